"""What ``gradcheck`` / ``gradgradcheck`` report: ``GradcheckError``, PyTorch-style (which
check, output, input, how far off), built from the ``Mismatch`` records of the comparison."""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np

from ._compare import Mismatch, unravel
from ._problem import Problem, Segment

__all__ = [
    "GradcheckError",
    "GradcheckUnresolvedWarning",
    "dtype_error",
    "gradcheck_error",
    "warn_unresolved",
]

_MODE_NAMES = {"rev": "reverse mode (VJP)", "fwd": "forward mode (JVP)"}


class GradcheckError(AssertionError):
    """A gradient check failed. The message reads like PyTorch's; the fields
    below let code (and tests) find out what failed.

    Attributes:
        kind: which check failed: ``"jacobian"`` (derivatives differ),
            ``"primal"`` (the output of ``jax.vjp``/``jax.linearize`` differs
            from a plain call), ``"undefined_grad"`` (a zero cotangent gives a
            nonzero gradient), ``"nondeterministic"`` (two runs of the backward
            differ), ``"batched_grad"`` (``vmap`` of the VJP differs from a
            loop), ``"grad_dtype"`` (a gradient's dtype or shape differs from
            its input's), ``"random_cotangent"`` (the VJP of a random cotangent
            differs from its product with the numerical Jacobian: a backward
            not linear in its cotangent), ``"reference"`` (values, VJPs or JVPs
            differ from the autodiff of ``gradcheck``'s ``reference=`` in
            float64), ``"unresolved"`` (not a failure: the
            entries the finite differences cannot resolve, carried by a
            ``GradcheckUnresolvedWarning``).
        order: 1 for ``gradcheck``, 2 for ``gradgradcheck``.
        mode: ``"rev"`` or ``"fwd"``.
        method: ``"full"`` (entrywise Jacobians) or ``"directional"``; ``None``
            for the other kinds.
        output_index, output_path: which output leaf failed: its position among
            the leaves of ``func``'s output and its key path (``""`` for a bare
            array). At order 2, the positional index and key path of the input
            whose gradient failed.
        input_index, input_path: positional index of the input (0-based; at
            order 2, ``grad_outputs`` follow the positional inputs) and key path
            inside it; ``None`` for a primal mismatch.
        output_element, input_element: index of the worst entry in the output's
            and the input's own shapes (``None`` where not applicable).
        direction: index of the worst random direction (directional method).
        numerical, analytical: the worst entry, from finite differences and
            from JAX's AD (for a primal mismatch: the plain call and the AD
            primal).
        abs_error, rel_error: ``|analytical - numerical|`` and that over
            ``|numerical|``.
        num_mismatched, num_checked: failing and compared entries of the pair.
        mismatched_pairs: ``(output_index, input_index)`` of every failing
            (output leaf, input leaf) pair of that check, the reported one first.
    """

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        for name in _ERROR_FIELDS:
            setattr(self, name, fields.pop(name, None))
        if fields:
            raise TypeError(f"unknown GradcheckError fields: {sorted(fields)}")


class GradcheckUnresolvedWarning(UserWarning):
    """``gradcheck`` / ``gradgradcheck`` found entries the finite differences cannot
    resolve, and nothing wrong: neither PASS nor FAIL (the check returns ``True``).

    An entry is unresolved where it fails the plain test (``atol + rtol * |numerical|``)
    and no finite-difference step resolves it to that tolerance: the differences at the
    steps around the check's step disagree by more than it (an ill-conditioned function,
    such as a solve with a Hilbert matrix, or one that is not smooth there), while the
    analytical value is within what they allow, or no step resolves it at all. A
    derivative wrong by more than the differences resolve still fails.

    Attributes:
        error: a ``GradcheckError`` of ``kind="unresolved"`` naming the output, input
            and worst entry (its ``num_mismatched`` counts the unresolved entries);
            not raised.
    """

    def __init__(self, error: GradcheckError) -> None:
        super().__init__(str(error))
        self.error = error


def warn_unresolved(error: GradcheckError | None) -> GradcheckError | None:
    """``error``, or ``None`` after a ``GradcheckUnresolvedWarning`` where it reports
    unresolved entries (no failure), warned at the caller of ``gradcheck``."""
    if error is not None and error.kind == "unresolved":
        warnings.warn(GradcheckUnresolvedWarning(error), stacklevel=3)
        return None
    return error


_ERROR_FIELDS = [
    "kind",
    "order",
    "mode",
    "method",
    "output_index",
    "output_path",
    "input_index",
    "input_path",
    "output_element",
    "input_element",
    "direction",
    "numerical",
    "analytical",
    "abs_error",
    "rel_error",
    "num_mismatched",
    "num_checked",
    "mismatched_pairs",
]


_KIND_TITLES = {
    "undefined_grad": "Nonzero gradient for a zero cotangent",
    "nondeterministic": "Nondeterministic backward",
    "batched_grad": "Batched gradient mismatch",
    "random_cotangent": "Gradient mismatch for a random cotangent",
}
_KIND_EXPLANATIONS = {
    "undefined_grad": "the VJP with an all-zero cotangent must give exactly zero gradients "
    "(PyTorch's check_undefined_grad)",
    "nondeterministic": "two runs of the backward on the same cotangent differ by more than "
    "`nondet_tol` (PyTorch's reentrancy check)",
    "batched_grad": "jax.vmap of the VJP over a batch of cotangents differs from one VJP per "
    "cotangent (PyTorch's check_batched_grad)",
    "random_cotangent": "the VJP of a random cotangent u differs from u^T J with the numerical "
    "Jacobian J, which the VJPs of one-hot cotangents matched: the backward is not linear in "
    "its cotangent (|g|, g**2, a branch on g ...)",
}
_KIND_TITLES["unresolved"] = "Unresolved gradient elements for a random cotangent"
# What an unresolved entry is, in the report's words (see ``_fd_error``).
_UNRESOLVED = (
    "neither PASS nor FAIL: the finite differences cannot resolve them to the tolerance asked "
    "(at every step they disagree with the neighbouring steps by more than it: an "
    "ill-conditioned or non-smooth function), and none is wrong by more than they resolve"
)
_KIND_EXPLANATIONS["unresolved"] = _UNRESOLVED


def gradcheck_error(
    problem: Problem,
    kind: str,
    mode: str,
    method: str | None,
    found: list[Mismatch],
    *,
    cause: Exception | None = None,
) -> GradcheckError:
    """The exception for the first of ``found``, with PyTorch-style wording.

    Args:
        problem: the flat problem, for the labels of its blocks.
        kind: ``"primal"``, ``"jacobian"``, ``"undefined_grad"``,
            ``"nondeterministic"`` or ``"batched_grad"``.
        mode: ``"rev"`` or ``"fwd"``.
        method: ``"full"`` or ``"directional"`` (``kind="jacobian"`` only).
        found: the mismatches, the reported one first (may be empty with
            ``cause``).
        cause: an exception that is itself the failure (``jax.vmap`` refusing
            the VJP, for ``batched_grad``).

    Returns:
        The error, its message and fields filled in.
    """
    context = f"order {problem.order}, {_MODE_NAMES[mode]}"
    if cause is not None:
        message = (
            f"{_KIND_TITLES[kind]} ({context}): {_KIND_EXPLANATIONS[kind]}; it raised "
            f"{type(cause).__name__}: {cause}"
        )
        return GradcheckError(message, kind=kind, order=problem.order, mode=mode)
    worst = found[0]
    out = None if worst.out_block is None else problem.outputs[worst.out_block]
    inp = None if worst.in_block is None else problem.inputs[worst.in_block]
    num, auto = worst.expected, worst.actual
    abs_error = abs(auto - num)
    rel_error = abs_error / abs(num) if num != 0 else math.inf
    out_element, out_part = _element(worst.out_element, out)
    in_element, in_part = _element(worst.in_element, inp)
    direction = worst.direction
    ad_name = "jax.vjp" if mode == "rev" else "jax.linearize"
    if kind == "primal":
        lines = [
            f"Primal mismatch for {out.label} ({context}): the primal output of {ad_name} "
            "differs from calling the function (for a custom_vjp function: its forward rule "
            "returns something else than the function itself).",
            f"  worst element: index {out_element}{out_part} of shape {out.shape}",
            f"  function call: {num:.10g}",
            f"  {ad_name}: {auto:.10g}",
        ]
        unit, reference = "elements", "function call"
    elif kind == "jacobian" or (kind == "unresolved" and out is not None):
        how = "full Jacobian" if method == "full" else "random directions"
        lines = [
            f"Jacobian mismatch for {out.label} with respect to {inp.label} ({context}, {how})."
            if kind == "jacobian"
            else f"Unresolved Jacobian entries for {out.label} with respect to {inp.label} "
            f"({context}, {how}): {_UNRESOLVED}."
        ]
        if method == "full":
            lines.append(
                f"  worst entry: output element {out_element}{out_part} (output shape "
                f"{out.shape}), input element {in_element}{in_part} (input shape {inp.shape})"
            )
            unit = "Jacobian entries for this pair"
        else:
            lines.append(
                f"  worst direction: #{direction} of {worst.total} (compared u . J v for random "
                "unit vectors u over the output and v over the input)"
            )
            unit = "directions"
        lines += [f"  numerical:  {num:.10g}", f"  analytical: {auto:.10g}"]
        if math.isnan(num):
            lines.append(_numerical_nan(problem, worst, out, inp, out_element, in_element))
        if math.isnan(auto):
            lines.append("  (the analytical value is NaN: the derivative rule gives NaN here)")
        reference = "numerical"
    else:
        lines = [
            f"{_KIND_TITLES[kind]} for the gradient of {inp.label} ({context}): "
            f"{_KIND_EXPLANATIONS[kind]}.",
            f"  worst element: {in_element}{in_part} (input shape {inp.shape})"
            + ("" if direction is None else f", batch entry #{direction}"),
        ]
        names = {
            "unresolved": ("u^T J (numerical)", "VJP of u"),
            "undefined_grad": ("expected", "gradient"),
            "nondeterministic": ("first run", "second run"),
            "batched_grad": ("one at a time", "under vmap"),
            "random_cotangent": ("u^T J (numerical)", "VJP of u"),
        }[kind]
        lines += [f"  {names[0]}: {num:.10g}", f"  {names[1]}: {auto:.10g}"]
        unit, reference = "gradient elements", names[0]
    if math.isnan(num) != math.isnan(auto):  # no tolerance covers it: not "allowed: nan"
        error = "  abs error: nan (NaN on one side only: no tolerance covers it)"
    elif math.isnan(num) or not math.isfinite(worst.allowed):
        # NaN on both sides (or no finite bound): there is no difference to hold to a bound.
        error = "  abs error: nan (NaN on both sides: no value to compare, never a match)"
    else:
        error = (
            f"  abs error: {abs_error:.3e}, rel error: {rel_error:.3e}; "
            f"allowed: {worst.allowed:.3e}"
        )
        if kind == "jacobian" or (kind == "unresolved" and out is not None):
            error += f" ({_bound(worst.atol_scale, reference)})"
    lines.append(error)
    if kind == "jacobian" and worst.atol_scale is not None:
        lines.append(
            f"  (atol is multiplied by {worst.atol_scale:.3e}, the largest |{reference}| of "
            "this pair: its derivatives are all below 1 in magnitude)"
        )
    tally = "unresolved" if kind == "unresolved" else "mismatched"
    lines.append(f"  {tally}: {worst.count} of {worst.total} {unit}")
    if problem.order == 2 and problem.inner == "fwd":
        lines.append(
            "  (order 2 here checks the Jacobian of (inputs, tangents) -> JVP of `func`: its "
            "forward rule differentiated again; tangents count as inputs after the positional "
            "ones)"
        )
    elif problem.order == 2:
        lines.append(
            "  (order 2 checks the Jacobian of (inputs, grad_outputs) -> VJP of `func`; "
            "grad_outputs count as inputs after the positional ones)"
        )
    pairs = [
        (
            None if m.out_block is None else problem.outputs[m.out_block],
            None if m.in_block is None else problem.inputs[m.in_block],
        )
        for m in found
    ]
    if len(pairs) > 1:
        others = [_pair_label(o, i) for o, i in pairs[1:]]
        lines.append(f"  also {tally}: {'; '.join(dict.fromkeys(others))}")
    return GradcheckError(
        "\n".join(lines),
        kind=kind,
        order=problem.order,
        mode=mode,
        method=method,
        output_index=None if out is None else out.index,
        output_path=None if out is None else out.path,
        input_index=None if inp is None else inp.index,
        input_path=None if inp is None else inp.path,
        output_element=out_element,
        input_element=in_element,
        direction=direction,
        numerical=num,
        analytical=auto,
        abs_error=abs_error,
        rel_error=rel_error,
        num_mismatched=worst.count,
        num_checked=worst.total,
        mismatched_pairs=tuple(
            (None if o is None else o.index, None if i is None else i.index) for o, i in pairs
        ),
    )


def _numerical_nan(problem, worst, out, inp, out_element, in_element) -> str:
    """Why a numerical Jacobian entry is NaN, from the function's value at the inputs
    themselves: NaN there whatever the input element is, or finite there and NaN a step
    away (the step crosses the edge of the domain)."""
    at_input = None
    if worst.out_element is not None:
        try:
            value = np.asarray(problem.f(problem.x0)).ravel()[out.offset + worst.out_element]
            at_input = bool(np.isnan(value))
        except Exception:  # noqa: BLE001 -- only the wording depends on it
            at_input = None
    if at_input:
        return (
            f"  (the numerical value is NaN: {out.label} element {out_element} is NaN at the "
            f"given inputs themselves, whatever {inp.label} element {in_element} is: the "
            "function is outside its domain there; check inside it)"
        )
    if at_input is False:
        return (
            f"  (the numerical value is NaN: {out.label} element {out_element} is finite at the "
            f"given inputs but NaN when {inp.label} element {in_element} moves by the "
            "finite-difference step: the input is within a step of the edge of the function's "
            "domain, and the step goes outside its domain; check further inside it)"
        )
    return (
        "  (the numerical value is NaN: the function is NaN at the given inputs or a "
        "finite-difference step away along this direction, outside its domain; check inside it)"
    )


def dtype_error(label: str, index: int, path: str, primal: Any, grad: Any) -> GradcheckError:
    """The exception for a gradient whose dtype or shape differs from its input's."""
    return GradcheckError(
        f"Gradient dtype/shape mismatch for {label}: the input is {primal.dtype}"
        f"{tuple(primal.shape)} but its gradient is {grad.dtype}{tuple(grad.shape)} (JAX does "
        "not check this for a custom_vjp backward; PyTorch's check_grad_dtypes).",
        kind="grad_dtype",
        order=1,
        mode="rev",
        input_index=index,
        input_path=path,
    )


def _bound(atol_scale: float | None, reference: str) -> str:
    """How a Jacobian entry's allowed error is made up, in the report's words."""
    atol = "atol" if atol_scale is None else f"atol * {atol_scale:.3e}"
    return f"{atol} + rtol * |{reference}| + finite-difference noise"


def _pair_label(out: Segment | None, inp: Segment | None) -> str:
    if inp is None:
        return out.label
    if out is None:
        return f"the gradient of {inp.label}"
    return f"{out.label} w.r.t. {inp.label}"


# Tracebacks show the name users can import and catch (`jaxext.GradcheckError`), not this
# private module's.
GradcheckError.__module__ = "jaxext"
GradcheckUnresolvedWarning.__module__ = "jaxext"


def _element(flat: int | None, segment: Any) -> tuple[tuple[int, ...] | None, str]:
    """The index in ``segment``'s shape of the flat entry ``flat``, and which part of a
    complex element it is (``" (real part)"``, ``" (imaginary part)"``; ``""`` if real)."""
    if flat is None:
        return None, ""
    if not segment.complex:
        return unravel(flat, segment.shape), ""
    part = " (real part)" if flat % 2 == 0 else " (imaginary part)"
    return unravel(flat // 2, segment.shape), part
