"""``jax.test_util.check_grads`` as a baseline beside ``jaxext.gradcheck``.

JAX's own checker (order 2, reverse mode, float64) runs on every op and layer of
the library: ``jaxext.linear``, ``jaxext.mul_constant``, the porting guide's
``jaxext.Function`` ports, and the Flax layers as functions of their parameters
and inputs. ``jaxext.gradcheck`` and ``jaxext.gradgradcheck`` run on the very same
functions and arguments, so the two checkers are held to the same cases.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import LinearFunction, MulConstant, rand
from jax.test_util import check_grads

import jaxext

F64 = np.float64


# -- cases: each builds (function, args) in float64 --------------------------------------


def _linear(x_shape, out_features, use_bias):
    def build():
        x = rand(0, x_shape, F64)
        w = rand(1, (out_features, x_shape[-1]), F64)
        if use_bias:
            return jaxext.linear, (x, w, rand(2, (out_features,), F64))
        return jaxext.linear, (x, w)

    return build


def _mul_constant_static(constant):
    def build():
        return lambda x: jaxext.mul_constant(x, constant), (rand(0, (2, 3), F64),)

    return build


def _mul_constant_array(c_shape):
    def build():
        return jaxext.mul_constant, (rand(0, (2, 3), F64), rand(1, c_shape, F64))

    return build


def _function_linear(use_bias):
    def build():
        x, w = rand(0, (5, 3), F64), rand(1, (4, 3), F64)
        if use_bias:
            return LinearFunction.apply, (x, w, rand(2, (4,), F64))
        return (lambda x, w: LinearFunction.apply(x, w, None)), (x, w)

    return build


def _function_mul_constant():
    return (lambda x: MulConstant.apply(x, 2.5)), (rand(0, (2, 3), F64),)


def _nnx(make_layer, x_shape):
    """A fresh NNX layer as ``f(params, x)``, ``params`` a plain dict of arrays."""

    def build():
        nnx = pytest.importorskip("flax.nnx")
        graphdef, state = nnx.split(make_layer(nnx))

        def f(params, x):
            layer_state = jax.tree.map(lambda leaf: leaf, state)
            nnx.replace_by_pure_dict(layer_state, params)
            return nnx.merge(graphdef, layer_state)(x)

        return f, (nnx.to_pure_dict(state), rand(5, x_shape, F64))

    return build


def _nnx_linear(use_bias, x_shape):
    def make(nnx):
        return jaxext.nnx.Linear(
            x_shape[-1], 4, use_bias=use_bias, param_dtype=F64, rngs=nnx.Rngs(0)
        )

    return _nnx(make, x_shape)


def _nnx_mul_constant(learnable):
    return _nnx(
        lambda nnx: jaxext.nnx.MulConstant(1.5, learnable=learnable, param_dtype=F64), (2, 3)
    )


def _linen(make_layer, x_shape):
    """A Linen layer as ``f(params, x)`` (or ``f(x)`` when it has no parameters)."""

    def build():
        pytest.importorskip("flax.linen")
        layer = make_layer()
        x = rand(5, x_shape, F64)
        params = layer.init(jax.random.key(0), x).get("params", {})
        if not params:
            return (lambda x: layer.apply({}, x)), (x,)
        return (lambda params, x: layer.apply({"params": params}, x)), (params, x)

    return build


def _linen_dense(use_bias, x_shape):
    return _linen(lambda: jaxext.linen.Dense(4, use_bias=use_bias, param_dtype=F64), x_shape)


def _linen_mul_constant(learnable):
    return _linen(
        lambda: jaxext.linen.MulConstant(1.5, learnable=learnable, param_dtype=F64), (2, 3)
    )


BATCH_SHAPES = {"1d": (3,), "2d": (5, 3), "3d": (2, 4, 3)}

CASES = [
    *(
        pytest.param(_linear(shape, 4, bias), id=f"linear-{name}-{'bias' if bias else 'nobias'}")
        for name, shape in BATCH_SHAPES.items()
        for bias in (True, False)
    ),
    pytest.param(_linear((6, 3), 1, True), id="linear-out1-bias"),
    pytest.param(_mul_constant_static(2.5), id="mul_constant-static-float"),
    pytest.param(_mul_constant_static(np.float64(-3.0)), id="mul_constant-static-numpy"),
    pytest.param(_mul_constant_static(2), id="mul_constant-static-int"),
    pytest.param(_mul_constant_array(()), id="mul_constant-array-scalar"),
    pytest.param(_mul_constant_array((3,)), id="mul_constant-array-broadcast"),
    pytest.param(_mul_constant_array((2, 3)), id="mul_constant-array-full"),
    pytest.param(_function_linear(True), id="Function-Linear-bias"),
    pytest.param(_function_linear(False), id="Function-Linear-nobias"),
    pytest.param(_function_mul_constant, id="Function-MulConstant"),
    *(
        pytest.param(
            _nnx_linear(bias, shape), id=f"nnx.Linear-{name}-{'bias' if bias else 'nobias'}"
        )
        for name, shape in BATCH_SHAPES.items()
        for bias in (True, False)
    ),
    pytest.param(_nnx_mul_constant(False), id="nnx.MulConstant-static"),
    pytest.param(_nnx_mul_constant(True), id="nnx.MulConstant-learnable"),
    *(
        pytest.param(
            _linen_dense(bias, shape), id=f"linen.Dense-{name}-{'bias' if bias else 'nobias'}"
        )
        for name, shape in BATCH_SHAPES.items()
        for bias in (True, False)
    ),
    pytest.param(_linen_mul_constant(False), id="linen.MulConstant-static"),
    pytest.param(_linen_mul_constant(True), id="linen.MulConstant-learnable"),
]


@pytest.mark.parametrize("build", CASES)
def test_check_grads_order_2_reverse_mode(build, x64):
    f, args = build()
    assert all(leaf.dtype == F64 for leaf in jax.tree.leaves(args))
    check_grads(f, args, order=2, modes=["rev"])


@pytest.mark.parametrize("build", CASES)
def test_gradcheck_and_gradgradcheck_agree_with_the_baseline(build, x64):
    f, args = build()
    assert jaxext.gradcheck(f, args)
    assert jaxext.gradgradcheck(f, args)


# -- the baseline can fail ------------------------------------------------------------------


def _wrong_backward(scale_grad_w):
    class Linear(jaxext.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w.T

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g @ w, scale_grad_w * (g.T @ x)

    return Linear.apply


def test_check_grads_rejects_a_wrong_backward(x64):
    # A weight gradient 1% off: both checkers must refuse it, check_grads included
    # (otherwise the baseline above would prove nothing).
    args = (rand(0, (5, 3), F64), rand(1, (4, 3), F64))
    check_grads(_wrong_backward(1.0), args, order=2, modes=["rev"])
    with pytest.raises(AssertionError):
        check_grads(_wrong_backward(1.01), args, order=1, modes=["rev"])
    with pytest.raises(jaxext.GradcheckError):
        jaxext.gradcheck(_wrong_backward(1.01), args)
