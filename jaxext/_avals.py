"""Types of values: dtypes, zeros, and the mesh (``shard_map``, explicit sharding) helpers.

A leaf module under ``jaxext``'s custom_vjp core (``_custom_vjp``, ``_forward_mode``,
``_rule_contracts``, ``_eager_cache``): what a value's type is, what its zero is, and how
a gradient or a batched operand is made to vary and be sharded like its input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import primal_dtype_to_tangent_dtype
from jax.interpreters import ad

__all__ = [
    "as_array",
    "as_dtype",
    "batch_entry",
    "batched_aval",
    "dtype_of",
    "explicit_spec",
    "is_array_leaf",
    "is_differentiable",
    "match_type",
    "shape_dtypes",
    "py_float",
    "short",
    "split_over_devices",
    "stand_in",
    "unbatched_aval",
    "varying_axes",
    "with_batch_entry",
    "zeros",
    "zeros_like",
]


def is_array_leaf(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.core.Tracer))


def dtype_of(value: Any) -> Any:
    """``jnp.result_type(value)``, read directly off an array."""
    return value.dtype if isinstance(value, jax.Array) else jnp.result_type(value)


def is_differentiable(dtype: Any) -> bool:
    """Whether values of ``dtype`` are differentiated, as JAX decides: their tangent dtype
    is not ``float0`` (floats, complex numbers, and extended dtypes with a tangent dtype,
    such as Flax's FP8 ``fp32_max_grad``, whose tangent dtype is itself)."""
    return primal_dtype_to_tangent_dtype(dtype) != jax.dtypes.float0


def as_dtype(dtype: Any) -> Any:
    """``jnp.dtype(dtype)``; an extended dtype (which NumPy cannot interpret) as it is."""
    return dtype if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else jnp.dtype(dtype)


def zeros_like(value: Any) -> jax.Array:
    """A zero tangent for ``value`` (see :func:`zeros`)."""
    aval = jax.typeof(value)
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
        return zeros(aval.to_tangent_aval())
    return jnp.zeros_like(value)


def zeros(aval: Any) -> jax.Array:
    """Zeros of type ``aval``; for an extended dtype, the zero of its own rules (as JAX's)."""
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
        return ad.instantiate_zeros(ad.Zero(aval))
    return jnp.zeros(aval.shape, aval.dtype)


def as_array(value: Any) -> Any:
    """``jnp.asarray(value)``; a concrete JAX array is returned as it is (what that gives)."""
    if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
        return value
    return jnp.asarray(value)


def py_float() -> Any:
    """The dtype a Python float takes (float32, or float64 with ``jax_enable_x64``)."""
    return jnp.result_type(float)


def short(value: Any) -> str:
    """``float32[3]``: a value's dtype and shape, as JAX's messages write them."""
    return f"{as_dtype(value.dtype).name}[{','.join(str(d) for d in value.shape)}]"


def shape_dtypes(out: Any) -> Any:
    """``out`` with each leaf replaced by its shape and dtype (a ``jax.ShapeDtypeStruct``)."""
    return jax.tree_util.tree_map(lambda o: jax.ShapeDtypeStruct(np.shape(o), dtype_of(o)), out)


def stand_in(aval: Any) -> jax.ShapeDtypeStruct:
    """A stand-in for a value of type ``aval``, keeping its ``shard_map`` variance."""
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return jax.ShapeDtypeStruct(
            aval.shape, aval.dtype, sharding=aval.sharding, manual_axis_type=manual
        )
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


def match_type(grad: jax.Array, aval: Any) -> jax.Array:
    """Sums over mesh axes ``grad`` varies over but its input does not; reshards like it."""
    extra = tuple(sorted(varying_axes(jax.typeof(grad)) - varying_axes(aval), key=str))
    if extra:
        grad = jax.lax.psum(grad, extra)
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    explicit = jax.sharding.AxisType.Explicit in getattr(mesh, "axis_types", ())
    if explicit and jax.typeof(grad).sharding != sharding:
        grad = jax.sharding.reshard(grad, sharding)
    return grad


def varying_axes(aval: Any) -> frozenset[Any]:
    """Manual (``shard_map``) mesh axes a value varies over; empty outside one."""
    varying = getattr(aval, "vma", None)  # JAX releases before 0.10
    if varying is None:  # JAX 0.10
        varying = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
    return frozenset(varying)


def split_over_devices(values: Sequence[Any]) -> bool:
    """Whether any of ``values`` is split over several devices: a concrete array placed on
    more than one, or a traced one whose type names mesh axes (explicit sharding)."""
    for value in values:
        if value is None:
            continue
        if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
            if len(value.sharding.device_set) > 1:
                return True
            continue
        spec = getattr(getattr(jax.typeof(value), "sharding", None), "spec", None)
        if spec is None:
            continue
        partitions = getattr(spec, "partitions", ())  # not `*spec`: refused for reduced specs
        if any(e is not None for e in partitions) or getattr(spec, "unreduced", None):
            return True
        if getattr(spec, "reduced", None):
            return True
    return False


def unbatched_aval(value: Any) -> Any:
    """The type of one element of ``value``'s leading batch axis."""
    return jax.ShapeDtypeStruct(np.shape(value)[1:], dtype_of(value))


def explicit_spec(value: Any) -> Any:
    """The ``PartitionSpec`` of ``value`` on an explicit mesh (``None`` elsewhere)."""
    sharding = getattr(jax.typeof(value), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    if jax.sharding.AxisType.Explicit not in getattr(mesh, "axis_types", ()):
        return None
    return sharding.spec


def batch_entry(values: Sequence[Any]) -> Any:
    """How the batch axis (axis 0) of ``values`` is sharded over an explicit mesh.

    The entry of the batched residuals' specs (the batch the user sharded, say over
    ``"data"``) when they all agree, else ``None`` (unsharded): the operands are then all
    resharded to it.
    """
    entries = set()
    for value in values:
        spec = explicit_spec(value)
        if spec is None:
            continue
        entries.add(spec[0] if len(spec) else None)
    return entries.pop() if len(entries) == 1 else None


def with_batch_entry(value: Any, entry: Any) -> Any:
    """``value`` with its axis 0 sharded as ``entry`` (on an explicit mesh; else as it is)."""
    spec = explicit_spec(value)
    if spec is None or np.ndim(value) == 0:
        return value
    rest = tuple(spec[1:]) + (None,) * (np.ndim(value) - max(len(spec), 1))
    if (spec[0] if len(spec) else None) == entry:
        return value
    return jax.sharding.reshard(value, jax.sharding.PartitionSpec(entry, *rest))


def batched_aval(aval: Any, size: int, entry: Any = None) -> Any:
    """``aval`` with a leading batch axis of ``size`` sharded as ``entry`` (``None``:
    unsharded), keeping its variance."""
    shape = (size, *aval.shape)
    sharding = getattr(aval, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return jax.core.ShapedArray(shape, aval.dtype, weak_type=aval.weak_type)
    spec = jax.sharding.PartitionSpec(entry, *sharding.spec)
    return aval.update(shape=shape, sharding=jax.sharding.NamedSharding(sharding.mesh, spec))
