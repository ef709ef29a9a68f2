"""The safetensors header's limits, the same on both sides: what the writer emits, its reader
takes (at most 64 dimensions, sizes multiplying to under 2**62), and every dtype the format
defines is a well-formed header for `audit` (sub-byte ones packed), while a restore refuses
the ones unbroken never writes, as corrupt, naming the tensor."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import unbroken
from unbroken.errors import CorruptCheckpoint, UnsupportedValue
from unbroken.state.stheader import BITS, ITEMSIZE, read_safetensors_header
from unbroken.state.tensorfile import encode_safetensors
from unbroken.state.tensorread import decode_safetensors


def _file(entries: dict) -> bytes:
    header = json.dumps(entries).encode()
    size = max((e["data_offsets"][1] for e in entries.values()), default=0)
    return struct.pack("<Q", len(header)) + header + bytes(size)


@pytest.mark.parametrize(("dtype", "shape", "nbytes"), [
    ("F4", [4], 2), ("F4", [3, 2], 3), ("F6_E2M3", [4], 3), ("F6_E3M2", [8], 6),
    ("F8_E8M0", [2, 2], 4), ("F8_E4M3FNUZ", [3], 3), ("F8_E5M2FNUZ", [1], 1)])
def test_every_dtype_of_the_format_is_a_well_formed_header(dtype, shape, nbytes):
    data = _file({"w": {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}})
    header, _ = read_safetensors_header(data, "f")
    assert header["w"]["dtype"] == dtype
    for view in (memoryview(bytearray(data)), memoryview(data)):  # (both decoding paths)
        with pytest.raises(CorruptCheckpoint, match=f"'w' has dtype {dtype}, which unbroken "
                                                    "does not restore"):
            decode_safetensors(view, "f")


@pytest.mark.parametrize(("dtype", "shape", "nbytes"), [
    ("F4", [3], 2), ("F4", [3], 1), ("F6_E2M3", [2], 2), ("F32", [2], 7)])
def test_a_span_that_is_no_whole_number_of_bytes_or_the_wrong_one_is_refused(dtype, shape,
                                                                              nbytes):
    data = _file({"w": {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}})
    with pytest.raises(CorruptCheckpoint, match="spans"):
        read_safetensors_header(data, "f")


def test_the_bits_of_the_whole_byte_dtypes_are_their_item_sizes():
    assert {k: BITS[k] for k in ITEMSIZE} == {k: 8 * v for k, v in ITEMSIZE.items()}


@pytest.mark.parametrize("shape", [[1] * 65, [0, 1 << 31, 1 << 31]])
def test_the_writer_refuses_a_shape_its_reader_would(shape):
    # (65 dimensions of one element; an empty tensor whose other sizes multiply past 2**62)
    with pytest.raises(UnsupportedValue, match="at most 64 dimensions"):
        encode_safetensors({"w": torch.zeros(shape, dtype=torch.uint8)})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=5), min_size=1, max_size=6),
       st.sampled_from([torch.float32, torch.bfloat16, torch.uint8, torch.bool, torch.int64]))
def test_what_the_writer_emits_its_reader_takes(shapes, dtype):
    tensors = {f"t{i}": torch.zeros(s, dtype=dtype) for i, s in enumerate(shapes)}
    data = memoryview(bytearray(b"".join(bytes(c) for c in encode_safetensors(tensors))))
    got, _ = decode_safetensors(data, "f")
    assert {k: (v.dtype, list(v.shape)) for k, v in got.items()} == {
        k: (v.dtype, list(v.shape)) for k, v in tensors.items()}


def test_a_save_of_a_65_dimension_buffer_is_refused_and_leaves_no_generation(tmp_path):
    model = torch.nn.Linear(2, 2)
    model.register_buffer("deep", torch.zeros([1] * 65))
    with unbroken.Checkpointer(tmp_path / "run", model=model) as ckpt:
        with pytest.raises(UnsupportedValue, match="'deep'"):
            ckpt.save(1)
    assert not list((tmp_path / "run").glob("gen-*"))
