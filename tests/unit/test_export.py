"""Inference export (`unbroken.tools.export`): weights any safetensors reader loads, identity
and lineage without optimizer, data or RNG state, adapters tied to a base revision, and the
fixed-input check that re-runs recorded inputs after reloading, casting or moving."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import unbroken
from unbroken.cli import main
from unbroken.errors import CorruptCheckpoint, MissingState, StateMismatch, UnbrokenError
from unbroken.tools.export import export_generation, export_model, verify_export

BASE = "org/base-model@" + "0123456789abcdef" * 2 + "01234567"  # an immutable revision
FACTORY = """import torch

def build():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4))
"""


def net() -> torch.nn.Module:
    """The same model as `FACTORY` builds (verify-export rebuilds it from there)."""
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4))


def train(model: torch.nn.Module, folder, steps=3, saves=(3,), make_input=None, tmp=None,
          **options):
    """A few AdamW updates under a Checkpointer (dropout active), saving after ``saves``."""
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = (tmp or folder.parent) / "train.bin"
    data.write_bytes(b"the training data")
    identity = unbroken.Identity(config={"width": 16}, tokenizer={"vocab": 10}, data=data)
    make_input = make_input or (lambda: torch.randn(4, 8))
    with unbroken.Checkpointer(folder, model=model, optimizer=opt, identity=identity,
                               **options) as ckpt:
        ckpt.restore()
        for step in range(1, steps + 1):
            out = model(make_input())
            out.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            ckpt.step_done(step)
            if step in saves:
                ckpt.save()
        run_id = ckpt.run_id
    return run_id


@pytest.fixture
def run(tmp_path):
    model = net()
    run_id = train(model, tmp_path / "run", saves=(2, 3))
    return tmp_path / "run", model.eval(), run_id


def fixed_input() -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(7))


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                              b.reshape(-1).view(torch.uint8))


def test_cli_export_reloads_with_plain_safetensors_bitwise(run, tmp_path, capsys):
    folder, model, run_id = run
    out = tmp_path / "export"
    assert main(["export", str(folder), str(out), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["ok"] and payload["lineage"]["step"] == 3
    assert sorted(os.listdir(out)) == ["export.json", "model.safetensors"]

    state = load_file(out / "model.safetensors")
    assert sorted(state) == sorted(model.state_dict())  # no optimizer, data, RNG or counter key
    fresh = net()
    fresh.load_state_dict(state, strict=True)
    fresh.eval()
    with torch.no_grad():
        assert bitwise(fresh(fixed_input()), model(fixed_input()))

    doc = json.loads((out / "export.json").read_text())
    assert doc["lineage"] == {"run_id": run_id, "generation": doc["lineage"]["generation"],
                              "incarnation": 0, "step": 3}
    assert sorted(doc["identity"]) == ["config", "tokenizer"]  # the data identity stays home
    assert doc["identity"]["config"]["value"] == {"width": 16}
    assert doc["weights"]["tensors"]["0.weight"] == {"dtype": "float32", "shape": [16, 8]}
    text = (out / "export.json").read_text()
    for word in ("optimizer", "exp_avg", "train.bin", "rng", "sampler", "cursor"):
        assert word not in text
    for sibling in os.listdir(tmp_path):  # the temporary folder was renamed into place
        assert ".export-" not in sibling


def test_export_model_records_fixed_inputs_and_verify_catches_changes(run, tmp_path):
    _, model, run_id = run
    model.train()  # export runs the inputs in eval mode and puts the flag back
    out = tmp_path / "export"
    doc = export_model(model, out, inputs=fixed_input(), lineage={"run_id": run_id},
                       identity=unbroken.Identity(config={"width": 16}, data="train-v3"),
                       generation_config={"max_new_tokens": 20})
    assert model.training and doc["fixed_inputs"]["outputs"] == ["output"]
    assert sorted(doc["identity"]) == ["config", "generation_config"]
    assert sorted(os.listdir(out)) == ["export.json", "fixed_inputs.safetensors",
                                       "model.safetensors"]

    report = verify_export(out, net())
    assert report["mode"] == "bitwise" and report["outputs"][0]["ok"]
    assert report["loaded"] == len(model.state_dict())
    assert verify_export(out, net(), inputs=[fixed_input()])["mode"] == "bitwise"

    perturbed = net()
    verify_export(out, perturbed)
    with torch.no_grad():
        perturbed[3].weight[0, 0] += 1e-3
    with pytest.raises(StateMismatch, match="not bitwise equal"):
        verify_export(out, perturbed, load=False)
    with pytest.raises(StateMismatch, match="max |diff|"):
        verify_export(out, perturbed, load=False, rtol=1e-6)

    raw = bytearray((out / "model.safetensors").read_bytes())
    raw[-1] ^= 1
    (out / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpoint, match="changed or damaged"):
        verify_export(out, net())


def test_verify_refuses_a_model_the_export_is_not_of(run, tmp_path):
    _, model, _ = run
    export_model(model, tmp_path / "export", inputs=fixed_input())
    with pytest.raises(StateMismatch, match="not in the model"):
        verify_export(tmp_path / "export", torch.nn.Sequential(torch.nn.Linear(8, 4)))
    with pytest.raises(StateMismatch, match="does not load"):
        verify_export(tmp_path / "export", torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Dropout(), torch.nn.ReLU(), torch.nn.Linear(16, 5)))


@pytest.mark.parametrize("dtype, torch_dtype", [("bf16", torch.bfloat16),
                                                ("fp16", torch.float16)])
def test_cast_exports_verify_within_their_tolerance(run, tmp_path, dtype, torch_dtype):
    folder, model, _ = run
    assert main(["export", str(folder), str(tmp_path / "cli"), "--dtype", dtype]) == 0
    state = load_file(tmp_path / "cli" / "model.safetensors")
    assert {t.dtype for t in state.values()} == {torch_dtype}

    out = tmp_path / "api"
    doc = export_model(model, out, inputs=fixed_input(), dtype=dtype)
    assert doc["weights"]["cast"] and doc["weights"]["dtype"] == dtype
    report = verify_export(out, net())  # an fp32 model holding the cast weights
    assert report["mode"] == "tolerance" and report["tolerance"]["class"] == dtype
    assert all(row["ok"] for row in report["outputs"])
    in_dtype = verify_export(out, net().to(torch_dtype))  # a model cast as well
    assert in_dtype["outputs"][0]["dtype"] == str(torch_dtype).removeprefix("torch.")
    with pytest.raises(StateMismatch, match="over the bound"):
        verify_export(out, net(), rtol=0.0, atol=0.0)


def test_adapter_export_needs_an_immutable_base_revision(run, tmp_path):
    folder, model, _ = run
    with pytest.raises(MissingState, match="base_revision"):
        export_model(model, tmp_path / "a", adapter="3.")
    with pytest.raises(UnbrokenError, match="not an immutable revision"):
        export_model(model, tmp_path / "a", adapter="3.", base_revision="org/base@main")
    with pytest.raises(StateMismatch, match="match no tensor"):
        export_model(model, tmp_path / "a", adapter=["3.weight", "9.bias"], base_revision=BASE)
    assert not (tmp_path / "a").exists()

    doc = export_model(model, tmp_path / "a", adapter="3.", base_revision=BASE,
                       inputs=fixed_input())
    assert doc["kind"] == "adapter" and doc["adapter"]["base_revision"] == BASE
    assert doc["identity"]["base_revision"] == BASE
    assert sorted(load_file(tmp_path / "a" / "model.safetensors")) == ["3.bias", "3.weight"]
    base = net()
    base.load_state_dict({k: v for k, v in model.state_dict().items() if k.startswith("0.")},
                         strict=False)
    assert verify_export(tmp_path / "a", base)["mode"] == "bitwise"  # base + adapter

    assert main(["export", str(folder), str(tmp_path / "b"), "--adapter", "0.weight"]) == 2
    assert main(["export", str(folder), str(tmp_path / "b"), "--adapter", "0.weight",
                 "--adapter", "3.*", "--base-revision", BASE]) == 0
    assert sorted(load_file(tmp_path / "b" / "model.safetensors")) == ["0.weight", "3.bias",
                                                                       "3.weight"]


def test_existing_output_folder_is_refused(run, tmp_path, capsys):
    folder, model, _ = run
    out = tmp_path / "export"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UnbrokenError, match="never overwrites"):
        export_model(model, out)
    assert main(["export", str(folder), str(out)]) == 2
    assert "never overwrites" in capsys.readouterr().err
    assert os.listdir(out) == ["keep.txt"]
    (out / "keep.txt").unlink()  # an empty folder is taken
    export_model(model, out)
    assert sorted(os.listdir(out)) == ["export.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["export", "run", "train.bin"]


def test_generation_choice_and_fallback_past_a_corrupt_one(run, tmp_path, capsys):
    folder, _, _ = run
    gens = sorted(p for p in os.listdir(folder) if p.startswith("gen-"))
    assert len(gens) == 2
    older = int(gens[0][4:])
    doc = export_generation(folder, tmp_path / "old", generation=older)
    assert doc["lineage"]["step"] == 2 and doc["lineage"]["generation"] == older
    assert main(["export", str(folder), str(tmp_path / "none"), "--generation", "99"]) == 2

    model_file = folder / gens[1] / "model.safetensors"
    raw = bytearray(model_file.read_bytes())
    raw[-1] ^= 1
    model_file.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["export", str(folder), str(tmp_path / "new"), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["lineage"]["step"] == 2 and len(payload["refused"]) == 1
    assert main(["export", str(folder), str(tmp_path / "bad"), "--generation",
                 str(int(gens[1][4:]))]) == 1
    assert not (tmp_path / "bad").exists()


def test_cli_verify_export_rebuilds_the_model_from_a_factory(run, tmp_path, monkeypatch,
                                                             capsys):
    _, model, _ = run
    (tmp_path / "exfactory.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "export"
    export_model(model, out, inputs={"input": fixed_input()})  # keyword inputs
    capsys.readouterr()
    assert main(["verify-export", str(out), "--factory", "exfactory:build", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "bitwise" and report["outputs"][0]["ok"]
    assert main(["verify-export", str(out), "--factory", "exfactory:nothing"]) == 2
    assert main(["verify-export", str(out), "--factory", "nocolon"]) == 2
    raw = bytearray((out / "fixed_inputs.safetensors").read_bytes())
    raw[-1] ^= 1
    (out / "fixed_inputs.safetensors").write_bytes(bytes(raw))
    assert main(["verify-export", str(out), "--factory", "exfactory:build"]) == 1


def test_incremental_run_exports_its_newest_weights(tmp_path):
    """An incremental save keeps unchanged tensors in files of older generations: the
    export gathers the model's tensors from all of them."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 512), torch.nn.Linear(512, 600),
                                torch.nn.Linear(600, 4))
    model[1].requires_grad_(False)  # frozen, over 1 MiB: kept in the first generation's file
    train(model, tmp_path / "run", saves=(1, 2, 3), incremental=True)
    assert os.path.exists(tmp_path / "run" / "gen-000000003" / "model.g1.safetensors")
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "export")]) == 0
    state = load_file(tmp_path / "export" / "model.safetensors")
    assert sorted(state) == sorted(model.state_dict())
    assert all(bitwise(state[k], v) for k, v in model.state_dict().items())


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(12, 6)
        self.head = torch.nn.Linear(6, 12, bias=False)
        self.head.weight = self.emb.weight  # shared storage: safetensors' own writer refuses

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


def test_tied_weights_export_under_both_names(tmp_path):
    model = Tied()
    tokens = torch.arange(12).reshape(3, 4)
    export_model(model, tmp_path / "export", inputs=tokens)
    state = load_file(tmp_path / "export" / "model.safetensors")
    assert sorted(state) == ["emb.weight", "head.weight"]
    fresh = Tied()
    fresh.load_state_dict(state, strict=True)
    assert bitwise(fresh(tokens), model(tokens))
    assert verify_export(tmp_path / "export", Tied())["mode"] == "bitwise"


def test_demo_model_export_is_bitwise_on_fixed_inputs(tmp_path):
    """Acceptance (issue 13): the demo's language model, trained under a Checkpointer,
    exported with `unbroken export`, reloads with plain `load_file` into a fresh model with
    bitwise-equal logits, and the export holds no optimizer or data key."""
    from unbroken.proof.tinylm import CONTEXT, TinyLM, Windows, corpus

    vocab = Windows(corpus(2000), 16).vocab
    torch.manual_seed(0)
    model = TinyLM(vocab)
    train(model, tmp_path / "run", steps=2, saves=(2,),
          make_input=lambda: torch.randint(0, vocab, (4, CONTEXT)))
    out = tmp_path / "export"
    assert main(["export", str(tmp_path / "run"), str(out)]) == 0
    state = load_file(out / "model.safetensors")
    assert sorted(state) == sorted(model.state_dict())
    assert not [k for k in state if any(w in k for w in ("optim", "exp_avg", "data", "rng"))]
    fresh = TinyLM(vocab)
    fresh.load_state_dict(state, strict=True)
    tokens = torch.randint(0, vocab, (3, CONTEXT), generator=torch.Generator().manual_seed(1))
    model.eval(), fresh.eval()
    with torch.no_grad():
        assert bitwise(fresh(tokens), model(tokens))

    export_model(model, tmp_path / "api", inputs=tokens)
    assert verify_export(tmp_path / "api", TinyLM(vocab))["mode"] == "bitwise"
    bf16 = tmp_path / "bf16"
    export_model(model, bf16, inputs=tokens, dtype="bf16")
    assert verify_export(bf16, TinyLM(vocab))["tolerance"]["class"] == "bf16"


def test_the_checkpointer_exports_its_live_model_with_lineage_and_fixed_inputs(tmp_path):
    import json

    import unbroken

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5),
                                torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(3, 4)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        model(x).sum().backward()
        opt.step()
        ckpt.step_done(1)
        ckpt.save()
        ckpt.export(tmp_path / "out", inputs=x)
        run_id = ckpt.run_id
    doc = json.loads((tmp_path / "out" / "export.json").read_text())
    assert doc["lineage"]["run_id"] == run_id and doc["lineage"]["generation"] == 1
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5),
                                torch.nn.Linear(8, 2))
    report = unbroken.verify_export(tmp_path / "out", fresh)
    assert report  # loaded and re-ran the recorded input
    with torch.no_grad():
        fresh[0].weight.add_(1e-3)
    with pytest.raises(unbroken.StateMismatch):
        unbroken.verify_export(tmp_path / "out", fresh, load=False)


def test_what_a_generation_holds_that_an_export_cannot_names_the_generation(tmp_path):
    """A module's extra state (a dict) is saved with the model; an inference export holds
    tensors only and says so, naming the generation (an outside attack, session 40: the
    message named the key alone)."""
    from unbroken.errors import UnsupportedValue

    class WithExtra(torch.nn.Linear):
        def get_extra_state(self):
            return {"vocab": 3}

        def set_extra_state(self, state):
            pass

    model = WithExtra(2, 2)
    with unbroken.Checkpointer(tmp_path / "run", model=model) as ckpt:
        ckpt.save(1)
    with pytest.raises(UnsupportedValue, match=r"gen-000000001 \[model\]: '_extra_state'"):
        export_generation(tmp_path / "run", tmp_path / "out")


def test_cli_export_takes_a_generation_folder_as_verify_and_diff_do(run, tmp_path, capsys):
    """`unbroken export RUN/gen-N OUT` exports generation N (an outside attack, session 40:
    "no generation to export (found none)"); beside another --generation, or naming a folder
    that is not there, it is a usage error."""
    folder, _, _ = run
    gens = sorted(p.name for p in folder.iterdir() if p.name.startswith("gen-"))
    assert len(gens) == 2
    assert main(["export", str(folder / gens[0]), str(tmp_path / "a"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["lineage"]["step"] == 2
    assert main(["export", str(folder / gens[0]), str(tmp_path / "b"), "--generation",
                 gens[1][4:].lstrip("0")]) == 2
    assert "name one" in capsys.readouterr().err
    assert main(["export", str(folder / "gen-000000099"), str(tmp_path / "c")]) == 2
    assert "no such generation folder (export takes" in capsys.readouterr().err
