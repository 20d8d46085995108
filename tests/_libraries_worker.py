"""Real libraries' own custom_vjp users, run by ``tests/test_libraries.py`` in a subprocess.

Flax, Equinox, diffrax, optax, jaxopt, optimistix and lineax build their custom
gradients on ``jax.custom_vjp``, and most of them capture it when they are imported
(``from jax import custom_vjp``, a decorator on a module-level function) or when a
rule is attached. So the swap has to come first: with ``MODE`` ``jaxext`` this script
sets ``jax.custom_vjp = jaxext.custom_vjp`` before it imports any of them; with
``MODE`` ``jax`` it leaves JAX alone. The test runs it once each way and compares.

Each check measures what a library's own tests check (written here after reading
them, not copied): gradients through a checkpointed while loop, an ODE solve, an
implicitly differentiated solver, Flax's FP8 amax histories; and, for forward mode,
a JVP next to central finite differences. Everything runs in float64 (x64 on)
except where a library fixes float32 (Flax's FP8 metadata). The script only
measures; a check that raises is recorded with its traceback (``run_checks``), which
is how plain JAX's refusals of forward mode reach the test.

Usage: ``python tests/_libraries_worker.py OUTPUT.json MODE`` (``MODE``: ``jax`` or
``jaxext``).
"""

from __future__ import annotations

import sys

import jax

MODE = sys.argv[2] if len(sys.argv) > 2 else "jax"
if MODE == "jaxext":
    import jaxext

    jax.custom_vjp = jaxext.custom_vjp  # before any library below is imported
elif MODE != "jax":
    raise SystemExit(f"MODE must be 'jax' or 'jaxext'; got {MODE!r}")

jax.config.update("jax_enable_x64", True)

import contextlib  # noqa: E402
import functools  # noqa: E402
import io  # noqa: E402
import typing  # noqa: E402

import diffrax  # noqa: E402
import equinox as eqx  # noqa: E402
import equinox.internal as eqxi  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxopt  # noqa: E402
import lineax as lx  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import optimistix as optx  # noqa: E402
from _worker_util import run_checks  # noqa: E402  (tests/, the script's directory)
from flax import nnx  # noqa: E402
from flax.linen import fp8_ops  # noqa: E402
from jax.experimental.pallas.ops.gpu import attention as pallas_attention  # noqa: E402
from jax.experimental.pallas.ops.gpu import layer_norm as pallas_layer_norm  # noqa: E402
from jax.experimental.pallas.ops.gpu import rms_norm as pallas_rms_norm  # noqa: E402
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox  # noqa: E402

EPS = 1e-6  # central differences in float64: error ~ EPS**2 * f''' + rounding / EPS


def tolist(tree):
    """A pytree of arrays as nested lists of floats (JSON)."""
    return jax.tree.map(lambda a: np.asarray(a, np.float64).tolist(), tree)


def central_difference(f, x, t):
    """``(f(x + EPS t) - f(x - EPS t)) / 2 EPS`` for pytrees ``x`` and ``t`` (``f`` jitted:
    one compilation for both points)."""
    f = jax.jit(f)
    plus = f(jax.tree.map(lambda a, b: a + EPS * b, x, t))
    minus = f(jax.tree.map(lambda a, b: a - EPS * b, x, t))
    return jax.tree.map(lambda p, m: (p - m) / (2 * EPS), plus, minus)


def directional(grad, t):
    """``<grad, t>`` summed over the leaves: a gradient against finite differences."""
    pairs = zip(jax.tree.leaves(grad), jax.tree.leaves(t), strict=True)
    return sum(jnp.vdot(g, d) for g, d in pairs)


def grad_and_fd(loss, x, t):
    """The gradient of a scalar ``loss`` at ``x`` (jitted), and ``<grad, t>`` with its
    central difference (the test checks both: the gradient against plain JAX, the
    directional derivative against finite differences)."""
    grad = jax.jit(jax.grad(loss))(x)
    return {
        "grad": tolist(grad),
        "directional": float(directional(grad, t)),
        "fd": float(central_difference(loss, x, t)),
    }


def jvp_and_fd(f, x, t):
    """``jax.jvp`` of ``f`` at ``x`` along ``t`` (jitted) and the central difference."""
    tangent = jax.jit(lambda x, t: jax.jvp(f, (x,), (t,))[1])(x, t)
    return {"jvp": tolist(tangent), "fd": tolist(central_difference(f, x, t))}


# -- Flax -------------------------------------------------------------------------------


class Scaled(nnx.Module):
    """Two parameters; ``scaled_product``'s custom backward scales one gradient."""

    def __init__(self):
        self.w = nnx.Param(jnp.array([0.5, -1.5, 2.0]))
        self.b = nnx.Param(jnp.array(0.25))


@functools.partial(nnx.custom_vjp, graph_updates=True)
def scaled_product(m: Scaled, x):
    return jnp.sum(jnp.sin(m.w[...] * x)) + m.b[...]


def scaled_product_fwd(m, x):
    return scaled_product(m, x), (m.w[...], x)


def scaled_product_bwd(res, g):
    # Flax's convention (graph_updates=True): the output cotangent comes with the
    # inputs' updates, whose states have the shape of the gradient to return.
    input_updates, out_g = g
    m_updates, _ = input_updates
    w, x = res
    cos = jnp.cos(w * x)
    m_g = jax.tree.map(lambda v: v, m_updates)
    m_g["w"][...] = 2.0 * out_g * cos * x  # twice the true gradient: the rule's own
    m_g["b"][...] = out_g
    return m_g, out_g * cos * w


scaled_product.defvjp(scaled_product_fwd, scaled_product_bwd)


def flax_nnx_custom_vjp():
    """``nnx.custom_vjp`` on a module (the ``w`` gradient doubled by the rule), under
    ``nnx.grad`` and ``nnx.value_and_grad(nnx.jit(...))``."""
    x = jnp.array([0.3, -0.7, 1.1])

    def loss(m, x):
        return scaled_product(m, x) ** 2

    grads = nnx.grad(loss)(Scaled(), x)
    value, jit_grads = nnx.value_and_grad(nnx.jit(loss))(Scaled(), x)
    return {
        "w": tolist(grads["w"][...]),
        "b": float(grads["b"][...]),
        "jit_value": float(value),
        "jit_w": tolist(jit_grads["w"][...]),
        "jit_b": float(jit_grads["b"][...]),
    }


def flax_fp8_meta_history():
    """Flax FP8's scale and amax history in the extended ``fp32_max_grad`` dtype: its
    custom_vjp returns the updated history as that input's gradient; three steps of
    ``grad``, each feeding the last one's history back."""
    fm32 = fp8_ops.fp32_max_grad
    f32 = jnp.float32

    def loss(x, history, scale):
        history = jax.lax.convert_element_type(history, fm32)
        scale = jax.lax.convert_element_type(scale, fm32)
        y = fp8_ops.in_qdq(f32, jnp.float8_e4m3fn, x, scale, history)
        return jnp.sum(y)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    history, scale = jnp.zeros(4, f32), jnp.ones(1, f32)
    xs = [
        jnp.array([[0.5, -3.0], [2.0, 1.0]], f32),
        jnp.array([[7.0, -1.0], [0.1, 0.2]], f32),
        jnp.array([[-0.25, 0.5], [1.5, -2.5]], f32),
    ]
    histories, scales = [], []
    for x in xs:
        _, history, scale = step(x, history, scale)
        histories.append(tolist(history))
        scales.append(tolist(scale))
    return {
        "histories": histories,
        "scales": scales,
        "amaxes": [float(jnp.abs(x).max()) for x in xs],
    }


def flax_fp8_scaled_dot_general():
    """``fp8_ops.fp8_scaled_dot_general`` (three custom_vjps: quantize, the quantized
    product, dequantize) with float32 metadata: the gradients of both operands and the
    updated metadata, returned as the metadata's "gradients", over two steps."""
    f32 = jnp.float32
    lhs = jax.random.normal(jax.random.key(0), (3, 5), f32)
    rhs = jax.random.normal(jax.random.key(1), (5, 4), f32)
    meta = {
        "lhs_scale": jnp.ones(1, f32),
        "rhs_scale": jnp.ones(1, f32),
        "grad_scale": jnp.ones(1, f32),
        "lhs_amax_history": jnp.zeros(4, f32),
        "rhs_amax_history": jnp.zeros(4, f32),
        "grad_amax_history": jnp.zeros(4, f32),
    }

    def loss(lhs, rhs, meta):
        out = fp8_ops.fp8_scaled_dot_general(
            lhs, rhs, (((1,), (0,)), ((), ())), preferred_element_type=f32, **meta
        )
        return jnp.sum(out**2)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    first = step(lhs, rhs, meta)
    second = step(2.0 * lhs, rhs, first[2])  # the metadata overwritten by its "gradient"
    return {"first": tolist(first), "second": tolist(second)}


# -- Equinox ----------------------------------------------------------------------------


@eqx.filter_custom_vjp
def power_sum(vjp_arg, exponent, scale):
    """``scale * sum(x ** exponent)`` with Python-number ``exponent`` and ``scale``."""
    return scale * jnp.sum(vjp_arg**exponent)


@power_sum.def_fwd
def power_sum_fwd(perturbed, vjp_arg, exponent, scale):
    del perturbed
    return power_sum(vjp_arg, exponent, scale), vjp_arg


@power_sum.def_bwd
def power_sum_bwd(residuals, grad_obj, perturbed, vjp_arg, exponent, scale):
    del perturbed, vjp_arg
    return grad_obj * scale * exponent * residuals ** (exponent - 1)


@eqx.filter_custom_vjp
def doubled(vjp_arg):
    """``(2 x, 1.5)``: an array output and a Python-float one."""
    return 2.0 * vjp_arg, 1.5


@doubled.def_fwd
def doubled_fwd(perturbed, vjp_arg):
    del perturbed
    return doubled(vjp_arg), None


@doubled.def_bwd
def doubled_bwd(residuals, grad_obj, perturbed, vjp_arg):
    del residuals, perturbed, vjp_arg
    return 2.0 * grad_obj[0]


def eqx_filter_custom_vjp_python_scalars():
    """``eqx.filter_custom_vjp`` with Python floats: as non-differentiated arguments, and
    as the differentiated input itself (eagerly, ``fwd`` then sees the Python float and
    Equinox treats its outputs as static: JAX gives 0 there, 2 under ``jit``)."""
    x = jnp.array([0.5, 1.5, 2.0])
    return {
        "grad": tolist(jax.grad(lambda x: power_sum(x, 3.0, 0.5))(x)),
        "jit_grad": tolist(jax.jit(jax.grad(lambda x: power_sum(x, 3.0, 0.5)))(x)),
        "expected": tolist(1.5 * x**2),
        "float_input": float(jax.grad(lambda s: doubled(s)[0])(3.0)),
        "float_input_jit": float(jax.jit(jax.grad(lambda s: doubled(s)[0]))(3.0)),
        "array_input": float(jax.grad(lambda s: doubled(s)[0])(jnp.float64(3.0))),
    }


def checkpointed_loop(x):
    """A checkpointed while loop with a data-dependent trip count (until the norm of
    ``y`` passes 4) and a bounded one (``max_steps``): Equinox's own recipe for reverse
    mode through a ``while_loop``, and what diffrax and optimistix build on."""

    def cond(carry):
        step, y = carry
        return jnp.logical_and(step < 12, jnp.sum(y**2) < 16.0)

    def body(carry):
        step, y = carry
        return step + 1, y + 0.3 * jnp.sin(y[::-1]) * y

    _, y = eqxi.while_loop(cond, body, (0, x), max_steps=16, kind="checkpointed", checkpoints=4)
    return y


LOOP_X = np.array([0.6, -0.4, 0.9])
LOOP_T = np.array([0.3, 1.0, -0.5])


def eqx_checkpointed_while_trivial_vjp():
    """Equinox's ``test_while_loop.py::test_trivial_vjp``: ``grad`` (under ``jit``) of the
    second carry of a checkpointed loop that the first, differentiated one never reaches.
    Under ``typing.TESTING`` Equinox prints which values it perturbs and, only when its
    backward runs with a cotangent to resolve, its symbolic zeros: JAX never runs that
    backward (the cotangent of the perturbed output is a symbolic zero)."""

    def cond_fun(carry):
        return True

    def body_fun(carry):
        return carry

    @jax.jit
    @jax.grad
    def run(x):
        _, b = eqxi.while_loop(cond_fun, body_fun, (x, 0.0), max_steps=3, kind="checkpointed")
        return b

    printed = io.StringIO()
    old = getattr(typing, "TESTING", False)
    typing.TESTING = True
    try:
        with contextlib.redirect_stdout(printed):
            value = float(run(1.0))
    finally:
        typing.TESTING = old
    return {"value": value, "printed": printed.getvalue()}


def eqx_checkpointed_while_grad():
    return grad_and_fd(lambda x: jnp.sum(jnp.cos(checkpointed_loop(x))), LOOP_X, LOOP_T)


def eqx_checkpointed_while_jvp():
    return jvp_and_fd(checkpointed_loop, LOOP_X, LOOP_T)


# -- diffrax ----------------------------------------------------------------------------


def vector_field(t, y, args):
    """A damped, driven nonlinear oscillator with parameters ``args``."""
    k, c = args
    position, velocity = y[0], y[1]
    return jnp.stack([velocity, -k * jnp.sin(position) - c * velocity + 0.1 * t])


def ode_solve(y0, args, adjoint=None):
    """The state at ``t = 1`` by 20 fixed Heun steps (a checkpointed loop of them)."""
    solution = diffrax.diffeqsolve(
        diffrax.ODETerm(vector_field),
        diffrax.Heun(),
        t0=0.0,
        t1=1.0,
        dt0=0.05,
        y0=y0,
        args=args,
        adjoint=adjoint if adjoint is not None else diffrax.RecursiveCheckpointAdjoint(),
        max_steps=32,
    )
    return solution.ys[-1]


ODE_Y0 = np.array([0.8, -0.2])
ODE_ARGS = (np.float64(2.0), np.float64(0.3))
ODE_T = (np.array([0.4, 1.0]), (np.float64(-0.7), np.float64(0.5)))


def _ode_loss(adjoint):
    def loss(inputs):
        y0, args = inputs
        y1 = ode_solve(y0, args, adjoint)
        return y1[0] ** 2 + jnp.sin(y1[1])

    return loss


def diffrax_recursive_checkpoint_grad():
    return grad_and_fd(_ode_loss(diffrax.RecursiveCheckpointAdjoint()), (ODE_Y0, ODE_ARGS), ODE_T)


def diffrax_backsolve_grad():
    # The backward solve integrates the adjoint ODE numerically: its gradient matches
    # the discretise-then-optimise one (and finite differences) to the solver's
    # truncation error, not to rounding.
    return grad_and_fd(_ode_loss(diffrax.BacksolveAdjoint()), (ODE_Y0, ODE_ARGS), ODE_T)


def diffrax_recursive_checkpoint_jvp():
    return jvp_and_fd(lambda inputs: ode_solve(*inputs), (ODE_Y0, ODE_ARGS), ODE_T)


def diffrax_grad_of_vmap():
    """``jax.grad(jax.vmap(diffeqsolve))``: a batch of initial states, one ``args``."""
    y0s = np.stack([ODE_Y0, ODE_Y0[::-1]])
    ts = np.stack([ODE_T[0], -ODE_T[0]])

    def loss(inputs):
        y0s, args = inputs
        y1s = jax.vmap(ode_solve, in_axes=(0, None))(y0s, args)
        return jnp.sum(y1s[:, 0] ** 2 + jnp.sin(y1s[:, 1]))

    return grad_and_fd(loss, (y0s, ODE_ARGS), (ts, ODE_T[1]))


def diffrax_backsolve_closure():
    """A ``BacksolveAdjoint`` solve whose vector field closes over the differentiated
    parameter instead of taking it through ``args``: plain JAX refuses (it explains
    the closure); the test accepts the right gradient or an error that says so too."""

    def loss(k):
        def field(t, y, args):
            return -k * y

        term = diffrax.ODETerm(field)
        solution = diffrax.diffeqsolve(
            term, diffrax.Tsit5(), 0.0, 1.0, 0.1, jnp.array([1.0]),
            adjoint=diffrax.BacksolveAdjoint(),
        )  # fmt: skip
        return solution.ys[-1, 0]

    return {"grad": float(jax.grad(loss)(0.7)), "expected": float(-np.exp(-0.7))}


def diffrax_closure_error_class():
    """diffrax's ``test_closure_errors``: ``BacksolveAdjoint`` under ``filter_jit`` of
    ``filter_value_and_grad``, the vector field closing over the differentiated model:
    diffrax documents (and tests) that JAX raises its ``CustomVJPException``."""
    from jax._src.interpreters.ad import CustomVJPException

    mlp = eqx.nn.MLP(1, 1, 4, 1, key=jax.random.key(0))

    @eqx.filter_jit
    @eqx.filter_value_and_grad
    def run(model):
        def field(t, y, args):
            return model(y)

        solution = diffrax.diffeqsolve(
            diffrax.ODETerm(field), diffrax.Euler(), 0.0, 1.0, 0.1, jnp.array([1.0]),
            adjoint=diffrax.BacksolveAdjoint(),
        )  # fmt: skip
        return jnp.sum(solution.ys)

    try:
        run(mlp)
    except CustomVJPException as error:
        return {"raised": type(error).__name__, "message": str(error)}
    return {"raised": None}


# -- optax ------------------------------------------------------------------------------


def optax_scale_gradient():
    """``optax.scale_gradient``: the identity whose backward scales the cotangent, in a
    loss, jitted and vmapped; forward mode too (the transpose of its backward)."""
    x = jnp.array([0.5, -1.0, 2.0])

    def loss(x):
        return jnp.sum(optax.scale_gradient(jnp.sin(x), 0.25) ** 2)

    grad = jax.jit(jax.grad(loss))(x)
    per_example = jax.vmap(jax.grad(lambda x: optax.scale_gradient(x**2, -3.0)))(x)
    return {
        "grad": tolist(grad),
        "expected": tolist(0.25 * 2 * jnp.sin(x) * jnp.cos(x)),
        "per_example": tolist(per_example),
        "per_example_expected": tolist(-3.0 * 2 * x),
    }


def optax_scale_gradient_jvp():
    """Forward mode through ``scale_gradient``: the adjoint of its backward, so the
    tangent is scaled too (plain JAX refuses: a custom_vjp)."""
    x, t = jnp.array([0.5, -1.0, 2.0]), jnp.array([1.0, 2.0, -1.0])
    _, tangent = jax.jvp(lambda x: optax.scale_gradient(x, -3.0), (x,), (t,))
    return {"jvp": tolist(tangent), "expected": tolist(-3.0 * t)}


# -- jaxopt -----------------------------------------------------------------------------

RIDGE_X = np.random.default_rng(0).standard_normal((8, 3))
RIDGE_Y = np.random.default_rng(1).standard_normal(8)


def ridge_objective(w, lam):
    residual = RIDGE_X @ w - RIDGE_Y
    return 0.5 * jnp.sum(residual**2) + 0.5 * lam * jnp.sum(w**2)


def ridge_solution(lam):
    """The closed form, ``(X^T X + lam I)^-1 X^T y``: the independent reference."""
    return jnp.linalg.solve(RIDGE_X.T @ RIDGE_X + lam * jnp.eye(3), RIDGE_X.T @ RIDGE_Y)


def jaxopt_solve(lam):
    """Gradient descent to convergence, differentiated implicitly (jaxopt's default:
    its custom_vjp's backward solves the linear system by conjugate gradients)."""
    solver = jaxopt.GradientDescent(ridge_objective, maxiter=2000, tol=1e-12, stepsize=0.02)
    return solver.run(jnp.zeros(3), lam).params


def jaxopt_implicit_grad():
    lam = np.float64(0.8)
    jacobian = jax.jit(jax.jacrev(jaxopt_solve))(lam)
    return {"jacobian": tolist(jacobian), "expected": tolist(jax.jacfwd(ridge_solution)(lam))}


def jaxopt_implicit_jvp():
    return jvp_and_fd(jaxopt_solve, np.float64(0.8), np.float64(1.0))


def jaxopt_custom_root_grad():
    """``jaxopt.implicit_diff.custom_root`` on a hand-written Newton solver of
    ``x**3 + a x - b = 0``, differentiated in ``(a, b)``."""

    def optimality(x, a, b):
        return x**3 + a * x - b

    @jaxopt.implicit_diff.custom_root(optimality)
    def solve(x0, a, b):
        def newton(_, x):
            return x - optimality(x, a, b) / (3 * x**2 + a)

        return jax.lax.fori_loop(0, 30, newton, x0)

    def root(ab):
        return solve(jnp.array(1.0), ab[0], ab[1])

    ab = np.array([1.5, 2.0])
    return grad_and_fd(root, ab, np.array([0.3, -1.0]))


# -- optimistix -------------------------------------------------------------------------


def optx_root(ab, adjoint):
    """The root of ``y**3 + a y - b`` (one per component) by Newton."""

    def fn(y, args):
        a, b = args
        return y**3 + a * y - b

    solver = optx.Newton(rtol=1e-12, atol=1e-12)
    return optx.root_find(fn, solver, jnp.ones(2), (ab[0], ab[1]), adjoint=adjoint).value


def optx_fixed_point(c, adjoint):
    """The fixed point of ``y = cos(c y) / 2`` (a contraction), by iteration."""
    solver = optx.FixedPointIteration(rtol=1e-13, atol=1e-13)
    return optx.fixed_point(
        lambda y, c: 0.5 * jnp.cos(c * y), solver, jnp.zeros(2), c, adjoint=adjoint, max_steps=400
    ).value


OPTX_AB = (np.array([1.5, 0.5]), np.array([2.0, -1.0]))
OPTX_T = (np.array([0.3, -0.2]), np.array([-1.0, 0.4]))
OPTX_C = np.array([0.7, 1.3])
OPTX_TC = np.array([1.0, -0.5])


def optx_implicit_grad():
    root = grad_and_fd(lambda ab: jnp.sum(optx_root(ab, optx.ImplicitAdjoint())), OPTX_AB, OPTX_T)
    fixed = grad_and_fd(
        lambda c: jnp.sum(optx_fixed_point(c, optx.ImplicitAdjoint()) ** 2), OPTX_C, OPTX_TC
    )
    return {"root": root, "fixed_point": fixed}


def optx_recursive_checkpoint_grad():
    adjoint = optx.RecursiveCheckpointAdjoint()
    return grad_and_fd(lambda ab: jnp.sum(optx_root(ab, adjoint)), OPTX_AB, OPTX_T)


def optx_recursive_checkpoint_jvp():
    return jvp_and_fd(lambda ab: optx_root(ab, optx.RecursiveCheckpointAdjoint()), OPTX_AB, OPTX_T)


# -- lineax -----------------------------------------------------------------------------

LX_A = np.array([[4.0, 1.0, 0.5], [1.0, 3.0, -0.5], [0.5, -0.5, 2.0]])
LX_B = np.array([1.0, -2.0, 0.5])


def lineax_solve_grad():
    """``lx.linear_solve`` (LU, and CG on the positive definite operator), its gradient
    in the matrix and the right-hand side."""

    def loss(inputs, solver, tags=()):
        a, b = inputs
        operator = lx.MatrixLinearOperator(a, tags)
        return jnp.sum(jnp.sin(lx.linear_solve(operator, b, solver).value))

    t = (np.ones((3, 3)) * 0.1 + np.eye(3) * 0.2, np.array([0.5, 0.3, -1.0]))
    cg = lx.CG(rtol=1e-13, atol=1e-13)
    return {
        "lu": grad_and_fd(lambda ab: loss(ab, lx.LU()), (LX_A, LX_B), t),
        "cg": grad_and_fd(lambda ab: loss(ab, cg, lx.positive_semidefinite_tag), (LX_A, LX_B), t),
    }


# -- JAX's own Pallas kernel ops (jax.custom_vjp), in interpret mode on CPU ---------------
# In float32 (the kernels' own dtype; megablox's index arithmetic refuses x64), tiny shapes.


def _pallas_inputs(*shapes):
    keys = jax.random.split(jax.random.key(0), len(shapes))
    return [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes, strict=True)]


def _norm_ops():
    x, w, b = _pallas_inputs((2, 3, 8), (8,), (8,))
    w, b = 1 + 0.1 * w, 0.1 * b
    return {
        "rms_norm": (lambda x, w, b: pallas_rms_norm.rms_norm(x, w, b, interpret=True), x, w, b),
        "layer_norm": (
            lambda x, w, b: pallas_layer_norm.layer_norm(x, w, b, interpret=True),
            x,
            w,
            b,
        ),
    }


_MHA_BLOCKS = pallas_attention.BlockSizes(
    block_q=8, block_k=8, block_q_dkv=8, block_kv_dkv=8, block_q_dq=8, block_kv_dq=8
)


def _mha(q, k, v):
    return pallas_attention.mha(q, k, v, None, block_sizes=_MHA_BLOCKS, interpret=True)


def _pallas_cases():
    """``{name: (f, *args)}``: each op with its differentiable arguments."""
    cases = _norm_ops()
    cases["attention"] = (_mha, *_pallas_inputs(*[(1, 8, 1, 4)] * 3))
    return cases


def _pallas_values_and_grads(name):
    def check():
        with jax.enable_x64(False):
            f, *args = _pallas_cases()[name]
            argnums = tuple(range(len(args)))
            loss = lambda *a: jnp.sum(f(*a) ** 2)  # noqa: E731
            return {
                "value": tolist(f(*args)),
                "grad": tolist(jax.grad(loss, argnums)(*args)),
                "jit_grad": tolist(jax.jit(jax.grad(loss, argnums))(*args)),
            }

    return check


def _pallas_jacobians(name):
    """``jacfwd`` and ``jacrev`` of the op in its first argument (plain JAX refuses
    ``jacfwd``)."""

    def check():
        with jax.enable_x64(False):
            f, x, *rest = _pallas_cases()[name]
            g = lambda x: f(x, *rest)  # noqa: E731
            return {"jacfwd": tolist(jax.jacfwd(g)(x)), "jacrev": tolist(jax.jacrev(g)(x))}

    return check


def pallas_megablox_gmm():
    """``megablox.gmm`` (its backward returns a gradient for ``existing_out``, None here):
    value and gradients; forward mode, which its Pallas backward cannot give within the
    row-by-row limit, recorded as the error it raises."""
    with jax.enable_x64(False):
        lhs, rhs = _pallas_inputs((128, 128), (2, 128, 128))
        sizes = jnp.array([48, 80], jnp.int32)

        def loss(lhs, rhs):
            out = megablox.gmm(lhs, rhs, sizes, jnp.float32, interpret=True)
            return jnp.sum(out**2) / 1e4

        value, grads = jax.value_and_grad(loss, (0, 1))(lhs, rhs)
        result = {"value": float(value), "grad": tolist(grads)}
        try:
            jax.jvp(loss, (lhs, rhs), (lhs, rhs))
            result["jvp_error"] = None
        except TypeError as error:
            result["jvp_error"] = str(error)
        return result


PALLAS_OPS = ("rms_norm", "layer_norm", "attention")

CHECKS = {
    **{f"pallas_{name}": _pallas_values_and_grads(name) for name in PALLAS_OPS},
    **{f"pallas_{name}_jacobians": _pallas_jacobians(name) for name in PALLAS_OPS},
    "pallas_megablox_gmm": pallas_megablox_gmm,
    "flax_nnx_custom_vjp": flax_nnx_custom_vjp,
    "flax_fp8_meta_history": flax_fp8_meta_history,
    "flax_fp8_scaled_dot_general": flax_fp8_scaled_dot_general,
    "eqx_filter_custom_vjp_python_scalars": eqx_filter_custom_vjp_python_scalars,
    "eqx_checkpointed_while_grad": eqx_checkpointed_while_grad,
    "eqx_checkpointed_while_trivial_vjp": eqx_checkpointed_while_trivial_vjp,
    "eqx_checkpointed_while_jvp": eqx_checkpointed_while_jvp,
    "diffrax_recursive_checkpoint_grad": diffrax_recursive_checkpoint_grad,
    "diffrax_backsolve_grad": diffrax_backsolve_grad,
    "diffrax_recursive_checkpoint_jvp": diffrax_recursive_checkpoint_jvp,
    "diffrax_grad_of_vmap": diffrax_grad_of_vmap,
    "diffrax_backsolve_closure": diffrax_backsolve_closure,
    "diffrax_closure_error_class": diffrax_closure_error_class,
    "optax_scale_gradient": optax_scale_gradient,
    "optax_scale_gradient_jvp": optax_scale_gradient_jvp,
    "jaxopt_implicit_grad": jaxopt_implicit_grad,
    "jaxopt_implicit_jvp": jaxopt_implicit_jvp,
    "jaxopt_custom_root_grad": jaxopt_custom_root_grad,
    "optx_implicit_grad": optx_implicit_grad,
    "optx_recursive_checkpoint_grad": optx_recursive_checkpoint_grad,
    "optx_recursive_checkpoint_jvp": optx_recursive_checkpoint_jvp,
    "lineax_solve_grad": lineax_solve_grad,
}


if __name__ == "__main__":
    # What Flax captured at import (`from jax import custom_vjp`): the swap came first.
    swapped = fp8_ops.custom_vjp is not jax.custom_derivatives.custom_vjp
    checks = CHECKS
    if len(sys.argv) > 3:  # a subset, for debugging: python ... OUT MODE NAME...
        checks = {name: CHECKS[name] for name in sys.argv[3:]}
    run_checks({"swapped": lambda: swapped, **checks}, sys.argv[1])
