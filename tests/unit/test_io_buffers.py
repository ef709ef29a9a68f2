"""`_buffers.borrowed`: page-aligned buffers lent to one borrower at a time, reused by later
borrowers on any thread (an async save writes and reads back from a new thread each time),
at most a few kept, and a forked child that never waits on its parent's lock; a restore in a
thread that outlives the main thread (where a ThreadPoolExecutor refuses work)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from unbroken.store.backends import _buffers
from unbroken.store.backends._buffers import borrowed
from unbroken.store.backends.local import LocalFS

SIZE = 3 * 4096 + 8  # a size no other test borrows


def _address(buf: memoryview) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def test_borrowed_buffers_are_distinct_writable_page_aligned_and_sized():
    with borrowed(3, SIZE) as bufs:
        assert len(bufs) == 3 and all(len(b) == SIZE and not b.readonly for b in bufs)
        assert all(_address(b) % 4096 == 0 for b in bufs)
        assert len({_address(b) for b in bufs}) == 3
        for i, b in enumerate(bufs):
            b[:] = bytes([i]) * SIZE
        assert [bytes(b[:1]) for b in bufs] == [b"\0", b"\1", b"\2"]


def test_a_returned_buffer_is_lent_again_from_another_thread_and_few_are_kept():
    with borrowed(_buffers._KEEP + 2, SIZE + 1) as first:
        lent = {_address(b) for b in first}
    seen: list[set[int]] = []

    def borrow() -> None:
        with borrowed(2, SIZE + 1) as bufs:
            seen.append({_address(b) for b in bufs})

    thread = threading.Thread(target=borrow)
    thread.start()
    thread.join()
    assert seen[0] <= lent  # reused, not mapped anew
    assert len(_buffers._free[SIZE + 1]) == _buffers._KEEP


def test_concurrent_borrowers_never_share_a_buffer():
    errors: list[str] = []

    def borrow(tag: int) -> None:
        for _ in range(20):
            with borrowed(2, SIZE + 2) as bufs:
                for b in bufs:
                    b[:] = bytes([tag]) * len(b)
                time.sleep(0.0005)
                if any(bytes(b) != bytes([tag]) * len(b) for b in bufs):
                    errors.append(f"borrower {tag} found another's bytes")

    threads = [threading.Thread(target=borrow, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_direct_writes_from_new_threads_reuse_the_same_buffers(tmp_path, monkeypatch):
    """An async save writes from a thread of its own each time: the second write borrows
    the buffers the first one returned."""
    from unbroken.store.backends import _direct

    data = os.urandom(1 << 20) * 20  # over 8 MiB: the O_DIRECT path where the disk allows it
    used: list[list[object]] = []  # (held: a mapping freed could be mapped at its address again)
    real = _direct._write_through

    def spying(fd, chunks, write, buffers):
        used.append([b.obj for b in buffers])
        return real(fd, chunks, write, buffers)

    monkeypatch.setattr(_direct, "_write_through", spying)
    for i in range(3):
        thread = threading.Thread(
            target=lambda i=i: LocalFS().write_file(str(tmp_path / f"f{i}"), [data]))
        thread.start()
        thread.join()
        assert (tmp_path / f"f{i}").read_bytes() == data
    assert len(used) == 3  # (tmp_path is on a filesystem that takes O_DIRECT)
    assert {id(o) for o in used[0]} == {id(o) for o in used[1]} == {id(o) for o in used[2]}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX")
def test_a_child_forked_while_another_thread_holds_the_lock_can_borrow():
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with _buffers._lock:
            held.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(10)
    try:
        pid = os.fork()
        if pid == 0:  # the child: the parent's lock is held by a thread that is not here
            try:
                with borrowed(1, SIZE) as bufs:
                    bufs[0][:1] = b"x"
                os._exit(0)
            finally:
                os._exit(1)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                assert os.waitstatus_to_exitcode(status) == 0
                break
            time.sleep(0.02)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on the parent's lock")
    finally:
        release.set()
        thread.join()


RESTORE_AT_EXIT = """
import sys, threading, torch, unbroken
torch.manual_seed(0)
model = torch.nn.Linear(4096, 2048)  # 32 MiB of weights: a mapped file, read by the pool
with unbroken.Checkpointer(sys.argv[1], model=model) as ckpt:
    ckpt.step_done(1)
    ckpt.save()
expected = model.weight.detach().clone()
with torch.no_grad():
    model.weight.zero_()

def late():
    main = threading.main_thread()
    main.join()  # the main thread has ended: the interpreter is exiting
    with unbroken.Checkpointer(sys.argv[1], model=model) as again:
        print("restored", again.restore(), torch.equal(model.weight, expected), flush=True)

threading.Thread(target=late).start()
"""


def test_a_restore_in_a_thread_that_outlives_the_main_thread_reads_its_large_tensors(tmp_path):
    """A ``ThreadPoolExecutor`` refuses work once the main thread has ended: the restore's
    readers of large tensors then read in the restoring thread instead of raising."""
    script = tmp_path / "late.py"
    script.write_text(RESTORE_AT_EXIT)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], timeout=120,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "restored 1 True" in out.stdout, out.stdout + out.stderr
