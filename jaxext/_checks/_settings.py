"""The validated settings of ``gradcheck``/``gradgradcheck`` and of ``opcheck``'s gradient rows.

``Settings`` holds the numerics options, checked once; ``as_args`` turns the caller's
``inputs`` into positional arguments, checked against the function's signature;
``validated_flags`` checks the boolean switches of the two entry points.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from typing import Any

from ._leaves import private_copies

__all__ = ["Settings", "as_args", "validated_flags"]


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


def as_args(func: Any, inputs: Any, *, argument: str = "inputs") -> tuple:
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


def validated_flags(undefined: Any, batched: Any, dtypes: Any) -> tuple[bool, bool, bool]:
    names = ("check_undefined_grad", "check_batched_grad", "check_grad_dtypes")
    for name, flag in zip(names, (undefined, batched, dtypes), strict=True):
        if not isinstance(flag, bool):
            raise TypeError(f"`{name}` must be True or False; got {flag!r}.")
    return undefined, batched, dtypes
