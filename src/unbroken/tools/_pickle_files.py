"""Files that hold pickles, read the way ``torch.load`` would open them (a zip archive, a
legacy torch.save file, a plain pickle), each pickle interpreted by `._pickle_scan` and never
run. (Moved out of ``_pickle_scan.py``.)"""

from __future__ import annotations

import io
import os
import stat
import tarfile
import zipfile
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import IO, Any, BinaryIO

from ..errors import CorruptCheckpoint
from ._pickle_scan import _STORAGE_DTYPE, Global, PickleScan, scan_pickle


def open_regular(path: str) -> BinaryIO:
    """Open a file of a foreign checkpoint for reading, refusing anything but a regular file
    (a FIFO would block ``open`` forever, a device never end) with a `CorruptCheckpoint`
    naming it. The path is resolved first and the result opened with ``O_NOFOLLOW |
    O_NONBLOCK`` and checked with ``fstat`` (the same checks as the store's reads): a link
    the user's folder holds is followed (a Hugging Face cache snapshot is all links), but
    what is opened is the regular file it resolves to, or nothing."""
    real = os.path.realpath(path)
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CorruptCheckpoint(f"{path}: not a regular file (mode {oct(st.st_mode)}: a FIFO, "
                                "socket, device or folder); only regular files are read")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


class _Capped:
    """A file seen by the instruction decoder with reads capped at what the file holds: a
    crafted length field must not make it allocate more than the file's size."""

    def __init__(self, f: IO[bytes], size: int) -> None:
        self.f, self.size = f, size

    def read(self, n: int = -1) -> bytes:
        left = max(0, self.size - self.f.tell())
        return self.f.read(left if n < 0 or n > left else n)

    def tell(self) -> int:
        return self.f.tell()

    def readline(self, limit: int = -1, /) -> bytes:
        if limit < 0:
            limit = 1 << 20
        return self.f.readline(max(0, min(limit, self.size - self.f.tell())))

    def skip(self, n: int) -> None:
        self.f.seek(min(self.f.tell() + n, self.size))


# -- containers ---------------------------------------------------------------------------------

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER
MAX_PICKLE_BYTES = 1 << 30  # a data.pkl holds structure, not tensor bytes
_HELD_PICKLE_BYTES = 64 << 20  # an archive's pickle up to this size is read whole, then scanned


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
        return list(dict.fromkeys(g for _name, s in self.scans for g in s.globals))

    @property
    def not_pickle(self) -> bool:
        """Not a pickle at all: its first instruction is one no unpickler runs (a text file),
        so nothing in it could be imported. A stream that starts like a pickle and then
        breaks is a pickle (unpickling runs what comes before the break)."""
        return self.format == "plain pickle" and self.scans[0][1].not_pickle

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
    with open_regular(path) as f:
        return f.read(4) == _ZIP_MAGIC  # (a truncated one too: its reading says why)


_ZIP_MAGIC = b"PK\x03\x04"  # what torch.serialization._is_zipfile checks
_LEGACY = ("protocol", "sys_info", "object", "storage_keys")
MAX_ZIP_PICKLES = 10_000  # .pkl entries scanned per archive
MAX_ZIP_PICKLE_BYTES = 2 << 30  # their bytes, decompressed, all together
MAX_TAR_MEMBERS = 10_000
_ELEMENT_SIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8,
                 "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8,
                 "complex128": 16}


def read_pickle_file(path: str) -> PickleFile:
    """Scan a file the way ``torch.load`` would open it: a zip archive (torch.save since 1.6,
    Lightning .ckpt, Trainer .pt/.bin), else a legacy tar file (torch.save before 0.4: its
    ``storages``, ``tensors`` and ``pickle`` members), else a legacy torch.save file (magic
    number, protocol, system info, object, storage keys), else a plain pickle file."""
    with open_regular(path) as raw:
        size = os.fstat(raw.fileno()).st_size
        if raw.read(4) == _ZIP_MAGIC:
            raw.seek(0)
            return _read_zip(raw)
        raw.seek(0)
        tar = _read_tar(raw)
        if tar is not None:
            return tar
        raw.seek(0)
        return _read_stream(_Capped(raw, size))


def read_pickle_bytes(blob: bytes) -> PickleFile:
    """Scan what ``torch.load`` reads from bytes in memory (a DCP bytes entry): a torch.save
    archive, else a legacy or plain pickle (torch tries the tar format only on real files)."""
    if blob[:4] == _ZIP_MAGIC:
        return _read_zip(io.BytesIO(blob))
    return _read_stream(_Capped(io.BytesIO(blob), len(blob)))


def _read_stream(f: _Capped) -> PickleFile:
    first = scan_pickle(f)
    if first.root != LEGACY_MAGIC or first.error:
        return PickleFile("plain pickle", [("object", first)])
    out = PickleFile("torch.save (legacy format)", [("magic", first)])
    for name in _LEGACY:
        scan = scan_pickle(f)
        out.scans.append((name, scan))
        if scan.error:
            break
    return out


def _read_tar(raw: BinaryIO) -> PickleFile | None:
    """The legacy tar format, or None when ``raw`` is not a tar file (what torch's
    ``tarfile.open`` decides). torch reads this format only with its full loader (never
    the weights-only one), which runs whatever each member names: it is always flagged.
    Every pickle of the ``storages``, ``tensors`` and ``pickle`` members is scanned, as far
    as their records can be followed."""
    try:
        tar = tarfile.open(fileobj=raw, mode="r:")
    except tarfile.TarError:
        return None  # (torch then reads the file as a pickle)
    except (OSError, EOFError, ValueError, UnicodeError) as e:
        return PickleFile("torch.save (legacy tar format)", [(
            "tar", PickleScan(error=f"a tar file tarfile cannot read ({e!s:.200})"))])
    out = PickleFile("torch.save (legacy tar format)")
    out.scans.append(("tar", PickleScan(error=(
        "the legacy tar format: torch reads it only with its full loader (not the "
        "weights-only one), which runs whatever its members name"))))
    with tar:
        try:
            for count, member in enumerate(tar):
                if count >= MAX_TAR_MEMBERS:
                    out.notes.append(f"over {MAX_TAR_MEMBERS} members: the rest not read")
                    break
                if member.name in ("storages", "tensors", "pickle") and member.isfile():
                    stream = tar.extractfile(member)
                    if stream is not None:
                        out.scans += _tar_member(member.name, _Capped(stream, member.size))
        except (tarfile.TarError, OSError, EOFError, ValueError, UnicodeError) as e:
            out.scans.append(("tar", PickleScan(error=f"unreadable tar member ({e!s:.200})")))
    return out


def _tar_member(name: str, f: _Capped) -> list[tuple[str, PickleScan]]:
    """The pickles of one legacy tar member: ``pickle`` is one; ``storages`` a count, then
    per storage its (key, location, storage class) and raw bytes, then the views;
    ``tensors`` a count, then per tensor its (key, storage, class) and raw sizes."""
    count = scan_pickle(f)
    out = [(name, count)]
    n = count.root
    if name == "pickle" or count.error or type(n) is not int or not 0 <= n <= 1_000_000:
        return out
    for i in range(n):
        scan = scan_pickle(f)
        out.append((f"{name}[{i}]", scan))
        args = scan.root
        if scan.error or not isinstance(args, tuple) or len(args) != 3:
            return out
        if name == "storages":
            cls = args[2]
            dtype = _STORAGE_DTYPE.get(cls.name.removesuffix("Storage")) if isinstance(
                cls, Global) else None
            head = f.read(8)
            if dtype is None or len(head) < 8:
                out[-1][1].error = "a storage record that cannot be followed"
                return out
            f.skip(int.from_bytes(head, "little", signed=True) * _ELEMENT_SIZE[dtype])
        else:
            ndim = int.from_bytes(f.read(4), "little", signed=True)
            f.skip(4 + 16 * max(0, ndim) + 8)
    if name == "storages":
        out.append(("storages (views)", scan_pickle(f)))
    return out


def _read_zip(source: BinaryIO) -> PickleFile:
    out = PickleFile("torch.save (zip)")
    try:
        with zipfile.ZipFile(source) as z:
            names = z.namelist()
            pkls = [n for n in names if n.endswith(".pkl")]
            if any(n.split("/")[1:2] == ["code"] for n in names):
                out.format = "TorchScript archive (torch.jit.save)"
                out.notes.append("holds TorchScript code: torch.load hands it to "
                                 "torch.jit.load, which runs it")
            if not pkls:
                out.notes.append("a zip archive without a pickle: not a torch.save file")
            counts = Counter(pkls)
            twice = sorted(n for n, c in counts.items() if c > 1)
            if twice:  # (torch reads one of them, zipfile's name lookup another: scan all)
                out.notes.append(f"holds several entries named {twice[0]!r}: readers "
                                 "disagree on which one is the archive's")
            budget = MAX_ZIP_PICKLE_BYTES
            # (each entry by its own record: a lookup by name sees only the last of a name)
            infos = sorted((i for i in z.infolist() if i.filename.endswith(".pkl")),
                           key=lambda i: (not i.filename.endswith("/data.pkl"), i.filename))
            for index, info in enumerate(infos):
                n = info.filename
                label = "data.pkl" if n.endswith("/data.pkl") and n.count("/") == 1 else n
                if index >= MAX_ZIP_PICKLES:
                    out.scans.append(("archive", PickleScan(error=(
                        f"over {MAX_ZIP_PICKLES} pickles: the rest not scanned"))))
                    break
                if info.file_size > min(MAX_PICKLE_BYTES, budget):
                    scan = PickleScan(error=f"{info.file_size} bytes: too large to scan")
                else:
                    budget -= info.file_size
                    with z.open(info) as member:
                        if info.file_size <= _HELD_PICKLE_BYTES:
                            scan = scan_pickle(io.BytesIO(member.read(info.file_size)))
                        else:  # (read as scanned: a 1 MB archive may inflate to a GiB)
                            scan = scan_pickle(io.BufferedReader(member, 1 << 20))  # type: ignore[type-var]
                if twice and n in twice and not scan.error:
                    scan.error = f"{n!r} appears more than once in the archive"
                out.scans.append((label, scan))
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, ValueError,
            OSError) as e:
        out.scans.append(("archive", PickleScan(error=f"unreadable zip archive: {e}")))
    return out
