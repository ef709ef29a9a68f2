from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"


def run_script(name: str, *args: str, env: dict[str, str] | None = None,
               timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run a script from tests/integration/scripts in a fresh interpreter, in its own process
    group (a SIGKILL of the group then takes any workers with it)."""
    return subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})},
                          start_new_session=True)


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def script():
    return run_script
