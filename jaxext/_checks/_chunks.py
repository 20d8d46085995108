"""Where gradcheck's full method takes its chunks from: the seam of the engines.

``_compare.full_mismatches`` is the one skeleton of the full method: it walks the
numerical Jacobian a chunk of columns at a time, holds the chunks in a tile, and
compares the tile with the VJP rows, a chunk of rows at a time. A ``ChunkSource``
says how the chunks are computed: ``ReferenceChunks`` (here) is the reference path,
plain programs one chunk after the other, every entry compared on the host; an
engine that only makes the check faster supplies its own (``_engines._screened.
ScreenedChunks``: chunks screened on the device, by worker threads), and gives the
same entries, so the same verdicts and reports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from ._jacobians import FlatJacobians

__all__ = ["ChunkSource", "Columns", "HeldColumns", "ReferenceChunks", "Tile", "overlaps"]


@dataclasses.dataclass
class Columns:
    """One chunk of columns of the numerical Jacobian, as a chunk source gives it.

    ``numerical`` is the transposed block (its columns as rows, ``m`` entries each),
    ``steps`` their finite-difference steps, ``forward`` the JVP columns to compare
    (transposed too; ``None`` where there are none to compare).
    """

    start: int
    numerical: np.ndarray
    steps: np.ndarray
    forward: np.ndarray | None = None


class Tile(Protocol):
    """Consecutive columns of the numerical Jacobian held until compared with VJP rows."""

    start: int
    stop: int
    nbytes: int

    def hold(self, chunk: Any) -> None: ...

    def weighted(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


class ChunkSource(Protocol):
    """Where ``full_mismatches`` takes its chunks from: the one seam of the engines."""

    def columns(self) -> Iterable[Columns]:
        """The chunks of columns, in order."""
        ...

    def seen(self, tallies: Iterable[Any], chunk: Any) -> None:
        """Notes a chunk of columns in the tallies beyond what ``Tally.add`` notes."""
        ...

    def tile(self, start: int) -> Tile:
        """An empty tile whose first column is ``start``."""
        ...

    def rows(
        self, tile: Any, steps: np.ndarray, noise: np.ndarray
    ) -> Iterable[tuple[int, np.ndarray, np.ndarray | None]]:
        """``(start, numerical, automatic)`` for each chunk of rows of ``tile``'s columns,
        ``automatic`` ``None`` where the chunk needs no comparison on the host."""
        ...


class ReferenceChunks:
    """The reference path's chunks: plain programs, one chunk after the other.

    Each chunk of columns is computed as it is needed (the differences, then the JVPs
    in forward mode), and the VJP rows are computed a chunk at a time against the
    columns held; every entry is compared on the host.
    """

    def __init__(
        self, *, jac: FlatJacobians, eps: float | np.ndarray, modes: Sequence[str], **_: Any
    ) -> None:
        self.jac, self.eps, self.forward = jac, eps, "fwd" in modes

    def columns(self) -> Iterator[Columns]:
        jac = self.jac
        for start in range(0, jac.n, jac.col_chunk):
            stop = min(jac.n, start + jac.col_chunk)
            numerical, steps = jac.numerical(range(start, stop), self.eps)
            forward = jac.forward(range(start, stop))[1] if self.forward else None
            yield Columns(start, numerical, steps, forward)

    def seen(self, tallies: Iterable[Any], chunk: Columns) -> None:
        """Nothing to note: every entry reaches ``Tally.add``, which keeps the scales."""

    def tile(self, start: int) -> HeldColumns:
        return HeldColumns(start)

    def rows(
        self, tile: HeldColumns, steps: np.ndarray, noise: np.ndarray
    ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        jac = self.jac
        for start in range(0, jac.m, jac.row_chunk):
            stop = min(jac.m, start + jac.row_chunk)
            numerical = tile.rows(start, stop)
            automatic = jac.reverse(range(start, stop))[1][:, tile.start : tile.stop]
            yield start, numerical, automatic


class HeldColumns:
    """The reference path's tile: the chunks of columns (transposed) as they came."""

    def __init__(self, start: int) -> None:
        self.start = self.stop = start
        self.nbytes = 0
        self.chunks: list[np.ndarray] = []

    def hold(self, chunk: Columns) -> None:
        self.chunks.append(chunk.numerical)
        self.nbytes += chunk.numerical.nbytes
        self.stop = chunk.start + chunk.numerical.shape[0]

    def weighted(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(u^T N, |u|^T |N|)`` for the tile's columns ``N`` (all ``m`` rows)."""
        weighted = np.concatenate([chunk @ u for chunk in self.chunks])
        return weighted, np.concatenate([np.abs(chunk) @ np.abs(u) for chunk in self.chunks])

    def rows(self, first: int, stop: int) -> np.ndarray:
        """The dense ``(stop - first, self.stop - self.start)`` block of rows ``[first, stop)``."""
        numerical = np.empty((stop - first, self.stop - self.start))
        offset = 0
        for chunk in self.chunks:
            numerical[:, offset : offset + chunk.shape[0]] = chunk[:, first:stop].T
            offset += chunk.shape[0]
        return numerical


def overlaps(starts: np.ndarray, stops: np.ndarray, first: int, count: int):
    """``(block, lo, hi)`` for each block ``[starts[k], stops[k])`` that meets the chunk
    ``[first, first + count)``: where it lies in the chunk, relative to ``first``."""
    for k in range(np.searchsorted(starts, first, side="right") - 1, len(starts)):
        lo, hi = max(starts[k], first) - first, min(stops[k], first + count) - first
        if lo >= count:
            break
        if hi > lo:
            yield k, lo, hi
