"""Review of the session's resume fixes (parts.py `_own`/RNG reload/scheduler class/GradScaler,
optim.py casts, rng.py SeedSequence spawn count, codec NaN sign and ndarray subclasses)."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest
import torch

import unbroken
from unbroken.state import parts as P
from unbroken.state.applying import _own


def _net() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    return m, torch.optim.Adam(m.parameters(), lr=0.1)


def _step(m, opt) -> None:
    m(torch.ones(4, 3)).sum().backward()
    opt.step()
    opt.zero_grad()


class Holder:
    def __init__(self, value=None) -> None:
        self.value = value

    def state_dict(self):
        return {"v": self.value}

    def load_state_dict(self, s) -> None:
        self.value = s["v"]


def test_failed_restore_puts_back_streams_after_numpy_generator_spawned(tmp_path) -> None:
    """Promise: a restore that fails raises StateMismatch "nothing was changed" (apply puts
    back every small part it loaded). With a registered NumPy generator whose saved run had
    spawned children, the restore spawns them; the rollback then loads the RNG backup, whose
    seed_sequence says 0 spawned while the live one has 2: `_spawned` raises inside
    validate_rng, swallowed by the best-effort rollback, so NONE of the streams (python,
    numpy, torch, the generator) is put back: they stay at the saved run's state."""
    m, opt = _net()
    g = np.random.default_rng(7)
    g.spawn(2)
    ck = unbroken.Checkpointer(tmp_path / "run", model=m, optimizer=opt, generators={"g": g})
    _step(m, opt)
    random.seed(1)
    ck.save(step=1)
    ck.close()

    m2, opt2 = _net()
    g2 = np.random.default_rng(7)

    def refuse(*a, **k):
        raise RuntimeError("load hook refuses")

    m2.register_load_state_dict_pre_hook(refuse)
    ck2 = unbroken.Checkpointer(tmp_path / "run", model=m2, optimizer=opt2,
                                generators={"g": g2})
    random.seed(12345)
    before = random.getstate()
    with pytest.raises(unbroken.UnbrokenError):
        ck2.restore()
    assert random.getstate() == before, "python stream left at the saved run's state"


def test_failed_restore_puts_back_streams_without_spawn(tmp_path) -> None:
    """Control for the test above: with no spawn() the rollback does put the streams back."""
    m, opt = _net()
    ck = unbroken.Checkpointer(tmp_path / "run", model=m, optimizer=opt,
                               generators={"g": np.random.default_rng(7)})
    _step(m, opt)
    random.seed(1)
    ck.save(step=1)
    ck.close()
    m2, opt2 = _net()
    m2.register_load_state_dict_pre_hook(lambda *a, **k: (_ for _ in ()).throw(RuntimeError()))
    ck2 = unbroken.Checkpointer(tmp_path / "run", model=m2, optimizer=opt2,
                                generators={"g": np.random.default_rng(7)})
    random.seed(12345)
    before = random.getstate()
    with pytest.raises(unbroken.UnbrokenError):
        ck2.restore()
    assert random.getstate() == before


def test_default_rng_with_random_entropy_never_spawned_restores(tmp_path) -> None:
    """A generator from np.random.default_rng() (random entropy, never spawned) restores in a
    new run whose generator has other entropy; its draws continue as saved."""
    m, opt = _net()
    g = np.random.default_rng()
    ck = unbroken.Checkpointer(tmp_path / "run", model=m, optimizer=opt, generators={"g": g})
    g.random(3)
    ck.save(step=1)
    want = g.random(4)
    ck.close()
    m2, opt2 = _net()
    g2 = np.random.default_rng()
    unbroken.Checkpointer(tmp_path / "run", model=m2, optimizer=opt2,
                          generators={"g": g2}).restore()
    assert np.array_equal(g2.random(4), want)


def test_seeded_generator_spawn_continues_for_a_child_generator(tmp_path) -> None:
    """A registered *child* generator (non-empty spawn_key) that spawned itself restores and
    its next spawn() continues as saved (spawn_key round trip through the codec)."""
    m, opt = _net()
    child = np.random.default_rng(3).spawn(2)[1]
    child.spawn(3)
    ck = unbroken.Checkpointer(tmp_path / "run", model=m, optimizer=opt, generators={"g": child})
    ck.save(step=1)
    want = child.spawn(1)[0].random(2)
    ck.close()
    m2, opt2 = _net()
    live = np.random.default_rng(3).spawn(2)[1]
    unbroken.Checkpointer(tmp_path / "run", model=m2, optimizer=opt2,
                          generators={"g": live}).restore()
    assert np.array_equal(live.spawn(1)[0].random(2), want)


def test_generation_without_scheduler_class_still_restores(tmp_path, monkeypatch) -> None:
    """A generation written before the scheduler's class was recorded restores."""
    m, opt = _net()
    sch = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    real = P.capture

    def old_capture(parts, model, **options):
        tree = real(parts, model, **options)
        tree[P.SCHEDULER].pop(P.SCHEDULER_CLASS)
        return tree

    monkeypatch.setattr(P, "capture", old_capture)
    ck = unbroken.Checkpointer(tmp_path / "run", model=m, optimizer=opt, scheduler=sch)
    _step(m, opt)
    sch.step()
    ck.save(step=1)
    ck.close()
    monkeypatch.setattr(P, "capture", real)
    m2, opt2 = _net()
    sch2 = torch.optim.lr_scheduler.StepLR(opt2, 1, 0.5)
    unbroken.Checkpointer(tmp_path / "run", model=m2, optimizer=opt2, scheduler=sch2).restore()
    assert sch2.state_dict() == sch.state_dict()
    assert not hasattr(sch2, P.SCHEDULER_CLASS)


def test_scheduler_class_is_stripped_and_other_class_refused(tmp_path) -> None:
    """The class key never reaches the live scheduler; another class with the same keys is a
    StateMismatch."""
    m, opt = _net()
    sch = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    ck = unbroken.Checkpointer(tmp_path / "run", model=m, optimizer=opt, scheduler=sch)
    _step(m, opt)
    sch.step()
    ck.save(step=1)
    ck.close()
    m2, opt2 = _net()
    sch2 = torch.optim.lr_scheduler.StepLR(opt2, 1, 0.5)
    ck2 = unbroken.Checkpointer(tmp_path / "run", model=m2, optimizer=opt2, scheduler=sch2)
    ck2.restore()
    ck2.close()
    assert P.SCHEDULER_CLASS not in sch2.__dict__
    m3, opt3 = _net()
    sch3 = torch.optim.lr_scheduler.ExponentialLR(opt3, 0.5)
    with pytest.raises(unbroken.StateMismatch):
        unbroken.Checkpointer(tmp_path / "run", model=m3, optimizer=opt3,
                              scheduler=sch3).restore()


def test_enabled_cpu_grad_scaler_restores(tmp_path) -> None:
    """An enabled GradScaler on CPU restores into an enabled one (the got - live refusal is
    only for a disabled live scaler)."""
    m, opt = _net()
    sc = torch.amp.GradScaler("cpu", init_scale=64.0)
    ck = unbroken.Checkpointer(tmp_path / "run", model=m, optimizer=opt, scaler=sc)
    ck.save(step=1)
    ck.close()
    m2, opt2 = _net()
    sc2 = torch.amp.GradScaler("cpu", init_scale=8.0)
    unbroken.Checkpointer(tmp_path / "run", model=m2, optimizer=opt2, scaler=sc2).restore()
    assert sc2.get_scale() == 64.0


def _round_trip(tmp_path: Any, value: Any) -> Any:
    """``value`` held by an extra, saved, and restored into a fresh process's objects."""
    m, opt = _net()
    ck = unbroken.Checkpointer(tmp_path / "run", model=m, optimizer=opt,
                               extras={"h": Holder(value)})
    ck.save(step=1)
    ck.close()
    m2, opt2 = _net()
    h2 = Holder()
    unbroken.Checkpointer(tmp_path / "run", model=m2, optimizer=opt2, extras={"h": h2}).restore()
    return h2.value


def test_negative_nan_keeps_sign_and_string_nan_stays_string(tmp_path) -> None:
    """A NaN's sign bit survives; the strings "-nan" and "nan" stay strings."""
    a, b, s1, s2, inf = _round_trip(tmp_path, [float("-nan"), float("nan"), "-nan", "nan",
                                               -math.inf])
    assert math.isnan(a) and math.copysign(1, a) < 0
    assert math.isnan(b) and math.copysign(1, b) > 0
    assert (s1, s2, inf) == ("-nan", "nan", -math.inf)


def test_memmap_stored_and_matrix_refused_typed(tmp_path) -> None:
    """np.memmap stores as its plain array; np.matrix is refused with UnsupportedValue."""
    mm = np.memmap(tmp_path / "a.bin", dtype=np.float32, mode="w+", shape=(3,))
    mm[:] = [1, 2, 3]
    assert np.array_equal(np.asarray(_round_trip(tmp_path, mm)), [1, 2, 3])
    m, opt = _net()
    h = Holder(np.matrix([[1.0]]))
    with pytest.raises(unbroken.UnsupportedValue):
        unbroken.Checkpointer(tmp_path / "run3", model=m, optimizer=opt,
                              extras={"h": h}).save(step=2)


def test_extra_leaf_tensor_requiring_grad_keeps_requires_grad() -> None:
    """`applying._own` (backups and loads of small parts) detaches: a leaf tensor that requires grad
    comes back without requires_grad (deepcopy kept it)."""
    t = torch.ones(2, requires_grad=True)
    own = _own({"t": t}, "extra.x")
    assert own["t"].requires_grad, "requires_grad dropped by _own"
