"""The command line attacked from outside (twenty-third session, second pass): Ctrl-C at any
moment of a real process, the import document's ``ok``, verify-export's exit status for a
path with no export and for a tampered one, and a failed `unbroken check` run's output shown
in the message rather than a path inside the working folder it removed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import unbroken
import unbroken._launch as launch
from unbroken.cli import main

_SRC = str(Path(unbroken.__file__).resolve().parents[1])
_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (
    _SRC, os.environ.get("PYTHONPATH"))))}
# The launcher as the console script calls it, saying "ready" on stderr once it has put its
# handler in place: what comes before (the interpreter's start, pip's `import re`, the
# package root's imports) no code of the launcher reaches.
_DRIVER = """
import signal, sys
import unbroken._launch as L
real = signal.signal
def spy(sig, handler):
    before = real(sig, handler)
    if sig == signal.SIGINT and not getattr(spy, "told", False):
        spy.told = True
        sys.stderr.write("ready\\n")
        sys.stderr.flush()
    return before
signal.signal = spy
sys.exit(L.main())
"""
_DELAYS = (0.002, 0.01, 0.03, 0.06, 0.1, 0.2)


def _our_traceback(err: str) -> bool:
    """A traceback raised once unbroken's launcher had control (not in Python's own start)."""
    return "Exception ignored" in err or "Traceback" in err and (
        "_launch.py\", line" in err and ", in main" in err or "unbroken/cli.py" in err)


def _interrupt(argv: list[str], delay: float, ready: bool) -> tuple[int, str]:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, env=_ENV)
    assert proc.stderr is not None
    first = proc.stderr.readline() if ready else ""
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=60)[1]
    return proc.returncode, ("" if first == "ready\n" else first) + rest


def test_a_ctrl_c_at_any_moment_after_the_launcher_is_no_traceback(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", _DRIVER, "inspect", str(tmp_path / "nothing")]
    normal = subprocess.run(argv, capture_output=True, text=True, env=_ENV, timeout=60)
    assert normal.returncode == 2
    for delay in _DELAYS:
        code, err = _interrupt(argv, delay, ready=True)
        assert "Traceback" not in err and "Exception ignored" not in err, (delay, err)
        assert code == normal.returncode or code == 130 and err.endswith(
            "unbroken: error: interrupted\n"), (delay, code, err)


def test_python_m_unbroken_interrupted_early_prints_no_traceback_of_its_own(
        tmp_path: Path) -> None:
    """As the console script: only Python's own start, before `unbroken._launch` runs, may
    still end in a traceback (an interrupt there is Python's, whatever the package)."""
    argv = [sys.executable, "-m", "unbroken", "inspect", str(tmp_path / "nothing")]
    for delay in (0.05, 0.1, 0.15, 0.2, 0.3):
        code, err = _interrupt(argv, delay, ready=False)
        assert not _our_traceback(err), (delay, err)
        if "Traceback" not in err:
            assert code in (2, 130), (delay, code, err)


def test_an_interrupt_python_could_not_raise_is_raised_again(monkeypatch) -> None:
    """A KeyboardInterrupt in a weakref callback (the import machinery's) is "Exception
    ignored" and lost; the launcher's hook delivers it again, to the command itself."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        hook = type("Args", (), {"exc_type": KeyboardInterrupt,
                                 "exc_value": KeyboardInterrupt(), "exc_traceback": None,
                                 "err_msg": None, "object": None})()
        with pytest.raises(KeyboardInterrupt):
            launch._unraisable(hook)
            for _ in range(1000):  # (the handler runs between two bytecodes)
                pass
    finally:
        signal.signal(signal.SIGINT, before)


def test_import_json_says_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_file({"w": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    code = main(["import", str(tmp_path / "w.safetensors"), str(tmp_path / "run"), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["ok"] is True and doc["tensors"] == 1
    code = main(["import", str(tmp_path / "w.safetensors"), str(tmp_path / "run"), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 2 and doc["ok"] is False and "error" in doc  # (the run holds one already)


def _exported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=model, every=1)
    ckpt.step_done(1)
    ckpt.close()
    (tmp_path / "attacked_factory.py").write_text(
        "import torch\ndef make():\n    return torch.nn.Linear(3, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "exp"
    assert main(["export", str(tmp_path / "run"), str(out)]) == 0
    return out


def test_verify_export_exits_2_for_no_export_and_1_for_a_tampered_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = _exported(tmp_path, monkeypatch)
    factory = ["--factory", "attacked_factory:make"]
    assert main(["verify-export", str(out), *factory]) == 0
    for missing in (tmp_path / "does" / "not" / "exist", tmp_path / "attacked_factory.py"):
        capsys.readouterr()
        assert main(["verify-export", str(missing), *factory, "--json"]) == 2, missing
        assert json.loads(capsys.readouterr().out)["ok"] is False
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify-export", str(out), *factory, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False
    (out / "export.json").write_text("{not json")
    assert main(["verify-export", str(out), *factory]) == 1


def test_a_failed_check_run_shows_its_output_not_a_path_it_removed(
        capsys: pytest.CaptureFixture[str]) -> None:
    script = "import sys\nfor i in range(1, 61): print(f'line {i:02d} of the script')\nsys.exit(3)"
    code = main(["check", "--random", "0", "--", sys.executable, "-c", script])
    out = capsys.readouterr().out  # (a failed run of the script is a report: exit 1)
    assert code == 1 and "exited with 3" in out, out
    assert "line 60 of the script" in out and "line 21 of the script" in out, out
    assert "line 20 of the script" not in out  # (the last 40 lines)
    # (the folder was removed: no log of it is named, as a log to open)
    assert "unbroken-check-" not in out and "output.log" not in out
    assert "rerun with --keep" in out
    code = main(["check", "--random", "0", "--", sys.executable, "-c", "pass"])
    err = capsys.readouterr().err
    assert code == 2 and "wrote no trace" in err and "printed nothing" in err, err
    assert "unbroken-check-" not in err
