"""The entrywise comparison of numerical and automatic derivatives, block by block.

An entry passes when ``|analytical - numerical| <= allowed`` with

    allowed = atol + rtol * |numerical| + NOISE_ULPS * eps64 * |f(x)| / step

The last term is the finite difference's rounding noise (``f(x + h)`` and ``f(x - h)``
carry a few ulps of ``|f(x)|``, magnified by dividing by the step): an output of 1e6
differenced with a step of 2e-6 resolves a derivative to about 1e-3 at best, while for
outputs of order one the term is about 1e-9. (A true zero of the Jacobian needs no
allowance: ``_jacobians`` makes it exact.) An entry that fails is judged again with the
differences' own error, estimated from several steps (``_fd_error``; ``Tally.mismatches``,
``cotangent_mismatches``); where they cannot resolve it to the tolerance asked, it is
*unresolved* (``Mismatch.unresolved``), neither passed nor failed.

``full_mismatches`` compares the full Jacobians without ever holding them (the
reference path, the counterpart of PyTorch's ``_slow_gradcheck``): it walks the
numerical Jacobian a chunk of columns at a time and holds the chunks until
``TILE_BYTES`` are held; then it streams the automatic Jacobian a chunk of rows at
a time against those columns. Memory stays bounded for any size; a dense Jacobian
simply takes several passes over the VJPs. (Large problems take the screened
engine, ``_screened``, which gives the same verdicts and reports faster.)
``directional_mismatches`` compares ``u . J v`` for random unit vectors.
Both return ``Mismatch`` records: the worst entry of each failing pair of an
output block and an input block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._chunks import ChunkSource, ReferenceChunks, overlaps
from ._fd_error import refine
from ._jacobians import FlatJacobians, unit_blocks

__all__ = [
    "EPS64",
    "NOISE_ULPS",
    "REFINE_MAX_ENTRIES",
    "TILE_BYTES",
    "Mismatch",
    "Refiner",
    "Tally",
    "block_mismatches",
    "cotangent_mismatches",
    "directional_mismatches",
    "entry_mismatches",
    "full_mismatches",
    "leaf_mismatches",
    "tolerated",
    "unravel",
    "widened",
    "worst_entry",
]

NOISE_ULPS = 4.0
TILE_BYTES = 2**27  # numerical-Jacobian columns held at once (128 MiB)
EPS64 = float(np.finfo(np.float64).eps)


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
    # Set where the pair's gradients are all below 1 in magnitude and ``atol`` was scaled by
    # the largest of them (``allowed`` then holds ``atol * atol_scale``): the report says so.
    atol_scale: float | None = None
    # Set where no entry fails and the differences cannot resolve some (``Tally``):
    # neither PASS nor FAIL; ``count`` counts those entries.
    unresolved: bool = False


class Tally:
    """Counts failing entries per block pair and keeps the worst of each.

    An entry fails when ``|a - n| > atol + rel`` (``rel = rtol |n| + noise``). Per
    pair, ``atol`` also scales with the pair's largest ``|n|`` when that is below 1
    (``atol * scale``): a gradient whose entries are all below ``atol`` (an L2 penalty
    of ``1e-6``) is then still held to ``rtol`` against its own size, and a 2x error is
    caught. The entries that pass ``atol`` but not ``rel`` are kept (up to
    ``_KEPT`` per pair) until the pair's scale is known, at the end.

    An entry that fails this plain test is judged again with the finite differences'
    own error (``_fd_error.refine``, given to ``mismatches``): it fails only where
    ``|a - D| > atol + rtol |D| + error`` too, ``D`` being the difference at the
    step that resolves the entry best and ``error`` its estimated error. Within
    that, it passes where ``error <= atol + rtol |D|`` (the differences resolve it to
    the tolerance asked), and is *unresolved* where the error is larger (an
    ill-conditioned function). An entry no step resolves (``_fd_error``) passes
    within the caller's ``atol``, never scaled, as PyTorch holds every entry, and is
    unresolved beyond it. A pair with unresolved entries and no failing one is a
    ``Mismatch`` with ``unresolved`` set. For that, the entries that could fail (over ``rel``
    by more than half the smallest ``atol`` they can get, as the screened engine's
    screen) are kept with their positions, up to ``_KEPT`` per pair; a pair with
    more keeps its plain verdict.
    """

    _KEPT = 2**16

    def __init__(
        self,
        out_slices: Sequence[slice],
        in_slices: Sequence[slice],
        atol: float,
        rtol: float = 0.0,
    ):
        self.atol = atol
        self.rtol = rtol
        # Entries that could fail, per pair: (rows, cols, expected, actual, relative).
        self.candidates: dict[tuple[int, int], list[tuple[np.ndarray, ...]]] = {}
        self.candidate_counts: dict[tuple[int, int], int] = {}
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
        for i, r0, r1 in overlaps(self.out_starts, self.out_stops, row0, rows):
            for j, c0, c1 in overlaps(self.in_starts, self.in_stops, col0, cols):
                e = expected[r0:r1, c0:c1]
                finite = np.isfinite(e)
                scale = float(np.max(np.abs(e), where=finite, initial=0.0))
                self.scale[i, j] = max(self.scale.get((i, j), 0.0), scale)
                with np.errstate(invalid="ignore"):
                    over = error[r0:r1, c0:c1] - relative[r0:r1, c0:c1]
                    within = over <= 0
                if within.all():
                    continue
                with np.errstate(invalid="ignore"):
                    keep = ~within & ~np.isnan(over)  # NaNs fail the entrywise test
                    # What could fail once the pair's atol is known (at least atol *
                    # min(1, |n|)); the screened engine's screen leaves out no such entry.
                    floor = 0.5 * self.atol * np.where(finite, np.minimum(np.abs(e), 1.0), 0.0)
                    could = ~(over <= floor)
                if could.any():
                    self._keep_candidates(
                        (i, j), row0 + r0, col0 + c0, could, e, actual[r0:r1, c0:c1],
                        relative[r0:r1, c0:c1],
                    )  # fmt: skip
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

    def _keep_candidates(self, pair, row0, col0, could, expected, actual, relative) -> None:
        """Keeps the entries ``could`` of a block (from ``(row0, col0)`` on), up to ``_KEPT``
        per pair (past that, only their count)."""
        r, c = np.nonzero(could)
        total = self.candidate_counts.get(pair, 0) + r.size
        self.candidate_counts[pair] = total
        if total > self._KEPT:
            self.candidates.pop(pair, None)
            return
        self.candidates.setdefault(pair, []).append(
            (r + row0, c + col0, expected[r, c], actual[r, c], relative[r, c])
        )

    def mismatches(self, refine: Refiner | None = None) -> list[Mismatch]:
        """The failing pairs; with ``refine`` (where it is ``on``), judged again with the
        finite differences' own error."""
        found = self._plain_mismatches()
        if refine is not None and found and refine.on():
            self._refined(found, refine)
        return [found[key] for key in sorted(found)]

    def _refined(self, found: dict, refine: Refiner) -> None:
        """Judges the kept entries of the failing pairs ``found`` again (see the class)."""
        pairs, parts = [], []
        for key in sorted(found):
            if key not in self.candidates or self.candidate_counts[key] > self._KEPT:
                continue  # more entries than kept: the plain verdict stands
            kept = zip(*self.candidates[key], strict=True)
            rows, cols, e, a, rel = (np.concatenate(x) for x in kept)
            scale = self.scale.get(key, 0.0)
            atol = self.atol * scale if 0.0 < scale < 1.0 else self.atol
            error = np.abs(a - e)
            with np.errstate(invalid="ignore"):
                fails = ~(error <= atol + rel)
            pairs.append((key, scale, atol))
            parts.append((rows, cols, e, a, rel, error, fails, fails & np.isfinite(error)))
        if not pairs:
            return
        ask = [(p[0][p[7]], p[1][p[7]]) for p in parts]
        rows = np.concatenate([r for r, _ in ask])
        cols = np.concatenate([c for _, c in ask])
        estimate, fd_error, resolved = refine(rows, cols)
        offset = 0
        for (key, scale, atol), part in zip(pairs, parts, strict=True):
            p_rows, p_cols, e, a, rel, error, fails, asked = part
            k = slice(offset, offset + int(asked.sum()))
            offset = k.stop
            expected, allowed = e.copy(), atol + rel
            tolerance = atol + self.rtol * np.abs(estimate[k])
            allowed_refined = np.where(resolved[k], tolerance + fd_error[k], self.atol + rel[asked])
            expected_refined = np.where(resolved[k], estimate[k], e[asked])
            within = np.abs(a[asked] - expected_refined) <= allowed_refined
            # Within its allowance, an entry passes where the differences resolve it to
            # the tolerance asked; else they cannot tell: unresolved, as is an entry no
            # step resolves that fails the plain test (never a FAIL).
            passes = within & resolved[k] & (fd_error[k] <= tolerance)
            passes |= within & ~resolved[k]
            unresolved = np.zeros_like(fails)
            unresolved[np.nonzero(asked)[0]] = ~passes & (~resolved[k] | within)
            fails[np.nonzero(asked)[0][passes]] = False
            fails &= ~unresolved
            # A refined entry is reported with its refined difference and allowance.
            expected[asked] = expected_refined
            allowed[asked] = allowed_refined
            if not fails.any() and not unresolved.any():
                del found[key]
                continue
            bad = fails if fails.any() else unresolved
            with np.errstate(invalid="ignore"):
                excess = np.abs(a - expected) - allowed
            w = worst_entry(excess, bad)
            i, j = key
            found[key] = Mismatch(
                i, j, int(p_rows[w] - self.out_starts[i]), int(p_cols[w] - self.in_starts[j]),
                None, float(expected[w]), float(a[w]), float(allowed[w]), int(bad.sum()),
                self.out_sizes[i] * self.in_sizes[j],
                atol_scale=scale if 0.0 < scale < 1.0 else None, unresolved=not fails.any(),
            )  # fmt: skip

    def _plain_mismatches(self) -> dict[tuple[int, int], Mismatch]:
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
                total, atol_scale=scale,
            )  # fmt: skip
        return found


def tolerated(expected, atol: float, rtol: float, noise) -> np.ndarray:
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
    allowed = tolerated(expected, atol, rtol, 0.0)
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
    wide: Callable[[], bool] = lambda: True,
    chunks: Callable[..., ChunkSource] | None = None,
) -> dict[str, list[Mismatch]]:
    """Entrywise comparison of the full Jacobians, per mode (``"rev"``, ``"fwd"``).

    An entry that fails is judged again with the finite differences' own error
    (``Refiner``; ``wide`` says whether the function computes in float64).

    The numerical Jacobian is computed a chunk of columns at a time; forward mode's
    columns are compared as they come, and for reverse mode the columns are held until
    ``TILE_BYTES`` are held (or the last one comes), then compared with the VJP rows,
    computed a chunk of rows at a time (``_stream_rows``). Where the chunks come from
    is ``chunks``'s business: ``ReferenceChunks`` (the default, the reference path), or
    an engine's source that only makes it faster (``_engines._screened.ScreenedChunks``),
    built with the keyword arguments ``jac, eps, noise, atol, rtol, modes, out_slices,
    in_slices``.

    With a ``cotangent`` ``u`` (reverse mode), the rows of the numerical Jacobian are
    also summed into ``u^T J`` as they stream by, and compared with the VJP of ``u``
    itself: one-hot cotangents cannot tell a backward linear in its cotangent from one
    that is not (``|g|`` in place of ``g``). The allowance is the sum of the entries'
    allowances weighted by ``|u|``, so a backward that passes entry by entry and is
    linear always passes.

    Returns:
        For each mode, the failing block pairs in output-major order; with a
        ``cotangent``, also ``"rev_cotangent"``: the input blocks whose VJP of it differs.
    """
    n, m = jac.n, jac.m
    tallies = {mode: Tally(out_slices, in_slices, atol, rtol) for mode in modes}
    if n == 0 or m == 0:
        return {mode: [] for mode in modes}
    linear = None
    if cotangent is not None and "rev" in modes:
        linear = (np.asarray(cotangent, np.float64), np.zeros(n), np.zeros(n))
    noise = NOISE_ULPS * EPS64 * np.abs(y0)
    steps = np.empty(n)
    source = (chunks or ReferenceChunks)(
        jac=jac, eps=eps, noise=noise, atol=atol, rtol=rtol, modes=modes,
        out_slices=out_slices, in_slices=in_slices,
    )  # fmt: skip
    tile = source.tile(0)
    for chunk in source.columns():
        start, numerical = chunk.start, chunk.numerical
        stop = start + numerical.shape[0]
        steps[start:stop] = chunk.steps
        source.seen(tallies.values(), chunk)
        if chunk.forward is not None:
            relative = tolerated(numerical, 0.0, rtol, noise[None, :] / chunk.steps[:, None])
            tallies["fwd"].add(0, start, numerical.T, chunk.forward.T, relative.T)
        if "rev" in modes:
            tile.hold(chunk)
            if tile.nbytes >= TILE_BYTES or stop == n:
                _stream_rows(source, tile, steps, noise, atol, rtol, tallies["rev"], linear)
                tile = source.tile(stop)
    refine_fn = Refiner(jac, eps, wide)
    results = {mode: tally.mismatches(refine_fn) for mode, tally in tallies.items()}
    if linear is not None:
        results["rev_cotangent"] = cotangent_mismatches(jac, linear, in_slices, refine_fn, rtol)
    return results


# Most entries (failing input elements times outputs) that ``cotangent_mismatches`` refines.
REFINE_MAX_ENTRIES = 2**22


def cotangent_mismatches(
    jac: FlatJacobians,
    linear: tuple[np.ndarray, np.ndarray, np.ndarray],
    in_slices: Sequence[slice],
    refine_fn: Refiner | None,
    rtol: float,
) -> list[Mismatch]:
    """The random-cotangent comparison of ``full_mismatches``: the VJP of ``u`` against
    ``u^T N``, with the allowance summed from the entries' plain allowances; an input
    element that fails that is judged again with the finite differences' own error
    (``_fd_error.refine`` of its whole column: ``u^T`` times the refined differences,
    and ``sum_i |u_i| error_i`` more allowed), up to ``REFINE_MAX_ENTRIES`` entries.
    A column with an entry no step resolves, or whose error exceeds the tolerance, is
    unresolved rather than failed or passed (``Tally``); with no failing column, the
    unresolved ones are returned, one ``Mismatch`` per input block, ``unresolved`` set."""
    u, expected, allowed = linear
    actual = jac.vjp(u)[1]
    found = block_mismatches(expected, actual, allowed, in_slices, on_inputs=True)
    if not found or refine_fn is None or not refine_fn.on():
        return found
    with np.errstate(invalid="ignore"):
        error = np.abs(actual - expected)
        cols = np.nonzero(~(error <= allowed) & np.isfinite(error))[0]
    rows = np.nonzero(u)[0]
    if cols.size == 0 or cols.size * rows.size > REFINE_MAX_ENTRIES:
        return found
    grid_cols, grid_rows = np.repeat(cols, rows.size), np.tile(rows, cols.size)
    estimate, fd_error, resolved = refine_fn(grid_rows, grid_cols)
    shape = (cols.size, rows.size)
    estimate = estimate.reshape(shape)
    fd_error = np.where(resolved, fd_error, 0.0).reshape(shape)
    weight = np.abs(u[rows])
    expected_refined = estimate @ u[rows]
    tolerance = allowed[cols] + rtol * (np.abs(estimate) @ weight)
    allowed_refined = tolerance + fd_error @ weight
    within = np.abs(actual[cols] - expected_refined) <= allowed_refined
    # As entrywise (``Tally``): a column with an entry no step resolves, or resolved
    # only beyond the tolerance, is unresolved where it is within its allowance (and
    # where it is not, if an entry of it is not resolved); it fails otherwise.
    unresolved_entry = (~resolved.reshape(shape) & (weight > 0)).any(axis=1)
    passes = within & ~unresolved_entry & (fd_error @ weight <= tolerance)
    unresolved = ~passes & (within | unresolved_entry)
    expected, allowed = expected.copy(), allowed.copy()
    expected[cols] = expected_refined
    allowed[cols] = np.where(passes | unresolved, np.inf, allowed_refined)
    found = block_mismatches(expected, actual, allowed, in_slices, on_inputs=True)
    if found or not unresolved.any():
        return found
    # No column fails: the unresolved ones, one record per input block.
    allowed[cols] = np.where(unresolved, -1.0, np.inf)  # flags exactly the unresolved
    records = block_mismatches(expected, actual, allowed, in_slices, on_inputs=True)
    allowed[cols] = allowed_refined
    return [
        dataclasses.replace(
            m, allowed=float(allowed[in_slices[m.in_block]][m.in_element]), unresolved=True
        )
        for m in records
    ]


class Refiner:
    """The ``refine`` of ``Tally.mismatches`` and ``cotangent_mismatches`` for a check:
    ``_fd_error.refine`` of its Jacobians at its step, a function of ``(rows, cols)``.

    ``on()`` says whether it applies: ``wide()`` (asked once, only where an entry
    fails) is false for a function computed in lower precision (an output that is not
    float64; in ``gradgradcheck``, a backward that returns float32 gradients): the
    differences' error is then not estimated, and the plain test stands.
    """

    def __init__(
        self, jac: FlatJacobians, eps: float | np.ndarray, wide: Callable[[], bool]
    ) -> None:
        self.jac, self.eps, self.wide = jac, eps, wide
        self._on: bool | None = None

    def on(self) -> bool:
        if self._on is None:
            self._on = bool(self.wide())
        return self._on

    def __call__(self, rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, ...]:
        return refine(self.jac, rows, cols, self.eps)


def _stream_rows(
    source: ChunkSource, tile: Any, steps, noise, atol, rtol, tally: Tally, linear
) -> None:
    """Compares the columns held in ``tile`` with the VJP rows, a chunk of rows at a time
    (``source.rows``; a chunk it finds clean needs no comparison on the host); with
    ``linear = (u, sum, allowance)``, adds ``u^T`` times the tile to ``sum`` and the
    ``|u|``-weighted sum of its entries' allowances to ``allowance``."""
    col0, col1 = tile.start, tile.stop
    if linear is not None:
        # sum_i |u_i| (atol + rtol |n_ij| + noise_i / step_j), term by term.
        u, total, allowance = linear
        weighted, weighted_magnitude = tile.weighted(u)
        total[col0:col1] += weighted
        noise_share = np.abs(u) @ noise / steps[col0:col1]
        allowance[col0:col1] += atol * np.abs(u).sum() + rtol * weighted_magnitude + noise_share
    for start, numerical, automatic in source.rows(tile, steps, noise):
        if automatic is None:  # passed a screen
            continue
        stop = start + numerical.shape[0]
        relative = tolerated(numerical, 0.0, rtol, noise[start:stop, None] / steps[None, col0:col1])
        tally.add(start, col0, numerical, automatic, relative)


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
                noise = NOISE_ULPS * EPS64 * (np.abs(u[out_block]) @ np.abs(y0[out_block]))
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
