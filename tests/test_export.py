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
from helpers import assert_close, rand, reference_linear
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


def _assert_same(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def _assert_matches_reference(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.shape == e.shape
        assert_close(a, e, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("serialize", [False, True])
@pytest.mark.parametrize("fn,ref", [(FORWARD, REF_FORWARD), (GRAD, REF_GRAD)], ids=["fwd", "grad"])
def test_export_concrete_shapes(fn, ref, serialize):
    args = (rand(0, (5, 16)), *_params())
    exported = export.export(fn)(*args)
    if serialize:
        exported = _roundtrip(exported)
    assert [a.shape for a in exported.in_avals] == [a.shape for a in args]
    out = exported.call(*args)
    _assert_same(out, fn(*args))
    _assert_matches_reference(out, ref(*args))


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
        out = exported.call(*args)
        _assert_same(out, fn(*args))
        _assert_matches_reference(out, ref(*args))


def test_export_symbolic_batch_and_sequence():
    # Any leading dimensions: two symbolic ones sharing one scope.
    b, s = export.symbolic_shape("b, s")
    x_spec = jax.ShapeDtypeStruct((b, s, 16), jnp.float32)
    exported = export.export(GRAD)(x_spec, *_params())
    for shape in ((2, 3, 16), (1, 5, 16)):
        args = (rand(0, shape), *_params())
        _assert_matches_reference(exported.call(*args), REF_GRAD(*args))


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

    graphdef, state = nnx.split(make(jaxext.nnx.Linear))
    params = nnx.to_pure_dict(state)  # plain dict: serializable pytree

    def loss(params, x):
        layer_state = jax.tree.map(lambda leaf: leaf, state)  # a fresh State
        nnx.replace_by_pure_dict(layer_state, params)  # in place
        layer = nnx.merge(graphdef, layer_state)
        return jnp.mean(jnp.tanh(layer(x)) ** 2)

    step = jax.jit(jax.value_and_grad(loss))
    x_spec = jax.ShapeDtypeStruct(export.symbolic_shape("b, 16"), jnp.float32)
    exported = export.export(step)(params, x_spec)
    if serialize:
        exported = _roundtrip(exported)

    reference = make(nnx.Linear)  # flax's own layer, same seed, plain autodiff
    for batch in (2, 5):
        x = rand(batch, (batch, 16))
        value, grads = exported.call(params, x)
        ref_value, ref_grads = nnx.value_and_grad(lambda m, x: jnp.mean(jnp.tanh(m(x)) ** 2))(
            reference, x
        )
        assert_close(value, ref_value, rtol=1e-6, atol=1e-7)
        ref_grads = nnx.to_pure_dict(ref_grads)
        for name in ("kernel", "bias"):
            assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7)
