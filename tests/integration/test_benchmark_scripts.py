"""The benchmark scripts still run against the library as it is (they reach into a save in
flight, as no user does: a change there broke `loop.py` silently once). Tiny sizes: what is
checked is that every method runs and reports, not its speed (never timed in tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

RUNS = {
    "loop": ["loop.py", "--size", "1M", "--width", "32", "--steps", "4", "--every", "2",
             "--repeats", "1", "--warmup", "0",
             "--modes", "none,unbroken-async,unbroken-process"],
    "save_load": ["save_load.py", "--sizes", "1M", "--small", "64", "--frozen", "0",
                  "--repeats", "1", "--warmup", "0", "--methods",
                  "unbroken,unbroken-async,unbroken-process,memcpy"],
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_benchmark_runs_every_method_and_reports(tmp_path, name):
    script, *args = RUNS[name]
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, str(BENCHMARKS / script), *args, "--dir",
                        str(tmp_path), "--out", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    text = json.dumps(doc)
    for method in ("unbroken-async" if name == "loop" else "unbroken async",
                   "unbroken-process" if name == "loop" else "unbroken process"):
        assert method in text, (method, text[:2000])
