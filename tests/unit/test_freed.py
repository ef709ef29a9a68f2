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
    got = shortfall(t)
    assert (got is None) == fits
    if got is not None:
        assert got[0] == held and got[1] > held and got[1] % size == 0


def test_empty_and_storage_less_tensors_have_no_shortfall():
    freed = torch.randn(0, 3)
    freed.untyped_storage().resize_(0)
    assert shortfall(freed) is None  # (nothing to read)
    assert shortfall(torch.empty(3, device="meta")) is None


@pytest.mark.parametrize("held", [0, 8])
def test_the_refusal_names_the_tensor_and_what_its_storage_holds(held):
    t = torch.randn(4, 4)
    t.untyped_storage().resize_(held)
    short = shortfall(t)
    assert short == (held, 64)
    message = unheld("model/w", t, short)
    assert message.startswith("model/w: a tensor of shape [4, 4]")
    assert ("holds no memory" in message) == (held == 0)
    assert held == 0 or "reaches 64 bytes of its storage, which holds 8" in message
