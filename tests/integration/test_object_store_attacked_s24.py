"""Attacks on the object store (moto's S3 server, real child processes, SIGKILL):

* a superseding save (the same step saved again after its state changed) killed at every
  mutating I/O operation must leave a run whose restore continues from that step, bitwise as
  the old save or the new one (whichever the kill point says), never from scratch;
* a restart of a run keeping many generations must not download every one of them, nor list
  or read every manifest once per generation."""

from __future__ import annotations

import json
import signal
import textwrap
import uuid
from pathlib import Path

import pytest
from conftest import BUCKET, run_script

# The run's objects and their digest, which the killed child prints and the test restores
# in-process after each kill (a process per check doubled the sweep's time).
RUN = textwrap.dedent('''
    import hashlib, json
    import torch, unbroken

    def build(url, **options):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)

        def digest():
            h = hashlib.sha256()
            for t in model.state_dict().values():
                h.update(t.detach().numpy().tobytes())
            for s in opt.state_dict()["state"].values():
                h.update(s["momentum_buffer"].numpy().tobytes())
            h.update(json.dumps(sched.state_dict(), sort_keys=True, default=str).encode())
            return h.hexdigest()

        c = unbroken.Checkpointer(url, model=model, optimizer=opt, scheduler=sched,
                                  read_back="sync", **options)
        return model, opt, sched, c, digest
''')

CHILD = RUN + textwrap.dedent('''
    import os, sys
    from unbroken.store.backends.objects import ObjectFS

    url, mode = sys.argv[1], sys.argv[2]
    if os.environ.get("OPS_LOG"):  # every mutating operation's kind, in order (a dry run)
        counted = ObjectFS._op

        def logged(self, kind, path):
            if kind != "read":
                with open(os.environ["OPS_LOG"], "a") as f:
                    f.write(f"{kind} {path}\\n")
            counted(self, kind, path)
        ObjectFS._op = logged
    model, opt, sched, c, digest = build(url)
    step = c.restore()
    if mode == "first":
        g = torch.Generator().manual_seed(1)
        while step < 10:
            model(torch.randn(4, 8, generator=g)).sum().backward()
            opt.step(); opt.zero_grad(); step += 1; c.step_done(step)
        c.save()
    elif mode.startswith("again"):
        assert step == 10, step
        sched.step()  # the end-of-epoch scheduler step: the same step, a new state
    if mode == "again-unreadable":  # its read-back fails: the old one must come back
        from unbroken.errors import CorruptCheckpoint
        from unbroken.store.objects import ObjectStore

        def fail(self, info, *args, **kwargs):
            raise CorruptCheckpoint(f"{info.path}: did not read back (simulated)")
        ObjectStore.verify = fail
    print(json.dumps({"step": step, "digest": digest()}), flush=True)
    if mode.startswith("again"):
        c.save()
    c.close()
''')


def _restored(s3: dict, url: str) -> dict:
    """What a new Checkpointer restores from ``url`` (in this process): its step and digest."""
    space: dict = {}
    exec(RUN, space)
    *_, c, digest = space["build"](url, storage_options=s3["options"])
    try:
        return {"step": c.restore(), "digest": digest()}
    finally:
        c.close()


def _child(tmp_path: Path) -> str:
    path = tmp_path / "child.py"
    if not path.exists():
        path.write_text(CHILD)
    return str(path)


def _run(tmp_path: Path, s3: dict, url: str, mode: str, **env: str) -> tuple[int, dict, str]:
    r = run_script(_child(tmp_path), url, mode, env={**s3["env"], **env}, timeout=120)
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    return r.returncode, (lines[-1] if lines else {}), r.stderr


class _Snapshot:
    """The run as the first save left it, copied aside once and put back before each kill
    (objects copied on the server: a training process per kill point made the sweep slow)."""

    def __init__(self, s3: dict, url: str) -> None:
        import s3fs

        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3["options"])
        self.run = url.removeprefix("s3://")
        self.copy = f"{self.run}-snapshot"
        self._mirror(self.run, self.copy)

    def _mirror(self, src: str, dst: str) -> None:
        self.fs.invalidate_cache()
        if self.fs.exists(dst):
            self.fs.rm(dst, recursive=True)
        for key in self.fs.find(src):
            self.fs.copy(key, dst + key[len(src):])
        self.fs.invalidate_cache()

    def put_back(self) -> None:
        self._mirror(self.copy, self.run)


def _operations(tmp_path: Path, s3: dict, url: str, mode: str, kind: str,
                snapshot: _Snapshot) -> list[tuple[str, str]]:
    """The mutating operations (kind, path) of the run ``mode`` (those of ``kind`` only, if
    given), in order, from a dry run that is not killed (the run then put back)."""
    log = tmp_path / "ops"
    log.unlink(missing_ok=True)
    snapshot.put_back()
    _run(tmp_path, s3, url, mode, OPS_LOG=str(log))
    ops = [tuple(line.split(" ", 1)) for line in log.read_text().splitlines()]
    assert ops, "the dry run performed no operation"
    return [op for op in ops if op[0] == kind.rstrip(":")] if kind else ops


def _changes_the_store(ops: list[tuple[str, str]], k: int) -> bool:
    """Whether the store may differ between a kill just before operation ``k`` (1-based) and
    one just before operation ``k - 1``: nothing reaches an object store between an upload's
    ``create``, its ``write``s (gathered in memory) and its ``fsync`` (just before the PUT);
    only the PUT after an ``fsync``, a ``create`` not followed by one (a small record put
    whole, a server-side copy) and an ``unlink`` change it. A kill at an operation that
    changes nothing leaves what a kill at the one before it left: swept once, not twice."""
    if k == 1:
        return True
    before, after = ops[k - 2][0], ops[k - 1][0]
    return before in ("fsync", "unlink") or before == "create" and after not in ("write",
                                                                                 "fsync")


def _kill_points(ops: list[tuple[str, str]]) -> list[int]:
    """The operations (1-based) a sweep kills at: those that may change the store
    (`_changes_the_store`), and of a run of them of one kind in one folder (the files of an
    upload copied into ``aside/`` one by one, those of an old upload folder deleted), the
    first and the last: a kill inside such a run leaves that folder with some of its files,
    as a kill at its first or its last does with one file more or fewer."""
    points = [k for k in range(1, len(ops) + 1) if _changes_the_store(ops, k)]

    def group(k: int) -> tuple[str, str]:
        kind, path = ops[k - 1]
        return kind, path.rsplit("/", 1)[0]
    return [k for i, k in enumerate(points)
            if i in (0, len(points) - 1) or group(points[i - 1]) != group(k)
            or group(points[i + 1]) != group(k)]


def _sweep(tmp_path: Path, s3: dict, mode: str, kind: str = "", base: tuple | None = None
           ) -> tuple[list, dict, dict, int, tuple]:
    """Kill the process that restores step 10, steps its scheduler and saves step 10 again
    (``mode``) at each of its mutating operations in turn (``kind``: at each of that kind;
    `_kill_points` says which); after each kill, restore with a new Checkpointer. The state
    restored must be step 10 bitwise, as the old save or the new one: the one whose manifest was
    uploaded last before the kill (the first save's until the first upload of that manifest by
    this process, then the other's at each one). Returns what each kill point restored, both
    states, the exit status of the run that was not killed (its run left as it ended), and the
    ``base`` (the run's URL, the first save's state, its copy) another sweep may start from
    again."""
    note = tmp_path / "note"
    if base is None:
        url = f"s3://{BUCKET}/supersede-{uuid.uuid4().hex[:8]}"
        rc, first, err = _run(tmp_path, s3, url, "first")
        assert rc == 0 and first["step"] == 10, err[-3000:]
        base = url, first, _Snapshot(s3, url)
    url, first, snapshot = base
    outcomes = []
    ops = _operations(tmp_path, s3, url, mode, kind, snapshot)
    for k in [*_kill_points(ops), len(ops) + 1]:
        snapshot.put_back()
        note.unlink(missing_ok=True)
        rc, again, err = _run(tmp_path, s3, url, mode, UNBROKEN_KILL_AT_OP=f"{kind}{k}",
                              UNBROKEN_KILL_NOTE=str(note))
        if rc != -signal.SIGKILL:
            return outcomes, first, again, rc, base  # past the last operation
        _, killed, path = note.read_text().split()
        assert killed == ops[k - 1][0], (k, killed, ops)  # (the dry run's sequence)
        back = _restored(s3, url)
        if kind:  # (only kills after the new manifest's upload: see the test)
            want, which = again, "new"
        else:
            # (uploads of the step's manifest by the killed process before it died)
            uploads = ops[:k - 1].count(("fsync", f"{url}/gen-000000010/MANIFEST.json"))
            want, which = (again, "new") if uploads % 2 else (first, "old")
        outcomes.append((k, killed, path, which))
        assert back == {"step": 10, "digest": want["digest"]}, (
            f"kill at {kind}{k} ({killed} {path}): restored {back}, expected the {which} step "
            f"10 ({want}); the other is {again if want is first else first}")
    pytest.fail("the superseding save never finished")


def test_a_superseding_save_killed_at_any_operation_restores_the_same_step(s3, tmp_path):
    """The new generation is committed, fails its read-back (simulated) and the superseded
    one is put back: a kill at any operation of all that (the old one copied aside, the
    manifest replaced, the old upload folder deleted, and the same again the other way)
    leaves the old one or the new one, bitwise, never step 0 (nor an older step); the run
    that is not killed ends with the old one back. A save whose read-back passes does the
    same up to its manifest's upload, then deletes the old upload folder: each of those
    deletions is a kill point of its own, after which the new one is restored."""
    outcomes, first, again, rc, base = _sweep(tmp_path, s3, "again-unreadable")
    assert rc == 1
    assert first["digest"] != again["digest"]
    assert [w for *_, w in outcomes].count("new") > 0, outcomes
    # the sweep went through the copies into aside/ and the deletions of the upload folders
    assert any(w == "old" and "/aside/" in p for _, _, p, w in outcomes), outcomes
    assert any(kind == "unlink" and "/gen-000000010/u-" in p for _, kind, p, _ in outcomes)
    # (the run the sweep did not kill, as it left it: the old one back)
    assert _restored(s3, base[0]) == {"step": 10, "digest": first["digest"]}
    # the passing save: killed at each deletion (its manifest was replaced before the first),
    # from the same first save
    outcomes, first, again, rc, _ = _sweep(tmp_path, s3, "again", kind="unlink:", base=base)
    assert rc == 0 and outcomes, outcomes
    assert any("/gen-000000010/u-" in p for _, _, p, _ in outcomes), outcomes
    assert all("/gen-000000010/u-" in p or "/aside/" in p or p.endswith("/LEASE.json")
               for _, _, p, _ in outcomes), outcomes  # (the lease: given up at close)


COUNTING = textwrap.dedent('''
    import collections, json, sys
    import torch, unbroken
    from unbroken.store.backends.objects import ObjectFS

    url, steps = sys.argv[1], int(sys.argv[2])
    calls = collections.Counter()

    def counted(name):
        method = getattr(ObjectFS, name)
        def call(self, path, *args, **kwargs):
            what = "manifest" if path.endswith("/MANIFEST.json") else (
                "artifact" if "/gen-" in path else "other")
            calls[f"{name} {what}"] += 1
            return method(self, path, *args, **kwargs)
        setattr(ObjectFS, name, call)

    for name in ("listing", "read_file", "hash_file"):
        counted(name)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.Adam(model.parameters())
    c = unbroken.Checkpointer(url, model=model, optimizer=opt, keep=unbroken.Keep(last=100))
    step = c.restore()
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward(); opt.step(); opt.zero_grad()
        step += 1; c.step_done(step)
        c.save(); c.wait()
    c.close()
    print(json.dumps(calls), flush=True)
''')


def test_a_restart_of_a_run_keeping_many_generations_does_not_download_them_all(s3, tmp_path):
    """Restore, one save and its retention with 12 kept generations: the artifacts read are
    the restored generation's and the new one's read-back, not every kept generation's;
    each manifest is read once, not once per scan; listing does not grow with the run."""
    script = tmp_path / "counting.py"
    script.write_text(COUNTING)
    url = f"s3://{BUCKET}/many-{uuid.uuid4().hex[:8]}"
    first = run_script(str(script), url, "12", env=s3["env"], timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    r = run_script(str(script), url, "1", env=s3["env"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    calls = json.loads(r.stdout.splitlines()[-1])
    artifacts_per_generation = 4  # model, optimizer, rng, state
    downloads = calls.get("read_file artifact", 0) + calls.get("hash_file artifact", 0)
    assert downloads <= 2 * artifacts_per_generation, calls  # restored + read back
    assert calls.get("read_file manifest", 0) <= 13 + 2, calls  # each once, the new one
    assert sum(v for k, v in calls.items() if k.startswith("listing")) <= 8, calls
