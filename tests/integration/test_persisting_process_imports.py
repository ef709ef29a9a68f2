"""The persisting process (``async_save="process"``) writes, commits, reads back and applies
retention without ever loading torch: it starts in a fraction of a second and holds tens of
megabytes, not torch's hundreds, beside every rank of a job. Checked on the real process,
through every path a save takes there (whole files, incremental links, retention), and the
generations it committed restore bit for bit. It runs under SCHED_BATCH: never preempting the
training loop when it wakes."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from _frozen import fresh, state_of, train_step

import unbroken


def _loaded(pid: int) -> tuple[set[str], int]:
    """The shared libraries mapped into ``pid``, by file name, and its resident kB."""
    with open(f"/proc/{pid}/maps") as f:
        libs = {line.split()[-1].rsplit("/", 1)[-1] for line in f if ".so" in line}
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return libs, rss


def test_the_persisting_process_never_loads_torch(tmp_path):
    model, opt = fresh(600)  # (a 1.4 MB frozen base: a stable file, then linked)
    root = tmp_path / "run"
    saved: dict[int, dict[str, torch.Tensor]] = {}
    with unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process",
                               incremental=True, keep=unbroken.Keep(last=2)) as ckpt:
        for s in range(1, 6):
            train_step(model, opt, s)
            ckpt.step_done(s)
            ckpt.save()
            saved[s] = state_of(model, opt)
            ckpt.wait()
        libs, rss_kb = _loaded(ckpt._persister._proc.pid)
        # it never preempts the training loop on waking (a request woke it onto the core
        # of the writer still sending it: 2.5 ms of a 19 ms save blocked, `_worker`)
        assert os.sched_getscheduler(ckpt._persister._proc.pid) == os.SCHED_BATCH
    torch_libs = sorted(lib for lib in libs if "torch" in lib)
    assert not torch_libs, f"the persisting process loaded {torch_libs}"
    assert rss_kb < 120_000, f"the persisting process holds {rss_kb} kB"
    gens = sorted(p.name for p in root.iterdir() if p.name.startswith("gen-"))
    assert gens == ["gen-000000004", "gen-000000005"], gens  # retention ran there too
    linked = [p for p in (root / "gen-000000005").iterdir() if ".g" in p.name]
    assert linked and all(p.stat().st_nlink > 1 for p in linked), linked  # links, not copies
    for s in (5, 4):  # (the newest first: restoring an older one abandons newer ones)
        other, other_opt = fresh(600)
        with unbroken.Checkpointer(root, model=other, optimizer=other_opt) as reader:
            assert reader.restore(generation=s) == s
        got = state_of(other, other_opt)
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


def test_a_trainer_under_sched_idle_keeps_its_persisting_process_there(tmp_path):
    """SCHED_BATCH only from the default policy (found in review, thirty-fifth session): a
    trainer run under SCHED_IDLE got a persisting process of normal weight, ahead of it."""
    code = (
        "import os, sys, torch, unbroken\n"
        "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
        "m = torch.nn.Linear(4, 2)\n"
        f"with unbroken.Checkpointer({str(tmp_path / 'run')!r}, model=m, "
        "async_save='process') as ck:\n"
        "    ck.save(1); ck.wait()\n"
        "    print(os.sched_getscheduler(ck._persister._proc.pid))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) == os.SCHED_IDLE
