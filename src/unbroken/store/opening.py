"""A run's location -> its store: a local folder (`generations.GenerationStore`) or a URL on
an object store that fsspec resolves (`objects.ObjectStore`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .backends.objects import ObjectFS
from .cache import ReadCache
from .generations import GenerationStore
from .objects import ObjectStore


def is_url(location: object) -> bool:
    """Whether ``location`` names a run on an object store (``scheme://...``, not
    ``file://``)."""
    return isinstance(location, str) and "://" in location and \
        not location.startswith("file://")


def location_key(location: str | os.PathLike[str]) -> str:
    """``location`` as `open_store` names the run it opens (a local folder's absolute path, a
    ``file://`` one's too; a URL without a trailing ``/``): what must be the same on every
    rank of a job, where each rank writes into the leader's staging folder by its path."""
    if is_url(location):
        return str(location).rstrip("/")
    path = os.fspath(location)
    return os.path.abspath(path[len("file://"):] if path.startswith("file://") else path)


def open_store(location: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None,
               cache_dir: str | os.PathLike[str] | None = None) -> GenerationStore:
    """The store of a run: a local folder, or a URL that fsspec resolves (its standard
    configuration and environment apply: ``AWS_*``, ``FSSPEC_S3_*``, ...; ``storage_options``
    are passed to the filesystem, e.g. ``{"endpoint_url": ..., "key": ..., "secret": ...}``).
    ``cache_dir``: a local `ReadCache` for restores from an object store."""
    if not is_url(location):
        path = os.fspath(location)
        return GenerationStore(path[len("file://"):] if path.startswith("file://") else path)
    import fsspec

    url = str(location).rstrip("/")
    scheme, _, rest = str(location).partition("://")
    if not rest.strip("/"):  # ("s3://" stripped is "s3:", which fsspec takes for a local path)
        raise ValueError(f"{location}: names no bucket or path after {scheme}://; give the "
                         f"run's prefix (e.g. {scheme}://bucket/runs/exp1)")
    if "?" in url:
        raise ValueError(f"{url}: a run URL names a prefix; a query ('?versionId=...') would "
                         "send writes outside it")
    try:
        # No listing cache: a generation another process committed, or a lease it took, must
        # show at once (a cached listing hid a live lease, and two writers held the run).
        fs, _ = fsspec.core.url_to_fs(url, **{"skip_instance_cache": True,
                                              "use_listings_cache": False,
                                              **(storage_options or {})})
    except (ImportError, ValueError) as e:
        raise ValueError(f"{url}: no filesystem for this URL ({e}); install the fsspec "
                         "backend for it (s3fs for s3://, gcsfs for gs://, adlfs for az://)"
                         ) from None
    # The URL as the filesystem writes it back (memory://x is memory:///x): listings then
    # name objects under the same root.
    return ObjectStore(str(fs.unstrip_protocol(fs._strip_protocol(url))), ObjectFS(fs),
                       cache=ReadCache(cache_dir) if cache_dir is not None else None)
