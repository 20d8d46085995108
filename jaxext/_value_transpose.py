"""A backward re-evaluated by its values, so that transposing it gives the map it computes.

Forward mode of a ``jaxext.custom_vjp`` op transposes its backward ``g -> J^T g``, or the
backward's linearization at ``g = 0`` (``_jvp_from_vjp``). Both go through JAX's derivative
rules of the operations inside, and three kinds of operation have rules that differ from
the values they compute, so that the transpose would differ from reverse mode's numbers:

* ``stop_gradient`` computes the identity and has the derivative 0 (and no transpose):
  the backward's linearization through it is 0, a silent zero.
* A ``custom_jvp`` or ``custom_vjp`` call (every ``jaxext.custom_vjp`` op is a
  ``custom_jvp_call``) computes its primal, and is differentiated by its custom rule,
  which need not be the derivative of those values.
* A product ``g * c`` (or quotient ``g / c``) by a coefficient that does not depend on
  ``g`` transposes to ``t * c``; where a masked branch has an infinite coefficient
  (``where(x > 0, g / sqrt(x), 0)`` at ``x = 0``), the transpose multiplies the zero the
  mask sends back by ``inf``: a NaN that reverse mode never computes.

:func:`by_values` traces the backward once and returns a function that evaluates its jaxpr
with ``stop_gradient`` as the identity, custom derivative calls as their primal bodies
(walked in turn), calls (``jit``, ``remat``) walked through, ``cond`` branches and ``scan``
and ``while`` bodies rebuilt (``lax.switch``, ``lax.scan``, ``lax.while_loop``) around
their bodies read the same way, and those products bound as :data:`scale_p`, whose
transpose keeps a zero cotangent zero (``0 * inf`` is ``0`` there, so a NaN of the
transpose is one the backward's own values hold). A ``dot_general`` with one operand
depending on ``g`` (``@``, ``jnp.dot``, ``einsum``) runs as written where its other operand
is all finite, and else sums its non-finite entries' products through :data:`scale_p` (a
``lax.cond``), up to :data:`SAFE_DOT_MAX_ENTRIES` broadcast entries (a larger one runs as
written: its zero-safe form allocates that broadcast). The result computes the
same values as the backward, and its transpose is the map it computes.

With ``custom_rules=True`` (forward mode's last way, for a call whose primal JAX cannot
transpose) custom derivative calls are kept, differentiated by their rules (trusted, and
listed in ``docs/limitations.md``); the rest is read by its values as above.

What it does not rebuild: a construct carrying a jaxpr other than those (``shard_map``,
``custom_vmap``, a Pallas kernel). Where one holds a ``stop_gradient`` or a custom
derivative call, the function raises ``NotImplementedError`` when called (forward mode
then goes row by row, or raises its named error); otherwise it is kept, and JAX
transposes its body by its rules, so a product inside it is not made zero-safe. Neither
is a ``conv_general_dilated``, nor a complex ``dot_general``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal, Primitive
from jax.interpreters import ad, batching, mlir

from ._jaxpr import Body, call_body, cond_parts, inner_jaxprs, scan_parts, while_parts

__all__ = ["by_values", "scale_p"]

# Calls evaluated by their primal body: their derivative rules are not their values'.
_BY_BODY = {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}
# Calls walked through (their derivative is their body's anyway).
_CALLS = {"jit", "pjit", "closed_call", "core_call", "remat", "remat2", "checkpoint"}


def by_values(
    fn: Callable[..., Any], examples: Sequence[Any], *, custom_rules: bool = False
) -> Callable[..., Any]:
    """``fn`` traced at ``examples`` and re-evaluated by its values (module docstring).

    Args:
        fn: the function, called as ``fn(*examples)``; its inputs are the values it is
            linear in (the backward's cotangents).
        examples: its arguments (arrays or ``jax.ShapeDtypeStruct``s).
        custom_rules: keep ``custom_jvp``/``custom_vjp`` calls as calls, differentiated by
            their rules (trusted: forward mode's last way, for a call whose primal JAX
            cannot transpose); everything else is still read by its values.

    Returns:
        A function of the same arguments and results, computing the same values. Calling
        it raises ``NotImplementedError`` where a construct it cannot rebuild (a
        ``shard_map``, a ``custom_vmap``, a Pallas kernel) holds an operation whose
        derivative rule differs from its values.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxext._value_transpose import by_values
        >>> bwd = lambda g: 3.0 * jax.lax.stop_gradient(g)
        >>> (t,) = jax.linear_transpose(by_values(bwd, [1.0]), 1.0)(1.0)
        >>> float(t)  # the derivative through stop_gradient would be 0
        3.0
    """
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*examples)
    out_tree = jax.tree_util.tree_structure(out_shape)
    jaxpr, consts = closed.jaxpr, list(closed.consts)

    def run(*args: Any) -> Any:
        flat = jax.tree_util.tree_leaves(args)
        out = _eval(jaxpr, consts, flat, [True] * len(flat), custom_rules)
        return jax.tree_util.tree_unflatten(out_tree, out)

    return run


def _eval(
    jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], linear: Sequence[bool], rules: bool
) -> list[Any]:
    """Evaluates ``jaxpr``; ``linear`` flags the inputs that depend on the linear inputs;
    ``rules``: custom derivative calls kept (``by_values``'s ``custom_rules``)."""
    env: dict[Any, tuple[Any, bool]] = {}
    for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = (c, False)
    for v, a, f in zip(jaxpr.invars, args, linear, strict=True):
        env[v] = (a, f)

    def read(atom: Any) -> tuple[Any, bool]:
        return (atom.val, False) if isinstance(atom, Literal) else env[atom]

    for eqn in jaxpr.eqns:
        read_in = [read(a) for a in eqn.invars]
        vals, flags = [v for v, _ in read_in], [f for _, f in read_in]
        outs = _eval_eqn(eqn, vals, flags, rules)
        dependent = any(flags)
        for v, o in zip(eqn.outvars, outs, strict=True):
            env[v] = (o, dependent)
    return [read(v)[0] for v in jaxpr.outvars]


def _eval_eqn(eqn: Any, vals: list[Any], flags: list[bool], rules: bool) -> list[Any]:
    name = eqn.primitive.name
    if any(flags) and not (rules and name in _BY_BODY):
        if name == "stop_gradient":
            return list(vals)
        if name in ("mul", "div") and flags[0] != flags[1] and not (name == "div" and flags[1]):
            x, c = (vals[0], vals[1]) if flags[0] else (vals[1], vals[0])
            return [scale_p.bind(x, c, divide=name == "div")]
        if name == "dot_general" and flags[0] != flags[1] and _real(vals):
            return [_zero_safe_dot(eqn, vals, linear_lhs=flags[0])]
        if name in _BY_BODY or name in _CALLS:
            body = call_body(eqn)
            if body is not None:
                return _eval(body.jaxpr, list(body.consts), vals, flags, rules)
        if name in _LOOPS:
            with eqn.ctx.manager:
                return _LOOPS[name](eqn, vals, flags, rules)
        found = _rule_not_values_inside(eqn)
        if found is not None:
            raise NotImplementedError(
                f"`{name}` holds `{found}`, whose derivative rule is not its values', and "
                f"forward mode cannot rebuild a `{name}` to read it by its values"
            )
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: Sequence[Any] = ()
    if isinstance(params, tuple):  # (subfuns, params) in older JAX
        subfuns, params = params
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*subfuns, *vals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _rule_not_values_inside(eqn: Any) -> str | None:
    """The name of a ``stop_gradient`` or custom derivative call in ``eqn``'s inner jaxprs,
    at any depth, else ``None``. (Custom rules count even where ``by_values`` keeps them,
    ``custom_rules``: only those it reaches are trusted.)"""
    for body in inner_jaxprs(eqn):
        for inner in body.jaxpr.eqns:
            name = inner.primitive.name
            if name == "stop_gradient" or name in _BY_BODY:
                return name
            found = _rule_not_values_inside(inner)
            if found is not None:
                return found
    return None


# -- dot_general: a product summed, zero-safe where its coefficient is not finite ------------


def _real(vals: Sequence[Any]) -> bool:
    return all(jnp.issubdtype(jnp.result_type(v), jnp.floating) for v in vals)


# The most entries (batch x free x free x contracting) a zero-safe product may have: its
# non-finite part is summed from that broadcast of elementwise products, which XLA allocates
# whether the conditional runs it or not, once per tangent under jacfwd's vmap (64 KiB of
# float32 each here). A larger product runs as written, transposed by JAX's own rule.
SAFE_DOT_MAX_ENTRIES = 2**14


def _zero_safe_dot(eqn: Any, vals: list[Any], *, linear_lhs: bool) -> Any:
    """``dot_general(lhs, rhs)``, one operand linear: as written where the other (the
    coefficient) is all finite; else its finite part as written plus its non-finite
    entries' products as :data:`scale_p`, summed, so that the transpose keeps a zero
    cotangent zero against ``inf`` (a ``lax.cond``, not a branch on traced values). A
    product of more than :data:`SAFE_DOT_MAX_ENTRIES` broadcast entries runs as written."""
    params = eqn.params
    out_dtype = eqn.outvars[0].aval.dtype
    coef = vals[1] if linear_lhs else vals[0]
    (contracting, _), _ = params["dimension_numbers"]
    lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
    entries = math.prod(lhs.shape) * math.prod(rhs.shape)
    entries //= max(math.prod(lhs.shape[d] for d in contracting), 1)  # counted twice above
    entries //= max(math.prod(lhs.shape[d] for d in params["dimension_numbers"][1][0]), 1)
    if entries > SAFE_DOT_MAX_ENTRIES:
        return lax.dot_general_p.bind(*vals, **params)

    def dot(lhs: Any, rhs: Any) -> Any:
        return lax.dot_general_p.bind(lhs, rhs, **params)

    def with_coef(c: Any) -> list[Any]:
        return [vals[0], c] if linear_lhs else [c, vals[1]]

    def as_written(c: Any) -> Any:
        return dot(*with_coef(c))

    def safe(c: Any) -> Any:
        finite = jnp.isfinite(c)
        summed = dot(*with_coef(jnp.where(finite, c, jnp.zeros_like(c))))
        rest = _products_summed(
            *with_coef(jnp.where(finite, jnp.zeros_like(c), c)),
            params["dimension_numbers"],
            out_dtype,
            linear_lhs,
        )
        return summed + rest

    return lax.cond(jnp.all(jnp.isfinite(coef)), as_written, safe, coef)


def _products_summed(
    lhs: Any, rhs: Any, dimension_numbers: Any, dtype: Any, linear_lhs: bool
) -> Any:
    """``dot_general(lhs, rhs)`` as elementwise products (:data:`scale_p`, linear in the
    linear operand) over the broadcast ``(batch, lhs free, rhs free, contracting)`` layout,
    summed over the contracting dimensions: ``dot_general``'s own output layout."""
    (lc, rc), (lb, rb) = dimension_numbers
    lfree = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rfree = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    nb, nl, nr, nc = len(lb), len(lfree), len(rfree), len(lc)
    shape = (
        *(lhs.shape[d] for d in lb),
        *(lhs.shape[d] for d in lfree),
        *(rhs.shape[d] for d in rfree),
        *(lhs.shape[d] for d in lc),
    )
    contracting = tuple(range(nb + nl + nr, nb + nl + nr + nc))
    lhs_dims = (*range(nb + nl), *contracting)
    rhs_dims = (*range(nb), *range(nb + nl, nb + nl + nr), *contracting)
    wide_lhs = lax.broadcast_in_dim(
        lax.transpose(lhs.astype(dtype), (*lb, *lfree, *lc)), shape, lhs_dims
    )
    wide_rhs = lax.broadcast_in_dim(
        lax.transpose(rhs.astype(dtype), (*rb, *rfree, *rc)), shape, rhs_dims
    )
    x, c = (wide_lhs, wide_rhs) if linear_lhs else (wide_rhs, wide_lhs)
    return jnp.sum(scale_p.bind(x, c, divide=False), axis=contracting)


# -- branches and loops: rebuilt with their bodies re-run by values ---------------------------


def _body_fn(body: Body, flags: Sequence[bool], rules: bool) -> Callable[..., list[Any]]:
    """``body`` as a function evaluated by :func:`_eval` (its values, rewritten)."""

    def fn(*args: Any) -> list[Any]:
        return _eval(body.jaxpr, list(body.consts), list(args), flags, rules)

    return fn


def _depends(jaxpr: Any, flags: Sequence[bool]) -> list[bool]:
    """Which outputs of ``jaxpr`` may depend on the inputs ``flags`` marks (each equation's
    outputs on all its operands: an over-approximation, never missing a dependence)."""
    env = dict(zip(jaxpr.invars, flags, strict=True))
    for eqn in jaxpr.eqns:
        dependent = any(env.get(a, False) for a in eqn.invars if not isinstance(a, Literal))
        env.update((v, dependent) for v in eqn.outvars)
    return [False if isinstance(v, Literal) else env.get(v, False) for v in jaxpr.outvars]


def _carry_flags(step: Callable[[list[bool]], list[bool]], carry: Sequence[bool]) -> list[bool]:
    """The carry's dependence flags over any number of iterations of ``step``."""
    flags = list(carry)
    while True:
        new = [a or b for a, b in zip(flags, step(flags), strict=True)]
        if new == flags:
            return flags
        flags = new


def _cond(eqn: Any, vals: list[Any], flags: list[bool], rules: bool) -> list[Any]:
    parts, part_flags = cond_parts(eqn, vals), cond_parts(eqn, flags)
    fns = [_body_fn(b, part_flags.operands, rules) for b in parts.branches]
    return list(lax.switch(parts.index, fns, *parts.operands))


def _scan(eqn: Any, vals: list[Any], flags: list[bool], rules: bool) -> list[Any]:
    parts, f = scan_parts(eqn, vals), scan_parts(eqn, flags)
    n_carry = len(parts.carry)

    def step_flags(carry: list[bool]) -> list[bool]:
        return _depends(parts.body.jaxpr, [*f.consts, *carry, *f.xs])[:n_carry]

    carry_flags = _carry_flags(step_flags, f.carry)
    run = _body_fn(parts.body, [*f.consts, *carry_flags, *f.xs], rules)

    def step(carry: list[Any], xs: list[Any]) -> tuple[list[Any], list[Any]]:
        out = run(*parts.consts, *carry, *xs)
        return out[:n_carry], out[n_carry:]

    params = eqn.params
    carry, ys = lax.scan(
        step,
        parts.carry,
        parts.xs,
        length=params["length"],
        reverse=params["reverse"],
        unroll=params["unroll"],
    )
    return [*carry, *ys]


def _while(eqn: Any, vals: list[Any], flags: list[bool], rules: bool) -> list[Any]:
    parts, f = while_parts(eqn, vals), while_parts(eqn, flags)

    def step_flags(carry: list[bool]) -> list[bool]:
        return _depends(parts.body.jaxpr, [*f.body_consts, *carry])

    carry_flags = _carry_flags(step_flags, f.carry)
    cond = _body_fn(parts.cond, [*f.cond_consts, *carry_flags], rules)
    body = _body_fn(parts.body, [*f.body_consts, *carry_flags], rules)
    return list(
        lax.while_loop(
            lambda c: cond(*parts.cond_consts, *c)[0],
            lambda c: body(*parts.body_consts, *c),
            list(parts.carry),
        )
    )


# Branches and loops rebuilt by their values (JAX transposes ``cond`` and ``scan`` by
# transposing their bodies; a ``while`` it does not transpose, but rebuilt it computes the
# same values, so the row-by-row way and this one agree).
_LOOPS: dict[str, Callable[[Any, list[Any], list[bool], bool], list[Any]]] = {
    "cond": _cond,
    "scan": _scan,
    "while": _while,
}


# -- scale_p: x * c (or x / c), linear in x, whose transpose keeps a zero cotangent zero ----

scale_p = Primitive("jaxext_zero_safe_scale")


def _impl(x: Any, c: Any, *, divide: bool) -> Any:
    return lax.div(x, c) if divide else lax.mul(x, c)


def _abstract(x: Any, c: Any, *, divide: bool) -> Any:
    # The product's own type: ``mul`` broadcasts size-1 dimensions (``g[:, None] * x``
    # is f32[3,1] * f32[3,4] -> f32[3,4]) and rank-0 operands; ``abstract_eval`` returns
    # ``(aval, effects)``.
    return (lax.div_p if divide else lax.mul_p).abstract_eval(x, c)[0]


def _jvp(primals: Sequence[Any], tangents: Sequence[Any], *, divide: bool):
    x, c = primals
    tx, tc = tangents
    out = scale_p.bind(x, c, divide=divide)
    terms = []
    if type(tx) is not ad.Zero:
        terms.append(scale_p.bind(tx, c, divide=divide))
    if type(tc) is not ad.Zero:
        terms.append(lax.neg(lax.div(lax.mul(out, tc), c)) if divide else lax.mul(x, tc))
    if not terms:
        return out, ad.Zero.from_primal_value(out)
    return out, terms[0] if len(terms) == 1 else lax.add(*terms)


def _transpose(ct: Any, x: Any, c: Any, *, divide: bool) -> list[Any]:
    if ad.is_undefined_primal(c):  # only ever built with x the linear operand
        raise NotImplementedError("jaxext_zero_safe_scale is linear in its first operand only")
    aval = x.aval
    if type(ct) is ad.Zero:
        return [ad.Zero(aval), None]
    value = lax.div(ct, c) if divide else lax.mul(ct, c)
    value = jnp.where(ct == 0, jnp.zeros_like(value), value)
    return [_unbroadcast(value, aval.shape).astype(aval.dtype), None]


def _unbroadcast(value: Any, shape: tuple[int, ...]) -> Any:
    """``value`` summed back to the ``shape`` the product broadcast: a rank-0 operand, or
    size-1 dimensions (as the transpose of ``mul`` does)."""
    if value.shape == shape:
        return value
    if not shape:
        return jnp.sum(value)
    axes = tuple(i for i, (a, b) in enumerate(zip(value.shape, shape, strict=True)) if a != b)
    return jnp.sum(value, axis=axes, keepdims=True)


def _batch(args: Sequence[Any], dims: Sequence[Any], *, divide: bool):
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not batching.not_mapped)
    out_shape = np.broadcast_shapes(
        *(
            tuple(s for i, s in enumerate(a.shape) if i != d)
            if d is not batching.not_mapped
            else a.shape
            for a, d in zip(args, dims, strict=True)
        )
    )
    full = []
    for a, d in zip(args, dims, strict=True):
        if d is batching.not_mapped:
            full.append(jnp.broadcast_to(a, (size, *out_shape)))
            continue
        a = jnp.moveaxis(a, d, 0)
        if a.ndim - 1 < len(out_shape):
            a = a.reshape((size,) + (1,) * len(out_shape))
        full.append(jnp.broadcast_to(a, (size, *out_shape)))
    return scale_p.bind(*full, divide=divide), 0


scale_p.def_impl(_impl)
scale_p.def_abstract_eval(_abstract)
ad.primitive_jvps[scale_p] = _jvp
ad.primitive_transposes[scale_p] = _transpose
batching.primitive_batchers[scale_p] = _batch
mlir.register_lowering(scale_p, mlir.lower_fun(_impl, multiple_results=False))
