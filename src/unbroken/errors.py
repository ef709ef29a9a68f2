"""Typed errors. Every message names the file or key, what was expected, what was found,
and what to do about it."""

from __future__ import annotations


class UnbrokenError(Exception):
    """Base of every error unbroken raises on purpose."""


class MissingState(UnbrokenError):
    """A continuation needs a state part that the checkpoint does not hold."""


class IdentityMismatch(UnbrokenError):
    """Config, tokenizer or data identity of the checkpoint differs from the current run."""


class CorruptCheckpoint(UnbrokenError):
    """A generation (or every generation) failed verification: torn, truncated, edited."""


class NoCheckpoint(UnbrokenError):
    """A generation was asked for that does not exist."""


class StoreLocked(UnbrokenError):
    """Another live process holds the run folder's single-writer lock."""


class StateMismatch(UnbrokenError):
    """The saved state does not fit the live objects (keys, shapes, dtypes, parameter names)."""


class UnsupportedValue(UnbrokenError):
    """A state value has a type the no-pickle codec cannot store."""


class SaveFailed(UnbrokenError):
    """Writing a generation failed (disk full, I/O error); older generations are untouched and
    the next save may succeed."""


class UpdateBoundaryError(UnbrokenError):
    """A save or step marker arrived somewhere other than a completed-update boundary."""


class UnbrokenWarning(UserWarning):
    """Warnings that do not stop a run (e.g. a different environment: bitwise equality may not
    hold)."""
