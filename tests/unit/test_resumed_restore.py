"""A resumed job's restore: a model built anew and an optimizer holding no state yet
(`picking._copied_parts`). The optimizer's large files are then read whole, hashed as they
arrive, and their tensors become its state (no copy pass, no fresh memory faulted in after the
read); with state to copy into they are mapped and copied, as before. Either way the run
continues bit for bit as the uninterrupted one; a corrupt optimizer file is refused before the
optimizer holds any of it, and the previous generation is used; the state holds no view of a
file mapping. (The memory it adds: `test_fast_paths.py`, beside the in-place restore's.)"""

from __future__ import annotations

import os

import pytest
import torch

import unbroken
from unbroken.picking import _MAP_MIN
from unbroken.store.backends._mapped import MappedFiles

WIDTH = 2048  # AdamW's state of a 2048x2048 layer: an optimizer file over the mapping threshold


def _build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int,
           ckpt: unbroken.Checkpointer | None = None, start: int = 0) -> None:
    for step in range(start + 1, start + steps + 1):
        x = torch.randn(4, WIDTH)  # the global stream: restored with the rest
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if ckpt is not None:
            ckpt.step_done(step)


def _saved_run(folder, steps: int, **options) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                                                    unbroken.Checkpointer]:
    """A new run in ``folder`` trained ``steps`` updates and saved; its model, optimizer and
    Checkpointer (still open)."""
    model, opt = _build(0)
    ckpt = unbroken.Checkpointer(folder, model=model, optimizer=opt, **options)
    ckpt.restore()
    _train(model, opt, steps, ckpt)
    ckpt.save()
    return model, opt, ckpt


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [*model.state_dict().values(),
            *(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))]


def _bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape
        and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        for x, y in zip(a, b))


def _file_behind(t: torch.Tensor) -> str | None:
    """The file whose mapping holds ``t``'s first byte, or None for anonymous memory."""
    ptr = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= ptr < end:
                path = fields[5].strip() if len(fields) > 5 else ""
                return path if fields[4] != "0" and path.startswith("/") else None
    return None


@pytest.fixture
def mapped_names(monkeypatch):
    """The names of the files each restore mapped (rather than read whole)."""
    names: list[str] = []
    real = MappedFiles.add

    def add(self, view, path, hashed, *more):
        names.append(os.path.basename(path))
        return real(self, view, path, hashed, *more)

    monkeypatch.setattr(MappedFiles, "add", add)
    return names


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("resumed", [True, False], ids=["fresh-optimizer", "live-state"])
def test_a_resumed_restore_continues_bit_for_bit(tmp_path, mapped_names, resumed):
    model, opt, ckpt = _saved_run(tmp_path / "run", 2)
    ckpt.close()
    [opt_file] = (tmp_path / "run").glob("gen-*/optimizer.safetensors")
    assert opt_file.stat().st_size >= _MAP_MIN  # (else it is read whole either way)
    _train(model, opt, 2)
    expected = [t.clone() for t in _state(model, opt)]

    model2, opt2 = _build(1)  # another init: the restore must overwrite all of it
    if not resumed:
        _train(model2, opt2, 1)  # state tensors to copy into
    live = [id(p) for p in model2.parameters()]
    with unbroken.Checkpointer(tmp_path / "run", model=model2, optimizer=opt2) as ckpt:
        assert ckpt.restore() == 2
        assert ("optimizer.safetensors" in mapped_names) is not resumed
        for t in _state(model2, opt2):
            assert _file_behind(t) is None, "restored state views a file"
        _train(model2, opt2, 2, ckpt, start=2)
    assert [id(p) for p in model2.parameters()] == live  # loaded into the live parameters
    assert _bitwise_equal(_state(model2, opt2), expected)


def test_a_corrupt_optimizer_file_is_refused_and_the_previous_generation_used(tmp_path):
    model, opt, ckpt = _saved_run(tmp_path / "run", 1, keep=unbroken.Keep(last=2))
    with ckpt:
        first = [t.clone() for t in _state(model, opt)]
        _train(model, opt, 1, ckpt, start=1)
        ckpt.save()
    newest = sorted((tmp_path / "run").glob("gen-*"))[-1] / "optimizer.safetensors"
    with open(newest, "r+b") as f:  # one bit, in the middle of the state's bytes
        f.seek(newest.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))

    model2, opt2 = _build(1)
    with unbroken.Checkpointer(tmp_path / "run", model=model2, optimizer=opt2,
                               keep=unbroken.Keep(last=2)) as ckpt:
        assert ckpt.restore() == 1
        [(path, why)] = ckpt.rejected
        assert "optimizer.safetensors: content hash" in why and newest.parent.name in path
    assert _bitwise_equal(_state(model2, opt2), first)


def test_a_refused_generation_leaves_a_fresh_optimizer_without_state(tmp_path):
    """No generation verifies: the restore raises, and the optimizer, which held nothing,
    still holds nothing (none of the refused file's tensors was adopted)."""
    _saved_run(tmp_path / "run", 1)[2].close()
    [f] = (tmp_path / "run").glob("gen-*/optimizer.safetensors")
    with open(f, "r+b") as fh:
        fh.seek(f.stat().st_size - 100)
        fh.write(b"\x00" * 8)
    model2, opt2 = _build(1)
    before = [t.clone() for t in model2.state_dict().values()]
    with unbroken.Checkpointer(tmp_path / "run", model=model2, optimizer=opt2) as ckpt:
        with pytest.raises(unbroken.CorruptCheckpoint, match="no generation verifies"):
            ckpt.restore()
    assert not any(opt2.state.values())
    assert _bitwise_equal(list(model2.state_dict().values()), before)

