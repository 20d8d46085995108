"""The module-like object :func:`~jaxext.cpp_extension.load` returns, and its functions."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax

__all__ = ["Extension", "FfiFunction"]


class FfiFunction:
    """One registered handler, called through ``jax.ffi.ffi_call``.

    Attributes:
        name: the handler's symbol in the sources.
        target_name: the FFI target it is registered as.
        platform: ``"cpu"`` or ``"CUDA"``.
    """

    def __init__(self, name: str, target_name: str, platform: str):
        self.name = name
        self.target_name = target_name
        self.platform = platform

    def __call__(
        self,
        *args: Any,
        result_shape_dtypes: Any,
        vmap_method: str | None = None,
        has_side_effect: bool = False,
        input_output_aliases: dict[int, int] | None = None,
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
            **attributes: the handler's attributes, by name. A Python ``float`` is
                sent as float64 and an ``int`` as int64; use NumPy scalars
                (``np.float32(2)``) for other widths.

        Returns:
            What ``jax.ffi.ffi_call`` returns: an array, or a list of arrays when
            ``result_shape_dtypes`` is a sequence.
        """
        # The raw handler, not its checking trampoline, where results alias inputs.
        target = f"{self.target_name}.raw" if input_output_aliases else self.target_name
        call = jax.ffi.ffi_call(
            target,
            result_shape_dtypes,
            vmap_method=vmap_method,
            has_side_effect=has_side_effect,
            input_output_aliases=input_output_aliases,
        )
        return call(*args, **attributes)

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
        self, name: str, path: Path, built: bool, platform: str, targets: Mapping[str, str]
    ):
        self.name = name
        self.path = path
        self.built = built
        self.platform = platform
        self._functions = {
            symbol: FfiFunction(symbol, target, platform) for symbol, target in targets.items()
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
