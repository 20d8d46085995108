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
from helpers import assert_close

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


@pytest.mark.parametrize("jit", [False, True])
def test_fp8_amax_history_is_the_gradient_of_an_extended_dtype_input(jit):
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

        fn = jax.grad(outer, (0, 1, 2))
        return jax.jit(fn) if jit else fn

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
