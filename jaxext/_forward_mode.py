"""Forward mode of a ``jaxext.custom_vjp`` op from its backward, wherever reverse mode works.

``_custom_vjp.py`` evaluates the tangent ``J t`` of an op without a ``jvp`` rule from its
hand-written backward ``bwd: g -> J^T g`` (linear in the cotangent ``g``). This module
holds the ways it does so, tried in order of cost until one works
(:func:`tangent_from_backward`):

1. **Transposing the backward** (``jax.linear_transpose``): one backward's worth of work.
2. **Transposing its linearization at zero** (``jax.vjp`` of the backward at ``g = 0``,
   applied to ``t``): the same map for a linear backward, and what makes the backward
   transposable when it calls an op JAX can differentiate but not transpose (a
   ``jaxext.Function`` with a ``vmap`` staticmethod, which lowers through
   ``jax.custom_batching.custom_vmap``). About twice the work of 1.
3. **The backward row by row**: the rows of ``J`` are ``bwd(e_i)`` for the unit
   cotangents ``e_i``, so ``J t = [<bwd(e_i), t>]_i``; batched with ``vmap`` in chunks
   (or one at a time where the backward cannot be batched). This works for any backward
   JAX can evaluate (a ``while_loop``, a host callback, an FFI kernel) and costs one
   backward per output element (real and imaginary parts of a complex output count
   twice), so it runs only up to the op's ``forward_mode_max_outputs``
   (:data:`DEFAULT_MAX_OUTPUTS`). A zero tangent entry contributes zero, so entry
   ``(k, i)`` of ``jacfwd`` is exactly ``bwd(e_k)[i]``, reverse mode's, NaN included.
4. **Transposing the linearization through the custom rules of the calls inside**: where a
   call inside the backward has a primal JAX cannot transpose (a ``jaxext.custom_vjp`` op
   around a host callback) and the output is too large for 3; those rules are trusted,
   the rest of the backward is read by its values as in 1 and 2.

Ways 1 and 2 transpose the backward **by its values** (:func:`by_values`, in
``_value_transpose``): ``stop_gradient`` as the identity, ``custom_jvp``/``custom_vjp``
calls as their primal, products by a coefficient independent of ``g`` zero-safe
(elementwise and in ``dot_general``), also inside ``cond`` branches and ``scan``/``while``
bodies. So each way gives the map the backward computes, reverse mode's numbers:
``jax.jacfwd`` equals the transpose of ``jax.jacrev`` entrywise, or forward mode raises the
error below.

Beyond that limit, or where no way works, :func:`tangent_from_backward` raises a
``TypeError`` naming the op and the two remedies: a ``jvp`` rule, or the
``differentiate_fwd=True`` opt-in, under which forward mode differentiates the forward
rule ``fwd`` with JAX's autodiff instead (:func:`tangent_of_fwd`), as proposed upstream
in jax-ml/jax#17840. That is right for a ``custom_vjp`` that exists to save memory
(checkpointing, implicit differentiation) and wrong for one that changes the gradient.

Also here: :func:`closure_convert`, which makes every tracer a rule closes over (integer
ones too, unlike ``jax.closure_convert``) an explicit operand (``_trace_state.staged`` says
when to); and :func:`batched_outputs`, which tells the tangent's batching rule which
output tangents a ``vmap`` batch reaches (an output the batch does not reach keeps an
unbatched tangent, as its primal does).

Linearity: a backward is taken to be linear in ``g`` where ``_linearity`` cannot prove
otherwise; what that walk cannot see into (host callbacks, FFI and Pallas kernels, other
primitives outside its tables, a ``while_loop`` whose trip count depends on ``g``, a
scatter of ``g`` into a residual) is trusted, and listed in ``docs/limitations.md`` with
way 4's custom rules, the only derivative rules trusted in place of values.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

from ._avals import stand_in
from ._jaxpr import call_body
from ._rule_contracts import RuleTypeError, RuleValueError
from ._value_transpose import by_values

__all__ = [
    "DEFAULT_MAX_OUTPUTS",
    "Call",
    "Rules",
    "TangentMap",
    "check_max_outputs",
    "closure_convert",
    "batched_outputs",
    "as_written_calls",
    "runs_as_written",
    "tangent_from_backward",
    "tangent_of_fwd",
]

#: Output elements up to which forward mode evaluates the backward row by row (way 3).
DEFAULT_MAX_OUTPUTS = 4096
# Entries of the rows a batched chunk of way 3 holds at once (chunk * input elements).
_CHUNK_ENTRIES = 2**20


def check_max_outputs(value: Any) -> int:
    """``forward_mode_max_outputs``, checked: a non-negative int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(
            f"`forward_mode_max_outputs` must be a non-negative int; got {value!r} "
            f"({type(value).__name__})."
        )
    return value


# -- what forward mode reads of the core --------------------------------------------------


class Rules(Protocol):
    """What forward mode reads of a ``jaxext.custom_vjp`` (the core's ``custom_vjp``)."""

    fwd: Callable[..., Any] | None
    symbolic_zeros: bool
    forward_mode_hint: str | None
    forward_mode_max_outputs: int


class Call(Protocol):
    """What forward mode reads of one call of an op (the core's ``_Op``)."""

    name: str
    spec: Rules

    def merge(self, diff_values: Sequence[Any]) -> list[Any]:
        """The call's arguments, with ``diff_values`` at the differentiable positions."""
        ...


class TangentMap(Protocol):
    """What forward mode reads of ``t -> J t`` for one call (the core's ``_TangentMap``)."""

    op: Call
    in_tree: Any  # the differentiable arguments' pytree structure
    perturbed: tuple[bool, ...]  # per input leaf: whether it has a tangent
    out_tree: Any
    out_float: tuple[bool, ...]  # per output leaf: whether it is differentiated
    ct_avals: tuple[Any, ...]  # the cotangent types of the differentiated outputs
    hoisted_fwd: Callable[..., Any] | None  # differentiate_fwd: fwd closure-converted

    def staged_backward(self, res_arrays: Sequence[Any], cts: Sequence[Any]) -> list[Any]:
        """``bwd`` on the residual operands and one cotangent per differentiated output."""
        ...


# -- ways 1-3 ------------------------------------------------------------------------------


def tangent_from_backward(
    lin: TangentMap, res_arrays: Sequence[Any], t_in: Sequence[Any]
) -> list[Any]:
    """``J t`` from ``lin``'s backward: transposed, or row by row (see the module docstring).

    Args:
        lin: the op's tangent map (its ``staged_backward``, ``ct_avals``, ``op``).
        res_arrays: the tangent primitive's residual operands.
        t_in: the tangents of the perturbed input leaves.

    Returns:
        One tangent per float output leaf.

    Raises:
        TypeError: naming the op and the remedies, where no way applies.
    """

    def backward(cts: Sequence[Any]) -> list[Any]:
        return lin.staged_backward(res_arrays, list(cts))

    examples = [stand_in(a) for a in lin.ct_avals]
    failures: list[BaseException] = []
    try:  # ways 1 and 2, on the backward read by its values (``_value_transpose``)
        values = by_values(backward, [examples])
        ways = [(way, values) for way in (_transposed, _transposed_linearization)]
    except (RuleTypeError, RuleValueError):
        raise
    except Exception as err:  # noqa: BLE001 -- the backward cannot be traced: row by row
        failures.append(err)
        ways = []
    for way, fn in ways:
        try:
            return [jnp.asarray(o) for o in way(fn, examples, t_in)]
        except (RuleTypeError, RuleValueError):
            raise
        except Exception as err:  # noqa: BLE001 -- the next way, or the error below
            failures.append(err)
    n = _basis_size(lin.ct_avals)
    limit = lin.op.spec.forward_mode_max_outputs
    if n <= limit:
        try:
            return _row_by_row(backward, lin.ct_avals, t_in)
        except (RuleTypeError, RuleValueError):
            raise
        except Exception as err:  # noqa: BLE001 -- the last way, or the error below
            row_problem = (
                f"evaluating the backward once per output element failed too "
                f"({type(err).__name__}: {_first_line(err)})"
            )
            row_error: BaseException = err
    else:
        row_problem = (
            f"evaluating the backward once per output element would take {n} backward "
            f"passes, more than the op's forward_mode_max_outputs={limit}"
        )
        row_error = failures[0]
    try:  # way 4 (trusted): the custom rules of calls whose values JAX cannot transpose
        rules = by_values(backward, [examples], custom_rules=True)
        return [jnp.asarray(o) for o in _transposed_linearization(rules, examples, t_in)]
    except (RuleTypeError, RuleValueError):
        raise
    except Exception:  # noqa: BLE001 -- reported through the first failure below
        pass
    raise _no_forward_mode(lin, failures[0], row_problem) from row_error


def _transposed(backward: Callable[..., Any], examples: list[Any], t_in: Sequence[Any]) -> Any:
    (out,) = jax.linear_transpose(backward, examples)(list(t_in))
    return out


def _transposed_linearization(
    backward: Callable[..., Any], examples: list[Any], t_in: Sequence[Any]
) -> Any:
    """The transpose of the backward's linearization at ``g = 0`` (the backward itself,
    when it is linear): JAX linearizes each op inside through its own derivative rules,
    so an op it cannot transpose directly (a ``custom_vmap``, a ``jaxext.custom_vjp`` op
    with an opaque primal) is transposed through its JVP, and a ``jaxext.custom_vjp``
    op's JVP transposes to its own backward."""
    zeros = [jnp.zeros(e.shape, e.dtype) for e in examples]
    _, pullback = jax.vjp(backward, zeros)
    (out,) = pullback(list(t_in))
    return out


def _basis_size(ct_avals: Sequence[Any]) -> int:
    """The real dimension of the cotangent space: complex elements count twice."""
    return sum(
        math.prod(a.shape) * (2 if jnp.issubdtype(a.dtype, jnp.complexfloating) else 1)
        for a in ct_avals
    )


def _row_by_row(
    backward: Callable[..., Any], ct_avals: Sequence[Any], t_in: Sequence[Any]
) -> list[Any]:
    """``J t`` as ``[<bwd(e_i), t>]_i`` over the real basis ``e_i`` of the cotangents.

    JAX pairs a cotangent with a tangent as ``Re(sum(a * b))``; with that pairing, for a
    real output element ``(J t)_k = <bwd(e_k), t>``, and for a complex one
    ``(J t)_k = <bwd(e_k), t> - i <bwd(i e_k), t>``.
    """
    sizes = [math.prod(a.shape) for a in ct_avals]
    is_complex = [jnp.issubdtype(a.dtype, jnp.complexfloating) for a in ct_avals]
    widths = [s * (2 if c else 1) for s, c in zip(sizes, is_complex, strict=True)]
    offsets = [sum(widths[:k]) for k in range(len(widths))]
    n = sum(widths)
    t_in = [jnp.asarray(t) for t in t_in]
    n_in = max(1, sum(math.prod(jnp.shape(t)) for t in t_in))

    def unit(i: Any) -> list[Any]:
        cts = []
        for aval, size, c, offset in zip(ct_avals, sizes, is_complex, offsets, strict=True):
            real = jax.nn.one_hot(i - offset, size, dtype=_real_dtype(aval.dtype))
            if c:
                imag = jax.nn.one_hot(i - offset - size, size, dtype=_real_dtype(aval.dtype))
                flat = jax.lax.complex(real, imag).astype(aval.dtype)
            else:
                flat = real.astype(aval.dtype)
            cts.append(flat.reshape(aval.shape))
        return cts

    def entry(i: Any) -> Any:
        grads = backward(unit(i))
        # A zero tangent entry contributes zero, also against a non-finite row entry: entry
        # (k, i) of jacfwd is then exactly bwd(e_k)[i], jacrev's.
        terms = [
            jnp.real(jnp.sum(jnp.where(t == 0, jnp.zeros_like(g * t), g * t)))
            for g, t in zip(grads, t_in, strict=True)
        ]
        return sum(terms) if terms else jnp.zeros((), jnp.float32)

    indices = jnp.arange(n)
    chunk = max(1, min(n, _CHUNK_ENTRIES // n_in))
    try:
        values = jax.lax.map(entry, indices, batch_size=chunk)
    except NotImplementedError:  # a backward JAX cannot batch: one output element at a time
        values = jax.lax.map(entry, indices)
    out = []
    for aval, size, c, offset in zip(ct_avals, sizes, is_complex, offsets, strict=True):
        part = values[offset : offset + size]
        if c:
            part = jax.lax.complex(part, -values[offset + size : offset + 2 * size])
        out.append(part.astype(aval.dtype).reshape(aval.shape))
    return out


def _real_dtype(dtype: Any) -> Any:
    return jnp.finfo(dtype).dtype if jnp.issubdtype(dtype, jnp.complexfloating) else dtype


def _no_forward_mode(
    lin: TangentMap, transpose_error: BaseException, row_problem: str
) -> TypeError:
    name, spec = lin.op.name, lin.op.spec
    if spec.forward_mode_hint is not None:
        remedies = f"{spec.forward_mode_hint}."
    else:
        remedies = (
            f"give a JVP rule: `{name}.defvjp(fwd, bwd, jvp=jvp)` with "
            "`jvp(*nondiff_args, residuals, tangents) -> output tangent`.\n"
            "Or, if the derivative of the forward rule is the one meant (a custom_vjp that "
            "exists to save memory: checkpointing, implicit differentiation; not one that "
            "changes the gradient), construct the op with "
            "`jaxext.custom_vjp(..., differentiate_fwd=True)`: forward mode then "
            "differentiates `fwd` with JAX's autodiff."
        )
    return TypeError(
        f"`{name}`: forward-mode differentiation (jvp, jacfwd, linearize, hessian) of a "
        "jaxext.custom_vjp function is derived from its bwd, and JAX could not transpose "
        f"it ({type(transpose_error).__name__}: {_first_line(transpose_error)}); "
        f"{row_problem}. The bwd must be linear in its cotangent and built of JAX "
        f"operations; otherwise {remedies}"
    )


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


# -- differentiate_fwd=True -------------------------------------------------------------------

_AS_WRITTEN = threading.local()


@contextlib.contextmanager
def as_written_calls(spec: Any) -> Iterator[None]:
    """While forward mode differentiates ``spec``'s ``fwd``, calls of ``spec`` inside it run
    the primal function as written (differentiated by JAX), not the custom rules."""
    active = getattr(_AS_WRITTEN, "specs", ())
    _AS_WRITTEN.specs = (*active, spec)
    try:
        yield
    finally:
        _AS_WRITTEN.specs = active


def runs_as_written(spec: Any) -> bool:
    """Whether calls of ``spec`` run its primal as written (see :func:`as_written_calls`)."""
    return any(s is spec for s in getattr(_AS_WRITTEN, "specs", ()))


def fwd_outputs(lin: TangentMap) -> Callable[..., list[Any]]:
    """``fwd``'s float outputs as a function of the op's input leaves."""
    op, spec = lin.op, lin.op.spec

    def outputs(*leaves: Any) -> list[Any]:
        if spec.symbolic_zeros:
            leaves = [CustomVJPPrimal(p, q) for p, q in zip(leaves, lin.perturbed, strict=True)]
        args = jax.tree_util.tree_unflatten(lin.in_tree, list(leaves))
        with as_written_calls(spec):
            out, _ = spec.fwd(*op.merge(args))
        flat = lin.out_tree.flatten_up_to(out)
        return [o for o, f in zip(flat, lin.out_float, strict=True) if f]

    return outputs


def tangent_of_fwd(
    lin: TangentMap, primals: Sequence[Any], consts: Sequence[Any], t_in: Sequence[Any]
):
    """``J t`` as JAX's forward-mode derivative of ``fwd`` at ``primals`` (the input leaves).

    ``consts`` are the tracers ``fwd`` closes over, hoisted by :func:`closure_convert`
    (``lin.hoisted_fwd``); without them ``fwd`` runs as written.
    """
    t_iter = iter(t_in)
    tangents = [
        next(t_iter) if q else _zero_tangent(p) for p, q in zip(primals, lin.perturbed, strict=True)
    ]
    if lin.hoisted_fwd is None:
        fun = fwd_outputs(lin)
    else:

        def fun(*leaves: Any) -> list[Any]:
            return list(lin.hoisted_fwd(*leaves, *consts))

    _, out = jax.jvp(fun, tuple(primals), tuple(tangents))
    return list(out)


def _zero_tangent(primal: Any) -> Any:
    aval = jax.typeof(primal).to_tangent_aval()
    return jnp.zeros(aval.shape, aval.dtype)


# -- closures ---------------------------------------------------------------------------------


def closure_convert(fn: Callable[..., Any], *args: Any) -> tuple[Callable[..., Any], list[Any]]:
    """``fn`` with the tracers it closes over made explicit trailing operands.

    As ``jax.closure_convert``, but every tracer is hoisted, whatever its dtype: an integer
    index or a loop counter closed over from an enclosing trace would otherwise stay a
    constant of the traced rule, stale once that trace has ended. Other constants stay
    baked in.

    Returns:
        ``(converted, hoisted)``: ``converted(*args, *hoisted)`` computes ``fn(*args)``.
    """
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    consts = list(closed.consts)
    traced = [isinstance(c, jax.core.Tracer) for c in consts]
    kept = [c for c, t in zip(consts, traced, strict=True) if not t]
    hoisted = [c for c, t in zip(consts, traced, strict=True) if t]
    out_tree = jax.tree_util.tree_structure(out_shape)
    n_args = len(jax.tree_util.tree_leaves(args))
    jaxpr = closed.jaxpr

    def converted(*operands: Any) -> Any:
        flat = jax.tree_util.tree_leaves(operands)
        given, extra = flat[:n_args], iter(flat[n_args:])
        kept_iter = iter(kept)
        values = [next(extra) if t else next(kept_iter) for t in traced]
        out = jaxpr_as_fun(ClosedJaxpr(jaxpr, values))(*given)
        return jax.tree_util.tree_unflatten(out_tree, out)

    return converted, hoisted


# -- which output tangents vmap batches -------------------------------------------------------


def batched_outputs(
    backward: Callable[..., Any],
    res_avals: Sequence[Any],
    res_batched: Sequence[bool],
    ct_avals: Sequence[Any],
    t_batched: Sequence[bool],
) -> list[bool]:
    """Which outputs of ``J t`` vary over a ``vmap`` batch, read off the backward's jaxpr.

    Output ``k`` of ``J t = sum_j J_kj t_j`` varies when some ``J_kj`` is nonzero and
    either ``t_j`` is batched or ``J_kj`` depends on a batched residual. In the backward
    ``g -> J^T g``, ``J_kj`` is the coefficient of ``g_k`` in gradient ``j``: each value of
    its jaxpr is tracked as the cotangents it is linear in, each flagged when its
    coefficient may depend on a batched residual, and whether its other part does. An
    equation mixes its operands' dependencies (over-approximating, never missing one);
    those with an inner jaxpr (``jit``, ``checkpoint``) are walked through.

    Returns:
        One flag per output of ``J t``; all ``True`` where the backward cannot be traced.
    """
    examples = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (*res_avals, *ct_avals)]
    n_res = len(res_avals)
    try:
        closed = jax.make_jaxpr(lambda *a: backward(list(a[:n_res]), list(a[n_res:])))(*examples)
    except Exception:  # noqa: BLE001 -- reverse mode traces (and reports) it itself
        return [True] * len(ct_avals)
    inputs = [_Dep({}, b) for b in res_batched]
    inputs += [_Dep({k: False}, False) for k in range(len(ct_avals))]
    grads = _walk_deps(closed.jaxpr, inputs)
    flags = [False] * len(ct_avals)
    for grad, batched in zip(grads, t_batched, strict=True):
        for k, coefficient_batched in grad.cts.items():
            flags[k] = flags[k] or batched or coefficient_batched
    return flags


class _Dep:
    """A value's dependence: ``cts`` maps each cotangent it is linear in to whether that
    coefficient may vary over the batch; ``batched``: whether the rest may."""

    def __init__(self, cts: dict[int, bool], batched: bool):
        self.cts, self.batched = cts, batched


_NONE = _Dep({}, False)


def _mix(deps: Sequence[_Dep]) -> _Dep:
    batched = any(d.batched for d in deps)
    cts: dict[int, bool] = {}
    for d in deps:
        for k, flag in d.cts.items():
            cts[k] = cts.get(k, False) or flag
    # A value linear in cotangents (as every value of a linear backward that depends on
    # one is) has no other part.
    return _Dep({k: flag or batched for k, flag in cts.items()}, batched and not cts)


def _walk_deps(jaxpr: Any, inputs: Sequence[_Dep]) -> list[_Dep]:
    env: dict[Any, _Dep] = dict(zip(jaxpr.invars, inputs, strict=True))

    def read(atom: Any) -> _Dep:
        return _NONE if isinstance(atom, jax.extend.core.Literal) else env.get(atom, _NONE)

    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        body = call_body(eqn)
        outs = [_mix(ins)] * len(eqn.outvars) if body is None else _walk_deps(body.jaxpr, ins)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]
