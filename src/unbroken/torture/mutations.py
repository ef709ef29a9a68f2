"""The mutation catalogue the corruption fuzz draws from: every mutation by name, with its
weight. A case draws one by ``random.Random(f"{seed}:{case}")`` over the sorted names."""

from __future__ import annotations

from ._case import Catalogue
from .content_mutations import CONTENT
from .layout_mutations import LAYOUT
from .part_mutations import PARTS
from .value_mutations import VALUES

MUTATIONS: Catalogue = {**CONTENT, **LAYOUT, **VALUES, **PARTS}
