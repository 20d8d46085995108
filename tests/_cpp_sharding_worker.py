"""Multi-device checks for ``tests/test_cpp_sharding.py``, run in a subprocess.

The C++ ops of ``jaxext.cpp_extension.ops`` (and handlers called with a
``partition`` rule) on a batch-sharded input over 8 forced CPU devices: values
and gradients against one-device float64 autodiff of the same math in plain
``jnp``, the shardings of the results, and the collectives in the compiled
program (an all-gather of the batch is what a kernel without a rule costs). As
``_sharding_worker.py``: JAX must see 8 devices from its first import, so
``XLA_FLAGS`` is set here; the script only measures and writes JSON, the
assertions live in the test module; a check that raises is recorded with its
traceback.

Usage: ``python tests/_cpp_sharding_worker.py OUTPUT.json``
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import contextlib  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _worker_util import (  # noqa: E402  (tests/, the script's directory)
    collective_counts,
    max_abs,
    max_abs_diff,
    rand,
    run_checks,
    specs,
)
from helpers import in_float64  # noqa: E402  (tests/, the script's directory)
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxext import cpp_extension  # noqa: E402
from jaxext.cpp_extension import ops  # noqa: E402

BATCH, N_IN, N_OUT = 16, 6, 4
CONSTANT = 2.5


# The ops measured: (the op, its plain-jnp reference, number of parameters: x and
# the weights). The loss is sum(tanh(op(params)) * ct), ct split like the output.
def _mul(x):
    return ops.mul_constant(x, CONSTANT)


def _mul_ref(x):
    return x * CONSTANT


def _mul_traced(x, c):
    return ops.mul_constant(x, c)  # c: a 0-d array, differentiable


def _mul_traced_ref(x, c):
    return x * c


def _linear(x, w, b):
    return ops.linear(x, w, b)


def _linear_ref(x, w, b):
    return x @ w.T + b


def _handler_with(rule):
    """The shipped mul_constant handler called with ``partition=rule``."""

    def call(x):
        return ops.extension().jaxext_mul_constant(
            x,
            np.asarray(CONSTANT, x.dtype),  # the constant: a 0-d operand of x's dtype
            result_shape_dtypes=jax.ShapeDtypeStruct(x.shape, x.dtype),
            partition=rule,
        )

    return call


_LOADED = {}


def _loaded_rule(x, w):
    """The shipped linear forward loaded with a rule given to ``load`` (a cached build)."""
    if "ext" not in _LOADED:
        _LOADED["ext"] = cpp_extension.load(
            "jaxext_ops", [ops.SOURCE], partition={"jaxext_linear_forward": "b i, o i, o -> b o"}
        )
    zeros = jnp.zeros((w.shape[0],), w.dtype)
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), x.dtype)
    return _LOADED["ext"].jaxext_linear_forward(x, w, zeros, result_shape_dtypes=out)


def _loaded_rule_ref(x, w):
    return x @ w.T


FUNCTIONS = {
    "mul_constant": (_mul, _mul_ref, 1),
    "mul_traced": (_mul_traced, _mul_traced_ref, 2),  # the constant replicated, P()
    "linear": (_linear, _linear_ref, 3),
    "batch_rule": (_handler_with("batch"), _mul_ref, 1),  # forward only: no gradient
    "no_rule": (_handler_with(None), _mul_ref, 1),  # what a kernel that says nothing costs
    "load_rule": (_loaded_rule, _loaded_rule_ref, 2),  # forward only: no gradient
}


def arrays_for(name, batch_shape=(BATCH,)):
    x = rand(0, (*batch_shape, N_IN))
    if name in ("mul_constant", "batch_rule", "no_rule"):
        return [x, rand(3, x.shape)]
    if name == "mul_traced":
        return [x, np.asarray(-1.25, np.float32), rand(3, x.shape)]
    params = [rand(1, (N_OUT, N_IN)) / np.sqrt(N_IN)]
    if name == "linear":
        params.append(rand(2, (N_OUT,)))
    return [x, *params, rand(3, (*batch_shape, N_OUT))]


def check(name, axes, jit=True, batch_shape=(BATCH,)):
    """Forward and ``grad`` of a loss of the op on x (and ct) split over ``data``.

    ``axes``: ``"explicit"`` (an explicit-axes mesh entered with ``jax.set_mesh``) or
    ``"auto"`` (plain ``NamedSharding`` inputs on an auto-axes mesh, no mesh context).
    """
    op, reference, n_params = FUNCTIONS[name]
    differentiable = name in ("mul_constant", "mul_traced", "linear")
    axis_type = AxisType.Explicit if axes == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    arrays = arrays_for(name, batch_shape)
    spec = [P("data")] + [P()] * (n_params - 1) + [P("data")]
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, spec, strict=True)]
    argnums = tuple(range(n_params))

    def loss_of(f):
        return lambda *a: jnp.sum(jnp.tanh(f(*a[:-1])) * a[-1])

    loss, loss_ref = loss_of(op), loss_of(reference)
    context = jax.set_mesh(mesh) if axes == "explicit" else contextlib.nullcontext()
    run = jax.jit if jit else (lambda f: f)
    with context:
        out = run(op)(*args[:n_params])
        result = {
            "out_diff": max_abs_diff(out, in_float64(reference, *arrays[:n_params])),
            "out_scale": max_abs(in_float64(reference, *arrays[:n_params])),
            "out_spec": specs(out)[0],
            "loss": [float(run(loss)(*args)), float(in_float64(loss_ref, *arrays))],
        }
        if jit:
            result["forward_collectives"] = collective_counts(op, *args[:n_params])
        if differentiable:
            grad, grad_ref = jax.grad(loss, argnums), jax.grad(loss_ref, argnums)
            grads = run(grad)(*args)
            want = in_float64(grad_ref, *arrays)
            result.update(
                grad_diff=max_abs_diff(grads, want),
                grad_scale=max_abs(want),
                grad_specs=specs(grads),
                param_specs=specs(args[:n_params]),
            )
            if jit:
                result["backward_collectives"] = collective_counts(grad, *args)
                result["plain_backward_collectives"] = collective_counts(grad_ref, *args)
    return result


ENSEMBLE = 2


def check_ensemble(jit=True):
    """``jax.vmap`` of ``ops.linear`` over an ensemble axis split over the mesh axis
    ``ens``, each member's rows split over ``data`` (a 2 x 4 explicit mesh): values,
    the gradient of every parameter, and the shardings (the ensemble axis stays split)."""
    mesh = jax.make_mesh((ENSEMBLE, 4), ("ens", "data"), axis_types=(AxisType.Explicit,) * 2)
    x = rand(0, (ENSEMBLE, BATCH, N_IN))
    w = rand(1, (ENSEMBLE, N_OUT, N_IN)) / np.sqrt(N_IN)
    b, ct = rand(2, (ENSEMBLE, N_OUT)), rand(3, (ENSEMBLE, BATCH, N_OUT))
    arrays = [x, w, b, ct]
    spec = [P("ens", "data"), P("ens"), P("ens"), P("ens", "data")]
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, spec, strict=True)]

    def loss_of(f):
        return lambda x, w, b, ct: jnp.sum(jnp.tanh(jax.vmap(f)(x, w, b)) * ct)

    run = jax.jit if jit else (lambda f: f)
    with jax.set_mesh(mesh):
        out = run(jax.vmap(_linear))(*args[:3])
        want = in_float64(jax.vmap(_linear_ref), *arrays[:3])
        grads = run(jax.grad(loss_of(_linear), (0, 1, 2)))(*args)
        grads_ref = in_float64(jax.grad(loss_of(_linear_ref), (0, 1, 2)), *arrays)
        return {
            "out_diff": max_abs_diff(out, want),
            "out_scale": max_abs(want),
            "out_spec": specs(out)[0],
            "loss": [
                float(run(loss_of(_linear))(*args)),
                float(in_float64(loss_of(_linear_ref), *arrays)),
            ],
            "grad_diff": max_abs_diff(grads, grads_ref),
            "grad_scale": max_abs(grads_ref),
            "grad_specs": specs(grads),
            "param_specs": specs(args[:3]),
        }


CHECKS = {
    f"{name}_{axes}_{mode}": (lambda n=name, a=axes, m=mode: check(n, a, jit=(m == "jit")))
    for name in ("mul_constant", "linear")
    for axes in ("explicit", "auto")
    for mode in ("jit", "eager")
}
CHECKS.update(
    {
        "linear_explicit_jit_3d": lambda: check("linear", "explicit", batch_shape=(BATCH, 3)),
        "batch_rule_explicit_jit": lambda: check("batch_rule", "explicit"),
        "no_rule_explicit_jit": lambda: check("no_rule", "explicit"),
        "mul_traced_explicit_jit": lambda: check("mul_traced", "explicit"),
        "mul_traced_explicit_eager": lambda: check("mul_traced", "explicit", jit=False),
        "load_rule_explicit_jit": lambda: check("load_rule", "explicit"),
        "linear_ensemble_explicit_jit": check_ensemble,
        "linear_ensemble_explicit_eager": lambda: check_ensemble(jit=False),
    }
)


if __name__ == "__main__":
    run_checks(CHECKS, sys.argv[1])
