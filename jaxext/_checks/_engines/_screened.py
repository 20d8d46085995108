"""The screened engine: gradcheck's full method for large problems, faster.

``_engines.choose`` picks it for the full method from ``SCREEN_MIN_ENTRIES`` Jacobian
entries up. It compares what the reference path (``_jacobians``, ``_compare``)
compares, entry by entry, and gives the same verdicts and reports; only faster:

* Each pair of chunks (numerical and automatic) is first screened on the device,
  where the automatic chunk was computed: one fused pass (``screen``, compiled into
  the VJPs' program) tells whether every entry passes with room to spare (its error
  at most half of the smallest allowance the entry can get, whatever the final scale
  of its block pair), and only a chunk that does not goes through the exact
  comparison on the host. A screened chunk cannot hold a failing entry, nor the
  worst entry of a failing pair, so verdicts and error reports are unchanged; the
  host work of a passing check shrinks to copying the numerical columns once. The
  scale of each block pair comes from the columns' maxima on the host
  (``_column_maxima``), as screened chunks never reach the tally.
* The numerical columns are held in a ``_Tile``, each chunk dense or as its nonzero
  entries (exact zeros are the rule for large problems, where an output depends on
  few inputs); a tile of nonzero entries alone sends none of its rows to the device:
  the device screens the VJP rows against zeros already there, except the entries
  the tile holds (their bits are set), and the host checks those few.
* The differences make each quotient in place (no stack of both sides, no pass over
  it after the loop: 6.9 against 8.3 ms per chunk at 5e7 entries). Smaller problems
  keep the stacked form: there the in-place form measured slower (3e6 entries: 0.36
  against 0.29 s a check; two more kernels per evaluation, and the host comparison
  after it slower, from the allocator); both give the same quotients bit for bit.
* The chunks are computed by ``WORKERS`` threads (``_in_order``): JAX runs the
  programs of one thread one after the other, those of two threads on two cores at
  once, and the host copies of one chunk overlap the computation of the next. The
  results are consumed in order, each computed exactly as it would be alone, so
  nothing depends on the threads. The programs are bound in the check's thread
  (``_quick.Program``), where JAX's configuration (x64) is the check's.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from .._chunks import Columns, overlaps
from .._compare import Tally
from .._jacobians import padded, perturbed, pullback_rows
from ._quick import Program, QuickJacobians

__all__ = ["WORKERS", "ScreenedChunks", "ScreenedJacobians", "passes", "screen"]

# Threads that compute the chunks of a screened problem (`_in_order`): one more than
# the cores (at most four), so that a thread's host work and waits leave its core to
# another (on 2 cores, 3 threads took 5-8% less time than 2 at 5e7 and 1.5e8 entries).
WORKERS = max(2, min(4, (os.cpu_count() or 1) + 1))

T = TypeVar("T")


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


def quotients_in_place(f: Callable, m: int, x, ks, plus, minus, count) -> tuple:
    """``_jacobians.stacked_quotients`` with each quotient made in place: the first
    iteration of entry ``i`` leaves ``f(x + h e_k)`` in row ``i``, the second makes it
    the quotient. Returns ``(quotient, the last value of f)``."""
    size, steps = ks.shape[0], plus - minus

    def in_place(j, carry):
        minus_side, i, y = perturbed(f, x, ks, plus, minus, count, j)
        row = jnp.where(minus_side, (carry[0][i] - y) / steps[i], y)
        return carry[0].at[i].set(row), y

    init = (jnp.zeros((size, m)), jnp.zeros(m))
    return jax.lax.fori_loop(0, 2 * count, in_place, init)  # (quotient, last value)


def screened_rows(vjp: Callable, n: int, m: int, x, ks, count, extra, *screen_args) -> tuple:
    """``_jacobians.pullback_rows``, and the rows screened against ``numerical`` in the
    same program (``screen``), except the entries whose bits are set in ``left`` (the
    caller checks those)."""
    y, rows = pullback_rows(vjp, n, m, x, ks, count, extra)
    numerical, left, noise, steps, valid, col0, atol, rtol = screen_args
    width = numerical.shape[1]
    automatic = jax.lax.dynamic_slice_in_dim(rows, col0, width, axis=1)
    unset = jnp.unpackbits(left, axis=1, count=width, bitorder="little") == 0
    return y, rows, screen(numerical, automatic, noise, steps, valid & unset, atol, rtol)


class ScreenedJacobians(QuickJacobians):
    """``QuickJacobians`` with the screen compiled into its VJPs' program and the
    differences made in place, whose chunks can be run from worker threads
    (``numerical_on_device``, ``forward_screened``, ``reverse_screened`` return calls
    bound to executables compiled in the owning thread, ``_quick.Program``).

    Args:
        f, x0, vjp, m, quick, refine_jit: as for ``QuickJacobians`` (never merged).
    """

    def __init__(
        self,
        f: Callable,
        x0: jax.Array,
        vjp: Callable | None = None,
        *,
        m: int | None = None,
        quick: bool = True,
        refine_jit: Callable[[Callable], Callable] | None = None,
    ) -> None:
        super().__init__(f, x0, vjp, m=m, quick=quick, refine_jit=refine_jit)
        self._screen = Program(_SCREEN)
        self._zero_blocks: dict[int, jax.Array] = {}

    def _differences_fn(self) -> Callable:
        return functools.partial(quotients_in_place, self.f, self.m)

    def _rows_fn(self) -> Callable:
        return functools.partial(screened_rows, self.vjp_fn, self.n, self.m)

    def _pullbacks(self, ks: np.ndarray, count: int, extra: np.ndarray) -> tuple:
        """``(primal, rows)`` from the VJPs' program, with an empty screen."""
        y, block, *_ = self._vjp_rows(*self._rows_args(ks, count, extra))
        return y, block

    def _rows_args(self, ks: np.ndarray, count: int, extra: np.ndarray) -> tuple:
        """The arguments of ``screened_rows`` with an empty screen."""
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

    def numerical_on_device(
        self, cols: Sequence[int] | range, eps: float | np.ndarray
    ) -> Callable[[], tuple[jax.Array, np.ndarray, int]]:
        """``numerical``, with the block left on the device and padded to ``col_chunk`` rows,
        as a call that any thread can make (see ``_quick.Program``).

        Returns:
            A function of no arguments that returns ``(block, steps, count)``: the
            ``(col_chunk, m)`` block (its rows past ``count`` are zero), the
            ``(col_chunk,)`` steps, padded like the block, and the number of columns
            asked for.
        """
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
        ks, count = padded(cols, self.col_chunk)
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
        ks, count = padded(rows, self.row_chunk)
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


class _Tile:
    """Consecutive columns of the numerical Jacobian, held until compared with VJP rows.

    Each chunk of columns is kept dense, or as its nonzero entries sorted by
    row when that is smaller (the usual case for large problems).
    """

    def __init__(self, start: int) -> None:
        self.start = self.stop = start
        self.nbytes = 0
        self.chunks: list[tuple[int, int, np.ndarray | None, tuple | None]] = []

    @staticmethod
    def pack(block: np.ndarray) -> tuple[np.ndarray | None, tuple | None, int, int]:
        """``block`` as the tile holds it: ``(dense, sparse, nbytes, columns)``."""
        flat = np.flatnonzero(block != 0)  # a boolean mask scans ten times faster
        if 16 * flat.size < block.nbytes:
            cols, rows = np.divmod(flat, block.shape[1])
            # By row, then by column (a radix sort where the rows fit 16 bits).
            key = rows.astype(np.uint16) if block.shape[1] <= 2**16 else rows
            order = np.argsort(key, kind="stable")
            values = block.ravel()[flat[order]]
            sparse = (rows[order].astype(np.int32), cols[order].astype(np.int32), values)
            return None, sparse, 16 * flat.size, block.shape[0]
        return block, None, block.nbytes, block.shape[0]

    def add(self, start: int, block: np.ndarray) -> None:
        """Adds ``block``, the transposed columns ``start, start + 1, ...``."""
        self.append(start, self.pack(block))

    def hold(self, chunk: _Columns) -> None:
        """Adds a chunk of columns, packed (``_screened_columns``)."""
        self.append(chunk.start, chunk.packed)

    def append(self, start: int, packed: tuple) -> None:
        """Adds a block packed by ``pack``."""
        dense, sparse, nbytes, columns = packed
        self.chunks.append((start, columns, dense, sparse))
        self.nbytes += nbytes
        self.stop = start + columns

    def rows(self, first: int, stop: int) -> np.ndarray:
        """The dense ``(stop - first, self.stop - self.start)`` block of rows ``[first, stop)``."""
        out = np.zeros((stop - first, self.stop - self.start))
        for start, _, dense, _ in self.chunks:
            if dense is not None:
                offset = start - self.start
                out[:, offset : offset + dense.shape[0]] = dense[:, first:stop].T
        rows, cols, values = next(self.entries([first, stop]))
        out[rows, cols] = values
        return out

    @property
    def sparse(self) -> bool:
        """Whether every chunk is held as its nonzero entries (``entries`` has them all)."""
        return all(dense is None for _, _, dense, _ in self.chunks)

    def entries(self, edges: Sequence[int]) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """For each span of rows ``[edges[i], edges[i + 1])``, the sparse chunks' entries
        there, as ``(rows - edges[i], columns in the tile, values)``, chunk after chunk
        (each sorted by row): slices of each chunk, nothing merged or sorted (a tile of
        many chunks is read a span of rows at a time, and the entries of a span go
        where their indices say), one search per chunk for all the spans."""
        edges = np.asarray(edges, np.int32)  # as the rows: searched without a cast
        empty = (np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0))
        chunks = [
            (start - self.start, sparse, np.searchsorted(sparse[0], edges).tolist())
            for start, _, _, sparse in self.chunks
            if sparse is not None
        ]
        for i in range(len(edges) - 1):
            parts, offsets, counts = [empty], [0], [0]
            for offset, (rows, cols, values), bounds in chunks:
                lo, hi = bounds[i], bounds[i + 1]
                parts.append((rows[lo:hi], cols[lo:hi], values[lo:hi]))
                offsets.append(offset)
                counts.append(hi - lo)
            rows, cols, values = (np.concatenate(arrays) for arrays in zip(*parts, strict=True))
            yield rows - edges[i], cols + np.repeat(offsets, counts).astype(np.int32), values

    def weighted(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(u^T N, |u|^T |N|)`` for the tile's columns ``N`` (all ``m`` rows)."""
        parts = []
        for _, columns, dense, sparse in self.chunks:
            if dense is not None:
                parts.append((dense @ u, np.abs(dense) @ np.abs(u)))
            else:
                rows, cols, values = sparse
                products = u[rows] * values
                parts.append(
                    (
                        np.bincount(cols, products, minlength=columns),
                        np.bincount(cols, np.abs(products), minlength=columns),
                    )
                )
        if not parts:
            return np.zeros(0), np.zeros(0)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


@dataclasses.dataclass
class _Columns(Columns):
    """One chunk of columns of the numerical Jacobian, on the host, and what goes with it.

    ``numerical`` is the transposed block (``count`` rows); ``maxima`` its largest
    finite ``|n|`` per column and output block; ``forward`` the JVP columns to compare
    on the host (``None`` where there are none, or where the screen passed them);
    ``packed`` the block as the tile holds it.
    """

    maxima: np.ndarray | None = None
    packed: tuple | None = None


def _screened_columns(
    jac: ScreenedJacobians, eps, noise, atol, rtol, *, forward: bool, pack: bool, bounds: tuple
) -> Iterator[Callable[[], _Columns]]:
    """Tasks for ``_in_order``: each computes a chunk of columns on the device (and
    screens its JVP columns there) and brings to the host what the comparison needs:
    its column maxima per output block (``bounds``) and, with ``pack``, the block as
    the tile holds it."""
    for start in range(0, jac.n, jac.col_chunk):
        cols = range(start, min(jac.n, start + jac.col_chunk))
        numerical = jac.numerical_on_device(cols, eps)
        screened = jac.forward_screened(cols, noise[None, :], atol, rtol) if forward else None

        def task(start=start, numerical=numerical, screened=screened) -> _Columns:
            block, steps, count = numerical()
            host = np.asarray(block)[:count]  # no copy on the CPU
            packed = _Tile.pack(host) if pack else (host, None, host.nbytes, count)
            chunk = _Columns(start, host, steps[:count], maxima=_column_maxima(packed, bounds))
            chunk.packed = packed if pack else None
            if screened is not None:
                automatic, clean = screened(block, steps[:, None])
                chunk.forward = None if bool(clean) else np.asarray(automatic)[:count]
            return chunk

        yield task


def _in_order(tasks: Iterator[Callable[[], T]], workers: int) -> Iterator[T]:
    """The results of ``tasks`` (functions of no arguments, made in this thread as they
    are needed), in order, computed by ``workers`` threads, with at most ``workers + 1``
    submitted and not yet collected (so memory stays bounded).

    JAX dispatch from one thread runs programs one after the other; from two threads,
    on two cores at once (and the host copies and bookkeeping of one chunk overlap the
    computation of the next). Each chunk is computed exactly as it would be alone, and
    the caller consumes the results in order, so nothing depends on the threads.
    """
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        pending: collections.deque = collections.deque()
        try:
            for task in tasks:
                pending.append(pool.submit(task))
                if len(pending) > workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


class ScreenedChunks:
    """The screened engine's chunks for ``_compare.full_mismatches``: the same entries
    as ``_compare.ReferenceChunks``, screened on the device first (see the module's
    docstring) and computed by ``WORKERS`` threads (``_in_order``).

    A chunk of columns brings its maxima per output block (``seen`` raises the tallies'
    scales by them, as screened chunks never reach ``Tally.add``); a chunk of rows that
    passes the screen comes without its automatic rows, and is not compared again.
    """

    def __init__(
        self,
        *,
        jac: ScreenedJacobians,
        eps: float | np.ndarray,
        noise: np.ndarray,
        atol: float,
        rtol: float,
        modes: Sequence[str],
        out_slices: Sequence[slice],
        in_slices: Sequence[slice],
    ) -> None:
        self.jac, self.eps, self.noise, self.atol, self.rtol = jac, eps, noise, atol, rtol
        self.modes, self.out_slices, self.in_slices = modes, out_slices, in_slices

    def columns(self) -> Iterator[_Columns]:
        tasks = _screened_columns(
            self.jac, self.eps, self.noise, self.atol, self.rtol, forward="fwd" in self.modes,
            pack="rev" in self.modes, bounds=tuple((s.start, s.stop) for s in self.out_slices),
        )  # fmt: skip
        return _in_order(tasks, WORKERS)

    def seen(self, tallies: Iterable[Tally], chunk: _Columns) -> None:
        count = chunk.numerical.shape[0]
        _add_scales(tallies, chunk.maxima, count, chunk.start, self.in_slices)

    def tile(self, start: int) -> _Tile:
        return _Tile(start)

    def rows(self, tile: _Tile, steps: np.ndarray, noise: np.ndarray) -> Iterator[tuple]:
        tasks = _screened_rows(self.jac, tile, steps, noise, self.atol, self.rtol)
        return _in_order(tasks, WORKERS)


def _row_chunks(jac) -> Iterator[tuple[int, int]]:
    for start in range(0, jac.m, jac.row_chunk):
        yield start, min(jac.m, start + jac.row_chunk)


def _screened_rows(jac, tile, steps, noise, atol, rtol) -> Iterator[Callable[[], tuple]]:
    """Tasks for ``_in_order``: each computes a chunk of VJP rows (padded, on the device),
    screened in the same program against the tile's rows, and returns ``(start,
    numerical, automatic)``, with ``automatic`` ``None`` where the rows pass the screen.

    A tile held as its nonzero entries alone (``_Tile.sparse``, the rule for large
    problems) sends none of its rows to the device: the device screens the rows'
    entries against zeros already there, except those the tile holds (their bits are
    set), and the task checks those few on the host (the same test, ``passes``),
    reading the automatic rows where the device left them."""
    rows = jac.row_chunk
    col0, col1 = tile.start, tile.stop
    spans = list(_row_chunks(jac))
    sparse = tile.entries([start for start, _ in spans] + [jac.m]) if tile.sparse else None
    for start, stop in spans:
        count = stop - start
        padded_noise = np.zeros((rows, 1))
        padded_noise[:count, 0] = noise[start:stop]
        if sparse is not None:  # the device screens zeros, the task the entries held
            entries = next(sparse)
            held = np.zeros((rows, col1 - col0), bool)
            held[entries[:2]] = True
            numerical, left = None, np.packbits(held, axis=1, bitorder="little")
        else:
            entries, left = None, np.zeros((rows, -(-(col1 - col0) // 8)), np.uint8)
            numerical = tile.rows(start, stop)
            if count < rows:
                numerical = np.concatenate([numerical, np.zeros((rows - count, col1 - col0))])
        call = jac.reverse_screened(
            range(start, stop), numerical, left, padded_noise, steps[None, col0:col1], col0,
            atol, rtol,
        )  # fmt: skip

        def task(start=start, stop=stop, call=call, entries=entries) -> tuple:
            on_device, clean = call()
            clean = bool(clean)
            if clean and entries is None:
                return start, None, None
            automatic = np.asarray(on_device)  # no copy on the CPU
            if clean:
                r, c, values = entries
                with np.errstate(invalid="ignore"):
                    clean = passes(
                        values, automatic[r, col0 + c], noise[start + r],
                        steps[col0 + c], atol, rtol, xp=np,
                    ).all()  # fmt: skip
                if clean:
                    return start, None, None
            return start, tile.rows(start, stop), automatic[: stop - start, col0:col1]

        yield task


def _add_scales(tallies, maxima, count: int, start: int, in_slices) -> None:
    """Raises each tally's per-pair scale (largest finite ``|n|``) by the columns
    ``start .. start + count`` of the numerical Jacobian, given as ``maxima``, their
    largest finite ``|n|`` per output block (``_column_maxima``): screened chunks never
    reach ``Tally.add``, which also keeps it."""
    per_out = np.asarray(maxima)[:count]  # (count, out blocks)
    in_starts = np.array([s.start for s in in_slices], dtype=np.int64)
    in_stops = np.array([s.stop for s in in_slices], dtype=np.int64)
    for j, c0, c1 in overlaps(in_starts, in_stops, start, count):
        local = per_out[c0:c1].max(axis=0)
        for tally in tallies:
            for i, value in enumerate(local):
                tally.scale[i, j] = max(tally.scale.get((i, j), 0.0), float(value))


def _column_maxima(packed: tuple, bounds: Sequence[tuple[int, int]]) -> np.ndarray:
    """The ``(columns, len(bounds))`` largest finite ``|n|`` of each column of a chunk,
    ``packed`` as ``_Tile.pack`` returns it, in each output block ``[lo, hi)`` of
    ``bounds`` (which cover the outputs in order; 0 where a column has no finite
    nonzero entry in a block)."""
    dense, sparse, _, columns = packed
    if dense is not None:
        magnitude = np.abs(dense)
        maxima = np.stack([magnitude[:, lo:hi].max(axis=1, initial=0.0) for lo, hi in bounds], 1)
        if np.isfinite(maxima).all():
            return maxima
        magnitude[~np.isfinite(magnitude)] = 0.0
        return np.stack([magnitude[:, lo:hi].max(axis=1, initial=0.0) for lo, hi in bounds], 1)
    rows, cols, values = sparse
    magnitude = np.abs(values)
    finite = np.isfinite(magnitude)
    flat = cols[finite].astype(np.int64) * len(bounds)
    if len(bounds) > 1:  # each entry's block: the last whose start is at most its row
        starts = np.array([lo for lo, _ in bounds])
        flat += np.searchsorted(starts, rows[finite], side="right") - 1
    maxima = np.zeros(columns * len(bounds))
    np.maximum.at(maxima, flat, magnitude[finite])
    return maxima.reshape(columns, len(bounds))
