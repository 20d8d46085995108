"""Compiling the checks' programs for small problems quickly.

Most of a check's time on a small op is XLA compiling its programs, not running
them. On the CPU, most of a compilation is generating and optimising the code of
the fused loops; for a few thousand entries the optimised loops save
microseconds and their optimisation costs milliseconds. ``quick_jit`` compiles a
program with LLVM's optimisations off and, where XLA still has them, its older
(simpler) loop emitters instead of the MLIR-based fusion emitters (XLA's
graph-level passes, fusion among them, still run; dots and convolutions still
call their library kernels) when the problem has at most ``QUICK_MAX_ENTRIES``
entries, and as ``jax.jit`` does otherwise. Options that this XLA does not know
are left out (found once per process, by compiling a trivial program).

Without LLVM's vectorisation an elementwise loop runs a few times slower: at
``2**16`` float64 entries (512 KiB) that is well under a millisecond per pass,
less than the compile time saved (tens of milliseconds per program). Results
differ only by rounding (no fast-math either way): every comparison between two
programs allows for that (``TIGHT``, gradcheck's tolerances).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

__all__ = ["QUICK_MAX_ENTRIES", "quick_jit"]

# Most entries (inputs and outputs, or Jacobian entries) of a problem compiled quickly.
QUICK_MAX_ENTRIES = 2**16
# LLVM at -O0 and without its expensive passes (XLA's CPU backend reads both), and the
# older loop emitters (an option of XLA's CPU backend until it dropped them): tried in
# this order, the first set this XLA compiles with is used.
_LLVM = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
_CANDIDATES = ({**_LLVM, "xla_cpu_use_fusion_emitters": False}, _LLVM)


def _on_cpu() -> bool:
    """Whether programs compile for the CPU (the default device, or backend)."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend() == "cpu"
    platform = device if isinstance(device, str) else device.platform
    return platform.lower() == "cpu"


@functools.cache
def _options() -> dict[str, Any] | None:
    """The first of ``_CANDIDATES`` that the CPU backend accepts, or ``None``."""
    with jax.default_device(jax.devices("cpu")[0]):
        for options in _CANDIDATES:
            try:
                jax.jit(lambda x: x + 1, compiler_options=options).lower(np.float32(0)).compile()
            except Exception:  # noqa: BLE001 -- an option this XLA does not know
                continue
            return options
    return None


def quick_jit(fn: Callable[..., Any], entries: int) -> Any:
    """``jax.jit(fn)``, compiled quickly where ``entries`` (the problem's size) is at most
    ``QUICK_MAX_ENTRIES`` and the program compiles for the CPU.

    Only for a program called at the top level (not inside another ``jax.jit``: JAX
    refuses compiler options on a nested one).

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxext._checks._quick import quick_jit
        >>> print(quick_jit(lambda x: 2 * x, entries=3)(jnp.arange(3.0)))
        [0. 2. 4.]
    """
    if entries <= QUICK_MAX_ENTRIES and _on_cpu():
        options = _options()
        if options is not None:
            return jax.jit(fn, compiler_options=options)
    return jax.jit(fn)
