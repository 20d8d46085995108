"""The ``ctx`` object of :class:`jaxext.Function`, and ``once_differentiable``.

In PyTorch ``ctx`` is one graph node that lives from the forward to the
backward. In JAX the two are separate traces (``custom_vjp``'s ``fwd`` and
``bwd``), so whatever the forward leaves on ``ctx`` must cross over as
residuals: array leaves travel as residual arrays, every other Python value
travels as static data inside the residual pytree's structure, which costs
nothing at run time and survives ``jit``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from ._validation import Static

__all__ = ["FunctionCtx", "is_array", "once_differentiable"]

_ONCE_FLAG = "_jaxext_once_differentiable"


def is_array(value: Any) -> bool:
    """True for JAX arrays (tracers included) and NumPy arrays, not for scalars."""
    return isinstance(value, (jax.Array, np.ndarray))


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
    )

    def __init__(self, function_name: str, needs_input_grad: tuple[bool, ...]):
        self._function_name = function_name
        self._needs_input_grad = needs_input_grad
        self._saved: tuple[Any, ...] = ()
        self._non_differentiable: list[Any] = []
        self._materialize_grads = True

    @property
    def needs_input_grad(self) -> tuple[bool, ...]:
        """One bool per forward argument: is it differentiated in this trace?"""
        return self._needs_input_grad

    def save_for_backward(self, *values: Any) -> None:
        """Stores arrays (or ``None``) for ``backward``, read back as ``saved_tensors``."""
        for i, value in enumerate(values):
            if value is not None and not is_array(value):
                raise TypeError(
                    f"`{self._function_name}`: save_for_backward accepts arrays or None; "
                    f"value {i} is a {type(value).__name__}. Store other Python values as "
                    "ctx attributes instead (e.g. `ctx.scale = scale`)."
                )
        self._saved = values

    @property
    def saved_tensors(self) -> tuple[Any, ...]:
        """The values given to ``save_for_backward``, in order."""
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


class _CtxState(NamedTuple):
    """Static half of a packed ctx: the pytree layout and its non-array leaves."""

    treedef: Any
    static_leaves: tuple[Any, ...]  # None where an array leaf sits
    array_mask: tuple[bool, ...]
    materialize_grads: bool


def pack_ctx(ctx: FunctionCtx) -> tuple[list[jax.Array], Static]:
    """Splits ``ctx``'s saved values and attributes into residual arrays and static data."""
    # A None is an array slot left empty, so that saving `x if needed else None`
    # keeps the same layout whatever is differentiated (see _residuals.py).
    leaves, treedef = jax.tree_util.tree_flatten(
        (ctx._saved, dict(vars(ctx))), is_leaf=lambda v: v is None
    )
    mask = tuple(leaf is None or is_array(leaf) for leaf in leaves)
    arrays = [leaf for leaf, is_arr in zip(leaves, mask, strict=True) if is_arr]
    static = tuple(None if is_arr else leaf for leaf, is_arr in zip(leaves, mask, strict=True))
    return arrays, Static(_CtxState(treedef, static, mask, ctx._materialize_grads))


def unpack_ctx(
    function_name: str,
    needs_input_grad: tuple[bool, ...],
    arrays: list[jax.Array],
    packed: Static,
) -> FunctionCtx:
    """Rebuilds, for ``backward``, the ctx that ``pack_ctx`` split up."""
    state: _CtxState = packed.value
    remaining = iter(arrays)
    leaves = [
        next(remaining) if is_arr else leaf
        for leaf, is_arr in zip(state.static_leaves, state.array_mask, strict=True)
    ]
    saved, attributes = jax.tree_util.tree_unflatten(state.treedef, leaves)
    ctx = FunctionCtx(function_name, needs_input_grad)
    ctx._saved = saved
    ctx._materialize_grads = state.materialize_grads
    for name, value in attributes.items():
        setattr(ctx, name, value)
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

    @functools.wraps(backward)
    def wrapper(ctx, *grad_outputs):
        return backward(ctx, *grad_outputs)

    setattr(wrapper, _ONCE_FLAG, True)
    return wrapper


def is_once_differentiable(backward: Callable[..., Any]) -> bool:
    return bool(getattr(backward, _ONCE_FLAG, False))


def call_blocking_derivatives(
    function_name: str, call: Callable[[Any, Any], Any], arrays: Any, cotangents: Any
) -> Any:
    """Evaluates ``call(arrays, cotangents)`` inside a ``custom_vjp`` whose backward raises.

    Every array the backward reads is an explicit input here, so a derivative
    through any of them reaches the raising rule.
    """

    @jax.custom_vjp
    def run(arrays, cotangents):
        return call(arrays, cotangents)

    def run_fwd(arrays, cotangents):
        return run(arrays, cotangents), None

    def run_bwd(_, __):
        raise RuntimeError(
            f"`{function_name}.backward` is decorated with @once_differentiable, so it cannot "
            "be differentiated: a second-order derivative (e.g. grad of grad) was requested "
            "through it. Remove the decorator if the backward is built from differentiable "
            "jax.numpy operations."
        )

    run.defvjp(run_fwd, run_bwd)
    return run(arrays, cotangents)
