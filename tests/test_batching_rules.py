"""Batching rules: ``jaxext.custom_vjp.def_vmap`` and ``Function.vmap`` (PyTorch 2's).

The forwards here call NumPy through ``jax.pure_callback`` without a
``vmap_method``, so JAX cannot batch them on its own: ``vmap`` works only through
the rule, and a missing or ignored rule fails loudly. Every transform is compared
with float64 autodiff of the same math, and with ``torch.func`` where torch is
installed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxext
from tests.helpers import assert_close

calls = {"rule": 0}


def host_sin(x):
    """sin on the host, one array at a time (no vmap_method: JAX cannot batch it)."""
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.pure_callback(lambda a: np.sin(np.asarray(a)).astype(a.dtype), shape, x)


def host_scale(x, w):
    """x * w[None, :] on the host, for a 2-d x and a 1-d w."""
    shape = jax.ShapeDtypeStruct(x.shape, jnp.result_type(x, w))
    return jax.pure_callback(lambda a, b: np.asarray(a) * np.asarray(b)[None, :], shape, x, w)


# -- jaxext.custom_vjp.def_vmap ---------------------------------------------------------------


@jaxext.custom_vjp
def sin_op(x):
    return host_sin(x)


@sin_op.def_vmap
def _sin_vmap(axis_size, in_batched, x):
    calls["rule"] += 1
    return sin_op(x), in_batched[0]  # elementwise: the batch is just more elements


sin_op.defvjp(lambda x: (sin_op(x), jnp.cos(x)), lambda cos_x, g: (g * cos_x,))


class NumpySin(jaxext.Function):
    """The same op ported from PyTorch, with its ``vmap`` staticmethod."""

    @staticmethod
    def forward(x):
        return host_sin(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * jnp.cos(x)

    @staticmethod
    def vmap(info, in_dims, x):
        calls["rule"] += 1
        assert info.batch_size == x.shape[in_dims[0]] if in_dims[0] is not None else True
        return NumpySin.apply(x), in_dims[0]


SIN_OPS = {"custom_vjp": sin_op, "Function": NumpySin.apply}


def _sum(f):
    return lambda x: jnp.sum(f(x))


TRANSFORMS = {
    "vmap": lambda f: jax.vmap(f),
    "jit(vmap)": lambda f: jax.jit(jax.vmap(f)),
    "vmap(vmap)": lambda f: jax.vmap(jax.vmap(f)),
    "vmap(grad)": lambda f: jax.vmap(jax.grad(_sum(f))),
    "grad(vmap)": lambda f: jax.grad(_sum(jax.vmap(f))),
    "vmap(jvp)": lambda f: jax.vmap(lambda x: jax.jvp(f, (x,), (jnp.ones_like(x),))[1]),
    "jacrev": lambda f: jax.jacrev(f),
    "jacfwd": lambda f: jax.jacfwd(f),
    "hessian": lambda f: jax.hessian(_sum(f)),
    "vmap(hessian)": lambda f: jax.vmap(jax.hessian(_sum(f))),
    "jit(vmap(grad))": lambda f: jax.jit(jax.vmap(jax.grad(_sum(f)))),
}


@pytest.mark.parametrize("op", SIN_OPS, ids=str)
@pytest.mark.parametrize("transform", TRANSFORMS, ids=str)
def test_rule_composes_with_every_transform(op, transform, x64):
    x = jnp.linspace(-2.0, 2.0, 12).reshape(3, 4)
    if transform == "vmap(vmap)":
        x = x.reshape(3, 2, 2)
    calls["rule"] = 0
    got = TRANSFORMS[transform](SIN_OPS[op])(x)
    want = TRANSFORMS[transform](jnp.sin)(x)
    assert_close(got, want, rtol=1e-12, atol=1e-12)
    if "vmap" in transform:
        assert calls["rule"] > 0  # the rule, not JAX's batching, batched the forward


@pytest.mark.parametrize("op", SIN_OPS, ids=str)
def test_without_a_rule_vmap_fails_loudly(op):
    @jaxext.custom_vjp
    def no_rule(x):
        return host_sin(x)

    no_rule.defvjp(lambda x: (no_rule(x), jnp.cos(x)), lambda cos_x, g: (g * cos_x,))

    class NoRule(jaxext.Function):
        @staticmethod
        def forward(x):
            return host_sin(x)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        @staticmethod
        def backward(ctx, g):
            return g * jnp.cos(ctx.saved_tensors[0])

    f = {"custom_vjp": no_rule, "Function": NoRule.apply}[op]
    with pytest.raises(NotImplementedError, match="vmap_method"):
        jax.vmap(f)(jnp.ones((2, 3)))


# -- in_dims with None, out_dims not 0, several outputs ---------------------------------------


class NumpyScale(jaxext.Function):
    """``(x * w, x * w)`` for a 2-d x and a 1-d w; the rule returns its batch axis last."""

    @staticmethod
    def forward(x, w):
        out = host_scale(x, w)
        return out, out * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g1, g2):
        x, w = ctx.saved_tensors
        g = g1 + 2 * g2
        return g * w[None, :], jnp.sum(g * x, axis=0)

    @staticmethod
    def vmap(info, in_dims, x, w):
        calls["rule"] += 1
        x_dim, w_dim = in_dims
        x = (
            jnp.moveaxis(x, x_dim, 0)
            if x_dim is not None
            else jnp.broadcast_to(x, (info.batch_size, *x.shape))
        )
        w = (
            jnp.moveaxis(w, w_dim, 0)
            if w_dim is not None
            else jnp.broadcast_to(w, (info.batch_size, *w.shape))
        )
        outs = [NumpyScale.apply(xi, wi) for xi, wi in zip(x, w, strict=True)]
        first = jnp.stack([o[0] for o in outs], axis=-1)  # batch axis last
        second = jnp.stack([o[1] for o in outs], axis=0)
        return (first, second), (-1, 0)


def scale_reference(x, w):
    out = x * w[None, :]
    return out, out * 2


@pytest.mark.parametrize("in_axes", [(0, None), (None, 0), (0, 0), (1, 0)], ids=str)
def test_in_dims_none_and_out_dims(in_axes, x64):
    key_x, key_w = jax.random.split(jax.random.key(0))
    x = jax.random.normal(key_x, (3, 2, 4))
    w = jax.random.normal(key_w, (3, 4))
    if in_axes[0] is None:
        x = x[0]
    if in_axes[1] is None:
        w = w[0]
    if in_axes[0] == 1:
        x = jnp.moveaxis(x, 0, 1)
    calls["rule"] = 0
    got = jax.vmap(NumpyScale.apply, in_axes)(x, w)
    assert calls["rule"] > 0
    for g, r in zip(got, jax.vmap(scale_reference, in_axes)(x, w), strict=True):
        assert_close(g, r, rtol=1e-12, atol=1e-12)

    def loss(f):
        return lambda x, w: sum(jnp.sum(jnp.sin(o)) for o in jax.vmap(f, in_axes)(x, w))

    got = jax.grad(loss(NumpyScale.apply), (0, 1))(x, w)
    want = jax.grad(loss(scale_reference), (0, 1))(x, w)
    for g, r in zip(got, want, strict=True):
        assert_close(g, r, rtol=1e-12, atol=1e-12)


# -- errors ----------------------------------------------------------------------------------


def test_vmap_with_generate_vmap_rule_is_an_error():
    class Both(NumpySin):
        generate_vmap_rule = True

    with pytest.raises(TypeError, match=r"`Both` both defines a `vmap` staticmethod"):
        jax.vmap(Both.apply)(jnp.ones((2, 3)))


def test_vmap_needs_the_setup_context_style():
    class OldStyle(jaxext.Function):
        @staticmethod
        def forward(ctx, x):
            return host_sin(x)

        @staticmethod
        def backward(ctx, g):
            return g

        @staticmethod
        def vmap(info, in_dims, x):
            return OldStyle.apply(x), in_dims[0]

    with pytest.raises(TypeError, match=r"`OldStyle` defines a `vmap` staticmethod"):
        jax.vmap(OldStyle.apply)(jnp.ones((2, 3)))


def test_bad_out_dims_is_an_error():
    class BadDims(NumpySin):
        @staticmethod
        def vmap(info, in_dims, x):
            return BadDims.apply(x), (0, 0)

    with pytest.raises(ValueError, match=r"`BadDims.vmap`: `out_dims` must be"):
        jax.vmap(BadDims.apply)(jnp.ones((2, 3)))


def test_generate_vmap_rule_batches_with_jax():
    class Generated(jaxext.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            return jnp.sin(x)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        @staticmethod
        def backward(ctx, g):
            return g * jnp.cos(ctx.saved_tensors[0])

    x = jnp.linspace(0.0, 1.0, 6).reshape(2, 3)
    assert_close(jax.vmap(jax.grad(_sum(Generated.apply)))(x), jnp.cos(x), rtol=1e-6, atol=1e-6)


# -- against torch.func -----------------------------------------------------------------------


def test_vmap_staticmethod_matches_torch_func():
    torch = pytest.importorskip("torch")
    from torch import func as tf

    seen = {}

    class TorchNumpySin(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return torch.from_numpy(np.sin(x.detach().numpy()))

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * torch.cos(x)

        @staticmethod
        def vmap(info, in_dims, x):
            seen["torch"] = (info.batch_size, tuple(in_dims))
            return TorchNumpySin.apply(x), in_dims[0]

    class Recording(NumpySin):
        @staticmethod
        def vmap(info, in_dims, x):
            seen["jaxext"] = (info.batch_size, tuple(in_dims))
            return Recording.apply(x), in_dims[0]

    x = np.linspace(-1.0, 1.0, 6).reshape(3, 2)
    want = tf.vmap(tf.grad(lambda t: TorchNumpySin.apply(t).sum()))(torch.from_numpy(x))
    with jax.enable_x64(True):
        got = jax.vmap(jax.grad(lambda t: Recording.apply(t).sum()))(jnp.asarray(x))
    assert_close(got, want.numpy(), rtol=1e-12, atol=1e-12)
    assert seen["jaxext"] == seen["torch"] == (3, (0,))


# -- a C++ kernel (jaxext.cpp_extension) called without a vmap_method --------------------------


def _kernel_scale(x, constant):
    """The shipped C++ mul_constant kernel, called with no vmap_method: JAX cannot batch it."""
    from jaxext.cpp_extension import ops

    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    c = np.asarray(constant, x.dtype)  # a 0-d operand of x's dtype
    return ops.extension().jaxext_mul_constant(x, c, result_shape_dtypes=out)


class KernelScale(jaxext.Function):
    """A C++ forward (JAX can neither batch nor differentiate it), a ``jnp`` backward."""

    @staticmethod
    def forward(x, constant):
        return _kernel_scale(x, constant)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.constant = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return g * ctx.constant, None

    @staticmethod
    def vmap(info, in_dims, x, constant):
        calls["rule"] += 1
        return KernelScale.apply(x, constant), in_dims[0]  # elementwise


@pytest.mark.parametrize("transform", ["vmap", "vmap(grad)", "vmap(jvp)", "jit(vmap(grad))"])
def test_cpp_kernel_batched_by_the_rule(transform, x64, cpp_builds):
    pytest.importorskip("jax.ffi")
    x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)

    def f(x):
        return KernelScale.apply(x, 2.5)

    with pytest.raises(Exception, match="vmap"):
        jax.vmap(lambda x: _kernel_scale(x, 2.5))(x)  # no rule: JAX refuses, loudly
    calls["rule"] = 0
    got = TRANSFORMS[transform](f)(x)
    assert calls["rule"] > 0
    assert_close(got, TRANSFORMS[transform](lambda x: x * 2.5)(x), rtol=1e-15, atol=0)
