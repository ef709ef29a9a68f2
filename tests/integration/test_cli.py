"""`unbroken inspect` and `unbroken verify` against a real run folder, pristine and corrupted."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import unbroken
from unbroken._commands import TOOLS
from unbroken.cli import main
from unbroken.store.manifest import seal

NEWEST = "gen-000000005"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """5 saved steps of a tiny model; default retention keeps generations 3, 4 and 5."""
    root = tmp_path_factory.mktemp("pristine") / "run"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ckpt = unbroken.Checkpointer(root, model=model, optimizer=opt, every=1,
                                 identity=unbroken.Identity(config={"lr": 1e-2}, data="v1"))
    for step in range(1, 6):
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ckpt.step_done(step, loss=0.25)
    ckpt.close()  # the CLI only reads, but a writer must not hold the folder meanwhile
    return root


@pytest.fixture
def run(pristine: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "run"
    shutil.copytree(pristine, dest)
    return dest


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    code, out, _ = cli(capsys, *argv, "--json")
    return code, json.loads(out)


def subprocess_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "unbroken.cli", *argv], check=False,
                          capture_output=True, text=True, timeout=120)


def load_manifest(gen: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((gen / "MANIFEST.json").read_text())
    return doc


def save_manifest(gen: Path, doc: dict[str, Any], sealed: bool = False) -> None:
    """Write an edited manifest: as a hand edit (its checksum now stale), or ``sealed`` with
    a correct checksum so that the deeper checks are what sees the edit."""
    (gen / "MANIFEST.json").write_bytes(seal(doc) if sealed else json.dumps(doc).encode())


def artifact(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(a for a in doc["artifacts"] if a["name"] == name)


# -- healthy run ------------------------------------------------------------------------------


def test_inspect_lists_three_complete_generations(run: Path, capsys: pytest.CaptureFixture[str]
                                                  ) -> None:
    code, out, err = cli(capsys, "inspect", str(run))
    assert code == 0, err
    assert "torn" not in out and "corrupt" not in out
    rows = [line.split() for line in out.splitlines() if line.endswith("rng")]
    assert [r[:2] for r in rows] == [["3", "3"], ["4", "4"], ["5", "5"]]
    assert "3 generations: 3 complete" in out
    assert "newest complete: gen-000000005 (step 5)" in out
    assert "config       lr=0.01 [" in out and "revision 'v1'" in out
    assert "parent       gen 4 of this run" in out and "fresh run" in out
    assert f"torch {torch.__version__}" in out and "threads" in out and "deterministic" in out
    assert "KiB" in out and err == ""

    code, doc = cli_json(capsys, "inspect", str(run))
    assert code == 0 and doc["ok"] is True and doc["run"] == str(run)
    gens = doc["generations"]
    assert [g["generation"] for g in gens] == [3, 4, 5] and [g["step"] for g in gens] == [3, 4, 5]
    assert all(g["status"] == "complete" and g["reason"] is None for g in gens)
    assert all(g["bytes"] == sum(a["size"] for a in g["artifacts"]) > 0 for g in gens)
    assert {a["name"] for a in gens[-1]["artifacts"]} >= {"model.safetensors", "state.json"}
    assert gens[-1]["parts"] == ["counters", "model", "optimizer", "rng"]
    newest = doc["newest_complete"]
    assert newest["generation"] == 5 and newest["parent"]["generation"] == 4
    assert newest["identity"]["data"]["value"] == "v1"
    assert newest["environment"]["torch"] == str(torch.__version__)
    assert doc["debris"] == [] and doc["aside"] == []


def test_verify_ok(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "verify", str(run))
    assert code == 0, out + err
    assert "3 checked: 3 verified, 0 failed" in out
    code, doc = cli_json(capsys, "verify", str(run))
    assert code == 0 and doc["ok"] is True and doc["run"] == str(run)
    for g in doc["generations"]:
        assert g["status"] == "verified" and g["reason"] is None and g["bytes"] > 0
        assert all(set(a) == {"name", "size", "xxh3_128"} for a in g["artifacts"])
        assert "model" in g["parts"]
    code, doc = cli_json(capsys, "verify", str(run), "--generation", "4")
    assert code == 0 and [g["generation"] for g in doc["generations"]] == [4]


def test_verify_beside_a_writer_whose_retention_deletes_a_generation_is_no_failure(
        run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """verify lists the generations, then reads each: a writer's retention may delete one in
    between. Its files are gone with its folder: that is reported as such, not as corruption,
    and the exit is 0; a generation that lost a file but not its folder is still corrupt."""
    from unbroken.store.generations import GenerationStore

    real = GenerationStore.verify

    def retention_meanwhile(self: GenerationStore, info: Any, *a: Any, **k: Any) -> Any:
        if info.path.endswith("gen-000000003"):
            shutil.rmtree(info.path)  # (as retention removes it, between listing and reading)
        elif info.path.endswith("gen-000000004"):
            os.remove(os.path.join(info.path, "model.safetensors"))  # (damage, not retention)
        return real(self, info, *a, **k)

    monkeypatch.setattr(GenerationStore, "verify", retention_meanwhile)
    code, doc = cli_json(capsys, "verify", str(run))
    status = {g["generation"]: g["status"] for g in doc["generations"]}
    assert status == {3: "deleted while checked", 4: "corrupt", 5: "verified"}, doc
    assert code == 1 and doc["ok"] is False  # (generation 4's missing file)
    shutil.rmtree(run / "gen-000000004")
    shutil.copytree(run / NEWEST, run / "gen-000000003")  # (a generation 3 to delete again)
    m = json.loads((run / "gen-000000003" / "MANIFEST.json").read_text())
    (run / "gen-000000003" / "MANIFEST.json").write_bytes(seal({**m, "generation": 3}))
    code, out, _ = cli(capsys, "verify", str(run))
    assert code == 0 and "2 checked: 1 verified, 0 failed, 1 deleted while checked" in out, out


def test_verify_catching_retention_between_manifest_and_folder_is_no_failure(
        run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Found from outside (twenty-third session): retention removes a generation's manifest
    first, then its folder; verify listing it in between saw it torn and failed. Gone by the
    end of the pass, it is deleted while checked; a torn generation that stays is a failure."""
    import unbroken._runview as runview

    (run / "gen-000000003" / "MANIFEST.json").unlink()  # retention's first step, seen listed
    real = runview.verify_one

    def retention_finishes(store: Any, info: Any, *a: Any, **k: Any) -> Any:
        rec = real(store, info, *a, **k)
        if info.path.endswith("gen-000000003"):
            shutil.rmtree(info.path)  # (its second step, while the others are verified)
        return rec

    monkeypatch.setattr("unbroken.cli.verify_one", retention_finishes)
    code, doc = cli_json(capsys, "verify", str(run))
    status = {g["generation"]: g["status"] for g in doc["generations"]}
    assert status == {3: "deleted while checked", 4: "verified", 5: "verified"}, doc
    assert code == 0 and doc["ok"] is True
    (run / "gen-000000004" / "MANIFEST.json").unlink()  # torn, and it stays
    monkeypatch.setattr("unbroken.cli.verify_one", real)
    code, doc = cli_json(capsys, "verify", str(run))
    assert code == 1 and [g["status"] for g in doc["generations"]] == ["torn", "verified"]


def test_subprocess_entry_point(run: Path) -> None:
    p = subprocess_cli("inspect", str(run), "--json")
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)["generations"]) == 3
    p = subprocess_cli("verify", str(run))
    assert p.returncode == 0, p.stderr
    assert "3 verified" in p.stdout


def test_inspect_answers_without_importing_torch(run: Path) -> None:
    """`unbroken inspect` reads manifests only: it loads neither torch nor the tools that
    import it (about 0.3 s instead of 2 s); an unknown command still lists every command."""
    code = ("import json, sys; from unbroken.cli import main; "
            f"rc = main(['inspect', {str(run)!r}, '--json']); "
            "print(json.dumps({'rc': rc, 'torch': sorted(m for m in sys.modules "
            "if m.split('.')[0] == 'torch')[:3]}), file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    seen = json.loads(p.stderr.strip().splitlines()[-1])
    assert seen == {"rc": 0, "torch": []}, p.stderr
    assert len(json.loads(p.stdout)["generations"]) == 3
    p = subprocess_cli("no-such-command")
    assert p.returncode == 2 and "export" in p.stderr and "diff" in p.stderr, p.stderr


@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"], ["audit", "--help"],
                                  ["frobnicate"], ["--version"], ["diff", "--help"],
                                  ["export", "--help"], ["verify-export", "--help"],
                                  ["import", "--help"], ["export", "only-one-argument"]])
def test_the_command_list_and_torch_free_tools_never_import_torch(argv: list[str]) -> None:
    """The command list comes from `TOOLS`: ``unbroken --help``, the tools that need no
    torch (plan, audit), and the help and usage errors of those that do (`tools._entries`)
    answer without it; ``unbroken diff`` imports it to run."""
    code = ("import json, sys; from unbroken.cli import main\n"
            "try:\n    rc = main(json.loads(sys.argv[1]))\nexcept SystemExit as e:\n"
            "    rc = e.code\n"
            "print(json.dumps({'rc': rc, 'torch': 'torch' in sys.modules}), file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code, json.dumps(argv)], capture_output=True,
                       text=True, timeout=120)
    seen = json.loads(p.stderr.strip().splitlines()[-1])
    usage_error = argv in (["frobnicate"], ["export", "only-one-argument"])
    assert seen == {"rc": 2 if usage_error else 0, "torch": False}, p.stderr
    if argv == ["--help"]:
        assert all(f"    {name}" in p.stdout for name in TOOLS), p.stdout


def test_the_export_dtypes_the_command_line_offers_are_the_ones_export_casts_to() -> None:
    from unbroken.tools._entries import EXPORT_DTYPES
    from unbroken.tools._export_io import DTYPES

    assert EXPORT_DTYPES == tuple(DTYPES)


def test_every_tool_registers_its_commands_in_the_module_tools_names() -> None:
    """`TOOLS` and the tools' registrations agree: each command is registered by the module
    listed for it, with the help listed for it, and no tool registers a command not listed."""
    import importlib
    import pkgutil

    from unbroken import tools
    from unbroken._commands import COMMANDS

    for module in pkgutil.iter_modules(tools.__path__):
        importlib.import_module(f"unbroken.tools.{module.name}")
    registered = {n: c for n, c in COMMANDS.items()
                  if c.run.__module__.startswith("unbroken.tools.")}
    assert set(registered) == set(TOOLS)
    for name, (module, help) in TOOLS.items():
        assert registered[name].run.__module__ == f"unbroken.tools.{module}"
        assert registered[name].help == help


def test_empty_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "inspect", str(tmp_path))
    assert code == 0 and "no generations" in out
    code, doc = cli_json(capsys, "inspect", str(tmp_path))
    assert code == 0 and doc["generations"] == [] and doc["newest_complete"] is None
    code, doc = cli_json(capsys, "verify", str(tmp_path))  # nothing to verify is no pass
    assert code == 2 and doc["ok"] is False and "not a run folder" in doc["error"]
    (tmp_path / "LOCK").write_text("")  # a Checkpointer's folder before its first save
    code, doc = cli_json(capsys, "verify", str(tmp_path))
    assert code == 0 and doc["generations"] == [] and doc["ok"] is True
    (tmp_path / "LOCK").unlink()
    (tmp_path / "RUN.json").write_text("{}")  # a run whose generations are all gone
    code, doc = cli_json(capsys, "verify", str(tmp_path))
    assert code == 0 and doc["generations"] == [] and doc["ok"] is True


def test_debris_and_aside_are_listed(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run / ".staging-000000006-0123456789ab").mkdir()
    (run / "aside" / "gen-000000007-abandoned-deadbeef").mkdir(parents=True)
    code, out, _ = cli(capsys, "inspect", str(run))
    assert code == 0
    assert ".staging-000000006-0123456789ab (in-progress or interrupted save, ignored)" in out
    assert "gen-000000007-abandoned-deadbeef" in out
    code, doc = cli_json(capsys, "inspect", str(run))
    assert doc["debris"][0]["name"].startswith(".staging-")
    assert [(e["name"], e["reason"], e["generation"]) for e in doc["aside"]] == [
        ("gen-000000007-abandoned-deadbeef", "abandoned", 7)]
    assert cli(capsys, "verify", str(run))[0] == 0  # debris is never read


# -- usage and environment errors -------------------------------------------------------------


@pytest.mark.parametrize("argv", [["inspect", "{missing}"], ["verify", "{missing}"],
                                  ["inspect", "{file}"], ["verify", "{run}", "--generation", "9"]])
def test_bad_run_exits_2_without_traceback(run: Path, tmp_path: Path, argv: list[str],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("x")
    paths = {"missing": tmp_path / "nope", "file": tmp_path / "file", "run": run}
    code, out, err = cli(capsys, *[a.format(**paths) for a in argv], "--json")
    assert code == 2 and json.loads(out)["ok"] is False, out + err  # JSON on errors too
    assert err.startswith("unbroken: error: ") and err.count("\n") == 1


def test_bad_run_via_subprocess(tmp_path: Path) -> None:
    p = subprocess_cli("verify", str(tmp_path / "nope"), "--json")
    assert p.returncode == 2 and json.loads(p.stdout)["exit_status"] == 2
    assert p.stderr == f"unbroken: error: {tmp_path / 'nope'}: no such run folder\n"


def test_unknown_generation_names_the_ones_found(run: Path, capsys: pytest.CaptureFixture[str]
                                                 ) -> None:
    code, _, err = cli(capsys, "verify", str(run), "--generation", "9")
    assert code == 2 and "no generation 9" in err and "[3, 4, 5]" in err


@pytest.mark.parametrize("argv", [[], ["frobnicate"], ["inspect"], ["verify", "RUN", "--bogus"],
                                  ["verify", "RUN", "--generation", "x"]])
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, *argv)
    assert code == 2 and "usage:" in err and "Traceback" not in err and out == ""


@pytest.mark.parametrize("argv", [["frobnicate"], ["inspect"], ["verify", "RUN", "--bogus"],
                                  ["verify", "RUN", "--generation", "x"]])
def test_bad_arguments_with_json_print_one_error_document(argv: list[str],
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """With --json a usage error is one JSON document too (as every other error), and
    stderr still says it as argparse does."""
    code, out, err = cli(capsys, *argv, "--json")
    doc = json.loads(out)
    assert code == 2 and doc["ok"] is False and doc["exit_status"] == 2
    assert "usage:" in err and doc["error"].split(": ", 1)[1] in err


def test_a_damaged_run_record_is_a_warning_of_inspect_and_verify(
        run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """RUN.json that does not parse: the generations are still listed and verified (the
    next writer rewrites the record), and both commands say it is damaged."""
    (run / "RUN.json").write_bytes(b"[[[")
    for command in ("inspect", "verify"):
        code, out, _ = cli(capsys, command, str(run))
        assert code == 0 and "warning:" in out and "RUN.json" in out, out
        code, doc = cli_json(capsys, command, str(run))
        assert code == 0 and doc["ok"] is True
        assert "RUN.json" in doc["run_record_problem"]
    (run / "RUN.json").unlink()  # (missing: a folder of an older version, not damaged)
    code, doc = cli_json(capsys, "inspect", str(run))
    assert code == 0 and doc["run_record_problem"] is None


def test_a_manifest_with_a_huge_integer_is_not_called_invalid_utf8(
        run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A manifest holding an integer of 5,000 digits is valid UTF-8 and valid JSON that
    Python refuses to convert: the report says "not valid JSON" and why."""
    (run / NEWEST / "MANIFEST.json").write_bytes(b'{"step": ' + b"9" * 5000 + b"}")
    code, doc = cli_json(capsys, "inspect", str(run))
    reason = next(g["reason"] for g in doc["generations"] if g["path"].endswith(NEWEST))
    assert code == 1 and "not valid JSON" in reason and "UTF-8" not in reason, reason


def test_bad_arguments_via_subprocess() -> None:
    p = subprocess_cli("verify", "RUN", "--bogus")
    assert p.returncode == 2 and "unrecognized arguments: --bogus" in p.stderr
    assert "Traceback" not in p.stderr


# -- corruption of the newest generation ------------------------------------------------------


def truncate(gen: Path) -> None:
    f = gen / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-5])


def flip_tensor_byte(gen: Path) -> None:
    f = gen / "model.safetensors"
    data = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    data[8 + n + 1] ^= 0x01  # inside the tensor data, past the header
    f.write_bytes(bytes(data))


def delete_manifest(gen: Path) -> None:
    (gen / "MANIFEST.json").unlink()


def manifest_edit(change: Callable[[dict[str, Any]], None],
                  sealed: bool) -> Callable[[Path], None]:
    """A mutation editing the manifest: a plain edit fails the manifest's own checksum; a
    resealed one reaches the size, hash, name and state checks."""
    def mutate(gen: Path) -> None:
        doc = load_manifest(gen)
        change(doc)
        save_manifest(gen, doc, sealed)
    mutate.__name__ = change.__name__ + ("_resealed" if sealed else "")
    return mutate


def edit_size(doc: dict[str, Any]) -> None:
    artifact(doc, "optimizer.safetensors")["size"] += 1


def edit_hash(doc: dict[str, Any]) -> None:
    a = artifact(doc, "model.safetensors")
    a["xxh3_128"] = ("0" if a["xxh3_128"][0] != "0" else "1") + a["xxh3_128"][1:]


def escape_folder(doc: dict[str, Any]) -> None:
    artifact(doc, "model.safetensors")["name"] = "../x"


def edit_step(doc: dict[str, Any]) -> None:
    doc["step"] = 50


def swap_from_older(gen: Path) -> None:
    """model.safetensors of generation 4, with the manifest 'fixed' to match: only the
    per-file stamps (checked by the full decode) can tell."""
    import xxhash

    older = (gen.parent / "gen-000000004" / "model.safetensors").read_bytes()
    (gen / "model.safetensors").write_bytes(older)
    doc = load_manifest(gen)
    artifact(doc, "model.safetensors").update(size=len(older),
                                              xxh3_128=xxhash.xxh3_128(older).hexdigest())
    save_manifest(gen, doc, sealed=True)


# Any edit of a committed manifest fails its checksum, found by the cheap check (inspect too).
CHECKSUM = ["MANIFEST.json", "manifest checksum", "changed after commit"]
CORRUPTIONS: list[tuple[Callable[[Path], None], str, list[str], int]] = [
    # (mutation, status, words the reason must contain, inspect's exit code)
    (truncate, "corrupt", ["model.safetensors", "the manifest lists"], 1),
    (flip_tensor_byte, "corrupt", ["model.safetensors", "content hash", "the manifest lists"], 0),
    (delete_manifest, "torn", ["MANIFEST.json", "missing"], 1),
    (manifest_edit(edit_size, False), "corrupt", CHECKSUM, 1),
    (manifest_edit(edit_hash, False), "corrupt", CHECKSUM, 1),
    (manifest_edit(escape_folder, False), "corrupt", CHECKSUM, 1),
    (manifest_edit(edit_step, False), "corrupt", CHECKSUM, 1),
    # resealed (a tool, or someone covering their tracks): the deeper checks still refuse it
    (manifest_edit(edit_size, True), "corrupt", ["optimizer.safetensors",
                                                 "bytes, the manifest lists"], 1),
    (manifest_edit(edit_hash, True), "corrupt", ["model.safetensors", "content hash",
                                                 "the manifest lists"], 0),
    (manifest_edit(escape_folder, True), "corrupt", ["MANIFEST.json", "'../x'",
                                                     "not a plain file name"], 1),
    (swap_from_older, "corrupt", ["model.safetensors", "stamped", "another generation"], 0),
    (manifest_edit(edit_step, True), "corrupt", ["state.json", "step 5", "step 50"], 0),
]


@pytest.mark.parametrize("mutate, status, words, inspect_code", CORRUPTIONS,
                         ids=[c[0].__name__ for c in CORRUPTIONS])
def test_corrupt_newest_generation(run: Path, capsys: pytest.CaptureFixture[str],
                                   mutate: Callable[[Path], None], status: str,
                                   words: list[str], inspect_code: int) -> None:
    mutate(run / NEWEST)

    code, doc = cli_json(capsys, "verify", str(run))
    assert code == 1 and doc["ok"] is False
    by_gen = {g["generation"]: g for g in doc["generations"]}
    assert set(by_gen) == {3, 4, 5}  # the others are still checked and reported
    assert by_gen[3]["status"] == by_gen[4]["status"] == "verified"
    bad = by_gen[5]
    assert bad["status"] == status, bad
    for word in words:
        assert word in bad["reason"], (word, bad["reason"])
    assert str(run / NEWEST) in bad["reason"]  # names the file by its path

    code, out, err = cli(capsys, "verify", str(run))
    assert code == 1 and "3 checked: 2 verified, 1 failed" in out and "Traceback" not in out + err
    assert f"{NEWEST}/" in out and words[0] in out  # relative path in the human report

    assert cli(capsys, "verify", str(run), "--generation", "4")[0] == 0
    assert cli(capsys, "verify", str(run), "--generation", "5")[0] == 1

    # inspect is cheap (manifest and sizes only): content edits pass it, structure does not
    code, doc = cli_json(capsys, "inspect", str(run))
    assert code == inspect_code and doc["ok"] is (inspect_code == 0)
    newest = doc["newest_complete"]["generation"]
    assert newest == (5 if inspect_code == 0 else 4)
    if inspect_code:
        assert doc["generations"][-1]["status"] == status and doc["generations"][-1]["reason"]


def test_corrupt_generation_via_subprocess(run: Path) -> None:
    flip_tensor_byte(run / NEWEST)
    p = subprocess_cli("verify", str(run), "--json")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    statuses = [g["status"] for g in json.loads(p.stdout)["generations"]]
    assert statuses == ["verified", "verified", "corrupt"]
    delete_manifest(run / "gen-000000004")
    p = subprocess_cli("inspect", str(run))
    assert p.returncode == 1
    assert "torn" in p.stdout and "gen-000000004/MANIFEST.json: missing" in p.stdout
    assert "newest complete: gen-000000005" in p.stdout  # inspect does not re-hash


def test_control_characters_from_files_are_escaped(run: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    doc = load_manifest(run / NEWEST)
    doc["identity"]["data"]["summary"] = "evil\x1b[2Jsummary"
    save_manifest(run / NEWEST, doc, sealed=True)
    code, out, _ = cli(capsys, "inspect", str(run))
    assert code == 0 and "\x1b" not in out and "evil\\x1b[2Jsummary" in out


def test_a_one_digit_edit_of_the_identity_is_corruption_not_a_mismatch(
        run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The review's case: a flipped hex digit in an identity hash still parses; the
    manifest's checksum makes it corruption, so inspect and verify report the generation as
    corrupt (naming MANIFEST.json and why) and the previous one as the newest complete."""
    doc = load_manifest(run / NEWEST)
    h = doc["identity"]["data"]["hash"]
    doc["identity"]["data"]["hash"] = ("0" if h[0] != "0" else "1") + h[1:]
    save_manifest(run / NEWEST, doc)
    for command in ("inspect", "verify"):
        code, report = cli_json(capsys, command, str(run))
        assert code == 1, command
        bad = report["generations"][-1]
        assert (bad["generation"], bad["status"]) == (5, "corrupt")
        for word in CHECKSUM:
            assert word in bad["reason"], (word, bad["reason"])
    assert report["generations"][-2]["status"] == "verified"
    code, out, _ = cli(capsys, "inspect", str(run))
    assert code == 1 and "newest complete: gen-000000004" in out and "manifest checksum" in out


def test_every_generation_corrupt_still_reports_each(run: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    for name in sorted(os.listdir(run)):
        if name.startswith("gen-"):
            flip_tensor_byte(run / name)
    code, doc = cli_json(capsys, "verify", str(run))
    assert code == 1 and [g["status"] for g in doc["generations"]] == ["corrupt"] * 3



# -- issue 8: every command exits 0, 1 or 2; verify in bounded memory --------------------------


@pytest.mark.parametrize("field, value", [
    ("environment", {"cuda_devices": 5, "torch": ["x"], "num_threads": {"a": 1}}),
    ("environment", {"filesystem": "\udcff", "deterministic_algorithms": "yes"}),
    ("identity", {"config": 3, "data": {"value": "x", "hash": 7}}),
    ("parent", {"generation": [1], "run_id": None}),
    ("origin", {"operation": 5}),
], ids=lambda v: str(v)[:30])
def test_inspect_survives_odd_manifest_fields(run: Path, capsys: pytest.CaptureFixture[str],
                                              field: str, value: Any) -> None:
    gen = run / NEWEST
    doc = load_manifest(gen)
    doc[field] = value
    save_manifest(gen, doc, sealed=True)
    # (an identity entry without its hash is corrupt since session 28: a problem, exit 1)
    refused = field == "identity"
    for args in (["inspect", str(run)], ["inspect", str(run), "--json"]):
        code, out, err = cli(capsys, *args)
        assert code == int(refused), err
        assert "Traceback" not in err
    code, doc2 = cli_json(capsys, "inspect", str(run))
    if refused:
        newest = [g for g in doc2["generations"] if g["path"].endswith(NEWEST)][0]
        assert newest["status"] == "corrupt" and "identity" in newest["reason"]
        return
    assert code == 0 and doc2["newest_complete"][field] == value


def test_an_unexpected_error_still_exits_2_without_a_traceback(
        run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import unbroken.cli as cli_module

    def boom(*a: Any, **k: Any) -> None:
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(cli_module, "newest_summary_lines", boom)
    code, out, err = cli(capsys, "inspect", str(run))
    assert code == 2 and "unexpected RuntimeError: simulated bug" in err
    assert "Traceback" not in err


def test_inspect_shows_the_run_and_aside_with_reasons(run: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = cli_json(capsys, "inspect", str(run))
    assert code == 0 and len(doc["run_id"]) == 32 and doc["lineage"] == []
    gen = run / NEWEST / "model.safetensors"
    data = bytearray(gen.read_bytes())
    data[-1] ^= 1
    gen.write_bytes(bytes(data))
    assert restore_pristine(run) == 4
    code, out, _ = cli(capsys, "inspect", str(run))
    assert code == 0 and "aside/" in out and "corrupt" in out and "gen-000000005-corrupt-" in out


def restore_pristine(run: Path) -> int:
    """Restore a copy of the pristine run with the objects that wrote it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with unbroken.Checkpointer(run, model=model, optimizer=opt,
                               identity=unbroken.Identity(config={"lr": 1e-2}, data="v1")) as c:
        return c.restore()


def _sparse_state(run: Path, size: int) -> Path:
    gen = run / NEWEST
    with open(gen / "state.json", "r+b") as f:
        f.truncate(size)
    doc = load_manifest(gen)
    artifact(doc, "state.json")["size"] = size
    save_manifest(gen, doc, sealed=True)
    return gen


def test_an_over_limit_state_file_is_refused_without_reading_it(
        run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from unbroken.store.backends.local import LocalFS

    _sparse_state(run, 1 << 30)
    touched: list[str] = []
    for method in ("read_file", "hash_file", "map_file"):
        real = getattr(LocalFS, method)

        def spy(self: LocalFS, path: str, *a: Any, _real: Any = real, **k: Any) -> Any:
            touched.append(path)
            return _real(self, path, *a, **k)

        monkeypatch.setattr(LocalFS, method, spy)
    code, doc = cli_json(capsys, "verify", str(run), "--generation", "5")
    assert code == 1 and "over the 268435456-byte limit" in doc["generations"][0]["reason"]
    assert not [p for p in touched if p.endswith("state.json")]
    touched.clear()
    assert restore_pristine(run) == 4
    assert not [p for p in touched if NEWEST in p and p.endswith("state.json")]


_RSS_PROBE = """
import json, sys
from unbroken.cli import main
import unbroken._runview, unbroken.state.parts  # imported before the baseline

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current resident size
base = status("VmRSS")
code = main(["verify", sys.argv[1], "--json"])
print(json.dumps({"code": code, "grew_kib": status("VmHWM") - base}), file=sys.stderr)
"""


def test_verify_of_a_1_gib_generation_stays_within_128_mib(tmp_path: Path) -> None:
    root = tmp_path / "big"
    model = torch.nn.Linear(1 << 14, 1 << 14, bias=False)  # 2^28 float32 = 1 GiB
    with torch.no_grad():
        model.weight.normal_()
    with unbroken.Checkpointer(root, model=model, keep=unbroken.Keep(last=1)) as c:
        c.restore()
        c.save(1)
    del model
    size = (root / "gen-000000001" / "model.safetensors").stat().st_size
    assert size >= 1 << 30
    r = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(root)], capture_output=True,
                       text=True, timeout=300, check=False)
    result = json.loads(r.stderr.strip().splitlines()[-1])
    assert result["code"] == 0, r.stdout
    assert result["grew_kib"] < 128 * 1024, result
    print(f"verify of {size} bytes: peak RSS +{result['grew_kib'] / 1024:.1f} MiB")


def test_inspect_json_is_standard_json_with_non_finite_metrics(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]
                                                               ) -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt, every=1) as c:
        c.restore()
        c.step_done(1, loss=float("nan"), val=-float("inf"))
    code, out, _ = cli(capsys, "inspect", str(tmp_path / "run"), "--json")

    def strict(name: str) -> Any:
        raise ValueError(f"not standard JSON: {name}")

    doc = json.loads(out, parse_constant=strict)
    assert code == 0 and doc["newest_complete"]["metrics"] == {"val": "-inf", "loss": "nan"}


def test_verify_takes_a_generation_folder_and_refuses_a_folder_that_is_no_run(
        run: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Found from outside (twenty-third session): `verify RUN/gen-N` (as diff takes it) and a
    misspelled folder said "no generations to verify" and exit 0, the generation corrupt."""
    gen = run / "gen-000000004"
    code, doc = cli_json(capsys, "verify", str(gen))
    assert code == 0 and [g["generation"] for g in doc["generations"]] == [4]
    with open(gen / "model.safetensors", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    code, doc = cli_json(capsys, "verify", str(gen))
    assert code == 1 and doc["ok"] is False and doc["generations"][0]["status"] == "corrupt"
    code, _, err = cli(capsys, "verify", str(gen), "--generation", "5")
    assert code == 2 and "name one" in err
    (tmp_path / "typo").mkdir()
    code, _, err = cli(capsys, "verify", str(tmp_path / "typo"))
    assert code == 2 and "not a run folder" in err


def test_verify_factory_without_any_fixture_is_refused_not_passed(
        run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "verify", str(run), "--deep", "--factory", "os:getcwd")
    assert code == 2 and "next_step_fixture=True" in err


def test_diff_names_the_newer_generations_it_passed_over(
        run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run / NEWEST / "optimizer.safetensors").write_bytes(b"x")  # generation 5 fails
    code, doc = cli_json(capsys, "diff", str(run))
    assert (doc["a"]["generation"], doc["b"]["generation"]) == (3, 4)
    assert any(n.startswith("B: skipped generation 5: ") for n in doc["notes"]), doc["notes"]
    _, out, _ = cli(capsys, "diff", str(run))
    assert "note: B: skipped generation 5" in out


def test_an_unreadable_generation_is_named_unreadable_not_torn(
        run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found from outside: a generation folder this user may not read (chmod 000) listed as
    torn, "MANIFEST.json missing". (As root the permission is not enforced: simulated.)"""
    from unbroken.store.generations import GenerationStore

    real = os.lstat
    target = str(run / "gen-000000004" / "MANIFEST.json")

    def lstat(path: Any, *a: Any, **k: Any) -> Any:
        if os.fspath(path) == target:
            raise PermissionError(13, "Permission denied", target)
        return real(path, *a, **k)

    monkeypatch.setattr(os, "lstat", lstat)
    info = {g.generation: g for g in GenerationStore(str(run)).scan()}[4]
    # (nor corrupt since session 28: a restore then moved a good generation aside)
    assert info.status == "unreadable" and "Permission denied [EACCES]" in info.reason
    assert "fix its permissions" in info.reason


def test_os_errors_say_what_to_do() -> None:
    from unbroken._commands import os_message as _os_message

    text = _os_message(PermissionError(13, "Permission denied", "/r/run"))
    assert text.startswith("/r/run: Permission denied [EACCES]; let this user read it")
    s3 = _os_message(OSError(5, "NoCredentialsError: Unable to locate credentials", "s3://b/r"))
    assert "AWS_ACCESS_KEY_ID" in s3 and "FSSPEC_S3_ENDPOINT_URL" in s3
    assert _os_message(OSError("plain")) == "plain"


def test_verify_export_of_a_path_that_holds_no_export_exits_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for out in (tmp_path / "missing", tmp_path):
        code, doc = cli_json(capsys, "verify-export", str(out), "--factory", "os:getcwd")
        assert code == 2 and "export.json" in doc["error"], doc


def test_check_shows_the_output_of_a_script_that_wrote_no_trace(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The message named a log inside the working folder it had just removed."""
    code, _, err = cli(capsys, "check", "--random", "0", "--", sys.executable, "-c",
                       "print('hello from the script')")
    assert code == 2 and "wrote no trace" in err and "hello from the script" in err
