"""The persisting process of ``async_save="process"``: how long it takes to start and how
much memory it holds, and how long the first ``save()`` of a fresh Checkpointer blocks (it
waits until that process holds the run) and takes to be durable.

Each repetition builds a new Checkpointer on a new folder and saves a small model at once,
the worst case: a script that saves right after building its Checkpointer. Prints a table
and, with ``--json FILE``, the same figures as JSON. To compare two commits, run it against
each checkout's sources:

    PYTHONPATH=<checkout>/src .venv/bin/python benchmarks/persister_start.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

import unbroken


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _torch_loaded(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any("libtorch" in line for line in f)


def one(root: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    shutil.rmtree(root, ignore_errors=True)
    t0 = time.perf_counter()
    ckpt = unbroken.Checkpointer(root, model=model, optimizer=opt, async_save="process")
    built = time.perf_counter()
    ckpt.save(1)
    returned = time.perf_counter()
    ckpt.wait()
    durable = time.perf_counter()
    pid = ckpt._persister._proc.pid  # (a private attribute: a benchmark may look)
    out = {"checkpointer_s": built - t0, "first_save_blocked_s": returned - built,
           "first_save_durable_s": durable - built, "persister_rss_mb": _rss_mb(pid),
           "persister_loaded_torch": _torch_loaded(pid)}
    ckpt.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [one(os.path.join(tmp, f"run{i}")) for i in range(args.repeats)]
    keys = [k for k in runs[0] if k != "persister_loaded_torch"]
    summary = {k: {"median": statistics.median(r[k] for r in runs),
                   "min": min(r[k] for r in runs), "max": max(r[k] for r in runs)}
               for k in keys}
    print(f"unbroken at {os.path.dirname(unbroken.__file__)}; {args.repeats} repetitions")
    print(f"| {'figure':<22} | {'median':>9} | {'min-max':>18} |")
    print(f"|{'-' * 24}|{'-' * 11}|{'-' * 20}|")
    for k in keys:
        s = summary[k]
        unit = "MB" if k.endswith("_mb") else "s"
        span = f"{s['min']:.2f}-{s['max']:.2f} {unit}"
        print(f"| {k:<22} | {s['median']:>6.2f} {unit:<2} | {span:>18} |")
    loaded = sum(r["persister_loaded_torch"] for r in runs)
    print(f"persisting process loaded torch in {loaded} of {len(runs)} runs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
