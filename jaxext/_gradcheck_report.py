"""`GradcheckError` and its PyTorch-style message: which output, which input, how far off."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._gradcheck_flat import Problem

__all__ = ["GradcheckError", "make_error"]

_MODE_NAMES = {"rev": "reverse mode (VJP)", "fwd": "forward mode (JVP)"}


class GradcheckError(AssertionError):
    """A gradient check failed. The message reads like PyTorch's; the fields
    below let code (and tests) find out what failed.

    Attributes:
        kind: ``"jacobian"`` (derivatives differ) or ``"primal"`` (the output of
            ``jax.vjp``/``jax.linearize`` differs from a plain call).
        order: 1 for ``gradcheck``, 2 for ``gradgradcheck``.
        mode: ``"rev"`` or ``"fwd"``.
        method: ``"full"`` (entrywise Jacobians) or ``"directional"``.
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


def make_error(problem: Problem, failures, kind, mode, method, atol, rtol) -> GradcheckError:
    """The exception for the first of ``failures``, with PyTorch-style wording."""
    worst = failures[0]
    out = problem.outputs[worst.out_block]
    inp = None if worst.in_block is None else problem.inputs[worst.in_block]
    num, auto = worst.numerical, worst.automatic
    abs_error = abs(auto - num)
    rel_error = abs_error / abs(num) if num != 0 else math.inf
    out_element = in_element = direction = None
    if kind == "primal":
        out_element = _unravel(worst.worst, out.shape)
    elif method == "full":
        row, col = divmod(worst.worst, inp.size)
        out_element, in_element = _unravel(row, out.shape), _unravel(col, inp.shape)
    else:
        direction = worst.worst
    how = "full Jacobian" if method == "full" else "random directions"
    context = f"order {problem.order}, {_MODE_NAMES[mode]}"
    if kind == "jacobian":
        context += f", {how}"
    ad_name = "jax.vjp" if mode == "rev" else "jax.linearize"
    if kind == "primal":
        lines = [
            f"Primal mismatch for {out.label} ({context}): the primal output of {ad_name} "
            "differs from calling the function (for a custom_vjp function: its forward rule "
            "returns something else than the function itself).",
            f"  worst element: index {out_element} of shape {out.shape}",
            f"  function call: {num:.10g}",
            f"  {ad_name}: {auto:.10g}",
        ]
        unit = "elements"
    else:
        lines = [f"Jacobian mismatch for {out.label} with respect to {inp.label} ({context})."]
        if method == "full":
            lines.append(
                f"  worst entry: output element {out_element} (output shape {out.shape}), "
                f"input element {in_element} (input shape {inp.shape})"
            )
            unit = "Jacobian entries for this pair"
        else:
            lines.append(
                f"  worst direction: #{direction} of {worst.total} (compared u . J v for random "
                "unit vectors u over the output and v over the input)"
            )
            unit = "directions"
        lines += [f"  numerical:  {num:.10g}", f"  analytical: {auto:.10g}"]
    lines += [
        f"  abs error: {abs_error:.3e}, rel error: {rel_error:.3e}; allowed: atol + rtol * "
        f"|{'function call' if kind == 'primal' else 'numerical'}| = "
        f"{atol + rtol * abs(num):.3e}",
        f"  mismatched: {worst.count} of {worst.total} {unit}",
    ]
    if problem.order == 2:
        lines.append(
            "  (order 2 checks the Jacobian of (inputs, grad_outputs) -> VJP of `func`; "
            "grad_outputs count as inputs after the positional ones)"
        )
    pairs = [
        (problem.outputs[f.out_block], None if f.in_block is None else problem.inputs[f.in_block])
        for f in failures
    ]
    if len(pairs) > 1:
        others = [o.label if i is None else f"{o.label} w.r.t. {i.label}" for o, i in pairs[1:]]
        lines.append(f"  also mismatched: {'; '.join(others)}")
    return GradcheckError(
        "\n".join(lines),
        kind=kind,
        order=problem.order,
        mode=mode,
        method=method,
        output_index=out.index,
        output_path=out.path,
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
        mismatched_pairs=tuple((o.index, None if i is None else i.index) for o, i in pairs),
    )


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(flat, shape))
