"""opcheck's row about the backward's linearity in its cotangent (``linearity``).

A VJP is linear in its cotangent: ``bwd(a g1 + b g2) = a bwd(g1) + b bwd(g2)``. A
backward that clips ``g``, adds a term that does not depend on it or takes ``|g|`` is
not, and ``gradcheck`` can miss it: its cotangents are one-hot ones, on which a clip at
``|g| <= 2`` is the identity. Forward mode of a :class:`jaxext.custom_vjp` relies on the
same property: it transposes the backward, or evaluates it row by row on unit cotangents.
Where the backward calls something forward mode's linearity walk cannot see into (a host
callback, an FFI kernel, a C++ kernel of ``jaxext.cpp_extension``, a Pallas kernel), the
walk trusts it to be linear; this row is where that trust is tested, numerically.

The row runs for every op, not only for those with such a call: it runs the op's
jitted pullback (``op.pullback``, the program ``zero_cotangent`` and ``reentrancy``
run, compiled once) three times, which costs next to nothing, and a backward nonlinear
in ``g`` is a bug wherever the nonlinearity is. Its detail names the calls the walk
trusts, where there are any. The tolerance is the op's (``_dtype_tolerance``), normwise
per gradient against the sizes of the two terms, plus ``nondet_tol`` for a backward
whose runs differ.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._jaxpr import inner_jaxprs
from .._compare import unravel, widened
from .._settings import Settings
from ._common import Skip, vjp
from ._op import CheckFailed, OpUnderTest, float_output_leaves

__all__ = ["linearity"]

# The combination a g1 + b g2 of two random cotangents: a + b != 1, so a term that does
# not depend on g (bwd(g) = J^T g + c) does not cancel, and |a g1| is often beyond 1.
_A, _B = 3.0, -0.5
# Calls whose insides forward mode's linearity walk cannot see (it trusts them).
_OPAQUE = ("pure_callback", "io_callback", "ffi_call", "pallas_call")


def linearity(op: OpUnderTest, settings: Settings) -> str:
    rng = np.random.default_rng(settings.seed + 13)
    primals = op.primals
    g1, g2 = op.cotangent(rng), op.cotangent(rng)
    if not float_output_leaves(g1):
        raise Skip("the op has no floating-point output: no cotangent to combine")
    mixed = jax.tree_util.tree_map(_combine, g1, g2)
    got = op.pullback(primals, mixed)
    first, second = op.pullback(primals, g1), op.pullback(primals, g2)
    trusted = _trusted_calls(op, g1)
    for label, m, x1, x2 in zip(op.labels, got, first, second, strict=True):
        _assert_linear(f"gradient of {label}", m, x1, x2, op.rtol, settings.nondet_tol, trusted)
    detail = f"{_combined('g')} = {_combined('bwd')} for random cotangents g1, g2"
    if trusted:
        detail += (
            f"; the backward calls {', '.join(trusted)}, which forward mode's linearity "
            "walk cannot see into: tested here"
        )
    return detail


def _combined(of: str) -> str:
    """``"bwd(3 g1 - 0.5 g2)"`` (``of="g"``) or ``"3 bwd(g1) - 0.5 bwd(g2)"`` (``"bwd"``)."""
    sign = "-" if _B < 0 else "+"
    if of == "g":
        return f"bwd({_A:g} g1 {sign} {abs(_B):g} g2)"
    return f"{_A:g} bwd(g1) {sign} {abs(_B):g} bwd(g2)"


def _combine(a: Any, b: Any) -> Any:
    if not jnp.issubdtype(a.dtype, jnp.inexact):
        return a  # float0: the cotangent of a non-float output
    return _A * a + _B * b  # a JAX array: keeps its dtype (weakly typed Python floats)


def _assert_linear(
    what: str, got: Any, first: Any, second: Any, rtol: float, atol: float, trusted: list[str]
) -> None:
    got, first, second = widened(got), widened(first), widened(second)
    expected = _A * first + _B * second
    scale = abs(_A) * _max_abs(first) + abs(_B) * _max_abs(second)
    allowed = atol + rtol * scale
    error = np.abs(got - expected)
    both_nan = np.isnan(got) & np.isnan(expected)
    bad = ~(error <= allowed) & ~both_nan
    if not bad.any():
        return
    worst = int(np.argmax(np.where(bad, np.nan_to_num(error, nan=np.inf), -1.0)))
    element = unravel(worst, got.shape)
    flat_got, flat_expected = got.reshape(-1), expected.reshape(-1)
    where = (
        f" It calls {', '.join(trusted)}, which forward mode's linearity walk cannot see "
        "into and trusts to be linear (a jax.jvp derived from this backward is then not "
        "the derivative of anything)."
        if trusted
        else ""
    )
    raise CheckFailed(
        f"{what}: {_combined('g')} differs from {_combined('bwd')} "
        f"(random cotangents g1, g2): element {element} is {flat_got[worst]:.10g}, expected "
        f"{flat_expected[worst]:.10g} (abs error {error.reshape(-1)[worst]:.3e}, allowed "
        f"{allowed:.3e}; {int(bad.sum())} of {bad.size} elements differ): the backward is not "
        f"linear in its cotangent, as a VJP is.{where}"
    )


def _max_abs(x: np.ndarray) -> float:
    finite = np.abs(x[np.isfinite(x)])
    return float(finite.max()) if finite.size else 0.0


def _trusted_calls(op: OpUnderTest, u: Any) -> list[str]:
    """The calls in the op's VJP that forward mode's linearity walk trusts (``ffi_call``
    with its target), in order of appearance; none where the VJP does not trace."""
    found: dict[str, None] = {}

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in _OPAQUE:
                target = eqn.params.get("target_name")
                found[f"{name} `{target}`" if isinstance(target, str) else name] = None
            for body in inner_jaxprs(eqn):
                walk(body.jaxpr)

    try:
        walk(jax.make_jaxpr(lambda *p: vjp(op.call, p, u))(*op.primals).jaxpr)
    except Exception:  # noqa: BLE001 -- the pullback above ran; no word on its calls
        return []
    return list(found)
