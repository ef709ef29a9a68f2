"""``unbroken demo``: the main job.

Trains the tiny language model of `unbroken.proof.tinylm` uninterrupted; kills a copy with
SIGKILL in the middle of an epoch; resumes it in a fresh process and compares every update bit
for bit. Then resumes copies of the killed run deliberately wrongly (weights only; scheduler,
RNG or data position not restored; the newest generation torn) and shows each defect caught and
attributed to the right state part, in the continuation-trace table of seed 002."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from .._table import table
from ..checkpointer import ROOT_ENV
from ..faults import DROP_ENV
from ..store.backends.killpoints import KILL_ENV
from ..trace import TRACE_ENV, read_trace
from .equivalence import compare, stitch
from .harness import run_process

EVERY, KILL_AFTER = 10, 35
# name -> (fault injected on resume, the state part the checker must name)
VARIANTS: dict[str, tuple[str | None, str | None]] = {
    "correct": (None, None),
    "weights_only": ("weights_only", "optimizer"),
    "no_scheduler": ("scheduler", "scheduler"),
    "no_rng": ("rng", "rng"),
    "no_data_position": ("data", "data position"),
    "torn_latest": (None, None),
}
_COLUMNS = {"correct": "correct resume", "weights_only": "weights only",
            "no_scheduler": "no scheduler", "no_rng": "no RNG",
            "no_data_position": "no data position", "torn_latest": "torn newest"}


def _cmd() -> list[str]:
    return [sys.executable, "-m", "unbroken.proof.tinylm", "--every", str(EVERY)]


def _tear_newest(run: str) -> str:
    """Truncate the largest file of the newest generation, as a crash of a tool without
    atomic commits would leave it."""
    newest = sorted(n for n in os.listdir(run) if n.startswith("gen-"))[-1]
    folder = os.path.join(run, newest)
    victim = max(os.listdir(folder), key=lambda n: os.path.getsize(os.path.join(folder, n)))
    path = os.path.join(folder, victim)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    return newest


def run_demo(workdir: str | None = None, as_json: bool = False) -> int:
    """Run the demonstration; 0 when the resume is bitwise equivalent and every defect is
    caught and attributed to the right part."""
    started = time.monotonic()
    tmp = workdir or tempfile.mkdtemp(prefix="unbroken-demo-")
    os.makedirs(tmp, exist_ok=True)
    say = (lambda m: None) if as_json else (lambda m: print(m, flush=True))
    say("unbroken demo: a tiny transformer LM (dropout, 2 DataLoader workers with random token "
        "masking, accumulation 2, AdamW, warmup+cosine, clipping, a moving AMP loss scale)")
    ref_trace = os.path.join(tmp, "uninterrupted.jsonl")
    say("  1. training uninterrupted ...")
    if run_process(_cmd(), {ROOT_ENV: os.path.join(tmp, "uninterrupted"), TRACE_ENV: ref_trace},
                   os.path.join(tmp, "uninterrupted.log"), 300) != 0:
        say(f"  the reference run failed; see {tmp}/uninterrupted.log")
        return 1
    reference = read_trace(ref_trace)
    killed_run, killed_trace = os.path.join(tmp, "killed"), os.path.join(tmp, "killed.jsonl")
    say(f"  2. training a copy that saves every {EVERY} updates; SIGKILL after update "
        f"{KILL_AFTER} ...")
    code = run_process(_cmd(), {ROOT_ENV: killed_run, TRACE_ENV: killed_trace,
                                KILL_ENV: f"step-done@{KILL_AFTER}"},
                       os.path.join(tmp, "killed.log"), 300)
    killed_ok = code == -signal.SIGKILL
    results: dict[str, Any] = {}
    say("  3. resuming copies of the killed run in fresh processes: correctly, and with "
        "deliberate defects ...")
    for name, (drop, expected_part) in VARIANTS.items():
        run, trace = os.path.join(tmp, name), os.path.join(tmp, f"{name}.jsonl")
        shutil.copytree(killed_run, run)
        torn = _tear_newest(run) if name == "torn_latest" else None
        env = {ROOT_ENV: run, TRACE_ENV: trace, **({DROP_ENV: drop} if drop else {})}
        rc = run_process(_cmd(), env, os.path.join(tmp, f"{name}.log"), 300)
        if rc != 0 or not killed_ok or not os.path.exists(trace):
            results[name] = {"exit_code": rc, "verdict": "error", "caught": False,
                             "log": os.path.join(tmp, f"{name}.log"), "resumed_from": None,
                             "state_part": None, "step": None, "also": [], "next_ids": [],
                             "next_lr": None, "optimizer_hash": None, "rng_hash": None,
                             "scaler_hash": None, "refused": None, "torn_generation": torn}
            continue
        segments = [read_trace(killed_trace), read_trace(trace)]
        result = compare(reference, segments)
        d = result.first_divergence
        restore = [r for r in segments[1] if r["event"] == "restore"][-1]
        updates, _ = stitch(segments)
        nxt = updates.get((result.resumed_from or 0) + 1, {})
        entry: dict[str, Any] = {
            "exit_code": rc, "verdict": result.verdict, "resumed_from": result.resumed_from,
            "state_part": d.state_part if d else None, "field": d.field if d else None,
            "step": d.step if d else None, "kind": d.kind if d else None,
            "also": d.also if d else [], "restore_differs": result.restore_differs,
            "next_ids": (nxt.get("ids") or [])[:4], "next_lr": (nxt.get("lr") or [None])[0],
            "optimizer_hash": restore["state"].get("optimizer"),
            "rng_hash": restore["rng"].get("torch_cpu"),
            "scaler_hash": restore["state"].get("scaler")}
        if torn:
            entry["refused"] = restore.get("rejected")
            entry["torn_generation"] = torn
        if expected_part is None:
            entry["caught"] = result.verdict == "equivalent" and (
                not torn or entry["refused"] == [torn])
        else:
            entry["caught"] = (result.verdict == "diverged" and d is not None
                               and d.state_part.startswith(expected_part))
        results[name] = entry
    good = killed_ok and all(r["caught"] for r in results.values())
    payload = {"ok": good, "workdir": tmp, "killed_by_sigkill": killed_ok,
               "seconds": round(time.monotonic() - started, 1),
               "resume": results["correct"],
               "defects": {k: v for k, v in results.items() if k != "correct"}}
    if as_json:
        print(json.dumps(payload, indent=2))
    else:
        say(_report(reference, results, killed_ok, good, tmp, payload["seconds"]))
    if workdir is None and good:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if good else 1


def _report(reference: list[dict[str, Any]], results: dict[str, Any], killed_ok: bool,
            good: bool, tmp: str, seconds: float) -> str:
    ref, _ = stitch([reference])
    k = results["correct"]["resumed_from"] or 0
    at, nxt = ref.get(k, {}), ref.get(k + 1, {})
    short = lambda v: "-" if v is None else str(v)[:10]  # noqa: E731
    lr = lambda v: "-" if v is None else f"{float.fromhex(v):.3e}"  # noqa: E731
    ids = lambda v: ",".join(map(str, v[:3])) if v else "-"  # noqa: E731
    names = list(results)
    rows: list[Sequence[object]] = [
        ["completed updates", k] + [short(results[n]["resumed_from"]) for n in names],
        ["next batch ids", ids(nxt.get("ids"))] + [ids(results[n]["next_ids"]) for n in names],
        ["learning rate", lr((nxt.get("lr") or [None])[0])] +
        [lr(results[n]["next_lr"]) for n in names],
        ["optimizer hash", short(at.get("state", {}).get("optimizer"))] +
        [short(results[n]["optimizer_hash"]) for n in names],
        ["loss-scale hash", short(at.get("state", {}).get("scaler"))] +
        [short(results[n]["scaler_hash"]) for n in names],
        ["RNG hash", short(at.get("rng", {}).get("torch_cpu"))] +
        [short(results[n]["rng_hash"]) for n in names],
        ["verdict", "reference"] + [results[n]["verdict"] for n in names],
        ["first differs at", "-"] + [short(results[n]["step"]) for n in names],
        ["explained by", "-"] + [results[n]["state_part"] or "-" for n in names],
    ]
    lines = ["", f"  killed by SIGKILL after update {KILL_AFTER}: {'yes' if killed_ok else 'NO'}",
             "", table(["", "uninterrupted", *(_COLUMNS[n] for n in names)], rows,
                       indent="  "), ""]
    c = results["correct"]
    lines.append(f"  correct resume: {c['verdict']}, bitwise, every update (resumed from "
                 f"{c['resumed_from']})")
    for n in names[1:]:
        r = results[n]
        if r["verdict"] == "error":
            lines.append(f"  {_COLUMNS[n]}: the resumed run failed (exit {r['exit_code']}); "
                         f"see {r['log']}")
            continue
        if n == "torn_latest":
            lines.append(f"  torn newest: {r['torn_generation']} refused by its hashes; resumed "
                         f"from {r['resumed_from']} instead and still {r['verdict']}")
            continue
        also = f" (also: {', '.join(r['also'])})" if r["also"] else ""
        lines.append(f"  {_COLUMNS[n]}: {r['verdict']} at update {r['step']}, explained by "
                     f"{r['state_part']}{also}; {'caught' if r['caught'] else 'NOT CAUGHT'}")
    lines += ["", f"  verdict: {'OK' if good else 'FAILED'} in {seconds:.0f} s" +
              ("" if good else f"; files in {tmp}")]
    return "\n".join(lines)
