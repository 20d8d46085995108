"""The one reader of JAX's tracing state in jaxext's custom_vjp core.

What JAX is tracing now decides a few things in ``_custom_vjp``, ``_forward_mode`` and
``_eager_cache``: whether a call runs at the top level (no transformation under way:
the eager cache may serve it), whether a rule's closed-over tracers must be hoisted
(:func:`staged`), whether ``fwd`` closes over a tracer of a trace that has ended
(:func:`stale_tracers`), and running ``fwd`` outside ``jax.grad``'s linearization
(:func:`eagerly`). JAX documents none of it, so every read is here, and each degrades
to a safe answer where the internal is missing.

JAX internals this module reads (pinned by
``tests/test_trace_state.py::test_trace_state_internals_have_the_forms_this_module_names``
on the JAX it runs with; checked on JAX 0.10 and 0.12):

* ``jax.core.eval_context``: a context manager that makes JAX's evaluation trace the
  current one (:func:`at_top_level`, :func:`eagerly`). Missing: nothing is at the top
  level, and ``fwd`` runs where it is called.
* ``jax.extend.core.find_top_trace(())``: the current trace, compared by identity with
  the one found inside ``eval_context`` (:func:`at_top_level`).
* ``jax.extend.core.take_current_trace()``: a context manager giving the current trace;
  of it, ``trace.frame.constvar_to_val`` (the constants of the jaxpr a ``DynamicJaxprTrace``
  is building, a dict) and ``trace.parent_trace`` (the trace it runs in, or ``None``);
  of a tracer, ``tracer._trace`` (:func:`stale_tracers`). Missing: no tracer is stale.
* Python frames (``sys._getframe``): JAX's tracing functions hold the trace they build in
  a local variable named ``trace`` (:func:`on_call_stack`).
* ``jax.interpreters.partial_eval.JaxprTracer``: the tracers of linearization's
  partial-evaluation trace (:func:`staged`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
from jax.extend.core import take_current_trace
from jax.interpreters import partial_eval

__all__ = ["at_top_level", "eagerly", "linearizing", "on_call_stack", "stale_tracers", "staged"]

T = TypeVar("T")


_TOP_TRACE: list[Any] = []


def at_top_level() -> bool:
    """Whether no transformation is under way (JAX's evaluation is the current trace)."""
    find = getattr(getattr(jax.extend, "core", None), "find_top_trace", None)
    eval_context = getattr(jax.core, "eval_context", None)
    if find is None or eval_context is None:
        return False
    if not _TOP_TRACE:
        with eval_context():
            _TOP_TRACE.append(find(()))
    return find(()) is _TOP_TRACE[0]


def eagerly(call: Callable[[], T], inputs: Sequence[Any]) -> T:
    """``call()`` in JAX's evaluation context where no value of ``inputs`` is traced.

    Linearization runs a JVP rule under a partial-evaluation trace, where every operation
    on concrete arrays takes JAX's slow dispatch path; ``jax.custom_vjp`` runs its ``fwd``
    outside that trace. A ``call`` that closes over a traced value (only possible beneath
    another transformation) cannot run there and runs as it is.
    """
    eval_context = getattr(jax.core, "eval_context", None)
    if eval_context is None or any(isinstance(p, jax.core.Tracer) for p in inputs):
        return call()
    try:
        with eval_context():
            return call()
    except jax.errors.UnexpectedTracerError:
        return call()


def staged(in_leaves: Sequence[Any], res_arrays: Sequence[Any], t_in: Sequence[Any]) -> bool:
    """Whether a JVP rule runs inside a trace whose tracers its rules may close over.

    So whenever its inputs or residuals are traced, and also where they are constants
    inside a transformation (``jax.jvp`` or ``jax.jacfwd`` under ``jit``, in a loop body).
    Linearization (``grad``, ``linearize``) runs the rule in a partial-evaluation trace
    even at the top level: there the inputs decide, so that an eager ``grad`` does not
    dry-run the rules.
    """
    if any(isinstance(v, jax.core.Tracer) for v in (*in_leaves, *res_arrays)):
        return True
    if linearizing(t_in):
        return False
    return not at_top_level()


def linearizing(t_in: Sequence[Any]) -> bool:
    """Whether a JVP rule's tangents ``t_in`` are those of a linearization (``grad``,
    ``vjp``, ``linearize``), which JAX stages as a jaxpr to transpose or evaluate later."""
    return any(isinstance(t, partial_eval.JaxprTracer) for t in t_in)


def stale_tracers() -> list[Any]:
    """Tracers among the constants of the jaxpr being traced that belong to no enclosing trace.

    Reads JAX's tracing state through attributes it does not document (``frame``,
    ``parent_trace``, ``_trace``): where they are missing, it finds nothing.
    """
    with take_current_trace() as trace:
        pass
    values = getattr(getattr(trace, "frame", None), "constvar_to_val", None)
    if not values:
        return []
    enclosing = set()
    while trace is not None:
        enclosing.add(id(trace))
        trace = getattr(trace, "parent_trace", None)
    foreign = [
        v
        for v in list(values.values())
        if isinstance(v, jax.core.Tracer) and hasattr(v, "_trace") and id(v._trace) not in enclosing
    ]
    # JAX does not link every trace to the one around it: a jaxpr trace still being built
    # (its tracing function is on the call stack) takes its tracers back when the jaxpr
    # being traced now is inlined into it. Any other foreign tracer (of a jaxpr trace that
    # has ended, or an autodiff tracer) would be taken for a constant.
    return [v for v in foreign if not (hasattr(v._trace, "frame") and on_call_stack(v._trace))]


def on_call_stack(trace: Any) -> bool:
    """Whether a function running now is building ``trace`` (JAX's tracing functions hold
    the trace they build in a local variable named ``trace``)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_locals.get("trace") is trace:
            return True
        frame = frame.f_back
    return False
