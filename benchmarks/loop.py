"""What an async save costs a training loop: unbroken (Checkpointer(async_save=True): a
background thread; async_save="process": a persisting process) against torch DCP's async_save,
on a CPU compute loop with a fixed amount of work per step. Mode ``unbroken`` is the default
synchronous save: blocked until committed and durable, its read-back beside the loop.

The loop trains a stack of Linear layers with AdamW (forward, backward, optimizer step on the
same batch every step: fixed work) and saves every N steps. For each save it measures:

- blocked: from the save call until it returns (for DCP: waiting for the previous save's future,
  then async_save(); unbroken's save() waits for the previous save itself);
- durable: from the save call until the generation is committed (unbroken: its background thread
  ended, i.e. written, fsynced, committed, read back, verified, retention applied; DCP: the
  future's done callback, i.e. written with sync_files=True);
- the loop's throughput while the save persists: the steps (fractions of steps counted by
  overlap) done between the save's return and its durable point, per second, against the same
  loop with no save in the same round. "slowdown" is the share of that throughput lost.

Also timed: a copy of the whole state into reused buffers (the floor of any snapshot; the
issue's goal is blocked <= 1.5x this copy), in the no-save rounds at the steps where the
other modes save (after an update: the caches as a save meets them; "blocked / memcpy" uses
this one), and at each round's start (reported beside it). Rounds are interleaved (no save,
unbroken, DCP, then again) and every figure is the median over rounds with its IQR; a figure
whose IQR exceeds 25% of the median is flagged unstable instead of reported.

    .venv/bin/python benchmarks/loop.py                # 256 MB state, 5 rounds, ~3 min on 2 cores
    .venv/bin/python benchmarks/loop.py --quick        # 32 MB, 3 rounds, smoke run
    .venv/bin/python benchmarks/loop.py --threads 2 --repeats 9 --json --out loop.json
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import save_load as sl  # noqa: E402  (helpers: machine facts, scratch folder, IQR)

MODES = ("none", "unbroken", "unbroken-async", "unbroken-process", "unbroken-async-paced",
         "unbroken-process-paced", "dcp-async")
DEFAULT_MODES = ("none", "unbroken-async", "unbroken-process", "dcp-async")


def build(size: int, width: int, batch: int) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                                                      torch.Tensor]:
    torch.manual_seed(0)
    per_layer = 3 * 4 * (width * width + width)  # params + exp_avg + exp_avg_sq, fp32
    layers = max(1, round(size / per_layer))
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*mods[:-1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, torch.randn(batch, width)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # grads stay allocated: the same work every step


class Saver:
    """One way of saving inside the loop: save(step) returns when the loop may go on, and
    calls self.durable(t) from whichever thread finishes the save."""

    def __init__(self) -> None:
        self.done_at: dict[int, float] = {}

    def durable(self, step: int) -> None:
        self.done_at[step] = time.perf_counter()

    def save(self, step: int) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError


class UnbrokenSaver(Saver):
    def __init__(self, root: str, model: torch.nn.Module, opt: torch.optim.Optimizer,
                 how: bool | str = True, share: float | None = None) -> None:
        super().__init__()
        import unbroken
        self.ckpt = unbroken.Checkpointer(root, model=model, optimizer=opt,
                                          keep=unbroken.Keep(last=1), async_save=how,
                                          persist_share=share)
        # One watcher for all saves, started here: a thread started per save made its
        # save() wait until the new thread ran (``Thread.start``), up to a GIL switch interval
        # (5 ms) behind the save's own background thread, which then counted as blocked.
        self.watched: queue.SimpleQueue[tuple[int, threading.Event] | None] = \
            queue.SimpleQueue()
        self.watcher = threading.Thread(target=self.watch, daemon=True)
        self.watcher.start()

    def watch(self) -> None:
        while (item := self.watched.get()) is not None:
            step, ended = item
            ended.wait()
            self.durable(step)

    def save(self, step: int) -> None:
        self.ckpt.save(step)
        in_flight = self.ckpt._in_flight  # the background save; it has ended when durable
        if in_flight is not None:
            self.watched.put((step, in_flight._ended))

    def finish(self) -> None:
        self.ckpt.wait()

    def close(self) -> None:
        self.ckpt.close()
        self.watched.put(None)
        self.watcher.join()


class DCPSaver(Saver):
    def __init__(self, root: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        super().__init__()
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        self.dcp, self.root, self.model, self.opt = dcp, root, model, opt
        # keeps its CPU buffers from one save to the next; pinning etc. need CUDA
        self.stager = DefaultStager(StagingOptions(False, False, False, False))
        self.writer = dcp.FileSystemWriter(os.path.join(root, "0"), sync_files=True)
        self.future: Any = None
        self.slot = 0

    def save(self, step: int) -> None:
        self.finish()  # at most one in flight, as unbroken
        self.slot ^= 1
        path = os.path.join(self.root, str(self.slot))
        older = os.path.join(self.root, str(self.slot ^ 1))
        self.future = self.dcp.async_save(sl.flat_state(self.model, self.opt),
                                          checkpoint_id=path, storage_writer=self.writer,
                                          async_stager=self.stager, no_dist=True)

        finished = self.callback_done = threading.Event()

        def done(_: Any) -> None:
            self.durable(step)
            sl.remove(older)  # retention by hand, once the new one is durable (as unbroken's)
            finished.set()

        self.future.add_done_callback(done)

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()
            self.callback_done.wait()  # the older checkpoint is gone before a save reuses its slot
            self.future = None

    def close(self) -> None:
        self.finish()
        self.stager.close()


def run_round(mode: str, saver: Saver | None, model: torch.nn.Module,
              opt: torch.optim.Optimizer, x: torch.Tensor, steps: int, every: int,
              first_step: int, copy: Callable[[], float] | None = None) -> dict[str, Any]:
    """``steps`` training steps, a save after every ``every``-th (not after the last: the
    steps after the last save let it persist inside the loop). Without a saver, ``copy``
    (the copy of the state into reused buffers) is timed at those points instead: where a
    save would be, after an update, in the state of the caches a save meets (its time is
    not counted in the loop's)."""
    spans: list[tuple[float, float]] = []
    saves: list[tuple[int, float, float]] = []  # step, called, returned
    copies: list[float] = []
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        a = time.perf_counter()
        train_step(model, opt, x)
        spans.append((a, time.perf_counter()))
        if i % every == 0 and i < steps:
            if saver is not None:
                step = first_step + i
                c = time.perf_counter()
                saver.save(step)
                saves.append((step, c, time.perf_counter()))
            elif copy is not None:
                copies.append(copy())
    loop_s = time.perf_counter() - t0 - sum(copies)
    if saver is not None:
        saver.finish()
        time.sleep(0.05)  # the durable callbacks have run
    out: dict[str, Any] = {"mode": mode, "loop_s": loop_s,
                           "step_s": statistics.median(b - a for a, b in spans)}
    if copies:
        out["copy_s"] = statistics.median(copies)
    if saver is None:
        return out
    blocked, durable, work, window = [], [], 0.0, 0.0
    for step, called, returned in saves:
        done = saver.done_at.get(step)
        blocked.append(returned - called)
        if done is None:
            continue
        durable.append(done - called)
        window += max(0.0, done - returned)
        for a, b in spans:  # steps (and fractions of steps) done while the save persisted
            overlap = min(b, done) - max(a, returned)
            if overlap > 0:
                work += overlap / (b - a)
    out.update({"blocked_s": statistics.median(blocked), "durable_s": statistics.median(durable)
                if durable else None, "steps_per_s_persisting": work / window if window else None,
                "saves": len(saves)})
    return out


def memcpy_s(model: torch.nn.Module, opt: torch.optim.Optimizer,
             bufs: list[torch.Tensor]) -> float:
    src = sl.state_tensors(model, opt)
    if not bufs:
        bufs.extend(torch.empty_like(t) for t in src)
    t = time.perf_counter()
    for b, s in zip(bufs, src):
        b.copy_(s)
    return time.perf_counter() - t


def stat(values: list[float]) -> dict[str, Any]:
    med = statistics.median(values)
    iqr = sl.iqr_pct(values)
    return {"median": med, "min": min(values), "max": max(values), "iqr_pct": iqr,
            "unstable": iqr > sl.UNSTABLE_PCT, "all": values}


def summarize(rounds: list[dict[str, Any]], copies: list[float]) -> dict[str, Any]:
    base = {r["round"]: r for r in rounds if r["mode"] == "none"}
    at_saves = [r["copy_s"] for r in base.values() if "copy_s" in r]
    out: dict[str, Any] = {"memcpy_reused_s": stat(copies),
                           "memcpy_at_saves_s": stat(at_saves) if at_saves else None,
                           "none": {"step_s": stat([r["step_s"] for r in base.values()]),
                                    "loop_s": stat([r["loop_s"] for r in base.values()])}}
    for mode in MODES[1:]:
        rs = [r for r in rounds if r["mode"] == mode]
        if not rs:
            continue
        slow = [100 * (1 - r["steps_per_s_persisting"] * base[r["round"]]["step_s"])
                for r in rs if r.get("steps_per_s_persisting")]
        overall = [100 * (r["loop_s"] / base[r["round"]]["loop_s"] - 1) for r in rs]
        out[mode] = {"blocked_s": stat([r["blocked_s"] for r in rs]),
                     "durable_s": stat([r["durable_s"] for r in rs if r["durable_s"]]),
                     "steps_per_s_persisting": stat([r["steps_per_s_persisting"] for r in rs
                                                     if r.get("steps_per_s_persisting")]),
                     "slowdown_persisting_pct": stat(slow) if slow else None,
                     "loop_slowdown_pct": stat(overall)}
    return out


def fmt(s: dict[str, Any] | None, digits: int = 3, unit: str = "") -> str:
    if s is None:
        return "-"
    if s["unstable"]:
        return f"unstable ({s['median']:.{digits}f}{unit}, IQR {s['iqr_pct']:.0f}%)"
    return f"{s['median']:.{digits}f}{unit} (IQR {s['iqr_pct']:.0f}%)"


def fmt_pct(s: dict[str, Any] | None) -> str:
    """A slowdown in %: its spread is told in points (an IQR relative to a median near 0 says
    nothing); unstable when the throughput it comes from is."""
    if s is None:
        return "-"
    return f"{s['median']:.0f}% ({s['min']:.0f} to {s['max']:.0f})"


def fmt_table(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    head = ("method", "blocked s", "blocked / memcpy", "durable s", "steps/s persisting",
            "slowdown persisting", "whole loop slower by")
    base_rate = 1 / s["none"]["step_s"]["median"]
    rows = [("no save", "-", "-", "-", f"{base_rate:.2f} (step {fmt(s['none']['step_s'])})", "0%",
             "0%")]
    # The copy at the save points (after an update, as a save meets the caches) when the
    # no-save rounds timed it; else the one at each round's start.
    cp = s.get("memcpy_at_saves_s") or s["memcpy_reused_s"]
    for mode in MODES[1:]:
        m = s.get(mode)
        if not m:
            continue
        b = m["blocked_s"]
        ratio = "-" if b["unstable"] or cp["unstable"] else f"{b['median'] / cp['median']:.2f}x"
        thr = m["steps_per_s_persisting"]
        slow = m["slowdown_persisting_pct"]
        rows.append((mode, fmt(b), ratio, fmt(m["durable_s"]), fmt(thr, 2),
                     "unstable" if thr["unstable"] or s["none"]["step_s"]["unstable"]
                     else fmt_pct(slow), fmt_pct(m["loop_slowdown_pct"])))
    c = doc["config"]
    lines = [f"state {doc['state_mb']:.0f} MB ({doc['n_tensors']} tensors), {c['steps']} steps a "
             f"round, a save every {c['every']} steps, {c['repeats']} rounds (+{c['warmup']} "
             f"warm-up), torch threads {c['threads']}; copy into reused buffers: "
             f"{fmt(s.get('memcpy_at_saves_s'), 4)} at the save points (blocked / memcpy "
             f"uses it), {fmt(s['memcpy_reused_s'], 4)} at each round's start", ""]
    lines += sl.render(head, [tuple(r) for r in rows], 1)
    lines += ["", "slowdown: median over rounds (min to max), in % of the no-save loop's "
              "steps/s; blocked, durable: median over rounds of each round's median save"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32 MB state, 3 rounds: a smoke run")
    ap.add_argument("--size", default=None, help="state bytes: params + exp_avg + exp_avg_sq "
                    "(default 256M)")
    ap.add_argument("--width", type=int, default=1024, help="Linear width (default 1024)")
    ap.add_argument("--batch", type=int, default=64, help="rows per step (default 64)")
    ap.add_argument("--steps", type=int, default=None, help="steps a round (default 40)")
    ap.add_argument("--every", type=int, default=10, help="save every N steps (default 10)")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads of the loop (default 1: on 2 cores the other "
                    "core is left to the save, as a GPU loop leaves the CPU; 0: torch default)")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help=f"subset of {','.join(MODES)} (default {','.join(DEFAULT_MODES)}); "
                    "the -paced ones save with persist_share")
    ap.add_argument("--persist-share", type=float, default=0.2,
                    help="persist_share of the -paced modes (default 0.2: a fifth of a core)")
    ap.add_argument("--dir", help="parent of the scratch folder (as save_load.py)")
    ap.add_argument("--json", action="store_true", help="print only the JSON document")
    ap.add_argument("--out", help="also write the JSON document to this file")
    args = ap.parse_args(argv)
    size = sl.parse_size(args.size or ("32M" if args.quick else "256M"))
    steps = args.steps or (20 if args.quick else 40)
    repeats = args.repeats or (3 if args.quick else 5)
    modes = [m for m in args.modes.split(",") if m]
    if "none" not in modes:
        modes.insert(0, "none")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)  # DCP's no-process-group warnings
    os.environ.setdefault("UNBROKEN_PROGRESS", "0")
    started = time.perf_counter()
    root = sl.pick_root(args.dir)
    model, opt, x = build(size, args.width, args.batch)
    train_step(model, opt, x)  # AdamW state exists from here on
    tensors = sl.state_tensors(model, opt)
    state_mb = sum(t.numel() * t.element_size() for t in tensors) / sl.MB
    sl.log(f"loop: {state_mb:.0f} MB state, {len(tensors)} tensors, target {root}")
    savers: dict[str, Saver] = {}
    rounds: list[dict[str, Any]] = []
    copies: list[float] = []
    bufs: list[torch.Tensor] = []
    step = 0
    try:
        info = sl.machine_info(root)
        if "unbroken" in modes:  # the default save: its read-back and retention beside
            savers["unbroken"] = UnbrokenSaver(os.path.join(root, "unbroken-sync"), model, opt,
                                               False)
        if "unbroken-async" in modes:
            savers["unbroken-async"] = UnbrokenSaver(os.path.join(root, "unbroken"), model, opt)
        if "unbroken-process" in modes:  # the snapshot in shared memory, a persisting process
            savers["unbroken-process"] = UnbrokenSaver(os.path.join(root, "unbroken-process"),
                                                       model, opt, "process")
        for mode, how in (("unbroken-async-paced", True), ("unbroken-process-paced", "process")):
            if mode in modes:  # the same saves, spread over a fifth of a core (persist_share)
                savers[mode] = UnbrokenSaver(os.path.join(root, mode), model, opt, how,
                                             args.persist_share)
        if "dcp-async" in modes:
            os.makedirs(os.path.join(root, "dcp"))
            savers["dcp-async"] = DCPSaver(os.path.join(root, "dcp"), model, opt)
        load_before = os.getloadavg()
        for rnd in range(args.warmup + repeats):
            copy = memcpy_s(model, opt, bufs)
            if rnd >= args.warmup:
                copies.append(copy)
            for mode in modes:  # interleaved: drift hits every mode alike
                r = run_round(mode, savers.get(mode), model, opt, x, steps, args.every, step,
                              lambda: memcpy_s(model, opt, bufs))
                step += steps
                r["round"] = rnd
                sl.log(f"   round {rnd + 1}/{args.warmup + repeats}"
                       f"{' (warm-up)' if rnd < args.warmup else ''} {mode}: loop "
                       f"{r['loop_s']:.2f}s, step {r['step_s']:.3f}s" +
                       (f", blocked {r['blocked_s']:.3f}s, durable {r['durable_s'] or 0:.3f}s, "
                        f"{r['steps_per_s_persisting'] or 0:.2f} steps/s persisting"
                        if "blocked_s" in r else ""))
                if rnd >= args.warmup:
                    rounds.append(r)
        info["loadavg_before_after"] = [load_before, os.getloadavg()]
    finally:
        for s in savers.values():
            s.close()  # type: ignore[attr-defined]
        shutil.rmtree(root, ignore_errors=True)
    doc = {"benchmark": "unbroken loop", "command": " ".join([os.path.basename(sys.executable),
                                                              *sys.argv]),
           "machine": info, "state_mb": state_mb, "n_tensors": len(tensors),
           "config": {"size": size, "width": args.width, "batch": args.batch, "steps": steps,
                      "every": args.every, "repeats": repeats, "warmup": args.warmup,
                      "threads": torch.get_num_threads(), "modes": modes,
                      "persist_share": args.persist_share,
                      "unstable": f"IQR > {sl.UNSTABLE_PCT:.0f}% of the median"},
           "summary": summarize(rounds, copies), "rounds": rounds,
           "total_seconds": time.perf_counter() - started}
    load = info["loadavg_before_after"]
    sl.emit(doc, args.json, args.out, [
        f"machine: {info['cpu']}, {info['cpu_count']} CPUs, torch {info['torch']}; "
        f"target {info['target']['dir']} ({info['target']['fstype']}); "
        f"{doc['total_seconds']:.0f} s, load average before/after "
        f"{load[0][0]:.2f}/{load[1][0]:.2f}", fmt_table(doc), ""])
    return 0


if __name__ == "__main__":
    sys.exit(main())
