"""Cost of the per-update trace on the demo's model (`unbroken.proof.tinylm`), in process.

Each update is timed, then marked with ``step_done`` on an untraced and on a traced
Checkpointer (alternating which goes first) over the same model, so machine noise hits both
alike. Prints a table and JSON: median update time, mean extra time of a traced
``step_done`` with the optimizer-state digest every 10 updates (the default) and every update,
and the ratio. Parameters, RNG streams and the other parts are digested every update.

    python benchmarks/trace_overhead.py [--updates N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

import unbroken
from unbroken.proof.tinylm import CONTEXT, TinyLM, Windows, corpus


def measure(updates: int, hash_every: int, tmp: str) -> dict[str, float]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = Windows(corpus(), 768)
    model = TinyLM(data.vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = unbroken.ResumableLoader(data, unbroken.ResumableSampler(len(data), 16, seed=0))
    plain = unbroken.Checkpointer(os.path.join(tmp, f"plain{hash_every}"), model=model,
                                  optimizer=opt, data=loader)
    traced = unbroken.Checkpointer(os.path.join(tmp, f"traced{hash_every}"), model=model,
                                   optimizer=opt, data=loader,
                                   trace=os.path.join(tmp, f"t{hash_every}.jsonl"),
                                   trace_hash_every=hash_every)
    batches = (b for _ in range(100) for b in loader)
    step_t, extra = [], []
    for step in range(1, updates + 1):
        x, y = next(batches)
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).reshape(-1, data.vocab), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        t1 = time.perf_counter()
        order = (plain, traced) if step % 2 else (traced, plain)
        spent = {}
        for ck in order:
            t = time.perf_counter()
            ck.step_done(step, loss=loss, batch=(x, y))
            spent[ck] = time.perf_counter() - t
        step_t.append(t1 - t0 + spent[plain])
        extra.append(spent[traced] - spent[plain])
    plain.close()
    traced.close()
    base, cost = statistics.median(step_t[5:]), statistics.mean(extra[5:])
    return {"hash_every": hash_every, "update_ms": base * 1e3, "trace_ms": cost * 1e3,
            "overhead_pct": 100 * cost / base}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=100)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(args.updates, every, tmp) for every in (10, 1)]
    print(f"{'optimizer digest every':>22} {'update':>10} {'trace cost':>11} {'overhead':>9}")
    for r in rows:
        print(f"{r['hash_every']:>22} {r['update_ms']:>7.2f} ms {r['trace_ms']:>8.3f} ms "
              f"{r['overhead_pct']:>8.1f}%")
    model = f"unbroken.proof.tinylm (2 layers, d=64, context {CONTEXT}, batch 16)"
    print(json.dumps({"model": model,
                      "threads": 1, "updates": args.updates, "results": rows}))


if __name__ == "__main__":
    main()
