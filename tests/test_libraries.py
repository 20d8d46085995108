"""``jaxext.custom_vjp`` in place of ``jax.custom_vjp`` under real libraries.

Flax, Equinox, diffrax, optax, jaxopt, optimistix and lineax build their custom
gradients on ``jax.custom_vjp``. The promise of a drop-in is that they keep working,
with the same values, when ``jaxext.custom_vjp`` replaces it; and that forward mode
then works through them where plain JAX refuses (a ``jax.custom_vjp`` has no JVP).

Most of these libraries capture ``jax.custom_vjp`` when they are imported, so the
swap must come before any import: ``tests/_libraries_worker.py`` runs once with plain
JAX and once with ``jax.custom_vjp = jaxext.custom_vjp`` set first, each in its own
process (the slow tier), and the tests here compare the two, or each with finite
differences, a closed form or a hand-computed value. Two cheap cases run in this
process (the default tier): ``eqx.filter_custom_vjp`` looks ``jax.custom_vjp`` up when its
rules are attached, so patching it for one test reaches a function defined there.

The libraries are the ``libs`` extra (``pip install 'jaxext[libs]'``); without them the
module skips.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import importorskip_extra, run_json_worker

import jaxext

WORKER = Path(__file__).with_name("_libraries_worker.py")
LIBRARIES = ("flax", "equinox", "diffrax", "optax", "jaxopt", "optimistix", "lineax")

# Same float64 math through two different custom_vjp implementations: the programs
# differ (jaxext's rules are traced and staged differently), so the values agree to
# rounding, not bit for bit.
SAME = {"rtol": 1e-10, "atol": 1e-12}
# Float64 central differences with step 1e-6: truncation ~1e-12 |f'''|, rounding
# ~1e-16 |f| / 1e-6 = 1e-10 |f|, for functions of order one.
FD = {"rtol": 1e-6, "atol": 1e-8}

# Eagerly, `jax.grad` at a Python float hands Equinox's fwd the float itself, so the
# output is a Python float that Equinox treats as static: JAX's gradient is then 0 (2, the
# rule's, under jit or at an array). A drop-in may match that 0 or give the rule's 2.
EAGER_FLOAT = "eager grad at a Python float: neither JAX's value nor the rule's"
PLAIN_JAX_REFUSES = "can't apply forward-mode autodiff (jvp) to a custom_vjp function"


@pytest.fixture(scope="module")
def results(tmp_path_factory, spawn_python):
    """``{"jax": checks, "jaxext": checks}``: the worker's measurements, each way."""
    for name in LIBRARIES:
        importorskip_extra(name, "libs")
    out = tmp_path_factory.mktemp("libraries")
    runs = {}
    for mode in ("jax", "jaxext"):
        runs[mode] = run_json_worker(
            spawn_python, WORKER, out / f"{mode}.json", f"libraries ({mode})", mode
        )["checks"]
    return runs


def measured(results, mode, name):
    """What check ``name`` measured with ``mode`` (``jax`` or ``jaxext``); fails with
    the worker's traceback if it raised."""
    result = results[mode][name]
    if isinstance(result, dict) and "error" in result:
        pytest.fail(f"{name} raised with {mode}.custom_vjp:\n{result['error']}")
    return result


def refusal(results, name):
    """Plain JAX's error for check ``name``: it must have refused."""
    result = results["jax"][name]
    assert isinstance(result, dict) and "error" in result, f"plain JAX did not refuse {name}"
    return result["error"]


def assert_tree_close(actual, expected, **tolerance):
    leaves, tree = jax.tree.flatten(actual)
    expected_leaves, expected_tree = jax.tree.flatten(expected)
    assert tree == expected_tree, (tree, expected_tree)
    for a, e in zip(leaves, expected_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), **tolerance)


def assert_grad_matches(results, name, fd=FD, **key):
    """Check ``name``'s gradient with jaxext equals plain JAX's, and its directional
    derivative equals the central difference (``key``: a sub-result to read)."""
    swapped, plain = measured(results, "jaxext", name), measured(results, "jax", name)
    for k in key.values():
        swapped, plain = swapped[k], plain[k]
    assert_tree_close(swapped["grad"], plain["grad"], **SAME)
    np.testing.assert_allclose(swapped["directional"], swapped["fd"], **fd)


def assert_forward_mode_gain(results, name):
    """Plain JAX refuses ``jax.jvp`` of check ``name``; with jaxext it equals finite
    differences."""
    assert PLAIN_JAX_REFUSES in refusal(results, name)
    swapped = measured(results, "jaxext", name)
    assert_tree_close(swapped["jvp"], swapped["fd"], **FD)


# -- the swap itself ----------------------------------------------------------------------


def test_the_swap_reaches_the_libraries(results):
    assert results["jaxext"]["swapped"] is True
    assert results["jax"]["swapped"] is False


# -- reverse mode: the same values as with jax.custom_vjp -----------------------------------


def test_flax_nnx_custom_vjp(results):
    swapped = measured(results, "jaxext", "flax_nnx_custom_vjp")
    assert_tree_close(swapped, measured(results, "jax", "flax_nnx_custom_vjp"), **SAME)
    # The rule doubles w's gradient: jaxext runs the rule, not autodiff of the primal.
    x, w, b = np.array([0.3, -0.7, 1.1]), np.array([0.5, -1.5, 2.0]), 0.25
    out = np.sum(np.sin(w * x)) + b
    np.testing.assert_allclose(swapped["w"], 2 * 2 * out * np.cos(w * x) * x, **SAME)
    np.testing.assert_allclose(swapped["jit_b"], 2 * out, **SAME)


def test_flax_fp8_amax_history(results):
    """The histories, by hand: each step shifts the history left by one and writes the
    input's amax (3, 7, 2.5) first; the scale is the history's previous maximum over
    float8_e4m3fn's largest value, 448 (1 while that maximum is 0)."""
    swapped = measured(results, "jaxext", "flax_fp8_meta_history")
    assert swapped["histories"] == [[3, 0, 0, 0], [7, 0, 0, 3], [2.5, 0, 3, 7]]
    np.testing.assert_allclose(np.ravel(swapped["scales"]), [1.0, 3 / 448, 7 / 448], rtol=1e-7)
    assert_tree_close(swapped, measured(results, "jax", "flax_fp8_meta_history"), rtol=1e-7)


def test_flax_fp8_scaled_dot_general(results):
    swapped = measured(results, "jaxext", "flax_fp8_scaled_dot_general")
    plain = measured(results, "jax", "flax_fp8_scaled_dot_general")
    # float32 with FP8 rounding inside: the same quantization steps, so the same values
    # up to float32 reassociation.
    assert_tree_close(swapped, plain, rtol=1e-5, atol=1e-6)
    histories = swapped["second"][2]
    assert histories["lhs_amax_history"][0] > 0 and histories["grad_amax_history"][0] > 0


def test_equinox_filter_custom_vjp_python_scalars(results):
    swapped = dict(measured(results, "jaxext", "eqx_filter_custom_vjp_python_scalars"))
    np.testing.assert_allclose(swapped["grad"], swapped["expected"], **SAME)
    np.testing.assert_allclose(swapped["jit_grad"], swapped["expected"], **SAME)
    assert swapped["float_input_jit"] == swapped["array_input"] == 2.0
    plain = dict(measured(results, "jax", "eqx_filter_custom_vjp_python_scalars"))
    assert swapped.pop("float_input") in (plain.pop("float_input"), 2.0), EAGER_FLOAT
    assert_tree_close(swapped, plain, **SAME)


def test_equinox_checkpointed_while_loop_grad(results):
    assert_grad_matches(results, "eqx_checkpointed_while_grad")


def test_diffrax_recursive_checkpoint_adjoint_grad(results):
    assert_grad_matches(results, "diffrax_recursive_checkpoint_grad")


def test_diffrax_backsolve_adjoint_grad(results):
    # The adjoint ODE is solved backwards by 20 Heun steps: it matches the derivative of
    # the discrete forward solve (finite differences) to Heun's error, O(0.05**2), not
    # to rounding.
    assert_grad_matches(results, "diffrax_backsolve_grad", fd={"rtol": 2e-3})


def test_diffrax_grad_of_vmap(results):
    assert_grad_matches(results, "diffrax_grad_of_vmap")


def test_diffrax_backsolve_closure_is_the_gradient_or_explained(results):
    """JAX refuses a custom_vjp differentiated through a closure, and says so; jaxext
    may give the right gradient, or must explain as well (not crash on a tracer)."""
    assert "closed-over value" in refusal(results, "diffrax_backsolve_closure")
    result = results["jaxext"]["diffrax_backsolve_closure"]
    if "error" in result:
        assert "No constant handler" not in result["error"], result["error"]
        # The exception itself (JAX appends a note on filtered frames after it).
        message = re.split(r"\n(?=[\w.]+(?:Error|Exception): )", result["error"])[-1]
        assert "clos" in message, result["error"]
    else:  # -exp(-k) at k = 0.7, to the Tsit5 solve's accuracy
        np.testing.assert_allclose(result["grad"], result["expected"], rtol=1e-4)


def test_optax_scale_gradient(results):
    swapped = measured(results, "jaxext", "optax_scale_gradient")
    np.testing.assert_allclose(swapped["grad"], swapped["expected"], **SAME)
    np.testing.assert_allclose(swapped["per_example"], swapped["per_example_expected"], **SAME)
    assert_tree_close(swapped, measured(results, "jax", "optax_scale_gradient"), **SAME)


def test_jaxopt_implicit_differentiation_grad(results):
    """Against the ridge regression's closed form, differentiated (the solver stops at
    tol 1e-12, the backward's CG at its own tolerance)."""
    swapped = measured(results, "jaxext", "jaxopt_implicit_grad")
    np.testing.assert_allclose(swapped["jacobian"], swapped["expected"], rtol=1e-8)
    plain = measured(results, "jax", "jaxopt_implicit_grad")
    np.testing.assert_allclose(swapped["jacobian"], plain["jacobian"], **SAME)


def test_jaxopt_custom_root_grad(results):
    assert_grad_matches(results, "jaxopt_custom_root_grad")


@pytest.mark.parametrize("solve", ["root", "fixed_point"])
def test_optimistix_implicit_adjoint_grad(results, solve):
    assert_grad_matches(results, "optx_implicit_grad", key=solve)


def test_optimistix_recursive_checkpoint_adjoint_grad(results):
    assert_grad_matches(results, "optx_recursive_checkpoint_grad")


@pytest.mark.parametrize("solver", ["lu", "cg"])
def test_lineax_linear_solve_grad(results, solver):
    assert_grad_matches(results, "lineax_solve_grad", key=solver)


# -- forward mode: plain JAX refuses, jaxext equals finite differences ----------------------


def test_optax_scale_gradient_jvp_is_the_adjoint_of_its_backward(results):
    """Derived forward mode is the adjoint of the hand-written backward, never another
    derivative: ``scale_gradient`` is the identity, but its backward scales by -3, so
    its tangent is scaled by -3 too."""
    assert PLAIN_JAX_REFUSES in refusal(results, "optax_scale_gradient_jvp")
    swapped = measured(results, "jaxext", "optax_scale_gradient_jvp")
    np.testing.assert_allclose(swapped["jvp"], swapped["expected"], **SAME)


def test_equinox_checkpointed_while_loop_jvp(results):
    assert_forward_mode_gain(results, "eqx_checkpointed_while_jvp")


def test_diffrax_recursive_checkpoint_adjoint_jvp(results):
    assert_forward_mode_gain(results, "diffrax_recursive_checkpoint_jvp")


def test_optimistix_recursive_checkpoint_adjoint_jvp(results):
    assert_forward_mode_gain(results, "optx_recursive_checkpoint_jvp")


def test_jaxopt_implicit_differentiation_jvp(results):
    """jaxopt's backward solves by CG (a while_loop): ``J t`` must come from it."""
    assert_forward_mode_gain(results, "jaxopt_implicit_jvp")


# -- the default tier: libraries that look jax.custom_vjp up late, patched in this process ----


def _defined_with(monkeypatch, custom_vjp, define):
    """``define()`` run with ``jax.custom_vjp`` set to ``custom_vjp``, and called so.

    Equinox is imported first, unpatched: its own loops decorate at import time.
    """
    importorskip_extra("equinox", "libs")
    with monkeypatch.context() as patch:
        patch.setattr(jax, "custom_vjp", custom_vjp)
        return define()


def _equinox_doubling():
    """An ``eqx.filter_custom_vjp`` whose output holds a Python float; returns the
    values Equinox's users meet: grad at an array, and at a Python float (eager and
    jitted), and ``jax.jvp`` (which plain JAX refuses)."""
    eqx = importorskip_extra("equinox", "libs")

    @eqx.filter_custom_vjp
    def doubled(x):
        return 2.0 * x, 1.5

    @doubled.def_fwd
    def doubled_fwd(perturbed, x):
        del perturbed
        return doubled(x), None

    @doubled.def_bwd
    def doubled_bwd(residuals, grad_obj, perturbed, x):
        del residuals, perturbed, x
        return 2.0 * grad_obj[0]

    def first(x):
        return doubled(x)[0]

    values = {
        "array": jax.grad(first)(jnp.float32(3.0)),
        "float": jax.grad(first)(3.0),
        "float_jit": jax.jit(jax.grad(first))(3.0),
    }
    try:
        values["jvp"] = jax.jvp(first, (jnp.float32(3.0),), (jnp.float32(0.5),))[1]
    except TypeError as error:
        values["jvp"] = str(error)
    return values


def test_equinox_python_float_input_as_with_jax(monkeypatch):
    plain = _defined_with(monkeypatch, jax.custom_vjp, _equinox_doubling)
    swapped = _defined_with(monkeypatch, jaxext.custom_vjp, _equinox_doubling)
    assert PLAIN_JAX_REFUSES in plain.pop("jvp")
    assert float(swapped.pop("jvp")) == 2.0 * 0.5  # the transpose of the backward
    assert float(swapped.pop("float")) in (float(plain.pop("float")), 2.0), EAGER_FLOAT
    assert_tree_close(swapped, plain, **SAME)


def test_equinox_filter_custom_vjp_jvp(monkeypatch):
    """Forward mode through ``eqx.filter_custom_vjp`` with an array input."""
    eqx = importorskip_extra("equinox", "libs")

    def define():
        @eqx.filter_custom_vjp
        def cube_sum(x, scale):
            return scale * jnp.sum(x**3)

        @cube_sum.def_fwd
        def cube_sum_fwd(perturbed, x, scale):
            del perturbed
            return cube_sum(x, scale), x

        @cube_sum.def_bwd
        def cube_sum_bwd(x, grad_obj, perturbed, x_again, scale):
            del perturbed, x_again
            return grad_obj * scale * 3 * x**2

        x, t = jnp.array([0.5, -1.0, 2.0]), jnp.array([1.0, 0.5, -0.25])
        try:
            return jax.jvp(lambda x: cube_sum(x, 0.5), (x,), (t,))[1]
        except TypeError as error:
            return str(error)

    assert PLAIN_JAX_REFUSES in _defined_with(monkeypatch, jax.custom_vjp, define)
    tangent = _defined_with(monkeypatch, jaxext.custom_vjp, define)
    x, t = np.array([0.5, -1.0, 2.0]), np.array([1.0, 0.5, -0.25])
    np.testing.assert_allclose(tangent, np.sum(0.5 * 3 * x**2 * t), rtol=1e-6)
