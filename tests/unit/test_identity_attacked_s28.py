"""Identity as an outside review found it (session 28): a Transformers tokenizer's last call
(padding, truncation: set on its backend anew at every call) was fingerprinted, so a resume
that never called the tokenizer was refused; two Unicode forms of one text were named as
``saved "café", now "café"``; a Python float NaN lost its payload in the codec."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import unbroken
from unbroken.errors import CorruptCheckpoint, IdentityMismatch
from unbroken.state.codec import encode_tree
from unbroken.state.decoding import decode_tree
from unbroken.state.identity import Identity


def _resume(tmp_path: Path, saved: Identity, now: Identity) -> int:
    """Save step 1 under ``saved``, then restore under ``now``: the step restored."""
    model = torch.nn.Linear(2, 2)
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=model, identity=saved)
    ckpt.restore()
    ckpt.save(1)
    ckpt.close()
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=model, identity=now)
    try:
        return ckpt.restore()
    finally:
        ckpt.close()


def _fast_tokenizer(vocab: dict[str, int]) -> object:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]",
                                                pad_token="[PAD]")


VOCAB = {"[UNK]": 0, "[PAD]": 1, "a": 2, "b": 3}


def test_a_wrapped_tokenizers_last_call_is_not_its_identity(tmp_path: Path) -> None:
    used = _fast_tokenizer(VOCAB)
    used(["a b a"], truncation=True, max_length=2, padding="max_length")  # type: ignore[operator]
    assert used.backend_tokenizer.truncation is not None  # type: ignore[attr-defined]
    _resume(tmp_path, Identity(tokenizer=used), Identity(tokenizer=_fast_tokenizer(VOCAB)))
    # a real change of the wrapped tokenizer is still refused, by name
    with pytest.raises(IdentityMismatch, match="tokenizer"):
        _resume(tmp_path / "2", Identity(tokenizer=used),
                Identity(tokenizer=_fast_tokenizer({**VOCAB, "c": 4})))


def test_a_bare_tokenizers_own_truncation_is_still_its_identity(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models
    bare = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    truncating = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    truncating.enable_truncation(max_length=8)
    with pytest.raises(IdentityMismatch, match="truncation"):
        _resume(tmp_path, Identity(tokenizer=bare), Identity(tokenizer=truncating))


def test_two_unicode_forms_of_one_text_are_shown_escaped(tmp_path: Path) -> None:
    with pytest.raises(IdentityMismatch) as e:
        _resume(tmp_path, Identity(config={"name": "caf\u00e9"}),
                Identity(config={"name": "cafe\u0301"}))
    assert 'config.name: saved "caf\\u00e9", now "cafe\\u0301"' in str(e.value)
    with pytest.raises(IdentityMismatch) as e:  # texts that look different stay as they are
        _resume(tmp_path / "2", Identity(config={"name": "caf\u00e9"}),
                Identity(config={"name": "th\u00e9"}))
    assert 'config.name: saved "caf\u00e9", now "th\u00e9"' in str(e.value)


def _bits(x: float) -> int:
    return int.from_bytes(struct.pack("<d", x), "little")


@settings(max_examples=300, deadline=None)
@given(payload=st.integers(1, (1 << 52) - 1), sign=st.booleans())
def test_every_python_nan_round_trips_with_its_bits(payload: int, sign: bool) -> None:
    """Any NaN (quiet or signalling, any payload, either sign) comes back bit for bit."""
    bits = (sign << 63) | (0x7FF << 52) | payload
    nan = struct.unpack("<d", bits.to_bytes(8, "little"))[0]
    skeleton, tensors = encode_tree({"x": nan, "l": [nan]})
    back = decode_tree(skeleton, tensors)
    assert math.isnan(back["x"]) and _bits(back["x"]) == bits and _bits(back["l"][0]) == bits


def test_the_usual_nans_are_written_as_before() -> None:
    skeleton, _ = encode_tree({"a": float("nan"), "b": -float("nan"), "c": float("-inf")})
    assert skeleton == {"a": {"$t": "float", "v": "nan"}, "b": {"$t": "float", "v": "-nan"},
                        "c": {"$t": "float", "v": "-inf"}}


@pytest.mark.parametrize("entry", [
    {"$t": "float", "v": "nan", "bits": "3ff0000000000000"},  # 1.0: not a NaN
    {"$t": "float", "v": "nan", "bits": "fff8000000000001"},  # the other sign
    {"$t": "float", "v": "inf", "bits": "7ff8000000000001"},  # bits for an infinity
    {"$t": "float", "v": "nan", "bits": "7ff80000001"},
    {"$t": "float", "v": "nan", "bits": 5},
])
def test_nan_bits_that_do_not_fit_are_refused(entry: dict[str, object]) -> None:
    with pytest.raises(CorruptCheckpoint, match="malformed 'float' entry"):
        decode_tree({"x": entry}, {})


@pytest.mark.parametrize("data, warned", [
    ("/datasets/web/shard-000.bin", True), ("data/train.jsonl", True), ("./data", True),
    ("../shared/tokens", True), ("train-v3", False), ("org/dataset", False),
    ("org/dataset@v1.2", False)])
def test_a_path_that_does_not_exist_is_said_to_be_a_label(data: str, warned: bool) -> None:
    """Session 28: a mistyped path was recorded as a revision label in silence, and a later
    change of the data it meant went unseen."""
    import warnings

    from unbroken.errors import UnbrokenWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Identity(data=data)
    said = [w for w in caught if issubclass(w.category, UnbrokenWarning)
            and "no such file or folder" in str(w.message)]
    assert bool(said) == warned, [str(w.message) for w in caught]
