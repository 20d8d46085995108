"""The functions a built library exports with C linkage, read from its ELF symbol table.

``XLA_FFI_DEFINE_HANDLER_SYMBOL(name, ...)`` defines ``extern "C" XLA_FFI_Error*
name(XLA_FFI_CallFrame*)``: an exported function whose symbol is its plain name.
Reading the library's dynamic symbol table finds every handler the compiler
actually made, however its name was spelled in the source (a macro that stamps out
handlers, a name pasted together with ``##``), which no scan of the text can.
"""

from __future__ import annotations

import struct
from pathlib import Path

__all__ = ["exported_c_functions"]

_SHT_DYNSYM = 11
_STB_GLOBAL, _STB_WEAK = 1, 2
_STT_FUNC = 2
_STV_DEFAULT, _STV_PROTECTED = 0, 3
_SHN_UNDEF = 0
# What jaxext compiles into every CPU library (jaxext/csrc/jaxext_checking.cc).
_OWN_PREFIX = "jaxext_checking_"


def exported_c_functions(library: Path) -> list[str] | None:
    """The functions ``library`` defines and exports under unmangled names, in table order.

    Leaves out C++ functions (mangled names start with ``_Z``), reserved names (a
    leading underscore: ``_init``, ``_fini``), imported symbols and jaxext's own
    checking functions.

    Returns:
        The names, or ``None`` if ``library`` is not an ELF file (macOS, Windows).

    Raises:
        OSError: if the file cannot be read.
    """
    data = Path(library).read_bytes()
    if data[:4] != b"\x7fELF" or len(data) < 64:
        return None
    wide = {1: False, 2: True}.get(data[4])
    order = {1: "<", 2: ">"}.get(data[5])
    if wide is None or order is None:
        return None
    if wide:
        shoff, shentsize, shnum = (
            _unpack(order + "Q", data, 0x28)[0],
            *_unpack(order + "HH", data, 0x3A),
        )
        section, symbol = order + "IIQQQQIIQQ", order + "IBBHQQ"
    else:
        shoff, shentsize, shnum = (
            _unpack(order + "I", data, 0x20)[0],
            *_unpack(order + "HH", data, 0x2E),
        )
        section, symbol = order + "IIIIIIIIII", order + "IIIBBH"
    sections = [_unpack(section, data, shoff + i * shentsize) for i in range(shnum)]
    names: list[str] = []
    for header in sections:
        if header[1] != _SHT_DYNSYM:
            continue
        offset, size, link, entsize = header[4], header[5], header[6], header[9]
        strings = sections[link]
        str_offset, str_size = strings[4], strings[5]
        table = data[str_offset : str_offset + str_size]
        for start in range(offset, offset + size, entsize or struct.calcsize(symbol)):
            fields = _unpack(symbol, data, start)
            if wide:
                name_at, info, other, shndx = fields[0], fields[1], fields[2], fields[3]
            else:
                name_at, info, other, shndx = fields[0], fields[3], fields[4], fields[5]
            if shndx == _SHN_UNDEF or info & 0xF != _STT_FUNC:
                continue
            if info >> 4 not in (_STB_GLOBAL, _STB_WEAK):
                continue
            if other & 0x3 not in (_STV_DEFAULT, _STV_PROTECTED):
                continue
            end = table.find(b"\0", name_at)
            name = table[name_at : end if end >= 0 else None].decode(errors="replace")
            if name and not name.startswith("_") and not name.startswith(_OWN_PREFIX):
                names.append(name)
    return list(dict.fromkeys(names))


def _unpack(fmt: str, data: bytes, offset: int) -> tuple:
    return struct.unpack_from(fmt, data, offset)
