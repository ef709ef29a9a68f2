"""A torch.compile'd model (session 28's outside review): its generations hold torch's own
names (``_orig_mod.0.weight``), as its continuation needs; but the inference export carried
them too, so it did not load into the uncompiled model one serves, and a warm start between
a compiled and an uncompiled model was refused both ways. The export now writes the served
names, verify-export maps a compiled model onto them, and a warm start (a new run) maps the
names that differ only by ``_orig_mod.`` one to one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import unbroken
from unbroken.errors import StateMismatch
from unbroken.tools.export import export_generation


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def _blocks() -> torch.nn.Module:
    """Compiled per block, as large models are: ``_orig_mod`` inside the names."""
    net = _net()
    net[0] = torch.compile(net[0], backend="eager")  # type: ignore[assignment]
    return net


def _saved(run: Path, model: torch.nn.Module) -> None:
    ckpt = unbroken.Checkpointer(run, model=model)
    ckpt.restore()
    ckpt.save(0)
    ckpt.close()


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("build", [lambda: torch.compile(_net(), backend="eager"), _blocks])
def test_the_export_of_a_compiled_run_holds_the_served_names(tmp_path: Path, build) -> None:
    model = build()
    assert any("_orig_mod." in k for k in model.state_dict())
    _saved(tmp_path / "run", model)
    export_generation(tmp_path / "run", tmp_path / "exp")
    names = json.loads((tmp_path / "exp" / "export.json").read_text())["weights"]["tensors"]
    assert sorted(names) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    served = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert unbroken.verify_export(tmp_path / "exp", served)["loaded"] == 4
    assert _equal(served, _net())
    again = build()  # a compiled model maps onto the served names too
    with torch.no_grad():
        for p in again.parameters():
            p.zero_()
    assert unbroken.verify_export(tmp_path / "exp", again)["loaded"] == 4
    assert _equal(again, _net())


def test_a_warm_start_maps_compiled_and_uncompiled_names(tmp_path: Path) -> None:
    _saved(tmp_path / "compiled", torch.compile(_net(), backend="eager"))
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    ckpt = unbroken.Checkpointer(tmp_path / "plain", model=plain)
    ckpt.restore(intent="warm_start", source=tmp_path / "compiled")
    ckpt.save(0)
    ckpt.close()
    assert _equal(plain, _net())
    blocks = _blocks()
    with torch.no_grad():
        for p in blocks.parameters():
            p.zero_()
    ckpt = unbroken.Checkpointer(tmp_path / "blocks", model=blocks)
    ckpt.restore(intent="warm_start", source=tmp_path / "plain")
    ckpt.close()
    assert _equal(blocks, _net())


def test_a_continuation_still_needs_the_model_as_saved(tmp_path: Path) -> None:
    _saved(tmp_path / "run", torch.compile(_net(), backend="eager"))
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=_net())
    with pytest.raises(StateMismatch, match="torch.compile'd model"):
        ckpt.restore()
    ckpt.close()


def test_an_adapter_named_as_the_compiled_model_shows_it(tmp_path: Path) -> None:
    """The review of this session's fix: adapter names with _orig_mod. matched nothing."""
    from unbroken.tools.export import export_model

    for n, adapter in enumerate(("_orig_mod.2.", ["_orig_mod.2.weight", "_orig_mod.2.bias"],
                                 "2.", ["2.*"])):
        doc = export_model(torch.compile(_net(), backend="eager"), tmp_path / f"e{n}",
                           adapter=adapter, base_revision="org/model@0123456789abcdef")
        assert sorted(doc["weights"]["tensors"]) == ["2.bias", "2.weight"], adapter
