"""Security: nothing unpickles; a crafted checkpoint cannot run code on restore, `inspect` or
`verify`; headers and manifests have size limits; artifact paths stay inside their
generation; the writer never follows a symlink out of the run folder.

The trust model (RELIABILITY.md, README): content hashes and the manifest's own checksum detect
corruption, not malice (the tests below reseal manifests as an attacker would). A
checkpoint from someone you do not trust can hold weights you do not want, but loading it
never executes code and never reads or writes outside the run folder."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import pickle
import struct
import zipfile
from pathlib import Path

import pytest
import torch
import xxhash

import unbroken
from unbroken.cli import main as cli_main
from unbroken.errors import CorruptCheckpoint, UnbrokenError, UnbrokenWarning
from unbroken.state.jsontext import loads_json
from unbroken.state.tensorfile import MAX_HEADER_BYTES, read_safetensors_header
from unbroken.state.tensorread import decode_safetensors
from unbroken.store.generations import GenerationStore
from unbroken.store.manifest import MANIFEST, MAX_MANIFEST_BYTES, parse_manifest, seal

SRC = Path(unbroken.__file__).parent

# -- the source never unpickles -----------------------------------------------------------------

_FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve",
                      "marshal", "torch.serialization"}
_FORBIDDEN_CALLS = {("torch", "load"), ("torch", "save"), ("numpy", "load"), ("np", "load"),
                    ("pickle", "loads"), ("pickle", "load")}


def _sources() -> list[Path]:
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 10
    return files


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(SRC)))
def test_source_never_unpickles(path):
    """An AST check (comments and strings do not count): no pickle-family import, no
    torch.load / torch.save / numpy.load, no allow_pickle=True or weights_only=False, no
    eval/exec."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name in _FORBIDDEN_MODULES
                      or a.name.split(".")[0] in _FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in _FORBIDDEN_MODULES or node.module.split(".")[0] in \
                    _FORBIDDEN_MODULES:
                found.append(f"from {node.module}")
            if node.module in ("torch", "numpy") and any(a.name in ("load", "save")
                                                         for a in node.names):
                found.append(f"from {node.module} import load/save")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in _FORBIDDEN_CALLS:
                found.append(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.keyword):
            if (node.arg, getattr(node.value, "value", None)) in (("allow_pickle", True),
                                                                   ("weights_only", False)):
                found.append(f"{node.arg}={node.value.value}")  # type: ignore[attr-defined]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("eval", "exec", "__import__")):
            found.append(f"{node.func.id}()")
    assert not found, f"{path}: {found}"


def test_the_source_check_catches_what_it_should(tmp_path):
    bad = ("import pickle\nfrom torch.serialization import load\nimport torch\n"
           "torch.load('x')\nnp.load('y', allow_pickle=True)\neval('1')\n")
    tree = ast.parse(bad)
    names = {type(n).__name__ for n in ast.walk(tree)}
    assert {"Import", "ImportFrom", "Attribute", "keyword", "Call"} <= names
    path = tmp_path / "probe.py"
    path.write_text(bad)
    with pytest.raises(AssertionError) as e:
        test_source_never_unpickles(path)
    for what in ("pickle", "torch.serialization", "torch.load", "allow_pickle=True", "eval()"):
        assert what in str(e.value)


# -- crafted checkpoints ------------------------------------------------------------------------


class Payload:
    """Unpickling this creates the marker file: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def make_run(root: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    ckpt = unbroken.Checkpointer(root, model=model, optimizer=opt)
    ckpt.restore()
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    ckpt.step_done(1)
    ckpt.save()
    ckpt.close()


def restore(root: Path) -> int:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    ckpt = unbroken.Checkpointer(root, model=model, optimizer=opt)
    try:
        return ckpt.restore()
    finally:
        ckpt.close()


def replace(gen: Path, name: str, data: bytes, restamp: bool = True) -> None:
    """Put ``data`` in place of an artifact and (as an attacker would) fix the manifest and
    reseal it."""
    (gen / name).write_bytes(data)
    if restamp:
        doc = json.loads((gen / MANIFEST).read_bytes())
        for a in doc["artifacts"]:
            if a["name"] == name:
                a["size"], a["xxh3_128"] = len(data), xxhash.xxh3_128(data).hexdigest()
        (gen / MANIFEST).write_bytes(seal(doc))


def cli(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(list(argv))
    return code, out.getvalue() + err.getvalue()


@pytest.fixture
def run(tmp_path) -> Path:
    root = tmp_path / "run"
    make_run(root)
    return root


def _torch_save_zip(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)  # tests may use torch.save to build hostile input; src/ never does
    data = buf.getvalue()
    assert zipfile.is_zipfile(io.BytesIO(data))
    return data


def payloads(marker: Path) -> dict[str, bytes]:
    return {"pickle": pickle.dumps(Payload(marker)),
            "pickle-protocol-0": pickle.dumps(Payload(marker), protocol=0),
            "torch.save": _torch_save_zip({"weight": Payload(marker)})}


def test_the_payloads_are_live(tmp_path):
    """Positive control: unpickling them really does create the marker."""
    for name, data in payloads(tmp_path / "m").items():
        marker = tmp_path / "m"
        if name == "torch.save":
            torch.load(io.BytesIO(data), weights_only=False)
        else:
            pickle.loads(data)
        assert marker.exists(), name
        marker.unlink()


@pytest.mark.parametrize("artifact", ["state.json", "model.safetensors",
                                      "optimizer.safetensors", MANIFEST])
@pytest.mark.parametrize("kind", ["pickle", "pickle-protocol-0", "torch.save"])
def test_a_crafted_checkpoint_runs_no_code(run, tmp_path, artifact, kind):
    marker = tmp_path / "PAYLOAD-RAN"
    gen = run / "gen-000000001"
    replace(gen, artifact, payloads(marker)[kind], restamp=artifact != MANIFEST)
    with pytest.raises(CorruptCheckpoint) as e:
        restore(run)
    assert "gen-000000001" in str(e.value)
    code, text = cli("verify", str(run))  # re-hashes and decodes: finds it
    assert code == 1 and "Traceback" not in text, text
    code, text = cli("inspect", str(run))  # cheap: sizes only, unless the manifest is bad
    assert code == (1 if artifact == MANIFEST else 0) and "Traceback" not in text, text
    assert not marker.exists()


@pytest.mark.parametrize("tag", ["bytes", "ndarray", "npscalar"])
def test_pickle_bytes_inside_state_json_are_data_or_refused(run, tmp_path, tag):
    """A payload smuggled as a bytes value or as a NumPy object array in state.json: bytes
    stay bytes (and the counters refuse them); object dtypes are never loaded."""
    import base64

    marker = tmp_path / "PAYLOAD-RAN"
    gen = run / "gen-000000001"
    doc = json.loads((gen / "state.json").read_bytes())
    b64 = base64.b64encode(pickle.dumps(Payload(marker))).decode()
    doc["parts"]["counters"]["epoch"] = {
        "bytes": {"$t": "bytes", "v": b64},
        "ndarray": {"$t": "ndarray", "dtype": "|O", "shape": [1], "v": b64},
        "npscalar": {"$t": "npscalar", "dtype": "|O", "v": b64}}[tag]
    replace(gen, "state.json", json.dumps(doc).encode())
    with pytest.raises(UnbrokenError) as e:
        restore(run)
    assert "gen-000000001" in str(e.value)
    assert cli("verify", str(run))[0] in (0, 1)
    assert not marker.exists()


# -- size limits --------------------------------------------------------------------------------


def test_manifest_over_the_limit_is_refused_without_reading_it(run):
    manifest = run / "gen-000000001" / MANIFEST
    with open(manifest, "r+b") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)  # sparse: refused by its size alone
    [info] = GenerationStore(run).scan()
    assert info.status == "corrupt" and "limit" in info.reason and MANIFEST in info.reason
    with pytest.raises(CorruptCheckpoint, match="no generation verifies"):
        restore(run)


def test_json_limits():
    with pytest.raises(CorruptCheckpoint, match="limit"):
        loads_json(b" " * 11, "x.json", 10)
    with pytest.raises(CorruptCheckpoint, match="nested too deeply"):
        loads_json(b"[" * 100_000 + b"]" * 100_000, "x.json", 10 ** 6)
    with pytest.raises(CorruptCheckpoint, match="m.json"):
        parse_manifest(b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "m.json")


@pytest.mark.parametrize("claimed", [MAX_HEADER_BYTES + 1, 2 ** 63 - 1, 2 ** 64 - 1])
def test_safetensors_header_over_the_limit(claimed):
    data = struct.pack("<Q", claimed) + b"{}" + b" " * 6
    with pytest.raises(CorruptCheckpoint, match="header claims"):
        read_safetensors_header(data, "t.safetensors")
    with pytest.raises(CorruptCheckpoint):
        decode_safetensors(data, "t.safetensors")


@pytest.mark.parametrize("name, why", [("model.safetensors", "more than this machine's memory"),
                                       ("state.json", "over the 268435456-byte limit")])
def test_an_artifact_larger_than_memory_is_not_read(run, name, why):
    gen = run / "gen-000000001"
    size = 1 << 43  # 8 TiB, sparse
    with open(gen / name, "r+b") as f:
        f.truncate(size)
    doc = json.loads((gen / MANIFEST).read_bytes())
    for a in doc["artifacts"]:
        if a["name"] == name:
            a["size"] = size
    (gen / MANIFEST).write_bytes(seal(doc))
    with pytest.raises(CorruptCheckpoint, match=why):
        restore(run)


# -- paths stay inside the run ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../gen-000000000/model.safetensors", "/etc/passwd", "a/b",
                                  ".hidden", "..", "", "x" * 200, "nul\x00byte", MANIFEST])
def test_artifact_names_are_confined(name):
    doc = {"schema": "unbroken.manifest/1", "generation": 1, "step": 1, "run_id": "r",
           "incarnation": 0, "parts": [], "identity": {}, "environment": {}, "retention": {},
           "metrics": {}, "created": "",
           "artifacts": [{"name": name, "size": 1, "xxh3_128": "0" * 32}]}
    with pytest.raises(CorruptCheckpoint, match="not a plain file name"):
        parse_manifest(seal(doc), "MANIFEST.json")


def test_a_manifest_cannot_point_at_a_real_file_outside(run, tmp_path):
    """Even with the outside file's true size and hash, the name is refused."""
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"not yours")
    gen = run / "gen-000000001"
    doc = json.loads((gen / MANIFEST).read_bytes())
    doc["artifacts"].append({"name": os.path.relpath(secret, gen), "size": 9,
                             "xxh3_128": xxhash.xxh3_128(b"not yours").hexdigest()})
    (gen / MANIFEST).write_bytes(seal(doc))
    [info] = GenerationStore(run).scan()
    assert info.status == "corrupt" and "plain file name" in info.reason


def test_symlinks_are_never_followed_out_of_the_run(run, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    precious = outside / "precious.txt"
    precious.write_bytes(b"keep me")
    gen = run / "gen-000000001"
    # an artifact that is a symlink to a byte-identical copy outside
    copy = outside / "model.safetensors"
    copy.write_bytes((gen / "model.safetensors").read_bytes())
    (gen / "model.safetensors").unlink()
    (gen / "model.safetensors").symlink_to(copy)
    [info] = GenerationStore(run).scan()
    assert info.status == "corrupt" and "regular file" in info.reason
    # a generation folder that is a symlink to a copy of itself outside the run
    (gen / "model.safetensors").unlink()
    (gen / "model.safetensors").write_bytes(copy.read_bytes())
    os.rename(gen, outside / "gen-copy")
    gen.symlink_to(outside / "gen-copy")
    [info] = GenerationStore(run).scan()
    assert info.status == "corrupt" and "symbolic link" in info.reason
    # LOCK, staging and trash debris as symlinks to outside files and folders
    (run / "LOCK").unlink()
    (run / "LOCK").symlink_to(precious)
    with pytest.raises(CorruptCheckpoint, match="LOCK"):
        restore(run)
    assert precious.read_bytes() == b"keep me"
    (run / "LOCK").unlink()
    (run / ".staging-000000002-0123456789ab").symlink_to(outside)
    (run / ".trash-0123456789ab").mkdir()
    (run / ".trash-0123456789ab" / "x").symlink_to(precious)
    with pytest.raises(CorruptCheckpoint, match="no generation verifies"):
        restore(run)  # the lock cleaned the debris, unlinking links, never their targets
    assert precious.read_bytes() == b"keep me" and (outside / "gen-copy").is_dir()
    assert sorted(p.name for p in outside.iterdir()) == ["gen-copy", "model.safetensors",
                                                         "precious.txt"]
    assert not (run / ".staging-000000002-0123456789ab").exists()


def test_retention_never_deletes_through_a_symlinked_generation(tmp_path):
    outside = tmp_path / "outside"
    root = tmp_path / "run"
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = unbroken.Checkpointer(root, model=model, optimizer=opt, keep=unbroken.Keep(last=1))
    ckpt.step_done(1)
    ckpt.save()
    ckpt.wait()  # read back before the test moves it
    os.rename(root / "gen-000000001", outside)
    (root / "gen-000000001").symlink_to(outside)  # an old "generation" leading outside
    before = sorted(p.name for p in outside.iterdir())
    ckpt.step_done(2)
    ckpt.save()  # retention deletes the old entry: the link, never what it points to
    ckpt.close()
    assert not os.path.lexists(root / "gen-000000001")
    assert sorted(p.name for p in outside.iterdir()) == before and MANIFEST in before


def test_aside_symlink_is_refused(run, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    gen2 = run / "gen-000000002"
    gen2.mkdir()  # a torn newer generation: restore moves it aside
    (run / "aside").symlink_to(outside)
    with pytest.warns(UnbrokenWarning, match="aside: not a folder"):
        restore(run)  # falls back; the refused generation stays where it is
    assert list(outside.iterdir()) == [] and gen2.is_dir()


@pytest.mark.parametrize("kind", ["folder", "fifo", "symlink"])
def test_a_lock_that_is_no_regular_file_is_refused_alike_naming_it(tmp_path, kind):
    """A LOCK planted as a folder, a FIFO or a symbolic link: the same typed refusal, naming
    the file and what it is (a folder once opened the run read-only, a FIFO failed it)."""
    root = tmp_path / "run"
    model = torch.nn.Linear(2, 2)
    with unbroken.Checkpointer(root, model=model) as ckpt:
        ckpt.save(1)
    lock = root / "LOCK"
    lock.unlink()
    {"folder": lock.mkdir, "fifo": lambda: os.mkfifo(lock),
     "symlink": lambda: lock.symlink_to(tmp_path / "elsewhere")}[kind]()
    with pytest.raises(CorruptCheckpoint, match=r"LOCK: (is a|not a regular)") as raised:
        unbroken.Checkpointer(root, model=model)
    assert str(lock) in str(raised.value) and "remove it" in str(raised.value)
