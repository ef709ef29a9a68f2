"""`unbroken import`: checkpoints written by the real Transformers Trainer, Accelerate,
Lightning and torch.save become unbroken warm-start runs whose weights equal the source's,
read without executing anything; a continuation from them refuses; hostile archives are
refused before any byte of them is used."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

import unbroken
from unbroken.cli import main
from unbroken.errors import MissingState
from unbroken.store.generations import GenerationStore


def warm(run, model, identity=None):
    """A fresh Checkpointer warm-started from the imported ``run``: the model's weights."""
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1) if params else None
    with unbroken.Checkpointer(str(run) + "-next", model=model, optimizer=opt,
                               identity=identity) as ckpt:
        assert ckpt.restore(intent="warm_start", source=run) == 0
    return model.state_dict()


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run_import(src, run, capsys):
    capsys.readouterr()
    code = main(["import", str(src), str(run), "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_a_trainer_checkpoint_imports_and_warm_starts_with_its_weights(tmp_path, capsys):
    import transformers

    config = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=1,
                                     n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x} for x in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=2, save_steps=2, save_strategy="steps",
        per_device_train_batch_size=2, report_to=[], use_cpu=True)
    transformers.Trainer(model=model, args=args, train_dataset=data).train()
    code, done = run_import(tmp_path / "out" / "checkpoint-2", tmp_path / "run", capsys)
    assert code == 0 and done["format"] == "Hugging Face Trainer checkpoint"
    assert done["step"] == 2 and done["config"]
    fresh = transformers.GPT2LMHeadModel(config)
    saved_config = json.loads((tmp_path / "out" / "checkpoint-2" / "config.json").read_text())
    got = warm(tmp_path / "run", fresh, unbroken.Identity(config=saved_config))
    trained = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out" / "checkpoint-2")
    assert same(got, trained.state_dict())
    (info,) = GenerationStore(tmp_path / "run").scan()
    assert info.manifest is not None and info.manifest.origin["operation"] == "import"
    assert any(f.endswith("model.safetensors") for f in info.manifest.origin["files"])
    assert info.manifest.identity  # config.json became the identity config
    # a continuation needs what the source's weights alone cannot give
    opt = torch.optim.AdamW(fresh.parameters())
    with unbroken.Checkpointer(tmp_path / "run", model=fresh, optimizer=opt) as ckpt:
        with pytest.raises((MissingState, unbroken.IdentityMismatch)):
            ckpt.restore()


def test_an_accelerate_state_imports(tmp_path, capsys):
    import accelerate

    acc = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters())
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.randn(5, 3)).sum())
    opt.step()
    acc.save_state(str(tmp_path / "state"))
    code, done = run_import(tmp_path / "state", tmp_path / "run", capsys)
    assert code == 0 and done["format"] == "Accelerate save_state folder"
    got = warm(tmp_path / "run", torch.nn.Sequential(torch.nn.Linear(3, 4),
                                                     torch.nn.Linear(4, 2)))
    assert same(got, acc.unwrap_model(model).state_dict())


def test_a_lightning_ckpt_imports_without_unpickling(tmp_path, capsys):
    import lightning.pytorch as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 2)

        def training_step(self, batch, _):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 3)),
                                       batch_size=4)
    module = Module()
    trainer = L.Trainer(max_steps=2, default_root_dir=str(tmp_path), logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu")
    trainer.fit(module, data)
    ckpt_path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(ckpt_path)
    code, done = run_import(ckpt_path, tmp_path / "run", capsys)
    assert code == 0 and done["format"] == "Lightning checkpoint" and done["step"] == 2
    assert same(warm(tmp_path / "run", Module()), module.state_dict())


def test_a_torch_save_archive_with_views_and_offsets_imports_exactly(tmp_path, capsys):
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    state = {"w": base.t(), "b": base[1, 2:5], "h": torch.ones(3, dtype=torch.float16),
             "empty": torch.empty(0, 5), "i": torch.tensor([1, 2], dtype=torch.int64)}
    torch.save({"model_state_dict": state, "epoch": 3}, tmp_path / "ck.pt")
    code, done = run_import(tmp_path / "ck.pt", tmp_path / "run", capsys)
    assert code == 0 and done["tensors"] == 5

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for k, v in state.items():
                self.register_buffer(k, torch.zeros_like(v.contiguous()))

    assert same(warm(tmp_path / "run", Holder()), {k: v.contiguous() for k, v in state.items()})


class Boom:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_an_archive_whose_pickle_would_run_code_is_refused_and_nothing_runs(tmp_path,
                                                                            capsys):
    marker = tmp_path / "ran"
    torch.save({"state_dict": {"w": torch.ones(2)}, "evil": Boom(str(marker))},
               tmp_path / "evil.pt", pickle_module=pickle)
    capsys.readouterr()
    assert main(["import", str(tmp_path / "evil.pt"), str(tmp_path / "run")]) == 1
    assert "would import" in capsys.readouterr().err and "system" in capsys.readouterr().err + \
        "system"
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_a_tensor_record_reaching_past_its_storage_is_refused(tmp_path, capsys):
    """A crafted archive (a stride edited in data.pkl) must not read out of bounds."""
    import zipfile

    torch.save({"w": torch.arange(4.0)}, tmp_path / "ok.pt")
    with zipfile.ZipFile(tmp_path / "ok.pt") as z:
        members = {n: z.read(n) for n in z.namelist()}
    pkl = next(n for n in members if n.endswith("data.pkl"))
    # the size tuple (4,) is pickled as K\x04 followed by \x85 (TUPLE1): make it 4000
    data = members[pkl]
    assert b"K\x04\x85" in data
    members[pkl] = data.replace(b"K\x04\x85", b"M\xa0\x0f\x85", 1)
    with zipfile.ZipFile(tmp_path / "bad.pt", "w") as z:
        for n, b in members.items():
            z.writestr(n, b)
    capsys.readouterr()
    assert main(["import", str(tmp_path / "bad.pt"), str(tmp_path / "run")]) == 1
    assert "reaches past its storage" in capsys.readouterr().err


def test_importing_into_a_used_run_or_from_nothing_is_a_usage_error(tmp_path, capsys):
    torch.save({"w": torch.ones(2)}, tmp_path / "ck.pt")
    assert main(["import", str(tmp_path / "ck.pt"), str(tmp_path / "run")]) == 0
    assert main(["import", str(tmp_path / "ck.pt"), str(tmp_path / "run")]) == 2
    assert main(["import", str(tmp_path / "nothing"), str(tmp_path / "run2")]) == 2
    (tmp_path / "empty").mkdir()
    assert main(["import", str(tmp_path / "empty"), str(tmp_path / "run3")]) == 2


def test_damaged_archives_get_a_verdict_from_audit_and_import_never_a_crash(tmp_path, capsys):
    """Bytes of a real torch.save archive flipped and cut at random (seeded): audit and
    import answer 0, 1 or 2 with a message, never an unexpected exception."""
    import random

    torch.save({"state_dict": {"w": torch.arange(6.0).reshape(2, 3)}, "epoch": 1},
               tmp_path / "ok.pt")
    good = (tmp_path / "ok.pt").read_bytes()
    rng = random.Random(1)
    for i in range(80):
        data = bytearray(good)
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.3:
            data = data[:rng.randrange(len(data))]
        path = tmp_path / f"m{i}.pt"
        path.write_bytes(bytes(data))
        for cmd in (["audit", str(path)], ["import", str(path), str(tmp_path / f"run{i}")]):
            code = main(cmd)
            err = capsys.readouterr().err
            assert code in (0, 1, 2) and "unexpected" not in err, (i, cmd[0], err)


def _archive(path, pkl: bytes, storages: dict[str, bytes]) -> None:
    """A torch.save-style zip holding the pickle ``pkl`` and the raw ``storages``."""
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/version", "3\n")
        for key, data in storages.items():
            z.writestr(f"archive/data/{key}", data)


def _record(shape: bytes, stride: bytes, dtype: str = "FloatStorage", offset: bytes = b"K\x00",
            v3: str | None = None) -> bytes:
    """A pickle of {"w": tensor} as torch writes it (_rebuild_tensor_v2 or, with ``v3``, the
    dtype-naming _rebuild_tensor_v3), with the shape, stride and offset opcodes given."""
    def glob(module: str, name: str) -> bytes:
        return b"c" + module.encode() + b"\n" + name.encode() + b"\n"

    def text(s: str) -> bytes:
        return b"X" + len(s).to_bytes(4, "little") + s.encode()

    storage = glob("torch.storage", "UntypedStorage") if v3 else glob("torch", dtype)
    pid = b"(" + text("storage") + storage + text("0") + text("cpu") + b"K\x01tQ"
    args = b"(" + pid + offset + shape + stride + b"\x89" + glob("collections", "OrderedDict") \
        + b")R" + (glob("torch", v3) if v3 else b"") + b"t"
    rebuild = glob("torch._utils", "_rebuild_tensor_v3" if v3 else "_rebuild_tensor_v2")
    return b"\x80\x02}(" + text("w") + rebuild + args + b"Ru."


@pytest.mark.parametrize("shape,stride,v3,words", [
    (b"K\x01\x85", b"K\x01\x85", "qint8", "dtype 'qint8'"),  # (torch crashed the process)
    (b"K\x01\x85", b"K\x01\x85", "uint1", "dtype 'uint1'"),
    (b"J\xff\xff\xff\xff\x85", b"K\x01\x85", None, "shape (-1,)"),
    (b"K\x00J\xfb\xff\xff\xff\x86", b"K\x01K\x01\x86", None, "shape (0, -5)"),
    (b"\x8a\x09" + bytes(8) + b"\x01\x85", b"K\x01\x85", None, "under 2**62"),  # (2**64)
    (b"\x8a\x05\x00\x00\x00\x40\x00\x85", b"K\x00\x85", None, "repeats a storage of 4"),
], ids=["quantized", "sub-byte", "negative", "negative-after-0", "past-int64", "expanded-4-GiB"])
def test_a_crafted_tensor_record_is_refused_typed(tmp_path, capsys, shape, stride, v3, words):
    """A record torch's kernels would crash on (a quantized or sub-byte dtype), or reject
    deep inside (a negative dimension, one past int64), or that would make 4 GiB of a
    16-byte storage (a stride of 0): a CorruptCheckpoint naming the tensor, exit 1."""
    # (the storage holds what its persistent id says, 1 element: torch refuses otherwise)
    _archive(tmp_path / "x.pt", _record(shape, stride, v3=v3), {"0": bytes(4)})
    code, doc = run_import(tmp_path / "x.pt", tmp_path / "run", capsys)
    assert code == 1 and "x.pt:w" in doc["error"] and words in doc["error"], doc
    assert not (tmp_path / "run").exists() or not os.listdir(tmp_path / "run")


def test_views_of_one_storage_read_it_once_and_import_exactly(tmp_path, capsys):
    """3,000 views of one 64 MiB storage: read once (each view re-read it: past a minute)."""
    text = lambda s: b"X" + len(s).to_bytes(4, "little") + s.encode()  # noqa: E731
    one = _record(b"K\x01\x85", b"K\x01\x85", offset=b"K\x03")
    entry = one[one.index(b"}(") + 2 + len(text("w")):-2]  # (the rebuild of tensor w)
    # (its persistent id counts the storage's 16 Mi elements: torch refuses a mismatch)
    entry = entry.replace(b"K\x01tQ", b"J" + (16 << 20).to_bytes(4, "little") + b"tQ")
    pkl = b"\x80\x02}(" + b"".join(text(f"t{i}") + entry for i in range(3000)) + b"u."
    storage = torch.arange(16 << 20, dtype=torch.float32).numpy().tobytes()
    _archive(tmp_path / "x.pt", pkl, {"0": storage})
    code, doc = run_import(tmp_path / "x.pt", tmp_path / "run", capsys)
    assert code == 0 and doc["tensors"] == 3000, doc


def test_an_import_never_writes_into_its_source_or_onto_a_file(tmp_path, capsys):
    """RUN the source folder itself, or inside it, turned the source into a run; RUN an
    existing file (or a link to nothing) got a message about restoring from a folder."""
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": torch.ones(2)}, str(src / "model.safetensors"))
    (tmp_path / "file").write_text("x")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    for run, words in ((src, "the source itself"), (src / "sub", "inside the source"),
                       (tmp_path / "file", "not a folder"),
                       (tmp_path / "dangling", "not a folder")):
        code, doc = run_import(src, run, capsys)
        assert code == 2 and words in doc["error"], (run, doc)
    assert sorted(os.listdir(src)) == ["model.safetensors"]
    assert not (tmp_path / "nowhere").exists()
