"""MANIFEST.json: strict parsing; every bad field raises CorruptCheckpoint naming it."""

from __future__ import annotations

import json

import pytest

from unbroken.errors import CorruptCheckpoint
from unbroken.manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    SCHEMA,
    Artifact,
    Manifest,
    parse_manifest,
    valid_artifact_name,
)

WHERE = "run/gen-000000005/MANIFEST.json"
H1, H2 = "0" * 32, "0123456789abcdef" * 2


def make(**overrides) -> Manifest:
    fields = dict(
        generation=5, step=500, run_id="run-abc", incarnation=2,
        artifacts=[Artifact("model.safetensors", 1024, H1), Artifact("state.json", 0, H2)],
        parts=["model", "rng"], parent={"run_id": "older", "generation": 3},
        origin=None, identity={"config": "deadbeef"}, environment={"torch": "2.4"},
        retention={"last": 3, "every": None, "best": ["val_loss", "min"]},
        metrics={"val_loss": 1.25}, created="2024-01-01T00:00:00Z")
    fields.update(overrides)
    return Manifest(**fields)


def raw(**changes) -> dict:
    doc = json.loads(make().to_bytes())
    for k, v in changes.items():
        if v is _DELETE:
            del doc[k]
        else:
            doc[k] = v
    return doc


_DELETE = object()


def parse(doc) -> Manifest:
    data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return parse_manifest(data, WHERE)


def refuse(doc, *words: str) -> str:
    with pytest.raises(CorruptCheckpoint) as e:
        parse(doc)
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
