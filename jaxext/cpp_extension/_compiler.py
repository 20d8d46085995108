"""Finding the system compiler, naming it for the cache key, and running it.

C++ sources are compiled with ``$CXX`` (which may carry arguments, e.g.
``"ccache g++"``), else ``c++``. ``.cu`` sources need CUDA's ``nvcc``: ``$NVCC``,
else ``$CUDA_HOME/bin/nvcc``, else ``nvcc`` on the ``PATH``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from ._errors import CompileError, CompilerNotFoundError

__all__ = [
    "Compiler",
    "compile_command",
    "compile_flags",
    "compile_library",
    "find_compiler",
    "link_command",
]

_CXX_HINT = (
    "Install a C++17 compiler (Debian/Ubuntu: `apt-get install g++`; Fedora/RHEL: "
    "`dnf install gcc-c++`; macOS: `xcode-select --install`; conda: "
    "`conda install -c conda-forge cxx-compiler`) or point the CXX environment "
    "variable at one."
)
_NVCC_HINT = (
    "Install the CUDA toolkit (https://developer.nvidia.com/cuda-downloads, or "
    "`conda install -c nvidia cuda-nvcc`) and put nvcc on the PATH, or set NVCC or "
    "CUDA_HOME."
)

# A compiler diagnostic that names a file and line: "path/to/file.cc:12:5: error: ...".
_DIAGNOSTIC = re.compile(r"^.+:\d+(:\d+)?: (fatal )?error\b.*$", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class Compiler:
    """A compiler command and what identifies it in the cache key.

    Attributes:
        argv: the command (the executable, resolved to a path, and any arguments
            given with it in ``$CXX``).
        identity: its ``--version`` output, so another compiler builds anew.
        cuda: True for ``nvcc`` (host flags go through ``-Xcompiler``).
    """

    argv: tuple[str, ...]
    identity: str
    cuda: bool


def find_compiler(cuda: bool) -> Compiler:
    """The C++ compiler (``cuda=False``) or ``nvcc`` (``cuda=True``) to build with.

    Raises:
        CompilerNotFoundError: if it is not installed, with what to install.
    """
    if cuda:
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
        default = str(Path(home) / "bin" / "nvcc") if home else "nvcc"
        command, source, hint = os.environ.get("NVCC") or default, "NVCC", _NVCC_HINT
    else:
        command, source, hint = os.environ.get("CXX") or "c++", "CXX", _CXX_HINT
    argv = shlex.split(command)
    executable = shutil.which(argv[0]) if argv else None
    if executable is None:
        where = f"{source}={command!r}" if os.environ.get(source) else repr(command)
        raise CompilerNotFoundError(
            f"No {'CUDA' if cuda else 'C++'} compiler found: {where} is not an executable "
            f"file or not on the PATH. {hint}"
        )
    argv = (executable, *argv[1:])
    return Compiler(argv=argv, identity=_identity(argv), cuda=cuda)


@functools.cache
def _identity(argv: tuple[str, ...]) -> str:
    try:
        done = subprocess.run(
            [*argv, "--version"], capture_output=True, text=True, timeout=60, check=False
        )
    except OSError as err:
        raise CompilerNotFoundError(f"Cannot run the compiler {argv[0]!r}: {err}.") from None
    return f"{' '.join(argv)}\n{done.stdout}{done.stderr}"


def compile_flags(
    compiler: Compiler,
    *,
    include_dirs: Sequence[Path],
    extra_cflags: Sequence[str],
    preinclude: str | None,
) -> list[str]:
    """The flags that compile (with ``-c``) or preprocess (with ``-E``) a source.

    ``include_dirs[0]`` is jaxlib's (``-isystem``: its warnings are not the user's to
    fix), the others ``-I``; ``preinclude`` is read before the source (``-include``).
    """
    if compiler.cuda:
        base = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC"]
    else:
        base = ["-std=c++17", "-O3", "-fPIC"]
    includes = ["-isystem", str(include_dirs[0])]
    for path in include_dirs[1:]:
        includes += ["-I", str(path)]
    pre = ["-include", preinclude] if preinclude is not None else []
    return [*base, *includes, *pre, *extra_cflags]


def compile_command(
    compiler: Compiler, flags: Sequence[str], source: str, output: Path
) -> list[str]:
    """The command line that compiles ``source`` into the object file ``output``."""
    return [*compiler.argv, *flags, "-c", source, "-o", str(output)]


def link_command(
    compiler: Compiler,
    objects: Sequence[Path],
    output: Path,
    *,
    extra_cflags: Sequence[str],
    extra_ldflags: Sequence[str],
) -> list[str]:
    """The command line that links ``objects`` into the shared library ``output``.

    The compiler flags come too: some act at link time (``-fopenmp``, ``-pthread``,
    ``-fsanitize=...``), the others are ignored there.
    """
    base = ["-shared", "-Xcompiler", "-fPIC"] if compiler.cuda else ["-shared", "-fPIC"]
    return [
        *compiler.argv,
        *base,
        *extra_cflags,
        *(str(o) for o in objects),
        "-o",
        str(output),
        *extra_ldflags,
    ]


def compile_library(
    name: str,
    commands: Sequence[tuple[list[str], str]],
    log_path: Path,
    verbose: bool,
) -> None:
    """Runs ``commands`` (``(command, directory it runs in)``) in turn (compiling each
    source, then linking); logs to ``log_path``.

    Raises:
        CompileError: if a command fails; the message lists the diagnostics that
            name a file and line, and the error carries the whole output.
    """
    log = []
    for command, cwd in commands:
        if verbose:
            print(f"[jaxext.cpp_extension] building {name!r}: {shlex.join(command)}", flush=True)
        try:
            done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
        except OSError as err:
            raise CompilerNotFoundError(f"Cannot run the compiler {command[0]!r}: {err}.") from None
        output = done.stdout + done.stderr
        log.append(f"$ {shlex.join(command)}\n{output}")
        log_path.write_text("".join(log))
        if verbose and output:
            print(output, flush=True)
        if done.returncode != 0:
            errors = [m.group(0) for m in _DIAGNOSTIC.finditer(output)][:10]
            summary = "\n".join(errors) if errors else output.strip()[-4000:]
            raise CompileError(
                f"Building extension {name!r} failed (compiler exit code {done.returncode}):\n"
                f"{summary}\n"
                f"The full compiler output is in this error's `.output` and in {log_path}.",
                command=command,
                output=output,
                log_path=str(log_path),
            )
