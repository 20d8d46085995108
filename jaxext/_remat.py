"""``optimize_remat=True``: ``fwd`` as a primitive that becomes the primal when its residuals die.

Under ``jax.checkpoint`` (remat) the forward pass keeps only the primal outputs of
what ``fwd`` computes and the backward pass recomputes ``fwd`` for its residuals.
JAX's dead-code elimination trims a ``fwd`` made of JAX operations to the primal's
work, but an opaque ``fwd`` (one FFI call or ``pure_callback`` that returns the
output and the residuals together, jax#21303) cannot be trimmed and would run in
full twice. As with ``jax.custom_vjp(..., optimize_remat=True)``, ``fwd`` is then
staged as one ``fwd_p`` equation that knows both ``fwd``'s and the primal
function's programs; when dead-code elimination finds none of its residual outputs
used (the forward pass of a remat), it becomes a call of the primal function.

Operands: ``fwd``'s closed-over values, the primal's closed-over values, then the
array leaves of the arguments. Outputs: ``fwd``'s array leaves, the primal output's
first (``n_out`` of them), then the residuals'.

JAX internals this module depends on (pinned by
``tests/test_remat.py::test_remat_internals_have_the_forms_this_module_names`` on
the JAX it runs with; checked on JAX 0.10 and 0.12):

* ``jax.interpreters.partial_eval.dce_rules``: the table of dead-code elimination
  rules, which ``jax.checkpoint`` applies to its forward pass (through
  ``partial_eval.dce_jaxpr``). A rule's signature changed in JAX 0.11:
  ``rule(used_outs, eqn)`` before, ``rule(used_outs, live_ins, eqn)`` since; both
  return ``(used_ins, new_eqn or None)``. The rules here (``_fwd_dce``,
  ``_pick_dce``) take ``(used_outs, *rest)`` and read the equation last.
* ``jax.interpreters.partial_eval.partial_eval_jaxpr_custom_rules``: the table of
  rules by which ``jax.checkpoint`` splits an equation into its forward and backward
  passes, ``rule(saveable, unks_in, inst_in, eqn) -> (known_eqn, staged_eqn,
  unks_out, inst_out, residuals)`` on JAX 0.10 and 0.12 (``_save_partial_eval``,
  ``_pick_partial_eval``: ``defremat``).
* ``jax.extend.core``: ``Var`` (a residual is a variable, not a literal),
  ``new_jaxpr_eqn`` and ``no_effects`` (the rewritten equations), and an equation's
  ``invars``, ``outvars``, ``params``, ``source_info`` and ``ctx``.

Besides these, it defines its primitives as the rest of jaxext does
(``jax.extend.core.Primitive``, ``ad.primitive_jvps``,
``batching.primitive_batchers``, ``mlir.register_lowering``).

Where the internals are missing or behave otherwise (:func:`missing_internals`, one
probe of ``fwd_p``'s rule through ``dce_jaxpr``, run once), ``optimize_remat`` falls
back to calling ``fwd`` as it is: under remat it then runs twice, as without the
option (correct, slower), instead of failing. Where a table is missing, its rules
are not registered, so importing jaxext still works; ``defremat`` then keeps correct
gradients but recomputes as ``jax.checkpoint``'s policy says.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.interpreters import partial_eval as pe

# The internals named in the module docstring: None where this JAX lacks them.
try:
    from jax.extend.core import Var
except ImportError:  # present on every JAX jaxext is tested with
    Var = None
try:
    from jax.extend.core import new_jaxpr_eqn, no_effects
except ImportError:  # present on every JAX jaxext is tested with
    new_jaxpr_eqn = no_effects = None

__all__ = ["missing_internals", "rematerialized", "run_fwd", "saved"]


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.core.Tracer))


class _Skip(Exception):  # noqa: N818 -- internal signal, never escapes
    """``fwd`` or the primal cannot be staged as ``fwd_p``: call ``fwd`` as it is."""


def run_fwd(op: Any, fwd_args: tuple) -> Any:
    """``op.spec.fwd(*op.merge(fwd_args))``, staged as ``fwd_p`` when that can pay off.

    ``fwd_args`` are the differentiable arguments (leaves wrapped in
    ``CustomVJPPrimal`` with ``symbolic_zeros=True``). ``fwd`` is called directly
    when no argument is traced (eager autodiff: there is no remat to optimize),
    when it has side effects, when ``fwd`` or the primal cannot be traced
    abstractly (Python control flow on values), or when this JAX lacks the
    internals the optimization needs (:func:`missing_internals`): the result is the
    same.
    """
    spec = op.spec

    def call_fwd() -> Any:
        return spec.fwd(*op.merge(fwd_args))

    leaves, tree = jax.tree_util.tree_flatten(
        fwd_args, is_leaf=lambda x: isinstance(x, CustomVJPPrimal)
    )
    wrapped = [isinstance(leaf, CustomVJPPrimal) for leaf in leaves]
    values = [leaf.value if w else leaf for leaf, w in zip(leaves, wrapped, strict=True)]
    flags = [leaf.perturbed if w else None for leaf, w in zip(leaves, wrapped, strict=True)]
    if not any(isinstance(v, jax.core.Tracer) for v in values):
        return call_fwd()
    if missing_internals() is not None:
        return call_fwd()  # as without optimize_remat: correct, and fwd runs twice in remat
    arrays = [_is_array(v) for v in values]
    dyn = [v for v, a in zip(values, arrays, strict=True) if a]

    def rebuild(dyn_values: Sequence[Any]) -> list[Any]:
        it = iter(dyn_values)
        full = [next(it) if a else v for v, a in zip(values, arrays, strict=True)]
        return [
            CustomVJPPrimal(v, q) if w else v for v, q, w in zip(full, flags, wrapped, strict=True)
        ]

    meta: dict[str, Any] = {}

    def fwd_flat(*dyn_values: Any) -> list[Any]:
        result = spec.fwd(*op.merge(jax.tree_util.tree_unflatten(tree, rebuild(dyn_values))))
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise _Skip  # jvp_rule reports it
        out_leaves, out_tree = jax.tree_util.tree_flatten(result[0])
        res_leaves, res_tree = jax.tree_util.tree_flatten(result[1])
        if not all(_is_array(o) for o in out_leaves):
            raise _Skip
        res_arrays = [_is_array(r) for r in res_leaves]
        meta.update(
            pair_type=type(result),
            out_tree=out_tree,
            res_tree=res_tree,
            res_arrays=res_arrays,
            res_static=[None if a else r for r, a in zip(res_leaves, res_arrays, strict=True)],
            n_out=len(out_leaves),
        )
        return [*out_leaves, *(r for r, a in zip(res_leaves, res_arrays, strict=True) if a)]

    primal = op.named_primal() if spec.vmap_rule is None else op.batched_primal()

    def primal_flat(*dyn_values: Any) -> list[Any]:
        full = jax.tree_util.tree_unflatten(tree, rebuild(dyn_values))
        full = jax.tree_util.tree_map(
            lambda x: x.value if isinstance(x, CustomVJPPrimal) else x,
            full,
            is_leaf=lambda x: isinstance(x, CustomVJPPrimal),
        )
        out = primal(*full)
        if jax.tree_util.tree_structure(out) != meta["out_tree"]:
            raise _Skip  # jvp_rule's check of fwd's output reports it
        return jax.tree_util.tree_leaves(out)

    try:
        fwd_jaxpr = jax.make_jaxpr(fwd_flat)(*dyn)
    except _Skip:
        return call_fwd()
    except jax.errors.ConcretizationTypeError:
        return call_fwd()
    n_out = meta["n_out"]
    if fwd_jaxpr.effects:
        flat = jax.extend.core.jaxpr_as_fun(fwd_jaxpr)(*dyn)
        return _unflatten(meta, flat)
    try:
        prim_jaxpr = jax.make_jaxpr(primal_flat)(*dyn)
    except (_Skip, jax.errors.ConcretizationTypeError):
        prim_jaxpr = None
    if prim_jaxpr is not None and (
        prim_jaxpr.effects or list(prim_jaxpr.out_avals) != list(fwd_jaxpr.out_avals[:n_out])
    ):
        prim_jaxpr = None  # a wrong fwd output is reported by jvp_rule
    call = _FwdCall(op.name, fwd_jaxpr, prim_jaxpr, n_out)
    prim_consts = [] if prim_jaxpr is None else prim_jaxpr.consts
    flat = fwd_p.bind(*fwd_jaxpr.consts, *prim_consts, *dyn, call=call)
    return _unflatten(meta, flat)


def _unflatten(meta: dict[str, Any], flat: Sequence[Any]) -> Any:
    n_out = meta["n_out"]
    out = jax.tree_util.tree_unflatten(meta["out_tree"], list(flat[:n_out]))
    it = iter(flat[n_out:])
    res_leaves = [
        next(it) if a else s for a, s in zip(meta["res_arrays"], meta["res_static"], strict=True)
    ]
    res = jax.tree_util.tree_unflatten(meta["res_tree"], res_leaves)
    return meta["pair_type"]((out, res))


class _FwdCall:
    """The programs of one staged ``fwd`` (a primitive parameter, hashed by identity).

    ``keep`` is None for ``fwd`` itself, or, once dead-code elimination turned the
    equation into the primal, the positions of the primal outputs still used.
    """

    def __init__(
        self,
        name: str,
        fwd_jaxpr: Any,
        prim_jaxpr: Any,
        n_out: int,
        keep: tuple[int, ...] | None = None,
    ):
        self.name, self.fwd_jaxpr, self.prim_jaxpr = name, fwd_jaxpr, prim_jaxpr
        self.n_out, self.keep = n_out, keep
        self.n_fwd_consts = 0 if keep is not None else len(fwd_jaxpr.consts)
        self.n_prim_consts = 0 if prim_jaxpr is None else len(prim_jaxpr.consts)

    def __repr__(self) -> str:
        kind = "fwd" if self.keep is None else "primal"
        return f"<jaxext.custom_vjp {self.name} {kind}>"

    def out_avals(self) -> list[Any]:
        if self.keep is None:
            return list(self.fwd_jaxpr.out_avals)
        return [self.prim_jaxpr.out_avals[i] for i in self.keep]

    def evaluate(self, *operands: Any) -> list[Any]:
        fwd_consts = operands[: self.n_fwd_consts]
        rest = operands[self.n_fwd_consts :]
        prim_consts, args = rest[: self.n_prim_consts], rest[self.n_prim_consts :]
        if self.keep is None:
            return jax.core.eval_jaxpr(self.fwd_jaxpr.jaxpr, list(fwd_consts), *args)
        outs = jax.core.eval_jaxpr(self.prim_jaxpr.jaxpr, list(prim_consts), *args)
        return [outs[i] for i in self.keep]

    def as_primal(self, keep: tuple[int, ...]) -> _FwdCall:
        return _FwdCall(self.name, self.fwd_jaxpr, self.prim_jaxpr, self.n_out, keep)


def _restage(
    name: str,
    fwd: Callable[..., list[Any]],
    primal: Callable[..., list[Any]] | None,
    n_out: int,
    operands: Sequence[Any],
) -> list[Any]:
    """Binds ``fwd_p`` for a transformed ``fwd`` (its first ``n_out`` outputs the primal's)."""
    fwd_jaxpr = jax.make_jaxpr(fwd)(*operands)
    prim_jaxpr = None if primal is None else jax.make_jaxpr(primal)(*operands)
    call = _FwdCall(name, fwd_jaxpr, prim_jaxpr, n_out)
    prim_consts = [] if prim_jaxpr is None else prim_jaxpr.consts
    return fwd_p.bind(*fwd_jaxpr.consts, *prim_consts, *operands, call=call)


fwd_p = Primitive("jaxext_custom_vjp_fwd")
fwd_p.multiple_results = True


def _fwd_impl(*operands: Any, call: _FwdCall) -> list[Any]:
    return call.evaluate(*operands)


def _fwd_abstract_eval(*operands: Any, call: _FwdCall) -> list[Any]:
    del operands
    return call.out_avals()


def _fwd_jvp(primals: Sequence[Any], tangents: Sequence[Any], *, call: _FwdCall):
    """Differentiates the program the equation runs, inlined (higher-order derivatives).

    Restaging the derivative as ``fwd_p`` (JAX's way) would mix primal and tangent
    operands in one equation, which reverse mode cannot split into known and
    unknown parts; inlined, ``grad`` of ``grad`` works (JAX's optimize_remat refuses it).
    """
    if all(type(t) is ad.Zero for t in tangents):
        outs = fwd_p.bind(*primals, call=call)
        return outs, [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in outs]
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    return jax.jvp(call.evaluate, list(primals), list(tangents))


def _fwd_batch(args: Sequence[Any], dims: Sequence[Any], *, call: _FwdCall):
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    axes = list(dims)
    if call.keep is not None:
        outs = jax.vmap(call.evaluate, in_axes=axes, out_axes=0, axis_size=size)(*args)
        return outs, [0] * len(outs)
    fwd = jax.vmap(call.evaluate, in_axes=axes, out_axes=0, axis_size=size)
    primal = None
    if call.prim_jaxpr is not None:
        prim_call = call.as_primal(tuple(range(call.n_out)))
        n_skip = call.n_fwd_consts
        batched = jax.vmap(prim_call.evaluate, in_axes=axes[n_skip:], out_axes=0, axis_size=size)

        def primal(*ops: Any) -> list[Any]:
            return batched(*ops[n_skip:])

    outs = _restage(call.name, fwd, primal, call.n_out, list(args))
    return outs, [0] * len(outs)


def _fwd_dce(used_outs: list[bool], *rest: Any) -> tuple[list[bool], Any]:
    """Dead-code elimination (JAX passes ``live_ins`` too since 0.11; the equation is last)."""
    eqn = rest[-1]
    call: _FwdCall = eqn.params["call"]
    if not any(used_outs):
        return [False] * len(eqn.invars), None
    if call.keep is not None or call.prim_jaxpr is None or any(used_outs[call.n_out :]):
        return [True] * len(eqn.invars), eqn
    # Only primal outputs are used (the forward pass of a remat): run the primal instead.
    keep = tuple(i for i in range(call.n_out) if used_outs[i])
    new_call = call.as_primal(keep)
    invars = list(eqn.invars[call.n_fwd_consts :])
    outvars = [v for v, used in zip(eqn.outvars, used_outs, strict=True) if used]
    new_eqn = new_jaxpr_eqn(
        invars, outvars, fwd_p, {"call": new_call}, no_effects, eqn.source_info, eqn.ctx
    )
    return [False] * call.n_fwd_consts + [True] * len(invars), new_eqn


def _register(table: str, primitive: Primitive, rule: Callable[..., Any]) -> None:
    """``partial_eval.<table>[primitive] = rule``, where this JAX has that table."""
    rules = getattr(pe, table, None)
    if isinstance(rules, dict) and new_jaxpr_eqn is not None and Var is not None:
        rules[primitive] = rule


fwd_p.def_impl(_fwd_impl)
fwd_p.def_abstract_eval(_fwd_abstract_eval)
ad.primitive_jvps[fwd_p] = _fwd_jvp
batching.primitive_batchers[fwd_p] = _fwd_batch
mlir.register_lowering(fwd_p, mlir.lower_fun(_fwd_impl, multiple_results=True))
_register("dce_rules", fwd_p, _fwd_dce)


@functools.cache
def missing_internals() -> str | None:
    """Why ``optimize_remat`` cannot stage ``fwd`` on this JAX, or ``None`` when it can.

    Checks that the internals the module docstring names exist, then runs one
    ``fwd_p`` equation, whose primal output alone is used, through
    ``partial_eval.dce_jaxpr`` (what ``jax.checkpoint`` does to its forward pass):
    ``_fwd_dce`` must be applied, with the signature it expects, and turn it into
    the primal. Run once (a few milliseconds), at the first traced ``fwd`` of a
    function with ``optimize_remat``.

    Returns:
        ``None``, or a sentence naming what is missing or behaves otherwise.
    """
    missing = [
        name
        for name, present in (
            ("jax.extend.core.Var", Var is not None),
            ("jax.extend.core.new_jaxpr_eqn", new_jaxpr_eqn is not None),
            ("jax.extend.core.no_effects", no_effects is not None),
            (
                "jax.interpreters.partial_eval.dce_rules",
                isinstance(getattr(pe, "dce_rules", None), dict),
            ),
            ("jax.interpreters.partial_eval.dce_jaxpr", callable(getattr(pe, "dce_jaxpr", None))),
        )
        if not present
    ]
    if missing:
        return f"this JAX lacks {', '.join(missing)}"
    try:
        x = np.float32(0.0)
        call = _FwdCall(
            "probe",
            jax.make_jaxpr(lambda a: [a, a + 1])(x),
            jax.make_jaxpr(lambda a: [a])(x),
            n_out=1,
        )
        program = jax.make_jaxpr(lambda a: fwd_p.bind(a, call=call)[:1])(x)
        trimmed, _ = pe.dce_jaxpr(program.jaxpr, [True])
        calls = [e.params["call"] for e in trimmed.eqns if e.primitive is fwd_p]
    except Exception as err:  # noqa: BLE001 -- any failure means: do not rely on it
        return (
            "jax.interpreters.partial_eval.dce_jaxpr failed on fwd_p's rule "
            f"({type(err).__name__}: {err})"
        )
    if len(calls) != 1 or calls[0].keep != (0,):
        return "jax.interpreters.partial_eval.dce_jaxpr did not apply fwd_p's rule"
    return None


# -- defremat: residuals that jax.checkpoint saves whatever its policy ------------------


def saved(tree: Any) -> Any:
    """``tree`` with its array leaves marked as saved by ``jax.checkpoint`` whatever its policy.

    ``defremat``'s ``fwd`` residuals go through this, so that under remat the
    forward pass saves them and the backward pass runs ``rem`` on them instead of
    running ``fwd`` again, as with ``jax.custom_vjp.defremat``. Outside remat it is
    the identity.
    """
    leaves, tree_def = jax.tree_util.tree_flatten(tree)
    arrays = [_is_array(leaf) for leaf in leaves]
    dyn = [leaf for leaf, a in zip(leaves, arrays, strict=True) if a]
    if not any(isinstance(leaf, jax.core.Tracer) for leaf in dyn):
        return tree
    it = iter(save_p.bind(*dyn))
    return jax.tree_util.tree_unflatten(
        tree_def, [next(it) if a else leaf for leaf, a in zip(leaves, arrays, strict=True)]
    )


save_p = Primitive("jaxext_custom_vjp_saved_residuals")
save_p.multiple_results = True
save_p.def_impl(lambda *xs: list(xs))
save_p.def_abstract_eval(lambda *avals: list(avals))
mlir.register_lowering(save_p, mlir.lower_fun(lambda *xs: list(xs), multiple_results=True))
ad.primitive_jvps[save_p] = lambda primals, tangents: (save_p.bind(*primals), list(tangents))
batching.primitive_batchers[save_p] = lambda args, dims: (save_p.bind(*args), list(dims))


def _save_partial_eval(saveable: Any, unks_in: Sequence[bool], inst_in: Sequence[bool], eqn: Any):
    """``jax.checkpoint``'s split into forward and backward: the outputs are always saved."""
    del saveable
    n = len(eqn.outvars)
    if not any(unks_in):
        # Known, and available to the backward pass as residuals when it needs them.
        return eqn, None, [False] * n, [False] * n, []
    res = [
        v
        for v, unknown, inst in zip(eqn.invars, unks_in, inst_in, strict=True)
        if not unknown and not inst and isinstance(v, Var)
    ]
    return None, eqn, [True] * n, [True] * n, res


_register("partial_eval_jaxpr_custom_rules", save_p, _save_partial_eval)


def rematerialized(out: Any, rem_out: Any) -> Any:
    """``out``, which ``jax.checkpoint``'s backward pass takes from ``rem_out`` instead.

    ``defremat``'s ``rem`` recomputes the primal output with the residuals: under
    remat, the backward pass (the gradient of what follows the call) uses that one
    rather than running ``fwd`` again. The caller checked that the trees match.
    """
    leaves, tree_def = jax.tree_util.tree_flatten(out)
    rem_leaves = tree_def.flatten_up_to(rem_out)
    if not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        return out
    leaves = [jax.numpy.asarray(leaf) for leaf in leaves]
    rem_leaves = [
        jax.numpy.asarray(r).astype(leaf.dtype) for r, leaf in zip(rem_leaves, leaves, strict=True)
    ]
    picked = pick_p.bind(*leaves, *rem_leaves, n=len(leaves), remat=True)
    return jax.tree_util.tree_unflatten(tree_def, picked)


# pick_p(*a, *b, n, remat) is ``a``. With remat=True, jax.checkpoint's backward pass computes
# it from ``b`` (see _pick_partial_eval); with remat=False it is the identity on ``a``.
pick_p = Primitive("jaxext_custom_vjp_rematerialized")
pick_p.multiple_results = True
pick_p.def_impl(lambda *xs, n, remat: list(xs[:n]))
pick_p.def_abstract_eval(lambda *avals, n, remat: list(avals[:n]))
mlir.register_lowering(
    pick_p, mlir.lower_fun(lambda *xs, n, remat: list(xs[:n]), multiple_results=True)
)


def _pick_jvp(primals: Sequence[Any], tangents: Sequence[Any], *, n: int, remat: bool):
    return pick_p.bind(*primals, n=n, remat=remat), list(tangents[:n])


def _pick_batch(args: Sequence[Any], dims: Sequence[Any], *, n: int, remat: bool):
    if not remat:
        return pick_p.bind(*args, n=n, remat=remat), list(dims[:n])
    # Both halves batched alike, so that the backward pass's half has the same layout.
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    moved = []
    for k, (a, d) in enumerate(zip(args, dims, strict=True)):
        partner = dims[(k + n) % (2 * n)]
        if d is not None:
            moved.append(jax.numpy.moveaxis(a, d, 0))
        elif partner is not None:
            moved.append(jax.numpy.broadcast_to(a, (size, *a.shape)))
        else:
            moved.append(a)
    out_dims = [None if d is None and dims[k + n] is None else 0 for k, d in enumerate(dims[:n])]
    return pick_p.bind(*moved, n=n, remat=remat), out_dims


def _pick_dce(used_outs: list[bool], *rest: Any) -> tuple[list[bool], Any]:
    """Outside remat (a jitted program's dead-code elimination): ``a``, without ``b``."""
    eqn = rest[-1]
    n = eqn.params["n"]
    if not any(used_outs):
        return [False] * len(eqn.invars), None
    if not eqn.params["remat"]:
        return [True] * len(eqn.invars), eqn
    new_eqn = new_jaxpr_eqn(
        list(eqn.invars[:n]),
        list(eqn.outvars),
        pick_p,
        {"n": n, "remat": False},
        no_effects,
        eqn.source_info,
        eqn.ctx,
    )
    return [True] * n + [False] * n, new_eqn


def _pick_partial_eval(saveable: Any, unks_in: Sequence[bool], inst_in: Sequence[bool], eqn: Any):
    """``jax.checkpoint``'s split: ``a`` on the forward pass, ``b`` on the backward pass."""
    del saveable
    n = len(eqn.outvars)

    def needed(invars: Sequence[Any], unks: Sequence[bool], inst: Sequence[bool]) -> list[Any]:
        return [
            v
            for v, u, i in zip(invars, unks, inst, strict=True)
            if not u and not i and isinstance(v, Var)
        ]

    if any(unks_in) or not eqn.params["remat"]:
        if not any(unks_in):
            return eqn, None, [False] * n, [False] * n, []
        return None, eqn, [True] * n, [True] * n, needed(eqn.invars, unks_in, inst_in)
    params = {"n": n, "remat": False}

    def half(invars: Sequence[Any]) -> Any:
        args = (pick_p, params, no_effects, eqn.source_info, eqn.ctx)
        return new_jaxpr_eqn(list(invars), list(eqn.outvars), *args)

    known, staged = half(eqn.invars[:n]), half(eqn.invars[n:])
    res = needed(eqn.invars[n:], unks_in[n:], inst_in[n:])
    return known, staged, [False] * n, [True] * n, res


ad.primitive_jvps[pick_p] = _pick_jvp
batching.primitive_batchers[pick_p] = _pick_batch
_register("dce_rules", pick_p, _pick_dce)
_register("partial_eval_jaxpr_custom_rules", pick_p, _pick_partial_eval)
