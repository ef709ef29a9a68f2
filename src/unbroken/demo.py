"""``unbroken demo``: seed 000's toy experiment, run for real.

Train 12 updates uninterrupted; train another copy that saves every 5 updates and is killed by
SIGKILL after update 8; resume it in a fresh process and compare every update bit for bit.
Then resume copies of the killed run deliberately wrongly (weights only; momentum cleared) and
show where and how they leave the uninterrupted trajectory."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any

from ._table import table

STEPS, EVERY, KILL_AFTER = 12, 5, 8
_FIELDS = ("weight", "lr", "optimizer", "rng")


def _run(run: str, log: str, *extra: str, kill_at: str | None = None) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    if kill_at:
        env["UNBROKEN_KILL_AT"] = kill_at
    cmd = [sys.executable, "-m", "unbroken._toy", "--run", run, "--log", log,
           "--steps", str(STEPS), "--every", str(EVERY), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True,
                          start_new_session=True).returncode


def _events(log: str) -> list[dict[str, Any]]:
    with open(log) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def _first_difference(ref: dict[int, dict[str, Any]], got: dict[int, dict[str, Any]]
                      ) -> tuple[int, list[str]] | None:
    for step in sorted(ref):
        diff = [f for f in _FIELDS if got.get(step, {}).get(f) != ref[step].get(f)]
        if diff:
            return step, diff
    return None


def run_demo(workdir: str | None = None, as_json: bool = False) -> int:
    """Run the demonstration; return 0 when the correct resume is bitwise equal to the
    uninterrupted run and every defective resume is caught."""
    tmp = workdir or tempfile.mkdtemp(prefix="unbroken-demo-")
    os.makedirs(tmp, exist_ok=True)
    ref_log = os.path.join(tmp, "uninterrupted.jsonl")
    _run(os.path.join(tmp, "uninterrupted"), ref_log)
    ref = {e["step"]: e for e in _events(ref_log) if e["event"] == "step"}

    killed_run, killed_log = os.path.join(tmp, "killed"), os.path.join(tmp, "killed.jsonl")
    code = _run(killed_run, killed_log, kill_at=f"step-done@{KILL_AFTER}")
    killed_ok = code == -signal.SIGKILL
    results: dict[str, Any] = {}
    for name, defect in (("correct", "none"), ("weights_only", "weights_only"),
                         ("cleared_momentum", "clear_momentum")):
        run, log = os.path.join(tmp, name), os.path.join(tmp, f"{name}.jsonl")
        shutil.copytree(killed_run, run)
        shutil.copy(killed_log, log)
        rc = _run(run, log, "--defect", defect)
        events = _events(log)
        restored = [e for e in events if e["event"] == "restored"][-1]
        steps = {e["step"]: e for e in events if e["event"] == "step"}  # replays overwrite
        first = _first_difference(ref, steps)
        results[name] = {"exit_code": rc, "resumed_from": restored["step"],
                         "restored_state": {f: restored[f] for f in _FIELDS},
                         "verdict": "equivalent" if first is None else "diverged",
                         "first_divergence": None if first is None else
                         {"step": first[0], "fields": first[1]}}
    good = (killed_ok and results["correct"]["verdict"] == "equivalent"
            and results["correct"]["resumed_from"] == EVERY
            and all(results[d]["verdict"] == "diverged"
                    for d in ("weights_only", "cleared_momentum")))
    if as_json:
        print(json.dumps({"ok": good, "workdir": tmp, "killed_by_sigkill": killed_ok,
                          "uninterrupted_final_weight": ref[STEPS]["weight"], **results},
                         indent=2))
    else:
        _print(ref, results, killed_ok, tmp, good)
    if workdir is None and good:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if good else 1


def _print(ref: dict[int, dict[str, Any]], results: dict[str, Any], killed_ok: bool, tmp: str,
           good: bool) -> None:
    print(f"unbroken demo: one weight, momentum 0.9, step-dependent lr, shuffled data, random "
          f"input noise ({STEPS} updates, a save every {EVERY})")
    print(f"  a copy was killed by SIGKILL after update {KILL_AFTER}: "
          f"{'yes' if killed_ok else 'NO'}; each resume runs in a fresh process\n")
    cols = ["uninterrupted", "correct resume", "weights only", "momentum cleared"]
    names = ["correct", "weights_only", "cleared_momentum"]
    short = lambda v: v[:12] if isinstance(v, str) else json.dumps(v)[:12]  # noqa: E731
    rows = [["completed updates", EVERY] + [results[n]["resumed_from"] for n in names]]
    for f, label in (("weight", "weight (hex)"), ("lr", "next lr (hex)"),
                     ("optimizer", "momentum hash"), ("rng", "RNG hash")):
        val = ref[EVERY][f]
        if f == "rng":
            rows.append([label, short(val["torch_cpu"])] +
                        [short(results[n]["restored_state"][f]["torch_cpu"]) for n in names])
        else:
            rows.append([label, short(val)] + [short(results[n]["restored_state"][f])
                                               for n in names])
    rows.append([f"weight after {STEPS}", short(ref[STEPS]["weight"])] + [
        "= uninterrupted" if results[n]["verdict"] == "equivalent" else
        f"differs from {results[n]['first_divergence']['step']}" for n in names])
    print(table(["state at the resume point", *cols], rows, indent="  "))
    print()
    for n, label in zip(names, cols[1:]):
        r = results[n]
        if r["verdict"] == "equivalent":
            print(f"  {label}: equivalent, bitwise, at every one of {STEPS} updates")
        else:
            d = r["first_divergence"]
            print(f"  {label}: diverged at update {d['step']} in {', '.join(d['fields'])}")
    print(f"\n  verdict: {'OK' if good else 'FAILED'}" + ("" if good else f" (files in {tmp})"))
