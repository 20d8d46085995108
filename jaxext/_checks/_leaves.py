"""The caller's ``func(*args)`` as a function of the floating-point array leaves of ``args``.

Both entry points see the function this way: ``gradcheck`` flattens these leaves into
one float64 vector (``_problem``), ``opcheck`` calls the op with other values for
them (``_op``). Which leaves are checked, how messages name them (``"input 1['w']"``,
``"output 0['y']"``) and how the function is called with new values are decided here,
once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "FloatLeaves",
    "float_dtype",
    "input_label",
    "is_complex",
    "output_label",
    "private_copies",
    "wide_dtype",
]


def private_copies(args: tuple) -> tuple:
    """``args`` with every NumPy array copied, so the checks never hand JAX the caller's.

    JAX remembers a NumPy array it converted with x64 on: after the checks (which run
    with x64) the same object would come back from ``jnp.asarray`` as float64 with x64
    off, and the caller's next ``jax.grad`` would see float64 where it expects float32.
    """
    return jax.tree_util.tree_map(
        lambda leaf: leaf.copy() if isinstance(leaf, np.ndarray) else leaf, args
    )


def float_dtype(leaf: Any, label: str) -> np.dtype | None:
    """The dtype of a checked (real or complex floating array) leaf, else ``None``.

    ``label`` names the leaf (kept for callers' messages).
    """
    del label
    if not isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
        return None  # Python/NumPy scalars and other objects are static
    return leaf.dtype if jnp.issubdtype(leaf.dtype, jnp.inexact) else None


def is_complex(leaf: Any) -> bool:
    """Whether an array leaf (or its ``ShapeDtypeStruct``) is complex."""
    return jnp.issubdtype(leaf.dtype, jnp.complexfloating)


def wide_dtype(dtype: Any) -> np.dtype:
    """float64, or complex128 for a complex ``dtype``: the precision the checks run in."""
    return np.dtype(np.complex128 if jnp.issubdtype(dtype, jnp.complexfloating) else np.float64)


def input_label(path: Any) -> str:
    """How messages name the input leaf at key path ``path`` in ``args``: ``"input 1['w']"``."""
    return f"input {path[0].idx}{jax.tree_util.keystr(path[1:])}"


def output_label(position: int, path: Any) -> str:
    """How messages name the output leaf at ``position`` (key path ``path``)."""
    full = jax.tree_util.keystr(path)
    shown = "" if full in ("", f"[{position}]") else full
    return f"output {position}{shown}"


@dataclasses.dataclass(frozen=True)
class FloatLeaves:
    """``func(*args)`` as a function of the float array leaves of ``args``.

    Attributes:
        func: the caller's function.
        args: its positional arguments.
        positions: leaf positions (in ``args``' flattening) of the float arrays.
        labels: how messages name those leaves, e.g. ``"input 1['w']"``.
        indices: the positional argument each float leaf is in.
        paths: each float leaf's key path inside its positional argument.
    """

    func: Callable[..., Any]
    args: tuple
    positions: tuple[int, ...]
    labels: tuple[str, ...]
    indices: tuple[int, ...]
    paths: tuple[str, ...]

    @staticmethod
    def fields_of(args: tuple, *, argument: str) -> dict[str, tuple]:
        """``positions``, ``labels``, ``indices`` and ``paths`` of the float leaves of
        ``args``; ``ValueError`` naming ``argument`` if there is none."""
        found: dict[str, list] = {"positions": [], "labels": [], "indices": [], "paths": []}
        for position, (path, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(args)[0]):
            index, sub, label = path[0].idx, jax.tree_util.keystr(path[1:]), input_label(path)
            if float_dtype(leaf, label) is None:
                continue
            for name, value in zip(found, (position, label, index, sub), strict=True):
                found[name].append(value)
        if not found["positions"]:
            raise ValueError(
                f"`{argument}` holds no floating-point array to differentiate (Python and "
                "NumPy scalars are constants: pass np.asarray(value) to differentiate one)."
            )
        return {name: tuple(values) for name, values in found.items()}

    @classmethod
    def of(cls, func: Callable[..., Any], args: tuple, *, argument: str = "args") -> FloatLeaves:
        """The view of ``func`` at ``args``; ``argument`` names ``args`` in errors."""
        return cls(func, args, **cls.fields_of(args, argument=argument))

    @property
    def values(self) -> list[Any]:
        """The float leaves, as given."""
        return self.float_leaves(self.args)

    def float_leaves(self, args: tuple) -> list[Any]:
        """The float leaves of ``args`` (the op's arguments, or others of their structure)."""
        leaves = jax.tree_util.tree_leaves(args)
        return [leaves[p] for p in self.positions]

    def args_with(self, values: Sequence[Any], args: tuple | None = None) -> tuple:
        """``args`` (default: the view's) with its float leaves replaced by ``values``."""
        leaves, treedef = jax.tree_util.tree_flatten(self.args if args is None else args)
        for position, value in zip(self.positions, values, strict=True):
            leaves[position] = value
        return tuple(jax.tree_util.tree_unflatten(treedef, leaves))

    def call(self, *values: Any) -> Any:
        """``func`` at the float leaves ``values`` (the other arguments as given)."""
        return self.func(*self.args_with(values))
