"""The headers a build read, from the compiler's own dependency output.

Each source is compiled with ``-MD -MF <object>.d``: the compiler writes, as a make
rule, every file it opened while preprocessing (through ``#include`` lines, ``-I``
and ``-isystem`` directories, ``-include``, macros that name headers: whatever it
actually read, not what a scan of the text would guess). A build records those files
with their contents' hashes, and is reused only while every one still has that hash.
"""

from __future__ import annotations

import functools
import hashlib
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["digest", "read_depfile", "record", "still_current", "system_directories"]


def read_depfile(path: Path) -> list[Path]:
    """The prerequisites of the make rule(s) in the depfile ``path``, resolved, in order.

    Handles line continuations (``\\`` at the end of a line) and escaped spaces
    (``\\ ``) in names, as GCC, Clang and nvcc write them.
    """
    text = path.read_text(errors="surrogateescape").replace("\\\r\n", " ").replace("\\\n", " ")
    found: dict[Path, None] = {}
    for line in text.splitlines():
        # "target: prereq prereq ...". The target is a path too and may hold a colon
        # only as "C:" on Windows, which we do not build on.
        head, sep, rest = line.partition(": ")
        if not sep:
            continue
        for name in _split(rest):
            found[Path(name).resolve()] = None
    return list(found)


def _split(text: str) -> Iterable[str]:
    word, escaped = [], False
    for char in text:
        if escaped:
            word.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char.isspace():
            if word:
                yield "".join(word)
                word = []
        else:
            word.append(char)
    if word:
        yield "".join(word)


def digest(path: Path) -> str:
    """The SHA-256 of the file's contents, hex."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record(paths: Sequence[Path], relative_to: Path | None = None) -> list[list[str]]:
    """``[[path, sha256], ...]`` of ``paths``, for a build's record.

    Paths under ``relative_to`` are written relative to it (a prebuilt library's
    directory moves with the package it ships in); the others absolute.
    """
    rows = []
    for path in paths:
        name = str(path)
        if relative_to is not None and path.is_relative_to(relative_to):
            name = str(path.relative_to(relative_to))
        rows.append([name, digest(path)])
    return rows


def still_current(rows: object, base: Path | None = None) -> bool:
    """Whether every ``[path, sha256]`` of a record still names a file with that hash.

    A missing file, an unreadable one or a malformed record counts as changed.
    """
    if not isinstance(rows, list):
        return False
    for row in rows:
        if not (isinstance(row, list) and len(row) == 2 and all(isinstance(v, str) for v in row)):
            return False
        path = Path(row[0])
        if not path.is_absolute():
            if base is None:
                return False
            path = base / path
        try:
            if digest(path) != row[1]:
                return False
        except OSError:
            return False
    return True


@functools.cache
def system_directories(argv: tuple[str, ...], include_dir: str) -> tuple[Path, ...]:
    """Where the compiler ``argv`` finds the system's headers, and jaxlib's ``include_dir``.

    Headers under these belong to the compiler, the C library and jaxlib, which the
    build's key already names (the compiler's ``--version``, the jaxlib version); the
    others are the extension's own, and their contents are part of its FFI target
    names. Asked of the compiler with ``-E -v`` (GCC and Clang print the list; for
    another compiler, such as nvcc, only ``/usr`` and the compiler's own installation
    count).
    """
    found = [Path(include_dir).resolve()]
    try:
        done = subprocess.run(
            [*argv, "-x", "c++", "-E", "-v", "-"],
            input="",
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        lines = done.stderr.splitlines()
    except (OSError, subprocess.SubprocessError):
        lines = []
    inside = False
    for line in lines:
        if line.startswith("#include <...> search starts here"):
            inside = True
        elif line.startswith("End of search list"):
            inside = False
        elif inside and line.strip():
            found.append(Path(line.strip().split(" (")[0]).resolve())
    if len(found) == 1:  # not GCC or Clang
        found += [Path("/usr").resolve(), Path(argv[0]).resolve().parent.parent]
    return tuple(dict.fromkeys(found))


def is_under(path: Path, directories: Sequence[Path]) -> bool:
    """Whether ``path`` lies in one of ``directories``."""
    return any(path.is_relative_to(d) for d in directories)
