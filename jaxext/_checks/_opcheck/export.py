"""opcheck's rows about ``jax.export``: the op serialized and run back, with concrete
(``export``) and symbolic (``export_symbolic``) shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from .._settings import Settings
from ._common import (
    Skip,
    fresh,
    vjp,
)
from ._kernels import disabled_safety_checks
from ._op import (
    CheckFailed,
    OpUnderTest,
    assert_trees_close,
)

__all__ = ["export", "export_symbolic"]


def _require_serializer() -> None:
    """Skips an export check where jax.export cannot serialize: a missing package, not the op."""
    try:
        import flatbuffers  # noqa: F401 -- what jax.export's serialization imports
    except ImportError:
        raise Skip(
            "jax.export serialization needs the flatbuffers package (pip install 'jaxext[export]')"
        ) from None


def _round_trip(fn: Callable, specs: list) -> Callable:
    # The C++ kernels of jaxext.cpp_extension are custom calls without JAX's
    # compatibility guarantees: exporting them needs this opt-in (and the extension
    # loaded where the export is run).
    exported = jax.export.export(jax.jit(fn), disabled_checks=disabled_safety_checks())(*specs)
    return jax.export.deserialize(exported.serialize()).call


def export(op: OpUnderTest, settings: Settings) -> str:
    _require_serializer()
    rng = np.random.default_rng(settings.seed + 9)
    primals, u = op.primals, op.cotangent(rng)
    specs = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in primals]
    gradient = lambda *p: vjp(fresh(op), p, u)  # noqa: E731
    try:
        call = _round_trip(fresh(op), specs)
        call_gradient = _round_trip(gradient, specs)
    except Exception as err:  # noqa: BLE001 -- not exportable: reported, not raised
        raise CheckFailed(
            f"the op cannot be exported with jax.export: {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}"
        ) from err
    assert_trees_close(call(*primals), op.jitted(*primals), what="exported output", rtol=op.rtol)
    expected = jax.jit(gradient)(*primals)
    for label, a, e in zip(op.labels, call_gradient(*primals), expected, strict=True):
        assert_trees_close(a, e, what=f"exported gradient of {label}", rtol=op.rtol)
    return "serialized, deserialized and called: same values and gradients"


def export_symbolic(op: OpUnderTest, settings: Settings) -> str:
    _require_serializer()
    primals = op.primals
    batched = next((i for i, p in enumerate(primals) if p.ndim >= 2), None)
    if batched is None:
        raise Skip("no float input has two or more dimensions to give a symbolic batch dimension")
    if primals[batched].shape[0] == 0:
        raise Skip(
            f"{op.labels[batched]} has an empty leading dimension: jax.export's symbolic "
            "dimensions are at least 1, so it cannot be called with 0"
        )
    leading = primals[batched].shape[0]
    # The symbolic dimension on input `batched` alone; where the op ties its shape to
    # another input's (two inputs of an elementwise op), on every float input of the
    # same leading dimension: one shared batch dimension; and on the integer array inputs
    # of that leading dimension too (token labels sharing the batch dimension), which
    # are then inputs of the exported function rather than constants of its shape.
    shared = [i for i, p in enumerate(primals) if p.ndim >= 1 and p.shape[0] == leading]
    leaves, treedef = jax.tree_util.tree_flatten(op.args)
    others = [
        position
        for position, leaf in enumerate(leaves)
        if position not in op.positions
        and isinstance(leaf, (jax.Array, np.ndarray))
        and leaf.ndim >= 1
        and leaf.shape[0] == leading
    ]
    attempts = [([batched], [])] + ([(shared, [])] if shared != [batched] else [])
    attempts += [(shared, others)] if others else []
    for symbolic, tied in attempts:
        specs = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in primals]
        specs += [jax.ShapeDtypeStruct(leaves[q].shape, leaves[q].dtype) for q in tied]
        scope = jax.export.SymbolicScope()  # one `b` for all of them
        for k, value in [(i, primals[i]) for i in symbolic] + [
            (len(primals) + n, leaves[q]) for n, q in enumerate(tied)
        ]:
            dims = ", ".join(["b", *map(str, value.shape[1:])])
            shape = jax.export.symbolic_shape(dims, scope=scope)
            specs[k] = jax.ShapeDtypeStruct(shape, value.dtype)

        def fn(*values, tied=tied):
            new = list(leaves)
            for q, value in zip(tied, values[len(primals) :], strict=True):
                new[q] = value
            args = tuple(jax.tree_util.tree_unflatten(treedef, new))
            return op.func(*op.args_with(values[: len(primals)], args))

        try:
            call = _round_trip(fn, specs)
            break
        except Exception as err:  # noqa: BLE001 -- a capability the op lacks, not a wrong result
            if symbolic == [batched] and not tied:
                first_error = err
    else:
        message = str(first_error).splitlines()[0] if str(first_error) else ""
        raise Skip(
            f"the op does not trace with a symbolic leading dimension of {op.labels[batched]} "
            f"({type(first_error).__name__}: {message[:200]})"
        ) from first_error
    tied_values = [leaves[q] for q in tied]
    names = " and ".join(op.labels[i] for i in symbolic)
    if tied:
        names += f" and {len(tied)} integer input(s) of the same leading dimension"
    what = f"a symbolic leading dimension of {names}"
    assert_trees_close(
        call(*primals, *tied_values),
        op.jitted(*primals),
        what=f"output exported with {what}",
        rtol=op.rtol,
    )
    return f"exported with {what}: same values"
