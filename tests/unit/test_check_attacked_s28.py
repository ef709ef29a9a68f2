"""`unbroken check --reference` as session 28's outside review found it: a reference whose
records lost their digests compared nothing and passed a defective script (exit 0); a step
written as a string, a state of another type and a non-UTF-8 byte crashed deep inside the
comparison ("a bug in unbroken") or exited 1 as a problem found. Each is now refused before
any run, as an error of the check's use (exit 2), naming the line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from unbroken.cli import main
from unbroken.errors import CorruptCheckpoint
from unbroken.trace import read_trace

GOOD = {"event": "update", "step": 1, "epoch": 0, "lr": ["0x1p-3"], "opt_steps": 1,
        "ids": [0, 1], "batch": "b", "loss": "0x1p+0", "grad_norm": None, "metrics": {},
        "params": "p1", "buffers": None, "mode": "t", "state": {"optimizer": "o"},
        "rng": {"torch_cpu": "r"}}
RESTORE = {"event": "restore", "step": 0, "generation": None, "rejected": [], "params": "p0",
           "buffers": None, "mode": "t", "state": {}, "rng": {"torch_cpu": "r"}}


def _write(path: Path, records: list[dict[str, object]], raw: bytes = b"") -> Path:
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records) + raw)
    return path


@pytest.mark.parametrize("edit", [
    {"step": "3"}, {"step": True}, {"step": -1}, {"event": 5}, {"state": None},
    {"rng": ["x"]}, {"state": {"optimizer": 5}}, {"lr": "0x1p-3"}, {"ids": "0,1"},
    {"metrics": {"a": 1.5}}, {"opt_steps": 1.0}, {"params": None},
])
def test_a_record_of_other_types_is_corrupt_naming_its_line(tmp_path: Path,
                                                            edit: dict[str, object]) -> None:
    path = _write(tmp_path / "t.jsonl", [RESTORE, GOOD, {**GOOD, "step": 2, **edit}])
    with pytest.raises(CorruptCheckpoint, match=r"t\.jsonl:3: "):
        read_trace(path)


def test_a_trace_that_is_not_utf8_is_corrupt(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", [RESTORE, GOOD], b'{"event": "\xff"}\n')
    with pytest.raises(CorruptCheckpoint, match="not UTF-8"):
        read_trace(path)
    assert read_trace(_write(tmp_path / "ok.jsonl", [RESTORE, GOOD])) == [RESTORE, GOOD]


@pytest.mark.parametrize("case", ["bare", "typed", "utf8"])
def test_an_unusable_reference_is_refused_before_any_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    bare = {k: v for k, v in GOOD.items() if k not in ("params", "state", "rng")}
    path = {"bare": lambda: _write(tmp_path / "r.jsonl", [RESTORE, bare]),
            "typed": lambda: _write(tmp_path / "r.jsonl", [RESTORE, {**GOOD, "step": "1"}]),
            "utf8": lambda: _write(tmp_path / "r.jsonl", [RESTORE], b"\xff\n")}[case]()
    marker = tmp_path / "ran"
    script = f"open({str(marker)!r}, 'w').close()"
    code = main(["check", "--json", "--reference", str(path), "--at", "1", "--",
                 sys.executable, "-c", script])
    doc = json.loads(capsys.readouterr().out)
    assert code == 2 and not marker.exists(), doc
    assert {"bare": "holds no digests", "typed": "r.jsonl:2: step is '1'",
            "utf8": "not UTF-8"}[case] in doc["error"]


def test_a_kill_resumed_from_before_its_planned_save_is_not_covered() -> None:
    """Session 28: with async_save, a kill right after a save was requested resumed from the
    save before it (the requested one still persisting), and the place was listed as covered."""
    from unbroken.proof.checkplan import Kill
    from unbroken.proof.harness import KillResult, _expected

    saves = [5, 10, 15]
    assert _expected(Kill(6, "after-update"), saves) == 5
    assert _expected(Kill(10, "after-update"), saves) == 10
    assert _expected(Kill(10, "after-commit"), saves) == 10
    assert _expected(Kill(10, "mid-save"), saves) == 5
    assert _expected(Kill(10, "mid-update"), saves) == 5
    assert _expected(Kill(3, "after-update"), saves) == 0
    early = KillResult(Kill(6, "after-update"), reached=True, resumed_from=4, expected=5)
    assert not early.covered and early.to_json()["covered"] is False
    assert KillResult(Kill(6, "after-update"), reached=True, resumed_from=5, expected=5).covered
    assert KillResult(Kill(6, "after-update"), reached=True, resumed_from=4).covered  # unknown


def test_a_dropped_stream_that_does_not_exist_names_the_streams_that_do() -> None:
    """Session 28: the list offered 'cuda_device_count' and 'generators', which are not
    streams one can drop, and no registered generator by its droppable name."""
    import torch

    from unbroken.errors import UnbrokenError
    from unbroken.faults import drop_parts
    from unbroken.state import parts as S
    from unbroken.state.rng import RNGStreams

    streams = RNGStreams({"noise": torch.Generator()})
    parts = {S.RNG: streams}
    with pytest.raises(UnbrokenError) as e:
        drop_parts(parts, {S.RNG: streams.state_dict()}, "rng.nosuch")
    listed = str(e.value).split("streams: ")[1]
    assert "cuda_device_count" not in listed and "'generators'" not in listed
    assert "'torch_cpu'" in listed and "'generators.noise'" in listed
    ready = {S.RNG: streams.state_dict()}
    drop_parts(parts, ready, "rng.generators.noise")  # a registered generator: droppable
