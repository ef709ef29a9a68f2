"""`unbroken import` and imported runs, as an outside review found them (session 28): a
``continue`` restore from an imported run went through and replaced the live RNG streams
with the importing process's; torch.save archives of uint16/uint32/uint64 tensors (records
torch writes as untyped storages, counted in bytes) were refused as corrupt; an Accelerate
folder of two models imported the first alone without a word; `unbroken inspect` showed an
import's origin as ``gen null (run null)``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import unbroken
from unbroken.cli import main
from unbroken.errors import MissingState


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    code = main([*args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_a_continuation_from_an_imported_run_is_refused_before_any_live_change(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    source = torch.nn.Linear(3, 2)
    torch.save({"global_step": 500, "state_dict": source.state_dict()}, tmp_path / "ckpt.pt")
    code, _ = run_cli(["import", str(tmp_path / "ckpt.pt"), str(tmp_path / "run")], capsys)
    assert code == 0
    torch.manual_seed(123)
    rng, model = torch.get_rng_state(), torch.nn.Linear(3, 2)
    weight = model.weight.detach().clone()
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=model)
    with pytest.raises(MissingState) as e:
        ckpt.restore()  # intent="continue"
    ckpt.close()
    assert "imported weights" in str(e.value) and 'intent="warm_start"' in str(e.value)
    assert str(tmp_path / "ckpt.pt") in str(e.value)
    assert torch.equal(model.weight, weight)  # nothing live changed: weights, RNG
    rng_now = torch.get_rng_state()
    torch.manual_seed(123)
    torch.nn.Linear(3, 2)
    assert torch.equal(rng_now, torch.get_rng_state())
    del rng
    # the import's own operation still works: a warm start into a new run
    warm = torch.nn.Linear(3, 2)
    ckpt = unbroken.Checkpointer(tmp_path / "new", model=warm)
    ckpt.restore(intent="warm_start", source=tmp_path / "run")
    ckpt.close()
    assert torch.equal(warm.weight, source.weight) and torch.equal(warm.bias, source.bias)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64, torch.int16,
                                   torch.float8_e4m3fn, torch.bfloat16])
def test_unsigned_tensors_import_bitwise(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         dtype: torch.dtype) -> None:
    """torch saves a dtype without a storage class of its own as an untyped storage, whose
    record counts bytes: its tensors import bit for bit (a strided view too)."""
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (5, 4 * dtype.itemsize), dtype=torch.uint8, generator=g)
    weight = raw.view(dtype)
    view = weight[1:, ::2]  # offset and strides within the storage
    torch.save({"w": weight, "v": view}, tmp_path / "ckpt.pt")
    code, doc = run_cli(["import", str(tmp_path / "ckpt.pt"), str(tmp_path / "run")], capsys)
    assert code == 0, doc
    holder = torch.nn.Module()
    holder.register_buffer("w", torch.zeros_like(weight))
    holder.register_buffer("v", torch.zeros_like(view.contiguous()))
    ckpt = unbroken.Checkpointer(tmp_path / "new", model=holder)
    ckpt.restore(intent="warm_start", source=tmp_path / "run")
    ckpt.close()
    for got, want in ((holder.w, weight), (holder.v, view)):
        assert got.dtype == dtype
        assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


def test_an_untyped_record_of_another_size_is_still_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The byte count of an untyped record is checked as an element count is: one byte
    short is a typed refusal naming the record."""
    import zipfile
    torch.save({"w": torch.arange(6).to(torch.uint16)}, tmp_path / "good.pt")
    with zipfile.ZipFile(tmp_path / "good.pt") as z, \
            zipfile.ZipFile(tmp_path / "bad.pt", "w") as out:
        for item in z.infolist():
            data = z.read(item)
            out.writestr(item, data[:-1] if item.filename.endswith("/data/0") else data)
    code, doc = run_cli(["import", str(tmp_path / "bad.pt"), str(tmp_path / "run")], capsys)
    assert code == 1
    assert "declares 11 bytes where its persistent id says 12 bytes (an untyped storage)" \
        in doc["error"]


def test_a_folder_of_several_models_is_refused_naming_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Accelerate's save_state writes a second prepared model as model_1: an import takes
    one, named by its file, never the first alone in silence."""
    folder = tmp_path / "state"
    folder.mkdir()
    save_file({"weight": torch.ones(2, 3)}, folder / "model.safetensors")
    save_file({"weight": torch.ones(4, 5)}, folder / "model_1.safetensors")
    (folder / "random_states_0.pkl").write_bytes(b"")
    code, doc = run_cli(["import", str(folder), str(tmp_path / "run")], capsys)
    assert code == 2 and "model_1.safetensors" in doc["error"]
    assert not (tmp_path / "run").exists()
    code, doc = run_cli(["import", str(folder / "model_1.safetensors"), str(tmp_path / "run")],
                        capsys)
    assert code == 0 and doc["tensors"] == 1
    code = main(["inspect", str(tmp_path / "run")])
    shown = capsys.readouterr().out
    assert "origin       import from " in shown and "(safetensors file)" in shown
    assert "null" not in shown


def test_trained_generations_after_an_import_still_continue(tmp_path: Path) -> None:
    """The review of this session's fix: generations an older unbroken let a continuation of
    an imported run write inherit the import's origin, and were refused as imports."""
    origin = {"operation": "import", "source": "/x/ckpt.pt", "format": "torch.save archive",
              "files": {}}
    model = torch.nn.Linear(3, 2)
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=model)
    ckpt.restore()
    ckpt._origin = origin  # (as the import writes it, and an older continuation kept it)
    for step in (500, 501, 502):
        ckpt.save(step)
    ckpt.close()
    again = unbroken.Checkpointer(tmp_path / "run", model=torch.nn.Linear(3, 2))
    assert again.restore() == 502
    again.close()
    with pytest.raises(MissingState, match="imported weights"):  # the import's own: refused
        unbroken.Checkpointer(tmp_path / "run", model=torch.nn.Linear(3, 2)).restore(
            generation=500)


def test_a_numpy_generation_number_is_taken(tmp_path: Path) -> None:
    import numpy as np

    model = torch.nn.Linear(3, 2)
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=model)
    ckpt.restore()
    ckpt.save(1)
    ckpt.save(2)
    ckpt.close()
    again = unbroken.Checkpointer(tmp_path / "run", model=torch.nn.Linear(3, 2))
    assert again.restore(generation=np.int64(1)) == 1
    again.close()
