"""``python -m jaxext.cpp_extension build NAME SOURCE...``: build an extension ahead of time."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._aot import build
from ._errors import ExtensionError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxext.cpp_extension",
        description="Build C++ XLA FFI extensions ahead of time, for jaxext.cpp_extension.load.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    cmd = commands.add_parser(
        "build",
        help="compile NAME from SOURCE files into a directory (default: the first source's)",
        description="Writes NAME.<hash>.so and NAME.json; load(NAME, SOURCES, ...) with the same "
        "sources, headers and flags then uses it without a compiler.",
    )
    cmd.add_argument("name", help="the extension's name, as given to load")
    cmd.add_argument("sources", nargs="+", help="source files (.cc, .cpp, .cxx, .cu)")
    cmd.add_argument("-o", "--output-dir", help="where to write (default: the first source's dir)")
    cmd.add_argument("--cflag", action="append", default=[], help="extra compiler flag (repeat)")
    cmd.add_argument("--ldflag", action="append", default=[], help="extra linker flag (repeat)")
    cmd.add_argument(
        "-I", "--include", action="append", default=[], help="extra include directory (repeat)"
    )
    cmd.add_argument("--platform", choices=["cpu", "CUDA"], help="default: from the sources")
    cmd.add_argument("-v", "--verbose", action="store_true", help="print the compiler command")
    args = parser.parse_args(argv)
    try:
        library = build(
            args.name,
            args.sources,
            args.output_dir,
            extra_cflags=args.cflag,
            extra_ldflags=args.ldflag,
            extra_include_paths=args.include,
            platform=args.platform,
            verbose=args.verbose,
        )
    except (ExtensionError, ValueError, TypeError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(library)
    return 0


if __name__ == "__main__":
    sys.exit(main())
