"""The object-store seam: `ObjectFS`, the operations of `LocalFS` that the store needs, on an
fsspec filesystem (``s3://``, ``gs://``, ``az://``, ``memory://``, ...).

An object store has no rename, no fsync and no hard links; what it has instead:

* an object appears whole or not at all when its upload completes (a multipart upload whose
  process dies is never completed, so a torn object cannot exist);
* a conditional create (``If-None-Match: *`` on S3, ``ifGenerationMatch=0`` on GCS, fsspec's
  ``pipe_file(mode="create")``): of two writers creating one key, exactly one succeeds.
  `ObjectFS.atomic_create` says whether the store gives that guarantee; fsspec's generic
  fallback (check, then write) does not.

Every operation counts for ``$UNBROKEN_KILL_AT_OP`` as `LocalFS` does (``create`` before an
upload starts, ``write`` per chunk gathered, ``fsync`` just before the upload, ``unlink``), so
the crash torture runs against object stores too. Errors of the client library (botocore's
and others) surface as ``OSError`` naming the object, never as the library's own types."""

from __future__ import annotations

import errno
import functools
import re
import ssl
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import xxhash

from ...errors import CorruptCheckpoint
from .killpoints import READ, io_fault_point
from .local import whole_buffer

# Stores whose conditional create is atomic on the server (or, for memory://, in-process).
ATOMIC_CREATE = ("s3", "s3a", "gs", "gcs", "memory")
_RANGE = 16 << 20  # one ranged read
_PARALLEL = 4  # ranged reads in flight at once

T = TypeVar("T")
# (the errno of an OSError a client raises without one, by its type)
_ERRNO = ((PermissionError, errno.EACCES), (FileNotFoundError, errno.ENOENT),
          (FileExistsError, errno.EEXIST), (TimeoutError, errno.ETIMEDOUT),
          (ConnectionResetError, errno.ECONNRESET), (ConnectionRefusedError, errno.ECONNREFUSED),
          (ConnectionAbortedError, errno.ECONNABORTED), (ConnectionError, errno.ENOTCONN))


_REMOTE = getattr(errno, "EREMOTEIO", errno.ECONNABORTED)  # (a machine error: `verifying`)


def _translated(path: str, call: Callable[[], T]) -> T:
    """``call()``, with any error that is not an ``OSError`` (a client library's own) turned
    into one naming ``path``."""
    try:
        return call()
    except CorruptCheckpoint:
        raise
    except OSError as e:
        if e.filename is not None and not _from_server(e):
            raise
        # (s3fs raises a refused credential as a bare PermissionError: which object, and
        # not the client's 18 frames)
        code = (_REMOTE if _from_server(e) or isinstance(e, ssl.SSLError) else e.errno
                or next((n for kind, n in _ERRNO if isinstance(e, kind)), _judged(e)))
        try:
            named = type(e)(code, e.strerror or str(e) or type(e).__name__, path)
        except Exception:  # noqa: BLE001 -- a subclass with its own constructor: as it was
            raise OSError(code, f"{type(e).__name__}: {e}", path) from None
        raise named from None
    except Exception as e:  # the client library's own error types
        raise OSError(_judged(e), f"{type(e).__name__}: {e}", path) from None


# Words of a client library's verdict on the bytes it received (botocore's
# FlexibleChecksumError, google-resumable-media's DataCorruption, azure's "MD5 mismatch").
_ON_CONTENT = ("checksum", "corrupt", "md5", "crc32", "crc64")


def _judged(e: BaseException) -> int:
    """The errno of a client library's error that carries none: EIO (content: judged) for a
    verdict on the bytes received, else a machine error (a connection dropped, a read timed
    out, a TLS session cut: not the object's bytes, which this store's own hashes judge)."""
    said = f"{type(e).__name__} {e}".lower()
    return errno.EIO if any(word in said for word in _ON_CONTENT) else _REMOTE


def _from_server(e: OSError) -> bool:
    """An error s3fs made of a server's answer that says nothing of the object (a 5xx, a
    429, throttling: s3fs maps the codes it does not know to EIO)."""
    response = getattr(e.__cause__, "response", None)
    if not isinstance(response, dict):
        return False
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    code = str((response.get("Error") or {}).get("Code", ""))
    return (isinstance(status, int) and (status >= 500 or status == 429)
            or "throttl" in code.lower() or code in ("RequestLimitExceeded", "SlowDown"))


def _translating(method: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(method)
    def wrapper(self: ObjectFS, path: str, *args: Any, **kwargs: Any) -> T:
        return _translated(path, lambda: method(self, path, *args, **kwargs))
    return wrapper


class ObjectFS:
    """The store's file operations on an fsspec filesystem; paths are full URLs."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self.atomic_create = any(p in ATOMIC_CREATE for p in protocols)
        # S3's PutObject takes If-Match (s3fs passes it through): `replace_file`
        self.conditional_replace = any(p in ("s3", "s3a") for p in protocols)

    def _op(self, kind: str, path: str) -> None:
        io_fault_point(kind, path)

    # -- writing --------------------------------------------------------------------------------

    def write_file(self, path: str, chunks: Iterable[memoryview | bytes]) -> tuple[int, str]:
        """Upload ``path`` (a fresh key), hashing on the way; return (size, xxh3-128 hex).
        The object's bytes are gathered first (one copy of this artifact in memory), then
        sent as one PUT or, when large, as a multipart upload whose parts go up in parallel
        and each confirmed (s3fs aborts the upload if one fails), so the object exists whole
        or not at all. The stored size is then checked against what was sent."""
        h = xxhash.xxh3_128()
        self._op("create", path)
        body = bytearray()
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            self._op("write", path)
            h.update(view)
            body += view
        self._op("fsync", path)
        # Only the store's calls are translated: an error raised while producing the chunks
        # (the state being encoded) is the caller's, not an I/O error.
        _translated(path, lambda: self.fs.pipe_file(path, body))
        stored = _translated(path, lambda: self.fs.info(path)).get("size")
        if stored != len(body):
            raise OSError(errno.EIO, f"the store holds {stored} bytes after an upload of "
                          f"{len(body)}", path)
        return len(body), h.hexdigest()

    @_translating
    def create_file(self, path: str, data: bytes) -> None:
        """Create ``path`` holding ``data`` only if no object of that name exists
        (`FileExistsError` otherwise); see `atomic_create` for how strong that is."""
        self._op("create", path)
        self._op("fsync", path)
        self.fs.pipe_file(path, data, mode="create")

    @_translating
    def replace_file(self, path: str, data: bytes, was: tuple[object, ...]) -> None:
        """Overwrite ``path`` with ``data`` only while it is still the object ``was`` (its
        `ident`), in one whole-object PUT: readers see the old object or the new one, never
        neither. On S3 the condition is the server's (If-Match on the ETag, `OSError` when
        another upload came first); elsewhere it is checked just before the upload, which
        only the run's lease makes safe (as `create_file`'s fallback)."""
        self._op("create", path)
        self._op("fsync", path)
        tag = was[1] if len(was) == 2 else None
        if self.conditional_replace and isinstance(tag, str) and tag.startswith("ETag="):
            self.fs.pipe_file(path, data, IfMatch=tag[len("ETag="):])
            return
        if self.ident(path) != was:
            raise FileExistsError(errno.EEXIST, "replaced by another upload meanwhile", path)
        self.fs.pipe_file(path, data)

    @_translating
    def put_file(self, path: str, data: bytes) -> None:
        """Write ``path`` whole, replacing any object of that name (small records only)."""
        self._op("create", path)
        self.fs.pipe_file(path, data)

    # -- reading --------------------------------------------------------------------------------

    def _size(self, path: str, limit: int) -> int:
        info = self.fs.info(path)
        if info.get("type") != "file":
            raise CorruptCheckpoint(f"{path}: not an object (a {info.get('type')})")
        size = info.get("size")
        if not isinstance(size, int) or size > limit:
            raise CorruptCheckpoint(f"{path}: {size} bytes, over the {limit}-byte limit")
        return size

    def _pieces(self, path: str, size: int) -> Iterator[tuple[int, bytes]]:
        """The object's bytes in order, as (offset, bytes): ranged reads of ``_RANGE`` bytes,
        ``_PARALLEL`` at a time (concurrent on async stores such as s3fs), so that at most
        ``_RANGE * _PARALLEL`` bytes are held beyond what the caller keeps."""
        starts = list(range(0, size, _RANGE))
        for i in range(0, len(starts), _PARALLEL):
            window = starts[i:i + _PARALLEL]
            ends = [min(start + _RANGE, size) for start in window]
            got = self.fs.cat_ranges([path] * len(window), window, ends, on_error="raise")
            for start, end, data in zip(window, ends, got, strict=True):
                if isinstance(data, BaseException):
                    raise data
                if len(data) != end - start:
                    raise CorruptCheckpoint(f"{path}: changed while being read (bytes "
                                            f"{start}-{end} of {size} came back as "
                                            f"{len(data)})")
                yield start, data

    @_translating
    def read_file(self, path: str, limit: int, aligned: bool = False) -> Any:
        """An object of at most ``limit`` bytes: a ``bytearray``, or with ``aligned`` a
        writable memoryview whose first byte is 64-byte aligned (as `LocalFS.read_file`);
        read in parallel ranges (`_pieces`)."""
        self._op(READ, path)
        size = self._size(path, limit)
        view = whole_buffer(size, aligned, path)
        for start, data in self._pieces(path, size):
            view[start:start + len(data)] = data
        return view if aligned else view.obj

    def read_hashed(self, path: str, limit: int, aligned: bool = False) -> tuple[Any, str]:
        """`read_file`'s result and the xxh3-128 of its bytes (as `LocalFS.read_hashed`)."""
        data = self.read_file(path, limit, aligned)
        return data, xxhash.xxh3_128(data).hexdigest()

    def will_read(self, paths: Iterable[str]) -> None:
        """(`LocalFS.will_read`: an object store is read as it is asked.)"""

    def map_file(self, path: str, limit: int) -> memoryview:
        """An object store maps nothing: the object read whole, aligned."""
        return self.read_file(path, limit, aligned=True)  # type: ignore[no-any-return]

    @_translating
    def hash_file(self, path: str, limit: int, drop_cache: bool = False) -> tuple[int, str]:
        """Size and xxh3-128 of an object of at most ``limit`` bytes, hashed while streaming
        parallel ranges (`_pieces`; no copy of the object is held). ``drop_cache`` is
        accepted for `LocalFS`'s signature: every read of an object store comes from it."""
        self._op(READ, path)
        size = self._size(path, limit)
        h = xxhash.xxh3_128()
        for _, data in self._pieces(path, size):
            h.update(data)
        return size, h.hexdigest()

    @_translating
    def listing(self, prefix: str) -> dict[str, dict[str, Any]]:
        """Every object under ``prefix`` (a full URL), by full URL, freshly listed (never
        from a listing cache: a generation committed by another process must show)."""
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(prefix, detail=True)
        except FileNotFoundError:
            return {}
        # A key ending in "/" is a folder marker (the S3 console's "Create folder", Hadoop),
        # not an object of a generation.
        return {self._url(p): info for p, info in found.items()
                if info.get("type") == "file" and not p.endswith("/")}

    @_translating
    def ident(self, path: str) -> tuple[object, ...]:
        """What changes when the object at ``path`` is uploaded again: its size and version
        tag (an incremental save copies an object only while they hold)."""
        self.fs.invalidate_cache(path)
        info = self.fs.info(path)
        return (info.get("size", -1), version_of(info))

    def _url(self, path: str) -> str:
        return str(self.fs.unstrip_protocol(path))

    @_translating
    def exists(self, path: str) -> bool:
        try:
            self.fs.info(path)
        except FileNotFoundError:
            return False
        return True

    # -- deleting -------------------------------------------------------------------------------

    @_translating
    def unlink(self, path: str) -> None:
        self._op("unlink", path)
        self.fs.rm_file(path)

    def rmtree(self, path: str) -> None:
        """Delete every object under the prefix ``path``, one counted operation each."""
        for url in sorted(self.listing(path)):
            try:
                self.unlink(url)
            except FileNotFoundError:
                pass

    @_translating
    def copy(self, src: str, dst: str) -> None:
        """Copy one object (server-side where the store can)."""
        self._op("create", dst)
        self.fs.copy(src, dst)

    # -- what a filesystem has and an object store has not --------------------------------------

    def mkdir(self, path: str) -> None:
        """Prefixes need no creating."""

    def fsync_dir(self, path: str) -> None:
        """A completed upload is durable; there is no folder to sync."""

    def replace(self, src: str, dst: str) -> None:
        """Overwrite ``dst`` with ``src`` (a single object: a small record), then drop
        ``src``. The write of ``dst`` is one whole-object PUT."""
        self.copy(src, dst)
        self.unlink(src)

    def link(self, src: str, dst: str) -> None:
        """No hard links: an incremental save uploads the unchanged file anew."""
        raise OSError(errno.ENOTSUP, "an object store has no hard links", dst)

    def rename(self, src: str, dst: str) -> None:
        raise OSError(errno.ENOTSUP, "an object store has no rename", src)


_CHECKSUM = re.compile(r'(ETag|etag)="?[0-9a-f]{32}(-[0-9]+)?"?|md5Hash=[A-Za-z0-9+/]{22}==')


def is_checksum(tag: object) -> bool:
    """Whether a version tag (`version_of`) is the store's checksum of the object's bytes:
    S3's ETag (the MD5 of an object stored in one part; of one stored in N parts, the MD5 of
    its parts' MD5s, "-N": equal only for the same bytes in the same parts), GCS's md5Hash.
    Two objects whose tags are equal checksums hold the same bytes."""
    return isinstance(tag, str) and _CHECKSUM.fullmatch(tag) is not None


def version_of(info: Mapping[str, Any]) -> str:
    """An object's version tag from its listing entry: ETag, generation or a time."""
    for key in ("ETag", "etag", "generation", "md5Hash", "LastModified", "mtime", "created"):
        if info.get(key) is not None:
            return f"{key}={info[key]}"
    return ""
