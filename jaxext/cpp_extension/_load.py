"""`load` and `load_inline`: compile C++ XLA FFI handlers at first use and register them."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from ._build import (
    PRELUDE,
    BuildPlan,
    compile_failure,
    compile_units,
    direct_key,
    library_key,
    own_files,
    read_units,
    target_key,
    units,
    write_inline,
)
from ._cache import add_to_manifest, build_once, cache_key, cache_root, find_build, read_manifest
from ._compiler import find_compiler
from ._deps import Reading, unchanged
from ._errors import CompilerNotFoundError
from ._module import Extension
from ._native import CHECKING_SOURCE
from ._partition import check_rule
from ._prebuilt import find_prebuilt
from ._registry import register_handlers
from ._symbols import exported_c_functions

__all__ = ["build_plan", "check_name", "load", "load_inline", "source_paths"]

PathLike = str | os.PathLike
_CPP_SUFFIXES = (".cc", ".cpp", ".cxx", ".c++", ".C")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HANDLER = re.compile(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\s*\(\s*([A-Za-z_][A-Za-z0-9_]*)")
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)


def load(
    name: str,
    sources: PathLike | Sequence[PathLike],
    functions: str | Sequence[str] | None = None,
    *,
    extra_cflags: Sequence[str] = (),
    extra_ldflags: Sequence[str] = (),
    extra_include_paths: Sequence[PathLike] = (),
    build_directory: PathLike | None = None,
    platform: str | None = None,
    partition: Mapping[str, str | None] | None = None,
    verbose: bool = False,
    prebuilt_directory: PathLike | None = None,
) -> Extension:
    """Compiles C++ (or CUDA) source files of XLA FFI handlers and registers them with JAX.

    The sources are compiled with ``$CXX`` (else ``c++``; ``nvcc`` when a source is
    ``.cu``) as ``-std=c++17 -O3 -fPIC`` and linked with ``-shared``, against the
    XLA FFI headers that ship with jaxlib (``jax.ffi.include_dir()``), once: a build
    is reused only when the compiler would read the same things the same way (its
    identity and version, every flag, the environment variables that move its search
    path such as ``CPLUS_INCLUDE_PATH``, and the preprocessed text of every source),
    in this process or another. A direct-mode manifest of every file the preprocessor
    opened (by the path it opened it under, and by content) and of the paths where a
    new file would shadow one lets a load skip the preprocessor while they are all as
    recorded. A library built anew gets a new file name (the hash of its bytes), so
    loading it again in a process that loaded an older build runs the new code.

    A library built ahead of time with ``python -m jaxext.cpp_extension build``
    (see :func:`jaxext.cpp_extension.build`) is used instead, without a compiler,
    when it is found, built from what the compiler would read now (the same name,
    sources, include paths, flags, search environment and headers, matched the same
    way), in ``prebuilt_directory`` or in the directory of the first source.

    Without ``functions``, the handlers are the functions the built library exports
    with C linkage (read from its ELF symbol table, leaving out jaxext's own), as
    ``XLA_FFI_DEFINE_HANDLER_SYMBOL`` defines them, also when a macro stamps them out.

    Args:
        name: the extension's name, a C identifier; FFI targets are registered
            under it, so two extensions may define handlers of the same name.
        sources: source file paths (``.cc``, ``.cpp``, ``.cxx``, or ``.cu``).
        functions: the handler symbols to register, each defined in the sources
            with ``XLA_FFI_DEFINE_HANDLER_SYMBOL``. ``None``: every function the
            built library exports with C linkage (name them when the sources
            export other ``extern "C"`` functions).
        extra_cflags: more compiler flags, e.g. ``["-march=native"]``.
        extra_ldflags: more linker flags, e.g. ``["-lm"]``.
        extra_include_paths: more ``-I`` directories.
        build_directory: where builds are cached. Default: ``$JAXEXT_EXTENSIONS_DIR``,
            else ``~/.cache/jaxext/cpp_extensions`` (under ``$XDG_CACHE_HOME`` if set).
        platform: ``"cpu"`` or ``"CUDA"``, the platform the handlers are registered
            for. Default: ``"CUDA"`` if a source is ``.cu``, else ``"cpu"``.
        partition: ``{handler: rule}``, how each handler splits over a device mesh
            (its ``FfiFunction.partition``; experimental):
            ``"batch"`` (the leading dimension of the first operand and of every
            result), an einsum-like rule such as ``"b i, o i -> b o"``, or ``None``
            (the default for handlers not named: sharded operands are gathered and
            every device runs the whole kernel). See ``partition`` in
            ``FfiFunction.__call__``,
            which can also override it per call.
        verbose: print the compiler command and output.
        prebuilt_directory: a directory to look in first for a library built ahead
            of time (the directory of the first source is always looked in).

    Returns:
        An :class:`jaxext.cpp_extension.Extension` whose attributes are the handlers, each called as
        ``ext.handler(*arrays, result_shape_dtypes=..., vmap_method=..., **attributes)``.

    Raises:
        TypeError: if an argument has the wrong type (e.g. ``sources`` is not a list of
            paths).
        ValueError: if ``name``, ``sources``, ``functions`` or ``platform`` is malformed,
            or the built library exports no handler.
        FileNotFoundError: if a source file does not exist.
        CompilerNotFoundError: if no compiler is installed (the message says what to
            install).
        CompileError: if compilation fails (the message lists the compiler's
            ``file:line`` errors; ``.output`` holds everything it printed).
        MissingHandlerError: if a symbol in ``functions`` is not in the library.
        ExtensionError: if the library cannot be loaded: an undefined symbol (the
            message names it and the ``extra_ldflags`` to pass), or a prebuilt library
            built against another jaxlib (the message names both versions).

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> import jax.numpy as jnp
        >>> from jaxext import cpp_extension
        >>> src = Path(tempfile.mkdtemp()) / "negate.cc"
        >>> _ = src.write_text('''
        ... #include "xla/ffi/api/ffi.h"
        ... namespace ffi = xla::ffi;
        ... ffi::Error Negate(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
        ...   if (y->element_count() != x.element_count())
        ...     return ffi::Error::InvalidArgument("negate: result size differs from x");
        ...   for (size_t i = 0; i < x.element_count(); ++i)
        ...     y->typed_data()[i] = -x.typed_data()[i];
        ...   return ffi::Error::Success();
        ... }
        ... XLA_FFI_DEFINE_HANDLER_SYMBOL(negate, Negate,
        ...     ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
        ... ''')
        >>> ext = cpp_extension.load("negate_ext", [src], build_directory=src.parent)
        >>> x = jnp.arange(3.0)
        >>> ext.negate(x, result_shape_dtypes=x)
        Array([-0., -1., -2.], dtype=float32)
    """
    check_name(name)
    paths = source_paths(sources)
    return _load(
        name,
        {path: path.read_text() for path in paths},
        functions,
        extra_cflags=extra_cflags,
        extra_ldflags=extra_ldflags,
        extra_include_paths=extra_include_paths,
        build_directory=build_directory,
        platform=platform,
        partition=partition,
        verbose=verbose,
        prebuilt=_prebuilt_directories(prebuilt_directory, paths),
    )


def _prebuilt_directories(directory: PathLike | None, paths: Sequence[Path]) -> list[Path]:
    if directory is not None and not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"`prebuilt_directory` must be a path; got {type(directory).__name__}.")
    found = [] if directory is None else [Path(directory).expanduser().resolve()]
    return list(dict.fromkeys([*found, paths[0].parent]))


def load_inline(
    name: str,
    cpp_sources: str | Sequence[str],
    cuda_sources: str | Sequence[str] | None = None,
    functions: str | Sequence[str] | None = None,
    *,
    extra_cflags: Sequence[str] = (),
    extra_ldflags: Sequence[str] = (),
    extra_include_paths: Sequence[PathLike] = (),
    build_directory: PathLike | None = None,
    platform: str | None = None,
    partition: Mapping[str, str | None] | None = None,
    verbose: bool = False,
) -> Extension:
    """Like :func:`jaxext.cpp_extension.load`, with the sources given as strings.

    The C++ strings are joined into ``<name>.cc`` (the CUDA ones into
    ``<name>.cu``), written into the cache (``<root>/<name>/inline/<hash>/``), and
    compiled there, with ``xla/ffi/api/ffi.h`` already included and
    ``namespace ffi = xla::ffi;`` declared, so the sources can start with the
    handlers. The compiler's line numbers are those of the joined strings. The
    compiler runs in that directory: give paths in ``extra_cflags`` and
    ``extra_ldflags`` absolute.

    Args:
        name: the extension's name (see :func:`jaxext.cpp_extension.load`).
        cpp_sources: C++ source text, or a list of texts joined with newlines.
        cuda_sources: CUDA source text(s); when given, everything is compiled with
            ``nvcc`` and the handlers register for ``"CUDA"`` by default.
        functions: the handler symbols to register; ``None``: every function the
            built library exports with C linkage (see :func:`jaxext.cpp_extension.load`).
        extra_cflags: see :func:`jaxext.cpp_extension.load`.
        extra_ldflags: see :func:`jaxext.cpp_extension.load`.
        extra_include_paths: see :func:`jaxext.cpp_extension.load`.
        build_directory: see :func:`jaxext.cpp_extension.load`.
        platform: see :func:`jaxext.cpp_extension.load`.
        partition: see :func:`jaxext.cpp_extension.load`.
        verbose: see :func:`jaxext.cpp_extension.load`.

    Returns:
        An :class:`jaxext.cpp_extension.Extension` (see :func:`jaxext.cpp_extension.load`).

    Raises:
        TypeError, ValueError, CompilerNotFoundError, CompileError, MissingHandlerError:
            as :func:`jaxext.cpp_extension.load` does.

    Example:
        >>> import tempfile
        >>> import jax, jax.numpy as jnp
        >>> from jaxext import cpp_extension
        >>> ext = cpp_extension.load_inline(
        ...     "square_ext",
        ...     '''
        ...     ffi::Error Square(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
        ...       if (y->element_count() != x.element_count())
        ...         return ffi::Error::InvalidArgument("square: result size differs from x");
        ...       for (size_t i = 0; i < x.element_count(); ++i)
        ...         y->typed_data()[i] = x.typed_data()[i] * x.typed_data()[i];
        ...       return ffi::Error::Success();
        ...     }
        ...     XLA_FFI_DEFINE_HANDLER_SYMBOL(square, Square,
        ...         ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
        ...     ''',
        ...     functions=["square"],
        ...     build_directory=tempfile.mkdtemp(),
        ... )
        >>> x = jnp.arange(4.0)
        >>> jax.jit(lambda x: ext.square(x, result_shape_dtypes=x))(x)
        Array([0., 1., 4., 9.], dtype=float32)
    """
    check_name(name)
    cpp = _joined(cpp_sources, "cpp_sources")
    files = {f"{name}.cc": cpp}
    if cuda_sources is not None:
        files[f"{name}.cu"] = _joined(cuda_sources, "cuda_sources")
    return _load(
        name,
        files,
        functions,
        inline=True,
        extra_cflags=extra_cflags,
        extra_ldflags=extra_ldflags,
        extra_include_paths=extra_include_paths,
        build_directory=build_directory,
        platform=platform,
        partition=partition,
        verbose=verbose,
    )


def _load(
    name: str,
    files: Mapping[Path | str, str],
    functions: str | Sequence[str] | None,
    *,
    inline: bool = False,
    extra_cflags: Sequence[str],
    extra_ldflags: Sequence[str],
    extra_include_paths: Sequence[PathLike],
    build_directory: PathLike | None,
    platform: str | None,
    partition: Mapping[str, str | None] | None,
    verbose: bool,
    prebuilt: Sequence[Path] = (),
) -> Extension:
    """Builds (once) and registers.

    ``files``: ``{source path: its text}``, or for ``inline``, ``{file name: text}``
    (written into the cache, see ``_build.write_inline``).
    """
    plan = build_plan(
        name, files, inline, extra_cflags, extra_ldflags, extra_include_paths, platform
    )  # fmt: skip
    wanted = None if functions is None else _functions(functions)
    found, stale = find_prebuilt(plan, prebuilt)
    built = False
    if found is not None:
        library, key = found
        if verbose:
            print(f"[jaxext.cpp_extension] {name!r}: using the prebuilt {library}", flush=True)
    else:
        library, key, built = _build_cached(plan, build_directory, verbose, stale)
    symbols = wanted if wanted is not None else _discovered(library, list(files.values()))
    rules = _partition_rules(partition, symbols)
    targets = register_handlers(name, library, plan.prefix(key), symbols, plan.platform)
    return Extension(name, library, built, plan.platform, targets, rules)


def build_plan(
    name: str,
    files: Mapping[Path | str, str],
    inline: bool,
    extra_cflags: object,
    extra_ldflags: object,
    extra_include_paths: object,
    platform: str | None,
) -> BuildPlan:
    """What to compile, checked, with the compiler-independent source key."""
    sources = list(files)
    inline_files = {str(s): t for s, t in files.items()} if inline else {}
    cflags = _strings(extra_cflags, "extra_cflags")
    ldflags = _strings(extra_ldflags, "extra_ldflags")
    includes = [Path(p).expanduser().resolve() for p in _paths(extra_include_paths)]
    cuda = any(str(s).endswith(".cu") for s in sources)
    platform = _platform(platform, cuda)
    key = cache_key(
        [
            name,
            platform,
            repr(cflags),
            repr(ldflags),
            repr(sorted(inline_files)),
            *(part for s, t in files.items() for part in (Path(s).name, t)),
            PRELUDE if inline_files else "",
            CHECKING_SOURCE.read_bytes(),
        ]
    )
    return BuildPlan(
        name=name, sources=tuple(sources), inline_files=dict(inline_files), cflags=tuple(cflags),
        ldflags=tuple(ldflags), includes=tuple(includes), platform=platform, cuda=cuda,
        source_key=key,
    )  # fmt: skip


def _build_cached(
    plan: BuildPlan, build_directory: PathLike | None, verbose: bool, stale: list[Path]
) -> tuple[Path, str, bool]:
    """The build of ``plan`` from what the compiler reads now, made if there is none.

    A direct-mode manifest whose files are unchanged names it without running the
    preprocessor; otherwise the preprocessed sources name it (see ``_cache``).

    Returns:
        ``(library, target key, whether it was built now)``.
    """
    try:
        compiler = find_compiler(plan.cuda)
    except CompilerNotFoundError as err:
        if stale:
            raise CompilerNotFoundError(
                f"{err} (A prebuilt {plan.name!r} was found, but for other sources, headers, "
                f"include paths or flags: {', '.join(map(str, stale))}; rebuild it with "
                "`python -m jaxext.cpp_extension build`.)"
            ) from None
        raise
    root = cache_root(build_directory) / plan.name
    inline = None
    if plan.inline_files:
        texts = [part for item in sorted(plan.inline_files.items()) for part in item]
        inline = root / "inline" / cache_key([PRELUDE, *texts])
        write_inline(plan, inline)
    found = units(plan, compiler, inline)
    manifest = root / "direct" / f"{direct_key(plan, compiler, found)}.json"
    cached = _from_manifest(root, plan.name, manifest, found[0].cwd)
    if cached is not None:
        library, record = cached
        if verbose:
            print(
                f"[jaxext.cpp_extension] {plan.name!r}: using the cached build {library}",
                flush=True,
            )
        return library, record["target_key"], False
    readings = read_units(compiler, found)
    if readings is None:  # the preprocessor failed: the compiler says why
        raise compile_failure(plan, compiler, found, root / "failed", verbose)
    directory = root / library_key(plan, compiler, found, readings)

    def build(output: Path) -> dict:
        compile_units(plan, compiler, found, directory, output, verbose)
        return {"target_key": target_key(plan, own_files(compiler, found, readings))}

    library, record, built = build_once(directory, plan.name, build, _has_target_key)
    if all(r.direct for r in readings):
        add_to_manifest(manifest, _manifest_entry(directory.name, readings))
    if verbose and not built:
        print(f"[jaxext.cpp_extension] {plan.name!r}: using the cached build {library}", flush=True)
    return library, record["target_key"], built


def _has_target_key(record: dict) -> bool:
    return isinstance(record.get("target_key"), str)


def _manifest_entry(key: str, readings: Sequence[Reading]) -> dict:
    opened = {path: sha for reading in readings for path, sha in reading.opened}
    absent = sorted({path for reading in readings for path in reading.absent})
    return {"library": key, "opened": [[p, h] for p, h in opened.items()], "absent": absent}


def _from_manifest(root: Path, name: str, manifest: Path, cwd: str) -> tuple[Path, dict] | None:
    """The build a manifest entry names whose files are all as recorded, if any."""
    digests: dict[str, str | None] = {}
    for entry in read_manifest(manifest):
        key = entry.get("library")
        if not (isinstance(key, str) and key.isalnum()):
            continue
        if unchanged(entry.get("opened"), entry.get("absent"), cwd, digests):
            directory = root / key
            found = find_build(directory, name, _has_target_key) if directory.is_dir() else None
            if found is not None:
                return found
    return None


def _partition_rules(
    partition: Mapping[str, str | None] | None, symbols: Sequence[str]
) -> dict[str, str | None]:
    if partition is None:
        return {}
    if not isinstance(partition, Mapping):
        raise TypeError(
            f"`partition` must be a dict {{handler name: rule}}; got {type(partition).__name__}."
        )
    unknown = sorted(set(partition) - set(symbols))
    if unknown:
        raise ValueError(
            f"`partition` names handlers that are not loaded: {unknown}; loaded: {list(symbols)}."
        )
    return {name: check_rule(rule) for name, rule in partition.items()}


def check_name(name: object) -> None:
    if not isinstance(name, str):
        raise TypeError(f"`name` must be a string; got {type(name).__name__}.")
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"`name` must be a C identifier (letters, digits, underscores); got {name!r}."
        )


def source_paths(sources: object) -> list[Path]:
    items = [sources] if isinstance(sources, (str, os.PathLike)) else sources
    if not isinstance(items, Sequence):
        raise TypeError(f"`sources` must be a list of file paths; got {type(sources).__name__}.")
    if not items:
        raise ValueError("`sources` must name at least one file; got an empty list.")
    paths = []
    for item in items:
        if not isinstance(item, (str, os.PathLike)):
            raise TypeError(f"`sources` must hold file paths; got {item!r}.")
        path = Path(item).expanduser().resolve()
        if path.suffix not in (*_CPP_SUFFIXES, ".cu"):
            raise ValueError(
                f"`sources` entries must end in {', '.join(_CPP_SUFFIXES)} or .cu; "
                f"got {path.name!r}."
            )
        if not path.is_file():
            raise FileNotFoundError(f"`sources` entry {str(item)!r} does not exist.")
        paths.append(path)
    return paths


def _joined(texts: object, arg: str) -> str:
    items = [texts] if isinstance(texts, str) else texts
    if not isinstance(items, Sequence) or not all(isinstance(t, str) for t in items):
        raise TypeError(f"`{arg}` must be a string or a list of strings; got {texts!r}.")
    return "\n".join(items)


def _strings(values: object, arg: str) -> list[str]:
    items = [values] if isinstance(values, str) else values
    if not isinstance(items, Sequence) or not all(isinstance(v, str) for v in items):
        raise TypeError(f"`{arg}` must be a list of strings; got {values!r}.")
    return list(items)


def _paths(values: object) -> list[PathLike]:
    items = [values] if isinstance(values, (str, os.PathLike)) else values
    if not isinstance(items, Sequence) or not all(isinstance(v, (str, os.PathLike)) for v in items):
        raise TypeError(f"`extra_include_paths` must be a list of paths; got {values!r}.")
    return list(items)


def _platform(platform: str | None, cuda: bool) -> str:
    if platform is None:
        return "CUDA" if cuda else "cpu"
    if isinstance(platform, str) and platform.lower() in ("cpu", "cuda", "gpu"):
        return "cpu" if platform.lower() == "cpu" else "CUDA"
    raise ValueError(f"`platform` must be 'cpu' or 'CUDA'; got {platform!r}.")


def _functions(functions: str | Sequence[str]) -> list[str]:
    items = [functions] if isinstance(functions, str) else functions
    if not isinstance(items, Sequence) or not all(isinstance(i, str) for i in items):
        raise TypeError(f"`functions` must be a list of names; got {functions!r}.")
    if not items:
        raise ValueError("`functions` must name at least one handler; got an empty list.")
    for item in items:
        if not _NAME.fullmatch(item):
            raise ValueError(f"`functions` entries must be C identifiers; got {item!r}.")
    return list(dict.fromkeys(items))


def _discovered(library: Path, texts: Sequence[str]) -> list[str]:
    """The handlers of ``functions=None``: what the built library exports with C linkage.

    In the order the sources first name them (handlers stamped out by a macro are
    named where the macro is used; a name pasted together comes last). Where the
    library is not an ELF file (macOS), the ``XLA_FFI_DEFINE_HANDLER_SYMBOL`` lines
    of the sources are read instead.
    """
    found = exported_c_functions(library)
    if found is None:
        found = [m.group(1) for t in texts for m in _HANDLER.finditer(_COMMENT.sub("", t))]
    if not found:
        raise ValueError(
            f"No handler found in the library {library}: it exports no function with C "
            "linkage. Define handlers with XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl, "
            "binding), or pass `functions`."
        )
    text = "\n".join(_COMMENT.sub("", t) for t in texts)

    def first_use(name: str) -> int:
        at = re.search(rf"\b{re.escape(name)}\b", text)
        return at.start() if at else len(text)

    return sorted(dict.fromkeys(found), key=first_use)
