"""The parts of `export` below its public API: which tensors go out and in which dtype,
fixed inputs and outputs as named tensors, how outputs are compared, the export folder written
atomically, and a generation's model part read from a run. Private: ``cli.py`` skips modules
whose name starts with an underscore, so this registers no command."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..errors import CorruptCheckpoint, MissingState, StateMismatch, UnbrokenError, UnsupportedValue
from ..state.generation import check_sizes, check_stamps, decode_generation
from ..state.modelcheck import cast_overflow
from ..state.parts import MODEL, STATE_FILE
from ..state.tensorfile import ST_DTYPES
from ..store.backends.local import LocalFS
from ..store.generations import GenerationStore
from ..store.verifying import GenerationInfo, not_loadable, unreadable
from ._export_paths import check_out

SCHEMA = "unbroken.export/1"
EXPORT_JSON = "export.json"
WEIGHTS = "model.safetensors"
FIXED = "fixed_inputs.safetensors"
MAX_EXPORT_JSON = 64 * 1024 * 1024

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16,
                                  "fp32": torch.float32}
# Only these are cast: float8 and other scaled formats are meaningful only with their scales,
# so a cast of them would silently change the model.
_CASTABLE = (torch.float64, torch.float32, torch.float16, torch.bfloat16)

# Default (rtol, atol) of a non-bitwise check, by the lowest precision involved. An output
# passes when max |got - recorded| <= atol + rtol * max |recorded| (per output tensor): the
# bound scales with the output's magnitude, because element-wise relative errors explode on
# outputs near zero. Measured on the demo's model: casting the weights to bf16 moves logits
# by <= 0.6% of their scale, fp16 by <= 0.08%. "tf32": an fp32 model on a GPU that allows
# TF32 (cuDNN does by default), whose matmul inputs round like fp16.
TOLERANCES: dict[str, tuple[float, float]] = {
    "fp32": (1e-4, 1e-6), "tf32": (2e-3, 1e-5), "fp16": (2e-3, 1e-5), "bf16": (2e-2, 1e-5),
    "fp8": (1e-1, 1e-3)}
_RANK = {"float64": "fp32", "float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
_ORDER = ("fp32", "tf32", "fp16", "bf16", "fp8")

# A base revision must name something that cannot move: a hex commit or content digest at
# its end ("org/model@<40 hex>", "sha256:<hex>", "<40 hex>"), never a branch or tag.
_IMMUTABLE = re.compile(r"(?:.+[@:])?[0-9a-fA-F]{7,128}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- the tensors of an export ---------------------------------------------------------------


def select(names: Iterable[str], adapter: str | Iterable[str] | None) -> list[str]:
    """The tensor names an export holds: all of them, or an adapter's subset. ``adapter``: a
    prefix (a str), or exact names of which one ending in ``*`` is a prefix."""
    names = list(names)
    if adapter is None:
        return names
    patterns = [adapter + "*"] if isinstance(adapter, str) else list(adapter)
    if not patterns or not all(isinstance(p, str) and p.strip("*") for p in patterns):
        raise UnbrokenError(f"adapter={adapter!r}: name the adapter's tensors (a prefix, or a "
                            "list of names where 'prefix*' selects by prefix)")
    chosen, unknown = set(), []
    for p in patterns:
        hits = ([n for n in names if n.startswith(p[:-1])] if p.endswith("*")
                else [p] if p in names else [])
        if not hits:
            unknown.append(p)
        chosen.update(hits)
    if unknown:
        raise StateMismatch(f"adapter: {', '.join(map(repr, unknown[:5]))} match no tensor of "
                            f"the model (it has {len(names)}, e.g. {names[:3]})")
    return [n for n in names if n in chosen]


def check_base_revision(base_revision: str | None, adapter: bool) -> None:
    """An adapter is meaningless without the exact base it was trained on: refuse one whose
    base is not named by an immutable id."""
    if base_revision is None:
        if adapter:
            raise MissingState(
                "an adapter export holds only some of the model's tensors and must name the "
                "immutable base model revision it applies to: pass base_revision= (CLI: "
                "--base-revision), e.g. 'org/model@<40-hex commit>' or 'sha256:<digest>'")
        return
    if not isinstance(base_revision, str) or not _IMMUTABLE.fullmatch(base_revision):
        raise UnbrokenError(
            f"base_revision={base_revision!r:.80} is not an immutable revision: end it with a "
            "commit hash or content digest ('org/model@<40-hex commit>', 'sha256:<hex>'); a "
            "branch or tag such as 'main' can move under the export")


def prepare(state: Mapping[str, Any], names: list[str], dtype: str | None
            ) -> tuple[dict[str, torch.Tensor], bool]:
    """The tensors to write (CPU, detached; floating ones cast to ``dtype``) and whether any
    was cast. Refuses what a plain safetensors reader could not load back as saved."""
    target = None if dtype is None else DTYPES.get(dtype)
    if dtype is not None and target is None:
        raise UnbrokenError(f"dtype={dtype!r}: one of {', '.join(DTYPES)}, or None (as saved)")
    out: dict[str, torch.Tensor] = {}
    cast = False
    for name in names:
        t = state[name]
        if not isinstance(t, torch.Tensor):
            raise UnsupportedValue(f"{name!r}: the model's state holds a {type(t).__name__}, "
                                   "not a tensor; an inference export holds tensors only")
        t = t.detach()
        if target is not None and t.dtype in _CASTABLE and t.dtype != target:
            _check_range(name, t, target, dtype)
            t, cast = t.to(target), True
        if t.dtype not in ST_DTYPES:
            raise UnsupportedValue(f"{name!r}: dtype {t.dtype} has no safetensors name; "
                                   "convert it before exporting")
        out[name] = t.cpu()  # encode_safetensors copies bytes per key: tied weights are fine
    return out, cast


def _check_range(name: str, source: torch.Tensor, target: torch.dtype, dtype: str | None
                 ) -> None:
    """Refuse a cast that cannot hold a finite value of ``source`` (`cast_overflow`: values
    already inf or NaN are not blamed on it)."""
    peak = cast_overflow(source, target)
    if peak is not None:
        raise UnsupportedValue(
            f"{name!r}: max |value| {peak:.4g} is over the range of {dtype} (|x| <= "
            f"{torch.finfo(target).max:.4g}): the cast would turn finite values into inf; "
            "export with another dtype whose range holds it (bf16 and fp32 reach 3.4e38) or "
            "with none (as saved), or rescale the weights first")


# -- fixed inputs and outputs as named tensors ----------------------------------------------


def pack_inputs(inputs: Any) -> dict[str, torch.Tensor]:
    """``args.<i>`` for a tensor or an iterable of tensors (positional), ``kwargs.<name>`` for a
    mapping (keyword arguments)."""
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    items = ([(f"kwargs.{k}", v) for k, v in inputs.items()] if isinstance(inputs, Mapping)
             else [(f"args.{i}", v) for i, v in enumerate(inputs)]
             if isinstance(inputs, Iterable) and not isinstance(inputs, (str, bytes)) else None)
    if not items or not all(isinstance(v, torch.Tensor) for _, v in items):
        raise UnbrokenError("inputs: a tensor, a list or tuple of tensors (positional "
                            "arguments) or a dict of tensors (keyword arguments)")
    return {k: v.detach().cpu().contiguous() for k, v in items}


def unpack_inputs(packed: Mapping[str, torch.Tensor], device: torch.device,
                  dtype: torch.dtype | None) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The model's arguments, on its device; floating inputs follow the model's dtype (a model
    cast to bf16 takes bf16 inputs)."""
    def place(t: torch.Tensor) -> torch.Tensor:
        if dtype is not None and t.dtype in _CASTABLE:
            t = t.to(dtype)
        return t.to(device)
    args = sorted((int(k[5:]), v) for k, v in packed.items() if k.startswith("args."))
    kwargs = {k[7:]: place(v) for k, v in packed.items() if k.startswith("kwargs.")}
    return [place(v) for _, v in args], kwargs


def flatten_outputs(obj: Any, prefix: str = "output") -> dict[str, torch.Tensor]:
    """Every tensor of a model's output (a tensor, tuple, list or mapping such as a
    ``ModelOutput``), named by its path; other leaves (None, numbers) are left out."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj.detach().cpu().contiguous()}
    found: dict[str, torch.Tensor] = {}
    items = (obj.items() if isinstance(obj, Mapping) else
             enumerate(obj) if isinstance(obj, (list, tuple)) else ())
    for key, value in items:
        found.update(flatten_outputs(value, f"{prefix}.{key}"))
    return found


def run_fixed(model: torch.nn.Module, packed: Mapping[str, torch.Tensor]
              ) -> dict[str, torch.Tensor]:
    """The model's outputs on the fixed inputs: eval mode (no dropout), no autograd, its
    training flags put back afterwards."""
    device, dtype = model_device_dtype(model)
    args, kwargs = unpack_inputs(packed, device, dtype)
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.no_grad():
            outputs = flatten_outputs(model(*args, **kwargs))
    finally:
        for m, mode in modes:
            m.training = mode
    if not outputs:
        raise UnbrokenError("the model's output on the fixed inputs holds no tensor")
    return outputs


def model_device_dtype(model: torch.nn.Module) -> tuple[torch.device, torch.dtype | None]:
    """The device of the model's first tensor, and its floating dtype when there is one."""
    tensors = [*model.parameters(), *model.buffers()]
    floats = {t.dtype for t in tensors if t.dtype in _CASTABLE}
    device = tensors[0].device if tensors else torch.device("cpu")
    return device, floats.pop() if len(floats) == 1 else None


def tolerance_class(dtypes: Iterable[str], device: torch.device) -> str:
    """The lowest precision among the floating ``dtypes`` (names such as ``"bfloat16"``, as
    `dtype_name` gives), as a key of `TOLERANCES`."""
    found = {_RANK.get(d) or "fp8" for d in dtypes if d in _RANK or d.startswith("float8")}
    if device.type == "cuda" and "fp32" in found and (
            torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32):
        found.add("tf32")
    return max(found or {"fp32"}, key=_ORDER.index)


def compare(name: str, got: torch.Tensor, want: torch.Tensor, bitwise: bool,
            rtol: float, atol: float) -> dict[str, Any]:
    """One output compared with its recording: ``ok``, the largest difference and the bound."""
    row: dict[str, Any] = {"name": name, "shape": list(want.shape), "recorded_dtype":
                           dtype_name(want.dtype), "dtype": dtype_name(got.dtype)}
    if got.shape != want.shape:
        return {**row, "ok": False, "why": f"shape {list(got.shape)}, recorded "
                                            f"{list(want.shape)}"}
    if bitwise or not (want.is_floating_point() or got.is_floating_point()):
        same = got.dtype == want.dtype and torch.equal(
            got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
        differ = 0 if same else int((got.double() != want.double()).sum())
        return {**row, "mode": "bitwise", "ok": same, "elements_differing": differ}
    a, b = got.double(), want.double()
    equal = (a == b) | (a.isnan() & b.isnan())  # inf == inf; NaN where NaN was recorded
    diff = torch.nan_to_num(torch.where(equal, 0.0, (a - b).abs()), nan=float("inf"))
    finite = b[b.isfinite()]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    worst = float(diff.max()) if diff.numel() else 0.0
    bound = atol + rtol * scale
    return {**row, "mode": "tolerance", "ok": worst <= bound, "max_abs_diff": worst,
            "bound": bound, "scale": scale}


# -- the export folder ----------------------------------------------------------------------


def write_folder(out: str, files: Mapping[str, Any]) -> dict[str, tuple[int, str]]:
    """Write ``files`` (name -> bytes or buffers; a callable receives the sizes and hashes of
    the files before it and returns its bytes) into a temporary sibling of ``out``, fsynced,
    then rename it to ``out``: a reader sees the whole export or none. Returns each file's
    (size, xxh3-128)."""
    check_out(out)
    parent = os.path.dirname(out) or "."
    fs = LocalFS()
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.export-", dir=parent)
    except OSError as e:  # no permission, a read-only or full disk, a file raced in
        raise UnbrokenError(f"{out}: cannot create it in {parent} ({e}); nothing was "
                            "written: choose an OUT in a folder you can write") from None
    done: dict[str, tuple[int, str]] = {}
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the export from its readers
        for name, data in files.items():
            data = data(dict(done)) if callable(data) else data
            chunks = [data] if isinstance(data, (bytes, memoryview)) else data
            done[name] = fs.write_file(os.path.join(tmp, name), chunks)
        fs.fsync_dir(tmp)
        try:
            os.rename(tmp, out)  # replaces an empty folder only (Linux); never a full one
        except OSError as e:
            raise UnbrokenError(f"{out}: cannot be created ({e}); nothing was written "
                                "there") from None
        fs.fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return done


def hash_checked(out: str, entry: Any, name: str) -> str:
    """The path of ``name`` in export ``out`` after checking its size and xxh3-128 against
    ``entry`` (its record in ``export.json``)."""
    path = os.path.join(out, name)
    try:
        want_size, want_hash = int(entry["bytes"]), str(entry["xxh3_128"])
    except (KeyError, TypeError, ValueError):
        raise CorruptCheckpoint(f"{out}/{EXPORT_JSON}: no size and hash for {name}") from None
    try:
        size, digest = LocalFS().hash_file(path, max(want_size, 0))
    except CorruptCheckpoint as e:  # larger than recorded: never read past the size
        raise CorruptCheckpoint(f"{e}; {EXPORT_JSON} records {want_size} bytes") from None
    except OSError as e:  # (this machine's error, a permission: no verdict on the file)
        raise unreadable(path, e) from None
    if (size, digest) != (want_size, want_hash):
        raise CorruptCheckpoint(f"{path}: {size} bytes with xxh3-128 {digest}; {EXPORT_JSON} "
                                f"records {want_size} bytes with {want_hash}: the file was "
                                "changed or damaged after export")
    return path


# -- reading a run ----------------------------------------------------------------------------


def read_model(store: GenerationStore, info: GenerationInfo) -> Mapping[str, Any]:
    """The model part of one generation: only its files, each hash-verified, decoded and
    checked against the manifest's stamps."""
    from ..dist.sharded import SHARDS_FILE

    if not info.ok or info.manifest is None:
        raise not_loadable(info)
    m = info.manifest
    if MODEL not in m.parts:
        raise CorruptCheckpoint(f"{info.path}: holds no model part (parts {m.parts})")
    if any(a.name == SHARDS_FILE for a in m.artifacts):
        raise UnsupportedValue(f"{info.path}: the model is sharded across ranks; restore it "
                               "(warm_start) into the model and export that with export_model")
    check_sizes(m, info.path)  # before reading a byte
    files = store.read_verified(info, [a.name for a in m.artifacts if a.name == STATE_FILE
                                       or a.name.startswith(f"{MODEL}.")])
    tree, meta = decode_generation(files, info.path, {MODEL})
    check_stamps(m, info.path, tree, meta, all_parts=False)
    state = tree.get(MODEL)
    if not isinstance(state, Mapping):
        raise CorruptCheckpoint(f"{info.path}: its model part is not a mapping of tensors")
    return state
