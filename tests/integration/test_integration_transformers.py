"""The Transformers Trainer adapter, with the real Trainer on CPU: `unbroken check` on
examples/transformers_train.py (2 DataLoader workers, dropout, random augmentation in the
dataset and the collator, warmup + cosine, gradient accumulation with a short last window)
kills it with SIGKILL mid-epoch and elsewhere, resumes it in fresh processes, and finds every
update bitwise equal to the uninterrupted run, each sample of each epoch seen exactly once; a
torn newest generation is refused and the previous one used; configurations the adapter
cannot resume exactly are refused before training."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import _Zygote

import unbroken.proof.harness as harness
from unbroken.trace import read_trace

if importlib.util.find_spec("transformers") is None:  # (not imported here: the zygote does)
    pytest.skip("the transformers extra is not installed", allow_module_level=True)

ROOT = Path(__file__).parents[2]
EXAMPLE = str(ROOT / "examples" / "transformers_train.py")
SAMPLES, BATCH, ACCUMULATION = 232, 16, 2  # the example's defaults
UPDATES_PER_EPOCH = 8  # 15 batches (the last of 8 samples) in windows of 2, the last of 1


class _TransformersZygote(_Zygote):
    """The tests' fork server (_zygote.py) with transformers' Trainer imported before any
    fork: each training process then starts in a fraction of a second, not ~6 s."""

    def __init__(self) -> None:
        here = str(Path(__file__).parent)
        code = (f"import runpy, sys; sys.path.insert(0, {here!r}); "
                "import transformers; from transformers import Trainer, TrainingArguments; "
                f"runpy.run_path({str(Path(here) / '_zygote.py')!r}, run_name='__main__')")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.lock = threading.Lock()


@pytest.fixture(scope="module")
def zygote():
    z = _TransformersZygote()
    yield z
    assert z.proc.stdin is not None
    z.proc.stdin.close()
    z.proc.kill()  # no child is left (each run waits for its group); exiting takes seconds
    z.proc.wait()


def _run(zygote: _Zygote, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return zygote.run(EXAMPLE, argv, {**os.environ, **harness._clean_env(env)}, timeout=300)


@pytest.fixture(scope="module")
def checked(zygote, tmp_path_factory):
    """One `unbroken check` of the example at its default places (one chain of kills), and
    one that sends SIGTERM inside update 5 (reusing the reference run), every process forked
    from the zygote: (report, SIGTERM report, workdir)."""
    workdir = tmp_path_factory.mktemp("check")

    def run_process(cmd, env, log, timeout):
        assert cmd[1] == EXAMPLE, cmd
        r = _run(zygote, cmd[2:], env)
        with open(log, "a") as f:
            f.write(r.stdout + r.stderr)
        return r.returncode

    cmd = [sys.executable, EXAMPLE, "--run", str(workdir / "unused")]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(harness, "run_process", run_process)
        report = harness.run_check(cmd, str(workdir / "work"))
        stopped = harness.run_check(
            cmd, str(workdir / "sigterm"), at=[5], phases=["sigterm"],
            reference_trace=str(workdir / "work" / "reference" / "trace.jsonl"))
    return report, stopped, workdir / "work"


def _updates(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records if r["event"] == "update"}


def test_check_equivalent_after_mid_epoch_sigkills(checked):
    report, _, work = checked
    out = report.to_json()
    assert out["verdict"] == "equivalent", json.dumps(out, indent=1)[:4000]
    assert report.steps == 2 * UPDATES_PER_EPOCH
    kills = [k for case in out["cases"] for k in case["kills"] if k["reached"]]
    mid_epoch = [k for k in kills if k["at"] % UPDATES_PER_EPOCH not in (0, 1)]
    assert len(mid_epoch) >= 2, kills  # killed inside epoch 0, not at its edges
    assert all(k["exit_code"] == -9 for k in kills), kills  # SIGKILL, every time
    assert {k["phase"] for k in kills} >= {"after-update", "mid-save", "mid-update"}
    # Each kill resumed from a generation written mid-run, never from scratch.
    resumed = [k["resumed_from"] for k in kills]
    assert all(r is not None and r >= 1 for r in resumed), kills
    assert any(0 < r % UPDATES_PER_EPOCH for r in resumed), resumed

    reference = _updates(read_trace(str(work / "reference" / "trace.jsonl")))
    # The workload is the one the acceptance asks for: warmup then cosine decay, gradient
    # accumulation with the epoch's short last window.
    lrs = [float.fromhex(reference[s]["lr"][0]) for s in sorted(reference)]
    peak = lrs.index(max(lrs))
    assert 0 < peak < 5 and lrs[:peak + 1] == sorted(lrs[:peak + 1])
    assert lrs[peak:] == sorted(lrs[peak:], reverse=True) and lrs[-1] < 0.1 * lrs[peak]
    assert len(reference[1]["ids"]) == ACCUMULATION * BATCH
    assert len(reference[UPDATES_PER_EPOCH]["ids"]) == SAMPLES - 14 * BATCH

    # Stitch the lives of the interrupted case: a later life replaces what an earlier one
    # did past its restore point. Every update, and every sample of every epoch exactly once.
    stitched: dict[int, dict] = {}
    for life in sorted((work / "case-01").glob("life-*.jsonl")):
        records = read_trace(str(life))
        restore = next(r for r in records if r["event"] == "restore")
        restored = restore["step"]
        if restored:  # every part comes back as it was traced (the Trainer's logging
            # accumulators too, before the loop takes them), so a divergence names its part
            assert restore["state"] == reference[restored]["state"], (life.name, restore)
        stitched = {s: r for s, r in stitched.items() if s <= restored}
        stitched.update(_updates(records))
    assert sorted(stitched) == sorted(reference)
    for epoch in (0, 1):
        ids = [i for s in sorted(stitched) if stitched[s]["epoch"] == epoch
               for i in stitched[s]["ids"]]
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {epoch}"
        assert ids == [i for s in sorted(reference) if reference[s]["epoch"] == epoch
                       for i in reference[s]["ids"]]


def test_sigterm_saves_stops_cleanly_and_resumes_equivalent(checked):
    _, stopped, _ = checked
    out = stopped.to_json()
    assert out["verdict"] == "equivalent", json.dumps(out, indent=1)[:4000]
    (kill,) = out["cases"][0]["kills"]
    assert kill["reached"] and kill["exit_code"] == 0, kill  # left the loop, exited cleanly
    assert kill["resumed_from"] == 5, kill  # the update SIGTERM landed in was saved


def test_torn_newest_generations_are_refused_and_previous_used(checked, zygote, tmp_path):
    """The newest generation torn (a file truncated) and the one before it without its
    manifest (a save killed before its commit): the run continues from the third newest."""
    _, _, work = checked
    run = tmp_path / "run"
    shutil.copytree(work / "reference" / "run", run)
    generations = sorted(run.glob("gen-*"))
    steps = [int(g.name.split("-")[1]) for g in generations]
    assert steps[-1] == 2 * UPDATES_PER_EPOCH and len(steps) >= 3, steps  # the final state
    victim = generations[-1] / "model.safetensors"
    victim.write_bytes(victim.read_bytes()[:-7])
    (generations[-2] / "MANIFEST.json").unlink()
    trace = tmp_path / "trace.jsonl"
    r = _run(zygote, ["--run", str(run)], {"UNBROKEN_TRACE": str(trace)})
    assert r.returncode == 0, r.stderr[-3000:]
    records = read_trace(str(trace))
    restore = records[0]
    assert restore["event"] == "restore" and restore["step"] == steps[-3], restore
    assert sorted(restore["rejected"]) == [g.name for g in generations[-2:]], restore
    aside = sorted(p.name.rsplit("-", 2)[0] for p in (run / "aside").iterdir())
    assert aside == [f"{generations[-2].name}-torn", f"{generations[-1].name}-corrupt"]
    # It continued from there to the same updates and final weights as the uninterrupted run.
    reference = _updates(read_trace(str(work / "reference" / "trace.jsonl")))
    updates = _updates(records)
    assert sorted(updates) == list(range(steps[-3] + 1, steps[-1] + 1))
    for step, record in updates.items():
        assert (record["params"], record["ids"], record["loss"], record["state"]) == (
            reference[step]["params"], reference[step]["ids"], reference[step]["loss"],
            reference[step]["state"]), step


def test_unresumable_setups_are_refused(zygote, tmp_path):
    """Run in a process forked from the zygote, where transformers is imported already
    (see `_refusals` below)."""
    r = zygote.run(__file__, [str(tmp_path)], dict(os.environ), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    done = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("refused ")]
    assert done == [name for name, _ in _REFUSALS], r.stdout


# -- refusals, run by test_unresumable_setups_are_refused in a forked child -------------------

def _trainer(run: Path, **overrides):
    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "examples"))
    from transformers_train import Classifier, Points, collate

    kwargs = dict(output_dir=f"{run}.trainer", use_cpu=True, report_to=[], disable_tqdm=True,
                  save_strategy="no", seed=0, num_train_epochs=1, per_device_train_batch_size=8,
                  learning_rate=3e-3, dataloader_num_workers=0)
    dataset = overrides.pop("train_dataset", None) or Points(32)
    cls = overrides.pop("cls", transformers.Trainer)
    extra = {k: overrides.pop(k) for k in ("callbacks", "eval_dataset", "data_collator")
             if k in overrides}
    args = transformers.TrainingArguments(**{**kwargs, **overrides})
    torch.manual_seed(0)
    return cls(model=Classifier(), args=args, train_dataset=dataset,
               **{"data_collator": collate, **extra})


def _refuse_default_save_strategy(tmp: Path):
    from unbroken.integrations.transformers import UnsupportedSetup, attach

    with pytest.raises(UnsupportedSetup, match="save_strategy='steps'"):
        attach(_trainer(tmp / "a", save_strategy="steps"), tmp / "a")


def _refuse_own_dataloader(tmp: Path):
    import torch
    import transformers

    from unbroken.integrations.transformers import UnsupportedSetup, attach

    class PlainLoader(transformers.Trainer):
        def get_train_dataloader(self):
            return torch.utils.data.DataLoader(self.train_dataset, batch_size=8, shuffle=True)

    with pytest.raises(UnsupportedSetup, match="overrides get_train_dataloader"):
        attach(_trainer(tmp / "b", cls=PlainLoader), tmp / "b")


def _refuse_iterable_dataset(tmp: Path):
    import torch

    from unbroken.integrations.transformers import UnsupportedSetup, attach

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from ({"x": torch.zeros(16), "labels": torch.tensor(0)} for _ in range(32))

    trainer = _trainer(tmp / "c", train_dataset=Stream(), max_steps=2)
    attach(trainer, tmp / "c")
    with pytest.raises(UnsupportedSetup, match="map-style"):
        trainer.train()
    assert not list((tmp / "c").glob("gen-*"))


def _refuse_trainer_checkpoint_path(tmp: Path):
    from unbroken.integrations.transformers import UnsupportedSetup, attach

    trainer = _trainer(tmp / "d")
    attach(trainer, tmp / "d")
    with pytest.raises(UnsupportedSetup, match="unbroken import"):
        trainer.train(resume_from_checkpoint=str(tmp / "checkpoint-10"))


def _refuse_attaching_twice(tmp: Path):
    from unbroken.integrations.transformers import UnsupportedSetup, attach

    trainer = _trainer(tmp / "e")
    attach(trainer, tmp / "e")
    with pytest.raises(UnsupportedSetup, match="attached already"):
        attach(trainer, tmp / "e")


def _refuse_changed_learning_rate(tmp: Path):
    from unbroken.errors import IdentityMismatch
    from unbroken.integrations.transformers import attach

    trainer = _trainer(tmp / "f", max_steps=2)
    attach(trainer, tmp / "f", every=1)
    assert trainer.train().global_step == 2
    trainer = _trainer(tmp / "f", max_steps=4, learning_rate=1e-3)
    attach(trainer, tmp / "f", every=1)
    with pytest.raises(IdentityMismatch, match="learning_rate"):
        trainer.train()
    assert sorted(p.name for p in (tmp / "f").glob("gen-*")) == ["gen-000000001",
                                                                  "gen-000000002"]


def _refuse_collator_with_own_generator(tmp: Path):
    import tokenizers
    import transformers

    from unbroken.integrations.transformers import UnsupportedSetup, attach

    vocab = {"[PAD]": 0, "[UNK]": 1, "[MASK]": 2, "a": 3, "b": 4}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, "[UNK]")),
        pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]")
    # Its masking stream restarts from seed= in every process: a resume masks differently.
    masking = transformers.DataCollatorForLanguageModeling(tokenizer, seed=3)
    with pytest.raises(UnsupportedSetup, match=r"DataCollatorForLanguageModeling .*seed=3"):
        attach(_trainer(tmp / "g", data_collator=masking), tmp / "g")
    # Without seed= it masks with the global RNGs, seeded per batch by the loader: accepted.
    attach(_trainer(tmp / "g", data_collator=transformers.DataCollatorForLanguageModeling(
        tokenizer)), tmp / "g")


_REFUSALS = [("save_strategy", _refuse_default_save_strategy),
             ("own_dataloader", _refuse_own_dataloader),
             ("iterable_dataset", _refuse_iterable_dataset),
             ("checkpoint_path", _refuse_trainer_checkpoint_path),
             ("attach_twice", _refuse_attaching_twice),
             ("changed_learning_rate", _refuse_changed_learning_rate),
             ("collator_generator", _refuse_collator_with_own_generator)]


# -- continuations in one process, run by test_continuations_match_uninterrupted -------------

def _points(n: int):
    sys.path.insert(0, str(ROOT / "examples"))
    from transformers_train import Points

    return Points(n)


def _interrupted(trainer, run: Path, at: int):
    """train() stopped by the harness's SIGTERM inside update ``at`` (saved there)."""
    import signal

    from unbroken.integrations.transformers import attach

    callback = attach(trainer, run, every=100, signals=[signal.SIGTERM])
    os.environ["UNBROKEN_SIGNAL_AT"] = str(at)
    try:
        assert trainer.train().global_step == at
    finally:
        del os.environ["UNBROKEN_SIGNAL_AT"]
    assert callback.checkpointer is not None and callback.checkpointer.should_stop
    return callback


def _weights(trainer) -> dict:
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def _logs(trainer) -> list[dict]:
    return [{k: v for k, v in e.items() if not k.endswith(("_runtime", "_per_second"))}
            for e in trainer.state.log_history]


def _assert_same(trainer, reference) -> None:
    import torch

    got, expected = _weights(trainer), _weights(reference)
    assert all(torch.equal(got[k], expected[k]) for k in expected), "weights differ"
    assert _logs(trainer)[:-1] == _logs(reference)[:-1]  # (the last: train()'s own metrics)


def _continue_a_run_a_callback_stopped(tmp: Path):
    """A callback ended the run at update 2 of 8 (early stopping): its final generation is
    the run's end, and running it again (a requeued job; a kill after that save) trains
    nothing more, as the uninterrupted run did not."""
    import transformers

    from unbroken.integrations.transformers import attach

    class StopAt2(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                control.should_training_stop = True

    for _ in range(2):
        trainer = _trainer(tmp / "s", max_steps=8, callbacks=[StopAt2()])
        attach(trainer, tmp / "s", every=1)
        assert trainer.train().global_step == 2
    assert sorted(p.name for p in (tmp / "s").glob("gen-*")) == ["gen-000000001",
                                                                  "gen-000000002"]


def _continue_without_a_second_eval_on_start(tmp: Path):
    """eval_on_start evaluates before update 1 only; a continuation at update 2 does not
    evaluate again (its augmentation draws from the RNGs and would add a log entry)."""
    from unbroken.integrations.transformers import attach

    options = dict(max_steps=4, eval_strategy="steps", eval_steps=3, eval_on_start=True,
                   per_device_eval_batch_size=8)
    reference = _trainer(tmp / "e1", eval_dataset=_points(16), **options)
    attach(reference, tmp / "e1")
    reference.train()
    _interrupted(_trainer(tmp / "e2", eval_dataset=_points(16), **options), tmp / "e2", 2)
    trainer = _trainer(tmp / "e2", eval_dataset=_points(16), **options)
    attach(trainer, tmp / "e2")
    assert trainer.train().global_step == 4
    _assert_same(trainer, reference)
    assert trainer.args.eval_on_start  # put back


def _second_train_call_with_persistent_workers(tmp: Path):
    """train() again on the same Trainer after a SIGTERM stop, with persistent DataLoader
    workers (the first call stopped them): it continues to the uninterrupted result."""
    from unbroken.integrations.transformers import attach

    options = dict(dataloader_num_workers=2, dataloader_persistent_workers=True)
    reference = _trainer(tmp / "w1", **options)
    attach(reference, tmp / "w1")
    reference.train()
    trainer = _trainer(tmp / "w2", **options)
    _interrupted(trainer, tmp / "w2", 2)
    # False is the Trainer's None (a script's `--resume` flag left off): it continues too.
    assert trainer.train(resume_from_checkpoint=False).global_step == 4
    _assert_same(trainer, reference)


def _persistent_eval_workers_leave_training_rng(tmp: Path):
    """Evaluation at every update through persistent DataLoader workers: the eval loader's
    first pass draws its workers' seed from the torch RNG (at update 1 uninterrupted, at
    update 3 in the resumed process); training's dropout must not see the difference."""
    import torch

    from unbroken.integrations.transformers import attach

    class Fixed(torch.utils.data.Dataset):  # a deterministic eval set
        def __len__(self):
            return 16

        def __getitem__(self, i):
            return {"x": torch.full((16,), i / 16.0), "labels": torch.tensor(i % 4)}

    options = dict(max_steps=4, eval_strategy="steps", eval_steps=1, dataloader_num_workers=2,
                   dataloader_persistent_workers=True, per_device_eval_batch_size=8)
    reference = _trainer(tmp / "p1", eval_dataset=Fixed(), **options)
    attach(reference, tmp / "p1")
    reference.train()
    _interrupted(_trainer(tmp / "p2", eval_dataset=Fixed(), **options), tmp / "p2", 2)
    trainer = _trainer(tmp / "p2", eval_dataset=Fixed(), **options)
    attach(trainer, tmp / "p2")
    assert trainer.train().global_step == 4
    _assert_same(trainer, reference)


def _sequential_sampling_keeps_dataset_order(tmp: Path):
    """train_sampling_strategy="sequential" (a curriculum, pre-shuffled data) is resumable:
    dataset order, every epoch, as the Trainer's SequentialSampler gives."""
    from unbroken.integrations.transformers import attach

    trainer = _trainer(tmp / "q", train_sampling_strategy="sequential", num_train_epochs=2)
    attach(trainer, tmp / "q", trace=str(tmp / "q.jsonl"))
    trainer.train()
    ids = [r["ids"] for r in read_trace(str(tmp / "q.jsonl")) if r["event"] == "update"]
    assert ids == [list(range(k, k + 8)) for k in range(0, 32, 8)] * 2


_CONTINUATIONS = [("callback_stopped", _continue_a_run_a_callback_stopped),
                  ("eval_on_start", _continue_without_a_second_eval_on_start),
                  ("second_train_call", _second_train_call_with_persistent_workers),
                  ("persistent_eval_workers", _persistent_eval_workers_leave_training_rng),
                  ("sequential_sampling", _sequential_sampling_keeps_dataset_order)]


def test_continuations_match_uninterrupted(zygote, tmp_path):
    """Run in a process forked from the zygote (see `_CONTINUATIONS` above)."""
    r = zygote.run(__file__, [str(tmp_path), "continuations"], dict(os.environ), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    done = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("continued ")]
    assert done == [name for name, _ in _CONTINUATIONS], r.stdout


if __name__ == "__main__":
    if sys.argv[2:] == ["continuations"]:
        for name, check in _CONTINUATIONS:
            check(Path(sys.argv[1]))
            print("continued", name, flush=True)
    else:
        for name, check in _REFUSALS:
            check(Path(sys.argv[1]))
            print("refused", name, flush=True)
