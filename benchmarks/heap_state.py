"""Why a process-mode save of many small tensors blocks longer in `save_load.py`'s full case
than alone: Python work slows in a heap that DCP's async saves left behind, copies do not.

One process, the state of `save_load.py`'s small case (1,250 Linear(32, 32) layers and AdamW:
10,000 tensors). Each figure is the median of ``--repeats`` calls, every call preceded by a read
of every state tensor (as a training update leaves them): first on a fresh heap, then again
after three ``torch.distributed.checkpoint.async_save`` calls whose stager, writer and last
plan stay alive (`save_load.py` keeps them for DCP's buffer reuse, in the same process):

- ``read``: a pass over every module's parameters (dict reads only);
- ``alloc``: building what a save's walk builds, a dict of 2,500 new string keys and two lists;
- ``walk``: unbroken's model walk (`state.livemodel.LiveModel`);
- ``memcpy``: ``copy_`` of every state tensor into buffers made once (the goal's floor);
- ``process save``: ``Checkpointer(async_save="process").save()`` until it returns.

    .venv/bin/python benchmarks/heap_state.py [--tensors 10000] [--repeats 40] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from save_load import build_state, flat_state, state_tensors, touch  # noqa: E402

import unbroken  # noqa: E402
from unbroken.state.livemodel import LiveModel  # noqa: E402


def _allocating() -> list[Any]:
    keys = {f"{i // 2}.{'weight' if i % 2 else 'bias'}": i for i in range(2500)}
    return [keys, list(range(10_000)), [str(i) for i in range(2500)]]


def _measure(fns: dict[str, Callable[[], Any]], model: torch.nn.Module,
             opt: torch.optim.Optimizer, repeats: int, before: Callable[[], Any] = lambda: None
             ) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():  # (interleaved: drift hits every figure alike)
            before()
            touch(model, opt)
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(v[repeats // 5:]) * 1e3 for name, v in times.items()}


def _dcp_leftovers(model: torch.nn.Module, opt: torch.optim.Optimizer, folder: str) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(False, False, False, False))
    writer = dcp.FileSystemWriter(folder, sync_files=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no process group: DCP warns each call)
        for _ in range(3):
            dcp.async_save(flat_state(model, opt), checkpoint_id=folder, storage_writer=writer,
                           async_stager=stager, no_dist=True).result()
    return stager, writer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, opt = build_state(max(1, args.tensors // 8), 32, small=True)
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    modules = list(model.modules())
    src = state_tensors(model, opt)
    bufs = [torch.empty_like(t) for t in src]
    folder = tempfile.mkdtemp(prefix="heap-state-")
    ck = unbroken.Checkpointer(os.path.join(folder, "run"), model=model, optimizer=opt,
                               keep=unbroken.Keep(last=1), async_save="process")
    step = [0]

    def save() -> None:
        step[0] += 1
        ck.save(step[0])

    def read() -> int:
        return sum(len(m.__dict__["_parameters"]) for m in modules)

    def memcpy() -> None:
        for b, t in zip(bufs, src):
            b.copy_(t)

    fns: dict[str, Callable[[], Any]] = {
        "read": read, "alloc": _allocating, "walk": lambda: LiveModel(model), "memcpy": memcpy,
        "process save": save}
    timed = {name: fn for name, fn in fns.items() if name != "process save"}

    try:
        for _ in range(3):  # (the persisting process started, buffers made)
            save()
            ck.wait()
        results: dict[str, dict[str, float]] = {}
        for heap in ("fresh heap", "after DCP async saves"):
            if heap != "fresh heap":
                kept = _dcp_leftovers(model, opt, os.path.join(folder, "dcp"))
            figures = _measure(timed, model, opt, args.repeats)
            # (the previous save's persisting ended first, untimed)
            saves = _measure({"process save": save}, model, opt, args.repeats, ck.wait)
            ck.wait()
            results[heap] = {**figures, **saves, "gc objects": len(gc.get_objects())}
        del kept
    finally:
        ck.close()
        shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=1))
        return
    fresh, after = results["fresh heap"], results["after DCP async saves"]
    print(f"{'ms (median)':<16}{'fresh heap':>12}{'after DCP':>12}{'change':>10}")
    for name in [*fns, "gc objects"]:
        a, b = fresh[name], after[name]
        shown = (lambda x: f"{x:12.0f}") if name == "gc objects" else (lambda x: f"{x:12.3f}")
        print(f"{name:<16}{shown(a)}{shown(b)}{(b / a - 1) * 100:+9.0f}%")
    print(f"process save / memcpy: {fresh['process save'] / fresh['memcpy']:.2f}x fresh, "
          f"{after['process save'] / after['memcpy']:.2f}x after DCP async saves")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
