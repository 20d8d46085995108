"""Shared helpers for the jaxext benchmarks: timing, statistics, machine description.

Timing protocol (used by every comparison in ``bench_linear.py``):

* every contender of a comparison lives in the same process;
* warm-up calls (which include compilation) are run first and discarded;
* each contender is calibrated once so that one *measurement* (``inner``
  back-to-back synchronous calls) lasts about ``target_s`` seconds;
* measurements are interleaved in rounds (A, B, C, then C, B, A, then A, B, C ...)
  so that slow drifts of a shared machine hit every contender alike; each
  measurement is preceded by one untimed call of the same contender, which absorbs
  the cost of switching from the previous one (another framework's thread pool
  still spinning, cold caches);
* a comparison is summarised by the median over rounds of the per-round time
  ratio, with its 25th/75th percentiles as the spread.

Every callable must be synchronous: JAX callables end with ``block_until_ready``.
"""

from __future__ import annotations

import datetime
import gc
import importlib
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np


def interleaved_times(
    fns: Mapping[str, Callable[[], Any]],
    *,
    rounds: int,
    warmup: int,
    target_s: float,
    budget_s: float | None = None,
    min_rounds: int = 5,
    max_inner: int = 10_000,
) -> dict[str, Any]:
    """Times synchronous zero-argument callables in interleaved rounds.

    Args:
        fns: contender name -> callable doing one full (blocking) call.
        rounds: number of measured rounds wanted.
        warmup: number of discarded calls per contender before calibration.
        target_s: wall time one measurement should last (sets ``inner``).
        budget_s: if given, the number of rounds is reduced so that the measured
            rounds take about this long, but never below ``min_rounds``; rounds
            also stop (once ``min_rounds`` are done) when twice the budget is spent.
        min_rounds: lower bound on the rounds kept when ``budget_s`` applies.
        max_inner: upper bound on the calls per measurement.

    Returns:
        ``{"times": {name: [seconds per call, one per round]}, "inner": {name: int},
        "rounds": int}``.
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    # Move everything alive now out of the collector's reach so that the collection
    # before each measurement only walks garbage made since (cheap), not the whole heap.
    gc.collect()
    gc.freeze()
    try:
        return _measure(fns, names, rounds, target_s, budget_s, min_rounds, max_inner)
    finally:
        gc.unfreeze()


def _measure(fns, names, rounds, target_s, budget_s, min_rounds, max_inner) -> dict[str, Any]:
    inner, single = {}, {}
    for name in names:
        single[name] = sorted(_timed(fns[name], 1) for _ in range(3))[1]  # median of 3
        inner[name] = int(max(1, min(max_inner, round(target_s / max(single[name], 1e-9)))))
    if budget_s is not None:
        per_round = sum((inner[n] + 1) * single[n] for n in names)
        rounds = max(min_rounds, min(rounds, int(budget_s / max(per_round, 1e-9))))
    times: dict[str, list[float]] = {name: [] for name in names}
    start = time.perf_counter()
    for r in range(rounds):
        if budget_s is not None and r >= min_rounds and r % 2 == 0 and _over(start, budget_s):
            rounds = r  # the machine got slower than calibrated: stop at twice the budget
            break
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            fns[name]()  # untimed: absorbs the switch from the previous contender
            times[name].append(_timed(fns[name], inner[name]))
    return {"times": times, "inner": inner, "rounds": rounds}


def _over(start: float, budget_s: float) -> bool:
    return time.perf_counter() - start > 2 * budget_s


def _timed(fn: Callable[[], Any], inner: int) -> float:
    """Seconds per call of ``inner`` back-to-back calls, with the GC paused."""
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - start) / inner
    finally:
        gc.enable()


def quantiles(values: list[float]) -> dict[str, float]:
    """Median and 25th/75th percentiles of ``values``."""
    arr = np.asarray(values, dtype=np.float64)
    return {
        "median": float(np.median(arr)),
        "p25": float(np.percentile(arr, 25)),
        "p75": float(np.percentile(arr, 75)),
    }


def ratio_summary(num: list[float], den: list[float]) -> dict[str, float]:
    """Median (and quartiles) of the per-round ratios ``num[r] / den[r]``."""
    return quantiles([a / b for a, b in zip(num, den, strict=True)])


def time_summary(times: list[float], work: float | None = None) -> dict[str, float]:
    """Per-call milliseconds (median/quartiles) and, given ``work``, ``work``/s at the median."""
    q = quantiles(times)
    out = {"median_ms": q["median"] * 1e3, "p25_ms": q["p25"] * 1e3, "p75_ms": q["p75"] * 1e3}
    if work is not None:
        out["rate"] = work / q["median"]
    return out


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (or ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except Exception:  # a missing optional package is reported as None
        return None


def machine_info() -> dict[str, Any]:
    """Description of the machine and software stack the benchmark ran on."""
    import jax

    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": _version("jax"),
        "jaxlib": _version("jaxlib"),
        "flax": _version("flax"),
        "optax": _version("optax"),
        "numpy": _version("numpy"),
        "torch": _version("torch"),
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        info["torch_cuda"] = bool(torch.cuda.is_available())
    except Exception:
        info["torch_threads"] = None
    return info


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def fmt_bytes(n: float | None) -> str:
    """Human-readable byte count (binary units)."""
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def loadavg() -> list[float] | None:
    """1/5/15-minute load averages: how busy the (possibly shared) machine was."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def blocking(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    """``fn(*args)`` as a synchronous callable for the timers (waits for JAX results)."""
    import jax

    return lambda: jax.block_until_ready(fn(*args))


def max_rel_err(a: Any, b: Any) -> float:
    """Largest ``max|a - b| / max|b|`` over matching leaves (in float64; 0 for empty ones)."""
    import jax

    worst = 0.0
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
        scale = max(float(np.max(np.abs(v), initial=0.0)), 1e-30)
        worst = max(worst, float(np.max(np.abs(u - v), initial=0.0)) / scale)
    return worst
