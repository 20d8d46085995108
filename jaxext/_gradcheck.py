"""`gradcheck` / `gradgradcheck`: PyTorch-style gradient checks for JAX functions.

``jax.test_util.check_grads`` compares automatic and numerical derivatives along
one random direction. That catches gross errors but can miss one wrong entry of
one gradient, and its failure names neither the input nor the output. These
checks follow ``torch.autograd.gradcheck`` instead: in float64, for inputs small
enough, the *full* Jacobian from central differences is compared entry by entry
with the full Jacobian assembled from one VJP per output element; larger
problems fall back to a few random directions per (output, input) pair, in the
spirit of ``check_grads`` but with unit-norm directions and per-pair reporting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from . import _jacobians
from ._gradcheck_flat import Problem, first_order, second_order
from ._gradcheck_report import GradcheckError as GradcheckError
from ._gradcheck_report import make_error

__all__ = ["GradcheckError", "gradcheck", "gradgradcheck"]


def gradcheck(
    func: Callable[..., Any],
    inputs: Any,
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    raise_exception: bool = True,
    fast_mode: bool | None = None,
    modes: str | Sequence[str] = ("rev",),
    num_directions: int = 3,
    seed: int = 0,
) -> bool:
    """Checks ``func``'s first derivatives against central finite differences.

    Everything runs in float64 (the caller's ``jax_enable_x64`` setting is
    restored afterwards). First, the primal output of ``jax.vjp`` must match a
    plain call of ``func``: this catches a ``custom_vjp`` forward rule that
    returns something else than the function. Then, per (output leaf, input
    leaf) pair, every compared entry must satisfy
    ``|analytical - numerical| <= atol + rtol * |numerical|``:

    * Full method (default when the differentiable inputs and the float outputs
      have at most 4096 elements each, and the Jacobian at most 2**22 entries):
      the numerical Jacobian, one central difference per input element, against
      the analytical one built from one VJP per output element with a basis
      cotangent, so a backward that ignores its cotangent fails too.
    * Directional method (larger problems): like ``jax.test_util.check_grads``,
      which it does not call, it compares ``u . J v`` for random directions, but
      per (output leaf, input leaf) pair, with unit-norm ``u`` and ``v`` and
      ``num_directions`` seeded draws. Cheaper, and blind to an error small
      against the whole Jacobian.

    Floating-point array leaves of ``inputs`` are differentiated; integer and
    boolean arrays, Python/NumPy scalars and other leaves are passed through
    unchanged. Integer and boolean outputs are ignored. Complex inputs or
    outputs raise ``TypeError``: they are not supported. On a TPU (or another
    backend without float64) the check runs on the CPU backend; on a GPU the
    default matmul precision is raised to ``"highest"`` while it runs.

    Args:
        func: function of the positional arguments ``inputs``, returning an
            array or a pytree of arrays.
        inputs: tuple (or list) of positional arguments, each an array or a
            pytree of arrays; anything else is taken as the single argument.
        eps: finite-difference step (> 0).
        atol: absolute tolerance (>= 0).
        rtol: relative tolerance (>= 0).
        raise_exception: raise ``GradcheckError`` on failure (``True``) or
            return ``False``.
        fast_mode: ``None`` picks by size as above; ``True`` forces the
            directional method, ``False`` the full one.
        modes: ``"rev"`` (VJPs; works for ``custom_vjp``), ``"fwd"`` (JVPs; for
            plain and ``custom_jvp`` functions), or both.
        num_directions: random directions per pair in the directional method.
        seed: seed of those directions.

    Returns:
        ``True`` if every check passed; ``False`` on failure when
        ``raise_exception=False``.

    Raises:
        GradcheckError: on failure, naming the output, input, order, mode and
            the worst entry.
        TypeError: if ``func`` is not callable, an argument has the wrong type,
            a float input/output is complex, or ``"fwd"`` is asked of a
            ``custom_vjp`` function.
        ValueError: if ``eps``/``atol``/``rtol`` are out of range, ``inputs``
            is empty or has no float array, or ``func`` returns no float array.

    Example:
        >>> import numpy as np
        >>> import jaxext
        >>> x = np.linspace(-1.0, 1.0, 12).reshape(4, 3)  # float64: no upcast warning
        >>> w = np.linspace(0.5, 1.5, 6).reshape(2, 3)
        >>> jaxext.gradcheck(jaxext.linear, (x, w), eps=1e-6, atol=1e-4)
        True
    """
    args, options = _validate(func, inputs, eps, atol, rtol, fast_mode, modes, num_directions, seed)
    with _float64_numerics():
        problem, low, low_out = first_order(func, args)
        _warn_precision(low, low_out)
        error = _check(problem, options)
    if error is not None and raise_exception:
        raise error
    return error is None


def gradgradcheck(
    func: Callable[..., Any],
    inputs: Any,
    grad_outputs: Any = None,
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    raise_exception: bool = True,
    fast_mode: bool | None = None,
    modes: str | Sequence[str] = ("rev",),
    num_directions: int = 3,
    seed: int = 0,
) -> bool:
    """Checks ``func``'s second derivatives against finite differences.

    As in PyTorch, this runs the check of ``gradcheck`` on the function
    ``(inputs, grad_outputs) -> VJP of func at inputs applied to grad_outputs``:
    its Jacobian with respect to both the inputs and the cotangents. A backward
    rule that is right at first order but cuts the gradient through one of its
    residuals (a ``stop_gradient`` on a saved input, say) passes ``gradcheck``
    and fails here. First derivatives are not checked: call ``gradcheck`` too.

    Args:
        func: as for ``gradcheck``.
        inputs: as for ``gradcheck``.
        grad_outputs: cotangents for ``func``'s output, with its structure
            (a 1-tuple is accepted for a single array output); entries for
            integer outputs are ignored. ``None`` draws standard-normal ones
            from ``seed``.
        eps, atol, rtol, raise_exception, fast_mode, modes, num_directions,
        seed: as for ``gradcheck``. ``modes=("fwd",)`` differentiates the VJP
            in forward mode.

    Returns:
        ``True`` if every check passed; ``False`` on failure when
        ``raise_exception=False``.

    Raises:
        GradcheckError: on failure. ``input_index`` counts ``grad_outputs``
            after the positional inputs; ``output_index`` is the index of the
            input whose gradient failed.
        TypeError, ValueError: as for ``gradcheck``, and if ``grad_outputs``
            does not match ``func``'s output.

    Example:
        >>> import numpy as np
        >>> import jaxext
        >>> x, c = np.arange(1.0, 4.0), np.array(2.0)
        >>> jaxext.gradgradcheck(jaxext.mul_constant, (x, c))
        True
    """
    args, options = _validate(func, inputs, eps, atol, rtol, fast_mode, modes, num_directions, seed)
    with _float64_numerics():
        first, low, low_out = first_order(func, args)
        problem, low_ct = second_order(first, grad_outputs, len(args), seed)
        _warn_precision(low + low_ct, low_out)
        error = _check(problem, options)
    if error is not None and raise_exception:
        raise error
    return error is None


@dataclasses.dataclass(frozen=True)
class _NumericsPlan:
    use_cpu: bool
    matmul_precision: str | None


def _numerics_plan(platform: str) -> _NumericsPlan:
    """Where and how to run the float64 check for a backend ``platform`` name.

    CPUs compute float64 exactly. GPUs do too, except that matmuls may drop to
    TF32 unless the precision is raised. TPUs (and backends we do not know) may
    lack float64 altogether, so the check moves to the CPU backend.
    """
    platform = platform.lower()
    if platform == "cpu":
        return _NumericsPlan(use_cpu=False, matmul_precision=None)
    if platform in ("gpu", "cuda", "rocm"):
        return _NumericsPlan(use_cpu=False, matmul_precision="highest")
    return _NumericsPlan(use_cpu=True, matmul_precision="highest")


@contextlib.contextmanager
def _float64_numerics(platform: str | None = None) -> Iterator[_NumericsPlan]:
    """Enables x64 (restoring the caller's setting on exit) and applies the plan."""
    plan = _numerics_plan(jax.default_backend() if platform is None else platform)
    with contextlib.ExitStack() as stack:
        stack.enter_context(jax.enable_x64(True))
        if plan.matmul_precision is not None:
            stack.enter_context(jax.default_matmul_precision(plan.matmul_precision))
        if plan.use_cpu:
            stack.enter_context(jax.default_device(jax.devices("cpu")[0]))
        yield plan


# -- argument validation ---------------------------------------------------------------


def _as_tolerance(value: Any, name: str, *, allow_zero: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a real number; got {type(value).__name__}.")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        expected = "non-negative" if allow_zero else "positive"
        raise ValueError(f"`{name}` must be a finite {expected} number; got {value!r}.")
    return value


def _validate(
    func, inputs, eps, atol, rtol, fast_mode, modes, num_directions, seed
) -> tuple[tuple, dict]:
    """Checks the arguments; returns the positional inputs and the numerics options."""
    if not callable(func):
        raise TypeError(f"`func` must be callable; got {type(func).__name__}.")
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if not args:
        raise ValueError("`inputs` must hold at least one positional argument; got none.")
    if fast_mode is not None and not isinstance(fast_mode, bool):
        raise TypeError(f"`fast_mode` must be None, True or False; got {fast_mode!r}.")
    modes = (modes,) if isinstance(modes, str) else tuple(modes)
    if not modes or len(set(modes)) != len(modes) or not set(modes) <= {"rev", "fwd"}:
        raise ValueError(f"`modes` must be distinct entries of ('rev', 'fwd'); got {modes!r}.")
    for name, value in (("num_directions", num_directions), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"`{name}` must be an int; got {type(value).__name__}.")
    if num_directions < 1:
        raise ValueError(f"`num_directions` must be at least 1; got {num_directions}.")
    return args, dict(
        eps=_as_tolerance(eps, "eps", allow_zero=False),
        atol=_as_tolerance(atol, "atol", allow_zero=True),
        rtol=_as_tolerance(rtol, "rtol", allow_zero=True),
        fast_mode=fast_mode,
        modes=modes,
        num_directions=int(num_directions),
        seed=int(seed),
    )


# -- reporting ----------------------------------------------------------------------------


def _warn_precision(upcast: list[str], low_outputs: list[str]) -> None:
    """Warns, at the caller of gradcheck/gradgradcheck, about lower-precision floats."""
    if upcast:
        warnings.warn(
            f"gradcheck: {', '.join(upcast)} not float64; upcasting to float64 for the check "
            "(finite differences in lower precision are unreliable). Pass float64 arrays to "
            "silence this warning.",
            UserWarning,
            stacklevel=3,
        )
    if low_outputs:
        warnings.warn(
            f"gradcheck: {', '.join(low_outputs)} not float64 although the inputs are (`func` "
            "computes in lower precision); the numerical derivatives will be imprecise.",
            UserWarning,
            stacklevel=3,
        )


def _check(problem: Problem, options: dict) -> GradcheckError | None:
    """Runs the checks on the flat problem; a ``GradcheckError`` describes the failure."""
    result = _jacobians.run_checks(
        problem.f,
        problem.x0,
        [segment.slice for segment in problem.inputs],
        [segment.slice for segment in problem.outputs],
        **options,
    )
    if result is None:
        return None
    kind, mode, method, failures = result
    return make_error(problem, failures, kind, mode, method, options["atol"], options["rtol"])
