"""Numerical and automatic Jacobians of a flat function, for ``jaxext.gradcheck``.

Everything here works on a function ``f: R^n -> R^m`` of one flat float64
vector (``jaxext.gradcheck`` builds it from the caller's pytrees), so the
numerics stay independent of how inputs and outputs are labelled:

* ``numerical_jacobian``: central differences, one input element at a time.
* ``reverse_jacobian``: one VJP per output element with a basis cotangent.
* ``forward_jacobian``: one JVP per input element with a basis tangent.
* ``directional_products``: ``u . J v`` for random unit vectors ``u`` (per
  output block) and ``v`` (per input block), numerical and automatic.
* ``*_failures``: the entrywise test ``|a - n| <= atol + rtol * |n|`` per
  (output block, input block) pair, with the worst entry of each failing pair.
* ``run_checks``: all of the above in the order ``jaxext.gradcheck`` wants.

The per-element loops are compiled once per call: ``jax.jit`` of a
``jax.vmap`` over chunks of ``BATCH_SIZE`` basis indices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "BATCH_SIZE",
    "FULL_MAX_ELEMENTS",
    "FULL_MAX_ENTRIES",
    "Failure",
    "directional_failures",
    "directional_products",
    "forward_jacobian",
    "jacobian_failures",
    "numerical_jacobian",
    "primal_failures",
    "reverse_jacobian",
    "run_checks",
]

BATCH_SIZE = 128
# The full method is used when inputs and outputs have at most this many elements
FULL_MAX_ELEMENTS = 4096
# ... and the Jacobian at most this many entries (32 MiB in float64).
FULL_MAX_ENTRIES = 2**22

FlatFn = Callable[[jax.Array], jax.Array]


def _basis(k: jax.Array, n: int, dtype) -> jax.Array:
    return (jnp.arange(n) == k).astype(dtype)


def _map_basis(fn: Callable, n: int, x0: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """Stacks ``fn(k, x0)[0]`` for ``k`` in ``range(n)``; also returns ``fn(k, x0)[1]``,
    which must not depend on ``k``.

    One compilation of ``jax.vmap(fn)``, run on chunks of ``BATCH_SIZE`` indices
    (the last chunk padded). ``x0`` is not batched, so whatever ``fn`` computes
    from ``x0`` alone (a primal, the residuals of a VJP) is computed once per chunk.
    """
    size = max(1, min(BATCH_SIZE, n))
    batched = jax.jit(jax.vmap(fn, in_axes=(0, None), out_axes=(0, None)))
    rows, aux = [], None
    for start in range(0, max(n, 1), size):
        indices = np.clip(np.arange(start, start + size), 0, max(n - 1, 0))
        chunk, aux = batched(jnp.asarray(indices), x0)
        rows.append(np.asarray(chunk)[: max(n - start, 0)])
    return np.concatenate(rows), np.asarray(aux)


def numerical_jacobian(f: FlatFn, x0: jax.Array, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """Returns ``(f(x0), jacobian)``, the ``(m, n)`` Jacobian from central differences,
    one input element at a time."""
    n = x0.shape[0]

    def column(k, x):
        step = eps * _basis(k, n, x.dtype)
        return (f(x + step) - f(x - step)) / (2 * eps), f(x)

    columns, y = _map_basis(column, n, x0)
    return y, columns.T


def reverse_jacobian(f: FlatFn, x0: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """Returns ``(primal, jacobian)`` from ``jax.vjp``; row ``i`` is ``vjp(e_i)``."""
    m = jax.eval_shape(f, x0).shape[0]

    def row(k, x):
        y, vjp_fn = jax.vjp(f, x)
        return vjp_fn(_basis(k, m, y.dtype))[0], y

    rows, y = _map_basis(row, m, x0)
    return y, rows


def forward_jacobian(f: FlatFn, x0: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """Returns ``(primal, jacobian)`` from ``jax.jvp``; column ``j`` is ``jvp(e_j)``."""
    n = x0.shape[0]

    def column(k, x):
        y, tangent = jax.jvp(f, (x,), (_basis(k, n, x.dtype),))
        return tangent, y

    columns, y = _map_basis(column, n, x0)
    return y, columns.T


def _unit_blocks(rng: np.random.Generator, slices: Sequence[slice], size: int) -> np.ndarray:
    """A vector of ``size`` entries holding an independent unit vector in each slice."""
    vector = np.zeros(size)
    for block in slices:
        part = rng.standard_normal(block.stop - block.start)
        norm = np.linalg.norm(part)
        vector[block] = part / norm if norm > 0 else part
    return vector


def _masked(vector: np.ndarray, block: slice) -> jax.Array:
    out = np.zeros_like(vector)
    out[block] = vector[block]
    return jnp.asarray(out)


def directional_products(
    f: FlatFn,
    x0: jax.Array,
    in_slices: Sequence[slice],
    out_slices: Sequence[slice],
    *,
    eps: float,
    mode: str,
    num_directions: int,
    seed: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``u . J v`` per (output block, input block) pair and random direction.

    For direction ``d``, each input block ``j`` gets its own random unit vector
    ``v`` and each output block ``i`` its own random unit vector ``u``; the
    numerical value is ``u . (f(x0 + eps v) - f(x0 - eps v)) / (2 eps)`` with
    ``v`` confined to block ``j``, the automatic one ``vjp(u)[block j] . v``
    (``mode="rev"``) or ``u . jvp(v)[block i]`` (``mode="fwd"``).

    Returns:
        ``(f(x0), primal from AD, numerical, automatic)``; the last two have
        shape ``(num_directions, len(out_slices), len(in_slices))``.
    """
    n, m = x0.shape[0], sum(block.stop - block.start for block in out_slices)
    f_jit = jax.jit(f)
    vjp_jit = jax.jit(lambda x, u: (lambda y, vjp_fn: (y, vjp_fn(u)[0]))(*jax.vjp(f, x)))
    jvp_jit = jax.jit(lambda x, v: jax.jvp(f, (x,), (v,)))
    y_auto = None
    rng = np.random.default_rng(seed)
    shape = (num_directions, len(out_slices), len(in_slices))
    numerical, automatic = np.zeros(shape), np.zeros(shape)
    for d in range(num_directions):
        v = _unit_blocks(rng, in_slices, n)
        u = _unit_blocks(rng, out_slices, m)
        for j, in_block in enumerate(in_slices):
            step = eps * _masked(v, in_block)
            diff = np.asarray(f_jit(x0 + step) - f_jit(x0 - step)) / (2 * eps)
            if mode == "fwd":
                y_auto, tangent = map(np.asarray, jvp_jit(x0, _masked(v, in_block)))
            for i, out_block in enumerate(out_slices):
                numerical[d, i, j] = u[out_block] @ diff[out_block]
                if mode == "fwd":
                    automatic[d, i, j] = u[out_block] @ tangent[out_block]
        if mode == "rev":
            for i, out_block in enumerate(out_slices):
                y_auto, grad = map(np.asarray, vjp_jit(x0, _masked(u, out_block)))
                for j, in_block in enumerate(in_slices):
                    automatic[d, i, j] = grad[in_block] @ v[in_block]
    return np.asarray(f_jit(x0)), y_auto, numerical, automatic


def _mismatches(
    numerical: np.ndarray, automatic: np.ndarray, atol: float, rtol: float
) -> tuple[int, int] | None:
    """``None`` if ``|a - n| <= atol + rtol * |n|`` everywhere (NaN fails), else
    ``(count, worst)``: how many entries fail and the flat position of the one
    exceeding its tolerance by the most."""
    numerical, automatic = np.ravel(numerical), np.ravel(automatic)
    with np.errstate(invalid="ignore"):
        error = np.abs(automatic - numerical)
        tolerance = atol + rtol * np.abs(numerical)
        bad = ~(error <= tolerance)
        if not bad.any():
            return None
        excess = np.where(np.isnan(error), np.inf, error - tolerance)
    return int(bad.sum()), int(np.argmax(np.where(bad, excess, -np.inf)))


@dataclasses.dataclass(frozen=True)
class Failure:
    """One (output block, input block) pair that failed the entrywise test.

    ``worst`` is the flat position of the worst entry within the compared
    values: row-major over ``(output element, input element)`` for a full
    Jacobian block, the output element for a primal, the direction otherwise.
    """

    out_block: int
    in_block: int | None
    worst: int
    numerical: float
    automatic: float
    count: int
    total: int


def _failure(out_block, in_block, numerical, automatic, atol, rtol) -> Failure | None:
    found = _mismatches(numerical, automatic, atol, rtol)
    if found is None:
        return None
    count, worst = found
    num, auto = np.ravel(numerical)[worst], np.ravel(automatic)[worst]
    return Failure(out_block, in_block, worst, float(num), float(auto), count, np.size(numerical))


def primal_failures(y_call, y_auto, out_slices, atol, rtol) -> list[Failure]:
    """Output blocks where the primal from AD differs from the plain call."""
    found = (_failure(i, None, y_call[s], y_auto[s], atol, rtol) for i, s in enumerate(out_slices))
    return [failure for failure in found if failure is not None]


def jacobian_failures(numerical, automatic, out_slices, in_slices, atol, rtol) -> list[Failure]:
    """Failing blocks of full ``(m, n)`` Jacobians, output-major like PyTorch."""
    failures = []
    for i, rows in enumerate(out_slices):
        for j, cols in enumerate(in_slices):
            block = _failure(i, j, numerical[rows, cols], automatic[rows, cols], atol, rtol)
            if block is not None:
                failures.append(block)
    return failures


def directional_failures(numerical, automatic, atol, rtol) -> list[Failure]:
    """Failing pairs of ``directional_products`` results, output-major."""
    _, num_out, num_in = numerical.shape
    failures = []
    for i in range(num_out):
        for j in range(num_in):
            pair = _failure(i, j, numerical[:, i, j], automatic[:, i, j], atol, rtol)
            if pair is not None:
                failures.append(pair)
    return failures


def run_checks(
    f: FlatFn,
    x0: jax.Array,
    in_slices: Sequence[slice],
    out_slices: Sequence[slice],
    *,
    eps: float,
    atol: float,
    rtol: float,
    modes: Sequence[str],
    fast_mode: bool | None,
    num_directions: int,
    seed: int,
) -> tuple[str, str, str, list[Failure]] | None:
    """Runs the primal and derivative checks of each mode, stopping at the first failure.

    Returns:
        ``None`` if all pass, else ``(kind, mode, method, failures)`` with
        ``kind`` in ``("primal", "jacobian")`` and ``method`` in
        ``("full", "directional")``.
    """
    n, m = x0.shape[0], sum(block.stop - block.start for block in out_slices)
    directional = fast_mode
    if directional is None:
        directional = max(n, m) > FULL_MAX_ELEMENTS or n * m > FULL_MAX_ENTRIES
    method = "directional" if directional else "full"
    if not directional:
        y_call, numerical = numerical_jacobian(f, x0, eps)
    for mode in modes:
        try:
            if directional:
                y_call, y_auto, numerical, automatic = directional_products(
                    f,
                    x0,
                    in_slices,
                    out_slices,
                    eps=eps,
                    mode=mode,
                    num_directions=num_directions,
                    seed=seed,
                )
            elif mode == "rev":
                y_auto, automatic = reverse_jacobian(f, x0)
            else:
                y_auto, automatic = forward_jacobian(f, x0)
        except TypeError as err:
            if mode != "fwd":
                raise
            raise TypeError(
                "`modes` includes 'fwd' but forward-mode differentiation of `func` failed "
                f"(custom_vjp functions support reverse mode only; use modes=('rev',)): {err}"
            ) from err
        failures = primal_failures(y_call, y_auto, out_slices, atol, rtol)
        if failures:
            return "primal", mode, method, failures
        if directional:
            failures = directional_failures(numerical, automatic, atol, rtol)
        else:
            failures = jacobian_failures(numerical, automatic, out_slices, in_slices, atol, rtol)
        if failures:
            return "jacobian", mode, method, failures
    return None
