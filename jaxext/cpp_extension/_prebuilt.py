"""Ahead-of-time builds: a library built into a directory of your package, found by ``load``.

``python -m jaxext.cpp_extension build NAME SOURCE...`` (or :func:`build`) compiles an
extension into ``<directory>/<name>.<hash>.so`` (``<hash>``: of the library's bytes,
so a rebuilt library has a new file name, and a process that loaded the old one
loads the new one anew rather than getting the old one back from the dynamic loader)
and writes ``<directory>/<name>.json`` beside it, recording the library's file name,
the source key (see ``BuildPlan``), the extension's own headers the compiler read
(paths relative to the directory when inside it) with their hashes, the platform and
the jaxlib the library was built against. ``load`` with the same name, sources and
flags finds it there (the sources' own directory, or ``prebuilt_directory``) and
loads it without running a compiler while every recorded header still has its hash;
a library built for other sources, headers or flags is passed over. Building again
removes the library the previous manifest named.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path

import jax

from ._build import BuildPlan, compile_plan, target_key
from ._cache import file_key
from ._compiler import find_compiler
from ._deps import is_under, record, still_current, system_directories
from ._native import installed_versions

__all__ = ["find_prebuilt", "manifest_path", "write_prebuilt"]

_FORMAT = 2


def manifest_path(directory: Path, name: str) -> Path:
    return directory / f"{name}.json"


def find_prebuilt(
    plan: BuildPlan, directories: Sequence[Path]
) -> tuple[tuple[Path, str] | None, list[Path]]:
    """A prebuilt library for ``plan`` in ``directories``, and the stale ones passed over.

    Returns:
        ``((library, target key) or None, libraries of this name built for other
        sources, headers or flags)``.
    """
    stale = []
    for directory in directories:
        manifest = manifest_path(directory, plan.name)
        if not manifest.is_file():
            continue
        try:
            found = json.loads(manifest.read_text())
        except (OSError, ValueError):
            stale.append(manifest)
            continue
        library = directory / str(found.get("library", f"{plan.name}.so"))
        if not library.is_file():
            continue
        if (
            found.get("format") == _FORMAT
            and found.get("source_key") == plan.source_key
            and found.get("platform") == plan.platform
            and isinstance(found.get("target_key"), str)
            and still_current(found.get("headers"), directory)
        ):
            return (library, found["target_key"]), stale
        stale.append(library)
    return None, stale


def write_prebuilt(plan: BuildPlan, directory: Path, verbose: bool = False) -> Path:
    """Compiles ``plan`` into ``directory/<name>.<hash>.so`` and writes its manifest.

    Returns:
        The library's path.

    Raises:
        CompilerNotFoundError, CompileError: as ``load`` does.
    """
    compiler = find_compiler(plan.cuda)
    directory.mkdir(parents=True, exist_ok=True)
    temporary = directory / f".{plan.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    logs = Path(tempfile.mkdtemp(prefix=f"jaxext-{plan.name}-"))  # build.log, kept on failure
    manifest = manifest_path(directory, plan.name)
    try:
        previous = json.loads(manifest.read_text()).get("library", f"{plan.name}.so")
    except (OSError, ValueError, AttributeError):
        previous = None
    try:
        headers = compile_plan(plan, compiler, logs, temporary, verbose)
        library = directory / f"{plan.name}.{file_key(temporary)}.so"
        os.replace(temporary, library)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
    # The extension's own headers: the system's and jaxlib's differ between the
    # machine that builds and those that load (the jaxlib version is checked instead).
    system = system_directories(compiler.argv, jax.ffi.include_dir())
    own = [path for path in headers if not is_under(path, system)]
    jaxlib_version, ffi_api = installed_versions()
    found = {
        "format": _FORMAT,
        "name": plan.name,
        "library": library.name,
        "source_key": plan.source_key,
        "target_key": target_key(plan, compiler, headers),
        "headers": record(own, relative_to=directory),
        "platform": plan.platform,
        "jaxlib": jaxlib_version,
        "ffi_api": ffi_api,
        "compiler": compiler.identity.splitlines()[0],
    }
    manifest.write_text(json.dumps(found, indent=2) + "\n")
    if isinstance(previous, str) and previous != library.name and "/" not in previous:
        with contextlib.suppress(OSError):
            (directory / previous).unlink()
    return library
