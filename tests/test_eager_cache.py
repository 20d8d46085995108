"""The per-function caches of eager work in ``jaxext.custom_vjp`` never serve a stale rule.

Eager calls reuse, per abstract signature, the primal's output type (fwd's output check)
and compiled forward-mode programs (see ``jaxext/_eager_cache.py``). Each
test alternates calls that differ in one static aspect (nondiff value, shape, dtype, weak
type, pytree structure, perturbed set, keyword argument, the rules themselves), three
times each so that every cache is filled and then served, and compares every result
with an independent float64 reference. No timing is asserted.
"""

from __future__ import annotations

import functools
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, count_primitive, in_float64, rand

import jaxext
from jaxext import _custom_vjp, _eager_cache

REPEAT = 3  # first call: as is; second: the tangent is compiled; third: served from cache


def _scale_op():
    """``x * c`` with nondiff ``c``; bwd and jvp-by-transposition use ``c``."""

    @functools.partial(jaxext.custom_vjp, nondiff_argnums=(1,))
    def scale(x, c):
        return x * c

    scale.defvjp(lambda x, c: (scale(x, c), None), lambda c, _, g: (g * c,))
    return scale


def _check_grad_and_jvp(f, plain, args, tol=1e-6):
    """Eager grad and jvp of ``f`` against ``plain`` in float64, ``REPEAT`` times."""
    tangents = tuple(jnp.ones_like(a) for a in args)
    argnums = tuple(range(len(args)))
    ref_grad = in_float64(lambda *a: jax.grad(lambda *b: plain(*b).sum(), argnums)(*a), *args)
    ref_jvp = in_float64(lambda *a: jax.jvp(plain, a, tuple(map(jnp.ones_like, a)))[1], *args)
    for _ in range(REPEAT):
        got = jax.grad(lambda *b: f(*b).sum(), argnums)(*args)
        for g, r, a in zip(got, ref_grad, args, strict=True):
            assert g.dtype == jnp.asarray(a).dtype
            assert_close(g, r, rtol=tol, atol=tol)
        assert_close(jax.jvp(f, args, tangents)[1], ref_jvp, rtol=tol, atol=tol)


@pytest.mark.parametrize("mode", ["grad", "jvp"])
def test_nondiff_values_of_equal_hash_are_told_apart(mode):
    scale = _scale_op()
    x = jnp.asarray(rand(0, (3,)))
    # 2 == 2.0 == True-ish and 0.0 == -0.0 hash alike; each must get its own rule.
    for _ in range(REPEAT):
        for c in (2, 2.0, 3.0, 0.0, -0.0, np.float32(3.0), True):
            if mode == "grad":
                got = jax.grad(lambda v, c=c: scale(v, c).sum())(x)
            else:
                got = jax.jvp(lambda v, c=c: scale(v, c), (x,), (jnp.ones_like(x),))[1]
            assert_close(got, np.full(3, float(c)), rtol=0, atol=0)
            assert got.dtype == jnp.float32
            if mode == "jvp" and c == 0.0:
                assert np.signbit(np.asarray(got)).all() == np.signbit(c), c


def test_shapes_dtypes_and_weak_types(x64):
    del x64

    @jaxext.custom_vjp
    def f(x, w):
        return jnp.tanh(x) * w

    def fwd(x, w):
        return f(x, w), (1 - jnp.tanh(x) ** 2, jnp.tanh(x), w)

    f.defvjp(fwd, lambda res, g: (g * res[0] * res[2], g * res[1]))

    def plain(x, w):
        return jnp.tanh(x) * w

    cases = [
        (rand(1, (3,)), rand(2, (3,))),
        (rand(3, (2, 4)), rand(4, (2, 4))),
        (rand(5, (3,), np.float64), rand(6, (3,), np.float64)),
        (rand(7, (), np.float32), rand(8, (), np.float32)),
    ]
    for _ in range(REPEAT):
        for x, w in cases:
            args = (jnp.asarray(x), jnp.asarray(w))
            tol = 1e-12 if x.dtype == np.float64 else 1e-6
            _check_grad_and_jvp(f, plain, args, tol)
        # A weakly typed scalar next to a float32 one: the output type follows each.
        for w in (jnp.float32(0.5), 0.5):
            x = jnp.float32(0.3)
            out = jax.jvp(lambda x, w=w: f(x, w), (x,), (jnp.float32(1.0),))
            ref = jax.jvp(lambda x, w=w: plain(x, w), (x,), (jnp.float32(1.0),))
            assert out[1].dtype == ref[1].dtype
            assert out[1].weak_type == ref[1].weak_type
            assert_close(out[1], ref[1])


def test_pytree_structures_and_keywords():
    @jaxext.custom_vjp
    def f(tree, scale=2.0):
        return jax.tree_util.tree_reduce(jnp.add, jax.tree.map(jnp.sum, tree)) * scale

    def fwd(tree, scale=2.0):
        return f(tree, scale), (tree, scale)

    def bwd(res, g):
        tree, scale = res
        return jax.tree.map(lambda a: jnp.full_like(a, g * scale), tree), g * 0

    f.defvjp(fwd, bwd)
    trees = [
        {"a": jnp.ones(2), "b": jnp.ones(3)},
        (jnp.ones(2), jnp.ones(3)),
        {"a": jnp.ones(2)},
        [jnp.ones((2, 2))],
    ]
    for _ in range(REPEAT):
        for tree in trees:
            for kwargs, s in (({}, 2.0), ({"scale": jnp.float32(3.0)}, 3.0)):
                grad = jax.grad(lambda t, kwargs=kwargs: f(t, **kwargs))(tree)
                assert jax.tree.structure(grad) == jax.tree.structure(tree)
                for g in jax.tree.leaves(grad):
                    assert_close(g, np.full(g.shape, s))
                tangent = jax.tree.map(jnp.ones_like, tree)
                out = jax.jvp(lambda t, kwargs=kwargs: f(t, **kwargs), (tree,), (tangent,))[1]
                size = sum(a.size for a in jax.tree.leaves(tree))
                assert_close(out, size * s)


def test_perturbed_sets_select_the_residuals():
    """fwd saves what the perturbed set needs: a stale rule would read the wrong residual."""

    @jaxext.custom_vjp
    def mul(x, y):
        return x * y

    def fwd(x, y):
        res = (y.value if x.perturbed else None, x.value if y.perturbed else None)
        return x.value * y.value, res

    def bwd(res, g):
        y, x = res
        return (None if y is None else g * y), (None if x is None else g * x)

    mul.defvjp(fwd, bwd, symbolic_zeros=True)
    x, y = jnp.asarray(rand(9, (4,))), jnp.asarray(rand(10, (4,)))
    ones = jnp.ones(4)
    for _ in range(REPEAT):
        assert_close(jax.jvp(lambda a: mul(a, y), (x,), (ones,))[1], y)
        assert_close(jax.jvp(lambda b: mul(x, b), (y,), (ones,))[1], x)
        assert_close(jax.jvp(mul, (x, y), (ones, 2 * ones))[1], y + 2 * x, rtol=1e-6)
        assert_close(jax.grad(lambda a: mul(a, y).sum())(x), y)
        assert_close(jax.grad(lambda b: mul(x, b).sum())(y), x)


def test_redefined_rules_are_used():
    scale = _scale_op()
    x = jnp.ones(3)
    for _ in range(REPEAT):
        assert_close(jax.jvp(lambda v: scale(v, 2.0), (x,), (x,))[1], 2 * x)
        assert_close(jax.grad(lambda v: scale(v, 2.0).sum())(x), 2 * x)
    scale.defvjp(lambda x, c: (scale(x, c), None), lambda c, _, g: (g * c * 10,))
    for _ in range(REPEAT):
        assert_close(jax.jvp(lambda v: scale(v, 2.0), (x,), (x,))[1], 20 * x)
        assert_close(jax.grad(lambda v: scale(v, 2.0).sum())(x), 20 * x)


def test_bwd_branching_on_a_residual_value_keeps_working():
    """A bwd that cannot be staged (Python control flow on a residual) runs as before."""

    @jaxext.custom_vjp
    def f(x):
        return x * 3.0

    def bwd(res, g):
        return (g * 3.0 if float(res) > 0 else g * 3.0,)

    f.defvjp(lambda x: (f(x), x.sum()), bwd)
    x = jnp.ones(2)
    for _ in range(REPEAT + 1):
        assert_close(jax.jvp(f, (x,), (x,))[1], 3 * x)


def test_fwd_closing_over_a_traced_value_with_concrete_inputs():
    """grad of a constant inside jit, with fwd closing over a jit-traced value."""

    def make(s):
        @jaxext.custom_vjp
        def f(x):
            return x * s

        f.defvjp(lambda x: (x * s, None), lambda _, g: (g * s,))
        return f

    x0 = jnp.arange(3.0)
    out = jax.jit(lambda s: jax.grad(lambda x: (make(s)(x) ** 2).sum())(x0))(2.0)
    assert_close(out, 2 * (x0 * 2.0) * 2.0)


def test_eager_distinct_constants_keep_the_cache_bounded():
    """10,000-style eager use: every call a new Python constant; entries stay bounded."""
    from jaxext._mul_constant import _mul_static

    x = jnp.ones(3)
    n = 2 * _eager_cache.CACHE_SIZE + 10
    for i in range(n):
        c = 1.0 + i / 7
        out = jax.jvp(lambda v, c=c: jaxext.mul_constant(v, c), (x,), (x,))[1]
        assert_close(out, np.full(3, c))
    cache = _eager_cache._entries(_mul_static)
    assert len(cache) <= _eager_cache.CACHE_SIZE
    # Nothing was compiled for a constant seen once.
    assert all(not callable(v) for v in cache.values())


def test_rules_reading_a_rebound_global_array_run_afresh():
    """An array the bwd reads from outside its arguments is never baked into a cache."""
    state = {"w": jnp.full(3, 2.0)}

    @jaxext.custom_vjp
    def f(x):
        return x * state["w"]

    f.defvjp(lambda x: (f(x), None), lambda _, g: (g * state["w"],))
    x = jnp.ones(3)
    for value in (2.0, 5.0, -1.0):
        state["w"] = jnp.full(3, value)
        for _ in range(REPEAT):
            assert_close(jax.jvp(f, (x,), (x,))[1], np.full(3, value))
            assert_close(jax.grad(lambda v: f(v).sum())(x), np.full(3, value))


def _sin_mul(calls):
    """``sin(x) * w``, whose ``fwd`` records each run in ``calls``."""

    @jaxext.custom_vjp
    def f(x, w):
        return jnp.sin(x) * w

    def fwd(x, w):
        calls.append(1)
        return f(x, w), (jnp.cos(x), jnp.sin(x), w)

    f.defvjp(fwd, lambda res, g: (g * res[0] * res[2], g * res[1]))
    return f


def _sin_mul_jvp_reference(x, w, tx, tw):
    return in_float64(lambda *a: jax.jvp(lambda x, w: jnp.sin(x) * w, a[:2], a[2:]), x, w, tx, tw)


def test_eager_jvp_runs_one_compiled_program_per_signature():
    """Eager jvp: fwd runs in Python the first time, is traced the second, then not at all."""
    calls = []
    f = _sin_mul(calls)
    x, w, tx, tw = (jnp.asarray(rand(k, (5,))) for k in (11, 12, 13, 14))
    ref_out, ref_t = _sin_mul_jvp_reference(x, w, tx, tw)
    for _ in range(5):
        out, t = jax.jvp(f, (x, w), (tx, tw))
        assert out.dtype == t.dtype == jnp.float32
        assert_close(out, ref_out)
        assert_close(t, ref_t)
    assert len(calls) == 2
    # A new shape is a new signature: run as is, then compiled again.
    x2, w2 = jnp.ones((2, 3)), jnp.full((2, 3), 0.5)
    ref2 = _sin_mul_jvp_reference(x2, w2, w2, x2)
    for _ in range(3):
        for got, ref in zip(jax.jvp(f, (x2, w2), (w2, x2)), ref2, strict=True):
            assert_close(got, ref)
    assert len(calls) == 4


@pytest.mark.parametrize("where", ["jit", "vmap", "grad"])
def test_eager_jvp_program_is_not_used_inside_transformations(where):
    """Inside jit/vmap/grad the JVP rule is traced as before, even with concrete inputs."""
    calls = []
    f = _sin_mul(calls)
    x, w = jnp.asarray(rand(15, (4,))), jnp.asarray(rand(16, (4,)))
    for _ in range(REPEAT):  # fills the eager cache
        jax.jvp(f, (x, w), (w, x))
    ref = _sin_mul_jvp_reference(x, w, w, x)[1]
    if where == "jit":
        # x and w are constants of the jitted function: the tangent stays a staged primitive.
        g = jax.jit(lambda: jax.jvp(f, (x, w), (w, x))[1])
        assert count_primitive(jax.make_jaxpr(g)(), "jaxext_custom_vjp_tangent") == 1
        assert_close(g(), ref)
    elif where == "vmap":
        got = jax.vmap(lambda s: jax.jvp(f, (x, w), (w, x))[1] * s)(jnp.arange(3.0))
        assert_close(got, np.outer(np.arange(3.0), ref))
    else:
        # The tangent is cos(x) * w * v + sin(x) * x: its gradient in v is cos(x) * w.
        got = jax.grad(lambda v: jax.jvp(f, (x, w), (v, x))[1].sum())(w)
        assert_close(got, np.cos(np.asarray(x, np.float64)) * np.asarray(w, np.float64))


def test_eager_jvp_fwd_branching_on_a_value_runs_as_is():
    """A fwd with Python control flow on an input's value cannot be compiled: it runs each time."""

    @jaxext.custom_vjp
    def f(x):
        return x * 2.0

    def fwd(x):
        scale = 2.0 if float(x.sum()) > 0 else 2.0
        return x * scale, None

    f.defvjp(fwd, lambda _, g: (g * 2.0,))
    for sign in (1.0, -1.0) * REPEAT:
        x = jnp.full(3, sign)
        out, t = jax.jvp(f, (x,), (jnp.ones(3),))
        assert_close(out, np.full(3, 2 * sign))
        assert_close(t, np.full(3, 2.0))


def test_eager_jvp_keeps_raising_for_a_wrong_fwd():
    """A fwd whose output does not match the primal raises at every eager call."""

    @jaxext.custom_vjp
    def f(x):
        return x * 2.0

    f.defvjp(lambda x: ((x * 2.0).astype(jnp.bfloat16), None), lambda _, g: (g * 2.0,))
    x = jnp.ones(3)
    for _ in range(REPEAT):
        with pytest.raises(TypeError, match="fwd's output must have the primal's"):
            jax.jvp(f, (x,), (x,))


def test_eager_jvp_program_does_not_keep_the_calls_arrays_alive():
    """The cached program holds the rules and static values, not the arrays it was built on."""
    calls = []
    f = _sin_mul(calls)
    xs = [jnp.full(3, float(i)) for i in range(REPEAT + 1)]
    refs = [weakref.ref(x) for x in xs]
    w = jnp.ones(3)
    for x in xs:
        assert_close(jax.jvp(f, (x, w), (w, w))[1], np.cos(np.asarray(x)) + np.sin(np.asarray(x)))
    assert len(calls) == 2  # the program was built (on the second array) and served
    del xs, x
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


def test_a_new_x64_setting_never_reuses_an_entry():
    """The primal's output type and the compiled programs are keyed by jax_enable_x64."""

    @jaxext.custom_vjp
    def widen(x):
        return x.astype(float)  # float32, or float64 under x64, for the same float32 input

    widen.defvjp(lambda x: (widen(x), None), lambda _, g: (g.astype(jnp.float32),))
    x = jnp.asarray(rand(17, (3,)))  # float32 under either setting
    for x64 in (False, True, False):
        with jax.enable_x64(x64):
            wide = jnp.float64 if x64 else jnp.float32
            for _ in range(REPEAT):
                assert_close(jax.grad(lambda v: widen(v).sum())(x), np.ones(3))
                out, t = jax.jvp(widen, (x,), (jnp.ones_like(x),))
                assert out.dtype == t.dtype == wide
                assert_close(t, np.ones(3))


def test_the_plain_steps_without_the_cache(monkeypatch):
    """With the eager cache off, the plain path gives the same values and errors."""
    monkeypatch.setattr(_custom_vjp, "STEPS", _custom_vjp.Steps())  # the caches off

    @jaxext.custom_vjp
    def f(x, w):
        return jnp.tanh(x) * w

    def fwd(x, w):
        return f(x, w), (1 - jnp.tanh(x) ** 2, jnp.tanh(x), w)

    f.defvjp(fwd, lambda res, g: (g * res[0] * res[2], g * res[1]))
    args = (jnp.asarray(rand(18, (2, 3))), jnp.asarray(rand(19, (2, 3))))
    _check_grad_and_jvp(f, lambda x, w: jnp.tanh(x) * w, args)

    scale = _scale_op()
    x = jnp.asarray(rand(20, (3,)))
    for c in (2, 2.0, -0.5):
        _check_grad_and_jvp(lambda v, c=c: scale(v, c), lambda v, c=c: v * c, (x,))

    w, b = jnp.asarray(rand(21, (4, 3))), jnp.asarray(rand(22, (4,)))
    _check_grad_and_jvp(jaxext.linear, lambda x, w, b: x @ w.T + b, (x[None], w, b))
    _, f_jvp = jax.linearize(lambda v: f(v, jnp.full(3, 2.0)), x)
    ref_lin = in_float64(lambda x: jax.linearize(lambda v: jnp.tanh(v) * 2.0, x)[1](x), x)
    for _ in range(REPEAT):
        assert_close(f_jvp(x), ref_lin)

    @jaxext.custom_vjp
    def wrong(x):
        return x * 2.0

    wrong.defvjp(lambda x: ((x * 2.0).astype(jnp.bfloat16), None), lambda _, g: (g * 2.0,))
    for _ in range(REPEAT):
        with pytest.raises(TypeError, match="fwd's output must have the primal's"):
            jax.grad(lambda v: wrong(v).sum())(x)
    for op in (f, scale, wrong):
        assert "_eager_cache" not in vars(op)  # nothing was cached


# -- jaxext.Function and the function jax.linearize returns (issue 41) --------------------


def _power_function(calls):
    """``x ** power`` as a ``jaxext.Function`` with a static ``power``; ``forward`` records
    each run (its static argument) in ``calls``."""

    class Power(jaxext.Function):
        @staticmethod
        def forward(ctx, x, power):
            calls.append(power)
            ctx.save_for_backward(x)
            ctx.power = power
            return x**power

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * ctx.power * x ** (ctx.power - 1), None

    return Power


def _power_reference(x, power):
    """Output, tangent (in direction ``x``) and gradient of ``sum(x ** power)``, in float64."""
    out, t = in_float64(lambda v: jax.jvp(lambda u: u**power, (v,), (v,)), x)
    return out, t, in_float64(jax.grad(lambda v: (v**power).sum()), x)


def test_eager_jvp_of_a_function_is_served_by_the_cache():
    """Each static value gets its own entry; once built, no call runs ``forward`` again."""
    calls = []
    power = _power_function(calls)
    x = jnp.asarray(rand(30, (4,)))
    refs = {p: _power_reference(x, p) for p in (2, 3)}
    for _ in range(2):  # as is, then the compiled program is built
        for p in (2, 3):
            jax.jvp(lambda v, p=p: power.apply(v, p), (x,), (x,))
    built = len(calls)
    for _ in range(REPEAT):
        for p in (2, 3):
            out, t = jax.jvp(lambda v, p=p: power.apply(v, p), (x,), (x,))
            assert out.dtype == t.dtype == jnp.float32
            assert_close(out, refs[p][0])
            assert_close(t, refs[p][1])
    assert len(calls) == built  # served: forward ran in none of these calls


def test_eager_grad_of_a_function_traces_its_primal_once():
    """Eager grad runs ``forward`` once per call; the primal's output type is served."""
    calls = []
    power = _power_function(calls)
    x = jnp.asarray(rand(31, (4,)))
    ref = _power_reference(x, 3)[2]
    jax.grad(lambda v: power.apply(v, 3).sum())(x)
    for _ in range(REPEAT):
        before = len(calls)
        assert_close(jax.grad(lambda v: power.apply(v, 3).sum())(x), ref)
        assert calls[before:] == [3]  # fwd's run alone: the primal is not traced again


def test_a_static_argument_the_cache_cannot_key_runs_as_is():
    """A static object (mutable, keyed by nothing) is read afresh at every call."""

    class Scale:
        def __init__(self, value):
            self.value = value

    calls = []

    class Scaled(jaxext.Function):
        @staticmethod
        def forward(ctx, x, scale):
            calls.append(1)
            ctx.scale = scale.value
            return x * scale.value

        @staticmethod
        def backward(ctx, g):
            return g * ctx.scale, None

    x, scale = jnp.asarray(rand(32, (3,))), Scale(2.0)
    for value in (2.0, -3.0, 0.5):
        scale.value = value
        for _ in range(REPEAT):
            before = len(calls)
            out, t = jax.jvp(lambda v: Scaled.apply(v, scale), (x,), (jnp.ones_like(x),))
            assert_close(out, np.asarray(x, np.float64) * value)
            assert_close(t, np.full(3, value))
            assert len(calls) > before  # not served from a cache
            assert_close(jax.grad(lambda v: Scaled.apply(v, scale).sum())(x), np.full(3, value))


def test_a_function_whose_backward_is_reassigned_uses_the_new_one():
    """A class patched between calls is lowered afresh, as ``defvjp`` anew is."""
    power = _power_function([])
    x = jnp.asarray(rand(33, (4,)))
    t_ref = _power_reference(x, 3)[1]
    for _ in range(REPEAT):
        assert_close(jax.jvp(lambda v: power.apply(v, 3), (x,), (x,))[1], t_ref)
    power.backward = staticmethod(lambda ctx, g: (7.0 * g, None))
    for _ in range(REPEAT):
        # forward mode transposes the (new) backward: J t = 7 t
        assert_close(jax.jvp(lambda v: power.apply(v, 3), (x,), (x,))[1], 7.0 * np.asarray(x))


def _typed_product(calls):
    """``x * w`` whose residuals keep ``jaxext.grad_type`` results (static, not plain
    Python values, as ``jaxext.linear`` keeps); ``bwd`` records each trace in ``calls``."""

    @jaxext.custom_vjp
    def f(x, w):
        return x * w

    def fwd(x, w):
        return f(x, w), (x, w, jaxext.grad_type(x), jaxext.grad_type(w))

    def bwd(res, g):
        calls.append(1)
        x, w, x_type, w_type = res
        return (g * w).astype(x_type.dtype), (g * x).astype(w_type.dtype)

    f.defvjp(fwd, bwd)
    return f


def test_the_linearized_function_compiles_its_tangent_once():
    """Eager calls of ``jax.linearize``'s function: ``bwd`` is not traced after the second."""
    calls = []
    f = _typed_product(calls)
    x, w, tx, tw = (jnp.asarray(rand(k, (5,))) for k in (34, 35, 36, 37))
    _, f_jvp = jax.linearize(f, x, w)
    ref = in_float64(lambda *a: jax.linearize(lambda x, w: x * w, *a[:2])[1](*a[2:]), x, w, tx, tw)
    for _ in range(2):
        assert_close(f_jvp(tx, tw), ref)
    traced = len(calls)
    for _ in range(REPEAT):
        assert_close(f_jvp(tx, tw), ref)
    assert len(calls) == traced


@pytest.mark.parametrize("wrt", ["x", "all"])
def test_the_linearized_linear_against_float64(wrt):
    """``jaxext.linear``'s linearized function, called eagerly, against float64 autodiff."""
    x, w, b = (jnp.asarray(rand(k, s)) for k, s in ((38, (8, 6)), (39, (4, 6)), (40, (4,))))
    t = tuple(jnp.asarray(rand(41 + k, a.shape)) for k, a in enumerate((x, w, b)))

    def plain(x, w, b):
        return x @ w.T + b

    if wrt == "x":
        _, f_jvp = jax.linearize(lambda v: jaxext.linear(v, w, b), x)
        ref = in_float64(
            lambda *a: jax.linearize(lambda v: plain(v, *a[1:3]), a[0])[1](a[3]), x, w, b, t[0]
        )
        call = lambda: f_jvp(t[0])  # noqa: E731
    else:
        _, f_jvp = jax.linearize(jaxext.linear, x, w, b)
        ref = in_float64(lambda *a: jax.linearize(plain, *a[:3])[1](*a[3:]), x, w, b, *t)
        call = lambda: f_jvp(*t)  # noqa: E731
    for _ in range(REPEAT + 1):
        got = call()
        assert got.dtype == jnp.float32
        assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_the_linearized_functions_programs_die_with_it():
    """The compiled tangent lives as long as the linearized function, no longer."""
    from jaxext import _linearized_cache

    programs = _linearized_cache._PROGRAMS
    earlier = weakref.WeakSet(programs.keys())
    f = _typed_product([])
    x = jnp.asarray(rand(44, (3,)))
    _, f_jvp = jax.linearize(lambda v: f(v, x), x)
    for _ in range(REPEAT):
        assert_close(f_jvp(x), np.asarray(x, np.float64) ** 2)
    (new,) = (weakref.ref(k) for k in list(programs.keys()) if k not in earlier)
    assert any(callable(p) for p in programs[new()].values())  # compiled, and kept
    del f_jvp
    jax.clear_caches()  # JAX's own (bounded) caches of jaxprs hold their parameters too
    gc.collect()
    assert new() is None


def test_a_linearized_bwd_reading_a_rebound_global_array_runs_afresh():
    """A linearized function whose bwd reads an array from outside its arguments."""
    state = {"w": jnp.full(3, 2.0)}

    @jaxext.custom_vjp
    def f(x):
        return x * state["w"]

    f.defvjp(lambda x: (f(x), None), lambda _, g: (g * state["w"],))
    x = jnp.ones(3)
    _, f_jvp = jax.linearize(f, x)
    for value in (2.0, 5.0, -1.0):
        state["w"] = jnp.full(3, value)
        for _ in range(REPEAT):
            assert_close(f_jvp(x), np.full(3, value))


def test_the_linearized_function_without_the_cache(monkeypatch):
    """With the eager cache off, a linearized function compiles nothing and keeps its values."""
    from jaxext import _linearized_cache

    monkeypatch.setattr(_custom_vjp, "STEPS", _custom_vjp.Steps())  # the caches off
    earlier = weakref.WeakSet(_linearized_cache._PROGRAMS.keys())
    calls = []
    f = _typed_product(calls)
    x, w = jnp.asarray(rand(45, (4,))), jnp.asarray(rand(46, (4,)))
    _, f_jvp = jax.linearize(f, x, w)
    ref = in_float64(lambda *a: a[0] * a[3] + a[2] * a[1], x, w, w, x)
    for _ in range(REPEAT):
        before = len(calls)
        assert_close(f_jvp(w, x), ref)
        assert len(calls) > before  # bwd transposed afresh at every call
    assert all(k in earlier for k in list(_linearized_cache._PROGRAMS.keys()))
