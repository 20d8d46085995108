"""opcheck's rows about second derivatives.

``gradgradcheck`` and ``fwd_over_rev`` (the VJP differentiated in reverse and in forward
mode, against central differences), ``rev_over_fwd`` and ``fwd_over_fwd`` (the JVP
differentiated, against reverse over reverse). A backward that cannot be differentiated
(declared ``once_differentiable``, or JAX's own limit) is a SKIP.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._compare import widened
from .._settings import Settings
from ._common import (
    Skip,
    first_line,
    gradient_check,
    inner_product,
    jitted_together,
    reference_check,
    require_forward_mode,
    vjp,
)
from ._op import (
    CheckFailed,
    OpUnderTest,
)
from ._plain import same_failure, strip_custom_rules

__all__ = ["fwd_over_fwd", "fwd_over_rev", "gradgradcheck", "rev_over_fwd"]


def _skip_if_not_differentiable(op: OpUnderTest, settings: Settings, err: Exception) -> None:
    """Raises ``Skip`` if ``err``, raised while differentiating the backward, means the
    backward cannot be differentiated, by declaration (``once_differentiable``) or by
    JAX's own limit: the backward itself runs, and JAX refuses to differentiate it the
    same way with every custom rule inside it stripped (a ``while_loop`` with a dynamic
    trip count, which reverse mode cannot differentiate). A backward that raises only
    because a custom rule inside it does stays the op's FAIL."""
    if isinstance(err, CheckFailed):
        return
    if isinstance(err, RuntimeError) and "once_differentiable" in str(err):
        raise Skip(f"the backward is once_differentiable ({first_line(err)})") from err
    u = op.cotangent(np.random.default_rng(settings.seed))

    def backward(*p):
        return vjp(op.call, p, u)

    try:
        grads = jax.jit(backward)(*op.primals)
    except Exception:  # noqa: BLE001 -- the backward itself fails: that is the finding
        return
    plain = strip_custom_rules(backward)
    compositions = {
        "reverse": lambda *p: jax.vjp(plain, *p)[1](grads),
        "forward": lambda *p: jax.jvp(plain, p, p)[1],
    }
    for how, composition in compositions.items():
        try:
            jax.jit(composition)(*op.primals)
        except Exception as plain_err:  # noqa: BLE001 -- the evidence itself
            if same_failure(err, plain_err):
                raise Skip(
                    "the backward runs but cannot be differentiated, JAX's own limit (plain "
                    f"JAX, custom rules inside it stripped, refuses it the same way in {how} "
                    f"mode): {type(err).__name__}: {first_line(err)}"
                ) from err


def gradgradcheck(op: OpUnderTest, settings: Settings) -> str:
    try:
        if op.reference is not None:
            return reference_check(op, settings, 2, "rev")
        gradient_check(op, settings, 2, "rev")
    except Exception as err:
        _skip_if_not_differentiable(op, settings, err)
        raise
    return "second derivatives (VJP of the VJP) match central differences"


def _second_order(op: OpUnderTest, settings: Settings, outer: str, inner: str) -> None:
    try:
        gradient_check(op, settings, 2, outer, inner)
    except Exception as err:
        _skip_if_not_differentiable(op, settings, err)
        raise


def fwd_over_rev(op: OpUnderTest, settings: Settings) -> str:
    if op.reference is not None:
        try:
            return reference_check(op, settings, 2, "fwd")
        except Exception as err:
            _skip_if_not_differentiable(op, settings, err)
            raise
    _second_order(op, settings, "fwd", "rev")
    return "second derivatives (JVP of the VJP) match central differences"


def _contract(a: Any, b: Sequence[Any]) -> tuple[float, float]:
    """``sum <a_i, b_i>`` and ``sum |a_i * b_i|`` over two lists of arrays (``<a, b> =
    Re sum(a b)`` for complex ones: JAX's pairing of a gradient with a tangent)."""
    pairs = [(widened(x), np.asarray(y)) for x, y in zip(a, b, strict=True)]
    value = sum(float(np.real(np.sum(x * y))) for x, y in pairs)
    return value, sum(float(np.sum(np.abs(x * y))) for x, y in pairs)


def _second_order_forward(op: OpUnderTest, settings: Settings, outer: str) -> str:
    """``D^2 f[u; t, s]`` from the JVP differentiated in ``outer`` mode, against reverse
    over reverse (what ``gradgradcheck`` checks against finite differences)."""
    require_forward_mode(op)
    rng = np.random.default_rng(settings.seed + 11)
    primals, u = op.primals, op.cotangent(rng)
    t, s = op.tangents(rng), op.tangents(rng)
    everything = tuple(range(len(primals)))

    def jvp_of(*p):  # x -> J(x) t
        return jax.jvp(op.call, p, tuple(t))[1]

    def vjp_of(*p):  # x -> t . J(x)^T u (Re for complex: JAX's pairing)
        pairs = zip(vjp(op.call, p, u), t, strict=True)
        return sum(jnp.real(jnp.sum(g * ti)) for g, ti in pairs)

    if outer == "rev":
        fns = {"got": lambda *p: vjp(jvp_of, p, u)}
        how = "jax.vjp of the JVP"
    else:
        fns = {"got": lambda *p: jax.jvp(jvp_of, p, tuple(s))[1]}
        how = "jax.jvp of the JVP"
    # Reverse over reverse, the same for both checks (the same seed): computed once, in
    # the program of the first of them to run.
    if "reverse_over_reverse" not in op.cache:
        fns["reference"] = jax.grad(vjp_of, argnums=everything)
    try:
        results = jitted_together(op, fns, *primals)
    except Exception as err:
        _skip_if_not_differentiable(op, settings, err)
        raise
    got = results["got"]
    reference = op.cache.setdefault("reverse_over_reverse", results.get("reference"))
    if outer == "rev":
        value, scale = _contract(got, s)
    else:
        value, scale = float(inner_product(u, got)), float(inner_product(u, got, absolute=True))
    expected, expected_scale = _contract(reference, s)
    allowed = op.rtol * max(scale, expected_scale)
    if not abs(value - expected) <= allowed:
        raise CheckFailed(
            f"u . D2f[t, s] = {value:.12g} from {how} but {expected:.12g} from the VJP "
            f"differentiated in reverse mode (random u, t, s; abs difference "
            f"{abs(value - expected):.3e}, allowed {allowed:.3e}): the forward mode is wrong "
            "at second order (a jvp rule that cuts the derivative through a residual?)."
        )
    return f"u . D2f[t, s] from {how} equals reverse over reverse (random u, t, s)"


def rev_over_fwd(op: OpUnderTest, settings: Settings) -> str:
    return _second_order_forward(op, settings, "rev")


def fwd_over_fwd(op: OpUnderTest, settings: Settings) -> str:
    return _second_order_forward(op, settings, "fwd")
