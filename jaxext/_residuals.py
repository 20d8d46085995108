"""Residuals whose layout does not depend on which inputs are differentiated.

With ``symbolic_zeros=True`` a forward rule learns which inputs are perturbed and
can save only what their gradients need. But JAX (0.10) records the residual
pytree structure and which residuals are forwarded inputs *once per traced
custom_vjp call*: when a jitted function containing the call is reused inside one
differentiated trace with a different set of perturbed inputs (two layers sharing a
jitted helper, say), the backward of one use is handed the layout of the other.
The result is an internal ``AssertionError`` or, when the leaf counts happen to
agree, a silently wrong gradient (see jax-ml/jax#16614 for a relative).

So every jaxext forward rule packs its residuals here:

* which inputs are perturbed travels in the *shape* of a zero-byte token array, a
  fresh value per call, never in the (shared) pytree structure;
* the arrays saved must form the same structure, with the same inputs forwarded,
  whatever is perturbed. jaxext's ops therefore always save references to their
  input arrays (no copies: under ``jit`` XLA drops whatever the backward does not
  read) and use the flags to compute only the wanted gradients; ``jaxext.Function``
  saves user values, so it copies them (``copy=True``) to rule forwarding out;
* the static part is fingerprinted into the token, and :func:`unpack` raises if the
  structure it receives is not the one its own forward produced (possible only for
  user code, e.g. a ``jaxext.Function`` whose saved values depend on
  ``needs_input_grad``), rather than returning a wrong gradient.
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


def _fingerprint(static: Any) -> int:
    treedef = jax.tree_util.tree_structure(static)
    return zlib.crc32(repr(treedef).encode()) % _FINGERPRINT_MOD


def pack(
    perturbed: Sequence[bool], saved: Sequence[jax.Array], static: Any, *, copy: bool = False
) -> tuple:
    """Builds residuals ``(token, saved arrays, static)`` with a perturbation-free layout.

    Args:
        perturbed: one flag per differentiable input.
        saved: arrays for the backward; their number, and which of them are the
            rule's own inputs, must not depend on ``perturbed``.
        static: trace-time data (e.g. a ``Static``); it should not depend on
            ``perturbed`` (the token carries that).
        copy: save copies, so that no residual is a forwarded input (for saved
            values chosen by user code). XLA elides the copies under ``jit``.

    Returns:
        The residual pytree to return from a forward rule.
    """
    token = jnp.zeros((*(int(bool(p)) for p in perturbed), _fingerprint(static), 0), jnp.int8)
    arrays = tuple(jnp.array(a, copy=True) if copy else a for a in saved)
    return token, arrays, static


def unpack(residuals: tuple, owner: str) -> tuple[tuple[bool, ...], tuple, Any]:
    """Inverse of :func:`pack`: ``(perturbed flags, saved arrays, static)``.

    Raises:
        ResidualLayoutError: if the residual structure is not the one this call's
            forward rule produced.
    """
    token, arrays, static = residuals
    *flags, fingerprint, _ = token.shape
    if fingerprint != _fingerprint(static):
        raise ResidualLayoutError(
            f"{owner}: the backward received residuals laid out for another call of the same "
            "rule. This happens when a jitted function is reused within one differentiated "
            "computation with different inputs being differentiated, and the forward saves a "
            "differently structured set of values depending on which are (e.g. on "
            "`ctx.needs_input_grad`). Save the same structure whatever is differentiated "
            "(use None for values you do not need)."
        )
    return tuple(bool(f) for f in flags), arrays, static
