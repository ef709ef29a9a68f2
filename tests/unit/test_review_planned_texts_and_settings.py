"""Review of the changes since 7d15b48: the codec's planned JSON texts (a place-holder string in
the skeleton, the plan's text put in its place when state.json is written), the async
snapshot's reused per-parameter rows, the optimizer state taken straight from the optimizer,
and the warnings for a changed LR-scheduler setting. The tests marked "Found by this review"
failed on the code under review and pass since its fix; the others document guarantees."""

from __future__ import annotations

import copy
import shutil
import warnings
from collections import OrderedDict
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_review_optimizer_zoo import OPTIMIZERS, SCHEDULERS, update
from test_review_snapshot_plans import _check, _same
from test_scheduler_changes import _built, _resume

import unbroken
from unbroken.persist import plans
from unbroken.persist.snapshot import SnapshotBuffers
from unbroken.state import encodeplans
from unbroken.state.generation import encode_generation
from unbroken.state.optim import _direct_state, live_group_names, optimizer_state

L = torch.optim.lr_scheduler
META = {"unbroken.run": "r", "unbroken.generation": "1"}
N = encodeplans._PLANNED + 4  # tensors in a mapping: enough for a plan


def _state_json(tree: dict[str, Any], layouts: dict[str, Any] | None) -> bytes:
    return b"".join(encode_generation(tree, META, layouts=layouts)["state.json"])


def _sd(n: int, cols: int, base: float = 0.0) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((cols,), base + i) for i in range(n)}


# -- 4. the codec's planned texts ---------------------------------------------------------------


def test_a_planned_mapping_inside_a_replanned_one_is_written_as_its_skeleton():
    """Found by this review (fixed: a mapping holding a planned one is not planned): a part
    holding two state_dicts ({"teacher": sd, "student": sd}, an EMA pair)
    is planned at "teacher", "student" and at the part itself. When the part's plan stops
    fitting (a third entry is added) while the inner ones still fit, the inner mappings are
    encoded by their plans, as place-holder strings, and the part is planned again with a
    skeleton that holds those strings. The next save takes the part by that plan: its text,
    made once from that skeleton, still holds the old place-holders, which no ``texts`` of
    this save replaces. state.json then holds "unbroken.planned.<hex>.<n>" where the
    tensor references should be (a save without plans writes the references)."""
    layouts: dict[str, Any] = {}
    trees = [{"ema": {"teacher": _sd(N, 2), "student": _sd(N, 3)}},
             {"ema": {"teacher": _sd(N, 2), "student": _sd(N, 3), "swa": _sd(1, 1)}},
             {"ema": {"teacher": _sd(N, 2, 1.0), "student": _sd(N, 3), "swa": _sd(1, 1)}}]
    for i, tree in enumerate(trees):
        planned, plain = _state_json(tree, layouts), _state_json(tree, None)
        assert b"unbroken.planned." not in planned, f"save {i}: a place-holder written"
        assert planned == plain, f"save {i}"


@pytest.mark.parametrize("async_save", [False, True])
def test_an_extra_of_two_state_dicts_restores_its_tensors_after_an_entry_is_added(
        tmp_path, async_save):
    """Found by this review (the one above, through the public API): an ``extras`` object whose
    state_dict() holds two state_dicts gains a third entry at step 2; generation 3 holds a
    place-holder string for each of the first two, and a continuation from it hands the
    object's load_state_dict those strings instead of its tensors, silently (the save, its
    read-back and the restore all succeed)."""
    class Pair:
        def __init__(self) -> None:
            self.d: dict[str, Any] = {"teacher": _sd(N, 2), "student": _sd(N, 3)}

        def state_dict(self) -> dict[str, Any]:
            return self.d

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.d = sd

    pair = Pair()
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=torch.nn.Linear(2, 2),
                                 extras={"ema": pair}, async_save=async_save)
    ckpt.restore()
    for s in (1, 2, 3):
        if s == 2:
            pair.d["swa"] = {"n": torch.ones(1)}
        for v in pair.d["teacher"].values():
            v.add_(1)
        ckpt.step_done(s)
        ckpt.save(s)
    ckpt.wait()
    want = copy.deepcopy(pair.d)
    ckpt.close()
    back = Pair()
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=torch.nn.Linear(2, 2),
                                 extras={"ema": back})
    assert ckpt.restore() == 3
    ckpt.close()
    assert {k: type(v) for k, v in back.d.items()} == {k: dict for k in want}, back.d
    _same(back.d, want)


_TEXTS = st.sampled_from(["plain", "é ☃ 日本", "\ud800 lone surrogate", "unbroken.planned.x.1",
                          '"quoted" \\ back', ""])


@settings(max_examples=30, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["values", "shape", "key", "none", "text",
                                                   "drop_state", "dtype"]),
                                st.integers(0, N - 1), _TEXTS), min_size=1, max_size=6))
def test_state_json_of_flat_and_optimizer_plans_is_that_of_an_unplanned_save(steps):
    """Guarantee: a model-like mapping and an optimizer-like per-parameter state (one level of
    dicts), saved again and again with changes, write state.json byte for byte as a save
    without plans does, also when another part's string cannot be UTF-8 encoded (the whole
    document falls back to ASCII escapes with the texts in place)."""
    torch.manual_seed(0)
    model = OrderedDict((f"l{i}.weight", torch.randn(2, 3)) for i in range(N))
    state = {f"l{i}.weight": {"step": torch.tensor(1.0), "exp_avg": torch.randn(2, 3)}
             for i in range(N)}
    layouts: dict[str, Any] = {}
    note = "start"
    for change, i, text in [("none", 0, "start"), *steps]:
        k = f"l{i}.weight"
        if change == "values" and k in model:
            model[k] = model[k] + 1
        elif change == "shape" and k in model:
            model[k] = torch.randn(3, 3)
        elif change == "key" and k in model:
            model[f"extra{i}"] = model.pop(k)
        elif change == "text":
            note = text
        elif change == "drop_state":
            state.pop(k, None)
        elif change == "dtype":
            state.get(k, {})["step"] = torch.tensor(2, dtype=torch.int64)
        tree = {"model": model, "optimizer": {"state": state, "param_groups": [{"lr": 0.1}]},
                "notes": {"note": note}}
        planned, plain = _state_json(tree, layouts), _state_json(tree, None)
        assert planned == plain
        assert b"unbroken.planned." not in planned or "unbroken.planned." in note


# -- 1. the async snapshot's reused rows -------------------------------------------------------


def _opt_tree(state: dict[str, Any]) -> dict[str, Any]:
    return {"optimizer": {"state": state, "param_groups": [{"lr": 0.1, "params": list(state)}]}}


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["values", "new_tensor", "grow_key",
                                                   "drop_key", "drop_param", "add_param",
                                                   "reorder", "shape", "none"]),
                                st.integers(0, plans.PLANNED + 3)), min_size=1, max_size=8))
def test_snapshots_of_a_changing_optimizer_state_by_its_plan_equal_the_state(steps):
    """Guarantee: the per-parameter dicts a plan gives every snapshot it takes are the
    snapshot of that step's state: every snapshot equals its tree and a fresh
    SnapshotBuffers' snapshot (`_check`), is not the live state's dicts, and keeps what it
    holds after save() (the live state changing, the next step's tree snapshotted by a
    fresh SnapshotBuffers)."""
    torch.manual_seed(1)
    n = plans.PLANNED + 4
    state = {f"p{i}": {"step": torch.tensor(float(i)), "exp_avg": torch.randn(4),
                       "exp_avg_sq": torch.randn(4)} for i in range(n)}
    buffers = SnapshotBuffers()
    for change, i in [("none", 0), ("values", 0), *steps]:
        names = list(state)
        k = names[i % len(names)] if names else None
        if change == "values":
            for d in state.values():
                for t in d.values():
                    t.add_(1)
        elif change == "new_tensor" and k:
            state[k]["exp_avg"] = torch.randn(4)
        elif change == "grow_key" and k:
            state[k]["max_exp_avg_sq"] = torch.randn(4)
        elif change == "drop_key" and k:
            state[k].pop("exp_avg_sq", None)
        elif change == "drop_param" and k:
            del state[k]
        elif change == "add_param":
            state[f"q{i}"] = {"step": torch.tensor(0.0), "exp_avg": torch.randn(4),
                              "exp_avg_sq": torch.randn(4)}
        elif change == "reorder":
            state = dict(reversed(list(state.items())))
        elif change == "shape" and k:
            state[k]["exp_avg"] = torch.randn(5)
        tree = _opt_tree(state)
        _check(buffers, tree)
        snap = buffers.take(tree)
        want = copy.deepcopy(tree)
        live_ids = {id(d) for d in state.values()}
        assert not live_ids & {id(d) for d in snap["optimizer"]["state"].values()}
        for d in state.values():  # the loop goes on
            for t in d.values():
                t.add_(100)
        _same(snap, want)


@pytest.mark.parametrize("name", ["adam-amsgrad-foreach", "adamw-single-tensor", "rprop"])
def test_every_async_generation_restores_the_optimizer_state_of_its_step(tmp_path, name):
    """Guarantee: async saves at every step (the per-parameter rows of the optimizer plan
    reused by each) each hold the optimizer state of their own step, restored exactly."""
    torch.manual_seed(0)
    o = OPTIMIZERS[name](0)
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=o["model"], optimizer=o["opt"],
                                 async_save=True, keep=unbroken.Keep(last=10))
    ckpt.restore()
    want = {}
    for s in range(1, 6):
        update(o, s)
        ckpt.step_done(s)
        ckpt.save(s)
        want[s] = copy.deepcopy(o["opt"].state_dict())
    ckpt.wait()
    ckpt.close()
    for s in range(1, 6):
        p = OPTIMIZERS[name](1)
        # (a continuation from s sets the later ones aside: each from its own copy)
        shutil.copytree(tmp_path / "run", tmp_path / f"copy{s}")
        back = unbroken.Checkpointer(tmp_path / f"copy{s}", model=p["model"],
                                     optimizer=p["opt"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert back.restore(generation=s) == s
        back.close()
        _same(p["opt"].state_dict(), want[s])


# -- 2. the optimizer state straight from the optimizer ----------------------------------------


def _through_torch(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What `optimizer_state` made before 9f92455: from ``opt.state_dict()``."""
    sd = opt.state_dict()
    group_names = live_group_names(model, opt)
    by_index: dict[int, str] = {}
    for saved_group, group in zip(sd["param_groups"], group_names):
        by_index.update(zip(saved_group["params"], group))
    return {"class": f"{type(opt).__module__}.{type(opt).__qualname__}",
            "state": {by_index[i]: s for i, s in sd["state"].items()},
            "param_groups": [{**g, "params": group}
                             for g, group in zip(sd["param_groups"], group_names)]}


def _identical(a: Any, b: Any) -> None:
    """Same keys in the same order, the very same leaf objects (the state's dicts too)."""
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _identical(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _identical(x, y)
    else:
        assert a is b or a == b, (a, b)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS) + ["sched:" + n for n in sorted(SCHEDULERS)])
def test_the_direct_optimizer_state_is_what_torchs_state_dict_gave(name):
    """Guarantee: across the optimizer and scheduler zoo (fused, foreach, amsgrad, LBFGS's
    one-key state, tensor lr, schedulers that add group fields), after updates, the
    name-keyed state is taken directly and equals, key for key and order for order, with
    the very same per-parameter dicts, what torch's state_dict made of it."""
    torch.manual_seed(0)
    o = (SCHEDULERS[name[6:]] if name.startswith("sched:") else OPTIMIZERS[name])(0)
    for s in range(1, 4):
        update(o, s)
    model, opt = o["model"], o["opt"]
    got = _direct_state(opt, live_group_names(model, opt))
    assert got is not None
    _identical(got, _through_torch(model, opt))
    for g, want in zip(got["state"].values(), _through_torch(model, opt)["state"].values()):
        assert g is want


def test_hooks_a_subclass_or_a_stray_state_key_take_torchs_state_dict():
    """Guarantee: with a state_dict hook, an overriding subclass, or a state key in no
    group, the state comes from torch's state_dict (hooks run, the override is used)."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    seen = []
    opt.register_state_dict_pre_hook(lambda o: seen.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "param_groups": [
        {**g, "tag": 1} for g in sd["param_groups"]]})
    out = optimizer_state(model, opt)
    assert seen == ["pre"] and out["param_groups"][0]["tag"] == 1
    assert set(out["state"]) == {"weight", "bias"}

    class Mine(torch.optim.SGD):
        def state_dict(self) -> dict[str, Any]:
            sd = super().state_dict()
            sd["param_groups"][0]["mine"] = True
            return sd

    mine = Mine(model.parameters(), lr=0.1)
    assert _direct_state(mine, live_group_names(model, mine)) is None
    assert optimizer_state(model, mine)["param_groups"][0]["mine"] is True

    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain.state[torch.zeros(1)] = {"x": 1}  # a key in no group: torch's own method decides
    assert _direct_state(plain, live_group_names(model, plain)) is None


def test_the_direct_state_follows_groups_their_order_and_frozen_parameters():
    """Guarantee: parameters in several groups (one never stepped, without state), groups in
    another order than the model's, a parameter without a gradient: the same as torch's."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    ps = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [ps[3], ps[0]], "lr": 0.1},
                             {"params": [ps[2]], "weight_decay": 0.0},
                             {"params": [ps[1]], "lr": 0.0}], lr=0.01)
    model(torch.randn(5, 3)).sum().backward()
    ps[2].grad = None
    opt.step()
    got = optimizer_state(model, opt)
    _identical(got, _through_torch(model, opt))
    assert list(got["state"]) == ["1.bias", "0.weight", "0.bias"]


# -- 3. the changed scheduler settings ---------------------------------------------------------


@pytest.mark.parametrize("name", ["cosine-warm-restarts", "cycliclr-exp-range",
                                  "onecyclelr-three-phase-linear", "reducelronplateau",
                                  "sequentiallr", "chainedscheduler",
                                  "multisteplr-repeated-milestone"])
def test_an_unchanged_schedule_says_nothing_after_restarts_and_phase_changes(tmp_path, name):
    """Guarantee: past restarts, phase changes, milestones and plateaus (9 updates, not 3),
    a schedule the script did not change says nothing."""
    _, said = _resume(tmp_path, SCHEDULERS[name], steps=9)
    assert said == []


def test_a_chained_schedulers_own_change_is_named():
    """Guarantee: a setting of one scheduler inside a ChainedScheduler is said, naming it."""
    import pathlib
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        def make(o: torch.optim.Optimizer, at: int) -> Any:
            return L.ChainedScheduler([L.ConstantLR(o, 0.5, total_iters=3),
                                       L.ExponentialLR(o, [0.9, 0.8][at])])
        o, said = _resume(pathlib.Path(d), _built(make))
    assert len(said) == 1, said
    assert "scheduler 1 (ExponentialLR) 'gamma': saved 0.9, live 0.8" in said[0]
    assert o["sched"]._schedulers[1].gamma == 0.9


def test_changed_plateau_mode_and_cosine_restart_settings_are_named(tmp_path):
    """Guarantee: ReduceLROnPlateau's mode (and the worse-value it implies) and
    CosineAnnealingWarmRestarts' T_mult are said with both values, and restored."""
    o, said = _resume(tmp_path / "a", _built(lambda o, at: L.ReduceLROnPlateau(
        o, mode=["min", "max"][at])))
    assert any("'mode': saved 'min', live 'max'" in w for w in said), said
    assert o["sched"].mode == "min"
    o, said = _resume(tmp_path / "b", _built(lambda o, at: L.CosineAnnealingWarmRestarts(
        o, 2, T_mult=[1, 2][at])))
    assert len(said) == 1 and "'T_mult': saved 1, live 2" in said[0], said
    assert o["sched"].T_mult == 1


@pytest.mark.parametrize("counts", [(3, 2), (2, 3)])
def test_a_sequential_schedule_with_another_number_of_schedulers_is_refused_typed(
        tmp_path, counts):
    """Guarantee: a SequentialLR that now chains more or fewer schedulers is refused with
    StateMismatch (not an IndexError from torch's load_state_dict, not a silent restore)."""
    def make(o: torch.optim.Optimizer, at: int) -> Any:
        inner = [L.LinearLR(o, 0.2, total_iters=2), L.ExponentialLR(o, 0.8),
                 L.StepLR(o, 2, 0.5)]
        n = counts[at]
        return L.SequentialLR(o, inner[:n], [2, 4][:n - 1])
    with pytest.raises(unbroken.errors.StateMismatch):
        _resume(tmp_path, _built(make))


def test_a_warm_start_with_another_schedule_says_nothing_and_keeps_the_live_one(tmp_path):
    """Guarantee: the changed-schedule warning is a continuation's: a warm start (weights
    only) from a run with another gamma says nothing, and the live gamma stays."""
    build = _built(lambda o, at: L.StepLR(o, 2, gamma=[0.5, 0.1][at]))
    torch.manual_seed(0)
    o = build(0)
    ckpt = unbroken.Checkpointer(tmp_path / "a", model=o["model"], optimizer=o["opt"],
                                 scheduler=o["sched"])
    ckpt.restore()
    for s in (1, 2):
        update(o, s)
        ckpt.step_done(s)
    ckpt.save()
    ckpt.close()
    o2 = build(1)
    ckpt = unbroken.Checkpointer(tmp_path / "b", model=o2["model"], optimizer=o2["opt"],
                                 scheduler=o2["sched"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ckpt.restore("warm_start", source=tmp_path / "a") == 0
    ckpt.close()
    assert not [w for w in caught if "saved schedule" in str(w.message)]
    assert o2["sched"].gamma == 0.1


def test_a_changed_swalr_setting_is_said_as_for_the_other_torch_schedulers(tmp_path):
    """Found by this review (fixed: swa_utils' schedulers are compared too): torch's SWALR
    (an LRScheduler like the others) was not compared, as `scheduler_changes` took only the
    classes of ``torch.optim.lr_scheduler``. A script that now anneals over 5 epochs,
    linearly, instead of the saved 3, cosine, got the saved schedule back silently, where a
    changed gamma of a StepLR is said. (The swa_lr itself is a group field, said by
    param_group_changes.)"""
    o, said = _resume(tmp_path, _built(lambda o, at: torch.optim.swa_utils.SWALR(
        o, 0.05, anneal_epochs=[3, 5][at], anneal_strategy=["cos", "linear"][at])))
    assert o["sched"].anneal_epochs == 3  # the saved value, restored
    assert any("'anneal_epochs': saved 3, live 5" in w for w in said), said
    assert any("'_anneal_strategy': saved 'cos', live 'linear'" in w for w in said), said


def test_an_unchanged_swalr_schedule_says_nothing(tmp_path):
    """An unchanged SWALR schedule says nothing."""
    _, said = _resume(tmp_path, _built(
        lambda o, at: torch.optim.swa_utils.SWALR(o, 0.05, anneal_epochs=3)), steps=5)
    assert said == []
