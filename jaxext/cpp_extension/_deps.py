"""What the compiler reads for one source file, and whether it would read the same now.

A build is keyed, as ccache's preprocessor mode keys it, by what the compiler
actually reads and how: the preprocessed translation unit (``c++ -E`` with the
build's own flags, line markers and all, since ``__FILE__`` reaches the object), the
compiler, every flag and the environment variables that move the header search path
(``SEARCH_ENVIRONMENT``). Running the preprocessor at every load would cost a fifth
of a second a source, so each build also leaves a direct-mode manifest
(``Reading``): every file the preprocessor opened, by the path it opened it under
(a symbolic link is read through, never resolved) and by its contents' hash, and
every path where a new file would be found before one of them (``absent``: each
directory the compiler searches, and the directory of every file opened, joined with
every name the opened files include, test with ``__has_include`` or were found
under). While every opened file has its hash and every absent path is still absent,
the preprocessor would read the same files in the same order, so the build it made
fits; otherwise the preprocessed text decides.

A file that names a header through a macro (``#include HEADER``,
``__has_include(HEADER)``) or uses ``__DATE__``, ``__TIME__`` or
``__TIMESTAMP__`` gets no manifest: every load preprocesses it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = [
    "SEARCH_ENVIRONMENT",
    "Reading",
    "builtin_directories",
    "digest",
    "preprocess",
    "read_depfile",
    "search_environment",
    "unchanged",
]

# Environment variables through which GCC, Clang and nvcc find headers, libraries and
# their own programs (and SOURCE_DATE_EPOCH, which sets __DATE__ and __TIME__).
SEARCH_ENVIRONMENT = (
    "CPATH",
    "C_INCLUDE_PATH",
    "CPLUS_INCLUDE_PATH",
    "OBJC_INCLUDE_PATH",
    "OBJCPLUS_INCLUDE_PATH",
    "GCC_EXEC_PREFIX",
    "COMPILER_PATH",
    "LIBRARY_PATH",
    "SOURCE_DATE_EPOCH",
    "NVCC_PREPEND_FLAGS",
    "NVCC_APPEND_FLAGS",
    "NVCC_CCBIN",
)

# Names a file includes or tests for, as written: #include "x.h", <x.h>, __has_include.
_NAMED = re.compile(
    rb'^[ \t]*#[ \t]*include(_next)?[ \t]*([<"])([^>"\n]+)[>"]'
    rb'|__has_include(_next)?\s*\(\s*([<"])([^>"\n]+)[>"]',
    re.MULTILINE,
)
# What a manifest cannot follow: a header named by a macro, the date and time.
_UNFOLLOWED = re.compile(
    rb'^[ \t]*#[ \t]*include(?:_next)?[ \t]+[^<"\s]|__has_include(?:_next)?\s*\(\s*[^<"\s]'
    rb"|\b__(?:DATE|TIME|TIMESTAMP)__\b",
    re.MULTILINE,
)


def search_environment() -> list[list[str | None]]:
    """``[[name, value or None], ...]`` of ``SEARCH_ENVIRONMENT`` now."""
    return [[name, os.environ.get(name)] for name in SEARCH_ENVIRONMENT]


@dataclasses.dataclass(frozen=True)
class Reading:
    """What the preprocessor read for one source.

    Attributes:
        text: the SHA-256 of the preprocessed translation unit (hex).
        opened: ``((path, sha256), ...)``, every file opened (the source first), by the
            path the compiler opened it under (relative paths: to ``cwd``).
        absent: paths that did not exist and, created, could be found before a file
            in ``opened``; empty when ``direct`` is False.
        direct: whether ``opened`` and ``absent`` decide reuse (see the module).
    """

    text: str
    opened: tuple[tuple[str, str], ...]
    absent: tuple[str, ...]
    direct: bool


def preprocess(command: Sequence[str], cwd: str, follow: bool) -> Reading:
    """Runs ``command`` (a compile command without ``-c`` and output) with ``-E``.

    Args:
        command: the compiler and its flags, the source last.
        cwd: the directory it runs in.
        follow: whether to ask for what it read (``-v -MD -MF``, GCC and Clang); else
            only the text counts.

    Raises:
        subprocess.CalledProcessError: if the preprocessor fails (the compile will
            report the error with its diagnostics).
    """
    with tempfile.TemporaryDirectory(prefix="jaxext-deps-") as work:
        depfile = Path(work) / "unit.d"
        extra = ["-v", "-MD", "-MF", str(depfile)] if follow else []
        *head, source = command
        done = subprocess.run(
            [*head, "-E", *extra, source], cwd=cwd, capture_output=True, check=False
        )
        if done.returncode != 0:
            raise subprocess.CalledProcessError(done.returncode, command, done.stdout, done.stderr)
        text = hashlib.sha256(done.stdout).hexdigest()
        if not follow:
            return Reading(text, (), (), False)
        opened = read_depfile(depfile)
    contents = {path: _read(path, cwd) for path in opened}
    direct = not any(_UNFOLLOWED.search(data) for data in contents.values())
    absent = _absent(contents, done.stderr, cwd) if direct else ()
    hashes = tuple((path, hashlib.sha256(data).hexdigest()) for path, data in contents.items())
    return Reading(text, hashes, absent, direct)


def _read(path: str, cwd: str) -> bytes:
    return Path(cwd, path).read_bytes()


def _searched(stderr: bytes) -> tuple[list[str], list[str], list[str]]:
    """``(quote, bracket, missing)``: the directories ``-v`` output lists for
    ``#include "..."`` (before the bracket ones) and ``#include <...>``, and those it
    ignored as nonexistent (created, they would be searched)."""
    quote, bracket, missing = [], [], []
    into = None
    for raw in stderr.decode(errors="surrogateescape").splitlines():
        if raw.startswith('#include "..." search starts here'):
            into = quote
        elif raw.startswith("#include <...> search starts here"):
            into = bracket
        elif raw.startswith("End of search list"):
            into = None
        elif into is not None and raw.startswith(" "):
            into.append(raw.strip().split(" (")[0])
        elif raw.startswith('ignoring nonexistent directory "'):
            missing.append(raw[len('ignoring nonexistent directory "') : -1])
    return quote, bracket, missing


def _absent(contents: dict[str, bytes], stderr: bytes, cwd: str) -> tuple[str, ...]:
    """Where a new file would be found before one the preprocessor opened.

    For each name a file includes or tests for, the directories searched for it (the
    file's own directory first for ``"..."``), up to the first where it exists (all of
    them for ``_next``, which starts past the file's own); and each directory that was
    ignored as nonexistent. The implicit ``<stdc-predef.h>`` counts as included by the
    source (the first file).
    """
    quote, bracket, missing = _searched(stderr)
    absent = set(missing)
    seen = set()
    for index, (path, data) in enumerate(contents.items()):
        named = [(m.group(1) or m.group(4), m.group(2) or m.group(5), m.group(3) or m.group(6))
                 for m in _NAMED.finditer(data)]  # fmt: skip
        if index == 0:
            named.append((None, b"<", b"stdc-predef.h"))
        here = os.path.dirname(path) or "."
        for following, delimiter, raw in named:
            name = raw.decode(errors="surrogateescape")
            quoted = delimiter == b'"'
            key = (here if quoted else None, bool(following), name)
            if key in seen:
                continue
            seen.add(key)
            if os.path.isabs(name):  # opened by that path, or absent
                if not os.path.lexists(name):
                    absent.add(name)
                continue
            chain = [here, *quote, *bracket] if quoted else bracket
            for directory in chain:
                probe = os.path.join(directory, name)
                if os.path.lexists(os.path.join(cwd, probe)):
                    if not following:
                        break
                else:
                    absent.add(probe)
    return tuple(sorted(absent))


def unchanged(
    opened: object, absent: object, base: str, digests: dict[str, str | None] | None = None
) -> bool:
    """Whether every ``[path, sha256]`` in ``opened`` still has that hash and every path
    in ``absent`` is still absent (relative paths: to ``base``).

    A missing or unreadable file, or a malformed list, counts as changed. ``digests``
    caches hashes across calls (one load checks several manifests).
    """
    if not (isinstance(opened, list) and isinstance(absent, list)):
        return False
    digests = {} if digests is None else digests
    join = os.path.join
    for row in opened:
        if not (isinstance(row, list) and len(row) == 2 and all(isinstance(v, str) for v in row)):
            return False
        path = join(base, row[0])
        if path not in digests:
            try:
                with open(path, "rb", buffering=0) as handle:
                    digests[path] = hashlib.sha256(handle.read()).hexdigest()
            except OSError:
                digests[path] = None
        if digests[path] != row[1]:
            return False
    for path in absent:
        if not isinstance(path, str):
            return False
        try:
            os.lstat(join(base, path))
        except FileNotFoundError:
            continue
        except OSError:  # e.g. a file where a directory was: still absent as a header
            if not os.path.lexists(join(base, path)):
                continue
        return False
    return True


def read_depfile(path: Path) -> list[str]:
    """The prerequisites of the make rule(s) in the depfile ``path``, as written, in order.

    Handles line continuations (``\\`` at the end of a line) and escaped spaces
    (``\\ ``) in names, as GCC, Clang and nvcc write them.
    """
    text = path.read_text(errors="surrogateescape").replace("\\\r\n", " ").replace("\\\n", " ")
    found: dict[str, None] = {}
    for line in text.splitlines():
        # "target: prereq prereq ...". The target is a path too and may hold a colon
        # only as "C:" on Windows, which we do not build on.
        head, sep, rest = line.partition(": ")
        if not sep:
            continue
        for name in _split(rest):
            found[name] = None
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


@functools.cache
def builtin_directories(argv: tuple[str, ...], include_dir: str) -> tuple[str, ...]:
    """Where the compiler ``argv`` finds the system's headers by itself, and jaxlib's
    ``include_dir``, resolved.

    Headers under these belong to the compiler, the C library and jaxlib, which every
    build's key names (the compiler's ``--version``, the jaxlib version); the others,
    those found through ``SEARCH_ENVIRONMENT`` included, are the extension's own. Asked
    of the compiler with ``-E -v`` and the search variables unset (GCC and Clang print
    the list; for another compiler, such as nvcc, ``/usr`` and the compiler's own
    installation count).
    """
    found = [str(Path(include_dir).resolve())]
    environment = {k: v for k, v in os.environ.items() if k not in SEARCH_ENVIRONMENT}
    try:
        done = subprocess.run(
            [*argv, "-x", "c++", "-E", "-v", "-"],
            input=b"",
            capture_output=True,
            timeout=60,
            check=False,
            env=environment,
        )
        quote, bracket, _ = _searched(done.stderr)
        searched = [*quote, *bracket]
    except (OSError, subprocess.SubprocessError):
        searched = []
    found += [str(Path(d).resolve()) for d in searched]
    if len(found) == 1:  # not GCC or Clang
        found += [str(Path("/usr").resolve()), str(Path(argv[0]).resolve().parent.parent)]
    return tuple(dict.fromkeys(found))


def is_under(path: str, directories: Sequence[str]) -> bool:
    """Whether ``path`` (resolved) lies in one of ``directories`` (resolved)."""
    resolved = Path(path).resolve()
    return any(resolved.is_relative_to(d) for d in directories)
