"""``unbroken import SRC RUN``: a foreign checkpoint's model weights as an unbroken warm-start
generation, so that a run trained elsewhere (a Transformers Trainer ``checkpoint-N/``, an
Accelerate ``save_state`` folder, a ``save_pretrained`` folder, a Lightning ``.ckpt``, a
torch.save file or a bare safetensors file) continues under unbroken's store, identity and
proof with ``restore(intent="warm_start", source=RUN)``.

Nothing is executed: safetensors files are read as such, and a torch.save archive (zip) is
read by interpreting its pickle symbolically (`._pickle_scan`) and copying each tensor's bytes
out of the archive by its storage record, bounds-checked; an archive whose pickle would import
anything beyond what torch's weights-only loader allows is refused. Only the weights
come over: the source's optimizer, scheduler, RNG and data position are not a continuation
unbroken can vouch for, so the imported run is a warm start (a ``continue`` restore from it
refuses, naming the missing parts). The generation's manifest names the source in ``origin``
(operation "import", path, format, and the xxh3-128 of every file read); the source's
``config.json``, when present, becomes the run's identity config."""

from __future__ import annotations

import math
import os
import re
import warnings
import zipfile
import zlib
from typing import Any

import safetensors.torch
import torch
import xxhash

from .._runview import UsageError
from ..errors import CorruptCheckpoint, UnbrokenError, shown
from ..state.identity import Identity
from ..state.jsontext import loads_json
from . import _pickle_files as pfiles
from . import _pickle_scan as ps

_WEIGHTS_PT = ("pytorch_model.bin", "model.bin", "model.pt", "model.pth")
_MORE_MODELS = re.compile(r"(?:pytorch_)?model_[1-9][0-9]*\.(?:safetensors|bin)")
_STATE_KEYS = ("state_dict", "model_state_dict", "model", "module", "net")
MAX_CONFIG_BYTES = 16 << 20


def read_source(src: str) -> dict[str, Any]:
    """The weights of ``src`` (name -> tensor), its format, the files read with their
    xxh3-128, its step when it records one, and its config (``config.json``) if any."""
    if not os.path.exists(src):
        raise UsageError(f"{src}: no such file or folder")
    if os.path.isdir(src):
        return _read_folder(src)
    if src.endswith(".safetensors"):
        return {"format": "safetensors file", "tensors": _safetensors(src),
                "files": {src: _digest(src)}, "step": 0, "config": None}
    return _read_archive(src, "torch.save archive" if not src.endswith(".ckpt")
                         else "Lightning checkpoint")


def _read_folder(src: str) -> dict[str, Any]:
    names = sorted(os.listdir(src))
    # Accelerate's save_state writes the N-th prepared model beside the first as model_N
    # (or pytorch_model_N.bin): which one a run continues is the user's to say
    others = [n for n in names if _MORE_MODELS.fullmatch(n)]
    if others:
        raise UsageError(f"{src}: holds more than one model ({', '.join(others[:4])} beside "
                         "the first); an import takes one: name its file instead of the "
                         f"folder (e.g. unbroken import {os.path.join(src, others[0])} RUN)")
    shards = [n for n in names if n.endswith(".safetensors") and
              (n == "model.safetensors" or n.startswith("model-"))]
    if shards:
        tensors: dict[str, torch.Tensor] = {}
        for n in shards:
            tensors.update(_safetensors(os.path.join(src, n)))
        out: dict[str, Any] = {"tensors": tensors, "files": {
            os.path.join(src, n): _digest(os.path.join(src, n)) for n in shards}}
    else:
        pt = next((n for n in _WEIGHTS_PT if n in names), None)
        if pt is None:
            raise UsageError(f"{src}: no model weights found (model.safetensors, "
                             f"model-*.safetensors or one of {', '.join(_WEIGHTS_PT)}); "
                             "`unbroken audit` says what the folder holds")
        out = _read_archive(os.path.join(src, pt), "")
    kind = ("Hugging Face Trainer checkpoint" if "trainer_state.json" in names else
            "Accelerate save_state folder" if any(n.startswith("random_states_") for n in names)
            else "model folder (save_pretrained)")
    out["format"] = kind
    out["step"] = _trainer_step(os.path.join(src, "trainer_state.json"))
    config = os.path.join(src, "config.json")
    out["config"] = _json(config) if os.path.isfile(config) else None
    if out["config"] is not None:
        out["files"][config] = _digest(config)
    return out


def _read_archive(path: str, kind: str) -> dict[str, Any]:
    """A torch.save zip archive's tensors, without unpickling (see the module doc)."""
    if not pfiles.is_zip(path):
        raise UsageError(f"{path}: not a torch.save zip archive (a legacy torch.save file, "
                         "legacy tar or plain pickle, which unbroken does not import, or another "
                         "format): re-save it with torch.save, or export safetensors")
    scanned = pfiles.read_pickle_file(path)
    unsafe = [g for g in scanned.globals() if ps.classify(g) not in ("weights_only", "numpy")]
    if scanned.errors or scanned.unresolved or unsafe:
        raise CorruptCheckpoint(
            f"{path}: refusing to import: its pickle "
            + (f"would import {', '.join(unsafe[:5])}" if unsafe else
               "cannot be read safely (" + "; ".join(scanned.errors or ["unresolved globals"])
               + ")") + "; `unbroken audit` lists what it holds")
    root = scanned.root
    step = root.get("global_step", 0) if isinstance(root, dict) else 0
    state = _state_dict(root, path)
    try:
        with pfiles.open_regular(path) as f, zipfile.ZipFile(f) as z:
            base = _archive_folder(z, path)
            need = _needed(state)
            storages: dict[str, bytes] = {}  # (one read each, however many views)
            tensors = {name: _materialize(z, base, t, f"{path}:{name}", storages, need)
                       for name, t in state.items()}
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, ValueError,
            StopIteration) as e:
        raise CorruptCheckpoint(f"{path}: unreadable zip archive ({e}); `unbroken audit` "
                                "says what it holds") from None
    return {"format": kind or "torch.save archive", "tensors": tensors,
            "files": {path: _digest(path)}, "step": step if type(step) is int else 0,
            "config": None}


def _archive_folder(z: zipfile.ZipFile, path: str) -> str:
    """The one folder every entry of a torch.save archive is in (torch refuses an archive
    whose entries are not all in the folder of its first: ``a/data.pkl`` and ``b/data.pkl``
    would be read differently by different readers)."""
    folders = {n.split("/", 1)[0] if "/" in n else None for n in z.namelist()}
    if len(folders) != 1 or None in folders:
        shown_ = sorted(str(f) for f in folders)[:4]
        raise CorruptCheckpoint(f"{path}: a torch.save archive has all its entries in one "
                                f"folder; this one has entries in {shown_}")
    base = folders.pop()
    assert base is not None
    if f"{base}/data.pkl" not in z.NameToInfo:
        raise CorruptCheckpoint(f"{path}: no {base}/data.pkl in the archive")
    return base


def _state_dict(root: Any, path: str) -> dict[str, ps.Tensor]:
    """The flat name -> tensor mapping inside a checkpoint's object: itself, or the first of
    its ``state_dict``-like entries."""
    candidates = [root] + ([root[k] for k in _STATE_KEYS if k in root]
                           if isinstance(root, dict) else [])
    for c in reversed(candidates):
        if isinstance(c, dict) and c and all(isinstance(k, str) and isinstance(v, ps.Tensor)
                                             for k, v in c.items()):
            return c
    keys = sorted(shown(k) for k in root)[:12] if isinstance(root, dict) else type(root)
    raise UsageError(f"{path}: no flat state dict of tensors found (top-level keys: {keys})")


# The dtypes a record may name: plain numbers (a quantized, bit-packed or sub-byte dtype
# makes torch's own kernels crash the process on a crafted record).
_IMPORTED = frozenset(d for d in (getattr(torch, n, None) for n in (
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "int64", "int32",
    "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn",
    "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")) if isinstance(d, torch.dtype))
_DIM = range(1 << 62)  # a dimension, stride or offset torch can hold (int64, with room)
# What an expanded record (a stride of 0) may make beyond its storage's own size.
_EXPANDED_BYTES = 64 << 20


_MAX_DIMS = 64  # (what safetensors headers may hold: `state.stheader`)


def _extent(t: ps.Tensor, item: int) -> int:
    """The bytes of its storage a valid record's view reaches (0 for an empty one)."""
    if not math.prod(t.shape or ()) or t.stride is None or t.shape is None:
        return 0
    return (t.offset + sum((n - 1) * s for n, s in zip(t.shape, t.stride, strict=True)) + 1) \
        * item


def _needed(state: dict[str, ps.Tensor]) -> dict[str, int]:
    """Per storage record, the bytes its views reach (read once, that far and no further);
    records that fail their checks are left to `_materialize` to refuse."""
    need: dict[str, int] = {}
    for t in state.values():
        dtype = getattr(torch, t.dtype, None) if isinstance(t.dtype, str) else None
        if dtype in _IMPORTED and t.key is not None and _valid_shape(t):
            assert isinstance(dtype, torch.dtype)
            end = _extent(t, dtype.itemsize)
            need[t.key] = max(need.get(t.key, 0), end)
    return need


def _valid_shape(t: ps.Tensor) -> bool:
    """Shape, strides and offset torch can hold: at most 64 dimensions of non-negative
    integers under 2**62, whose product (zeros left out: strides are computed from it even
    when a zero makes the count 0) stays under 2**62."""
    if (t.shape is None or t.stride is None or len(t.stride) != len(t.shape)
            or len(t.shape) > _MAX_DIMS or not all(
                type(n) is int and n in _DIM for n in (*t.shape, *t.stride, t.offset))):
        return False
    return math.prod(n or 1 for n in t.shape) in _DIM


def _materialize(z: zipfile.ZipFile, base: str, t: ps.Tensor, where: str,
                 storages: dict[str, bytes], need: dict[str, int]) -> torch.Tensor:
    """The tensor ``t`` describes, copied out of the archive's storage record, with its
    dtype, shape, strides and offset checked against the storage's size (each storage read
    once, into ``storages``, as far as its views reach)."""
    dtype = getattr(torch, t.dtype, None) if isinstance(t.dtype, str) else None
    if dtype not in _IMPORTED:
        raise CorruptCheckpoint(f"{where}: a tensor of dtype {shown(t.dtype)}, which unbroken "
                                f"does not import (plain numeric dtypes only)")
    if t.key is None or not _valid_shape(t):
        raise CorruptCheckpoint(f"{where}: a tensor record unbroken cannot read: shape "
                                f"{shown(t.shape, 80)}, strides {shown(t.stride, 80)} and offset "
                                f"{shown(t.offset)}, where at most {_MAX_DIMS} non-negative "
                                "integers under 2**62 (their product too) go")
    assert isinstance(dtype, torch.dtype) and t.shape is not None and t.stride is not None
    item = dtype.itemsize
    try:
        info = z.getinfo(f"{base}/data/{t.key}")
    except KeyError:
        raise CorruptCheckpoint(f"{where}: storage {t.key!r} missing from the archive") \
            from None
    # (torch refuses a record whose size is not its persistent id's count of elements; a
    # 9 MB deflated record may declare 2 GiB)
    if type(t.numel) is not int or info.file_size != t.numel * (1 if t.untyped else item):
        says = (f"{shown(t.numel)} bytes (an untyped storage)" if t.untyped else
                f"{shown(t.numel)} {t.dtype} elements of {item} bytes")
        raise CorruptCheckpoint(f"{where}: storage record {t.key!r} declares "
                                f"{info.file_size} bytes where its persistent id says {says}: "
                                "record size does not match")
    numel = math.prod(t.shape)
    if not numel:
        return torch.empty(t.shape, dtype=dtype)
    end = _extent(t, item)
    if end > info.file_size:
        raise CorruptCheckpoint(f"{where}: shape {list(t.shape)} with strides "
                                f"{list(t.stride)} at offset {t.offset} reaches past its "
                                f"storage of {info.file_size // item} elements")
    if numel * item > max(info.file_size, _EXPANDED_BYTES):
        raise CorruptCheckpoint(f"{where}: shape {list(t.shape)} with strides "
                                f"{list(t.stride)} repeats a storage of {info.file_size} bytes "
                                f"into {numel * item} bytes; an expanded view that large is "
                                "not imported")
    raw = storages.get(t.key)
    if raw is None or len(raw) < end:
        with z.open(info) as member:
            raw = storages[t.key] = member.read(max(end, need.get(t.key, 0)))
        if len(raw) < end:
            raise CorruptCheckpoint(f"{where}: storage record {t.key!r} ends after "
                                    f"{len(raw)} of its {info.file_size} bytes")
    with warnings.catch_warnings():  # (read-only bytes: only read, by the clone)
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(raw, dtype=dtype, count=len(raw) // item)
    return flat.as_strided(t.shape, t.stride, t.offset).clone()


def _safetensors(path: str) -> dict[str, torch.Tensor]:
    with pfiles.open_regular(path):  # (a FIFO in its place: refused, not waited on)
        pass
    try:
        return dict(safetensors.torch.load_file(path))
    except Exception as e:  # noqa: BLE001 -- the reader's own errors on a bad file
        raise CorruptCheckpoint(f"{path}: not a readable safetensors file ({e})") from None


def _digest(path: str) -> str:
    h = xxhash.xxh3_128()
    with pfiles.open_regular(path) as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _json(path: str) -> Any:
    """A JSON file of the source, parsed with unbroken's bounded reader (size, nesting)."""
    with pfiles.open_regular(path) as f:
        return loads_json(f.read(MAX_CONFIG_BYTES + 1), path, MAX_CONFIG_BYTES, unique=False)


def _trainer_step(path: str) -> int:
    if not os.path.isfile(path):
        return 0
    doc = _json(path)
    step = doc.get("global_step", 0) if isinstance(doc, dict) else 0
    return step if type(step) is int and step >= 0 else 0


def _holder(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose ``state_dict`` is ``tensors`` (buffers along the dotted names): what
    the Checkpointer saves as the model part, loadable by name into the real model."""
    root = torch.nn.Module()
    for name, tensor in tensors.items():
        *path, leaf = name.split(".")
        module = root
        try:
            for part in path:
                if part not in module._modules:
                    module.add_module(part, torch.nn.Module())
                module = module._modules[part]  # type: ignore[assignment]
            module.register_buffer(leaf, tensor)
        except (KeyError, TypeError, AttributeError) as e:
            raise UnbrokenError(f"tensor {name!r}: its name cannot be held as a state-dict "
                                f"entry ({e})") from None
    return root


_MAX_NAME_PARTS = 64  # dotted parts of a tensor name (modules nested that deep)


def _check_names(tensors: dict[str, torch.Tensor], src: str) -> None:
    """Refuse a tensor name nested deeper than any model: its modules would be nested as
    deep, and ``Module.state_dict`` recurses through them (5,000 parts: RecursionError)."""
    for name in tensors:
        parts = name.count(".") + 1
        if parts > _MAX_NAME_PARTS:
            raise CorruptCheckpoint(f"{src}: tensor {name[:80]!r}... has {parts} dotted "
                                    f"parts; at most {_MAX_NAME_PARTS} are imported")


def import_checkpoint(src: str, run: str) -> dict[str, Any]:
    """Write ``src``'s weights as the first generation of the new run ``run`` (see the
    module doc); returns what was imported."""
    from ..checkpointer import Checkpointer  # the tools sit above the checkpointer

    if os.path.exists(src) and not (os.path.isdir(src) or os.path.isfile(src)):
        raise UsageError(f"{src}: not a regular file or folder (a FIFO, socket or device); "
                         "import reads a checkpoint file or folder")
    where, into = os.path.realpath(src), os.path.realpath(run)
    if into == where or into.startswith(where.rstrip(os.sep) + os.sep):
        what = "the source itself" if into == where else "inside the source"
        raise UsageError(f"{run}: is {what} {src}; an import never writes into what it reads: "
                         "name a new run folder elsewhere")
    if os.path.lexists(run) and not os.path.isdir(run):
        raise UsageError(f"{run}: exists and is not a folder (a file, or a link to nothing); "
                         "name a new run folder")
    source = read_source(src)
    _check_names(source["tensors"], src)
    config = source["config"]
    identity = Identity(config=config if isinstance(config, dict) else None)
    ckpt = Checkpointer(run, model=_holder(source["tensors"]), identity=identity)
    try:
        if ckpt.store.scan():
            raise UsageError(f"{ckpt.store.root}: already holds generations; import into a "
                             "new run folder")
        ckpt.restore()
        # The generation's lineage: where its weights came from (a warm start records its
        # parent run the same way).
        ckpt._origin = {"operation": "import", "source": os.path.abspath(src),
                        "format": source["format"], "files": source["files"]}
        step = source["step"]
        ckpt.save(step)
    finally:
        ckpt.close()
    return {"run": ckpt.store.root, "source": os.path.abspath(src), "format": source["format"],
            "step": step, "tensors": len(source["tensors"]),
            "bytes": sum(t.numel() * t.element_size() for t in source["tensors"].values()),
            "config": config is not None}
