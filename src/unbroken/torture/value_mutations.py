"""Mutations of the values in a generation's JSON, resealed (hashes, sizes and checksums made to
agree) so that they reach the parsers and decoders behind the hashes: numbers out of range
(1e999, -1e999, an integer of 5,000 digits, a torch.Size dimension of 2**70) and lone
surrogates (``\\udcff``, written as JSON escapes) in keys and string values of state.json, the
manifest and RUN.json."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import xxhash

from ..state.jsontext import dumps_json
from ..store.manifest import CHECKSUM, MANIFEST, seal
from ..store.runrecord import RUN_FILE
from ._case import Case, Catalogue, registrar

STATE = "state.json"

VALUES: Catalogue = {}
mutation = registrar(VALUES)

Path = tuple[Any, ...]
_SENTINEL = "@@unbroken-fuzz-number@@"


def _walk(obj: Any, path: Path, visit: Callable[[str, Path, Any], None]) -> None:
    """Call ``visit(kind, path, value)`` for every key ("key", the path ending in it) and leaf
    value ("value") of a JSON document."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            visit("key", (*path, k), k)
            _walk(v, (*path, k), visit)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _walk(v, (*path, i), visit)
    else:
        visit("value", path, obj)


def _numbers(doc: Any) -> list[Path]:
    out: list[Path] = []
    _walk(doc, (), lambda kind, path, v: out.append(path) if kind == "value" and isinstance(
        v, (int, float)) and not isinstance(v, bool) else None)
    return out


def _set(doc: Any, path: Path, value: Any) -> None:
    for p in path[:-1]:
        doc = doc[p]
    doc[path[-1]] = value


def _rename_key(doc: Any, path: Path, new: str) -> None:
    """Rename the key at ``path`` in place, keeping the order of the object's keys."""
    for p in path[:-1]:
        doc = doc[p]
    items = list(doc.items())
    doc.clear()
    for k, v in items:
        doc[new if k == path[-1] else k] = v


def _show(path: Path) -> str:
    return "/".join(str(p) for p in path)[-70:]


def _reseal_raw(body: bytes) -> bytes:
    """A manifest body (canonical JSON without its checksum) sealed as ``seal`` would: the
    checksum is the xxh3-128 of those bytes. For bodies ``seal`` cannot write (1e999)."""
    return body[:-1] + f',"{CHECKSUM}":"{xxhash.xxh3_128(body).hexdigest()}"}}'.encode()


@mutation("numeric-overflow", 3)
def _overflow(c: Case) -> str:
    """A number of state.json (three times in four) or of the manifest replaced by one no
    float or sane size holds; resealed, so only the parser or the decoder can refuse it."""
    g = c.pick_target()
    how = c.rng.choice(["1e999", "-1e999", "5000-digit int", "2**70 in a size"])
    where = STATE if c.rng.random() < 0.75 else MANIFEST
    doc = json.loads(c.read(g, where))
    if where == MANIFEST:
        doc.pop(CHECKSUM, None)
    numbers = _numbers(doc)
    if where == STATE:  # a part first, then one of its numbers (the RNG holds most of them)
        parts = sorted({p[1] for p in numbers if p[0] == "parts"})
        part = c.rng.choice(parts)
        numbers = [p for p in numbers if p[:2] == ("parts", part)]
    path = c.rng.choice(numbers)
    if how == "2**70 in a size":
        dims = [c.rng.choice([1, 3]), 2 ** 70] if c.rng.random() < 0.5 else [2 ** 70]
        _set(doc, path, {"$t": "size", "v": dims} if where == STATE else 2 ** 70)
        text = None
    else:
        _set(doc, path, _SENTINEL)
        text = {"1e999": "1e999", "-1e999": "-1e999"}.get(how) or (
            str(c.rng.randrange(1, 10)) + "".join(str(c.rng.randrange(10)) for _ in range(4999)))
    if where == STATE:
        raw = json.dumps(doc, separators=(",", ":"))
        if text is not None:
            raw = raw.replace(f'"{_SENTINEL}"', text)
        c.write(g, STATE, raw.encode())
        c.restamp(g, STATE)
    elif text is None:
        c.save_manifest(g, doc)
    else:
        body = dumps_json(doc).replace(f'"{_SENTINEL}"'.encode(), text.encode())
        c.write(g, MANIFEST, _reseal_raw(body))
    return f"{how} at {where} {_show(path)} of {os.path.basename(g)}, resealed"


def _validated(path: Path) -> bool:
    """Whether unbroken has a contract for the string at ``path`` of state.json. Inside one
    parameter's optimizer state, and inside a hyperparameter's value, the content is the
    optimizer's (see state.optim.optimizer_state_to_torch): a resealed edit there is an edit of the
    data, which no hash can tell from the data."""
    if path[:3] == ("parts", "optimizer", "state") and len(path) > 4:
        return False
    return not (path[:3] == ("parts", "optimizer", "param_groups") and len(path) > 5
                and path[4] != "params")


_SURROGATES = ("\udcff", "\udcff", "\ud800")


@mutation("surrogate-string", 3)
def _surrogate(c: Case) -> str:
    """A lone surrogate in a key or string value of state.json, the manifest or RUN.json,
    written as a JSON escape and resealed: decoded, compared, stamped, printed and logged, it
    must end in a typed refusal or in a load whose state equals what was saved."""
    where = c.rng.choices([STATE, MANIFEST, RUN_FILE], [5, 4, 1])[0]
    g = c.pick_target() if where != RUN_FILE else c.run
    doc = json.loads(c.read(g, where))
    if where != STATE:
        doc.pop(CHECKSUM, None)
    spots: list[tuple[str, Path, str]] = []
    _walk(doc, (), lambda kind, path, v: spots.append((kind, path, v))
          if isinstance(v, str) else None)
    if where == STATE:
        spots = [s for s in spots if _validated(s[1])]
    kind, path, old = c.rng.choice(spots)
    bad = c.rng.choice(_SURROGATES)
    at = c.rng.choice(["append", "prepend", "replace"])
    new = {"append": old + bad, "prepend": bad + old, "replace": bad}[at]
    if kind == "key":
        _rename_key(doc, path, new)
    else:
        _set(doc, path, new)
    if where == STATE:
        c.write(g, STATE, json.dumps(doc, separators=(",", ":")).encode())  # \udcff escapes
        c.restamp(g, STATE)
    else:
        c.write(g, where, seal(doc))
    return (f"lone surrogate {bad!r} ({at}) in the {kind} {_show(path)!r} of "
            f"{os.path.basename(g) + '/' if where != RUN_FILE else ''}{where}, resealed")
