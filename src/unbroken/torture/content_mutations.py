"""Mutations of what a generation's files hold: bit flips, truncations, edited manifest fields,
oversized files and headers, deeply nested JSON, bad encodings, pickle payloads, edited
state.json, and every generation corrupt at once."""

from __future__ import annotations

import io
import json
import os
import random
import struct
import zipfile
from typing import Any

import xxhash

from ..state.jsontext import dumps_json
from ..store.manifest import CHECKSUM, MANIFEST
from ._case import Case, Catalogue, header_end, registrar

STATE = "state.json"

CONTENT: Catalogue = {}
mutation = registrar(CONTENT)


def _nested(depth: int, kind: str = "list") -> bytes:
    if kind == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"0" + b"}" * depth


def _pickle_payload(marker: str) -> bytes:
    """Protocol-0 pickle bytes, written by hand (nothing in unbroken imports pickle): if any
    unpickler ever loaded them, ``open(marker, "w")`` would create the marker file."""
    return (b"cbuiltins\nopen\n(V" + marker.encode("raw_unicode_escape") + b"\nVw\ntR.")


def _torch_zip(marker: str) -> bytes:
    """A torch.save-style zip archive whose data.pkl carries the payload."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", _pickle_payload(marker))
        z.writestr("archive/version", "3\n")
    return buf.getvalue()


@mutation("flip-tensor-data", 3)
def _flip_tensor_data(c: Case) -> str:
    g = c.pick_target()
    name = c.rng.choice(c.tensor_files(g))
    data = c.read(g, name)
    return "bit flip in tensor data: " + c.flip(g, name, header_end(data), len(data))


@mutation("flip-safetensors-header", 3)
def _flip_header(c: Case) -> str:
    g = c.pick_target()
    name = c.rng.choice(c.tensor_files(g))
    desc = c.flip(g, name, 0, header_end(c.read(g, name)))
    return "bit flip in a safetensors header: " + desc + c.maybe_restamp(g, name)


@mutation("flip-manifest", 3)
def _flip_manifest(c: Case) -> str:
    g = c.pick_target()
    return "bit flip in the manifest: " + c.flip(g, MANIFEST, 0, len(c.read(g, MANIFEST)))


@mutation("flip-state-json", 2)
def _flip_state(c: Case) -> str:
    g = c.pick_target()
    return "bit flip in state.json: " + c.flip(g, STATE, 0, len(c.read(g, STATE)))


@mutation("truncate", 3)
def _truncate(c: Case) -> str:
    g = c.pick_target()
    name = c.rng.choice(c.names(g))
    size = os.path.getsize(os.path.join(g, name))
    keep = c.rng.choice([0, 1, 7, 8, c.rng.randrange(max(1, size))])
    os.truncate(os.path.join(g, name), min(keep, max(0, size - 1)))
    return f"{os.path.basename(g)}/{name} truncated to {keep} bytes" + c.maybe_restamp(g, name,
                                                                                        0.3)


_FIELD_EDITS: list[tuple[str, Any]] = [
    ("size", 1), ("size", -1), ("size", 0), ("size", 2 ** 62), ("size", -5), ("size", "12"),
    ("size", 1.5), ("size", True), ("size", None),
    ("hash", "other"), ("hash", "UPPER"), ("hash", "short"), ("hash", 123),
    ("step", 1), ("step", -1), ("step", "neg"), ("step", True), ("step", 2 ** 70),
    ("step", "6"), ("step", 6.0), ("step", None),
    ("schema", "unbroken.manifest/2"), ("schema", ""), ("schema", None), ("schema", "<del>"),
    ("generation", 1), ("generation", -1), ("generation", "6"), ("generation", "<del>"),
    ("incarnation", -1), ("incarnation", "0"), ("incarnation", 10 ** 30),
    ("run_id", "someone-else"), ("run_id", 5),
    ("artifacts", "drop"), ("artifacts", "dup"), ("artifacts", "str"), ("artifacts", {}),
    ("artifacts", []), ("artifacts", "<del>"), ("artifacts", "noname"),
    ("parts", [1]), ("parts", "x"), ("parts", ["model"]),
    ("identity", "x"), ("identity", "changed"), ("identity", {}),
    ("environment", "x"), ("environment", "changed"), ("retention", []),
    ("metrics", "x"), ("metrics", {"loss": "nan?"}), ("created", 5), ("parent", "x"),
    ("parent", {"generation": 99}), ("origin", []), ("unknown_field", {"future": True}),
    ("top", []), ("top", "text"), ("top", None),
]


@mutation("manifest-field", 5)
def _manifest_field(c: Case) -> str:
    """An edited field. Resealed (three times in five) the edit reaches the field checks and
    what lies behind them (sizes, hashes, stamps, identity); left as a plain edit, the
    manifest's own checksum refuses it."""
    g = c.pick_target()
    doc = c.manifest(g)
    key, value = c.rng.choice(_FIELD_EDITS)
    sealed = c.rng.random() < 0.6
    arts = doc["artifacts"]
    entry = c.rng.choice(arts)
    if key == "size":
        entry["size"] = entry["size"] + value if value in (1, -1) and type(value) is int \
            else value
    elif key == "hash":
        entry["xxh3_128"] = {"other": "0" * 32, "UPPER": entry["xxh3_128"].upper(),
                             "short": entry["xxh3_128"][:16]}.get(value, value)
    elif key == "step" and value in (1, -1) and type(value) is int:
        doc["step"] += value
    elif key == "step" and value == "neg":
        doc["step"] = -doc["step"]
    elif key == "artifacts" and value == "drop":
        arts.remove(entry)
    elif key == "artifacts" and value == "dup":
        arts.append(dict(entry))
    elif key == "artifacts" and value == "str":
        arts[arts.index(entry)] = entry["name"]
    elif key == "artifacts" and value == "noname":
        del entry["name"]
    elif key == "identity" and value == "changed":
        doc["identity"]["config"]["hash"] = "f" * 32
    elif key == "environment" and value == "changed":
        doc["environment"]["torch"] = "0.0.1"
    elif key == "top":
        doc = value
    elif value == "<del>":
        doc.pop(key, None)
    else:
        doc[key] = value
    c.save_manifest(g, doc, sealed)
    how = ("" if not isinstance(doc, dict) else ", resealed" if sealed
           else ", checksum left stale")
    return f"{os.path.basename(g)}/{MANIFEST}: {key} -> {value!r:.40}{how}"


@mutation("oversized", 2)
def _oversized(c: Case) -> str:
    from ..state.tensorfile import MAX_HEADER_BYTES
    from ..store.manifest import MAX_MANIFEST_BYTES
    g = c.pick_target()
    how = c.rng.choice(["manifest-sparse", "manifest-padded", "header-length", "header-claim",
                        "artifact-beyond-memory"])
    if how == "manifest-sparse":
        with open(os.path.join(g, MANIFEST), "r+b") as f:
            f.truncate(MAX_MANIFEST_BYTES + 1)
    elif how == "manifest-padded":
        data = c.read(g, MANIFEST)
        c.write(g, MANIFEST, data + b" " * (MAX_MANIFEST_BYTES + 1 - len(data)))
    elif how in ("header-length", "header-claim"):
        name = c.rng.choice(c.tensor_files(g))
        raw = bytearray(c.read(g, name))
        n = 2 ** 63 - 1 if how == "header-length" else MAX_HEADER_BYTES + 8
        raw[:8] = struct.pack("<Q", n)
        c.write(g, name, bytes(raw))
        c.restamp(g, name)
        return f"{os.path.basename(g)}/{name} header length {n}, manifest re-stamped"
    else:
        name = c.rng.choice(c.names(g, manifest=False))
        size = 1 << 43  # 8 TiB, sparse
        with open(os.path.join(g, name), "r+b") as f:
            f.truncate(size)
        doc = c.manifest(g)
        for entry in doc["artifacts"]:
            if entry["name"] == name:
                entry["size"] = size
        c.save_manifest(g, doc)
        return (f"{os.path.basename(g)}/{name} is a sparse {size}-byte file listed as such, "
                "manifest resealed")
    return f"{os.path.basename(g)}/{MANIFEST} oversized ({how})"


@mutation("deep-json", 3)
def _deep(c: Case) -> str:
    g = c.pick_target()
    where = c.rng.choice(["manifest", "manifest-field", "state", "state-part", "header"])
    depth = c.rng.choice([250, 900, 990, 5000, 200000])
    kind = c.rng.choice(["list", "dict"])
    if where == "manifest":
        c.write(g, MANIFEST, _nested(depth, kind))
    elif where == "manifest-field":
        doc = c.manifest(g)
        doc.pop(CHECKSUM, None)
        key = c.rng.choice(["parent", "origin", "identity", "environment", "metrics"])
        raw = dumps_json(doc)
        field_json = dumps_json({key: doc[key]})[1:-1]
        deep = b'{"x":' * depth + b"1" + b"}" * depth
        raw = raw.replace(field_json, f'"{key}":'.encode() + deep, 1)
        if c.rng.random() < 0.5:  # resealed: the body is canonical JSON, its hash the checksum
            raw = raw[:-1] + f',"{CHECKSUM}":"{xxhash.xxh3_128(raw).hexdigest()}"}}'.encode()
            where += " (resealed)"
        c.write(g, MANIFEST, raw)
    elif where in ("state", "state-part"):
        if where == "state":
            c.write(g, STATE, _nested(depth, kind))
        else:
            doc = json.loads(c.read(g, STATE))
            raw = json.dumps(doc, separators=(",", ":")).encode()
            deep = b'{"x":' * depth + b"1" + b"}" * depth
            raw = raw.replace(b'"scheduler":{', b'"scheduler":{"deep":' + deep + b",", 1)
            c.write(g, STATE, raw)
        c.restamp(g, STATE)
    else:
        name = c.rng.choice(c.tensor_files(g))
        data = c.read(g, name)
        end = header_end(data)
        header = _nested(depth, kind)
        header += b" " * (-len(header) % 8)
        c.write(g, name, struct.pack("<Q", len(header)) + header + data[end:])
        c.restamp(g, name)
    return f"JSON nested {depth} deep ({kind}) in {os.path.basename(g)} {where}"


@mutation("bad-encoding", 3)
def _encoding(c: Case) -> str:
    g = c.pick_target()
    where = c.rng.choice([MANIFEST, STATE, "header"])
    how = c.rng.choice(["invalid-utf8", "truncated-json", "trailing-garbage", "nan", "bom",
                        "empty", "single-quotes", "overlong-utf8", "lone-surrogate"])
    name = c.rng.choice(c.tensor_files(g)) if where == "header" else where
    data = c.read(g, name)
    start, end = (8, header_end(data)) if where == "header" else (0, len(data))
    text = data[start:end]
    if how == "invalid-utf8":
        i = text.index(b'"', 2) + 1
        text = text[:i] + b"\xff\xfe" + text[i + 2:]
    elif how == "truncated-json":
        text = text[: len(text) // 2]
    elif how == "trailing-garbage":
        text = text.rstrip() + b"}{"
    elif how == "nan":
        text = text.replace(b":", b":NaN,\"nan\":", 1)
    elif how == "bom":
        text = b"\xef\xbb\xbf" + text
    elif how == "empty":
        text = b""
    elif how == "single-quotes":
        text = text.replace(b'"', b"'")
    elif how == "overlong-utf8":
        i = text.index(b'"', 2) + 1
        text = text[:i] + b"\xc0\xaf" + text[i + 2:]
    else:
        text = text.replace(b'"', b'"\\ud800', 1)
    if where == "header":
        text += b" " * (-len(text) % 8)
        data = struct.pack("<Q", len(text)) + text + data[end:]
    else:
        data = text
    c.write(g, name, data)
    if where != MANIFEST:
        c.restamp(g, name)
    return f"{how} in {os.path.basename(g)}/{name}" + ("" if where == MANIFEST
                                                         else ", manifest re-stamped")


@mutation("pickle-payload", 3)
def _pickle(c: Case) -> str:
    g = c.pick_target()
    where = c.rng.choice([STATE, "tensor", MANIFEST, "tensor-zip", "state-b64"])
    if where == "tensor":
        name = c.rng.choice(c.tensor_files(g))
        c.write(g, name, _pickle_payload(c.marker))
    elif where == "tensor-zip":
        name = c.rng.choice(c.tensor_files(g))
        c.write(g, name, _torch_zip(c.marker))
    elif where == "state-b64":
        # a "bytes" / "ndarray" entry carrying the payload: decoded as data, never executed
        import base64
        doc = json.loads(c.read(g, STATE))
        payload = base64.b64encode(_pickle_payload(c.marker)).decode()
        doc["parts"]["counters"]["epoch"] = c.rng.choice([
            {"$t": "bytes", "v": payload},
            {"$t": "ndarray", "dtype": "|O", "shape": [1], "v": payload},
            {"$t": "npscalar", "dtype": "|O", "v": payload}])
        name = STATE
        c.write(g, name, json.dumps(doc, separators=(",", ":")).encode())
    else:
        name = where
        c.write(g, name, _pickle_payload(c.marker))
    if name != MANIFEST:
        c.restamp(g, name)
    return f"pickle payload as {os.path.basename(g)}/{name} ({where})"


def _state_edits(doc: dict[str, Any], rng: random.Random) -> str:
    parts = doc["parts"]
    edit = rng.choice(["meta-generation", "meta-run", "counters-step", "counters-type",
                       "drop-part", "extra-part", "unknown-tag", "bad-base64", "missing-tensor",
                       "schema", "tensor-file-escape", "tensor-file-other", "no-parts",
                       "bad-int-tag", "finite-float-tag", "model-not-mapping"])
    if edit == "meta-generation":
        doc["meta"]["unbroken.generation"] = str(int(doc["meta"]["unbroken.generation"]) + 2)
    elif edit == "meta-run":
        doc["meta"]["unbroken.run_id"] = "0" * 32
    elif edit == "counters-step":
        parts["counters"]["step"] += rng.choice([-2, -1, 1, 2])
    elif edit == "counters-type":
        parts["counters"]["step"] = rng.choice(["6", 6.0, None, [6]])
    elif edit == "drop-part":
        parts.pop(rng.choice(sorted(parts)))
    elif edit == "extra-part":
        parts["extra.intruder"] = {"x": 1}
    elif edit == "unknown-tag":
        parts["scheduler"]["last_epoch"] = {"$t": "exec", "v": "print(1)"}
    elif edit == "bad-base64":
        parts["scheduler"]["blob"] = {"$t": "bytes", "v": "!!not base64!!"}
    elif edit == "missing-tensor":
        missing = {"$t": "tensor", "key": "no.such.key"}
        model = parts["model"]
        if model.get("$t") == "odict":  # a state_dict is an OrderedDict: [[key, value], ...]
            model["v"][0][1] = missing
        else:
            model["0.weight"] = missing
    elif edit == "schema":
        doc["schema"] = "unbroken.state/99"
    elif edit == "tensor-file-escape":
        doc["tensor_files"]["model"] = "../gen-000000002/model.safetensors"
    elif edit == "tensor-file-other":
        doc["tensor_files"]["model"] = "optimizer.safetensors"
    elif edit == "no-parts":
        doc.pop("parts")
    elif edit == "bad-int-tag":
        parts["counters"]["epoch"] = {"$t": "int", "v": "0xZZ"}
    elif edit == "finite-float-tag":
        parts["scheduler"]["base_lrs"] = [{"$t": "float", "v": "0.5"}]
    else:
        parts["model"] = [1, 2, 3]
    return edit


@mutation("state-edit", 4)
def _state_edit(c: Case) -> str:
    g = c.pick_target()
    doc = json.loads(c.read(g, STATE))
    edit = _state_edits(doc, c.rng)
    c.write(g, STATE, json.dumps(doc, separators=(",", ":")).encode())
    c.restamp(g, STATE)
    return f"state.json of {os.path.basename(g)}: {edit}, manifest re-stamped"


@mutation("every-generation", 2)
def _every(c: Case) -> str:
    c.every_generation = True
    done = []
    for g in c.gens:
        how = c.rng.choice(["flip", "truncate", "no-manifest", "flip-state"])
        if how == "flip":
            name = c.rng.choice(c.tensor_files(g))
            data = c.read(g, name)
            c.flip(g, name, header_end(data), len(data))
        elif how == "truncate":
            name = c.rng.choice(c.names(g, manifest=False))
            os.truncate(os.path.join(g, name), 3)
        elif how == "no-manifest":
            os.unlink(os.path.join(g, MANIFEST))
        else:
            c.flip(g, STATE, 0, len(c.read(g, STATE)))
        done.append(f"{os.path.basename(g)}: {how}")
    return "every generation corrupt (" + "; ".join(done) + ")"
