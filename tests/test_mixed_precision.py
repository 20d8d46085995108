"""Mixed precision: bfloat16 compute with float32 parameters or accumulation.

References are independent of jaxext: ``flax.nnx.Linear`` / ``flax.linen.Dense``
built from the same seed, and plain ``lax.dot_general`` with
``preferred_element_type`` differentiated by JAX's own autodiff.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, rand
from jax import lax

import jaxext

nnx = pytest.importorskip("flax.nnx")
linen = pytest.importorskip("flax.linen")
import jaxext.linen  # noqa: E402
import jaxext.nnx  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32


def _loss(y):
    # A nonlinear float32 loss so that every output element gets its own cotangent.
    return jnp.sum(jnp.sin(y.astype(F32)))


def _nnx_pair(**kwargs):
    kwargs.setdefault("bias_init", nnx.initializers.normal(1.0))
    ours = jaxext.nnx.Linear(16, 8, rngs=nnx.Rngs(0), **kwargs)
    theirs = nnx.Linear(16, 8, rngs=nnx.Rngs(0), **kwargs)
    return ours, theirs


def _nnx_outputs_and_grads(layer, x):
    y = layer(x)
    param_grads, x_grad = nnx.grad(lambda m, x: _loss(m(x)), argnums=(0, 1))(layer, x)
    return y, nnx.to_pure_dict(param_grads), x_grad


def _assert_equal(actual, expected, name):
    assert actual.dtype == expected.dtype, f"{name}: {actual.dtype} != {expected.dtype}"
    np.testing.assert_array_equal(
        np.asarray(actual, np.float32), np.asarray(expected, np.float32), err_msg=name
    )


@pytest.mark.parametrize("x_dtype", [F32, BF16])
@pytest.mark.parametrize("param_dtype", [F32, BF16])
@pytest.mark.parametrize("shape", [(4, 16), (5, 3, 16)])
def test_nnx_linear_bf16_compute_matches_flax(x_dtype, param_dtype, shape):
    x = jnp.asarray(rand(1, shape), x_dtype)
    ours, theirs = _nnx_pair(dtype=BF16, param_dtype=param_dtype)
    y, grads, x_grad = _nnx_outputs_and_grads(ours, x)
    y_ref, grads_ref, x_grad_ref = _nnx_outputs_and_grads(theirs, x)
    assert y.dtype == BF16
    _assert_equal(y, y_ref, "output")
    _assert_equal(x_grad, x_grad_ref, "input gradient")
    _assert_equal(grads["kernel"], grads_ref["kernel"], "kernel gradient")
    # The bias gradient sums the bfloat16 output cotangent over the batch; the
    # backward reduces in the cotangent's dtype exactly as plain autodiff does.
    _assert_equal(grads["bias"], grads_ref["bias"], "bias gradient")


@pytest.mark.parametrize("x_dtype", [F32, BF16])
def test_nnx_linear_bf16_params_f32_accumulation_matches_flax_exactly(x_dtype):
    x = jnp.asarray(rand(2, (5, 3, 16)), x_dtype)
    ours, theirs = _nnx_pair(dtype=BF16, param_dtype=F32, preferred_element_type=F32)
    y, grads, x_grad = _nnx_outputs_and_grads(ours, x)
    y_ref, grads_ref, x_grad_ref = _nnx_outputs_and_grads(theirs, x)
    assert y.dtype == F32
    _assert_equal(y, y_ref, "output")
    _assert_equal(x_grad, x_grad_ref, "input gradient")
    for name in ("kernel", "bias"):
        assert grads[name].dtype == F32
        _assert_equal(grads[name], grads_ref[name], f"{name} gradient")


@pytest.mark.parametrize("param_dtype", [F32, BF16])
def test_nnx_linear_f32_compute_on_bf16_inputs_matches_flax(param_dtype):
    # float32 compute: the matmuls are equal up to float32 summation order.
    x = jnp.asarray(rand(3, (5, 3, 16)), BF16)
    ours, theirs = _nnx_pair(dtype=F32, param_dtype=param_dtype)
    y, grads, x_grad = _nnx_outputs_and_grads(ours, x)
    y_ref, grads_ref, x_grad_ref = _nnx_outputs_and_grads(theirs, x)
    assert y.dtype == F32 and x_grad.dtype == BF16
    assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    assert_close(x_grad, x_grad_ref, rtol=1e-2, atol=1e-2)
    tol = 1e-2 if param_dtype == BF16 else 1e-5
    for name in ("kernel", "bias"):
        assert grads[name].dtype == grads_ref[name].dtype == param_dtype
        assert_close(grads[name], grads_ref[name], rtol=tol, atol=tol)


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("preferred", [BF16])
def test_nnx_linear_narrow_preferred_element_type_like_flax(use_bias, preferred):
    # (float16 is in tests/test_flax_parity.py's grid; not here: this test's sin/cos
    # loss on a float16 result does not compile with XLA_FLAGS=--xla_cpu_max_isa=SSE4_2,
    # for plain JAX code too: LLVM lacks __extendhfsf2 there.)
    # float32 compute, narrow matmul result: Flax adds the float32 bias with jnp
    # promotion (a float32 result) and, without a bias, rounds the kernel gradient
    # through the preferred type. Under jit both sides compile the same program
    # (tests/test_flax_parity.py checks that over the whole grid): equal bits.
    x = jnp.asarray(rand(8, (5, 3, 16)), F32)
    ours, theirs = _nnx_pair(use_bias=use_bias, preferred_element_type=preferred)
    run = nnx.jit(_nnx_outputs_and_grads)
    y, grads, x_grad = run(ours, x)
    y_ref, grads_ref, x_grad_ref = run(theirs, x)
    assert y.dtype == (F32 if use_bias else preferred)
    _assert_equal(y, y_ref, "output")
    _assert_equal(x_grad, x_grad_ref, "input gradient")
    for name in grads_ref:
        _assert_equal(grads[name], grads_ref[name], f"{name} gradient")


def test_linen_dense_bf16_compute_matches_flax():
    x = jnp.asarray(rand(4, (6, 16)), F32)
    kwargs = dict(features=8, dtype=BF16, param_dtype=F32)
    ours, theirs = jaxext.linen.Dense(**kwargs), linen.Dense(**kwargs)
    params = theirs.init(jax.random.key(0), x)
    params_ours = ours.init(jax.random.key(0), x)
    jax.tree.map(lambda a, b: _assert_equal(a, b, "params"), params_ours, params)

    def run(module):
        y = module.apply(params, x)
        return y, jax.grad(lambda p, x: _loss(module.apply(p, x)), argnums=(0, 1))(params, x)

    y, (grads, x_grad) = run(ours)
    y_ref, (grads_ref, x_grad_ref) = run(theirs)
    _assert_equal(y, y_ref, "output")
    _assert_equal(x_grad, x_grad_ref, "input gradient")
    _assert_equal(grads["params"]["kernel"], grads_ref["params"]["kernel"], "kernel gradient")
    scale = float(jnp.max(jnp.abs(grads_ref["params"]["bias"])))
    assert_close(grads["params"]["bias"], grads_ref["params"]["bias"], rtol=2e-2, atol=2e-2 * scale)


def _reference_preferred(x, weight, bias):
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    y = lax.dot_general(x, weight, dims, preferred_element_type=F32)
    return y if bias is None else y + bias.astype(F32)


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("shape", [(4, 16), (2, 3, 16)])
def test_linear_preferred_element_type_f32_on_bf16(shape, use_bias):
    x = jnp.asarray(rand(5, shape), BF16)
    weight = jnp.asarray(rand(6, (8, 16)), BF16)
    bias = jnp.asarray(rand(7, (8,)), BF16) if use_bias else None

    y = jaxext.linear(x, weight, bias, preferred_element_type=F32)
    y_ref = _reference_preferred(x, weight, bias)
    assert y.dtype == F32
    _assert_equal(y, y_ref, "output")
    # The f32 result keeps what bfloat16 would round away.
    assert not np.array_equal(np.asarray(y), np.asarray(y.astype(BF16).astype(F32)))

    def grads(fn):
        argnums = (0, 1, 2) if use_bias else (0, 1)
        return jax.grad(lambda *a: _loss(fn(*a)), argnums=argnums)(x, weight, bias)

    ours = grads(lambda x, w, b: jaxext.linear(x, w, b, preferred_element_type=F32))
    theirs = grads(_reference_preferred)
    for name, g, g_ref in zip(("x", "weight", "bias"), ours, theirs, strict=False):
        assert g.dtype == BF16, name  # gradients come back in each input's dtype
        _assert_equal(g, g_ref, f"{name} gradient")
