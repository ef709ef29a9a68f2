"""Content digests of state trees, for traces: fast, stable, and never via repr or any
serializer."""

from __future__ import annotations

import contextvars
import struct
from array import array
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import xxhash

from .freed import shortfall
from .tensorfile import tensor_bytes


def _numpy_chars() -> dict[torch.dtype, bytes]:
    """The NumPy type character of each dtype NumPy has: a tensor's digest ends with it (as
    when digests read tensors through ``numpy()``, which made their storages non-resizable)."""
    out = {}
    for dtype in (torch.float64, torch.float32, torch.float16, torch.int64, torch.int32,
                  torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32,
                  torch.uint64, torch.bool, torch.complex64, torch.complex128):
        try:
            out[dtype] = torch.empty(0, dtype=dtype).numpy().dtype.char.encode()
        except TypeError:  # (a torch without NumPy's view of it)
            pass
    return out


_NUMPY_CHAR = _numpy_chars()
# Digests as unbroken made them before 2026-12-05 (next-step fixtures of schema 1 hold them):
# a contiguous tensor off the CPU was hashed in an "X" form of its memory; it now digests as
# the CPU tensor of its values does (a GPU run's digests then differed by layout alone).
_DEVICE_FORM_1: contextvars.ContextVar[bool] = contextvars.ContextVar("device_form_1",
                                                                      default=False)


@contextmanager
def device_form_1() -> Iterator[None]:
    """Digest tensors off the CPU as unbroken did before 2026-12-05 (see `_DEVICE_FORM_1`):
    to compare with digests recorded then."""
    token = _DEVICE_FORM_1.set(True)
    try:
        yield
    finally:
        _DEVICE_FORM_1.reset(token)


def _feed(h: Any, obj: Any) -> None:
    """Hash a canonical, type-tagged byte form of ``obj`` (no repr: stable across versions).
    Tensors come first: a trace digests hundreds of them per update."""
    kind = type(obj)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        char = _NUMPY_CHAR.get(obj.dtype)
        try:  # ~1 us: a contiguous CPU tensor of a NumPy dtype, its bytes and that dtype
            strided = obj.is_cpu and obj.layout is torch.strided
            if strided and shortfall(obj, obj.data_ptr()) is not None:
                # (its storage freed or shrunk under it, FSDP's between two passes: its bytes
                # are not there to read, and reading them crashed the process)
                h.update(b"U%s%s;" % (str(obj.dtype).encode(), str(tuple(obj.shape)).encode()))
                return
            if (char is not None and strided and not obj.is_neg() and not obj.is_conj()
                    and obj.is_contiguous() and not obj.is_nested):
                h.update(tensor_bytes(obj))
                h.update(char)
                return
        except (RuntimeError, TypeError, ValueError):
            pass
        _feed_values(h, obj.detach(), char)
    elif obj is None or kind is bool:
        h.update(b"N" if obj is None else b"T" if obj else b"F")
    elif kind is int:
        h.update(b"I%d;" % obj)
    elif kind is float:
        h.update(b"D" + struct.pack("<d", obj))
    elif kind is str:  # (a lone surrogate, which os.fsdecode makes, as its own code unit)
        data = obj.encode("utf-8", "surrogatepass")
        h.update(b"S%d;" % len(data) + data)
    elif isinstance(obj, Mapping):
        h.update(b"M%d;" % len(obj))
        keys = list(obj)
        if not all(type(k) is str for k in keys):
            keys.sort(key=lambda k: (type(k).__name__, str(k)))
        else:
            keys.sort()
        for key in keys:
            _feed(h, key)
            _feed(h, obj[key])
    elif kind is tuple or kind is list or kind is torch.Size:
        try:  # fast path for the 625-word Mersenne state: one packed buffer, no Python loop
            packed = array("Q", obj)
        except (TypeError, OverflowError):
            h.update(b"L%d;" % len(obj))
            for item in obj:
                _feed(h, item)
        else:
            h.update(b"Q%d;" % len(obj) + packed.tobytes())
    elif isinstance(obj, torch.Tensor) and obj.is_nested:  # (jagged: a subclass of its own)
        _feed_values(h, obj.detach(), None)
    elif isinstance(obj, torch.Tensor):  # a Tensor subclass
        local = getattr(obj, "to_local", None)  # a DTensor: this rank's chunk (traces are
        if local is not None:  # per rank)
            _feed(h, local())
            return
        try:
            plain = obj.as_subclass(torch.Tensor)
        except (RuntimeError, NotImplementedError, TypeError, RecursionError):
            plain = None
        if type(plain) is not torch.Tensor:  # (a wrapper of others' data: FakeTensor, NF4)
            raise TypeError(f"cannot digest a {type(obj).__qualname__}: a tensor subclass "
                            "without data of its own")
        _feed(h, plain)
    elif isinstance(obj, (np.ndarray, np.generic)):
        arr = np.ascontiguousarray(obj)
        h.update(f"A{arr.dtype.str}{arr.shape};".encode())
        h.update(arr.tobytes())
    elif kind is bytes:
        h.update(b"B%d;" % len(obj) + obj)
    elif isinstance(obj, (torch.dtype, torch.device)):
        h.update(f"T{obj};".encode())
    else:
        raise TypeError(f"cannot digest a state value of type {type(obj).__qualname__}")


def _feed_values(h: Any, t: torch.Tensor, char: bytes | None) -> None:
    """Hash a tensor the fast path of `_feed` does not take by its values, so that equal
    values digest equally whatever their form: on the CPU, lazy negation and conjugation
    applied, contiguous (then as the fast path does, where NumPy has the dtype); a sparse
    one as its coalesced indices and values, a nested one as its pieces, a quantized one as
    its integers and quantization, one without data (meta) by its dtype and shape. (A trace
    digests every batch and every part's state: a form torch cannot view as bytes must not
    stop the training loop, and a restored tensor, always plain, must digest as the live
    view it was saved from.)"""
    if t.device.type == "meta":  # (no values: as a tensor whose storage was freed)
        h.update(b"U%s%s;" % (str(t.dtype).encode(), str(tuple(t.shape)).encode()
                              if not t.is_nested else b"nested"))
        return
    if t.is_nested:  # (its pieces, each with its shape: the splits are part of its value)
        pieces = t.unbind()
        h.update(b"J%d;" % len(pieces))
        for piece in pieces:
            _feed(h, piece.shape)
            _feed(h, piece)
        return
    if t.layout is not torch.strided:
        try:
            c = t.to_sparse_coo().coalesce()
        except (RuntimeError, NotImplementedError) as e:  # (coalesce of uint16, float8...)
            raise TypeError(f"cannot digest a tensor of layout {t.layout} and dtype "
                            f"{t.dtype} (torch: {str(e).splitlines()[0][:120]})") from None
        h.update(b"P%s%s;" % (str(t.dtype).encode(), str(tuple(t.shape)).encode()))
        _feed(h, c.indices())
        _feed(h, c.values())
        return
    if t.device.type != "cpu":
        t = t.cpu()
        if _DEVICE_FORM_1.get() and t.is_contiguous():
            _feed_x(h, t)
            return
    if t.is_quantized:
        h.update(b"Z%s%s;" % (str(t.dtype).encode(), str(t.qscheme()).encode()))
        if t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            _feed(h, (t.q_scale(), t.q_zero_point()))
        else:
            _feed(h, (t.q_per_channel_axis(), t.q_per_channel_scales(),
                      t.q_per_channel_zero_points()))
        _feed(h, t.int_repr())
        return
    if t.is_conj() or t.is_neg():  # (a view's memory is not its values)
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():  # (channels_last, slices: the values in order)
        t = t.contiguous()
    if char is not None:  # (as the fast path: a view digests as the tensor it equals)
        h.update(tensor_bytes(t))
        h.update(char)
        return
    _feed_x(h, t)


def _feed_x(h: Any, t: torch.Tensor) -> None:
    """A contiguous CPU tensor of a dtype NumPy has not (bfloat16, float8): its dtype, shape
    and bytes."""
    h.update(b"X%s%s;" % (str(t.dtype).encode(), str(tuple(t.shape)).encode()))
    h.update(tensor_bytes(t))


def digest_tree(obj: Any) -> str:
    """A 64-bit content digest of a state tree: equal trees give equal digests."""
    h = xxhash.xxh3_64()
    _feed(h, obj)
    return h.hexdigest()




def digest_modules(modules: list[torch.nn.Module]) -> tuple[str, str | None, str]:
    """Digests of ``modules`` (``list(model.modules())``, built once by the caller: walking
    the module tree costs more than hashing a small model): (parameters and persistent
    buffers: what a generation saves; non-persistent buffers, or None when there are none:
    caches a module rebuilds, never saved; the train/eval mode of every module)."""
    saved, rebuilt = xxhash.xxh3_64(), xxhash.xxh3_64()
    modes = bytearray()
    any_rebuilt = False
    for m in modules:
        for p in m._parameters.values():
            if p is not None:
                _feed(saved, p.data)
        skip = m._non_persistent_buffers_set
        for name, b in m._buffers.items():
            if b is None:
                continue
            if name in skip:
                any_rebuilt = True
                rebuilt.update(name.encode())
                _feed(rebuilt, b.data)
            else:
                _feed(saved, b.data)
        modes.append(m.training)
    return (saved.hexdigest(), rebuilt.hexdigest() if any_rebuilt else None,
            xxhash.xxh3_64(bytes(modes)).hexdigest())


def digest_optimizer(optimizer: torch.optim.Optimizer, moments: bool = True) -> str:
    """Digest of an optimizer's hyperparameters (but the learning rate) and per-parameter
    state, in group order.

    ``moments=False`` is the cheap per-update form: hyperparameters, how many parameters have
    state, and the scalar entries (step counts) of each group's first parameter, which is
    enough to see a lost, reset or shifted optimizer at every update."""
    h = xxhash.xxh3_64()
    h.update(b"%d;" % len(optimizer.state))
    for group in optimizer.param_groups:
        # The rate is traced apart, as the one the step applied; a scheduler moves it after
        # the step, so here it would show a lost scheduler one update early, as the optimizer.
        _feed(h, {k: v for k, v in group.items() if k not in ("params", "lr")})
        for p in group["params"] if moments else group["params"][:1]:
            entry = optimizer.state.get(p)
            if not entry:
                h.update(b"-")
                continue
            for key in sorted(entry):
                value = entry[key]
                if not moments and isinstance(value, torch.Tensor) and value.dim() > 0:
                    continue
                h.update(key.encode())
                _feed(h, value)
    return h.hexdigest()
