"""`dense`: Flax's ``Dense``/``Linear`` computation with a hand-written VJP.

The forward is the one ``flax.nnx.Linear`` and ``flax.linen.Dense`` run after
their ``promote_dtype``: ``lax.dot_general(inputs, kernel, ...)`` with the
layer's ``precision`` and ``preferred_element_type``, then ``y + bias`` with
``jnp`` promotion (so a bias wider than ``preferred_element_type`` widens the
result, as in Flax). The backward is the program JAX's transpose rules emit for
that forward, op for op: the bias gradient is a ``reduce_sum`` over the batch
axes in the cotangent's dtype, the cotangent is then cast back to the matmul's
result dtype (the transpose of the bias add's promotion), and the input and
kernel gradients are ``dot_general(g, kernel)`` and ``dot_general(g, inputs)``
transposed to ``(in, out)``, both with the forward's ``preferred_element_type``,
each finally cast to its input's dtype. Same program, same bits: the Flax
drop-ins give Flax's outputs and gradients exactly under ``jit``.

Like :func:`jaxext.linear`, the forward keeps only what the perturbed inputs'
gradients need.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec
from jax.typing import DTypeLike

from jaxext import custom_vjp, grad_type

__all__ = ["dense"]


def dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    *,
    precision: Any,
    preferred_element_type: DTypeLike | None,
    out_sharding: Any,
) -> jax.Array:
    """``x @ kernel + bias`` with ``kernel`` in Flax's ``(in_features, out_features)`` layout.

    For the Flax layers, which promote and check their operands themselves: the
    operands are used as they come (no cast), exactly as Flax's layers use them.

    Args:
        x: inputs of shape ``(..., in_features)``.
        kernel: array of shape ``(in_features, out_features)``.
        bias: ``None`` or an array of shape ``(out_features,)``.
        precision: ``lax.dot_general``'s ``precision``.
        preferred_element_type: ``lax.dot_general``'s ``preferred_element_type``.
        out_sharding: ``lax.dot_general``'s ``out_sharding``.

    Returns:
        ``lax.dot_general(x, kernel) + bias`` of shape ``(..., out_features)``.

    Raises:
        TypeError: if ``out_sharding`` is not a sharding, or (from
            ``lax.dot_general``) if the shapes do not contract.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxext._dense import dense
        >>> dense(jnp.ones((4, 3)), jnp.ones((3, 2)), jnp.zeros(2), precision=None,
        ...       preferred_element_type=None, out_sharding=None).shape
        (4, 2)
    """
    if out_sharding is not None and not isinstance(out_sharding, (PartitionSpec, NamedSharding)):
        raise TypeError(
            "`out_sharding` must be None, a jax.sharding.PartitionSpec or a "
            f"jax.sharding.NamedSharding; got {type(out_sharding).__name__} {out_sharding!r}."
        )
    return _dense(x, kernel, bias, _Config(precision, preferred_element_type, out_sharding))


class _Config(NamedTuple):
    """The static (non-differentiable, hashable) arguments of the custom VJP."""

    precision: Any
    preferred_element_type: Any
    out_sharding: Any


def _matmul(x, kernel, config):
    return lax.dot_general(
        x,
        kernel,
        (((x.ndim - 1,), (0,)), ((), ())),
        precision=config.precision,
        preferred_element_type=config.preferred_element_type,
        out_sharding=config.out_sharding,
    )


def _add_bias(y, bias):
    # Flax's `y += jnp.reshape(bias, ...)`: jnp promotion of the two dtypes.
    if bias is None:
        return y
    return y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))


@functools.partial(custom_vjp, nondiff_argnums=(3,))
def _dense(x, kernel, bias, config):
    return _add_bias(_matmul(x, kernel, config), bias)


def _dense_fwd(x, kernel, bias, config):
    # grad_x needs the kernel and grad_kernel needs x; grad_bias needs neither. Only
    # those are kept (references, no copies), with the Python facts the backward
    # needs: the matmul's result dtype and each input's dtype and sharding.
    xv, kv = x.value, kernel.value
    bv = None if bias is None else bias.value
    y_dot = _matmul(xv, kv, config)
    res = (
        kv if x.perturbed else None,
        xv if kernel.perturbed else None,
        bias is not None and bias.perturbed,
        y_dot.dtype,
        grad_type(xv),
        grad_type(kv),
        None if bv is None else grad_type(bv),
    )
    return _add_bias(y_dot, bv), res


def _cast(grad: jax.Array, dtype: Any) -> jax.Array:
    """``grad`` in ``dtype``, as autodiff's transpose of a cast: the real part for a
    real ``dtype``."""
    if jnp.iscomplexobj(grad) and not jnp.issubdtype(dtype, jnp.complexfloating):
        grad = lax.real(grad)
    return grad.astype(dtype)


def _transposed(sharding):
    """The sharding of a 2-D array laid out like ``sharding``'s, axes swapped."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    # `partitions`, not `*spec`: a spec's unreduced/reduced axes stay as they are.
    partitions = tuple(sharding.spec.partitions) + (None,) * (2 - len(sharding.spec.partitions))
    return sharding.update(spec=sharding.spec.update(partitions=partitions[::-1]))


def _dense_bwd(config, res, g):
    k_for_x, x_for_k, bias_wanted, dot_dtype, x_type, k_type, b_type = res
    batch_axes = tuple(range(g.ndim - 1))
    grad_x = grad_k = grad_b = None
    if bias_wanted:
        # The transpose of the bias's broadcast: a sum over the batch axes, in g's dtype.
        grad_b = lax.reduce_sum(g, batch_axes, out_sharding=b_type.sharding)
        grad_b = _cast(grad_b, b_type.dtype)
    # The transpose of the bias add's promotion of the matmul result.
    g = _cast(g, dot_dtype)
    if k_for_x is not None:
        # (..., out) x (in, out) -> (..., in), contracting the kernel's out axis.
        grad_x = lax.dot_general(
            g,
            k_for_x,
            (((g.ndim - 1,), (1,)), ((), ())),
            precision=config.precision,
            preferred_element_type=config.preferred_element_type,
            out_sharding=x_type.sharding,  # needed when the contraction axis is sharded
        )
        grad_x = _cast(grad_x, x_type.dtype)
    if x_for_k is not None:
        # As autodiff: (..., out) x (..., in) -> (out, in), then transposed to (in, out).
        grad_k = lax.dot_general(
            g,
            x_for_k,
            ((batch_axes, batch_axes), ((), ())),
            precision=config.precision,
            preferred_element_type=config.preferred_element_type,
            out_sharding=_transposed(k_type.sharding),
        )
        grad_k = _cast(lax.transpose(grad_k, (1, 0)), k_type.dtype)
    return grad_x, grad_k, grad_b


_dense.defvjp(_dense_fwd, _dense_bwd, symbolic_zeros=True)
