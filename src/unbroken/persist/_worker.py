"""The persisting process (`persist.process`): ``python -m unbroken.persist._worker RUN``.

Holds the persister byte of the run's lock for its whole life, reads one JSON request per
save from its standard input (where the snapshot lies in shared memory, and the manifest's
fields), commits, reads back, applies retention, and answers one JSON line. At the end of
its input (the writer closed it, or died) it ends, removing the last segment: a save handed
over before the writer died is finished first."""

from __future__ import annotations

import functools
import json
import mmap
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from .._procs import PERSISTER_OF_ENV
from .._progress import Progress
from ..dist.commit import describe
from ..dist.group import Group
from ..saving import read_back, save_failed
from ..state.incremental import Linked
from ..store.generations import GenerationStore
from ..store.lock import take_persister
from ..store.manifest import Artifact, Manifest
from ..store.retention import Keep
from ..writer import RunWriter


def _copy(path: str, chunk: int = 8 << 20) -> Iterator[bytes]:
    """A linked file's bytes, read again where a link cannot be made."""
    with open(path, "rb") as f:
        while data := f.read(chunk):
            yield data


def _save(store: GenerationStore, request: dict[str, Any]) -> dict[str, Any]:
    step = request["step"]
    with open(request["shm"], "rb") as f:
        shm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        view = memoryview(shm)
        artifacts: dict[str, Any] = {}
        for a in request["artifacts"]:
            if "link" in a:
                source, size, digest = a["link"]
                artifacts[a["name"]] = Linked(source, size, digest,
                                              functools.partial(_copy, source))
            else:
                artifacts[a["name"]] = [view[a["offset"]:a["offset"] + a["size"]]]
        fields = request["manifest"]

        def make_manifest(written: list[Artifact]) -> Manifest:
            return Manifest(artifacts=written, **fields)

        try:
            info = store.commit(step, artifacts, make_manifest, supersede=request["again"])
        except OSError as e:
            raise save_failed(store.root, step, e) from e
        finally:
            artifacts.clear()
            view.release()
    finally:
        shm.close()
    read_back(Group(), store, info, Progress("", 0), request["linked"])
    keep = request["keep"]
    writer = RunWriter(store, Keep(keep["last"], keep["every"],
                                   tuple(keep["best"]) if keep["best"] else None,
                                   keep["aside"]), take_lock=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer.retain(step)
    return {"ok": True, "warnings": [str(w.message) for w in caught]}


def main(root: str) -> None:
    store = GenerationStore(root)
    store.adopt_lock(take_persister(store.root))
    out = sys.stdout.buffer
    last_shm = None
    try:
        for line in sys.stdin.buffer:
            request = json.loads(line)
            last_shm = request["shm"]
            try:
                reply = _save(store, request)
            except Exception as e:  # noqa: BLE001 -- handed to the writer, typed
                reply = {"ok": False, **describe(e)}
            try:
                out.write(json.dumps(reply).encode() + b"\n")
                out.flush()
            except OSError:
                pass  # the writer is gone; the save was finished all the same
    finally:
        if last_shm is not None and str(os.getppid()) != os.environ.get(PERSISTER_OF_ENV):
            try:  # the writer died: the segment is this process's to remove
                os.unlink(last_shm)
            except OSError:
                pass
        store.unlock()


if __name__ == "__main__":
    main(sys.argv[1])
