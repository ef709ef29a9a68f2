"""A tensor file's small tensors are gathered into one chunk; runs of one dtype and shape
(the layout puts them side by side) are copied by one ``torch.stack``, the rest a memmove
each. Both must give exactly the bytes of each tensor's memory, in the layout's order: for
every dtype, odd bytes a stack could normalise (a bool byte of 2, NaN payloads, negative
zeros), tensors requiring grad, runs shorter and longer than a stack's minimum; and the file
must decode back to the same tensors, bit for bit."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.state import tensorfile as T
from unbroken.state.tensorfile import encode_safetensors
from unbroken.state.tensorread import decode_safetensors

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.uint16, torch.int32]


def _raw(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are arbitrary (any bit pattern, as memory holds)."""
    n = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def _memory(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().view(-1).view(torch.uint8).numpy())


@settings(max_examples=60, deadline=None, database=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES),
                          st.sampled_from([(3,), (2, 5), (7,), (1,), (4, 4)]),
                          st.integers(1, 12), st.booleans()), min_size=1, max_size=6),
       st.integers(0, 2 ** 32 - 1))
def test_gathered_small_tensors_are_their_memory_in_layout_order(groups, seed):
    tensors: dict[str, torch.Tensor] = {}
    for g, (dtype, shape, count, grad) in enumerate(groups):
        for i in range(count):
            t = _raw(dtype, shape, seed + 1000 * g + i)
            if grad and dtype.is_floating_point and dtype.itemsize >= 2:
                t = torch.nn.Parameter(t.clone())  # (a parameter: its bytes, not its history)
            tensors[f"g{g}.t{i:02d}"] = t
    chunks = encode_safetensors(tensors, {"m": "1"})
    data = b"".join(bytes(c) for c in chunks)
    header_len = int.from_bytes(data[:8], "little")
    entries, _ = T.read_safetensors_header(data, "test")
    body = data[8 + header_len:]
    for key, e in entries.items():
        begin, end = e["data_offsets"]
        assert body[begin:end] == _memory(tensors[key]), key
    decoded, meta = decode_safetensors(memoryview(bytearray(data)), "test")
    assert meta == {"m": "1"}
    for key, t in tensors.items():
        assert decoded[key].dtype == t.dtype and decoded[key].shape == t.shape
        assert _memory(decoded[key]) == _memory(t), key


def test_a_long_run_of_one_shape_is_stacked_and_the_layout_groups_shapes():
    """The layout orders by shape within a size class: 20 tensors of each of two shapes,
    named so that key order would interleave them, come out as two runs (each stacked)."""
    tensors = {f"{i}.{w}": torch.randn(4, 4) if w == "w" else torch.randn(16)
               for i in range(20) for w in ("b", "w")}
    stacks = []
    real = T._stacked

    def spy(ts, into, dtype, shape, unchecked=False):
        stacks.append((len(ts), tuple(shape)))
        return real(ts, into, dtype, shape, unchecked)

    T._stacked = spy
    try:
        data = b"".join(bytes(c) for c in encode_safetensors(tensors))
    finally:
        T._stacked = real
    assert sorted(stacks) == [(20, (4, 4)), (20, (16,))]
    entries, _ = T.read_safetensors_header(data, "test")
    shapes = [tuple(e["shape"]) for e in sorted(entries.values(),
                                                key=lambda e: e["data_offsets"][0])]
    assert shapes == sorted(shapes)  # one run per shape
    decoded, _ = decode_safetensors(memoryview(bytearray(data)), "test")
    assert all(torch.equal(decoded[k], v) for k, v in tensors.items())


@settings(max_examples=30, deadline=None, database=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.sampled_from([(3,), (2, 5), (1,)]),
                          st.integers(1, 12)), min_size=1, max_size=5),
       st.integers(1, 3), st.integers(0, 2 ** 32 - 1))
def test_a_kept_layout_gathers_the_bytes_of_a_fresh_one_save_after_save(groups, saves, seed):
    """The chunking (which tensors are stacked, which moved) is made with the layout and
    kept with it: each later save of the same keys, dtypes and shapes, with new values (and
    new tensors), must write exactly what an encoding without a kept layout writes."""
    layout: dict = {}
    for s in range(saves):
        tensors = {f"g{g}.t{i:02d}": _raw(dtype, shape, seed + 7919 * s + 1000 * g + i)
                   for g, (dtype, shape, count) in enumerate(groups) for i in range(count)}
        tensors["big"] = _raw(torch.float32, (T._SMALL // 4 + 1,), seed + s)  # (its own chunk)
        kept = b"".join(bytes(c) for c in encode_safetensors(tensors, {"s": str(s)},
                                                               layout=layout))
        fresh = b"".join(bytes(c) for c in encode_safetensors(tensors, {"s": str(s)}))
        assert kept == fresh
        assert "chunking" in layout


def _gathered(chunks: list[memoryview]) -> list[int]:
    """The addresses of the gathered chunks (all but the header and the large tensor)."""
    return [np.frombuffer(c, dtype=np.uint8).ctypes.data for c in chunks[1:]
            if c.nbytes != T._SMALL + 4]


def test_a_kept_layout_gathers_into_the_same_buffers_until_it_changes():
    """Without a room, the gathered chunks of a kept layout are built in the buffers of the
    last call (fresh memory is faulted in at every save otherwise): each call's chunks hold
    its own values; a layout that changed gets new buffers; a room is used instead of them."""
    def tensors(seed: int, n: int = 40) -> dict[str, torch.Tensor]:
        out = {f"w{i:02d}": _raw(torch.float32, (6,), seed + i) for i in range(n)}
        out["c"] = _raw(torch.int8, (3,), seed)
        out["big"] = _raw(torch.float32, (T._SMALL // 4 + 1,), seed)
        return out

    layout: dict = {}
    first = encode_safetensors(tensors(1), {}, layout=layout)
    where = _gathered(first)
    assert where
    for seed in (2, 3):
        state = tensors(seed)
        chunks = encode_safetensors(state, {}, layout=layout)
        assert _gathered(chunks) == where  # the same buffers again
        decoded, _ = decode_safetensors(bytes(b"".join(bytes(c) for c in chunks)), "f")
        assert all(_raw_bytes(decoded[k]) == _raw_bytes(v) for k, v in state.items())
    changed = encode_safetensors(tensors(4, n=41), {}, layout=layout)
    assert not set(_gathered(changed)) & set(where)  # (41 tensors: a new layout)
    room_bytes = bytearray(1 << 16)
    view = memoryview(room_bytes)
    given: list[memoryview] = []

    def room(n: int) -> memoryview:
        given.append(view[:n])
        return given[-1]

    in_room = encode_safetensors(tensors(5, n=41), {}, layout=layout, room=room)
    assert in_room[1:] and any(c is given[0] for c in in_room)  # the room's, not the kept


def _raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()
