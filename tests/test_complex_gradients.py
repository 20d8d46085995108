"""Complex factors and weights on real inputs: plain autodiff's gradients, no warning.

JAX's convention for a real input of a complex function is the real part of the
complex cotangent (the transpose of the real-to-complex cast). jaxext's backwards
must return exactly that, without the complex-to-real cast JAX warns about (a
``DeprecationWarning`` today, an error in a later JAX). The references are plain
``jnp`` autodiff of the same math, in float64.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import rounding_tolerance
from ops_table import OPS

import jaxext
import jaxext.linen
import jaxext.nnx

RNG = np.random.default_rng(0)
X = RNG.standard_normal((4, 3))

# (name, jaxext function, plain jnp function, primal arguments): tests/ops_table.py
CASES = [case for op in OPS for case in op.complex_cases]


def _vjp(fn, args, seed):
    y, vjp = jax.vjp(fn, *args)
    rng = np.random.default_rng(seed)
    ct = rng.standard_normal(y.shape) + 1j * rng.standard_normal(y.shape)
    return y, vjp(jnp.asarray(ct, y.dtype))


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_real_inputs_of_complex_ops_get_autodiff_gradients_without_warning(x64, case, jitted):
    _, ours, plain, args = case
    wrap = jax.jit if jitted else (lambda f: f)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # JAX's complex-to-real cast warning included
        y, grads = _vjp(wrap(ours), [jnp.asarray(a) for a in args], seed=1)
        # float32/complex64 too: the warning does not depend on the precision.
        _vjp(wrap(ours), [jnp.asarray(a, np.result_type(a, np.float32)) for a in args], 1)
    y_ref, grads_ref = _vjp(plain, [jnp.asarray(a) for a in args], seed=1)
    np.testing.assert_allclose(y, y_ref, rtol=1e-13, atol=1e-13)
    for g, g_ref, a in zip(grads, grads_ref, args, strict=True):
        assert g.dtype == g_ref.dtype == jnp.asarray(a).dtype
        np.testing.assert_allclose(g, g_ref, rtol=1e-13, atol=1e-13)


def _scale_grad_reference():
    """d/ds of sum |x s - 1|^2 at s = 1j, in float64 (jax.grad's complex convention)."""
    return jax.grad(lambda s: jnp.sum(jnp.abs(jnp.asarray(X) * s - 1.0) ** 2))(jnp.complex128(1j))


# The gradient is a float32 sum of X.size = 12 terms, held to the worst case (n * eps,
# not sqrt(n) * eps: the terms' errors do not cancel here): the rule at n = 12**2.
RTOL = rounding_tolerance(jnp.float32, n=12**2)


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16, jnp.complex64])
def test_nnx_learnable_complex_constant(x64, param_dtype):
    x = jnp.asarray(X, jnp.float32)
    layer = jaxext.nnx.MulConstant(1j, learnable=True, param_dtype=param_dtype)
    assert layer.scale[...].dtype == jnp.complex64
    assert layer.scale[...] == 1j
    grad = nnx.grad(lambda m: jnp.sum(jnp.abs(m(x) - 1.0) ** 2))(layer)
    np.testing.assert_allclose(grad["scale"][...], _scale_grad_reference(), rtol=RTOL)


def test_linen_learnable_complex_constant(x64):
    x = jnp.asarray(X, jnp.float32)
    layer = jaxext.linen.MulConstant(1j, learnable=True)
    variables = layer.init(jax.random.key(0), x)
    assert variables["params"]["scale"] == 1j
    assert variables["params"]["scale"].dtype == jnp.complex64
    grad = jax.grad(lambda v: jnp.sum(jnp.abs(layer.apply(v, x) - 1.0) ** 2))(variables)
    np.testing.assert_allclose(grad["params"]["scale"], _scale_grad_reference(), rtol=RTOL)
