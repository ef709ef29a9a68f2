"""Attacks from outside on the named intents (twenty-third session): a misnamed ``allow=`` is
the caller's error, not every generation's corruption; a warm start never casts finite
weights to inf (or clamps them); ``unbroken diff`` compares the identity each generation is
bound to."""

from __future__ import annotations

import json
import os

import pytest
import torch

import unbroken
from unbroken.cli import main as cli_main


def _run(root: str, name: str, scale: float = 1.0, identity: unbroken.Identity | None = None,
         dtype: torch.dtype = torch.float32) -> str:
    run = os.path.join(root, name)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    ck = unbroken.Checkpointer(run, model=model, identity=identity)
    ck.restore()
    ck.step_done(1)
    ck.save()
    ck.close()
    return run


@pytest.mark.parametrize("intent, allow", [("warm_start", ["confg"]), ("warm_start", "tokens"),
                                           ("continue", ["config"])])
def test_a_misnamed_allow_is_a_usage_error_before_any_generation_is_read(
        tmp_path: object, intent: str, allow: object) -> None:
    src = _run(str(tmp_path), "src", identity=unbroken.Identity(config={"lr": 1}))
    for _ in range(2):  # a second save: two healthy generations that must stay where they are
        ck = unbroken.Checkpointer(src, model=torch.nn.Linear(4, 2),
                                   identity=unbroken.Identity(config={"lr": 1}))
        step = ck.restore()
        ck.step_done(step + 1)
        ck.save()
        ck.close()
    before = sorted(os.listdir(src))
    dst = os.path.join(str(tmp_path), "dst") if intent == "warm_start" else src
    ck = unbroken.Checkpointer(dst, model=torch.nn.Linear(4, 2),
                               identity=unbroken.Identity(config={"lr": 1}))
    with pytest.raises(ValueError, match="allow") as raised:
        ck.restore(intent=intent, source=src if intent == "warm_start" else None,
                   allow=allow)  # type: ignore[arg-type]
    assert not isinstance(raised.value, unbroken.UnbrokenError)  # not "corrupt"
    ck.close()
    assert sorted(os.listdir(src)) == before  # nothing moved aside
    ck = unbroken.Checkpointer(src, model=torch.nn.Linear(4, 2),
                               identity=unbroken.Identity(config={"lr": 1}))
    assert ck.restore() == 3
    ck.close()


# (saved dtype, live dtype, a weight's magnitude, refused?)
_CASTS = [
    (torch.float32, torch.float16, 1e5, True),  # beyond 65504: inf
    (torch.float32, torch.float16, 6e4, False),
    (torch.float64, torch.bfloat16, 1e300, True),
    (torch.float64, torch.float32, 1e39, True),
    (torch.bfloat16, torch.float16, 7e4, True),
    (torch.float32, torch.float8_e4m3fn, 1e3, True),  # beyond 448: clamped without a word
    (torch.float32, torch.float8_e4m3fn, 100.0, False),
    (torch.float32, torch.float8_e5m2, 1e5, True),
    (torch.float16, torch.float32, 6e4, False),  # widening never refused
]


@pytest.mark.parametrize("saved, live, magnitude, refused", _CASTS)
def test_a_warm_start_refuses_a_cast_that_loses_finite_weights(
        tmp_path: object, saved: torch.dtype, live: torch.dtype, magnitude: float,
        refused: bool) -> None:
    run = os.path.join(str(tmp_path), "src")
    model = torch.nn.Linear(4, 2).to(saved)
    with torch.no_grad():
        model.weight.fill_(0.5)
        model.weight[1, 2] = -magnitude
        model.bias.fill_(float("inf"))  # already inf: never the cast's doing
    ck = unbroken.Checkpointer(run, model=model)
    ck.restore()
    ck.step_done(1)
    ck.save()
    ck.close()
    target = torch.nn.Linear(4, 2).to(live)
    before = [p.detach().clone() for p in target.parameters()]
    ck = unbroken.Checkpointer(os.path.join(str(tmp_path), "dst"), model=target)
    try:
        if refused:
            with pytest.raises(unbroken.StateMismatch, match="model tensor 'weight' holds finite"):
                ck.restore(intent="warm_start", source=run)
            for p, b in zip(target.parameters(), before):  # nothing loaded
                assert torch.equal(p.detach().float(), b.float())
        else:
            ck.restore(intent="warm_start", source=run)
            assert torch.isfinite(target.weight.float()).all()
            # (as torch casts inf: float8_e4m3fn, which has none, clamps it)
            assert torch.equal(target.bias.detach().float(),
                               torch.full((2,), float("inf")).to(live).float())
    finally:
        ck.close()


def _diff(a: str, b: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict, str]:
    capsys.readouterr()
    code = cli_main(["diff", a, b, "--json"])
    payload = json.loads(capsys.readouterr().out)
    cli_main(["diff", a, b])
    return code, payload, capsys.readouterr().out


def test_diff_compares_the_identity_each_generation_is_bound_to(
        tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path)
    base = {"lr": 1e-3, "model": {"width": 4, "depth": 2}}
    a = _run(root, "a", identity=unbroken.Identity(config=base, tokenizer="tok-v1"))
    same = _run(root, "same", identity=unbroken.Identity(config=base, tokenizer="tok-v1"))
    code, payload, text = _diff(a, same, capsys)
    assert code == 0 and payload["equal"] and payload["identity"]["status"] == "equal"
    assert "verdict: equal" in text

    deeper = {"lr": 1e-3, "model": {"width": 4, "depth": 3}}
    b = _run(root, "b", identity=unbroken.Identity(config=deeper, tokenizer="tok-v1"))
    code, payload, text = _diff(a, b, capsys)
    assert code == 1 and not payload["equal"]
    keys = {e["key"] for e in payload["identity"]["entries"]}
    assert "config/model/depth" in keys and "tokenizer (content)" not in keys
    assert "identity (config)" in text and "config/model/depth" in text

    c = _run(root, "c", identity=unbroken.Identity(config=base, tokenizer="tok-v2"))
    code, payload, text = _diff(a, c, capsys)
    assert code == 1 and {e["key"] for e in payload["identity"]["entries"]} == {
        "tokenizer (content)"}

    d = _run(root, "d", identity=unbroken.Identity(config=base, tokenizer="tok-v1",
                                                      data="rev-2"))
    code, payload, _ = _diff(a, d, capsys)
    assert code == 1
    only = [e for e in payload["identity"]["entries"] if e["key"] == "data (content)"]
    assert only and only[0]["change"] == "only in B"


def test_allow_given_as_a_generator_is_read_once_and_still_counts(tmp_path: object) -> None:
    src = _run(str(tmp_path), "src", identity=unbroken.Identity(config={"lr": 1}))
    ck = unbroken.Checkpointer(os.path.join(str(tmp_path), "dst"), model=torch.nn.Linear(4, 2),
                               identity=unbroken.Identity(config={"lr": 2}))
    try:
        assert ck.restore(intent="warm_start", source=src,
                          allow=(field for field in ["config"])) == 0
    finally:
        ck.close()


@pytest.mark.parametrize("saved_wrapped", [True, False])
def test_a_model_wrapped_on_one_side_only_is_named_as_such(tmp_path: object,
                                                           saved_wrapped: bool) -> None:
    """A torch.compile'd model's keys start with '_orig_mod.': restored into the bare model
    (or the other way round) the refusal said "another model definition"."""
    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        bare = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        return torch.compile(bare, backend="eager") if saved_wrapped else bare

    run = os.path.join(str(tmp_path), "run")
    ck = unbroken.Checkpointer(run, model=model())
    ck.restore()
    ck.step_done(1)
    ck.save()
    ck.close()
    saved_wrapped = not saved_wrapped
    ck = unbroken.Checkpointer(run, model=model())
    side = "checkpoint" if not saved_wrapped else "live model"
    try:
        with pytest.raises(unbroken.StateMismatch,
                           match=f"the {side}'s keys are the .* with '_orig_mod.' before each "
                                 r"\(a torch.compile'd model"):
            ck.restore()
    finally:
        ck.close()


def test_a_lazy_module_not_yet_run_is_named_not_called_corrupt(tmp_path: object) -> None:
    """Found from outside: restoring into a LazyLinear that had not run yet said "no generation
    verifies ... move the folder away" of a good run."""
    run = os.path.join(str(tmp_path), "run")
    model = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.Linear(4, 1))
    model(torch.zeros(1, 3))
    ck = unbroken.Checkpointer(run, model=model)
    ck.restore()
    ck.step_done(1)
    ck.save()
    ck.close()
    before = sorted(os.listdir(run))
    ck = unbroken.Checkpointer(run, model=torch.nn.Sequential(torch.nn.LazyLinear(4),
                                                              torch.nn.Linear(4, 1)))
    try:
        with pytest.raises(unbroken.StateMismatch, match="'0.weight' is uninitialized"):
            ck.restore()
    finally:
        ck.close()
    assert sorted(os.listdir(run)) == before
