"""Ops with known checker verdicts, shared by tests/test_opcheck.py and
tests/test_checker_catalogue.py: each op written once, here.

Each builder returns ``(op, args)``, the args float64 NumPy data (``f64``). Correct
ops first (opcheck gives no FAIL), then buggy ones (one realistic bug each).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from helpers import rand

import jaxext


def f64(seed, shape):
    return rand(seed, shape, np.float64)


def positive(seed, shape):
    return 0.5 + np.abs(f64(seed, shape))


# -- custom_vjp variants of linear and elementwise ops, for gradcheck and its engines -------
# (tests/test_gradcheck.py, tests/test_engines.py)


def make_linear(bwd_rule, primal_offset=0.0):
    """A custom_vjp ``x @ w.T`` whose backward is ``bwd_rule(x, w, g)``.

    ``primal_offset`` is added to the primal returned by the forward rule only.
    """

    @jax.custom_vjp
    def op(x, w):
        return jnp.matmul(x, jnp.transpose(w))

    def op_fwd(x, w):
        return op(x, w) + primal_offset, (x, w)

    def op_bwd(residuals, g):
        x, w = residuals
        return bwd_rule(x, w, g)

    op.defvjp(op_fwd, op_bwd)
    return op


def grad_x(x, w, g):
    return jnp.matmul(g, w)


def grad_w(x, w, g):
    return jnp.matmul(jnp.transpose(g), x)


CORRECT = make_linear(lambda x, w, g: (grad_x(x, w, g), grad_w(x, w, g)))


# name -> (backward rule, index of the first wrong input)
BROKEN_BACKWARDS = {
    "scale_1pct": (lambda x, w, g: (grad_x(x, w, g), 1.01 * grad_w(x, w, g)), 1),
    "wrong_sign": (lambda x, w, g: (-grad_x(x, w, g), grad_w(x, w, g)), 0),
    "transposed": (lambda x, w, g: (grad_x(x, w, g), grad_w(x, w, g).T), 1),
    "swapped": (lambda x, w, g: (grad_w(x, w, g), grad_x(x, w, g)), 0),
    "ignores_cotangent": (
        lambda x, w, g: (grad_x(x, w, jnp.ones_like(g)), grad_w(x, w, g)),
        0,
    ),
    "one_element": (
        lambda x, w, g: (grad_x(x, w, g), grad_w(x, w, g).at[0, 0].multiply(1.01)),
        1,
    ),
}


def square_with_wrong_jvp():
    """``x**2`` with a ``custom_jvp`` rule 1% too large: only forward mode sees it."""

    @jax.custom_jvp
    def square(x):
        return x**2

    @square.defjvp
    def square_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return square(x), 2.02 * x * t  # 1% too large

    return square


def elementwise_op(fn, derivative, *, scale=1.0, bump=0.0):
    """A custom_vjp ``fn`` whose backward is ``g * derivative(x)``, times ``scale``,
    with ``bump`` added to the first element of the gradient (wrong unless 1 and 0)."""

    @jax.custom_vjp
    def op(x):
        return fn(x)

    def op_fwd(x):
        return fn(x), x

    def op_bwd(x, g):
        grad = scale * g * derivative(x)
        return (grad.reshape(-1).at[0].add(bump).reshape(grad.shape),)

    op.defvjp(op_fwd, op_bwd)
    return op


# -- correct ops ---------------------------------------------------------------------------


def perm_index():
    """fwd indexes with ``x[perm]``; the backward scatters back (a jaxext.custom_vjp)."""
    perm = np.array([2, 0, 3, 1])

    @jaxext.custom_vjp
    def op(x):
        return x[perm] * 2.0

    op.defvjp(
        lambda x: (op(x), None),
        lambda _, g: (jnp.zeros_like(g).at[perm].set(2.0 * g, unique_indices=True),),
    )
    return op, (f64(0, (4, 2)),)


def embedding():
    """``table[ids]`` with integer ids (repeated), gradient scattered with ``.at[].add``."""

    @jaxext.custom_vjp
    def op(table, ids):
        return table[ids]

    def bwd(res, g):
        zeros, ids = res
        return zeros.at[ids].add(g), None

    op.defvjp(lambda table, ids: (op(table, ids), (jnp.zeros_like(table), ids)), bwd)
    return op, (f64(0, (3, 2)), np.array([1, 0, 1, 2]))


def at_set_add():
    """``.at[].set`` / ``.at[].add``: the op needs JAX arrays, whatever the caller passes."""
    return (lambda x: x.at[0].set(x[1] * 2.0).at[1:].add(x[0] ** 2)), (f64(0, (3,)),)


def mixed_precision():
    """float32 output for a bfloat16 input (float64 for float64)."""

    def op(x):
        return jnp.tanh(x.astype(jnp.promote_types(x.dtype, jnp.float32)))

    return op, (f64(0, (2, 3)),)


def sin_large_phases():
    """Phases in [100, 200]: rounding them to bfloat16 alone moves sin a lot."""
    return jnp.sin, (np.random.default_rng(0).uniform(100.0, 200.0, (2, 3)),)


def normalize_tiny():
    """Vectors of norm ~2e-5: the finite-difference step must follow the scale."""
    return (lambda x: x / jnp.linalg.norm(x)), (2e-5 * f64(0, (4,)),)


def linalg_solve():
    """No bfloat16 kernel on CPU: low_precision SKIPs with the reason."""
    return jnp.linalg.solve, (f64(0, (2, 2)) + 3 * np.eye(2), f64(1, (2,)))


@jax.custom_vjp
def fixed_point_sqrt(a):
    """sqrt(a) as the fixed point of z = (z + a / z) / 2, with JAX's documented
    fixed-point backward, which reverse mode cannot differentiate again."""
    return jnp.sqrt(a)


def _fixed_point_sqrt_bwd(res, g):
    """The adjoint of z = (z + a / z) / 2 solved by a while_loop (dynamic trip count)."""
    a, z = res
    dfdz, dfda = 0.5 - 0.5 * a / z**2, 0.5 / z

    def body(state):
        u, _, k = state
        return g + u * dfdz, u, k + 1

    def not_converged(state):
        u, previous, k = state
        return (k < 60) & jnp.any(jnp.abs(u - previous) > 1e-15 * jnp.abs(u))

    u, _, _ = jax.lax.while_loop(not_converged, body, body((g, g + 1.0, 0)))
    return (u * dfda,)


fixed_point_sqrt.defvjp(lambda a: (jnp.sqrt(a), (a, jnp.sqrt(a))), _fixed_point_sqrt_bwd)


def fixed_point_backward():
    return fixed_point_sqrt, (positive(0, (3,)),)


def linear_empty_batch():
    return jaxext.linear, (np.zeros((0, 3)), f64(1, (2, 3)), f64(2, (2,)))


def plain_custom_jvp():
    @jax.custom_jvp
    def softplus(x):
        return jnp.logaddexp(x, 0.0)

    softplus.defjvp(lambda p, t: (softplus(p[0]), jax.nn.sigmoid(p[0]) * t[0]))
    return softplus, (f64(0, (3, 2)),)


def _matmul_and_sin(bwd):
    """``(x @ w.T, sin(x))``: a plain jax.custom_vjp with symbolic_zeros=True and ``bwd``."""

    @jax.custom_vjp
    def op(x, w):
        return x @ w.T, jnp.sin(x)

    def fwd(x, w):
        return op(x.value, w.value), (x.value, w.value)

    op.defvjp(fwd, bwd, symbolic_zeros=True)
    return op, (f64(0, (3, 2)), f64(1, (2, 2)))


def symbolic_zeros_two_outputs():
    """symbolic_zeros=True, two outputs, unused outputs' zeros handled (skipped)."""

    def bwd(res, g):
        x, w = res
        g_y, g_s = g
        zero = jax.custom_derivatives.SymbolicZero
        grad_x = jnp.zeros_like(x)
        grad_w = jnp.zeros_like(w)
        if not isinstance(g_y, zero):
            grad_x, grad_w = grad_x + g_y @ w, grad_w + g_y.T @ x
        if not isinstance(g_s, zero):
            grad_x = grad_x + g_s * jnp.cos(x)
        return grad_x, grad_w

    return _matmul_and_sin(bwd)


# -- buggy ops -----------------------------------------------------------------------------


def abs_cotangent():
    """bwd uses |g|: right for every one-hot +1 cotangent, not linear in g."""

    @jax.custom_vjp
    def op(x):
        return jnp.sin(x)

    op.defvjp(lambda x: (op(x), x), lambda x, g: (jnp.abs(g) * jnp.cos(x),))
    return op, (f64(0, (3, 2)),)


def float32_grad_for_bfloat16():
    """Computes the gradient in at least float32 and forgets to cast back: right for
    float64 and float32 inputs, a float32 gradient for a bfloat16 one."""

    @jax.custom_vjp
    def op(x):
        return x * x

    def bwd(x, g):
        wide = jnp.promote_types(x.dtype, jnp.float32)
        return (2 * x.astype(wide) * g.astype(wide),)

    op.defvjp(lambda x: (op(x), x), bwd)
    return op, (f64(0, (3, 2)),)


def symbolic_zero_as_ones():
    """Two outputs; bwd reads an unused output's symbolic-zero cotangent as ones."""

    def bwd(res, g):
        x, w = res
        g_y, g_s = (
            jnp.ones(t.shape, t.dtype) if isinstance(t, jax.custom_derivatives.SymbolicZero) else t
            for t in g
        )
        return g_y @ w + g_s * jnp.cos(x), g_y.T @ x

    return _matmul_and_sin(bwd)


def l2_penalty_off_by_2x():
    """lambda = 1e-6: every gradient entry is below atol, and 2x off."""

    @jax.custom_vjp
    def op(w):
        return 1e-6 * jnp.sum(w**2)

    op.defvjp(lambda w: (op(w), w), lambda w, g: (4e-6 * g * w,))
    return op, (f64(0, (3, 2)),)


def float32_grad_always():
    """float32 gradient for every input dtype (float64 included)."""

    @jax.custom_vjp
    def op(x):
        return jnp.sin(x)

    op.defvjp(lambda x: (op(x), x), lambda x, g: ((g * jnp.cos(x)).astype(jnp.float32),))
    return op, (f64(0, (3,)),)


def fwd_differs_from_primal():
    """fwd adds an epsilon the primal does not (as a stale copy of the kernel would)."""

    @jax.custom_vjp
    def op(x):
        return jnp.sin(x)

    op.defvjp(lambda x: (jnp.sin(x) + 1e-4, x), lambda x, g: (g * jnp.cos(x),))
    return op, (f64(0, (3,)),)


def jvp_rule_wrong_at_second_order():
    """A jvp= rule right at first order, stop_gradient on its residual: forward-mode
    second derivatives (jacrev(jacfwd), jacfwd(jacfwd)) are wrong while every
    reverse-mode derivative (through the correct bwd) is right."""

    @jaxext.custom_vjp
    def op(x):
        return jnp.sin(x)

    op.defvjp(
        lambda x: (op(x), x),
        lambda x, g: (g * jnp.cos(x),),
        jvp=lambda x, tangents: jnp.cos(jax.lax.stop_gradient(x)) * tangents[0],
    )
    return op, (f64(0, (3,)),)


def residuals_by_perturbed_reused():
    """Plain jax.custom_vjp, symbolic_zeros=True, residuals chosen by ``.perturbed``
    (None for an input not differentiated): jitted once and used as
    ``op(a, c) + op(c, b) + op(a, b) ** 2`` the gradient is wrong (JAX reuses one
    residual layout)."""

    @jax.custom_vjp
    def op(x, w):
        return x * w

    def fwd(x, w):
        saved = (w.value if x.perturbed else None, x.value if w.perturbed else None)
        return x.value * w.value, saved

    def bwd(saved, g):
        w, x = saved
        return (None if w is None else g * w, None if x is None else g * x)

    op.defvjp(fwd, bwd, symbolic_zeros=True)
    return op, (f64(0, (3, 2)), f64(1, (3, 2)))


def residual_layout_cached():
    """fwd saves residuals by which inputs are differentiated, but bwd reads the layout
    from a cache keyed by shape and filled by the first trace (like a kernel cache):
    a stale layout as soon as the jitted op is differentiated w.r.t. another subset."""
    layouts = {}

    @jax.custom_vjp
    def op(x, w):
        return x * jnp.sin(w)

    def fwd(x, w):
        layouts.setdefault(x.value.shape, (x.perturbed, w.perturbed))  # first trace wins
        saved = [jnp.sin(w.value)] if x.perturbed else []
        saved += [x.value * jnp.cos(w.value)] if w.perturbed else []
        return op(x.value, w.value), saved

    def bwd(saved, g):
        want_x, want_w = layouts[g.shape]
        saved = list(saved)
        grad_x = g * saved.pop(0) if want_x else None
        grad_w = g * saved.pop(0) if want_w else None
        return grad_x, grad_w

    op.defvjp(fwd, bwd, symbolic_zeros=True)
    return op, (f64(0, (3, 2)), f64(1, (3, 2)))


# -- issue #43: one verdict per cause ----------------------------------------------------


@jax.custom_vjp
def newton_sqrt(a):
    """sqrt(a) by Newton's iteration in a while_loop, as the JAX docs' ``fixed_point``: a
    plain jax.custom_vjp whose ``fwd`` calls the op itself."""

    def not_converged(state):
        z, previous, k = state
        return (k < 60) & jnp.any(jnp.abs(z - previous) > 1e-15 * jnp.abs(z))

    def step(state):
        z, _, k = state
        return 0.5 * (z + a / z), z, k + 1

    z, _, _ = jax.lax.while_loop(not_converged, step, (a, a + 1.0, 0))
    return z


def _newton_sqrt_fwd(a):
    z = newton_sqrt(a)
    return z, (a, z)


newton_sqrt.defvjp(_newton_sqrt_fwd, lambda res, g: (0.5 * g / res[1],))


def newton_sqrt_fwd_calls_op():
    """No forward mode anywhere: the JVP of its VJP needs the op's forward mode too."""
    return newton_sqrt, (positive(0, (3,)),)


def _multiply_kernel(a_ref, b_ref, out_ref):
    out_ref[...] = a_ref[...] * b_ref[...]


def _kernel_multiply(a, b):
    """``a * b`` as a Pallas kernel: interpret mode on the CPU, the platform's kernel
    (Triton, Mosaic) elsewhere, picked per platform when lowered (as ``jaxext.rms_norm``
    does), so that every platform row lowers a kernel for its platform."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas import triton as pltriton

    def call(**options):
        shape = jax.ShapeDtypeStruct(a.shape, a.dtype)
        return pl.pallas_call(_multiply_kernel, out_shape=shape, **options)(a, b)

    return jax.lax.platform_dependent(
        cpu=lambda: call(interpret=True),
        cuda=lambda: call(compiler_params=pltriton.CompilerParams()),
        rocm=lambda: call(compiler_params=pltriton.CompilerParams()),
        tpu=lambda: call(compiler_params=pltpu.CompilerParams()),
    )


def mul_kernel_backward():
    """``x * w`` through jaxext.custom_vjp whose backward is a Pallas kernel (interpret
    mode on the CPU, picked per platform): correct, and JAX cannot differentiate the
    kernel again. (Its arrays are 4 x 4: Triton takes blocks of a power of 2 only.)"""

    @jaxext.custom_vjp
    def op(x, w):
        return x * w

    def bwd(res, g):
        x, w = res
        return _kernel_multiply(g, w), _kernel_multiply(g, x)

    op.defvjp(lambda x, w: (x * w, (x, w)), bwd)
    return op, (f64(0, (4, 4)), f64(1, (4, 4)))


def bfloat16_mixed_in():
    """An op that crashes on bfloat16 through its own bug: ``lax.add`` of its input and a
    float32 constant (a dtype it mixes in itself, not one it refuses)."""

    def op(x):
        other = jnp.float32 if x.dtype == jnp.bfloat16 else x.dtype
        return jax.lax.add(x, jnp.full(x.shape, 0.5, other)) * x

    return op, (f64(0, (4,)),)


def float32_accumulator():
    """``sum_i x_i**2`` over rows, accumulated in a float32 loop carry (as JAX's Pallas
    ``mha``): no float64 path; it runs at float32."""

    @jaxext.custom_vjp
    def op(x):
        def body(i, acc):
            return acc + x[i] * x[i]

        return jax.lax.fori_loop(0, x.shape[0], body, jnp.zeros(x.shape[1:], jnp.float32))

    op.defvjp(lambda x: (op(x), x), lambda x, g: ((2 * x * g).astype(x.dtype),))
    return op, (f64(0, (3, 4)),)


# -- a float32 kernel and its plain-JAX reference (issue #43) ----------------------------------


def rms_norm_reference(x, w):
    """RMSNorm in plain JAX: the reference of the float32 kernel below."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w


def rms_norm_float32(bug=None):
    """``(op, args)``: RMSNorm as a kernel computes it, in float32 whatever it is given
    (a ``jaxext.custom_vjp`` with a hand-written backward), and its buggy twins:
    ``"scale_1pct"`` (the weight's gradient 1% too large), ``"missing_term"`` (the input's
    gradient without the normalisation's term), ``"swapped_residuals"`` (the backward
    reads the saved input and normalised input in each other's place)."""

    def rsqrt_of(x32):
        return jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)

    @jaxext.custom_vjp
    def op(x, w):
        x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
        return (x32 * rsqrt_of(x32) * w32).astype(x.dtype)

    def op_fwd(x, w):
        x32 = x.astype(jnp.float32)
        r = rsqrt_of(x32)
        return op(x, w), (x32, x32 * r, w, r)

    def op_bwd(res, g):
        x32, xhat, w, r = res
        if bug == "swapped_residuals":
            x32, xhat = xhat, x32
        gw = g.astype(jnp.float32) * w.astype(jnp.float32)
        term = xhat * jnp.mean(gw * xhat, -1, keepdims=True)
        dx = r * (gw - (0 if bug == "missing_term" else term))
        dw = jnp.sum(g.astype(jnp.float32) * xhat, 0) * (1.01 if bug == "scale_1pct" else 1)
        return dx.astype(g.dtype), dw.astype(w.dtype)

    op.defvjp(op_fwd, op_bwd)
    return op, (f64(0, (3, 8)), 1 + 0.1 * f64(1, (8,)))


RMS_NORM_BUGS = ("scale_1pct", "missing_term", "swapped_residuals")


def torch_rms_norm(torch, bug=None):
    """The same math and the same backward (with ``bug``) as a ``torch.autograd.Function``."""

    class RMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            r = torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6)
            ctx.save_for_backward(x, x * r, w, r)
            return x * r * w

        @staticmethod
        def backward(ctx, g):
            x, xhat, w, r = ctx.saved_tensors
            if bug == "swapped_residuals":
                x, xhat = xhat, x
            gw = g * w
            term = xhat * (gw * xhat).mean(-1, keepdim=True)
            dx = r * (gw - (0 if bug == "missing_term" else term))
            dw = (g * xhat).sum(0) * (1.01 if bug == "scale_1pct" else 1)
            return dx, dw

    return RMSNorm.apply


def loop_carry_float32(bug=0.0):
    """``(op, args)``: ``x @ w`` as a kernel writes it, a float32 accumulator in a loop
    carry (the op has no float64 path: at float64 inputs the carry's types differ), with
    a hand-written backward whose weight gradient is ``1 + bug`` times too large. Its
    arguments are float32."""

    @jaxext.custom_vjp
    def op(x, w):
        def body(i, acc):
            return acc + x[:, i] * w[i]

        return jax.lax.fori_loop(0, x.shape[1], body, jnp.zeros(x.shape[:1], jnp.float32))

    def op_fwd(x, w):
        return op(x, w), (x, w)

    def op_bwd(res, g):
        x, w = res
        dx = g[:, None] * w[None, :]
        dw = (1 + bug) * jnp.sum(g[:, None] * x, 0)
        return dx.astype(x.dtype), dw.astype(w.dtype)

    op.defvjp(op_fwd, op_bwd)
    args = (f64(0, (3, 4)).astype(np.float32), f64(1, (4,)).astype(np.float32))
    return op, args


def loop_carry_reference(x, w):
    return x @ w
