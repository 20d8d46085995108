"""``jaxext/_trace_state.py``: the one reader of JAX's tracing state, pinned.

The module's header lists each JAX internal it reads; this file checks that each has the
form the module names on the JAX it runs with (CI runs it on JAX 0.10 and 0.12), and that
each reader gives the answer the core relies on, as
``tests/test_remat.py::test_remat_internals_have_the_forms_this_module_names`` does for
``_remat.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import partial_eval

from jaxext import _trace_state


def _tangent_types_under_grad():
    """The types of the tangents a ``jax.custom_jvp`` rule sees under ``jax.grad``."""
    seen = []

    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        seen.extend(type(t) for t in tangents)
        return f(primals[0]), jnp.cos(primals[0]) * tangents[0]

    jax.grad(f)(np.float32(0.5))
    return seen


def test_trace_state_internals_have_the_forms_this_module_names():
    # eval_context and find_top_trace: the top-level trace, found again by identity.
    assert callable(jax.core.eval_context)
    assert callable(jex_core.find_top_trace)
    with jax.core.eval_context():
        top = jex_core.find_top_trace(())
    assert jex_core.find_top_trace(()) is top
    inside = []
    jax.jit(lambda x: inside.append(jex_core.find_top_trace(())) or x)(1.0)
    assert inside and inside[0] is not top

    # take_current_trace: a context manager; a jaxpr trace's frame holds its constants in
    # a dict, links its parent, and its tracers name it in `_trace`.
    forms = {}

    def traced(x):
        with jex_core.take_current_trace() as trace:
            pass
        forms["trace"] = trace
        forms["frame_consts"] = getattr(getattr(trace, "frame", None), "constvar_to_val", None)
        forms["has_parent"] = hasattr(trace, "parent_trace")
        forms["tracer_trace"] = getattr(x, "_trace", None)
        forms["on_stack"] = _trace_state.on_call_stack(trace)
        return x * 2.0

    jax.jit(traced)(jnp.ones(3))
    assert isinstance(forms["frame_consts"], dict)
    assert forms["has_parent"]
    assert forms["tracer_trace"] is forms["trace"]
    # JAX's tracing function holds the trace it builds in a local variable named `trace`.
    assert forms["on_stack"]
    assert not _trace_state.on_call_stack(forms["trace"])  # that trace has ended

    # partial_eval.JaxprTracer: the tangents of linearization (grad) are of that class.
    assert isinstance(partial_eval.JaxprTracer, type)
    assert _tangent_types_under_grad() == [partial_eval.JaxprTracer]


def test_at_top_level_only_outside_every_transformation():
    assert _trace_state.at_top_level()
    seen = []

    def record(x):
        seen.append(_trace_state.at_top_level())
        return x

    jax.jit(record)(1.0)
    jax.jvp(record, (1.0,), (1.0,))
    jax.grad(record)(1.0)
    jax.vmap(record)(jnp.ones(2))
    assert seen == [False, False, False, False]


def test_eagerly_runs_at_the_top_level_unless_an_input_is_traced():
    seen = []

    def under_grad(x):
        seen.append(_trace_state.eagerly(_trace_state.at_top_level, [np.float32(1.0)]))
        seen.append(_trace_state.eagerly(_trace_state.at_top_level, [x]))
        return x

    jax.grad(under_grad)(1.0)
    assert seen == [True, False]


def test_staged_where_rules_may_close_over_tracers():
    concrete = [jnp.ones(2)]
    assert not _trace_state.staged(concrete, concrete, concrete)  # eager jax.jvp
    flags = []
    jax.jit(lambda x: flags.append(_trace_state.staged([x], [], [])) or x)(1.0)
    jax.jit(lambda x: flags.append(_trace_state.staged(concrete, concrete, concrete)) or x)(1.0)
    assert flags == [True, True]  # a traced input; constants inside a transformation


def test_stale_tracers_finds_none_at_the_top_level_or_in_a_live_trace():
    assert _trace_state.stale_tracers() == []
    found = []

    def traced(x):
        y = x * 2.0
        jax.jit(lambda z: found.append(_trace_state.stale_tracers()) or z + y)(x)
        return y

    jax.jit(traced)(jnp.ones(3))
    assert found == [[]]  # `y` belongs to the enclosing jit's trace, still being built
