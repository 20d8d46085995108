"""The module-like object :func:`~jaxext.cpp_extension.load` returns, and its functions."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax

from ._partition import check_rule, partitioned_call

__all__ = ["Extension", "FfiFunction"]


_OWN_RULE: Any = object()  # FfiFunction.__call__'s default: the function's own rule


class FfiFunction:
    """One registered handler, called through ``jax.ffi.ffi_call``.

    Attributes:
        name: the handler's symbol in the sources.
        target_name: the FFI target it is registered as.
        platform: ``"cpu"`` or ``"CUDA"``.
        partition: (experimental) how the kernel splits over a device mesh when it is called
            without a ``partition`` argument: ``None`` (it does not: sharded operands
            are gathered and every device computes the whole result), ``"batch"``
            or an einsum-like rule (see ``__call__``). Set by ``load(...,
            partition=...)``; may be reassigned.
    """

    def __init__(self, name: str, target_name: str, platform: str, partition: str | None = None):
        self.name = name
        self.target_name = target_name
        self.platform = platform
        self.partition = partition

    @property
    def partition(self) -> str | None:
        """The default ``partition`` rule of this function's calls (``None``: gathered)."""
        return self._partition

    @partition.setter
    def partition(self, rule: str | None) -> None:
        self._partition = check_rule(rule)

    def __call__(
        self,
        *args: Any,
        result_shape_dtypes: Any,
        vmap_method: str | None = None,
        has_side_effect: bool = False,
        input_output_aliases: dict[int, int] | None = None,
        partition: Any = _OWN_RULE,
        **attributes: Any,
    ) -> Any:
        """Calls the handler on ``args`` (arrays), eagerly or under any JAX transformation.

        Args:
            *args: the handler's buffer arguments, in order.
            result_shape_dtypes: the results' shapes and dtypes: one object with
                ``.shape`` and ``.dtype`` (a ``jax.ShapeDtypeStruct`` or an array)
                or a sequence of them, as ``jax.ffi.ffi_call`` takes it.
            vmap_method: how ``jax.vmap`` calls the handler, as in
                ``jax.ffi.ffi_call``: ``"sequential"`` (a loop of unbatched calls),
                ``"expand_dims"`` (unbatched arguments get a leading axis of size 1,
                the handler broadcasts), ``"broadcast_all"`` (every argument is
                broadcast to the batch) or ``None`` (``vmap`` raises).
            has_side_effect: keep the call even if its results are unused.
            input_output_aliases: ``{input index: output index}`` buffers to reuse
                (such results are not filled in checking mode: they hold an input).
            partition: how the kernel splits over a device mesh; default: the
                function's ``partition`` attribute (``None`` unless ``load`` set one).

                * ``None``: it does not. On operands sharded over a mesh, XLA
                  gathers every operand whole onto every device, and every device
                  runs the kernel on the whole problem; the results come back
                  replicated.
                * An einsum-like rule naming each dimension of each operand and
                  result, names separated by spaces, operands and results by
                  commas: ``"b i, o i, o -> b o"`` for ``y = x @ w.T + b``. ``...``
                  stands for any number of dimensions (matched from the right, as
                  in NumPy), ``_`` for a dimension that is never split. A named
                  dimension may be split over mesh axes: where an operand's
                  ``NamedSharding`` splits it, the call runs in ``jax.shard_map``
                  on that mesh, each device calling the kernel on its shards, and a
                  result that lacks a dimension that is split is summed over it
                  (``psum``), as ``jnp.einsum`` sums it. So a rule promises that
                  the kernel computes each result element from the operand elements
                  with the same indices, summing over the dimensions the result
                  lacks. The results keep the operands' splits.
                * ``"batch"``: short for the rule that names only the leading
                  dimension of the first operand and of every result (the other
                  operands are passed whole): elementwise kernels of one array,
                  row-wise kernels such as a linear layer's forward.

                Which dimensions are split is read from the operands: the
                sharding of concrete arrays, and under ``jit`` the sharding in
                their type (``jax.typeof(x).sharding``), which names the mesh axes
                of explicit meshes (``axis_types=Explicit``, the default of
                ``jax.make_mesh``). Under ``jit`` with ``Auto`` axes the type does
                not say, and the kernel runs as with ``None``. Inside ``shard_map``
                the kernel already sees shards, and runs as it is.
            **attributes: the handler's attributes, by name. A Python ``float`` is
                sent as float64 and an ``int`` as int64; use NumPy scalars
                (``np.float32(2)``) for other widths.

        Returns:
            What ``jax.ffi.ffi_call`` returns: an array, or a list of arrays when
            ``result_shape_dtypes`` is a sequence.
        """
        rule = self.partition if partition is _OWN_RULE else check_rule(partition)

        # The raw handler, not its checking trampoline, where results alias inputs.
        target = f"{self.target_name}.raw" if input_output_aliases else self.target_name

        def make_call(results: Any) -> Any:
            call = jax.ffi.ffi_call(
                target,
                results,
                vmap_method=vmap_method,
                has_side_effect=has_side_effect,
                input_output_aliases=input_output_aliases,
            )
            return lambda *arrays: call(*arrays, **attributes)

        try:
            if rule is None:
                return make_call(result_shape_dtypes)(*args)
            several = isinstance(result_shape_dtypes, (list, tuple))
            results = list(result_shape_dtypes) if several else [result_shape_dtypes]
            outs = partitioned_call(make_call, args, results, rule)
        except ValueError as err:
            # JAX's own message names the target and suggests "`jax.custom_jvp` or
            # `jax.custom_jvp`": name the handler and say how to give it a gradient.
            if "cannot be differentiated" not in str(err) or "FFI call" not in str(err):
                raise
            raise ValueError(self._no_derivative_message()) from None
        if not several:
            return outs[0]
        return tuple(outs) if isinstance(result_shape_dtypes, tuple) else outs

    def _no_derivative_message(self) -> str:
        return (
            f"The C++ handler `{self.name}` (FFI target `{self.target_name}`) has no derivative "
            "rule: JAX cannot differentiate (jax.grad, jax.vjp, jax.jvp ...) a call of it by "
            "itself. Give it one: call it inside a function decorated with "
            "`@jaxext.custom_vjp` and attach its rules with `.defvjp(fwd, bwd, jvp=...)` (they "
            "may call other handlers; `jvp=` for forward mode; see 'Giving it a gradient' in "
            "the C++ extensions guide), "
            "or apply `jax.lax.stop_gradient` to its inputs where no gradient is needed."
        )

    def __repr__(self) -> str:
        return f"<FfiFunction {self.name} -> FFI target {self.target_name!r} ({self.platform})>"


class Extension:
    """A loaded extension; each handler is an attribute (a ``FfiFunction``).

    Attributes:
        name: the extension's name.
        path: the shared library.
        built: whether loading it ran the compiler (``False``: taken from the cache).
        platform: ``"cpu"`` or ``"CUDA"``.
        functions: the handler names.
    """

    def __init__(
        self,
        name: str,
        path: Path,
        built: bool,
        platform: str,
        targets: Mapping[str, str],
        partition: Mapping[str, str | None] | None = None,
    ):
        self.name = name
        self.path = path
        self.built = built
        self.platform = platform
        self._functions = {
            symbol: FfiFunction(symbol, target, platform, (partition or {}).get(symbol))
            for symbol, target in targets.items()
        }

    @property
    def functions(self) -> tuple[str, ...]:
        return tuple(self._functions)

    @property
    def disabled_safety_checks(self) -> list[jax.export.DisabledSafetyCheck]:
        """What ``jax.export.export(..., disabled_checks=...)`` needs to export calls of
        these handlers.

        ``jax.export`` refuses custom calls that are not on its list of targets with
        compatibility guarantees; these ``DisabledSafetyCheck.custom_call`` entries
        allow this extension's. The process that runs the deserialized program must
        load the same extension (same sources and flags: the FFI target names are the
        same) before calling it.
        """
        targets = [f.target_name for f in self._functions.values()]
        return [
            jax.export.DisabledSafetyCheck.custom_call(name)
            for target in targets
            for name in (target, f"{target}.raw")
        ]

    def __getattr__(self, attr: str) -> FfiFunction:
        functions = self.__dict__.get("_functions", {})
        if attr in functions:
            return functions[attr]
        raise AttributeError(
            f"Extension {self.__dict__.get('name')!r} has no function {attr!r}; "
            f"it has {sorted(functions)}."
        )

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self._functions})

    def __repr__(self) -> str:
        return f"<Extension {self.name!r} from {self.path}: {', '.join(self._functions)}>"
