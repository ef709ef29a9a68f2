"""The optimizer part attacked (twenty-sixth session): what an optimizer's own code keeps
beside torch's state and groups, and how its own methods and hooks are honoured.

1. A top-level ``state_dict()`` entry besides 'state' and 'param_groups' (a subclass's, a
   post-hook's) was dropped: the resumed run diverged. It is saved and handed back.
2. A param group added after the Checkpointer was built, with a tensor outside the model,
   was saved under a made-up name (its moments, not its value). Refused at save.
3. ``_uncast`` set back the saved dtype where the optimizer's own hooks had chosen another
   one (saved bfloat16, loaded float32): the next step failed.
4. ``state_dict`` / ``load_state_dict`` patched on the instance were bypassed.
5. State under a key that is no parameter (``optimizer.state["global"]``) made save() raise
   a bare KeyError. It is saved and restored.

Each resume is compared, bit for bit (``torch.equal`` and dtype), with the run that was never
interrupted (or, where the optimizer's own hooks round values, with torch's own save and
load)."""

from __future__ import annotations

import copy
import json
import re
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _resealing import reseal as _reseal

import unbroken
from unbroken.errors import CorruptCheckpoint, StateMismatch, UnsupportedValue
from unbroken.state import optim as O

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

Build = Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]]
N, CUT = 5, 2


def net(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                               torch.nn.Linear(4, 2)).to(dtype)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, start: int, end: int) -> None:
    dtype = next(model.parameters()).dtype
    for i in range(start, end):
        x = torch.linspace(-1, 1, 12, dtype=dtype).reshape(4, 3) * (i + 1)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every parameter, every optimizer state value (parameters' by name, others by key),
    every group setting and the optimizer's own attributes besides torch's."""
    names = {id(p): n for n, p in model.named_parameters()}
    own = {k: v for k, v in vars(opt).items()
           if k not in ("state", "param_groups", "defaults") and not k.startswith("_")
           and not callable(v)}
    return {"params": dict(model.named_parameters()),
            "state": {names.get(id(k), k) if isinstance(k, torch.Tensor) else k: v
                      for k, v in opt.state.items()},
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "own": own}


def diffs(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
              and torch.equal(a.detach(), b.detach()))
        return [] if ok else [f"{path}: {a!r} != {b!r}"]
    if isinstance(a, dict) and isinstance(b, dict):
        if list(map(str, a)) != list(map(str, b)) and set(map(str, a)) != set(map(str, b)):
            return [f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a for d in diffs(a[k], b.get(k), f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diffs(x, y, f"{path}[{i}]")]
    return [] if type(a) is type(b) and a == b else [f"{path}: {a!r} != {b!r}"]


def uninterrupted(build: Build, n: int = N) -> dict[str, Any]:
    model, opt = build()
    train(model, opt, 0, n)
    return snapshot(model, opt)


def resumed(build: Build, folder: Any, cut: int = CUT, n: int = N) -> dict[str, Any]:
    """Trained to ``cut``, saved; a new process's objects restored, trained to ``n``."""
    model, opt = build()
    with unbroken.Checkpointer(folder, model=model, optimizer=opt) as ckpt:
        assert ckpt.restore() == 0
        train(model, opt, 0, cut)
        ckpt.save(cut)
    model, opt = build()
    with unbroken.Checkpointer(folder, model=model, optimizer=opt) as ckpt:
        assert ckpt.restore() == cut
    train(model, opt, cut, n)
    return snapshot(model, opt)


def torch_resumed(build: Build, cut: int = CUT, n: int = N) -> dict[str, Any]:
    """The same interruption through torch's own state_dict() and load_state_dict()."""
    model, opt = build()
    train(model, opt, 0, cut)
    sd_model, sd_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    model, opt = build()
    model.load_state_dict(sd_model)
    opt.load_state_dict(sd_opt)
    train(model, opt, cut, n)
    return snapshot(model, opt)


# -- 1. top-level state_dict entries besides 'state' and 'param_groups' ------------------------


class DecayingSGD(torch.optim.SGD):
    """SGD whose step size decays by a factor it keeps itself, saved in its state_dict."""

    save_scale = True  # (False: as a generation saved without the entry)

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1, momentum=0.9)
        self.scale = 1.0

    def step(self, closure: Any = None) -> Any:
        for g in self.param_groups:
            g["lr"] = 0.1 * self.scale
        self.scale *= 0.5
        return super().step(closure)

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        if self.save_scale:
            sd["scale"] = self.scale
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = dict(state_dict)
        self.scale = sd.pop("scale", 1.0)
        super().load_state_dict(sd)


def _decaying() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = net()
    return model, DecayingSGD(model.parameters())


def test_a_subclass_top_level_entry_is_saved_and_handed_back(tmp_path):
    ref = uninterrupted(_decaying)
    got = resumed(_decaying, tmp_path / "run")
    assert got["own"]["scale"] == ref["own"]["scale"] == 0.5 ** N
    assert diffs(ref, got) == []


class Hooked:
    """A plain Adam whose state-dict post-hook adds entries (a float, a tensor, nested
    containers) that its load pre-hook reads back; its step uses them."""

    def __call__(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = net()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        opt.extra_state = {"scale": 1.0, "ema": torch.zeros(2), "log": [1, (2, "x")]}

        def save(o: Any, sd: dict[str, Any]) -> None:
            sd["scale"] = o.extra_state["scale"]
            sd["more"] = {"ema": o.extra_state["ema"].clone(), "log": list(o.extra_state["log"])}

        def load(o: Any, sd: dict[str, Any]) -> dict[str, Any]:
            sd = dict(sd)
            more = sd.pop("more", {"ema": torch.zeros(2), "log": []})
            o.extra_state = {"scale": sd.pop("scale", 1.0), **more}
            return sd

        def decay(o: Any, args: Any, kwargs: Any) -> None:
            o.extra_state["scale"] *= 0.5
            o.extra_state["ema"] = o.extra_state["ema"] * 0.9 + 1.0
            o.extra_state["log"].append(len(o.extra_state["log"]))
            for g in o.param_groups:
                g["lr"] = 0.01 * o.extra_state["scale"] + float(o.extra_state["ema"][0]) * 1e-4

        opt.register_state_dict_post_hook(save)
        opt.register_load_state_dict_pre_hook(load)
        opt.register_step_pre_hook(decay)
        return model, opt


def test_a_post_hook_top_level_entries_are_saved_and_handed_back(tmp_path):
    ref = uninterrupted(Hooked())
    got = resumed(Hooked(), tmp_path / "run")
    assert diffs(ref, got) == []
    assert diffs(ref["own"]["extra_state"], got["own"]["extra_state"]) == []


def test_a_top_level_entry_the_codec_cannot_store_is_refused_at_save(tmp_path):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.register_state_dict_post_hook(lambda o, sd: sd.update(tags={"a", "b"}))
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        ckpt.restore()
        train(model, opt, 0, 1)
        with pytest.raises(UnsupportedValue, match=r"tags.*cannot be stored"):
            ckpt.save(1)


def test_a_generation_without_the_entries_loads_as_before(tmp_path, monkeypatch):
    monkeypatch.setattr(DecayingSGD, "save_scale", False)
    model, opt = _decaying()
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        ckpt.restore()
        train(model, opt, 0, CUT)
        ckpt.save(CUT)
        assert O.EXTRA not in O.optimizer_state(model, opt)
    monkeypatch.setattr(DecayingSGD, "save_scale", True)
    model, opt = _decaying()
    opt.scale = 7.0
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        assert ckpt.restore() == CUT
    assert opt.scale == 1.0  # its own default, as torch's load of such a state_dict gives


def test_a_forged_extra_or_other_state_is_corrupt():
    model, opt = _decaying()
    train(model, opt, 0, 1)
    saved = O.optimizer_state(model, opt)
    for key, bad in ((O.EXTRA, [1]), (O.EXTRA, {"state": {}}), (O.OTHER_STATE, {0: {}}),
                     (O.OTHER_STATE, "x")):
        with pytest.raises(CorruptCheckpoint, match=key):
            O.optimizer_state_to_torch({**saved, key: bad}, model, opt, "here")


# -- 2. a tensor outside the model, in a param group added later ------------------------------


def _temperature() -> tuple[torch.nn.Module, torch.nn.Parameter]:
    model = net()
    torch.manual_seed(1)
    return model, torch.nn.Parameter(torch.randn(()))


def test_a_param_group_added_later_with_a_tensor_outside_the_model_is_refused_at_save(tmp_path):
    model, temp = _temperature()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        ckpt.restore()
        opt.add_param_group({"params": [temp]})
        train(model, opt, 0, 2)
        with pytest.raises(UnsupportedValue, match=r"not parameters of the model \(group 1 "
                                                   r"param 0 \(\)\).*register them on the model"):
            ckpt.save(2)
    model, _ = _temperature()  # nothing was saved
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        assert ckpt.restore() == 0


def test_a_generation_holding_an_outside_tensors_moments_is_refused_at_restore(
        tmp_path, monkeypatch):
    """As saved before the fix (the made-up name, no value): a restore into an optimizer that
    has the same late group would put the moments onto a freshly made tensor."""
    model, temp = _temperature()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        ckpt.restore()
        opt.add_param_group({"params": [temp]})
        train(model, opt, 0, 2)
        with monkeypatch.context() as m:
            m.setattr(O, "_ADDED", None)  # the save as it was: made-up names
            ckpt.save(2)
    model, temp = _temperature()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        opt.add_param_group({"params": [temp]})
        with pytest.raises(UnsupportedValue, match="no save holds their values"):
            ckpt.restore()
    model, _ = _temperature()  # without the late group: the groups differ
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        with pytest.raises(StateMismatch, match="groups differ"):
            ckpt.restore()


def test_a_param_group_added_later_from_the_model_still_resumes(tmp_path):
    """Progressive unfreezing: the late group's tensors are the model's."""
    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = net()
        opt = torch.optim.Adam(model[0].parameters(), lr=0.1)
        opt.add_param_group({"params": list(model[2].parameters()), "lr": 0.05})
        return model, opt

    assert diffs(uninterrupted(build), resumed(build, tmp_path / "run")) == []


# -- 3. dtypes the optimizer's own hooks choose -----------------------------------------------


def _compressing(expand: bool) -> Build:
    """Adam whose state-dict post-hook stores the moments as bfloat16 (to halve the
    checkpoint); ``expand``: its load pre-hook turns them back into float32 (else torch's
    load casts them to the parameters' float32)."""
    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = net()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)

        def compress(o: Any, sd: dict[str, Any]) -> None:
            for s in sd["state"].values():
                for k in ("exp_avg", "exp_avg_sq"):
                    s[k] = s[k].to(torch.bfloat16)

        def widen(o: Any, sd: dict[str, Any]) -> dict[str, Any]:
            sd = dict(sd)
            sd["state"] = {i: {k: v if k == "step" else v.float() for k, v in s.items()}
                           for i, s in sd["state"].items()}
            return sd

        opt.register_state_dict_post_hook(compress)
        if expand:
            opt.register_load_state_dict_pre_hook(widen)
        return model, opt
    return build


@pytest.mark.parametrize("expand", [True, False], ids=["load-pre-hook", "torchs-cast"])
def test_dtypes_chosen_by_the_optimizers_hooks_are_not_undone(tmp_path, expand):
    build = _compressing(expand)
    ref = torch_resumed(build)
    got = resumed(build, tmp_path / "run")  # (before the fix: the next step failed, or
    assert diffs(ref, got) == []              # its moments stayed bfloat16)
    assert all(s["exp_avg"].dtype == torch.float32 for s in got["state"].values())


@pytest.mark.parametrize("make,dtype", [
    (lambda p: torch.optim.NAdam(p, lr=1e-2), torch.float64),
    (lambda p: torch.optim.ASGD(p, lr=1e-2, t0=2), torch.bfloat16),
], ids=["nadam-float64", "asgd-bfloat16"])
def test_torchs_own_cast_is_still_undone_where_nothing_else_changes_dtypes(
        tmp_path, monkeypatch, make, dtype):
    """NAdam's mu_product and ASGD's eta and mu are float32 for any parameter: where torch's
    load casts them (the route through load_state_dict, forced here), they are set back."""
    monkeypatch.setattr(O, "_identity_cast", lambda *a: False)

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = net(dtype)
        return model, make(model.parameters())

    ref = uninterrupted(build)
    got = resumed(build, tmp_path / "run")
    assert diffs(ref, got) == []
    assert any(v.dtype == torch.float32 for s in got["state"].values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() == 0)


def test_torchs_float32_scalars_are_set_back_with_a_hook_too(tmp_path):
    """With a (harmless) load hook, torch's own values of the optimizer's dtype choice stay
    as its load gives them, but NAdam's mu_product, float32 for any parameter in the
    uninterrupted run, is set back to float32 (the resume is bitwise)."""
    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = net(torch.float64)
        opt = torch.optim.NAdam(model.parameters(), lr=1e-2)
        opt.register_load_state_dict_post_hook(lambda o: None)
        return model, opt

    ref = uninterrupted(build)
    got = resumed(build, tmp_path / "run")
    assert diffs(ref, got) == []
    assert all(s["mu_product"].dtype == torch.float32 for s in got["state"].values())


# -- 4. state_dict / load_state_dict patched on the instance ----------------------------------


def _patched(calls: dict[str, int]) -> Build:
    """Adam whose methods are patched on the instance (as libraries patch what they wrap): its
    own state_dict adds an entry that its own load_state_dict reads."""
    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = net()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        opt.calls_seen = 0
        plain_sd, plain_load = opt.state_dict, opt.load_state_dict

        def state_dict(self: Any) -> dict[str, Any]:
            calls["state_dict"] += 1
            return {**plain_sd(), "calls_seen": self.calls_seen + 1}

        def load_state_dict(self: Any, sd: dict[str, Any]) -> None:
            calls["load_state_dict"] += 1
            sd = dict(sd)
            self.calls_seen = sd.pop("calls_seen")
            plain_load(sd)

        opt.state_dict = types.MethodType(state_dict, opt)  # type: ignore[method-assign]
        opt.load_state_dict = types.MethodType(load_state_dict, opt)  # type: ignore[method-assign]
        return model, opt
    return build


def test_methods_patched_on_the_instance_are_called(tmp_path):
    calls = {"state_dict": 0, "load_state_dict": 0}
    got = resumed(_patched(calls), tmp_path / "run")
    assert calls == {"state_dict": 1, "load_state_dict": 1}
    assert got["own"]["calls_seen"] == 1
    ref = uninterrupted(_patched(calls))
    ref["own"]["calls_seen"] = 1
    assert diffs(ref, got) == []


# -- 5. state under a key that is no parameter ------------------------------------------------


class CountingSGD(torch.optim.SGD):
    """Keeps a count of its steps under a key of its state that is no parameter."""

    def step(self, closure: Any = None) -> Any:
        g = self.state["global"]
        g["count"] = g.get("count", 0) + 1
        g["ema"] = g.get("ema", torch.zeros(())) * 0.5 + g["count"]
        for group in self.param_groups:
            group["lr"] = 0.1 / (1 + float(g["ema"]))
        return super().step(closure)


def _counting() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = net()
    return model, CountingSGD(model.parameters(), lr=0.1, momentum=0.9)


def test_state_under_a_string_key_is_saved_and_restored(tmp_path):
    ref = uninterrupted(_counting)
    got = resumed(_counting, tmp_path / "run")
    assert got["state"]["global"]["count"] == N
    assert diffs(ref, got) == []


@pytest.mark.parametrize("key", [("a", 1), 99], ids=["tuple", "int"])
def test_state_under_another_key_is_refused_typed(tmp_path, key):
    model, opt = _counting()
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        ckpt.restore()
        train(model, opt, 0, 1)
        opt.state[key] = {"n": 1}
        with pytest.raises(UnsupportedValue, match=re.escape(f"state key {key!r}") + ".*string"):
            ckpt.save(1)


def test_state_of_a_tensor_in_no_group_is_refused_typed(tmp_path):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        ckpt.restore()
        train(model, opt, 0, 1)
        opt.state[torch.zeros(3)] = {"x": 1}  # (torch's own state_dict: a bare KeyError)
        with pytest.raises(UnsupportedValue, match=r"tensor of shape \[3\].*none of its param"):
            ckpt.save(1)


def test_ranks_compare_the_extra_entries_too():
    """A job checks that every rank holds the same replicated state (`saving.replicated`):
    the optimizer's extra entries and non-parameter state are part of it."""
    from unbroken.saving import replicated
    from unbroken.state import parts as S

    tree = {S.MODEL: {"w": torch.zeros(1)},
            S.OPTIMIZER: {"class": "x", "state": {"w": {"step": torch.zeros(())}},
                          "param_groups": [], "extra": {"scale": 0.5},
                          "other_state": {"global": {"n": 1}}}}
    named = dict(replicated(tree))
    assert named["optimizer extra"] == {"scale": 0.5}
    assert named["optimizer other_state"] == {"global": {"n": 1}}


class _MomentumFP32(torch.optim.Optimizer):
    """Keeps float32 momentum for lower-precision parameters (as mixed-precision optimizers
    do): torch's own load casts it to the parameter's dtype."""

    def __init__(self, params, lr=0.1):  # type: ignore[no-untyped-def]
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):  # type: ignore[no-untyped-def, override]
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                if "buf" not in st:
                    st["buf"] = torch.zeros_like(p, dtype=torch.float32)
                st["buf"].mul_(0.9).add_(p.grad.float())
                p.sub_((g["lr"] * st["buf"]).to(p.dtype))


class _Overriding(_MomentumFP32):
    def state_dict(self):  # type: ignore[no-untyped-def, override]
        return super().state_dict()  # (a subclass that logs, or adds a field)


@pytest.mark.parametrize("how", ["override", "post-hook"])
def test_a_harmless_state_dict_override_keeps_the_saved_dtypes(tmp_path, how):
    """Before (this session's first fix): an optimizer whose state_dict was overridden or
    hooked but changed no dtype came back with its float32 momentum cast to bfloat16 by
    torch's load, silently. A save records whether its state_dict changed any dtype."""
    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = net(torch.bfloat16)
        opt = (_Overriding if how == "override" else _MomentumFP32)(model.parameters())
        if how == "post-hook":
            opt.register_state_dict_post_hook(lambda o, sd: sd)
        return model, opt

    ref = uninterrupted(build)
    got = resumed(build, tmp_path / "run")
    assert diffs(ref, got) == []
    assert all(s["buf"].dtype == torch.float32 for s in got["state"].values())


class _MasterWeights(torch.optim.Optimizer):
    """Mixed precision: float32 master weights and momentum for bfloat16 parameters, and a
    float64 step count; its state-dict hook stores only the count as float32."""

    def __init__(self, params, lr=0.1):  # type: ignore[no-untyped-def]
        super().__init__(params, {"lr": lr})
        self.register_state_dict_post_hook(self._narrow_count)

    @staticmethod
    def _narrow_count(opt, sd):  # type: ignore[no-untyped-def]
        return {**sd, "state": {i: {**s, "count": s["count"].float()}
                                for i, s in sd["state"].items()}}

    @torch.no_grad()
    def step(self):  # type: ignore[no-untyped-def, override]
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                if not st:
                    st["master"] = p.float()
                    st["m"] = torch.zeros_like(st["master"])
                    st["count"] = torch.zeros((), dtype=torch.float64)
                st["m"].mul_(0.9).add_(p.grad.float())
                st["master"].sub_(g["lr"] * st["m"])
                st["count"].add_(1)
                p.copy_(st["master"])


def test_a_hook_that_narrows_one_value_leaves_the_others_at_their_saved_dtype(tmp_path):
    """Before: one value whose dtype the hook changed marked the whole optimizer, and torch's
    cast to bfloat16 was kept for the float32 master weights too (silently). The save
    records each value the hook changed: only those keep torch's cast."""
    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = net(torch.bfloat16)
        return model, _MasterWeights(model.parameters())

    got = resumed(build, tmp_path / "run")
    ref = uninterrupted(build)
    for name, s in got["state"].items():
        assert s["master"].dtype == s["m"].dtype == torch.float32, name
        assert torch.equal(s["master"], ref["state"][name]["master"]), name
        assert torch.equal(s["m"], ref["state"][name]["m"]), name


def test_a_generation_without_the_record_keeps_torchs_cast(tmp_path):
    """A generation saved before the record existed (an optimizer with a compressing hook):
    the restore keeps what torch's load gives (float32 moments), as torch's own resume does;
    setting the saved bfloat16 back made the next step fail."""
    build = _compressing(False)
    model, opt = build()
    train(model, opt, 0, 2)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        ckpt.save(2)
    gen = tmp_path / "run" / "gen-000000002"
    doc = json.loads((gen / "state.json").read_text())
    # (what the record says of it: the moments the hook narrowed; removed, as before it)
    assert ["0.weight", "exp_avg"] in doc["parts"]["optimizer"].pop("own_dtypes")
    _reseal(gen, "state.json", json.dumps(doc).encode())
    model2, opt2 = build()
    with unbroken.Checkpointer(tmp_path / "run", model=model2, optimizer=opt2) as ckpt:
        assert ckpt.restore() == 2
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt2.state.values())
    train(model2, opt2, 2, 3)  # (before: expected dtype BFloat16 ... got float)
