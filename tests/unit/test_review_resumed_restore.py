"""Review of the resumed restore (`picking._copied_parts`): a fresh optimizer adopts the
tensors of its files read whole (`LocalFS.read_hashed`), an optimizer holding state has them
copied from mapped files. Whatever the path, a run that goes on training, saving (sync, async
thread, async process, incremental) and restoring again ends bit for bit as the uninterrupted
one; a corrupt, truncated or replaced optimizer file is refused before any of it is adopted;
the adopted state keeps alive its file's buffer and nothing more.

Most tests lower `_MAP_MIN` so that small models take the large-file paths; one uses a model
whose optimizer file is over the real threshold."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch
from safetensors.torch import load_file

import unbroken
from unbroken import picking
from unbroken.store.backends import local
from unbroken.store.backends._mapped import MappedFiles
from unbroken.store.backends.local import LocalFS

SMALL_MAP_MIN = 1 << 12  # every optimizer file of the small models below is over this
WIDTH = 64


# -- helpers ------------------------------------------------------------------------------------


@pytest.fixture
def paths(monkeypatch):
    """The names of the files restores mapped and read whole, and the threshold lowered."""
    monkeypatch.setattr(picking, "_MAP_MIN", SMALL_MAP_MIN)
    seen: dict[str, list[str]] = {"mapped": [], "whole": []}
    real_add = MappedFiles.add
    real_read = LocalFS.read_hashed

    def add(self, view, path, hashed, *more):
        seen["mapped"].append(os.path.basename(path))
        return real_add(self, view, path, hashed, *more)

    def read_hashed(self, path, limit, aligned=False):
        seen["whole"].append(os.path.basename(path))
        return real_read(self, path, limit, aligned)

    monkeypatch.setattr(MappedFiles, "add", add)
    monkeypatch.setattr(LocalFS, "read_hashed", read_hashed)
    return seen


def _opt_files(seen: dict[str, list[str]], key: str) -> list[str]:
    return [n for n in seen[key] if n.startswith("optimizer")]


class Setup:
    """A model and optimizer factory (deterministic per seed) and a training step."""

    def __init__(self, optim, dtype=torch.float32, groups=False, frozen=False, tied=False,
                 width=WIDTH):
        self.optim, self.dtype, self.groups, self.frozen = optim, dtype, groups, frozen
        self.tied, self.width = tied, width

    def build(self, seed: int):
        torch.manual_seed(seed)
        w = self.width
        model = torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.Tanh(),
                                    torch.nn.Linear(w, w), torch.nn.Linear(w, 4))
        if self.tied:  # one parameter under two names
            model[2].weight = model[0].weight
        model = model.to(self.dtype)
        if self.frozen:  # no gradient, no state
            model[0].bias.requires_grad_(False)
        if self.groups:
            params = [{"params": [*model[0].parameters(), *model[2].parameters()]},
                      {"params": list(model[3].parameters()), "lr": 3e-3}]
            if self.tied:
                params[0]["params"] = list({id(p): p for p in params[0]["params"]}.values())
        else:
            params = list(model.parameters())
        return model, self.optim(params)

    def train(self, model, opt, steps, ckpt=None, start=0):
        for step in range(start + 1, start + steps + 1):
            x = torch.randn(3, self.width).to(self.dtype)  # global stream, restored
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if ckpt is not None:
                ckpt.step_done(step)


def _state(model, opt) -> list[torch.Tensor]:
    out = list(model.state_dict().values())
    for p in (p for g in opt.param_groups for p in g["params"]):
        for k in sorted(opt.state.get(p, {})):
            v = opt.state[p][k]
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out


def _snap(model, opt) -> list[torch.Tensor]:
    return [t.detach().clone() for t in _state(model, opt)]


def _assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want), (len(got), len(want))
    for i, (x, y) in enumerate(zip(got, want)):
        assert x.dtype == y.dtype and x.shape == y.shape, (i, x.dtype, y.dtype, x.shape, y.shape)
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), i


def _has_state(opt) -> bool:
    return any(isinstance(v, torch.Tensor) for s in opt.state.values() for v in s.values())


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _fused_ok() -> bool:
    try:
        p = torch.nn.Parameter(torch.ones(2))
        o = torch.optim.Adam([p], fused=True)
        p.grad = torch.ones(2)
        o.step()
        return True
    except (RuntimeError, ValueError):
        return False


ZOO = {
    "adamw": Setup(_adamw),
    "adam-amsgrad": Setup(lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True)),
    "adam-for-loop": Setup(lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False)),
    "sgd-momentum": Setup(lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True)),
    "adagrad": Setup(lambda p: torch.optim.Adagrad(p, lr=1e-2)),
    "rmsprop-centered": Setup(lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5,
                                                            centered=True)),
    "nadam": Setup(lambda p: torch.optim.NAdam(p, lr=1e-2)),
    "adamw-groups-frozen": Setup(_adamw, groups=True, frozen=True),
    "adamw-bf16": Setup(_adamw, dtype=torch.bfloat16),
    "adamw-f64": Setup(_adamw, dtype=torch.float64),
    "adamw-tied": Setup(_adamw, tied=True, groups=True),
    "adam-fused": Setup(lambda p: torch.optim.Adam(p, lr=1e-2, fused=True)),
}


def _first_run(root, setup: Setup, save_at=(2,), total=4, **kw):
    """The uninterrupted run: saves at ``save_at``; returns its state after each step."""
    model, opt = setup.build(0)
    states = {}
    with unbroken.Checkpointer(root, model=model, optimizer=opt, **kw) as ckpt:
        ckpt.restore()
        for step in range(1, total + 1):
            setup.train(model, opt, 1, ckpt, start=step - 1)
            if step in save_at:
                ckpt.save()
            states[step] = _snap(model, opt)
    return states


# -- bit for bit, every optimizer, both paths -----------------------------------------------------


@pytest.mark.parametrize("resumed", [True, False], ids=["fresh", "live-state"])
@pytest.mark.parametrize("name", list(ZOO))
def test_every_optimizer_continues_bit_for_bit_on_either_path(tmp_path, paths, name, resumed):
    if name == "adam-fused" and not _fused_ok():
        pytest.skip("this torch has no fused Adam on the CPU")
    setup = ZOO[name]
    states = _first_run(tmp_path / "run", setup)
    [f] = (tmp_path / "run").glob("gen-*/optimizer.safetensors")
    assert f.stat().st_size >= SMALL_MAP_MIN
    model, opt = setup.build(1)
    if not resumed:
        setup.train(model, opt, 1)  # state to copy into
    fresh = not _has_state(opt)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        assert ckpt.restore() == 2
        # the path taken: a fresh optimizer's file is read whole, a live state's mapped
        assert bool(_opt_files(paths, "mapped")) is not fresh
        assert bool(_opt_files(paths, "whole")) is fresh
        _assert_bitwise(_state(model, opt), states[2])
        setup.train(model, opt, 2, ckpt, start=2)
    _assert_bitwise(_state(model, opt), states[4])


def test_partial_live_state_takes_the_mapped_path_and_fills_every_parameter(tmp_path, paths):
    setup = ZOO["adamw"]
    states = _first_run(tmp_path / "run", setup)
    model, opt = setup.build(1)
    model[3](torch.randn(2, WIDTH)).sum().backward()  # state for the last layer only
    opt.step()
    opt.zero_grad()
    assert 0 < len(opt.state) < len(list(model.parameters()))
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        assert ckpt.restore() == 2
        assert _opt_files(paths, "mapped") and not _opt_files(paths, "whole")
        assert len(opt.state) == len(list(model.parameters()))
        _assert_bitwise(_state(model, opt), states[2])
        setup.train(model, opt, 2, ckpt, start=2)
    _assert_bitwise(_state(model, opt), states[4])


# -- after an adopted restore: train, save, restore again -----------------------------------------


@pytest.mark.parametrize("kw", [{}, {"async_save": True}, {"incremental": True},
                                {"async_save": True, "incremental": True}],
                         ids=["sync", "async-thread", "incremental", "async-incremental"])
def test_an_adopted_state_saves_and_restores_again_bit_for_bit(tmp_path, paths, kw):
    """Adopted state, trained and saved twice more; a second restore in the same process (now
    into live state: the mapped path copies into the adopted views), then a third into fresh
    objects: every one gives the uninterrupted run's state."""
    setup = ZOO["adamw"]
    states = _first_run(tmp_path / "ref", setup, save_at=(), total=8)
    _first_run(tmp_path / "run", setup, save_at=(2,), total=2, **kw)

    model, opt = setup.build(1)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt, **kw) as ckpt:
        assert ckpt.restore() == 2
        assert _opt_files(paths, "whole") and not _opt_files(paths, "mapped")
        setup.train(model, opt, 2, ckpt, start=2)
        ckpt.save()  # step 4
        setup.train(model, opt, 1, ckpt, start=4)
        ckpt.save()  # step 5
        setup.train(model, opt, 1, ckpt, start=5)  # step 6: not saved
        _assert_bitwise(_state(model, opt), states[6])
        paths["mapped"].clear(), paths["whole"].clear()
        assert ckpt.restore() == 5  # state exists: copied into the adopted tensors
        assert _opt_files(paths, "mapped") and not _opt_files(paths, "whole")
        _assert_bitwise(_state(model, opt), states[5])
        setup.train(model, opt, 2, ckpt, start=5)
        ckpt.save()  # step 7
    _assert_bitwise(_state(model, opt), states[7])

    model2, opt2 = setup.build(2)
    with unbroken.Checkpointer(tmp_path / "run", model=model2, optimizer=opt2, **kw) as ckpt:
        assert ckpt.restore() == 7
        _assert_bitwise(_state(model2, opt2), states[7])
        setup.train(model2, opt2, 1, ckpt, start=7)
        ckpt.save()
        assert ckpt.store.verified(ckpt.store.scan()[-1]) is None
    _assert_bitwise(_state(model2, opt2), states[8])


PROCESS_SCRIPT = r"""
import sys, torch, unbroken
from unbroken import picking
picking._MAP_MIN = 1 << 12
sys.path.insert(0, sys.argv[3])
from test_review_resumed_restore import ZOO, _state
setup = ZOO["adamw"]
model, opt = setup.build(0 if sys.argv[2] == "0" else 1)
with unbroken.Checkpointer(sys.argv[1], model=model, optimizer=opt,
                           async_save="process") as ckpt:
    start = ckpt.restore()
    assert start == int(sys.argv[2]), start
    assert start == 0 or any(isinstance(v, torch.Tensor) for s in opt.state.values()
                             for v in s.values())
    setup.train(model, opt, 2, ckpt, start=start)
    ckpt.save()
    setup.train(model, opt, 1, ckpt, start=start + 2)
    ckpt.save()
from safetensors.torch import save_file
save_file({str(i): t.contiguous() for i, t in enumerate(_state(model, opt))}, sys.argv[4])
"""


def test_an_adopted_state_saved_by_a_process_restores_bit_for_bit(tmp_path):
    """A resumed job (fresh optimizer, adopted state, in a process of its own) whose saves
    run in a separate process (async_save="process")."""
    setup = ZOO["adamw"]
    states = _first_run(tmp_path / "ref", setup, save_at=(), total=6)
    script = tmp_path / "job.py"
    script.write_text(PROCESS_SCRIPT)
    here = os.path.dirname(__file__)
    env = {**os.environ, "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = str(tmp_path / "run")
    _first_run(run, setup, save_at=(3,), total=3)
    subprocess.run([sys.executable, str(script), run, "3", here, str(tmp_path / "b.safetensors")],
                   check=True, timeout=180, env=env)
    # the second job resumed from step 3 (adopted) and saved 5 and 6 from the process
    model, opt = setup.build(7)
    with unbroken.Checkpointer(run, model=model, optimizer=opt) as ckpt:
        assert ckpt.restore() == 6
    saved = load_file(tmp_path / "b.safetensors")  # (no pickle, in tests too)
    _assert_bitwise([saved[str(i)] for i in range(len(saved))], states[6])
    _assert_bitwise(_state(model, opt), states[6])


# -- the real threshold ---------------------------------------------------------------------------


def test_over_the_real_threshold_an_adopted_state_survives_a_rewrite_of_its_file(tmp_path):
    """Without lowering `_MAP_MIN`: a 2048x2048 AdamW state (~33.6 MB file). The adopted state
    holds its own memory: the file rewritten on disk after the restore changes nothing; saving
    and restoring again gives the same bytes."""
    setup = Setup(_adamw, width=2048)
    model, opt = setup.build(0)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        ckpt.restore()
        setup.train(model, opt, 1, ckpt)
        ckpt.save()
    want = _snap(model, opt)
    [f] = (tmp_path / "run").glob("gen-*/optimizer.safetensors")
    assert f.stat().st_size >= picking._MAP_MIN

    model2, opt2 = setup.build(1)
    with unbroken.Checkpointer(tmp_path / "run", model=model2, optimizer=opt2,
                               keep=unbroken.Keep(last=3)) as ckpt:
        assert ckpt.restore() == 1
        with open(f, "r+b") as fh:  # after the restore: no part of the state views it
            fh.seek(f.stat().st_size // 2)
            fh.write(b"\xff" * 4096)
        _assert_bitwise(_state(model2, opt2), want)
        ckpt.step_done(2)
        ckpt.save()
        # (small unaligned tensors are decoded as copies and adopted: only the large ones
        # are copied into)
        adopted = [t.data_ptr() for t in _state(model2, opt2) if t.nbytes >= 4096]
        for t in _state(model2, opt2):  # overwritten, then restored again: copied into them
            t.zero_()
        assert ckpt.restore() == 2
        assert [t.data_ptr() for t in _state(model2, opt2) if t.nbytes >= 4096] == adopted
        _assert_bitwise(_state(model2, opt2), want)
    model3, opt3 = setup.build(2)
    with unbroken.Checkpointer(tmp_path / "run", model=model3, optimizer=opt3,
                               keep=unbroken.Keep(last=3)) as ckpt:
        assert ckpt.restore() == 2
    _assert_bitwise(_state(model3, opt3), want)


# -- refused files ---------------------------------------------------------------------------------


def _two_generations(root, setup):
    model, opt = setup.build(0)
    with unbroken.Checkpointer(root, model=model, optimizer=opt,
                               keep=unbroken.Keep(last=2)) as ckpt:
        ckpt.restore()
        setup.train(model, opt, 1, ckpt)
        ckpt.save()
        first = _snap(model, opt)
        setup.train(model, opt, 1, ckpt, start=1)
        ckpt.save()
    return first, sorted(root.glob("gen-*"))


def _flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x20]))


def _where(path, spot):
    size = path.stat().st_size
    n = int.from_bytes(path.read_bytes()[:8], "little")
    return {"length": 0, "header": 20, "padding": 8 + n - 1, "data": 8 + n + 3,
            "middle": size // 2, "last": size - 1}[spot]


@pytest.mark.parametrize("spot", ["length", "header", "padding", "data", "middle", "last"])
def test_a_corrupt_byte_anywhere_falls_back_to_the_older_generation(tmp_path, paths, spot):
    setup = ZOO["adamw"]
    first, gens = _two_generations(tmp_path / "run", setup)
    newest = gens[-1] / "optimizer.safetensors"
    _flip(newest, _where(newest, spot))
    model, opt = setup.build(1)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               keep=unbroken.Keep(last=2)) as ckpt:
        assert ckpt.restore() == 1
        [(path, why)] = ckpt.rejected
        assert gens[-1].name in path and "optimizer.safetensors" in why
    assert _opt_files(paths, "whole") and not _opt_files(paths, "mapped")
    _assert_bitwise(_state(model, opt), first)


@pytest.mark.parametrize("spot", ["length", "header", "data"])
def test_with_no_good_generation_the_fresh_optimizer_stays_empty(tmp_path, paths, spot):
    setup = ZOO["adamw"]
    _, gens = _two_generations(tmp_path / "run", setup)
    for g in gens:
        f = g / "optimizer.safetensors"
        _flip(f, _where(f, spot))
    model, opt = setup.build(1)
    before = _snap(model, opt)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        with pytest.raises(unbroken.CorruptCheckpoint, match="optimizer.safetensors"):
            ckpt.restore()
    assert not _has_state(opt)
    _assert_bitwise(_state(model, opt), before)


@pytest.mark.parametrize("change", ["truncated", "grown", "replaced-same-size"])
def test_a_file_changed_between_scan_and_read_is_refused(tmp_path, paths, monkeypatch, change):
    setup = ZOO["adamw"]
    first, gens = _two_generations(tmp_path / "run", setup)
    newest = gens[-1] / "optimizer.safetensors"
    real = LocalFS.read_hashed  # (the fixture's wrapper)
    done = []

    def read_hashed(self, path, limit, aligned=False):
        if path == str(newest) and not done:
            done.append(path)
            data = newest.read_bytes()
            if change == "truncated":
                data = data[:-64]
            elif change == "grown":
                data += b"\0" * 64
            else:
                data = data[:-8] + b"\x01" * 8
            newest.write_bytes(data)
        return real(self, path, limit, aligned)

    monkeypatch.setattr(LocalFS, "read_hashed", read_hashed)
    model, opt = setup.build(1)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               keep=unbroken.Keep(last=2)) as ckpt:
        assert ckpt.restore() == 1
        [(path, why)] = ckpt.rejected
        assert str(newest) in why, why
    assert done
    _assert_bitwise(_state(model, opt), first)


# -- memory ---------------------------------------------------------------------------------------


@pytest.fixture
def buffers(monkeypatch):
    """Weak references to every whole-file buffer made (`local.whole_buffer`), by size."""
    refs: list[tuple[int, weakref.ref]] = []
    real = local.whole_buffer

    def whole_buffer(size, aligned, path):
        view = real(size, aligned, path)
        if not aligned:  # (a bytearray: small records, never decoded as views)
            return view
        base = view.obj
        while getattr(base, "base", None) is not None:
            base = base.base
        refs.append((size, weakref.ref(base)))
        return view

    monkeypatch.setattr(local, "whole_buffer", whole_buffer)
    return refs


def _alive(refs) -> list[int]:
    gc.collect()
    return sorted(size for size, r in refs if r() is not None)


def test_the_adopted_state_keeps_its_file_buffer_and_nothing_more(tmp_path, paths, buffers):
    setup = ZOO["adamw"]
    _first_run(tmp_path / "run", setup, save_at=(2, 3), total=3)
    gens = sorted((tmp_path / "run").glob("gen-*"))
    size = (gens[-1] / "optimizer.safetensors").stat().st_size
    model, opt = setup.build(1)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               async_save=True) as ckpt:
        assert ckpt.restore() == 3
        assert _alive(buffers) == [size]  # the optimizer's; the model's was copied and freed
        # a second restore copies into the adopted tensors: no new buffer stays alive
        buffers.clear()
        assert ckpt.restore() == 3
        assert _alive(buffers) == []
        setup.train(model, opt, 1, ckpt, start=3)
        ckpt.save()
    adopted = weakref.ref(next(iter(opt.state.values()))["exp_avg"])
    del model, opt, ckpt
    gc.collect()
    assert adopted() is None


def test_restoring_fresh_optimizers_repeatedly_frees_each_buffer(tmp_path, paths, buffers):
    setup = ZOO["adamw"]
    _first_run(tmp_path / "run", setup, save_at=(2,), total=2)
    for seed in range(3):
        model, opt = setup.build(seed + 1)
        with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
            assert ckpt.restore() == 2
        del model, opt, ckpt
        assert _alive(buffers) == [], seed


# -- verify, warm start ---------------------------------------------------------------------------


def test_verify_and_warm_start_after_adopted_restores(tmp_path, paths):
    setup = ZOO["adamw"]
    states = _first_run(tmp_path / "run", setup, save_at=(2,), total=3)
    model, opt = setup.build(1)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        assert ckpt.restore() == 2
        setup.train(model, opt, 1, ckpt, start=2)
        ckpt.save()
        for g in ckpt.store.scan():
            ckpt.store.verify(g)  # raises on any bad byte
    _assert_bitwise(_state(model, opt), states[3])
    out = subprocess.run([sys.executable, "-m", "unbroken", "verify", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr

    paths["whole"].clear(), paths["mapped"].clear()
    model2, opt2 = setup.build(5)
    with unbroken.Checkpointer(tmp_path / "new", model=model2, optimizer=opt2) as ckpt:
        assert ckpt.restore("warm_start", source=tmp_path / "run") == 0
    assert not _opt_files(paths, "whole") and not _opt_files(paths, "mapped")
    assert not _has_state(opt2)  # a warm start reads the model only
    _assert_bitwise(list(model2.state_dict().values()), states[3][:len(model2.state_dict())])


# -- more paths: torch's own load, saved dtypes other than the parameter's, a refused model file --


def _hooked_adamw(params):
    """An AdamW whose load goes through torch's ``load_state_dict`` (a pre-hook)."""
    opt = torch.optim.AdamW(params, lr=1e-2)
    opt.register_load_state_dict_pre_hook(lambda o, sd: sd)
    return opt


MORE = {
    "hooked-adamw-bf16": Setup(_hooked_adamw, dtype=torch.bfloat16),
    "hooked-adamw-groups": Setup(_hooked_adamw, groups=True, frozen=True),
    "nadam-bf16": Setup(lambda p: torch.optim.NAdam(p, lr=1e-2), dtype=torch.bfloat16),
    "asgd-f64": Setup(lambda p: torch.optim.ASGD(p, lr=1e-2), dtype=torch.float64),
}


@pytest.mark.parametrize("resumed", [True, False], ids=["fresh", "live-state"])
@pytest.mark.parametrize("name", list(MORE))
def test_torch_s_own_load_and_saved_dtypes_continue_bit_for_bit(tmp_path, paths, name, resumed):
    setup = MORE[name]
    states = _first_run(tmp_path / "run", setup)
    model, opt = setup.build(1)
    if not resumed:
        setup.train(model, opt, 1)
    fresh = not _has_state(opt)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        assert ckpt.restore() == 2
        assert bool(_opt_files(paths, "whole")) is fresh
        _assert_bitwise(_state(model, opt), states[2])
        setup.train(model, opt, 2, ckpt, start=2)
    _assert_bitwise(_state(model, opt), states[4])


def test_a_refused_model_file_drops_the_optimizer_buffer_read_for_it(tmp_path, paths, buffers):
    """The newest generation's optimizer file verifies (read whole), its model file does not:
    the fresh optimizer ends with the older generation's state, and the refused candidate's
    buffer is not kept."""
    setup = ZOO["adamw"]
    first, gens = _two_generations(tmp_path / "run", setup)
    model_file = gens[-1] / "model.safetensors"
    _flip(model_file, model_file.stat().st_size // 2)
    size = (gens[0] / "optimizer.safetensors").stat().st_size
    model, opt = setup.build(1)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               keep=unbroken.Keep(last=2)) as ckpt:
        assert ckpt.restore() == 1
        [(path, why)] = ckpt.rejected
        assert gens[-1].name in path and "model.safetensors" in why
        _assert_bitwise(_state(model, opt), first)
        assert _alive(buffers) == [size]
