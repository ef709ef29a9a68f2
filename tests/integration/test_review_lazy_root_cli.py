"""Review attacks on the lazy package root (PEP 562) and the torch-free `unbroken inspect`.

Every check that needs a fresh interpreter runs in a subprocess with a timeout."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

GEN = "gen-000000001"
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ,
       "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}

# run the CLI in a fresh interpreter; an atexit hook reports whether torch was ever imported
_CLI = textwrap.dedent("""
    import atexit, json, runpy, sys
    argv = json.loads(sys.argv[1])
    atexit.register(lambda: print("@@TORCH=%s" % ("torch" in sys.modules), file=sys.stderr))
    sys.argv = ["unbroken", *argv]
    runpy.run_module("unbroken", run_name="__main__", alter_sys=True)
""")


def py(code: str, timeout: float = 60, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def cli(*argv: str, timeout: float = 60) -> tuple[int, str, str, bool]:
    """(exit status, stdout, stderr without the probe line, torch imported)."""
    r = py(_CLI, timeout, json.dumps(list(argv)))
    m = re.search(r"@@TORCH=(True|False)", r.stderr)
    assert m, r.stderr
    return r.returncode, r.stdout, r.stderr.replace(m.group(0), ""), m.group(1) == "True"


# -- 1. the lazy root --------------------------------------------------------------------------


def test_root_import_is_torch_free_and_names_resolve() -> None:
    r = py("""
        import importlib, sys
        import unbroken
        assert "torch" not in sys.modules, "import unbroken imported torch"
        assert unbroken.__version__ and isinstance(unbroken.__version__, str)
        assert set(unbroken.__all__) - {"__version__"} == set(unbroken._WHERE), "_WHERE != __all__"
        assert len(unbroken.__all__) == len(set(unbroken.__all__))
        missing = set(unbroken.__all__) - set(dir(unbroken))
        assert not missing, missing
        for name in unbroken.__all__:
            assert getattr(unbroken, name) is not None, name
        for name, where in unbroken._WHERE.items():
            real = importlib.import_module(where, "unbroken")
            assert getattr(unbroken, name) is getattr(real, name), name
        from unbroken.checkpointer import Checkpointer
        assert unbroken.Checkpointer is Checkpointer
        assert "torch" in sys.modules
        ns = {}
        exec("from unbroken import *", ns)
        assert sorted(k for k in ns if k != "__builtins__") == sorted(unbroken.__all__)
        import contextlib, io, pydoc
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            help(unbroken)
        assert "Checkpointer" in buf.getvalue() and "verify_export" in buf.getvalue()
        assert "Checkpointer" in pydoc.render_doc(unbroken, renderer=pydoc.plaintext)
        print("OK")
    """)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


def test_unknown_attribute_is_a_plain_attribute_error() -> None:
    r = py("""
        import sys, unbroken
        assert not hasattr(unbroken, "no_such_name")
        assert not hasattr(unbroken, "__wrapped__")
        try:
            unbroken.no_such_name
        except AttributeError as e:
            assert str(e) == "module 'unbroken' has no attribute 'no_such_name'", str(e)
        else:
            raise AssertionError("no AttributeError")
        try:
            from unbroken import no_such_name
        except ImportError as e:
            assert "no_such_name" in str(e), str(e)
        else:
            raise AssertionError("no ImportError")
        assert getattr(unbroken, "no_such_name", 7) == 7
        assert "torch" not in sys.modules
        print("OK")
    """)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


def test_submodule_import_then_parent_attribute() -> None:
    r = py("""
        import unbroken.state.codec
        import unbroken
        assert unbroken.state.codec.__name__ == "unbroken.state.codec"
        assert unbroken.state.__name__ == "unbroken.state"
        assert unbroken.Identity is unbroken.state.identity.Identity
        print("OK")
    """)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


@pytest.mark.parametrize("name", ["UnbrokenError", "Keep"])
def test_torch_free_names_stay_torch_free(name: str) -> None:
    r = py(f"""
        import sys, unbroken
        unbroken.{name}
        print("torch" in sys.modules)
    """)
    assert r.returncode == 0 and r.stdout.strip() == "False", (r.stdout, r.stderr)


@pytest.mark.parametrize("name", ["verify_export"])
def test_torch_needing_names_import_it_on_first_use(name: str) -> None:
    r = py(f"""
        import sys, unbroken
        before = "torch" in sys.modules
        obj = unbroken.{name}
        print(before, "torch" in sys.modules, obj.__name__)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True", name]


def test_concurrent_first_resolution_from_8_threads() -> None:
    r = py("""
        import threading, unbroken
        names = list(unbroken.__all__)
        barrier = threading.Barrier(8)
        results, errors = {}, []
        def work(i):
            order = names if i % 2 else names[::-1]
            barrier.wait()
            try:
                results[i] = {n: getattr(unbroken, n) for n in order}
            except BaseException as e:
                errors.append(f"{type(e).__name__}: {e}")
        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(8)]
        for t in threads: t.start()
        for t in threads: t.join(90)
        assert not any(t.is_alive() for t in threads), "deadlock"
        assert not errors, errors
        assert len(results) == 8
        for r in results.values():
            assert all(r[n] is results[0][n] for n in names)
        print("OK")
    """, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


# -- 2. the command line -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def commands() -> list[str]:
    code, out, err, _ = cli("--help")
    assert code == 0 and out.startswith("usage: unbroken"), err
    block = out.split("positional arguments:")[1].split("options:")[0]
    names = re.findall(r"^    ([a-z][a-z-]*)", block, re.M)
    assert {"inspect", "verify", "check", "demo"} <= set(names), names
    return names


def test_every_command_help_and_takes_json(commands: list[str]) -> None:
    r = py("""
        import contextlib, io, json, sys
        from unbroken.cli import main
        out = {}
        for name in json.loads(sys.argv[1]):
            buf, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
                code = main([name, "--help"])
            out[name] = [code, buf.getvalue(), err.getvalue()]
        print(json.dumps(out))
    """, 120, json.dumps(commands))
    assert r.returncode == 0, r.stderr
    for name, (code, text, err) in json.loads(r.stdout.splitlines()[-1]).items():
        assert code == 0, (name, err)
        assert text.startswith(f"usage: unbroken {name}"), (name, text[:200])
        assert "--json" in text, f"{name} --help lists no --json"
        assert "Traceback" not in err


def test_inspect_help_is_torch_free() -> None:
    code, out, err, torch = cli("inspect", "--help")
    assert code == 0 and out.startswith("usage: unbroken inspect") and "--json" in out
    assert not torch


def test_unknown_command(commands: list[str]) -> None:
    code, out, err, _ = cli("no-such-command", "x")
    assert code == 2 and "Traceback" not in err
    assert "no-such-command" in err
    assert all(c in err for c in commands), err


def test_no_arguments_and_version() -> None:
    code, out, err, _ = cli()
    assert code == 2 and "usage: unbroken" in err and "Traceback" not in err
    code, out, err, _ = cli("--version")
    assert code == 0 and out.strip() == "unbroken 0.1.0", (out, err)


def test_python_dash_m_and_console_script() -> None:
    r = subprocess.run([sys.executable, "-m", "unbroken", "--help"], env=ENV,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("usage: unbroken")
    script = Path(sys.executable).parent / "unbroken"
    if script.exists():
        r = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.startswith("usage: unbroken")


@pytest.mark.parametrize("argv", [["inspect", "--json"],
                                  ["verify", "RUN", "--json", "--generation", "abc"],
                                  ["inspect", "RUN", "--json", "--bogus"]])
def test_json_usage_errors_print_one_document(argv: list[str], tmp_path: Path) -> None:
    argv = [str(tmp_path) if a == "RUN" else a for a in argv]
    code, out, err, _ = cli(*argv)
    assert code == 2 and "Traceback" not in err
    doc = json.loads(out)
    assert doc["ok"] is False and doc["exit_status"] == 2
    assert doc["error"].startswith("unbroken") and doc["error"].split(": ", 1)[1] in err


# -- hostile run folders -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("real") / "run"
    r = py(f"""
        import torch, unbroken
        m = torch.nn.Linear(2, 2)
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        c = unbroken.Checkpointer({str(root)!r}, model=m, optimizer=o)
        c.save(1)
        c.close()
    """, 120)
    assert r.returncode == 0, r.stderr
    assert (root / GEN / "MANIFEST.json").is_file()
    return root


# name -> (expected exit status, text every report must contain)
CASES: dict[str, tuple[int, str]] = {
    "missing": (2, "no such run folder"), "afile": (2, "not a folder"), "empty": (0, ""),
    "real": (0, ""), "notjson": (1, "MANIFEST.json"), "nonutf8": (1, "MANIFEST.json"),
    "types_step": (1, "'step'"), "types_artifacts": (1, "'artifacts'"),
    "types_entry": (1, "MANIFEST.json"), "toplist": (1, "MANIFEST.json"),
    "deepjson": (1, "MANIFEST.json"), "dotdot": (1, "../../etc/passwd"),
    "artdir": (1, "model.safetensors"), "fifo": (1, "model.safetensors"),
    "fifo_manifest": (1, "MANIFEST.json"), "zero_manifest": (1, "MANIFEST.json"),
    "symlink_out": (1, "model.safetensors"), "symlink_gen": (1, GEN),
    "truncated": (1, "model.safetensors"), "torn_extra": (1, "gen-000000009"),
}


@pytest.fixture(scope="module")
def hostile(real_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from unbroken.store.manifest import seal

    base = tmp_path_factory.mktemp("hostile")
    man = json.loads((real_run / GEN / "MANIFEST.json").read_bytes())

    def clone(name: str) -> Path:
        d = base / name
        shutil.copytree(real_run, d, symlinks=True)
        return d

    def manifest(name: str, data: bytes) -> None:
        (clone(name) / GEN / "MANIFEST.json").write_bytes(data)

    (base / "afile").write_text("x")
    (base / "empty").mkdir()
    clone("real")
    manifest("notjson", b"{not json")
    manifest("nonutf8", b"\xff\xfe\x00garbage")
    manifest("types_step", seal({**man, "step": "one"}))
    manifest("types_artifacts", seal({**man, "artifacts": 5}))
    manifest("types_entry", seal({**man, "artifacts": [{"name": 3, "size": "x",
                                                         "xxh3_128": None}]}))
    manifest("toplist", b"[1, 2]")
    manifest("deepjson", b"[" * 100_000 + b"]" * 100_000)
    manifest("dotdot", seal({**man, "artifacts": [{"name": "../../etc/passwd", "size": 1,
                                                     "xxh3_128": "0" * 32}]}))
    for name, make in [("artdir", os.mkdir), ("fifo", os.mkfifo)]:
        target = clone(name) / GEN / "model.safetensors"
        target.unlink()
        make(target)
    target = clone("fifo_manifest") / GEN / "MANIFEST.json"
    target.unlink()
    os.mkfifo(target)
    target = clone("zero_manifest") / GEN / "MANIFEST.json"
    target.unlink()
    target.symlink_to("/dev/zero")
    target = clone("symlink_out") / GEN / "model.safetensors"
    shutil.move(target, base / "outside.safetensors")
    target.symlink_to(base / "outside.safetensors")
    d = clone("symlink_gen")
    shutil.move(d / GEN, base / "outside_gen")
    (d / GEN).symlink_to(base / "outside_gen")
    with open(clone("truncated") / GEN / "model.safetensors", "r+b") as f:
        f.truncate(10)
    (clone("torn_extra") / "gen-000000009").mkdir()
    return base


_ALL_CASES = """
    import contextlib, io, json, signal, sys
    from unbroken.cli import main
    command, base, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    as_json = sys.argv[4] == "1"
    def hang(*_):
        raise TimeoutError("hang")
    signal.signal(signal.SIGALRM, hang)
    res = {}
    for case in cases:
        out, err = io.StringIO(), io.StringIO()
        signal.alarm(20)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main([command, f"{base}/{case}", *(["--json"] if as_json else [])])
        except BaseException as e:
            code = f"raised {type(e).__name__}: {e}"
        signal.alarm(0)
        res[case] = [code, out.getvalue(), err.getvalue()]
    print("@@" + json.dumps({"results": res, "torch": "torch" in sys.modules}))
"""


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_hostile_folders(hostile: Path, command: str, as_json: bool) -> None:
    """Every hostile case in one interpreter per command and mode (a fresh one per case
    costs a second each): the exit status, one JSON document, no traceback, the offending
    file named, no hang; and ``inspect`` never imported torch for any of them."""
    r = py(_ALL_CASES, 240, command, str(hostile), json.dumps(sorted(CASES)),
           "1" if as_json else "0")
    assert r.returncode == 0, r.stderr[-2000:]
    done = json.loads(r.stdout.rsplit("@@", 1)[1])
    if command == "inspect":
        assert not done["torch"], "unbroken inspect imported torch"
    wrong = {}
    for case, (code, out, err) in done["results"].items():
        expected, needle = CASES[case]
        if case == "empty" and command == "verify":  # (nothing to verify is no pass)
            expected, needle = 2, "not a run folder"
        problems = []
        if code != expected:
            problems.append(f"exit {code}, expected {expected}")
        if "Traceback" in err or "unexpected" in err:
            problems.append(f"stderr: {err[-300:]}")
        if as_json:
            try:
                doc = json.loads(out)
                if doc["ok"] is not (expected == 0):
                    problems.append(f"ok={doc['ok']}")
                if expected == 2 and (doc["exit_status"] != 2 or needle not in doc["error"]):
                    problems.append(f"error document: {doc}")
            except ValueError as e:
                problems.append(f"not one JSON document: {e}")
        if needle not in out + err:
            problems.append(f"{needle!r} not named: {(out + err)[-300:]}")
        if problems:
            wrong[case] = problems
    assert not wrong, wrong


def test_inspect_real_run_json_and_importtime(real_run: Path) -> None:
    code, out, err, torch = cli("inspect", str(real_run), "--json")
    doc = json.loads(out)
    assert code == 0 and not torch and doc["ok"] is True
    assert [g["status"] for g in doc["generations"]] == ["complete"]
    assert doc["newest_complete"] is not None
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "unbroken", "inspect",
                        str(real_run)], env=ENV, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines()
                if line.startswith("import time:")}
    assert "torch" not in imported and not any(m.startswith("torch.") for m in imported)
    assert "unbroken.cli" in imported
    assert not any(m.startswith("unbroken.tools.") for m in imported), imported
