"""Data parallelism across two processes: ``jax.distributed`` on CPU with gloo collectives.

Two processes (``tests/_multiprocess_worker.py``) join one JAX job over 127.0.0.1,
each with two CPU devices and half of the batch, and take one jitted SGD step of an
MLP of ``jaxext.nnx.Linear`` layers and of the same MLP on the C++
``jaxext.cpp_extension.ops.linear``. Every process must return the loss, gradients
and updated parameters of a float64 single-process step on the whole batch (plain
``jnp``). The run is bounded: both processes are killed if it overruns.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close_to_float64, in_float64, rounding_tolerance

WORKER = Path(__file__).with_name("_multiprocess_worker.py")
REPO_ROOT = WORKER.parent.parent
TIMEOUT_S = 300
BATCH, FEATURES = 16, (12, 8, 4)
LEARNING_RATE = 0.1  # the worker's
# The loss of a float32 step of this small tanh MLP against float64 (sums of up to 16 * 12
# terms); assert_close_to_float64 uses the same rule for the arrays.
TOL = rounding_tolerance(np.float32, n=256)


def _has_compiler() -> bool:
    command = (os.environ.get("CXX") or "c++").split()
    return bool(command) and shutil.which(command[0]) is not None


MODELS = ["nnx", "cpp"] if _has_compiler() else ["nnx"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs():
    rng = np.random.default_rng(7)

    def draw(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    sizes = list(zip(FEATURES[:-1], FEATURES[1:], strict=True))
    params = {
        f"l{i + 1}": {"kernel": draw(n, o) / np.sqrt(n), "bias": draw(o)}
        for i, (n, o) in enumerate(sizes)
    }
    return params, draw(BATCH, FEATURES[0]), draw(BATCH, FEATURES[-1])


def _reference_step(params, x, t):
    """One SGD step on the whole batch, plain ``jnp`` on one device (run in float64)."""

    def loss(params):
        h = jnp.tanh(x @ params["l1"]["kernel"] + params["l1"]["bias"])
        return jnp.mean((h @ params["l2"]["kernel"] + params["l2"]["bias"] - t) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return value, grads, jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)


def _run_two_processes(spawn_python, tmp_path, inputs):
    port = _free_port()
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    # The worker sets its own device count; other XLA flags (say, an ISA cap) stay.
    flags = env.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if "host_platform_device_count" not in f)
    env["JAXEXT_EXTENSIONS_DIR"] = str(tmp_path / "extensions")  # not the user's cache
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    outputs = [tmp_path / f"process{i}.json" for i in range(2)]
    logs = [open(tmp_path / f"process{i}.log", "w") for i in range(2)]  # noqa: SIM115
    procs = [
        spawn_python.popen(
            [str(WORKER), str(i), str(port), str(inputs), str(outputs[i]), *MODELS],
            env=env,
            cwd=REPO_ROOT,
            stdout=logs[i],
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    text = "\n".join(
        f"--- process {i}:\n{(tmp_path / f'process{i}.log').read_text()[-3000:]}" for i in range(2)
    )
    codes = [proc.returncode for proc in procs]
    assert codes == [0, 0], (
        f"worker exit codes {codes} (killed after {TIMEOUT_S} s if negative)\n{text}"
    )
    return [json.loads(out.read_text()) for out in outputs]


@pytest.fixture(scope="module")
def run(tmp_path_factory, spawn_python):
    pytest.importorskip("flax")
    tmp_path = tmp_path_factory.mktemp("multiprocess")
    params, x, t = _inputs()
    inputs = tmp_path / "inputs.npz"
    flat = {f"{layer}.{name}": a for layer, p in params.items() for name, a in p.items()}
    np.savez(inputs, x=x, t=t, **flat)
    reference = in_float64(_reference_step, params, x, t)
    return _run_two_processes(spawn_python, tmp_path, inputs), reference


def _assert_tree_close(result, reference, what):
    """A worker's float32 JSON tree (nested lists) against the float64 reference tree."""
    leaves, tree = jax.tree.flatten(result, is_leaf=lambda a: isinstance(a, list))
    assert tree == jax.tree.structure(reference), what
    for (key, expected), leaf in zip(jax.tree.leaves_with_path(reference), leaves, strict=True):
        actual = np.asarray(leaf, np.float32)  # the worker's float32 values, exactly
        assert_close_to_float64(actual, expected, n=256, err_msg=f"{what} {key}")


def test_two_processes_form_one_job_of_four_devices(run):
    results, _ = run
    assert [r["process_id"] for r in results] == [0, 1]
    for r in results:
        assert (r["process_count"], r["device_count"], r["local_device_count"]) == (2, 4, 2)
        assert r["x_sharding"] == str(jax.sharding.PartitionSpec("data", None))


@pytest.mark.parametrize("model", ["nnx", "cpp"])
def test_data_parallel_step_matches_single_process_float64(run, model):
    if model not in MODELS:
        pytest.skip("no C++ compiler ($CXX or c++) to build jaxext.cpp_extension.ops")
    results, (loss_1, grads_1, new_1) = run
    for r in results:
        result = r["models"][model]
        assert "error" not in result, f"process {r['process_id']} raised:\n{result['error']}"
        assert result["loss"] == pytest.approx(float(loss_1), rel=TOL)
        _assert_tree_close(result["grads"], grads_1, "gradient")
        _assert_tree_close(result["params"], new_1, "updated parameter")
    # The gradients are not vanishingly small: the step's comparison is not vacuous.
    assert min(float(np.max(np.abs(g))) for g in jax.tree.leaves(grads_1)) > 1e-2
