"""Helpers shared by the test modules: independent references and comparisons."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def reference_linear(x, weight, bias=None):
    """Plain-jnp ``x @ weight.T + bias``: differentiated by JAX's own autodiff."""
    y = jnp.matmul(x, weight.T)
    return y if bias is None else y + bias


def rand(key_or_seed, shape, dtype=np.float32):
    """Deterministic standard-normal NumPy data of ``shape`` and ``dtype``."""
    rng = np.random.default_rng(key_or_seed)
    return rng.standard_normal(shape).astype(dtype)


def assert_close(actual, expected, *, rtol=1e-6, atol=1e-6, err_msg=""):
    """``np.testing.assert_allclose`` after moving both sides to float64 NumPy."""
    np.testing.assert_allclose(
        np.asarray(actual, dtype=np.float64),
        np.asarray(expected, dtype=np.float64),
        rtol=rtol,
        atol=atol,
        err_msg=err_msg,
    )
