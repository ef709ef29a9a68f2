"""The persisting process (``async_save="process"``) writes, commits, reads back and applies
retention without ever loading torch: it starts in a fraction of a second and holds tens of
megabytes, not torch's hundreds, beside every rank of a job. Checked on the real process,
through every path a save takes there (whole files, incremental links, retention), and the
generations it committed restore bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import unbroken


def _persisting_processes() -> list[int]:
    """The pids of this process's persisting processes (its children running the worker)."""
    me, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, IndexError, ValueError):
            continue  # (ended meanwhile)
        if ppid == me and b"unbroken.persist._worker" in cmd:
            out.append(int(entry))
    return out


def _loaded(pid: int) -> tuple[set[str], int]:
    """The shared libraries mapped into ``pid``, by file name, and its resident kB."""
    with open(f"/proc/{pid}/maps") as f:
        libs = {line.split()[-1].rsplit("/", 1)[-1] for line in f if ".so" in line}
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return libs, rss


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = torch.nn.Linear(600, 600)  # 1.4 MB, frozen: a stable file, then linked
        self.base.requires_grad_(False)
        self.head = torch.nn.Linear(600, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.base(x)))


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        out.update({f"opt.{i}.{k}": v.clone() for k, v in s.items()})
    return out


def test_the_persisting_process_never_loads_torch(tmp_path):
    model = Net()
    opt = torch.optim.AdamW(model.head.parameters(), lr=1e-2)
    root = tmp_path / "run"
    saved: dict[int, dict[str, torch.Tensor]] = {}
    with unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process",
                               incremental=True, keep=unbroken.Keep(last=2)) as ckpt:
        for s in range(1, 6):
            model(torch.randn(4, 600)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ckpt.step_done(s)
            ckpt.save()
            saved[s] = _state(model, opt)
            ckpt.wait()
        [pid] = _persisting_processes()
        libs, rss_kb = _loaded(pid)
    torch_libs = sorted(lib for lib in libs if "torch" in lib)
    assert not torch_libs, f"the persisting process loaded {torch_libs}"
    assert rss_kb < 120_000, f"the persisting process holds {rss_kb} kB"
    gens = sorted(p.name for p in root.iterdir() if p.name.startswith("gen-"))
    assert gens == ["gen-000000004", "gen-000000005"], gens  # retention ran there too
    linked = [p for p in (root / "gen-000000005").iterdir() if ".g" in p.name]
    assert linked and all(p.stat().st_nlink > 1 for p in linked), linked  # links, not copies
    for s in (5, 4):  # (the newest first: restoring an older one abandons newer ones)
        fresh = Net()
        fresh_opt = torch.optim.AdamW(fresh.head.parameters(), lr=1e-2)
        with unbroken.Checkpointer(root, model=fresh, optimizer=fresh_opt) as reader:
            assert reader.restore(generation=s) == s
        got = _state(fresh, fresh_opt)
        assert got.keys() == saved[s].keys()
        assert all(torch.equal(got[k], saved[s][k]) for k in got), s


def test_the_persisting_process_starts_without_the_package_importing_torch():
    """Importing the worker's module (and the package root) loads no torch: the names the
    package exports are imported when first used."""
    code = ("import sys, unbroken, unbroken.persist._worker; "
            "loaded = sorted(m for m in sys.modules if 'torch' in m)[:5]; "
            "assert not loaded, loaded; "
            "unbroken.Checkpointer; assert 'torch' in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
