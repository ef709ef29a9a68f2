"""Helpers of the tests of the persisting process (``async_save="process"``): a model and
optimizer state taken and compared bit for bit, a run's generations, a restore into a fresh
model, and the persisting processes this test process has. Imported by test files in both
``unit`` and ``integration`` (the root conftest's folder is on the import path)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

import unbroken


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer, cloned (keeping dtype and values)."""
    out = {f"m.{k}": v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    if opt is not None:
        for i, st in opt.state_dict()["state"].items():
            for k, v in st.items():
                if torch.is_tensor(v):
                    out[f"o.{i}.{k}"] = v.clone()
    return out


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys(), (sorted(got.keys() ^ want.keys()))
    for k in want:
        a, b = got[k], want[k]
        assert a.dtype == b.dtype, (k, a.dtype, b.dtype)
        assert a.shape == b.shape, (k, a.shape, b.shape)
        assert torch.equal(a.contiguous().view(-1).view(torch.uint8),
                           b.contiguous().view(-1).view(torch.uint8)), k


def restored(root, build, generation: int | None = None) -> tuple[int, dict]:
    """Restore ``root`` (its newest generation, or ``generation``) into ``build()``'s fresh
    model and optimizer: the step and their `snapshot`."""
    model, opt = build()
    with unbroken.Checkpointer(root, model=model, optimizer=opt) as reader:
        step = reader.restore(generation=generation)
    return step, snapshot(model, opt)


def gens(root) -> list[int]:
    return sorted(int(p.name[4:]) for p in Path(root).iterdir()
                  if p.name.startswith("gen-") and p.name[4:].isdigit())


def worker_pid(ck: unbroken.Checkpointer) -> int:
    proc = ck._persister._proc
    assert proc is not None and proc.poll() is None, "no live persisting process"
    return proc.pid


def workers_of_me() -> list[int]:
    """Live (not zombie) children of this process running `unbroken.persist._worker`."""
    me, found = os.getpid(), []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if int(fields[1]) == me and fields[0] != "Z" and b"unbroken.persist._worker" in cmd:
            found.append(int(d))
    return found
