"""The documentation site builds offline with warnings as errors and documents every public name.

The build runs ``mkdocs build --strict`` (see README, Development) in a subprocess whose sockets
refuse to connect, so a plugin that reaches for the network fails the test instead of hanging.
Strict mode turns every warning into an error: a broken link or cross-reference, an API entry
for a name that does not exist, a docstring griffe cannot parse, a page missing from the nav.
"""

from __future__ import annotations
import __future__

import importlib
import importlib.util
import os
import pkgutil
import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from types import ModuleType
from urllib.parse import unquote, urlsplit

import pytest
from helpers import importorskip_extra

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
PAGES_WITH_CODE = [
    "index.md",
    "quickstart.md",
    "guides/flax_layers.md",
    "guides/scaling_out.md",
    "guides/writing_ops.md",
    "guides/cpp_extension.md",
    "guides/libraries.md",
    "guides/pallas_kernels.md",
]
# Pages whose examples need optional packages (the `libs` extra): skipped without them.
PAGE_NEEDS = {"guides/libraries.md": ("equinox", "diffrax", "optax")}
_BLOCK = re.compile(r"(<!-- not-run:[^>]*-->\n)?```python\n(.*?)```", flags=re.DOTALL)


@pytest.fixture(scope="module")
def site(tmp_path_factory, docs_build) -> Path:
    out = tmp_path_factory.mktemp("docs") / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    result = docs_build.run(
        ["-c", _OFFLINE_MKDOCS, "build", "--strict", "--site-dir", str(out)],
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


def _docstrings() -> dict[str, str]:
    """The docstring of every public name and of each public member of its classes and modules."""
    import inspect

    docs = {}
    for name, obj in public_names().items():
        docs[name] = inspect.getdoc(obj) or ""
        if inspect.isclass(obj) or inspect.ismodule(obj):
            for member, value in vars(obj).items():
                doc = getattr(value, "__doc__", None)
                documented = inspect.isroutine(value) or isinstance(value, property)
                if documented and not member.startswith("_") and isinstance(doc, str):
                    docs[f"{name}.{member}"] = inspect.cleandoc(doc)
    return docs


# Markdown reads `2**30` in running text as `2` and a bold run up to the next `**`: the API page
# showed "230 Jacobian entries" and ten lines in bold. Code spans and doctests are left alone.
_CODE_SPAN = re.compile(r"``.*?``|`[^`\n]*`", flags=re.DOTALL)
_DOCTEST_LINE = re.compile(r"^\s*(>>>|\.\.\.)( .*)?$", flags=re.MULTILINE)
_MARKDOWN_IN_A_NUMBER = re.compile(r"\w\*{1,2}[\w(]")


def markdown_in_numbers(doc: str) -> list[str]:
    """Each ``a**b`` or ``a*b`` of ``doc``'s running text: Markdown would open emphasis there."""
    text = _CODE_SPAN.sub("``", _DOCTEST_LINE.sub("", doc))
    return [
        text[max(m.start() - 20, 0) : m.end() + 20] for m in _MARKDOWN_IN_A_NUMBER.finditer(text)
    ]


def test_markdown_in_numbers_is_found():
    assert markdown_in_numbers("up to 2**30 entries") == ["up to 2**30 entries"]
    assert markdown_in_numbers("from 2*x up") == ["from 2*x up"]
    assert not markdown_in_numbers("up to ``2**30`` or `2**22`, a **bold** word, x ** y")
    assert not markdown_in_numbers(">>> x**2\n... return s**2, s\n")


def test_docstrings_write_powers_as_code():
    found = {
        name: hits for name, doc in _docstrings().items() if (hits := markdown_in_numbers(doc))
    }
    assert not found, f"write these as code (``2**30``), or Markdown makes them bold: {found}"


def test_pages_have_no_number_cut_by_emphasis(site):
    """The built pages: no `<strong>` or `<em>` opens right after a digit (`2<strong>30`)."""
    found = {
        page.relative_to(site).as_posix(): re.findall(
            r".{0,40}\d<(?:strong|em)>.{0,40}", page.read_text()
        )
        for page in site.rglob("*.html")
    }
    found = {page: hits for page, hits in found.items() if hits}
    assert not found, found


@pytest.mark.parametrize("page", PAGES_WITH_CODE)
def test_page_code_runs(page, tmp_path, docs_build):
    for module in PAGE_NEEDS.get(page, ()):
        importorskip_extra(module, "libs")
    blocks = [code for skip, code in _BLOCK.findall((DOCS / page).read_text()) if not skip]
    assert blocks, f"{page} has no Python block to run"
    result = docs_build.run(
        ["-c", "\n".join(blocks)],
        cwd=tmp_path,  # outside the repository: jaxext comes from PYTHONPATH
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"{page}:\n{result.stderr[-3000:]}"


# --- The built site: links, anchors, titles, the API index, links out ----------------------------
# `mkdocs build --strict` checks links between Markdown pages, but not the HTML that plugins
# write (notebooks, mkdocstrings), nor anchors into it, nor the titles a plugin sets. These tests
# read the built HTML as a browser would.


class _Page(HTMLParser):
    """What a link check needs from one HTML page: its anchors, links, title and link texts."""

    _LINKING = {"a": "href", "link": "href", "script": "src", "img": "src", "iframe": "src"}

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.title = ""
        self.link_texts: list[tuple[str | None, str]] = []  # (href, text) of each <a>
        self._open_links: list[list] = []
        self._in_title = False
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("name"):
            self.ids.add(attrs["name"])
        target = attrs.get(self._LINKING.get(tag, ""))
        if target is not None:
            self.links.append(target)
        if tag == "a":
            self._open_links.append([attrs.get("href"), ""])
        self._in_title = self._in_title or tag == "title"

    def handle_endtag(self, tag):
        if tag == "a" and self._open_links:
            href, text = self._open_links.pop()
            self.link_texts.append((href, " ".join(text.split())))
        if tag == "title":
            self._in_title = False

    def handle_data(self, data):
        if self._in_title:
            self.title += data
        for link in self._open_links:
            link[1] += data


def _read_site(site: Path) -> dict[Path, _Page]:
    return {path: _Page(path.read_text(encoding="utf-8")) for path in sorted(site.rglob("*.html"))}


def broken_links(site: Path) -> list[str]:
    """Every link of every page of ``site`` to a missing file or a missing ``#fragment``.

    External links (with a scheme or a host) are not followed: the build is offline. A path
    starting with ``/`` is taken from the site's root (``404.html`` links that way).
    """
    site = site.resolve()
    pages = _read_site(site)
    problems = []
    for page, parsed in pages.items():
        where = page.relative_to(site).as_posix()
        for link in parsed.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc:
                continue
            path = unquote(parts.path)
            if not path:
                target = page
            elif path.startswith("/"):
                target = (site / path.lstrip("/")).resolve()
            else:
                target = (page.parent / path).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.is_relative_to(site) or not target.is_file():
                problems.append(f"{where}: {link!r} is no file of the site")
            elif (
                parts.fragment
                and target.suffix == ".html"
                and unquote(parts.fragment) not in pages[target].ids
            ):
                problems.append(f"{where}: {link!r} names no id of {target.name}")
    return problems


def test_link_check_finds_missing_pages_and_anchors(tmp_path):
    (tmp_path / "guides").mkdir()
    (tmp_path / "style.css").write_text("")
    (tmp_path / "index.html").write_text(
        '<link href="style.css"><h1 id="top">x</h1><a name="old"></a>'
        '<a href="#top">ok</a> <a href="#old">ok</a> <a href="guides/a.html#sec">ok</a>'
        '<a href="https://example.org/#nowhere">external</a> <a href="guides/">dir</a>'
        '<a href="#gone">1</a> <a href="guides/a.html#gone">2</a> <a href="b.html">3</a>'
        '<script src="/missing.js"></script> <a href="../outside.html">4</a>'
    )
    (tmp_path / "guides" / "a.html").write_text('<h2 id="sec">s</h2><a href="../index.html#top">')
    (tmp_path / "guides" / "index.html").write_text('<a href="a.md">5</a>')
    assert sorted(broken_links(tmp_path)) == [
        "guides/index.html: 'a.md' is no file of the site",
        "index.html: '#gone' names no id of index.html",
        "index.html: '../outside.html' is no file of the site",
        "index.html: '/missing.js' is no file of the site",
        "index.html: 'b.html' is no file of the site",
        "index.html: 'guides/a.html#gone' names no id of a.html",
    ]


def test_every_internal_link_and_anchor_resolves(site):
    problems = broken_links(site)
    assert not problems, "\n".join(problems)


def _nav_titles(nav: list) -> list[tuple[str, str]]:
    """``(title, page)`` for each page that ``nav`` in mkdocs.yml gives a title."""
    entries = []
    for item in nav:
        if isinstance(item, dict):
            for title, value in item.items():
                if isinstance(value, list):
                    entries += _nav_titles(value)
                else:
                    entries.append((title, value))
    return entries


def _site_title(page_title: str) -> str:
    return f"{page_title} - jaxext {jaxext.__version__}"


_HEADER_TOPIC = re.compile(
    r'data-md-component="header-topic">\s*<span class="md-ellipsis">\s*(.*?)\s*</span>', re.DOTALL
)


def test_page_titles_are_those_of_the_nav(site):
    """Notebooks included: their first heading must not replace the title in mkdocs.yml."""
    import yaml  # a dependency of mkdocs (and flax)

    nav = _nav_titles(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    notebooks = [page for _, page in nav if page.endswith(".ipynb")]
    assert len(notebooks) == len(list((ROOT / "notebooks").glob("*.ipynb"))), notebooks
    home = _Page((site / "index.html").read_text())
    for title, page in nav:
        url = page.rsplit(".", 1)[0] + ".html"
        html = (site / url).read_text()
        expected = f"jaxext {jaxext.__version__}" if url == "index.html" else _site_title(title)
        assert _Page(html).title == expected, page  # (the home page's is the site's name)
        assert _HEADER_TOPIC.findall(html)[-1] == title, page  # the header, once scrolled
        assert (url, title) in home.link_texts, f"{page} is not {title!r} in the sidebar"


def test_notebook_table_of_contents_is_that_of_the_rendered_headings(site):
    """A heading with a code span keeps it (mkdocs-jupyter's own TOC cut it off there)."""
    links = _Page((site / "notebooks" / "cpp_extension.html").read_text()).link_texts
    assert ("#c-kernels-in-jax-with-jaxextcpp_extension", "Skip to content") in links
    assert ("#1-the-handler", "1. The handler") in links


def test_site_shows_the_version_and_the_source(site):
    header = re.search(
        r'md-header__topic">\s*<span class="md-ellipsis">\s*(.*?)\s*</span>',
        (site / "index.html").read_text(),
    )
    assert header[1] == f"jaxext {jaxext.__version__}"
    ops = (site / "api" / "ops.html").read_text()
    assert "Source code in" in ops and "jaxext/_linear.py" in ops


def index_names() -> set[str]:
    """The public names, and those of public modules inside public packages (``.ops``)."""
    names = set(public_names())
    for path, module in _public_namespaces().items():
        for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
            if path == "jaxext" or info.name.startswith("_"):
                continue
            inner = importlib.import_module(f"{path}.{info.name}")
            names.add(inner.__name__)
            exported = getattr(inner, "__all__", None)
            assert exported is not None, f"{inner.__name__} has no __all__"
            names.update(f"{inner.__name__}.{name}" for name in exported)
    return names


def test_api_index_lists_every_public_name(site):
    assert "jaxext.cpp_extension.ops.linear" in index_names()
    listed = {text for _, text in _Page((site / "api" / "index.html").read_text()).link_texts}
    missing = sorted(index_names() - listed)
    assert not missing, f"add these to docs/api/index.md, 'Every public name': {missing}"


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


JAX = "https://docs.jax.dev/en/latest/"
FLAX = "https://flax.readthedocs.io/en/latest/api_reference/flax.nnx/"
LINEN = "https://flax-linen.readthedocs.io/en/latest/api_reference/flax.linen/"


@pytest.mark.parametrize(
    ("name", "url"),
    [
        ("jax.custom_vjp", f"{JAX}_autosummary/jax.custom_vjp.html"),
        ("jax.ffi.include_dir()", f"{JAX}_autosummary/jax.ffi.include_dir.html"),
        ("jax.lax.dot_general", f"{JAX}_autosummary/jax.lax.dot_general.html"),
        ("jax.numpy", f"{JAX}jax.numpy.html"),
        ("jax.typing.ArrayLike", f"{JAX}_autosummary/jax.typing.ArrayLike.html"),
        ("jax.errors.JaxRuntimeError", f"{JAX}jax.errors.html#jax.errors.JaxRuntimeError"),
        ("jax.custom_derivatives.Zero", f"{JAX}search.html?q=jax.custom_derivatives.Zero"),
        ("nnx.Param", f"{FLAX}variables.html#flax.nnx.Param"),
        ("flax.nnx.Linear", f"{FLAX}nn/linear.html#flax.nnx.Linear"),
        ("flax.linen.Dense", f"{LINEN}layers.html#flax.linen.Dense"),
        ("numpy.sum", None),
        ("torch.nn.Linear", None),
        ("jaxext.linear", None),
    ],
)  # fmt: skip
def test_external_docs_url(name, url):
    assert _hooks().external_url(name) == url


def test_jax_and_flax_names_link_to_their_docs(site):
    links = set(_Page((site / "api" / "nnx.html").read_text()).link_texts)
    assert (f"{FLAX}nn/linear.html#flax.nnx.Linear", "flax.nnx.Linear") in links
    links = set(_Page((site / "guides" / "writing_ops.html").read_text()).link_texts)
    assert (f"{JAX}_autosummary/jax.custom_vjp.html", "jax.custom_vjp") in links
    links = set(_Page((site / "api" / "ops.html").read_text()).link_texts)  # in signatures
    assert (f"{JAX}_autosummary/jax.typing.ArrayLike.html", "ArrayLike") in links


# --- Signatures: wrapped by a formatter that the `docs` extra installs -------------------------


def _extra(name: str) -> list[str]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["optional-dependencies"][name]


def test_docs_extra_installs_the_signature_formatter():
    """mkdocstrings-python wraps signatures only with Black or Ruff importable."""
    [ruff] = [req for req in _extra("test") if req.startswith("ruff")]
    pins = [req.split(";")[0].strip() for req in _extra("docs")]
    assert ruff in pins, f"the docs extra should pin {ruff}, as the test extra does: {pins}"


def test_build_warns_without_a_signature_formatter(monkeypatch, caplog):
    hooks = _hooks()
    assert hooks.signature_formatter() is not None  # Ruff, from the test extra
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "black" else real_find_spec(name, *a),
    )
    monkeypatch.setitem(sys.modules, "ruff.__main__", None)  # `import` raises ImportError
    assert hooks.signature_formatter() is None

    class Config(dict):
        config_file_path = str(ROOT / "mkdocs.yml")
        site_name = "jaxext"
        extra: dict = {}

    with caplog.at_level("WARNING", logger="mkdocs.plugins.jaxext_hooks"):
        hooks.on_config(Config())
    assert "no formatter for API signatures" in caplog.text  # a failure under --strict


def test_long_signatures_are_wrapped_one_parameter_a_line(site):
    signatures = re.findall(
        r'<div class="doc-signature highlight"><pre>(.*?)</pre>',
        (site / "api" / "checking.html").read_text(),
        flags=re.DOTALL,
    )
    text = [re.sub(r"<[^>]+>", "", html_) for html_ in signatures]
    [gradcheck] = [t for t in text if t.startswith("gradcheck(")]
    lines = gradcheck.strip().splitlines()
    assert len(lines) > 10, lines  # one line, clipped, without a formatter
    assert lines[1:3] == ["    func: Callable[..., Any],", "    inputs: Any,"], lines


# --- What a new reader meets: titles, the API index, the first limitation ----------------------


def _first_heading(notebook: Path) -> str:
    import json

    cells = json.loads(notebook.read_text())["cells"]
    source = "".join(next(c for c in cells if c["cell_type"] == "markdown")["source"])
    heading = next(line[2:] for line in source.splitlines() if line.startswith("# "))
    return heading.replace("`", "")  # a code span's text, as the sidebar shows it


def test_notebook_nav_titles_are_their_headings():
    """The sidebar and the page title name a notebook as its first heading does."""
    import yaml

    nav = _nav_titles(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    notebooks = [(title, page) for title, page in nav if page.endswith(".ipynb")]
    assert notebooks
    for title, page in notebooks:
        assert title == _first_heading(DOCS / page), page


def _api_index_row(page: str) -> str:
    [row] = [
        line
        for line in (DOCS / "api" / "index.md").read_text().splitlines()
        if line.startswith("| [") and f"]({page})" in line
    ]
    return row


def test_api_index_names_the_main_entries_of_each_page():
    """The table of pages says what is on them: every function of the Checking page."""
    checking = (DOCS / "api" / "checking.md").read_text()
    functions = re.findall(r"^::: (jaxext\.[a-z_]+)$", checking, flags=re.MULTILINE)
    assert functions == ["jaxext.gradcheck", "jaxext.gradgradcheck", "jaxext.opcheck"]
    row = _api_index_row("checking.md")
    assert all(f"`{name}`" in row for name in functions), row
    row = _api_index_row("writing_ops.md")
    assert "`jaxext.custom_vjp`" in row and "`jaxext.Function`" in row, row


def test_first_limitation_leads_with_what_a_beginner_needs():
    """The internals (transposition, reduced shardings) sit in a section it links to."""
    page = (DOCS / "limitations.md").read_text()
    first = page.split("\n### ")[1]
    assert first.startswith("Forward mode needs"), first[:80]
    assert "**What you need to know.**" in first.split("\n\n")[1]
    assert "reduced=" not in first and "{U:" not in first and "RuleTypeError" not in first
    assert "(#forward-mode-in-detail)" in first
    assert "\n### Forward mode, in detail\n" in page
    readme = (ROOT / "README.md").read_text()
    limitations = readme.split("\n## Limitations\n", 1)[1]
    entry = limitations.split("\n- ")[1]
    assert "transpos" not in entry and "reduced" not in entry, entry
    assert "(docs/limitations.md)" in entry, entry
