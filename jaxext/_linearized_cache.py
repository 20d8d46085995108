"""Eager calls of a linearized function: one compiled ``J t`` per tangent map (issue 41).

The function ``jax.linearize`` returns evaluates the linear jaxpr it traced, at every
call. Through a ``jaxext.custom_vjp`` op, that jaxpr holds the op's tangent primitive,
whose parameter (the tangent map of that one traced call: the op, its nondiff
arguments, the static leaves and structure of its residuals) is the same object at
every call. Evaluated eagerly, the primitive transposes ``bwd`` and checks that it is
linear, each time: 10-30x what plain JAX's linearized function costs.

:func:`program` keeps the compiled ``J t`` per tangent map, keyed only by what can
still change between calls: the operands' abstract values and the global settings the
caller names (``jax_enable_x64``, ``jax_disable_bwd_checks``). The per-function cache
of ``_eager_cache`` (for eager ``jax.jvp``, which makes a new tangent map at every
call) keys the same program by value instead, which needs every static residual to be
a plain Python value: a ``jax.ShapeDtypeStruct`` kept for the backward (what
``jaxext.grad_type`` gives, and ``jaxext.linear`` keeps) is not, so that cache never
served a linearized ``jaxext.linear``.

As there, a program is compiled the second time its key is seen; one whose rules
cannot be staged (Python control flow on a residual's value) or read arrays other than
their operands (a global that may be rebound) is remembered as such and runs as
written, and tangent maps with hoisted closures (made inside a trace) are not cached.
As plain JAX's linearized function does, the compiled program takes the rules to be
functions of their operands: a Python value they read (a nondiff argument, a static
residual, a global number) is read when it is compiled. Entries live as long as the
tangent map does (it keys them weakly), at most :data:`PER_MAP` per map.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import jaxpr_as_fun

__all__ = ["PER_MAP", "program"]

# Programs kept per tangent map: its operands' types are fixed by the jaxpr that holds
# it, so only the global settings (and weak types) make more than one.
PER_MAP = 8
_SEEN_ONCE, _UNSTAGED = object(), object()
_PROGRAMS: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()


def program(lin: Any, args: Sequence[Any], flags: Any) -> Callable[..., Any] | None:
    """The compiled ``J t`` of the tangent map ``lin`` for ``args``, or ``None`` (run as is).

    Args:
        lin: the tangent primitive's parameter (``apply(args)`` computes ``J t``;
            ``n_res`` and ``n_own`` count its residual operands, all of them and its
            own, which differ where closures were hoisted).
        args: the primitive's concrete operands (residuals, then tangents).
        flags: the hashable global settings that change what tracing ``lin`` makes.

    Returns:
        A function of ``*args`` returning the output tangents, from the second call of a
        key on; ``None`` at the first call and for maps that run as written.
    """
    if lin.n_res != lin.n_own:  # hoisted closures: only made inside a trace
        return None
    try:
        key = (flags, tuple(jax.typeof(a) for a in args))
        hash(key)
        entries = _PROGRAMS.setdefault(lin, {})
    except TypeError:  # a type JAX cannot hash, or a map that cannot be weakly referenced
        return None
    entry = entries.get(key)
    if entry is None:  # first sighting: run as is
        if len(entries) >= PER_MAP:
            entries.pop(next(iter(entries)))
        entries[key] = _SEEN_ONCE
        return None
    if entry is _SEEN_ONCE:
        entry = entries[key] = _compiled(lin, args)
    return None if entry is _UNSTAGED else entry


def _compiled(lin: Any, args: Sequence[Any]) -> Any:
    """``lin``'s ``J t`` staged and jitted, or ``_UNSTAGED``."""
    try:
        closed = jax.make_jaxpr(lambda *a: lin.apply(a))(*args)
    except Exception:  # noqa: BLE001 -- the uncached path raises the error itself
        return _UNSTAGED
    if closed.consts:  # arrays read other than the operands, which may be rebound
        return _UNSTAGED
    return jax.jit(jaxpr_as_fun(closed))
