"""The documentation site builds offline with warnings as errors and documents every public name.

The build runs ``mkdocs build --strict`` (see README, Development) in a subprocess whose sockets
refuse to connect, so a plugin that reaches for the network fails the test instead of hanging.
Strict mode turns every warning into an error: a broken link or cross-reference, an API entry
for a name that does not exist, a docstring griffe cannot parse, a page missing from the nav.
"""

from __future__ import annotations
import __future__

import importlib
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import jaxext

if sys.version_info < (3, 11):
    pytest.skip(
        "the docs tools pinned in the `docs` extra need Python >= 3.11", allow_module_level=True
    )

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"

# mkdocs, run with every way out to the network closed.
_OFFLINE_MKDOCS = """
import runpy, socket, sys

def _refuse(*args, **kwargs):
    raise OSError("the docs build tried to reach the network")

socket.socket.connect = socket.socket.connect_ex = _refuse
socket.create_connection = socket.getaddrinfo = _refuse
sys.argv = ["mkdocs", *sys.argv[1:]]
runpy.run_module("mkdocs", run_name="__main__", alter_sys=True)
"""

# Pages whose Python blocks this file runs (the porting guide's run in test_function.py).
# A block right after a `<!-- not-run: reason -->` line is skipped.
PAGES_WITH_CODE = ["index.md", "guides/flax_layers.md", "guides/scaling_out.md"]
_BLOCK = re.compile(r"(<!-- not-run:[^>]*-->\n)?```python\n(.*?)```", flags=re.DOTALL)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", _OFFLINE_MKDOCS, "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{log[-5000:]}"
    assert "WARNING" not in log, log[-5000:]
    return out


def _public_namespaces() -> dict[str, ModuleType]:
    """``jaxext`` and each of its public submodules that imports (``nnx``, ``linen``, ...)."""
    namespaces = {"jaxext": jaxext}
    for info in pkgutil.iter_modules(jaxext.__path__):
        if info.name.startswith("_"):
            continue
        try:
            namespaces[f"jaxext.{info.name}"] = importlib.import_module(f"jaxext.{info.name}")
        except ImportError:  # an optional dependency is missing: documented statically still
            continue
    return namespaces


def _is_public_object(value: object) -> bool:
    if isinstance(value, (ModuleType, __future__._Feature)):
        return False
    module = getattr(value, "__module__", None) or type(value).__module__
    return module.split(".")[0] == "jaxext"  # not a name imported from another library


def public_names() -> dict[str, object]:
    """Every public name, as ``{"jaxext.nnx.Linear": object}``, found by introspection."""
    names: dict[str, object] = {}
    for path, module in _public_namespaces().items():
        if path != "jaxext":
            names[path] = module
        exported = getattr(module, "__all__", None)
        if exported is None:
            exported = [n for n in dir(module) if not n.startswith("_")]
            exported = [n for n in exported if _is_public_object(getattr(module, n))]
        names.update({f"{path}.{name}": getattr(module, name) for name in exported})
    return names


def test_site_builds_offline_with_warnings_as_errors(site):
    for page in ["index.html", "api/index.html", "api/checking.html", "changelog.html"]:
        assert (site / page).is_file(), page
    assert "30-second example" in (site / "index.html").read_text()
    changelog = (site / "changelog.html").read_text()
    assert re.search(rf"<h2[^>]*>{re.escape(jaxext.__version__)}\b", changelog), "no entry for it"


def test_notebooks_are_rendered_with_their_stored_outputs(site):
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks
    for notebook in notebooks:
        page = site / "notebooks" / f"{notebook.stem}.html"
        assert page.is_file(), f"{notebook.name} is not in the site"
        html = page.read_text()
        assert "data:image/png;base64," in html or "jp-OutputArea-output" in html, notebook.name


def test_public_names_are_found():
    names = public_names()
    for expected in ["jaxext.gradcheck", "jaxext.linear", "jaxext.nnx.Linear", "jaxext.linen"]:
        assert expected in names
    assert not [n for n in names if n.split(".")[-1].startswith("_")]
    assert "jaxext.jax" not in names and "jaxext.annotations" not in names


def test_every_public_name_is_in_the_api_reference(site):
    anchors = set()
    for page in (site / "api").rglob("*.html"):
        anchors.update(re.findall(r'id="(jaxext[\w.]*)"', page.read_text()))
    missing = sorted(set(public_names()) - anchors)
    assert not missing, (
        f"public names missing from the API reference (add `::: NAME` to a docs/api page): "
        f"{missing}"
    )


@pytest.mark.parametrize("name", sorted(public_names()))
def test_every_public_name_has_a_docstring(name):
    doc = getattr(public_names()[name], "__doc__", None)  # a class's own, not inherited
    assert doc and doc.strip(), f"{name} has no docstring, so its API entry would be empty"


@pytest.mark.parametrize("page", PAGES_WITH_CODE)
def test_page_code_runs(page, tmp_path):
    blocks = [code for skip, code in _BLOCK.findall((DOCS / page).read_text()) if not skip]
    assert blocks, f"{page} has no Python block to run"
    result = subprocess.run(
        [sys.executable, "-c", "\n".join(blocks)],
        cwd=tmp_path,  # outside the repository: jaxext comes from PYTHONPATH
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"{page}:\n{result.stderr[-3000:]}"
