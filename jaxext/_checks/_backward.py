"""The checks of a backward that ``gradcheck`` and ``opcheck`` share, each written once.

Zero cotangent, reentrancy, batched gradients and gradient dtypes, as in PyTorch's
``gradcheck``. Each takes the backward in the form both entry points have (a
pullback ``u -> one gradient per input leaf or block``, or the ``FloatLeaves``
view of the function), applies its one tolerance rule, and returns ``Mismatch``
records (or ``None``); the entry points word them in their own reports:

* zero cotangent: the gradients of an all-zero cotangent are exactly zero;
* reentrancy: two runs of the backward on the same cotangent differ by at most
  ``nondet_tol`` entrywise (a NaN in both runs is the same value);
* batched gradients: ``jax.vmap`` of the gradient over a batch equals one call per
  batch entry within a relative bound, normwise per gradient leaf (``TIGHT`` for two
  float64 programs computing the same math; gradcheck's ``rtol`` where larger);
* gradient dtypes: each gradient has its input's dtype and shape (``float0`` for
  an integer or boolean array input).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._compare import Mismatch, leaf_mismatches, widened
from ._dtype_refusal import deliberate, refused_by_jax, tracing_error
from ._leaves import FloatLeaves, input_label

__all__ = [
    "TIGHT",
    "DtypeMismatch",
    "batched_gradients",
    "batched_mismatches",
    "complex_counterpart",
    "dtype_refusal",
    "gradient_dtypes",
    "loop_and_vmap",
    "pick",
    "refusal",
    "reentrancy",
    "stacked",
    "zero_cotangent",
    "zero_like",
]

# Normwise relative tolerance between two float64 programs that compute the same math
# (jit against eager, vmap against a loop ...): far above float64 rounding, far below a bug.
TIGHT = 1e-9


def zero_like(leaf: Any) -> Any:
    """The zero cotangent of an output leaf (``float0`` for an integer or boolean one)."""
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
        return jnp.zeros(leaf.shape, leaf.dtype)
    return np.zeros(leaf.shape, jax.dtypes.float0)


def zero_cotangent(pullback: Callable[[Any], Sequence[Any]], zero: Any) -> list[Mismatch]:
    """The gradients of the zero cotangent ``zero`` that are not exactly zero."""
    grads = [widened(g) for g in pullback(zero)]
    zeros = [np.zeros(g.shape) for g in grads]
    return leaf_mismatches(zeros, grads, atol=0.0, rtol=0.0, normwise=False)


def reentrancy(
    runs: dict[str, Callable[[], Sequence[Any]]], nondet_tol: float
) -> tuple[str, list[Mismatch]] | None:
    """Runs each backward of ``runs`` (``{how: run}``) twice: the first way whose two
    runs differ by more than ``nondet_tol`` somewhere, with the mismatches (the first
    run is ``expected``), or ``None``."""
    for how, run in runs.items():
        first, second = run(), run()
        found = leaf_mismatches(
            first, second, atol=nondet_tol, rtol=0.0, normwise=False, nan_equal=True
        )
        if found:
            return how, found
    return None


Looped = tuple[Any, Any]  # (the loop's results stacked, vmap's results or its exception)


def loop_and_vmap(
    parts: dict[str, tuple[Callable, Sequence[tuple], tuple, tuple]],
    jit: Callable[[Callable], Callable] = jax.jit,
) -> dict:
    """Each part's function called once per batch entry and under ``jax.vmap``.

    ``parts`` maps a name to ``(fn, items, batched_args, in_axes)``: ``fn(*item)``
    for each item (the loop), and ``jax.vmap(fn, in_axes)(*batched_args)``. All of it
    runs in one compiled program, jitted with ``jit`` (one compilation, not two per
    part); should that program raise, each part's loop and vmap run alone, so an
    error is attributed to the part, and the side, that raises it.

    Returns:
        ``{name: (looped, batched)}``: the loop's results stacked on the host, and
        vmap's results, or the exception that ``jax.vmap`` of the part raised (that
        is a finding). An error of a loop itself propagates.
    """

    def everything(items, batched_args):
        return {
            name: (
                [fn(*item) for item in items[name]],
                jax.vmap(fn, in_axes=axes)(*batched_args[name]),
            )
            for name, (fn, _, _, axes) in parts.items()
        }

    items = {name: list(part[1]) for name, part in parts.items()}
    batched_args = {name: part[2] for name, part in parts.items()}
    try:
        merged = jit(everything)(items, batched_args)
    except Exception:  # noqa: BLE001 -- run the parts alone below, to attribute the error
        merged = None
    results = {}
    for name, (fn, part_items, args, axes) in parts.items():
        if merged is not None:
            looped, batched = merged[name]
        else:
            one = jax.jit(fn)
            looped = [one(*item) for item in part_items]
            try:
                batched = jax.jit(jax.vmap(fn, in_axes=axes))(*args)
            except Exception as err:  # noqa: BLE001 -- any failure of vmap is the finding
                batched = err
        results[name] = (stacked(looped), batched)
    return results


def stacked(results: Sequence[Any]) -> Any:
    return jax.tree_util.tree_map(lambda *leaves: np.stack(leaves), *results)


def pick(tree: Any, b: int) -> Any:
    """Batch entry ``b`` of each array leaf (rank 0 leaves are not batched)."""
    return jax.tree_util.tree_map(lambda leaf: leaf[b] if np.ndim(leaf) else leaf, tree)


def batched_mismatches(looped: Any, batched: Any, size: int, rtol: float) -> list[Mismatch]:
    """Per leaf of ``size`` stacked results whose vmapped counterpart differs by more
    than ``rtol`` normwise, its worst entry: ``direction`` is the batch entry,
    ``in_element`` the flat index inside the leaf, ``expected`` the loop's."""
    looped = [widened(x) for x in jax.tree_util.tree_leaves(looped)]
    batched = [widened(x) for x in jax.tree_util.tree_leaves(batched)]
    found = []
    for mismatch in leaf_mismatches(looped, batched, atol=0.0, rtol=rtol, normwise=True):
        per_entry = looped[mismatch.in_block].size // size
        b, element = divmod(mismatch.in_element, per_entry)
        found.append(dataclasses.replace(mismatch, in_element=element, direction=b))
    return found


def batched_gradients(
    gradient: Callable[[Any, Any], Sequence[Any]],
    batch: Any,
    cotangents: Sequence[Any],
    rtol: float = TIGHT,
) -> list[Mismatch] | Exception:
    """``gradient(item, u)`` under ``jax.vmap`` over ``batch`` (``None``: not batched;
    array leaves of rank 0 are not batched either) and ``cotangents``, against one call
    per batch entry, within ``rtol`` normwise per gradient leaf (``TIGHT``: two float64
    programs; gradcheck passes its caller's ``rtol`` when larger, for a function that
    computes in a lower precision inside).

    Returns:
        Per gradient leaf that differs, its worst entry (``batched_mismatches``), or
        the exception ``jax.vmap`` of the gradient raised (that is the finding).
    """
    items = [(None if batch is None else pick(batch, b), u) for b, u in enumerate(cotangents)]
    part = (gradient, items, (batch, stacked(cotangents)), (None if batch is None else 0, 0))
    looped, batched = loop_and_vmap({"gradient": part})["gradient"]
    if isinstance(batched, Exception):
        return batched
    return batched_mismatches(looped, batched, len(cotangents), rtol)


@dataclasses.dataclass(frozen=True)
class DtypeMismatch:
    """A gradient whose dtype or shape is not its input's."""

    label: str  # the input, e.g. "input 1['w']"
    index: int  # its positional argument
    path: str  # its key path inside that argument
    primal: Any  # the input (its dtype and shape)
    grad: Any  # the gradient (its dtype and shape)
    expected: np.dtype  # the dtype the gradient should have


def refusal(fn: Callable, values: list, dtype: Any) -> str | None:
    """Why ``fn`` refuses ``values`` of ``dtype`` when traced, or ``None``: a dtype an op
    does not accept is not a bug. A refusal is raised while tracing, before any
    computation, and its message names the dtype, whatever the exception's class (an op
    whose kernels have no handler for it raises a ``TypeError``; JAX refuses a bfloat16
    FFT with a ``ValueError``); and it counts only on evidence (``_dtype_refusal``): the
    op's own deliberate check, or JAX refusing the dtype for the op's math with every
    float value in it (not a dtype the op mixes in itself, ``lax.add`` of a bfloat16 and
    a float32). Any other error is left for the check to report."""
    name = jnp.dtype(dtype).name
    err = tracing_error(fn, values)
    if err is not None:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        if (
            name in first
            and not isinstance(err, (jax.errors.JAXTypeError, jax.errors.JAXIndexError))
            and (deliberate(err) or refused_by_jax(fn, values, dtype))
        ):
            return f"{name}: the op does not take it ({type(err).__name__}: {first})"
    return None


def _in_dtype(view: FloatLeaves, dtype: Any) -> tuple[Callable, list, list]:
    """The function of every array leaf of the arguments, those leaves (the float ones
    cast to ``dtype``; ``None``: each in its own) and their key paths."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(view.args)
    arrays = [p for p, (_, leaf) in enumerate(flat) if isinstance(leaf, (jax.Array, np.ndarray))]
    leaves = [leaf for _, leaf in flat]
    for p in view.positions:
        own = leaves[p].dtype
        wanted = own if dtype is None else complex_counterpart(own, dtype)
        leaves[p] = jnp.asarray(leaves[p], wanted)

    def fn(*values):
        new = list(leaves)
        for p, value in zip(arrays, values, strict=True):
            new[p] = value
        return view.func(*jax.tree_util.tree_unflatten(treedef, new))

    return fn, [leaves[p] for p in arrays], [flat[p][0] for p in arrays]


def complex_counterpart(leaf_dtype: Any, dtype: Any) -> np.dtype:
    """``dtype`` for a real leaf; for a complex leaf, the complex dtype of ``dtype``'s
    precision (complex128 for float64, complex64 for float32 and for bfloat16 and
    float16, which have no complex counterpart)."""
    if not jnp.issubdtype(leaf_dtype, jnp.complexfloating):
        return np.dtype(dtype)
    return np.dtype(np.complex128 if np.dtype(dtype) == np.float64 else np.complex64)


def dtype_refusal(view: FloatLeaves, dtype: Any) -> str | None:
    """Why the function refuses its float inputs in ``dtype`` (``refusal``), or ``None``."""
    fn, primals, _ = _in_dtype(view, dtype)
    return refusal(fn, primals, dtype)


def gradient_dtypes(view: FloatLeaves, dtype: Any) -> DtypeMismatch | None:
    """The first gradient whose dtype or shape is not its input's, with the float inputs
    of ``view`` in ``dtype`` (``None``: each in its own dtype); ``None`` if there is none.

    Decided when tracing (``jax.eval_shape``): nothing is compiled or run. Every array
    leaf of the arguments is an input here: an integer or boolean one must get a
    ``float0`` gradient.

    Raises:
        NotImplementedError: where the function has no kernel for ``dtype``.
    """
    fn, primals, paths = _in_dtype(view, dtype)

    def gradients(*values):
        out, pullback = jax.vjp(fn, *values)
        return pullback(jax.tree_util.tree_map(zero_like, out))

    grads = jax.eval_shape(gradients, *primals)
    for path, primal, grad in zip(paths, primals, grads, strict=True):
        inexact = jnp.issubdtype(primal.dtype, jnp.inexact)
        expected = np.dtype(primal.dtype) if inexact else np.dtype(jax.dtypes.float0)
        if np.dtype(grad.dtype) != expected or tuple(grad.shape) != tuple(primal.shape):
            index, sub = path[0].idx, jax.tree_util.keystr(path[1:])
            return DtypeMismatch(input_label(path), index, sub, primal, grad, expected)
    return None
