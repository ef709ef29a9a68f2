"""I/O faults through the storage seam (`unbroken.store.backends.local.FaultyFS`): ENOSPC or EIO
on every mutating operation of a save in turn — each write, fsync, mkdir, rename and unlink of the
commit and of retention — and on reads.

Whatever fails: `save()` raises the typed `SaveFailed` (naming the file and the error) while
the generation is not committed, or warns while only retention failed after the commit;
earlier generations stay intact and verified; no staging debris is left; training goes on and
the next save succeeds; a fresh process-level restore returns the newest good generation."""

from __future__ import annotations

import errno
import os
import shutil
import warnings

import pytest
import torch

import unbroken
from unbroken.errors import SaveFailed, UnbrokenWarning
from unbroken.store.aside import ASIDE
from unbroken.store.backends.killpoints import MUTATING
from unbroken.store.backends.local import FaultyFS, LocalFS
from unbroken.store.generations import STAGING_PREFIX, TRASH_PREFIX, GenerationStore


def make(root):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = unbroken.Checkpointer(root, model=model, optimizer=opt, keep=unbroken.Keep(last=2))
    return ckpt, model, opt


def update(model, opt, step):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def snapshot(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
             for i, s in enumerate(opt.state.values())})


def same(a, b):
    (ma, oa), (mb, ob) = a, b
    return (ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
            and oa.keys() == ob.keys()
            and all(torch.equal(x, ob[i][k]) if torch.is_tensor(x) else x == ob[i][k]
                    for i in oa for k, x in oa[i].items()))


def files_of(root, generation):
    store = GenerationStore(root)
    return store.read_verified(store.scan_one(generation))


def debris(root):
    return sorted(n for n in os.listdir(root) if n.startswith((STAGING_PREFIX, TRASH_PREFIX)))


@pytest.fixture
def base(fast_tmp):
    """A run with generations 1 and 2 (Keep(last=2): the save of 3 deletes 1)."""
    root = fast_tmp / "base"
    ckpt, model, opt = make(root)
    assert ckpt.restore() == 0
    for step in (1, 2):
        update(model, opt, step)
        ckpt.step_done(step)
        ckpt.save()
    ckpt.close()
    return root


def save_ops(root):
    """The operations of the third save, in order, recorded by a FaultyFS that never fails."""
    ckpt, model, opt = make(root)
    assert ckpt.restore() == 2
    update(model, opt, 3)
    ckpt.step_done(3)
    ckpt.store.fs = fs = FaultyFS(nth=10 ** 9)
    ckpt.save()
    ckpt.close()
    return fs.ops


def test_every_operation_of_a_save_fails_in_turn(base, fast_tmp):
    probe = fast_tmp / "probe"
    shutil.copytree(base, probe)
    ops = [op for op in save_ops(probe) if op[0] in MUTATING]
    kinds = {k for k, _ in ops}
    assert {"mkdir", "create", "write", "fsync", "fsync_dir", "rename", "unlink",
            "rmdir"} <= kinds, kinds
    rename = next(i for i, (k, p) in enumerate(ops) if k == "rename" and STAGING_PREFIX in p)
    committed_at = rename + 2  # the rename, then the fsync of the run folder
    problems = []
    outcomes = {"SaveFailed": 0, "retention warning": 0}
    for err in (errno.ENOSPC, errno.EIO):
        for i, (kind, path) in enumerate(ops):
            run = fast_tmp / f"case-{err}-{i}"
            shutil.copytree(base, run)
            where = f"{errno.errorcode[err]} at operation {i + 1} ({kind} {os.path.basename(path)})"
            try:
                outcome = _one_fault(run, i + 1, err, committed=i >= committed_at)
                outcomes[outcome] += 1
            except AssertionError as e:
                problems.append(f"{where}: {e}")
            shutil.rmtree(run)
    assert not problems, "\n".join(problems[:20])
    assert outcomes["SaveFailed"] == 2 * committed_at
    assert outcomes["retention warning"] == 2 * (len(ops) - committed_at)


def _one_fault(run, nth, err, committed):
    ckpt, model, opt = make(run)
    assert ckpt.restore() == 2
    before = {g: files_of(run, g) for g in (1, 2)}
    update(model, opt, 3)
    ckpt.step_done(3)
    state3 = snapshot(model, opt)
    ckpt.store.fs = fs = FaultyFS(nth=nth, err=err)
    if not committed:
        try:
            ckpt.save()
            ckpt.wait()
        except SaveFailed as e:
            failed = e
        else:
            raise AssertionError("save() did not raise SaveFailed")
        assert isinstance(failed.__cause__, OSError) and failed.__cause__.errno == err
        assert os.strerror(err) in str(failed), str(failed)
        assert fs.failed and fs.failed[0][1] in str(failed), (str(failed), fs.failed)
        outcome = "SaveFailed"
        assert not (run / "gen-000000003").exists(), "a failed save left its generation"
        assert {g: files_of(run, g) for g in (1, 2)} == before, "older generations changed"
        assert debris(run) == [], f"staging debris left: {debris(run)}"
        assert same(snapshot(model, opt), state3), "the failed save changed live state"
        ckpt.store.fs = LocalFS()
        assert ckpt.save() is not None, "retrying the same step after the disk recovered"
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            info = ckpt.save()  # committed: only retention's deletion failed
            ckpt.wait()  # (retention follows the read-back, in the background)
        assert info is not None and info.generation == 3
        assert any(issubclass(w.category, UnbrokenWarning) and "retention" in str(w.message)
                   for w in caught), [str(w.message) for w in caught]
        outcome = "retention warning"
        assert files_of(run, 2) == before[2]
        ckpt.store.fs = LocalFS()
    files_of(run, 3)  # committed and verified either way now
    # Training goes on and the next save succeeds, and cleans up what retention left.
    update(model, opt, 4)
    ckpt.step_done(4)
    assert ckpt.save() is not None
    state4 = snapshot(model, opt)
    ckpt.close()
    store = GenerationStore(run)
    assert [(g.generation, g.status) for g in store.scan()] == [(3, "complete"),
                                                                (4, "complete")]
    assert debris(run) == [], debris(run)
    # A fresh Checkpointer (what a restarted process builds) restores the newest generation.
    again, model2, opt2 = make(run)
    assert again.restore() == 4
    assert same(snapshot(model2, opt2), state4)
    again.close()
    return outcome


@pytest.mark.parametrize("kind", ["write", "fsync", "rename"])
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_first_write_fsync_rename_failure_is_typed(base, kind, err):
    ckpt, model, opt = make(base)
    assert ckpt.restore() == 2
    update(model, opt, 3)
    ckpt.step_done(3)
    ckpt.store.fs = FaultyFS(kind=kind, err=err)
    with pytest.raises(SaveFailed, match=os.strerror(err)) as e:
        ckpt.save()
    assert isinstance(e.value, unbroken.UnbrokenError)
    assert str(base) in str(e.value) and "untouched" in str(e.value)
    assert [g.generation for g in GenerationStore(base).scan() if g.ok] == [1, 2]
    ckpt.close()


def test_a_full_disk_fails_every_save_until_space_returns(base):
    ckpt, model, opt = make(base)
    assert ckpt.restore() == 2
    ckpt.store.fs = FaultyFS(kind="write", err=errno.ENOSPC, times=-1)
    for step in (3, 4, 5):
        update(model, opt, step)
        ckpt.step_done(step)
        with pytest.raises(SaveFailed):
            ckpt.save()
        assert debris(base) == []
    assert [g.generation for g in GenerationStore(base).scan() if g.ok] == [1, 2]
    ckpt.store.fs = LocalFS()  # space freed
    update(model, opt, 6)
    ckpt.step_done(6)
    assert ckpt.save() is not None
    ckpt.wait()  # (retention follows the read-back, in the background)
    assert [g.generation for g in GenerationStore(base).scan() if g.ok] == [2, 6]
    ckpt.close()


def test_eio_on_read_back_moves_the_new_generation_aside(base):
    ckpt, model, opt = make(base)
    assert ckpt.restore() == 2
    update(model, opt, 3)
    ckpt.step_done(3)
    ckpt.store.fs = FaultyFS(kind="read", err=errno.EIO, match="gen-000000003")
    with pytest.raises(SaveFailed, match="read back"):
        ckpt.save()  # committed, then read back beside the loop: the verdict comes at wait()
        ckpt.wait()
    assert [g.generation for g in GenerationStore(base).scan() if g.ok] == [1, 2]
    assert [n.split("-corrupt-")[0] for n in os.listdir(base / ASIDE)] == ["gen-000000003"]
    ckpt.store.fs = LocalFS()
    update(model, opt, 4)
    ckpt.step_done(4)
    assert ckpt.save() is not None
    ckpt.close()


def test_eio_reading_the_newest_generation_falls_back(base):
    ckpt, _, _ = make(base)
    ckpt.store.fs = FaultyFS(kind="read", err=errno.EIO, match="gen-000000002",
                             times=-1)
    assert ckpt.restore() == 1
    assert "gen-000000002" in ckpt.rejected[0][0] and os.strerror(errno.EIO) in \
        ckpt.rejected[0][1]
    ckpt.close()


def test_faulty_fs_validates_its_arguments():
    with pytest.raises(ValueError):
        FaultyFS(kind="chmod")
    with pytest.raises(ValueError):
        FaultyFS(nth=0)


_FSIZE_CHILD = r"""
import resource, sys, torch, unbroken
root, limit = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
m = torch.nn.Linear(1024, 1024)  # AdamW state: an optimizer file of 8.4 MB, past O_DIRECT's 8 MiB
o = torch.optim.AdamW(m.parameters())
def step():
    m(torch.ones(2, 1024)).sum().backward(); o.step(); o.zero_grad()
ck = unbroken.Checkpointer(root, model=m, optimizer=o, keep=unbroken.Keep(last=2))
ck.restore()
step(); ck.step_done(1); ck.save(); ck.wait()
saved = {k: v.clone() for k, v in m.state_dict().items()}
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
step(); ck.step_done(2)
try:
    ck.save()
    ck.wait()
except unbroken.SaveFailed as e:
    print("FAILED", e)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
step(); ck.step_done(3); ck.save(); ck.wait(); ck.close()
m2 = torch.nn.Linear(1024, 1024); o2 = torch.optim.AdamW(m2.parameters())
r = unbroken.Checkpointer(root, model=m2, optimizer=o2, keep=unbroken.Keep(last=2))
print("RESTORED", r.restore(), [g.generation for g in r.store.scan()])
r.close()
"""


@pytest.mark.parametrize("limit", [6_000_000, 6_291_456], ids=["off-the-block-grid", "aligned"])
def test_a_file_size_limit_fails_the_save_with_efbig_naming_the_file(tmp_path, limit):
    """A write the file-size limit cuts (RLIMIT_FSIZE; Python ignores SIGXFSZ) fails with
    EFBIG naming the file and the remedy, wherever the limit falls: an O_DIRECT write cut off
    the 4 KiB grid was refused with EINVAL, which hid the cause. Nothing is lost, and the next
    save succeeds once the limit is gone."""
    import subprocess
    import sys

    root = tmp_path / "run"
    out = subprocess.run([sys.executable, "-c", _FSIZE_CHILD, str(root), str(limit)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    failed = next(line for line in out.stdout.splitlines() if line.startswith("FAILED"))
    assert "File too large [EFBIG]" in failed and "ulimit -f" in failed, failed
    assert "optimizer.safetensors" in failed and "EINVAL" not in failed, failed
    assert "RESTORED 3 [1, 3]" in out.stdout, out.stdout
    assert not [n for n in os.listdir(root) if n.startswith((STAGING_PREFIX, TRASH_PREFIX))]
