"""Helpers shared by the test modules: independent references and comparisons."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

import jaxext


def reference_linear(x, weight, bias=None):
    """Plain-jnp ``x @ weight.T + bias``: differentiated by JAX's own autodiff."""
    y = jnp.matmul(x, weight.T)
    return y if bias is None else y + bias


def rand(key_or_seed, shape, dtype=np.float32):
    """Deterministic standard-normal NumPy data of ``shape`` and ``dtype``."""
    rng = np.random.default_rng(key_or_seed)
    return rng.standard_normal(shape).astype(dtype)


# -- comparisons: one family, one tolerance rule -----------------------------------------
#
# An approximate comparison holds a result computed in its own dtype against a float64
# reference of the same math (``in_float64``, NumPy float64 formulas, float64 autodiff
# or PyTorch in float64), at the tolerance :func:`rounding_tolerance` derives from the
# dtype the result was rounded in and the length of the sums behind it:
#
# - :func:`assert_close_to_float64`: arrays; ``rtol`` is the rule, ``atol`` the same
#   fraction of the reference's largest entry.
# - :func:`assert_trees_close`: pytrees of float64 results against float64 references
#   (hand-written rules against autodiff): :data:`FLOAT64_TOL`, the rule at ``K_FLOAT64``.
# - :func:`assert_trees_equal`: bit-identical, for the same program on both sides.
# - :func:`assert_close`: the primitive under them, with explicit bounds, for values that
#   are exact or bounded by hand where it is called (exact sums, a derived error bound).
#
# No comparison here is tighter than what a float32 result needs against float64 on any
# CPU (fused or not, any vector width, any summation order).


def rounding_tolerance(dtype, n=1, *, k=8.0):
    """Relative tolerance for a ``dtype`` computation against a float64 reference.

    A length-``n`` sum of products rounded in ``dtype`` differs from the exact one by
    about ``sqrt(n) * eps`` relative to the size of its terms (rounding errors add up
    like a random walk; the worst case is ``n * eps``). ``k`` covers the few roundings
    around the sum and the conditioning of a small, well-scaled problem. Any two
    programs (fused or not, any vector width, any summation order) land within it.
    """
    eps = float(jnp.finfo(dtype).eps)
    return k * eps * float(np.sqrt(max(n, 1)))


# Two float64 programs of the same math (a hand-written rule against autodiff, or against
# a NumPy formula) on the tests' small problems differ by far fewer than the 4504 float64
# roundings this allows (4504 eps = 1.0001e-12).
K_FLOAT64 = 4504.0
FLOAT64_TOL = rounding_tolerance(np.float64, k=K_FLOAT64)


def assert_close(actual, expected, *, rtol=1e-6, atol=1e-6, err_msg=""):
    """``np.testing.assert_allclose`` after moving both sides to float64 NumPy."""
    np.testing.assert_allclose(
        np.asarray(actual, dtype=np.float64),
        np.asarray(expected, dtype=np.float64),
        rtol=rtol,
        atol=atol,
        err_msg=err_msg,
    )


def coarsest(*dtypes):
    """The floating dtype with the largest epsilon among ``dtypes`` (``None`` and
    non-floating ones skipped): what a computation mixing them rounds in, at worst."""
    floats = [jnp.dtype(d) for d in dtypes if d is not None and jnp.issubdtype(d, jnp.floating)]
    return max(floats, key=lambda d: float(jnp.finfo(d).eps))


def assert_close_to_float64(actual, reference, *, n=1, k=8.0, dtype=None, err_msg=""):
    """``actual`` (computed in its own dtype) vs a float64 ``reference`` of the same math.

    ``rtol`` is :func:`rounding_tolerance` of ``dtype`` (by default ``actual``'s dtype;
    pass the coarsest dtype the computation rounded in where that is coarser, see
    :func:`coarsest`); ``atol`` is the same fraction of the largest reference entry
    (entries that nearly cancel are held to the scale of the problem, not to their own
    tiny size).
    """
    actual = np.asarray(actual)
    reference = np.asarray(reference, np.float64)
    tol = rounding_tolerance(actual.dtype if dtype is None else dtype, n, k=k)
    scale = float(np.max(np.abs(reference))) if reference.size else 0.0
    assert_close(actual, reference, rtol=tol, atol=tol * max(scale, 1e-30), err_msg=err_msg)


def assert_trees_close(actual, expected, *, tol=FLOAT64_TOL, same_dtypes=False, err_msg=""):
    """Same tree structure, each float64 leaf within ``tol`` (relative and absolute) of
    the float64 reference's; ``tol=0`` asks for equal values. ``same_dtypes`` also asks
    each pair of leaves for the same shape and dtype."""
    leaves_a, tree_a = jax.tree.flatten(actual)
    leaves_e, tree_e = jax.tree.flatten(expected)
    assert tree_a == tree_e, err_msg
    for a, e in zip(leaves_a, leaves_e, strict=True):
        if same_dtypes:
            what = (err_msg, a.shape, a.dtype, e.shape, e.dtype)
            assert a.shape == e.shape and a.dtype == e.dtype, what
        assert_close(a, e, rtol=tol, atol=tol, err_msg=err_msg)


def assert_trees_equal(actual, expected):
    """Same tree structure, and every leaf bit-identical with the same dtype and shape."""
    leaves_a, tree_a = jax.tree.flatten(actual)
    leaves_e, tree_e = jax.tree.flatten(expected)
    assert tree_a == tree_e
    for a, e in zip(leaves_a, leaves_e, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(e, np.float64))


def assert_first_and_second_order_close(actual, expected, *, tol=FLOAT64_TOL):
    """Compares ``(grads, hessian rows)`` pairs from two float64 implementations."""
    (grads, hess), (grads_ref, hess_ref) = actual, expected
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert_close(g, g_ref, rtol=tol, atol=tol)
    for row, row_ref in zip(hess, hess_ref, strict=True):
        for h, h_ref in zip(row, row_ref, strict=True):
            assert h.shape == h_ref.shape
            assert_close(h, h_ref, rtol=tol, atol=tol)


def assert_bias_grad_exact_and_right(g_bias, g_bias_ref, y_ref):
    """Bias gradient of a layer vs flax's (bit-identical) and vs a float64 reference.

    The loss is ``sum(sin(y.astype(float32)))``; the reference sums its output cotangent
    over the batch axes in float64, at the tolerance of the coarsest dtype the layer
    rounds in (bfloat16 where the output or the gradient is), while the comparison with
    flax stays exact.
    """
    assert g_bias.dtype == g_bias_ref.dtype and g_bias.shape == g_bias_ref.shape
    # Bit-identical to flax, bfloat16 compute included: the backward reduces the
    # cotangent in its own dtype, as autodiff's transpose of the broadcast does.
    np.testing.assert_array_equal(
        np.asarray(g_bias, np.float64), np.asarray(g_bias_ref, np.float64)
    )
    g_y = jax.grad(lambda y: jnp.sum(jnp.sin(y.astype(jnp.float32))))(y_ref)
    g_y = np.asarray(g_y.astype(jnp.float32), np.float64)
    expected = g_y.sum(axis=tuple(range(g_y.ndim - 1)))
    batch = g_y.size // max(1, g_y.shape[-1])
    dtype = coarsest(y_ref.dtype, g_bias.dtype)
    assert_close_to_float64(g_bias, expected, n=batch, dtype=dtype)


def in_float64(fn, *args):
    """``fn(*args)`` computed in float64: the independent reference for float32 results.

    Floating arrays in ``args`` are upcast (their values are exact in float64) and
    ``fn`` runs with x64 enabled (the ``x64`` fixture's context manager), so the rest of
    the test keeps JAX's default configuration. Results come back as float64 NumPy.
    """

    def up(a):
        a = np.asarray(a)
        # jnp.issubdtype: NumPy does not count bfloat16 (an ml_dtypes type) as floating.
        return a.astype(np.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a

    with jax.enable_x64(True):
        out = fn(*jax.tree.map(lambda a: jnp.asarray(up(a)), args))
        return jax.tree.map(lambda a: np.asarray(a, np.float64), out)


def skip_without_float16():
    """Skips the calling test where XLA cannot compute in float16 on this CPU.

    XLA's CPU backend converts float16 with the F16C instructions; without them
    (``XLA_FLAGS=--xla_cpu_max_isa=SSE4_2``, or an old CPU) even plain ``jnp``
    float16 code fails to compile. That is a limit of the machine, not of jaxext.
    """
    import pytest

    try:
        jnp.ones(2, jnp.float32).astype(jnp.float16).block_until_ready()
    except Exception as err:  # jax.errors.JaxRuntimeError: missing __truncsfhf2
        pytest.skip(f"XLA cannot compile float16 code on this CPU: {str(err)[:120]}")


_HLO_DOT = re.compile(r"=\s*\S+\s+dot\(")
_HLO_MATMUL_CALL = re.compile(r"=\s*\S+\s+custom-call\(.*custom_call_target=\"[^\"]*(matmul|gemm)")


def count_hlo_dots(hlo_text):
    """Number of matrix-product *instructions* in compiled HLO text.

    Counts instructions whose opcode is ``dot`` (and library matmul custom-calls,
    which some backends rewrite dots into), not the many ``dot_general`` substrings
    that appear in ``metadata={op_name=...}`` and instruction names.
    """
    return sum(
        1
        for line in hlo_text.splitlines()
        if _HLO_DOT.search(line) or _HLO_MATMUL_CALL.search(line)
    )


def count_primitive(jaxpr, name):
    """Number of equations of primitive ``name`` in ``jaxpr``, sub-jaxprs included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)  # ClosedJaxpr -> Jaxpr
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == name
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += count_primitive(inner, name)
    return total


def vjp_kept(fn, *primals):
    """The arrays a ``jax.vjp`` closure of ``fn`` holds (zero-size arrays left out)."""
    _, vjp_fn = jax.vjp(fn, *primals)
    return [leaf for leaf in jax.tree.leaves(vjp_fn) if np.size(leaf) > 0]


def uses_custom_rule(f, *args):
    """True when differentiating ``f`` goes through a ``jaxext.custom_vjp`` rule.

    The JVP of such a call holds its tangent primitive, linear in the tangents,
    which reverse mode transposes into the hand-written backward.
    """
    jaxpr = jax.make_jaxpr(lambda *a: jax.jvp(f, a, a))(*args)
    return "jaxext_custom_vjp_tangent" in str(jaxpr)


# -- the porting guide's Functions (docs/porting_from_pytorch.md), shared by the test files --
# test_function checks that the guide shows exactly these classes.


class LinearFunction(jaxext.Function):
    @staticmethod
    def forward(ctx, input, weight, bias=None):
        ctx.save_for_backward(input, weight, bias)
        output = input @ weight.T
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output @ weight
        if ctx.needs_input_grad[1]:
            grad_weight = grad_output.T @ input
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_output.sum(0)
        return grad_input, grad_weight, grad_bias


class MulConstant(jaxext.Function):
    @staticmethod
    def forward(ctx, tensor, constant):
        ctx.constant = constant
        return tensor * constant

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output * ctx.constant, None


class Cube(jaxext.Function):
    """``x ** 3``, a PyTorch-style Function with one input."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * grad_output


class OnceCube(Cube):
    """:class:`Cube` with its backward declared ``@once_differentiable``."""

    backward = staticmethod(jaxext.once_differentiable(Cube.backward))


def run_json_worker(spawn_python, worker, out, what, *args):
    """Runs ``python worker out *args`` (through the ``spawn_python`` fixture) on the CPU
    backend from the repository root and returns the JSON it wrote to ``out`` (multi-device
    checks run in such a subprocess, which sets its device count before importing JAX)."""
    import json
    import os
    from pathlib import Path

    repo_root = Path(worker).resolve().parent.parent
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo_root), env.get("PYTHONPATH", "")) if p)
    proc = spawn_python.run(
        [str(worker), str(out), *map(str, args)],
        env=env,
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{what} worker failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(Path(out).read_text())


class CompileCounter:
    """Counts XLA compilations (``jax.monitoring``'s backend-compile events) while active.

    Example::

        with CompileCounter() as compiles:
            f(x)
        assert compiles.count == 0
    """

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0

    def _listener(self, event, duration, **kwargs):
        del duration, kwargs
        if event == self.EVENT:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)


# -- parameter grids: every pair by default, the whole product as `exhaustive` -------------


def _pairs(row):
    """The (axis, value index) pairs a grid row covers, as a set of index quadruples."""
    return {(a, row[a], b, row[b]) for a in range(len(row)) for b in range(a + 1, len(row))}


def covering_rows(sizes, required=(), valid=None):
    """Rows of value indices, one per axis of ``sizes``, that cover every pair of values.

    A deterministic greedy pairwise covering array (JAX's ``sample_product`` idea without
    randomness): ``required`` rows come first, then, while some pair of values of two axes
    is in no row yet, the first row of the product (in ``itertools.product`` order) that
    covers the most such pairs. Only rows for which ``valid(row)`` holds are candidates, and
    only their pairs need covering. With fewer than two axes every valid row is needed.
    """
    import itertools

    product = [
        r for r in itertools.product(*(range(n) for n in sizes)) if valid is None or valid(r)
    ]
    if len(sizes) < 2:
        return product
    rows = list(dict.fromkeys(tuple(r) for r in required))
    uncovered = set().union(*(_pairs(r) for r in product))
    for r in rows:
        uncovered -= _pairs(r)
    while uncovered:
        best = max(product, key=lambda r: len(_pairs(r) & uncovered))
        rows.append(best)
        uncovered -= _pairs(best)
    return rows


def grid(*, corners=(), ids=None, where=None, **axes):
    """``pytest.mark.parametrize`` arguments for the product of ``axes``, in two tiers.

    The default tier holds a covering array of the product (every pair of values of any two
    axes appears in some case; :func:`covering_rows`) plus the named ``corners``; the rest of
    the product is marked ``exhaustive`` (``pytest -m exhaustive`` runs it; CI runs it).

    An axis may be a list of ``pytest.param``s: each is one value of the axis, its values
    spread over the argument names the axis name lists (``**{"x_shape,out_features": SHAPES}``)
    and its id used as is.

    Args:
        corners: cases that always run, each a dict naming a value for every axis (a
            ``pytest.param`` value by its id).
        ids: a function from one value to its text in the test id (the values joined by
            ``-``), a dict of such functions by axis name (``str`` for the others), or
            ``None`` for pytest's own ids.
        where: a predicate on one case's arguments (as keyword arguments): the product is
            restricted to the cases for which it holds.
        **axes: the axes, in argument order, each a sequence of values.

    Returns:
        ``(argnames, params)`` for ``@pytest.mark.parametrize(*grid(...))``.

    Example::

        @pytest.mark.parametrize(*grid(dtype=["float32", "float64"], shape=[(2,), (3, 4)]))
        def test_op(dtype, shape): ...
    """
    import itertools

    import pytest
    from _pytest.mark.structures import ParameterSet

    names = list(axes)
    values = [list(v) for v in axes.values()]
    argnames = [a.strip() for n in names for a in n.split(",")]
    for corner in corners:
        if set(corner) != set(names):
            raise ValueError(f"`corners`: each must name the axes {names}; got {sorted(corner)}.")

    def same(value, wanted):
        if isinstance(value, ParameterSet):
            return value.id == wanted
        return value is wanted or value == wanted

    def index(axis, wanted):
        matches = [i for i, v in enumerate(values[axis]) if same(v, wanted)]
        if not matches:
            raise ValueError(f"`corners`: {wanted!r} is not a value of axis `{names[axis]}`.")
        return matches[0]

    def args(row):
        out = []
        for a, i in enumerate(row):
            v = values[a][i]
            out.extend(v.values if isinstance(v, ParameterSet) else (v,))
        return out

    def valid(row):
        return where is None or where(**dict(zip(argnames, args(row), strict=True)))

    def text(name, value):
        if isinstance(value, ParameterSet):
            return value.id if value.id is not None else "-".join(map(str, value.values))
        fn = ids.get(name, str) if isinstance(ids, dict) else ids
        return str(value if fn is None else fn(value))

    def case_id(row):
        cells = [(n, values[a][i]) for a, (n, i) in enumerate(zip(names, row, strict=True))]
        if ids is None and not any(isinstance(v, ParameterSet) for _, v in cells):
            return None
        return "-".join(text(n, v) for n, v in cells)

    required = [tuple(index(a, c[n]) for a, n in enumerate(names)) for c in corners]
    default = set(covering_rows([len(v) for v in values], required, valid))
    params = [
        pytest.param(
            *args(row), id=case_id(row), marks=() if row in default else pytest.mark.exhaustive
        )
        for row in itertools.product(*(range(len(v)) for v in values))
        if valid(row)
    ]
    return ",".join(argnames), params


def tiered(values, *, default, ids=None):
    """``values`` as ``pytest.param``s: those in ``default`` in the default tier, the rest
    ``exhaustive`` (an engine differential keeps one smoke case by default, say).

    Args:
        values: the values of one parameter.
        default: the values that run in the default tier.
        ids: a function from a value to its test id, or ``None`` for pytest's own.
    """
    import pytest

    missing = [v for v in default if v not in values]
    if missing:
        raise ValueError(f"`default`: {missing!r} are not among the values.")
    return [
        pytest.param(
            v,
            id=None if ids is None else ids(v),
            marks=() if v in default else pytest.mark.exhaustive,
        )
        for v in values
    ]


def importorskip_extra(module, extra):
    """``pytest.importorskip(module)`` for a package of pyproject.toml's extra ``extra``.

    Every test skipped for lack of one extra gives the same reason, naming the extra and its
    install command, so the run's summary counts those skips on one line (a bare
    ``importorskip`` gives one reason per module, none naming the extra).
    """
    import pytest

    return pytest.importorskip(
        module, reason=f"needs the `{extra}` extra: pip install 'jaxext[{extra}]'"
    )
