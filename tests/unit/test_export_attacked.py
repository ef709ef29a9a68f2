"""Inference export under attack: an OUT inside the run folder (it would change committed
generations), a cast that overflows to inf, an edited export.json (its own checksum), an OUT
under a file, and a user's factory that raises."""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file

import unbroken
from unbroken.cli import main
from unbroken.errors import CorruptCheckpoint, UnbrokenError, UnbrokenWarning, UnsupportedValue
from unbroken.store.manifest import checksum
from unbroken.tools._factory import load_factory
from unbroken.tools.export import export_generation, export_model, verify_export


def _run(folder, model: torch.nn.Module, steps=(1, 2)) -> None:
    with unbroken.Checkpointer(folder, model=model) as ckpt:
        ckpt.restore()
        for step in steps:
            ckpt.step_done(step)
            ckpt.save()


@pytest.fixture
def run(tmp_path):
    torch.manual_seed(0)
    _run(tmp_path / "run", torch.nn.Linear(4, 2))
    return tmp_path / "run"


def _restored_step(folder) -> int:
    with unbroken.Checkpointer(folder, model=torch.nn.Linear(4, 2)) as ckpt:
        return ckpt.restore()


# -- OUT inside the run folder ----------------------------------------------------------------


@pytest.mark.parametrize("inside", ["gen-000000002/export", "gen-000000002", "gen-000000009",
                                    "sub/deeper/out", ".", "../run/x"])
def test_an_out_inside_the_run_is_refused_and_the_run_is_unchanged(run, inside):
    before = sorted(os.listdir(run))
    with pytest.raises(UnbrokenError, match="run folder") as e:
        export_generation(run, os.path.join(run, inside))
    assert str(os.path.realpath(run)) in str(e.value)
    assert sorted(os.listdir(run)) == before and _restored_step(run) == 2


def test_an_out_reaching_the_run_through_a_symlink_or_holding_it_is_refused(run, tmp_path):
    os.symlink(run, tmp_path / "link")
    for out in (tmp_path / "link" / "gen-000000003", tmp_path):
        with pytest.raises(UnbrokenError, match="run folder"):
            export_generation(run, out)
    with pytest.raises(UnbrokenError, match="run folder"):  # the run named through the link
        export_generation(tmp_path / "link", run / "gen-000000002" / "x")
    assert _restored_step(run) == 2


def test_the_cli_refuses_an_out_inside_the_run_with_exit_2(run, capsys):
    assert main(["export", str(run), str(run / "gen-000000002" / "sub")]) == 2
    assert "choose an OUT outside the run folder" in capsys.readouterr().err
    assert _restored_step(run) == 2


def test_export_model_refuses_an_out_inside_the_run_it_names_and_any_url(run, tmp_path):
    with pytest.raises(UnbrokenError, match="run folder"):
        export_model(torch.nn.Linear(4, 2), run / "exp", run=run)
    with pytest.raises(UnbrokenError, match="not a URL"):
        export_generation(run, "s3://bucket/run/exp")
    assert not (tmp_path / "s3:").exists()


def test_a_checkpointers_export_into_its_own_run_is_refused(tmp_path):
    folder = tmp_path / "run"
    with unbroken.Checkpointer(folder, model=torch.nn.Linear(4, 2)) as ckpt:
        ckpt.restore()
        ckpt.step_done(1)
        ckpt.save()
        with pytest.raises(UnbrokenError, match="run folder"):
            ckpt.export(folder / "gen-000000001" / "export")
        ckpt.export(tmp_path / "export")  # outside: written
    assert _restored_step(folder) == 1 and (tmp_path / "export" / "export.json").exists()


# -- a cast that overflows --------------------------------------------------------------------


def _state_run(folder, **tensors: torch.Tensor) -> None:
    model = torch.nn.Module()
    for name, value in tensors.items():
        model.register_buffer(name, value)
    _run(folder, model, steps=(1,))


@pytest.mark.parametrize("dtype, source, value", [("fp16", torch.float32, 1e6),
                                                  ("fp16", torch.bfloat16, -7e4),
                                                  ("bf16", torch.float64, 1e300),
                                                  ("fp32", torch.float64, -1e39)])
def test_a_cast_that_turns_finite_weights_into_inf_is_refused(tmp_path, dtype, source, value):
    _state_run(tmp_path / "run", ok=torch.ones(3, dtype=source),
               big=torch.tensor([1.0, value, 2.0], dtype=source))
    with pytest.raises(UnsupportedValue, match=rf"'big'.*over the range of {dtype}.*another "
                                               "dtype"):
        export_generation(tmp_path / "run", tmp_path / "out", dtype=dtype)
    assert not (tmp_path / "out").exists()


def test_values_already_inf_or_nan_are_not_blamed_on_the_cast(tmp_path):
    held = torch.tensor([float("inf"), float("-inf"), float("nan"), 3.0])
    _state_run(tmp_path / "run", held=held)
    export_generation(tmp_path / "run", tmp_path / "out", dtype="fp16")
    got = load_file(tmp_path / "out" / "model.safetensors")["held"]
    assert got.dtype == torch.float16 and got[:2].isinf().all() and got[2].isnan()
    # ... but an overflow beside them still is
    _state_run(tmp_path / "run2", held=torch.tensor([float("inf"), 1e6]))
    with pytest.raises(UnsupportedValue, match="'held'.*1e\\+06.*finite values into inf"):
        export_generation(tmp_path / "run2", tmp_path / "out2", dtype="fp16")


# -- export.json's own checksum ----------------------------------------------------------------




def _edit(folder, change) -> None:
    path = folder / "export.json"
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc, indent=2))


def test_export_json_carries_a_checksum_of_its_other_fields(sealed_export):
    folder, model = sealed_export
    doc = json.loads((folder / "export.json").read_text())
    assert doc["checksum"] == checksum(doc)
    assert verify_export(folder, model)["checksum"] == doc["checksum"]


@pytest.mark.parametrize("change", [
    lambda d: d.update(identity={"config": {"width": 5}}),
    lambda d: d["lineage"].update(step=2),
    lambda d: d["weights"].update(cast=True),
    lambda d: d["weights"].update(dtype="bf16"),
    lambda d: d.update(fixed_inputs=None),
    lambda d: d.update(created="2020-01-01T00:00:00+00:00"),
    lambda d: d.update(checksum="0" * 32),
    lambda d: d.update(extra=1),
], ids=["identity", "lineage", "cast", "dtype", "fixed-null", "created", "checksum", "added"])
def test_any_edit_of_export_json_is_corruption(sealed_export, change):
    folder, model = sealed_export
    _edit(folder, change)
    with pytest.raises(CorruptCheckpoint, match="export.json checksum .*export again"):
        verify_export(folder, model)


def test_an_export_without_a_checksum_still_verifies_and_says_so(sealed_export):
    folder, model = sealed_export
    _edit(folder, lambda d: d.pop("checksum"))
    with pytest.warns(UnbrokenWarning, match="no checksum"):
        report = verify_export(folder, model)
    assert report["checksum"] is None and report["mode"] == "bitwise"
    # ... but its fixed inputs dropped while their file is there is an edit
    _edit(folder, lambda d: d.update(fixed_inputs=None))
    with pytest.raises(CorruptCheckpoint, match="records no fixed inputs"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", UnbrokenWarning)
        verify_export(folder, model)


# -- OUT under a file -------------------------------------------------------------------------


@pytest.mark.parametrize("below", ["out", "a/b/out"])
def test_an_out_under_a_file_is_a_typed_error_naming_the_file(run, tmp_path, below, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(UnbrokenError, match=f"{afile} exists and is not a folder"):
        export_generation(run, afile / below)
    assert main(["export", str(run), str(afile / below)]) == 2
    err = capsys.readouterr().err
    assert str(afile) in err and "Errno" not in err and afile.read_text() == "x"


# -- a factory that raises --------------------------------------------------------------------


def test_a_factory_that_raises_is_named_with_its_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "attacked_factory.py").write_text(
        "def boom():\n    raise RuntimeError('needs a GPU')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "attacked_factory", raising=False)
    with pytest.raises(UnbrokenError, match="attacked_factory:boom.*RuntimeError: needs a GPU"
                       ) as e:
        load_factory("attacked_factory:boom")()
    assert isinstance(e.value.__cause__, RuntimeError)
    export_model(torch.nn.Linear(2, 2), tmp_path / "exp")
    assert main(["verify-export", str(tmp_path / "exp"), "--factory",
                 "attacked_factory:boom"]) == 2
    err = capsys.readouterr().err
    assert "attacked_factory:boom" in err and "bug in unbroken" not in err
