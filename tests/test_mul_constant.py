"""Tests for `jaxext.mul_constant`: static and array constants, dtypes, transforms, errors.

References: plain ``jnp`` autodiff of ``x * c``, hand-computed gradients, and
PyTorch (``x * c`` autograd and a port of the seed's ``MulConstant``).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    CompileCounter,
    assert_close,
    assert_close_to_float64,
    assert_first_and_second_order_close,
    coarsest,
    grid,
    in_float64,
    rand,
    skip_without_float16,
    vjp_kept,
)

import jaxext

F64 = np.float64

X_SHAPES = [(), (3,), (0, 3), (2, 3, 4)]
STATIC_CONSTANTS = [
    pytest.param(2, id="int"),
    pytest.param(-1.5, id="float"),
    pytest.param(np.float32(0.25), id="np-float32"),
    pytest.param(np.int32(3), id="np-int32"),
]
# (x shape, constant shape): every way the constant can broadcast, both directions.
ARRAY_CASES = [
    pytest.param((2, 3), (), id="scalar-array"),
    pytest.param((2, 3), (1, 3), id="row"),
    pytest.param((2, 3), (3,), id="vector"),
    pytest.param((2, 3), (2, 1), id="column"),
    pytest.param((2, 3), (2, 3), id="same"),
    pytest.param((3,), (2, 3), id="constant-larger"),
    pytest.param((0, 3), (3,), id="empty-x"),
    pytest.param((4, 2, 3), (2, 1), id="3d"),
]


DTYPES = ["float32", "float64", "bfloat16"]


@pytest.fixture(params=DTYPES)
def dtype(request):
    """A floating dtype; float64 turns on x64 for the one test that uses it."""
    if request.param == "float64":
        request.getfixturevalue("x64")
    return jnp.dtype(request.param)


def plain_mul(x, c):
    return x * c


def weighted_sum(fn, ct):
    return lambda *args: jnp.sum(fn(*args).astype(ct.dtype) * ct)


# -- static (Python / NumPy scalar) constants -----------------------------------------


@pytest.mark.parametrize(
    *grid(x_shape=X_SHAPES, constant=STATIC_CONSTANTS, dtype=DTYPES), indirect=["dtype"]
)
def test_static_constant_value_and_grad(x_shape, constant, dtype):
    x = jnp.asarray(rand(0, x_shape), dtype)
    y = jaxext.mul_constant(x, constant)
    y_ref = plain_mul(x, constant)
    assert y.shape == x_shape
    assert y.dtype == y_ref.dtype  # jnp promotion: a Python scalar keeps bfloat16
    assert_close_to_float64(y, float(constant) * np.asarray(x, np.float64))

    ct = jnp.asarray(rand(1, x_shape), jnp.float32 if dtype == jnp.bfloat16 else dtype)
    g = jax.grad(weighted_sum(lambda x: jaxext.mul_constant(x, constant), ct))(x)
    assert g.dtype == x.dtype
    # Hand-computed: d/dx sum(ct * x * c) = c * ct.
    assert_close_to_float64(g, float(constant) * np.asarray(ct, np.float64))


def test_python_scalar_keeps_bfloat16():
    x = jnp.asarray(rand(0, (4,)), jnp.bfloat16)
    assert jaxext.mul_constant(x, 2.5).dtype == jnp.bfloat16
    assert jax.grad(lambda x: jaxext.mul_constant(x, 2.5).astype(float).sum())(x).dtype == (
        jnp.bfloat16
    )


def test_static_constant_saves_no_residual_and_is_hashable_under_jit():
    x = jnp.asarray(rand(0, (2, 3)))
    _, vjp_fn = jax.vjp(lambda x: jaxext.mul_constant(x, 3.0), x)
    assert jax.tree_util.tree_leaves(vjp_fn) == []
    f = jax.jit(jaxext.mul_constant, static_argnums=1)
    assert_close(f(x, 3.0), 3.0 * np.asarray(x))
    assert_close(f(x, np.float32(-2.0)), -2.0 * np.asarray(x))
    g = jax.jit(jax.grad(lambda x: jaxext.mul_constant(x, 3.0).sum()))(x)
    assert_close(g, np.full((2, 3), 3.0))


def test_traced_python_scalar_gets_its_true_gradient():
    # Under grad/jit a Python number becomes a tracer: it must not get a silent zero.
    x = jnp.asarray(rand(0, (2, 3)))
    expected = np.asarray(x, np.float64).sum()
    assert_close(jax.grad(lambda c: jaxext.mul_constant(x, c).sum())(2.0), expected)
    g_jit = jax.jit(jax.grad(lambda c: jaxext.mul_constant(x, c).sum()))(2.0)
    assert_close(g_jit, expected)
    assert_close(jax.jit(jaxext.mul_constant)(x, 2.0), 2.0 * np.asarray(x))


# -- array constants ----------------------------------------------------------------------


def _array_inputs(x_shape, c_shape, dtype):
    x = jnp.asarray(rand(0, x_shape), dtype)
    c = jnp.asarray(rand(1, c_shape), dtype)
    return x, c


@pytest.mark.parametrize(("x_shape", "c_shape"), ARRAY_CASES)
def test_array_constant_value_and_true_gradients(x_shape, c_shape, dtype):
    x, c = _array_inputs(x_shape, c_shape, dtype)
    ref_dtype = jnp.float32 if dtype == jnp.bfloat16 else dtype
    y = jaxext.mul_constant(x, c)
    assert y.shape == jnp.broadcast_shapes(x_shape, c_shape)
    assert y.dtype == dtype
    assert_close_to_float64(y, in_float64(plain_mul, x, c))

    ct = jnp.asarray(rand(2, y.shape), ref_dtype)
    gx, gc = jax.grad(weighted_sum(jaxext.mul_constant, ct), (0, 1))(x, c)
    gx_ref, gc_ref = in_float64(jax.grad(weighted_sum(plain_mul, ct), (0, 1)), x, c)
    assert (gx.shape, gc.shape) == (x_shape, c_shape)
    assert (gx.dtype, gc.dtype) == (x.dtype, c.dtype)
    n = max(1, y.size // max(1, c.size))  # the constant's gradient sums over the broadcast
    assert_close_to_float64(gx, gx_ref)
    assert_close_to_float64(gc, gc_ref, n=n)


def test_scalar_array_constant_gradient_is_sum_g_times_x():
    x = jnp.arange(6.0).reshape(2, 3)
    gc = jax.grad(lambda c: jaxext.mul_constant(x, c).sum())(jnp.array(2.0))
    assert gc.shape == ()
    assert_close(gc, 15.0)  # 0 + 1 + ... + 5


@pytest.mark.parametrize(("x_shape", "c_shape"), ARRAY_CASES)
def test_array_constant_under_jit(x_shape, c_shape):
    x, c = _array_inputs(x_shape, c_shape, jnp.float32)

    def loss(fn):
        return lambda x, c: jnp.sum(jnp.sin(fn(x, c)))

    assert_close(jax.jit(jaxext.mul_constant)(x, c), plain_mul(x, c))
    grads = jax.jit(jax.grad(loss(jaxext.mul_constant), (0, 1)))(x, c)
    grads_ref = in_float64(jax.grad(loss(plain_mul), (0, 1)), x, c)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert_close_to_float64(g, g_ref, n=24)  # the constant's gradient sums up to 24 terms


@pytest.mark.parametrize("in_axes", [(0, None), (None, 0), (0, 0), (1, 0)])
@pytest.mark.parametrize(("x_shape", "c_shape"), [((2, 3), (1, 3)), ((2, 3), ()), ((3,), (2, 3))])
def test_array_constant_under_vmap(x_shape, c_shape, in_axes):
    def batched(shape, axis, seed):
        shape = list(shape)
        if axis is not None:
            shape.insert(min(axis, len(shape)), 4)
        return jnp.asarray(rand(seed, tuple(shape)))

    axes = tuple(
        None if a is None else min(a, len(s))
        for a, s in zip(in_axes, (x_shape, c_shape), strict=True)
    )
    x, c = batched(x_shape, axes[0], 0), batched(c_shape, axes[1], 1)

    def value_and_grads(fn):
        loss = lambda x, c: jnp.sum(jnp.tanh(fn(x, c)))  # noqa: E731
        return jax.jit(jax.vmap(jax.value_and_grad(loss, (0, 1)), in_axes=axes))

    v, grads = value_and_grads(jaxext.mul_constant)(x, c)
    v_ref, grads_ref = in_float64(value_and_grads(plain_mul), x, c)
    assert_close_to_float64(v, v_ref, n=24)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert g.shape == g_ref.shape
        assert_close_to_float64(g, g_ref, n=24)


@pytest.mark.parametrize(("x_shape", "c_shape"), ARRAY_CASES)
def test_grad_of_grad_and_jacrev_jacrev_match_jnp(x_shape, c_shape, x64):
    x, c = _array_inputs(x_shape, c_shape, jnp.float64)

    def second_order(fn):
        def loss(x, c):
            return jnp.sum(jnp.sin(fn(x, c)) * fn(x, c))

        def grad_fn(x, c):
            gx, gc = jax.grad(loss, (0, 1))(x, c)
            return jnp.sum(gx**2) + jnp.sum(jnp.cos(gc))

        def both(x, c):
            return jax.grad(grad_fn, (0, 1))(x, c), jax.jacrev(jax.jacrev(loss, (0, 1)), (0, 1))(
                x, c
            )

        return jax.jit(both)(x, c)

    assert_first_and_second_order_close(second_order(jaxext.mul_constant), second_order(plain_mul))


@pytest.mark.parametrize("argnum", [0, 1])
def test_forward_keeps_only_what_the_wanted_gradient_needs(argnum):
    x, c = _array_inputs((64, 32), (32,), jnp.float32)
    args = [x, c]

    def f(v):
        return jaxext.mul_constant(*(v if i == argnum else a for i, a in enumerate(args)))

    leaves = vjp_kept(f, args[argnum])
    # grad_x needs the constant, grad_constant needs x: only that operand is kept.
    needed = c if argnum == 0 else x
    assert len(leaves) == 1
    assert leaves[0].shape == needed.shape and np.array_equal(leaves[0], needed)

    # Compiled, the same memory as autodiff.
    def loss(op):
        return lambda *a: jnp.sum(jnp.sin(op(*a)))

    def temp_bytes(op):
        grad = jax.jit(jax.grad(loss(op), argnums=argnum))
        return grad.lower(x, c).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(jaxext.mul_constant) <= temp_bytes(lambda x, c: x * c)


def test_jitted_op_reused_with_different_differentiated_inputs():
    # One jitted helper, called twice in one differentiated computation with a
    # different operand perturbed each time. With a residual layout that depends on
    # what is perturbed, JAX 0.10 hands one backward the other's layout and the
    # gradient of x came back as zeros. Reference: plain jnp autodiff.
    helper = jax.jit(jaxext.mul_constant)
    x, c, d = jnp.arange(1.0, 4.0), jnp.array(2.0), jnp.array(3.0)

    def loss(op):
        def f(x, c):
            y = op(x, d)  # x perturbed, the constant not
            z = op(jnp.ones(3) * 5, c)  # the constant perturbed, x not
            return jnp.sum(y) + jnp.sum(z)

        return f

    got = jax.grad(loss(helper), argnums=(0, 1))(x, c)
    want = jax.grad(loss(lambda a, b: a * b), argnums=(0, 1))(x, c)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w)


# -- dtypes and NumPy constants --------------------------------------------------------------


@pytest.mark.parametrize(
    ("x_dtype", "c_dtype"),
    [
        (jnp.bfloat16, jnp.float32),
        (jnp.float32, jnp.bfloat16),
        (jnp.float16, jnp.bfloat16),
        (jnp.bfloat16, jnp.bfloat16),
    ],
)
def test_mixed_dtypes_promote_and_grads_keep_input_dtypes(x_dtype, c_dtype):
    if jnp.float16 in (x_dtype, c_dtype):
        skip_without_float16()
    x = jnp.asarray(rand(0, (2, 3)), x_dtype)
    c = jnp.asarray(rand(1, (3,)), c_dtype)
    y = jaxext.mul_constant(x, c)
    assert y.dtype == plain_mul(x, c).dtype
    gx, gc = jax.grad(lambda x, c: jaxext.mul_constant(x, c).astype(float).sum(), (0, 1))(x, c)
    assert (gx.dtype, gc.dtype) == (x.dtype, c.dtype)
    x64, c64 = np.asarray(x, np.float64), np.asarray(c, np.float64)
    low = coarsest(x_dtype, c_dtype)
    assert_close_to_float64(gx, np.broadcast_to(c64, (2, 3)), dtype=low)
    assert_close_to_float64(gc, x64.sum(0), n=2, dtype=low)


def test_integer_x_promotes_like_jnp():
    x = jnp.arange(4)
    assert jaxext.mul_constant(x, 2.5).dtype == plain_mul(x, 2.5).dtype
    assert_close(jaxext.mul_constant(x, 2.5), [0.0, 2.5, 5.0, 7.5])
    assert jaxext.mul_constant(x, 3).dtype == plain_mul(x, 3).dtype
    gc = jax.grad(lambda c: jaxext.mul_constant(x, c).sum())(jnp.array(1.0))
    assert_close(gc, 6.0)


def test_numpy_float64_scalar_follows_jnp(x64):
    x = jnp.asarray(rand(0, (3,)), jnp.float32)
    c = np.float64(1.5)
    y = jaxext.mul_constant(x, c)
    assert y.dtype == plain_mul(x, c).dtype
    g = jax.grad(lambda x: jaxext.mul_constant(x, c).sum())(x)
    assert g.dtype == jnp.float32
    assert_close(g, np.full(3, 1.5), rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("constant", [np.array(2.0), np.array([1.0, -2.0, 0.5])], ids=["0d", "1d"])
def test_numpy_array_constant_is_an_array(constant):
    x = jnp.asarray(rand(0, (2, 3)))
    assert_close(jaxext.mul_constant(x, constant), np.asarray(x) * constant)
    g = jax.jit(jax.grad(lambda x: jaxext.mul_constant(x, constant).sum()))(x)
    assert_close(g, np.broadcast_to(constant, (2, 3)))
    # Passed through jit it is traced like any array and gets its true gradient.
    gc = jax.jit(jax.grad(lambda c: jaxext.mul_constant(x, c).sum()))(constant)
    assert_close(gc, jax.grad(lambda c: plain_mul(x, c).sum())(constant))


def test_complex_vjp_matches_jnp(x64):
    x = jnp.asarray(rand(0, (2, 3), F64) + 1j * rand(1, (2, 3), F64))
    c = jnp.asarray(rand(2, (3,), F64) - 1j * rand(3, (3,), F64))
    ct = jnp.asarray(rand(4, (2, 3), F64) + 1j * rand(5, (2, 3), F64))
    for constant in (c, 1.5 - 2j):
        y, vjp_fn = jax.vjp(lambda x, c: jaxext.mul_constant(x, c), x, constant)
        y_ref, vjp_ref = jax.vjp(plain_mul, x, constant)
        assert_close(y.real, y_ref.real, rtol=1e-12, atol=1e-12)
        assert_close(y.imag, y_ref.imag, rtol=1e-12, atol=1e-12)
        for g, g_ref in zip(vjp_fn(ct), vjp_ref(ct), strict=True):
            assert_close(jnp.real(g), jnp.real(g_ref), rtol=1e-12, atol=1e-12)
            assert_close(jnp.imag(g), jnp.imag(g_ref), rtol=1e-12, atol=1e-12)
    g = jax.vjp(lambda x: jaxext.mul_constant(x, 1.5 - 2j), x)[1](ct)[0]
    assert_close(jnp.imag(g), np.imag(np.asarray(ct) * (1.5 - 2j)), rtol=1e-12, atol=1e-12)


# -- PyTorch -----------------------------------------------------------------------------------


def _torch_mul_constant():
    """A port of the seed's ``MulConstant``: a non-tensor constant gets no gradient."""
    torch = pytest.importorskip("torch")

    class MulConstant(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor, constant):
            ctx.constant = constant
            return tensor * constant

        @staticmethod
        def backward(ctx, grad_output):
            return grad_output * ctx.constant, None

    return MulConstant


@pytest.mark.parametrize("constant", [-1.5, 3, 0.0])
@pytest.mark.parametrize("x_shape", X_SHAPES)
def test_static_constant_matches_torch(x_shape, constant, x64):
    torch = pytest.importorskip("torch")
    x = jnp.asarray(rand(0, x_shape, np.float64))
    ct = rand(1, x_shape, np.float64)

    def loss(x):
        return jnp.sum(jnp.sin(jaxext.mul_constant(x, constant)) * ct)

    y = jaxext.mul_constant(x, constant)
    g = jax.grad(loss)(x)
    gg = jax.grad(lambda x: jnp.sum(jax.grad(loss)(x) ** 2))(x)

    for fn in (_torch_mul_constant().apply, lambda t, c: t * c):
        t_x = torch.tensor(np.asarray(x), requires_grad=True)
        t_y = fn(t_x, constant)
        assert_close(y, t_y.detach().numpy(), rtol=1e-12, atol=1e-12)
        t_loss = (torch.sin(fn(t_x, constant)) * torch.from_numpy(ct)).sum()
        (t_g,) = torch.autograd.grad(t_loss, t_x, create_graph=True)
        assert_close(g, t_g.detach().numpy(), rtol=1e-12, atol=1e-12)
        if t_g.requires_grad:  # False when constant == 0: the gradient is identically 0
            (t_gg,) = torch.autograd.grad((t_g**2).sum(), t_x)
            assert_close(gg, t_gg.numpy(), rtol=1e-12, atol=1e-12)
        else:
            assert_close(gg, np.zeros(x_shape), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("x_shape", "c_shape"), ARRAY_CASES)
def test_array_constant_matches_torch(x_shape, c_shape, x64):
    torch = pytest.importorskip("torch")
    x, c = _array_inputs(x_shape, c_shape, jnp.float64)

    def loss(x, c):
        return jnp.sum(jnp.tanh(jaxext.mul_constant(x, c)))

    gx, gc = jax.jit(jax.grad(loss, (0, 1)))(x, c)
    ggc = jax.jit(jax.grad(lambda x, c: jnp.sum(jax.grad(loss, 1)(x, c) ** 2), (0, 1)))(x, c)

    t_x = torch.tensor(np.asarray(x), requires_grad=True)
    t_c = torch.tensor(np.asarray(c), requires_grad=True)
    t_y = t_x * t_c
    assert_close(jaxext.mul_constant(x, c), t_y.detach().numpy(), rtol=1e-12, atol=1e-12)
    t_gx, t_gc = torch.autograd.grad(torch.tanh(t_y).sum(), (t_x, t_c), create_graph=True)
    assert_close(gx, t_gx.detach().numpy(), rtol=1e-12, atol=1e-12)
    assert_close(gc, t_gc.detach().numpy(), rtol=1e-12, atol=1e-12)
    t_ggc = torch.autograd.grad((t_gc**2).sum(), (t_x, t_c))
    for g, t_g in zip(ggc, t_ggc, strict=True):
        assert_close(g, t_g.numpy(), rtol=1e-12, atol=1e-12)


# -- errors ---------------------------------------------------------------------------------

XA = np.ones((2, 3), np.float32)

BAD_CONSTANTS = [
    pytest.param("2", TypeError, r"`constant`.*got str", id="str"),
    pytest.param(None, TypeError, r"`constant`.*got NoneType", id="none"),
    pytest.param([1.0, 2.0, 3.0], TypeError, r"`constant`.*got list.*jnp.asarray", id="list"),
    pytest.param((1.0, 2.0, 3.0), TypeError, r"`constant`.*got tuple", id="tuple"),
    pytest.param(True, TypeError, r"`constant`.*got bool", id="bool"),
    pytest.param(np.bool_(False), TypeError, r"`constant`.*got bool", id="np-bool"),
    pytest.param(np.array([True, False, True]), TypeError, r"`constant`.*dtype bool", id="bool-np"),
    pytest.param(jnp.array(True), TypeError, r"`constant`.*dtype bool", id="bool-jnp"),
    pytest.param(np.array(["a"]), TypeError, r"`constant`", id="str-array"),
    pytest.param({"c": 2.0}, TypeError, r"`constant`.*got dict", id="dict"),
    pytest.param(
        jnp.ones(4), ValueError, r"`constant` of shape \(4,\).*`x` of shape \(2, 3\)", id="shape"
    ),
    pytest.param(
        np.ones((3, 2)), ValueError, r"`constant` of shape \(3, 2\).*\(2, 3\)", id="shape-3d"
    ),
]


@pytest.mark.parametrize(("constant", "error", "match"), BAD_CONSTANTS)
def test_bad_constant_is_refused_by_name(constant, error, match):
    with pytest.raises(error, match=match):
        jaxext.mul_constant(XA, constant)


@pytest.mark.parametrize(
    ("x", "match"),
    [
        ("abc", r"`x`.*str"),
        (None, r"`x`.*NoneType"),
        (XA.astype(bool), r"`x`.*dtype bool"),
        ([1.0, 2.0], r"`x`.*list"),
        ({"a": XA}, r"`x` must be a numeric array; got a dict"),
    ],
    ids=["str", "none", "bool", "list", "dict"],
)
def test_bad_x_is_refused_by_name(x, match):
    with pytest.raises(TypeError, match=match):
        jaxext.mul_constant(x, 2.0)


def test_errors_are_raised_at_trace_time_under_jit():
    with pytest.raises(ValueError, match=r"`constant` of shape \(4,\)"):
        jax.jit(jaxext.mul_constant)(XA, jnp.ones(4))
    with pytest.raises(ValueError, match=r"`constant` of shape \(4,\)"):
        jax.grad(lambda c: jaxext.mul_constant(XA, c).sum())(jnp.ones(4))
    with pytest.raises(TypeError, match=r"`constant`.*dtype bool"):
        jax.jit(jaxext.mul_constant)(XA, jnp.array(True))
    with pytest.raises(TypeError, match=r"`x`.*dtype bool"):
        jax.jit(jaxext.mul_constant)(XA.astype(bool), 2.0)


def test_eager_calls_with_new_constants_reuse_one_program(caplog):
    """A new Python constant must not compile (and keep) a new program per value."""
    x = jnp.arange(1.0, 7.0, dtype=jnp.float32).reshape(2, 3)
    jaxext.mul_constant(x, 0.5)  # compiles once
    constants = [1.0 + 0.01 * i for i in range(20)]
    with jax.log_compiles(True), caplog.at_level(logging.DEBUG):
        outs = [jaxext.mul_constant(x, c) for c in constants]
    compiles = [r for r in caplog.records if "Compiling" in r.getMessage()]
    assert compiles == [], [r.getMessage() for r in compiles]
    for c, out in zip(constants, outs, strict=True):
        assert out.dtype == jnp.float32
        np.testing.assert_allclose(out, np.asarray(x, np.float64) * c, rtol=1e-6)


def test_eager_grad_jvp_vmap_with_new_constants_compile_nothing(x64):
    """Eager grad, jvp and vmap, each call with a new Python constant: after one warm-up
    call, no compilation (counted by jax.monitoring's compile events)."""
    x = np.linspace(-1.0, 1.0, 12).reshape(3, 4)
    grad = jax.grad(lambda x, c: jnp.sum(jnp.sin(jaxext.mul_constant(x, c))))
    jvp = lambda c: jax.jvp(lambda v: jaxext.mul_constant(v, c), (x,), (x,))  # noqa: E731
    vmapped = jax.vmap(jaxext.mul_constant, in_axes=(0, None))
    calls = (lambda c: grad(x, c), jvp, lambda c: vmapped(x, c))
    for call in calls:
        jax.block_until_ready(call(0.5))
    constants = [1.0 + 0.37 * i for i in range(15)]
    with CompileCounter() as compiles:
        outs = [[jax.block_until_ready(call(c)) for call in calls] for c in constants]
    assert compiles.count == 0
    for c, (g, (y, y_dot), v) in zip(constants, outs, strict=True):
        np.testing.assert_allclose(g, c * np.cos(c * x), rtol=1e-14)
        np.testing.assert_allclose(y, c * x, rtol=1e-15)
        np.testing.assert_allclose(y_dot, c * x, rtol=1e-15)
        np.testing.assert_allclose(v, c * x, rtol=1e-15)
