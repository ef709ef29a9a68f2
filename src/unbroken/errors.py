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


class SharedFileFailed(SaveFailed):
    """A save failed on a file it did not write but linked (an incremental save; an object
    store copies it in place) from an earlier generation, at its read-back or when the link
    could not be made and the file written anew did not hash as the one it replaces: rot of
    the bytes that generation verified, which every generation linking the file shares, or a
    bad copy. The state saved is good: the save is written again with every file anew (at
    once where the state saved is still at hand, else by the next save)."""


class CommitConflict(SaveFailed):
    """Another writer committed the same generation first (two writers on one run on an
    object store): this save was not committed; the run holds the other writer's."""


class ReadOnlyRun(SaveFailed):
    """The run folder cannot be written (read-only media, no permission, a full disk, a
    filesystem without locks): restore works, saving raises this, naming the cause."""


class RunNotRestored(UnbrokenError):
    """A first save into a run folder that already holds generations, without ``restore()``:
    it would branch from, or silently overwrite the history of, the run that is there."""


class RunUnreadable(UnbrokenError):
    """A file or folder of the run could not be read for a reason of this machine, not of its
    content (permission denied, no file descriptors or memory left): nothing was judged
    corrupt or moved aside; fix the cause and run again."""


class ForeignGeneration(CorruptCheckpoint):
    """A generation written by another run than the one this folder holds (copied in):
    refused unless adopted explicitly with ``restore(adopt=True)``."""


class UpdateBoundaryError(UnbrokenError):
    """A save or step marker arrived somewhere other than a completed-update boundary."""


class UnsupportedSetup(UnbrokenError):
    """A setup whose continuation a generation would not capture exactly (a framework's:
    Lightning, the Transformers Trainer, Accelerate; a `ResumableLoader` collate_fn with a
    random generator of its own); raised before anything is trained."""


class UnbrokenWarning(UserWarning):
    """Warnings that do not stop a run (e.g. a different environment: bitwise equality may not
    hold)."""


def shown(value: object, width: int = 40) -> str:
    """``repr(value)`` cut to ``width`` characters, for messages about values read from files:
    repr of an int past 4300 digits raises ValueError, which would replace the message."""
    try:
        text = repr(value)
    except ValueError:
        text = (f"<an int of {value.bit_length()} bits>" if isinstance(value, int)
                else f"<a {type(value).__name__}>")
    return text[:width]
