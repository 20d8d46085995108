"""``jaxext.rms_norm`` (plain XLA or Pallas kernels) and its Flax layers.

Its gradcheck, gradgradcheck and full opcheck run from ``tests/ops_table.py``; its
sharding cases (rows split) in ``tests/test_sharding.py``. Here: values, gradients
and JVPs in every dtype, of the XLA implementation against an independent float64
reference and of the kernels (``implementation="interpret"``) against the XLA
implementation run in float64; uneven row counts, empty batches, argument errors,
lowering for GPU and TPU through ``jax.export`` on this CPU machine, and the NNX and
Linen layers against Flax's own ``RMSNorm``. On CPU the kernels run in Pallas
interpret mode, which compiles slowly: the shapes are small and few.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close_to_float64, coarsest, in_float64, rand, vjp_kept
from jax.sharding import PartitionSpec as P

import jaxext

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


def reference(x, weight, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def xla_reference(x, weight, eps=1e-6):
    """The op's XLA implementation: the reference of its kernels (run in float64)."""
    return jaxext.rms_norm(x, weight, eps, implementation="xla")


def kernels(x, weight, eps=1e-6, **options):
    """The op's Pallas kernels, in interpret mode (this machine has no GPU or TPU)."""
    return jaxext.rms_norm(x, weight, eps, implementation="interpret", **options)


# implementation -> its float64 reference: the independent formula for XLA, XLA for the kernels
REFERENCES = {"xla": reference, "interpret": xla_reference}


def _measures(f, x, w, c, tx, tw):
    """Output, VJP with cotangent ``c`` (both inputs) and JVP along ``(tx, tw)``."""
    y, vjp = jax.vjp(f, x, w)
    grads = vjp(c.astype(y.dtype))
    return y, grads, jax.jvp(f, (x, w), (tx, tw))[1]


# (x shape, block_rows): one block, several with padded rows (14 rows in blocks of 4, 37
# in blocks of 16), a 1-D input, no rows at all.
SHAPES = [
    pytest.param((5, 3), None, id="5x3"),
    pytest.param((2, 7, 5), 4, id="2x7x5-blocks4"),
    pytest.param((37, 6), 16, id="37x6-blocks16"),
    pytest.param((3,), None, id="1d"),
    pytest.param((0, 4), None, id="empty"),
]


def _cases(default, **axes):
    """The product of ``axes`` as ``pytest.param``s: ``default`` (ids) in the default tier,
    the rest ``exhaustive`` (each case compiles interpret-mode kernels: seconds on CPU)."""
    import itertools

    names = list(axes)
    params = []
    for combo in itertools.product(*axes.values()):
        case_id = "-".join(getattr(v, "id", None) or getattr(v, "__name__", str(v)) for v in combo)
        values = [p for v in combo for p in (v.values if hasattr(v, "values") else (v,))]
        marks = () if case_id in default else pytest.mark.exhaustive
        params.append(pytest.param(*values, id=case_id, marks=marks))
    return names, params


VALUE_CASES = _cases(
    # float32 on one block is also opcheck's (tests/ops_table.py); these add uneven row
    # blocks, the narrow dtypes, mixed dtypes and no rows.
    {
        "2x7x5-blocks4-bfloat16-float32-interpret",
        "37x6-blocks16-float16-same-interpret",
        "empty-float32-float32-interpret",
        "2x7x5-blocks4-bfloat16-float32-xla",
        "37x6-blocks16-float16-same-xla",
    },
    shape=SHAPES,
    dtype=[F32, BF16, F16],
    weight_dtype=["same", F32],
    implementation=["interpret", "xla"],
)


@pytest.mark.parametrize("shape, block_rows, dtype, weight_dtype, implementation", VALUE_CASES[1])
def test_values_gradients_and_jvp_match_float64(
    shape, block_rows, dtype, weight_dtype, implementation
):
    w_dtype = dtype if weight_dtype == "same" else weight_dtype
    x = jnp.asarray(rand(0, shape), dtype)
    w = jnp.asarray(rand(1, shape[-1:]) + 1.5, w_dtype)
    c, tx, tw = rand(2, shape), rand(3, shape), rand(4, shape[-1:])

    def f(x, w):
        return jaxext.rms_norm(x, w, implementation=implementation, block_rows=block_rows)

    got = jax.jit(lambda *a: _measures(f, *a))(x, w, c, jnp.asarray(tx, dtype), tw.astype(w_dtype))
    # The reference sees the inputs as rounded to their dtypes, and the same tangents.
    ref = REFERENCES[implementation]
    want = in_float64(
        lambda *a: _measures(ref, *a), x, w, c, jnp.asarray(tx, dtype), tw.astype(w_dtype)
    )
    y, (gx, gw), jvp = got
    assert y.dtype == jnp.result_type(dtype, w_dtype) and y.shape == shape
    assert gx.dtype == dtype and gw.dtype == w_dtype and gw.shape == shape[-1:]
    rows = int(np.prod(shape[:-1]))
    rounds_in = coarsest(dtype, w_dtype)
    n = shape[-1]
    assert_close_to_float64(y, want[0], n=n, dtype=rounds_in)
    assert_close_to_float64(gx, want[1][0], n=n, dtype=rounds_in)
    assert_close_to_float64(gw, want[1][1], n=rows, dtype=rounds_in)
    assert_close_to_float64(jvp, want[2], n=n, dtype=rounds_in)


@pytest.mark.exhaustive  # float64 values and gradients are opcheck's too (tests/ops_table.py)
@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_float64_is_computed_in_float64(x64, implementation):
    x, w = jnp.asarray(rand(0, (6, 5), np.float64)), jnp.asarray(rand(1, (5,), np.float64))
    f = functools.partial(jaxext.rms_norm, implementation=implementation)
    y, grads, jvp = jax.jit(lambda *a: _measures(f, *a))(x, w, x, x, w)
    want = _measures(reference, x, w, x, x, w)
    assert y.dtype == jnp.float64
    for a, b in zip(jax.tree.leaves((y, grads, jvp)), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)


def test_eps_zero_in_the_kernels():
    x, w = jnp.asarray(rand(0, (4, 3))), jnp.asarray(rand(1, (3,)))
    # eps = 0: padded rows (ones) keep the row sums finite, so no NaN leaks into grad_w
    # (4 rows in blocks of 16).
    got = jax.grad(lambda x, w: jnp.sum(kernels(x, w, 0)), (0, 1))
    want = in_float64(jax.grad(lambda x, w: jnp.sum(xla_reference(x, w, 0.0)), (0, 1)), x, w)
    for a, b in zip(got(x, w), want, strict=True):
        assert np.all(np.isfinite(a))
        assert_close_to_float64(a, b, n=12)


def test_compiled_kernels_cannot_run_on_cpu():
    if jax.default_backend() != "cpu":
        pytest.skip("checks the CPU backend")
    with pytest.raises(Exception, match="interpret"):
        jaxext.rms_norm(jnp.ones((2, 3)), jnp.ones(3), implementation="pallas")


@pytest.mark.parametrize("implementation", [None, "pallas"])
def test_default_is_the_kernels_on_tpu_only_and_pallas_asks_for_them_on_gpu(implementation):
    """One jitted program, chosen per platform when lowered (lax.platform_dependent): by
    default XLA on CPU and GPU (faster than the Triton kernels on an H200), kernels on TPU."""
    x, w = jax.ShapeDtypeStruct((16, 8), jnp.float32), jax.ShapeDtypeStruct((8,), jnp.float32)
    op = functools.partial(jaxext.rms_norm, implementation=implementation)
    grad = jax.jit(jax.grad(lambda x, w: jnp.sum(op(x, w) ** 2), (0, 1)))
    if implementation is None:
        cpu = grad.trace(x, w).lower(lowering_platforms=("cpu",)).as_text()
        assert "custom_call" not in cpu and "while" not in cpu  # no kernel, no interpreter loop
    with _lowering_target("cuda"):
        cuda = grad.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    # the forward and the backward kernel, asked for; none by default
    assert cuda.count("__gpu$xla.gpu.triton") == (2 if implementation else 0)
    assert "while" not in cuda
    tpu = grad.trace(x, w).lower(lowering_platforms=("tpu",)).as_text()
    assert tpu.count("tpu_custom_call") == 2


@pytest.mark.parametrize(
    ("shape", "grid"),
    [((4096, 1024), 1024), ((64, 4096), 64), ((8, 8), 1), ((3, 100), 1), ((2048, 16), 8)],
)
def test_triton_blocks_hold_about_4096_elements(shape, grid):
    """Each Triton program holds about 4096 elements (at least one row, at most 256): the
    block size measured fastest on an H200, where bigger blocks ran up to 4x slower."""
    x, w = jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape[-1:], jnp.float32)
    op = functools.partial(jaxext.rms_norm, implementation="pallas")
    jaxpr = jax.make_jaxpr(lambda x, w: jax.vjp(op, x, w)[1](jnp.ones(shape)))(x, w)
    grids = [
        eqn.params["grid_mapping"].grid
        for cond in _equations(jaxpr.jaxpr)
        if "branches_platforms" in cond.params
        for branch, names in zip(
            cond.params["branches"], cond.params["branches_platforms"], strict=True
        )
        if names and "cuda" in names
        for eqn in _equations(branch.jaxpr)
        if eqn.primitive.name == "pallas_call"
    ]
    assert grids == [(grid,), (grid,)], grids  # the forward's and the backward's


def test_interpret_mode_runs_one_block_per_step():
    """Pallas's interpreter loop over a grid copies whole arrays at each step (quadratic in
    the rows); the op runs a one-block kernel per row block in a ``lax.map`` instead."""
    x, w = jnp.ones((64, 8)), jnp.ones(8)
    jaxpr = jax.make_jaxpr(lambda x, w: kernels(x, w, block_rows=16))(x, w)
    text = str(jaxpr)
    assert "scan" in text and "length=4" in text
    grids = [
        eqn.params["grid_mapping"].grid
        for eqn in _equations(jaxpr.jaxpr)
        if eqn.primitive.name == "pallas_call"
    ]
    assert grids == [(1,)], grids


def _equations(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


@pytest.mark.parametrize("implementation", ["xla", "interpret", None])
def test_vmap_over_an_empty_batch(implementation):
    """Pallas's batched kernel slices a batch element that an empty batch does not have."""
    f = functools.partial(jaxext.rms_norm, implementation=implementation)
    x, w = jnp.ones((0, 3, 4)), jnp.ones(4)
    assert jax.vmap(f, (0, None))(x, w).shape == (0, 3, 4)
    gx, gw = jax.vmap(jax.grad(lambda x, w: jnp.sum(f(x, w)), (0, 1)), (0, None))(x, w)
    assert gx.shape == (0, 3, 4) and gw.shape == (0, 4)
    assert jax.vmap(f)(x, jnp.ones((0, 4))).shape == (0, 3, 4)  # weight batched too
    # A batch of two: the kernels' batching gives what the formula gives.
    x2, w2 = jnp.asarray(rand(0, (2, 3, 4))), jnp.asarray(rand(1, (2, 4)))
    got = jax.vmap(jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), (0, 1)))(x2, w2)
    want = in_float64(
        jax.vmap(jax.grad(lambda x, w: jnp.sum(jnp.sin(reference(x, w))), (0, 1))), x2, w2
    )
    for a, b in zip(got, want, strict=True):
        assert_close_to_float64(a, b, n=12)


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        (("a", jnp.ones(3)), {}, TypeError, "`x` must be a numeric array"),
        ((jnp.ones((2, 3), jnp.int32), jnp.ones(3)), {}, TypeError, "`x` must have a floating"),
        ((jnp.ones((2, 3), jnp.complex64), jnp.ones(3)), {}, TypeError, "`x` .* complex64"),
        ((jnp.ones((2, 3)), jnp.ones(3, jnp.int8)), {}, TypeError, "`weight` must have a float"),
        ((jnp.ones((2, 3)), jnp.ones(4)), {}, ValueError, r"`weight` .*\(3,\).* got shape \(4,\)"),
        ((jnp.ones((2, 3)), jnp.ones((1, 3))), {}, ValueError, "`weight` must have shape"),
        ((jnp.float32(1), jnp.ones(1)), {}, ValueError, "`x` .* got a scalar"),
        ((jnp.ones((2, 0)), jnp.ones(0)), {}, ValueError, "`x` must have at least one feature"),
        ((jnp.ones((2, 3)), jnp.ones(3), jnp.float32(1e-6)), {}, TypeError, "`eps` must be"),
        ((jnp.ones((2, 3)), jnp.ones(3), "1e-6"), {}, TypeError, "`eps` must be"),
        ((jnp.ones((2, 3)), jnp.ones(3), -1.0), {}, ValueError, "`eps` must be a finite"),
        ((jnp.ones((2, 3)), jnp.ones(3), float("nan")), {}, ValueError, "`eps` must be a finite"),
        ((jnp.ones((2, 3)), jnp.ones(3)), {"implementation": 1}, TypeError, "`implementation`"),
        (
            (jnp.ones((2, 3)), jnp.ones(3)),
            {"implementation": "triton"},
            ValueError,
            r"`implementation` must be None or one of \('xla', 'pallas', .*; got 'triton'",
        ),
        ((jnp.ones((2, 3)), jnp.ones(3)), {"block_rows": 12}, ValueError, "power of two"),
        ((jnp.ones((2, 3)), jnp.ones(3)), {"block_rows": 8.0}, TypeError, "`block_rows`"),
    ],
)
def test_bad_arguments_are_refused_by_name(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        jaxext.rms_norm(*args, **kwargs)


def test_symbolic_shapes_are_refused_clearly():
    (rows,) = jax.export.symbolic_shape("rows")
    spec = jax.ShapeDtypeStruct((rows, 3), jnp.float32)
    with pytest.raises(ValueError, match="static shape"):
        jax.export.export(jax.jit(jaxext.rms_norm))(spec, jax.ShapeDtypeStruct((3,), jnp.float32))


# -- GPU and TPU: lowered through jax.export on this machine (no device needed) ----------

# Triton's custom call has no export compatibility guarantee: serialising it must be asked
# for by name. Mosaic's (tpu_custom_call) is on JAX's list of stable targets.
_TRITON = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
_KERNEL_CALL = {"cuda": "__gpu$xla.gpu.triton", "rocm": "__gpu$xla.gpu.triton", "tpu": "tpu"}
# Triton compiles for one GPU model: without a GPU here, name one (JAX 0.12 refuses to lower
# for "cuda" otherwise; JAX 0.10 accepts either).
_TARGET_GPU = {"cuda": "NVIDIA H100 80GB HBM3", "rocm": "gfx90a"}


def _lowering_target(platform):
    if platform not in _TARGET_GPU:
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(
        device_kind=_TARGET_GPU[platform], num_cores=None, platform="gpu"
    )
    mesh = jax.sharding.AbstractMesh((1,), ("i",), abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


@pytest.mark.parametrize(
    "platform, implementation",
    [("cuda", "pallas"), ("tpu", "pallas"), ("rocm", "pallas"), ("tpu", None), ("cuda", None)],
)
def test_forward_and_gradient_lower_for_accelerators(platform, implementation):
    """The kernels where asked for or the default (TPU); plain XLA by default on GPU."""
    x = jax.ShapeDtypeStruct((10, 5), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((5,), jnp.float32)

    def forward(x, w):
        return jaxext.rms_norm(x, w, implementation=implementation)

    gradient = jax.grad(lambda x, w: jnp.sum(forward(x, w)), (0, 1))
    kernel = implementation == "pallas" or platform == "tpu"
    # the gradient runs the forward and the backward kernel
    for fn, kernels in ((forward, int(kernel)), (gradient, 2 * kernel)):
        export = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=[_TRITON])
        with _lowering_target(platform):
            exported = export(x, w)
        assert exported.platforms == (platform,)
        text = exported.mlir_module()
        assert text.count(f"stablehlo.custom_call @{_KERNEL_CALL[platform]}") == kernels, text[
            :2000
        ]
        assert "while" not in text  # the compiled kernel, not the interpreter's loop


@pytest.mark.parametrize("implementation", [None, "pallas"])
def test_one_export_for_several_platforms_is_refused_with_a_kernel(implementation):
    # Documented limit: each platform's kernel is lowered for every platform of a
    # multi-platform export, and one platform's compiler options are refused on another.
    spec = jax.ShapeDtypeStruct((4, 3), jnp.float32)
    op = jax.jit(functools.partial(jaxext.rms_norm, implementation=implementation))
    with pytest.raises(ValueError, match="cannot be used for (tpu|gpu)"):
        jax.export.export(op, platforms=["cuda", "tpu"])(
            spec, jax.ShapeDtypeStruct((3,), jnp.float32)
        )


def test_the_default_exports_for_cpu_and_gpu_at_once():
    """Without a kernel on either (XLA on both), one export serves CPU and GPU."""
    x, w = jnp.arange(12.0).reshape(4, 3), jnp.array([1.0, 2.0, 0.5])
    exported = jax.export.export(jax.jit(jaxext.rms_norm), platforms=["cpu", "cuda"])(x, w)
    assert exported.platforms == ("cpu", "cuda")
    assert "custom_call" not in exported.mlir_module()
    x64 = np.asarray(x, np.float64)
    expected = x64 / np.sqrt(np.mean(x64**2, -1, keepdims=True) + 1e-6) * np.asarray(w)
    np.testing.assert_allclose(exported.call(x, w), expected, rtol=1e-6)


# -- Flax layers against Flax's RMSNorm ------------------------------------------------------


def _scale_init(key, shape, dtype):
    return jax.random.normal(key, shape, dtype) + 1.0


def _layer_pair(api, options, ours_options=None, x_shape=(2, 4)):
    """(ours, Flax's) as ``f(params, x)`` with Flax's parameters, for one ``options``
    (``ours_options``: given to jaxext's layer only)."""
    ours_options = {**options, **(ours_options or {})}
    if api == "nnx":
        from flax import nnx

        import jaxext.nnx

        def split(cls, options):
            return nnx.split(cls(x_shape[-1], **options, rngs=nnx.Rngs(0)))

        (g_ours, state_ours) = split(jaxext.nnx.RMSNorm, ours_options)
        (g_flax, state_flax) = split(nnx.RMSNorm, options)
        assert jax.tree.structure(state_ours) == jax.tree.structure(state_flax)
        params = nnx.to_pure_dict(state_flax)

        def apply(graphdef, state):
            def f(params, x):
                s = jax.tree.map(lambda leaf: leaf, state)
                nnx.replace_by_pure_dict(s, params)
                return nnx.merge(graphdef, s)(x)

            return f

        return apply(g_ours, state_ours), apply(g_flax, state_flax), params
    from flax import linen as nn

    import jaxext.linen

    ours, theirs = jaxext.linen.RMSNorm(**ours_options), nn.RMSNorm(**options)
    x = jnp.ones(x_shape)
    params = theirs.init(jax.random.key(0), x)
    assert jax.tree.map(np.shape, ours.init(jax.random.key(0), x)) == jax.tree.map(np.shape, params)
    return (lambda p, x: ours.apply(p, x)), (lambda p, x: theirs.apply(p, x)), params


LAYER_CASES = {
    # float64 parameters and input: both sides must agree to float64 rounding.
    "float64": ({"epsilon": 1e-3, "param_dtype": jnp.float64, "scale_init": _scale_init}, "f64"),
    "no_scale": ({"use_scale": False, "param_dtype": jnp.float64}, "f64"),
    # Mixed precision: float32 scale, bfloat16 input (Flax promotes to float32).
    "bf16_input": ({"scale_init": _scale_init}, "bf16"),
    # bfloat16 compute dtype: Flax casts input and scale to bfloat16 first.
    "dtype_bf16": ({"dtype": jnp.bfloat16, "scale_init": _scale_init}, "f32"),
    # A compute dtype wider than the input: Flax computes in it (linen: its statistics and
    # product are in the promotion of the input's dtype, `dtype` and float32; bfloat16
    # parameters: the case where computing in the input's dtype lost 3 digits).
    "dtype_f32_bf16_input": (
        {"dtype": F32, "param_dtype": BF16, "scale_init": _scale_init},
        "bf16",
    ),
    "dtype_f64_f32_input": ({"dtype": jnp.float64, "scale_init": _scale_init}, "f32"),
}


@pytest.mark.parametrize(
    "api, case, implementation",
    _cases(
        {
            "nnx-float64-default",
            "linen-no_scale-default",
            "nnx-dtype_bf16-default",
            "linen-bf16_input-default",
            "linen-dtype_f32_bf16_input-default",
            "linen-dtype_f64_f32_input-default",
            "nnx-dtype_f32_bf16_input-default",
            "linen-dtype_f32_bf16_input-interpret",
            "nnx-bf16_input-interpret",
        },
        api=["nnx", "linen"],
        case=list(LAYER_CASES),
        implementation=[pytest.param(None, id="default"), "interpret"],
    )[1],
)
def test_layer_matches_flax_rmsnorm(api, case, implementation, x64):
    options, x_kind = LAYER_CASES[case]
    ours, theirs, params = _layer_pair(api, options, {"implementation": implementation})
    x_dtype = {"f64": jnp.float64, "bf16": jnp.bfloat16, "f32": jnp.float32}[x_kind]
    x = jnp.asarray(rand(5, (3, 2, 4)), x_dtype)

    def measures(f):
        def loss(params, x):
            y = f(params, x)
            return jnp.sum(jnp.sin(y.astype(jnp.float64))), y

        (_, y), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(params, x)
        return y, grads

    got, want = measures(ours), measures(theirs)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        # Flax in the same precision is the reference: each result rounds in its own dtype
        # or a coarser compute `dtype`, around a float32 (or float64) reduction over 4
        # features or 6 rows (same input, so no input rounding between the two).
        rounds_in = coarsest(a.dtype, options.get("dtype"))
        tol = 1e-13 if rounds_in == jnp.float64 else 8 * float(jnp.finfo(rounds_in).eps)
        scale = float(np.max(np.abs(np.asarray(b, np.float64))))
        np.testing.assert_allclose(
            np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tol, atol=tol * scale
        )


@pytest.mark.parametrize(
    "option, value",
    [
        ("reduction_axes", (-2, -1)),
        ("reduction_axes", 0),
        ("reduction_axes", "last"),
        ("feature_axes", 0),
        ("feature_axes", ()),
        ("axis_name", "batch"),
        ("axis_index_groups", [[0]]),
    ],
)
def test_layers_refuse_what_the_op_cannot_do(option, value):
    from flax import nnx

    import jaxext.linen
    import jaxext.nnx

    x = jnp.ones((2, 4))
    with pytest.raises(ValueError, match=f"`{option}`"):
        jaxext.nnx.RMSNorm(4, **{option: value}, rngs=nnx.Rngs(0))(x)
    with pytest.raises(ValueError, match=f"`{option}`"):
        jaxext.linen.RMSNorm(**{option: value}).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="`mask`"):
        jaxext.nnx.RMSNorm(4, rngs=nnx.Rngs(0))(x, mask=jnp.ones((2, 4), bool))


@pytest.mark.parametrize("api", ["nnx", "linen"])
@pytest.mark.parametrize(
    "axes",
    [
        {"reduction_axes": 2, "feature_axes": 2},
        {"reduction_axes": (2,), "feature_axes": -1},
        {"reduction_axes": [-1, 2], "feature_axes": (2,)},
    ],
    ids=["2", "tuple", "list-duplicate"],
)
def test_layers_take_the_last_axis_by_position_as_flax_does(api, axes, x64):
    ours, theirs, params = _layer_pair(api, axes, x_shape=(2, 3, 4))
    x = jnp.asarray(rand(5, (2, 3, 4)))
    np.testing.assert_allclose(ours(params, x), theirs(params, x), rtol=1e-6, atol=1e-6)


def test_nnx_shape_error_names_scale():
    from flax import nnx

    import jaxext.nnx

    with pytest.raises(ValueError, match=r"`scale` of shape \(4,\); got `x` of shape \(2, 5\)"):
        jaxext.nnx.RMSNorm(4, rngs=nnx.Rngs(0))(jnp.ones((2, 5)))


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_layers_under_vmap_over_an_empty_batch(api):
    ours, theirs, params = _layer_pair(api, {})
    x = jnp.ones((0, 3, 4))
    assert jax.vmap(ours, (None, 0))(params, x).shape == (0, 3, 4)
    grads = jax.vmap(jax.grad(lambda p, x: jnp.sum(ours(p, x))), (None, 0))(params, x)
    assert jax.tree.leaves(grads)[0].shape == (0, 4)
    want = jax.vmap(jax.grad(lambda p, x: jnp.sum(theirs(p, x))), (None, 0))(params, x)
    assert jax.tree.map(jnp.shape, grads) == jax.tree.map(jnp.shape, want)


def test_backward_keeps_x_weight_and_the_per_row_factor_only():
    x, w = jnp.asarray(rand(0, (6, 5))), jnp.asarray(rand(1, (5,)))
    kept = vjp_kept(jaxext.rms_norm, x, w)
    shapes = sorted(tuple(np.shape(a)) for a in kept)
    assert shapes == [(5,), (6,), (6, 5)], shapes  # weight, rsqrt per row, x: not y
    (inv,) = [a for a in kept if np.shape(a) == (6,)]
    assert_close_to_float64(inv, in_float64(lambda x: jax.lax.rsqrt(jnp.mean(x * x, -1) + 1e-6), x))


def test_shard_map_with_rows_split_on_one_device():
    # The multi-device cases are in tests/test_sharding.py (slow tier). Here, one device:
    # the kernels run in interpret mode (check_vma=False, see the guide) and are lowered for
    # TPU with check_vma=True (the kernel results carry the mesh axes their operands vary over).
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x, w = jnp.asarray(rand(0, (8, 5))), jnp.asarray(rand(1, (5,)) + 1.0)

    def grad_of(norm, check_vma):
        def local(x, w):
            return jax.lax.psum(jnp.sum(jnp.tanh(norm(x, w))), "data")

        mapped = jax.shard_map(
            local, mesh=mesh, in_specs=(P("data"), P()), out_specs=P(), check_vma=check_vma
        )
        return jax.jit(jax.grad(mapped, (0, 1)))

    want = in_float64(grad_of(reference, False), x, w)
    # The kernels in interpret mode, and the default (XLA on CPU), which takes check_vma.
    for got in (grad_of(kernels, False)(x, w), grad_of(jaxext.rms_norm, True)(x, w)):
        for a, b in zip(got, want, strict=True):
            assert_close_to_float64(a, b, n=40)
    exported = jax.export.export(grad_of(jaxext.rms_norm, True), platforms=["tpu"])(x, w)
    assert exported.mlir_module().count("tpu_custom_call") == 2
