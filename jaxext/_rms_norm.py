"""`rms_norm`: a fused RMSNorm, as plain XLA or as Pallas kernels (an implementation choice).

This module is a template for an op written in ``jax.experimental.pallas``: its
checks, the two kernels, the same math in plain JAX, the primal, ``fwd``, ``bwd``
and a ``jvp`` rule, written with the public ``jaxext.custom_vjp`` and JAX's public
API only.

* ``implementation`` picks how the forward and backward run: ``"xla"`` (the math
  below in plain JAX: the reference, and the default on CPU, where no kernel
  compiler exists and XLA's fusion is fastest, and on GPU, where the Triton kernels
  measured slower than XLA's fusion for a training step on an H200:
  ``benchmarks/results/rms_norm_triton_sweep_gpu.md``), ``"pallas"`` (the kernels
  compiled: Triton on ``cuda``/``rocm``, Mosaic on ``tpu``; the default on TPU),
  ``"interpret"`` (the same kernels in Pallas's interpret mode on any platform: for
  testing kernels on CPU) or ``None``, decided when the program is lowered with
  ``lax.platform_dependent``, so one jitted program is right on each platform.
* ``fwd`` runs the forward (kernel), which returns the output and the per-row
  ``rsqrt(mean(x**2) + eps)``; the residuals are ``x``, ``weight`` and that
  per-row factor, nothing else.
* ``bwd`` runs the backward (kernel): per row block it writes ``grad_x`` and a
  partial sum of ``grad_weight``; the partial sums are added up outside it.
* A ``pallas_call`` cannot be transposed, so forward mode (``jvp``, ``jacfwd``)
  cannot be derived from ``bwd``: the op gives ``defvjp(..., jvp=...)`` a rule
  in plain JAX (no kernel).
* Each kernel call is a ``jax.custom_jvp`` whose derivative is the same math in
  plain JAX, so the backward is itself differentiable: grad-of-grad and
  ``hessian`` work, their second-order part computed by XLA, not by a kernel.
* Each kernel call has a ``jax.custom_batching.custom_vmap`` rule: a batch of
  inputs is more rows for the kernel (one launch), and an empty batch is empty.

Rows are padded to a whole number of row blocks and features to a power of two
(Triton's block shapes must be powers of two); the padding never reaches the
results. Default blocks: about 4096 elements per Triton program (among the
fastest of a sweep of block rows and warps on an H200), about ``2**15`` and at least
16 rows on TPU and in interpret mode. Interpret mode runs one single-block kernel
call per row block in a ``lax.map`` (Pallas's interpreter loop over a grid copies
the whole array at each step: quadratic time in the rows).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.typing import ArrayLike

from jaxext import check_array, custom_vjp

__all__ = ["rms_norm"]

_IMPLEMENTATIONS: tuple[str, ...] = ("xla", "pallas", "interpret")
"""The values of ``rms_norm``'s ``implementation`` argument other than ``None``."""

_FLOATS = ("bfloat16", "float16", "float32", "float64")
# Default rows per block: as many as keep a block near 2**15 elements, within [16, 256]
# (16 rows: a whole number of TPU sublane tiles for 32- and 16-bit types).
_BLOCK_ELEMENTS = 2**15
_MIN_BLOCK_ROWS, _MAX_BLOCK_ROWS = 16, 256
# Triton: one program per block holds the block in registers, so blocks stay small
# (about 4096 elements; any power of two of rows lowers).
_TRITON_BLOCK_ELEMENTS, _TRITON_MIN_BLOCK_ROWS = 2**12, 1


def rms_norm(
    x: ArrayLike,
    weight: ArrayLike,
    eps: float = 1e-6,
    *,
    implementation: str | None = None,
    block_rows: int | None = None,
) -> jax.Array:
    """Applies RMSNorm ``x * rsqrt(mean(x**2, -1) + eps) * weight``, in XLA or Pallas kernels.

    Normalises over the last axis; any leading shape. The forward and the
    backward are each plain XLA or one ``jax.experimental.pallas`` kernel over
    blocks of rows (``implementation``), tied together with
    :func:`jaxext.custom_vjp`. Statistics are computed in float32 (float64 for
    float64 inputs), whatever the input dtype. The residuals are ``x``,
    ``weight`` and the per-row ``rsqrt``.

    Forward mode (``jvp``, ``jacfwd``) uses a ``jvp`` rule in plain JAX (a
    ``pallas_call`` cannot be transposed), and second derivatives (grad of
    grad, ``hessian``) differentiate each kernel call through a plain-JAX rule
    of the same math: the first-order forward and backward run the kernels,
    higher orders run XLA. Under ``vmap`` the batch becomes more rows of one
    kernel call. With rows split over devices, call it inside ``jax.shard_map``
    (for ``"interpret"``, with ``check_vma=False``: Pallas's interpret mode in
    JAX 0.10 and 0.12 refuses ``check_vma=True``); ``pallas_call`` refuses
    explicit mesh axes outside a ``shard_map``. Export the kernels for one
    platform at a time (``jax.export`` with ``platforms=["cuda"]`` or
    ``["tpu"]``; Triton's custom call needs
    ``DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")`` and, on a
    machine without a GPU, a target GPU named with
    ``jax.sharding.AbstractDevice`` on an abstract mesh); a multi-platform
    export fails, and shape polymorphism is not supported.

    Args:
        x: input of shape ``(..., features)``, floating (bfloat16, float16,
            float32, or float64 with ``jax_enable_x64``).
        weight: scale of shape ``(features,)``, floating; it may have another
            floating dtype than ``x`` (e.g. float32 parameters, bfloat16 input).
        eps: a Python or NumPy real number, at least 0, added to the mean square
            (static: a new value compiles a new program).
        implementation: how the forward and backward run. ``"xla"``: plain JAX
            (the reference; fastest on CPU). ``"pallas"``: the Pallas kernels
            compiled (Triton on ``cuda``/``rocm``, Mosaic on ``tpu``; on CPU,
            lowering fails). ``"interpret"``: the Pallas kernels in interpret
            mode on any platform (slow; for testing the kernels on CPU).
            ``None`` (default): picked per platform when the program is lowered,
            ``"pallas"`` on TPU and ``"xla"`` elsewhere (on an H200 GPU the
            Triton kernels' training step measured 0.9x to 1.9x XLA's time,
            so XLA is the default there; pass ``"pallas"`` to run them).
        block_rows: rows per kernel block, a power of two. ``None`` picks one
            from the feature count: about 4096 elements per block for Triton
            (1 to 256 rows), about ``2**15`` for Mosaic and interpret mode (16 to
            256 rows). On TPU, several blocks need a multiple of 16. No effect
            with ``"xla"``.

    Returns:
        Array of ``x``'s shape in the ``jnp`` promotion of ``x``'s and
        ``weight``'s dtypes. Gradients come back in each input's own dtype.

    Raises:
        TypeError: if ``x`` or ``weight`` is not a floating array of one of the
            dtypes above, ``eps`` is not a real number (an array, say), or
            ``implementation``/``block_rows`` has the wrong type.
        ValueError: if ``x`` is a scalar, has no features or a symbolic
            dimension (``jax.export`` shape polymorphism), ``weight`` is not
            ``(features,)``, ``eps`` is negative or not finite,
            ``implementation`` is not one of the above, or ``block_rows`` is not
            a positive power of two.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import jaxext
        >>> x, w = jnp.arange(6.0).reshape(2, 3), jnp.ones(3)
        >>> y = jaxext.rms_norm(x, w)
        >>> bool(jnp.allclose(y, x / jnp.sqrt(jnp.mean(x**2, -1, keepdims=True) + 1e-6)))
        True
        >>> y_kernel = jaxext.rms_norm(x, w, implementation="interpret")
        >>> bool(jnp.allclose(y_kernel, y))
        True
        >>> jax.grad(lambda w: jaxext.rms_norm(x, w).sum())(w).shape
        (3,)
    """
    x = _check_floating(x, "x")
    weight = _check_floating(weight, "weight")
    if x.ndim == 0:
        raise ValueError("`x` must have shape (..., features); got a scalar.")
    if not all(isinstance(d, (int, np.integer)) for d in x.shape):
        raise ValueError(
            f"`x` must have a static shape (the Pallas grid is fixed when traced); got shape "
            f"{x.shape} with a symbolic dimension."
        )
    if x.shape[-1] == 0:
        raise ValueError(f"`x` must have at least one feature; got shape {x.shape}.")
    if weight.shape != (x.shape[-1],):
        raise ValueError(
            f"`weight` must have shape (features,) = ({x.shape[-1]},) for `x` of shape "
            f"{x.shape}; got shape {weight.shape}."
        )
    config = _Config(
        _check_eps(eps), _check_implementation(implementation), _check_block_rows(block_rows)
    )
    if isinstance(x, jax.core.Tracer) or isinstance(weight, jax.core.Tracer):
        return _rms_norm(x, weight, config)
    # An eager call runs as one compiled program, as jax.numpy's functions do.
    return _rms_norm_compiled(x, weight, config)


# -- checks ---------------------------------------------------------------------------


def _check_floating(value: Any, name: str) -> jax.Array:
    array = check_array(value, name)
    if array.dtype.name not in _FLOATS:
        raise TypeError(
            f"`{name}` must have a floating dtype ({', '.join(_FLOATS)}); got dtype {array.dtype}."
        )
    return array


def _check_eps(eps: Any) -> float:
    if isinstance(eps, (bool, np.bool_)) or not isinstance(
        eps, (int, float, np.integer, np.floating)
    ):
        raise TypeError(
            f"`eps` must be a Python or NumPy real number (static); got {type(eps).__name__}."
        )
    eps = float(eps)
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"`eps` must be a finite number >= 0; got {eps}.")
    return eps


def _check_implementation(implementation: Any) -> str | None:
    if implementation is None:
        return None
    if not isinstance(implementation, str):
        raise TypeError(
            f"`implementation` must be None or one of {_IMPLEMENTATIONS}; got "
            f"{type(implementation).__name__}."
        )
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            f"`implementation` must be None or one of {_IMPLEMENTATIONS}; got {implementation!r}."
        )
    return implementation


def _check_block_rows(block_rows: Any) -> int | None:
    if block_rows is None:
        return None
    if isinstance(block_rows, (bool, np.bool_)) or not isinstance(block_rows, (int, np.integer)):
        raise TypeError(f"`block_rows` must be an int or None; got {type(block_rows).__name__}.")
    block_rows = int(block_rows)
    if block_rows < 1 or block_rows & (block_rows - 1):
        raise ValueError(f"`block_rows` must be a positive power of two; got {block_rows}.")
    return block_rows


class _Config(NamedTuple):
    """The static (hashable, non-differentiable) arguments."""

    eps: float
    implementation: str | None
    block_rows: int | None


# -- layout: rows padded to whole blocks, features to a power of two -------------------


class _Layout(NamedTuple):
    rows: int  # rows of the 2-D view (product of x's leading dims)
    features: int
    padded_rows: int
    padded_features: int
    block_rows: int


def _layout(shape: tuple[int, ...], block_rows: int | None, mode: str) -> _Layout:
    rows, features = math.prod(shape[:-1]), shape[-1]
    padded_features = 1 << (features - 1).bit_length()
    if block_rows is None:
        triton = mode == "triton"
        elements = _TRITON_BLOCK_ELEMENTS if triton else _BLOCK_ELEMENTS
        smallest = _TRITON_MIN_BLOCK_ROWS if triton else _MIN_BLOCK_ROWS
        block_rows = min(max(elements // padded_features, smallest), _MAX_BLOCK_ROWS)
        block_rows = 1 << (block_rows.bit_length() - 1)  # a power of two
        block_rows = min(block_rows, 1 << (max(rows, 1) - 1).bit_length())  # no bigger than needed
    padded_rows = -(-rows // block_rows) * block_rows
    return _Layout(rows, features, padded_rows, padded_features, block_rows)


def _pad(a: jax.Array, rows: int, cols: int, row_value: float = 0.0) -> jax.Array:
    """The 2-D view of ``a`` (last axis kept), padded to ``(rows, cols)``.

    Padded columns are 0 (they add nothing to a row's sum of squares); padded rows
    are ``row_value`` (1 for ``x``, so their ``rsqrt`` stays finite even for eps=0,
    and 0 for the cotangent, so they add nothing to ``grad_weight``).
    """
    a = a.reshape(-1, a.shape[-1])
    a = jnp.pad(a, ((0, 0), (0, cols - a.shape[1])))
    return jnp.pad(a, ((0, rows - a.shape[0]), (0, 0)), constant_values=row_value)


def _compute_dtype(*dtypes: Any) -> Any:
    return jnp.float64 if jnp.dtype(jnp.result_type(*dtypes)) == jnp.float64 else jnp.float32


# -- the kernels ----------------------------------------------------------------------


def _forward_kernel(x_ref, w_ref, scale_ref, eps_ref, y_ref, inv_ref):
    """One block of rows: ``y = x * inv * w`` and ``inv = rsqrt(mean(x**2) + eps)``.

    ``scale_ref`` holds ``1 / features`` (the true count, not the padded one) and
    ``eps_ref`` eps, as (1, 1) operands rather than Python constants: interpret mode
    inside ``shard_map`` refuses a constant beside values that vary over mesh axes.
    """
    x = x_ref[...].astype(inv_ref.dtype)
    w = w_ref[...].astype(inv_ref.dtype)
    mean_square = jnp.sum(x * x, axis=1, keepdims=True) * scale_ref[...]
    inv = lax.rsqrt(mean_square + eps_ref[...])
    y_ref[...] = (x * inv * w).astype(y_ref.dtype)
    inv_ref[...] = inv


def _backward_kernel(x_ref, w_ref, inv_ref, g_ref, scale_ref, dx_ref, dw_ref):
    """One block of rows: ``grad_x`` and this block's partial sum of ``grad_weight``.

    With ``n = x * inv`` and ``gw = g * w``:
    ``grad_x = inv * (gw - n * mean(gw * n))`` and ``grad_weight = sum_rows(g * n)``.
    """
    cdt = inv_ref.dtype
    x = x_ref[...].astype(cdt)
    w = w_ref[...].astype(cdt)
    inv = inv_ref[...]
    g = g_ref[...].astype(cdt)
    n = x * inv
    gw = g * w
    dot = jnp.sum(gw * n, axis=1, keepdims=True) * scale_ref[...]
    dx_ref[...] = (inv * (gw - n * dot)).astype(dx_ref.dtype)
    dw_ref[...] = jnp.sum(g * n, axis=0, keepdims=True)


def _vary_alike(args: tuple) -> tuple[tuple, dict]:
    """``args`` made to vary over the same ``shard_map`` axes, and the kernel outputs' type.

    Inside ``shard_map`` (with ``check_vma``) a kernel's operands and results carry the
    mesh axes they vary over: the replicated weight is cast to vary like the rows, and the
    results vary over all of them.
    """
    types = [getattr(jax.typeof(a), "manual_axis_type", None) for a in args]
    if any(t is None for t in types):
        return args, {}  # a JAX without manual axis types on arrays
    varying = frozenset().union(*(t.varying for t in types))
    if not varying:
        return args, {}
    args = tuple(
        a if t.varying == varying else lax.pcast(a, tuple(varying - t.varying), to="varying")
        for a, t in zip(args, types, strict=True)
    )
    return args, {"manual_axis_type": jax.typeof(args[0]).manual_axis_type}


# -- launching a kernel: compiled over a grid, or interpreted one block at a time --------


def _launch(kernel, name: str, inputs: list, outputs: list, block_rows: int, mode: str):
    """Runs ``kernel`` over blocks of ``block_rows`` rows; returns its outputs.

    ``inputs`` are ``(array, per_row)`` pairs of 2-D arrays: a per-row one is cut into row
    blocks, the others are seen whole by every block. ``outputs`` are ``(columns, dtype,
    per_row)``: a per-row output has the inputs' rows; the others are one ``(1, columns)``
    row per block, returned as ``(blocks, 1, columns)``. ``mode``: ``"triton"``,
    ``"mosaic"``, ``"cpu"`` (compiled for CPU: Pallas's own error says interpret mode is
    needed) or ``"interpret"``: one single-block call per row block in a ``lax.map``, in
    linear time (Pallas's interpreter loop over a grid copies whole arrays at each step).
    """
    rows = next(a.shape[0] for a, per_row in inputs if per_row)
    blocks = rows // block_rows
    per_rows = [per_row for _, per_row in inputs]
    args, typed = _vary_alike(tuple(a for a, _ in inputs))

    def call(n_blocks: int, **options):
        in_specs = [
            pl.BlockSpec((block_rows, a.shape[1]), lambda i: (i, 0))
            if per_row
            else pl.BlockSpec(a.shape, lambda i: (0, 0))
            for a, per_row in zip(args, per_rows, strict=True)
        ]
        out_specs, out_shape = [], []
        for columns, dtype, per_row in outputs:
            if per_row:
                out_specs.append(pl.BlockSpec((block_rows, columns), lambda i: (i, 0)))
                shape = (n_blocks * block_rows, columns)
            else:  # the leading (block) axis squeezed: the kernel sees (1, columns)
                out_specs.append(pl.BlockSpec((None, 1, columns), lambda i: (i, 0, 0)))
                shape = (n_blocks, 1, columns)
            out_shape.append(jax.ShapeDtypeStruct(shape, dtype, **typed))
        return pl.pallas_call(
            kernel,
            grid=(n_blocks,),
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=out_shape,
            name=name,
            **options,
        )

    if mode != "interpret":
        from jax.experimental.pallas import tpu as pltpu
        from jax.experimental.pallas import triton as pltriton

        options = {
            # Pallas's default GPU backend (Mosaic GPU) cannot lower the reductions.
            "triton": {"compiler_params": pltriton.CompilerParams()},
            "mosaic": {"compiler_params": pltpu.CompilerParams()},
            "cpu": {"interpret": False},
        }[mode]
        return call(blocks, **options)(*args)

    def one_block(row_blocks):
        row_blocks = iter(row_blocks)
        block_args = [next(row_blocks) if p else a for a, p in zip(args, per_rows, strict=True)]
        return tuple(call(1, interpret=True)(*block_args))

    blocked = tuple(
        a.reshape(blocks, block_rows, a.shape[1]) for a, p in zip(args, per_rows, strict=True) if p
    )
    outs = lax.map(one_block, blocked)
    return [
        o.reshape(rows, o.shape[-1]) if per_row else o.reshape(blocks, 1, o.shape[-1])
        for o, (_, _, per_row) in zip(outs, outputs, strict=True)
    ]


def _forward_kernels(mode: str, x: jax.Array, weight: jax.Array, config: _Config):
    """``(y, inv)``: the forward kernel on ``x``'s rows; ``inv`` has shape ``x.shape[:-1]``."""
    lay = _layout(x.shape, config.block_rows, mode)
    out_dtype = jnp.result_type(x, weight)
    cdt = _compute_dtype(x.dtype, weight.dtype)
    if lay.rows == 0:
        return jnp.zeros(x.shape, out_dtype), jnp.zeros(x.shape[:-1], cdt)
    dp = lay.padded_features
    y, inv = _launch(
        _forward_kernel,
        "rms_norm_forward",
        [
            (_pad(x, lay.padded_rows, dp, 1.0), True),
            (_pad(weight[None], 1, dp), False),
            (jnp.full((1, 1), 1.0 / lay.features, cdt), False),
            (jnp.full((1, 1), config.eps, cdt), False),
        ],
        [(dp, out_dtype, True), (1, cdt, True)],
        lay.block_rows,
        mode,
    )
    y = y[: lay.rows, : lay.features].reshape(x.shape)
    return y, inv[: lay.rows, 0].reshape(x.shape[:-1])


def _backward_kernels(mode: str, x, weight, inv, g, config: _Config):
    """``(grad_x, grad_weight)`` from the backward kernel."""
    lay = _layout(x.shape, config.block_rows, mode)
    if lay.rows == 0:
        return jnp.zeros(x.shape, x.dtype), jnp.zeros(weight.shape, weight.dtype)
    dp = lay.padded_features
    dx, dw_parts = _launch(
        _backward_kernel,
        "rms_norm_backward",
        [
            (_pad(x, lay.padded_rows, dp, 1.0), True),
            (_pad(weight[None], 1, dp), False),
            (_pad(inv[..., None], lay.padded_rows, 1, 1.0), True),
            (_pad(g, lay.padded_rows, dp), True),
            (jnp.full((1, 1), 1.0 / lay.features, inv.dtype), False),
        ],
        # One partial grad_weight per block, added up here.
        [(dp, x.dtype, True), (dp, inv.dtype, False)],
        lay.block_rows,
        mode,
    )
    dx = dx[: lay.rows, : lay.features].reshape(x.shape)
    dw = jnp.sum(dw_parts[:, 0, : lay.features], axis=0)
    return dx, dw.astype(weight.dtype)


# -- the same math in plain JAX: the kernels' derivatives (second order, forward mode) --


def _forward_math(x, weight, eps):
    cdt = _compute_dtype(x.dtype, weight.dtype)
    xc = x.astype(cdt)
    inv = lax.rsqrt(jnp.mean(xc * xc, axis=-1) + eps)
    y = xc * inv[..., None] * weight.astype(cdt)
    return y.astype(jnp.result_type(x, weight)), inv


def _backward_math(x, weight, inv, g):
    cdt = inv.dtype
    n = x.astype(cdt) * inv[..., None]
    gw = g.astype(cdt) * weight.astype(cdt)
    dot = jnp.mean(gw * n, axis=-1, keepdims=True)
    dx = inv[..., None] * (gw - n * dot)
    dw = jnp.sum((g.astype(cdt) * n).reshape(-1, x.shape[-1]), axis=0)
    return dx.astype(x.dtype), dw.astype(weight.dtype)


# -- the implementation choice ---------------------------------------------------------


def _implemented(xla, kernels, args: tuple, config: _Config):
    """``xla(*args)`` or ``kernels(mode, *args, config)``, as ``config.implementation`` says.

    ``None`` and ``"pallas"`` choose with ``lax.platform_dependent``, which lowers only
    the branch of the platform the program is lowered for (one platform at a time: a
    multi-platform ``jax.export`` would lower each branch for every platform, and
    Triton's options are refused on TPU).
    """
    implementation = config.implementation
    if implementation == "xla":
        return xla(*args)
    if implementation == "interpret":
        return kernels("interpret", *args, config)

    def kernel(mode):
        return lambda *a: kernels(mode, *a, config)

    if implementation is None:
        # The kernels on TPU; plain XLA on CPU (no kernel compiler), on GPU (XLA's fusion
        # was faster than the Triton kernels for a training step on an H200) and elsewhere.
        return lax.platform_dependent(*args, tpu=kernel("mosaic"), default=xla)
    return lax.platform_dependent(
        *args,
        cuda=kernel("triton"),
        rocm=kernel("triton"),
        tpu=kernel("mosaic"),
        cpu=kernel("cpu"),
    )


def _empty_batch_safe(fn):
    """``fn(*arrays)`` with a ``vmap`` rule: Pallas's batching (a grid axis), except that an
    empty batch gives empty results (Pallas's batched kernel slices a block of the batch)."""
    batched_fn = jax.custom_batching.custom_vmap(fn)

    @batched_fn.def_vmap
    def rule(axis_size, in_batched, *args):
        if axis_size:
            in_axes = tuple(0 if b else None for b in in_batched)
            out = jax.vmap(fn, in_axes)(*args)
        else:
            unbatched = [
                jax.ShapeDtypeStruct(a.shape[1:] if b else a.shape, a.dtype)
                for a, b in zip(args, in_batched, strict=True)
            ]
            shapes = jax.eval_shape(fn, *unbatched)
            out = tuple(jnp.zeros((0, *s.shape), s.dtype) for s in shapes)
        return out, tuple(True for _ in out)

    return batched_fn


# Each call is jitted: an eager call under a transformation (jax.jvp, jax.vjp outside jit)
# then reuses one compiled program per shape instead of re-lowering the kernel.
@functools.partial(jax.jit, static_argnums=2)
def _forward_impl(x, weight, config: _Config):
    def forward(x, weight):
        return _implemented(
            functools.partial(_forward_math, eps=config.eps), _forward_kernels, (x, weight), config
        )

    return _empty_batch_safe(forward)(x, weight)


@functools.partial(jax.jit, static_argnums=4)
def _backward_impl(x, weight, inv, g, config: _Config):
    def backward(*args):
        return _implemented(_backward_math, _backward_kernels, args, config)

    return _empty_batch_safe(backward)(x, weight, inv, g)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _forward(x, weight, config):
    return _forward_impl(x, weight, config)


@_forward.defjvp
def _forward_jvp(config, primals, tangents):
    out = _forward(*primals, config)
    _, out_dot = jax.jvp(lambda x, w: _forward_math(x, w, config.eps), primals, tangents)
    return out, out_dot


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _backward(x, weight, inv, g, config):
    return _backward_impl(x, weight, inv, g, config)


@_backward.defjvp
def _backward_jvp(config, primals, tangents):
    out = _backward(*primals, config)
    _, out_dot = jax.jvp(_backward_math, primals, tangents)
    return out, out_dot


# -- the op: primal, fwd, bwd and jvp on jaxext.custom_vjp ----------------------------


@functools.partial(custom_vjp, nondiff_argnums=(2,))
def _rms_norm(x, weight, config):
    return _forward(x, weight, config)[0]


def _rms_norm_fwd(x, weight, config):
    y, inv = _forward(x, weight, config)
    return y, (x, weight, inv)  # what the backward kernel reads, nothing more


def _rms_norm_bwd(config, res, g):
    x, weight, inv = res
    return _backward(x, weight, inv, g, config)


def _rms_norm_jvp(config, res, tangents):
    # Plain JAX: the derivative of y = x * inv * w, with d(inv) = -inv**3 * mean(x * dx).
    x, weight, inv = res
    dx, dw = tangents
    cdt = inv.dtype
    xc, wc, inv_ = x.astype(cdt), weight.astype(cdt), inv[..., None]
    dxc, dwc = dx.astype(cdt), dw.astype(cdt)
    d_inv = -(inv_**3) * jnp.mean(xc * dxc, axis=-1, keepdims=True)
    dy = (dxc * inv_ + xc * d_inv) * wc + xc * inv_ * dwc
    return dy.astype(jnp.result_type(x, weight))


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd, jvp=_rms_norm_jvp)
_rms_norm_compiled = jax.jit(_rms_norm, static_argnums=2)
