"""``unbroken inspect`` in a loop beside a real writer whose retention (``Keep(last=2)``)
deletes a generation at every save: every inspect exits 0 (one listed while its folder was
being deleted is "deleted while checked", never "torn"). Before the fix, about 6% of such
inspects exited 1."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from unbroken.cli import main


def test_inspect_in_a_loop_beside_a_real_writer_never_says_torn(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import torch, unbroken
        model = torch.nn.Linear(64, 64)
        with unbroken.Checkpointer({str(run)!r}, model=model,
                                   keep=unbroken.Keep(last=2)) as ckpt:
            for step in range(1, 201):
                with torch.no_grad():
                    model.weight.add_(1)
                ckpt.save(step)
        """)])
    failed: list[list[Any]] = []
    listed = 0
    try:
        deadline = time.monotonic() + 120
        while writer.poll() is None and time.monotonic() < deadline:
            if not (run / "RUN.json").exists():
                time.sleep(0.01)
                continue
            capsys.readouterr()
            code = main(["inspect", str(run), "--json"])
            doc = json.loads(capsys.readouterr().out)
            listed += 1
            if code != 0:
                failed.append([(g["generation"], g["status"], g["reason"])
                               for g in doc["generations"] if g["status"] != "complete"])
    finally:
        writer.kill()
        writer.wait()
    assert listed >= 50, listed
    assert failed == []
