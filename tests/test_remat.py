"""Rematerialization (``jax.checkpoint`` / ``nnx.remat``) and saved residuals.

Gradients under remat are compared with plain ``jnp`` autodiff. What the forward
saves for the backward is read with the public ``jax.ad_checkpoint.
print_saved_residuals`` (and cross-checked with the leaves of the ``jax.vjp``
closure) and compared, as a multiset of ``(dtype, dims)``, with what plain
autodiff of ``x @ w.T + b`` (or ``flax.nnx.Linear``) saves. Dims are compared
sorted because plain autodiff saves ``w.T`` where jaxext saves ``w``.
"""

from __future__ import annotations

import collections
import contextlib
import io
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_close_to_float64,
    in_float64,
    rand,
    reference_linear,
    vjp_kept,
)
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals

import jaxext

POLICIES = {
    "default": None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    "save_only_h": jax.checkpoint_policies.save_only_these_names("h"),
}

_RESIDUAL = re.compile(r"^(\w+)\[([\d,]*)\]")


def saved_residuals(fn, *args):
    """Multiset of ``(dtype, sorted dims)`` that ``print_saved_residuals`` reports."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_saved_residuals(fn, *args)
    found = collections.Counter()
    for line in buf.getvalue().splitlines():
        match = _RESIDUAL.match(line.strip())
        assert match, f"unexpected print_saved_residuals line: {line!r}"
        dims = tuple(sorted(int(d) for d in match.group(2).split(",") if d))
        found[(match.group(1), dims)] += 1
    return found


def vjp_residuals(fn, *args):
    """Multiset of sorted dims of the array leaves of the ``jax.vjp`` closure."""
    return collections.Counter(tuple(sorted(np.shape(leaf))) for leaf in vjp_kept(fn, *args))


def _mlp(linear, name_hidden=False):
    def f(x, w1, b1, w2):
        h = linear(x, w1, b1)
        if name_hidden:
            h = checkpoint_name(h, "h")
        return jnp.sum(jnp.tanh(linear(jnp.sin(h), w2, None)))

    return f


JAXEXT_MLP, PLAIN_MLP = _mlp(jaxext.linear), _mlp(reference_linear)


def _mlp_args(x_shape=(4, 16)):
    return rand(0, x_shape), rand(1, (8, 16)), rand(2, (8,)), rand(3, (3, 8))


def _restrict(fn, args, argnums):
    """``fn`` as a function of ``args[i] for i in argnums`` only (others closed over)."""

    def restricted(*diff_args):
        full = list(args)
        for i, value in zip(argnums, diff_args, strict=True):
            full[i] = value
        return fn(*full)

    return restricted, tuple(args[i] for i in argnums)


@pytest.mark.parametrize("x_shape", [(4, 16), (2, 3, 16)])
def test_linear_saves_what_plain_autodiff_saves(x_shape):
    # Everything differentiated (training): the same residuals as plain autodiff.
    args = _mlp_args(x_shape)
    expected = saved_residuals(PLAIN_MLP, *args)
    assert saved_residuals(JAXEXT_MLP, *args) == expected
    from_vjp = vjp_residuals(JAXEXT_MLP, *args)
    assert from_vjp == vjp_residuals(PLAIN_MLP, *args)
    assert sum(from_vjp.values()) == sum(expected.values())


ALL_SUBSETS = [c for r in range(1, 5) for c in itertools.combinations(range(4), r)]


@pytest.mark.parametrize("argnums", ALL_SUBSETS)
def test_partial_gradients_save_what_plain_autodiff_saves(argnums):
    # Some inputs not differentiated (frozen layers, input gradients): the forward
    # keeps only what the wanted gradients need, exactly as autodiff does. Checked
    # in the jaxpr, in an eager jax.vjp, in an eager jax.vjp of a jitted function
    # (where an unneeded intermediate would become an output of the jit), and in
    # compiled memory.
    args = _mlp_args((4, 16))
    ours, diff_args = _restrict(JAXEXT_MLP, args, argnums)
    plain, _ = _restrict(PLAIN_MLP, args, argnums)
    assert saved_residuals(ours, *diff_args) == saved_residuals(plain, *diff_args)
    assert vjp_residuals(ours, *diff_args) == vjp_residuals(plain, *diff_args)
    assert vjp_residuals(jax.jit(ours), *diff_args) == vjp_residuals(jax.jit(plain), *diff_args)

    def temp_bytes(fn):
        compiled = jax.jit(jax.grad(fn, argnums)).lower(*args).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp_bytes(JAXEXT_MLP) <= temp_bytes(PLAIN_MLP)


def test_bias_only_gradient_saves_nothing():
    x, w, b = rand(0, (4, 16)), rand(1, (8, 16)), rand(2, (8,))
    # The bias gradient reads the cotangent alone: no residual array at all.
    ours, ours_args = _restrict(lambda x, w, b: jnp.sum(jaxext.linear(x, w, b)), (x, w, b), (2,))
    assert saved_residuals(ours, *ours_args) == collections.Counter()
    assert vjp_residuals(ours, *ours_args) == collections.Counter()


@pytest.mark.parametrize("policy", list(POLICIES))
def test_checkpointed_linear_gradients_match(policy):
    # Remat, eager and jitted, against float64 autodiff of the same MLP. Two float32
    # programs (jaxext vs jnp, remat vs not, eager vs jit) may round differently on
    # another CPU, so each is held to the float64 answer, not to the other.
    args = _mlp_args((2, 3, 16))
    argnums = (0, 1, 2, 3)
    expected = in_float64(jax.grad(PLAIN_MLP, argnums), *args)
    remat = jax.checkpoint(_mlp(jaxext.linear, name_hidden=True), policy=POLICIES[policy])
    for grads in (jax.grad(remat, argnums)(*args), jax.jit(jax.grad(remat, argnums))(*args)):
        for name, g, g_ref in zip(("x", "w1", "b1", "w2"), grads, expected, strict=True):
            assert g.dtype == jnp.float32
            # Longest reduction: w1's gradient sums over 6 rows x 8 units.
            assert_close_to_float64(g, g_ref, n=48, err_msg=f"grad of {name}")


@pytest.mark.parametrize(
    "policy", ["default", "nothing_saveable", "everything_saveable", "save_only_h"]
)
def test_checkpointed_linear_saves_what_plain_autodiff_saves(policy):
    args = _mlp_args()
    ours = jax.checkpoint(_mlp(jaxext.linear, True), policy=POLICIES[policy])
    plain = jax.checkpoint(_mlp(reference_linear, True), policy=POLICIES[policy])
    assert saved_residuals(ours, *args) == saved_residuals(plain, *args)


def test_dots_saveable_does_not_see_inside_custom_vjp():
    # A checkpoint policy inspects the primitives of the function; jaxext.linear is
    # one custom_vjp call, not a dot_general, so `dots_saveable` recomputes it where
    # it would save a plain matmul. jaxext never saves more than plain autodiff, and
    # naming the output (`checkpoint_name` + `save_only_these_names`) restores the
    # plain behaviour (test above).
    args = _mlp_args()
    policy = POLICIES["dots_saveable"]
    ours = saved_residuals(jax.checkpoint(JAXEXT_MLP, policy=policy), *args)
    plain = saved_residuals(jax.checkpoint(PLAIN_MLP, policy=policy), *args)
    assert not ours - plain  # a sub-multiset
    inputs_only = saved_residuals(
        jax.checkpoint(JAXEXT_MLP, policy=POLICIES["nothing_saveable"]), *args
    )
    assert ours == inputs_only


# ----------------------------------------------------------------------------- nnx

nnx = pytest.importorskip("flax.nnx")
import jaxext.nnx  # noqa: E402


class _MLP(nnx.Module):
    def __init__(self, linear_cls, rngs):
        init = nnx.initializers.normal(0.5)
        self.l1 = linear_cls(16, 8, bias_init=init, rngs=rngs)
        self.l2 = linear_cls(8, 4, bias_init=init, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def _pure(linear_cls):
    """``(apply(params, x), params)`` for a fresh ``_MLP``; params is a plain dict."""
    graphdef, state = nnx.split(_MLP(linear_cls, nnx.Rngs(0)))

    def apply(params, x):
        layer_state = jax.tree.map(lambda leaf: leaf, state)
        nnx.replace_by_pure_dict(layer_state, params)
        return nnx.merge(graphdef, layer_state)(x)

    return apply, nnx.to_pure_dict(state)


def _functional(linear_cls):
    """``(loss(params, x), params)`` for a fresh ``_MLP``; params is a plain dict."""
    apply, params = _pure(linear_cls)
    return (lambda params, x: jnp.sum(apply(params, x) ** 2)), params


@pytest.mark.parametrize("policy", ["default", "nothing_saveable", "dots_saveable"])
def test_nnx_remat_gradients_match_flax(policy):
    # jaxext.nnx.Linear with and without nnx.remat against flax's nnx.Linear (same
    # seed, plain autodiff) in float64: different float32 programs are each held to
    # the float64 answer, not to each other.
    x = rand(4, (5, 16))

    def grads(linear_cls, remat):
        model = _MLP(linear_cls, nnx.Rngs(0))

        def forward(model, x):
            return model(x)

        if remat:
            forward = nnx.remat(forward, policy=POLICIES[policy])
        loss = lambda model, x: jnp.sum(forward(model, x) ** 2)  # noqa: E731
        return nnx.to_pure_dict(nnx.grad(loss)(model, x))

    flax_loss, flax_params = _functional(nnx.Linear)
    expected = in_float64(jax.grad(flax_loss), flax_params, x)
    for remat in (True, False):
        got = grads(jaxext.nnx.Linear, remat)
        # Two layers forward and back: chained sums of up to 16 terms (see test_export).
        jax.tree.map(lambda a, b: assert_close_to_float64(a, b, n=256), got, expected)


@pytest.mark.parametrize("policy", [None, "default", "nothing_saveable", "everything_saveable"])
def test_nnx_linear_saves_what_flax_saves(policy):
    x = rand(5, (5, 16))
    counts = []
    for linear_cls in (jaxext.nnx.Linear, nnx.Linear):
        loss, params = _functional(linear_cls)
        if policy is not None:
            loss = jax.checkpoint(loss, policy=POLICIES[policy])
        counts.append(saved_residuals(loss, params, x))
    ours, flax_counts = counts
    assert ours == flax_counts
    assert sum(ours.values()) > 0


@pytest.mark.parametrize("wrt", ["params", "inputs", "both"])
def test_nnx_linear_eager_vjp_keeps_what_flax_keeps(wrt):
    # Eager jax.vjp (no jit): the closure holds exactly the arrays flax's holds,
    # shapes unsorted (the kernel is kept as stored, never as a transposed copy).
    x = rand(5, (5, 16))
    kept = []
    for linear_cls in (jaxext.nnx.Linear, nnx.Linear):
        loss, params = _functional(linear_cls)
        argnums = {"params": (0,), "inputs": (1,), "both": (0, 1)}[wrt]
        restricted, diff_args = _restrict(loss, (params, x), argnums)
        leaves = vjp_kept(restricted, *diff_args)
        kept.append(collections.Counter((np.shape(leaf), str(leaf.dtype)) for leaf in leaves))
    ours, flax_kept = kept
    assert ours == flax_kept
    assert sum(ours.values()) > 0


def test_nnx_linear_remat_in_jitted_train_step():
    # nnx.remat inside nnx.jit: an optimizer-free SGD step, compared with flax.
    x, t = rand(6, (8, 16)), rand(7, (8, 4))

    def step(model, x, t):
        forward = nnx.remat(lambda m, x: m(x))
        grads = nnx.grad(lambda m: jnp.mean((forward(m, x) - t) ** 2))(model)
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))

    model = _MLP(jaxext.nnx.Linear, nnx.Rngs(0))
    nnx.jit(step)(model, x, t)
    ours = nnx.to_pure_dict(nnx.state(model, nnx.Param))

    # The same step for flax's layer, by plain autodiff in float64.
    apply, before = _pure(nnx.Linear)

    def sgd_step(params, x, t):
        grads = jax.grad(lambda p: jnp.mean((apply(p, x) - t) ** 2))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    expected = in_float64(sgd_step, before, x, t)
    jax.tree.map(lambda a, b: assert_close_to_float64(a, b, n=256), ours, expected)
    assert not np.allclose(ours["l1"]["kernel"], before["l1"]["kernel"])


# -- optimize_remat and defremat: how often an opaque forward runs under jax.checkpoint --
#
# The rules below are host callbacks (stand-ins for an FFI kernel, jax#21303): JAX can
# neither look into nor trim them, so each one that the program keeps runs. A counter
# per rule says how often. Where the JAX here supports the same rules, what it runs is
# the expectation; the gradients are compared with float64 plain autodiff.


def _host(calls, name, fn):
    """``fn`` on NumPy arrays, counted in ``calls[name]``, as one opaque callback."""

    def host(*arrays):
        calls[name] += 1
        return fn(*arrays)

    def call(*args, n_out=1):
        shape = jax.ShapeDtypeStruct(args[0].shape, args[0].dtype)
        return jax.pure_callback(
            host, shape if n_out == 1 else (shape,) * n_out, *args, vmap_method="sequential"
        )

    return call


def _opaque_sin_mul(custom_vjp, calls, optimize_remat):
    """``sin(x) * y`` whose primal and fwd are one opaque call each."""
    primal = _host(calls, "fun", lambda x, y: np.sin(x) * y)
    fused = _host(calls, "fwd", lambda x, y: (np.sin(x) * y, np.cos(x), np.sin(x)))

    @custom_vjp
    def f(x, y):
        return primal(x, y)

    def fwd(x, y):
        out, cos_x, sin_x = fused(x, y, n_out=3)
        return out, (cos_x, sin_x, y)

    def bwd(res, g):
        cos_x, sin_x, y = res
        return g * cos_x * y, g * sin_x

    f.defvjp(fwd, bwd, optimize_remat=optimize_remat)
    return f


def _loss(f):
    return lambda x, y: jnp.sum(jnp.tanh(f(x, y)))


REMAT_TRANSFORMS = {
    "grad": lambda h: jax.value_and_grad(jax.checkpoint(h), argnums=(0, 1)),
    "jit": lambda h: jax.jit(jax.value_and_grad(jax.checkpoint(h), argnums=(0, 1))),
    "vmap": lambda h: jax.vmap(jax.value_and_grad(jax.checkpoint(h), argnums=(0, 1))),
}


def _remat_args(transform):
    x, y = rand(20, (3,)), rand(21, (3,))
    return (x[None].repeat(2, 0), y[None].repeat(2, 0)) if transform == "vmap" else (x, y)


COUNTED_TRANSFORMS = {
    **REMAT_TRANSFORMS,
    "no_checkpoint": lambda h: jax.value_and_grad(h, argnums=(0, 1)),
    "jit_no_checkpoint": lambda h: jax.jit(jax.value_and_grad(h, argnums=(0, 1))),
}


@pytest.mark.parametrize("transform", list(COUNTED_TRANSFORMS))
@pytest.mark.parametrize("optimize_remat", [False, True])
def test_optimize_remat_runs_an_opaque_fwd_once_as_jax_does(transform, optimize_remat):
    args = _remat_args(transform)
    counted = {}
    results = {}
    for name, custom_vjp in (("jax", jax.custom_vjp), ("jaxext", jaxext.custom_vjp)):
        calls = collections.Counter()
        f = _opaque_sin_mul(custom_vjp, calls, optimize_remat)
        results[name] = jax.block_until_ready(COUNTED_TRANSFORMS[transform](_loss(f))(*args))
        counted[name] = dict(calls)
    assert counted["jaxext"] == counted["jax"]
    # Under remat the forward pass keeps the primal output only: with the option it runs
    # the primal instead of fwd, and fwd runs once, on the backward pass. Without remat,
    # fwd runs once either way.
    # (vmap_method="sequential": under vmap, one call per example of the batch of 2.)
    per_call = 2 if transform == "vmap" else 1
    expected = {"fun": 1, "fwd": 1} if optimize_remat else {"fwd": 2}
    if transform.endswith("no_checkpoint"):
        expected = {"fwd": 1}
    assert counted["jaxext"] == {k: v * per_call for k, v in expected.items()}
    reference = in_float64(COUNTED_TRANSFORMS[transform](_loss(lambda x, y: jnp.sin(x) * y)), *args)
    jax.tree.map(assert_close_to_float64, results["jaxext"], reference)


def _sin_mul_rules(symbolic_zeros):
    """``sin(x) * y`` made of JAX operations, with a static residual."""

    @jaxext.custom_vjp
    def f(x, y):
        return jnp.sin(x) * y

    def fwd(x, y):
        if symbolic_zeros:
            x, y = x.value, y.value
        return f(x, y), (jnp.cos(x), jnp.sin(x), y, "static")

    def bwd(res, g):
        cos_x, sin_x, y, tag = res
        assert tag == "static"
        return g * cos_x * y, g * sin_x

    f.defvjp(fwd, bwd, symbolic_zeros=symbolic_zeros, optimize_remat=True)
    return f


def _scan_loss(f):
    def loss(x, y):
        step = jax.checkpoint(lambda c, _: (c + jnp.sum(jnp.tanh(f(x * c, y))), None))
        return jax.lax.scan(step, 0.5, None, length=3)[0]

    return loss


OPTIMIZED_TRANSFORMS = {
    **REMAT_TRANSFORMS,
    "no_checkpoint": lambda h: jax.grad(h, argnums=(0, 1)),
    "dots_saveable": lambda h: jax.jit(
        jax.grad(jax.checkpoint(h, policy=jax.checkpoint_policies.dots_saveable))
    ),
    "jvp": lambda h: lambda x, y: jax.jvp(jax.checkpoint(h), (x, y), (jnp.ones_like(x), y)),
    "jit_jacfwd": lambda h: jax.jit(jax.jacfwd(jax.checkpoint(h), argnums=(0, 1))),
    "hessian": lambda h: jax.hessian(jax.checkpoint(h)),
    "jacrev_grad": lambda h: jax.jacrev(jax.grad(jax.checkpoint(h))),
    "jacfwd_grad": lambda h: jax.jacfwd(jax.grad(jax.checkpoint(h))),
}


@pytest.mark.parametrize("transform", list(OPTIMIZED_TRANSFORMS))
@pytest.mark.parametrize("symbolic_zeros", [False, True])
def test_optimize_remat_derivatives_match_plain_autodiff(transform, symbolic_zeros):
    # jax.custom_vjp refuses symbolic_zeros and higher orders with optimize_remat;
    # jaxext gives every derivative, as without the option.
    args = _remat_args(transform)
    got = OPTIMIZED_TRANSFORMS[transform](_loss(_sin_mul_rules(symbolic_zeros)))(*args)
    want = in_float64(OPTIMIZED_TRANSFORMS[transform](_loss(lambda x, y: jnp.sin(x) * y)), *args)
    jax.tree.map(lambda a, b: assert_close_to_float64(a, b, n=3), got, want)


def test_optimize_remat_in_scan_and_under_jit_with_closures():
    scale = np.float32(1.5)

    @jax.jit
    def run(x, y, s):
        @jaxext.custom_vjp
        def f(x, y):
            return jnp.sin(x) * y * s

        f.defvjp(
            lambda x, y: (f(x, y), (jnp.cos(x) * s, jnp.sin(x) * s, y)),
            lambda r, g: (g * r[0] * r[2], g * r[1]),
            optimize_remat=True,
        )
        return jax.grad(_scan_loss(f), argnums=(0, 1))(x, y)

    x, y = rand(22, (3,)), rand(23, (3,))
    want = in_float64(
        lambda x, y: jax.grad(_scan_loss(lambda x, y: jnp.sin(x) * y * scale), (0, 1))(x, y),
        x,
        y,
    )
    jax.tree.map(lambda a, b: assert_close_to_float64(a, b, n=9), run(x, y, scale), want)


def _opaque_remat_rules(custom_vjp, calls, with_defvjp=None):
    """``sin(x) * y`` by ``defremat``: fwd saves ``sin(x)``; rem recomputes ``cos(x)`` from it."""
    primal = _host(calls, "fun", lambda x, y: np.sin(x) * y)
    fused = _host(calls, "fwd", lambda x, y: (np.sin(x) * y, np.sin(x)))
    # For x in (-pi/2, pi/2): cos(x) from sin(x) alone, so rem needs fwd's residual.
    cos_from_sin = _host(calls, "rem", lambda s: np.sqrt(1 - s * s).astype(s.dtype))

    @custom_vjp
    def f(x, y):
        return primal(x, y)

    def fwd(x, y):
        out, sin_x = fused(x, y, n_out=2)
        return out, sin_x

    def rem(sin_x, x, y):
        return sin_x * y, (cos_from_sin(sin_x), sin_x, y)

    def bwd(res, g):
        cos_x, sin_x, y = res
        return g * cos_x * y, g * sin_x

    def plain_fwd(x, y):
        return f(x, y), (jnp.cos(x), jnp.sin(x), y)

    if with_defvjp == "before":
        f.defvjp(plain_fwd, bwd)
    f.defremat(fwd, rem, bwd)
    if with_defvjp == "after":
        f.defvjp(plain_fwd, bwd)
    return f


def _remat_rule_args(transform):
    x, y = rand(24, (3,)) * 0.5, rand(25, (3,))  # |x| < pi/2
    return (x[None].repeat(2, 0), y[None].repeat(2, 0)) if transform == "vmap" else (x, y)


DEFREMAT_TRANSFORMS = {
    **REMAT_TRANSFORMS,
    "no_checkpoint": lambda h: jax.value_and_grad(h, argnums=(0, 1)),
    "everything_saveable": lambda h: jax.value_and_grad(
        jax.checkpoint(h, policy=jax.checkpoint_policies.everything_saveable), argnums=(0, 1)
    ),
}


@contextlib.contextmanager
def _jax_defremat():
    """JAX's own defremat (JAX 0.12 and later), which needs its newer implementations."""
    names = ("jax_custom_vjp3", "jax_remat3")
    before = {name: getattr(jax.config, name) for name in names}
    try:
        for name in names:
            jax.config.update(name, True)
        yield
    finally:
        for name, value in before.items():
            jax.config.update(name, value)


@pytest.mark.parametrize("transform", list(DEFREMAT_TRANSFORMS))
def test_defremat_runs_fwd_once_and_rem_on_the_backward_pass(transform):
    args = _remat_rule_args(transform)
    calls = collections.Counter()
    f = _opaque_remat_rules(jaxext.custom_vjp, calls)
    got = jax.block_until_ready(DEFREMAT_TRANSFORMS[transform](_loss(f))(*args))
    # fwd's residual is saved whatever the policy: fwd runs once, rem once, the primal
    # never (under vmap, once per example of the batch of 2).
    per_call = 2 if transform == "vmap" else 1
    assert dict(calls) == {"fwd": per_call, "rem": per_call}
    want = in_float64(DEFREMAT_TRANSFORMS[transform](_loss(lambda x, y: jnp.sin(x) * y)), *args)
    jax.tree.map(lambda a, b: assert_close_to_float64(a, b, n=3), got, want)


@pytest.mark.parametrize("transform", list(DEFREMAT_TRANSFORMS))
def test_defremat_runs_what_jax_runs(transform):
    if not hasattr(jax.custom_vjp, "defremat"):
        pytest.skip(f"jax.custom_vjp.defremat does not exist in JAX {jax.__version__}")
    args = _remat_rule_args(transform)
    counted = {}
    for name, custom_vjp in (("jax", jax.custom_vjp), ("jaxext", jaxext.custom_vjp)):
        calls = collections.Counter()
        f = _opaque_remat_rules(custom_vjp, calls)
        context = _jax_defremat() if name == "jax" else contextlib.nullcontext()
        with context:
            jax.block_until_ready(DEFREMAT_TRANSFORMS[transform](_loss(f))(*args))
        counted[name] = dict(calls)
    assert counted["jaxext"] == counted["jax"]


@pytest.mark.parametrize("with_defvjp", ["before", "after"])
def test_defremat_rules_win_over_defvjp_in_either_order(with_defvjp):
    args = _remat_rule_args("grad")
    calls = collections.Counter()
    f = _opaque_remat_rules(jaxext.custom_vjp, calls, with_defvjp=with_defvjp)
    got = REMAT_TRANSFORMS["grad"](_loss(f))(*args)
    assert dict(calls) == {"fwd": 1, "rem": 1}
    want = in_float64(REMAT_TRANSFORMS["grad"](_loss(lambda x, y: jnp.sin(x) * y)), *args)
    jax.tree.map(lambda a, b: assert_close_to_float64(a, b, n=3), got, want)


@pytest.mark.parametrize(
    "transform",
    [
        lambda h: lambda x, y: jax.jvp(jax.checkpoint(h), (x, y), (jnp.ones_like(x), y)),
        lambda h: jax.hessian(jax.checkpoint(h)),
        lambda h: jax.jacrev(jax.grad(jax.checkpoint(h))),
    ],
    ids=["jvp", "hessian", "jacrev_grad"],
)
def test_defremat_forward_mode_and_second_order(transform):
    @jaxext.custom_vjp
    def f(x, y):
        return jnp.sin(x) * y

    f.defremat(
        lambda x, y: (f(x, y), jnp.sin(x)),
        lambda sin_x, x, y: (sin_x * y, (jnp.cos(x), sin_x, y)),
        lambda r, g: (g * r[0] * r[2], g * r[1]),
    )
    args = _remat_rule_args("grad")
    got = transform(_loss(f))(*args)
    want = in_float64(transform(_loss(lambda x, y: jnp.sin(x) * y)), *args)
    jax.tree.map(lambda a, b: assert_close_to_float64(a, b, n=3), got, want)


@pytest.mark.parametrize("bad", ["fwd", "rem", "bwd"])
def test_defremat_refuses_a_rule_that_is_not_callable(bad):
    f = jaxext.custom_vjp(jnp.sin)
    rules = {"fwd": lambda x: (jnp.sin(x), x), "rem": lambda r, x: (jnp.sin(x), r)}
    rules["bwd"] = lambda r, g: (g * jnp.cos(r),)
    rules[bad] = 3
    with pytest.raises(TypeError, match=f"`{bad}` must be callable; got int"):
        f.defremat(rules["fwd"], rules["rem"], rules["bwd"])


@pytest.mark.parametrize(
    ("rem", "message"),
    [
        (lambda s, x: jnp.cos(x), "rem must return a pair"),
        (lambda s, x: ((s, s), jnp.cos(x)), "rem's output must have fwd's output structure"),
    ],
    ids=["not_a_pair", "wrong_output_structure"],
)
def test_defremat_names_a_rem_that_breaks_its_contract(rem, message):
    @jaxext.custom_vjp
    def sin_op(x):
        return jnp.sin(x)

    sin_op.defremat(lambda x: (jnp.sin(x), jnp.sin(x)), rem, lambda c, g: (g * c,))
    with pytest.raises(jaxext.RuleTypeError, match=f"`sin_op`: {message}"):
        jax.grad(jax.checkpoint(sin_op))(jnp.float32(0.5))


# -- the JAX internals _remat.py names in its header, and the fallback without them --------

_LIVE_INS_SINCE = (0, 11)  # JAX passes DCE rules `live_ins` since 0.11


def _jax_version():
    return tuple(int(part) for part in jax.__version__.split(".")[:2])


def _recorded(table, primitive, monkeypatch):
    """The argument tuples JAX calls ``table[primitive]`` with, from now on."""
    calls = []
    rule = table[primitive]

    def record(*args):
        calls.append(args)
        return rule(*args)

    monkeypatch.setitem(table, primitive, record)
    return calls


def test_remat_internals_have_the_forms_this_module_names(monkeypatch):
    from jax.extend import core
    from jax.interpreters import partial_eval as pe

    from jaxext import _remat

    for name in ("Primitive", "Var", "JaxprEqn", "new_jaxpr_eqn", "no_effects"):
        assert hasattr(core, name), name
    assert isinstance(pe.dce_rules, dict)
    assert isinstance(pe.partial_eval_jaxpr_custom_rules, dict)
    assert callable(pe.dce_jaxpr)
    assert pe.dce_rules[_remat.fwd_p] is _remat._fwd_dce
    assert pe.dce_rules[_remat.pick_p] is _remat._pick_dce
    assert pe.partial_eval_jaxpr_custom_rules[_remat.save_p] is _remat._save_partial_eval
    assert pe.partial_eval_jaxpr_custom_rules[_remat.pick_p] is _remat._pick_partial_eval
    assert _remat.missing_internals() is None  # so optimize_remat stages fwd here

    # The DCE rule's signature, as jax.checkpoint calls it on an optimize_remat fwd.
    dce_calls = _recorded(pe.dce_rules, _remat.fwd_p, monkeypatch)
    calls = collections.Counter()
    args = _remat_args("grad")
    jax.grad(jax.checkpoint(_loss(_opaque_sin_mul(jaxext.custom_vjp, calls, True))))(*args)
    assert dce_calls
    n_lists = 2 if _jax_version() >= _LIVE_INS_SINCE else 1  # (used_outs[, live_ins])
    for call in dce_calls:
        *flags, eqn = call
        assert len(flags) == n_lists
        assert isinstance(eqn, core.JaxprEqn)
        assert eqn.primitive is _remat.fwd_p
        assert len(flags[0]) == len(eqn.outvars)
        assert all(len(f) == len(eqn.invars) for f in flags[1:])
        assert all(isinstance(b, bool) for f in flags for b in f)
        assert {"invars", "outvars", "params", "source_info", "ctx"} <= set(dir(eqn))

    # The partial-eval rule's signature, as jax.checkpoint calls it on defremat's residuals.
    pe_calls = _recorded(pe.partial_eval_jaxpr_custom_rules, _remat.save_p, monkeypatch)
    calls = collections.Counter()
    args = _remat_rule_args("grad")
    jax.grad(jax.checkpoint(_loss(_opaque_remat_rules(jaxext.custom_vjp, calls))))(*args)
    assert pe_calls
    for saveable, unks_in, inst_in, eqn in pe_calls:
        assert callable(saveable)
        assert len(unks_in) == len(inst_in) == len(eqn.invars)
        assert eqn.primitive is _remat.save_p


@pytest.fixture
def reprobed_internals(monkeypatch):
    """``monkeypatch``, with ``_remat.missing_internals`` probing again before and after."""
    from jaxext import _remat

    _remat.missing_internals.cache_clear()
    yield monkeypatch
    _remat.missing_internals.cache_clear()


def _without_dce_rules(monkeypatch, pe, _remat):
    monkeypatch.delattr(pe, "dce_rules")
    return "dce_rules"


def _without_new_jaxpr_eqn(monkeypatch, pe, _remat):
    monkeypatch.setattr(_remat, "new_jaxpr_eqn", None)
    return "new_jaxpr_eqn"


def _dce_rule_not_applied(monkeypatch, pe, _remat):
    # As if JAX no longer asked the table: the equation is kept whole.
    monkeypatch.setitem(
        pe.dce_rules, _remat.fwd_p, lambda used, *rest: ([True] * len(rest[-1].invars), rest[-1])
    )
    return "did not apply"


def _dce_rule_signature_changed(monkeypatch, pe, _remat):
    # As if JAX passed the equation somewhere other than last.
    monkeypatch.setitem(
        pe.dce_rules, _remat.fwd_p, lambda used, *rest: _remat._fwd_dce(used, *rest, None)
    )
    return "failed on fwd_p's rule"


@pytest.mark.parametrize(
    "simulate",
    [
        _without_dce_rules,
        _without_new_jaxpr_eqn,
        _dce_rule_not_applied,
        _dce_rule_signature_changed,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
@pytest.mark.parametrize("transform", ["grad", "jit"])
def test_optimize_remat_without_the_internals_runs_fwd_twice_with_correct_gradients(
    simulate, transform, reprobed_internals
):
    from jax.interpreters import partial_eval as pe

    from jaxext import _remat

    why = simulate(reprobed_internals, pe, _remat)
    assert why in (_remat.missing_internals() or "")
    args = _remat_args(transform)
    calls = collections.Counter()
    f = _opaque_sin_mul(jaxext.custom_vjp, calls, optimize_remat=True)
    got = jax.block_until_ready(REMAT_TRANSFORMS[transform](_loss(f))(*args))
    assert dict(calls) == {"fwd": 2}  # as without optimize_remat, instead of failing
    want = in_float64(REMAT_TRANSFORMS[transform](_loss(lambda x, y: jnp.sin(x) * y)), *args)
    jax.tree.map(assert_close_to_float64, got, want)
