"""What an outside review of incremental generations found in the messages (twenty-sixth
session): a reference to a tensor no file of the part holds, and ``verify --deep`` on a part
spread over several files, each named by the file it is about."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _resealing import reseal as _reseal

import unbroken
from unbroken._runview import open_run, verify_one
from unbroken.state.parts import MORE_FILES, STATE_FILE
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


def _flip_one_bit(path: Path) -> None:
    """Rot: one bit of the middle byte, size and modification time kept (as a disk's rot
    leaves them, so a save cannot tell the file changed before it links it)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)[0]
        f.seek(st.st_size // 2)
        f.write(bytes([byte ^ 0x10]))
    import os
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _train_to(root: Path, last: int, options: dict, rot_at: int | None = None
              ) -> tuple[_Net, list[str]]:
    """Updates 1..``last`` with a save every three (the embedding frozen from the start, so
    generations link its stable file); at ``rot_at`` the newest generation's stable model
    file rots. Returns the model and the warnings' texts."""
    import warnings

    torch.manual_seed(0)
    model = _Net()
    model.emb.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with unbroken.Checkpointer(root, model=model, optimizer=opt, incremental=True,
                                   keep=unbroken.Keep(last=3), every=3, **options) as ckpt:
            step = ckpt.restore()
            while step < last:
                opt.zero_grad()
                model(torch.randint(0, 300, (8,), generator=g)).square().mean().backward()
                opt.step()
                step += 1
                ckpt.step_done(step)
                if step == rot_at:
                    ckpt.wait()
                    newest = sorted(root.glob("gen-*"))[-1]
                    stable = [p for p in newest.glob("model.g*.safetensors")]
                    assert stable, sorted(p.name for p in newest.iterdir())
                    _flip_one_bit(stable[0])
    return model, [str(w.message) for w in seen if issubclass(w.category, unbroken.UnbrokenWarning)]


@pytest.mark.parametrize("options", [{"read_back": "sync"}, {}, {"async_save": True},
                                     {"async_save": "process"}],
                         ids=["sync-read-back", "background-read-back", "async", "process"])
def test_rot_in_a_linked_file_does_not_end_training_or_lose_the_run(tmp_path: Path,
                                                                    options: dict) -> None:
    """Before: the save after the rot linked the damaged file (its size and time unchanged),
    its read-back failed, and the next save raised SaveFailed: the training loop died, and
    every kept generation shared the damaged file, so a restart found none that verifies.
    Now the failed generation goes aside with a warning naming the shared file and the next
    save (at once, for a save that reads back before it returns) writes every file anew."""
    root = tmp_path / "run"
    model, warned = _train_to(root, 18, options, rot_at=10)
    assert any("it linked it" in w and "model.g" in w for w in warned), warned
    uninterrupted, _ = _train_to(tmp_path / "other", 18, options)
    for k, v in uninterrupted.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    # A restart finds the newest generation verified and continues from it, bitwise
    store = open_run(str(root))
    newest = [g for g in store.scan() if g.ok][-1]
    assert newest.generation == 18
    assert verify_one(store, newest)["status"] == "verified"
    resumed = _Net()
    opt = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    with unbroken.Checkpointer(root, model=resumed, optimizer=opt, incremental=True) as ckpt:
        assert ckpt.restore() == 18
    for k, v in model.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k


@pytest.mark.parametrize("mode", [False, True, "process"])
def test_a_run_folder_replaced_by_a_file_fails_the_save_typed(tmp_path: Path, mode) -> None:
    """Before: a bare NotADirectoryError from deep inside the store (listing the next
    generation's folder under a run folder that had become a file)."""
    root = tmp_path / "run"
    model = torch.nn.Linear(2, 2)
    ckpt = unbroken.Checkpointer(root, model=model, async_save=mode)
    try:
        ckpt.save(1)
        ckpt.wait()
        root.rename(tmp_path / "moved")
        root.write_text("not a folder")
        with pytest.raises(unbroken.SaveFailed, match=str(root)):
            ckpt.save(2)
            ckpt.wait()
    finally:
        try:
            ckpt.close()
        except unbroken.UnbrokenError:
            pass
