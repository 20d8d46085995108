"""The finite differences' own error, estimated from the evaluations themselves.

A central difference ``D(H) = (f(x + H e_k) - f(x - H e_k)) / 2H`` is off the
derivative by two errors:

* truncation, about ``f''' H^2 / 6``: it grows with the step;
* rounding, about ``delta / H``, where ``delta`` is the rounding noise of the
  *computed* ``f`` near ``x``. That noise is not a few ulps of ``|f(x)|``: in
  ``1 - tanh(x)`` at ``x = 10`` it is the ulp of the intermediate ``tanh(x)``
  (about ``1.1e-16``, while ``|f| = 4e-9``), so the difference at ``H = 1e-6``
  carries an error of about ``1e-10``, 1% of ``f' = -8e-9``. No bound taken from
  ``|f|`` alone sees it.

Neither can be known beforehand; both show in how the differences at several
steps disagree. ``refine`` evaluates the central differences of the entries it
is asked about at ``STEPS`` steps ``H_j = h * RATIO**(j - BELOW)``, from ``h / 10``
to ``1000 h`` (``h`` the check's step; the steps are not powers of two apart, so
that values rounded to the same grid cannot agree exactly by accident). Each step
from ``h`` to ``100 h`` is judged against its ``WIDTH`` neighbours on each side:
the disagreement of a side is ``max |D(H_j) - D(H_i)|`` over its steps (all
finite). Only the steps on one side are *valid* for the entry: those where its
error shrinks, the smaller steps where truncation dominates, the larger where
rounding does. There the disagreement bounds the error of ``D(H_j)`` (up to the
neighbours' own, a factor ``RATIO`` or ``RATIO**2`` smaller per step); on the
other side the error grows by at least ``RATIO`` per step, so its disagreement is
larger than the error, by up to ``RATIO**4 = 100`` for truncation. So the side
that agrees better is the valid one, and its disagreement is ``e_j``. Of the
steps where ``e_j <= RESOLVED * |D(H_j)|``, the one with the smallest ``e_j``
gives the estimate ``D(H_j)`` and its error ``SAFETY * e_j``: the step where the
function's values resolve its derivative best, and how well. The check's own step
is one of them, so the error is never larger than what the differences resolve
there: a derivative wrong by more than that always fails. (Taking the largest
disagreement over both sides, as before issue #43, let the truncation of steps
100 times larger excuse a 3% error of ``sin(3000 x)``'s derivative, which the
differences at ``h`` resolve to ``1.5e-6``.)

An entry with no such step is *unresolved*: its differences are not finite, or
disagree by more than a tenth, on both sides of every step. Its values leave the
function's domain, or jump: a derivative that jumps at ``x`` (``jnp.max`` at a
tie, differentiated twice) gives differences that grow as ``1 / H``, like
rounding, but of the size of the values themselves, and no step agrees with its
neighbours. (Differences that are exactly zero at every step resolve a zero
derivative: the values do not change.) See ``_compare.Tally`` for the verdicts:
an entry resolved only beyond the tolerance asked (an ill-conditioned function),
or not at all, is *unresolved*, neither PASS nor FAIL, unless it is wrong by more
than the differences resolve.

Only entries that fail the plain test (``_compare``) are refined, a chunk of
columns at a time through a program for the differences compiled as the quick
engine's are, whatever engine runs the check (``FlatJacobians.refine_numerical``: the
differences it judges and reports are the same bits on every engine): a correct
function whose differences already agree costs nothing more.
"""

from __future__ import annotations

import numpy as np

from ._jacobians import FlatJacobians

__all__ = ["BELOW", "RATIO", "RESOLVED", "SAFETY", "STEPS", "WIDTH", "refine"]

RATIO = 10.0**0.5  # between consecutive steps
STEPS = 9  # steps h / 10, ..., h * RATIO**6 (1000 h)
BELOW = 2  # of them below the check's step h: the first step judged is h itself
WIDTH = 2  # neighbours on each side that a step is compared with
SAFETY = 2.0  # the error bound is this times the disagreement of the valid side
RESOLVED = 0.1  # a step resolves an entry where its disagreement is at most this relative


def refine(
    jac: FlatJacobians,
    rows: np.ndarray,
    cols: np.ndarray,
    eps: float | np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The refined numerical derivative of the entries ``(rows[i], cols[i])``.

    Args:
        jac: the check's Jacobians (``FlatJacobians.refine_numerical`` runs the
            differences).
        rows, cols: the entries (output, input element), flat positions.
        eps: the check's step, one for all inputs or one per input element.

    Returns:
        ``(estimate, error, resolved)``: per entry, the difference at the step that
        resolves it best (at the check's own step where none does), ``SAFETY`` times its
        disagreement with the steps on its valid side (infinite where no step resolves
        it), and whether a step resolves it.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jaxext._checks._fd_error import refine
        >>> from jaxext._checks._jacobians import FlatJacobians
        >>> with jax.enable_x64(True):
        ...     jac = FlatJacobians(lambda x: jnp.sin(3000.0 * x), jnp.array([0.25]))
        ...     estimate, error, resolved = refine(jac, np.array([0]), np.array([0]), 1e-6)
        >>> bool(resolved[0]), bool(error[0] < 1e-5 * abs(estimate[0]))  # not 1e-2
        (True, True)
    """
    rows = np.asarray(rows, np.int64)
    cols = np.asarray(cols, np.int64)
    count = rows.shape[0]
    estimate, error, resolved = np.zeros(count), np.full(count, np.inf), np.zeros(count, bool)
    if count == 0:
        return estimate, error, resolved
    base = np.broadcast_to(np.asarray(eps, np.float64), (jac.n,))
    columns = np.unique(cols)
    for start in range(0, columns.shape[0], jac.col_chunk):
        chunk = columns[start : start + jac.col_chunk]
        where = np.searchsorted(chunk, cols)
        mine = (where < chunk.shape[0]) & (chunk[np.minimum(where, chunk.shape[0] - 1)] == cols)
        picked = np.nonzero(mine)[0]
        at = (where[picked], rows[picked])
        differences = np.stack(
            [jac.refine_numerical(chunk, base * RATIO ** (j - BELOW))[0][at] for j in range(STEPS)]
        )  # (STEPS, entries of this chunk)
        estimate[picked], error[picked], resolved[picked] = _best(differences)
    return estimate, error, resolved


def _best(differences: np.ndarray) -> tuple[np.ndarray, ...]:
    """``(estimate, error, resolved)`` from the differences at each step (shape
    ``(STEPS, entries)``, the check's own step at ``BELOW``); see ``refine``."""
    steps, count = differences.shape
    usable = np.isfinite(differences)
    best_error = np.full(count, np.inf)
    best = differences[BELOW].copy()  # where no step resolves the entry: the check's own
    for j in range(max(WIDTH, BELOW), steps - WIDTH):
        sides = []
        for side in (range(j - WIDTH, j), range(j + 1, j + WIDTH + 1)):
            with np.errstate(invalid="ignore"):
                disagreement = np.max([np.abs(differences[j] - differences[i]) for i in side], 0)
            ok = np.logical_and.reduce([usable[i] for i in side])
            sides.append(np.where(ok & usable[j], disagreement, np.inf))
        worst = np.minimum(*sides)  # the valid side: the one that agrees better
        with np.errstate(invalid="ignore"):
            better = (worst < best_error) & (worst <= RESOLVED * np.abs(differences[j]))
        best_error = np.where(better, worst, best_error)
        best = np.where(better, differences[j], best)
    return best, SAFETY * best_error, np.isfinite(best_error)
