"""Mutations of whole parts of a run: oversized parts that must be refused by their size,
before anything reads them whole (a sparse state.json over the state limit, a safetensors
header over the header limit in a file that really holds that many bytes, a sparse tensor
file larger than this machine's memory), and a generation copied in from another run."""

from __future__ import annotations

import os
import shutil
import struct

from ..state.parts import MAX_STATE_BYTES
from ..state.tensorfile import MAX_HEADER_BYTES
from ..store.generations import generation_name
from ._case import Case, Catalogue, registrar

STATE = "state.json"

PARTS: Catalogue = {}
mutation = registrar(PARTS)


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 40


@mutation("oversized-part", 2)
def _oversized_part(c: Case) -> str:
    g = c.pick_target()
    how = c.rng.choice(["state-json-sparse", "header-claim", "tensor-beyond-memory"])
    if how == "state-json-sparse":
        path = os.path.join(g, STATE)
        size = MAX_STATE_BYTES + c.rng.choice([1, 8, 1 << 20])
        os.truncate(path, size)  # the JSON, then a hole of zeros
        c.restamp(g, STATE)  # its true size and hash: only the size limit can refuse it
        c.no_whole_read.add(path)
        return (f"{os.path.basename(g)}/{STATE} is a sparse {size}-byte file (limit "
                f"{MAX_STATE_BYTES}), listed with its size and hash (resealed)")
    name = c.rng.choice(c.tensor_files(g))
    path = os.path.join(g, name)
    if how == "header-claim":
        claim = MAX_HEADER_BYTES + 8 * c.rng.randrange(1, 4)
        with open(path, "r+b") as f:
            f.write(struct.pack("<Q", claim))
        os.truncate(path, 8 + claim + c.rng.choice([0, 64, 4096]))  # it holds what it claims
        c.restamp(g, name)
        return (f"{os.path.basename(g)}/{name}: header length {claim} (limit "
                f"{MAX_HEADER_BYTES}) in a sparse file that holds it, resealed")
    size = 2 * _memory_bytes() + c.rng.choice([0, 1 << 20, 1 << 30])
    os.truncate(path, size)
    doc = c.manifest(g)
    for entry in doc["artifacts"]:
        if entry["name"] == name:
            entry["size"] = size  # the hash stays: no one could compute it in time
    c.save_manifest(g, doc)
    c.no_whole_read.add(path)
    return (f"{os.path.basename(g)}/{name} is a sparse {size}-byte file (twice this "
            "machine's memory), listed with that size (resealed)")


@mutation("foreign-generation", 3)
def _foreign(c: Case) -> str:
    """A generation of another run (another run id, another state) copied into the run: as a
    newer step, or in place of one of its own. Restore must refuse it as foreign, unless
    ``adopt=True`` (one case in four), which must then load exactly what that run saved."""
    how = c.rng.choice(["newer", "replace-newest", "replace-older"])
    c.adopt = c.rng.random() < 0.25
    if how == "newer":
        step = max(c.other_saved)
        dest = os.path.join(c.run, generation_name(step))
        c.newest = step
    else:
        dest = c.gens[-1] if how == "replace-newest" else c.rng.choice(c.gens[:-1])
        step = int(os.path.basename(dest).split("-")[1])
        shutil.rmtree(dest)
        c.target = dest
    shutil.copytree(os.path.join(c.other_run, generation_name(step)), dest)
    c.foreign[step] = c.other_saved[step]
    return (f"{os.path.basename(dest)} of another run copied in ({how})"
            + (", restore(adopt=True)" if c.adopt else ""))
