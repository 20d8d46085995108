"""The one renderer of the benchmarks: Markdown for every ``bench_*.py`` script's results
(and the PNG plot of ``bench_linear.py``'s); the scripts call it after measuring.

Also usable on its own to re-render results files (the renderer is picked from the
file name: ``linear_*``, ``checks_*``, ``cpp_extension_per_device_*``, ``cpp_extension_*``,
``forward_mode_*``)::

    python benchmarks/report.py benchmarks/results/linear_cpu.json
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
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


# -- bench_checks.py ----------------------------------------------------------------------


def render_checks(results: dict[str, Any]) -> str:
    med = statistics.median
    lines = ["# jaxext checks: timings", ""]
    machine = results["machine"]
    lines.append(
        f"Machine: {machine.get('cpu_model')}, {machine.get('usable_cpus')} usable CPUs. "
        f"{results['note']} Load average (1 min) before/after: "
        f"{results['load_average']['before'][0]:.1f} / {results['load_average']['after'][0]:.1f}."
    )
    g = results["gradcheck"]
    lines += ["", f"## gradcheck vs torch.autograd.gradcheck ({g['problem']})", ""]
    lines += [
        "Cold: the first call in a fresh process (library initialised, nothing compiled). "
        "Warm: later calls on the same inputs. jaxext compiles its programs on every call "
        "(it caches nothing, so a verdict never comes from a stale compilation); torch "
        "compiles nothing.",
        "",
        "| checker | cold median s | warm median s | runs |",
        "|---|---|---|---|",
    ]
    names = {"jaxext": "jaxext.gradcheck"}
    if "torch_version" in g:
        threads = f", threads: {g['torch_threads']}" if "torch_threads" in g else ""
        names["torch"] = f"torch.autograd.gradcheck ({g['torch_version']}{threads})"
    for key, name in names.items():
        cold, warm = g[f"{key}_cold_s"], g[f"{key}_warm_s"]
        lines.append(f"| {name} | {med(cold):.3f} | {med(warm):.3f} | {len(cold)} |")
    if "torch" in names:
        ratio_cold = med(g["torch_cold_s"]) / med(g["jaxext_cold_s"])
        ratio_warm = med(g["torch_warm_s"]) / med(g["jaxext_warm_s"])
        lines += [
            "",
            f"torch time / jaxext time: cold {ratio_cold:.2f}x, warm {ratio_warm:.2f}x "
            "(issue #20: never slower than torch cold at small sizes; at least 5x from 5e7 "
            "entries, see the size sweep).",
        ]
    o = results["opcheck"]
    lines += ["", f"## opcheck battery ({o['problem']})", ""]
    lines.append(
        f"Total: median {med(o['total_s']):.1f} s over {len(o['total_s'])} runs "
        "(issue #20's target: under 3.5 s, on an idle machine)."
    )
    lines += ["", "| check | status | median s |", "|---|---|---|"]
    for name, seconds in o["per_check_s"].items():
        lines.append(f"| {name} | {o['statuses'][name]} | {seconds:.2f} |")
    if results.get("sweep"):
        lines += _render_sweep(results["sweep"])
    if results.get("large"):
        lines += ["", "## gradcheck on large problems (full element-by-element method)", ""]
        lines += ["| problem | inputs x outputs | Jacobian entries | s | peak RSS so far (GiB) |"]
        lines += ["|---|---|---|---|---|"]
        for row in results["large"]:
            lines.append(
                f"| {row['problem']} | {row['inputs']} x {row['outputs']} | "
                f"{row['entries']:.2e} | {row['seconds']:.1f} | {row['peak_rss_gib_so_far']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def _torch_threads_text(rows: list[dict[str, Any]]) -> str:
    """The intra-op threads torch ran with in the sweep, as recorded by its processes."""
    threads = sorted({row["torch"]["threads"] for row in rows if "threads" in row.get("torch", {})})
    return " / ".join(str(t) for t in threads) if threads else "(not recorded)"


def _render_sweep(rows: list[dict[str, Any]]) -> list[str]:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [
        "",
        "## Size sweep: full element-by-element check, jaxext vs torch (linear, float64)",
        "",
        "x s x s, w 1.5s x s: `jaxext.gradcheck(jaxext.linear, (x, w), fast_mode=False)` and "
        "`torch.autograd.gradcheck(F.linear, (x, w), fast_mode=False)`, both comparing every "
        "Jacobian entry. Each run is a fresh process, jaxext's then torch's at each size, "
        f"in {_rounds_text(rows)} rounds (paired: both see the same machine load, given as "
        "the median 1-minute load average when the processes started); times are the "
        "medians of the rounds. Cold: the process's first call; warm: a second call "
        "(run only after a short first one). Ratio: torch time / jaxext time, cold: the "
        "median of the rounds' ratios (each round's in the last column). Peak RSS: the "
        "whole process's, JAX or torch included. torch is not run (-) where its time, "
        "extrapolated from the previous size by the number of entries, exceeds the limit. "
        f"torch runs with {_torch_threads_text(rows)} intra-op threads "
        "(`--torch-threads`; its default is one per core): on an idle machine its default "
        "was about 10% faster than one thread (4.9-5.6 s against 5.4-6.1 s at s = 60, "
        "paired runs), on a loaded one several times slower (1.7 s against 4.5 s at "
        "s = 13, one measurement). JAX keeps its defaults; jaxext's checks run their "
        "chunks on one thread more than there are cores.",
        "",
        "| s | inputs x outputs | entries | jaxext cold s | jaxext warm s | torch cold s | "
        "torch warm s | ratio cold | ratio warm | jaxext peak RSS GiB | torch peak RSS GiB | "
        "load (jaxext / torch) | ratio cold per round |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        j, t = row["jaxext"], row.get("torch")
        ratios = row.get("ratio_cold_rounds") or ([t["cold_s"] / j["cold_s"]] if t else [])
        ratio_cold = f"{statistics.median(ratios):.1f}x" if ratios else "-"
        each = " / ".join(f"{r:.2f}" for r in ratios) or "-"
        ratio_warm = (
            f"{t['warm_s'] / j['warm_s']:.1f}x" if t and t["warm_s"] and j["warm_s"] else "-"
        )
        s = row["problem"].split(" ")[2].split("x")[0]
        torch_rss = f"{t['peak_rss_gib']:.2f}" if t else "-"
        torch_load = f"{t['load_before']:.1f}" if t else "-"
        lines.append(
            f"| {s} | {row['inputs']} x {row['outputs']} | {row['entries']:.2e} | "
            f"{seconds(j['cold_s'])} | {seconds(j['warm_s'])} | "
            f"{seconds(t['cold_s'] if t else None)} | {seconds(t['warm_s'] if t else None)} | "
            f"{ratio_cold} | {ratio_warm} | {j['peak_rss_gib']:.2f} | {torch_rss} | "
            f"{j['load_before']:.1f} / {torch_load} | {each} |"
        )
    return lines


def _rounds_text(rows: list[dict[str, Any]]) -> str:
    """How many paired rounds the sweep ran (one in runs recorded before rounds)."""
    counts = sorted({len(row["jaxext"].get("rounds", ())) or 1 for row in rows})
    return " / ".join(str(c) for c in counts)


# -- bench_cpp_extension.py ---------------------------------------------------------------

MUL_TARGET = 0.5  # C++ mul_constant throughput / XLA multiply throughput at 16M elements


def render_cpp_per_device(results: dict[str, Any]) -> str:
    m = results["machine"]
    work = results["per_device_work"]
    n, batch, feat = work["devices"], work["batch"], work["features"]
    lines = [
        f"# jaxext C++ kernels: per-device work on a batch-sharded input ({n} CPU devices)",
        "",
        f"jax {m['jax']}, jaxlib {m['jaxlib']}, {m['date_utc']}. x: ({batch}, {feat}) float32 "
        f"split over `data` (P('data')), w: ({feat}, {feat}) and b replicated; explicit "
        "axes under `jax.set_mesh`. Elements read (operands) and written (results) by the "
        "`jaxext_*` custom calls of one device's compiled program, before (no `partition` "
        "rule) and after (the rules `ops` ships); the ideal share of the batch is 1/"
        f"{n}. XLA's `cost_analysis()` reports -1 (unknown) for custom calls, so the "
        "elements are read from the compiled HLO.",
        "",
        "| program | kernel | before: result elems | after: result elems | after/before | "
        "before: operand elems | after: operand elems | all-gathers before -> after |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for program, before in work["before"].items():
        after = work["after"][program]
        gathers = f"{before['all_gathers']} -> {after['all_gathers']}"
        for cb, ca in zip(before["calls"], after["calls"], strict=True):
            ratio = ca["result_elements"] / cb["result_elements"]
            lines.append(
                f"| {program} | {cb['kernel']} | {cb['result_elements']:,} | "
                f"{ca['result_elements']:,} | {ratio:.3f} | {cb['operand_elements']:,} | "
                f"{ca['operand_elements']:,} | {gathers} |"
            )
    lines += [
        "",
        f"Before, every device runs each kernel on the whole batch of {batch} rows "
        "(after gathering it); after, on its own "
        f"{batch // n} rows: the batch-shaped results shrink to 1/{n}. The weight and "
        "bias gradients of the backward keep their full (replicated) size: each device "
        "computes its partial sum, and one all-reduce adds them, as in plain autodiff.",
    ]
    return "\n".join(lines) + "\n"


def render_cpp_extension(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        f"# jaxext C++ kernels vs XLA ({m['jax_backend']}, {m['cpu_model']}, "
        f"{m['usable_cpus']} usable CPUs)",
        "",
        f"jax {m['jax']}, jaxlib {m['jaxlib']}, {m['date_utc']}; load average at start "
        f"{m['loadavg_start']}. Medians over interleaved rounds; ratios are medians of "
        "per-round ratios [25th-75th percentile].",
        "",
        "## mul_constant (float32), GB/s (one read + one write per element)",
        "",
        "| elements | C++ GB/s | XLA GB/s | C++/XLA throughput | target |",
        "|---:|---:|---:|---:|---|",
    ]
    for r in results["mul_constant"]:
        q = r["throughput_ratio"]
        target = ""
        if r["elements"] == 2**24:
            target = f">= {MUL_TARGET}: {'met' if q['median'] >= MUL_TARGET else 'MISSED'}"
        lines.append(
            f"| {r['elements']:,} | {r['cpp']['rate']:.1f} | {r['xla']['rate']:.1f} | "
            f"{q['median']:.2f} [{q['p25']:.2f}-{q['p75']:.2f}] | {target} |"
        )
    lines += [
        "",
        "## linear (float32), GFLOP/s",
        "",
        "| B x I -> O | pass | C++ GFLOP/s | XLA GFLOP/s | C++/XLA time | max rel diff |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in results["linear"]:
        b, i, o = r["size"]
        for kind in ("forward", "fwd_bwd"):
            k = r[kind]
            q = k["time_ratio_cpp_over_xla"]
            lines.append(
                f"| {b} x {i} -> {o} | {kind} | {k['cpp']['rate']:.1f} | {k['xla']['rate']:.1f} "
                f"| {q['median']:.2f} [{q['p25']:.2f}-{q['p75']:.2f}] | "
                f"{r['max_rel_diff_vs_xla']:.1e} |"
            )
    return "\n".join(lines) + "\n"


# -- bench_forward_mode.py --------------------------------------------------------------


def fm_size(size: Sequence[int]) -> str:
    return f"{size[0]}x{size[1]}->{size[2]}"


def _min_ratio(row: dict[str, Any]) -> str:
    return "n/a" if "min_ratio" not in row else f"{row['min_ratio']:.3f}"


def _met(row: dict[str, Any]) -> str:
    return "met" if row["met"] else "**missed**"


def _same(h: dict[str, Any]) -> str:
    if h["same_opcodes"]:
        if "same_signature" not in h:  # results written before the shape check existed
            return "yes (opcodes)"
        return "yes" if h["same_signature"] else "ops (shapes differ)"
    diff = ", ".join(f"{k} {a}/{b}" for k, (a, b) in h["opcode_diff"].items() if k != "parameter")
    return f"no ({diff})"


def _flops(h: dict[str, Any]) -> str:
    j, a = h["flops"]["jaxext"], h["flops"]["autodiff"]
    if j is None or a is None:
        return "n/a"
    return "equal" if j == a else f"{j / max(a, 1.0):.3f}x"


def run_header(title: str, results: dict[str, Any], digits: int = 2, end: str = ".  ") -> list[str]:
    """Title, command, machine and date lines of a results file (``end`` closes the last)."""
    m = results["machine"]
    start, stop = (fmt_load(m[k], digits) for k in ("loadavg_start", "loadavg_end"))
    return [
        title,
        "",
        f"Command: `{results['command']}`  ",
        f"Machine: {m['cpu_model']}, {m['usable_cpus']} usable of {m['logical_cpus']} logical "
        f"CPUs; JAX backend `{m['jax_backend']}`; jax {m['jax']} / jaxlib {m['jaxlib']}; "
        f"Python {m['python']}  ",
        f"Date (UTC): {m['date_utc']}; wall time {results['wall_s']:.0f} s; load average "
        f"(1/5/15 min) at start {start}, at end {stop}{end}",
    ]


def render_forward_mode(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = [
        *run_header("# Forward mode through jaxext ops: benchmark results (cpu)", results),
        f"float32; up to {s['rounds']} interleaved rounds per comparison (at least "
        f"{s['min_rounds']}, fewer when {s['budget_s']:.0f} s of measurement are used up); "
        f"{s['warmup']} warm-up calls; ~{s['target_s'] * 1e3:.0f} ms per measurement.",
        "",
        "**Noisy**: the machine is shared with other jobs (the load average, above and per "
        "row, counts runnable processes on its cores). Ratios are medians of per-round "
        "ratios of interleaved measurements, so a slowdown hitting both sides of a round "
        "cancels; absolute times do not. `min ratio` divides the two sides' fastest "
        "measurements (the least disturbed rounds): a second view, the targets use the median. "
        "Where both programs compile to the same HLO "
        "(`same HLO` = yes) a ratio away from 1 is noise; the A/A control below measures it.",
        "",
    ]
    if results.get("note"):
        lines += [f"Note: {results['note']}", ""]
    lines += [
        "## Jitted: jaxext op vs plain autodiff of the same math",
        "",
        "Models: `jaxext.linear` and `Function linear` in a two-layer MLP "
        "`linear(tanh(linear(x, w1, b1)), w2, b2)` (size = batch x in -> out; w2 is "
        "out x out); `mul_constant` in `mul(tanh(mul(x, c)), c')`. "
        "`jvp`: all arguments perturbed; `jacfwd`: one example's output w.r.t. its input; "
        "`hvp`: `jvp(grad(loss))` w.r.t. the parameters (forward-over-reverse); `hessian`: "
        "`jax.hessian(loss)` (small sizes); `grad`: `jax.grad(loss)`. Loss: mean squared "
        "error. Ratio = jaxext / autodiff time, below 1 means jaxext is faster; dots = `dot` "
        "instructions in the optimised HLO (jaxext / autodiff); flops = XLA's estimate; same "
        "HLO: yes = the same multiset of (opcode, result shape) over all computations, "
        "fused ones included; otherwise the opcodes whose counts differ (jaxext/autodiff).",
        "",
        "| op | mode | size | jaxext ms | autodiff ms | ratio [p25-p75] | min ratio | target "
        "| status | dots | flops | same HLO | rounds | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["jitted"]:
        d = row["hlo"]["dots"]
        lines.append(
            f"| {row['op']} | {row['mode']} | {fm_size(row['size'])} | "
            f"{_ms(row['time']['jaxext'])} | {_ms(row['time']['autodiff'])} | "
            f"{_ratio(row['ratio'])} | {_min_ratio(row)} | <= {row['target']:.2f} | {_met(row)} | "
            f"{d['jaxext']} / {d['autodiff']} | {_flops(row['hlo'])} | "
            f"{_same(row['hlo'])} | {row['rounds']} | "
            f"{row['loadavg_before'][0]:.1f} |"
        )
    if results["eager"]:
        lines += [
            "",
            "## Eager (un-jitted) calls",
            "",
            "One call of the op on concrete arrays, against the plain expression, both "
            "ending in `block_until_ready`. The issue's bound is for `jaxext.linear` and "
            "`Function.apply`; `mul_constant` is held to the same bound here.",
            "",
            "| op | against | size | op ms | plain ms | ratio [p25-p75] | min ratio | target "
            "| status | rounds | load |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in results["eager"]:
            lines.append(
                f"| {row['op']} | `{row['against']}` | {fm_size(row['size'])} | "
                f"{_ms(row['time']['jaxext'])} | {_ms(row['time']['autodiff'])} | "
                f"{_ratio(row['ratio'])} | {_min_ratio(row)} | <= {row['target']:.2f} | "
                f"{_met(row)} | {row['rounds']} | {row['loadavg_before'][0]:.1f} |"
            )
    if results.get("control"):
        lines += [
            "",
            "## A/A control: the noise floor",
            "",
            "The plain-autodiff program of the linear MLP timed against a second `jit` of "
            "itself, same protocol. Both sides run the same executable: how far these ratios "
            "stray from 1 is what noise alone does to a ratio in this run.",
            "",
            "| mode | size | ms | ratio [p25-p75] | min ratio | rounds | load |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in results["control"]:
            lines.append(
                f"| {row['mode']} | {fm_size(row['size'])} | {_ms(row['time']['autodiff'])} | "
                f"{_ratio(row['ratio'])} | {_min_ratio(row)} | {row['rounds']} | "
                f"{row['loadavg_before'][0]:.1f} |"
            )
    for name, prof in (results.get("eager_profile") or {}).items():
        lines += [
            "",
            f"## Where an eager `{name}` call spends its time",
            "",
            f"cProfile of {prof['calls']} calls at 32x64->64; microseconds per call, profiler "
            "overhead included (so larger than the timings above). Top entries by cumulative "
            "time, then the largest self times.",
            "",
            "| function | calls per op | self us | cumulative us |",
            "|---|---|---|---|",
        ]
        shown = prof["top_cumulative"][:15]
        shown += [e for e in prof["top_self"][:8] if e not in shown]
        for e in shown:
            lines.append(
                f"| `{e['function']}` | {e['calls_per_op']:g} | {e['self_us_per_op']:.1f} | "
                f"{e['cum_us_per_op']:.1f} |"
            )
    met = [r["met"] for r in results["jitted"] + results["eager"]]
    has_signature = all("same_signature" in r["hlo"] for r in results["jitted"])
    same = sum(
        r["hlo"]["same_opcodes"] and r["hlo"].get("same_signature", True) for r in results["jitted"]
    )
    what = "the same (opcode, shape) multiset" if has_signature else "identical opcode histograms"
    dots = sum(
        r["hlo"]["dots"]["jaxext"] == r["hlo"]["dots"]["autodiff"] for r in results["jitted"]
    )
    n = len(results["jitted"])
    lines += [
        "",
        "## Summary",
        "",
        f"- Targets met: {sum(met)} of {len(met)}.",
        f"- Equal `dot` counts in {dots} of {n} jitted pairs; {what} in {same} of {n}.",
        f"- Largest relative difference of a jaxext result from autodiff's: "
        f"{max([r['max_rel_err_vs_autodiff'] for r in results['jitted']] or [0.0]):.2e}.",
    ]
    if results.get("control"):
        ctrl = [r["ratio"]["median"] for r in results["control"]]
        if all("min_ratio" in r for r in results["jitted"]):
            mins = [r["min_ratio"] for r in results["jitted"]]
            lines.append(
                f"- Min ratios (fastest against fastest) of the jitted pairs: {min(mins):.3f} to "
                f"{max(mins):.3f}; above 1.05 in {sum(m > 1.05 for m in mins)} of {len(mins)}."
            )
        lines.append(
            f"- A/A control (identical programs): median ratios from {min(ctrl):.3f} to "
            f"{max(ctrl):.3f}; a jaxext/autodiff ratio inside that range is not a measured "
            "difference."
        )
    lines.append("")
    return "\n".join(lines)


def render_eager(results: dict[str, Any]) -> str:
    """Markdown for ``bench_eager.py``'s results."""
    title = "# Eager autodiff through jaxext.custom_vjp: benchmark results (cpu)"
    lines = [*run_header(title, results, digits=1, end="."), ""]
    if results.get("note"):
        lines += [f"Note: {results['note']}", ""]
    lines += [
        "Un-jitted calls on concrete float32 arrays, each ending in `block_until_ready`. "
        "`grad`: `jax.grad` of `sum(linear(x, w, b))` w.r.t. x, w, b, with the same "
        "`fwd`/`bwd` on `jaxext.custom_vjp` and on `jax.custom_vjp`. `jvp`: `jax.jvp` of "
        "`linear` (all inputs perturbed) through `jaxext.custom_vjp` (forward mode derived "
        "from `bwd`) against plain autodiff of `x @ w + b`. `Function grad`/`Function jvp`: the "
        "same calls with the same rules as a `jaxext.Function`, against the `jaxext.custom_vjp` "
        "op. `linearize`: an eager call of the function `jax.linearize` returns (in x) through "
        "`jaxext.linear` against plain autodiff of `x @ w.T + b`. Ratio = median of per-round time "
        "ratios of interleaved measurements [25th-75th percentile]; `min ratio` divides the "
        "fastest measurements. The machine is shared: compare ratios, not milliseconds.",
        "",
        "| mode | size | against | jaxext ms | reference ms | ratio [p25-p75] | min ratio "
        "| target | status | rounds | load | max rel err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    if not results["time"]:
        lines.append("| (not run: `--no-time`) | | | | | | | | | | | |")
    for r in results["time"]:
        t, q = r["time"], r["ratio"]
        lines.append(
            f"| {r['mode']} | {fm_size(r['size'])} | {r['against']} "
            f"| {t['jaxext']['median_ms']:.3f} | {t['reference']['median_ms']:.3f} "
            f"| {q['median']:.2f} [{q['p25']:.2f}-{q['p75']:.2f}] | {r['min_ratio']:.2f} "
            f"| <= {r['target']} | {'met' if r['met'] else 'NOT met'} | {r['rounds']} "
            f"| {r['loadavg_before'][0]:.1f} | {r['max_rel_err']:.1e} |"
        )
    lines += [
        "",
        "## Memory: eager calls with a new Python constant each",
        "",
        "Resident set size growth after 20 warm-up calls; `compiles` = XLA compilations "
        "during the calls; `trace` = (calls, MiB) at every tenth of the run.",
        "",
        "| op | calls | RSS growth MiB | ms per call | compiles | trace |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["memory"]:
        if "error" in r:
            lines.append(f"| {r['op']} | - | - | - | - | not run: `{r['error']}` |")
            continue
        trace = ", ".join(f"{n}: {g:+}" for n, g in r["trace"])
        lines.append(
            f"| {r['op']} | {r['calls']} | {r['growth_mib']:+} | {r['ms_per_call']:.2f} "
            f"| {r.get('compiles', '-')} | {trace} |"
        )
    return "\n".join(lines) + "\n"


def fmt_load(load: list[float] | None, digits: int = 2) -> str:
    return "n/a" if not load else "/".join(f"{v:.{digits}f}" for v in load)


RENDERERS = {  # results file name prefix -> renderer (longest prefix first)
    "cpp_extension_per_device": render_cpp_per_device,
    "cpp_extension": render_cpp_extension,
    "forward_mode": render_forward_mode,
    "checks": render_checks,
    "eager": render_eager,
    "linear": markdown,
}


def render(path: Path) -> Path:
    """Re-writes the ``.md`` (and for ``linear_*`` the ``.png``) of a results JSON."""
    data = json.loads(path.read_text())
    name = next(n for n in RENDERERS if path.stem.startswith(n))
    path.with_suffix(".md").write_text(RENDERERS[name](data))
    if name == "linear":
        plot(data, path.with_suffix(".png"))
    return path.with_suffix(".md")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(f"re-rendered {render(Path(arg))}")
