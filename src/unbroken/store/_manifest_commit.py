"""Committing a generation's manifest on an object store, and, when its upload fails, finding
out whether it took effect all the same (the reply lost, a retry that found the first
attempt's object): `ObjectStore.publish` decides from that whether its upload folder goes."""

from __future__ import annotations

from collections.abc import Callable

from ..errors import CommitConflict
from .backends.objects import ObjectFS
from .manifest import MAX_MANIFEST_BYTES, Manifest


class Undecided(Exception):
    """Whether a manifest upload took effect cannot be told (the store does not answer)."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(str(cause))
        self.cause = cause


def commit_manifest(fs: ObjectFS, where: str, manifest: Manifest, upload: Callable[[], None],
                    was: tuple[object, ...] | None = None) -> None:
    """``upload()`` the manifest at ``where`` (creating it, or replacing the manifest whose
    `ObjectFS.ident` was ``was``); where that raised, return all the same if it was committed
    (`committed_anyway`)."""
    try:
        upload()
    except OSError as e:
        if not committed_anyway(fs, where, manifest, e, was):
            raise


def committed_anyway(fs: ObjectFS, where: str, manifest: Manifest, error: OSError,
                     was: tuple[object, ...] | None = None) -> bool:
    """After the manifest upload failed: whether it was committed all the same. Our manifest
    there: True. None there (creating), or still the replaced one (``was``): False (the
    upload goes). Another writer's, or none where one was replaced: `CommitConflict`. Cannot
    tell: `Undecided`, and the upload stays (the next writer removes it if it is debris),
    since deleting it could tear a committed generation."""
    try:
        there = bytes(fs.read_file(where, MAX_MANIFEST_BYTES))
        unchanged = was is not None and fs.ident(where) == was
    except FileNotFoundError:
        if isinstance(error, FileExistsError) or was is not None:  # someone else's doing
            raise CommitConflict(f"{where}: another writer is saving generation "
                                 f"{manifest.generation}; this save was not committed "
                                 "(two writers on one run: stop one)") from None
        return False
    except OSError as e:
        raise Undecided(e) from None
    if there == manifest.to_bytes():
        return True
    if unchanged:
        return False
    raise CommitConflict(
        f"{where}: another writer committed generation {manifest.generation} first; this "
        "save was not committed (two writers on one run: stop one)")
