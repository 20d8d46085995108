"""`linear`: an affine map ``x @ weight.T + bias`` with a hand-written VJP.

This module is a template for your own op: its checks, the primal, ``fwd`` and
``bwd``, written with the public ``jaxext.custom_vjp`` and ``jax.lax`` only.
``CustomVJPPrimal.perturbed`` tells the forward which inputs are differentiated
(PyTorch's ``ctx.needs_input_grad``); the forward keeps only the operands those
gradients need and the backward computes those gradients alone. Forward mode
(``jvp``, ``jacfwd``, ``hessian``) comes from ``jaxext.custom_vjp``, which
transposes the backward.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from jaxext import check_array, custom_vjp, grad_type

__all__ = ["linear"]

PrecisionLike = Any  # None, str, lax.Precision, or a pair of them (hashable)
OutSharding = Any  # None, jax.sharding.PartitionSpec or jax.sharding.NamedSharding


def linear(
    x: ArrayLike,
    weight: ArrayLike,
    bias: ArrayLike | None = None,
    *,
    precision: PrecisionLike = None,
    preferred_element_type: DTypeLike | None = None,
    out_sharding: OutSharding = None,
) -> jax.Array:
    """Applies ``y = x @ weight.T + bias`` with a custom VJP.

    The layout follows ``torch.nn.functional.linear``: ``weight`` has shape
    ``(out_features, in_features)``.

    Args:
        x: input of shape ``(..., in_features)``; any number of leading
            dimensions, including none and empty ones.
        weight: array of shape ``(out_features, in_features)``.
        bias: optional array of shape ``(out_features,)``.
        precision: matmul precision passed to ``lax.dot_general`` in the forward
            and in the backward (e.g. ``"highest"`` or ``lax.Precision.HIGHEST``).
        preferred_element_type: accumulation and result dtype of the matmul
            (e.g. ``jnp.float32`` for bfloat16 inputs). Defaults to the promoted
            dtype of the inputs.
        out_sharding: sharding of the result (a ``PartitionSpec`` under
            ``jax.set_mesh``, or a ``NamedSharding``), as for ``jnp.matmul``:
            needed on meshes with explicit axes when ``in_features`` is sharded
            (row parallelism). Each gradient has the sharding autodiff gives
            it (see :func:`jaxext.grad_type`): its input's, unreduced for an
            input marked reduced, replicated for one not placed on the mesh.

    Returns:
        Array of shape ``(..., out_features)``. Its dtype is the ``jnp``
        promotion of the input dtypes unless ``preferred_element_type`` is given.
        Gradients come back in each input's own dtype.

    Raises:
        TypeError: if an input is not a numeric (non-bool) array, e.g. a string,
            ``None`` for ``x``, a Python list, or ``bias=False`` (use ``None``);
            or if ``out_sharding`` is not a sharding.
        ValueError: if ``weight`` is not 2-D, ``x``'s last dimension differs
            from ``in_features``, or ``bias`` is not ``(out_features,)``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import jaxext
        >>> x, w, b = jnp.ones((4, 3)), jnp.ones((2, 3)), jnp.zeros(2)
        >>> jaxext.linear(x, w, b).shape
        (4, 2)
        >>> jax.grad(lambda w: jaxext.linear(x, w, b).sum())(w).shape
        (2, 3)
    """
    x = check_array(x, "x")
    weight = check_array(weight, "weight")
    if isinstance(bias, (bool, np.bool_)):
        # The seed's `bias=False` idiom: refuse it rather than read it as an array.
        raise TypeError(f"`bias` must be an array of shape (out_features,) or None; got {bias!r}.")
    if bias is not None:
        bias = check_array(bias, "bias")
    _check_shapes(x, weight, bias)
    config = _config(precision, preferred_element_type, out_sharding)
    if any(isinstance(a, jax.core.Tracer) for a in (x, weight, bias)):
        return _linear(x, weight, bias, config)
    # An eager call (nothing traced, so nothing to differentiate) runs as one compiled
    # program, as jax.numpy's functions do, rather than dispatching op by op.
    return _linear_compiled(x, weight, bias, config)


class _Config(NamedTuple):
    """The static (non-differentiable, hashable) arguments of the custom VJP."""

    precision: PrecisionLike
    preferred_element_type: Any  # a numpy dtype or None
    out_sharding: OutSharding


def _config(precision, preferred_element_type, out_sharding) -> _Config:
    if out_sharding is not None and not isinstance(
        out_sharding, (jax.sharding.PartitionSpec, jax.sharding.NamedSharding)
    ):
        raise TypeError(
            "`out_sharding` must be None, a jax.sharding.PartitionSpec or a "
            f"jax.sharding.NamedSharding; got {type(out_sharding).__name__} {out_sharding!r}."
        )
    if preferred_element_type is not None:
        preferred_element_type = jnp.dtype(preferred_element_type)
    return _Config(precision, preferred_element_type, out_sharding)


def _check_shapes(x: jax.Array, weight: jax.Array, bias: jax.Array | None) -> None:
    if weight.ndim != 2:
        raise ValueError(
            f"`weight` must be 2-D with shape (out_features, in_features); "
            f"got shape {weight.shape}."
        )
    out_features, in_features = weight.shape
    if x.ndim == 0:
        raise ValueError(
            f"`x` must have shape (..., in_features) = (..., {in_features}); got a scalar."
        )
    if x.shape[-1] != in_features:
        raise ValueError(
            f"`x` has {x.shape[-1]} features in its last dimension (shape {x.shape}) but "
            f"`weight` expects in_features={in_features} (shape {weight.shape})."
        )
    if bias is not None and bias.shape != (out_features,):
        raise ValueError(
            f"`bias` must have shape (out_features,) = ({out_features},); got shape {bias.shape}."
        )


def _result_dtype(x, weight, bias, preferred_element_type):
    if preferred_element_type is not None:
        return preferred_element_type
    operands = (x, weight) if bias is None else (x, weight, bias)
    return jnp.result_type(*operands)


def _matmul(x, weight, config, out_dtype):
    """``x @ weight.T``: contracts ``x``'s last axis with in_features."""
    dtype = jnp.promote_types(x.dtype, weight.dtype)
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    return lax.dot_general(
        x.astype(dtype),
        weight.astype(dtype),
        dims,
        precision=config.precision,
        preferred_element_type=out_dtype,
        out_sharding=config.out_sharding,
    )


@functools.partial(custom_vjp, nondiff_argnums=(3,))
def _linear(x, weight, bias, config):
    out_dtype = _result_dtype(x, weight, bias, config.preferred_element_type)
    y = _matmul(x, weight, config, out_dtype)
    if bias is not None:
        y = y + bias.astype(out_dtype)
    return y.astype(out_dtype)


def _linear_fwd(x, weight, bias, config):
    # With symbolic_zeros=True each argument arrives with `.value` and `.perturbed`
    # (PyTorch's needs_input_grad). grad_x needs the weight and grad_weight needs x;
    # grad_bias needs neither. Only those are kept (references, no copies), with
    # the Python facts the backward needs: which bias grad, and each gradient's type
    # (dtype and sharding, as autodiff would give it).
    xv, wv = x.value, weight.value
    bv = None if bias is None else bias.value
    res = (
        wv if x.perturbed else None,
        xv if weight.perturbed else None,
        bias is not None and bias.perturbed,
        grad_type(xv),
        grad_type(wv),
        None if bv is None else grad_type(bv),
    )
    return _linear(xv, wv, bv, config), res


def _linear_bwd(config, res, g):
    w_for_x, x_for_w, bias_wanted, x_type, w_type, b_type = res
    batch_axes = tuple(range(g.ndim - 1))
    grad_x = grad_w = grad_b = None
    if w_for_x is not None:
        # (..., out) x (out, in) -> (..., in).
        dtype = jnp.promote_types(g.dtype, w_for_x.dtype)
        grad_x = lax.dot_general(
            g.astype(dtype),
            w_for_x.astype(dtype),
            (((g.ndim - 1,), (0,)), ((), ())),
            precision=config.precision,
            out_sharding=x_type.sharding,  # needed when the contraction axis is sharded
        )
        grad_x = _as_grad(grad_x, x_type)
    if x_for_w is not None:
        # Contract every leading (batch) axis: (..., out) x (..., in) -> (out, in).
        dtype = jnp.promote_types(g.dtype, x_for_w.dtype)
        grad_w = lax.dot_general(
            g.astype(dtype),
            x_for_w.astype(dtype),
            ((batch_axes, batch_axes), ((), ())),
            precision=config.precision,
            out_sharding=w_type.sharding,
        )
        grad_w = _as_grad(grad_w, w_type)
    if bias_wanted:
        # Sum over leading axes only, so the shape stays (out_features,) even when it
        # is 1. reduce_sum is the reduction autodiff's transpose emits, in g's own
        # dtype: bit-identical to flax's bias gradient, bfloat16 included.
        grad_b = lax.reduce_sum(g, batch_axes, out_sharding=b_type.sharding)
        grad_b = _as_grad(grad_b, b_type)
    return grad_x, grad_w, grad_b


_linear.defvjp(_linear_fwd, _linear_bwd, symbolic_zeros=True)
_linear_compiled = jax.jit(_linear, static_argnums=3)


def _as_grad(grad: jax.Array, kind: jax.ShapeDtypeStruct) -> jax.Array:
    """``grad`` in its input's dtype; the real part for a real input of a complex result."""
    if jnp.iscomplexobj(grad) and not jnp.issubdtype(kind.dtype, jnp.complexfloating):
        grad = jnp.real(grad)
    return grad.astype(kind.dtype)
