"""Sharded save/load of an FSDP2 model + AdamW state at 2 and 4 ranks (gloo, CPU): unbroken
against torch.distributed.checkpoint (DCP) alone on the same state, in the same job.

The script spawns the ranks (loopback only). Each job shards a stack of Linear layers with
``fully_shard`` and, per method, saves and then loads *into the live model and optimizer*:
unbroken ``Checkpointer.save(step)`` (``Keep(last=1)``) / ``restore()`` on a fresh
Checkpointer (built untimed); DCP ``dcp.save`` of ``get_state_dict`` with
``FileSystemWriter(sync_files=True)`` / ``dcp.load(FileSystemReader)`` + ``set_state_dict``,
alternating two folders, the older deleted right after each save, untimed but timed apart (the
page cache is freed where unbroken's retention frees it: on a VM whose balloon takes freed
memory back, that decides whether the next write is fast). A time is the job's: barrier,
operation, barrier. Rounds are interleaved (rep 1 of both methods, then rep 2, ...), medians
reported. Before each load the live state is zeroed, after it compared with the saved one
(untimed); loads are cold (the files' pages dropped with posix_fadvise(DONTNEED)). GB/s: the
tensors' nbytes over all ranks per second. Also timed: ``Group.max_int`` (one all-reduce MAX
of two int64s: the value under the collective's tag), the per-update cost of the stop
agreement with ``stop_check_every=1``, and a bare all_reduce.

    .venv/bin/python benchmarks/sharded.py             # 256M and 1G at 2 and 4 ranks, 2-4 min
    .venv/bin/python benchmarks/sharded.py --quick     # 16M, smoke run (~25 s)
    .venv/bin/python benchmarks/sharded.py --json --out sharded.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import socket
import statistics
import sys
import time
import warnings
from typing import Any

import save_load as sl
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import unbroken
from unbroken import checkpointer, persisting, picking
from unbroken.dist.group import Group

DEFAULT_SIZES = "256M,1G"
# "a:b": time in b called from phase a; the last two: computed (see Unbroken._timed)
PHASES = {"save": ["capture", "encode", "commit", "commit:write()", "commit:fsync()",
                   "verify", "verify:hash", "retention", "retention:hash",
                   "other", "collectives"],
          "load": ["scan", "read+hash", "decode", "shards (DCP)", "validate", "apply", "other",
                   "collectives"]}


# ---------------------------------------------------------------------------------------------
# the state and the two methods (every rank runs all of this)


def local_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's chunks of every parameter, exp_avg and exp_avg_sq, as held now."""
    out: list[Any] = []
    for p in model.parameters():
        out += [p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]] if opt.state else [p]
    return [v.to_local() for v in out]


def build_state(layers: int, width: int, world: int
                ) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    """A stack of Linear layers, each and the root sharded by ``fully_shard`` over all ranks,
    with AdamW state from one step on a dummy loss; returns (model, optimizer, payload bytes
    of every rank together)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(dist.get_rank())
    with torch.no_grad():
        for t in local_state(model, opt):  # each rank its own chunk; std keeps the loss finite
            t.normal_(std=width ** -0.5)
    model(torch.randn(2, width)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    total = torch.tensor([sum(t.nbytes for t in local_state(model, opt))])
    dist.all_reduce(total)
    return model, opt, int(total.item())


class Unbroken:
    name = "unbroken"

    def __init__(self, folder: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.folder, self.model, self.opt, self.step = folder, model, opt, 0
        self.phases: dict[str, list[dict[str, float]]] = {"save": [], "load": []}
        self._pending: Any = None  # (op, patches, timer, seconds, phases so far): `_record`
        self.ckpt = self._open()
        self.ckpt.restore()  # an empty folder: step 0, and saving into the folder is allowed

    def _open(self) -> Any:
        return unbroken.Checkpointer(self.folder, model=self.model, optimizer=self.opt,
                                     keep=unbroken.Keep(last=1))

    def files(self) -> str:
        return self.folder

    def after_save(self) -> None:  # untimed: the read-back and retention beside the loop
        self._record()

    def before_load(self) -> None:  # a restore is a fresh Checkpointer's (built untimed)
        self.ckpt.close()
        self.ckpt = self._open()

    def _timed(self, op: str, patches: list[tuple[Any, str, str, bool]]) -> None:
        """Save or restore, timing the patched functions on this rank's clock (``True``:
        labelled ``phase:key`` by the phase they are called from, see
        `save_load.PhaseTimer`); a function the code no longer has is not timed."""
        pt = sl.PhaseTimer()
        es = contextlib.ExitStack()
        for obj, fn, key, inner in [*patches, (Group, "_call", "collectives", True)]:
            if hasattr(obj, fn):
                es.enter_context(pt.patch(obj, fn, key, syscall=inner))
        t = time.perf_counter()
        self.ckpt.save(self.step) if op == "save" else self.ckpt.restore()
        self._pending = (op, es, pt, time.perf_counter() - t, dict(pt.acc))
        if op == "load":
            self._record()

    def _record(self) -> None:
        """The phases of the last save or restore, once its background part (a save's
        read-back and retention beside the loop) ended: waited for here, untimed."""
        op, es, pt, total, inside = self._pending
        with es:
            self.ckpt.wait()
        ph = {k: pt.acc.get(k, 0.0) for k in PHASES[op]}
        ph["other"] = total - sum(inside.get(k, 0.0) for k in PHASES[op][:-2] if ":" not in k)
        ph["collectives"] = sum(v for k, v in pt.acc.items() if k.endswith(":collectives"))
        self.phases[op].append({**ph, "total": total})

    def save(self) -> None:
        self.step += 1
        C = persisting  # (where the save's steps are looked up)
        self._timed("save", [
            (checkpointer.S, "capture", "capture", False), (C, "encode_share", "encode", False),
            (C, "commit_job", "commit", False), (C, "read_back", "verify", False),
            (self.ckpt._writer, "apply_retention", "retention", False),
            (os, "write", "write()", True), (os, "fsync", "fsync()", True),
            (self.ckpt.store.fs, "hash_file", "hash", True)])

    def load(self) -> None:
        P = picking
        self._timed("load", [
            (self.ckpt.store, "scan", "scan", False),
            (self.ckpt.store, "read_verified", "read+hash", False),
            (P.G, "decode_generation", "decode", False),
            (P, "_load_shards", "shards (DCP)", False),
            (P.S, "validate_parts", "validate", False), (P.S, "apply", "apply", False)])

    def close(self) -> None:
        self.ckpt.close()


class UnbrokenSync(Unbroken):
    """``Checkpointer(read_back="sync")``: a save returns after every rank's read-back and
    the retention too."""

    name = "unbroken-sync"

    def _open(self) -> Any:
        return unbroken.Checkpointer(self.folder, model=self.model, optimizer=self.opt,
                                     keep=unbroken.Keep(last=1), read_back="sync")


class DCP:
    name = "DCP"

    def __init__(self, folder: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.folder, self.model, self.opt, self.slot = folder, model, opt, 0
        self.deletes: list[float] = []

    def files(self) -> str:  # the newest checkpoint
        return f"{self.folder}.{self.slot}"

    def after_save(self) -> None:
        if dist.get_rank() == 0:
            t = time.perf_counter()
            sl.remove(self.files())
            self.deletes.append(time.perf_counter() - t)
        self.slot ^= 1

    def before_load(self) -> None:
        pass

    def _state(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd}

    def save(self) -> None:
        dcp.save(self._state(), storage_writer=dcp.FileSystemWriter(
            f"{self.folder}.{self.slot ^ 1}", sync_files=True))

    def load(self) -> None:
        sd = self._state()
        dcp.load(sd, storage_reader=dcp.FileSystemReader(self.files()))
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])

    def close(self) -> None:
        if dist.get_rank() == 0:
            sl.remove(self.files())


# ---------------------------------------------------------------------------------------------
# one job of ``world`` ranks


def timed_case(case: dict[str, Any], cfg: dict[str, Any], world: int) -> dict[str, Any]:
    rank = dist.get_rank()
    model, opt, payload = build_state(case["layers"], case["width"], world)
    folder = os.path.join(cfg["root"], f"{case['name']}-w{world}")
    ub, dc = Unbroken(f"{folder}-unbroken", model, opt), DCP(f"{folder}-dcp", model, opt)
    ms: list[Unbroken | DCP] = [ub, UnbrokenSync(f"{folder}-sync", model, opt), dc]
    if rank == 0:
        sl.log(f"== {case['name']} at {world} ranks: {case['layers']} x "
               f"Linear({case['width']}), {payload / sl.MB:.0f} MB payload "
               f"({payload / world / sl.MB:.0f} MB a rank)")
    saved = [t.clone() for t in local_state(model, opt)]  # what every save and load holds
    gc.collect()
    times: dict[str, dict[str, list[float]]] = {m.name: {"save": [], "load": []} for m in ms}
    file_mb: dict[str, float] = {}
    for op in ("save", "load"):
        for rep in range(cfg["warmup"] + cfg["repeats"]):
            for m in ms:  # round-robin: drift of the disk hits both methods alike
                if op == "load":  # a load that changed nothing would show as a broken one
                    m.before_load()
                    with torch.no_grad():
                        for x in local_state(model, opt):
                            x.zero_()
                    if rank == 0:
                        sl.drop_cache(m.files())
                dist.barrier()
                t = time.perf_counter()
                getattr(m, op)()
                dist.barrier()
                dt = time.perf_counter() - t
                if op == "save":
                    m.after_save()
                if op == "load" and not all(map(torch.equal, local_state(model, opt), saved)):
                    raise AssertionError(f"rank {rank}: {m.name} loaded another state")
                if rep < cfg["warmup"]:
                    if isinstance(m, Unbroken):
                        m.phases[op].pop()
                    continue
                times[m.name][op].append(dt)
                if op == "save" and rank == 0:
                    file_mb[m.name] = sl.tree_bytes(m.files()) / sl.MB
            if rank == 0:
                sl.log(f"   {op} round {rep + 1}: " + ", ".join(
                    f"{n} {t[op][-1]:.3f}s" if rep >= cfg["warmup"] else n
                    for n, t in times.items()))
    for m in ms:
        m.close()
    results = []
    for name, tm in times.items():
        for op in ("save", "load"):
            med = statistics.median(tm[op])
            r = {"method": name, "op": op, "median_s": med, "min_s": min(tm[op]),
                 "max_s": max(tm[op]), "all_s": tm[op], "gbps": payload / med / sl.GB,
                 "file_mb": file_mb.get(name, 0.0)}
            if name != DCP.name:
                r["x_dcp"] = med / statistics.median(times[DCP.name][op])
            if name == ub.name:
                r["phases_median_s_rank0"] = {k: statistics.median(p[k] for p in ub.phases[op])
                                              for k in PHASES[op] + ["total"]}
            elif op == "save" and rank == 0:
                r["delete_previous_median_s_rank0"] = statistics.median(
                    dc.deletes[cfg["warmup"]:])
            results.append(r)
    del ms, ub, dc, model, opt, saved
    gc.collect()
    return {"case": case["name"], "world": world, "layers": case["layers"],
            "width": case["width"], "payload_mb": payload / sl.MB, "results": results}


def stop_agreement(calls: int) -> dict[str, Any]:
    """Microseconds per ``Group.max_int`` (a tagged all-reduce) and per bare ``all_reduce`` of
    one int64, in blocks of 100 calls taking turns; each call timed alone."""
    group, t = Group(), torch.zeros(1, dtype=torch.int64)
    fns = {"Group.max_int": lambda: group.max_int(0, "benchmark"),
           "bare all_reduce": lambda: dist.all_reduce(t, dist.ReduceOp.MAX)}
    us: dict[str, list[float]] = {k: [] for k in fns}
    for block in range(-1, calls // 100):  # block -1: warm-up
        for name, fn in fns.items():
            dist.barrier()
            for _ in range(100):
                t0 = time.perf_counter()
                fn()
                if block >= 0:
                    us[name].append(1e6 * (time.perf_counter() - t0))
    return {name: {"median_us": statistics.median(v), "p90_us": sorted(v)[int(0.9 * len(v))],
                   "min_us": min(v), "calls": len(v)} for name, v in us.items()}


def worker(rank: int, world: int, cfg: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]),
                      UNBROKEN_PROGRESS="0")
    warnings.filterwarnings("ignore")  # DCP's and FSDP's notices, every round, every rank
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    doc = {"world": world, "torch_threads": torch.get_num_threads(),
           "stop_agreement": stop_agreement(cfg["calls"]),
           "cases": [timed_case(c, cfg, world) for c in cfg["cases"]]}
    if rank == 0:
        with open(os.path.join(cfg["root"], f"job-{world}.json"), "w", encoding="utf-8") as f:
            json.dump(doc, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # gloo's threads sometimes abort an oversubscribed interpreter's teardown


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------------
# report


def table(head: list[str], rows: list[list[str]], left: int) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(v.ljust(w) if i < left else v.rjust(w)
                                for i, (v, w) in enumerate(zip(r, widths))) + " |" for r in rows]
    return "\n".join(lines)


def report(doc: dict[str, Any]) -> str:
    m, cfg = doc["machine"], doc["config"]
    rows, phases, stops = [], [], []
    for job in doc["jobs"]:
        for c in job["cases"]:
            for r in c["results"]:
                rows.append([c["case"], str(job["world"]), r["method"], r["op"],
                             f"{r['median_s']:.3f}", f"{r['min_s']:.3f}-{r['max_s']:.3f}",
                             f"{r['gbps']:.2f}", f"{r['x_dcp']:.2f}" if "x_dcp" in r else "-",
                             f"{r['file_mb']:.0f}" if r["op"] == "save" else ""])
                ph = r.get("phases_median_s_rank0")
                if "delete_previous_median_s_rank0" in r:
                    phases.append(f"- {c['case']}, {job['world']} ranks: DCP's deleting the "
                                  f"previous checkpoint (after its save, untimed) "
                                  f"{r['delete_previous_median_s_rank0']:.3f}s")
                if ph:
                    phases.append(f"- {c['case']}, {job['world']} ranks, {r['op']} "
                                  f"{ph['total']:.3f}s: " + ", ".join(
                                      f"{k} {ph[k]:.3f}s ({100 * ph[k] / ph['total']:.0f}%)"
                                      for k in PHASES[r["op"]]))
        for name, s in job["stop_agreement"].items():
            stops.append([str(job["world"]), name, f"{s['median_us']:.1f}", f"{s['p90_us']:.1f}",
                          f"{s['min_us']:.1f}", str(s["calls"])])
    over = [j["world"] for j in doc["jobs"] if j["world"] > (m["cpu_count"] or 1)]
    return "\n".join([
        f"machine: {m['cpu']}, {m['cpu_count']} CPUs, {m['memory_gb']} GB RAM, Linux "
        f"{m['kernel']}, Python {m['python']}, torch {m['torch']}",
        f"target:  {m['target']['dir']} on {m['target']['device']} ({m['target']['fstype']})",
        f"run:     {cfg['repeats']} timed reps (median), warm-up {cfg['warmup']} per case, "
        f"loads {cfg['load_cache']}, torch threads a rank "
        f"{[j['torch_threads'] for j in doc['jobs']]}, {doc['total_seconds']:.0f} s, load "
        "average before/after {:.2f}/{:.2f}".format(*(x[0] for x in m["loadavg_before_after"])) +
        (f"\nnote:    {over} ranks on {m['cpu_count']} CPUs is oversubscribed: the ranks take "
         "turns on the cores, and times include waiting for one" if over else ""),
        "", table(["case", "ranks", "method", "op", "median s", "min-max s", "GB/s",
                   "x DCP time", "files MB"], rows, 4),
        "", "x DCP time: unbroken's median time over DCP's (above 1: unbroken is slower)",
        "", "unbroken's phases on rank 0 (median s, share of total; a:b is time in b called "
        "from a; hash: re-reading and hashing a written file; "
        "collectives: time inside unbroken's collectives in all phases, waiting for the "
        "other ranks included):", *phases,
        "", "stop agreement, Group.max_int: one all-reduce MAX of two int64s, the value under "
        "the collective's tag (the cost per update of stop_check_every=1):",
        table(["ranks", "call", "median us", "p90 us", "min us", "calls"], stops, 2)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16M only, 1 rep, 500 calls")
    ap.add_argument("--sizes", help=f"payload sizes, all ranks together (default "
                    f"{DEFAULT_SIZES}; --quick: 16M)")
    ap.add_argument("--worlds", default="2,4", help="rank counts (default 2,4)")
    ap.add_argument("--repeats", type=int, help="timed repetitions (default 5; --quick: 1)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds before each case")
    ap.add_argument("--calls", type=int, help="timed all-reduce calls (default 2000)")
    ap.add_argument("--dir", help="parent of the scratch folder (default: /work or the temp "
                    "dir, whichever is on a real disk)")
    ap.add_argument("--json", action="store_true", help="print only the JSON document")
    ap.add_argument("--out", help="also write the JSON document to this file")
    args = ap.parse_args(argv)
    cases = []
    for s in (args.sizes or ("16M" if args.quick else DEFAULT_SIZES)).split(","):
        target = sl.parse_size(s)
        width = 512 if target < 100e6 else 2048
        per_layer = 3 * 4 * (width * width + width)  # params + exp_avg + exp_avg_sq, fp32
        cases.append({"name": s, "width": width, "layers": max(1, round(target / per_layer))})
    cfg = {"cases": cases, "repeats": args.repeats or (1 if args.quick else 5),
           "warmup": args.warmup, "calls": args.calls or (500 if args.quick else 2000),
           "load_cache": "cold (posix_fadvise DONTNEED)"}
    started = time.perf_counter()
    root = sl.pick_root(args.dir)
    try:
        info = sl.machine_info(root)
        load_before, jobs = os.getloadavg(), []
        for world in (int(w) for w in args.worlds.split(",")):
            sl.log(f"job of {world} ranks (gloo, 127.0.0.1)")
            torch.multiprocessing.spawn(worker, args=(world, {**cfg, "root": root,
                                                              "port": free_port()}),
                                        nprocs=world)
            with open(os.path.join(root, f"job-{world}.json"), encoding="utf-8") as f:
                jobs.append(json.load(f))
        info["loadavg_before_after"] = [load_before, os.getloadavg()]
    finally:
        sl.remove(root)
    doc = {"benchmark": "unbroken sharded", "command": " ".join(
        [os.path.basename(sys.executable), *sys.argv]), "machine": info,
        "config": {**cfg, "gbps": "payload bytes of all ranks per second, median of repeats",
                   "x_dcp": "unbroken's median time over DCP's, same case, same job"},
        "jobs": jobs, "total_seconds": time.perf_counter() - started}
    text = json.dumps(doc, indent=1)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text if args.json else f"{report(doc)}\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
