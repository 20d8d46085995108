"""jaxext under multi-device sharding: NamedSharding, nnx.with_partitioning, shard_map.

The checks need 8 devices, and this pytest process already imported JAX with one
CPU device, so they run once in a subprocess (``tests/_sharding_worker.py``,
8 forced host devices) that writes JSON; the tests here assert on that JSON. The
references are independent: plain ``jnp`` autodiff or ``flax.nnx.Linear`` on a
single device, and plain autodiff compiled with identical shardings for the
collective counts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import rounding_tolerance, run_json_worker

WORKER = Path(__file__).with_name("_sharding_worker.py")
REPO_ROOT = WORKER.parent.parent

LINEAR_CASES = [
    "linear_explicit_single",
    "linear_explicit_replicated_bias",
    "linear_auto_single",
    "linear_auto_mlp",
    "linear_explicit_mlp_out_sharding",  # row-parallel layer: explicit axes need out_sharding
]
NNX_CASES = ["nnx_explicit", "nnx_auto", "nnx_explicit_row_out_sharding"]
SHARD_MAP_CASES = [
    "shard_map_row_vma",
    "shard_map_row_novma",
    "shard_map_column_vma",
    "shard_map_column_novma",
    "shard_map_with_mul_constant",  # replicated array constant: psum of its gradient
    "shard_map_eager",  # un-jitted shard_map: value and grad
]
# Parameters as plain JAX also accepts them, under `jax.set_mesh` with a batch-sharded
# input: never placed on the mesh (jnp arrays made outside it), replicated, resharded to
# "reduced" inside the loss, placed reduced with two microbatches' unreduced gradients
# summed (explicit axes only: auto axes have no reduced shardings); for jaxext.linear,
# jaxext.nnx.Linear and jaxext.linen.Dense, each against plain jnp or Flax's own layer.
PLACEMENTS = {
    "explicit": ("unplaced", "replicated", "reduced", "reduced_accumulate"),
    "auto": ("unplaced", "replicated"),
}
PLACEMENT_CASES = [
    f"placement_{axes}_{layer}_{placement}"
    for axes, placements in PLACEMENTS.items()
    for layer in ("linear", "nnx", "linen")
    for placement in placements
]
# jaxext.rms_norm (Pallas kernels) with its rows split: in a shard_map, and jitted on rows
# sharded over a mesh of auto axes.
RMS_NORM_CASES = ["rms_norm_shard_map", "rms_norm_rows_sharded_jit"]
FORWARD_CASES = [  # forward mode of jaxext.linear on sharded arrays, no shard_map
    "forward_explicit_eager",
    "forward_explicit_jit",
    "forward_auto_eager",
    "forward_auto_jit",
]
# per-example vmap of jaxext.linear over a batch sharded on an explicit mesh
PER_EXAMPLE_CASES = ["per_example_vmap_eager", "per_example_vmap_jit"]


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory, spawn_python):
    pytest.importorskip("flax")
    out = tmp_path_factory.mktemp("sharding") / "results.json"
    return run_json_worker(spawn_python, WORKER, out, "sharding")


def _check(results, name):
    result = results["checks"][name]
    assert "error" not in result, f"{name} raised in the worker:\n{result['error']}"
    return result


# The worker's references are one-device float64 autodiff. A float32 result of these
# small tanh MLPs (two layers, sums of up to 16 * 12 terms, forward and back) lands
# within this many float32 rounding units of it, in any summation order.
TOL = rounding_tolerance(np.float32, n=256)


def _assert_loss_close(loss_pair):
    sharded, reference = loss_pair
    assert sharded == pytest.approx(reference, rel=TOL)


def _assert_grads_close(result):
    assert result["grad_scale"] > 1e-2  # gradients are not vanishingly small
    assert result["grad_diff"] <= TOL * result["grad_scale"]


def test_worker_sees_eight_devices(worker_results):
    assert worker_results["device_count"] == 8
    assert set(worker_results["checks"]) == set(
        LINEAR_CASES
        + NNX_CASES
        + SHARD_MAP_CASES
        + FORWARD_CASES
        + PLACEMENT_CASES
        + RMS_NORM_CASES
        + PER_EXAMPLE_CASES
    )


@pytest.mark.parametrize("name", LINEAR_CASES)
def test_linear_sharded_step_matches_single_device(worker_results, name):
    result = _check(worker_results, name)
    _assert_loss_close(result["loss"])
    _assert_grads_close(result)
    assert result["update_diff"] <= TOL * result["update_scale"]
    assert result["n_devices"] == 8


@pytest.mark.parametrize("name", LINEAR_CASES)
def test_linear_gradients_keep_parameter_shardings(worker_results, name):
    result = _check(worker_results, name)
    assert result["grad_specs"] == result["plain_grad_specs"]
    assert result["grad_specs"] == result["param_specs"]


@pytest.mark.parametrize("name", LINEAR_CASES)
def test_linear_backward_adds_no_collectives(worker_results, name):
    result = _check(worker_results, name)
    assert result["collectives"] == result["plain_collectives"]
    # The data-parallel weight gradient needs a reduction: the count is not vacuous.
    assert result["plain_collectives"]["all-reduce"] >= 1


@pytest.mark.parametrize("name", PLACEMENT_CASES)
def test_placement_step_matches_single_device(worker_results, name):
    result = _check(worker_results, name)
    _assert_loss_close(result["loss"])
    _assert_grads_close(result)


@pytest.mark.parametrize("name", PLACEMENT_CASES)
def test_placement_gradients_and_collectives_match_plain(worker_results, name):
    result = _check(worker_results, name)
    assert result["grad_specs"] == result["plain_grad_specs"]
    assert result["collectives"] == result["plain_collectives"]
    assert result["plain_collectives"]["all-reduce"] >= 1  # the weight gradients' reduction
    # Within a step of two microbatches the gradients of reduced kernels are unreduced
    # over `data` (summed before the one reduction), as plain autodiff makes them.
    assert result["microbatch_unreduced"] == result["plain_microbatch_unreduced"]
    if name.endswith("reduced_accumulate"):
        assert result["microbatch_unreduced"].count(["data"]) == 2  # the two kernels


@pytest.mark.parametrize("name", NNX_CASES)
def test_nnx_with_partitioning_step_matches_single_device(worker_results, name):
    result = _check(worker_results, name)
    for layer in ("jaxext", "flax"):
        # Same Rngs: the sharded models hold the single-device model's parameters
        # (sharded and one-device initializers are separate programs: a few ulps).
        assert (
            result[layer]["param_diff"]
            <= 4 * np.finfo(np.float32).eps * (result[layer]["param_scale"])
        )
        assert result[layer]["param_specs"] == result["flax"]["param_specs"]
        _assert_loss_close(result[layer]["loss"])
        _assert_grads_close(result[layer])
    assert "'model'" in "".join(result["jaxext"]["param_specs"])


@pytest.mark.parametrize("name", NNX_CASES)
def test_nnx_gradients_and_collectives_match_flax(worker_results, name):
    result = _check(worker_results, name)
    jaxext_layer, flax_layer = result["jaxext"], result["flax"]
    assert jaxext_layer["grad_specs"] == flax_layer["grad_specs"]
    assert jaxext_layer["grad_specs"] == jaxext_layer["param_specs"]
    assert jaxext_layer["collectives"] == flax_layer["collectives"]
    assert flax_layer["collectives"]["all-reduce"] >= 1


@pytest.mark.parametrize("name", SHARD_MAP_CASES)
def test_linear_in_shard_map_matches_unsharded(worker_results, name):
    result = _check(worker_results, name)
    _assert_loss_close(result["loss"])
    _assert_grads_close(result)


# Forward mode is derived by transposing the backward, which psums the gradient of an
# input that is invariant over a mesh axis (w over `data` in the row layout, the
# replicated constant): with check_vma=True that transpose must keep the variance types,
# and on sharded arrays (explicit axes, eagerly) their shardings.
@pytest.mark.parametrize("name", SHARD_MAP_CASES + FORWARD_CASES)
def test_forward_mode_matches_unsharded(worker_results, name):
    result = _check(worker_results, name)
    _assert_loss_close(result["jvp"])
    for measure in ("jacfwd", "hvp"):
        assert result[f"{measure}_scale"] > 1e-2
        assert result[f"{measure}_diff"] <= TOL * result[f"{measure}_scale"], measure


@pytest.mark.parametrize("name", RMS_NORM_CASES)
def test_rms_norm_with_rows_split_matches_unsharded(worker_results, name):
    result = _check(worker_results, name)
    _assert_loss_close(result["loss"])
    _assert_grads_close(result)
    assert result["x_grad_spec"] == ["('data', None)"]  # x's gradient keeps x's row split
    _assert_loss_close(result["jvp"])
    for measure in ("jacfwd", "hvp"):
        assert result[f"{measure}_scale"] > 1e-2
        assert result[f"{measure}_diff"] <= TOL * result[f"{measure}_scale"], measure


@pytest.mark.parametrize("name", PER_EXAMPLE_CASES)
def test_per_example_vmap_over_a_sharded_batch_matches_unsharded(worker_results, name):
    result = _check(worker_results, name)
    _assert_grads_close(result)
    _assert_loss_close(result["jvp"])
    for measure in ("jacfwd", "hvp"):
        assert result[f"{measure}_scale"] > 1e-2
        assert result[f"{measure}_diff"] <= TOL * result[f"{measure}_scale"], measure
