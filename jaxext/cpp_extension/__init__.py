"""Native kernels for JAX: compile C++ XLA FFI handlers at first use and call them.

JAX's answer to ``torch.utils.cpp_extension``. :func:`jaxext.cpp_extension.load`
compiles source files and :func:`jaxext.cpp_extension.load_inline` source strings
with the system compiler, against the XLA FFI headers that ship with jaxlib,
caches the build, registers each handler as an FFI target and returns an
:class:`jaxext.cpp_extension.Extension` whose attributes call the handlers through
``jax.ffi.ffi_call`` (so they work under ``jit`` and, given a ``vmap_method``,
``vmap``). Give them a gradient with :class:`jaxext.custom_vjp`, as
``jaxext.cpp_extension.ops`` does for jaxext's own ops.
"""

from ._aot import build as build
from ._errors import CompileError as CompileError
from ._errors import CompilerNotFoundError as CompilerNotFoundError
from ._errors import ExtensionError as ExtensionError
from ._errors import MissingHandlerError as MissingHandlerError
from ._load import load as load
from ._load import load_inline as load_inline
from ._module import Extension as Extension
from ._module import FfiFunction as FfiFunction
from ._native import checking as checking

__all__ = [
    "CompileError",
    "CompilerNotFoundError",
    "Extension",
    "ExtensionError",
    "FfiFunction",
    "MissingHandlerError",
    "build",
    "checking",
    "load",
    "load_inline",
]
