"""MANIFEST.json: sealed by its own checksum, checked first; strict parsing, every bad field
raises CorruptCheckpoint naming it."""

from __future__ import annotations

import json

import pytest

from unbroken.errors import CorruptCheckpoint
from unbroken.store.manifest import (
    CHECKSUM,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    SCHEMA,
    Artifact,
    Manifest,
    checksum,
    parse_manifest,
    seal,
    valid_artifact_name,
)

WHERE = "run/gen-000000005/MANIFEST.json"
H1, H2 = "0" * 32, "0123456789abcdef" * 2


def make(**overrides) -> Manifest:
    fields = dict(
        generation=5, step=500, run_id="run-abc", incarnation=2,
        artifacts=[Artifact("model.safetensors", 1024, H1), Artifact("state.json", 0, H2)],
        parts=["model", "rng"], parent={"run_id": "older", "generation": 3},
        origin=None, identity={"config": {"kind": "json", "hash": "deadbeef"}},
        environment={"torch": "2.4"},
        retention={"last": 3, "every": None, "best": ["val_loss", "min"]},
        metrics={"val_loss": 1.25}, created="2024-01-01T00:00:00Z")
    fields.update(overrides)
    return Manifest(**fields)


def raw(**changes) -> dict:
    """The fields of a valid manifest, changed; ``parse`` reseals them, so that the field
    checks, not the checksum, are what a test reaches."""
    doc = json.loads(make().to_bytes())
    for k, v in changes.items():
        if v is _DELETE:
            del doc[k]
        else:
            doc[k] = v
    return doc


_DELETE = object()


def parse(doc, sealed: bool = True) -> Manifest:
    """Parse bytes as they are, or a dict sealed with a correct checksum (``sealed``) or
    written as it is."""
    if isinstance(doc, bytes):
        data = doc
    else:
        data = seal(doc) if sealed else json.dumps(doc).encode()
    return parse_manifest(data, WHERE)


def refuse(doc, *words: str, sealed: bool = True) -> str:
    with pytest.raises(CorruptCheckpoint) as e:
        parse(doc, sealed)
    msg = str(e.value)
    assert WHERE in msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


# ---------------------------------------------------------------------------------------------


def test_valid_manifest_round_trips():
    m = make()
    data = m.to_bytes()
    assert parse_manifest(data, WHERE) == m
    assert m.to_bytes() == data  # canonical: stable bytes
    assert json.loads(data)["schema"] == SCHEMA


def test_optional_and_default_fields_round_trip():
    m = make(parent=None, origin={"from": "x"}, artifacts=[], parts=[], metrics={},
             identity={}, environment={}, retention={}, created="")
    assert parse_manifest(m.to_bytes(), WHERE) == m
    doc = raw(parent=_DELETE, origin=_DELETE)
    parsed = parse(doc)
    assert parsed.parent is None and parsed.origin is None


def test_helpers():
    m = make()
    assert m.artifact("state.json") == Artifact("state.json", 0, H2)
    assert m.artifact("nope") is None
    assert m.total_bytes == 1024


@pytest.mark.parametrize("schema", ["unbroken.manifest/2", "", None, 1, "UNBROKEN.MANIFEST/1"])
def test_wrong_schema(schema):
    refuse(raw(schema=schema), "schema")
    refuse(raw(schema=_DELETE), "schema")


@pytest.mark.parametrize("field", ["generation", "step", "incarnation"])
@pytest.mark.parametrize("value", [_DELETE, None, "5", 5.0, True, False, [5]])
def test_integer_fields_must_be_integers(field, value):
    refuse(raw(**{field: value}), repr(field))


@pytest.mark.parametrize("field", ["generation", "step", "incarnation"])
def test_negative_integer_fields(field):
    refuse(raw(**{field: -1}), "negative")


@pytest.mark.parametrize("field", ["generation", "step", "incarnation"])
@pytest.mark.parametrize("value", [1 << 63, 10 ** 400], ids=["2**63", "10**400"])
def test_integer_fields_past_int64_are_refused_without_printing_them(field, value):
    """No save writes one (the counters are int64); a message printing 401 digits is none."""
    why = refuse(raw(**{field: value}), "past 2**63 - 1")
    assert str(value) not in why
    assert getattr(parse(raw(**{field: (1 << 63) - 1})), field) == (1 << 63) - 1


@pytest.mark.parametrize("field,value", [
    ("run_id", 5), ("run_id", None), ("run_id", _DELETE),
    ("artifacts", {}), ("artifacts", None), ("artifacts", _DELETE),
    ("parts", "model"), ("parts", _DELETE),
    ("parent", "gen-3"), ("parent", []), ("origin", 1),
    ("identity", []), ("identity", _DELETE), ("environment", "x"), ("retention", None),
    ("metrics", [1.0]), ("created", 0), ("created", _DELETE),
])
def test_other_fields_have_their_types(field, value):
    refuse(raw(**{field: value}), repr(field))


def test_parts_must_list_strings():
    refuse(raw(parts=["model", 3]), "'parts'")


BAD_NAMES = ["../x", "..", ".", "/etc/passwd", "a/b", "a\\b", ".hidden", ".staging-1", MANIFEST,
             "", "x" * 129, "-rf", "a b", "a\x00b", "\u00e9t\u00e9", "a:b", "~x", "a*", None, 5,
             ["x"]]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_artifact_names_that_could_leave_the_folder_are_refused(name):
    assert not valid_artifact_name(name)
    doc = raw()
    doc["artifacts"][0]["name"] = name
    refuse(doc, "artifact name")


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors",
                                  "extra.my-thing.safetensors",
                                  "_x", "0", "a" * 128, "a..b", "x.", "MANIFEST.json.bak"])
def test_plain_names_are_accepted(name):
    assert valid_artifact_name(name)
    doc = raw()
    doc["artifacts"][0]["name"] = name
    assert parse(doc).artifacts[0].name == name


@pytest.mark.parametrize("name", ["model.safetensors\n", "MANIFEST.json\n"], ids=repr)
def test_trailing_newline_names_are_refused(name):
    assert not valid_artifact_name(name)


def test_duplicate_artifact_names():
    doc = raw()
    doc["artifacts"].append(dict(doc["artifacts"][0]))
    refuse(doc, "model.safetensors", "twice")


@pytest.mark.parametrize("size", [-1, "10", 1.0, 10.5, True, None])
def test_malformed_size(size):
    doc = raw()
    doc["artifacts"][0]["size"] = size
    refuse(doc, "model.safetensors", "size or hash")


@pytest.mark.parametrize("digest", ["", "0" * 31, "0" * 33, "A" * 32, "g" * 32, None, 0,
                                    "0" * 32 + "\n"], ids=repr)
def test_malformed_hash(digest):
    doc = raw()
    doc["artifacts"][0]["xxh3_128"] = digest
    refuse(doc, "model.safetensors", "size or hash")


def test_missing_artifact_keys_and_non_object_entries():
    doc = raw()
    del doc["artifacts"][0]["xxh3_128"]
    refuse(doc, "size or hash")
    doc = raw()
    del doc["artifacts"][0]["size"]
    refuse(doc, "size or hash")
    doc = raw()
    del doc["artifacts"][0]["name"]
    refuse(doc, "artifact name")
    doc = raw()
    doc["artifacts"][0] = ["model.safetensors", 1, H1]
    refuse(doc, "not an object")


@pytest.mark.parametrize("data", [b"[]", b"null", b"5", b'"manifest"', b"true"])
def test_non_object_json(data):
    refuse(data, "JSON object")


@pytest.mark.parametrize("data", [b"", b"{", b"\xff\xfe", b'{"generation": NaN}',
                                  b"[" * 100_000, b"{}garbage"], ids=repr)
def test_unparseable_bytes(data):
    refuse(data)


def test_oversized_manifest_is_refused_before_parsing():
    m = make()
    data = m.to_bytes()
    padded = data[:-1] + b" " * (MAX_MANIFEST_BYTES - len(data)) + b"}"
    assert len(padded) == MAX_MANIFEST_BYTES
    assert parse_manifest(padded, WHERE) == m
    refuse(padded + b" ", "limit")


# -- the checksum -------------------------------------------------------------------------------


def test_to_bytes_is_sealed_with_the_checksum_of_the_other_fields():
    m = make()
    doc = json.loads(m.to_bytes())
    recorded = doc.pop(CHECKSUM)
    assert len(recorded) == 32 and recorded == checksum(doc)
    assert seal(doc) == m.to_bytes()
    assert seal({**doc, CHECKSUM: "f" * 32}) == m.to_bytes()  # seal replaces a stale one


def test_the_checksum_covers_content_not_formatting():
    doc = json.loads(make().to_bytes())
    pretty = json.dumps(dict(reversed(doc.items())), indent=2).encode()
    assert parse_manifest(pretty, WHERE) == make()


def _flip_hex(s: str) -> str:
    return ("1" if s[0] == "0" else "0") + s[1:]


EDITS = {
    "step": lambda d: d.update(step=d["step"] + 1),
    "generation": lambda d: d.update(generation=4),
    "incarnation": lambda d: d.update(incarnation=1),
    "run_id": lambda d: d.update(run_id="run-abd"),
    "size": lambda d: d["artifacts"][0].update(size=1025),
    "hash-digit": lambda d: d["artifacts"][1].update(xxh3_128=_flip_hex(H2)),
    "artifact-name": lambda d: d["artifacts"][0].update(name="optimizer.safetensors"),
    "dropped-artifact": lambda d: d["artifacts"].pop(),
    "parent": lambda d: d["parent"].update(generation=2),
    "no-parent": lambda d: d.update(parent=None),
    "identity-digit": lambda d: d["identity"]["config"].update(hash="ceadbeef"),
    "environment": lambda d: d["environment"].update(torch="2.5"),
    "metric": lambda d: d["metrics"].update(val_loss=1.0),
    "parts": lambda d: d["parts"].reverse(),
    "created": lambda d: d.update(created="2024-01-01T00:00:01Z"),
    "extra-field": lambda d: d.update(note="hello"),
    "schema": lambda d: d.update(schema="unbroken.manifest/2"),
    "bad-name": lambda d: d["artifacts"][0].update(name="../x"),
    "bad-step": lambda d: d.update(step="500"),
}


@pytest.mark.parametrize("edit", EDITS.values(), ids=EDITS.keys())
def test_any_edit_of_a_sealed_manifest_is_a_checksum_mismatch(edit):
    doc = json.loads(make().to_bytes())
    recorded = doc[CHECKSUM]
    edit(doc)
    msg = refuse(doc, f"manifest checksum {checksum(doc)}, expected {recorded} (the manifest "
                 "changed after commit)", sealed=False)
    assert "field" not in msg and "artifact name" not in msg  # reported before the fields


def test_a_sealed_manifest_of_another_schema_says_so_on_a_mismatch():
    doc = json.loads(make().to_bytes())
    doc["schema"] = "unbroken.manifest/2"
    refuse(doc, "manifest checksum", "'unbroken.manifest/2'", SCHEMA, sealed=False)


def test_a_missing_checksum_is_refused():
    doc = json.loads(make().to_bytes())
    del doc[CHECKSUM]
    refuse(doc, f"manifest checksum {checksum(doc)}, expected a 'checksum' field, found none",
           sealed=False)


@pytest.mark.parametrize("value", [None, "", 5, "F" * 32, "0" * 32, ["x"]], ids=repr)
def test_a_malformed_checksum_is_refused(value):
    doc = json.loads(make().to_bytes())
    doc[CHECKSUM] = value
    refuse(doc, "manifest checksum", "changed after commit", sealed=False)


def test_a_number_out_of_the_float_range_is_corruption_not_a_crash():
    data = make().to_bytes()[:-1] + b',"metrics":{"x":1e999}}'  # json would parse it as inf
    refuse(data, "1e999 is out of the float range")


def test_a_one_character_corruption_anywhere_in_the_bytes_is_refused():
    data = make().to_bytes()
    for i in range(len(data)):
        for c in b"0a9z\"\x01":
            if data[i] == c:
                continue
            mutated = data[:i] + bytes([c]) + data[i + 1:]
            with pytest.raises(CorruptCheckpoint):
                parse_manifest(mutated, WHERE)


def test_restore_falls_back_past_a_manifest_edited_after_commit(tmp_path):
    """The review's case, end to end: one hex digit of an identity hash flipped in the newest
    manifest. Without the checksum it parses and restore raises IdentityMismatch; with it the
    generation is refused as corrupt and the previous verified one is restored."""
    import torch

    import unbroken

    def run():
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt, every=1,
                                     identity=unbroken.Identity(config={"d": 4}, data="rev-a"))

    with run() as ckpt:
        ckpt.step_done(1)
        ckpt.step_done(2)
    path = tmp_path / "run" / "gen-000000002" / MANIFEST
    doc = json.loads(path.read_bytes())
    h = doc["identity"]["config"]["hash"]
    doc["identity"]["config"]["hash"] = ("0" if h[0] != "0" else "1") + h[1:]
    path.write_text(json.dumps(doc, sort_keys=True, separators=(",", ":")))
    with run() as ckpt:
        assert ckpt.restore() == 1
        [(where, why)] = ckpt.rejected
        assert "gen-000000002" in where and MANIFEST in why and "manifest checksum" in why
