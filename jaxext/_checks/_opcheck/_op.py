"""The op under test: ``f(*args)`` seen as a function of its floating-point array leaves.

``opcheck``'s checks all need the same few views of the caller's op: call it with
other values for its float array leaves (differentiable inputs), draw random
cotangents and tangents of the right structure, take VJPs and JVPs, and compare
two results leaf by leaf. They live here, once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _engines
from .._backward import zero_like
from .._compare import Mismatch, leaf_mismatches, unravel, widened
from .._dtype_tolerance import program_dtypes, rtol_for
from .._engines._quick import entries
from .._leaves import FloatLeaves, wide_dtype

__all__ = [
    "CheckFailed",
    "OpUnderTest",
    "assert_trees_close",
    "float_output_leaves",
    "forward_mode_error",
    "mismatch_text",
]


class CheckFailed(Exception):
    """Raised by a check with the diagnostic of its failure."""


def _is_array(leaf: Any) -> bool:
    """An array (a NumPy scalar too) or its type (``jax.ShapeDtypeStruct``)."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


@dataclasses.dataclass(frozen=True)
class OpUnderTest(FloatLeaves):
    """``func(*args)`` as a function of the float array leaves of ``args``.

    The ``FloatLeaves`` view, with ``args``' float array leaves converted to float64
    (complex ones to complex128) JAX arrays (what a user's code receives:
    ``x.at[...]``, ``table[ids]`` with traced ``ids`` and the like work); other
    leaves as given.

    Attributes:
        forward_error: why ``jax.jvp`` cannot differentiate the op (the
            ``TypeError`` a plain ``jax.custom_vjp`` raises), or ``None``.
        reference: the op's math in plain JAX, a function of the same arguments
            (``opcheck(..., reference=)``), or ``None``.
        narrow: why the op runs in the dtypes it takes rather than float64 (its
            float64 call raised this), or ``None``.
        cache: results one check computes for another (``opcheck`` puts the
            names of the selected checks under ``"selected"``).
    """

    forward_error: str | None = None
    # the same math in plain JAX (`opcheck(..., reference=)`), or None
    reference: Callable[..., Any] | None = None
    # why the op is checked in the dtypes it takes (it has no float64 path), or None
    narrow: str | None = None
    # results shared between checks (and the names of the checks selected)
    cache: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(
        cls, func: Callable[..., Any], args: tuple, reference: Callable[..., Any] | None = None
    ) -> OpUnderTest:
        """The op at ``args``' float leaves widened to float64 (complex128); an op that
        raises there but runs at the dtypes given (float32 for float64 ones) is kept at
        those, ``narrow`` saying why."""
        view = FloatLeaves.of(func, args, argument="args")
        values = [jnp.asarray(leaf, dtype=wide_dtype(leaf.dtype)) for leaf in view.values]
        fields = {f.name: getattr(view, f.name) for f in dataclasses.fields(FloatLeaves)}
        op = cls(**{**fields, "args": view.args_with(values), "reference": reference})
        try:
            jax.eval_shape(op.call, *op.primals)
        except Exception as err:  # noqa: BLE001 -- no float64 path: its own dtypes, below
            taken = [jnp.asarray(leaf, dtype=_taken_dtype(leaf.dtype)) for leaf in view.values]
            narrow = dataclasses.replace(op, args=view.args_with(taken))
            try:
                jax.eval_shape(narrow.call, *narrow.primals)
            except Exception:  # noqa: BLE001 -- it fails there too: the rows report it
                pass
            else:
                first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
                op = dataclasses.replace(narrow, narrow=f"{type(err).__name__}: {first}")
        return dataclasses.replace(op, forward_error=forward_mode_error(op))

    @property
    def precision(self) -> str:
        """The dtypes the op runs in, for a row's detail (``""`` for float64)."""
        if self.narrow is None:
            return ""
        taken = sorted({jnp.dtype(p.dtype).name for p in self.primals})
        return f"in {', '.join(taken)}: the op has no float64 path"

    # -- calling -------------------------------------------------------------------------

    @property
    def primals(self) -> list[jax.Array]:
        return self.values

    def with_only(self, subset: Sequence[int], fn: Callable | None = None) -> Callable:
        """A function of the float leaves in ``subset``; the others are constants."""
        fn = self.call if fn is None else fn
        primals = self.primals

        def partial(*chosen):
            values = list(primals)
            for index, value in zip(subset, chosen, strict=True):
                values[index] = value
            return fn(*values)

        return partial

    # -- random data ---------------------------------------------------------------------

    @property
    def work(self) -> int:
        """The entries a check's program computes, estimated (``_quick``): those of one
        call of the op (its jaxpr's ``entries``) times ``_EVALUATIONS``."""
        if "work" not in self.cache:
            jaxpr, shapes = jax.make_jaxpr(self.call, return_shape=True)(*self.primals)
            self.cache.setdefault("output_shapes", shapes)
            self.cache["work"] = _EVALUATIONS * entries(jaxpr)
        return self.cache["work"]

    def quick_jit(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``jax.jit`` of ``fn``, compiled quickly for a small op (``_quick``, as
        ``_engines.choose`` says); only for a program called at the top level."""
        return _engines.choose(self.work).jit(fn)

    @property
    def jitted(self) -> Callable[..., Any]:
        """``jax.jit`` of ``call``, one for all checks (a bound method is a new function at
        each access: jitting ``op.call`` afresh would compile the same program again)."""
        if "jitted" not in self.cache:
            self.cache["jitted"] = self.quick_jit(self.call)
        return self.cache["jitted"]

    @property
    def pullback(self) -> Callable[[Sequence[Any], Any], Any]:
        """``jax.jit`` of ``(primals, u) -> J^T u`` (the gradients of the float inputs for
        the cotangent ``u``), one for all checks: ``u`` is an argument, so every check
        that differentiates the op at the same dtypes runs the same compiled program."""
        if "pullback" not in self.cache:
            self.cache["pullback"] = self.quick_jit(lambda p, u: jax.vjp(self.call, *p)[1](u))
        return self.cache["pullback"]

    @property
    def computes_in(self) -> frozenset[np.dtype]:
        """The floating dtypes the op's programs compute in (``_dtype_tolerance``): its
        forward, its VJP and (with forward mode) its JVP, traced once."""
        if "computes_in" not in self.cache:
            self.cache["computes_in"] = _computed_dtypes(self)
        return self.cache["computes_in"]

    @property
    def rtol(self) -> float:
        """The normwise relative tolerance between two programs of the op (jit and eager,
        vmap and a loop ...): from the dtypes it computes in (``TIGHT``, 1e-9, for an op
        that computes in float64 only)."""
        return rtol_for(self.computes_in)

    def output_shapes(self) -> Any:
        """The shapes and dtypes of the op's output (traced once)."""
        if "output_shapes" not in self.cache:
            self.cache["output_shapes"] = jax.eval_shape(self.call, *self.primals)
        return self.cache["output_shapes"]

    def cotangent(self, rng: np.random.Generator, scale: float = 1.0) -> Any:
        """A random cotangent for the output (complex for a complex leaf; float0 zeros
        for non-float leaves)."""
        return jax.tree_util.tree_map(lambda o: _random_like(rng, o, scale), self.output_shapes())

    def tangents(self, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
        """Random tangents for the float inputs (complex for a complex input)."""
        # In the primal's dtype: JAX takes only a tangent of its primal's dtype.
        return tuple(
            np.asarray(_standard_normal(rng, p.shape, p.dtype), p.dtype) for p in self.primals
        )


# The op's evaluations in a check's largest program (vmap's: output, gradient and JVP
# of each of 3 batch entries, looped and vmapped), a gradient counting as two or three.
_EVALUATIONS = 32


def _standard_normal(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Standard-normal draws; for a complex ``dtype``, independent real and imaginary
    parts (a tangent or cotangent along both directions of each element)."""
    if jnp.issubdtype(dtype, jnp.complexfloating):
        pairs = rng.standard_normal((*shape, 2))
        return pairs[..., 0] + 1j * pairs[..., 1]
    return rng.standard_normal(shape)


def _taken_dtype(dtype: Any) -> np.dtype:
    """The dtype an op without a float64 path is checked in: the one given, or float32
    (complex64) for a float64 (complex128) one."""
    dtype = np.dtype(dtype)
    if dtype == np.float64:
        return np.dtype(np.float32)
    return np.dtype(np.complex64) if dtype == np.complex128 else dtype


def _computed_dtypes(op: OpUnderTest) -> frozenset[np.dtype]:
    """The dtypes of ``op.computes_in`` (``program_dtypes``: its forward, VJP and, with
    forward mode, JVP); none where its output fails to trace (its rows say why)."""
    try:
        cotangent = op.cotangent(np.random.default_rng(0))
    except Exception:  # noqa: BLE001 -- an op that fails to trace: its rows say why
        return frozenset()
    return program_dtypes(op.call, op.primals, cotangent, forward=op.forward_error is None)


def forward_mode_error(op: OpUnderTest) -> str | None:
    """Why ``jax.jvp`` cannot differentiate the op, or ``None``.

    A plain ``jax.custom_vjp`` raises its ``TypeError`` only when the JVP is
    lowered, not when it is traced, so this lowers one. An op whose primal or VJP does
    not lower at these inputs (no float64 path, a backward that raises) has no
    forward-mode error of its own: what fails is not forward mode.
    """
    primals = op.primals

    def vjp_of_zero(*p):
        out, pullback = jax.vjp(op.call, *p)
        return pullback(jax.tree_util.tree_map(zero_like, out))

    try:
        jax.jit(op.call).lower(*primals)
        jax.jit(vjp_of_zero).lower(*primals)
    except Exception:  # noqa: BLE001 -- the op or its VJP does not run: no word on forward mode
        return None
    try:
        jax.jit(lambda *p: jax.jvp(op.call, p, p)).lower(*primals)
    except TypeError as err:
        return f"TypeError: {str(err).splitlines()[0]}"
    except Exception:  # noqa: BLE001 -- an op that fails to trace fails the checks themselves
        return None
    return None


def _random_like(rng: np.random.Generator, leaf: Any, scale: float) -> Any:
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
        # A JAX array, as a backward receives in a user's code (NumPy arithmetic on a
        # NumPy cotangent would promote differently: 1.01 * g of bfloat16 is float32).
        draws = _standard_normal(rng, leaf.shape, leaf.dtype)
        return jnp.asarray(scale * draws, dtype=leaf.dtype)
    return np.zeros(leaf.shape, jax.dtypes.float0)


def float_output_leaves(tree: Any) -> list[tuple[str, Any]]:
    """``(key path, leaf)`` of the floating-point leaves of an output pytree."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [
        (jax.tree_util.keystr(path), leaf)
        for path, leaf in flat
        if _is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.inexact)
    ]


def assert_trees_close(
    actual: Any, expected: Any, *, what: str, rtol: float, atol: float = 0.0
) -> None:
    """Raises ``CheckFailed`` unless every float leaf is close, normwise per leaf.

    A leaf passes when ``max |actual - expected| <= atol + rtol * max |expected|``
    (moduli for complex leaves, compared whole):
    two programs computing the same math round differently, and normwise
    comparison does not punish entries that are small by cancellation.
    """
    a_leaves = float_output_leaves(actual)
    e_leaves = float_output_leaves(expected)
    if [p for p, _ in a_leaves] != [p for p, _ in e_leaves]:
        raise CheckFailed(
            f"{what}: the structures differ: {[p for p, _ in a_leaves]} against "
            f"{[p for p, _ in e_leaves]}."
        )
    for (path, a), (_, e) in zip(a_leaves, e_leaves, strict=True):
        a, e = widened(a), widened(e)
        if a.shape != e.shape:
            raise CheckFailed(f"{what}{path}: shape {a.shape}, expected {e.shape}.")
        found = leaf_mismatches([e], [a], atol=atol, rtol=rtol, normwise=True, nan_equal=True)
        for m in found[:1]:
            raise CheckFailed(mismatch_text(f"{what}{path}", m, unravel(m.in_element, a.shape)))


def mismatch_text(what: str, mismatch: Mismatch, element: tuple[int, ...]) -> str:
    """The diagnostic of a ``leaf_mismatches`` record whose worst entry is ``element``."""
    m = mismatch
    return (
        f"{what}: element {element} is {m.actual:.10g}, expected {m.expected:.10g} (abs error "
        f"{abs(m.actual - m.expected):.3e}, allowed {m.allowed:.3e}; {m.count} of {m.total} "
        "elements differ)."
    )
