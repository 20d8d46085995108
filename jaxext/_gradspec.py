"""What a backward rule must know about each input to hand back a well-typed gradient.

Plain autodiff gives every gradient its primal's full type: shape, dtype, sharding
and, inside ``shard_map``, the set of manual axes it varies over. A hand-written
backward must do the same or fail (``check_vma``, explicit-sharding meshes) where
autodiff works. The forward records a :class:`GradSpec` per wanted gradient (static
data, no arrays) and the backward finishes each gradient with :func:`finish_grad`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ._validation import unbroadcast

__all__ = ["GradSpec", "cast_grad", "finish_grad", "grad_spec"]


class GradSpec(NamedTuple):
    """Static type of one primal input: what its gradient must look like."""

    shape: tuple[int, ...]
    dtype: Any
    sharding: Any
    varying: frozenset[Any]


def _varying_axes(value: Any) -> frozenset[Any]:
    """Manual (``shard_map``) mesh axes that ``value`` varies over; empty outside one."""
    aval = jax.typeof(value)
    varying = getattr(aval, "vma", None)  # JAX releases before 0.10
    if varying is None:  # JAX 0.10
        varying = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
    return frozenset(varying)


def grad_spec(value: Any) -> GradSpec | None:
    """Records ``value``'s type for its gradient; ``None`` for an absent input."""
    if value is None:
        return None
    sharding = jax.typeof(value).sharding
    return GradSpec(tuple(value.shape), value.dtype, sharding, _varying_axes(value))


def _is_explicit(sharding: Any) -> bool:
    mesh = getattr(sharding, "mesh", None)
    axis_types = getattr(mesh, "axis_types", ())
    return jax.sharding.AxisType.Explicit in axis_types


def cast_grad(grad: jax.Array, dtype: Any) -> jax.Array:
    """Casts a gradient to its primal's ``dtype`` as autodiff's transposes do.

    A complex gradient of a real primal keeps its real part, taken explicitly:
    that is what the transpose of the forward's real-to-complex cast computes, and
    it does not trip JAX's complex-to-real cast warning (a future error).
    """
    if jnp.iscomplexobj(grad) and not jnp.issubdtype(dtype, jnp.complexfloating):
        grad = lax.real(grad)
    return grad.astype(dtype)


def finish_grad(grad: jax.Array, spec: GradSpec) -> jax.Array:
    """Gives ``grad`` its primal's shape, manual-axis variance, sharding and dtype.

    * Broadcast dimensions are summed away (:func:`unbroadcast`).
    * Manual axes the gradient varies over but the primal does not are ``psum``-ed:
      the forward implicitly cast the invariant primal to varying, and the
      transpose of that cast is a ``psum``.
    * Under an explicit-sharding mesh the gradient is resharded like the primal,
      as autodiff's transposes do.
    * Finally it is cast to the primal's dtype (:func:`cast_grad`: the real part
      for a real primal).
    """
    if grad.shape != spec.shape:
        grad = unbroadcast(grad, spec.shape)
    extra = tuple(sorted(_varying_axes(grad) - spec.varying, key=str))
    if extra:
        grad = lax.psum(grad, extra)
    if _is_explicit(spec.sharding) and jax.typeof(grad).sharding != spec.sharding:
        grad = jax.sharding.reshard(grad, spec.sharding)
    return cast_grad(grad, spec.dtype)
