"""What ``jax.custom_vjp`` accepts from a rule, ``jaxext.custom_vjp`` accepts (issue #45).

Each case was found by a real library run with ``jax.custom_vjp = jaxext.custom_vjp``
(diffrax, Equinox, JAX's own Pallas kernel ops), reduced here to a few lines. Each test
runs the same rules through both implementations and holds jaxext to JAX's result and to
a hand-computed value; where JAX raises a specific exception, jaxext raises that class.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxext

IMPLEMENTATIONS = pytest.mark.parametrize(
    "custom_vjp", [jax.custom_vjp, jaxext.custom_vjp], ids=["jax", "jaxext"]
)


# -- an unbatched input passed through as an output, indexed by a jitted caller ------------
# (diffrax's test_adjoint.py::test_against with the swap: "Gather op must have one slice
# size for every input dimension")


def _passthrough(custom_vjp):
    @custom_vjp
    def op(x, y):
        return x * 2, y

    op.defvjp(lambda x, y: ((x * 2, y), None), lambda _, g: (g[0] * 2, g[1]))

    @jax.jit
    def caller(x, y):
        a, b = op(x, y)
        return a.sum() + b[1] * b[0]

    return caller


@IMPLEMENTATIONS
def test_grad_of_vmap_of_jit_with_an_unbatched_output_passed_through(custom_vjp):
    caller = _passthrough(custom_vjp)
    x, y = jnp.ones((3, 2), jnp.float32), jnp.array([1.0, 2.0], jnp.float32)
    g_x = jax.grad(lambda x: jax.vmap(caller, in_axes=(0, None))(x, y).sum())(x)
    g_y = jax.grad(lambda y: jax.vmap(caller, in_axes=(0, None))(x, y).sum())(y)
    # sum over 3 rows of (sum 2 x_i + y1 y0): d/dx = 2; d/dy = 3 (y1, y0)
    np.testing.assert_array_equal(g_x, np.full((3, 2), 2.0, np.float32))
    np.testing.assert_array_equal(g_y, np.array([6.0, 3.0], np.float32))


def test_forward_mode_of_vmap_of_jit_with_an_unbatched_output_passed_through():
    caller = _passthrough(jaxext.custom_vjp)
    x, y = jnp.ones((3, 2), jnp.float32), jnp.array([1.0, 2.0], jnp.float32)
    t = jnp.arange(6.0, dtype=jnp.float32).reshape(3, 2)
    _, out_t = jax.jvp(lambda x: jax.vmap(caller, in_axes=(0, None))(x, y), (x,), (t,))
    np.testing.assert_array_equal(out_t, 2 * np.arange(6.0).reshape(3, 2).sum(1))


# -- a gradient for an argument that is None (megablox.gmm's `existing_out`) ---------------


@IMPLEMENTATIONS
def test_a_gradient_for_an_argument_without_arrays_is_dropped(custom_vjp):
    @custom_vjp
    def op(x, existing):
        del existing
        return x * 3

    op.defvjp(
        lambda x, existing: (x * 3, None),
        lambda _, g: (g * 3, jnp.zeros(4)),  # a leaf broadcast over zero leaves
    )
    x = jnp.arange(3.0, dtype=jnp.float32)
    np.testing.assert_array_equal(jax.grad(lambda x: op(x, None).sum())(x), np.full(3, 3.0))
    np.testing.assert_array_equal(
        jax.jit(jax.grad(lambda x: op(x, ((), None)).sum()))(x), np.full(3, 3.0)
    )


@IMPLEMENTATIONS
def test_a_structured_gradient_for_an_argument_without_arrays_is_refused_as_by_jax(custom_vjp):
    @custom_vjp
    def op(x, existing):
        del existing
        return x * 3

    op.defvjp(lambda x, existing: (x * 3, None), lambda _, g: (g * 3, {"a": jnp.zeros(4)}))
    with pytest.raises(TypeError):
        jax.grad(lambda x: op(x, None).sum())(jnp.ones(3))


# -- a float32 gradient for a bfloat16 input (Pallas attention's bias gradient) ------------


def _mixed_precision(custom_vjp):
    @custom_vjp
    def scaled(x, b):
        return x * b

    scaled.defvjp(
        lambda x, b: (x * b, (x, b)),
        lambda res, g: (g * res[1], (g * res[0]).astype(jnp.float32)),
    )
    return scaled


@IMPLEMENTATIONS
def test_a_float32_gradient_for_a_bfloat16_input_is_returned_as_jax_returns_it(custom_vjp):
    scaled = _mixed_precision(custom_vjp)
    x = jnp.array([1.0, 2.0, 3.0], jnp.bfloat16)
    b = jnp.array([0.5, 0.25, 2.0], jnp.bfloat16)

    def loss(b):
        return scaled(x, b).astype(jnp.float32).sum()

    ones = jnp.ones(3, jnp.bfloat16)
    for g in (jax.grad(loss)(b), jax.jit(jax.grad(loss))(b), jax.vjp(scaled, x, b)[1](ones)[1]):
        # JAX keeps the gradient as bwd made it: float32, not cast to bfloat16
        assert g.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(g), [1.0, 2.0, 3.0])  # d/db x b = x
    g = jax.vmap(jax.grad(loss))(jnp.stack([b, 2 * b]))
    assert g.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(g), np.tile([1.0, 2.0, 3.0], (2, 1)))


def test_forward_mode_with_a_float32_gradient_for_a_bfloat16_input():
    scaled = _mixed_precision(jaxext.custom_vjp)
    x = jnp.array([1.0, 2.0, 3.0], jnp.bfloat16)
    b = jnp.array([0.5, 0.25, 2.0], jnp.bfloat16)
    t = jnp.array([1.0, -1.0, 0.5], jnp.bfloat16)
    out, out_t = jax.jvp(lambda b: scaled(x, b), (b,), (t,))
    assert out.dtype == out_t.dtype == jnp.bfloat16  # the output's tangent type
    np.testing.assert_array_equal(np.asarray(out_t, np.float32), [1.0, -2.0, 1.5])  # x * t
    jac = jax.jacfwd(lambda b: scaled(x, b).astype(jnp.float32))(b)
    np.testing.assert_array_equal(np.asarray(jac, np.float32), np.diag([1.0, 2.0, 3.0]))


def test_a_gradient_of_another_shape_is_still_refused():
    @jaxext.custom_vjp
    def op(x):
        return x * 2

    op.defvjp(lambda x: (x * 2, None), lambda _, g: (jnp.zeros(4, jnp.float32),))
    with pytest.raises(jaxext.RuleValueError, match="shape"):
        jax.grad(lambda x: op(x).sum())(jnp.ones(3, jnp.float32))


# -- symbolic zeros: bwd traced only as jax.custom_vjp traces it ------------------------------
# (Equinox's test_while_loop.py::test_trivial_vjp: its checkpointed loop's backward does other
# work, and prints, when a cotangent is dense)


@IMPLEMENTATIONS
def test_symbolic_zeros_bwd_never_sees_a_dense_cotangent_for_an_unused_output(custom_vjp):
    seen = []

    @custom_vjp
    def pair(x):
        return x * 2, x * 3

    def fwd(x):
        return pair(x.value), None

    def bwd(_, g):
        seen.append(tuple(type(c).__name__ for c in g))
        dense = [c for c in g if not isinstance(c, jax.custom_derivatives.SymbolicZero)]
        return (2 * dense[0] if len(dense) == 1 else 2 * g[0] + 3 * g[1],)

    pair.defvjp(fwd, bwd, symbolic_zeros=True)
    x = jnp.arange(3.0, dtype=jnp.float32)
    g = jax.jit(jax.grad(lambda x: pair(x)[0].sum()))(x)
    np.testing.assert_array_equal(g, np.full(3, 2.0))
    assert seen and all(kinds[1] == "SymbolicZero" for kinds in seen), seen


# -- a rule closing over a differentiated value: JAX's CustomVJPException -------------------
# (diffrax's test_closure_errors)


@IMPLEMENTATIONS
def test_a_rule_closing_over_a_differentiated_value_raises_jax_exception(custom_vjp):
    from jax._src.interpreters.ad import CustomVJPException

    def f(x):
        @custom_vjp
        def g(y):
            return y * x

        g.defvjp(lambda y: (g(y), None), lambda _, c: (c * 2,))
        return g(jnp.float32(1.0))

    with pytest.raises(CustomVJPException):
        jax.grad(jax.jit(f))(jnp.float32(2.0))


def test_the_closure_error_is_also_a_rule_type_error_with_jaxext_message():
    def f(x):
        @jaxext.custom_vjp
        def g(y):
            return y * x

        g.defvjp(lambda y: (g(y), None), lambda _, c: (c * 2,))
        return g(jnp.float32(1.0))

    with pytest.raises(jaxext.ClosedOverValueError, match="`g`: its rules close over") as err:
        jax.grad(jax.jit(f))(jnp.float32(2.0))
    assert isinstance(err.value, jaxext.RuleTypeError)
    assert "closed-over value" in str(err.value)  # JAX's sentence is kept


# -- JAX's own Pallas kernel op: megablox.gmm, in interpret mode on CPU ----------------------


@pytest.mark.exhaustive  # interpret-mode Pallas: tens of seconds on a shared CPU
def test_megablox_gmm_values_and_gradients_equal_jax_and_forward_mode_is_named():
    """``gmm`` returns a gradient for ``existing_out`` even when it is None; with jaxext its
    rules give JAX's values and gradients, and forward mode (its backward is a Pallas
    kernel JAX cannot transpose, with more outputs than row by row allows) raises the
    error that names the op and the remedies, never a number."""
    ops = pytest.importorskip("jax.experimental.pallas.ops.tpu.megablox.ops")
    swapped = jaxext.custom_vjp(ops.gmm.fun, nondiff_argnums=ops.gmm.nondiff_argnums)
    swapped.defvjp(ops.gmm.fwd, ops.gmm.bwd)
    keys = jax.random.split(jax.random.key(0), 2)
    lhs = jax.random.normal(keys[0], (128, 128), jnp.float32)
    rhs = jax.random.normal(keys[1], (2, 128, 128), jnp.float32)
    sizes = jnp.array([48, 80], jnp.int32)

    def loss(gmm):
        return lambda lhs, rhs: (gmm(lhs, rhs, sizes, jnp.float32, interpret=True) ** 2).sum()

    value, grads = jax.value_and_grad(loss(swapped), (0, 1))(lhs, rhs)
    ref_value, ref_grads = jax.value_and_grad(loss(ops.gmm), (0, 1))(lhs, rhs)
    # the same float32 kernels on the same operands: equal to rounding
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for g, ref in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-3)
    # against a float64 reference: rows 0..47 use rhs[0], the rest rhs[1]
    l64, r64 = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.concatenate([l64[:48] @ r64[0], l64[48:] @ r64[1]])
    np.testing.assert_allclose(value, (out**2).sum(), rtol=1e-4)
    with pytest.raises(TypeError, match=r"`gmm`: forward-mode.*jvp=jvp"):
        jax.jvp(loss(swapped), (lhs, rhs), (lhs, rhs))
