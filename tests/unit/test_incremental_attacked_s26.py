"""What an outside review of incremental generations found in the messages (twenty-sixth
session): a reference to a tensor no file of the part holds, and ``verify --deep`` on a part
spread over several files, each named by the file it is about."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import unbroken
from unbroken._runview import open_run, verify_one
from unbroken.state.parts import MORE_FILES, STATE_FILE
from unbroken.store.manifest import seal
from unbroken.tools.deep import deep_problems


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Parameter(torch.randn(300, 1024))  # (over MIN_STABLE_BYTES)
        self.head = torch.nn.Linear(1024, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb[x])


def _incremental_run(root: Path, nan_at: int | None = None) -> None:
    """Six updates, a save every three; the embedding trains for three updates, then is
    frozen (the save at 6 links it from generation 3's stable file)."""
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    with unbroken.Checkpointer(root, model=model, optimizer=opt, incremental=True) as ckpt:
        ckpt.restore()
        for step in range(1, 7):
            if step == 4:
                model.emb.requires_grad_(False)
            opt.zero_grad()
            model(torch.randint(0, 300, (8,), generator=g)).square().mean().backward()
            opt.step()
            if step == nan_at:
                with torch.no_grad():
                    model.emb[5, 7] = float("nan")
            ckpt.step_done(step)
            if step % 3 == 0:
                ckpt.save()


def _reseal(gen: Path, name: str, data: bytes) -> None:
    import xxhash

    (gen / name).write_bytes(data)
    manifest = json.loads((gen / "MANIFEST.json").read_text())
    for a in manifest["artifacts"]:
        if a["name"] == name:
            a["size"], a["xxh3_128"] = len(data), xxhash.xxh3_128(data).hexdigest()
    (gen / "MANIFEST.json").write_bytes(seal(manifest))


def test_a_dropped_file_reference_names_state_json_and_the_part(tmp_path: Path) -> None:
    """Before: "tensor 'emb' is referenced but not stored", naming no file, part or generation
    (the list of the part's files in state.json edited, the manifest resealed)."""
    root = tmp_path / "run"
    _incremental_run(root)
    gen = root / "gen-000000006"
    doc = json.loads((gen / STATE_FILE).read_text())
    assert doc.pop(MORE_FILES)  # (the stable file of generation 3 holds 'emb')
    _reseal(gen, STATE_FILE, json.dumps(doc).encode())
    store = open_run(str(root))
    record = verify_one(store, store.scan()[-1])
    assert record["status"] == "corrupt"
    assert f"gen-000000006/{STATE_FILE} [model]: tensor 'emb' is referenced but no tensor " \
           "file of the part holds it" in record["reason"]


@pytest.mark.parametrize("frozen", [True, False])
def test_deep_names_the_file_holding_the_bad_tensor(tmp_path: Path, frozen: bool) -> None:
    """Before: a NaN in the frozen embedding (in generation 6's stable file) was reported in
    "model.*.safetensors". Now the stable file itself; a tensor of the part's own file, its
    own file."""
    root = tmp_path / "run"
    _incremental_run(root, nan_at=5 if frozen else 2)
    store = open_run(str(root))
    info = store.scan()[-1 if frozen else 0]
    record = verify_one(store, info, None, deep_problems)
    names = {a.name for a in info.manifest.artifacts}
    assert len([n for n in names if n.startswith("model.")]) == (2 if frozen else 1)
    problems = record["problems"]
    emb = [p for p in problems if "model tensor 'emb'" in p]
    assert len(emb) == 1 and "*" not in emb[0], problems
    holder = emb[0].split(": ", 1)[0]
    if frozen:  # (the stable file written by generation 6 when the embedding stopped training)
        assert holder.endswith("/model.g6.safetensors"), emb
    else:
        assert holder.endswith("/gen-000000003/model.safetensors"), emb
    # the file named holds the tensor: its bytes are the NaN
    from safetensors.torch import load_file
    assert torch.isnan(load_file(holder)["emb"]).any()
