"""One build of an extension: what goes into it (``BuildPlan``) and compiling it."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path

import jax

from ._cache import cache_key
from ._compiler import Compiler, compile_command, compile_library, link_command
from ._deps import is_under, read_depfile, system_directories
from ._native import CHECKING_SOURCE, build_flags

__all__ = ["PRELUDE", "BuildPlan", "compile_plan", "target_key"]

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
        source_key: hash of the sources, flags and platform, not of the compiler or
            of where it is built. The headers are not in it (which ones the sources
            read is known only once the compiler has read them): each build records
            them with their hashes (see ``_deps``), and the FFI target names carry
            ``target_key``, which adds the extension's own headers to it.
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

    def prefix(self, key: str) -> str:
        """What the FFI target names start with: ``<name>_<target key>``."""
        return f"{self.name}_{key}"


def target_key(plan: BuildPlan, compiler: Compiler, headers: Sequence[Path]) -> str:
    """The key of the handlers' FFI target names: ``plan.source_key`` and the contents
    of the extension's own headers among ``headers``.

    The system's and jaxlib's headers are left out (the key stays the same on every
    machine that builds the same sources and headers, so a program exported with
    ``jax.export`` finds its targets there); they are covered by the cache key
    (compiler version, jaxlib version) and by the build's record.
    """
    system = system_directories(compiler.argv, jax.ffi.include_dir())
    own = sorted((path.name, path.read_bytes()) for path in headers if not is_under(path, system))
    return cache_key([plan.source_key, *(part for header in own for part in header)])


def compile_plan(
    plan: BuildPlan, compiler: Compiler, directory: Path, output: Path, verbose: bool
) -> list[Path]:
    """Compiles ``plan`` into the library ``output``; sources of ``load_inline`` and the
    compiler's log go into ``directory``.

    Each source is compiled on its own (so that the compiler reports, for each,
    the files it read), then they are linked.

    Returns:
        Every file the compiler read besides the sources and jaxext's own files
        (whose contents are in ``plan.source_key``): the headers, resolved.

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
    work = directory / f".objects.{os.getpid()}.{uuid.uuid4().hex}"
    work.mkdir()
    try:
        commands, objects, depfiles = [], [], []
        cflags = [*build_flags(), *plan.cflags]
        for i, path in enumerate(paths):
            obj, dep = work / f"{i}.{path.stem}.o", work / f"{i}.{path.stem}.d"
            objects.append(obj)
            depfiles.append(dep)
            commands.append(
                compile_command(
                    compiler,
                    path,
                    obj,
                    dep,
                    include_dirs=[Path(jax.ffi.include_dir()), *plan.includes],
                    extra_cflags=cflags,
                    preinclude=prelude,
                )
            )
        commands.append(
            link_command(
                compiler, objects, output, extra_cflags=plan.cflags, extra_ldflags=plan.ldflags
            )
        )
        compile_library(plan.name, commands, directory / "build.log", verbose)
        own = {p.resolve() for p in paths} | ({prelude.resolve()} if prelude else set())
        read = {}
        for dep in depfiles:
            for path in read_depfile(dep):
                if path not in own:
                    read[path] = None
        return list(read)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(work)
