"""Retention attacked (session 27), with real run folders:

1. a generation whose deletion was interrupted (its manifest deleted first, its files left)
   between two kept ones (an ``every`` milestone older than it) is deleted by the next
   retention, not left for good (its bytes leaked, and ``unbroken verify`` failed the run
   for it at every later run);
2. an ``every`` milestone that rotted is reported and moved aside as corrupt, as a rotted
   last-N or best generation is, instead of being kept silently as a copy nothing can
   restore; after a restart (no verdicts in memory) the milestones are hashed a few at a
   time, about the bytes of the generation just saved per save, never all at once."""

from __future__ import annotations

import os
import shutil
import warnings

import torch

import unbroken
from unbroken.errors import UnbrokenWarning
from unbroken.store.verifying import Verifying


def _names(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("gen-"))


def _aside(root) -> list[str]:
    folder = os.path.join(root, "aside")
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def _train(root, steps: range, keep: unbroken.Keep, restore: bool = False):
    """A tiny model trained and saved at each step of ``steps``; the UnbrokenWarnings said."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnbrokenWarning)
        with unbroken.Checkpointer(root, model=model, optimizer=opt, keep=keep,
                                   read_back="sync") as ck:
            if restore:
                ck.restore()
            for s in steps:
                model(torch.randn(2, 64)).sum().backward()
                opt.step()
                opt.zero_grad()
                ck.save(s)
    return [str(w.message) for w in caught if issubclass(w.category, UnbrokenWarning)]


def _flip(path: str) -> None:
    """One byte of a tensor's data changed in place (size kept)."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))


def test_interrupted_deletion_between_kept_generations_is_finished(tmp_path):
    root = tmp_path / "run"
    keep = unbroken.Keep(last=1, every=4)
    _train(root, range(1, 6), keep)
    shutil.copytree(root / "gen-000000005", tmp_path / "five")
    _train(root, range(6, 7), keep, restore=True)
    assert _names(root) == ["gen-000000004", "gen-000000006"]
    # What a kill during the deletion of generation 5 (by the save of 6) leaves: its manifest
    # (deleted first) gone, its files there, between 4 (a milestone) and 6.
    shutil.copytree(tmp_path / "five", root / "gen-000000005")
    os.unlink(root / "gen-000000005" / "MANIFEST.json")
    _train(root, range(7, 8), keep, restore=True)
    assert _names(root) == ["gen-000000004", "gen-000000007"]


def test_rotted_milestone_is_moved_aside_as_corrupt(tmp_path):
    root = tmp_path / "run"
    keep = unbroken.Keep(last=1, every=2)
    _train(root, range(1, 5), keep)
    assert _names(root) == ["gen-000000002", "gen-000000004"]
    _flip(str(root / "gen-000000002" / "model.safetensors"))
    said = _train(root, range(5, 6), keep, restore=True)
    assert _names(root) == ["gen-000000004", "gen-000000005"]
    assert [n.split("-corrupt-")[0] for n in _aside(root)] == ["gen-000000002"]
    assert any("corrupt" in m and "gen-000000002" in m for m in said), said


def test_milestones_are_hashed_a_few_at_a_time_after_a_restart(tmp_path, monkeypatch):
    root = tmp_path / "run"
    keep = unbroken.Keep(last=1, every=1)  # (every generation a milestone: all kept)
    _train(root, range(1, 9), keep)
    for g in (1, 3):  # rotted without a trace in mtime: only a hash finds them
        path = str(root / f"gen-00000000{g}" / "model.safetensors")
        st = os.stat(path)
        _flip(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    hashed: list[list[str]] = []
    real = Verifying.hashed_verdict

    def counting(self, info):
        hashed[-1].append(info.name)
        return real(self, info)

    monkeypatch.setattr(Verifying, "hashed_verdict", counting)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnbrokenWarning)
        with unbroken.Checkpointer(root, model=model, optimizer=opt, keep=keep,
                                   read_back="sync") as ck:
            hashed.append([])
            ck.restore()
            for s in range(9, 17):
                hashed.append([])
                ck.save(s)
                assert len(hashed[-1]) <= 1, hashed  # (the generations are of one size)
    # Every milestone this process had not verified (the restore verified 8, each save its
    # own generation) hashed once, newest first, the rotted ones moved aside.
    every = [n for saves in hashed for n in saves]
    assert every == [f"gen-{g:09d}" for g in range(7, 0, -1)], hashed
    assert [n.split("-corrupt-")[0] for n in _aside(root)] == ["gen-000000001", "gen-000000003"]
    assert _names(root) == [f"gen-{g:09d}" for g in (2, *range(4, 17))]


def test_inspect_names_the_best_generation(tmp_path, capsys):
    """`unbroken inspect` says which generation the ``best`` rule ranks first (NaN and
    missing values rank nowhere; ties: the newest), in its table and its JSON."""
    import json

    from unbroken.cli import main as cli_main

    root = tmp_path / "run"
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    keep = unbroken.Keep(last=3, best=("val", "min"))
    with unbroken.Checkpointer(root, model=model, optimizer=opt, keep=keep,
                               read_back="sync") as ck:
        for step, val in enumerate([3.0, 1.0, 2.0, float("nan"), 1.0], 1):
            ck.save(step, metrics={"val": val})
    assert _names(root) == [f"gen-{g:09d}" for g in (3, 4, 5)]  # (5 is the best now: a tie)
    assert cli_main(["inspect", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["best"] == {"metric": "val", "mode": "min", "generation": 5}
    assert [(g["generation"], g["best"]) for g in doc["generations"]] == [
        (3, False), (4, False), (5, True)]
    assert cli_main(["inspect", str(root)]) == 0
    text = capsys.readouterr().out
    assert "best by val (min): generation 5" in text and "complete (best)" in text


def test_the_leader_of_a_job_hashes_milestones_at_its_share_of_each_save():
    """In a job the leader hashes milestones alone: each save adds its bytes per rank (a
    generation of 2 ranks: half its size), so a milestone of its size is hashed every
    second save, not at each."""
    from types import SimpleNamespace

    from unbroken.writer import RunWriter

    def info(n: int, world: int = 2) -> SimpleNamespace:
        artifacts = [SimpleNamespace(size=60), SimpleNamespace(size=40)]
        return SimpleNamespace(generation=n, manifest=SimpleNamespace(
            artifacts=artifacts, world_size=world))

    writer = RunWriter.__new__(RunWriter)
    writer.store = SimpleNamespace(hash_needed=lambda i: True)
    writer._credit = 0
    milestones = {n: info(n) for n in (2, 4, 6)}
    hashed: list[int] = []
    for save in range(6):
        unchecked = set(milestones) - set(hashed)
        writer._check_milestones(milestones, unchecked, info(10 + save), hashed.append)
        assert len(hashed) == (save + 1) // 2, (save, hashed)
    assert hashed == [6, 4, 2]
