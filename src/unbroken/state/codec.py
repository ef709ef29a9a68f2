"""Pure codec: a state tree -> (JSON skeleton, named tensors), and back in `decoding`. The
skeleton becomes text in `jsontext`, the named tensors safetensors bytes in `tensorfile`.

Nothing here touches files and nothing is ever pickled. The skeleton keeps Python types
exactly (int dict keys, tuples, bytes, None, NaN/inf, NumPy scalars and arrays); every tensor
leaf becomes a reference ``{"$t": "tensor", "key": ...}`` into the part's safetensors file.
"""

from __future__ import annotations

import base64
import math
import struct
from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import UnsupportedValue
from .encodeplans import Listed, Planning, _Plan
from .tensorfile import ST_DTYPES
from .views import address, view_ident

TAG = "$t"
MAX_DEPTH = 200
_INLINE_BYTES = 4096  # ``bytes`` values this large go to the tensor file, not into JSON
_STRIDED = torch.strided
_QUIET_NAN = 0x7FF8000000000000  # the bits of float("nan"), the sign bit aside
_BIG_INT = 1 << 1024  # JSON text of ints is refused past 4300 digits: larger ones go as hex
_COMPLEX = frozenset({torch.complex32, torch.complex64, torch.complex128})



# Every dtype a skeleton may name, resolved from this fixed list once: a name read from a file
# is only ever looked up here, never with getattr(torch, name) (which can import modules).
_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
    "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
)
_DTYPES: dict[str, torch.dtype] = {
    n: d for n in _DTYPE_NAMES if isinstance(d := getattr(torch, n, None), torch.dtype)}
_DTYPE_NAME_OF = {d: n for n, d in _DTYPES.items()}


def _float_bits(x: float) -> int:
    """The 64 bits of a Python float (a NaN's sign and payload among them)."""
    return int.from_bytes(struct.pack("<d", x), "little")


def _dtype_name(dtype: torch.dtype, path: str = "") -> str:
    name = _DTYPE_NAME_OF.get(dtype)
    if name is None:
        raise UnsupportedValue(f"{path}: tensors of dtype {dtype} cannot be stored (quantized "
                               "and sub-byte dtypes are not supported); convert them in "
                               "state_dict()")
    return name


def _utf8_key(path: str) -> str:
    """A tensor key any safetensors reader accepts: lone surrogates (from undecodable file
    names) are escaped; the skeleton's reference keeps the mapping."""
    try:
        path.encode("utf-8")
        return path
    except UnicodeEncodeError:
        return path.encode("utf-8", "backslashreplace").decode("utf-8")


# ---------------------------------------------------------------------------------------------
# state tree <-> skeleton + tensors

# Mapping types kept exactly (MultiStepLR's milestones are a Counter; module state_dicts are
# OrderedDicts). Any other Mapping subclass (defaultdict: its factory is code) is refused.
_MAPPINGS: dict[type, str] = {dict: "dict", OrderedDict: "odict", Counter: "counter"}
_MAPPING_TYPES: dict[str, Any] = {v: k for k, v in _MAPPINGS.items()}


_INT = frozenset({int})
_STR = frozenset({str})


class ShardedLeaf(UnsupportedValue):
    """A DTensor met in a tree given to the encoder whole: a save that skipped taking the
    sharded leaves out (`saving.encode_share`, while no save of its Checkpointer met one)
    takes them out and encodes again."""


class _Encoder(Planning):
    def __init__(self, plans: dict[str, _Plan] | None = None, owned: bool = False,
                 defer: bool = False) -> None:
        self.plans = plans  # by the mapping's path; kept by the caller from save to save
        self.owned = owned  # the tensors are buffers only their owner changes, never reshapes
        # A plan's tensors' shapes, devices, lazy bits and contiguity are left to the file's
        # encoder (``defer``); ``unchecked`` once a plan took some so (`Planning.planned`).
        self.defer, self.unchecked = defer, False
        # With plans: each planned mapping's place in the skeleton -> its JSON text.
        self.texts: dict[str, str] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.listed: Listed | None = None  # (the tensors while a plan took them all: `settle`)
        # Beside each stored tensor, in order: (key, dtype, shape) and its address, which
        # `encode_safetensors` would otherwise read again (~1 us a tensor for 10,000).
        self.kinds: list[tuple[str, torch.dtype, torch.Size]] = []
        self.ptrs: list[int] = []
        # Each view met and its reference, by address (a tensor without one: by -id): the
        # same view met twice (tied weights: two state_dict entries of one parameter) is
        # stored once. `view_ident`, four more torch calls, only tells apart two views of one
        # address, which is rare. (One view per address is a ``(tensor, ref)`` pair; a list
        # only for the rare second one.)
        self._views: dict[int, Any] = {}
        # The views a plan took, not copied into ``_views`` (`Planning.planned`): (address ->
        # index, the tensors, their references) for each.
        self._placed: list[tuple[dict[int, int], list[Any], list[dict[str, Any]]]] = []
        self.met: set[str] = set()  # the paths of the mappings this encoding met by plan

    def settle(self) -> None:
        """The tensors a plan took alone (``listed``) into ``tensors``, before another one
        is stored: every key is then found there."""
        if self.listed is not None:
            self.tensors.update(self.listed.items())
            self.listed = None

    def stored(self) -> Mapping[str, torch.Tensor]:
        """The tensors by key, in the order they were stored."""
        return self.tensors if self.listed is None else self.listed

    def tensor(self, t: torch.Tensor, path: str) -> dict[str, Any]:
        # (Each torch call costs ~0.1-1 us, and 10,000 small tensors are common: none is
        # repeated, and the checks that only rare tensors fail run only for those.)
        if self.listed is not None:
            self.settle()
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            from ..dist.sharded import is_sharded  # (imports DTensor only where one is live)
            if is_sharded(t):
                raise ShardedLeaf(f"{path}: a DTensor (sharded state) is saved only as a "
                                  "value of a dict (a state_dict, the optimizer's state, a "
                                  "part's dicts), not inside a list or tuple")
        if t.layout is not _STRIDED:
            raise UnsupportedValue(
                f"{path}: tensor with layout {t.layout} cannot be stored; convert it to a dense "
                "tensor (e.g. .to_dense()) in state_dict()")
        # The same view referenced twice (tied weights) is stored once and decoded as one
        # object; a lazy view is found as itself (`view_ident` keeps its bits), before it is
        # resolved into a new tensor.
        ptr = address(t, path)
        at = ptr or -id(t)  # (addresses and ids are positive: the keys never clash)
        held = self._views.get(at)
        if held is None and self._placed:
            held = self.held(at)
        if held is not None:
            for other, same in held if type(held) is list else (held,):
                if other is t or (ptr and view_ident(other) == view_ident(t)):
                    return same  # type: ignore[no-any-return]
        # A parameter is stored as itself (~1 us a tensor not spent detaching: `tensorfile`
        # reads bytes by address or under no_grad); a tensor made from it, from its .detach().
        data, dtype = t, t.dtype
        # A lazy view of its base (``z.conj().imag`` is real, with the negative bit; only a
        # complex tensor has a conjugate bit): its own values, not its memory's.
        if data.is_neg() or dtype in _COMPLEX and data.is_conj():
            try:
                data, ptr = data.detach().resolve_conj().resolve_neg(), 0
            except (RuntimeError, NotImplementedError) as e:  # (torch negates no float8)
                raise UnsupportedValue(f"{path}: a lazily negated {dtype} view cannot be "
                                       f"resolved ({e}); store a negated copy instead") from None
        if not data.is_cpu:
            if data.is_meta:
                raise UnsupportedValue(f"{path}: a meta tensor holds no data to store; "
                                       "materialize it (e.g. .to_empty()) before saving")
            data = data.detach().cpu()
            ptr = 0
        tensors = self.tensors
        # (`_key`'s common case inline)
        key = (path if path.isascii() and path not in tensors and path != "__metadata__"
               else self._key(path))
        ref: dict[str, Any] = {TAG: "tensor", "key": key}
        if dtype not in ST_DTYPES:  # (quantized dtypes are refused by _dtype_name)
            ref["dtype"] = _dtype_name(dtype, path)
            ref["shape"] = list(data.shape)
            flat = data.detach().contiguous().reshape(-1)
            if flat.numel() <= 1:  # (dimensions of size 0 or 1 keep any stride: bytes need 1)
                flat = flat.clone(memory_format=torch.contiguous_format)
            data, dtype, ptr = flat.view(torch.uint8), torch.uint8, 0
        elif not data.is_contiguous():
            data, ptr = data.detach().contiguous(), 0
        try:
            shape = data.shape
        except RuntimeError:  # (a nested tensor of strided layout: no shape; rare, so here)
            raise UnsupportedValue(f"{path}: a nested tensor cannot be stored; store its "
                                   "components (.unbind()) in state_dict()") from None
        tensors[key] = data
        self.kinds.append((key, dtype, shape))
        self.ptrs.append(ptr or data.data_ptr())  # (t's address, unless data is a new tensor)
        if held is None:
            self._views[at] = (t, ref)
        elif type(held) is list:
            held.append((t, ref))
        else:
            self._views[at] = [held, (t, ref)]
        return ref

    def held(self, at: int) -> tuple[torch.Tensor, dict[str, Any]] | None:
        """The view a plan took at address ``at`` and its reference, or None."""
        for where, tensors, refs in self._placed:
            i = where.get(at)
            if i is not None:
                return tensors[i], refs[i]
        return None

    def _key(self, path: str) -> str:
        """A unique tensor key for ``path``."""
        if path.isascii() and path not in self.tensors and path != "__metadata__":
            return path  # (the common case, without the checks below)
        base = key = _utf8_key(path)
        n = 1
        while key in self.tensors or key == "__metadata__":  # reserved by the file format
            key = f"{base}#{n}"
            n += 1
        return key

    def raw(self, tag: str, data: np.ndarray[Any, Any], path: str, **fields: Any
            ) -> dict[str, Any]:
        """Bulk bytes (a NumPy array, a large ``bytes``) go to the tensor file as raw uint8,
        never into the JSON skeleton: JSON would hold them as base64, a third larger, parsed
        whole, and limited to ``MAX_STATE_BYTES``."""
        self.settle()
        key = self._key(path)
        flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if not flat.flags.writeable:  # torch shares only writable memory (bytes, a frozen array)
            flat = flat.copy()
        t = self.tensors[key] = torch.from_numpy(flat)
        self.kinds.append((key, torch.uint8, t.shape))
        self.ptrs.append(t.data_ptr())
        return {TAG: tag, **fields, "key": key}

    def encode(self, obj: Any, path: str, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            shown = path if len(path) < 80 else f"{path[:60]}...{path[-16:]}"
            raise UnsupportedValue(f"{shown}: nested deeper than {MAX_DEPTH} levels; return a "
                                   "flatter state from state_dict() (a list of records, a "
                                   "tensor)")
        t = type(obj)
        if t in _MAPPINGS:
            # (First: state dicts hold thousands of entries. A plain tensor leaf skips a level
            # of calls, and so does a plain int key, the optimizer's per-parameter state.)
            if (self.plans is not None and (t is dict or t is OrderedDict)
                    and depth < MAX_DEPTH - 1):  # (a plan's tensors are two levels down)
                return self.by_plan(obj, path, depth, self.plans)
            return self.mapping(obj, path, depth)
        if obj is None or t is bool or t is str:
            return obj
        if t is int:
            # JSON text of ints past 4300 digits is refused by Python; hex has no such limit.
            return obj if -_BIG_INT < obj < _BIG_INT else {TAG: "int", "v": hex(obj)}
        if t is float:
            if math.isfinite(obj):
                return obj
            # (a NaN's sign bit is its own: 0/0 on x86 gives -nan, which repr() calls "nan")
            if not math.isnan(obj):
                return {TAG: "float", "v": repr(obj)}
            bits = _float_bits(obj)
            out = {TAG: "float", "v": "-nan" if bits >> 63 else "nan"}
            if bits & ~(1 << 63) != _QUIET_NAN:  # a payload (or a signalling NaN): its bits
                out["bits"] = f"{bits:016x}"
            return out
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        if t is list or t is tuple:
            # (An optimizer group's parameter ids or names, Python's RNG state of 625 ints;
            # its elements' depth is checked as theirs would be, one level down: a call
            # each, ~0.5 us, spared.)
            if depth < MAX_DEPTH and (_INT.issuperset(map(type, obj)) and (
                    not obj or -_BIG_INT < min(obj) and max(obj) < _BIG_INT)
                    or _STR.issuperset(map(type, obj))):
                items = list(obj)
            else:
                items = [self.encode(v, f"{path}.{i}", depth + 1) for i, v in enumerate(obj)]
            return items if t is list else {TAG: "tuple", "v": items}
        if t is torch.Size:
            return {TAG: "size", "v": list(obj)}
        if t is bytes:
            if len(obj) >= _INLINE_BYTES:
                return self.raw("bytes", np.frombuffer(obj, dtype=np.uint8), path)
            return {TAG: "bytes", "v": base64.b64encode(obj).decode("ascii")}
        if isinstance(obj, (np.ndarray, np.generic)) and (
                obj.dtype.hasobject or obj.dtype.fields is not None or obj.dtype.itemsize == 0):
            raise UnsupportedValue(f"{path}: NumPy value of dtype {obj.dtype} cannot be stored "
                                   "(object, structured or zero-size elements); store each "
                                   "field as its own array")
        if isinstance(obj, np.ndarray):
            if t is not np.ndarray and not isinstance(obj, np.memmap):
                raise UnsupportedValue(
                    f"{path}: a NumPy {t.__qualname__} cannot be stored: its "
                    f"{'mask' if isinstance(obj, np.ma.MaskedArray) else 'own attributes'} "
                    "would be lost (stored as a plain array); store its parts as plain arrays "
                    "(e.g. .data and .mask)")
            return self.raw("ndarray", obj, path, dtype=obj.dtype.str, shape=list(obj.shape))
        if isinstance(obj, np.generic):
            return {TAG: "npscalar", "dtype": obj.dtype.str,
                    "v": base64.b64encode(obj.tobytes()).decode("ascii")}
        if t is torch.dtype:
            return {TAG: "dtype", "v": _dtype_name(obj, path)}
        if t is torch.device:
            return {TAG: "device", "v": str(obj)}
        raise UnsupportedValue(
            f"{path}: value of type {t.__module__}.{t.__qualname__} cannot be stored without "
            "pickle; return tensors, numbers, strings, bytes, lists, tuples or dicts from "
            "state_dict()")

    def mapping(self, obj: Any, path: str, depth: int) -> Any:
        """A dict, OrderedDict or Counter ``obj``'s skeleton (its tensors stored)."""
        t = type(obj)
        dot = f"{path}." if path else ""
        leaf = depth < MAX_DEPTH  # a tensor child within the depth limit: no call level
        tensor, encode, plain = self.tensor, self.encode, torch.Tensor
        if t is dict and TAG not in obj and all(type(k) is str for k in obj):
            return {k: tensor(v, dot + k) if leaf and type(v) is plain
                    else encode(v, dot + k, depth + 1) for k, v in obj.items()}
        return {TAG: _MAPPINGS[t], "v": [
            [k if type(k) is str or type(k) is int and -_BIG_INT < k < _BIG_INT
             else encode(k, f"{dot}<key>", depth + 1),
             tensor(v, f"{dot}{k}") if leaf and type(v) is plain
             else encode(v, f"{dot}{k}", depth + 1)] for k, v in obj.items()]}


def encode_tree(tree: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """Split ``tree`` into a JSON-able skeleton and its tensors by key (a parameter as is)."""
    enc = _Encoder()
    skeleton = enc.encode(tree, prefix)  # (first: it stores the tensors)
    enc.settle()
    return skeleton, enc.tensors


class Encoded(NamedTuple):
    """`encode_tree`'s skeleton and tensors, and what `encode_safetensors` takes of each
    tensor (``kinds``: key, dtype, shape; ``ptrs``: the address of its data), in order.
    ``texts``: the JSON text of each planned mapping, by the string the skeleton holds in
    its place (`jsontext.dumps_json` puts it back). ``unchecked``: some tensors' dtypes,
    shapes, devices, lazy bits and contiguity are only what ``kinds`` expects (see
    `encode_tree_for_file`)."""

    skeleton: Any
    tensors: Mapping[str, torch.Tensor]
    kinds: list[tuple[str, torch.dtype, torch.Size]]
    ptrs: list[int]
    texts: dict[str, str]
    unchecked: bool


def encode_tree_for_file(tree: Any, plans: dict[str, Any] | None = None, owned: bool = False,
                         defer: bool = False) -> Encoded:
    """`encode_tree`, with what `encode_safetensors` needs of each tensor already read:
    every tensor is contiguous, on the CPU, without a lazy bit, of a dtype the file format
    names. ``plans``: a dict kept from one call to the next (a Checkpointer's saves of one
    part) in which the encoding of mappings of many tensors is kept and used again while it
    fits (the skeleton, with ``texts`` put back, and the tensors are a plain call's).
    ``owned``: the tree's tensors are the caller's own buffers (an async snapshot's), which
    only it writes and never reshapes, retypes or moves: a plan meeting the same objects
    again skips their checks. (Any other tensors, the user's, may have changed in place.)
    ``defer``: for `encode_safetensors` with ``unchecked``, which checks, as it copies them,
    the tensors a plan took without reading their dtypes, shapes, devices, lazy bits and
    contiguity (`Planning.planned`), and refuses the file (`tensorfile.PlanUnfit`) if one
    does not fit: the caller then encodes the tree again with its plans cleared."""
    enc = _Encoder(plans, owned, defer)
    skeleton = enc.encode(tree, "")
    if owned and plans:
        # A plan whose mapping this save did not hold lets go of the buffers it took (the
        # snapshot dropped them): it is used again only if its mapping comes back.
        for path in plans.keys() - enc.met:
            plans[path].mine.clear()
    return Encoded(skeleton, enc.stored(), enc.kinds, enc.ptrs, enc.texts, enc.unchecked)
