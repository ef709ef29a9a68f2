"""Closing a Checkpointer after the training failed: its own error (a save's read-back that
failed beside the loop) must not replace the training's exception, which the framework
handles (Lightning's teardown, a Ctrl-C's exit); it was logged when it happened, and is
logged again here."""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("unbroken")


def close_after(failure: BaseException, close: Callable[[], None]) -> None:
    """``close()``, logging instead of raising an error of its own (``failure`` goes on)."""
    try:
        close()
    except Exception as e:  # noqa: BLE001 -- the training's exception wins
        log.error("after %s: closing the Checkpointer failed too: %s",
                  type(failure).__name__, e)
