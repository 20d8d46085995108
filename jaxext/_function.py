"""`Function`: PyTorch's ``torch.autograd.Function`` pattern, built on ``jaxext.custom_vjp``.

``Function.apply`` lowers a class to a ``jaxext.custom_vjp`` once per argument
pattern (number of arguments, positions of the arrays) and calls it. Array
arguments are its differentiable inputs; every other argument (numbers,
strings, ``None``, tuples of ints ...) is static: the tuple of them is the op's
one nondiff argument, which never needs to be hashable (``jit`` retraces exactly
when the caller's own static arguments change) and which the eager cache keys
like any nondiff value (a value it cannot key takes the uncached path). As for
any ``jaxext.custom_vjp`` (and under ``jax.jit``), eager calls then take the
rules to be functions of their arguments: a Python number they read elsewhere
(a class attribute reassigned between calls) is read when a call signature's
program is built. ``CustomVJPPrimal.perturbed`` becomes ``ctx.needs_input_grad``.

In PyTorch ``ctx`` is one graph node that lives from the forward to the
backward. In JAX the two are separate traces (``fwd`` and ``bwd`` of the
``custom_vjp``), so whatever the forward leaves on ``ctx`` crosses over as
residuals (:meth:`FunctionCtx._residuals`, :meth:`FunctionCtx._restore`): array
leaves as residual arrays, every other Python value as static data, which costs
nothing at run time and survives ``jit``.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from ._custom_vjp import arg_label, custom_vjp, name_user_function, without_derivatives

__all__ = ["Function", "FunctionCtx", "VmapInfo", "once_differentiable"]


def _is_array(value: Any) -> bool:
    """True for JAX arrays (tracers included) and NumPy arrays, not for scalars."""
    return isinstance(value, (jax.Array, np.ndarray))


class _CtxState(NamedTuple):
    """What a ``FunctionCtx`` carries from forward to backward (and ``jvp``), as residuals."""

    saved: tuple[Any, ...]
    saved_for_forward: tuple[Any, ...]
    attributes: dict[str, Any]
    materialize_grads: bool


class FunctionCtx:
    """The context object passed as ``ctx`` to ``forward`` and ``backward``.

    Set any attribute on it in ``forward`` and read it in ``backward``: array
    values (also inside tuples, lists and dicts) become residuals, anything
    else is kept as static Python data. Values must not hide arrays inside
    objects that are not pytrees.
    """

    __slots__ = (
        "__dict__",
        "_function_name",
        "_materialize_grads",
        "_needs_input_grad",
        "_non_differentiable",
        "_saved",
        "_saved_for_forward",
    )

    def __init__(self, function_name: str, needs_input_grad: tuple[bool, ...]):
        self._function_name = function_name
        self._needs_input_grad = needs_input_grad
        self._saved: tuple[Any, ...] = ()
        self._saved_for_forward: tuple[Any, ...] = ()
        self._non_differentiable: list[Any] = []
        self._materialize_grads = True

    @property
    def needs_input_grad(self) -> tuple[bool, ...]:
        """One bool per forward argument: is it differentiated in this trace?"""
        return self._needs_input_grad

    def save_for_backward(self, *values: Any) -> None:
        """Stores arrays (or ``None``) for ``backward``, read back as ``saved_tensors``."""
        self._saved = self._checked("save_for_backward", values)

    def save_for_forward(self, *values: Any) -> None:
        """Stores arrays (or ``None``) for ``jvp``, read back there as ``saved_tensors``."""
        self._saved_for_forward = self._checked("save_for_forward", values)

    def _checked(self, method: str, values: tuple[Any, ...]) -> tuple[Any, ...]:
        for i, value in enumerate(values):
            if value is not None and not _is_array(value):
                raise TypeError(
                    f"`{self._function_name}`: {method} accepts arrays or None; "
                    f"value {i} is a {type(value).__name__}. Store other Python values as "
                    "ctx attributes instead (e.g. `ctx.scale = scale`)."
                )
        return values

    @property
    def saved_tensors(self) -> tuple[Any, ...]:
        """The values given to ``save_for_backward`` (in ``jvp``: to ``save_for_forward``)."""
        return self._saved

    @property
    def saved_variables(self) -> tuple[Any, ...]:
        """Alias of ``saved_tensors``, for code written for older PyTorch."""
        return self._saved

    def mark_non_differentiable(self, *outputs: Any) -> None:
        """Declares outputs (the very objects ``forward`` returns) non-differentiable.

        No gradient flows back through them; ``backward`` receives zeros as
        their cotangents.
        """
        self._non_differentiable.extend(outputs)

    def set_materialize_grads(self, value: bool) -> None:
        """With ``False``, ``backward`` gets ``None`` instead of zero arrays for zero cotangents."""
        self._materialize_grads = bool(value)

    def mark_dirty(self, *args: Any) -> None:
        """Unsupported: JAX arrays are immutable, so nothing is modified in place."""
        raise TypeError(
            f"`{self._function_name}`: mark_dirty has no JAX equivalent because JAX arrays are "
            "immutable; return a new array from forward instead of modifying an input."
        )

    # -- crossing from forward to backward (used by Function.apply only) ---------------

    def _non_differentiable_flags(self, outputs: tuple[Any, ...]) -> tuple[bool, ...]:
        """One flag per output: was it given to ``mark_non_differentiable``?"""
        marked = self._non_differentiable
        for k, value in enumerate(marked):
            if not any(value is o for o in outputs):
                raise ValueError(
                    f"`{self._function_name}.forward`: value {k} given to "
                    "mark_non_differentiable is not one of the returned outputs (pass the "
                    "very array objects that forward returns)."
                )
        return tuple(any(o is m for m in marked) for o in outputs)

    def _residuals(self) -> _CtxState:
        """What ``backward`` and ``jvp`` read, as a pytree of residuals and static data."""
        # None is an empty pytree: `x if ctx.needs_input_grad[1] else None` saves nothing.
        return _CtxState(
            self._saved, self._saved_for_forward, dict(vars(self)), self._materialize_grads
        )

    @classmethod
    def _restore(
        cls,
        function_name: str,
        needs_input_grad: tuple[bool, ...],
        state: _CtxState,
        *,
        for_jvp: bool = False,
    ) -> FunctionCtx:
        """The ``ctx`` that ``backward`` (or, with ``for_jvp``, ``jvp``) receives."""
        ctx = cls(function_name, needs_input_grad)
        ctx._saved = state.saved_for_forward if for_jvp else state.saved
        ctx._materialize_grads = state.materialize_grads
        for key, value in state.attributes.items():
            setattr(ctx, key, value)
        return ctx


def once_differentiable(backward: Callable[..., Any]) -> Callable[..., Any]:
    """Declares that a :class:`jaxext.Function`'s ``backward`` must not be differentiated.

    First-order gradients work as usual. Asking JAX for a second-order
    derivative through the backward (``grad`` of ``grad``, ``jacrev`` of
    ``grad`` ...) raises ``RuntimeError`` at trace time instead of silently
    differentiating code that was not written for it. Put it under
    ``@staticmethod``, as in PyTorch.

    Args:
        backward: the ``backward(ctx, *grad_outputs)`` function.

    Returns:
        The same function, tagged for ``Function.apply``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import jaxext
        >>> class Cube(jaxext.Function):
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         ctx.save_for_backward(x)
        ...         return x**3
        ...     @staticmethod
        ...     @jaxext.once_differentiable
        ...     def backward(ctx, g):
        ...         (x,) = ctx.saved_tensors
        ...         return g * 3 * x**2
        >>> jax.grad(Cube.apply)(jnp.float32(2.0))
        Array(12., dtype=float32)
    """

    return _OnceDifferentiable(backward)


class _OnceDifferentiable:
    """A ``backward`` tagged by :func:`once_differentiable` (a declared type, not a flag)."""

    def __init__(self, backward: Callable[..., Any]):
        functools.update_wrapper(self, backward)
        self.backward = backward

    def __call__(self, ctx: FunctionCtx, *grad_outputs: Any) -> Any:
        return self.backward(ctx, *grad_outputs)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        # Bound like a plain function when used without @staticmethod.
        return self if instance is None else functools.partial(self, instance)


class VmapInfo(NamedTuple):
    """The ``info`` a :class:`Function`'s ``vmap`` staticmethod receives, as in PyTorch.

    Attributes:
        batch_size: the size of the axis being mapped.
        randomness: PyTorch's vmap randomness mode. JAX's randomness is explicit
            (a key argument, batched or not), so this is always ``"error"``,
            PyTorch's default.
    """

    batch_size: int
    randomness: str


def _batch_first(name: str, result: Any) -> tuple[Any, Any]:
    """A ``vmap`` staticmethod's ``(output, out_dims)`` as ``(output, out_batched)``.

    Batched outputs get their batch axis first; ``out_dims`` is one int or None for
    every output, or one per output.
    """
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise TypeError(
            f"`{name}.vmap` must return `(output, out_dims)`; got {type(result).__name__}."
        )
    output, out_dims = result
    tuple_output = isinstance(output, (tuple, list))
    outputs = tuple(output) if tuple_output else (output,)
    dims = tuple(out_dims) if isinstance(out_dims, (tuple, list)) else (out_dims,) * len(outputs)
    if len(dims) != len(outputs) or not all(d is None or isinstance(d, int) for d in dims):
        raise ValueError(
            f"`{name}.vmap`: `out_dims` must be an int or None, or one per output "
            f"({len(outputs)}); got {out_dims!r}."
        )
    moved = tuple(
        o if d is None else jnp.moveaxis(o, d, 0) for o, d in zip(outputs, dims, strict=True)
    )
    flags = tuple(d is not None for d in dims)
    return (moved, flags) if tuple_output else (moved[0], flags[0])


class Function:
    """Base class for custom differentiable functions written the PyTorch way.

    Subclass it with static methods, then call ``YourFunction.apply``:

    * ``forward(ctx, *args)`` computes the output(s) with ``jax.numpy``. Array
      arguments (JAX or NumPy arrays, tracers) are differentiable inputs; any
      other argument is static, like PyTorch's non-Tensor arguments. Stash what
      the backward needs with ``ctx.save_for_backward(...)`` or as ``ctx``
      attributes; ``ctx.mark_non_differentiable(out)`` and
      ``ctx.set_materialize_grads(False)`` work as in PyTorch. Or, in the style
      PyTorch 2 recommends, ``forward(*args)`` without ``ctx`` plus
      ``setup_context(ctx, inputs, output)``.
    * ``backward(ctx, *grad_outputs)`` receives one cotangent per output (zeros
      for outputs that get none) and returns one gradient per forward
      argument: ``None`` means zero (with a warning when that argument is
      differentiated), extra trailing ``None`` are allowed, a static argument
      must get ``None``. A gradient must have its input's shape; a float
      gradient of another width is cast to the input's dtype.
      ``ctx.saved_tensors`` (alias ``saved_variables``) and
      ``ctx.needs_input_grad`` (true exactly for the arguments differentiated
      in this trace) are available.
    * Optionally ``jvp(ctx, *grad_inputs)``: one tangent per forward argument
      (``None`` for static ones) to the output tangent(s), reading what forward
      stored with ``ctx.save_for_forward(...)`` as ``ctx.saved_tensors``.

    The result works under ``jit``, ``vmap``, ``grad``, ``jacrev`` and, when
    ``backward`` is made of ``jax.numpy`` ops, ``grad`` of ``grad``. Forward
    mode (``jvp``, ``jacfwd``, ``hessian``) uses ``jvp`` when it is defined and
    otherwise the transpose of ``backward`` (see :class:`jaxext.custom_vjp`).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import jaxext
        >>> class MulConstant(jaxext.Function):
        ...     @staticmethod
        ...     def forward(ctx, tensor, constant):
        ...         ctx.constant = constant
        ...         return tensor * constant
        ...     @staticmethod
        ...     def backward(ctx, grad_output):
        ...         return grad_output * ctx.constant, None
        >>> jax.grad(lambda x: MulConstant.apply(x, 3.0).sum())(jnp.ones(2))
        Array([3., 3.], dtype=float32)
        >>> jax.jvp(lambda x: MulConstant.apply(x, 3.0), (jnp.ones(2),), (jnp.ones(2),))[1]
        Array([3., 3.], dtype=float32)
    """

    @staticmethod
    def forward(ctx: FunctionCtx, *args: Any) -> Any:
        raise NotImplementedError("Function subclasses must define a static `forward`.")

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple[Any, ...], output: Any) -> None:
        raise NotImplementedError  # overridden by subclasses in the setup_context style

    @staticmethod
    def backward(ctx: FunctionCtx, *grad_outputs: Any) -> Any:
        raise NotImplementedError("Function subclasses must define a static `backward`.")

    @staticmethod
    def jvp(ctx: FunctionCtx, *grad_inputs: Any) -> Any:
        raise NotImplementedError  # optional: forward mode otherwise comes from backward

    @staticmethod
    def vmap(info: VmapInfo, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        raise NotImplementedError  # optional: a batching rule (PyTorch 2's vmap staticmethod)

    #: As in PyTorch; without a ``vmap`` method JAX batches ``forward``'s operations either way.
    generate_vmap_rule: bool = False

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        """Runs ``forward`` with the hand-written ``backward`` as its VJP.

        Args:
            *args: the forward arguments (after ``ctx`` when forward takes one).
            **kwargs: forward arguments by name, bound as PyTorch binds them. In
                the ``setup_context`` style they map onto ``forward``'s parameters
                and defaults are filled in, so ``setup_context`` receives every
                input. In the ``forward(ctx, ...)`` style defaults are not filled
                in, and a keyword must not skip an earlier parameter.

        Returns:
            What ``forward`` returns: an array, or a tuple of arrays.

        Raises:
            TypeError: if ``forward``/``backward`` is not defined, a keyword
                argument leaves a gap, a static argument contains arrays, or
                ``forward`` returns something other than arrays.
        """
        name = cls.__name__
        for method in ("forward", "backward"):
            if getattr(cls, method) is getattr(Function, method):
                raise TypeError(f"`{name}` must define a static `{method}` method.")
        args = _bind(cls, args, kwargs)
        diff_positions = tuple(i for i, arg in enumerate(args) if _is_array(arg))
        for i, arg in enumerate(args):
            if i not in diff_positions and any(map(_is_array, jax.tree_util.tree_leaves(arg))):
                raise TypeError(
                    f"`{name}.apply`: {_arg_label(cls, i)} is a {type(arg).__name__} holding "
                    "arrays; pass each differentiable array as its own argument."
                )
        diff_values = [
            args[i] if isinstance(args[i], jax.Array) else jnp.asarray(args[i])
            for i in diff_positions
        ]
        if not any(isinstance(v, jax.core.Tracer) for v in diff_values):
            # Nothing is traced, so nothing can differentiate this call: run forward alone.
            _, outputs, tuple_output, _ = _run_forward(
                cls, args, diff_positions, diff_values, (False,) * len(args)
            )
            return tuple(outputs) if tuple_output else outputs[0]
        # The static arguments reach the op as one nondiff argument (see _Lowered).
        statics = tuple(arg for i, arg in enumerate(args) if i not in diff_positions)
        lowered = _lowered(cls, len(args), diff_positions, _closes_over_tracers(cls))
        return lowered.op(*diff_values, statics)


def _overrides(cls: type[Function], method: str) -> bool:
    return getattr(cls, method) is not getattr(Function, method)


class _Meta(NamedTuple):
    """What bwd needs besides the arrays: Python data, kept static by custom_vjp."""

    needs_input_grad: tuple[bool, ...]
    inputs: tuple[Any, ...]  # (shape, dtype) per argument, or the static value's type name
    outputs: tuple[tuple[tuple[int, ...], Any, bool], ...]  # (shape, dtype, non-differentiable)
    tuple_output: bool


_METHODS = ("forward", "setup_context", "backward", "jvp", "vmap")


def _same(kept: tuple[Any, ...], methods: tuple[Any, ...]) -> bool:
    """Whether the class's methods are the very objects it was lowered with."""
    # (`==` for a classmethod, which is bound afresh at each lookup)
    return all(a is b or a == b for a, b in zip(kept, methods, strict=True))


def _lowered(
    cls: type[Function], n_args: int, diff_positions: tuple[int, ...], hoist: bool
) -> _Lowered:
    """The class's :class:`_Lowered` for this argument pattern, built at its first call.

    Kept in the class's own ``__dict__`` (a subclass gets its own), as PyTorch builds an
    op's autograd kernel once: no ``custom_vjp`` is built after the first call of a
    pattern, so the eager cache, which keeps its entries per ``custom_vjp``, serves later
    calls. ``hoist``: whether the rules visibly close over tracers (see
    :func:`_closes_over_tracers`), which only picks the entry.

    Raises:
        TypeError: if the class both defines ``vmap`` and sets ``generate_vmap_rule``, or
            defines ``vmap`` without ``setup_context`` (checked once per class).
    """
    # A method assigned anew (a class patched between calls) is a new set of rules, as a
    # new `defvjp` is for a custom_vjp: checked and lowered afresh.
    methods = (*(getattr(cls, m) for m in _METHODS), cls.generate_vmap_rule)
    kept = cls.__dict__.get("__jaxext_lowered__")
    if kept is None or not _same(kept[0], methods):
        _check_class(cls)
        kept = (methods, {})
        cls.__jaxext_lowered__ = kept  # type: ignore[attr-defined]
    built = kept[1]
    key = (n_args, diff_positions, hoist)
    lowered = built.get(key)
    if lowered is None:
        lowered = built[key] = _Lowered(cls, n_args, diff_positions, hoist)
    return lowered


def _check_class(cls: type[Function]) -> None:
    """Raises where the class's ``vmap`` staticmethod breaks PyTorch's rules for it."""
    name = cls.__name__
    if _overrides(cls, "vmap") and cls.generate_vmap_rule:
        raise TypeError(
            f"`{name}` both defines a `vmap` staticmethod and sets "
            "generate_vmap_rule=True; choose one (as PyTorch requires)."
        )
    if _overrides(cls, "vmap") and not _overrides(cls, "setup_context"):
        raise TypeError(
            f"`{name}` defines a `vmap` staticmethod, so it must use the setup_context "
            "style (`forward(*args)` without ctx, plus `setup_context(ctx, inputs, "
            "output)`), as PyTorch requires for its transforms."
        )


class _Lowered:
    """A ``Function``'s rules for one argument pattern, as the ``jaxext.custom_vjp`` :attr:`op`.

    Built once per class, number of arguments and positions of the array arguments (see
    :func:`_lowered`). :attr:`op` takes the array arguments, then ``statics``, the tuple
    of the other (static) arguments in their order, as its one nondiff argument: the
    eager cache keys it as it keys any nondiff value. Each rule of ``op`` is one method:
    :meth:`primal` (forward alone), :meth:`fwd`, :meth:`bwd`, :meth:`jvp` (when the class
    defines ``jvp``) and :meth:`vmap` (when it defines a ``vmap`` staticmethod).

    As PyTorch runs ``forward`` under ``no_grad``, :meth:`fwd` runs it on inputs cut
    from any outer derivative, and hands its outputs out through :attr:`attached`, a
    second ``custom_vjp`` that returns them unchanged and whose rules
    (:meth:`attached_fwd`, :meth:`attached_bwd`, :meth:`attached_jvp`) are this
    Function's own: differentiated again (a second or higher order), the outputs get
    their derivatives from ``backward``/``jvp``, as in PyTorch, even for a ``forward``
    JAX cannot differentiate.
    """

    def __init__(
        self, cls: type[Function], n_args: int, diff_positions: tuple[int, ...], hoist: bool
    ):
        self.cls, self.n_args, self.diff_positions = cls, n_args, diff_positions
        self.name = name = cls.__name__
        # With @once_differentiable, the message of the error any derivative of backward
        # raises.
        self.once = (
            f"`{name}.backward` is decorated with @once_differentiable, so it cannot be "
            "differentiated: a second-order derivative (e.g. grad of grad, or jax.hessian) "
            "was requested through it. Remove the decorator if the backward is built from "
            "differentiable jax.numpy operations."
            if isinstance(cls.backward, _OnceDifferentiable)
            else None
        )
        self.batching_rule = _overrides(cls, "vmap")
        options: dict[str, Any] = {
            "forward_mode_hint": (
                f"define a static method `jvp(ctx, *grad_inputs)` on `{name}`, reading what "
                "forward stored with `ctx.save_for_forward(...)`"
            ),
            "no_derivatives_message": self.once,
            # The rules run once per differentiation, as in torch: they are dry-run to hoist
            # the tracers they close over only where they visibly close over some.
            "hoist_closures": hoist,
        }
        has_jvp = _overrides(cls, "jvp")
        # `attached(values, outputs, statics)` returns `outputs` (computed by forward).
        self.attached: custom_vjp = custom_vjp(
            lambda values, outputs, statics: list(outputs), nondiff_argnums=(2,), **options
        )
        self.attached.defvjp(
            self.attached_fwd,
            self.attached_bwd,
            symbolic_zeros=True,
            jvp=self.attached_jvp if has_jvp else None,
        )
        self.op: custom_vjp = custom_vjp(
            _named(self.primal, name, origin=(cls, diff_positions)),
            nondiff_argnums=(len(diff_positions),),
            **options,
        )
        self.op.defvjp(self.fwd, self.bwd, symbolic_zeros=True, jvp=self.jvp if has_jvp else None)
        if self.batching_rule:
            self.op.def_vmap(self.vmap)

    def full_args(self, statics: tuple[Any, ...]) -> list[Any]:
        """Forward's arguments with ``statics`` in place and ``None`` at the array positions."""
        it = iter(statics)
        diff = set(self.diff_positions)
        return [None if i in diff else next(it) for i in range(self.n_args)]

    def run_forward(
        self,
        statics: tuple[Any, ...],
        diff_values: Sequence[Any],
        needs_input_grad: tuple[bool, ...],
        evaluate: Callable[..., Any] | None = None,
    ) -> tuple[FunctionCtx, list[jax.Array], bool, tuple[bool, ...]]:
        """:func:`_run_forward` with this pattern's class and the call's static arguments."""
        return _run_forward(
            self.cls,
            self.full_args(statics),
            self.diff_positions,
            diff_values,
            needs_input_grad,
            evaluate,
        )

    def primal(self, *args: Any) -> Any:
        """Forward alone (no derivative asked for): ``args`` are the arrays, then ``statics``."""
        *diff_values, statics = args
        _, outputs, tuple_output, _ = self.run_forward(statics, diff_values, (False,) * self.n_args)
        return tuple(outputs) if tuple_output else outputs[0]

    def vmap(self, axis_size: int, in_batched: Sequence[bool], *args: Any) -> Any:
        """The class's ``vmap`` staticmethod as ``custom_vjp.def_vmap``'s rule."""
        *diff_values, statics = args
        full, in_dims = self.full_args(statics), [None] * self.n_args
        for i, value, batched in zip(
            self.diff_positions, diff_values, in_batched[: len(diff_values)], strict=True
        ):
            full[i], in_dims[i] = value, (0 if batched else None)
        result = self.cls.vmap(VmapInfo(axis_size, "error"), tuple(in_dims), *full)
        return _batch_first(self.name, result)

    def fwd(self, *args: Any) -> tuple[Any, tuple[_CtxState, _Meta]]:
        """Forward on frozen inputs; outputs through :attr:`attached`; ``ctx`` as residuals.

        ``args``: the arrays (as ``CustomVJPPrimal``), then ``statics``.
        """
        *primals, statics = args
        values = [p.value for p in primals]
        needs = [False] * self.n_args
        for i, p in zip(self.diff_positions, primals, strict=True):
            needs[i] = bool(p.perturbed)
        values = [v if isinstance(v, jax.Array) else jnp.asarray(v) for v in values]
        # Forward runs on inputs cut from any outer derivative (as PyTorch runs it under
        # no_grad); the saved inputs and outputs are then relinked to their differentiable
        # versions (see _relinked). Other saved intermediates are constants, as in torch.
        # (JAX arrays: forward then receives these very objects, which the relinking needs.)
        frozen = [jax.lax.stop_gradient(jnp.asarray(v)) for v in values]
        # With a vmap rule, the outputs come from the op itself, so that vmap uses the rule.
        evaluate = (lambda *v: self.op(*v, statics)) if self.batching_rule else None
        ctx, outputs, tuple_output, non_diff = self.run_forward(
            statics, frozen, tuple(needs), evaluate
        )
        inputs = [type(arg).__name__ for arg in self.full_args(statics)]
        for i, value in zip(self.diff_positions, values, strict=True):
            inputs[i] = (value.shape, value.dtype)
        meta = _Meta(
            tuple(needs),
            tuple(inputs),
            tuple((o.shape, o.dtype, nd) for o, nd in zip(outputs, non_diff, strict=True)),
            tuple_output,
        )
        live = self.attached(values, outputs, statics)
        # Outputs after inputs: an output that is an input as forward received it
        # (`return x`) is relinked to the output.
        state = _relinked(ctx._residuals(), [*frozen, *outputs], [*values, *live])
        return (tuple(live) if tuple_output else live[0]), (state, meta)

    def bwd(
        self, statics: tuple[Any, ...], residuals: tuple[_CtxState, _Meta], cotangents: Any
    ) -> tuple[Any, ...]:
        """The user's ``backward``, one gradient per differentiable argument."""
        del statics  # backward reads what forward kept on ctx
        state, meta = residuals
        cotangents = _materialize(
            meta, state.materialize_grads, cotangents if meta.tuple_output else (cotangents,)
        )
        if cotangents is None:  # nothing flows back: skip the user's backward
            return (None,) * len(self.diff_positions)
        if self.once:
            # Every array the backward reads (saved, or kept as a ctx attribute) is an
            # explicit input of `without_derivatives`, so a derivative through any of them,
            # reverse or forward, raises.
            leaves, treedef = jax.tree_util.tree_flatten(state)
            arrays = [leaf for leaf in leaves if _is_array(leaf)]

            def call(arrays, cotangents):
                it = iter(arrays)
                rebuilt = [next(it) if _is_array(leaf) else leaf for leaf in leaves]
                return _run_backward(self.cls, meta, treedef.unflatten(rebuilt), cotangents)

            grads = without_derivatives(call, self.once)(arrays, cotangents)
        else:
            grads = _run_backward(self.cls, meta, state, cotangents)
        return tuple(grads[i] if meta.needs_input_grad[i] else None for i in self.diff_positions)

    def jvp(
        self, statics: tuple[Any, ...], residuals: tuple[_CtxState, _Meta], tangents: Sequence[Any]
    ) -> Any:
        """The user's ``jvp``: the output tangent(s), checked against the outputs."""
        del statics  # jvp reads what forward kept on ctx
        name = self.name
        state, meta = residuals
        ctx = FunctionCtx._restore(name, meta.needs_input_grad, state, for_jvp=True)
        # As in PyTorch: None for static and integer inputs, a (maybe zero) array for floats.
        grad_inputs: list[Any] = [None] * self.n_args
        for i, tangent in zip(self.diff_positions, tangents, strict=True):
            if jnp.issubdtype(meta.inputs[i][1], jnp.inexact):
                grad_inputs[i] = tangent
        out = self.cls.jvp(ctx, *grad_inputs)
        if meta.tuple_output:
            out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            if len(out) != len(meta.outputs):
                raise ValueError(
                    f"`{name}.jvp` must return one tangent per output of forward "
                    f"({len(meta.outputs)}); got {len(out)}."
                )
            return tuple(
                _output_tangent(name, k, t, spec)
                for k, (t, spec) in enumerate(zip(out, meta.outputs, strict=True))
            )
        return _output_tangent(name, 0, out, meta.outputs[0])

    # `attached`'s rules: :meth:`fwd`, :meth:`bwd` and :meth:`jvp` with `values` as the
    # differentiable inputs and `outputs` (forward's, already computed) as none.

    def attached_fwd(
        self, values: list[CustomVJPPrimal], outputs: Any, statics: tuple[Any, ...]
    ) -> tuple[list[Any], tuple[_CtxState, _Meta]]:
        out, residuals = self.fwd(*values, statics)
        return list(out) if isinstance(out, tuple) else [out], residuals

    def attached_bwd(
        self, statics: tuple[Any, ...], residuals: tuple[_CtxState, _Meta], cotangents: list[Any]
    ) -> tuple[list[Any], list[None]]:
        _, meta = residuals
        grads = self.bwd(
            statics, residuals, tuple(cotangents) if meta.tuple_output else cotangents[0]
        )
        return list(grads), [None] * len(cotangents)

    def attached_jvp(
        self, statics: tuple[Any, ...], residuals: tuple[_CtxState, _Meta], tangents: Any
    ) -> list[Any]:
        out = self.jvp(statics, residuals, tuple(tangents[0]))
        return list(out) if isinstance(out, tuple) else [out]


def _closes_over_tracers(cls: type[Function]) -> bool:
    """Whether ``backward`` or ``jvp`` visibly closes over a tracer (a jit-traced scale).

    Looks at the closure cells of the methods, of the functions found there, and at the
    class's own attributes; forward mode then hoists those tracers (see
    ``custom_vjp``'s ``hoist_closures``), which needs a dry run of the rules.
    """
    seen: set[int] = set()
    stack: list[Any] = [getattr(cls, name) for name in ("backward", "jvp")]
    stack += [v for k, v in vars(cls).items() if not k.startswith("__")]
    while stack:
        value = stack.pop()
        if isinstance(value, _OnceDifferentiable):
            value = value.backward
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, jax.core.Tracer):
            return True
        if isinstance(value, (staticmethod, classmethod)):
            stack.append(value.__func__)
        elif inspect.isfunction(value):
            for cell in value.__closure__ or ():
                try:
                    stack.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    continue
        elif isinstance(value, (tuple, list, dict)):
            stack.extend(jax.tree_util.tree_leaves(value))
    return False


def _named(
    method: Callable[..., Any], name: str, origin: tuple[type, tuple[int, ...]] | None = None
) -> Callable[..., Any]:
    """``method`` as a plain function called ``name`` (the op's name in errors and jaxprs).

    With ``origin``, ``(cls, diff_positions)``: the function stands for ``cls.forward``
    called with its arguments at ``diff_positions``, then the tuple of its static ones
    (see :class:`_Lowered`); it carries their names (and ``statics``) as its signature,
    and ``forward`` as ``_jaxext_origin``, so that an error raised while JAX traces it
    names the user's ``forward`` and arguments.
    """

    def call(*args: Any) -> Any:
        return method(*args)

    call.__name__ = call.__qualname__ = name
    if origin is not None:
        cls, diff_positions = origin
        skip = 0 if _overrides(cls, "setup_context") else 1
        try:
            params = list(inspect.signature(cls.forward).parameters.values())[skip:]
        except (TypeError, ValueError):
            params = []
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        names = [
            params[i].name if i < len(params) and params[i].kind in positional else f"args[{i}]"
            for i in diff_positions
        ]
        if len(set(names)) == len(names) and all(n.isidentifier() for n in names):
            call.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
                [
                    inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY)
                    for n in [*names, _unused_name("statics", names)]
                ]
            )
        call._jaxext_origin = cls.forward  # type: ignore[attr-defined]
    return call


def _unused_name(name: str, taken: Sequence[str]) -> str:
    """``name``, with underscores prepended until it is not among ``taken``."""
    while name in taken:
        name = f"_{name}"
    return name


def _relinked(state: _CtxState, stale: Sequence[Any], live: Sequence[Any]) -> _CtxState:
    """``state`` with each leaf that *is* ``stale[k]`` (the very object) replaced by ``live[k]``.

    What ``ctx`` kept of forward's frozen inputs and of its outputs (saved tensors,
    attributes) becomes the differentiable inputs and outputs, so that ``backward`` and
    ``jvp`` are differentiable through them, as in PyTorch; any other leaf stays as it
    is. Identity is what counts, as in PyTorch (a saved tensor *is* an output): ``id``
    only indexes the candidates, ``is`` decides (both objects are alive here, so their
    ids are distinct and stable). An object listed twice in ``stale`` (an input that
    forward returns as it is) gets the later ``live`` value.
    """
    by_id = {id(s): (s, v) for s, v in zip(stale, live, strict=True)}

    def relink(leaf: Any) -> Any:
        found = by_id.get(id(leaf))
        return found[1] if found is not None and found[0] is leaf else leaf

    return jax.tree_util.tree_map(relink, state)


def _run_forward(cls, args, diff_positions, diff_values, needs_input_grad, evaluate=None):
    """Runs the user's forward (and setup_context): ``(ctx, outputs, tuple?, non-diff flags)``.

    ``evaluate``, if given, computes forward's result from the differentiable values
    (the op itself, so that its batching rule applies); only in the setup_context style.
    """
    name = cls.__name__
    full = list(args)
    for i, value in zip(diff_positions, diff_values, strict=True):
        # A JAX array, never a Python scalar (JAX may hand differentiated scalars over as
        # typed Python floats): forward and setup_context may read .shape and .dtype.
        full[i] = value if isinstance(value, jax.Array) else jnp.asarray(value)
    ctx = FunctionCtx(name, needs_input_grad)
    try:
        if _overrides(cls, "setup_context"):
            raw = cls.forward(*full) if evaluate is None else evaluate(*diff_values)
            cls.setup_context(ctx, tuple(full), raw)
        else:
            raw = cls.forward(ctx, *full)
    except jax.errors.ConcretizationTypeError as err:  # a Python `if` on a traced value
        name_user_function(err, cls.forward, None)
        raise
    outputs, tuple_output = _check_outputs(name, raw)
    non_diff = ctx._non_differentiable_flags(raw if tuple_output else (raw,))
    return ctx, outputs, tuple_output, non_diff


def _output_tangent(name: str, k: int, tangent: Any, spec: tuple) -> Any:
    shape, dtype, non_differentiable = spec
    if tangent is None:
        return jnp.zeros(shape, dtype) if jnp.issubdtype(dtype, jnp.inexact) else None
    if non_differentiable or not jnp.issubdtype(dtype, jnp.inexact):
        why = "marked non-differentiable" if non_differentiable else f"of dtype {dtype}"
        raise ValueError(
            f"`{name}.jvp` returned a tangent for output {k}, which is {why}: return None "
            "at that position instead (as PyTorch requires)."
        )
    if not _is_array(tangent):
        raise TypeError(
            f"`{name}.jvp` must return arrays (or None) as output tangents; got "
            f"{type(tangent).__name__}."
        )
    if jnp.issubdtype(dtype, jnp.inexact) and jnp.dtype(tangent.dtype) != jnp.dtype(dtype):
        tangent = tangent.astype(dtype)  # float widths are cast, as for backward's gradients
    return tangent


def _materialize(
    meta: _Meta, materialize: bool, cotangents: tuple[Any, ...]
) -> tuple[Any, ...] | None:
    """One cotangent per output, zeros (or None) where none flows; None if all are zero."""
    result, any_nonzero = [], False
    for ct, (shape, dtype, non_diff) in zip(cotangents, meta.outputs, strict=True):
        zero = non_diff or not jnp.issubdtype(dtype, jnp.inexact) or isinstance(ct, SymbolicZero)
        any_nonzero = any_nonzero or not zero
        result.append((jnp.zeros(shape, dtype) if materialize else None) if zero else ct)
    return tuple(result) if any_nonzero else None


def _run_backward(cls, meta: _Meta, state: _CtxState, cotangents) -> list[Any]:
    ctx = FunctionCtx._restore(cls.__name__, meta.needs_input_grad, state)
    return _check_grads(cls, meta, cls.backward(ctx, *cotangents))


def _check_grads(cls, meta: _Meta, grads: Any) -> list[Any]:
    """Validates backward's result against the inputs; casts float widths."""
    name, n = cls.__name__, len(meta.inputs)
    grads = tuple(grads) if isinstance(grads, (tuple, list)) else (grads,)
    if len(grads) < n or any(g is not None for g in grads[n:]):
        raise ValueError(
            f"`{name}.backward` returned {len(grads)} gradient(s); expected {n}, one per "
            "argument given to forward (extra trailing values must be None)."
        )
    checked = []
    for i, (g, spec) in enumerate(zip(grads[:n], meta.inputs, strict=True)):
        label = functools.partial(_arg_label, cls, i)  # made for an error only: reads forward
        if g is not None and isinstance(spec, str):
            raise TypeError(
                f"`{name}.backward` returned a gradient for {label()}, but that argument is "
                f"static (a {spec}, not an array); return None for it."
            )
        if g is not None and not _is_array(g):
            raise TypeError(
                f"`{name}.backward`: the gradient for {label()} must be an array or None; "
                f"got {type(g).__name__}."
            )
        if g is None and not isinstance(spec, str) and meta.needs_input_grad[i]:
            _warn_missing_gradient(name, label(), i, spec[1])
        if g is None or isinstance(spec, str):
            checked.append(None)
            continue
        shape, dtype = spec
        if g.shape != shape:
            raise ValueError(
                f"`{name}.backward`: the gradient for {label()} must have the input's shape "
                f"{shape}; got shape {g.shape}."
            )
        if not jnp.issubdtype(dtype, jnp.inexact):  # integer/bool input: never differentiated
            checked.append(None)
            continue
        complex_to_real = jnp.issubdtype(g.dtype, jnp.complexfloating) and not jnp.issubdtype(
            dtype, jnp.complexfloating
        )
        if not jnp.issubdtype(g.dtype, jnp.inexact) or complex_to_real:
            raise TypeError(
                f"`{name}.backward`: the gradient for {label()} must be a floating array "
                f"matching the input's dtype {dtype}; got dtype {g.dtype}."
            )
        checked.append(jnp.asarray(g).astype(dtype))
    return checked


def _warn_missing_gradient(name: str, label: str, i: int, dtype: Any) -> None:
    if jnp.issubdtype(dtype, jnp.inexact):
        warnings.warn(
            f"`{name}.backward` returned None for {label}, which is differentiated "
            f"(ctx.needs_input_grad[{i}] is True): its gradient is taken as zero. Return "
            "its gradient, or zeros explicitly if zero is right.",
            UserWarning,
            stacklevel=2,
        )


def _check_outputs(name: str, raw: Any) -> tuple[list[jax.Array], bool]:
    tuple_output = isinstance(raw, (tuple, list))
    items = tuple(raw) if tuple_output else (raw,)
    if not items or not all(map(_is_array, items)):
        got = type(raw).__name__ if not tuple_output else [type(o).__name__ for o in items]
        raise TypeError(f"`{name}.forward` must return an array or a tuple of arrays; got {got}.")
    return [o if isinstance(o, jax.Array) else jnp.asarray(o) for o in items], tuple_output


def _bind(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Forward's arguments by position, bound as ``torch.autograd.Function.apply`` binds them.

    In the ``setup_context`` style, ``forward`` has no ``ctx``: keywords are mapped
    onto its parameters and defaults filled in, so ``setup_context`` sees every
    input. In the ``forward(ctx, ...)`` style, keywords are mapped after ``ctx``
    and defaults are not filled in; a keyword that leaves a gap is an error.
    """
    name = cls.__name__
    setup_style = _overrides(cls, "setup_context")
    if not kwargs and not setup_style:
        return args
    try:
        signature = inspect.signature(cls.forward)
    except (TypeError, ValueError):
        if kwargs:
            raise TypeError(
                f"`{name}.apply`: keyword arguments need a forward with a signature."
            ) from None
        return args
    try:
        bound = (
            signature.bind(*args, **kwargs)
            if setup_style
            else signature.bind(None, *args, **kwargs)
        )
    except TypeError as err:
        raise TypeError(f"`{name}.apply`: {err}.") from None
    if setup_style:
        bound.apply_defaults()
    if bound.kwargs:
        raise TypeError(
            f"`{name}.apply`: keyword argument(s) {sorted(bound.kwargs)} must come "
            "with every earlier forward argument given as well."
            if not setup_style
            else f"`{name}.apply`: keyword-only parameter(s) {sorted(bound.kwargs)} of "
            "forward are not supported; make them positional."
        )
    return tuple(bound.args) if setup_style else tuple(bound.args[1:])


def _arg_label(cls, i: int) -> str:
    """``argument 2 (`bias`)``: forward's ``i``-th argument after ``ctx`` (if it takes one)."""
    return arg_label(cls.forward, i, skip=0 if _overrides(cls, "setup_context") else 1)
