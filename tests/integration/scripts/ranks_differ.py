"""One rank of a 2-rank gloo job whose ranks build or use their Checkpointers differently
(tests/integration/test_ddp_ranks_differ.py). Every collective runs under a 60 s
process-group timeout; the test asserts the job ends long before it.

``--mode differ``: builds one Checkpointer per setting that rank 1 gives otherwise than rank 0,
each refused on both ranks, in turn (a refusal leaves the job's collectives in step), then one
with the same settings that saves; prints one JSON line per setting.
``--mode raise``: rank 1 raises its own error after update 3 (handled, ``close()`` in
``finally``) while rank 0 trains on and saves at update 4; prints what each rank saw.
``--mode train``: trains to ``--steps``, resuming from the folder, and prints the weights.
``--mode tags``: rank 0 and rank 1 enter different collectives of `unbroken.dist.group.Group`;
then the same one."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import time

import torch
import torch.distributed as dist

import unbroken
from unbroken.dist.group import Group, RankFailed

p = argparse.ArgumentParser()
p.add_argument("--folder", required=True)
p.add_argument("--mode", required=True)
p.add_argument("--async-save", default="")
p.add_argument("--steps", type=int, default=6)
args = p.parse_args()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
started = time.monotonic()


def report(**fields) -> None:
    print(json.dumps({"rank": rank, "seconds": round(time.monotonic() - started, 1), **fields}),
          flush=True)


class Extra:
    def state_dict(self):
        return {"decay": 0.99}

    def load_state_dict(self, state):
        pass


def job():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    return model, ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)


if args.mode == "tags":
    group = Group()
    try:
        if rank == 0:
            group.all_gather({"step": 4}, "comparing replicas")
        else:
            group.broadcast(None, "closing")
        report(raised=None)
    except RankFailed as e:
        report(raised=str(e))
    report(after=group.all_gather(rank, "the same one"))
    # The class of it: 200 random sequences of the three kinds of collective, rank 1's
    # leaving rank 0's at a random call (another name, or another kind of the same name):
    # both fail at that call, never sooner, never later, and the group stays in step.
    import random

    names = ["comparing replicas", "closing", "preparing the save", "agreeing on the run",
             "writing the generation", "agreeing on a stop request"]
    failed_at = []
    for seed in range(200):
        rng = random.Random(seed)
        calls = [(rng.choice("gbm"), rng.choice(names)) for _ in range(rng.randint(1, 8))]
        leave = rng.randrange(len(calls) + 1)  # (len: none left)
        if rank == 1 and leave < len(calls):
            kind, name = calls[leave]
            calls[leave] = ((kind, rng.choice([n for n in names if n != name])) if seed % 3
                            else (rng.choice([k for k in "gbm" if k != kind]), name))
        got = None
        for i, (kind, name) in enumerate(calls):
            try:
                value = {"g": lambda: group.all_gather([rank, i] * (i + rank), name),
                         "b": lambda: group.broadcast({"from": rank, "i": i}, name),
                         "m": lambda: group.max_int(rank + i, name)}[kind]()
                assert value == {"g": [[r, i] * (i + r) for r in range(2)],
                                 "b": {"from": 0, "i": i}, "m": 1 + i}[kind], (kind, value)
            except RankFailed:
                got = i
                break
        failed_at.append([leave if leave < len(calls) else None, got])
        group.all_gather(seed, "between sequences")  # (in step again)
    report(sequences=failed_at)
    try:  # a value too large on one rank: refused on both, in step
        group.max_int(2**31 if rank else 0, "too large")
        report(large=None)
    except unbroken.UnbrokenError as e:
        report(large=str(e))
    report(after_large=group.max_int(rank, "in step"))

elif args.mode == "differ":
    USR1 = signal.SIGUSR1
    cases = {  # setting: (both ranks' options, rank 1's other options)
        "every=": ({"every": 2}, {"every": 3}),
        "async_save=": ({}, {"async_save": True}),
        "read_back=": ({}, {"read_back": "sync"}),
        "incremental=": ({}, {"incremental": True}),
        "signals=": ({}, {"signals": [USR1]}),
        "stop_check_every=": ({"signals": [USR1]}, {"stop_check_every": 2}),
        "$UNBROKEN_SAVE_AT": ({}, {}),
        "the parts given": ({}, {"extras": {"ema": Extra()}}),
        "root": ({}, {}),
        "identity": ({"identity": unbroken.Identity(config={"lr": 0.1, "seed": 0})},
                     {"identity": unbroken.Identity(config={"lr": 0.2, "seed": 0})}),
    }
    model, ddp, opt = job()
    for setting, (both, other) in cases.items():
        if setting == "$UNBROKEN_SAVE_AT" and rank == 1:
            os.environ["UNBROKEN_SAVE_AT"] = "3"
        folder = os.path.join(args.folder, "refused" + ("2" * (setting == "root" and rank)))
        try:
            ck = unbroken.Checkpointer(folder, model=ddp,
                                       optimizer=opt, **{**both, **(other if rank else {})})
            ck.close()
            report(setting=setting, refused=None)
        except unbroken.UnbrokenError as e:
            report(setting=setting, refused=type(e).__name__, message=str(e))
            assert not os.path.exists(folder), setting
        os.environ.pop("UNBROKEN_SAVE_AT", None)
    same = unbroken.Identity(config={"lr": 0.1, "seed": 0})
    with unbroken.Checkpointer(args.folder, model=ddp, optimizer=opt, identity=same) as ck:
        ck.save(0)
    for setting, odd in (("restore(generation=)", {"generation": 0}),
                         ("restore(intent)", {"intent": "warm_start", "source": args.folder})):
        with unbroken.Checkpointer(args.folder, model=ddp, optimizer=opt, identity=same) as ck:
            try:
                ck.restore(**(odd if rank else {}))
                report(setting=setting, refused=None)
            except unbroken.UnbrokenError as e:
                report(setting=setting, refused=type(e).__name__, message=str(e))
    report(setting=None, saved=sorted(os.listdir(args.folder)))

else:
    model, ddp, opt = job()
    ck = unbroken.Checkpointer(args.folder, model=ddp, optimizer=opt, every=2,
                               async_save=args.async_save or False)
    step = ck.restore()
    errors = []
    try:
        while step < args.steps:
            ddp(torch.randn(8, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            step += 1
            if args.mode == "raise" and rank == 1 and step == 4:
                raise RuntimeError("rank 1's own error")
            ck.step_done(step)
        ck.save()
    except Exception as e:
        errors.append(f"{type(e).__name__}: {e}")
    finally:
        try:
            ck.close()
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    report(errors=errors, step=step,
           weights=[t.flatten().tolist() for t in model.state_dict().values()])
# (ended here, not in the interpreter's teardown, where a live group's threads can abort it)
dist.destroy_process_group()
