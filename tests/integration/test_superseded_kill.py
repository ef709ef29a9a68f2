"""A kill while a save of the same step replaces its generation (the earlier save of that step
moved aside as superseded, the new one complete in its staging folder, not yet renamed in): the
next writer commits the new one, as the rename would have (the superseded state is not one the
run continues from: it was replaced, as after an end-of-epoch scheduler step). Before the
fortieth session the restore took the generation before it (replaying the updates since), and,
where the superseded generation was the run's only one (``Keep(last=1)``, found by an outside
attack), started again from step 0. A kill at every other operation of that save leaves the
old generation or the new one in place, never neither."""

from __future__ import annotations

import json
import os
import signal
import textwrap

import pytest
from conftest import run_script

SCRIPT = textwrap.dedent('''
    import json, sys, torch, unbroken
    from unbroken.store.backends.killpoints import io_count
    torch.manual_seed(0)
    folder, mode, keep = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ck = unbroken.Checkpointer(folder, model=model, optimizer=opt, scheduler=sched,
                               keep=unbroken.Keep(last=keep), read_back="sync",
                               async_save=mode if mode != "off" else False)
    step = ck.restore()
    if step == 0:
        for step in (1, 2):
            model(torch.ones(3)).sum().backward()
            opt.step()
            opt.zero_grad()
            ck.step_done(step)
            ck.save()
            ck.wait()
        sched.step()  # (the end of an epoch: step 2 saved again)
        before = io_count()
        ck.save()
        ck.wait()
        print(json.dumps({"ops": [before, io_count()]}))
    print(json.dumps({"step": step, "lr": opt.param_groups[0]["lr"],
                      "weight": model.weight.tolist()}), flush=True)
    ck.close()
''')


def _run(tmp_path, run, *args, env=None):
    script = tmp_path / "supersede.py"
    script.write_text(SCRIPT)
    r = run_script(str(script), str(run), *args, env=env or {})
    return r, [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]


@pytest.mark.parametrize("mode,keep", [("off", 2), ("process", 2), ("off", 1)])
def test_a_kill_between_superseding_and_committing_commits_the_new_save(tmp_path, mode, keep):
    straight, lines = _run(tmp_path, tmp_path / "straight", mode, str(keep))
    assert straight.returncode == 0, straight.stderr[-3000:]
    final = lines[-1]
    run = tmp_path / "run"
    r, _ = _run(tmp_path, run, mode, str(keep),
                env={"UNBROKEN_KILL_AT": "superseded-moved@2"})
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    assert not (run / "gen-000000002").exists()
    assert [n.split("-")[:3] for n in os.listdir(run / "aside")] == [
        ["gen", "000000002", "superseded"]]
    assert any(n.startswith(".staging-000000002-") for n in os.listdir(run))
    again, lines = _run(tmp_path, run, mode, str(keep))
    assert again.returncode == 0, again.stderr[-3000:]
    assert lines == [final]  # the new save of step 2: its lr, its weights, bitwise
    assert final["lr"] == 0.25 and "superseded" not in again.stderr
    assert not [n for n in os.listdir(run) if n.startswith(".staging-")]


def test_a_kill_at_any_operation_of_a_superseding_save_of_the_only_generation(tmp_path):
    """Every mutating I/O operation of the save of step 2 again (its only generation kept:
    ``Keep(last=1)``) killed in turn: the restore gives step 2, as saved first (lr 0.5) or
    again (lr 0.25), never step 0."""
    straight, lines = _run(tmp_path, tmp_path / "straight", "off", "1")
    assert straight.returncode == 0, straight.stderr[-3000:]
    first, last = lines[0]["ops"]
    seen = set()
    for k in range(first + 1, last + 1):
        run = tmp_path / f"run{k}"
        r, _ = _run(tmp_path, run, "off", "1", env={"UNBROKEN_KILL_AT_OP": str(k)})
        if r.returncode == 0:  # (an operation of the same number at another point)
            continue
        assert r.returncode == -signal.SIGKILL, (k, r.stderr[-3000:])
        again, out = _run(tmp_path, run, "off", "1")
        assert again.returncode == 0, (k, again.stderr[-3000:])
        assert out[-1]["step"] == 2 and out[-1]["lr"] in (0.5, 0.25), (k, out)
        seen.add(out[-1]["lr"])
    assert seen == {0.5, 0.25}  # (the sweep reached both sides of the rename)
