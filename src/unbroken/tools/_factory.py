"""``--factory MODULE:FUNCTION``: a user's function that builds what a command needs (a model
for `verify-export`, the training objects for `verify --deep --factory`)."""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from .._runview import UsageError
from ..errors import UnbrokenError


def load_factory(spec: str) -> Callable[..., Any]:
    """The callable ``spec`` names; `UsageError` (exit 2) naming what is wrong. Calling it
    turns an exception of the user's code into an `UnbrokenError` naming ``spec`` (the cause
    kept as ``__cause__``): the factory failed, not unbroken."""
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

    @functools.wraps(found)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return found(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 -- the user's code: any failure is theirs
            raise UnbrokenError(
                f"--factory {spec}: the factory raised {type(e).__name__}: {e!s:.500}; fix "
                f"{spec} (it runs in this process, from the current folder or the Python "
                "path) and run again") from e
    return call
