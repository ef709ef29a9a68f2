"""The Accelerate adapter with the real library on CPU.

Acceptance: ``unbroken check`` on examples/accelerate_train.py (2 DataLoader workers, dropout,
augmentation from three RNGs, warmup + cosine, Accelerate's gradient accumulation) SIGKILLs the
run inside an update in the middle of the first epoch, resumes it in a fresh process (which
crosses into the second epoch, through the epoch's shorter last accumulation window), and finds
every update bitwise equal to the uninterrupted run; the stitched traces show every sample of
each epoch exactly once.

In-process: Accelerate's accumulation windows end where unbroken's loader ends them, a torn
newest generation written through the adapter is refused and the previous one continues
bitwise, and setups that cannot resume exactly are refused."""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import GradientAccumulationPlugin  # noqa: E402

import unbroken  # noqa: E402
from unbroken.cli import main  # noqa: E402
from unbroken.integrations import accelerate as ua  # noqa: E402
from unbroken.trace import read_trace  # noqa: E402

ROOT = Path(__file__).parents[2]
EXAMPLE = [sys.executable, str(ROOT / "examples" / "accelerate_train.py")]
SAMPLES, BATCH, ACCUMULATION = 224, 16, 3  # 14 micro-batches an epoch: windows 3,3,3,3,2
AT = (3,)  # inside update 3 of epoch 0 (updates 1-5; epoch 1 is 6-10): one case, 3 processes


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> tuple[int, dict[str, Any], Path]:
    """One ``unbroken check`` of the unchanged example: a case per point of ``AT``, each
    killed inside that update (after its optimizer step, before ``step_done``)."""
    work = tmp_path_factory.mktemp("accelerate-check")
    args = ["check", "--json", "--phase", "mid-update", "--workdir", str(work)]
    for k in AT:
        args += ["--at", str(k)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*args, "--", *EXAMPLE, "--run", str(work / "unused")])
    return code, json.loads(out.getvalue()), work


def updates(path: Path) -> list[dict[str, Any]]:
    return [r for r in read_trace(path) if r["event"] == "update"]


def test_check_on_the_example_says_equivalent(checked):
    code, report, _ = checked
    assert code == 0 and report["verdict"] == "equivalent", report
    assert [c["interrupt_at"] for c in report["cases"]] == list(AT)
    for case in report["cases"]:
        (kill,) = case["kills"]
        assert kill["reached"] and kill["exit_code"] == -9, kill  # a real SIGKILL
        assert case["resumed_from"] == kill["at"] - 1, case  # the killed update is redone
        assert case["verdict"] == "equivalent" and case["first_divergence"] is None


def test_kills_are_mid_epoch_and_windows_follow_accelerate(checked):
    _, _, work = checked
    reference = updates(work / "reference" / "trace.jsonl")
    assert [r["step"] for r in reference] == list(range(1, 11))
    epoch_of = {r["step"]: r["epoch"] for r in reference}
    for k in AT:  # the resume starts between two updates of the same epoch
        assert epoch_of[k - 1] == epoch_of[k], (k, epoch_of)
    # 16 samples a micro-batch, 3 per update; Accelerate closes each epoch's last window
    # after 2 (end_of_dataloader), where unbroken's loader closes it.
    assert [len(r["ids"]) for r in reference] == [48, 48, 48, 48, 32] * 2


def test_every_sample_of_each_epoch_seen_exactly_once_across_the_kill(checked):
    _, report, work = checked
    reference = updates(work / "reference" / "trace.jsonl")
    for i, case in enumerate(report["cases"]):
        folder = work / f"case-{i + 1:02d}"
        killed, resumed = updates(folder / "life-01.jsonl"), updates(folder / "life-02.jsonl")
        start = case["resumed_from"]
        assert [r["step"] for r in killed][-1] == start  # the killed update left no record
        stitched = [r for r in killed if r["step"] <= start] + \
                   [r for r in resumed if r["step"] > start]
        assert [r["step"] for r in stitched] == list(range(1, 11))
        by_epoch: dict[int, list[int]] = {}
        for r in stitched:
            by_epoch.setdefault(r["epoch"], []).extend(r["ids"])
        assert sorted(by_epoch) == [0, 1]
        for ids in by_epoch.values():
            assert sorted(ids) == list(range(SAMPLES))
        assert [r["ids"] for r in stitched] == [r["ids"] for r in reference]
        assert [r["loss"] for r in stitched] == [r["loss"] for r in reference]


# -- in process ------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def fresh_accelerate():
    """Accelerate's state is process-wide (singletons): each test starts from none."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class Points(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(SAMPLES, 8, generator=g)
        self.y = self.x[:, :2].argmax(1)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        return self.x[i] + 0.1 * torch.randn(8), self.y[i]  # augmentation: torch's RNG


def build(root: Path, accumulation: int = ACCUMULATION, every: int | None = 2) -> dict[str, Any]:
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = unbroken.ResumableLoader(
        unbroken.seeded(Points(), seed=0),
        unbroken.ResumableSampler(SAMPLES, batch_size=BATCH, seed=0), accumulation=accumulation)
    total = 2 * math.ceil(len(loader) / accumulation)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / 2, 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))))
    model, opt, loader, sched = ua.prepare(accelerator, model, opt, loader, sched)
    ckpt = ua.checkpointer(accelerator, root, model=model, optimizer=opt, scheduler=sched,
                           data=loader, every=every)
    return dict(accelerator=accelerator, model=model, opt=opt, loader=loader, sched=sched,
                ckpt=ckpt)


def update(run: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> None:
    """One batch of the accumulation window, through Accelerate."""
    accelerator, model = run["accelerator"], run["model"]
    with accelerator.accumulate(model):
        accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
        run["opt"].step()
        run["sched"].step()
        run["opt"].zero_grad()


def train(run: dict[str, Any], until: int) -> dict[int, dict[str, torch.Tensor]]:
    """Train to update ``until`` (across epochs); the weights after each update."""
    accelerator, model, loader, ckpt = (run[k] for k in (
        "accelerator", "model", "loader", "ckpt"))
    step = ckpt.restore()
    weights = {}
    while step < until:
        for x, y in loader:
            update(run, x, y)
            assert accelerator.sync_gradients == loader.at_boundary
            if accelerator.sync_gradients:
                step += 1
                ckpt.step_done(step)
                weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
                if step == until:
                    break
    ckpt.close()
    return weights


def test_windows_and_end_of_dataloader_match_accelerates_own_loader(tmp_path):
    """Over two epochs, the prepared ResumableLoader gives the sync pattern Accelerate's own
    prepared DataLoader gives (a short last window per epoch, end_of_dataloader on its last
    batch), and sync_gradients equals at_boundary at every batch."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    model = accelerator.prepare(torch.nn.Linear(8, 2))
    theirs = accelerator.prepare(torch.utils.data.DataLoader(Points(), batch_size=BATCH))
    ours = ua.prepare_loader(accelerator, unbroken.ResumableLoader(
        unbroken.seeded(Points(), seed=0), unbroken.ResumableSampler(SAMPLES, batch_size=BATCH),
        accumulation=ACCUMULATION))

    def pattern(loader: Any, ours: bool) -> list[tuple[bool, bool]]:
        seen = []
        for _ in range(2):
            for _batch in loader:
                with accelerator.accumulate(model):
                    pass
                seen.append((accelerator.sync_gradients,
                             accelerator.gradient_state.end_of_dataloader))
                if ours:
                    assert loader.at_boundary == accelerator.sync_gradients
        assert not accelerator.gradient_state.in_dataloader  # each pass deregistered
        return seen

    expected = pattern(theirs, False)
    assert expected == pattern(ours, True)
    assert [s for s, _ in expected[:14]] == [False, False, True] * 4 + [False, True]


def test_torn_newest_generation_is_refused_and_the_previous_continues(tmp_path):
    reference = train(build(tmp_path / "reference", every=None), 6)
    root = tmp_path / "run"
    train(build(root), 6)  # generations 2, 4 and 6 (6 is in the second epoch)
    newest = root / "gen-000000006"
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-7])  # torn: the file's tail never landed
    resumed = build(root)
    assert resumed["ckpt"].restore() == 4
    assert resumed["ckpt"].rejected and "gen-000000006" in resumed["ckpt"].rejected[0][0]
    assert not newest.exists()  # moved aside
    assert (resumed["loader"].epoch, resumed["loader"].consumed) == (0, 4 * 3 * BATCH)
    resumed["ckpt"].close()
    after = train(build(root), 6)  # restores 4 again, continues to 6: bitwise
    assert sorted(after) == [5, 6]
    for step in (5, 6):
        for name, value in reference[step].items():
            assert torch.equal(after[step][name], value), (step, name)


def test_refuses_setups_it_cannot_resume_exactly(tmp_path):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    ds = unbroken.seeded(Points(), seed=0)
    sampler = unbroken.ResumableSampler(SAMPLES, batch_size=BATCH)
    with pytest.raises(ua.UnsupportedSetup, match="accumulation=1"):
        ua.prepare_loader(accelerator, unbroken.ResumableLoader(ds, sampler))
    plain = torch.utils.data.DataLoader(ds, batch_sampler=sampler)
    with pytest.raises(ua.UnsupportedSetup, match="ResumableSampler"):
        ua.prepare(accelerator, plain)
    with pytest.raises(ua.UnsupportedSetup, match="expected an unbroken.ResumableLoader"):
        ua.prepare_loader(accelerator, plain)
    raw = unbroken.ResumableLoader(ds, sampler, accumulation=2)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    loader = ua.prepare_loader(accelerator, raw)
    with pytest.raises(ua.UnsupportedSetup, match="was not prepared"):
        ua.checkpointer(accelerator, tmp_path / "a", model=model, optimizer=opt, data=raw)
    with pytest.raises(ua.UnsupportedSetup, match="scaler= is taken"):
        ua.checkpointer(accelerator, tmp_path / "a", model=model, optimizer=opt, data=loader,
                        scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ua.UnsupportedSetup, match="not the one accelerator.prepare"):
        ua.checkpointer(accelerator, tmp_path / "a", model=model, data=loader,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ema = torch.nn.Linear(8, 2)
    counter = torch.optim.lr_scheduler.LambdaLR(opt.optimizer, lambda s: 1.0)
    accelerator.register_for_checkpointing(counter)
    with pytest.raises(ua.UnsupportedSetup, match="register_for_checkpointing"):
        ua.checkpointer(accelerator, tmp_path / "a", model=model, optimizer=opt, data=loader)
    teacher = accelerator.prepare(ema)
    with pytest.raises(ua.UnsupportedSetup, match="prepared model #1"):
        ua.checkpointer(accelerator, tmp_path / "a", model=model, optimizer=opt, data=loader,
                        extras={"counter": counter})
    ckpt = ua.checkpointer(accelerator, tmp_path / "a", model=model, optimizer=opt, data=loader,
                           extras={"counter": counter, "teacher": teacher})
    ckpt.close()
    shard = accelerator.prepare(torch.utils.data.DataLoader(ds))
    with pytest.raises(ua.UnsupportedSetup, match="found DataLoaderShard"):
        ua.checkpointer(accelerator, tmp_path / "a", model=model, optimizer=opt, data=shard,
                        extras={"counter": counter, "teacher": teacher})
    with pytest.raises(ua.UnsupportedSetup, match="besides it accelerator.prepare returned"):
        ua.checkpointer(accelerator, tmp_path / "a", model=model, optimizer=opt, data=loader,
                        extras={"counter": counter, "teacher": teacher})
    accelerator.prepare(torch.optim.SGD(teacher.parameters(), lr=0.1))
    with pytest.raises(ua.UnsupportedSetup, match="2 optimizers were prepared"):
        ua.checkpointer(accelerator, tmp_path / "a", model=model, optimizer=opt, data=loader)


def test_refuses_windows_or_schedules_that_would_not_match(monkeypatch):
    ds = unbroken.seeded(Points(), seed=0)
    loader = unbroken.ResumableLoader(ds, unbroken.ResumableSampler(SAMPLES, batch_size=BATCH),
                                      accumulation=2)
    spanning = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(
        num_steps=2, sync_with_dataloader=False))
    with pytest.raises(ua.UnsupportedSetup, match="sync_with_dataloader=False"):
        ua.prepare_loader(spanning, loader)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    monkeypatch.setattr(Accelerator, "num_processes", property(lambda self: 2))  # a job's view
    with pytest.raises(ua.UnsupportedSetup, match="split_batches=True"):
        ua.prepare_loader(accelerator, loader)


def test_unwraps_prepared_objects_and_captures_the_accelerators_scaler(tmp_path):
    accelerator = Accelerator(cpu=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    accelerator.scaler = scaler  # what fp16 mixed precision on a GPU sets
    module = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    loader = unbroken.ResumableLoader(unbroken.seeded(Points(), seed=0),
                                      unbroken.ResumableSampler(SAMPLES, batch_size=BATCH))
    model, p_opt, p_loader, p_sched = ua.prepare(accelerator, module, opt, loader, sched)
    assert type(p_opt).__name__ == "AcceleratedOptimizer" and p_loader.loader is loader
    ckpt = ua.checkpointer(accelerator, tmp_path / "run", model=model, optimizer=p_opt,
                           scheduler=p_sched, data=p_loader)
    try:
        assert ckpt.model is module and ckpt.optimizer is opt and ckpt.data is loader
        info = ckpt.save(0)
        assert info is not None
        state = (tmp_path / "run" / "gen-000000000" / "state.json").read_text()
        assert '"scaler"' in state and "512" in state and '"scheduler"' in state
    finally:
        ckpt.close()


def test_an_evaluation_loop_that_breaks_out_early_does_not_shift_the_windows(tmp_path):
    """A prepared evaluation DataLoader iterated for a few batches only (or dropped
    unfinished) stays on top of Accelerate's GradientState: the training loader must still
    end Accelerate's window with the epoch, where unbroken's loader ends it, or step_done at
    Accelerate's next sync lands inside unbroken's window (UpdateBoundaryError)."""
    run = build(tmp_path / "run", every=None)
    accelerator, loader, ckpt = (run[k] for k in ("accelerator", "loader", "ckpt"))
    evaluation = accelerator.prepare(torch.utils.data.DataLoader(Points(), batch_size=8))
    step, syncs = ckpt.restore(), []
    while loader.epoch < 2:
        for x, y in loader:
            update(run, x, y)
            syncs.append(accelerator.sync_gradients)
            assert accelerator.sync_gradients == loader.at_boundary, (step, len(syncs))
            if accelerator.sync_gradients:
                step += 1
                ckpt.step_done(step)
                for i, _ in enumerate(evaluation):  # a quick look: two batches only
                    if i == 1:
                        break
                if step == 3:  # and one prepared, half read and dropped
                    dropped = accelerator.prepare(torch.utils.data.DataLoader(Points()))
                    next(iter(dropped))
                    del dropped
    ckpt.close()
    assert step == 10 and syncs == ([False, False, True] * 4 + [False, True]) * 2


def test_resume_recipes_written_for_accelerates_loader_are_refused_or_harmless(tmp_path):
    """``accelerator.skip_first_batches`` on the prepared loader would lose batches on top of
    the exact resume, so it is refused (0 batches: the loader itself); ``set_epoch`` is
    accepted for the cursor's epoch only (a loop counting epochs from 0 after a resume would
    train them again)."""
    run = build(tmp_path / "run", every=None)
    accelerator, loader = run["accelerator"], run["loader"]
    assert accelerator.skip_first_batches(loader, 0) is loader
    with pytest.raises(ua.UnsupportedSetup, match="skip_first_batches.*num_batches=2"):
        accelerator.skip_first_batches(loader, 2)
    plain = torch.utils.data.DataLoader(Points(), batch_size=BATCH)  # others: Accelerate's own
    assert len(list(accelerator.skip_first_batches(plain, 13))) == 1
    loader.set_epoch(0)
    with pytest.raises(ua.UnsupportedSetup, match=r"set_epoch\(1\).*at epoch 0"):
        loader.set_epoch(1)
    assert loader.dataset is loader.loader.dataset and len(loader.dataset) == SAMPLES
    run["ckpt"].close()


def test_objects_registered_for_checkpointing_that_the_generation_holds_are_accepted(tmp_path):
    """A scheduler kept out of ``prepare`` is registered with ``register_for_checkpointing``
    so that Accelerate's save_state would hold it; passed as ``scheduler=`` it is a part of
    the generation already, so it is not refused (nor is the registered prepared model)."""
    accelerator = Accelerator(cpu=True)
    module = torch.nn.Linear(8, 2)
    model, opt = accelerator.prepare(module, torch.optim.SGD(module.parameters(), lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, 1, gamma=0.5)
    accelerator.register_for_checkpointing(sched)
    accelerator.register_for_checkpointing(model)
    loader = ua.prepare_loader(accelerator, unbroken.ResumableLoader(
        unbroken.seeded(Points(), seed=0), unbroken.ResumableSampler(SAMPLES, batch_size=BATCH)))
    ckpt = ua.checkpointer(accelerator, tmp_path / "run", model=model, optimizer=opt,
                           scheduler=sched, data=loader)
    try:
        assert ckpt._parts["scheduler"] is sched and ckpt.model is model
    finally:
        ckpt.close()
    accelerator.register_for_checkpointing(torch.optim.lr_scheduler.StepLR(opt.optimizer, 1))
    with pytest.raises(ua.UnsupportedSetup, match="object #2 .StepLR. was registered"):
        ua.checkpointer(accelerator, tmp_path / "run", model=model, optimizer=opt,
                        scheduler=sched, data=loader)


def test_objects_and_models_held_per_rank_count_as_held(tmp_path):
    """An object registered for checkpointing and a second prepared model, each given as an
    extra held per rank (`unbroken.PerRank`), are held by the generation like plain extras:
    neither is refused, and the model is saved unwrapped (its own parameter names)."""
    class Mine:
        def __init__(self) -> None:
            self.n = 3

        def state_dict(self) -> dict:
            return {"n": self.n}

        def load_state_dict(self, state: dict) -> None:
            self.n = state["n"]

    accelerator = Accelerator(cpu=True)
    module = torch.nn.Linear(8, 2)
    model, opt = accelerator.prepare(module, torch.optim.SGD(module.parameters(), lr=0.1))
    second = accelerator.prepare(torch.nn.Linear(2, 2))
    mine = Mine()
    accelerator.register_for_checkpointing(mine)
    loader = ua.prepare_loader(accelerator, unbroken.ResumableLoader(
        unbroken.seeded(Points(), seed=0), unbroken.ResumableSampler(SAMPLES, batch_size=BATCH)))
    ckpt = ua.checkpointer(accelerator, tmp_path / "run", model=model, optimizer=opt,
                           data=loader, extras={"mine": unbroken.PerRank(mine),
                                                "second": unbroken.PerRank(second)})
    try:
        assert ckpt._parts["extra.mine"] is mine and ckpt._per_rank == {"extra.mine",
                                                                       "extra.second"}
        assert ckpt._parts["extra.second"] is accelerator.unwrap_model(second)
        ckpt.save(1)
    finally:
        ckpt.close()
