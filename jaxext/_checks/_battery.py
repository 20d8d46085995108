"""The checks of ``jaxext.opcheck``, one function each, in the order they run.

Each check takes the op under test and the settings, and returns a short
detail for the report, raises ``Skip`` with the reason it does not apply, or
raises ``CheckFailed`` with the diagnostic (``Unresolved`` where finite differences
cannot resolve entries none of which is wrong). Cheap structural checks run first.
Comparisons of two float64 programs that compute the same math (jit against
eager, vmap against a loop, checkpointed against plain ...) use ``TIGHT``, a
normwise relative tolerance far above float64 rounding and far below any bug.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._backward import (
    TIGHT,
    batched_mismatches,
    complex_counterpart,
    dtype_refusal,
    gradient_dtypes,
    loop_and_vmap,
    pick,
    refusal,
    stacked,
    zero_like,
)
from ._backward import reentrancy as reentrancy_mismatches
from ._backward import zero_cotangent as zero_cotangent_mismatches
from ._compare import unravel, widened
from ._gradcheck import Settings, check_gradients
from ._kernels import disabled_safety_checks, kernel_targets, unchecked
from ._leaves import is_complex, wide_dtype
from ._op import (
    CheckFailed,
    OpUnderTest,
    assert_trees_close,
    float_output_leaves,
    mismatch_text,
)
from ._plain import jax_limit, same_failure, strip_custom_rules

__all__ = ["CHECKS", "TIGHT", "Skip", "Unresolved"]

_BATCH = 3
_POLICIES = {
    "default": None,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Skip(Exception):
    """Raised by a check that does not apply to the op, with the reason."""


class Unresolved(CheckFailed):
    """Raised by a finite-difference check whose differences cannot resolve some entries,
    none wrong (``_fd_error``): neither PASS nor FAIL, with the entries named."""


def _require_forward_mode(op: OpUnderTest) -> None:
    if op.forward_error is not None:
        raise Skip(f"no forward mode (jax.jvp raises {op.forward_error})")


def _inner(u: Any, out: Any, *, absolute: bool = False) -> jax.Array:
    """``sum <u_i, out_i>`` (or ``sum <|u_i|, |out_i|>``) over the float leaves of two
    output pytrees. For complex leaves ``<u, t> = Re sum(u t)``: how JAX pairs a
    cotangent with a tangent (the real part is the pairing, nothing is dropped)."""
    pairs = zip(float_output_leaves(u), float_output_leaves(out), strict=True)
    if absolute:
        return sum((jnp.sum(jnp.abs(a * b)) for (_, a), (_, b) in pairs), jnp.zeros(()))
    return sum((jnp.real(jnp.sum(a * b)) for (_, a), (_, b) in pairs), jnp.zeros(()))


def _vjp(fn: Callable, primals, u) -> tuple:
    return jax.vjp(fn, *primals)[1](u)


def _fresh(op: OpUnderTest) -> Callable:
    """The op behind a new Python function, so that no trace cache is shared."""
    return lambda *values: op.func(*op.args_with(values))


def _jitted_together(op: OpUnderTest, fns: dict[str, Callable], *args: Any) -> dict[str, Any]:
    """``{name: fn(*args)}`` for each of ``fns``, jitted (``op.quick_jit``): all in one
    compiled program (one compilation, not one each); should that raise, each in its
    own, so that an error comes from the computation that raises it."""
    try:
        merged = op.quick_jit(lambda *a: {name: fn(*a) for name, fn in fns.items()})(*args)
    except Exception:  # noqa: BLE001 -- each alone below, to attribute the error
        return {name: op.quick_jit(fn)(*args) for name, fn in fns.items()}
    return {name: merged[name] for name in fns}  # in the order of `fns`, not sorted


def _gradient_settings(settings: Settings, modes: tuple[str, ...]) -> Settings:
    return Settings(
        eps=settings.eps, atol=settings.atol, rtol=settings.rtol, nondet_tol=settings.nondet_tol,
        fast_mode=None, modes=modes, num_directions=settings.num_directions, seed=settings.seed,
    )  # fmt: skip


# -- 0. C++ kernels that leave results unwritten ----------------------------------------------


def unwritten_outputs(op: OpUnderTest, settings: Settings) -> str:
    """The op's output, gradients and JVP, computed with the C++ kernels' result buffers
    filled with NaN (checking mode) and without: an element that is NaN (an integer that
    differs) only in checking mode was never written by a kernel."""
    rng = np.random.default_rng(settings.seed + 11)
    primals, u, v = op.primals, op.cotangent(rng), op.tangents(rng)
    computations: dict[str, tuple[Callable, list[str]]] = {}

    def add(what: str, fn: Callable) -> None:
        try:
            targets = kernel_targets(fn, *primals)
        except Exception:  # noqa: BLE001 -- a computation the op lacks (e.g. no gradient)
            return
        if targets:
            computations[what] = (jax.jit(fn), targets)

    add("output", op.call)
    add("gradient", lambda *p: _vjp(op.call, p, u))
    if op.forward_error is None:
        add("JVP", lambda *p: jax.jvp(op.call, p, v)[1])
    if not computations:
        raise Skip(
            "the op calls no C++ kernel of jaxext.cpp_extension (checking mode fills those "
            "kernels' result buffers)"
        )
    names = sorted({t.rsplit(".", 1)[-1] for _, ts in computations.values() for t in ts})
    for what, (fn, targets) in computations.items():
        with unchecked():
            plain = jax.device_get(fn(*primals))
        checked = jax.device_get(fn(*primals))  # opcheck runs its checks in checking mode
        if what == "gradient":
            names_and_trees = [
                (f"gradient of {label}", a, b)
                for label, a, b in zip(op.labels, checked, plain, strict=True)
            ]
        else:
            names_and_trees = [("output" if what == "output" else "JVP output", checked, plain)]
        for name, a, b in names_and_trees:
            _assert_written(a, b, name, targets)
    return f"every element of the results written by the kernel(s) {', '.join(names)}"


def _assert_written(checked: Any, plain: Any, what: str, targets: list[str]) -> None:
    flat_checked = jax.tree_util.tree_flatten_with_path(checked)[0]
    flat_plain = jax.tree_util.tree_leaves(plain)
    for (path, a), b in zip(flat_checked, flat_plain, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype == jax.dtypes.float0 or a.size == 0:
            continue
        if jnp.issubdtype(a.dtype, jnp.inexact):
            bad = np.isnan(a) & ~np.isnan(b)
            fill = "NaN"
        else:
            bad = a != b
            fill = "the sentinel"
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            kernels = ", ".join(t.rsplit(".", 1)[-1] for t in targets)
            raise CheckFailed(
                f"{what}{jax.tree_util.keystr(path)}: {int(bad.sum())} of {a.size} elements "
                f"were never written by a C++ kernel ({kernels}): they hold {fill}, the fill "
                f"of checking mode, e.g. element {first} (without checking mode it was "
                f"{b[first]!r}, whatever memory held)."
            )


# -- 1. forward rule, gradients, second order ------------------------------------------------


def forward_rule(op: OpUnderTest, settings: Settings) -> str:
    primals = op.primals
    plain = op.jitted(*primals)
    primal_of = {"jax.vjp": lambda *p: jax.vjp(op.call, *p)[0]}
    if op.forward_error is None:
        primal_of["jax.jvp"] = lambda *p: jax.jvp(op.call, p, p)[0]
    for how, primal in _jitted_together(op, primal_of, *primals).items():
        assert_trees_close(primal, plain, what=f"primal output of {how} vs the op", rtol=TIGHT)
    if op.forward_error is not None:
        return "jax.vjp's primal equals the op's output (no forward mode to compare)"
    return "the primal outputs of jax.vjp and jax.jvp equal the op's output"


# The checks that differentiate the same function (the op, its VJP, its JVP) in reverse
# and in forward mode: when both are selected, one run covers both (one numerical
# Jacobian, one set of compiled programs), and the second check reads the result.
_MODE_CHECKS = {
    (1, "rev"): {"rev": "gradcheck", "fwd": "jvp"},
    (2, "rev"): {"rev": "gradgradcheck", "fwd": "fwd_over_rev"},
}


def _gradient_check(
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
    return check_gradients(
        op.func, op.args, order=order, settings=_gradient_settings(settings, modes),
        undefined=False, batched=False, reentrant=False, inner=inner,
    )  # fmt: skip


def gradcheck(op: OpUnderTest, settings: Settings) -> str:
    _gradient_check(op, settings, 1, "rev")
    return "full Jacobian from VJPs matches central differences"


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else ""


def _skip_if_not_differentiable(op: OpUnderTest, settings: Settings, err: Exception) -> None:
    """Raises ``Skip`` if ``err``, raised while differentiating the backward, means the
    backward cannot be differentiated, by declaration (``once_differentiable``) or by
    JAX's own limit: the backward itself runs, and JAX refuses to differentiate it the
    same way with every custom rule inside it stripped (a ``while_loop`` with a dynamic
    trip count, which reverse mode cannot differentiate). A backward that raises only
    because a custom rule inside it does stays the op's FAIL."""
    if isinstance(err, CheckFailed):
        return
    if isinstance(err, RuntimeError) and "once_differentiable" in str(err):
        raise Skip(f"the backward is once_differentiable ({_first_line(err)})") from err
    u = op.cotangent(np.random.default_rng(settings.seed))

    def backward(*p):
        return _vjp(op.call, p, u)

    try:
        grads = jax.jit(backward)(*op.primals)
    except Exception:  # noqa: BLE001 -- the backward itself fails: that is the finding
        return
    plain = strip_custom_rules(backward)
    compositions = {
        "reverse": lambda *p: jax.vjp(plain, *p)[1](grads),
        "forward": lambda *p: jax.jvp(plain, p, p)[1],
    }
    for how, composition in compositions.items():
        try:
            jax.jit(composition)(*op.primals)
        except Exception as plain_err:  # noqa: BLE001 -- the evidence itself
            if same_failure(err, plain_err):
                raise Skip(
                    "the backward runs but cannot be differentiated, JAX's own limit (plain "
                    f"JAX, custom rules inside it stripped, refuses it the same way in {how} "
                    f"mode): {type(err).__name__}: {_first_line(err)}"
                ) from err


def gradgradcheck(op: OpUnderTest, settings: Settings) -> str:
    try:
        _gradient_check(op, settings, 2, "rev")
    except Exception as err:
        _skip_if_not_differentiable(op, settings, err)
        raise
    return "second derivatives (VJP of the VJP) match central differences"


def _second_order(op: OpUnderTest, settings: Settings, outer: str, inner: str) -> None:
    try:
        _gradient_check(op, settings, 2, outer, inner)
    except Exception as err:
        _skip_if_not_differentiable(op, settings, err)
        raise


def fwd_over_rev(op: OpUnderTest, settings: Settings) -> str:
    _second_order(op, settings, "fwd", "rev")
    return "second derivatives (JVP of the VJP) match central differences"


def _contract(a: Any, b: Sequence[Any]) -> tuple[float, float]:
    """``sum <a_i, b_i>`` and ``sum |a_i * b_i|`` over two lists of arrays (``<a, b> =
    Re sum(a b)`` for complex ones: JAX's pairing of a gradient with a tangent)."""
    pairs = [(widened(x), np.asarray(y)) for x, y in zip(a, b, strict=True)]
    value = sum(float(np.real(np.sum(x * y))) for x, y in pairs)
    return value, sum(float(np.sum(np.abs(x * y))) for x, y in pairs)


def _second_order_forward(op: OpUnderTest, settings: Settings, outer: str) -> str:
    """``D^2 f[u; t, s]`` from the JVP differentiated in ``outer`` mode, against reverse
    over reverse (what ``gradgradcheck`` checks against finite differences)."""
    _require_forward_mode(op)
    rng = np.random.default_rng(settings.seed + 11)
    primals, u = op.primals, op.cotangent(rng)
    t, s = op.tangents(rng), op.tangents(rng)
    everything = tuple(range(len(primals)))

    def jvp_of(*p):  # x -> J(x) t
        return jax.jvp(op.call, p, tuple(t))[1]

    def vjp_of(*p):  # x -> t . J(x)^T u (Re for complex: JAX's pairing)
        pairs = zip(_vjp(op.call, p, u), t, strict=True)
        return sum(jnp.real(jnp.sum(g * ti)) for g, ti in pairs)

    if outer == "rev":
        fns = {"got": lambda *p: _vjp(jvp_of, p, u)}
        how = "jax.vjp of the JVP"
    else:
        fns = {"got": lambda *p: jax.jvp(jvp_of, p, tuple(s))[1]}
        how = "jax.jvp of the JVP"
    # Reverse over reverse, the same for both checks (the same seed): computed once, in
    # the program of the first of them to run.
    if "reverse_over_reverse" not in op.cache:
        fns["reference"] = jax.grad(vjp_of, argnums=everything)
    try:
        results = _jitted_together(op, fns, *primals)
    except Exception as err:
        _skip_if_not_differentiable(op, settings, err)
        raise
    got = results["got"]
    reference = op.cache.setdefault("reverse_over_reverse", results.get("reference"))
    if outer == "rev":
        value, scale = _contract(got, s)
    else:
        value, scale = float(_inner(u, got)), float(_inner(u, got, absolute=True))
    expected, expected_scale = _contract(reference, s)
    allowed = TIGHT * max(scale, expected_scale)
    if not abs(value - expected) <= allowed:
        raise CheckFailed(
            f"u . D2f[t, s] = {value:.12g} from {how} but {expected:.12g} from the VJP "
            f"differentiated in reverse mode (random u, t, s; abs difference "
            f"{abs(value - expected):.3e}, allowed {allowed:.3e}): the forward mode is wrong "
            "at second order (a jvp rule that cuts the derivative through a residual?)."
        )
    return f"u . D2f[t, s] from {how} equals reverse over reverse (random u, t, s)"


def rev_over_fwd(op: OpUnderTest, settings: Settings) -> str:
    return _second_order_forward(op, settings, "rev")


def fwd_over_fwd(op: OpUnderTest, settings: Settings) -> str:
    return _second_order_forward(op, settings, "fwd")


# -- 2. forward mode -----------------------------------------------------------------------


def jvp(op: OpUnderTest, settings: Settings) -> str:
    _require_forward_mode(op)
    _gradient_check(op, settings, 1, "fwd")
    return "full Jacobian from JVPs matches central differences"


def jvp_vjp(op: OpUnderTest, settings: Settings) -> str:
    _require_forward_mode(op)
    rng = np.random.default_rng(settings.seed + 1)
    primals, u, v = op.primals, op.cotangent(rng), op.tangents(rng)
    both = {"jv": lambda *p: jax.jvp(op.call, p, v)[1], "jtu": lambda *p: _vjp(op.call, p, u)}
    got = _jitted_together(op, both, *primals)
    jv, jtu = got["jv"], got["jtu"]
    left = float(_inner(u, jv))
    right = float(sum(np.real(np.sum(np.asarray(a) * b)) for a, b in zip(jtu, v, strict=True)))
    scale = float(_inner(u, jv, absolute=True))
    scale += float(sum(np.sum(np.abs(np.asarray(a) * b)) for a, b in zip(jtu, v, strict=True)))
    if not abs(left - right) <= TIGHT * scale:
        raise CheckFailed(
            f"u . (J v) = {left:.12g} from jax.jvp but (J^T u) . v = {right:.12g} from jax.vjp "
            f"(random u, v; abs difference {abs(left - right):.3e}, allowed {TIGHT * scale:.3e}): "
            "forward and reverse mode disagree."
        )
    return "u . (J v) from jax.jvp equals (J^T u) . v from jax.vjp"


# -- 3. and 4. jit ---------------------------------------------------------------------------


def jit(op: OpUnderTest, settings: Settings) -> str:
    rng = np.random.default_rng(settings.seed + 2)
    primals, u = op.primals, op.cotangent(rng)
    eager = op.call(*primals)
    jitted = op.jitted(*primals)
    assert_trees_close(jitted, eager, what="output under jit vs eager", rtol=TIGHT)
    eager_grads = _vjp(op.call, primals, u)
    jitted_grads = op.pullback(primals, u)
    for label, a, e in zip(op.labels, jitted_grads, eager_grads, strict=True):
        assert_trees_close(a, e, what=f"gradient of {label} under jit vs eager", rtol=TIGHT)
    return "values and gradients under jit equal eager ones"


def _subsets(count: int) -> list[tuple[int, ...]]:
    if count <= 4:
        return [s for r in range(1, count + 1) for s in itertools.combinations(range(count), r)]
    return [(i,) for i in range(count)] + [tuple(range(count))]


def jit_reuse(op: OpUnderTest, settings: Settings) -> str:
    primals = op.primals
    if len(primals) < 2:  # its one subset is every input: the `jit` check
        raise Skip(
            f"only one differentiable input ({op.labels[0] if op.labels else 'none'}): no "
            "subset of inputs to leave out"
        )
    rng = np.random.default_rng(settings.seed + 3)
    u, u2, u3, u4, u5 = (op.cotangent(rng) for _ in range(5))
    subsets = _subsets(len(primals))
    everything = tuple(range(len(primals)))
    shared = jax.jit(_fresh(op))

    def grads(fn, subset, cotangent):
        return _vjp(op.with_only(subset, fn), [primals[i] for i in subset], cotangent)

    # The reference: every input differentiated at once, in a fresh trace.
    fresh_full = op.quick_jit(
        lambda c: (grads(_fresh(op), everything, c), _inner(c, op.call(*primals)))
    )
    full, inner = {}, {}
    for c in (u, u2, u3, u4, u5):
        full[id(c)], inner[id(c)] = fresh_full(c)
    square_weight = 2 * float(inner[id(u5)])

    def expected_uses(i, first, second):
        expected = square_weight * np.asarray(full[id(u5)][i])
        if i in first:
            expected = expected + np.asarray(full[id(u)][i]) + np.asarray(full[id(u3)][i])
        if i in second:
            expected = expected + np.asarray(full[id(u2)][i]) + np.asarray(full[id(u4)][i])
        return expected

    bodies = {  # the jitted runs, each a program of its own, or all in one program
        "in jit": lambda s: grads(shared, s, u),
        "fresh jit": lambda s: grads(_fresh(op), s, u),
    }
    merged, merged_error = None, None
    for s in subsets:  # one jitted op, reused across calls with other inputs differentiated
        runs = {"eager": lambda s=s: grads(shared, s, u)}
        runs.update({how: jax.jit(functools.partial(body, s)) for how, body in bodies.items()})
        for how, run in runs.items():
            if how != "eager" and merged is None and merged_error is None:
                # Every subset's jitted runs in one program: one compilation, not two per
                # subset. Should it raise, each subset's runs go alone, to name the subset.
                try:
                    merged = op.quick_jit(
                        lambda: {h: [b(t) for t in subsets] for h, b in bodies.items()}
                    )()
                except Exception as err:  # noqa: BLE001 -- attributed to a subset below
                    merged_error = err
            try:
                got = merged[how][subsets.index(s)] if how != "eager" and merged else run()
            except Exception as err:  # noqa: BLE001 -- attributed to the subset, then reported
                raise CheckFailed(
                    f"differentiating only {[op.labels[j] for j in s]} ({how}) raised "
                    f"{type(err).__name__}: {err}"
                ) from err
            for i, a in zip(s, got, strict=True):
                what = (
                    f"gradient of {op.labels[i]} differentiating only "
                    f"{[op.labels[j] for j in s]} ({how}) vs all inputs at once"
                )
                assert_trees_close(a, full[id(u)][i], what=what, rtol=TIGHT)
    if merged_error is not None:  # raised only with every subset in one program
        raise CheckFailed(
            "differentiating each subset of inputs in turn in one jitted program raised "
            f"{type(merged_error).__name__}: {merged_error}"
        ) from merged_error
    # The uses' outputs weighed by u, u2, u3, u4, and the last squared: one jitted
    # function (differentiated eagerly, op by op, this would compile a dozen programs).
    weigh = jax.jit(
        lambda outs, last: sum(map(_inner, (u, u2, u3, u4), outs)) + _inner(u5, last) ** 2
    )
    pairs = [(a, b) for a, b in zip(subsets, subsets[1:] + subsets[:1], strict=True) if a != b]
    for first, second in pairs:
        # The same jitted op several times in one differentiated computation, with other
        # inputs differentiated each time: the form in which a residual-layout bug shows.
        # The inputs left out are cut by stop_gradient, or constants (not perturbed at
        # all: `op(a, c) + op(c, b) + op(a, b) ** 2`, c a constant), and one use has
        # every input differentiated, squared (its cotangent depends on the output).
        def uses(*values, first=first, second=second, shared=shared):
            outs = []
            for subset, cut in ((first, True), (second, True), (first, False), (second, False)):
                kept = [
                    v if i in subset else jax.lax.stop_gradient(v) if cut else primals[i]
                    for i, v in enumerate(values)
                ]
                outs.append(shared(*kept))
            return weigh(outs, shared(*values))

        # The jitted op's cache matters: the one used above, already traced for each
        # subset, and for inputs 0 and 1 a fresh one, called once before (as in an
        # evaluation pass before training).
        caches = {"jitted op reused": shared}
        if first == (0,) and second == (1,):
            warm = jax.jit(_fresh(op))
            warm(*primals)
            caches["fresh jitted op, called once before"] = warm
        for how, jitted in caches.items():
            _check_uses(op, uses, jitted, first, second, how, expected_uses)
    return f"{len(subsets)} subsets of differentiated inputs, {len(pairs)} pairs in one computation"


def _check_uses(op, uses, jitted, first, second, how, expected_uses) -> None:
    everything = tuple(range(len(op.primals)))
    try:
        got = jax.grad(functools.partial(uses, shared=jitted), argnums=everything)(*op.primals)
    except Exception as err:  # noqa: BLE001 -- attributed to the pair, then reported
        raise CheckFailed(
            f"the op used several times in one computation ({how}; differentiating "
            f"{[op.labels[j] for j in first]}, then {[op.labels[j] for j in second]}, "
            f"the others cut by stop_gradient or constants) raised "
            f"{type(err).__name__}: {err}"
        ) from err
    for i, label in enumerate(op.labels):
        what = (
            f"gradient of {label} with the op used several times in one computation ({how}; "
            f"differentiating {[op.labels[j] for j in first]}, then "
            f"{[op.labels[j] for j in second]}, the others cut by stop_gradient or "
            "constants, and all of them squared)"
        )
        assert_trees_close(got[i], expected_uses(i, first, second), what=what, rtol=TIGHT)


# -- 5. vmap -------------------------------------------------------------------------------


def _is_key(leaf: Any) -> bool:
    """A typed PRNG key array (``jax.random.key``)."""
    return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _batched_leaf(leaf: Any, rng: np.random.Generator) -> Any:
    """``_BATCH`` versions of an array leaf, stacked: float ones perturbed, typed PRNG
    keys split (``jax.random.split``: a batch of independent keys), others repeated."""
    if _is_key(leaf):
        keys = jax.vmap(lambda k: jax.random.split(k, _BATCH))(leaf.reshape(-1))
        return keys.T.reshape((_BATCH, *leaf.shape))
    # A JAX array stays a JAX array (the op sees what a user's code passes).
    xp = jnp if isinstance(leaf, jax.Array) else np
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
        return xp.stack([leaf * (1 + 0.1 * rng.standard_normal(leaf.shape)) for _ in range(_BATCH)])
    return xp.stack([leaf] * _BATCH)


def _is_batchable(leaf: Any) -> bool:
    """An array leaf: what vmap maps over. Python scalars, strings, ``None`` and other
    leaves stay static (``in_axes=None``), closed over rather than passed."""
    return isinstance(leaf, (jax.Array, np.ndarray))


def _on_host(leaf: Any) -> Any:
    """A JAX array of a plain dtype as a NumPy array of the same abstract value."""
    if not isinstance(leaf, jax.Array) or jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended):
        return leaf  # PRNG keys stay JAX arrays
    if leaf.weak_type:
        return leaf
    return np.asarray(leaf)


def vmap(op: OpUnderTest, settings: Settings) -> str:
    rng = np.random.default_rng(settings.seed + 4)
    forward = op.forward_error is None
    parts = {}
    for index, arg in enumerate(op.args):
        leaves, treedef = jax.tree_util.tree_flatten(arg)
        mapped = [i for i, leaf in enumerate(leaves) if _is_batchable(leaf)]
        if not mapped:
            continue  # a static argument cannot be batched
        # Every call of the op below is traced (under jit or vmap): a host copy of the
        # batch gives it the same abstract values, and picking an element of it compiles
        # nothing (of a JAX array, eagerly, two small programs per shape). Only the array
        # leaves are batched (and passed); the others are closed over, as given.
        try:
            batch = [_on_host(_batched_leaf(leaves[i], rng)) for i in mapped]
        except Exception as err:  # noqa: BLE001 -- a leaf that cannot be batched: said why
            raise Skip(
                f"input {index} cannot be batched for vmap ({type(err).__name__}: "
                f"{_first_line(err)})"
            ) from err

        def full_args(values, index=index, leaves=leaves, treedef=treedef, mapped=mapped):
            new = list(leaves)
            for i, value in zip(mapped, values, strict=True):
                new[i] = value
            value = jax.tree_util.tree_unflatten(treedef, new)
            return op.args[:index] + (value,) + op.args[index + 1 :]

        def apply(value, full_args=full_args):
            return op.func(*full_args(value))

        def gradient(value, u, full_args=full_args):
            args = full_args(value)
            return _vjp(lambda *v: op.func(*op.args_with(v, args)), op.float_leaves(args), u)

        def tangent(value, t, full_args=full_args):
            args = full_args(value)
            fn = lambda *v: op.func(*op.args_with(v, args))  # noqa: E731
            return jax.jvp(fn, tuple(op.float_leaves(args)), tuple(t))[1]

        items = [pick(batch, b) for b in range(_BATCH)]
        us = [op.cotangent(rng) for _ in range(_BATCH)]
        parts[index, "output"] = (apply, [(item,) for item in items], (batch,), 0)
        parts[index, "gradient"] = (
            gradient,
            list(zip(items, us, strict=True)),
            (batch, stacked(us)),
            0,
        )
        if forward:
            ts = [op.tangents(rng) for _ in range(_BATCH)]
            parts[index, "JVP"] = (
                tangent,
                list(zip(items, ts, strict=True)),
                (batch, stacked(ts)),
                0,
            )
    # Every batched input's output, gradient and JVP, looped and vmapped: one program.
    for (index, part), (looped, batched) in loop_and_vmap(parts, op.quick_jit).items():
        what = f"vmap over input {index} vs a loop"
        if isinstance(batched, Exception):
            raise batched
        if part != "gradient":
            assert_trees_close(batched, looped, what=f"{what}: {part}", rtol=TIGHT)
            continue
        for m in batched_mismatches(looped, batched, _BATCH, TIGHT)[:1]:
            element = (m.direction, *unravel(m.in_element, op.primals[m.in_block].shape))
            raise CheckFailed(mismatch_text(f"{what}: gradients[{m.in_block}]", m, element))
    checked = sorted({index for index, _ in parts})
    parts = "output, gradient and JVP" if forward else "output and gradient"
    return f"{parts} under vmap over input(s) {checked} equal a loop"


# -- 6. zero cotangents ---------------------------------------------------------------------


def zero_cotangent(op: OpUnderTest, settings: Settings) -> str:
    primals = op.primals
    zero = jax.tree_util.tree_map(zero_like, op.output_shapes())
    for m in zero_cotangent_mismatches(lambda _: op.pullback(primals, zero), zero)[:1]:
        element = unravel(m.in_element, primals[m.in_block].shape)
        raise CheckFailed(
            f"gradient of {op.labels[m.in_block]} for a zero cotangent is not zero: element "
            f"{element} is {m.actual:.10g} ({m.count} of {m.total} elements nonzero)."
        )
    outputs = float_output_leaves(op.output_shapes())
    if len(outputs) < 2:
        return "a zero cotangent gives zero gradients"
    rng = np.random.default_rng(settings.seed + 5)
    u = op.cotangent(rng)
    for keep, (path, _) in enumerate(outputs):
        # Only output `keep` is used: JAX passes symbolic zeros for the others.
        def loss(*p, keep=keep):
            return _inner(
                [leaf for i, (_, leaf) in enumerate(float_output_leaves(u)) if i == keep],
                [leaf for i, (_, leaf) in enumerate(float_output_leaves(op.call(*p))) if i == keep],
            )

        got = op.quick_jit(jax.grad(loss, argnums=tuple(range(len(primals)))))(*primals)
        only = _only_float_leaf(u, keep)
        expected = op.quick_jit(lambda *p, only=only: _vjp(op.call, p, only))(*primals)
        for label, a, e in zip(op.labels, got, expected, strict=True):
            what = f"gradient of {label} with only output {path or keep} used (symbolic zeros)"
            assert_trees_close(a, e, what=what, rtol=TIGHT)
    return "a zero cotangent gives zero gradients; unused outputs (symbolic zeros) work"


def _only_float_leaf(tree: Any, keep: int) -> Any:
    """``tree`` with every float leaf but the ``keep``-th replaced by zeros."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    index = -1
    for position, leaf in enumerate(leaves):
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            index += 1
            if index != keep:
                leaves[position] = np.zeros_like(leaf)
    return jax.tree_util.tree_unflatten(treedef, leaves)


# -- 7. gradient dtypes ---------------------------------------------------------------------


def grad_dtypes(op: OpUnderTest, settings: Settings) -> str:
    checked, unsupported, not_taken = [], [], []
    for dtype in (jnp.float64, jnp.float32, jnp.bfloat16):
        if dtype != jnp.float64 and dtype_refusal(op, dtype) is not None:
            not_taken.append(jnp.dtype(dtype).name)  # nothing to check: what the op takes is
            continue
        try:
            found = gradient_dtypes(op, dtype)
        except NotImplementedError as err:  # no kernel for this dtype: what the op cannot do
            unsupported.append(_no_kernel(err, dtype))
            continue
        if found is not None:
            primal, grad, shape = found.primal, found.grad, tuple(found.primal.shape)
            raise CheckFailed(
                f"gradient of {found.label} is {np.dtype(grad.dtype)}{tuple(grad.shape)} for an "
                f"input of {np.dtype(primal.dtype)}{shape}; expected {found.expected}{shape} "
                "(JAX does not check a custom_vjp backward's dtypes)."
            )
        checked.append(jnp.dtype(dtype).name)
    if unsupported:
        raise Skip(f"{', '.join(checked)} checked; not run: {'; '.join(unsupported)}")
    refused = f"; the op does not take {', '.join(not_taken)}" if not_taken else ""
    return f"gradients have their inputs' dtypes and shapes ({', '.join(checked)} inputs{refused})"


# -- 8. reentrancy --------------------------------------------------------------------------


def reentrancy(op: OpUnderTest, settings: Settings) -> str:
    rng = np.random.default_rng(settings.seed + 7)
    primals, u = op.primals, op.cotangent(rng)
    runs = {
        "under jit": lambda: op.pullback(primals, u),
        "eagerly": lambda: _vjp(op.call, primals, u),
    }
    found = reentrancy_mismatches(runs, settings.nondet_tol)
    if found is not None:
        how, (m, *_) = found
        what = f"gradient of {op.labels[m.in_block]}, second run of the backward {how} vs the first"
        raise CheckFailed(mismatch_text(what, m, unravel(m.in_element, primals[m.in_block].shape)))
    return f"two runs of the backward agree within nondet_tol={settings.nondet_tol:g}"


# -- 9. checkpoint --------------------------------------------------------------------------


def _checkpointed_gradients(op: OpUnderTest, u: Any) -> dict[str, Callable]:
    """``{policy name: primals -> gradients under jax.checkpoint with it}``, and the
    gradients without it under ``"reference"``."""
    gradients = {"reference": lambda *p: _vjp(op.call, p, u)}
    for name, policy in _POLICIES.items():
        remat = jax.checkpoint(_fresh(op), policy=policy)
        gradients[name] = lambda *p, remat=remat: _vjp(remat, p, u)
    return gradients


def checkpoint(op: OpUnderTest, settings: Settings) -> str:
    rng = np.random.default_rng(settings.seed + 8)
    primals, u = op.primals, op.cotangent(rng)
    gradients = _checkpointed_gradients(op, u)
    not_run = {}
    try:
        got = op.quick_jit(lambda *p: {name: fn(*p) for name, fn in gradients.items()})(*primals)
    except Exception:  # noqa: BLE001 -- each policy alone below, to attribute the error
        got = {"reference": op.quick_jit(gradients.pop("reference"))(*primals)}
        for name, fn in gradients.items():
            try:
                got[name] = op.quick_jit(fn)(*primals)
            except Exception as err:
                # A policy JAX itself cannot apply to this math (everything_saveable over
                # complex intermediates) is not run; any other error is the op's.
                limit = jax_limit(
                    op,
                    err,
                    lambda twin, name=name: jax.jit(_checkpointed_gradients(twin, u)[name])(
                        *twin.primals
                    ),
                )
                if limit is None:
                    raise
                not_run[name] = limit
    reference = got.pop("reference")
    for name, grads in got.items():
        for label, a, e in zip(op.labels, grads, reference, strict=True):
            what = f"gradient of {label} under jax.checkpoint(policy={name})"
            assert_trees_close(a, e, what=what, rtol=TIGHT)
    if not_run:
        reasons = "; ".join(f"{name}: {why}" for name, why in not_run.items())
        raise Skip(
            f"same gradients under jax.checkpoint with {len(got)} of {len(_POLICIES)} "
            f"policies; not run: {reasons}"
        )
    return f"same gradients under jax.checkpoint with {len(_POLICIES)} policies"


# -- 10. export -----------------------------------------------------------------------------


def _require_serializer() -> None:
    """Skips an export check where jax.export cannot serialize: a missing package, not the op."""
    try:
        import flatbuffers  # noqa: F401 -- what jax.export's serialization imports
    except ImportError:
        raise Skip(
            "jax.export serialization needs the flatbuffers package (pip install 'jaxext[export]')"
        ) from None


def _round_trip(fn: Callable, specs: list) -> Callable:
    # The C++ kernels of jaxext.cpp_extension are custom calls without JAX's
    # compatibility guarantees: exporting them needs this opt-in (and the extension
    # loaded where the export is run).
    exported = jax.export.export(jax.jit(fn), disabled_checks=disabled_safety_checks())(*specs)
    return jax.export.deserialize(exported.serialize()).call


def export(op: OpUnderTest, settings: Settings) -> str:
    _require_serializer()
    rng = np.random.default_rng(settings.seed + 9)
    primals, u = op.primals, op.cotangent(rng)
    specs = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in primals]
    gradient = lambda *p: _vjp(_fresh(op), p, u)  # noqa: E731
    try:
        call = _round_trip(_fresh(op), specs)
        call_gradient = _round_trip(gradient, specs)
    except Exception as err:  # noqa: BLE001 -- not exportable: reported, not raised
        raise CheckFailed(
            f"the op cannot be exported with jax.export: {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}"
        ) from err
    assert_trees_close(call(*primals), op.jitted(*primals), what="exported output", rtol=TIGHT)
    expected = jax.jit(gradient)(*primals)
    for label, a, e in zip(op.labels, call_gradient(*primals), expected, strict=True):
        assert_trees_close(a, e, what=f"exported gradient of {label}", rtol=TIGHT)
    return "serialized, deserialized and called: same values and gradients"


def export_symbolic(op: OpUnderTest, settings: Settings) -> str:
    _require_serializer()
    primals = op.primals
    batched = next((i for i, p in enumerate(primals) if p.ndim >= 2), None)
    if batched is None:
        raise Skip("no float input has two or more dimensions to give a symbolic batch dimension")
    if primals[batched].shape[0] == 0:
        raise Skip(
            f"{op.labels[batched]} has an empty leading dimension: jax.export's symbolic "
            "dimensions are at least 1, so it cannot be called with 0"
        )
    leading = primals[batched].shape[0]
    # The symbolic dimension on input `batched` alone; where the op ties its shape to
    # another input's (two inputs of an elementwise op), on every float input of the
    # same leading dimension: one shared batch dimension.
    shared = [i for i, p in enumerate(primals) if p.ndim >= 1 and p.shape[0] == leading]
    attempts = [[batched]] + ([shared] if shared != [batched] else [])
    for symbolic in attempts:
        specs = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in primals]
        scope = jax.export.SymbolicScope()  # one `b` for all of them
        for i in symbolic:
            dims = ", ".join(["b", *map(str, primals[i].shape[1:])])
            shape = jax.export.symbolic_shape(dims, scope=scope)
            specs[i] = jax.ShapeDtypeStruct(shape, primals[i].dtype)
        try:
            call = _round_trip(_fresh(op), specs)
            break
        except Exception as err:  # noqa: BLE001 -- a capability the op lacks, not a wrong result
            if symbolic is attempts[0]:
                first_error = err
    else:
        message = str(first_error).splitlines()[0] if str(first_error) else ""
        raise Skip(
            f"the op does not trace with a symbolic leading dimension of {op.labels[batched]} "
            f"({type(first_error).__name__}: {message[:200]})"
        ) from first_error
    names = " and ".join(op.labels[i] for i in symbolic)
    what = f"a symbolic leading dimension of {names}"
    assert_trees_close(
        call(*primals), op.jitted(*primals), what=f"output exported with {what}", rtol=TIGHT
    )
    return f"exported with {what}: same values"


# -- 11. lower precision --------------------------------------------------------------------


def _no_kernel(err: Exception, dtype: Any) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{jnp.dtype(dtype).name}: the op has no kernel for it ({type(err).__name__}: {first})"


def low_precision(op: OpUnderTest, settings: Settings) -> str:
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
            unsupported.append(_no_kernel(err, dtype))
            continue
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
        assert_trees_close(got, reference, what=f"{name} output vs float64", rtol=rtol)
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


CHECKS: dict[str, Callable[[OpUnderTest, Settings], str]] = {
    "unwritten_outputs": unwritten_outputs,
    "forward_rule": forward_rule,
    "grad_dtypes": grad_dtypes,
    "zero_cotangent": zero_cotangent,
    "reentrancy": reentrancy,
    "gradcheck": gradcheck,
    "gradgradcheck": gradgradcheck,
    "jvp": jvp,
    "jvp_vjp": jvp_vjp,
    "fwd_over_rev": fwd_over_rev,
    "rev_over_fwd": rev_over_fwd,
    "fwd_over_fwd": fwd_over_fwd,
    "jit": jit,
    "jit_reuse": jit_reuse,
    "vmap": vmap,
    "checkpoint": checkpoint,
    "export": export,
    "export_symbolic": export_symbolic,
    "low_precision": low_precision,
}
