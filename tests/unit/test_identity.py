"""Identity fingerprints, the continue / warm_start rules, and the environment record."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest

from unbroken.errors import IdentityMismatch, UnbrokenError, UnbrokenWarning
from unbroken.state import identity
from unbroken.state.environment import environment
from unbroken.state.identity import Identity, check_environment, check_identity
from unbroken.state.jsontext import dumps_json

CFG = {"lr": 0.001, "model": {"d_model": 64, "layers": [2, 2]}, "name": "exp"}


def fp(**kw: object) -> dict[str, Any]:
    return Identity(**kw).fingerprint()  # type: ignore[arg-type]


def make_tokenizer(root: Path) -> Path:
    (root / "tok" / "sub").mkdir(parents=True)
    (root / "tok" / "vocab.json").write_text('{"a": 0, "b": 1}')
    (root / "tok" / "sub" / "merges.txt").write_bytes(b"a b\n")
    return root / "tok"


def test_config_hash_ignores_key_order() -> None:
    reordered = {"name": "exp", "model": {"layers": [2, 2], "d_model": 64}, "lr": 0.001}
    a, b = fp(config=CFG), fp(config=reordered)
    assert a == b
    assert a["config"]["kind"] == "config" and a["config"]["value"] == CFG
    assert set(a) == {"config"}  # absent fields are omitted
    check_identity(a, b, intent="continue")


def test_changed_nested_config_names_key_path_and_values() -> None:
    changed = json.loads(json.dumps(CFG))
    changed["model"]["d_model"] = 128
    with pytest.raises(IdentityMismatch) as e:
        check_identity(fp(config=CFG), fp(config=changed), intent="continue",
                       where="runs/x/gen-000000500/MANIFEST.json")
    msg = str(e.value)
    assert "config.model.d_model: saved 64, now 128" in msg
    assert "runs/x/gen-000000500/MANIFEST.json" in msg
    assert "warm_start(...)" in msg and "allow=['config']" in msg


def test_int_and_float_config_values_differ() -> None:
    with pytest.raises(IdentityMismatch, match=r"config.lr: saved 1, now 1.0"):
        check_identity(fp(config={"lr": 1}), fp(config={"lr": 1.0}), intent="continue")


@pytest.mark.parametrize("bad, key", [({"a": {"b": object()}}, "config.a.b"),
                                      ({"x": [1, float("nan")]}, r"config.x\[1\]"),
                                      ({"m": {1: 2}}, "config.m")])
def test_unrepresentable_config_value_names_the_key(bad: dict[str, Any], key: str) -> None:
    with pytest.raises(UnbrokenError, match=key):
        Identity(config=bad)


def test_large_config_is_hashed_but_not_kept() -> None:
    big = {"blob": "x" * 20000}
    entry = fp(config=big)["config"]
    assert "value" not in entry
    with pytest.raises(IdentityMismatch, match="config: saved config with 1 keys"):
        check_identity(fp(config=big), fp(config={"blob": "y" * 20000}), intent="continue")


def test_tokenizer_dir_one_byte_change(tmp_path: Path) -> None:
    tok = make_tokenizer(tmp_path)
    before = fp(tokenizer=tok)
    assert before["tokenizer"]["kind"] == "dir"
    assert before["tokenizer"]["files"] == 2 and before["tokenizer"]["bytes"] == 20
    assert fp(tokenizer=str(tok)) == before  # an existing str path is a path too
    (tok / "sub" / "merges.txt").write_bytes(b"a c\n")  # same size, one byte different
    after = fp(tokenizer=tok)
    with pytest.raises(IdentityMismatch, match="tokenizer: saved dir tok/") as e:
        check_identity(before, after, intent="continue")
    assert "config" not in str(e.value).split("\n")[1]


def test_dir_records_renames_and_empty_folders(tmp_path: Path) -> None:
    tok = make_tokenizer(tmp_path)
    before = fp(tokenizer=tok)["tokenizer"]["hash"]
    (tok / "empty").mkdir()
    assert fp(tokenizer=tok)["tokenizer"]["hash"] != before
    (tok / "empty").rmdir()
    (tok / "vocab.json").rename(tok / "vocab2.json")
    assert fp(tokenizer=tok)["tokenizer"]["hash"] != before


def test_a_run_saved_when_symlinks_counted_by_target_text_is_still_recognised(
        tmp_path: Path) -> None:
    """Before the twenty-third session a symlink counted by its target text, never followed
    (a change behind it went unseen). Now links are hashed by content, and the older hash is
    computed alongside: a checkpoint that recorded it continues, with a warning saying what
    this resume cannot check; a link moved elsewhere is still refused."""
    import xxhash

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"x")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"1")
    os.symlink(outside, folder / "link")
    (folder / "sub").mkdir()
    os.symlink(tmp_path / "elsewhere", folder / "sub" / "gone")  # dangling
    # what the older walk recorded, entry by entry (its format, written out)
    old = xxhash.xxh3_128()
    for record in (["file", "a.txt", 1, xxhash.xxh3_128(b"x").hexdigest()],
                   ["link", "link", str(outside)], ["dir", "sub"],
                   ["link", "sub/gone", str(tmp_path / "elsewhere")]):
        old.update(json.dumps(record).encode("ascii") + b"\n")
    now = fp(tokenizer=folder)["tokenizer"]
    assert now["legacy_hash"] == old.hexdigest() and now["symlinks"] == 2
    assert now["hash"] != old.hexdigest() and now["files"] == 2  # a.txt and what link holds
    saved = {"tokenizer": {k: v for k, v in now.items() if k not in ("symlinks", "legacy_hash")}
             | {"hash": old.hexdigest()}}
    outside.write_bytes(b"2")  # unseen by the old hash: the warning says so
    with pytest.warns(UnbrokenWarning, match="symlink's target text"):
        check_identity(saved, fp(tokenizer=folder), intent="continue")
    (folder / "link").unlink()
    os.symlink(tmp_path / "moved.bin", folder / "link")
    with pytest.raises(IdentityMismatch, match="symlinks, now hashed by what they point to"):
        check_identity(saved, fp(tokenizer=folder), intent="continue")


def test_data_file(tmp_path: Path) -> None:
    data = tmp_path / "train.bin"
    data.write_bytes(b"\x00" * 1000)
    entry = fp(data=data)["data"]
    assert entry["kind"] == "file" and entry["size"] == 1000
    assert "train.bin" in entry["summary"]


def test_data_revision_strings() -> None:
    v1 = fp(data="dataset@v1")
    assert v1["data"]["kind"] == "revision" and v1["data"]["value"] == "dataset@v1"
    check_identity(v1, fp(data="dataset@v1"), intent="continue")
    with pytest.raises(IdentityMismatch, match=r"data: saved revision 'dataset@v1'.*now revision "
                                               r"'dataset@v2'"):
        check_identity(v1, fp(data="dataset@v2"), intent="continue")


def test_revision_and_file_with_same_bytes_differ(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("v1")
    with pytest.raises(IdentityMismatch):
        check_identity(fp(data="v1"), fp(data=tmp_path / "f"), intent="continue")


def test_missing_path_raises(tmp_path: Path) -> None:
    with pytest.raises(UnbrokenError, match=r"tokenizer path .*nope does not exist"):
        Identity(tokenizer=tmp_path / "nope")


def test_relative_path_resolved_at_construction(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    make_tokenizer(tmp_path)
    monkeypatch.chdir(tmp_path)
    ident = Identity(tokenizer="tok")
    monkeypatch.chdir("/")
    assert ident.fingerprint()["tokenizer"]["kind"] == "dir"


def test_mapping_and_vocab_tokenizers() -> None:
    class Tok:
        def __init__(self, vocab: dict[str, int]) -> None:
            self.vocab = vocab
            self.all_special_tokens = ["<eos>"]

        def get_vocab(self) -> dict[str, int]:
            return dict(self.vocab)

    a = fp(tokenizer=Tok({"a": 0, "b": 1}))["tokenizer"]
    assert a["kind"] == "vocab" and a["summary"] == "Tok with 2 tokens"
    assert fp(tokenizer=Tok({"b": 1, "a": 0}))["tokenizer"] == a
    assert fp(tokenizer=Tok({"a": 0, "b": 2}))["tokenizer"]["hash"] != a["hash"]
    m = fp(tokenizer={"name": "gpt2", "revision": "abc"})["tokenizer"]
    assert m["kind"] == "mapping" and m["value"]["revision"] == "abc"
    with pytest.raises(TypeError):
        Identity(data=Tok({}))  # type: ignore[arg-type]  # vocab objects are tokenizers, not data


def test_warm_start_rules() -> None:
    saved = fp(config=CFG, tokenizer="tok@1", data="d@1")
    check_identity(saved, fp(config=CFG, tokenizer="tok@1", data="d@2"), intent="warm_start")
    with pytest.raises(IdentityMismatch):
        check_identity(saved, fp(config=CFG, tokenizer="tok@1", data="d@2"), intent="continue")
    new_cfg = {**CFG, "lr": 0.01}
    with pytest.raises(IdentityMismatch, match=r"(?s)config.lr.*allow=\['config'\]"):
        check_identity(saved, fp(config=new_cfg, tokenizer="tok@1", data="d@2"),
                       intent="warm_start")
    check_identity(saved, fp(config=new_cfg, tokenizer="tok@1"), intent="warm_start",
                   allow=["config"])
    with pytest.raises(IdentityMismatch, match="tokenizer"):
        check_identity(saved, fp(config=new_cfg, tokenizer="tok@2"), intent="warm_start",
                       allow="config")


def test_all_differences_in_one_message() -> None:
    with pytest.raises(IdentityMismatch) as e:
        check_identity(fp(config=CFG, tokenizer="t1", data="d1"),
                       fp(config={**CFG, "name": "other"}, data="d2"), intent="continue")
    msg = str(e.value)
    assert 'config.name: saved "exp", now "other"' in msg
    assert "tokenizer: saved revision 't1'" in msg and "now nothing" in msg
    assert "data: saved revision 'd1'" in msg
    assert "allow=['config', 'tokenizer']" in msg


def test_bad_arguments() -> None:
    a = fp(config=CFG)
    with pytest.raises(ValueError, match="unknown identity fields"):
        check_identity(a, a, intent="warm_start", allow=["model"])
    with pytest.raises(ValueError, match="warm_start only"):
        check_identity(a, a, intent="continue", allow=["config"])
    with pytest.raises(ValueError, match="intent"):
        check_identity(a, a, intent="resume")


def test_fingerprint_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_tokenizer(tmp_path)
    calls = []
    real = identity._hash_file

    def counting(path: str | os.PathLike[str]) -> tuple[int, str]:
        calls.append(path)
        return real(path)

    monkeypatch.setattr(identity, "_hash_file", counting)
    ident = Identity(tokenizer=tmp_path / "tok")
    assert calls == []  # lazy: nothing read at construction
    first = ident.fingerprint()
    assert len(calls) == 2
    first["tokenizer"]["hash"] = "tampered"  # callers get a copy
    assert ident.fingerprint()["tokenizer"]["hash"] != "tampered"
    assert len(calls) == 2


def test_config_captured_at_construction() -> None:
    cfg = {"lr": 1}
    ident = Identity(config=cfg)
    cfg["lr"] = 2
    assert ident.fingerprint()["config"]["value"] == {"lr": 1}


def test_environment_fields_and_json() -> None:
    env = environment()
    for key in ("python", "torch", "numpy", "platform", "machine", "cuda_available",
                "cuda_device_count", "cuda_devices", "deterministic_algorithms",
                "cudnn_deterministic", "cudnn_benchmark", "num_threads", "world_size", "rank"):
        assert key in env
    assert env["world_size"] == 1 and env["rank"] == 0
    assert json.loads(dumps_json(env)) == env


def test_check_environment_warns_on_thread_count() -> None:
    env = environment()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_environment(env, dict(env)) == []
        assert check_environment(env, {**env, "rank": 3, "new_field": 1}) == []
    other = {**env, "num_threads": env["num_threads"] + 1}
    with pytest.warns(UnbrokenWarning, match="bitwise") as record:
        lines = check_environment(env, other, where="gen-1/MANIFEST.json")
    assert lines == [f"num_threads: saved {env['num_threads']}, now {env['num_threads'] + 1}"]
    assert len(record) == 1 and "gen-1/MANIFEST.json" in str(record[0].message)


def test_an_identity_can_be_copied_as_a_spawned_process_receives_it(tmp_path) -> None:
    """Found from outside (thirty-fifth session): Lightning's ``ddp_spawn`` sends the
    callback, and its Identity, to each process; the Identity's lock could not be copied."""
    import copy

    (tmp_path / "data.txt").write_text("abc")
    original = Identity(config={"lr": 0.1}, data=str(tmp_path / "data.txt"))
    copied = copy.deepcopy(original)
    assert copied.fingerprint() == original.fingerprint()
    assert copied._lock is not original._lock
