"""The test run ends with the skipped tests counted by reason (the root conftest.py's hook)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent


def test_skips_are_counted_by_reason_once_each(pytester: pytest.Pytester):
    pytester.makeconftest((ROOT / "conftest.py").read_text())
    pytester.makepyfile(
        test_a="""
        import pytest

        def test_one():
            pytest.importorskip("no_such_module_for_jaxext")

        @pytest.mark.parametrize("i", range(3))
        def test_many(i):
            pytest.importorskip("no_such_module_for_jaxext")

        @pytest.mark.skip(reason="needs a GPU")
        def test_gpu():
            pass

        def test_passes():
            pass
        """
    )
    result = pytester.runpytest("-rfEX", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=5)
    lines = result.stdout.lines
    start = next(i for i, line in enumerate(lines) if "skipped tests, by reason" in line)
    summary = [line for line in lines[start + 1 :] if line.strip()][:2]
    assert summary[0].split(None, 1) == [
        "4",
        "could not import 'no_such_module_for_jaxext': No module named 'no_such_module_for_jaxext'",
    ]
    assert summary[1].split(None, 1) == ["1", "needs a GPU"]
    assert not [line for line in lines if line.startswith("SKIPPED")]  # no line per test
    assert lines[-1].startswith("=") and "passed" in lines[-1]  # pytest's totals end the run


def test_slow_marker_is_registered(pytestconfig):
    markers = pytestconfig.getini("markers")
    assert any(m.startswith("slow:") for m in markers)


def test_missing_packages_of_one_extra_skip_under_one_reason():
    from helpers import importorskip_extra

    reasons = set()
    for module in ("no_such_module_for_jaxext", "another_missing_module_for_jaxext"):
        with pytest.raises(pytest.skip.Exception) as info:
            importorskip_extra(module, "libs")
        reasons.add(info.value.msg)
    assert reasons == {"needs the `libs` extra: pip install 'jaxext[libs]'"}


# Import names of the packages of pyproject.toml's optional extras, where they differ.
_IMPORT_NAMES = {"scikit-learn": "sklearn"}


def test_no_bare_importorskip_of_an_extras_package():
    """A package of the `libs` or `demo` extra is skipped through `importorskip_extra`."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    import re

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]
    packages = {
        _IMPORT_NAMES.get(name, name)
        for extra in ("libs", "demo")
        for spec in extras[extra]
        for name in [re.match(r"[\w.-]+", spec)[0]]
    }
    assert {"equinox", "sklearn", "optax"} <= packages
    bare = re.compile(r"""\bimportorskip\(\s*["'](\w+)["']\s*[,)]""")
    found = [
        f"{path.name}: {name}"
        for path in sorted((ROOT / "tests").glob("*.py"))
        for name in bare.findall(path.read_text())
        if name in packages
    ]
    assert not found, found
