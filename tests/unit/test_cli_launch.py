"""The command line's entry point and its documents (found from outside, twenty-third
session): a Ctrl-C before the command runs is one line, not a traceback; one after it
finished does not turn a reported success into exit 130; every --json document says ok."""

from __future__ import annotations

import argparse
import json
import signal

import pytest

import unbroken._launch as launch
import unbroken.cli
from unbroken._commands import emit


@pytest.fixture
def sigint():
    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("as_json", [False, True])
def test_an_interrupt_before_the_command_runs_is_one_line(
        monkeypatch, capsys, sigint, as_json: bool) -> None:
    def interrupted(argv=None):
        raise KeyboardInterrupt  # (as while `unbroken.cli` imports torch or the store)

    monkeypatch.setattr(unbroken.cli, "main", interrupted)
    code = launch.main(["inspect", "RUN", *(["--json"] if as_json else [])])
    out, err = capsys.readouterr()
    assert code == 130 and err == "unbroken: error: interrupted\n"
    if as_json:
        assert json.loads(out) == {"ok": False, "error": "interrupted", "exit_status": 130}
    else:
        assert out == ""


def test_after_the_command_a_ctrl_c_is_ignored(monkeypatch, sigint) -> None:
    monkeypatch.setattr(unbroken.cli, "main", lambda argv=None: 0)
    assert launch.main(["plan"]) == 0
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


@pytest.mark.parametrize("ok", [True, False])
def test_every_json_document_says_ok(capsys, ok: bool) -> None:
    args = argparse.Namespace(json=True)
    assert emit(args, {"imported": 3}, "text", ok) == (0 if ok else 1)
    assert json.loads(capsys.readouterr().out) == {"imported": 3, "ok": ok}
    emit(args, {"ok": True, "n": 1}, "text", True)  # (a document's own ok stays)
    assert json.loads(capsys.readouterr().out) == {"ok": True, "n": 1}


def test_the_launcher_guards_before_any_heavy_import() -> None:
    """The Ctrl-C handler is in place only once the package and the launcher are imported:
    they import no module the interpreter has not loaded already but a few small ones (not
    typing, ~8 ms, nor the enums of `signal`, ~4 ms), so the window left to Python's own
    start is as short as a package can make it."""
    import subprocess
    import sys

    code = ("import sys; before = set(sys.modules); import unbroken._launch; "
            "print(' '.join(sorted(set(sys.modules) - before)))")
    new = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    assert not {"typing", "enum", "signal", "json", "torch"} & set(new), new
    assert "unbroken._launch" in new
