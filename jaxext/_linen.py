"""Flax Linen layers whose forward and backward run through jaxext's custom VJPs.

:class:`Dense` mirrors ``flax.linen.Dense`` (attributes, parameter tree,
initializers, dtype promotion) with a hand-written VJP (``_dense.py``);
:class:`MulConstant` wraps :func:`jaxext.mul_constant`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax.linen.dtypes import promote_dtype
from flax.typing import Dtype, Initializer, PrecisionLike, PromoteDtypeFn
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

__all__ = ["Dense", "MulConstant", "RMSNorm"]


class Dense(nn.Module):
    """Drop-in for ``flax.linen.Dense`` whose matmul is a hand-written custom VJP.

    Same attributes and parameters as ``flax.linen.Dense`` (``kernel`` of shape
    ``(in_features, features)``, ``bias`` of shape ``(features,)``, same default
    initializers): ``init`` with the same key gives the identical ``params`` tree,
    and ``apply`` gives identical outputs and gradients (bit for bit under
    ``jit``: the hand-written backward is the program Flax's autodiff compiles).

    Attributes:
        features: number of output features.
        use_bias: whether to add a bias (default ``True``).
        dtype: computation dtype (default: promoted from inputs and params).
        param_dtype: dtype of the parameters (default ``float32``).
        precision: matmul precision, see ``jax.lax.Precision``.
        kernel_init: initializer of the kernel (default LeCun normal).
        bias_init: initializer of the bias (default zeros).
        promote_dtype: variadic ``(inputs, kernel, bias, dtype=...) -> list``
            casting the operands before the matmul, as in flax.
        dot_general: accepted for compatibility; must be ``None`` or
            ``jax.lax.dot_general``.
        dot_general_cls: accepted for compatibility; must be ``None``.

    Raises:
        ValueError: (at ``init``/``apply``) if ``dot_general`` or
            ``dot_general_cls`` is customised.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import jaxext.linen
        >>> layer = jaxext.linen.Dense(features=4)
        >>> params = layer.init(jax.random.key(0), jnp.ones((1, 3)))
        >>> layer.apply(params, jnp.ones((2, 3))).shape
        (2, 4)
    """

    features: int
    use_bias: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    precision: PrecisionLike = None
    kernel_init: Initializer = nn.initializers.lecun_normal()
    bias_init: Initializer = nn.initializers.zeros_init()
    promote_dtype: PromoteDtypeFn = promote_dtype
    dot_general: Any = None
    dot_general_cls: Any = None

    @nn.compact
    def __call__(self, inputs: ArrayLike) -> jax.Array:
        """Applies ``inputs @ kernel + bias`` over the last axis of ``inputs``.

        Args:
            inputs: array of shape ``(..., in_features)``, or anything the
                layer's ``promote_dtype`` turns into one, as in Flax (a nested
                Python list, a bool or integer array).

        Returns:
            Array of shape ``(..., features)``.
        """
        refuse_dot_general(self.dot_general, "linen.Dense")
        if self.dot_general_cls is not None:
            raise ValueError(
                "`dot_general_cls` cannot be set for jaxext's linen.Dense (its matmul is "
                f"jaxext's custom VJP); got {self.dot_general_cls!r}."
            )
        refuse_missing_inputs(inputs)
        if np.ndim(inputs) == 0:
            raise TypeError("`inputs` must have shape (..., in_features); got a scalar.")
        kernel = self.param(
            "kernel", self.kernel_init, (np.shape(inputs)[-1], self.features), self.param_dtype
        )
        bias = None
        if self.use_bias:
            bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        return apply_kernel(
            inputs, kernel, bias, precision=self.precision, preferred_element_type=None
        )


class MulConstant(nn.Module):
    """Multiplies its input by a constant via :func:`jaxext.mul_constant`.

    By default the constant is a static attribute (no parameter, no gradient).
    With ``learnable=True`` it is a scalar parameter ``scale`` initialized to
    ``constant`` that receives its true gradient.

    Attributes:
        constant: a Python or NumPy scalar (not a bool).
        learnable: store the constant as a trainable parameter ``scale``.
        param_dtype: dtype of ``scale`` when ``learnable``; for a complex
            ``constant``, the complex dtype it promotes to with complex64.

    Raises:
        TypeError: (at ``init``/``apply``) if ``constant`` is not a scalar.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import jaxext.linen
        >>> layer = jaxext.linen.MulConstant(3.0)
        >>> layer.apply({}, jnp.ones(2))
        Array([3., 3.], dtype=float32)
    """

    constant: float
    learnable: bool = False
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, inputs: ArrayLike) -> jax.Array:
        """Returns ``inputs * constant`` (or ``inputs * scale`` when learnable)."""
        check_mul_constant(self.constant)
        if self.learnable:
            scale = self.param(
                "scale", lambda _key: learnable_scale(self.constant, self.param_dtype)
            )
            return mul_constant(inputs, scale)
        return mul_constant(inputs, self.constant)


class RMSNorm(nn.Module):
    """Drop-in for ``flax.linen.RMSNorm`` that runs :func:`jaxext.rms_norm`.

    Same attributes and parameter tree (``scale`` of shape ``(features,)`` from
    ``scale_init``, created at the first call) as ``flax.linen.RMSNorm``; the call
    runs :func:`jaxext.rms_norm` (by default plain XLA on CPU, its Pallas kernels
    compiled on GPU and TPU; see ``implementation``). As in Flax, it computes in
    ``dtype`` where ``dtype`` is wider than the input (float32 for bfloat16 input,
    say). Outputs and gradients equal Flax's up to rounding (both reduce in float32
    at least).

    Attributes:
        epsilon: added to the mean square (default ``1e-6``).
        dtype: result dtype (default: promoted from the input and ``scale``).
        param_dtype: dtype of ``scale`` (default ``float32``).
        use_scale: whether to learn ``scale``.
        scale_init: initializer of ``scale`` (default ones).
        reduction_axes: the last axis: ``-1`` or its position (``2`` for a 3-D
            input), an int or a sequence of them, as in Flax.
        feature_axes: the last axis, as ``reduction_axes``.
        axis_name: must be ``None``.
        axis_index_groups: must be ``None``.
        use_fast_variance: accepted for compatibility (no effect on RMSNorm).
        force_float32_reductions: must be ``True`` (the kernel always reduces in
            float32 at least).
        implementation: passed to :func:`jaxext.rms_norm`: ``"xla"``,
            ``"pallas"``, ``"interpret"`` or ``None`` (default: per platform).
        block_rows: passed to :func:`jaxext.rms_norm`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import jaxext.linen
        >>> layer = jaxext.linen.RMSNorm()
        >>> params = layer.init(jax.random.key(0), jnp.ones((2, 3)))
        >>> layer.apply(params, jnp.ones((2, 3))).shape
        (2, 3)
    """

    epsilon: float = 1e-6
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    use_scale: bool = True
    scale_init: Initializer = nn.initializers.ones
    reduction_axes: Any = -1
    feature_axes: Any = -1
    axis_name: str | None = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True
    implementation: str | None = None
    block_rows: int | None = None

    @nn.compact
    def __call__(self, x: ArrayLike, *, mask: jax.Array | None = None) -> jax.Array:
        """Normalises ``x`` over its last axis and multiplies by ``scale``.

        Raises:
            ValueError: if an unsupported attribute is set, ``mask`` is given, or
                ``x``'s last axis is not the one ``reduction_axes`` and
                ``feature_axes`` name.
        """
        check_rms_norm_options(
            "linen.RMSNorm",
            reduction_axes=self.reduction_axes,
            feature_axes=self.feature_axes,
            axis_name=self.axis_name,
            axis_index_groups=self.axis_index_groups,
        )
        if not self.force_float32_reductions:
            raise ValueError(
                "linen.RMSNorm: `force_float32_reductions` must be True (the kernel "
                "reduces in float32 at least); got False."
            )
        refuse_missing_inputs(x)
        refuse_mask(mask, "linen.RMSNorm")
        x = jnp.asarray(x)
        check_rms_norm_input(
            "linen.RMSNorm",
            x,
            reduction_axes=self.reduction_axes,
            feature_axes=self.feature_axes,
            scale=None,
        )
        features = x.shape[-1]
        args = [x]
        if self.use_scale:
            scale = self.param("scale", self.scale_init, (features,), self.param_dtype)
            args.append(scale)
        # Flax's result dtype: `dtype`, else the inputs' and scale's, made floating.
        out_dtype = nn.dtypes.canonicalize_dtype(*args, dtype=self.dtype)
        # Flax computes in `dtype` where it is wider than the input (its statistics and
        # the product are in the promotion of x's dtype, `dtype` and float32).
        compute = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else out_dtype
        if self.dtype is not None:
            compute = jnp.promote_types(compute, self.dtype)
        x = x.astype(compute)
        if not self.use_scale:
            scale = jnp.ones((features,), x.dtype)
        y = rms_norm(
            x,
            scale,
            self.epsilon,
            implementation=self.implementation,
            block_rows=self.block_rows,
        )
        return y.astype(out_dtype)
