"""Decoding a pickle's instructions (opcode and argument) without executing them, for
`._pickle_scan`.

``pickletools.genops`` is stricter than the readers that run the file: it reads an INT or
LONG in base 10 where they read ``int(text, 0)`` (``I0x10``), a STRING as ASCII where torch's
loader decodes UTF-8, and it requires a newline where CPython's pure-Python reader does not.
A stream it rejected was filed as "not a pickle" while torch's full loader ran its globals.
Here every argument is read at least as permissively as both of CPython's readers (the
pure-Python one in the standard library and the C one that torch's loader uses): a stream either of
them accepts, this accepts. Where it fails, the error
says whether the real unpicklers certainly fail at the same point too (`PickleSyntaxError.
certain`): only such a failure on the very first instruction lets a file be called "not a
pickle"."""

from __future__ import annotations

import codecs
import re
import struct
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Protocol

MAX_LINE = 1 << 20  # a text argument longer than this is not decoded (the scan is flagged)
# Byte strings above this are skipped, not held: nothing in a checkpoint's structure needs
# their contents, and a 1 GB BINBYTES would otherwise be read into memory.
MAX_HELD_BYTES = 1 << 20
MAX_HELD_TEXT = 16 << 20
HIGHEST_PROTOCOL = 5


class Readable(Protocol):
    """What the decoder reads from: a binary file, or a view of one."""

    def read(self, n: int = -1, /) -> bytes: ...

    def readline(self, limit: int = -1, /) -> bytes: ...

    def tell(self) -> int: ...


class PickleSyntaxError(ValueError):
    """An instruction that could not be decoded. ``certain``: both of CPython's unpicklers
    fail on it too (an unknown opcode, a truncated argument, text no parser accepts), as
    opposed to a limit of this reader (a line over `MAX_LINE`)."""

    def __init__(self, message: str, certain: bool = True) -> None:
        super().__init__(message)
        self.certain = certain


class Blob:
    """Stands for a byte string or text too large to hold (its length only)."""

    def __init__(self, kind: str, size: int) -> None:
        self.kind, self.size = kind, size

    def __repr__(self) -> str:
        return f"<{self.size}-byte {self.kind}>"


def _read(f: Readable, n: int) -> bytes:
    data = f.read(n)
    if len(data) < n:
        raise PickleSyntaxError("pickle data was truncated")
    return data


def _skip(f: Readable, n: int) -> None:
    """Read past ``n`` bytes in bounded pieces (never holding them)."""
    while n > 0:
        piece = f.read(min(n, 1 << 20))
        if not piece:
            raise PickleSyntaxError("pickle data was truncated")
        n -= len(piece)


def _line(f: Readable) -> bytes:
    """One text argument as the unpicklers read it: up to and including its newline. At the
    end of the stream a line without one is returned as it is (the pure-Python reader then
    drops its last character; the C reader refuses it)."""
    data = f.readline(MAX_LINE + 1)
    if len(data) > MAX_LINE and not data.endswith(b"\n"):
        raise PickleSyntaxError(f"a text argument over {MAX_LINE} bytes", certain=False)
    if not data:
        raise PickleSyntaxError("pickle data was truncated")
    return data


def _bodies(line: bytes) -> list[bytes]:
    """The argument's text as each reader sees it: the pure-Python one drops the last
    character; the C one reads up to the newline, as a C string (to its first NUL)."""
    out = [line[:-1]]
    if line.endswith(b"\n"):
        out.append(line[:-1].split(b"\0", 1)[0])
    return out


# strtol(s, &end, 0) as the C unpickler's INT uses it: whitespace, a sign, then hex (0x),
# octal (a leading 0) or decimal digits, ending at the newline or a NUL.
_STRTOL = re.compile(rb"[ \t\n\v\f\r]*([+-]?)(0[xX]([0-9a-fA-F]+)|0([0-7]*)|([1-9][0-9]*))"
                     rb"(?=[\n\0])")
# strtod as PyOS_string_to_double reads a FLOAT (no whitespace), ending at newline or NUL.
_STRTOD = re.compile(rb"[+-]?(inf(inity)?|nan|(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?)(?=[\n\0])",
                     re.IGNORECASE)


def _int_text(line: bytes, base: int, long: bool = False) -> int:
    """An INT, LONG, GET or PUT argument, accepted if either unpickler accepts it."""
    candidates = [line] if not long else []  # (the pure-Python reader's INT: int(line, 0))
    for body in _bodies(line):
        candidates.append(body[:-1] if long and body.endswith(b"L") else body)
    for text in candidates:
        try:
            return int(text, base)
        except ValueError:
            pass
    if base == 0 and not long:
        m = _STRTOL.match(line)
        if m:
            sign = -1 if m.group(1) == b"-" else 1
            if m.group(3) is not None:
                return sign * int(m.group(3), 16)
            if m.group(5) is not None:
                return sign * int(m.group(5))
            return sign * int(m.group(4) or b"0", 8)
    raise PickleSyntaxError(f"not an integer: {line[:40]!r}")


def _int_nl(f: Readable) -> int | bool:
    line = _line(f)
    if line in (b"00\n", b"01\n"):  # protocol 0's False and True
        return line == b"01\n"
    return _int_text(line, 0)


def _long_nl(f: Readable) -> int:
    return _int_text(_line(f), 0, long=True)


def _decimal_nl(f: Readable) -> int:
    return _int_text(_line(f), 10, long=False)


def _float_nl(f: Readable) -> float:
    line = _line(f)
    for body in _bodies(line):
        try:
            return float(body)
        except ValueError:
            pass
    m = _STRTOD.match(line)
    if m:
        return float(m.group(0))
    raise PickleSyntaxError(f"not a float: {line[:40]!r}")


def _text(data: bytes) -> str:
    """A protocol 0-2 byte string as text: the loader picks the encoding (torch.load UTF-8,
    pickle ASCII, some latin-1), so any bytes are accepted here."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def _string_nl(f: Readable) -> str:
    line = _line(f)
    for body in _bodies(line):
        if len(body) >= 2 and body[:1] == body[-1:] and body[:1] in (b"'", b'"'):
            try:
                with warnings.catch_warnings():  # (an unknown escape only warns)
                    warnings.simplefilter("ignore")
                    return _text(codecs.escape_decode(body[1:-1])[0])
            except ValueError:
                pass
    raise PickleSyntaxError(f"the STRING argument is not a quoted string: {line[:40]!r}")


def _unicode_nl(f: Readable) -> str:
    line = _line(f)
    for body in _bodies(line):
        try:
            return body.decode("raw-unicode-escape")
        except UnicodeDecodeError:
            pass
    raise PickleSyntaxError(f"the UNICODE argument does not decode: {line[:40]!r}")


def _names_nl(f: Readable) -> str:
    """GLOBAL and INST: module and name, each a line of UTF-8 (as "module name")."""
    parts = []
    for _ in range(2):
        line = _line(f)
        for body in _bodies(line):
            try:
                parts.append(body.decode("utf-8"))
                break
            except UnicodeDecodeError:
                pass
        else:
            raise PickleSyntaxError(f"a global's name is not UTF-8: {line[:40]!r}")
    return " ".join(parts)


def _ascii_nl(f: Readable) -> str:
    line = _line(f)
    for body in _bodies(line):
        if body.isascii():
            return body.decode("ascii")
    raise PickleSyntaxError(f"a persistent id is not ASCII: {line[:40]!r}")


def _unsigned(n: int) -> Callable[[Readable], int]:
    return lambda f: int.from_bytes(_read(f, n), "little")


def _signed4(f: Readable) -> int:
    return int.from_bytes(_read(f, 4), "little", signed=True)


def _length(f: Readable, n: int, signed: bool = False) -> int:
    size = int.from_bytes(_read(f, n), "little", signed=signed)
    if size < 0 or size > sys.maxsize:
        raise PickleSyntaxError(f"a length of {size} bytes")
    return size


def _long_bin(n: int) -> Callable[[Readable], int]:
    def read(f: Readable) -> int:
        size = _length(f, n, signed=n == 4)
        if size > MAX_LINE:  # (a 2**31-byte integer: the real unpickler would build it)
            _skip(f, size)
            raise PickleSyntaxError(f"a {size}-byte integer", certain=False)
        return int.from_bytes(_read(f, size), "little", signed=True)
    return read


def _bytes(n: int, kind: str, signed: bool = False) -> Callable[[Readable], Any]:
    def read(f: Readable) -> Any:
        size = _length(f, n, signed)
        limit = MAX_HELD_TEXT if kind in ("str", "text") else MAX_HELD_BYTES
        if size > limit:
            _skip(f, size)
            return Blob(kind, size)
        data = _read(f, size)
        if kind == "str":
            return _text(data)
        if kind == "text":
            try:
                return data.decode("utf-8", "surrogatepass")
            except UnicodeDecodeError:
                raise PickleSyntaxError("a BINUNICODE argument that is not UTF-8") from None
        return data if kind == "bytes" else bytearray(data)
    return read


def _proto(f: Readable) -> int:
    proto = _read(f, 1)[0]
    if proto > HIGHEST_PROTOCOL:
        raise PickleSyntaxError(f"unsupported pickle protocol: {proto}")
    return proto


def _frame(f: Readable) -> int:
    return _length(f, 8)  # (a hint only: frames are not enforced, which accepts more)


_Reader = Callable[[Readable], Any] | None
# opcode byte -> (pickletools' name, argument reader); the standard library's table.
OPCODES: dict[int, tuple[str, _Reader]] = {ord(k): v for k, v in {
    "(": ("MARK", None), ".": ("STOP", None), "0": ("POP", None), "1": ("POP_MARK", None),
    "2": ("DUP", None), "F": ("FLOAT", _float_nl), "I": ("INT", _int_nl),
    "J": ("BININT", _signed4), "K": ("BININT1", _unsigned(1)), "L": ("LONG", _long_nl),
    "M": ("BININT2", _unsigned(2)), "N": ("NONE", None), "P": ("PERSID", _ascii_nl),
    "Q": ("BINPERSID", None), "R": ("REDUCE", None), "S": ("STRING", _string_nl),
    "T": ("BINSTRING", _bytes(4, "str", signed=True)),
    "U": ("SHORT_BINSTRING", _bytes(1, "str")), "V": ("UNICODE", _unicode_nl),
    "X": ("BINUNICODE", _bytes(4, "text")), "a": ("APPEND", None), "b": ("BUILD", None),
    "c": ("GLOBAL", _names_nl), "d": ("DICT", None), "}": ("EMPTY_DICT", None),
    "e": ("APPENDS", None), "g": ("GET", _decimal_nl), "h": ("BINGET", _unsigned(1)),
    "i": ("INST", _names_nl), "j": ("LONG_BINGET", _unsigned(4)), "l": ("LIST", None),
    "]": ("EMPTY_LIST", None), "o": ("OBJ", None), "p": ("PUT", _decimal_nl),
    "q": ("BINPUT", _unsigned(1)), "r": ("LONG_BINPUT", _unsigned(4)),
    "s": ("SETITEM", None), "t": ("TUPLE", None), ")": ("EMPTY_TUPLE", None),
    "u": ("SETITEMS", None), "G": ("BINFLOAT", lambda f: struct.unpack(">d", _read(f, 8))[0]),
    "\x80": ("PROTO", _proto), "\x81": ("NEWOBJ", None), "\x82": ("EXT1", _unsigned(1)),
    "\x83": ("EXT2", _unsigned(2)), "\x84": ("EXT4", _signed4), "\x85": ("TUPLE1", None),
    "\x86": ("TUPLE2", None), "\x87": ("TUPLE3", None), "\x88": ("NEWTRUE", None),
    "\x89": ("NEWFALSE", None), "\x8a": ("LONG1", _long_bin(1)),
    "\x8b": ("LONG4", _long_bin(4)), "B": ("BINBYTES", _bytes(4, "bytes")),
    "C": ("SHORT_BINBYTES", _bytes(1, "bytes")), "\x8c": ("SHORT_BINUNICODE", _bytes(1, "text")),
    "\x8d": ("BINUNICODE8", _bytes(8, "text")), "\x8e": ("BINBYTES8", _bytes(8, "bytes")),
    "\x8f": ("EMPTY_SET", None), "\x90": ("ADDITEMS", None), "\x91": ("FROZENSET", None),
    "\x92": ("NEWOBJ_EX", None), "\x93": ("STACK_GLOBAL", None), "\x94": ("MEMOIZE", None),
    "\x95": ("FRAME", _frame), "\x96": ("BYTEARRAY8", _bytes(8, "bytearray")),
    "\x97": ("NEXT_BUFFER", None), "\x98": ("READONLY_BUFFER", None)}.items()}


def read_ops(f: Readable) -> Iterator[tuple[str, Any, int]]:
    """Each instruction of one pickle (name, decoded argument, byte position), up to and
    including its STOP; `PickleSyntaxError` where one cannot be decoded."""
    while True:
        pos = f.tell()
        code = f.read(1)
        if not code:
            raise PickleSyntaxError("pickle data was truncated (no STOP)")
        entry = OPCODES.get(code[0])
        if entry is None:
            raise PickleSyntaxError(f"invalid load key {code!r} at byte {pos}")
        name, reader = entry
        try:
            arg = reader(f) if reader is not None else None
        except PickleSyntaxError as e:
            raise PickleSyntaxError(f"{name} at byte {pos}: {e}", e.certain) from None
        except (ValueError, OverflowError, MemoryError) as e:
            raise PickleSyntaxError(f"{name} at byte {pos}: {e!s:.100}", certain=False) \
                from None
        yield name, arg, pos
        if name == "STOP":
            return


# -- the work budget --------------------------------------------------------------------------


class WorkExceeded(Exception):
    """The scan's work budget is spent (`MAX_WORK`)."""


class _Work:
    """What the interpreter has copied or walked, beyond one step per instruction: a REDUCE
    of OrderedDict over one memoized 100,000-pair list, repeated 100,000 times, is 100,000
    instructions and 10**10 dict insertions. Charged before the work is done."""

    def __init__(self) -> None:
        self.done = 0

    def charge(self, n: int) -> None:
        self.done += n
        if self.done > MAX_WORK:
            raise WorkExceeded(f"more than {MAX_WORK:,} elements copied or hashed (a small "
                               "pickle that makes the same large container over and over)")

    def copy(self, value: Any) -> tuple[Any, ...] | None:
        """``tuple(value)`` for a list or tuple (charged), else None."""
        if type(value) is tuple:
            return value  # (immutable: shared, not copied)
        if type(value) is not list:
            return None
        self.charge(len(value))
        return tuple(value)


# Elements copied or hashed per pickle beyond their instructions: a torch.save copies almost
# none (its shapes and strides are tuples, shared); about a second of work at most.
MAX_WORK = 4_000_000
