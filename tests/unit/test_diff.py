"""``unbroken diff``: which tensors, counters, streams and learning rates differ between two
generations, read from verified bytes only; exit 0 equal, 1 different, 2 bad input."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import unbroken
from unbroken.cli import main
from unbroken.tools.diff import leaf_diff, split_generation, tensor_diff


class Cursor:
    """A data part: its position advances with every batch."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "order": list(range(1000))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


class Ema:
    """An extra part with a tensor."""

    def __init__(self) -> None:
        self.value = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def train(root: str, steps: int = 4, every: int = 2, nan: bool = False,
          extras: dict[str, Any] | None = None) -> None:
    """A tiny run: generations at steps 2 and 4; the first layer's bias is frozen."""
    torch.manual_seed(0)
    first = torch.nn.Linear(4, 3)
    model = torch.nn.Sequential(first, torch.nn.ReLU(), torch.nn.Linear(3, 2))
    first.bias.requires_grad_(False)
    if nan:
        with torch.no_grad():
            first.bias[1] = float("nan")  # frozen: NaN stays put in every generation
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    data = Cursor()
    ckpt = unbroken.Checkpointer(root, model=model, optimizer=opt, scheduler=sched, data=data,
                                 extras=extras, every=every)
    try:
        for step in range(1, steps + 1):
            data.position += 5
            opt.zero_grad()
            model(torch.randn(5, 4)).square().mean().backward()
            opt.step()
            sched.step()
            ckpt.step_done(step)
    finally:
        ckpt.close()


def gen(root: Any, n: int) -> str:
    return f"{root}/gen-{n:09d}"


def diff(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    code = main(["diff", *argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def entries(report: dict[str, Any], part: str) -> dict[str, dict[str, Any]]:
    return {e["key"]: e for e in report["parts"][part]["entries"]}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("diff") / "run")
    train(root)
    return root


def test_two_generations_name_the_changed_tensors(run: str, capsys: Any) -> None:
    code, report = diff(gen(run, 2), gen(run, 4), capsys=capsys)
    assert code == 1 and report["equal"] is False
    assert (report["a"]["generation"], report["b"]["generation"]) == (2, 4)
    model = entries(report, "model")
    assert set(model) == {"0.weight", "2.weight", "2.bias"}
    for e in model.values():
        assert e["change"] == "values" and e["max_abs"] > 0 and e["max_rel"] > 0
        assert 0 < e["differing"] <= e["elements"]
    assert "0.bias" in report["parts"]["model"]["equal"]  # frozen: unchanged
    counters = entries(report, "counters")
    assert (counters["step"]["a"], counters["step"]["b"]) == (2, 4)
    optimizer = entries(report, "optimizer")
    assert optimizer["param_groups[0]/lr"]["a"] == pytest.approx(0.025)
    assert optimizer["param_groups[0]/lr"]["b"] == pytest.approx(0.025 / 4)
    assert (optimizer["state/0.weight/step"]["a"], optimizer["state/0.weight/step"]["b"]) == (2, 4)
    assert not any(k.startswith("state/0.bias") for k in optimizer)  # never optimized
    assert "stream torch_cpu" in entries(report, "rng")
    data = entries(report, "data")
    assert set(data) == {"position"} and (data["position"]["a"], data["position"]["b"]) == (10, 20)
    assert "order" in report["parts"]["data"]["equal"]


def test_human_output_is_a_table_and_a_verdict(run: str, capsys: Any) -> None:
    assert main(["diff", gen(run, 2), gen(run, 4)]) == 1
    out = capsys.readouterr().out
    assert "0.weight" in out and "max abs" in out and "counters" in out
    assert out.rstrip().splitlines()[-1].startswith("verdict: different")
    assert main(["diff", gen(run, 4), gen(run, 4)]) == 0
    out = capsys.readouterr().out
    assert "equal parts: model, optimizer, scheduler, data, rng, counters" in out
    assert "verdict: equal" in out


def test_a_generation_against_itself_is_equal(run: str, capsys: Any) -> None:
    code, report = diff(gen(run, 2), gen(run, 2), capsys=capsys)
    assert code == 0 and report["equal"] is True
    assert all(p["status"] == "equal" and not p["entries"] for p in report["parts"].values())


def test_runs_and_generation_options(run: str, capsys: Any) -> None:
    # A run alone: the newest verified generation against the one before it.
    code, report = diff(run, capsys=capsys)
    assert code == 1 and (report["a"]["generation"], report["b"]["generation"]) == (2, 4)
    code, report = diff(run, "--a-generation", "2", "--b-generation", "4", capsys=capsys)
    assert code == 1 and (report["a"]["generation"], report["b"]["generation"]) == (2, 4)
    code, report = diff(gen(run, 4), run, capsys=capsys)  # B: the run's newest
    assert code == 0 and report["b"]["generation"] == 4


def test_the_newest_generation_alone_shows_what_its_save_changed(run: str, capsys: Any) -> None:
    """`diff RUN/gen-N`, N the newest, compared generation N with itself (an outside attack,
    session 40): it is what save N changed, as `diff RUN`; an older one named alone is still
    compared with the newest."""
    for argv in ([gen(run, 4)], [run, "--a-generation", "4"]):
        code, report = diff(*argv, capsys=capsys)
        assert code == 1 and (report["a"]["generation"], report["b"]["generation"]) == (2, 4)
    code, report = diff(gen(run, 2), capsys=capsys)
    assert code == 1 and (report["a"]["generation"], report["b"]["generation"]) == (2, 4)


def test_same_state_saved_twice_diffs_equal_nan_included(tmp_path: Path, capsys: Any) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    train(a, nan=True)
    train(b, nan=True)
    code, report = diff(gen(a, 4), gen(b, 4), capsys=capsys)
    assert code == 0, report  # other run ids, bitwise the same state (NaN == NaN)
    assert report["a"]["run_id"] != report["b"]["run_id"]


def test_a_part_only_in_one_run(tmp_path: Path, capsys: Any) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    train(a)
    train(b, extras={"ema": Ema()})
    code, report = diff(gen(a, 4), gen(b, 4), capsys=capsys)
    assert code == 1
    ema = report["parts"]["extra.ema"]
    assert ema["status"] == "only in B"
    assert entries(report, "extra.ema")["value"] == {
        "key": "value", "kind": "tensor", "change": "only in B", "b": "float32[3]"}
    assert all(report["parts"][p]["status"] == "equal" for p in report["parts"] if p != "extra.ema")
    assert main(["diff", gen(a, 4), gen(b, 4)]) == 1
    assert "extra.ema (only in B)" in capsys.readouterr().out


def test_bad_inputs_exit_2(run: str, tmp_path: Path, capsys: Any) -> None:
    cases = {
        str(tmp_path / "missing"): "no such run folder",
        str(tmp_path): "no gen-NNNNNNNNN generation",
        gen(run, 3): "has no generation 3",
        os.path.join(gen(run, 2), "MANIFEST.json"): "not a folder",
    }
    for spec, message in cases.items():
        assert main(["diff", spec, gen(run, 2), "--json"]) == 2, spec
        report = json.loads(capsys.readouterr().out)
        assert message in report["error"] and report["exit_status"] == 2
    assert main(["diff", gen(run, 2), "--a-generation", "4"]) == 2
    assert "names generation 2, and --a-generation 4" in capsys.readouterr().err
    assert main(["diff", run, "--b-generation", "2"]) == 2  # nothing verified before 2
    assert "no generation older than generation 2 verifies" in capsys.readouterr().err


def test_only_verified_bytes_are_read(tmp_path: Path, capsys: Any) -> None:
    root = str(tmp_path / "run")
    train(root)
    path = os.path.join(gen(root, 4), "model.safetensors")
    data = bytearray(Path(path).read_bytes())
    data[-1] ^= 0xFF
    Path(path).write_bytes(bytes(data))
    assert main(["diff", gen(root, 4), gen(root, 2)]) == 2  # named: refused
    assert "generation 4 does not verify" in capsys.readouterr().err
    code, report = diff(root, gen(root, 2), capsys=capsys)  # newest verified: 2
    assert code == 0 and report["a"]["generation"] == 2


def test_memory_url_runs(capsys: Any) -> None:
    url = f"memory://unbroken-tests/diff-{uuid.uuid4().hex}"
    try:
        train(url)
        code, report = diff(gen(url, 2), url, capsys=capsys)
        assert code == 1 and report["b"]["generation"] == 4
        assert "0.weight" in entries(report, "model")
        code, report = diff(url, "--a-generation", "4", capsys=capsys)  # (4 is B: what it
        assert code == 1 and report["a"]["generation"] == 2  # changed, session 40)
    finally:
        fs = fsspec.filesystem("memory")
        if fs.exists(url):
            fs.rm(url, recursive=True)


def test_split_generation() -> None:
    assert split_generation("/r/run/gen-000000400") == ("/r/run", 400)
    assert split_generation("/r/run/gen-000000400/") == ("/r/run", 400)
    assert split_generation("gen-000000007") == (".", 7)
    assert split_generation("/r/run") == ("/r/run", None)
    assert split_generation("s3://b/run/gen-000000001") == ("s3://b/run", 1)
    assert split_generation("memory://gen-000000001") == ("memory://gen-000000001", None)
    assert split_generation("/r/gen-1") == ("/r/gen-1", None)  # not a generation name


def test_tensor_comparison_is_bitwise() -> None:
    nan = float("nan")
    assert tensor_diff(torch.tensor([1.0, nan]), torch.tensor([1.0, nan])) is None
    zero = tensor_diff(torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0]))
    assert zero is not None and zero["differing"] == 1 and zero["max_abs"] == 0
    mixed = tensor_diff(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([1.0, nan, 3.0]))
    assert mixed is not None and mixed["differing"] == 2 and mixed["max_abs"] == float("inf")
    d = tensor_diff(torch.tensor([2.0, 0.0]), torch.tensor([3.0, 0.0]))
    assert d is not None and (d["max_abs"], d["max_rel"]) == (1.0, 0.5)
    i = tensor_diff(torch.tensor([1, 2**40]), torch.tensor([1, 2**40 + 3]))
    assert i is not None and (i["differing"], i["max_abs"]) == (1, 3.0)
    assert tensor_diff(torch.tensor([True]), torch.tensor([True])) is None
    c = tensor_diff(torch.tensor([1 + 1j], dtype=torch.complex128),
                    torch.tensor([1 + 2j], dtype=torch.complex128))  # 16-byte elements
    assert c is not None and c["max_abs"] == 1.0
    shape = tensor_diff(torch.zeros(2, 3), torch.zeros(3, 2))
    assert shape is not None and shape["change"] == "shape"
    dtype = tensor_diff(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    assert dtype is not None and dtype["change"] == "dtype"


def test_large_tensors_are_compared_in_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    import unbroken.tools.diff as diff_module

    monkeypatch.setattr(diff_module, "_CHUNK", 2)
    a = torch.tensor([1.0, 1.0, 1.0, 1.0, 8.0])
    b = torch.tensor([1.0, 2.0, 1.0, 1.0, 4.0])
    d = tensor_diff(a, b)
    assert d is not None and (d["differing"], d["elements"]) == (2, 5)
    assert (d["max_abs"], d["max_rel"]) == (4.0, 1.0)
    assert tensor_diff(a, a.clone()) is None


def test_plain_values() -> None:
    assert leaf_diff(float("nan"), float("nan")) is None
    assert leaf_diff((0.9, 0.999), (0.9, 0.999)) is None
    changed = leaf_diff(1, 1.0)
    assert changed is not None and changed["change"] == "type"
    long = leaf_diff(list(range(10_000)), list(range(1, 10_001)))
    assert long is not None and len(long["a"]) < 100  # shown truncated
