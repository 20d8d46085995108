"""Repository-wide pytest setup, for the tests and the doctests in ``jaxext/`` alike."""

from __future__ import annotations

import collections

import pytest

# The slowest tests (C++ builds, notebook runs, several processes, the docs site build), marked
# `slow` here in one place; `python -m pytest -m "not slow"` is the quick subset (README).
# tests/test_examples.py marks its slow tests itself.
_SLOW_FILES = (
    "tests/test_cpp_extension.py",
    "tests/test_multiprocess.py",
    "tests/test_sharding.py",
)
_SLOW_TESTS = (
    "tests/test_notebook.py::test_notebook_executes",
    "tests/test_docs.py::test_page_code_runs",
    "tests/test_readme.py::test_single_host_sharding_recipe_runs_on_8_cpu_devices",
)


def pytest_collection_modifyitems(config, items):
    del config
    for item in items:
        node = item.nodeid.split("[")[0]
        slow = (
            node.split("::")[0] in _SLOW_FILES
            or node in _SLOW_TESTS
            # test_docs.py: every test that needs the built site
            or (node.startswith("tests/test_docs.py::") and "site" in item.fixturenames)
        )
        if slow:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def _cpp_extensions_in_a_temporary_directory(tmp_path_factory):
    """``jaxext.cpp_extension`` builds go to a session directory, not the user's cache.

    Set through the environment, so the notebook kernels the suite starts inherit it.
    """
    with pytest.MonkeyPatch.context() as patch:
        root = tmp_path_factory.mktemp("cpp_extensions")
        patch.setenv("JAXEXT_EXTENSIONS_DIR", str(root))
        yield root


def _skip_reason(report: pytest.TestReport) -> str:
    """Why a test was skipped, without the file and line pytest prepends."""
    longrepr = report.longrepr  # (path, lineno, "Skipped: reason") for a skip
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ").strip()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Ends the run with the skipped tests counted by reason, one line per reason.

    (pytest's own `-r` summary lists a line per test location: the PyTorch parity tests alone,
    without torch, would fill a screen with the same reason.)
    """
    del exitstatus, config
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons = collections.Counter(_skip_reason(report) for report in skipped)
    terminalreporter.section("skipped tests, by reason")
    for reason, count in sorted(reasons.items(), key=lambda rc: (-rc[1], rc[0])):
        terminalreporter.write_line(f"{count:5d}  {reason}")
