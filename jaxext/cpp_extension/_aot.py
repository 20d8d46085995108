"""`build`: compile an extension ahead of time into a directory, for ``load`` to find."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ._load import PathLike, build_plan, check_name, source_paths
from ._prebuilt import write_prebuilt

__all__ = ["build"]


def build(
    name: str,
    sources: PathLike | Sequence[PathLike],
    output_directory: PathLike | None = None,
    *,
    extra_cflags: Sequence[str] = (),
    extra_ldflags: Sequence[str] = (),
    extra_include_paths: Sequence[PathLike] = (),
    platform: str | None = None,
    verbose: bool = False,
) -> Path:
    """Compiles an extension ahead of time, for :func:`~jaxext.cpp_extension.load` to use.

    Writes ``<output_directory>/<name>.<hash>.so`` (``<hash>``: of the library's
    bytes, so a rebuilt library is a new file that a running process loads anew;
    the library the previous build wrote is removed) and ``<name>.json`` beside it:
    what the compiler read, as the build cache matches it (the sources, include
    paths, flags, search environment variables, and every file of the extension's
    own the preprocessor opened, with its hash, and the paths where a new file would
    shadow one), the platform and the jaxlib it was built against. A later
    ``load(name, sources, ...)`` looking in that directory (the first source's
    directory, or its ``prebuilt_directory``) uses it, without a compiler, only when
    all of that is as recorded: build it into your package (next to its sources)
    before making the wheel, and machines without a compiler can use it. Otherwise
    ``load`` passes it over and compiles (or, without a compiler, says so). The
    library is for one platform and jaxlib: ``load`` refuses it, naming both
    versions, under another jaxlib.

    The same as ``python -m jaxext.cpp_extension build NAME SOURCE... [-o DIR]``.

    Args:
        name: the extension's name (as given to ``load``).
        sources: its source files.
        output_directory: where to write the library. Default: the first source's
            directory, where ``load`` looks without being told.
        extra_cflags: as for ``load``; ``load`` must be given the same.
        extra_ldflags: as for ``load``; ``load`` must be given the same.
        extra_include_paths: as for ``load``.
        platform: as for ``load``.
        verbose: print the compiler command and output.

    Returns:
        The path of the library.

    Raises:
        TypeError, ValueError, FileNotFoundError, CompilerNotFoundError, CompileError:
            as :func:`~jaxext.cpp_extension.load` does.
    """
    check_name(name)
    paths = source_paths(sources)
    files = {path: path.read_text() for path in paths}
    plan = build_plan(
        name, files, False, extra_cflags, extra_ldflags, extra_include_paths, platform
    )
    directory = paths[0].parent if output_directory is None else Path(output_directory)
    return write_prebuilt(plan, directory.expanduser().resolve(), verbose)
