"""Identity binding under attack: tokenizers equal in vocab but not in encoding, data behind
symlinks, configs too big, too deep or of the wrong type, and legacy entries."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from unbroken.errors import IdentityMismatch, UnbrokenWarning, UnsupportedValue
from unbroken.state import _identity_json
from unbroken.state.identity import Identity, IdentityArgumentError, check_identity
from unbroken.state.jsontext import dumps_json

transformers = pytest.importorskip("transformers")

VOCAB = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "[UNK]": 5, "[E]": 6, "[P]": 7}
MERGES = [("a", "b"), ("b", "c")]


def fp(**kw: object) -> dict[str, Any]:
    return Identity(**kw).fingerprint()  # type: ignore[arg-type]


def backend(merges: list[tuple[str, str]] = MERGES, lower: bool = False,
            split: bool = True) -> Tokenizer:
    t = Tokenizer(models.BPE(vocab=dict(VOCAB), merges=merges, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace() if split else pre_tokenizers.Metaspace()
    if lower:
        t.normalizer = normalizers.Lowercase()
    return t


def hf(t: Tokenizer | None = None, **kw: Any) -> Any:
    kw = {"unk_token": "[UNK]", "eos_token": "[E]", "pad_token": "[P]", **kw}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t or backend(), **kw)


def refused(saved: dict[str, Any], now: dict[str, Any]) -> str:
    with pytest.raises(IdentityMismatch) as e:
        check_identity(saved, now, intent="continue")
    return str(e.value)


# Each changes what the tokenizer encodes to (or how it pads), never its vocab.
MUTATIONS = {
    "merges": (lambda: hf(backend(merges=MERGES[::-1])), "tokenizer.backend.model.merges"),
    "normalizer": (lambda: hf(backend(lower=True)),
                   'tokenizer.backend.normalizer: saved null, now {"type": "Lowercase"}'),
    "pre_tokenizer": (lambda: hf(backend(split=False)), "tokenizer.backend.pre_tokenizer"),
    "padding_side": (lambda: hf(padding_side="left"),
                     'tokenizer.settings.padding_side: saved "right", now "left"'),
    "truncation_side": (lambda: hf(truncation_side="left"),
                        "tokenizer.settings.truncation_side"),
    "model_max_length": (lambda: hf(model_max_length=8),
                         "tokenizer.settings.model_max_length"),
    "eos/pad swapped": (lambda: hf(eos_token="[P]", pad_token="[E]"),
                        "tokenizer.settings.special_tokens_map"),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_tokenizer_mutation_with_same_vocab_is_refused_and_named(name: str) -> None:
    make, named = MUTATIONS[name]
    other = make()
    assert other.get_vocab() == hf().get_vocab()  # the old fingerprint could not tell
    msg = refused(fp(tokenizer=hf()), fp(tokenizer=other))
    assert named in msg, msg
    assert "allow=['tokenizer']" in msg


def test_unchanged_tokenizer_rebuilt_or_reloaded_is_accepted(tmp_path: Path) -> None:
    a = fp(tokenizer=hf())
    assert a["tokenizer"]["kind"] == "hf-tokenizer"
    assert "value" not in a["tokenizer"]  # the serialization is digested per key, not kept
    check_identity(a, fp(tokenizer=hf()), intent="continue")
    hf().save_pretrained(tmp_path)
    loaded = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path)
    check_identity(a, fp(tokenizer=loaded), intent="continue")
    check_identity(a, json.loads(dumps_json(a)), intent="continue")  # as a manifest holds it


def test_bare_tokenizers_object_covers_merges() -> None:
    a = fp(tokenizer=backend())
    assert a["tokenizer"]["kind"] == "hf-tokenizer"
    assert "merges" in refused(a, fp(tokenizer=backend(merges=MERGES[::-1])))


class SavesFiles:
    """A slow-tokenizer stand-in: no backend, but ``save_pretrained`` and ``get_vocab``."""

    def __init__(self, lower: bool) -> None:
        self.lower = lower

    def get_vocab(self) -> dict[str, int]:
        return dict(VOCAB)

    def save_pretrained(self, folder: str) -> None:
        Path(folder, "tokenizer_config.json").write_text(json.dumps({"do_lower_case":
                                                                     self.lower}))
        Path(folder, "spm.model").write_bytes(b"\x00\x01")


def test_tokenizer_without_backend_is_fingerprinted_by_its_saved_files() -> None:
    a = fp(tokenizer=SavesFiles(False))
    assert "save_pretrained" in a["tokenizer"]["summary"]
    check_identity(a, fp(tokenizer=SavesFiles(False)), intent="continue")
    msg = refused(a, fp(tokenizer=SavesFiles(True)))
    assert ('tokenizer.files.tokenizer_config.json: saved {"do_lower_case": false}, now '
            '{"do_lower_case": true}') in msg


def test_older_vocab_only_entry_is_compared_on_what_it_recorded() -> None:
    tok = hf()
    special = list(tok.all_special_tokens)
    legacy_payload = {"class": type(tok).__name__, "vocab": tok.get_vocab(),
                      "special_tokens": special}
    legacy = {"tokenizer": {"kind": "vocab", "hash": _identity_json.xxh(
        dumps_json(legacy_payload)), "summary": f"{type(tok).__name__} with 8 tokens"}}
    with pytest.warns(UnbrokenWarning, match="older unbroken.*merges"):
        check_identity(legacy, fp(tokenizer=tok), intent="continue")
    other = hf(eos_token="[P]", pad_token="[E]")  # special tokens in another order
    msg = refused(legacy, fp(tokenizer=other))
    assert "older unbroken's vocab-only fingerprint" in msg and "full serialization" in msg


def test_plain_get_vocab_object_keeps_its_old_hash() -> None:
    class Tok:
        all_special_tokens = ["<eos>"]

        def get_vocab(self) -> dict[str, int]:
            return {"a": 0}

    entry = fp(tokenizer=Tok())["tokenizer"]
    payload = {"class": "Tok", "vocab": {"a": 0}, "special_tokens": ["<eos>"]}
    assert entry["kind"] == "vocab" and entry["hash"] == _identity_json.xxh(dumps_json(payload))


def make_linked_data(tmp_path: Path) -> tuple[Path, Path]:
    store, data = tmp_path / "bigdisk", tmp_path / "data"
    store.mkdir()
    data.mkdir()
    (store / "train.bin").write_bytes(b"A" * 100)
    os.symlink(store / "train.bin", data / "train.bin")
    return store, data


def test_data_behind_a_symlink_is_hashed_by_content(tmp_path: Path) -> None:
    store, data = make_linked_data(tmp_path)
    before = fp(data=data)
    assert before["data"]["files"] == 1 and before["data"]["symlinks"] == 1
    (store / "train.bin").write_bytes(b"B" * 100)
    assert "data: saved dir data/" in refused(before, fp(data=data))
    copies = tmp_path / "copies"
    copies.mkdir()
    (copies / "train.bin").write_bytes(b"B" * 100)  # a folder of copies hashes alike
    copy_entry = fp(data=copies)["data"]
    assert copy_entry["hash"] == fp(data=data)["data"]["hash"]
    assert "symlinks" not in copy_entry


def test_symlinked_folder_is_followed_and_dangling_link_recorded(tmp_path: Path) -> None:
    store, data = make_linked_data(tmp_path)
    (store / "shard").mkdir()
    (store / "shard" / "x").write_bytes(b"1")
    os.symlink(store / "shard", data / "shard")
    os.symlink(tmp_path / "not-yet", data / "later")
    first = fp(data=data)["data"]
    assert first["files"] == 2
    (store / "shard" / "x").write_bytes(b"2")
    second = fp(data=data)["data"]
    assert second["hash"] != first["hash"]
    (tmp_path / "not-yet").write_bytes(b"")  # the dangling link now points at a file
    assert fp(data=data)["data"]["hash"] != second["hash"]


@pytest.mark.parametrize("kind", ["cycle", "ancestor"])
def test_link_loops_are_typed_errors_naming_the_link(tmp_path: Path, kind: str) -> None:
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    if kind == "cycle":
        os.symlink(data / "b", data / "a")
        os.symlink(data / "a", data / "b")
    else:
        os.symlink(data, data / "sub" / "up")
    with pytest.raises(UnsupportedValue, match="/data/(a|sub/up)"):
        fp(data=data)


def test_dir_entry_from_before_symlinks_were_followed_says_so(tmp_path: Path) -> None:
    _, data = make_linked_data(tmp_path)
    now = fp(data=data)
    old = {"data": {k: v for k, v in now["data"].items() if k != "symlinks"} | {"hash": "0"}}
    assert "older unbroken hashed a symlink's target text" in refused(old, now)


def nested(levels: int) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    cur = tree
    for _ in range(levels):
        cur["k"] = {}
        cur = cur["k"]
    return tree


def test_config_values_json_cannot_hold_are_typed_and_named() -> None:
    with pytest.raises(UnsupportedValue, match=r"config\.run\.seed: an int of \d+ bits"):
        Identity(config={"run": {"seed": 10 ** 5000}})
    Identity(config={"seed": 10 ** 4000})  # under Python's 4300-digit limit
    with pytest.raises(UnsupportedValue, match=r"config\.k\.k.*nested deeper than 100"):
        Identity(config=nested(3000))
    Identity(config=nested(_identity_json.MAX_DEPTH))
    loop: dict[str, Any] = {"a": 1}
    loop["self"] = loop
    with pytest.raises(UnsupportedValue, match="config.self.self"):
        Identity(config=loop)


def test_large_config_mismatch_names_changed_keys_and_values() -> None:
    a = {f"layer_{i}_dropout": 0.1 for i in range(3000)}
    b = {**a, "layer_1234_dropout": 0.2}
    saved = json.loads(dumps_json(fp(config=a)))
    assert "value" not in saved["config"]
    # The hash is the same canonical-JSON hash as before: older checkpoints still compare.
    assert saved["config"]["hash"] == _identity_json.xxh(dumps_json(a))
    assert "config.layer_1234_dropout: saved 0.1, now 0.2" in refused(saved, fp(config=b))
    c = {**b, **{f"layer_{i}_dropout": 0.3 for i in range(10)}, "blob": "x" * 20000}
    msg = refused(saved, fp(config=c))
    assert "config.blob: saved absent, now xxh3" in msg and "(and 7 more differing keys)" in msg
    assert len(dumps_json(saved)) < 256 * 1024


def test_key_digest_map_stays_bounded() -> None:
    wide = {f"k{i}": i for i in range(10000)}  # too many keys to name: the hash alone decides
    entry = fp(config=wide)["config"]
    assert "keys" not in entry and "value" not in entry
    deep_wide = {"model": {f"k{i}": "v" * 40 for i in range(5000)}, "lr": 1}
    keys = fp(config=deep_wide)["config"]["keys"]
    assert set(keys) == {"config.model", "config.lr"}  # the wide dict stays one path
    with pytest.raises(IdentityMismatch, match="config.model: saved xxh3"):
        check_identity(fp(config=deep_wide),
                       fp(config={**deep_wide, "model": {"k0": "w"}}), intent="continue")


class RaisingVocab:
    def get_vocab(self) -> dict[str, int]:
        raise RuntimeError("boom")


class ListVocab:
    def get_vocab(self) -> list[str]:
        return ["a"]


@pytest.mark.parametrize("kw, named", [
    ({"config": "lr=1"}, "Identity(config=...): a str"),
    ({"config": [("lr", 1)]}, "Identity(config=...): a list"),
    ({"tokenizer": object()}, "Identity(tokenizer=...): a object"),
    ({"tokenizer": 12}, "Identity(tokenizer=...): a int"),
    ({"tokenizer": b"x"}, "Identity(tokenizer=...): a bytes"),
    ({"data": RaisingVocab()}, "Identity(data=...): a RaisingVocab"),
])
def test_wrong_typed_arguments_are_typed_errors(kw: dict[str, Any], named: str) -> None:
    with pytest.raises(IdentityArgumentError) as e:
        Identity(**kw)
    assert isinstance(e.value, TypeError) and isinstance(e.value, UnsupportedValue)
    assert named in str(e.value) and "takes" in str(e.value)


def test_tokenizer_whose_get_vocab_fails_is_a_typed_error() -> None:
    with pytest.raises(UnsupportedValue, match=r"tokenizer: .*RaisingVocab.*RuntimeError: boom"):
        Identity(tokenizer=RaisingVocab())
    with pytest.raises(UnsupportedValue, match=r"tokenizer: ListVocab.get_vocab\(\) returned a "
                                               "list"):
        Identity(tokenizer=ListVocab())


def test_no_warning_for_matching_full_entries() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_identity(fp(tokenizer=hf()), fp(tokenizer=hf()), intent="continue")


def test_malformed_key_records_from_an_edited_manifest_do_not_crash_the_message() -> None:
    big = {f"k{i}": "v" * 10 for i in range(2000)}
    saved = fp(config=big)
    saved["config"]["keys"]["config.k1"] = [5]
    saved["config"]["keys"]["config.k2"] = "x"
    saved["config"]["hash"] = "0" * 32
    msg = refused(saved, fp(config=big))
    assert "config.k1: saved absent, now" in msg and "config.k2: saved absent" in msg
