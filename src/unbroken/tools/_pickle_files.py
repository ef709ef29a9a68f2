"""Files that hold pickles, read the way ``torch.load`` would open them (a zip archive, a
legacy torch.save file, a plain pickle), each pickle interpreted by `._pickle_scan` and never
run. (Moved out of ``_pickle_scan.py``.)"""

from __future__ import annotations

import io
import os
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from ._pickle_scan import PickleScan, scan_pickle


class _Capped:
    """A file seen by the instruction decoder with reads capped at what the file holds: a
    crafted length field must not make it allocate more than the file's size."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f, self.size = f, size

    def read(self, n: int = -1) -> bytes:
        left = max(0, self.size - self.f.tell())
        return self.f.read(left if n < 0 or n > left else n)

    def tell(self) -> int:
        return self.f.tell()

    def readline(self) -> bytes:
        return self.f.readline(1 << 20)  # GLOBAL names, INT and FLOAT text: short lines


# -- containers ---------------------------------------------------------------------------------

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER
MAX_PICKLE_BYTES = 1 << 30  # a data.pkl holds structure, not tensor bytes


@dataclass
class PickleFile:
    """What a file that holds pickles says: its format, each pickle read (member name and
    scan) and the object the file stands for (the ``torch.load`` result, symbolically)."""
    format: str
    scans: list[tuple[str, PickleScan]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def root(self) -> Any:
        main = [s for name, s in self.scans if name in ("data.pkl", "object")]
        return main[0].root if main else None

    def globals(self) -> list[str]:
        out: list[str] = []
        for _name, s in self.scans:
            out += [g for g in s.globals if g not in out]
        return out

    @property
    def unresolved(self) -> int:
        return sum(s.unresolved for _name, s in self.scans)

    @property
    def errors(self) -> list[str]:
        return [f"{name}: {s.error}" for name, s in self.scans if s.error]


def is_zip(path: str) -> bool:
    """Whether ``torch.load`` reads ``path`` as a zip archive: it begins with a zip entry's
    signature, as torch checks (``zipfile`` finds an archive anywhere in a file: a pickle
    with an archive appended, which torch unpickles, would be judged by the archive). One
    whose end record is broken or missing counts (its reading then says why)."""
    with open(path, "rb") as f:
        return f.read(4) == _ZIP_MAGIC  # (a truncated one too: its reading says why)


_ZIP_MAGIC = b"PK\x03\x04"  # what torch.serialization._is_zipfile checks


def read_pickle_file(path: str) -> PickleFile:
    """Scan a file the way ``torch.load`` would open it: a zip archive (torch.save since 1.6,
    Lightning .ckpt, Trainer .pt/.bin), else a legacy torch.save file (magic number,
    protocol, system info, object, storage keys), else a plain pickle file."""
    if is_zip(path):
        return _read_zip(path)
    with open(path, "rb") as raw:
        f: Any = _Capped(raw, os.fstat(raw.fileno()).st_size)
        first = scan_pickle(f)
        if first.root != LEGACY_MAGIC or first.error:
            return PickleFile("plain pickle", [("object", first)])
        out = PickleFile("torch.save (legacy format)", [("magic", first)])
        for name in ("protocol", "sys_info", "object", "storage_keys"):
            scan = scan_pickle(f)
            out.scans.append((name, scan))
            if scan.error:
                break
    return out


def read_zip_bytes(blob: bytes) -> PickleFile:
    """Scan a torch.save archive held in memory (a DCP bytes entry is one)."""
    return _read_zip(io.BytesIO(blob))


def _read_zip(path: str | BinaryIO) -> PickleFile:
    out = PickleFile("torch.save (zip)")
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            pkls = [n for n in names if n.endswith(".pkl")]
            if any(n.split("/")[1:2] == ["code"] for n in names):
                out.format = "TorchScript archive (torch.jit.save)"
                out.notes.append("holds TorchScript code: torch.load hands it to "
                                 "torch.jit.load, which runs it")
            if not pkls:
                out.notes.append("a zip archive without a pickle: not a torch.save file")
            twice = sorted({n for n in pkls if pkls.count(n) > 1})
            if twice:  # (torch reads one of them, zipfile's name lookup another: scan all)
                out.notes.append(f"holds several entries named {twice[0]!r}: readers "
                                 "disagree on which one is the archive's")
            # (each entry by its own record: a lookup by name sees only the last of a name)
            for info in sorted((i for i in z.infolist() if i.filename.endswith(".pkl")),
                               key=lambda i: (not i.filename.endswith("/data.pkl"),
                                              i.filename)):
                n = info.filename
                label = "data.pkl" if n.endswith("/data.pkl") and n.count("/") == 1 else n
                if info.file_size > MAX_PICKLE_BYTES:
                    scan = PickleScan(error=f"{info.file_size} bytes: too large to scan")
                else:
                    with z.open(info) as member:
                        scan = scan_pickle(io.BytesIO(member.read()))
                if twice and n in twice and not scan.error:
                    scan.error = f"{n!r} appears more than once in the archive"
                out.scans.append((label, scan))
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, ValueError) as e:
        out.scans.append(("archive", PickleScan(error=f"unreadable zip archive: {e}")))
    return out
