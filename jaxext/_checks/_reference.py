"""An op against its reference: values, VJPs and JVPs against plain-JAX autodiff in float64.

Kernel libraries test a kernel against its XLA reference: the same math written in plain
JAX, differentiated by JAX. ``gradcheck(..., reference=fn)`` and
``opcheck(..., reference=fn)`` do that for an op that computes in float32 (or refuses
float64), where finite differences in float64 cannot judge it: the op runs at its inputs
in the dtypes it takes; the reference runs at the same values widened to float64, under
JAX's own autodiff. Its values, its VJP for random cotangents and (with forward mode) its
JVP for random tangents must agree, normwise per leaf
(``max |got - expected| <= rtol * max |expected|``), within a tolerance from the dtypes
the op computes in (``REFERENCE_RTOL``): far above what rounding in that dtype does to a
small op, far below a 1% error in a gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._compare import leaf_mismatches, unravel, widened
from ._dtype_tolerance import narrowest
from ._leaves import wide_dtype

__all__ = ["REFERENCE_RTOL", "random_like", "reference_mismatch", "reference_rtol"]

# Normwise relative tolerance of an op computing in each dtype against its float64
# reference (about 1000 ulps of float32; torch's assert_close allows 1e-7 in float64).
REFERENCE_RTOL: dict[np.dtype, float] = {
    np.dtype(jnp.float64): 1e-7,
    np.dtype(jnp.float32): 1e-4,
    np.dtype(jnp.float16): 1e-2,
    np.dtype(jnp.bfloat16): 6.4e-2,
}


def reference_rtol(dtypes: Iterable[Any]) -> float:
    """``REFERENCE_RTOL`` of the narrowest of ``dtypes`` (float64's where there is none).

    Example:
        >>> import numpy as np
        >>> from jaxext._checks._reference import reference_rtol
        >>> reference_rtol([np.float64, np.float32])
        0.0001
    """
    dtype = narrowest(dtypes)
    if dtype is None:
        return REFERENCE_RTOL[np.dtype(jnp.float64)]
    if dtype in REFERENCE_RTOL:
        return REFERENCE_RTOL[dtype]
    return REFERENCE_RTOL[np.dtype(jnp.float32)] * float(
        jnp.finfo(dtype).eps / jnp.finfo(jnp.float32).eps
    )


def _float_leaves(tree: Any) -> list[tuple[str, Any]]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [
        (jax.tree_util.keystr(path), leaf)
        for path, leaf in flat
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.inexact)
    ]


def _normal(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    if jnp.issubdtype(dtype, jnp.complexfloating):
        pairs = rng.standard_normal((*shape, 2))
        return pairs[..., 0] + 1j * pairs[..., 1]
    return rng.standard_normal(shape)


def random_like(rng: np.random.Generator, tree: Any) -> tuple[Any, Any]:
    """A random cotangent for ``tree``'s leaves (their dtypes) and its float64 twin
    (float0 zeros for the integer leaves of both)."""

    def draw(leaf):
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            zero = np.zeros(leaf.shape, jax.dtypes.float0)
            return zero, zero
        value = _normal(rng, leaf.shape, leaf.dtype)
        return jnp.asarray(value, leaf.dtype), jnp.asarray(value, wide_dtype(leaf.dtype))

    pairs = jax.tree_util.tree_map(draw, tree)
    first = jax.tree_util.tree_map(lambda _, p: p[0], tree, pairs)
    second = jax.tree_util.tree_map(lambda _, p: p[1], tree, pairs)
    return first, second


def _compare(got: Any, expected: Any, what: str, rtol: float) -> str | None:
    g_leaves, e_leaves = _float_leaves(got), _float_leaves(expected)
    if [p for p, _ in g_leaves] != [p for p, _ in e_leaves]:
        return (
            f"{what}: the structures differ: {[p for p, _ in g_leaves]} from the op, "
            f"{[p for p, _ in e_leaves]} from the reference."
        )
    for (path, a), (_, e) in zip(g_leaves, e_leaves, strict=True):
        a, e = widened(a), widened(e)
        if a.shape != e.shape:
            return f"{what}{path}: shape {a.shape} from the op, {e.shape} from the reference."
        for m in leaf_mismatches([e], [a], atol=0.0, rtol=rtol, normwise=True, nan_equal=True)[:1]:
            element = unravel(m.in_element, a.shape)
            return (
                f"{what}{path}: element {element} is {m.actual:.10g}, the reference's "
                f"{m.expected:.10g} (abs error {abs(m.actual - m.expected):.3e}, allowed "
                f"{m.allowed:.3e}: rtol {rtol:g} of the largest; {m.count} of {m.total} "
                "elements differ)."
            )
    return None


def reference_mismatch(
    fn: Callable[..., Any],
    reference: Callable[..., Any],
    primals: Sequence[Any],
    labels: Sequence[str],
    *,
    rtol: float,
    forward: bool,
    reverse: bool = True,
    seed: int = 0,
    draws: int = 2,
) -> str | None:
    """How ``fn`` at ``primals`` disagrees with ``reference`` in float64, or ``None``.

    Call under x64 (``float64_numerics``). ``fn`` runs at ``primals`` as given; the
    reference at them widened to float64 (complex128). Compared: the values, the VJP
    for ``draws`` random cotangents and, where ``forward``, the JVP for as many random
    tangents.

    Args:
        fn: the op, a function of the arrays ``primals``.
        reference: the same math in plain JAX, a function of the same arguments.
        primals: the float arrays to differentiate.
        labels: how messages name each of ``primals``.
        rtol: normwise relative tolerance (``reference_rtol``).
        forward: compare the JVP.
        reverse: compare the VJP.
        seed: seed of the random cotangents and tangents.
        draws: how many cotangents (and tangents).

    Returns:
        The diagnostic of the first disagreement, or ``None``.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jaxext._checks._reference import reference_mismatch
        >>> def op(x):  # a float32 kernel: float32 inside whatever it is given
        ...     return jnp.sin(x.astype(jnp.float32)).astype(x.dtype)
        >>> with jax.enable_x64(True):
        ...     x = jnp.linspace(0.0, 1.0, 5)
        ...     print(reference_mismatch(op, jnp.sin, [x], ["input 0"], rtol=1e-4, forward=True))
        None
    """
    rng = np.random.default_rng(seed)
    primals = tuple(jnp.asarray(p) for p in primals)
    wide = tuple(p.astype(wide_dtype(p.dtype)) for p in primals)
    out, pullback = jax.vjp(fn, *primals)
    expected, reference_pullback = jax.vjp(reference, *wide)
    found = _compare(out, expected, "output", rtol)
    for _ in range(draws if found is None else 0):
        u, u_wide = random_like(rng, out)
        if reverse:
            got, want = pullback(u), reference_pullback(u_wide)
            for label, g, e in zip(labels, got, want, strict=True):
                found = found or _compare(g, e, f"VJP of {label} (random cotangent)", rtol)
        if found is None and forward:
            t = [_normal(rng, p.shape, p.dtype) for p in primals]
            found = _compare(
                jax.jvp(fn, primals, _cast(t, primals))[1],
                jax.jvp(reference, wide, _cast(t, wide))[1],
                "JVP (random tangent)",
                rtol,
            )
        if found is not None:
            break
    return found


def _cast(values: Sequence[np.ndarray], like: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    return tuple(jnp.asarray(v, p.dtype) for v, p in zip(values, like, strict=True))
