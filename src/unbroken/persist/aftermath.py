"""What a save left behind when its persisting process died before it replied
(``async_save="process"``: SIGKILL, an out-of-memory kill). The save is a `SaveFailed` either
way (`persist.process`), but the run goes on: the writer, which still holds the run's lock,
looks at the generation itself, as the thread mode's read-back would have, so that the next
save builds only on a generation that is committed and verified.

What the persisting process may have left: nothing (it died before its commit: a staging
folder, debris that listing ignores and the next writer removes); the generation committed,
read back or not; or, for a save of the same step again, the generation it was to supersede
moved aside and the new one not in its place. A generation in place that verifies (every
byte hashed again here: the dead process's verdict died with it) is the run's newest; one
that does not is moved aside as the read-back does; an earlier generation of the same step
that the save moved aside is put back."""

from __future__ import annotations

from ..errors import UnbrokenError
from ..store.aside import ASIDE_REASONS
from ..store.generations import GenerationInfo, GenerationStore, generation_name
from ..store.verifying import UNREADABLE
from ..writer import RunWriter


def settle_died_save(store: GenerationStore, writer: RunWriter, step: int,
                     again: bool) -> tuple[GenerationInfo | None, str]:
    """(The writer, holding the lock, after the persisting process that had the save of
    generation ``step`` ended without replying.) The generation ``step`` now in place when it
    is committed and verifies (else None), and a sentence saying what was found and done.
    ``again``: the save was of the step saved last (it superseded that generation)."""
    try:
        return _settle(store, writer, step, again)
    except (OSError, UnbrokenError) as e:  # (nothing is counted on: as if not committed)
        return None, (f"generation {step} could not be checked ({e}); the next save does "
                      "not build on it, and a restore verifies it")


def _settle(store: GenerationStore, writer: RunWriter, step: int,
            again: bool) -> tuple[GenerationInfo | None, str]:
    info = store.scan_one(step)
    name = generation_name(step)
    if info.ok:
        why = store.verified(info)
        if why is None:
            # (its rename may not have been made durable yet: the dead process's last step)
            store.fs.fsync_dir(store.root)
            which = (f"{name} (this save's, or the one of the same step it was to supersede)"
                     if again else name)
            return info, (f"{which} is committed and verifies (every byte read back); the "
                          "next save builds on it")
        found = (f"{name} was committed but does not read back as written ({why}): "
                 + _set_aside(store, writer, info, "corrupt"))  # (as the read-back does)
    elif info.status == UNREADABLE:  # (this machine's: not judged, left as it is)
        found = f"{name} could not be read ({info.reason})"
    elif store.present(info):  # (a folder no commit leaves: refused, as a restore would)
        found = f"{name} is {info.status} ({info.reason}): " + _set_aside(
            store, writer, info, info.status if info.status in ASIDE_REASONS else "corrupt")
    else:
        found = f"{name} was not committed"
    if again and not store.present(info):
        found += _put_back(store, step)
    return None, found + "; the next save builds on the newest generation verified before"


def _set_aside(store: GenerationStore, writer: RunWriter, info: GenerationInfo,
               why: str) -> str:
    """Move ``info`` aside (`RunWriter.set_aside`: where that fails it warns, and the next
    save tries again before anything else); what became of it."""
    writer.set_aside(info, why)
    if store.present(info):
        return "it could not be moved aside (tried again at the next save; restore refuses it)"
    return "moved aside"


def _put_back(store: GenerationStore, step: int) -> str:
    """A save of the same step again moves the generation it supersedes aside just before its
    own rename: when it died between the two, that generation is the step's last verified
    state, and goes back in place (verified again before any use)."""
    prefix = f"{generation_name(step)}-superseded-"
    moved = [e for e in store.aside() if e.name.startswith(prefix)]
    if not moved:
        return ""
    try:
        store.put_back(moved[-1].path, step)  # (the newest: we held the lock since)
    except (OSError, UnbrokenError) as e:
        return (f"; the generation of the same step it was to supersede could not be put "
                f"back from {moved[-1].path} ({e}): move it back to {generation_name(step)} "
                "by hand")
    return "; the generation of the same step it was to supersede is back in place"
