"""A fuzz case (the copied run a mutation edits, with the helpers mutations share) and how
mutations register in a catalogue with their draw weights."""

from __future__ import annotations

import json
import os
import random
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ..store.manifest import MANIFEST, seal


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
    # A second, independently trained run (another run id): its folder, and the digest of the
    # state each of its generations saved, by step.
    other_run: str = ""
    other_saved: dict[int, str] = field(default_factory=dict)
    foreign: dict[int, str] = field(default_factory=dict)  # steps copied in from other_run
    adopt: bool = False  # restore(adopt=True): a foreign generation may then load
    newest: int | None = None  # the newest step on disk, when the mutation added one
    no_whole_read: set[str] = field(default_factory=set)  # files nothing may read whole

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

    def save_manifest(self, gen: str, doc: Any, sealed: bool = True) -> None:
        """Write an edited manifest: ``sealed`` with a correct checksum (as a tool or an
        attacker would), so that the edit reaches the checks behind the manifest's own
        checksum; or as a plain edit, which that checksum refuses."""
        data = seal(doc) if sealed and isinstance(doc, dict) else json.dumps(
            doc, sort_keys=True, separators=(",", ":")).encode()
        self.write(gen, MANIFEST, data)

    def restamp(self, gen: str, name: str) -> None:
        """Make the manifest agree with a mutated file (size and hash) and reseal it, so that
        the mutation reaches the decoders behind the hash check."""
        doc = self.manifest(gen)
        h = xxhash.xxh3_128()
        size = 0
        with open(os.path.join(gen, name), "rb") as f:  # streaming: some files are sparse GiBs
            while chunk := f.read(8 << 20):
                h.update(chunk)
                size += len(chunk)
        for entry in doc["artifacts"]:
            if entry["name"] == name:
                entry["size"], entry["xxh3_128"] = size, h.hexdigest()
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


def header_end(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


Mutation = Callable[[Case], str]
Catalogue = dict[str, tuple[int, Mutation]]


def registrar(catalogue: Catalogue) -> Callable[[str, int], Callable[[Mutation], Mutation]]:
    """The ``@mutation(name, weight)`` decorator that adds a mutation to ``catalogue``."""
    def mutation(name: str, weight: int = 1) -> Callable[[Mutation], Mutation]:
        def register(fn: Mutation) -> Mutation:
            catalogue[name] = (weight, fn)
            return fn
        return register
    return mutation
