"""`inputs.check_options`: the Checkpointer's options that take only some values are refused
by name before anything is opened (no run folder, no lock)."""

from __future__ import annotations

import math
import os

import pytest
import torch

import unbroken
from unbroken.inputs import check_options

BAD = [
    ({"async_save": "threads"}, "async_save='threads'"),
    ({"async_save": 1.5}, "async_save=1.5"),
    ({"read_back": "later"}, "read_back='later'"),
    ({"async_save": True, "async_timeout": 0}, "async_timeout=0"),
    ({"async_timeout": math.inf}, "async_timeout=inf"),
    ({"async_save": True, "async_timeout": math.nan}, "async_timeout=nan"),
    ({"read_back": "sync", "persist_share": 0.5}, "persist_share paces"),
    ({"async_save": True, "persist_share": 0.0}, "persist_share"),
    ({"every": 0}, "every=0"),
    ({"every": 2.0}, "every=2.0"),
    ({"every": True}, "every=True"),
    ({"trace_hash_every": 0}, "trace_hash_every=0"),
]


@pytest.mark.parametrize(("options", "named"), BAD)
def test_a_bad_option_is_refused_by_name_before_the_folder_is_made(tmp_path, options, named
                                                                    ) -> None:
    root = tmp_path / "run"
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(".", r"\.")):
        unbroken.Checkpointer(root, model=torch.nn.Linear(2, 2), **options)
    assert not os.path.exists(root)


def test_what_the_options_allow() -> None:
    assert check_options(False, "background", 600.0, None, None, 10) is True
    assert check_options(False, "sync", 600.0, None, 5, 1) is False
    assert check_options("process", "background", 1.0, 0.25, 1, 3) is False
    assert check_options(True, "sync", 1.0, None, None, 10) is False
