"""unbroken: resume an interrupted PyTorch training run exactly as if it had never stopped,
and prove it."""

from __future__ import annotations

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
from .state.parts import Stateful
from .store.retention import Keep
from .tools.export import verify_export

__version__ = "0.1.0"

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
    "seeded",
    "verify_export",
    "__version__",
]
