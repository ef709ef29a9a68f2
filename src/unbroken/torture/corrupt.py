"""Corruption fuzz: mutate committed generations in every way a disk, a copy tool or a hostile
archive can, then restore, inspect and verify each mutated run.

One run with three committed generations is made once; each case copies it, applies one
mutation chosen by ``random.Random(f"{seed}:{case}")`` (so any case reruns alone from its
number), runs ``unbroken verify`` and ``unbroken inspect`` in-process, then ``restore()`` with
a fresh model and optimizer, all under a timer. A case passes when the restore ends in a typed
`UnbrokenError` whose message names the file, or loads a generation whose restored state
equals, bit for bit, what that generation saved; the commands exit 0 or 1 without a traceback;
no file outside the run changes and no code from the checkpoint runs."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import random
import shutil
import signal
import stat
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ..errors import CorruptCheckpoint, UnbrokenError
from ._case import Case
from ._job import build, prepare_parent, state_digest, train, update
from .mutations import MUTATIONS

STEPS, EVERY, KEEP = 6, 2, 3  # generations 2, 4, 6
CASE_SECONDS = 20.0


class _Timeout(BaseException):
    """Raised by the case timer: the case hung."""


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    def fire(signum: int, frame: Any) -> None:
        raise _Timeout()

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)



@dataclass
class Outcome:
    kind: str
    description: str
    verdict: str = ""  # refused | fell_back | loaded | FAILED
    detail: str = ""
    older_only: bool = False  # the mutation hit an older generation, not the newest
    failures: list[str] = field(default_factory=list)


def _cli(argv: list[str]) -> tuple[int | None, str, str]:
    from ..cli import main as cli_main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_main(argv)
        except _Timeout:
            raise
        except BaseException as e:  # noqa: BLE001 -- reported as a failure
            traceback.print_exc(file=err)
            return None, out.getvalue(), f"{type(e).__name__}: {e}\n{err.getvalue()}"
    return code, out.getvalue(), err.getvalue()


def _snapshot(folder: str) -> dict[str, str]:
    """Every entry under ``folder`` (links not followed): its mode, and a regular file's hash."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            out[p] = oct(st.st_mode)
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    out[p] += " " + xxhash.xxh3_64(f.read()).hexdigest()
    return out


class Fuzz:
    def __init__(self, cases: int, seed: int, workdir: str, only: int | None = None) -> None:
        self.cases, self.seed, self.workdir, self.only = cases, seed, workdir, only
        self.base = os.path.join(workdir, "base")
        self.outside = os.path.join(workdir, "outside")
        self.marker = os.path.join(workdir, "PAYLOAD-RAN")
        self.saved: dict[int, str] = {}  # generation -> digest of the state it saved
        self.newest = STEPS

    def make_base(self) -> None:
        log = os.path.join(self.workdir, "base-log.jsonl")
        train(self.base, log, steps=STEPS, every=EVERY, keep_last=KEEP)
        with open(log, encoding="utf-8") as f:
            for line in f:
                e = json.loads(line)
                if e["e"] == "step" and e["saved"]:
                    self.saved[e["step"]] = e["digest"]
        os.makedirs(os.path.join(self.outside, "sub"))
        with open(os.path.join(self.outside, "precious.txt"), "wb") as f:
            f.write(b"a file outside the run that no checkpoint operation may touch\n")

    def restore(self, run: str, layout: bool) -> tuple[str, Any]:
        job = None
        try:
            job = build(run, None, KEEP)
            step = job.ckpt.restore()
            digest = state_digest(job)
            rejected = list(job.ckpt.rejected)
            if layout:  # train on and save: retention and debris cleanup meet the layout
                update(job)
                job.ckpt.step_done(step + 1)
                job.ckpt.save()
            return "ok", (step, digest, rejected)
        except _Timeout:
            raise
        except UnbrokenError as e:
            return "error", e
        except BaseException as e:  # noqa: BLE001 -- judged as a failure
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
        case = Case(number, rng, run, gens, self.outside, self.marker)
        try:
            out = Outcome(kind, MUTATIONS[kind][1](case))
            out.older_only = bool(case.target) and case.target != gens[-1]
        except Exception as e:  # noqa: BLE001 -- a broken mutation is the fuzzer's own bug
            out = Outcome(kind, f"mutation failed: {type(e).__name__}: {e}")
            out.failures.append(out.description)
            return out
        before = _snapshot(self.outside)  # including what the mutation placed outside
        try:
            with _deadline(CASE_SECONDS):
                self._judge(case, out)
        except _Timeout:
            out.failures.append(f"hung for more than {CASE_SECONDS} s")
        if os.path.exists(self.marker):
            out.failures.append("a pickle payload ran (the marker file exists)")
            os.unlink(self.marker)
        after = _snapshot(self.outside)
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
            code, _, err = _cli([command, case.run])
            codes[command] = code
            if code not in (0, 1):
                out.failures.append(f"`unbroken {command}` exited {code}: {err[-600:]}")
            elif "Traceback" in err:
                out.failures.append(f"`unbroken {command}` printed a traceback: {err[-600:]}")
        status, value = self.restore(case.run, case.layout)
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
        if step not in self.saved:
            out.failures.append(f"restore returned step {step}, which no generation saved")
        elif digest != self.saved[step]:
            out.failures.append(f"restore loaded WRONG DATA: the state restored at step {step} "
                                "differs from what that generation saved")
        if step == self.newest and not rejected:
            out.verdict, out.detail = "loaded", f"generation {step}, state equal"
        else:
            out.verdict = "fell_back"
            out.detail = (f"generation {step}, state equal; rejected "
                          f"{[os.path.basename(p) for p, _ in rejected]}")
            if codes["verify"] == 0 and not case.layout:
                out.failures.append("`unbroken verify` passed a run whose newest generation "
                                    "restore rejected")

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        self.make_base()
        by_kind: dict[str, dict[str, int]] = {
            k: {"cases": 0, "refused": 0, "fell_back": 0, "loaded": 0, "loaded_older_mutated": 0,
                "failures": 0}
            for k in sorted(MUTATIONS)}
        errors: dict[str, int] = {}
        failures: list[dict[str, Any]] = []
        case_log: list[dict[str, Any]] = []
        numbers = [self.only] if self.only is not None else range(self.cases)
        log = logging.getLogger("unbroken")
        level, propagate = log.level, log.propagate
        log.setLevel(logging.CRITICAL)
        log.propagate = False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for n in numbers:
                    o = self.one(n)
                    case_log.append({"case": n, "kind": o.kind, "mutation": o.description,
                                     "verdict": o.verdict, "detail": o.detail})
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
            log.setLevel(level)
            log.propagate = propagate
        total = {k: sum(r[k] for r in by_kind.values())
                 for k in ("cases", "refused", "fell_back", "loaded", "loaded_older_mutated",
                           "failures")}
        return {"mode": "corrupt", "seed": self.seed, "cases": total["cases"],
                "refused": total["refused"], "fell_back": total["fell_back"],
                "loaded": total["loaded"], "loaded_older_mutated": total["loaded_older_mutated"],
                "failed": total["failures"], "by_kind": by_kind,
                "errors_by_type": dict(sorted(errors.items())), "failures": failures,
                "case_log": case_log,
                "seconds": round(time.monotonic() - started, 2),
                "ok": total["failures"] == 0 and total["cases"] == len(numbers)}


def _skip_hash() -> Callable[[], None]:
    """A loader that trusts sizes and never re-hashes content, on purpose."""
    from ..store import GenerationStore

    original = GenerationStore._read_artifact

    def read(self: GenerationStore, folder: str, a: Any) -> bytes:
        return self.fs.read_file(os.path.join(folder, a.name), a.size)

    GenerationStore._read_artifact = read  # type: ignore[method-assign]
    return lambda: setattr(GenerationStore, "_read_artifact", original)


# Known-bad implementations the fuzz must catch (a test of the test: exit status 1).
SABOTAGE: dict[str, Callable[[], Callable[[], None]]] = {"skip-hash": _skip_hash}


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
            keep: bool = False, sabotage: str | None = None) -> dict[str, Any]:
    import torch

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
