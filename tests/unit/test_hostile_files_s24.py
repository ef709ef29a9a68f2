"""Hostile run folders, found from outside (twenty-fourth session): a damaged export whose
export.json was resealed (the parser's own error, or an AttributeError, came out of
`verify-export`), a lone-surrogate string in a saved state (`diff` crashed digesting it), a
key twice in one object of a manifest (Python keeps the last, another reader the first: the
checksum covered only what Python read)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import xxhash

import unbroken
from unbroken.cli import main
from unbroken.errors import CorruptCheckpoint
from unbroken.state._digest import digest_tree
from unbroken.state.jsontext import loads_json
from unbroken.store.manifest import checksum
from unbroken.tools.export import verify_export

# -- verify-export of a damaged, resealed export -----------------------------------------------




def _reseal(folder: Path, change_doc=None) -> None:
    """export.json made to list the files as they are now, and its checksum recomputed: only
    the content itself can tell."""
    path = folder / "export.json"
    doc = json.loads(path.read_text())
    for entry in (doc["weights"], doc["fixed_inputs"]):
        data = (folder / entry["file"]).read_bytes()
        entry.update(bytes=len(data), xxh3_128=xxhash.xxh3_128(data).hexdigest())
    if change_doc is not None:
        change_doc(doc)
    doc["checksum"] = checksum(doc)
    path.write_text(json.dumps(doc))


def _truncate(name: str, size: int):
    def damage(folder: Path) -> None:
        with open(folder / name, "r+b") as f:
            f.truncate(size)
    return damage


def _header(folder: Path) -> None:
    data = bytearray((folder / "model.safetensors").read_bytes())
    at = data.index(b'"dtype"')
    data[at + 1:at + 2] = b"D"  # a header entry without its dtype
    (folder / "model.safetensors").write_bytes(bytes(data))


def _utf8(folder: Path) -> None:
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[data.index(b'"dtype"') + 2] = 0xFF
    (folder / "model.safetensors").write_bytes(bytes(data))


def _uncovered(folder: Path) -> None:
    with open(folder / "model.safetensors", "ab") as f:
        f.write(b"\0" * 16)  # data no tensor covers


@pytest.mark.parametrize(("damage", "named"), [
    (_truncate("fixed_inputs.safetensors", 3), "fixed_inputs.safetensors: 3 bytes, too short"),
    (_truncate("model.safetensors", 20), "model.safetensors: header claims"),
    (_header, "model.safetensors: malformed header entry"),
    (_utf8, "model.safetensors: not valid UTF-8"),
    (_uncovered, "model.safetensors: tensors cover"),
], ids=["fixed-truncated", "weights-truncated", "entry-without-dtype", "utf8", "uncovered"])
def test_a_damaged_resealed_export_is_corruption_naming_its_file(sealed_export, capsys, damage,
                                                                  named) -> None:
    folder, model = sealed_export
    damage(folder)
    _reseal(folder)
    with pytest.raises(CorruptCheckpoint, match=named):
        verify_export(folder, model)
    assert main(["verify-export", str(folder), "--json", "--no-load"]) in (1, 2)
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and "a bug in unbroken" not in doc["error"]


@pytest.mark.parametrize("tensors", [5, [], "x", {"weight": 3}])
def test_an_export_listing_its_tensors_as_no_mapping_is_not_an_export(sealed_export,
                                                                       tensors) -> None:
    folder, model = sealed_export
    _reseal(folder, lambda doc: doc["weights"].update(tensors=tensors))
    with pytest.raises(CorruptCheckpoint, match="export.json: not an export document"):
        verify_export(folder, model)


# -- a lone surrogate in a saved state -----------------------------------------------------------


class _Named:
    def __init__(self) -> None:
        self.state = {"name": "bad\udcff", "n": 0}

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def test_strings_with_a_lone_surrogate_digest_apart_and_as_before_otherwise() -> None:
    assert digest_tree({"a": "bad\udcff"}) != digest_tree({"a": "bad\udcfe"})
    assert digest_tree("x\udcff") == digest_tree("x\udcff")
    # (text UTF-8 encodes: the digest of a string is the one traces recorded before)
    assert digest_tree("héllo") == xxhash.xxh3_64(b"S6;" + "héllo".encode()).hexdigest()


def test_diff_and_a_trace_take_a_state_holding_a_lone_surrogate(tmp_path, capsys) -> None:
    """The README promises such strings (os.fsdecode makes them) round-trip: `diff` crashed
    with a UnicodeEncodeError digesting them, and so would a trace of the state."""
    torch.manual_seed(0)
    model, named = torch.nn.Linear(3, 2), _Named()
    with unbroken.Checkpointer(tmp_path / "run", model=model, extras={"named": named},
                               trace=tmp_path / "trace.jsonl",
                               identity=unbroken.Identity(config={"tag\udcfe": "v\udcff"})
                               ) as ckpt:
        ckpt.restore()
        for step in (1, 2):
            named.state["name"] += "\udcfe"
            ckpt.step_done(step)
            ckpt.save()
    assert main(["diff", str(tmp_path / "run")]) == 1  # (the extra differs)
    out = capsys.readouterr().out
    assert "extra.named" in out and "bad\\udcff\\udcfe" in out
    assert main(["diff", str(tmp_path / "run"), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert "error" not in doc and doc["equal"] is False and "extra.named" in doc["parts"]


# -- a key twice in one object ------------------------------------------------------------------


def test_a_key_twice_in_one_object_is_refused_naming_it() -> None:
    with pytest.raises(CorruptCheckpoint, match="the key 'run_id' appears twice"):
        loads_json(b'{"a": {"run_id": "x", "run_id": "y"}}', "M", 1000)
    assert loads_json(b'{"a": 1, "b": {"a": 2}}', "M", 1000) == {"a": 1, "b": {"a": 2}}
    assert loads_json(b'{"a": 1, "a": 2}', "M", 1000, unique=False) == {"a": 2}


def test_a_manifest_with_a_key_twice_is_corrupt_and_the_previous_generation_is_used(
        tmp_path) -> None:
    """Inserted before the real field without resealing: the checksum (of what Python read,
    the last value) still matched, and verify passed it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    root = tmp_path / "run"
    with unbroken.Checkpointer(root, model=model) as ckpt:
        ckpt.restore()
        at = {}
        for step in (1, 2):
            with torch.no_grad():
                model.weight.add_(1.0)
            at[step] = model.weight.detach().clone()
            ckpt.step_done(step)
            ckpt.save()
    manifest = root / "gen-000000002" / "MANIFEST.json"
    text = manifest.read_text()
    manifest.write_text(text.replace('"run_id":', '"run_id":"' + "d" * 32 + '","run_id":', 1))
    assert main(["verify", str(root)]) == 1
    fresh = torch.nn.Linear(3, 2)
    with unbroken.Checkpointer(root, model=fresh) as ckpt:
        assert ckpt.restore() == 1
        [(path, why)] = ckpt.rejected
    assert path.endswith("gen-000000002") and "'run_id' appears twice" in why
    assert torch.equal(fresh.weight, at[1])
