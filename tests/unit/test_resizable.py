"""What unbroken reads of the live tensors leaves them as they were: ``Tensor.numpy()`` marks a
storage non-resizable for good, and after one save (sync or process mode), one restore of
large tensors, or one traced update, FSDP's ``untyped_storage().resize_(0)`` of a parameter
raised. The bytes are read
through ctypes (`tensorfile.tensor_bytes`); trace digests are the ones NumPy gave."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import unbroken
from unbroken.state._digest import digest_tree
from unbroken.state.tensorfile import tensor_bytes


def _numpy_feed_digest(t: torch.Tensor) -> str:
    """A tensor's digest as `_digest` took it through ``numpy()`` (on a copy here)."""
    h = xxhash.xxh3_64()
    h.update(b"M1;")  # (digest_tree of {"t": t}: a one-key mapping, its key, its tensor)
    data = b"t"
    h.update(b"S%d;" % len(data) + data)
    arr = t.detach().clone().numpy()
    h.update(arr)
    h.update(arr.dtype.char.encode())
    return h.hexdigest()


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.int64,
                              torch.int32, torch.int8, torch.uint8, torch.bool,
                              torch.complex64]),
       shape=st.lists(st.integers(0, 4), max_size=3), grad=st.booleans())
def test_a_tensor_s_digest_is_the_one_numpy_gave(dtype, shape, grad):
    t = (torch.randn(shape) * 10).to(dtype)
    if grad and t.is_floating_point():
        t.requires_grad_(True)
    assert digest_tree({"t": t}) == _numpy_feed_digest(t)
    t.detach().untyped_storage().resize_(0)  # (still resizable)


def test_tensor_bytes_are_the_tensor_s_and_keep_it_alive():
    for t in (torch.arange(6, dtype=torch.float32).reshape(2, 3),
              torch.randn(5).bfloat16(), torch.tensor(True), torch.empty(0, 3),
              torch.arange(10)[3:7]):
        view = tensor_bytes(t)
        assert bytes(view) == t.view(-1).view(torch.uint8).clone().numpy().tobytes()
        assert not view.readonly
        t.untyped_storage().resize_(t.untyped_storage().nbytes())  # (still resizable)
    kept = tensor_bytes(torch.full((1000,), 7, dtype=torch.uint8))
    torch.randn(1000)  # (the tensor's memory is the view's: not handed out again)
    assert bytes(kept) == b"\x07" * 1000


def _resizable(tensors: Any) -> bool:
    try:
        for t in tensors:
            s = t.untyped_storage()
            s.resize_(s.nbytes())
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("mode", [False, True, "process"])
def test_saves_restores_and_traces_leave_the_live_tensors_resizable(tmp_path, mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Linear(300, 4))
    opt = torch.optim.AdamW(model.parameters())
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               async_save=mode, trace=tmp_path / "trace.jsonl",
                               trace_hash_every=1) as ckpt:
        model(torch.ones(2, 300)).sum().backward()
        opt.step()
        ckpt.step_done(1, loss=1.0)
        ckpt.save()
        ckpt.wait()
    live = [*model.parameters(), *(v for s in opt.state.values() for v in s.values())]
    assert _resizable(live)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        assert ckpt.restore() == 1
    # (the parameters are copied into; the optimizer adopts the state read, which is
    # unbroken's own memory)
    assert _resizable(model.parameters())


def test_tensor_bytes_hold_the_storage_and_refuse_what_is_not_contiguous():
    """A parameter given other data while a view of its bytes lives (``p.data = ...``) leaves
    its old storage to the view (read from freed memory, it crashed); a tensor whose bytes are
    not its values in order (transposed, expanded) is refused, not viewed."""
    import gc

    p = torch.nn.Parameter(torch.full((1 << 18,), 7.0))
    view = tensor_bytes(p)
    p.data = torch.zeros(1 << 18)
    gc.collect()
    torch.randn(1 << 18)  # (freed memory would be handed out again)
    assert bytes(view[:4]) == torch.tensor(7.0).numpy().tobytes()
    for t in (torch.arange(6).reshape(2, 3).t(), torch.zeros(1).expand(8)):
        with pytest.raises(ValueError, match="not contiguous"):
            tensor_bytes(t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [0, 8])
def test_a_digest_of_a_tensor_whose_storage_is_gone_reads_none_of_it(dtype, size):
    """A trace digests the live parameters; one whose storage was freed or shrunk (FSDP
    frees its flat parameter between passes) was read past its storage's end (a crash, or
    bytes that are not its values): it digests as its dtype and shape alone."""
    flat = torch.randn(64).to(dtype)
    view = flat[8:24].view(4, 4)
    before = digest_tree({"t": view})
    flat.untyped_storage().resize_(size)
    gone = digest_tree({"t": view})
    assert gone != before and gone == digest_tree({"t": view})
