"""Where builds are kept, what makes two builds the same, and building each at most once.

A build lives in ``<root>/<name>/<key>/``, where ``<key>`` hashes what is known
before compiling: the sources' names and contents, the compiler command and its
``--version`` output, the flags (``-I`` directories included), the include
directories, the jaxlib version (its FFI headers) and the platform. The headers are
known only once the compiler has read them: each build in the directory is a library
``<name>.<hash>.so`` (``<hash>``: of the library's own bytes) with a record
``<name>.<hash>.json`` beside it listing every header the compiler read (its
``-MD`` output) with the SHA-256 of its contents. A build is reused only while every
one of those files still has that hash; an edited header makes a new build, under a
new file name, so a process that loaded the old library (the dynamic loader hands
back the library it has for a path it already opened) loads the new one as a new
library. The directory also holds ``build.log`` and, for
:func:`~jaxext.cpp_extension.load_inline`, the sources written out.

Two processes (or threads) building the same extension at once take turns on a
file lock in that directory; the library is compiled into a temporary file and
renamed into place, and its record written after it, so nobody ever loads a
half-written library.
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

__all__ = ["ENV_VAR", "build_once", "cache_key", "cache_root", "file_key", "find_build"]

ENV_VAR = "JAXEXT_EXTENSIONS_DIR"
# Bump when the build layout or command changes meaning.
_FORMAT = "jaxext-cpp-extension-3"


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
