"""torch.nn.Linear state dicts in and out of jaxext/flax linear layers."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from helpers import assert_close_to_float64, rand

import jaxext
import jaxext.linen
import jaxext.nnx


@pytest.fixture
def torch():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    return torch


# -- without PyTorch: NumPy state dicts ----------------------------------------------


def test_params_layout_from_numpy_state_dict():
    weight, bias = rand(0, (3, 5)), rand(1, (3,))
    params = jaxext.torch_linear_to_params({"weight": weight, "bias": bias})
    np.testing.assert_array_equal(params["kernel"], weight.T)
    np.testing.assert_array_equal(params["bias"], bias)
    assert params["kernel"].flags.c_contiguous


@pytest.mark.parametrize("use_bias", [True, False])
def test_numpy_round_trip_exact(use_bias):
    state = {"fc.weight": rand(0, (4, 6))}
    if use_bias:
        state["fc.bias"] = rand(1, (4,))
    layer = jaxext.nnx.Linear(6, 4, use_bias=use_bias, rngs=nnx.Rngs(0))
    jaxext.load_torch_linear(layer, state, prefix="fc.")
    for source in (layer, jaxext.torch_linear_to_params(state, prefix="fc.")):
        back = jaxext.export_torch_linear(source, prefix="fc.")
        assert sorted(back) == sorted(state)
        for key, value in state.items():
            assert back[key].dtype == value.dtype and back[key].flags.c_contiguous
            np.testing.assert_array_equal(back[key], value)


def test_load_preserves_sharding_metadata():
    mesh = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    with jax.set_mesh(mesh):
        layer = jaxext.nnx.Linear(5, 3, kernel_init=init, rngs=nnx.Rngs(0))
        jaxext.load_torch_linear(layer, {"weight": rand(0, (3, 5)), "bias": rand(1, (3,))})
    assert layer.kernel.get_metadata()["out_sharding"] == (None, "model")
    assert layer.kernel[...].sharding.spec == jax.sharding.PartitionSpec(None, "model")
    np.testing.assert_array_equal(layer.kernel[...], rand(0, (3, 5)).T)


def test_load_errors():
    layer = jaxext.nnx.Linear(5, 3, rngs=nnx.Rngs(0))
    with pytest.raises(KeyError, match="weight"):
        jaxext.load_torch_linear(layer, {"bias": np.zeros(3)})
    with pytest.raises(ValueError, match="shape"):
        jaxext.load_torch_linear(layer, {"weight": np.zeros((5, 3)), "bias": np.zeros(3)})
    with pytest.raises(ValueError, match="use_bias"):
        jaxext.load_torch_linear(layer, {"weight": np.zeros((3, 5), np.float32)})
    no_bias = jaxext.nnx.Linear(5, 3, use_bias=False, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="use_bias"):
        jaxext.load_torch_linear(no_bias, {"weight": np.zeros((3, 5)), "bias": np.zeros(3)})
    with pytest.raises(ValueError, match="2-D"):
        jaxext.torch_linear_to_params({"weight": np.zeros(3)})
    with pytest.raises(ValueError, match=r"\(3,\)"):
        jaxext.torch_linear_to_params({"weight": np.zeros((3, 5)), "bias": np.zeros(4)})
    with pytest.raises(TypeError, match="floating"):
        jaxext.torch_linear_to_params({"weight": np.zeros((3, 5), np.int32)})
    with pytest.raises(ValueError, match="kernel"):
        jaxext.export_torch_linear({"weight": np.zeros((3, 5))})


def test_load_casts_to_param_dtype():
    layer = jaxext.nnx.Linear(5, 3, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    weight = rand(0, (3, 5), np.float64)
    jaxext.load_torch_linear(layer, {"weight": weight, "bias": np.zeros(3)})
    assert layer.kernel[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(layer.kernel[...], weight.T.astype(ml_dtypes.bfloat16))


# -- against PyTorch -----------------------------------------------------------------


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("x_shape", [(7,), (4, 7), (2, 3, 7)])
def test_outputs_and_gradients_match_torch(torch, use_bias, x_shape):
    linear = torch.nn.Linear(7, 5, bias=use_bias)
    state = linear.state_dict()  # float32, loaded into the jaxext layers
    # The reference: the same torch layer in float64 (float32 values are exact there).
    linear64 = copy.deepcopy(linear).double()
    x = rand(2, x_shape)
    x_t = torch.from_numpy(x.astype(np.float64)).requires_grad_(True)
    y_t = linear64(x_t)
    (y_t**2).sum().backward()
    n = 42  # longest sum: the weight gradient over up to 6 rows, 7 features deep

    ours = jaxext.nnx.Linear(7, 5, use_bias=use_bias, rngs=nnx.Rngs(0))
    jaxext.load_torch_linear(ours, state)
    assert_close_to_float64(ours(jnp.asarray(x)), y_t.detach().numpy(), n=7)
    grads, g_x = nnx.grad(lambda m, x: jnp.sum(m(x) ** 2), argnums=(0, 1))(ours, jnp.asarray(x))
    assert_close_to_float64(g_x, x_t.grad.numpy(), n=n)
    assert_close_to_float64(grads.kernel[...].T, linear64.weight.grad.numpy(), n=n)
    if use_bias:
        assert_close_to_float64(grads.bias[...], linear64.bias.grad.numpy(), n=n)

    dense = jaxext.linen.Dense(features=5, use_bias=use_bias)
    params = jaxext.torch_linear_to_params(state)
    y_linen = dense.apply({"params": params}, jnp.asarray(x))
    assert_close_to_float64(y_linen, y_t.detach().numpy(), n=7)


def test_also_loads_flax_layers(torch):
    linear = torch.nn.Linear(4, 3)
    x = rand(0, (2, 4))
    expected = copy.deepcopy(linear).double()(torch.from_numpy(x.astype(np.float64)))
    expected = expected.detach().numpy()  # float64 reference
    layer = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    jaxext.load_torch_linear(layer, linear.state_dict())
    assert_close_to_float64(layer(jnp.asarray(x)), expected, n=4)
    params = jaxext.torch_linear_to_params(linear.state_dict())
    y = nn.Dense(3).apply({"params": params}, jnp.asarray(x))
    assert_close_to_float64(y, expected, n=4)


@pytest.mark.parametrize("dtype_name", ["float32", "float64", "bfloat16"])
def test_torch_round_trip_exact(torch, dtype_name):
    torch_dtype = getattr(torch, dtype_name)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model = model.to(torch_dtype)
    state = model.state_dict()
    jax_dtype = jnp.dtype(dtype_name)
    with jax.enable_x64(dtype_name == "float64"):
        layer = jaxext.nnx.Linear(6, 4, param_dtype=jax_dtype, rngs=nnx.Rngs(0))
        jaxext.load_torch_linear(layer, state, prefix="0.")
        assert layer.kernel[...].dtype == jax_dtype
        exported = jaxext.export_torch_linear(layer, prefix="0.", as_torch=True)
        exported_np = jaxext.export_torch_linear(layer, prefix="0.")
    assert sorted(exported) == ["0.bias", "0.weight"]
    for key in exported:
        assert exported[key].dtype == torch_dtype
        assert torch.equal(exported[key], state[key])
        assert exported_np[key].dtype == jax_dtype
    # Exported tensors load straight back into PyTorch.
    fresh = torch.nn.Linear(6, 4).to(torch_dtype)
    fresh.load_state_dict({key[2:]: value for key, value in exported.items()})
    assert torch.equal(fresh.weight, model[0].weight)


def test_linen_variables_export_to_torch(torch):
    x = jnp.ones((1, 3))
    variables = jaxext.linen.Dense(features=2).init(jax.random.key(0), x)
    state = jaxext.export_torch_linear(variables, as_torch=True)
    linear = torch.nn.Linear(3, 2)
    linear.load_state_dict(state)
    x_np = rand(0, (5, 3))
    params = variables["params"]
    # float64 reference from the jax parameters; torch (float32) must land within rounding.
    expected = x_np.astype(np.float64) @ np.asarray(params["kernel"], np.float64)
    expected += np.asarray(params["bias"], np.float64)
    got = linear(torch.from_numpy(x_np)).detach().numpy()
    assert got.dtype == np.float32
    assert_close_to_float64(got, expected, n=3)


def test_import_jaxext_does_not_import_torch(spawn_python):
    code = "import sys, jaxext; assert 'torch' not in sys.modules"
    spawn_python.run(["-c", code], check=True, timeout=120)
