"""How closely two programs of one op must agree: a tolerance from the dtypes it computes in.

Two programs that compute the same math (an op under ``jit`` and eagerly, under ``vmap``
and in a loop, checkpointed and plain) round differently. How much depends on the
precision the op computes in, not on the dtype of its inputs: a kernel that takes
float64 arrays but accumulates in float32 rounds like float32. So the tolerance is read
from the op's program: the floating-point dtypes of every value its jaxpr computes
(inner jaxprs included: loop bodies, custom rules, a Pallas kernel's body), the
lowest precision among them setting it, as ``torch.testing.assert_close`` picks its
tolerance per dtype. The comparisons are normwise per leaf
(``max |a - e| <= rtol * max |e|``), so the table allows a few times more than torch's
elementwise ``rtol``:

========  ============  ==========================================
dtype     ``rtol``      (torch's ``assert_close`` ``rtol``, ``atol``)
========  ============  ==========================================
float64   ``1e-9``      (``1e-7``, ``1e-7``): far below any bug
float32   ``1e-5``      (``1.3e-6``, ``1e-5``)
float16   ``4e-3``      (``1e-3``, ``1e-5``)
bfloat16  ``3.2e-2``    (``1.6e-2``, ``1e-5``)
========  ============  ==========================================

A complex dtype counts as its real part's (complex64 as float32).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._jaxpr import inner_jaxprs

__all__ = ["RTOL", "computed_dtypes", "narrowest", "rtol_for"]

# Normwise relative tolerance between two programs of an op that computes in each dtype.
RTOL: dict[np.dtype, float] = {
    np.dtype(jnp.float64): 1e-9,
    np.dtype(jnp.float32): 1e-5,
    np.dtype(jnp.float16): 4e-3,
    np.dtype(jnp.bfloat16): 3.2e-2,
}


def _real(dtype: Any) -> np.dtype | None:
    """The real floating dtype of ``dtype`` (complex64 -> float32), else ``None`` (an
    integer, a PRNG key, ``float0``: not a computed float)."""
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return None
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return np.dtype(jnp.finfo(dtype).dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return dtype
    return None


def computed_dtypes(jaxpr: Any) -> frozenset[np.dtype]:
    """The real floating dtypes of a jaxpr's inputs and of every value it computes,
    nested jaxprs included (complex ones as their real part's).

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jaxext._checks._dtype_tolerance import computed_dtypes
        >>> with jax.enable_x64(True):
        ...     closed = jax.make_jaxpr(lambda x: jnp.sin(x.astype(jnp.float32)))(np.ones(3))
        >>> sorted(d.name for d in computed_dtypes(closed))
        ['float32', 'float64']
    """
    jaxpr = jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") and hasattr(jaxpr.jaxpr, "eqns") else jaxpr
    found: set[np.dtype] = set()
    for var in (*jaxpr.invars, *(v for eqn in jaxpr.eqns for v in eqn.outvars)):
        dtype = getattr(getattr(var, "aval", None), "dtype", None)
        real = None if dtype is None else _real(dtype)
        if real is not None:
            found.add(real)
    for eqn in jaxpr.eqns:
        for body in inner_jaxprs(eqn):
            found |= computed_dtypes(body.jaxpr)
    return frozenset(found)


def narrowest(dtypes: Iterable[Any]) -> np.dtype | None:
    """The dtype of least precision (largest machine epsilon) among ``dtypes``.

    Example:
        >>> import numpy as np
        >>> from jaxext._checks._dtype_tolerance import narrowest
        >>> narrowest([np.float64, np.float32]).name
        'float32'
    """
    reals = [r for r in (_real(d) for d in dtypes) if r is not None]
    return max(reals, key=lambda d: float(jnp.finfo(d).eps), default=None)


def rtol_for(dtypes: Iterable[Any]) -> float:
    """The normwise relative tolerance between two programs of an op computing in
    ``dtypes`` (``RTOL`` of the narrowest; ``RTOL[float64]`` where there is none).

    Example:
        >>> import numpy as np
        >>> from jaxext._checks._dtype_tolerance import rtol_for
        >>> rtol_for([np.float64]), rtol_for([np.float64, np.float32])
        (1e-09, 1e-05)
    """
    dtype = narrowest(dtypes)
    if dtype is None:
        return RTOL[np.dtype(jnp.float64)]
    if dtype in RTOL:
        return RTOL[dtype]
    # Another float (float8 ...): scaled from float32's by the machine epsilons.
    return RTOL[np.dtype(jnp.float32)] * float(jnp.finfo(dtype).eps / jnp.finfo(jnp.float32).eps)
