"""What a run *is*: JSON-able fingerprints of config, tokenizer, data and environment, and
the rules that decide whether a checkpoint may be continued or warm-started from."""

from __future__ import annotations

import copy
import errno
import json
import os
import re
import stat
import threading
import unicodedata
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import xxhash

from ..errors import IdentityMismatch, UnbrokenError, UnbrokenWarning, UnsupportedValue
from ._identity_json import json_entry, key_changes, key_digests, xxh
from ._identity_tokenizer import tokenizer_entry

FIELDS = ("config", "tokenizer", "data")
# A string that reads as a path, not as a revision label ("train-v3", "org/dataset@rev"): one
# from the root, the home folder or here, or ending in a file name with an extension
_LOOKS_LIKE_A_PATH = re.compile(r"(?:/|~/|\./|\.\./)|.*/[^/@]*\.[A-Za-z0-9]{1,10}$")
_CHUNK = 8 * 1024 * 1024
# Kept values let a mismatch name the changed key and show both values; a larger tree keeps
# a bounded digest per key path instead (``_identity_json.key_digests``): manifests stay small.
_KEEP_VALUE_BYTES = 16 * 1024
# Changed keys named per field in a mismatch message, when only digests were kept.
_NAMED_KEYS = 5
_ABSENT = object()


class IdentityArgumentError(UnsupportedValue, TypeError):
    """An ``Identity`` argument of a type it does not take; a ``TypeError`` too, as before."""


def _hash_file(path: str | os.PathLike[str]) -> tuple[int, str]:
    """(size, xxh3-128 hex) of a file's contents, read in 8 MiB chunks."""
    h, size = xxhash.xxh3_128(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _hash_dir(root: Path) -> tuple[str, int, int, int, str]:
    """(hash, file count, total bytes, symlink count, the hash an older unbroken computed) of
    a folder tree: every entry, in sorted order.

    Symlinks are followed and count as what they point to: data/train.bin -> /big/disk/...
    changes the hash when the bytes there change (recording the link text alone would not),
    and a folder of links hashes like one of copies, wherever the targets live. A dangling
    link holds nothing to read: it is recorded as dangling with its target text, so the hash
    changes once the target appears or the link moves. A link cycle, or a link to a folder
    that contains it, has no finite content: ``UnsupportedValue`` names it.

    Before, a symlink counted by its target text and was never followed; that hash is
    computed alongside (the same walk without the linked folders), so that a run saved then
    is still recognised (`_legacy_match`): a tokenizer folder of the Hugging Face cache is
    all symlinks."""
    h, old = xxhash.xxh3_128(), xxhash.xxh3_128()
    files = total = links = 0
    top = os.stat(root)
    # Each folder to visit carries the (device, inode) of the folders above it (a loop test)
    # and whether the older walk visited it (no symlink on the way).
    stack: list[tuple[str, frozenset[tuple[int, int]], bool]] = [
        ("", frozenset({(top.st_dev, top.st_ino)}), True)]
    while stack:
        rel, above, visited = stack.pop()
        with os.scandir(root / rel) as it:
            entries = sorted(it, key=lambda e: e.name)
        subdirs = []
        for e in entries:
            name = rel + e.name
            record: list[Any]
            links += e.is_symlink()
            try:
                st = os.stat(e.path)  # follows a symlink to its final target
            except OSError as err:
                if not e.is_symlink() or err.errno not in (errno.ENOENT, errno.ELOOP):
                    raise  # unreadable or gone while hashing: the caller names the path
                if err.errno == errno.ELOOP:
                    raise UnsupportedValue(
                        f"{e.path} is a symlink cycle ({os.readlink(e.path)!r} leads back to "
                        "itself): it cannot be hashed; remove the link or fix its target"
                    ) from None
                st = None
            if st is None:
                record = ["dangling", name, os.readlink(e.path)]
            elif stat.S_ISDIR(st.st_mode):
                if (st.st_dev, st.st_ino) in above:
                    raise UnsupportedValue(
                        f"{e.path} links to a folder that contains it "
                        f"({os.readlink(e.path)!r}): the tree would never end; remove the link "
                        "or point the identity at a folder without it")
                record = ["dir", name]
                subdirs.append((name + "/", above | {(st.st_dev, st.st_ino)},
                                visited and not e.is_symlink()))
            elif stat.S_ISREG(st.st_mode):
                size, digest = _hash_file(e.path)
                files += 1
                total += size
                record = ["file", name, size, digest]
            else:  # fifo, socket, device: reading could block, so only its name counts
                record = ["other", name]
            # A JSON line per entry frames names unambiguously, undecodable ones too (ASCII).
            h.update(json.dumps(record).encode("ascii") + b"\n")
            if visited:
                was = ["link", name, os.readlink(e.path)] if e.is_symlink() else record
                old.update(json.dumps(was).encode("ascii") + b"\n")
        stack.extend(reversed(subdirs))
    return h.hexdigest(), files, total, links, old.hexdigest()


def _path_entry(field: str, path: Path) -> dict[str, Any]:
    try:
        if path.is_dir():
            digest, files, total, links, legacy = _hash_dir(path)
            entry = {"kind": "dir", "hash": digest, "files": files, "bytes": total,
                     "summary": f"dir {path.name}/ with {files} files, {total:,} bytes"}
            # "symlinks" marks the entry as hashing links by content (an older unbroken's did
            # not); "legacy_hash" is what that one recorded for the folder.
            return entry | {"symlinks": links, "legacy_hash": legacy} if links else entry
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
    folder (hashed by content, symlinks followed), any other ``str`` (a revision label), a
    mapping, or (tokenizer only) an object with ``get_vocab()``: a Hugging Face tokenizer is
    recorded in full (serialization and encoding settings, see ``_identity_tokenizer``), any
    other by class, vocab and special tokens. Config, mappings and tokenizer objects are
    captured now; files are hashed lazily, once, on the first ``fingerprint()``. A value that
    cannot be fingerprinted raises ``UnsupportedValue`` naming its key path; an argument of
    the wrong type ``IdentityArgumentError`` (also a ``TypeError``)."""

    def __init__(self, config: Mapping[str, Any] | None = None,
                 tokenizer: str | os.PathLike[str] | Mapping[str, Any] | object | None = None,
                 data: str | os.PathLike[str] | Mapping[str, Any] | None = None) -> None:
        self._entries: dict[str, dict[str, Any]] = {}
        self._paths: dict[str, Path] = {}
        if config is not None:
            if not isinstance(config, Mapping):
                raise IdentityArgumentError(
                    f"Identity(config=...): a {type(config).__name__} was given; config takes "
                    "a mapping of str keys to JSON-able values (str, int, float, bool, None, "
                    "list, dict), e.g. dict(vars(args))")
            self._entries["config"] = json_entry("config", config, "config",
                                                 f"config with {len(config)} keys",
                                                 _KEEP_VALUE_BYTES)
        for field, source in (("tokenizer", tokenizer), ("data", data)):
            if source is not None:
                self._add(field, source)
        self._cache: dict[str, Any] | None = None
        # An async save thread and the training loop may both ask; hash a big folder once.
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # (copied or sent to a spawned process, as Lightning's ddp_spawn does: a lock cannot
        # be; each copy gets its own)
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _add(self, field: str, source: object) -> None:
        if isinstance(source, str) and source.startswith("~"):
            source = os.path.expanduser(source)  # (a shell would: "~/data" is a path)
        if isinstance(source, os.PathLike) or (isinstance(source, str) and os.path.exists(source)):
            path = Path(source).expanduser().absolute()  # (now: the cwd may change before hashing)
            if not path.exists():
                raise UnbrokenError(f"{field} path {path} does not exist")
            self._paths[field] = path
        elif isinstance(source, str):
            if _LOOKS_LIKE_A_PATH.match(source):
                warnings.warn(
                    f"Identity({field}={source!r}): no such file or folder, so it is recorded "
                    "as a revision label and a later change of what it names goes unseen; pass "
                    "an existing path to hash its content, or a revision string (e.g. "
                    "'train-v3')", UnbrokenWarning, stacklevel=3)
            self._entries[field] = {"kind": "revision", "hash": xxh(source.encode("utf-8")),
                                    "value": source, "summary": f"revision {source!r}"}
        elif isinstance(source, Mapping):
            self._entries[field] = json_entry("mapping", source, field,
                                               f"mapping with {len(source)} keys",
                                               _KEEP_VALUE_BYTES)
        elif field == "tokenizer" and callable(getattr(source, "get_vocab", None)):
            self._entries[field] = tokenizer_entry(source, field, _KEEP_VALUE_BYTES)
        else:
            takes = " or (tokenizer only) an object with get_vocab()" * (field == "tokenizer")
            raise IdentityArgumentError(
                f"Identity({field}=...): a {type(source).__name__} was given; {field} takes a "
                f"path (Path, or a str naming an existing file or folder), a revision string, "
                f"a mapping{takes}")

    def refuse_inside(self, run: str) -> None:
        """Refuse a tokenizer or data folder that holds the run folder ``run`` (a local path):
        every save would change its hash, and no continuation would match it
        (`UnsupportedValue`, naming both)."""
        inside = Path(run).expanduser().absolute()
        for field, path in self._paths.items():
            if path.is_dir() and (inside == path or path in inside.parents):
                raise UnsupportedValue(
                    f"Identity({field}=...): the folder {path} holds the run folder {inside}, "
                    "so every save would change its hash and no continuation would match; "
                    f"point {field} at a folder without the run, or keep the run elsewhere")

    def fingerprint(self) -> dict[str, Any]:
        """One ``{"kind", "hash", "summary", ...}`` entry per given field (JSON-able, a copy)."""
        with self._lock:
            if self._cache is None:
                found = dict(self._entries)
                for field, path in self._paths.items():
                    found[field] = _path_entry(field, path)
                self._cache = {f: found[f] for f in FIELDS if f in found}
            return copy.deepcopy(self._cache)


def _fmt(value: Any, escaped: bool = False) -> str:
    text = "absent" if value is _ABSENT else json.dumps(value, ensure_ascii=escaped,
                                                        default=repr)
    return text if len(text) <= 80 else text[:77] + "..."


def _saved_now(a: Any, b: Any, fmt: Callable[[Any, bool], str] = _fmt) -> str:
    """"saved A, now B": escaped where the two would look alike (Unicode forms of one text:
    "café" composed and decomposed)."""
    x, y = fmt(a, False), fmt(b, False)
    if unicodedata.normalize("NFKC", x) == unicodedata.normalize("NFKC", y):
        x, y = fmt(a, True), fmt(b, True)
    return f"saved {x}, now {y}"


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


def _more(n: int) -> str:
    return f" (and {n} more differing key{'s' if n > 1 else ''})" if n else ""


def _kept(record: list[Any] | None, escaped: bool = False) -> str:
    if record is None:
        return "absent"
    return (_fmt(record[1], escaped) if len(record) > 1
            else f"xxh3 {record[0][:12]} (too long to show)")


def _legacy_tokenizer(saved: Any, current: Any) -> bool:
    """The saved entry is the vocab-only one an older unbroken wrote for a tokenizer object
    that is now fingerprinted in full."""
    return (isinstance(saved, Mapping) and isinstance(current, Mapping)
            and saved.get("kind") == "vocab" and current.get("kind") == "hf-tokenizer")


def _keys(entry: Any, field: str) -> dict[str, Any] | None:
    """An entry's per-key digests; made from its kept value when it was small enough to keep
    whole (a config that grew past the limit since the save still names its changed keys)."""
    if not isinstance(entry, Mapping):
        return None
    keys, value = entry.get("keys"), entry.get("value")
    if isinstance(keys, dict):
        return keys
    return key_digests(value, field) if isinstance(value, dict) else None


def _legacy_match(field: str, saved: Any, current: Any) -> str | None:
    """What an older unbroken recorded, equal to what it would record now (then a warning's
    text: what this resume cannot check), or None. Refusing would strand every run saved
    before the current fingerprints; the next save records them."""
    if not isinstance(saved, Mapping) or not isinstance(current, Mapping) or saved.get(
            "hash") is None:
        return None
    if (field == "tokenizer" and _legacy_tokenizer(saved, current)
            and saved["hash"] == current.get("vocab_hash")):
        return ("its tokenizer was fingerprinted by an older unbroken from class, get_vocab() "
                "and special tokens only; those match, but a change of merges, normalizer or "
                "settings since cannot be detected for this resume")
    if (saved.get("kind") == current.get("kind") == "dir" and "symlinks" not in saved
            and saved["hash"] == current.get("legacy_hash")):
        return (f"its {field} folder was hashed by an older unbroken, which recorded a "
                f"symlink's target text, not what it points to; those match, but a change of "
                "the linked files since cannot be detected for this resume")
    return None


def _describe(field: str, saved: Any, current: Any) -> str:
    old, new = (e.get("value") if isinstance(e, Mapping) else None for e in (saved, current))
    if isinstance(old, dict) and isinstance(new, dict) and _agree(saved, current, "kind"):
        diffs = list(_diffs(old, new, field))
        if diffs:
            path, a, b = diffs[0]
            return f"{path}: {_saved_now(a, b)}{_more(len(diffs) - 1)}"
    head = f"{field}: saved {_side(saved)}, now {_side(current)}"
    if (isinstance(saved, Mapping) and isinstance(current, Mapping) and _agree(
            saved, current, "kind") and saved["kind"] == "dir" and "symlinks" not in saved
            and current.get("symlinks")):
        return (head + f"\n    {current['symlinks']} entries of the folder are symlinks, now "
                "hashed by what they point to; an older unbroken hashed a symlink's target "
                "text only, so a checkpoint it wrote differs even if no data changed")
    if _legacy_tokenizer(saved, current):
        return (head + "\n    the saved entry is an older unbroken's vocab-only fingerprint "
                "(class, get_vocab() and special tokens), the current one the full "
                "serialization; on what both record, the vocab or special tokens differ")
    old, new = (_keys(e, field) for e in (saved, current))
    if old is not None and new is not None and _agree(saved, current, "kind"):
        changes = key_changes(old, new)
        lines = [f"{path}: {_saved_now(a, b, _kept)}"
                 for path, a, b in changes[:_NAMED_KEYS]]
        if lines:
            return "\n    ".join([head, *lines]) + _more(len(changes) - len(lines))
    return head


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
        legacy = _legacy_match(field, old, new)
        if legacy is not None:
            warnings.warn(f"{where or 'checkpoint'}: {legacy} (the next save records it in "
                          "full)", UnbrokenWarning, stacklevel=2)
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
