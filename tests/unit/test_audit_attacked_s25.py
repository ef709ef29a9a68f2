"""`unbroken audit` against crafted pickles an outside review found (session 25): streams the
real unpicklers accept but pickletools rejected (base-0 INT/LONG, UTF-8 STRING), the legacy
tar format, a hash bomb in a persistent id, work amplification, Python 2 names, DCP bytes
entries with negative ranges or a FIFO. Each class is tested, with a differential test
against CPython's own unpicklers where one applies."""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import struct
import subprocess
import sys
import tarfile
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unbroken.cli import main as cli_main
from unbroken.tools import _audit_parts, _pickle_ops
from unbroken.tools import _pickle_files as pfiles
from unbroken.tools import _pickle_scan as ps

EVIL = b"cos\ngetcwd\n)R."  # (harmless: os.getcwd; os.system in a real attack)


def audit(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    rc = cli_main(["audit", str(path), "--json"])
    return rc, json.loads(capsys.readouterr().out)


# -- the real unpicklers, as a reference ------------------------------------------------------


class _Anything:
    """What the reference unpicklers hand back for every global: takes any call or state."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Anything:
        return _Anything()

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


def _reached(data: bytes) -> set[str]:
    """The globals CPython's unpicklers (C and pure Python, UTF-8 strings as torch.load
    decodes them) reach in ``data``: find_class records them and imports nothing."""
    found: set[str] = set()
    for base in (pickle.Unpickler, pickle._Unpickler):  # type: ignore[attr-defined]
        class Recording(base):  # type: ignore[misc,valid-type]
            def find_class(self, module: str, name: str) -> Any:
                found.add(f"{module}.{name}")
                return _Anything

            def persistent_load(self, pid: Any) -> Any:
                return None

        try:
            with warnings.catch_warnings():  # (an unknown escape in a STRING warns)
                warnings.simplefilter("ignore")
                Recording(io.BytesIO(data), encoding="utf-8").load()
        except Exception:  # noqa: BLE001 -- only what was reached before failing matters
            pass
    return found


def _assert_covers(data: bytes) -> None:
    """Every global a real unpickler reaches, the scan lists (or counts as unresolved), and
    never calls the stream "not a pickle"."""
    reached = _reached(data)
    scan = ps.scan_pickle(io.BytesIO(data))
    pf = pfiles.read_pickle_bytes(data)
    if reached:
        assert not pf.not_pickle, (data, scan)
        missing = reached - set(scan.globals)
        assert not missing or scan.unresolved, (data, missing, scan)


# -- protocol 0/1 arguments the real unpicklers accept ---------------------------------------

_INT_TEXT = st.sampled_from([b"0x10", b"0X1f", b"0o17", b"0b101", b"1_000", b" 12", b"+7", b"-0x3",
                             b"017", b"00", b"01", b"12\x00junk", b"99999999999999999999999",
                             b"\t5 ", b"0"])
_STR_TEXT = st.text(max_size=6).map(lambda s: s.replace("\\", "").replace("\n", "")
                                    .replace("'", "")).map(lambda s: b"'" + s.encode() + b"'")
_ARG_OPS = st.one_of(
    _INT_TEXT.map(lambda t: b"I" + t + b"\n"),
    _INT_TEXT.map(lambda t: b"L" + t.replace(b"\x00junk", b"") + b"L\n"),
    _STR_TEXT.map(lambda t: b"S" + t + b"\n"),
    st.sampled_from([b"S'\\xe9\\n'\n", b"S\"\xc3\xa9\"\n", b"V\\u00e9\xc3\n", b"F1e500\n",
                     b"Finf\n", b"F 1.5\n", b"F1_0.5\n", b"T\x02\x00\x00\x00\xc3\xa9",
                     b"U\x02\xff\xfe", b"\x8c\x02\xc3\xa9", b"P0x\n", b"G" + bytes(8),
                     b"J\xff\xff\xff\xff", b"\x8a\x03\x01\x02\x03", b"N", b"\x88", b")"]),
)
_PROTO = st.sampled_from([b"", b"\x80\x01", b"\x80\x02", b"\x80\x05"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_PROTO, st.lists(_ARG_OPS, max_size=4), st.sampled_from([b"p0\n", b"p 1\n", b""]))
def test_arguments_the_unpicklers_accept_never_hide_a_later_global(proto, args, put):
    """Values before a code-running GLOBAL, as the real unpicklers parse them (INT base 0,
    LONG with or without L, UTF-8 STRING, overflowing FLOAT...): the global is listed."""
    body = b"".join(a + put + b"0" for a in args)
    data = proto + body + EVIL
    _assert_covers(data)
    if _reached(data):
        assert "os.getcwd" in ps.scan_pickle(io.BytesIO(data)).globals


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(_ARG_OPS, st.sampled_from(
    [b"(", b"t", b"l", b"d", b"s", b"a", b"e", b"0", b"1", b"2", b"R", b"b", b"q\x00",
     b"h\x00", b"g0\n", b"\x85", b"\x94", b"\x93", b"cos\ngetcwd\n", b"ibuiltins\nlen\n",
     b"X\x02\x00\x00\x00os", b"\x8c\x06getcwd", b"Q", b"o", b"\x81", b"\x95" + bytes(8)])),
    max_size=12), st.booleans())
def test_differential_against_cpython_unpicklers(tokens, stop):
    """Streams of mixed (valid, invalid, truncated) instructions: whatever global either of
    CPython's unpicklers reaches, the scan reports."""
    _assert_covers(b"".join(tokens) + (b"." if stop else b""))


@pytest.mark.parametrize("data", [b"I0x10\n0" + EVIL, "S'é'\n0".encode() + EVIL,
                                  b"L0x10L\n0" + EVIL, b"I12\x00zz\n0" + EVIL,
                                  b"F1e999\n0" + EVIL, b"S'\\q'\n0" + EVIL])
def test_hidden_global_is_flagged_in_file_and_folder(tmp_path, capsys, data):
    assert "os.getcwd" in _reached(data)
    (tmp_path / "x.pth").write_bytes(data)
    rc, doc = audit(tmp_path / "x.pth", capsys)
    assert rc == 1 and doc["would_import_code"] == ["os.getcwd"], doc
    ck = tmp_path / "checkpoint-5"
    ck.mkdir()
    (ck / "trainer_state.json").write_text('{"global_step": 5}')
    (ck / "rng_state.pth").write_bytes(data)
    rc, doc = audit(ck, capsys)
    assert rc == 1 and doc["would_import_code"] == ["os.getcwd"], doc


def test_a_stream_that_breaks_after_starting_like_a_pickle_is_flagged(tmp_path, capsys):
    """Not "not a pickle": unreadable and flagged (torch.load may run what comes first)."""
    (tmp_path / "x.bin").write_bytes(b"N\xff\xfe")
    rc, doc = audit(tmp_path / "x.bin", capsys)
    assert rc == 1 and doc["files"][0]["flagged"] and doc["files"][0]["errors"], doc
    for text in (b"import torch\n", b"", b"# notes\n", b"In this file\n"):
        (tmp_path / "t.txt").write_bytes(text)
        assert cli_main(["audit", str(tmp_path / "t.txt")]) == 2, text


def test_the_opcode_table_is_pickle_s():
    assert {code: name for code, (name, _r) in _pickle_ops.OPCODES.items()} == {
        ord(op.code): op.name for op in pickletools.opcodes}


# -- the legacy tar format ----------------------------------------------------------------------


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("member", ["storages", "tensors", "pickle"])
def test_legacy_tar_members_are_scanned_and_always_flagged(tmp_path, capsys, member):
    members = {"storages": b"K\x00.", "tensors": b"K\x00.", "pickle": b"N."}
    members[member] = EVIL
    (tmp_path / "old.pt").write_bytes(_tar(list(members.items())))
    rc, doc = audit(tmp_path / "old.pt", capsys)
    assert rc == 1 and doc["kind"] == "torch.save (legacy tar format)", doc
    assert doc["would_import_code"] == ["os.getcwd"]
    (tmp_path / "clean.pt").write_bytes(_tar([("storages", b"K\x00."), ("tensors", b"K\x00."),
                                              ("pickle", b"N.")]))
    rc, doc = audit(tmp_path / "clean.pt", capsys)
    assert rc == 1 and doc["files"][0]["errors"]  # (weights_only=False is the only way in)


def test_legacy_tar_storage_records_are_followed(tmp_path, capsys):
    """A second storage's record, after the first's raw bytes, is scanned too."""
    rec = b"\x80\x02(X\x01\x00\x00\x000X\x03\x00\x00\x00cpuctorch\nFloatStorage\ntq\x00."
    storages = (b"\x80\x02K\x02." + rec + struct.pack("<q", 3) + bytes(12)
                + b"(X\x01\x00\x00\x001X\x03\x00\x00\x00cpu" + EVIL[:-3] + b"t." + b"].")
    (tmp_path / "old.pt").write_bytes(_tar([("storages", storages), ("pickle", b"N.")]))
    rc, doc = audit(tmp_path / "old.pt", capsys)
    assert rc == 1 and "os.getcwd" in doc["would_import_code"], doc


# -- bounded: depth, hashing, work ----------------------------------------------------------


def test_deep_and_dag_keys_never_crash_or_hang(tmp_path):
    """A persistent id around a tuple 300,000 deep (hash() overflowed C's stack: SIGSEGV),
    and a tuple DAG 60 levels of (t, t) (2**60 steps to hash): run in a child process."""
    deep = b"\x80\x02}" + b")" + b"\x85" * 300_000 + b"QNs."
    dag = b"\x80\x02})" + b"\x94" + b"".join(
        b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86\x94" for i in range(60)) + b"Ns."
    for name, data in (("deep.pkl", deep), ("dag.pkl", dag)):
        (tmp_path / name).write_bytes(data)
        r = subprocess.run([sys.executable, "-m", "unbroken.cli", "audit",
                            str(tmp_path / name)], capture_output=True, text=True, timeout=60)
        assert r.returncode in (0, 1, 2) and "a bug in unbroken" not in r.stderr, r


def test_repeated_reduce_over_one_memoized_list_is_bounded(monkeypatch):
    """REDUCE OrderedDict over one memoized 2,000-pair list, 5,000 times: the work budget
    stops it with an error that flags the file; the global after it is still listed."""
    monkeypatch.setattr(_pickle_ops, "MAX_WORK", 200_000)
    pairs = b"".join(b"J" + struct.pack("<i", i) + b"N\x86" for i in range(2000))
    data = (b"\x80\x02](" + pairs + b"e\x94ccollections\nOrderedDict\n\x940"
            + b"h\x01h\x00\x85R0" * 5000 + EVIL)
    start = time.monotonic()
    scan = ps.scan_pickle(io.BytesIO(data))
    assert time.monotonic() - start < 5
    assert scan.error and "copied or hashed" in scan.error
    assert "os.getcwd" in scan.globals


def test_paths_and_shared_params_lists_are_bounded():
    """A dict 23 deep under one 1 MiB key (23 MiB per path), and 40,000 param groups sharing
    one 40,000-long params list: bounded time and paths."""
    key = "k" * (1 << 20)
    node: dict[Any, Any] = {f"x{i}": None for i in range(2000)}
    for _ in range(23):
        node = {key: node}
    found = _audit_parts.Findings()
    start = time.monotonic()
    _audit_parts.find_parts(node, "f", found, None)
    params = list(range(40_000))
    opt = {"state": {}, "param_groups": [{"params": params} for _ in range(40_000)]}
    _audit_parts.find_parts(opt, "o", found, None)
    assert time.monotonic() - start < 5
    assert found.optimizer == [("o", True)]


def test_many_distinct_globals_are_listed_in_linear_time():
    data = b"".join(b"cm\nf%d\n0" % i for i in range(100_000)) + b"N."
    start = time.monotonic()
    scan = ps.scan_pickle(io.BytesIO(data))
    assert len(scan.globals) == 100_000 and time.monotonic() - start < 10


# -- Python 2 names ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["__builtin__.eval", "__builtin__.getattr", "commands.getoutput",
                                  "cPickle.loads", "__builtin__.__import__"])
def test_python2_names_are_judged_as_the_unpickler_maps_them(name):
    assert ps.classify(name) == "code" and ps.dangerous(name)


def test_python2_eval_is_dangerous_in_the_report(tmp_path, capsys):
    (tmp_path / "e.pkl").write_bytes(b"c__builtin__\neval\n(S'6*7'\ntR.")
    rc, doc = audit(tmp_path / "e.pkl", capsys)
    assert rc == 1 and doc["dangerous"] == ["__builtin__.eval"]


# -- DCP bytes entries ---------------------------------------------------------------------------


def _dcp(tmp_path: Path, **change: Any) -> Path:
    import dataclasses

    import torch
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2), "extra": {"step": 5}}, checkpoint_id=str(tmp_path / "d"))
    with open(tmp_path / "d" / ".metadata", "rb") as f:
        md = pickle.load(f)  # (our own file, written just above)
    for k, v in list(md.storage_data.items()):
        if type(md.state_dict_metadata[k.fqn]).__name__ == "BytesStorageMetadata":
            md.storage_data[k] = dataclasses.replace(v, **change)
    with open(tmp_path / "d" / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return tmp_path / "d"


@pytest.mark.parametrize("change,words", [
    ({"offset": 0, "length": -1}, "negative"), ({"offset": -5}, "negative"),
    ({"offset": 1 << 40}, "holds"), ({"relative_path": "fifo.distcp"}, "not a regular file"),
])
def test_dcp_bytes_entries_with_bad_ranges_or_a_fifo_are_flagged(tmp_path, capsys, change,
                                                                   words):
    folder = _dcp(tmp_path, **change)
    os.mkfifo(folder / "fifo.distcp")
    rc, doc = audit(folder, capsys)
    errors = [e for f in doc["files"] for e in f["errors"]]
    assert rc == 1 and any(words in e for e in errors), doc


def test_a_dcp_bytes_entry_that_is_a_plain_pickle_is_scanned(tmp_path, capsys):
    folder = _dcp(tmp_path)
    with open(folder / ".metadata", "rb") as f:
        md = pickle.load(f)
    for k, v in md.storage_data.items():
        if type(md.state_dict_metadata[k.fqn]).__name__ == "BytesStorageMetadata":
            with open(folder / v.relative_path, "r+b") as f:
                f.seek(v.offset)
                f.write(EVIL.ljust(v.length, b"\x00"))
    rc, doc = audit(folder, capsys)
    assert rc == 1 and "os.getcwd" in doc["would_import_code"], doc


# -- session 40: an archive that inflates to a GiB --------------------------------------------


def test_a_pickle_past_the_decoded_budget_is_flagged_without_reading_the_rest(monkeypatch):
    """A 1 MB archive whose data.pkl inflates to 1 GiB of one-byte instructions took 463 s to
    list its globals after the interpreter stopped: past `MAX_DECODED` instructions nothing
    more is read, and an unresolved global stands for what the rest could import (the file
    is flagged)."""
    monkeypatch.setattr(ps, "MAX_INSTRUCTIONS", 1000)
    monkeypatch.setattr(ps, "MAX_DECODED", 3000)
    early = ps.scan_pickle(io.BytesIO(b"\x80\x02" + b"]" * 1500 + EVIL))
    assert "os.getcwd" in early.globals and early.error  # (listed past the interpreter)
    read = io.BytesIO(b"\x80\x02" + b"]" * 10_000 + EVIL)
    late = ps.scan_pickle(read)
    assert late.error and "not read past byte 3001" in late.error, late.error  # (after PROTO)
    assert late.unresolved == 1 and read.tell() < 3100


def test_an_archive_member_inflating_to_more_than_is_held_is_scanned_as_it_is_read(
        tmp_path, capsys, monkeypatch):
    """A data.pkl larger than `_HELD_PICKLE_BYTES` is scanned from the archive as it inflates
    (its 1 GiB BINBYTES8 was read whole and copied: 2.1 GB for a 1 MB file): what follows a
    large argument is still found."""
    import zipfile

    monkeypatch.setattr(pfiles, "_HELD_PICKLE_BYTES", 1 << 10)
    big = b"\x80\x04\x8e" + struct.pack("<Q", 1 << 20) + bytes(1 << 20) + b"0" + EVIL
    with zipfile.ZipFile(tmp_path / "x.pt", "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", big)
        z.writestr("archive/version", "3\n")
    rc, doc = audit(tmp_path / "x.pt", capsys)
    assert rc == 1 and doc["would_import_code"] == ["os.getcwd"], doc
