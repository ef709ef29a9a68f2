"""Pure bytes codec for safetensors, writing side: named CPU tensors -> one buffer (header
first; `tensorread` reads it back, after a strict validation of its header). Nothing here
touches files; the store reads and writes them (see DESIGN.md: a pure bytes codec split from
file I/O, as safetensors does)."""

from __future__ import annotations

import ctypes
import json
import math
import operator
import struct
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import xxhash

from ..errors import UnsupportedValue
from .stheader import ITEMSIZE, MAX_HEADER_BYTES
from .stheader import read_safetensors_header as read_safetensors_header

# safetensors dtype names; dtypes outside this table are stored as raw bytes (U8) with
# the real dtype and shape kept in the skeleton reference.
ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
_ST_BY_NAME = {v: k for k, v in ST_DTYPES.items()}
_ITEMSIZE = ITEMSIZE
_ITEMSIZE_OF = {dt: _ITEMSIZE[name] for name, dt in _ST_BY_NAME.items()}
_DTYPE, _DATA_PTR = operator.attrgetter("dtype"), torch.Tensor.data_ptr
# Small tensors of one shape and dtype are stacked this many at a time, each stack checked
# right after it while its tensors' metadata is in the cache (after an update, 10,000 small
# tensors' is not: their dtypes read before a stack of all cost ~2 ms more). The async
# snapshot's plans (`persist.plans`) copy and check their tensors so too.
CHUNK = 128
_SMALL = 64 * 1024  # tensors up to this size are gathered into one chunk per run of a dtype
_STACKED = 8  # this many small tensors of one dtype and shape in a row: copied by one stack
_json_key = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]  # C, as dumps'
# Room for a chunk of ``n`` bytes the encoder builds itself (a run of gathered small tensors):
# a writable buffer of exactly ``n`` bytes, or None for memory of its own (`encode_safetensors`).
# One may also have ``mark()`` (where its next gift starts) and ``rewind(mark)`` (the gifts
# from there on are unused: a file refused midway, `PlanUnfit`), see `rewinding`.
Room = Callable[[int], memoryview | None]


def rewinding(room: Room | None) -> Callable[[], None] | None:
    """For a room that can rewind: what gives its gifts from now on again (those of a file
    refused midway, built again); None for any other."""
    mark = getattr(room, "mark", None)
    if mark is None:
        return None
    at = mark()
    return lambda: room.rewind(at)  # type: ignore[union-attr]


class PlanUnfit(Exception):
    """A tensor an encoding plan took unchecked (`codec.encode_tree_for_file` with
    ``defer``) is not what the plan expects: another shape, device, a lazy bit, not
    contiguous. Its tree is encoded again without plans (never raised beyond that)."""


def encode_safetensors(tensors: Mapping[str, torch.Tensor],
                       metadata: Mapping[str, str] | None = None,
                       data_hash_key: str | None = None, prepared: bool = False,
                       layout: dict[str, Any] | None = None,
                       kinds: list[tuple[str, torch.dtype, torch.Size]] | None = None,
                       ptrs: list[int] | None = None, room: Room | None = None,
                       unchecked: bool = False) -> list[memoryview]:
    """Serialize to the safetensors format as a list of buffers (header first), without
    concatenating them, so the store can hash and write them straight from tensor memory.
    With ``data_hash_key``, the xxh3-128 of the data section is stamped into the metadata
    (a single file that carries its own checksum). ``prepared``: the tensors are on the
    CPU and without a lazy negative or conjugate bit, as `codec.encode_tree` returns
    them (only their contiguity is still checked). ``kinds`` and ``ptrs``: besides, each
    tensor's (key, dtype, shape) and data address, in order, and every tensor contiguous
    (`codec.encode_tree_for_file`). ``room``: where the chunks of gathered small tensors are
    built (a process-mode save builds them in its shared memory: no copy at the hand-over);
    the chunks it gave are returned as the very buffers it gave. ``layout``: a dict kept
    from one call to the next (a Checkpointer's saves of one file) in which the order and
    header of the last call's tensors are kept, and used again while their keys, dtypes and
    shapes stay the same (the bytes are those of a call without it); without ``room``, the
    buffers the small tensors are gathered into are kept there too, and the next call
    gathers into them again: the caller is done with the last call's chunks by then.
    ``unchecked`` (with ``kinds`` and ``ptrs``): the tensors' addresses, dtypes, shapes,
    devices, lazy bits and contiguity may not be what they are said to be (`codec.Encoded`):
    each is checked as it is copied, a stretch stacked by ``torch.stack`` (which refuses
    another device and unequal shapes, and copies values, not memory) by its addresses and
    its first tensor's shape before the stack and its dtypes after; `PlanUnfit` if one does
    not fit."""
    # Tensors of a multiple of 64 bytes first (the data section starts 64-aligned, so each of
    # them stays 64-aligned and loads as a view, see decode_safetensors); then largest element
    # size first, which keeps every tensor aligned to its element size; then by shape (small
    # tensors of one shape and dtype, side by side, are copied by one ``torch.stack``, see
    # `_gather`); then by key (the same tensors give the same bytes in any order).
    # (Per-tensor costs matter: 10,000 small tensors are common, so each tensor's attributes
    # are read once, with the cheapest torch call that gives each.)
    if kinds is None:
        values, kinds, ptrs = [], [], None
        for key, t in tensors.items():
            if not prepared:
                if t.requires_grad:
                    t = t.detach()
                if not t.is_cpu:
                    t = t.cpu()
                if t.is_neg() or t.is_conj():  # lazy views: their memory is not their values
                    t = t.resolve_conj().resolve_neg()
            if not t.is_contiguous():
                t = t.contiguous()
            values.append(t)
            kinds.append((key, t.dtype, t.shape))
    else:
        values = list(tensors.values())
    if layout is not None and layout.get("sig") == kinds:
        body, chunking = layout["body"], layout["chunking"]
    else:
        # (unchecked: the sizes the tensors are said to have, each then checked as it is
        # copied; a tensor found empty would have no chunk, and be checked by none)
        sizes = ([math.prod(shape) * _ITEMSIZE_OF[d] for _, d, shape in kinds] if unchecked
                 else [t.nbytes for t in values])
        rank = [((n % 64 != 0) << 8 | 16 - _ITEMSIZE_OF[d], tuple(shape), k)
                for (k, d, shape), n in zip(kinds, sizes)]
        order = sorted(range(len(rank)), key=rank.__getitem__)
        body = _header_body([(kinds[i], sizes[i]) for i in order]).encode("utf-8")
        chunking = _chunking(order, kinds, sizes)
        if layout is not None:
            layout.update(sig=kinds, body=body, chunking=chunking, gathered={})
    # (fresh memory for 300 MB of small tensors costs more to fault in than to fill: a
    # save of them took 2.5x longer than with the buffers reused)
    reused = layout.setdefault("gathered", {}) if layout is not None and room is None else None
    expected = ptrs if unchecked else None  # the addresses to check (with ``unchecked``)
    if unchecked and expected is None:
        raise ValueError("encode_safetensors(unchecked=True) needs the tensors' ptrs")
    chunks = [tensor_bytes(values[c] if expected is None
                           else _fit(values[c], *kinds[c][1:], expected[c]))
              if type(c) is int else _gather(c, values, ptrs, room, reused, i, expected)
              for i, c in enumerate(chunking)]
    meta = dict(metadata or {})
    if data_hash_key:
        h = xxhash.xxh3_128()
        for chunk in chunks:
            h.update(chunk)
        meta[data_hash_key] = h.hexdigest()
    tail = (b"," if body else b"") + b'"__metadata__":' + json.dumps(
        meta, separators=(",", ":")).encode("utf-8") if meta else b""
    size = len(body) + len(tail) + 2
    size += -(8 + size) % 64  # the data section starts 64-byte aligned
    if size > MAX_HEADER_BYTES:  # what read_safetensors_header refuses is never written
        raise UnsupportedValue(
            f"{len(tensors)} tensors need a {size}-byte safetensors header, over the "
            f"{MAX_HEADER_BYTES}-byte limit readers apply; store fewer, larger tensors")
    # (one copy of the body, kept with the layout: 10,000 entries are ~0.7 MB of text)
    header = b"".join((struct.pack("<Q", size), b"{", body, tail, b"}",
                       b" " * (size - len(body) - len(tail) - 2)))
    return [memoryview(header), *chunks]


def _header_body(items: list[tuple[tuple[str, torch.dtype, torch.Size], int]]) -> str:
    """The header's entries, as JSON text, of ``items`` ((key, dtype, shape), size) in their
    order in the data section (json.dumps of 10,000 dicts costs more than this)."""
    entries: list[str] = []
    offset = 0
    kinds: dict[tuple[torch.dtype, torch.Size], str] = {}  # (few distinct ones: reused)
    for (key, dtype, shape), nbytes in items:
        kind = kinds.get((dtype, shape))
        if kind is None:
            if len(shape) > 64 or math.prod(d or 1 for d in shape) >= 1 << 62:
                # (what `read_header` refuses is never written: a save must read back)
                raise UnsupportedValue(
                    f"tensor {key!r} of shape {list(shape)}: safetensors readers take at most "
                    "64 dimensions whose sizes (zeros as 1) multiply to under 2**62; reshape "
                    "it, or keep it out of the saved state")
            kind = kinds[dtype, shape] = (f'"dtype":"{ST_DTYPES[dtype]}","shape":'
                                          f'[{",".join(map(str, shape))}]')
        entries.append(f'{_json_key(key)}:{{{kind},"data_offsets":[{offset},'
                       f'{offset + nbytes}]}}')
        offset += nbytes
    return ",".join(entries)


# (take, indices, dtype, shape, bytes each): see `_Run`
_Stretch = tuple[Callable[[list[Any]], Any] | None, list[int], torch.dtype, torch.Size,
                 int]


class _Run(NamedTuple):
    """Consecutive small tensors of a layout, copied into one chunk of ``nbytes``: each part
    ``(take, indices, dtype, shape, size)`` a stretch of tensors of one dtype and shape
    (``size`` bytes each), by one ``torch.stack`` of ``take(values)`` when it holds
    ``_STACKED`` or more (``take`` None: a ``memmove`` each)."""

    nbytes: int
    parts: list[_Stretch]


def _chunking(order: list[int], kinds: list[tuple[str, torch.dtype, torch.Size]],
              sizes: list[int]) -> list[int | _Run]:
    """How a layout's tensors (``order``) become chunks: a tensor over ``_SMALL`` bytes its
    own (its index), a run of smaller ones one gathered chunk (`_Run`); empty ones none.
    Made with the layout and kept with it: a save of an unchanged layout only copies."""
    chunking: list[int | _Run] = []
    run: list[int] = []
    for i in [*order, -1]:  # (-1: the end, which closes the last run)
        if i >= 0 and not sizes[i]:
            continue
        if i >= 0 and sizes[i] <= _SMALL:
            run.append(i)
            continue
        if run:
            parts: list[_Stretch] = []
            j = 0
            while j < len(run):
                _, dtype, shape = kinds[run[j]]
                k = j + 1
                while k < len(run) and kinds[run[k]][1:] == (dtype, shape):
                    k += 1
                stretch = run[j:k]
                take = operator.itemgetter(*stretch) if len(stretch) >= _STACKED else None
                parts.append((take, stretch, dtype, shape, sizes[run[j]]))
                j = k
            chunking.append(_Run(sum(sizes[x] for x in run), parts))
            run = []
        if i >= 0:
            chunking.append(i)
    return chunking


def _gather(run: _Run, values: list[torch.Tensor], ptrs: list[int] | None,
            room: Room | None = None, reused: dict[int, torch.Tensor] | None = None,
            index: int = 0, expected: list[int] | None = None) -> memoryview:
    """The bytes of a run of small contiguous CPU tensors (the caller holds them), one after
    the other, in one buffer (``room``'s, when it gives one; else ``reused[index]``, made
    when missing, if ``reused`` is given): a stretch of one dtype and shape by one
    ``torch.stack`` into its place (~0.3 us a tensor), the others by a ``memmove`` each
    (~1 us; twice as fast as torch's ``flatten_dense_tensors``, which makes a view of
    each). ``expected``: the tensors' addresses, each checked with the rest of what
    `encode_safetensors` with ``unchecked`` checks."""
    given = None if room is None else room(run.nbytes)
    if given is not None:
        out = torch.frombuffer(given, dtype=torch.uint8)
    elif reused is None:
        out = torch.empty(run.nbytes, dtype=torch.uint8)  # (not zeroed first)
    elif index in reused:  # (made for this run of this layout: its size)
        out = reused[index]
    else:
        out = reused[index] = torch.empty(run.nbytes, dtype=torch.uint8)
    base, move = out.data_ptr(), ctypes.memmove
    at = 0
    for take, stretch, dtype, shape, n in run.parts:
        if take is not None and _stacked(take(values), out[at:at + len(stretch) * n], dtype,
                                         shape, None if expected is None else take(expected)):
            at += len(stretch) * n
            continue
        for x in stretch:
            if expected is not None:
                _fit(values[x], dtype, shape, expected[x])
            move(base + at, values[x].data_ptr() if ptrs is None else ptrs[x], n)
            at += n
    return tensor_bytes(out) if given is None else given


def _fit(t: torch.Tensor, dtype: torch.dtype | None, shape: torch.Size, ptr: int = 0
         ) -> torch.Tensor:
    """``t``, checked for what `encode_safetensors` with ``unchecked`` copies it as: of
    ``shape``, and (``dtype`` None: the first of a stack, which copies values, from any
    device it accepts, its dtypes and addresses checked by `_stacked`) a contiguous CPU
    tensor of ``dtype`` without a lazy bit (complex dtypes are never planned: no conj bit)
    whose data is at ``ptr``. `PlanUnfit` if not."""
    try:
        if t.shape == shape and (dtype is None or t.dtype is dtype and t.is_cpu
                                 and not t.is_neg() and t.is_contiguous()
                                 and t.data_ptr() == ptr):
            return t
    except (RuntimeError, NotImplementedError):  # (an exotic tensor: encoded one at a time)
        pass
    raise PlanUnfit


def _stacked(tensors: tuple[torch.Tensor, ...] | list[torch.Tensor], into: torch.Tensor,
             dtype: torch.dtype, shape: torch.Size, ptrs: tuple[int, ...] | None = None
             ) -> bool:
    """``tensors`` (of ``dtype`` and ``shape``) copied side by side into the bytes ``into``,
    `CHUNK` at a time; False (some maybe copied) for a dtype torch cannot stack on the CPU
    (a float8), or a stack that fails: the caller copies them one at a time. ``ptrs``: the
    addresses they are expected at, unchecked otherwise (see `encode_safetensors`): before
    each stack, its tensors' addresses (a stack reads a freed storage's null address) and
    its first tensor's shape are checked (a stack resizes an ``out`` of another shape, and
    checks the others by its first), and after it their dtypes (a stack casts), while its
    tensors are in the cache; `PlanUnfit` if one does not fit."""
    rows = into.view(dtype).view(len(tensors), *shape)
    try:
        with torch.no_grad():  # (a parameter's history is not the file's)
            for lo in range(0, len(tensors), CHUNK):
                part = tensors[lo:lo + CHUNK]
                if ptrs is not None:
                    if tuple(map(_DATA_PTR, part)) != ptrs[lo:lo + CHUNK]:
                        raise PlanUnfit
                    _fit(part[0], None, shape)
                torch.stack(part, out=rows[lo:lo + len(part)])
                if ptrs is not None and list(map(_DTYPE, part)).count(dtype) != len(part):
                    raise PlanUnfit
    except (RuntimeError, NotImplementedError, TypeError):  # (TypeError: a complex member)
        return False
    return True


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy: a writable view (a restore reads
    into it) that keeps its storage alive (a parameter given other data meanwhile, ``p.data =
    ...``, leaves it to the view). Viewed through ctypes, not NumPy: ``numpy()`` marks a
    storage non-resizable for good, and FSDP's ``untyped_storage().resize_(0)`` of a parameter
    a save or a restore had read then raised; so a caller keeps no view past a point where
    user code may resize the storage."""
    if not t.is_contiguous():  # (its bytes in memory are not its values in order)
        raise ValueError(f"tensor_bytes of a tensor of strides {t.stride()}: not contiguous")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    raw = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    raw._storage = t.untyped_storage()  # type: ignore[attr-defined]  # (held by the view)
    return memoryview(raw).cast("B")
