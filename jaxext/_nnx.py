"""Flax NNX layers whose forward and backward run through jaxext's custom VJPs.

:class:`Linear` mirrors ``flax.nnx.Linear`` (constructor, parameter names, shapes,
initializers, dtype promotion), so a model can swap one for the other and keep its
checkpoints. Its matmul and bias add run through a hand-written VJP (``_dense.py``)
that emits the ops Flax's autodiff emits, so outputs and gradients are Flax's, bit
for bit under ``jit``.
:class:`MulConstant` wraps :func:`jaxext.mul_constant`.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from flax.typing import Dtype, Initializer, PrecisionLike, PromoteDtypeFn
from jax import lax
from jax.typing import ArrayLike

from ._layers import (
    apply_kernel,
    check_mul_constant,
    check_rms_norm_input,
    check_rms_norm_options,
    learnable_scale,
    refuse_dot_general,
    refuse_mask,
    refuse_missing_inputs,
)
from ._mul_constant import mul_constant
from ._rms_norm import rms_norm

__all__ = ["Linear", "MulConstant", "RMSNorm"]

default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()


def _feature_count(value: Any, name: str) -> int:
    """Returns ``value`` as a Python int, refusing bools, non-integers and values < 1."""
    try:
        count = operator.index(value)
    except TypeError:
        count = None
    if isinstance(value, bool) or count is None or count < 1:
        raise ValueError(f"`{name}` must be a positive integer; got {value!r}.")
    return count


class Linear(nnx.Module):
    """Drop-in for ``flax.nnx.Linear`` whose matmul is a hand-written custom VJP.

    Same constructor, parameters (``kernel`` of shape ``(in_features,
    out_features)``, ``bias`` of shape ``(out_features,)``) and default
    initializers as ``flax.nnx.Linear``: built from the same ``nnx.Rngs`` it holds
    identical parameters and returns identical outputs and gradients (bit for bit
    under ``jit``: the hand-written backward is the program Flax's autodiff
    compiles), for every ``dtype``, ``param_dtype``, ``precision`` and
    ``preferred_element_type``.

    Args:
        in_features: number of input features.
        out_features: number of output features.
        use_bias: whether to add a bias (default ``True``).
        dtype: computation dtype (default: promoted from inputs and params).
        param_dtype: dtype of the parameters (default ``float32``).
        precision: matmul precision, see ``jax.lax.Precision``.
        kernel_init: initializer of the kernel (default LeCun normal).
        bias_init: initializer of the bias (default zeros).
        dot_general: accepted for signature compatibility and kept as the
            ``dot_general`` attribute, as in Flax; only ``jax.lax.dot_general``
            (the default) is allowed.
        promote_dtype: function ``((inputs, kernel, bias), dtype=...) -> tuple``
            casting the operands before the matmul, as in flax.
        preferred_element_type: accumulation/result dtype of the matmul.
        rngs: the ``nnx.Rngs`` whose ``params`` stream initializes the weights.
        kernel_metadata: extra metadata for the kernel ``nnx.Param``.
        bias_metadata: extra metadata for the bias ``nnx.Param``.

    Raises:
        ValueError: if ``dot_general`` is not ``jax.lax.dot_general``, or a
            feature count is not a positive integer.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jaxext.nnx
        >>> layer = jaxext.nnx.Linear(3, 4, rngs=nnx.Rngs(0))
        >>> layer(jnp.ones((2, 3))).shape
        (2, 4)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        precision: PrecisionLike = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        dot_general: Any = lax.dot_general,
        promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
        preferred_element_type: Dtype | None = None,
        rngs: nnx.Rngs,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        refuse_dot_general(dot_general, "nnx.Linear")
        in_features = _feature_count(in_features, "in_features")
        out_features = _feature_count(out_features, "out_features")
        # Same key order as flax.nnx.Linear: kernel first, then bias.
        self.kernel = nnx.Param(
            kernel_init(rngs.params(), (in_features, out_features), param_dtype),
            **kernel_metadata,
        )
        self.bias: nnx.Param | None
        if use_bias:
            self.bias = nnx.Param(
                bias_init(rngs.params(), (out_features,), param_dtype), **bias_metadata
            )
        else:
            self.bias = nnx.data(None)
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.dot_general = dot_general
        self.promote_dtype = promote_dtype
        self.preferred_element_type = preferred_element_type

    def __call__(self, inputs: ArrayLike, out_sharding: Any = None) -> jax.Array:
        """Applies ``inputs @ kernel + bias`` over the last axis of ``inputs``.

        Args:
            inputs: array of shape ``(..., in_features)``, or anything the
                layer's ``promote_dtype`` turns into one, as in Flax (a nested
                Python list, a bool or integer array).
            out_sharding: sharding of the result, as in ``flax.nnx.Linear``
                (e.g. a ``PartitionSpec`` under ``jax.set_mesh``; needed for a
                row-parallel layer on a mesh with explicit axes).

        Returns:
            Array of shape ``(..., out_features)``.

        Raises:
            TypeError: if ``inputs`` is ``None`` or a string, if its last dimension
                is not ``in_features`` (the exception type ``flax.nnx.Linear``
                raises), or if ``out_sharding`` is not a sharding.
        """
        refuse_missing_inputs(inputs)
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        return apply_kernel(
            inputs,
            kernel,
            bias,
            precision=self.precision,
            preferred_element_type=self.preferred_element_type,
            out_sharding=out_sharding,
        )


class MulConstant(nnx.Module):
    """Multiplies its input by a constant via :func:`jaxext.mul_constant`.

    By default the constant is static (part of the module's structure, never a
    parameter, receiving no gradient). With ``learnable=True`` it becomes an
    ``nnx.Param`` named ``scale`` initialized to ``constant``, which receives its
    true gradient ``sum(g * x)``.

    Args:
        constant: a Python or NumPy real/complex scalar (not a bool).
        learnable: store the constant as a trainable scalar parameter.
        param_dtype: dtype of the ``scale`` parameter when ``learnable``; for a
            complex ``constant``, the complex dtype it promotes to with complex64.

    Raises:
        TypeError: if ``constant`` is not a Python/NumPy scalar.

    Example:
        >>> import jax.numpy as jnp
        >>> import jaxext.nnx
        >>> jaxext.nnx.MulConstant(3.0)(jnp.ones(2))
        Array([3., 3.], dtype=float32)
    """

    def __init__(
        self, constant: float, *, learnable: bool = False, param_dtype: Dtype = jnp.float32
    ):
        check_mul_constant(constant)
        self.constant = constant
        self.learnable = learnable
        self.scale: nnx.Param | None
        if learnable:
            self.scale = nnx.Param(learnable_scale(constant, param_dtype))
        else:
            self.scale = nnx.data(None)

    def __call__(self, inputs: ArrayLike) -> jax.Array:
        """Returns ``inputs * constant`` (or ``inputs * scale`` when learnable)."""
        if self.scale is not None:
            return mul_constant(inputs, self.scale[...])
        return mul_constant(inputs, self.constant)


class RMSNorm(nnx.Module):
    """Drop-in for ``flax.nnx.RMSNorm`` that runs :func:`jaxext.rms_norm`.

    Same constructor and parameter (``scale`` of shape ``(num_features,)``, from
    ``scale_init``) as ``flax.nnx.RMSNorm``; the call runs :func:`jaxext.rms_norm`
    (by default plain XLA on CPU, its Pallas kernels compiled on GPU and TPU; see
    ``implementation``). Outputs and gradients equal Flax's up to rounding (both
    reduce in float32 at least).

    Args:
        num_features: size of the last axis of the input.
        epsilon: added to the mean square (default ``1e-6``).
        dtype: result dtype (default: promoted from the input and ``scale``).
        param_dtype: dtype of ``scale`` (default ``float32``).
        use_scale: whether to learn ``scale``; without it the output is not scaled.
        scale_init: initializer of ``scale`` (default ones).
        reduction_axes: the last axis: ``-1`` or its position (``2`` for a 3-D
            input), an int or a sequence of them, as in Flax (the op normalises
            over the last axis only).
        feature_axes: the last axis, as ``reduction_axes``.
        axis_name: must be ``None`` (no cross-device statistics).
        axis_index_groups: must be ``None``.
        use_fast_variance: accepted for compatibility; RMSNorm's statistic is the
            mean square either way.
        promote_dtype: function ``((x, scale), dtype=...) -> tuple`` casting the
            operands first, as in Flax.
        rngs: the ``nnx.Rngs`` whose ``params`` stream ``scale_init`` receives.
        scale_metadata: extra metadata for the ``scale`` ``nnx.Param``.
        implementation: passed to :func:`jaxext.rms_norm`: ``"xla"``,
            ``"pallas"``, ``"interpret"`` or ``None`` (default: per platform).
        block_rows: passed to :func:`jaxext.rms_norm`.

    Raises:
        ValueError: if an option above is not one the op supports, or
            ``num_features`` is not a positive integer.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jaxext.nnx
        >>> layer = jaxext.nnx.RMSNorm(3, rngs=nnx.Rngs(0))
        >>> layer(jnp.ones((2, 3))).shape
        (2, 3)
    """

    def __init__(
        self,
        num_features: int,
        *,
        epsilon: float = 1e-6,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        use_scale: bool = True,
        scale_init: Initializer = nnx.initializers.ones,
        reduction_axes: Any = -1,
        feature_axes: Any = -1,
        axis_name: str | None = None,
        axis_index_groups: Any = None,
        use_fast_variance: bool = True,
        promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
        rngs: nnx.Rngs,
        scale_metadata: Mapping[str, Any] = MappingProxyType({}),
        implementation: str | None = None,
        block_rows: int | None = None,
    ):
        num_features = _feature_count(num_features, "num_features")
        check_rms_norm_options(
            "nnx.RMSNorm",
            reduction_axes=reduction_axes,
            feature_axes=feature_axes,
            axis_name=axis_name,
            axis_index_groups=axis_index_groups,
        )
        self.scale: nnx.Param | None
        if use_scale:
            self.scale = nnx.Param(
                scale_init(rngs.params(), (num_features,), param_dtype), **scale_metadata
            )
        else:
            self.scale = nnx.data(None)
        self.num_features = num_features
        self.epsilon = epsilon
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.use_scale = use_scale
        self.reduction_axes = reduction_axes
        self.feature_axes = feature_axes
        self.axis_name = axis_name
        self.axis_index_groups = axis_index_groups
        self.use_fast_variance = use_fast_variance
        self.promote_dtype = promote_dtype
        self.implementation = implementation
        self.block_rows = block_rows

    def __call__(self, x: ArrayLike, mask: jax.Array | None = None) -> jax.Array:
        """Normalises ``x`` over its last axis and multiplies by ``scale``.

        Args:
            x: array of shape ``(..., num_features)``.
            mask: must be ``None`` (masked statistics are not supported).

        Returns:
            Array of ``x``'s shape.

        Raises:
            ValueError: if ``mask`` is given, ``x``'s last axis is not the one
                ``reduction_axes`` and ``feature_axes`` name, or its size is not
                ``scale``'s.
        """
        refuse_missing_inputs(x)
        refuse_mask(mask, "nnx.RMSNorm")
        scale = self.scale[...] if self.scale is not None else None
        x, scale = self.promote_dtype((x, scale), dtype=self.dtype)
        x = jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(jnp.float32)
        check_rms_norm_input(
            "nnx.RMSNorm",
            x,
            reduction_axes=self.reduction_axes,
            feature_axes=self.feature_axes,
            scale=scale,
        )
        if scale is None:
            scale = jnp.ones((x.shape[-1],), x.dtype)
        return rms_norm(
            x,
            scale,
            self.epsilon,
            implementation=self.implementation,
            block_rows=self.block_rows,
        )
