"""Ported ``torch.autograd.Function``s behave as the originals do in PyTorch.

Each behaviour is checked against float64 JAX autodiff of the same math (always)
and against PyTorch on the original Function (where ``torch`` is installed).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxext
from tests.helpers import assert_close

# -- argument binding: positional, keyword, defaults (setup_context style) ---------------------


class Affine(jaxext.Function):
    """``x * scale + shift``, in PyTorch 2's setup_context style with defaults."""

    @staticmethod
    def forward(x, scale=2.0, shift=1.0):
        return x * scale + shift

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, scale, shift = inputs  # every input, defaults filled in, as torch passes them
        ctx.scale = scale

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None, None


class AffineCtx(jaxext.Function):
    """The same in the ``forward(ctx, ...)`` style."""

    @staticmethod
    def forward(ctx, x, scale=2.0, shift=1.0):
        ctx.scale = scale
        return x * scale + shift

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None, None


CALLS = [
    ((), {}),
    ((5.0,), {}),
    ((), {"shift": 5.0}),
    ((), {"scale": 3.0}),
    ((5.0,), {"shift": 4.0}),
]


def affine_reference(x, scale=2.0, shift=1.0):
    return x * scale + shift


@pytest.mark.parametrize("call", CALLS, ids=str)
def test_setup_context_style_binds_like_torch(call, x64):
    args, kwargs = call
    x = jnp.arange(3.0)
    assert_close(Affine.apply(x, *args, **kwargs), affine_reference(x, *args, **kwargs))
    got = jax.grad(lambda x: Affine.apply(x, *args, **kwargs).sum())(x)
    want = jax.grad(lambda x: affine_reference(x, *args, **kwargs).sum())(x)
    assert_close(got, want)


@pytest.mark.parametrize("call", CALLS, ids=str)
def test_binding_matches_torch(call):
    torch = pytest.importorskip("torch")
    args, kwargs = call

    class TorchAffine(torch.autograd.Function):
        @staticmethod
        def forward(x, scale=2.0, shift=1.0):
            return x * scale + shift

        @staticmethod
        def setup_context(ctx, inputs, output):
            x, scale, shift = inputs
            ctx.scale = scale

        @staticmethod
        def backward(ctx, g):
            return g * ctx.scale, None, None

    x = np.arange(3.0)
    want = TorchAffine.apply(torch.from_numpy(x), *args, **kwargs).numpy()
    with jax.enable_x64(True):
        assert_close(Affine.apply(jnp.asarray(x), *args, **kwargs), want)


def test_ctx_style_keywords_map_after_ctx_without_defaults():
    x = jnp.arange(3.0)
    assert_close(AffineCtx.apply(x, 5.0), affine_reference(x, 5.0))
    assert_close(AffineCtx.apply(x, scale=5.0), affine_reference(x, scale=5.0))
    # As in torch's C++ apply: a keyword that skips an earlier parameter is an error.
    with pytest.raises(TypeError, match=r"`AffineCtx.apply`: keyword argument\(s\) \['shift'\]"):
        AffineCtx.apply(x, shift=5.0)


# -- jvp: None tangents for integer inputs; none for non-differentiable outputs ---------------


class Gather(jaxext.Function):
    @staticmethod
    def forward(x, index):
        return x[index]

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, index = inputs
        ctx.size = x.shape[0]
        ctx.save_for_backward(index)
        ctx.save_for_forward(index)

    @staticmethod
    def backward(ctx, g):
        (index,) = ctx.saved_tensors
        return jnp.zeros(ctx.size, g.dtype).at[index].add(g), None

    @staticmethod
    def jvp(ctx, x_tangent, index_tangent):
        assert index_tangent is None, f"an integer input's tangent must be None: {index_tangent}"
        (index,) = ctx.saved_tensors
        return x_tangent[index]


@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "jacrev"])
def test_integer_input_tangent_is_none(transform, x64):
    x, index = jnp.arange(4.0) ** 2, jnp.array([3, 0, 3])

    def reference(x):
        return x[index]

    def ported(x):
        return Gather.apply(x, index)

    if transform == "jvp":
        t = jnp.arange(4.0) + 1.0
        got, want = jax.jvp(ported, (x,), (t,)), jax.jvp(reference, (x,), (t,))
    else:
        got, want = getattr(jax, transform)(ported)(x), getattr(jax, transform)(reference)(x)
    assert_close(got, want)


class FloorAndDouble(jaxext.Function):
    @staticmethod
    def forward(x):
        return x * 2, jnp.floor(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, g_double, g_floor):
        return g_double * 2

    @staticmethod
    def jvp(ctx, x_tangent):
        return x_tangent * 2, x_tangent  # wrong: output 1 is non-differentiable


def test_jvp_tangent_for_non_differentiable_output_is_an_error():
    with pytest.raises(ValueError, match=r"`FloorAndDouble.jvp` returned a tangent for output 1"):
        jax.jacfwd(lambda x: FloorAndDouble.apply(x)[1])(1.5)
    # reverse mode is unaffected: no gradient flows through the marked output
    assert_close(jax.jacrev(lambda x: FloorAndDouble.apply(x)[1])(1.5), 0.0)


def test_jvp_tangent_for_non_differentiable_output_torch_also_refuses():
    torch = pytest.importorskip("torch")
    import torch.autograd.forward_ad as fwAD

    class TorchFloorAndDouble(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * 2, torch.floor(x)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.mark_non_differentiable(output[1])

        @staticmethod
        def backward(ctx, g_double, g_floor):
            return g_double * 2

        @staticmethod
        def jvp(ctx, x_tangent):
            return x_tangent * 2, x_tangent

    one = torch.tensor(1.5, dtype=torch.float64)
    with fwAD.dual_level(), pytest.raises(RuntimeError, match="not a differentiable"):
        TorchFloorAndDouble.apply(fwAD.make_dual(one, torch.ones_like(one)))


# -- once_differentiable: every second-order use raises, wherever the arrays live -------------


class CubeSavedAsAttribute(jaxext.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.x = x  # an attribute, not save_for_backward
        return x**3

    @staticmethod
    @jaxext.once_differentiable
    def backward(ctx, g):
        return g * 3 * ctx.x**2


class CubeByCallback(jaxext.Function):
    """A forward JAX cannot differentiate (host NumPy), a once-differentiable backward."""

    @staticmethod
    def forward(x):
        shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return jax.pure_callback(lambda a: np.asarray(a) ** 3, shape, x, vmap_method="sequential")

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    @jaxext.once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 3 * x**2


def _scalar_loss(function):
    return lambda x: jnp.sum(function.apply(x))


SECOND_ORDER = {
    "grad(grad)": lambda f: jax.grad(lambda x: jnp.sum(jax.grad(f)(x))),
    "hessian": jax.hessian,
    "jacfwd(grad)": lambda f: jax.jacfwd(jax.grad(f)),
    "jacrev(grad)": lambda f: jax.jacrev(jax.grad(f)),
}


@pytest.mark.parametrize(
    "function", [CubeSavedAsAttribute, CubeByCallback], ids=lambda f: f.__name__
)
@pytest.mark.parametrize("order2", SECOND_ORDER, ids=str)
def test_once_differentiable_refuses_every_second_order(function, order2):
    x = jnp.array([1.0, 2.0])
    loss = _scalar_loss(function)
    assert_close(jax.grad(loss)(x), 3 * x**2)  # first order works
    with pytest.raises(RuntimeError, match=rf"`{function.__name__}.backward` is decorated"):
        SECOND_ORDER[order2](loss)(x)


# -- Python scalars in every argument position ----------------------------------------------


class ScaleBy(jaxext.Function):
    """``x * c``, either of which may be differentiated or a Python number."""

    @staticmethod
    def forward(ctx, x, c):
        ctx.x, ctx.c = x, c  # attributes: c may be a Python number (static)
        return x * c

    @staticmethod
    def backward(ctx, g):
        grad_c = jnp.sum(g * ctx.x) if ctx.needs_input_grad[1] else None
        return g * ctx.c, grad_c


class ScaleBySetup(jaxext.Function):
    @staticmethod
    def forward(x, c):
        return x * c

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.x, ctx.c = inputs

    @staticmethod
    def backward(ctx, g):
        grad_x = (
            jnp.sum(g * ctx.c) if ctx.needs_input_grad[0] and jnp.ndim(ctx.x) == 0 else g * ctx.c
        )
        grad_c = jnp.sum(g * ctx.x) if ctx.needs_input_grad[1] else None
        return (grad_x if ctx.needs_input_grad[0] else None), grad_c


SCALARS = [2.0, 3, np.float32(1.5), np.float64(-0.5)]


@pytest.mark.parametrize("function", [ScaleBy, ScaleBySetup], ids=lambda f: f.__name__)
@pytest.mark.parametrize("c", SCALARS, ids=lambda c: type(c).__name__)
def test_python_scalar_static_or_differentiated(function, c):
    x = jnp.array([1.0, -2.0, 4.0])
    # c differentiated: JAX hands it over traced
    assert_close(jax.grad(lambda c: function.apply(x, c).sum())(float(c)), float(jnp.sum(x)))
    # c static (a Python or NumPy number), x differentiated
    assert_close(jax.grad(lambda x: function.apply(x, c).sum())(x), jnp.full(3, float(c)))
    assert_close(function.apply(x, c), x * float(c))
    assert_close(jax.jit(lambda x: function.apply(x, c))(x), x * float(c))


def test_python_scalar_as_the_differentiated_input():
    c = jnp.array([1.0, -2.0])
    assert_close(jax.grad(lambda x: ScaleBySetup.apply(x, c).sum())(3.0), float(jnp.sum(c)))
    assert_close(jax.jacfwd(lambda x: ScaleBySetup.apply(x, c))(3.0), c)


# -- higher orders come from the Function's own rules (saved outputs) -------------------------


def _numpy_cube(x):
    """x**3 and its derivative 3 x**2, computed on the host: JAX cannot differentiate it."""

    def host(a):
        a = np.asarray(a)
        return a**3, 3 * a**2

    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.pure_callback(host, (shape, shape), x, vmap_method="sequential")


class NumpyCube(jaxext.Function):
    """PyTorch's double-backward pattern: the derivative is an extra, saved output."""

    @staticmethod
    def forward(x):
        return _numpy_cube(x)

    @staticmethod
    def setup_context(ctx, inputs, outputs):
        (x,) = inputs
        _, dx = outputs
        ctx.save_for_backward(x, dx)

    @staticmethod
    def backward(ctx, grad_out, grad_dx):
        x, dx = ctx.saved_tensors
        return grad_out * dx + grad_dx * 6 * x


def cube(x):
    return NumpyCube.apply(x)[0]


HIGHER = {
    "grad(grad)": lambda f: jax.grad(lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(f(x)))(x))),
    "hessian": lambda f: jax.hessian(lambda x: jnp.sum(f(x))),
    "jvp(grad)": lambda f: (
        lambda x: jax.jvp(jax.grad(lambda x: jnp.sum(f(x))), (x,), (jnp.ones_like(x),))[1]
    ),
    "jacfwd(jacrev)": lambda f: jax.jacfwd(jax.jacrev(f)),
    "jacrev(jacrev)": lambda f: jax.jacrev(jax.jacrev(f)),
    "grad(grad(grad))": lambda f: jax.grad(
        lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(f(x)))(x)))(x))
    ),
}


def _cube_reference(x):
    return x**3


@pytest.mark.parametrize("transform", HIGHER, ids=str)
def test_saved_output_differentiates_through_the_function(transform, x64):
    x = jnp.array([0.5, -1.5, 2.0])
    got = HIGHER[transform](cube)(x)
    want = HIGHER[transform](_cube_reference)(x)  # float64 autodiff of the same math
    assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("transform", ["grad(grad)", "hessian", "jacfwd(jacrev)"])
def test_saved_output_matches_torch_func(transform):
    torch = pytest.importorskip("torch")
    from torch import func as tf

    class TorchNumpyCube(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            a = x.detach().numpy()
            return torch.from_numpy(a**3), torch.from_numpy(3 * a**2)

        @staticmethod
        def setup_context(ctx, inputs, outputs):
            (x,) = inputs
            _, dx = outputs
            ctx.save_for_backward(x, dx)

        @staticmethod
        def backward(ctx, grad_out, grad_dx):
            x, dx = ctx.saved_tensors
            return grad_out * dx + grad_dx * 6 * x

    x = np.array([0.5, -1.5, 2.0])
    tx = torch.from_numpy(x)

    def tcube(t):
        return TorchNumpyCube.apply(t)[0]

    torch_transforms = {
        "grad(grad)": lambda: tf.grad(lambda t: tf.grad(lambda t: tcube(t).sum())(t).sum())(tx),
        # torch's forward mode needs a jvp method; reverse over reverse gives the same matrix
        "hessian": lambda: tf.jacrev(tf.jacrev(lambda t: tcube(t).sum()))(tx),
        "jacfwd(jacrev)": lambda: tf.jacrev(tf.jacrev(tcube))(tx),
    }
    want = torch_transforms[transform]().numpy()
    with jax.enable_x64(True):
        got = HIGHER[transform](cube)(jnp.asarray(x))
    assert_close(got, want, rtol=1e-12, atol=1e-12)


class ExpSavingIntermediate(jaxext.Function):
    """Saves an intermediate (exp(x)) that is neither an input nor an output."""

    @staticmethod
    def forward(x):
        return jnp.exp(x) * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(jnp.exp(inputs[0]))

    @staticmethod
    def backward(ctx, g):
        (e,) = ctx.saved_tensors
        return g * 2 * e


def test_saved_intermediate_is_a_constant_as_in_torch():
    torch = pytest.importorskip("torch")
    from torch import func as tf

    class TorchExpSavingIntermediate(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            return torch.exp(x) * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(torch.exp(inputs[0]))

        @staticmethod
        def backward(ctx, g):
            (e,) = ctx.saved_tensors
            return g * 2 * e

    x = np.array([0.3, -0.7])
    hessian = tf.jacrev(tf.jacrev(lambda t: TorchExpSavingIntermediate.apply(t).sum()))
    want = hessian(torch.from_numpy(x))
    with jax.enable_x64(True):
        got = jax.hessian(lambda x: ExpSavingIntermediate.apply(x).sum())(jnp.asarray(x))
    assert_close(got, want.numpy(), rtol=1e-12, atol=1e-12)
