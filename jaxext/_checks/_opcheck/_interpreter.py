"""Failures of Pallas itself (its TPU interpreter, its Mosaic lowering), not of the op it
runs (issue #43).

JAX's TPU interpreter (``pltpu.force_tpu_interpret_mode``) runs a TPU kernel on a CPU, one
host callback per grid step. Two of its own defects surface as exceptions in checks of a
correct op, whatever the op computes; both are recognised where they are raised, in the
interpreter's code, and the op's plain twin cannot stand in as evidence (plain JAX cannot
differentiate a Pallas kernel at all):

- under ``jax.vmap`` the batched kernel's grid gains a dimension that its
  ``dimension_semantics`` lack, and the interpreter's ``_get_randomized_grid_coordinates``
  zips the two (``ValueError`` from ``safe_zip``);
- under ``jax_enable_x64`` it hands a kernel an int64 value where the kernel's own jaxpr
  declares int32 (a ``TypeError`` of an equation whose inputs are all declared int32: a
  mismatch no kernel can cause, its jaxpr being type-checked when traced).

And where lowering a kernel fails Pallas's own verification of what it generated, Pallas
says so itself ("internal verification error. Please file a bug"): its bug, not the op's.
"""

from __future__ import annotations

import types
from collections.abc import Iterator

import numpy as np

__all__ = ["interpreter_limit"]

_INTERPRETER = ("pallas", "mosaic", "interpret")
_PALLAS_BUG = "Pallas encountered an internal verification error"


def interpreter_limit(err: BaseException) -> str | None:
    """A SKIP reason where ``err`` (or an exception it was raised from) is one of Pallas's
    own defects (the module docstring); else ``None``."""
    for exc in _chain(err):
        if _PALLAS_BUG in str(exc):
            return (
                "Pallas's lowering fails its own verification of the kernel it generated "
                f"(JAX's bug, as Pallas says: {type(exc).__name__}: "
                f"{' '.join(str(exc).split())[:300]})"
            )
        for frame in _frames(exc.__traceback__):
            if not all(part in frame.f_code.co_filename for part in _INTERPRETER):
                continue
            line = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            if frame.f_code.co_name == "_get_randomized_grid_coordinates":
                return (
                    "Pallas's TPU interpreter cannot run the op's kernel under jax.vmap (JAX's "
                    "limit: the batched grid gains a dimension its dimension_semantics lack; "
                    f"{type(exc).__name__}: {line})"
                )
            if isinstance(exc, TypeError) and "int64" in str(exc) and _declared_int32(frame):
                return (
                    "Pallas's TPU interpreter under jax_enable_x64 gives the op's kernel an "
                    "int64 value where the kernel's jaxpr declares int32 (JAX's limit, not "
                    f"the op's: {type(exc).__name__}: {line})"
                )
    return None


def _declared_int32(frame: types.FrameType) -> bool:
    """Whether the equation the interpreter was evaluating in ``frame`` takes only values
    its jaxpr declares int32."""
    eqn = frame.f_locals.get("eqn")
    avals = [getattr(v, "aval", None) for v in getattr(eqn, "invars", ())]
    dtypes = [getattr(a, "dtype", None) for a in avals]
    return bool(dtypes) and all(d == np.dtype(np.int32) for d in dtypes)


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    stack = [err]
    while stack:
        exc = stack.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        yield exc
        stack.extend((exc.__cause__, exc.__context__))


def _frames(tb: types.TracebackType | None) -> Iterator[types.FrameType]:
    while tb is not None:
        yield tb.tb_frame
        tb = tb.tb_next
