"""The next-step fixture: a known "load and take one more update" result for a generation.

With ``Checkpointer(next_step_fixture=True)``, the update right after a save records what it
consumed and what it produced: the sample ids of update N+1 and the content digests of the
model and optimizer state after it, in ``RUN/fixtures/gen-NNNNNNNNN.json`` (N the saved
generation). ``unbroken verify RUN --deep --factory MODULE:FUNCTION`` then rebuilds the
training objects with the user's factory, restores generation N into them (from a copy: the
run is never changed), takes that one update and compares: a generation that verifies byte
for byte can still fail here when what it holds does not continue the run (a part missing from
the save, a restored value the code never applies). Local runs of one process; the newest
``KEEP`` fixtures are kept."""

from __future__ import annotations

import json
import os
import re
import uuid
from typing import Any

from .errors import CorruptCheckpoint
from .state._digest import device_form_1, digest_tree

FIXTURES = "fixtures"
SCHEMA = "unbroken.fixture/2"
# Schema 1: recorded before 2026-12-05, its digests of tensors off the CPU in their old form
# (`_digest.device_form_1`); compared in that form. (Quantized and nested tensors digested
# otherwise then too, without their scales and splits: a schema-1 fixture of a state holding
# them reads as differing; record it again.)
_SCHEMAS = ("unbroken.fixture/1", SCHEMA)
KEEP = 16
MAX_FIXTURE_BYTES = 16 << 20
_NAME = re.compile(r"gen-([0-9]{9,})\.json", re.ASCII)


def fixture_path(root: str, generation: int) -> str:
    return os.path.join(root, FIXTURES, f"gen-{generation:09d}.json")


def state_digests(model: Any, optimizer: Any, schema: str = SCHEMA) -> dict[str, str]:
    """What the fixture compares: the model's and the optimizer's state, by content, as a
    fixture of ``schema`` holds them."""
    if schema != SCHEMA:
        with device_form_1():
            return state_digests(model, optimizer)
    out = {"model": digest_tree(model.state_dict())}
    if optimizer is not None:
        out["optimizer"] = digest_tree(optimizer.state_dict())
    return out


def record(root: str, generation: int, step: int, ids: Any, digests: dict[str, str]) -> None:
    """Write the fixture of ``generation`` (atomically: a temporary file renamed into place),
    then drop all but the newest `KEEP`."""
    folder = os.path.join(root, FIXTURES)
    os.makedirs(folder, exist_ok=True)
    doc = {"schema": SCHEMA, "generation": generation, "step": step,
           "ids": [int(i) for i in ids] if ids is not None else None, **digests}
    tmp = os.path.join(folder, f".tmp-{uuid.uuid4().hex[:12]}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, fixture_path(root, generation))
    numbers = sorted(int(m.group(1)) for n in os.listdir(folder) if (m := _NAME.fullmatch(n)))
    for old in numbers[:-KEEP]:
        try:
            os.unlink(fixture_path(root, old))
        except OSError:
            pass


def read(root: str, generation: int) -> dict[str, Any] | None:
    """The fixture of ``generation``, None when none was recorded; `CorruptCheckpoint` when
    it cannot be used."""
    path = fixture_path(root, generation)
    if not os.path.isfile(path):
        return None
    try:
        if os.path.getsize(path) > MAX_FIXTURE_BYTES:
            raise ValueError(f"over {MAX_FIXTURE_BYTES} bytes")
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"{path}: unreadable next-step fixture ({e})") from None
    if not isinstance(doc, dict) or doc.get("schema") not in _SCHEMAS or \
            doc.get("generation") != generation or type(doc.get("step")) is not int or \
            not isinstance(doc.get("model"), str):
        raise CorruptCheckpoint(f"{path}: not a next-step fixture of generation {generation} "
                                f"(schema {SCHEMA})")
    return doc
