"""The caller's function and pytrees as one flat float64 function ``R^n -> R^m``.

``first_order`` turns ``func(*args)`` into a function of one flat float64
vector, ``Problem.f``, whose input blocks are the floating-point array leaves of
``args`` and whose output blocks are the floating-point leaves of the result.
A complex leaf is two real ones: its block holds the real and imaginary part of
each element, interleaved (``z.view(float64)``), so the numerical Jacobian
perturbs both directions. JAX's convention links its VJP to that real view: the
cotangent of ``(Re w, Im w)`` entries ``(a, b)`` is the complex ``a - ib``, and a
gradient ``g`` of ``z`` is the pair ``(Re g, -Im g)`` (a cotangent ``c`` pairs
with a tangent ``t`` as ``Re(c t)``; for holomorphic ``f``, ``vjp(c) = c f'(z)``).
Each block is a ``Segment`` that remembers which input or output it came from,
so failures can be reported in the caller's terms. ``second_order`` builds the
function that ``gradgradcheck`` differentiates: the VJP of ``Problem.f`` as a
function of the inputs and the cotangent.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._leaves import FloatLeaves, float_dtype, output_label

__all__ = [
    "Problem",
    "Segment",
    "first_order",
    "grad_output_leaves",
    "second_order",
    "second_order_forward",
]


@dataclasses.dataclass(frozen=True)
class Segment:
    """A block of the flat input or output vector: one array leaf of the caller's."""

    index: int  # positional input index, or output leaf index
    path: str  # key path (inputs: inside the positional argument; outputs: full)
    shape: tuple[int, ...]
    offset: int
    label: str  # how messages name it, e.g. "input 1['w']"
    complex: bool = False  # two flat entries per element: real and imaginary part

    @property
    def size(self) -> int:
        return math.prod(self.shape) * (2 if self.complex else 1)

    @property
    def slice(self) -> slice:
        return slice(self.offset, self.offset + self.size)


@dataclasses.dataclass(frozen=True)
class Problem:
    """A flat float64 function ``f: R^n -> R^m`` with labelled input/output blocks."""

    f: Callable[[jax.Array], jax.Array]
    x0: jax.Array
    # x -> (f(x), pullback: u -> J(x)^T u); each input block's gradient is cast to float64
    # before the blocks are joined, so a backward of the wrong dtype cannot break the check.
    vjp: Callable[[jax.Array], tuple[jax.Array, Callable[[jax.Array], jax.Array]]]
    inputs: tuple[Segment, ...]
    outputs: tuple[Segment, ...]
    order: int
    out_treedef: Any = None  # structure of func's output (first order only)
    out_positions: tuple[int, ...] = ()  # leaf position of each output segment
    inner: str = "rev"  # order 2: the first derivative differentiated, VJP or JVP


def _as_real(value: jax.Array, complex_: bool) -> jax.Array:
    """A leaf as flat float64 entries: ``(Re, Im)`` interleaved for a complex one."""
    if complex_:
        value = jnp.asarray(value, jnp.complex128)
        return jnp.stack([jnp.real(value), jnp.imag(value)], axis=-1).ravel()
    return jnp.ravel(value).astype(jnp.float64)


def _as_complex(flat: jax.Array, segment: Segment, sign: float = 1.0) -> jax.Array:
    """The inverse of ``_as_real`` for ``segment`` (``sign=-1``: ``Re - i Im``, a cotangent)."""
    if segment.complex:
        pairs = flat.reshape(*segment.shape, 2)
        return jax.lax.complex(pairs[..., 0], sign * pairs[..., 1])
    return flat.reshape(segment.shape)


def _gradient_as_real(grad: jax.Array, complex_: bool) -> jax.Array:
    """A gradient as flat float64 entries: ``(Re g, -Im g)`` for a complex input (the
    derivatives along its real and imaginary part, in JAX's convention); for a real
    input, the real part of a (wrongly) complex gradient, as JAX's convention reads it."""
    grad = jnp.asarray(grad)
    if complex_:
        grad = grad.astype(jnp.complex128)
        return jnp.stack([jnp.real(grad), -jnp.imag(grad)], axis=-1).ravel()
    return jnp.ravel(jnp.real(grad)).astype(jnp.float64)


_WIDE = (np.dtype(np.float64), np.dtype(np.complex128))


def first_order(func: Callable[..., Any], args: tuple) -> tuple[Problem, list[str], list[str]]:
    """Flattens ``func`` at ``args`` into a ``Problem``.

    Also returns the labels of the float inputs that are not float64 (they are
    upcast) and of the float outputs that are not float64 (computed in lower
    precision by ``func`` itself), for the caller to warn about.
    """
    view = FloatLeaves.of(func, args, argument="inputs")
    segments, arrays, low = [], [], []
    offset = 0
    for leaf, label, index, sub in zip(
        view.values, view.labels, view.indices, view.paths, strict=True
    ):
        dtype = np.dtype(leaf.dtype)
        if dtype not in _WIDE:
            low.append(f"{label} ({dtype})")
        complex_ = jnp.issubdtype(dtype, jnp.complexfloating)
        array = np.asarray(leaf).astype(np.complex128 if complex_ else np.float64)
        segment = Segment(index, sub, array.shape, offset, label, complex_)
        segments.append(segment)
        arrays.append(array.reshape(-1).view(np.float64) if complex_ else array.ravel())
        offset += segment.size
    # device_put, not jnp.asarray: the latter compiles a small program on a process's
    # first call, which is a good part of a small check's cold time.
    x0 = jax.device_put(np.concatenate(arrays))
    out_positions: list[int] = []

    def f_tree(x):
        return view.call(*(_as_complex(x[segment.slice], segment) for segment in segments))

    def flat_outputs(tree):
        outs = jax.tree_util.tree_leaves(tree)
        parts = [
            _as_real(outs[p], segment.complex)
            for segment, p in zip(outputs, out_positions, strict=True)
        ]
        return jnp.concatenate(parts) if parts else jnp.zeros((0,))

    def f(x):
        return flat_outputs(f_tree(x))

    def vjp(x):
        blocks = [_as_complex(x[segment.slice], segment) for segment in segments]
        out, vjp_fn = jax.vjp(view.call, *blocks)
        out_leaves, out_def = jax.tree_util.tree_flatten(out)

        def pullback(u):
            cotangents = [np.zeros(leaf.shape, jax.dtypes.float0) for leaf in out_leaves]
            for segment, position in zip(outputs, out_positions, strict=True):
                leaf = out_leaves[position]
                ct = _as_complex(u[segment.slice], segment, sign=-1.0)
                cotangents[position] = ct.astype(leaf.dtype)
            grads = vjp_fn(jax.tree_util.tree_unflatten(out_def, cotangents))
            return jnp.concatenate(
                [_gradient_as_real(g, s.complex) for g, s in zip(grads, segments, strict=True)]
            )

        return flat_outputs(out), pullback

    example = jax.eval_shape(f_tree, x0)
    outputs, offset, low_out = [], 0, []
    example_leaves, out_treedef = jax.tree_util.tree_flatten_with_path(example)
    for position, (path, leaf) in enumerate(example_leaves):
        label = output_label(position, path)
        dtype = float_dtype(leaf, label)
        if dtype is None:
            continue  # integer and boolean outputs are not checked
        if dtype not in _WIDE:
            low_out.append(f"{label} ({dtype})")
        full = jax.tree_util.keystr(path)
        complex_ = jnp.issubdtype(dtype, jnp.complexfloating)
        outputs.append(Segment(position, full, leaf.shape, offset, label, complex_))
        out_positions.append(position)
        offset += outputs[-1].size
    if not outputs:
        raise ValueError("`func` returned no floating-point array to check.")
    problem = Problem(
        f, x0, vjp, tuple(segments), tuple(outputs), 1, out_treedef, tuple(out_positions)
    )
    return problem, low, low_out


def grad_output_leaves(grad_outputs: Any, treedef: Any) -> list[Any]:
    """The leaves of the caller's ``grad_outputs``, which must have the structure
    ``treedef`` of the function's output (a 1-tuple stands for a single output, a PyTorch
    habit).

    Raises:
        ValueError: if the structures differ.
    """
    single = jax.tree_util.treedef_is_leaf(treedef)
    if single and isinstance(grad_outputs, (tuple, list)) and len(grad_outputs) == 1:
        grad_outputs = grad_outputs[0]
    structure = jax.tree_util.tree_structure(grad_outputs)
    if structure != treedef:
        raise ValueError(
            f"`grad_outputs` must have the structure of `func`'s output, {treedef}; "
            f"got {structure}."
        )
    return jax.tree_util.tree_leaves(grad_outputs)


def _given_grad_outputs(grad_outputs: Any, first: Problem, low: list[str]) -> list[np.ndarray]:
    leaves = grad_output_leaves(grad_outputs, first.out_treedef)
    cotangents = []
    for segment, position in zip(first.outputs, first.out_positions, strict=True):
        label = f"grad_outputs for {segment.label}"
        dtype = float_dtype(leaves[position], label)
        complex_ = dtype is not None and jnp.issubdtype(dtype, jnp.complexfloating)
        if (
            dtype is None
            or np.shape(leaves[position]) != segment.shape
            or (complex_ and not segment.complex)
        ):
            kind = "complex or real" if segment.complex else "real floating-point"
            raise ValueError(
                f"`grad_outputs`: {label} must be a {kind} array of shape "
                f"{segment.shape}; got {type(leaves[position]).__name__} of shape "
                f"{np.shape(leaves[position])}"
                + (f" and dtype {dtype}." if dtype is not None else ".")
            )
        if dtype not in _WIDE:
            low.append(f"{label} ({dtype})")
        value = np.asarray(leaves[position])
        if segment.complex:  # the cotangent c of (Re, Im) entries (Re c, -Im c)
            value = value.astype(np.complex128).conj().reshape(-1).view(np.float64)
        cotangents.append(value.astype(np.float64))
    return cotangents


def _appended_inputs(
    segments: tuple[Segment, ...], num_args: int, n_x: int, what: str
) -> tuple[Segment, ...]:
    """Input segments for one ``what`` (grad_outputs, tangent) per segment, after the ``n_x``
    entries of the positional inputs; like PyTorch, they count as inputs after those."""
    return tuple(
        Segment(
            num_args + s.index, s.path, s.shape, n_x + s.offset,
            f"input {num_args + s.index} ({what} for {s.label})", s.complex,
        )
        for s in segments
    )  # fmt: skip


def _flat_vjp(g: Callable[[jax.Array], jax.Array]) -> Callable:
    """``z -> (g(z), u -> J_g(z)^T u)`` for a function of one flat vector."""

    def vjp(z):
        y, vjp_fn = jax.vjp(g, z)
        return y, lambda u: vjp_fn(u)[0]

    return vjp


def second_order(
    first: Problem, grad_outputs: Any, num_args: int, seed: int
) -> tuple[Problem, list[str]]:
    """The problem ``(x, v) -> vjp(first.f, x)(v)``, inputs ``x`` then ``v``.

    ``v`` is ``grad_outputs`` flattened, or standard-normal draws from ``seed``.
    Also returns the labels of the ``grad_outputs`` that are upcast.
    """
    low: list[str] = []
    if grad_outputs is None:
        rng = np.random.default_rng(seed)
        cotangents = [rng.standard_normal(segment.size) for segment in first.outputs]
    else:
        cotangents = _given_grad_outputs(grad_outputs, first, low)
    n_x = first.x0.shape[0]
    ct_inputs = _appended_inputs(first.outputs, num_args, n_x, "grad_outputs")
    gradients = tuple(
        Segment(
            s.index,
            s.path,
            s.shape,
            s.offset,
            f"output {s.index}{s.path} (the gradient of {s.label})",
            s.complex,
        )
        for s in first.inputs
    )

    # The pullback gives a complex input's gradient g as (Re g, -Im g): flipped back to
    # (Re g, Im g), so that reports show the gradient's own imaginary part.
    signs = np.ones(n_x)
    for segment in first.inputs:
        if segment.complex:
            signs[segment.offset + 1 : segment.offset + segment.size : 2] = -1.0

    def g(z):
        return first.vjp(z[:n_x])[1](z[n_x:]) * signs

    z0 = jnp.concatenate([first.x0, jnp.asarray(np.concatenate([c.ravel() for c in cotangents]))])
    return Problem(g, z0, _flat_vjp(g), first.inputs + ct_inputs, gradients, order=2), low


def second_order_forward(first: Problem, num_args: int, seed: int) -> Problem:
    """The problem ``(x, t) -> jvp(first.f, x)(t)``, inputs ``x`` then ``t``.

    ``t`` holds standard-normal tangents from ``seed``, one block per input block;
    they count as inputs after the positional ones. Differentiating this problem in
    reverse or forward mode checks reverse-over-forward or forward-over-forward
    second derivatives: what a forward rule (a ``jvp`` rule, or forward mode derived
    from a backward) gets wrong at second order only.
    """
    rng = np.random.default_rng(seed)
    tangents = [rng.standard_normal(segment.size) for segment in first.inputs]
    n_x = first.x0.shape[0]
    t_inputs = _appended_inputs(first.inputs, num_args, n_x, "tangent")
    outputs = tuple(
        Segment(s.index, s.path, s.shape, s.offset, f"{s.label} (its JVP)", s.complex)
        for s in first.outputs
    )

    def g(z):
        return jax.jvp(first.f, (z[:n_x],), (z[n_x:],))[1]

    t0 = np.concatenate([t.ravel() for t in tangents]) if tangents else np.zeros(0)
    z0 = jnp.concatenate([first.x0, jnp.asarray(t0)])
    return Problem(g, z0, _flat_vjp(g), first.inputs + t_inputs, outputs, order=2, inner="fwd")
