"""How long do jaxext's checks take? gradcheck against torch.autograd.gradcheck, opcheck's battery.

Three sections, each a wall-clock time of what a user waits for (compilation included,
since every call of a checker compiles the function it checks):

* gradcheck: ``jaxext.gradcheck(jaxext.linear, (x, w))`` against
  ``torch.autograd.gradcheck(F.linear, (x, w))`` on the same float64 inputs, x 20x20 and
  w 30x20 (a 1000-input, 600-output Jacobian, compared entry by entry by both), each
  cold (the first call of a fresh process) and warm (later calls);
* opcheck: the whole battery on ``jaxext.linear`` with small inputs (x 4x3, w 2x3, b 2),
  with the time of each check;
* sweep: ``jaxext.gradcheck`` (full method, ``fast_mode=False``) against
  ``torch.autograd.gradcheck(..., fast_mode=False)`` on linear with x s x s, w 1.5s x s in
  float64, from 1e5 to 1e9 Jacobian entries. Each size runs in fresh processes, jaxext's
  then torch's (interleaved, so both see the same machine load), in ``--sweep-rounds``
  rounds (medians reported, the ratio as the median of the rounds' ratios): cold is the first call,
  warm a second one in the same process (for first calls under ``--warm-max-s``), with
  the process's peak resident memory (JAX or torch itself included). torch runs while
  its time, extrapolated from the previous size by the number of entries, stays under
  ``--torch-max-s``;
* large (``--large``): ``jaxext.gradcheck`` on problems of about 1e4 inputs by 1e4
  outputs, with the process's peak resident memory (which includes JAX itself, about 0.3 GB).

Usage::

    python benchmarks/bench_checks.py                 # writes benchmarks/results/checks_cpu.*
    python benchmarks/bench_checks.py --quick         # no torch, no large problems
    python benchmarks/bench_checks.py --repeats 5 --note "idle machine"

Nothing here is a test: no timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import report  # noqa: E402
from benchlib import machine_info  # noqa: E402

import jaxext  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# torch's intra-op threads (``--torch-threads``, passed to the child processes through
# this environment variable): 0 keeps torch's default.
TORCH_THREADS_ENV = "BENCH_CHECKS_TORCH_THREADS"


def _times(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        ok = fn()
        times.append(time.perf_counter() - start)
        if not ok:
            raise AssertionError("a checker rejected a correct function")
    return times


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def _own_peak_rss_gib() -> float:
    """This process's own peak RSS (``VmHWM``: ``ru_maxrss`` keeps the parent's across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20  # KiB
    return _peak_rss_gib()


def _requested_torch_threads() -> int:
    """``--torch-threads`` as the child processes see it (0: torch's default)."""
    return int(os.environ.get(TORCH_THREADS_ENV, "0"))


def _torch_threads():
    """torch with the intra-op threads asked for (``--torch-threads``; its default, as
    users run it, unless set). On a loaded 2-core machine the default (2 threads,
    spinning while they wait) made gradcheck several times slower than one thread; on
    an idle one it was about 10% faster."""
    import torch

    threads = _requested_torch_threads()
    if threads:
        torch.set_num_threads(threads)
    return torch


def _gradcheck_problem() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((20, 20)), rng.standard_normal((30, 20))


def _gradcheck_call(checker: str):
    """A no-argument call of ``checker``'s gradcheck on the shared problem, with the
    library initialised (its first computation done) so that only the check is timed."""
    x, w = _gradcheck_problem()
    if checker == "jaxext":
        jaxext.linear(np.ones((1, 1)), np.ones((1, 1)))  # JAX's backend is up
        return lambda: jaxext.gradcheck(jaxext.linear, (x, w))
    torch = _torch_threads()
    import torch.nn.functional as F  # noqa: N812

    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    F.linear(tx, tw).sum().backward()  # torch's autograd is up
    return lambda: torch.autograd.gradcheck(F.linear, (tx, tw))


def _cold_times(checker: str, runs: int) -> list[float]:
    """The first gradcheck call of a fresh process, ``runs`` times."""
    times = []
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, __file__, "--cold-one", checker],
            capture_output=True,
            text=True,
            check=True,
        )
        times.append(float(out.stdout.strip().splitlines()[-1]))
    return times


def bench_gradcheck(repeats: int, torch_repeats: int) -> dict[str, Any]:
    result: dict[str, Any] = {"problem": "linear, x 20x20, w 30x20, float64"}
    checkers = ["jaxext"]
    if torch_repeats:
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None:
            checkers.append("torch")
            result["torch_version"] = torch.__version__
            result["torch_threads"] = _requested_torch_threads() or "default"
    for checker in checkers:
        runs = repeats if checker == "jaxext" else torch_repeats
        result[f"{checker}_cold_s"] = _cold_times(checker, runs)
        call = _gradcheck_call(checker)
        call()  # the in-process first call is the cold case, timed above
        result[f"{checker}_warm_s"] = _times(call, runs)
    return result


def bench_opcheck(repeats: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    args = (rng.standard_normal((4, 3)), rng.standard_normal((2, 3)), rng.standard_normal(2))
    totals, per_check = [], {}
    for _ in range(repeats):
        start = time.perf_counter()
        report = jaxext.opcheck(jaxext.linear, args)
        totals.append(time.perf_counter() - start)
        for r in report.results:
            per_check.setdefault(r.name, []).append(r.seconds)
    return {
        "problem": "jaxext.linear, x 4x3, w 2x3, b 2",
        "total_s": totals,
        "per_check_s": {name: statistics.median(t) for name, t in per_check.items()},
        "statuses": report.statuses,
    }


def bench_large() -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    rows = []
    for x_shape, w_shape in [((80, 60), (70, 60)), ((100, 50), (100, 50))]:
        x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
        n, m = x.size + w.size, x_shape[0] * w_shape[0]
        start = time.perf_counter()
        assert jaxext.gradcheck(jaxext.linear, (x, w))
        rows.append(
            {
                "problem": f"linear, x {x_shape[0]}x{x_shape[1]}, w {w_shape[0]}x{w_shape[1]}",
                "inputs": n,
                "outputs": m,
                "entries": n * m,
                "seconds": time.perf_counter() - start,
                "peak_rss_gib_so_far": _peak_rss_gib(),
            }
        )
    x = rng.standard_normal(10_000)
    start = time.perf_counter()
    assert jaxext.gradcheck(lambda v: jaxext.mul_constant(v, 1.5) / (1 + v @ v), (x,))
    rows.append(
        {
            "problem": "dense Jacobian: x * 1.5 / (1 + |x|^2), 10,000 elements",
            "inputs": 10_000,
            "outputs": 10_000,
            "entries": 10**8,
            "seconds": time.perf_counter() - start,
            "peak_rss_gib_so_far": _peak_rss_gib(),
        }
    )
    return rows


# s: 1.1e5 .. 1.0e9 Jacobian entries (61: 5.15e7, the first size from 5e7 up)
SWEEP_SIZES = (13, 20, 30, 40, 61, 80, 100, 128)


def _sweep_shapes(s: int) -> tuple[tuple[int, int], tuple[int, int], int, int]:
    x_shape, w_shape = (s, s), (3 * s // 2, s)
    n, m = s * s + w_shape[0] * s, s * w_shape[0]
    return x_shape, w_shape, n, m


def _sweep_one(checker: str, s: int, warm_max_s: float) -> dict[str, Any]:
    """In a fresh process: the first (cold) and, if it was short, a second (warm) call."""
    x_shape, w_shape, _, _ = _sweep_shapes(s)
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    if checker == "jaxext":
        jaxext.linear(np.ones((1, 1)), np.ones((1, 1)))  # JAX's backend is up

        def call():
            return jaxext.gradcheck(jaxext.linear, (x, w), fast_mode=False)
    else:
        torch = _torch_threads()
        import torch.nn.functional as F  # noqa: N812

        tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
        F.linear(tx, tw).sum().backward()  # torch's autograd is up

        def call():
            return torch.autograd.gradcheck(F.linear, (tx, tw), fast_mode=False)

    cold = _times(call, 1)[0]
    warm = _times(call, 1)[0] if cold < warm_max_s else None
    result = {"cold_s": cold, "warm_s": warm, "peak_rss_gib": _own_peak_rss_gib()}
    if checker == "torch":
        result["threads"] = torch.get_num_threads()
    return result


def _sweep_child(checker: str, s: int, warm_max_s: float) -> dict[str, Any]:
    """``_sweep_one`` in a fresh process, with the load average when it started."""
    load = os.getloadavg()[0]
    out = subprocess.run(
        [sys.executable, __file__, "--sweep-one", checker, str(s), str(warm_max_s)],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["load_before"] = load
    return result


def _median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One checker's rounds at one size: medians of its times, all of its runs."""
    warm = [run["warm_s"] for run in runs if run["warm_s"] is not None]
    summary = {
        "cold_s": statistics.median(run["cold_s"] for run in runs),
        "warm_s": statistics.median(warm) if warm else None,
        "peak_rss_gib": max(run["peak_rss_gib"] for run in runs),
        "load_before": statistics.median(run["load_before"] for run in runs),
        "rounds": runs,
    }
    if "threads" in runs[0]:
        summary["threads"] = runs[0]["threads"]
    return summary


def bench_sweep(
    torch_max_s: float, warm_max_s: float, sizes=SWEEP_SIZES, rounds: int = 3
) -> list[dict[str, Any]]:
    """Each size in ``rounds`` rounds of fresh processes, jaxext's then torch's (paired:
    both see the same machine load); the ratio is the median of the rounds' ratios."""
    rows, torch_estimate, previous = [], 0.0, None
    for s in sizes:
        x_shape, w_shape, n, m = _sweep_shapes(s)
        row: dict[str, Any] = {
            "problem": f"linear, x {x_shape[0]}x{x_shape[1]}, w {w_shape[0]}x{w_shape[1]}",
            "inputs": n,
            "outputs": m,
            "entries": n * m,
        }
        checkers = ["jaxext"]
        if previous is not None:
            torch_estimate = previous[0] * (n * m) / previous[1]
        if torch_max_s > 0 and torch_estimate < torch_max_s:
            checkers.append("torch")
        runs: dict[str, list[dict[str, Any]]] = {checker: [] for checker in checkers}
        for _ in range(rounds):
            for checker in checkers:
                runs[checker].append(_sweep_child(checker, s, warm_max_s))
                print(checker, row["problem"], runs[checker][-1], flush=True)
        for checker in checkers:
            row[checker] = _median_of(runs[checker])
        if "torch" in row:
            pairs = zip(runs["torch"], runs["jaxext"], strict=True)
            row["ratio_cold_rounds"] = [t["cold_s"] / j["cold_s"] for t, j in pairs]
            previous = (row["torch"]["cold_s"], n * m)
        else:
            row["torch_skipped_estimate_s"] = torch_estimate
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="no torch, no large problems")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the jaxext checks")
    parser.add_argument("--torch-repeats", type=int, default=3, help="runs of torch's gradcheck")
    parser.add_argument("--out", type=Path, default=RESULTS, help="output folder")
    parser.add_argument("--note", default="", help="stored with the results")
    parser.add_argument("--large", action="store_true", help="also the large-problem section")
    parser.add_argument(
        "--torch-max-s", type=float, default=60.0, help="sweep: longest torch call to run"
    )
    parser.add_argument(
        "--warm-max-s", type=float, default=20.0, help="sweep: a second call after a shorter one"
    )
    parser.add_argument(
        "--sizes", type=int, nargs="*", default=list(SWEEP_SIZES), help="sweep: values of s"
    )
    parser.add_argument(
        "--torch-threads", type=int, default=0, help="torch's intra-op threads (0: its default)"
    )
    parser.add_argument(
        "--sweep-rounds", type=int, default=3, help="sweep: paired rounds of processes per size"
    )
    parser.add_argument("--cold-one", choices=["jaxext", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--sweep-one", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cold_one:  # child process of _cold_times: time one first call, print seconds
        print(_times(_gradcheck_call(args.cold_one), 1)[0])
        return 0
    if args.sweep_one:  # child process of bench_sweep: print its timings as JSON
        checker, s, warm_max_s = args.sweep_one
        print(json.dumps(_sweep_one(checker, int(s), float(warm_max_s))))
        return 0
    os.environ[TORCH_THREADS_ENV] = str(args.torch_threads)  # for the child processes
    load_before = os.getloadavg()
    results = {
        "machine": machine_info(),
        "note": args.note,
        "gradcheck": bench_gradcheck(args.repeats, 0 if args.quick else args.torch_repeats),
        "opcheck": bench_opcheck(1 if args.quick else args.repeats),
        "sweep": []
        if args.quick
        else bench_sweep(args.torch_max_s, args.warm_max_s, args.sizes, args.sweep_rounds),
        "large": bench_large() if args.large and not args.quick else [],
    }
    results["load_average"] = {"before": load_before, "after": os.getloadavg()}
    text = report.render_checks(results)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "checks_cpu.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (args.out / "checks_cpu.md").write_text(text)
    print(json.dumps({k: v for k, v in results.items() if k != "machine"}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
