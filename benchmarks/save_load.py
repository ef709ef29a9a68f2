"""Save/load throughput of model + optimizer state: the disk itself, torch.save/torch.load,
safetensors, torch.distributed.checkpoint (one process) and unbroken, in one run, on one disk.

Every method handles the same tensors (a stack of Linear layers plus AdamW's exp_avg,
exp_avg_sq and step), is timed end to end including fsync, and loads back *into the live model
and optimizer* (what a restore has to do). GB/s is always payload bytes (the tensors' nbytes) per
second, so methods are comparable whatever their file overhead. Each "x disk" ratio divides by
the O_DIRECT bandwidth measured in the same round-robin for the same size.

Rounds are interleaved (rep 1 of every method, then rep 2, ...) so that drift of a shared
virtual disk hits every method alike. Each case runs in a child process of its own (all its
methods in it), so that no case is measured in what an earlier case's loads left behind
(--one-process: all in this one). Loads are cold by default: the files' clean pages are
dropped from the page cache with posix_fadvise(DONTNEED) before each load (drop_caches needs
root; this needs nothing). The host may still cache the virtual disk.

Before each cold load the share of the files' pages still in the page cache is read with
mincore(2); a load that found more than 1% of them cached is marked "not cold".

Async saves (unbroken's Checkpointer(async_save=True), DCP's async_save) report two figures:
"blocked", from the save call until it returns, and "durable", until wait() / future.result()
returns. "memcpy reused" is a copy_ of every state tensor into preallocated buffers: the floor
of a snapshot (the goal for async saves: blocked <= 1.5x this copy). Each async method and the
copy run once per case untimed first, so their buffers exist, as in a long run.

Before each timed save, every method's, the state is walked and read once, untimed
(`touch`): in a training loop a save follows the update, which has just read and written the
state, and no method should be timed in what the method before it in the round left in the
caches. (Without it, the snapshot of 10,000 small tensors taken right after DCP's async save,
which is always its predecessor in the rounds, took 27 ms instead of 16 ms, while the copy it
is compared with came right after a save that had read the state.)

Every figure is the median of --repeats (default 5) interleaved repetitions; its spread is the
interquartile range as % of the median, and a figure whose IQR exceeds 25% is shown as
"unstable" instead of a result (min-max is shown as well). torch runs one intra-op thread by
default (--threads): on 2 cores shared with other jobs, two OpenMP threads stall at every
barrier while the other core is taken.

Peak memory is the peak resident set size during the operation minus the resident set size
before it (Linux /proc/self/clear_refs resets the peak; file pages mapped by mmap count too).

    .venv/bin/python benchmarks/save_load.py                 # default sizes, ~5 min on 2 cores
    .venv/bin/python benchmarks/save_load.py --quick         # tiny sizes, smoke run (< 30 s)
    .venv/bin/python benchmarks/save_load.py --sizes 64M,512M,1G,1.5G --small 20000 --repeats 9
    .venv/bin/python benchmarks/save_load.py --json --out results.json

The training-loop benchmark of async saves is benchmarks/loop.py.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

GB = 1e9
MB = 1e6
DIRECT_BLOCK = 64 << 20  # O_DIRECT transfer size: the fastest single-stream size measured here
ALIGN = 4096


def _generation_module(parts: Any) -> Any:
    """Where ``encode_generation`` / ``decode_generation`` live: ``unbroken.state.generation``,
    or the parts module of an older checkout (benchmarked against through PYTHONPATH)."""
    try:
        import unbroken.state.generation as generation
    except ImportError:
        return parts
    return generation


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# machine and disk facts


def mount_of(path: str) -> dict[str, str]:
    """Device, mount point and filesystem type holding ``path`` (longest /proc/mounts match)."""
    real = os.path.realpath(path)
    best = {"device": "unknown", "mount": "", "fstype": "unknown", "options": ""}
    with open("/proc/mounts", encoding="utf-8") as f:
        for line in f:
            dev, mnt, fstype, opts, *_ = line.split()
            mnt = mnt.replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and \
                    len(mnt) >= len(best["mount"]):
                best = {"device": dev, "mount": mnt, "fstype": fstype, "options": opts}
    return best


def pick_root(requested: str | None) -> str:
    """A temp folder on a real disk: /work if it is one, else /tmp, else the current folder."""
    if requested:
        os.makedirs(requested, exist_ok=True)
        return tempfile.mkdtemp(prefix="unbroken-bench-", dir=requested)
    for base in ("/work", tempfile.gettempdir(), os.getcwd()):
        if os.path.isdir(base) and os.access(base, os.W_OK) and \
                mount_of(base)["fstype"] not in ("tmpfs", "ramfs", "overlay", "zram"):
            return tempfile.mkdtemp(prefix="unbroken-bench-", dir=base)
    return tempfile.mkdtemp(prefix="unbroken-bench-")


def direct_io_works(root: str) -> bool:
    """Whether the filesystem under ``root`` accepts O_DIRECT (tmpfs, for one, does not)."""
    probe = os.path.join(root, ".o_direct_probe")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
        return True
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)


def machine_info(root: str) -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_total = 0
    with contextlib.suppress(OSError), open("/proc/meminfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_total = int(line.split()[1]) * 1024
    mnt = mount_of(root)
    dev = os.path.basename(mnt["device"])
    rotational = scheduler = None
    with contextlib.suppress(OSError):
        with open(f"/sys/block/{dev}/queue/rotational", encoding="utf-8") as f:
            rotational = f.read().strip() == "1"
        with open(f"/sys/block/{dev}/queue/scheduler", encoding="utf-8") as f:
            scheduler = f.read().strip()
    st = shutil.disk_usage(root)
    import safetensors
    import xxhash

    import unbroken
    return {
        "cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "memory_gb": round(mem_total / GB, 1), "kernel": platform.release(),
        "python": platform.python_version(), "torch": torch.__version__,
        "safetensors": safetensors.__version__, "xxhash": xxhash.VERSION,
        "unbroken": getattr(unbroken, "__version__", "editable"),
        "unbroken_path": os.path.dirname(unbroken.__file__),  # tells a PYTHONPATH run apart
        "target": {"dir": root, **mnt, "rotational": rotational, "scheduler": scheduler,
                   "free_gb": round(st.free / GB, 1)},
    }


def _times(fn: Callable[[], Any], n: int) -> list[float]:
    """Seconds of ``n`` calls of ``fn``, one at a time."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def memory_rates(nbytes: int = 256 << 20) -> dict[str, float]:
    """GB/s of a copy into a reused buffer, into fresh memory, and of xxh3-128 hashing: the
    in-memory ceilings every method below runs into."""
    import xxhash
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)

    def best(fn: Callable[[], Any]) -> float:
        return nbytes / min(_times(fn, 3)) / GB

    view = memoryview(src.numpy())
    out = {"copy_reused_gbps": best(lambda: dst.copy_(src)),
           "copy_fresh_gbps": best(lambda: torch.empty_like(src).copy_(src)),
           "bytes_fresh_gbps": best(lambda: bytes(view)),
           "xxh3_128_gbps": best(lambda: xxhash.xxh3_128(view).digest())}
    return {k: round(v, 2) for k, v in out.items()}


def python_rates(n: int = 10000) -> dict[str, float]:
    """Milliseconds (median of 7, as the figures are) of the per-tensor Python work that a
    save or restore of ``n`` small tensors cannot avoid: parsing a safetensors header of
    ``n`` entries (``json.loads``) and making ``n`` tensors over slices of one array
    (``torch.from_numpy``, what a restore's views cost at least), before and after the cases.
    They tell whether that floor moved. On 2026-12-03 it did not, while the same 10k restore
    took 0.105 s at 15:35 and 0.231 s at 16:53: that drift showed in `memory_rates` (a copy
    into a reused buffer at 7.43 and 4.92 GB/s)."""
    header = json.dumps({f"state.{i}.weight.exp_avg": {
        "dtype": "F32", "shape": [32, 32], "data_offsets": [i * 4096, (i + 1) * 4096]}
        for i in range(n)}).encode()
    flat = np.zeros(n * 1024, dtype=np.float32)
    slices = [flat[i * 1024:(i + 1) * 1024] for i in range(n)]

    def median(fn: Callable[[], Any]) -> float:
        return round(statistics.median(_times(fn, 7)) * 1000, 2)

    return {"json_header_ms": median(lambda: json.loads(header)),
            "from_numpy_ms": median(lambda: list(map(torch.from_numpy, slices))), "tensors": n}


# ---------------------------------------------------------------------------------------------
# memory accounting


def _status_kb(field: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class PeakRSS:
    """Peak RSS minus RSS at start, via /proc/self/clear_refs (None where unavailable)."""

    delta_mb: float | None = None


@contextlib.contextmanager
def peak_rss() -> Iterator[PeakRSS]:
    out = PeakRSS()
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # resets VmHWM to the current RSS
        ok = True
    except OSError:
        ok = False
    base = _status_kb("VmRSS")
    yield out
    if ok:
        out.delta_mb = max(0, _status_kb("VmHWM") - base) * 1024 / MB


# ---------------------------------------------------------------------------------------------
# the state under test


def build_state(layers: int, width: int, small: bool = False, frozen: bool = False
                ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A stack of Linear layers with AdamW state (exp_avg, exp_avg_sq, step per parameter).
    ``frozen``: the stack is a frozen base (no gradients, no optimizer state) under one
    trainable adapter holding about 1% of the state's bytes (LoRA-like)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    if frozen:
        model.requires_grad_(False)
        rank = max(1, round(layers * width / 300))  # 3 x rank x width ~ 1% of the base
        model.append(torch.nn.Linear(width, rank, bias=False))
    if not small:  # default init walks every element in Python-visible kernels; randn is faster
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    train_once(model, opt)
    return model, opt


def train_once(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """An optimizer step on random gradients: the trainable state changes."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.grad = torch.randn_like(p)
    opt.step()
    for p in trainable:
        p.grad = None


def touch(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Walk the model and the optimizer state and read every tensor once, as the update
    before a save does (see the module's docstring)."""
    with torch.no_grad():
        for t in state_tensors(model, opt):
            t.sum()


def state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = list(model.state_dict().values())
    for s in opt.state.values():
        out.extend(v for v in s.values() if isinstance(v, torch.Tensor))
    return out


def flat_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors under flat string keys (safetensors and DCP want this)."""
    flat = {f"m.{k}": v for k, v in model.state_dict().items()}
    for i, p in enumerate(opt.param_groups[0]["params"]):
        for k, v in opt.state[p].items():
            flat[f"o.{i}.{k}"] = v
    return flat


def load_flat(model: torch.nn.Module, opt: torch.optim.Optimizer,
              loaded: dict[str, torch.Tensor]) -> None:
    """Apply a flat dict the way a restore does: model by load_state_dict (copies into the
    parameters), optimizer by load_state_dict (adopts the loaded tensors)."""
    model.load_state_dict({k[2:]: v for k, v in loaded.items() if k.startswith("m.")})
    sd = opt.state_dict()
    for i in sd["state"]:
        sd["state"][i] = {k: loaded[f"o.{i}.{k}"] for k in sd["state"][i]}
    opt.load_state_dict(sd)


# ---------------------------------------------------------------------------------------------
# file helpers


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cache(path: str) -> None:
    """Drop the clean page-cache pages of every file under ``path`` (they are fsynced)."""
    paths = [path] if os.path.isfile(path) else [
        os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for p in paths:
        with contextlib.suppress(OSError):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


_LIBC: Any = None


def resident_pct(path: str) -> float | None:
    """Share of the pages of the files under ``path`` that are in the page cache (mincore on a
    PROT_READ mapping, which faults nothing in); None where mincore is unavailable."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(None, use_errno=True)
            _LIBC.mmap.restype = ctypes.c_void_p
            _LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_int, ctypes.c_long]
            _LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            _LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        except (OSError, AttributeError):
            _LIBC = False
    if not _LIBC:
        return None
    paths = [path] if os.path.isfile(path) else [
        os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    total = resident = 0
    for p in paths:
        size = os.path.getsize(p)
        if size == 0:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == ctypes.c_void_p(-1).value:
                return None
            try:
                pages = -(-size // mmap.PAGESIZE)
                vec = (ctypes.c_ubyte * pages)()
                if _LIBC.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                    return None
                total += pages
                resident += pages - bytes(vec).count(0)
            finally:
                _LIBC.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
    return 100.0 * resident / total if total else 0.0


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def tree_files(path: str) -> dict[tuple[int, int], int]:
    """(device, inode) -> size of every file under ``path``."""
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in
                                                  os.walk(path) for f in fs]
    stats = [os.lstat(p) for p in paths if os.path.lexists(p)]
    return {(st.st_dev, st.st_ino): st.st_size for st in stats}


def tree_bytes(path: str, before: dict[tuple[int, int], int] | None = None) -> int:
    """Bytes of the files under ``path``; with ``before`` (`tree_files` before a save), only
    those of files that did not exist then: what the save wrote (unbroken's incremental
    saves hard-link unchanged data from the previous generation)."""
    return sum(n for key, n in tree_files(path).items() if before is None or key not in before)


# ---------------------------------------------------------------------------------------------
# methods: each has prepare (untimed), save, load, and cleanup between saves (untimed)


class Method:
    """A way to save and load. Saves alternate between two paths and remove the older one
    first (untimed): the previous checkpoint still exists while the next one is written, as
    with any safe checkpointer (and as with unbroken's retention)."""

    name = ""
    note = ""
    ops: tuple[str, ...] = ("save", "load")  # the async methods and memcpy only save
    only_frozen = False  # runs in the frozen case only

    def __init__(self, where: str, model: torch.nn.Module, opt: torch.optim.Optimizer,
                 payload: int) -> None:
        self.base, self.model, self.opt, self.payload = where, model, opt, payload
        self.slot = 0
        self.phases: dict[str, list[dict[str, float]]] = {"save": [], "load": []}
        self.blocked: list[float] = []  # async saves: time until save() returned

    def prime(self) -> None:
        """Untimed, once per case: what a long run has done before (reused buffers exist)."""

    def settle(self) -> None:
        """Untimed, right after each timed operation: background work it left (a read-back
        in the background) ends before another method is timed."""

    @property
    def where(self) -> str:
        return f"{self.base}.{self.slot}"

    def before_save(self) -> None:
        self.slot ^= 1
        remove(self.where)

    def before_load(self) -> None:
        """Untimed, before each timed load (and before the files' pages are dropped)."""

    def save(self) -> None:
        raise NotImplementedError

    def load(self) -> None:
        raise NotImplementedError

    def files(self) -> str:
        return self.where

    def close(self) -> None:
        for slot in (0, 1):
            remove(f"{self.base}.{slot}")


class DiskDirect(Method):
    name = "disk O_DIRECT"
    note = "the disk itself: aligned 64 MiB O_DIRECT writes + fsync, O_DIRECT reads"
    flags = os.O_DIRECT  # DiskBuffered: the same loop through the page cache

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        block = min(DIRECT_BLOCK, -(-self.payload // ALIGN) * ALIGN)
        self.buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
        self.buf.write(os.urandom(min(block, 1 << 20)) * (block // min(block, 1 << 20)))
        self.view = memoryview(self.buf)
        self.total = -(-self.payload // block) * block

    def save(self) -> None:
        fd = os.open(self.where, os.O_WRONLY | os.O_CREAT | os.O_EXCL | self.flags, 0o644)
        try:
            done = 0
            while done < self.total:
                done += os.write(fd, self.view)
            os.fsync(fd)
        finally:
            os.close(fd)

    def load(self) -> None:
        fd = os.open(self.where, os.O_RDONLY | self.flags)
        try:
            while os.readv(fd, [self.view]) > 0:
                pass
        finally:
            os.close(fd)

    def close(self) -> None:
        super().close()
        self.view.release()
        self.buf.close()


class DiskBuffered(DiskDirect):
    name = "disk buffered"
    note = "page cache: write() of a reused buffer + fsync, read() into a reused buffer"
    flags = 0


class TorchSave(Method):
    name = "torch.save"
    note = ("torch.save({model, optimizer}) + fsync / torch.load(weights_only=True) + "
            "load_state_dict")

    def save(self) -> None:
        with open(self.where, "wb") as f:
            torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    def load(self) -> None:
        sd = torch.load(self.where, map_location="cpu", weights_only=True)
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optimizer"])


class Safetensors(Method):
    name = "safetensors"
    note = "save_file(flat) + fsync / load_file (mmap) + load_state_dict"

    def save(self) -> None:
        from safetensors.torch import save_file
        save_file(flat_state(self.model, self.opt), self.where)
        fsync_path(self.where)

    def load(self) -> None:
        from safetensors.torch import load_file
        load_flat(self.model, self.opt, load_file(self.where))
        self._loaded = True

    def settle(self) -> None:
        """Untimed, after a load: the optimizer adopted tensors viewing the file's mapping
        (copy-on-write); the next method's load into them (unbroken and DCP copy into the
        live state) would fault every page in as a private copy, its peak memory counting
        the state twice. They become memory of the process's own, as after any other load."""
        if getattr(self, "_loaded", False):
            self._loaded = False
            for state in self.opt.state.values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor):
                        state[k] = v.clone()


class DCP(Method):
    name = "torch DCP"
    note = "torch.distributed.checkpoint save/load, no_dist=True, sync_files=True; loads in place"

    def save(self) -> None:
        import torch.distributed.checkpoint as dcp
        dcp.save(flat_state(self.model, self.opt),
                 storage_writer=dcp.FileSystemWriter(self.where, sync_files=True), no_dist=True)

    def load(self) -> None:
        import torch.distributed.checkpoint as dcp
        dcp.load(flat_state(self.model, self.opt),
                 storage_reader=dcp.FileSystemReader(self.where), no_dist=True)


class PhaseTimer:
    """Times calls of named functions (phases) and, inside them, of system calls, so that
    e.g. the fsync() of commit and the fsync() of retention are told apart."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = {}
        self._stack: list[str] = []

    @contextlib.contextmanager
    def patch(self, obj: Any, name: str, key: str, syscall: bool = False) -> Iterator[None]:
        orig = getattr(obj, name)
        own = name in vars(obj)  # else a class attribute, shadowed on the instance
        acc, stack = self.acc, self._stack

        def timed(*a: Any, **k: Any) -> Any:
            if not syscall and key in stack:  # nested in a phase of the same name
                return orig(*a, **k)
            label = f"{stack[-1] if stack else 'other'}:{key}" if syscall else key
            if not syscall:
                stack.append(key)
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                acc[label] = acc.get(label, 0.0) + time.perf_counter() - t
                if not syscall:
                    stack.pop()

        setattr(obj, name, timed)
        try:
            yield
        finally:
            if own:
                setattr(obj, name, orig)
            else:
                delattr(obj, name)


class Unbroken(Method):
    name = "unbroken"
    options: dict[str, Any] = {}
    note = ("Checkpointer.save() by default: returns once committed and durable (capture, "
            "encode, write+hash+fsync, manifest, rename); the read-back verify and retention run "
            "beside the loop, waited for (untimed) before the next save / a load: a new "
            "Checkpointer's restore() (read+hash, decode, validate, load into live objects) and "
            "close(); the saving Checkpointer closes before it and reopens after, untimed)")

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        import unbroken
        self._unbroken = unbroken
        remove(self.base)
        self.ckpt = unbroken.Checkpointer(self.base, model=self.model, optimizer=self.opt,
                                          keep=unbroken.Keep(last=1), **self.options)
        self.step = 0
        self._reopen = False
        # a timed save's phase timer, until `settle` waited for its background part
        self._saving: tuple[contextlib.ExitStack, PhaseTimer, float, dict[str, float]] | None \
            = None

    def before_save(self) -> None:  # retention removed the previous generation (see settle)
        pass

    def save(self) -> None:
        import unbroken.state.parts as S
        G = _generation_module(S)
        pt = PhaseTimer()
        c, st = self.ckpt, self.ckpt.store
        self.step += 1
        es = contextlib.ExitStack()
        # after commit, the read-back reads through scan_one and read_verified (or verify)
        for obj, name, key in ((S, "capture", "capture"), (G, "encode_generation", "encode"),
                               (st, "commit", "commit"), (st, "scan_one", "verify"),
                               (st, "read_verified", "verify"), (st, "verify", "verify"),
                               (c._writer, "apply_retention", "retention")):
            es.enter_context(pt.patch(obj, name, key))  # a renamed function fails here
        for name in ("write", "fsync", "readv"):
            es.enter_context(pt.patch(os, name, name + "()", syscall=True))
        t = time.perf_counter()
        c.save(self.step)
        self._saving = (es, pt, time.perf_counter() - t, dict(pt.acc))

    def settle(self) -> None:
        """Untimed: the read-back and retention beside the loop (phases of the save); after a
        load, a saving Checkpointer again."""
        self._reopened()
        if self._saving is None:
            return
        es, pt, total, inside = self._saving
        self._saving = None
        with es:
            self.ckpt.wait()
        a = pt.acc
        ph = {k: a.get(k, 0.0) for k in ("capture", "encode", "commit")}
        ph["  write()"] = a.get("commit:write()", 0.0)
        ph["  fsync()"] = a.get("commit:fsync()", 0.0)
        ph["  hash+other"] = ph["commit"] - ph["  write()"] - ph["  fsync()"]
        ph["verify"] = a.get("verify", 0.0)
        ph["  read()"] = a.get("verify:readv()", 0.0)
        ph["  hash+alloc+copy"] = ph["verify"] - ph["  read()"]
        ph["retention"] = a.get("retention", 0.0)
        ph["other"] = total - sum(inside.get(k, 0.0) for k in ("capture", "encode", "commit",
                                                               "verify", "retention"))
        ph["total"] = total
        self.phases["save"].append(ph)

    def before_load(self) -> None:
        """The saving Checkpointer lets go of the run (a load opens a Checkpointer of its own,
        as a resumed job does); closing it is no part of the load."""
        self.ckpt.close()

    def load(self) -> None:
        self._restore_into(self.model, self.opt)

    def _restore_into(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        import unbroken.state.parts as S
        G = _generation_module(S)
        import unbroken.restoring as R  # (it calls `apply` by the name it imported)
        import unbroken.store.backends._mapped as M
        r = self._unbroken.Checkpointer(self.base, model=model, optimizer=opt,
                                        keep=self._unbroken.Keep(last=1), **self.options)
        pt = PhaseTimer()
        st = r.store
        try:
            with contextlib.ExitStack() as es:
                for obj, name, key in ((st, "scan", "scan"), (st, "read_verified", "read+hash"),
                                       (G, "decode_generation", "decode"),
                                       (S, "validate_parts", "validate"), (S, "apply", "apply"),
                                       (R, "apply", "apply"),
                                       # (a file hashed as it is copied: inside apply)
                                       (M.MappedFiles, "_hash", "stream")):
                    if hasattr(obj, name):
                        es.enter_context(pt.patch(obj, name, key))
                es.enter_context(pt.patch(os, "readv", "readv()", syscall=True))
                t = time.perf_counter()
                r.restore()
                total = time.perf_counter() - t
        finally:
            r.close()
        a = pt.acc
        ph = {k: a.get(k, 0.0) for k in ("scan", "read+hash")}
        ph["  read()"] = a.get("read+hash:readv()", 0.0)
        ph["read+hash"] += a.get("stream", 0.0)  # (hashed and copied in one pass)
        ph["  hash+alloc+copy"] = ph["read+hash"] - ph["  read()"]
        ph.update({k: a.get(k, 0.0) for k in ("decode", "validate", "apply")})
        ph["apply"] -= a.get("stream", 0.0)
        ph["other"] = total - sum(ph[k] for k in ("scan", "read+hash", "decode", "validate",
                                                  "apply"))
        ph["total"] = total
        self.phases["load"].append(ph)
        self._reopen = True

    def _reopened(self) -> None:
        """After a load (untimed, in `settle`): a saving Checkpointer again."""
        if self._reopen:
            self._reopen = False
            self.ckpt = self._unbroken.Checkpointer(self.base, model=self.model,
                                                    optimizer=self.opt,
                                                    keep=self._unbroken.Keep(last=1),
                                                    **self.options)

    def files(self) -> str:
        return self.base

    def close(self) -> None:
        self.ckpt.close()
        remove(self.base)


class UnbrokenResumed(Unbroken):
    name = "unbroken resumed"
    note = ("what a resumed job does: restore() into a model built anew (initialized, untimed) "
            "and an optimizer holding no state yet, whose state the restore allocates (peak "
            "RSS: that state); saved once, untimed")
    ops = ("load",)

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self._fresh: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None

    def prime(self) -> None:
        super().save()
        self.settle()

    def before_load(self) -> None:
        super().before_load()
        model = copy.deepcopy(self.model)
        params = [p for p in model.parameters() if p.requires_grad]
        self._fresh = model, type(self.opt)(params, lr=self.opt.defaults["lr"])  # (as built)

    def load(self) -> None:
        assert self._fresh is not None
        self._restore_into(*self._fresh)

    def settle(self) -> None:
        self._fresh = None  # (its memory goes before the next method is timed)
        super().settle()


class UnbrokenReadBackSync(Unbroken):
    name = "unbroken read-back sync"
    note = ("Checkpointer(read_back='sync').save(): returns after the read-back verify (every "
            "byte read again from the device) and retention too")
    options = {"read_back": "sync"}


class UnbrokenIncremental(Unbroken):
    name = "unbroken incremental"
    note = ("Checkpointer(incremental=True): tensors unchanged since the previous generation "
            "are hard-linked from it, not written (the 99%-frozen case only)")
    only_frozen = True
    options = {"incremental": True}


class MemcpyReused(Method):
    name = "memcpy reused"
    note = "copy_ of every state tensor into preallocated buffers: the floor of a snapshot"
    ops = ("save",)

    def prime(self) -> None:
        self.src = state_tensors(self.model, self.opt)
        self.bufs = [torch.empty_like(t) for t in self.src]
        self.save()

    def before_save(self) -> None:
        pass

    def save(self) -> None:
        for b, t in zip(self.bufs, self.src):
            b.copy_(t)

    def close(self) -> None:
        self.bufs = self.src = []


class UnbrokenAsync(Method):
    name = "unbroken async"
    how: bool | str = True
    note = ("Checkpointer(async_save=True).save(): snapshot into reused buffers, returns; "
            "wait(): written, fsynced, committed, read back and verified, retention applied")
    ops = ("save",)

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        import unbroken
        remove(self.base)
        self.ckpt = unbroken.Checkpointer(self.base, model=self.model, optimizer=self.opt,
                                          keep=unbroken.Keep(last=1), async_save=self.how)
        self.step = 0

    def prime(self) -> None:
        self.save()
        self.blocked.clear()

    def before_save(self) -> None:
        pass

    def save(self) -> None:
        self.step += 1
        t = time.perf_counter()
        self.ckpt.save(self.step)
        self.blocked.append(time.perf_counter() - t)
        self.ckpt.wait()

    def files(self) -> str:
        return self.base

    def close(self) -> None:
        self.ckpt.close()
        remove(self.base)


class UnbrokenProcess(UnbrokenAsync):
    name = "unbroken process"
    note = ("Checkpointer(async_save='process').save(): snapshot into reused shared memory, "
            "returns; wait(): the persisting process wrote, committed, read back, verified")
    how: bool | str = "process"


class DCPAsync(Method):
    name = "torch DCP async"
    note = ("dcp.async_save(flat dict, FileSystemWriter(sync_files=True), no_dist=True) with a "
            "DefaultStager that keeps its CPU buffers (no pinning: no CUDA); future.result()")
    ops = ("save",)

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        self.dcp = dcp
        # pinned memory, shared memory, async staging, non-blocking copy: all need CUDA
        self.stager = DefaultStager(StagingOptions(False, False, False, False))
        self.writer = dcp.FileSystemWriter(self.where, sync_files=True)

    def prime(self) -> None:
        self.before_save()
        self.save()
        self.blocked.clear()

    def save(self) -> None:
        t = time.perf_counter()
        fut: Any = self.dcp.async_save(flat_state(self.model, self.opt), checkpoint_id=self.where,
                                  storage_writer=self.writer, async_stager=self.stager,
                                  no_dist=True)
        self.blocked.append(time.perf_counter() - t)
        fut.result()

    def close(self) -> None:
        self.stager.close()
        super().close()


# Display order; indented names are parts of the phase above them.
PHASE_ORDER = {
    "save": ["capture", "encode", "commit", "  write()", "  fsync()", "  hash+other",
             "verify", "  read()", "  hash+alloc+copy", "retention", "other"],
    "load": ["scan", "read+hash", "  read()", "  hash+alloc+copy", "decode", "validate",
             "apply", "other"]}

METHODS: dict[str, type[Method]] = {
    "disk": DiskDirect, "buffered": DiskBuffered, "torch": TorchSave,
    "safetensors": Safetensors, "dcp": DCP, "unbroken": Unbroken, "memcpy": MemcpyReused,
    "dcp-async": DCPAsync, "unbroken-async": UnbrokenAsync, "unbroken-process": UnbrokenProcess,
    "unbroken-incremental": UnbrokenIncremental, "unbroken-sync": UnbrokenReadBackSync,
    "unbroken-resumed": UnbrokenResumed}


# ---------------------------------------------------------------------------------------------
# cases and the run


DEFAULT_SIZES = "64M,512M,1G"  # 1.5G adds ~2 min (unbroken alone: ~20 s a round today)
DEFAULT_FROZEN = "1G"
DEFAULT_SMALL = 10000  # 20000 adds ~70 s (DCP and torch.load take 4-14 s per round there)


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    mult = {"K": 1e3, "M": 1e6, "G": 1e9}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def make_cases(sizes: list[str], small: list[int] | None, frozen: str | None = None
               ) -> list[dict[str, Any]]:
    cases = []
    for s in sizes:
        target = parse_size(s)
        width = 256 if target < 20e6 else 1024 if target < 256e6 else 2048
        per_layer = 3 * 4 * (width * width + width)  # params + exp_avg + exp_avg_sq, fp32
        layers = max(1, round(target / per_layer))
        cases.append({"name": f"{s} dense", "layers": layers, "width": width, "small": False})
    for count in small or []:
        # each Linear: weight + bias, each with exp_avg, exp_avg_sq and step: 8 tensors
        cases.append({"name": f"{count // 1000}k small", "layers": max(1, count // 8),
                      "width": 32, "small": True})
    if frozen:  # frozen weights only: no optimizer state (1/3 of a dense case's bytes a layer)
        width = 2048
        layers = max(1, round(parse_size(frozen) / (4 * (width * width + width))))
        cases.append({"name": f"{frozen} 99% frozen", "layers": layers, "width": width,
                      "small": False, "frozen": True})
    return cases


UNSTABLE_PCT = 25.0  # a figure whose IQR exceeds this share of its median is not a result


def iqr_pct(times: list[float]) -> float:
    """Interquartile range as % of the median (0 with fewer than 2 values)."""
    med = statistics.median(times)
    if len(times) < 2 or not med:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return 100 * (q3 - q1) / med


def summarize(times: list[float], payload: int) -> dict[str, Any]:
    med = statistics.median(times)
    iqr = iqr_pct(times)
    return {"median_s": med, "min_s": min(times), "max_s": max(times), "all_s": times,
            "spread_pct": 100 * (max(times) - min(times)) / med if med else 0.0,
            "iqr_pct": iqr, "unstable": iqr > UNSTABLE_PCT,
            "gbps": payload / med / GB if med else 0.0}


def run_case(case: dict[str, Any], root: str, methods: list[str], repeats: int, warmup: int,
             cold: bool) -> dict[str, Any]:
    frozen = case.get("frozen", False)
    model, opt = build_state(case["layers"], case["width"], case["small"], frozen)
    tensors = state_tensors(model, opt)
    payload = sum(t.numel() * t.element_size() for t in tensors)
    log(f"== {case['name']}: {len(tensors)} tensors, {payload / MB:.1f} MB")
    folder = os.path.join(root, case["name"].replace(" ", "_"))
    os.makedirs(folder, exist_ok=True)
    ms = [METHODS[m](os.path.join(folder, m), model, opt, payload) for m in methods
          if frozen or not METHODS[m].only_frozen]
    t_case = time.perf_counter()
    for m in ms:
        m.prime()  # untimed: buffers a long run would already have reused
    gc.collect()  # once per case; during measurements the collector runs as in any process
    times: dict[str, dict[str, list[float]]] = {m.name: {"save": [], "load": []} for m in ms}
    peaks: dict[str, dict[str, list[float]]] = {m.name: {"save": [], "load": []} for m in ms}
    cached: dict[str, list[float]] = {m.name: [] for m in ms}  # % resident before cold loads
    file_bytes: dict[str, int] = {}
    written: dict[str, int] = {}
    try:
        for op in ("save", "load"):
            for rep in range(warmup + repeats):
                if frozen and op == "save":  # an update between saves: the adapter changes
                    train_once(model, opt)
                # round-robin, each round starting one method later: drift of the disk hits
                # every method alike, and none is always the one whose files were written last
                # (this VM's host serves recently written files faster)
                for m in ms[rep % len(ms):] + ms[:rep % len(ms)]:
                    if op not in m.ops:
                        continue
                    if op == "save":
                        m.before_save()
                        touch(model, opt)
                        existing = tree_files(m.files()) if os.path.exists(m.files()) else {}
                    else:
                        m.before_load()
                    if op == "load" and cold:
                        drop_cache(m.files())
                        pct = resident_pct(m.files())
                        if pct is not None and rep >= warmup:
                            cached[m.name].append(pct)
                    with peak_rss() as mem:
                        t = time.perf_counter()
                        getattr(m, op)()
                        dt = time.perf_counter() - t
                    m.settle()
                    if rep < warmup:
                        if isinstance(m, Unbroken):
                            m.phases[op].pop()
                        if op == "save" and m.blocked:
                            m.blocked.pop()
                        continue
                    times[m.name][op].append(dt)
                    if mem.delta_mb is not None:
                        peaks[m.name][op].append(mem.delta_mb)
                    if op == "save":
                        file_bytes[m.name] = tree_bytes(m.files())
                        written[m.name] = tree_bytes(m.files(), existing)
                log(f"   {op} round {rep + 1}/{warmup + repeats}"
                    f"{' (warm-up)' if rep < warmup else ''}: " +
                    ", ".join(f"{m.name} {times[m.name][op][-1]:.3f}s" if rep >= warmup
                              else m.name for m in ms if op in m.ops))
    finally:
        for m in ms:
            m.close()
        shutil.rmtree(folder, ignore_errors=True)
    disk = times.get(DiskDirect.name)
    disk_gbps = {op: payload / statistics.median(disk[op]) / GB for op in ("save", "load")} \
        if disk else None
    results = []
    for m in ms:
        for op in m.ops:
            r = {"method": m.name,
                 "op": "copy" if isinstance(m, MemcpyReused) else "durable" if m.blocked else op,
                 **summarize(times[m.name][op], payload),
                 "x_disk": (payload / statistics.median(times[m.name][op]) / GB / disk_gbps[op])
                 if disk_gbps else None,
                 "peak_rss_delta_mb": max(peaks[m.name][op]) if peaks[m.name][op] else None,
                 "file_mb": file_bytes.get(m.name, 0) / MB,
                 "written_mb": written.get(m.name, 0) / MB}
            if op == "load" and cached[m.name]:
                r["cached_pct_max"] = max(cached[m.name])  # > 1: that "cold" load was not
            if op == "save" and m.blocked:
                results.append({"method": m.name, "op": "blocked",
                                **summarize(m.blocked, payload), "x_disk": None,
                                "peak_rss_delta_mb": None, "file_mb": r["file_mb"],
                                "written_mb": r["written_mb"]})
            if isinstance(m, Unbroken) and m.phases[op]:
                keys = m.phases[op][0].keys()
                r["phases_median_s"] = {k: statistics.median(p.get(k, 0.0) for p in m.phases[op])
                                        for k in keys}
            results.append(r)
    n_tensors = len(tensors)
    del model, opt, tensors, ms
    gc.collect()
    return {"case": case["name"], "layers": case["layers"], "width": case["width"],
            "n_tensors": n_tensors, "payload_mb": payload / MB, "disk_gbps": disk_gbps,
            "seconds": time.perf_counter() - t_case, "results": results}


def fmt_header(doc: dict[str, Any]) -> str:
    m, t = doc["machine"], doc["machine"]["target"]
    rates = m.get("memory_rates", {})
    load = m.get("loadavg_before_after")
    lines = [
        (f"machine: {m['cpu']}, {m['cpu_count']} CPUs, {m['memory_gb']} GB RAM, Linux "
         f"{m['kernel']}, Python {m['python']}, torch {m['torch']}, safetensors "
         f"{m['safetensors']}"),
        (f"target:  {t['dir']} on {t['device']} ({t['fstype']}, {t['options']}), "
         f"rotational flag {t['rotational']}, scheduler {t['scheduler']}"),
        (f"memory:  copy into a reused buffer {rates.get('copy_reused_gbps')} GB/s, into "
         f"fresh memory {rates.get('copy_fresh_gbps')} GB/s, bytes() copy "
         f"{rates.get('bytes_fresh_gbps')} GB/s, xxh3-128 {rates.get('xxh3_128_gbps')} GB/s"),
        (f"run:     {doc['config']['repeats']} timed reps (median), warm-up "
         f"{doc['config']['warmup']}, loads {doc['config']['load_cache']}, torch threads "
         f"{doc['config'].get('torch_threads')}, "
         f"{'a process per case, ' if doc['config'].get('process_per_case') else ''}"
         f"{doc['total_seconds']:.0f} s"),
    ]
    if load:
        lines[-1] += f", load average before/after {load[0][0]:.2f}/{load[1][0]:.2f}"
    speed = m.get("python_rates_before_after")
    if speed:
        lines.insert(3, "python:  {0} tensors, header json.loads {1}/{2} ms, torch.from_numpy "
                        "{3}/{4} ms (before/after the cases)".format(
                            speed[0]["tensors"], speed[0]["json_header_ms"],
                            speed[1]["json_header_ms"], speed[0]["from_numpy_ms"],
                            speed[1]["from_numpy_ms"]))
    return "\n".join(lines)


def fmt_median(r: dict[str, Any]) -> str:
    return "unstable" if r.get("unstable") else f"{r['median_s']:.3f}"


def render(head: tuple[str, ...], rows: Sequence[tuple[str, ...]], left: int) -> list[str]:
    """A markdown table; the first ``left`` columns left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    for r in rows:
        out.append("| " + " | ".join(v.ljust(w) if i < left or h == "note" else v.rjust(w)
                                     for i, (v, w, h) in enumerate(zip(r, widths, head)))
                   + " |")
    return out


def fmt_table(doc: dict[str, Any]) -> str:
    head = ("case", "method", "op", "median s", "min-max s", "IQR", "GB/s", "x disk",
            "peak RSS +MB", "file MB", "written MB", "note")
    rows = []
    for c in doc["cases"]:
        for r in c["results"]:
            bad = r.get("unstable")
            note = [f"unstable: IQR {r['iqr_pct']:.0f}% > {UNSTABLE_PCT:.0f}%"] if bad else []
            if r.get("cached_pct_max", 0.0) > 1.0:
                note.append(f"not cold: up to {r['cached_pct_max']:.0f}% of pages cached")
            rows.append((c["case"], r["method"], r["op"], fmt_median(r),
                         f"{r['min_s']:.3f}-{r['max_s']:.3f}", f"{r['iqr_pct']:.0f}%",
                         "-" if bad else f"{r['gbps']:.2f}",
                         "-" if bad or r["x_disk"] is None else f"{r['x_disk']:.2f}",
                         "-" if r["peak_rss_delta_mb"] is None else f"{r['peak_rss_delta_mb']:.0f}",
                         f"{r['file_mb']:.0f}", f"{r.get('written_mb', r['file_mb']):.0f}",
                         "; ".join(note)))
    out = render(head, rows, 3)
    asyn = fmt_async(doc)
    if asyn:
        out += ["", asyn]
    phase_lines = []
    for c in doc["cases"]:
        for r in c["results"]:
            ph = r.get("phases_median_s")
            if not ph:
                continue
            total = ph.get("total", 0.0) or 1.0
            parts = []
            for k in PHASE_ORDER[r["op"]]:
                if k in ph:
                    parts.append(f"{k} {ph[k]:.3f}s ({100 * ph[k] / total:.0f}%)")
            phase_lines.append(f"- {c['case']}, {r['op']} {ph.get('total', 0):.3f}s: " +
                               ", ".join(parts))
    return "\n".join(out) + ("\n\nunbroken phases (median s, share of total):\n" +
                             "\n".join(phase_lines) if phase_lines else "")


def fmt_async(doc: dict[str, Any]) -> str:
    """Per case: time blocked and time to durable of each async save, against a copy of the
    state into reused buffers (the issue's goal: blocked <= 1.5x that copy)."""
    head = ("case", "memcpy reused s", "method", "blocked s", "blocked / memcpy", "durable s")
    rows = []
    for c in doc["cases"]:
        by = {(r["method"], r["op"]): r for r in c["results"]}
        cp = by.get((MemcpyReused.name, "copy"))
        for name in (UnbrokenAsync.name, UnbrokenProcess.name, DCPAsync.name):
            b, d = by.get((name, "blocked")), by.get((name, "durable"))
            if b is None or d is None:
                continue
            ratio = "-" if cp is None or cp.get("unstable") or b.get("unstable") else \
                f"{b['median_s'] / cp['median_s']:.2f}x"
            rows.append((c["case"], "-" if cp is None else
                         f"{fmt_median(cp)} (IQR {cp['iqr_pct']:.0f}%)", name,
                         f"{fmt_median(b)} (IQR {b['iqr_pct']:.0f}%)", ratio,
                         f"{fmt_median(d)} (IQR {d['iqr_pct']:.0f}%)"))
    if not rows:
        return ""
    return "async saves (median; unstable = IQR above " + f"{UNSTABLE_PCT:.0f}% of the median):\n" \
        + "\n".join(render(head, rows, 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, a smoke run (< 20 s)")
    ap.add_argument("--sizes", help="comma-separated payload sizes of dense cases "
                    f"(default {DEFAULT_SIZES}; --quick: 4M,16M)")
    ap.add_argument("--small", help="tensor counts of the many-small-tensors cases, "
                    f"comma-separated (default {DEFAULT_SMALL}; --quick: 1000; 0: none)")
    ap.add_argument("--frozen", help="payload of the 99%%-frozen case (a frozen base, an "
                    "adapter with AdamW holding 1%% of the bytes, updated between saves; "
                    f"default {DEFAULT_FROZEN}; --quick: 16M; 0: none)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"comma-separated subset of {','.join(METHODS)}")
    ap.add_argument("--repeats", type=int, default=5, help="timed repetitions (median reported; "
                    f"a figure whose IQR exceeds {UNSTABLE_PCT:.0f}%% of it is flagged unstable)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed rounds before the timed ones, in the first case only (it "
                    "warms every method's code paths for the later cases)")
    ap.add_argument("--warmup-every-case", action="store_true",
                    help="also run the untimed rounds before every later case")
    ap.add_argument("--warm-cache", action="store_true",
                    help="load from the page cache (default: drop the files' pages first)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1; 0: torch's default). On 2 cores "
                    "shared with other jobs, 2 OpenMP threads stall at every barrier while a "
                    "core is taken: a 60 MB copy_ measured 0.007 s to 1.9 s")
    ap.add_argument("--dir", help="parent folder of the scratch folder (default: /work or the "
                    "temp dir, whichever is on a real disk)")
    ap.add_argument("--one-process", action="store_true",
                    help="run every case in this process, one after the other (default: each "
                    "case in a child process of its own, so that no case is measured in the "
                    "heap and free memory an earlier case's multi-GiB loads left)")
    ap.add_argument("--json", action="store_true", help="print only the JSON document")
    ap.add_argument("--out", help="also write the JSON document to this file")
    ap.add_argument("--case-json", help=argparse.SUPPRESS)  # (a child: its case, root, out)
    args = ap.parse_args(argv)
    if args.case_json:
        return _child(args)

    sizes = (args.sizes or ("4M,16M" if args.quick else DEFAULT_SIZES)).split(",")
    small = [int(n) for n in (args.small or str(1000 if args.quick else DEFAULT_SMALL)
                              ).split(",") if int(n)]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        ap.error(f"unknown methods {unknown}; choose from {list(METHODS)}")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)  # DCP's no-process-group warnings
    os.environ.setdefault("UNBROKEN_PROGRESS", "0")  # no progress bar on stderr
    started = time.perf_counter()
    root = pick_root(args.dir)
    try:
        info = machine_info(root)
        if info["target"]["fstype"] in ("tmpfs", "ramfs"):
            log(f"warning: {root} is on {info['target']['fstype']}: that measures memory")
        log(f"target {root} on {info['target']['device']} ({info['target']['fstype']}), "
            f"{info['cpu_count']} CPUs")
        if "disk" in methods and not direct_io_works(root):
            log(f"warning: {root} refuses O_DIRECT: no disk baseline, no x disk ratios")
            methods.remove("disk")
        info["memory_rates"] = memory_rates(128 << 20 if args.quick else 256 << 20)
        python_before = python_rates()
        cases = []
        load_before = os.getloadavg()
        frozen = args.frozen or ("16M" if args.quick else DEFAULT_FROZEN)
        for i, case in enumerate(make_cases(sizes, small, None if frozen == "0" else frozen)):
            if args.one_process:
                warmup = args.warmup if i == 0 or args.warmup_every_case else 0
                cases.append(run_case(case, root, methods, args.repeats, warmup,
                                      cold=not args.warm_cache))
            else:  # (a fresh process: every case warms its code paths up)
                cases.append(_in_child(case, root, methods, args))
        info["loadavg_before_after"] = [load_before, os.getloadavg()]
        info["python_rates_before_after"] = [python_before, python_rates()]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    doc = {"benchmark": "unbroken save_load", "command": " ".join([os.path.basename(
        sys.executable), *sys.argv]), "machine": info,
        "config": {"sizes": sizes, "small": small, "methods": methods,
                   "torch_threads": torch.get_num_threads(),
                   "unstable": f"IQR > {UNSTABLE_PCT:.0f}% of the median",
                   "repeats": args.repeats, "warmup": args.warmup,
                   "warmup_every_case": args.warmup_every_case or not args.one_process,
                   "process_per_case": not args.one_process,
                   "load_cache": "warm" if args.warm_cache else "cold (posix_fadvise DONTNEED)",
                   "gbps": "payload bytes (tensor nbytes) per second, median of repeats",
                   "x_disk": "GB/s over the same case's disk O_DIRECT median (save: write, "
                             "load: read)",
                   "methods_notes": {cls.name: cls.note for cls in METHODS.values()
                                     if any(cls is METHODS[m] for m in methods)}},
        "cases": cases, "total_seconds": time.perf_counter() - started}
    emit(doc, args.json, args.out, [fmt_header(doc), "", fmt_table(doc), ""])
    return 0


def _in_child(case: dict[str, Any], root: str, methods: list[str], args: argparse.Namespace
              ) -> dict[str, Any]:
    """`run_case` in a child process of its own (this script again, ``--case-json``), so
    that a case's figures do not depend on the cases before it: on the heap and the free
    memory an earlier case's multi-GiB loads left (this VM serves fresh memory at a fraction
    of a reused buffer's speed). Every method of a case still runs in one process,
    interleaved."""
    out = os.path.join(root, "case.json")
    spec = {"case": case, "root": root, "methods": methods, "out": out}
    cmd = [sys.executable, os.path.abspath(__file__), "--case-json", json.dumps(spec),
           "--repeats", str(args.repeats), "--warmup", str(args.warmup),
           "--threads", str(args.threads), *(["--warm-cache"] if args.warm_cache else [])]
    subprocess.run(cmd, check=True)
    with open(out, encoding="utf-8") as f:
        result: dict[str, Any] = json.load(f)
    os.remove(out)
    return result


def _child(args: argparse.Namespace) -> int:
    """One case, in a child process (`_in_child`): its result as JSON to the file named."""
    spec = json.loads(args.case_json)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)
    os.environ.setdefault("UNBROKEN_PROGRESS", "0")
    result = run_case(spec["case"], spec["root"], spec["methods"], args.repeats, args.warmup,
                      cold=not args.warm_cache)
    with open(spec["out"], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


def emit(doc: dict[str, Any], json_only: bool, out: str | None, report: list[str]) -> None:
    """The JSON document to ``out`` (if given), then to stdout after the ``report`` lines
    (only the document with ``json_only``). Shared by the benchmarks of this folder."""
    text = json.dumps(doc, indent=1)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print("\n".join([*([] if json_only else report), text]))


if __name__ == "__main__":
    sys.exit(main())
