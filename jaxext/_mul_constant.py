"""`mul_constant`: ``x * constant`` with a hand-written VJP.

Two cases, chosen at trace time from the *type* of ``constant`` (never its value):

* A Python or NumPy scalar is a static, non-differentiable constant, the JAX
  reading of PyTorch's "gradients of non-Tensor arguments are None".
* A JAX array (possibly a tracer under ``jit``/``grad``) is a differentiable
  input and receives its true gradient ``sum(g * x)``, reduced to its shape.
  Returning ``None`` for it would make JAX report a zero gradient, silently.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.typing import ArrayLike

from ._gradspec import cast_grad, finish_grad, grad_spec
from ._residuals import pack, unpack
from ._validation import Static, as_numeric_array, is_static_scalar

__all__ = ["mul_constant"]


def mul_constant(x: ArrayLike, constant: Any) -> jax.Array:
    """Multiplies ``x`` by ``constant`` with a custom VJP.

    Args:
        x: numeric array of any shape.
        constant: a Python/NumPy scalar (static; receives no gradient), or an
            array broadcastable against ``x`` (differentiable; receives
            ``sum(g * x)`` reduced to its shape). A NumPy array, 0-d included,
            is handled like a JAX array: it is not traced, so nothing asks for
            its gradient, but it is not a static (hashed) argument either.
            Python lists are refused, as ``jnp`` functions refuse them; wrap
            them with ``jnp.asarray``.

    Returns:
        ``x * constant`` with ``jnp`` type promotion (a Python scalar is weakly
        typed, so ``bfloat16`` input stays ``bfloat16``).

    Raises:
        TypeError: if ``x`` or ``constant`` is not numeric (a string, ``None``,
            a bool or bool array, a Python list ...).
        ValueError: if ``constant``'s shape does not broadcast against ``x``'s.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import jaxext
        >>> jax.grad(lambda x: jaxext.mul_constant(x, 3.0).sum())(jnp.ones(2))
        Array([3., 3.], dtype=float32)
        >>> jax.grad(lambda c: jaxext.mul_constant(jnp.arange(3.0), c).sum())(jnp.array(2.0))
        Array(3., dtype=float32)
    """
    x = as_numeric_array(x, "x")
    if is_static_scalar(constant):
        return _mul_static(x, constant)
    if isinstance(constant, (bool, np.bool_)) or not hasattr(constant, "dtype"):
        hint = " (wrap it with jnp.asarray)" if isinstance(constant, (list, tuple)) else ""
        raise TypeError(
            "`constant` must be a Python/NumPy number or a numeric array; "
            f"got {type(constant).__name__}{hint}."
        )
    constant = as_numeric_array(constant, "constant")
    try:
        jnp.broadcast_shapes(x.shape, constant.shape)
    except ValueError:
        raise ValueError(
            f"`constant` of shape {constant.shape} does not broadcast against `x` of "
            f"shape {x.shape}."
        ) from None
    return _mul_array(x, constant)


# -- static constant: a nondiff argument, hashable and part of the trace ------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _mul_static(x, constant):
    return x * constant


def _mul_static_fwd(x, constant):
    # No array is needed by the backward, only x's dtype (static).
    return _mul_static(x, constant), Static(x.dtype)


def _mul_static_bwd(constant, x_dtype, g):
    # A complex constant on a real x: the real part, as autodiff of x * constant.
    return (cast_grad(g * constant, x_dtype.value),)


_mul_static.defvjp(_mul_static_fwd, _mul_static_bwd)


# -- array constant: both operands are differentiable -------------------------------


@jax.custom_vjp
def _mul_array(x, constant):
    return x * constant


def _mul_array_fwd(x, constant):
    xv, cv = x.value, constant.value
    # grad_x needs the constant and grad_constant needs x: only those are kept
    # (see _linear_fwd and _residuals.py).
    c_for_x = cv if x.perturbed else None
    x_for_c = xv if constant.perturbed else None
    specs = Static((grad_spec(xv), grad_spec(cv)))
    return _mul_array(xv, cv), pack((x.perturbed, constant.perturbed), (c_for_x, x_for_c), specs)


def _mul_array_bwd(residuals, g):
    (x_wanted, c_wanted), (c_for_x, x_for_c), specs = unpack(residuals, "jaxext.mul_constant")
    if isinstance(g, SymbolicZero):
        return None, None
    x_spec, c_spec = specs.value
    grad_x = finish_grad(g * c_for_x, x_spec) if x_wanted else None
    grad_c = finish_grad(g * x_for_c, c_spec) if c_wanted else None
    return grad_x, grad_c


_mul_array.defvjp(_mul_array_fwd, _mul_array_bwd, symbolic_zeros=True)
