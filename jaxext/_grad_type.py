"""`grad_type`: the shape, dtype and sharding a custom VJP's gradient must have."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec
from jax.typing import ArrayLike

__all__ = ["grad_type"]


def grad_type(x: ArrayLike) -> jax.ShapeDtypeStruct:
    """The type the gradient of ``x`` must have: ``x``'s shape and dtype, its cotangent's sharding.

    Call it in a custom VJP's forward on each input, keep the result with the
    residuals (it is static data, not an array), and in the backward give each
    gradient that type: pass its ``sharding`` as ``out_sharding`` to the matmuls
    and reductions that produce the gradient, and cast to its ``dtype``. That is
    what JAX's own autodiff does: the sharding of a cotangent is a function of
    its primal's sharding (sharded stays sharded, replicated stays replicated, a
    weight marked ``reduced`` over a mesh axis gets an ``unreduced`` gradient).
    Inside ``jax.set_mesh``, an input that was never placed on the mesh (a NumPy
    array, or a ``jnp`` array created outside the mesh) gets a gradient replicated
    over the mesh, again as autodiff gives it.

    Without the sharding a backward is ambiguous in explicit-axis meshes: the
    weight gradient of a data-parallel matmul contracts the batch-sharded axis,
    and JAX refuses a contraction over a sharded axis whose output sharding is
    not given.

    Args:
        x: an input of the op (an array or tracer), as the forward sees it.

    Returns:
        A ``jax.ShapeDtypeStruct`` with ``x``'s shape and dtype and the sharding
        (a ``NamedSharding``, possibly on an abstract mesh) of ``x``'s cotangent.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import jaxext
        >>> t = jaxext.grad_type(jnp.ones((2, 3), jnp.bfloat16))
        >>> t.shape, t.dtype
        ((2, 3), dtype(bfloat16))
    """
    aval = jax.typeof(x)
    # The cotangent type (reduced -> unreduced). Where a JAX lacks `to_ct_aval`, the
    # primal's own sharding: the cotangent's for all but reduced arrays.
    cotangent = aval.to_ct_aval() if hasattr(aval, "to_ct_aval") else aval
    sharding = cotangent.sharding
    mesh = jax.sharding.get_abstract_mesh()
    if sharding.mesh.empty and not mesh.empty:
        # Not placed on the mesh in use: autodiff replicates its gradient over it.
        sharding = NamedSharding(mesh, PartitionSpec())
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding)
