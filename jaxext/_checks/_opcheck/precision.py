"""opcheck's lower-precision row: float32 and bfloat16 runs of the op against the float64
one, within what rounding explains (``low_precision``, with its allowance for the
gradient's sensitivity to its residuals' rounding).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._backward import (
    complex_counterpart,
    refusal,
)
from .._compare import widened
from .._leaves import is_complex, wide_dtype
from .._settings import Settings
from ._common import (
    Skip,
    first_line,
    no_kernel,
)
from ._op import (
    CheckFailed,
    OpUnderTest,
    assert_trees_close,
    float_output_leaves,
)

__all__ = ["RESIDUAL_ROUNDING_FACTOR", "low_precision"]


def low_precision(op: OpUnderTest, settings: Settings) -> str:
    if op.narrow is not None:
        raise Skip(
            f"no float64 run to compare with: {op.precision} ({op.narrow}); the gradient "
            "rows judge it in the dtypes it takes"
        )
    rng = np.random.default_rng(settings.seed + 10)
    primals, u = op.primals, op.cotangent(rng)
    checked, unsupported = [], []
    call = op.jitted
    gradients = op.pullback  # float64 compiles once
    all_complex = all(is_complex(p) for p in primals)
    for dtype in (jnp.float32, jnp.bfloat16):
        rtol = 16 * float(jnp.finfo(dtype).eps)
        name = jnp.dtype(dtype).name
        if dtype == jnp.bfloat16 and all_complex:
            continue  # no complex bfloat16: said in the detail below
        # complex inputs in the complex dtype of this precision (complex64 for bfloat16)
        low = [jnp.asarray(p, complex_counterpart(p.dtype, dtype)) for p in primals]
        refused = refusal(op.call, low, dtype)
        if refused is not None:
            unsupported.append(refused)
            continue
        try:
            got = call(*low)
        except NotImplementedError as err:  # no kernel for this dtype: what the op cannot do
            unsupported.append(no_kernel(err, dtype))
            continue
        except Exception as err:  # not a refusal (no evidence of one): the op's own error
            raise CheckFailed(
                f"{name} inputs: the op raises {type(err).__name__}: {first_line(err)} (not a "
                "refusal of the dtype: no deliberate check of the op's, and JAX runs the op's "
                "math with every float value in it)"
            ) from None
        # The reference is float64 at the *rounded* inputs: rounding an input of 150 to
        # bfloat16 moves it by 0.5, which is no error of the op's.
        rounded = [jnp.asarray(p, wide_dtype(p.dtype)) for p in low]
        reference = call(*rounded)
        # The cotangent takes each output's dtype in this run (a float32 output for a
        # bfloat16 input is mixed precision, not an error), rounded alike for the reference.
        u_low = jax.tree_util.tree_map(
            lambda leaf, out: (
                jnp.asarray(leaf, out.dtype) if jnp.issubdtype(out.dtype, jnp.inexact) else leaf
            ),
            u,
            got,
        )
        u_ref = jax.tree_util.tree_map(
            lambda leaf: (
                jnp.asarray(leaf, wide_dtype(leaf.dtype))
                if jnp.issubdtype(leaf.dtype, jnp.inexact)
                else leaf
            ),
            u_low,
        )
        # Allowed beyond 16 eps: what rounding the inputs by eps moves the float64 output by
        # (an ill-conditioned op, sin(w x) at a large phase, loses those digits in any run).
        conditioning = _input_sensitivity(op, rounded, reference, float(jnp.finfo(dtype).eps), rng)
        assert_trees_close(
            got,
            reference,
            what=f"{name} output vs float64",
            rtol=rtol,
            atol=RESIDUAL_ROUNDING_FACTOR * conditioning,
        )
        grads = gradients(low, u_low)
        reference_grads = gradients(rounded, u_ref)
        terms = _term_scales(gradients, rounded, u_ref, rng)
        spreads = _residual_sensitivity(
            op, rounded, u_ref, reference_grads, float(jnp.finfo(dtype).eps), rng
        )
        for label, a, e, t, spread in zip(
            op.labels, grads, reference_grads, terms, spreads, strict=True
        ):
            assert_trees_close(
                a,
                e,
                what=f"{name} gradient of {label} vs float64",
                rtol=rtol,
                atol=rtol * t + RESIDUAL_ROUNDING_FACTOR * spread,
            )
        checked.append(name)
    if unsupported:
        raise Skip(
            f"{' and '.join(checked) or 'no dtype'} checked; not run: {'; '.join(unsupported)}"
        )
    if all_complex:
        return (
            "float32 (complex64 inputs) run; outputs and gradients within 16 eps of "
            "complex128 at the rounded inputs; bfloat16 not run: every input is complex, "
            "and there is no complex bfloat16"
        )
    return (
        "float32 and bfloat16 run; outputs and gradients within 16 eps of float64 at the "
        "rounded inputs"
        + ("; complex inputs run as complex64" if any(is_complex(p) for p in primals) else "")
    )


# How many times the gradient's sensitivity to its residuals' rounding a low-precision
# gradient may be off (`_residual_sensitivity`).
RESIDUAL_ROUNDING_FACTOR = 8.0


def _residual_sensitivity(
    op: OpUnderTest, primals: Sequence[Any], u: Any, reference: Any, eps: float, rng: Any
) -> list[np.ndarray]:
    """How far each float64 gradient entry moves when every residual is off by ``eps``.

    A low-precision backward computes from residuals (the values ``fwd`` saves, or the
    intermediates JAX keeps) that are themselves rounded: where the gradient depends on
    them by cancellation, that rounding alone takes digits no backward can recover. A
    softmax of logits in the tens is the case: its largest probability rounds to within
    ``eps`` of 1, and the backward's ``g - sum(g * y)`` then carries ``eps * |g|`` of
    error in an entry of size ``1e-7``. Multiplying each float residual of the float64
    ``jax.vjp`` (the leaves of its pullback) by ``1 +- eps`` (random signs, four draws;
    ``reference`` is the unperturbed gradient) measures this: the root mean
    square change of each gradient entry (flat, per input), so an entry that no rounding
    touches keeps its tight allowance beside one that loses every digit. The residuals are
    those of the op's own float64 derivative, so an op that rounds wrongly at low
    precision only (a bfloat16 branch, a constant in the wrong dtype) gains nothing.
    """
    if "perturbed_pullback" not in op.cache:

        def perturbed(p, u, seed, eps):
            _, pullback = jax.vjp(op.call, *p)
            leaves, tree = jax.tree_util.tree_flatten(pullback)
            leaves = [
                leaf * (1 + eps * _random_signs(leaf, seed, salt))
                if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.inexact)
                else leaf
                for salt, leaf in enumerate(leaves)
            ]
            return jax.tree_util.tree_unflatten(tree, leaves)(u)

        op.cache["perturbed_pullback"] = op.quick_jit(perturbed)
    perturbed = op.cache["perturbed_pullback"]
    draws = []
    for _ in range(4):
        seed = np.uint32(rng.integers(2**32))  # an argument: one compilation for all
        moved = perturbed(primals, u, seed, eps)
        draws.append(
            [
                np.nan_to_num(np.abs(widened(g) - widened(r)) ** 2, nan=0.0, posinf=0.0)
                for g, r in zip(moved, reference, strict=True)
            ]
        )
    return _root_mean_square(draws)


def _input_sensitivity(
    op: OpUnderTest, primals: Sequence[Any], reference: Any, eps: float, rng: Any
) -> float:
    """How far the float64 output moves when every floating input is off by ``1 +- eps``.

    A low-precision run rounds its intermediates, and a backward-stable computation's
    result is the exact one at inputs moved by a few ``eps``: where the op is
    ill-conditioned (``sin(w x)`` with ``w x`` in the thousands moves by ``|w x| eps``),
    no run in that dtype keeps more digits. Multiplying each float input of the float64 op
    by ``1 +- eps`` (random signs, four draws; ``reference`` is the unperturbed output)
    measures this: the largest root mean square change of an output entry. A
    well-conditioned op's is about ``eps |y|``, within the row's 16 eps already, so a
    wrong low-precision path (a bfloat16 branch in a float32 op) gains nothing.
    """
    if "perturbed_call" not in op.cache:

        def perturbed(p, seed, eps):
            p = [
                leaf * (1 + eps * _random_signs(leaf, seed, salt))
                if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.inexact)
                else leaf
                for salt, leaf in enumerate(p)
            ]
            return op.call(*p)

        op.cache["perturbed_call"] = op.quick_jit(perturbed)
    perturbed = op.cache["perturbed_call"]
    expected = [widened(e) for _, e in float_output_leaves(reference)]
    draws = []
    for _ in range(4):
        seed = np.uint32(rng.integers(2**32))  # an argument: one compilation for all
        moved = [widened(m) for _, m in float_output_leaves(perturbed(list(primals), seed, eps))]
        draws.append(
            [
                np.nan_to_num(np.abs(m - e) ** 2, nan=0.0, posinf=0.0)
                for m, e in zip(moved, expected, strict=True)
            ]
        )
    return max((float(np.max(r, initial=0.0)) for r in _root_mean_square(draws)), default=0.0)


def _root_mean_square(squares: list[list[np.ndarray]]) -> list[np.ndarray]:
    """Per input, the square root of the mean over draws of each entry's squared modulus
    (``squares``: per draw, one array per input), flat."""
    return [
        np.sqrt(np.mean(np.stack(per_input), axis=0)).ravel()
        for per_input in zip(*squares, strict=True)
    ]


def _random_signs(leaf: jax.Array, seed: jax.Array, salt: int) -> jax.Array:
    """Pseudo-random +-1 of ``leaf``'s shape (and real dtype) from an integer hash of
    each entry's position, ``seed`` and ``salt``: a few integer operations, where
    ``jax.random`` would compile a program several times larger."""
    h = jax.lax.iota(jnp.uint32, leaf.size).reshape(leaf.shape) * jnp.uint32(0x9E3779B1)
    h = h + seed.astype(jnp.uint32) * jnp.uint32(0x85EBCA77) + jnp.uint32(salt * 0x27D4EB2F % 2**32)
    for shift, factor in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        h = (h ^ (h >> shift)) * jnp.uint32(factor)
    h = h ^ (h >> 16)
    return jnp.where((h & 1) == 1, 1.0, -1.0).astype(jnp.finfo(leaf.dtype).dtype)


def _term_scales(gradients: Callable[..., Any], primals: Any, u: Any, rng: Any) -> list[float]:
    """The size of the terms each gradient sums, per input: ``sqrt(sum_k |J_ki u_k|^2)``.

    A gradient ``(J^T u)_i = sum_k J_ki u_k`` rounds like a sum of its terms, so its
    rounding error follows their size, not the sum's: a sum that cancels (the gradient of
    a softmax temperature) is small while its rounding error is not. With random signs
    ``s``, ``E |(J^T (s u))_i|^2 = sum_k |J_ki u_k|^2``; a few draws in float64 estimate it
    (the largest entry per input). Where terms do not cancel, this is at most the
    gradient's own size, and nothing changes.
    """
    draws = []
    for _ in range(8):
        signed = jax.tree_util.tree_map(
            lambda leaf: (
                leaf * rng.choice(np.array([-1.0, 1.0]), size=np.shape(leaf))
                if jnp.issubdtype(leaf.dtype, jnp.inexact)
                else leaf
            ),
            u,
        )
        draws.append(
            [np.abs(np.asarray(g, np.complex128)) ** 2 for g in gradients(primals, signed)]
        )
    return [float(np.max(rms, initial=0.0)) for rms in _root_mean_square(draws)]
