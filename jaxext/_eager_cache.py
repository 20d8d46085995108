"""Eager work of ``jaxext.custom_vjp`` reused per abstract signature (issue 19).

``_custom_vjp.py`` defines the drop-in and its primitives and runs every step of a
call as written (its ``Steps``). Outside any transformation, on concrete arrays, some
of those steps cost more in Python than the call itself, so this module's
:class:`CachedSteps`, a subclass, takes them faster, and ``jaxext/__init__.py``
installs it as the steps every JVP rule takes (``_custom_vjp.STEPS``). Installing
plain ``Steps()`` instead turns the caches off: everything then runs as written, which
is always correct.

What is kept, per decorated function and per *abstract signature* of a call:

* the primal's output type, against which ``fwd``'s output is checked (tracing the
  primal again at every eager ``grad`` costs more than the call);
* the eager forward-mode tangent ``J t`` (a transposed and linearity-checked
  ``bwd``, or the ``jvp`` rule), compiled the second time its signature is seen;
* the whole eager ``jax.jvp`` rule (``fwd`` and ``J t``) as one compiled program,
  also built the second time, for calls at the top level (no transformation under
  way, every primal and tangent a concrete array).

Not a cache, but eager-only too: ``fwd`` on concrete inputs runs in JAX's evaluation
context rather than under the partial-evaluation trace of ``jax.grad``'s
linearization, as ``jax.custom_vjp`` runs it (``_trace_state.eagerly``, which with
``_trace_state.at_top_level`` is how this module reads JAX's tracing state).

A signature is everything static about a call: the function and its rules, the
positions and values of the nondiff arguments (plain immutable Python values only,
keyed by type and ``repr`` so that ``1``, ``1.0``, ``True`` and ``0.0``, ``-0.0``
stay apart; a call with any other nondiff value is not cached), the pytree
structure and abstract values (shape, dtype, weak type, sharding) of the
differentiable arguments, and the global settings that change what tracing makes
of the same inputs: ``jax_enable_x64`` (under which a Python float, ``float`` as a
dtype or a literal in a rule takes 64 bits, so a program traced before the setting
changed would compute, or check, in the wrong precision) and
``jax_disable_bwd_checks``. Programs whose rules cannot be staged (Python control
flow on a value) or read arrays other than their arguments (a global that may be
rebound) are remembered as such and run as written; as under ``jax.jit``, rules are
taken to be functions of their arguments otherwise.

Bounds: at most :data:`CACHE_SIZE` (64) entries per decorated function, least
recently used first out, so that eager calls each with a new Python constant (a
step size) neither grow memory nor compile: nothing is compiled for a signature
seen once. Entries hold rules and static values, never a call's arrays.
"""

from __future__ import annotations

import collections
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import jaxpr_as_fun

from . import _linearized_cache
from ._avals import is_differentiable
from ._custom_vjp import Steps
from ._trace_state import at_top_level, eagerly

__all__ = ["CACHE_SIZE", "CachedSteps"]

# Entries kept per decorated function: eager calls with distinct nondiff values (a new
# Python constant each step) evict old entries rather than growing without bound.
CACHE_SIZE = 64
_PLAIN_VALUES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    np.generic,
    np.dtype,
    type,
    slice,
)
_SEEN_ONCE, _UNSTAGED = object(), object()


class CachedSteps(Steps):
    """The steps of a ``custom_vjp`` call that reuse eager work (see the module docstring).

    Each step has the meaning and signature of its ``Steps`` original and falls back on
    it wherever no cache applies.
    """

    def jvp(
        self,
        op: Any,
        primals: tuple,
        in_leaves: list[Any],
        in_tree: Any,
        perturbed: tuple,
        t_in: list,
    ) -> tuple[Any, Any]:
        """The JVP rule: eagerly, one compiled program per call signature seen twice.

        An eager ``jax.jvp`` otherwise runs ``fwd`` operation by operation and then the
        compiled tangent (see :meth:`tangent`). Where every primal and tangent is a
        concrete array and no transformation is under way (the JVP's parent is the
        top-level evaluation), the rule's work -- ``fwd`` and ``J t`` -- is compiled into
        one program, built the second time a signature is seen from the traced rule (the
        program ``jax.jit`` would make of it), and run at every later call. A signature
        whose rule cannot be staged (Python control flow on values, closed-over arrays)
        or whose eager outputs are not all arrays (a Python number) keeps running as is,
        as do ``fwd`` rules with ``optimize_remat`` and calls inside other
        transformations.
        """
        key = _jvp_key(op, in_leaves, in_tree, perturbed, t_in)
        if key is None:
            return super().jvp(op, primals, in_leaves, in_tree, perturbed, t_in)
        cache = _entries(op.spec)
        entry = cache.get(key)
        if entry is None:  # first sighting: run as is, and note whether the outputs are arrays
            out, out_t = super().jvp(op, primals, in_leaves, in_tree, perturbed, t_in)
            arrays = all(isinstance(o, jax.Array) for o in jax.tree_util.tree_leaves(out))
            _put(cache, key, _SEEN_ONCE if arrays else _UNSTAGED)
            return out, out_t
        cache.move_to_end(key)
        if entry is _SEEN_ONCE:
            entry = self._stage_jvp(op, in_leaves, in_tree, perturbed, t_in)
            if entry is not _UNSTAGED:
                try:  # compiles it: a rule that cannot be lowered fails here
                    result = entry.run(in_leaves, t_in)
                except Exception:  # noqa: BLE001 -- the uncached path raises the error itself
                    entry = _UNSTAGED
            _put(cache, key, entry)
            if entry is not _UNSTAGED:
                return result
        if entry is _UNSTAGED:
            return super().jvp(op, primals, in_leaves, in_tree, perturbed, t_in)
        return entry.run(in_leaves, t_in)

    def _stage_jvp(
        self, op: Any, in_leaves: list[Any], in_tree: Any, perturbed: tuple, t_in: list
    ) -> Any:
        """The compiled program for :meth:`jvp`, or ``_UNSTAGED``."""
        n_in, meta = len(in_leaves), {}
        # The program keeps the op (in its tangent's parameters): not this call's arrays.
        args = tuple(None if i in op.diff else a for i, a in enumerate(op.args))
        op = type(op)(op.spec, op.name, args, op.diff)

        def staged(*args: Any) -> list[Any]:
            leaves = list(args[:n_in])
            primals = jax.tree_util.tree_unflatten(in_tree, leaves)
            out, out_t = self.traced_jvp(op, primals, leaves, in_tree, perturbed, list(args[n_in:]))
            out_leaves, out_tree = jax.tree_util.tree_flatten(out)
            out_float = tuple(is_differentiable(jnp.result_type(o)) for o in out_leaves)
            t_leaves = out_tree.flatten_up_to(out_t)
            meta["out"] = out_tree, out_float
            return [*out_leaves, *(t for t, f in zip(t_leaves, out_float, strict=True) if f)]

        try:
            closed = jax.make_jaxpr(staged)(*in_leaves, *t_in)
        except Exception:  # noqa: BLE001 -- the uncached path raises the error itself
            return _UNSTAGED
        if closed.consts:  # arrays read other than the arguments, which may be rebound
            return _UNSTAGED
        return _CompiledJvp(jax.jit(jaxpr_as_fun(closed)), *meta["out"])

    def fwd(self, op: Any, fwd_args: Sequence[Any], in_leaves: Sequence[Any]) -> Any:
        """Runs ``fwd``; eagerly where its inputs are concrete (eager ``grad``, ``vjp``).

        Linearization runs the JVP rule under a partial-evaluation trace, where every
        operation on concrete arrays takes JAX's slow dispatch path; ``jax.custom_vjp``
        runs its ``fwd`` outside that trace. A ``fwd`` that closes over a traced value
        (only possible beneath another transformation) cannot run eagerly and runs as
        before.
        """
        return eagerly(lambda: op.call_fwd(fwd_args), in_leaves)

    def expected_output(self, op: Any, primals: tuple) -> Any:
        """The primal's output type for ``primals`` (``None``: it cannot be traced abstractly).

        Kept per abstract signature: tracing the primal again for every eager call costs
        more than the call itself. Not where a Python number is among ``primals``: the
        primal sees its value (see ``abstract_output``), which the signature leaves out.
        """
        key = _key(op, "out", primals)
        if key is None or _has_python_number(primals):
            return super().expected_output(op, primals)
        cache = _entries(op.spec)
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
        expected = super().expected_output(op, primals)
        _put(cache, key, expected)
        return expected

    def tangent(self, lin: Any, args: Sequence[Any]) -> list[jax.Array]:
        """Eager ``J t``: compiled once per abstract signature seen twice (see ``_tangent``),
        or per tangent map, for a linearized function called again (``_linearized_cache``)."""
        compiled = _linearized_cache.program(lin, args, _flags()) or _tangent(args, lin)
        if compiled is None:
            return super().tangent(lin, args)
        return list(compiled(*args))


def _entries(spec: Any) -> collections.OrderedDict:
    """The cache of the decorated function ``spec`` (a bounded LRU)."""
    cache = spec.__dict__.get("_eager_cache")
    if cache is None:
        cache = spec.__dict__["_eager_cache"] = collections.OrderedDict()
    return cache


def _put(cache: collections.OrderedDict, key: Any, value: Any) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > CACHE_SIZE:
        cache.popitem(last=False)


def _flags() -> tuple[bool, bool]:
    """The global settings every entry is keyed by (see the module docstring)."""
    return (
        bool(jax.config.jax_enable_x64),
        bool(getattr(jax.config, "jax_disable_bwd_checks", False)),
    )


def _static_key(values: Any) -> Any:
    """A hashable key for Python values, or ``None`` where they cannot safely be one.

    Only plain immutable values (numbers, strings, dtypes, types, module-level functions)
    and containers of them: an arbitrary object may be mutable or hold arrays or tracers,
    which a cache must not keep alive. Numbers are keyed by type and ``repr`` so that
    ``1``, ``1.0``, ``True`` and ``0.0``, ``-0.0`` stay apart.
    """
    leaves, tree = jax.tree_util.tree_flatten(values)
    key = []
    for leaf in leaves:
        if isinstance(leaf, (float, complex, np.inexact)):
            key.append((type(leaf), repr(leaf)))
        elif isinstance(leaf, (*_PLAIN_VALUES, types.BuiltinFunctionType)) or (
            isinstance(leaf, types.FunctionType) and leaf.__closure__ is None
        ):
            key.append((type(leaf), leaf))
        else:
            return None
    try:
        hash(tree)
        return tree, tuple(key)
    except TypeError:
        return None


def _key(op: Any, kind: str, diff_values: Any) -> Any:
    """A key naming everything static about ``op``'s call, or ``None`` (not cacheable).

    The function and rules, the positions and values of the nondiff arguments, the
    pytree structure and the abstract values (shape, dtype, weak type, sharding) of the
    differentiable ones, and the global settings of :func:`_flags`.
    """
    nondiff = _static_key(op.nondiff())
    if nondiff is None:
        return None
    leaves, tree = jax.tree_util.tree_flatten(diff_values)
    spec = op.spec
    rules = (spec.fun, spec.fwd, spec.bwd, spec.jvp, spec.symbolic_zeros)
    key = (kind, rules, len(op.args), op.diff, nondiff, tree, _flags())
    try:
        key = (*key, tuple(jax.typeof(leaf) for leaf in leaves))
        hash(key)
    except TypeError:  # a type JAX cannot hash (an extended one, say): not cached
        return None
    return key


def _has_python_number(values: Any) -> bool:
    """Whether a leaf of ``values`` is a Python number rather than an array."""
    return any(
        not isinstance(leaf, (jax.Array, np.ndarray, np.generic))
        for leaf in jax.tree_util.tree_leaves(values)
    )


# -- the eager tangent -----------------------------------------------------------------


def _tangent(args: Sequence[Any], lin: Any) -> Callable[..., Any] | None:
    """A compiled ``J t`` for ``lin``'s abstract signature, or ``None`` (run it as is).

    Eager forward mode otherwise traces and transposes ``bwd`` (and checks that it is
    linear) at every call. The program is compiled the second time a signature is seen, so
    that eager calls each with a new nondiff value (a Python constant) compile nothing. A
    signature whose rules cannot be staged (Python control flow on a residual's value) or
    read arrays other than their arguments is remembered as such and keeps running as is.
    As under ``jax.jit``, the rules are taken to be functions of their arguments: a Python
    number they read from a global that is later rebound is not noticed.
    """
    if lin.n_res != lin.n_own:  # hoisted closures: only made inside a trace
        return None
    spec = lin.op.spec
    key = _key(lin.op, "tangent", list(args))
    static = _static_key([lin.res_static, spec.forward_mode_hint, spec.no_derivatives_message])
    if key is None or static is None:
        return None
    key = (*key, lin.perturbed, lin.in_tree, lin.in_avals, lin.res_tree, lin.res_is_array)
    key = (*key, static, lin.out_tree, lin.out_avals, lin.out_float)
    try:
        hash(key)
    except TypeError:
        return None
    cache = _entries(spec)
    entry = cache.get(key)
    if entry is None:  # first sighting: run as is
        _put(cache, key, _SEEN_ONCE)
        return None
    cache.move_to_end(key)
    if entry is _SEEN_ONCE:
        try:
            closed = jax.make_jaxpr(lambda *a: lin.apply(a))(*args)
        except Exception:  # noqa: BLE001 -- the uncached path raises the error itself
            closed = None
        if closed is None or closed.consts:
            # Arrays the rules read other than their arguments (a global or closed-over
            # array) may be rebound between eager calls: such rules always run afresh.
            _put(cache, key, _UNSTAGED)
            return None
        entry = jax.jit(jaxpr_as_fun(closed))
        _put(cache, key, entry)
    return None if entry is _UNSTAGED else entry


# -- the eager JVP program ---------------------------------------------------------------


class _CompiledJvp:
    """One eager JVP signature's compiled ``fwd`` and ``J t`` (see :meth:`CachedSteps.jvp`)."""

    def __init__(self, program: Callable[..., Any], out_tree: Any, out_float: tuple):
        self.program, self.out_tree, self.out_float = program, out_tree, out_float

    def run(self, in_leaves: Sequence[Any], t_in: Sequence[Any]) -> tuple[Any, Any]:
        flat = self.program(*in_leaves, *t_in)
        out_leaves = flat[: len(self.out_float)]
        tangents = iter(flat[len(self.out_float) :])
        out_t = [
            next(tangents) if f else np.zeros(np.shape(o), jax.dtypes.float0)
            for o, f in zip(out_leaves, self.out_float, strict=True)
        ]
        return (
            jax.tree_util.tree_unflatten(self.out_tree, out_leaves),
            jax.tree_util.tree_unflatten(self.out_tree, out_t),
        )


def _jvp_key(op: Any, in_leaves: list[Any], in_tree: Any, perturbed: tuple, t_in: list) -> Any:
    """The key of an eager JVP's compiled program, or ``None`` where it runs as is."""
    spec = op.spec
    if spec.optimize_remat:
        return None
    for leaf in (*in_leaves, *t_in):  # (tracers under grad's linearization: a quick no)
        if not isinstance(leaf, (jax.Array, np.ndarray)) or isinstance(leaf, jax.core.Tracer):
            return None
    if not at_top_level():
        return None
    # What every cached entry of this call is keyed by, plus what only this program reads.
    base = _key(op, "jvp", (list(in_leaves), list(t_in)))
    static = _static_key([spec.forward_mode_hint, spec.no_derivatives_message])
    if base is None or static is None:
        return None
    key = (base, spec.hoist_closures, static, in_tree, perturbed)
    try:
        hash(key)
    except TypeError:  # a type JAX cannot hash: not cached
        return None
    return key
