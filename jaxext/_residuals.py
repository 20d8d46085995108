"""Residuals that hold only what the backward needs, in a layout JAX can cache.

With ``symbolic_zeros=True`` a forward rule learns which inputs are perturbed and
can save only what their gradients need. But JAX (0.10) records the residual
*pytree structure* once per traced custom_vjp call: when a jitted function
containing the call is reused inside one differentiated trace with a different
set of perturbed inputs (two layers sharing a jitted helper, say), the backward of
one use is handed the structure recorded for the other. With ``None`` for an
unneeded residual that is an internal ``AssertionError`` or, when the leaf counts
happen to agree, a silently wrong gradient (see jax-ml/jax#16614 for a relative).
The residual *values* and their shapes, on the other hand, come from a forward
traced per perturbation pattern, so they are always right.

So every jaxext forward rule packs its residuals here, and what varies with the
perturbation pattern varies only in shapes, never in structure:

* an unneeded residual (``None``) is stored as a zero-size placeholder array, so
  the structure is the same whatever is perturbed, and nothing unneeded is kept;
* which inputs are perturbed and which slots are filled travel in the *shape* of a
  zero-byte token array;
* the token also carries a fingerprint of the static part and of the saved shapes
  and dtypes: :func:`unpack` recomputes it and raises if the residuals it receives
  are not the ones its own forward produced (possible for user code, e.g. a
  ``jaxext.Function`` whose non-array ``ctx`` attributes depend on
  ``needs_input_grad``), rather than return a wrong gradient.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["ResidualLayoutError", "pack", "unpack"]

_FINGERPRINT_MOD = 1 << 16


class ResidualLayoutError(RuntimeError):
    """The backward received residuals laid out for another call of the same rule."""


def _placeholder() -> jax.Array:
    return jnp.zeros((0,), jnp.int8)


def _fingerprint(saved: Sequence[jax.Array | None], static: Any) -> int:
    types = [None if a is None else (tuple(map(str, a.shape)), str(a.dtype)) for a in saved]
    text = repr((jax.tree_util.tree_structure(static), types))
    return zlib.crc32(text.encode()) % _FINGERPRINT_MOD


def pack(
    perturbed: Sequence[bool],
    saved: Sequence[jax.Array | None],
    static: Any,
) -> tuple:
    """Builds residuals ``(token, saved arrays, static)`` whose structure is perturbation-free.

    Args:
        perturbed: one flag per differentiable input.
        saved: one entry per slot: an array the backward needs, or ``None``. The
            number of slots must not depend on ``perturbed``.
        static: trace-time data (e.g. a ``Static``); it should not depend on
            ``perturbed`` (the token carries that).

    Returns:
        The residual pytree to return from a forward rule.
    """
    present = tuple(a is not None for a in saved)
    flags = (*(int(bool(p)) for p in perturbed), *map(int, present))
    token = jnp.zeros((*flags, _fingerprint(saved, static), 0), jnp.int8)
    arrays = tuple(_placeholder() if a is None else a for a in saved)
    return token, arrays, static


def unpack(residuals: tuple, owner: str) -> tuple[tuple[bool, ...], tuple, Any]:
    """Inverse of :func:`pack`: ``(perturbed flags, saved arrays or None, static)``.

    Raises:
        ResidualLayoutError: if the residuals are not the ones this call's forward
            rule produced.
    """
    token, arrays, static = residuals
    *flags, fingerprint, _ = token.shape
    n_perturbed = len(flags) - len(arrays)
    present = flags[n_perturbed:] if n_perturbed >= 0 else ()
    saved = tuple(a if p else None for a, p in zip(arrays, present, strict=False))
    if len(present) != len(arrays) or fingerprint != _fingerprint(saved, static):
        raise ResidualLayoutError(
            f"{owner}: the backward received residuals laid out for another call of the same "
            "rule. This happens when a jitted function is reused within one differentiated "
            "computation with different inputs being differentiated, and the forward saves a "
            "differently structured set of values depending on which are (e.g. non-array "
            "`ctx` attributes that depend on `ctx.needs_input_grad`). Keep the structure the "
            "same whatever is differentiated (use None for arrays you do not need)."
        )
    return tuple(bool(f) for f in flags[:n_perturbed]), saved, static
