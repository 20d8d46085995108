"""Tests for `jaxext.linear`: values, gradients, dtypes, transforms and errors.

References are independent of the code under test: plain ``jnp`` autodiff of
``x @ weight.T + bias``, hand-written NumPy formulas, and PyTorch (both
``torch.nn.functional.linear`` and a port of the seed's ``LinearFunction``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_close,
    assert_close_to_float64,
    assert_first_and_second_order_close,
    assert_trees_equal,
    coarsest,
    count_hlo_dots,
    count_primitive,
    grid,
    in_float64,
    rand,
    reference_linear,
    skip_without_float16,
    vjp_kept,
)

import jaxext

F64 = np.float64

# (x shape, out_features); in_features is x.shape[-1].
SHAPES = [
    pytest.param((3,), 4, id="1d"),
    pytest.param((5, 3), 4, id="2d"),
    pytest.param((2, 5, 3), 4, id="3d"),
    pytest.param((0, 3), 4, id="empty-batch"),
    pytest.param((6, 3), 1, id="out1"),
    pytest.param((2, 3, 2), 1, id="3d-out1"),
]
BIAS = [pytest.param(True, id="bias"), pytest.param(False, id="nobias")]


DTYPES = ["float32", "float64", "bfloat16"]


@pytest.fixture(params=DTYPES)
def dtype(request):
    """A floating dtype; float64 turns on x64 for the one test that uses it."""
    if request.param == "float64":
        request.getfixturevalue("x64")
    return jnp.dtype(request.param)


def make_inputs(x_shape, out_features, use_bias, dtype, seed=0):
    in_features = x_shape[-1]
    x = jnp.asarray(rand(seed, x_shape), dtype)
    w = jnp.asarray(rand(seed + 1, (out_features, in_features)), dtype)
    b = jnp.asarray(rand(seed + 2, (out_features,)), dtype) if use_bias else None
    return x, w, b


def weighted_sum(fn, cotangent):
    """A scalar loss ``sum(fn(...) * cotangent)`` so that every output entry matters."""
    return lambda *args: jnp.sum(fn(*args).astype(cotangent.dtype) * cotangent)


# -- values and gradients against plain jnp autodiff ---------------------------------


@pytest.mark.parametrize(
    *grid(**{"x_shape,out_features": SHAPES}, use_bias=BIAS, dtype=DTYPES), indirect=["dtype"]
)
def test_value_and_grads_match_jnp_autodiff(x_shape, out_features, use_bias, dtype):
    args = make_inputs(x_shape, out_features, use_bias, dtype)
    # The reference is plain autodiff in float64 on the same (rounded) inputs.
    ct_dtype = jnp.float32 if dtype == jnp.bfloat16 else dtype
    n = max(int(np.prod(x_shape[:-1])), x_shape[-1], out_features)  # longest sum

    def check(actual, expected, err_msg=""):
        # bfloat16 results rounded to 8 significant bits: the rule at bfloat16's eps.
        assert_close_to_float64(actual, expected, n=n, err_msg=err_msg)

    y = jaxext.linear(*args)
    assert y.shape == x_shape[:-1] + (out_features,)
    assert y.dtype == dtype
    check(y, in_float64(reference_linear, *args))

    ct = np.asarray(rand(7, y.shape), ct_dtype)
    argnums = (0, 1, 2) if use_bias else (0, 1)
    grads = jax.grad(weighted_sum(jaxext.linear, jnp.asarray(ct)), argnums)(*args)

    def reference_grads(*args):
        return jax.grad(weighted_sum(reference_linear, jnp.asarray(ct, jnp.float64)), argnums)(
            *args
        )

    grads_ref = in_float64(reference_grads, *args)
    for name, g, g_ref, a in zip("xwb", grads, grads_ref, args, strict=False):
        assert g.shape == a.shape, name
        assert g.dtype == a.dtype, name
        check(g, g_ref, err_msg=f"grad of {name}")


@pytest.mark.parametrize("use_bias", BIAS)
@pytest.mark.parametrize(("x_shape", "out_features"), SHAPES)
def test_backward_maps_cotangent_to_three_grads(x_shape, out_features, use_bias, x64):
    """The VJP returns ``(grad_x, grad_weight, grad_bias)`` per the textbook formulas."""
    x, w, b = make_inputs(x_shape, out_features, use_bias, jnp.float64)
    y, vjp_fn = jax.vjp(jaxext.linear, x, w, b)
    ct = rand(3, y.shape, np.float64)
    grad_x, grad_w, grad_b = vjp_fn(jnp.asarray(ct))

    xn, wn = np.asarray(x), np.asarray(w)
    ct2 = ct.reshape(-1, out_features)  # every leading axis is a batch axis
    assert_close(grad_x, ct @ wn, rtol=1e-12, atol=1e-12)
    assert_close(grad_w, ct2.T @ xn.reshape(-1, xn.shape[-1]), rtol=1e-12, atol=1e-12)
    if use_bias:
        assert grad_b.shape == (out_features,)
        assert_close(grad_b, ct2.sum(axis=0), rtol=1e-12, atol=1e-12)
    else:
        assert grad_b is None


def test_out_features_one_bias_grad_keeps_its_shape():
    # The seed's `sum(0).squeeze(0)` collapses this gradient to a scalar.
    x, w, b = make_inputs((5, 3), 1, True, jnp.float32)
    grad_b = jax.grad(lambda b: jaxext.linear(x, w, b).sum())(b)
    assert grad_b.shape == (1,)
    assert_close(grad_b, [5.0])


def test_no_bias_grad_structure_has_none():
    x, w, _ = make_inputs((5, 3), 4, False, jnp.float32)
    params = {"x": x, "w": w, "b": None}
    grads = jax.grad(lambda p: jaxext.linear(p["x"], p["w"], p["b"]).sum())(params)
    assert grads["b"] is None
    assert_close_to_float64(grads["w"], np.broadcast_to(np.asarray(x, F64).sum(0), (4, 3)), n=5)
    gx, gw, gb = jax.grad(lambda x, w, b: jaxext.linear(x, w, b).sum(), (0, 1, 2))(x, w, None)
    assert gb is None
    assert gx.shape == x.shape and gw.shape == w.shape


# -- needs_input_grad: only wanted gradients, only needed residuals -------------------


def _grad_fns(argnum):
    def custom(x, w, b):
        return jaxext.linear(x, w, b).sum()

    def plain(x, w, b):
        return (x @ w.T + b).sum()

    return jax.grad(custom, argnum), jax.grad(plain, argnum)


@pytest.mark.parametrize(("argnum", "min_dots"), [(0, 1), (1, 1), (2, 0), ((0, 1, 2), 2)])
def test_compiled_grad_has_no_extra_matmuls(argnum, min_dots):
    x, w, b = make_inputs((8, 16), 32, True, jnp.float32)
    custom, plain = _grad_fns(argnum)
    n_custom = count_hlo_dots(jax.jit(custom).lower(x, w, b).compile().as_text())
    n_plain = count_hlo_dots(jax.jit(plain).lower(x, w, b).compile().as_text())
    assert n_plain >= min_dots  # the counter does see the products
    assert n_custom <= n_plain


@pytest.mark.parametrize(("argnum", "n_dots"), [(0, 1), (1, 1), (2, 0)])
def test_backward_computes_only_the_wanted_gradient(argnum, n_dots):
    """Before XLA's dead-code elimination: the backward pass itself has no extra products."""
    args = list(make_inputs((8, 16), 32, True, jnp.float32))

    def partial(fn):
        def f(v):
            return fn(*args[:argnum], v, *args[argnum + 1 :])

        return f

    _, vjp_custom = jax.vjp(partial(jaxext.linear), args[argnum])
    _, vjp_plain = jax.vjp(partial(reference_linear), args[argnum])
    ct = jnp.ones((8, 32), jnp.float32)
    n_custom = count_primitive(jax.make_jaxpr(vjp_custom)(ct), "dot_general")
    n_plain = count_primitive(jax.make_jaxpr(vjp_plain)(ct), "dot_general")
    assert n_plain == n_dots
    assert n_custom == n_plain


@pytest.mark.parametrize(("argnum", "needed"), [(0, "w"), (1, "x"), (2, None)])
def test_forward_keeps_only_what_the_wanted_gradient_needs(argnum, needed):
    x, w, b = make_inputs((64, 32), 16, True, jnp.float32)
    args = [x, w, b]

    def f(v):
        return jaxext.linear(*args[:argnum], v, *args[argnum + 1 :])

    leaves = vjp_kept(f, args[argnum])
    # grad_x needs w, grad_w needs x, grad_b needs nothing (PyTorch's
    # needs_input_grad pattern); what is kept is the operand itself.
    expected = {"x": [x], "w": [w], None: []}[needed]
    assert len(leaves) == len(expected)
    for leaf, array in zip(leaves, expected, strict=True):
        assert leaf.shape == array.shape and np.array_equal(leaf, array)

    # Compiled, the same memory as autodiff.
    def loss(op):
        return lambda *a: jnp.sum(jnp.sin(op(*a)))

    def temp_bytes(op):
        grad = jax.jit(jax.grad(loss(op), argnums=argnum))
        return grad.lower(x, w, b).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(jaxext.linear) <= temp_bytes(reference_linear)


@pytest.mark.parametrize("square", [True, False])
def test_jitted_linear_reused_with_different_differentiated_inputs(square):
    # A jitted helper used by two layers in one differentiated computation: layer 1's
    # input is data (not differentiated), layer 2's is. With a residual layout that
    # depends on what is perturbed, JAX 0.10 gives one backward the other's layout:
    # an internal error, or (square shapes) swapped residuals. Reference: jnp autodiff.
    helper = jax.jit(lambda x, w: jaxext.linear(x, w))
    n = 3 if square else 4
    x = jnp.asarray(rand(0, (5, 3)))
    w1, w2 = jnp.asarray(rand(1, (n, 3))), jnp.asarray(rand(2, (3, n)))

    def loss(op):
        return lambda w1, w2, x: jnp.sum(jnp.sin(op(op(x, w1), w2)))

    for argnums in [(0, 1), (0,), (1,), (2,), (0, 1, 2)]:
        got = jax.grad(loss(helper), argnums)(w1, w2, x)
        want = in_float64(jax.grad(loss(lambda x, w: x @ w.T), argnums), w1, w2, x)
        for g, r in zip(got, want, strict=True):
            assert_close_to_float64(g, r, n=20)


# -- dtypes ---------------------------------------------------------------------------

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


@pytest.mark.parametrize(
    ("x_dtype", "w_dtype", "b_dtype"),
    [
        (BF16, BF16, BF16),
        (BF16, F32, None),
        (BF16, F32, BF16),
        (F32, BF16, BF16),
        (F16, F16, F32),
        (BF16, BF16, F32),
    ],
)
def test_dtypes_follow_jnp_promotion_and_grads_keep_input_dtypes(x_dtype, w_dtype, b_dtype):
    if F16 in (x_dtype, w_dtype, b_dtype):
        skip_without_float16()
    x = jnp.asarray(rand(0, (4, 3)), x_dtype)
    w = jnp.asarray(rand(1, (2, 3)), w_dtype)
    b = None if b_dtype is None else jnp.asarray(rand(2, (2,)), b_dtype)
    y = jaxext.linear(x, w, b)
    assert y.dtype == reference_linear(x, w, b).dtype
    low = coarsest(x_dtype, w_dtype, b_dtype)  # what the product rounds in, at worst
    assert_close_to_float64(y, in_float64(reference_linear, x, w, b), n=3, dtype=low)

    argnums = (0, 1) if b is None else (0, 1, 2)
    grads = jax.grad(lambda *a: jaxext.linear(*a).astype(F32).sum(), argnums)(x, w, b)
    grads_ref = in_float64(jax.grad(lambda *a: reference_linear(*a).sum(), argnums), x, w, b)
    for g, g_ref, a in zip(grads, grads_ref, (x, w, b), strict=False):
        assert g.dtype == a.dtype
        assert_close_to_float64(g, g_ref, n=4, dtype=low)


def test_integer_x_promotes_like_jnp():
    x = jnp.arange(6).reshape(2, 3)
    w = jnp.asarray(rand(1, (4, 3)))
    y = jaxext.linear(x, w)
    assert y.dtype == reference_linear(x, w).dtype == jnp.float32
    assert_close_to_float64(y, in_float64(reference_linear, x, w), n=3)
    assert_close(
        jax.grad(lambda w: jaxext.linear(x, w).sum())(w), np.broadcast_to([3, 5, 7], (4, 3))
    )


@pytest.mark.parametrize("use_bias", BIAS)
def test_preferred_element_type(use_bias):
    x, w, b = make_inputs((5, 7), 3, use_bias, BF16)
    y = jaxext.linear(x, w, b, preferred_element_type=F32)
    assert y.dtype == F32
    # Products of bfloat16 values are exact in float32: only the f32 sum rounds.
    assert_close_to_float64(y, in_float64(reference_linear, x, w, b), n=7)

    argnums = (0, 1, 2) if use_bias else (0, 1)
    loss = lambda *a: jaxext.linear(*a, preferred_element_type=F32).sum()  # noqa: E731
    grads = jax.grad(loss, argnums)(x, w, b)
    grads_ref = in_float64(jax.grad(lambda *a: reference_linear(*a).sum(), argnums), x, w, b)
    for g, g_ref, a in zip(grads, grads_ref, (x, w, b), strict=False):
        assert g.dtype == BF16 == a.dtype
        assert_close_to_float64(g, g_ref, n=5)


def _f32_sin_loss(y):
    # A nonlinear float32 loss so that every output element gets its own cotangent.
    return jnp.sum(jnp.sin(y.astype(F32)))


def _reference_preferred(x, weight, bias):
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    y = jax.lax.dot_general(x, weight, dims, preferred_element_type=F32)
    return y if bias is None else y + bias.astype(F32)


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("shape", [(4, 16), (2, 3, 16)])
def test_preferred_element_type_f32_on_bf16_is_bit_exact(shape, use_bias):
    x = jnp.asarray(rand(5, shape), BF16)
    weight = jnp.asarray(rand(6, (8, 16)), BF16)
    bias = jnp.asarray(rand(7, (8,)), BF16) if use_bias else None

    y = jaxext.linear(x, weight, bias, preferred_element_type=F32)
    y_ref = _reference_preferred(x, weight, bias)
    assert y.dtype == F32
    assert_trees_equal(y, y_ref)
    # The f32 result keeps what bfloat16 would round away.
    assert not np.array_equal(np.asarray(y), np.asarray(y.astype(BF16).astype(F32)))

    def grads(fn):
        argnums = (0, 1, 2) if use_bias else (0, 1)
        return jax.grad(lambda *a: _f32_sin_loss(fn(*a)), argnums=argnums)(x, weight, bias)

    ours = grads(lambda x, w, b: jaxext.linear(x, w, b, preferred_element_type=F32))
    theirs = grads(_reference_preferred)
    for name, g, g_ref in zip(("x", "weight", "bias"), ours, theirs, strict=False):
        assert g.dtype == BF16, name  # gradients come back in each input's dtype
        assert_trees_equal(g, g_ref)


def test_precision_is_accepted_and_hashable_under_jit():
    x, w, b = make_inputs((5, 3), 4, True, F32)
    f = jax.jit(lambda x, w, b: jaxext.linear(x, w, b, precision="highest"))
    assert_close_to_float64(f(x, w, b), in_float64(reference_linear, x, w, b), n=3)
    g = jax.grad(lambda w: jaxext.linear(x, w, b, precision=jax.lax.Precision.HIGHEST).sum())(w)
    g_ref = in_float64(jax.grad(lambda w, x, b: reference_linear(x, w, b).sum()), w, x, b)
    assert_close_to_float64(g, g_ref, n=5)


def test_out_sharding_sets_the_result_sharding_and_is_checked():
    # One device here; tests/test_sharding.py covers row parallelism on 8 devices.
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    x, w, b = make_inputs((4, 3), 2, True, F32)
    spec = jax.sharding.PartitionSpec("data", None)
    seen = []

    def f(x, w, b):
        y = jaxext.linear(x, w, b, out_sharding=spec)
        seen.append(jax.typeof(y).sharding.spec)  # the result's type carries the sharding
        return y

    with jax.set_mesh(mesh):
        y = jax.jit(f)(x, w, b)
        assert jax.typeof(jax.jit(lambda x: x @ w.T)(x)).sharding.spec != spec
    assert seen == [spec]
    assert_close_to_float64(y, in_float64(reference_linear, x, w, b), n=3)
    with pytest.raises(TypeError, match="`out_sharding`.*got tuple"):
        jaxext.linear(x, w, b, out_sharding=("data", None))


def test_complex_vjp_matches_jnp(x64):
    x = jnp.asarray(rand(0, (4, 3), F64) + 1j * rand(1, (4, 3), F64))
    w = jnp.asarray(rand(2, (2, 3), F64) - 1j * rand(3, (2, 3), F64))
    b = jnp.asarray(rand(4, (2,), F64) + 0.5j)
    ct = jnp.asarray(rand(5, (4, 2), F64) + 1j * rand(6, (4, 2), F64))
    y, vjp_fn = jax.vjp(jaxext.linear, x, w, b)
    y_ref, vjp_ref = jax.vjp(reference_linear, x, w, b)
    assert_close(y.real, y_ref.real, rtol=1e-12, atol=1e-12)
    assert_close(y.imag, y_ref.imag, rtol=1e-12, atol=1e-12)
    for g, g_ref in zip(vjp_fn(ct), vjp_ref(ct), strict=True):
        assert_close(g.real, g_ref.real, rtol=1e-12, atol=1e-12)
        assert_close(g.imag, g_ref.imag, rtol=1e-12, atol=1e-12)


# -- transformations ------------------------------------------------------------------


@pytest.mark.parametrize("use_bias", BIAS)
@pytest.mark.parametrize(("x_shape", "out_features"), SHAPES[:4])
def test_jit(x_shape, out_features, use_bias):
    args = make_inputs(x_shape, out_features, use_bias, F32)
    argnums = (0, 1, 2) if use_bias else (0, 1)
    n = max(int(np.prod(x_shape[:-1])), x_shape[-1], out_features)  # longest sum
    y_ref = in_float64(reference_linear, *args)
    assert_close_to_float64(jax.jit(jaxext.linear)(*args), y_ref, n=n)
    loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a)))  # noqa: E731
    grads = jax.jit(jax.grad(loss(jaxext.linear), argnums))(*args)
    grads_ref = in_float64(jax.grad(loss(reference_linear), argnums), *args)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert_close_to_float64(g, g_ref, n=n)


@pytest.mark.parametrize("in_axes", [(0, None, None), (0, 0, 0), (None, 0, None), (1, None, 0)])
def test_vmap_of_value_and_grad(in_axes):
    unbatched = {0: (5, 4), 1: (2, 4), 2: (2,)}  # x, weight, bias of one example

    def make(i, axis):
        shape = list(unbatched[i])
        if axis is not None:
            shape.insert(axis, 3)
        return jnp.asarray(rand(10 + i, tuple(shape)))

    args = [make(i, axis) for i, axis in enumerate(in_axes)]

    def value_and_grads(fn):
        loss = lambda *a: jnp.sum(jnp.tanh(fn(*a)))  # noqa: E731
        return jax.vmap(jax.value_and_grad(loss, (0, 1, 2)), in_axes=in_axes)

    v, grads = value_and_grads(jaxext.linear)(*args)
    v_ref, grads_ref = in_float64(value_and_grads(reference_linear), *args)
    assert v.shape == (3,)
    assert_close_to_float64(v, v_ref, n=10)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert g.shape == g_ref.shape
        assert_close_to_float64(g, g_ref, n=10)


def _nonlinear_loss(fn):
    return lambda x, w, b: jnp.sum(jnp.tanh(fn(x, w, b)) ** 2)


SECOND_ORDER_CASES = [
    pytest.param((3,), 4, True, id="1d"),
    pytest.param((5, 3), 4, False, id="2d-nobias"),
    pytest.param((2, 5, 3), 4, True, id="3d"),
    pytest.param((0, 3), 4, True, id="empty-batch"),
    pytest.param((2, 3, 2), 1, True, id="3d-out1"),
]


@pytest.mark.parametrize(("x_shape", "out_features", "use_bias"), SECOND_ORDER_CASES)
def test_grad_of_grad_and_jacrev_jacrev_match_jnp(x_shape, out_features, use_bias, x64):
    args = make_inputs(x_shape, out_features, use_bias, jnp.float64)
    argnums = (0, 1, 2) if use_bias else (0, 1)

    def second_order(fn):
        loss = _nonlinear_loss(fn)

        def grad_fn(x, w, b):
            # A function of the gradient, differentiated again.
            gx, gw = jax.grad(loss, (0, 1))(x, w, b)
            return jnp.sum(gx**2) + jnp.sum(jnp.sin(gw))

        def both(*a):
            hessian = jax.jacrev(jax.jacrev(loss, argnums), argnums)(*a)
            return jax.grad(grad_fn, argnums)(*a), hessian

        return jax.jit(both)(*args)

    assert_first_and_second_order_close(second_order(jaxext.linear), second_order(reference_linear))


# -- PyTorch ----------------------------------------------------------------------------


def _torch_linear_function():
    """A port of the seed's ``LinearFunction`` with its defects fixed (leading dims, out=1)."""
    torch = pytest.importorskip("torch")

    class LinearFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias=None):
            ctx.save_for_backward(x, weight, bias)
            out = x @ weight.t()
            return out if bias is None else out + bias

        @staticmethod
        def backward(ctx, grad_output):
            x, weight, bias = ctx.saved_tensors
            grad_x = grad_weight = grad_bias = None
            g2 = grad_output.reshape(-1, grad_output.shape[-1])
            if ctx.needs_input_grad[0]:
                grad_x = grad_output @ weight
            if ctx.needs_input_grad[1]:
                grad_weight = g2.t() @ x.reshape(-1, x.shape[-1])
            if bias is not None and ctx.needs_input_grad[2]:
                grad_bias = g2.sum(0)
            return grad_x, grad_weight, grad_bias

    return LinearFunction


@pytest.mark.parametrize("use_bias", BIAS)
@pytest.mark.parametrize(("x_shape", "out_features"), SHAPES)
def test_matches_torch_values_grads_and_second_order(x_shape, out_features, use_bias, x64):
    torch = pytest.importorskip("torch")
    functional = torch.nn.functional
    torch_fn = _torch_linear_function().apply
    args = make_inputs(x_shape, out_features, use_bias, jnp.float64)
    n = len(args) if use_bias else 2
    argnums = tuple(range(n))
    ct = rand(9, x_shape[:-1] + (out_features,), np.float64)

    y = jaxext.linear(*args)
    grads = jax.grad(weighted_sum(jaxext.linear, jnp.asarray(ct)), argnums)(*args)
    loss = _nonlinear_loss(jaxext.linear)

    def second_order(*a):
        grad2 = jax.grad(lambda *a: jnp.sum(jax.grad(loss, 1)(*a) ** 2), argnums)(*a)
        return grad2, jax.jacrev(jax.jacrev(loss, argnums), argnums)(*a)

    grad2, hess = jax.jit(second_order)(*args)

    for ref in (functional.linear, torch_fn):
        t_args = [torch.tensor(np.asarray(a), requires_grad=True) for a in args[:n]]
        call = (lambda *a, ref=ref: ref(*a, None)) if not use_bias else ref
        t_y = call(*t_args)
        assert_close(y, t_y.detach().numpy(), rtol=1e-12, atol=1e-12)
        t_grads = torch.autograd.grad((t_y * torch.from_numpy(ct)).sum(), t_args)
        for g, t_g in zip(grads, t_grads, strict=True):
            assert_close(g, t_g.numpy(), rtol=1e-12, atol=1e-12)

        def t_loss(*a, call=call):
            return (torch.tanh(call(*a)) ** 2).sum()

        # grad of a function of the gradient (double backward through the Function).
        t_gw = torch.autograd.grad(t_loss(*t_args), t_args[1], create_graph=True)[0]
        t_grad2 = torch.autograd.grad((t_gw**2).sum(), t_args, allow_unused=True)
        for g, t_g in zip(grad2, t_grad2, strict=True):
            assert_close(
                g, np.zeros(g.shape) if t_g is None else t_g.numpy(), rtol=1e-12, atol=1e-12
            )

        if any(t.numel() == 0 for t in t_args):
            continue  # torch's hessian cannot stack an empty Jacobian
        t_hess = torch.autograd.functional.hessian(t_loss, tuple(t.detach() for t in t_args))
        for row, t_row in zip(hess, t_hess, strict=True):
            for h, t_h in zip(row, t_row, strict=True):
                assert_close(h, t_h.numpy(), rtol=1e-12, atol=1e-12)


# -- errors -------------------------------------------------------------------------------

X, W, B = np.ones((2, 3), np.float32), np.ones((4, 3), np.float32), np.ones(4, np.float32)

BAD_INPUTS = [
    pytest.param(
        (np.ones((2, 5)), W, B), ValueError, r"`x`.*\b5\b.*in_features=3", id="in-mismatch"
    ),
    pytest.param(
        (np.ones(5), W, None), ValueError, r"`x`.*\b5\b.*in_features=3", id="in-mismatch-1d"
    ),
    pytest.param(
        (X, np.ones(3), B), ValueError, r"`weight` must be 2-D.*got shape \(3,\)", id="w-1d"
    ),
    pytest.param(
        (X, np.ones((1, 4, 3)), B), ValueError, r"`weight` must be 2-D.*\(1, 4, 3\)", id="w-3d"
    ),
    pytest.param(
        (X, W, np.ones(3)), ValueError, r"`bias`.*\(out_features,\) = \(4,\).*\(3,\)", id="b-len"
    ),
    pytest.param((X, W, np.ones((1, 4))), ValueError, r"`bias`.*\(4,\).*\(1, 4\)", id="b-2d"),
    pytest.param((X, W, np.float32(1.0)), ValueError, r"`bias`.*\(4,\).*got shape \(\)", id="b-0d"),
    pytest.param(
        (np.float32(2.0), W, B), ValueError, r"`x`.*in_features.*3.*scalar", id="x-scalar"
    ),
    pytest.param(("abc", W, B), TypeError, r"`x`.*numeric.*str", id="x-str"),
    pytest.param((None, W, B), TypeError, r"`x`.*numeric.*NoneType", id="x-none"),
    pytest.param((X, "w", B), TypeError, r"`weight`.*numeric.*str", id="w-str"),
    pytest.param((X, W, "b"), TypeError, r"`bias`.*numeric.*str", id="b-str"),
    pytest.param((X.astype(bool), W, B), TypeError, r"`x`.*numeric dtype.*bool", id="x-bool"),
    pytest.param((X, W.astype(bool), B), TypeError, r"`weight`.*numeric dtype.*bool", id="w-bool"),
    pytest.param((X, W, B.astype(bool)), TypeError, r"`bias`.*numeric dtype.*bool", id="b-bool"),
    pytest.param((X, W, False), TypeError, r"`bias`.*or None; got False", id="bias-False"),
    pytest.param(([[1.0, 2.0, 3.0]], W, B), TypeError, r"`x`.*list.*jnp.asarray", id="x-list"),
    pytest.param((np.array(["a", "b", "c"]), W, B), TypeError, r"`x`.*numeric", id="x-str-array"),
    pytest.param(
        ({"a": X}, W, B), TypeError, r"`x` must be a numeric array; got a dict", id="x-dict"
    ),
    pytest.param((X, {"w": W}, B), TypeError, r"`weight`.*got a dict", id="w-dict"),
]


@pytest.mark.parametrize(("args", "error", "match"), BAD_INPUTS)
def test_bad_input_is_refused_by_name(args, error, match):
    with pytest.raises(error, match=match):
        jaxext.linear(*args)


JITTABLE_BAD_INPUTS = [
    p
    for p in BAD_INPUTS
    if p.id not in {"x-str", "w-str", "b-str", "x-list", "x-str-array", "bias-False"}
]


@pytest.mark.parametrize(("args", "error", "match"), JITTABLE_BAD_INPUTS)
def test_bad_input_is_refused_at_trace_time_under_jit(args, error, match):
    with pytest.raises(error, match=match):
        jax.jit(jaxext.linear)(*args)
    x, weight, bias = args
    if np.issubdtype(np.asarray(weight).dtype, np.floating):
        with pytest.raises(error, match=match):
            jax.grad(lambda w: jaxext.linear(x, w, bias).sum())(weight)
