"""What the multi-device worker scripts share (``_sharding_worker.py``,
``_cpp_sharding_worker.py``): counting collectives in a compiled program, the
largest difference between two pytrees, per-leaf partition specs, seeded inputs,
and the loop that runs each named check and writes the results as JSON.

Imported by the workers after they set ``XLA_FLAGS`` (it imports JAX).
"""

from __future__ import annotations

import json
import re
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def collective_counts(fn: Callable[..., Any], *args: Any) -> dict[str, int]:
    """Counts each collective op in the compiled (post-SPMD-partitioning) HLO of
    ``fn`` (jitted here unless it already is) at ``args``."""
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    text = jitted.lower(*args).compile().as_text()
    return {c: len(re.findall(rf"\b{c}(?:-start)?\(", text)) for c in COLLECTIVES}


def max_abs_diff(a: Any, b: Any) -> float:
    """The largest absolute difference between matching leaves, in float64."""
    return max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def max_abs(tree: Any) -> float:
    """The largest absolute entry over all leaves."""
    return max(float(np.max(np.abs(np.asarray(leaf)))) for leaf in jax.tree.leaves(tree))


def specs(tree: Any) -> list[str]:
    """Per-leaf partition specs padded to the array rank (``P()`` == ``P(None,)``)."""
    out = []
    for leaf in jax.tree.leaves(tree):
        spec = tuple(getattr(leaf.sharding, "spec", ()))
        out.append(str(spec + (None,) * (leaf.ndim - len(spec))))
    return out


def rand(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """Standard-normal float32 entries from a seeded generator."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def run_checks(checks: Mapping[str, Callable[[], Any]], path: str) -> None:
    """Runs each check and writes ``{"device_count", "checks": {name: result}}`` to
    ``path``; a check that raises is recorded with its traceback (the test that
    reads the file reports it) and the others still run."""
    results: dict[str, Any] = {"device_count": jax.device_count(), "checks": {}}
    for name, check in checks.items():
        try:
            results["checks"][name] = check()
        except Exception:  # recorded, reported by the test that reads it
            results["checks"][name] = {"error": traceback.format_exc()}
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
