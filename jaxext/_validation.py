"""Trace-time argument checks and small static helpers shared by the ops."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Static", "as_numeric_array", "is_static_scalar", "unbroadcast"]


def as_numeric_array(value: Any, name: str) -> jax.Array:
    """Converts ``value`` to a JAX array, refusing non-numeric input by name.

    Tracers pass through untouched, so this is safe under ``jit``/``grad``.
    Python lists and tuples are refused, as ``jnp`` functions refuse them: an
    implicit conversion would hide an element-by-element copy (and, under
    ``jit``, one traced scalar per element). Wrap them in ``jnp.asarray``.
    Dicts and other pytree containers are refused too: the ops take one array
    per argument.

    Raises:
        TypeError: if ``value`` is not an array or scalar of a numeric
            (integer, floating or complex, not bool) dtype.
    """
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"`{name}` must be a numeric array; got {type(value).__name__}.")
    if isinstance(value, (list, tuple)):
        raise TypeError(
            f"`{name}` must be a numeric array; got a Python {type(value).__name__} "
            f"(wrap it with jnp.asarray)."
        )
    if isinstance(value, Mapping):
        raise TypeError(
            f"`{name}` must be a numeric array; got a {type(value).__name__} "
            "(pass one array, not a dict or other container of arrays)."
        )
    try:
        array = jnp.asarray(value)
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"`{name}` must be a numeric array; got {type(value).__name__} ({err})."
        ) from None
    if not (jnp.issubdtype(array.dtype, jnp.number)):
        raise TypeError(f"`{name}` must have a numeric dtype; got dtype {array.dtype}.")
    return array


def is_static_scalar(value: Any) -> bool:
    """True for Python and NumPy numeric scalars (not bools), which are hashable constants."""
    if isinstance(value, (bool, np.bool_)):
        return False
    return isinstance(value, (int, float, complex, np.number))


def unbroadcast(g: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Sums ``g`` down to ``shape``, undoing NumPy broadcasting."""
    extra = g.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(
        extra + i for i, n in enumerate(shape) if n == 1 and g.shape[extra + i] != 1
    )
    g = jnp.sum(g, axis=axes, keepdims=True) if axes else g
    return g.reshape(shape)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Static:
    """A residual that is trace-time data (dtypes, shapes, flags), never an array.

    Registered as a static pytree: it passes through ``custom_vjp`` residuals
    as part of the tree structure, so it costs nothing at run time.
    """

    value: Any
