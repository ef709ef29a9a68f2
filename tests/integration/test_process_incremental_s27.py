"""Incremental saves after a save that failed (session 27), in the three save modes alike:
``async_save=False`` (the training thread), ``True`` (a thread) and ``"process"`` (a
persisting process, with the fault injected into that process, `SITECUSTOMIZE`).

1. A save that fails on ENOSPC while writing (nothing committed) leaves the files the next
   save may link as they were: the next save links the frozen base's stable file again (the
   same file, written by generation 1) and succeeds. Before, the process mode forgot them
   after any failure and wrote the base again in full at every later save: on a nearly full
   disk, ENOSPC at every save from then on, where the other modes failed once.
2. A save whose read-back failed (after its commit: what it linked may be what failed) makes
   the next save write every file anew, in every mode (rot in a linked file, a
   ``SharedFileFailed``, is in ``tests/unit/test_incremental_attacked_s26.py``).

Every restored state is compared bit for bit with the state saved. Every wait is bounded
(`hang_watchdog`)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from _frozen import fresh, train_step
from _persisting import assert_bitwise, gens, restored, snapshot

import unbroken
from unbroken.errors import SaveFailed
from unbroken.state.parts import MORE_FILES, STATE_FILE
from unbroken.store.backends.local import FaultyFS
from unbroken.store.generations import STAGING_PREFIX

pytestmark = pytest.mark.usefixtures("hang_watchdog")  # (60 s a test: nothing may hang)

MODES = {"sync": {}, "thread": {"async_save": True}, "process": {"async_save": "process"}}
WIDTH = 600  # the frozen base: 600 x 600 float32, 1.4 MB (a stable file of its own)
FAULT_ENV = "UNBROKEN_TEST_S27_FAULT"

# Imported at start-up by the persisting processes the tests start (PYTHONPATH, `fault`):
# with $UNBROKEN_TEST_S27_FAULT = "KIND:ERRNO:TEXT", the first operation of that kind
# (`LocalFS`'s ``write``, ``read``, ...) on a path containing TEXT fails with that errno, once
# (a write first writes half its chunk, as a disk that fills up does): `FaultyFS`, in the
# persisting process.
SITECUSTOMIZE = """
import os
_spec = os.environ.get("UNBROKEN_TEST_S27_FAULT", "")
if _spec and os.environ.get("UNBROKEN_PERSISTER_OF"):
    from unbroken.store.backends import local as _local
    _kind, _err, _match = _spec.split(":", 2)
    _op, _failed = _local.LocalFS._op, []

    def _faulty(self, kind, path, before_death=None):
        _op(self, kind, path, before_death)
        if kind == _kind and _match in path and not _failed:
            _failed.append(path)
            if kind == "write" and before_death is not None:
                before_death()  # (half the chunk reached the disk)
            raise OSError(int(_err), os.strerror(int(_err)), path)

    _local.LocalFS._op = _faulty
"""


@pytest.fixture
def fault(tmp_path, monkeypatch):
    """Inject one I/O fault into the save of the mode given: ``fault(mode, kind, err, match)``
    before the Checkpointer is made (the persisting process starts with it); then
    ``install(ckpt)`` for the modes that save in this process (a `FaultyFS`)."""
    folder = tmp_path / "sitecustomize"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)

    def arm(mode: str, kind: str, err: int, match: str):
        if mode == "process":
            monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
                filter(None, (str(folder), os.environ.get("PYTHONPATH")))))
            monkeypatch.setenv(FAULT_ENV, f"{kind}:{err}:{match}")
            return lambda ckpt: None

        def install(ckpt: unbroken.Checkpointer) -> None:
            ckpt.store.fs = FaultyFS(kind=kind, err=err, match=match)

        return install

    return arm


def _stable(gen: Path) -> list[str]:
    return sorted(p.name for p in gen.glob("model.g*.safetensors"))


def _gen(root: Path, n: int) -> Path:
    return root / f"gen-{n:09d}"


def _run(root: Path, mode: str, install, failing: int, match: str) -> dict:
    """Updates 1..4 of the frozen base's model, a save after each; the save of ``failing``
    fails (``match``: the text of the error). The state saved last."""
    model, opt = fresh(WIDTH)
    with unbroken.Checkpointer(root, model=model, optimizer=opt, incremental=True,
                               keep=unbroken.Keep(last=10), **MODES[mode]) as ckpt:
        assert ckpt.restore() == 0
        install(ckpt)
        for step in range(1, 5):
            train_step(model, opt, step)
            ckpt.step_done(step)
            if step == failing:
                with pytest.raises(SaveFailed, match=match):
                    ckpt.save()
                    ckpt.wait()
            else:
                ckpt.save()
                ckpt.wait()
        return snapshot(model, opt)


@pytest.mark.parametrize("mode", list(MODES))
def test_after_a_save_failed_on_enospc_the_next_links_the_frozen_base(tmp_path, fault, mode):
    """Before (``"process"``): generation 4 wrote ``model.g4.safetensors``, the base in full,
    where the other modes linked generation 1's ``model.g1.safetensors``."""
    root = tmp_path / "run"
    install = fault(mode, "write", errno.ENOSPC, f"{STAGING_PREFIX}{3:09d}-")
    saved = _run(root, mode, install, failing=3, match=r"No space left on device \[ENOSPC\]")
    assert gens(root) == [1, 2, 4]
    assert not [n for n in os.listdir(root) if n.startswith(STAGING_PREFIX)]
    origin = _gen(root, 1) / "model.g1.safetensors"
    for n in (2, 4):
        gen = _gen(root, n)
        assert _stable(gen) == ["model.g1.safetensors"], (n, sorted(os.listdir(gen)))
        assert os.path.samefile(gen / "model.g1.safetensors", origin), n  # a link, not a copy
        # its state names the file of generation 1 as the one holding the base
        more = json.loads((gen / STATE_FILE).read_text())[MORE_FILES]["model"]
        assert [(f["file"], f["generation"]) for f in more] == [
            ("model.g1.safetensors", "1")], more
    assert os.stat(origin).st_nlink == 3  # generations 1, 2 and 4: no other copy
    step, got = restored(root, lambda: fresh(WIDTH))
    assert step == 4
    assert_bitwise(got, saved)


@pytest.mark.parametrize("mode", list(MODES))
def test_after_a_read_back_failed_the_next_save_writes_every_file(tmp_path, fault, mode):
    """The generation committed, then did not read back (a file it wrote unreadable): what it
    linked may be what failed, so the next save links nothing (the process mode forgets the
    files it may link on the persisting process's word that the failure came after its
    commit)."""
    root = tmp_path / "run"
    install = fault(mode, "read", errno.EIO, f"gen-{3:09d}/model.safetensors")
    saved = _run(root, mode, install, failing=3, match="did not read back as written")
    assert gens(root) == [1, 2, 4]
    assert _stable(_gen(root, 2)) == ["model.g1.safetensors"]
    assert _stable(_gen(root, 4)) == ["model.g4.safetensors"]  # written anew
    assert not os.path.samefile(_gen(root, 4) / "model.g4.safetensors",
                                _gen(root, 1) / "model.g1.safetensors")
    step, got = restored(root, lambda: fresh(WIDTH))
    assert step == 4
    assert_bitwise(got, saved)


NOLINK = """
import os
if os.environ.get("UNBROKEN_PERSISTER_OF"):
    def _nolink(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted (no hard links here)")
    os.link = _nolink
"""


def test_a_rotted_stable_file_where_links_cannot_be_made_fails_one_save_only(
        tmp_path, monkeypatch):
    """Process mode on a filesystem without hard links: the stable file the next save would
    link rotted (size and time kept), so writing it anew from there does not hash as the file
    it replaces. That save fails (a `SharedFileFailed`), and the next writes every file anew
    and succeeds; before, every later save failed the same way."""
    folder = tmp_path / "sitecustomize"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(NOLINK)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, (str(folder), os.environ.get("PYTHONPATH")))))
    root = tmp_path / "run"
    model, opt = fresh(WIDTH)
    failed = []
    with unbroken.Checkpointer(root, model=model, optimizer=opt, incremental=True,
                               keep=unbroken.Keep(last=10), async_save="process") as ckpt:
        assert ckpt.restore() == 0
        for step in range(1, 6):
            train_step(model, opt, step)
            ckpt.step_done(step)
            if step == 3:  # generation 2's copy of the base rots
                (stable,) = _gen(root, 2).glob("model.g*.safetensors")
                st = os.stat(stable)
                data = bytearray(stable.read_bytes())
                data[len(data) // 2] ^= 0xFF
                stable.write_bytes(bytes(data))
                os.utime(stable, ns=(st.st_atime_ns, st.st_mtime_ns))
            try:
                ckpt.save()
                ckpt.wait()
            except SaveFailed as e:
                failed.append((step, type(e).__name__))
        saved = snapshot(model, opt)
    assert failed == [(3, "SharedFileFailed")], failed
    assert gens(root)[-2:] == [4, 5]
    step, got = restored(root, lambda: fresh(WIDTH))
    assert step == 5
    assert_bitwise(got, saved)
