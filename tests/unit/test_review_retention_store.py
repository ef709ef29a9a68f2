"""Adversarial review of the generation store: retention (`Keep`), restore's fallback and
``aside/``, with the default background read-back, checked against a reference model of the run
kept here (which step was saved with which state and metric, which generation was damaged).

What this file pins down about metrics and ``Keep(best=...)`` (the implementation's behaviour,
checked to be deterministic):

- a NaN or missing metric never ranks: such a generation is never kept as "best", and when no
  verified generation has a rankable value nothing is kept for "best" alone;
- ``inf`` and ``-inf`` are values like any other: ``-inf`` is the best of ``"min"``, ``inf`` the
  best of ``"max"`` (an ``inf`` loss is the worst of ``"min"``);
- ties (``0.0`` and ``-0.0`` included, ints equal to floats) go to the newest generation;
- the choice depends only on the set of (generation, step, metrics) and which of them verify,
  never on listing order.

What retention does with damaged generations, as the state machine checks it: one the listing
already calls corrupt (a size, a missing or unlisted file, a damaged manifest) is moved to
``aside/`` at the next save; one that only fails its hash is verified, and moved aside, when
its keeping depends on it (among the newest ``last`` or a "best" candidate ranked above the
kept one), else deleted like any generation the policy drops; ``every`` keeps its multiples
without verifying them (a rotten one stays listed until a restore or ``unbroken verify`` meets
it); a torn one (no manifest) older than everything kept is deleted as the remains of an
interrupted deletion, a newer one stays listed and restore moves it aside.

Defects found (section 3; each of those tests fails on the code as reviewed):

- ``test_a_superseding_save_that_fails_its_read_back_keeps_the_superseded_generation``
- ``test_a_foreign_generation_is_never_counted_as_a_kept_copy``
- ``test_saving_a_step_again_after_its_generation_rotted_writes_it_again``
- ``test_a_linked_stable_file_that_rotted_is_never_linked_again``
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import re
import shutil
import tempfile
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

import unbroken
from unbroken.cli import main as cli_main
from unbroken.errors import (
    CorruptCheckpoint,
    NoCheckpoint,
    RunNotRestored,
    SaveFailed,
    UnbrokenWarning,
)
from unbroken.store.backends.local import FaultyFS, LocalFS
from unbroken.store.generations import STAGING_PREFIX, TRASH_PREFIX, GenerationStore
from unbroken.store.manifest import MANIFEST
from unbroken.store.retention import Keep, select_kept
from unbroken.store.verifying import generation_of

NAN, INF = float("nan"), float("inf")
METRIC = "val"

# -- the reference --------------------------------------------------------------------------


def rankable(v: float | None) -> bool:
    return v is not None and not math.isnan(v)


def reference_kept(good: dict[int, float | None], keep: Keep) -> set[int]:
    """What the policy keeps of the verified generations ``good`` (number == step -> metric),
    written independently of `select_kept`: the newest ``last``, every multiple of ``every``,
    the best rankable value (ties: the newest)."""
    numbers = sorted(good)
    kept = set(numbers[-keep.last:])
    if keep.every:
        kept |= {g for g in numbers if g % keep.every == 0}
    if keep.best:
        sign = 1.0 if keep.best[1] == "min" else -1.0
        ranked = {g: sign * v for g, v in good.items() if rankable(v)}  # type: ignore[operator]
        if ranked:
            top = min(ranked.values())
            kept.add(max(g for g, s in ranked.items() if s == top))
    return kept


VALUES = st.one_of(
    st.sampled_from([NAN, INF, -INF, 0.0, -0.0]),
    st.integers(-3, 3),
    st.floats(-4, 4, allow_nan=False, allow_infinity=False, width=16),
)
METRICS = st.one_of(st.none(), VALUES)  # None: no metric in the manifest
KEEPS = st.builds(Keep, last=st.integers(1, 3), every=st.sampled_from([None, 2, 3]),
                  best=st.sampled_from([None, (METRIC, "min"), (METRIC, "max")]),
                  aside=st.sampled_from([0, 1, 50]))

# -- 1. the pure selection, with verification failing at random ------------------------------


@settings(deadline=None, database=None, max_examples=150)
@given(data=st.data(), keep=KEEPS)
def test_select_kept_matches_the_reference_over_the_generations_that_verify(data, keep):
    numbers = data.draw(st.sets(st.integers(0, 40), min_size=1, max_size=12), label="numbers")
    gens = [(g, g, {} if (v := data.draw(METRICS, label=f"metric {g}")) is None
             else {METRIC: float(v)}) for g in sorted(numbers)]
    bad = data.draw(st.sets(st.sampled_from(sorted(numbers))), label="bad")
    just_saved = max(numbers)  # protected, as the writer protects the generation just saved

    def good(g: int) -> bool:
        return g not in bad

    kept = select_kept(gens, keep, {just_saved}, good)
    verified = {g: m.get(METRIC) for g, _, m in gens if g not in bad}
    every = {g for g in numbers if keep.every and g % keep.every == 0}  # verified or not
    assert kept == reference_kept(verified, keep) | {just_saved} | every
    # the newest generation that verifies is always kept; a bad one counts for nothing
    if verified:
        assert max(verified) in kept
    assert len(kept & set(verified)) >= min(keep.last, len(verified))
    # NaN and missing never win "best"; a kept generation outside last/every/protect is the best
    if keep.best:
        extra = kept - set(sorted(verified)[-keep.last:]) - every - {just_saved}
        assert len(extra) <= 1
        assert all(rankable(verified.get(g)) for g in extra)
    # deterministic: the same answer in any order, asked again
    shuffled = gens[:]
    random.Random(len(gens)).shuffle(shuffled)
    assert select_kept(shuffled, keep, {just_saved}, good) == kept
    assert select_kept(gens, keep, {just_saved}, good) == kept


# -- helpers on a real run -------------------------------------------------------------------


class Frozen(torch.nn.Module):
    """A frozen 1 MiB base (a stable file that incremental saves hard-link from generation to
    generation) under a small trained head."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(512, 512, bias=False).requires_grad_(False)
        self.head = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


def build(root: Path, keep: Keep, seed: int = 0, incremental: bool = False):
    torch.manual_seed(seed)
    model = Frozen() if incremental else torch.nn.Linear(3, 2)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1,
                          momentum=0.9)
    return model, opt, unbroken.Checkpointer(root, model=model, optimizer=opt, keep=keep,
                                             incremental=incremental)


def update(model, opt, ckpt, gen: torch.Generator | None = None) -> None:
    x = torch.randn(4, 3, generator=gen)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    ckpt.step_done(ckpt.step + 1)


def snapshot(model, opt) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        buf = opt.state.get(p, {}).get("momentum_buffer")
        if buf is not None:
            out[f"momentum.{name}"] = buf.detach().clone()
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def listing(root: Path) -> dict[int, str]:
    """The library's own cheap listing: generation -> complete / torn / corrupt."""
    return {g.generation: g.status for g in GenerationStore(root).scan()}


def aside_names(root: Path) -> set[str]:
    return {e.name for e in GenerationStore(root).aside()}


def cli_verify(root: Path) -> dict[int, str]:
    """``unbroken verify RUN --json`` (in process): generation -> verified / torn / corrupt."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli_main(["verify", str(root), "--json"])
    return {r["generation"]: r["status"] for r in json.loads(out.getvalue())["generations"]}


def flip(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@dataclass(frozen=True)
class Hit:
    """One damage, drawn up front (so that what the folder holds when it lands never changes
    what is drawn): its kind, which file, where in it, which bits."""

    kind: str
    pick: int
    where: int
    mask: int


HITS = st.builds(Hit, kind=st.sampled_from(["flip", "flip", "truncate", "append",
                                            "drop_manifest", "drop_artifact", "stray_file"]),
                 pick=st.integers(0, 1 << 16), where=st.integers(0, 1 << 20),
                 mask=st.integers(1, 255))


def damage(folder: Path, hit: Hit, spare_stable: bool = False) -> tuple[int, int] | None:
    """Damage one generation folder; OSError if it vanished meanwhile (retention). A damage
    that needs a file the folder lacks (a planted empty one) adds a stray file instead.
    Returns (device, inode) of a file changed in place: every generation that hard-links it
    (incremental saves) is damaged with it. ``spare_stable``: a stable file (``*.gN.*``,
    maybe linked from an older generation) is not changed in place (a stray file is added
    instead): see the test of linked files below."""
    names = sorted(p.name for p in folder.iterdir())
    artifacts = [n for n in names if n != MANIFEST]
    kind = hit.kind
    if (not artifacts and kind in ("truncate", "append", "drop_artifact")
            or not names and kind == "flip" or MANIFEST not in names and kind == "drop_manifest"):
        kind = "stray_file"
    changed = None
    if kind in ("flip", "truncate", "append"):
        path = folder / (names if kind == "flip" else artifacts)[
            hit.pick % len(names if kind == "flip" else artifacts)]
        st_ = path.stat()
        changed = (st_.st_dev, st_.st_ino)
        if spare_stable and re.search(r"\.g[0-9]+(\.[0-9]+)?\.safetensors$", path.name):
            kind, changed = "stray_file", None
    if kind == "flip":  # any file, the manifest included: one byte, one to eight bits
        offset = hit.where % max(1, path.stat().st_size)
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([(byte[0] if byte else 0) ^ hit.mask]))
    elif kind == "truncate":
        os.truncate(path, hit.where % max(1, path.stat().st_size))
    elif kind == "append":
        with open(path, "ab") as f:
            f.write(b"\0")
    elif kind == "drop_manifest":
        os.remove(folder / MANIFEST)
    elif kind == "drop_artifact":
        os.remove(folder / artifacts[hit.pick % len(artifacts)])
    elif kind == "stray_file":
        (folder / "stray.bin").write_bytes(b"x")
    else:
        raise AssertionError(kind)
    return changed


def sharing(root: Path, changed: tuple[int, int] | None, target: int) -> set[int]:
    """The listed generations damaged by a damage of ``target`` (and of its file ``changed``
    in place: every generation holding a hard link of it)."""
    hit = {target}
    if changed is not None:
        for folder in root.glob("gen-*"):
            with contextlib.suppress(OSError):
                if any((f.lstat().st_dev, f.lstat().st_ino) == changed for f in folder.iterdir()):
                    hit.add(int(folder.name[4:]))
    return hit


# -- 2. the stateful model: save / damage / restore / reopen ---------------------------------


@dataclass
class Version:
    """One generation as the reference knows it."""

    state: dict[str, torch.Tensor] | None  # None: planted, never saved by the run
    metric: float | None
    bad: bool = False


class RunMachine(RuleBasedStateMachine):
    """A Checkpointer with the default background read-back on a tiny model, against a
    reference: ``versions`` (what each listed generation holds, and whether it was damaged) and
    ``good`` (the undamaged generations retention must have kept). Damage is injected between
    saves (a quiet folder: exact checks) or while a save's read-back and retention run beside
    the loop (a race: bounded checks, then the reference follows the folder)."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="unbroken-review-"))
        self.runs = 0
        self.ckpt: Any = None  # the Checkpointer (None until the run starts)
        self.pending: tuple[int, set[int]] | None = None  # (step, good before it) in flight

    # -- the run ---------------------------------------------------------------------------

    @initialize(keep=KEEPS, incremental=st.booleans())
    def start(self, keep: Keep, incremental: bool) -> None:
        self.keep = keep
        self.incremental = incremental
        self.new_run()

    def new_run(self) -> None:
        self.runs += 1
        self.root = self.tmp / f"run{self.runs}"
        self.model, self.opt, self.ckpt = build(self.root, self.keep, self.runs,
                                                self.incremental)
        assert self.ckpt.restore() == 0
        self.gen = torch.Generator().manual_seed(self.runs)
        self.versions: dict[int, Version] = {}
        self.good: set[int] = set()
        self.pending = None

    def metrics_of(self, numbers: set[int]) -> dict[int, float | None]:
        return {g: self.versions[g].metric for g in numbers}

    def kept_after(self, before: set[int], saved: int) -> set[int]:
        return reference_kept(self.metrics_of(before | {saved}), self.keep)

    def settle(self) -> None:
        """Wait for the save in flight (its read-back and retention) and check the folder."""
        if self.pending is not None:
            step, before = self.pending
            self.pending = None
            info = self.ckpt.wait()
            assert info is not None and info.generation == step, (info, step)
            self.good = self.kept_after(before, step)
            self.check_folder()
            self.check_after_retention()
        else:
            self.check_folder()

    def check_folder(self) -> None:
        found = listing(self.root)
        unknown = set(found) - set(self.versions)
        assert not unknown, f"generations nobody saved appeared: {sorted(unknown)}"
        actual = {g for g in found if not self.versions[g].bad}
        assert actual == self.good, (
            f"undamaged generations in the folder {sorted(actual)}, the policy {self.keep} "
            f"keeps {sorted(self.good)} (listing {found})")
        for g in self.good:
            assert found[g] == "complete", (g, found[g])
        self.versions = {g: v for g, v in self.versions.items() if g in found}
        if found:  # the CLI's verdict agrees with the reference, generation by generation
            verdicts = cli_verify(self.root)
            assert set(verdicts) == set(found)
            for g, verdict in verdicts.items():
                assert (verdict == "verified") == (g in self.good), (g, verdict)

    def check_after_retention(self, raced: set[int] | frozenset[int] = frozenset()) -> None:
        """After a save's retention: ``raced`` were damaged while it ran (maybe after it)."""
        found = {g: s for g, s in listing(self.root).items() if g not in raced}
        # retention moved every generation the listing already calls corrupt aside
        assert "corrupt" not in found.values(), found
        # a damaged generation that still lists as complete was never counted: only "every"
        # may keep one in place without verifying it (it is no copy of anything else)
        for g, status in found.items():
            if status == "complete" and self.versions[g].bad:
                assert self.keep.every and g % self.keep.every == 0, (g, found, self.keep)
        bounded = [e for e in GenerationStore(self.root).aside() if e.reason != "foreign"]
        assert len(bounded) <= self.keep.aside, (bounded, self.keep)

    # -- rules -----------------------------------------------------------------------------

    @rule(n=st.integers(1, 3), value=METRICS, then=st.sampled_from(["wait", "leave"]))
    def save_quietly(self, n: int, value, then: str) -> None:
        """(Saves twice as often as anything else: retention needs a history to choose from.)"""
        self.save(n, value, then, 0, Hit("flip", 0, 0, 1))

    @rule(n=st.integers(1, 3), value=METRICS,
          then=st.sampled_from(["wait", "leave", "race"]), pick=st.integers(0, 1 << 16),
          hit=HITS)
    def save(self, n: int, value, then: str, pick: int, hit: Hit) -> None:
        """``n`` updates and a save; then wait for its read-back, or leave it in flight (the
        next save, restore, wait or close waits for it), or damage a generation at once, while
        the read-back and retention run."""
        if self.pending is not None:  # this save waits for it first: fold its retention in
            step, before = self.pending
            self.pending = None
            self.good = self.kept_after(before, step)
        for _ in range(n):
            update(self.model, self.opt, self.ckpt, self.gen)
        step = self.ckpt.step
        planted = self.versions.get(step)
        assert planted is None or planted.state is None  # only a planted folder can be there
        aside_before = aside_names(self.root)
        info = self.ckpt.save(metrics={} if value is None else {METRIC: value})
        assert info is not None and info.generation == step
        metric = None if value is None else float(value)
        self.versions[step] = Version(snapshot(self.model, self.opt), metric)
        before = set(self.good)
        if then in ("wait", "leave"):
            self.pending = (step, before)
            if then == "wait":
                self.settle()
                if planted is not None:
                    event("save over a planted torn folder")
                if planted is not None and self.keep.aside >= 50:  # moved aside, never lost
                    new = aside_names(self.root) - aside_before
                    assert any(m.startswith(f"gen-{step:09d}-torn-") for m in new), new
            return
        # a race: damage while the read-back and retention run beside the loop
        aside_now = aside_names(self.root)  # (the save waited for the one before it)
        # (an undamaged one: a second damage could undo the first, a flip flipped back)
        choices = sorted({step} | before)
        target = step if pick % 2 else choices[pick // 2 % len(choices)]
        try:
            changed = damage(self.root / f"gen-{target:09d}", hit, spare_stable=True)
            applied = True
        except OSError:  # retention deleted it meanwhile
            changed, applied = None, False
        try:
            self.ckpt.wait()
            failed = False
        except SaveFailed as e:
            failed = True
            event("race: the read-back caught it")
            assert target == step and applied, e
            assert "did not read back as written" in str(e)
        found_now = listing(self.root)
        hit_gens = sharing(self.root, changed, target) if applied else {target}
        # (a damage that failed met retention deleting the target; should the deletion have
        # failed in turn, the target is still listed, half deleted: damaged all the same)
        for g in hit_gens & set(found_now):
            self.versions[g].bad = True
        event(f"race on {'the save' if target == step else 'an older one'}: {hit.kind}")
        if failed:  # no retention ran: aside/ lost nothing
            assert aside_now <= aside_names(self.root)
            assert step not in found_now
            assert any(m.startswith(f"gen-{step:09d}-corrupt-") for m in
                       aside_names(self.root) - aside_before) or self.keep.aside < 50
            assert {g for g in found_now if not self.versions[g].bad} == before - hit_gens
            self.good = before - hit_gens
        else:
            actual = {g for g in found_now if not self.versions[g].bad}
            lower = self.kept_after(before, step) - hit_gens
            upper = (before | {step}) - hit_gens
            assert lower <= actual <= upper, (sorted(lower), sorted(actual), sorted(upper))
            self.good = actual
            self.check_after_retention(raced=hit_gens)
        self.check_folder()

    @rule(value=VALUES, then=st.sampled_from(["wait", "leave"]))
    def save_again(self, value, then: str) -> None:
        """The same step again with another metric: it supersedes the generation (the old one
        goes aside as superseded), or writes it afresh where the folder lacks it."""
        self.settle()
        step = self.ckpt.step
        if step == 0:
            return
        old = self.versions.get(step)
        if old is not None and old.metric is not None and (
                old.metric == value or math.isnan(old.metric) and math.isnan(value)):
            return  # unchanged state and metric: a no-op by design (see the rot test below)
        aside_before = aside_names(self.root)
        info = self.ckpt.save(metrics={METRIC: value})
        assert info is not None and info.generation == step
        event(f"save again: {'supersedes' if old is not None else 'afresh'}"
              f"{' a damaged one' if old is not None and old.bad else ''}")
        if old is not None and self.keep.aside >= 50:
            new = aside_names(self.root) - aside_before
            assert any(m.startswith(f"gen-{step:09d}-superseded-") for m in new), new
        self.versions[step] = Version(snapshot(self.model, self.opt), float(value))
        self.pending = (step, self.good - {step})
        if then == "wait":
            self.settle()

    @rule(pick=st.integers(0, 1 << 16), hit=HITS)
    def damage_quietly(self, pick: int, hit: Hit) -> None:
        self.settle()
        found = sorted(self.good)  # (undamaged: a second damage could undo the first)
        if not found:
            return
        target = found[pick % len(found)]
        changed = damage(self.root / f"gen-{target:09d}", hit)
        hit_gens = sharing(self.root, changed, target)
        if len(hit_gens) > 1:
            event("damage of a file linked by several generations")
        for g in hit_gens:
            self.versions[g].bad = True
        self.good -= hit_gens
        self.check_folder()

    @rule(what=st.sampled_from(["staging", "staging_with_manifest", "torn_future"]),
          ahead=st.integers(1, 3))
    def plant(self, what: str, ahead: int) -> None:
        """A crashed writer's half-written staging folder (with or without its manifest:
        it was never renamed, so never committed), or a torn folder of a future step."""
        self.settle()
        step = self.ckpt.step + ahead
        donor = next((self.root / f"gen-{g:09d}" for g in sorted(self.good, reverse=True)),
                     None)
        if what == "torn_future":
            folder = self.root / f"gen-{step:09d}"
            if step in self.versions or os.path.lexists(folder):
                return
            folder.mkdir()
            if donor is not None:
                for f in donor.iterdir():
                    if f.name != MANIFEST:
                        shutil.copyfile(f, folder / f.name)
            self.versions[step] = Version(None, None, bad=True)
        else:
            folder = self.root / f"{STAGING_PREFIX}{step:09d}-{uuid.uuid4().hex[:12]}"
            folder.mkdir()
            if donor is not None:
                for f in donor.iterdir():
                    if f.name != MANIFEST or what == "staging_with_manifest":
                        shutil.copyfile(f, folder / f.name)
                torn = max((f for f in folder.iterdir() if f.name != MANIFEST),
                           key=lambda f: f.stat().st_size)  # written halfway
                os.truncate(torn, torn.stat().st_size // 2)
            else:
                (folder / "model.safetensors").write_bytes(b"\0" * 10)
        self.check_folder()

    @rule()
    def restore_here(self) -> None:
        """restore() in the running Checkpointer."""
        self.settle()
        self.restore_and_check()

    @rule(pick=st.integers(0, 1 << 16))
    def restore_generation(self, pick: int) -> None:
        """restore(generation=N) of a listed generation: newer ones go aside as abandoned
        (whatever their state: they were not tried), nothing is deleted."""
        self.settle()
        found = sorted(listing(self.root))
        if found:
            self.restore_and_check(generation=found[pick % len(found)])

    @rule(seed=st.integers(10, 13), keep=st.one_of(st.none(), KEEPS))
    def reopen(self, seed: int, keep: Keep | None) -> None:
        """close(), then a new process's Checkpointer on the folder (maybe with another
        policy: the next save's retention applies it), restore()."""
        if self.pending is not None:  # close() waits for the save in flight
            step, before = self.pending
            self.pending = None
            self.ckpt.close()
            self.good = self.kept_after(before, step)
            self.check_folder()
            self.check_after_retention()
        else:
            self.settle()
            self.ckpt.close()
        self.keep = keep or self.keep
        self.model, self.opt, self.ckpt = build(self.root, self.keep, seed, self.incremental)
        left = [n for n in os.listdir(self.root) if n.startswith((STAGING_PREFIX, TRASH_PREFIX))]
        assert not left, f"debris the new writer should have removed: {left}"
        if not self.restore_and_check():
            # none verifies: the folder is refused, and so is a save into it
            update(self.model, self.opt, self.ckpt, self.gen)
            with pytest.raises(RunNotRestored):
                self.ckpt.save()
            self.ckpt.close()
            self.new_run()

    def restore_and_check(self, generation: int | None = None) -> bool:
        """restore() (or of ``generation``): the newest undamaged generation (or that one)
        loads, bit for bit; every newer one goes to aside/ with its label; nothing is deleted;
        when none verifies, CorruptCheckpoint and nothing changes. False then."""
        before = listing(self.root)
        aside_before = aside_names(self.root)
        if generation is not None:
            expected = generation if generation in self.good else None
        else:
            expected = None if before and not self.good else max(self.good, default=0)
        try:
            got = self.ckpt.restore(generation=generation)
        except NoCheckpoint:
            # An empty folder, while this Checkpointer counted updates in this process (its
            # save failed its read-back and went aside: a race's drop landed first): 0 would
            # mean "start fresh", and the live objects are not fresh. Nothing changes.
            event("restore: refused, this process's saves are gone")
            assert generation is None and not before and self.ckpt.step > 0, (before,
                                                                              self.ckpt.step)
            assert listing(self.root) == before and aside_names(self.root) == aside_before
            return True
        except CorruptCheckpoint:
            event("restore: none verifies" if generation is None else "restore N: refused")
            assert expected is None, f"restore refused though {expected} verifies ({before})"
            assert listing(self.root) == before and aside_names(self.root) == aside_before
            return False
        assert got == expected, (got, expected, before)
        if not before:
            return True  # nothing in the folder: live objects untouched
        state = self.versions[got].state
        assert state is not None and same(snapshot(self.model, self.opt), state), \
            f"restore of {got} did not load the state saved at step {got}"
        assert self.ckpt.step == got
        newer = sorted((g for g in before if g > got), reverse=True)
        event(f"restore{' N' if generation is not None else ''}: "
              f"{'past ' + str(len(newer)) if newer else 'the newest'}")
        assert [int(generation_of(p)[4:]) for p, _ in self.ckpt.rejected] == (
            newer if generation is None else [])
        after = listing(self.root)
        assert after == {g: s for g, s in before.items() if g <= got}, (before, after)
        moved = aside_names(self.root) - aside_before
        assert aside_before <= aside_names(self.root), "restore deleted from aside/"
        labels = sorted((int(m[4:13]), m.split("-")[2]) for m in moved)
        assert labels == sorted(
            (g, "abandoned" if generation is not None else "torn" if before[g] == "torn"
             else "corrupt") for g in newer), (labels, before)
        self.versions = {g: v for g, v in self.versions.items() if g <= got}
        self.good = {g for g in self.good if g <= got}
        return True

    def teardown(self) -> None:
        try:
            if self.ckpt is not None:
                try:
                    self.settle()
                finally:
                    self.ckpt.close()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


# UNBROKEN_PROPERTY_SCALE=10 searches ten times as long; UNBROKEN_PROPERTY_SHRINK=1 shrinks a
# failure to its shortest sequence (minutes: every shrink step reruns saves and restores), so by
# default a failure reports the sequence as found, in seconds.
RunMachine.TestCase.settings = settings(
    max_examples=int(15 * float(os.environ.get("UNBROKEN_PROPERTY_SCALE", "1"))),
    stateful_step_count=20, deadline=None, database=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target] + (
        [Phase.shrink] if os.environ.get("UNBROKEN_PROPERTY_SHRINK") else []),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much])


TestRunMachine = pytest.mark.filterwarnings("ignore::unbroken.errors.UnbrokenWarning")(
    RunMachine.TestCase)


# -- 3. defects, each on its shortest sequence -----------------------------------------------


def test_a_superseding_save_that_fails_its_read_back_keeps_the_superseded_generation(tmp_path):
    """save(1) verified; save(1) again with another metric supersedes it (the old one goes to
    aside/ as superseded before the rename); the new one fails its read-back (an EIO, as a
    bad disk gives) and goes aside as corrupt. The verified generation 1 must still be what
    restore finds; instead the folder lists nothing and restore() starts from scratch."""
    root = tmp_path / "run"
    model, opt, ckpt = build(root, Keep(last=1))
    ckpt.restore()
    update(model, opt, ckpt)
    ckpt.save(metrics={METRIC: 1.0})
    ckpt.wait()
    saved = snapshot(model, opt)
    ckpt.store.fs = FaultyFS(kind="read", match="gen-000000001/model.safetensors", err=5)
    ckpt.save(metrics={METRIC: 0.5})
    with pytest.raises(SaveFailed, match="did not read back"):
        ckpt.wait()
    ckpt.store.fs = LocalFS()
    ckpt.close()
    model, opt, ckpt = build(root, Keep(last=1), seed=5)
    try:
        assert ckpt.restore() == 1, (
            f"the verified generation 1 was lost: listing {listing(root)}, aside "
            f"{sorted(aside_names(root))}")
        assert same(snapshot(model, opt), saved)
    finally:
        ckpt.close()


def test_on_an_object_store_too_a_failed_superseding_save_puts_the_old_generation_back(
        monkeypatch):
    # The object-store backend copies a superseded generation under aside/ and deletes it;
    # a superseding save whose read-back fails copies it back, the manifest last.
    import uuid

    root = f"memory://unbroken-review-{uuid.uuid4().hex[:8]}/run"
    model, opt, ckpt = build(root, Keep(last=1))  # type: ignore[arg-type]
    ckpt.restore()
    update(model, opt, ckpt)
    ckpt.save(metrics={METRIC: 1.0})
    ckpt.wait()
    saved = snapshot(model, opt)
    real = type(ckpt.store).verify

    def failing(store, info, *args, **kwargs):
        if info.superseded is not None:  # (the superseding save's read-back)
            raise CorruptCheckpoint(f"{info.path}: a byte differs")
        return real(store, info, *args, **kwargs)

    monkeypatch.setattr(type(ckpt.store), "verify", failing)
    ckpt.save(metrics={METRIC: 0.5})
    with pytest.raises(SaveFailed, match="did not read back"):
        ckpt.wait()
    monkeypatch.setattr(type(ckpt.store), "verify", real)
    ckpt.close()
    model, opt, ckpt = build(root, Keep(last=1), seed=5)  # type: ignore[arg-type]
    try:
        assert ckpt.restore() == 1
        assert same(snapshot(model, opt), saved)
    finally:
        ckpt.close()


def test_a_foreign_generation_is_never_counted_as_a_kept_copy(tmp_path):
    """A generation copied in from another run verifies (its hashes are right) but restore
    refuses it as foreign. Retention counted it as one of Keep(last=2)'s copies and deleted
    the run's own generation 3; when generation 4 then rots, nothing of this run restores."""
    other = tmp_path / "other"
    model, opt, ckpt = build(other, Keep(last=1), seed=3)
    ckpt.restore()
    for _ in range(10):
        update(model, opt, ckpt)
    ckpt.save()
    ckpt.close()
    root = tmp_path / "run"
    model, opt, ckpt = build(root, Keep(last=2))
    ckpt.restore()
    for _ in range(3):
        update(model, opt, ckpt)
        ckpt.save()
        ckpt.wait()
    at_three = snapshot(model, opt)
    shutil.copytree(other / "gen-000000010", root / "gen-000000010")
    update(model, opt, ckpt)
    ckpt.save()
    ckpt.wait()
    ckpt.close()
    own = sorted(g for g in listing(root) if g != 10)
    flip(root / "gen-000000004" / "model.safetensors")
    model, opt, ckpt = build(root, Keep(last=2), seed=5)
    try:
        assert own == [3, 4], f"retention kept {own} of this run (and the foreign 10)"
        assert ckpt.restore() == 3
        assert same(snapshot(model, opt), at_three)
    finally:
        ckpt.close()


def test_saving_a_step_again_after_its_generation_rotted_writes_it_again(tmp_path):
    """save(2), verified; a byte of it rots; save() of the same step with the same state is
    taken for a no-op (the manifest's hashes match a re-encoding, the files are never looked
    at), so step 2's state, live in memory, has no restorable copy on disk."""
    root = tmp_path / "run"
    model, opt, ckpt = build(root, Keep(last=1))
    ckpt.restore()
    for _ in range(2):
        update(model, opt, ckpt)
        ckpt.save()
        ckpt.wait()
    flip(root / "gen-000000002" / "model.safetensors")
    ckpt.save()  # "a no-op if that step is saved": it is not, any more
    ckpt.wait()
    saved = snapshot(model, opt)
    ckpt.close()
    model, opt, ckpt = build(root, Keep(last=1), seed=5)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnbrokenWarning)
            try:
                got = ckpt.restore()
            except CorruptCheckpoint as e:
                pytest.fail(f"save() of step 2 was a no-op over a rotten generation 2: {e}")
        assert got == 2
        assert same(snapshot(model, opt), saved)
    finally:
        ckpt.close()


def test_a_linked_stable_file_that_rotted_is_never_linked_again(tmp_path):
    """incremental=True: generation 1 holds the frozen base in a stable file that later saves
    hard-link. A byte of it rots the way a disk rots it: the content changes, the
    modification time does not (simulated: a write, then the old mtime put back, as
    ``cp -p``/``rsync -t`` also leave it). save(2) links it anyway (the link test compares
    device, inode, size and mtime only), the read-back skips linked files ("verified when
    their generation was, and unchanged on disk since" -- not checked), so generation 2 is
    reported verified, counted by retention (generation 1 deleted), and every later save
    links the rotten file again: wait() keeps reporting verified generations, none of which
    restores, although the live state is intact. (The same happens with no mtime trick when
    the file changes between the link and the start of the background read-back.) Now the
    read-back hashes linked files too, and a failed one makes the next save write them."""
    root = tmp_path / "run"
    model, opt, ckpt = build(root, Keep(last=1), incremental=True)
    ckpt.restore()
    update(model, opt, ckpt)
    ckpt.save()
    ckpt.wait()
    shared = root / "gen-000000001" / "model.g1.safetensors"
    before = shared.stat()
    with open(shared, "r+b") as f:
        f.seek(600_000)
        byte = f.read(1)
        f.seek(600_000)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(shared, ns=(before.st_atime_ns, before.st_mtime_ns))
    # The first save that links the rotten file fails its read-back, loudly (nothing short of
    # hashing the file before linking it, every save, could know sooner); the saves after it
    # write the file anew: the live state is intact, and they give restorable generations.
    update(model, opt, ckpt)
    ckpt.save()
    with pytest.raises(SaveFailed, match="did not read back as written"):
        ckpt.wait()
    for _ in range(2):
        update(model, opt, ckpt)
        ckpt.save()
        assert ckpt.wait() is not None
    saved = snapshot(model, opt)
    ckpt.close()
    verdicts = cli_verify(root)
    model, opt, ckpt = build(root, Keep(last=1), seed=5, incremental=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnbrokenWarning)
            try:
                got = ckpt.restore()
            except CorruptCheckpoint as e:
                pytest.fail(f"generations 2-4 were reported verified; `unbroken verify` says "
                            f"{verdicts}; restore: {e}")
        assert got == 4
        assert same(snapshot(model, opt), saved)
    finally:
        ckpt.close()
