"""Sweep ``jaxext.rms_norm``'s Triton kernels over block rows and warps, against XLA (GPU).

Run on a machine with an NVIDIA GPU, from the repository root::

    python benchmarks/sweep_rms_norm_triton.py                     # float32
    DTYPES=bfloat16 python benchmarks/sweep_rms_norm_triton.py     # bfloat16

For each size (``SIZES``, default ``4096x1024,16384x4096``) the jitted forward and the
jitted training step (``value_and_grad`` of ``sum(rms_norm(x, w) * ct)`` w.r.t. ``x`` and
``w``) of ``implementation="xla"`` are timed, then those of ``implementation="pallas"`` for
``block_rows`` in 1..16 and Triton's ``num_warps`` in 2..16 (set through
``pltriton.CompilerParams``; ``num_stages=1``: the kernels have no loop). Each time is the
median of 15 (Pallas) or 25 (XLA) synchronous calls after 3 warm-up calls. Writes
``rms_norm_triton_sweep_<backend>.json`` and ``.md`` to ``--out`` (``benchmarks/results``).
This is the measurement behind ``rms_norm``'s Triton block size and its default of XLA on
GPU. The medians of a few calls of sub-millisecond kernels are noisy: read the pattern,
not one cell.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository root: import jaxext without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.pallas import triton as pltriton  # noqa: E402

import jaxext  # noqa: E402

BLOCK_ROWS = (1, 2, 4, 8, 16)
NUM_WARPS = (2, 4, 8, 16)


def _median_ms(fn, *args, calls: int) -> float:
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _programs(implementation: str, block_rows: int | None):
    op = functools.partial(jaxext.rms_norm, implementation=implementation, block_rows=block_rows)
    step = jax.value_and_grad(lambda x, w, ct: jnp.sum(op(x, w) * ct), argnums=(0, 1))
    return jax.jit(op), jax.jit(step)


def sweep(dtype_name: str, rows: int, features: int) -> list[dict]:
    dtype = jnp.dtype(dtype_name)
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (rows, features), dtype)
    w = (1 + 0.1 * jax.random.normal(keys[1], (features,))).astype(dtype)
    ct = jax.random.normal(keys[2], (rows, features), dtype)
    forward, step = _programs("xla", None)
    xla = (_median_ms(forward, x, w, calls=25), _median_ms(step, x, w, ct, calls=25))
    print(f"{dtype_name} {rows}x{features} xla fwd {xla[0]:.3f} step {xla[1]:.3f}", flush=True)
    results = []
    real = pltriton.CompilerParams
    for block_rows in BLOCK_ROWS:
        for warps in NUM_WARPS:
            pltriton.CompilerParams = functools.partial(real, num_warps=warps, num_stages=1)
            try:
                forward, step = _programs("pallas", block_rows)
                times = (_median_ms(forward, x, w, calls=15), _median_ms(step, x, w, ct, calls=15))
            except Exception as err:  # noqa: BLE001 -- a configuration Triton refuses
                print(f"  br={block_rows} nw={warps} ERROR {type(err).__name__}", flush=True)
                continue
            finally:
                pltriton.CompilerParams = real
            results.append(
                {
                    "dtype": dtype_name,
                    "size": [rows, features],
                    "block_rows": block_rows,
                    "num_warps": warps,
                    "fwd_ms": times[0],
                    "step_ms": times[1],
                    "xla_fwd_ms": xla[0],
                    "xla_step_ms": xla[1],
                }
            )
            print(
                f"  br={block_rows:2d} nw={warps:2d} fwd {times[0]:.3f} "
                f"({times[0] / xla[0]:.2f}x) step {times[1]:.3f} ({times[1] / xla[1]:.2f}x)",
                flush=True,
            )
        jax.clear_caches()
    return results


def render(results: list[dict], device: str, note: str = "") -> str:
    """A markdown table per (dtype, size): Pallas time / XLA time, forward and step."""
    lines = [f"# rms_norm's Triton kernels against XLA on {device}", ""]
    if note:
        lines += [note, ""]
    lines += [
        'Each cell: Pallas time / `implementation="xla"` time (below 1: the kernel is faster),',
        "forward | training step. Rows: `block_rows`; columns: Triton `num_warps`.",
        "",
    ]
    groups: dict[tuple, list[dict]] = {}
    for row in results:
        groups.setdefault((row["dtype"], tuple(row["size"])), []).append(row)
    for (dtype, size), rows in groups.items():
        first = rows[0]
        lines += [
            f"## {dtype} {size[0]}x{size[1]} (XLA: forward {first['xla_fwd_ms']:.3f} ms, "
            f"step {first['xla_step_ms']:.3f} ms)",
            "",
            "| block_rows | " + " | ".join(f"{w} warps" for w in NUM_WARPS) + " |",
            "|---|" + "---|" * len(NUM_WARPS),
        ]
        cell = {(r["block_rows"], r["num_warps"]): r for r in rows}
        for block_rows in BLOCK_ROWS:
            cells = []
            for warps in NUM_WARPS:
                r = cell.get((block_rows, warps))
                cells.append(
                    f"{r['fwd_ms'] / r['xla_fwd_ms']:.2f} / {r['step_ms'] / r['xla_step_ms']:.2f}"
                    if r
                    else "-"
                )
            lines.append(f"| {block_rows} | " + " | ".join(cells) + " |")
        best = min(rows, key=lambda r: r["step_ms"])
        lines += [
            "",
            f"Fastest step: block_rows={best['block_rows']}, num_warps={best['num_warps']}, "
            f"{best['step_ms']:.3f} ms ({best['step_ms'] / best['xla_step_ms']:.2f}x XLA).",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--note", default="", help="stored with the results")
    settings = parser.parse_args(argv)
    sizes = [
        tuple(int(n) for n in size.split("x"))
        for size in os.environ.get("SIZES", "4096x1024,16384x4096").split(",")
    ]
    results = [
        row
        for dtype in os.environ.get("DTYPES", "float32").split(",")
        for rows, features in sizes
        for row in sweep(dtype, rows, features)
    ]
    device = jax.devices()[0].device_kind
    settings.out.mkdir(parents=True, exist_ok=True)
    stem = f"rms_norm_triton_sweep_{jax.default_backend()}"
    payload = {"device": device, "jax": jax.__version__, "note": settings.note, "rows": results}
    (settings.out / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    (settings.out / f"{stem}.md").write_text(render(results, device, settings.note))
    print(f"wrote {settings.out / stem}.json and .md")
    return settings.out / f"{stem}.json"


if __name__ == "__main__":
    main()
