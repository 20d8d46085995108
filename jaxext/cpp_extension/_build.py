"""One build of an extension: what goes into it (``BuildPlan``), what the compiler
reads for it (``Unit``, ``read_units``), the keys that name it, and compiling it."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from pathlib import Path

import jax
import jaxlib

from ._cache import cache_key
from ._compiler import Compiler, compile_command, compile_flags, compile_library, link_command
from ._deps import Reading, builtin_directories, is_under, preprocess, search_environment
from ._errors import CompileError
from ._native import CHECKING_SOURCE, build_flags

__all__ = [
    "PRELUDE",
    "PRELUDE_NAME",
    "BuildPlan",
    "Unit",
    "compile_failure",
    "compile_units",
    "direct_key",
    "library_key",
    "own_files",
    "read_units",
    "target_key",
    "units",
    "write_inline",
]

# What load_inline puts before the sources (through -include, so their line numbers stay).
PRELUDE = '#include "xla/ffi/api/ffi.h"\nnamespace ffi = xla::ffi;\n'
PRELUDE_NAME = "jaxext_prelude.h"


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """An extension's sources and flags, checked.

    Attributes:
        name: the extension's name.
        sources: source paths (``load``) or file names (``load_inline``, written
            into a directory of their own from ``inline_files``).
        inline_files: ``{file name: text}`` for ``load_inline``; empty for ``load``.
        cflags: extra compiler flags.
        ldflags: extra linker flags.
        includes: extra include directories, resolved.
        platform: ``"cpu"`` or ``"CUDA"``.
        cuda: whether ``nvcc`` compiles it.
        source_key: hash of the sources' names and texts, the flags and the platform:
            what the FFI target names start from (see ``target_key``). Which build
            fits is decided by what the compiler reads (see ``_deps``).
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


@dataclasses.dataclass(frozen=True)
class Unit:
    """One source as the compiler is given it.

    Attributes:
        source: its path as passed to the compiler (``load_inline``'s: a file name,
            relative to ``cwd``, so that the preprocessed text does not name the cache).
        cwd: the directory the compiler runs in.
        flags: every flag but ``-c``/``-E`` and the output.
    """

    source: str
    cwd: str
    flags: tuple[str, ...]


def write_inline(plan: BuildPlan, directory: Path) -> None:
    """Writes ``load_inline``'s sources and the prelude into ``directory`` (each file
    replaced whole, and only when its text differs)."""
    directory.mkdir(parents=True, exist_ok=True)
    for file_name, text in {**plan.inline_files, PRELUDE_NAME: PRELUDE}.items():
        path = directory / file_name
        with contextlib.suppress(OSError):
            if path.read_text() == text:
                continue
        temporary = directory / f".{file_name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        temporary.write_text(text)
        os.replace(temporary, path)


def units(plan: BuildPlan, compiler: Compiler, inline_directory: Path | None) -> list[Unit]:
    """The units that make ``plan``'s library: its sources, then (CPU builds) jaxext's
    checking source; ``load_inline``'s are in ``inline_directory`` (see ``write_inline``)."""
    inline = bool(plan.inline_files)
    flags = tuple(
        compile_flags(
            compiler,
            include_dirs=[Path(jax.ffi.include_dir()), *plan.includes],
            extra_cflags=[*build_flags(), *plan.cflags],
            preinclude=PRELUDE_NAME if inline else None,
        )
    )
    cwd = str(inline_directory) if inline else os.getcwd()
    found = [Unit(str(source), cwd, flags) for source in plan.sources]
    if not plan.cuda:  # build info and checking trampolines: CPU builds (not tried with nvcc)
        found.append(Unit(str(CHECKING_SOURCE), cwd, flags))
    return found


def _link_flags(plan: BuildPlan) -> list[str]:
    return [*plan.cflags, "--", *plan.ldflags]


def _common(plan: BuildPlan, compiler: Compiler) -> list[str]:
    return [
        plan.name,
        plan.platform,
        compiler.identity,
        repr(search_environment()),
        jaxlib.__version__,
        repr(_link_flags(plan)),
    ]


def direct_key(plan: BuildPlan, compiler: Compiler, found: Sequence[Unit]) -> str:
    """The key of the direct-mode manifests of ``plan``'s builds: the compiler, the
    search environment, every command line and the directory it runs in, the sources'
    texts. (The manifests list the rest: what the compiler read.)"""
    parts = [*_common(plan, compiler), plan.source_key, CHECKING_SOURCE.read_bytes()]
    for unit in found:
        parts += [unit.cwd, unit.source, repr(unit.flags)]
    return cache_key(["direct", *parts])


def library_key(
    plan: BuildPlan, compiler: Compiler, found: Sequence[Unit], readings: Sequence[Reading]
) -> str:
    """The key of a build: the compiler, the search environment, every flag, and each
    preprocessed translation unit (line markers included). The directory the compiler
    runs in counts too where debug information or profiling records it."""
    parts = _common(plan, compiler)
    for unit, reading in zip(found, readings, strict=True):
        parts += [unit.source, repr(unit.flags), reading.text]
        if any(f.startswith(("-g", "-fprofile", "--coverage")) for f in unit.flags):
            parts.append(unit.cwd)
    return cache_key(["library", *parts])


def read_units(compiler: Compiler, found: Sequence[Unit]) -> list[Reading] | None:
    """What the preprocessor reads for each unit; ``None`` if it fails (the compile
    then reports the error)."""
    readings = []
    for unit in found:
        command = [*compiler.argv, *unit.flags, unit.source]
        try:
            readings.append(preprocess(command, unit.cwd, follow=not compiler.cuda))
        except (subprocess.CalledProcessError, OSError):
            return None
    return readings


def own_files(
    compiler: Compiler, found: Sequence[Unit], readings: Sequence[Reading]
) -> list[tuple[str, str, str]]:
    """``(unit's cwd, path, sha256)`` of the files the units read that are the
    extension's own: neither a source (whose text is in the source key), jaxext's
    prelude or checking source, nor under the compiler's built-in directories or
    jaxlib's (see ``builtin_directories``)."""
    system = builtin_directories(compiler.argv, jax.ffi.include_dir())
    mine = {str(CHECKING_SOURCE.resolve())}
    for unit in found:
        mine.add(os.path.realpath(os.path.join(unit.cwd, unit.source)))
        mine.add(os.path.realpath(os.path.join(unit.cwd, PRELUDE_NAME)))
    own = {}
    for unit, reading in zip(found, readings, strict=True):
        for path, sha in reading.opened:
            full = os.path.join(unit.cwd, path)
            if os.path.realpath(full) not in mine and not is_under(full, system):
                own.setdefault((unit.cwd, path), sha)
    return [(cwd, path, sha) for (cwd, path), sha in own.items()]


def target_key(plan: BuildPlan, own: Sequence[tuple[str, str, str]]) -> str:
    """The key of the handlers' FFI target names: ``plan.source_key`` and the names
    and contents of the extension's own headers (``own_files``).

    The system's and jaxlib's headers are left out (the key stays the same on every
    machine that builds the same sources and headers, so a program exported with
    ``jax.export`` finds its targets there); the build's key covers them.
    """
    headers = sorted({(os.path.basename(path), sha) for _, path, sha in own})
    return cache_key([plan.source_key, *(part for header in headers for part in header)])


def compile_units(
    plan: BuildPlan,
    compiler: Compiler,
    found: Sequence[Unit],
    directory: Path,
    output: Path,
    verbose: bool,
) -> None:
    """Compiles ``found`` and links them into the library ``output``; the compiler's
    log goes into ``directory``.

    Raises:
        CompileError: if the compiler fails.
    """
    directory.mkdir(parents=True, exist_ok=True)
    work = directory / f".objects.{os.getpid()}.{uuid.uuid4().hex}"
    work.mkdir()
    try:
        commands, objects = [], []
        for i, unit in enumerate(found):
            obj = work / f"{i}.{Path(unit.source).stem}.o"
            objects.append(obj)
            commands.append((compile_command(compiler, unit.flags, unit.source, obj), unit.cwd))
        link = link_command(
            compiler, objects, output, extra_cflags=plan.cflags, extra_ldflags=plan.ldflags
        )
        commands.append((link, found[0].cwd))
        compile_library(plan.name, commands, directory / "build.log", verbose)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(work)


def compile_failure(
    plan: BuildPlan, compiler: Compiler, found: Sequence[Unit], directory: Path, verbose: bool
) -> CompileError:
    """The error of a build whose preprocessing failed: compiled in ``directory``, the
    compiler reports it with its diagnostics."""
    output = directory / f".failed.{os.getpid()}.{uuid.uuid4().hex}.so"
    try:
        compile_units(plan, compiler, found, directory, output, verbose)
    except CompileError as err:
        return err
    finally:
        with contextlib.suppress(FileNotFoundError):
            output.unlink()
    return CompileError(
        f"Building extension {plan.name!r} failed: the preprocessor (`-E`) failed where "
        "the compiler did not.",
        command=[*compiler.argv, *found[0].flags, "-E", found[0].source],
        output="",
        log_path=str(directory / "build.log"),
    )
