"""Forward mode wherever reverse mode works (issue 34): the ways ``jaxext/_forward_mode.py``
derives ``J t`` from a backward JAX cannot transpose, the ``differentiate_fwd`` opt-in,
and closures over an enclosing trace's tracers.

Every forward-mode result is compared with float64 autodiff of the same math (or with
finite differences where the math has none), never with jaxext itself.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxext
from tests.helpers import assert_close, assert_trees_close, tiered

# -- PyTorch's autograd_function_db ports, with their vmap staticmethods, without jvp ---------
# Their forwards run NumPy on the host; the backwards call the other ports, which lower
# through custom_vmap (JAX cannot transpose it): forward mode transposes the backward's
# linearization instead, through each inner op's own rules.


def _host(fn, shapes, *args):
    return jax.pure_callback(fn, shapes, *args, vmap_method="sequential")


class NumpyMul(jaxext.Function):
    @staticmethod
    def forward(x, y):
        shape = jax.ShapeDtypeStruct(jnp.broadcast_shapes(x.shape, y.shape), x.dtype)
        return _host(lambda a, b: np.asarray(a) * np.asarray(b), shape, x, y)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        gx = NumpyMul.apply(g, y) if ctx.needs_input_grad[0] else None
        gy = NumpyMul.apply(g, x) if ctx.needs_input_grad[1] else None
        return gx, gy

    @staticmethod
    def vmap(info, in_dims, x, y):
        x_dim, y_dim = in_dims
        x = jnp.moveaxis(x, x_dim, -1) if x_dim is not None else x[..., None]
        y = jnp.moveaxis(y, y_dim, -1) if y_dim is not None else y[..., None]
        return jnp.moveaxis(NumpyMul.apply(x, y), -1, 0), 0


class NumpyCube(jaxext.Function):
    @staticmethod
    def forward(x):
        shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return _host(lambda a: (np.asarray(a) ** 3, 3 * np.asarray(a) ** 2), (shape, shape), x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], output[1])

    @staticmethod
    def backward(ctx, grad_output, grad_saved):
        x, dx = ctx.saved_tensors
        return NumpyMul.apply(grad_output, dx) + 6 * NumpyMul.apply(grad_saved, x)

    @staticmethod
    def vmap(info, in_dims, x):
        return NumpyCube.apply(x), (in_dims[0], in_dims[0])


class NumpyExp(jaxext.Function):
    """PyTorch's ``NumpyExp_`` without the in-place update (JAX arrays are immutable)."""

    @staticmethod
    def forward(x):
        return _host(lambda a: np.exp(np.asarray(a)), jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return NumpyMul.apply(g, out)

    @staticmethod
    def vmap(info, in_dims, x):
        return NumpyExp.apply(x), in_dims[0]


class NumpyTake(jaxext.Function):
    @staticmethod
    def forward(x, ind, ind_inv, dim):
        shape = jax.ShapeDtypeStruct(ind.shape, x.dtype)
        take = functools.partial(np.take_along_axis, axis=dim)
        return _host(lambda a, i: take(np.asarray(a), np.asarray(i)), shape, x, ind)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ind, ind_inv, dim = inputs
        ctx.save_for_backward(ind, ind_inv)
        ctx.dim = dim

    @staticmethod
    def backward(ctx, g):
        ind, ind_inv = ctx.saved_tensors
        return NumpyTake.apply(g, ind_inv, ind, ctx.dim), None, None, None

    @staticmethod
    def vmap(info, in_dims, x, ind, ind_inv, dim):
        def batched(a, d):
            return (
                jnp.moveaxis(a, d, 0)
                if d is not None
                else jnp.broadcast_to(a, (info.batch_size, *a.shape))
            )

        x, ind, ind_inv = (
            batched(a, d) for a, d in zip((x, ind, ind_inv), in_dims[:3], strict=True)
        )
        return NumpyTake.apply(x, ind, ind_inv, dim + 1), 0


class NumpySort(jaxext.Function):
    @staticmethod
    def forward(x, dim):
        def host(a):
            a = np.asarray(a)
            ind = np.argsort(a, axis=dim)
            return np.take_along_axis(a, ind, dim), ind, np.argsort(ind, axis=dim)

        ints = jax.ShapeDtypeStruct(x.shape, jnp.int32)
        shapes = (jax.ShapeDtypeStruct(x.shape, x.dtype), ints, ints)
        return _host(
            lambda a: tuple(np.asarray(o, s.dtype) for o, s in zip(host(a), shapes, strict=True)),
            shapes,
            x,
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, dim = inputs
        _, ind, ind_inv = output
        ctx.mark_non_differentiable(ind, ind_inv)
        ctx.save_for_backward(ind, ind_inv)
        ctx.dim = dim

    @staticmethod
    def backward(ctx, g, _0, _1):
        ind, ind_inv = ctx.saved_tensors
        return NumpyTake.apply(g, ind_inv, ind, ctx.dim), None

    @staticmethod
    def vmap(info, in_dims, x, dim):
        return NumpySort.apply(jnp.moveaxis(x, in_dims[0], 0), dim + 1), (0, 0, 0)


X = np.array([[0.5, -1.5, 2.0, 0.25], [1.25, -0.75, 0.1, -2.0]])
Y = np.array([[1.5, 0.5, -1.0, 2.0], [-0.5, 0.25, 1.75, 1.0]])
_SORTED = np.argsort(X, axis=1)

DB = {  # name: (port, float64 reference of the same math)
    "NumpyMul": (lambda x: NumpyMul.apply(x, jnp.asarray(Y)), lambda x: x * Y),
    "NumpyCube": (lambda x: NumpyCube.apply(x), lambda x: (x**3, 3 * x**2)),
    "NumpyExp_": (NumpyExp.apply, jnp.exp),
    "NumpySort": (lambda x: NumpySort.apply(x, 1)[0], lambda x: jnp.sort(x, axis=1)),
    "NumpyTake": (
        lambda x: NumpyTake.apply(x, jnp.asarray(_SORTED), jnp.argsort(_SORTED, axis=1), 1),
        lambda x: jnp.take_along_axis(x, _SORTED, axis=1),
    ),
}
FORWARD = {
    "jvp": lambda f: lambda x: jax.jvp(f, (x,), (jnp.cos(x),))[1],
    "jit(jacfwd)": lambda f: jax.jit(jax.jacfwd(f)),
    "vmap(jvp)": lambda f: (
        lambda x: jax.vmap(lambda t: jax.jvp(f, (x,), (t,))[1])(jnp.stack([x, jnp.sin(x)]))
    ),
}


@pytest.mark.parametrize("transform", tiered(list(FORWARD), default=["jvp"]))
@pytest.mark.parametrize("name", DB, ids=str)
def test_autograd_function_db_ports_without_jvp_give_forward_mode(name, transform, x64):
    port, reference = DB[name]
    x = jnp.asarray(X)
    got = FORWARD[transform](port)(x)
    want = FORWARD[transform](reference)(x)
    assert_trees_close(got, want)


@pytest.mark.exhaustive
def test_db_port_second_order_forward_over_reverse(x64):
    port, reference = DB["NumpyCube"]
    x = jnp.asarray(X[0])
    hessian = jax.hessian(lambda x: jnp.sum(port(x)[0]))
    assert_trees_close(hessian(x), jax.hessian(lambda x: jnp.sum(reference(x)[0]))(x))


# -- a backward JAX cannot transpose: row by row ----------------------------------------------

A = np.array([[4.0, 1.0, 0.0], [1.0, 3.0, 0.5], [0.0, 0.5, 2.0]])


def _jacobi(b, tol=1e-14):
    """A^-1 b by Jacobi iterations to convergence: a while_loop, as an iterative solver."""
    d = jnp.diag(A)

    def body(carry):
        x, _ = carry
        new = (b - (A @ x - d * x)) / d
        return new, jnp.max(jnp.abs(new - x))

    return jax.lax.while_loop(lambda c: c[1] > tol, body, (jnp.zeros_like(b), jnp.inf))[0]


def _host_cos_times(x, g):
    shape = jax.ShapeDtypeStruct(g.shape, g.dtype)
    return jax.pure_callback(lambda x, g: np.cos(x) * g, shape, x, g, vmap_method="sequential")


def _ops(limit=4096):
    """The three kinds of backward JAX cannot transpose, each with its float64 reference."""
    make = functools.partial(jaxext.custom_vjp, forward_mode_max_outputs=limit)

    solve = make(lambda b: _jacobi(b))  # A symmetric: the backward solves with A too
    solve.defvjp(lambda b: (_jacobi(b), None), lambda _, g: (_jacobi(g),))

    host_sin = make(jnp.sin)
    host_sin.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (_host_cos_times(x, g),))

    return {
        "while_loop": (solve, lambda b: jnp.linalg.solve(A, b)),
        "pure_callback": (host_sin, jnp.sin),
    }


def test_backward_with_a_while_loop_gives_forward_mode(x64):
    op, reference = _ops()["while_loop"]
    x, t, eps = jnp.array([1.0, 2.0, 3.0]), jnp.array([0.5, -1.0, 0.25]), 1e-6
    out, tangent = jax.jvp(op, (x,), (t,))
    assert_trees_close((out, tangent), jax.jvp(reference, (x,), (t,)))
    central = (op(x + eps * t) - op(x - eps * t)) / (2 * eps)
    assert_close(tangent, central, rtol=1e-8, atol=1e-8)


def test_backward_with_a_host_callback_gives_forward_mode(x64):
    op, reference = _ops()["pure_callback"]
    x, t = jnp.array([1.0, 2.0, 3.0]), jnp.array([0.5, -1.0, 0.25])
    assert_trees_close(jax.jvp(op, (x,), (t,)), jax.jvp(reference, (x,), (t,)))
    assert_trees_close(jax.jit(jax.jacfwd(op))(x), jax.jacfwd(reference)(x))


def test_backward_closing_over_traced_integer_indices(x64):
    """Forward mode inside the jit that traced the indices the backward scatters to."""

    def gather(x, ids):
        op = jaxext.custom_vjp(lambda x: x[ids])
        op.defvjp(
            lambda x: (x[ids], None),
            lambda _, g: (jnp.zeros(x.shape, g.dtype).at[ids].add(g),),
        )
        return op(x)

    x, t, ids = jnp.array([1.0, 2.0, 3.0]), jnp.array([0.5, -1.0, 0.25]), np.array([2, 0, 2])
    got = jax.jit(lambda x, t, ids: jax.jvp(lambda x: gather(x, ids), (x,), (t,)))(x, t, ids)
    assert_trees_close(got, (x[ids], t[ids]))
    jacobian = jax.jit(lambda x, ids: jax.jacfwd(lambda x: gather(x, ids))(x))(x, ids)
    assert_trees_close(jacobian, np.eye(3)[ids])


def test_complex_outputs_row_by_row(x64):
    """A complex, non-holomorphic op (c * conj(z) + z**2) through a backward JAX cannot
    transpose (a host copy of the cotangent): real and imaginary parts count apart."""
    c = jnp.asarray([1.0 + 2.0j, -0.5 + 0.25j])

    def reference(z):
        return c * jnp.conj(z) + z**2

    @jaxext.custom_vjp
    def op(z):
        return reference(z)

    def bwd(z, g):
        shape = jax.ShapeDtypeStruct(g.shape, g.dtype)
        copied = jax.pure_callback(np.asarray, shape, g, vmap_method="sequential")
        return jax.vjp(reference, z)[1](copied)

    op.defvjp(lambda z: (reference(z), z), bwd)
    z, t = jnp.asarray([0.3 - 1.0j, 2.0 + 0.5j]), jnp.asarray([1.0 + 1.0j, -0.5 + 2.0j])
    got, want = jax.jvp(op, (z,), (t,)), jax.jvp(reference, (z,), (t,))
    assert_trees_close(jax.tree.map(jnp.real, got), jax.tree.map(jnp.real, want))
    assert_trees_close(jax.tree.map(jnp.imag, got), jax.tree.map(jnp.imag, want))


def test_over_the_limit_the_error_names_both_remedies():
    op, _ = _ops(limit=2)["pure_callback"]
    x = jnp.array([1.0, 2.0, 3.0])
    with pytest.raises(TypeError) as info:
        jax.jvp(op, (x,), (x,))
    message = str(info.value)
    assert "3 backward passes, more than the op's forward_mode_max_outputs=2" in message
    assert "defvjp(fwd, bwd, jvp=jvp)" in message
    assert "differentiate_fwd=True" in message
    jax.grad(lambda x: jnp.sum(op(x)))(x)  # reverse mode is unaffected


def test_unbatchable_backward_runs_one_output_element_at_a_time(x64):
    @jaxext.custom_vjp
    def op(x):
        return jnp.sin(x)

    def bwd(x, g):  # no vmap_method: JAX cannot batch this callback
        shape = jax.ShapeDtypeStruct(g.shape, g.dtype)
        return (jax.pure_callback(lambda x, g: np.cos(x) * g, shape, x, g),)

    op.defvjp(lambda x: (jnp.sin(x), x), bwd)
    x, t = jnp.array([0.5, -1.0]), jnp.array([2.0, 3.0])
    assert_trees_close(jax.jvp(op, (x,), (t,)), jax.jvp(jnp.sin, (x,), (t,)))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-1, "`forward_mode_max_outputs` must be a non-negative int; got -1"),
        (2.0, "`forward_mode_max_outputs` must be a non-negative int; got 2.0"),
        (True, "`forward_mode_max_outputs` must be a non-negative int; got True"),
    ],
)
def test_max_outputs_of_the_wrong_type_is_a_type_error(value, message):
    with pytest.raises(TypeError, match=message):
        jaxext.custom_vjp(jnp.sin, forward_mode_max_outputs=value)


# -- differentiate_fwd=True: forward mode differentiates fwd -----------------------------------


def test_differentiate_fwd_differentiates_the_forward_rule(x64):
    """A straight-through round: reverse mode runs bwd (the identity); with the opt-in,
    forward mode is the derivative of fwd (zero), without it the transpose of bwd."""

    def make(**options):
        @functools.partial(jaxext.custom_vjp, **options)
        def st_round(x):
            return jnp.round(x)

        st_round.defvjp(lambda x: (st_round(x), None), lambda _, g: (g,))
        return st_round

    x, t = jnp.array([0.3, 1.7]), jnp.array([1.0, 2.0])
    opted = make(differentiate_fwd=True)
    assert_trees_close(jax.jvp(opted, (x,), (t,)), (jnp.round(x), jnp.zeros(2)))
    assert_trees_close(jax.jvp(make(), (x,), (t,)), (jnp.round(x), t))
    assert_trees_close(jax.grad(lambda x: jnp.sum(opted(x)))(x), jnp.ones(2))


def test_differentiate_fwd_through_while_loops_in_both_rules(x64):
    """A fixed-point solve with a while_loop in fwd and bwd (an implicit-differentiation
    custom_vjp): forward mode differentiates fwd's loop; jvp equals finite differences."""

    def make(**options):
        @functools.partial(jaxext.custom_vjp, **options)
        def root(a):  # x = cos(a x): a fixed point by iteration
            return _fixed_point(a)

        def bwd(res, g):  # implicit: dx/da = -x sin(ax) / (1 + a sin(ax)), through a loop
            a, x = res
            g = jax.lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, c[1]), (0, g))[1]
            s = jnp.sin(a * x)
            return (-g * x * s / (1 + a * s),)

        root.defvjp(lambda a: (root(a), (a, root(a))), bwd)
        return root

    root = make(differentiate_fwd=True, forward_mode_max_outputs=0)
    a, t, eps = jnp.array([0.5, 0.8]), jnp.array([1.0, -1.0]), 1e-6
    central = (_fixed_point(a + eps * t) - _fixed_point(a - eps * t)) / (2 * eps)
    out, tangent = jax.jit(lambda a, t: jax.jvp(root, (a,), (t,)))(a, t)
    assert_close(out, _fixed_point(a), rtol=1e-12, atol=1e-12)
    assert_close(tangent, central, rtol=1e-6, atol=1e-8)
    grad = jax.grad(lambda a: jnp.sum(root(a) * t))(a)  # reverse mode: the implicit bwd
    assert_close(grad, central, rtol=1e-6, atol=1e-8)


def _fixed_point(a):
    def body(c):
        x, _ = c
        new = jnp.cos(a * x)
        return new, jnp.max(jnp.abs(new - x))

    return jax.lax.while_loop(lambda c: c[1] > 1e-15, body, (jnp.zeros_like(a), jnp.inf))[0]


def test_differentiate_fwd_is_checked_by_type():
    with pytest.raises(TypeError, match="`differentiate_fwd` must be a bool; got int"):
        jaxext.custom_vjp(jnp.sin, differentiate_fwd=1)


# -- closures over an enclosing trace's tracers -----------------------------------------------


def _scaled_by(s):
    @jaxext.custom_vjp
    def scaled(x):
        return x * s

    scaled.defvjp(lambda x: (scaled(x), None), lambda _, g: (g * s,))
    return scaled


def test_closure_over_jit_tracer_with_constant_inputs(x64):
    x, t = np.ones(3), np.arange(3.0)
    got = jax.jit(lambda s: jax.jvp(_scaled_by(s), (x,), (t,))[1])(2.0)
    assert_close(got, 2.0 * t, rtol=0, atol=0)
    got = jax.jit(lambda s: jax.jacfwd(_scaled_by(s))(x))(3.0)
    assert_close(got, 3.0 * np.eye(3), rtol=0, atol=0)


def test_function_backward_reading_a_jit_traced_scale(x64):
    def jvp_of_scale(x, s):
        class Scale(jaxext.Function):
            @staticmethod
            def forward(ctx, x):
                return x * s

            @staticmethod
            def backward(ctx, g):
                return g * s

        return jax.jvp(Scale.apply, (x,), (jnp.arange(3.0),))[1]

    assert_close(jax.jit(jvp_of_scale)(jnp.ones(3), 3.0), [0.0, 3.0, 6.0], rtol=0, atol=0)


def test_backward_indexing_with_a_loop_counter(x64):
    def picked(x):
        def body(i, acc):
            pick = jaxext.custom_vjp(lambda x: x[i])
            pick.defvjp(lambda x: (x[i], None), lambda _, g: (jnp.zeros_like(x).at[i].set(g),))
            return acc + jax.jvp(pick, (x,), (jnp.arange(4.0) + 1,))[1]

        return jax.lax.fori_loop(0, 3, body, 0.0)

    assert_close(jax.jit(picked)(jnp.ones(4)), 1.0 + 2.0 + 3.0, rtol=0, atol=0)


# -- vmap: an output the batch does not reach keeps an unbatched tangent ---------------------


def _scale_and_shared(jit_bwd):
    """``(x * c, sin(c))``: under ``vmap`` over ``x`` only, the second output is shared."""

    @jaxext.custom_vjp
    def op(x, c):
        return x * c, jnp.sin(c)

    def bwd(res, g):
        x, c = res
        g_scaled, g_shared = g
        return g_scaled * c, g_scaled * x + g_shared * jnp.cos(c)

    op.defvjp(lambda x, c: (op(x, c), (x, c)), jax.jit(bwd) if jit_bwd else bwd)
    return op


def _shared_reference(x, c):
    return x * c, jnp.sin(c)


@pytest.mark.parametrize("jit_bwd", tiered([True, False], default=[True], ids=str))
def test_vmap_with_an_unbatched_output_then_grad_and_jacfwd(jit_bwd, x64):
    x, c = jnp.arange(6.0).reshape(2, 3), jnp.array([1.0, 2.0, 3.0])

    def loss(f):
        batched = jax.vmap(f, in_axes=(0, None), out_axes=(0, None))
        return lambda x, c: jnp.sum(batched(x, c)[0] ** 2) + jnp.sum(jnp.cos(batched(x, c)[1]))

    op = _scale_and_shared(jit_bwd)
    want = jax.grad(loss(_shared_reference), (0, 1))(x, c)
    assert_trees_close(jax.grad(loss(op), (0, 1))(x, c), want)
    assert_trees_close(jax.jacfwd(loss(op), (0, 1))(x, c), want)
    shared = jax.vmap(op, in_axes=(0, None), out_axes=(0, None))
    shared_reference = jax.vmap(_shared_reference, in_axes=(0, None), out_axes=(0, None))
    assert_trees_close(
        jax.jacfwd(lambda c: shared(x, c))(c),
        jax.jacfwd(lambda c: shared_reference(x, c))(c),
    )
