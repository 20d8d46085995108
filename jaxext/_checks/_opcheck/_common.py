"""What the rows of several families share.

``Skip`` (a row that does not apply), ``Unresolved`` (finite differences that cannot
resolve entries none of which is wrong: neither PASS nor FAIL), the op behind a fresh
Python function, one VJP, the pairing of a cotangent with an output, several
computations jitted together, the first line of an error, and ``gradient_check``: the
run against finite differences that ``gradcheck`` and ``jvp`` (first order) and
``gradgradcheck`` and ``fwd_over_rev`` (second order) share, one run for both modes where
both are selected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._dtype_tolerance import narrowest
from .._gradients import check_gradients
from .._leaves import wide_dtype
from .._reference import reference_mismatch, reference_rtol
from .._settings import Settings
from ._op import (
    CheckFailed,
    OpUnderTest,
    float_output_leaves,
)

__all__ = [
    "Skip",
    "Unresolved",
    "first_line",
    "float64_refusal",
    "fresh",
    "gradient_check",
    "gradient_settings",
    "inner_product",
    "jitted_together",
    "no_float64_path",
    "no_kernel",
    "refused_forward_mode",
    "reference_check",
    "require_forward_mode",
    "vjp",
]


class Skip(Exception):
    """Raised by a check that does not apply to the op, with the reason."""


class Unresolved(CheckFailed):
    """Raised by a finite-difference check whose differences cannot resolve some entries,
    none wrong (``_fd_error``): neither PASS nor FAIL, with the entries named."""


def require_forward_mode(op: OpUnderTest) -> None:
    if op.forward_error is not None:
        raise Skip(f"no forward mode (jax.jvp raises {op.forward_error})")


def no_float64_path(op: OpUnderTest) -> str | None:
    """Why the op does not run at its float64 inputs while it runs at float32 ones (float32
    accumulators in a loop carry, as JAX's Pallas ``mha``), or ``None``: a property of
    the op's own dtypes, the one cause of every row that raises, not JAX's limit and not
    a missing forward mode. Found once per op."""
    if "no_float64_path" not in op.cache:
        op.cache["no_float64_path"] = None
        try:
            jax.eval_shape(op.call, *op.primals)
        except Exception as err:  # noqa: BLE001 -- does it run at float32, then?
            narrow = [
                jnp.asarray(p, jnp.complex64 if jnp.iscomplexobj(p) else jnp.float32)
                for p in op.primals
            ]
            try:
                jax.eval_shape(op.call, *narrow)
            except Exception:  # noqa: BLE001 -- runs at neither: the checks report it
                return None
            op.cache["no_float64_path"] = (
                "the op has no float64 path (its own dtypes, not JAX's limit): with float64 "
                f"inputs it raises {type(err).__name__}: {first_line(err)}; with float32 "
                "inputs it runs; not checked at float64"
            )
            op.cache["float64_refusal"] = (type(err), first_line(err))
    return op.cache["no_float64_path"]


def float64_refusal(op: OpUnderTest, err: BaseException) -> str | None:
    """:func:`no_float64_path`'s reason where ``err`` is that refusal (the same exception
    class and first line the op raises at float64 inputs), else ``None``: any other error
    of a row of such an op (which runs in float32) is judged as any op's."""
    reason = no_float64_path(op)
    if reason is None or op.cache.get("float64_refusal") != (type(err), first_line(err)):
        return None
    return reason


def refused_forward_mode(op: OpUnderTest, err: BaseException) -> str | None:
    """``require_forward_mode``'s SKIP reason where ``err`` (or an exception it was raised
    from) is the op's refusal of forward mode: a row that needs it without saying so (the
    JVP of the VJP of a plain ``jax.custom_vjp`` whose ``fwd`` calls the op) gets the same
    verdict as the rows that ask first; else ``None``."""
    if op.forward_error is None:
        return None
    refusal = op.forward_error.split(": ", 1)[-1]
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if refusal and refusal in str(err):
            return f"no forward mode (jax.jvp raises {op.forward_error})"
        err = err.__cause__ or err.__context__
    return None


def inner_product(u: Any, out: Any, *, absolute: bool = False) -> jax.Array:
    """``sum <u_i, out_i>`` (or ``sum <|u_i|, |out_i|>``) over the float leaves of two
    output pytrees. For complex leaves ``<u, t> = Re sum(u t)``: how JAX pairs a
    cotangent with a tangent (the real part is the pairing, nothing is dropped)."""
    pairs = zip(float_output_leaves(u), float_output_leaves(out), strict=True)
    if absolute:
        return sum((jnp.sum(jnp.abs(a * b)) for (_, a), (_, b) in pairs), jnp.zeros(()))
    return sum((jnp.real(jnp.sum(a * b)) for (_, a), (_, b) in pairs), jnp.zeros(()))


def vjp(fn: Callable, primals, u) -> tuple:
    return jax.vjp(fn, *primals)[1](u)


def fresh(op: OpUnderTest) -> Callable:
    """The op behind a new Python function, so that no trace cache is shared."""
    return lambda *values: op.func(*op.args_with(values))


def jitted_together(op: OpUnderTest, fns: dict[str, Callable], *args: Any) -> dict[str, Any]:
    """``{name: fn(*args)}`` for each of ``fns``, jitted (``op.quick_jit``): all in one
    compiled program (one compilation, not one each); should that raise, each in its
    own, so that an error comes from the computation that raises it."""
    try:
        merged = op.quick_jit(lambda *a: {name: fn(*a) for name, fn in fns.items()})(*args)
    except Exception:  # noqa: BLE001 -- each alone below, to attribute the error
        return {name: op.quick_jit(fn)(*args) for name, fn in fns.items()}
    return {name: merged[name] for name in fns}  # in the order of `fns`, not sorted


def gradient_settings(settings: Settings, modes: tuple[str, ...]) -> Settings:
    return Settings(
        eps=settings.eps, atol=settings.atol, rtol=settings.rtol, nondet_tol=settings.nondet_tol,
        fast_mode=None, modes=modes, num_directions=settings.num_directions, seed=settings.seed,
    )  # fmt: skip


# The checks that differentiate the same function (the op, its VJP, its JVP) in reverse
# and in forward mode: when both are selected, one run covers both (one numerical
# Jacobian, one set of compiled programs), and the second check reads the result.
_MODE_CHECKS = {
    (1, "rev"): {"rev": "gradcheck", "fwd": "jvp"},
    (2, "rev"): {"rev": "gradgradcheck", "fwd": "fwd_over_rev"},
}


def gradient_check(
    op: OpUnderTest, settings: Settings, order: int, mode: str, inner: str = "rev"
) -> None:
    results = op.cache.setdefault(("gradients", order, inner), {})
    if mode not in results:
        names = _MODE_CHECKS[order, inner]
        both = (
            names["rev"] in op.cache.get("selected", ())
            and names["fwd"] in op.cache.get("selected", ())
            and (op.forward_error is None or (order, inner) == (2, "rev"))
        )
        modes = ("rev", "fwd") if both else (mode,)
        try:
            error = _run_gradient_check(op, settings, order, modes, inner)
        except Exception:  # noqa: BLE001 -- one mode may fail to run: each alone, below
            if len(modes) == 1:
                raise
            modes = (mode,)
            error = _run_gradient_check(op, settings, order, modes, inner)
        if error is None:
            results.update(dict.fromkeys(modes))
        else:
            results[error.mode] = error
            if error.mode != mode:  # the other mode failed first: run this one alone
                results[mode] = _run_gradient_check(op, settings, order, (mode,), inner)
    if results[mode] is not None:
        failure = Unresolved if results[mode].kind == "unresolved" else CheckFailed
        raise failure(str(results[mode]))


def _run_gradient_check(op: OpUnderTest, settings: Settings, order, modes, inner):
    low = narrowest(op.computes_in)
    if op.narrow is None and (low is None or jnp.finfo(low).bits >= 64):
        return check_gradients(
            op.func, op.args, order=order, settings=gradient_settings(settings, modes),
            undefined=False, batched=False, reentrant=False, inner=inner,
        )  # fmt: skip
    # No float64 path (the op refuses float64, or computes in float32 whatever it is
    # given): the op at its own dtypes, as a function of float64 inputs rounded to them,
    # differenced at a step and held to tolerances for the narrowest dtype it computes in.
    eps = float(jnp.finfo(low).eps) if low is not None else 2.0**-52
    narrow = Settings(
        eps=eps ** (1 / 3), atol=max(settings.atol, 1000 * eps), rtol=max(settings.rtol, 100 * eps),
        nondet_tol=settings.nondet_tol, fast_mode=None, modes=modes,
        num_directions=settings.num_directions, seed=settings.seed,
    )  # fmt: skip
    dtypes = [p.dtype for p in op.primals]

    def rounded(*values):
        return op.call(*(jnp.asarray(v).astype(d) for v, d in zip(values, dtypes, strict=True)))

    wide = tuple(np.asarray(p.astype(wide_dtype(p.dtype))) for p in op.primals)
    return check_gradients(
        rounded, wide, order=order, settings=narrow,
        undefined=False, batched=False, reentrant=False, inner=inner,
    )  # fmt: skip


def reference_check(op: OpUnderTest, settings: Settings, order: int, mode: str) -> str:
    """The gradient rows of an op with a reference (``opcheck(..., reference=)``): its
    values and VJPs (``mode="rev"``) or JVPs (``"fwd"``), at ``order`` 2 those of its
    VJP for a random cotangent, against JAX's autodiff of the reference in float64."""
    rtol = reference_rtol(op.computes_in)

    def reference(*values):
        return op.reference(*op.args_with(values))

    fn, ref = op.call, reference
    if order == 2:
        u = op.cotangent(np.random.default_rng(settings.seed + 11))
        u_wide = jax.tree_util.tree_map(
            lambda c: c.astype(wide_dtype(c.dtype)) if jnp.issubdtype(c.dtype, jnp.inexact) else c,
            u,
        )
        fn = lambda *p: vjp(op.call, p, u)  # noqa: E731
        ref = lambda *p: vjp(reference, p, u_wide)  # noqa: E731
    found = reference_mismatch(
        fn, ref, op.primals, op.labels, rtol=rtol, forward=mode == "fwd",
        reverse=mode == "rev", seed=settings.seed + 10 * order,
    )  # fmt: skip
    if found is not None:
        raise CheckFailed(f"against the reference (its autodiff in float64): {found}")
    what = {
        (1, "rev"): "values and VJPs", (1, "fwd"): "values and JVPs",
        (2, "rev"): "VJPs of the VJP", (2, "fwd"): "JVPs of the VJP",
    }[order, mode]  # fmt: skip
    computes = sorted(d.name for d in op.computes_in) or ["float64"]
    return (
        f"{what} match the reference's autodiff in float64 (normwise rtol {rtol:g}; the op "
        f"computes in {', '.join(computes)})"
    )


def first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else ""


def no_kernel(err: Exception, dtype: Any) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{jnp.dtype(dtype).name}: the op has no kernel for it ({type(err).__name__}: {first})"
