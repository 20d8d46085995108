"""JAX 0.12's logging and accumulating backward rules on ``jaxext.custom_vjp``.

``defvjp_with_logs``, ``defremat_with_logs`` and ``defvjp_with_accums`` exist on
``jaxext.custom_vjp`` exactly where they exist on the installed ``jax.custom_vjp``. Each
test runs the same rules through both (written from the methods' docstrings, as JAX's own
tests of them) and compares with hand-computed values; forward mode, which JAX refuses,
is checked against the transpose of reverse mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxext

METHODS = ("defvjp_with_logs", "defremat_with_logs", "defvjp_with_accums")


def _jax_has(method):
    return hasattr(jax.custom_vjp(lambda x: x), method)


needs = {m: pytest.mark.skipif(not _jax_has(m), reason=f"JAX lacks {m}") for m in METHODS}
IMPLEMENTATIONS = pytest.mark.parametrize(
    "custom_vjp", [jax.custom_vjp, jaxext.custom_vjp], ids=["jax", "jaxext"]
)
X, Y = np.float32(0.5), np.float32(2.0)


@pytest.mark.parametrize("method", METHODS)
def test_the_methods_exist_where_jax_has_them(method):
    jaxext_op = jaxext.custom_vjp(lambda x: x)
    assert hasattr(jaxext_op, method) == _jax_has(method)
    if not _jax_has(method):
        with pytest.raises(AttributeError, match=method):
            getattr(jaxext_op, method)


def _sin_times(custom_vjp):
    @custom_vjp
    def f(x, y):
        return jnp.sin(x) * y

    def bwd(res, g):
        cos_x, sin_x, y = res
        return (cos_x * g * y, sin_x * g), {"g": g, "y": y}

    f.defvjp_with_logs(lambda x, y: (f(x, y), (jnp.cos(x), jnp.sin(x), y)), bwd)
    return f


def _expected_grads(ct):
    return np.cos(X) * Y * ct, np.sin(X) * ct


@needs["defvjp_with_logs"]
@IMPLEMENTATIONS
def test_with_logs_returns_the_logs_and_plain_calls_drop_them(custom_vjp):
    f = _sin_times(custom_vjp)
    out, f_vjp = jax.vjp(f, X, Y)
    np.testing.assert_allclose(out, np.sin(X) * Y, rtol=1e-6)
    grads = f_vjp(np.float32(1.0))
    np.testing.assert_allclose(grads, _expected_grads(1.0), rtol=1e-6)
    grads, logs = f_vjp.with_logs(np.float32(3.0))
    np.testing.assert_allclose(grads, _expected_grads(3.0), rtol=1e-6)
    assert sorted(logs) == ["g", "y"]
    np.testing.assert_array_equal([logs["g"], logs["y"]], [3.0, Y])
    np.testing.assert_allclose(jax.grad(f)(X, Y), _expected_grads(1.0)[0], rtol=1e-6)


@needs["defvjp_with_logs"]
@IMPLEMENTATIONS
def test_with_logs_under_jit_and_vmap(custom_vjp):
    f = _sin_times(custom_vjp)

    @jax.jit
    def pulled(ct):
        return jax.vjp(f, X, Y)[1].with_logs(ct)

    grads, logs = pulled(np.float32(2.0))
    np.testing.assert_allclose(grads, _expected_grads(2.0), rtol=1e-6)
    np.testing.assert_array_equal(logs["g"], 2.0)
    cts = np.array([1.0, -1.0], np.float32)
    grads, logs = jax.vmap(lambda c: jax.vjp(f, X, Y)[1].with_logs(c))(cts)
    np.testing.assert_allclose(grads[0], np.cos(X) * Y * cts, rtol=1e-6)
    np.testing.assert_array_equal(logs["g"], cts)


@needs["defvjp_with_logs"]
@IMPLEMENTATIONS
def test_a_logging_bwd_must_return_a_pair(custom_vjp):
    @custom_vjp
    def f(x):
        return x * 2

    f.defvjp_with_logs(lambda x: (f(x), None), lambda _, g: (2 * g,))
    with pytest.raises(TypeError, match="defvjp_with_logs"):
        jax.grad(f)(X)


@needs["defvjp_with_logs"]
def test_forward_mode_of_a_logging_bwd_is_the_transpose_of_reverse_mode():
    f = _sin_times(jaxext.custom_vjp)
    jac_fwd = jax.jacfwd(f, (0, 1))(X, Y)
    jac_rev = jax.jacrev(f, (0, 1))(X, Y)
    np.testing.assert_allclose(jac_fwd, jac_rev, rtol=1e-6)
    np.testing.assert_allclose(jac_fwd, _expected_grads(1.0), rtol=1e-6)


def _sin_squared(custom_vjp):
    @custom_vjp
    def k(x):
        return jnp.sin(x) ** 2

    k.defremat_with_logs(
        lambda x: (jnp.sin(x) ** 2, jnp.sin(x)),
        lambda s, x: (s**2, 2 * s * jnp.cos(x)),
        lambda d, g: ((g * d,), {"d": d}),
    )
    return k


@needs["defremat_with_logs"]
def test_remat_with_logs_under_checkpoint_and_outside():
    k = _sin_squared(jaxext.custom_vjp)
    for fn in (k, jax.checkpoint(k)):
        (grad,), logs = jax.vjp(fn, X)[1].with_logs(np.float32(1.0))
        np.testing.assert_allclose(grad, np.sin(2 * X), rtol=1e-6)  # 2 sin cos
        np.testing.assert_allclose(logs["d"], np.sin(2 * X), rtol=1e-6)
    np.testing.assert_allclose(jax.jacfwd(k)(X), np.sin(2 * X), rtol=1e-6)


@needs["defremat_with_logs"]
def test_remat_with_logs_as_jax_under_custom_vjp3():
    jax_k = _sin_squared(jax.custom_vjp)
    with jax.custom_vjp3(True) if hasattr(jax, "custom_vjp3") else _custom_vjp3():
        expected = jax.vjp(jax.checkpoint(jax_k), X)[1].with_logs(np.float32(1.0))
    got = jax.vjp(jax.checkpoint(_sin_squared(jaxext.custom_vjp)), X)[1].with_logs(np.float32(1.0))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, expected)


def _custom_vjp3():
    import contextlib

    @contextlib.contextmanager
    def option():
        old = jax.config.jax_custom_vjp3
        jax.config.update("jax_custom_vjp3", True)
        try:
            yield
        finally:
            jax.config.update("jax_custom_vjp3", old)

    return option()


def _product(custom_vjp):
    @custom_vjp
    def h(x, pair):
        return x * pair[0] + pair[1]

    def bwd(res, g, x_acc, pair_acc):
        x, pair = res
        x_acc.accum(g * pair[0])
        pair_acc[0].accum(g * x)
        pair_acc[1].accum(g)
        return {"g": g}

    h.defvjp_with_accums(lambda x, pair: (h(x, pair), (x, pair)), bwd)
    return h


@needs["defvjp_with_accums"]
@IMPLEMENTATIONS
def test_with_accums_gradients_and_logs(custom_vjp):
    h = _product(custom_vjp)
    pair = (Y, np.float32(1.5))
    grads = jax.grad(h, (0, 1))(X, pair)
    np.testing.assert_allclose(jax.tree.leaves(grads), [Y, X, 1.0], rtol=1e-6)
    grads, logs = jax.vjp(h, X, pair)[1].with_logs(np.float32(2.0))
    np.testing.assert_allclose(jax.tree.leaves(grads), [2 * Y, 2 * X, 2.0], rtol=1e-6)
    np.testing.assert_array_equal(logs["g"], 2.0)
    # only x differentiated: the pair's accumulators discard what bwd pushes
    np.testing.assert_allclose(jax.jit(jax.grad(h))(X, pair), Y, rtol=1e-6)


@needs["defvjp_with_accums"]
def test_forward_mode_of_an_accumulating_bwd_is_the_transpose_of_reverse_mode():
    h = _product(jaxext.custom_vjp)
    pair = (Y, np.float32(1.5))
    jac_fwd = jax.jacfwd(h, (0, 1))(X, pair)
    jac_rev = jax.jacrev(h, (0, 1))(X, pair)
    np.testing.assert_allclose(jax.tree.leaves(jac_fwd), jax.tree.leaves(jac_rev), rtol=1e-6)
    np.testing.assert_allclose(jax.tree.leaves(jac_fwd), [Y, X, 1.0], rtol=1e-6)


# -- cases learned from JAX's own tests of defvjp_with_logs (written here) -----------------


@needs["defvjp_with_logs"]
@IMPLEMENTATIONS
def test_logs_of_a_scanned_op_stack_one_entry_per_step(custom_vjp):
    f = _sin_times(custom_vjp)
    xs = np.array([0.5, 1.0, 1.5], np.float32)

    def loop(xs):
        total, _ = jax.lax.scan(lambda c, x: (c + f(x, Y), None), np.float32(0.0), xs)
        return total

    (grads,), logs = jax.vjp(loop, xs)[1].with_logs(np.float32(2.0))
    np.testing.assert_allclose(grads, 2.0 * Y * np.cos(xs), rtol=1e-6)
    np.testing.assert_array_equal(logs["g"], [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(logs["y"], [Y, Y, Y])


@needs["defvjp_with_logs"]
@IMPLEMENTATIONS
def test_logs_with_nondiff_argnums_and_none_logs(custom_vjp):
    scale = custom_vjp(lambda n, x: x * n, nondiff_argnums=(0,))
    scale.defvjp_with_logs(lambda n, x: (scale(n, x), None), lambda n, _, g: ((g * n,), {"n": n}))
    (grad,), logs = jax.vjp(lambda x: scale(np.float32(3.0), x), X)[1].with_logs(np.float32(2.0))
    np.testing.assert_allclose(grad, 6.0, rtol=1e-6)
    np.testing.assert_array_equal(logs["n"], 3.0)

    double = custom_vjp(lambda x: x * 2.0)
    double.defvjp_with_logs(lambda x: (double(x), None), lambda _, g: ((2.0 * g,), None))
    (grad,), logs = jax.vjp(double, X)[1].with_logs(np.float32(1.0))
    np.testing.assert_allclose(grad, 2.0, rtol=1e-6)
    assert logs == {}


@needs["defvjp_with_logs"]
@IMPLEMENTATIONS
def test_logs_that_are_not_a_dict_are_refused(custom_vjp):
    @custom_vjp
    def f(x):
        return x * 2

    f.defvjp_with_logs(lambda x: (f(x), None), lambda _, g: ((2 * g,), [g]))
    with pytest.raises(TypeError, match="None or a dict"):
        jax.grad(f)(X)


@needs["defvjp_with_logs"]
@IMPLEMENTATIONS
def test_logs_through_checkpoint_and_a_batched_primal(custom_vjp):
    f = _sin_times(custom_vjp)
    (grad, _), logs = jax.vjp(jax.checkpoint(lambda x, y: f(x, y) * 3.0), X, Y)[1].with_logs(
        np.float32(1.0)
    )
    np.testing.assert_allclose(grad, 3.0 * np.cos(X) * Y, rtol=1e-6)
    np.testing.assert_allclose(logs["g"], 3.0, rtol=1e-6)
    xs = np.array([0.5, 1.0, 1.5], np.float32)
    (grads,), logs = jax.vjp(lambda x: jax.vmap(f, in_axes=(0, None))(x, Y), xs)[1].with_logs(
        np.ones(3, np.float32)
    )
    np.testing.assert_allclose(grads, Y * np.cos(xs), rtol=1e-6)
    assert logs["g"].shape == (3,)


@needs["defvjp_with_logs"]
def test_forward_mode_of_a_scanned_logging_op_is_the_transpose_of_reverse_mode():
    f = _sin_times(jaxext.custom_vjp)
    xs = np.array([0.5, 1.0, 1.5], np.float32)

    def loop(xs):
        return jax.lax.scan(lambda c, x: (c, f(x, Y)), np.float32(0.0), xs)[1]

    np.testing.assert_allclose(jax.jacfwd(loop)(xs), np.diag(Y * np.cos(xs)), rtol=1e-6)
    np.testing.assert_allclose(jax.jacfwd(loop)(xs), jax.jacrev(loop)(xs), rtol=1e-6)


# -- the JAX internals _bwd_variants.py reads, pinned --------------------------------------


def test_bwd_variant_internals_have_the_forms_this_module_names():
    """The forms ``jaxext/_bwd_variants.py``'s header lists, on the installed JAX."""
    from jax._src.interpreters import ad as jax_ad

    from jaxext import _bwd_variants

    # CustomVJPException (for _rule_contracts.ClosedOverValueError): an Exception class.
    assert issubclass(jax_ad.CustomVJPException, Exception)
    assert issubclass(jaxext.ClosedOverValueError, jax_ad.CustomVJPException)
    # The three methods: all or none, as the installed jax.custom_vjp has them.
    present = [_bwd_variants.jax_has(m) for m in METHODS]
    assert present == [callable(getattr(jax.custom_vjp, m, None)) for m in METHODS]
    if not any(present):  # JAX 0.10: nothing more is read
        assert not _bwd_variants.passes_logs()
        return
    assert all(present) and _bwd_variants.passes_logs()

    # The accumulators: ValAccum sums (ad.Zero before any push), NullAccum discards.
    aval = jax.core.ShapedArray((2,), jnp.float32).to_ct_aval()
    acc, null = jax_ad.ValAccum(aval), jax_ad.NullAccum(aval)
    assert isinstance(acc, jax_ad.GradAccum) and isinstance(null, jax_ad.GradAccum)
    assert type(acc.freeze()) is jax_ad.Zero
    acc.accum(jnp.array([1.0, 2.0]))
    acc.accum(jnp.array([0.5, 0.5]))
    np.testing.assert_array_equal(acc.freeze(), [1.5, 2.5])
    null.accum(jnp.ones(2))
    assert _bwd_variants.is_accumulator(acc) and not _bwd_variants.is_accumulator(jnp.ones(2))

    # fancy_transposes: a rule JAX's backward pass calls with an accumulator for the
    # linear operand, and whose logs it merges into with_logs.
    assert isinstance(jax_ad.fancy_transposes, dict)
    double_p = jax.extend.core.Primitive("jaxext_pin_double")
    double_p.def_impl(lambda x: 2 * x)
    double_p.def_abstract_eval(lambda x: x)
    jax.interpreters.ad.primitive_jvps[double_p] = lambda p, t: (
        double_p.bind(*p),
        double_p.bind(*t),
    )
    seen = []

    def transpose(ct, operand):
        seen.append(type(operand))
        operand.accum(2 * ct)
        return {"ct": ct}

    _bwd_variants.register_logging_transpose(double_p, transpose)
    (grad,), logs = jax.vjp(double_p.bind, X)[1].with_logs(np.float32(3.0))
    assert len(seen) == 1 and issubclass(seen[0], jax_ad.GradAccum)
    np.testing.assert_array_equal([grad, logs["ct"]], [6.0, 3.0])
