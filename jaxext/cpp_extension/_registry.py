"""Loading a built library and registering its handlers as XLA FFI targets.

Each handler is registered as ``<extension name>_<build key>.<symbol>``: the
extension's name keeps two extensions with the same function names apart, and the
build key keeps apart two builds of one extension in one process (a source edited
and loaded again), which XLA would otherwise refuse as a duplicate registration.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from pathlib import Path

import jax

from ._errors import ExtensionError, MissingHandlerError

__all__ = ["register_handlers"]

_LOCK = threading.Lock()
# (target name, platform) -> library path, for the targets registered in this process.
_REGISTERED: dict[tuple[str, str], str] = {}


def register_handlers(
    extension: str, library: Path, prefix: str, symbols: Sequence[str], platform: str
) -> dict[str, str]:
    """Registers ``symbols`` of ``library`` for ``platform``.

    Args:
        extension: the extension's name, for error messages.
        library: path of the shared library.
        prefix: the qualifier put before each symbol's name.
        symbols: the handler symbols to register.
        platform: ``"cpu"`` or ``"CUDA"``.

    Returns:
        ``{symbol: target name}``.

    Raises:
        MissingHandlerError: if ``library`` does not export one of ``symbols``.
    """
    handle = ctypes.CDLL(str(library))
    pointers = {}
    for symbol in symbols:
        try:
            pointers[symbol] = getattr(handle, symbol)
        except AttributeError:
            raise MissingHandlerError(
                f"Extension {extension!r} has no handler symbol {symbol!r} (library "
                f"{library}). Define it in the sources with "
                f"XLA_FFI_DEFINE_HANDLER_SYMBOL({symbol}, ...), which exports it with C "
                "linkage, or fix the name in `functions`."
            ) from None
    targets = {}
    with _LOCK:
        # Registering before the backend starts is deferred, and a clash found then
        # would break the backend itself: start it first so XLA checks each one now.
        _start_backend(extension, platform)
        for symbol, pointer in pointers.items():
            target = f"{prefix}.{symbol}"
            if _REGISTERED.get((target, platform)) != str(library):
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(pointer), platform=platform)
                _REGISTERED[(target, platform)] = str(library)
            targets[symbol] = target
    return targets


def _start_backend(extension: str, platform: str) -> None:
    try:
        jax.devices("cpu" if platform == "cpu" else "gpu")
    except RuntimeError as err:
        raise ExtensionError(
            f"Extension {extension!r} has {platform} handlers, but JAX has no such backend "
            f"here ({err}). CUDA handlers need a CUDA build of jaxlib (`pip install "
            "'jax[cuda12]'`) and a GPU."
        ) from None
