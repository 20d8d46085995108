"""Tests for the engines of gradcheck's full method (``jaxext/_checks/_engines/``).

The quick and screened engines only make a check faster: each test here holds the
engines to the reference path's verdicts and reports (the same mismatches, the same
numbers), or pins what makes them faster (programs compiled once, quickly, from worker
threads; the screen that leaves out exactly the passing entries). Correct and broken
ops are written here or in ``tests/helpers.py``, independently of the checker.
"""

from __future__ import annotations

import ast
import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checker_ops import (
    BROKEN_BACKWARDS,
    CORRECT,
    elementwise_op,
    f64,
    grad_w,
    grad_x,
    make_linear,
    square_with_wrong_jvp,
)
from helpers import CompileCounter, tiered

import jaxext

# -- large problems: the full method, in chunks ---------------------------------------------


def linear_with_grad_w(change):
    """Custom_vjp linear whose ``grad_w`` is passed through ``change``."""
    return make_linear(lambda x, w, g: (grad_x(x, w, g), change(grad_w(x, w, g))))


LARGE_WRONG_GRAD_W = {
    # name -> (change to grad_w, rtol)
    "scaled_1.001": (lambda gw: gw * 1.001, 1e-4),
    "one_element_plus_1e-3": (lambda gw: gw.at[0, 0].add(1e-3), 1e-3),
    "one_element_times_1.01": (lambda gw: gw.at[5, 7].multiply(1.01), 1e-3),
}


@pytest.mark.parametrize(
    "name", tiered(sorted(LARGE_WRONG_GRAD_W), default=["one_element_times_1.01"])
)
def test_large_problem_is_checked_element_by_element(name):
    # 9000 inputs x 5600 outputs: 5e7 Jacobian entries, compared in chunks.
    change, rtol = LARGE_WRONG_GRAD_W[name]
    x, w = f64(0, (80, 60)), f64(1, (70, 60))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to random directions
        with pytest.raises(jaxext.GradcheckError) as info:
            jaxext.gradcheck(linear_with_grad_w(change), (x, w), rtol=rtol)
    err = info.value
    assert (err.kind, err.method, err.output_index, err.input_index) == ("jacobian", "full", 0, 1)
    assert err.num_checked == 5600 * 4200
    if name == "one_element_times_1.01":
        assert err.input_element == (5, 7)


def test_large_problem_correct_op_passes():
    x, w = f64(0, (80, 60)), f64(1, (70, 60))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jaxext.gradcheck(CORRECT, (x, w))


def test_dense_jacobian_over_several_tiles(monkeypatch):
    # A dense Jacobian larger than the tile: the comparison takes several passes.
    from jaxext._checks import _compare

    monkeypatch.setattr(_compare, "TILE_BYTES", 2**16)
    x, dense = f64(0, (300,)), jnp.asarray(f64(1, (300, 300)) / 17)
    assert jaxext.gradcheck(jax.nn.softmax, (x,))
    good = elementwise_op(jnp.tanh, lambda x: 1 - jnp.tanh(x) ** 2)
    assert jaxext.gradcheck(lambda x: good(dense @ x), (x,))
    bad = elementwise_op(jnp.tanh, lambda x: 1 - jnp.tanh(x) ** 2, scale=1.01)
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(lambda x: bad(dense @ x), (x,))
    assert (info.value.kind, info.value.method) == ("jacobian", "full")
    assert info.value.num_mismatched > 300 * 300 // 2


@pytest.mark.parametrize("density", [0.02, 0.3, 0.9])
def test_tile_gives_back_the_rows_of_its_chunks(density):
    # The tile holds chunks of numerical columns dense or as their nonzero entries, and
    # hands back any range of rows (merged across chunks once): the rows of the
    # columns it was given, NaN and signed zeros included.
    from jaxext._checks._engines._screened import _Tile

    rng = np.random.default_rng(int(density * 100))
    m, widths = 37, (5, 8, 1, 6)
    blocks = []
    for width in widths:
        block = rng.standard_normal((width, m)) * (rng.random((width, m)) < density)
        block[0, 3] = -0.0
        blocks.append(block)
    blocks[1][2, 4] = np.nan
    tile = _Tile(10)
    start = 10
    for block in blocks:
        tile.add(start, block)
        start += block.shape[0]
    expected = np.concatenate(blocks).T  # (m, columns)
    assert (tile.start, tile.stop) == (10, 10 + sum(widths))
    for first, stop in [(0, m), (0, 1), (5, 17), (36, 37), (12, 12)]:
        np.testing.assert_array_equal(tile.rows(first, stop), expected[first:stop])
    # The entries of the chunks held sparse, span of rows by span, in one pass.
    held = np.concatenate([np.full(width, dense is None) for _, width, dense, _ in tile.chunks])
    edges = [0, 5, 5, 17, 36, 37]
    spans = tile.entries(edges)
    for first, stop, (rows, cols, values) in zip(edges[:-1], edges[1:], spans, strict=True):
        got = np.zeros((stop - first, held.size))
        got[rows, cols] = values
        np.testing.assert_array_equal(got, np.where(held, expected[first:stop], 0.0))


def _tiny_x_linear(scale):
    """``x @ w.T`` with the gradient of ``w`` times ``scale``, for inputs ``x`` of 1e-8."""
    op = make_linear(lambda x, w, g: (grad_x(x, w, g), scale * grad_w(x, w, g)))
    return lambda x, w: op(x * 1e-8, w)


_BROKEN_LINEAR = {name: make_linear(rule) for name, (rule, _) in BROKEN_BACKWARDS.items()}

# name -> (function, inputs' shapes, modes): every kind of verdict of the full method.
SCREEN_CASES = {
    **{name: (op, ((5, 5), (5, 5)), ("rev",)) for name, op in _BROKEN_LINEAR.items()},
    "correct": (CORRECT, ((6, 5), (7, 5)), ("rev",)),
    # Gradient entries below atol: only the scaled atol of their block pair catches 2x.
    "tiny_gradient_2x": (_tiny_x_linear(2.0), ((6, 5), (7, 5)), ("rev",)),
    "tiny_gradient_correct": (_tiny_x_linear(1.0), ((6, 5), (7, 5)), ("rev",)),
    "nan_gradient": (
        make_linear(lambda x, w, g: (grad_x(x, w, g), grad_w(x, w, g).at[2, 1].set(jnp.nan))),
        ((6, 5), (7, 5)), ("rev",),
    ),
    "wrong_jvp": (lambda x, w: square_with_wrong_jvp()(x) @ w.T, ((6, 5), (7, 5)), ("rev", "fwd")),
    "correct_both_modes": (lambda x, w: jnp.tanh(x) @ w.T, ((6, 5), (7, 5)), ("rev", "fwd")),
    # A closed-over array: a constant of the compiled programs that the threads run.
    "closure_constant": (
        lambda x, w: jnp.tanh(x) @ (w * jnp.asarray(f64(9, (7, 5)))).T, ((6, 5), (7, 5)),
        ("rev", "fwd"),
    ),
    # Every output depends on every input (tiles of dense chunks, whose rows go to the
    # device), or on every entry of x (tiles of dense and sparse chunks); the others
    # above have sparse tiles only (the device screens zeros, the host the entries).
    "dense_correct": (
        lambda x, w: CORRECT(x, w) + jnp.sum(jnp.sin(x)) + jnp.sum(w**2), ((6, 5), (7, 5)),
        ("rev",),
    ),
    "dense_one_element": (
        lambda x, w: _BROKEN_LINEAR["one_element"](x, w) + jnp.sum(jnp.sin(x)) + jnp.sum(w**2),
        ((6, 5), (7, 5)), ("rev",),
    ),
    "mixed_wrong_sign": (
        lambda x, w: _BROKEN_LINEAR["wrong_sign"](x, w) + jnp.sum(jnp.sin(x)), ((6, 5), (7, 5)),
        ("rev",),
    ),
    # Two outputs, one with a tiny gradient: each block pair's scale comes from its own
    # output block's columns (the chunks' maxima per output block).
    "two_outputs_tiny_2x": (
        lambda x, w: (CORRECT(x, w), _tiny_x_linear(2.0)(x, w)), ((6, 5), (7, 5)), ("rev",),
    ),
    "two_outputs_tiny_correct": (
        lambda x, w: (_tiny_x_linear(1.0)(x, w), CORRECT(x, w)), ((6, 5), (7, 5)), ("rev",),
    ),
}  # fmt: skip


@pytest.mark.parametrize("workers", tiered([1, 3], default=[3]))
@pytest.mark.parametrize(
    "name",
    tiered(
        sorted(SCREEN_CASES),
        # dense_one_element: a refined entry (_fd_error), reported alike on every engine.
        default=["dense_one_element", "mixed_wrong_sign", "two_outputs_tiny_correct"],
    ),
)
def test_device_screen_changes_no_verdict_and_no_report(monkeypatch, name, workers):
    # Large problems are screened chunk by chunk on the device first, by worker threads;
    # small chunks and tiles here make some chunks pass the screen and others go to the
    # host comparison, and many chunks in flight at once. The reference path (plain
    # programs, no engine) gives the same verdicts and reports too.
    from jaxext._checks import _compare, _jacobians
    from jaxext._checks import _engines as _engine
    from jaxext._checks._engines import _screened

    func, shapes, modes = SCREEN_CASES[name]
    inputs = tuple(f64(seed, shape) for seed, shape in enumerate(shapes))
    monkeypatch.setattr(_jacobians, "CHUNK", 4)
    monkeypatch.setattr(_compare, "TILE_BYTES", 2**9)
    monkeypatch.setattr(_screened, "WORKERS", workers)
    reports = []
    # The host comparison alone; every chunk screened; the reference path.
    for minimum, force in ((2**62, None), (0, None), (0, "reference")):
        monkeypatch.setattr(_engine, "SCREEN_MIN_ENTRIES", minimum)
        monkeypatch.setattr(_engine, "FORCE", force)
        try:
            reports.append(jaxext.gradcheck(func, inputs, modes=modes))
        except jaxext.GradcheckError as err:
            reports.append((str(err), err.kind, err.num_mismatched, err.input_element))
    assert reports[1] == reports[0]
    assert reports[2] == reports[0]
    passes = name in {
        "correct", "correct_both_modes", "tiny_gradient_correct", "closure_constant",
        "dense_correct", "two_outputs_tiny_correct",
    }  # fmt: skip
    assert (reports[0] is True) == passes


@pytest.mark.parametrize("bounds", [((0, 37),), ((0, 10), (10, 10), (10, 30), (30, 37))])
@pytest.mark.parametrize("density", [0.02, 0.9])
def test_column_maxima_per_output_block(density, bounds):
    # The scale of each block pair comes from the chunks' largest finite |n| per column
    # and output block, taken from the chunk as the tile holds it (dense or its nonzero
    # entries): NaN and infinities left out, an empty block or a column with no entry
    # there gives 0, and the last columns count even where they are all zero.
    from jaxext._checks._engines._screened import _column_maxima, _Tile

    rng = np.random.default_rng(int(density * 100) + len(bounds))
    block = rng.standard_normal((9, 37)) * (rng.random((9, 37)) < density)
    block[1, 12], block[2, 0], block[3, 33] = np.nan, np.inf, -np.inf
    block[2, 1], block[8] = -7.5, 0.0
    packed = _Tile.pack(block)
    assert (packed[0] is None) == (density < 0.5)
    expected = np.zeros((9, len(bounds)))
    for column in range(9):
        for i, (lo, hi) in enumerate(bounds):
            for value in block[column, lo:hi]:
                if np.isfinite(value):
                    expected[column, i] = max(expected[column, i], abs(value))
    np.testing.assert_array_equal(_column_maxima(packed, bounds), expected)


@pytest.mark.parametrize("col0", [0, 7])
def test_rows_screen_leaves_out_exactly_the_entries_whose_bits_are_set(x64, col0):
    # A sparse tile's rows are screened against zeros on the device, except the entries
    # the tile holds (their bits set), which the host checks: the device must pass a
    # nonzero automatic entry exactly where its bit is set (19 columns: three bytes of
    # bits, the last one partly used), from the tile's first column on; a dense tile's
    # rows are screened against the rows sent, with the same bits.
    from jaxext._checks._engines._screened import ScreenedJacobians

    rng = np.random.default_rng(3)
    a = rng.standard_normal((6, 19)) * (rng.random((6, 19)) < 0.3)
    jac = ScreenedJacobians(lambda x: jnp.asarray(a) @ x, jnp.asarray(f64(0, (19,))))
    rows, width = jac.row_chunk, 19 - col0
    nonzero = a[:, col0:] != 0

    def clean(held, numerical=None):
        left = np.packbits(np.pad(held, ((0, rows - 6), (0, 0))), axis=1, bitorder="little")
        steps, noise = np.ones((1, width)), np.zeros((rows, 1))
        if numerical is not None:
            numerical = np.pad(numerical, ((0, rows - 6), (0, 0)))
        call = jac.reverse_screened(range(6), numerical, left, noise, steps, col0, 1e-5, 1e-3)
        block, passed = call()
        np.testing.assert_array_equal(np.asarray(block)[:6], a)  # row k: e_k^T a, exactly
        return bool(passed)

    assert nonzero.sum() > 5
    assert clean(nonzero)
    assert clean(np.ones_like(nonzero))
    assert not clean(np.zeros_like(nonzero))
    for i, j in np.argwhere(nonzero)[:5]:
        held = nonzero.copy()
        held[i, j] = False
        assert not clean(held)
        assert clean(held, a[:, col0:])  # the rows themselves, on the device
        numerical = a[:, col0:].copy()
        numerical[i, j] = 0.0
        assert not clean(np.zeros_like(nonzero), numerical)
        assert clean(~held, numerical)  # the entry that differs is left out


# Programs one full check compiles: small, the merged one (differences, VJP rows and,
# in both modes, JVP columns); screened, each alone, and the screen of forward chunks.
PROGRAMS = {
    (False, ("rev",)): 1,
    (False, ("rev", "fwd")): 1,
    (True, ("rev",)): 2,
    (True, ("rev", "fwd")): 4,
}


@pytest.mark.parametrize(("screened", "modes"), sorted(PROGRAMS))
def test_full_check_compiles_each_program_once(monkeypatch, screened, modes):
    # The programs are compiled side by side before their first call (compile_ahead),
    # with the signatures of those calls: a mismatch would compile a program twice. The
    # flat input is staged without compiling anything.
    from jaxext._checks import _engines as _engine
    from jaxext._checks._engines import _quick

    monkeypatch.setattr(_engine, "SCREEN_MIN_ENTRIES", 1 if screened else 2**62)
    inputs = (f64(0, (4, 3)), f64(1, (2, 3)))
    jaxext.linear(*inputs)  # the op's own programs, compiled outside the count
    _quick._options()  # the compiler options, probed once per process

    def op(x, w):  # a new function: nothing of it is cached
        return jaxext.linear(x, w)

    with CompileCounter() as compiles:
        assert jaxext.gradcheck(op, inputs, modes=modes, check_batched_grad=False)
    assert compiles.count == PROGRAMS[screened, modes]


@pytest.mark.parametrize("merged", [False, True])
def test_screened_programs_compute_the_same_chunks(x64, monkeypatch, merged):
    # The screen is compiled into the programs only for screened problems, and small
    # problems merge their two programs into one; all must compute the same numerical
    # and automatic chunks, bit for bit.
    from jaxext._checks import _engines as _engine
    from jaxext._checks._engines._screened import ScreenedJacobians

    monkeypatch.setattr(_engine, "MERGE_MAX_ENTRIES", 2**18 if merged else 0)

    dense = jnp.asarray(f64(1, (7, 5)))

    def f(x):
        return jnp.tanh(dense @ x[:5]) * x[5:].sum()

    x0 = jnp.asarray(f64(0, (9,)))
    lean = _engine.jacobians(f, x0, None, full=True, modes=("rev",))[1]
    screened = ScreenedJacobians(f, x0)
    assert not isinstance(lean, ScreenedJacobians) and isinstance(screened, ScreenedJacobians)
    assert (lean._both is not None, screened._both) == (merged, None)
    np.testing.assert_array_equal(lean.value(), screened.value())
    np.testing.assert_allclose(lean.value(), np.asarray(f(x0)), rtol=1e-14, atol=1e-15)
    cols, eps = range(3, 9), np.linspace(1e-6, 2e-6, 9)
    for jac in (lean, screened):
        np.testing.assert_array_equal(jac.numerical(cols, eps)[0], lean.numerical(cols, eps)[0])
        np.testing.assert_array_equal(jac.reverse(range(2, 7))[1], lean.reverse(range(2, 7))[1])
        reference = jax.grad(lambda x: f(x).sum())(x0)
        np.testing.assert_allclose(jac.vjp(np.ones(7))[1], reference, rtol=1e-14, atol=1e-15)
    block, steps, count = screened.numerical_on_device(cols, eps)()
    expected, expected_steps = lean.numerical(cols, eps)
    assert count == 6
    np.testing.assert_array_equal(np.asarray(block)[:count], expected)
    np.testing.assert_array_equal(steps[:count], expected_steps)
    assert not hasattr(lean, "numerical_on_device")  # the screened engine's alone


def test_small_problem_in_both_modes_compiles_one_program(x64):
    # A small problem checked in both modes runs its differences, VJPs and JVPs from one
    # merged program (one compilation, not three), with the values of separate programs.
    from jaxext._checks._engines._quick import QuickJacobians

    dense = jnp.asarray(f64(1, (7, 5)))

    def f(x):
        return jnp.tanh(dense @ x[:5]) * x[5:].sum()

    x0 = jnp.asarray(f64(0, (9,)))
    separate = QuickJacobians(f, x0)  # the same compiler options, programs apart
    cols, eps, u, t = range(2, 9), 1e-6, f64(2, (7,)), f64(3, (9,))
    expected = (
        separate.value(), separate.numerical(cols, eps)[0], separate.reverse(range(1, 6))[1],
        separate.forward(cols)[1], separate.vjp(u)[1], separate.jvp(t)[1],
    )  # fmt: skip
    merged = QuickJacobians(f, x0, merge=True, merge_forward=True)
    with CompileCounter() as compiles:
        got = (
            merged.value(), merged.numerical(cols, eps)[0], merged.reverse(range(1, 6))[1],
            merged.forward(cols)[1], merged.vjp(u)[1], merged.jvp(t)[1],
        )  # fmt: skip
    assert compiles.count == 1
    for a, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-12, atol=1e-14)
    jacobian = jax.jacfwd(f)(x0)
    np.testing.assert_allclose(got[3], jacobian[:, 2:].T, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got[2], jacobian[1:6], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(("size", "quick"), [(16, True), (256, False)])
def test_programs_compile_quickly_only_for_little_work(x64, monkeypatch, size, quick):
    # The programs compile with XLA's optimisations off only where they compute little:
    # with 256 inputs, f's (256, 256) intermediate, evaluated per column, is too much,
    # though the Jacobian has only 65 536 entries.
    from jaxext._checks import _engines as _engine

    works, choose = [], _engine.choose

    def spy(work, *args, **kwargs):
        works.append(work)
        return choose(work, *args, **kwargs)

    def f(x):
        return jnp.tanh(x[:, None] * x[None, :]).sum(1)

    monkeypatch.setattr(_engine, "choose", spy)
    engine, _ = _engine.jacobians(f, jnp.ones(size), None, full=True, modes=("rev",))
    assert engine.quick == quick
    # f computes size**2 entries twice (the product, its tanh), and a few vectors: at
    # least 2 size**2 entries, in 4 (n + m) evaluations.
    expected = 4 * (2 * size) * (2 * size**2)
    assert works and all(w >= expected for w in works)
    assert all((w <= _engine.QUICK_MAX_WORK) == quick for w in works)


def test_merged_program_falls_back_for_a_function_without_forward_mode(x64):
    # A plain jax.custom_vjp has no JVP: the merged program does not lower, and each
    # loop compiles alone: reverse mode works, forward mode raises as it would alone.
    from jaxext._checks._engines._quick import QuickJacobians

    @jax.custom_vjp
    def double(x):
        return 2 * x

    double.defvjp(lambda x: (2 * x, None), lambda _, g: (2 * g,))
    x0 = jnp.asarray(f64(0, (4,)))
    jac = QuickJacobians(double, x0, merge=True, merge_forward=True)
    np.testing.assert_array_equal(jac.reverse(range(4))[1], 2 * np.eye(4))
    np.testing.assert_allclose(jac.numerical(range(4), 1e-6)[0], 2 * np.eye(4), rtol=1e-8)
    assert jac._both is None
    with pytest.raises(TypeError):
        jac.forward(range(4))


def test_compiler_options_are_only_those_this_xla_accepts(monkeypatch):
    # Each set of options is probed once per process and used only where XLA accepts it
    # (JAX 0.12's XLA refuses xla_cpu_use_fusion_emitters): no program compiles with an
    # option XLA refuses, and no check pays for a refused compilation again.
    from jaxext._checks._engines import _quick

    for large in (False, True):
        options = _quick._options(large) or {}
        jax.jit(lambda x: x + 1, compiler_options=options).lower(np.float32(0)).compile()
        assert set(options) <= {*_quick._LLVM, *_quick._OLDER_EMITTERS}
        assert (set(_quick._LLVM) <= set(options)) == (not large)  # both JAX versions take it
    probes = _quick._accepted.cache_info().misses
    assert jaxext.gradcheck(jaxext.linear, (f64(0, (3, 2)), f64(1, (4, 2))))
    assert _quick._accepted.cache_info().misses == probes
    monkeypatch.setattr(_quick, "_OLDER_EMITTERS", {"xla_no_such_option_here": False})
    assert _quick._options() == _quick._LLVM
    assert _quick._options(large=True) is None
    with CompileCounter() as compiles:
        assert _quick.quick_jit(lambda x: 2 * x, quick=False)(np.arange(3.0)).tolist() == [0, 2, 4]
    assert compiles.count == 1  # the program itself: the refused option is not tried again


def _modules(package):
    """``{dotted name: parsed source}`` of every module of ``package`` (a package's
    ``__init__.py`` under the package's own name)."""
    root = pathlib.Path(package.__file__).parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = (package.__name__, *path.relative_to(root).with_suffix("").parts)
        name = ".".join(parts).removesuffix(".__init__")
        found[name] = (path, ast.parse(path.read_text()))
    return found


def test_only_choose_reads_the_engine_thresholds():
    # The engines only make a check faster; one function picks them, and it alone reads
    # the thresholds (the reference path needs none of them).
    import jaxext._checks as checks

    thresholds = {"QUICK_MAX_WORK", "MERGE_MAX_ENTRIES", "SCREEN_MIN_ENTRIES", "FORCE"}
    readers = set()
    for module, (_, tree) in _modules(checks).items():
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef):
                continue
            for node in ast.walk(function):
                name = getattr(node, "id", None) or getattr(node, "attr", None)
                if name in thresholds:
                    readers.add(f"{module.removeprefix('jaxext._checks.')}.{function.name}")
    assert readers == {"_engines.choose"}


def _private_imports(modules):
    """``"a imports b._c"`` for each private name ``_c`` that a module imports from another
    jaxext module (a submodule ``_c`` of a package is a module, not a private name; a
    package's ``__init__`` may gather its own modules' names)."""
    found = []
    for module, (path, tree) in modules.items():
        package = path.name == "__init__.py"
        for node in ast.walk(tree):  # imports inside functions count too
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + package]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "jaxext" or package:
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and f"{target}.{alias.name}" not in modules:
                    found.append(f"{module} imports {target}.{alias.name}")
    return found


def test_no_private_name_is_imported_across_jaxext_modules():
    # A name a module shares is package-public (no underscore) in the module that owns
    # it: a private one imported elsewhere is a seam crossed, and it breaks silently
    # when its owner renames it.
    assert _private_imports(_modules(jaxext)) == []


@pytest.mark.parametrize(
    ("source", "bad"),
    [
        ("from ._compare import _Tally", True),
        ("from .._compare import Tally, tolerated", False),
        ("from . import _compare", False),  # a private module, imported whole
        ("from jaxext._checks._compare import _EPS64", True),
        ("def f():\n    from ._op import _forward_mode_error", True),
        ("from jax._src import core", False),  # not jaxext's
    ],
)
def test_the_private_import_rule_itself(tmp_path, source, bad):
    path = tmp_path / "_engine.py"
    modules = {
        "jaxext._checks._engine": (path, ast.parse(source)),
        "jaxext._checks._compare": (tmp_path / "_compare.py", ast.parse("")),
    }
    assert bool(_private_imports(modules)) is bad


def test_programs_run_from_worker_threads_as_compiled(x64):
    # JAX's configuration is thread-local: a worker thread runs the executable compiled
    # in the check's thread (float64 here), and never compiles one under its own.
    import threading

    from jaxext._checks._engines._screened import ScreenedJacobians

    jac = ScreenedJacobians(lambda x: jnp.sin(x) * 3.0, jnp.asarray(f64(0, (5,))))
    call = jac.numerical_on_device(range(5), 1e-7)
    expected = jac.numerical(range(5), 1e-7)[0]
    results = {}

    def worker():
        assert not jax.config.jax_enable_x64  # a new thread has JAX's defaults
        block = call()[0]
        results["block"] = np.asarray(block)
        try:
            jac.numerical_on_device(range(5), np.full(5, 1e-7))  # bound before: allowed
            jac.forward_screened(range(5), np.zeros((1, 5)), 0.0, 0.0)  # not bound before
        except RuntimeError as err:
            results["error"] = err

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert results["block"].dtype == np.float64
    np.testing.assert_array_equal(results["block"][:5], expected)
    np.testing.assert_allclose(np.diag(results["block"][:5]), 3 * np.cos(f64(0, (5,))), rtol=1e-8)
    assert "outside the thread" in str(results["error"])


def test_directional_fallback_warns_and_says_what_it_can_miss():
    x, w = f64(0, (1024, 64)), f64(1, (32, 64))  # 67584 x 32768 entries: above the limit
    with pytest.warns(UserWarning, match="random projections.*can miss.*one wrong element"):
        assert jaxext.gradcheck(jaxext.linear, (x, w))
    rule, _ = BROKEN_BACKWARDS["wrong_sign"]
    with pytest.raises(jaxext.GradcheckError) as info, pytest.warns(UserWarning):
        jaxext.gradcheck(make_linear(rule), (x, w))
    err = info.value
    assert (err.method, err.input_index, err.output_index) == ("directional", 0, 0)
    assert err.num_mismatched == err.num_checked == 3
    assert err.numerical == pytest.approx(-err.analytical, rel=1e-6)


def test_fast_mode_forces_the_method():
    rule, _ = BROKEN_BACKWARDS["scale_1pct"]
    inputs = (f64(0, (4, 4)), f64(1, (4, 4)))
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(make_linear(rule), inputs, fast_mode=True, num_directions=2)
    assert (info.value.method, info.value.input_index, info.value.num_checked) == (
        "directional",
        1,
        2,
    )
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(make_linear(rule), inputs, fast_mode=False)
    assert info.value.method == "full"
