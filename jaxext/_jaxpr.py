"""Where a jaxpr's inner jaxprs live: the one definition every jaxpr walker in jaxext uses.

JAX keeps the jaxprs of calls, loops, branches and custom rules in an equation's
parameters, under names that differ by construct (``jaxpr`` for ``jit``/``pjit`` and
``checkpoint``, ``call_jaxpr`` for ``custom_jvp_call``/``custom_vjp_call``, ``fun_jaxpr``
for older custom rules, ``branches`` for ``cond``, ``body_jaxpr``/``cond_jaxpr`` for
``while``) and in forms that differ too (a ``Jaxpr``, a ``ClosedJaxpr``, a tuple of them).
This module reads them in one place, so that a renamed parameter or primitive (``pjit`` was
renamed ``jit`` once) is one edit.

* :func:`inner_jaxprs`: every jaxpr in an equation's parameters, with its constants.
* :func:`call_body`: the body of a call-like equation, one whose inner jaxpr takes the
  equation's operands in order and returns its results in order (``jit``, ``closed_call``,
  ``remat``, ``custom_jvp_call``, ``custom_vjp_call``, ``custom_vmap_call``), else ``None``.
* :func:`evaluate`: a jaxpr run equation by equation under the caller's transformations,
  chosen calls opened (their bodies run in their place), each operand passed through a
  function: the one evaluator of the checks' rewritten programs (the plain twin's, with
  custom rules stripped; the dtype replay's, every float operand cast).


* :func:`cond_parts`, :func:`scan_parts`, :func:`while_parts`: a branch's or a loop's
  bodies, and its operands split into the groups each body reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax

__all__ = [
    "Body",
    "CondParts",
    "ScanParts",
    "WhileParts",
    "call_body",
    "cond_parts",
    "evaluate",
    "inner_jaxprs",
    "scan_parts",
    "while_parts",
]

# The parameters under which a call-like equation keeps the jaxpr it runs, in the order
# they are tried: jit/pjit/closed_call/checkpoint, then custom_jvp_call/custom_vjp_call/
# then the older custom rules' name, then custom_vmap_call's.
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr", "call")


class Body(NamedTuple):
    """An inner jaxpr and the constants it closes over (empty for an open ``Jaxpr``)."""

    jaxpr: Any
    consts: Sequence[Any]


def _as_body(value: Any) -> Body | None:
    """``value`` as a :class:`Body` where it is a ``Jaxpr`` or ``ClosedJaxpr``, else ``None``.

    A ``ClosedJaxpr`` is unwrapped first: it has ``eqns`` too, and its constants belong
    to the body (a ``jit`` of a function that closes over an array holds them there).
    """
    inner = getattr(value, "jaxpr", None)
    if inner is not None and hasattr(inner, "eqns"):
        return Body(inner, tuple(getattr(value, "consts", ())))
    if hasattr(value, "eqns"):
        return Body(value, ())
    return None


def inner_jaxprs(eqn: Any) -> Iterator[Body]:
    """Every jaxpr in ``eqn``'s parameters, one level down, with its constants.

    Args:
        eqn: a ``JaxprEqn``.

    Returns:
        An iterator of :class:`Body`; parameters that hold a sequence of jaxprs (``cond``'s
        ``branches``) give each of them.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxext._jaxpr import inner_jaxprs
        >>> closed = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x))(1.0)
        >>> [len(b.jaxpr.eqns) for b in inner_jaxprs(closed.jaxpr.eqns[0])]
        [1]
    """
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            body = _as_body(item)
            if body is not None:
                yield body


def call_body(eqn: Any) -> Body | None:
    """The jaxpr a call-like ``eqn`` runs on its operands, else ``None``.

    An equation is call-like when one of its jaxpr parameters takes exactly its operands
    and returns exactly its results, so a walker may carry what it knows of the operands
    into the body and read the results back out.

    Args:
        eqn: a ``JaxprEqn``.

    Returns:
        The body as a :class:`Body`, or ``None`` where ``eqn`` runs no such jaxpr (a
        primitive, a loop, a branch).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxext._jaxpr import call_body
        >>> closed = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x) + 1)(1.0)
        >>> [call_body(eqn) is not None for eqn in closed.jaxpr.eqns]
        [True, False]
    """
    for param in _CALL_PARAMS:
        body = _as_body(eqn.params.get(param))
        if (
            body is not None
            and len(body.jaxpr.invars) == len(eqn.invars)
            and len(body.jaxpr.outvars) == len(eqn.outvars)
        ):
            return body
    return None


def evaluate(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    *,
    opened: Callable[[Any], Body | None] = call_body,
    operand: Callable[[Any], Any] | None = None,
) -> list:
    """``jaxpr`` evaluated equation by equation (each primitive bound again, so the
    caller's transformations trace it), with the body of each equation ``opened`` gives
    evaluated in its place, the same way.

    Args:
        jaxpr: a ``Jaxpr`` (open: its constants given apart).
        consts: the values of its ``constvars``.
        args: the values of its ``invars``.
        opened: the body to run in place of an equation, or ``None`` to bind the
            equation's primitive (default :func:`call_body`: every call-like equation is
            opened, a custom rule's call replaced by the function it wraps).
        operand: applied to each operand of each equation before it runs (``None``: the
            operands as they are).

    Returns:
        The values of its ``outvars``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxext._jaxpr import evaluate
        >>> closed = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x) * 2)(1.0)
        >>> [float(v) for v in evaluate(closed.jaxpr, closed.consts, [0.0])]
        [0.0]
    """
    env: dict = {}

    def read(var: Any) -> Any:
        return var.val if isinstance(var, jax.extend.core.Literal) else env[var]

    for var, value in zip(jaxpr.constvars, consts, strict=True):
        env[var] = value
    for var, value in zip(jaxpr.invars, args, strict=True):
        env[var] = value
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if operand is not None:
            invals = [operand(v) for v in invals]
        body = opened(eqn)
        if body is not None:
            outs = evaluate(body.jaxpr, body.consts, invals, opened=opened, operand=operand)
        else:
            bound = eqn.primitive.get_bind_params(eqn.params)
            subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*subfuns, *invals, **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        for var, value in zip(eqn.outvars, outs, strict=True):
            env[var] = value
    return [read(v) for v in jaxpr.outvars]


# -- branches and loops: their bodies, and which operands each body reads ----------------------


class CondParts(NamedTuple):
    """A ``cond``: ``branches[index](*operands)`` runs."""

    branches: tuple[Body, ...]
    index: Any
    operands: list[Any]


class ScanParts(NamedTuple):
    """A ``scan``: ``body(*consts, *carry, *xs) -> (*carry, *ys)``, ``length`` times."""

    body: Body
    consts: list[Any]
    carry: list[Any]
    xs: list[Any]


class WhileParts(NamedTuple):
    """A ``while``: ``body(*body_consts, *carry) -> carry`` while ``cond(*cond_consts,
    *carry)``."""

    cond: Body
    body: Body
    cond_consts: list[Any]
    body_consts: list[Any]
    carry: list[Any]


def _body(value: Any) -> Body:
    body = _as_body(value)
    if body is None:
        raise TypeError(f"expected a jaxpr; got {type(value).__name__}")
    return body


def cond_parts(eqn: Any, operands: Sequence[Any]) -> CondParts:
    """A ``cond`` equation's branches, and ``operands`` (one per ``eqn.invars``, of any kind:
    values, tracers, what a walker knows of them) as its branch index and branch operands.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxext._jaxpr import cond_parts
        >>> closed = jax.make_jaxpr(lambda p, x: jax.lax.cond(p, jnp.sin, jnp.cos, x))(True, 1.0)
        >>> eqn = closed.jaxpr.eqns[-1]
        >>> parts = cond_parts(eqn, eqn.invars)
        >>> len(parts.branches), len(parts.operands)
        (2, 1)
    """
    ops = list(operands)
    return CondParts(tuple(_body(b) for b in eqn.params["branches"]), ops[0], ops[1:])


def scan_parts(eqn: Any, operands: Sequence[Any]) -> ScanParts:
    """A ``scan`` equation's body, and ``operands`` split into its constants, carry and
    scanned inputs.

    JAX 0.10 records the split as ``num_consts``/``num_carry``; newer JAX as ``ft_in``, a
    flat tree of the three groups (its ``update(...).unpack()``, as JAX's own rules read it).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxext._jaxpr import scan_parts
        >>> step = lambda c, x: (c + x, 2 * c)
        >>> closed = jax.make_jaxpr(lambda c, xs: jax.lax.scan(step, c, xs))(0.0, jnp.ones(3))
        >>> eqn = closed.jaxpr.eqns[-1]
        >>> parts = scan_parts(eqn, eqn.invars)
        >>> len(parts.consts), len(parts.carry), len(parts.xs)
        (0, 1, 1)
    """
    params, ops = eqn.params, list(operands)
    body = _body(params["jaxpr"])
    if "num_consts" in params:
        n_consts, n_carry = params["num_consts"], params["num_carry"]
        return ScanParts(
            body, ops[:n_consts], ops[n_consts : n_consts + n_carry], ops[n_consts + n_carry :]
        )
    consts, carry, xs = params["ft_in"].update(ops).unpack()
    return ScanParts(body, list(consts), list(carry), list(xs))


def while_parts(eqn: Any, operands: Sequence[Any]) -> WhileParts:
    """A ``while`` equation's condition and body, and ``operands`` split into the
    condition's constants, the body's constants and the carry.

    Example:
        >>> import jax
        >>> from jaxext._jaxpr import while_parts
        >>> loop = lambda x: jax.lax.while_loop(lambda c: c < 10.0, lambda c: 2 * c, x)
        >>> eqn = jax.make_jaxpr(loop)(1.0).jaxpr.eqns[-1]
        >>> parts = while_parts(eqn, eqn.invars)
        >>> len(parts.cond_consts), len(parts.body_consts), len(parts.carry)
        (0, 0, 1)
    """
    params, ops = eqn.params, list(operands)
    n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
    return WhileParts(
        _body(params["cond_jaxpr"]),
        _body(params["body_jaxpr"]),
        ops[:n_cond],
        ops[n_cond : n_cond + n_body],
        ops[n_cond + n_body :],
    )
