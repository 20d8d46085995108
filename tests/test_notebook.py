"""The notebooks are stored executed and must still run from top to bottom."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
from helpers import importorskip_extra

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
for _module in ("optax", "sklearn", "matplotlib"):
    importorskip_extra(_module, "demo")

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_every_notebook_has_its_claims_checked():
    assert [p.name for p in NOTEBOOKS] == sorted(CLAIMS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_with_outputs(path):
    nb = nbformat.read(path, as_version=4)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    assert code_cells, "notebook has no code cells"
    for cell in code_cells:
        assert cell.execution_count is not None, f"cell not executed:\n{cell.source[:200]}"
        assert cell.outputs, f"stored cell has no output:\n{cell.source[:200]}"
        assert not [o for o in cell.outputs if o.output_type == "error"]


# An absolute path of the machine that ran the notebook: a temporary file (a warning's
# location), a home directory, a virtual environment's site-packages.
_MACHINE_PATH = re.compile(r"(/tmp/|/var/folders/|/home/|/Users/|/root/|site-packages|[A-Z]:\\)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_stored_outputs_hold_no_machine_paths(path):
    nb = nbformat.read(path, as_version=4)
    found = [line for line in output_lines(nb) if _MACHINE_PATH.search(line)]
    assert not found, f"stored outputs show paths of the machine that ran them: {found[:3]}"


# What a terminal repr leaves in a stored output: colour codes (Flax's `print(module)` in a
# kernel) and memory addresses (`<function dot_general at 0x7fb1a670a020>`), which differ on
# every run and show as noise in the rendered page.
_TERMINAL_NOISE = re.compile(r"\x1b\[|0x[0-9a-fA-F]{6,}")


def terminal_noise(nb):
    """The output lines of ``nb`` holding an ANSI escape or a memory address."""
    return [line for line in output_lines(nb) if _TERMINAL_NOISE.search(line)]


def test_terminal_noise_is_found():
    cell = nbformat.v4.new_code_cell(
        outputs=[
            nbformat.v4.new_output(
                "stream", name="stdout", text="\x1b[38;2;79;201;177mLinear\x1b[0m(\nok 0x1f\n"
            ),
            nbformat.v4.new_output(
                "execute_result", data={"text/plain": "<function f at 0x7fb1a670a020>"}
            ),
        ]
    )
    nb = nbformat.v4.new_notebook(cells=[cell])
    assert terminal_noise(nb) == [
        "<function f at 0x7fb1a670a020>",
        "\x1b[38;2;79;201;177mLinear\x1b[0m(",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_stored_outputs_are_plain_and_deterministic(path):
    found = terminal_noise(nbformat.read(path, as_version=4))
    assert not found, f"stored outputs hold ANSI colours or memory addresses: {found[:3]}"


# A page of the site named as code (`docs/porting_from_pytorch.md`) rather than linked.
_PAGE_AS_CODE = re.compile(r"`[^`\n]*\.(?:md|ipynb)`")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_pages_are_linked_not_named_as_code(path):
    nb = nbformat.read(path, as_version=4)
    found = [
        match
        for cell in nb.cells
        if cell.cell_type == "markdown"
        for match in _PAGE_AS_CODE.findall(cell.source)
    ]
    assert not found, f"link these pages ([title](../docs/page.md)): {found}"


def output_lines(nb):
    """The text lines a notebook's code cells printed or displayed.

    The kernel may split one ``print`` over several stream messages (under load,
    ``'kept for d/dx:'`` then ``' [(2, 3)]\\n'``), so the messages of each stream of a
    cell are concatenated exactly as emitted before splitting into lines. Rich outputs
    contribute their ``text/plain`` lines.
    """
    lines = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        streams = {}
        for output in cell.outputs:
            if output.output_type == "stream":
                streams[output.name] = streams.get(output.name, "") + output.text
            else:
                lines += str(output.get("data", {}).get("text/plain", "")).splitlines()
        for text in streams.values():
            lines += text.splitlines()
    return lines


def test_output_lines_joins_split_stream_messages():
    stream = nbformat.v4.new_output
    cell = nbformat.v4.new_code_cell(
        outputs=[
            stream("stream", name="stdout", text="kept for d/dx:"),
            stream("stream", name="stderr", text="a warning\n"),
            stream("stream", name="stdout", text=" [(2, 3)]\nkept for d/db: []\n"),
            stream("execute_result", data={"text/plain": "Array(1., dtype=float32)"}),
        ]
    )
    nb = nbformat.v4.new_notebook(cells=[cell, nbformat.v4.new_markdown_cell("x")])
    assert output_lines(nb) == [
        "Array(1., dtype=float32)",
        "kept for d/dx: [(2, 3)]",
        "kept for d/db: []",
        "a warning",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, docs_build):
    nb = nbformat.read(path, as_version=4)
    fresh = copy.deepcopy(nb)
    for cell in fresh.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    client = nbclient.NotebookClient(
        fresh,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell

    # Whole lines, with a print split over several stream messages joined back.
    text = "\n".join(output_lines(fresh))
    CLAIMS[path.name](fresh, text)
    assert not terminal_noise(fresh), terminal_noise(fresh)[:3]  # as stored, so as rendered


def _extending_jax_claims(nb, text):
    """The tutorial's claims, re-checked on this run."""
    assert "[True, True, True]" in text  # hand-written VJP equals autodiff
    # Only what the wanted gradient needs is kept: w for d/dx, x for d/dw, nothing for d/db.
    assert "kept for d/dx: [(2, 3)]" in text
    assert "kept for d/dw: [(5, 3)]" in text
    assert "kept for d/db: []" in text
    assert "Jacobian mismatch for output 0 with respect to input 1" in text
    assert "same params: True" in text and "same output: True" in text
    # Forward mode through the hand-written backward (which jax.custom_vjp refuses).
    assert "jax.custom_vjp refuses forward mode: TypeError" in text
    assert "jvp equals autodiff: True" in text
    assert "fwd-over-rev Hessian (2, 3, 2, 3) equals autodiff: True" in text
    assert "rev-over-fwd Hessian (2, 3, 2, 3) equals autodiff: True" in text
    assert "same Hessian as flax: True" in text
    # opcheck: the built-in op passes the battery; the wrong backward fails gradcheck only.
    assert "23 PASS, 0 FAIL, 1 SKIP" in text  # unwritten_outputs: no C++ kernel
    assert "18 PASS, 1 FAIL, 5 SKIP" in text  # and no forward mode: 4 SKIPs more
    assert any(line.split()[:2] == ["gradcheck", "FAIL"] for line in text.splitlines())
    prefix = "test accuracy after 8 epochs: "
    [accuracy] = [
        float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)
    ]
    assert accuracy >= 0.9
    assert any(
        "image/png" in o.get("data", {})
        for cell in nb.cells
        if cell.cell_type == "code"
        for o in cell.outputs
    )


def _cpp_extension_claims(nb, text):
    """The C++ notebook's claims: cache reuse, values, gradients, training, the errors."""
    del nb
    assert "second load compiled again: False" in text
    assert "matches jax.nn.silu: True" in text and "vmap shape: (4, 3)" in text
    assert "grad matches autodiff of jax.nn.silu: True" in text and "jvp matches: True" in text
    assert "2 FFI calls: ['silu', 'silu_grad']" in text
    assert "gradcheck passed: True" in text and "ops.linear gradcheck: True" in text
    assert "same gradients as the jnp activation: True" in text
    assert "loss decreased: True" in text
    assert "CompileError -> oops_ext.cc:3:" in text
    assert "silu: only float32 and float64 are supported" in text
    assert "apt-get install g++" in text


CLAIMS = {
    "cpp_extension.ipynb": _cpp_extension_claims,
    "extending_jax.ipynb": _extending_jax_claims,
}
