"""Review: the optimizer / LR-scheduler / GradScaler zoo against the core promise, "an
interrupted training run continues exactly as if it had never stopped" (bit for bit on CPU).

Each combination trains a tiny model deterministically for ``N`` updates without any
Checkpointer (the reference), and again under a Checkpointer that is interrupted after the
updates listed in ``CUTS``: save, drop every live object, build fresh ones from another seed
(so a part that is not restored shows), restore, continue. ``CUTS`` holds 0 (a save before any
update), a step twice in a row (a resume that is interrupted again before its first update)
and a later step. The final model, optimizer state_dict, scheduler state_dict, scaler
state_dict, extras and the torch RNG state must be equal: tensors with ``torch.equal`` and the
same dtype, every other value with the same type and ``==``.

The ``# DEFECT`` tests fail on the revision under review; each docstring names the promise
it breaks. For those about divergence, the reference run is first run twice to show that
torch itself is deterministic there."""

from __future__ import annotations

import copy
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import unbroken
from unbroken._runview import open_run, verify_one
from unbroken.errors import StateMismatch, UnbrokenError
from unbroken.tools.deep import deep_problems

optim = torch.optim
L = torch.optim.lr_scheduler
N = 7
CUTS = (0, 2, 2, 5)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True)
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


# -- comparison -------------------------------------------------------------------------------


def diffs(a: Any, b: Any, path: str = "", out: list[str] | None = None) -> list[str]:
    """Every difference between two state trees, bitwise (NaN equals NaN, -0.0 is not 0.0)."""
    out = [] if out is None else out
    if type(a) is not type(b):
        out.append(f"{path}: {type(a).__name__} {a!r:.50} vs {type(b).__name__} {b!r:.50}")
    elif isinstance(a, torch.Tensor):
        if (a.dtype, a.shape, a.layout) != (b.dtype, b.shape, b.layout):
            out.append(f"{path}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}")
        elif a.is_sparse:
            if not torch.equal(a.coalesce().to_dense(), b.coalesce().to_dense()):
                out.append(f"{path}: sparse values differ")
        elif not torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                             b.view(-1).view(torch.uint8) if b.numel() else b):
            out.append(f"{path}: values differ")
    elif isinstance(a, dict):
        if list(a) != list(b):
            out.append(f"{path}: keys {list(a)} vs {list(b)}")
        for k in a:
            if k in b:
                diffs(a[k], b[k], f"{path}.{k}", out)
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{path}: {len(a)} vs {len(b)} entries")
        for i, (x, y) in enumerate(zip(a, b)):
            diffs(x, y, f"{path}[{i}]", out)
    elif isinstance(a, float):
        if not (math.isnan(a) and math.isnan(b)) and (a != b or math.copysign(1, a)
                                                      != math.copysign(1, b)):
            out.append(f"{path}: {a!r} vs {b!r}")
    elif callable(a):
        pass  # (lr_lambdas and the like: the live run's own code, never saved)
    elif a != b:
        out.append(f"{path}: {a!r:.60} vs {b!r:.60}")
    return out


def snapshot(o: dict[str, Any]) -> dict[str, Any]:
    out = {"model": o["model"].state_dict(), "optimizer": o["opt"].state_dict(),
           "rng": torch.get_rng_state()}
    for key in ("sched", "scaler"):
        if o.get(key) is not None:
            out[key] = o[key].state_dict()
    for name, extra in (o.get("extras") or {}).items():
        out[f"extra.{name}"] = extra.state_dict()
    return copy.deepcopy(out)


# -- the training loop ------------------------------------------------------------------------


def net(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(),
                               torch.nn.Linear(6, 2)).to(dtype)


def update(o: dict[str, Any], s: int) -> None:
    """Update ``s`` (1-based): a batch from the global torch RNG, backward, optimizer step
    (through the GradScaler, with an inf gradient at the steps in ``inf_at``; or with a
    closure), then the scheduler's per-update step (ReduceLROnPlateau with the loss)."""
    if "step" in o:  # a setup's own update
        o["step"](o, s)
        return
    model, opt, sched, scaler = o["model"], o["opt"], o.get("sched"), o.get("scaler")
    if "before" in o:
        o["before"](o, s)
    dtype = next(model.parameters()).dtype
    x, y = torch.randn(8, 4).to(dtype), torch.randn(8, 2).to(dtype)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        return loss

    if o.get("closure"):
        loss = opt.step(closure)
    else:
        loss = closure()
        if scaler is not None:
            if s in o.get("inf_at", ()):
                next(model.parameters()).grad.view(-1)[0] = math.inf  # a skipped step
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    if sched is not None:
        if isinstance(sched, L.ReduceLROnPlateau):
            sched.step(loss.item())
        else:
            sched.step()
    if "after" in o:
        o["after"](o, s)


def parts(o: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {"model": o["model"], "optimizer": o["opt"]}
    if o.get("sched") is not None:
        kw["scheduler"] = o["sched"]
    if o.get("scaler") is not None:
        kw["scaler"] = o["scaler"]
    if o.get("extras"):
        kw["extras"] = o["extras"]
    return kw


Build = Callable[[int], dict[str, Any]]  # the step at which it is built -> live objects


def reference(build: Build, n: int = N) -> dict[str, Any]:
    """The uninterrupted run, without any Checkpointer."""
    torch.manual_seed(0)
    o = build(0)
    for s in range(1, n + 1):
        update(o, s)
    return snapshot(o)


def interrupted(build: Build, folder: str, cuts: tuple[int, ...] = CUTS, n: int = N
                ) -> dict[str, Any]:
    """The same run, saved, dropped, rebuilt and restored after each step in ``cuts``."""
    torch.manual_seed(0)
    o = build(0)
    ckpt = unbroken.Checkpointer(folder, **parts(o))
    assert ckpt.restore() == 0
    s = 0
    while True:
        for _ in range(cuts.count(s)):
            ckpt.save()
            ckpt.close()
            del ckpt, o
            torch.manual_seed(1000 + s)  # another init: whatever is not restored shows
            o = build(s)
            torch.manual_seed(77)  # another RNG state: the restore must bring it back
            ckpt = unbroken.Checkpointer(folder, **parts(o))
            assert ckpt.restore() == s
        if s == n:
            break
        s += 1
        update(o, s)
        ckpt.step_done(s)
    out = snapshot(o)
    ckpt.close()
    return out


def optimizer(make: Callable[[Any], optim.Optimizer], dtype: torch.dtype = torch.float32,
              **more: Any) -> Build:
    def build(at: int) -> dict[str, Any]:
        model = net(dtype)
        return {"model": model, "opt": make(model.parameters()), **more}
    return build


def scheduled(make: Callable[[optim.Optimizer], Any],
              opt: Callable[[Any], optim.Optimizer] = lambda p: optim.SGD(p, lr=0.1, momentum=0.9),
              **more: Any) -> Build:
    def build(at: int) -> dict[str, Any]:
        model = net()
        o = opt(model.parameters())
        return {"model": model, "opt": o, "sched": make(o), **more}
    return build


def with_scaler(build: Build, inf_at: set[int]) -> Build:
    def b(at: int) -> dict[str, Any]:
        o = build(at)
        o["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
        o["inf_at"] = inf_at
        return o
    return b


# -- passing combinations (none of these is resumed and compared elsewhere in tests/) ----------


class Warmup:
    """A callable lr_lambda with state (torch saves its __dict__)."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __call__(self, step: int) -> float:
        self.calls += 1
        return min(1.0, (step + 1) / self.n)


class HalfLife:
    """A callable CyclicLR scale_fn with state."""

    def __init__(self) -> None:
        self.k = 0.5

    def __call__(self, x: float) -> float:
        return self.k ** x


OPTIMIZERS: dict[str, Build] = {
    "sgd-momentum": optimizer(lambda p: optim.SGD(p, lr=0.05, momentum=0.9)),
    "sgd-nesterov-wd-foreach": optimizer(lambda p: optim.SGD(
        p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2, foreach=True)),
    "sgd-fused-dampening": optimizer(lambda p: optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1,
                                                     fused=True)),
    "adam-amsgrad-foreach": optimizer(lambda p: optim.Adam(p, lr=1e-2, amsgrad=True, foreach=True)),
    "adam-fused-capturable-false": optimizer(lambda p: optim.Adam(p, lr=1e-2, fused=True,
                                                              capturable=False)),
    "adam-maximize-tensor-lr": optimizer(lambda p: optim.Adam(p, lr=torch.tensor(1e-3),
                                                          maximize=True, foreach=False)),
    "adamw-fused-amsgrad": optimizer(lambda p: optim.AdamW(p, lr=1e-2, fused=True, amsgrad=True)),
    "adamw-single-tensor": optimizer(lambda p: optim.AdamW(p, lr=1e-2, foreach=False,
                                                       weight_decay=0.1)),
    "adam-float64": optimizer(lambda p: optim.Adam(p, lr=1e-2), torch.float64),
    "adam-bfloat16": optimizer(lambda p: optim.Adam(p, lr=1e-2), torch.bfloat16),
    "adagrad": optimizer(lambda p: optim.Adagrad(p, lr=1e-2, lr_decay=1e-3,
                                             initial_accumulator_value=0.1)),
    "adagrad-fused": optimizer(lambda p: optim.Adagrad(p, lr=1e-2, fused=True)),
    "adadelta-foreach": optimizer(lambda p: optim.Adadelta(p, lr=1.0, weight_decay=1e-3,
                                                       foreach=True)),
    "adamax": optimizer(lambda p: optim.Adamax(p, lr=1e-2)),
    "nadam-decoupled": optimizer(lambda p: optim.NAdam(p, lr=1e-2, decoupled_weight_decay=True,
                                                   weight_decay=0.1)),
    "nadam-foreach": optimizer(lambda p: optim.NAdam(p, lr=1e-2, foreach=True)),
    "radam-decoupled": optimizer(lambda p: optim.RAdam(p, lr=1e-2, decoupled_weight_decay=True,
                                                   weight_decay=0.1)),
    "rmsprop-centered": optimizer(lambda p: optim.RMSprop(p, lr=1e-2, centered=True,
                                                      momentum=0.5)),
    "rprop": optimizer(lambda p: optim.Rprop(p, lr=1e-2)),
    "asgd": optimizer(lambda p: optim.ASGD(p, lr=1e-2, t0=2)),
    "asgd-foreach": optimizer(lambda p: optim.ASGD(p, lr=1e-2, t0=2, foreach=True)),
    "lbfgs-strong-wolfe": optimizer(lambda p: optim.LBFGS(p, lr=1, history_size=3, max_iter=4,
                                                      line_search_fn="strong_wolfe"),
                                    closure=True),
    "adafactor-float16": optimizer(lambda p: optim.Adafactor(p, lr=1e-2), torch.float16),
}
if hasattr(optim, "Muon"):
    def _muon(at: int) -> dict[str, Any]:
        model = torch.nn.Sequential(torch.nn.Linear(4, 6, bias=False), torch.nn.Tanh(),
                                    torch.nn.Linear(6, 2, bias=False))
        return {"model": model, "opt": optim.Muon(model.parameters(), lr=1e-2)}
    OPTIMIZERS["muon"] = _muon

SCHEDULERS: dict[str, Build] = {
    "steplr": scheduled(lambda o: L.StepLR(o, 2, 0.5)),
    "multisteplr-repeated-milestone": scheduled(lambda o: L.MultiStepLR(o, [2, 3, 3, 5], 0.5)),
    "exponentiallr": scheduled(lambda o: L.ExponentialLR(o, 0.9)),
    "cosineannealinglr": scheduled(lambda o: L.CosineAnnealingLR(o, 4, eta_min=1e-3)),
    "cosine-warm-restarts": scheduled(lambda o: L.CosineAnnealingWarmRestarts(
        o, 2, T_mult=2, eta_min=1e-3)),
    "onecyclelr-adam-betas": scheduled(lambda o: L.OneCycleLR(o, 0.1, total_steps=10),
                                       opt=lambda p: optim.Adam(p, lr=1e-2)),
    "onecyclelr-three-phase-linear": scheduled(lambda o: L.OneCycleLR(
        o, 0.1, total_steps=10, anneal_strategy="linear", three_phase=True)),
    "onecyclelr-tensor-lr": scheduled(lambda o: L.OneCycleLR(o, 0.1, total_steps=10,
                                                             cycle_momentum=False),
                                      opt=lambda p: optim.Adam(p, lr=torch.tensor(0.01),
                                                           foreach=False)),
    "cycliclr-triangular2": scheduled(lambda o: L.CyclicLR(o, 0.01, 0.1, step_size_up=2,
                                                           mode="triangular2")),
    "cycliclr-exp-range": scheduled(lambda o: L.CyclicLR(o, 0.01, 0.1, step_size_up=2,
                                                         mode="exp_range", gamma=0.9)),
    "cycliclr-lambda-scale-fn": scheduled(lambda o: L.CyclicLR(
        o, 0.01, 0.1, step_size_up=2, scale_fn=lambda x: 0.5 ** x, scale_mode="cycle")),
    "cycliclr-callable-scale-fn": scheduled(lambda o: L.CyclicLR(
        o, 0.01, 0.1, step_size_up=2, scale_fn=HalfLife(), scale_mode="iterations")),
    "linearlr": scheduled(lambda o: L.LinearLR(o, 0.2, 1.0, total_iters=4)),
    "constantlr": scheduled(lambda o: L.ConstantLR(o, 0.3, total_iters=3)),
    "polynomiallr": scheduled(lambda o: L.PolynomialLR(o, total_iters=6, power=2.0)),
    "sequentiallr": scheduled(lambda o: L.SequentialLR(
        o, [L.LinearLR(o, 0.2, total_iters=2), L.ExponentialLR(o, 0.8), L.StepLR(o, 2, 0.5)],
        [2, 4])),
    "chainedscheduler": scheduled(lambda o: L.ChainedScheduler(
        [L.ConstantLR(o, 0.5, total_iters=3), L.ExponentialLR(o, 0.9)])),
    "reducelronplateau": scheduled(lambda o: L.ReduceLROnPlateau(
        o, patience=0, factor=0.5, cooldown=1, threshold=0.5)),
    "reducelronplateau-max-abs": scheduled(lambda o: L.ReduceLROnPlateau(
        o, mode="max", threshold_mode="abs", patience=1, factor=0.5, min_lr=[0.02])),
    "lambdalr-lambda": scheduled(lambda o: L.LambdaLR(o, lambda s: 0.9 ** s)),
    "lambdalr-callable-object": scheduled(lambda o: L.LambdaLR(o, Warmup(4))),
    "multiplicativelr-lambda": scheduled(lambda o: L.MultiplicativeLR(o, lambda s: 0.95)),
    "cosine-fused-adamw-tensor-lr": scheduled(lambda o: L.CosineAnnealingLR(o, 4),
                                              opt=lambda p: optim.AdamW(p, lr=torch.tensor(0.01),
                                                                    fused=True)),
}

SCALERS: dict[str, Build] = {
    "scaler-sgd-steplr": with_scaler(scheduled(lambda o: L.StepLR(o, 2, 0.5)), {3, 5}),
    "scaler-adam-fused": with_scaler(optimizer(lambda p: optim.Adam(p, lr=1e-2, fused=True)),
                                     {2, 3}),
    "scaler-sgd-fused": with_scaler(optimizer(lambda p: optim.SGD(p, lr=1e-2, momentum=0.9,
                                                              fused=True)), {5}),
    "scaler-onecycle-adamw": with_scaler(scheduled(lambda o: L.OneCycleLR(o, 0.1, total_steps=10),
                                                   opt=lambda p: optim.AdamW(p, lr=1e-2)), {1, 5}),
}


def _groups(at: int) -> dict[str, Any]:
    """Param groups with their own hyperparameters, one holding a frozen parameter."""
    model = net()
    model[0].bias.requires_grad_(False)
    opt = optim.AdamW([{"params": [model[0].weight, model[0].bias], "lr": 1e-2,
                    "weight_decay": 0.0, "name": "encoder"},
                   {"params": [model[2].weight], "lr": 3e-3, "betas": (0.8, 0.9),
                    "amsgrad": True, "name": "head"},
                   {"params": [model[2].bias], "lr": 1e-3, "eps": 1e-6, "name": "bias"}],
                  lr=5e-3)
    return {"model": model, "opt": opt, "sched": L.StepLR(opt, 2, 0.7)}


def _named(at: int) -> dict[str, Any]:
    """An optimizer built from named_parameters (torch keeps param_names in each group)."""
    model = net()
    return {"model": model, "opt": optim.Adam(model.named_parameters(), lr=1e-2)}


def _tensor_betas(at: int) -> dict[str, Any]:
    model = net()
    opt = optim.Adam(model.parameters(), lr=torch.tensor(1e-2), foreach=False,
                 betas=(torch.tensor(0.9), torch.tensor(0.99)))
    return {"model": model, "opt": opt, "sched": L.ExponentialLR(opt, 0.9)}


ADD_AT = 4  # the update before which the head joins the optimizer


def _add_group(o: dict[str, Any], s: int) -> None:
    if s == ADD_AT:
        o["opt"].add_param_group({"params": list(o["model"][2].parameters()), "lr": 0.03,
                                  "momentum": 0.5})


def _progressive(at: int) -> dict[str, Any]:
    """add_param_group after the first save (progressive unfreezing): a rebuilt run adds the
    group before restore() when the saved step is past it, as its loop would have."""
    model = net()
    opt = optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    o = {"model": model, "opt": opt, "sched": L.StepLR(opt, 2, 0.5), "before": _add_group}
    if at >= ADD_AT:
        _add_group(o, ADD_AT)
    return o


class Embedder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4, sparse=True)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x).mean(1))


class OptimizerExtra:
    """A second optimizer, registered as an extra."""

    def __init__(self, opt: optim.Optimizer) -> None:
        self.opt = opt

    def state_dict(self) -> dict[str, Any]:
        return self.opt.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.opt.load_state_dict(state)


def _sparse(kind: str) -> Build:
    def build(at: int) -> dict[str, Any]:
        model = Embedder()
        sparse = (optim.SparseAdam(model.emb.parameters(), lr=1e-2) if kind == "sparseadam"
                  else optim.Adagrad(model.emb.parameters(), lr=1e-1))
        dense = optim.Adam(model.head.parameters(), lr=1e-2)

        def replace(o: dict[str, Any], s: int) -> None:  # integer inputs, two optimizers
            o["model"].zero_grad()
            x, y = torch.randint(0, 10, (8, 3)), torch.randn(8, 2)
            F.mse_loss(o["model"](x), y).backward()
            o["opt"].step()
            dense.step()
        return {"model": model, "opt": sparse, "extras": {"dense": OptimizerExtra(dense)},
                "step": replace}
    return build


def _swa(at: int) -> dict[str, Any]:
    model = net()
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    swa = optim.swa_utils.AveragedModel(model)
    return {"model": model, "opt": opt, "sched": optim.swa_utils.SWALR(opt, 0.05, anneal_epochs=3),
            "extras": {"swa": swa}, "after": lambda o, s: swa.update_parameters(o["model"])}


SETUPS: dict[str, Build] = {
    "groups-hyperparameters-frozen-param": _groups,
    "named-parameters": _named,
    "tensor-lr-and-betas": _tensor_betas,
    "add-param-group-after-first-save": _progressive,
    "sparseadam-embedding": _sparse("sparseadam"),
    "adagrad-sparse-embedding": _sparse("adagrad"),
    "swa-averagedmodel-swalr": _swa,
}

ALL = {**OPTIMIZERS, **SCHEDULERS, **SCALERS, **SETUPS}


@pytest.mark.parametrize("name", list(ALL))
def test_resumed_run_equals_the_uninterrupted_one(tmp_path, name):
    """Saved at step 0, at step 2 twice in a row and at step 5, each time rebuilt and
    restored: the end state equals the uninterrupted run's, bit for bit."""
    build = ALL[name]
    found = diffs(reference(build), interrupted(build, str(tmp_path / "run")))
    assert not found, found[:6]


def test_epoch_scheduler_saved_after_its_step_supersedes_and_resumes(tmp_path):
    """The documented remedy for a per-epoch scheduler: step_done saves the epoch's last
    update (every=3), the scheduler steps after the inner loop, and save() then supersedes
    that generation. Killed at any update, the resumed run equals the uninterrupted one."""
    def build() -> tuple[torch.nn.Module, optim.Optimizer, Any]:
        model = net()
        opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, opt, L.StepLR(opt, 1, 0.5)

    def train(folder: str, stop: int | None) -> dict[str, Any] | None:
        torch.manual_seed(0)
        model, opt, sched = build()
        o = {"model": model, "opt": opt, "sched": None}
        ckpt = unbroken.Checkpointer(folder, model=model, optimizer=opt, scheduler=sched,
                                     every=3)
        step = ckpt.restore()
        for epoch in range(ckpt.epoch, 3):
            for _ in range(step - 3 * epoch, 3):
                update(o, step + 1)
                step += 1
                ckpt.step_done(step)
                if step == stop:  # killed: nothing after this boundary happens
                    ckpt.close()
                    return None
            sched.step()
            ckpt.epoch = epoch + 1
            ckpt.save()
        out = snapshot({**o, "sched": sched})
        ckpt.close()
        return out

    whole = train(str(tmp_path / "whole"), None)
    for stop in (2, 3, 4, 7):
        folder = str(tmp_path / f"stop{stop}")
        assert train(folder, stop) is None
        found = diffs(whole, train(folder, None))
        assert not found, (stop, found[:6])


def test_a_pre_or_post_add_param_group_generation_into_the_other_shape_is_refused(tmp_path):
    """A generation saved before add_param_group restored into an optimizer that has the
    group, and the reverse: StateMismatch, typed, before anything changes."""
    torch.manual_seed(0)
    o = _progressive(0)
    ckpt = unbroken.Checkpointer(str(tmp_path / "run"), **parts(o))
    ckpt.restore()
    for s in range(1, 6):
        update(o, s)
        ckpt.step_done(s)
        if s in (3, 5):
            ckpt.save()
    ckpt.close()
    for generation, at in ((3, 5), (5, 3)):
        o = _progressive(at)
        with unbroken.Checkpointer(str(tmp_path / "run"), **parts(o)) as ckpt:
            with pytest.raises(StateMismatch, match="groups"):
                ckpt.restore(generation=generation)


def test_what_a_scheduler_or_group_holds_that_cannot_be_stored_is_refused_typed(tmp_path):
    """A plain lambda is dropped by torch's own state_dict (None: the live run's code is
    kept, covered above). A callable lr_lambda whose state holds a function cannot be stored:
    refused when the Checkpointer is built, naming the part and key; a param group added
    later with a set in it is refused by save(), typed, naming the key."""
    class Holder:
        def __init__(self) -> None:
            self.f = math.cos

        def __call__(self, step: int) -> float:
            return 1.0

    model = net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(unbroken.errors.UnsupportedValue, match=r"scheduler.*lr_lambdas\.0\.f"):
        unbroken.Checkpointer(str(tmp_path / "a"), model=model, optimizer=opt,
                              scheduler=L.LambdaLR(opt, Holder()))
    opt = optim.SGD(model[0].parameters(), lr=0.1)
    with unbroken.Checkpointer(str(tmp_path / "b"), model=model, optimizer=opt) as ckpt:
        ckpt.restore()
        opt.add_param_group({"params": list(model[2].parameters()), "tags": {"a", "b"}})
        with pytest.raises(unbroken.errors.UnsupportedValue, match=r"param_groups\.1\.tags"):
            ckpt.save()


# -- defects ----------------------------------------------------------------------------------


@pytest.mark.parametrize("make,dtype", [
    (lambda p: optim.NAdam(p, lr=1e-2), torch.float64),
    (lambda p: optim.NAdam(p, lr=1e-2), torch.bfloat16),
    (lambda p: optim.ASGD(p, lr=1e-2, t0=2), torch.float16),
], ids=["nadam-float64", "nadam-bfloat16", "asgd-float16"])
def test_scalar_optimizer_state_of_low_or_double_precision_params_keeps_its_dtype(
        tmp_path, make, dtype):
    """# DEFECT. Promise: "an interrupted training run continues exactly as if it had never
    stopped" (optimizer moments bit for bit).

    NAdam's ``mu_product`` and ASGD's ``eta``/``mu`` are float32 scalars whatever the
    parameter dtype. A restore of a float64 / bfloat16 / float16 model casts them to the
    parameter's dtype: `load_optimizer_state` sends any state whose dtype differs from the
    parameter's through ``torch.optim.Optimizer.load_state_dict``, whose
    ``_process_value_according_to_param_policy`` casts every non-``step`` tensor. Expected:
    the resumed state equals the uninterrupted one. Got: ``mu_product``/``eta``/``mu`` come
    back float64/bfloat16/float16, and with float64 NAdam the weights differ after the next
    update (~1e-11). The uninterrupted run is deterministic (run twice, equal)."""
    build = optimizer(make, dtype)
    ref = reference(build)
    assert diffs(ref, reference(build)) == []  # torch alone is deterministic here
    found = diffs(ref, interrupted(build, str(tmp_path / "run"), cuts=(3,)))
    assert not found, found[:6]


@pytest.mark.parametrize("saved,live", [
    (lambda o: L.StepLR(o, 2, 0.5), lambda o: L.ExponentialLR(o, 0.9)),
    (lambda o: L.LambdaLR(o, lambda s: 0.9 ** s), lambda o: L.MultiplicativeLR(o, lambda s: 0.9)),
], ids=["steplr-into-exponentiallr", "lambdalr-into-multiplicativelr"])
def test_a_scheduler_of_another_class_is_refused(tmp_path, saved, live):
    """# DEFECT. Promise (README): a continuation refuses "any shape, key or parameter-name
    mismatch (StateMismatch) before changing any live object" (the optimizer's class is
    checked: `test_state.test_another_optimizer_class_is_refused`).

    The scheduler part records no class, and `parts.validate_parts` only refuses saved
    scheduler state that *lacks* a live key (``live - got``), never one with keys the live
    scheduler does not have. A StepLR generation restored into an ExponentialLR is accepted
    silently: torch's ``__dict__.update`` gives the ExponentialLR a stray ``step_size`` and the
    StepLR's gamma 0.5, and it then decays every update where the saved run decayed every
    second one (LambdaLR into MultiplicativeLR: same keys, another schedule). Expected:
    StateMismatch (or MissingState). Got: restore() returns 3, no warning.
    Fix: record the scheduler's class beside its state (as ``optimizer_state`` does) and
    compare it, recursively for SequentialLR/ChainedScheduler, or also refuse ``got - live``."""
    def build(make: Callable[[optim.Optimizer], Any]) -> dict[str, Any]:
        torch.manual_seed(0)
        model = net()
        opt = optim.SGD(model.parameters(), lr=0.1)
        return {"model": model, "opt": opt, "sched": make(opt)}

    o = build(saved)
    with unbroken.Checkpointer(str(tmp_path / "run"), **parts(o)) as ckpt:
        ckpt.restore()
        for s in range(1, 4):
            update(o, s)
            ckpt.step_done(s)
        ckpt.save()
    o = build(live)
    with unbroken.Checkpointer(str(tmp_path / "run"), **parts(o)) as ckpt:
        with pytest.raises(UnbrokenError):
            ckpt.restore()


def test_a_hyperparameter_that_changes_kind_mid_run_is_not_corruption(tmp_path):
    """# DEFECT. Promises: "the newest verified generation" is used, only "a torn or corrupt
    checkpoint is refused by name"; a hyperparameter whose live value differs from the saved
    one is restored with a warning naming it.

    A run switches LBFGS to ``line_search_fn="strong_wolfe"`` at update 3 (after a plain
    warm-up). `optim.optimizer_state_to_torch` raises CorruptCheckpoint when a saved
    hyperparameter is not of the live value's kind (``_same_kind``: 'strong_wolfe' where the
    freshly built optimizer holds None), so `picking.pick_generation` treats the healthy,
    hash-verified generation 4 as corrupt: it falls back to generation 2 and `restore` moves
    generation 4 to ``aside/`` as "corrupt". Expected: restore() == 4 (warning about
    line_search_fn), or a StateMismatch that leaves the folder alone. Got: restore() == 2,
    gen-000000004 set aside as corrupt, two updates silently lost (a log warning only).
    With a single generation the same config change reads "no generation verifies; refusing
    to start from scratch ... move the folder away to start a new run".
    Fix: a kind mismatch of a hyperparameter in a verified generation is a StateMismatch (or
    a hyperparameter change: warn and restore the saved value), never CorruptCheckpoint."""
    def build() -> dict[str, Any]:
        model = net()
        opt = optim.LBFGS(model.parameters(), lr=1, history_size=3, max_iter=4)

        def switch(o: dict[str, Any], s: int) -> None:
            if s == 3:
                o["opt"].param_groups[0]["line_search_fn"] = "strong_wolfe"
        return {"model": model, "opt": opt, "closure": True, "before": switch}

    folder = str(tmp_path / "run")
    torch.manual_seed(0)
    o = build()
    with unbroken.Checkpointer(folder, **parts(o)) as ckpt:
        ckpt.restore()
        for s in range(1, 5):
            update(o, s)
            ckpt.step_done(s)
            if s in (2, 4):
                ckpt.save()
    torch.manual_seed(0)
    o = build()
    with unbroken.Checkpointer(folder, **parts(o)) as ckpt:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got: int | None = ckpt.restore()
        except StateMismatch:
            got = None
    assert os.path.isdir(os.path.join(folder, "gen-000000004")), os.listdir(
        os.path.join(folder, "aside"))
    assert got in (4, None)


def test_verify_deep_accepts_a_generation_after_add_param_group_with_a_scheduler(tmp_path):
    """# DEFECT. Promise: ``unbroken verify --deep`` flags what "would keep it from loading or
    training correctly" (`tools.deep.deep_problems`).

    After ``add_param_group`` (progressive unfreezing) a StepLR keeps ``base_lrs`` with one
    entry per group it was built with; torch steps the new group fine (chainable form) and
    the run saves and resumes bit for bit (`test_resumed_run_equals_the_uninterrupted_one
    [add-param-group-after-first-save]`). `deep._scheduler` requires ``len(base_lrs)`` to equal
    the optimizer's group count, so verify --deep reports this healthy generation as
    *corrupt* ("scheduler 'base_lrs' has 1 entries; expected 2"). Expected: verified. Fix:
    check only ``_last_lr`` against the group count (torch rebuilds it every step), or
    ``base_lrs`` as at most that many."""
    torch.manual_seed(0)
    o = _progressive(0)
    folder = str(tmp_path / "run")
    with unbroken.Checkpointer(folder, **parts(o)) as ckpt:
        ckpt.restore()
        for s in range(1, 6):
            update(o, s)
            ckpt.step_done(s)
        ckpt.save()
    store = open_run(folder)
    record = verify_one(store, store.scan()[-1], None, deep_problems)
    assert record["status"] == "verified", record.get("problems") or record["reason"]
