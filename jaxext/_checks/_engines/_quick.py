"""The quick engine: the checks' programs compiled quickly, and ahead of their first use.

Most of a check's time on a small op is XLA compiling its programs, not running
them. On the CPU, most of a compilation is generating and optimising the code of
the fused loops; for a few thousand entries the optimised loops save
microseconds and their optimisation costs milliseconds. ``quick_jit`` compiles a
program with LLVM's optimisations off and, where XLA still has them, its older
(simpler) loop emitters instead of the MLIR-based fusion emitters (XLA's
graph-level passes, fusion among them, still run; dots and convolutions still
call their library kernels) when the work that its runs in one check do is small
(``_engines.choose`` says so, from ``QUICK_MAX_WORK``). A program with more work
keeps LLVM's optimisations but also takes the older emitters where XLA has them:
they halve its compile time too, and its loops ran as fast (those of gradcheck's
full method on a linear layer, 5e7 and 1.5e8 Jacobian entries). Each option is
used only where this XLA accepts it: whether it does is found once per process,
by compiling a trivial program with it (JAX 0.10's XLA takes all three; JAX
0.12's refuses ``xla_cpu_use_fusion_emitters``, "No such compile option", and
its programs compile with the other two, or as ``jax.jit`` does).

The work is estimated from the function's jaxpr (``entries``: every entry of
every value it computes, a loop's body counted once) times the evaluations a
check makes. Without LLVM's vectorisation an elementwise loop runs two to three
times slower (measured on a chain of transcendental functions: about 3 ns more
per entry); at ``2**23`` entries that is some 25 ms per check, less than the
compile time saved (tens of milliseconds per program, several programs per
check). Results differ only by rounding (no fast-math either way): every
comparison between two programs allows for that (``TIGHT``, gradcheck's
tolerances).

``QuickJacobians`` is gradcheck's ``FlatJacobians`` on this engine, the one
``_engines.choose`` picks for problems below the screened engine's size: its
programs compile quickly, side by side before their first call
(``compile_ahead``), and a small problem (``MERGE_MAX_ENTRIES``) compiles its
loops as one program. Each runs through ``Program``, which also lets worker
threads run it (the screened engine's).
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._jaxpr import inner_jaxprs
from .._jacobians import FlatFn, FlatJacobians, basis_or

__all__ = ["Program", "QuickJacobians", "entries", "quick_jit"]

# LLVM at -O0 and without its expensive passes (XLA's CPU backend reads both), for
# programs with little work; the older loop emitters (an option of XLA's CPU backend
# until it dropped them), for all. Each set is used where this XLA accepts it.
_LLVM = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
_OLDER_EMITTERS = {"xla_cpu_use_fusion_emitters": False}


def _on_cpu() -> bool:
    """Whether programs compile for the CPU (the default device, or backend)."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend() == "cpu"
    platform = device if isinstance(device, str) else device.platform
    return platform.lower() == "cpu"


@functools.cache
def _accepted(options: tuple[tuple[str, Any], ...]) -> bool:
    """Whether the CPU backend compiles with ``options`` (probed once per process)."""
    with jax.default_device(jax.devices("cpu")[0]):
        try:
            jax.jit(lambda x: x + 1, compiler_options=dict(options)).lower(np.float32(0)).compile()
        except Exception:  # noqa: BLE001 -- an option this XLA does not know
            return False
    return True


def _options(large: bool = False) -> dict[str, Any] | None:
    """The compiler options of a quick program (``large``: of one with more work), of
    those this XLA accepts, or ``None`` where it accepts none."""
    options: dict[str, Any] = {}
    for wanted in (_OLDER_EMITTERS,) if large else (_LLVM, _OLDER_EMITTERS):
        if _accepted(tuple(wanted.items())):
            options.update(wanted)
    return options or None


def entries(jaxpr: Any) -> int:
    """The entries of a jaxpr's inputs and of every value its equations compute, those
    of nested jaxprs (loop bodies, branches, custom rules) counted once.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxext._checks._engines._quick import entries
        >>> entries(jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(jnp.ones(3)))
        9
    """
    jaxpr = jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr
    total = sum(int(np.prod(getattr(v.aval, "shape", ()))) for v in jaxpr.invars)
    for eqn in jaxpr.eqns:
        total += sum(int(np.prod(getattr(v.aval, "shape", ()))) for v in eqn.outvars)
        total += sum(entries(body.jaxpr) for body in inner_jaxprs(eqn))
    return total


def quick_jit(fn: Callable[..., Any], quick: bool) -> Any:
    """``jax.jit(fn)``, compiled quickly where the program compiles for the CPU: with
    LLVM's optimisations off where ``quick`` (little work: ``_engines.choose``), with
    XLA's older loop emitters (where it has them) in any case.

    Only for a program called at the top level (not inside another ``jax.jit``: JAX
    refuses compiler options on a nested one).

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxext._checks._engines._quick import quick_jit
        >>> print(quick_jit(lambda x: 2 * x, quick=True)(jnp.arange(3.0)))
        [0. 2. 4.]
    """
    if _on_cpu():
        options = _options(large=not quick)
        if options is not None:
            return jax.jit(fn, compiler_options=options)
    return jax.jit(fn)


def _signature(value: Any) -> Any:
    """What an executable compiled for ``value`` requires of an argument."""
    if isinstance(value, (bool, int, float)):
        return type(value)  # a weakly typed scalar
    return tuple(value.shape), np.dtype(value.dtype).str


class Program:
    """A ``jax.jit`` program, run through executables compiled ahead of time, so that
    worker threads can run it too.

    JAX's configuration (x64 above all, also the default device and matmul precision)
    is thread-local: a worker thread calling a jitted function would look it up, and
    trace it anew, under its own defaults (float32). ``bind`` compiles (or finds: JAX
    shares its cache with plain calls, so this costs no second compilation) the
    executable for the arguments' types in the thread that owns the check, under its
    configuration, and returns a function that runs it from any thread. Calls in the
    owning thread go through ``jax.jit`` itself (whatever JAX does there, as always:
    an op that leaks a tracer raises ``UnexpectedTracerError``, say).
    """

    def __init__(self, jitted: Callable) -> None:
        self.jitted = jitted
        self.executables: dict[tuple, Any] = {}
        self.owner = threading.get_ident()
        # A compilation started ahead (``ahead``): its signature and future.
        self.pending: tuple[tuple, concurrent.futures.Future] | None = None

    def ahead(self, args: tuple, future: concurrent.futures.Future) -> None:
        """Takes the compilation of the program for ``args``, started elsewhere."""
        self.pending = (tuple(_signature(a) for a in args), future)

    def _wait(self) -> None:
        """Waits for the compilation started ahead and keeps its executable for
        ``bind`` (an error is left to the call that follows, which compiles again
        and raises it)."""
        if self.pending is not None:
            key, future = self.pending
            self.pending = None
            if future.exception() is None:
                self.executables[key] = future.result()

    def bind(self, *args: Any) -> Callable:
        key = tuple(_signature(a) for a in args)
        if threading.get_ident() == self.owner:
            self._wait()
        executable = self.executables.get(key)
        if executable is None:
            if threading.get_ident() != self.owner:
                raise RuntimeError("a program was bound outside the thread that owns it")
            executable = self.executables[key] = self.jitted.lower(*args).compile()

        def run(*args):
            with jax.enable_x64(True):  # Python scalars are weakly typed 64-bit ones
                return executable(*args)

        return run

    def __call__(self, *args: Any) -> Any:
        """A plain call of the jitted program, in this thread."""
        self._wait()
        return self.jitted(*args)


def _jvp_loop(f: FlatFn, n: int, m: int, x, ks, count, extra) -> tuple:
    """``_jacobians.tangent_columns`` for the first ``count`` entries of ``ks`` (the rest
    are zero), as a loop (the merged program's)."""
    y, jvp_fn = jax.linearize(f, x)

    def body(i, cols):
        return cols.at[i].set(jvp_fn(basis_or(ks[i], n, extra)))

    return y, jax.lax.fori_loop(0, count, body, jnp.zeros((ks.shape[0], m)))


def _all_loops(
    differences, rows, f, n, m, x, kc, plus, minus, count_cols, kr, count_rows, extra, *forward
) -> tuple:
    """The merged program: the differences, the VJPs and (``forward``) the JVPs."""
    return (
        *differences(x, kc, plus, minus, count_cols),
        *rows(x, kr, count_rows, extra),
        *(_jvp_loop(f, n, m, x, *forward) if forward else ()),
    )


class QuickJacobians(FlatJacobians):
    """``FlatJacobians`` whose programs compile quickly (``quick_jit``), side by side
    ahead of their first call (``compile_ahead``), and, for a small problem, as one.

    Args:
        f, x0, vjp, m, refine_jit: as for ``FlatJacobians``.
        quick: compile with LLVM's optimisations off (little work; ``_engines.choose``).
        merge: compile the two loops (differences, VJPs) as one program (XLA's cost per
            program is a good part of a small check's time); each call runs one of the
            loops, the others for zero rows (their outputs, zeros, are small then). That
            traces the VJP whichever method runs first, so it is for reverse-mode checks.
        merge_forward: with ``merge``, the loop of JVPs in that program too (one program,
            not three, for checks of both modes); should it fail to trace or lower (no
            forward mode, say), the three loops compile alone instead.
    """

    def __init__(
        self,
        f: Callable,
        x0: jax.Array,
        vjp: Callable | None = None,
        *,
        m: int | None = None,
        quick: bool = True,
        merge: bool = False,
        merge_forward: bool = False,
        refine_jit: Callable[[Callable], Callable] | None = None,
    ) -> None:
        self.quick = quick
        super().__init__(f, x0, vjp, m=m, refine_jit=refine_jit)
        self._forward_merged = merge and merge_forward
        self._both: Program | None = None
        if merge:
            loops = (self._differences_fn(), self._rows_fn(), self.f, self.n, self.m)
            self._both = self._compile(functools.partial(_all_loops, *loops))
        self._both_checked = False

    def _compile(self, fn: Callable) -> Program:
        return Program(quick_jit(fn, self.quick))

    def _idle(self, part: str) -> tuple:
        """The arguments of ``part`` of the merged program that run none of its loop."""
        if part == "differences":
            return (
                np.zeros(self.col_chunk, np.int64),
                np.ones(self.col_chunk),
                np.zeros(self.col_chunk),
                0,
            )
        if part == "rows":
            return np.zeros(self.row_chunk, np.int64), 0, np.zeros(self.m)
        if not self._forward_merged:
            return ()
        return np.zeros(self.col_chunk, np.int64), 0, np.zeros(self.n)

    def _merged(self, *args) -> bool:
        """Whether the merged program serves (decided at its first call, from ``args``).

        Not for a function with a Python callback: XLA runs a larger program on a
        thread of its own, where JAX's x64 setting (thread-local) is off, and a
        callback's float64 results are then refused as float32."""
        if self._both is None:
            return False
        if self._both_checked:
            return True
        self._both_checked = True
        try:
            text = self._both.jitted.lower(*args).as_text()
        except Exception:
            if not self._forward_merged:
                raise
            # No forward mode, say: each loop runs alone, and raises what it raises.
            self._both = None
            return False
        if "callback" in text:
            self._both = None
        return self._both is not None

    def _run_differences(self, *args) -> tuple:
        merged = (*args, *self._idle("rows"), *self._idle("fwd"))
        if self._merged(*merged):
            return self._both(*merged)[:2]
        return super()._run_differences(*args)

    def _pullbacks(self, ks: np.ndarray, count: int, extra: np.ndarray) -> tuple:
        args = (self.x0, *self._idle("differences"), ks, count, extra, *self._idle("fwd"))
        if self._merged(*args):
            return self._both(*args)[2:4]
        return super()._pullbacks(ks, count, extra)

    def _columns(self, ks: np.ndarray, count: int, extra: np.ndarray) -> tuple:
        if self._forward_merged:
            args = (self.x0, *self._idle("differences"), *self._idle("rows"), ks, count, extra)
            if self._merged(*args):
                return self._both(*args)[4:]
        return super()._columns(ks, count, extra)

    def _rows_args(self, ks: np.ndarray, count: int, extra: np.ndarray) -> tuple:
        """The arguments of the VJPs' program for ``_pullbacks``."""
        return self.x0, ks, count, extra

    def compile_ahead(self, forward: bool) -> None:
        """Starts compiling the programs, side by side, before their first use.

        ``value``, ``vjp`` and (with ``forward``) ``jvp`` would each compile their
        program at its first call, one after the other, and compilation is most of a
        small check's time (a large problem's programs take a good part of a second
        each). XLA compiles with the GIL released, so this thread lowers them (tracing
        under its configuration, as a call would) and worker threads compile them, each
        as soon as it is lowered, while this thread goes on: the VJPs' program last,
        after the others, so that the differences can run while it compiles (side by
        side, the compilations only slowed each other). JAX caches the
        executables, where the first calls and ``Program.bind`` find them (a program's
        first use waits for its compilation: a second one would compile it again). A
        program that fails to lower or compile is left to its first call, which raises
        as it always did. Nothing to do where one merged program serves.
        """
        if self._both is not None:
            return
        kc, kr = np.zeros(self.col_chunk, np.int64), np.zeros(self.row_chunk, np.int64)
        calls = [(self._differences, self._value_args())]
        if forward:
            calls.append((self._jvp_columns, (self.x0, kc, np.zeros(self.n))))
        calls.append((self._vjp_rows, self._rows_args(kr, 1, np.zeros(self.m))))
        # What the check needs first (f(x0) from the differences; forward mode's primal
        # from the JVPs) compiles side by side; the VJPs', needed last, after them.
        pool = concurrent.futures.ThreadPoolExecutor(len(calls) - 1)
        for program, args in calls:
            try:
                lowered = program.jitted.lower(*args)
            except Exception:  # noqa: BLE001 - raised again, as before, by the first call
                continue
            program.ahead(args, pool.submit(lowered.compile))
        pool.shutdown(wait=False)  # its threads end with their compilations
