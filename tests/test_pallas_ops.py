"""JAX's own Pallas ops under ``opcheck``, with ``jaxext.custom_vjp`` swapped in (issue #43).

``benchmarks/pallas_ops_tables.py`` builds the tables: JAX's GPU ``rms_norm``, ``layer_norm``
and ``mha``, its TPU ``mha_reference`` and megablox ``gmm``, in interpret mode on CPU (the
swap must come before JAX's Pallas modules are imported, so the script runs in its own
process: the slow tier), each judged against JAX's plain-JAX reference; and their buggy twins,
JAX's own forward and backward functions in a ``jaxext.custom_vjp`` whose backward is
perturbed. A correct op gets no FAIL on the platforms its kernels are written for, and a SKIP
only for the reasons verified here; each twin FAILs the gradient rows, while the faithful twin
(JAX's backward as it is) passes them. ``gmm``'s forward mode cannot run in Pallas's TPU
interpreter (it batches the backward's kernel, which the interpreter cannot run batched): its
``jvp`` rows SKIP saying so, and its twins are judged by ``gradcheck``. Flash and splash
attention's own tables are left to the script (their rows in ``HEAVY_CHECKS``, not asserted
here); their twins run here, alone (``NAME/KIND``, seconds each), judged by ``gradcheck``: flash
attention's ``jvp`` SKIPs for the same batched-grid defect, splash attention has no forward mode.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "pallas_ops_tables.py"
OPS = ("gpu_rms_norm", "gpu_layer_norm", "gpu_mha", "tpu_mha_reference", "tpu_gmm")
TWINS = ("scaled_gradient", "missing_term", "swapped_residuals")
# Ops whose twins run alone, without the op's own table (seconds per twin, not minutes).
TWINS_ALONE = ("tpu_flash_attention", "tpu_splash_attention")
TWINNED = OPS + TWINS_ALONE

# Why a correct op's row may SKIP: the reasons checked by hand (see the script's docstring).
NO_CPP_KERNEL = r"calls no C\+\+ kernel of jaxext\.cpp_extension"
# The backward is a Pallas kernel: plain JAX, the custom rules stripped, refuses it too.
PALLAS_BACKWARD = r"the backward runs but cannot be differentiated, JAX's own limit \(plain JAX"
# JAX's op raises NotImplementedError when differentiated again.
DECLARED = r"differentiating the op again is declared not implemented"
NO_FLOAT64 = r"no float64 run to compare with: in float32: the op has no float64 path"
# Pallas's TPU interpreter runs each kernel step through io_callback.
HOST_CALLBACKS = r"jax\.checkpoint does not differentiate the side effects of the op's program"
NOT_SERIALIZED = r"JAX's own limit, not the op's: .* serialization of host_callbacks"
TILE = r"does not trace with a symbolic leading dimension of input 0 .*tile size"
# Pallas's TPU interpreter's own defects (jaxext/_checks/_opcheck/_interpreter.py): a kernel
# under jax.vmap (forward mode, derived from the backward, batches it), an int64 value for a
# kernel's int32 under x64.
BATCHED_GRID = r"Pallas's TPU interpreter cannot run the op's kernel under jax\.vmap"
X64_VALUE = r"Pallas's TPU interpreter under jax_enable_x64 gives the op's kernel an int64"
# Forward mode derived from a backward JAX cannot transpose (a pallas_call), over
# forward_mode_max_outputs when evaluated once per output element.
NO_FORWARD_MODE = r"no forward mode \(jax\.jvp raises .*JAX could not transpose it"
SECOND_ORDER = ("gradgradcheck", "fwd_over_rev", "rev_over_fwd", "fwd_over_fwd")
PALLAS_SECOND_ORDER = dict.fromkeys(SECOND_ORDER, PALLAS_BACKWARD)
SKIPS = {
    "gpu_rms_norm": {"unwritten_outputs": NO_CPP_KERNEL, **PALLAS_SECOND_ORDER},
    "gpu_layer_norm": {"unwritten_outputs": NO_CPP_KERNEL, **PALLAS_SECOND_ORDER},
    "gpu_mha": {
        "unwritten_outputs": NO_CPP_KERNEL,
        **PALLAS_SECOND_ORDER,
        "low_precision": NO_FLOAT64,
    },
    "tpu_mha_reference": {
        "unwritten_outputs": NO_CPP_KERNEL,
        **dict.fromkeys(SECOND_ORDER, DECLARED),
    },
    "tpu_gmm": {
        "unwritten_outputs": NO_CPP_KERNEL,
        **dict.fromkeys(SECOND_ORDER, DECLARED),
        "jvp": BATCHED_GRID,
        "jvp_vjp": BATCHED_GRID,
        "vmap": BATCHED_GRID,
        "jit_reuse": X64_VALUE,
        "checkpoint": HOST_CALLBACKS,
        "export": NOT_SERIALIZED,
        "export_symbolic": TILE,
        "low_precision": NO_FLOAT64,
    },
}
# What lowering a kernel for an accelerator it is not written for raises.
NOT_ITS_PLATFORM = r"Compiler params for platform (gpu|tpu) cannot be used for (tpu|gpu) lowering"


@pytest.fixture(scope="module")
def tables(tmp_path_factory, spawn_python):
    """``{name: {"rows": {check: {"status", "detail"}}, "targets": [...]}}`` for each op and
    each twin (``op/kind``), as the script wrote them."""
    pytest.importorskip("jax.experimental.pallas.ops.tpu.megablox")
    out = tmp_path_factory.mktemp("pallas_ops") / "tables.json"
    twins_alone = [f"{name}/{kind}" for name in TWINS_ALONE for kind in ("faithful", *TWINS)]
    proc = spawn_python.run(
        [str(SCRIPT), "--twins", "--json", str(out), *OPS, *twins_alone],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def rows(tables, name):
    found = tables[name]
    if "error" in found:
        pytest.fail(f"{name} did not run: {found['error']}")
    return found["rows"]


# Why a twin's ``jvp`` row SKIPs, where it is not judged: the TPU interpreter's batched-grid
# defect (``gmm``, flash attention: the op's own ``jvp`` SKIPs the same), or no forward mode
# (splash attention, as the op).
JVP_SKIPS = {
    "tpu_gmm": BATCHED_GRID,
    "tpu_flash_attention": BATCHED_GRID,
    "tpu_splash_attention": NO_FORWARD_MODE,
}


def interpreted_jvp(name):
    """The gradient rows that SKIP for the reasons in ``JVP_SKIPS``, not judged there."""
    return {"jvp"} if name.split("/")[0] in JVP_SKIPS else set()


@pytest.mark.parametrize("name", OPS)
def test_a_correct_op_fails_nothing_on_its_platforms(tables, name):
    targets = set(tables[name]["targets"])
    for check, row in rows(tables, name).items():
        if row["status"] != "FAIL":
            continue
        # A kernel written for other accelerators: a true property, not a defect.
        platform = check.removeprefix("platform_")
        assert platform in ("cuda", "rocm", "tpu") and platform not in targets, (check, row)
        assert re.search(NOT_ITS_PLATFORM, row["detail"]), (check, row)


@pytest.mark.parametrize("name", OPS)
def test_a_correct_op_skips_only_for_the_verified_reasons(tables, name):
    skipped = {c: r["detail"] for c, r in rows(tables, name).items() if r["status"] == "SKIP"}
    assert set(skipped) == set(SKIPS[name]), skipped
    for check, detail in skipped.items():
        assert re.search(SKIPS[name][check], detail), (check, detail)


@pytest.mark.parametrize("name", OPS)
def test_gradients_judged_against_the_reference_and_lowered_for_the_targets(tables, name):
    found = rows(tables, name)
    for check in {"gradcheck", "jvp"} - interpreted_jvp(name):
        assert found[check]["status"] == "PASS", found[check]
        assert "match the reference's autodiff in float64" in found[check]["detail"]
    for platform in tables[name]["targets"]:
        assert found[f"platform_{platform}"]["status"] == "PASS", found[f"platform_{platform}"]
    assert found["platform_cpu"]["status"] == "PASS", found["platform_cpu"]


@pytest.mark.parametrize("name", TWINNED)
def test_the_faithful_twin_passes(tables, name):
    """The control: JAX's forward and backward in a ``jaxext.custom_vjp``, unperturbed."""
    found = rows(tables, f"{name}/faithful")
    assert {"forward_rule", "gradcheck", "jvp"} <= set(found), found
    for check, row in found.items():
        if check in interpreted_jvp(name):
            assert row["status"] == "SKIP" and re.search(JVP_SKIPS[name], row["detail"]), row
        else:
            assert row["status"] == "PASS", (check, row)


@pytest.mark.parametrize("kind", TWINS)
@pytest.mark.parametrize("name", TWINNED)
def test_a_buggy_twin_fails_the_gradient_rows(tables, name, kind):
    found = rows(tables, f"{name}/{kind}")
    assert found["forward_rule"]["status"] == "PASS", found["forward_rule"]
    for check in {"gradcheck", "jvp"} - interpreted_jvp(name):
        assert found[check]["status"] == "FAIL", (check, found[check])
        assert "against the reference" in found[check]["detail"], found[check]
    for check in interpreted_jvp(name):
        assert found[check]["status"] == "SKIP", (check, found[check])
        assert re.search(JVP_SKIPS[name], found[check]["detail"]), found[check]
