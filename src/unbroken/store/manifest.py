"""MANIFEST.json: the commit record of a generation, written last and trusted only whole.

A manifest names every artifact with its size and xxh3-128 content hash, the generation and
step, the run's id and incarnation, its lineage, identity and environment, and a ``checksum``
of its own: the xxh3-128 of the canonical JSON of every other field. Parsing is strict: the
checksum is checked first, so that any edit of a committed manifest (a flipped digit of a hash,
an edited step or parent, a field that still parses) is refused as corruption of the manifest
rather than read as a different generation; then an unknown schema, a name that could leave
the generation folder, duplicate names, or a header larger than the limit all raise
``CorruptCheckpoint`` naming the file and the field.

The checksum detects accidents (a bad disk, a stray edit), not an attacker: anyone able to write
the file can reseal it. What a resealed manifest names is still checked against the files."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import xxhash

from ..errors import CorruptCheckpoint
from ..state.jsontext import dumps_json, loads_json

SCHEMA = "unbroken.manifest/1"
MANIFEST = "MANIFEST.json"
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
# How deeply a manifest's JSON may nest: what unbroken writes nests a few levels around the
# identity values (themselves at most 100 deep, `_identity_json.MAX_DEPTH`); deeper is no
# manifest of ours, and tools that print one (``inspect --json``) recurse through it.
MAX_MANIFEST_DEPTH = 128
TO_COMMIT = "to_commit_seconds"  # timings: a save's start to its manifest
CHECKSUM = "checksum"  # the manifest's own field: xxh3-128 hex of every other field
# Plain file names only: no separators, no "..", no leading dot, nothing a shell or a
# filesystem could reinterpret. Confinement to the generation folder follows from this.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}", re.ASCII)  # used with fullmatch
_HASH = re.compile(r"[0-9a-f]{32}", re.ASCII)
_NON_FINITE = ("nan", "inf", "-inf")
_FLOAT_MAX = 1.7976931348623157e308


@dataclass(frozen=True)
class Artifact:
    """One file of a generation: its name inside the folder, byte size and xxh3-128 hex."""

    name: str
    size: int
    xxh3_128: str


@dataclass
class Manifest:
    """The parsed commit record of one generation."""

    generation: int
    step: int
    run_id: str
    incarnation: int
    artifacts: list[Artifact]
    parts: list[str]
    parent: dict[str, Any] | None = None
    origin: dict[str, Any] | None = None
    identity: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    retention: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    created: str = ""
    schema: str = SCHEMA
    world_size: int = 1  # ranks that wrote it (each its own rankNNNNN.* files when > 1)
    # On an object store: the upload folder (``u-<id>``) inside the generation's prefix that
    # holds its artifacts; empty for a local generation (its files are beside the manifest).
    folder: str = ""
    # Seconds from the save's start to this manifest (encoding and writing every artifact; a
    # sync save's read-back comes after): what `unbroken plan RUN` measures a save by.
    timings: dict[str, float] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        """The committed bytes: canonical JSON of every field, sealed with its checksum.
        A non-finite metric (the NaN loss of an overflowing AMP step) is written as the
        string "nan", "inf" or "-inf": JSON has no such numbers."""
        fields = asdict(self)
        fields["metrics"] = {k: v if math.isfinite(v) else repr(v)
                             for k, v in self.metrics.items()}
        if not self.folder:
            del fields["folder"]  # a local manifest's bytes stay as before object stores
        if not self.timings:
            del fields["timings"]
        return seal(fields)

    def artifact(self, name: str) -> Artifact | None:
        return next((a for a in self.artifacts if a.name == name), None)

    @property
    def total_bytes(self) -> int:
        return sum(a.size for a in self.artifacts)


def checksum(fields: Mapping[str, Any]) -> str:
    """The xxh3-128 hex of the canonical JSON (sorted keys) of every field but ``checksum``."""
    return xxhash.xxh3_128(dumps_json({k: v for k, v in fields.items() if k != CHECKSUM}))\
        .hexdigest()


def seal(fields: Mapping[str, Any]) -> bytes:
    """Manifest bytes for ``fields`` with a correct ``checksum`` (any old one is replaced).

    For tests and tools that write a deliberately crafted but well-formed manifest; nothing
    here validates the fields, ``parse_manifest`` does."""
    body = {k: v for k, v in fields.items() if k != CHECKSUM}
    return dumps_json({**body, CHECKSUM: checksum(body)})


def check_seal(raw: dict[str, Any], where: str, schema: str = SCHEMA,
               what: str = "manifest") -> None:
    """Refuse a sealed record (a manifest, or the ``what`` of ``schema``) whose checksum is
    absent or does not match its other fields."""
    try:
        expected = checksum(raw)
    except (ValueError, TypeError, RecursionError) as e:  # e.g. 1e999 parses as inf
        raise CorruptCheckpoint(f"{where}: {what} cannot be checksummed ({e}); the {what} "
                                "changed after commit") from None
    recorded = raw.get(CHECKSUM)
    if recorded == expected:
        return
    if CHECKSUM not in raw:
        listed = f"a {CHECKSUM!r} field, found none"
    else:
        listed = recorded if isinstance(recorded, str) and _HASH.fullmatch(recorded) \
            else f"{recorded!r:.40}"
    declared = raw.get("schema")
    hint = "" if declared == schema else (
        f"; it declares schema {declared!r:.40}, this version of unbroken reads {schema!r}")
    raise CorruptCheckpoint(f"{where}: {what} checksum {expected}, expected {listed} (the "
                            f"{what} changed after commit){hint}")


def valid_artifact_name(name: object) -> bool:
    return isinstance(name, str) and bool(_NAME.fullmatch(name)) and name != MANIFEST


def _refuse_deep(raw: Any, where: str) -> None:
    """`CorruptCheckpoint` if ``raw`` nests deeper than `MAX_MANIFEST_DEPTH` (walked without
    recursion)."""
    stack: list[tuple[Any, int]] = [(raw, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_MANIFEST_DEPTH:
            raise CorruptCheckpoint(f"{where}: JSON nested deeper than {MAX_MANIFEST_DEPTH} "
                                    "levels; unbroken writes far fewer (not a manifest of ours)")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def parse_manifest(data: bytes, where: str) -> Manifest:
    """Parse and validate manifest bytes read from ``where``."""
    raw = loads_json(data, where, MAX_MANIFEST_BYTES)
    if not isinstance(raw, dict):
        raise CorruptCheckpoint(f"{where}: expected a JSON object, found {type(raw).__name__}")
    check_seal(raw, where)  # first: an edited field must read as corruption, not as data
    _refuse_deep(raw, where)
    schema = raw.get("schema")
    if schema != SCHEMA:
        raise CorruptCheckpoint(f"{where}: schema {schema!r}, this version of unbroken reads "
                                f"{SCHEMA!r}; upgrade unbroken or use the matching version")

    def need(key: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
        value = raw.get(key)
        if value is None and optional:
            return None
        if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
            raise CorruptCheckpoint(f"{where}: field {key!r} should be {_kind(kind)}, "
                                    f"found {value!r:.80}")
        return value

    generation, step, incarnation = need("generation", int), need("step", int), need(
        "incarnation", int)
    if min(generation, step, incarnation) < 0:
        raise CorruptCheckpoint(f"{where}: negative generation, step or incarnation")
    if max(generation, step, incarnation) >= 1 << 63:  # (what a save writes: int64 counters)
        raise CorruptCheckpoint(f"{where}: generation, step or incarnation past 2**63 - 1; "
                                "no save writes one")
    artifacts = []
    seen: set[str] = set()
    for entry in need("artifacts", list):
        if not isinstance(entry, dict):
            raise CorruptCheckpoint(f"{where}: artifact entry {entry!r:.80} is not an object")
        name, size, digest = entry.get("name"), entry.get("size"), entry.get("xxh3_128")
        if not isinstance(name, str) or not valid_artifact_name(name):
            raise CorruptCheckpoint(
                f"{where}: artifact name {name!r:.80} is not a plain file name inside the "
                "generation folder (1 to 128 ASCII letters, digits, '_', '-' and '.', not "
                "first; no '/'); refusing the generation")
        if type(size) is not int or size < 0 or not (isinstance(digest, str)
                                                     and _HASH.fullmatch(digest)):
            raise CorruptCheckpoint(f"{where}: artifact {name!r} has a malformed size or hash")
        if name in seen:
            raise CorruptCheckpoint(f"{where}: artifact {name!r} listed twice")
        seen.add(name)
        artifacts.append(Artifact(name, size, digest))
    parts = need("parts", list)
    if not all(isinstance(p, str) for p in parts):
        raise CorruptCheckpoint(f"{where}: field 'parts' should list strings")
    metrics = {}
    for k, v in need("metrics", dict).items():
        if isinstance(v, str) and v in _NON_FINITE:
            metrics[k] = float(v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) <= _FLOAT_MAX:
            metrics[k] = float(v)
        else:
            raise CorruptCheckpoint(f"{where}: metric {k!r:.60} should be a number, found "
                                    f"{v!r:.60}")
    world_size = raw.get("world_size", 1)  # absent in manifests of a single process
    if type(world_size) is not int or not 1 <= world_size <= 1 << 20:
        raise CorruptCheckpoint(f"{where}: field 'world_size' should be a rank count, found "
                                f"{world_size!r:.40}")
    folder = raw.get("folder", "")  # absent in local manifests
    if not isinstance(folder, str) or folder and not valid_artifact_name(folder):
        raise CorruptCheckpoint(f"{where}: field 'folder' should be a plain folder name, found "
                                f"{folder!r:.40}")
    timings = raw.get("timings", {})
    if not isinstance(timings, dict) or not all(
            isinstance(k, str) and type(v) in (int, float) and 0 <= v <= _FLOAT_MAX
            for k, v in timings.items()):
        raise CorruptCheckpoint(f"{where}: field 'timings' should map names to seconds, found "
                                f"{timings!r:.60}")
    identity = need("identity", dict)
    for name, entry in identity.items():  # (what a restore compares: never a None hash)
        if entry is not None and not (isinstance(entry, dict)
                                      and isinstance(entry.get("hash"), str)):
            raise CorruptCheckpoint(f"{where}: identity {name!r} should be an entry with its "
                                    f"'hash' as unbroken writes it, found {entry!r:.80}")
    return Manifest(
        world_size=world_size, folder=folder, timings={k: float(v) for k, v in timings.items()},
        generation=generation, step=step, run_id=need("run_id", str), incarnation=incarnation,
        artifacts=artifacts, parts=parts, parent=need("parent", dict, optional=True),
        origin=need("origin", dict, optional=True), identity=identity,
        environment=need("environment", dict), retention=need("retention", dict),
        metrics=metrics, created=need("created", str), schema=schema)


def _kind(kind: type | tuple[type, ...]) -> str:
    names = {int: "an integer", str: "a string", list: "a list", dict: "an object"}
    return names.get(kind, str(kind)) if isinstance(kind, type) else "valid"
