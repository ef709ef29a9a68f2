"""The packing example resumes bitwise mid-document, in a fresh process after SIGKILL."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from conftest import run_script

from unbroken.proof.equivalence import compare
from unbroken.trace import read_trace

EXAMPLE = str(Path(__file__).parents[2] / "examples" / "train_packed_lm.py")


def test_packed_stream_resumes_mid_document(tmp_path):
    ref = tmp_path / "ref.jsonl"
    assert run_script(EXAMPLE, "--run", str(tmp_path / "ref"),
                      env={"UNBROKEN_TRACE": str(ref)}).returncode == 0
    killed, resumed = tmp_path / "killed.jsonl", tmp_path / "resumed.jsonl"
    r = run_script(EXAMPLE, "--run", str(tmp_path / "run"),
                   env={"UNBROKEN_TRACE": str(killed), "UNBROKEN_SAVE_AT": "17",
                        "UNBROKEN_KILL_AT": "step-done@19"})
    assert r.returncode == -signal.SIGKILL, r.stderr
    doc = json.loads((tmp_path / "run" / "gen-000000017" / "state.json").read_text())
    cursor = doc["parts"]["data"]
    assert cursor["offset"] > 0, "the save should fall inside a document"
    assert run_script(EXAMPLE, "--run", str(tmp_path / "run"),
                      env={"UNBROKEN_TRACE": str(resumed)}).returncode == 0
    result = compare(read_trace(ref), [read_trace(killed), read_trace(resumed)])
    assert result.resumed_from == 17
    assert result.verdict == "equivalent", result.first_divergence
    # Same rows (tokens) at every step, checked through the batch digests.
    assert all(r["batch"] for r in read_trace(resumed) if r["event"] == "update")
