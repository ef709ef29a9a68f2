"""Settings for every test process (pytest's workers and every process they start).

OpenMP's idle threads wait passively. By default torch's OpenMP threads spin for a while
before they sleep; with two test workers on two cores, each training with two threads, the
spinning threads of one process take the cores the other's need, and the suite's small
training runs took up to four times as long as they do alone. A wait policy changes neither
the number of threads nor any result, only how an idle thread waits. Set here, before any
test imports torch (OpenMP reads it when it loads), and inherited by the xdist workers, the
zygote and every script the tests start."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
