"""`load` and `load_inline`: compile C++ XLA FFI handlers at first use and register them."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import jaxlib

from ._cache import build_once, cache_key, cache_root
from ._compiler import compile_command, compile_library, find_compiler
from ._module import Extension
from ._partition import check_rule
from ._registry import register_handlers

__all__ = ["load", "load_inline"]

PathLike = str | os.PathLike
_CPP_SUFFIXES = (".cc", ".cpp", ".cxx", ".c++", ".C")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HANDLER = re.compile(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\s*\(\s*([A-Za-z_][A-Za-z0-9_]*)")
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
# What load_inline puts before the sources (through -include, so their line numbers stay).
_PRELUDE = '#include "xla/ffi/api/ffi.h"\nnamespace ffi = xla::ffi;\n'


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
) -> Extension:
    """Compiles C++ (or CUDA) source files of XLA FFI handlers and registers them with JAX.

    The sources are compiled with ``$CXX`` (else ``c++``; ``nvcc`` when a source is
    ``.cu``) as ``-std=c++17 -O3 -fPIC -shared`` against the XLA FFI headers that
    ship with jaxlib (``jax.ffi.include_dir()``), once: the library is cached under
    a hash of the sources, flags, jaxlib version and compiler, and later calls, in
    this process or another, load it from there. Headers the sources include are
    not part of that hash: pass them as ``sources`` too, or change a flag, to
    rebuild after editing one.

    Args:
        name: the extension's name, a C identifier; FFI targets are registered
            under it, so two extensions may define handlers of the same name.
        sources: source file paths (``.cc``, ``.cpp``, ``.cxx``, or ``.cu``).
        functions: the handler symbols to register, each defined in the sources
            with ``XLA_FFI_DEFINE_HANDLER_SYMBOL``. ``None``: every such
            definition found in the sources.
        extra_cflags: more compiler flags, e.g. ``["-march=native"]``.
        extra_ldflags: more linker flags, e.g. ``["-lm"]``.
        extra_include_paths: more ``-I`` directories.
        build_directory: where builds are cached. Default: ``$JAXEXT_EXTENSIONS_DIR``,
            else ``~/.cache/jaxext/cpp_extensions`` (under ``$XDG_CACHE_HOME`` if set).
        platform: ``"cpu"`` or ``"CUDA"``, the platform the handlers are registered
            for. Default: ``"CUDA"`` if a source is ``.cu``, else ``"cpu"``.
        partition: ``{handler: rule}``, how each handler splits over a device mesh
            (its ``FfiFunction.partition``):
            ``"batch"`` (the leading dimension of the first operand and of every
            result), an einsum-like rule such as ``"b i, o i -> b o"``, or ``None``
            (the default for handlers not named: sharded operands are gathered and
            every device runs the whole kernel). See ``partition`` in
            ``FfiFunction.__call__``,
            which can also override it per call.
        verbose: print the compiler command and output.

    Returns:
        An :class:`jaxext.cpp_extension.Extension` whose attributes are the handlers, each called as
        ``ext.handler(*arrays, result_shape_dtypes=..., vmap_method=..., **attributes)``.

    Raises:
        TypeError: if an argument has the wrong type (e.g. ``sources`` is not a list of
            paths).
        ValueError: if ``name``, ``sources``, ``functions`` or ``platform`` is malformed,
            or no handler is found in the sources.
        FileNotFoundError: if a source file does not exist.
        CompilerNotFoundError: if no compiler is installed (the message says what to
            install).
        CompileError: if compilation fails (the message lists the compiler's
            ``file:line`` errors; ``.output`` holds everything it printed).
        MissingHandlerError: if a symbol in ``functions`` is not in the library.

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
    _check_name(name)
    paths = _source_paths(sources)
    texts = [path.read_text() for path in paths]
    return _load(
        name,
        paths,
        texts,
        {},
        functions,
        extra_cflags=extra_cflags,
        extra_ldflags=extra_ldflags,
        extra_include_paths=extra_include_paths,
        build_directory=build_directory,
        platform=platform,
        partition=partition,
        verbose=verbose,
    )


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
    ``<name>.cu``), written into the build's cache directory, and compiled with
    ``xla/ffi/api/ffi.h`` already included and ``namespace ffi = xla::ffi;``
    declared, so the sources can start with the handlers. The compiler's line
    numbers are those of the joined strings.

    Args:
        name: the extension's name (see :func:`jaxext.cpp_extension.load`).
        cpp_sources: C++ source text, or a list of texts joined with newlines.
        cuda_sources: CUDA source text(s); when given, everything is compiled with
            ``nvcc`` and the handlers register for ``"CUDA"`` by default.
        functions: the handler symbols to register; ``None``: all that the
            sources define with ``XLA_FFI_DEFINE_HANDLER_SYMBOL``.
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
    _check_name(name)
    cpp = _joined(cpp_sources, "cpp_sources")
    files = {f"{name}.cc": cpp}
    if cuda_sources is not None:
        files[f"{name}.cu"] = _joined(cuda_sources, "cuda_sources")
    return _load(
        name,
        list(files),  # written into the build directory, see _load
        list(files.values()),
        files,
        functions,
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
    sources: Sequence[Path | str],
    texts: Sequence[str],
    inline_files: dict[str, str],
    functions: str | Sequence[str] | None,
    *,
    extra_cflags: Sequence[str],
    extra_ldflags: Sequence[str],
    extra_include_paths: Sequence[PathLike],
    build_directory: PathLike | None,
    platform: str | None,
    partition: Mapping[str, str | None] | None,
    verbose: bool,
) -> Extension:
    """Builds (once) and registers; ``inline_files`` are written into the build directory."""
    extra_cflags = _strings(extra_cflags, "extra_cflags")
    extra_ldflags = _strings(extra_ldflags, "extra_ldflags")
    includes = [Path(p).expanduser().resolve() for p in _paths(extra_include_paths)]
    cuda = any(str(s).endswith(".cu") for s in sources)
    platform = _platform(platform, cuda)
    symbols = _functions(functions, texts)
    rules = _partition_rules(partition, symbols)
    compiler = find_compiler(cuda)
    key = cache_key(
        [
            name,
            platform,
            compiler.identity,
            jaxlib.__version__,
            jax.ffi.include_dir(),
            repr(extra_cflags),
            repr(extra_ldflags),
            repr([str(p) for p in includes]),
            repr(sorted(inline_files)),
            *(part for s, t in zip(sources, texts, strict=True) for part in (Path(s).name, t)),
        ]
    )
    directory = cache_root(build_directory) / name / key

    def build(output: Path) -> None:
        prelude = None
        for file_name, text in inline_files.items():
            (directory / file_name).write_text(text)
        if inline_files:
            prelude = directory / "jaxext_prelude.h"
            prelude.write_text(_PRELUDE)
        paths = [directory / s if inline_files else Path(s) for s in sources]
        command = compile_command(
            compiler,
            paths,
            output,
            include_dirs=[Path(jax.ffi.include_dir()), *includes],
            extra_cflags=extra_cflags,
            extra_ldflags=extra_ldflags,
            preinclude=prelude,
        )
        compile_library(name, command, directory / "build.log", verbose)

    library, built = build_once(directory, f"{name}.so", build)
    if verbose and not built:
        print(f"[jaxext.cpp_extension] {name!r}: using the cached build {library}", flush=True)
    targets = register_handlers(name, library, f"{name}_{key}", symbols, platform)
    return Extension(name, library, built, platform, targets, rules)


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


def _check_name(name: object) -> None:
    if not isinstance(name, str):
        raise TypeError(f"`name` must be a string; got {type(name).__name__}.")
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"`name` must be a C identifier (letters, digits, underscores); got {name!r}."
        )


def _source_paths(sources: object) -> list[Path]:
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


def _functions(functions: str | Sequence[str] | None, texts: Sequence[str]) -> list[str]:
    if functions is None:
        found = [m.group(1) for t in texts for m in _HANDLER.finditer(_COMMENT.sub("", t))]
        if not found:
            raise ValueError(
                "No handler found in the sources: define one with "
                "XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl, binding), or pass `functions`."
            )
        return list(dict.fromkeys(found))
    items = [functions] if isinstance(functions, str) else functions
    if not isinstance(items, Sequence) or not all(isinstance(i, str) for i in items):
        raise TypeError(f"`functions` must be a list of names; got {functions!r}.")
    if not items:
        raise ValueError("`functions` must name at least one handler; got an empty list.")
    for item in items:
        if not _NAME.fullmatch(item):
            raise ValueError(f"`functions` entries must be C identifiers; got {item!r}.")
    return list(dict.fromkeys(items))
