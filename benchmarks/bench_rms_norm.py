"""Benchmark the RMSNorm layers' jitted training step against Flax's, on CPU (or any device).

Run from the repository root::

    python benchmarks/bench_rms_norm.py            # every size below
    python benchmarks/bench_rms_norm.py --quick    # tiny sizes, few rounds (smoke test)

For each ``(rows, features)`` float32 input, the jitted training step of each layer,
``value_and_grad`` of ``sum(y * cos(y))`` with respect to the parameters and the input,
is timed for ``jaxext.nnx.RMSNorm`` against ``flax.nnx.RMSNorm`` and
``jaxext.linen.RMSNorm`` against ``flax.linen.RMSNorm``, the four in one interleaved group
(see ``benchlib.py``). The ratio is the median over rounds of jaxext's time / Flax's time,
with quartiles. Before timing, each jaxext layer's loss and gradients are compared with
Flax's (the largest relative difference is stored). jaxext's layers run
``jaxext.rms_norm`` with its default ``implementation`` (plain XLA on CPU, the Pallas
kernels on GPU/TPU). Results go to ``benchmarks/results/rms_norm_<backend>[_quick].{json,md}``.
This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository root: import jaxext without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jaxext.linen  # noqa: E402
import jaxext.nnx  # noqa: E402

sys.path.insert(0, str(HERE))
import benchlib  # noqa: E402

# The sizes the issue measured (#42), (8192, 4096) among them, and bench_accelerator.py's.
SIZES = [(512, 4096), (2048, 4096), (4096, 1024), (4096, 2048), (8192, 4096), (16384, 4096)]
QUICK_SIZES = [(16, 32), (64, 128)]
MAX_LIMIT = 1.1  # the bound on jaxext's time / Flax's


def _loss(y: jax.Array) -> jax.Array:
    return jnp.sum(y * jnp.cos(y))


def _nnx_step(cls: Any, features: int) -> tuple[Callable, Any]:
    graphdef, params = nnx.split(cls(features, rngs=nnx.Rngs(0)))

    def loss(params, x):
        return _loss(nnx.merge(graphdef, params)(x))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params


def _linen_step(cls: Any, x: jax.Array) -> tuple[Callable, Any]:
    layer = cls()
    params = layer.init(jax.random.key(0), x)

    def loss(params, x):
        return _loss(layer.apply(params, x))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params


def run(settings: argparse.Namespace, save: Callable[[dict], Any] | None = None) -> dict[str, Any]:
    backend = jax.default_backend()
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({backend}), float32")
    rows_out = []
    start = time.perf_counter()
    sizes = QUICK_SIZES if settings.quick else SIZES
    if settings.size:
        sizes = [tuple(int(n) for n in size.split("x")) for size in settings.size]
    for size in sizes:
        x = jax.random.normal(jax.random.key(1), size, jnp.float32)
        steps = {
            "jaxext.nnx": _nnx_step(jaxext.nnx.RMSNorm, size[-1]),
            "flax.nnx": _nnx_step(nnx.RMSNorm, size[-1]),
            "jaxext.linen": _linen_step(jaxext.linen.RMSNorm, x),
            "flax.linen": _linen_step(nn.RMSNorm, x),
        }
        errs = {
            api: benchlib.max_rel_err(
                steps[f"jaxext.{api}"][0](steps[f"jaxext.{api}"][1], x),
                steps[f"flax.{api}"][0](steps[f"flax.{api}"][1], x),
            )
            for api in ("nnx", "linen")
        }
        load = benchlib.loadavg()
        measured = benchlib.interleaved_times(
            {name: benchlib.blocking(step, params, x) for name, (step, params) in steps.items()},
            rounds=settings.rounds,
            warmup=2,
            target_s=settings.target_s,
            budget_s=settings.budget_s,
            min_rounds=min(5, settings.rounds),
        )
        times = measured["times"]
        row = {
            "size": list(size),
            "rounds": measured["rounds"],
            "load_avg_1min_before": load[0] if load else None,
            **{name: benchlib.time_summary(t) for name, t in times.items()},
        }
        for api in ("nnx", "linen"):
            ratio = benchlib.ratio_summary(times[f"jaxext.{api}"], times[f"flax.{api}"])
            row[f"ratio_{api}"] = ratio
            row[f"max_rel_err_{api}"] = errs[api]
            print(
                f"{api:5s} {str(size):14s} jaxext {row[f'jaxext.{api}']['median_ms']:9.2f} ms  "
                f"flax {row[f'flax.{api}']['median_ms']:9.2f} ms  ratio {ratio['median']:.3f} "
                f"[{ratio['p25']:.3f}, {ratio['p75']:.3f}]  err {errs[api]:.1e}"
            )
        rows_out.append(row)
        if save is not None:  # after each size: a long run interrupted keeps what it measured
            save(_results(settings, backend, device, start, rows_out))
    return _results(settings, backend, device, start, rows_out)


def _results(settings, backend, device, start, rows_out) -> dict[str, Any]:
    return {
        "benchmark": "rms_norm",
        "device": device.device_kind,
        "backend": backend,
        "dtype": "float32",
        "quick": settings.quick,
        "limit": MAX_LIMIT,
        "command": "python benchmarks/bench_rms_norm.py " + " ".join(sys.argv[1:]),
        "wall_s": time.perf_counter() - start,
        "machine": benchlib.machine_info(),
        "loadavg_end": benchlib.loadavg(),
        "note": settings.note,
        "rows": rows_out,
    }


def render(results: dict[str, Any]) -> str:
    machine = results["machine"]
    lines = [
        f"# RMSNorm layers' training step on {results['device']} ({results['backend']}), float32",
        "",
        f"Command: `{results['command']}`  ",
        f"Machine: {json.dumps(machine)}  ",
        f"Wall time {results['wall_s']:.0f} s; load average at end {results['loadavg_end']}.",
        "",
        "`jax.jit(jax.value_and_grad(loss, (params, x)))` with `loss = sum(y * cos(y))`. Time "
        "per call in ms (median over interleaved rounds, the four layers in one group); ratio = "
        "median of per-round ratios jaxext / Flax [25th-75th percentile]; below 1: jaxext "
        f"faster. The bound is {results['limit']}x.",
    ]
    if results["note"]:
        lines += ["", f"Note: {results['note']}"]
    lines += [
        "",
        "| rows x features | jaxext nnx ms | flax nnx ms | nnx ratio | jaxext linen ms "
        "| flax linen ms | linen ratio | rounds | load avg | max rel err (nnx, linen) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:

        def ratio(api: str, row: dict = row) -> str:
            r = row[f"ratio_{api}"]
            return f"{r['median']:.3f} [{r['p25']:.2f}-{r['p75']:.2f}]"

        load = row["load_avg_1min_before"]
        lines.append(
            f"| {'x'.join(map(str, row['size']))} "
            f"| {row['jaxext.nnx']['median_ms']:.2f} | {row['flax.nnx']['median_ms']:.2f} "
            f"| {ratio('nnx')} "
            f"| {row['jaxext.linen']['median_ms']:.2f} | {row['flax.linen']['median_ms']:.2f} "
            f"| {ratio('linen')} | {row['rounds']} | {load if load is None else f'{load:.1f}'} "
            f"| {row['max_rel_err_nnx']:.1e}, {row['max_rel_err_linen']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--note", default="", help="stored with the results")
    parser.add_argument(
        "--size", action="append", help="ROWSxFEATURES, repeatable (default: all of SIZES)"
    )
    settings = parser.parse_args(argv)
    if settings.rounds is None:
        settings.rounds = 3 if settings.quick else 20
    settings.target_s = 0.002 if settings.quick else 0.05
    settings.budget_s = 0.5 if settings.quick else 30.0
    settings.out.mkdir(parents=True, exist_ok=True)

    def save(results: dict[str, Any]) -> Path:
        stem = f"rms_norm_{results['backend']}" + ("_quick" if settings.quick else "")
        path = settings.out / f"{stem}.json"
        path.write_text(json.dumps(results, indent=1) + "\n")
        (settings.out / f"{stem}.md").write_text(render(results))
        return path

    path = save(run(settings, save))
    print(f"wrote {path} and its .md")
    return path


if __name__ == "__main__":
    main()
