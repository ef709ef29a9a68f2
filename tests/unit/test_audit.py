"""`unbroken audit`: foreign checkpoints read without executing anything.

Every checkpoint here is written by the real library call (torch.save, safetensors,
torch.distributed.checkpoint, and at the end a Transformers Trainer, an Accelerator and a
Lightning Trainer, all test extras). The
malicious pickles are written with ``pickle.dumps`` (writing is harmless); nothing here or in
the code under test loads them, and the marker file proves no command ran."""

from __future__ import annotations

import importlib
import io
import json
import os
import pickle
import pickletools
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from unbroken.cli import main as cli_main
from unbroken.tools import _pickle_scan as ps


def audit(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    rc = cli_main(["audit", str(path), "--json"])
    return rc, json.loads(capsys.readouterr().out)


def table(doc: dict[str, Any]) -> dict[str, str]:
    return {r["part"]: r["status"] for r in doc["parts"]}


def row(doc: dict[str, Any], part: str) -> dict[str, Any]:
    return next(r for r in doc["parts"] if r["part"] == part)


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def basic_state() -> dict[str, Any]:
    model, opt, sched = trained()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(), "rng_state": torch.get_rng_state()}


BASIC = {"model": "present", "optimizer": "present", "scheduler": "present",
         "scaler": "missing", "rng": "present", "data position": "missing",
         "identity": "missing"}


# -- torch.save -----------------------------------------------------------------------------


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_torch_save_dict(tmp_path, capsys, zip_format):
    path = tmp_path / "ckpt.pt"
    torch.save(basic_state(), path, _use_new_zipfile_serialization=zip_format)
    rc, doc = audit(path, capsys)
    assert rc == 0 and doc["ok"]
    assert doc["kind"] == ("torch.save (zip)" if zip_format else "torch.save (legacy format)")
    assert table(doc) == BASIC
    assert row(doc, "optimizer")["keyed_by_position"] is True
    assert row(doc, "rng")["streams"] == {"torch CPU": [None]}
    assert row(doc, "model")["where"] == ["model: 4 entries"]
    assert doc["verdict"] == "warm start only"
    assert doc["would_import_code"] == [] and doc["needs_numpy_globals"] == []


def test_torch_save_everything_can_continue(tmp_path, capsys):
    state = basic_state() | {
        "python_rng": random.getstate(), "numpy_rng": np.random.get_state(),
        "cuda_rng": [torch.zeros(16, dtype=torch.uint8)],  # the shape get_rng_state_all gives
        "sampler": {"epoch": 1, "position": 96}, "config": {"lr": 1e-3},
        "scaler": torch.amp.GradScaler("cpu").state_dict(), "step": 7}
    torch.save(state, tmp_path / "full.pt")
    rc, doc = audit(tmp_path / "full.pt", capsys)
    assert rc == 0 and doc["ok"]
    assert set(table(doc).values()) == {"present"}
    assert set(row(doc, "rng")["streams"]) == {"python", "numpy", "torch CPU", "CUDA"}
    assert doc["verdict"] == "can continue"
    # NumPy's RNG state needs numpy globals: reported, not treated as code
    assert any(g.endswith("_reconstruct") for g in doc["needs_numpy_globals"])
    assert doc["would_import_code"] == []


def test_counters_alone_are_a_partial_data_position(tmp_path, capsys):
    torch.save(basic_state() | {"epoch": 3, "global_step": 120}, tmp_path / "c.pt")
    rc, doc = audit(tmp_path / "c.pt", capsys)
    assert rc == 0 and table(doc)["data position"] == "partial"
    assert sorted(row(doc, "data position")["where"]) == ["epoch", "global_step"]


def test_bare_model_state_dict_is_inference_only(tmp_path, capsys):
    model, _opt, _sched = trained()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    rc, doc = audit(tmp_path / "pytorch_model.bin", capsys)
    assert rc == 0 and doc["verdict"] == "inference only"
    assert table(doc)["model"] == "present" and table(doc)["optimizer"] == "missing"


def test_optimizer_only_file_has_no_model(tmp_path, capsys):
    _model, opt, _sched = trained()
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    rc, doc = audit(tmp_path / "optimizer.pt", capsys)
    assert rc == 0 and doc["verdict"] == "no model weights"
    assert table(doc)["optimizer"] == "present"


def test_human_output(tmp_path, capsys):
    torch.save(basic_state(), tmp_path / "ckpt.pt")
    assert cli_main(["audit", str(tmp_path / "ckpt.pt")]) == 0
    out = capsys.readouterr().out
    assert "keyed by position" in out
    assert "verdict: warm start only (missing: data position)" in out


# -- safetensors and DCP --------------------------------------------------------------------


def test_bare_safetensors(tmp_path, capsys):
    model, _opt, _sched = trained()
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    rc, doc = audit(tmp_path / "model.safetensors", capsys)
    assert rc == 0 and doc["kind"] == "safetensors file"
    assert doc["verdict"] == "inference only"
    assert table(doc) == {p: "present" if p == "model" else "missing" for p in BASIC}


def test_dcp_folder(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    model, opt, _sched = trained()
    folder = tmp_path / "dcp"
    with pytest.warns(UserWarning):  # "assuming the intent is to save in a single process"
        dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1},
                 checkpoint_id=str(folder))
    assert (folder / ".metadata").is_file()
    rc, doc = audit(folder, capsys)
    assert rc == 0 and doc["ok"], doc["files"]
    assert doc["kind"].startswith("DCP")
    assert table(doc) == BASIC | {"scheduler": "missing", "rng": "missing",
                                  "data position": "partial"}
    assert row(doc, "optimizer")["keyed_by_position"] is True
    assert doc["verdict"] == "warm start only"
    # the metadata pickle names DCP's own classes: listed by the scan, none flagged
    assert doc["files"][0]["name"] == ".metadata" and doc["files"][0]["code"] == []


# -- pickles that would run code ------------------------------------------------------------


class Payload:
    """Unpickling this runs ``touch marker``: a pickle that would execute a command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch " + str(self.marker),))


@pytest.mark.parametrize("protocol", [2, 4], ids=["GLOBAL", "STACK_GLOBAL"])
def test_os_system_is_flagged_and_never_run(tmp_path, capsys, protocol):
    marker = tmp_path / "marker"
    data = pickle.dumps({"model": Payload(marker)}, protocol=protocol)
    assert (b"\x93" in data) == (protocol == 4)  # STACK_GLOBAL only at protocol 4
    (tmp_path / "x.pt").write_bytes(data)
    rc, doc = audit(tmp_path / "x.pt", capsys)
    assert rc == 1 and not doc["ok"]
    system = f"{os.system.__module__}.system"  # posix.system (nt.system on Windows)
    assert doc["would_import_code"] == [system] and doc["dangerous"] == [system]
    assert cli_main(["audit", str(tmp_path / "x.pt")]) == 1
    assert f"WOULD IMPORT CODE: {system}" in capsys.readouterr().out
    assert not marker.exists()


def _archive_with(tmp_path: Path, entries: list[tuple[str, bytes]], prefix: bytes = b""
                  ) -> Path:
    """A torch.save zip of ``basic_state()`` with ``entries`` added, after ``prefix``."""
    import zipfile

    torch.save(basic_state(), tmp_path / "good.pt")
    with zipfile.ZipFile(tmp_path / "good.pt") as z:
        members = [(i.filename, z.read(i)) for i in z.infolist()]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (zipfile warns of a duplicate name: that is the point)
        for name, data in [*entries, *members]:
            z.writestr(name, data)
    path = tmp_path / "hostile.pt"
    path.write_bytes(prefix + buf.getvalue())
    return path


def test_an_archive_behind_a_pickle_is_judged_by_the_pickle_torch_reads(tmp_path, capsys):
    """torch.load reads a file as a zip only when it begins with one (else it unpickles it);
    zipfile finds an archive anywhere. A payload pickle with a clean archive (or an empty end
    record) appended was judged by the archive: clean."""
    import zipfile

    marker = tmp_path / "marker"
    payload = pickle.dumps(Payload(marker), protocol=2)
    system = f"{os.system.__module__}.system"
    polyglot = _archive_with(tmp_path, [], prefix=payload)
    empty = io.BytesIO()
    zipfile.ZipFile(empty, "w").close()
    (tmp_path / "eocd.pt").write_bytes(payload + empty.getvalue())
    for path in (polyglot, tmp_path / "eocd.pt"):
        assert zipfile.is_zipfile(path)  # (what was trusted)
        rc, doc = audit(path, capsys)
        assert rc == 1 and doc["dangerous"] == [system], doc
        assert cli_main(["import", str(path), str(tmp_path / "run")]) != 0
        capsys.readouterr()
    assert not marker.exists()


def test_a_second_data_pkl_in_an_archive_is_scanned_too(tmp_path, capsys):
    """Two entries of one name: torch reads the first, a lookup by name the last, which was
    all that was scanned."""
    marker = tmp_path / "marker"
    torch.save(basic_state(), tmp_path / "good.pt")
    import zipfile

    with zipfile.ZipFile(tmp_path / "good.pt") as z:
        pkl = next(n for n in z.namelist() if n.endswith("/data.pkl"))
    path = _archive_with(tmp_path, [(pkl, pickle.dumps(Payload(marker), protocol=2))])
    rc, doc = audit(path, capsys)
    assert rc == 1 and doc["dangerous"] == [f"{os.system.__module__}.system"], doc
    assert cli_main(["import", str(path), str(tmp_path / "run")]) == 1
    assert "would import" in capsys.readouterr().err
    assert not marker.exists()


def test_torch_save_of_a_payload_is_flagged(tmp_path, capsys):
    marker = tmp_path / "marker"
    torch.save(basic_state() | {"extra": Payload(marker)}, tmp_path / "ckpt.pt")
    rc, doc = audit(tmp_path / "ckpt.pt", capsys)
    assert rc == 1 and doc["dangerous"] == [f"{os.system.__module__}.system"]
    assert table(doc) == BASIC  # the rest is still read
    assert not marker.exists()


def test_dcp_bytes_entry_with_a_payload_is_flagged(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "marker"
    model, _opt, _sched = trained()
    with pytest.warns(UserWarning):
        dcp.save({"model": model.state_dict(), "extra": Payload(marker)},
                 checkpoint_id=str(tmp_path / "dcp"))
    rc, doc = audit(tmp_path / "dcp", capsys)
    assert rc == 1 and doc["dangerous"] == [f"{os.system.__module__}.system"]
    assert [f["name"].endswith("(extra)") for f in doc["files"] if f["flagged"]] == [True]
    assert not marker.exists()


class TrainState:
    def __init__(self) -> None:
        self.step = 3


def test_user_class_would_import_code(tmp_path, capsys):
    torch.save(basic_state() | {"train_state": TrainState()}, tmp_path / "ckpt.pt")
    rc, doc = audit(tmp_path / "ckpt.pt", capsys)
    assert rc == 1 and doc["would_import_code"] == [f"{__name__}.TrainState"]
    assert doc["dangerous"] == []


def test_unresolved_stack_global_is_flagged(tmp_path, capsys):
    # PROTO 4, NONE, NONE, STACK_GLOBAL, STOP: the names are not strings, so what it would
    # import cannot be told (hand-assembled: a pickle, not an imitation of a library format)
    (tmp_path / "u.pkl").write_bytes(b"\x80\x04NN\x93.")
    rc, doc = audit(tmp_path / "u.pkl", capsys)
    assert rc == 1 and doc["unresolved_globals"] == 1


def test_scanner_resolves_memoized_stack_global_names():
    # the second STACK_GLOBAL takes its module string from the memo (BINGET), as DCP's
    # .metadata does for every class after the first
    data = pickle.dumps([os.system, os.listdir], protocol=4)
    ops = [op.name for op, _arg, _pos in pickletools.genops(data)]
    second = [i for i, name in enumerate(ops) if name == "STACK_GLOBAL"][1]
    assert "BINGET" in ops[second - 3:second]
    scan = ps.scan_pickle(io.BytesIO(data))
    assert scan.error is None and scan.unresolved == 0
    module = os.system.__module__
    assert scan.globals == [f"{module}.system", f"{module}.listdir"]
    assert scan.root == [ps.Global(module, "system"), ps.Global(module, "listdir")]


def test_broken_protocol_0_pickle_is_still_flagged(tmp_path, capsys):
    # pickle.load would run os.system before reaching the garbage: flagged, not "unknown"
    (tmp_path / "p0.pt").write_bytes(b"cos\nsystem\n(S'echo hi'\ntR\xff\xfe garbage")
    rc, doc = audit(tmp_path / "p0.pt", capsys)
    assert rc == 1 and doc["dangerous"] == ["os.system"]
    assert doc["files"][0]["errors"]


def test_allowlist_covers_torch_weights_only():
    from torch._weights_only_unpickler import _get_allowed_globals

    assert {g: ps.classify(g) for g in _get_allowed_globals()} == {
        g: "weights_only" for g in _get_allowed_globals()}
    for g in ("posix.system", "builtins.eval", "subprocess.Popen", "builtins.getattr"):
        assert ps.classify(g) == "code" and ps.dangerous(g)
    assert ps.classify("numpy._core.multiarray._reconstruct") == "numpy"


# -- what is not a checkpoint ---------------------------------------------------------------


def test_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("import torch\n")
    assert cli_main(["audit", str(tmp_path / "notes.txt")]) == 2
    assert cli_main(["audit", str(tmp_path / "missing.pt")]) == 2
    (tmp_path / "empty").mkdir()
    assert cli_main(["audit", str(tmp_path / "empty")]) == 2
    capsys.readouterr()


def test_unbroken_run_points_to_inspect(tmp_path, capsys):
    import unbroken

    model, opt, _sched = trained()
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt)
    ckpt.restore()
    ckpt.step_done(1)
    ckpt.save()
    ckpt.close()
    rc, doc = audit(tmp_path / "run", capsys)
    assert rc == 0 and doc["kind"] == "unbroken run"
    assert "unbroken inspect" in doc["notes"][0]


# -- the libraries themselves (run where they are installed) --------------------------------


def test_transformers_trainer_checkpoint(tmp_path, capsys):
    transformers = importlib.import_module("transformers")
    config = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=1,
                                     n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x} for x in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, save_steps=2, save_strategy="steps",
        per_device_train_batch_size=2, report_to=[], use_cpu=True)
    transformers.Trainer(model=model, args=args, train_dataset=data).train()
    capsys.readouterr()  # the Trainer prints its own summary
    rc, doc = audit(tmp_path / "checkpoint-2", capsys)
    assert doc["kind"] == "Hugging Face Trainer checkpoint"
    assert table(doc) == BASIC | {"data position": "partial", "identity": "present"}
    assert row(doc, "optimizer")["keyed_by_position"] is True
    assert {"python", "numpy", "torch CPU"} <= set(row(doc, "rng")["streams"])
    assert doc["verdict"] == "can continue"
    # training_args.bin is a pickled TrainingArguments: the one file that imports code
    assert rc == 1 and [f["name"] for f in doc["files"] if f["flagged"]] == [
        "training_args.bin"]
    assert "transformers.training_args.TrainingArguments" in doc["would_import_code"]


def test_accelerate_save_state(tmp_path, capsys):
    accelerate = importlib.import_module("accelerate")
    acc = accelerate.Accelerator(cpu=True)
    model, opt, sched = trained()
    model, opt, sched = acc.prepare(model, opt, sched)
    acc.backward(model(torch.randn(5, 3)).sum())
    opt.step()
    sched.step()
    acc.save_state(str(tmp_path / "state"))
    rc, doc = audit(tmp_path / "state", capsys)
    assert doc["kind"] == "Accelerate save_state folder"
    assert table(doc) == BASIC  # no data position without a stateful loader or sampler
    assert row(doc, "rng")["streams"]["torch CPU"] == [0]
    assert doc["verdict"] == "warm start only"
    assert rc == 0 and doc["would_import_code"] == []


def test_lightning_ckpt(tmp_path, capsys):
    L = importlib.import_module("lightning.pytorch")

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}

    ds = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1)
    trainer.fit(Module(), torch.utils.data.DataLoader(ds, batch_size=4))
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    rc, doc = audit(tmp_path / "last.ckpt", capsys)
    assert doc["kind"].startswith("Lightning checkpoint")
    # Lightning saves no RNG state; its loop counters are a partial data position
    assert table(doc) == BASIC | {"rng": "missing", "data position": "partial"}
    assert row(doc, "optimizer")["keyed_by_position"] is True
    assert doc["verdict"] == "warm start only"
    assert doc["dangerous"] == []
    assert rc == 0 or all(g.startswith(("lightning", "pytorch_lightning"))
                          for g in doc["would_import_code"])


def test_a_dict_key_nested_past_any_stack_and_instruction_bombs_are_bounded(
        tmp_path, capsys, monkeypatch):
    """hash() of a tuple nested 300,000 deep overflows C's stack (the process died); a
    20 KB pickle of 20 million empty dicts held 4 GB. Each gets a verdict, bounded (the
    instruction cap lowered here, to keep the test short)."""
    import resource
    import zipfile

    monkeypatch.setattr(ps, "MAX_INSTRUCTIONS", 200_000)

    key = b"}" + b")" + b"\x85" * 300_000 + b"X\x01\x00\x00\x00vs."  # {((((),),...),): "v"}
    bomb = b"\x80\x02(" + b"}" * (ps.MAX_INSTRUCTIONS + 10) + b"l."
    for name, pkl in (("key.pt", b"\x80\x02" + key), ("bomb.pt", bomb)):
        with zipfile.ZipFile(tmp_path / name, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("archive/data.pkl", pkl)
            z.writestr("archive/version", "3\n")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rc, doc = audit(tmp_path / "key.pt", capsys)
    assert rc in (0, 1) and doc["kind"] == "torch.save (zip)"
    rc, doc = audit(tmp_path / "bomb.pt", capsys)
    assert rc == 1 and any("instructions" in e for f in doc["files"] for e in f["errors"]), doc
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 200, grown_mib


@pytest.mark.parametrize("entries,words", [
    ({"a": {"dtype": "X99", "shape": [1], "data_offsets": [0, 4]}}, "malformed header entry"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, "overlapping"),
    ({"a": {"dtype": "F32", "shape": [2 ** 62, 2 ** 62], "data_offsets": [0, 4]}},
     "malformed header entry"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, "the file holds 8"),
], ids=["unknown-dtype", "overlapping", "overflowing-shape", "past-the-end"])
def test_a_safetensors_file_no_reader_accepts_is_refused_by_audit(tmp_path, capsys, entries,
                                                                   words):
    """audit read only the header's JSON: a file no reader takes passed as inference-only.
    It checks the header as every reader does (never the tensors, never torch)."""
    header = json.dumps(entries).encode()
    (tmp_path / "x.safetensors").write_bytes(len(header).to_bytes(8, "little") + header
                                             + bytes(8))
    assert cli_main(["audit", str(tmp_path / "x.safetensors"), "--json"]) == 2
    assert words in json.loads(capsys.readouterr().out)["error"]


def test_the_torch_free_header_check_knows_torch_s_element_sizes():
    from unbroken.state.stheader import ITEMSIZE
    from unbroken.state.tensorfile import ST_DTYPES

    assert ITEMSIZE == {name: torch.empty(0, dtype=dt).element_size()
                        for dt, name in ST_DTYPES.items()}
