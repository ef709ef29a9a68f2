"""Defects an outside review found in the Transformers and Accelerate adapters (round 26):

1. ``TrainingArguments(enable_jit_checkpoint=True)``: the Trainer's own SIGTERM handling set
   ``should_training_stop`` and the generation saved there marked the run finished (a
   requeued job trained nothing more). Refused before training, naming ``signals=``.
2. Accelerate: ``ua.checkpointer(..., data=None)`` accepted a loop over a DataLoader that
   ``accelerator.prepare`` returned; the resume replayed its epoch. Refused.
3. A private random generator reached through what a collator holds (a user collator
   wrapping a seeded ``DataCollatorForLanguageModeling``, a closure or global
   ``torch.Generator``, a ``functools.partial`` argument) was accepted and diverged after a
   resume. Refused naming the path; collators on the global streams stay accepted.
4. A run whose epochs a callback ended early (``should_epoch_stop``) ran out of
   ``num_train_epochs`` before ``max_steps``: its final update was never saved, so running the
   finished script again trained it again. Saved; the rerun trains nothing.
5. The default identity left out ``eval_steps``/``eval_strategy``, ``metric_for_best_model``,
   ``greater_is_better``, ``neftune_noise_alpha``...: a continuation changing them was
   accepted. Refused; a generation an older adapter saved (without those keys) continues.

The Trainer checks run in a process forked from the zygote of
test_integration_transformers (transformers imported once), one per test."""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import random
import sys
from pathlib import Path

import pytest
import torch

import unbroken

ROOT = Path(__file__).parents[2]
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAS_ACCELERATE = importlib.util.find_spec("accelerate") is not None
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS,
                                        reason="the transformers extra is not installed")
needs_accelerate = pytest.mark.skipif(not HAS_ACCELERATE,
                                      reason="the accelerate extra is not installed")


@pytest.fixture(scope="module")
def zygote():
    from test_integration_transformers import _TransformersZygote

    z = _TransformersZygote()
    yield z
    assert z.proc.stdin is not None
    z.proc.stdin.close()
    z.proc.kill()
    z.proc.wait()


def _in_child(zygote, tmp_path: Path, name: str) -> None:
    r = zygote.run(__file__, [str(tmp_path), name], dict(os.environ), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert f"passed {name}" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


# -- 1. the Trainer's just-in-time checkpointing ------------------------------------------

@needs_transformers
def test_jit_checkpoint_is_refused_naming_signals(zygote, tmp_path):
    _in_child(zygote, tmp_path, "jit")


def _jit(tmp: Path) -> None:
    import transformers
    from transformers.trainer_jit_checkpoint import JITCheckpointCallback

    from unbroken.integrations.transformers import UnsupportedSetup, attach

    with pytest.raises(UnsupportedSetup,
                       match=r"enable_jit_checkpoint=True.*signals=\[signal.SIGTERM\]"):
        attach(_trainer(tmp / "a", enable_jit_checkpoint=True), tmp / "a")
    # The callback added by hand, with or without the argument: the same SIGTERM handling.
    with pytest.raises(UnsupportedSetup, match="JITCheckpointCallback"):
        attach(_trainer(tmp / "b", callbacks=[JITCheckpointCallback()]), tmp / "b")
    # ... or added after attach: refused when train() starts, before any generation.
    trainer = _trainer(tmp / "c", max_steps=2)
    attach(trainer, tmp / "c")
    trainer.add_callback(JITCheckpointCallback)
    with pytest.raises(UnsupportedSetup, match="enable_jit_checkpoint"):
        trainer.train()
    assert not list((tmp / "c").glob("gen-*"))
    assert isinstance(trainer, transformers.Trainer)


# -- 3. private random generators reached through a collator -------------------------------

_GLOBAL_GENERATOR: torch.Generator | None = None


def _collate_with_global_generator(samples):
    import transformers

    batch = transformers.default_data_collator(samples)
    assert _GLOBAL_GENERATOR is not None
    batch["x"] = batch["x"] * (torch.rand(batch["x"].shape, generator=_GLOBAL_GENERATOR) > 0.1)
    return batch


def _collate_masking(samples, rng=None, p=0.1):
    import transformers

    batch = transformers.default_data_collator(samples)
    draw = rng.random() if rng is not None else random.random()
    batch["x"] = batch["x"] * (draw > p)
    return batch


@needs_transformers
def test_private_generators_reached_through_a_collator_are_refused(zygote, tmp_path):
    _in_child(zygote, tmp_path, "collators")


def _collators(tmp: Path) -> None:
    global _GLOBAL_GENERATOR
    import numpy as np
    import tokenizers
    import transformers

    from unbroken.integrations.transformers import UnsupportedSetup, attach

    vocab = {"[PAD]": 0, "[UNK]": 1, "[MASK]": 2, "a": 3, "b": 4}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, "[UNK]")),
        pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]")

    class Wrapped:
        """A user collator delegating to another under a name of its own."""

        def __init__(self, inner):
            self.mlm = inner

        def __call__(self, features):
            return self.mlm(features)

    class Deep:
        def __init__(self):
            self.config = {"aug": [Wrapped(random.Random(5))]}

        def __call__(self, features):
            return transformers.default_data_collator(features)

    generator = torch.Generator().manual_seed(0)

    def closing(samples):
        batch = transformers.default_data_collator(samples)
        batch["x"] = batch["x"] * (torch.rand(batch["x"].shape, generator=generator) > 0.1)
        return batch

    _GLOBAL_GENERATOR = torch.Generator().manual_seed(0)
    refused = [
        (Wrapped(transformers.DataCollatorForLanguageModeling(tokenizer, seed=42)),
         r"data_collator\.mlm: DataCollatorForLanguageModeling\(seed=42\)"),
        (closing, r"closure generator.*torch\.Generator"),
        (_collate_with_global_generator, r"global _GLOBAL_GENERATOR.*torch\.Generator"),
        (functools.partial(_collate_masking, rng=np.random.default_rng(0)),
         r"keywords\['rng'\].*Generator"),
        (functools.partial(_collate_masking, rng=np.random.RandomState(0)), "RandomState"),
        (Deep(), r"config\['aug'\]\[0\]\.mlm: a random\.Random"),
    ]
    for i, (collator, why) in enumerate(refused):
        with pytest.raises(UnsupportedSetup, match=why):
            attach(_trainer(tmp / f"r{i}", data_collator=collator), tmp / f"r{i}")
    # The global streams (saved, seeded per batch by the loader) are fine, however reached.
    # A library's logger whose sampling filter holds a generator of its own: a collator that
    # only logs through the process-wide registry does not draw from it.
    sampling = logging.Filter()
    sampling.rng = random.Random(3)  # type: ignore[attr-defined]
    logging.getLogger("some_library").addFilter(sampling)
    accepted = [transformers.DataCollatorForLanguageModeling(tokenizer),
                Wrapped(transformers.DataCollatorForLanguageModeling(tokenizer)),
                functools.partial(_collate_masking, rng=random),  # the module: its _inst
                functools.partial(_collate_masking, rng=np.random),
                Wrapped(random.random), _collate_logging]
    for i, collator in enumerate(accepted):
        attach(_trainer(tmp / f"a{i}", data_collator=collator), tmp / f"a{i}")


def _collate_logging(samples):
    import transformers

    _LOG.debug("collating %d samples", len(samples))
    return transformers.default_data_collator(samples)


_LOG = logging.getLogger("a_user_module")


# -- 4. the final update of a run whose epochs a callback ended early -----------------------

@needs_transformers
def test_final_update_is_saved_when_epochs_run_out_before_max_steps(zygote, tmp_path):
    _in_child(zygote, tmp_path, "final_saved")


def _final_saved(tmp: Path) -> None:
    import transformers

    from unbroken.integrations.transformers import attach
    from unbroken.trace import read_trace

    class HalfEpochs(transformers.TrainerCallback):  # a per-epoch budget of 2 updates of 4
        def on_step_end(self, args, state, control, **kwargs):
            if state.epoch - int(state.epoch) >= 0.5:
                control.should_epoch_stop = True

    options = dict(num_train_epochs=3, callbacks=[HalfEpochs()])
    reference = _trainer(tmp / "ref", **options)
    attach(reference, tmp / "ref", every=100)
    assert reference.train().global_step == 6  # 3 epochs of 2 updates; max_steps is 12
    # The last update is the run's final state, saved though nothing asked for it.
    assert sorted(p.name for p in (tmp / "ref").glob("gen-*"))[-1] == "gen-000000006"
    # Running the finished script again restores it and trains nothing.
    again = _trainer(tmp / "ref", **options)
    callback = attach(again, tmp / "ref", every=100, trace=str(tmp / "again.jsonl"))
    assert again.train().global_step == 6 and callback.restored == 6
    assert not [r for r in read_trace(str(tmp / "again.jsonl")) if r["event"] == "update"]
    _assert_same(again, reference)
    # Interrupted (SIGTERM inside update 3) and continued: bitwise the uninterrupted run.
    _interrupted(_trainer(tmp / "run", **options), tmp / "run", 3)
    trainer = _trainer(tmp / "run", **options)
    attach(trainer, tmp / "run", every=100)
    assert trainer.train().global_step == 6
    _assert_same(trainer, reference)
    assert sorted(p.name for p in (tmp / "run").glob("gen-*"))[-1] == "gen-000000006"


# -- 5. the default identity -----------------------------------------------------------------

@needs_transformers
def test_identity_binds_evaluation_and_noise_arguments(zygote, tmp_path):
    _in_child(zygote, tmp_path, "identity")


def _identity(tmp: Path) -> None:
    from unbroken.errors import IdentityMismatch
    from unbroken.integrations.transformers import attach, trainer_config

    config = trainer_config(_trainer(tmp / "x").args)
    for key in ("eval_strategy", "eval_steps", "metric_for_best_model", "greater_is_better",
                "neftune_noise_alpha", "train_sampling_strategy"):
        assert key in config, key
    for key in ("logging_steps", "output_dir", "report_to", "save_strategy", "eval_on_start",
                "per_device_eval_batch_size"):
        assert key not in config, key  # logging and output only: free to change
    plateau = dict(max_steps=4, eval_strategy="steps", eval_steps=1,
                   metric_for_best_model="loss", lr_scheduler_type="reduce_lr_on_plateau",
                   lr_scheduler_kwargs={"patience": 0, "factor": 0.5})
    _interrupted(_trainer(tmp / "p", eval_dataset=_points(16), **plateau), tmp / "p", 2)
    # (neftune_noise_alpha is bound too, above; this model has no embeddings to add it to)
    for change in (dict(eval_steps=2), dict(metric_for_best_model="eval_loss"),
                   dict(greater_is_better=True), dict(eval_strategy="epoch")):
        trainer = _trainer(tmp / "p", eval_dataset=_points(16), **{**plateau, **change})
        attach(trainer, tmp / "p")
        (key,) = change
        with pytest.raises(IdentityMismatch, match=f"config.{key}"):
            trainer.train()
    assert sorted(p.name for p in (tmp / "p").glob("gen-*"))[-1] == "gen-000000002"


@needs_transformers
def test_generations_saved_with_the_older_identity_still_continue(zygote, tmp_path):
    _in_child(zygote, tmp_path, "legacy_identity")


def _legacy_identity(tmp: Path) -> None:
    import json
    import warnings

    from unbroken.errors import IdentityMismatch, UnbrokenWarning
    from unbroken.integrations import _transformers_state as state
    from unbroken.integrations.transformers import attach

    options = dict(max_steps=4, eval_strategy="steps", eval_steps=1)
    reference = _trainer(tmp / "ref", eval_dataset=_points(16), **options)
    attach(reference, tmp / "ref")
    reference.train()
    full = state._TRAJECTORY_ARGS
    state._TRAJECTORY_ARGS = state._LEGACY_ARGS  # what an older adapter recorded
    try:
        _interrupted(_trainer(tmp / "run", eval_dataset=_points(16), **options), tmp / "run", 2)
    finally:
        state._TRAJECTORY_ARGS = full
    saved = json.loads((tmp / "run" / "gen-000000002" / "MANIFEST.json").read_text())
    assert "eval_steps" not in json.dumps(saved["identity"])
    # A changed argument the older identity recorded is still refused, by name.
    changed = _trainer(tmp / "run", eval_dataset=_points(16), learning_rate=1e-3, **options)
    attach(changed, tmp / "run")
    with pytest.raises(IdentityMismatch, match="config.learning_rate"):
        changed.train()
    trainer = _trainer(tmp / "run", eval_dataset=_points(16), **options)
    attach(trainer, tmp / "run")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert trainer.train().global_step == 4
    assert any(issubclass(w.category, UnbrokenWarning) and "older unbroken" in str(w.message)
               and "eval_steps" in str(w.message) for w in caught), [str(w.message)
                                                                      for w in caught]
    _assert_same(trainer, reference)
    # The next generation records the full identity: a later change of eval_steps is refused.
    saved = json.loads((tmp / "run" / "gen-000000004" / "MANIFEST.json").read_text())
    assert '"eval_steps"' in json.dumps(saved["identity"])
    # That newest generation damaged: the restore falls back past it to the older-identity
    # generation 2, with the same warning (the choice looks at every generation, not only
    # the newest), and trains updates 3 and 4 again as the reference did.
    damaged = tmp / "run" / "gen-000000004" / "model.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    again = _trainer(tmp / "run", eval_dataset=_points(16), **options)
    attach(again, tmp / "run")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert again.train().global_step == 4
    assert any("older unbroken" in str(w.message) for w in caught), [str(w.message)
                                                                     for w in caught]
    _assert_same(again, reference)


# -- 1 (continued). a signal's stop never marks the run finished ---------------------------

@needs_transformers
def test_a_signal_stop_is_not_the_runs_end(zygote, tmp_path):
    _in_child(zygote, tmp_path, "signal_not_end")


def _signal_not_end(tmp: Path) -> None:
    """The loop left for SIGTERM (``signals=``) inside the last epoch (where the loop's end
    saves the final update): that generation is not the run's end, the next process goes on."""
    from unbroken.integrations.transformers import attach

    reference = _trainer(tmp / "ref", max_steps=4)
    attach(reference, tmp / "ref")
    reference.train()
    _interrupted(_trainer(tmp / "run", max_steps=4), tmp / "run", 2)
    trainer = _trainer(tmp / "run", max_steps=4)
    attach(trainer, tmp / "run")
    assert trainer.train().global_step == 4
    _assert_same(trainer, reference)


# -- 2. Accelerate: data=None with a prepared DataLoader -----------------------------------

@pytest.fixture
def fresh_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@needs_accelerate
def test_accelerate_data_none_with_a_prepared_dataloader_is_refused(tmp_path,
                                                                    fresh_accelerate):
    from accelerate import Accelerator

    from unbroken.integrations import accelerate as ua

    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g),
                                        torch.randint(0, 2, (64,), generator=g))
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    module = torch.nn.Linear(8, 2)
    model, opt = accelerator.prepare(module, torch.optim.SGD(module.parameters(), lr=0.1))
    # No prepared DataLoader (synthetic data drawn in the loop): data=None is accepted.
    ua.checkpointer(accelerator, tmp_path / "ok", model=model, optimizer=opt,
                    data=None).close()
    loader = accelerator.prepare(torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True))
    with pytest.raises(ua.UnsupportedSetup,
                       match=r"data=None, but accelerator.prepare returned a DataLoader "
                             r"\(#0, DataLoaderShard\).*ResumableLoader.*data="):
        ua.checkpointer(accelerator, tmp_path / "run", model=model, optimizer=opt, data=None)
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("gen-*"))
    # With the training data given as data=, a loader prepared before the checkpointer is a
    # second stream of training batches (an auxiliary loss's, session 34's review): refused.
    data = ua.prepare_loader(accelerator, unbroken.ResumableLoader(
        unbroken.seeded(ds, seed=0), unbroken.ResumableSampler(64, batch_size=4, seed=0),
        accumulation=2))
    with pytest.raises(ua.UnsupportedSetup,
                       match=r"data= is the loop's ResumableLoader, and besides it "
                             r"accelerator.prepare returned a DataLoader \(#0"):
        ua.checkpointer(accelerator, tmp_path / "run", model=model, optimizer=opt, data=data)
    assert len(loader) == 16
    # Declared evaluation-only, it is accepted; one prepared after the checkpointer (the
    # README's order) is never seen.
    ua.checkpointer(accelerator, tmp_path / "run", model=model, optimizer=opt,
                    data=data, evaluation=[loader]).close()
    evaluation = accelerator.prepare(torch.utils.data.DataLoader(ds, batch_size=8))
    assert len(evaluation) == 8
    # The prepared loader tells the batches it handed out (an empty epoch's rollover is a
    # boundary, `boundary._empty_rollover`), as the loader it wraps counts them.
    next(iter(data))
    assert data.handed_out == data.loader.handed_out == 1


# -- helpers (in the forked child) ---------------------------------------------------------

def _trainer(run: Path, **overrides):
    from test_integration_transformers import _trainer as build

    return build(run, **overrides)


def _points(n: int):
    from test_integration_transformers import _points as points

    return points(n)


def _interrupted(trainer, run: Path, at: int):
    from test_integration_transformers import _interrupted as interrupted

    return interrupted(trainer, run, at)


def _assert_same(trainer, reference) -> None:
    from test_integration_transformers import _assert_same as same

    same(trainer, reference)


_CHECKS = {"jit": _jit, "collators": _collators, "final_saved": _final_saved,
           "identity": _identity, "legacy_identity": _legacy_identity,
           "signal_not_end": _signal_not_end}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    _CHECKS[sys.argv[2]](Path(sys.argv[1]))
    print("passed", sys.argv[2], flush=True)
