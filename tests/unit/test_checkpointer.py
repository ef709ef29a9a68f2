"""The Checkpointer through its public API: the seeds' teaching cases, refusals, fallbacks."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from _resealing import reseal

import unbroken
from unbroken.errors import (
    CorruptCheckpoint,
    IdentityMismatch,
    MissingState,
    StateMismatch,
    StoreLocked,
    UpdateBoundaryError,
)


def one_weight(w: float = 1.0):
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(w)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


def grad_one_step(model, opt):
    """One update with gradient exactly 1 (seed 000: v = 0.9 v + g, w = w - 0.1 v)."""
    opt.zero_grad()
    model.weight.grad = torch.ones_like(model.weight)
    opt.step()


def test_momentum_example_full_resume_vs_warm_start(tmp_path):
    model, opt = one_weight()
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        grad_one_step(model, opt)
        assert model.weight.item() == pytest.approx(0.9)
        ckpt.step_done(1)
        ckpt.save()

    resumed, ropt = one_weight(123.0)
    with unbroken.Checkpointer(tmp_path / "run", model=resumed, optimizer=ropt) as ckpt:
        assert ckpt.restore() == 1
        grad_one_step(resumed, ropt)
    assert abs(resumed.weight.item() - 0.71) < 1e-6

    warm, wopt = one_weight(123.0)
    with unbroken.Checkpointer(tmp_path / "warm", model=warm, optimizer=wopt) as ckpt:
        assert ckpt.restore(intent="warm_start", source=tmp_path / "run") == 0
        grad_one_step(warm, wopt)
    assert abs(warm.weight.item() - 0.80) < 1e-6


def test_lesson_variant_v2(tmp_path):
    """Seed 002: at the checkpoint w = 1.0 and v = 2.0; g = 1 gives 0.72 resumed, 0.90 warm."""
    model, opt = one_weight(1.0)
    opt.state[model.weight]["momentum_buffer"] = torch.full_like(model.weight, 2.0)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        ckpt.save(0)
    resumed, ropt = one_weight(5.0)
    with unbroken.Checkpointer(tmp_path / "run", model=resumed, optimizer=ropt) as ckpt:
        ckpt.restore()
        grad_one_step(resumed, ropt)
    assert abs(resumed.weight.item() - 0.72) < 1e-6
    warm, wopt = one_weight(5.0)
    with unbroken.Checkpointer(tmp_path / "warm", model=warm, optimizer=wopt) as ckpt:
        ckpt.restore(intent="warm_start", source=tmp_path / "run")
        grad_one_step(warm, wopt)
    assert abs(warm.weight.item() - 0.90) < 1e-6


def small_run(root, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    ckpt = unbroken.Checkpointer(root, model=model, optimizer=opt, scheduler=sched, **kw)
    return model, opt, sched, ckpt


def train(model, opt, sched, ckpt, n):
    for _ in range(n):
        loss = model(torch.randn(5, 3)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        ckpt.step_done(ckpt.step + 1, loss=loss)


def snapshot(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            [v.clone() for s in opt.state.values() for v in s.values()], torch.get_rng_state())


def unchanged(before, model, opt):
    m, o, r = before
    return (all(torch.equal(m[k], v) for k, v in model.state_dict().items())
            and all(torch.equal(a, b) for a, b in zip(
                o, [v for s in opt.state.values() for v in s.values()]))
            and torch.equal(r, torch.get_rng_state()))


def test_missing_rng_field_is_refused_without_touching_live_state(tmp_path):
    model, opt, sched, ckpt = small_run(tmp_path / "run", every=2)
    train(model, opt, sched, ckpt, 2)
    ckpt.close()
    # Rewrite generation 2 without the numpy stream, as an older tool would have written it.
    gen = tmp_path / "run" / "gen-000000002"
    doc = json.loads((gen / "state.json").read_text())
    del doc["parts"]["rng"]["numpy"]
    reseal(gen, "state.json", json.dumps(doc).encode())

    model2, opt2, sched2, ckpt2 = small_run(tmp_path / "run")
    train(model2, opt2, sched2, ckpt2, 1)  # live state worth protecting
    ckpt2._counters.step = 0
    before = snapshot(model2, opt2)
    with pytest.raises(MissingState, match="rng.numpy"):
        ckpt2.restore()
    assert unchanged(before, model2, opt2)


def test_missing_scheduler_part_is_refused(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        ckpt.save(3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               scheduler=sched) as ckpt:
        with pytest.raises(MissingState, match="'scheduler'"):
            ckpt.restore()


def test_identity_mismatch_names_field_and_values(tmp_path):
    model, opt, sched, ckpt = small_run(
        tmp_path / "run", identity=unbroken.Identity(config={"d": 4}, data="rev-a"))
    ckpt.save(1)
    ckpt.close()
    model, opt, sched, ckpt = small_run(
        tmp_path / "run", identity=unbroken.Identity(config={"d": 4}, data="rev-b"))
    with pytest.raises(IdentityMismatch) as e:
        ckpt.restore()
    assert "data" in str(e.value) and "rev-a" in str(e.value) and "rev-b" in str(e.value)
    ckpt.close()


def test_mixed_generation_is_rejected_and_previous_used(tmp_path):
    """Weights of generation 12 with the optimizer of generation 11: refused, 11 is used."""
    model, opt, sched, ckpt = small_run(tmp_path / "run", every=1)
    train(model, opt, sched, ckpt, 12)
    ckpt.close()
    g11, g12 = tmp_path / "run" / "gen-000000011", tmp_path / "run" / "gen-000000012"
    shutil.copy(g11 / "optimizer.safetensors", g12 / "optimizer.safetensors")
    model2, opt2, sched2, ckpt2 = small_run(tmp_path / "run")
    assert ckpt2.restore() == 11
    assert any("optimizer.safetensors" in why for _, why in ckpt2.rejected)
    # The rejected generation was moved aside, not deleted and not overwritten.
    assert not g12.exists()
    assert len(list((tmp_path / "run" / "aside").iterdir())) == 1
    train(model2, opt2, sched2, ckpt2, 1)
    ckpt2.save()  # the new branch's 12 does not collide with the abandoned one
    assert (tmp_path / "run" / "gen-000000012").exists()
    ckpt2.close()


def test_stamps_catch_a_consistently_resealed_swap(tmp_path):
    """Even with the manifest rewritten to match, a file from another generation is refused."""
    model, opt, sched, ckpt = small_run(tmp_path / "run", every=1)
    train(model, opt, sched, ckpt, 3)
    ckpt.close()
    g2, g3 = tmp_path / "run" / "gen-000000002", tmp_path / "run" / "gen-000000003"
    reseal(g3, "model.safetensors", (g2 / "model.safetensors").read_bytes())
    model2, opt2, sched2, ckpt2 = small_run(tmp_path / "run")
    assert ckpt2.restore() == 2
    assert "another generation" in ckpt2.rejected[0][1]
    ckpt2.close()


def test_leftover_staging_never_replaces_last_generation(tmp_path):
    model, opt, sched, ckpt = small_run(tmp_path / "run", every=1)
    train(model, opt, sched, ckpt, 2)
    ckpt.close()
    staging = tmp_path / "run" / ".staging-000000003-deadbeef"
    shutil.copytree(tmp_path / "run" / "gen-000000002", staging)
    model2, opt2, sched2, ckpt2 = small_run(tmp_path / "run")
    assert not staging.exists()  # the new writer removed the dead writer's debris
    assert ckpt2.restore() == 2
    ckpt2.close()


def test_no_generation_verifies_raises_listing_each(tmp_path):
    model, opt, sched, ckpt = small_run(tmp_path / "run", every=1)
    train(model, opt, sched, ckpt, 2)
    ckpt.close()
    for gen in ("gen-000000001", "gen-000000002"):
        p = tmp_path / "run" / gen / "model.safetensors"
        data = bytearray(p.read_bytes())
        data[-1] ^= 1
        p.write_bytes(bytes(data))
    model2, opt2, sched2, ckpt2 = small_run(tmp_path / "run")
    with pytest.raises(CorruptCheckpoint) as e:
        ckpt2.restore()
    assert "gen-000000001" in str(e.value) and "gen-000000002" in str(e.value)
    assert "content hash" in str(e.value)
    ckpt2.close()


def test_fresh_run_restores_zero(tmp_path):
    model, opt, sched, ckpt = small_run(tmp_path / "run")
    assert ckpt.restore() == 0
    ckpt.close()


def test_renamed_parameters_are_refused(tmp_path):
    model, opt, sched, ckpt = small_run(tmp_path / "run")
    train(model, opt, sched, ckpt, 1)
    ckpt.save()
    ckpt.close()
    # Same shapes, parameters handed to the optimizer in another order: torch's own
    # load_state_dict would silently give each parameter another one's moments.
    torch.manual_seed(0)
    model2 = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    params = list(model2.parameters())
    opt2 = torch.optim.AdamW([params[1], params[0], params[2], params[3]], lr=1e-2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2)
    with unbroken.Checkpointer(tmp_path / "run", model=model2, optimizer=opt2,
                               scheduler=sched2) as ckpt2:
        with pytest.raises(StateMismatch, match="position 0"):
            ckpt2.restore()


def test_model_shape_change_is_refused(tmp_path):
    model, opt, sched, ckpt = small_run(tmp_path / "run")
    ckpt.save(1)
    ckpt.close()
    model2 = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    opt2 = torch.optim.AdamW(model2.parameters())
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2)
    with unbroken.Checkpointer(tmp_path / "run", model=model2, optimizer=opt2,
                               scheduler=sched2) as ckpt2:
        with pytest.raises(StateMismatch, match="0.weight"):
            ckpt2.restore()


def test_warm_start_refuses_config_change_unless_allowed(tmp_path):
    model, opt, sched, ckpt = small_run(tmp_path / "run",
                                        identity=unbroken.Identity(config={"lr": 1}))
    ckpt.save(4)
    ckpt.close()
    for allow, ok in (((), False), (("config",), True)):
        root = tmp_path / f"warm-{ok}"
        model2, opt2, sched2, ckpt2 = small_run(root, identity=unbroken.Identity(config={"lr": 2}))
        if ok:
            assert ckpt2.restore(intent="warm_start", source=tmp_path / "run", allow=allow) == 0
            ckpt2.save(1)
            manifest = json.loads((root / "gen-000000001" / "MANIFEST.json").read_text())
            assert manifest["origin"]["operation"] == "warm_start"
            assert manifest["origin"]["generation"] == 4
            assert manifest["run_id"] != json.loads(
                (tmp_path / "run" / "gen-000000004" / "MANIFEST.json").read_text())["run_id"]
        else:
            with pytest.raises(IdentityMismatch, match="config"):
                ckpt2.restore(intent="warm_start", source=tmp_path / "run")
        ckpt2.close()


def test_warm_start_into_own_folder_is_refused(tmp_path):
    model, opt, sched, ckpt = small_run(tmp_path / "run")
    ckpt.save(1)
    with pytest.raises(unbroken.UnbrokenError, match="own folder"):
        ckpt.restore(intent="warm_start")
    ckpt.close()


def test_step_done_must_count_updates(tmp_path):
    model, opt, sched, ckpt = small_run(tmp_path / "run")
    ckpt.step_done(1)
    with pytest.raises(UpdateBoundaryError, match="step_done\\(3\\)"):
        ckpt.step_done(3)
    ckpt.close()


def test_second_writer_is_refused(tmp_path):
    model, opt, sched, ckpt = small_run(tmp_path / "run")
    with pytest.raises(StoreLocked):
        small_run(tmp_path / "run")
    ckpt.close()
    small_run(tmp_path / "run")[3].close()


def test_retention_keeps_last_and_best(tmp_path):
    model, opt, sched, ckpt = small_run(
        tmp_path / "run", keep=unbroken.Keep(last=2, every=4, best=("val", "min")))
    for step, val in zip(range(1, 10), [5, 4, 1, 3, 6, 7, 8, 9, 9.5]):
        ckpt.step_done(step)
        ckpt.save(metrics={"val": val})
    ckpt.close()
    gens = sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("gen-"))
    assert gens == ["gen-000000003", "gen-000000004", "gen-000000008", "gen-000000009"]


def test_tied_weights_and_extras_round_trip(tmp_path):
    class Counter:
        def __init__(self):
            self.n = 0

        def state_dict(self):
            return {"n": self.n, "hist": (1, 2.5, None, b"\x00")}

        def load_state_dict(self, sd):
            assert sd["hist"] == (1, 2.5, None, b"\x00")
            self.n = sd["n"]

    emb = torch.nn.Embedding(5, 3)
    head = torch.nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    opt = torch.optim.Adam(model.parameters())
    extra = Counter()
    extra.n = 7
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               extras={"counter": extra}) as ckpt:
        model["head"](model["emb"](torch.tensor([1, 2]))).sum().backward()
        opt.step()
        ckpt.save(1)
    emb2 = torch.nn.Embedding(5, 3)
    head2 = torch.nn.Linear(3, 5, bias=False)
    head2.weight = emb2.weight
    model2 = torch.nn.ModuleDict({"emb": emb2, "head": head2})
    opt2 = torch.optim.Adam(model2.parameters())
    extra2 = Counter()
    with unbroken.Checkpointer(tmp_path / "run", model=model2, optimizer=opt2,
                               extras={"counter": extra2}) as ckpt:
        assert ckpt.restore() == 1
    assert extra2.n == 7
    assert model2["head"].weight is model2["emb"].weight
    assert torch.equal(model2["emb"].weight, model["emb"].weight)
    assert torch.equal(opt2.state[model2["emb"].weight]["exp_avg"],
                       opt.state[model["emb"].weight]["exp_avg"])


def test_no_pickle_in_the_format(tmp_path):
    model, opt, sched, ckpt = small_run(tmp_path / "run")
    train(model, opt, sched, ckpt, 1)
    ckpt.save()
    ckpt.close()
    for f in (tmp_path / "run" / "gen-000000001").iterdir():
        head = f.read_bytes()[:2]
        assert head != b"\x80\x04" and head != b"PK", f  # pickle protocol / torch zip
    assert os.path.exists(tmp_path / "run" / "gen-000000001" / "model.safetensors")


def _truncate(g):
    p = g / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-7])


def _flip(g):
    p = g / "optimizer.safetensors"
    data = bytearray(p.read_bytes())
    data[-5] ^= 0x01
    p.write_bytes(bytes(data))


def _no_manifest(g):
    (g / "MANIFEST.json").unlink()


def _edit_manifest(field, value):
    """Edit an artifact's entry and reseal the manifest, so that the size or hash check
    refuses it (an unsealed edit fails the manifest's own checksum first)."""
    def edit(g):
        from unbroken.store.manifest import seal
        m = json.loads((g / "MANIFEST.json").read_text())
        m["artifacts"][0][field] = value
        (g / "MANIFEST.json").write_bytes(seal(m))
    return edit


def _outside(g):
    from unbroken.store.manifest import seal
    m = json.loads((g / "MANIFEST.json").read_text())
    m["artifacts"][0]["name"] = "../gen-000000002/" + m["artifacts"][0]["name"]
    (g / "MANIFEST.json").write_bytes(seal(m))  # resealed: the name check refuses it


@pytest.mark.parametrize("corrupt", [
    _truncate, _flip, _no_manifest, _edit_manifest("size", 1),
    _edit_manifest("xxh3_128", "0" * 32), _outside],
    ids=["truncate", "flip-byte", "delete-manifest", "edit-size", "edit-hash", "outside-name"])
def test_corrupt_newest_falls_back_to_previous_exact_state(tmp_path, corrupt):
    model, opt, sched, ckpt = small_run(tmp_path / "run", every=1)
    train(model, opt, sched, ckpt, 2)
    at_two = snapshot(model, opt)  # state as saved in generation 2 ...
    sched_two = sched.state_dict()
    rng_two = torch.get_rng_state()
    train(model, opt, sched, ckpt, 1)
    ckpt.close()
    corrupt(tmp_path / "run" / "gen-000000003")
    torch.manual_seed(99)
    model2, opt2, sched2, ckpt2 = small_run(tmp_path / "run")
    torch.manual_seed(99)  # live RNG differs from the saved one until the restore
    assert ckpt2.restore() == 2
    assert ckpt2.rejected and "gen-000000003" in ckpt2.rejected[0][0]
    assert unchanged(at_two[:2] + (rng_two,), model2, opt2)  # ... restored bit for bit
    assert sched2.state_dict() == sched_two
    assert not (tmp_path / "run" / "gen-000000003").exists()  # moved aside, not reused
    ckpt2.close()


def test_progress_bar_for_slow_saves_and_loads(tmp_path, monkeypatch, capsys):
    import unbroken._progress as progress

    monkeypatch.setattr(progress, "DELAY", 0.0)  # as if the save took more than a second
    monkeypatch.setattr(progress, "INTERVAL", 0.0)
    monkeypatch.setenv("UNBROKEN_PROGRESS", "1")
    model, opt, sched, ckpt = small_run(tmp_path / "run")
    ckpt.save(1)
    ckpt.close()
    err = capsys.readouterr().err
    assert "saving gen-000000001" in err and "100%" in err and err.endswith("\n")
    model, opt, sched, ckpt = small_run(tmp_path / "run")
    ckpt.restore()
    ckpt.close()
    assert "loading gen-000000001" in capsys.readouterr().err
    monkeypatch.setenv("UNBROKEN_PROGRESS", "0")
    model, opt, sched, ckpt = small_run(tmp_path / "run")
    ckpt.restore()
    ckpt.step_done(2)
    ckpt.save(2)
    ckpt.close()
    assert capsys.readouterr().err == ""


def test_warm_start_may_change_precision_but_continue_may_not(tmp_path):
    model, opt, sched, ckpt = small_run(tmp_path / "run")
    ckpt.save(1)
    ckpt.close()
    half = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).to(torch.bfloat16)
    with unbroken.Checkpointer(tmp_path / "warm", model=half) as ckpt2:
        assert ckpt2.restore(intent="warm_start", source=tmp_path / "run") == 0
    assert torch.equal(half[0].weight, model[0].weight.to(torch.bfloat16))
    opt3 = torch.optim.AdamW(half.parameters(), lr=1e-2)
    sched3 = torch.optim.lr_scheduler.StepLR(opt3, step_size=2)
    with unbroken.Checkpointer(tmp_path / "run", model=half, optimizer=opt3,
                               scheduler=sched3) as ckpt3:
        with pytest.raises(StateMismatch, match="bfloat16"):
            ckpt3.restore()


@pytest.mark.parametrize("epoch", [-1, 0, 2**63 - 1])
def test_an_epoch_sentinel_saved_is_restored(tmp_path, epoch):
    """Whatever int64 epoch a run keeps (-1 for "not started" is common) restores as saved:
    restore bounds the counters it reads to what a save can write."""
    model = torch.nn.Linear(2, 2)
    with unbroken.Checkpointer(tmp_path / "run", model=model) as ckpt:
        ckpt.epoch = epoch
        ckpt.save(1)
    with unbroken.Checkpointer(tmp_path / "run", model=model) as again:
        assert again.restore() == 1 and again.epoch == epoch


def test_an_epoch_outside_int64_is_refused_at_save_not_at_restore(tmp_path):
    model = torch.nn.Linear(2, 2)
    with unbroken.Checkpointer(tmp_path / "run", model=model) as ckpt:
        ckpt.epoch = 2**63
        with pytest.raises(unbroken.errors.UnsupportedValue, match="epoch"):
            ckpt.save(1)
