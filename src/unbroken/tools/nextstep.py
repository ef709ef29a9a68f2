"""Replaying a generation's next-step fixture (`unbroken.fixture`) for ``unbroken verify
--deep --factory MODULE:FUNCTION``.

The factory builds the training objects the way the training script does and returns them in
a dict: ``model`` (required), ``step`` (required: a function taking one batch and doing one
whole update: forward, backward, ``optimizer.step()``, ``scheduler.step()``), and whichever of
``optimizer``, ``scheduler``, ``scaler``, ``data`` (the ResumableLoader), ``extras``,
``generators`` and ``identity`` the run's Checkpointer has. The generation is copied into a
temporary run (the real one is never changed), restored into those objects as a
continuation, one update is taken on the next batch, and the sample ids and the state's
digests are compared with what the training run recorded after that same update."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

from .. import fixture
from .._runview import UsageError
from ..store.generations import GenerationInfo
from ..store.runrecord import RUN_FILE

_PARTS = ("optimizer", "scheduler", "scaler", "data", "extras", "generators", "identity")


def _built(factory: Any, spec: str) -> Mapping[str, Any]:
    built = factory()
    if not isinstance(built, Mapping) or "model" not in built or not callable(built.get("step")):
        raise UsageError(
            f"--factory {spec}: must return a dict with 'model' and 'step' (a function taking "
            "one batch and doing one update), plus the run's other parts by name: "
            f"{', '.join(_PARTS)}")
    return built


def replay(root: str, info: GenerationInfo, factory: Any, spec: str
           ) -> tuple[dict[str, Any] | None, list[str]]:
    """(What was compared, problems) for generation ``info`` of the local run ``root``; (None,
    []) when the run recorded no fixture for it."""
    from ..checkpointer import Checkpointer  # the tools sit above the checkpointer

    recorded = fixture.read(root, info.generation)
    if recorded is None:
        return None, []
    built = _built(factory, spec)
    model, data = built["model"], built.get("data")
    with tempfile.TemporaryDirectory(prefix="unbroken-replay-") as tmp:
        run = os.path.join(tmp, "run")
        os.makedirs(run)
        if os.path.isfile(os.path.join(root, RUN_FILE)):
            shutil.copy2(os.path.join(root, RUN_FILE), run)
        shutil.copytree(info.path, os.path.join(run, os.path.basename(info.path)))
        ckpt = Checkpointer(run, model=model, **{k: built[k] for k in _PARTS if k in built})
        try:
            step = ckpt.restore()
            batch = next(iter(data)) if data is not None else None
            built["step"](batch)
            ckpt.step_done(step + 1)
            ids = getattr(data, "last_update_ids", None)
            got = fixture.state_digests(model, built.get("optimizer"), recorded["schema"])
        finally:
            ckpt.close()
    where = fixture.fixture_path(root, info.generation)
    problems = []
    if recorded["ids"] is not None and (ids is None or [int(i) for i in ids] != recorded["ids"]):
        problems.append(f"{where}: update {recorded['step']} consumed samples "
                        f"{recorded['ids'][:8]}..., the restored run takes "
                        f"{None if ids is None else [int(i) for i in ids][:8]}...: the data "
                        "position does not continue")
    for part in ("model", "optimizer"):
        if part in recorded and recorded[part] != got.get(part):
            problems.append(f"{where}: after update {recorded['step']} the {part} state "
                            f"differs from the training run's (digest {got.get(part)}, "
                            f"recorded {recorded[part]}): restoring generation "
                            f"{info.generation} and taking one update does not continue the "
                            "run")
    return {"step": recorded["step"], "ids_checked": recorded["ids"] is not None,
            "parts": [p for p in ("model", "optimizer") if p in recorded]}, problems


def replay_fixtures(args: argparse.Namespace, store: Any, scanned: list[Any],
                    records: list[dict[str, Any]]) -> None:
    """``--factory``: replay the next-step fixture of every verified generation that has one
    (`replay`); a replay that differs makes the generation fail."""
    from ..store.objects import ObjectStore
    from ._factory import load_factory

    if not args.deep:
        raise UsageError("--factory replays next-step fixtures: it goes with --deep")
    if isinstance(store, ObjectStore):
        raise UsageError(f"{store.root}: next-step fixtures are recorded in local runs only")
    factory = load_factory(args.factory)
    replayed = 0
    for info, rec in zip(scanned, records, strict=True):
        if rec["status"] != "verified":
            continue
        compared, problems = replay(store.root, info, factory, args.factory)
        rec["next_step"] = compared
        replayed += compared is not None
        if problems:
            rec.update(status="corrupt", reason="; ".join(problems), problems=problems)
    if not replayed and any(r["status"] == "verified" for r in records):
        # (asked to replay, and nothing could be: a pass here would read as a replay passed)
        raise UsageError(
            f"{store.root}: --factory replays next-step fixtures, and no verified generation "
            "checked here has one; save with Checkpointer(next_step_fixture=True) to record "
            "them, or drop --factory")
