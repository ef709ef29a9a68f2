"""A kill while a save of the same step replaces its generation (the earlier save of that step
moved aside as superseded, the new one not yet renamed in): the restore takes the generation
before it, which replays the updates since (the superseded state was replaced, as after an
end-of-epoch scheduler step, and is not one the run continues from), and says so, naming the
superseded save it keeps in aside/ (it was silent)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import unbroken

SCRIPT = textwrap.dedent('''
    import sys, torch, unbroken
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ck = unbroken.Checkpointer(sys.argv[1], model=model, optimizer=opt, scheduler=sched,
                               async_save=sys.argv[2] if sys.argv[2] != "off" else False)
    for step in (1, 2):
        model(torch.ones(3)).sum().backward()
        opt.step()
        opt.zero_grad()
        ck.step_done(step)
        ck.save()
        ck.wait()
    sched.step()  # (the end of an epoch: step 2 saved again)
    ck.save()
    ck.wait()
    ck.close()
''')


@pytest.mark.parametrize("mode", ["off", "process"])
def test_a_kill_between_superseding_and_committing_is_said_at_restore(tmp_path, mode):
    run = tmp_path / "run"
    env = {**os.environ, "UNBROKEN_KILL_AT": "superseded-moved@2"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(run), mode], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert not (run / "gen-000000002").exists()
    aside = os.listdir(run / "aside")
    assert len(aside) == 1 and aside[0].startswith("gen-000000002-superseded-")
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ck = unbroken.Checkpointer(str(run), model=model, optimizer=opt, scheduler=sched)
    with pytest.warns(unbroken.UnbrokenWarning,
                      match=r"generation 2 was being saved again.*superseded.*continuing "
                            r"from generation 1") as said:
        assert ck.restore() == 1
    assert said[0].filename == __file__
    ck.close()
