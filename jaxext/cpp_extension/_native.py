"""What jaxext compiles into every CPU extension: build info, and checking mode.

``jaxext/csrc/jaxext_checking.cc`` is compiled beside the user's sources. It records
the jaxlib and XLA FFI API versions the library was built against (checked when the
library is loaded), and gives each handler a trampoline that, in checking mode, fills
the result buffers with NaN (integers: a sentinel) before the handler runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import jax
import jaxlib

from ._errors import ExtensionError

__all__ = [
    "CHECKING_SOURCE",
    "build_flags",
    "checking",
    "checking_enabled",
    "installed_versions",
    "library_versions",
    "suspended",
    "trampoline",
]

CHECKING_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "jaxext_checking.cc"

_LOCK = threading.RLock()
_depth = 0  # nesting depth of `checking()` blocks, process-wide
_setters: dict[str, ctypes._CFuncPtr] = {}  # library path -> its jaxext_checking_set_mode


def build_flags() -> list[str]:
    """The compiler flags that embed the installed jaxlib version in the library."""
    return [f'-DJAXEXT_JAXLIB_VERSION="{jaxlib.__version__}"']


def installed_versions() -> tuple[str, str]:
    """``(jaxlib version, XLA FFI API version)`` of this installation's headers."""
    return jaxlib.__version__, _ffi_api_version()


def _ffi_api_version() -> str:
    header = Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h"
    try:
        text = header.read_text()
    except OSError:
        return "unknown"
    found = dict(re.findall(r"#define XLA_FFI_API_(MAJOR|MINOR)\s+(\d+)", text))
    return f"{found.get('MAJOR', '?')}.{found.get('MINOR', '?')}"


def library_versions(handle: ctypes.CDLL) -> tuple[str, str] | None:
    """``(jaxlib, FFI API)`` versions recorded in a loaded library, or ``None`` if absent."""
    try:
        start = ctypes.c_char.in_dll(handle, "jaxext_build_info")
    except ValueError:
        return None
    info = ctypes.string_at(ctypes.addressof(start)).decode(errors="replace")
    fields = dict(part.split("=", 1) for part in info.split(";") if "=" in part)
    return fields.get("jaxlib", "unknown"), fields.get("ffi_api", "unknown")


def check_versions(extension: str, library: Path, handle: ctypes.CDLL) -> None:
    """Raises ``ExtensionError`` if ``library`` was built against another jaxlib.

    Raises:
        ExtensionError: naming the versions of the build and of this installation.
    """
    recorded = library_versions(handle)
    if recorded is None:
        return  # not built by jaxext (e.g. a CUDA-only build): nothing to compare
    installed = installed_versions()
    if recorded[0] != installed[0]:
        raise ExtensionError(
            f"Extension {extension!r} ({library}) was built against jaxlib {recorded[0]} "
            f"(XLA FFI API {recorded[1]}), but jaxlib {installed[0]} (XLA FFI API "
            f"{installed[1]}) is installed: its handlers would not match this XLA. Rebuild "
            "it for this jaxlib (`python -m jaxext.cpp_extension build ...`, or delete the "
            "library and call `load` with a compiler available)."
        )


def trampoline(handle: ctypes.CDLL, slot: int, pointer: int) -> int | None:
    """The address of ``handle``'s checking trampoline ``slot``, now calling ``pointer``.

    ``None`` when the library has no trampolines (not built by jaxext for the CPU) or
    they are used up: the handler is then registered as it is.
    """
    try:
        function = handle.jaxext_checking_trampoline
        setter = handle.jaxext_checking_set_mode
    except AttributeError:
        return None
    function.restype = ctypes.c_void_p
    function.argtypes = (ctypes.c_int, ctypes.c_void_p)
    address = function(slot, pointer)
    if not address:
        return None
    setter.restype = None
    setter.argtypes = (ctypes.c_int,)
    with _LOCK:
        if handle._name not in _setters:
            _setters[handle._name] = setter
            setter(1 if _depth else 0)
    return address


def checking_enabled() -> bool:
    """Whether checking mode is on (inside a :func:`checking` block)."""
    return _depth > 0


@contextlib.contextmanager
def checking() -> Iterator[None]:
    """Checking mode: C++ kernels' result buffers are filled with NaN before they run.

    Inside the block, every handler loaded by :func:`~jaxext.cpp_extension.load` or
    :func:`~jaxext.cpp_extension.load_inline` for the CPU gets result buffers filled
    with NaN (floating types, complex ones in both parts) or a sentinel (signed
    integers: the type's minimum; unsigned: its maximum) before it runs, so an element
    the kernel never writes shows as NaN (or the sentinel) instead of whatever memory
    held. Booleans and sub-byte types are not filled; neither are buffers of a call
    with ``input_output_aliases`` (they hold an input), nor those of CUDA kernels.

    The mode is process-wide and acts when a kernel *runs*, not when it is traced:
    jitted functions need no retracing, and results must be computed (e.g.
    ``jax.block_until_ready``) inside the block. :func:`jaxext.opcheck` runs its
    checks in this mode and reports unwritten elements by output.

    Example:
        >>> import numpy as np
        >>> from jaxext import cpp_extension
        >>> from jaxext.cpp_extension import ops
        >>> with cpp_extension.checking():
        ...     y = np.asarray(ops.mul_constant(np.ones(3, np.float32), 2.0))
        >>> y  # every element written: no NaN
        array([2., 2., 2.], dtype=float32)
    """
    global _depth
    with _LOCK:
        _depth += 1
        if _depth == 1:
            _set_all(1)
    try:
        yield
    finally:
        with _LOCK:
            _depth -= 1
            if _depth == 0:
                _set_all(0)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Checking mode off inside, also within a :func:`checking` block (for comparisons)."""
    global _depth
    with _LOCK:
        saved, _depth = _depth, 0
        _set_all(0)
    try:
        yield
    finally:
        with _LOCK:
            _depth = saved
            _set_all(1 if saved else 0)


def _set_all(mode: int) -> None:
    for setter in _setters.values():
        setter(mode)
