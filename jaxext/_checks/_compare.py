"""The entrywise comparison of numerical and automatic derivatives, block by block.

An entry passes when ``|analytical - numerical| <= allowed`` with

    allowed = atol + rtol * |numerical| + NOISE_ULPS * eps64 * |f(x)| / step

The last term is the rounding noise of the finite difference itself: both
``f(x + h)`` and ``f(x - h)`` carry a few ulps of ``|f(x)|``, and dividing their
difference by the step magnifies that. It is what makes the check scale-aware:
an output of 1e6 differenced with a step of 2e-6 cannot resolve a derivative to
better than about 1e-3, so no correct function fails for lack of resolution,
while for outputs of order one the term is about 1e-9 and changes nothing. (A
true zero of the Jacobian needs no allowance: ``_jacobians`` makes it exact.)

``full_mismatches`` compares the full Jacobians without ever holding them: it
walks the numerical Jacobian a chunk of columns at a time and holds the chunks
(as their nonzero entries where that is smaller: exact zeros are the rule for
large problems, where an output depends on few inputs) until ``TILE_BYTES`` are
held; then it streams the automatic Jacobian a chunk of rows at a time against
that tile. Memory stays bounded for any size; a dense Jacobian simply takes
several passes over the VJPs.
From ``SCREEN_MIN_ENTRIES`` Jacobian entries up, each pair of chunks (numerical and
automatic) is first screened on the device, where the automatic chunk was computed:
one fused pass tells whether every entry passes with room to spare (its error at
most half of the smallest allowance the entry can get, whatever the final scale
of its block pair), and only a chunk that does not goes through the exact
comparison on the host. A screened chunk cannot hold a failing entry, nor the
worst entry of a failing pair, so verdicts and error reports are unchanged; the
host work of a passing check shrinks to copying the numerical columns once.
The chunks of a screened problem are computed by ``WORKERS`` threads
(``_in_order``): JAX runs the programs of one thread one after the other, those of
two threads on two cores at once, and the host copies of one chunk overlap the
computation of the next. The results are consumed in order, each computed exactly
as it would be alone, so nothing depends on the threads.
``directional_mismatches`` compares ``u . J v`` for random unit vectors.
Both return ``Mismatch`` records: the worst entry of each failing pair of an
output block and an input block.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from ._jacobians import FlatJacobians, passes, unit_blocks

__all__ = [
    "NOISE_ULPS",
    "SCREEN_MIN_ENTRIES",
    "TILE_BYTES",
    "Mismatch",
    "block_mismatches",
    "directional_mismatches",
    "entry_mismatches",
    "full_mismatches",
    "leaf_mismatches",
    "unravel",
    "widened",
    "worst_entry",
]

NOISE_ULPS = 4.0
TILE_BYTES = 2**27  # numerical-Jacobian columns held at once (128 MiB)
# Jacobians from this many entries up are screened chunk by chunk on the device.
SCREEN_MIN_ENTRIES = 2**22
_EPS64 = float(np.finfo(np.float64).eps)
# Threads that compute the chunks of a screened problem (`_in_order`): one more than
# the cores (at most four), so that a thread's host work and waits leave its core to
# another (on 2 cores, 3 threads took 5-8% less time than 2 at 5e7 and 1.5e8 entries).
WORKERS = max(2, min(4, (os.cpu_count() or 1) + 1))

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """The worst failing entry of one (output block, input block) pair.

    ``out_element`` / ``in_element`` are flat positions inside the blocks
    (``None`` where they do not apply); ``direction`` is the index of the
    random direction (or of the batch entry) for checks that have one.
    ``expected`` is the reference value (numerical derivative, plain call,
    first run ...), ``actual`` the value under test.
    """

    out_block: int | None
    in_block: int | None
    out_element: int | None
    in_element: int | None
    direction: int | None
    expected: float
    actual: float
    allowed: float
    count: int
    total: int


class _Tally:
    """Counts failing entries per block pair and keeps the worst of each.

    An entry fails when ``|a - n| > atol + rel`` (``rel = rtol |n| + noise``). Per
    pair, ``atol`` also scales with the pair's largest ``|n|`` when that is below 1
    (``atol * scale``): a gradient whose entries are all below ``atol`` (an L2 penalty
    of ``1e-6``) is then still held to ``rtol`` against its own size, and a 2x error is
    caught. The entries that pass ``atol`` but not ``rel`` are kept (up to
    ``_KEPT`` per pair) until the pair's scale is known, at the end.
    """

    _KEPT = 2**16

    def __init__(self, out_slices: Sequence[slice], in_slices: Sequence[slice], atol: float):
        self.atol = atol
        self.out_starts = np.array([s.start for s in out_slices], dtype=np.int64)
        self.in_starts = np.array([s.start for s in in_slices], dtype=np.int64)
        self.out_stops = np.array([s.stop for s in out_slices], dtype=np.int64)
        self.in_stops = np.array([s.stop for s in in_slices], dtype=np.int64)
        self.out_sizes = [s.stop - s.start for s in out_slices]
        self.in_sizes = [s.stop - s.start for s in in_slices]
        self.counts: dict[tuple[int, int], int] = {}
        self.worst: dict[tuple[int, int], tuple] = {}
        self.scale: dict[tuple[int, int], float] = {}
        self.excess: dict[tuple[int, int], list[np.ndarray]] = {}
        self.worst_excess: dict[tuple[int, int], tuple] = {}

    def add(self, row0: int, col0: int, expected, actual, relative) -> None:
        error = np.abs(actual - expected)
        allowed = self.atol + relative
        self._scale_relative(row0, col0, expected, actual, error, relative)
        with np.errstate(invalid="ignore"):
            bad = ~(error <= allowed)
        if not bad.any():
            return
        r, c = np.nonzero(bad)
        excess = np.nan_to_num(error[r, c] - allowed[r, c], nan=np.inf)
        rows, cols = r + row0, c + col0
        out_block = np.searchsorted(self.out_starts, rows, side="right") - 1
        in_block = np.searchsorted(self.in_starts, cols, side="right") - 1
        pair = out_block * len(self.in_starts) + in_block
        for key in np.unique(pair):
            members = np.nonzero(pair == key)[0]
            best = members[np.argmax(excess[members])]
            i, j = divmod(int(key), len(self.in_starts))
            self.counts[i, j] = self.counts.get((i, j), 0) + members.size
            candidate = (
                float(excess[best]),
                int(rows[best] - self.out_starts[i]),
                int(cols[best] - self.in_starts[j]),
                float(expected[r[best], c[best]]),
                float(actual[r[best], c[best]]),
                float(allowed[r[best], c[best]]),
            )
            if (i, j) not in self.worst or candidate[0] > self.worst[i, j][0]:
                self.worst[i, j] = candidate

    def _scale_relative(self, row0, col0, expected, actual, error, relative) -> None:
        """Per block pair in this chunk: the largest ``|n|``, and the entries over ``rel``."""
        rows, cols = expected.shape
        for i, r0, r1 in _overlaps(self.out_starts, self.out_stops, row0, rows):
            for j, c0, c1 in _overlaps(self.in_starts, self.in_stops, col0, cols):
                e = expected[r0:r1, c0:c1]
                finite = np.isfinite(e)
                scale = float(np.max(np.abs(e), where=finite, initial=0.0))
                self.scale[i, j] = max(self.scale.get((i, j), 0.0), scale)
                with np.errstate(invalid="ignore"):
                    over = error[r0:r1, c0:c1] - relative[r0:r1, c0:c1]
                    keep = over > 0  # False for NaN: NaNs fail the entrywise test
                if not keep.any():
                    continue
                values = over[keep]
                kept = self.excess.setdefault((i, j), [])
                if sum(v.size for v in kept) < self._KEPT:
                    kept.append(values)
                k = np.unravel_index(worst_entry(over, keep), over.shape)
                candidate = (
                    float(over[k]),
                    int(row0 + r0 + k[0] - self.out_starts[i]),
                    int(col0 + c0 + k[1] - self.in_starts[j]),
                    float(e[k]),
                    float(actual[r0:r1, c0:c1][k]),
                    float(relative[r0:r1, c0:c1][k]),
                )
                if (i, j) not in self.worst_excess or candidate[0] > self.worst_excess[i, j][0]:
                    self.worst_excess[i, j] = candidate

    def mismatches(self) -> list[Mismatch]:
        found = {}
        for (i, j), count in self.counts.items():
            _, out_element, in_element, expected, actual, allowed = self.worst[i, j]
            total = self.out_sizes[i] * self.in_sizes[j]
            found[i, j] = Mismatch(
                i, j, out_element, in_element, None, expected, actual, allowed, count, total
            )
        for (i, j), worst in self.worst_excess.items():
            scale = self.scale.get((i, j), 0.0)
            if (i, j) in found or not 0.0 < scale < 1.0:
                continue
            atol = self.atol * scale
            if worst[0] <= atol:
                continue
            _, out_element, in_element, expected, actual, relative = worst
            count = int(sum(int(np.sum(v > atol)) for v in self.excess[i, j]))
            total = self.out_sizes[i] * self.in_sizes[j]
            found[i, j] = Mismatch(
                i, j, out_element, in_element, None, expected, actual, atol + relative, count,
                total,
            )  # fmt: skip
        return [found[key] for key in sorted(found)]


def _overlaps(starts: np.ndarray, stops: np.ndarray, first: int, count: int):
    """``(block, lo, hi)`` for each block ``[starts[k], stops[k])`` that meets the chunk
    ``[first, first + count)``: where it lies in the chunk, relative to ``first``."""
    for k in range(np.searchsorted(starts, first, side="right") - 1, len(starts)):
        lo, hi = max(starts[k], first) - first, min(stops[k], first + count) - first
        if lo >= count:
            break
        if hi > lo:
            yield k, lo, hi


def _allowed(expected, atol: float, rtol: float, noise) -> np.ndarray:
    return atol + rtol * np.abs(expected) + noise


def worst_entry(excess: np.ndarray, bad: np.ndarray) -> int:
    """Flat index of the failing entry (``bad``) furthest over its allowance (``excess``,
    ``error - allowed``); a NaN is the furthest of all."""
    return int(np.argmax(np.where(bad, np.nan_to_num(excess, nan=np.inf), -np.inf)))


def unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The index in ``shape`` of the flat position ``flat`` (of a ``Mismatch``)."""
    return tuple(int(i) for i in np.unravel_index(flat, shape))


def block_mismatches(
    expected: np.ndarray,
    actual: np.ndarray,
    allowed: np.ndarray | float,
    slices: Sequence[slice],
    *,
    on_inputs: bool,
    nan_equal: bool = False,
) -> list[Mismatch]:
    """Blocks of two flat vectors where ``|actual - expected| > allowed`` somewhere.

    Args:
        expected, actual: flat vectors (a plain call and an AD primal; two
            gradients ...).
        allowed: the allowance, one for all entries or one per entry.
        slices: the blocks.
        on_inputs: whether the blocks are input blocks (else output blocks).
        nan_equal: a NaN on both sides is the same value (``log(-1)`` is NaN
            however it is computed); else a NaN always fails.

    Returns:
        One ``Mismatch`` per failing block, in order: its worst entry and count.
    """
    error = np.abs(actual - expected)
    allowed = np.broadcast_to(np.asarray(allowed, np.float64), error.shape)
    with np.errstate(invalid="ignore"):
        bad = ~(error <= allowed)
    if nan_equal:
        bad &= ~(np.isnan(expected) & np.isnan(actual))
    found = []
    for index, block in enumerate(slices):
        b = bad[block]
        if not b.any():
            continue
        worst = worst_entry(error[block] - allowed[block], b)
        e, a, tol = expected[block], actual[block], allowed[block]
        out_block, in_block = (None, index) if on_inputs else (index, None)
        out_element, in_element = (None, worst) if on_inputs else (worst, None)
        found.append(
            Mismatch(
                out_block, in_block, out_element, in_element, None, _number(e[worst]),
                _number(a[worst]), float(tol[worst]), int(b.sum()), int(b.size),
            )
        )  # fmt: skip
    return found


def _number(value: Any) -> float | complex:
    """A NumPy scalar as a Python ``float``, or ``complex`` where it is complex."""
    return complex(value) if np.iscomplexobj(value) else float(value)


def widened(value: Any) -> np.ndarray:
    """``value`` as a float64 NumPy array, or complex128 where it is complex (never
    dropping an imaginary part)."""
    value = np.asarray(value)
    return value.astype(np.complex128 if np.iscomplexobj(value) else np.float64)


def entry_mismatches(
    expected: np.ndarray,
    actual: np.ndarray,
    slices: Sequence[slice],
    *,
    atol: float,
    rtol: float,
    on_inputs: bool,
) -> list[Mismatch]:
    """Blocks of two flat vectors that differ by more than ``atol + rtol * |expected|``
    (a NaN on both sides is the same value); see ``block_mismatches``."""
    allowed = _allowed(expected, atol, rtol, 0.0)
    return block_mismatches(expected, actual, allowed, slices, on_inputs=on_inputs, nan_equal=True)


def leaf_mismatches(
    expected: Sequence[np.ndarray],
    actual: Sequence[np.ndarray],
    *,
    atol: float,
    rtol: float,
    normwise: bool,
    nan_equal: bool = False,
) -> list[Mismatch]:
    """``block_mismatches`` of two lists of arrays of the same shapes, one block per array.

    The allowance is ``atol + rtol * |expected|`` entrywise, or with ``normwise``
    ``atol + rtol * max |expected|`` over each array: two programs computing the
    same math round differently, and normwise comparison does not punish entries
    that are small by cancellation. Complex arrays are compared as complex: the
    error and the scale are moduli.
    """
    e = [widened(x).ravel() for x in expected]
    a = [widened(x).ravel() for x in actual]
    stops = np.cumsum([x.size for x in e], dtype=np.int64)
    slices = [slice(int(stop - x.size), int(stop)) for x, stop in zip(e, stops, strict=True)]
    # The scale of an array is that of its finite entries: a NaN (log(-1)) is not a scale.
    scale = [
        np.full(x.size, np.max(np.abs(x), initial=0.0, where=np.isfinite(x)))
        if normwise
        else np.abs(x)
        for x in e
    ]
    flat_e = np.concatenate(e) if e else np.zeros(0)
    flat_a = np.concatenate(a) if a else np.zeros(0)
    allowed = atol + rtol * (np.concatenate(scale) if scale else np.zeros(0))
    return block_mismatches(flat_e, flat_a, allowed, slices, on_inputs=True, nan_equal=nan_equal)


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
class _Columns:
    """One chunk of columns of the numerical Jacobian, on the host, and what goes with it.

    ``numerical`` is the transposed block (``count`` rows); ``maxima`` its largest
    finite ``|n|`` per column and output block (screened problems); ``forward`` the
    JVP columns to compare on the host (``None`` where there are none, or where the
    screen passed them); ``packed`` the block as the tile holds it.
    """

    start: int
    numerical: np.ndarray
    steps: np.ndarray
    maxima: np.ndarray | None = None
    forward: np.ndarray | None = None
    packed: tuple | None = None


def _host_columns(jac: FlatJacobians, eps, forward: bool) -> Iterator[_Columns]:
    """The chunks of columns, one after the other, for the host comparison."""
    for start in range(0, jac.n, jac.col_chunk):
        cols = range(start, min(jac.n, start + jac.col_chunk))
        numerical, steps = jac.numerical(cols, eps)
        automatic = jac.forward(cols)[1] if forward else None
        yield _Columns(start, numerical, steps, forward=automatic)


def _screened_columns(
    jac: FlatJacobians, eps, noise, atol, rtol, *, forward: bool, pack: bool, bounds: tuple
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
            chunk = _Columns(start, host, steps[:count], _column_maxima(packed, bounds))
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


def full_mismatches(
    jac: FlatJacobians,
    y0: np.ndarray,
    out_slices: Sequence[slice],
    in_slices: Sequence[slice],
    *,
    eps: float | np.ndarray,
    atol: float,
    rtol: float,
    modes: Sequence[str],
    cotangent: np.ndarray | None = None,
) -> dict[str, list[Mismatch]]:
    """Entrywise comparison of the full Jacobians, per mode (``"rev"``, ``"fwd"``).

    With a ``cotangent`` ``u`` (reverse mode), the rows of the numerical Jacobian are
    also summed into ``u^T J`` as they stream by, and compared with the VJP of ``u``
    itself: one-hot cotangents cannot tell a backward linear in its cotangent from one
    that is not (``|g|`` in place of ``g``). The allowance is the sum of the entries'
    allowances weighted by ``|u|``, so a backward that passes entry by entry and is
    linear always passes.

    Chunks are screened on the device first (see the module's docstring) where ``jac``
    was built for it (``jac.screened``: ``_gradcheck`` passes ``SCREEN_MIN_ENTRIES``);
    then they are also computed by ``WORKERS`` threads (``_in_order``).

    Returns:
        For each mode, the failing block pairs in output-major order; with a
        ``cotangent``, also ``"rev_cotangent"``: the input blocks whose VJP of it differs.
    """
    n, m = jac.n, jac.m
    tallies = {mode: _Tally(out_slices, in_slices, atol) for mode in modes}
    if n == 0 or m == 0:
        return {mode: [] for mode in modes}
    linear = None
    if cotangent is not None and "rev" in modes:
        linear = (np.asarray(cotangent, np.float64), np.zeros(n), np.zeros(n))
    noise = NOISE_ULPS * _EPS64 * np.abs(y0)
    steps = np.empty(n)
    tile = _Tile(0)
    screen = jac.screened
    if screen:
        tasks = _screened_columns(
            jac, eps, noise, atol, rtol, forward="fwd" in modes, pack="rev" in modes,
            bounds=tuple((s.start, s.stop) for s in out_slices),
        )  # fmt: skip
        columns = _in_order(tasks, WORKERS)
    else:
        columns = _host_columns(jac, eps, "fwd" in modes)
    for chunk in columns:
        start, numerical = chunk.start, chunk.numerical
        stop = start + numerical.shape[0]
        steps[start:stop] = chunk.steps
        if screen:
            _add_scales(tallies.values(), chunk.maxima, stop - start, start, in_slices)
        if chunk.forward is not None:
            relative = _allowed(numerical, 0.0, rtol, noise[None, :] / chunk.steps[:, None])
            tallies["fwd"].add(0, start, numerical.T, chunk.forward.T, relative.T)
        if "rev" in modes:
            tile.append(start, chunk.packed if chunk.packed is not None else tile.pack(numerical))
            if tile.nbytes >= TILE_BYTES or stop == n:
                _stream_rows(
                    jac, tile, steps, noise, atol, rtol, tallies["rev"], linear, screen=screen
                )
                tile = _Tile(stop)
    results = {mode: tally.mismatches() for mode, tally in tallies.items()}
    if linear is not None:
        u, expected, allowed = linear
        actual = jac.vjp(u)[1]
        results["rev_cotangent"] = block_mismatches(
            expected, actual, allowed, in_slices, on_inputs=True
        )
    return results


def _stream_rows(
    jac, tile: _Tile, steps, noise, atol, rtol, tally: _Tally, linear, *, screen: bool = False
) -> None:
    """Compares the columns held in ``tile`` with VJP rows, a chunk of rows at a time;
    with ``linear = (u, sum, allowance)``, adds ``u^T`` times the tile to ``sum`` and the
    ``|u|``-weighted sum of its entries' allowances to ``allowance``.
    With ``screen``, the rows are screened on the device (``_screened_rows``), by
    ``WORKERS`` threads, and a chunk of rows that passes skips the host comparison."""
    col0, col1 = tile.start, tile.stop
    if linear is not None:
        # sum_i |u_i| (atol + rtol |n_ij| + noise_i / step_j), term by term.
        u, total, allowance = linear
        weighted, weighted_magnitude = tile.weighted(u)
        total[col0:col1] += weighted
        noise_share = np.abs(u) @ noise / steps[col0:col1]
        allowance[col0:col1] += atol * np.abs(u).sum() + rtol * weighted_magnitude + noise_share
    if screen:
        tasks = _screened_rows(jac, tile, steps, noise, atol, rtol)
        chunks = _in_order(tasks, WORKERS)
    else:
        chunks = (
            (start, tile.rows(start, stop), jac.reverse(range(start, stop))[1][:, col0:col1])
            for start, stop in _row_chunks(jac)
        )
    for start, numerical, automatic in chunks:
        if automatic is None:  # passed the screen
            continue
        stop = start + numerical.shape[0]
        relative = _allowed(numerical, 0.0, rtol, noise[start:stop, None] / steps[None, col0:col1])
        tally.add(start, col0, numerical, automatic, relative)


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
    reach ``_Tally.add``, which also keeps it."""
    per_out = np.asarray(maxima)[:count]  # (count, out blocks)
    in_starts = np.array([s.start for s in in_slices], dtype=np.int64)
    in_stops = np.array([s.stop for s in in_slices], dtype=np.int64)
    for j, c0, c1 in _overlaps(in_starts, in_stops, start, count):
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


def directional_mismatches(
    jac: FlatJacobians,
    y0: np.ndarray,
    out_slices: Sequence[slice],
    in_slices: Sequence[slice],
    *,
    eps: float | Sequence[float],
    atol: float,
    rtol: float,
    mode: str,
    num_directions: int,
    seed: int,
) -> list[Mismatch]:
    """``u . J v`` per (output block, input block) pair and random direction.

    ``eps`` is the step, one for all input blocks or one per block.
    For direction ``d``, each input block ``j`` gets its own random unit vector
    ``v`` and each output block ``i`` its own random unit vector ``u``; the
    numerical value is ``u . (f(x0 + eps v) - f(x0 - eps v)) / (2 eps)`` with
    ``v`` confined to block ``j``, the automatic one ``vjp(u)[block j] . v``
    (``mode="rev"``) or ``u . jvp(v)[block i]`` (``mode="fwd"``).
    """
    rng = np.random.default_rng(seed)
    block_eps = np.broadcast_to(np.asarray(eps, np.float64), (len(in_slices),))
    shape = (num_directions, len(out_slices), len(in_slices))
    numerical, automatic, allowed = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    for d in range(num_directions):
        v = unit_blocks(rng, in_slices, jac.n)
        u = unit_blocks(rng, out_slices, jac.m)
        for j, in_block in enumerate(in_slices):
            v_j = np.zeros(jac.n)
            v_j[in_block] = v[in_block]
            diff, step = jac.difference(v_j, float(block_eps[j]))
            tangent = jac.jvp(v_j)[1] if mode == "fwd" else None
            for i, out_block in enumerate(out_slices):
                numerical[d, i, j] = u[out_block] @ diff[out_block] / step
                noise = NOISE_ULPS * _EPS64 * (np.abs(u[out_block]) @ np.abs(y0[out_block]))
                allowed[d, i, j] = atol + rtol * abs(numerical[d, i, j]) + noise / step
                if tangent is not None:
                    automatic[d, i, j] = u[out_block] @ tangent[out_block]
        if mode == "rev":
            for i, out_block in enumerate(out_slices):
                u_i = np.zeros(jac.m)
                u_i[out_block] = u[out_block]
                grad = jac.vjp(u_i)[1]
                for j, in_block in enumerate(in_slices):
                    automatic[d, i, j] = grad[in_block] @ v[in_block]
    found = []
    for i in range(len(out_slices)):
        for j in range(len(in_slices)):
            e, a, tol = numerical[:, i, j], automatic[:, i, j], allowed[:, i, j]
            error = np.abs(a - e)
            with np.errstate(invalid="ignore"):
                bad = ~(error <= tol)
            if bad.any():
                d = worst_entry(error - tol, bad)
                found.append(
                    Mismatch(
                        i, j, None, None, d, float(e[d]), float(a[d]), float(tol[d]),
                        int(bad.sum()), num_directions,
                    )
                )  # fmt: skip
    return found
