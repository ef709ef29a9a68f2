"""What the store writes as one artifact (`Source`): chunks of bytes, or a file that already
exists and is linked into the new generation (`Linked`, an incremental generation's stable
file, `state.incremental`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass
class Linked:
    """An artifact that already exists (``source``): linked into the new generation; when
    linking fails, ``write()`` gives the chunks that write it anew, which must hash as the
    source did. ``linked``: set by the store once it was linked, not written. ``ident``: see
    below."""

    source: str
    size: int
    xxh3_128: str
    write: Callable[[], Iterable[memoryview | bytes]]
    linked: bool = False
    # the source's identity in its store when it was last verified (the backend's ``ident``;
    # empty: unknown): a copy an object store makes holding the same checksum is those bytes
    ident: tuple[object, ...] = ()


Source = Iterable[memoryview | bytes] | Linked  # what the store writes as one artifact
