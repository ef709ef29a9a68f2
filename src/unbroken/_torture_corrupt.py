"""Corruption fuzz: mutate committed generations in every way a disk, a copy tool or a hostile
archive can, then restore, inspect and verify each mutated run.

One run with three committed generations is made once; each case copies it, applies one
mutation chosen by ``random.Random(f"{seed}:{case}")`` (so any case reruns alone from its
number), runs ``unbroken verify`` and ``unbroken inspect`` in-process, then ``restore()`` with
a fresh model and optimizer, all under a timer. A case passes when the restore ends in a typed
`UnbrokenError` whose message names the file, or loads a generation whose restored state
equals, bit for bit, what that generation saved; the commands exit 0 or 1 without a traceback;
no file outside the run changes and no code from the checkpoint runs."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import random
import shutil
import signal
import socket
import stat
import struct
import tempfile
import time
import traceback
import warnings
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ._torture_crash import build, prepare_parent, state_digest, train, update
from .errors import CorruptCheckpoint, UnbrokenError
from .manifest import MANIFEST

STEPS, EVERY, KEEP = 6, 2, 3  # generations 2, 4, 6
CASE_SECONDS = 20.0
STATE = "state.json"


class _Timeout(BaseException):
    """Raised by the case timer: the case hung."""


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    def fire(signum: int, frame: Any) -> None:
        raise _Timeout()

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# -- a case and the helpers mutations use ------------------------------------------------------


@dataclass
class Case:
    number: int
    rng: random.Random
    run: str
    gens: list[str]  # generation folders, oldest first
    outside: str  # a folder outside the run that nothing may change
    marker: str  # created only if some pickle payload ever ran
    target: str = ""
    every_generation: bool = False
    layout: bool = False  # a hostile run-folder layout (not a generation's content)

    def pick_target(self) -> str:
        self.target = self.gens[-1] if self.rng.random() < 0.75 else self.rng.choice(self.gens)
        return self.target

    def other(self, gen: str) -> str:
        return self.rng.choice([g for g in self.gens if g != gen])

    @staticmethod
    def names(gen: str, manifest: bool = True) -> list[str]:
        return sorted(n for n in os.listdir(gen) if manifest or n != MANIFEST)

    @staticmethod
    def tensor_files(gen: str) -> list[str]:
        return sorted(n for n in os.listdir(gen) if n.endswith(".safetensors"))

    @staticmethod
    def read(gen: str, name: str) -> bytes:
        with open(os.path.join(gen, name), "rb") as f:
            return f.read()

    @staticmethod
    def write(gen: str, name: str, data: bytes) -> None:
        path = os.path.join(gen, name)
        if os.path.lexists(path):
            os.unlink(path)
        with open(path, "wb") as f:
            f.write(data)

    def manifest(self, gen: str) -> dict[str, Any]:
        return json.loads(self.read(gen, MANIFEST))

    def save_manifest(self, gen: str, doc: Any) -> None:
        self.write(gen, MANIFEST, json.dumps(doc, sort_keys=True, separators=(",", ":"))
                   .encode())

    def restamp(self, gen: str, name: str) -> None:
        """Make the manifest agree with a mutated file (size and hash), so that the mutation
        reaches the decoders behind the hash check."""
        doc = self.manifest(gen)
        data = self.read(gen, name)
        for entry in doc["artifacts"]:
            if entry["name"] == name:
                entry["size"], entry["xxh3_128"] = len(data), xxhash.xxh3_128(data).hexdigest()
        self.save_manifest(gen, doc)

    def maybe_restamp(self, gen: str, name: str, p: float = 0.5) -> str:
        if name != MANIFEST and self.rng.random() < p:
            self.restamp(gen, name)
            return ", manifest re-stamped"
        return ""

    def flip(self, gen: str, name: str, lo: int, hi: int) -> str:
        data = bytearray(self.read(gen, name))
        pos = self.rng.randrange(lo, hi)
        bit = self.rng.randrange(8)
        data[pos] ^= 1 << bit
        self.write(gen, name, bytes(data))
        return f"{os.path.basename(gen)}/{name} byte {pos} bit {bit}"


def _header_end(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


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


# -- mutations ---------------------------------------------------------------------------------

Mutation = Callable[[Case], str]
MUTATIONS: dict[str, tuple[int, Mutation]] = {}


def mutation(name: str, weight: int = 1) -> Callable[[Mutation], Mutation]:
    def register(fn: Mutation) -> Mutation:
        MUTATIONS[name] = (weight, fn)
        return fn
    return register


@mutation("flip-tensor-data", 3)
def _flip_tensor_data(c: Case) -> str:
    g = c.pick_target()
    name = c.rng.choice(c.tensor_files(g))
    data = c.read(g, name)
    return "bit flip in tensor data: " + c.flip(g, name, _header_end(data), len(data))


@mutation("flip-safetensors-header", 3)
def _flip_header(c: Case) -> str:
    g = c.pick_target()
    name = c.rng.choice(c.tensor_files(g))
    desc = c.flip(g, name, 0, _header_end(c.read(g, name)))
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


@mutation("delete-file", 2)
def _delete(c: Case) -> str:
    g = c.pick_target()
    name = c.rng.choice(c.names(g))
    os.unlink(os.path.join(g, name))
    desc = f"{os.path.basename(g)}/{name} deleted"
    if name != MANIFEST and c.rng.random() < 0.4:
        doc = c.manifest(g)
        doc["artifacts"] = [a for a in doc["artifacts"] if a["name"] != name]
        c.save_manifest(g, doc)
        desc += " and dropped from the manifest"
    return desc


@mutation("extra-file", 2)
def _extra(c: Case) -> str:
    g = c.pick_target()
    how = c.rng.choice(["file", "hidden", "folder", "symlink", "empty"])
    name = {"file": "extra.bin", "hidden": ".extra", "folder": "extra.d", "symlink": "link",
            "empty": "zero.safetensors"}[how]
    path = os.path.join(g, name)
    if how == "folder":
        os.mkdir(path)
    elif how == "symlink":
        os.symlink(os.path.join(c.outside, "precious.txt"), path)
    else:
        with open(path, "wb") as f:
            f.write(b"" if how == "empty" else os.urandom(64))
    return f"unlisted {how} {os.path.basename(g)}/{name}"


@mutation("swap-files", 2)
def _swap_files(c: Case) -> str:
    g = c.pick_target()
    o = c.other(g)
    name = c.rng.choice(c.names(g, manifest=c.rng.random() < 0.3))
    a, b = c.read(g, name), c.read(o, name)
    c.write(g, name, b)
    c.write(o, name, a)
    desc = f"{name} swapped between {os.path.basename(g)} and {os.path.basename(o)}"
    if name != MANIFEST and c.rng.random() < 0.6:
        c.restamp(g, name)
        c.restamp(o, name)
        desc += ", both manifests re-stamped"
    return desc


@mutation("swap-generation", 2)
def _swap_generation(c: Case) -> str:
    g = c.pick_target()
    o = c.other(g)
    for name in c.names(g):
        os.unlink(os.path.join(g, name))
    for name in c.names(o):
        shutil.copyfile(os.path.join(o, name), os.path.join(g, name))
    doc = c.manifest(g)
    number = int(os.path.basename(g).split("-")[1])
    doc["generation"] = number
    desc = f"{os.path.basename(g)} replaced by a copy of {os.path.basename(o)}, manifest renumbered"
    if c.rng.random() < 0.6:
        doc["step"] = number
        desc += " (generation and step)"
    c.save_manifest(g, doc)
    return desc


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
    g = c.pick_target()
    doc = c.manifest(g)
    key, value = c.rng.choice(_FIELD_EDITS)
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
    c.save_manifest(g, doc)
    return f"{os.path.basename(g)}/{MANIFEST}: {key} -> {value!r:.40}"


_ESCAPES = ["../{other}/{name}", "{abs_outside}", "/etc/passwd", "sub/{name}", ".{name}",
            "", "..", ".", "x" * 300, "{name}\x00.txt", "{abs_self}", "MANIFEST.json",
            "../../{outside_rel}"]


@mutation("path-escape", 3)
def _path_escape(c: Case) -> str:
    g = c.pick_target()
    doc = c.manifest(g)
    entry = c.rng.choice(doc["artifacts"])
    outside_file = os.path.join(c.outside, "precious.txt")
    pattern = c.rng.choice(_ESCAPES)
    new = pattern.format(other=os.path.basename(c.other(g)), name=entry["name"],
                         abs_outside=outside_file, abs_self=os.path.join(g, entry["name"]),
                         outside_rel=os.path.relpath(outside_file, c.run))
    if c.rng.random() < 0.5 and pattern not in ("{abs_self}", "../{other}/{name}"):
        # point at a real file outside the generation, with its true size and hash
        with open(outside_file, "rb") as f:
            data = f.read()
        entry["size"], entry["xxh3_128"] = len(data), xxhash.xxh3_128(data).hexdigest()
    entry["name"] = new
    c.save_manifest(g, doc)
    return f"artifact name {new!r:.60} in {os.path.basename(g)}/{MANIFEST}"


@mutation("symlink", 3)
def _symlink(c: Case) -> str:
    g = c.pick_target()
    how = c.rng.choice(["same-bytes-outside", "outside-file", "older-generation", "dev-zero",
                        "manifest", "generation-folder", "dangling", "loop"])
    if how == "generation-folder":
        copy = os.path.join(c.outside, f"copy-{c.number}")
        shutil.copytree(g, copy)
        shutil.rmtree(g)
        os.symlink(copy, g)
        return f"{os.path.basename(g)} is a symlink to a copy outside the run"
    name = MANIFEST if how == "manifest" else c.rng.choice(c.names(g, manifest=False))
    path = os.path.join(g, name)
    if how in ("same-bytes-outside", "manifest"):
        target = os.path.join(c.outside, f"same-{c.number}-{name}")
        shutil.copyfile(path, target)
    elif how == "outside-file":
        target = os.path.join(c.outside, "precious.txt")
    elif how == "older-generation":
        target = os.path.join(c.other(g), name)
    elif how == "dev-zero":
        target = "/dev/zero"
    elif how == "dangling":
        target = os.path.join(c.outside, "does-not-exist")
    else:
        target = path  # a link to itself: ELOOP
    os.unlink(path)
    os.symlink(target, path)
    return f"{os.path.basename(g)}/{name} is a symlink ({how})"


@mutation("special-file", 3)
def _special(c: Case) -> str:
    g = c.pick_target()
    how = c.rng.choice(["fifo", "char-device", "socket", "folder"])
    name = MANIFEST if c.rng.random() < 0.25 else c.rng.choice(c.names(g, manifest=False))
    path = os.path.join(g, name)
    if name != MANIFEST and c.rng.random() < 0.7:
        doc = c.manifest(g)  # list it with the size a special file reports, 0
        for entry in doc["artifacts"]:
            if entry["name"] == name:
                entry["size"] = 0
        c.save_manifest(g, doc)
    os.unlink(path)
    if how == "fifo":
        os.mkfifo(path)
    elif how == "char-device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero
        except PermissionError:
            os.mkfifo(path)
            how = "fifo (mknod needs root)"
    elif how == "socket":
        s = socket.socket(socket.AF_UNIX)
        try:
            s.bind(path)
        except OSError:  # path too long for a socket address
            os.mkfifo(path)
            how = "fifo (socket path too long)"
        finally:
            s.close()
    else:
        os.mkdir(path)
    return f"{os.path.basename(g)}/{name} is a {how}"


@mutation("oversized", 2)
def _oversized(c: Case) -> str:
    from .codec import MAX_HEADER_BYTES
    from .manifest import MAX_MANIFEST_BYTES
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
        data = bytearray(c.read(g, name))
        n = 2 ** 63 - 1 if how == "header-length" else MAX_HEADER_BYTES + 8
        data[:8] = struct.pack("<Q", n)
        c.write(g, name, bytes(data))
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
        return f"{os.path.basename(g)}/{name} is a sparse {size}-byte file listed as such"
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
        key = c.rng.choice(["parent", "origin", "identity", "environment", "metrics"])
        raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        field_json = json.dumps({key: doc[key]}, sort_keys=True, separators=(",", ":"))[1:-1]
        deep = b'{"x":' * depth + b"1" + b"}" * depth
        raw = raw.replace(field_json.encode(), f'"{key}":'.encode() + deep, 1)
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
        end = _header_end(data)
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
    start, end = (8, _header_end(data)) if where == "header" else (0, len(data))
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
        parts["model"]["0.weight"] = {"$t": "tensor", "key": "no.such.key"}
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
            c.flip(g, name, _header_end(data), len(data))
        elif how == "truncate":
            name = c.rng.choice(c.names(g, manifest=False))
            os.truncate(os.path.join(g, name), 3)
        elif how == "no-manifest":
            os.unlink(os.path.join(g, MANIFEST))
        else:
            c.flip(g, STATE, 0, len(c.read(g, STATE)))
        done.append(f"{os.path.basename(g)}: {how}")
    return "every generation corrupt (" + "; ".join(done) + ")"


@mutation("hostile-layout", 2)
def _layout(c: Case) -> str:
    c.layout = True
    how = c.rng.choice(["lock-symlink", "aside-symlink", "staging-symlink", "trash-symlink",
                        "staging-holds-symlink", "staging-file", "lock-fifo"])
    outside_file = os.path.join(c.outside, "precious.txt")
    if how.startswith("lock-"):
        os.unlink(os.path.join(c.run, "LOCK"))
    if how == "lock-symlink":
        os.symlink(outside_file, os.path.join(c.run, "LOCK"))
    elif how == "lock-fifo":
        os.mkfifo(os.path.join(c.run, "LOCK"))
    elif how == "aside-symlink":
        os.symlink(c.outside, os.path.join(c.run, "aside"))
        data = c.read(c.gens[-1], "model.safetensors")  # so that restore moves one aside
        c.flip(c.gens[-1], "model.safetensors", _header_end(data), len(data))
    elif how in ("staging-symlink", "trash-symlink"):
        prefix = ".staging-000000008-0123456789ab" if how == "staging-symlink" \
            else ".trash-0123456789ab"
        os.symlink(c.outside, os.path.join(c.run, prefix))
    elif how == "staging-holds-symlink":
        staging = os.path.join(c.run, ".staging-000000008-0123456789ab")
        os.mkdir(staging)
        os.symlink(outside_file, os.path.join(staging, "model.safetensors"))
        os.symlink(c.outside, os.path.join(staging, "sub"))
    else:
        with open(os.path.join(c.run, ".staging-000000008-0123456789ab"), "wb") as f:
            f.write(b"not a folder")
    return f"hostile run folder: {how}"


# -- running and judging cases -----------------------------------------------------------------


@dataclass
class Outcome:
    kind: str
    description: str
    verdict: str = ""  # refused | fell_back | loaded | FAILED
    detail: str = ""
    older_only: bool = False  # the mutation hit an older generation, not the newest
    failures: list[str] = field(default_factory=list)


def _cli(argv: list[str]) -> tuple[int | None, str, str]:
    from .cli import main as cli_main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_main(argv)
        except _Timeout:
            raise
        except BaseException as e:  # noqa: BLE001 -- reported as a failure
            traceback.print_exc(file=err)
            return None, out.getvalue(), f"{type(e).__name__}: {e}\n{err.getvalue()}"
    return code, out.getvalue(), err.getvalue()


def _snapshot(folder: str) -> dict[str, str]:
    """Every entry under ``folder`` (links not followed): its mode, and a regular file's hash."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            out[p] = oct(st.st_mode)
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    out[p] += " " + xxhash.xxh3_64(f.read()).hexdigest()
    return out


class Fuzz:
    def __init__(self, cases: int, seed: int, workdir: str, only: int | None = None) -> None:
        self.cases, self.seed, self.workdir, self.only = cases, seed, workdir, only
        self.base = os.path.join(workdir, "base")
        self.outside = os.path.join(workdir, "outside")
        self.marker = os.path.join(workdir, "PAYLOAD-RAN")
        self.saved: dict[int, str] = {}  # generation -> digest of the state it saved
        self.newest = STEPS

    def make_base(self) -> None:
        log = os.path.join(self.workdir, "base-log.jsonl")
        train(self.base, log, steps=STEPS, every=EVERY, keep_last=KEEP)
        with open(log, encoding="utf-8") as f:
            for line in f:
                e = json.loads(line)
                if e["e"] == "step" and e["saved"]:
                    self.saved[e["step"]] = e["digest"]
        os.makedirs(os.path.join(self.outside, "sub"))
        with open(os.path.join(self.outside, "precious.txt"), "wb") as f:
            f.write(b"a file outside the run that no checkpoint operation may touch\n")

    def restore(self, run: str, layout: bool) -> tuple[str, Any]:
        job = None
        try:
            job = build(run, None, KEEP)
            step = job.ckpt.restore()
            digest = state_digest(job)
            rejected = list(job.ckpt.rejected)
            if layout:  # train on and save: retention and debris cleanup meet the layout
                update(job)
                job.ckpt.step_done(step + 1)
                job.ckpt.save()
            return "ok", (step, digest, rejected)
        except _Timeout:
            raise
        except UnbrokenError as e:
            return "error", e
        except BaseException as e:  # noqa: BLE001 -- judged as a failure
            return "other", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
        finally:
            if job is not None:
                job.ckpt.close()

    def one(self, number: int) -> Outcome:
        rng = random.Random(f"{self.seed}:{number}")
        run = os.path.join(self.workdir, f"case-{number:05d}")
        shutil.copytree(self.base, run, symlinks=True)
        gens = sorted(os.path.join(run, n) for n in os.listdir(run) if n.startswith("gen-"))
        names = sorted(MUTATIONS)
        kind = rng.choices(names, [MUTATIONS[n][0] for n in names])[0]
        case = Case(number, rng, run, gens, self.outside, self.marker)
        try:
            out = Outcome(kind, MUTATIONS[kind][1](case))
            out.older_only = bool(case.target) and case.target != gens[-1]
        except Exception as e:  # noqa: BLE001 -- a broken mutation is the fuzzer's own bug
            out = Outcome(kind, f"mutation failed: {type(e).__name__}: {e}")
            out.failures.append(out.description)
            return out
        before = _snapshot(self.outside)  # including what the mutation placed outside
        try:
            with _deadline(CASE_SECONDS):
                self._judge(case, out)
        except _Timeout:
            out.failures.append(f"hung for more than {CASE_SECONDS} s")
        if os.path.exists(self.marker):
            out.failures.append("a pickle payload ran (the marker file exists)")
            os.unlink(self.marker)
        after = _snapshot(self.outside)
        if after != before:
            changed = sorted(set(before.items()) ^ set(after.items()))
            out.failures.append(f"something outside the run changed: {changed[:6]}")
        shutil.rmtree(run, ignore_errors=True)
        for n in os.listdir(self.outside):  # per-case copies the mutation placed outside
            if n.startswith(("copy-", "same-")):
                p = os.path.join(self.outside, n)
                shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
        if out.failures:
            out.verdict = "FAILED"
        return out

    def _judge(self, case: Case, out: Outcome) -> None:
        codes = {}
        for command in ("verify", "inspect"):
            code, _, err = _cli([command, case.run])
            codes[command] = code
            if code not in (0, 1):
                out.failures.append(f"`unbroken {command}` exited {code}: {err[-600:]}")
            elif "Traceback" in err:
                out.failures.append(f"`unbroken {command}` printed a traceback: {err[-600:]}")
        status, value = self.restore(case.run, case.layout)
        if status == "other":
            out.failures.append(f"restore raised an untyped exception: {value}")
            return
        if status == "error":
            message = str(value)
            out.verdict, out.detail = "refused", f"{type(value).__name__}: {message[:300]}"
            if case.run not in message:
                out.failures.append(f"the error does not name the file: {message[:300]}")
            # "No generation verifies": then `unbroken verify` must have failed too. (Errors
            # from validating state against the live objects are beyond what verify checks.)
            if (isinstance(value, CorruptCheckpoint) and codes["verify"] == 0
                    and "no generation verifies" in message and not case.layout):
                out.failures.append("`unbroken verify` passed a run that restore refused as "
                                    f"corrupt: {message[:300]}")
            return
        step, digest, rejected = value
        if case.every_generation:
            out.failures.append(f"every generation was corrupt, yet restore returned {step}")
        if step not in self.saved:
            out.failures.append(f"restore returned step {step}, which no generation saved")
        elif digest != self.saved[step]:
            out.failures.append(f"restore loaded WRONG DATA: the state restored at step {step} "
                                "differs from what that generation saved")
        if step == self.newest and not rejected:
            out.verdict, out.detail = "loaded", f"generation {step}, state equal"
        else:
            out.verdict = "fell_back"
            out.detail = (f"generation {step}, state equal; rejected "
                          f"{[os.path.basename(p) for p, _ in rejected]}")
            if codes["verify"] == 0 and not case.layout:
                out.failures.append("`unbroken verify` passed a run whose newest generation "
                                    "restore rejected")

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        self.make_base()
        by_kind: dict[str, dict[str, int]] = {
            k: {"cases": 0, "refused": 0, "fell_back": 0, "loaded": 0, "loaded_older_mutated": 0,
                "failures": 0}
            for k in sorted(MUTATIONS)}
        errors: dict[str, int] = {}
        failures: list[dict[str, Any]] = []
        case_log: list[dict[str, Any]] = []
        numbers = [self.only] if self.only is not None else range(self.cases)
        log = logging.getLogger("unbroken")
        level, propagate = log.level, log.propagate
        log.setLevel(logging.CRITICAL)
        log.propagate = False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for n in numbers:
                    o = self.one(n)
                    case_log.append({"case": n, "kind": o.kind, "mutation": o.description,
                                     "verdict": o.verdict, "detail": o.detail})
                    row = by_kind[o.kind]
                    row["cases"] += 1
                    if o.failures:
                        row["failures"] += 1
                        failures.append({"case": n, "kind": o.kind, "mutation": o.description,
                                         "failures": o.failures})
                    else:
                        row[o.verdict] += 1
                        if o.verdict == "loaded" and o.older_only:
                            row["loaded_older_mutated"] += 1
                        if o.verdict == "refused":
                            name = o.detail.split(":", 1)[0]
                            errors[name] = errors.get(name, 0) + 1
        finally:
            log.setLevel(level)
            log.propagate = propagate
        total = {k: sum(r[k] for r in by_kind.values())
                 for k in ("cases", "refused", "fell_back", "loaded", "loaded_older_mutated",
                           "failures")}
        return {"mode": "corrupt", "seed": self.seed, "cases": total["cases"],
                "refused": total["refused"], "fell_back": total["fell_back"],
                "loaded": total["loaded"], "loaded_older_mutated": total["loaded_older_mutated"],
                "failed": total["failures"], "by_kind": by_kind,
                "errors_by_type": dict(sorted(errors.items())), "failures": failures,
                "case_log": case_log,
                "seconds": round(time.monotonic() - started, 2),
                "ok": total["failures"] == 0 and total["cases"] == len(numbers)}


def _skip_hash() -> Callable[[], None]:
    """A loader that trusts sizes and never re-hashes content, on purpose."""
    from .store import GenerationStore

    original = GenerationStore._read_artifact

    def read(self: GenerationStore, folder: str, a: Any) -> bytes:
        return self.fs.read_file(os.path.join(folder, a.name), a.size)

    GenerationStore._read_artifact = read  # type: ignore[method-assign]
    return lambda: setattr(GenerationStore, "_read_artifact", original)


# Known-bad implementations the fuzz must catch (a test of the test: exit status 1).
SABOTAGE: dict[str, Callable[[], Callable[[], None]]] = {"skip-hash": _skip_hash}


def _scratch_dir() -> str:
    """The fuzz checks parsing and validation, not durability: a memory-backed folder
    (/dev/shm) makes it several times faster where one exists."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        try:
            return tempfile.mkdtemp(prefix="unbroken-fuzz-", dir=shm)
        except OSError:
            pass
    return tempfile.mkdtemp(prefix="unbroken-fuzz-")


def corrupt(cases: int, seed: int, workdir: str | None = None, only: int | None = None,
            keep: bool = False, sabotage: str | None = None) -> dict[str, Any]:
    import torch

    prepare_parent()
    torch.set_num_threads(1)
    own = workdir is None
    work = workdir or _scratch_dir()
    os.makedirs(work, exist_ok=True)
    undo = SABOTAGE[sabotage]() if sabotage else None
    try:
        return Fuzz(cases, seed, work, only).run()
    finally:
        if undo is not None:
            undo()
        if own and not keep:
            shutil.rmtree(work, ignore_errors=True)
