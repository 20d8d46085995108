"""The gradient core of ``gradcheck``, ``gradgradcheck`` and ``opcheck``'s gradient rows.

``check_gradients`` runs the checks of one order on a function and its arguments and
returns the error (``None`` if all pass). The flow is one way: arguments -> ``_problem``
(the caller's function as a flat ``R^n -> R^m``) -> ``_engines`` (its Jacobians, a chunk
at a time, from the engine ``_engines.choose`` picks) -> ``_compare`` (mismatches) ->
``_gradcheck_report`` (the error).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _engines
from ._backward import (
    TIGHT,
    batched_gradients,
    gradient_dtypes,
    reentrancy,
    zero_cotangent,
    zero_like,
)
from ._compare import Mismatch, directional_mismatches, entry_mismatches
from ._dtype_tolerance import program_dtypes, rtol_for
from ._gradcheck_report import GradcheckError, dtype_error, gradcheck_error
from ._jacobians import FlatJacobians
from ._leaves import FloatLeaves
from ._precision import float64_numerics
from ._problem import (
    Problem,
    Segment,
    first_order,
    grad_output_leaves,
    second_order,
    second_order_forward,
)
from ._reference import random_like, reference_mismatch, reference_rtol
from ._settings import Settings

__all__ = ["FULL_MAX_ENTRIES", "STEP_SCALE", "check_gradients", "step_sizes"]


# The full (entrywise) method covers Jacobians up to this many entries (1.07e9).
FULL_MAX_ENTRIES = 2**30


_BATCH = 3  # cotangents in the batched-gradient check


_TINY = 2.0**-100  # smallest input scale the finite-difference step follows


# Inputs whose entries are all below this in magnitude get a step scaled to them.
STEP_SCALE = 0.01


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
    engine, jac = _engines.jacobians(
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


def _grad_dtypes(
    func: Callable[..., Any], args: tuple, dtype: Any = jnp.float64
) -> GradcheckError | None:
    """Checks each float input's gradient dtype and shape (``float0`` for other arrays),
    the float inputs in ``dtype`` (``None``: each in its own)."""
    found = gradient_dtypes(FloatLeaves.of(func, args, argument="inputs"), dtype)
    if found is None:
        return None
    return dtype_error(found.label, found.index, found.path, found.primal, found.grad)


def against_reference(
    func: Callable[..., Any],
    reference: Callable[..., Any],
    args: tuple,
    settings: Settings,
    *,
    order: int = 1,
    grad_outputs: Any = None,
    undefined: bool = False,
    batched: bool = False,
    dtypes: bool = False,
) -> GradcheckError | None:
    """``gradcheck(..., reference=)`` (``order=1``) and ``gradgradcheck(..., reference=)``
    (``order=2``): ``func`` at ``args`` in their own dtypes against JAX's autodiff of
    ``reference`` in float64 (``_reference``), then the checks of its backward in those
    dtypes; ``None`` if all pass.

    At order 2 the function compared is ``(inputs, grad_outputs) -> VJP of func``, as
    ``gradgradcheck`` differentiates it: its values are the VJPs, its VJPs and JVPs the
    second derivatives (``grad_outputs`` count as inputs after the positional ones).
    The backward's checks (``undefined``: zero cotangent; reentrancy within
    ``settings.nondet_tol``; ``batched``: ``jax.vmap`` over cotangents; ``dtypes``: each
    gradient in its input's dtype and shape, order 1) run on that function in reverse mode.
    """
    with float64_numerics():
        view = FloatLeaves.of(func, args, argument="inputs")
        twin = FloatLeaves.of(reference, args, argument="inputs")
        primals = [jnp.asarray(v) for v in view.values]
        labels = list(view.labels)
        segments = [
            Segment(i, path, tuple(p.shape), 0, label)
            for i, path, p, label in zip(
                view.indices, view.paths, primals, view.labels, strict=True
            )
        ]
        fn, ref = view.call, twin.call
        if order == 2:
            out = jax.eval_shape(view.call, *primals)
            cotangents, positions = _grad_outputs(grad_outputs, out, settings.seed)
            fn, ref = (
                _vjp_function(view.call, out, positions),
                _vjp_function(twin.call, out, positions),
            )
            for k, (u, position) in enumerate(zip(cotangents, positions, strict=True)):
                label = f"input {len(args) + k} (grad_outputs for output {position})"
                segments.append(Segment(len(args) + k, "", tuple(u.shape), 0, label))
                labels.append(label)
            primals += cotangents
        out = jax.eval_shape(fn, *primals)
        u = random_like(np.random.default_rng(0), out)[0]
        computes_in = program_dtypes(fn, primals, u, forward="fwd" in settings.modes)
        rtol = reference_rtol(computes_in)
        for mode in settings.modes:
            found = reference_mismatch(
                fn, ref, primals, labels, rtol=rtol, forward=mode == "fwd", reverse=mode == "rev",
                seed=settings.seed,
            )  # fmt: skip
            if found is not None:
                how = "reverse mode (VJP)" if mode == "rev" else "forward mode (JVP)"
                what = "" if order == 1 else " of (inputs, grad_outputs) -> VJP of `func`"
                return GradcheckError(
                    f"Mismatch against the reference's autodiff in float64{what}, {how}: {found}",
                    kind="reference", order=order, mode=mode,
                )  # fmt: skip
        if "rev" not in settings.modes:
            return None
        labelled = Problem(fn, None, None, tuple(segments), (), order)
        batch_rtol = max(rtol_for(computes_in), settings.rtol)
        error = _own_dtype_backward(fn, primals, labelled, settings, undefined, batched, batch_rtol)
        if error is None and dtypes and order == 1:
            error = _grad_dtypes(func, args, None)
    return error


def _grad_outputs(grad_outputs: Any, out: Any, seed: int) -> tuple[list[jax.Array], list[int]]:
    """The cotangents of ``out``'s float leaves (``grad_outputs``, or standard-normal draws
    from ``seed``), each in its leaf's dtype, and those leaves' positions."""
    leaves, treedef = jax.tree_util.tree_flatten(out)
    positions = [i for i, leaf in enumerate(leaves) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    if not positions:
        raise ValueError("`func` returned no floating-point array to check.")
    if grad_outputs is None:
        drawn = jax.tree_util.tree_leaves(random_like(np.random.default_rng(seed), out)[0])
        return [drawn[i] for i in positions], positions
    given = grad_output_leaves(grad_outputs, treedef)
    cotangents = []
    for i in positions:
        value = given[i]
        if np.shape(value) != tuple(leaves[i].shape) or not jnp.issubdtype(
            jnp.result_type(value), jnp.inexact
        ):
            raise ValueError(
                f"`grad_outputs`: the entry for output {i} must be a floating-point array of "
                f"shape {tuple(leaves[i].shape)}; got {type(value).__name__} of shape "
                f"{np.shape(value)}."
            )
        cotangents.append(jnp.asarray(value, leaves[i].dtype))
    return cotangents, positions


def _vjp_function(call: Callable[..., Any], out: Any, positions: list[int]) -> Callable:
    """``(*primals, *cotangents) -> VJP of call at primals``, the cotangents those of the
    float output leaves at ``positions`` (the others get ``float0`` zeros)."""
    leaves, treedef = jax.tree_util.tree_flatten(out)

    def vjp_of(*values):
        primals, given = values[: len(values) - len(positions)], values[-len(positions) :]
        cotangents = [np.zeros(leaf.shape, jax.dtypes.float0) for leaf in leaves]
        for position, u in zip(positions, given, strict=True):
            cotangents[position] = u
        return jax.vjp(call, *primals)[1](jax.tree_util.tree_unflatten(treedef, cotangents))

    return vjp_of


def _own_dtype_backward(
    fn: Callable,
    primals: Sequence[Any],
    labelled: Problem,
    settings: Settings,
    undefined: bool,
    batched: bool,
    batch_rtol: float,
) -> GradcheckError | None:
    """The backward's checks of ``_check`` (zero cotangent, reentrancy, batched
    gradients) on ``fn`` at ``primals`` in their own dtypes; ``labelled`` names its
    inputs."""

    def error(kind: str, found: list[Mismatch]) -> GradcheckError:
        return gradcheck_error(labelled, kind, "rev", None, found)

    out, pullback = jax.vjp(fn, *primals)
    if undefined:
        found = zero_cotangent(pullback, jax.tree_util.tree_map(zero_like, out))
        if found:
            return error("undefined_grad", found)
    rng = np.random.default_rng(settings.seed)
    u = random_like(rng, out)[0]
    found = reentrancy({"": lambda: pullback(u)}, settings.nondet_tol)
    if found is not None:
        return error("nondeterministic", found[1])
    if batched:
        cotangents = [random_like(rng, out)[0] for _ in range(_BATCH)]
        found = batched_gradients(
            lambda _, u: jax.vjp(fn, *primals)[1](u), None, cotangents, rtol=batch_rtol
        )
        if isinstance(found, Exception):
            return gradcheck_error(labelled, "batched_grad", "rev", None, [], cause=found)
        if found:
            return error("batched_grad", found)
    return None
