"""Benchmark jaxext's shipped ops on whatever accelerator is present (CPU too).

Run from the repository root::

    python benchmarks/bench_accelerator.py            # full sizes
    python benchmarks/bench_accelerator.py --quick    # tiny sizes, few rounds (smoke test)

For each shipped op (``linear``, ``mul_constant``, ``rms_norm``), the jitted forward +
backward (``value_and_grad`` of ``sum(op(...) * ct)`` with respect to every array input)
is timed against plain XLA autodiff of the same math; the Pallas RMSNorm is also timed
forward only against XLA's fused ``jnp`` RMSNorm. Before timing, each contender's values
and gradients are compared with the plain version (the largest relative difference is
stored). The device name, every time and every ratio (median over interleaved rounds of
jaxext's time / the plain time, with quartiles; see ``benchlib.py``) are printed and
written to ``benchmarks/results/accelerator_<backend>[_quick].{json,md}``.

The RMSNorm rows run ``jaxext.rms_norm``'s Pallas kernels explicitly
(``implementation="pallas"``: Triton on GPU, Mosaic on TPU), whatever the op's default. On
CPU, Pallas has no compiler: they run ``implementation="interpret"``, an emulation. Those rows
are labelled ``interpret mode`` and their times are not kernel timings; they are kept only to
show the script runs (``benchmarks/bench_rms_norm.py`` times the CPU default, plain XLA, against
Flax). This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository root: import jaxext without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxext  # noqa: E402

sys.path.insert(0, str(HERE))
import benchlib  # noqa: E402

# (name, jaxext op, plain jnp math, input shapes as a function of one size parameter)
FULL_SIZES = {
    "linear": [(256, 1024, 1024), (4096, 4096, 4096)],  # (batch, in, out)
    "mul_constant": [(1 << 20,), (1 << 26,)],  # elements
    "rms_norm": [(4096, 1024), (16384, 4096)],  # (rows, features)
}
QUICK_SIZES = {"linear": [(8, 16, 8)], "mul_constant": [(256,)], "rms_norm": [(16, 32)]}


def _rms_plain(x, w, eps=1e-6):
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * inv * w.astype(jnp.float32)).astype(jnp.result_type(x, w))


def _inputs(op: str, size: tuple[int, ...], dtype: Any) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(0), 3)
    if op == "linear":
        b, i, o = size
        shapes = [(b, i), (o, i), (o,)]
    elif op == "mul_constant":
        shapes = [size, ()]
    else:
        shapes = [size, size[-1:]]
    return tuple(
        jax.random.normal(k, s, jnp.float32).astype(dtype)
        for k, s in zip(keys, shapes, strict=False)
    )


def _rms_kernels(implementation: str) -> Callable:
    def rms_norm(x, w):
        return jaxext.rms_norm(x, w, implementation=implementation)

    return rms_norm


OPS: dict[str, tuple[Callable, Callable]] = {
    "linear": (jaxext.linear, lambda x, w, b: x @ w.T + b),
    "mul_constant": (jaxext.mul_constant, lambda x, c: x * c),
    "rms_norm": (_rms_kernels("pallas"), _rms_plain),  # "interpret" on CPU (see run)
}


def _value_and_grad(fn: Callable, n_args: int) -> Callable:
    def loss(*args):
        y = fn(*args)
        return jnp.sum(y.astype(jnp.float32) * jnp.cos(y.astype(jnp.float32)))

    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(n_args))))


def _compare(
    name: str, ours: Callable, plain: Callable, args: tuple, settings: argparse.Namespace
) -> dict[str, Any]:
    err = benchlib.max_rel_err(ours(*args), plain(*args))
    measured = benchlib.interleaved_times(
        {"jaxext": benchlib.blocking(ours, *args), "plain": benchlib.blocking(plain, *args)},
        rounds=settings.rounds,
        warmup=2,
        target_s=settings.target_s,
        budget_s=settings.budget_s,
        min_rounds=min(5, settings.rounds),
    )
    times = measured["times"]
    return {
        "name": name,
        "max_rel_err_vs_plain": err,
        "rounds": measured["rounds"],
        "jaxext": benchlib.time_summary(times["jaxext"]),
        "plain": benchlib.time_summary(times["plain"]),
        "ratio": benchlib.ratio_summary(times["jaxext"], times["plain"]),
    }


def run(settings: argparse.Namespace) -> dict[str, Any]:
    backend = jax.default_backend()
    device = jax.devices()[0]
    interpret = backend == "cpu"  # jaxext.rms_norm's kernels are interpreted on CPU
    dtype = jnp.dtype(settings.dtype)
    sizes = QUICK_SIZES if settings.quick else FULL_SIZES
    print(f"device: {device.device_kind} ({backend}), dtype {dtype.name}")
    if interpret:
        print("note: on CPU the Pallas rows run in interpret mode (an emulation, not a kernel)")
    rows = []
    for op, (ours_fn, plain_fn) in OPS.items():
        if settings.only and op not in settings.only:
            continue
        if op == "rms_norm" and interpret:
            ours_fn = _rms_kernels("interpret")
        for size in sizes[op]:
            args = _inputs(op, size, dtype)
            pallas = op == "rms_norm"
            label = (
                "interpret mode" if pallas and interpret else ("pallas kernel" if pallas else "")
            )
            cases = [
                (
                    "fwd+bwd",
                    _value_and_grad(ours_fn, len(args)),
                    _value_and_grad(plain_fn, len(args)),
                )
            ]
            if pallas:  # the Pallas forward against XLA's fused jnp version
                cases.append(("fwd", jax.jit(ours_fn), jax.jit(plain_fn)))
            for kind, ours, plain in cases:
                row = _compare(f"{op} {kind}", ours, plain, args, settings)
                row.update(op=op, kind=kind, size=list(size), pallas=pallas, label=label)
                if pallas:
                    row["implementation"] = "interpret" if interpret else "pallas"
                row["kernel_timing"] = not (pallas and interpret)
                rows.append(row)
                r = row["ratio"]
                note = f" [{label}: not a kernel timing]" if label == "interpret mode" else ""
                jaxext_ms, plain_ms = row["jaxext"]["median_ms"], row["plain"]["median_ms"]
                print(
                    f"{op:13s} {kind:8s} {str(size):22s} jaxext {jaxext_ms:9.3f} ms"
                    f"  plain {plain_ms:9.3f} ms  ratio {r['median']:.3f} "
                    f"[{r['p25']:.3f}, {r['p75']:.3f}]  err {row['max_rel_err_vs_plain']:.1e}{note}"
                )
    return {
        "benchmark": "accelerator",
        "device": device.device_kind,
        "backend": backend,
        "dtype": dtype.name,
        "quick": settings.quick,
        "pallas_mode": "interpret" if interpret else "compiled",
        "machine": benchlib.machine_info(),
        "loadavg_end": benchlib.loadavg(),
        "note": settings.note,
        "rows": rows,
    }


def render(results: dict[str, Any]) -> str:
    lines = [
        f"# jaxext ops on {results['device']} ({results['backend']}), {results['dtype']}",
        "",
        "Ratio: median over interleaved rounds of jaxext's time / plain XLA's time "
        "(below 1: jaxext faster), with 25th-75th percentiles.",
    ]
    if results["pallas_mode"] == "interpret":
        lines += [
            "",
            "**CPU: the Pallas RMSNorm ran in interpret mode (an emulation). Its rows are not "
            "kernel timings.**",
        ]
    lines += [
        "",
        "| op | pass | size | jaxext ms | plain ms | ratio [p25, p75] | max rel err | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        r = row["ratio"]
        lines.append(
            f"| {row['op']} | {row['kind']} | {'x'.join(map(str, row['size']))} "
            f"| {row['jaxext']['median_ms']:.3f} | {row['plain']['median_ms']:.3f} "
            f"| {r['median']:.3f} [{r['p25']:.3f}, {r['p75']:.3f}] "
            f"| {row['max_rel_err_vs_plain']:.1e} | {row['label']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few rounds")
    parser.add_argument("--dtype", default="float32", help="input dtype (default float32)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--only", action="append", choices=list(OPS), help="repeatable")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--note", default="", help="stored with the results")
    settings = parser.parse_args(argv)
    if settings.rounds is None:
        settings.rounds = 3 if settings.quick else 30
    settings.target_s = 0.002 if settings.quick else 0.025
    settings.budget_s = 0.5 if settings.quick else 20.0
    results = run(settings)
    settings.out.mkdir(parents=True, exist_ok=True)
    stem = f"accelerator_{results['backend']}" + ("_quick" if settings.quick else "")
    path = settings.out / f"{stem}.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    (settings.out / f"{stem}.md").write_text(render(results))
    print(f"wrote {path} and {stem}.md")
    return path


if __name__ == "__main__":
    main()
