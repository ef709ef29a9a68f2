"""A process-mode save builds its gathered small tensors in the shared-memory segment itself
(`ProcessPersister.room`), and copies only the rest at the hand-over. Whatever the room gave
or refused (the first save, a state that grew past the segment, one that shrank), every
generation holds the state at its ``save()``, bitwise, whatever the loop does right after."""

from __future__ import annotations

import pytest
import torch

import unbroken
from unbroken.persist import process
from unbroken.persist.process import ProcessPersister

WIDTH = 48


class Net(torch.nn.Module):
    """Many small tensors of several dtypes: float32 layers (stacked by shape), bfloat16 and
    int64 buffers (moved one by one), so a run of gathered tensors mixes both ways. 120
    layers: 1.1 MB of parameters, over 3 MB with AdamW's state (a new segment is a whole
    number of MiB: the state must outgrow the first one)."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        for i in range(0, layers, 3):
            self.register_buffer(f"scale{i}", torch.randn(5).to(torch.bfloat16))
            self.register_buffer(f"count{i}", torch.arange(i, i + 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        out.update({f"opt.{i}.{k}": v.clone() for k, v in s.items()})
    return out


def step(model: Net, opt: torch.optim.Optimizer, which: list[torch.nn.Parameter]) -> None:
    for p in model.parameters():
        p.requires_grad_(any(p is q for q in which))
    model(torch.randn(4, WIDTH)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.add_(1 if b.dtype == torch.int64 else 0.5)


def scramble(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """What a loop does right after ``save()`` returns: every tensor changes in place."""
    with torch.no_grad():
        for t in [*model.state_dict().values(),
                  *(v for s in opt.state.values() for v in s.values())]:
            t.add_(7) if t.dtype != torch.bool else t.logical_not_()


@pytest.mark.parametrize("rewinds", [True, False])
def test_every_generation_holds_its_state_whether_the_room_gave_or_refused(tmp_path,
                                                                           monkeypatch, rewinds):
    """``rewinds=False``: a file refused midway (its optimizer state moved by the restore)
    leaves its gifts of the room unused, and the room runs out: the hand-over then copies
    every chunk into a new segment, never over the chunks built in the old one (it did, and
    a generation's RNG state came out as another part's bytes)."""
    if not rewinds:
        monkeypatch.setattr(process._Room, "rewind", lambda self, mark: None)
    built: list[tuple[int, int]] = []
    submit = ProcessPersister.submit

    def counted(self: ProcessPersister, *args, **kwargs) -> None:
        submit(self, *args, **kwargs)
        built.append((self.built, self.nbytes))

    monkeypatch.setattr(ProcessPersister, "submit", counted)
    model = Net(120)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    # which parameters train before each save: none (no optimizer state: a small first
    # segment), a few, all (the state outgrows the segment: a save whose room ran out
    # midway), all again (the room gives every gathered chunk), a few (a state that shrank
    # cannot happen with AdamW, but one whose tensors moved does: the same room, reused)
    plan = [[], params[:10], params, params, params[::2], params]
    saved: dict[int, dict[str, torch.Tensor]] = {}
    root = tmp_path / "run"
    with unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process",
                               keep=unbroken.Keep(last=len(plan))) as ckpt:
        for g, which in enumerate(plan):
            if which:
                step(model, opt, which)
            saved[g] = snapshot(model, opt)
            ckpt.save(g)
            scramble(model, opt)  # before the persisting process wrote a byte
            ckpt.wait()
            scramble(model, opt)
            # (the scrambles are undone by restoring what was saved, for the next step)
            ckpt.restore(generation=g)
    assert len(built) == len(plan)
    assert built[0][0] == 0  # no segment yet: the room gives nothing
    assert built[2][0] < built[3][0]  # it ran out midway, then gave every gathered chunk
    if rewinds:  # the small tensors: nearly all
        assert all(b > 0.9 * n for b, n in built[3:]), built
    for g, want in sorted(saved.items(), reverse=True):  # (an older one abandons newer ones)
        fresh = Net(120)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        with unbroken.Checkpointer(root, model=fresh, optimizer=fresh_opt) as reader:
            assert reader.restore(generation=g) == g
        got = snapshot(fresh, fresh_opt)
        assert got.keys() == want.keys(), g
        different = [k for k in want if not torch.equal(got[k], want[k])]
        assert not different, (g, different[:5])


@pytest.mark.parametrize("incremental", [False, True])
def test_a_run_saved_in_process_mode_resumes_bitwise(tmp_path, incremental):
    """Saves built in the room, then a restore in a fresh model: the same bits as the
    uninterrupted run, incremental saves (stable files built in the room too) or not."""

    def run(root, stop: int, resume: bool) -> dict[str, torch.Tensor]:
        model = Net(40)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process",
                                   incremental=incremental) as ckpt:
            start = ckpt.restore() if resume else 0
            for s in range(start + 1, stop + 1):
                torch.manual_seed(s)
                step(model, opt, list(model.parameters())[: 20 if incremental else None])
                ckpt.step_done(s)
                ckpt.save()
        return snapshot(model, opt)

    whole = run(tmp_path / "whole", 6, False)
    run(tmp_path / "split", 3, False)
    resumed = run(tmp_path / "split", 6, True)
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
