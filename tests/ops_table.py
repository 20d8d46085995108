"""The library's ops in one table, read by every test file that loops over ops.

A third op registers here once, with its cases for each such test:

- ``fn`` and ``reference``: the jaxext function and the plain ``jnp`` math it computes
  (differentiated by JAX's own autodiff), with the same signature;
  ``tests/test_custom_vjp.py`` runs every transformation of both on ``arrays``.
- ``float64_cases``: every entry point of the op (function, the porting guide's
  ``Function``, the NNX and Linen layers) as ``id -> build``, ``build()`` returning
  ``(function, float64 args)``: ``tests/test_check_grads.py`` holds
  ``jax.test_util.check_grads`` and ``jaxext.gradcheck`` to them.
- ``opcheck_cases``: ``id -> build`` of the same kind, each one a full ``jaxext.opcheck``
  run in ``tests/test_opcheck.py`` (so fewer of them).
- ``complex_cases``: ``(id, jaxext function, plain function, args)`` with complex
  factors on real inputs, for ``tests/test_complex_gradients.py``.
- ``cpp``: ``build(ops, rng) -> (function, args)``, a call of its C++ kernel in
  ``jaxext.cpp_extension.ops``; ``tests/test_cpp_extension.py`` runs ``opcheck`` on it
  and ``tests/test_cpp_sharding.py`` its sharding cases (``tests/_cpp_sharding_worker.py``
  holds those cases by the same name).

The test ids are ``{id}`` in each test's own naming, so they stay what they were.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import LinearFunction, MulConstant, rand, reference_linear

import jaxext
import jaxext.linen
import jaxext.nnx

F64 = np.float64


def f64(seed, shape):
    """Deterministic standard-normal float64 data (``rand`` in float64)."""
    return rand(seed, shape, F64)


@dataclass(frozen=True)
class Op:
    """One op of the library and its cases (see the module docstring)."""

    name: str
    fn: Callable
    reference: Callable
    arrays: Callable[[np.random.Generator], tuple]
    float64_cases: dict[str, Callable[[], tuple]] = field(default_factory=dict)
    opcheck_cases: dict[str, Callable[[], tuple]] = field(default_factory=dict)
    complex_cases: list[tuple] = field(default_factory=list)
    cpp: Callable | None = None


# -- layers as functions of their parameters and inputs (float64) ------------------------


def nnx_case(make_layer, x_shape):
    """A fresh NNX layer as ``f(params, x)``, ``params`` a plain dict of arrays."""

    def build():
        nnx = pytest.importorskip("flax.nnx")
        graphdef, state = nnx.split(make_layer(nnx))

        def f(params, x):
            layer_state = jax.tree.map(lambda leaf: leaf, state)
            nnx.replace_by_pure_dict(layer_state, params)
            return nnx.merge(graphdef, layer_state)(x)

        return f, (nnx.to_pure_dict(state), f64(5, x_shape))

    return build


def linen_case(make_layer, x_shape):
    """A Linen layer as ``f(params, x)`` (or ``f(x)`` when it has no parameters)."""

    def build():
        pytest.importorskip("flax.linen")
        layer = make_layer()
        x = f64(5, x_shape)
        params = layer.init(jax.random.key(0), x).get("params", {})
        if not params:
            return (lambda x: layer.apply({}, x)), (x,)
        return (lambda params, x: layer.apply({"params": params}, x)), (params, x)

    return build


def _nnx_linear_opcheck():
    nnx = pytest.importorskip("flax.nnx")
    graphdef, params = nnx.split(jaxext.nnx.Linear(3, 2, rngs=nnx.Rngs(0)))

    def apply(params, x):
        return nnx.merge(graphdef, params)(x)

    return apply, (jax.tree_util.tree_map(np.asarray, params), f64(1, (4, 3)))


def _linen_dense_opcheck():
    pytest.importorskip("flax.linen")
    layer = jaxext.linen.Dense(2)
    params = layer.init(jax.random.key(0), jnp.ones((1, 3)))["params"]

    def apply(params, x):
        return layer.apply({"params": params}, x)

    return apply, (jax.tree_util.tree_map(np.asarray, params), f64(1, (4, 3)))


# -- linear --------------------------------------------------------------------------------

BATCH_SHAPES = {"1d": (3,), "2d": (5, 3), "3d": (2, 4, 3)}


def _linear_arrays(rng):
    x, w, b = (rng.standard_normal(s) for s in ((4, 3), (2, 3), (2,)))
    return x, w, b


def _linear(x_shape, out_features, use_bias):
    def build():
        x = f64(0, x_shape)
        w = f64(1, (out_features, x_shape[-1]))
        if use_bias:
            return jaxext.linear, (x, w, f64(2, (out_features,)))
        return jaxext.linear, (x, w)

    return build


def _function_linear(use_bias):
    def build():
        x, w = f64(0, (5, 3)), f64(1, (4, 3))
        if use_bias:
            return LinearFunction.apply, (x, w, f64(2, (4,)))
        return (lambda x, w: LinearFunction.apply(x, w, None)), (x, w)

    return build


def _nnx_linear(use_bias, x_shape):
    def make(nnx):
        return jaxext.nnx.Linear(
            x_shape[-1], 4, use_bias=use_bias, param_dtype=F64, rngs=nnx.Rngs(0)
        )

    return nnx_case(make, x_shape)


def _linen_dense(use_bias, x_shape):
    return linen_case(lambda: jaxext.linen.Dense(4, use_bias=use_bias, param_dtype=F64), x_shape)


def _bias_name(use_bias):
    return "bias" if use_bias else "nobias"


_RNG = np.random.default_rng(0)
_X = _RNG.standard_normal((4, 3))
_W = _RNG.standard_normal((2, 3)) + 1j * _RNG.standard_normal((2, 3))
_B = _RNG.standard_normal(2) + 1j * _RNG.standard_normal(2)
_C = _RNG.standard_normal((4, 1)) + 1j * _RNG.standard_normal((4, 1))

LINEAR = Op(
    name="linear",
    fn=jaxext.linear,
    reference=reference_linear,
    arrays=_linear_arrays,
    float64_cases={
        **{
            f"linear-{name}-{_bias_name(bias)}": _linear(shape, 4, bias)
            for name, shape in BATCH_SHAPES.items()
            for bias in (True, False)
        },
        "linear-out1-bias": _linear((6, 3), 1, True),
        "Function-Linear-bias": _function_linear(True),
        "Function-Linear-nobias": _function_linear(False),
        **{
            f"nnx.Linear-{name}-{_bias_name(bias)}": _nnx_linear(bias, shape)
            for name, shape in BATCH_SHAPES.items()
            for bias in (True, False)
        },
        **{
            f"linen.Dense-{name}-{_bias_name(bias)}": _linen_dense(bias, shape)
            for name, shape in BATCH_SHAPES.items()
            for bias in (True, False)
        },
    },
    opcheck_cases={
        "jaxext.linear": lambda: (jaxext.linear, (f64(0, (4, 3)), f64(1, (2, 3)), f64(2, (2,)))),
        "nnx.Linear": _nnx_linear_opcheck,
        "linen.Dense": _linen_dense_opcheck,
        "Function": lambda: (LinearFunction.apply, (f64(0, (4, 3)), f64(1, (2, 3)))),
    },
    complex_cases=[
        ("linear x w", jaxext.linear, lambda x, w: x @ w.T, (_X, _W)),
        ("linear x w b", jaxext.linear, lambda x, w, b: x @ w.T + b, (_X, _W, _B)),
        ("linear x real-w b", jaxext.linear, lambda x, w, b: x @ w.T + b, (_X, _W.real, _B)),
    ],
    cpp=lambda ops, rng: (ops.linear, _linear_arrays(rng)),
)


# -- mul_constant --------------------------------------------------------------------------


def _mul_constant_arrays(rng):
    return rng.standard_normal((4, 3)), rng.standard_normal((3,))


def _mul_constant_static(constant):
    def build():
        return lambda x: jaxext.mul_constant(x, constant), (f64(0, (2, 3)),)

    return build


def _mul_constant_array(c_shape):
    def build():
        return jaxext.mul_constant, (f64(0, (2, 3)), f64(1, c_shape))

    return build


def _function_mul_constant():
    return (lambda x: MulConstant.apply(x, 2.5)), (f64(0, (2, 3)),)


def _nnx_mul_constant(learnable):
    return nnx_case(
        lambda nnx: jaxext.nnx.MulConstant(1.5, learnable=learnable, param_dtype=F64), (2, 3)
    )


def _linen_mul_constant(learnable):
    return linen_case(
        lambda: jaxext.linen.MulConstant(1.5, learnable=learnable, param_dtype=F64), (2, 3)
    )


def _linen_mul_constant_1j(x):
    return jaxext.linen.MulConstant(1j).apply({}, x)


MUL_CONSTANT = Op(
    name="mul_constant",
    fn=jaxext.mul_constant,
    reference=lambda x, c: x * c,
    arrays=_mul_constant_arrays,
    float64_cases={
        "mul_constant-static-float": _mul_constant_static(2.5),
        "mul_constant-static-numpy": _mul_constant_static(np.float64(-3.0)),
        "mul_constant-static-int": _mul_constant_static(2),
        "mul_constant-array-scalar": _mul_constant_array(()),
        "mul_constant-array-broadcast": _mul_constant_array((3,)),
        "mul_constant-array-full": _mul_constant_array((2, 3)),
        "Function-MulConstant": _function_mul_constant,
        "nnx.MulConstant-static": _nnx_mul_constant(False),
        "nnx.MulConstant-learnable": _nnx_mul_constant(True),
        "linen.MulConstant-static": _linen_mul_constant(False),
        "linen.MulConstant-learnable": _linen_mul_constant(True),
    },
    opcheck_cases={
        "jaxext.mul_constant_static": lambda: (jaxext.mul_constant, (f64(0, (4, 3)), 2.5)),
        "jaxext.mul_constant_array": lambda: (
            jaxext.mul_constant,
            (f64(0, (4, 3)), np.array([0.5, 2.0, -1.0])),
        ),
        # A 0-d float input (a learnable scale): its expected gradients are NumPy scalars.
        "jaxext.mul_constant_0d": lambda: (jaxext.mul_constant, (f64(0, (4, 3)), np.array(2.0))),
    },
    complex_cases=[
        ("mul_constant 1j", lambda x: jaxext.mul_constant(x, 1j), lambda x: x * 1j, (_X,)),
        (
            "mul_constant 2-0.5j",
            lambda x: jaxext.mul_constant(x, 2 - 0.5j),
            lambda x: x * (2 - 0.5j),
            (_X,),
        ),
        ("mul_constant array", jaxext.mul_constant, lambda x, c: x * c, (_X, _C)),
        ("mul_constant real c", jaxext.mul_constant, lambda x, c: x * c, (_X * 1j, _X[:, :1])),
        ("nnx.MulConstant", jaxext.nnx.MulConstant(1j), lambda x: x * 1j, (_X,)),
        ("linen.MulConstant", _linen_mul_constant_1j, lambda x: x * 1j, (_X,)),
    ],
    cpp=lambda ops, rng: ((lambda x: ops.mul_constant(x, 2.5)), (rng.standard_normal((2, 3)),)),
)


# -- rms_norm: ``fn`` runs its Pallas kernels in interpret mode (every transformation of
# tests/test_custom_vjp.py, so few and small cases); the default implementation (plain XLA on
# CPU, the kernels lowered by opcheck's platform rows) is the opcheck case. Its layers are
# compared with Flax's in tests/test_rms_norm.py -------------------------------------------


def _rms_norm_reference(x, weight, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rms_norm_arrays(rng):
    return rng.standard_normal((4, 3)), rng.standard_normal((3,)) + 1.0


def _rms_scale_init(key, shape, dtype):
    return jax.random.normal(key, shape, dtype) + 1.0  # not all ones: a real weight gradient


def _rms_norm_interpret(x, weight, eps=1e-6):
    return jaxext.rms_norm(x, weight, eps, implementation="interpret")


RMS_NORM = Op(
    name="rms_norm",
    fn=_rms_norm_interpret,
    reference=_rms_norm_reference,
    arrays=_rms_norm_arrays,
    float64_cases={
        "rms_norm-2d": lambda: (jaxext.rms_norm, (f64(0, (5, 3)), f64(1, (3,)))),
        "rms_norm-2d-interpret": lambda: (_rms_norm_interpret, (f64(0, (5, 3)), f64(1, (3,)))),
    },
    opcheck_cases={
        "jaxext.rms_norm": lambda: (jaxext.rms_norm, (f64(0, (4, 3)), f64(1, (3,)))),
    },
)


OPS = [LINEAR, MUL_CONSTANT, RMS_NORM]
OPS_BY_NAME = {op.name: op for op in OPS}
CPP_OPS = [op.name for op in OPS if op.cpp is not None]
