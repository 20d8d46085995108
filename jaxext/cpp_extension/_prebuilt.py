"""Ahead-of-time builds: a library built into a directory of your package, found by ``load``.

``python -m jaxext.cpp_extension build NAME SOURCE...`` (or :func:`build`) compiles an
extension into ``<directory>/<name>.so`` and writes ``<directory>/<name>.json``
beside it, recording the source key (see ``BuildPlan``), the platform and the jaxlib
the library was built against. ``load`` with the same name, sources and flags finds
it there (the sources' own directory, or ``prebuilt_directory``) and loads it without
running a compiler; a library built for other sources or flags is passed over.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path

from ._build import BuildPlan, compile_plan
from ._compiler import find_compiler
from ._native import installed_versions

__all__ = ["find_prebuilt", "manifest_path", "write_prebuilt"]

_FORMAT = 1


def manifest_path(directory: Path, name: str) -> Path:
    return directory / f"{name}.json"


def find_prebuilt(plan: BuildPlan, directories: Sequence[Path]) -> tuple[Path | None, list[Path]]:
    """A prebuilt library for ``plan`` in ``directories``, and the stale ones passed over.

    Returns:
        ``(library or None, libraries of this name built for other sources or flags)``.
    """
    stale = []
    for directory in directories:
        library = directory / f"{plan.name}.so"
        manifest = manifest_path(directory, plan.name)
        if not (library.is_file() and manifest.is_file()):
            continue
        try:
            record = json.loads(manifest.read_text())
        except (OSError, ValueError):
            stale.append(library)
            continue
        if (
            record.get("format") == _FORMAT
            and record.get("source_key") == plan.source_key
            and record.get("platform") == plan.platform
        ):
            return library, stale
        stale.append(library)
    return None, stale


def write_prebuilt(plan: BuildPlan, directory: Path, verbose: bool = False) -> Path:
    """Compiles ``plan`` into ``directory/<name>.so`` and writes its manifest.

    Returns:
        The library's path.

    Raises:
        CompilerNotFoundError, CompileError: as ``load`` does.
    """
    compiler = find_compiler(plan.cuda)
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"{plan.name}.so"
    temporary = directory / f".{plan.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    logs = Path(tempfile.mkdtemp(prefix=f"jaxext-{plan.name}-"))  # build.log, kept on failure
    try:
        compile_plan(plan, compiler, logs, temporary, verbose)
        os.replace(temporary, library)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
    jaxlib_version, ffi_api = installed_versions()
    record = {
        "format": _FORMAT,
        "name": plan.name,
        "source_key": plan.source_key,
        "platform": plan.platform,
        "jaxlib": jaxlib_version,
        "ffi_api": ffi_api,
        "compiler": compiler.identity.splitlines()[0],
    }
    manifest_path(directory, plan.name).write_text(json.dumps(record, indent=2) + "\n")
    return library
