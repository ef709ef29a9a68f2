"""The fast paths of save and restore do exactly what the slow ones do: small chunks gathered
into fewer writes give the same bytes, and a model of plain modules restored by copying into
its tensors ends as ``load_state_dict`` would leave it; a module that customises loading (or
has hooks) still goes through ``load_state_dict``; the optimizer's state loaded without
torch's per-value cast ends, and steps, exactly as ``load_state_dict`` would have."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import unbroken
from unbroken.picking import _MAP_MIN
from unbroken.state.livemodel import LiveModel
from unbroken.state.optim import load_optimizer_state
from unbroken.store.backends.local import _coalesced


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(st.integers(0, 600_000), max_size=30))
def test_gathered_writes_carry_the_same_bytes_in_order(sizes):
    chunks = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    out = [bytes(v) for v in _coalesced(chunks)]
    assert b"".join(out) == b"".join(chunks)
    assert len(out) <= len(chunks)  # never more writes than chunks


def _save_and_restore(tmp_path, make):
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        ckpt.step_done(1)
        ckpt.save()
    torch.manual_seed(1)
    other = make()
    params = [id(p) for p in other.parameters()]
    with unbroken.Checkpointer(tmp_path / "run", model=other,
                               optimizer=torch.optim.SGD(other.parameters(), lr=0.1)) as ckpt:
        assert ckpt.restore() == 1
    assert [id(p) for p in other.parameters()] == params  # loaded into the live tensors
    for (k, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), k
    return other


def test_a_stack_of_plain_layers_takes_the_copy_path_and_restores_exactly(tmp_path):
    def make():
        return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(300)])

    assert LiveModel(make()).loads
    _save_and_restore(tmp_path, make)


def test_modules_that_customise_loading_go_through_load_state_dict(tmp_path):
    def make():
        return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))

    assert not LiveModel(make()).loads  # BatchNorm overrides _load_from_state_dict
    _save_and_restore(tmp_path, make)

    calls = []

    def hooked():
        m = torch.nn.Linear(2, 2)
        m.register_load_state_dict_post_hook(lambda module, keys: calls.append(1))
        return m

    assert not LiveModel(hooked()).loads
    _save_and_restore(tmp_path / "hooked", hooked)
    assert calls == [1]  # the user's hook ran on restore


@settings(max_examples=25, deadline=None, database=None)
@given(st.lists(st.integers(0, 9 << 20), max_size=6))
def test_direct_writes_leave_exactly_the_bytes_and_their_hash(tmp_path_factory, sizes):
    import os

    import xxhash

    from unbroken.store.backends.local import LocalFS

    chunks = [os.urandom(min(n, 4096)) * (n // 4096) + os.urandom(n % 4096) for n in sizes]
    path = tmp_path_factory.mktemp("direct") / "f"
    size, digest = LocalFS().write_file(str(path), chunks)
    data = b"".join(chunks)
    assert path.read_bytes() == data and size == len(data)  # no padding left behind
    assert digest == xxhash.xxh3_128(data).hexdigest()


def test_a_failing_direct_write_raises_and_stops(tmp_path, monkeypatch):
    import pytest

    from unbroken.store.backends import _direct

    calls = []

    def failing(view):
        calls.append(len(view))
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            assert _direct.try_direct(fd)
            _direct.write_direct(fd, [bytes(40 << 20)], failing)
        finally:
            os.close(fd)
    assert len(calls) == 1  # nothing more is written after the failure


def _trained(kind: str, **options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    opt = getattr(torch.optim, kind)(model.parameters(), lr=0.01, **options)
    for _ in range(3):
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


OPTIMIZERS = [("Adam", {}), ("AdamW", {"amsgrad": True}), ("SGD", {"momentum": 0.9}),
              ("Adam", {"fused": True}), ("RMSprop", {"centered": True}), ("Adagrad", {})]


@pytest.mark.parametrize("kind,options", OPTIMIZERS, ids=[k + str(o) for k, o in OPTIMIZERS])
def test_the_optimizer_fast_load_ends_as_load_state_dict_and_steps_alike(kind, options):
    _, source = _trained(kind, **options)
    saved = source.state_dict()
    results = []
    for load in (lambda o, s: o.load_state_dict(s), load_optimizer_state):
        model, opt = _trained(kind, **options)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1)  # the live state differs from the saved one
        load(opt, copy.deepcopy(saved))
        torch.manual_seed(5)
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
        results.append((opt.state_dict(), [p.detach().clone() for p in model.parameters()]))
    (fast_sd, fast_p), (ref_sd, ref_p) = results[1], results[0]
    assert all(torch.equal(a, b) for a, b in zip(fast_p, ref_p, strict=True))
    assert fast_sd["param_groups"] == ref_sd["param_groups"]
    for i, ref in ref_sd["state"].items():
        got = fast_sd["state"][i]
        assert got.keys() == ref.keys()
        for k, v in ref.items():
            assert (torch.equal(v, got[k]) and v.dtype == got[k].dtype
                    if torch.is_tensor(v) else v == got[k]), (i, k)


def test_an_optimizer_that_loads_its_own_way_goes_through_load_state_dict():
    calls = []

    class Own(torch.optim.SGD):
        def load_state_dict(self, state_dict):
            calls.append(1)
            super().load_state_dict(state_dict)

    model = torch.nn.Linear(2, 2)
    opt = Own(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2)).sum().backward()
    opt.step()
    load_optimizer_state(opt, opt.state_dict())
    assert calls == [1]


RESTORE_MEMORY = textwrap.dedent("""
    import sys, torch, unbroken

    def peak_kb():
        with open("/proc/self/status") as f:
            return int(dict(line.split(":", 1) for line in f)["VmHWM"].split()[0])

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(10)])
    opt = torch.optim.AdamW(model.parameters())
    if sys.argv[2] != "resume":  # (a resumed job's optimizer holds no state yet)
        model(torch.randn(2, 1024)).sum().backward()
        opt.step()
    if sys.argv[2] == "save":
        with unbroken.Checkpointer(sys.argv[1], model=model, optimizer=opt) as ckpt:
            ckpt.step_done(1)
            ckpt.save()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak to the current resident size
        before = peak_kb()
        with unbroken.Checkpointer(sys.argv[1], model=model, optimizer=opt) as ckpt:
            assert ckpt.restore() == 1
        state = sum(v.nbytes for s in opt.state.values() for v in s.values())
        print(peak_kb() - before, state // 1024)
    """)


def _restore_memory(tmp_path, mode: str) -> tuple[int, int]:
    """KiB a restore (``mode``: "restore" into live state, "resume" into an optimizer holding
    none) adds to the peak resident size, and KiB of optimizer state after it."""
    script = tmp_path / "memory.py"
    script.write_text(RESTORE_MEMORY)
    run = [sys.executable, str(script), str(tmp_path / "run")]
    subprocess.run([*run, "save"], check=True, timeout=120)
    out = subprocess.run([*run, mode], check=True, timeout=120, capture_output=True, text=True)
    added_kib, state_kib = map(int, out.stdout.split())
    return added_kib, state_kib


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux peak memory")
def test_a_restore_adds_no_more_memory_than_its_largest_tensor_and_64_mib(tmp_path):
    # 10 layers of 4 MiB weights with AdamW: 126 MiB of state; a restore that read the
    # generation into memory would add all of it (measured: +242 MiB for 20 layers)
    added_kib, _ = _restore_memory(tmp_path, "restore")
    assert added_kib / 1024 <= 4 + 64, added_kib


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux peak memory")
def test_a_resumed_restore_adds_the_state_and_no_second_copy_of_it(tmp_path):
    """A resumed job's optimizer adopts the tensors of its files read whole
    (tests/unit/test_resumed_restore.py): the memory added is that state, never a copy more."""
    added_kib, state_kib = _restore_memory(tmp_path, "resume")
    assert state_kib >= 80 * 1024  # (84 MB of AdamW state, read whole)
    # the state itself, plus what any restore may add (its largest tensor and 64 MiB)
    assert added_kib <= state_kib + (4 + 64) * 1024, (added_kib, state_kib)


def test_restored_state_holds_no_view_of_the_files(tmp_path):
    model, opt = _trained("AdamW")
    big = torch.nn.Linear(2048, 2048)  # optimizer file over the 32 MiB above which it is mapped
    opt.add_param_group({"params": big.parameters()})
    model.add_module("big", big)
    big(torch.randn(2, 2048)).sum().backward()
    opt.step()
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        ckpt.step_done(1)
        ckpt.save()
    mapped = (tmp_path / "run").glob("gen-*/optimizer.safetensors")
    assert [f.stat().st_size >= _MAP_MIN for f in mapped] == [True]
    expected = [t.clone() for t in [*model.state_dict().values(),
                                    *(v for s in opt.state.values() for v in s.values())]]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    for state in list(opt.state.values())[1:]:
        # nothing to copy into but the first parameter's state: new tensors of the
        # optimizer's own (an optimizer holding no state at all reads its files whole and
        # adopts their tensors: tests/unit/test_resumed_restore.py)
        state.clear()
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        ckpt.restore()
    restored = [*model.state_dict().values(), *(v for s in opt.state.values() for v in s.values())]
    assert all(torch.equal(a, b) for a, b in zip(restored, expected, strict=True))
    for t in restored:
        # a view of the mapped file would hold a storage of its size; the smaller files are
        # read whole into memory of this process's own
        assert t.untyped_storage().nbytes() < _MAP_MIN
        t.add_(1)  # writable, of this process's own
