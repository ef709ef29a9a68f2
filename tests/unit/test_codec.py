"""The no-pickle codec: state tree <-> (JSON skeleton, tensors) <-> safetensors bytes."""

from __future__ import annotations

import json
import math
import random
import struct

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.errors import CorruptCheckpoint, UnsupportedValue
from unbroken.state.codec import MAX_DEPTH, TAG, encode_tree
from unbroken.state.decoding import decode_tree
from unbroken.state.jsontext import dumps_json, loads_json
from unbroken.state.tensorfile import encode_safetensors, read_safetensors_header
from unbroken.state.tensorread import decode_safetensors

# ---------------------------------------------------------------------------------------------
# helpers


def full_roundtrip(tree, metadata=None):
    """tree -> skeleton JSON bytes + safetensors bytes -> tree, as a generation stores it."""
    skeleton, tensors = encode_tree(tree, "")
    skel_bytes = dumps_json(skeleton)
    blob = b"".join(encode_safetensors(tensors, metadata))
    loaded, meta = decode_safetensors(blob, "part.safetensors")
    return decode_tree(loads_json(skel_bytes, "state.json", 1 << 30), loaded), meta


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(a, b, path="root"):
    """Equal values *and* identical types, all the way down (NaN == NaN, -0.0 != 0.0)."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, path
        assert a.shape == b.shape, path
        assert tensor_bytes(a) == tensor_bytes(b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, float):
        if math.isnan(a):
            assert math.isnan(b), path
        else:
            assert a == b and math.copysign(1, a) == math.copysign(1, b), path
    elif isinstance(a, dict):
        assert len(a) == len(b), path
        bkeys = {(type(k), k): k for k in b}
        for k, v in a.items():
            assert (type(k), k) in bkeys, f"{path}: key {k!r} ({type(k).__name__}) missing"
            assert_same(v, b[bkeys[(type(k), k)]], f"{path}.{k!r}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
    else:
        assert a == b, path


def st_file(header, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def f32(shape, begin):
    n = math.prod(shape) * 4
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, begin + n]}


# ---------------------------------------------------------------------------------------------
# skeleton types


def test_python_values_keep_their_exact_types():
    tree = {
        "none": None,
        "bools_vs_ints": [True, False, 1, 0],
        "floats": [0.0, -0.0, 1.5, 1e308, 5e-324, float("nan"), float("inf"), float("-inf")],
        "huge_ints": [2**64, -(2**100), 2**63 - 1, 10**4000],
        "str": "héllo \u2603 \x00",
        "bytes": [b"", b"\x00\xff\x80abc"],
        "tuples": [(), (1,), (1, (2, (3, ())), [4, (5,)]), ((), ())],
        "size": [torch.Size([]), torch.Size([2, 3, 0])],
        "dtype": [torch.float32, torch.bfloat16, torch.complex128, torch.float8_e5m2],
        "device": [torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")],
        "list_of_dicts": [{}, {"a": {"b": {"c": []}}}],
    }
    out, _ = full_roundtrip(tree)
    assert_same(tree, out)
    assert out["bools_vs_ints"][0] is True and type(out["bools_vs_ints"][2]) is int


def test_int_and_mixed_dict_keys_like_optimizer_state():
    tree = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4)},
                  1: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 2)}},
        "param_groups": [{"lr": 0.1, "params": [0, 1], "betas": (0.9, 0.999)}],
        "mixed": {1: "int", "1": "str", (2, "x"): "tuple", None: "none", 2.5: "f", b"k": "b"},
        "negative": {-1: -1, 10**30: "big"},
    }
    out, _ = full_roundtrip(tree)
    assert_same(tree, out)
    assert list(out["state"]) == [0, 1]
    assert out["mixed"][1] == "int" and out["mixed"]["1"] == "str"
    # int-keyed (tagged) dicts keep their insertion order
    order = {3: "c", 1: "a", 2: "b"}
    assert list(full_roundtrip(order)[0]) == [3, 1, 2]


def test_user_dict_containing_the_tag_key_is_not_confused_with_a_tag():
    tree = {"user": {TAG: "tensor", "key": "nope"}, "other": {TAG: 5},
            "nested": [{TAG: "bytes", "v": "not base64!"}]}
    out, _ = full_roundtrip(tree)
    assert_same(tree, out)


def test_numpy_scalars_keep_type_and_dtype():
    scalars = [np.float16(1.5), np.float32(-0.0), np.float64("nan"), np.int8(-128),
               np.int16(-3), np.int32(7), np.int64(-(2**63)), np.uint8(255), np.uint16(65535),
               np.uint32(2**32 - 1), np.uint64(2**64 - 1), np.bool_(True), np.complex64(1 - 2j),
               np.complex128(3 + 4j), np.datetime64("2024-01-02T03:04:05", "s")]
    out, _ = full_roundtrip({"s": scalars})
    for a, b in zip(scalars, out["s"]):
        assert type(a) is type(b) and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_numpy_arrays_including_mt19937_state():
    bitgen = np.random.MT19937(1234)
    bitgen.random_raw(5)  # move off the initial position
    mt_state = bitgen.state
    assert mt_state["state"]["key"].dtype == np.uint32 and mt_state["state"]["key"].shape == (624,)
    arrays = {
        "mt": mt_state,
        "legacy": np.random.RandomState(7).get_state(),  # ('MT19937', uint32[624], pos, ...)
        "zero_d": np.array(3.25),
        "multi": np.arange(24, dtype=np.int16).reshape(2, 3, 4),
        "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "strided": np.arange(20)[::3],
        "big_endian": np.arange(5, dtype=">i4"),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "bools": np.array([True, False]),
    }
    out, _ = full_roundtrip(arrays)
    assert_same(arrays, out)
    for name in ("fortran", "strided"):
        np.testing.assert_array_equal(out[name], arrays[name])
    # the restored state drives an identical stream
    restored = np.random.MT19937()
    restored.state = out["mt"]
    np.testing.assert_array_equal(restored.random_raw(10), bitgen.random_raw(10))
    legacy = np.random.RandomState()
    legacy.set_state(out["legacy"])
    expected = np.random.RandomState(7).randint(0, 2**31, 5).tolist()
    assert legacy.randint(0, 2**31, 5).tolist() == expected
    # decoded arrays are writable copies, not views into the JSON buffer
    out["multi"][0, 0, 0] = 99


def test_python_random_state_round_trips():
    rng = random.Random(5)
    rng.random()
    state = rng.getstate()
    out, _ = full_roundtrip({"py": state})
    assert_same(state, out["py"])
    again = random.Random()
    again.setstate(out["py"])
    assert [again.random() for _ in range(5)] == [rng.random() for _ in range(5)]


# ---------------------------------------------------------------------------------------------
# tensors


def _dtypes():
    names = ["float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
             "uint8", "bool", "uint16", "uint32", "uint64", "complex64", "complex128",
             "complex32", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
             "float8_e8m0fnu"]
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def _random_tensor(dtype, shape, gen):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    n = math.prod(shape) * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)  # arbitrary bit patterns, NaNs included


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
def test_tensor_of_every_dtype_round_trips_bitwise(dtype):
    gen = torch.Generator().manual_seed(0)
    tree = {
        "full": _random_tensor(dtype, (3, 5), gen),
        "scalar": _random_tensor(dtype, (), gen),
        "empty": _random_tensor(dtype, (0, 4), gen),
        "transposed": _random_tensor(dtype, (4, 6), gen).t(),
        "strided": _random_tensor(dtype, (6, 8), gen)[::2, 1::3],
    }
    out, _ = full_roundtrip(tree)
    assert_same(tree, out)
    for v in out.values():
        assert v.device.type == "cpu"


def test_complex128_takes_the_raw_bytes_path():
    t = torch.randn(2, 3, dtype=torch.complex128)
    skeleton, tensors = encode_tree({"c": t})
    ref = skeleton["c"]
    assert ref[TAG] == "tensor" and ref["dtype"] == "complex128" and ref["shape"] == [2, 3]
    assert tensors[ref["key"]].dtype == torch.uint8 and tensors[ref["key"]].numel() == 6 * 16
    header = json.loads(bytes(encode_safetensors(tensors)[0])[8:])
    assert header[ref["key"]]["dtype"] == "U8"
    out, _ = full_roundtrip({"c": t})
    assert out["c"].dtype == torch.complex128 and torch.equal(out["c"], t)


def test_expanded_grad_and_parameter_tensors():
    base = torch.randn(3, requires_grad=True)
    tree = {"expanded": torch.arange(3.0).expand(4, 3), "grad": base * 2,
            "param": torch.nn.Parameter(torch.randn(2, 2))}
    out, _ = full_roundtrip(tree)
    assert torch.equal(out["expanded"], tree["expanded"])
    assert torch.equal(out["grad"], tree["grad"].detach()) and not out["grad"].requires_grad
    assert torch.equal(out["param"], tree["param"].detach())


def test_tied_tensors_decode_to_one_object():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # weight tying
    w = torch.randn(5)
    tree = {"emb": emb.weight, "head": head.weight, "list": [w, w], "tuple": (w, {"again": w})}
    skeleton, tensors = encode_tree(tree)
    assert len(tensors) == 2  # each tied tensor stored once
    out, _ = full_roundtrip(tree)
    assert out["emb"] is out["head"]
    assert out["list"][0] is out["list"][1] is out["tuple"][0] is out["tuple"][1]["again"]
    assert torch.equal(out["emb"], emb.weight.detach())
    # tied tensors on the raw-bytes path (complex128) are shared too
    c = torch.randn(3, dtype=torch.complex128)
    cout, _ = full_roundtrip({"x": c, "y": [c]})
    assert cout["x"] is cout["y"][0] and torch.equal(cout["x"], c)


def test_views_of_one_storage_decode_to_separate_correct_values():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tree = {"base": base, "row0": base[0], "row1": base[1], "t": base.t(), "col": base[:, 2],
            "tail": base.reshape(-1)[20:]}
    out, _ = full_roundtrip(tree)
    for k, v in tree.items():
        assert torch.equal(out[k], v), k
        assert out[k].shape == v.shape
    assert out["row0"] is not out["row1"] and out["base"] is not out["t"]
    # the same bytes viewed as another dtype are a different value
    f = torch.tensor([1.0, -2.0, 0.5])
    vout, _ = full_roundtrip({"f": f, "i": f.view(torch.int32), "h": f.view(torch.float16)})
    assert vout["f"].dtype == torch.float32 and torch.equal(vout["f"], f)
    assert vout["i"].dtype == torch.int32 and torch.equal(vout["i"], f.view(torch.int32))
    assert vout["h"].shape == (6,) and tensor_bytes(vout["h"]) == tensor_bytes(f)
    # complex128 views share storage too and go through the raw-bytes path
    cbase = torch.randn(4, 4, dtype=torch.complex128)
    ctree = {"a": cbase[1:3], "b": cbase[:, 1], "c": cbase.t()}
    cout, _ = full_roundtrip(ctree)
    for k, v in ctree.items():
        assert torch.equal(cout[k], v), k


def test_key_collisions_get_distinct_keys():
    t1, t2 = torch.ones(2), torch.zeros(3)
    tree = {"a.b": t1, "a": {"b": t2}}
    skeleton, tensors = encode_tree(tree)
    assert len(tensors) == 2
    out, _ = full_roundtrip(tree)
    assert torch.equal(out["a.b"], t1) and torch.equal(out["a"]["b"], t2)


def test_top_level_tensor_and_empty_trees():
    t = torch.randn(3)
    out, _ = full_roundtrip(t)
    assert torch.equal(out, t)
    assert full_roundtrip({})[0] == {}
    assert full_roundtrip([])[0] == []
    assert full_roundtrip(())[0] == ()


def test_tensor_named_like_the_metadata_entry():
    t = torch.ones(2)
    out, meta = full_roundtrip({"__metadata__": t}, {"run": "r1"})
    assert torch.equal(out["__metadata__"], t) and meta == {"run": "r1"}


# ---------------------------------------------------------------------------------------------
# unsupported values


class _Custom:
    pass


@pytest.mark.parametrize("value,typename", [
    ({1, 2}, "set"), (frozenset(), "frozenset"), (lambda: 0, "function"), (object(), "object"),
    (_Custom(), "_Custom"), (1 + 2j, "complex"), (np.array([object()]), "object"),
])
def test_unsupported_values_name_their_path(value, typename):
    tree = {"opt": {"state": {0: {"extra": [1, value]}}}}
    with pytest.raises(UnsupportedValue) as e:
        encode_tree(tree, "")
    assert "opt.state.0.extra.1" in str(e.value)
    assert typename in str(e.value)


def test_unsupported_tensor_layouts_and_depth():
    with pytest.raises(UnsupportedValue, match="w"):
        encode_tree({"w": torch.eye(3).to_sparse()})
    with pytest.raises(UnsupportedValue, match="w"):
        encode_tree({"w": torch.empty(3, device="meta")})
    deep: list = []
    node = deep
    for _ in range(MAX_DEPTH + 5):
        node.append([])
        node = node[0]
    with pytest.raises(UnsupportedValue, match="deeper"):
        encode_tree(deep)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.one_of(st.integers(), st.booleans(),
                                 st.sampled_from([1 << 1024, -(1 << 1024), (1 << 1024) - 1,
                                                  1 - (1 << 1024), 10**400]))))
def test_lists_of_ints_keep_every_value_and_type(values):
    """A list or tuple of plain ints (an optimizer group's parameter ids, Python's RNG
    state) is taken whole, in range; ints past the JSON range, bools among them: each element
    its own way, and the skeleton is the one element-by-element encoding gives."""
    tree = {"ids": values, "nested": [values, (values,)], "tuple": tuple(values),
            "rng": (3, tuple(values), None)}
    out, _ = full_roundtrip(tree)
    assert_same(out, tree)
    skeleton, _ = encode_tree({"t": tuple(values)})
    assert skeleton["t"] == {TAG: "tuple", "v": [encode_tree(v)[0] for v in values]}


def test_int_beyond_str_digit_limit_round_trips_or_is_refused_up_front():
    big = 10**5000
    try:
        skeleton, _ = encode_tree({"n": big})
    except UnsupportedValue:
        return
    assert decode_tree(loads_json(dumps_json(skeleton), "s", 1 << 20), {})["n"] == big


# ---------------------------------------------------------------------------------------------
# safetensors bytes: format, alignment, hash


def _mixed_tensors():
    gen = torch.Generator().manual_seed(1)
    return {
        "b": torch.tensor([True, False, True]),
        "u8": torch.arange(5, dtype=torch.uint8),
        "h": torch.randn(3, generator=gen).half(),
        "bf": torch.randn(1, generator=gen).bfloat16(),
        "f": torch.randn(3, generator=gen),
        "d": torch.randn(1, generator=gen).double(),
        "c": torch.randn(3, generator=gen, dtype=torch.complex64),
        "i64": torch.arange(3),
        "u32": torch.tensor([0, 7, 2**32 - 1], dtype=torch.uint32),
        "f8": torch.randn(7, generator=gen).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "t": torch.randn(3, 2, generator=gen).t(),
    }


def test_safetensors_round_trip_metadata_and_official_loader(tmp_path):
    tensors = _mixed_tensors()
    meta = {"run_id": "r1", "unicode": "\u2603", "empty": ""}
    chunks = encode_safetensors(tensors, meta)
    assert all(isinstance(c, memoryview) for c in chunks)
    blob = b"".join(chunks)
    out, got_meta = decode_safetensors(blob, "x.safetensors")
    assert got_meta == meta
    assert set(out) == set(tensors)
    for k, t in tensors.items():
        assert out[k].dtype == t.dtype and out[k].shape == t.shape, k
        assert tensor_bytes(out[k]) == tensor_bytes(t), k
    # format compatibility: the official loader reads the same bytes
    official = safetensors.torch.load(blob)
    for k, t in tensors.items():
        assert tensor_bytes(official[k]) == tensor_bytes(t) and official[k].dtype == t.dtype, k
    path = tmp_path / "x.safetensors"
    path.write_bytes(blob)
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert f.metadata() == meta
        assert set(f.keys()) == set(tensors)


def test_no_tensors_and_no_metadata():
    blob = b"".join(encode_safetensors({}))
    assert decode_safetensors(blob, "x") == ({}, {})
    assert safetensors.torch.load(blob) == {}


def test_every_tensor_is_aligned_to_its_element_size():
    tensors = _mixed_tensors()
    blob = b"".join(encode_safetensors(tensors, {"k": "v"}))
    (n,) = struct.unpack("<Q", blob[:8])
    assert n % 8 == 0  # so data-section alignment is also file alignment
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__")
    itemsize = {"BOOL": 1, "U8": 1, "F16": 2, "BF16": 2, "F32": 4, "F64": 8, "C64": 8, "I64": 8,
                "U32": 4, "F8_E4M3": 1}
    for k, entry in header.items():
        begin = entry["data_offsets"][0]
        assert begin % itemsize[entry["dtype"]] == 0, (k, entry)
        assert (8 + n + begin) % itemsize[entry["dtype"]] == 0, (k, entry)


def test_data_hash_key_stamps_the_data_section_hash():
    tensors = {"a": torch.arange(10.0), "b": torch.ones(3, dtype=torch.int64)}
    blob = b"".join(encode_safetensors(tensors, {"user": "x"}, data_hash_key="unbroken.xxh3"))
    (n,) = struct.unpack("<Q", blob[:8])
    _, meta = decode_safetensors(blob, "x")
    assert meta["user"] == "x"
    assert meta["unbroken.xxh3"] == xxhash.xxh3_128(blob[8 + n:]).hexdigest()
    other = b"".join(encode_safetensors({"a": torch.arange(10.0) + 1, "b": tensors["b"]},
                                        {"user": "x"}, data_hash_key="unbroken.xxh3"))
    assert decode_safetensors(other, "x")[1]["unbroken.xxh3"] != meta["unbroken.xxh3"]
    plain = decode_safetensors(b"".join(encode_safetensors(tensors, {"user": "x"})), "x")[1]
    assert plain == {"user": "x"}


def test_encoding_is_deterministic():
    tensors = _mixed_tensors()
    a = b"".join(encode_safetensors(tensors, {"m": "1"}))
    b = b"".join(encode_safetensors(dict(reversed(list(tensors.items()))), {"m": "1"}))
    assert a == b


# ---------------------------------------------------------------------------------------------
# crafted safetensors buffers: always CorruptCheckpoint


_DATA8 = bytes(range(8))

CRAFTED = {
    "empty": b"",
    "too_short": b"\x02\x00\x00",
    "seven_bytes": b"\x00" * 7,
    "header_longer_than_file": struct.pack("<Q", 100) + b"{}",
    "header_length_huge": struct.pack("<Q", 2**63) + b"{}",
    "header_length_max": b"\xff" * 8 + b"{}",
    "invalid_json": st_file(b"{not json}"),
    "truncated_json": st_file(b'{"a": {"dtype": "F32"'),
    "invalid_utf8": st_file(b'{"\xff\xfe": 1}'),
    "nan_constant": st_file(b'{"a": NaN}'),
    "header_is_list": st_file(b"[]"),
    "header_is_number": st_file(b"1"),
    "header_is_string": st_file(b'"x"'),
    "header_is_null": st_file(b"null"),
    "entry_not_object": st_file({"a": 5}),
    "entry_missing_keys": st_file({"a": {"dtype": "F32"}}),
    "unknown_dtype": st_file({"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}},
                             bytes(16)),
    "dtype_not_str": st_file({"a": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}},
                             _DATA8),
    "negative_shape": st_file({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}},
                              _DATA8),
    "float_shape": st_file({"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}},
                           _DATA8),
    "bool_shape": st_file({"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}},
                          b"\x00"),
    "shape_not_list": st_file({"a": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}},
                              _DATA8),
    "offsets_float": st_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}},
                             _DATA8),
    "offsets_one_value": st_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0]}},
                                 _DATA8),
    "offsets_not_list": st_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": 8}},
                                _DATA8),
    "offsets_negative": st_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}},
                                _DATA8),
    "offsets_overlap": st_file({"a": f32([2], 0), "b": f32([2], 4)}, bytes(12)),
    "offsets_hole": st_file({"a": f32([1], 0), "b": f32([1], 8)}, bytes(12)),
    "offsets_not_from_zero": st_file({"a": f32([1], 4)}, bytes(8)),
    "span_vs_shape_mismatch": st_file(
        {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4)),
    "span_reversed": st_file({"a": {"dtype": "U8", "shape": [0], "data_offsets": [4, 0]}},
                             bytes(4)),
    "data_longer": st_file({"a": f32([2], 0)}, bytes(9)),
    "data_shorter": st_file({"a": f32([2], 0)}, bytes(7)),
    "data_without_tensors": st_file({}, bytes(4)),
    "deep_list": struct.pack("<Q", 100_000) + b"[" * 100_000,
    "deep_object": st_file(b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
    "metadata_int_value": st_file({"__metadata__": {"a": 1}}),
    "metadata_null_value": st_file({"__metadata__": {"a": None}}),
    "metadata_nested": st_file({"__metadata__": {"a": {"b": "c"}}}),
    "metadata_string": st_file({"__metadata__": "x"}),
    "metadata_list_nonempty": st_file({"__metadata__": ["a", "b"]}),
    "metadata_list": st_file({"__metadata__": []}),
    "huge_zero_size_shape": st_file(
        {"a": {"dtype": "F32", "shape": [2**64, 0], "data_offsets": [0, 0]}}),
    "overflowing_zero_size_shape": st_file(
        {"a": {"dtype": "F32", "shape": [2**62, 2**62, 0], "data_offsets": [0, 0]}}),
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_buffers_raise_corrupt_checkpoint(name):
    with pytest.raises(CorruptCheckpoint) as e:
        decode_safetensors(CRAFTED[name], "bad.safetensors")
    assert "bad.safetensors" in str(e.value)


def test_header_over_the_limit_is_refused_before_parsing():
    blob = b"".join(encode_safetensors({"a": torch.ones(2)}, {"pad": "x" * 200}))
    read_safetensors_header(blob, "x", limit=1024)  # fine under a roomy limit
    with pytest.raises(CorruptCheckpoint, match="limit"):
        read_safetensors_header(blob, "x", limit=64)


def test_mutated_and_truncated_files_never_raise_anything_else():
    """Every truncation and many single-byte edits of a valid file either decode or raise
    CorruptCheckpoint; no other exception type escapes."""
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(2).half(),
               "c": torch.tensor([True, False])}
    blob = b"".join(encode_safetensors(tensors, {"k": "v"}))
    (n,) = struct.unpack("<Q", blob[:8])
    variants = [blob[:i] for i in range(len(blob))]
    rng = random.Random(0)
    for i in range(8 + n):
        for value in {0, 0x20, 0x22, 0x2C, 0x30, 0x39, 0x5B, 0x7B, 0x7D, 0xFF,
                      rng.randrange(256)}:
            if blob[i] != value:
                variants.append(blob[:i] + bytes([value]) + blob[i + 1:])
    for v in variants:
        try:
            decode_safetensors(v, "fuzz")
        except CorruptCheckpoint:
            pass


# ---------------------------------------------------------------------------------------------
# loads_json and decode_tree on hostile input


@pytest.mark.parametrize("text", [b"NaN", b"[Infinity]", b'{"a": -Infinity}', b"{", b"\xff",
                                  b"[" * 100_000, b""])
def test_loads_json_rejects_non_standard_or_broken_json(text):
    with pytest.raises(CorruptCheckpoint, match="state.json"):
        loads_json(text, "state.json", 1 << 20)


def test_loads_json_size_limit():
    assert loads_json(b"[1, 2]", "x", 6) == [1, 2]
    with pytest.raises(CorruptCheckpoint, match="limit"):
        loads_json(b"[1, 2] ", "x", 6)


def test_dumps_json_is_canonical_and_refuses_nan():
    assert dumps_json({"b": 1, "a": [1.5, "\u2603"]}) == '{"a":[1.5,"\u2603"],"b":1}'.encode()
    with pytest.raises(ValueError):
        dumps_json({"x": float("nan")})


@pytest.mark.parametrize("skeleton", [
    {TAG: "tensor", "key": "missing"},
    {TAG: "tensor"},
    {TAG: "float", "v": "1.5"},  # finite floats are never tagged
    {TAG: "float", "v": "bogus"},
    {TAG: "tuple", "v": 3},
    {TAG: "size", "v": ["x"]},
    {TAG: "dict", "v": [[1]]},
    {TAG: "dict", "v": [[[1, 2], "unhashable key"]]},
    {TAG: "bytes", "v": "not base64!"},
    {TAG: "ndarray", "dtype": "|O", "shape": [1], "v": ""},
    {TAG: "ndarray", "dtype": "<f8", "shape": [3], "v": "AAAAAAAAAAA="},
    {TAG: "ndarray", "dtype": "nonsense", "shape": [], "v": ""},
    {TAG: "npscalar", "dtype": "|O", "v": ""},
    {TAG: "npscalar", "dtype": "<f8", "v": "AAA="},
    {TAG: "dtype", "v": "Tensor"},
    {TAG: "dtype", "v": "no_such_dtype"},
    {TAG: "no_such_tag"},
    {TAG: ["unhashable"]},
    [[[[{TAG: "tuple", "v": [{TAG: "bytes"}]}]]]],
], ids=repr)
def test_malformed_skeleton_entries_raise_corrupt_checkpoint(skeleton):
    with pytest.raises(CorruptCheckpoint):
        decode_tree(skeleton, {}, "gen/state.json")


def test_skeleton_nested_too_deep():
    deep = 1
    for _ in range(MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(CorruptCheckpoint, match="deeper"):
        decode_tree(deep, {})


@pytest.mark.parametrize("skeleton,tensors", [
    ({TAG: "device", "v": "garbage"}, {}),
    ({TAG: "npscalar", "dtype": "<f8", "v": ""}, {}),
    ({TAG: "tensor", "key": "k", "dtype": "complex128", "shape": [3]},
     {"k": torch.zeros(16, dtype=torch.uint8)}),
    ({TAG: "tensor", "key": "k", "dtype": "complex128", "shape": [1]},
     {"k": torch.zeros(15, dtype=torch.uint8)}),
], ids=["device", "npscalar-empty", "tensor-shape", "tensor-size"])
def test_malformed_entries_raise_corrupt_checkpoint(skeleton, tensors):
    with pytest.raises(CorruptCheckpoint):
        decode_tree(skeleton, tensors, "gen/state.json")


def test_every_reference_to_a_key_decodes_to_one_object_whatever_its_form():
    """A tensor referenced many times is one object after a restore (a tie stays a tie): plain
    references to a stored tensor; and, to a raw one (bytes viewed as their dtype), the raw
    references and the plain ones after them (the fortieth session's lookup without a cache
    gave those the stored bytes)."""
    stored = torch.arange(8, dtype=torch.float32)
    raw = torch.zeros(32, dtype=torch.uint8)
    skeleton = {"a": {TAG: "tensor", "key": "s"}, "b": [{TAG: "tensor", "key": "s"}],
                "c": {TAG: "tensor", "key": "r", "dtype": "complex128", "shape": [2]},
                "d": [{TAG: "tensor", "key": "r"},
                      {TAG: "tensor", "key": "r", "dtype": "complex128", "shape": [2]}],
                "e": {"x": {TAG: "tensor", "key": "s"}, "y": {TAG: "tensor", "key": "r"}}}
    out = decode_tree(skeleton, {"s": stored, "r": raw}, "gen/state.json")
    assert out["a"] is stored and out["b"][0] is stored and out["e"]["x"] is stored
    view = out["c"]
    assert view.dtype == torch.complex128 and view.shape == (2,)
    assert out["d"][0] is view and out["d"][1] is view and out["e"]["y"] is view


def test_tagged_entries_with_unexpected_keys_are_refused():
    for skeleton in ({TAG: "tuple", "v": [1], "extra": 2}, {TAG: "tensor", "key": "k", "v": 1},
                     {TAG: "bytes", "v": "", "x": None}):
        with pytest.raises(CorruptCheckpoint, match="unexpected keys"):
            decode_tree(skeleton, {"k": torch.zeros(1)}, "gen/state.json")


def test_counter_and_ordered_dict_keep_their_type_and_defaultdict_is_refused():
    from collections import Counter, OrderedDict, defaultdict
    tree = {"c": Counter({2: 1, 4: 2}), "o": OrderedDict([("b", 1), ("a", 2)])}
    skeleton, tensors = encode_tree(tree)
    out = decode_tree(loads_json(dumps_json(skeleton), "s", 1 << 20), tensors)
    assert type(out["c"]) is Counter and out["c"] == tree["c"]
    assert type(out["o"]) is OrderedDict and list(out["o"]) == ["b", "a"]
    with pytest.raises(UnsupportedValue, match="defaultdict"):
        encode_tree({"d": defaultdict(int)})


# -- issue 8: what the writer writes the reader reads; hostile names and numbers -----------------


def test_numpy_arrays_and_large_bytes_go_to_the_tensor_file_not_into_json():
    ids = np.arange(100_000, dtype=np.int64)
    odd = np.array([[1.5, 2.5]], dtype=">f8")  # big-endian, kept exactly
    record = np.array([b"abc", b"de"], dtype="S3")
    blob = bytes(range(256)) * 64
    tree = {"ids": ids, "odd": odd, "rec": record, "blob": blob, "small": b"\x00\x01",
            "empty": np.zeros((0, 4), dtype=np.float32), "scalar": np.array(7, dtype=np.uint16)}
    skeleton, tensors = encode_tree(tree)
    text = dumps_json(skeleton)
    assert len(text) < 2000 and set(tensors) == {"ids", "odd", "rec", "blob", "empty", "scalar"}
    back, _ = full_roundtrip(tree)
    for k in ("ids", "odd", "rec", "empty", "scalar"):
        assert back[k].dtype == tree[k].dtype and back[k].shape == tree[k].shape
        assert back[k].tobytes() == tree[k].tobytes()
    assert back["blob"] == blob and back["small"] == b"\x00\x01"
    back["ids"][0] = 5  # a writable array
    with pytest.raises(UnsupportedValue, match="structured"):
        encode_tree({"rec": np.zeros(3, dtype=[("a", "<i4"), ("b", "S3")])})


def test_inline_base64_arrays_written_before_still_decode():
    import base64

    arr = np.arange(6, dtype="<u4").reshape(2, 3)
    skeleton = {TAG: "ndarray", "dtype": "<u4", "shape": [2, 3],
                "v": base64.b64encode(arr.tobytes()).decode()}
    assert np.array_equal(decode_tree(skeleton, {}), arr)


def test_surrogate_strings_round_trip_in_json_and_tensor_keys():
    name = "shard-\udcff.bin"  # what os.fsdecode makes of an undecodable file name
    tree = {name: torch.ones(2), "path": name, "nested": {name: [name]}}
    skeleton, tensors = encode_tree(tree)
    for key in tensors:
        key.encode("utf-8")  # every tensor key is valid UTF-8 for any safetensors reader
    data = dumps_json(skeleton)
    assert decode_tree(loads_json(data, "x", 1 << 20), tensors) is not None
    back, _ = full_roundtrip(tree)
    assert back["path"] == name and back["nested"] == {name: [name]}
    assert torch.equal(back[name], torch.ones(2))


@pytest.mark.parametrize("name", ["nn", "testing", "distributed", "Tensor", "float128",
                                  "__class__", "qint8", ["float32"], 5], ids=repr)
def test_dtype_names_come_from_a_fixed_table_never_getattr(name):
    import sys

    before = set(sys.modules)
    skeleton = {TAG: "dtype", "v": name}
    with pytest.raises(CorruptCheckpoint, match="unknown torch dtype"):
        decode_tree(skeleton, {})
    assert set(sys.modules) == before  # no module imported by a name read from a file


@pytest.mark.parametrize("skeleton", [
    {TAG: "size", "v": [2 ** 70]}, {TAG: "size", "v": [-1]}, {TAG: "size", "v": [1.5]},
    {TAG: "ndarray", "dtype": "<f4", "shape": [-1], "v": ""},
    {TAG: "ndarray", "dtype": "<f4", "shape": [3], "v": "AAAA"},
    {TAG: "ndarray", "dtype": "O", "shape": [1], "v": "AAAAAAAAAAA="},
    {TAG: "ndarray", "dtype": "<f4", "shape": [1], "key": "absent"},
    {TAG: "npscalar", "dtype": "<f8", "v": "AAAA"},
    {TAG: "tensor", "key": "t", "dtype": "float32", "shape": [-1]},
    {TAG: "tensor", "key": "t", "dtype": "float32", "shape": [3]},
    {TAG: "tensor", "key": ["t"]},
], ids=repr)
def test_out_of_range_shapes_and_sizes_are_corruption(skeleton):
    with pytest.raises(CorruptCheckpoint):
        decode_tree(skeleton, {"t": torch.zeros(8, dtype=torch.uint8)})


@pytest.mark.parametrize("text", [b"1e999", b"[-1e999]", b'{"a": 1e400}', b"1" + b"0" * 5000])
def test_numbers_out_of_range_are_corruption(text):
    with pytest.raises(CorruptCheckpoint):
        loads_json(text, "state.json", 1 << 20)


def test_the_writer_refuses_a_header_the_reader_would_refuse(monkeypatch):
    import unbroken.state.tensorfile as tensorfile

    monkeypatch.setattr(tensorfile, "MAX_HEADER_BYTES", 4096)
    tensors = {f"t{i:04d}": torch.zeros(1) for i in range(200)}
    with pytest.raises(UnsupportedValue, match="safetensors header, over the 4096-byte limit"):
        encode_safetensors(tensors)


# ---------------------------------------------------------------------------------------------
# what the small-tensor fast paths must keep (found by review of those paths)


@pytest.mark.parametrize("kind", [dict, "odict"])
def test_a_tensor_leaf_past_the_depth_limit_is_refused_at_save(kind):
    """The fast path for tensor leaves must keep the depth limit that decoding applies:
    else a generation saves and is then refused by every restore."""
    from collections import OrderedDict

    node = {"w": torch.ones(2)} if kind is dict else OrderedDict(w=torch.ones(2))
    for _ in range(MAX_DEPTH):
        node = {"a": node}
    with pytest.raises(UnsupportedValue, match="deeper"):
        encode_tree(node)


@pytest.mark.parametrize("offset", range(1, 8))
def test_unaligned_bool_tensors_keep_their_bytes(offset):
    """A tensor the decoder copies (not 64-byte aligned) is copied as bytes: a bool tensor
    holding bytes other than 0 and 1 (a mask made with .view(torch.bool)) comes back as it
    was saved, as an aligned one does."""
    raw = torch.tensor([0, 1, 2, 255, 7], dtype=torch.uint8)
    tensors = {"a_pad": torch.ones(offset, dtype=torch.uint8), "mask": raw.view(torch.bool)}
    blob = b"".join(encode_safetensors(tensors))
    # a writable 64-byte aligned buffer, as the store reads a file: tensors decode as views
    # where aligned and as copies elsewhere
    buf = np.empty(len(blob) + 64, dtype=np.uint8)
    start = -buf.ctypes.data % 64
    view = memoryview(buf)[start:start + len(blob)]
    view[:] = blob
    got, _ = decode_safetensors(view, "part.safetensors")
    assert got["mask"].data_ptr() % 64 == 0  # the copy
    assert tensor_bytes(got["mask"]) == raw.numpy().tobytes()


def test_a_conjugate_view_is_stored_with_its_own_values():
    x = torch.randn(3, dtype=torch.complex64)
    tree = {"x": x, "c": x.conj()}
    got, _ = full_roundtrip(tree)
    assert torch.equal(got["x"], x) and torch.equal(got["c"], x.conj().resolve_conj())
    assert got["c"] is not got["x"]


@pytest.mark.parametrize("skeleton,tensors", [
    ({TAG: "ndarray", "dtype": "<u4", "shape": [10 ** 11], "key": "k"},
     {"k": torch.zeros(2496, dtype=torch.uint8)}),
    ({TAG: "tensor", "key": "k", "dtype": "complex128", "shape": [5]},
     {"k": torch.zeros(16, dtype=torch.uint8)}),
    ({TAG: "tensor", "key": "k", "dtype": "torch.float99", "shape": [1]},
     {"k": torch.zeros(16, dtype=torch.uint8)}),
    ({TAG: "dtype", "v": "torch.float99"}, {}),
], ids=["ndarray-shape", "raw-shape", "raw-dtype", "dtype"])
def test_a_malformed_shape_or_dtype_names_the_file(skeleton, tensors):
    """(An outside attack, session 40: "ndarray: shape [100000000000] does not hold 624
    elements" named neither the file nor the generation.)"""
    with pytest.raises(CorruptCheckpoint, match=r"^gen-000000003/state\.json \[rng\]: "):
        decode_tree({"x": skeleton}, tensors, "gen-000000003/state.json [rng]")
