"""Benchmark jaxext's C++ kernels (jaxext.cpp_extension.ops) against XLA's own ops.

Run from the repository root::

    python benchmarks/bench_cpp_extension.py           # full run (CPU: about a minute)
    python benchmarks/bench_cpp_extension.py --quick   # small sizes, few rounds

Compared, in one process and in interleaved rounds (see ``benchlib.py``):

* ``mul_constant``: ``jit(ops.mul_constant(x, 2.0))`` (a C++ loop through an FFI call)
  against ``jit(x * 2.0)``, float32; throughput in GB/s counts one read and one write
  per element. Target: at 16M elements, at least 0.5x XLA's throughput.
* ``linear``: ``jit(ops.linear(x, w, b))`` against ``jit(x @ w.T + b)`` (forward), and
  ``jit(value_and_grad)`` of ``sum(linear(x, w, b) * ct)`` w.r.t. ``x, w, b`` (forward
  plus the C++ backward), float32, in GFLOP/s (2*B*I*O per product; fwd+bwd counts 3).
  The C++ kernels are plain loops (single-threaded, vectorized by the compiler with
  ``-O3`` and no ``-march``); XLA's dot is a tuned, multithreaded library GEMM. Reported
  as measured, no target.

Writes ``benchmarks/results/cpp_extension_<backend>[_quick].json`` and ``.md``.

``--per-device-work [--devices N]`` measures instead what each of N CPU devices
(forced host devices, in subprocesses) computes when x is batch-sharded over a
``("data",)`` mesh (explicit axes, ``jax.set_mesh``): for the compiled
``jit(mul_constant)``, ``jit(linear)`` and ``jit(grad)`` of a linear loss, the
elements of every ``jaxext_*`` custom call's operands and results in the
per-device program (the compiled, SPMD-partitioned HLO), and its all-gathers;
before (the handlers' ``partition`` rules set to ``None``) and after (the rules
``ops`` ships). With a rule each device's kernels see 1/N of the batch. XLA's
``cost_analysis()`` cannot tell: it reports -1 (unknown) or nothing for custom
calls. Writes ``benchmarks/results/cpp_extension_per_device_<backend>.json``/``.md``.

This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository root: import jaxext without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxext.cpp_extension import ops  # noqa: E402

sys.path.insert(0, str(HERE))
import benchlib  # noqa: E402
import report  # noqa: E402


def _timed_pair(fns: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    return benchlib.interleaved_times(
        fns,
        rounds=args.rounds,
        warmup=3,
        target_s=0.05 if not args.quick else 0.01,
        budget_s=args.budget,
        min_rounds=5,
    )


def bench_mul_constant(sizes: list[int], args: argparse.Namespace, log) -> list[dict[str, Any]]:
    rows = []
    cpp = jax.jit(lambda x: ops.mul_constant(x, 2.0))
    xla = jax.jit(lambda x: x * 2.0)
    for n in sizes:
        x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
        np.testing.assert_array_equal(cpp(x), xla(x))  # same product, same rounding
        timing = _timed_pair(
            {"cpp": benchlib.blocking(cpp, x), "xla": benchlib.blocking(xla, x)}, args
        )
        t = timing["times"]
        bytes_moved = 2 * 4 * n
        row = {
            "elements": n,
            "cpp": benchlib.time_summary(t["cpp"], bytes_moved / 1e9),
            "xla": benchlib.time_summary(t["xla"], bytes_moved / 1e9),
            # throughput ratio cpp/xla = time ratio xla/cpp, per round
            "throughput_ratio": benchlib.ratio_summary(t["xla"], t["cpp"]),
            "rounds": timing["rounds"],
        }
        rows.append(row)
        log(
            f"mul_constant n={n}: cpp {row['cpp']['rate']:.1f} GB/s, xla "
            f"{row['xla']['rate']:.1f} GB/s, ratio {row['throughput_ratio']['median']:.2f}"
        )
    return rows


def _linear_loss(linear):
    def loss(x, w, b, ct):
        return jnp.sum(linear(x, w, b) * ct)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _xla_linear(x, w, b):
    return x @ w.T + b


def bench_linear(sizes, args, log) -> list[dict[str, Any]]:
    rows = []
    fwd = {"cpp": jax.jit(ops.linear), "xla": jax.jit(_xla_linear)}
    vg = {"cpp": _linear_loss(ops.linear), "xla": _linear_loss(_xla_linear)}
    for batch, n_in, n_out in sizes:
        keys = jax.random.split(jax.random.key(1), 4)
        x = jax.random.normal(keys[0], (batch, n_in), jnp.float32)
        w = jax.random.normal(keys[1], (n_out, n_in), jnp.float32) / np.sqrt(n_in)
        b = jax.random.normal(keys[2], (n_out,), jnp.float32)
        ct = jax.random.normal(keys[3], (batch, n_out), jnp.float32)
        flops = 2.0 * batch * n_in * n_out
        err = benchlib.max_rel_err(vg["cpp"](x, w, b, ct), vg["xla"](x, w, b, ct))
        row: dict[str, Any] = {"size": [batch, n_in, n_out], "max_rel_diff_vs_xla": err}
        for kind, fns, work in (("forward", fwd, flops), ("fwd_bwd", vg, 3 * flops)):
            call_args = (x, w, b) if kind == "forward" else (x, w, b, ct)
            timing = _timed_pair(
                {k: benchlib.blocking(f, *call_args) for k, f in fns.items()}, args
            )
            t = timing["times"]
            row[kind] = {
                "cpp": benchlib.time_summary(t["cpp"], work / 1e9),
                "xla": benchlib.time_summary(t["xla"], work / 1e9),
                "time_ratio_cpp_over_xla": benchlib.ratio_summary(t["cpp"], t["xla"]),
                "rounds": timing["rounds"],
            }
            log(
                f"linear {batch}x{n_in}->{n_out} {kind}: cpp {row[kind]['cpp']['rate']:.1f} "
                f"GFLOP/s, xla {row[kind]['xla']['rate']:.1f} GFLOP/s, time ratio "
                f"{row[kind]['time_ratio_cpp_over_xla']['median']:.2f}"
            )
        rows.append(row)
    return rows


# -- per-device work ------------------------------------------------------------------

_CUSTOM_CALL = re.compile(r"=\s*(.*?)\s+custom-call\((.*?)\),.*?custom_call_target=\"([^\"]+)\"")
_SHAPE = re.compile(r"\b[a-z]+[0-9]*\[([0-9,]*)\]")


def _elements(text: str) -> int:
    total = 0
    for dims in _SHAPE.findall(text):
        total += int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
    return total


def kernel_work(compiled_text: str) -> dict[str, Any]:
    """Per-device elements read and written by the jaxext custom calls of a compiled program."""
    calls = []
    for line in compiled_text.splitlines():
        m = _CUSTOM_CALL.search(line)
        if not m or ".jaxext_" not in m.group(3):
            continue
        layouts = re.search(r"operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}", line)
        calls.append(
            {
                "kernel": m.group(3).split(".")[-1],
                "result_elements": _elements(m.group(1)),
                "operand_elements": _elements(layouts.group(1)) if layouts else None,
            }
        )
    return {
        "calls": calls,
        "all_gathers": len(re.findall(r"\ball-gather(?:-start)?\(", compiled_text)),
        "all_reduces": len(re.findall(r"\ball-reduce(?:-start)?\(", compiled_text)),
    }


def per_device_child(n: int, rules: bool, batch: int, features: int) -> dict[str, Any]:
    """Runs in a process with ``n`` forced CPU devices: the compiled programs' kernel work."""
    from jax.sharding import PartitionSpec as P

    ext = ops.extension()
    if not rules:  # "before": the handlers as a kernel that says nothing
        for name in ext.functions:
            getattr(ext, name).partition = None
    mesh = jax.make_mesh((n,), ("data",))
    rng = np.random.default_rng(0)
    with jax.set_mesh(mesh):
        x = jax.device_put(rng.standard_normal((batch, features), np.float32), P("data"))
        w = jax.device_put(rng.standard_normal((features, features), np.float32), P())
        b = jax.device_put(rng.standard_normal((features,), np.float32), P())
        programs = {
            "mul_constant forward": (lambda x: ops.mul_constant(x, 2.0), (x,)),
            "linear forward": (ops.linear, (x, w, b)),
            "linear fwd+bwd": (
                jax.grad(lambda x, w, b: jnp.sum(jnp.tanh(ops.linear(x, w, b))), argnums=(0, 1, 2)),
                (x, w, b),
            ),
        }
        out = {}
        for name, (fn, fargs) in programs.items():
            text = jax.jit(fn).lower(*fargs).compile().as_text()
            out[name] = kernel_work(text)
    return out


def bench_per_device_work(args: argparse.Namespace, log) -> dict[str, Any]:
    results: dict[str, Any] = {"devices": args.devices, "batch": args.batch, "features": 256}
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    for label, flag in (("before", "off"), ("after", "on")):
        command = [sys.executable, __file__, "--per-device-child", flag]
        command += ["--devices", str(args.devices), "--batch", str(args.batch)]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if proc.returncode:
            raise RuntimeError(f"per-device child failed:\n{proc.stdout}\n{proc.stderr}")
        results[label] = json.loads(proc.stdout.strip().splitlines()[-1])
        log(f"{label}: measured {len(results[label])} programs")
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--budget", type=float, default=8.0, help="seconds per comparison")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--note", default="", help="stored with the results")
    parser.add_argument(
        "--per-device-work",
        action="store_true",
        help="per-device kernel work on a batch-sharded input, without and with rules",
    )
    parser.add_argument("--devices", type=int, default=4, help="for --per-device-work")
    parser.add_argument("--batch", type=int, default=4096, help="for --per-device-work")
    parser.add_argument("--per-device-child", choices=("on", "off"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, flush=True)

    if args.per_device_child:
        work = per_device_child(args.devices, args.per_device_child == "on", args.batch, 256)
        print(json.dumps(work))
        return work
    if args.per_device_work:
        results = {
            "machine": benchlib.machine_info(),
            "note": args.note,
            "per_device_work": bench_per_device_work(args, log),
        }
        text = report.render_cpp_per_device(results)
        print(text)
        stem = f"cpp_extension_per_device_{jax.default_backend()}"
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
        (args.out / f"{stem}.md").write_text(text)
        log(f"wrote {args.out / stem}.json and .md")
        return results
    if args.quick:
        args.rounds, args.budget = 5, 1.0
        mul_sizes = [2**10, 2**20]
        linear_sizes = [(64, 64, 64), (256, 256, 256)]
    else:
        mul_sizes = [2**10, 2**20, 2**24]
        linear_sizes = [(32, 64, 64), (256, 256, 256), (1024, 1024, 1024)]

    ops.extension()  # build (or load) the kernels before anything is timed
    results = {
        "machine": benchlib.machine_info(),
        "note": args.note,
        "mul_constant": bench_mul_constant(mul_sizes, args, log),
        "linear": bench_linear(linear_sizes, args, log),
    }
    results["machine"]["loadavg_end"] = benchlib.os.getloadavg()
    text = report.render_cpp_extension(results)
    print(text)
    stem = f"cpp_extension_{jax.default_backend()}" + ("_quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(text)
    log(f"wrote {args.out / stem}.json and .md")
    return results


if __name__ == "__main__":
    main()
