"""An object store that cannot serve a read now (503 SlowDown, 500 InternalError, a client
library's own connection error) says nothing of the object's bytes: the generation is not
judged corrupt, moved aside and rolled back over (the newest updates lost to a throttled
request), but left as it is with `RunUnreadable` naming the object, as a local permission
error is. A checksum the client checked on the bytes it received still judges them."""

from __future__ import annotations

import errno
import uuid
import warnings
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

import unbroken
from unbroken.cli import main
from unbroken.errors import RunUnreadable

NEWEST = "gen-000000003"


class EndpointConnectionError(Exception):
    """What botocore raises (not an OSError) when the endpoint does not answer."""


class FlexibleChecksumError(Exception):
    """What botocore raises when the bytes it received fail the object's checksum."""


FAILURES: dict[str, Any] = {
    "slow_down": lambda: OSError(errno.EBUSY, "Please reduce your request rate."),
    "internal_error": lambda: OSError(errno.EREMOTEIO, "We encountered an internal error."),
    "client_connection": lambda: EndpointConnectionError("Could not connect to the endpoint"),
}


@pytest.fixture
def url():
    u = f"memory://unbroken-tests/{uuid.uuid4().hex}"
    yield u
    fs = fsspec.filesystem("memory")
    for key in fs.find(u):
        fs.rm_file(key)


def _save(url: str) -> None:
    """Three generations of a small model at ``url`` (a store's URL or a local folder)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    ckpt = unbroken.Checkpointer(url, model=model, keep=unbroken.Keep(last=5),
                                 read_back="sync")
    ckpt.restore()
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.add_(1.0)
        ckpt.save(step)
    ckpt.close()


def _failing_reads(monkeypatch: pytest.MonkeyPatch, make: Any) -> None:
    """Every ranged read of a state file of the newest generation (its manifest aside:
    listing reads it) fails with ``make()``."""
    real = MemoryFileSystem.cat_ranges

    def cat_ranges(self: Any, paths: list[str], *a: Any, **k: Any) -> Any:
        if any(f"/{NEWEST}/" in p and not p.endswith("MANIFEST.json") for p in paths):
            raise make()
        return real(self, paths, *a, **k)

    monkeypatch.setattr(MemoryFileSystem, "cat_ranges", cat_ranges)


def _moves_nothing(url: str, monkeypatch: pytest.MonkeyPatch, make: Any) -> None:
    """Reads of the newest generation failing with ``make()``: the restore raises
    `RunUnreadable` naming it, nothing is moved, and once the store answers again the
    newest generation restores (nothing was lost)."""
    _save(url)
    _failing_reads(monkeypatch, make)
    ckpt = unbroken.Checkpointer(url, model=torch.nn.Linear(4, 4))
    with pytest.raises(RunUnreadable) as e:
        ckpt.restore()
    ckpt.close()
    assert NEWEST in str(e.value) and "not judged" in str(e.value)
    monkeypatch.undo()
    assert [g.name for g in ckpt.store.scan()] == ["gen-000000001", "gen-000000002", NEWEST]
    assert not ckpt.store.aside()
    fresh = unbroken.Checkpointer(url, model=torch.nn.Linear(4, 4))
    assert fresh.restore() == 3
    fresh.close()


def _judged(url: str, monkeypatch: pytest.MonkeyPatch, make: Any) -> None:
    """Reads of the newest generation failing with ``make()``, a verdict on the bytes: the
    generation is moved aside as corrupt and the restore falls back to the previous one."""
    _save(url)
    _failing_reads(monkeypatch, make)
    ckpt = unbroken.Checkpointer(url, model=torch.nn.Linear(4, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ckpt.restore() == 2
    ckpt.close()
    assert [e.reason for e in ckpt.store.aside()] == ["corrupt"]


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_read_the_store_cannot_serve_now_moves_nothing(url, monkeypatch, failure):
    _moves_nothing(url, monkeypatch, FAILURES[failure])


def test_verify_calls_it_unreadable_with_exit_2(url, monkeypatch, capsys):
    _save(url)
    _failing_reads(monkeypatch, FAILURES["slow_down"])
    capsys.readouterr()
    assert main(["verify", url]) == 2
    assert "unreadable" in capsys.readouterr().out


def test_a_checksum_the_client_checked_still_judges_the_bytes(url, monkeypatch):
    _judged(url, monkeypatch, lambda: FlexibleChecksumError("Expected checksum X, got Y"))


# -- found by the outside review of the change ---------------------------------------------------


def _s3fs_error(code: str) -> OSError:
    """What s3fs raises for a server's answer: its own translation of botocore's error."""
    import botocore.exceptions
    from s3fs.errors import translate_boto_error

    status = int(code) if code.isdigit() else 503
    return translate_boto_error(botocore.exceptions.ClientError(
        {"Error": {"Code": code, "Message": f"upstream said {code}"},
         "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject"))


def _transport_errors() -> dict[str, Any]:
    import ssl

    import aiohttp
    import requests

    return {"requests_timeout": lambda: requests.exceptions.ReadTimeout("read timed out"),
            "requests_connection": lambda: requests.exceptions.ConnectionError("reset"),
            "aiohttp": lambda: aiohttp.ClientOSError(),
            "ssl_eof": lambda: ssl.SSLEOFError(8, "EOF occurred in violation of protocol")}


@pytest.mark.parametrize("code", ["502", "504", "429", "Throttling", "RequestLimitExceeded"])
def test_a_server_answer_s3fs_does_not_map_moves_nothing(url, monkeypatch, code):
    """s3fs makes EIO of the codes it does not know (a proxy's 502, a 429): the server's
    answer, not the object's bytes."""
    _moves_nothing(url, monkeypatch, lambda: _s3fs_error(code))


@pytest.mark.parametrize("kind", ["requests_timeout", "requests_connection", "aiohttp",
                                  "ssl_eof"])
def test_a_transport_error_without_an_errno_moves_nothing(url, monkeypatch, kind):
    _moves_nothing(url, monkeypatch, _transport_errors()[kind])


class DataCorruption(Exception):
    """google-resumable-media's verdict on a download's checksum."""


class AzureError(Exception):
    """azure-core's error type, here for an MD5 mismatch."""


@pytest.mark.parametrize("make", [lambda: DataCorruption("Checksum mismatch while downloading"),
                                  lambda: AzureError("MD5 mismatch. Expected 'x==', got 'y=='")])
def test_other_clients_verdicts_on_the_bytes_still_judge_them(url, monkeypatch, make):
    _judged(url, monkeypatch, make)


def _local_run(tmp_path) -> str:
    root = str(tmp_path / "run")
    _save(root)
    return root


@pytest.mark.parametrize("which", ["read_file", "map_file"])
def test_verify_calls_a_second_read_refused_by_the_machine_unreadable(
        tmp_path, monkeypatch, capsys, which):
    """verify hashes every file, then reads or maps it again to decode it: an error of the
    machine or store there is no verdict on the bytes (exit 2, not corrupt with exit 1)."""
    from unbroken.store.backends.local import LocalFS

    root = _local_run(tmp_path)
    real = getattr(LocalFS, which)

    def failing(self: Any, path: str, *a: Any, **k: Any) -> Any:
        if NEWEST in path and not path.endswith("MANIFEST.json"):
            raise OSError(errno.EBUSY, "Device or resource busy", path)
        return real(self, path, *a, **k)

    monkeypatch.setattr(LocalFS, which, failing)
    capsys.readouterr()
    assert main(["verify", root]) == 2
    assert "unreadable" in capsys.readouterr().out


def test_a_flapping_stale_handle_in_listing_neither_drops_nor_moves_the_newest(
        tmp_path, monkeypatch):
    """The manifest read fails with ESTALE and the existence check right after fails too:
    ``os.path.lexists`` says False for any error, so listing took the generation for deleted
    (the restore silently used the older one) and the next save moved it aside as torn."""
    import os

    from unbroken.store.backends.local import LocalFS

    root = _local_run(tmp_path)
    stale = [False]
    real_read, real_lstat = LocalFS.read_file, os.lstat

    def read_file(self: Any, path: str, *a: Any, **k: Any) -> Any:
        if NEWEST in path:
            stale[0] = True
            raise OSError(errno.ESTALE, "Stale file handle", path)
        return real_read(self, path, *a, **k)

    def lstat(path: Any, *a: Any, **k: Any) -> Any:
        if stale[0] and NEWEST in os.fspath(path):
            stale[0] = False
            raise OSError(errno.ESTALE, "Stale file handle", os.fspath(path))
        return real_lstat(path, *a, **k)

    monkeypatch.setattr(LocalFS, "read_file", read_file)
    monkeypatch.setattr(os, "lstat", lstat)
    ckpt = unbroken.Checkpointer(root, model=torch.nn.Linear(4, 4))
    with pytest.raises(RunUnreadable, match=NEWEST):
        ckpt.restore()
    ckpt.close()
    monkeypatch.undo()
    assert sorted(os.listdir(root)) == ["LOCK", "RUN.json", "gen-000000001", "gen-000000002",
                                        NEWEST]
