"""The README's loop runs as written (smaller), and resumes exactly after a kill."""

from __future__ import annotations

import re
import signal
from pathlib import Path

from conftest import run_script

from unbroken.proof.equivalence import compare
from unbroken.trace import read_trace

README = Path(__file__).parents[2] / "README.md"


def loop_script(tmp_path: Path) -> str:
    code = re.search(r"## A plain PyTorch loop\s+```python\n(.*?)```", README.read_text(),
                     re.S).group(1)
    assert code.count("\n") <= 30, "the README promises a short loop"
    code = (code.replace("4096", "512").replace("loader.epoch < 10", "loader.epoch < 2")
            .replace('"runs/exp1"', repr(str(tmp_path / "run"))).replace("every=200", "every=7"))
    path = tmp_path / "readme_loop.py"
    path.write_text("import random, numpy\nrandom.seed(0); numpy.random.seed(0)\n"
                    "import torch\ntorch.manual_seed(0)\n" + code)
    return str(path)


def test_readme_loop_resumes_exactly(tmp_path):
    script = loop_script(tmp_path)
    ref = tmp_path / "ref.jsonl"
    r = run_script(script, env={"UNBROKEN_TRACE": str(ref), "UNBROKEN_ROOT": str(tmp_path / "ref")})
    assert r.returncode == 0, r.stderr
    killed, resumed = tmp_path / "killed.jsonl", tmp_path / "resumed.jsonl"
    r = run_script(script, env={"UNBROKEN_TRACE": str(killed), "UNBROKEN_KILL_AT": "step-done@12"})
    assert r.returncode == -signal.SIGKILL, r.stderr
    r = run_script(script, env={"UNBROKEN_TRACE": str(resumed)})
    assert r.returncode == 0, r.stderr
    result = compare(read_trace(ref), [read_trace(killed), read_trace(resumed)])
    assert result.resumed_from == 7 and result.verdict == "equivalent", result.first_divergence


def test_readme_loop_stops_on_sigterm_and_resumes_exactly(tmp_path):
    script = loop_script(tmp_path)
    ref = tmp_path / "ref.jsonl"
    r = run_script(script, env={"UNBROKEN_TRACE": str(ref), "UNBROKEN_ROOT": str(tmp_path / "ref")})
    assert r.returncode == 0, r.stderr
    stopped, resumed = tmp_path / "stopped.jsonl", tmp_path / "resumed.jsonl"
    r = run_script(script, env={"UNBROKEN_TRACE": str(stopped), "UNBROKEN_SIGNAL_AT": "10"})
    assert r.returncode == 0, r.stderr  # saved at the boundary and left the loop
    assert [x["step"] for x in read_trace(stopped) if x["event"] == "stop"] == [10]
    r = run_script(script, env={"UNBROKEN_TRACE": str(resumed)})
    assert r.returncode == 0, r.stderr
    result = compare(read_trace(ref), [read_trace(stopped), read_trace(resumed)])
    assert result.resumed_from == 10 and result.verdict == "equivalent", result.first_divergence
