"""Tests for `jaxext.gradcheck` / `jaxext.gradgradcheck`.

Correct ops (jaxext's and plain-jnp functions) must be accepted. A catalogue of
deliberately broken ``custom_vjp`` variants of ``linear`` / ``mul_constant``
must be rejected, each with the right input (and output) named: the broken
ops are written here, so every expected failure is known independently of the
checker.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checker_ops import (
    BROKEN_BACKWARDS,
    CORRECT,
    elementwise_op,
    grad_w,
    grad_x,
    make_linear,
    square_with_wrong_jvp,
)
from helpers import grid, rand, reference_linear
from jax.test_util import check_grads

import jaxext
from jaxext._checks import _precision


def f64(seed, shape):
    return rand(seed, shape, np.float64)


# -- broken variants of linear (y = x @ w.T), as custom_vjp -------------------------------


def one_element_wrong(scale):
    return make_linear(lambda x, w, g: (grad_x(x, w, g), grad_w(x, w, g).at[0, 0].multiply(scale)))


# -- mul_constant variants -----------------------------------------------------------------


def make_mul(bwd_rule):
    """A custom_vjp ``x * c`` (c broadcasts against x) whose backward is ``bwd_rule``."""

    @jax.custom_vjp
    def op(x, c):
        return x * c

    def op_fwd(x, c):
        return op(x, c), (x, c)

    def op_bwd(residuals, g):
        x, c = residuals
        return bwd_rule(x, c, g)

    op.defvjp(op_fwd, op_bwd)
    return op


# Right at first order, but the gradient of c cuts the derivative through x.
MUL_CUT_RESIDUAL = make_mul(lambda x, c, g: (g * c, jnp.sum(g * jax.lax.stop_gradient(x))))
# Forgets x in the gradient of c.
MUL_WRONG_CONSTANT_GRAD = make_mul(lambda x, c, g: (g * c, jnp.sum(g)))
LINEAR_CUT_RESIDUAL = make_linear(
    lambda x, w, g: (grad_x(x, w, g), grad_w(jax.lax.stop_gradient(x), w, g))
)


# -- correct ops are accepted --------------------------------------------------------------


def test_seed_call_verbatim():
    x, w = f64(0, (20, 20)), f64(1, (30, 20))
    assert jaxext.gradcheck(jaxext.linear, (x, w), eps=1e-6, atol=1e-4) is True


def test_seed_call_with_default_float32_arrays_warns_and_passes():
    x, w = jnp.asarray(rand(0, (20, 20))), jnp.asarray(rand(1, (30, 20)))
    with pytest.warns(UserWarning, match=r"input 0 \(float32\), input 1 \(float32\)"):
        assert jaxext.gradcheck(jaxext.linear, (x, w), eps=1e-6, atol=1e-4)


@pytest.mark.parametrize("x_shape", [(4,), (3, 4), (2, 3, 4)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_accepted(x_shape, with_bias):
    inputs = (f64(0, x_shape), f64(1, (5, 4))) + ((f64(2, (5,)),) if with_bias else ())
    assert jaxext.gradcheck(jaxext.linear, inputs)
    assert jaxext.gradgradcheck(jaxext.linear, inputs)


@pytest.mark.parametrize(
    "constant",
    [2.5, np.float64(-1.5), np.array(3.0), np.array([[0.5], [2.0], [-1.0]])],
    ids=["python", "numpy_scalar", "array_0d", "array_broadcast"],
)
def test_mul_constant_accepted(constant):
    x = f64(0, (3, 4))
    assert jaxext.gradcheck(jaxext.mul_constant, (x, constant))
    assert jaxext.gradgradcheck(jaxext.mul_constant, (x, constant))


def test_static_constant_is_not_differentiated():
    # A Python scalar is passed through unchanged, so the wrong gradient of c is
    # not checked; the same value as an array is differentiated and caught.
    broken = make_mul(lambda x, c, g: (g * c, jnp.zeros_like(c)))
    assert jaxext.gradcheck(lambda x, c: broken(x, c), (f64(0, (3,)), 2.0))
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(broken, (f64(0, (3,)), np.array(2.0)))
    assert info.value.input_index == 1


def test_plain_jnp_function_both_modes():
    inputs = (f64(0, (3, 4)), f64(1, (2, 4)), f64(2, (2,)))
    assert jaxext.gradcheck(reference_linear, inputs, modes=("fwd", "rev"))


def test_pytree_in_pytree_out():
    def model(params, x, labels):
        y = jaxext.linear(x, params["w"], params["b"])
        return {"logits": y, "loss": jnp.sum(y**2) / 2, "argmax": jnp.argmax(y, axis=-1) + labels}

    params = {"w": f64(0, (3, 4)), "b": f64(1, (3,))}
    labels = np.arange(5)  # integer input: passed through, not differentiated
    assert jaxext.gradcheck(model, (params, f64(2, (5, 4)), labels))
    assert jaxext.gradgradcheck(model, (params, f64(2, (5, 4)), labels))


def test_closure_over_constants():
    w, b = jnp.asarray(f64(0, (3, 4))), 0.5

    def f(x):
        return jnp.tanh(jaxext.linear(x, w)) + b

    assert jaxext.gradcheck(f, f64(1, (2, 4)))  # a single array as `inputs`
    assert jaxext.gradgradcheck(f, [f64(1, (2, 4))])  # a list works too


def test_correct_custom_vjp_reference_accepted():
    # The harness used for the broken ops is itself fine when the backward is right.
    x, w = f64(0, (4, 4)), f64(1, (4, 4))
    assert jaxext.gradcheck(CORRECT, (x, w))
    assert jaxext.gradgradcheck(CORRECT, (x, w))


# -- the catalogue of broken backward rules --------------------------------------------------


@pytest.mark.parametrize("name", sorted(BROKEN_BACKWARDS))
def test_broken_backward_rejected(name):
    rule, wrong_input = BROKEN_BACKWARDS[name]
    x, w = f64(0, (4, 4)), f64(1, (4, 4))  # square, so transposed/swapped still fit
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(make_linear(rule), (x, w))
    err = info.value
    assert isinstance(err, AssertionError)
    assert (err.kind, err.order, err.mode, err.method) == ("jacobian", 1, "rev", "full")
    assert err.output_index == 0
    assert err.input_index == wrong_input
    assert f"Jacobian mismatch for output 0 with respect to input {wrong_input}" in str(err)
    assert err.abs_error > 1e-5 + 1e-3 * abs(err.numerical)


def test_swapped_gradients_name_both_inputs():
    rule, _ = BROKEN_BACKWARDS["swapped"]
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(make_linear(rule), (f64(0, (4, 4)), f64(1, (4, 4))))
    assert info.value.mismatched_pairs == ((0, 0), (0, 1))
    assert "also mismatched: output 0 w.r.t. input 1" in str(info.value)


def test_single_wrong_element_is_located():
    x, w = f64(0, (20, 20)), f64(1, (30, 20))
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(one_element_wrong(1.01), (x, w))  # default tolerances
    err = info.value
    assert err.input_index == 1
    assert err.input_element == (0, 0)
    # Only d y[b, 0] / d w[0, 0] = x[b, 0] is wrong: one entry per row b at most.
    assert err.output_element[1] == 0
    assert 1 <= err.num_mismatched <= 20
    assert err.num_checked == 600 * 600
    np.testing.assert_allclose(err.analytical, 1.01 * err.numerical, rtol=1e-7)
    assert err.numerical == pytest.approx(x[err.output_element[0], 0], rel=1e-7)


def test_check_grads_misses_single_wrong_element():
    """``check_grads`` projects on one random direction and dilutes the error."""
    x, w = f64(0, (20, 20)), f64(1, (30, 20))
    op = one_element_wrong(1.01)
    with jax.enable_x64(True):
        # Same tolerances as gradcheck's defaults: accepted by check_grads.
        check_grads(op, (jnp.asarray(x), jnp.asarray(w)), 1, modes=["rev"], atol=1e-5, rtol=1e-3)
    # In float32 at check_grads' own defaults: accepted as well.
    x32, w32 = jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)
    check_grads(op, (x32, w32), 1, modes=["rev"])
    assert not jaxext.gradcheck(op, (x, w), raise_exception=False)
    with pytest.warns(UserWarning, match="float32"):
        assert not jaxext.gradcheck(op, (x32, w32), raise_exception=False)


def test_primal_of_forward_rule_differs():
    op = make_linear(lambda x, w, g: (grad_x(x, w, g), grad_w(x, w, g)), primal_offset=0.1)
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(op, (f64(0, (3, 4)), f64(1, (2, 4))))
    err = info.value
    assert err.kind == "primal"
    assert (err.output_index, err.input_index) == (0, None)
    assert err.num_mismatched == err.num_checked == 6
    assert err.analytical - err.numerical == pytest.approx(0.1)
    assert str(err).startswith("Primal mismatch for output 0")


@pytest.mark.parametrize("screened", [False, True])
def test_primal_mismatch_is_reported_before_a_wrong_jacobian(monkeypatch, screened):
    # Reverse mode's primal output is compared after the Jacobians are computed (the
    # differences run while the VJPs compile), but its mismatch is still the error
    # reported, before the wrong Jacobian of the same backward.
    from jaxext._checks import _engines as _engine

    monkeypatch.setattr(_engine, "SCREEN_MIN_ENTRIES", 1 if screened else 2**62)
    args = (f64(0, (3, 4)), f64(1, (2, 4)))
    errors = []
    for offset in (0.1, 0.0):
        op = make_linear(lambda x, w, g: (2 * grad_x(x, w, g), grad_w(x, w, g)), offset)
        with pytest.raises(jaxext.GradcheckError) as info:
            jaxext.gradcheck(op, args)
        errors.append(info.value)
    assert [(e.kind, e.mode) for e in errors] == [("primal", "rev"), ("jacobian", "rev")]
    assert errors[0].analytical - errors[0].numerical == pytest.approx(0.1)
    assert errors[1].input_index == 0


def test_wrong_constant_gradient_names_input_1():
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(MUL_WRONG_CONSTANT_GRAD, (f64(0, (3, 4)), np.array(1.5)))
    assert (info.value.output_index, info.value.input_index) == (0, 1)
    assert info.value.input_element == ()


def test_pytree_input_named_by_key_path():
    def bad_bias_grad(x, params):
        # Leaves in order: x, params["b"], params["w"]; only b's gradient is wrong.
        return MUL_WRONG_CONSTANT_GRAD(jaxext.linear(x, params["w"]), params["b"])

    inputs = (f64(0, (5, 4)), {"b": np.array(0.5), "w": f64(1, (3, 4))})
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(bad_bias_grad, inputs)
    err = info.value
    assert (err.input_index, err.input_path) == (1, "['b']")
    assert "with respect to input 1['b']" in str(err)


def test_second_of_several_outputs_named():
    def two_outputs(x, c):
        return jaxext.linear(x, jnp.eye(4)), MUL_WRONG_CONSTANT_GRAD(x, c)

    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(two_outputs, (f64(0, (3, 4)), np.array(2.0)))
    assert (info.value.output_index, info.value.input_index) == (1, 1)


def test_dict_output_named_by_key_path():
    def outputs(x, c):
        return {"bad": MUL_WRONG_CONSTANT_GRAD(x, c), "good": 2 * x}

    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(outputs, (f64(0, (3,)), np.array(2.0)))
    assert (info.value.output_index, info.value.output_path) == (0, "['bad']")
    assert "output 0['bad'] with respect to input 1" in str(info.value)


def test_raise_exception_false_returns_false():
    rule, _ = BROKEN_BACKWARDS["wrong_sign"]
    inputs = (f64(0, (4, 4)), f64(1, (4, 4)))
    assert jaxext.gradcheck(make_linear(rule), inputs, raise_exception=False) is False
    assert jaxext.gradcheck(CORRECT, inputs, raise_exception=False) is True


def test_forward_mode_checks_custom_jvp():
    square = square_with_wrong_jvp()
    x = f64(0, (5,))
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(square, (x,), modes=("fwd",))
    assert (info.value.mode, info.value.input_index) == ("fwd", 0)
    with pytest.raises(TypeError, match="'fwd'"):
        jaxext.gradcheck(CORRECT, (x.reshape(5, 1), x.reshape(5, 1)), modes="fwd")


# -- second order --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "inputs", "cut_output", "cut_input"),
    [
        (MUL_CUT_RESIDUAL, (f64(0, (3, 4)), np.array(1.5)), 1, 0),
        (LINEAR_CUT_RESIDUAL, (f64(0, (3, 4)), f64(1, (2, 4))), 1, 0),
    ],
    ids=["mul_constant", "linear"],
)
def test_cut_residual_passes_gradcheck_fails_gradgradcheck(op, inputs, cut_output, cut_input):
    assert jaxext.gradcheck(op, inputs)
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradgradcheck(op, inputs)
    err = info.value
    assert (err.order, err.output_index, err.input_index) == (2, cut_output, cut_input)
    assert err.analytical == 0.0  # the cut derivative
    assert "order 2" in str(err)


def test_gradgradcheck_grad_outputs():
    x, c = f64(0, (3, 4)), np.array(1.5)
    assert jaxext.gradgradcheck(jaxext.mul_constant, (x, c), f64(5, (3, 4)))
    assert jaxext.gradgradcheck(jaxext.mul_constant, (x, c), (f64(5, (3, 4)),))
    with pytest.raises(ValueError, match="`grad_outputs`"):
        jaxext.gradgradcheck(jaxext.mul_constant, (x, c), f64(5, (4, 3)))
    with pytest.raises(ValueError, match="`grad_outputs`"):
        jaxext.gradgradcheck(jaxext.mul_constant, (x, c), {"y": f64(5, (3, 4))})


def test_gradgradcheck_names_grad_outputs_after_inputs():
    # grad_x = g * c is right, but stop_gradient hides that it depends on g.
    broken = make_mul(lambda x, c, g: (jax.lax.stop_gradient(g) * c, jnp.sum(g * x)))
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradgradcheck(broken, (f64(0, (3,)), np.array(1.5)))
    # The first mismatching pair, in output-major order: gradient of x w.r.t.
    # grad_outputs[0], which comes after the two positional inputs.
    assert (info.value.output_index, info.value.input_index) == (0, 2)
    assert "grad_outputs for output 0" in str(info.value)


# -- large magnitudes: never fail a correct function ---------------------------------------


# name -> (function, its derivative, input range): outputs reach 1e6, inputs 1e3.
LARGE_MAGNITUDES = {
    "mul_constant_1000": (
        lambda x: jaxext.mul_constant(x, 1000.0), lambda x: 1000.0 + 0 * x, (1e3, 2e3)
    ),
    "square": (lambda x: x**2, lambda x: 2 * x, (1e3, 2e3)),
    "cube": (lambda x: x**3, lambda x: 3 * x**2, (50.0, 100.0)),
    "sin_1e6": (lambda x: jnp.sin(x) * 1e6, lambda x: 1e6 * jnp.cos(x), (-20.0, 20.0)),
    "exp": (jnp.exp, jnp.exp, (10.0, 13.8)),
    "affine_1e6": (lambda x: 1e6 + x, lambda x: 1.0 + 0 * x, (-1.0, 1.0)),
}  # fmt: skip


def normalize(x):
    return x / jnp.linalg.norm(x)


def normalize_with_backward(scale):
    """``normalize`` with a hand-written backward, ``scale`` times the true one."""

    @jax.custom_vjp
    def op(x):
        return normalize(x)

    def op_bwd(x, g):
        n = jnp.linalg.norm(x)
        return (scale * (g / n - x * jnp.dot(x, g) / n**3),)

    op.defvjp(lambda x: (normalize(x), x), op_bwd)
    return op


@pytest.mark.parametrize("norm", [2e-5, 1e-9])
def test_small_inputs_pass_with_the_default_eps(norm):
    """The step follows the input's scale: a step of 1e-6 would move x by 5% or more."""
    x = np.random.default_rng(0).standard_normal(4)
    x *= norm / np.linalg.norm(x)
    assert jaxext.gradcheck(normalize, (x,), check_forward_ad=True)
    assert jaxext.gradgradcheck(normalize, (x,))
    assert jaxext.gradcheck(normalize_with_backward(1.0), (x,))
    with pytest.raises(jaxext.GradcheckError, match="Jacobian mismatch"):
        jaxext.gradcheck(normalize_with_backward(1.01), (x,))


def uniform(seed, bounds, shape):
    return np.random.default_rng(seed).uniform(*bounds, shape)


@pytest.mark.parametrize(*grid(name=sorted(LARGE_MAGNITUDES), shape=[(4,), (3, 5), (64,)]))
def test_large_magnitudes_pass_with_default_tolerances(name, shape):
    fn, derivative, bounds = LARGE_MAGNITUDES[name]
    x = uniform(0, bounds, shape)
    assert jaxext.gradcheck(fn, (x,))
    assert jaxext.gradcheck(elementwise_op(fn, derivative), (x,))
    assert jaxext.gradgradcheck(fn, (x,))


WRONG_BACKWARDS = {  # id -> (scale, bump, rtol)
    "scaled_1.001_rtol_1e-4": (1.001, 0.0, 1e-4),
    "scaled_1.01": (1.01, 0.0, 1e-3),
    "one_element_plus_1e-2": (1.0, 1e-2, 1e-3),
}


@pytest.mark.parametrize(
    *grid(wrong=list(WRONG_BACKWARDS), name=sorted(LARGE_MAGNITUDES), shape=[(4,), (3, 5)])
)
def test_large_magnitudes_wrong_backward_fails(wrong, name, shape):
    # A 0.1% scale error is exactly rtol=1e-3 (PyTorch's default too): it needs a tighter rtol.
    scale, bump, rtol = WRONG_BACKWARDS[wrong]
    fn, derivative, bounds = LARGE_MAGNITUDES[name]
    x = uniform(0, bounds, shape)
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(elementwise_op(fn, derivative, scale=scale, bump=bump), (x,), rtol=rtol)
    assert info.value.kind == "jacobian"
    if bump:
        assert info.value.input_element == (0,) * len(shape)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_untouched_outputs_difference_to_exact_zero(x64, scale):
    from jaxext._checks._jacobians import FlatJacobians

    x0 = jnp.asarray(uniform(1, (1e3, 2e3), (300,)))
    jac = FlatJacobians(lambda x: jnp.sin(x) * scale * 1e6 + x**2, x0)
    block, steps = jac.numerical(range(jac.col_chunk), 1e-6)
    off_diagonal = ~np.eye(jac.col_chunk, 300, dtype=bool)
    assert np.all(block[off_diagonal] == 0.0)
    np.testing.assert_array_equal(steps, (x0[:128] + 1e-6) - (x0[:128] - 1e-6))


def test_torch_agrees_on_the_large_magnitude_functions():
    torch = pytest.importorskip("torch")
    x = uniform(0, (1e3, 2e3), (4,))
    t = torch.tensor(x, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: t * 1000.0, (t,))
    assert jaxext.gradcheck(lambda x: jaxext.mul_constant(x, 1000.0), (x,))


# -- precision handling ---------------------------------------------------------------------


@pytest.mark.parametrize("enabled", [False, True])
def test_caller_x64_setting_restored(enabled):
    inputs = (f64(0, (4, 4)), f64(1, (4, 4)))
    with jax.enable_x64(enabled):
        assert jaxext.gradcheck(CORRECT, inputs)
        assert jax.config.jax_enable_x64 is enabled
        with pytest.raises(jaxext.GradcheckError):
            jaxext.gradgradcheck(LINEAR_CUT_RESIDUAL, inputs)
        assert jax.config.jax_enable_x64 is enabled
        assert jnp.zeros(1).dtype == (jnp.float64 if enabled else jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_low_precision_inputs_warn_then_upcast(dtype):
    x = jnp.asarray(rand(0, (3, 4)), dtype)
    with pytest.warns(UserWarning, match=f"input 0 \\({jnp.dtype(dtype).name}\\)"):
        assert jaxext.gradcheck(jaxext.mul_constant, (x, 3.0))


def test_float64_inputs_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jaxext.gradcheck(jaxext.mul_constant, (f64(0, (3,)), 3.0))


def test_low_precision_output_warns():
    def downcasts(x):
        return (x * 2).astype(jnp.float32)

    with pytest.warns(UserWarning, match=r"output 0 \(float32\)"):
        jaxext.gradcheck(downcasts, (f64(0, (3,)),), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(
    ("platform", "use_cpu", "precision"),
    [("cpu", False, None), ("gpu", False, "highest"), ("cuda", False, "highest"),
     ("tpu", True, "highest"), ("TPU", True, "highest")],
)  # fmt: skip
def test_numerics_plan(platform, use_cpu, precision):
    plan = _precision.numerics_plan(platform)
    assert (plan.use_cpu, plan.matmul_precision) == (use_cpu, precision)


@pytest.mark.parametrize(("platform", "moves_to_cpu"), [("tpu", True), ("gpu", False)])
def test_float64_numerics_context_applies_and_restores_the_plan(platform, moves_to_cpu):
    before = (
        jax.config.jax_enable_x64,
        jax.config.jax_default_matmul_precision,
        jax.config.jax_default_device,
    )
    with _precision.float64_numerics(platform):
        assert jax.config.jax_enable_x64
        assert jax.config.jax_default_matmul_precision == "highest"
        assert jnp.zeros(2).dtype == jnp.float64
        expected_device = jax.devices("cpu")[0] if moves_to_cpu else before[2]
        assert jax.config.jax_default_device == expected_device
    after = (
        jax.config.jax_enable_x64,
        jax.config.jax_default_matmul_precision,
        jax.config.jax_default_device,
    )
    assert after == before


# -- argument validation ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"eps": 0.0}, ValueError, "`eps`"),
        ({"eps": -1e-6}, ValueError, "`eps`"),
        ({"eps": "small"}, TypeError, "`eps`"),
        ({"atol": -1.0}, ValueError, "`atol`"),
        ({"rtol": float("nan")}, ValueError, "`rtol`"),
        ({"rtol": True}, TypeError, "`rtol`"),
        ({"fast_mode": "yes"}, TypeError, "`fast_mode`"),
        ({"modes": ("backward",)}, ValueError, "`modes`"),
        ({"modes": ()}, ValueError, "`modes`"),
        ({"num_directions": 0}, ValueError, "`num_directions`"),
        ({"seed": 1.5}, TypeError, "`seed`"),
    ],
)
def test_invalid_options(kwargs, error, name):
    with pytest.raises(error, match=name):
        jaxext.gradcheck(jaxext.mul_constant, (f64(0, (3,)), 2.0), **kwargs)
    with pytest.raises(error, match=name):
        jaxext.gradgradcheck(jaxext.mul_constant, (f64(0, (3,)), 2.0), **kwargs)


def test_invalid_func_and_inputs():
    x = f64(0, (3,))
    with pytest.raises(TypeError, match="`func`"):
        jaxext.gradcheck("linear", (x,))
    with pytest.raises(ValueError, match="`inputs`"):
        jaxext.gradcheck(jnp.sin, ())
    with pytest.raises(ValueError, match="`inputs` holds no floating-point"):
        jaxext.gradcheck(lambda i: i * 2.0, (np.arange(3),))
    with pytest.raises(ValueError, match="`func` returned no floating-point"):
        jaxext.gradcheck(lambda x: jnp.argmax(x), (x,))
    # complex inputs are checked, not refused (tests/test_complex_gradients.py)
    assert jaxext.gradcheck(jnp.sin, (x.astype(np.complex128),))


# -- PyTorch's option names -------------------------------------------------------------------


def mul_with_bwd(bwd):
    """A custom_vjp ``x * c`` (c a 0-d array) whose backward is ``bwd(x, c, g)``."""
    return make_mul(bwd)


def _callback_noise(values):
    return values * (1 + np.random.default_rng().normal(size=values.shape) * 1e-12)


OPTION_CASES = {
    # name -> (backward that only the option's check catches, option that turns it off, kind)
    "undefined_grad": (
        lambda x, c, g: (jnp.where(jnp.all(g == 0), 1.0, g * c), jnp.sum(g * x)),
        {"check_undefined_grad": False},
        "undefined_grad",
    ),
    "nondeterministic": (
        lambda x, c, g: (
            jax.pure_callback(
                _callback_noise, jax.ShapeDtypeStruct(g.shape, g.dtype), g * c,
                vmap_method="sequential",
            ),
            jnp.sum(g * x),
        ),
        {"nondet_tol": 1e-9},
        "nondeterministic",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(OPTION_CASES))
def test_option_checks_catch_what_the_jacobian_misses(name):
    bwd, turn_off, kind = OPTION_CASES[name]
    inputs = (f64(0, (3, 4)), np.array(1.5))
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(mul_with_bwd(bwd), inputs)
    assert (info.value.kind, info.value.input_index) == (kind, 0)
    assert jaxext.gradcheck(mul_with_bwd(bwd), inputs, **turn_off)


def _sum_all(values):
    return np.broadcast_to(values.sum(), values.shape).copy()  # ignores a batch axis


def test_check_batched_grad_holds_a_lower_precision_inside_to_the_callers_rtol():
    # Correct, but computed in float32 inside: vmap and a loop round differently (~1e-7
    # relative), which the caller's rtol admits; a batching bug is an error of order one.
    def f(x, w):
        inner = x.astype(jnp.float32) @ w.astype(jnp.float32).T
        return jnp.tanh(inner).astype(jnp.float64)

    inputs = (f64(0, (5, 7)), f64(1, (3, 7)))
    assert jaxext.gradcheck(f, inputs, eps=1e-3, atol=1e-2, rtol=1e-2, check_batched_grad=True)


def test_check_batched_grad_catches_a_wrong_batching_rule():
    # The backward's callback sums over all axes, batch included, under vmap.
    def bwd(x, c, g):
        total = jax.pure_callback(
            _sum_all, jax.ShapeDtypeStruct(g.shape, g.dtype), g * x, vmap_method="expand_dims"
        )
        return g * c, total.reshape(-1)[0]

    inputs = (f64(0, (3, 4)), np.array(1.5))
    assert jaxext.gradcheck(mul_with_bwd(bwd), inputs)  # default: not checked, as in PyTorch
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(mul_with_bwd(bwd), inputs, check_batched_grad=True)
    assert (info.value.kind, info.value.input_index) == ("batched_grad", 1)
    assert jaxext.gradcheck(CORRECT, (f64(0, (3, 4)), f64(1, (2, 4))), check_batched_grad=True)


def test_check_grad_dtypes_catches_a_float32_gradient():
    def bwd(x, c, g):
        return (g * c).astype(jnp.float32), jnp.sum(g * x)

    inputs = (f64(0, (3, 4)), np.array(1.5))
    assert jaxext.gradcheck(mul_with_bwd(bwd), inputs)  # JAX accepts it silently
    with pytest.raises(jaxext.GradcheckError, match="float32") as info:
        jaxext.gradcheck(mul_with_bwd(bwd), inputs, check_grad_dtypes=True)
    assert (info.value.kind, info.value.input_index) == ("grad_dtype", 0)
    assert jaxext.gradcheck(jaxext.linear, (f64(0, (3, 4)), f64(1, (2, 4))), check_grad_dtypes=True)


def test_check_forward_and_backward_ad_select_the_modes():
    square = square_with_wrong_jvp()
    x = f64(0, (5,))
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(square, (x,), check_forward_ad=True, check_backward_ad=False)
    assert info.value.mode == "fwd"
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(square, (x,), check_forward_ad=True)
    assert info.value.mode == "rev"  # reverse mode is checked first, and is wrong too
    assert jaxext.gradcheck(
        reference_linear, (f64(0, (3, 4)), f64(1, (2, 4))), check_forward_ad=True
    )
    with pytest.raises(ValueError, match="nothing to check"):
        jaxext.gradcheck(square, (x,), check_backward_ad=False)
    with pytest.raises(TypeError, match="forward"):
        jaxext.gradcheck(CORRECT, (f64(0, (3, 4)), f64(1, (2, 4))), check_forward_ad=True)
    assert jaxext.gradgradcheck(
        reference_linear, (f64(0, (3, 4)), f64(1, (2, 4))), check_fwd_over_rev=True
    )
    with pytest.raises(ValueError, match="nothing to check") as info:
        jaxext.gradgradcheck(reference_linear, (x, f64(1, (2, 5))), check_rev_over_rev=False)
    # gradgradcheck's errors name gradgradcheck's own options, not gradcheck's
    assert "`check_rev_over_rev` is False" in str(info.value)
    assert "check_fwd_over_rev=True" in str(info.value)
    assert "_ad" not in str(info.value)
    with pytest.raises(TypeError, match="`check_fwd_over_rev` must be True or False"):
        jaxext.gradgradcheck(reference_linear, (x, f64(1, (2, 5))), check_fwd_over_rev=1)


@pytest.mark.parametrize(
    "kwargs",
    [{"nondet_tol": -1.0}, {"check_undefined_grad": 1}, {"check_batched_grad": "yes"},
     {"check_grad_dtypes": None}, {"check_forward_ad": 0}, {"check_backward_ad": "no"}],
)  # fmt: skip
def test_invalid_pytorch_options(kwargs):
    name = next(iter(kwargs))
    error = ValueError if name == "nondet_tol" else TypeError
    with pytest.raises(error, match=f"`{name}`"):
        jaxext.gradcheck(jaxext.mul_constant, (f64(0, (3,)), 2.0), **kwargs)


# -- edge inputs: empty arrays, NaN outside the domain -------------------------------------


@pytest.mark.parametrize("shape", [(0,), (0, 3), (3, 0)], ids=str)
@pytest.mark.parametrize("checker", [jaxext.gradcheck, jaxext.gradgradcheck])
def test_empty_inputs_pass_as_in_pytorch(shape, checker):
    x = np.zeros(shape)
    assert checker(jnp.sin, (x,))
    # a non-empty input beside the empty one is still checked
    wrong = _WRONG_SQUARES[checker.__name__]
    with pytest.raises(jaxext.GradcheckError):
        checker(lambda x, y: jnp.sin(x).sum() + wrong(y), (x, np.arange(1.0, 3.0)))


def _square_with_bwd(bwd):
    @jax.custom_vjp
    def square(y):
        return jnp.sum(y**2)

    square.defvjp(lambda y: (jnp.sum(y**2), y), bwd)
    return square


_WRONG_SQUARES = {  # sum(y**2), wrong at first order / right at first order only
    "gradcheck": _square_with_bwd(lambda y, g: (3 * g * y,)),
    "gradgradcheck": _square_with_bwd(lambda y, g: (2 * g * jax.lax.stop_gradient(y),)),
}


def test_nan_outside_the_domain_is_reported_as_a_nan_not_a_primal_mismatch():
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(jnp.log, (np.array([2.0, -1.0, 3.0]),))
    err = info.value
    assert err.kind == "jacobian", str(err)  # the forward rule is not blamed
    assert "output element (1,)" in str(err) and "numerical:  nan" in str(err)
    assert "output 0 element (1,) is NaN at the given inputs themselves" in str(err)
    assert "NaN on one side only" in str(err) and "allowed: nan" not in str(err)
    assert jaxext.gradcheck(jnp.log, (np.array([2.0, 1.0, 3.0]),))


def _nan_report(func, x) -> str:
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(func, (x,))
    return str(info.value)


def test_a_nan_says_whether_the_output_is_nan_at_the_inputs_or_a_step_away():
    """The numerical value is NaN either because the output is NaN at the inputs, whatever
    the input element the column perturbs, or because one step of it leaves the domain;
    the report says which, and prints no "allowed" bound where nothing was compared."""
    # log(x[0]) is NaN at x[0] = -1: the whole output row is NaN, for every column.
    report = _nan_report(lambda x: jnp.log(x[0]) + x[1] * x, np.array([-1.0, 2.0]))
    assert "is NaN at the given inputs themselves, whatever input 0 element" in report
    assert "allowed" not in report, report
    # log at 1e-7 is finite, but a step of 1e-6 below it is not.
    report = _nan_report(jnp.log, np.array([1e-7, 2.0]))
    assert "output 0 element (0,) is finite at the given inputs but NaN when input 0 " in report
    assert "allowed" not in report, report
    # NaN on both sides (the rule NaN too): no bound printed.
    report = _nan_report(lambda x: jnp.where(x > 0, jnp.sqrt(x), jnp.nan), np.array([-1.0, 2.0]))
    assert "NaN on both sides" in report and "allowed" not in report, report


def test_a_backward_not_linear_in_its_cotangent_fails():
    """One-hot +1 cotangents cannot see |g| for g; the random cotangent does."""

    @jax.custom_vjp
    def op(x):
        return jnp.sin(x) * x.sum()

    def bwd(x, g):
        g = jnp.abs(g)  # the bug
        return (g * jnp.cos(x) * x.sum() + jnp.sum(g * jnp.sin(x)),)

    op.defvjp(lambda x: (op(x), x), bwd)
    x = f64(0, (5,))
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(op, (x,))
    err = info.value
    assert err.kind == "random_cotangent" and err.input_index == 0, str(err)
    assert "not linear in its cotangent" in str(err)
    # The same backward with g in place of |g| passes: the check is the linearity.
    op.defvjp(
        lambda x: (op(x), x), lambda x, g: (g * jnp.cos(x) * x.sum() + jnp.sum(g * jnp.sin(x)),)
    )
    assert jaxext.gradcheck(op, (x,))


def l2_penalty(lam, factor):
    """``lam * sum(w**2)`` with a hand-written backward ``factor`` times the true one."""

    @jax.custom_vjp
    def penalty(w):
        return lam * jnp.sum(w**2)

    penalty.defvjp(lambda w: (penalty(w), w), lambda w, g: (factor * 2 * lam * g * w,))
    return penalty


@pytest.mark.parametrize("lam", [1e-6, 1e-9])
def test_a_gradient_off_by_2x_is_caught_however_small_its_entries(lam):
    w = f64(0, (3, 4))  # gradient entries 2 * lam * w: all far below atol = 1e-5
    with pytest.raises(jaxext.GradcheckError, match="Jacobian mismatch") as info:
        jaxext.gradcheck(l2_penalty(lam, 2.0), (w,))
    assert info.value.num_mismatched == info.value.num_checked == w.size
    np.testing.assert_allclose(info.value.analytical, 2 * info.value.numerical, rtol=1e-6)
    assert jaxext.gradcheck(l2_penalty(lam, 1.0), (w,))
    assert jaxext.gradcheck(lambda w: lam * jnp.sum(w**2), (w,), check_forward_ad=True)
    # Forward mode too (a jaxext.custom_vjp's JVP is its transposed backward).
    op = jaxext.custom_vjp(lambda w: lam * jnp.sum(w**2))
    op.defvjp(lambda w: (op(w), w), lambda w, g: (4 * lam * g * w,))
    with pytest.raises(jaxext.GradcheckError, match="Jacobian mismatch") as info:
        jaxext.gradcheck(op, (w,), modes="fwd")
    assert info.value.mode == "fwd"


def _counted_product():
    """A ``jaxext.custom_vjp`` of two inputs ``x * y``, and the list its primal appends to."""
    calls = []

    @jaxext.custom_vjp
    def product(x, y):
        calls.append(1)
        return x * y

    product.defvjp(lambda x, y: (product(x, y), (x, y)), lambda res, g: (g * res[1], g * res[0]))
    return product, calls


def _opcheck_gradcheck(func, inputs):
    return not jaxext.opcheck(func, inputs, checks=["gradcheck"]).failed


CHECKERS = {
    "gradcheck": (jaxext.gradcheck, "inputs"),
    "gradgradcheck": (jaxext.gradgradcheck, "inputs"),
    "opcheck": (_opcheck_gradcheck, "args"),
}


@pytest.mark.parametrize("checker", list(CHECKERS))
@pytest.mark.parametrize("as_array", [np.asarray, jnp.asarray])
@pytest.mark.filterwarnings("ignore:.*upcasting to float64:UserWarning")
def test_a_single_array_is_the_one_input(checker, as_array):
    # as torch.autograd.gradcheck(fn, tensor): the array is the op's one input, whole
    check, _ = CHECKERS[checker]
    shapes = []

    def op(a):
        shapes.append(a.shape)
        return jnp.sin(a) * a[:, :1]

    assert check(op, as_array(f64(0, (3, 2))))
    assert shapes and set(shapes) == {(3, 2)}


@pytest.mark.parametrize("checker", list(CHECKERS))
def test_an_input_count_that_misses_the_signature_is_refused_before_the_call(checker):
    check, argument = CHECKERS[checker]
    product, calls = _counted_product()
    x = f64(0, (3,))
    with pytest.raises(TypeError) as info:
        check(product, x)  # one array for two inputs: PyTorch's single-tensor form
    message = str(info.value)
    assert f"`{argument}` must hold 2 positional arguments for `product(x, y)`; got 1" in message
    assert "ndarray, not a tuple or list, is the one argument" in message
    assert "e.g. `(x, y)`" in message
    with pytest.raises(TypeError, match=rf"`{argument}` must hold 2 positional .*; got 3\.$"):
        check(product, (x, x, x))
    assert calls == []  # refused before product ran, even under a trace
    assert check(product, (x, f64(1, (3,))))
    assert calls


@pytest.mark.parametrize(
    ("count", "expected"), [(1, "2 to 3 positional arguments"), (4, "2 to 3 positional")]
)
def test_an_input_count_names_the_optional_range(count, expected):
    inputs = [f64(0, (4, 3)), f64(1, (2, 3)), f64(2, (2,)), f64(3, (2,))][:count]
    with pytest.raises(TypeError, match=rf"`inputs` must hold {expected}.*`linear\(x, weight"):
        jaxext.gradcheck(jaxext.linear, tuple(inputs))


def test_a_variadic_function_takes_any_count():
    x, y = f64(0, (3,)), f64(1, (3,))
    assert jaxext.gradcheck(lambda *a: a[0] * a[-1], (x, y))
    assert jaxext.gradcheck(lambda *a: a[0] * a[-1], x)
    with pytest.raises(TypeError, match=r"`inputs` must hold at least 2 positional arguments"):
        jaxext.gradcheck(lambda a, b, *rest: a * b, x)


# --- The failure text the docs show is the text the code prints ---------------------------

_DOCS_WITH_FAILURES = ["README.md", "docs/guides/checking.md"]


def _documented_failures(page: str) -> list[tuple[str, str, str, str]]:
    """``(where, bases, code, shown)`` for each Python block of ``page`` that prints a
    ``GradcheckError`` or ``OpcheckError``: the blocks it builds on, the block, and the
    ``text`` block that follows it on the page."""
    from pathlib import Path

    from test_examples import _FENCE, markdown_examples

    text = (Path(__file__).resolve().parent.parent / page).read_text()
    examples = {e.lineno: e for e in markdown_examples(text, page)}
    fences = list(_FENCE.finditer(text))
    found = []
    for fence, after in zip(fences, fences[1:], strict=False):
        lineno = text.count("\n", 0, fence.start()) + 1
        if lineno not in examples or "except jaxext." not in fence["body"]:
            continue
        assert after["lang"] == "text", f"{page}:{lineno}: the printed error should follow"
        code = examples[lineno].code
        own = code.rindex(fence["body"])  # the blocks it builds on come first
        found.append((f"{page}:{lineno}", code[:own], code[own:], after["body"]))
    return found


@pytest.mark.parametrize("page", _DOCS_WITH_FAILURES)
def test_documented_failure_text_is_what_the_code_prints(page):
    import contextlib
    import io

    failures = _documented_failures(page)
    assert failures, f"{page} shows no failing example"
    for where, bases, code, shown in failures:
        namespace = {"__name__": "__main__"}
        printed = io.StringIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(bases, where, "exec"), namespace)
            with contextlib.redirect_stdout(printed):
                exec(compile(code, where, "exec"), namespace)
        printed = printed.getvalue().rstrip("\n")
        shown = shown.rstrip("\n")
        if shown.endswith("\n  ..."):  # the page abbreviates the rest of the diagnostic
            shown = shown.removesuffix("\n  ...")
            assert printed.startswith(shown + "\n"), f"{where}: the page shows\n{shown}\n\n" + (
                f"but the code prints\n{printed}"
            )
        else:
            assert printed == shown, (
                f"{where}: the page shows\n{shown}\n\nbut the code prints\n{printed}"
            )


def test_allowed_error_explains_a_scaled_atol_only_where_it_was_scaled():
    x, w = f64(0, (4, 3)), f64(1, (2, 3))
    op = jax.custom_vjp(lambda x, w: x @ w.T)
    op.defvjp(lambda x, w: (op(x, w), (x, w)), lambda r, g: (g @ r[1], 1.01 * g.T @ r[0]))
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(op, (x, w))
    message = str(info.value)
    assert "(atol + rtol * |numerical| + finite-difference noise)\n" in message
    assert "largest" not in message and "times" not in message

    w = f64(0, (3, 4))
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(l2_penalty(1e-6, 2.0), (w,))
    message = str(info.value)
    scale = float(np.max(np.abs(2e-6 * np.asarray(w))))
    assert f"(atol * {scale:.3e} + rtol * |numerical| + finite-difference noise)\n" in message
    assert f"(atol is multiplied by {scale:.3e}, the largest |numerical| of this pair" in message


# -- reference= (issue #43): a kernel judged against its plain-JAX reference ------------------


def sin_kernel(residual="exact"):
    """``sin(x * w)`` computed in float32 whatever it is given (a kernel), its backward
    built from the residual ``cos(x * w)``: ``"exact"``; ``"cut"`` (the residual under
    ``stop_gradient``: right at first order, its derivative lost at second); ``"1pct"``
    (the residual's value exact, its derivative off by ``0.01 * d(x w)``)."""

    @jaxext.custom_vjp
    def op(x, w):
        return jnp.sin(x.astype(jnp.float32) * w.astype(jnp.float32)).astype(x.dtype)

    def fwd(x, w):
        t = x.astype(jnp.float32) * w.astype(jnp.float32)
        c = jnp.cos(t)
        if residual == "cut":
            c = jax.lax.stop_gradient(c)
        elif residual == "1pct":
            c = c + 0.01 * (t - jax.lax.stop_gradient(t))
        return op(x, w), (x.astype(jnp.float32), w.astype(jnp.float32), c)

    def bwd(res, g):
        x, w, c = res
        gc = g.astype(jnp.float32) * c
        return (gc * w).astype(g.dtype), (gc * x).astype(g.dtype)

    op.defvjp(fwd, bwd)
    return op


def sin_reference(x, w):
    return jnp.sin(x * w)


@pytest.mark.parametrize("residual", ["exact", "cut", "1pct"])
def test_gradgradcheck_reference_judges_second_derivatives(residual):
    # Every twin is right at first order (its values and VJPs match the reference); the
    # twins' second derivatives are wrong, and only the float64 autodiff of the
    # reference tells (a float32 kernel's finite differences cannot).
    op, inputs = sin_kernel(residual), (f64(0, (3, 4)), f64(1, (3, 4)))
    assert jaxext.gradcheck(op, inputs, reference=sin_reference, modes=("rev", "fwd"))
    for modes in (("rev",), ("fwd",)):
        if residual == "exact":
            assert jaxext.gradgradcheck(op, inputs, reference=sin_reference, modes=modes)
            continue
        with pytest.raises(jaxext.GradcheckError) as info:
            jaxext.gradgradcheck(op, inputs, reference=sin_reference, modes=modes)
        assert (info.value.kind, info.value.order, info.value.mode) == ("reference", 2, modes[0])
        assert "(inputs, grad_outputs) -> VJP" in str(info.value)


def test_gradgradcheck_reference_takes_grad_outputs_in_the_outputs_dtype():
    op, inputs = sin_kernel(), (f64(0, (3, 4)), f64(1, (3, 4)))
    u = f64(2, (3, 4))
    assert jaxext.gradgradcheck(op, inputs, (u,), reference=sin_reference)
    assert jaxext.gradgradcheck(op, inputs, u.astype(np.float32), reference=sin_reference)
    with pytest.raises(ValueError, match="`grad_outputs`"):
        jaxext.gradgradcheck(op, inputs, f64(2, (4, 3)), reference=sin_reference)
    with pytest.raises(TypeError, match="`reference`"):
        jaxext.gradgradcheck(op, inputs, reference="sin")


def _float32_gradient(x, c, g):
    return (g * c).astype(jnp.float32), jnp.sum(g * x)


# name -> (backward that only the option's check catches, the option's argument, kind): with
# reference= the backward's checks run on the op in its own dtypes, as without it.
REFERENCE_OPTION_CASES = {
    **{name: (bwd, off, kind) for name, (bwd, off, kind) in OPTION_CASES.items()},
    "batched_grad": (
        lambda x, c, g: (
            g * c,
            jax.pure_callback(
                _sum_all, jax.ShapeDtypeStruct(g.shape, g.dtype), g * x,
                vmap_method="expand_dims",
            ).reshape(-1)[0],
        ),
        {"check_batched_grad": True},
        "batched_grad",
    ),
    "grad_dtype": (_float32_gradient, {"check_grad_dtypes": True}, "grad_dtype"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REFERENCE_OPTION_CASES))
def test_reference_runs_the_backward_option_checks(name):
    bwd, option, kind = REFERENCE_OPTION_CASES[name]
    op, inputs = mul_with_bwd(bwd), (f64(0, (3, 4)), np.array(1.5))

    def reference(x, c):
        return x * c

    # The values and VJPs match the reference: only the option's check tells.
    off = option if name in OPTION_CASES else {}
    on = {} if name in OPTION_CASES else option
    assert jaxext.gradcheck(op, inputs, reference=reference, **off)
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(op, inputs, reference=reference, **on)
    assert info.value.kind == kind
    if kind != "grad_dtype":
        assert info.value.input_index == (1 if kind == "batched_grad" else 0)
    # Correct ops pass every option.
    every = {"check_batched_grad": True, "check_grad_dtypes": True}
    assert jaxext.gradcheck(mul_with_bwd(lambda x, c, g: (g * c, jnp.sum(g * x))), inputs,
                            reference=reference, **every)  # fmt: skip


def test_gradgradcheck_reference_runs_the_option_checks_on_the_vjp():
    # A backward built from a product whose own backward gives a gradient for a zero
    # cotangent: the second derivatives match the reference for random cotangents, and
    # check_undefined_grad of the VJP function catches it, in the kernel's own dtypes.
    undefined = make_mul(lambda x, c, g: (jnp.where(jnp.all(g == 0), 1.0, g * c), g * x))

    @jaxext.custom_vjp
    def op(x):
        return jnp.sin(x)

    op.defvjp(lambda x: (op(x), x), lambda x, g: (undefined(g, jnp.cos(x)),))
    inputs = (f64(0, (5,)),)

    def reference(x):
        return jnp.sin(x)

    assert jaxext.gradcheck(op, inputs, reference=reference)
    assert jaxext.gradgradcheck(op, inputs, reference=reference, check_undefined_grad=False)
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradgradcheck(op, inputs, reference=reference)
    assert (info.value.kind, info.value.order) == ("undefined_grad", 2)


# -- the dtypes an op computes in: what reaches its outputs (issue #43) ------------------------


def _sin_with(forward_extra, relative_error):
    """A float64 ``sin`` whose forward also runs ``forward_extra(x)`` (returning the
    output's factor) and whose backward is ``relative_error`` too large."""

    @jaxext.custom_vjp
    def op(x):
        return jnp.sin(x) * forward_extra(x)

    op.defvjp(lambda x: (op(x), x), lambda x, g: (g * jnp.cos(x) * (1 + relative_error),))
    return op


def _through_float32(x):
    return (jnp.sin(x.astype(jnp.float32)) / jnp.sin(x.astype(jnp.float32))).astype(x.dtype)


def _float32_aside(x):
    side = jnp.sum(x.astype(jnp.float32) ** 2)  # computed, never used: reaches no output
    del side
    return jnp.ones_like(x) * jnp.asarray(1.0, jnp.float32)  # a float32 constant, exact


def test_an_op_whose_output_goes_through_float32_is_judged_at_float32s_tolerance():
    # The output is rounded to float32 on its way (x / x in float32): an error of 1e-5
    # in its gradient is within float32's reference tolerance (1e-4).
    op = _sin_with(_through_float32, 1e-5)
    assert jaxext.gradcheck(op, (f64(0, (6,)),), reference=jnp.sin)


def test_a_float32_side_value_leaves_a_float64_op_at_float64s_tolerance():
    # A float32 side computation and a float32 constant reach the output through nothing
    # rounded: float64's tolerance (1e-7) stands, and a 1e-6 gradient error FAILs.
    inputs = (f64(0, (6,)),)
    assert jaxext.gradcheck(_sin_with(_float32_aside, 0.0), inputs, reference=jnp.sin)
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(_sin_with(_float32_aside, 1e-6), inputs, reference=jnp.sin)
    assert info.value.kind == "reference"
    assert "rtol 1e-07" in str(info.value)


def test_computed_dtypes_follow_the_data_from_inputs_to_outputs():
    from jaxext._checks._dtype_tolerance import computed_dtypes, program_dtypes

    def names(fn, *args):
        with jax.enable_x64(True):
            return sorted(d.name for d in computed_dtypes(jax.make_jaxpr(fn)(*args)))

    x = f64(0, (4,))
    assert names(lambda x: x * _float32_aside(x), x) == ["float64"]
    assert names(_through_float32, x) == ["float32", "float64"]
    # Inside a jit call: followed; a side value there does not count either.
    assert names(jax.jit(lambda x: (jnp.sin(x), x.astype(jnp.float32))[0]), x) == ["float64"]
    assert names(jax.jit(_through_float32), x) == ["float32", "float64"]

    # A loop's body counts whole where the loop computes from an input for an output.
    def carried(x):
        x32 = x.astype(jnp.float32)
        return jax.lax.fori_loop(0, 2, lambda i, c: c + x32[i] ** 2, jnp.zeros((), jnp.float32))

    assert names(carried, x) == ["float32", "float64"]
    # A backward that rounds its cotangent to float32: the cotangent is data of the VJP.
    op = _sin_with(lambda x: 1.0, 0.0)
    rounding = jaxext.custom_vjp(jnp.sin)
    rounding.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g.astype(jnp.float32) * 2,))
    with jax.enable_x64(True):
        assert {d.name for d in program_dtypes(op, [x], x, forward=False)} == {"float64"}
        found = program_dtypes(rounding, [x], x, forward=False)
    assert {d.name for d in found} == {"float32", "float64"}
