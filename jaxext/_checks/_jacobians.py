"""Numerical and automatic Jacobians of a flat function, a chunk at a time.

Everything here works on a function ``f: R^n -> R^m`` of one flat float64
vector (``_problem`` builds it from the caller's pytrees). ``FlatJacobians``
compiles its programs once and then hands out chunks of at most ``CHUNK`` rows
or columns (fewer for wide problems: ``CHUNK_ENTRIES`` bounds each stacked
array), so no caller ever needs the whole ``(m, n)`` Jacobian in memory:

* ``numerical(cols, eps)``: central differences. ``f(x + h e_k)`` and
  ``f(x - h e_k)`` come from the *same* compiled loop body (one ``fori_loop`` over
  both sides' perturbed inputs) on inputs that differ only in entry ``k``. An
  output that the step does not touch is therefore bit-for-bit
  the same on both sides and its difference is exactly zero: a true zero of the
  Jacobian is a numerical zero too, whatever the magnitude of the output. The
  divisor is the step actually taken, ``(x_k + h) - (x_k - h)``.
* ``reverse(rows)``: one VJP per output element with a basis cotangent.
* ``forward(cols)``: one JVP per input element with a basis tangent.
* ``directional(...)``: ``u . J v`` for random unit vectors, numerical and
  automatic, for problems too large for the above.

Rows of a chunk are computed one after the other inside the program (a
``jax.lax`` loop), not with ``jax.vmap``: checking derivatives must not depend on
the function's batching rule, which ``jaxext.opcheck`` checks on its own.

What is compiled depends on the size: a screened problem (``screen_min_entries``)
has the screen in its VJPs' program, and its chunks can be run
from worker threads (``numerical_on_device``, ``forward_screened``,
``reverse_screened`` return calls bound to executables compiled in the owning
thread, ``_Program``); a small one (``MERGE_MAX_ENTRIES``) compiles its two loops
as one program.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._quick import entries, quick_jit

__all__ = [
    "CHUNK",
    "CHUNK_ENTRIES",
    "FlatJacobians",
    "chunk_size",
    "passes",
    "screen",
    "unit_blocks",
]

CHUNK = 128  # most rows or columns per compiled call
CHUNK_ENTRIES = 2**21  # most entries of one stacked array per call (16 MiB in float64)
# Most entries of a chunk of columns plus a chunk of rows for one merged program.
MERGE_MAX_ENTRIES = 2**18

FlatFn = Callable[[jax.Array], jax.Array]


def _basis_or(k: jax.Array, size: int, extra: jax.Array) -> jax.Array:
    """The one-hot vector ``e_k``, or ``extra`` where ``k < 0``."""
    return jnp.where(k >= 0, (jnp.arange(size) == k).astype(jnp.float64), extra)


def _padded(indices: Sequence[int] | range, size: int) -> tuple[np.ndarray, int]:
    """``indices`` as an int array padded to ``size`` entries (repeating the last)."""
    indices = np.asarray(indices, dtype=np.int64)
    count = indices.shape[0]
    if not 0 < count <= size:
        raise ValueError(f"a chunk holds 1 to {size} indices; got {count}.")
    return np.concatenate([indices, np.full(size - count, indices[-1])]), count


def chunk_size(width: int) -> int:
    """Rows per call when each row has ``width`` entries."""
    return int(max(1, min(CHUNK, CHUNK_ENTRIES // max(width, 1))))


class FlatJacobians:
    """Chunks of the numerical and automatic Jacobians of ``f`` at ``x0``.

    Args:
        f: flat float64 function ``R^n -> R^m``.
        x0: the point, shape ``(n,)``.
        vjp: ``x -> (f(x), pullback)`` with ``pullback(u) = J(x)^T u``; ``None``
            means ``jax.vjp`` of ``f``.
        screen_min_entries: from this many Jacobian entries (``n * m``) up, the VJPs'
            program also computes the screen of ``reverse_screened`` and the chunks can be
            run from worker threads (``screened``); below it, or with ``None``, the screen
            is left out (less to compile) and the methods that return calls
            (``numerical_on_device``, ``forward_screened``, ``reverse_screened``) are not
            available.
        merge: whether a small unscreened problem (``MERGE_MAX_ENTRIES``) may compile
            its two loops as one program; that traces the VJP whichever method runs
            first, so it is for reverse-mode checks.
        merge_forward: with ``merge``, the loop of JVPs in that program too (one program,
            not three, for checks of both modes); should it fail to trace or lower (no
            forward mode, say), the three loops compile alone instead.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxext._checks._jacobians import FlatJacobians
        >>> with jax.enable_x64(True):
        ...     jac = FlatJacobians(lambda x: x**2, jnp.array([1.0, 2.0]))
        ...     print(jac.numerical(range(2), 1e-6)[0].round(6).tolist())  # transposed
        [[2.0, 0.0], [0.0, 4.0]]
    """

    def __init__(
        self,
        f: FlatFn,
        x0: jax.Array,
        vjp: Callable | None = None,
        screen_min_entries: int | None = None,
        merge: bool = False,
        merge_forward: bool = False,
    ) -> None:
        if vjp is None:

            def vjp(x):
                y, vjp_fn = jax.vjp(f, x)
                return y, lambda u: vjp_fn(u)[0]

        self.f = f
        self.vjp_fn = vjp
        self.x0 = x0
        self.x0_host = np.asarray(x0)
        self.n = int(x0.shape[0])
        jaxpr, shape = jax.make_jaxpr(f, return_shape=True)(x0)
        self.m = int(shape.shape[0])
        n, m = self.n, self.m
        # The entries the programs compute, estimated (``_quick``): 2n evaluations of f
        # for the differences, m VJPs and n JVPs (a derivative costing about two).
        work = 4 * (n + m) * entries(jaxpr)
        # Only a problem that is screened (`reverse_screened`) has the screen compiled into
        # its VJPs' program: it costs compile time, which is most of a small check's time.
        self.screened = screened = screen_min_entries is not None and n * m >= screen_min_entries
        # Columns need stacked inputs and outputs; rows need stacked input-sized gradients.
        self.col_chunk = chunk_size(max(n, m))
        self.row_chunk = chunk_size(n)

        def differences(x, ks, plus, minus, count):
            # (f(x + h e_k) - f(x - h e_k)) / step_k for the first `count` entries of `ks`:
            # iterations i and count + i of one loop, so the same compiled body evaluates
            # both sides. A screened (large) problem makes each quotient in place: the
            # first iteration leaves f(x + h e_k) in row i, the second makes it the
            # quotient (no stack of both sides, no pass over it after the loop: 6.9 against
            # 8.3 ms per chunk at 5e7 entries). A smaller one stacks both sides' values
            # and takes the quotients after the loop: there the in-place form measured
            # slower (3e6 entries: 0.36 against 0.29 s a check; two more kernels per
            # evaluation, and the host comparison after it slower, from the allocator).
            size, steps = ks.shape[0], plus - minus

            def perturbed(j):
                # x with entry k set, afresh (XLA copies x for it; carrying the perturbed
                # input and restoring the entry made it copy x twice).
                minus_side = j >= count
                i = jnp.where(minus_side, j - count, j)
                value = jnp.where(minus_side, minus[i], plus[i])
                return minus_side, i, f(x.at[ks[i]].set(value))

            if not screened:

                def stacked(j, y):
                    minus_side, i, value = perturbed(j)
                    return y.at[i + size * minus_side].set(value)

                y = jax.lax.fori_loop(0, 2 * count, stacked, jnp.zeros((2 * size, m)))
                return (y[:size] - y[size:]) / steps[:, None], y[0]

            def in_place(j, carry):
                minus_side, i, y = perturbed(j)
                row = jnp.where(minus_side, (carry[0][i] - y) / steps[i], y)
                return carry[0].at[i].set(row), y

            init = (jnp.zeros((size, m)), jnp.zeros(m))
            return jax.lax.fori_loop(0, 2 * count, in_place, init)  # (quotient, last value)

        def vjp_rows(x, ks, count, extra, *screen_args):
            # Row i < count is the pullback of the one-hot cotangent e_k (k = ks[i]), or of
            # `extra` where k < 0 (the rows past count are zero); for a screened problem,
            # the rows are screened against `numerical` in the same program (`screen`),
            # except the entries whose bits are set in `left` (the caller checks those).
            y, pullback = vjp(x)

            def body(i, rows):
                return rows.at[i].set(pullback(_basis_or(ks[i], m, extra)))

            rows = jax.lax.fori_loop(0, count, body, jnp.zeros((ks.shape[0], n)))
            if not screen_args:
                return y, rows
            numerical, left, noise, steps, valid, col0, atol, rtol = screen_args
            width = numerical.shape[1]
            automatic = jax.lax.dynamic_slice_in_dim(rows, col0, width, axis=1)
            unset = jnp.unpackbits(left, axis=1, count=width, bitorder="little") == 0
            return y, rows, screen(numerical, automatic, noise, steps, valid & unset, atol, rtol)

        def jvp_columns(x, ks, extra):
            y, jvp_fn = jax.linearize(f, x)
            return y, jax.lax.map(lambda k: jvp_fn(_basis_or(k, n, extra)), ks)

        def jvp_loop(x, ks, count, extra):
            # `jvp_columns` for the first `count` entries of `ks` (the rest are zero).
            y, jvp_fn = jax.linearize(f, x)

            def body(i, cols):
                return cols.at[i].set(jvp_fn(_basis_or(ks[i], n, extra)))

            return y, jax.lax.fori_loop(0, count, body, jnp.zeros((ks.shape[0], m)))

        # Two programs serve the full method: the stacked evaluations of f (which also
        # give f(x0) and the difference quotients) and the stacked pullbacks (which also
        # give the AD primal, the pullback of any one cotangent and the screen of a chunk
        # of rows). Each compiles once per check (the pullbacks once more where the
        # numerical columns are held in several tiles).
        # A small problem's programs compile quickly (``_quick``).
        self._differences = _Program(quick_jit(differences, work))
        self._vjp_rows = _Program(quick_jit(vjp_rows, work))
        # A small problem compiles the two (with `merge_forward`, the three) as one
        # program (XLA's cost per program is a good part of a small check's time); each
        # call runs one of the loops, the others for zero rows (their outputs, zeros, are
        # small here).
        self._both: _Program | None = None
        self._both_checked = False
        columns = (2 if merge_forward else 1) * self.col_chunk * m  # the JVPs' block too
        small = columns + self.row_chunk * n <= MERGE_MAX_ENTRIES
        self._forward_merged = merge_forward
        if merge and not screened and small:

            def both(x, kc, plus, minus, count_cols, kr, count_rows, extra, *forward):
                return (
                    *differences(x, kc, plus, minus, count_cols),
                    *vjp_rows(x, kr, count_rows, extra),
                    *(jvp_loop(x, *forward) if forward else ()),
                )

            self._both = _Program(quick_jit(both, work))
        self._jvp_columns = _Program(quick_jit(jvp_columns, work))
        self._screen = _Program(_SCREEN)
        self._call = jax.jit(f)
        self._zero_blocks: dict[int, jax.Array] = {}

    def _require_screen(self, method: str) -> None:
        if not self.screened:
            raise ValueError(
                f"`{method}` needs the screen compiled in: construct FlatJacobians with "
                f"`screen_min_entries` at most n * m = {self.n * self.m}."
            )

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

    def _pullbacks(
        self, ks: np.ndarray, count: int, extra: np.ndarray
    ) -> tuple[jax.Array, jax.Array]:
        """``(primal, rows)`` from the program of ``reverse``, with an empty screen."""
        if not self.screened:
            args = (self.x0, *self._idle("differences"), ks, count, extra, *self._idle("fwd"))
            if self._merged(*args):
                return self._both(*args)[2:4]
            return self._vjp_rows(self.x0, ks, count, extra)
        y, block, *_ = self._vjp_rows(*self._unscreened_rows_args(ks, count, extra))
        return y, block

    def _unscreened_rows_args(self, ks: np.ndarray, count: int, extra: np.ndarray) -> tuple:
        """The arguments of a screened problem's ``vjp_rows`` with an empty screen."""
        return (self.x0, ks, count, extra, *self._empty_screen, 0, 0.0, 0.0)

    @functools.cached_property
    def _empty_screen(self) -> tuple[jax.Array, ...]:
        """A screen that checks nothing (``valid`` all false), put on the device once: a
        block of rows is megabytes, and ``vjp``, ``reverse`` and the primal pass one."""
        rows, n = self.row_chunk, self.n
        rest = (
            np.zeros((rows, -(-n // 8)), np.uint8), np.zeros((rows, 1)), np.ones((1, n)),
            np.zeros((rows, 1), bool),
        )  # fmt: skip
        with jax.enable_x64(True):
            return (self._zeros(n), *(jax.device_put(a) for a in rest))

    def _zeros(self, width: int) -> jax.Array:
        """A ``(row_chunk, width)`` block of zeros on the device (made once per width)."""
        if width not in self._zero_blocks:
            with jax.enable_x64(True):
                self._zero_blocks[width] = jax.device_put(np.zeros((self.row_chunk, width)))
        return self._zero_blocks[width]

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
        executables, where the first calls and ``_Program.bind`` find them (a program's
        first use waits for its compilation: a second one would compile it again). A
        program that fails to lower or compile is left to its first call, which raises
        as it always did. Nothing to do where one merged program serves.
        """
        if self._both is not None:
            return
        kc, kr = np.zeros(self.col_chunk, np.int64), np.zeros(self.row_chunk, np.int64)
        extra = np.zeros(self.m)
        rows_args = (
            self._unscreened_rows_args(kr, 1, extra) if self.screened else (self.x0, kr, 1, extra)
        )
        calls = [(self._differences, self._value_args())]
        if forward:
            calls.append((self._jvp_columns, (self.x0, kc, np.zeros(self.n))))
        calls.append((self._vjp_rows, rows_args))
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

    def value(self) -> np.ndarray:
        """``f(x0)``, from the program of ``numerical`` with nothing perturbed."""
        return np.asarray(self._run_differences(*self._value_args())[1])

    def _value_args(self) -> tuple:
        """The arguments of ``differences`` that evaluate ``f(x0)`` (entry 0 set to itself)."""
        ks = np.zeros(self.col_chunk, dtype=np.int64)
        values = self.x0_host[ks]
        return self.x0, ks, values, values, 1

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
        """``differences(*args)``: ``(quotient, a value of f)``, f at ``x0`` itself for
        ``_value_args`` (entry ``ks[0]`` set to its own value on both sides)."""
        merged = (*args, *self._idle("rows"), *self._idle("fwd"))
        if self._merged(*merged):
            return self._both(*merged)[:2]
        return self._differences(*args)

    def _difference_args(self, cols: Sequence[int] | range, eps: float | np.ndarray):
        ks, count = _padded(cols, self.col_chunk)
        eps = np.broadcast_to(np.asarray(eps, np.float64), (self.n,))[ks]
        plus = self.x0_host[ks] + eps
        minus = self.x0_host[ks] - eps
        return (self.x0, ks, plus, minus, count), plus - minus, count

    def numerical(
        self, cols: Sequence[int] | range, eps: float | np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Central differences for the input elements ``cols`` (at most ``col_chunk``).

        ``eps`` is the step, one for all inputs or one per input element (shape ``(n,)``).

        Returns:
            ``(block, steps)``: the ``(len(cols), m)`` block of the *transposed*
            numerical Jacobian (row ``k`` is the derivative of every output with
            respect to input ``cols[k]``) and the step actually taken for each
            column, ``(x_k + eps) - (x_k - eps)``.
        """
        args, steps, count = self._difference_args(cols, eps)
        quotient = np.asarray(self._run_differences(*args)[0])
        return quotient[:count], steps[:count]

    def numerical_on_device(
        self, cols: Sequence[int] | range, eps: float | np.ndarray
    ) -> Callable[[], tuple[jax.Array, np.ndarray, int]]:
        """``numerical``, with the block left on the device and padded to ``col_chunk`` rows,
        as a call that any thread can make (see ``_Program``; only a screened problem).

        Returns:
            A function of no arguments that returns ``(block, steps, count)``: the
            ``(col_chunk, m)`` block (its rows past ``count`` are zero), the
            ``(col_chunk,)`` steps, padded like the block, and the number of columns
            asked for.
        """
        self._require_screen("numerical_on_device")
        args, steps, count = self._difference_args(cols, eps)
        run = self._differences.bind(*args)

        def call():
            return run(*args)[0], steps, count

        return call

    def forward_screened(
        self, cols: Sequence[int] | range, noise, atol: float, rtol: float
    ) -> Callable[[jax.Array, np.ndarray], tuple[jax.Array, jax.Array]]:
        """``forward``'s block, left on the device and padded to ``col_chunk`` rows, and
        whether it passes ``screen`` against a ``numerical_on_device`` block (rows past
        ``len(cols)`` are padding and pass), as a call that any thread can make: a
        function of that block and its steps (shape ``(col_chunk, 1)``) that returns
        ``(block, clean)``."""
        self._require_screen("forward_screened")
        ks, count = _padded(cols, self.col_chunk)
        forward_args = (self.x0, ks, np.zeros(self.n))
        forward = self._jvp_columns.bind(*forward_args)
        valid = (np.arange(self.col_chunk) < count)[:, None]
        block = jax.ShapeDtypeStruct((self.col_chunk, self.m), np.float64)
        steps = jax.ShapeDtypeStruct((self.col_chunk, 1), np.float64)
        rest = (valid, float(atol), float(rtol))
        check = self._screen.bind(block, block, noise, steps, *rest)

        def call(numerical, steps):
            automatic = forward(*forward_args)[1]
            return automatic, check(numerical, automatic, noise, steps, *rest)

        return call

    def reverse_screened(
        self, rows: Sequence[int] | range, numerical, left, noise, steps, col0, atol, rtol
    ) -> Callable[[], tuple[jax.Array, jax.Array]]:
        """``reverse``'s block, left on the device and padded to ``row_chunk`` rows, and
        ``screen`` of its columns ``col0 ..`` against ``numerical`` (rows past
        ``len(rows)`` are padding and pass), as a call that any thread can make: a
        function of no arguments that returns ``(block, clean)``.

        ``numerical`` is the ``(row_chunk, width)`` block of rows, or ``None`` to screen
        against zeros (kept on the device: nothing is sent). ``left`` holds a bit per entry
        (``np.packbits`` of a boolean array along its rows, ``bitorder="little"``): the
        entries whose bit is set are left out of the screen, for the caller to check
        (the nonzero entries of a sparse block, with ``numerical`` ``None``)."""
        self._require_screen("reverse_screened")
        ks, count = _padded(rows, self.row_chunk)
        valid = (np.arange(self.row_chunk) < count)[:, None]
        if numerical is None:
            numerical = self._zeros(steps.shape[1])  # already on the device
        args = (
            self.x0, ks, count, np.zeros(self.m), numerical, left, noise, steps, valid,
            int(col0), float(atol), float(rtol),
        )  # fmt: skip
        run = self._vjp_rows.bind(*args)

        def call():
            _, block, clean = run(*args)
            return block, clean

        return call

    def forward_on_device(self, cols: Sequence[int] | range) -> jax.Array:
        """``forward``'s block, left on the device and padded to ``col_chunk`` rows."""
        ks, _ = _padded(cols, self.col_chunk)
        return self._jvp_columns(self.x0, ks, np.zeros(self.n))[1]

    def reverse(self, rows: Sequence[int] | range) -> tuple[np.ndarray, np.ndarray]:
        """``(primal, block)``: rows ``rows`` of the Jacobian, one VJP each."""
        ks, count = _padded(rows, self.row_chunk)
        y, block = self._pullbacks(ks, count, np.zeros(self.m))
        return np.asarray(y), np.asarray(block)[:count]

    def forward(self, cols: Sequence[int] | range) -> tuple[np.ndarray, np.ndarray]:
        """``(primal, block)``: columns ``cols`` of the Jacobian, one JVP each, as the
        rows of ``block`` (shape ``(len(cols), m)``, like ``numerical``)."""
        ks, count = _padded(cols, self.col_chunk)
        y, block = self._columns(ks, count, np.zeros(self.n))
        return np.asarray(y), np.asarray(block)[:count]

    def vjp(self, cotangent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(primal, J^T u)`` for one cotangent ``u`` (from the program of ``reverse``)."""
        ks = np.full(self.row_chunk, -1, dtype=np.int64)
        y, block = self._pullbacks(ks, 1, np.asarray(cotangent, np.float64))
        return np.asarray(y), np.asarray(block)[0]

    def jvp(self, tangent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(primal, J v)`` for one tangent ``v`` (from the program of ``forward``)."""
        ks = np.full(self.col_chunk, -1, dtype=np.int64)
        y, block = self._columns(ks, 1, np.asarray(tangent, np.float64))
        return np.asarray(y), np.asarray(block)[0]

    def _columns(self, ks: np.ndarray, count: int, extra: np.ndarray) -> tuple:
        """``(primal, block)`` of ``jvp_columns`` (from the merged program where it has
        the JVPs; its rows past ``count`` are zero there)."""
        if self._forward_merged:
            args = (self.x0, *self._idle("differences"), *self._idle("rows"), ks, count, extra)
            if self._merged(*args):
                return self._both(*args)[4:]
        return self._jvp_columns(self.x0, ks, extra)

    def difference(self, direction: np.ndarray, eps: float) -> tuple[np.ndarray, float]:
        """``(f(x0 + eps v) - f(x0 - eps v), 2 eps)``, both sides from one program."""
        plus = jnp.asarray(self.x0_host + eps * direction)
        minus = jnp.asarray(self.x0_host - eps * direction)
        return np.asarray(self._call(plus)) - np.asarray(self._call(minus)), 2 * eps


def passes(numerical, automatic, noise, steps, atol, rtol, xp: Any = jnp):
    """Whether each entry of a chunk passes with room to spare (``xp``: ``jax.numpy``,
    or ``numpy`` for the same test on the host).

    ``noise`` and ``steps`` broadcast against ``numerical`` and ``automatic`` as in the
    host comparison (``_compare``). An entry passes the screen when
    ``|a - n| - (rtol |n| + noise / step) <= atol min(1, |n|) / 2``: the final test of
    its block pair allows at least ``atol min(1, scale)`` with ``scale >= |n|``, so the
    entry passes it, and by a margin that rounding cannot eat (an entry with ``n = 0``,
    or a NaN anywhere, must pass without ``atol``).
    """
    magnitude = xp.abs(numerical)
    relative = rtol * magnitude + noise / steps
    over = xp.abs(automatic - numerical) - relative
    finite = xp.isfinite(numerical)
    margin = 0.5 * atol * xp.where(finite, xp.minimum(magnitude, 1.0), 0.0)
    return over <= margin


def screen(numerical, automatic, noise, steps, valid, atol, rtol):
    """Whether every valid entry of a chunk ``passes``."""
    return jnp.all(passes(numerical, automatic, noise, steps, atol, rtol) | ~valid)


_SCREEN = jax.jit(screen)


def _signature(value: Any) -> Any:
    """What an executable compiled for ``value`` requires of an argument."""
    if isinstance(value, (bool, int, float)):
        return type(value)  # a weakly typed scalar
    return tuple(value.shape), np.dtype(value.dtype).str


class _Program:
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


def unit_blocks(rng: np.random.Generator, slices: Sequence[slice], size: int) -> np.ndarray:
    """A vector of ``size`` entries holding an independent unit vector in each slice."""
    vector = np.zeros(size)
    for block in slices:
        part = rng.standard_normal(block.stop - block.start)
        norm = np.linalg.norm(part)
        vector[block] = part / norm if norm > 0 else part
    return vector
