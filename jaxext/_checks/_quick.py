"""Compiling the checks' programs quickly.

Most of a check's time on a small op is XLA compiling its programs, not running
them. On the CPU, most of a compilation is generating and optimising the code of
the fused loops; for a few thousand entries the optimised loops save
microseconds and their optimisation costs milliseconds. ``quick_jit`` compiles a
program with LLVM's optimisations off and, where XLA still has them, its older
(simpler) loop emitters instead of the MLIR-based fusion emitters (XLA's
graph-level passes, fusion among them, still run; dots and convolutions still
call their library kernels) when the work that its runs in one check do is at most
``QUICK_MAX_WORK`` entries computed. A program with more work keeps LLVM's
optimisations but also takes the older emitters where XLA has them: they halve
its compile time too, and its loops ran as fast (those of gradcheck's full method
on a linear layer, 5e7 and 1.5e8 Jacobian entries). Options that this XLA does not know
are left out (found once per process, by compiling a trivial program); without
any, a program compiles as ``jax.jit`` does.

The work is estimated from the function's jaxpr (``entries``: every entry of
every value it computes, a loop's body counted once) times the evaluations a
check makes. Without LLVM's vectorisation an elementwise loop runs two to three
times slower (measured on a chain of transcendental functions: about 3 ns more
per entry); at ``2**23`` entries that is some 25 ms per check, less than the
compile time saved (tens of milliseconds per program, several programs per
check). Results differ only by rounding (no fast-math either way): every
comparison between two programs allows for that (``TIGHT``, gradcheck's
tolerances).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

__all__ = ["QUICK_MAX_WORK", "entries", "quick_jit"]

# Most entries computed by the runs of a check's programs for them to compile quickly.
QUICK_MAX_WORK = 2**23
# LLVM at -O0 and without its expensive passes (XLA's CPU backend reads both), and the
# older loop emitters (an option of XLA's CPU backend until it dropped them): tried in
# this order, the first set this XLA compiles with is used.
_LLVM = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
_OLDER_EMITTERS = {"xla_cpu_use_fusion_emitters": False}
_CANDIDATES = ({**_LLVM, **_OLDER_EMITTERS}, _LLVM)
# A program with more work keeps LLVM's optimisations, with the older loop emitters.
_LARGE_CANDIDATES = (_OLDER_EMITTERS,)


def _on_cpu() -> bool:
    """Whether programs compile for the CPU (the default device, or backend)."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend() == "cpu"
    platform = device if isinstance(device, str) else device.platform
    return platform.lower() == "cpu"


@functools.cache
def _options(large: bool = False) -> dict[str, Any] | None:
    """The first of ``_CANDIDATES`` (``_LARGE_CANDIDATES``) that the CPU backend
    accepts, or ``None``."""
    with jax.default_device(jax.devices("cpu")[0]):
        for options in _LARGE_CANDIDATES if large else _CANDIDATES:
            try:
                jax.jit(lambda x: x + 1, compiler_options=options).lower(np.float32(0)).compile()
            except Exception:  # noqa: BLE001 -- an option this XLA does not know
                continue
            return options
    return None


def _jaxprs(value: Any) -> list:
    """The jaxprs in an equation's parameter (a jaxpr, a closed one, or a sequence)."""
    if hasattr(value, "eqns"):
        return [value]
    if hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        return [value.jaxpr]
    if isinstance(value, (tuple, list)):
        return [j for item in value for j in _jaxprs(item)]
    return []


def entries(jaxpr: Any) -> int:
    """The entries of a jaxpr's inputs and of every value its equations compute, those
    of nested jaxprs (loop bodies, branches, custom rules) counted once.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxext._checks._quick import entries
        >>> entries(jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(jnp.ones(3)))
        9
    """
    jaxpr = jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr
    total = sum(int(np.prod(getattr(v.aval, "shape", ()))) for v in jaxpr.invars)
    for eqn in jaxpr.eqns:
        total += sum(int(np.prod(getattr(v.aval, "shape", ()))) for v in eqn.outvars)
        for value in eqn.params.values():
            total += sum(entries(sub) for sub in _jaxprs(value))
    return total


def quick_jit(fn: Callable[..., Any], work: int) -> Any:
    """``jax.jit(fn)``, compiled quickly where the program compiles for the CPU: with
    LLVM's optimisations off where ``work`` (the entries computed by the check's runs
    of it, estimated) is at most ``QUICK_MAX_WORK``, with XLA's older loop emitters
    (where it has them) in any case.

    Only for a program called at the top level (not inside another ``jax.jit``: JAX
    refuses compiler options on a nested one).

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxext._checks._quick import quick_jit
        >>> print(quick_jit(lambda x: 2 * x, work=3)(jnp.arange(3.0)))
        [0. 2. 4.]
    """
    if _on_cpu():
        options = _options(large=work > QUICK_MAX_WORK)
        if options is not None:
            return jax.jit(fn, compiler_options=options)
    return jax.jit(fn)
