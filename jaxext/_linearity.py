"""Is a traced function linear in its inputs? A walk over its jaxpr.

Forward mode of a :class:`jaxext.custom_vjp` function transposes its backward, which
is only right when the backward is linear in the cotangent. ``jax.linear_transpose``
raises for some nonlinear uses (``jnp.clip``) but silently drops others: a term that
does not depend on the cotangent (``return 3 * x**2``, or ``g * a + b``) transposes to
nothing. This module classifies each value of the backward's jaxpr as

* ``ZERO``: identically zero (a literal ``0``, ``jnp.zeros``, a NumPy constant of
  zeros such as ``np.zeros(2)``, a product with zero),
* ``CONST``: independent of the inputs (residuals, literals, their functions),
* ``LINEAR``: a linear function of the inputs,
* ``AFFINE``: linear plus a term that does not depend on the inputs,
* ``NONLINEAR``: any other use of the inputs,

and reports, per output, why it is not linear. It walks into every construct that
carries a jaxpr of values: calls (any equation whose jaxpr takes its operands and returns
its results, ``_jaxpr.call_body``: ``jit``, ``remat``, ``custom_jvp``/``custom_vjp``
calls, whose primal is what the backward computes, ``custom_vmap``, ``shard_map``),
``cond`` branches, and ``scan`` and ``while_loop`` bodies (to a fixed point of the carry's
kinds, for any trip count). It knows the operations JAX itself linearizes in some
operands only: ``sort`` in its payload (the keys must not depend on the inputs:
``lax.sort_key_val(perm, g)`` is linear), gathers and scatters in their data (not their
indices).

Primitives it does not know are given the benefit of the doubt (``UNKNOWN``): the walk
only reports what it can prove. So are, and only these are, trusted: host callbacks, FFI
and Pallas kernels and other primitives outside its tables; a ``while_loop`` whose trip
count depends on the inputs (an iterative solve, linear to its tolerance); a scatter of
the inputs into a residual (``zeros.at[ids].add(g)`` with ``zeros`` saved by ``fwd``).
``docs/limitations.md`` lists them for users.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._jaxpr import call_body, cond_parts, scan_parts, while_parts

__all__ = ["Kind", "nonlinearities"]


class Kind(enum.IntEnum):
    ZERO = 0
    CONST = 1
    LINEAR = 2
    UNKNOWN = 3
    AFFINE = 4
    NONLINEAR = 5


# Linear in every operand together (f(a t) = a f(t)), with no constant operands allowed
# beyond zeros: sums of linear terms (``complex(a, b) = a + i b`` too).
_ADDITIVE = {"add", "sub", "add_any", "concatenate", "complex"}
# Linear in their first operand; every other operand must not depend on the inputs.
_LINEAR_IN_FIRST = {
    "neg",
    "reduce_sum",
    "broadcast_in_dim",
    "reshape",
    "transpose",
    "convert_element_type",
    "squeeze",
    "expand_dims",
    "slice",
    "dynamic_slice",
    "rev",
    "copy",
    "copy_p",
    "real",
    "imag",
    "conj",
    "reduce_precision",
    "cumsum",
    "gather",
    "psum",
    "all_gather",
    "all_to_all",
    "ppermute",
    "reduce_scatter",
    "psum_scatter",
    "pbroadcast",
    "pvary",
    "pcast",
    "sharding_constraint",
    "mesh_cast",
    "reshard",
    "device_put",
    "optimization_barrier",
    "select_and_scatter_add",
    "reduce_window_sum",
    # The identity in value (what forward mode transposes: see ``_value_transpose``).
    "stop_gradient",
}
# Bilinear: linear when exactly one operand depends on the inputs.
_BILINEAR = {"mul", "dot_general", "conv_general_dilated"}
# Nonlinear in every operand that depends on the inputs.
_NONLINEAR = {
    "abs",
    "sign",
    "max",
    "min",
    "clamp",
    "exp",
    "exp2",
    "log",
    "log1p",
    "expm1",
    "sin",
    "cos",
    "tan",
    "tanh",
    "logistic",
    "sqrt",
    "rsqrt",
    "cbrt",
    "pow",
    "integer_pow",
    "square",
    "erf",
    "erfc",
    "erf_inv",
    "atan2",
    "asin",
    "acos",
    "atan",
    "sinh",
    "cosh",
    "asinh",
    "acosh",
    "atanh",
    "floor",
    "ceil",
    "round",
    "is_finite",
    "reduce_max",
    "reduce_min",
    "argmax",
    "argmin",
    "gt",
    "ge",
    "lt",
    "le",
    "eq",
    "ne",
    "sort",
    "nextafter",
    "rem",
    "lgamma",
    "digamma",
    "reduce_prod",
    "cumprod",
    "cummax",
    "cummin",
    "cumlogsumexp",
    "top_k",
    "scatter-mul",
    "scatter_mul",
    "scatter-min",
    "scatter_min",
    "scatter-max",
    "scatter_max",
}
# Sums in two operands, with the rest (indices) not depending on the inputs:
# a scatter writes or adds its updates into its operand, a dynamic_update_slice writes one
# into the other, a pad surrounds its operand with its padding value.
_ADDITIVE_IN_TWO = {
    "scatter",
    "scatter-add",
    "scatter_add",
    "scatter-sub",
    "scatter_sub",
    "dynamic_update_slice",
    "pad",
}


def nonlinearities(fn: Callable[..., Any], examples: Sequence[Any]) -> list[tuple[Kind, str]]:
    """Traces ``fn`` at ``examples`` and classifies each output leaf.

    Args:
        fn: the function, called as ``fn(*examples)``.
        examples: its arguments (arrays or ``jax.ShapeDtypeStruct``s).

    Returns:
        One ``(kind, reason)`` per output leaf; ``reason`` names the primitive that made
        it ``NONLINEAR``, and is empty otherwise.
    """
    closed = jax.make_jaxpr(fn)(*examples)
    kinds = _walk(closed.jaxpr, [Kind.LINEAR] * len(closed.jaxpr.invars), closed.consts)
    return kinds


def _walk(
    jaxpr: Any, in_kinds: Sequence[Kind], consts: Sequence[Any] = ()
) -> list[tuple[Kind, str]]:
    env: dict[Any, tuple[Kind, str]] = {}
    if len(consts) != len(jaxpr.constvars):  # values unknown: none provably zero
        consts = [None] * len(jaxpr.constvars)
    for v, value in zip(jaxpr.constvars, consts, strict=True):
        env[v] = (Kind.ZERO if _is_zero_constant(value) else Kind.CONST, "")
    for v, k in zip(jaxpr.invars, in_kinds, strict=True):
        env[v] = (k, "")

    def read(atom: Any) -> tuple[Kind, str]:
        if isinstance(atom, jax.extend.core.Literal):
            return (Kind.ZERO if _is_zero(atom.val) else Kind.CONST, "")
        return env.get(atom, (Kind.CONST, ""))

    # Values fixed when the function is written: functions of literals and NumPy constants.
    fixed = {v for v, value in zip(jaxpr.constvars, consts, strict=True) if _is_numpy(value)}
    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        known = [isinstance(a, jax.extend.core.Literal) or a in fixed for a in eqn.invars]
        outs = _rule(eqn, ins, known)
        for v, k in zip(eqn.outvars, outs, strict=True):
            env[v] = k
        if all(known):
            fixed.update(eqn.outvars)
    return [read(v) for v in jaxpr.outvars]


def _is_numpy(value: Any) -> bool:
    return isinstance(value, (np.ndarray, np.generic))


def _is_zero_constant(value: Any) -> bool:
    """Whether a jaxpr's constant ``value`` is a NumPy array of zeros.

    Only NumPy arrays count: they are fixed when the function is written (``np.zeros(2)``),
    whereas a JAX array among a jaxpr's constants may be a residual that happens to be zero
    for these inputs (and is traced, so not known, under ``jit``).
    """
    return isinstance(value, np.ndarray) and _is_zero(value)


def _is_zero(val: Any) -> bool:
    try:
        arr = np.asarray(val)
        return arr.dtype != object and arr.size > 0 and not np.any(arr)
    except Exception:  # noqa: BLE001 -- not a plain number: not provably zero
        return False


def _worst(ins: Sequence[tuple[Kind, str]]) -> tuple[Kind, str]:
    return max(ins, key=lambda kr: kr[0], default=(Kind.CONST, ""))


def _rule(
    eqn: Any, ins: Sequence[tuple[Kind, str]], known: Sequence[bool] = ()
) -> list[tuple[Kind, str]]:
    """The kinds of ``eqn``'s outputs; ``known`` flags operands fixed when the function is
    written (of literals and NumPy constants), as opposed to residuals."""
    n_out = len(eqn.outvars)
    name = eqn.primitive.name
    kinds = [k for k, _ in ins]
    worst = _worst(ins)
    if worst[0] >= Kind.AFFINE:  # already not linear: stays so
        return [worst] * n_out
    if all(k <= Kind.CONST for k in kinds):
        # Independent of the inputs. A zero stays zero through shape-only and linear ops.
        zero = kinds and all(k == Kind.ZERO for k in kinds[:1]) and name in _LINEAR_IN_FIRST
        zero = zero or (name in _BILINEAR and Kind.ZERO in kinds)
        zero = zero or (name in _ADDITIVE and all(k == Kind.ZERO for k in kinds))
        return [(Kind.ZERO if zero else Kind.CONST, "")] * n_out
    here = f"`{name}`"
    if name == "convert_element_type" and not _is_inexact(eqn.params["new_dtype"]):
        return [(Kind.NONLINEAR, here)] * n_out  # rounded to an integer or a bool
    if name == "sort":  # JAX linearizes sort in its payload operands; the keys must not vary
        n_keys = eqn.params["num_keys"]
        if any(k >= Kind.LINEAR for k in kinds[:n_keys]):
            return [(Kind.NONLINEAR, here)] * n_out
        return [ins[i] if kinds[i] >= Kind.LINEAR else (Kind.CONST, "") for i in range(n_out)]
    if name in _ADDITIVE_IN_TWO:
        # scatter(operand, indices, updates); dynamic_update_slice(operand, update, *indices)
        summed = (0, 2) if name.startswith("scatter") else (0, 1)
        if any(k >= Kind.LINEAR for i, k in enumerate(kinds) if i not in summed):
            return [(Kind.NONLINEAR, here)] * n_out
        out = _sum_of([ins[i] for i in summed], here)
        if out[0] == Kind.AFFINE and not all(known[i] for i in summed if kinds[i] == Kind.CONST):
            # Written into a residual: a buffer of zeros (``zeros.at[ids].add(g)``, the
            # common way to scatter a gradient) or not, unknown here: trusted.
            out = (Kind.UNKNOWN, "")
        return [out] * n_out
    if name == "while":
        return _while(eqn, ins, here)
    if name == "scan":
        return _scan(eqn, ins, here)
    if name in _ADDITIVE:
        if any(k == Kind.CONST for k in kinds) and any(k >= Kind.LINEAR for k in kinds):
            if Kind.UNKNOWN in kinds:
                return [(Kind.UNKNOWN, "")] * n_out
            return [(Kind.AFFINE, here)] * n_out
        return [worst] * n_out
    if name in _LINEAR_IN_FIRST:
        if any(k >= Kind.LINEAR for k in kinds[1:]):
            return [(Kind.NONLINEAR, here)] * n_out
        return [ins[0] if kinds[0] >= Kind.LINEAR else (Kind.CONST, "")] * n_out
    if name in _BILINEAR:
        dependent = [k for k in kinds if k >= Kind.LINEAR]
        if Kind.ZERO in kinds:
            return [(Kind.ZERO, "")] * n_out
        if len(dependent) > 1:
            return [(Kind.NONLINEAR, here)] * n_out
        return [worst] * n_out
    if name == "div":
        if kinds[1] >= Kind.LINEAR:
            return [(Kind.NONLINEAR, here)] * n_out
        return [ins[0]] * n_out
    if name in ("select_n", "cond"):
        # The predicate / branch index must not depend on the inputs.
        if kinds[0] >= Kind.LINEAR:
            return [(Kind.NONLINEAR, here)] * n_out
        if name == "select_n":
            cases = ins[1:]
            if any(k == Kind.CONST for k, _ in cases) and any(k >= Kind.LINEAR for k, _ in cases):
                return [(Kind.AFFINE, here)] * n_out
            return [_worst(cases)] * n_out
        parts = cond_parts(eqn, ins)
        branch_outs = [
            _walk(b.jaxpr, [k for k, _ in parts.operands], b.consts) for b in parts.branches
        ]
        return [_worst(col) for col in zip(*branch_outs, strict=True)]
    if name in _NONLINEAR:
        return [(Kind.NONLINEAR, here)] * n_out
    body = call_body(eqn)  # jit, closed_call, checkpoint, custom_jvp_call, ...
    if body is not None:
        return _walk(body.jaxpr, kinds, body.consts)
    return [(Kind.UNKNOWN, "")] * n_out


def _is_inexact(dtype: Any) -> bool:
    # jnp.issubdtype: NumPy does not count bfloat16 (an ml_dtypes type) as inexact.
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def _sum_of(ins: Sequence[tuple[Kind, str]], here: str) -> tuple[Kind, str]:
    """The kind of a sum of terms of kinds ``ins`` (as ``_ADDITIVE``)."""
    kinds = [k for k, _ in ins]
    if any(k == Kind.CONST for k in kinds) and any(k >= Kind.LINEAR for k in kinds):
        if Kind.UNKNOWN in kinds:
            return (Kind.UNKNOWN, "")
        return (Kind.AFFINE, here)
    if all(k == Kind.ZERO for k in kinds):
        return (Kind.ZERO, "")
    return _worst(ins)


def _join(a: tuple[Kind, str], b: tuple[Kind, str], here: str) -> tuple[Kind, str]:
    """The kind of a value that is of kind ``a`` or ``b`` (by a loop's trip count)."""
    if a[0] == Kind.ZERO:
        return b
    if b[0] == Kind.ZERO:
        return a
    return _sum_of([a, b], here)


def _fixpoint(
    step: Callable[[list[tuple[Kind, str]]], list[tuple[Kind, str]]],
    carry: list[tuple[Kind, str]],
    here: str,
) -> list[tuple[Kind, str]]:
    """The kinds a loop's carry takes over any number of iterations of ``step``."""
    for _ in range(len(Kind) * len(carry) + 1):  # kinds only grow: this many steps suffice
        new = [_join(c, o, here) for c, o in zip(carry, step(carry), strict=True)]
        if [k for k, _ in new] == [k for k, _ in carry]:
            return carry
        carry = new
    return carry


def _while(eqn: Any, ins: Sequence[tuple[Kind, str]], here: str) -> list[tuple[Kind, str]]:
    """A ``while_loop``: its carry over any number of iterations; ``UNKNOWN`` where its trip
    count depends on the inputs."""
    cond, body, cond_consts, body_consts, carry = while_parts(eqn, ins)

    def step(carry: list[tuple[Kind, str]]) -> list[tuple[Kind, str]]:
        return _walk(body.jaxpr, [k for k, _ in body_consts + carry], body.consts)

    carry = _fixpoint(step, carry, here)
    (pred,) = _walk(cond.jaxpr, [k for k, _ in cond_consts + carry], cond.consts)
    if pred[0] >= Kind.LINEAR:
        # A trip count that depends on the inputs: an iterative solver run to a tolerance,
        # linear to that tolerance. Not provably linear, not provably not: trusted.
        return [c if c[0] >= Kind.AFFINE else (Kind.UNKNOWN, "") for c in carry]
    return carry


def _scan(eqn: Any, ins: Sequence[tuple[Kind, str]], here: str) -> list[tuple[Kind, str]]:
    """A ``scan``: its carry over any number of iterations, and its stacked outputs."""
    body, consts, carry, xs = scan_parts(eqn, ins)
    n_carry = len(carry)

    def walk(carry: list[tuple[Kind, str]]) -> list[tuple[Kind, str]]:
        return _walk(body.jaxpr, [k for k, _ in consts + carry + xs], body.consts)

    carry = _fixpoint(lambda c: walk(c)[:n_carry], carry, here)
    return carry + walk(carry)[n_carry:]
