"""Ahead-of-time builds: a library built into a directory of your package, found by ``load``.

``python -m jaxext.cpp_extension build NAME SOURCE...`` (or :func:`build`) compiles an
extension into ``<directory>/<name>.<hash>.so`` (``<hash>``: of the library's bytes,
so a rebuilt library has a new file name, and a process that loaded the old one
loads the new one anew rather than getting the old one back from the dynamic loader)
and writes ``<directory>/<name>.json`` beside it: the library's file name, the
source key (see ``BuildPlan``), the sources and include directories, the search
environment (see ``_deps.SEARCH_ENVIRONMENT``), and the direct-mode manifest of the
extension's own files (every one the preprocessor opened, by the path it opened it
under, with its hash, and the paths where a new file would shadow one; see
``_deps``), paths relative to the directory when inside it; then the platform and
the jaxlib the library was built against. ``load`` with the same name, sources,
include paths, flags and search environment finds it there (the sources' own
directory, or ``prebuilt_directory``) and loads it without running a compiler while
that manifest holds; any other library of that name is passed over. The system's
and jaxlib's headers are not in the manifest (they differ between the machine that
builds and those that load): the jaxlib version is checked instead. Building again
removes the library the previous manifest named.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import jax

from ._build import (
    BuildPlan,
    compile_failure,
    compile_units,
    own_files,
    read_units,
    target_key,
    units,
)
from ._cache import file_key
from ._compiler import find_compiler
from ._deps import builtin_directories, is_under, search_environment, unchanged
from ._native import CHECKING_SOURCE, installed_versions

__all__ = ["find_prebuilt", "manifest_path", "write_prebuilt"]

_FORMAT = 3


def manifest_path(directory: Path, name: str) -> Path:
    return directory / f"{name}.json"


def find_prebuilt(
    plan: BuildPlan, directories: Sequence[Path]
) -> tuple[tuple[Path, str] | None, list[Path]]:
    """A prebuilt library for ``plan`` in ``directories``, and the stale ones passed over.

    Returns:
        ``((library, target key) or None, libraries of this name built for other
        sources, headers, include paths, flags or search environment)``.
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
        relative = _relative_to(directory, plan)
        if (
            found.get("format") == _FORMAT
            and found.get("source_key") == plan.source_key
            and found.get("platform") == plan.platform
            and isinstance(found.get("target_key"), str)
            and found.get("sources") == [relative(s) for s in plan.sources]
            and found.get("includes") == [relative(i) for i in plan.includes]
            and found.get("environment") == search_environment()
            and found.get("direct") is True
            and unchanged(found.get("opened"), found.get("absent"), str(directory))
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
    found_units = units(plan, compiler, None)
    readings = read_units(compiler, found_units)
    if readings is None:  # the preprocessor failed: the compiler says why
        raise compile_failure(plan, compiler, found_units, logs, verbose)
    try:
        compile_units(plan, compiler, found_units, logs, temporary, verbose)
        library = directory / f"{plan.name}.{file_key(temporary)}.so"
        os.replace(temporary, library)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
    # The extension's own files: the system's and jaxlib's differ between the machine
    # that builds and those that load (the jaxlib version is checked instead).
    own = own_files(compiler, found_units, readings)
    relative = _relative_to(directory, plan)
    system = builtin_directories(compiler.argv, jax.ffi.include_dir())
    jaxext_own = str(CHECKING_SOURCE.parent)
    absent = sorted(
        {
            relative(full)
            for unit, reading in zip(found_units, readings, strict=True)
            for full in (os.path.join(unit.cwd, p) for p in reading.absent)
            if not is_under(full, (*system, jaxext_own))
        }
    )
    jaxlib_version, ffi_api = installed_versions()
    found = {
        "format": _FORMAT,
        "name": plan.name,
        "library": library.name,
        "source_key": plan.source_key,
        "target_key": target_key(plan, own),
        "sources": [relative(s) for s in plan.sources],
        "includes": [relative(i) for i in plan.includes],
        "environment": search_environment(),
        "direct": all(r.direct for r in readings),
        "opened": [[relative(os.path.join(cwd, p)), h] for cwd, p, h in own],
        "absent": absent,
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


def _relative_to(directory: Path, plan: BuildPlan) -> Callable[[Path | str], str]:
    """How the manifest in ``directory`` writes a path: relative to ``directory`` (by
    name, ``..`` where needed, links not followed) when inside the deepest directory
    that holds both it and the sources (the package, which moves whole), else as it is.
    """
    root = os.path.commonpath([str(directory), *(str(s) for s in plan.sources)])

    def relative(path: Path | str) -> str:
        text = str(path)
        if text == root or text.startswith(root.rstrip("/") + "/"):
            return os.path.relpath(text, directory)
        return text

    return relative
