"""Repository-wide pytest setup, for the tests and the doctests in ``jaxext/`` alike.

Two tiers beside the default one (README, "Set up and run the tests"):

- ``slow``: a test that spawns a Python process, compiles C++, builds the docs site or runs a
  notebook. The marker is attached by the fixtures that do those things (``spawn_python``,
  ``cpp_builds``, ``docs_build``; each adds its kind too: ``processes``, ``cpp``, ``docs``),
  so a test is slow exactly when it asks for one; a doctest is slow when it builds C++. A test
  outside the tier that starts a Python process or a compile anyway fails, naming the fixture
  to use (:func:`_slow_work_only_in_slow_tests`).
- ``exhaustive``: the rest of each parameter grid (``tests/helpers.py``'s ``grid`` keeps
  every pair of values in the default tier), engine differentials and the largest problems.

``pyproject.toml``'s ``addopts`` deselects both; ``-m "slow or exhaustive"`` runs them, and
``-m ""`` runs everything.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

# fixture name -> the markers a test that uses it gets (slow, and the kind of slow work)
_SLOW_FIXTURES: dict[str, tuple[str, ...]] = {}


def slow_fixture(*kinds: str, **fixture_kwargs):
    """``pytest.fixture`` for a fixture whose users are slow: they get ``slow`` and ``kinds``.

    A test uses a fixture when it names it, or when a fixture it uses does (pytest's fixture
    closure), so a module fixture that builds an extension marks every test that needs it.
    """

    def decorate(fn):
        _SLOW_FIXTURES[fn.__name__] = ("slow", *kinds)
        return pytest.fixture(**fixture_kwargs)(fn)

    return decorate


class PythonRunner:
    """Runs this interpreter (``sys.executable``) in a new process."""

    def run(self, args, **kwargs) -> subprocess.CompletedProcess:
        """``subprocess.run([sys.executable, *args], **kwargs)``."""
        return subprocess.run([sys.executable, *args], **kwargs)

    def popen(self, args, **kwargs) -> subprocess.Popen:
        """``subprocess.Popen([sys.executable, *args], **kwargs)``."""
        return subprocess.Popen([sys.executable, *args], **kwargs)


@slow_fixture("processes", scope="session")
def spawn_python():
    """Starts Python processes: fresh interpreters, multi-device and multi-process workers."""
    return PythonRunner()


@slow_fixture("docs", scope="session")
def docs_build():
    """Starts Python processes for the docs: the site build, notebooks, the pages' examples."""
    return PythonRunner()


@slow_fixture("cpp", scope="session")
def cpp_builds(tmp_path_factory):
    """A directory for ``jaxext.cpp_extension`` builds; the tests that compile C++ ask for it."""
    return tmp_path_factory.mktemp("cpp_builds")


# A doctest builds C++ when it loads an extension or calls a kernel of the shipped one.
_CPP_BUILD = re.compile(r"\b(load_inline|load|build)\(|cpp_extension import ops\b")


def pytest_collection_modifyitems(config, items):
    del config
    for item in items:
        names = getattr(item, "fixturenames", ())
        kinds = {kind for name in names for kind in _SLOW_FIXTURES.get(name, ())}
        if isinstance(item, pytest.DoctestItem) and any(
            _CPP_BUILD.search(example.source) for example in item.dtest.examples
        ):
            kinds |= {"slow", "cpp"}
        for kind in sorted(kinds):
            item.add_marker(kind)


# -- the guard: slow work only in slow tests ----------------------------------------------

_COMPILERS = re.compile(r"^(.*-)?(g\+\+|c\+\+|gcc|cc|clang|clang\+\+)(-[0-9.]+)?$")
_spawned: list[str] | None = None
_popen_init = subprocess.Popen.__init__


def _slow_work(args) -> str | None:
    """What a process started with ``args`` does that belongs in the slow tier, if anything."""
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    if not argv:
        return None
    program = Path(os.fsdecode(argv[0])).name
    if os.fsdecode(argv[0]) == sys.executable or program.startswith("python"):
        return "starts a Python process (use the `spawn_python` fixture)"
    probes = {"--version", "-dumpversion", "-dumpfullversion", "-v"}
    if _COMPILERS.match(program) and not probes & {os.fsdecode(a) for a in argv[1:]}:
        return "compiles C++ (use the `cpp_builds` fixture)"
    return None


def _recording_popen_init(self, args, *rest, **kwargs):
    # Only the test's own thread: a module fixture's pool of a slow test may outlive it.
    if (
        _spawned is not None
        and threading.current_thread() is threading.main_thread()
        and (what := _slow_work(args)) is not None
    ):
        _spawned.append(what)
    _popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _recording_popen_init


@pytest.fixture(autouse=True)
def _slow_work_only_in_slow_tests(request):
    """Fails a test outside the ``slow`` tier that starts a Python process or compiles C++.

    So the tier stays what it says: such a test must get there through its fixture.
    """
    global _spawned
    slow = request.node.get_closest_marker("slow") is not None
    _spawned = None if slow else []
    yield
    found, _spawned = _spawned, None
    if found:
        pytest.fail(
            f"{request.node.nodeid} is not in the `slow` tier but " + "; ".join(sorted(set(found)))
        )


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
