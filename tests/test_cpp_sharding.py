"""C++ kernels under sharding: the ``partition`` rules of ``jaxext.cpp_extension``.

The multi-device checks run once in a subprocess (``tests/_cpp_sharding_worker.py``,
8 forced CPU devices, as ``test_sharding.py`` does) that writes JSON; the tests here
assert on it. References: one-device float64 autodiff of the same math in plain
``jnp``, and the collectives of plain autodiff compiled with the same shardings. The
rule parser's errors are checked in this process (no mesh needed).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rounding_tolerance, run_json_worker
from ops_table import CPP_OPS

from jaxext import cpp_extension
from jaxext.cpp_extension import ops

WORKER = Path(__file__).with_name("_cpp_sharding_worker.py")
REPO_ROOT = WORKER.parent.parent

OPS = CPP_OPS  # tests/ops_table.py; _cpp_sharding_worker.py has a case for each
RULE_CASES = [
    *(f"{op}_explicit_{mode}" for op in OPS for mode in ("jit", "eager")),
    *(f"{op}_auto_eager" for op in OPS),  # concrete shardings: their specs are known
    "linear_explicit_jit_3d",
]
FALLBACK_CASES = [f"{op}_auto_jit" for op in OPS]  # auto axes under jit: replicated
HANDLER_CASES = ["batch_rule_explicit_jit", "load_rule_explicit_jit"]
# ops.mul_constant with a 0-d array constant (replicated, differentiable) on split x.
TRACED_CASES = ["mul_traced_explicit_jit", "mul_traced_explicit_eager"]
# jax.vmap of ops.linear over an ensemble axis split over `ens`, rows over `data` (issue #45:
# eagerly, "shard_map out_specs argument must refer to an axis marked as manual").
ENSEMBLE_CASES = ["linear_ensemble_explicit_jit", "linear_ensemble_explicit_eager"]
ALL_CASES = (
    RULE_CASES
    + FALLBACK_CASES
    + HANDLER_CASES
    + TRACED_CASES
    + ENSEMBLE_CASES
    + ["no_rule_explicit_jit"]
)
# float32 results of these small problems (sums of up to 16 * 6 terms) against float64.
TOL = rounding_tolerance(np.float32, n=128)


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory, spawn_python, cpp_builds):
    out = tmp_path_factory.mktemp("cpp_sharding") / "results.json"
    return run_json_worker(spawn_python, WORKER, out, "cpp sharding")


def _check(results, name):
    result = results["checks"][name]
    assert "error" not in result, f"{name} raised in the worker:\n{result['error']}"
    return result


def _assert_values(result):
    assert result["out_diff"] <= TOL * result["out_scale"]
    assert result["loss"][0] == pytest.approx(result["loss"][1], rel=TOL)
    if "grad_diff" in result:
        assert result["grad_scale"] > 1e-2
        assert result["grad_diff"] <= TOL * result["grad_scale"]


def test_worker_sees_eight_devices(worker_results):
    assert worker_results["device_count"] == 8
    assert set(worker_results["checks"]) == set(ALL_CASES)


@pytest.mark.parametrize("name", ALL_CASES)
def test_values_and_gradients_match_unsharded_reference(worker_results, name):
    _assert_values(_check(worker_results, name))


@pytest.mark.parametrize("name", ENSEMBLE_CASES)
def test_vmap_over_a_split_ensemble_axis_keeps_both_splits(worker_results, name):
    result = _check(worker_results, name)
    assert result["out_spec"].startswith("('ens', 'data'")
    assert result["grad_specs"] == result["param_specs"]


@pytest.mark.parametrize("name", RULE_CASES + HANDLER_CASES + TRACED_CASES)
def test_output_keeps_batch_sharding(worker_results, name):
    result = _check(worker_results, name)
    assert result["out_spec"].startswith("('data',")


@pytest.mark.parametrize("name", RULE_CASES + TRACED_CASES)
def test_gradients_keep_parameter_shardings(worker_results, name):
    result = _check(worker_results, name)
    assert result["grad_specs"] == result["param_specs"]


@pytest.mark.parametrize(
    "name", [c for c in RULE_CASES + HANDLER_CASES + TRACED_CASES if "jit" in c]
)
def test_compiled_forward_and_backward_gather_nothing(worker_results, name):
    result = _check(worker_results, name)
    assert result["forward_collectives"]["all-gather"] == 0
    assert result["forward_collectives"]["all-reduce"] == 0
    if "backward_collectives" in result:
        # As plain autodiff: no gather, and the one reduction of the weight gradients
        # across the batch (none for mul_constant with a Python constant, which has no
        # parameter; the array constant's gradient sum(g * x) is one).
        assert result["backward_collectives"] == result["plain_backward_collectives"]
        assert result["backward_collectives"]["all-gather"] == 0
        expected = 1 if name.startswith(("linear", "mul_traced")) else 0
        assert result["backward_collectives"]["all-reduce"] == expected


@pytest.mark.parametrize("name", ["no_rule_explicit_jit", *FALLBACK_CASES])
def test_without_a_rule_the_batch_is_gathered(worker_results, name):
    # What a kernel that says nothing costs (and auto axes under jit, where the
    # operands' types do not say how they are split): the batch is all-gathered and
    # every device runs the whole kernel; the values stay right.
    result = _check(worker_results, name)
    assert result["forward_collectives"]["all-gather"] >= 1
    assert result["out_spec"] == "(None, None)"


# -- the rule argument, in this process --------------------------------------------


@pytest.mark.parametrize(
    ("rule", "match"),
    [
        ("b i, o i", "exactly one '->'"),
        ("b i -> b o", "'o' is in no operand"),
        ("b b -> b", "repeats"),
        ("... i ... -> i", "twice"),
        ("b+i -> b", "not a dimension name"),
    ],
)
def test_malformed_rules_are_value_errors(rule, match):
    with pytest.raises(ValueError, match=match):
        cpp_extension.FfiFunction("f", "t", "cpu", partition=rule)


def test_rule_must_be_a_string():
    with pytest.raises(TypeError, match="`partition`"):
        cpp_extension.FfiFunction("f", "t", "cpu", partition=("b", "b"))


def test_rule_that_does_not_fit_the_call_is_a_value_error(cpp_builds):
    x = jnp.ones((4, 3))
    c = np.float32(2.0)
    handler = ops.extension().jaxext_mul_constant
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    with pytest.raises(ValueError, match="3 operand"):
        handler(x, c, result_shape_dtypes=out, partition="b, c, d -> b")
    with pytest.raises(ValueError, match="rank 2"):
        handler(x, c, result_shape_dtypes=out, partition="b, -> b")


def test_load_partition_names_loaded_handlers(cpp_builds):
    with pytest.raises(ValueError, match="not loaded"):
        cpp_extension.load("jaxext_ops", [ops.SOURCE], partition={"nope": "batch"})
    ext = cpp_extension.load(
        "jaxext_ops", [ops.SOURCE], partition={"jaxext_mul_constant": "..., -> ..."}
    )
    assert ext.jaxext_mul_constant.partition == "..., -> ..."
    assert ext.jaxext_linear_forward.partition is None


def test_rule_on_one_device_gives_the_kernel_result(cpp_builds):
    # No mesh: the rule changes nothing (the call runs whole).
    x = jnp.arange(6.0).reshape(2, 3)
    out = ops.extension().jaxext_mul_constant(
        x, np.float32(3.0), result_shape_dtypes=x, partition="batch"
    )
    np.testing.assert_array_equal(out, np.arange(6.0).reshape(2, 3) * 3.0)
