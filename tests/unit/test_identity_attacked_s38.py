"""Identity as an outside review found it (session 38): a tokenizer without a fast backend,
fingerprinted from the files ``save_pretrained`` writes, was refused when loaded again (its
``tokenizer_config.json`` records how it was loaded: ``is_local``, ``local_files_only``, and
null defaults a fresh one leaves out); a data folder holding the run folder changed with every
save, so no continuation matched; ``~/`` paths were taken as revision labels."""

from __future__ import annotations

import pytest
import torch
from test_identity_attacked_s28 import _resume

import unbroken
from unbroken.errors import IdentityMismatch, UnsupportedValue
from unbroken.state.identity import Identity


def test_a_slow_tokenizer_loaded_again_is_the_same_and_a_token_added_is_not(tmp_path):
    transformers = pytest.importorskip("transformers")
    slow = transformers.ByT5Tokenizer  # (no fast backend: its saved files are its identity)
    folder = tmp_path / "tok"
    slow().save_pretrained(folder)
    assert _resume(tmp_path / "a", Identity(tokenizer=slow()),
                   Identity(tokenizer=slow.from_pretrained(folder))) == 1
    assert _resume(tmp_path / "b", Identity(tokenizer=slow.from_pretrained(folder)),
                   Identity(tokenizer=slow.from_pretrained(folder, local_files_only=True))) == 1
    grown = slow()
    grown.add_special_tokens({"additional_special_tokens": ["<new>"]})
    with pytest.raises(IdentityMismatch, match="tokenizer"):
        _resume(tmp_path / "c", Identity(tokenizer=slow()), Identity(tokenizer=grown))


def test_a_data_folder_holding_the_run_is_refused_when_the_checkpointer_is_built(tmp_path):
    (tmp_path / "train.txt").write_text("data")
    with pytest.raises(UnsupportedValue, match="holds the run folder"):
        unbroken.Checkpointer(tmp_path / "runs" / "exp1", model=torch.nn.Linear(2, 2),
                              identity=Identity(data=tmp_path))
    # (a folder beside the run is hashed as before)
    (tmp_path / "data").mkdir()
    unbroken.Checkpointer(tmp_path / "runs" / "exp2", model=torch.nn.Linear(2, 2),
                          identity=Identity(data=tmp_path / "data")).close()


def test_a_home_path_is_hashed(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "train.jsonl").write_text("{}")
    entry = Identity(data="~/train.jsonl").fingerprint()["data"]
    assert entry["kind"] == "file", entry
    (tmp_path / "train.jsonl").write_text('{"x": 1}')
    assert Identity(data="~/train.jsonl").fingerprint()["data"]["hash"] != entry["hash"]
