"""Which engine runs a check: the one reader of the thresholds that choose it.

A check's verdict and report come from what it compares, which is fixed by the
reference path: ``_jacobians.FlatJacobians`` (plain ``jax.jit`` programs, each
compiled at its first call) and ``_compare.full_mismatches`` (every entry of the
numerical Jacobian against every entry of the automatic one, held and compared a
chunk at a time), as in PyTorch's ``_slow_gradcheck``. The engines compare the
same entries with the same test, and only make a check faster:

* ``"reference"``: the reference path itself (only where ``FORCE`` asks for it).
* ``"quick"`` (``_quick``): the programs compiled quickly (LLVM's optimisations off
  where their runs compute at most ``QUICK_MAX_WORK`` entries) and side by side before
  their first call; a small problem (``MERGE_MAX_ENTRIES``, reverse mode checked)
  compiles its loops as one program. What every check below ``SCREEN_MIN_ENTRIES``
  runs, and opcheck's programs too.
* ``"screened"`` (``_screened``): the quick engine's programs, and each chunk screened
  on the device first, by worker threads, for the full method from
  ``SCREEN_MIN_ENTRIES`` Jacobian entries up.

``choose`` is the only function that reads the thresholds; tests lower them (or set
``FORCE``) to run an engine on small problems and compare it with the reference
path. Sizes that are not a choice of engine stay with the code they bound: the
chunks' rows and entries (``_jacobians.CHUNK``, ``CHUNK_ENTRIES``), the numerical
columns held at once (``_compare.TILE_BYTES``), the screened engine's threads
(``_screened.WORKERS``), and gradcheck's method (``_gradients.FULL_MAX_ENTRIES``:
the full or the directional method, which compare different things).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .. import _compare
from .._jacobians import FlatJacobians, chunk_size
from . import _screened
from ._quick import QuickJacobians, entries, quick_jit

__all__ = [
    "ENGINES",
    "FORCE",
    "MERGE_MAX_ENTRIES",
    "QUICK_MAX_WORK",
    "SCREEN_MIN_ENTRIES",
    "Engine",
    "choose",
    "jacobians",
]

# Most entries computed by the runs of a check's programs for them to compile quickly.
QUICK_MAX_WORK = 2**23
# Most entries of a chunk of columns plus a chunk of rows for one merged program.
MERGE_MAX_ENTRIES = 2**18
# Jacobians from this many entries up are screened chunk by chunk on the device.
SCREEN_MIN_ENTRIES = 2**22
ENGINES = ("reference", "quick", "screened")
# An engine that every check runs whatever its size (``None``: ``choose`` picks one).
FORCE: str | None = None


@dataclasses.dataclass(frozen=True)
class Engine:
    """How a check runs: which engine, and its choices for this problem.

    Attributes:
        name: one of ``ENGINES``.
        quick: compile with LLVM's optimisations off (the quick and screened engines).
        merge: compile the differences and VJPs as one program (quick engine).
        merge_forward: with ``merge``, the JVPs in that program too.
    """

    name: str
    quick: bool = False
    merge: bool = False
    merge_forward: bool = False

    def jit(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``jax.jit(fn)`` as this engine compiles it (for a top-level program)."""
        return jax.jit(fn) if self.name == "reference" else quick_jit(fn, self.quick)

    def jacobians(self, f: Callable, x0: jax.Array, vjp: Callable, m: int) -> FlatJacobians:
        """The ``FlatJacobians`` of ``f`` at ``x0`` on this engine.

        The differences that ``_fd_error.refine`` evaluates come from a program compiled
        quickly (``quick_jit(..., quick=True)``) on every engine: the check's own where
        its engine compiles it so, else one built for them (``refine_jit``), so that a
        refined entry is judged and reported alike whichever engine runs the check.
        """
        refine_jit = None if self.quick else functools.partial(quick_jit, quick=True)
        if self.name == "reference":
            return FlatJacobians(f, x0, vjp, m=m, refine_jit=refine_jit)
        if self.name == "screened":
            return _screened.ScreenedJacobians(
                f, x0, vjp, m=m, quick=self.quick, refine_jit=refine_jit
            )
        return QuickJacobians(
            f, x0, vjp, m=m, quick=self.quick, merge=self.merge,
            merge_forward=self.merge_forward, refine_jit=refine_jit,
        )  # fmt: skip

    def compile_ahead(self, jac: FlatJacobians, forward: bool) -> None:
        """Starts compiling ``jac``'s programs before their first use (not the reference
        path's: each compiles at its first call)."""
        if isinstance(jac, QuickJacobians):
            jac.compile_ahead(forward=forward)

    @property
    def full_mismatches(self) -> Callable[..., dict[str, list[_compare.Mismatch]]]:
        """The entrywise comparison of the full method on this engine."""
        if self.name == "screened":
            return functools.partial(_compare.full_mismatches, chunks=_screened.ScreenedChunks)
        return _compare.full_mismatches


def choose(
    work: int, n: int = 0, m: int = 0, *, full: bool = False, modes: Sequence[str] = ()
) -> Engine:
    """The engine of a check: the only reader of ``QUICK_MAX_WORK``,
    ``MERGE_MAX_ENTRIES``, ``SCREEN_MIN_ENTRIES`` (and of ``FORCE``).

    Args:
        work: the entries the check's programs compute in its runs, estimated
            (``_quick.entries`` of the function's jaxpr times its evaluations).
        n, m: the Jacobian's inputs and outputs (gradcheck); 0 for opcheck's programs.
        full: whether the full method may run (gradcheck's ``fast_mode`` is not
            ``True``); only then is a large problem screened.
        modes: the modes checked; a merged program only where ``"rev"`` is one (it
            traces the VJP first, and forward mode alone must work without one), with
            the JVPs too where ``"fwd"`` is also.

    Returns:
        The engine: ``"screened"`` for the full method from ``SCREEN_MIN_ENTRIES``
        entries up, else ``"quick"``; ``FORCE`` where set.

    Example:
        >>> from jaxext._checks._engines import choose
        >>> choose(work=10**5, n=100, m=100, full=True, modes=("rev",))
        Engine(name='quick', quick=True, merge=True, merge_forward=False)
        >>> choose(work=10**9, n=4000, m=3000, full=True, modes=("rev",)).name
        'screened'
    """
    if FORCE is not None and FORCE not in ENGINES:
        raise ValueError(f"FORCE must be None or one of {ENGINES}; got {FORCE!r}.")
    if FORCE == "reference":
        return Engine("reference")
    quick = work <= QUICK_MAX_WORK
    if FORCE == "screened" or (FORCE is None and full and n * m >= SCREEN_MIN_ENTRIES):
        return Engine("screened", quick=quick)
    merge = "rev" in modes
    merge_forward = merge and "fwd" in modes
    # The merged program's stacked outputs: a chunk of columns (twice, with the JVPs'),
    # a chunk of rows.
    columns = (2 if merge_forward else 1) * chunk_size(max(n, m)) * m
    merge = merge and columns + chunk_size(n) * n <= MERGE_MAX_ENTRIES
    return Engine("quick", quick=quick, merge=merge, merge_forward=merge and merge_forward)


def jacobians(
    f: Callable, x0: jax.Array, vjp: Callable, *, full: bool, modes: Sequence[str]
) -> tuple[Engine, FlatJacobians]:
    """The engine ``choose`` picks for the flat problem ``f`` at ``x0``, and its Jacobians.

    The work is estimated from ``f``'s jaxpr: ``2 n`` evaluations of ``f`` for the
    differences, ``m`` VJPs and ``n`` JVPs (a derivative costing about two).
    """
    jaxpr, shape = jax.make_jaxpr(f, return_shape=True)(x0)
    n, m = int(x0.shape[0]), int(shape.shape[0])
    engine = choose(4 * (n + m) * entries(jaxpr), n, m, full=full, modes=modes)
    return engine, engine.jacobians(f, x0, vjp, m)
