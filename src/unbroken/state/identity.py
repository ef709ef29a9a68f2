"""What a run *is*: JSON-able fingerprints of config, tokenizer, data and environment, and
the rules that decide whether a checkpoint may be continued or warm-started from."""

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

from ..errors import IdentityMismatch, UnbrokenError, UnbrokenWarning
from .jsontext import dumps_json

FIELDS = ("config", "tokenizer", "data")
_CHUNK = 8 * 1024 * 1024
# Kept values let a mismatch name the changed key; this keeps manifests small.
_KEEP_VALUE_BYTES = 16 * 1024
_ABSENT = object()


def _xxh(data: bytes) -> str:
    return xxhash.xxh3_128(data).hexdigest()


def _jsonable(obj: Any, path: str) -> Any:
    """A plain JSON tree equal to ``obj``, or ``UnbrokenError`` naming the first bad key."""
    if isinstance(obj, float) and not math.isfinite(obj):
        raise UnbrokenError(f"{path}: {obj} cannot be fingerprinted (JSON has no NaN/inf)")
    if obj is None or isinstance(obj, (bool, int, float, str)):
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


def _json_entry(kind: str, obj: Mapping[str, Any], path: str, summary: str) -> dict[str, Any]:
    blob = dumps_json(_jsonable(obj, path))
    entry: dict[str, Any] = {"kind": kind, "hash": _xxh(blob), "summary": summary}
    if len(blob) < _KEEP_VALUE_BYTES:
        entry["value"] = json.loads(blob)  # plain JSON (tuples, enums normalised), as hashed
    return entry


def _vocab_entry(tokenizer: Any, field: str) -> dict[str, Any]:
    # get_vocab() omits merges and normalizers; pass the tokenizer folder to cover those too.
    vocab, name = tokenizer.get_vocab(), type(tokenizer).__name__
    special = getattr(tokenizer, "all_special_tokens", None)
    payload = {"class": name, "vocab": vocab, "special_tokens": special and list(special)}
    return _json_entry("vocab", payload, field, f"{name} with {len(vocab)} tokens")


def _hash_file(path: str | os.PathLike[str]) -> tuple[int, str]:
    """(size, xxh3-128 hex) of a file's contents, read in 8 MiB chunks."""
    h, size = xxhash.xxh3_128(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _hash_dir(root: Path) -> tuple[str, int, int]:
    """(hash, file count, total bytes) of a folder tree: every entry, in sorted order.
    Symlinks count by their target string, never followed: nothing outside, no loops."""
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
            # A JSON line per entry frames names unambiguously, undecodable ones too (ASCII).
            h.update(json.dumps(record).encode("ascii") + b"\n")
        stack.extend(reversed(subdirs))
    return h.hexdigest(), files, total


def _path_entry(field: str, path: Path) -> dict[str, Any]:
    try:
        if path.is_dir():
            digest, files, total = _hash_dir(path)
            return {"kind": "dir", "hash": digest, "files": files, "bytes": total,
                    "summary": f"dir {path.name}/ with {files} files, {total:,} bytes"}
        if path.is_file():
            size, digest = _hash_file(path)
            return {"kind": "file", "hash": digest, "size": size,
                    "summary": f"file {path.name}, {size:,} bytes"}
    except OSError as e:
        raise UnbrokenError(f"{field} path {path} cannot be read: {e}") from e
    raise UnbrokenError(f"{field} path {path} is gone, or is neither a file nor a folder")


class Identity:
    """What must stay the same for a run to be continued: config, tokenizer and data.

    ``tokenizer``/``data``: a ``Path`` (must exist) or a ``str`` naming an existing file or
    folder (hashed by content), any other ``str`` (a revision label), a mapping, or (tokenizer
    only) an object with ``get_vocab()``. Config and mappings are captured now; files are
    hashed lazily, once, on the first ``fingerprint()``."""

    def __init__(self, config: Mapping[str, Any] | None = None,
                 tokenizer: str | os.PathLike[str] | Mapping[str, Any] | object | None = None,
                 data: str | os.PathLike[str] | Mapping[str, Any] | None = None) -> None:
        self._entries: dict[str, dict[str, Any]] = {}
        self._paths: dict[str, Path] = {}
        if config is not None:
            if not isinstance(config, Mapping):
                raise TypeError(f"config must be a mapping, not {type(config).__name__}")
            self._entries["config"] = _json_entry("config", config, "config",
                                                 f"config with {len(config)} keys")
        for field, source in (("tokenizer", tokenizer), ("data", data)):
            if source is not None:
                self._add(field, source)
        self._cache: dict[str, Any] | None = None
        # An async save thread and the training loop may both ask; hash a big folder once.
        self._lock = threading.Lock()

    def _add(self, field: str, source: object) -> None:
        if isinstance(source, os.PathLike) or (isinstance(source, str) and os.path.exists(source)):
            path = Path(source).absolute()  # resolved now: the cwd may change before hashing
            if not path.exists():
                raise UnbrokenError(f"{field} path {path} does not exist")
            self._paths[field] = path
        elif isinstance(source, str):
            self._entries[field] = {"kind": "revision", "hash": _xxh(source.encode("utf-8")),
                                    "value": source, "summary": f"revision {source!r}"}
        elif isinstance(source, Mapping):
            self._entries[field] = _json_entry("mapping", source, field,
                                                f"mapping with {len(source)} keys")
        elif field == "tokenizer" and callable(getattr(source, "get_vocab", None)):
            self._entries[field] = _vocab_entry(source, field)
        else:
            raise TypeError(f"{field} must be a path, a revision string, a mapping or (tokenizer "
                            f"only) an object with get_vocab(), not {type(source).__name__}")

    def fingerprint(self) -> dict[str, Any]:
        """One ``{"kind", "hash", "summary", ...}`` entry per given field (JSON-able, a copy)."""
        with self._lock:
            if self._cache is None:
                found = dict(self._entries)
                for field, path in self._paths.items():
                    found[field] = _path_entry(field, path)
                self._cache = {f: found[f] for f in FIELDS if f in found}
            return copy.deepcopy(self._cache)


def environment() -> dict[str, Any]:
    """Software, hardware and numerics settings that decide whether results are bitwise equal.
    Loader knobs such as ``num_workers`` are absent: the data order does not depend on them."""
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    # Device names only once CUDA is initialized: asking for them initializes it, which would
    # add CUDA RNG streams to the process between a save and the next one.
    names = ([torch.cuda.get_device_name(i) for i in range(count)]
             if cuda and torch.cuda.is_initialized() else None)
    distributed = dist.is_available() and dist.is_initialized()
    return {
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "cuda_device_count": count,
        "cuda_devices": names,
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
    text = "absent" if value is _ABSENT else json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= 80 else text[:77] + "..."


def _diffs(a: Any, b: Any, path: str) -> Iterator[tuple[str, Any, Any]]:
    """Every differing leaf of two JSON trees, in sorted key order."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(a.keys() | b.keys()):
            yield from _diffs(a.get(key, _ABSENT), b.get(key, _ABSENT), f"{path}.{key}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from _diffs(x, y, f"{path}[{i}]")
    elif type(a) is not type(b) or a != b:  # 1 vs 1.0 vs True hash differently, so differ here
        yield path, a, b


def _side(entry: Any) -> str:
    if not isinstance(entry, Mapping):
        return "nothing" if entry is None else "a malformed entry"
    return f"{entry.get('summary') or entry.get('kind', '?')} (xxh3 {str(entry.get('hash'))[:12]})"


def _agree(saved: Any, current: Any, *keys: str) -> bool:
    """Both are entries and hold the same, present, value under each of ``keys``."""
    return (isinstance(saved, Mapping) and isinstance(current, Mapping)
            and all(saved.get(k) is not None and saved.get(k) == current.get(k) for k in keys))


def _describe(field: str, saved: Any, current: Any) -> str:
    old, new = (e.get("value") if isinstance(e, Mapping) else None for e in (saved, current))
    if isinstance(old, dict) and isinstance(new, dict) and _agree(saved, current, "kind"):
        diffs = list(_diffs(old, new, field))
        if diffs:
            path, a, b = diffs[0]
            n = len(diffs) - 1
            more = f" (and {n} more differing key{'s' if n > 1 else ''})" if n else ""
            return f"{path}: saved {_fmt(a)}, now {_fmt(b)}{more}"
    return f"{field}: saved {_side(saved)}, now {_side(current)}"


def check_identity(saved: Mapping[str, Any], current: Mapping[str, Any], *, intent: str,
                   allow: Iterable[str] = (), where: str = "") -> None:
    """Raise one ``IdentityMismatch`` naming every field that forbids this resume.

    ``continue`` needs config, tokenizer and data to match exactly; ``warm_start`` (a new run)
    lets data differ, and config/tokenizer when named in ``allow``. ``where``: the manifest."""
    if intent not in ("continue", "warm_start"):
        raise ValueError(f"intent must be 'continue' or 'warm_start', not {intent!r}")
    allowed = {allow} if isinstance(allow, str) else set(allow)
    if unknown := sorted(allowed - set(FIELDS)):
        raise ValueError(f"allow names unknown identity fields {unknown}; known: {list(FIELDS)}")
    if allowed and intent == "continue":
        raise ValueError("allow= applies to warm_start only: a continuation must match exactly")
    refused = []
    for field in FIELDS:
        old, new = saved.get(field), current.get(field)
        # Kind counts too: a revision label and a file holding the same bytes hash alike.
        if (old is None and new is None) or _agree(old, new, "kind", "hash"):
            continue
        if intent == "warm_start" and (field == "data" or field in allowed):
            continue
        refused.append(field)
    if not refused:
        return
    lines = [_describe(f, saved.get(f), current.get(f)) for f in refused]
    names = ", ".join(refused)
    need = [f for f in refused if f != "data"]
    remedy = (f"restore with the original {names}, or start a new run with warm_start(...)"
              + (f" and allow={need!r}" if need else "") if intent == "continue"
              else f"use the original {names}, or pass allow={need!r}")
    raise IdentityMismatch(f"{where or 'checkpoint'}: identity differs from the current run in "
                           f"{names} (intent {intent!r}):\n  " + "\n  ".join(lines)
                           + f"\n{remedy} if the change is intended")


def check_environment(saved: Mapping[str, Any], current: Mapping[str, Any],
                      where: str = "") -> list[str]:
    """Lines naming each differing environment field; warns once (``UnbrokenWarning``), never
    raises: the run may go on, only bitwise equality is no longer promised. Fields recorded on
    one side only (another unbroken version) and the per-process rank are not compared."""
    lines = [f"{key}: saved {_fmt(saved[key])}, now {_fmt(current[key])}"
             for key in sorted(saved.keys() & current.keys())
             if key != "rank" and None not in (saved[key], current[key])
             and saved[key] != current[key]]
    if lines:
        warnings.warn(f"{where or 'checkpoint'} was written in a different environment ("
                      + "; ".join(lines) + "); the resumed run may not be bitwise equal to an "
                      "uninterrupted one", UnbrokenWarning, stacklevel=2)
    return lines
