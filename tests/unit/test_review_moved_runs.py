"""Review: run folders that users copy, move and sync. A copy (``shutil.copytree``), a moved
folder (``os.rename``), a hard-linked tree (``cp -al``) and a symlinked tree (``cp -as``) must
restore bit for bit or be refused with a typed error, and nothing done to one folder may change
the bytes of another."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from test_incremental import train

import unbroken
from unbroken.cli import main as cli_main
from unbroken.errors import CorruptCheckpoint, RunNotRestored, StoreLocked, UnbrokenError
from unbroken.store.generations import GenerationStore

WIDTH = 384  # two frozen 384x384 layers: ~1.1 MiB of stable data
MODES = pytest.mark.parametrize("incremental", [True, False], ids=["incremental", "full"])


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH),
                                torch.nn.Linear(WIDTH, 4))
    for p in (*model[0].parameters(), *model[1].parameters()):
        p.requires_grad_(False)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def state(model, opt) -> dict[str, torch.Tensor]:
    """Model weights and every tensor of the optimizer state, by a flat key."""
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for pid, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            out[f"opt.{pid}.{k}"] = v.clone() if torch.is_tensor(v) else torch.tensor(v)
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def run(root, incremental: bool, stop: int, start: int = 0, keep: int = 10,
        seed: int = 0) -> dict[str, torch.Tensor]:
    """Restore ``root`` (at ``start``), train to ``stop`` saving every 5 updates; the state
    at ``stop`` (a saved generation)."""
    model, opt = build()
    with unbroken.Checkpointer(root, model=model, optimizer=opt, every=5,
                               incremental=incremental, keep=unbroken.Keep(last=keep)) as ckpt:
        assert ckpt.restore() == start
        torch.manual_seed(seed)
        train(model, opt, ckpt, start, stop)
        ckpt.wait()
    return state(model, opt)


def restored(root, step: int) -> dict[str, torch.Tensor]:
    model, opt = build(seed=99)  # different starting weights: the restore must fill them all
    with unbroken.Checkpointer(root, model=model, optimizer=opt) as ckpt:
        assert ckpt.restore() == step
    return state(model, opt)


def listing(root, data_only: bool = True) -> dict[str, tuple]:
    """Every entry under ``root``: kind, size, inode, mtime and content hash (LOCK, whose
    content is a note of its holder, left out when ``data_only``)."""
    out: dict[str, tuple] = {}
    for dirpath, dirs, names in os.walk(root):
        for name in dirs + names:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if data_only and rel == "LOCK":
                continue
            st = os.lstat(p)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = ("dir", st.st_ino)
            else:
                with open(p, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
                out[rel] = ("file", st.st_size, st.st_ino, st.st_mtime_ns, digest)
    return out


def gens(root) -> list[int]:
    return sorted(int(n[4:]) for n in os.listdir(root) if n.startswith("gen-"))


def verify(root, ok: bool = True) -> dict:
    """``unbroken verify ROOT --json`` (in this process: a fresh interpreter costs seconds)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli_main(["verify", str(root), "--json"])
    assert (rc == 0) == ok, out.getvalue()
    return json.loads(out.getvalue())


def link_tree(src, dst) -> None:
    """``cp -al``: the same folders, every file a hard link to the original's inode."""
    for dirpath, _, names in os.walk(src):
        out = os.path.join(dst, os.path.relpath(dirpath, src))
        os.makedirs(out, exist_ok=True)
        for n in names:
            os.link(os.path.join(dirpath, n), os.path.join(out, n))


def symlink_tree(src, dst) -> None:
    """``cp -as``: the same folders, every file a symlink to the original's file."""
    for dirpath, _, names in os.walk(src):
        out = os.path.join(dst, os.path.relpath(dirpath, src))
        os.makedirs(out, exist_ok=True)
        for n in names:
            os.symlink(os.path.abspath(os.path.join(dirpath, n)), os.path.join(out, n))


def stable_files(root, gen: int) -> list[str]:
    g = os.path.join(root, f"gen-{gen:09d}")
    return sorted(n for n in os.listdir(g) if n.startswith("model.g"))


# -- 1. copytree ---------------------------------------------------------------------------


@MODES
def test_copytree_restores_bitwise_and_continues_without_touching_the_original(
        tmp_path, incremental):
    orig, copy = tmp_path / "orig", tmp_path / "copy"
    final = run(orig, incremental, 15, keep=2)
    shutil.copytree(orig, copy)
    before = listing(orig)
    if incremental:  # the copy's stable file is its own (copytree breaks hard links)
        assert stable_files(copy, 15) == ["model.g5.safetensors"]
        st = os.stat(copy / "gen-000000015/model.g5.safetensors")
        assert st.st_ino != os.stat(orig / "gen-000000015/model.g5.safetensors").st_ino
        assert st.st_nlink == 1  # generations 10 and 15 of the copy: separate files now
    assert same(restored(copy, 15), final)
    assert verify(copy)
    # continue in the copy: retention (last=2) deletes 10 and 15 there
    cont = run(copy, incremental, 30, start=15, keep=2, seed=7)
    assert gens(copy) == [25, 30]
    assert same(restored(copy, 30), cont)
    assert verify(copy)
    for g in GenerationStore(copy).scan():
        assert g.ok, g
        GenerationStore(copy).verify(g)
    if incremental:  # the continuation linked inside the copy, never to the original
        a = os.stat(copy / "gen-000000030" / stable_files(copy, 30)[0])
        assert a.st_nlink >= 2
        assert a.st_ino not in {s[2] for s in before.values() if s[0] == "file"}
    assert listing(orig) == before  # nothing done to the copy touched the original
    assert same(restored(orig, 15), final)


@MODES
def test_saving_into_the_original_never_changes_the_copy(tmp_path, incremental):
    orig, copy = tmp_path / "orig", tmp_path / "copy"
    final = run(orig, incremental, 15, keep=2)
    shutil.copytree(orig, copy)
    before = listing(copy)
    run(orig, incremental, 30, start=15, keep=2, seed=3)
    assert gens(orig) == [25, 30]
    assert listing(copy) == before
    assert same(restored(copy, 15), final)


@MODES
def test_hard_linked_tree_shares_inodes_but_neither_side_changes_the_other(
        tmp_path, incremental):
    """``cp -al``: both folders name the same inodes. Saving, retention and moving aside in
    the copy must only unlink its own names, never write into a shared inode."""
    orig, copy = tmp_path / "orig", tmp_path / "copy"
    final = run(orig, incremental, 15, keep=2)
    link_tree(orig, copy)
    assert os.path.samefile(orig / "gen-000000015/MANIFEST.json",
                            copy / "gen-000000015/MANIFEST.json")
    before = listing(orig)
    # a corrupt newest generation in the copy is moved aside (in the copy) on restore: break
    # the link first, as a user editing the copy's file would (a rewrite, not in place)
    victim = copy / "gen-000000015/state.json"
    data = victim.read_bytes()
    victim.unlink()
    victim.write_bytes(data.replace(b"{", b"[", 1))
    model, opt = build()
    with unbroken.Checkpointer(copy, model=model, optimizer=opt, every=5,
                               incremental=incremental, keep=unbroken.Keep(last=2)) as ckpt:
        assert ckpt.restore() == 10
        assert os.path.isdir(copy / "aside")
        train(model, opt, ckpt, 10, 30)
        ckpt.wait()
    cont = state(model, opt)
    assert gens(copy) == [25, 30]
    assert same(restored(copy, 30), cont)
    assert verify(copy)
    assert listing(orig) == before
    assert same(restored(orig, 15), final)
    # the reverse: the original saves and retains while sharing inodes with the copy's aside/
    before_copy = listing(copy)
    run(orig, incremental, 30, start=15, keep=1, seed=5)
    assert gens(orig) == [30]
    assert listing(copy) == before_copy
    assert same(restored(copy, 30), cont)


# -- 2. os.rename --------------------------------------------------------------------------


@MODES
def test_a_moved_run_restores_and_continues(tmp_path, incremental):
    first, moved = tmp_path / "a" / "run", tmp_path / "b" / "deeper" / "run"
    final = run(first, incremental, 15)
    moved.parent.mkdir(parents=True)
    os.rename(first, moved)
    assert not first.exists()
    assert same(restored(moved, 15), final)
    cont = run(moved, incremental, 25, start=15, keep=2)
    assert gens(moved) == [20, 25]
    assert same(restored(moved, 25), cont)
    assert verify(moved)
    assert not first.exists()  # nothing recreated at the old path
    texts = b"".join(p.read_bytes() for p in moved.rglob("*.json"))
    assert str(first).encode() not in texts and str(tmp_path).encode() not in texts
    if incremental:
        assert os.path.samefile(moved / "gen-000000025" / stable_files(moved, 25)[0],
                                moved / "gen-000000020" / stable_files(moved, 20)[0])


# -- 3. copied while a save was in flight --------------------------------------------------


@MODES
@pytest.mark.parametrize("torn", ["staging", "no-manifest", "truncated", "missing-stable"])
def test_a_copy_taken_mid_save_falls_back_to_a_complete_generation(tmp_path, incremental,
                                                                   torn):
    orig, copy = tmp_path / "orig", tmp_path / "copy"
    run(orig, incremental, 10)
    final = restored(orig, 10)
    shutil.copytree(orig, copy)
    newest = copy / "gen-000000010"
    if torn == "staging":  # the staging folder of save 15 came along; 10 is whole
        staging = copy / ".staging-000000015-abc"
        shutil.copytree(newest, staging)
        (staging / "MANIFEST.json").unlink()
        (staging / "model.safetensors").write_bytes(b"\0" * 100)
        expect = 10
    else:  # generation 10 itself is incomplete in the copy
        if torn == "no-manifest":
            (newest / "MANIFEST.json").unlink()
        elif torn == "truncated":
            big = max(newest.iterdir(), key=lambda p: p.stat().st_size)
            os.truncate(big, big.stat().st_size // 2)
        else:
            names = stable_files(copy, 10) if incremental else ["optimizer.safetensors"]
            (newest / names[0]).unlink()
        expect = 5
        final = None
    model, opt = build(seed=99)
    with unbroken.Checkpointer(copy, model=model, optimizer=opt, incremental=incremental,
                               every=5) as ckpt:
        assert ckpt.restore() == expect
        got = state(model, opt)
        if final is not None:
            assert same(got, final)
        torch.manual_seed(1)
        train(model, opt, ckpt, expect, 20)
        ckpt.wait()
    assert not any(n.startswith(".staging") for n in os.listdir(copy))
    assert gens(copy)[-1] == 20
    assert verify(copy)


@MODES
def test_a_copy_with_no_complete_generation_is_refused_typed(tmp_path, incremental):
    orig, copy = tmp_path / "orig", tmp_path / "copy"
    run(orig, incremental, 10)
    shutil.copytree(orig, copy)
    for g in gens(copy):
        f = copy / f"gen-{g:09d}" / "model.safetensors"
        os.truncate(f, f.stat().st_size - 1)
    model, opt = build(seed=99)
    untouched = state(model, opt)
    with unbroken.Checkpointer(copy, model=model, optimizer=opt) as ckpt:
        with pytest.raises(CorruptCheckpoint, match="model.safetensors"):
            ckpt.restore()
    assert same(state(model, opt), untouched)  # nothing torn was loaded


# -- 4. two writers at once ----------------------------------------------------------------

WORKER = textwrap.dedent("""
    import hashlib, json, sys, torch, unbroken
    sys.path.insert(0, sys.argv[4])
    from test_review_moved_runs import build, train, state
    root, seed, incremental = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    model, opt = build()
    with unbroken.Checkpointer(root, model=model, optimizer=opt, every=5,
                               incremental=incremental, keep=unbroken.Keep(last=2)) as ckpt:
        start = ckpt.restore()
        torch.manual_seed(seed)
        train(model, opt, ckpt, start, 40)
        ckpt.wait()
    s = state(model, opt)
    print(json.dumps({"start": start, "digest": hashlib.sha256(b"".join(
        s[k].numpy().tobytes() for k in sorted(s))).hexdigest()}))
""")


def _digest(s: dict[str, torch.Tensor]) -> str:
    return hashlib.sha256(b"".join(s[k].numpy().tobytes() for k in sorted(s))).hexdigest()


def test_two_processes_on_copy_and_original_do_not_interfere(tmp_path):
    incremental = True  # (both modes run in one process below: a process costs seconds)
    orig, copy = tmp_path / "orig", tmp_path / "copy"
    run(orig, incremental, 10)
    shutil.copytree(orig, copy)
    here = os.path.dirname(__file__)
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(root), str(seed),
                               "1" if incremental else "0", here],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for root, seed in ((orig, 1), (copy, 2))]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    res = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert [r["start"] for r in res] == [10, 10]
    assert res[0]["digest"] != res[1]["digest"]  # different seeds, different runs
    for root, r in zip((orig, copy), res, strict=True):
        assert gens(root) == [35, 40]
        assert _digest(restored(root, 40)) == r["digest"]
        assert verify(root)


@MODES
def test_two_checkpointers_in_one_process_on_copy_and_original(tmp_path, incremental):
    orig, copy = tmp_path / "orig", tmp_path / "copy"
    run(orig, incremental, 10)
    shutil.copytree(orig, copy)
    pairs = [build() for _ in range(2)]
    ckpts = [unbroken.Checkpointer(root, model=m, optimizer=o, every=5, incremental=incremental,
                                   keep=unbroken.Keep(last=2))
             for root, (m, o) in zip((orig, copy), pairs, strict=True)]
    try:
        assert [c.restore() for c in ckpts] == [10, 10]
        torch.manual_seed(4)
        for step in range(11, 26):  # interleaved updates and saves
            for (m, o), c in zip(pairs, ckpts, strict=True):
                loss = m(torch.randn(4, WIDTH) * (1 + (c is ckpts[1]))).pow(2).mean()
                o.zero_grad()
                loss.backward()
                o.step()
                c.step_done(step, loss=loss)
        for c in ckpts:
            c.wait()
    finally:
        for c in ckpts:
            c.close()
    finals = [state(m, o) for m, o in pairs]
    assert not same(*finals)
    for root, f in zip((orig, copy), finals, strict=True):
        assert gens(root) == [20, 25]
        assert same(restored(root, 25), f)


def test_hard_linked_copy_shares_the_lock_with_its_original(tmp_path):
    """``cp -al`` also links ``LOCK``: POSIX locks are per inode, so a writer of the original
    locks out a writer of the copy (in another process), and the copy's writer rewrites the
    holder note of the original's LOCK in place. Safe (typed refusal, no data touched), but
    the two folders are not independent."""
    orig, copy = tmp_path / "orig", tmp_path / "copy"
    run(orig, True, 10)
    link_tree(orig, copy)
    assert os.path.samefile(orig / "LOCK", copy / "LOCK")
    model, opt = build()
    with unbroken.Checkpointer(orig, model=model, optimizer=opt):
        p = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            import unbroken, sys
            try:
                unbroken.Checkpointer({str(copy)!r}, model=__import__('torch').nn.Linear(1, 1))
            except unbroken.errors.StoreLocked as e:
                print("StoreLocked", e); sys.exit(3)
            """)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 3, p.stdout + p.stderr  # locked out by the other folder's writer
    assert StoreLocked.__name__ in p.stdout


# -- 5. symlinked trees --------------------------------------------------------------------


@MODES
def test_symlinked_tree_is_refused_typed_and_never_writes_through(tmp_path, incremental):
    """``cp -as``: folders are real, every file a symlink into the original. Artifacts are
    read with O_NOFOLLOW, so nothing verifies; the refusal is typed and names files, and
    nothing reaches the original through a link."""
    orig, copy = tmp_path / "orig", tmp_path / "copy"
    final = run(orig, incremental, 10)
    symlink_tree(orig, copy)
    before = listing(orig, data_only=False)
    model, opt = build(seed=99)
    untouched = state(model, opt)
    with pytest.raises(UnbrokenError) as e:  # LOCK itself is a symlink
        unbroken.Checkpointer(copy, model=model, optimizer=opt)
    assert "LOCK" in str(e.value)
    os.unlink(copy / "LOCK")  # without it, restore must still refuse the linked files
    with unbroken.Checkpointer(copy, model=model, optimizer=opt, every=5,
                               incremental=incremental) as ckpt:
        with pytest.raises(CorruptCheckpoint) as e:
            ckpt.restore()
        assert "gen-000000010/MANIFEST.json: is a symbolic link" in str(e.value)
        assert "gen-000000005/MANIFEST.json: is a symbolic link" in str(e.value)
        with pytest.raises(UnbrokenError):  # nor a save into the linked tree
            ckpt.save()
    assert same(state(model, opt), untouched)
    assert listing(orig, data_only=False) == before
    assert same(restored(orig, 10), final)
    report = verify(copy, ok=False)
    assert "MANIFEST.json" in json.dumps(report) or "symbolic" in json.dumps(report), report


@MODES
def test_generation_folders_symlinked_into_another_run_are_never_deleted_through(
        tmp_path, incremental):
    """A "sync" that made each ``gen-*`` a symlink to the original's folder: retention and
    moving aside in the linked run remove the link, never the original's files."""
    orig, copy = tmp_path / "orig", tmp_path / "copy"
    final = run(orig, incremental, 15)
    copy.mkdir()
    for g in gens(orig):
        os.symlink(orig / f"gen-{g:09d}", copy / f"gen-{g:09d}")
    shutil.copy2(orig / "RUN.json", copy / "RUN.json")
    before = listing(orig, data_only=False)
    model, opt = build(seed=99)
    with unbroken.Checkpointer(copy, model=model, optimizer=opt, every=5,
                               incremental=incremental, keep=unbroken.Keep(last=1)) as ckpt:
        with pytest.raises(CorruptCheckpoint, match="never a symbolic link") as e:
            ckpt.restore()
        assert all(f"gen-{g:09d}" in str(e.value) for g in (5, 10, 15))
        with pytest.raises(RunNotRestored, match=r"restore\(\) raised"):  # (not "did not call")
            ckpt.save()
    assert all(os.path.islink(copy / f"gen-{g:09d}") for g in (5, 10, 15))  # left as found
    assert listing(orig, data_only=False) == before
    assert same(restored(orig, 15), final)


@MODES
def test_hard_linked_copy_rolled_back_moves_shared_generations_aside_only_in_the_copy(
        tmp_path, incremental):
    """``restore(generation=N)`` in a ``cp -al`` copy moves the newer (shared-inode)
    generations aside there; saving and retention afterwards leave the original whole."""
    orig, copy = tmp_path / "orig", tmp_path / "copy"
    final = run(orig, incremental, 20, keep=3)
    link_tree(orig, copy)
    before = listing(orig)
    model, opt = build()
    with unbroken.Checkpointer(copy, model=model, optimizer=opt, every=5,
                               incremental=incremental, keep=unbroken.Keep(last=1, aside=0)) as c:
        assert c.restore(generation=10) == 10
        assert gens(copy) == [10]
        assert len(os.listdir(copy / "aside")) == 2
        torch.manual_seed(9)
        train(model, opt, c, 10, 30)
        c.wait()
    cont = state(model, opt)
    assert gens(copy) == [30]
    assert same(restored(copy, 30), cont)
    assert listing(orig) == before
    assert same(restored(orig, 20), final)
