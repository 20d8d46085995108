"""One build of an extension: what goes into it (``BuildPlan``) and compiling it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax

from ._compiler import Compiler, compile_command, compile_library
from ._native import CHECKING_SOURCE, build_flags

__all__ = ["PRELUDE", "BuildPlan", "compile_plan"]

# What load_inline puts before the sources (through -include, so their line numbers stay).
PRELUDE = '#include "xla/ffi/api/ffi.h"\nnamespace ffi = xla::ffi;\n'


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """An extension's sources and flags, checked.

    Attributes:
        name: the extension's name.
        sources: source paths (``load``) or file names (``load_inline``, written
            into the build directory from ``inline_files``).
        inline_files: ``{file name: text}`` for ``load_inline``; empty for ``load``.
        cflags: extra compiler flags.
        ldflags: extra linker flags.
        includes: extra include directories, resolved.
        platform: ``"cpu"`` or ``"CUDA"``.
        cuda: whether ``nvcc`` compiles it.
        source_key: hash of what defines the library's behaviour (sources, included
            headers, flags, platform), not of the compiler or of where it is built:
            the handlers' FFI target names carry it, and prebuilt libraries are
            matched by it.
    """

    name: str
    sources: tuple[Path | str, ...]
    inline_files: dict[str, str]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    includes: tuple[Path, ...]
    platform: str
    cuda: bool
    source_key: str

    @property
    def prefix(self) -> str:
        """What the FFI target names start with: ``<name>_<source key>``."""
        return f"{self.name}_{self.source_key}"


def compile_plan(
    plan: BuildPlan, compiler: Compiler, directory: Path, output: Path, verbose: bool
) -> None:
    """Compiles ``plan`` into the library ``output``; sources of ``load_inline`` and the
    compiler's log go into ``directory``.

    Raises:
        CompileError: if the compiler fails.
    """
    directory.mkdir(parents=True, exist_ok=True)
    prelude = None
    for file_name, text in plan.inline_files.items():
        (directory / file_name).write_text(text)
    if plan.inline_files:
        prelude = directory / "jaxext_prelude.h"
        prelude.write_text(PRELUDE)
    paths = [directory / s if plan.inline_files else Path(s) for s in plan.sources]
    if not plan.cuda:  # build info and checking trampolines: CPU builds (not tried with nvcc)
        paths.append(CHECKING_SOURCE)
    command = compile_command(
        compiler,
        paths,
        output,
        include_dirs=[Path(jax.ffi.include_dir()), *plan.includes],
        extra_cflags=[*build_flags(), *plan.cflags],
        extra_ldflags=plan.ldflags,
        preinclude=prelude,
    )
    compile_library(plan.name, command, directory / "build.log", verbose)
