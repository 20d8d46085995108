"""Every example runs when pasted alone into a fresh interpreter.

The examples are the ``>>>`` doctests of every docstring in ``jaxext`` (public and private
modules) and the fenced ``python`` blocks of the README and of every page under ``docs/``.
Each one runs in its own new ``python`` process, started outside the repository with only
``PYTHONPATH`` pointing at it, so an example that leans on a name, an import or a setting made
elsewhere (its module's namespace, an earlier block, another example) fails here even when the
doctest run in its module's namespace (``--doctest-modules``) passes. Doctests are run by
``doctest`` in that process with empty globals, so their printed outputs are checked too.

Markers, HTML comments (invisible on the site) on the lines right before a fenced block:

- ``<!-- not-run: reason -->``: not run (it needs a GPU, several hosts, illustrative paths).
- ``<!-- example: NAME -->``: names the block, for ``builds-on``.
- ``<!-- builds-on: previous -->`` or ``<!-- builds-on: NAME, NAME2 -->``: the block continues
  the page's previous ``python`` block, or the ones named, which are run first in the same
  process (with, in page order, the blocks those build on). Nothing else is shared.

The processes run a few at a time; the tests are in the ``slow`` tier (the ``docs_build``
fixture starts them).
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import os
import pkgutil
import re
import shutil
import subprocess
import textwrap
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

import jaxext

ROOT = Path(__file__).resolve().parent.parent
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
WORKERS = max(1, min(4, os.cpu_count() or 1))
TIMEOUT_S = 600

_FENCE = re.compile(
    r"^(?P<indent> *)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S
)
_MARKER = re.compile(r"^<!--\s*(?P<kind>[\w-]+):\s*(?P<arg>[^>]*?)\s*-->$")
_MARKER_KINDS = ("not-run", "example", "builds-on")

# Run in the fresh process for a docstring: the docstring comes on stdin.
_DOCTEST_MAIN = """
import doctest, sys
name, filename, lineno = sys.argv[1], sys.argv[2], int(sys.argv[3])
test = doctest.DocTestParser().get_doctest(
    sys.stdin.read(), {"__name__": "__main__"}, name, filename, lineno
)
runner = doctest.DocTestRunner()
runner.run(test)
sys.exit(1 if runner.failures else 0)
"""


@dataclasses.dataclass(frozen=True)
class Example:
    """One example: ``id`` names where it is (``README.md:42``, ``jaxext.linear``)."""

    id: str
    kind: str  # "markdown" or "doctest"
    code: str  # the Python source, or the docstring for a doctest
    filename: str = ""
    lineno: int = 0
    skip: str | None = None  # why it is not run

    def __str__(self) -> str:
        return self.id


@dataclasses.dataclass(frozen=True)
class Block:
    """A fenced ``python`` block of a page, with the marker on the line before it."""

    lineno: int  # 1-based line of the opening fence
    code: str
    markers: dict[str, str]  # {"builds-on": "previous"}, ...


def markdown_blocks(text: str) -> list[Block]:
    """The page's fenced ``python`` blocks, in order."""
    blocks = []
    for fence in _FENCE.finditer(text):
        if fence["lang"] not in ("python", "py"):
            continue
        lineno = text.count("\n", 0, fence.start()) + 1
        markers = {}
        for line in reversed(text[: fence.start()].splitlines()):
            marker = _MARKER.match(line.strip())
            if not marker:
                break
            if marker["kind"] not in _MARKER_KINDS:
                raise ValueError(f"line {lineno}: unknown marker {line.strip()!r}")
            markers[marker["kind"]] = marker["arg"]
        blocks.append(Block(lineno, textwrap.dedent(fence["body"]), markers))
    return blocks


def markdown_examples(text: str, name: str) -> list[Example]:
    """One example per block of page ``name``, each with the earlier blocks it builds on."""
    blocks = markdown_blocks(text)
    named = {b.markers["example"]: b for b in blocks if "example" in b.markers}

    def with_bases(block: Block, seen: tuple[Block, ...]) -> list[Block]:
        """``block`` preceded by the blocks it builds on, each once, in page order."""
        chain = []
        for target in block.markers.get("builds-on", "").replace(",", " ").split():
            index = blocks.index(block)
            base = blocks[index - 1] if target == "previous" and index > 0 else named.get(target)
            if base is None or blocks.index(base) >= index or base in seen:
                raise ValueError(f"{name}:{block.lineno}: builds on {target!r}, not a block before")
            chain += [b for b in with_bases(base, (*seen, block)) if b not in chain]
        return sorted(chain, key=blocks.index) + [block]

    examples = []
    for block in blocks:
        chain = with_bases(block, ())
        examples.append(
            Example(
                id=f"{name}:{block.lineno}",
                kind="markdown",
                code="\n".join(b.code for b in chain),
                filename=name,
                lineno=block.lineno,
                skip=block.markers.get("not-run"),
            )
        )
    return examples


def docstring_examples() -> list[Example]:
    """The docstrings of ``jaxext``'s modules, classes and functions that hold ``>>>`` lines."""
    modules = [jaxext]
    for info in pkgutil.walk_packages(jaxext.__path__, "jaxext."):
        modules.append(importlib.import_module(info.name))
    seen, examples = set(), []
    for module in modules:
        for test in doctest.DocTestFinder().find(module):
            if not test.examples or (test.filename, test.lineno) in seen:
                continue
            seen.add((test.filename, test.lineno))
            examples.append(
                Example(
                    id=test.name,
                    kind="doctest",
                    code=test.docstring,
                    filename=test.filename,
                    lineno=test.lineno or 0,
                )
            )
    return sorted(examples, key=lambda e: e.id)


EXAMPLES = [
    *(
        e
        for p in MARKDOWN
        for e in markdown_examples(p.read_text(), p.relative_to(ROOT).as_posix())
    ),
    *docstring_examples(),
]


def run_example(docs_build, example: Example, cwd: Path) -> subprocess.CompletedProcess:
    """Runs ``example`` alone in a new interpreter, outside the repository (``docs_build``
    is the fixture that starts it)."""
    if example.kind == "doctest":
        args = ["-c", _DOCTEST_MAIN, example.id, example.filename, str(example.lineno)]
    else:
        args = ["-"]  # the block, read from stdin as if pasted
    return docs_build.run(
        args,
        input=example.code,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def _missing_requirement(example: Example) -> str | None:
    """Why this machine cannot run ``example``, if it cannot."""
    if "cpp_extension" in example.code and not shutil.which(os.environ.get("CXX", "c++")):
        return "no C++ compiler (`$CXX`, else `c++`)"
    return None


@pytest.fixture(scope="module")
def started(request, tmp_path_factory, docs_build) -> dict[str, Future]:
    """The selected examples' processes, started a few at a time as soon as the first is needed."""
    selected = [
        item.callspec.params["example"]
        for item in request.session.items
        if getattr(item, "module", None) is request.module
        and hasattr(item, "callspec")
        and "example" in item.callspec.params
    ]
    cwd = tmp_path_factory.mktemp("examples")
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        futures = {
            e.id: pool.submit(run_example, docs_build, e, cwd)
            for e in selected
            if e.skip is None and _missing_requirement(e) is None
        }
        yield futures
        for future in futures.values():
            future.cancel()


def test_examples_are_found():
    ids = [e.id for e in EXAMPLES]
    assert len(ids) == len(set(ids)), "two examples share an id"
    for expected in ["README.md:", "docs/guides/writing_ops.md:", "docs/porting_from_pytorch.md:"]:
        assert any(i.startswith(expected) for i in ids), expected
    for name in ["load_torch_linear", "torch_linear_to_params", "uniform_range", "custom_vjp"]:
        assert any(e.kind == "doctest" and e.id.endswith(name) for e in EXAMPLES), name


def test_builds_on_prepends_the_previous_blocks():
    page = textwrap.dedent(
        """\
        ```python
        a = 1
        ```

        <!-- builds-on: previous -->
        ```python
        b = a + 1
        ```

        <!-- builds-on: previous -->
        ```python
        assert b == 2
        ```

        <!-- not-run: needs a GPU -->
        ```python
        gpu()
        ```
        """
    )
    examples = markdown_examples(page, "page.md")
    assert [e.code for e in examples] == [
        "a = 1\n",
        "a = 1\n\nb = a + 1\n",
        "a = 1\n\nb = a + 1\n\nassert b == 2\n",
        "gpu()\n",
    ]
    assert [e.skip for e in examples] == [None, None, None, "needs a GPU"]
    assert [e.id for e in examples] == ["page.md:1", "page.md:6", "page.md:11", "page.md:16"]
    with pytest.raises(ValueError, match="builds on 'previous', not a block before"):
        markdown_examples("<!-- builds-on: previous -->\n```python\nx\n```\n", "p.md")
    named = "<!-- example: base -->\n```python\na = 1\n```\n\n```python\nb = 2\n```\n\n"
    named += "<!-- builds-on: base -->\n<!-- not-run: reason -->\n```python\nc = a\n```\n\n"
    named += "<!-- example: d -->\n```python\nd = 4\n```\n\n"
    named += "<!-- builds-on: d, previous, base -->\n```python\ne = a + c + d\n```\n"
    assert [e.code for e in markdown_examples(named, "p.md")] == [
        "a = 1\n",
        "b = 2\n",
        "a = 1\n\nc = a\n",
        "d = 4\n",
        "a = 1\n\nd = 4\n\ne = a + c + d\n",
    ]
    assert markdown_examples(named, "p.md")[2].skip == "reason"


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_example_runs_alone(example, started):
    if example.skip is not None:
        pytest.skip(f"marked not-run: {example.skip}")
    missing = _missing_requirement(example)
    if missing:
        pytest.skip(missing)
    result = started[example.id].result()
    if result.returncode != 0 and re.search(r"No module named '?torch'?", result.stderr):
        pytest.skip("torch is not installed (the example uses it)")
    output = (result.stdout + result.stderr)[-4000:]
    assert result.returncode == 0, f"{example.id} fails when run alone:\n{output}"


CPP_GUIDE = "docs/guides/cpp_extension.md"

_CPP_GUIDE_CHECKS = """
import numpy as np

# float64 in, float64 out, computed in double precision (float32 would be off by ~1e-7).
with jax.enable_x64(True):
    x = jnp.asarray(np.linspace(-1.0, 2.0, 7) + 1 / 3)
    assert cube(x).dtype == jnp.float64, cube(x).dtype
    np.testing.assert_allclose(cube(x), np.asarray(x) ** 3, rtol=1e-13)
    grad = jax.grad(lambda x: cube(x).sum())(x)
    np.testing.assert_allclose(grad, 3 * np.asarray(x) ** 2, rtol=1e-13)
assert cube(jnp.ones(3)).dtype == jnp.float32
# Any other dtype: refused at trace time, in Python, naming the argument, before XLA runs.
for bad in (jnp.arange(3), jnp.ones(3, jnp.bfloat16), jnp.ones(3, jnp.float16)):
    try:
        jax.jit(cube).lower(bad)
    except TypeError as error:
        assert str(error) == f"`x` must be float32 or float64; got {bad.dtype}.", str(error)
    else:
        raise AssertionError(f"{bad.dtype} was not refused")
print("guide kernel checked")
"""


def test_cpp_guide_kernel_has_float32_and_float64_paths(tmp_path, docs_build):
    """The guide's kernel: float32 and float64 handlers by dtype, a Python error otherwise,
    and the float64 path used by its gradcheck (the example itself asserts that one)."""
    page = ROOT / CPP_GUIDE
    [example] = [
        e for e in markdown_examples(page.read_text(), CPP_GUIDE) if "cube.defvjp" in e.code
    ]
    if _missing_requirement(example):
        pytest.skip(_missing_requirement(example))
    assert "cube_f64" in example.code and "gradcheck(cube, (x64,)" in example.code
    result = run_example(
        docs_build, dataclasses.replace(example, code=example.code + _CPP_GUIDE_CHECKS), tmp_path
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "guide kernel checked" in result.stdout
