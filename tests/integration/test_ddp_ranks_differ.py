"""Many ranks (2 gloo processes) whose Checkpointers differ or diverge: settings given
otherwise on one rank are refused on every rank when the Checkpointer is built (before, they
hung until the process group's timeout, or saved an Identity a resume then refused); a rank
that handles its own error and closes while the other saves ends the job at once, with a
typed error (before: an AttributeError from a payload of the wrong collective, or a hang);
two ranks in different collectives of unbroken's fail alike and stay in step. Every process
runs under a 60 s process-group timeout and a subprocess timeout: a hang fails, never waits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _launch import free_port, gens
from conftest import SCRIPTS, zygote_ranks

SCRIPT = str(SCRIPTS / "ranks_differ.py")


def job(folder: Path, *args: str) -> list[dict]:
    """Both ranks of ``ranks_differ.py`` (forked from the test zygote); each rank's JSON
    lines."""
    _, ranks = zygote_ranks(2, SCRIPT, ["--folder", str(folder), *args],
                            {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())},
                            timeout=100)
    for r in ranks:
        assert r.returncode == 0, r.stderr[-3000:]
    return [[json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")] for r in ranks]


def test_settings_given_otherwise_on_one_rank_are_refused_on_every_rank_at_build(tmp_path):
    ranks = job(tmp_path, "--mode", "differ")
    for lines in ranks:
        refused = {x["setting"]: x for x in lines if x.get("setting")}
        assert {s: x["refused"] for s, x in refused.items()} == {
            "every=": "UnsupportedSetup", "async_save=": "UnsupportedSetup",
            "read_back=": "UnsupportedSetup", "incremental=": "UnsupportedSetup",
            "signals=": "UnsupportedSetup", "stop_check_every=": "UnsupportedSetup",
            "$UNBROKEN_SAVE_AT": "UnsupportedSetup", "the parts given": "UnsupportedSetup",
            "root": "UnsupportedSetup", "restore(generation=)": "UnsupportedSetup",
            "restore(intent)": "UnsupportedSetup",
            "identity": "IdentityMismatch"}
        assert "every= differs across the ranks of the job (2 on rank 0; 3 on rank 1)" in (
            refused["every="]["message"])
        assert "(['SIGUSR1'] on rank 0; [] on rank 1)" in refused["signals="]["message"] or (
            "([] on rank 0; ['SIGUSR1'] on rank 1)" in refused["signals="]["message"])
        assert "([] on rank 0; [3] on rank 1)" in refused["$UNBROKEN_SAVE_AT"]["message"]
        assert ("parts (optimizer=, scheduler=, scaler=, data=, extras=) differs "
                "across the ranks of the job (['model', 'optimizer'] on rank 0; "
                "['extra.ema', 'model', 'optimizer'] on rank 1)") in (
            refused["the parts given"]["message"])
        assert "run folder (root= or $UNBROKEN_ROOT) differs across the ranks" in (
            refused["root"]["message"])
        assert ("generation= differs across the ranks of the job (None on rank 0; 0 on rank "
                "1); call restore() with the same generation=") in (
            refused["restore(generation=)"]["message"])
        assert "in config" in refused["identity"]["message"]
        assert "differing in key(s) ['lr']" in refused["identity"]["message"]
        # the same settings (and Identity) on every rank still build and save
        saved = next(x for x in lines if "saved" in x)
        assert saved["saved"] == ["LOCK", "RUN.json", "gen-000000000"]
        assert lines[-1]["seconds"] < 40  # far from the 60 s process-group timeout
    assert not (tmp_path / "refused").exists()  # nothing was opened


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> list[dict]:
    """An uninterrupted job of 6 updates (the save mode changes nothing it computes)."""
    ranks = job(tmp_path_factory.mktemp("straight") / "run", "--mode", "train")
    assert [r[-1]["errors"] for r in ranks] == [[], []]
    return [r[-1] for r in ranks]


@pytest.mark.parametrize("mode", ["", "thread", "process"])
def test_a_rank_closing_on_its_own_error_ends_the_job_at_once_and_it_resumes_bitwise(
        tmp_path, mode, straight):
    """Rank 1 raises after update 3, handles it and closes; rank 0 saves update 4 (or, with an
    async save, persists it beside update 5's all-reduce). Rank 0 sees a typed `SaveFailed`
    or torch's own error of a peer gone, within seconds; the committed generation 2 resumes
    bitwise against an uninterrupted job (resumed after the synchronous save's run only: an
    async save's generation resuming bitwise in a job is `test_ddp_modes.py`'s, and the
    resume is the same whatever the failure before it)."""
    args = ("--async-save", mode) if mode else ()
    failed = job(tmp_path / "run", "--mode", "raise", *args)
    zero, one = (lines[-1] for lines in failed)
    assert one["errors"] == ["RuntimeError: rank 1's own error"]
    assert zero["errors"], zero
    assert all(e.startswith(("SaveFailed: rank 0 of 2", "RuntimeError: ")) and "gloo" in e
               or "another rank failed or died" in e for e in zero["errors"]), zero["errors"]
    assert not any("AttributeError" in e or "TypeError" in e for e in zero["errors"])
    assert zero["seconds"] < 30 and one["seconds"] < 30  # the timeout is 60 s
    assert gens(tmp_path / "run") == ["gen-000000002"]
    if mode:
        return
    resumed = job(tmp_path / "run", "--mode", "train", *args)
    for r in range(2):
        assert resumed[r][-1]["errors"] == []
        assert resumed[r][-1]["step"] == 6
        assert resumed[r][-1]["weights"] == straight[r]["weights"]  # bitwise (floats)


def test_two_ranks_in_different_collectives_fail_alike_and_stay_in_step(tmp_path):
    zero, one = job(tmp_path, "--mode", "tags")
    assert "comparing replicas failed: rank 1 was 'closing'" in zero[0]["raised"]
    assert "closing failed: rank 0 was 'comparing replicas'" in one[0]["raised"]
    assert zero[1]["after"] == one[1]["after"] == [0, 1]
    # 200 random sequences of unbroken's collectives, rank 1's leaving rank 0's at one call
    # (another name, or another kind of collective of the same name: a tag of the name alone
    # let those desynchronise the group, measured):
    # both ranks fail at that call, none sooner or later, and stay in step for the next
    for mine in (zero[2]["sequences"], one[2]["sequences"]):
        assert len(mine) == 200 and all(left == failed for left, failed in mine), mine
        assert sum(left is not None for left, _ in mine) > 100  # (most of them leave)
    # a value too large for the header on one rank is refused on both, which stay in step
    assert "too large: a value too large for a collective (another rank's;" in zero[3]["large"]
    assert "(this rank's, 2147483648;" in one[3]["large"]
    assert zero[4]["after_large"] == one[4]["after_large"] == 1
