"""The environment variables through which the proof harness (`proof.checkplan`) steers a
training process: where to save and where to deliver a signal. (Kept apart from the modules
that read them, which import torch: the command line builds them without it.)"""

from __future__ import annotations

SAVE_AT_ENV = "UNBROKEN_SAVE_AT"  # extra saves at these updates ("3,7")
SIGNAL_AT_ENV = "UNBROKEN_SIGNAL_AT"  # the harness's "send SIGTERM inside update K"
