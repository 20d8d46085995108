"""`mul_constant`: ``x * constant`` with a hand-written VJP, on ``jaxext.custom_vjp``.

This module is a template for your own op: its checks, the primal, ``fwd`` and
``bwd``, written with the public ``jaxext.custom_vjp`` and ``jax.numpy`` only.

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
from jax.typing import ArrayLike

from jaxext import check_array, custom_vjp

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
        >>> jax.jvp(lambda x: jaxext.mul_constant(x, 3.0), (jnp.ones(2),), (jnp.ones(2),))[1]
        Array([3., 3.], dtype=float32)
    """
    x = check_array(x, "x")
    if isinstance(constant, (int, float, complex, np.number)) and not isinstance(
        constant, (bool, np.bool_)
    ):
        if isinstance(x, jax.core.Tracer):
            return _mul_static(x, constant)
        # Eager: nothing to differentiate. The constant goes in as an argument, as
        # jax.numpy's functions take it, so a new value reuses the compiled program.
        return _mul_eager(x, constant)
    if isinstance(constant, (bool, np.bool_)) or not hasattr(constant, "dtype"):
        hint = " (wrap it with jnp.asarray)" if isinstance(constant, (list, tuple)) else ""
        raise TypeError(
            "`constant` must be a Python/NumPy number or a numeric array; "
            f"got {type(constant).__name__}{hint}."
        )
    constant = check_array(constant, "constant")
    try:
        jnp.broadcast_shapes(x.shape, constant.shape)
    except ValueError:
        raise ValueError(
            f"`constant` of shape {constant.shape} does not broadcast against `x` of "
            f"shape {x.shape}."
        ) from None
    traced = isinstance(x, jax.core.Tracer) or isinstance(constant, jax.core.Tracer)
    # An eager call (nothing traced, so nothing to differentiate) runs as one compiled
    # program, as jax.numpy's functions do, rather than dispatching op by op.
    return (_mul_array if traced else _mul_array_compiled)(x, constant)


def _as_grad(g: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """``g`` summed down to ``shape`` (undoing broadcasting) in ``dtype``.

    For a real input of a complex result the gradient is the real part, as in
    JAX's own autodiff.
    """
    extra = g.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(
        extra + i for i, n in enumerate(shape) if n == 1 and g.shape[extra + i] != 1
    )
    g = jnp.sum(g, axis=axes, keepdims=True).reshape(shape) if axes else g
    if jnp.iscomplexobj(g) and not jnp.issubdtype(dtype, jnp.complexfloating):
        g = jnp.real(g)
    return g.astype(dtype)


# -- static constant: a nondiff argument, hashable and part of the trace ------------


@functools.partial(custom_vjp, nondiff_argnums=(1,))
def _mul_static(x, constant):
    return x * constant


def _mul_static_fwd(x, constant):
    # The backward needs no array, only x's shape and dtype (Python values).
    return _mul_static(x, constant), (x.shape, x.dtype)


def _mul_static_bwd(constant, res, g):
    shape, dtype = res
    return (_as_grad(g * constant, shape, dtype),)


_mul_static.defvjp(_mul_static_fwd, _mul_static_bwd)


@jax.jit
def _mul_eager(x, constant):
    return x * constant


# -- array constant: both operands are differentiable -------------------------------


@custom_vjp
def _mul_array(x, constant):
    return x * constant


def _mul_array_fwd(x, constant):
    # With symbolic_zeros=True each argument arrives with `.value` and `.perturbed`
    # (PyTorch's needs_input_grad): grad_x needs the constant and grad_constant
    # needs x, so only those are kept.
    xv, cv = x.value, constant.value
    res = (
        cv if x.perturbed else None,
        xv if constant.perturbed else None,
        (xv.shape, xv.dtype),
        (cv.shape, cv.dtype),
    )
    return xv * cv, res


def _mul_array_bwd(res, g):
    c, x, x_type, c_type = res
    grad_x = None if c is None else _as_grad(g * c, *x_type)
    grad_c = None if x is None else _as_grad(g * x, *c_type)
    return grad_x, grad_c


_mul_array.defvjp(_mul_array_fwd, _mul_array_bwd, symbolic_zeros=True)
_mul_array_compiled = jax.jit(_mul_array)
