"""opcheck's row about C++ kernels: results a kernel leaves unwritten (``unwritten_outputs``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._settings import Settings
from ._common import (
    Skip,
    vjp,
)
from ._kernels import kernel_targets, unchecked
from ._op import (
    CheckFailed,
    OpUnderTest,
)

__all__ = ["unwritten_outputs"]


def unwritten_outputs(op: OpUnderTest, settings: Settings) -> str:
    """The op's output, gradients and JVP, computed with the C++ kernels' result buffers
    filled with NaN (checking mode) and without: an element that is NaN (an integer that
    differs) only in checking mode was never written by a kernel."""
    rng = np.random.default_rng(settings.seed + 11)
    primals, u, v = op.primals, op.cotangent(rng), op.tangents(rng)
    computations: dict[str, tuple[Callable, list[str]]] = {}

    def add(what: str, fn: Callable) -> None:
        try:
            targets = kernel_targets(fn, *primals)
        except Exception:  # noqa: BLE001 -- a computation the op lacks (e.g. no gradient)
            return
        if targets:
            computations[what] = (jax.jit(fn), targets)

    add("output", op.call)
    add("gradient", lambda *p: vjp(op.call, p, u))
    if op.forward_error is None:
        add("JVP", lambda *p: jax.jvp(op.call, p, v)[1])
    if not computations:
        raise Skip(
            "the op calls no C++ kernel of jaxext.cpp_extension (checking mode fills those "
            "kernels' result buffers)"
        )
    names = sorted({t.rsplit(".", 1)[-1] for _, ts in computations.values() for t in ts})
    for what, (fn, targets) in computations.items():
        with unchecked():
            plain = jax.device_get(fn(*primals))
        checked = jax.device_get(fn(*primals))  # opcheck runs its checks in checking mode
        if what == "gradient":
            names_and_trees = [
                (f"gradient of {label}", a, b)
                for label, a, b in zip(op.labels, checked, plain, strict=True)
            ]
        else:
            names_and_trees = [("output" if what == "output" else "JVP output", checked, plain)]
        for name, a, b in names_and_trees:
            _assert_written(a, b, name, targets)
    return f"every element of the results written by the kernel(s) {', '.join(names)}"


def _assert_written(checked: Any, plain: Any, what: str, targets: list[str]) -> None:
    flat_checked = jax.tree_util.tree_flatten_with_path(checked)[0]
    flat_plain = jax.tree_util.tree_leaves(plain)
    for (path, a), b in zip(flat_checked, flat_plain, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype == jax.dtypes.float0 or a.size == 0:
            continue
        if jnp.issubdtype(a.dtype, jnp.inexact):
            bad = np.isnan(a) & ~np.isnan(b)
            fill = "NaN"
        else:
            bad = a != b
            fill = "the sentinel"
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            kernels = ", ".join(t.rsplit(".", 1)[-1] for t in targets)
            raise CheckFailed(
                f"{what}{jax.tree_util.keystr(path)}: {int(bad.sum())} of {a.size} elements "
                f"were never written by a C++ kernel ({kernels}): they hold {fill}, the fill "
                f"of checking mode, e.g. element {first} (without checking mode it was "
                f"{b[first]!r}, whatever memory held)."
            )
