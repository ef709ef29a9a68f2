"""Review of incremental generations (``incremental=True``) from outside: a Hypothesis state
machine drives a real Checkpointer (training, in-place edits of the frozen base, freezing and
unfreezing, saves, corruption of any file of any committed generation, reopening and
restoring, ``unbroken verify --json``) and checks the promises against a model kept apart from
the library:

* a generation is *damaged* when a file it holds was changed in place (flipped byte,
  truncation: the inode is damaged, so every generation that hard-links it is damaged) or one
  of its files was deleted (only that folder is damaged);
* restore loads bitwise (model, optimizer, torch RNG) the state recorded at the save of the
  newest undamaged generation present, refuses every newer one (moved aside), and raises
  ``CorruptCheckpoint`` exactly when generations exist and all are damaged;
* a committed save never holds damaged data, and retention keeps exactly the ``Keep(last=N)``
  newest undamaged generations (deleting an origin never breaks a later one that links it);
* ``unbroken verify --json`` reports as failed exactly the damaged generations.

Targeted tests follow: the origin of a base linked by five generations corrupted, Keep(last=1)
deleting the origin, the three save modes restoring the same bits, and rot that keeps a shared
file's size and time."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import tempfile
import time
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

import unbroken
from unbroken.cli import main as cli_main
from unbroken.errors import CorruptCheckpoint, SaveFailed
from unbroken.store.retention import Keep

pytestmark = pytest.mark.filterwarnings("ignore::unbroken.errors.UnbrokenWarning")

WIDTH = 384  # each frozen layer 576 KiB: together over the 1 MiB stable-file minimum
GEN = re.compile(r"gen-([0-9]{9})")


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A frozen two-layer base and a small trainable head; AdamW over every parameter (a
    frozen one has no gradient, so it gets no optimizer state until it is unfrozen)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH),
                                torch.nn.Linear(WIDTH, 4))
    for p in (*model[0].parameters(), *model[1].parameters()):
        p.requires_grad_(False)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def update(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(4, WIDTH)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone(v) for v in obj)
    return obj


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": clone(model.state_dict()), "optimizer": clone(opt.state_dict()),
            "rng": torch.get_rng_state().clone()}


def difference(a: Any, b: Any, where: str = "") -> str | None:
    """Where ``a`` and ``b`` first differ (bitwise for tensors), or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where}: {type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            return f"{where}: tensors differ"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            if (d := difference(a[k], b[k], f"{where}/{k}")) is not None:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: lengths {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if (d := difference(x, y, f"{where}[{i}]")) is not None:
                return d
        return None
    return None if type(a) is type(b) and a == b else f"{where}: {a!r} vs {b!r}"


def generations(root: str) -> dict[int, str]:
    """The committed-looking ``gen-*`` folders in the run folder (not aside/, not staging)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return {}
    return {int(m.group(1)): os.path.join(root, n) for n in names
            if (m := GEN.fullmatch(n)) and os.path.isdir(os.path.join(root, n))}


def ident(path: str) -> tuple[int, int]:
    st_ = os.stat(path)
    return st_.st_dev, st_.st_ino


def verify_cli(root: str) -> tuple[int, dict[int, str]]:
    """``unbroken verify ROOT --json``: exit status and status by generation."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli_main(["verify", root, "--json"])
    doc = json.loads(out.getvalue())
    return rc, {r["generation"]: r["status"] for r in doc["generations"]}


def flip(path: str, offset: int, keep_time: bool = False) -> None:
    """Change one byte in place (the inode, and every hard link to it, changes content).
    Adding one, not XOR with a constant: a second flip of the same byte must not undo the
    first. ``keep_time``: set the mtime back, as rot that keeps a file's size and time would."""
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([(byte[0] + 1) & 0xFF]))
    if keep_time:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


# -- the state machine --------------------------------------------------------------------------


class IncrementalMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.base = tempfile.mkdtemp(prefix="unbroken-incr-machine-")
        self.pinned: list[int] = []  # fds holding damaged inodes: never reused while we run
        self.ckpt: unbroken.Checkpointer | None = None
        self.runs = 0

    # -- the model of what is on disk --

    def new_root(self) -> None:
        self.runs += 1
        self.root = os.path.join(self.base, f"run{self.runs}")
        self.saved: dict[int, dict[str, Any]] = {}  # generation -> state recorded at its save
        self.bad_inodes: set[tuple[int, int]] = set()
        self.bad_folders: set[tuple[int, int]] = set()  # a folder that lost a file
        self.model, self.opt = build()
        self.ckpt = self.open()
        assert self.ckpt.restore() == 0
        self.step = 0

    def open(self) -> unbroken.Checkpointer:
        return unbroken.Checkpointer(self.root, model=self.model, optimizer=self.opt,
                                     incremental=True, keep=self.keep, async_save=self.mode)

    def damaged(self, folder: str) -> bool:
        if ident(folder) in self.bad_folders:
            return True
        return any(ident(os.path.join(folder, n)) in self.bad_inodes for n in os.listdir(folder))

    def good(self) -> list[int]:
        return sorted(g for g, p in generations(self.root).items() if not self.damaged(p))

    def pin(self, path: str) -> None:
        self.pinned.append(os.open(path, os.O_RDONLY))

    # -- rules --

    @initialize(last=st.integers(1, 4), mode=st.sampled_from([False, True]),
                history=st.lists(st.integers(1, 3), min_size=1, max_size=5))
    def start(self, last: int, mode: bool, history: list[int]) -> None:
        self.keep, self.mode = Keep(last=last), mode
        self.new_root()
        for k in history:  # a few generations to begin with: the base linked across them
            self.train(k)
            self.save()

    @rule(k=st.integers(1, 3))
    def train(self, k: int) -> None:
        assert self.ckpt is not None
        for _ in range(k):
            update(self.model, self.opt)
            self.step += 1
            self.ckpt.step_done(self.step)
        event("train")

    @rule(layer=st.sampled_from([0, 1]), at=st.integers(0, WIDTH - 1))
    def edit_frozen_base(self, layer: int, at: int) -> None:
        with torch.no_grad():
            self.model[layer].weight[at % WIDTH, (7 * at) % WIDTH] += 1.0

    @rule(layer=st.sampled_from([0, 1]))
    def toggle_frozen(self, layer: int) -> None:
        for p in self.model[layer].parameters():
            p.requires_grad_(not p.requires_grad)

    @rule(k=st.integers(1, 3))
    def train_and_save(self, k: int) -> None:
        self.train(k)
        self.save()

    @rule()
    def save(self) -> None:
        assert self.ckpt is not None
        before = {g for g in self.good() if g != self.step}
        state = snapshot(self.model, self.opt)
        try:
            info = self.ckpt.save()
            verified = self.ckpt.wait()
        except SaveFailed as e:  # rot is always noticed by time here: nothing may fail
            raise AssertionError(f"save of step {self.step} failed: {e}") from e
        gens = generations(self.root)
        assert self.step in gens, f"generation {self.step} missing after its save"
        assert not self.damaged(gens[self.step]), "a committed save holds damaged data"
        if info is None and verified is None:  # nothing changed since the same step's save
            assert self.step in self.saved
            d = difference(self.saved[self.step], state)
            assert d is None, f"save() was a no-op but the state changed: {d}"
        else:
            self.saved[self.step] = state
        event(f"save: {'no-op' if info is None and verified is None else 'written'}, "
              f"{len(generations(self.root))} present")
        want = sorted(before | {self.step})[-self.keep.last:]
        assert self.good() == want, (f"retention kept {self.good()} of the undamaged, "
                                     f"expected {want} (Keep(last={self.keep.last}))")

    def with_files(self) -> dict[int, str]:
        """The generations that still hold a file to damage."""
        return {g: p for g, p in generations(self.root).items() if os.listdir(p)}

    @precondition(lambda self: bool(self.with_files()))
    @rule(data=st.data(), how=st.sampled_from(["flip", "flip", "truncate", "delete"]))
    def corrupt(self, data: st.DataObject, how: str) -> None:
        gens = self.with_files()
        g = data.draw(st.sampled_from(sorted(gens)), label="generation")
        folder = gens[g]
        names = sorted(os.listdir(folder))
        stable = [n for n in names if ".g" in n]  # the files later generations link
        name = data.draw(st.sampled_from(stable) if stable and data.draw(st.booleans())
                         else st.sampled_from(names), label="file")
        path = os.path.join(folder, name)
        size = os.path.getsize(path)
        time.sleep(0.012)  # rot comes later than a save: its mtime differs (coarse clocks)
        event(f"corrupt: {how}{' shared' if os.stat(path).st_nlink > 1 else ''}")
        if how == "delete" or size == 0:
            self.bad_folders.add(ident(folder))
            self.pin(folder)
            os.unlink(path)
            return
        self.bad_inodes.add(ident(path))
        self.pin(path)
        # where, as a share of the size: a manifest's size varies from run to run (its
        # timings), and a draw must not depend on it
        at = data.draw(st.integers(0, 1 << 16), label="where") * (size - 1) >> 16
        if how == "flip":
            flip(path, at)
        else:
            os.truncate(path, at)

    @precondition(lambda self: bool(self.with_files()))
    @rule(data=st.data(), how=st.sampled_from(["flip", "truncate", "delete"]))
    def corrupt_then_restore(self, data: st.DataObject, how: str) -> None:
        self.corrupt(data, how)
        self.reopen_and_restore()

    @rule()
    def reopen_and_restore(self) -> None:
        assert self.ckpt is not None
        self.ckpt.close()
        self.ckpt = None
        gens = generations(self.root)
        good = self.good()
        self.model, self.opt = build(seed=1234)
        ckpt = self.open()
        if gens and not good:
            with pytest.raises(CorruptCheckpoint, match="no generation verifies"):
                ckpt.restore()
            rejected = {int(GEN.search(p).group(1)) for p, _ in ckpt.rejected}  # type: ignore[union-attr]
            assert rejected == set(gens)
            ckpt.close()
            assert set(generations(self.root)) == set(gens), "a failed restore moved files"
            event("restore: none verifies")
            self.new_root()  # nothing left to continue: a new run in a new folder
            return
        self.ckpt = ckpt
        got = ckpt.restore()
        if not gens:
            assert got == 0
            self.step = 0
            return
        want = good[-1]
        assert got == want, f"restored {got}, the newest undamaged is {want} (of {sorted(gens)})"
        d = difference(self.saved[want], snapshot(self.model, self.opt))
        assert d is None, f"restored generation {want} is not what was saved: {d}"
        rejected = {int(GEN.search(p).group(1)) for p, _ in ckpt.rejected}  # type: ignore[union-attr]
        assert rejected == {g for g in gens if g > want}
        assert set(generations(self.root)) == {g for g in gens if g <= want}
        self.step = want
        event(f"restore: {'fallback' if want != max(gens) else 'newest'}")

    @rule()
    def verify(self) -> None:
        assert self.ckpt is not None
        self.ckpt.wait()
        rc, status = verify_cli(self.root)
        gens = generations(self.root)
        assert set(status) == set(gens)
        failed = {g for g, s in status.items() if s != "verified"}
        assert failed == {g for g, p in gens.items() if self.damaged(p)}
        assert rc == (1 if failed else 0)

    def teardown(self) -> None:
        try:
            if self.ckpt is not None:
                self.ckpt.close()
        finally:
            for fd in self.pinned:
                os.close(fd)
            shutil.rmtree(self.base, ignore_errors=True)


TestIncrementalMachine = IncrementalMachine.TestCase
TestIncrementalMachine.settings = settings(
    max_examples=25, stateful_step_count=20, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# -- targeted tests ------------------------------------------------------------------------------


def open_run(root, model, opt, **options) -> unbroken.Checkpointer:
    return unbroken.Checkpointer(root, model=model, optimizer=opt, incremental=True, **options)


def step_and_save(ckpt: unbroken.Checkpointer, model, opt, step: int) -> dict[str, Any]:
    """One update, its boundary, a save waited for; the state that save recorded."""
    update(model, opt)
    ckpt.step_done(step)
    ckpt.save()
    ckpt.wait()
    return snapshot(model, opt)


def set_frozen(model: torch.nn.Module, frozen: bool) -> None:
    for p in (*model[0].parameters(), *model[1].parameters()):
        p.requires_grad_(not frozen)


def restore_fresh(root, **options) -> tuple[int, dict[str, Any], list[tuple[str, str]]]:
    model, opt = build(seed=1234)
    with unbroken.Checkpointer(root, model=model, optimizer=opt, **options) as ckpt:
        step = ckpt.restore()
        rejected = list(ckpt.rejected)
    return step, snapshot(model, opt), rejected


@pytest.mark.parametrize("before_base", [True, False])
def test_the_origin_of_a_base_linked_by_five_generations_corrupted(tmp_path, before_base):
    """Generation 2 writes the frozen base (``model.g2``), generations 3-6 link it; one
    flipped byte in the origin's file fails all five. Restore falls back to generation 1
    (written while the base still trained, before any stable file) or, without it, refuses."""
    model, opt = build()
    states: dict[int, dict[str, Any]] = {}
    with open_run(tmp_path, model, opt, keep=Keep(last=10)) as ckpt:
        ckpt.restore()
        if before_base:
            set_frozen(model, False)
            states[1] = step_and_save(ckpt, model, opt, 1)
            set_frozen(model, True)
        else:
            update(model, opt)
            ckpt.step_done(1)
        for step in range(2, 7):
            states[step] = step_and_save(ckpt, model, opt, step)
    gens = generations(str(tmp_path))
    origin = os.path.join(gens[2], "model.g2.safetensors")
    for n in range(3, 7):
        assert os.path.samefile(os.path.join(gens[n], "model.g2.safetensors"), origin)
    if before_base:
        assert not any(".g" in n for n in os.listdir(gens[1]) if n.startswith("model"))
    assert verify_cli(str(tmp_path)) == (0, {n: "verified" for n in gens})

    time.sleep(0.012)
    flip(origin, os.path.getsize(origin) - 5)
    rc, status = verify_cli(str(tmp_path))
    assert rc == 1
    assert {n for n, s in status.items() if s != "verified"} == set(range(2, 7))
    if before_base:
        step, got, rejected = restore_fresh(tmp_path)
        assert step == 1
        assert difference(states[1], got) is None
        assert {int(GEN.search(p).group(1)) for p, _ in rejected} == set(range(2, 7))
        assert set(generations(str(tmp_path))) == {1}  # the five moved aside, whole
    else:
        with pytest.raises(CorruptCheckpoint, match="no generation verifies") as e:
            restore_fresh(tmp_path)
        for n in range(2, 7):
            assert f"gen-{n:09d}/model.g2.safetensors" in str(e.value)
        assert set(generations(str(tmp_path))) == set(range(2, 7))  # nothing moved


def test_keep_last_1_deletes_the_origin_and_later_generations_still_restore(tmp_path):
    model, opt = build()
    with open_run(tmp_path, model, opt, keep=Keep(last=1)) as ckpt:
        ckpt.restore()
        for step in range(1, 6):
            final = step_and_save(ckpt, model, opt, step)
            assert set(generations(str(tmp_path))) == {step}
    kept = generations(str(tmp_path))[5]
    base = os.path.join(kept, "model.g1.safetensors")
    assert os.stat(base).st_nlink == 1  # its origin, gen 1, and 2-4 are gone: the last link
    inode = os.stat(base).st_ino
    assert verify_cli(str(tmp_path)) == (0, {5: "verified"})
    step, got, _ = restore_fresh(tmp_path)
    assert step == 5 and difference(final, got) is None

    model, opt = build(seed=99)
    with open_run(tmp_path, model, opt, keep=Keep(last=1)) as ckpt:
        assert ckpt.restore() == 5
        final = step_and_save(ckpt, model, opt, 6)
    assert set(generations(str(tmp_path))) == {6}
    assert os.stat(os.path.join(str(tmp_path), "gen-000000006", "model.g1.safetensors")
                   ).st_ino == inode  # still the base written at step 1
    assert verify_cli(str(tmp_path)) == (0, {6: "verified"})
    step, got, _ = restore_fresh(tmp_path)
    assert step == 6 and difference(final, got) is None


def _run_in_mode(root, mode) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """Saves at 2, 4 (after an edit of the frozen base: a new stable file) and 6 (with layer
    1 unfrozen: it trains, and the optimizer holds its moments); then a resume from 4 is run
    on to 6 again. The state recorded at each save, and at the end of the resumed run."""
    model, opt = build()
    states = {}
    with open_run(root, model, opt, async_save=mode) as ckpt:
        ckpt.restore()
        for step in range(1, 7):
            if step == 3:
                with torch.no_grad():
                    model[0].weight[3, 5] += 1.0
            if step == 5:
                for p in model[1].parameters():
                    p.requires_grad_(True)
            update(model, opt)
            ckpt.step_done(step)
            if step % 2 == 0:
                states[step] = snapshot(model, opt)
                ckpt.save()
                ckpt.wait()
    shutil.rmtree(os.path.join(root, "gen-000000006"))  # the run died before 6 was saved
    model, opt = build(seed=7)
    with open_run(root, model, opt, async_save=mode) as ckpt:
        assert ckpt.restore() == 4
        assert difference(states[4], snapshot(model, opt)) is None
        for p in model[1].parameters():  # the script unfreezes at 5 again
            p.requires_grad_(True)
        for step in (5, 6):
            update(model, opt)
            ckpt.step_done(step)
        ckpt.save()
        ckpt.wait()
    return states, snapshot(model, opt)


def test_sync_thread_and_process_saves_restore_the_same_bits(tmp_path):
    results = {str(mode): _run_in_mode(str(tmp_path / str(mode)), mode)
               for mode in (False, True, "process")}
    ref_states, ref_end = results["False"]
    assert difference(ref_states[6], ref_end) is None  # the resumed run is the uninterrupted one
    for mode, (states, end) in results.items():
        root = str(tmp_path / mode)
        assert difference(ref_states, states) is None, mode
        assert difference(ref_end, end) is None, mode
        gens = generations(root)
        assert set(gens) == {2, 4, 6}
        layout = {n: sorted(os.listdir(p)) for n, p in gens.items()}
        assert layout == {n: sorted(os.listdir(p))  # the same files in every mode
                          for n, p in generations(str(tmp_path / "False")).items()}, mode
        assert "model.g2.safetensors" in layout[2] and "model.g4.safetensors" in layout[4]
        model, opt = build(seed=5)
        with unbroken.Checkpointer(root, model=model, optimizer=opt) as ckpt:
            assert ckpt.restore() == 6
        assert difference(ref_end, snapshot(model, opt)) is None, mode
        assert verify_cli(root) == (0, {2: "verified", 4: "verified", 6: "verified"})


def test_rot_that_keeps_size_and_time_is_never_counted_as_a_kept_copy(tmp_path):
    """A shared stable file rots keeping its size and mtime (only its ctime moves). The next
    save links it, and its read-back fails, as promised. The link once re-blessed the cached
    verdicts of the generations that share the file (only their ctime had changed), and the
    save after that counted those rotted generations as kept copies and deleted generation
    1, the only undamaged one besides the newest: once the newest was lost too, nothing
    restored.
    README: "a generation that rotted on disk is reported, moved to aside/ as corrupt and
    never counted as a kept copy"."""
    model, opt = build()
    with open_run(tmp_path, model, opt, keep=Keep(last=3)) as ckpt:
        ckpt.restore()
        set_frozen(model, False)
        first = step_and_save(ckpt, model, opt, 1)  # no stable file: the base still trains
        set_frozen(model, True)
        step_and_save(ckpt, model, opt, 2)  # writes model.g2 (the frozen base)
        step_and_save(ckpt, model, opt, 3)  # links it
        shared = os.path.join(generations(str(tmp_path))[3], "model.g2.safetensors")
        time.sleep(0.02)  # the ctime moves; the mtime is set back
        flip(shared, os.path.getsize(shared) - 5, keep_time=True)
        update(model, opt)
        ckpt.step_done(4)
        with pytest.raises(SaveFailed):  # links the rotted file: its read-back fails
            ckpt.save()
            ckpt.wait()
        step_and_save(ckpt, model, opt, 5)  # writes the base anew
    gens = generations(str(tmp_path))
    assert 5 in gens
    assert set(gens) == {1, 5}, f"retention kept {sorted(gens)}; the undamaged are 1 and 5"
    os.unlink(os.path.join(gens[5], "model.safetensors"))  # the newest is lost in turn
    step, got, _ = restore_fresh(tmp_path)
    assert step == 1 and difference(first, got) is None


def test_silent_rot_found_by_a_read_back_is_never_counted_as_a_kept_copy(tmp_path):
    """Rot the disk makes changes no metadata at all: the remembered verdicts of the
    generations that share the file still match their files' identities. (Simulated: the
    verdicts are remembered again for the rotted files, as silent rot would leave them.) A
    read-back that fails on the shared file must make retention hash those generations
    again, not count them as kept copies."""
    model, opt = build()
    with open_run(tmp_path, model, opt, keep=Keep(last=3)) as ckpt:
        ckpt.restore()
        set_frozen(model, False)
        first = step_and_save(ckpt, model, opt, 1)
        set_frozen(model, True)
        step_and_save(ckpt, model, opt, 2)
        step_and_save(ckpt, model, opt, 3)
        shared = os.path.join(generations(str(tmp_path))[3], "model.g2.safetensors")
        flip(shared, os.path.getsize(shared) - 5, keep_time=True)
        store = ckpt.store
        for n in (2, 3):  # as if nothing about the files had changed
            info = store.scan_one(n)
            store._verified[info.path] = store.file_identity(info)
        update(model, opt)
        ckpt.step_done(4)
        with pytest.raises(SaveFailed):  # links the rotted file: its read-back fails
            ckpt.save()
            ckpt.wait()
        step_and_save(ckpt, model, opt, 5)
    assert set(generations(str(tmp_path))) == {1, 5}
    os.unlink(os.path.join(generations(str(tmp_path))[5], "model.safetensors"))
    step, got, _ = restore_fresh(tmp_path)
    assert step == 1 and difference(first, got) is None
