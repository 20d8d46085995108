"""Loading a built library and registering its handlers as XLA FFI targets.

Each handler is registered as ``<extension name>_<target key>.<symbol>``: the
extension's name keeps two extensions with the same function names apart, and the
target key (a hash of the sources, the extension's own headers as the compiler read
them, the flags and the platform, but not of the compiler, the system's headers or
the build directory; see ``_build.target_key``) keeps apart two builds of one
extension in one process (a source or header edited and loaded again), which XLA
would otherwise refuse as a duplicate registration. The same sources loaded again, from
the same or another build directory (or a prebuilt library), get the handlers
already registered; and a program exported with ``jax.export`` names the same
targets in every process that loads the same sources.

CPU handlers are registered through the checking trampolines of ``_native`` (the
target name) and also as they are (``<target>.raw``, for calls whose results alias
an input, which checking mode must not fill).
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

import jax

from . import _native
from ._errors import ExtensionError, MissingHandlerError

__all__ = ["register_handlers"]

_LOCK = threading.Lock()
# (target name, platform) -> library path, for the targets registered in this process.
_REGISTERED: dict[tuple[str, str], str] = {}
# library path -> checking trampolines used
_SLOTS: dict[str, int] = {}
_UNDEFINED = re.compile(r"undefined symbol: ?(\S+)")


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
        ExtensionError: if the library cannot be loaded (an undefined symbol: a
            library missing from ``extra_ldflags``), or was built against another jaxlib.
    """
    handle = open_library(extension, library)
    _native.check_versions(extension, library, handle)
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
            if (target, platform) not in _REGISTERED:
                # Not yet registered. (If it is, the same sources were loaded before, from
                # this library or another build of them: the registered handler is theirs.)
                raw = ctypes.cast(pointer, ctypes.c_void_p).value
                slot = _SLOTS.get(str(library), 0)
                checked = _native.trampoline(handle, slot, raw) if platform == "cpu" else None
                if checked is not None:
                    _SLOTS[str(library)] = slot + 1
                jax.ffi.register_ffi_target(
                    target, jax.ffi.pycapsule(checked or raw), platform=platform
                )
                jax.ffi.register_ffi_target(
                    f"{target}.raw", jax.ffi.pycapsule(raw), platform=platform
                )
                _REGISTERED[(target, platform)] = str(library)
            targets[symbol] = target
    return targets


def registered_targets() -> list[str]:
    """The FFI targets registered by ``jaxext.cpp_extension`` in this process."""
    with _LOCK:
        names = [target for target, _ in _REGISTERED]
    return sorted({*names, *(f"{n}.raw" for n in names)})


def target_platforms() -> dict[str, set[str]]:
    """``{target name: platforms it has a handler for}``, JAX's platform names
    (``"cpu"``, ``"cuda"``), for the targets registered by ``jaxext.cpp_extension``."""
    found: dict[str, set[str]] = {}
    with _LOCK:
        for target, platform in _REGISTERED:
            found.setdefault(target, set()).add(platform.lower())
    return found


def open_library(extension: str, library: Path) -> ctypes.CDLL:
    """``ctypes.CDLL(library)``, with a link failure explained.

    Raises:
        ExtensionError: if the dynamic loader refuses the library; for an undefined
            symbol, naming it and the ``extra_ldflags`` to pass.
    """
    try:
        return ctypes.CDLL(str(library))
    except OSError as err:
        message = str(err)
        found = _UNDEFINED.search(message)
        if found is None:
            raise ExtensionError(
                f"Extension {extension!r}: the library {library} cannot be loaded: {message}"
            ) from None
        symbol = found.group(1)
        raise ExtensionError(
            f"Extension {extension!r}: the library {library} cannot be loaded: undefined "
            f"symbol {symbol}{_demangled(symbol)}. The sources use it but nothing linked "
            "into the library defines it: pass the library that does through `extra_ldflags` "
            "(e.g. extra_ldflags=['-lm'] for the C math library, ['-L/path/to/lib', '-lfoo'] "
            "for libfoo), or add the source that defines it to `sources`."
        ) from None


def _demangled(symbol: str) -> str:
    if not symbol.startswith("_Z"):
        return ""
    tool = shutil.which("c++filt")
    if tool is None:
        return ""
    try:
        done = subprocess.run([tool, symbol], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    name = done.stdout.strip()
    return f" ({name})" if name and name != symbol else ""


def _start_backend(extension: str, platform: str) -> None:
    try:
        jax.devices("cpu" if platform == "cpu" else "gpu")
    except RuntimeError as err:
        raise ExtensionError(
            f"Extension {extension!r} has {platform} handlers, but JAX has no such backend "
            f"here ({err}). CUDA handlers need a CUDA build of jaxlib (`pip install "
            "'jax[cuda12]'`) and a GPU."
        ) from None
