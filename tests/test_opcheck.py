"""Tests for `jaxext.opcheck`.

Correct ops (jaxext's, the Flax layers, Function-defined ops, plain ``jax.custom_vjp``
and ``jax.custom_jvp`` ops) must pass every check that applies. Buggy ops, each with
one known defect (written here, or in tests/checker_ops.py where
tests/test_checker_catalogue.py uses them too), must be rejected by the check for that
defect (the first check to fail, named in the error), never by a crash.
"""

from __future__ import annotations

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checker_ops import (
    abs_cotangent,
    f64,
    float32_grad_always,
    float32_grad_for_bfloat16,
    fwd_differs_from_primal,
    jvp_rule_wrong_at_second_order,
    l2_penalty_off_by_2x,
    linalg_solve,
    residual_layout_cached,
    residuals_by_perturbed_reused,
    symbolic_zero_as_ones,
)
from helpers import Cube, tiered
from ops_table import OPS

import jaxext
from jaxext._checks import CHECK_NAMES

# -- correct ops -------------------------------------------------------------------------------


@jax.custom_vjp
def plain_vjp_linear(x, w):
    return x @ w.T


plain_vjp_linear.defvjp(
    lambda x, w: (plain_vjp_linear(x, w), (x, w)),
    lambda res, g: (g @ res[1], g.T @ res[0]),
)


CORRECT_OPS = {
    # name -> (function returning (op, args), checks expected to SKIP)
    # The library's ops and layers (tests/ops_table.py): no check skipped.
    **{name: (build, ()) for op in OPS for name, build in op.opcheck_cases.items()},
    # Tricky correct ops (permutations, integer ids, .at[] updates, a scalar output,
    # mixed precision, tiny scales, what an op cannot do as a SKIP with its reason ...):
    # tests/test_checker_catalogue.py, which asserts the exact SKIPs.
    "plain_custom_vjp": (
        lambda: (plain_vjp_linear, (f64(0, (4, 3)), f64(1, (2, 3)))),
        ("jvp", "jvp_vjp", "rev_over_fwd", "fwd_over_fwd"),
    ),
    # An output shape the random cotangents and inner products must handle: an integer
    # output beside a float one (a float0 cotangent leaf); a scalar output (a NumPy
    # scalar cotangent) is in the catalogue.
    "integer_output": (
        lambda: (lambda x: (jnp.argmax(x, -1), jnp.max(x, -1)), (f64(0, (3, 4)),)),
        (),
    ),
}


@pytest.mark.parametrize("name", sorted(CORRECT_OPS))
def test_correct_ops_pass(name):
    make, expected_skips = CORRECT_OPS[name]
    op, args = make()
    report = jaxext.opcheck(op, args, raise_exception=False)
    assert report.failed == (), str(report)
    # unwritten_outputs applies to ops with C++ kernels only (tests/test_cpp_extension.py);
    # jit_reuse to ops with two float array leaves or more (subsets of them to differentiate).
    floats = [
        leaf
        for leaf in jax.tree.leaves(args)
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic))
        and jnp.issubdtype(leaf.dtype, jnp.inexact)
    ]
    assert ("jit_reuse" in report.skipped) == (len(floats) < 2), str(report)
    allowed = {"export_symbolic", "unwritten_outputs", "jit_reuse"}
    assert set(report.skipped) <= set(expected_skips) | allowed
    assert "unwritten_outputs" in report.skipped
    assert set(expected_skips) <= set(report.skipped)
    assert len(report.results) == len(CHECK_NAMES)


def _softmax_with_temperature(bf16_gradient_factor):
    """softmax(x / t) . w with a 0-d temperature t; its t-gradient is a sum that cancels
    (softmax's derivatives in t sum to zero), so it is small beside the terms it sums.
    ``bf16_gradient_factor`` scales the bfloat16 gradients only: 1.0 is the correct op."""

    @jaxext.custom_vjp
    def op(x, t):
        return jax.nn.softmax(x / t)

    def fwd(x, t):
        y = op(x, t)
        return y, (x, t, y)

    def bwd(res, g):
        x, t, y = res
        s = y * (g - jnp.sum(g * y))  # d/d(x/t) of softmax, applied to g
        factor = bf16_gradient_factor if x.dtype == jnp.bfloat16 else 1.0
        return (factor * s / t, factor * -jnp.sum(s * x) / t**2)

    op.defvjp(fwd, bwd)
    x = 3.0 * f64(0, (16,))
    return op, (x, np.asarray(0.7))


@pytest.mark.parametrize(("factor", "verdict"), [(1.0, "PASS"), (2.0, "FAIL")])
def test_low_precision_allows_for_a_gradient_that_cancels_and_still_catches_errors(factor, verdict):
    # The rounding error of a gradient that sums cancelling terms follows the terms'
    # size: the correct op PASSes (it FAILed when the allowance was 16 eps of the small
    # result); a bfloat16 gradient 2x off still FAILs.
    op, args = _softmax_with_temperature(factor)
    report = jaxext.opcheck(op, args, checks=["low_precision"], raise_exception=False)
    assert report.statuses == {"low_precision": verdict}, str(report)
    if verdict == "FAIL":
        assert "bfloat16 gradient" in report["low_precision"].detail


def _softmax_by_hand(buggy_dtype=None, factor=1.0):
    """softmax with a hand-written backward that keeps the output as its residual, as a
    user writes it; the gradients of ``buggy_dtype`` inputs are scaled by ``factor``."""

    @jaxext.custom_vjp
    def op(x):
        return jax.nn.softmax(x)

    def fwd(x):
        y = op(x)
        return y, y

    def bwd(y, g):
        scale = factor if y.dtype == buggy_dtype else 1.0
        return (scale * y * (g - jnp.sum(g * y, axis=-1, keepdims=True)),)

    op.defvjp(fwd, bwd)
    return op


@pytest.mark.parametrize("op", ["jax.nn.softmax", "by_hand"])
@pytest.mark.parametrize("scale", [1.0, 20.0, 40.0, 80.0])
@pytest.mark.parametrize("seed", [0, 3])
def test_low_precision_passes_softmax_of_large_logits(op, scale, seed):
    # With logits in the tens the largest probability rounds to within eps of 1, and the
    # backward's g - sum(g * y) keeps eps * |g| of error in an entry of size ~1e-7: the
    # rounding of the residual y, which no float32 backward avoids. These inputs FAILed
    # (4 of the 8 points) when the allowance was 16 eps of the gradient's size alone.
    fn = jax.nn.softmax if op == "jax.nn.softmax" else _softmax_by_hand()
    report = jaxext.opcheck(fn, (scale * f64(seed, (4, 16)),), checks=["low_precision"])
    assert report.statuses == {"low_precision": "PASS"}, str(report)


@pytest.mark.parametrize("scale", [1.0, 40.0])
@pytest.mark.parametrize(("dtype", "factor"), [(jnp.bfloat16, 2.0), (jnp.float32, 1.0001)])
def test_low_precision_still_catches_a_wrong_low_precision_gradient(scale, dtype, factor):
    # The allowance for residual rounding is per entry: the entries that rounding barely
    # touches keep a tight one, so a wrong gradient of one dtype's path FAILs even where
    # another entry of the same gradient has no correct digit left.
    op = _softmax_by_hand(dtype, factor)
    report = jaxext.opcheck(
        op, (scale * f64(3, (4, 16)),), checks=["low_precision"], raise_exception=False
    )
    assert report.statuses == {"low_precision": "FAIL"}, str(report)
    assert f"{jnp.dtype(dtype).name} gradient of input 0" in report["low_precision"].detail


def test_a_dtype_without_a_kernel_is_a_skip_with_the_reason():
    # jnp.linalg.solve has no bfloat16 kernel on CPU: what the op cannot do, not a bug.
    if jax.default_backend() != "cpu":
        pytest.skip("bfloat16 solve has a kernel on this backend")
    op, args = linalg_solve()
    report = jaxext.opcheck(op, args, checks=["grad_dtypes", "low_precision"])
    assert report.skipped == ("low_precision",), str(report)
    detail = report["low_precision"].detail
    assert "float32 checked" in detail and "bfloat16" in detail
    # JAX 0.10 fails when the bfloat16 program runs (no kernel), newer JAX refuses the dtype
    # while tracing (a TypeError naming it): either way the reason is the op's, not a bug.
    assert "no kernel" in detail or "does not take it" in detail, detail
    assert report["grad_dtypes"].status == "PASS"


def test_a_backward_that_fails_to_run_is_not_skipped_by_gradgradcheck():
    @jax.custom_vjp
    def op(x):
        return jnp.sin(x)

    def bwd(x, g):
        raise ValueError("the backward is broken")

    op.defvjp(lambda x: (jnp.sin(x), x), bwd)
    report = jaxext.opcheck(op, (f64(0, (3,)),), checks=["gradgradcheck"], raise_exception=False)
    assert report.failed == ("gradgradcheck",)
    assert "the backward is broken" in report["gradgradcheck"].detail


def test_a_dtype_the_op_refuses_is_not_a_failure():
    """An op taking float32 and float64 only (as jaxext's C++ kernels): grad_dtypes checks
    the dtypes it takes and says which it does not; low_precision SKIPs bfloat16."""

    def sin_f32_f64(x):
        if x.dtype not in (jnp.float32, jnp.float64):
            raise TypeError(f"`x` must be float32 or float64; got {x.dtype}.")
        return jnp.sin(x)

    report = jaxext.opcheck(sin_f32_f64, (f64(0, (3,)),), checks=["grad_dtypes", "low_precision"])
    assert report.statuses == {"grad_dtypes": "PASS", "low_precision": "SKIP"}, str(report)
    detail = report["grad_dtypes"].detail
    assert "(float64, float32 inputs; the op does not take bfloat16)" in detail
    detail = report["low_precision"].detail
    assert "float32 checked" in detail and "bfloat16: the op does not take it" in detail


def test_plain_custom_vjp_skips_forward_mode_with_the_reason():
    report = jaxext.opcheck(plain_vjp_linear, (f64(0, (4, 3)), f64(1, (2, 3))))
    assert report["jvp"].status == report["jvp_vjp"].status == "SKIP"
    assert "TypeError" in report["jvp"].detail and "forward mode" in report["jvp"].detail
    table = str(report)
    assert "jvp " in table and "SKIP" in table and "0 FAIL" in table


# -- the catalogue of buggy ops ----------------------------------------------------------------


def _double_plus_sum(x):
    return 2 * x + x.sum()  # sums a batch axis too, when given one


def wrong_vmap_method():
    """A pure_callback declared ``expand_dims`` whose host function is not batch-aware."""

    @jax.custom_vjp
    def op(x):
        return jax.pure_callback(
            _double_plus_sum, jax.ShapeDtypeStruct(x.shape, x.dtype), x, vmap_method="expand_dims"
        )

    op.defvjp(lambda x: (op(x), None), lambda _, g: (2 * g + g.sum(),))
    return op, (f64(0, (3, 2)),)


def nonzero_grad_for_zero_cotangent():
    @jax.custom_vjp
    def op(x, w):
        return x @ w.T

    def bwd(res, g):
        x, w = res
        return g @ w, jnp.where(jnp.all(g == 0), 1e-3, g.T @ x)

    op.defvjp(lambda x, w: (op(x, w), (x, w)), bwd)
    return op, (f64(0, (4, 3)), f64(1, (2, 3)))


def eager_and_jit_differ():
    """A NumPy fast path for concrete inputs that rounds through float32."""

    def op(x, w):
        if not isinstance(x, jax.core.Tracer) and not isinstance(w, jax.core.Tracer):
            return jnp.asarray(np.asarray(x, np.float32) @ np.asarray(w, np.float32).T, x.dtype)
        return jaxext.linear(x, w)

    return op, (f64(0, (4, 3)), f64(1, (2, 3)))


def _jitter(like):
    return np.asarray(1 + 1e-12 * np.random.default_rng().standard_normal(), like.dtype)


def nondeterministic_backward():
    @jax.custom_vjp
    def op(x, w):
        return x @ w.T

    def bwd(res, g):
        x, w = res
        factor = jax.pure_callback(
            _jitter,
            jax.ShapeDtypeStruct((), g.dtype),
            jnp.zeros((), g.dtype),
            vmap_method="sequential",
        )
        return g @ w * factor, g.T @ x

    op.defvjp(lambda x, w: (op(x, w), (x, w)), bwd)
    return op, (f64(0, (4, 3)), f64(1, (2, 3)))


def wrong_backward_value():
    @jax.custom_vjp
    def op(x, w):
        return x @ w.T

    op.defvjp(lambda x, w: (op(x, w), (x, w)), lambda res, g: (g @ res[1], 1.01 * g.T @ res[0]))
    return op, (f64(0, (4, 3)), f64(1, (2, 3)))


BUGGY_OPS = {
    # name -> (builder, the check that must reject it)
    "residual_layout": (residual_layout_cached, "jit_reuse"),
    "wrong_vmap_method": (wrong_vmap_method, "vmap"),
    "nonzero_grad_for_zero_cotangent": (nonzero_grad_for_zero_cotangent, "zero_cotangent"),
    "symbolic_zero_taken_for_ones": (symbolic_zero_as_ones, "zero_cotangent"),
    "forward_rule_differs": (fwd_differs_from_primal, "forward_rule"),
    "eager_and_jit_differ": (eager_and_jit_differ, "jit"),
    "nondeterministic_backward": (nondeterministic_backward, "reentrancy"),
    "wrong_gradient_dtype": (float32_grad_always, "grad_dtypes"),
    "float32_gradient_for_bfloat16": (float32_grad_for_bfloat16, "grad_dtypes"),
    "wrong_backward_value": (wrong_backward_value, "gradcheck"),
    "backward_not_linear_in_cotangent": (abs_cotangent, "linearity"),
    "small_gradient_off_by_2x": (l2_penalty_off_by_2x, "gradcheck"),
    "jvp_rule_cut_at_second_order": (jvp_rule_wrong_at_second_order, "rev_over_fwd"),
}


@pytest.mark.parametrize("name", sorted(BUGGY_OPS))
def test_buggy_op_rejected_by_the_right_check(name):
    build, check = BUGGY_OPS[name]
    op, args = build()
    with pytest.raises(jaxext.OpcheckError) as info:
        jaxext.opcheck(op, args)
    err = info.value
    assert err.failed[0] == check, str(err)
    assert f"FAIL {check}:" in str(err)
    # Run alone, the check still rejects it, and the others can be turned off.
    report = jaxext.opcheck(op, args, checks=[check], raise_exception=False)
    assert report.failed == (check,)


@pytest.mark.parametrize(
    "name",
    tiered(
        ["wrong_backward_value", "jvp_rule_cut_at_second_order", "eager_and_jit_differ"],
        default=[],  # whole batteries, twice each: the smoke case below runs by default
    ),
)
def test_quick_compilation_changes_no_verdict(monkeypatch, name):
    # Small problems' programs compile with XLA's CPU optimisations off (jaxext._checks.
    # _quick): every check gives the verdict it gives with them on, for a buggy op and
    # for a correct one.
    from jaxext._checks import _engines as _engine
    from jaxext._checks._engines import _quick

    assert _quick._options() is not None  # the CPU backend takes the options
    cases = [BUGGY_OPS[name][0](), (jaxext.linear, (f64(0, (4, 3)), f64(1, (2, 3)), f64(2, 2)))]
    for op, args in cases:
        statuses = []
        for limit in (_engine.QUICK_MAX_WORK, -1):
            monkeypatch.setattr(_engine, "QUICK_MAX_WORK", limit)
            report = jaxext.opcheck(op, args, raise_exception=False)
            statuses.append(report.statuses)
        assert statuses[0] == statuses[1]


def test_quick_compilation_changes_no_verdict_of_one_check(monkeypatch):
    # The smoke case of the differential above: one check, with XLA's CPU optimisations
    # off and on, for a buggy op (FAIL both ways) and a correct one (PASS both ways).
    from jaxext._checks import _engines

    cases = {
        "FAIL": BUGGY_OPS["wrong_backward_value"][0](),
        "PASS": (jaxext.linear, (f64(0, (4, 3)), f64(1, (2, 3)), f64(2, 2))),
    }
    for verdict, (op, args) in cases.items():
        for limit in (_engines.QUICK_MAX_WORK, -1):
            monkeypatch.setattr(_engines, "QUICK_MAX_WORK", limit)
            report = jaxext.opcheck(op, args, checks=["gradcheck"], raise_exception=False)
            assert report.statuses == {"gradcheck": verdict}, (verdict, limit)


def test_plain_twin_runs_inner_calls_with_their_constants():
    # The plain twin (custom rules stripped, JAX's own autodiff) opens a jit's body with
    # the constants it closes over, and the custom rule inside it is gone: the gradient
    # is the true one although the op's backward is 3x too large.
    from jaxext._checks._opcheck._plain import strip_custom_rules

    c = np.array([1.0, -2.0, 0.5])

    @jax.custom_vjp
    def scale(x):
        return x * c

    scale.defvjp(lambda x: (x * c, None), lambda _, g: (3.0 * g * c,))
    op = jax.jit(lambda x: jnp.sin(scale(x)))
    x = np.array([0.3, 0.1, -0.7])
    plain = strip_custom_rules(op)
    np.testing.assert_allclose(plain(x), np.sin(x * c), rtol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(plain(x)))(x)
    np.testing.assert_allclose(grad, np.cos(x * c) * c, rtol=1e-6)
    assert not np.allclose(jax.grad(lambda x: jnp.sum(op(x)))(x), grad)  # the rule is wrong


def test_jit_reuse_runs_the_pattern_with_constants():
    """`op(a, c) + op(c, b) + op(a, b) ** 2`, c a constant, with the op jitted once: the
    verdict of jit_reuse must be what JAX gives for it, against plain autodiff (on JAX
    0.10 a wrong gradient or an error; the stop_gradient form alone passed)."""
    op, (a, b) = residuals_by_perturbed_reused()
    c = f64(2, (3, 2))

    def pattern(fn):
        return lambda a, b: jnp.sum(fn(a, c)) + jnp.sum(fn(c, b)) + jnp.sum(fn(a, b) ** 2)

    with jax.enable_x64(True):
        jitted = jax.jit(op)
        jitted(a, b)  # an evaluation pass first, as in training
        expected = jax.grad(pattern(lambda x, w: x * w), (0, 1))(a, b)
        try:
            got = jax.grad(pattern(jitted), (0, 1))(a, b)
            right = all(np.allclose(g, e, rtol=1e-12) for g, e in zip(got, expected, strict=True))
        except Exception:  # noqa: BLE001 -- JAX failing on the pattern is a wrong result too
            right = False
    report = jaxext.opcheck(op, (a, b), checks=["jit_reuse"], raise_exception=False)
    assert report["jit_reuse"].status == ("PASS" if right else "FAIL"), str(report)
    if not right:
        assert "several times in one computation" in report["jit_reuse"].detail


def test_buggy_op_diagnostics_name_what_failed():
    op, args = residual_layout_cached()
    report = jaxext.opcheck(op, args, checks=["jit_reuse"], raise_exception=False)
    assert "differentiating only" in report["jit_reuse"].detail
    op, args = wrong_vmap_method()
    report = jaxext.opcheck(op, args, checks=["vmap"], raise_exception=False)
    assert "vmap over input 0 vs a loop" in report["vmap"].detail
    op, args = wrong_backward_value()
    report = jaxext.opcheck(op, args, checks=["gradcheck"], raise_exception=False)
    assert "with respect to input 1" in report["gradcheck"].detail


def test_an_op_that_raises_fails_its_checks_without_crashing():
    def broken(x):
        raise RuntimeError("kernel not available")

    report = jaxext.opcheck(broken, (f64(0, (3,)),), raise_exception=False)
    assert set(report.failed) == set(CHECK_NAMES) - set(report.skipped)
    assert "kernel not available" in report["jit"].detail


def test_unexportable_op_is_reported():
    op, args = nondeterministic_backward()  # a host callback: jax.export refuses it
    report = jaxext.opcheck(op, args, checks=["export"], raise_exception=False)
    assert report.failed == ("export",)
    assert "cannot be exported" in report["export"].detail


# -- linearity: where forward mode trusts the backward, tested numerically -------------------


def _sin_with_host_backward(host):
    """sin(x) through jaxext.custom_vjp whose backward sends g through ``host`` on the host
    (``jax.pure_callback``: forward mode's linearity walk cannot see into it)."""

    @jaxext.custom_vjp
    def op(x):
        return jnp.sin(x)

    def bwd(x, g):
        spec = jax.ShapeDtypeStruct(g.shape, g.dtype)
        sent = jax.pure_callback(host, spec, g, vmap_method="sequential")
        return (jnp.cos(x) * sent,)

    op.defvjp(lambda x: (jnp.sin(x), x), bwd)
    return op, (f64(0, (3, 2)),)


HOST_BACKWARDS = {
    "identity": lambda g: np.asarray(g),
    # one-hot cotangents (gradcheck's, and forward mode's rows) are never clipped
    "clipped_at_2": lambda g: np.clip(np.asarray(g), -2.0, 2.0),
    "plus_a_constant": lambda g: np.asarray(g) + np.asarray(0.25, g.dtype),
}


def test_a_linear_backward_through_a_callback_passes_linearity():
    op, args = _sin_with_host_backward(HOST_BACKWARDS["identity"])
    report = jaxext.opcheck(op, args, checks=["linearity", "gradcheck", "jvp"])
    detail = report["linearity"].detail
    assert report.failed == () and report["linearity"].status == "PASS", str(report)
    assert "bwd(3 g1 - 0.5 g2) = 3 bwd(g1) - 0.5 bwd(g2)" in detail
    assert "the backward calls pure_callback, which forward mode's linearity walk" in detail


@pytest.mark.parametrize("host", ["clipped_at_2", "plus_a_constant"])
def test_a_callback_backward_nonlinear_in_g_fails_linearity(host):
    op, args = _sin_with_host_backward(HOST_BACKWARDS[host])
    report = jaxext.opcheck(
        op, args, checks=["linearity", "gradcheck", "jvp"], raise_exception=False
    )
    assert "linearity" in report.failed, str(report)
    detail = report["linearity"].detail
    assert "not linear in its cotangent" in detail and "pure_callback" in detail
    # The diagnostic names the gradient, the combination and the trusted call.
    assert re.search(r"gradient of input 0: bwd\(3 g1 - 0\.5 g2\) differs", detail), detail
    if host == "clipped_at_2":
        # Right on every one-hot cotangent: the finite-difference rows cannot see it.
        assert report.failed == ("linearity",), str(report)


def test_linearity_detail_names_no_trusted_call_where_there_is_none():
    report = jaxext.opcheck(
        plain_vjp_linear, (f64(0, (4, 3)), f64(1, (2, 3))), checks=["linearity"]
    )
    assert report["linearity"].status == "PASS"
    assert "linearity walk" not in report["linearity"].detail


# -- options -----------------------------------------------------------------------------------


def test_checks_and_skip_select():
    args = (f64(0, (4, 3)), f64(1, (2, 3)))
    report = jaxext.opcheck(jaxext.linear, args, checks=["vmap", "jit", "gradcheck"])
    assert list(report.statuses) == ["gradcheck", "jit", "vmap"]  # in run order
    report = jaxext.opcheck(jaxext.linear, args, checks=["jit", "vmap"], skip=["vmap"])
    assert list(report.statuses) == ["jit"]


def test_tolerances_reach_the_gradient_check():
    op, args = wrong_backward_value()  # 1% off
    report = jaxext.opcheck(op, args, checks=["gradcheck"], rtol=0.05, atol=0.05)
    assert report.failed == ()


def test_nondet_tol_allows_a_nondeterministic_backward():
    op, args = nondeterministic_backward()
    report = jaxext.opcheck(op, args, checks=["reentrancy"], nondet_tol=1e-9)
    assert report.failed == ()


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"checks": ["vmapp"]}, ValueError, "`checks`"),
        ({"checks": "vmap"}, TypeError, "`checks`"),
        ({"skip": ["nope"]}, ValueError, "`skip`"),
        ({"checks": ["jit"], "skip": ["jit"]}, ValueError, "no check left"),
        ({"rtol": -1.0}, ValueError, "`rtol`"),
        ({"raise_exception": 1}, TypeError, "`raise_exception`"),
    ],
)
def test_invalid_options(kwargs, error, name):
    with pytest.raises(error, match=name):
        jaxext.opcheck(jaxext.mul_constant, (f64(0, (3,)), 2.0), **kwargs)


@pytest.mark.parametrize(
    ("op", "args", "name"),
    [
        (lambda x: x * 2, (f64(0, (3,)) + 1j,), "input 0"),
        (lambda x, w: {"y": x * w, "z": jnp.exp(1j * x)}, (f64(0, (3,)), f64(1, (3,))), "['z']"),
    ],
    ids=["complex_input", "complex_output"],
)
def test_complex_inputs_and_outputs_are_checked(op, args, name):
    """Complex leaves are checked like real ones (tests/test_complex_gradients.py has the
    grid): plain JAX ops pass every check that applies."""
    del name
    report = jaxext.opcheck(op, args)
    assert not report.failed and report.statuses["gradcheck"] == "PASS"


def test_invalid_func_and_args():
    with pytest.raises(TypeError, match="`func`"):
        jaxext.opcheck("linear", (f64(0, (3,)),))
    with pytest.raises(ValueError, match="`args` holds no floating-point"):
        jaxext.opcheck(lambda i: i * 2.0, (np.arange(3),))


def test_report_table_and_error_message():
    op, args = wrong_backward_value()
    with pytest.raises(jaxext.OpcheckError) as info:
        jaxext.opcheck(op, args, checks=["forward_rule", "gradcheck"])
    err = info.value
    assert isinstance(err, AssertionError)
    assert not err.report
    lines = str(err).splitlines()
    assert lines[0] == "opcheck op"
    assert any(line.startswith("forward_rule") and "PASS" in line for line in lines)
    assert any(line.startswith("gradcheck") and "FAIL" in line for line in lines)
    assert "1 PASS, 1 FAIL, 0 SKIP" in lines


def test_export_checks_skip_without_the_serializer_package(monkeypatch):
    # A missing optional package is not the op's fault: SKIP with the way out, never FAIL.
    monkeypatch.setitem(sys.modules, "flatbuffers", None)  # `import flatbuffers` now fails
    report = jaxext.opcheck(
        jaxext.linear, (f64(0, (4, 3)), f64(1, (2, 3))), checks=["export", "export_symbolic"]
    )
    for result in report.results:
        assert result.status == "SKIP" and "jaxext[export]" in result.detail, str(report)


@pytest.mark.parametrize(
    ("op", "shapes", "symbolic"),
    [
        (jaxext.linear, [(4, 3), (2, 3), (2,)], "input 0"),  # w's 2 is not x's batch
        (lambda x, y: x * jnp.sin(y), [(3, 4), (3, 4)], "input 0 and input 1"),
        (lambda x, y, z: x * y + z, [(5, 2), (5, 2), (2,)], "input 0 and input 1"),
    ],
    ids=["linear", "elementwise_pair", "elementwise_broadcast"],
)
def test_export_symbolic_shares_the_batch_dimension_where_the_op_ties_inputs(op, shapes, symbolic):
    # An elementwise op cannot take a symbolic batch on one input against a fixed one on
    # the other: every input with input 0's leading dimension gets the same symbol.
    args = tuple(f64(i, shape) for i, shape in enumerate(shapes))
    report = jaxext.opcheck(op, args, checks=["export_symbolic"])
    detail = report["export_symbolic"].detail
    assert report["export_symbolic"].status == "PASS", str(report)
    assert detail == f"exported with a symbolic leading dimension of {symbolic}: same values"


def _linear_cross_entropy(x, w, labels):
    """A fused linear + cross-entropy loss: token labels share x's batch dimension."""
    logits = x @ w.T
    picked = jnp.take_along_axis(logits, labels[:, None], -1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)


def test_export_symbolic_gives_the_batch_dimension_to_integer_inputs_that_share_it():
    # Token labels of the batch's length: with the symbolic dimension on x alone the
    # labels' fixed length does not broadcast against it; jax.export takes both symbolic.
    args = (f64(0, (4, 3)), f64(1, (5, 3)), np.array([0, 2, 4, 1]))
    report = jaxext.opcheck(_linear_cross_entropy, args, checks=["export_symbolic"])
    assert report["export_symbolic"].status == "PASS", str(report)
    assert "input 0 and 1 integer input(s) of the same leading dimension" in (
        report["export_symbolic"].detail
    )


# -- no state left behind -------------------------------------------------------------------


@pytest.mark.parametrize(
    "checker",
    [
        lambda f, args: jaxext.opcheck(f, args),
        lambda f, args: jaxext.gradcheck(f, args, eps=1e-6, atol=1e-4),
        lambda f, args: jaxext.gradgradcheck(f, args, eps=1e-6, atol=1e-4),
    ],
    ids=["opcheck", "gradcheck", "gradgradcheck"],
)
def test_checks_leave_the_callers_arrays_as_they_were(checker):
    """After every check (run with x64), the caller's NumPy arrays, x64 off, train as before."""
    assert not jax.config.jax_enable_x64
    x, w = f64(0, (4, 3)), f64(1, (2, 3))
    ids = np.array([1, 0, 1, 1])

    @jaxext.custom_vjp
    def square(x):
        return x * x

    square.defvjp(lambda x: (x * x, x), lambda x, g: (2 * x * g,))

    def op(x, w, ids):  # a user's op applied to the caller's arrays directly
        return jaxext.linear(square(x), w)[jnp.arange(4), ids]

    checker(op, (x, w, ids))
    assert not jax.config.jax_enable_x64
    for a, dtype in ((x, jnp.float32), (w, jnp.float32), (ids, jnp.int32)):
        assert jnp.asarray(a).dtype == dtype
    grad = jax.grad(lambda x, w: jnp.sum(op(x, w, ids) ** 2), argnums=(0, 1))(x, w)
    assert [g.dtype for g in grad] == [jnp.float32, jnp.float32]
    # float64 reference: y = (x*x) @ w.T, loss = sum_i y[i, ids_i]^2
    y = (x * x) @ w.T
    want_x, want_w = np.zeros_like(x), np.zeros_like(w)
    for i, j in enumerate(ids):
        want_w[j] += 2 * y[i, j] * x[i] ** 2
        want_x[i] += 2 * y[i, j] * w[j] * 2 * x[i]
    np.testing.assert_allclose(grad[0], want_x, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad[1], want_w, rtol=1e-5, atol=1e-6)


def test_a_function_op_is_titled_with_its_class_name():
    report = jaxext.opcheck(Cube.apply, (f64(0, (3,)),), checks=["jit"], raise_exception=False)
    assert str(report).splitlines()[0] == "opcheck Cube"
    assert report.op == "Cube"


def test_jit_reuse_with_one_differentiable_input_is_a_skip_that_says_why():
    """One differentiable input has one subset, every input: nothing is reused with other
    inputs differentiated, and a PASS would claim a comparison that never ran."""
    for op in (Cube.apply, jaxext.custom_vjp(jnp.sin)):
        report = jaxext.opcheck(op, (f64(0, (3,)),), checks=["jit_reuse"], raise_exception=False)
        result = report["jit_reuse"]
        assert result.status == "SKIP", str(report)
        assert "only one differentiable input (input 0)" in result.detail
        assert "0 pairs" not in result.detail
    report = jaxext.opcheck(jaxext.linear, (f64(0, (4, 3)), f64(1, (2, 3))), checks=["jit_reuse"])
    assert report["jit_reuse"].status == "PASS"


@pytest.mark.parametrize("width", [40, 60, 100])
def test_table_wraps_a_long_detail_and_keeps_its_remedy(width):
    # A SKIP's reason ends with its remedy: the table wraps it, never cuts it off.
    reason = (
        "jax.export serialization needs the flatbuffers package "
        "(pip install 'jaxext[export]') to run this check"
    )
    report = jaxext.OpcheckReport(
        "op",
        (
            jaxext.CheckResult("export", "SKIP", reason, 0.0),
            jaxext.CheckResult("jit", "PASS", "", 0.0),
        ),
    )
    lines = report.table(width=width).splitlines()
    assert all(len(line) <= width for line in lines), lines
    assert lines[2].startswith("export  SKIP    jax.export")
    detail = " ".join(line[len("export  SKIP    ") :].strip() for line in lines[2:-2])
    assert detail == reason
    assert lines[-2].startswith("jit     PASS") and lines[-1] == "1 PASS, 0 FAIL, 1 SKIP"


# -- platforms: the op lowers for CPU, CUDA, ROCm and TPU -----------------------------------

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
PLATFORM_ROWS = [f"platform_{p}" for p in PLATFORMS]


@pytest.mark.parametrize(
    ("op", "args"),
    [
        (jaxext.linear, (f64(0, (4, 3)), f64(1, (2, 3)), f64(2, (2,)))),
        (jaxext.mul_constant, (f64(0, (3,)), 2.5)),
    ],
    ids=["linear", "mul_constant"],
)
def test_shipped_ops_lower_for_every_platform(op, args):
    report = jaxext.opcheck(op, args, checks=PLATFORM_ROWS, platforms=PLATFORMS)
    assert report.statuses == dict.fromkeys(PLATFORM_ROWS, "PASS"), str(report)
    for platform, name in zip(PLATFORMS, ("CPU", "CUDA", "ROCm", "TPU"), strict=True):
        assert report[f"platform_{platform}"].detail == (
            f"jitted forward, VJP and JVP lower for {name}; at float64, float32 and bfloat16 inputs"
        )


@pytest.mark.parametrize("implementation", [None, "pallas"])
def test_rms_norm_rows_say_which_kernels_they_lowered(implementation):
    """By default the kernels lower on TPU only (XLA on CPU and GPU); asked for, on GPU too."""
    args = (f64(0, (4, 3)), f64(1, (3,)))
    report = jaxext.opcheck(
        lambda x, w: jaxext.rms_norm(x, w, implementation=implementation),
        args,
        checks=PLATFORM_ROWS,
        raise_exception=False,
    )
    dtypes = "at float64, float32 and bfloat16 inputs"
    kernels = "Pallas kernels lowered to {} custom calls (forward 1, VJP 2, JVP 1)"
    expected = {"tpu": f"jitted forward, VJP and JVP lower for TPU; {kernels.format('Mosaic')}"}
    for platform, name in (("cuda", "CUDA"), ("rocm", "ROCm")):
        lowered = f"jitted forward, VJP and JVP lower for {name}"
        expected[platform] = f"{lowered}; {kernels.format('Triton')}" if implementation else lowered
    if implementation is None:
        expected["cpu"] = "jitted forward, VJP and JVP lower for CPU"
    else:  # compiled kernels have no CPU lowering (Pallas asks for interpret mode)
        assert report.statuses["platform_cpu"] == "FAIL", str(report)
        assert "do not lower for CPU" in report["platform_cpu"].detail
        assert "interpret" in report["platform_cpu"].detail
    for platform, detail in expected.items():
        assert report.statuses[f"platform_{platform}"] == "PASS", str(report)
        assert report[f"platform_{platform}"].detail == f"{detail}; {dtypes}"


def _pallas_op(block, per_platform):
    """``2 * x`` as a Pallas kernel over blocks of ``block`` (the backward in plain JAX),
    its interpret mode picked per platform when lowered (as ``jaxext.rms_norm``) or by
    the machine's backend (``interpret=jax.default_backend() == "cpu"``)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas import triton as pltriton

    def kernel(x_ref, y_ref):
        y_ref[...] = 2 * x_ref[...]

    def double(x):
        def call(**options):
            spec = pl.BlockSpec(block, lambda i: (i, 0))
            return pl.pallas_call(
                kernel,
                grid=(x.shape[0] // block[0],),
                in_specs=[spec],
                out_specs=spec,
                out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                **options,
            )(x)

        if not per_platform:
            return call(interpret=jax.default_backend() == "cpu")
        return jax.lax.platform_dependent(
            cpu=lambda: call(interpret=True),
            cuda=lambda: call(compiler_params=pltriton.CompilerParams()),
            rocm=lambda: call(compiler_params=pltriton.CompilerParams()),
            tpu=lambda: call(compiler_params=pltpu.CompilerParams()),
        )

    @jaxext.custom_vjp
    def op(x):
        return double(x)

    op.defvjp(lambda x: (double(x), None), lambda _, g: (2 * g,))
    return op


@pytest.mark.parametrize(
    "block, per_platform, expected",
    [
        # The backend picks interpret mode: on this CPU machine every row lowers the
        # interpreter's loop, a kernel for none; Triton could not even compile (8, 6).
        ((8, 8), False, {"cuda": "FAIL", "rocm": "FAIL", "tpu": "FAIL"}),
        ((8, 6), False, {"cuda": "FAIL", "rocm": "FAIL", "tpu": "FAIL"}),
        # Per platform: the kernels are lowered, and Triton refuses a (8, 6) block.
        ((8, 8), True, {"cuda": "PASS", "rocm": "PASS", "tpu": "PASS"}),
        ((8, 6), True, {"cuda": "FAIL", "rocm": "FAIL", "tpu": "PASS"}),
    ],
    ids=["backend-8x8", "backend-8x6", "per_platform-8x8", "per_platform-8x6"],
)
def test_a_pallas_row_that_lowered_no_kernel_fails(block, per_platform, expected):
    if jax.default_backend() != "cpu":
        pytest.skip("the interpret mode the backend picks is this CPU machine's")
    op = _pallas_op(block, per_platform)
    report = jaxext.opcheck(
        op, (f64(0, (16, block[1])),), checks=PLATFORM_ROWS, raise_exception=False
    )
    assert report.statuses == {"platform_cpu": "PASS"} | {
        f"platform_{p}": status for p, status in expected.items()
    }, str(report)
    for platform, status in expected.items():
        detail = report[f"platform_{platform}"].detail
        if status == "PASS":
            assert "Pallas kernels lowered to" in detail and "custom calls (forward 1" in detail
        elif not per_platform:
            assert re.search("holds? a Pallas kernel but lowered none for", detail), detail
        else:
            assert "not lower for" in detail and "power of 2" in detail, detail


def test_an_op_that_does_not_lower_for_a_platform_fails_that_row():
    """jnp.linalg.eigvals has no TPU lowering (XLA's eig is CPU and GPU only)."""
    a = np.eye(3) + f64(0, (3, 3)) / 10
    report = jaxext.opcheck(
        lambda a: jnp.real(jnp.linalg.eigvals(a)), (a,), checks=PLATFORM_ROWS, raise_exception=False
    )
    assert report.failed == ("platform_tpu",), str(report)
    detail = report["platform_tpu"].detail
    assert "forward, VJP and JVP do not lower for TPU" in detail and "'eig'" in detail


def test_platform_rows_of_an_op_without_forward_mode_skip_its_jvp_with_the_reason():
    report = jaxext.opcheck(
        plain_vjp_linear, (f64(0, (4, 3)), f64(1, (2, 3))), checks=["jvp", "platform_cuda"]
    )
    assert report.statuses == {"jvp": "SKIP", "platform_cuda": "PASS"}
    detail = report["platform_cuda"].detail
    assert detail.startswith("jitted forward and VJP lower for CUDA; JVP: SKIP, no forward mode")
    assert "TypeError" in detail  # the reason, as the jvp row gives it


def test_an_op_that_lowers_only_here_is_a_skip_elsewhere():
    """A host callback lowers only for the backend of the machine that runs it."""

    @jaxext.custom_vjp
    def host_double(x):
        return jax.pure_callback(
            lambda a: 2 * np.asarray(a), jax.ShapeDtypeStruct(x.shape, x.dtype), x
        )

    host_double.defvjp(lambda x: (host_double(x), None), lambda _, g: (2 * g,))

    if jax.default_backend() != "cpu":
        pytest.skip("the platforms named below assume a CPU machine")
    report = jaxext.opcheck(host_double, (f64(0, (3,)),), checks=["platform_cpu", "platform_tpu"])
    assert report.statuses == {"platform_cpu": "PASS", "platform_tpu": "SKIP"}, str(report)
    detail = report["platform_tpu"].detail
    assert "only for this machine's backend (cpu)" in detail and "cannot be told here" in detail


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"platforms": ["gpu"]}, ValueError, r"`platforms`: unknown platforms \['gpu'\]"),
        ({"platforms": [1]}, TypeError, "`platforms` must be a sequence"),
        ({"platforms": "tpu"}, TypeError, "`platforms` must be a sequence"),
        ({"platforms": ["tpu"], "skip": ["platform_tpu"]}, ValueError, "platform_tpu"),
    ],
)
def test_invalid_platforms(kwargs, error, match):
    with pytest.raises(error, match=match):
        jaxext.opcheck(jaxext.mul_constant, (f64(0, (3,)), 2.0), **kwargs)


def _off_when_traced(kind):
    """``x ** 2``, off by 1e-6 relative when traced by ``kind`` (a float64 op whose jit or
    vmap program is subtly wrong): the program rows keep float64's tight tolerance."""

    def op(x):
        bump = 1e-6 if any(k.__name__ == kind for k in type(x).__mro__) else 0.0
        return x * x * (1 + bump)

    return op


@pytest.mark.parametrize(
    ("check", "kind"),
    [("jit", "Tracer"), ("vmap", "BatchTracer")],
)
def test_float64_op_off_by_1e_6_under_a_transformation_fails(check, kind):
    x = np.linspace(0.5, 1.5, 6)
    report = jaxext.opcheck(_off_when_traced(kind), (x,), checks=[check], raise_exception=False)
    assert report.failed == (check,), str(report)


def test_rms_norm_kernels_against_their_xla_implementation():
    """``jaxext.rms_norm``'s Pallas kernels (interpret mode) judged against its own XLA
    implementation as the reference: the gradient rows compare with its float64 autodiff."""
    rows = ["gradcheck", "jvp", "gradgradcheck", "fwd_over_rev"]

    def kernels(x, w):
        return jaxext.rms_norm(x, w, implementation="interpret")

    def xla(x, w):
        return jaxext.rms_norm(x, w, implementation="xla")

    args = (f64(0, (4, 3)), f64(1, (3,)))
    report = jaxext.opcheck(kernels, args, checks=rows, reference=xla)
    assert report.statuses == dict.fromkeys(rows, "PASS"), str(report)
    assert all("reference's autodiff" in r.detail for r in report.results), str(report)


def test_platform_rows_lower_at_every_dtype_the_op_takes():
    """An op whose TPU lowering breaks at bfloat16 only (here: an eig, which has no TPU
    lowering, on that path): the TPU row FAILs naming bfloat16, though float64 lowers."""

    def op(x):
        def on_tpu(x):
            if x.dtype == jnp.bfloat16:
                eig = jnp.real(jnp.linalg.eigvals(x.astype(jnp.float32)))[0]
                return 2 * x + (0 * eig).astype(x.dtype)
            return 2 * x

        return jax.lax.platform_dependent(x, cpu=lambda x: 2 * x, tpu=on_tpu, default=on_tpu)

    report = jaxext.opcheck(
        op, (np.eye(3) + f64(0, (3, 3)) / 10,), checks=PLATFORM_ROWS, raise_exception=False
    )
    assert report.failed == ("platform_tpu",), str(report)
    detail = report["platform_tpu"].detail
    assert "do not lower for TPU (at bfloat16)" in detail and "'eig'" in detail, detail


def test_platform_rows_of_an_op_for_accelerators_only_lower_at_every_dtype():
    """An op that lowers for no CPU (a Pallas kernel compiled without interpret mode; here
    branches for CUDA and TPU only): its float32 and bfloat16 are lowered too, for the
    platforms it is written for, not float64 alone."""

    def op(x):
        return jax.lax.platform_dependent(x, cuda=lambda x: 2 * x, tpu=lambda x: 3 * x)

    report = jaxext.opcheck(
        op, (f64(0, (3,)),), checks=["platform_cuda", "platform_tpu"], raise_exception=False
    )
    for row in ("platform_cuda", "platform_tpu"):
        assert report[row].status == "PASS", str(report)
        assert "at float64, float32 and bfloat16 inputs" in report[row].detail, str(report)


def test_checkpoint_of_an_op_with_host_callbacks_is_jax_limit():
    """jax.checkpoint cannot differentiate an io_callback's effects (Pallas's TPU
    interpreter runs kernels through one): a SKIP naming JAX's limit, not the op's FAIL."""
    from jax.experimental import io_callback

    def host_sin(x):
        return io_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x, ordered=True)

    @jaxext.custom_vjp
    def op(x):
        return host_sin(x)

    op.defvjp(lambda x: (host_sin(x), x), lambda x, g: (g * jnp.cos(x),))
    report = jaxext.opcheck(op, (np.linspace(0.1, 1, 3),), checks=["checkpoint"])
    assert report["checkpoint"].status == "SKIP", str(report)
    assert "jax.checkpoint does not differentiate" in report["checkpoint"].detail
    assert "OrderedIOEffect" in report["checkpoint"].detail


def test_vmap_of_a_forward_jax_cannot_batch_is_jax_limit():
    """The forward JAX cannot batch (a pure_callback without a vmap_method), the gradient of
    the op's plain twin not taken either (a pure_callback has no JVP): judged on the part
    that raised, the output, whose plain twin raises the same: JAX's limit, not a FAIL."""

    def host_sin(x):
        return jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    @jaxext.custom_vjp
    def op(x):
        return host_sin(x)

    op.defvjp(lambda x: (host_sin(x), x), lambda x, g: (g * jnp.cos(x),))
    report = jaxext.opcheck(op, (np.linspace(0.1, 1, 3),), checks=["vmap"])
    detail = report["vmap"].detail
    assert report["vmap"].status == "SKIP", str(report)
    assert "jax.vmap of the output over input 0: JAX's own limit" in detail, detail
    assert "vmap_method" in detail, detail


def _raised_in(filename: str, source: str, name: str, **names) -> Exception:
    """What function ``name`` of ``source`` raises, compiled as ``filename``'s code (its frame
    as one of JAX's own module's), with ``names`` as its globals."""
    namespace = dict(names)
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 -- the source below
    try:
        namespace[name]()
    except Exception as err:  # noqa: BLE001 -- the exception is the point
        return err
    raise AssertionError(f"{name} did not raise")


_INTERPRETER_FILE = "/site-packages/jax/_src/pallas/mosaic/interpret/interpret_pallas_call.py"
_BATCHED_GRID = """
def _get_randomized_grid_coordinates():
    raise ValueError("safe_zip() argument 1 has length 3 but argument 0 has length 4")
"""
_X64_VALUE = """
def _interpret_jaxpr():
    eqn = EQN
    raise TypeError("lax.sub requires arguments to have the same dtypes, got int64, int32")
"""


@pytest.mark.parametrize(
    ("filename", "declared", "limit"),
    [
        (_INTERPRETER_FILE, "int32", True),  # the interpreter's own value: JAX's limit
        (_INTERPRETER_FILE, "int64", False),  # the kernel's jaxpr mixes them: the op's
        ("/work/my_kernels.py", "int32", False),  # not the interpreter's code
    ],
)
def test_tpu_interpreter_defects_are_recognised_where_they_are_raised(filename, declared, limit):
    """Pallas's TPU interpreter's own defects (a vmapped grid zipped with its semantics; an
    int64 value for a kernel's int32 under x64) are JAX's limit, and only those."""
    from types import SimpleNamespace

    from jaxext._checks._opcheck._interpreter import interpreter_limit

    wrapped = RuntimeError("the check failed")  # as a check re-raises what it met
    wrapped.__cause__ = _raised_in(filename, _BATCHED_GRID, "_get_randomized_grid_coordinates")
    in_vmap = interpreter_limit(wrapped)
    assert (in_vmap is not None) == (filename == _INTERPRETER_FILE), in_vmap
    assert in_vmap is None or "cannot run the op's kernel under jax.vmap" in in_vmap

    var = SimpleNamespace(aval=SimpleNamespace(dtype=np.dtype(declared)))
    eqn = SimpleNamespace(invars=[var, var])
    under_x64 = interpreter_limit(_raised_in(filename, _X64_VALUE, "_interpret_jaxpr", EQN=eqn))
    assert (under_x64 is not None) == limit, under_x64
    assert under_x64 is None or "int64 value where the kernel's jaxpr declares int32" in under_x64


def test_a_pallas_verification_error_is_pallas_bug():
    """Pallas's own word that lowering failed its verification ("Please file a bug") is JAX's
    bug wherever it is raised; an op's own error is not."""
    from jaxext._checks._opcheck._interpreter import interpreter_limit

    wrapped = RuntimeError("the JVP did not lower")
    wrapped.__cause__ = ValueError(
        "Pallas encountered an internal verification error. Please file a bug at "
        "https://github.com/jax-ml/jax/issues/new/choose. Error details: 'arith.muli' op"
    )
    limit = interpreter_limit(wrapped)
    assert limit is not None and "JAX's bug, as Pallas says" in limit, limit
    assert interpreter_limit(ValueError("the op's own shape error")) is None
