"""unbroken: resume an interrupted PyTorch training run exactly as if it had never stopped,
and prove it.

The names below are imported on first use (PEP 562), not with the package: a process that
needs only part of it (the persisting process, `persist._worker`, which writes files and
never touches a tensor) does not pay for importing torch."""

from __future__ import annotations

import importlib

# typing.TYPE_CHECKING without importing typing (~8 ms): the command line installs its
# Ctrl-C handler only once this package is imported (`_launch`)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .checkpointer import Checkpointer
    from .data import Packer, ResumableLoader, ResumableSampler, seeded
    from .errors import (
                         CommitConflict,
                         CorruptCheckpoint,
                         IdentityMismatch,
                         MissingState,
                         NoCheckpoint,
                         SaveFailed,
                         StateMismatch,
                         StoreLocked,
                         UnbrokenError,
                         UnbrokenWarning,
                         UnsupportedSetup,
                         UnsupportedValue,
                         UpdateBoundaryError,
    )
    from .state.identity import Identity
    from .state.parts import PerRank, Stateful
    from .state.rng import fork_rng
    from .store.retention import Keep
    from .tools.export import verify_export

__version__ = "0.1.0"

# each public name -> the module it lives in
_WHERE = {
    "Checkpointer": ".checkpointer",
    "Packer": ".data", "ResumableLoader": ".data", "ResumableSampler": ".data",
    "seeded": ".data",
    **dict.fromkeys(("CommitConflict", "CorruptCheckpoint", "IdentityMismatch",
                     "MissingState", "NoCheckpoint", "SaveFailed", "StateMismatch",
                     "StoreLocked", "UnbrokenError", "UnbrokenWarning", "UnsupportedSetup",
                     "UnsupportedValue", "UpdateBoundaryError"), ".errors"),
    "Identity": ".state.identity",
    "PerRank": ".state.parts", "Stateful": ".state.parts",
    "fork_rng": ".state.rng",
    "Keep": ".store.retention",
    "verify_export": ".tools.export",
}

__all__ = [
    "Checkpointer",
    "CommitConflict",
    "CorruptCheckpoint",
    "Identity",
    "IdentityMismatch",
    "Keep",
    "MissingState",
    "NoCheckpoint",
    "Packer",
    "PerRank",
    "ResumableLoader",
    "ResumableSampler",
    "SaveFailed",
    "StateMismatch",
    "Stateful",
    "StoreLocked",
    "UnbrokenError",
    "UnbrokenWarning",
    "UnsupportedSetup",
    "UnsupportedValue",
    "UpdateBoundaryError",
    "fork_rng",
    "seeded",
    "verify_export",
    "__version__",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'unbroken' has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value  # (looked up once)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
