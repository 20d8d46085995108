"""The README's runnable Python examples still run."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest

import jaxext

README = (Path(__file__).parent.parent / "README.md").read_text()
PY_BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)


def _block_containing(marker: str) -> str:
    matches = [b for b in PY_BLOCKS if marker in b]
    assert len(matches) == 1, f"expected one README python block containing {marker!r}"
    return matches[0]


def test_quick_example_runs():
    code = _block_containing("jaxext.gradcheck(jaxext.linear, (x64, w64), eps=1e-6, atol=1e-4)")
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the first snippet a user runs prints no warning
        exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["y"].shape == (20, 30)
    assert namespace["gw"].shape == (30, 20)
    assert namespace["z"].shape == (20, 30)
    # Forward mode through the hand-written backward: linear in w, so J w = x @ w.T.
    np.testing.assert_allclose(namespace["tw"], namespace["y"], rtol=1e-5, atol=1e-5)


def test_quick_example_explains_the_float32_warning_it_avoids():
    """The README quotes gradcheck's float32 warning; the quote must match what it says."""
    x = np.ones((2, 3), np.float32)
    with pytest.warns(UserWarning) as caught:
        jaxext.gradcheck(lambda x: x * 2.0, (x,))
    message = str(caught[0].message)
    quoted = re.search(r"`UserWarning: \.\.\. ([^`]*)`", README)
    assert quoted, "the README no longer quotes the warning"
    assert quoted[1] in message, (quoted[1], message)


def test_writing_your_own_op_example_runs_and_its_hessian_is_right():
    code = _block_containing("def scaled_sin(x, scale):")
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    x = np.arange(3.0)
    np.testing.assert_allclose(namespace["h"], np.diag(-2.0 * np.sin(x)), rtol=1e-5, atol=1e-6)


def test_single_host_sharding_recipe_runs_on_8_cpu_devices(spawn_python):
    code = _block_containing("xla_force_host_platform_device_count=8")
    check = (
        "\nassert len(jax.devices()) == 8"
        "\nassert loss.shape == ()"
        "\nassert grads['l1']['kernel'][...].shape == (12, 8)"
        "\nprint('recipe ok', float(loss))"
    )
    result = spawn_python.run(
        ["-c", code + check],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "recipe ok" in result.stdout


def test_no_unexplained_jargon():
    """ "The seeds'" meant PyTorch's *Extending PyTorch* note's examples; say so instead."""
    root = Path(__file__).parent.parent
    for path in [root / "README.md", *sorted((root / "notebooks").glob("*.ipynb"))]:
        assert "seeds'" not in path.read_text().lower(), path.name


def test_rms_norm_example_runs_and_matches_a_float64_reference():
    code = _block_containing("jaxext.rms_norm(x, weight)")
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    x = np.asarray(namespace["x"], np.float64)
    weight = np.asarray(namespace["weight"], np.float64)
    inv = 1.0 / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(namespace["y"], x * inv * weight, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(namespace["gw"], np.sum(x * inv, axis=0), rtol=1e-5, atol=1e-5)


ROOT = Path(__file__).parent.parent
# Each front page, with how it links a guide.
FRONT_PAGES = {"README.md": "docs/guides/", "docs/index.md": "guides/"}


@pytest.mark.parametrize("page", sorted(FRONT_PAGES))
def test_front_pages_show_every_op_and_layer_and_link_the_guides(page):
    import jaxext.linen
    import jaxext.nnx

    text = (ROOT / page).read_text()
    for op in ("jaxext.linear", "jaxext.mul_constant", "jaxext.rms_norm"):
        assert f"`{op}`" in text, (page, op)
    for namespace in (jaxext.nnx, jaxext.linen):
        layers = [n for n in namespace.__all__ if isinstance(getattr(namespace, n), type)]
        assert layers, namespace
        for name in layers:  # `jaxext.nnx.RMSNorm`, or `MulConstant` "for both APIs"
            assert re.search(rf"`({re.escape(namespace.__name__)}\.)?{name}`", text), (page, name)
    # where rms_norm runs: plain XLA on CPU, the Pallas kernels on GPU and TPU
    assert re.search(r"plain XLA\s+on\s+CPU", text) and 'implementation="interpret"' in text, page
    for guide in ("pallas_kernels.md", "libraries.md"):
        assert f"]({FRONT_PAGES[page]}{guide})" in text, (page, guide)
    # the main job's opcheck tables, rms_norm's included
    assert re.search(r"opcheck[^.]*\(`linear`,\s+`mul_constant`,\s+`rms_norm`\)", text), page
