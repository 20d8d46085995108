"""``jax.export`` of jitted jaxext forwards and gradients, with symbolic batch sizes.

The custom VJPs lower to ordinary StableHLO, so an exported forward or gradient
runs without jaxext. Results are compared with plain ``jnp`` autodiff and with the
jitted function before export. Serialization needs the optional ``flatbuffers``
package (``jax.export.Exported.serialize`` imports it); those tests skip without it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_close_to_float64,
    assert_trees_equal,
    in_float64,
    rand,
    reference_linear,
)
from jax import export

import jaxext


def _jaxext_model(x, w1, b1, w2):
    h = jnp.tanh(jaxext.linear(x, w1, b1))
    return jaxext.mul_constant(jaxext.linear(h, w2), 0.5)


def _plain_model(x, w1, b1, w2):
    return 0.5 * reference_linear(jnp.tanh(reference_linear(x, w1, b1)), w2)


def _loss(model):
    return lambda x, w1, b1, w2: jnp.sum(model(x, w1, b1, w2) ** 2)


FORWARD = jax.jit(_jaxext_model)
GRAD = jax.jit(jax.value_and_grad(_loss(_jaxext_model), argnums=(0, 1, 2, 3)))
REF_FORWARD = _plain_model
REF_GRAD = jax.value_and_grad(_loss(_plain_model), argnums=(0, 1, 2, 3))


def _params():
    return rand(1, (8, 16)), rand(2, (8,)), rand(3, (4, 8))


def _roundtrip(exported):
    pytest.importorskip("flatbuffers")
    blob = exported.serialize()
    assert isinstance(blob, (bytes, bytearray)) and len(blob) > 0
    return export.deserialize(blob)


def _assert_matches_reference(actual, ref, args):
    """float32 results vs ``ref`` (plain autodiff) computed in float64."""
    expected = in_float64(ref, *args)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.shape == e.shape and a.dtype == jnp.float32
        # Two layers forward and back: four chained sums of up to 16 terms each, whose
        # rounding errors compound (about 16 * 16 terms' worth).
        assert_close_to_float64(a, e, n=256)


@pytest.mark.parametrize("serialize", [False, True])
@pytest.mark.parametrize("fn,ref", [(FORWARD, REF_FORWARD), (GRAD, REF_GRAD)], ids=["fwd", "grad"])
def test_export_concrete_shapes(fn, ref, serialize):
    args = (rand(0, (5, 16)), *_params())
    exported = export.export(fn)(*args)
    if serialize:
        exported = _roundtrip(exported)
    assert [a.shape for a in exported.in_avals] == [a.shape for a in args]
    out = exported.call(*args)
    assert_trees_equal(out, fn(*args))
    _assert_matches_reference(out, ref, args)


@pytest.mark.parametrize("serialize", [False, True])
@pytest.mark.parametrize("fn,ref", [(FORWARD, REF_FORWARD), (GRAD, REF_GRAD)], ids=["fwd", "grad"])
def test_export_symbolic_batch(fn, ref, serialize):
    x_spec = jax.ShapeDtypeStruct(export.symbolic_shape("b, 16"), jnp.float32)
    exported = export.export(fn)(x_spec, *_params())
    if serialize:
        exported = _roundtrip(exported)
    assert export.is_symbolic_dim(exported.in_avals[0].shape[0])
    for batch in (1, 3, 7):
        args = (rand(batch, (batch, 16)), *_params())
        # A shape-polymorphic module refined at call time is not the program jit compiles
        # for the concrete shape, so it is held to the float64 reference, not to fn's bits.
        _assert_matches_reference(exported.call(*args), ref, args)


def test_export_symbolic_batch_and_sequence():
    # Any leading dimensions: two symbolic ones sharing one scope.
    b, s = export.symbolic_shape("b, s")
    x_spec = jax.ShapeDtypeStruct((b, s, 16), jnp.float32)
    exported = export.export(GRAD)(x_spec, *_params())
    for shape in ((2, 3, 16), (1, 5, 16)):
        args = (rand(0, shape), *_params())
        _assert_matches_reference(exported.call(*args), REF_GRAD, args)


def test_exported_symbolic_batch_rejects_wrong_features():
    x_spec = jax.ShapeDtypeStruct(export.symbolic_shape("b, 16"), jnp.float32)
    exported = export.export(FORWARD)(x_spec, *_params())
    with pytest.raises(ValueError, match="shape"):
        exported.call(rand(0, (3, 15)), *_params())


@pytest.mark.parametrize("serialize", [False, True])
def test_export_nnx_linear_train_step(serialize):
    nnx = pytest.importorskip("flax.nnx")
    import jaxext.nnx

    def make(cls):
        return cls(16, 8, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(0))

    def functional(cls):
        """``(loss(params, x), params)`` for a fresh layer; params is a plain dict."""
        graphdef, state = nnx.split(make(cls))

        def loss(params, x):
            layer_state = jax.tree.map(lambda leaf: leaf, state)  # a fresh State
            nnx.replace_by_pure_dict(layer_state, params)  # in place
            layer = nnx.merge(graphdef, layer_state)
            return jnp.mean(jnp.tanh(layer(x)) ** 2)

        return loss, nnx.to_pure_dict(state)  # plain dict: serializable pytree

    loss, params = functional(jaxext.nnx.Linear)
    step = jax.jit(jax.value_and_grad(loss))
    x_spec = jax.ShapeDtypeStruct(export.symbolic_shape("b, 16"), jnp.float32)
    exported = export.export(step)(params, x_spec)
    if serialize:
        exported = _roundtrip(exported)

    # Flax's own layer (same seed), plain autodiff, in float64.
    ref_loss, ref_params = functional(nnx.Linear)
    for batch in (2, 5):
        x = rand(batch, (batch, 16))
        value, grads = exported.call(params, x)
        ref_value, ref_grads = in_float64(jax.value_and_grad(ref_loss), ref_params, x)
        assert_close_to_float64(value, ref_value, n=16 * batch)
        for name in ("kernel", "bias"):
            assert_close_to_float64(grads[name], ref_grads[name], n=16 * batch)


# -- programs with jaxext's C++ kernels (jaxext.cpp_extension) ------------------------------

_CHILD = """
import sys
import jax
import numpy as np
from jaxext.cpp_extension import ops

if sys.argv[2] == "load":
    ops.extension()  # registers the kernels' FFI targets, as the exporting process did
exported = jax.export.deserialize(open(sys.argv[1], "rb").read())
args = np.load(sys.argv[1] + ".npz")
out = exported.call(*(args[f"arr_{i}"] for i in range(len(args.files))))
np.savez(sys.argv[1] + ".out.npz", *jax.tree.leaves(out))
"""


def _cpp_model(x, w1, b1, w2):
    from jaxext.cpp_extension import ops

    return ops.mul_constant(ops.linear(jnp.tanh(ops.linear(x, w1, b1)), w2), 0.5)


def test_export_of_cpp_kernels_needs_the_documented_option(cpp_builds):
    pytest.importorskip("flatbuffers")
    from jaxext.cpp_extension import ops

    args = (rand(0, (5, 16)), *_params())
    with pytest.raises(ValueError, match="Cannot serialize code with custom calls"):
        export.export(jax.jit(_cpp_model))(*args)
    exported = export.export(
        jax.jit(_cpp_model), disabled_checks=ops.extension().disabled_safety_checks
    )(*args)
    assert_trees_equal(_roundtrip(exported).call(*args), jax.jit(_cpp_model)(*args))


@pytest.mark.parametrize("fn", ["forward", "grad"])
def test_exported_cpp_kernels_run_in_a_fresh_process(fn, tmp_path, spawn_python, cpp_builds):
    """Serialized here; deserialized and called by a new Python that loads the extension."""
    pytest.importorskip("flatbuffers")
    from jaxext.cpp_extension import ops

    program = jax.jit(
        _cpp_model if fn == "forward" else jax.grad(_loss(_cpp_model), argnums=(0, 1, 2, 3))
    )
    args = (rand(0, (5, 16)), *_params())
    checks = ops.extension().disabled_safety_checks
    blob = tmp_path / "program.bin"
    blob.write_bytes(export.export(program, disabled_checks=checks)(*args).serialize())
    np.savez(str(blob) + ".npz", *args)

    def child(mode):
        return spawn_python.run(
            ["-c", _CHILD, str(blob), mode],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )

    done = child("load")
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(str(blob) + ".out.npz") as out:
        got = [out[f"arr_{i}"] for i in range(len(out.files))]
    assert_trees_equal(got, jax.tree.leaves(program(*args)))  # the same program, the same bits
    ref = REF_FORWARD if fn == "forward" else jax.grad(_loss(_plain_model), argnums=(0, 1, 2, 3))
    _assert_matches_reference(got, ref, args)
    # Without the extension loaded, the call fails, naming the kernel's target.
    done = child("skip")
    assert done.returncode != 0 and "jaxext_linear_forward" in done.stderr
