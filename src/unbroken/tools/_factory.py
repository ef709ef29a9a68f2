"""``--factory MODULE:FUNCTION``: a user's function that builds what a command needs (a model
for `verify-export`, the training objects for `verify --deep --factory`)."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from .._runview import UsageError


def load_factory(spec: str) -> Any:
    """The callable ``spec`` names; `UsageError` (exit 2) naming what is wrong."""
    module, _, name = spec.partition(":")
    if not module or not name.isidentifier():
        raise UsageError(f"--factory {spec!r}: MODULE:FUNCTION, e.g. mypkg.models:build")
    if os.getcwd() not in sys.path:  # as `python -m` would: the user's modules beside them
        sys.path.insert(0, os.getcwd())
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"--factory {spec}: {e}") from None
    if not callable(found):
        raise UsageError(f"--factory {spec}: not callable")
    return found
