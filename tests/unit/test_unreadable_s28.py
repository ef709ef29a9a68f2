"""A generation this machine may not read (permission denied, no file descriptors or memory
left) is not a corrupt one (session 28's outside review): it was moved aside as corrupt and
the restore rolled back over it in silence, three updates lost; verify called it corrupt
(exit 1). Now nothing is judged or moved: the restore raises `RunUnreadable` naming the file,
verify reports it ``unreadable`` with exit 2, and retention neither deletes it nor counts it
as a kept copy. (The errors are injected at the file system layer: the tests run as root,
whom permissions do not stop; one test drops that capability where ``setpriv`` exists.)"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import unbroken
from unbroken.cli import main
from unbroken.errors import RunUnreadable
from unbroken.store.backends.local import LocalFS
from unbroken.store.verifying import MACHINE_ERRNOS

NEWEST = "gen-000000003"


def _save(run: Path, steps: list[int], keep: int = 5) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    ckpt = unbroken.Checkpointer(run, model=model, keep=unbroken.Keep(last=keep),
                                 read_back="sync")
    ckpt.restore()
    for step in steps:
        with torch.no_grad():
            model.weight.add_(1.0)
        ckpt.save(step)
    ckpt.close()
    return model


def _deny(monkeypatch: pytest.MonkeyPatch, code: int, where: str = NEWEST) -> None:
    """Every read of a file under ``where`` fails with ``code``."""
    def failing(name: str) -> Any:
        real = getattr(LocalFS, name)

        def call(self: LocalFS, path: str, *a: Any, **k: Any) -> Any:
            if f"/{where}/" in path:
                raise OSError(code, os.strerror(code), path)
            return real(self, path, *a, **k)
        return call
    for name in ("read_hashed", "hash_file", "map_file", "read_file"):
        monkeypatch.setattr(LocalFS, name, failing(name))


@pytest.mark.parametrize("code", sorted(MACHINE_ERRNOS))
def test_a_restore_raises_and_moves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            code: int) -> None:
    run = tmp_path / "run"
    _save(run, [1, 2, 3])
    _deny(monkeypatch, code)
    ckpt = unbroken.Checkpointer(run, model=torch.nn.Linear(4, 4))
    with pytest.raises(RunUnreadable) as e:
        ckpt.restore()
    ckpt.close()
    assert f"{NEWEST}/" in str(e.value) and errno.errorcode[code] in str(e.value)
    assert "not judged" in str(e.value)
    assert sorted(os.listdir(run)) == ["LOCK", "RUN.json", "gen-000000001", "gen-000000002",
                                       NEWEST]  # nothing aside


def test_an_io_error_is_still_corruption_and_falls_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    _save(run, [1, 2, 3])
    _deny(monkeypatch, errno.EIO)
    ckpt = unbroken.Checkpointer(run, model=torch.nn.Linear(4, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ckpt.restore() == 2
    ckpt.close()
    assert [n for n in os.listdir(run / "aside")][0].startswith(f"{NEWEST}-corrupt-")


def test_verify_says_unreadable_with_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    _save(run, [1, 2, 3])
    _deny(monkeypatch, errno.EACCES)
    capsys.readouterr()
    assert main(["verify", str(run), "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert [g["status"] for g in doc["generations"]] == ["verified", "verified", "unreadable"]
    assert main(["verify", str(run)]) == 2
    assert "unreadable" in capsys.readouterr().out


def test_retention_neither_deletes_nor_counts_an_unreadable_generation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    model = _save(run, [1, 2, 3], keep=5)
    _deny(monkeypatch, errno.EACCES, "gen-000000002")
    ckpt = unbroken.Checkpointer(run, model=model, keep=unbroken.Keep(last=1),
                                 read_back="sync")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ckpt.restore() == 3
        ckpt.save(4)
    ckpt.close()
    # gen 1 and 3: let go by Keep(last=1); gen 2, unreadable, left as it is, and said
    assert sorted(os.listdir(run)) == ["LOCK", "RUN.json", "gen-000000002", "gen-000000004"]
    assert any("may not read" in str(w.message) and "gen-000000002" in str(w.message)
               for w in caught)


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_a_real_permission_denied_folder(tmp_path: Path) -> None:
    """The real thing: a generation folder without search permission, read by a process that
    permissions do stop (root without CAP_DAC_OVERRIDE)."""
    run = tmp_path / "run"
    _save(run, [1, 2, 3])
    os.chmod(run / NEWEST, 0o644)
    script = ("import sys, torch, unbroken\n"
              "from unbroken.errors import RunUnreadable\n"
              f"c = unbroken.Checkpointer({str(run)!r}, model=torch.nn.Linear(4, 4))\n"
              "try:\n    c.restore()\nexcept RunUnreadable as e:\n    print('raised', e)\n"
              "else:\n    print('restored')\n")
    try:
        out = subprocess.run(["setpriv", "--bounding-set", "-dac_override,-dac_read_search",
                              sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=120)
    finally:
        os.chmod(run / NEWEST, 0o755)
    assert out.stdout.startswith("raised"), out.stdout + out.stderr
    assert "Permission denied" in out.stdout and "aside" not in os.listdir(run)


def test_a_read_back_this_machine_cannot_do_fails_the_save_and_moves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The review of this session's fix: a read-back that met EMFILE raised RunUnreadable out
    of save() (not a SaveFailed), and saving the step again moved the committed generation
    aside as abandoned. Now the save fails as a SaveFailed, the generation stays in place, and
    a save of the step again supersedes it."""
    from unbroken.errors import SaveFailed

    run = tmp_path / "run"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    ckpt = unbroken.Checkpointer(run, model=model, read_back="sync")
    ckpt.restore()
    ckpt.save(1)
    real, failing = LocalFS.hash_file, [True]

    def once(self: LocalFS, path: str, *a: Any, **k: Any) -> Any:
        if "/gen-000000002/" in path and failing:
            failing.clear()
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), path)
        return real(self, path, *a, **k)

    monkeypatch.setattr(LocalFS, "hash_file", once)
    with pytest.raises(SaveFailed, match="left in place unverified") as e:
        ckpt.save(2)
    assert "EMFILE" in str(e.value)
    assert "gen-000000002" in os.listdir(run) and "aside" not in os.listdir(run)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt.save(2)  # the step again: written anew, the unverified one superseded
    ckpt.close()
    aside = os.listdir(run / "aside") if (run / "aside").exists() else []
    assert not [n for n in aside if "abandoned" in n], aside  # superseded, never abandoned
    again = unbroken.Checkpointer(run, model=torch.nn.Linear(4, 4))
    assert again.restore() == 2
    again.close()


def test_a_job_agrees_on_what_one_rank_could_not_read_back() -> None:
    """A rank that could not read its share back told the others nothing and left: they
    agreed alone, or waited for it until the timeout. Now the verdict is gathered."""
    from unbroken.dist import commit

    class TwoRanks:
        active, leader, rank = True, True, 0

        def all_gather(self, mine: Any, what: str) -> list[Any]:
            return [mine, {"unreadable": "gen-000000002/rank00001.rng.safetensors: cannot be "
                                         "read (Too many open files [EMFILE])"}]

    class Store:
        def verify(self, *a: Any, **k: Any) -> None:
            return None

    corrupt, unread = commit.verify_own(TwoRanks(), Store(), None, set())  # type: ignore[arg-type]
    assert corrupt == [] and unread == [
        "rank 1: gen-000000002/rank00001.rng.safetensors: cannot be read (Too many open files "
        "[EMFILE])"]


@pytest.mark.parametrize("command", ["export", "diff", "verify"])
def test_commands_never_fall_back_past_a_generation_folder_they_may_not_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        command: str) -> None:
    """The review of this session's fix: with the newest generation folder unreadable,
    `export` exported the one before it and `diff` compared that one with itself, exit 0."""
    run = tmp_path / "run"
    _save(run, [1, 2, 3])
    real, target = os.lstat, str(run / NEWEST / "MANIFEST.json")

    def lstat(path: Any, *a: Any, **k: Any) -> Any:
        if os.fspath(path) == target:
            raise PermissionError(errno.EACCES, "Permission denied", target)
        return real(path, *a, **k)

    monkeypatch.setattr(os, "lstat", lstat)
    args = {"export": ["export", str(run), str(tmp_path / "out")],
            "diff": ["diff", str(run / "gen-000000002"), str(run)],
            "verify": ["verify", str(run)]}[command]
    capsys.readouterr()
    assert main([*args, "--json"]) == 2
    assert "Permission denied" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("error", [TimeoutError("read timed out"),
                                   ConnectionResetError(errno.ECONNRESET, "reset by peer")])
def test_an_object_store_that_does_not_answer_is_not_corruption(
        monkeypatch: pytest.MonkeyPatch, error: OSError) -> None:
    """The review of this session's fix: a timeout or a reset connection while reading the
    newest generation from a store moved it aside as corrupt (a store that did not answer
    says nothing of the bytes)."""
    import uuid

    import fsspec

    from unbroken.store.backends.objects import ObjectFS

    run = f"memory://bucket/{uuid.uuid4().hex}"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    ckpt = unbroken.Checkpointer(run, model=model, read_back="sync")
    ckpt.restore()
    for step in (1, 2, 3):
        ckpt.save(step)
    ckpt.close()
    for name in ("read_hashed", "hash_file", "read_file"):
        real = getattr(ObjectFS, name)

        def call(self: Any, path: str, *a: Any, _real: Any = real, **k: Any) -> Any:
            if "/gen-000000003/u-" in str(path):
                raise error
            return _real(self, path, *a, **k)
        monkeypatch.setattr(ObjectFS, name, call)
    ckpt = unbroken.Checkpointer(run, model=torch.nn.Linear(4, 4))
    with pytest.raises(RunUnreadable, match="cannot be read"):
        ckpt.restore()
    ckpt.close()
    assert not fsspec.filesystem("memory").find(run[len("memory://"):] + "/aside")


def test_a_run_record_this_machine_cannot_read_is_never_rewritten(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The review of this session's fix: RUN.json unreadable (EMFILE) was taken for damaged,
    and the next save wrote it anew without the run's lineage."""
    run = tmp_path / "run"
    _save(run, [1])
    before = (run / "RUN.json").read_bytes()
    _deny(monkeypatch, errno.EMFILE, where="run")  # (every file under the run folder)
    with pytest.raises(RunUnreadable, match="RUN.json: cannot be read"):
        unbroken.Checkpointer(run, model=torch.nn.Linear(4, 4))
    monkeypatch.undo()
    assert (run / "RUN.json").read_bytes() == before
