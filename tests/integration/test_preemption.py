"""A preemption notice as launchers send it: SIGTERM to every process of the training
process's group (torchrun's agent, SLURM, ``kill -TERM -PGID``), DataLoader workers included.
The workers survive it, and the training loop saves at the next update boundary and stops."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap

from unbroken.store.generations import GenerationStore

SCRIPT = textwrap.dedent("""
    import signal, sys, time, torch, unbroken
    data = torch.utils.data.TensorDataset(torch.randn(512, 4), torch.randn(512, 1))
    loader = unbroken.ResumableLoader(
        data, unbroken.ResumableSampler(len(data), batch_size=8, seed=0), num_workers=2)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = unbroken.Checkpointer(sys.argv[1], model=model, optimizer=opt, data=loader,
                                 signals=[signal.SIGTERM])
    step = ckpt.restore()
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        step += 1
        ckpt.step_done(step)
        print(f"update {step}", flush=True)
        if ckpt.should_stop:
            print(f"stopped after update {step}", flush=True)
            break
        time.sleep(0.05)
    ckpt.close()
    """)


def test_sigterm_to_the_whole_process_group_stops_at_the_next_boundary(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path / "run")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if line.strip() == "update 5":
                os.killpg(proc.pid, signal.SIGTERM)  # the training process and its 2 workers
                break
        out, err = proc.communicate(timeout=120)
    finally:  # whatever happened, nothing of it outlives the test
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, err[-3000:]
    stopped = next(line for line in out.splitlines() if line.startswith("stopped"))
    step = int(stopped.split()[-1])
    assert step >= 5
    gens = GenerationStore(tmp_path / "run").scan()
    assert gens[-1].generation == step and gens[-1].ok
