"""A 2-rank job (gloo on CPU) for tests/integration/test_review_job_saves_ddp.py: saves whose
failure is the leader's alone must fail on every rank at once, never leave the ranks waiting
for each other. Run with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set; ``MODE`` is
``process`` or ``background`` (the default read-back). Writes ``<out>/result.rank<r>.json``.

Save 1 succeeds; at save 2 the extras part is nested deeper than a generation can store, on
every rank alike (so the replicas agree), and only the leader encodes it; save 3 succeeds.
With ``process``, rank 1's persisting process is then stopped, handed save 4 and SIGKILLed
before it took it: a new one takes it, and the job commits it. Then it takes save 5 and is
SIGKILLed while it waits for rank 0's: every rank's ``wait()`` must fail at once, not when the
others give up waiting for it."""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import signal
import sys
import time
import warnings

import torch
import torch.distributed as dist

import unbroken


class Deep:
    """Extras whose state is nested too deep to store while ``deep`` is set."""

    def __init__(self) -> None:
        self.deep = False

    def state_dict(self) -> dict[str, object]:
        value: object = 0
        for _ in range(300 if self.deep else 1):
            value = {"x": value}
        return {"v": value}

    def load_state_dict(self, state: dict[str, object]) -> None:
        pass


def outcome(ckpt: unbroken.Checkpointer, tag: str) -> dict[str, object]:
    """How ``ckpt.wait()`` ended (``raised<tag>``: None or the error) and how long it took."""
    started = time.monotonic()
    try:
        ckpt.wait()
        raised = None
    except unbroken.UnbrokenError as e:
        raised = {"type": type(e).__name__, "message": str(e)}
    return {f"raised{tag}": raised, f"seconds{tag}": time.monotonic() - started}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    faulthandler.dump_traceback_later(60, exit=True)  # a stuck rank shows its stacks, ends
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    extra = Deep()
    mode = os.environ["MODE"]
    ckpt = unbroken.Checkpointer(args.folder, model=model, optimizer=opt, extras={"e": extra},
                                 async_save="process" if mode == "process" else False,
                                 async_timeout=8)
    ckpt.restore()
    ckpt.save(1)
    ckpt.wait()
    extra.deep = True
    started = time.monotonic()
    try:
        ckpt.save(2)
        ckpt.wait()
        raised = None
    except unbroken.UnbrokenError as e:
        raised = {"type": type(e).__name__, "message": str(e)}
    seconds = time.monotonic() - started
    extra.deep = False
    ckpt.save(3)
    result = {"raised": raised, "seconds": seconds}
    if mode == "process":
        ckpt.wait()
        # save 4: rank 1's persisting process is stopped, handed the save and SIGKILLed before
        # it took it: a new one takes it (with a warning), and the job commits generation 4
        persister = ckpt._persister._proc
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if rank == 1:
                os.kill(persister.pid, signal.SIGSTOP)
            ckpt.save(4)
            if rank == 1:
                os.kill(persister.pid, signal.SIGKILL)
            result.update(outcome(ckpt, "4"))
        result["warned4"] = [str(w.message) for w in caught]
        # save 5: rank 1's persisting process takes the save, then waits for rank 0's (stopped
        # before the save) to write its files too, and is SIGKILLed there: every rank's wait()
        # must fail at once, not when the others give up waiting for it
        persister = ckpt._persister._proc
        if rank == 0:
            os.kill(persister.pid, signal.SIGSTOP)
        ckpt.save(5)
        if rank == 1:
            deadline = time.monotonic() + 20
            while not ckpt._persister._taken:
                assert time.monotonic() < deadline, "save 5 was never taken"
                time.sleep(0.01)
            os.kill(persister.pid, signal.SIGKILL)
        dist.barrier()
        if rank == 0:
            os.kill(persister.pid, signal.SIGCONT)
        result.update(outcome(ckpt, "5"))
    ckpt.close()
    with open(os.path.join(args.out, f"result.rank{rank}.json"), "w") as f:
        json.dump({**result, "folder": sorted(os.listdir(args.folder))}, f)
    dist.destroy_process_group()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
