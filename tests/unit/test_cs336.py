"""The CS336 checkpointing contract in unbroken's safe format (as the assignment's
test_checkpointing does: 10 AdamW steps, round trip, exact comparison)."""

from __future__ import annotations

import io

import pytest
import torch

from unbroken.compat.cs336 import load_checkpoint, save_checkpoint
from unbroken.errors import CorruptCheckpoint, StateMismatch


def trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(10):
        loss = model(torch.randn(5, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


def fresh():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=5.0)


def same_optimizer_state(a: dict, b: dict) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(torch.equal(a["state"][k][n], b["state"][k][n]) for k in a["state"]
               for n in a["state"][k])


@pytest.mark.parametrize("target", ["path", "file"])
def test_round_trip_is_exact(tmp_path, target):
    model, opt = trained()
    out = tmp_path / "ckpt.safetensors" if target == "path" else io.BytesIO()
    save_checkpoint(model, opt, 10, out)
    if target == "file":
        out.seek(0)
    model2, opt2 = fresh()
    assert load_checkpoint(out, model2, opt2) == 10
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 model2.state_dict().values()))
    assert same_optimizer_state(opt.state_dict(), opt2.state_dict())
    # and the next step is the same
    x = torch.randn(5, 8)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_file_is_safetensors_not_pickle(tmp_path):
    model, opt = trained()
    path = tmp_path / "ckpt"
    save_checkpoint(model, opt, 3, path)
    from safetensors.torch import load_file
    tensors = load_file(path)  # any safetensors reader can open it
    assert torch.equal(tensors["model.0.weight"], model[0].weight)
    data = path.read_bytes()
    assert data[8:9] == b"{" and not data.startswith(b"PK")  # safetensors, not pickle/zip


def test_corrupt_file_is_refused_before_touching_the_model(tmp_path):
    model, opt = trained()
    path = tmp_path / "ckpt"
    save_checkpoint(model, opt, 3, path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    model2, opt2 = fresh()
    before = [p.clone() for p in model2.parameters()]
    with pytest.raises(CorruptCheckpoint, match="hash"):
        load_checkpoint(path, model2, opt2)
    assert all(torch.equal(a, b) for a, b in zip(before, model2.parameters()))


def test_reordered_parameters_are_refused(tmp_path):
    model, opt = trained()
    buf = io.BytesIO()
    save_checkpoint(model, opt, 3, buf)
    buf.seek(0)
    model2, _ = fresh()
    params = list(model2.parameters())
    opt2 = torch.optim.AdamW([params[2], params[3], params[0], params[1]])
    with pytest.raises(StateMismatch):
        load_checkpoint(buf, model2, opt2)


class _Strict(torch.optim.AdamW):
    """An optimizer whose own load refuses keys it does not know (as some do)."""

    def state_dict(self):  # type: ignore[no-untyped-def, override]
        return super().state_dict()

    def load_state_dict(self, sd) -> None:  # type: ignore[no-untyped-def, override]
        unknown = set(sd) - {"state", "param_groups"}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}")
        super().load_state_dict(sd)


def test_an_optimizers_own_load_sees_only_its_own_keys(tmp_path):
    """Before: the restore's private note of the dtypes a state_dict chose reached the
    optimizer's own load_state_dict, which refused it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    opt = _Strict(model.parameters(), lr=1e-2)
    model(torch.randn(5, 8)).pow(2).mean().backward()
    opt.step()
    save_checkpoint(model, opt, 1, tmp_path / "c.safetensors")
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 4))
    opt2 = _Strict(model2.parameters(), lr=1e-2)
    assert load_checkpoint(tmp_path / "c.safetensors", model2, opt2) == 1
    assert same_optimizer_state(opt.state_dict(), opt2.state_dict())
