"""The `python -m jaxext` main job: environment report, opcheck tables, training demo."""

from __future__ import annotations

import pathlib
import re
import sys

import jax
import numpy as np
import pytest
from helpers import importorskip_extra

import jaxext
from jaxext import __main__ as main_module
from jaxext._checks import CHECK_NAMES

importorskip_extra("optax", "demo")
importorskip_extra("sklearn", "demo")


def _accuracy_line(text: str) -> float:
    match = re.search(r"^test accuracy: (\d\.\d{4})$", text, flags=re.MULTILINE)
    assert match, f"no 'test accuracy: 0.xxxx' line in output:\n{text}"
    return float(match.group(1))


def test_main_job_prints_opcheck_tables_and_reaches_95_percent(capsys, tmp_path):
    plot = tmp_path / "curves.png"
    assert main_module.main(["--epochs", "20", "--seed", "0", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert f"jax {jax.__version__}" in out
    assert f"backend: {jax.default_backend()}" in out
    # what jaxext ships, and where rms_norm runs here
    assert "\nops: jaxext.linear, jaxext.mul_constant, jaxext.rms_norm\n" in out
    assert "\nlayers: jaxext.nnx: Linear, MulConstant, RMSNorm\n" in out
    assert "\n        jaxext.linen: Dense, MulConstant, RMSNorm\n" in out
    placement = {"tpu": "its Pallas kernels"}.get(jax.default_backend(), "plain XLA")
    assert f"\nrms_norm on {jax.default_backend()}: {placement}" in out
    guides = re.search(r"^guides \(in the repository's docs/\): (.*)$", out, flags=re.MULTILINE)
    for guide in ("guides/pallas_kernels.md", "guides/libraries.md"):
        assert guide in guides[1]
        assert (pathlib.Path(__file__).parents[1] / "docs" / guide).is_file(), guide
    for op in ("linear", "mul_constant", "rms_norm"):
        table = out.split(f"opcheck {op}\n", 1)[1].split("\n\n", 1)[0]
        rows = dict(re.findall(r"^(\w+) +(PASS|FAIL|SKIP) ", table, flags=re.MULTILINE))
        assert set(rows) == set(CHECK_NAMES), table
        assert rows["gradcheck"] == rows["vmap"] == rows["jvp"] == "PASS", table
        assert re.search(r"^\d+ PASS, 0 FAIL, \d+ SKIP$", table, flags=re.MULTILINE), table
    assert " FAIL " not in out
    assert len(re.findall(r"^epoch +\d+/20 ", out, flags=re.MULTILINE)) == 20
    assert _accuracy_line(out) >= 0.95
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_model_is_made_of_every_nnx_layer():
    from flax import nnx

    import jaxext.nnx
    from jaxext._demo import DigitsMLP

    model = DigitsMLP(hidden=8, rngs=nnx.Rngs(0))
    used = {type(module) for _, module in nnx.iter_graph(model) if isinstance(module, nnx.Module)}
    assert {jaxext.nnx.Linear, jaxext.nnx.MulConstant, jaxext.nnx.RMSNorm} <= used
    assert model(np.ones((2, 64), np.float32)).shape == (2, 10)


def test_training_is_deterministic_for_a_seed():
    from jaxext._demo import train_digits

    first = train_digits(epochs=2, seed=3)
    second = train_digits(epochs=2, seed=3)
    other = train_digits(epochs=2, seed=4)
    assert first.loss == second.loss
    assert first.test_accuracy == second.test_accuracy
    assert first.loss != other.loss


@jax.custom_vjp
def _linear_with_wrong_weight_grad(x, weight, bias=None):
    y = x @ weight.T
    return y if bias is None else y + bias


def _wrong_fwd(x, weight, bias=None):
    return _linear_with_wrong_weight_grad(x, weight, bias), (x, weight, bias)


def _wrong_bwd(residuals, g):
    x, weight, bias = residuals
    grad_bias = None if bias is None else g.sum(0)
    return g @ weight, -(g.T @ x), grad_bias  # sign error in the weight gradient


_linear_with_wrong_weight_grad.defvjp(_wrong_fwd, _wrong_bwd)


def test_failing_opcheck_exits_non_zero(capsys, monkeypatch):
    monkeypatch.setattr(jaxext, "linear", _linear_with_wrong_weight_grad)
    assert main_module.main(["--epochs", "1"]) == 1
    captured = capsys.readouterr()
    assert re.search(r"^gradcheck +FAIL ", captured.out, flags=re.MULTILINE)
    assert "FAIL gradcheck:" in captured.out
    assert "with respect to input 1" in captured.out  # the diagnostic names the weight
    assert "epoch" not in captured.out


def test_bad_option_is_refused():
    with pytest.raises(SystemExit) as exc:
        main_module.main(["--epochs", "0"])
    assert exc.value.code == 2


def test_module_entry_point_runs_help(spawn_python):
    result = spawn_python.run(
        ["-m", "jaxext", "--help"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    for option in ("--epochs", "--seed", "--plot"):
        assert option in result.stdout


def _core_dependencies() -> dict[str, str]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = pathlib.Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    names = [re.match(r"[A-Za-z0-9_.-]+", spec).group(0) for spec in project["dependencies"]]
    return {"names": names, "export": project["optional-dependencies"]["export"], "root": root}


def test_core_install_serializes_exports_as_the_quickstart_table_shows():
    deps = _core_dependencies()
    # what opcheck's export rows and Exported.serialize() import; without it they SKIP
    assert "flatbuffers" in deps["names"]
    assert [re.match(r"[\w.-]+", spec).group(0) for spec in deps["export"]] == ["flatbuffers"]
    # the quickstart's `pip install .` line names exactly what it installs
    page = (deps["root"] / "docs" / "quickstart.md").read_text()
    comment = re.search(r"^pip install \. +# jaxext, with (.+)$", page, flags=re.MULTILINE)
    assert comment, "no `pip install .  # jaxext, with ...` line in docs/quickstart.md"
    listed = re.split(r", | and ", comment.group(1))
    assert sorted(listed) == sorted(deps["names"])


def _no_opcheck(monkeypatch):
    calls = []
    monkeypatch.setattr(jaxext, "opcheck", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(main_module, "_run_opchecks", lambda: calls.append("run") or True)
    return calls


@pytest.mark.parametrize(
    ("hidden", "argv", "package"),
    [
        ("sklearn", ["--epochs", "1"], "scikit-learn"),
        ("optax", ["--epochs", "1"], "optax"),
        ("matplotlib", ["--epochs", "1", "--plot", "curves.png"], "matplotlib"),
    ],
)
def test_missing_demo_package_names_the_extra_before_any_work(
    capsys, monkeypatch, hidden, argv, package
):
    calls = _no_opcheck(monkeypatch)
    monkeypatch.setitem(sys.modules, hidden, None)  # `import <hidden>` now raises ImportError
    assert main_module.main(argv) == 2
    captured = capsys.readouterr()
    assert calls == []  # failed before the opcheck tables
    assert captured.out == ""  # nor the environment report
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err  # one line, no traceback
    assert package in lines[0]
    assert "pip install 'jaxext[demo]'" in lines[0]


def test_matplotlib_is_needed_only_with_plot(capsys, monkeypatch):
    calls = _no_opcheck(monkeypatch)
    monkeypatch.setattr(main_module, "_run_opchecks", lambda: calls.append("run") and False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main_module.main(["--epochs", "1"]) == 1  # got as far as the (failing) checks
    assert calls == ["run"]
    assert "matplotlib" not in capsys.readouterr().err


def test_help_shows_each_default(capsys):
    with pytest.raises(SystemExit) as exc:
        main_module.main(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--epochs EPOCHS training epochs (default: 20)" in text
    assert "--seed SEED init and shuffling seed (default: 0)" in text
    assert "default: no plot" in text
    assert "pip install 'jaxext[demo]'" in text


@pytest.mark.parametrize(("epochs", "words"), [(1, "1 epoch)"), (2, "2 epochs)")])
def test_epoch_count_is_singular_for_one(capsys, monkeypatch, epochs, words):
    _no_opcheck(monkeypatch)
    assert main_module.main(["--epochs", str(epochs)]) == 0
    out = capsys.readouterr().out
    assert (
        re.search(r"^training DigitsMLP .*\)$", out, flags=re.MULTILINE)
        .group(0)
        .endswith(f"(seed 0, {words}")
    )
    assert len(re.findall(rf"^epoch +\d+/{epochs} ", out, flags=re.MULTILINE)) == epochs
