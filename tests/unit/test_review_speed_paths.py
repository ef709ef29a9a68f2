"""Adversarial review of the speed commits 68aa8c2 (restore: a pool of threads copies large
tensors into the live state; safetensors views as one ``as_strided`` each of a per-dtype tensor;
tied views found by address first) and 83c7838 (save: small tensors gathered with a
``memmove`` each).

The tests marked DEFECT fail on the code under review; the others pin behaviour the attacks
could not break (bit-exact values, typed errors, no threads left behind)."""

from __future__ import annotations

import copy
import json
import struct
import threading

import numpy as np
import pytest
import torch

import unbroken
from unbroken import picking
from unbroken.errors import CorruptCheckpoint, UnbrokenError
from unbroken.picking import _MAP_MIN
from unbroken.state.codec import encode_tree
from unbroken.state.decoding import decode_tree
from unbroken.state.tensorfile import encode_safetensors
from unbroken.state.tensorread import decode_safetensors
from unbroken.store.backends import _mapped, _readahead

# A float32 tensor over the mapping threshold, a multiple of 64 bytes (so it sits aligned in
# the file and is copied by `MappedFiles.copy`, not cloned at decode) and not a multiple of the
# pool's 8 MiB pieces (the last piece is partial).
BIG = (_MAP_MIN + (4 << 20) + 64) // 4


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s values (NaN payloads and -0.0 included)."""
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _odd_floats(n: int) -> torch.Tensor:
    """Random float32 values with -0.0, a quiet NaN, and signalling NaN payloads, placed at
    the edges of the pool's pieces."""
    t = torch.randn(n)
    ints = t.view(torch.int32)
    t[0] = -0.0
    piece = _mapped._PIECE // 4
    for i, at in enumerate(range(piece - 1, n, piece)):
        ints[at] = 0x7FA00001 + i  # signalling NaN with a payload, last word of a piece
        if at + 1 < n:
            ints[at + 1] = -0x00400000 + i  # negative quiet NaN with a payload, first of next
    ints[n - 1] = 0x7F800001
    return t


class _Holder:
    """An extra whose state is whatever ``make`` returns, and which keeps what it loads."""

    def __init__(self, make):
        self.make, self.loaded = make, None

    def state_dict(self):
        return self.make()

    def load_state_dict(self, sd):
        self.loaded = sd


def _extra_round_trip(tmp_path, state, async_save=False) -> _Holder:
    """Save an extra whose state_dict() is ``state()``, restore it into a new one."""
    with unbroken.Checkpointer(tmp_path / "run", model=torch.nn.Linear(1, 1),
                               extras={"e": _Holder(state)}, async_save=async_save) as ckpt:
        ckpt.step_done(1)
        ckpt.save()
    back = _Holder(dict)
    with unbroken.Checkpointer(tmp_path / "run", model=torch.nn.Linear(1, 1),
                               extras={"e": back}) as ckpt:
        ckpt.restore()
    return back


def _roundtrip(tree, shift: int = 0):
    """``tree`` through the codec and the safetensors bytes, decoded from a writable buffer
    ``shift`` bytes past a 64-byte boundary (as `LocalFS.read_file(aligned=True)` gives at 0)."""
    skeleton, tensors = encode_tree(tree)
    raw = b"".join(bytes(b) for b in encode_safetensors(tensors))
    return _decode_at(raw, shift, skeleton)


def _decode_at(raw: bytes, shift: int, skeleton=None):
    store = np.zeros(len(raw) + 128, dtype=np.uint8)
    start = (-store.ctypes.data) % 64 + shift
    store[start:start + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    out, _ = decode_safetensors(memoryview(store[start:start + len(raw)]).cast("B"), "f")
    return out if skeleton is None else decode_tree(skeleton, out)


def _restore_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("unbroken-restore")]


# ---------------------------------------------------------------------------------------------
# DEFECTS


def test_gathered_small_tensor_with_the_negative_bit_keeps_its_sign(tmp_path):
    # DEFECT (83c7838): `_gather` (state/tensorfile.py:113-119) memmoves each small tensor's
    # raw memory from data_ptr(); a real tensor with the lazy negative bit (the imaginary part
    # of a conjugated complex tensor, contiguous when it has one element) is stored un-negated.
    # The encoder only resolves conj/neg for complex dtypes (state/codec.py:141), and the old
    # `flatten_dense_tensors` honoured the bit. Saved -2.0, restored +2.0, silently.
    # Expected: the value as it reads (-2.0).
    z = torch.tensor([1 + 2j], dtype=torch.complex64)
    model = torch.nn.Linear(2, 2)
    model.register_buffer("neg", z.conj().imag)  # tensor([-2.]), is_neg() True
    assert model.neg.is_neg() and model.neg.item() == -2.0
    with unbroken.Checkpointer(tmp_path / "run", model=model) as ckpt:
        ckpt.step_done(1)
        ckpt.save()
    other = torch.nn.Linear(2, 2)
    other.register_buffer("neg", torch.zeros(1))
    with unbroken.Checkpointer(tmp_path / "run", model=other) as ckpt:
        assert ckpt.restore() == 1
    assert other.neg.item() == -2.0


def test_a_lone_small_tensor_with_the_negative_bit_saves_or_is_refused_typed():
    # DEFECT (pre-existing, same root cause as above): alone in its run, such a tensor goes
    # to `tensor_bytes` (state/tensorfile.py:122-130), whose `.numpy()` raises torch's
    # RuntimeError ("Can't call numpy() on Tensor that has negative bit set") from deep
    # inside the save. Expected: stored with its value (the bit resolved first).
    n = torch.tensor(1 + 2j).conj().imag  # 0-d, -2.0, negative bit
    out = _roundtrip({"n": n})
    assert out["n"].item() == -2.0


@pytest.mark.parametrize("async_save", [False, True])
def test_a_negated_view_is_not_taken_for_the_view_it_negates(tmp_path, async_save):
    # DEFECT (pre-existing in `view_ident`, kept by the encoder's tie lookup in state/codec.py;
    # also persist/snapshot.py's tensor()): `z.imag` and `z.conj().imag` have the same
    # address, shape, strides and dtype; only is_neg() differs, and view_ident checks it for
    # complex dtypes only. The second is taken as a tie of the first: both restore as `z.imag`,
    # the negated one silently loses its sign. Expected: each restores its own values.
    z = torch.randn(4, dtype=torch.complex64)
    back = _extra_round_trip(tmp_path, lambda: {"im": z.imag, "neg": z.conj().imag},
                             async_save)
    assert torch.equal(back.loaded["im"], z.imag)
    assert torch.equal(back.loaded["neg"], -z.imag)


def _tensor_lr_run(tmp_path, n: int):
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(n))
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.01), momentum=0.9)
    model.w.square().sum().backward()
    opt.step()
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        ckpt.step_done(1)
        ckpt.save()
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        ckpt.restore()
    return opt


@pytest.mark.parametrize("n", [1 << 12, BIG], ids=["read-whole", "mapped"])
def test_a_scalar_in_the_param_groups_does_not_hold_a_copy_of_the_whole_file(tmp_path, n):
    # DEFECT (68aa8c2): `_views` (state/tensorfile.py:232-249) makes every tensor a view of
    # ONE storage spanning all the file's data of its dtype. torch deep-copies the saved
    # param_groups (optim.py:252, and torch's own load_state_dict): deepcopy of a tensor copies
    # its whole storage, so a 0-d lr tensor now carries a copy of the file's whole float32
    # region for the rest of the run (36 MiB for a 36 MiB momentum buffer; for a mapped file
    # every page of it is faulted in, against the restore's memory bound). Before, a tensor's
    # storage was its own bytes (`torch.frombuffer(count=...)`). Expected: a few bytes.
    opt = _tensor_lr_run(tmp_path, n)
    lr = opt.param_groups[0]["lr"]
    assert lr.item() == pytest.approx(0.01)
    held = lr.untyped_storage().nbytes()  # (a name: pytest would print the storage)
    assert held <= 64, held


def test_an_extra_that_deep_copies_what_it_loads_gets_its_tensors_not_the_whole_file(tmp_path):
    # DEFECT (68aa8c2, as above): `copy.deepcopy` of a loaded state is a common pattern in a
    # `load_state_dict`; each decoded tensor's storage is the whole float32 region of its file,
    # so a 16-byte tensor deep-copied costs a copy of every float32 of the file (1 MiB here).
    # Expected: the copy is the tensor's own bytes.
    big, small = torch.randn(1 << 18), torch.randn(4)
    back = _extra_round_trip(tmp_path, lambda: {"big": big, "small": small})
    kept = copy.deepcopy(back.loaded)["small"]
    assert torch.equal(kept, small)
    held = kept.untyped_storage().nbytes()
    assert held <= 64, held


def test_a_live_buffer_with_the_negative_bit_restored_from_a_mapped_file_reads_as_saved(
        tmp_path):
    # A live tensor that is a lazy negated view reads its memory negated: the restore's raw
    # read into a mapped file's destination (`MappedFiles.copy`) must go through copy_ there.
    n = BIG
    model = torch.nn.Linear(2, 2)
    # a contiguous lazy negation (what z.conj().imag is for one element): reads -0, -1, ...
    model.register_buffer("neg", torch._neg_view(torch.arange(n, dtype=torch.float32)))
    with unbroken.Checkpointer(tmp_path / "run", model=model) as ckpt:
        ckpt.step_done(1)
        ckpt.save()
    assert next((tmp_path / "run").glob("gen-*/model.safetensors")).stat().st_size >= _MAP_MIN
    other = torch.nn.Linear(2, 2)
    other.register_buffer("neg", torch._neg_view(torch.ones(n)))
    with unbroken.Checkpointer(tmp_path / "run", model=other) as ckpt:
        assert ckpt.restore() == 1
    assert other.neg.is_neg() and torch.equal(other.neg, -torch.arange(n, dtype=torch.float32))


# ---------------------------------------------------------------------------------------------
# Attacks that found nothing: pinned


def _big_model(values: torch.Tensor | None = None) -> torch.nn.Module:
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(BIG) if values is None else values)
    m.b = torch.nn.Parameter(torch.zeros(3) if values is None else torch.randn(3))
    # a contiguous view of the parameter, stored beside it (its own copy in the file)
    m.register_buffer("tail", m.w.detach()[BIG // 2:])
    return m


def test_a_mapped_restore_through_the_pool_is_bit_exact_and_leaves_no_thread(tmp_path):
    torch.manual_seed(0)
    model = _big_model(_odd_floats(BIG))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.w.grad = _odd_floats(BIG)
    model.b.grad = torch.ones(3)
    opt.step()  # NaN payloads in the momentum buffer as well
    with torch.no_grad():
        model.w.copy_(_odd_floats(BIG))
    saved = [t.clone() for t in (model.w, model.b, opt.state[model.w]["momentum_buffer"])]
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt) as ckpt:
        ckpt.step_done(1)
        ckpt.save()
    assert all(f.stat().st_size >= _MAP_MIN
               for f in (tmp_path / "run").glob("gen-*/[mo]*.safetensors"))
    other = _big_model()
    opt2 = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    other.w.grad, other.b.grad = torch.ones(BIG), torch.ones(3)
    opt2.step()  # live momentum buffers to copy into
    live = opt2.state[other.w]["momentum_buffer"]
    for _ in range(2):  # the same generation twice into the same objects
        with unbroken.Checkpointer(tmp_path / "run", model=other, optimizer=opt2) as ckpt:
            assert ckpt.restore() == 1
        got = [other.w, other.b, opt2.state[other.w]["momentum_buffer"]]
        assert all(_same_bits(a, b) for a, b in zip(saved, got, strict=True))
        assert opt2.state[other.w]["momentum_buffer"] is live  # copied into, not replaced
        assert other.tail.data_ptr() == other.w.data_ptr() + BIG // 2 * 4  # still a view
        assert _same_bits(other.tail, saved[0][BIG // 2:])
        assert _restore_threads() == []


@pytest.mark.parametrize("failing_in", ["pool", "main"])
def test_a_failed_read_raises_typed_and_a_later_restore_is_exact(tmp_path, monkeypatch,
                                                                 failing_in):
    # "main": a small tensor's read fails while the large one's pieces are still in the pool.
    # (The copies of a restore that hashes first: a job of many ranks, a warm start.)
    monkeypatch.setattr(picking, "MappedFiles", lambda defer=False: _mapped.MappedFiles())
    torch.manual_seed(0)
    model = _big_model(_odd_floats(BIG))
    with unbroken.Checkpointer(tmp_path / "run", model=model) as ckpt:
        ckpt.step_done(1)
        ckpt.save()
    read = _mapped._read_into
    pieces = []

    def failing(fd, into, offset):
        pool = threading.current_thread().name.startswith("unbroken-restore")
        pieces.append(pool)
        if pool == (failing_in == "pool"):
            raise OSError(5, "Input/output error")
        return read(fd, into, offset)

    monkeypatch.setattr(_mapped, "_read_into", failing)
    other = _big_model()
    with pytest.raises(UnbrokenError, match="partly restored"):
        with unbroken.Checkpointer(tmp_path / "run", model=other) as ckpt:
            ckpt.restore()
    assert any(pieces)  # the pool really ran
    assert _restore_threads() == []  # every reader ended before restore() raised
    monkeypatch.setattr(_mapped, "_read_into", read)
    with unbroken.Checkpointer(tmp_path / "run", model=other) as ckpt:
        assert ckpt.restore() == 1
    assert _same_bits(other.w, model.w) and _same_bits(other.b, model.b)


@pytest.mark.parametrize("at", [0, 3])
def test_a_failed_read_of_the_hashing_copy_refuses_typed_and_a_later_restore_is_exact(
        tmp_path, monkeypatch, at):
    """A read failing in the pass that hashes and copies at once (a continuation of one
    process) is a file gone bad, as in a hash pass: refused, naming the file (the only
    generation here: the restore raises, saying the live objects hold some of its bytes),
    no reader left behind, and the next restore, the disk healthy again, is exact."""
    torch.manual_seed(0)
    model = _big_model(_odd_floats(BIG))
    with unbroken.Checkpointer(tmp_path / "run", model=model) as ckpt:
        ckpt.step_done(1)
        ckpt.save()
    read, calls = _readahead._read_all, []

    def failing(fd, bufs, offset):
        calls.append(offset)
        if len(calls) > at:
            raise OSError(5, "Input/output error")
        return read(fd, bufs, offset)

    monkeypatch.setattr(_readahead, "_read_all", failing)
    other = _big_model()
    with pytest.raises(CorruptCheckpoint, match="no generation verifies") as caught:
        with unbroken.Checkpointer(tmp_path / "run", model=other) as ckpt:
            ckpt.restore()
    said = str(caught.value)
    assert "model.safetensors: unreadable ([Errno 5] Input/output error)" in said
    assert "hold bytes of" in said
    assert not [t for t in threading.enumerate() if t.name.startswith("unbroken-read-ahead")]
    assert (tmp_path / "run" / "gen-000000001").is_dir()  # (a refused restore moves nothing)
    monkeypatch.setattr(_readahead, "_read_all", read)
    with unbroken.Checkpointer(tmp_path / "run", model=other) as ckpt:
        assert ckpt.restore() == 1
    assert _same_bits(other.w, model.w) and _same_bits(other.b, model.b)


def _zoo() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    base = torch.randn(6, 5)
    f = torch.tensor([float("nan"), -0.0, 1.0, -1.0])
    f.view(torch.int32)[0] = 0x7FA00001
    return {
        "f64": torch.randn(3, dtype=torch.float64), "f32": f, "bf16": torch.randn(3).bfloat16(),
        "f16": torch.randn(5).half(), "bool": torch.tensor([True, False, True]),
        "u8": torch.arange(7, dtype=torch.uint8), "i8": torch.arange(-3, 2, dtype=torch.int8),
        "f8": torch.randn(3).to(torch.float8_e4m3fn),
        "f8fnuz": torch.randn(5).to(torch.float8_e5m2fnuz),  # raw bytes (no safetensors name)
        "c64": torch.randn(3, dtype=torch.complex64),
        "c128": torch.randn(3, dtype=torch.complex128),
        "conj": torch.randn(3, dtype=torch.complex64).conj(),
        "u16": torch.tensor([1, 2, 65535], dtype=torch.uint16),
        "u64": torch.tensor([1, 2, 3], dtype=torch.uint64),
        "empty": torch.empty(0, 3), "empty_view": base[6:], "scalar": torch.tensor(2.5),
        "i64_scalar": torch.tensor(7), "one": torch.tensor([[3.0]]),
        "base": base, "T": base.T, "every_other": base[::2], "offset": base[1:],
        "row": base[2], "expanded": torch.randn(1, 3).expand(4, 3),
        "as_int": base.view(torch.int32), "same_addr_other_shape": base.view(-1),
    }


@pytest.mark.parametrize("shift", range(9))
def test_every_layout_and_dtype_decodes_bit_exact_and_aligned_at_any_buffer_address(shift):
    tree = _zoo()
    out = _roundtrip(tree, shift)
    assert [k for k in tree if not _same_bits(tree[k], out[k])] == []
    # more than one element: 64-byte aligned (the vectorized kernels round as they did)
    assert [k for k, v in out.items() if v.numel() > 1 and v.data_ptr() % 64] == []


def test_the_same_view_twice_decodes_as_one_tensor_and_different_views_apart():
    w = torch.nn.Parameter(torch.randn(4, 4))
    out = _roundtrip({"w": w, "tied": w, "T": w.T, "flat": w.view(-1),
                      "bits": w.detach().view(torch.int32)})
    assert out["w"] is out["tied"]
    assert out["T"] is not out["w"] and _same_bits(out["T"], w.T)
    assert _same_bits(out["flat"], w.view(-1)) and _same_bits(out["bits"], w.view(torch.int32))


@pytest.mark.parametrize("shift", range(8))
def test_a_hand_written_file_with_offsets_off_their_element_size_decodes_exact(shift):
    f = np.array([1.5, np.nan, -0.0], dtype=np.float32)
    f.view(np.int32)[1] = 0x7FA00001
    data = b"\x07\x09" + f.tobytes() + np.float64(3.25).tobytes() + b"\x01"
    header = {"u": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
              "f": {"dtype": "F32", "shape": [3], "data_offsets": [2, 14]},
              "d": {"dtype": "F64", "shape": [], "data_offsets": [14, 22]},
              "b": {"dtype": "BOOL", "shape": [1, 1], "data_offsets": [22, 23]},
              "e": {"dtype": "F32", "shape": [0, 4], "data_offsets": [23, 23]}}
    raw = json.dumps(header).encode()  # unpadded: the data section starts anywhere
    out = _decode_at(struct.pack("<Q", len(raw)) + raw + data, shift)
    assert out["u"].tolist() == [7, 9]
    assert out["f"].view(torch.int32).tolist() == f.view(np.int32).tolist()
    assert out["d"].shape == () and out["d"].item() == 3.25
    assert out["b"].tolist() == [[True]] and out["e"].shape == (0, 4)
    assert out["f"].data_ptr() % 64 == 0


def test_colliding_and_reserved_keys_keep_their_own_values():
    tree = {"__metadata__": torch.full((2,), 1.0), "a.b": torch.full((2,), 2.0),
            "a": {"b": torch.full((2,), 3.0)}, "a.b#1": torch.full((2,), 4.0),
            "é": torch.full((2,), 5.0), "\udcff": torch.full((2,), 6.0),
            "\\udcff": torch.full((2,), 7.0)}
    out = _roundtrip(tree)
    assert out["a"]["b"].tolist() == [3.0, 3.0]
    assert {k: v[0].item() for k, v in out.items() if k != "a"} == {
        "__metadata__": 1.0, "a.b": 2.0, "a.b#1": 4.0, "é": 5.0, "\udcff": 6.0, "\\udcff": 7.0}


@pytest.mark.parametrize("async_save", [False, True])
def test_tied_weights_and_views_restore_bit_exact_over_repeated_saves(tmp_path, async_save):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(6, 4)
            self.lm_head = torch.nn.Linear(4, 6, bias=False)
            self.lm_head.weight = self.embed.weight

    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    z = torch.randn(4, dtype=torch.complex64)
    odd = _odd_floats(5)

    def views():
        w = model.embed.weight.detach()
        return {"T": w.T, "row": w[1], "bits": w.view(torch.int32), "w": w, "im": z.imag,
                "conj": z.conj(), "zero": w[6:], "odd": odd[1:]}

    torch.manual_seed(3)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               extras={"e": _Holder(views)}, async_save=async_save) as ckpt:
        for step in range(1, 4):  # buffers of an async save are reused from the second on
            model.lm_head(model.embed(torch.tensor([1, 2]))).sum().backward()
            opt.step()
            z.mul_(1j)
            ckpt.step_done(step)
            ckpt.save()
            ckpt.wait()
        saved = {k: v.clone() for k, v in views().items()}
        saved_model = {k: v.clone() for k, v in model.state_dict().items()}
        saved_opt = [v.clone() for s in opt.state.values() for v in s.values()]
    torch.manual_seed(1)
    other = Tied()
    opt2 = torch.optim.Adam(other.parameters(), lr=0.1)
    back = _Holder(dict)
    with unbroken.Checkpointer(tmp_path / "run", model=other, optimizer=opt2,
                               extras={"e": back}) as ckpt:
        assert ckpt.restore() == 3
    assert other.lm_head.weight is other.embed.weight
    assert all(_same_bits(v, other.state_dict()[k]) for k, v in saved_model.items())
    assert all(_same_bits(a, b) for a, b in zip(
        saved_opt, [v for s in opt2.state.values() for v in s.values()], strict=True))
    assert [k for k, v in saved.items() if not _same_bits(v, back.loaded[k])] == []
