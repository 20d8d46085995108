"""Benchmark the eager (un-jitted) cost of autodiff through ``jaxext.custom_vjp``.

Run from the repository root::

    python benchmarks/bench_eager.py            # full run (CPU: a few minutes)
    python benchmarks/bench_eager.py --quick    # fewer rounds and calls
    python benchmarks/bench_eager.py --render benchmarks/results/eager_cpu.json

Compared, in one process and in interleaved rounds (see ``benchlib.py``), for a linear
layer ``x @ w + b`` with hand-written rules (``fwd`` saves ``x`` and ``w``; ``bwd``
returns ``g @ w.T, x.T @ g, g.sum(0)``), sizes ``B x I -> O``:

* ``grad``: un-jitted ``jax.grad`` of ``sum(f(x, w, b))`` w.r.t. all three, with ``f``
  decorated by ``jaxext.custom_vjp`` against the same rules on ``jax.custom_vjp``
  (target: at most 1.2x, issue 19 item 7);
* ``jvp``: un-jitted ``jax.jvp`` of ``f`` (all inputs perturbed) through
  ``jaxext.custom_vjp`` (forward mode derived from ``bwd``) against plain autodiff's
  ``jax.jvp`` of ``x @ w + b`` (target: at most 1.5x);
* ``Function grad`` and ``Function jvp``: the same two calls with the same rules
  written as a ``jaxext.Function`` (``forward`` saves ``x`` and ``w``), against the
  ``jaxext.custom_vjp`` op (target: at most 1.5x, issue 41);
* ``linearize``: an eager call of the function ``jax.linearize`` returns (in ``x``),
  through ``jaxext.linear`` (``w`` of shape ``O x I``) against plain autodiff's of
  ``x @ w.T + b`` (target: at most 2x, issue 41).

Memory: the resident set size (``VmRSS``) over eager calls each with a new Python
constant, of ``jaxext.mul_constant(x, c)``, of ``jax.jvp`` through it (which goes
through the custom_vjp call path and its per-function cache), and of the C++
``jaxext.cpp_extension.ops.mul_constant(x, c)`` (its constant is a 0-d operand; it was
an FFI attribute before, so every new value compiled a program: measure such a version
with a smaller ``--cpp-calls``), with the number of XLA compilations during each run
(``jax.monitoring``'s backend-compile events). ``--no-time`` runs the memory part only.

``JAXEXT_BENCH_ROOT=<dir>`` imports ``jaxext`` from ``<dir>`` instead of this checkout
(to measure another version, e.g. an export of the previous commit). Writes
``benchmarks/results/eager_cpu.json`` and ``.md`` (``--stem`` to change). A benchmark,
not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = Path(os.environ.get("JAXEXT_BENCH_ROOT", HERE.parent))
sys.path.insert(0, str(ROOT))  # import jaxext without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxext  # noqa: E402

sys.path.insert(0, str(HERE))
import benchlib  # noqa: E402
import report  # noqa: E402

# jaxext / reference: issue 19 item 7 (grad, jvp) and issue 41 (Function, linearize)
TARGETS = {"grad": 1.2, "jvp": 1.5, "Function grad": 1.5, "Function jvp": 1.5, "linearize": 2.0}
SIZES = [(32, 64, 64), (256, 512, 512)]


def _linear(decorator: Callable[..., Any]) -> Callable[..., Any]:
    @decorator
    def linear(x, w, b):
        return x @ w + b

    def fwd(x, w, b):
        return linear(x, w, b), (x, w)

    def bwd(res, g):
        x, w = res
        return g @ w.T, x.T @ g, g.sum(0)

    linear.defvjp(fwd, bwd)
    return linear


class _LinearFunction(jaxext.Function):
    """``_linear``'s rules as a ``jaxext.Function``."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x @ w + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w.T, x.T @ g, g.sum(0)


def _plain(x, w, b):
    return x @ w + b


def _linearized(f: Callable[..., Any], args: tuple[jax.Array, ...]) -> Callable[[], Any]:
    """An eager call of ``jax.linearize``'s function of ``f`` in ``x`` (``w`` is ``O x I``)."""
    x, w, b = args
    w = w.T
    _, f_jvp = jax.linearize(lambda v: f(v, w, b), x)
    t = jnp.ones_like(x)
    return lambda: jax.block_until_ready(f_jvp(t))


def _args(size: tuple[int, int, int]) -> tuple[jax.Array, ...]:
    batch, n_in, n_out = size
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    return (
        jax.random.normal(k[0], (batch, n_in)),
        jax.random.normal(k[1], (n_in, n_out)) / np.sqrt(n_in),
        jax.random.normal(k[2], (n_out,)),
    )


def _grad(f: Callable[..., Any], args: tuple[jax.Array, ...]) -> Callable[[], Any]:
    g = jax.grad(lambda x, w, b: f(x, w, b).sum(), argnums=(0, 1, 2))
    return lambda: jax.block_until_ready(g(*args))


def _jvp(f: Callable[..., Any], args: tuple[jax.Array, ...]) -> Callable[[], Any]:
    tangents = tuple(jnp.ones_like(a) for a in args)
    return lambda: jax.block_until_ready(jax.jvp(f, args, tangents))


def bench_time(args: argparse.Namespace, log: Callable[[str], None]) -> list[dict[str, Any]]:
    ext, ref = _linear(jaxext.custom_vjp), _linear(jax.custom_vjp)
    rows = []
    for size in SIZES:
        a = _args(size)
        function = _LinearFunction.apply
        groups = {
            "grad": ({"jaxext": _grad(ext, a), "reference": _grad(ref, a)}, "jax.custom_vjp"),
            "jvp": ({"jaxext": _jvp(ext, a), "reference": _jvp(_plain, a)}, "plain autodiff"),
            "Function grad": (
                {"jaxext": _grad(function, a), "reference": _grad(ext, a)},
                "jaxext.custom_vjp",
            ),
            "Function jvp": (
                {"jaxext": _jvp(function, a), "reference": _jvp(ext, a)},
                "jaxext.custom_vjp",
            ),
            "linearize": (
                {
                    "jaxext": _linearized(jaxext.linear, a),
                    "reference": _linearized(lambda x, w, b: x @ w.T + b, a),
                },
                "plain autodiff",
            ),
        }
        for mode, (fns, against) in groups.items():
            err = benchlib.max_rel_err(fns["jaxext"](), fns["reference"]())
            load = list(os.getloadavg())
            res = benchlib.interleaved_times(
                fns,
                rounds=args.rounds,
                warmup=5,
                target_s=0.05,
                budget_s=args.budget,
                min_rounds=5,
            )
            t = res["times"]
            ratio = benchlib.ratio_summary(t["jaxext"], t["reference"])
            row = {
                "mode": mode,
                "size": list(size),
                "against": against,
                "time": {k: benchlib.time_summary(v) for k, v in t.items()},
                "ratio": ratio,
                "min_ratio": min(t["jaxext"]) / min(t["reference"]),
                "target": TARGETS[mode],
                "met": ratio["median"] <= TARGETS[mode],
                "rounds": res["rounds"],
                "max_rel_err": err,
                "loadavg_before": load,
            }
            rows.append(row)
            log(
                f"{mode} {report.fm_size(size)}: "
                f"jaxext {row['time']['jaxext']['median_ms']:.3f} ms, "
                f"{against} {row['time']['reference']['median_ms']:.3f} ms, "
                f"ratio {ratio['median']:.2f} (target <= {TARGETS[mode]})"
            )
    return rows


def _rss_mib() -> float:
    with open("/proc/self/status", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _rss_run(name: str, call: Callable[[float], Any], calls: int, log) -> dict[str, Any]:
    """RSS before, at every tenth of the calls and after ``calls`` calls of ``call(c_i)``,
    and the number of XLA compilations during the calls."""
    for i in range(20):  # warm-up: first compilations, caches filled
        call(1000.0 + i)
    compiles = [0]

    def count(event: str, duration: float, **kwargs: Any) -> None:
        compiles[0] += event == _COMPILE_EVENT

    jax.monitoring.register_event_duration_secs_listener(count)
    start_rss, start = _rss_mib(), time.perf_counter()
    trace = []
    try:
        for i in range(calls):
            call(1.0 + i * 1e-3)
            if (i + 1) % max(1, calls // 10) == 0:
                trace.append([i + 1, round(_rss_mib() - start_rss, 1)])
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    wall = time.perf_counter() - start
    row = {
        "op": name,
        "calls": calls,
        "rss_start_mib": round(start_rss, 1),
        "growth_mib": round(_rss_mib() - start_rss, 1),
        "ms_per_call": wall / calls * 1e3,
        "compiles": compiles[0],
        "trace": trace,
    }
    log(
        f"RSS {name}: {row['growth_mib']:+} MiB over {calls} calls, "
        f"{row['ms_per_call']:.2f} ms, {row['compiles']} compilations"
    )
    return row


def bench_memory(args: argparse.Namespace, log: Callable[[str], None]) -> list[dict[str, Any]]:
    x = jnp.ones((32, 64))

    def jvp_mul(c: float) -> Any:
        return jax.block_until_ready(jax.jvp(lambda v: jaxext.mul_constant(v, c), (x,), (x,)))

    rows = [
        _rss_run(
            "jaxext.mul_constant(x, c)",
            lambda c: jaxext.mul_constant(x, c).block_until_ready(),
            args.calls,
            log,
        ),
        _rss_run(
            "jax.jvp(lambda x: jaxext.mul_constant(x, c))",
            jvp_mul,
            args.jvp_calls,
            log,
        ),
    ]
    if args.cpp_calls:
        try:
            from jaxext.cpp_extension import ops

            ops.mul_constant(x, 2.0).block_until_ready()  # builds the extension
        except Exception as err:  # noqa: BLE001 -- reported, not fatal
            rows.append({"op": "cpp ops.mul_constant(x, c)", "error": repr(err)[:300]})
        else:
            rows.append(
                _rss_run(
                    "cpp ops.mul_constant(x, c)",
                    lambda c: ops.mul_constant(x, c).block_until_ready(),
                    args.cpp_calls,
                    log,
                )
            )
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and calls")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per comparison")
    parser.add_argument("--calls", type=int, default=None, help="eager mul_constant calls")
    parser.add_argument("--jvp-calls", type=int, default=None, help="eager jvp calls")
    parser.add_argument("--cpp-calls", type=int, default=None, help="C++ op calls (0: skip)")
    parser.add_argument("--no-memory", action="store_true", help="skip the RSS runs")
    parser.add_argument("--no-time", action="store_true", help="skip the time comparison")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="output directory")
    parser.add_argument("--stem", default="eager_cpu", help="output file name without extension")
    parser.add_argument("--note", default="", help="free text stored with the results")
    parser.add_argument("--render", type=Path, default=None, help="only re-write this JSON's .md")
    args = parser.parse_args(argv)
    if args.render is not None:
        results = json.loads(args.render.read_text())
        args.render.with_suffix(".md").write_text(report.render_eager(results))
        return results
    quick = args.quick
    args.rounds = args.rounds or (7 if quick else 21)
    args.budget = 5.0 if quick else 20.0
    args.calls = args.calls or (1000 if quick else 10_000)
    args.jvp_calls = args.jvp_calls or (200 if quick else 2000)
    if args.cpp_calls is None:
        args.cpp_calls = args.calls
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)

    results: dict[str, Any] = {
        "machine": benchlib.machine_info(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "render")},
        "jaxext_root": str(ROOT),
        "note": args.note,
        "command": " ".join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]),
    }
    log(f"load average at start {results['machine']['loadavg_start']}")
    results["time"] = [] if args.no_time else bench_time(args, log)
    results["memory"] = [] if args.no_memory else bench_memory(args, log)
    results["machine"]["loadavg_end"] = list(os.getloadavg())
    results["wall_s"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{args.stem}.json"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    md = report.render_eager(results)
    (args.out / f"{args.stem}.md").write_text(md)
    print(md)
    log(f"wrote {json_path} and {args.stem}.md")
    return results


if __name__ == "__main__":
    main()
