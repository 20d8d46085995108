"""Whether an op's error at a low-precision dtype is a refusal of that dtype or its bug.

An op traced with bfloat16 inputs can raise an error naming bfloat16 for two reasons:
it does not take that dtype (its own deliberate check, ``gmm``'s "Expected bfloat16 or
float32"; JAX's own refusal, a bfloat16 FFT), or its code is wrong at that dtype
(``lax.add`` of a bfloat16 input and a float32 constant: a dtype the op mixes in itself).
The checks SKIP only the first, on evidence:

* **deliberate**: the error is raised by the op's own code, not from inside JAX (the
  innermost frame of its traceback lies outside the ``jax`` and ``jaxlib`` packages);
* **JAX's own**: the op's math with *every* floating-point value in the dtype (its
  program traced at a dtype it takes, then replayed equation by equation with each
  floating operand cast to the dtype) raises too: JAX refuses the dtype for an operation
  of this math, whatever the op does. An error that the cast replay does not raise
  comes from dtypes the op mixes itself: its bug, left for the check to report.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._jaxpr import evaluate

__all__ = ["deliberate", "refused_by_jax", "tracing_error"]

_JAX_DIRS = tuple(
    os.path.dirname(os.path.abspath(module.__file__)) + os.sep
    for module in (jax, __import__("jaxlib"))
)


def tracing_error(fn: Callable, values: Sequence[Any]) -> Exception | None:
    """What ``jax.eval_shape(fn, *values)`` raises, with its whole traceback (JAX's
    traceback filtering off, so that ``deliberate`` sees where it was raised), or
    ``None``."""
    filtering = jax.config.jax_traceback_filtering
    jax.config.update("jax_traceback_filtering", "off")
    try:
        jax.eval_shape(fn, *values)
    except Exception as err:  # noqa: BLE001 -- returned to the caller to judge
        return err
    finally:
        jax.config.update("jax_traceback_filtering", filtering)
    return None


def deliberate(err: BaseException) -> bool:
    """Whether ``err`` (from ``tracing_error``) was raised by code outside JAX (the op's
    own check)."""
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return not os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_JAX_DIRS)


def refused_by_jax(fn: Callable, values: Sequence[Any], dtype: Any) -> bool:
    """Whether ``fn``'s math, with every floating-point value in ``dtype``, is refused by
    JAX: ``fn`` traced at the first of float32 and float64 it takes, then replayed with
    each floating operand of each operation cast to ``dtype`` (calls and custom rules'
    bodies inlined), raises. ``False`` when ``fn`` takes neither (no evidence)."""
    for wide in (jnp.float32, jnp.float64):
        cast = [
            jnp.asarray(v, wide) if jnp.issubdtype(jnp.result_type(v), jnp.floating) else v
            for v in values
        ]
        try:
            closed = jax.make_jaxpr(fn)(*cast)
        except Exception:  # noqa: BLE001 -- not taken at this dtype either: try the next
            continue
        try:
            jax.eval_shape(lambda *a, c=closed: _replay(c.jaxpr, c.consts, a, dtype), *values)
        except Exception:  # noqa: BLE001 -- the evidence: JAX refuses the dtype itself
            return True
        return False
    return False


def _cast(value: Any, dtype: Any) -> Any:
    if jnp.issubdtype(jnp.result_type(value), jnp.floating):
        return jnp.asarray(value, dtype)
    return value


def _replay(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], dtype: Any) -> list:
    """``jaxpr`` evaluated with each floating operand of each operation cast to ``dtype``
    (calls and custom rules' bodies inlined)."""
    return evaluate(jaxpr, consts, args, operand=lambda value: _cast(value, dtype))
