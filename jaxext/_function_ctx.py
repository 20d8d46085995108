"""The ``ctx`` object of :class:`jaxext.Function`, and ``once_differentiable``.

In PyTorch ``ctx`` is one graph node that lives from the forward to the
backward. In JAX the two are separate traces (``fwd`` and ``bwd`` of a
``jaxext.custom_vjp``), so whatever the forward leaves on ``ctx`` crosses over
as residuals: array leaves as residual arrays, every other Python value as
static data, which costs nothing at run time and survives ``jit``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

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
            if value is not None and not is_array(value):
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


def refusing_rule(function_name: str) -> Callable[..., Any]:
    """A derivative rule that raises: the backward of ``function_name`` is once differentiable."""

    def refuse(*_: Any) -> Any:
        raise RuntimeError(
            f"`{function_name}.backward` is decorated with @once_differentiable, so it cannot "
            "be differentiated: a second-order derivative (e.g. grad of grad, or "
            "jax.hessian) was requested through it. Remove the decorator if the backward is "
            "built from differentiable jax.numpy operations."
        )

    return refuse


def call_blocking_derivatives(
    function_name: str, call: Callable[[Any, Any], Any], arrays: Any, cotangents: Any
) -> Any:
    """Evaluates ``call(arrays, cotangents)`` in a ``jaxext.custom_vjp`` whose rules raise.

    Every array the backward reads is an explicit input here, so a derivative
    through any of them, reverse or forward, reaches a raising rule. Transposing
    the backward (first-order forward mode of the Function) is not differentiating
    it, and still works: JAX transposes the primal ``call``.
    """
    from ._custom_vjp import custom_vjp  # _custom_vjp imports nothing of Function's

    refuse = refusing_rule(function_name)
    run = custom_vjp(call)
    run.defvjp(lambda arrays, cotangents: (call(arrays, cotangents), None), refuse, jvp=refuse)
    return run(arrays, cotangents)
