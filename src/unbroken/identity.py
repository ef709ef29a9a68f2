"""What a run *is*: fingerprints of config, tokenizer and data, the environment it ran in,
and the rules that decide whether a checkpoint may be continued or warm-started from.

Fingerprints are plain JSON-able dicts so they can live in every manifest; nothing here
touches the checkpoint store.
"""

from __future__ import annotations

import copy
import json
import math
import os
import platform
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from .codec import dumps_json
from .errors import IdentityMismatch, UnbrokenError, UnbrokenWarning

FIELDS = ("config", "tokenizer", "data")
_CHUNK = 8 * 1024 * 1024
# Small enough to sit in every manifest, large enough for any hand-written config; keeping it
# lets a mismatch name the exact key that changed instead of two opaque hashes.
_KEEP_VALUE_BYTES = 16 * 1024
# The rank differs between the processes of one run, so it is recorded but never compared.
_PER_PROCESS_ENV = frozenset({"rank"})
_ABSENT = object()


def _xxh(data: bytes) -> str:
    return xxhash.xxh3_128(data).hexdigest()


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} bytes"
    value = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _jsonable(obj: Any, path: str) -> Any:
    """A plain JSON tree equal to ``obj``, or ``UnbrokenError`` naming the first bad key."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise UnbrokenError(f"{path}: {obj} cannot be fingerprinted (JSON has no NaN/inf)")
        return obj
    if isinstance(obj, Mapping):
        for key in obj:
            if not isinstance(key, str):
                raise UnbrokenError(f"{path}: key {key!r} is a {type(key).__name__}; "
                                    "identity mappings need string keys")
        return {k: _jsonable(v, f"{path}.{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    raise UnbrokenError(f"{path}: a {type(obj).__name__} value cannot be fingerprinted; "
                        "convert it to str, int, float, bool, None, list or dict")


def _mapping_entry(kind: str, mapping: Mapping[str, Any], path: str) -> dict[str, Any]:
    blob = dumps_json(_jsonable(mapping, path))
    # Parsed back so the kept value is plain JSON (enums, tuples normalised), exactly what
    # was hashed and what a manifest will hold.
    value = json.loads(blob)
    entry: dict[str, Any] = {"kind": kind, "hash": _xxh(blob),
                             "summary": f"{kind} with {len(value)} keys"}
    if len(blob) < _KEEP_VALUE_BYTES:
        entry["value"] = value
    return entry


def _vocab_entry(tokenizer: Any, field: str) -> dict[str, Any]:
    # get_vocab() omits merges and normalizers; pass the tokenizer folder to cover those too.
    vocab = tokenizer.get_vocab()
    payload: dict[str, Any] = {"class": type(tokenizer).__name__, "vocab": vocab}
    special = getattr(tokenizer, "all_special_tokens", None)
    if special is not None:
        payload["special_tokens"] = list(special)
    blob = dumps_json(_jsonable(payload, field))
    return {"kind": "vocab", "hash": _xxh(blob),
            "summary": f"{type(tokenizer).__name__} with {len(vocab)} tokens"}


def _hash_file(path: str | os.PathLike[str]) -> tuple[int, str]:
    """(size, xxh3-128 hex) of a file's contents, read in 8 MiB chunks."""
    h = xxhash.xxh3_128()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _hash_dir(root: Path) -> tuple[str, int, int]:
    """(hash, file count, total bytes) of a folder tree: every entry, in sorted order.

    Symlinks are recorded by their target string and never followed, so a link cannot pull
    in files from outside the folder (or loop); HuggingFace cache links name content hashes.
    """
    h = xxhash.xxh3_128()
    files = total = 0
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(root / rel) as it:
            entries = sorted(it, key=lambda e: e.name)
        subdirs = []
        for e in entries:
            name = rel + e.name
            record: list[Any]
            if e.is_symlink():
                record = ["link", name, os.readlink(e.path)]
            elif e.is_dir(follow_symlinks=False):
                record = ["dir", name]
                subdirs.append(name + "/")
            elif e.is_file(follow_symlinks=False):
                size, digest = _hash_file(e.path)
                files += 1
                total += size
                record = ["file", name, size, digest]
            else:  # fifo, socket, device: reading could block, so only its name counts
                record = ["other", name]
            # One JSON line per entry frames names unambiguously (ASCII-escaped, so even
            # undecodable file names hash stably).
            h.update(json.dumps(record).encode("ascii") + b"\n")
        stack.extend(reversed(subdirs))
    return h.hexdigest(), files, total


def _path_entry(field: str, path: Path) -> dict[str, Any]:
    try:
        if path.is_dir():
            digest, files, total = _hash_dir(path)
            return {"kind": "dir", "hash": digest, "files": files, "bytes": total,
                    "summary": f"dir {path.name}/ with {files} files, {_size(total)}"}
        if path.is_file():
            size, digest = _hash_file(path)
            return {"kind": "file", "hash": digest, "size": size,
                    "summary": f"file {path.name}, {_size(size)}"}
    except OSError as e:
        raise UnbrokenError(f"{field} path {path} cannot be read: {e}") from e
    raise UnbrokenError(f"{field} path {path} does not exist (any more) or is not a file or folder")


class Identity:
    """What must stay the same for a run to be continued: config, tokenizer and data.

    ``tokenizer`` and ``data`` may be a ``Path`` (must exist), a ``str`` naming an existing
    file or folder (hashed by content), any other ``str`` (an explicit revision label such
    as a dataset version or commit), or a mapping; ``tokenizer`` may also be an object with
    ``get_vocab()``. Config and mappings are captured now, so later edits to them do not
    change this identity; files are hashed lazily, once, on the first ``fingerprint()``.
    """

    def __init__(self, config: Mapping[str, Any] | None = None,
                 tokenizer: str | os.PathLike[str] | Mapping[str, Any] | object | None = None,
                 data: str | os.PathLike[str] | Mapping[str, Any] | None = None) -> None:
        self._entries: dict[str, dict[str, Any]] = {}
        self._paths: dict[str, Path] = {}
        if config is not None:
            if not isinstance(config, Mapping):
                raise TypeError(f"config must be a mapping, not {type(config).__name__}")
            self._entries["config"] = _mapping_entry("config", config, "config")
        for field, source in (("tokenizer", tokenizer), ("data", data)):
            if source is not None:
                self._add(field, source)
        self._cache: dict[str, Any] | None = None
        # An async save thread and the training loop may both ask; hash a big folder once.
        self._lock = threading.Lock()

    def _add(self, field: str, source: object) -> None:
        if isinstance(source, str) and not source:
            raise ValueError(f"{field} is an empty string; give a path or a revision label")
        if isinstance(source, os.PathLike) or (isinstance(source, str) and os.path.exists(source)):
            path = Path(source).absolute()  # resolved now: the cwd may change before hashing
            if not path.exists():
                raise UnbrokenError(f"{field} path {path} does not exist")
            self._paths[field] = path
        elif isinstance(source, str):
            self._entries[field] = {"kind": "revision", "hash": _xxh(source.encode("utf-8")),
                                    "value": source, "summary": f"revision {source!r}"}
        elif isinstance(source, Mapping):
            self._entries[field] = _mapping_entry("mapping", source, field)
        elif field == "tokenizer" and callable(getattr(source, "get_vocab", None)):
            self._entries[field] = _vocab_entry(source, field)
        else:
            raise TypeError(f"{field} must be a path, a revision string or a mapping"
                            f"{' or a tokenizer with get_vocab()' if field == 'tokenizer' else ''}"
                            f", not {type(source).__name__}")

    def fingerprint(self) -> dict[str, Any]:
        """One ``{"kind", "hash", "summary", ...}`` entry per given field (JSON-able, a copy)."""
        with self._lock:
            if self._cache is None:
                found = dict(self._entries)
                for field, path in self._paths.items():
                    found[field] = _path_entry(field, path)
                self._cache = {f: found[f] for f in FIELDS if f in found}
            return copy.deepcopy(self._cache)

    def __repr__(self) -> str:
        given = [f for f in FIELDS if f in self._entries or f in self._paths]
        return f"Identity({', '.join(given)})"


def environment() -> dict[str, Any]:
    """Software, hardware and numerics settings that decide whether results are bitwise equal.

    Loader knobs such as ``num_workers`` are deliberately absent: the data order does not
    depend on them, so they are not part of identity.
    """
    cuda = torch.cuda.is_available()
    distributed = dist.is_available() and dist.is_initialized()
    return {
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "cuda_device_count": torch.cuda.device_count() if cuda else 0,
        # Names only when CUDA is usable: asking initialises the driver.
        "cuda_devices": ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                         if cuda else []),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        # TF32 changes matmul/conv results bitwise, just like the algorithm choice.
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        # CPU reductions split work by thread: 1 and 2 threads give different bits.
        "num_threads": torch.get_num_threads(),
        "world_size": dist.get_world_size() if distributed else 1,
        "rank": dist.get_rank() if distributed else 0,
    }


def _fmt(value: Any) -> str:
    if value is _ABSENT:
        return "absent"
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= 80 else text[:77] + "..."


def _diffs(a: Any, b: Any, path: str) -> Iterator[tuple[str, Any, Any]]:
    """Every differing leaf of two JSON trees, in sorted key order."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(a.keys() | b.keys()):
            yield from _diffs(a.get(key, _ABSENT), b.get(key, _ABSENT), f"{path}.{key}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _diffs(x, y, f"{path}[{i}]")
    elif type(a) is not type(b) or a != b:  # 1 vs 1.0 vs True hash differently, so differ here
        yield path, a, b


def _side(entry: Any) -> str:
    if not isinstance(entry, Mapping):
        return "nothing" if entry is None else "a malformed entry"
    return f"{entry.get('summary') or entry.get('kind', '?')} (xxh3 {str(entry.get('hash'))[:12]})"


def _describe(field: str, saved: Any, current: Any) -> str:
    old = saved.get("value") if isinstance(saved, Mapping) else None
    new = current.get("value") if isinstance(current, Mapping) else None
    if isinstance(old, dict) and isinstance(new, dict) and saved.get("kind") == current.get("kind"):
        diffs = list(_diffs(old, new, field))
        if diffs:
            path, a, b = diffs[0]
            more = f" (and {len(diffs) - 1} more keys differ)" if len(diffs) > 1 else ""
            return f"{path}: saved {_fmt(a)}, now {_fmt(b)}{more}"
    return f"{field}: saved {_side(saved)}, now {_side(current)}"


def _same(saved: Any, current: Any) -> bool:
    # Kind counts too: a revision label and a file holding the same bytes hash alike.
    return (isinstance(saved, Mapping) and isinstance(current, Mapping)
            and saved.get("hash") is not None
            and (saved.get("kind"), saved.get("hash")) == (current.get("kind"), current.get("hash")))


def check_identity(saved: Mapping[str, Any], current: Mapping[str, Any], *, intent: str,
                   allow: Iterable[str] = (), where: str = "") -> None:
    """Raise ``IdentityMismatch`` listing every field the checkpoint may not be resumed with.

    ``continue`` requires config, tokenizer and data to match exactly. ``warm_start`` starts
    a new run, so data may differ; config and tokenizer may differ only when named in
    ``allow``. ``where`` (the manifest path) is named in the message.
    """
    if intent not in ("continue", "warm_start"):
        raise ValueError(f"intent must be 'continue' or 'warm_start', not {intent!r}")
    allowed = {allow} if isinstance(allow, str) else set(allow)
    unknown = sorted(allowed - set(FIELDS))
    if unknown:
        raise ValueError(f"allow names unknown identity fields {unknown}; known: {list(FIELDS)}")
    if allowed and intent == "continue":
        raise ValueError("allow= applies to warm_start only: a continuation must match exactly")
    refused = []
    for field in FIELDS:
        old, new = saved.get(field), current.get(field)
        if (old is None and new is None) or _same(old, new):
            continue
        if intent == "warm_start" and (field == "data" or field in allowed):
            continue
        refused.append(field)
    if not refused:
        return
    lines = [_describe(f, saved.get(f), current.get(f)) for f in refused]
    names = " and ".join(refused)
    need = [f for f in refused if f != "data"]
    if intent == "continue":
        remedy = (f"restore with the original {names}, or start a new run with warm_start(...)"
                  + (f" and allow={need!r}" if need else "") + " if the change is intended")
    else:
        remedy = f"use the original {names}, or pass allow={need!r} if the change is intended"
    raise IdentityMismatch(
        f"{where or 'checkpoint'}: identity differs from the current run in {names} "
        f"(intent {intent!r}):\n  "
        + "\n  ".join(lines) + f"\n{remedy}")


def check_environment(saved: Mapping[str, Any], current: Mapping[str, Any],
                      where: str = "") -> list[str]:
    """Lines naming each environment field that differs; warns once (``UnbrokenWarning``).

    Never raises: a different environment can still continue, only bitwise equality with
    the uninterrupted run is no longer promised. Fields recorded on one side only (an older
    or newer version of unbroken) are not compared.
    """
    lines = [f"{key}: saved {_fmt(saved[key])}, now {_fmt(current[key])}"
             for key in sorted(saved.keys() & current.keys())
             if key not in _PER_PROCESS_ENV and saved[key] != current[key]]
    if lines:
        warnings.warn(f"{where or 'checkpoint'} was written in a different environment ("
                      + "; ".join(lines) + "); the resumed run may not be bitwise equal to an "
                      "uninterrupted one", UnbrokenWarning, stacklevel=2)
    return lines
