"""What jaxext's NNX and Linen layers share, beneath both (imports neither ``flax.nnx``
nor ``flax.linen``).

The argument checks both layer APIs make, the matmul both dense layers run through
jaxext's custom VJP (``_dense.py``), ``MulConstant``'s constant check and learnable
scale, and the :func:`uniform_range` initializer both namespaces export.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.typing import Initializer
from jax import lax
from jax.typing import DTypeLike

from ._dense import dense
from ._validation import is_static_scalar

__all__ = [
    "apply_kernel",
    "check_mul_constant",
    "check_rms_norm_input",
    "check_rms_norm_options",
    "learnable_scale",
    "refuse_dot_general",
    "refuse_mask",
    "refuse_missing_inputs",
    "uniform_range",
]


def uniform_range(low: float = -0.1, high: float = 0.1) -> Initializer:
    """Initializer drawing from the uniform distribution on ``[low, high)``.

    ``flax``'s ``initializers.uniform(scale)`` samples ``[0, scale)``; this is the
    counterpart of ``torch.nn.init.uniform_(tensor, low, high)``. It follows the
    ``(key, shape, dtype)`` initializer protocol, so it works for NNX and Linen.

    Args:
        low: inclusive lower bound.
        high: exclusive upper bound, greater than ``low``.

    Returns:
        An initializer ``init(key, shape, dtype=jnp.float32) -> jax.Array``.

    Raises:
        ValueError: if ``low >= high``.

    Example:
        >>> import jax
        >>> import jaxext.nnx
        >>> init = jaxext.nnx.uniform_range(-0.1, 0.1)
        >>> w = init(jax.random.key(0), (3, 2))
        >>> bool((w >= -0.1).all() and (w < 0.1).all())
        True
    """
    if not low < high:
        raise ValueError(f"`low` must be smaller than `high`; got low={low}, high={high}.")

    def init(key: jax.Array, shape: Any, dtype: DTypeLike = jnp.float32) -> jax.Array:
        return jax.random.uniform(key, shape, dtype, minval=low, maxval=high)

    return init


def refuse_missing_inputs(inputs: Any) -> None:
    """Refuses, by name, ``inputs`` that no ``promote_dtype`` can turn into an array."""
    if inputs is None or isinstance(inputs, (str, bytes)):
        raise TypeError(f"`inputs` must be a numeric array; got {type(inputs).__name__}.")


def refuse_dot_general(dot_general: Any, layer: str) -> None:
    """Refuses a ``dot_general`` other than ``None`` or ``lax.dot_general`` for ``layer``."""
    if dot_general is not None and dot_general is not lax.dot_general:
        raise ValueError(
            f"`dot_general` cannot be customised for jaxext's {layer}: its forward and "
            f"backward are jaxext's custom VJP; got {dot_general!r}. Use flax's "
            "own layer for a custom dot_general."
        )


def apply_kernel(inputs, kernel, bias, *, precision, preferred_element_type, out_sharding=None):
    """``inputs @ kernel + bias`` through jaxext's custom VJP, for the Flax layers.

    The operands are the layer's, after its ``promote_dtype``, used as they are,
    exactly as Flax's layers use them (see ``_dense.py``). A shape that does not
    contract is a ``TypeError``, as ``lax.dot_general`` raises in Flax's layers.
    """
    in_features = kernel.shape[0]
    if np.ndim(inputs) == 0 or np.shape(inputs)[-1] != in_features:
        raise TypeError(
            f"`inputs` must have shape (..., in_features) = (..., {in_features}) to match "
            f"the kernel of shape {kernel.shape}; got shape {np.shape(inputs)}."
        )
    return dense(
        inputs,
        kernel,
        bias,
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
    )


def check_mul_constant(constant: Any) -> None:
    """Refuses a ``MulConstant`` constant that is not a Python/NumPy scalar (or is a bool)."""
    if not is_static_scalar(constant):
        raise TypeError(
            "`constant` must be a Python or NumPy scalar (not a bool); got "
            f"{type(constant).__name__}. For an array factor call "
            "jaxext.mul_constant directly."
        )


def learnable_scale(constant: Any, param_dtype: DTypeLike) -> jax.Array:
    """The initial value of a learnable ``MulConstant``'s ``scale``: ``constant`` in
    ``param_dtype``, made complex when ``constant`` is complex (a real parameter
    cannot hold it)."""
    if isinstance(constant, (complex, np.complexfloating)):
        param_dtype = jnp.promote_types(param_dtype, jnp.complex64)
    return jnp.asarray(constant, dtype=param_dtype)


def check_rms_norm_options(
    layer: str,
    *,
    reduction_axes: Any,
    feature_axes: Any,
    axis_name: Any,
    axis_index_groups: Any,
) -> None:
    """Refuses the Flax ``RMSNorm`` options :func:`jaxext.rms_norm` cannot honour.

    The op normalises and scales over the last axis of one device's rows. An axis
    given by position (``reduction_axes=2``) is checked against the input, at the call
    (:func:`check_rms_norm_input`); here, values that name no axis or several.
    """
    for name, value in (("reduction_axes", reduction_axes), ("feature_axes", feature_axes)):
        axes = _axes(value)
        if not axes:
            raise ValueError(
                f"{layer}: `{name}` must name the last axis (-1, or its position, e.g. 2 "
                f"for a 3-D input: the only axis jaxext.rms_norm normalises over); got "
                f"{value!r}."
            )
    for name, value in (("axis_name", axis_name), ("axis_index_groups", axis_index_groups)):
        if value is not None:
            raise ValueError(
                f"{layer}: `{name}` must be None (statistics across devices are not "
                f"supported; split rows, not features); got {value!r}."
            )


def _axes(value: Any) -> tuple[int, ...] | None:
    """``value`` as a tuple of ints (an int or a sequence of ints), else ``None``."""
    values = value if isinstance(value, (tuple, list)) else (value,)
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        return None
    return tuple(int(v) for v in values)


def check_rms_norm_input(
    layer: str, x: jax.Array, *, reduction_axes: Any, feature_axes: Any, scale: Any
) -> None:
    """Refuses an input whose last axis is not the one ``reduction_axes`` and
    ``feature_axes`` name (Flax's axes, positions taken modulo ``x.ndim``), or whose
    features do not match ``scale``'s (``None``: no scale)."""
    if x.ndim == 0:
        raise ValueError(f"{layer}: `x` must have shape (..., features); got a scalar.")
    last = x.ndim - 1
    for name, value in (("reduction_axes", reduction_axes), ("feature_axes", feature_axes)):
        if {a + x.ndim if a < 0 else a for a in _axes(value)} != {last}:
            raise ValueError(
                f"{layer}: `{name}` must be the last axis of `x` (-1 or {last} for `x` of "
                f"shape {x.shape}; the only axis jaxext.rms_norm normalises over); got "
                f"{value!r}."
            )
    if scale is not None and np.shape(scale) != (x.shape[-1],):
        raise ValueError(
            f"{layer}: `x` must have shape (..., features) with features = "
            f"{np.shape(scale)[0]}, the size of `scale` of shape {np.shape(scale)}; got `x` "
            f"of shape {x.shape}."
        )


def refuse_mask(mask: Any, layer: str) -> None:
    if mask is not None:
        raise ValueError(f"{layer}: `mask` is not supported (it must be None); got an array.")
