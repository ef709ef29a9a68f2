"""`unbroken.tools.deep`: the checks behind ``unbroken verify --deep``, on real generations.

A run of a real Checkpointer is read back verified and decoded; its tree has no problem.
Each kind of damage a hash cannot see (a NaN weight, an optimizer moment of another shape,
an impossible hyperparameter, an infinite loss scale, ...) is then made in memory and must be
named. Finally the acceptance path on disk: a generation rewritten with the bad tensor and
resealed (sizes, hashes and the manifest's checksum made to agree) passes plain verification
and is refused by the deep checks."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import unbroken
from unbroken._runview import open_run, verify_one
from unbroken.state.generation import decode_generation, encode_generation
from unbroken.state.optim import optimizer_state
from unbroken.store.manifest import Artifact, Manifest
from unbroken.tools import deep
from unbroken.tools.deep import deep_problems
from unbroken.torture._case import Case

Tree = dict[str, Any]


def make_run(folder: Path) -> None:
    """Two updates of a small model with AdamW, StepLR and a (CPU) GradScaler, saved."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    scaler = torch.amp.GradScaler("cpu")
    ckpt = unbroken.Checkpointer(folder, model=model, optimizer=opt, scheduler=sched,
                                 scaler=scaler)
    for step in (1, 2):
        loss = model(torch.randn(5, 3)).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        ckpt.step_done(step, loss=loss)
    ckpt.save()
    ckpt.close()


def read(folder: Path) -> tuple[Any, Any, Tree, dict[str, str]]:
    """The newest generation of ``folder``, read verified and decoded, as restore reads it."""
    store = open_run(str(folder))
    info = store.scan()[-1]
    files = store.read_verified(info)
    tree, meta = decode_generation(files, info.path)
    return store, info, tree, meta


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("deep") / "run"
    make_run(folder)
    return folder


@pytest.fixture
def gen(run: Path) -> tuple[Tree, Manifest, str]:
    """A fresh copy of the decoded tree (tensors cloned: writable), its manifest, its folder."""
    _, info, tree, _ = read(run)
    tree = copy.deepcopy(tree)  # (deepcopy clones every tensor)
    return tree, info.manifest, info.path


def one(problems: list[str], *words: str) -> str:
    """The single problem, after checking that it names every one of ``words``."""
    assert len(problems) == 1, problems
    for w in words:
        assert w in problems[0], (w, problems[0])
    return problems[0]


# -- a real generation is clean ---------------------------------------------------------------


def test_a_real_generation_has_no_problem(gen: tuple[Tree, Manifest, str]) -> None:
    tree, manifest, where = gen
    assert set(tree) >= {"model", "optimizer", "scheduler", "scaler"}
    assert deep_problems(tree, manifest, where) == []


# -- damage in memory, each named ---------------------------------------------------------------


def test_a_nan_weight_is_named_with_its_count_and_first_index(gen: tuple[Tree, Manifest, str]
                                                              ) -> None:
    tree, manifest, where = gen
    w = tree["model"]["0.weight"]
    w[1, 2] = math.nan
    w[3, 0] = math.nan
    w[2, 1] = math.inf
    one(deep_problems(tree, manifest, where), f"{where}/model.safetensors", "'0.weight'",
        "2 NaN and 1 inf of 12 values", "index [1, 2]", "[4, 3]", "expected finite")


def test_an_inf_in_a_trained_weight_is_named(gen: tuple[Tree, Manifest, str]) -> None:
    tree, manifest, where = gen
    tree["model"]["1.bias"][1] = -math.inf
    one(deep_problems(tree, manifest, where), "'1.bias'", "0 NaN and 1 inf", "index [1]")


def test_inf_in_a_tensor_nothing_trains_is_allowed_nan_is_not(gen: tuple[Tree, Manifest, str]
                                                              ) -> None:
    """A persistent attention mask holds -inf by design; NaN is never legitimate."""
    tree, manifest, where = gen
    tree["model"]["mask"] = torch.tensor([[0.0, -math.inf], [0.0, 0.0]])
    assert [p for p in deep_problems(tree, manifest, where) if "mask" in p] == []
    tree["model"]["mask"][1, 1] = math.nan
    one([p for p in deep_problems(tree, manifest, where) if "'mask'" in p],
        "1 NaN of 4 values", "index [1, 1]", "expected no NaN")


def test_a_nan_optimizer_moment_is_named(gen: tuple[Tree, Manifest, str]) -> None:
    tree, manifest, where = gen
    tree["optimizer"]["state"]["1.weight"]["exp_avg_sq"][0, 3] = math.nan
    one(deep_problems(tree, manifest, where), f"{where}/optimizer.safetensors",
        "optimizer state['1.weight']['exp_avg_sq']", "1 NaN", "index [0, 3]")


def test_a_moment_of_another_shape_is_named(gen: tuple[Tree, Manifest, str]) -> None:
    tree, manifest, where = gen
    tree["optimizer"]["state"]["0.weight"]["exp_avg"] = torch.zeros(2, 4)
    one(deep_problems(tree, manifest, where), f"{where}/optimizer.safetensors",
        "state['0.weight']['exp_avg']", "shape [2, 4]", "expected [4, 3]",
        "torch.optim.adamw.AdamW")


def test_a_moment_in_another_layout_of_the_saved_tensor_is_no_problem(
        gen: tuple[Tree, Manifest, str]) -> None:
    """A module that saves its own way (`_save_to_state_dict`) may store a parameter
    transposed: the saved tensor's shape is then not the parameter's, which its optimizer
    state mirrors. Without the live model, only the number of elements is judged (a restore
    compares with the live parameter itself: test_own_layout_optimizer.py)."""
    tree, manifest, where = gen
    tree["optimizer"]["state"]["0.weight"]["exp_avg"] = torch.zeros(3, 4)
    assert deep_problems(tree, manifest, where) == []


def test_an_empty_moment_of_an_impossible_shape_is_named(gen: tuple[Tree, Manifest, str]
                                                         ) -> None:
    """Zero elements, so nothing to be non-finite, and no byte on disk: only the shape tells."""
    tree, manifest, where = gen
    tree["optimizer"]["state"]["0.bias"]["exp_avg_sq"] = torch.empty(2**40, 0)
    one(deep_problems(tree, manifest, where), "state['0.bias']['exp_avg_sq']",
        f"shape [{2**40}, 0]", "expected [4]")


def test_a_negative_learning_rate_is_named(gen: tuple[Tree, Manifest, str]) -> None:
    tree, manifest, where = gen
    tree["optimizer"]["param_groups"][0]["lr"] = -1.0
    one(deep_problems(tree, manifest, where), f"{where}/state.json",
        "optimizer param group 0 'lr' is -1.0", "expected a finite number >= 0")


@pytest.mark.parametrize("key, value, words", [
    ("betas", (0.9, 1.0), ["'betas'[1] is 1.0", "< 1"]),
    ("betas", (math.nan, 0.999), ["'betas'[0] is nan"]),
    ("eps", -1e-8, ["'eps' is -1e-08"]),
    ("weight_decay", math.inf, ["'weight_decay' is inf"]),
    ("lr", torch.tensor(math.nan), ["optimizer.safetensors", "'lr' is tensor(nan)"]),
    pytest.param("lr", 10**5000, ["'lr' is <an int of"], id="lr-int-of-5001-digits"),
])
def test_impossible_hyperparameters_are_named(gen: tuple[Tree, Manifest, str], key: str,
                                              value: Any, words: list[str]) -> None:
    tree, manifest, where = gen
    tree["optimizer"]["param_groups"][0][key] = value
    one(deep_problems(tree, manifest, where), "param group 0", *words)


@pytest.mark.parametrize("step, words", [
    (torch.tensor(-1.0), ["tensor(-1.0)"]),
    (torch.tensor(math.inf), ["tensor(inf)"]),
    (torch.tensor([1.0, 2.0]), ["a tensor of shape [2]"]),
    ("2", ["'2'"]),
])
def test_an_impossible_step_is_named(gen: tuple[Tree, Manifest, str], step: Any,
                                     words: list[str]) -> None:
    tree, manifest, where = gen
    tree["optimizer"]["state"]["1.bias"]["step"] = step
    one(deep_problems(tree, manifest, where), "state['1.bias']['step']",
        "finite scalar >= 0", *words)


def test_state_of_a_parameter_the_model_lacks_is_named(gen: tuple[Tree, Manifest, str]) -> None:
    tree, manifest, where = gen
    state = tree["optimizer"]["state"]
    state["ghost.weight"] = state.pop("1.weight")
    problems = deep_problems(tree, manifest, where)
    assert len(problems) == 2, problems
    assert any("no param group lists 'ghost.weight'" in p for p in problems)
    assert any("the model has no parameter 'ghost.weight'" in p for p in problems)
    tree["optimizer"]["param_groups"][0]["params"][2] = "ghost.weight"  # listed, still unknown
    problems = deep_problems(tree, manifest, where)
    assert len(problems) == 2, problems
    assert any("param group 0 lists parameter 'ghost.weight'" in p for p in problems)
    assert any("the model has no parameter 'ghost.weight'" in p for p in problems)


def test_a_group_listing_a_parameter_the_model_lacks_is_named(gen: tuple[Tree, Manifest, str]
                                                              ) -> None:
    tree, manifest, where = gen
    tree["optimizer"]["param_groups"][0]["params"].append("ghost.bias")
    one(deep_problems(tree, manifest, where), "param group 0 lists parameter 'ghost.bias'",
        "the model does not have")


def test_an_optimizer_part_without_groups_is_named(gen: tuple[Tree, Manifest, str]) -> None:
    tree, manifest, where = gen
    del tree["optimizer"]["param_groups"]
    one(deep_problems(tree, manifest, where), "needs 'param_groups'")


def test_an_infinite_loss_scale_is_named(gen: tuple[Tree, Manifest, str]) -> None:
    tree, manifest, where = gen
    tree["scaler"]["scale"] = math.inf
    one(deep_problems(tree, manifest, where), f"{where}/state.json", "scaler 'scale' is inf",
        "finite number > 0")


@pytest.mark.parametrize("edit, words", [
    (lambda s: s.update(backoff_factor=0.0), ["'backoff_factor' is 0.0"]),
    (lambda s: s.update(growth_interval=0), ["'growth_interval' is 0", ">= 1"]),
    (lambda s: s.update(_growth_tracker=1.5), ["'_growth_tracker' is 1.5"]),
    (lambda s: s.pop("growth_factor"), ["lacks ['growth_factor']"]),
])
def test_an_impossible_scaler_state_is_named(gen: tuple[Tree, Manifest, str],
                                             edit: Callable[[dict[str, Any]], Any],
                                             words: list[str]) -> None:
    tree, manifest, where = gen
    edit(tree["scaler"])
    one(deep_problems(tree, manifest, where), "scaler", *words)


@pytest.mark.parametrize("edit, words", [
    (lambda s: s.update(base_lrs=[0.01, 0.01]), ["'base_lrs' has 2 entries",
                                                 "expected at most 1"]),
    (lambda s: s.update(_last_lr=[math.nan]), ["'_last_lr'[0] is nan"]),
    (lambda s: s.update(base_lrs=0.01), ["'base_lrs' is 0.01", "a list"]),
    (lambda s: s.pop("last_epoch"), ["lacks ['last_epoch']"]),
    (lambda s: s.update(last_epoch=-7), ["'last_epoch' is -7"]),
])
def test_an_impossible_scheduler_state_is_named(gen: tuple[Tree, Manifest, str],
                                                edit: Callable[[dict[str, Any]], Any],
                                                words: list[str]) -> None:
    tree, manifest, where = gen
    edit(tree["scheduler"])
    one(deep_problems(tree, manifest, where), f"{where}/state.json", "scheduler", *words)


# -- what legitimately varies is not flagged ---------------------------------------------------


def states_of(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> Tree:
    """The model and optimizer parts of ``model`` trained ``steps`` updates with ``opt``."""
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 3)).pow(2).mean().backward()
        opt.step()
    return {"model": model.state_dict(), "optimizer": optimizer_state(model, opt)}


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adafactor(ps, lr=1e-2),  # factored rows and columns
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    lambda ps: torch.optim.RMSprop(ps, lr=1e-2, centered=True, momentum=0.5),
    lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    lambda ps: torch.optim.Rprop(ps, lr=1e-2),
    lambda ps: torch.optim.ASGD(ps, lr=1e-2),
    lambda ps: torch.optim.NAdam(ps, lr=1e-2),
])
def test_torch_optimizers_states_pass(gen: tuple[Tree, Manifest, str],
                                      make: Callable[[Any], torch.optim.Optimizer]) -> None:
    _, manifest, where = gen
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    tree = states_of(model, make(model.parameters()))
    assert deep_problems(tree, manifest, where) == []


def test_what_legitimately_varies_passes(gen: tuple[Tree, Manifest, str]) -> None:
    _, manifest, where = gen
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # an optimizer without state yet, parts absent, a disabled scaler, extras of any shape
    fresh = {"model": model.state_dict(), "optimizer": optimizer_state(model, opt),
             "scaler": torch.amp.GradScaler("cpu", enabled=False).state_dict(),
             "extra.ema": {"x": torch.full((2, 0, 7), math.nan), "y": [1, None]}}
    assert deep_problems(fresh, manifest, where) == []
    assert deep_problems({}, manifest, where) == []
    assert deep_problems({"model": {"w": torch.tensor([-math.inf])}}, manifest, where) == []
    # a third-party optimizer keeps its state as it likes (GaLore projects its moments)
    tree = states_of(model, opt)
    tree["optimizer"]["class"] = "galore_torch.adamw.AdamW"
    tree["optimizer"]["state"]["0.weight"]["exp_avg"] = torch.zeros(2, 3)
    assert deep_problems(tree, manifest, where) == []


def test_torch_schedulers_states_pass(gen: tuple[Tree, Manifest, str]) -> None:
    """ReduceLROnPlateau holds inf by design (best, mode_worse); chained schedulers nest."""
    _, manifest, where = gen
    L = torch.optim.lr_scheduler
    for make in (lambda o: L.ReduceLROnPlateau(o),
                 lambda o: L.SequentialLR(o, [L.ConstantLR(o), L.ExponentialLR(o, 0.9)], [2]),
                 lambda o: L.ChainedScheduler([L.ConstantLR(o), L.ExponentialLR(o, 0.9)]),
                 lambda o: L.OneCycleLR(o, 1.0, total_steps=10),
                 lambda o: L.LambdaLR(o, lambda s: 1.0)):
        model = torch.nn.Linear(3, 2)
        groups: list[dict[str, Any]] = [{"params": [model.weight]}, {"params": [model.bias]}]
        opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
        sched = make(opt)
        tree = states_of(model, opt, 1)
        tree["scheduler"] = sched.state_dict()
        assert deep_problems(tree, manifest, where) == [], type(sched).__name__
        tree["scheduler"]["_last_lr"] = [0.1]  # one for two groups: a group added since
        assert deep_problems(tree, manifest, where) == [], type(sched).__name__
        tree["scheduler"]["_last_lr"] = [0.1] * 3  # three learning rates for two groups
        assert len(deep_problems(tree, manifest, where)) == 1, type(sched).__name__


def test_chunked_scan_and_low_precision_dtypes(gen: tuple[Tree, Manifest, str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The first bad index is found across chunks; float8 (no isinf kernel) is read too."""
    _, manifest, where = gen
    monkeypatch.setattr(deep, "_CHUNK", 4)
    t = torch.zeros(3, 5)
    t[2, 3] = math.nan
    t[2, 4] = math.inf
    one(deep_problems({"model": {"w": t, "b": t.to(torch.bfloat16)},
                       "optimizer": {"param_groups": [{"params": ["w", "b"]}], "state": {}}},
                      manifest, where)[:1], "'w'", "1 NaN and 1 inf of 15", "index [2, 3]")
    f8 = torch.zeros(6).to(torch.float8_e4m3fn)
    f8[5] = math.nan
    one(deep_problems({"model": {"w": f8}}, manifest, where), "float8_e4m3fn", "index [5]")
    z = torch.zeros(2, 3, dtype=torch.complex64)
    z[1, 0] = complex(0.0, math.nan)
    one(deep_problems({"model": {"z": z}}, manifest, where), "complex64", "index [1, 0]")


def test_sharded_shapes_come_from_the_shard_index(gen: tuple[Tree, Manifest, str]) -> None:
    """FSDP2: the tree lacks sharded tensors; shards.json gives their global shapes. Without
    it, names and shapes are not judged (nothing is known of the sharded tensors)."""
    tree, manifest, where = gen
    del tree["model"]["0.weight"]
    del tree["optimizer"]["state"]["0.weight"]["exp_avg"]
    with_index = dataclasses.replace(
        manifest, artifacts=[*manifest.artifacts, Artifact("shards.json", 2, "0" * 32)])
    assert deep_problems(tree, with_index, where) == []

    def entry(size: list[int]) -> dict[str, Any]:
        return {"dtype": "F32", "size": size, "chunks": []}
    index = {"tensors": {json.dumps(["model", "0.weight"]): entry([4, 3]),
                         json.dumps(["optimizer", "state", "0.weight", "exp_avg"]): entry([4, 3])}}
    assert deep_problems(tree, with_index, where, shards=index) == []
    index["tensors"][json.dumps(["optimizer", "state", "0.weight", "exp_avg"])] = entry([12])
    one(deep_problems(tree, with_index, where, shards=index), "['exp_avg'] has shape [12]",
        "expected [4, 3]")


# -- the acceptance path: resealed on disk ------------------------------------------------------


def reseal(folder: Path, info: Any, tree: Tree, meta: dict[str, str]) -> list[str]:
    """Rewrite the generation from ``tree`` and make the manifest agree (sizes, hashes and its
    checksum), with the torture suite's helper: what a tool or an attacker could do."""
    case = Case(0, random.Random(0), str(folder), [info.path], outside="", marker="")
    changed = []
    for name, chunks in encode_generation(tree, meta).items():
        data = b"".join(bytes(c) for c in chunks)
        if data != Case.read(info.path, name):
            case.write(info.path, name, data)
            case.restamp(info.path, name)
            changed.append(name)
    return changed


def bad_moment(tree: Tree) -> str:
    tree["optimizer"]["state"]["0.weight"]["exp_avg"] = torch.empty(2**40, 0)
    return f"state['0.weight']['exp_avg'] has shape [{2**40}, 0]"


def nan_weight(tree: Tree) -> str:
    tree["model"]["1.weight"][0, 1] = math.nan
    return "model tensor '1.weight' (float32 [2, 4]) holds 1 NaN and 0 inf"


@pytest.mark.parametrize("damage", [bad_moment, nan_weight])
def test_a_resealed_generation_passes_verify_and_fails_deep(
        run: Path, tmp_path: Path, damage: Callable[[Tree], str],
        capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    _, info, tree, meta = read(folder)
    tree = copy.deepcopy(tree)
    words = damage(tree)
    changed = reseal(folder, info, tree, meta)
    assert changed and "MANIFEST.json" not in changed

    store = open_run(str(folder))
    info = store.scan()[-1]
    assert verify_one(store, info)["status"] == "verified"  # plain verification: fine
    _, info, tree, _ = read(folder)
    one(deep_problems(tree, info.manifest, info.path), words)
    # the acceptance path: the command line says the same
    from unbroken.cli import main

    assert main(["verify", str(folder)]) == 0
    capsys.readouterr()
    assert main(["verify", str(folder), "--deep", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    newest = out["generations"][-1]
    assert newest["status"] == "corrupt" and words in newest["reason"]
    assert newest["problems"]
