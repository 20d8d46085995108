"""Tests for `jaxext.Function` and `jaxext.once_differentiable`.

The two Functions of the "Extending PyTorch" note are ported line for line
(torch ops replaced by ``jnp``), exactly as in ``docs/porting_from_pytorch.md``.
References are independent of the code under test: plain ``jnp`` autodiff,
``jax.test_util.check_grads`` (finite differences), hand-computed values and PyTorch.
"""

from __future__ import annotations

import inspect
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    LinearFunction,
    MulConstant,
    OnceCube,
    assert_close,
    assert_close_to_float64,
    in_float64,
    rand,
    reference_linear,
    vjp_kept,
)
from jax.test_util import check_grads

import jaxext

# -- the seed's two Functions, ported line for line (helpers.py; same code as the guide) -----

linear = LinearFunction.apply
mul_constant = MulConstant.apply


# -- helpers ------------------------------------------------------------------------------

recorded: list = []  # what recording backwards observed, appended at trace time


@pytest.fixture(autouse=True)
def _clear_seen():
    recorded.clear()


class RecordingLinear(LinearFunction):
    """The ported LinearFunction, recording ``ctx.needs_input_grad`` in backward."""

    @staticmethod
    def backward(ctx, grad_output):
        recorded.append(ctx.needs_input_grad)
        return LinearFunction.backward(ctx, grad_output)


def linear_inputs(batch=5, in_features=3, out_features=4, dtype=np.float32, seed=0):
    x = jnp.asarray(rand(seed, (batch, in_features), dtype))
    w = jnp.asarray(rand(seed + 1, (out_features, in_features), dtype))
    b = jnp.asarray(rand(seed + 2, (out_features,), dtype))
    return x, w, b


def loss_of(fn):
    """A scalar whose gradient depends on every output entry (not just a sum)."""
    return lambda *args: jnp.sum(jnp.sin(fn(*args)))


# -- the seed ports against plain autodiff ----------------------------------------------------


@pytest.mark.parametrize("shape", [(5, 3, 4), (1, 2, 1), (7, 1, 3)], ids=str)
@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "nobias"])
def test_linear_port_values_and_grads_match_autodiff(shape, use_bias):
    x, w, b = linear_inputs(*shape)
    args = (x, w, b) if use_bias else (x, w)
    assert_close_to_float64(linear(*args), in_float64(reference_linear, *args), n=3)
    argnums = tuple(range(len(args)))
    got = jax.grad(loss_of(linear), argnums)(*args)
    want = in_float64(jax.grad(loss_of(reference_linear), argnums), *args)
    for g, r, a in zip(got, want, args, strict=True):
        assert g.shape == a.shape and g.dtype == a.dtype
        assert_close_to_float64(g, r, n=shape[0] * shape[2])


def test_linear_port_float64(x64):
    x, w, b = linear_inputs(dtype=np.float64)
    got = jax.grad(loss_of(linear), (0, 1, 2))(x, w, b)
    want = jax.grad(loss_of(reference_linear), (0, 1, 2))(x, w, b)
    for g, r in zip(got, want, strict=True):
        assert g.dtype == jnp.float64
        assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_linear_port_matches_torch():
    torch = pytest.importorskip("torch")
    x, w, b = linear_inputs()
    tx, tw, tb = (torch.tensor(np.asarray(a), requires_grad=True) for a in (x, w, b))
    torch.sin(torch.nn.functional.linear(tx, tw, tb)).sum().backward()
    got = jax.grad(loss_of(linear), (0, 1, 2))(x, w, b)
    for g, t in zip(got, (tx, tw, tb), strict=True):
        assert_close_to_float64(g, t.grad.numpy(), n=20)  # torch in float64


@pytest.mark.parametrize("constant", [3.0, -2, np.float32(0.5)], ids=["float", "int", "np"])
def test_mul_constant_port_static_constant(constant):
    x = jnp.asarray(rand(3, (4, 2)))
    assert_close(mul_constant(x, constant), np.asarray(x) * float(constant))
    got = jax.grad(loss_of(mul_constant))(x, constant)
    want = jax.grad(loss_of(lambda x, c: x * c))(x, constant)
    assert_close(got, want)
    # The constant is static: it is a trace-time Python value, also under jit.
    jitted = jax.jit(jax.grad(loss_of(mul_constant)), static_argnums=1)
    assert_close(jitted(x, constant), want)


def test_mul_constant_static_argument_change_retraces_under_jit():
    x = jnp.arange(3.0)
    f = jax.jit(jax.grad(lambda x, c: mul_constant(x, c).sum()), static_argnums=1)
    assert_close(f(x, 2.0), [2.0, 2.0, 2.0])
    assert_close(f(x, 5.0), [5.0, 5.0, 5.0])


# -- ctx.needs_input_grad ------------------------------------------------------------------------

ARGNUMS = [0, 1, 2, (0, 1), (0, 2), (1, 2), (0, 1, 2)]


@pytest.mark.parametrize("argnums", ARGNUMS, ids=str)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_needs_input_grad_follows_argnums(argnums, jit):
    x, w, b = linear_inputs()
    grad_fn = jax.grad(loss_of(RecordingLinear.apply), argnums)
    got = (jax.jit(grad_fn) if jit else grad_fn)(x, w, b)
    wanted = (argnums,) if isinstance(argnums, int) else argnums
    expected = tuple(i in wanted for i in range(3))
    assert recorded == [expected]
    want = in_float64(jax.grad(loss_of(reference_linear), argnums), x, w, b)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close_to_float64(g, r, n=20)


def test_needs_input_grad_has_one_entry_per_passed_argument():
    x, w, _ = linear_inputs()
    jax.grad(loss_of(RecordingLinear.apply), 1)(x, w)  # bias left at its default
    assert recorded == [(False, True)]


def test_static_argument_never_needs_grad():
    seen = []

    class Scale(jaxext.Function):
        @staticmethod
        def forward(ctx, x, factor, name):
            ctx.factor = factor
            return x * factor

        @staticmethod
        def backward(ctx, g):
            seen.append(ctx.needs_input_grad)
            return g * ctx.factor, None, None

    got = jax.grad(lambda x: Scale.apply(x, 2.0, "label").sum())(jnp.ones(3))
    assert seen == [(True, False, False)]
    assert_close(got, [2.0, 2.0, 2.0])


def test_keyword_arguments_bind_to_positions():
    x, w, b = linear_inputs()
    got = jax.grad(loss_of(lambda x, w, b: RecordingLinear.apply(x, w, bias=b)), 2)(x, w, b)
    assert recorded == [(False, False, True)]
    assert_close_to_float64(got, in_float64(jax.grad(loss_of(reference_linear), 2), x, w, b), n=20)


def test_numpy_array_inputs_are_differentiable():
    x, w, b = (np.asarray(a) for a in linear_inputs())
    got = jax.grad(loss_of(linear), 1)(x, w, b)
    assert_close_to_float64(got, in_float64(jax.grad(loss_of(reference_linear), 1), x, w, b), n=20)


# -- transforms ----------------------------------------------------------------------------------


def test_jit_values_and_grads():
    x, w, b = linear_inputs()
    assert_close_to_float64(jax.jit(linear)(x, w, b), in_float64(reference_linear, x, w, b), n=3)
    got = jax.jit(jax.grad(loss_of(linear), (0, 1, 2)))(x, w, b)
    want = in_float64(jax.grad(loss_of(reference_linear), (0, 1, 2)), x, w, b)
    for g, r in zip(got, want, strict=True):
        assert_close_to_float64(g, r, n=20)


@pytest.mark.parametrize("in_axes", [(0, None, None), (None, 0, None), (0, 0, 0)], ids=str)
def test_vmap_of_grad(in_axes):
    x, w, b = linear_inputs()
    stacked = [
        jnp.stack([a, 2 * a + 1]) if ax == 0 else a
        for a, ax in zip((x, w, b), in_axes, strict=True)
    ]
    got = jax.vmap(jax.grad(loss_of(linear), (0, 1, 2)), in_axes)(*stacked)
    want = in_float64(jax.vmap(jax.grad(loss_of(reference_linear), (0, 1, 2)), in_axes), *stacked)
    for g, r in zip(got, want, strict=True):
        assert_close_to_float64(g, r, n=20)


def test_grad_of_grad_and_jacrev(x64):
    x, w, b = linear_inputs(dtype=np.float64)

    def second(fn):
        return jax.grad(lambda w: jnp.sum(jax.grad(loss_of(fn), 0)(x, w, b) ** 2))

    assert_close(second(linear)(w), second(reference_linear)(w), rtol=1e-10, atol=1e-10)
    jac = jax.jacrev(linear, (0, 1, 2))(x, w, b)
    ref = jax.jacrev(reference_linear, (0, 1, 2))(x, w, b)
    for g, r in zip(jac, ref, strict=True):
        assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_check_grads_finite_differences(x64):
    x, w, b = linear_inputs(dtype=np.float64)
    check_grads(linear, (x, w, b), order=2, modes=["rev"])
    check_grads(lambda t: mul_constant(t, 1.5), (x,), order=2, modes=["rev"])


# -- ctx attributes --------------------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_ctx_attributes_reach_backward(jit):
    seen = {}

    class Affine(jaxext.Function):
        @staticmethod
        def forward(ctx, x, a, shift):
            ctx.scale = 2.5  # static Python float
            ctx.bag = {"a": a, "axes": [0], "pair": (x, "tag")}  # mixed, with a list
            ctx.shift = shift
            return ctx.scale * a * x + shift

        @staticmethod
        def backward(ctx, g):
            seen["types"] = (type(ctx.scale), type(ctx.bag["axes"]), ctx.bag["pair"][1])
            seen["a_is_array"] = isinstance(ctx.bag["a"], jax.Array)
            a, x = ctx.bag["a"], ctx.bag["pair"][0]
            return g * ctx.scale * a, jnp.sum(g * ctx.scale * x, axis=0), None

    x = jnp.asarray(rand(0, (4, 3)))
    a = jnp.asarray(rand(1, (3,)))
    grad_fn = jax.grad(lambda x, a: jnp.sum(Affine.apply(x, a, 1.0) ** 2), (0, 1))
    got = (jax.jit(grad_fn) if jit else grad_fn)(x, a)
    want = in_float64(jax.grad(lambda x, a: jnp.sum((2.5 * a * x + 1.0) ** 2), (0, 1)), x, a)
    assert seen == {"types": (float, list, "tag"), "a_is_array": True}
    for g, r in zip(got, want, strict=True):
        assert_close_to_float64(g, r, n=4)


def test_save_for_backward_rejects_python_values():
    class Bad(jaxext.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x, 2.0)
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(TypeError, match=r"`Bad`: save_for_backward .* value 1 is a float"):
        Bad.apply(jnp.ones(2))


# -- several outputs, mark_non_differentiable, set_materialize_grads -------------------------


class SinCos(jaxext.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return jnp.sin(x), jnp.cos(x)

    @staticmethod
    def backward(ctx, grad_sin, grad_cos):
        (x,) = ctx.saved_tensors
        recorded.append((grad_sin, grad_cos))
        return grad_sin * jnp.cos(x) - grad_cos * jnp.sin(x)


def test_several_outputs():
    x = jnp.asarray(rand(0, (5,)))
    s, c = SinCos.apply(x)
    assert_close_to_float64(s, np.sin(np.asarray(x, np.float64)))
    assert_close_to_float64(c, np.cos(np.asarray(x, np.float64)))

    def both(fn):
        return lambda x: jnp.sum(fn(x)[0] * 3.0 + fn(x)[1] ** 2)

    reference = lambda x: (jnp.sin(x), jnp.cos(x))  # noqa: E731
    want = in_float64(jax.grad(both(reference)), x)
    assert_close_to_float64(jax.grad(both(SinCos.apply))(x), want, n=4)


def test_unused_output_gets_zero_cotangent():
    x = jnp.asarray(rand(0, (5,)))
    got = jax.grad(lambda x: jnp.sum(SinCos.apply(x)[0] * 2.0))(x)
    assert_close_to_float64(got, 2.0 * np.cos(np.asarray(x, np.float64)))
    [(grad_sin, grad_cos)] = recorded
    assert_close(grad_sin, np.full(5, 2.0))
    assert grad_cos.shape == (5,) and not np.asarray(grad_cos).any()


def test_set_materialize_grads_false_passes_none():
    class SinCosLazy(SinCos):
        @staticmethod
        def forward(ctx, x):
            ctx.set_materialize_grads(False)
            return SinCos.forward(ctx, x)

        @staticmethod
        def backward(ctx, grad_sin, grad_cos):
            recorded.append(grad_cos)
            (x,) = ctx.saved_tensors
            return grad_sin * jnp.cos(x)

    x = jnp.asarray(rand(0, (5,)))
    got = jax.grad(lambda x: jnp.sum(SinCosLazy.apply(x)[0]))(x)
    assert recorded == [None]
    assert_close_to_float64(got, np.cos(np.asarray(x, np.float64)))


class SortWithIndices(jaxext.Function):
    """Sorted values plus the permutation (integer, marked non-differentiable)."""

    @staticmethod
    def forward(ctx, x):
        idx = jnp.argsort(x)
        values = x[idx]
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(idx)
        return values, idx

    @staticmethod
    def backward(ctx, grad_values, grad_idx):
        (idx,) = ctx.saved_tensors
        recorded.append(np.asarray(grad_idx))
        return jnp.zeros_like(grad_values).at[idx].set(grad_values)


class DoubleWithMarkedTriple(jaxext.Function):
    @staticmethod
    def forward(ctx, x):
        doubled, tripled = 2 * x, 3 * x
        ctx.mark_non_differentiable(tripled)
        return doubled, tripled

    @staticmethod
    def backward(ctx, grad_doubled, grad_tripled):
        recorded.append(np.asarray(grad_tripled))
        return 2 * grad_doubled + 3 * grad_tripled  # the second term must vanish


def test_mark_non_differentiable_blocks_gradient():
    x = jnp.asarray(rand(1, (4,)))

    def loss(x):
        doubled, tripled = DoubleWithMarkedTriple.apply(x)
        return jnp.sum((doubled + tripled) ** 2)

    # Only the unmarked output carries gradient: d/dx of (2x + stop(3x))^2 = 2 * 5x * 2.
    assert_close_to_float64(jax.grad(loss)(x), 20.0 * np.asarray(x, np.float64), n=4)
    [grad_tripled] = recorded
    assert grad_tripled.shape == (4,) and not grad_tripled.any()


def test_mark_non_differentiable_integer_output():
    x = jnp.asarray(rand(2, (6,)))
    values, idx = SortWithIndices.apply(x)
    assert_close(values, np.sort(np.asarray(x)))
    assert idx.dtype == jnp.argsort(x).dtype
    weights = jnp.arange(6.0)
    got = jax.grad(lambda x: jnp.sum(SortWithIndices.apply(x)[0] * weights))(x)
    assert_close(got, jax.grad(lambda x: jnp.sum(jnp.sort(x) * weights))(x))
    [grad_idx] = recorded
    assert grad_idx.shape == (6,) and not grad_idx.any()


def test_only_marked_output_used_skips_backward():
    x = jnp.asarray(rand(1, (4,)))
    got = jax.grad(lambda x: jnp.sum(DoubleWithMarkedTriple.apply(x)[1]))(x)
    assert recorded == []
    assert_close(got, np.zeros(4))


def test_mark_non_differentiable_rejects_non_outputs():
    class Bad(jaxext.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.mark_non_differentiable(x)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    with pytest.raises(ValueError, match=r"`Bad.forward`: value 0 .* not one of the returned"):
        Bad.apply(jnp.ones(2))


# -- once_differentiable -------------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_once_differentiable_first_order(jit):
    x = jnp.asarray(rand(0, (5,)))
    grad_fn = jax.grad(lambda x: jnp.sum(jnp.sin(OnceCube.apply(x))))
    got = (jax.jit(grad_fn) if jit else grad_fn)(x)
    # sin(x**3) amplifies the rounding of x**3 by |x**3| (up to ~20 here).
    want = in_float64(jax.grad(lambda x: jnp.sum(jnp.sin(x**3))), x)
    assert_close_to_float64(got, want, n=4, k=8 * 20)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_once_differentiable_rejects_second_order(jit):
    def grad_sum(x):
        return jnp.sum(jax.grad(lambda x: jnp.sum(OnceCube.apply(x)))(x))

    fn = jax.grad(grad_sum)
    with pytest.raises(RuntimeError, match=r"`OnceCube.backward` is decorated with @once_diff"):
        (jax.jit(fn) if jit else fn)(jnp.ones(3))
    with pytest.raises(RuntimeError, match="once_differentiable"):
        jax.jacrev(jax.grad(lambda x: jnp.sum(OnceCube.apply(x))))(jnp.ones(3))


# -- errors ----------------------------------------------------------------------------------------


def make_function(backward, forward=lambda ctx, x, c: x * c):
    return type(
        "Broken",
        (jaxext.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )


def grad_of(function, x=None, c=2.0, jit=False):
    x = jnp.ones((3, 2)) if x is None else x
    grad_fn = jax.grad(lambda x: jnp.sum(function.apply(x, c)))
    return (jax.jit(grad_fn) if jit else grad_fn)(x)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_error_gradient_for_static_argument(jit):
    broken = make_function(lambda ctx, g: (g * 2.0, jnp.sum(g)))
    with pytest.raises(TypeError, match=r"`Broken.backward` .* argument 1 \(`c`\).* static"):
        grad_of(broken, jit=jit)


@pytest.mark.parametrize(
    "result", [lambda g: g, lambda g: (g,), lambda g: (g, None, g)], ids=["bare", "one", "three"]
)
def test_error_wrong_gradient_count(result):
    broken = make_function(lambda ctx, g: result(g))
    with pytest.raises(
        ValueError, match=r"`Broken.backward` returned \d gradient\(s\); expected 2"
    ):
        grad_of(broken)


def test_extra_trailing_nones_are_allowed():
    fine = make_function(lambda ctx, g: (g * 2.0, None, None, None))
    assert_close(grad_of(fine), np.full((3, 2), 2.0))


@pytest.mark.parametrize("bad_shape", [(2, 3), (3,), (3, 2, 1)], ids=str)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_error_wrong_gradient_shape(bad_shape, jit):
    broken = make_function(lambda ctx, g: (jnp.ones(bad_shape), None))
    with pytest.raises(
        ValueError, match=r"`Broken.backward`: the gradient for argument 0 \(`x`\) must have"
    ):
        grad_of(broken, jit=jit)


@pytest.mark.parametrize("bad", [jnp.int32, jnp.bool_, jnp.complex64], ids=str)
def test_error_wrong_gradient_dtype_kind(bad):
    broken = make_function(lambda ctx, g: (g.astype(bad), None))
    with pytest.raises(TypeError, match=r"argument 0 \(`x`\) must be a floating array"):
        grad_of(broken)


def test_error_non_array_gradient():
    broken = make_function(lambda ctx, g: ("oops", None))
    with pytest.raises(TypeError, match=r"argument 0 \(`x`\) must be an array or None; got str"):
        grad_of(broken)


def test_float_gradient_is_cast_to_input_dtype(x64):
    cast = make_function(lambda ctx, g: (g.astype(jnp.float64) * 2.0, None))
    got = grad_of(cast, jnp.ones((3, 2), jnp.float32))
    assert got.dtype == jnp.float32
    assert_close(got, np.full((3, 2), 2.0))


def test_error_forward_returns_non_array():
    broken = make_function(lambda ctx, g: (g, None), forward=lambda ctx, x, c: float(c))
    with pytest.raises(TypeError, match=r"`Broken.forward` must return an array or a tuple"):
        broken.apply(jnp.ones(2), 2.0)


def test_error_static_argument_holding_arrays():
    with pytest.raises(TypeError, match=r"argument 1 \(`c`\) is a tuple holding arrays"):
        make_function(lambda ctx, g: (g, None)).apply(jnp.ones(2), (jnp.ones(2),))


def test_error_keyword_argument_gap():
    class Defaults(jaxext.Function):
        @staticmethod
        def forward(ctx, x, a=1.0, b=2.0):
            return x * a * b

        @staticmethod
        def backward(ctx, g):
            return g * 2.0

    with pytest.raises(TypeError, match=r"`Defaults.apply`: keyword argument\(s\) \['b'\]"):
        Defaults.apply(jnp.ones(2), b=3.0)
    with pytest.raises(TypeError, match=r"`LinearFunction.apply`: missing .* 'weight'"):
        linear(jnp.ones((2, 3)), bias=jnp.ones(4))


def test_error_missing_backward():
    class NoBackward(jaxext.Function):
        @staticmethod
        def forward(ctx, x):
            return x

    with pytest.raises(TypeError, match=r"`NoBackward` must define a static `backward`"):
        NoBackward.apply(jnp.ones(2))


def test_error_mark_dirty():
    broken = make_function(lambda ctx, g: (g, None), forward=lambda ctx, x, c: ctx.mark_dirty(x))
    with pytest.raises(TypeError, match="immutable"):
        broken.apply(jnp.ones(2), 1.0)


# -- jaxext.gradcheck / gradgradcheck ------------------------------------------------------------


class WrongLinear(LinearFunction):
    """The ported LinearFunction with a deliberately wrong weight gradient."""

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight, grad_bias = LinearFunction.backward(ctx, grad_output)
        return grad_input, 1.01 * grad_weight, grad_bias


def float64_linear_inputs():
    return tuple(np.asarray(a, np.float64) for a in linear_inputs(batch=3, out_features=2))


def test_gradcheck_accepts_ported_functions():
    # Without bias, the porting guide's own example runs the same two checks.
    x, w, b = float64_linear_inputs()
    assert jaxext.gradcheck(linear, (x, w, b), eps=1e-6, atol=1e-4)
    assert jaxext.gradgradcheck(linear, (x, w, b), eps=1e-6, atol=1e-4)
    assert jaxext.gradcheck(mul_constant, (x, 1.5), eps=1e-6, atol=1e-4)
    assert jaxext.gradcheck(lambda t: SinCos.apply(t), (x,), eps=1e-6, atol=1e-4)


def test_gradcheck_catches_a_wrong_backward():
    with pytest.raises(jaxext.GradcheckError):
        jaxext.gradcheck(WrongLinear.apply, float64_linear_inputs(), eps=1e-6, atol=1e-4)


def test_gradcheck_with_once_differentiable():
    x = np.linspace(0.5, 1.5, 5)
    assert jaxext.gradcheck(OnceCube.apply, (x,))
    with pytest.raises(RuntimeError, match="once_differentiable"):
        jaxext.gradgradcheck(OnceCube.apply, (x,))


# -- docs/porting_from_pytorch.md: every code block runs, and its ports are the ones above -----

GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "porting_from_pytorch.md"


def guide_blocks():
    """The guide's ```python blocks, split into PyTorch ones and JAX ones."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)
    torch_blocks = [b for b in blocks if b.startswith("import torch")]
    return torch_blocks, [b for b in blocks if not b.startswith("import torch")]


@pytest.fixture(scope="module")
def guide():
    """Namespace after running the guide's JAX blocks in order (they assert as they go)."""
    namespace: dict = {}
    for block in guide_blocks()[1]:
        exec(compile(block, str(GUIDE), "exec"), namespace)
    return namespace


def test_guide_ports_are_the_tested_ones():
    text = GUIDE.read_text()
    for cls in (LinearFunction, MulConstant):
        assert inspect.getsource(cls) in text


@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("batch_shape", [(5,), (2, 3)], ids=str)
def test_guide_linear_custom_vjp(guide, use_bias, batch_shape):
    x, w, b = linear_inputs()
    x = jnp.asarray(rand(9, (*batch_shape, 3)))
    args = (x, w, b) if use_bias else (x, w)
    assert_close_to_float64(guide["linear_vjp"](*args), in_float64(reference_linear, *args), n=3)
    argnums = tuple(range(len(args)))
    got = jax.grad(loss_of(guide["linear_vjp"]), argnums)(*args)
    want = in_float64(jax.grad(loss_of(reference_linear), argnums), *args)
    for g, r in zip(got, want, strict=True):
        assert_close_to_float64(g, r, n=24)


def test_guide_mul_constant_and_mul(guide):
    x, y = jnp.asarray(rand(0, (4,))), jnp.asarray(rand(1, (4,)))
    want = in_float64(jax.grad(lambda x: loss_of(lambda x, c: x * c)(x, 2.5)), x)
    assert_close_to_float64(jax.grad(loss_of(guide["mul_constant_vjp"]))(x, 2.5), want)
    assert_close_to_float64(jax.grad(loss_of(guide["mul_constant"]))(x, 2.5), want)
    for argnums in (0, 1, (0, 1)):
        got = jax.grad(loss_of(guide["mul"]), argnums)(x, y)
        want = in_float64(jax.grad(loss_of(lambda x, y: x * y), argnums), x, y)
        for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert_close_to_float64(g, r)


def test_guide_mul_keeps_only_what_is_needed_and_survives_jit_reuse(guide):
    mul = guide["mul"]
    x, y = jnp.asarray(rand(0, (4,))), jnp.asarray(rand(1, (4,)))
    leaves = vjp_kept(lambda x: mul(x, y), x)
    assert len(leaves) == 1 and np.array_equal(leaves[0], y)
    # One jitted helper, two uses with different inputs perturbed.
    helper = jax.jit(mul)
    c1, c2 = jnp.asarray(rand(2, (4,))), jnp.asarray(rand(3, (4,)))

    def loss(op):
        return lambda x, c1, c2: jnp.sum(jnp.sin(op(op(x, c1), c2)))

    for argnums in (0, 1, 2, (1, 2)):
        got = jax.grad(loss(helper), argnums)(x, c1, c2)
        want = in_float64(jax.grad(loss(lambda a, b: a * b), argnums), x, c1, c2)
        for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert_close_to_float64(g, r, n=2)


def test_guide_module(guide):
    layer = guide["Linear"](3, 2, rngs=guide["nnx"].Rngs(0))
    x = jnp.asarray(rand(0, (4, 3)))
    w, b = layer.weight[...], layer.bias[...]
    assert_close_to_float64(layer(x), in_float64(reference_linear, x, w, b), n=3)
    bound = 1 / np.sqrt(3)
    assert np.all(np.abs(np.asarray(w)) <= bound) and np.all(np.abs(np.asarray(b)) <= bound)
    grads = guide["nnx"].grad(lambda layer: loss_of(layer)(x))(layer)
    want = in_float64(jax.grad(loss_of(reference_linear), (1, 2)), x, w, b)
    assert_close_to_float64(grads["weight"][...], want[0], n=12)
    assert_close_to_float64(grads["bias"][...], want[1], n=4)


def test_guide_torch_originals_match_the_ports():
    torch = pytest.importorskip("torch")
    torch_blocks = guide_blocks()[0]
    assert len(torch_blocks) == 2
    namespace: dict = {}
    for block in torch_blocks:
        exec(compile(block, str(GUIDE), "exec"), namespace)
    x, w, b = (np.asarray(a, np.float64) for a in linear_inputs())
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    torch.sin(namespace["LinearFunction"].apply(tx, tw, tb)).sum().backward()
    got = jax.grad(loss_of(linear), (0, 1, 2))(x, w, b)
    for g, t in zip(got, (tx, tw, tb), strict=True):
        assert_close_to_float64(g, t.grad.numpy(), n=20)  # jax in float32, torch in float64
    tx.grad = None
    torch.sin(namespace["MulConstant"].apply(tx, 2.5)).sum().backward()
    got = jax.grad(loss_of(mul_constant))(x, 2.5)
    assert_close_to_float64(got, tx.grad.numpy(), n=2)


# -- a jitted Function reused with different inputs differentiated -------------------------


class SavesNoneWhenNotNeeded(jaxext.Function):
    """The PyTorch idiom: save each operand only if the other's gradient is wanted."""

    @staticmethod
    def forward(ctx, x, w):
        need_x, need_w = ctx.needs_input_grad
        ctx.save_for_backward(w if need_x else None, x if need_w else None)
        return x @ w.T

    @staticmethod
    def backward(ctx, g):
        w, x = ctx.saved_tensors
        grad_x = g @ w if ctx.needs_input_grad[0] else None
        grad_w = g.T @ x if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def test_saving_none_for_unneeded_values_keeps_only_the_needed_ones():
    x, w = jnp.asarray(rand(0, (64, 32))), jnp.asarray(rand(1, (16, 32)))
    for argnum, needed in [(0, w), (1, x)]:
        args = [x, w]

        def f(v, argnum=argnum, args=args):
            args[argnum] = v
            return SavesNoneWhenNotNeeded.apply(*args)

        leaves = vjp_kept(f, [x, w][argnum])
        assert len(leaves) == 1
        assert leaves[0].shape == needed.shape and np.array_equal(leaves[0], needed)


@pytest.mark.parametrize("function", [LinearFunction, SavesNoneWhenNotNeeded])
def test_jitted_function_reused_with_different_differentiated_inputs(function):
    # Layer 1's input is data, layer 2's is differentiated: with square shapes a
    # layout mix-up between the two backward passes could go unnoticed. The two
    # uses of SavesNoneWhenNotNeeded even save different values; the layout stays
    # the same (None is an empty slot), so each backward gets its own.
    helper = jax.jit(function.apply)
    x = jnp.asarray(rand(0, (5, 3)))
    w1, w2 = jnp.asarray(rand(1, (3, 3))), jnp.asarray(rand(2, (3, 3)))

    def loss(op):
        return lambda w1, w2, x: jnp.sum(jnp.sin(op(op(x, w1), w2)))

    for argnums in [(0,), (1,), (2,), (0, 1), (0, 1, 2)]:
        got = jax.grad(loss(helper), argnums)(w1, w2, x)
        want = in_float64(jax.grad(loss(reference_linear), argnums), w1, w2, x)
        for g, r in zip(got, want, strict=True):
            assert_close_to_float64(g, r, n=15)


def _saves_only_what_is_needed():
    """A fresh Function (its own jit cache) saving values chosen by needs_input_grad."""

    class SavesOnlyWhatIsNeeded(jaxext.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.kinds = tuple(k for k, need in zip("xw", ctx.needs_input_grad, strict=True) if need)
            ctx.save_for_backward(*(w if k == "x" else x for k in ctx.kinds))
            return x @ w.T

        @staticmethod
        def backward(ctx, g):
            grads = {"x": None, "w": None}
            for kind, saved in zip(ctx.kinds, ctx.saved_tensors, strict=True):
                grads[kind] = g @ saved if kind == "x" else g.T @ saved
            return grads["x"], grads["w"]

    return SavesOnlyWhatIsNeeded


def _reuse_setup():
    helper = jax.jit(_saves_only_what_is_needed().apply)
    x = jnp.asarray(rand(0, (5, 3)))
    w1, w2 = jnp.asarray(rand(1, (3, 3))), jnp.asarray(rand(2, (3, 3)))

    def loss(op):
        # Differentiating w1 only: use 1 saves x (for w's gradient), use 2 saves w2
        # (for its input's gradient): one array each, different static data.
        # Differentiating w1 and w2: use 2 saves two arrays, use 1 still one.
        return lambda w1, w2: jnp.sum(jnp.sin(op(op(x, w1), w2)))

    return helper, loss, (w1, w2)


@pytest.mark.parametrize(
    ("argnums", "primed"),
    [
        pytest.param((0,), False, id="same-count"),
        pytest.param((0,), True, id="same-count-primed"),
        pytest.param((0, 1), False, id="count-differs"),
        pytest.param((0, 1), True, id="count-differs-primed"),
    ],
)
def test_layout_depending_on_needs_input_grad_is_right_when_reused_under_jit(argnums, primed):
    # The two uses of the jitted helper save different values (different counts and
    # different non-array ctx data): each backward must get its own, whatever JAX caches.
    helper, loss, args = _reuse_setup()
    want = in_float64(jax.grad(loss(lambda x, w: x @ w.T), argnums), *args)
    if primed:  # one use alone first: the jit cache now holds that use's trace
        w1, w2 = args
        alone = jax.grad(lambda w: jnp.sum(jnp.sin(helper(w1, w))))(w2)
        alone_want = in_float64(jax.grad(lambda w: jnp.sum(jnp.sin(w1 @ w.T))), w2)
        assert_close_to_float64(alone, alone_want, n=5)
    got = jax.grad(loss(helper), argnums)(*args)
    for g, g_ref in zip(got, want, strict=True):
        assert_close_to_float64(g, g_ref, n=15)


def test_ctx_type_is_public():
    seen = []

    class Double(jaxext.Function):
        @staticmethod
        def forward(ctx: jaxext.FunctionCtx, x):
            seen.append(ctx)
            return 2 * x

        @staticmethod
        def backward(ctx: jaxext.FunctionCtx, g):
            seen.append(ctx)
            return 2 * g

    assert_close(jax.grad(lambda x: Double.apply(x).sum())(jnp.ones(3)), np.full(3, 2.0))
    # forward may be traced more than once (see the porting guide); backward once.
    assert len(seen) >= 2 and all(isinstance(ctx, jaxext.FunctionCtx) for ctx in seen)
    assert jaxext.FunctionCtx.__doc__


def test_setup_context_style_errors_name_the_right_argument():
    # forward takes no ctx in this style: argument 0 is `x`, not `w`.
    class Scale(jaxext.Function):
        @staticmethod
        def forward(x, w):
            return x * w

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(*inputs)

        @staticmethod
        def backward(ctx, g):
            return jnp.ones(7), None  # wrong shape for x

    with pytest.raises(ValueError, match=r"gradient for argument 0 \(`x`\) must have"):
        jax.grad(lambda x: Scale.apply(x, jnp.ones(3)).sum())(jnp.ones(3))


class _BranchingCube(jaxext.Function):
    @staticmethod
    def forward(ctx, x, threshold):
        if x.sum() > threshold:  # a Python `if` on traced values: an error under jit
            return x**3
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def test_a_python_if_on_a_traced_value_in_forward_names_the_users_forward_and_arguments():
    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        jax.jit(_BranchingCube.apply)(jnp.arange(3.0), 1.0)
    message = str(info.value)
    first = message.splitlines()[0]
    assert first.startswith("`_BranchingCube.forward` (")
    assert "needs the concrete value of `x`, `threshold`" in first
    assert "the function _BranchingCube.forward at " in message
    assert "the arguments x and threshold" in message  # JAX's explanation, with their names
    assert "Attempted boolean conversion of traced array" in message
    for internal in (
        "jaxext/_custom_vjp.py",
        "jaxext/_function.py",
        "custom_jvp fun",
        "diff_values",
    ):
        assert internal not in message, message


def test_a_python_if_on_a_traced_value_in_a_custom_vjp_names_the_users_function():
    @jaxext.custom_vjp
    def clipped(x, t):
        return x if x.sum() > t else 0 * x

    clipped.defvjp(lambda x, t: (clipped(x, t), None), lambda r, g: (g, None))
    with pytest.raises(jax.errors.ConcretizationTypeError) as info:
        jax.jit(clipped)(jnp.ones(3), 0.5)
    message = str(info.value)
    assert "needs the concrete value of `x`, `t`" in message.splitlines()[0]
    assert "clipped" in message.splitlines()[0]
    for internal in ("jaxext/_custom_vjp.py", "custom_jvp fun", "diff_values"):
        assert internal not in message, message


def test_a_python_if_on_a_traced_value_in_forward_under_grad_leads_with_the_users_forward():
    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        jax.jit(jax.grad(lambda x: _BranchingCube.apply(x, 1.0).sum()))(jnp.arange(3.0))
    message = str(info.value)
    assert message.startswith("`_BranchingCube.forward` ("), message
    assert "jaxext/_custom_vjp.py" not in message and "diff_values" not in message
    assert "the function <lambda> at " in message  # JAX names the user's own jitted lambda
