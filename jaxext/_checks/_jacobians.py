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
* ``vjp``, ``jvp``, ``difference``: one cotangent, one tangent, one direction
  (for the directional method, ``_compare.directional_mismatches``).

Rows of a chunk are computed one after the other inside the program (a
``jax.lax`` loop), not with ``jax.vmap``: checking derivatives must not depend on
the function's batching rule, which ``jaxext.opcheck`` checks on its own.

This is the reference path, the counterpart of PyTorch's ``_slow_gradcheck``:
each program is a plain ``jax.jit``, compiled at its first call. The engines
that only make a check faster subclass it (``_engines.choose`` picks one):
``_quick.QuickJacobians`` compiles the programs quickly, ahead of their first
call, and merges them for small problems; ``_screened.ScreenedJacobians`` also
screens chunks on the device and runs them from worker threads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "CHUNK",
    "CHUNK_ENTRIES",
    "FlatJacobians",
    "basis_or",
    "chunk_size",
    "padded",
    "perturbed",
    "pullback_rows",
    "stacked_quotients",
    "tangent_columns",
    "unit_blocks",
]

CHUNK = 128  # most rows or columns per compiled call
CHUNK_ENTRIES = 2**21  # most entries of one stacked array per call (16 MiB in float64)

FlatFn = Callable[[jax.Array], jax.Array]


def basis_or(k: jax.Array, size: int, extra: jax.Array) -> jax.Array:
    """The one-hot vector ``e_k``, or ``extra`` where ``k < 0``."""
    return jnp.where(k >= 0, (jnp.arange(size) == k).astype(jnp.float64), extra)


def padded(indices: Sequence[int] | range, size: int) -> tuple[np.ndarray, int]:
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

    Three programs serve the full method, each a ``jax.jit`` compiled once per
    check: the stacked evaluations of ``f`` (which also give ``f(x0)`` and the
    difference quotients), the stacked pullbacks (which also give the AD primal and
    the pullback of any one cotangent) and the stacked JVPs (forward mode).

    Args:
        f: flat float64 function ``R^n -> R^m``.
        x0: the point, shape ``(n,)``.
        vjp: ``x -> (f(x), pullback)`` with ``pullback(u) = J(x)^T u``; ``None``
            means ``jax.vjp`` of ``f``.
        m: the number of outputs, where the caller has it (``None``: from
            ``jax.eval_shape`` of ``f``).
        refine_jit: how the program of ``refine_numerical`` compiles (``None``: it is
            the check's own program of the differences).

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
        *,
        m: int | None = None,
        refine_jit: Callable[[Callable], Callable] | None = None,
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
        self.m = int(jax.eval_shape(f, x0).shape[0]) if m is None else int(m)
        # Columns need stacked inputs and outputs; rows need stacked input-sized gradients.
        self.col_chunk = chunk_size(max(self.n, self.m))
        self.row_chunk = chunk_size(self.n)
        self._differences = self._compile(self._differences_fn())
        self._vjp_rows = self._compile(self._rows_fn())
        self._jvp_columns = self._compile(self._columns_fn())
        self._call = jax.jit(f)
        self.refine_jit = refine_jit
        self._refine_program: Callable | None = None

    def _compile(self, fn: Callable) -> Callable:
        """The program of ``fn``: here a plain ``jax.jit`` (engines compile otherwise)."""
        return jax.jit(fn)

    # The programs' functions hold what they need, never ``self`` (a program holding the
    # object that holds it would keep both, executables included, until a garbage
    # collection); engines return others.

    def _differences_fn(self) -> Callable:
        """The differences' function: ``stacked_quotients`` of ``f``."""
        return functools.partial(stacked_quotients, self.f, self.m)

    def _rows_fn(self) -> Callable:
        """The pullbacks' function: ``pullback_rows`` of the VJP."""
        return functools.partial(pullback_rows, self.vjp_fn, self.n, self.m)

    def _columns_fn(self) -> Callable:
        """The JVPs' function: ``tangent_columns`` of ``f``."""
        return functools.partial(tangent_columns, self.f, self.n)

    # -- running them ------------------------------------------------------------------------

    def _run_differences(self, *args) -> tuple:
        """``(quotient, a value of f)`` from the differences' program."""
        return self._differences(*args)

    def _pullbacks(self, ks: np.ndarray, count: int, extra: np.ndarray) -> tuple:
        """``(primal, rows)`` from the pullbacks' program."""
        return self._vjp_rows(self.x0, ks, count, extra)

    def _columns(self, ks: np.ndarray, count: int, extra: np.ndarray) -> tuple:
        """``(primal, block)`` from the JVPs' program."""
        return self._jvp_columns(self.x0, ks, extra)

    def _value_args(self) -> tuple:
        """The arguments of the differences that evaluate ``f(x0)`` (entry 0 set to itself)."""
        ks = np.zeros(self.col_chunk, dtype=np.int64)
        values = self.x0_host[ks]
        return self.x0, ks, values, values, 1

    def _difference_args(self, cols: Sequence[int] | range, eps: float | np.ndarray):
        """``(arguments of the differences, steps, count)`` for the columns ``cols``."""
        ks, count = padded(cols, self.col_chunk)
        eps = np.broadcast_to(np.asarray(eps, np.float64), (self.n,))[ks]
        plus = self.x0_host[ks] + eps
        minus = self.x0_host[ks] - eps
        return (self.x0, ks, plus, minus, count), plus - minus, count

    def refine_numerical(
        self, cols: Sequence[int] | range, eps: float | np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``numerical``, for ``_fd_error.refine``: from the check's own program where
        ``refine_jit`` is ``None``, else from ``stacked_quotients`` compiled by it (built
        at the first call: only a check with an entry to refine pays for it).

        The engines pass a ``refine_jit`` that compiles as their quick programs do (LLVM's
        optimisations off, which computes each operation in the order the program states,
        no sum reordered by vectorisation) wherever their own program is not compiled so
        (the reference path's plain ``jax.jit``, a large problem's): the differences that
        ``refine`` judges and reports are then the same bits on every engine.
        """
        if self.refine_jit is None:
            return self.numerical(cols, eps)
        if self._refine_program is None:
            self._refine_program = self.refine_jit(
                functools.partial(stacked_quotients, self.f, self.m)
            )
        args, steps, count = self._difference_args(cols, eps)
        quotient = np.asarray(self._refine_program(*args)[0])
        return quotient[:count], steps[:count]

    def value(self) -> np.ndarray:
        """``f(x0)``, from the program of ``numerical`` with nothing perturbed."""
        return np.asarray(self._run_differences(*self._value_args())[1])

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

    def reverse(self, rows: Sequence[int] | range) -> tuple[np.ndarray, np.ndarray]:
        """``(primal, block)``: rows ``rows`` of the Jacobian, one VJP each."""
        ks, count = padded(rows, self.row_chunk)
        y, block = self._pullbacks(ks, count, np.zeros(self.m))
        return np.asarray(y), np.asarray(block)[:count]

    def forward(self, cols: Sequence[int] | range) -> tuple[np.ndarray, np.ndarray]:
        """``(primal, block)``: columns ``cols`` of the Jacobian, one JVP each, as the
        rows of ``block`` (shape ``(len(cols), m)``, like ``numerical``)."""
        ks, count = padded(cols, self.col_chunk)
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

    def difference(self, direction: np.ndarray, eps: float) -> tuple[np.ndarray, float]:
        """``(f(x0 + eps v) - f(x0 - eps v), 2 eps)``, both sides from one program."""
        plus = jnp.asarray(self.x0_host + eps * direction)
        minus = jnp.asarray(self.x0_host - eps * direction)
        return np.asarray(self._call(plus)) - np.asarray(self._call(minus)), 2 * eps


# -- the programs' functions (traced) ---------------------------------------------------


def perturbed(f: FlatFn, x, ks, plus, minus, count, j) -> tuple:
    """Iteration ``j`` of the differences' loop: ``(minus side, i, f(x with entry ks[i]
    set))``, iterations ``i`` and ``count + i`` being the two sides of ``ks[i]``. ``x`` is
    copied with the entry set, afresh (carrying the perturbed input and restoring the
    entry made XLA copy it twice)."""
    minus_side = j >= count
    i = jnp.where(minus_side, j - count, j)
    value = jnp.where(minus_side, minus[i], plus[i])
    return minus_side, i, f(x.at[ks[i]].set(value))


def stacked_quotients(f: FlatFn, m: int, x, ks, plus, minus, count) -> tuple:
    """``((f(x + h e_k) - f(x - h e_k)) / step_k, a value of f)`` for the first ``count``
    entries of ``ks``: the same compiled body evaluates both sides, whose values are
    stacked and differenced after the loop."""
    size, steps = ks.shape[0], plus - minus

    def stacked(j, y):
        minus_side, i, value = perturbed(f, x, ks, plus, minus, count, j)
        return y.at[i + size * minus_side].set(value)

    y = jax.lax.fori_loop(0, 2 * count, stacked, jnp.zeros((2 * size, m)))
    return (y[:size] - y[size:]) / steps[:, None], y[0]


def pullback_rows(vjp: Callable, n: int, m: int, x, ks, count, extra) -> tuple:
    """``(f(x), rows)``: row ``i < count`` is the pullback of the one-hot cotangent ``e_k``
    (``k = ks[i]``), or of ``extra`` where ``k < 0``; the rows past ``count`` are zero."""
    y, pullback = vjp(x)

    def body(i, rows):
        return rows.at[i].set(pullback(basis_or(ks[i], m, extra)))

    return y, jax.lax.fori_loop(0, count, body, jnp.zeros((ks.shape[0], n)))


def tangent_columns(f: FlatFn, n: int, x, ks, extra) -> tuple:
    """``(f(x), columns)``: the JVP of ``e_k`` for each ``k`` of ``ks`` (``extra`` where
    ``k < 0``), as rows."""
    y, jvp_fn = jax.linearize(f, x)
    return y, jax.lax.map(lambda k: jvp_fn(basis_or(k, n, extra)), ks)


def unit_blocks(rng: np.random.Generator, slices: Sequence[slice], size: int) -> np.ndarray:
    """A vector of ``size`` entries holding an independent unit vector in each slice."""
    vector = np.zeros(size)
    for block in slices:
        part = rng.standard_normal(block.stop - block.start)
        norm = np.linalg.norm(part)
        vector[block] = part / norm if norm > 0 else part
    return vector
