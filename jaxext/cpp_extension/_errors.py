"""The errors `jaxext.cpp_extension` raises when an extension cannot be built or loaded."""

from __future__ import annotations

__all__ = ["CompileError", "CompilerNotFoundError", "ExtensionError", "MissingHandlerError"]


class ExtensionError(RuntimeError):
    """Base class: an extension could not be built or loaded."""


class CompilerNotFoundError(ExtensionError):
    """No C++ compiler (or, for ``.cu`` sources, no ``nvcc``) could be run."""


class CompileError(ExtensionError):
    """The compiler rejected the sources.

    Attributes:
        command: the compiler command line, as a list of arguments.
        output: everything the compiler printed (its diagnostics name file and line).
        log_path: where that output was also written, next to the build.
    """

    def __init__(self, message: str, *, command: list[str], output: str, log_path: str):
        super().__init__(message)
        self.command = command
        self.output = output
        self.log_path = log_path


class MissingHandlerError(ExtensionError):
    """A requested handler symbol is not exported by the compiled library."""


# Tracebacks show the names users can import and catch (`jaxext.cpp_extension.CompileError`),
# not this private module's.
for _error in (ExtensionError, CompilerNotFoundError, CompileError, MissingHandlerError):
    _error.__module__ = "jaxext.cpp_extension"
del _error
