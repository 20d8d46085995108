"""Numerical and automatic Jacobians of a flat function, a chunk at a time.

Everything here works on a function ``f: R^n -> R^m`` of one flat float64
vector (``_problem`` builds it from the caller's pytrees). ``FlatJacobians``
compiles its programs once and then hands out chunks of at most ``CHUNK`` rows
or columns (fewer for wide problems: ``CHUNK_ENTRIES`` bounds each stacked
array), so no caller ever needs the whole ``(m, n)`` Jacobian in memory:

* ``numerical(cols, eps)``: central differences. ``f(x + h e_k)`` and
  ``f(x - h e_k)`` come from two calls of the *same* compiled program on inputs
  that differ only in entry ``k``, with each perturbed input in the same row of
  the batch. An output that the step does not touch is therefore bit-for-bit
  the same on both sides and its difference is exactly zero: a true zero of the
  Jacobian is a numerical zero too, whatever the magnitude of the output. The
  divisor is the step actually taken, ``(x_k + h) - (x_k - h)``.
* ``reverse(rows)``: one VJP per output element with a basis cotangent.
* ``forward(cols)``: one JVP per input element with a basis tangent.
* ``directional(...)``: ``u . J v`` for random unit vectors, numerical and
  automatic, for problems too large for the above.

Rows of a chunk are computed one after the other inside the program
(``jax.lax.map``), not with ``jax.vmap``: checking derivatives must not depend on
the function's batching rule, which ``jaxext.opcheck`` checks on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["CHUNK", "CHUNK_ENTRIES", "FlatJacobians", "chunk_size", "unit_blocks"]

CHUNK = 128  # most rows or columns per compiled call
CHUNK_ENTRIES = 2**21  # most entries of one stacked array per call (16 MiB in float64)

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

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxext._checks._jacobians import FlatJacobians
        >>> with jax.enable_x64(True):
        ...     jac = FlatJacobians(lambda x: x**2, jnp.array([1.0, 2.0]))
        ...     print(jac.numerical(range(2), 1e-6)[0].round(6).tolist())  # transposed
        [[2.0, 0.0], [0.0, 4.0]]
    """

    def __init__(self, f: FlatFn, x0: jax.Array, vjp: Callable | None = None) -> None:
        if vjp is None:

            def vjp(x):
                y, vjp_fn = jax.vjp(f, x)
                return y, lambda u: vjp_fn(u)[0]

        self.f = f
        self.vjp_fn = vjp
        self.x0 = x0
        self.x0_host = np.asarray(x0)
        self.n = int(x0.shape[0])
        self.m = int(jax.eval_shape(f, x0).shape[0])
        n, m = self.n, self.m
        # Columns need stacked inputs and outputs; rows need stacked input-sized gradients.
        self.col_chunk = chunk_size(max(n, m))
        self.row_chunk = chunk_size(n)

        def perturbed(x, ks, values):
            rows = jnp.broadcast_to(x, (ks.shape[0], n)).at[jnp.arange(ks.shape[0]), ks]
            return jax.lax.map(f, rows.set(values))

        def vjp_rows(x, ks, extra):
            # Row k is the pullback of the one-hot cotangent e_k, or of `extra` where k < 0.
            y, pullback = vjp(x)
            return y, jax.lax.map(lambda k: pullback(_basis_or(k, m, extra)), ks)

        def jvp_columns(x, ks, extra):
            y, jvp_fn = jax.linearize(f, x)
            return y, jax.lax.map(lambda k: jvp_fn(_basis_or(k, n, extra)), ks)

        # Two programs serve the full method: the stacked evaluations of f (which also
        # give f(x0)) and the stacked pullbacks (which also give the AD primal and the
        # pullback of any one cotangent). Each compiles once per check.
        self._perturbed = jax.jit(perturbed)
        self._vjp_rows = jax.jit(vjp_rows)
        self._jvp_columns = jax.jit(jvp_columns)
        self._call = jax.jit(f)

    def value(self) -> np.ndarray:
        """``f(x0)``, from the program of ``numerical`` with nothing perturbed."""
        ks = np.zeros(self.col_chunk, dtype=np.int64)
        return np.asarray(self._perturbed(self.x0, ks, self.x0_host[ks]))[0]

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
        ks, count = _padded(cols, self.col_chunk)
        eps = np.broadcast_to(np.asarray(eps, np.float64), (self.n,))[ks]
        plus = self.x0_host[ks] + eps
        minus = self.x0_host[ks] - eps
        steps = plus - minus
        # Two calls of one compiled program, each perturbed input in the same row.
        y_plus = np.asarray(self._perturbed(self.x0, ks, plus))[:count]
        y_minus = np.asarray(self._perturbed(self.x0, ks, minus))[:count]
        steps = steps[:count]
        return (y_plus - y_minus) / steps[:, None], steps

    def numerical_on_device(
        self, cols: Sequence[int] | range, eps: float | np.ndarray
    ) -> tuple[jax.Array, np.ndarray, int]:
        """``numerical``, with the block left on the device and padded to ``col_chunk`` rows.

        Returns:
            ``(block, steps, count)``: the ``(col_chunk, m)`` block (its rows past
            ``count`` repeat the last column), the ``(col_chunk,)`` steps, padded the
            same way, and the number of columns asked for.
        """
        ks, count = _padded(cols, self.col_chunk)
        eps = np.broadcast_to(np.asarray(eps, np.float64), (self.n,))[ks]
        plus = self.x0_host[ks] + eps
        minus = self.x0_host[ks] - eps
        steps = plus - minus
        # Two calls of one compiled program, each perturbed input in the same row.
        y_plus = self._perturbed(self.x0, ks, plus)
        y_minus = self._perturbed(self.x0, ks, minus)
        return _difference_quotient(y_plus, y_minus, steps), steps, count

    def reverse_on_device(self, rows: Sequence[int] | range) -> jax.Array:
        """``reverse``'s block, left on the device and padded to ``row_chunk`` rows."""
        ks, _ = _padded(rows, self.row_chunk)
        return self._vjp_rows(self.x0, ks, np.zeros(self.m))[1]

    def forward_on_device(self, cols: Sequence[int] | range) -> jax.Array:
        """``forward``'s block, left on the device and padded to ``col_chunk`` rows."""
        ks, _ = _padded(cols, self.col_chunk)
        return self._jvp_columns(self.x0, ks, np.zeros(self.n))[1]

    def reverse(self, rows: Sequence[int] | range) -> tuple[np.ndarray, np.ndarray]:
        """``(primal, block)``: rows ``rows`` of the Jacobian, one VJP each."""
        ks, count = _padded(rows, self.row_chunk)
        y, block = self._vjp_rows(self.x0, ks, np.zeros(self.m))
        return np.asarray(y), np.asarray(block)[:count]

    def forward(self, cols: Sequence[int] | range) -> tuple[np.ndarray, np.ndarray]:
        """``(primal, block)``: columns ``cols`` of the Jacobian, one JVP each, as the
        rows of ``block`` (shape ``(len(cols), m)``, like ``numerical``)."""
        ks, count = _padded(cols, self.col_chunk)
        y, block = self._jvp_columns(self.x0, ks, np.zeros(self.n))
        return np.asarray(y), np.asarray(block)[:count]

    def vjp(self, cotangent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(primal, J^T u)`` for one cotangent ``u`` (from the program of ``reverse``)."""
        ks = np.full(self.row_chunk, -1, dtype=np.int64)
        y, block = self._vjp_rows(self.x0, ks, np.asarray(cotangent, np.float64))
        return np.asarray(y), np.asarray(block[0])

    def jvp(self, tangent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(primal, J v)`` for one tangent ``v`` (from the program of ``forward``)."""
        ks = np.full(self.col_chunk, -1, dtype=np.int64)
        y, block = self._jvp_columns(self.x0, ks, np.asarray(tangent, np.float64))
        return np.asarray(y), np.asarray(block[0])

    def difference(self, direction: np.ndarray, eps: float) -> tuple[np.ndarray, float]:
        """``(f(x0 + eps v) - f(x0 - eps v), 2 eps)``, both sides from one program."""
        plus = jnp.asarray(self.x0_host + eps * direction)
        minus = jnp.asarray(self.x0_host - eps * direction)
        return np.asarray(self._call(plus)) - np.asarray(self._call(minus)), 2 * eps


@jax.jit
def _difference_quotient(y_plus: jax.Array, y_minus: jax.Array, steps: jax.Array) -> jax.Array:
    return (y_plus - y_minus) / steps[:, None]


def unit_blocks(rng: np.random.Generator, slices: Sequence[slice], size: int) -> np.ndarray:
    """A vector of ``size`` entries holding an independent unit vector in each slice."""
    vector = np.zeros(size)
    for block in slices:
        part = rng.standard_normal(block.stop - block.start)
        norm = np.linalg.norm(part)
        vector[block] = part / norm if norm > 0 else part
    return vector
