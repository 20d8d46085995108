"""`gradcheck` / `gradgradcheck`: PyTorch-style gradient checks for JAX functions.

``jax.test_util.check_grads`` compares automatic and numerical derivatives along
one random direction. That catches gross errors but can miss one wrong entry of
one gradient, and its failure names neither the input nor the output. These
checks follow ``torch.autograd.gradcheck`` instead, with its option names: in
float64, the *full* Jacobian from central differences is compared entry by
entry with the Jacobian assembled from one VJP per output element, in chunks,
for problems up to ``FULL_MAX_ENTRIES`` Jacobian entries; larger ones fall back
(with a warning) to a few random directions per (output, input) pair.

The flow is one way: arguments -> ``_problem`` (the caller's function as a flat
``R^n -> R^m``) -> ``_jacobians`` (its Jacobians, a chunk at a time) -> ``_compare``
(mismatches) -> ``_gradcheck_report`` (the error). ``_engine.choose`` picks the engine
that computes and compares them: the reference path, or one that only makes it faster.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from . import _engine
from ._backward import (
    TIGHT,
    batched_gradients,
    gradient_dtypes,
    reentrancy,
    zero_cotangent,
)
from ._compare import Mismatch, directional_mismatches, entry_mismatches
from ._gradcheck_report import GradcheckError as GradcheckError
from ._gradcheck_report import GradcheckUnresolvedWarning as GradcheckUnresolvedWarning
from ._gradcheck_report import dtype_error, gradcheck_error, warn_unresolved
from ._jacobians import FlatJacobians
from ._leaves import FloatLeaves, private_copies
from ._precision import float64_numerics
from ._problem import Problem, first_order, second_order, second_order_forward

__all__ = [
    "FULL_MAX_ENTRIES",
    "STEP_SCALE",
    "GradcheckError",
    "GradcheckUnresolvedWarning",
    "Settings",
    "check_gradients",
    "gradcheck",
    "gradgradcheck",
]

# The full (entrywise) method covers Jacobians up to this many entries (1.07e9).
FULL_MAX_ENTRIES = 2**30
_BATCH = 3  # cotangents in the batched-gradient check
_TINY = 2.0**-100  # smallest input scale the finite-difference step follows
# Inputs whose entries are all below this in magnitude get a step scaled to them.
STEP_SCALE = 0.01


def gradcheck(
    func: Callable[..., Any],
    inputs: Any,
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    raise_exception: bool = True,
    nondet_tol: float = 0.0,
    check_undefined_grad: bool = True,
    check_grad_dtypes: bool = False,
    check_batched_grad: bool = False,
    check_forward_ad: bool = False,
    check_backward_ad: bool = True,
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
    ``|analytical - numerical| <= atol + rtol * |numerical| + noise``, where
    ``noise = 4 * 2.2e-16 * |f(x)| / (2 * h)`` is the rounding noise of the
    finite difference (about 1e-9 for outputs of order one; it keeps outputs
    of 1e6 from failing a correct function). For an (output, input) pair whose
    numerical derivatives are all below 1 in magnitude (full method), ``atol``
    is multiplied by the largest of them: a gradient whose entries are all below
    ``atol`` (an L2 penalty of ``1e-6``) is still held to ``rtol`` against its own
    size, so an error of 2x is caught.

    That noise term assumes the values carry a few ulps of ``|f(x)|``; a function
    whose intermediates are larger than its values carries more (``1 - tanh(x)`` at
    ``x = 10`` is ``4e-9`` but carries the ulp of ``tanh(x)``, ``1e-16``: its central
    difference at ``h = 1e-6`` is off by ``1e-10``, 1% of its derivative). So an
    entry that fails is judged again with the finite differences' own error,
    ``E`` estimated from central differences at steps ``h / 10 .. 1000 h`` (full
    method; ``_fd_error``: each step's error comes from the steps on the side where it
    shrinks; ``h`` is one of them, so a derivative wrong by more than the differences
    resolve at ``h`` always fails). It fails if ``|analytical - D| > atol + rtol|D| + E``
    (``D`` the best-resolved difference), passes if not and ``E <= atol + rtol|D|``;
    else it, or an entry no step resolves (a jump) beyond the unscaled ``atol``, is
    *unresolved* (a correct solve with a 5x5 Hilbert matrix): no failure; where nothing
    fails, the check returns ``True`` with a ``jaxext.GradcheckUnresolvedWarning``.
    Only input elements with a failing entry pay for these differences, and only
    where ``func`` computes in float64 (an output that is not float64, or in
    gradgradcheck a float32 gradient, keeps the plain test).

    * Full method (up to ``FULL_MAX_ENTRIES = 2**30`` Jacobian entries, about
      1.07e9, e.g. 41,000 inputs by 25,000 outputs; it costs ``2 n`` calls of
      ``func`` and ``m`` VJPs for ``n`` inputs and ``m`` outputs, and
      ``benchmarks/results/checks_cpu.md`` times it up to 1e9 entries): the
      numerical Jacobian, one central difference per input element, against
      the analytical one built from one VJP per output element with a basis
      cotangent (so a backward that ignores its cotangent fails too); then the VJP of one random
      cotangent ``u`` against ``u^T J`` from the numerical Jacobian (so a
      backward not linear in its cotangent, ``|g|`` for ``g``, fails too:
      ``kind="random_cotangent"``). Both are computed and compared in
      chunks: memory stays bounded (well under 1 GB) whatever the size. From
      ``2**22`` entries up, each chunk is first screened where it was computed
      (on the device) and only a chunk that could fail is compared on the host.
      An output that an input does not touch differences to exactly zero.
    * Directional method (``fast_mode=True``, or larger problems, with a
      warning): it compares ``u . J v`` for ``num_directions`` seeded random
      unit vectors per (output leaf, input leaf) pair. Cheaper, and blind to
      an error small against the whole Jacobian.

    Then, as in PyTorch (reverse mode only): a zero cotangent must give exactly
    zero gradients (``check_undefined_grad``), the backward run twice must agree
    within ``nondet_tol``, gradients computed for a batch of cotangents under
    ``jax.vmap`` must match one at a time (``check_batched_grad``), and each
    gradient must have its input's dtype and shape (``check_grad_dtypes``).

    Floating-point array leaves of ``inputs`` are differentiated; integer and
    boolean arrays, Python/NumPy scalars and other leaves are passed through
    unchanged. Integer and boolean outputs are ignored. Complex inputs and
    outputs are checked in JAX's convention: each complex element is two real
    ones (real and imaginary part) for the finite differences, and a VJP at
    cotangent ``c`` must be ``c * df/dz + conj(c * df/dzbar)`` (``c * f'(z)``
    for holomorphic ``f``; PyTorch's is its conjugate). Complex64 inputs are
    upcast to complex128. On a TPU (or another
    backend without float64) the check runs on the CPU backend; on a GPU the
    default matmul precision is raised to ``"highest"`` while it runs.

    Args:
        func: function of the positional arguments ``inputs``, returning an
            array or a pytree of arrays.
        inputs: tuple (or list) of positional arguments, each an array or a
            pytree of arrays; anything else is taken as the single argument.
        eps: finite-difference step (> 0). It follows the scale of an input
            leaf whose entries are all below 0.01: the step is then
            ``h = eps * max |x| / 0.01`` (a relative step of 1e-4 at the default),
            so that a correct function of inputs of scale ``1e-5`` is not failed
            by truncation error; other leaves get ``h = eps``.
        atol: absolute tolerance (>= 0).
        rtol: relative tolerance (>= 0).
        raise_exception: raise ``GradcheckError`` on failure (``True``) or
            return ``False``.
        nondet_tol: how far two runs of the backward on the same cotangent may
            differ (PyTorch's reentrancy check; 0 means bit-equal).
        check_undefined_grad: check that a zero cotangent gives zero
            gradients (PyTorch's undefined output gradients).
        check_grad_dtypes: check each gradient's dtype and shape against its
            input's (JAX itself accepts a float32 gradient for a float64 input;
            an integer or boolean array input must get a ``float0`` gradient).
        check_batched_grad: check ``jax.vmap`` of the VJP over a batch of
            cotangents against one VJP per cotangent (normwise per gradient,
            within ``rtol``, or 1e-9 if that is larger: a batching bug is an
            error of order one, rounding of a lower precision inside is not).
        check_forward_ad: also check forward mode (adds ``"fwd"`` to ``modes``).
        check_backward_ad: check reverse mode (``False`` removes ``"rev"``).
        fast_mode: ``None`` picks by size as above; ``True`` forces the
            directional method, ``False`` the full one.
        modes: ``"rev"`` (VJPs; works for ``custom_vjp``), ``"fwd"`` (JVPs; for
            plain and ``custom_jvp`` functions, and ``jaxext.custom_vjp``), or both.
        num_directions: random directions per pair in the directional method.
        seed: seed of those directions and of random cotangents.

    Returns:
        ``True`` if no check failed (unresolved entries: ``GradcheckUnresolvedWarning``);
        ``False`` on failure when ``raise_exception=False``.

    Raises:
        GradcheckError: on failure, naming the check (``kind``), the output,
            input, order, mode and the worst entry.
        TypeError: if ``func`` is not callable, an argument has the wrong type,
            or ``"fwd"`` is asked of a
            function without forward mode (a plain ``jax.custom_vjp``).
        ValueError: if ``eps``/``atol``/``rtol``/``nondet_tol`` are out of range,
            no mode is left, ``inputs`` is empty or has no float array, or
            ``func`` returns no float array.

    Example:
        >>> import numpy as np
        >>> import jaxext
        >>> x = np.linspace(-1.0, 1.0, 12).reshape(4, 3)  # float64: no upcast warning
        >>> w = np.linspace(0.5, 1.5, 6).reshape(2, 3)
        >>> jaxext.gradcheck(jaxext.linear, (x, w), eps=1e-6, atol=1e-4)
        True
    """
    args = _as_args(func, inputs)
    settings = Settings.validate(
        eps=eps, atol=atol, rtol=rtol, nondet_tol=nondet_tol, fast_mode=fast_mode, modes=modes,
        forward=("check_forward_ad", check_forward_ad),
        backward=("check_backward_ad", check_backward_ad),
        num_directions=num_directions, seed=seed,
    )  # fmt: skip
    undefined, batched, dtypes = _flags(check_undefined_grad, check_batched_grad, check_grad_dtypes)
    error = check_gradients(
        func, args, order=1, settings=settings, undefined=undefined, batched=batched, dtypes=dtypes
    )
    error = warn_unresolved(error)
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
    nondet_tol: float = 0.0,
    check_undefined_grad: bool = True,
    check_batched_grad: bool = False,
    check_fwd_over_rev: bool = False,
    check_rev_over_rev: bool = True,
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
        eps: as for ``gradcheck``.
        atol: as for ``gradcheck``.
        rtol: as for ``gradcheck``.
        raise_exception: as for ``gradcheck``.
        nondet_tol: as for ``gradcheck``, applied to the second-order VJP.
        check_undefined_grad: as for ``gradcheck``, for the VJP function.
        check_batched_grad: as for ``gradcheck``, for the VJP function.
        check_fwd_over_rev: also differentiate the VJP in forward mode (PyTorch's
            name; adds ``"fwd"`` to ``modes``).
        check_rev_over_rev: differentiate the VJP in reverse mode (``False``
            removes ``"rev"``).
        fast_mode: as for ``gradcheck``.
        modes: as for ``gradcheck``: how the VJP function is differentiated.
        num_directions: as for ``gradcheck``.
        seed: as for ``gradcheck``.

    Returns:
        ``True`` if no check failed (unresolved entries: ``GradcheckUnresolvedWarning``);
        ``False`` on failure when ``raise_exception=False``.

    Raises:
        GradcheckError: on failure. ``input_index`` counts ``grad_outputs``
            after the positional inputs; ``output_index`` is the index of the
            input whose gradient failed.
        TypeError: as for ``gradcheck``.
        ValueError: as for ``gradcheck``, and if ``grad_outputs`` does not
            match ``func``'s output.

    Example:
        >>> import numpy as np
        >>> import jaxext
        >>> x, c = np.arange(1.0, 4.0), np.array(2.0)
        >>> jaxext.gradgradcheck(jaxext.mul_constant, (x, c))
        True
    """
    args = _as_args(func, inputs)
    settings = Settings.validate(
        eps=eps, atol=atol, rtol=rtol, nondet_tol=nondet_tol, fast_mode=fast_mode, modes=modes,
        forward=("check_fwd_over_rev", check_fwd_over_rev),
        backward=("check_rev_over_rev", check_rev_over_rev),
        num_directions=num_directions, seed=seed,
    )  # fmt: skip
    undefined, batched, _ = _flags(check_undefined_grad, check_batched_grad, False)
    error = check_gradients(
        func, args, order=2, settings=settings, undefined=undefined, batched=batched,
        grad_outputs=grad_outputs,
    )  # fmt: skip
    error = warn_unresolved(error)
    if error is not None and raise_exception:
        raise error
    return error is None


# -- settings ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Settings:
    """The validated numerics settings shared by gradcheck and gradgradcheck."""

    eps: float
    atol: float
    rtol: float
    nondet_tol: float
    fast_mode: bool | None
    modes: tuple[str, ...]
    num_directions: int
    seed: int

    @classmethod
    def validate(
        cls,
        *,
        eps: Any,
        atol: Any,
        rtol: Any,
        nondet_tol: Any,
        fast_mode: Any,
        modes: Any,
        forward: tuple[str, Any],
        backward: tuple[str, Any],
        num_directions: Any,
        seed: Any,
    ) -> Settings:
        """Checks each option; ``forward``/``backward`` are ``(caller's option name, value)``."""
        (forward_name, forward), (backward_name, backward) = forward, backward
        if fast_mode is not None and not isinstance(fast_mode, bool):
            raise TypeError(f"`fast_mode` must be None, True or False; got {fast_mode!r}.")
        modes = (modes,) if isinstance(modes, str) else tuple(modes)
        if not modes or len(set(modes)) != len(modes) or not set(modes) <= {"rev", "fwd"}:
            raise ValueError(f"`modes` must be distinct entries of ('rev', 'fwd'); got {modes!r}.")
        for name, flag in ((forward_name, forward), (backward_name, backward)):
            if not isinstance(flag, bool):
                raise TypeError(f"`{name}` must be True or False; got {flag!r}.")
        if forward and "fwd" not in modes:
            modes += ("fwd",)
        if not backward:
            modes = tuple(mode for mode in modes if mode != "rev")
        if not modes:
            raise ValueError(
                f"nothing to check: `{backward_name}` is False and forward mode is not asked "
                f"for (pass {forward_name}=True)."
            )
        for name, value in (("num_directions", num_directions), ("seed", seed)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"`{name}` must be an int; got {type(value).__name__}.")
        if num_directions < 1:
            raise ValueError(f"`num_directions` must be at least 1; got {num_directions}.")
        return cls(
            eps=_as_tolerance(eps, "eps", allow_zero=False),
            atol=_as_tolerance(atol, "atol", allow_zero=True),
            rtol=_as_tolerance(rtol, "rtol", allow_zero=True),
            nondet_tol=_as_tolerance(nondet_tol, "nondet_tol", allow_zero=True),
            fast_mode=fast_mode,
            modes=modes,
            num_directions=int(num_directions),
            seed=int(seed),
        )


def _as_tolerance(value: Any, name: str, *, allow_zero: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a real number; got {type(value).__name__}.")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        expected = "non-negative" if allow_zero else "positive"
        raise ValueError(f"`{name}` must be a finite {expected} number; got {value!r}.")
    return value


def _as_args(func: Any, inputs: Any, *, argument: str = "inputs") -> tuple:
    """``func``'s positional arguments: ``inputs`` unpacked if a tuple or list, else itself.

    As ``torch.autograd.gradcheck`` takes a single tensor as its one input. Where
    ``func`` has a signature, the count of arguments must fit it: a ``TypeError``
    naming ``argument`` then, before ``func`` is called.
    """
    if not callable(func):
        raise TypeError(f"`func` must be callable; got {type(func).__name__}.")
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if not args:
        raise ValueError(f"`{argument}` must hold at least one positional argument; got none.")
    _check_arity(func, args, argument=argument, packed=isinstance(inputs, (tuple, list)))
    return private_copies(args)


def _check_arity(func: Any, args: tuple, *, argument: str, packed: bool) -> None:
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # no signature to read (some builtins): the call decides
        return
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    variadic = any(p.kind is p.VAR_POSITIONAL for p in params)
    n = len(args)
    if len(required) <= n and (variadic or n <= len(positional)):
        return
    if variadic:
        expected = f"at least {len(required)}"
    elif len(required) == len(positional):
        expected = f"{len(positional)}"
    else:
        expected = f"{len(required)} to {len(positional)}"
    plural = "" if expected == "1" else "s"
    plain = signature.replace(
        parameters=[p.replace(annotation=p.empty) for p in params],
        return_annotation=signature.empty,
    )
    name = getattr(func, "__name__", None) or type(func).__name__
    hint = ""
    if not packed:
        example = ", ".join(p.name for p in required)
        hint = (
            f" (a {type(args[0]).__name__}, not a tuple or list, is the one argument; "
            f"pass a tuple of them, e.g. `({example})`)"
        )
    raise TypeError(
        f"`{argument}` must hold {expected} positional argument{plural} for "
        f"`{name}{plain}`; got {n}{hint}."
    )


def _flags(undefined: Any, batched: Any, dtypes: Any) -> tuple[bool, bool, bool]:
    names = ("check_undefined_grad", "check_batched_grad", "check_grad_dtypes")
    for name, flag in zip(names, (undefined, batched, dtypes), strict=True):
        if not isinstance(flag, bool):
            raise TypeError(f"`{name}` must be True or False; got {flag!r}.")
    return undefined, batched, dtypes


def _warn_precision(upcast: list[str], low_outputs: list[str]) -> None:
    """Warns, at the caller of gradcheck/gradgradcheck, about lower-precision floats."""
    if upcast:
        # complex inputs are named as such only where there are some
        complex_ = any("complex" in entry for entry in upcast)
        wide = "float64 (complex128 if complex)" if complex_ else "float64"
        widened = "float64 (complex128)" if complex_ else "float64"
        warnings.warn(
            f"gradcheck: {', '.join(upcast)} not {wide}; upcasting to {widened} for the "
            "check (finite differences in lower precision are unreliable). Pass "
            f"{widened} arrays to silence this warning.",
            UserWarning,
            stacklevel=4,
        )
    if low_outputs:
        warnings.warn(
            f"gradcheck: {', '.join(low_outputs)} not float64 (complex128 if complex) although "
            "the inputs are (`func` computes in lower precision); the numerical derivatives "
            "will be imprecise.",
            UserWarning,
            stacklevel=4,
        )


# -- the checks -----------------------------------------------------------------------------


def check_gradients(
    func: Callable[..., Any],
    args: tuple,
    *,
    order: int,
    settings: Settings,
    undefined: bool,
    batched: bool,
    dtypes: bool = False,
    reentrant: bool = True,
    grad_outputs: Any = None,
    inner: str = "rev",
) -> GradcheckError | None:
    """The checks of ``gradcheck`` (``order=1``) or ``gradgradcheck`` (``order=2``).

    Args:
        func: the function.
        args: its positional arguments.
        order: 1 or 2.
        settings: validated numerics settings (``Settings.validate``).
        undefined: run the zero-cotangent check.
        batched: run the batched-gradient check.
        dtypes: run the gradient dtype/shape check (order 1).
        reentrant: run the reentrancy check (two runs of the backward).
        grad_outputs: cotangents for ``order=2`` (``None``: random).
        inner: at ``order=2``, the first derivative differentiated: ``"rev"``
            (the VJP, as gradgradcheck) or ``"fwd"`` (the JVP, with random
            tangents); ``settings.modes`` says how it is differentiated.

    Returns:
        ``None`` if all pass, else the error describing the first failure (where none:
        ``kind="unresolved"`` for entries the finite differences cannot resolve).
    """
    with float64_numerics():
        problem, low, low_out = first_order(func, args)
        if order == 2 and inner == "fwd":
            problem = second_order_forward(problem, len(args), settings.seed)
        elif order == 2:
            problem, low_ct = second_order(problem, grad_outputs, len(args), settings.seed)
            low = low + low_ct
        _warn_precision(low, low_out)

        def wide() -> bool:
            """Whether ``func`` computes in float64 (the differences' error is estimated)."""
            if low_out:
                return False
            return order == 1 or inner != "rev" or not _narrow_gradients(func, args)

        error = _check(problem, settings, undefined, batched, reentrant, wide)
        if error is None and dtypes:
            error = _grad_dtypes(func, args)
    return error


def _check(
    problem: Problem,
    settings: Settings,
    undefined: bool,
    batched: bool,
    reentrant: bool,
    wide: Callable[[], bool] = lambda: True,
) -> GradcheckError | None:
    """Runs the checks on the flat problem; the first failure becomes the error."""
    in_slices = [segment.slice for segment in problem.inputs]
    out_slices = [segment.slice for segment in problem.outputs]
    engine, jac = _engine.jacobians(
        problem.f, problem.x0, problem.vjp, full=settings.fast_mode is not True,
        modes=settings.modes,
    )  # fmt: skip
    tolerances = {"atol": settings.atol, "rtol": settings.rtol}

    def error(kind: str, mode: str, method: str | None, found: list[Mismatch]) -> GradcheckError:
        return gradcheck_error(problem, kind, mode, method, found)

    if jac.n == 0 or jac.m == 0:
        return None  # an empty input or output: no derivative to check (as in PyTorch)
    engine.compile_ahead(jac, forward="fwd" in settings.modes)
    y_call = jac.value()
    # Forward mode's primal output now (a function without forward mode raises here);
    # reverse mode's once the Jacobians are computed, so that the differences run while
    # the VJPs' program still compiles. Both are compared before the Jacobians' verdicts.
    y_auto = {"fwd": _ad_primal(jac, "fwd")} if "fwd" in settings.modes else {}
    method = _method(settings.fast_mode, jac.n, jac.m)
    block_eps = step_sizes(jac.x0_host, in_slices, settings.eps)
    if method == "full":
        eps = np.concatenate(
            [np.full(s.stop - s.start, e) for s, e in zip(in_slices, block_eps, strict=True)]
        )
        # A random cotangent too: one-hot ones cannot tell a backward linear in its
        # cotangent from one that is not (|g| for g).
        cotangent = np.random.default_rng(settings.seed + 1).standard_normal(jac.m)
        results = engine.full_mismatches(
            jac, y_call, out_slices, in_slices, eps=eps, modes=settings.modes,
            cotangent=cotangent, wide=wide, **tolerances,
        )  # fmt: skip
    else:
        results = {
            mode: directional_mismatches(
                jac, y_call, out_slices, in_slices, eps=block_eps, mode=mode,
                num_directions=settings.num_directions, seed=settings.seed, **tolerances,
            )
            for mode in settings.modes
        }  # fmt: skip
    for mode in settings.modes:
        y = y_auto[mode] if mode in y_auto else _ad_primal(jac, mode)
        found = entry_mismatches(y_call, y, out_slices, on_inputs=False, **tolerances)
        if found:
            return error("primal", mode, None, found)
    failing = {mode: [m for m in found if not m.unresolved] for mode, found in results.items()}
    for mode in settings.modes:
        if failing[mode]:
            return error("jacobian", mode, method, failing[mode])
    if failing.get("rev_cotangent"):
        return error("random_cotangent", "rev", None, failing["rev_cotangent"])
    # Entries the differences cannot resolve fail nothing: reported where nothing fails.
    late = [(m, method, results[m]) for m in settings.modes]
    late.append(("rev", None, results.get("rev_cotangent")))
    unresolved = next((error("unresolved", *u) for u in late if u[2]), None)
    if "rev" not in settings.modes:
        return unresolved
    rng = np.random.default_rng(settings.seed)

    def blocks(flat):
        return [flat[block] for block in in_slices]

    if undefined:
        found = zero_cotangent(lambda u: blocks(jac.vjp(u)[1]), np.zeros(jac.m))
        if found:
            return error("undefined_grad", "rev", None, found)
    cotangent = rng.standard_normal(jac.m)
    # The backward's compiled program, run twice (opcheck's reentrancy also runs it eagerly).
    if reentrant:
        found = reentrancy({"": lambda: blocks(jac.vjp(cotangent)[1])}, settings.nondet_tol)
        if found is not None:
            return error("nondeterministic", "rev", None, found[1])
    if batched:
        cotangents = rng.standard_normal((_BATCH, jac.m))
        found = batched_gradients(
            lambda _, u: blocks(jac.vjp_fn(jac.x0)[1](u)),
            None,
            list(cotangents),
            rtol=max(TIGHT, settings.rtol),
        )
        if isinstance(found, Exception):
            return gradcheck_error(problem, "batched_grad", "rev", None, [], cause=found)
        if found:
            return error("batched_grad", "rev", None, found)
    return unresolved


def step_sizes(x0: np.ndarray, in_slices: Sequence[slice], eps: float) -> np.ndarray:
    """The finite-difference step of each input block: ``eps * min(1, max |x| / 0.01)``.

    A step follows the scale of its input when that is below ``STEP_SCALE`` (0.01):
    normalising vectors of norm 2e-5 with a step of 1e-6 would move them by 5% and
    fail a correct function on truncation error alone. Such an input is moved by
    at most ``eps / STEP_SCALE`` of its largest entry (1e-4 at the default ``eps``).
    Larger inputs (and all-zero ones) keep ``eps`` itself, as in PyTorch: a smaller
    step would only magnify the rounding of a function computed in float32. The
    floor ``_TINY`` keeps the step a normal float64.
    """
    steps = np.full(len(in_slices), float(eps))
    for j, block in enumerate(in_slices):
        values = x0[block]
        scale = float(np.max(np.abs(values))) if values.size else 0.0
        if 0.0 < scale < STEP_SCALE:
            steps[j] = eps * max(scale, _TINY) / STEP_SCALE
    return steps


def _ad_primal(jac: FlatJacobians, mode: str) -> np.ndarray:
    """The primal output of ``jax.vjp`` (``"rev"``) or ``jax.linearize`` (``"fwd"``)."""
    if mode == "rev":
        return jac.vjp(np.zeros(jac.m))[0]
    try:
        return jac.jvp(np.zeros(jac.n))[0]
    except TypeError as err:
        raise TypeError(
            "forward mode ('fwd' in `modes`, or check_forward_ad=True) was asked for, but "
            "forward-mode differentiation of `func` failed (a plain jax.custom_vjp supports "
            f"reverse mode only: use jaxext.custom_vjp, or modes=('rev',)): {err}"
        ) from err


def _method(fast_mode: bool | None, n: int, m: int) -> str:
    if fast_mode is not None:
        return "directional" if fast_mode else "full"
    if n * m <= FULL_MAX_ENTRIES:
        return "full"
    warnings.warn(
        f"gradcheck: the Jacobian has {n} x {m} = {n * m:.3g} entries, more than the "
        f"{FULL_MAX_ENTRIES:.3g} the element-by-element check covers; comparing random "
        "projections u . J v per (output, input) pair instead. This can miss an error that is "
        "small against the whole Jacobian: one wrong element, or a small relative scale error "
        "of one gradient. Check on smaller inputs, or pass fast_mode=False to force the "
        "full check (slow).",
        UserWarning,
        stacklevel=5,
    )
    return "directional"


def _narrow_gradients(func: Callable[..., Any], args: tuple) -> bool:
    """Whether ``func``'s backward gives a gradient whose dtype or shape is not its
    input's (a float32 gradient for a float64 input, say), decided when tracing; also
    where that cannot be decided."""
    try:
        return (
            gradient_dtypes(FloatLeaves.of(func, args, argument="inputs"), jnp.float64) is not None
        )
    except Exception:  # noqa: BLE001 -- undecided: the plain test stands
        return True


def _grad_dtypes(func: Callable[..., Any], args: tuple) -> GradcheckError | None:
    """Checks each float input's gradient dtype and shape (``float0`` for other arrays)."""
    found = gradient_dtypes(FloatLeaves.of(func, args, argument="inputs"), jnp.float64)
    if found is None:
        return None
    return dtype_error(found.label, found.index, found.path, found.primal, found.grad)
