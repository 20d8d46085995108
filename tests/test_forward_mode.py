"""Forward mode through jaxext's hand-written backwards equals plain autodiff.

``jaxext.custom_vjp`` derives ``jvp``, ``jacfwd``, ``linearize`` and ``hessian``
by transposing the hand-written ``bwd`` (or from a user ``jvp`` rule). Every
check here runs in float64 and compares with JAX's own autodiff of an
independent reference (``helpers.reference_linear``, ``x * c``, flax's layers,
plain ``jnp`` code), never with the code under test.

How: an op is viewed as a function of one flat vector holding the differentiated
inputs (the others are closed over, so the op sees exactly that subset perturbed).
The reference's Jacobian, second derivative, and the gradient and Hessian of the
loss ``sum(sin(y))`` are computed once per input configuration with respect to all
inputs; each transform's expected value is a sub-block of those (contracted with the
tangent in NumPy where needed).

Tolerance: both sides compute the same sums of at most a few dozen O(1) float64
products, possibly in another order, so they agree to a few ulps times the number
of terms, far below ``TOL`` (1e-12, ~5000 ulps of 1.0).

Cost: XLA compilation dominates, so each case is one jitted program holding all its
transforms; the full grids run under ``jit``, ``vmap`` and eager (un-jitted)
evaluation on smaller grids.
"""

from __future__ import annotations

import functools
import itertools

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    FLOAT64_TOL,
    LinearFunction,
    MulConstant,
    OnceCube,
    grid,
    rand,
    reference_linear,
    uses_custom_rule,
)
from jax.flatten_util import ravel_pytree

import jaxext

TOL = FLOAT64_TOL  # 1e-12: the float64 rule of tests/helpers.py

# XLA's optimisation passes take most of these tests' time and are not what they test
# (the derivative programs are): compile with them turned down.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def run_jitted(fn, *args):
    """``jax.jit(fn)(*args)``, compiled with ``FAST_COMPILE``."""
    return jax.jit(fn).lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


# -- helpers ---------------------------------------------------------------------------


def subsets(n):
    """Every non-empty subset of ``range(n)``, as sorted tuples."""
    return [s for k in range(1, n + 1) for s in itertools.combinations(range(n), k)]


def as_vector_function(op, args, argnums):
    """``op`` as a function of one flat float vector holding the arguments in ``argnums``.

    The other arguments are closed over (constants, never perturbed), so the custom
    rule sees exactly the subset ``argnums`` differentiated. Returns ``(f, v0)``
    with ``f(v)`` the output (all outputs) raveled and ``v0`` the flat argument values.
    """
    v0, unravel = ravel_pytree(tuple(args[i] for i in argnums))

    def f(v):
        full = list(args)
        for i, value in zip(argnums, unravel(v), strict=True):
            full[i] = value
        return jnp.concatenate([jnp.ravel(y) for y in jax.tree.leaves(op(*full))])

    return f, v0


def _loss(f):
    return lambda v: jnp.sum(jnp.sin(f(v)))


def _linearized(f, v, t):
    y, f_jvp = jax.linearize(f, v)
    return y, f_jvp(t)


def _grad_of_jvp(f, v, t):
    # Reverse over forward, with respect to the primal and to the tangent.
    return jax.grad(lambda v, t: jnp.sum(jnp.sin(jax.jvp(f, (v,), (t,))[1])), (0, 1))(v, t)


# Each transform of ``f: R^n -> R^m`` at ``v`` with tangent ``t``.
TRANSFORMS = {
    "jvp": lambda f, v, t: jax.jvp(f, (v,), (t,)),
    "linearize": _linearized,
    "jacfwd": lambda f, v, t: jax.jacfwd(f)(v),
    "hessian": lambda f, v, t: jax.hessian(_loss(f))(v),
    "jacfwd(jacrev)": lambda f, v, t: jax.jacfwd(jax.jacrev(f))(v),
    "jacrev(jacfwd)": lambda f, v, t: jax.jacrev(jax.jacfwd(f))(v),
    "vmap(jvp)": lambda f, v, t: jax.vmap(lambda t: jax.jvp(f, (v,), (t,))[1])(
        jnp.stack([t, 2.0 * t + 1.0])
    ),
    "jvp(grad)": lambda f, v, t: jax.jvp(jax.grad(_loss(f)), (v,), (t,)),
    "grad(jvp)": _grad_of_jvp,
}
# CORE runs on most cases; the other transforms (compositions of the same rules) on the
# cases with the most structure. UNDER_VMAP: checked with the whole computation vmapped.
CORE = ("jvp", "linearize", "jacfwd", "hessian", "jacrev(jacfwd)")
UNDER_VMAP = (*CORE, "jacfwd(jacrev)")


def forward_mode(f, v, t, names):
    """The transforms ``names`` of ``f`` at ``v`` (tangent ``t``), by name."""
    return {name: TRANSFORMS[name](f, v, t) for name in names}


def assert_trees_close(actual, expected, tol=TOL, what=""):
    """Same structure, shapes and dtypes; values within ``tol`` (relative and absolute)."""
    helpers.assert_trees_close(actual, expected, tol=tol, same_dtypes=True, err_msg=what)


def full_reference(ref, args):
    """Plain autodiff of ``ref`` with respect to all ``args``, raveled into one vector ``v``.

    Returns NumPy arrays: the output ``y``, the Jacobian ``J``, the second derivative
    ``T`` of ``f`` (``T[i, j, k] = d2 y_i / dv_j dv_k``), and the gradient ``g`` and
    Hessian ``H`` of the scalar loss ``sum(sin(y))``. One compiled program serves
    every subset of differentiated inputs: their derivatives are sub-blocks.
    """
    f, v0 = as_vector_function(ref, args, tuple(range(len(args))))
    loss = _loss(f)

    def derivatives(v):
        return {
            "y": f(v),
            "J": jax.jacfwd(f)(v),
            "T": jax.hessian(f)(v),
            "g": jax.grad(loss)(v),
            "H": jax.hessian(loss)(v),
        }

    return jax.tree.map(np.asarray, run_jitted(derivatives, v0))


def expected_transforms(full, args, argnums, t, names):
    """What each transform of ``TRANSFORMS`` gives for the inputs ``argnums``, from ``full``."""
    sizes = [np.size(a) for a in args]
    offsets = np.cumsum([0, *sizes])
    idx = np.concatenate(
        [np.arange(offsets[i], offsets[i + 1]) for i in argnums] + [np.zeros(0, int)]
    )
    t = np.asarray(t)
    jac, hess_f = full["J"][:, idx], full["T"][:, idx][:, :, idx]
    hess, grad, y = full["H"][np.ix_(idx, idx)], full["g"][idx], full["y"]
    u = jac @ t
    ts = np.stack([t, 2.0 * t + 1.0])
    table = {
        "jvp": (y, u),
        "linearize": (y, u),
        "jacfwd": jac,
        "hessian": hess,
        "jacfwd(jacrev)": hess_f,
        "jacrev(jacfwd)": hess_f,
        "vmap(jvp)": ts @ jac.T,
        "jvp(grad)": (grad, hess @ t),
        "grad(jvp)": (np.einsum("i,ijk,k->j", np.cos(u), hess_f, t), jac.T @ np.cos(u)),
    }
    return {name: table[name] for name in names}


def check_forward_mode(op, full, args, argnums, wrapper="jit", names=CORE, seed=0):
    """The transforms ``names`` of ``op`` equal plain autodiff's (``full``, a sub-block each).

    ``wrapper`` is ``"jit"`` or ``"eager"`` (un-jitted). ``full`` is
    :func:`full_reference` of an independent implementation at ``args``.
    """
    f, v0 = as_vector_function(op, args, argnums)
    assert uses_custom_rule(f, v0)
    t = jnp.asarray(rand(seed, v0.shape, np.float64))
    run = functools.partial(forward_mode, f, names=names)
    got = run_jitted(run, v0, t) if wrapper == "jit" else run(v0, t)
    want = expected_transforms(full, args, argnums, t, (*names, "jacfwd"))
    for name in names:
        assert_trees_close(got[name], want[name], what=name)
    # The reference is not trivially zero, so the comparison has teeth.
    assert v0.size == 0 or np.size(full["y"]) == 0 or np.any(want["jacfwd"] != 0)


def check_forward_mode_under_vmap(op, ref, args, argnums, names=UNDER_VMAP, seed=0):
    """As :func:`check_forward_mode`, the whole computation vmapped over two points."""
    f, v0 = as_vector_function(op, args, argnums)
    f_ref, _ = as_vector_function(ref, args, argnums)
    vs = jnp.stack([v0, v0 + jnp.asarray(rand(seed + 1, v0.shape, np.float64))])
    ts = jnp.stack([jnp.asarray(rand(seed, v0.shape, np.float64)), -0.5 * v0])

    def both(v, t):
        return forward_mode(f, v, t, names), forward_mode(f_ref, v, t, names)

    got, want = run_jitted(jax.vmap(both), vs, ts)
    for name in names:
        assert_trees_close(got[name], want[name], what=name)


# -- jaxext.linear ---------------------------------------------------------------------

BATCH_SHAPES = [(), (5,), (2, 3), (0,)]


def linear_args(batch_shape, use_bias, in_features=3, out_features=2, seed=0):
    x = jnp.asarray(rand(seed, (*batch_shape, in_features), np.float64))
    w = jnp.asarray(rand(seed + 1, (out_features, in_features), np.float64))
    b = jnp.asarray(rand(seed + 2, (out_features,), np.float64))
    return (x, w, b) if use_bias else (x, w)


@functools.cache
def linear_reference(batch_shape, use_bias):
    return full_reference(reference_linear, linear_args(batch_shape, use_bias))


@pytest.mark.parametrize(
    *grid(
        use_bias=[True, False],
        batch_shape=BATCH_SHAPES,
        argnums=subsets(3),
        where=lambda use_bias, batch_shape, argnums: use_bias or 2 not in argnums,
        corners=[dict(use_bias=True, batch_shape=(2, 3), argnums=(0, 1, 2))],
        ids={
            "use_bias": lambda b: "bias" if b else "nobias",
            "batch_shape": lambda s: f"batch{s}",
            "argnums": lambda a: f"d{a}",
        },
    )
)
def test_linear_forward_mode(use_bias, batch_shape, argnums, x64):
    args = linear_args(batch_shape, use_bias)
    # Every transform on the case with most batch axes, the core ones on a 1-D x, fewer
    # on the plain matrix case and on an empty batch (whose second derivatives are empty).
    names = {
        (2, 3): tuple(TRANSFORMS),
        (): CORE,
        (5,): ("jvp", "jacfwd", "hessian"),
        (0,): ("jvp", "jacfwd"),
    }[batch_shape]
    full = linear_reference(batch_shape, use_bias)
    check_forward_mode(jaxext.linear, full, args, argnums, names=names)


@pytest.mark.parametrize("argnums", [(0,), (1,), (0, 1, 2)], ids=lambda a: f"d{a}")
def test_linear_forward_mode_under_vmap(argnums, x64):
    args = linear_args((2,), use_bias=True)
    check_forward_mode_under_vmap(jaxext.linear, reference_linear, args, argnums)


def test_linear_forward_mode_eager(x64):
    args = linear_args((2,), use_bias=True)
    full = full_reference(reference_linear, args)
    check_forward_mode(jaxext.linear, full, args, (0, 1, 2), "eager", ("jvp", "jacfwd"))


# -- jaxext.mul_constant -----------------------------------------------------------------

STATIC_CONSTANTS = {
    "float": 2.5,
    "int": -3,
    "np.float64": np.float64(0.5),
    "np.float32": np.float32(1.5),
}


@pytest.mark.parametrize(
    ("constant", "x_shape"),
    [(name, (2, 3)) for name in STATIC_CONSTANTS] + [("float", ()), ("int", (0, 3))],
    ids=str,
)
def test_mul_constant_static_forward_mode(constant, x_shape, x64):
    c = STATIC_CONSTANTS[constant]
    args = (jnp.asarray(rand(0, x_shape, np.float64)),)
    full = full_reference(lambda x: x * c, args)
    check_forward_mode(lambda x: jaxext.mul_constant(x, c), full, args, (0,))


# (x shape, constant shape): scalar, leading-axis and two-sided broadcasting, a constant
# of higher rank than x, and an empty x (trailing broadcasting: the vmap test below).
BROADCAST_SHAPES = [
    ((2, 3), ()),
    ((2, 3), (2, 1)),
    ((3,), (2, 3)),
    ((2, 1), (1, 3)),
    ((0, 3), (3,)),
]


@functools.cache
def mul_array_reference(x_shape, c_shape):
    return full_reference(jnp.multiply, mul_array_args(x_shape, c_shape))


def mul_array_args(x_shape, c_shape):
    return (jnp.asarray(rand(0, x_shape, np.float64)), jnp.asarray(rand(1, c_shape, np.float64)))


@pytest.mark.parametrize("argnums", subsets(2), ids=lambda a: f"d{a}")
@pytest.mark.parametrize(("x_shape", "c_shape"), BROADCAST_SHAPES, ids=str)
def test_mul_constant_array_forward_mode(x_shape, c_shape, argnums, x64):
    args = mul_array_args(x_shape, c_shape)
    full = mul_array_reference(x_shape, c_shape)
    names = tuple(TRANSFORMS) if (x_shape, c_shape) == ((2, 1), (1, 3)) else CORE
    check_forward_mode(jaxext.mul_constant, full, args, argnums, names=names)


def test_mul_constant_numpy_array_constant_forward_mode(x64):
    # A NumPy array constant is not traced: only x is differentiated.
    c = rand(1, (3,), np.float64)
    args = (jnp.asarray(rand(0, (2, 3), np.float64)),)
    full = full_reference(lambda x: x * c, args)
    check_forward_mode(lambda x: jaxext.mul_constant(x, c), full, args, (0,))


@pytest.mark.parametrize("argnums", subsets(2), ids=lambda a: f"d{a}")
def test_mul_constant_forward_mode_under_vmap(argnums, x64):
    args = mul_array_args((2, 3), (3,))
    check_forward_mode_under_vmap(jaxext.mul_constant, jnp.multiply, args, argnums)


@pytest.mark.parametrize("constant", [2.5, "array"])
def test_mul_constant_forward_mode_eager(constant, x64):
    if constant == "array":
        args = mul_array_args((2, 3), (3,))
        op, ref = jaxext.mul_constant, jnp.multiply
    else:
        args = (jnp.asarray(rand(0, (2, 3), np.float64)),)
        op, ref = (lambda x: jaxext.mul_constant(x, 2.5)), (lambda x: x * 2.5)
    argnums = tuple(range(len(args)))
    full = full_reference(ref, args)
    names = ("jvp", "jacfwd") if constant == "array" else ("jvp",)
    check_forward_mode(op, full, args, argnums, "eager", names)


# -- the Flax layers -----------------------------------------------------------------------


def assert_layer_derivatives_match(loss, loss_ref, apply, apply_ref, params, params_ref, x):
    """Hessian of the loss in the params, jvp in (params, x): jaxext's vs flax's."""
    tangents = jax.tree.map(lambda a: jnp.cos(a) + 0.5, (params, x))

    def derivatives(loss, apply, params):
        hessian = jax.hessian(loss)(params, x)
        return hessian, jax.jvp(apply, (params, x), tangents)

    got = run_jitted(lambda p: derivatives(loss, apply, p), params)
    want = run_jitted(lambda p: derivatives(loss_ref, apply_ref, p), params_ref)
    assert_trees_close(jax.tree.leaves(got), jax.tree.leaves(want))
    assert "jaxext_custom_vjp_tangent" in str(jax.make_jaxpr(jax.hessian(loss))(params, x))


def test_nnx_mlp_hessian_matches_flax(x64):
    from flax import nnx

    import jaxext.nnx

    class Scale(nnx.Module):  # flax has no MulConstant: the plain-jnp reference
        def __init__(self, constant, *, learnable=False, param_dtype=jnp.float32):
            self.constant = constant
            self.scale = nnx.Param(jnp.asarray(constant, param_dtype)) if learnable else None

        def __call__(self, x):
            return x * (self.constant if self.scale is None else self.scale[...])

    class MLP(nnx.Module):
        def __init__(self, linear, mul, rngs):
            # A layer with a (non-zero) bias, one without.
            bias_init = nnx.initializers.normal(1.0)
            self.l1 = linear(3, 4, bias_init=bias_init, param_dtype=jnp.float64, rngs=rngs)
            self.double = mul(2.0)
            self.l2 = linear(4, 2, use_bias=False, param_dtype=jnp.float64, rngs=rngs)
            self.scale = mul(0.5, learnable=True, param_dtype=jnp.float64)

        def __call__(self, x):
            return self.scale(self.l2(self.double(jnp.tanh(self.l1(x)))))

    model = MLP(jaxext.nnx.Linear, jaxext.nnx.MulConstant, nnx.Rngs(0))
    model_ref = MLP(nnx.Linear, Scale, nnx.Rngs(0))
    x = jnp.asarray(rand(0, (5, 3), np.float64))

    def functions(model):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def apply(params, x):
            return nnx.merge(graphdef, params, rest)(x)

        def loss(params, x):
            return jnp.sum(jnp.sin(apply(params, x)))

        return loss, apply, params

    loss, apply, params = functions(model)
    loss_ref, apply_ref, params_ref = functions(model_ref)
    assert jax.tree.structure(params) == jax.tree.structure(params_ref)
    assert_trees_close(params, params_ref, tol=0)
    assert_layer_derivatives_match(loss, loss_ref, apply, apply_ref, params, params_ref, x)


def test_linen_mlp_hessian_matches_flax(x64):
    from flax import linen as nn

    import jaxext.linen

    class Scale(nn.Module):  # flax has no MulConstant: the plain-jnp reference
        constant: float
        learnable: bool = False
        param_dtype: object = jnp.float32

        @nn.compact
        def __call__(self, x):
            if not self.learnable:
                return x * self.constant
            init = lambda _key: jnp.asarray(self.constant, self.param_dtype)  # noqa: E731
            return x * self.param("scale", init)

    class MLP(nn.Module):
        dense: type
        mul: type

        @nn.compact
        def __call__(self, x):
            # A layer with a (non-zero) bias, one without.
            bias_init = nn.initializers.normal(1.0)
            dense1 = self.dense(4, bias_init=bias_init, param_dtype=jnp.float64, name="l1")
            dense2 = self.dense(2, use_bias=False, param_dtype=jnp.float64, name="l2")
            x = dense2(self.mul(2.0, name="double")(jnp.tanh(dense1(x))))
            return self.mul(0.5, learnable=True, param_dtype=jnp.float64, name="scale")(x)

    model = MLP(jaxext.linen.Dense, jaxext.linen.MulConstant)
    model_ref = MLP(nn.Dense, Scale)
    x = jnp.asarray(rand(0, (5, 3), np.float64))
    params = model.init(jax.random.key(0), x)["params"]
    params_ref = model_ref.init(jax.random.key(0), x)["params"]
    assert_trees_close(params, params_ref, tol=0)

    def functions(model):
        def apply(params, x):
            return model.apply({"params": params}, x)

        def loss(params, x):
            return jnp.sum(jnp.sin(apply(params, x)))

        return loss, apply

    loss, apply = functions(model)
    loss_ref, apply_ref = functions(model_ref)
    assert_layer_derivatives_match(loss, loss_ref, apply, apply_ref, params, params_ref, x)


# -- jaxext.Function -----------------------------------------------------------------------
# Forward mode of a Function without a `jvp` is the transpose of its `backward`.


@pytest.mark.parametrize("argnums", [(0,), (1,), (2,), (0, 1, 2)], ids=lambda a: f"d{a}")
def test_function_linear_port_forward_mode(argnums, x64):

    args = linear_args((5,), use_bias=True)
    full = linear_reference((5,), True)
    check_forward_mode(LinearFunction.apply, full, args, argnums)


@pytest.mark.parametrize("constant", [3.0, -2], ids=["float", "int"])
def test_function_mul_constant_port_forward_mode(constant, x64):

    args = (jnp.asarray(rand(0, (4, 2), np.float64)),)
    full = full_reference(lambda x: x * constant, args)
    check_forward_mode(lambda x: MulConstant.apply(x, constant), full, args, (0,))


class SinMul(jaxext.Function):
    """``sin(x) * y`` in PyTorch 2's style: forward without ctx, plus setup_context."""

    @staticmethod
    def forward(x, y):
        return jnp.sin(x) * y

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, y = inputs
        ctx.save_for_backward(x, y)

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        return grad * jnp.cos(x) * y, grad * jnp.sin(x)


class Cube(jaxext.Function):
    """``x ** 3``, its backward reading the older ``ctx.saved_variables``."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_variables
        return grad * 3 * x**2


class ExpWithJvp(jaxext.Function):
    """``exp(x) * y`` with a `jvp` reading what forward gave ``ctx.save_for_forward``."""

    @staticmethod
    def forward(ctx, x, y):
        out = jnp.exp(x) * y
        ctx.save_for_backward(out, x)
        # Saved inputs and outputs carry their derivatives into second order, as in torch
        # (an intermediate such as exp(x) would be a constant there, as in torch).
        ctx.save_for_forward(out, x)
        return out

    @staticmethod
    def backward(ctx, grad):
        out, x = ctx.saved_tensors
        return grad * out, grad * jnp.exp(x)

    @staticmethod
    def jvp(ctx, x_dot, y_dot):
        out, x = ctx.saved_tensors
        return x_dot * out + y_dot * jnp.exp(x)


class SinCos(jaxext.Function):
    """Two outputs."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)
        return jnp.sin(x), jnp.cos(x)

    @staticmethod
    def backward(ctx, grad_sin, grad_cos):
        (x,) = ctx.saved_tensors
        grad = jnp.zeros_like(x)
        if grad_sin is not None:
            grad = grad + grad_sin * jnp.cos(x)
        if grad_cos is not None:
            grad = grad - grad_cos * jnp.sin(x)
        return grad


class SinCosLazy(SinCos):
    """Zero cotangents arrive in backward as None."""

    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return SinCos.forward(ctx, x)


class SinCosWithJvp(SinCos):
    @staticmethod
    def jvp(ctx, x_dot):
        (x,) = ctx.saved_tensors
        return x_dot * jnp.cos(x), -x_dot * jnp.sin(x)


def _sin_cos(x):
    return jnp.sin(x), jnp.cos(x)


FUNCTIONS = {
    "setup_context": (SinMul.apply, lambda x, y: jnp.sin(x) * y, 2),
    "saved_variables": (Cube.apply, lambda x: x**3, 1),
    "jvp_method": (ExpWithJvp.apply, lambda x, y: jnp.exp(x) * y, 2),
    "two_outputs": (SinCos.apply, _sin_cos, 1),
    "materialize_grads_false": (SinCosLazy.apply, _sin_cos, 1),
    "jvp_method_two_outputs": (SinCosWithJvp.apply, _sin_cos, 1),
}


@pytest.mark.parametrize(
    ("function", "argnums"),
    [
        pytest.param(name, argnums, id=f"{name}-d{argnums}")
        for name, (*_, n) in FUNCTIONS.items()
        for argnums in subsets(n)
    ],
)
def test_function_forward_mode(function, argnums, x64):
    apply, ref, n = FUNCTIONS[function]
    args = tuple(jnp.asarray(rand(i, (2, 3), np.float64)) for i in range(n))
    full = full_reference(ref, args)
    names = tuple(TRANSFORMS) if argnums == (0, 1) else CORE
    check_forward_mode(apply, full, args, argnums, names=names)


class ExpScaledJvp(jaxext.Function):
    """``exp(x)`` whose `jvp` is deliberately twice the true one.

    Nothing else could produce the factor 2: the backward (and autodiff of the
    forward) give the true derivative, so a doubled tangent shows that forward
    mode USES the `jvp` method and reverse mode the `backward`.
    """

    @staticmethod
    def forward(ctx, x):
        out = jnp.exp(x)
        ctx.save_for_backward(out)
        ctx.save_for_forward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * out

    @staticmethod
    def jvp(ctx, x_dot):
        (out,) = ctx.saved_tensors
        return 2.0 * x_dot * out


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_function_jvp_method_is_used_for_forward_mode(jit, x64):
    x = jnp.asarray(rand(0, (3,), np.float64))
    t = jnp.asarray(rand(1, (3,), np.float64))
    maybe_jit = jax.jit if jit else (lambda f: f)
    y, y_dot = maybe_jit(lambda x, t: jax.jvp(ExpScaledJvp.apply, (x,), (t,)))(x, t)
    assert_trees_close((y, y_dot), (np.exp(x), 2.0 * np.exp(x) * t))
    jac = maybe_jit(jax.jacfwd(ExpScaledJvp.apply))(x)
    assert_trees_close(jac, 2.0 * np.diag(np.exp(x)))
    grad = maybe_jit(jax.grad(lambda x: ExpScaledJvp.apply(x).sum()))(x)
    assert_trees_close(grad, np.exp(x))


def _host_scale(g, x):
    return np.asarray(g) * np.cos(np.asarray(x))


class HostSin(jaxext.Function):
    """``sin(x)`` whose backward runs on the host (``pure_callback``): JAX cannot transpose it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        ctx.save_for_forward(jnp.cos(x))
        return jnp.sin(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        shape = jax.ShapeDtypeStruct(grad.shape, grad.dtype)
        return jax.pure_callback(_host_scale, shape, grad, x, vmap_method="broadcast_all")


class HostSinWithJvp(HostSin):
    @staticmethod
    def jvp(ctx, x_dot):
        (cos_x,) = ctx.saved_tensors
        return x_dot * cos_x


def test_function_jvp_method_gives_forward_mode_for_an_untransposable_backward(x64):
    x = jnp.asarray(rand(0, (4,), np.float64))
    t = jnp.asarray(rand(1, (4,), np.float64))
    assert_trees_close(jax.grad(lambda x: HostSin.apply(x).sum())(x), np.cos(x))
    got = jax.jit(lambda x, t: jax.jvp(HostSinWithJvp.apply, (x,), (t,)))(x, t)
    assert_trees_close(got, (np.sin(x), np.cos(x) * t))
    # Without a jvp method: the backward row by row (one host call per output element) ...
    got = jax.jit(lambda x, t: jax.jvp(HostSin.apply, (x,), (t,)))(x, t)
    assert_trees_close(got, (np.sin(x), np.cos(x) * t))
    # ... up to forward_mode_max_outputs (4096) output elements.
    big = jnp.ones(4097)
    with pytest.raises(TypeError, match=r"`HostSin`: forward-mode.*could not transpose"):
        jax.jvp(HostSin.apply, (big,), (big,))


def test_function_untransposable_backward_error_names_the_jvp_method(x64):
    x = jnp.ones(4097)  # more output elements than forward mode evaluates the backward for
    with pytest.raises(TypeError) as info:
        jax.jvp(HostSin.apply, (x,), (x,))
    assert "defvjp" not in str(info.value) and "jvp(ctx" in str(info.value)


# -- once_differentiable -------------------------------------------------------------------
# Forward mode transposes the backward (a linear map of the cotangent); it does not
# differentiate it. So first-order forward mode should work for a once_differentiable
# backward, and a second-order derivative through it (hessian, jacrev of jacfwd) should
# raise once_differentiable's RuntimeError, as grad of grad does.


def test_once_differentiable_reverse_mode_first_and_second_order(x64):
    x = jnp.asarray(rand(0, (3,), np.float64))
    assert_trees_close(jax.grad(lambda x: OnceCube.apply(x).sum())(x), 3 * np.asarray(x) ** 2)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        jax.jacrev(jax.jacrev(OnceCube.apply))(x)


@pytest.mark.parametrize("transform", ["jvp", "jacfwd"])
def test_once_differentiable_first_order_forward_mode(transform, x64):
    x = jnp.asarray(rand(0, (3,), np.float64))
    t = jnp.asarray(rand(1, (3,), np.float64))
    if transform == "jvp":
        got = jax.jvp(OnceCube.apply, (x,), (t,))
        assert_trees_close(got, (np.asarray(x) ** 3, 3 * np.asarray(x) ** 2 * t))
    else:
        assert_trees_close(jax.jacfwd(OnceCube.apply)(x), np.diag(3 * np.asarray(x) ** 2))


@pytest.mark.parametrize("transform", ["hessian", "jacrev(jacfwd)"])
def test_once_differentiable_second_order_forward_mode_raises(transform, x64):
    x = jnp.asarray(rand(0, (3,), np.float64))
    loss = lambda x: jnp.sum(OnceCube.apply(x))  # noqa: E731
    second = jax.hessian(loss) if transform == "hessian" else jax.jacrev(jax.jacfwd(loss))
    try:
        second(x)
    except Exception as err:  # noqa: BLE001 -- the kind of error is the point
        assert isinstance(err, RuntimeError) and "once_differentiable" in str(err), repr(err)
    else:
        raise AssertionError("no error for a derivative through a once_differentiable backward")


# -- a straight-through estimator ------------------------------------------------------------
# Its backward is deliberately not the true derivative (round has derivative 0): reverse
# mode must give the backward's gradient and forward mode its transpose, never autodiff of
# the forward.


def straight_through_round(decorator, fwd_calls_op):
    """``round`` whose backward passes the cotangent through unchanged.

    With ``fwd_calls_op`` its ``fwd`` computes the output by calling the op itself (the
    pattern of JAX's custom_vjp documentation), so a higher-order derivative of that
    output goes through the custom rule again; otherwise through autodiff of ``fwd``'s
    ``jnp.round``, as with ``jax.custom_vjp``.
    """

    @decorator
    def ste(x):
        return jnp.round(x)

    def fwd(x):
        return (ste(x) if fwd_calls_op else jnp.round(x)), None

    def bwd(_, grad):
        return (grad,)

    ste.defvjp(fwd, bwd)
    return ste


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_straight_through_estimator(jit, x64):
    ste = straight_through_round(jaxext.custom_vjp, fwd_calls_op=True)
    maybe_jit = jax.jit if jit else (lambda f: f)
    x = jnp.asarray(rand(0, (4,), np.float64)) * 3
    t = jnp.asarray(rand(1, (4,), np.float64))
    rounded = np.round(np.asarray(x))
    # What autodiff of the forward would give: nothing.
    assert not np.any(np.asarray(jax.jvp(jnp.round, (x,), (t,))[1]))
    assert_trees_close(maybe_jit(jax.grad(lambda x: ste(x).sum()))(x), np.ones(4))
    assert_trees_close(maybe_jit(lambda x, t: jax.jvp(ste, (x,), (t,)))(x, t), (rounded, t))
    assert_trees_close(maybe_jit(jax.jacfwd(ste))(x), np.eye(4))
    assert_trees_close(maybe_jit(jax.jacrev(ste))(x), np.eye(4))
    # Second order: d/dx of the straight-through gradient cos(round(x)).
    hessian = maybe_jit(jax.hessian(lambda x: jnp.sum(jnp.sin(ste(x)))))(x)
    assert_trees_close(hessian, np.diag(-np.sin(rounded)))
    assert np.any(np.diag(hessian) != 0)


@pytest.mark.parametrize("fwd_calls_op", [True, False], ids=["fwd_calls_op", "fwd_plain"])
def test_straight_through_second_order_matches_jax_custom_vjp(fwd_calls_op, x64):
    # jax.custom_vjp has no forward mode, but its reverse-over-reverse Hessian is the
    # reference for which derivative a fwd's output gets at second order.
    ste = straight_through_round(jaxext.custom_vjp, fwd_calls_op)
    ste_ref = straight_through_round(jax.custom_vjp, fwd_calls_op)
    x = jnp.asarray(rand(0, (4,), np.float64)) * 3

    def loss(f):
        return lambda x: jnp.sum(jnp.sin(f(x)))

    want = jax.jacrev(jax.jacrev(loss(ste_ref)))(x)
    assert_trees_close(jax.hessian(loss(ste))(x), want)
    assert_trees_close(jax.jacrev(jax.jacrev(loss(ste)))(x), want)
