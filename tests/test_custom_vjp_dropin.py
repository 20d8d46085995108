"""`jaxext.custom_vjp` as a drop-in for `jax.custom_vjp` under libraries' usage patterns.

Each test reproduces, in a few lines, what a library built on ``jax.custom_vjp``
(Flax, Equinox, diffrax) does with it, and holds jaxext to what JAX gives there (JAX's
own ``jax.custom_vjp`` on the same rules, or hand-computed values).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, importorskip_extra

import jaxext

# -- extended dtypes with a tangent dtype of their own (Flax's FP8 meta dtype) ----------
# flax.linen.fp8_ops keeps scales and amax histories in `fp32_max_grad`, an extended dtype
# whose tangent dtype is itself and whose gradients accumulate by `max`; its custom_vjps'
# backwards return the updated history as that input's "gradient".

fp8_ops = pytest.importorskip("flax.linen.fp8_ops")


def _as_jaxext(op):
    """Flax's ``jax.custom_vjp`` op ``op``, rebuilt as a ``jaxext.custom_vjp``."""
    rebuilt = jaxext.custom_vjp(op.fun, nondiff_argnums=op.nondiff_argnums)
    rebuilt.defvjp(op.fwd, op.bwd)
    return rebuilt


def _meta(x):
    return jax.lax.convert_element_type(jnp.asarray(x, jnp.float32), fp8_ops.fp32_max_grad)


def _f32(x):
    return jax.lax.convert_element_type(x, jnp.float32)


def test_fp8_amax_history_is_the_gradient_of_an_extended_dtype_input():
    # Flax's FP8 meta-dtype test: in_qdq in a scan, the history and scale read three
    # times; their "gradients" (max-accumulated) are the updated history and scale.
    e4m3_max = float(jnp.finfo(jnp.float8_e4m3fn).max)

    def step(in_qdq):
        def outer(x, history, scale):
            history, scale = _meta(history), _meta(scale)

            def body(carry, _):
                return in_qdq(jnp.float32, jnp.float8_e4m3fn, carry, scale, history), None

            out, _ = jax.lax.scan(body, jnp.array([x], jnp.float32), None, length=3)
            return out[0]

        return jax.jit(jax.grad(outer, (0, 1, 2)))

    results = {}
    for name, op in (("jax", fp8_ops.in_qdq), ("jaxext", _as_jaxext(fp8_ops.in_qdq))):
        fn, history, scale, trail = step(op), jnp.zeros(3), jnp.ones(1), []
        for x in (2.0, 3.0, 4.0):
            g_x, history, scale = fn(x, history, scale)
            history, scale = _f32(history), _f32(scale)
            trail.append((g_x, history, scale))
        results[name] = trail
    expected = [  # Flax's hand-computed trail
        ([2.0, 0.0, 0.0], [1.0]),
        ([3.0, 0.0, 2.0], [2.0 / e4m3_max]),
        ([4.0, 2.0, 3.0], [3.0 / e4m3_max]),
    ]
    for (g_x, history, scale), (want_history, want_scale) in zip(
        results["jaxext"], expected, strict=True
    ):
        assert_close(g_x, 1.0)
        assert_close(history, want_history, rtol=0, atol=0)
        assert_close(scale, want_scale)
    for got, want in zip(results["jaxext"], results["jax"], strict=True):
        for a, b in zip(got, want, strict=True):
            assert_close(a, b)


@pytest.mark.parametrize("jit", [False, True])
def test_extended_dtype_input_and_output_gradients_match_jax_custom_vjp(jit):
    # An extended-dtype output (its cotangent left zero here) and input (its gradient
    # None: the zero of its own rules, -inf for a max-accumulated dtype), as in Flax's in_q.
    def make(custom_vjp):
        @custom_vjp
        def op(x, scale, history):
            return x * 2, history

        op.defvjp(
            lambda x, scale, history: ((x * 2, history), history),
            lambda history, g: (g[0] * 2, None, history),
        )
        return op

    def loss(op):
        def f(x, scale, history):
            y, new_history = op(x, scale, history)
            return y.sum(), new_history

        fn = jax.grad(f, (0, 1, 2), allow_int=True, has_aux=True)
        return jax.jit(fn) if jit else fn

    x, scale, history = jnp.array([1.0, -3.0, 2.0]), _meta(1.0), _meta([0.5, 0.0, 0.0])
    want, _ = loss(make(jax.custom_vjp))(x, scale, history)
    for _ in range(2):  # the second eager call may take the eager cache's path
        got, _ = loss(make(jaxext.custom_vjp))(x, scale, history)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype
            assert_close(_f32(a), _f32(b), rtol=0, atol=0)
    assert_close(_f32(want[1]), -np.inf, rtol=0, atol=0)


# -- the primal traced once, in the caller's context (Flax NNX) -------------------------
# nnx.custom_vjp's primal reads an update context that only exists while the caller's
# function runs; `nnx.value_and_grad(nnx.jit(f))` linearizes the jitted program after
# that. The check of fwd's output must use the type JAX found when it traced the primal.

_CONTEXT: list[str] = []


def _context_bound_op(custom_vjp):
    @custom_vjp
    def op(x):
        if not _CONTEXT:
            raise RuntimeError("the primal was traced outside its caller's context")
        return jnp.sin(x) * 2

    op.defvjp(lambda x: (jnp.sin(x) * 2, jnp.cos(x)), lambda cos_x, g: (2 * g * cos_x,))
    return op


def _in_context(op):
    def f(x):
        _CONTEXT.append("inside")
        try:
            return op(x).sum()
        finally:
            _CONTEXT.pop()

    return f


@pytest.mark.parametrize("transform", ["grad_of_jit", "value_and_grad_of_jit", "grad"])
def test_primal_is_not_traced_again_outside_the_callers_context(transform, x64):
    x = jnp.array([0.5, -1.0, 2.0])
    wrap = {
        "grad_of_jit": lambda f: jax.grad(jax.jit(f)),
        "value_and_grad_of_jit": lambda f: jax.value_and_grad(jax.jit(f)),
        "grad": jax.grad,
    }[transform]
    got = wrap(_in_context(_context_bound_op(jaxext.custom_vjp)))(x)
    want = wrap(_in_context(_context_bound_op(jax.custom_vjp)))(x)
    assert_close(jax.tree.leaves(got)[-1], 2 * np.cos([0.5, -1.0, 2.0]))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(a, b)


def test_wrong_fwd_output_is_still_caught_under_jit():
    @jaxext.custom_vjp
    def op(x):
        return jnp.sin(x)

    op.defvjp(lambda x: (jnp.sin(x)[:1], None), lambda _, g: (g,))
    with pytest.raises(TypeError, match="fwd's output must have the primal's shapes"):
        jax.grad(jax.jit(lambda x: op(x).sum()))(jnp.ones(3))


# -- Python numbers through fwd (Equinox) ----------------------------------------------
# An eager `grad` hands a Python float input to the rules as a Python float. Equinox's
# filter_custom_vjp keeps outputs that are not arrays as static data, out of the pytree's
# leaves: fwd's output then has a different structure than the primal traced on arrays.


@jax.tree_util.register_pytree_node_class
class _Static:
    """A value kept in the pytree's structure, not its leaves (as Equinox keeps non-arrays)."""

    def __init__(self, value):
        self.value = value

    def tree_flatten(self):
        return (), self.value

    @classmethod
    def tree_unflatten(cls, value, children):
        del children
        return cls(value)


def _filtered(value):
    """``(array, _Static(None))`` for an array, ``(None, _Static(value))`` otherwise."""
    return (value, _Static(None)) if isinstance(value, jax.Array) else (None, _Static(value))


def _filtering_op(custom_vjp):
    def primal(x, y):
        return _filtered(x * y), _filtered(x)

    op = custom_vjp(primal)
    op.defvjp(
        lambda x, y: (primal(x, y), (x, y)),
        lambda res, g: (jnp.sum(g[0][0] * res[1]), g[0][0] * res[0]),
    )
    return op


@pytest.mark.parametrize("jit", [False, True])
def test_python_float_input_through_fwd_matches_jax_custom_vjp(jit):
    y = jnp.array([1.0, 2.0])

    def grads(custom_vjp):
        op = _filtering_op(custom_vjp)
        fn = jax.grad(lambda x, y: op(x, y)[0][0].sum(), (0, 1))
        return jax.jit(fn) if jit else fn

    want = grads(jax.custom_vjp)(1.5, y)
    fn = grads(jaxext.custom_vjp)
    for x in (1.5, 1.5, -0.5):  # again: the eager cache's path must not mix up the values
        got = fn(x, y)
        assert_close(got[0], 3.0)  # d/dx sum(x * y) = sum(y)
        assert_close(got[1], [x, x])
    for a, b in zip(fn(1.5, y), want, strict=True):
        assert_close(a, b)


# -- the same, with the libraries' own wrappers built on jaxext.custom_vjp --------------
# Flax NNX and Equinox call `jax.custom_vjp` when a function is decorated: swapped here
# while the test's functions are defined.


@pytest.fixture
def swapped(monkeypatch):
    """``jax.custom_vjp`` is ``jaxext.custom_vjp`` while the test runs."""
    monkeypatch.setattr(jax, "custom_vjp", jaxext.custom_vjp)


def test_flax_nnx_custom_vjp_under_value_and_grad_of_jit(swapped):
    nnx = pytest.importorskip("flax.nnx")

    class Scale(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.array([1.5, -2.0]))
            self.calls = nnx.BatchStat(jnp.array(0, jnp.uint32))

    def scaled(m, x):
        m.calls[...] += 1  # needs NNX's update context
        return jnp.sin(x) * m.w

    def scaled_fwd(m, x):
        return scaled(m, x), (m, x)

    def scaled_bwd(res, g):
        m, x = res
        (m_g, _), out_g = g
        m_g["w"][...] = jnp.sin(x) * out_g
        return m_g, jnp.cos(x) * m.w * out_g

    op = nnx.custom_vjp(scaled)
    op.defvjp(scaled_fwd, scaled_bwd)

    @nnx.jit
    def loss(x, m):
        return op(m, x).sum()

    m, x = Scale(), jnp.array([0.3, -0.7])
    value, grad = nnx.value_and_grad(loss)(x, m)
    w = np.array([1.5, -2.0])
    assert_close(value, np.sum(np.sin([0.3, -0.7]) * w))
    assert_close(grad, np.cos([0.3, -0.7]) * w)
    assert int(m.calls[...]) == 1


def test_equinox_filter_custom_vjp_with_python_float_inputs(swapped):
    eqx = importorskip_extra("equinox", "libs")

    @eqx.filter_custom_vjp
    def f(vjp_arg, y):
        x, a = vjp_arg
        return x * a * y

    @f.def_fwd
    def f_fwd(perturbed, vjp_arg, y):
        del perturbed
        x, a = vjp_arg
        return x * a * y, None

    @f.def_bwd
    def f_bwd(residuals, g, perturbed, vjp_arg, y):
        del residuals, perturbed
        x, a = vjp_arg
        return g * a * y, g * x * y

    # x a Python float: Equinox sees a non-array, so the output is static (JAX: 0).
    assert_close(jax.grad(lambda x: f((x, 2.0), 3.0))(1.5), 0.0)
    assert_close(jax.grad(lambda a: f((jnp.float32(1.5), a), 3.0))(2.0), 4.5)
    assert_close(jax.jit(jax.grad(lambda x: f((x, 2.0), 3.0)))(1.5), 6.0)


# -- closed-over traced values, and the backward traced once (diffrax, Equinox) --------
# A diffrax solve under jit whose vector field closes over the differentiated model:
# JAX differentiates the traced solve after its trace has ended, where the rules'
# closed-over value is stale.


def _closing_op(custom_vjp, scale):
    @custom_vjp
    def scaled(x):
        return jnp.sin(x) * scale

    scaled.defvjp(lambda x: (jnp.sin(x) * scale, jnp.cos(x)), lambda c, g: (g * c * scale,))
    return scaled


CLOSURES = {  # grad of (x, w) -> loss, the op's rules closing over 2 * w
    # a jit's tracer, not differentiated (JAX fails too, with "No constant handler")
    "jit_value": (0, lambda op_of: jax.jit(lambda x, w: op_of(w * 2)(x).sum())),
    # a jit's tracer, differentiated: JAX raises its CustomVJPException
    "jit_value_differentiated": (1, lambda op_of: jax.jit(lambda x, w: op_of(w * 2)(x).sum())),
    # the differentiated value itself, inside a jit (diffrax's vector field closing over
    # the model): JAX raises its CustomVJPException
    "differentiated_across_jit": (
        1,
        lambda op_of: lambda x, w: jax.jit(lambda x: op_of(w * 2)(x).sum())(x),
    ),
}


@pytest.mark.parametrize("case", list(CLOSURES))
def test_rules_closing_over_a_value_out_of_reach_are_a_clear_error(case):
    argnum, program = CLOSURES[case]
    x, w = jnp.array([0.5, -1.0]), jnp.float32(1.5)
    loss = program(lambda scale: _closing_op(jaxext.custom_vjp, scale))
    with pytest.raises(jaxext.RuleTypeError, match=r"`scaled`: its rules close over a traced"):
        jax.grad(loss, argnum)(x, w)


def test_rules_closing_over_values_of_live_traces_still_work(x64):
    x, s = jnp.array([0.5, -1.0]), 1.5

    def scan_loss(s):  # the closed-over value has a tangent, inside the scan's own trace
        def body(carry, k):
            return carry + _closing_op(jaxext.custom_vjp, s * k)(x).sum(), None

        return jax.lax.scan(body, 0.0, jnp.arange(1.0, 3.0))[0]

    def jit_inside(x):  # a jit inside grad, closing over a value grad does not perturb
        return jax.jit(lambda x: _closing_op(jaxext.custom_vjp, s * 2)(x).sum())(x)

    assert_close(jax.grad(scan_loss)(s), 3 * np.sum(np.sin([0.5, -1.0])))
    assert_close(jax.grad(jit_inside)(x), 2 * s * np.cos([0.5, -1.0]))


@pytest.mark.parametrize("order", ["grad_of_jit", "jit_of_grad"])
def test_bwd_is_traced_once_per_compilation_as_with_jax_custom_vjp(order):
    def count(custom_vjp):
        traces = []

        @custom_vjp
        def op(x):
            return jnp.sin(x)

        def bwd(cos_x, g):
            traces.append(1)
            return (g * cos_x,)

        op.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), bwd)
        f = lambda x: op(x).sum()  # noqa: E731
        fn = jax.grad(jax.jit(f)) if order == "grad_of_jit" else jax.jit(jax.grad(f))
        x = jnp.array([0.5, -1.0])
        for _ in range(2):
            assert_close(fn(x), np.cos([0.5, -1.0]))
        return len(traces)

    assert count(jaxext.custom_vjp) == count(jax.custom_vjp) == 1


def test_equinox_bwd_traced_once_under_jit(swapped):
    eqx = importorskip_extra("equinox", "libs")
    traces = []

    @eqx.filter_custom_vjp
    def f(x):
        return x

    @f.def_fwd
    def f_fwd(perturbed, x):
        del perturbed
        return x, None

    @f.def_bwd
    def f_bwd(residual, g, perturbed, x):
        del residual, perturbed, x
        traces.append(1)
        return g + 2

    x, jitted = jnp.array(1.0), jax.jit(f)
    assert eqx.filter_grad(jitted)(x) == 3
    assert eqx.filter_grad(jitted)(x) == 3
    assert len(traces) == 1
