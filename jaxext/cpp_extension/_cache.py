"""Where builds are kept, what makes two builds the same, and building each at most once.

A build lives in ``<root>/<name>/<key>/``, where ``<key>`` hashes everything that
goes into the library: the sources' names and contents, the headers they include
(found by following ``#include`` lines, see ``included_headers``), the compiler
command and its ``--version`` output, the flags, the jaxlib version (its FFI
headers) and the platform. The directory holds ``<name>.so``, ``build.log`` and, for
:func:`~jaxext.cpp_extension.load_inline`, the sources written out.

Two processes (or threads) building the same extension at once take turns on a
file lock in that directory; the library is compiled into a temporary file and
renamed into place, so nobody ever loads a half-written library.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

__all__ = ["ENV_VAR", "build_once", "cache_key", "cache_root", "included_headers"]

ENV_VAR = "JAXEXT_EXTENSIONS_DIR"
# Bump when the build layout or command changes meaning.
_FORMAT = "jaxext-cpp-extension-2"


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


def build_once(
    directory: Path,
    library_name: str,
    build: Callable[[Path], None],
) -> tuple[Path, bool]:
    """Makes ``directory / library_name`` with ``build(temporary_path)`` unless it exists.

    Args:
        directory: the build's own directory (created if missing).
        library_name: file name of the finished library in it.
        build: writes the library to the path it is given (raising on failure);
            called at most once across processes for one ``directory``.

    Returns:
        The library's path, and whether this call built it.
    """
    library = directory / library_name
    if library.exists():
        return library, False
    directory.mkdir(parents=True, exist_ok=True)
    with _locked(directory / "lock"):
        if library.exists():  # another process built it while we waited
            return library, False
        temporary = directory / f".{library_name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            build(temporary)
            os.replace(temporary, library)
        finally:
            with contextlib.suppress(FileNotFoundError):
                temporary.unlink()
    return library, True


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


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^">]+)[">]', re.MULTILINE)


def included_headers(
    sources: Sequence[tuple[Path | None, str]], include_dirs: Sequence[Path]
) -> list[tuple[str, bytes]]:
    """The headers the sources include, found by name, for the cache key.

    Follows ``#include "..."`` (relative to the including file, then ``include_dirs``)
    and ``#include <...>`` (in ``include_dirs`` only) recursively, without
    preprocessing: an include inside ``#if 0`` counts too, which only makes the key
    stricter. Headers found nowhere (the system's, jaxlib's) are not followed.

    Args:
        sources: ``(path or None, text)`` of each source (``None``: no directory of
            its own, as for ``load_inline``).
        include_dirs: the ``-I`` directories, in order.

    Returns:
        ``(name as included, contents)`` of each header, in the order first found.
    """
    found: dict[Path, tuple[str, bytes]] = {}
    stack = [(path, text) for path, text in reversed(sources)]
    while stack:
        path, text = stack.pop()
        for kind, name in _INCLUDE.findall(text):
            bases = ([path.parent] if kind == '"' and path is not None else []) + list(include_dirs)
            for base in bases:
                candidate = (base / name).resolve()
                if candidate.is_file():
                    if candidate not in found:
                        data = candidate.read_bytes()
                        found[candidate] = (name, data)
                        stack.append((candidate, data.decode(errors="replace")))
                    break
    return list(found.values())
