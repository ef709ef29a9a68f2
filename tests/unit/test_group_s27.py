"""The save group torn down at ``close()`` (session 27): `Group.destroy` kept its reference
to the gloo group, whose threads then lived until the interpreter's teardown, where a rank
of a finished job sometimes aborted ("terminate called without an active exception", about
1 job in 15 of 2 ranks). Now nothing keeps the destroyed group alive (checked in a fresh
process: a job of one rank, gloo on loopback)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import datetime, gc, socket, weakref
import torch.distributed as dist
from unbroken.dist.group import background_group
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=20))
group = background_group(None, 30.0)
ref = weakref.ref(group.pg)
group.destroy()
gc.collect()
print("gone" if ref() is None else "alive")
dist.destroy_process_group()
"""


def test_a_destroyed_save_group_is_not_kept_alive():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "gone", done.stdout
