"""jaxext.cpp_extension: building, caching, registering and calling C++ XLA FFI handlers.

Each compile takes seconds, so the extensions are built once per module (fixtures)
and every test that only calls them shares those builds. The build directories are
temporary: the user's cache is never touched.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import subprocess
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CompileCounter, rand, rounding_tolerance
from ops_table import CPP_OPS, OPS_BY_NAME

import jaxext
from jaxext import cpp_extension
from jaxext.cpp_extension import _cache, ops

# -- the extension the cache/registration/error tests share -----------------------------

SCALE_SOURCE = """
// y = factor * x, and a handler that refuses negative input.
ffi::Error Scale(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y, float factor) {
  for (size_t i = 0; i < x.element_count(); ++i) y->typed_data()[i] = factor * x.typed_data()[i];
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(scale, Scale,
    ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>().Attr<float>("factor"));

ffi::Error CheckPositive(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  for (size_t i = 0; i < x.element_count(); ++i) {
    if (x.typed_data()[i] < 0)
      return ffi::Error::InvalidArgument("negative input at index " + std::to_string(i));
    y->typed_data()[i] = x.typed_data()[i];
  }
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(check_positive, CheckPositive,
    ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
"""


@pytest.fixture(autouse=True)
def _compiles(cpp_builds):
    """Every test here may build C++: an extension of its own, or the shipped kernels
    (``jaxext.cpp_extension.ops``, built on first use), so all are in the ``slow`` tier."""


@pytest.fixture(scope="module")
def build_dir(cpp_builds):
    return cpp_builds / "test_cpp_extension"


@pytest.fixture(scope="module")
def scale_ext(build_dir):
    return cpp_extension.load_inline("scale_ext", SCALE_SOURCE, build_directory=build_dir)


def _scale(ext, x, factor, vmap_method=None):
    return ext.scale(x, result_shape_dtypes=x, factor=np.float32(factor), vmap_method=vmap_method)


def _library_files(root):
    return sorted(p.relative_to(root) for p in root.rglob("*.so"))


# -- load_inline: calling under jit and vmap ---------------------------------------------


def test_load_inline_finds_handlers_and_builds(scale_ext, build_dir):
    assert scale_ext.functions == ("scale", "check_positive")
    assert scale_ext.built
    assert scale_ext.path.is_file() and scale_ext.path.is_relative_to(build_dir)
    assert scale_ext.scale.target_name.startswith("scale_ext_")  # qualified by the extension


@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (0, 2)])
def test_inline_handler_under_jit_and_vmap(scale_ext, shape):
    x = rand(0, shape)
    expected = np.float32(2.5) * x  # the same float32 product the kernel computes
    np.testing.assert_array_equal(_scale(scale_ext, jnp.asarray(x), 2.5), expected)
    np.testing.assert_array_equal(jax.jit(lambda x: _scale(scale_ext, x, 2.5))(x), expected)
    batched = np.stack([x, -x, 2 * x])
    out = jax.vmap(lambda x: _scale(scale_ext, x, 2.5, vmap_method="broadcast_all"))(batched)
    np.testing.assert_array_equal(out, np.float32(2.5) * batched)


def test_vmap_without_vmap_method_is_refused(scale_ext):
    with pytest.raises(NotImplementedError, match="vmap_method"):
        jax.vmap(lambda x: _scale(scale_ext, x, 2.0))(jnp.ones((2, 3)))


def test_handler_error_is_raised_with_its_message(scale_ext):
    x = jnp.array([1.0, 2.0, -3.0, 4.0])

    def call(x):
        return scale_ext.check_positive(x, result_shape_dtypes=x)

    np.testing.assert_array_equal(jax.jit(call)(jnp.abs(x)), jnp.abs(x))
    # XLA raises the handler's ffi::Error as JaxRuntimeError, or as the builtin
    # exception its error code maps to (INVALID_ARGUMENT: ValueError).
    for f in (call, jax.jit(call)):
        with pytest.raises(
            (jax.errors.JaxRuntimeError, ValueError), match="negative input at index 2"
        ):
            jax.block_until_ready(f(x))


def test_unknown_attribute_names_the_functions(scale_ext):
    with pytest.raises(AttributeError, match=r"no function 'scal'.*'check_positive', 'scale'"):
        _ = scale_ext.scal


# -- the build cache -------------------------------------------------------------------


def test_second_load_reuses_the_cached_build(scale_ext, build_dir):
    before = {p: os.stat(build_dir / p) for p in _library_files(build_dir)}
    again = cpp_extension.load_inline("scale_ext", SCALE_SOURCE, build_directory=build_dir)
    assert not again.built
    assert again.path == scale_ext.path
    after = {p: os.stat(build_dir / p) for p in _library_files(build_dir)}
    assert after.keys() == before.keys()
    for path, stat in after.items():  # the same file, not rewritten
        assert (stat.st_ino, stat.st_mtime_ns) == (before[path].st_ino, before[path].st_mtime_ns)
    x = jnp.arange(3.0)
    np.testing.assert_array_equal(_scale(again, x, 3.0), 3.0 * np.arange(3.0))


def test_changed_source_rebuilds_and_both_builds_stay_callable(scale_ext, build_dir):
    changed = SCALE_SOURCE.replace("factor * x.typed_data()[i]", "factor * x.typed_data()[i] + 1")
    new = cpp_extension.load_inline("scale_ext", changed, build_directory=build_dir)
    assert new.built and new.path != scale_ext.path
    assert new.scale.target_name != scale_ext.scale.target_name
    assert len(list((build_dir / "scale_ext").glob("*/scale_ext.*.so"))) == 2
    x = jnp.arange(3.0)
    np.testing.assert_array_equal(_scale(new, x, 2.0), 2.0 * np.arange(3.0) + 1)
    np.testing.assert_array_equal(_scale(scale_ext, x, 2.0), 2.0 * np.arange(3.0))


def test_the_same_extension_from_another_build_directory(scale_ext, build_dir, tmp_path):
    """Same sources, another build (here: a copy of the cache elsewhere): the handlers
    registered by the first load are returned, under the same FFI target names."""
    import shutil

    shutil.copytree(build_dir / "scale_ext", tmp_path / "scale_ext")
    again = cpp_extension.load_inline("scale_ext", SCALE_SOURCE, build_directory=tmp_path)
    assert not again.built and again.path.is_relative_to(tmp_path)
    assert again.scale.target_name == scale_ext.scale.target_name
    x = jnp.arange(3.0)
    np.testing.assert_array_equal(_scale(again, x, 3.0), 3.0 * np.arange(3.0))


def test_two_extensions_with_the_same_function_names(scale_ext, build_dir):
    other_source = SCALE_SOURCE.replace("factor * x.typed_data()[i]", "factor - x.typed_data()[i]")
    other = cpp_extension.load_inline("other_ext", other_source, build_directory=build_dir)
    assert other.functions == scale_ext.functions
    x = jnp.arange(3.0)
    f = jax.jit(lambda x: (_scale(scale_ext, x, 2.0), _scale(other, x, 2.0)))
    a, b = f(x)
    np.testing.assert_array_equal(a, 2.0 * np.arange(3.0))
    np.testing.assert_array_equal(b, 2.0 - np.arange(3.0))


def test_concurrent_builds_of_one_extension_build_once(tmp_path):
    calls, start = [], threading.Barrier(4)
    results = []

    def build(output):
        calls.append(output)
        output.write_bytes(b"library")
        return {"headers": []}

    def worker():
        start.wait()
        results.append(_cache.build_once(tmp_path / "key", "ext", build, lambda record: True))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert sorted(built for *_, built in results) == [False, False, False, True]
    # The library's file name carries the hash of its bytes.
    library = tmp_path / "key" / f"ext.{hashlib.sha256(b'library').hexdigest()[:16]}.so"
    assert {path for path, *_ in results} == {library}
    assert sorted(p.name for p in (tmp_path / "key").iterdir()) == sorted(
        [library.name, library.with_suffix(".json").name, "lock"]
    )


def test_build_directory_argument_beats_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(_cache.ENV_VAR, str(tmp_path / "env"))
    assert _cache.cache_root(None) == tmp_path / "env"
    assert _cache.cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv(_cache.ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _cache.cache_root(None) == tmp_path / "xdg" / "jaxext" / "cpp_extensions"


# -- errors a user can act on ------------------------------------------------------------


def test_compile_error_names_file_and_line(build_dir):
    source = "\n".join(
        [
            "// line 1",
            "ffi::Error Broken(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {",
            "  return undefined_name;  // line 3",
            "}",
        ]
    )
    with pytest.raises(cpp_extension.CompileError) as info:
        cpp_extension.load_inline(
            "broken_ext", source, functions="broken", build_directory=build_dir
        )
    message = str(info.value)
    assert "broken_ext.cc:3:" in message and "undefined_name" in message
    assert "broken_ext.cc:3:" in info.value.output
    assert os.path.isfile(info.value.log_path)
    assert not list((build_dir / "broken_ext").glob("*/*.so"))  # nothing half-built is kept


def test_missing_handler_symbol_is_named(scale_ext, build_dir):
    with pytest.raises(cpp_extension.MissingHandlerError, match=r"no handler symbol 'scale_v2'"):
        cpp_extension.load_inline(
            "scale_ext", SCALE_SOURCE, functions=["scale", "scale_v2"], build_directory=build_dir
        )


def test_undefined_symbol_is_an_extension_error_naming_it_and_the_flag(tmp_path, cpp_builds):
    source = """
    extern "C" double jaxext_test_not_linked(double);  // declared, defined nowhere
    ffi::Error Call(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
      for (size_t i = 0; i < x.element_count(); ++i)
        y->typed_data()[i] = static_cast<float>(jaxext_test_not_linked(x.typed_data()[i]));
      return ffi::Error::Success();
    }
    XLA_FFI_DEFINE_HANDLER_SYMBOL(call, Call,
        ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
    """
    with pytest.raises(cpp_extension.ExtensionError) as info:
        cpp_extension.load_inline("unlinked_ext", source, build_directory=tmp_path)
    message = str(info.value)
    assert "undefined symbol jaxext_test_not_linked" in message
    assert "extra_ldflags=['-lm']" in message


def test_missing_compiler_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(cpp_extension.CompilerNotFoundError, match=r"CXX=.*apt-get install g\+\+"):
        cpp_extension.load_inline("any_ext", SCALE_SOURCE, build_directory=tmp_path)


def test_sources_without_a_handler_are_refused(tmp_path):
    source = "// XLA_FFI_DEFINE_HANDLER_SYMBOL(commented_out, Impl, binding)\nint f() { return 0; }"
    with pytest.raises(ValueError, match="No handler found"):
        cpp_extension.load_inline("empty_ext", source, build_directory=tmp_path)


@pytest.mark.parametrize("name", ["", "1ext", "my-ext", "a b", "ext.so"])
def test_bad_extension_name(name, tmp_path):
    with pytest.raises(ValueError, match="`name` must be a C identifier"):
        cpp_extension.load_inline(name, SCALE_SOURCE, build_directory=tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"name": None}, TypeError, "`name` must be a string; got NoneType"),
        ({"cpp_sources": 3}, TypeError, "`cpp_sources` must be a string or a list of strings"),
        ({"functions": [1]}, TypeError, "`functions` must be a list of names"),
        ({"functions": []}, ValueError, "`functions` must name at least one handler"),
        ({"functions": ["a-b"]}, ValueError, "`functions` entries must be C identifiers"),
        ({"extra_cflags": [3]}, TypeError, "`extra_cflags` must be a list of strings"),
        ({"platform": "tpu"}, ValueError, "`platform` must be 'cpu' or 'CUDA'"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match, tmp_path):
    args = {"name": "ext", "cpp_sources": SCALE_SOURCE, "build_directory": tmp_path, **kwargs}
    with pytest.raises(error, match=match):
        cpp_extension.load_inline(**args)


def test_verbose_reports_the_cached_build(scale_ext, build_dir, capsys):
    again = cpp_extension.load_inline(
        "scale_ext", SCALE_SOURCE, build_directory=build_dir, verbose=True
    )
    assert not again.built
    assert "'scale_ext': using the cached build" in capsys.readouterr().out


def test_bad_source_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.cc"):
        cpp_extension.load("ext", [tmp_path / "nope.cc"], build_directory=tmp_path)
    (tmp_path / "kernel.py").write_text("")
    with pytest.raises(ValueError, match=r"must end in .*\.cu; got 'kernel.py'"):
        cpp_extension.load("ext", [tmp_path / "kernel.py"], build_directory=tmp_path)
    with pytest.raises(ValueError, match="`sources` must name at least one file"):
        cpp_extension.load("ext", [], build_directory=tmp_path)


# -- jaxext's ops in C++: values and gradients against float64 references ---------------

BATCH_SHAPES = [(), (1,), (7,), (2, 9), (0,)]
# (in_features, out_features): the kernels' edge cases, tiles of 4 rows x 16 columns
# (float32 AVX) and panels of 256 rows of the right operand.
FEATURES = [(3, 4), (17, 5), (1, 1), (300, 37)]


def _dot_bound(dtype, n, magnitude):
    """A rounding-error bound for a length-``n`` sum of products with these magnitudes:
    the rule of tests/helpers.py, per entry (``magnitude`` is ``|x| @ |w|``)."""
    return rounding_tolerance(dtype, n) * magnitude + np.finfo(dtype).tiny


def _assert_dot_close(actual, expected, dtype, n, magnitude):
    assert actual.dtype == dtype and actual.shape == expected.shape
    err = np.abs(np.asarray(actual, np.float64) - expected)
    bound = _dot_bound(dtype, n, magnitude)
    assert np.all(err <= bound), f"max error {err.max()} vs bound {np.max(bound)}"


def _linear_inputs(batch, features, dtype, seed=0):
    i, o = features
    return (
        rand(seed, (*batch, i), dtype),
        rand(seed + 1, (o, i), dtype),
        rand(seed + 2, (o,), dtype),
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("batch", BATCH_SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_ops_linear_forward(batch, features, dtype, with_bias, x64):
    x, w, b = _linear_inputs(batch, features, dtype)
    b = b if with_bias else None
    x64_, w64 = x.astype(np.float64), w.astype(np.float64)
    b64 = np.zeros(w.shape[0]) if b is None else b.astype(np.float64)
    expected = x64_ @ w64.T + b64
    magnitude = np.abs(x64_) @ np.abs(w64).T + np.abs(b64)
    y = jax.jit(ops.linear)(x, w, b)
    _assert_dot_close(y, expected, dtype, features[0] + 1, magnitude)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("batch", BATCH_SHAPES)
def test_ops_linear_grad(batch, features, dtype, x64):
    x, w, b = _linear_inputs(batch, features, dtype)
    ct = rand(3, (*batch, features[1]), dtype)
    grads = jax.jit(jax.grad(lambda x, w, b: jnp.sum(ops.linear(x, w, b) * ct), (0, 1, 2)))(x, w, b)
    x64_, w64, ct64 = (a.astype(np.float64) for a in (x, w, ct))
    rows = math.prod(batch)
    x2, ct2 = x64_.reshape(rows, features[0]), ct64.reshape(rows, features[1])
    expected = (ct64 @ w64, ct2.T @ x2, ct2.sum(0))
    magnitudes = (
        np.abs(ct64) @ np.abs(w64),
        np.abs(ct2).T @ np.abs(x2),
        np.abs(ct2).sum(0),
    )
    lengths = (features[1], rows, rows)
    for g, e, m, n in zip(grads, expected, magnitudes, lengths, strict=True):
        _assert_dot_close(g, e, dtype, n, m)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
# (3, 700_001): split in chunks over XLA's thread pool, the last one shorter.
@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (0, 2), (2, 3, 4), (3, 700_001)])
@pytest.mark.parametrize("constant", [2.5, -1, np.float32(0.1)])
def test_ops_mul_constant_and_grad(shape, dtype, constant, x64):
    x = rand(4, shape, dtype)
    c = dtype(float(constant))  # the kernel multiplies in x's dtype
    y = jax.jit(ops.mul_constant, static_argnums=1)(x, constant)
    assert y.dtype == dtype
    np.testing.assert_array_equal(y, x * c)  # one correctly rounded product per element
    g = jax.grad(lambda x: jnp.sum(ops.mul_constant(x, constant) * x))(x)
    # d/dx sum(c*x*x) = 2cx; each of the two terms is one correctly rounded product.
    np.testing.assert_allclose(g, 2 * x.astype(np.float64) * float(c), rtol=2 * np.finfo(dtype).eps)


@pytest.mark.parametrize("batched", ["x", "weight", "bias", "all"])
def test_ops_linear_vmap(batched, x64):
    x, w, b = _linear_inputs((4,), (5, 3), np.float64)
    n = 6
    args = {"x": x, "weight": w, "bias": b}
    in_axes = {}
    for key, value in args.items():
        if batched in (key, "all"):
            args[key] = np.stack([value * (k + 1) for k in range(n)])
            in_axes[key] = 0
        else:
            in_axes[key] = None
    axes = (in_axes["x"], in_axes["weight"], in_axes["bias"])
    inputs = (args["x"], args["weight"], args["bias"])

    def reference(x, w, b):
        return x @ w.T + b

    np.testing.assert_allclose(
        jax.vmap(ops.linear, axes)(*inputs), jax.vmap(reference, axes)(*inputs), rtol=1e-13
    )

    def loss(f):
        return lambda x, w, b: jnp.sum(jnp.sin(f(x, w, b)))

    # Per-example gradients: the C++ backward, batched, against autodiff.
    got = jax.vmap(jax.grad(loss(ops.linear), (0, 1, 2)), axes)(*inputs)
    want = jax.vmap(jax.grad(loss(reference), (0, 1, 2)), axes)(*inputs)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-12)
    # Gradient of a vmapped loss: unbatched inputs get the sum over the batch.
    got = jax.grad(lambda *a: loss(jax.vmap(ops.linear, axes))(*a), (0, 1, 2))(*inputs)
    want = jax.grad(lambda *a: loss(jax.vmap(reference, axes))(*a), (0, 1, 2))(*inputs)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-12)


def test_ops_linear_nested_vmap(x64):
    x, w, b = _linear_inputs((2, 4), (3, 5), np.float64)
    ws = np.stack([w, -w, 2 * w])

    def reference(x, w, b):
        return x @ w.T + b

    nested = jax.vmap(jax.vmap(ops.linear, (0, None, None)), (None, 0, None))
    nested_ref = jax.vmap(jax.vmap(reference, (0, None, None)), (None, 0, None))
    np.testing.assert_allclose(nested(x, ws, b), nested_ref(x, ws, b), rtol=1e-13)


def test_ops_mul_constant_vmap(x64):
    x = rand(5, (4, 3), np.float64)
    out = jax.vmap(jax.grad(lambda x: jnp.sum(jnp.sin(ops.mul_constant(x, 3.0)))))(x)
    np.testing.assert_allclose(out, 3.0 * np.cos(3.0 * x), rtol=1e-14)


# -- mul_constant's constant is a 0-d operand, not an FFI attribute (issue 19 item 7) ----

_CONSTANTS = [1.0 + 0.37 * i for i in range(40)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ops_mul_constant_eager_new_constants_compile_nothing(dtype, x64):
    """Eager calls, each with a new Python constant, reuse one compiled program.

    As an FFI attribute the constant was compiled into the program: every new value
    compiled (and kept) one more, +425 MiB over 300 calls.
    """
    x = rand(11, (3, 5), dtype)
    ops.mul_constant(x, 0.5).block_until_ready()  # compiles once
    with CompileCounter() as compiles:
        outs = [ops.mul_constant(x, c) for c in _CONSTANTS]
    assert compiles.count == 0
    for c, out in zip(_CONSTANTS, outs, strict=True):
        assert out.dtype == dtype
        np.testing.assert_array_equal(out, x * dtype(c))  # one rounded product each


def test_ops_mul_constant_eager_grad_and_vmap_new_constants_compile_nothing(x64):
    x = rand(12, (4, 3), np.float64)
    grad = jax.grad(lambda x, c: jnp.sum(jnp.sin(ops.mul_constant(x, c))))
    vmapped = jax.vmap(ops.mul_constant, in_axes=(0, None))
    grad(x, 0.5).block_until_ready(), vmapped(x, 0.5).block_until_ready()
    with CompileCounter() as compiles:
        got = [(grad(x, c), vmapped(x, c)) for c in _CONSTANTS[:10]]
    assert compiles.count == 0
    x64_ = np.asarray(x, np.float64)
    for c, (g, v) in zip(_CONSTANTS[:10], got, strict=True):
        np.testing.assert_allclose(g, c * np.cos(c * x64_), rtol=1e-14)
        np.testing.assert_array_equal(v, x64_ * c)


@pytest.mark.parametrize("constant", [-3.25, 0.0, 1e-30, np.float32(7.5), np.int64(-4)])
def test_ops_mul_constant_nested_vmap_and_jvp(constant, x64):
    """Under two vmaps the constant operand gets two size-1 dims; values and jvp stay right."""
    x = rand(13, (2, 3, 4), np.float64)
    f = jax.vmap(jax.vmap(lambda x: ops.mul_constant(x, constant)))
    np.testing.assert_array_equal(f(x), x * float(constant))
    t = rand(14, x.shape, np.float64)
    y, y_dot = jax.jvp(f, (x,), (t,))
    np.testing.assert_array_equal(y_dot, t * float(constant))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ops_mul_constant_traced_constant(dtype, x64):
    """A 0-d array constant is an operand of one jitted program for every value, and
    receives its gradient sum(g * x) (float64 autodiff of x * c as the reference)."""
    x = rand(18, (3, 4), dtype)
    f = jax.jit(lambda x, c: ops.mul_constant(x, c))
    for c in _CONSTANTS[:5]:
        np.testing.assert_array_equal(f(x, c), x * dtype(c))
    assert f._cache_size() == 1
    with CompileCounter() as compiles:
        for c in _CONSTANTS[5:10]:
            f(x, c).block_until_ready()
    assert compiles.count == 0

    def loss(f, x, c):
        return jnp.sum(jnp.sin(f(x, c)))

    x64_, c = np.asarray(x, np.float64), np.float64(-1.75)
    want = jax.grad(lambda x, c: loss(jnp.multiply, x, c), (0, 1))(x64_, c)
    got = jax.grad(lambda x, c: loss(ops.mul_constant, x, c), (0, 1))(x, jnp.asarray(c, dtype))
    assert got[1].dtype == dtype
    tol = 8 * x.size * np.finfo(dtype).eps  # sum(g * x) over x.size terms
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)
    # Forward mode, second order and vmap over the constant.
    hess = jax.hessian(lambda c: loss(ops.mul_constant, x, c))(jnp.asarray(c, dtype))
    want_h = jax.hessian(lambda c: loss(jnp.multiply, x64_, c))(c)
    np.testing.assert_allclose(hess, want_h, rtol=tol, atol=tol)
    cs = jnp.asarray(_CONSTANTS[:4], dtype)
    out = jax.vmap(lambda c: ops.mul_constant(x, c))(cs)
    np.testing.assert_array_equal(out, np.asarray(cs)[:, None, None] * x[None])
    # A float64 constant with float32 x multiplies in x's dtype; its gradient keeps its own.
    if dtype == np.float32:
        g = jax.grad(lambda c: jnp.sum(ops.mul_constant(x, c)))(jnp.float64(2.0))
        assert g.dtype == np.float64
        np.testing.assert_allclose(g, x64_.sum(), rtol=tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernel_broadcasts_a_batched_constant(dtype, x64):
    """The handler called directly under vmap over its constant operand (x unbatched, and
    both batched): each batch entry multiplies by its own constant."""
    ext = ops.extension()
    x = rand(15, (3, 4), dtype)
    cs = np.asarray([0.5, -2.0, 3.25, 1e3], dtype)
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)

    def call(x, c):
        return ext.jaxext_mul_constant(x, c, result_shape_dtypes=out, vmap_method="expand_dims")

    want = cs[:, None, None] * x[None]
    np.testing.assert_array_equal(jax.vmap(call, (None, 0))(x, cs), want)
    xs = rand(16, (4, 3, 4), dtype)
    np.testing.assert_array_equal(jax.vmap(call)(xs, cs), cs[:, None, None] * xs)
    nested = jax.vmap(jax.vmap(call, (None, 0)), (0, None))(xs, cs)
    np.testing.assert_array_equal(nested, cs[None, :, None, None] * xs[:, None])


def test_kernel_refuses_a_constant_of_another_dtype(x64):
    x = rand(17, (3,), np.float64)
    with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match="scalar of `x`'s dtype"):
        jax.block_until_ready(
            ops.extension().jaxext_mul_constant(x, np.float32(2.0), result_shape_dtypes=x)
        )


@pytest.mark.parametrize("batch", [(), (3,), (2, 2)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_ops_gradcheck(batch, with_bias, x64):
    x, w, b = _linear_inputs(batch, (4, 3), np.float64)
    inputs = (x, w, b) if with_bias else (x, w)
    both = ("rev", "fwd")  # reverse: the C++ backward; forward: the jvp rule
    assert jaxext.gradcheck(ops.linear, inputs, eps=1e-6, atol=1e-6, modes=both)
    mul = lambda x: ops.mul_constant(x, -1.5)  # noqa: E731
    assert jaxext.gradcheck(mul, (x,), eps=1e-6, atol=1e-6, modes=both)


@pytest.mark.parametrize("perturbed", [(0,), (1,), (2,), (0, 1, 2)])
def test_ops_linear_forward_mode(perturbed, x64):
    x, w, b = _linear_inputs((2, 3), (5, 4), np.float64)
    tangents = [np.zeros_like(a) for a in (x, w, b)]
    for i in perturbed:
        tangents[i] = rand(10 + i, tangents[i].shape, np.float64)

    def reference(x, w, b):
        return x @ w.T + b

    y, y_dot = jax.jit(lambda *t: jax.jvp(ops.linear, (x, w, b), t))(*tangents)
    y_ref, y_dot_ref = jax.jvp(reference, (x, w, b), tuple(tangents))
    np.testing.assert_allclose(y, y_ref, rtol=1e-13)
    np.testing.assert_allclose(y_dot, y_dot_ref, rtol=1e-12, atol=1e-13)
    jac = jax.jacfwd(ops.linear, argnums=perturbed)(x, w, b)
    jac_ref = jax.jacfwd(reference, argnums=perturbed)(x, w, b)
    for j, j_ref in zip(jac, jac_ref, strict=True):
        np.testing.assert_allclose(j, j_ref, rtol=1e-12, atol=1e-13)


def _reference_linear(x, w, b):
    return x @ w.T + b


@pytest.mark.parametrize(
    "transform",
    ["hessian", "jacfwd_jacrev", "jacrev_jacrev", "third_order"],
)
def test_ops_linear_higher_derivatives_match_autodiff(transform, x64):
    """Every rule is made of differentiable ops: any order, against plain float64 autodiff."""
    x, w, b = _linear_inputs((3,), (4, 2), np.float64)

    def derivative(f):
        loss = lambda x, w, b: jnp.sum(jnp.sin(f(x, w, b)) * jnp.cos(x[..., :2].sum()))  # noqa: E731
        argnums = (0, 1, 2)
        if transform == "hessian":
            return jax.hessian(loss, argnums)
        if transform == "jacfwd_jacrev":
            return jax.jacfwd(jax.jacrev(loss, argnums), argnums)
        if transform == "jacrev_jacrev":
            return jax.jacrev(jax.jacrev(loss, argnums), argnums)
        # third order: grad of the sum of a hessian-vector product
        return jax.grad(lambda x, w, b: jnp.sum(jax.hessian(loss, 1)(x, w, b) ** 2), argnums)

    got = jax.jit(derivative(ops.linear))(x, w, b)
    want = derivative(_reference_linear)(x, w, b)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-11, atol=1e-12)


def test_ops_mul_constant_higher_derivatives_match_autodiff(x64):
    x = rand(5, (3, 2), np.float64)
    for f in (jax.hessian, lambda g: jax.jacfwd(jax.jacrev(g))):
        got = f(lambda x: jnp.sum(jnp.sin(ops.mul_constant(x, -1.5))))(x)
        want = f(lambda x: jnp.sum(jnp.sin(-1.5 * x)))(x)
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-14)
    third = jax.grad(jax.grad(jax.grad(lambda x: jnp.sin(ops.mul_constant(x, 2.0)))))(0.3)
    np.testing.assert_allclose(third, -8 * np.cos(0.6), rtol=1e-13)


def test_ops_refuse_bad_input(x64):
    x, w = jnp.ones((2, 3), jnp.float32), jnp.ones((4, 3), jnp.float32)
    with pytest.raises(TypeError, match="`x` must be float32 or float64; got int32"):
        ops.linear(jnp.ones((2, 3), jnp.int32), w)
    with pytest.raises(TypeError, match="`weight` must have `x`'s dtype float32; got float64"):
        ops.linear(x, w.astype(jnp.float64))
    with pytest.raises(ValueError, match=r"`x` must have shape \(\.\.\., 3\)"):
        ops.linear(jnp.ones((2, 5), jnp.float32), w)
    with pytest.raises(ValueError, match=r"`bias` must have shape \(4,\)"):
        ops.linear(x, w, jnp.ones(3, jnp.float32))
    with pytest.raises(TypeError, match="`constant` must be a Python or NumPy real scalar"):
        ops.mul_constant(x, [2.0])
    with pytest.raises(TypeError, match="`constant` must be a Python or NumPy real scalar"):
        ops.mul_constant(x, True)
    with pytest.raises(TypeError, match="`constant` must have a real dtype; got complex64"):
        ops.mul_constant(x, jnp.array(2.0 + 1j, jnp.complex64))
    with pytest.raises(TypeError, match="`constant`"):
        ops.mul_constant(x, jnp.array(True))
    with pytest.raises(ValueError, match=r"`constant` must be 0-d \(a scalar\); got shape \(3,\)"):
        jax.jit(ops.mul_constant)(x, jnp.ones(3))


def test_ops_kernels_refuse_buffers_that_do_not_fit(x64):
    """Called directly with shapes that do not fit, the kernels return an error rather
    than read or write out of bounds. (``partition=None``: the handlers' partition rules
    would refuse some of these shapes in Python first; the kernels' own checks are tested.)"""
    ext = ops.extension()
    x, w, b = _linear_inputs((4,), (3, 2), np.float64)
    out = jax.ShapeDtypeStruct((4, 2), np.float64)
    for args, shape in [
        ((x, w[:, :2], b), out),  # weight's in_features differ from x's
        ((x, w, b[:1]), out),  # bias too short
        ((x, w, b), jax.ShapeDtypeStruct((4, 5), np.float64)),  # result too wide
        ((x[:3], w, b), out),  # fewer rows than the result
    ]:
        with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match="expected x"):
            jax.block_until_ready(
                ext.jaxext_linear_forward(*args, result_shape_dtypes=shape, partition=None)
            )
    g = rand(1, (4, 2), np.float64)
    good = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, w, b)]
    for k, bad in [(1, (2, 4)), (2, (3,))]:
        shapes = list(good)
        shapes[k] = jax.ShapeDtypeStruct(bad, np.float64)
        with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match="expected x"):
            jax.block_until_ready(
                ext.jaxext_linear_backward(x, w, g, result_shape_dtypes=shapes, partition=None)
            )
    with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match="result must match"):
        y = jax.ShapeDtypeStruct((5,), np.float64)
        jax.block_until_ready(
            ext.jaxext_mul_constant(x[0], np.float64(2.0), result_shape_dtypes=y, partition=None)
        )


def test_ops_are_built_through_the_public_load():
    ext = ops.extension()
    assert ext.name == "jaxext_ops"
    assert set(ext.functions) == {
        "jaxext_mul_constant",
        "jaxext_linear_forward",
        "jaxext_linear_backward",
    }
    assert ext.path.parent.parent.parent == _cache.cache_root(None)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_portable_and_threaded_kernel_paths(build_dir, dtype, x64):
    """The 16-byte-vector path other CPUs take, with every product split over threads.

    Forced with -DJAXEXT_NO_FMA_PATH, and thresholds of 1 for the thread-pool split
    (the default ones start at millions of elements or flops).
    """
    flags = ["-DJAXEXT_NO_FMA_PATH", "-DJAXEXT_GEMM_TASK_FLOPS=1", "-DJAXEXT_MIN_CHUNK=1"]
    ext = cpp_extension.load(
        "jaxext_ops_portable", [ops.SOURCE], extra_cflags=flags, build_directory=build_dir
    )
    x = rand(8, (2, 1001), dtype)
    y = ext.jaxext_mul_constant(x, dtype(0.1), result_shape_dtypes=x)
    np.testing.assert_array_equal(y, x * dtype(0.1))
    rows, n_in, n_out = 9, 300, 37
    x, w, b = _linear_inputs((rows,), (n_in, n_out), dtype)
    g = rand(7, (rows, n_out), dtype)
    y = ext.jaxext_linear_forward(
        x, w, b, result_shape_dtypes=jax.ShapeDtypeStruct((rows, n_out), dtype)
    )
    shapes = [jax.ShapeDtypeStruct(s, dtype) for s in (x.shape, w.shape, b.shape)]
    gx, gw, gb = ext.jaxext_linear_backward(x, w, g, result_shape_dtypes=shapes)
    x64_, w64, b64, g64 = (a.astype(np.float64) for a in (x, w, b, g))
    _assert_dot_close(
        y, x64_ @ w64.T + b64, dtype, n_in + 1, np.abs(x64_) @ np.abs(w64).T + np.abs(b64)
    )
    _assert_dot_close(gx, g64 @ w64, dtype, n_out, np.abs(g64) @ np.abs(w64))
    _assert_dot_close(gw, g64.T @ x64_, dtype, rows, np.abs(g64).T @ np.abs(x64_))
    _assert_dot_close(gb, g64.sum(0), dtype, rows, np.abs(g64).sum(0))


def test_readme_example_runs(cpp_builds):
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, re.DOTALL) if "twice_ext" in b]
    assert len(blocks) == 1
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    np.testing.assert_array_equal(namespace["y"], [0.0, 2.0, 4.0])


# -- CUDA (only where there is a GPU and nvcc) ------------------------------------------

CUDA_SOURCE = """
#include <cuda_runtime.h>
__global__ void AddOneKernel(const float* x, float* y, size_t n) {
  size_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] + 1.0f;
}
ffi::Error AddOne(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  size_t n = x.element_count();
  AddOneKernel<<<(n + 255) / 256, 256, 0, stream>>>(x.typed_data(), y->typed_data(), n);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(err));
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(add_one, AddOne,
    ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
"""


def _has_gpu():
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


@pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU (and nvcc)")
def test_cuda_source_compiles_with_nvcc_and_runs_on_the_gpu(tmp_path):
    ext = cpp_extension.load_inline(
        "cuda_ext", cpp_sources="", cuda_sources=CUDA_SOURCE, build_directory=tmp_path
    )
    assert ext.platform == "CUDA"
    x = jnp.arange(5.0, device=jax.devices("gpu")[0])
    y = jax.jit(lambda x: ext.add_one(x, result_shape_dtypes=x))(x)
    np.testing.assert_array_equal(np.asarray(y), np.arange(5.0) + 1)


@pytest.mark.parametrize("op", CPP_OPS)
def test_ops_pass_opcheck(op):
    """As a user calls it, with no check skipped: all pass but bfloat16, which the
    kernels have no handler for, a SKIP with the op's own reason."""
    f, args = OPS_BY_NAME[op].cpp(ops, np.random.default_rng(0))
    pytest.importorskip("flatbuffers")  # what jax.export's serialization needs
    report = jaxext.opcheck(f, args)
    statuses = {r.name: r.status for r in report.results}
    # jit_reuse leaves out subsets of two or more differentiable inputs: mul_constant has one.
    one_input = ("jit_reuse",) if len(args) < 2 else ()
    # The kernels have CPU handlers only: CPU-only, a SKIP for the other platforms.
    accelerators = ("platform_cuda", "platform_rocm", "platform_tpu")
    assert report.skipped == (*one_input, "low_precision", *accelerators), str(report)
    detail = report["low_precision"].detail
    assert "float32 checked" in detail and "bfloat16: the op does not take it" in detail
    assert "must be float32 or float64; got bfloat16" in detail  # the op's own reason
    # The C++ kernels ran in checking mode, were exported, and differentiated twice.
    for name in ("unwritten_outputs", "gradgradcheck", "export", "export_symbolic", "vmap"):
        assert statuses[name] == "PASS", str(report)
    assert "jaxext_linear" in report["unwritten_outputs"].detail or op == "mul_constant"
    assert statuses["platform_cpu"] == "PASS"
    kernel = "jaxext_mul_constant" if op == "mul_constant" else "jaxext_linear_forward"
    for name in accelerators:
        detail = report[name].detail
        assert detail.startswith("CPU-only: its C++ kernels (") and kernel in detail, detail


@pytest.mark.parametrize("op", CPP_OPS)
def test_ops_are_cpu_only_and_fail_a_platform_asked_for(op):
    f, args = OPS_BY_NAME[op].cpp(ops, np.random.default_rng(0))
    rows = ["platform_cpu", "platform_cuda", "platform_rocm", "platform_tpu"]
    report = jaxext.opcheck(f, args, checks=rows, platforms=["cpu", "tpu"], raise_exception=False)
    assert report.statuses == {
        "platform_cpu": "PASS",
        "platform_cuda": "SKIP",
        "platform_rocm": "SKIP",
        "platform_tpu": "FAIL",
    }, str(report)
    assert "none for TPU (asked for with `platforms`)" in report["platform_tpu"].detail
    assert "pass platforms=['cuda'] to require it" in report["platform_cuda"].detail


# -- checking mode: kernels that leave results unwritten -------------------------------

BUGGY_SOURCE = """
// Writes only the first half of its result: the second half is whatever memory held.
ffi::Error HalfWritten(ffi::Buffer<ffi::F64> x, ffi::ResultBuffer<ffi::F64> y) {
  for (size_t i = 0; i < x.element_count() / 2; ++i) y->typed_data()[i] = 3 * x.typed_data()[i];
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(half_written, HalfWritten,
    ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F64>>().Ret<ffi::Buffer<ffi::F64>>());

// Correct: y = 3 x.
ffi::Error Triple(ffi::Buffer<ffi::F64> x, ffi::ResultBuffer<ffi::F64> y) {
  if (x.element_count() != y->element_count())
    return ffi::Error::InvalidArgument("triple: result size differs from x");
  for (size_t i = 0; i < x.element_count(); ++i) y->typed_data()[i] = 3 * x.typed_data()[i];
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(triple, Triple,
    ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F64>>().Ret<ffi::Buffer<ffi::F64>>());

// Integer result, element 0 never written.
ffi::Error Positions(ffi::Buffer<ffi::F64> x, ffi::ResultBuffer<ffi::S32> y) {
  for (size_t i = 1; i < y->element_count(); ++i) y->typed_data()[i] = static_cast<int32_t>(i);
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(positions, Positions,
    ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F64>>().Ret<ffi::Buffer<ffi::S32>>());
"""


@pytest.fixture(scope="module")
def buggy_ext(build_dir):
    return cpp_extension.load_inline("buggy_ext", BUGGY_SOURCE, build_directory=build_dir)


def test_checking_mode_fills_results_before_the_kernel(buggy_ext, x64):
    x = jnp.arange(6.0)
    half = jax.jit(lambda x: buggy_ext.half_written(x, result_shape_dtypes=x))
    positions = jax.jit(
        lambda x: buggy_ext.positions(x, result_shape_dtypes=jax.ShapeDtypeStruct((4,), jnp.int32))
    )
    with cpp_extension.checking():
        y = np.asarray(half(x))  # the same jitted function: the mode acts at run time
        p = np.asarray(positions(x))
    np.testing.assert_array_equal(y[:3], 3 * np.arange(3.0))
    assert np.isnan(y[3:]).all()
    np.testing.assert_array_equal(p, [np.iinfo(np.int32).min, 1, 2, 3])
    # A correct kernel is unaffected; aliased results (they hold an input) are not filled.
    with cpp_extension.checking():
        np.testing.assert_array_equal(
            buggy_ext.triple(x, result_shape_dtypes=x), 3 * np.arange(6.0)
        )
        aliased = jax.jit(
            lambda x: buggy_ext.half_written(x, result_shape_dtypes=x, input_output_aliases={0: 0})
        )(jnp.arange(6.0))
        np.testing.assert_array_equal(aliased, [0, 3, 6, 3, 4, 5])


def test_opcheck_fails_a_kernel_that_leaves_its_output_unwritten(buggy_ext):
    def op(x):
        return buggy_ext.half_written(x, result_shape_dtypes=x)

    report = jaxext.opcheck(op, (np.ones((2, 3)),), raise_exception=False)
    assert report["unwritten_outputs"].status == "FAIL"
    detail = report["unwritten_outputs"].detail
    assert detail.startswith("output: 3 of 6 elements were never written")
    assert "half_written" in detail and "NaN" in detail
    with pytest.raises(jaxext.OpcheckError, match="output: 3 of 6 elements"):
        jaxext.opcheck(op, (np.ones((2, 3)),), checks=["unwritten_outputs"])
    # An integer output: the sentinel, by output.
    report = jaxext.opcheck(
        lambda x: (
            buggy_ext.triple(x, result_shape_dtypes=x),
            buggy_ext.positions(x, result_shape_dtypes=jax.ShapeDtypeStruct((5,), jnp.int32)),
        ),
        (np.ones(5),),
        checks=["unwritten_outputs"],
        raise_exception=False,
    )
    detail = report["unwritten_outputs"].detail
    assert detail.startswith("output[1]: 1 of 5 elements were never written"), detail
    assert "the sentinel" in detail and "element (0,)" in detail


def test_opcheck_names_the_gradient_an_unwritten_backward_spoils(buggy_ext):
    @jaxext.custom_vjp
    def triple(x):
        return buggy_ext.triple(x, result_shape_dtypes=x)

    triple.defvjp(
        lambda x: (triple(x), None),
        lambda _, g: (buggy_ext.half_written(g, result_shape_dtypes=g),),  # the bug
        jvp=lambda _, t: buggy_ext.triple(t[0], result_shape_dtypes=t[0]),
    )
    report = jaxext.opcheck(
        triple, (np.ones(4),), checks=["unwritten_outputs", "gradcheck"], raise_exception=False
    )
    assert report.failed == ("unwritten_outputs", "gradcheck")
    assert report["unwritten_outputs"].detail.startswith("gradient of input 0: 2 of 4 elements")
    # The correct kernel alone passes; an op without C++ kernels skips the check.
    good = jaxext.opcheck(
        lambda x: buggy_ext.triple(x, result_shape_dtypes=x),
        (np.ones(4),),
        checks=["unwritten_outputs"],
    )
    assert good["unwritten_outputs"].status == "PASS"
    plain = jaxext.opcheck(jnp.sin, (np.ones(4),), checks=["unwritten_outputs"])
    assert plain.skipped == ("unwritten_outputs",)


# -- ahead-of-time builds, headers in the key, builds for another jaxlib ----------------

AOT_SOURCE = """
#include "xla/ffi/api/ffi.h"
#include "factor.h"
namespace ffi = xla::ffi;
ffi::Error Times(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  if (y->element_count() != x.element_count())
    return ffi::Error::InvalidArgument("times: result size differs from x");
  for (size_t i = 0; i < x.element_count(); ++i) y->typed_data()[i] = FACTOR * x.typed_data()[i];
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(times, Times,
    ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
"""


def _times(ext, x):
    return np.asarray(ext.times(x, result_shape_dtypes=x))


def test_ahead_of_time_build_used_without_a_compiler(
    tmp_path, monkeypatch, spawn_python, cpp_builds
):
    package = tmp_path / "mypkg" / "csrc"
    package.mkdir(parents=True)
    source = package / "kernel.cc"
    source.write_text(AOT_SOURCE)
    (package / "factor.h").write_text("#define FACTOR 2.0f\n")
    cache = tmp_path / "cache"
    # The command, as a package's build would run it: the library goes next to the source.
    done = spawn_python.run(
        ["-m", "jaxext.cpp_extension", "build", "aot_ext", str(source)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (library,) = package.glob("aot_ext.*.so")
    assert sorted(p.name for p in package.iterdir()) == sorted(
        ["aot_ext.json", library.name, "factor.h", "kernel.cc"]
    )
    # The library's file name carries the hash of its bytes.
    assert library.name == f"aot_ext.{hashlib.sha256(library.read_bytes()).hexdigest()[:16]}.so"
    x = jnp.arange(4.0)

    # No compiler at all: CXX points nowhere and the PATH holds none.
    with monkeypatch.context() as m:
        m.setenv("CXX", str(tmp_path / "no-such-compiler"))
        m.setenv("PATH", str(tmp_path / "empty"))
        ext = cpp_extension.load("aot_ext", [source], build_directory=cache)
        assert not ext.built and ext.path == library
        np.testing.assert_array_equal(_times(ext, x), 2 * np.arange(4.0))
        assert not cache.exists()  # nothing compiled, nothing cached
        # The header is part of the key: edited, the prebuilt library no longer fits.
        (package / "factor.h").write_text("#define FACTOR 3.0f\n")
        with pytest.raises(cpp_extension.CompilerNotFoundError, match="prebuilt 'aot_ext'"):
            cpp_extension.load("aot_ext", [source], build_directory=cache)
    # With a compiler, the edited header gives a new build with the new behaviour.
    ext3 = cpp_extension.load("aot_ext", [source], build_directory=cache)
    assert ext3.built and ext3.path.is_relative_to(cache)
    np.testing.assert_array_equal(_times(ext3, x), 3 * np.arange(4.0))
    np.testing.assert_array_equal(_times(ext, x), 2 * np.arange(4.0))  # the first still works

    # The same library, as if built against another jaxlib (its recorded version
    # changed in the binary, same length): refused, naming both versions.
    import jaxlib

    other = "".join("9" if c.isdigit() else c for c in jaxlib.__version__)
    assert other != jaxlib.__version__
    copy = tmp_path / "other"
    copy.mkdir()
    (package / "factor.h").write_text("#define FACTOR 2.0f\n")
    data = library.read_bytes()
    marker = f"jaxlib={jaxlib.__version__};".encode()
    assert data.count(marker) == 1
    (copy / library.name).write_bytes(data.replace(marker, f"jaxlib={other};".encode()))
    (copy / "aot_ext.json").write_text((package / "aot_ext.json").read_text())
    # The sources and headers are recorded relative to the library: the copy moves whole.
    (copy / "factor.h").write_text("#define FACTOR 2.0f\n")
    (copy / "kernel.cc").write_text(source.read_text())
    with pytest.raises(cpp_extension.ExtensionError) as info:
        cpp_extension.load("aot_ext", [copy / "kernel.cc"], build_directory=cache)
    message = str(info.value)
    assert f"built against jaxlib {other}" in message
    assert f"jaxlib {jaxlib.__version__}" in message and "XLA FFI API" in message


def test_build_command_reports_bad_input(tmp_path, capsys):
    from jaxext.cpp_extension.__main__ import main

    assert main(["build", "aot_ext", str(tmp_path / "nope.cc")]) == 1
    assert "nope.cc' does not exist" in capsys.readouterr().err
    assert main(["build", "bad-name", str(tmp_path / "nope.cc")]) == 1
    assert "`name` must be a C identifier" in capsys.readouterr().err


# -- builds are never stale: a rebuilt library, an edited header, handlers from a macro --

SCALED_SOURCE = AOT_SOURCE  # FACTOR comes from factor.h, found through -I


def test_a_rebuilt_prebuilt_library_runs_the_new_code_in_the_same_process(tmp_path):
    """Rebuilt ahead of time and loaded again in one process: the new machine code runs
    (the dynamic loader hands back the library it already has for a path it opened)."""
    source = tmp_path / "kernel.cc"
    source.write_text(SCALED_SOURCE.replace('#include "factor.h"', "#define FACTOR 2.0f"))
    cache = tmp_path / "cache"
    x = jnp.arange(4.0)
    first_library = cpp_extension.build("rebuilt_ext", [source])
    first = cpp_extension.load("rebuilt_ext", [source], build_directory=cache)
    assert not first.built and first.path == first_library
    np.testing.assert_array_equal(_times(first, x), 2 * np.arange(4.0))

    source.write_text(SCALED_SOURCE.replace('#include "factor.h"', "#define FACTOR 3.0f"))
    second_library = cpp_extension.build("rebuilt_ext", [source])
    second = cpp_extension.load("rebuilt_ext", [source], build_directory=cache)
    np.testing.assert_array_equal(_times(second, x), 3 * np.arange(4.0))
    assert not second.built and second.path == second_library
    assert second_library != first_library and not first_library.exists()  # replaced
    np.testing.assert_array_equal(_times(first, x), 2 * np.arange(4.0))  # still loaded
    assert not cache.exists()  # both came from the prebuilt libraries


def test_a_header_found_through_extra_cflags_is_part_of_the_cache_key(tmp_path):
    """A header the compiler finds through ``-I`` in ``extra_cflags`` (which no scan of
    ``#include`` lines would follow): edited, the next load builds anew and runs it."""
    include = tmp_path / "include"
    include.mkdir()
    header = include / "factor.h"
    header.write_text("#define FACTOR 2.0f\n")
    source = SCALED_SOURCE.replace('#include "xla/ffi/api/ffi.h"\n', "").replace(
        "namespace ffi = xla::ffi;\n", ""
    )
    flags = [f"-I{include}"]
    cache = tmp_path / "cache"
    x = jnp.arange(4.0)

    def load():
        return cpp_extension.load_inline(
            "header_ext", source, extra_cflags=flags, build_directory=cache
        )

    first = load()
    assert first.built
    np.testing.assert_array_equal(_times(first, x), 2 * np.arange(4.0))

    header.write_text("#define FACTOR 3.0f\n")
    second = load()
    np.testing.assert_array_equal(_times(second, x), 3 * np.arange(4.0))
    assert second.built and second.path != first.path
    assert second.times.target_name != first.times.target_name
    np.testing.assert_array_equal(_times(first, x), 2 * np.arange(4.0))

    again = load()  # unchanged since: the cached build
    assert not again.built and again.path == second.path
    header.write_text("#define FACTOR 2.0f\n")  # back as it was: the first build fits again
    back = load()
    assert not back.built and back.path == first.path
    assert back.times.target_name == first.times.target_name


def test_handlers_stamped_out_by_a_macro_are_found_in_the_library(tmp_path):
    source = """
    #define DEFINE_SCALE(NAME, FACTOR)                                                  \\
      ffi::Error NAME##_impl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {  \\
        for (size_t i = 0; i < x.element_count(); ++i)                                  \\
          y->typed_data()[i] = FACTOR * x.typed_data()[i];                              \\
        return ffi::Error::Success();                                                   \\
      }                                                                                 \\
      XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, NAME##_impl,                                  \\
          ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
    DEFINE_SCALE(twice, 2.0f)
    DEFINE_SCALE(thrice, 3.0f)
    """
    ext = cpp_extension.load_inline("macro_ext", source, build_directory=tmp_path)
    assert ext.functions == ("twice", "thrice")
    x = jnp.arange(4.0)
    np.testing.assert_array_equal(ext.twice(x, result_shape_dtypes=x), 2 * np.arange(4.0))
    np.testing.assert_array_equal(ext.thrice(x, result_shape_dtypes=x), 3 * np.arange(4.0))


def test_depfile_names_with_spaces_and_continuations(tmp_path):
    from jaxext.cpp_extension._deps import read_depfile

    (tmp_path / "a dir").mkdir()
    depfile = tmp_path / "x.d"
    depfile.write_text(
        f"{tmp_path}/x.o: {tmp_path}/x.cc \\\n {tmp_path}/a\\ dir/h.h /usr/include/stdio.h\n"
    )
    assert read_depfile(depfile) == [  # as written: a symbolic link is not resolved
        f"{tmp_path}/x.cc",
        f"{tmp_path}/a dir/h.h",
        "/usr/include/stdio.h",
    ]


# -- the five ways a build went stale: each load must run what the compiler reads now ----


def _kernel(directory, header="factor.h"):
    """``kernel.cc`` in ``directory``, its FACTOR from ``#include "<header>"``."""
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "kernel.cc"
    source.write_text(AOT_SOURCE.replace('"factor.h"', f'"{header}"'))
    return source


def _factor(path, factor):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#define FACTOR {factor}f\n")


def test_an_identical_source_in_another_checkout_reads_its_own_header(tmp_path):
    """Two checkouts, the same ``kernel.cc``, each with its own ``factor.h`` beside it."""
    cache, x = tmp_path / "cache", jnp.arange(4.0)
    first, second = _kernel(tmp_path / "one"), _kernel(tmp_path / "two")
    _factor(tmp_path / "one" / "factor.h", 2.0)
    _factor(tmp_path / "two" / "factor.h", 3.0)
    one = cpp_extension.load("checkout_ext", [first], build_directory=cache)
    np.testing.assert_array_equal(_times(one, x), 2 * np.arange(4.0))
    two = cpp_extension.load("checkout_ext", [second], build_directory=cache)
    np.testing.assert_array_equal(_times(two, x), 3 * np.arange(4.0))
    assert two.built and two.path != one.path


def test_a_header_found_through_cplus_include_path_follows_the_variable(tmp_path, monkeypatch):
    """``factor.h`` found through ``$CPLUS_INCLUDE_PATH``; the variable names another
    directory with another ``factor.h``."""
    cache, x = tmp_path / "cache", jnp.arange(4.0)
    source = _kernel(tmp_path / "src")
    _factor(tmp_path / "a" / "factor.h", 2.0)
    _factor(tmp_path / "b" / "factor.h", 3.0)
    monkeypatch.setenv("CPLUS_INCLUDE_PATH", str(tmp_path / "a"))
    first = cpp_extension.load("env_ext", [source], build_directory=cache)
    np.testing.assert_array_equal(_times(first, x), 2 * np.arange(4.0))
    monkeypatch.setenv("CPLUS_INCLUDE_PATH", str(tmp_path / "b"))
    second = cpp_extension.load("env_ext", [source], build_directory=cache)
    np.testing.assert_array_equal(_times(second, x), 3 * np.arange(4.0))
    assert second.built


def test_a_prebuilt_library_is_passed_over_for_other_include_paths(tmp_path):
    """Built ahead of time with ``-I a``; loaded with ``-I b``, whose ``factor.h`` differs."""
    cache, x = tmp_path / "cache", jnp.arange(4.0)
    source = _kernel(tmp_path / "pkg")
    _factor(tmp_path / "a" / "factor.h", 2.0)
    _factor(tmp_path / "b" / "factor.h", 3.0)
    library = cpp_extension.build("paths_ext", [source], extra_include_paths=[tmp_path / "a"])
    same = cpp_extension.load(
        "paths_ext", [source], extra_include_paths=[tmp_path / "a"], build_directory=cache
    )
    assert not same.built and same.path == library
    np.testing.assert_array_equal(_times(same, x), 2 * np.arange(4.0))
    other = cpp_extension.load(
        "paths_ext", [source], extra_include_paths=[tmp_path / "b"], build_directory=cache
    )
    np.testing.assert_array_equal(_times(other, x), 3 * np.arange(4.0))
    assert other.built and other.path.is_relative_to(cache)


def test_a_repointed_symlinked_header_builds_anew(tmp_path):
    """``factor.h`` is a symbolic link; pointed at another file, that file is read."""
    cache, x = tmp_path / "cache", jnp.arange(4.0)
    source = _kernel(tmp_path / "src")
    _factor(tmp_path / "src" / "two.h", 2.0)
    _factor(tmp_path / "src" / "three.h", 3.0)
    link = tmp_path / "src" / "factor.h"
    link.symlink_to("two.h")
    first = cpp_extension.load("link_ext", [source], build_directory=cache)
    np.testing.assert_array_equal(_times(first, x), 2 * np.arange(4.0))
    link.unlink()
    link.symlink_to("three.h")
    second = cpp_extension.load("link_ext", [source], build_directory=cache)
    np.testing.assert_array_equal(_times(second, x), 3 * np.arange(4.0))
    assert second.built


def test_a_new_header_that_shadows_the_included_one_builds_anew(tmp_path, monkeypatch):
    """``factor.h`` found through ``-I``; a new ``factor.h`` beside the source comes first
    for ``#include "factor.h"``."""
    cache, x = tmp_path / "cache", jnp.arange(4.0)
    source = _kernel(tmp_path / "src")
    _factor(tmp_path / "include" / "factor.h", 2.0)
    includes = [tmp_path / "include"]

    def load():
        return cpp_extension.load(
            "shadow_ext", [source], extra_include_paths=includes, build_directory=cache
        )

    first = load()
    np.testing.assert_array_equal(_times(first, x), 2 * np.arange(4.0))
    _factor(tmp_path / "src" / "factor.h", 3.0)
    second = load()
    np.testing.assert_array_equal(_times(second, x), 3 * np.arange(4.0))
    assert second.built
    (tmp_path / "src" / "factor.h").unlink()  # gone again: the first build fits again
    with monkeypatch.context() as m:  # found by its manifest: no preprocessor, no compiler
        m.setattr(subprocess, "run", _no_process)
        back = load()
    assert not back.built and back.path == first.path
    np.testing.assert_array_equal(_times(back, x), 2 * np.arange(4.0))


def _no_process(*args, **kwargs):
    raise AssertionError(f"a cache hit ran a process: {args}")


def test_a_prebuilt_library_moves_with_its_package(tmp_path, monkeypatch):
    """Built into ``pkg/lib`` from ``pkg/csrc`` with ``-I pkg/include``: the paths are
    recorded relative to ``pkg/lib``, so the package moved whole still fits; with
    another ``factor.h`` it does not."""
    package = tmp_path / "pkg"
    source = _kernel(package / "csrc")
    _factor(package / "include" / "factor.h", 2.0)
    cpp_extension.build(
        "moved_ext", [source], package / "lib", extra_include_paths=[package / "include"]
    )
    moved = tmp_path / "site-packages" / "pkg"
    moved.parent.mkdir()
    package.rename(moved)
    x = jnp.arange(4.0)

    def load():
        return cpp_extension.load(
            "moved_ext",
            [moved / "csrc" / "kernel.cc"],
            extra_include_paths=[moved / "include"],
            prebuilt_directory=moved / "lib",
            build_directory=tmp_path / "cache",
        )

    with monkeypatch.context() as m:
        m.setattr(subprocess, "run", _no_process)
        ext = load()
    assert not ext.built and ext.path.parent == moved / "lib"
    np.testing.assert_array_equal(_times(ext, x), 2 * np.arange(4.0))
    _factor(moved / "include" / "factor.h", 3.0)
    again = load()
    assert again.built and again.path.is_relative_to(tmp_path / "cache")
    np.testing.assert_array_equal(_times(again, x), 3 * np.arange(4.0))
