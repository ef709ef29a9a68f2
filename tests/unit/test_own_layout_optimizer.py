"""A module that saves its own way may store a parameter in another layout than the parameter
(`_save_to_state_dict` writing the weight transposed, its `_load_from_state_dict` undoing it).
Its optimizer state mirrors the live parameter, not the saved tensor: every generation of such
a run was refused as corrupt ("torch's own classes never hold such a state"), and `verify
--deep` called them corrupt too. The state is judged against the live parameter now (a
restore) or by its number of elements (without a live model), and a moment that fits neither
is still refused."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import unbroken
from unbroken.cli import main
from unbroken.state.optim import optimizer_state
from unbroken.store.manifest import MANIFEST


class Transposed(torch.nn.Linear):
    """Saves its weight transposed and doubled; its load undoes that."""

    def _save_to_state_dict(self, dest, prefix, keep_vars):  # type: ignore[no-untyped-def]
        super()._save_to_state_dict(dest, prefix, keep_vars)
        dest[prefix + "weight"] = (dest[prefix + "weight"].detach() * 2).t().contiguous()

    def _load_from_state_dict(self, sd, prefix, *a, **k):  # type: ignore[no-untyped-def]
        if prefix + "weight" in sd:
            sd[prefix + "weight"] = sd[prefix + "weight"].t() / 2
        super()._load_from_state_dict(sd, prefix, *a, **k)


def _objects(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(Transposed(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    torch.nn.functional.mse_loss(model(torch.randn(16, 4)), torch.randn(16, 1)).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("async_save", [False, True, "process"])
def test_a_run_of_a_module_saving_its_own_layout_resumes_bitwise_and_verifies(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], async_save: object) -> None:
    run = tmp_path / "run"
    model, opt = _objects(0)
    with unbroken.Checkpointer(run, model=model, optimizer=opt,
                               async_save=async_save) as ckpt:
        for step in (1, 2, 3):
            _step(model, opt)
            ckpt.step_done(step)
        ckpt.save()
    other, other_opt = _objects(1)
    with unbroken.Checkpointer(run, model=other, optimizer=other_opt) as ckpt:
        assert ckpt.restore() == 3
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    saved, restored = optimizer_state(model, opt), optimizer_state(other, other_opt)
    assert json.dumps(saved["param_groups"]) == json.dumps(restored["param_groups"])
    for name, entry in saved["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, restored["state"][name][key]), (name, key)
    capsys.readouterr()
    assert main(["verify", str(run), "--deep", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def test_a_moment_that_fits_no_live_parameter_is_still_refused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A moment transposed against the live parameter (a forged or buggy state) is refused at
    restore, though it has as many elements as the saved tensor's layout."""
    import xxhash

    from unbroken.state.tensorfile import encode_safetensors
    from unbroken.state.tensorread import decode_safetensors
    from unbroken.store.manifest import seal

    run = tmp_path / "run"
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with unbroken.Checkpointer(run, model=model, optimizer=opt) as ckpt:
        _step(model, opt)
        ckpt.step_done(1)
        ckpt.save()
        _step(model, opt)
        ckpt.step_done(2)
        ckpt.save()
    gen = run / "gen-000000002"
    path = gen / "optimizer.safetensors"
    tensors, meta = decode_safetensors(path.read_bytes(), str(path))
    key = next(k for k in tensors if k.endswith("exp_avg") and tensors[k].dim() == 2)
    tensors = {k: v.clone() for k, v in tensors.items()}
    tensors[key] = tensors[key].t().contiguous()
    data = b"".join(bytes(c) for c in encode_safetensors(tensors, meta))
    path.write_bytes(data)
    doc = json.loads((gen / MANIFEST).read_bytes())
    for a in doc["artifacts"]:
        if a["name"] == "optimizer.safetensors":
            a["size"], a["xxh3_128"] = len(data), xxhash.xxh3_128(data).hexdigest()
    (gen / MANIFEST).write_bytes(seal(doc))
    other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    other_opt = torch.optim.Adam(other.parameters(), lr=1e-2)
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        with unbroken.Checkpointer(run, model=other, optimizer=other_opt) as ckpt:
            assert ckpt.restore() == 1  # generation 2 refused, the one before used
    shape = list(tensors[key].shape)
    assert f"has shape {shape}; expected {shape[::-1]}" in caplog.text, caplog.text


@pytest.mark.parametrize("live", ["wider", "lazy"])
def test_a_model_built_otherwise_is_a_state_mismatch_not_corruption(
        tmp_path: Path, live: str) -> None:
    """The optimizer state is judged against a live parameter only where it has as many
    elements as the saved tensor: a model built wider (the commonest resume mistake) or
    lazy and not yet run is the model's mismatch, named as such; the generations are not
    called corrupt."""
    run = tmp_path / "run"
    model = torch.nn.Sequential(torch.nn.Linear(4, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with unbroken.Checkpointer(run, model=model, optimizer=opt) as ckpt:
        for step in (1, 2):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            ckpt.step_done(step)
            ckpt.save()
    other = torch.nn.Sequential(torch.nn.Linear(4, 16) if live == "wider"
                                else torch.nn.LazyLinear(8))
    other_opt = torch.optim.Adam(other.parameters(), lr=1e-2)
    with pytest.raises(unbroken.StateMismatch) as caught:
        with unbroken.Checkpointer(run, model=other, optimizer=other_opt) as ckpt:
            ckpt.restore()
    said = str(caught.value)
    assert "gen-000000002 [model]" in said, said
    assert ("expected (16, 4)" if live == "wider" else "is uninitialized") in said
