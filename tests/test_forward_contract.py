"""Forward mode's contract (issue #45): ``jax.jacfwd`` equals ``jax.jacrev`` entrywise, or
forward mode raises the error that names the op and the remedies; never a third outcome.

- A property test over the project's op table (``tests/ops_table.py``) and the checker
  catalogue's correct ops (plain ``jax.custom_vjp`` ops among them swapped for
  ``jaxext.custom_vjp``, as a user of the drop-in does): float64 ``jacfwd`` against
  ``jacrev``, entrywise.
- One test per way forward mode used to differ from reverse mode silently, or to refuse a
  correct backward: a ``stop_gradient`` in the backward (exact zeros), a guarded backward
  (NaN from a masked branch), a backward nonlinear where the linearity walk did not look
  (``custom_vmap``, a scatter, loops), a ``sort_key_val`` un-permuting the cotangent.
"""

from __future__ import annotations

import checker_ops
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FLOAT64_TOL, assert_close_to_float64, tiered
from jax import lax
from jax.custom_batching import custom_vmap
from ops_table import OPS
from test_checker_catalogue import CORRECT

import jaxext

# -- the property: jacfwd == jacrev over the op table and the catalogue -------------------------


def _swapped(op):
    """A plain ``jax.custom_vjp`` op as the same rules on ``jaxext.custom_vjp``."""
    if not isinstance(op, jax.custom_vjp):
        return op
    new = jaxext.custom_vjp(op.fun, nondiff_argnums=op.nondiff_argnums)
    new.defvjp(op.fwd, op.bwd, symbolic_zeros=op.symbolic_zeros)
    return new


def _is_array(leaf):
    return isinstance(leaf, (np.ndarray, jax.Array))


def _flat_real(fn, args):
    """``fn`` as a function of the real parts (and imaginary parts) of its float array
    leaves, returning its inexact outputs raveled into one real float64 vector."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    diff = [_is_array(x) and jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact) for x in leaves]
    cplx = [d and jnp.iscomplexobj(x) for x, d in zip(leaves, diff, strict=True)]

    def wide(x):
        return jnp.asarray(x, jnp.complex128 if jnp.iscomplexobj(x) else jnp.float64)

    params = []
    for x, d, c in zip(leaves, diff, cplx, strict=True):
        if d:
            params += [wide(x).real, wide(x).imag] if c else [wide(x)]

    def flat(*ps):
        it = iter(ps)
        new = []
        for x, d, c in zip(leaves, diff, cplx, strict=True):
            if not d:
                new.append(x)
            elif c:
                new.append(jax.lax.complex(next(it), next(it)))
            else:
                new.append(next(it))
        out = fn(*jax.tree_util.tree_unflatten(tree, new))
        parts = []
        for o in jax.tree_util.tree_leaves(out):
            if not jnp.issubdtype(jnp.asarray(o).dtype, jnp.inexact):
                continue
            parts += [jnp.real(o).ravel(), jnp.imag(o).ravel()] if jnp.iscomplexobj(o) else [o]
        return jnp.concatenate([jnp.ravel(p).astype(jnp.float64) for p in parts])

    return flat, params


def _cases():
    cases = {}
    for op in OPS:
        for name, build in op.float64_cases.items():
            cases[f"table-{name}"] = build
    for name, (build, *_) in CORRECT.items():
        cases[f"catalogue-{name}"] = build
    return cases


CASES = _cases()
# One case of each kind in the default tier (a jaxext op, a Function, a layer, swapped
# plain custom_vjp ops with symbolic zeros, nondiff_argnums and a while_loop backward,
# once_differentiable); the rest run with -m exhaustive.
DEFAULT = [
    "table-linear-2d-bias",
    "table-Function-MulConstant",
    "table-nnx.Linear-1d-nobias",
    "catalogue-perm_index",
    "catalogue-embedding_int_ids",
    "catalogue-argsort_index_plain_vjp",
    "catalogue-nondiff_argnums",
    "catalogue-symbolic_zeros_two_outputs",
    "catalogue-fixed_point_backward",
    "catalogue-once_differentiable",
    "catalogue-perturbed_residuals_done_right",
]


@pytest.mark.parametrize("name", tiered(list(CASES), default=DEFAULT))
def test_jacfwd_equals_jacrev(name, x64):
    fn, args = CASES[name]()
    flat, params = _flat_real(_swapped(fn), args)
    argnums = tuple(range(len(params)))
    rev = jax.jacrev(flat, argnums=argnums)(*params)
    fwd = jax.jacfwd(flat, argnums=argnums)(*params)
    for r, f in zip(rev, fwd, strict=True):
        r, f = np.asarray(r), np.asarray(f)
        scale = max(1.0, float(np.max(np.abs(r[np.isfinite(r)]), initial=0.0)))
        np.testing.assert_allclose(f, r, rtol=FLOAT64_TOL, atol=FLOAT64_TOL * scale)


# -- the silent differences and the false refusal, each fixed --------------------------------


def _op(primal, bwd, *, residual=lambda x: x, transposed=True):
    """A ``jaxext.custom_vjp`` op; ``transposed``: row by row off, so that forward mode must
    transpose the backward (ways 1 and 2 of ``_jvp_from_vjp``)."""
    op = jaxext.custom_vjp(primal, forward_mode_max_outputs=0 if transposed else 4096)
    op.defvjp(lambda x: (primal(x), residual(x)), bwd)
    return op


def _assert_forward_is_reverse(op, x, t):
    """jvp, jit(jvp) and jacfwd against jacrev (float64, entrywise)."""
    jac = np.asarray(jax.jacrev(op)(x))
    tol = dict(rtol=FLOAT64_TOL, atol=FLOAT64_TOL)
    np.testing.assert_allclose(jax.jacfwd(op)(x), jac, **tol)
    np.testing.assert_allclose(jax.jit(jax.jacfwd(op))(x), jac, **tol)
    np.testing.assert_allclose(jax.jvp(op, (x,), (t,))[1], jac @ np.asarray(t), **tol)
    jitted = jax.jit(lambda x, t: jax.jvp(op, (x,), (t,))[1])(x, t)
    np.testing.assert_allclose(jitted, jac @ np.asarray(t), **tol)
    return jac


def test_stop_gradient_in_the_backward_is_its_value(x64):
    """``cos(x) * stop_gradient(g)`` (``grad_output.detach()``): exact zeros before."""
    op = _op(jnp.sin, lambda x, g: (jnp.cos(x) * lax.stop_gradient(g),))
    x, t = jnp.array([0.3, 1.0, 2.0]), jnp.array([0.5, -1.0, 0.25])
    jac = _assert_forward_is_reverse(op, x, t)
    np.testing.assert_allclose(np.diag(jac), np.cos(x), rtol=1e-15)  # reverse mode is right


def test_custom_jvp_in_the_backward_is_transposed_by_its_values(x64):
    """A call inside the backward whose custom JVP rule is not its values' derivative: the
    backward computes ``2 g``, and forward mode must give what the backward computes."""

    @jax.custom_jvp
    def double(g):
        return 2.0 * g

    double.defjvp(lambda p, t: (double(p[0]), 3.0 * t[0]))  # a different derivative
    op = _op(lambda x: 2.0 * x, lambda _, g: (double(g),))
    x, t = jnp.array([0.3, 1.0, 2.0]), jnp.array([0.5, -1.0, 0.25])
    jac = _assert_forward_is_reverse(op, x, t)
    np.testing.assert_allclose(jac, 2.0 * np.eye(3), rtol=1e-15)


def _safe_sqrt_op():
    def primal(x):
        return jnp.where(x > 0, jnp.sqrt(jnp.where(x > 0, x, 1.0)), 0.0)

    return _op(primal, lambda x, g: (jnp.where(x > 0, g * 0.5 / jnp.sqrt(x), 0.0),))


def test_masked_branch_gives_no_nan(x64):
    """A guarded backward at x = 0 (its masked branch is inf there): NaN before."""
    op, x = _safe_sqrt_op(), jnp.array([0.0, 1.0, 4.0])
    jac = _assert_forward_is_reverse(op, x, jnp.array([0.0, 1.0, 1.0]))
    np.testing.assert_array_equal(jac, np.diag([0.0, 0.5, 0.25]))
    _assert_forward_is_reverse(op, x, jnp.array([1.0, 1.0, 1.0]))
    # Batched tangents (vmap of jvp) take the zero-safe product's batching rule.
    ts = jnp.eye(3)
    batched = jax.vmap(lambda t: jax.jvp(op, (x,), (t,))[1])(ts)
    np.testing.assert_array_equal(batched, jac.T)
    # Second order: the tangent's derivative in the residual x (jacfwd of jacfwd).
    hess = jax.jacfwd(jax.jacfwd(op))(jnp.array([1.0, 4.0]))
    np.testing.assert_allclose(hess, jax.jacfwd(jax.jacrev(op))(jnp.array([1.0, 4.0])))


def _assert_nan_only_where_reverse_has_one(op, x):
    rev, fwd = np.asarray(jax.jacrev(op)(x)), np.asarray(jax.jacfwd(op)(x))
    assert np.isnan(rev).any()
    assert not (np.isnan(fwd) & ~np.isnan(rev)).any()
    np.testing.assert_array_equal(fwd[~np.isnan(rev)], rev[~np.isnan(rev)])


INF_COEFFICIENT = jnp.array([1.0, jnp.inf, 2.0])


def test_nan_only_where_reverse_mode_has_one(x64):
    """An unguarded infinite coefficient: reverse mode's rows hold NaN (0 * inf) off the
    diagonal; forward mode gives reverse mode's number wherever that is not NaN, and NaN
    nowhere else."""
    c = INF_COEFFICIENT
    _assert_nan_only_where_reverse_has_one(
        _op(lambda x: x * c, lambda _, g: (g * c,)), jnp.array([0.3, 1.0, 2.0])
    )


def test_nan_only_where_reverse_mode_has_one_row_by_row(x64):
    """The same, row by row (a while_loop backward, which JAX cannot transpose): a zero
    tangent entry meets a NaN entry of a row as zero."""
    c = INF_COEFFICIENT

    def bwd(_, g):
        return (lax.while_loop(lambda s: s[0] < 1, lambda s: (s[0] + 1, s[1] * c), (0, g))[1],)

    op = _op(lambda x: x * c, bwd, transposed=False)
    _assert_nan_only_where_reverse_has_one(op, jnp.array([0.3, 1.0, 2.0]))


def _clip(g):
    return jnp.clip(g, -0.1, 0.1)


@custom_vmap
def _vmapped_clip(g):
    return _clip(g)


_vmapped_clip.def_vmap(lambda n, in_batched, g: (_vmapped_clip(g), in_batched[0]))


NONLINEAR_BACKWARDS = {
    "clip-in-custom_vmap": lambda g: _vmapped_clip(g),
    "affine-at-set": lambda g: jnp.ones(3).at[0].set(g[0]),
    "clip-in-while_loop": lambda g: lax.fori_loop(0, 2, lambda i, a: _clip(a), g),
    "clip-in-scan": lambda g: lax.scan(lambda a, _: (_clip(a), None), g, None, length=2)[0],
    "affine-in-scan": lambda g: lax.scan(lambda a, _: (2 * a + 1, None), g, None, length=2)[0],
    "rounded-to-int": lambda g: g.astype(jnp.int32).astype(g.dtype),
}


@pytest.mark.parametrize("name", list(NONLINEAR_BACKWARDS))
def test_nonlinear_backward_is_refused_with_the_remedies(name, x64):
    """Linearized or evaluated row by row before (0.1x the derivative for a clip)."""
    backward = NONLINEAR_BACKWARDS[name]

    def clipped(x):
        return x

    op = _op(clipped, lambda _, g: (backward(g),), residual=lambda x: None, transposed=False)
    x = jnp.array([0.3, 1.0, 2.0])
    jax.jacrev(op)(x)  # reverse mode works
    for forward in (lambda: jax.jvp(op, (x,), (x,)), lambda: jax.jit(jax.jacfwd(op))(x)):
        with pytest.raises(jaxext.RuleTypeError, match="jvp=jvp") as info:
            forward()
        assert "`clipped`" in str(info.value) and "differentiate_fwd=True" in str(info.value)


def test_linear_loops_keep_forward_mode(x64):
    """Loops linear in the cotangent are not refused: a scan, a while_loop."""
    for backward in (
        lambda g: lax.scan(lambda a, _: (2 * a, None), g, None, length=2)[0],
        lambda g: lax.fori_loop(0, 2, lambda i, a: 2 * a, g),
    ):
        op = _op(lambda x: 4 * x, lambda _, g, b=backward: (b(g),), transposed=False)
        jac = _assert_forward_is_reverse(op, jnp.array([0.3, 1.0, 2.0]), jnp.ones(3))
        np.testing.assert_array_equal(jac, 4 * np.eye(3))


def test_sort_key_val_unpermuting_the_cotangent_is_linear(x64):
    """MoE-style dispatch: refused before ("uses the cotangent nonlinearly (in `sort`)")."""
    perm = jnp.array([2, 0, 3, 1])
    op = _op(lambda x: x[perm], lambda _, g: (lax.sort_key_val(perm, g)[1],))
    x = jnp.array([0.3, 1.0, 2.0, -1.5])
    jac = _assert_forward_is_reverse(op, x, jnp.array([0.5, -1.0, 0.25, 2.0]))
    np.testing.assert_array_equal(jac, np.eye(4)[np.asarray(perm)])


def test_sort_key_val_with_cotangent_keys_is_refused(x64):
    """Sorting by the cotangent itself is nonlinear, and still refused."""
    op = _op(lambda x: x, lambda _, g: (lax.sort_key_val(g, g)[1],), residual=lambda x: None)
    with pytest.raises(jaxext.RuleTypeError, match="sort"):
        jax.jvp(op, (jnp.array([0.3, 1.0]),), (jnp.ones(2),))


# -- the zero-safe product's shapes: a cotangent broadcast over size-1 dimensions -------------


def test_product_broadcasting_a_size_one_dimension_lowers(x64):
    """``jnp.sum(g[:, None] * x, 0)`` multiplies f32[3,1] by f32[3,4]: the zero-safe product
    took the shape of its first operand, and ``jit(jvp)`` failed to lower ("'stablehlo.reduce'
    ... tensor<4xf32> vs tensor<1xf32>"). Float64, against jacrev of plain ``x @ w``."""

    # forward_mode_max_outputs=0: transposed, not row by row.
    matvec = jaxext.custom_vjp(lambda x, w: x @ w, forward_mode_max_outputs=0)
    matvec.defvjp(
        lambda x, w: (x @ w, (x, w)),
        lambda res, g: (g[:, None] * res[1][None, :], jnp.sum(g[:, None] * res[0], 0)),
    )
    x, w = jnp.asarray(checker_ops.f64(0, (3, 4))), jnp.asarray(checker_ops.f64(1, (4,)))
    tx, tw = jnp.asarray(checker_ops.f64(2, (3, 4))), jnp.asarray(checker_ops.f64(3, (4,)))
    jx, jw = jax.jacrev(lambda x, w: x @ w, argnums=(0, 1))(x, w)
    expected = np.einsum("kij,ij->k", jx, tx) + jw @ tw
    tol = dict(rtol=FLOAT64_TOL, atol=FLOAT64_TOL)
    jitted = jax.jit(lambda *a: jax.jvp(matvec, a[:2], a[2:])[1])(x, w, tx, tw)
    np.testing.assert_allclose(jitted, expected, **tol)
    fx, fw = jax.jit(jax.jacfwd(matvec, argnums=(0, 1)))(x, w)
    np.testing.assert_allclose(fx, jx, **tol)
    np.testing.assert_allclose(fw, jw, **tol)
    # Batched tangents: the product's batching rule, with the broadcast dimension.
    ts = jnp.stack([tw, 2 * tw])
    batched = jax.jit(jax.vmap(lambda t: jax.jvp(matvec, (x, w), (jnp.zeros_like(x), t))[1]))(ts)
    np.testing.assert_allclose(batched, np.stack([jw @ tw, 2 * (jw @ tw)]), **tol)


def test_float32_loop_carry_op_jit_jvp_lowers():
    """The catalogue's float32 op (fori_loop primal, the bwd above): ``jit(jvp)`` and
    ``jit(jacfwd)`` against float64 ``jacrev`` of ``x @ w``, at float32's tolerance."""
    op, (x, w) = checker_ops.loop_carry_float32()
    x, w = jnp.asarray(x), jnp.asarray(w)
    tx, tw = jnp.ones_like(x), jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32)
    with jax.enable_x64(True):
        x64_, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
        jx, jw = (np.asarray(j) for j in jax.jacrev(jnp.matmul, argnums=(0, 1))(x64_, w64))
    expected = np.einsum("kij,ij->k", jx, np.asarray(tx, np.float64)) + jw @ np.asarray(tw)
    jitted = jax.jit(lambda *a: jax.jvp(op, a[:2], a[2:])[1])(x, w, tx, tw)
    assert_close_to_float64(jitted, expected, n=8)
    fx, fw = jax.jit(jax.jacfwd(op, argnums=(0, 1)))(x, w)
    assert_close_to_float64(fx, jx)
    assert_close_to_float64(fw, jw)


# -- loops and branches of the backward, re-run by their values ------------------------------


@jax.custom_jvp
def _double(g):
    return 2.0 * g


_double.defjvp(lambda p, t: (_double(p[0]), 3.0 * t[0]))  # not the derivative of its values

# Steps linear in the cotangent ``g`` whose derivative rules differ from their values.
BODY_STEPS = {
    "stop_gradient": lambda x, g: jnp.cos(x) * lax.stop_gradient(g),
    "custom_jvp": lambda x, g: jnp.cos(x) * _double(g),
    "masked": lambda x, g: jnp.where(x > 0, g * 0.5 / jnp.sqrt(x), 0.0),  # inf at x = 0
}
# Constructs JAX transposes by their own rules, each running a step in its body.
CONSTRUCTS = {
    "cond": lambda f, x, g: lax.cond(x[1] > 0, lambda g: f(x, g), lambda g: 2 * g, g),
    "switch": lambda f, x, g: lax.switch(
        jnp.int32(2), [lambda g: -g, lambda g: 2 * g, lambda g: f(x, g)], g
    ),
    "scan": lambda f, x, g: lax.scan(lambda a, _: (f(x, a), None), g, None, length=2)[0],
    "scan-xs": lambda f, x, g: lax.scan(lambda c, gi: (c, f(x, gi)), 0.0, jnp.stack([g, g]))[1][1],
    "fori_loop": lambda f, x, g: lax.fori_loop(0, 2, lambda i, a: f(x, a), g),
    "scan-in-cond": lambda f, x, g: lax.cond(
        x[1] > 0, lambda g: CONSTRUCTS["scan"](f, x, g), jnp.negative, g
    ),
}


def _in_body_op(construct, step):
    return _op(
        lambda x: x, lambda x, g: (CONSTRUCTS[construct](BODY_STEPS[step], x, g),), transposed=True
    )


# Each construct once and each step twice in the default tier; the rest with -m exhaustive.
_STEP_CELLS = [(c, s) for c in CONSTRUCTS for s in BODY_STEPS]
_STEP_DEFAULT = [(c, list(BODY_STEPS)[i % len(BODY_STEPS)]) for i, c in enumerate(CONSTRUCTS)]


@pytest.mark.parametrize("cell", tiered(_STEP_CELLS, default=_STEP_DEFAULT, ids="-".join))
def test_step_inside_a_loop_or_branch_is_transposed_by_its_values(cell, x64):
    """A ``stop_gradient``, a custom_jvp call or a masked product inside a ``cond`` branch or
    a ``scan``/``fori_loop`` body: exact zeros (the derivative 0 of ``stop_gradient``), the
    custom rule's number or NaN before; reverse mode's numbers now (jacrev entrywise)."""
    op = _in_body_op(*cell)
    x, t = jnp.array([0.0, 1.0, 4.0]), jnp.array([0.0, -1.0, 0.25])
    jac = _assert_forward_is_reverse(op, x, t)
    assert np.isfinite(jac).all()
    assert np.count_nonzero(np.diag(jac)) >= 2  # not the silent zero


WHILE_BACKWARDS = {
    "while_loop": lambda f, x, g: lax.while_loop(
        lambda s: s[0] < 2, lambda s: (s[0] + 1, f(x, s[1])), (0, g)
    )[1],
    # A trip count read from a residual.
    "while_loop-residual": lambda f, x, g: lax.while_loop(
        lambda s: s[0] < x[2], lambda s: (s[0] + 2.0, f(x, s[1])), (0.0, g)
    )[1],
}


@pytest.mark.parametrize(
    "cell",
    tiered(
        [(w, s) for w in WHILE_BACKWARDS for s in BODY_STEPS],
        default=[("while_loop", "stop_gradient"), ("while_loop-residual", "masked")],
        ids="-".join,
    ),
)
def test_step_inside_a_while_loop_is_reverse_mode_or_the_named_error(cell, x64):
    """JAX transposes no ``while_loop``: row by row gives reverse mode's numbers; with that
    off, the named error (never a number)."""
    loop, step = cell
    backward = WHILE_BACKWARDS[loop]
    x, t = jnp.array([0.0, 1.0, 4.0]), jnp.array([0.0, -1.0, 0.25])

    def bwd(x, g):
        return (backward(BODY_STEPS[step], x, g),)

    _assert_forward_is_reverse(_op(lambda x: x, bwd, transposed=False), x, t)
    op = _op(lambda x: x, bwd, transposed=True)
    with pytest.raises(TypeError, match="differentiate_fwd=True"):
        jax.jvp(op, (x,), (t,))
    with pytest.raises(TypeError, match="differentiate_fwd=True"):
        jax.jit(jax.jacfwd(op))(x)


# -- products inside dot_general, zero-safe ---------------------------------------------------


def _half_rsqrt_diag(x):
    """``diag(0.5 / sqrt(x))``: infinite where ``x = 0``, exact zeros off the diagonal."""
    return jnp.diag(0.5 / jnp.sqrt(x))


# Guarded backwards whose masked branch reaches a matmul: ``g @ diag(0.5 / sqrt(x))`` holds
# ``0 * inf`` at x = 0 in the transpose (the mask sends a zero back); reverse mode is finite.
MASKED_MATMULS = {
    "matmul": lambda x, g: jnp.where(x > 0, g @ _half_rsqrt_diag(x), 0.0),
    "dot-linear-rhs": lambda x, g: jnp.where(x > 0, jnp.dot(_half_rsqrt_diag(x), g), 0.0),
    "einsum": lambda x, g: jnp.where(x > 0, jnp.einsum("i,ij->j", g, _half_rsqrt_diag(x)), 0.0),
    "einsum-batched": lambda x, g: jnp.where(
        x > 0,
        jnp.einsum("bi,bij->bj", g.reshape(1, 3), _half_rsqrt_diag(x)[None]).reshape(3),
        0.0,
    ),
    "in-scan": lambda x, g: lax.scan(
        lambda a, _: (jnp.where(x > 0, a @ _half_rsqrt_diag(x), 0.0), None), g, None, length=1
    )[0],
}


@pytest.mark.parametrize("name", tiered(list(MASKED_MATMULS), default=["matmul", "in-scan"]))
def test_masked_branch_reaching_a_matmul_gives_no_nan(name, x64):
    """The guarded backward's NaN of ``test_masked_branch_gives_no_nan``, through a
    ``dot_general`` (``@``, ``jnp.dot``, ``einsum``): NaN in row 0 of jacfwd before."""
    bwd = MASKED_MATMULS[name]
    op = _op(
        lambda x: jnp.where(x > 0, jnp.sqrt(jnp.where(x > 0, x, 1.0)), 0.0),
        lambda x, g: (bwd(x, g),),
    )
    x = jnp.array([0.0, 1.0, 4.0])
    jac = _assert_forward_is_reverse(op, x, jnp.array([0.0, 1.0, 1.0]))
    np.testing.assert_array_equal(jac, np.diag([0.0, 0.5, 0.25]))
    _assert_forward_is_reverse(op, x, jnp.array([1.0, 1.0, 1.0]))
    batched = jax.vmap(lambda t: jax.jvp(op, (x,), (t,))[1])(jnp.eye(3))
    np.testing.assert_array_equal(batched, jac.T)
    # Second order: the tangent's derivative in the residual x, through the lax.cond.
    y = jnp.array([1.0, 4.0, 9.0])
    hess = jax.jit(jax.jacfwd(jax.jacfwd(op)))(y)
    np.testing.assert_allclose(hess, jax.jacfwd(jax.jacrev(op))(y), rtol=FLOAT64_TOL)


INF_MATRIX = jnp.array([[1.0, jnp.inf, 0.0], [2.0, 3.0, -jnp.inf], [0.5, 0.0, 4.0]])


@pytest.mark.parametrize(
    "bwd",
    [lambda _, g: (g @ INF_MATRIX,), lambda _, g: (INF_MATRIX @ g,)],
    ids=["linear-lhs", "linear-rhs"],
)
def test_matmul_nan_only_where_reverse_mode_has_one(bwd, x64):
    """An unguarded infinite matrix entry: reverse mode's rows hold NaN (0 * inf) where
    another row meets it; forward mode gives reverse mode's numbers wherever those are not
    NaN (inf included), and NaN nowhere else."""
    x = jnp.array([0.3, 1.0, 2.0])
    op = _op(lambda x: x, bwd, residual=lambda x: None)
    _assert_nan_only_where_reverse_has_one(op, x)
    rev, fwd = np.asarray(jax.jacrev(op)(x)), np.asarray(jax.jit(jax.jacfwd(op))(x))
    assert np.isinf(rev).any()
    np.testing.assert_array_equal(fwd[~np.isnan(rev)], rev[~np.isnan(rev)])


def test_forward_mode_of_a_large_matmul_allocates_no_broadcast_product():
    """A zero-safe product sums its non-finite entries from a (rows, columns, contracting)
    broadcast: a 512^3 linear's jit(jvp) held 1.5 GiB of temporaries for it (and XLA
    allocates a conditional's larger branch whether it runs or not). Past
    SAFE_DOT_MAX_ENTRIES the product runs as written: temporaries of its operands' order."""
    n = 512
    x = jax.ShapeDtypeStruct((n, n), jnp.float32)
    b = jax.ShapeDtypeStruct((n,), jnp.float32)
    jvp = jax.jit(lambda *a: jax.jvp(jaxext.linear, a[:3], a[3:]))
    memory = jvp.lower(x, x, b, x, x, b).compile().memory_analysis()
    if memory is None:
        pytest.skip("this backend reports no memory analysis")
    assert memory.temp_size_in_bytes <= 4 * n * n * 4, memory.temp_size_in_bytes
    # Under jacfwd each tangent has its own broadcast: a 32x32 linear held 280 MiB against
    # plain autodiff's 24 MiB with a bound of 2**18 entries; past 2**14 it runs as written.
    n = 32
    args = (jnp.ones((n, n)), jnp.ones((n, n)), jnp.ones(n))
    ours = jax.jit(jax.jacfwd(jaxext.linear, (0, 1))).lower(*args).compile()
    plain = jax.jit(jax.jacfwd(lambda x, w, b: x @ w.T + b, (0, 1))).lower(*args).compile()
    ratio = ours.memory_analysis().temp_size_in_bytes / plain.memory_analysis().temp_size_in_bytes
    assert ratio <= 2.5, ratio


def _host_double():
    """``2 g`` computed on the host, as a ``jaxext.custom_vjp`` op whose rules JAX can
    transpose (its primal it cannot)."""

    def host(g):
        shape = jax.ShapeDtypeStruct(g.shape, g.dtype)
        return jax.pure_callback(lambda g: 2 * g, shape, g, vmap_method="sequential")

    op = jaxext.custom_vjp(host)
    op.defvjp(lambda g: (host(g), None), lambda _, ct: (2 * ct,))
    return op


def test_stop_gradient_beside_a_trusted_custom_rule_is_its_value(x64):
    """Way 4 (the custom rules of a call whose primal JAX cannot transpose, past the
    row-by-row limit) read ``stop_gradient`` by its derivative: exact zeros before."""
    double = _host_double()
    op = _op(jnp.sin, lambda x, g: (jnp.cos(x) * double(lax.stop_gradient(g)) / 2,))
    x, t = jnp.array([0.3, 1.0, 2.0]), jnp.array([0.5, -1.0, 0.25])
    jac = _assert_forward_is_reverse(op, x, t)
    np.testing.assert_allclose(np.diag(jac), np.cos(x), rtol=1e-15)


def _in_shard_map(step):
    """``step`` inside a ``shard_map`` over a one-device mesh: a construct carrying a jaxpr
    that forward mode does not rebuild."""
    from jax.sharding import PartitionSpec

    mesh = jax.make_mesh((1,), ("d",))
    spec = PartitionSpec()  # replicated
    return lambda x, g: jax.shard_map(step, mesh=mesh, in_specs=(spec, spec), out_specs=spec)(x, g)


@pytest.mark.parametrize("step", ["stop_gradient", "custom_jvp"])
def test_step_inside_an_unrebuilt_construct_is_reverse_mode_or_the_named_error(step, x64):
    """A ``shard_map`` body is transposed by JAX's rules: a ``stop_gradient`` in it gave
    exact zeros. Row by row gives reverse mode's numbers; with that off, the named error."""
    bwd = _in_shard_map(BODY_STEPS[step])
    x, t = jnp.array([0.0, 1.0, 4.0]), jnp.array([0.0, -1.0, 0.25])
    _assert_forward_is_reverse(_op(jnp.sin, lambda x, g: (bwd(x, g),), transposed=False), x, t)
    op = _op(jnp.sin, lambda x, g: (bwd(x, g),), transposed=True)
    with pytest.raises(TypeError, match="forward mode cannot rebuild a `shard_map`"):
        jax.jvp(op, (x,), (t,))


# -- what stays trusted: exactly what docs/limitations.md lists ------------------------------


def _host_clip(g):
    shape = jax.ShapeDtypeStruct(g.shape, g.dtype)
    return jax.pure_callback(lambda g: np.clip(g, -0.1, 0.1), shape, g, vmap_method="sequential")


def _ffi_clip(g):  # traced only: the target is never run
    shape = jax.ShapeDtypeStruct(g.shape, g.dtype)
    return jax.ffi.ffi_call("jaxext_test_clip", shape, vmap_method="sequential")(g)


def _pallas_clip(g):
    from jax.experimental import pallas as pl

    def kernel(g_ref, o_ref):
        o_ref[...] = _clip(g_ref[...])

    shape = jax.ShapeDtypeStruct(g.shape, g.dtype)
    return pl.pallas_call(kernel, out_shape=shape, interpret=True)(g)


def _halve_until_small(g):  # a trip count that depends on g
    return lax.while_loop(lambda c: jnp.sum(c**2) > 1.0, lambda c: c / 2, g)


# Backwards nonlinear in g where the linearity walk cannot see, each keyed by the words
# docs/limitations.md's trusted list names it by: forward mode does not refuse them.
TRUSTED = {
    "`jax.pure_callback`": lambda r, g: _host_clip(g),
    "`jax.ffi.ffi_call`": lambda r, g: _ffi_clip(g),
    "`pallas_call`": lambda r, g: _pallas_clip(g),
    "trip count depends on `g`": lambda r, g: _halve_until_small(g),
    "a residual your `fwd` saved": lambda r, g: r.at[:].add(g),  # g + 1: affine
}
# The same nonlinearities written where the walk sees them: refused.
SEEN = {
    "clip": lambda r, g: _clip(g),
    "clip-in-shard_map": lambda r, g: _in_shard_map(lambda r, g: _clip(g))(r, g),
    "square-in-scan": lambda r, g: lax.scan(lambda c, _: (c * c, None), g, None, length=1)[0],
    "affine-in-bwd": lambda r, g: jnp.ones(3).at[:].add(g),
}


def _nonlinear_op(bwd):
    op = jaxext.custom_vjp(lambda x: x)
    op.defvjp(lambda x: (x, jnp.ones_like(x)), lambda r, g: (bwd(r, g),))
    return op


@pytest.mark.parametrize("name", list(TRUSTED))
def test_trusted_items_are_exactly_the_documented_ones(name):
    """Each trusted item passes forward mode's linearity check though it is nonlinear in g
    (lowered, not run), and docs/limitations.md lists it; the walk refuses what it sees."""
    from pathlib import Path

    op = _nonlinear_op(TRUSTED[name])
    jax.jit(lambda x: jax.jvp(op, (x,), (x,))).lower(jnp.ones(3))  # no RuleTypeError
    page = (Path(__file__).parent.parent / "docs" / "limitations.md").read_text()
    trusted = page.split("What remains **trusted**", 1)[1].split("Everything else", 1)[0]
    bullets = trusted.split("\n- ")[1:]
    assert len(bullets) == len(TRUSTED) + 1  # + the custom rules of path 4
    assert sum(name in b for b in bullets) == 1, name


@pytest.mark.parametrize("name", list(SEEN))
def test_nonlinearity_the_walk_sees_is_refused(name):
    op = _nonlinear_op(SEEN[name])
    with pytest.raises(jaxext.RuleTypeError, match="differentiate_fwd=True"):
        jax.jit(lambda x: jax.jvp(op, (x,), (x,))).lower(jnp.ones(3))
