"""jaxext.linen layers: drop-in equality with flax.linen.Dense, transforms, metadata."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from helpers import assert_bias_grad_exact_and_right, rand, uses_custom_rule
from helpers import assert_trees_equal as _assert_trees_equal

import jaxext.linen

BF16 = jnp.bfloat16


def _init_pair(x, seed=0, **kwargs):
    ours, ref = jaxext.linen.Dense(**kwargs), nn.Dense(**kwargs)
    key = jax.random.key(seed)
    return ours, ref, ours.init(key, x), ref.init(key, x)


def _loss(module, variables, x):
    return jnp.sum(jnp.sin(module.apply(variables, x).astype(jnp.float32)))


@pytest.mark.parametrize("features", [1, 4])
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("param_dtype", [jnp.float32, BF16])
def test_params_identical_to_flax(features, use_bias, param_dtype):
    x = jnp.ones((2, 5))
    _, _, v, v_ref = _init_pair(x, features=features, use_bias=use_bias, param_dtype=param_dtype)
    assert v["params"]["kernel"].shape == (5, features)
    assert v["params"]["kernel"].dtype == param_dtype
    assert ("bias" in v["params"]) == use_bias
    _assert_trees_equal(v, v_ref)


CONFIGS = {
    "f32": dict(x_dtype=np.float32, kwargs={}),
    "no_bias": dict(x_dtype=np.float32, kwargs={"use_bias": False}),
    "bf16_compute_f32_params": dict(x_dtype=np.float32, kwargs={"dtype": BF16}),
    "bf16_params": dict(x_dtype=np.float32, kwargs={"param_dtype": BF16}),
    "precision_highest": dict(x_dtype=np.float32, kwargs={"precision": "highest"}),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("x_shape", [(5,), (4, 5), (2, 3, 5)])
def test_outputs_and_gradients_identical_to_flax(config, x_shape):
    cfg = CONFIGS[config]
    x = jnp.asarray(rand(0, x_shape), cfg["x_dtype"])
    kwargs = dict(features=3, bias_init=nn.initializers.normal(1.0), **cfg["kwargs"])
    ours, ref, v, v_ref = _init_pair(x, seed=1, **kwargs)
    _assert_trees_equal(v, v_ref)

    y, y_ref = ours.apply(v, x), ref.apply(v_ref, x)
    assert y.shape == x_shape[:-1] + (3,)
    _assert_trees_equal(y, y_ref)

    grads = jax.grad(_loss, argnums=(1, 2))(ours, v, x)
    grads_ref = jax.grad(_loss, argnums=(1, 2))(ref, v_ref, x)
    _assert_trees_equal(grads[1], grads_ref[1])
    _assert_trees_equal(grads[0]["params"]["kernel"], grads_ref[0]["params"]["kernel"])
    if "bias" not in v["params"]:
        return
    g_bias, g_bias_ref = grads[0]["params"]["bias"], grads_ref[0]["params"]["bias"]
    assert_bias_grad_exact_and_right(g_bias, g_bias_ref, y_ref)


def test_gradient_runs_through_custom_vjp():
    x = jnp.asarray(rand(0, (2, 4)))
    ours, ref, v, v_ref = _init_pair(x, features=3)
    assert uses_custom_rule(lambda v: _loss(ours, v, x), v)
    assert not uses_custom_rule(lambda v: _loss(ref, v, x), v_ref)


def test_jit_and_sgd_match_flax_step_for_step():
    x = jnp.asarray(rand(1, (16, 4)))
    target = jnp.asarray(rand(2, (16, 2)))
    ours, ref, v, v_ref = _init_pair(x, seed=3, features=2)
    tx = optax.sgd(0.1)

    def make_step(module):
        @jax.jit
        def step(params, opt_state):
            def mse(p):
                return jnp.mean((module.apply({"params": p}, x) - target) ** 2)

            loss, grads = jax.value_and_grad(mse)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return step

    step, step_ref = make_step(ours), make_step(ref)
    p, p_ref = v["params"], v_ref["params"]
    s, s_ref = tx.init(p), tx.init(p_ref)
    losses = []
    for _ in range(5):
        p, s, loss = step(p, s)
        p_ref, s_ref, loss_ref = step_ref(p_ref, s_ref)
        np.testing.assert_array_equal(loss, loss_ref)
        _assert_trees_equal(p, p_ref)
        losses.append(float(loss))
    assert losses[-1] < losses[0]


def test_vmap_per_example_gradients_match_flax():
    xs = jnp.asarray(rand(0, (6, 3)))
    ours, ref, v, v_ref = _init_pair(xs[0], seed=4, features=2)
    per_example = jax.vmap(jax.grad(_loss, argnums=1), in_axes=(None, None, 0))
    grads = per_example(ours, v, xs)
    assert grads["params"]["kernel"].shape == (6, 3, 2)
    _assert_trees_equal(grads, per_example(ref, v_ref, xs))


def test_nn_vmap_ensemble_matches_flax():
    def ensemble(cls):
        return nn.vmap(
            cls,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=None,
            axis_size=3,
        )(features=2)

    x = jnp.asarray(rand(0, (5, 4)))
    ours, ref = ensemble(jaxext.linen.Dense), ensemble(nn.Dense)
    v, v_ref = ours.init(jax.random.key(0), x), ref.init(jax.random.key(0), x)
    assert v["params"]["kernel"].shape == (3, 4, 2)
    _assert_trees_equal(v, v_ref)
    _assert_trees_equal(ours.apply(v, x), ref.apply(v_ref, x))
    _assert_trees_equal(
        jax.grad(_loss, argnums=1)(ours, v, x), jax.grad(_loss, argnums=1)(ref, v_ref, x)
    )


@pytest.mark.parametrize("remat", ["nn.remat", "jax.checkpoint"])
def test_rematerialisation_matches_flax(remat):
    x = jnp.asarray(rand(0, (3, 5)))

    def grads(cls):
        if remat == "nn.remat":
            module = nn.remat(cls)(features=4)
            v = module.init(jax.random.key(5), x)
            return jax.grad(_loss, argnums=1)(module, v, x)
        module = cls(features=4)
        v = module.init(jax.random.key(5), x)
        fwd = jax.checkpoint(lambda v: module.apply(v, x))
        return jax.grad(lambda v: jnp.sum(jnp.sin(fwd(v))))(v)

    _assert_trees_equal(grads(jaxext.linen.Dense), grads(nn.Dense))


def test_partitioning_metadata_like_flax():
    init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
    x = jnp.ones((2, 4))
    _, _, v, v_ref = _init_pair(x, features=6, kernel_init=init)
    assert isinstance(v["params"]["kernel"], nn.Partitioned)
    spec = nn.get_partition_spec(v)
    assert spec == nn.get_partition_spec(v_ref)
    assert spec["params"]["kernel"] == jax.sharding.PartitionSpec(None, "model")
    _assert_trees_equal(nn.meta.unbox(v), nn.meta.unbox(v_ref))
    module = jaxext.linen.Dense(features=6, kernel_init=init)
    _assert_trees_equal(module.apply(v, x), nn.Dense(6, kernel_init=init).apply(v_ref, x))


def test_seed_module_uniform_init():
    init = jaxext.linen.uniform_range(-0.1, 0.1)
    x = jnp.ones((1, 30))
    module = jaxext.linen.Dense(features=20, kernel_init=init, bias_init=init)
    v = module.init(jax.random.key(7), x)
    _assert_trees_equal(v, module.init(jax.random.key(7), x))
    kernel = np.asarray(v["params"]["kernel"])
    assert kernel.min() >= -0.1 and kernel.max() < 0.1
    assert kernel.min() < -0.05 and kernel.max() > 0.05
    # Same draw as flax's Dense given the same initializer: the params stream is shared.
    _assert_trees_equal(
        v, nn.Dense(20, kernel_init=init, bias_init=init).init(jax.random.key(7), x)
    )


@pytest.mark.parametrize(
    "kwargs",
    [{"dot_general": lambda *a, **k: jax.lax.dot_general(*a, **k)}, {"dot_general_cls": object}],
)
def test_custom_dot_general_refused(kwargs):
    with pytest.raises(ValueError, match="dot_general"):
        jaxext.linen.Dense(features=2, **kwargs).init(jax.random.key(0), jnp.ones((1, 3)))


def test_bad_inputs_refused_by_name():
    module = jaxext.linen.Dense(features=2)
    with pytest.raises(TypeError, match="`inputs`"):
        module.init(jax.random.key(0), "not an array")
    with pytest.raises(TypeError, match="`inputs`.*scalar"):
        module.init(jax.random.key(0), jnp.float32(1.0))


@pytest.mark.parametrize(
    "inputs",
    [[[0.5, -1.0, 2.0], [1.5, 0.25, -3.0]], np.array([[True, False, True]])],
    ids=["nested list", "bool array"],
)
def test_inputs_flax_accepts_are_accepted(inputs):
    # flax.linen.Dense's promote_dtype turns them into float arrays; so does the
    # drop-in's. Same program under jit: same bits.
    def run(module):
        variables = module.init(jax.random.key(0), inputs)
        return jax.jit(lambda v: module.apply(v, inputs))(variables)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the drop-in takes a nested list without a warning
        y = run(jaxext.linen.Dense(features=2))
    if isinstance(inputs, list):
        # Flax's Dense takes one too, but JAX warns that `jnp.shape` of a list is deprecated
        with pytest.warns(DeprecationWarning, match="shape requires ndarray or scalar"):
            y_ref = run(nn.Dense(features=2))
    else:
        y_ref = run(nn.Dense(features=2))
    assert y.dtype == y_ref.dtype == jnp.float32
    np.testing.assert_array_equal(y, y_ref)


def test_default_dot_general_accepted():
    module = jaxext.linen.Dense(features=2, dot_general=jax.lax.dot_general)
    v = module.init(jax.random.key(0), jnp.ones((1, 3)))
    assert module.apply(v, jnp.ones((1, 3))).shape == (1, 2)


# -- MulConstant ---------------------------------------------------------------------


@pytest.mark.parametrize("constant", [3.0, -2, np.float32(0.5)])
def test_mul_constant_static(constant):
    module = jaxext.linen.MulConstant(constant)
    x = jnp.asarray(rand(0, (2, 3)))
    v = module.init(jax.random.key(0), x)
    assert jax.tree.leaves(v) == []
    np.testing.assert_allclose(module.apply(v, x), np.asarray(x) * float(constant), rtol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(jnp.sin(module.apply(v, x))))(x)
    expected = np.cos(np.asarray(x) * float(constant)) * float(constant)
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-6)


def test_mul_constant_learnable_gets_true_gradient():
    module = jaxext.linen.MulConstant(2.0, learnable=True)
    x = jnp.asarray(rand(1, (3, 4)))
    v = module.init(jax.random.key(0), x)
    assert v["params"]["scale"].shape == () and float(v["params"]["scale"]) == 2.0
    grads = jax.grad(lambda v: jnp.sum(jnp.sin(module.apply(v, x))))(v)
    expected = jax.grad(lambda c: jnp.sum(jnp.sin(c * x)))(jnp.float32(2.0))
    np.testing.assert_allclose(grads["params"]["scale"], expected, rtol=1e-5)


@pytest.mark.parametrize("bad", [True, "2", None])
def test_mul_constant_rejects_non_scalar(bad):
    with pytest.raises(TypeError, match="constant"):
        jaxext.linen.MulConstant(bad).init(jax.random.key(0), jnp.ones(2))


# -- packaging -----------------------------------------------------------------------


def test_linen_does_not_import_flax_nnx(spawn_python):
    # flax.linen itself does not import flax.nnx; jaxext.linen must not either, even
    # once its layers have run (init, apply, a gradient).
    code = (
        "import sys, jax, jax.numpy as jnp\n"
        "import jaxext.linen\n"
        "x = jnp.ones((2, 3))\n"
        "for layer in (jaxext.linen.Dense(4, kernel_init=jaxext.linen.uniform_range()),\n"
        "              jaxext.linen.MulConstant(2.0, learnable=True)):\n"
        "    v = layer.init(jax.random.key(0), x)\n"
        "    jax.grad(lambda v: layer.apply(v, x).sum())(v)\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('flax.nnx', 'jaxext._nnx')))\n"
        "assert not loaded, loaded\n"
    )
    spawn_python.run(["-c", code], check=True, timeout=120)
