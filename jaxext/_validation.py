"""Trace-time argument checks and small static helpers shared by the ops."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["as_numeric_array", "check_array", "is_static_scalar"]


def check_array(value: Any, name: str) -> jax.Array:
    """Converts an op's argument to a JAX array, refusing non-numeric input by name.

    The argument check jaxext's own ops run first; use it in yours. Tracers
    pass through untouched, so it is safe under ``jit`` and ``grad``. Python
    lists and tuples are refused, as ``jnp`` functions refuse them: an implicit
    conversion would hide an element-by-element copy (and, under ``jit``, one
    traced scalar per element).

    Args:
        value: the argument as the caller gave it.
        name: the argument's name, quoted in the error.

    Returns:
        ``value`` as a JAX array (or the tracer itself).

    Raises:
        TypeError: if ``value`` is not an array or scalar of a numeric
            (integer, floating or complex, not bool) dtype.

    Example:
        >>> import jaxext
        >>> jaxext.check_array(3.0, "x")
        Array(3., dtype=float32, weak_type=True)
        >>> jaxext.check_array("3", "x")
        Traceback (most recent call last):
        ...
        TypeError: `x` must be a numeric array; got str.
    """
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"`{name}` must be a numeric array; got {type(value).__name__}.")
    if isinstance(value, (list, tuple)):
        raise TypeError(
            f"`{name}` must be a numeric array; got a Python {type(value).__name__} "
            f"(wrap it with jnp.asarray)."
        )
    try:
        array = jnp.asarray(value)
    except TypeError as err:
        raise TypeError(
            f"`{name}` must be a numeric array; got {type(value).__name__} ({err})."
        ) from None
    if not (jnp.issubdtype(array.dtype, jnp.number)):
        raise TypeError(f"`{name}` must have a numeric dtype; got dtype {array.dtype}.")
    return array


as_numeric_array = check_array  # the name the Flax layers use


def is_static_scalar(value: Any) -> bool:
    """True for Python and NumPy numeric scalars (not bools), which are hashable constants."""
    if isinstance(value, (bool, np.bool_)):
        return False
    return isinstance(value, (int, float, complex, np.number))
