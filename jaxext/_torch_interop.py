"""Moving ``torch.nn.Linear`` weights in and out of jaxext/flax linear layers.

PyTorch stores ``weight`` as ``(out_features, in_features)``; flax (and jaxext's
layers) store ``kernel`` as ``(in_features, out_features)``. These helpers do the
transpose and the renaming. PyTorch is never imported here unless an export is
explicitly asked for as ``torch`` tensors: state-dict values are read by duck
typing (anything with ``.detach().cpu().numpy()``, or any array-like).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

__all__ = ["export_torch_linear", "load_torch_linear", "torch_linear_to_params"]


def _to_numpy(value: Any, key: str) -> np.ndarray:
    """A state-dict value (torch tensor, NumPy or JAX array) as a NumPy array, exactly."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch.Tensor
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            # NumPy has no bfloat16; bfloat16 -> float32 -> bfloat16 is exact.
            return value.float().numpy().astype(ml_dtypes.bfloat16)
        value = value.numpy()
    array = np.asarray(value)
    if not np.issubdtype(array.dtype, np.floating) and array.dtype != ml_dtypes.bfloat16:
        raise TypeError(f"`state_dict[{key!r}]` must be a floating array; got dtype {array.dtype}.")
    return array


def _torch():
    try:
        return importlib.import_module("torch")
    except ImportError as err:
        raise ImportError("`as_torch=True` needs PyTorch installed (`pip install torch`).") from err


def torch_linear_to_params(
    state_dict: Mapping[str, Any], *, prefix: str = ""
) -> dict[str, np.ndarray]:
    """Converts a ``torch.nn.Linear`` state dict to flax-layout parameters.

    Args:
        state_dict: mapping with ``f"{prefix}weight"`` of shape ``(out, in)`` and
            optionally ``f"{prefix}bias"`` of shape ``(out,)``; values may be torch
            tensors (any device, bfloat16 included), NumPy or JAX arrays.
        prefix: key prefix of the layer inside a larger state dict, e.g. ``"fc."``.

    Returns:
        ``{"kernel": (in, out)}`` plus ``"bias": (out,)`` when present, as NumPy
        arrays in the state dict's dtype: the ``params`` of
        ``jaxext.linen.Dense``/``flax.linen.Dense``.

    Raises:
        KeyError: if the weight is missing.
        ValueError: if the weight is not 2-D or the bias shape does not match.

    Example:
        >>> import numpy as np
        >>> import jaxext
        >>> p = jaxext.torch_linear_to_params({"weight": np.ones((2, 3)), "bias": np.zeros(2)})
        >>> p["kernel"].shape, p["bias"].shape
        ((3, 2), (2,))
    """
    weight_key, bias_key = f"{prefix}weight", f"{prefix}bias"
    if weight_key not in state_dict:
        raise KeyError(
            f"`state_dict` has no {weight_key!r} entry; keys: {sorted(state_dict)[:10]}."
        )
    weight = _to_numpy(state_dict[weight_key], weight_key)
    if weight.ndim != 2:
        raise ValueError(
            f"`state_dict[{weight_key!r}]` must be 2-D (out_features, in_features); "
            f"got shape {weight.shape}."
        )
    params = {"kernel": np.ascontiguousarray(weight.T)}
    if state_dict.get(bias_key) is not None:
        bias = _to_numpy(state_dict[bias_key], bias_key)
        if bias.shape != (weight.shape[0],):
            raise ValueError(
                f"`state_dict[{bias_key!r}]` must have shape ({weight.shape[0]},); "
                f"got {bias.shape}."
            )
        params["bias"] = bias
    return params


def load_torch_linear(layer: Any, state_dict: Mapping[str, Any], *, prefix: str = "") -> None:
    """Loads a ``torch.nn.Linear`` state dict into an NNX linear layer, in place.

    Works for ``jaxext.nnx.Linear`` and ``flax.nnx.Linear``. Values are cast to
    the layer's parameter dtype; metadata (e.g. sharding) of the parameters is kept.

    Args:
        layer: module with ``kernel`` (and ``bias``) ``nnx.Param`` attributes.
        state_dict: see :func:`torch_linear_to_params`.
        prefix: key prefix of the layer inside a larger state dict.

    Raises:
        ValueError: if shapes differ from the layer's, or exactly one of the
            state dict and the layer has a bias.

    Example:
        >>> import numpy as np
        >>> from flax import nnx
        >>> import jaxext.nnx
        >>> layer = jaxext.nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        >>> jaxext.load_torch_linear(layer, {"weight": np.ones((2, 3)), "bias": np.zeros(2)})
        >>> float(layer.kernel[...].sum())
        6.0
    """
    params = torch_linear_to_params(state_dict, prefix=prefix)
    layer_bias = getattr(layer, "bias", None)
    if ("bias" in params) != (layer_bias is not None):
        has = "has" if "bias" in params else "has no"
        raise ValueError(
            f"`state_dict` {has} {prefix + 'bias'!r} but the layer's use_bias is "
            f"{layer_bias is not None}."
        )
    for name, value in params.items():
        variable = getattr(layer, name)
        current = variable[...]
        if value.shape != current.shape:
            raise ValueError(
                f"`state_dict` gives {name} shape {value.shape} (flax layout) but the layer's "
                f"{name} has shape {current.shape}."
            )
        variable[...] = _as_jax(value, current)


def _as_jax(value: np.ndarray, like: jax.Array) -> jax.Array:
    array = jnp.asarray(value, dtype=like.dtype)
    sharding = getattr(like, "sharding", None)
    return jax.device_put(array, sharding) if sharding is not None else array


def export_torch_linear(source: Any, *, prefix: str = "", as_torch: bool = False) -> dict[str, Any]:
    """Exports a linear layer's parameters as a ``torch.nn.Linear`` state dict.

    Args:
        source: an NNX linear layer (``jaxext.nnx.Linear``, ``flax.nnx.Linear``),
            or Linen parameters of a dense layer: ``{"kernel", "bias"}``, or the
            whole variables ``{"params": {"kernel", "bias"}}``.
        prefix: key prefix to prepend, e.g. ``"fc."``.
        as_torch: return ``torch.Tensor`` values (imports PyTorch) instead of
            NumPy arrays.

    Returns:
        ``{f"{prefix}weight": (out, in)}`` plus ``f"{prefix}bias": (out,)`` if the
        layer has a bias; values in the parameters' dtype, contiguous.

    Raises:
        ValueError: if ``source`` has no 2-D ``kernel``.
        ImportError: if ``as_torch`` and PyTorch is not installed.

    Example:
        >>> import numpy as np
        >>> import jaxext
        >>> sd = jaxext.export_torch_linear({"kernel": np.ones((3, 2)), "bias": np.zeros(2)})
        >>> sd["weight"].shape
        (2, 3)
    """
    if isinstance(source, Mapping):
        params = source["params"] if "params" in source and "kernel" not in source else source
        kernel, bias = params.get("kernel"), params.get("bias")
        kernel, bias = _unbox(kernel), _unbox(bias)
    else:
        kernel = getattr(source, "kernel", None)
        bias = getattr(source, "bias", None)
        kernel = None if kernel is None else kernel[...]
        bias = None if bias is None else bias[...]
    if kernel is None or np.ndim(kernel) != 2:
        raise ValueError(
            "`source` must be an NNX linear layer or a params mapping with a 2-D `kernel`; "
            f"got {type(source).__name__}."
        )
    state = {f"{prefix}weight": np.ascontiguousarray(np.asarray(kernel).T)}
    if bias is not None:
        state[f"{prefix}bias"] = np.ascontiguousarray(np.asarray(bias))
    if as_torch:
        state = {key: _numpy_to_torch(value) for key, value in state.items()}
    return state


def _unbox(value: Any) -> Any:
    # An nnx.Variable (from nnx.state) holds its array behind get_value(); Linen's
    # nn.with_partitioning wraps parameters in a box with unbox().
    if hasattr(value, "get_value"):
        return value.get_value()
    return value.unbox() if hasattr(value, "unbox") else value


def _numpy_to_torch(array: np.ndarray) -> Any:
    torch = _torch()
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())
