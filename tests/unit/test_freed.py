"""`state.freed.shortfall`: a tensor whose storage holds fewer bytes than its offset, shape and
strides reach is found, exactly where torch's own bounds check (``set_``) refuses the same
view of the same storage; and a storage freed or shrunk under a tensor is refused by every
save mode, naming it (tests/unit/test_unchecked_saves.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.state.freed import shortfall, unheld

_DTYPES = [torch.float32, torch.float64, torch.int8, torch.bfloat16, torch.bool]


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
       strides=st.lists(st.integers(0, 7), min_size=3, max_size=3),
       offset=st.integers(0, 6), dtype=st.sampled_from(_DTYPES), contiguous=st.booleans(),
       held=st.integers(0, 400))
def test_shortfall_is_torch_s_own_bounds_check(shape, strides, offset, dtype, contiguous,
                                                held):
    size = torch.empty(0, dtype=dtype).element_size()
    storage = torch.empty(4096, dtype=torch.uint8).untyped_storage()
    t = torch.empty(0, dtype=dtype)
    if contiguous:
        t.set_(storage, offset, shape)
    else:
        t.set_(storage, offset, shape, strides[:len(shape)])
    storage.resize_(held)
    try:  # torch's own check of this view on this storage
        torch.empty(0, dtype=dtype).set_(storage, offset, t.shape, t.stride())
        fits = True
    except RuntimeError:
        fits = False
    got = shortfall(t, t.data_ptr())
    assert (got is None) == fits
    if got is not None:
        assert got[0] == held and got[1] > held and got[1] % size == 0


def test_empty_and_storage_less_tensors_have_no_shortfall():
    freed = torch.randn(0, 3)
    freed.untyped_storage().resize_(0)
    assert shortfall(freed, freed.data_ptr()) is None  # (nothing to read)
    meta = torch.empty(3, device="meta")
    assert shortfall(meta, 0) is None


@pytest.mark.parametrize("held", [0, 8])
def test_the_refusal_names_the_tensor_and_what_its_storage_holds(held):
    t = torch.randn(4, 4)
    t.untyped_storage().resize_(held)
    short = shortfall(t, t.data_ptr())
    assert short == (held, 64)
    message = unheld("model/w", t, short)
    assert message.startswith("model/w: a tensor of shape [4, 4]")
    assert ("holds no memory" in message) == (held == 0)
    assert held == 0 or "reaches 64 bytes of its storage, which holds 8" in message


class _Wrapper(torch.Tensor):
    """A wrapper subclass (the pattern of DTensor, torchao's NF4 weights and 8-bit optimizer
    states): a storage of its size without memory, its data another tensor's."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Wrapper:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, inner.shape, dtype=inner.dtype, strides=inner.stride(),
            storage_offset=inner.storage_offset())

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(x):
            return x.inner if isinstance(x, _Wrapper) else x
        return func(*torch.utils._pytree.tree_map(unwrap, args),
                    **torch.utils._pytree.tree_map(unwrap, kwargs or {}))


def test_a_wrapper_subclass_has_no_memory_of_its_own():
    w = _Wrapper(torch.randn(4, 4))
    assert shortfall(w, w.data_ptr()) == (0, 64)


@pytest.mark.parametrize("mode", [False, True, "process"])
@pytest.mark.parametrize("where", ["optimizer", "extras"])
def test_a_wrapper_subclass_is_refused_not_read_from_address_0(tmp_path, mode, where):
    """Its bytes were read from address 0 plus its offset (SIGSEGV) by sync and process
    saves: refused by every mode, naming it."""
    import unbroken

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()

    class Extra:
        def __init__(self) -> None:
            self.w = _Wrapper(torch.randn(3, 2))

        def state_dict(self):
            return {"w": self.w}

        def load_state_dict(self, sd):
            self.w = sd["w"]

    refused = pytest.raises(unbroken.UnsupportedValue,
                            match="_Wrapper whose data is another tensor's")
    if where == "extras":  # (refused as the Checkpointer is built: extras are tried then)
        with refused:
            unbroken.Checkpointer(tmp_path / "run", model=model, extras={"x": Extra()},
                                  async_save=mode)
        return
    for p in model.parameters():
        opt.state[p]["exp_avg"] = _Wrapper(opt.state[p]["exp_avg"].clone())
    ckpt = unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                                 async_save=mode)
    try:
        with refused:
            ckpt.save(1)
            ckpt.wait()
    finally:
        ckpt.close()
