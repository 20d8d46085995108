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
    refused_forward_mode,
    require_forward_mode,
    vjp,
)
from ._op import (
    CheckFailed,
    OpUnderTest,
)
from ._plain import strip_custom_rules, underlying_error

__all__ = ["fwd_over_fwd", "fwd_over_rev", "gradgradcheck", "rev_over_fwd"]


# What an op raises where it declares that its backward cannot be differentiated:
# jaxext's `once_differentiable`, and JAX's Pallas TPU ops (flash and splash attention
# raise `NotImplementedError("Higher-order AD not supported")` from their rules).
_DECLARED = ("Higher-order AD not supported",)
# JAX's own NotImplementedError for a primitive rule it lacks (newer JAX raises it for the
# transpose of a `pallas_call`): JAX's limit, judged by the plain-JAX evidence, not a
# declaration of the op's.
_JAX_MISSING_RULE = ("Transpose rule", "Differentiation rule", "Batching rule", "JVP rule")


def _declared_limit(err: BaseException) -> str | None:
    """The declaration that the backward cannot be differentiated again, found in ``err``
    or an exception it was raised from (``raise ... from``), worded from the declaration
    alone (the same on every row, whatever wraps it), or ``None``: jaxext's
    ``once_differentiable``, a rule's "Higher-order AD not supported" (JAX's Pallas flash
    and splash attention), or any ``NotImplementedError`` met while differentiating the
    op again (``mha_reference``'s bare one), not JAX's own for a primitive rule it lacks."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        line = first_line(err)
        if "once_differentiable" in line:
            return f"the backward is once_differentiable ({line})"
        jax_rule = line.startswith(_JAX_MISSING_RULE) and line.endswith("not implemented")
        if (isinstance(err, NotImplementedError) and not jax_rule) or any(
            w in line for w in _DECLARED
        ):
            said = f"{type(err).__name__}: {line}" if line else type(err).__name__
            return (
                "differentiating the op again is declared not implemented, by the op or "
                f"by JAX ({said})"
            )
        err = err.__cause__
    return None


def _backward_limit(op: OpUnderTest, settings: Settings) -> str | None:
    """Why JAX itself cannot differentiate the op's backward, or ``None``; found once per
    op and the same on every second-order row it reaches.

    The backward itself runs, and JAX refuses to differentiate it in reverse or in
    forward mode with every custom rule inside it stripped (a Pallas kernel, which
    ``jax.vjp`` cannot linearize; a ``while_loop`` with a dynamic trip count). All four
    second-order rows differentiate the backward (``rev_over_fwd`` and ``fwd_over_fwd``
    against reverse over reverse), so whichever exception surfaces in a row (JAX's
    ``ValueError`` for a linearization, a transpose's ``AssertionError``, jaxext's
    ``TypeError`` for a forward mode it could not derive), the cause is this one.
    """
    if "backward_limit" in op.cache:
        return op.cache["backward_limit"]
    op.cache["backward_limit"] = None
    u = op.cotangent(np.random.default_rng(settings.seed))

    def backward(*p):
        return vjp(op.call, p, u)

    try:
        grads = jax.jit(backward)(*op.primals)
        plain = strip_custom_rules(backward)
    except Exception:  # noqa: BLE001 -- the backward itself fails: that is the finding
        return None
    compositions = {
        "reverse": lambda *p: jax.vjp(plain, *p)[1](grads),
        "forward": lambda *p: jax.jvp(plain, p, p)[1],
    }
    refused = []
    for how, composition in compositions.items():
        try:
            jax.jit(composition)(*op.primals)
        except Exception as plain_err:  # noqa: BLE001 -- the evidence itself
            refused.append(f"in {how} mode: {type(plain_err).__name__}: {first_line(plain_err)}")
    if refused:
        op.cache["backward_limit"] = (
            "the backward runs but cannot be differentiated, JAX's own limit (plain JAX, "
            f"custom rules inside it stripped, refuses it {'; '.join(refused)})"
        )
    return op.cache["backward_limit"]


def _skip_if_not_differentiable(op: OpUnderTest, settings: Settings, err: Exception) -> None:
    """Raises ``Skip`` if ``err``, raised by a second-order row, has a cause that is no
    bug of the op: the op declares its backward not differentiable
    (``once_differentiable``, "Higher-order AD not supported"), or it has no forward mode
    and the row met that refusal (``refused_forward_mode``), or JAX itself cannot
    differentiate the backward (``_backward_limit``). A mismatch stays a FAIL, and so
    does a backward that raises only because a custom rule inside it does (stripped,
    JAX differentiates it)."""
    raised = underlying_error(err)
    if raised is None:
        return
    no_forward_mode = refused_forward_mode(op, raised)
    if no_forward_mode is not None:
        raise Skip(no_forward_mode) from err
    # The first second-order row to find the backward not differentiable names the cause
    # for all of them: a row may meet the op's declaration where another met JAX's
    # refusal first (flash attention: a linearization JAX refuses, then "Higher-order AD
    # not supported"), and one cause gets one reason.
    if "not_differentiable" not in op.cache:
        reason = _declared_limit(raised) or _backward_limit(op, settings)
        if reason is None:
            return
        op.cache["not_differentiable"] = reason
    raise Skip(op.cache["not_differentiable"]) from err


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
