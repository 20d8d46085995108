"""How closely two programs of one op must agree: a tolerance from the dtypes it computes in.

Two programs that compute the same math (an op under ``jit`` and eagerly, under ``vmap``
and in a loop, checkpointed and plain) round differently. How much depends on the
precision the op computes in, not on the dtype of its inputs: a kernel that takes
float64 arrays but accumulates in float32 rounds like float32. So the tolerance is read
from the op's program: the floating-point dtypes of the values its jaxpr computes from
its inputs on their way to its outputs (data flow; inner jaxprs included: calls and
custom rules followed inside, loop bodies and a Pallas kernel's body counted whole), the
lowest precision among them setting it, as ``torch.testing.assert_close`` picks its
tolerance per dtype. A float32 constant or a float32 side value that reaches no output
does not round the results, and leaves a float64 op at float64's tolerance. The
comparisons are normwise per leaf (``max |a - e| <= rtol * max |e|``), so the table
allows a few times more than torch's elementwise ``rtol``:

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

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._jaxpr import call_body, inner_jaxprs

__all__ = ["RTOL", "computed_dtypes", "narrowest", "program_dtypes", "rtol_for"]

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
    """The real floating dtypes (complex ones as their real part's) of the values a jaxpr
    computes from its inputs on their way to its outputs.

    A value counts where it depends on an input and an output depends on it (data flow,
    forward from the inputs and back from the outputs): a float32 constant converted into
    a float64 computation, or a float32 side value that reaches no output, does not round
    the op's results, and does not count. Calls (``jit``, custom rules' primal functions)
    are followed inside; any other inner jaxpr (a loop's or branch's body, a Pallas
    kernel's, whose results are written to references) counts whole where its equation
    computes from an input for an output.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jaxext._checks._dtype_tolerance import computed_dtypes
        >>> with jax.enable_x64(True):
        ...     closed = jax.make_jaxpr(lambda x: jnp.sin(x.astype(jnp.float32)))(np.ones(3))
        ...     side = jax.make_jaxpr(lambda x: (jnp.sum(x.astype(jnp.float32)), jnp.sin(x))[1])(
        ...         np.ones(3)
        ...     )
        >>> sorted(d.name for d in computed_dtypes(closed))
        ['float32', 'float64']
        >>> sorted(d.name for d in computed_dtypes(side))
        ['float64']
    """
    jaxpr = jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") and hasattr(jaxpr.jaxpr, "eqns") else jaxpr
    found, _ = _flow(jaxpr, [True] * len(jaxpr.invars), [True] * len(jaxpr.outvars))
    return frozenset(found)


def program_dtypes(
    fn: Callable[..., Any], primals: Sequence[Any], cotangent: Any, *, forward: bool
) -> frozenset[np.dtype]:
    """``computed_dtypes`` of an op's programs: its value at ``primals``, its VJP for
    ``cotangent`` (a pytree like its output; its float leaves are inputs of the program,
    data as much as ``primals``) and, with ``forward``, its JVP. A program that fails to
    trace adds none (the checks that run it report its error).

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jaxext._checks._dtype_tolerance import program_dtypes
        >>> def op(x):  # float64 forward, a backward that rounds its cotangent to float32
        ...     f = jax.custom_vjp(jnp.sin)
        ...     f.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: ((g.astype(jnp.float32) * 2),))
        ...     return f(x)
        >>> with jax.enable_x64(True):
        ...     x = np.ones(3)
        ...     found = program_dtypes(op, [x], np.ones(3), forward=False)
        >>> sorted(d.name for d in found)
        ['float32', 'float64']
    """
    primals = tuple(primals)
    leaves, treedef = jax.tree_util.tree_flatten(cotangent)
    floats = [i for i, leaf in enumerate(leaves) if jnp.issubdtype(leaf.dtype, jnp.inexact)]

    def vjp(primals, given):
        full = list(leaves)
        for i, value in zip(floats, given, strict=True):
            full[i] = value
        return jax.vjp(fn, *primals)[1](jax.tree_util.tree_unflatten(treedef, full))

    programs = [(fn, primals), (vjp, (primals, [leaves[i] for i in floats]))]
    if forward:
        programs.append((lambda *p: jax.jvp(fn, p, p)[1], primals))
    found: set[np.dtype] = set()
    for program, args in programs:
        try:
            found |= computed_dtypes(jax.make_jaxpr(program)(*args))
        except Exception:  # noqa: BLE001 -- reported by the checks that run it
            continue
    return frozenset(found)


def _is_var(var: Any) -> bool:
    """Whether ``var`` is a variable (not a literal), which data can flow through."""
    return not hasattr(var, "val")


def _dtype_of(var: Any) -> np.dtype | None:
    dtype = getattr(getattr(var, "aval", None), "dtype", None)
    return None if dtype is None else _real(dtype)


def _every_dtype(jaxpr: Any) -> set[np.dtype]:
    """The real floating dtypes of every value of ``jaxpr`` and its inner jaxprs."""
    found = {_dtype_of(v) for v in (*jaxpr.invars, *(o for e in jaxpr.eqns for o in e.outvars))}
    for eqn in jaxpr.eqns:
        for body in inner_jaxprs(eqn):
            found |= _every_dtype(body.jaxpr)
    return found - {None}


def _flow(jaxpr: Any, tainted_in: list[bool], live_out: list[bool]) -> tuple[set, list[bool]]:
    """``computed_dtypes`` of ``jaxpr`` whose inputs flagged in ``tainted_in`` come from
    the op's inputs and whose outputs flagged in ``live_out`` reach its outputs; also which
    of its inputs reach those outputs."""
    tainted = {v for v, t in zip(jaxpr.invars, tainted_in, strict=True) if t}
    from_input = []
    for eqn in jaxpr.eqns:  # forward: what is computed from an input
        hit = any(_is_var(v) and v in tainted for v in eqn.invars)
        from_input.append(hit)
        if hit:
            tainted.update(eqn.outvars)
    needed = {v for v, live in zip(jaxpr.outvars, live_out, strict=True) if live and _is_var(v)}
    found: set = set()
    for eqn, hit in zip(reversed(jaxpr.eqns), reversed(from_input), strict=True):  # backward
        live = [v in needed for v in eqn.outvars]
        if not any(live):
            continue
        body = call_body(eqn)
        if body is not None:
            inner_tainted = [_is_var(v) and v in tainted for v in eqn.invars]
            inner, reaching = _flow(body.jaxpr, inner_tainted, live)
            found |= inner
        else:
            reaching = [True] * len(eqn.invars)
            if hit:
                for inner_body in inner_jaxprs(eqn):
                    found |= _every_dtype(inner_body.jaxpr)
        needed.update(v for v, r in zip(eqn.invars, reaching, strict=True) if r and _is_var(v))
        found.update(
            _dtype_of(v) for v, is_live in zip(eqn.outvars, live, strict=True) if is_live and hit
        )
    found.update(_dtype_of(v) for v in jaxpr.invars if v in needed and v in tainted)
    reaching_in = [v in needed for v in jaxpr.invars]
    return found - {None}, reaching_in


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
