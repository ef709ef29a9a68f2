"""The next-step fixture: a run saved with ``next_step_fixture=True`` records the update after
each save; ``unbroken verify --deep --factory`` restores the generation into objects the
user's factory builds, replays that update and compares. A factory that rebuilds the run
faithfully passes; one whose restore would not continue the run (a part left out) fails,
naming the generation and what differed."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from unbroken.cli import main

SCRIPT = '''
import torch, unbroken

class Noisy(torch.utils.data.Dataset):
    def __len__(self):
        return 48
    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(4, generator=g) + 0.1 * torch.randn(4), torch.tensor(i % 3)

def build(dropout=0.3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(dropout),
                                torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    sampler = unbroken.ResumableSampler(48, batch_size=4, seed=1)
    loader = unbroken.ResumableLoader(unbroken.seeded(Noisy(), seed=2), sampler)

    def step(batch):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()

    return {"model": model, "optimizer": opt, "scheduler": sched, "data": loader,
            "step": step}

def factory():
    return build()

def train(run, until):
    parts = build()
    ckpt = unbroken.Checkpointer(run, model=parts["model"], optimizer=parts["optimizer"],
                                 scheduler=parts["scheduler"], data=parts["data"], every=3,
                                 next_step_fixture=True)
    step = ckpt.restore()
    for batch in parts["data"]:
        parts["step"](batch)
        step += 1
        ckpt.step_done(step)
        if step == until:
            break
    ckpt.close()
'''


@pytest.fixture
def run(tmp_path, monkeypatch):
    (tmp_path / "nsmodel.py").write_text(textwrap.dedent(SCRIPT))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    sys.modules.pop("nsmodel", None)
    import nsmodel

    nsmodel.train(str(tmp_path / "run"), 7)
    yield tmp_path / "run"
    sys.modules.pop("nsmodel", None)


def test_the_update_after_each_save_is_recorded_and_replays(run, capsys):
    names = sorted(p.name for p in (run / "fixtures").iterdir())
    assert names == ["gen-000000003.json", "gen-000000006.json"]
    doc = json.loads((run / "fixtures" / "gen-000000003.json").read_text())
    assert doc["step"] == 4 and len(doc["ids"]) == 4 and doc["model"] and doc["optimizer"]
    assert main(["verify", str(run), "--deep", "--factory", "nsmodel:factory", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [g["status"] for g in out["generations"]] == ["verified", "verified"]
    assert all(g["next_step"]["step"] == g["generation"] + 1 and g["next_step"]["ids_checked"]
               for g in out["generations"])
    assert sorted(p.name for p in run.iterdir()) == ["LOCK", "RUN.json", "fixtures",
                                                     "gen-000000003", "gen-000000006"]


def test_a_replay_that_does_not_continue_the_run_fails_naming_what_differs(run, capsys,
                                                                           tmp_path):
    """The code changed since the save (another dropout rate): every byte verifies, the
    restore succeeds, and the replayed update differs from the one the run took."""
    (tmp_path / "nsbad.py").write_text(
        "import nsmodel\n\ndef factory():\n    return nsmodel.build(dropout=0.5)\n")
    assert main(["verify", str(run), "--json"]) == 0
    capsys.readouterr()
    code = main(["verify", str(run), "--deep", "--factory", "nsbad:factory", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1
    bad = out["generations"][0]
    assert bad["status"] == "corrupt" and "gen-000000003.json" in bad["reason"]
    assert "model state differs" in bad["reason"]


def test_factory_needs_deep_and_a_usable_result(run, capsys, tmp_path):
    assert main(["verify", str(run), "--factory", "nsmodel:factory"]) == 2
    (tmp_path / "nsnone.py").write_text("def factory():\n    return 3\n")
    assert main(["verify", str(run), "--deep", "--factory", "nsnone:factory"]) == 2
    assert "must return a dict with 'model' and 'step'" in capsys.readouterr().err


def test_a_fixture_recorded_before_the_digest_change_still_replays(run, capsys):
    """Fixtures of schema 1 (before 2026-12-05) hold digests of tensors off the CPU in their
    old form; they are compared in that form (on the CPU both forms are one)."""
    for path in (run / "fixtures").iterdir():
        doc = json.loads(path.read_text())
        assert doc["schema"] == "unbroken.fixture/2"
        path.write_text(json.dumps({**doc, "schema": "unbroken.fixture/1"}))
    assert main(["verify", str(run), "--deep", "--factory", "nsmodel:factory", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [g["status"] for g in out["generations"]] == ["verified", "verified"]
    for path in (run / "fixtures").iterdir():
        path.write_text(path.read_text().replace("fixture/1", "fixture/0"))
    assert main(["verify", str(run), "--deep", "--factory", "nsmodel:factory", "--json"]) != 0
