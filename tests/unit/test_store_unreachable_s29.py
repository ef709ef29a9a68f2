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


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_read_the_store_cannot_serve_now_moves_nothing(url, monkeypatch, failure):
    _save(url)
    _failing_reads(monkeypatch, FAILURES[failure])
    ckpt = unbroken.Checkpointer(url, model=torch.nn.Linear(4, 4))
    with pytest.raises(RunUnreadable) as e:
        ckpt.restore()
    ckpt.close()
    assert NEWEST in str(e.value) and "not judged" in str(e.value)
    monkeypatch.undo()
    assert [g.name for g in ckpt.store.scan()] == ["gen-000000001", "gen-000000002", NEWEST]
    assert not ckpt.store.aside()
    fresh = unbroken.Checkpointer(url, model=torch.nn.Linear(4, 4))
    assert fresh.restore() == 3  # (the store answers again: nothing was lost)
    fresh.close()


def test_verify_calls_it_unreadable_with_exit_2(url, monkeypatch, capsys):
    _save(url)
    _failing_reads(monkeypatch, FAILURES["slow_down"])
    capsys.readouterr()
    assert main(["verify", url]) == 2
    assert "unreadable" in capsys.readouterr().out


def test_a_checksum_the_client_checked_still_judges_the_bytes(url, monkeypatch):
    _save(url)
    _failing_reads(monkeypatch, lambda: FlexibleChecksumError("Expected checksum X, got Y"))
    ckpt = unbroken.Checkpointer(url, model=torch.nn.Linear(4, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ckpt.restore() == 2
    ckpt.close()
    assert [e.reason for e in ckpt.store.aside()] == ["corrupt"]
