"""Tests for `jaxext.custom_vjp`: the drop-in for ``jax.custom_vjp`` with forward mode.

References are independent of the code under test: the same examples run with
``jax.custom_vjp`` (JAX's own implementation), plain ``jnp`` autodiff of the
primal math, and hand-computed values. Comparisons are in float64.
"""

from __future__ import annotations

import functools
import re
from collections import namedtuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, grid
from ops_table import OPS, OPS_BY_NAME

import jaxext

# -- the examples of JAX's custom_vjp documentation, with only the decorator switched ----


def _sin_times(custom_vjp):
    @custom_vjp
    def f(x, y):
        return jnp.sin(x) * y

    def f_fwd(x, y):
        return f(x, y), (jnp.cos(x), jnp.sin(x), y)

    def f_bwd(res, g):
        cos_x, sin_x, y = res
        return (cos_x * g * y, sin_x * g)

    f.defvjp(f_fwd, f_bwd)
    return f, lambda x, y: jnp.sin(x) * y


def _clip_gradient(custom_vjp):
    @functools.partial(custom_vjp, nondiff_argnums=(0, 1))
    def clip_gradient(lo, hi, x):
        return x

    def clip_gradient_fwd(lo, hi, x):
        return x, None

    def clip_gradient_bwd(lo, hi, _, g):
        return (jnp.clip(g, lo, hi),)

    clip_gradient.defvjp(clip_gradient_fwd, clip_gradient_bwd)
    return clip_gradient


def _app(custom_vjp):
    @functools.partial(custom_vjp, nondiff_argnums=(0,))
    def app(f, x):
        return f(x)

    def app_fwd(f, x):
        return app(f, x), x

    def app_bwd(f, x, g):
        return (5 * g,)

    app.defvjp(app_fwd, app_bwd)
    return app


Point = namedtuple("Point", ["x", "y"])


def _pytree_op(custom_vjp):
    @custom_vjp
    def f(pt):
        x, y = pt.x, pt.y
        return {"a": x**2, "b": (jnp.sin(x), jnp.cos(y))}

    def f_fwd(pt):
        return f(pt), pt

    def f_bwd(pt, g):
        a_bar, (b0_bar, b1_bar) = g["a"], g["b"]
        x_bar = 2 * pt.x * a_bar + jnp.cos(pt.x) * b0_bar
        y_bar = -jnp.sin(pt.y) * b1_bar
        return (Point(x_bar, y_bar),)

    f.defvjp(f_fwd, f_bwd)
    return f, lambda pt: {"a": pt.x**2, "b": (jnp.sin(pt.x), jnp.cos(pt.y))}


XS = [pytest.param(0.3, id="scalar"), pytest.param(np.linspace(-1.0, 2.0, 5), id="vector")]


@pytest.mark.parametrize("x", XS)
def test_doc_example_matches_jax_custom_vjp_and_gets_forward_mode(x, x64):
    ours, plain = _sin_times(jaxext.custom_vjp)
    theirs, _ = _sin_times(jax.custom_vjp)
    x, y = jnp.asarray(x), jnp.asarray(x) + 1.5
    loss = lambda f: lambda x, y: jnp.sum(f(x, y))  # noqa: E731
    assert_trees_close(jax.grad(loss(ours), (0, 1))(x, y), jax.grad(loss(theirs), (0, 1))(x, y))
    assert_trees_close(jax.jit(jax.grad(loss(ours)))(x, y), jax.grad(loss(theirs))(x, y))
    # Forward mode, which jax.custom_vjp refuses, equals autodiff of the primal math.
    with pytest.raises(TypeError):
        jax.jvp(theirs, (x, y), (jnp.ones_like(x), jnp.ones_like(y)))
    tangents = (jnp.ones_like(x) * 0.7, jnp.ones_like(y) * -1.3)
    assert_trees_close(jax.jvp(ours, (x, y), tangents), jax.jvp(plain, (x, y), tangents))
    assert_trees_close(jax.jacfwd(ours, (0, 1))(x, y), jax.jacfwd(plain, (0, 1))(x, y))
    assert_trees_close(jax.hessian(loss(ours))(x, y), jax.hessian(loss(plain))(x, y))


def test_doc_example_nondiff_argnums_clip_gradient(x64):
    ours, theirs = _clip_gradient(jaxext.custom_vjp), _clip_gradient(jax.custom_vjp)
    x = jnp.linspace(-2.0, 2.0, 7)
    for lo, hi in [(-0.5, 0.5), (0.0, 1.0)]:
        got = jax.grad(lambda x, lo=lo, hi=hi: jnp.sum(3 * x * ours(lo, hi, x)))(x)
        want = jax.grad(lambda x, lo=lo, hi=hi: jnp.sum(3 * x * theirs(lo, hi, x)))(x)
        assert_trees_close(got, want)
    # Clipping is not linear in the cotangent: forward mode cannot be derived from
    # it, and the error says why and how to give a JVP rule.
    with pytest.raises(TypeError, match=r"`clip_gradient`: forward-mode .* jvp=jvp"):
        jax.jvp(lambda x: ours(-0.5, 0.5, x), (x,), (x,))


def _scaled_power(custom_vjp, **nondiff):
    # nondiff_argnames (or the equivalent argnums): `power` is a Python int, `scale` an array.
    @functools.partial(custom_vjp, **nondiff)
    def scaled_power(x, power, scale=1.0):
        return scale * x**power

    def fwd(x, power, scale=1.0):
        return scaled_power(x, power, scale), (x, scale)

    def bwd(power, res, g):
        x, scale = res
        return (g * scale * power * x ** (power - 1), g * x**power)

    scaled_power.defvjp(fwd, bwd)
    return scaled_power


NONDIFF = [
    pytest.param({"nondiff_argnames": ("power",)}, id="argnames"),
    pytest.param({"nondiff_argnames": "power"}, id="argname-string"),
    pytest.param({"nondiff_argnums": (1,), "nondiff_argnames": ("power",)}, id="both"),
]
CALLS = [
    pytest.param(lambda f, x, s: f(x, 3, s), id="positional"),
    pytest.param(lambda f, x, s: f(x, power=3, scale=s), id="keywords"),
]


@pytest.mark.parametrize("nondiff", NONDIFF)
@pytest.mark.parametrize("call", CALLS)
def test_nondiff_argnames_as_jax_custom_vjp(nondiff, call, x64):
    ours = _scaled_power(jaxext.custom_vjp, **nondiff)
    theirs = _scaled_power(jax.custom_vjp, nondiff_argnames=("power",))
    assert ours.nondiff_argnums == (1,)
    x, s = jnp.linspace(0.5, 2.0, 4), jnp.linspace(-1.0, 1.0, 4)

    def loss(f):
        return lambda x, s: jnp.sum(jnp.cos(call(f, x, s)))

    assert_trees_close(jax.grad(loss(ours), (0, 1))(x, s), jax.grad(loss(theirs), (0, 1))(x, s))
    # Forward mode against autodiff of the primal math (jax.custom_vjp has none).
    plain = lambda x, s: jnp.sum(jnp.cos(s * x**3))  # noqa: E731
    tangents = (jnp.full(4, 0.3), jnp.full(4, -0.8))
    assert_trees_close(jax.jvp(loss(ours), (x, s), tangents), jax.jvp(plain, (x, s), tangents))
    assert_trees_close(jax.hessian(loss(ours))(x, s), jax.hessian(plain)(x, s))


def test_nondiff_argnames_must_name_positional_parameters():
    def f(x, power, *, scale=1.0):
        return scale * x**power

    with pytest.raises(ValueError, match=r"`nondiff_argnames` must name .*\(x, power\); got 'pwr'"):
        jaxext.custom_vjp(f, nondiff_argnames=("pwr",))
    with pytest.raises(ValueError, match=r"`nondiff_argnames` .*; got 'scale'"):
        jaxext.custom_vjp(f, nondiff_argnames=("scale",))


def test_doc_example_function_valued_nondiff_argument(x64):
    ours, theirs = _app(jaxext.custom_vjp), _app(jax.custom_vjp)
    x = jnp.arange(3.0)
    got = jax.grad(lambda x: jnp.sum(ours(jnp.sin, x)))(x)
    assert_trees_close(got, jax.grad(lambda x: jnp.sum(theirs(jnp.sin, x)))(x))
    assert_trees_close(got, np.full(3, 5.0))
    # Forward mode follows the (deliberately untrue) backward: its transpose, 5 t.
    assert_trees_close(jax.jvp(lambda x: ours(jnp.sin, x), (x,), (x,))[1], 5 * x)


def test_doc_example_pytrees(x64):
    ours, plain = _pytree_op(jaxext.custom_vjp)
    theirs, _ = _pytree_op(jax.custom_vjp)
    pt = Point(jnp.linspace(0.1, 0.9, 3), jnp.linspace(-1.0, 1.0, 3))

    def loss(f):
        return lambda pt: jnp.sum(jnp.tanh(f(pt)["a"]) + f(pt)["b"][0] * f(pt)["b"][1])

    assert_trees_close(jax.grad(loss(ours))(pt), jax.grad(loss(theirs))(pt))
    tangent = Point(jnp.ones(3), jnp.full(3, 0.5))
    assert_trees_close(jax.jvp(ours, (pt,), (tangent,)), jax.jvp(plain, (pt,), (tangent,)))
    assert_trees_close(jax.hessian(loss(ours))(pt), jax.hessian(loss(plain))(pt))


# -- every transformation, against autodiff of the primal math ------------------------------


def _ops():
    """(name, jaxext op of (x, y), plain reference): bwd is the true derivative.

    The library's ops (tests/ops_table.py) with their first two arrays."""
    sin_times, sin_plain = _sin_times(jaxext.custom_vjp)
    return [("sin_times", sin_times, sin_plain)] + [
        (op.name, lambda x, y, fn=op.fn: fn(x, y), op.reference) for op in OPS
    ]


def _inputs(name):
    rng = np.random.default_rng(0)
    if name == "sin_times":  # its backward does not undo broadcasting
        return jnp.asarray(rng.standard_normal((4, 3))), jnp.asarray(rng.standard_normal((4, 3)))
    x, y = OPS_BY_NAME[name].arrays(rng)[:2]
    return jnp.asarray(x), jnp.asarray(y)


TRANSFORMS = {
    "jvp": lambda f: lambda x, y: jax.jvp(f, (x, y), (jnp.cos(x), jnp.sin(y))),
    "linearize": lambda f: lambda x, y: jax.linearize(f, x, y)[1](jnp.cos(x), jnp.sin(y)),
    "jacfwd": lambda f: jax.jacfwd(f, (0, 1)),
    "jacrev": lambda f: jax.jacrev(f, (0, 1)),
    "hessian": lambda f: jax.hessian(lambda x, y: jnp.sum(jnp.sin(f(x, y))), (0, 1)),
    "jacfwd_jacrev": lambda f: jax.jacfwd(jax.jacrev(lambda x, y: jnp.sum(jnp.sin(f(x, y)))), 1),
    "jacrev_jacfwd": lambda f: jax.jacrev(jax.jacfwd(lambda x, y: jnp.sum(jnp.sin(f(x, y)))), 1),
    "jvp_of_grad": lambda f: (
        lambda x, y: jax.jvp(jax.grad(lambda x: jnp.sum(jnp.sin(f(x, y)))), (x,), (jnp.cos(x),))
    ),
    "grad_of_jvp": lambda f: jax.grad(
        lambda x, y: jnp.sum(jax.jvp(lambda x: jnp.sin(f(x, y)), (x,), (x,))[1]), (0, 1)
    ),
}
WRAPS = {
    "plain": lambda t: t,
    "jit": jax.jit,
    "vmap": lambda t: jax.vmap(t, in_axes=(0, None)),
    "jit_vmap": lambda t: jax.jit(jax.vmap(t, in_axes=(0, None))),
}


def _transformation_cases():
    """Every pair of (op, transform, wrap) values by default, the rest exhaustive; rms_norm's
    Pallas kernels run in the interpreter on CPU (seconds a case), so its cells other than a
    few corners (each transform family once) are in the exhaustive tier too."""
    argnames, params = grid(
        op=["sin_times", *(name for name in OPS_BY_NAME if name != "rms_norm")],
        transform=list(TRANSFORMS),
        wrap=list(WRAPS),
        ids=str,
    )
    rms_default = {("hessian", "jit_vmap"), ("jacfwd", "vmap"), ("grad_of_jvp", "jit")}
    if "rms_norm" in OPS_BY_NAME:
        params += [
            pytest.param(
                "rms_norm",
                transform,
                wrap,
                id=f"rms_norm-{transform}-{wrap}",
                marks=() if (transform, wrap) in rms_default else pytest.mark.exhaustive,
            )
            for transform in TRANSFORMS
            for wrap in WRAPS
        ]
    return argnames, params


@pytest.mark.parametrize(*_transformation_cases())
def test_every_transformation_matches_autodiff(op, transform, wrap, x64):
    _, ours, plain = next(o for o in _ops() if o[0] == op)
    x, y = _inputs(op)
    if wrap.endswith("vmap"):
        x = jnp.stack([x, 2 * x + 0.5])
    got = WRAPS[wrap](TRANSFORMS[transform](ours))(x, y)
    want = WRAPS["vmap" if wrap.endswith("vmap") else "plain"](TRANSFORMS[transform](plain))(x, y)
    assert_trees_close(got, want)


def _shared_output(custom_vjp, **options):
    # Under vmap over x alone, the second output depends on the unbatched w only: it is
    # shared across the batch, and its cotangent must count once in w's gradient.
    @custom_vjp
    def f(x, w):
        return x * w, jnp.sin(w)

    def fwd(x, w):
        return f(x, w), (x, w)

    def bwd(res, g):
        (x, w), (g_xw, g_sin) = res, g
        return g_xw * w, g_xw * x + g_sin * jnp.cos(w)

    f.defvjp(fwd, bwd, **options)
    return f


SHARED_TRANSFORMS = {
    "grad": lambda loss: jax.grad(loss, (0, 1)),
    "jit_grad": lambda loss: jax.jit(jax.grad(loss, (0, 1))),
    "jvp": lambda loss: lambda x, w: jax.jvp(loss, (x, w), (jnp.cos(x), jnp.sin(w))),
    # A Python float tangent for the unbatched input reaches the batching rule unbatched.
    "jvp_float_tangent": lambda loss: lambda x, w: jax.jvp(loss, (x, w), (jnp.cos(x), 0.5)),
    "jacfwd": lambda loss: jax.jacfwd(loss, (0, 1)),
    "hessian": lambda loss: jax.hessian(loss, (0, 1)),
}


# JAX 0.12's jax.custom_vjp raises on a shared output unless defvjp is given
# generic_batching=True; jaxext accepts the option and gets the same (right) answer.
@pytest.mark.parametrize("options", [{}, {"generic_batching": True}], ids=["default", "generic"])
@pytest.mark.parametrize("transform", list(SHARED_TRANSFORMS))
def test_output_shared_across_a_vmap_batch_matches_autodiff(transform, options, x64):
    def loss_of(f):
        def loss(x, w):
            xw, sin_w = jax.vmap(f, in_axes=(0, None))(x, w)
            return jnp.sum(jnp.tanh(xw)) + 3.0 * jnp.sum(sin_w**2)

        return loss

    plain = lambda x, w: (x * w, jnp.sin(w))  # noqa: E731
    x, w = jnp.linspace(-1.0, 2.0, 5), jnp.float64(0.7)
    got = SHARED_TRANSFORMS[transform](loss_of(_shared_output(jaxext.custom_vjp, **options)))(x, w)
    want = SHARED_TRANSFORMS[transform](loss_of(plain))(x, w)
    assert_trees_close(got, want)


def test_reverse_mode_runs_the_hand_written_backward_not_autodiff(x64):
    # A straight-through estimator: the backward is deliberately not the derivative
    # of the forward (which is zero almost everywhere).
    @jaxext.custom_vjp
    def ste_round(x):
        return jnp.round(x)

    ste_round.defvjp(lambda x: (jnp.round(x), None), lambda _, g: (g,))
    x = jnp.linspace(-1.2, 1.7, 6)
    t = jnp.linspace(0.5, 1.5, 6)
    assert_trees_close(jax.grad(lambda x: jnp.sum(3.0 * ste_round(x)))(x), np.full(6, 3.0))
    assert_trees_close(jax.jvp(ste_round, (x,), (t,)), (jnp.round(x), t))
    assert_trees_close(jax.jacfwd(ste_round)(x), np.eye(6))


# -- perturbed inputs and residuals --------------------------------------------------------


def _structure_varying_mul(seen):
    @jaxext.custom_vjp
    def mul(x, c):
        return x * c

    def mul_fwd(x, c):
        seen.append((x.perturbed, c.perturbed))
        res = {"flags": (x.perturbed, c.perturbed)}  # Python bools: static residuals
        if x.perturbed:
            res["c"] = c.value
        if c.perturbed:
            res["x"] = x.value
        return x.value * c.value, res

    def mul_bwd(res, g):
        wants_x, wants_c = res["flags"]
        return (g * res["c"] if wants_x else None, jnp.sum(g * res["x"]) if wants_c else None)

    mul.defvjp(mul_fwd, mul_bwd, symbolic_zeros=True)
    return mul


@pytest.mark.parametrize("order", ["fresh", "primed"])
def test_residuals_depending_on_perturbed_inputs_are_safe_in_a_reused_jit(order, x64):
    seen = []
    helper = jax.jit(_structure_varying_mul(seen))
    sg = jax.lax.stop_gradient

    def loss(mul):
        # One jitted helper, used twice in one differentiated computation with a
        # different input differentiated each time: different residual structures.
        return lambda x, c: jnp.sum(jnp.sin(mul(x, sg(c)) * mul(sg(x), c)))

    x, c = jnp.linspace(0.5, 1.5, 4), jnp.asarray(1.7)
    if order == "primed":
        jax.grad(lambda x: jnp.sum(helper(x, c)))(x)
    got = jax.grad(loss(helper), (0, 1))(x, c)
    assert_trees_close(got, jax.grad(loss(lambda x, c: x * c), (0, 1))(x, c))
    assert {(True, False), (False, True)} <= set(seen)
    # The forward saves only what the wanted gradient needs.
    _, vjp_fn = jax.vjp(lambda x: helper(x, c), x)
    kept = [leaf for leaf in jax.tree_util.tree_leaves(vjp_fn) if np.size(leaf) > 0]
    assert [np.shape(leaf) for leaf in kept] == [()]


def test_symbolic_zero_cotangents_reach_bwd_and_skip_it_when_all_zero(x64):
    calls = []

    @jaxext.custom_vjp
    def two(x):
        return jnp.sin(x), jnp.cos(x)

    def two_fwd(x):
        return two(x.value), x.value

    def two_bwd(x, g):
        calls.append(tuple(type(gi).__name__ for gi in g))
        g_sin, g_cos = g
        grad = jnp.zeros_like(x)
        if not isinstance(g_sin, jax.custom_derivatives.SymbolicZero):
            grad = grad + jnp.cos(x) * g_sin
        if not isinstance(g_cos, jax.custom_derivatives.SymbolicZero):
            grad = grad - jnp.sin(x) * g_cos
        return (grad,)

    two.defvjp(two_fwd, two_bwd, symbolic_zeros=True)
    x = jnp.linspace(0.0, 1.0, 3)
    assert_trees_close(jax.grad(lambda x: jnp.sum(two(x)[0]))(x), jnp.cos(x))
    assert calls[-1][1] == "SymbolicZero"
    calls.clear()
    _, vjp_fn = jax.vjp(two, x)
    assert_trees_close(vjp_fn((jnp.zeros(3), jnp.zeros(3)))[0], np.zeros(3))
    # Only the cos output used: the forward-mode derivative too.
    assert_trees_close(jax.jvp(lambda x: two(x)[1], (x,), (jnp.ones(3),))[1], -jnp.sin(x))


@pytest.mark.parametrize("extra", [0, 2], ids=["exact", "extra_trailing_nones"])
def test_bwd_may_return_none_and_extra_trailing_nones(extra, x64):
    @jaxext.custom_vjp
    def first(x, y, z):
        return 2.0 * x + 0.0 * y + 0.0 * z

    first.defvjp(
        lambda x, y, z: (first(x, y, z), None), lambda _, g: (2.0 * g, None, None) + (None,) * extra
    )
    x = jnp.ones(3)
    grads = jax.grad(lambda *a: jnp.sum(first(*a)), (0, 1, 2))(x, x, x)
    assert_trees_close(grads, (np.full(3, 2.0), np.zeros(3), np.zeros(3)))
    assert_trees_close(jax.jvp(first, (x, x, x), (x, x, x))[1], np.full(3, 2.0))


@pytest.mark.parametrize("argnums", [(0,), (1,), (0, 1, 2)], ids=str)
@pytest.mark.parametrize("mode", ["grad", "jvp"])
def test_bwd_returning_too_few_gradients_is_an_error(argnums, mode):
    """A forgotten gradient is never a silent zero (JAX raises TypeError as well)."""

    @jaxext.custom_vjp
    def first(x, y, z):
        return 2.0 * x + 3.0 * y + 4.0 * z

    first.defvjp(lambda x, y, z: (first(x, y, z), None), lambda _, g: (2.0 * g,))
    x = jnp.ones(3)
    with pytest.raises(
        TypeError,
        match=r"`first`: bwd returned 1 gradient\(s\); expected 3.*"
        r"none for argument 1 \(`y`\), argument 2 \(`z`\)",
    ):
        if mode == "grad":
            jax.grad(lambda *a: jnp.sum(first(*a)), argnums)(x, x, x)
        else:
            jax.jvp(first, (x, x, x), (x, x, x))
    with pytest.raises(TypeError, match="must produce a tuple"):  # JAX's own phrase
        jax.grad(lambda *a: jnp.sum(first(*a)), argnums)(x, x, x)


def test_integer_inputs_and_outputs(x64):
    @jaxext.custom_vjp
    def scale(x, n):
        return x * n, n + 1

    scale.defvjp(lambda x, n: (scale(x, n), n), lambda n, g: (g[0] * n, None))
    x, n = jnp.linspace(0.0, 1.0, 3), jnp.arange(3)
    assert_trees_close(jax.grad(lambda x: jnp.sum(scale(x, n)[0]))(x), np.arange(3.0))
    y, t = jax.jvp(lambda x: scale(x, n), (x,), (jnp.ones(3),))
    assert_trees_close(t[0], np.arange(3.0))
    assert t[1].dtype == jax.dtypes.float0


def test_keyword_arguments_resolve_to_positions(x64):
    @functools.partial(jaxext.custom_vjp, nondiff_argnums=(1,))
    def power(x, n=2):
        return x**n

    power.defvjp(lambda x, n: (x**n, x), lambda n, x, g: (n * x ** (n - 1) * g,))
    x = jnp.asarray(1.5)
    assert_trees_close(jax.grad(lambda x: power(x, n=3))(x), 3 * 1.5**2)
    assert_trees_close(jax.grad(power)(x), 2 * 1.5)


def test_user_jvp_rule_for_a_backward_jax_cannot_transpose(x64):
    def host_mul(a, b):
        return jax.pure_callback(
            lambda a, b: np.asarray(a) * np.asarray(b),
            jax.ShapeDtypeStruct(a.shape, a.dtype),
            a,
            b,
            vmap_method="broadcast_all",
        )

    # Without the row-by-row fallback (forward_mode_max_outputs=0), forward mode refuses it.
    @functools.partial(jaxext.custom_vjp, forward_mode_max_outputs=0)
    def sin(x):
        return jnp.sin(x)

    fwd, bwd = (lambda x: (jnp.sin(x), jnp.cos(x))), (lambda cos_x, g: (host_mul(cos_x, g),))
    sin.defvjp(fwd, bwd)
    x = jnp.linspace(0.0, 2.0, 4)
    assert_trees_close(jax.grad(lambda x: jnp.sum(sin(x)))(x), jnp.cos(x))
    with pytest.raises(TypeError, match=r"`sin`: forward-mode .*transpose.*jvp=jvp"):
        jax.jvp(sin, (x,), (x,))
    sin.defvjp(fwd, bwd, jvp=lambda cos_x, tangents: host_mul(cos_x, tangents[0]))
    assert_trees_close(jax.jvp(sin, (x,), (x,)), (jnp.sin(x), jnp.cos(x) * x))
    assert_trees_close(jax.jit(jax.jacfwd(sin))(x), np.diag(np.cos(np.asarray(x))))
    batched = jax.vmap(lambda t: jax.jvp(sin, (x,), (t,))[1])(jnp.eye(4))
    assert_trees_close(batched, np.diag(np.cos(np.asarray(x))))


def test_checkpoint_and_export(x64):
    sin_times, plain = _sin_times(jaxext.custom_vjp)
    x, y = jnp.linspace(0.1, 1.0, 4), jnp.linspace(1.0, 2.0, 4)

    def loss(f):
        return lambda x, y: jnp.sum(jnp.tanh(f(x, y)) * f(y, x))

    for policy in (None, jax.checkpoint_policies.nothing_saveable):
        got = jax.grad(jax.checkpoint(loss(sin_times), policy=policy), (0, 1))(x, y)
        assert_trees_close(got, jax.grad(loss(plain), (0, 1))(x, y))

    def hvp(f):
        return lambda x, y: jax.jvp(lambda x: jax.grad(loss(f))(x, y), (x,), (y,))

    exported = jax.export.export(jax.jit(hvp(sin_times)))(x, y)
    restored = jax.export.deserialize(exported.serialize())
    assert_trees_close(restored.call(x, y), hvp(plain)(x, y))


# -- errors ------------------------------------------------------------------------------------


def _op_with(fwd=None, bwd=None, **defvjp):
    @jaxext.custom_vjp
    def op(x, y):
        return x * y

    default_fwd = lambda x, y: (op(x, y), (x, y))  # noqa: E731
    default_bwd = lambda res, g: (g * res[1], g * res[0])  # noqa: E731
    op.defvjp(fwd or default_fwd, bwd or default_bwd, **defvjp)
    return op


BAD_BACKWARDS = [
    pytest.param(lambda r, g: (g,) * 3, ValueError, r"`op`: bwd returned 3 gradients; expected 2"),
    pytest.param(lambda r, g: g, TypeError, r"`op`: bwd must return a tuple .* got \w+"),
    pytest.param(
        lambda r, g: (jnp.ones(2), None),
        ValueError,
        r"gradient for argument 0 \(`x`\) must have the input's shape \(\); got shape \(2,\)",
    ),
    # (a gradient of another dtype for a float input is accepted, as by jax.custom_vjp:
    # tests/test_dropin_acceptance.py)
    pytest.param(
        lambda r, g: ({"a": g}, None),
        TypeError,
        r"gradient for argument 0 \(`x`\) must be an array or None; got dict",
    ),
    pytest.param(lambda r, g: ("0", None), TypeError, r"must be an array or None; got str"),
]


@pytest.mark.parametrize("bwd, error, match", BAD_BACKWARDS)
@pytest.mark.parametrize("jit", [False, True])
def test_bad_backward_is_a_clear_error_at_trace_time(bwd, error, match, jit, x64):
    op = _op_with(bwd=bwd)
    grad = jax.grad(op)
    with pytest.raises(error, match=match):
        (jax.jit(grad) if jit else grad)(jnp.asarray(1.0), jnp.asarray(2.0))


BAD_FORWARDS = [
    pytest.param(lambda x, y: x * y, r"`op`: fwd must return a pair \(output, residuals\)"),
    pytest.param(
        lambda x, y: ((x * y).astype(jnp.float32), None),
        r"`op`: fwd's output must have the primal's shapes and dtypes float64\[\]; got float32",
    ),
    pytest.param(lambda x, y: ((x, y), None), r"`op`: fwd's output must have the primal's struc"),
]


@pytest.mark.parametrize("fwd, match", BAD_FORWARDS)
def test_bad_forward_is_a_clear_error(fwd, match, x64):
    op = _op_with(fwd=fwd)
    with pytest.raises(TypeError, match=match):
        jax.grad(op)(jnp.asarray(1.0), jnp.asarray(2.0))


def test_wrong_gradient_structure_is_a_clear_error(x64):
    @jaxext.custom_vjp
    def norm2(pt):
        return pt.x**2 + pt.y**2

    norm2.defvjp(lambda pt: (norm2(pt), pt), lambda pt, g: ((2 * pt.x * g, 2 * pt.y * g),))
    pt = Point(jnp.asarray(1.0), jnp.asarray(2.0))
    with pytest.raises(TypeError, match=r"`norm2`: bwd's gradient for argument 0 \(`pt`\) must "):
        jax.grad(norm2)(pt)


def test_definition_errors():
    @jaxext.custom_vjp
    def undefined(x):
        return x

    with pytest.raises(AttributeError, match=r"No VJP defined for custom_vjp function undefined"):
        undefined(1.0)
    with pytest.raises(TypeError, match=r"`fun` must be callable; got int"):
        jaxext.custom_vjp(3)
    with pytest.raises(TypeError, match=r"`nondiff_argnums` must hold non-negative ints"):
        jaxext.custom_vjp(lambda x: x, nondiff_argnums=("0",))
    with pytest.raises(TypeError, match=r"`bwd` must be callable; got NoneType"):
        undefined.defvjp(lambda x: (x, None), None)
    with pytest.raises(TypeError, match=r"`jvp` must be callable or None"):
        undefined.defvjp(lambda x: (x, None), lambda r, g: (g,), jvp=1)

    @functools.partial(jaxext.custom_vjp, nondiff_argnums=(2,))
    def short(x, y):
        return x * y

    short.defvjp(lambda x, y: (x * y, None), lambda r, g: (g, g))
    with pytest.raises(TypeError, match=r"nondiff_argnums=\(2,\) names argument 2"):
        short(1.0, 2.0)


# -- the drop-in promise: behaviours jax.custom_vjp has, with only the import switched ---------
# Each test runs the same code with jax.custom_vjp as the reference where JAX accepts it.

DECORATORS = {"jax": jax.custom_vjp, "jaxext": jaxext.custom_vjp}


@pytest.mark.parametrize("impl", DECORATORS)
def test_python_control_flow_on_values_under_eager_grad(impl):
    @DECORATORS[impl]
    def f(x):
        if x > 0:  # concrete under eager grad: JAX never traces the primal there
            return jnp.sin(x)
        return jnp.cos(x)

    def f_fwd(x):
        return f(x), x

    def f_bwd(x, g):
        return (g * (jnp.cos(x) if x > 0 else -jnp.sin(x)),)

    f.defvjp(f_fwd, f_bwd)
    for x in (1.0, -1.0):
        want = np.cos(x) if x > 0 else -np.sin(x)
        np.testing.assert_allclose(jax.grad(f)(x), want, rtol=1e-6)


@pytest.mark.parametrize("impl", DECORATORS)
def test_traced_value_through_nondiff_argnums_is_a_clear_error(impl):
    @functools.partial(DECORATORS[impl], nondiff_argnums=(0,))
    def scale(c, x):
        return c * x

    scale.defvjp(lambda c, x: (scale(c, x), None), lambda c, _, g: (c * g,))
    with pytest.raises(jax.errors.UnexpectedTracerError, match="custom_vjp"):
        jax.grad(jax.jit(lambda c, x: scale(c, x)), 1)(2.0, 3.0)
    assert float(jax.grad(lambda x: scale(2.0, x))(3.0)) == 2.0  # a Python value is fine


@pytest.mark.parametrize("impl", DECORATORS)
def test_bwd_gradient_may_be_a_prefix_of_a_pytree_argument(impl):
    @DECORATORS[impl]
    def total(tree):
        return tree["a"] * 2.0 + tree["b"]["c"] * 2.0

    total.defvjp(lambda t: (total(t), None), lambda _, g: (2.0 * g,))  # one array, two leaves
    tree = {"a": jnp.arange(3.0), "b": {"c": jnp.ones(3)}}
    got = jax.grad(lambda t: jnp.sum(total(t)))(tree)
    assert_trees_close(got, {"a": np.full(3, 2.0), "b": {"c": np.full(3, 2.0)}})


@pytest.mark.parametrize("impl", DECORATORS)
def test_symbolic_zero_of_the_wrong_shape_is_an_error(impl):
    @DECORATORS[impl]
    def ident(x, y, z):
        return x, y, z

    def fwd(x, y, z):
        return ident(x.value, y.value, z.value), None

    def bwd(_, gs):
        x_bar, y_bar, z_bar = gs
        return y_bar, x_bar, z_bar  # swapped: SymbolicZeros of the wrong shapes

    ident.defvjp(fwd, bwd, symbolic_zeros=True)
    with pytest.raises(ValueError, match="returning a None here"):
        jax.grad(lambda x, y, z: ident(x, y, z)[2].sum(), 2)(jnp.ones(1), jnp.ones(2), jnp.ones(3))


@pytest.mark.parametrize("impl", DECORATORS)
def test_disable_bwd_checks_is_honoured(impl):
    @DECORATORS[impl]
    def first(x, y):
        return x

    first.defvjp(lambda x, y: (x, None), lambda _, g: (jnp.zeros(3), jnp.zeros(3)))
    args = (jnp.ones(3), jnp.ones(4))
    jax.config.update("jax_disable_bwd_checks", True)
    try:
        jax.grad(lambda x, y: first(x, y).sum(), 1)(*args)  # y's gradient has a wrong shape
    finally:
        jax.config.update("jax_disable_bwd_checks", False)
    with pytest.raises(ValueError):
        jax.grad(lambda x, y: first(x, y).sum(), 1)(*args)


@pytest.mark.parametrize("impl", DECORATORS)
def test_def_methods_are_forwarded_to_the_wrapped_function(impl, x64):
    @jax.custom_batching.custom_vmap
    def sin(x):
        return jnp.sin(x)

    wrapped = DECORATORS[impl](sin)

    @wrapped.def_vmap  # the wrapped custom_vmap's rule
    def _rule(axis_size, in_batched, xs):
        return jnp.sin(xs) + 1.0, in_batched[0]  # recognisably the rule's result

    wrapped.defvjp(lambda x: (wrapped(x), jnp.cos(x)), lambda cos_x, g: (g * cos_x,))
    np.testing.assert_allclose(jax.vmap(sin)(jnp.arange(3.0)), np.sin(np.arange(3.0)) + 1.0)
    xs = jnp.arange(3.0)
    np.testing.assert_allclose(jax.vmap(wrapped)(xs), np.sin(np.arange(3.0)) + 1.0)
    np.testing.assert_allclose(jax.grad(wrapped)(0.5), np.cos(0.5))


# (JAX 0.12's defvjp_with_logs, defvjp_with_accums, defremat_with_logs: present exactly where
# the installed jax.custom_vjp has them, tests/test_bwd_variants.py)


@pytest.mark.parametrize("impl", DECORATORS)
def test_keyword_only_parameter_with_a_default(impl):
    @DECORATORS[impl]
    def scaled(x, *, scale=2.0):
        return x * scale

    scaled.defvjp(lambda x, *, scale=2.0: (scaled(x), None), lambda _, g: (g * 2.0,))
    x = jnp.arange(3.0)
    np.testing.assert_allclose(scaled(x), 2.0 * np.arange(3.0))
    np.testing.assert_allclose(jax.grad(lambda x: scaled(x).sum())(x), np.full(3, 2.0))
    with pytest.raises(TypeError, match="could not be resolved to positions"):
        scaled(x, scale=3.0)


def test_jaxpr_names_the_op():
    @jaxext.custom_vjp
    def my_op(x):
        return jnp.sin(x)

    my_op.defvjp(lambda x: (my_op(x), jnp.cos(x)), lambda c, g: (g * c,))
    text = str(jax.make_jaxpr(my_op)(1.0))
    assert "name=my_op" in text, text
    assert "name=primal" not in text


def test_rule_errors_carry_public_names():
    @jaxext.custom_vjp
    def bad(x):
        return x

    bad.defvjp(lambda x: (x, None), lambda _, g: (g[:1],))
    with pytest.raises(jaxext.RuleValueError) as info:
        jax.grad(lambda x: bad(x).sum())(jnp.ones(3))
    assert isinstance(info.value, ValueError)
    assert f"{type(info.value).__module__}.{type(info.value).__qualname__}" == (
        "jaxext.RuleValueError"
    )
    assert jaxext.RuleValueError.__name__ == "RuleValueError"
    assert issubclass(jaxext.RuleTypeError, TypeError)


# -- forward mode needs a backward linear in its cotangent ----------------------------
# Forward mode transposes bwd. jax.linear_transpose silently drops a term that does not
# depend on the cotangent, so each non-linear form below must be refused, naming the op
# and the argument whose gradient is not linear; a linear bwd (however it is written)
# must give the JVP of the primal.


def _two_input_op(bwd_x, bwd_y):
    """``x**3 * y``, with the given formulas for the gradients of x and y."""

    @jaxext.custom_vjp
    def cube_times(x, y):
        return x**3 * y

    cube_times.defvjp(
        lambda x, y: (x**3 * y, (x, y)),
        lambda res, g: (bwd_x(*res, g), bwd_y(*res, g)),
    )
    return cube_times


def _right_y(x, y, g):
    return g * x**3


NONLINEAR_BACKWARDS = {  # gradient of x, in forms seen in user code
    "ignores_cotangent": lambda x, y, g: 3 * x**2 * y,
    "affine": lambda x, y, g: g * 3 * x**2 * y + 6 * x,
    "abs": lambda x, y, g: jnp.abs(g) * 3 * x**2 * y,
    "clip": lambda x, y, g: jnp.clip(g, -1.0, 1.0) * 3 * x**2 * y,
    "square": lambda x, y, g: g * g * 3 * x**2 * y,
    "sign": lambda x, y, g: jnp.sign(g) * 3 * x**2 * y,
    "branch_on_cotangent": lambda x, y, g: jnp.where(g > 0, g, 0.0) * 3 * x**2 * y,
    "divide_by_cotangent": lambda x, y, g: 3 * x**2 * y / g,
    "affine_under_jit": lambda x, y, g: jax.jit(lambda a, b: a + b)(g * 3 * x**2 * y, x),
    # real((g + i) (a + i)) = g a - 1: a constant imaginary part makes it affine.
    "complex_with_constant": lambda x, y, g: jnp.real(
        jax.lax.complex(g, jnp.ones_like(g)) * jax.lax.complex(3 * x**2 * y, jnp.ones_like(x))
    ),
}


@pytest.mark.parametrize("form", list(NONLINEAR_BACKWARDS))
@pytest.mark.parametrize("which", ["x", "y"])
@pytest.mark.parametrize("jit", [False, True])
def test_forward_mode_of_a_nonlinear_bwd_is_an_error(form, which, jit, x64):
    bad = NONLINEAR_BACKWARDS[form]
    if which == "x":
        op = _two_input_op(bad, _right_y)
    else:  # the same defect in the second argument's gradient
        op = _two_input_op(lambda x, y, g: g * 3 * x**2 * y, lambda x, y, g: bad(y, x, g))
    x, y = jnp.array([0.5, -1.5, 2.0]), jnp.array([1.5, 0.25, -2.0])

    def jvp(x, y):
        return jax.jvp(op, (x, y), (jnp.ones(3), jnp.ones(3)))

    with pytest.raises(
        TypeError, match=rf"`cube_times`: forward-mode.*gradient for argument \d \(`{which}`\)"
    ):
        (jax.jit(jvp) if jit else jvp)(x, y)
    with pytest.raises(jaxext.RuleTypeError):
        jax.jacfwd(op, argnums=(0, 1))(x, y)


LINEAR_BACKWARDS = {  # gradient of x, linear in g however written
    "product": lambda x, y, g: g * 3 * x**2 * y,
    "divide_by_residual": lambda x, y, g: g / (1.0 / (3 * x**2 * y)),
    "where_on_residual": lambda x, y, g: jnp.where(x > 0, g * 3 * x**2 * y, 3 * x**2 * y * g),
    "where_with_zero": lambda x, y, g: jnp.where(x > 100.0, 0.0, g * 3 * x**2 * y),
    "sum_of_terms": lambda x, y, g: g * x**2 * y + 2 * (g * x**2 * y) - jnp.zeros_like(g),
    "under_jit": lambda x, y, g: jax.jit(lambda a, b: a * b)(g, 3 * x**2 * y),
    "slices": lambda x, y, g: jnp.concatenate([(g * 3 * x**2 * y)[:1], (3 * x**2 * y * g)[1:]]),
    "matrix": lambda x, y, g: jnp.diag(3 * x**2 * y) @ g,
    # complex(a, b) = a + i b is linear in (a, b) together, both from the cotangent.
    "complex_parts": lambda x, y, g: jnp.real(jax.lax.complex(g, 2 * g) * (3 * x**2 * y)),
    # NumPy constants of zeros are zero terms, not terms independent of g.
    "numpy_zero_padding": lambda x, y, g: jnp.concatenate([g * 3 * x**2 * y, np.zeros(2)])[:3],
    "plus_numpy_zeros": lambda x, y, g: g * 3 * x**2 * y + np.zeros(3),
}


@pytest.mark.parametrize("form", list(LINEAR_BACKWARDS))
def test_forward_mode_of_a_linear_bwd_is_not_rejected(form, x64):
    op = _two_input_op(LINEAR_BACKWARDS[form], _right_y)
    x, y = jnp.array([0.5, -1.5, 2.0]), jnp.array([1.5, 0.25, -2.0])
    tx, ty = jnp.array([0.3, -1.0, 2.0]), jnp.array([1.0, 0.5, -0.25])
    got = jax.jit(lambda *a: jax.jvp(op, a[:2], a[2:]))(x, y, tx, ty)
    want = jax.jvp(lambda x, y: x**3 * y, (x, y), (tx, ty))
    assert_trees_close(got, want)


# -- forward mode where the rules close over traced values ----------------------------
# A scale traced by jit, a scan or while_loop carry, a cond operand: the rules close over
# it, and forward mode must work wherever reverse mode does, with the derivatives
# through the closed-over value too.


def _scaled_sin(scale, with_jvp):
    """``sin(x) * scale`` with rules closing over ``scale``."""

    @jaxext.custom_vjp
    def scaled_sin(x):
        return jnp.sin(x) * scale

    def fwd(x):
        return jnp.sin(x) * scale, jnp.cos(x)

    def bwd(cos_x, g):
        return (g * cos_x * scale,)

    def jvp(cos_x, tangents):
        return tangents[0] * cos_x * scale

    scaled_sin.defvjp(fwd, bwd, jvp=jvp if with_jvp else None)
    return scaled_sin


def _closure_programs(op_of):
    """(name, f(scale, x)) pairs: forward-mode derivatives with a traced closure."""

    def jvp(scale, x):
        return jax.jvp(op_of(scale), (x,), (jnp.cos(x),))[1]

    def hessian_diag(scale, x):
        return jnp.diag(jax.hessian(lambda x: op_of(scale)(x).sum())(x))

    def through_scale(scale, x):  # d/dscale of the jvp: the closed-over value's derivative
        return jax.grad(lambda s: jvp(s, x).sum())(scale)

    def scan(scale, x):
        def body(carry, s):
            return carry + jvp(s * scale, x), None

        return jax.lax.scan(body, jnp.zeros_like(x), jnp.arange(1.0, 3.0))[0]

    def while_loop(scale, x):
        def body(state):
            i, acc = state
            return i + 1, acc + jvp(scale * i, x)

        return jax.lax.while_loop(lambda st: st[0] < 3, body, (0, jnp.zeros_like(x)))[1]

    def cond(scale, x):
        return jax.lax.cond(scale > 0, lambda: jvp(scale, x), lambda: jnp.zeros_like(x))

    return {
        "jvp": jvp,
        "hessian": hessian_diag,
        "through_scale": through_scale,
        "scan": scan,
        "while_loop": while_loop,
        "cond": cond,
    }


@pytest.mark.parametrize("program", list(_closure_programs(None)))
@pytest.mark.parametrize("with_jvp", [False, True], ids=["from_bwd", "jvp_rule"])
def test_forward_mode_with_rules_closing_over_traced_values(program, with_jvp, x64):
    ours = _closure_programs(lambda s: _scaled_sin(s, with_jvp))[program]
    reference = _closure_programs(lambda s: lambda x: jnp.sin(x) * s)[program]
    scale, x = jnp.asarray(1.5), jnp.array([0.5, -1.0, 2.0])
    assert_trees_close(jax.jit(ours)(scale, x), reference(scale, x))


@pytest.mark.parametrize(
    "jvp, error, match",
    [
        (lambda c, t: (t[0] * c)[:2], ValueError, r"jvp's tangent for the output must have the "
         r"output's shape \(3,\); got shape \(2,\)"),
        (lambda c, t: (t[0] * c).astype(jnp.float32), TypeError, r"jvp's tangent for the output "
         r"must have the output's dtype float64; got float32"),
        (lambda c, t: {"t": t[0] * c}, TypeError, r"jvp's tangent for the output must be an "
         r"array or None; got dict"),
    ],
    ids=["shape", "dtype", "structure"],
)  # fmt: skip
def test_wrong_jvp_rule_is_blamed_on_the_jvp_rule(jvp, error, match, x64):
    @jaxext.custom_vjp
    def sine(x):
        return jnp.sin(x)

    sine.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (g * c,), jvp=jvp)
    x = jnp.array([0.5, 1.0, 2.0])
    with pytest.raises(error, match=rf"`sine`: {match}") as info:
        jax.jvp(sine, (x,), (jnp.ones(3),))
    assert "bwd" not in str(info.value)
    # reverse mode does not use the jvp rule
    assert_trees_close(jax.grad(lambda x: sine(x).sum())(x), jnp.cos(x))


# -- JAX's key phrases: code that matched on jax.custom_vjp's errors keeps matching ------


def _rule_error_case(case):
    """(function to call, exception type, JAX's phrase) for one kind of broken rule."""

    def f(x, y):
        return x * y

    def f_fwd(x, y):
        return f(x, y), (x, y)

    bwds = {
        "bwd_not_a_tuple": lambda res, g: g * res[1],
        "bwd_too_many": lambda res, g: (g * res[1], g * res[0], g),
        "bwd_too_few": lambda res, g: (g * res[1],),
        "bwd_wrong_shape": lambda res, g: (g * res[1], jnp.zeros(2)),
    }
    fwds = {"fwd_not_a_pair": lambda x, y: f(x, y)}
    for impl in DECORATORS.values():
        op = impl(f)
        op.defvjp(fwds.get(case, f_fwd), bwds.get(case, lambda res, g: (g * res[1], g * res[0])))
        yield impl, op


_JAX_FWD_PAIR = r"Custom VJP fwd rule <lambda> for function f must produce a pair"
JAX_PHRASES = {
    "bwd_not_a_tuple": (TypeError, r"Custom VJP bwd rule .* must produce a tuple"),
    "bwd_too_many": ((TypeError, ValueError), r"Custom VJP bwd rule .*must produce"),
    "bwd_too_few": (TypeError, r"Custom VJP bwd rule .*must produce"),
    "bwd_wrong_shape": (
        ValueError,
        r"at output\[1\] the bwd rule produced an output of type float32\[2\] corresponding "
        r"to an input of type float32\[3\]",
    ),
    "fwd_not_a_pair": (TypeError, _JAX_FWD_PAIR),
}  # fmt: skip


@pytest.mark.parametrize("case", list(JAX_PHRASES))
def test_errors_keep_jax_key_phrases(case):
    error, phrase = JAX_PHRASES[case]
    x, y = jnp.array([1.0, 2.0, 3.0]), jnp.array([0.5, -1.0, 2.0])
    for _, op in _rule_error_case(case):  # jax.custom_vjp, then jaxext.custom_vjp
        with pytest.raises(error, match=phrase):
            jax.jit(jax.grad(lambda x, y, op=op: op(x, y).sum(), argnums=(0, 1)))(x, y)


@pytest.mark.parametrize("vjp3", [False, True], ids=["classic", "custom_vjp3"])
def test_a_wrong_gradient_shape_keeps_the_installed_jax_sentence(vjp3):
    """JAX's own message for a gradient of the wrong shape, in either of its custom_vjp
    implementations (the ``jax_custom_vjp3`` option), is inside jaxext's, less JAX's
    ``at file:line`` (JAX's own tests match ``the bwd rule attached to foo.*produced``)."""

    def make(custom_vjp):
        @custom_vjp
        def foo(x, y):
            return x

        foo.defvjp(lambda x, y: (x, None), lambda _, g: (jnp.zeros(3), jnp.zeros(3)))
        return foo

    def message(custom_vjp):
        foo = make(custom_vjp)
        with pytest.raises(ValueError) as info:
            jax.grad(lambda x, y: foo(x, y * y).sum(), 1)(jnp.ones(3), jnp.ones(4))
        return str(info.value)

    old = jax.config.jax_custom_vjp3
    jax.config.update("jax_custom_vjp3", vjp3)
    try:
        expected = re.sub(r" at \S+:\d+", "", message(jax.custom_vjp))
        got = message(jaxext.custom_vjp)
    finally:
        jax.config.update("jax_custom_vjp3", old)
    assert "output[1]" in expected and "float32[3]" in expected  # the sentence, not another
    assert f"(JAX: {expected}.)" in got


_JAX_FWD_SENTENCE = (
    "Custom VJP fwd rule scale_fwd for function scale must produce a pair (list or tuple of "
    "length two) where the first element represents the primal output (equal to the output "
    "of the custom_vjp-decorated function scale) and the second element represents "
    "residuals (i.e. values stored from the forward pass for use on the backward pass), but "
    "instead the fwd rule output's first element had "
)
FWD_MISMATCHES = {
    # fwd's primal output, our explanation, the rest of JAX's sentence, then vjp3's wording
    "shape": (
        lambda x: jnp.stack([x, x]),
        "fwd's output must have the primal's shapes and dtypes float32[3]; got float32[2, 3]",
        "shapes/dtypes of:\n    float32[2,3]\nwhile the custom_vjp-decorated function scale "
        "had output shapes/dtypes of:\n    float32[3])",
        "at output, got fwd output type float32[2,3] which doesn't match primal output type "
        "float32[3]",
    ),
    "dtype_in_a_tuple": (
        lambda x: (x, x.astype(jnp.bfloat16)),
        "fwd's output must have the primal's shapes and dtypes float32[3]; got bfloat16[3]",
        "shapes/dtypes of:\n    (float32[3], bfloat16[3])\nwhile the custom_vjp-decorated "
        "function scale had output shapes/dtypes of:\n    (float32[3], float32[3]))",
        "at output[1], got fwd output type bfloat16[3] which doesn't match primal output type "
        "float32[3]",
    ),
    "structure": (
        lambda x: [x, x],
        "fwd's output must have the primal's structure PyTreeDef((*, *)); got PyTreeDef([*, *])",
        "container/pytree structure:\n    [float32[3], float32[3]]\nwhile the "
        "custom_vjp-decorated function scale had output container/pytree structure:\n"
        "    (float32[3], float32[3]).)",
        None,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(FWD_MISMATCHES))
@pytest.mark.parametrize("mode", ["grad", "jvp", "jit_grad"])
def test_fwd_output_mismatch_explains_then_keeps_jax_sentence(case, mode):
    """Our explanation first, then JAX's whole sentence (and its newer wording) verbatim."""
    make_out, ours, jax_rest, vjp3 = FWD_MISMATCHES[case]
    two = case != "shape"

    @jaxext.custom_vjp
    def scale(x):
        return (x * 2.0, x * 3.0) if two else x * 2.0

    def scale_fwd(x):
        return make_out(x), None

    scale.defvjp(scale_fwd, lambda _, g: (jnp.zeros(3),))

    def loss(x):
        return sum(jnp.sum(o) for o in jax.tree.leaves(scale(x)))

    x = jnp.array([1.0, 2.0, 3.0])
    run = {
        "grad": lambda: jax.grad(loss)(x),
        "jvp": lambda: jax.jvp(scale, (x,), (x,)),
        "jit_grad": lambda: jax.jit(jax.grad(loss))(x),
    }[mode]
    with pytest.raises(TypeError) as info:
        run()
    message = str(info.value)
    assert message.startswith(f"`scale`: {ours}. (JAX: {_JAX_FWD_SENTENCE}{jax_rest}")
    if vjp3 is not None:
        assert message.endswith(f" (JAX: {vjp3}.)")


@pytest.mark.parametrize("impl", DECORATORS)
def test_bwd_gradient_pytree_is_not_rebuilt_with_placeholders(impl):
    """A pytree whose unflatten refuses None children, as a bwd gradient: not rebuilt."""

    class Pair(list):
        pass

    def unflatten(_, children):
        assert all(c is not None for c in children)
        return Pair(children)

    jax.tree_util.register_pytree_node(Pair, lambda p: (list(p), None), unflatten)

    @DECORATORS[impl]
    def first(p):
        return p[0] * 2.0

    first.defvjp(lambda p: (p[0] * 2.0, None), lambda _, g: (Pair([2.0 * g, jnp.zeros(())]),))
    grad = jax.grad(first)(Pair([jnp.asarray(1.5), jnp.asarray(3.0)]))
    assert isinstance(grad, Pair) and float(grad[0]) == 2.0 and float(grad[1]) == 0.0


@pytest.mark.parametrize("mode", ["vjp", "grad", "jit_grad"])
@pytest.mark.parametrize("x", [4.0, np.float32(4.0)], ids=["python_float", "float32"])
def test_python_float_gradient_returned_as_jax_returns_it(mode, x):
    """A bwd returning a Python float: a float from eager grad/vjp, a weak array under jit."""
    results = {}
    for impl, decorator in DECORATORS.items():

        @decorator
        def f(x):
            return x * 2.0

        f.defvjp(lambda x: (f(x), None), lambda _, g: (99.0,))
        run = {
            "vjp": lambda f=f: jax.vjp(f, x)[1](7.0)[0],
            "grad": lambda f=f: jax.grad(f)(x),
            "jit_grad": lambda f=f: jax.jit(jax.grad(f))(x),
        }[mode]
        results[impl] = run()
    got, ref = results["jaxext"], results["jax"]
    assert type(got) is type(ref)
    assert type(got) is (float if mode != "jit_grad" else type(jnp.ones(())))
    assert got == 99.0
    if mode == "jit_grad":
        assert got.dtype == ref.dtype == jnp.float32
        assert got.weak_type == ref.weak_type


def test_python_float_gradient_for_a_low_precision_input_takes_its_dtype():
    """Where JAX returns the float32 Python float as is, a bfloat16 input gets a bfloat16 array."""

    @jaxext.custom_vjp
    def f(x):
        return x * 2

    f.defvjp(lambda x: (f(x), None), lambda _, g: (99.0,))
    got = jax.grad(f)(jnp.bfloat16(4.0))
    assert isinstance(got, jax.Array)
    assert got.dtype == jnp.bfloat16
    assert float(got) == 99.0


# -- the options of libraries built on custom_vjp: keyword-only constructor arguments --------


def _host_sin():
    """``sin`` whose ``bwd`` is a host callback, which forward mode cannot transpose."""

    def host(c, g):
        return np.asarray(c * g, dtype=np.asarray(g).dtype)

    def bwd(cos_x, g):
        shape = jax.ShapeDtypeStruct(g.shape, g.dtype)
        return (jax.pure_callback(host, shape, cos_x, g, vmap_method="sequential"),)

    return (lambda x: (jnp.sin(x), jnp.cos(x))), bwd


def test_options_are_keyword_only_and_default_to_plain_custom_vjp():
    plain = jaxext.custom_vjp(jnp.sin)
    assert (plain.forward_mode_hint, plain.no_derivatives_message, plain.hoist_closures) == (
        None,
        None,
        True,
    )
    op = jaxext.custom_vjp(
        jnp.sin, forward_mode_hint="hint", no_derivatives_message="stop", hoist_closures=False
    )
    assert (op.forward_mode_hint, op.no_derivatives_message, op.hoist_closures) == (
        "hint",
        "stop",
        False,
    )
    with pytest.raises(TypeError):
        jaxext.custom_vjp(jnp.sin, (), (), "hint")  # positional: as jax.custom_vjp's signature


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("forward_mode_hint", 3, "`forward_mode_hint` must be a string or None; got int."),
        ("no_derivatives_message", b"x", "`no_derivatives_message` must be a string or None"),
        ("hoist_closures", 1, "`hoist_closures` must be a bool; got int."),
    ],
)
def test_option_of_the_wrong_type_is_a_type_error(option, value, message):
    with pytest.raises(TypeError, match=message):
        jaxext.custom_vjp(jnp.sin, **{option: value})


def test_forward_mode_hint_replaces_the_advice_to_give_a_jvp():
    x = jnp.float32(0.3)
    ops = {}
    for hint in (None, "define a jvp on Sine"):
        ops[hint] = jaxext.custom_vjp(jnp.sin, forward_mode_hint=hint, forward_mode_max_outputs=0)
        ops[hint].defvjp(*_host_sin())
        assert jnp.allclose(jax.grad(ops[hint])(x), jnp.cos(x))  # reverse mode is unaffected
    with pytest.raises(TypeError, match=r"otherwise give a JVP rule: `sin.defvjp\(fwd, bwd, jvp"):
        jax.jvp(ops[None], (x,), (x,))
    with pytest.raises(TypeError, match=r"otherwise define a jvp on Sine\.(\n|$)"):
        jax.jvp(ops["define a jvp on Sine"], (x,), (x,))


def test_no_derivatives_message_guards_the_transpose_of_bwd():
    x, one = jnp.float32(0.3), jnp.float32(1.0)
    op = jaxext.custom_vjp(jnp.sin, no_derivatives_message="stop here")
    op.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))
    assert jnp.allclose(jax.jvp(op, (x,), (one,))[1], jnp.cos(x))  # transposing bwd is fine
    with pytest.raises(RuntimeError, match=r"^stop here(\n|$)"):  # differentiating that is not
        jax.grad(lambda x: jax.jvp(op, (x,), (one,))[1])(x)
