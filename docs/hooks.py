"""MkDocs hooks for the documentation site (``hooks:`` in mkdocs.yml).

- The version: ``site_name`` becomes ``jaxext <version>``, read from ``jaxext/__init__.py``
  (without importing jaxext), so every page's header and title carry it.
- Signatures: mkdocstrings-python wraps a long signature one parameter a line only when it
  can import a formatter (Black, or Ruff, which the ``docs`` extra installs); without one, each
  signature is a single clipped line and it says so only at INFO level. The build warns
  instead, so ``mkdocs build --strict`` fails.
- Notebooks: mkdocs-jupyter builds a notebook page's table of contents from a Markdown export
  that drops code spans, so a heading such as ``C++ kernels in JAX with `jaxext.cpp_extension```
  got a truncated TOC entry and an anchor that does not exist. The TOC is rebuilt here from the
  headings of the rendered page. Links between notebooks and Markdown pages (``.md``,
  ``.ipynb``) are rewritten to the pages' URLs, as MkDocs does for Markdown pages; a link may be
  written relative to the notebook's place in the repository (``notebooks/``, which works on
  GitHub and in Jupyter) or in the site. A link that resolves to no page is a warning, so
  ``mkdocs build --strict`` fails on it.
- Names of JAX and Flax (``jax.custom_vjp``, ``flax.nnx.Linear``, ``nnx.Param``) written as code
  in any page, and JAX's types in signatures (``jax.Array``, ``jax.typing.ArrayLike``), become
  links to their entries in JAX's and Flax's documentation. The build is
  offline, so the URLs are formed here by the rules of those sites rather than read from their
  ``objects.inv``; a name whose page the rules do not know links to the site's search.
"""

from __future__ import annotations

import html
import logging
import posixpath
import re
from pathlib import Path
from urllib.parse import quote, urlsplit

log = logging.getLogger("mkdocs.plugins.jaxext_hooks")

# --- the version ----------------------------------------------------------------------------

_VERSION = re.compile(r'^__version__\s*=\s*["\']([^"\']+)["\']', re.MULTILINE)


def jaxext_version(root: Path) -> str:
    """``jaxext.__version__``, read from the source as hatch reads it."""
    match = _VERSION.search((root / "jaxext" / "__init__.py").read_text(encoding="utf-8"))
    if match is None:
        raise ValueError("no `__version__ = ...` line in jaxext/__init__.py")
    return match[1]


def signature_formatter() -> str | None:
    """The formatter mkdocstrings-python will wrap signatures with (Black first, then Ruff)."""
    import importlib.util

    if importlib.util.find_spec("black") is not None:
        return "black"
    try:
        from ruff.__main__ import find_ruff_bin
    except ImportError:
        return None
    try:
        return find_ruff_bin()
    except FileNotFoundError:
        return None


def on_config(config):
    if signature_formatter() is None:
        log.warning(
            "no formatter for API signatures (Ruff or Black): each signature would be one "
            "clipped line. Install the `docs` extra, which pins Ruff: pip install '.[docs]'"
        )
    version = jaxext_version(Path(config.config_file_path).parent)
    config.site_name = f"{config.site_name} {version}"
    config.extra["version"] = version
    return config


# --- links to JAX's and Flax's documentation -------------------------------------------------

JAX_DOCS = "https://docs.jax.dev/en/latest/"
FLAX_DOCS = "https://flax.readthedocs.io/en/latest/"
LINEN_DOCS = "https://flax-linen.readthedocs.io/en/latest/"

# JAX modules with a page of their own, `jax.numpy.html`.
_JAX_MODULE_PAGES = {
    "jax.numpy",
    "jax.lax",
    "jax.export",
    "jax.ffi",
    "jax.sharding",
    "jax.random",
    "jax.tree_util",
    "jax.errors",
    "jax.distributed",
    "jax.test_util",
    "jax.custom_batching",
    "jax.nn",
    "jax.scipy",
    "jax.debug",
    "jax.dlpack",
    "jax.stages",
    "jax.typing",
}
# Modules whose functions and classes each have an `_autosummary/<name>.html` page.
_JAX_AUTOSUMMARY = _JAX_MODULE_PAGES - {"jax.errors", "jax.sharding"} | {"jax"}
# Modules documented on their page with anchors (`jax.errors.html#jax.errors.JaxRuntimeError`).
_JAX_ANCHORED = {"jax.errors", "jax.sharding"}

# flax.nnx's API reference: one page per topic, an anchor per name.
_NNX_PAGES = {
    "Module": "module",
    "Linear": "nn/linear",
    "LinearGeneral": "nn/linear",
    "Conv": "nn/linear",
    "ConvTranspose": "nn/linear",
    "Embed": "nn/linear",
    "Einsum": "nn/linear",
    "Param": "variables",
    "Variable": "variables",
    "BatchStat": "variables",
    "Cache": "variables",
    "Intermediate": "variables",
    "Rngs": "rnglib",
    "RngStream": "rnglib",
    "jit": "transforms",
    "remat": "transforms",
    "grad": "transforms",
    "value_and_grad": "transforms",
    "vmap": "transforms",
    "scan": "transforms",
    "with_partitioning": "spmd",
    "get_partition_spec": "spmd",
    "get_named_sharding": "spmd",
    "split": "graph",
    "merge": "graph",
    "state": "graph",
    "update": "graph",
}
_LINEN_PAGES = {
    "Module": "module",
    "Dense": "layers",
    "DenseGeneral": "layers",
    "Conv": "layers",
    "Embed": "layers",
}


def external_url(name: str) -> str | None:
    """The URL of ``name``'s entry in JAX's or Flax's documentation, or None for other names.

    ``name`` is written as in our docs: ``jax.custom_vjp``, ``jax.ffi.include_dir()``,
    ``flax.nnx.Linear``, ``nnx.Param``, ``flax.linen.Dense``.
    """
    name = name.removesuffix("()")
    if name.startswith("nnx."):
        name = f"flax.{name}"
    parts = name.split(".")
    if parts[0] == "jax":
        if name in _JAX_MODULE_PAGES:
            return f"{JAX_DOCS}{name}.html"
        module = next(
            (
                ".".join(parts[:i])
                for i in range(len(parts) - 1, 0, -1)
                if ".".join(parts[:i]) in _JAX_MODULE_PAGES | {"jax"}
            ),
            "jax",
        )
        first_below = parts[len(module.split("."))]
        if module == "jax" and first_below.islower() and len(parts) > 2:
            # `jax.custom_derivatives.SymbolicZero`: a module that has no API page.
            return f"{JAX_DOCS}search.html?q={quote(name)}"
        if module in _JAX_ANCHORED:
            return f"{JAX_DOCS}{module}.html#{name}"
        if module in _JAX_AUTOSUMMARY:
            return f"{JAX_DOCS}_autosummary/{name}.html"
        return f"{JAX_DOCS}search.html?q={quote(name)}"
    if parts[:2] == ["flax", "nnx"]:
        if len(parts) == 2:
            return f"{FLAX_DOCS}api_reference/flax.nnx/index.html"
        page = _NNX_PAGES.get(parts[2]) if len(parts) == 3 else None
        if page is None:
            return f"{FLAX_DOCS}search.html?q={quote(name)}"
        return f"{FLAX_DOCS}api_reference/flax.nnx/{page}.html#{name}"
    if parts[:2] == ["flax", "linen"]:
        if len(parts) == 2:
            return f"{LINEN_DOCS}api_reference/flax.linen/index.html"
        page = _LINEN_PAGES.get(parts[2]) if len(parts) == 3 else None
        if page is None:
            return f"{LINEN_DOCS}search.html?q={quote(name)}"
        return f"{LINEN_DOCS}api_reference/flax.linen/{page}.html#{name}"
    if name == "flax":
        return FLAX_DOCS
    return None


# An <a> element (left alone: its code is already a link) or a code span holding a dotted name.
_CODE_OR_LINK = re.compile(
    r"<a\b[^>]*>.*?</a>"
    r"|<code>(?P<name>(?:jax|flax|nnx)(?:\.\w+)+(?:\(\))?)</code>",
    flags=re.DOTALL,
)


def link_external_names(content: str) -> str:
    def link(match: re.Match[str]) -> str:
        name = match["name"]
        url = external_url(name) if name else None
        if url is None:
            return match[0]
        return f'<a class="jaxext-external" href="{html.escape(url)}">{match[0]}</a>'

    return _CODE_OR_LINK.sub(link, content)


# --- notebooks: table of contents and links --------------------------------------------------

_HEADING = re.compile(r'<h([1-6]) id="([^"]+)"[^>]*>(.*?)</h\1>', flags=re.DOTALL)
_ANCHOR_LINK = re.compile(r'<a class="anchor-link"[^>]*>.*?</a>', flags=re.DOTALL)
_HREF = re.compile(r'(<a\b[^>]*?\bhref=")([^"]*)(")')


def notebook_toc_tokens(content: str) -> list[dict]:
    """TOC tokens (as Python-Markdown's toc extension makes them) from rendered headings."""
    roots: list[dict] = []
    stack: list[dict] = []
    for level, anchor, inner in _HEADING.findall(content):
        token = {
            "level": int(level),
            "id": html.unescape(anchor),
            "name": _ANCHOR_LINK.sub("", inner).strip(),
            "children": [],
        }
        while stack and stack[-1]["level"] >= token["level"]:
            stack.pop()
        (stack[-1]["children"] if stack else roots).append(token)
        stack.append(token)
    return roots


def _page_link(href: str, page, config, files) -> str | None:
    """The site URL of a notebook's link to a page given as a path, or None if none is."""
    parts = urlsplit(href)
    if parts.scheme or parts.netloc or not parts.path or parts.path.startswith("/"):
        return href
    if not parts.path.endswith((".md", ".ipynb")):
        return href
    path = parts.path
    docs = Path(config.docs_dir).resolve()
    candidates = [posixpath.normpath(posixpath.join(posixpath.dirname(page.file.src_uri), path))]
    real = (Path(page.file.abs_src_path).resolve().parent / path).resolve()
    if real.is_relative_to(docs):
        candidates.append(real.relative_to(docs).as_posix())
    for candidate in candidates:
        target = files.get_file_from_path(candidate)
        if target is not None:
            url = target.url_relative_to(page.file)
            return url + (f"#{parts.fragment}" if parts.fragment else "")
    return None


def on_page_content(content, page, config, files):
    if page.file.src_uri.endswith(".ipynb"):
        from mkdocs.structure.toc import get_toc

        page.toc = get_toc(notebook_toc_tokens(content))

        def relink(match: re.Match[str]) -> str:
            href = html.unescape(match[2])
            url = _page_link(href, page, config, files)
            if url == href:
                return match[0]
            if url is None:
                log.warning(
                    "notebook %s links to %r, which is no page of the site",
                    page.file.src_uri,
                    match[2],
                )
                return match[0]
            return f"{match[1]}{html.escape(url)}{match[3]}"

        content = _HREF.sub(relink, content)
    return link_external_names(content)


# Type annotations in signatures that name JAX's or Flax's types: autorefs leaves those it
# cannot resolve (no inventory offline) as `<span title="jax.Array">Array</span>`.
_UNRESOLVED = re.compile(r'<span title="(?P<name>(?:jax|flax)\.[\w.]+)">(?P<text>[^<]*)</span>')


def on_post_page(output, page, config):
    def link(match: re.Match[str]) -> str:
        name = match["name"]
        url = external_url(name)
        # Only pages of their own: not the search, not the dtypes of jax.numpy.
        if url is None or "search.html" in url or name.startswith("jax.numpy."):
            return match[0]
        return (
            f'<a class="jaxext-external" href="{html.escape(url)}" title="{name}">'
            f"{match['text']}</a>"
        )

    return _UNRESOLVED.sub(link, output)
