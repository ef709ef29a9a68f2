"""Corruption fuzz: mutate committed generations in every way a disk, a copy tool or a hostile
archive can, then restore, inspect and verify each mutated run.

One run with three committed generations is made once; each case copies it, applies one
mutation chosen by ``random.Random(f"{seed}:{case}")`` (so any case reruns alone from its
number), runs ``unbroken verify`` and ``unbroken inspect`` in-process, then ``restore()`` with
a fresh model and optimizer, all under a timer. A case passes when the restore ends in a typed
`UnbrokenError` whose message names the file, or loads a generation whose restored state
equals, bit for bit, what that generation saved; the commands exit 0 or 1 without a traceback;
no exception outside `UnbrokenError` escapes (nor refuses a candidate generation); no file
outside the run changes, no file a mutation made oversized is read whole, and no code from the
checkpoint runs. A second run, trained independently (another run id, other random streams),
supplies the generations that the foreign-generation mutation copies in."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptCheckpoint, UnbrokenError
from ..store.aside import ASIDE
from ._case import Case
from ._job import build, prepare_parent, state_digest, train, update
from ._probe import Probe, Timeout, deadline, run_cli, snapshot
from .mutations import MUTATIONS

STEPS, EVERY, KEEP = 6, 2, 3  # generations 2, 4, 6
OTHER_STEPS = 8  # the independent run: generations 2, 4, 6, 8
CASE_SECONDS = 20.0



@dataclass
class Outcome:
    kind: str
    description: str
    verdict: str = ""  # refused | fell_back | loaded | FAILED
    detail: str = ""
    older_only: bool = False  # the mutation hit an older generation, not the newest
    failures: list[str] = field(default_factory=list)
    exceptions: list[str] = field(default_factory=list)  # type names, each exception once
    untyped: list[str] = field(default_factory=list)  # ... of those outside UnbrokenError


class Fuzz:
    def __init__(self, cases: int, seed: int, workdir: str, only: int | None = None) -> None:
        self.cases, self.seed, self.workdir, self.only = cases, seed, workdir, only
        self.base = os.path.join(workdir, "base")
        self.outside = os.path.join(workdir, "outside")
        self.marker = os.path.join(workdir, "PAYLOAD-RAN")
        self.other = os.path.join(workdir, "other-run")
        self.saved: dict[int, str] = {}  # generation -> digest of the state it saved
        self.other_saved: dict[int, str] = {}  # the same for the independent run
        self.newest = STEPS
        self.probe = Probe()

    @staticmethod
    def _train(run: str, log: str, steps: int, keep: int, reseed: int | None) -> dict[int, str]:
        train(run, log, steps=steps, every=EVERY, keep_last=keep, reseed=reseed)
        saved = {}
        with open(log, encoding="utf-8") as f:
            for line in f:
                e = json.loads(line)
                if e["e"] == "step" and e["saved"]:
                    saved[e["step"]] = e["digest"]
        return saved

    def make_base(self) -> None:
        self.saved = self._train(self.base, os.path.join(self.workdir, "base-log.jsonl"),
                                 STEPS, KEEP, None)
        self.other_saved = self._train(self.other, os.path.join(self.workdir, "other-log.jsonl"),
                                       OTHER_STEPS, OTHER_STEPS, 1)
        if any(self.other_saved.get(k) == v for k, v in self.saved.items()):
            raise RuntimeError("the independent run saved the same state as the base run")
        os.makedirs(os.path.join(self.outside, "sub"))
        with open(os.path.join(self.outside, "precious.txt"), "wb") as f:
            f.write(b"a file outside the run that no checkpoint operation may touch\n")

    def restore(self, run: str, layout: bool, adopt: bool) -> tuple[str, Any]:
        job = None
        try:
            job = build(run, None, KEEP)
            step = job.ckpt.restore(adopt=adopt)
            digest = state_digest(job)
            rejected = list(job.ckpt.rejected)
            if layout:  # train on and save: retention and debris cleanup meet the layout
                update(job)
                job.ckpt.step_done(step + 1)
                job.ckpt.save()
            return "ok", (step, digest, rejected)
        except Timeout:
            raise
        except UnbrokenError as e:
            self.probe.exception(e)
            return "error", e
        except BaseException as e:  # noqa: BLE001 -- judged as a failure
            self.probe.exception(e)
            return "other", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
        finally:
            if job is not None:
                job.ckpt.close()

    def one(self, number: int) -> Outcome:
        rng = random.Random(f"{self.seed}:{number}")
        run = os.path.join(self.workdir, f"case-{number:05d}")
        shutil.copytree(self.base, run, symlinks=True)
        gens = sorted(os.path.join(run, n) for n in os.listdir(run) if n.startswith("gen-"))
        names = sorted(MUTATIONS)
        kind = rng.choices(names, [MUTATIONS[n][0] for n in names])[0]
        case = Case(number, rng, run, gens, self.outside, self.marker,
                    other_run=self.other, other_saved=self.other_saved)
        try:
            out = Outcome(kind, MUTATIONS[kind][1](case))
            out.older_only = bool(case.target) and case.target != gens[-1]
        except Exception as e:  # noqa: BLE001 -- a broken mutation is the fuzzer's own bug
            out = Outcome(kind, f"mutation failed: {type(e).__name__}: {e}")
            out.failures.append(out.description)
            return out
        before = snapshot(self.outside)  # including what the mutation placed outside
        self.probe.reset()
        try:
            with deadline(CASE_SECONDS):
                self._judge(case, out)
        except Timeout:
            out.failures.append(f"hung for more than {CASE_SECONDS} s")
        out.exceptions = self.probe.types
        out.untyped = self.probe.outside_unbroken_error()
        if out.untyped:
            out.failures.append(f"exceptions outside UnbrokenError: {', '.join(out.untyped)}")
        whole = self.probe.read_whole(case.no_whole_read)
        if whole:
            out.failures.append(f"an oversized file was read whole: {whole[:3]}")
        if os.path.exists(self.marker):
            out.failures.append("a pickle payload ran (the marker file exists)")
            os.unlink(self.marker)
        after = snapshot(self.outside)
        if after != before:
            changed = sorted(set(before.items()) ^ set(after.items()))
            out.failures.append(f"something outside the run changed: {changed[:6]}")
        shutil.rmtree(run, ignore_errors=True)
        for n in os.listdir(self.outside):  # per-case copies the mutation placed outside
            if n.startswith(("copy-", "same-")):
                p = os.path.join(self.outside, n)
                shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
        if out.failures:
            out.verdict = "FAILED"
        return out

    def _judge(self, case: Case, out: Outcome) -> None:
        codes = {}
        for command in ("verify", "inspect"):
            code, _, err = run_cli([command, case.run], self.probe)
            codes[command] = code
            if code not in (0, 1):
                out.failures.append(f"`unbroken {command}` exited {code}: {err[-600:]}")
            elif "Traceback" in err:
                out.failures.append(f"`unbroken {command}` printed a traceback: {err[-600:]}")
        status, value = self.restore(case.run, case.layout, case.adopt)
        if status == "other":
            out.failures.append(f"restore raised an untyped exception: {value}")
            return
        if status == "error":
            message = str(value)
            out.verdict, out.detail = "refused", f"{type(value).__name__}: {message[:300]}"
            if case.run not in message:
                out.failures.append(f"the error does not name the file: {message[:300]}")
            # "No generation verifies": then `unbroken verify` must have failed too. (Errors
            # from validating state against the live objects are beyond what verify checks.)
            if (isinstance(value, CorruptCheckpoint) and codes["verify"] == 0
                    and "no generation verifies" in message and not case.layout):
                out.failures.append("`unbroken verify` passed a run that restore refused as "
                                    f"corrupt: {message[:300]}")
            return
        step, digest, rejected = value
        if case.every_generation:
            out.failures.append(f"every generation was corrupt, yet restore returned {step}")
        # What each step on disk saved: a foreign generation's own state only when adopted.
        expected = {**self.saved, **case.foreign} if case.adopt else dict(self.saved)
        if step not in expected:
            out.failures.append(f"restore returned step {step}, which no generation saved"
                                + (" (the FOREIGN generation, not adopted)"
                                   if step in case.foreign else ""))
        elif digest != expected[step]:
            foreign = step in case.foreign and digest == case.foreign[step]
            out.failures.append(f"restore loaded WRONG DATA: the state restored at step {step} "
                                "differs from what that generation saved"
                                + (" (it is the FOREIGN generation's, not adopted)"
                                   if foreign else ""))
        self._judge_foreign(case, out, step)
        if step == (case.newest or self.newest) and not rejected:
            out.verdict, out.detail = "loaded", f"generation {step}, state equal"
        else:
            out.verdict = "fell_back"
            out.detail = (f"generation {step}, state equal; rejected "
                          f"{[os.path.basename(p) for p, _ in rejected]}")
            # (Unless every refusal came from fitting the state to the live objects, which
            # verify, having none, cannot check.)
            if codes["verify"] == 0 and not case.layout and not (
                    rejected and all(_live_check(p, why) for p, why in rejected)):
                out.failures.append("`unbroken verify` passed a run whose newest generation "
                                    "restore rejected")

    def _judge_foreign(self, case: Case, out: Outcome, step: int) -> None:
        """Not adopted, a foreign generation newer than the one loaded must have been refused
        as foreign and moved aside with that label."""
        if case.adopt:
            return
        for s in (s for s in case.foreign if s > step):
            name = f"gen-{s:09d}"
            if "ForeignGeneration" not in self.probe.types:
                out.failures.append(f"{name} (foreign) was not refused with ForeignGeneration "
                                    f"(seen: {self.probe.types})")
            aside = os.path.join(case.run, ASIDE)
            labels = os.listdir(aside) if os.path.isdir(aside) else []
            if not any(n.startswith(f"{name}-foreign-") for n in labels):
                out.failures.append(f"{name} (foreign) is not in aside/ labelled foreign: "
                                    f"{labels}")

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        self.make_base()
        by_kind: dict[str, dict[str, int]] = {
            k: {"cases": 0, "refused": 0, "fell_back": 0, "loaded": 0, "loaded_older_mutated": 0,
                "failures": 0}
            for k in sorted(MUTATIONS)}
        errors: dict[str, int] = {}
        seen: dict[str, int] = {}  # every exception type seen, in every case
        untyped: set[str] = set()
        failures: list[dict[str, Any]] = []
        case_log: list[dict[str, Any]] = []
        numbers = [self.only] if self.only is not None else range(self.cases)
        log = logging.getLogger("unbroken")
        level, propagate = log.level, log.propagate
        log.setLevel(logging.CRITICAL)
        log.propagate = False
        uninstall = self.probe.install()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for n in numbers:
                    o = self.one(n)
                    case_log.append({"case": n, "kind": o.kind, "mutation": o.description,
                                     "verdict": o.verdict, "detail": o.detail})
                    for name in o.exceptions:
                        seen[name] = seen.get(name, 0) + 1
                    untyped.update(o.untyped)
                    row = by_kind[o.kind]
                    row["cases"] += 1
                    if o.failures:
                        row["failures"] += 1
                        failures.append({"case": n, "kind": o.kind, "mutation": o.description,
                                         "failures": o.failures})
                    else:
                        row[o.verdict] += 1
                        if o.verdict == "loaded" and o.older_only:
                            row["loaded_older_mutated"] += 1
                        if o.verdict == "refused":
                            name = o.detail.split(":", 1)[0]
                            errors[name] = errors.get(name, 0) + 1
        finally:
            uninstall()
            log.setLevel(level)
            log.propagate = propagate
        total = {k: sum(r[k] for r in by_kind.values())
                 for k in ("cases", "refused", "fell_back", "loaded", "loaded_older_mutated",
                           "failures")}
        return {"mode": "corrupt", "seed": self.seed, "cases": total["cases"],
                "refused": total["refused"], "fell_back": total["fell_back"],
                "loaded": total["loaded"], "loaded_older_mutated": total["loaded_older_mutated"],
                "failed": total["failures"], "by_kind": by_kind,
                "errors_by_type": dict(sorted(errors.items())),
                "exception_types": dict(sorted(seen.items(), key=lambda kv: (-kv[1], kv[0]))),
                "exceptions_outside_unbroken_error": sorted(untyped),
                "failures": failures,
                "case_log": case_log,
                "seconds": round(time.monotonic() - started, 2),
                "ok": total["failures"] == 0 and total["cases"] == len(numbers)}


def _live_check(path: str, why: str) -> bool:
    """Whether a refusal came from fitting the saved state to the live objects (the reason
    names the generation folder or its file, and a part: "gen-... [optimizer]: ...",
    "gen-.../state.json [scheduler]: ...")."""
    named = why.startswith(f"{path} [") or (
        why.startswith(f"{path}/") and " [" in why.split(":", 1)[0]
        and "/" not in why[len(path) + 1:why.index(" [")])
    return named or "saved state does not validate" in why


def _skip_hash() -> Callable[[], None]:
    """A loader that trusts sizes and never re-hashes content, on purpose."""
    from ..store.generations import GenerationStore

    original = GenerationStore._read_artifact

    def read(self: GenerationStore, folder: str, a: Any) -> bytes:
        return self.fs.read_file(os.path.join(folder, a.name), a.size)

    GenerationStore._read_artifact = read  # type: ignore[method-assign,assignment]
    return lambda: setattr(GenerationStore, "_read_artifact", original)


def _accept_foreign() -> Callable[[], None]:
    """A loader that continues from any run's generation (every restore adopts), on purpose."""
    from .. import picking

    original: Any = picking._load

    def load(store: Any, info: Any, intent: str, allow: Any, adopt: bool, *rest: Any) -> Any:
        return original(store, info, intent, allow, True, *rest)

    setattr(picking, "_load", load)
    return lambda: setattr(picking, "_load", original)


def _no_size_limits() -> Callable[[], None]:
    """A loader that reads state.json whatever size the manifest lists, on purpose."""
    from ..state import generation as state

    original = state.check_sizes
    setattr(state, "check_sizes", lambda manifest, folder: None)
    return lambda: setattr(state, "check_sizes", original)


# Known-bad implementations the fuzz must catch (a test of the test: exit status 1).
SABOTAGE: dict[str, Callable[[], Callable[[], None]]] = {
    "skip-hash": _skip_hash, "accept-foreign": _accept_foreign,
    "no-size-limits": _no_size_limits}


def _scratch_dir() -> str:
    """The fuzz checks parsing and validation, not durability: a memory-backed folder
    (/dev/shm) makes it several times faster where one exists."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        try:
            return tempfile.mkdtemp(prefix="unbroken-fuzz-", dir=shm)
        except OSError:
            pass
    return tempfile.mkdtemp(prefix="unbroken-fuzz-")


def corrupt(cases: int, seed: int, workdir: str | None = None, only: int | None = None,
            keep: bool = False, sabotage: str | None = None, map_all: bool = False
            ) -> dict[str, Any]:
    import torch

    from .. import picking

    if map_all:  # (the fuzz's models are small: their files would be read whole)
        picking._MAP_MIN = 0
    prepare_parent()
    torch.set_num_threads(1)
    own = workdir is None
    work = workdir or _scratch_dir()
    os.makedirs(work, exist_ok=True)
    undo = SABOTAGE[sabotage]() if sabotage else None
    try:
        return Fuzz(cases, seed, work, only).run()
    finally:
        if undo is not None:
            undo()
        if own and not keep:
            shutil.rmtree(work, ignore_errors=True)
