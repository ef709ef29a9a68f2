"""A model's names across torch.compile: a compiled model (or a compiled submodule) names
its tensors with ``_orig_mod.`` segments, which the model as served has not."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_COMPILED = re.compile(r"(?:^|(?<=\.))_orig_mod\.")


def served_name(name: str) -> str:
    """A tensor's name in the model as it is served: without the ``_orig_mod.`` segments
    torch.compile puts in the names of a compiled model (or of compiled submodules)."""
    return _COMPILED.sub("", name)


def under_live_names(saved: Mapping[str, Any], live: Mapping[str, Any],
                     partial: bool = False) -> Mapping[str, Any]:
    """``saved`` under the live model's names where the two differ only by torch.compile's
    ``_orig_mod.`` segments (a warm start from a compiled model into an uncompiled one, or
    back), one to one; else ``saved`` as it is. ``partial`` (a warm start keeping some names
    fresh, which either side may lack): every saved name whose served name is one live name
    alone takes it, the others stay as they are."""
    by_served = {served_name(k): k for k in live}
    if partial:
        renamed = {by_served.get(served_name(k), k): v for k, v in saved.items()}
    else:
        renamed = {by_served.get(served_name(k), ""): v for k, v in saved.items()}
    if len(by_served) != len(live) or "" in renamed or len(renamed) != len(saved):
        return saved
    return renamed
