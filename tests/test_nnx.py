"""jaxext.nnx layers: drop-in equality with flax.nnx.Linear, transforms, metadata."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import (
    assert_bias_grad_exact_and_right,
    assert_close,
    rand,
    skip_without_float16,
    uses_custom_rule,
)
from helpers import assert_trees_equal as _assert_trees_equal
from jax.sharding import PartitionSpec as P

import jaxext.nnx

BF16 = jnp.bfloat16


def _pair(in_features, out_features, seed=0, **kwargs):
    """A jaxext layer and a flax layer built from identically seeded Rngs."""
    ours = jaxext.nnx.Linear(in_features, out_features, rngs=nnx.Rngs(seed), **kwargs)
    ref = nnx.Linear(in_features, out_features, rngs=nnx.Rngs(seed), **kwargs)
    return ours, ref


def _loss(model, x):
    return jnp.sum(jnp.sin(model(x).astype(jnp.float32)))


# -- construction --------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1), (3, 4), (17, 5)])
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("param_dtype", [jnp.float32, BF16])
def test_parameters_identical_to_flax(shape, use_bias, param_dtype):
    ours, ref = _pair(*shape, use_bias=use_bias, param_dtype=param_dtype)
    assert ours.kernel[...].shape == shape
    assert ours.kernel[...].dtype == param_dtype
    if use_bias:
        assert ours.bias[...].shape == (shape[1],)
    else:
        assert ours.bias is None
    _assert_trees_equal(nnx.state(ours, nnx.Param), nnx.state(ref, nnx.Param))


def test_repr_names_features_and_bias():
    text = repr(jaxext.nnx.Linear(3, 7, use_bias=False, rngs=nnx.Rngs(0)))
    assert "in_features=3" in text
    assert "out_features=7" in text
    assert "use_bias=False" in text


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "3"])
def test_invalid_feature_count(bad):
    with pytest.raises(ValueError, match="in_features"):
        jaxext.nnx.Linear(bad, 2, rngs=nnx.Rngs(0))


def test_numpy_int_features_accepted():
    layer = jaxext.nnx.Linear(np.int64(3), np.int32(2), rngs=nnx.Rngs(0))
    assert layer.kernel[...].shape == (3, 2)
    assert type(layer.in_features) is int


def test_custom_dot_general_refused():
    def my_dot(*args, **kwargs):
        return jax.lax.dot_general(*args, **kwargs)

    with pytest.raises(ValueError, match="dot_general"):
        jaxext.nnx.Linear(3, 2, dot_general=my_dot, rngs=nnx.Rngs(0))


def test_dot_general_attribute_like_flax():
    ours, ref = _pair(3, 2)
    assert ours.dot_general is ref.dot_general is jax.lax.dot_general


@pytest.mark.parametrize(
    "inputs",
    [
        [[0.5, -1.0, 2.0], [1.5, 0.25, -3.0]],
        [1.0, 2.0, 3.0],
        np.array([[True, False, True]]),
        np.array([[1, -2, 3]], np.int32),
    ],
    ids=["nested list", "list", "bool array", "int array"],
)
def test_inputs_flax_accepts_are_accepted(inputs):
    # flax.nnx.Linear's promote_dtype turns lists, bool and integer arrays into
    # float arrays; so does the drop-in's, before its matmul. Same program: same bits.
    ours, ref = _pair(3, 2)

    def run(layer):
        return nnx.jit(lambda layer: layer(inputs))(layer)

    y, y_ref = run(ours), run(ref)
    assert y.dtype == y_ref.dtype == jnp.float32
    np.testing.assert_array_equal(y, y_ref)


def test_out_sharding_is_passed_through_like_flax():
    # One device here; tests/test_sharding.py runs a row-parallel layer on 8.
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = jnp.asarray(rand(0, (4, 3)))
    ours = jaxext.nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    theirs = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    spec = P("data", None)
    with jax.set_mesh(mesh):
        y = ours(x, out_sharding=spec)
        assert_close(y, theirs(x, out_sharding=spec), rtol=1e-6)
        assert y.sharding.spec == theirs(x, out_sharding=spec).sharding.spec
    with pytest.raises(TypeError, match="`out_sharding`.*got str"):
        ours(x, out_sharding="data")


@pytest.mark.parametrize("x", [jnp.ones((4, 5)), jnp.ones((5,)), jnp.float32(1.0)])
def test_wrong_input_features_raise_flax_exception_type(x):
    # flax.nnx.Linear raises TypeError (from lax.dot_general); so does the drop-in,
    # naming `inputs` and the expected shape.
    with pytest.raises(TypeError):
        nnx.Linear(3, 2, rngs=nnx.Rngs(0))(x)
    layer = jaxext.nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"`inputs`.*\(\.\.\., 3\).*got shape"):
        layer(x)


def test_non_numeric_inputs_refused_by_name():
    with pytest.raises(TypeError, match="`inputs`"):
        jaxext.nnx.Linear(3, 2, rngs=nnx.Rngs(0))("not an array")


# -- forward and backward against flax.nnx.Linear ----------------------------------------

CONFIGS = {
    "f32": dict(x_dtype=np.float32, kwargs={}),
    "no_bias": dict(x_dtype=np.float32, kwargs={"use_bias": False}),
    "bf16_compute_f32_params": dict(x_dtype=np.float32, kwargs={"dtype": BF16}),
    "bf16_params": dict(x_dtype=np.float32, kwargs={"param_dtype": BF16}),
    "bf16_everything": dict(x_dtype=BF16, kwargs={"dtype": BF16, "param_dtype": BF16}),
    "bf16_preferred_f32": dict(
        x_dtype=BF16,
        kwargs={"param_dtype": BF16, "preferred_element_type": jnp.float32},
    ),
    "precision_highest": dict(x_dtype=np.float32, kwargs={"precision": "highest"}),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("x_shape", [(5,), (4, 5), (2, 3, 5)])
def test_outputs_and_gradients_identical_to_flax(config, x_shape):
    cfg = CONFIGS[config]
    ours, ref = _pair(5, 3, seed=1, bias_init=nnx.initializers.normal(1.0), **cfg["kwargs"])
    x = jnp.asarray(rand(0, x_shape), cfg["x_dtype"])

    y, y_ref = ours(x), ref(x)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape == x_shape[:-1] + (3,)
    np.testing.assert_array_equal(np.asarray(y, np.float64), np.asarray(y_ref, np.float64))

    grad_fn = nnx.grad(_loss, argnums=(0, 1))
    (g_params, g_x), (g_params_ref, g_x_ref) = grad_fn(ours, x), grad_fn(ref, x)
    _assert_trees_equal(g_x, g_x_ref)
    _assert_trees_equal(g_params.kernel[...], g_params_ref.kernel[...])
    if ours.bias is None:
        return
    g_bias, g_bias_ref = g_params.bias[...], g_params_ref.bias[...]
    assert_bias_grad_exact_and_right(g_bias, g_bias_ref, y_ref)


def test_integer_inputs_promoted_like_flax():
    ours, ref = _pair(4, 2)
    x = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)
    _assert_trees_equal(ours(x), ref(x))


def test_custom_promote_dtype_is_used():
    skip_without_float16()
    calls = []

    def promote_to_f16(args, /, *, dtype=None):
        calls.append(dtype)
        return tuple(None if a is None else jnp.asarray(a, jnp.float16) for a in args)

    ours, ref = _pair(4, 2, promote_dtype=promote_to_f16)
    x = jnp.asarray(rand(3, (3, 4)))
    y = ours(x)
    assert y.dtype == jnp.float16
    _assert_trees_equal(y, ref(x))
    assert len(calls) == 2


def test_gradient_runs_through_custom_vjp():
    # The forward is a custom_vjp call whose backward is jaxext's. (The jaxpr of the
    # gradient itself is Flax's, op for op: tests/test_flax_parity.py.)
    ours, ref = _pair(4, 3)
    x = jnp.asarray(rand(0, (2, 4)))

    def runs_custom_rule(layer):
        graphdef, params = nnx.split(layer)
        return uses_custom_rule(lambda p: _loss(nnx.merge(graphdef, p), x), params)

    assert runs_custom_rule(ours)
    assert not runs_custom_rule(ref)


def test_kernel_transpose_folded_away_when_compiled():
    # Kernel is stored (in, out) but jaxext.linear takes (out, in): the transpose
    # must fold into the dots instead of materialising a copy.
    layer = jaxext.nnx.Linear(6, 5, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(layer)
    x = jnp.asarray(rand(0, (4, 6)))

    def step(p, x):
        return jax.grad(lambda p, x: _loss(nnx.merge(graphdef, p), x), argnums=(0, 1))(p, x)

    hlo = jax.jit(step).lower(params, x).compile().as_text()
    ops = [m.group(1) for m in re.finditer(r"= [^=\n]*?\b([a-z][a-z0-9-]*)\(", hlo)]
    assert ops.count("dot") == 3, ops  # forward, grad_x, grad_kernel
    assert "transpose" not in ops and "copy" not in ops, ops


# -- transformations -----------------------------------------------------------------


def test_jit_and_sgd_match_flax_step_for_step():
    ours, ref = _pair(4, 2, seed=3)
    x = jnp.asarray(rand(1, (16, 4)))
    target = jnp.asarray(rand(2, (16, 2)))

    def mse(model):
        return jnp.mean((model(x) - target) ** 2)

    @nnx.jit
    def train_step(model, optimizer):
        loss, grads = nnx.value_and_grad(mse)(model)
        optimizer.update(model, grads)
        return loss

    opt = nnx.Optimizer(ours, optax.sgd(0.1), wrt=nnx.Param)
    opt_ref = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)
    losses = []
    for _ in range(5):
        loss, loss_ref = train_step(ours, opt), train_step(ref, opt_ref)
        np.testing.assert_array_equal(loss, loss_ref)
        _assert_trees_equal(nnx.state(ours, nnx.Param), nnx.state(ref, nnx.Param))
        losses.append(float(loss))
    assert losses[-1] < losses[0]


def test_jax_vmap_per_example_gradients_match_flax():
    ours, ref = _pair(3, 2, seed=4)
    xs = jnp.asarray(rand(0, (6, 3)))

    def per_example(layer):
        graphdef, params = nnx.split(layer)
        grad = jax.grad(lambda p, x: _loss(nnx.merge(graphdef, p), x))
        return jax.vmap(grad, in_axes=(None, 0))(params, xs)

    grads = per_example(ours)
    assert grads["kernel"][...].shape == (6, 3, 2)
    _assert_trees_equal(grads, per_example(ref))


def test_nnx_vmap_ensemble_matches_flax():
    def ensemble(cls):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return cls(4, 2, rngs=rngs)

        return create(nnx.Rngs(0))

    ours, ref = ensemble(jaxext.nnx.Linear), ensemble(nnx.Linear)
    assert ours.kernel[...].shape == (3, 4, 2)
    x = jnp.asarray(rand(0, (5, 4)))

    @nnx.vmap(in_axes=(0, None))
    def forward(model, x):
        return model(x)

    _assert_trees_equal(forward(ours, x), forward(ref, x))
    grad_fn = nnx.grad(lambda m: jnp.sum(forward(m, x) ** 2))
    _assert_trees_equal(nnx.state(grad_fn(ours)), nnx.state(grad_fn(ref)))


@pytest.mark.parametrize("remat", ["nnx.remat", "jax.checkpoint"])
def test_rematerialisation_matches_flax(remat):
    ours, ref = _pair(5, 4, seed=5)
    x = jnp.asarray(rand(0, (3, 5)))

    def grads(layer):
        if remat == "nnx.remat":
            fwd = nnx.remat(lambda m, x: m(x))
            return nnx.state(nnx.grad(lambda m: jnp.sum(fwd(m, x) ** 2))(layer))
        graphdef, params = nnx.split(layer)
        fwd = jax.checkpoint(lambda p: nnx.merge(graphdef, p)(x))
        return jax.grad(lambda p: jnp.sum(fwd(p) ** 2))(params)

    _assert_trees_equal(grads(ours), grads(ref))


def test_sharding_metadata_preserved_like_flax():
    mesh = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    with jax.set_mesh(mesh):
        ours, ref = _pair(4, 6, kernel_init=init, bias_metadata={"out_sharding": ("model",)})
        assert ours.kernel.get_metadata() == ref.kernel.get_metadata()
        assert ours.kernel.get_metadata()["out_sharding"] == (None, "model")
        assert ours.bias.get_metadata()["out_sharding"] == ("model",)
        assert ours.kernel[...].sharding == ref.kernel[...].sharding
        assert ours.kernel[...].sharding.spec == P(None, "model")
        spec = nnx.get_partition_spec(nnx.state(ours))
        assert spec["kernel"].get_value() == P(None, "model")
        assert spec["bias"].get_value() == P("model")
        assert spec == nnx.get_partition_spec(nnx.state(ref))
        forward = nnx.jit(lambda m, x: m(x))
        y, y_ref = forward(ours, jnp.ones((2, 4))), forward(ref, jnp.ones((2, 4)))
    _assert_trees_equal(nnx.state(ours, nnx.Param), nnx.state(ref, nnx.Param))
    _assert_trees_equal(y, y_ref)


# -- the seeds' own module: uniform(-0.1, 0.1) weights ------------------------------------


def test_seed_module_uniform_init_reproducible():
    init = jaxext.nnx.uniform_range(-0.1, 0.1)
    a = jaxext.nnx.Linear(30, 20, kernel_init=init, bias_init=init, rngs=nnx.Rngs(7))
    b = jaxext.nnx.Linear(30, 20, kernel_init=init, bias_init=init, rngs=nnx.Rngs(7))
    _assert_trees_equal(nnx.state(a), nnx.state(b))
    # Independent reference: the same two keys drawn from the Rngs, sampled directly.
    rngs = nnx.Rngs(7)
    kernel_key, bias_key = rngs.params(), rngs.params()
    expected_kernel = jax.random.uniform(kernel_key, (30, 20), minval=-0.1, maxval=0.1)
    expected_bias = jax.random.uniform(bias_key, (20,), minval=-0.1, maxval=0.1)
    np.testing.assert_array_equal(a.kernel[...], expected_kernel)
    np.testing.assert_array_equal(a.bias[...], expected_bias)
    kernel = np.asarray(a.kernel[...])
    assert kernel.min() >= -0.1 and kernel.max() < 0.1
    assert kernel.min() < -0.05 and kernel.max() > 0.05  # both halves of the range used


def test_uniform_range_rejects_empty_interval():
    with pytest.raises(ValueError, match="low"):
        jaxext.nnx.uniform_range(0.1, -0.1)


# -- MulConstant ---------------------------------------------------------------------


@pytest.mark.parametrize("constant", [3.0, -2, np.float32(0.5)])
@pytest.mark.parametrize("shape", [(), (4,), (2, 3)])
def test_mul_constant_static(constant, shape):
    layer = jaxext.nnx.MulConstant(constant)
    x = jnp.asarray(rand(0, shape))
    np.testing.assert_allclose(layer(x), np.asarray(x) * float(constant), rtol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(jnp.sin(layer(x))))(x)
    expected = np.cos(np.asarray(x) * float(constant)) * float(constant)
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-6)
    assert len(jax.tree.leaves(nnx.state(layer, nnx.Param))) == 0
    assert uses_custom_rule(lambda x: layer(x).sum(), x)


def test_mul_constant_learnable_gets_true_gradient():
    layer = jaxext.nnx.MulConstant(2.0, learnable=True)
    x = jnp.asarray(rand(1, (3, 4)))
    np.testing.assert_allclose(layer(x), 2.0 * np.asarray(x), rtol=1e-6)
    grads = nnx.grad(lambda m: jnp.sum(jnp.sin(m(x))))(layer)
    expected = jax.grad(lambda c: jnp.sum(jnp.sin(c * x)))(jnp.float32(2.0))
    np.testing.assert_allclose(grads.scale[...], expected, rtol=1e-5)
    assert grads.scale[...] != 0


def test_mul_constant_learnable_trains():
    layer = jaxext.nnx.MulConstant(0.0, learnable=True)
    x = jnp.asarray(rand(2, (32,)))
    opt = nnx.Optimizer(layer, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - 3.0 * x) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    for _ in range(50):
        step(layer, opt)
    np.testing.assert_allclose(layer.scale[...], 3.0, rtol=1e-3)


@pytest.mark.parametrize("bad", [True, jnp.array(2.0), "2", None])
def test_mul_constant_rejects_non_scalar(bad):
    with pytest.raises(TypeError, match="constant"):
        jaxext.nnx.MulConstant(bad)


# -- packaging -----------------------------------------------------------------------


def test_lazy_namespaces_and_no_eager_flax_or_torch(spawn_python):
    code = (
        "import sys, jaxext\n"
        "assert 'flax' not in sys.modules, 'flax imported eagerly'\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert jaxext.nnx.Linear.__name__ == 'Linear'\n"
        "assert jaxext.linen.Dense.__name__ == 'Dense'\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    spawn_python.run(["-c", code], check=True, timeout=120)
    with pytest.raises(AttributeError, match="no_such_thing"):
        jaxext.no_such_thing  # noqa: B018
