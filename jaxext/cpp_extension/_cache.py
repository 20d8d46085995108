"""Where builds are kept, what makes two builds the same, and building each at most once.

A build lives in ``<root>/<name>/<key>/``, where ``<key>`` hashes what the compiler
reads and how (see ``_build.library_key``): the compiler's identity and version,
every flag, the environment variables that move its search path, and each
preprocessed translation unit. The directory holds the library
``<name>.<hash>.so`` (``<hash>``: of the library's own bytes, so a process that
loaded an older build, to which the dynamic loader would hand back the library it
has for a path it already opened, loads a new one as a new library), its record
``<name>.<hash>.json`` and ``build.log``.

Finding the key takes the preprocessor; a load skips it through a direct-mode
manifest, ``<root>/<name>/direct/<direct key>.json`` (the direct key: the compiler,
the environment, the command lines and the sources' texts), which lists, for each
build made from those, every file the preprocessor opened with its hash and the
paths where a new file would shadow one (see ``_deps``). A listed build whose files
are all unchanged is the build the preprocessor would pick.
:func:`~jaxext.cpp_extension.load_inline` writes its sources into
``<root>/<name>/inline/<hash of the texts>/``.

Two processes (or threads) building the same extension at once take turns on a
file lock in that directory; the library is compiled into a temporary file and
renamed into place, and its record written after it, so nobody ever loads a
half-written library. Manifests are rewritten whole, under a lock, by renaming.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

__all__ = [
    "ENV_VAR",
    "add_to_manifest",
    "build_once",
    "cache_key",
    "cache_root",
    "file_key",
    "find_build",
    "read_manifest",
]

ENV_VAR = "JAXEXT_EXTENSIONS_DIR"
# Bump when the build layout or command changes meaning.
_FORMAT = "jaxext-cpp-extension-4"
_MANIFEST_ENTRIES = 8  # builds a manifest remembers, newest first


def cache_root(build_directory: str | os.PathLike | None) -> Path:
    """``build_directory``, else ``$JAXEXT_EXTENSIONS_DIR``, else the user cache.

    The user cache is ``$XDG_CACHE_HOME/jaxext/cpp_extensions``, with
    ``XDG_CACHE_HOME`` defaulting to ``~/.cache``.
    """
    if build_directory is not None:
        return Path(build_directory).expanduser().resolve()
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser().resolve()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser().resolve() / "jaxext" / "cpp_extensions"


def cache_key(parts: Sequence[str | bytes]) -> str:
    """A short hex digest of ``parts`` (each length-prefixed, so boundaries count)."""
    digest = hashlib.sha256(_FORMAT.encode())
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()[:16]


def file_key(path: Path) -> str:
    """A short hex digest of the file's contents (what a library's file name carries)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def find_build(
    directory: Path, name: str, current: Callable[[dict], bool]
) -> tuple[Path, dict] | None:
    """A finished build of ``name`` in ``directory`` whose record ``current`` accepts.

    Returns:
        ``(library, record)``, the newest such build, or ``None``.
    """
    records = []
    for path in directory.glob(f"{name}.*.json"):
        try:
            records.append((path.stat().st_mtime_ns, path, json.loads(path.read_text())))
        except (OSError, ValueError):
            continue
    for _, _, record in sorted(records, key=lambda r: r[0], reverse=True):
        library = directory / str(record.get("library", ""))
        if record.get("format") == _FORMAT and library.is_file() and current(record):
            return library, record
    return None


def build_once(
    directory: Path,
    name: str,
    build: Callable[[Path], dict],
    current: Callable[[dict], bool],
) -> tuple[Path, dict, bool]:
    """A build of ``name`` in ``directory`` that ``current`` accepts, made if there is none.

    Args:
        directory: the build's own directory (created if missing).
        name: the library's name; it is written as ``<name>.<hash of its bytes>.so``.
        build: writes the library to the path it is given (raising on failure) and
            returns what to record about it (JSON values, e.g. the headers it read);
            called at most once across processes while a current build exists.
        current: whether a recorded build may still be used (e.g. its headers are
            unchanged).

    Returns:
        The library's path, its record, and whether this call built it.
    """
    found = find_build(directory, name, current) if directory.is_dir() else None
    if found is not None:
        return (*found, False)
    directory.mkdir(parents=True, exist_ok=True)
    with _locked(directory / "lock"):
        found = find_build(directory, name, current)
        if found is not None:  # another process built it while we waited
            return (*found, False)
        unique = f"{os.getpid()}.{uuid.uuid4().hex}"
        temporary = directory / f".{name}.{unique}.tmp"
        try:
            record = dict(build(temporary))
            library = directory / f"{name}.{file_key(temporary)}.so"
            os.replace(temporary, library)
            record.update(format=_FORMAT, library=library.name)
            written = directory / f".{name}.{unique}.json.tmp"
            written.write_text(json.dumps(record, indent=1) + "\n")
            os.replace(written, library.with_suffix(".json"))
        finally:
            with contextlib.suppress(FileNotFoundError):
                temporary.unlink()
    return library, record, True


def read_manifest(path: Path) -> list[dict]:
    """The entries of the direct-mode manifest ``path``, newest first (none if it is
    missing or unreadable)."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(found, dict) or found.get("format") != _FORMAT:
        return []
    entries = found.get("entries")
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def add_to_manifest(path: Path, entry: dict) -> None:
    """Puts ``entry`` first in the manifest ``path`` (replacing one for the same
    ``entry["library"]``), keeping the newest few."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.parent / "lock"):
        entries = [e for e in read_manifest(path) if e.get("library") != entry["library"]]
        found = {"format": _FORMAT, "entries": [entry, *entries][:_MANIFEST_ENTRIES]}
        written = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        written.write_text(json.dumps(found) + "\n")
        os.replace(written, path)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    # flock locks the open file description: it excludes other processes and other
    # threads of this one alike (each opens its own), and is released if we die.
    with open(path, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
