"""Markdown tables and the PNG plot for the results of ``bench_linear.py``.

Also usable on its own to re-render a results file::

    python benchmarks/report.py benchmarks/results/linear_cpu.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchlib import fmt_bytes

TORCH = ("torch_function", "torch_F.linear", "torch_compile")
LABELS = {
    "jaxext": "jaxext.linear",
    "jax_autodiff": "JAX autodiff",
    "torch_function": "torch Function",
    "torch_F.linear": "torch F.linear",
    "torch_compile": "torch.compile",
    "matmul": "jnp matmul",
}


def _size(row: dict[str, Any]) -> str:
    if "width" in row:
        return f"{row['batch']}x{row['width']} (x{row['depth']})"
    return f"{row['batch']}x{row['in']}x{row['out']}"


def _ratio(r: dict[str, float] | None) -> str:
    if r is None:
        return "n/a"
    return f"{r['median']:.3f} [{r['p25']:.2f}-{r['p75']:.2f}]"


def _ms(t: dict[str, float] | None) -> str:
    if t is None:
        return "n/a"
    ms = t["median_ms"]
    return f"{ms:.3f}" if ms < 10 else f"{ms:.1f}"


def _rate(t: dict[str, float] | None, scale: float = 1.0) -> str:
    return "n/a" if t is None else f"{t['rate'] * scale:.1f}"


def _res(r: dict[str, Any]) -> str:
    """Residual bytes, with the part not aliasing an input buffer in parentheses."""
    new = r.get("new_bytes")
    return fmt_bytes(r["bytes"]) + ("" if new is None else f" ({fmt_bytes(new)} new)")


def _load(row: dict[str, Any]) -> str:
    load = row.get("loadavg_before")
    return "n/a" if not load else f"{load[0]:.1f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines + [""]


def machine_line(m: dict[str, Any]) -> str:
    parts = [
        f"{m['cpu_model']}, {m['usable_cpus']} usable of {m['logical_cpus']} logical CPUs",
        f"{m['memory_gib']} GiB RAM",
        f"JAX backend `{m['jax_backend']}` ({', '.join(m['jax_devices'])})",
        f"jax {m['jax']} / jaxlib {m['jaxlib']} / flax {m['flax']} / optax {m['optax']}",
        f"torch {m['torch'] or 'not installed'} ({m.get('torch_threads')} threads)",
        f"Python {m['python']}, {m['platform']}",
    ]
    return "; ".join(parts)


def markdown(res: dict[str, Any]) -> str:
    m, s = res["machine"], res["settings"]
    gpu = s["mode"] != "cpu"
    unit, scale = ("TFLOP/s", 1e-3) if gpu else ("GFLOP/s", 1.0)
    out = [f"# jaxext benchmark results ({s['mode']}{', quick' if s['quick'] else ''})", ""]
    out += [f"Command: `python benchmarks/{res['command']}`  ", f"Machine: {machine_line(m)}  "]
    load = (m.get("loadavg_start"), m.get("loadavg_end"))
    out += [
        f"Date (UTC): {m['date_utc']}; wall time {res['wall_s']:.0f} s; "
        f"load average (1/5/15 min) at start {load[0]}, at end {load[1]}.  ",
        f"dtype {s['dtype']}; rounds per size and group up to {s['rounds']} (at least "
        f"{s['min_rounds']}, fewer when the group's time budget of {s['budget_s']:.0f} s is "
        f"reached); {s['warmup']} warm-up calls; ~{s['target_s'] * 1e3:.0f} ms per measurement, "
        "each preceded by one untimed call.",
    ]
    if res.get("note"):
        out += ["", f"Note: {res['note']}"]
    if s["mode"] == "gpu-smoke":
        out += ["", "**Smoke test of the GPU code path on a non-GPU backend: not a GPU result.**"]
    out += [""]
    out += _linear_section(res, unit, scale, gpu)
    out += _costs_section(res)
    out += _mlp_section(res, unit, scale)
    out += _mul_section(res)
    out += _targets_section(res)
    return "\n".join(out)


def _linear_section(res: dict[str, Any], unit: str, scale: float, gpu: bool) -> list[str]:
    rows = res["linear"]["rows"]
    if not rows:
        return []
    out = ["## Linear forward + backward (`jit(value_and_grad)` w.r.t. x, w, b)", ""]
    out += [
        "Time per call in ms (median over rounds); ratio = median of per-round time ratios "
        "[25th-75th percentile]; below 1 means jaxext is faster. "
        f"Throughput counts 6*B*I*O flops per call, in {unit}. The JAX contenders are timed "
        "in one interleaved group; the PyTorch ones in a second group together with jaxext "
        "(the jaxext/torch ratios come from that group).",
        "",
    ]
    header = ["B x I x O", "jaxext ms", "autodiff ms", "jaxext / autodiff", f"jaxext {unit}"]
    header += ["rounds", "load avg"]
    if gpu:
        header += ["matmul " + unit, "jaxext / matmul rate"]
    body = []
    for r in rows:
        t = r["time"]
        line = [_size(r), _ms(t["jaxext"]), _ms(t["jax_autodiff"])]
        line += [_ratio(r["ratio"]["jaxext/jax_autodiff"]), _rate(t["jaxext"], scale)]
        line += [str(r["rounds"]["jax"]), _load(r)]
        if gpu:
            line += [_rate(t.get("matmul"), scale), f"{r['efficiency_vs_matmul']['jaxext']:.1%}"]
        body.append(line)
    out += _table(header, body)
    torch_cols = [k for k in TORCH if any(k in r["time"] for r in rows)]
    if torch_cols:
        out += ["### Against PyTorch (same machine, eager unless noted)", ""]
        header = ["B x I x O", "jaxext ms (this group)"] + [f"{LABELS[k]} ms" for k in torch_cols]
        header += [f"jaxext / {LABELS[k]}" for k in torch_cols]
        header += [f"best torch {unit}", "rounds"]
        body = []
        for r in rows:
            t = r["time"]
            line = [_size(r), _ms(r.get("ref_time_in_torch_group"))]
            line += [_ms(t.get(k)) for k in torch_cols]
            line += [_ratio(r["ratio"].get(f"jaxext/{k}")) for k in torch_cols]
            best = max((t[k]["rate"] for k in torch_cols if k in t), default=None)
            line += ["n/a" if best is None else f"{best * scale:.1f}"]
            line += [str(r["rounds"].get("torch", "n/a"))]
            body.append(line)
        out += _table(header, body)
    tc = res["linear"]["torch_compile"]
    if tc.get("ok") is False:
        out += [f"torch.compile failed here: `{tc.get('error', '')[:300]}`", ""]
    elif tc.get("ok"):
        firsts = ", ".join(f"{k}: {v:.1f} s" for k, v in tc.get("first_call_s", {}).items())
        out += [f"torch.compile (Inductor) worked; first call incl. compilation: {firsts}.", ""]
    else:
        out += ["torch.compile not run (disabled for this run or torch missing).", ""]
    errs = [r["max_rel_err_vs_autodiff"] for r in rows]
    out += [f"Max relative gradient difference jaxext vs autodiff: {max(errs):.2e}.", ""]
    return out


def _costs_section(res: dict[str, Any]) -> list[str]:
    rows = res["linear_costs"]
    if not rows:
        return []
    out = ["## Linear: compile time, compiled temp memory, saved residuals", ""]
    out += [
        "Compile = cold `jit(...).lower(...)` + `.compile()` of a freshly built function after "
        "`jax.clear_caches()`, interleaved repeats, median. Temp = "
        "`compiled.memory_analysis().temp_size_in_bytes` of the fwd+bwd step. Residuals = "
        "bytes of the arrays held by the closure `jax.vjp` returns, in parentheses the part "
        "that does not share a buffer with an input (torch: bytes of the tensors autograd "
        "saves, via `saved_tensors_hooks`). Eager `jax.vjp` of any `custom_vjp` function "
        "hands back *copies* of residuals that are inputs (JAX behaviour; under `jax.jit` "
        "they are references), while plain autodiff references `x` and materialises `w.T`; "
        "inside a jitted training step neither exists and the compiled temp memory is the "
        "figure that matters.",
        "",
    ]
    header = ["B x I x O", "compile ms jaxext", "compile ms autodiff", "ratio"]
    header += ["temp jaxext", "temp autodiff", "residuals jaxext", "residuals autodiff"]
    has_torch = any("torch_saved_bytes" in r for r in rows)
    if has_torch:
        header += ["saved torch Function", "saved F.linear"]
    body = []
    for r in rows:
        c, mem, rs = r["compile"], r["memory"], r["residuals"]
        line = [_size(r), f"{c['jaxext']['total_ms']:.1f}", f"{c['jax_autodiff']['total_ms']:.1f}"]
        line += [_ratio(c["ratio"])]
        line += [fmt_bytes(mem[k]["temp_size_in_bytes"]) for k in ("jaxext", "jax_autodiff")]
        line += [_res(rs[k]) for k in ("jaxext", "jax_autodiff")]
        if has_torch:
            tb = r.get("torch_saved_bytes", {})
            line += [fmt_bytes(tb.get(k)) for k in ("torch_function", "torch_F.linear")]
        body.append(line)
    return out + _table(header, body)


def _mlp_section(res: dict[str, Any], unit: str, scale: float) -> list[str]:
    mlp = res["mlp"]
    if mlp.get("skipped"):
        return ["## MLP training step", "", f"Skipped: {mlp['skipped']}", ""]
    rows = mlp.get("rows", [])
    fails = mlp.get("failures", [])
    if not rows and not fails:
        return []
    out = ["## MLP training step (ReLU MLP, Adam, `nnx.jit`)", ""]
    for f in fails:
        out += [f"**Failed at batch {f['batch']} x width {f['width']}:** `{f['error'][:400]}`", ""]
    if not rows:
        return out
    out += [
        "Same weights (same `nnx.Rngs`) for both layers; torch uses `nn.Linear` + "
        "`torch.optim.Adam` eagerly. Size = batch x width (x layers).",
        "",
    ]
    has_torch = any("torch_nn.Linear" in r["time"] for r in rows)
    header = ["size", "jaxext.nnx ms", "flax.nnx ms", "jaxext.nnx / flax.nnx"]
    if has_torch:
        header += ["jaxext.nnx ms (torch group)", "torch ms", "jaxext.nnx / torch"]
    header += [f"jaxext.nnx {unit}", "compile ratio", "of which lowering ratio"]
    header += ["temp jaxext / flax", "residuals j / f"]
    header += ["load avg"]
    body = []
    for r in rows:
        t = r["time"]
        line = [_size(r), _ms(t["jaxext.nnx"]), _ms(t["flax.nnx"])]
        line += [_ratio(r["ratio"]["jaxext.nnx/flax.nnx"])]
        if has_torch:
            line += [
                _ms(r.get("ref_time_in_torch_group")),
                _ms(t.get("torch_nn.Linear")),
                _ratio(r["ratio"].get("jaxext.nnx/torch_nn.Linear")),
            ]
        line += [_rate(t["jaxext.nnx"], scale), _ratio(r["compile"]["ratio"])]
        line += [_ratio(r["compile"].get("lower_ratio"))]
        mem, rs = r["memory"], r["residuals"]
        line += [
            f"{fmt_bytes(mem['jaxext.nnx']['temp_size_in_bytes'])} / "
            f"{fmt_bytes(mem['flax.nnx']['temp_size_in_bytes'])}",
            f"{_res(rs['jaxext.nnx'])} / {_res(rs['flax.nnx'])}",
            _load(r),
        ]
        body.append(line)
    out += _table(header, body)
    errs = [r["max_rel_err_grads"] for r in rows]
    return out + [f"Max relative parameter-gradient difference at init: {max(errs):.2e}.", ""]


def _mul_section(res: dict[str, Any]) -> list[str]:
    rows = res["mul_constant"]
    if not rows:
        return []
    out = ["## mul_constant (`x * 2.0`): bandwidth", ""]
    out += [
        "GB/s counts one read and one write of the array. fwd = `jit(mul)`, bwd = the jitted "
        "VJP applied to a cotangent; copy = `jit(jnp.copy)` measured in the same rounds.",
        "",
    ]
    header = ["elements", "jaxext fwd GB/s", "jnp fwd GB/s", "jaxext bwd GB/s", "jnp bwd GB/s"]
    header += ["copy GB/s", "fwd ratio", "bwd ratio", "jaxext fwd / copy"]
    body = []
    for r in rows:
        t = r["time"]
        line = [f"{r['n']:,}"] + [
            f"{t[k]['rate']:.2f}"
            for k in ("jaxext_fwd", "jnp_fwd", "jaxext_bwd", "jnp_bwd", "copy")
        ]
        line += [_ratio(r["ratio"]["jaxext_fwd/jnp_fwd"]), _ratio(r["ratio"]["jaxext_bwd/jnp_bwd"])]
        line += [f"{r['fraction_of_copy']['jaxext_fwd']:.1%}"]
        body.append(line)
    return out + _table(header, body)


def _targets_section(res: dict[str, Any]) -> list[str]:
    checks = res["targets"]
    if not checks:
        return []
    out = ["## Targets", ""]
    body = []
    for c in checks:
        v = c["value"]
        val = f"{v:.3f}" if isinstance(v, float) else str(v)
        body.append([c["target"], val, c["limit"], "met" if c["met"] else "**missed**"])
    out += _table(["target", "value", "limit", ""], body)
    missed = sum(not c["met"] for c in checks)
    out += [f"{len(checks) - missed} of {len(checks)} targets met.", ""]
    return out


COLORS = {
    "jaxext": "C0",
    "jax_autodiff": "C1",
    "torch_F.linear": "C2",
    "torch_function": "C3",
    "torch_compile": "C4",
    "mlp": "C5",
}


def _errorbar(ax: Any, xs: list[float], qs: list[dict[str, float]], **kw: Any) -> None:
    med = [q["median"] for q in qs]
    err = [[q["median"] - q["p25"] for q in qs], [q["p75"] - q["median"] for q in qs]]
    ax.errorbar(xs, med, yerr=err, capsize=3, **kw)


def plot(res: dict[str, Any], path: Path) -> None:
    """Three panels vs size: jaxext/JAX ratios, jaxext/PyTorch ratios, throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["linear"]["rows"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 5.4))
    gpu = res["settings"]["mode"] != "cpu"
    flops = [r["flops"] for r in rows]
    if rows:
        qs = [r["ratio"]["jaxext/jax_autodiff"] for r in rows]
        _errorbar(
            ax1,
            flops,
            qs,
            fmt="o-",
            color=COLORS["jax_autodiff"],
            label="linear fwd+bwd: jaxext.linear / JAX autodiff",
        )
    mlp = res["mlp"].get("rows", [])
    if mlp:
        _errorbar(
            ax1,
            [r["flops"] for r in mlp],
            [r["ratio"]["jaxext.nnx/flax.nnx"] for r in mlp],
            fmt="P--",
            color=COLORS["mlp"],
            label="MLP train step: jaxext.nnx / flax.nnx",
        )
    ax1.axhline(1.0, color="gray", lw=1)
    ax1.axhline(1.02, color="red", lw=1, ls=":", label="target 1.02")
    ax1.set_ylabel("time ratio (median of rounds, quartile bars)")
    ax1.set_title("jaxext vs JAX/Flax autodiff (< 1: jaxext faster)", fontsize=9)
    for key, style in (
        ("torch_F.linear", "s--"),
        ("torch_function", "^--"),
        ("torch_compile", "d:"),
    ):
        pts = [(f, r["ratio"].get(f"jaxext/{key}")) for f, r in zip(flops, rows, strict=True)]
        pts = [(f, q) for f, q in pts if q is not None]
        if pts:
            _errorbar(
                ax2,
                [f for f, _ in pts],
                [q for _, q in pts],
                fmt=style,
                color=COLORS[key],
                label=f"jaxext.linear / {LABELS[key]}",
            )
    ax2.axhline(1.0, color="gray", lw=1)
    ax2.set_yscale("log")
    ax2.set_ylabel("time ratio (log); < 1: jaxext faster")
    ax2.set_title("linear fwd+bwd: jaxext vs PyTorch (same machine)", fontsize=9)
    scale, unit = (1e-3, "TFLOP/s") if gpu else (1.0, "GFLOP/s")
    for key in ("jaxext", "jax_autodiff", "torch_F.linear", "torch_function", "torch_compile"):
        pts = [
            (f, r["time"][key]["rate"] * scale)
            for f, r in zip(flops, rows, strict=True)
            if key in r["time"]
        ]
        if pts:
            ax3.plot(
                [p[0] for p in pts], [p[1] for p in pts], "o-", color=COLORS[key], label=LABELS[key]
            )
    ax3.set_yscale("log")
    ax3.set_ylabel(f"linear fwd+bwd throughput ({unit}, 6*B*I*O flops)")
    ax3.set_title("throughput", fontsize=9)
    for ax in (ax1, ax2, ax3):
        ax.set_xscale("log")
        ax.set_xlabel("flops per fwd+bwd call (ticks: linear B x I x O)")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        if rows:
            ax.set_xticks(flops)
            ax.set_xticklabels([_size(r) for r in rows], rotation=30, fontsize=7)
            ax.minorticks_off()
    m = res["machine"]
    s = res["settings"]
    title = (
        f"jaxext benchmarks ({s['mode']}, {s['dtype']}) on {m['cpu_model']}, "
        f"{m['usable_cpus']} CPUs"
    )
    fig.suptitle(title, fontsize=10)
    fig.text(
        0.5,
        0.01,
        f"jax {m['jax']} / jaxlib {m['jaxlib']} / flax {m['flax']} / torch {m['torch']}; "
        f"{m['date_utc']}; load avg start {m.get('loadavg_start')}, end {m.get('loadavg_end')}",
        ha="center",
        fontsize=7,
    )
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        p = Path(arg)
        data = json.loads(p.read_text())
        p.with_suffix(".md").write_text(markdown(data))
        plot(data, p.with_suffix(".png"))
        print(f"re-rendered {p.with_suffix('.md')} and {p.with_suffix('.png')}")
