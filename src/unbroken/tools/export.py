"""Inference export (DESIGN.md, "The three operations": export): the model's weights in one
safetensors file that any reader loads (names as in the model's ``state_dict``), with the
model's identity (config, tokenizer, base model revision, generation config) and lineage (run,
generation, step), and nothing else of the run: no optimizer, no data paths, no sample state,
no RNG. An export folder holds::

    model.safetensors         the weights (``safetensors.torch.load_file`` reads them)
    export.json               schema, identity, lineage, dtype, each tensor's dtype and shape,
                              each file's size and xxh3-128, and a ``checksum`` of its own
                              (as a run manifest's: any edited field is corruption)
    fixed_inputs.safetensors  (when inputs were given) the inputs and the outputs the model
                              produced on them at export time, for `verify_export`

``export_model`` exports a live model, ``export_generation`` (``unbroken export``) a run's
generation; `verify_export` (``unbroken verify-export``) reloads an export into a model and
re-runs the fixed inputs, bitwise or within a tolerance per dtype (`_export_io.TOLERANCES`).
The folder is written beside OUT and renamed into place: OUT holds a whole export or none;
an OUT inside the run folder (it would change committed generations) and a cast that turns
finite weights into inf are refused.
Nothing is pickled, nothing is read with ``torch.load``."""

from __future__ import annotations

import datetime
import json
import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .._runview import open_run
from ..errors import (
    CorruptCheckpoint,
    MissingState,
    NoCheckpoint,
    StateMismatch,
    UnbrokenWarning,
    UnsupportedValue,
)
from ..state.identity import Identity
from ..state.jsontext import dumps_json, loads_json
from ..state.livemodel import with_versions
from ..state.names import served_name
from ..state.tensorfile import encode_safetensors
from ..state.tensorread import decode_safetensors
from ..store.backends.local import LocalFS
from ..store.manifest import CHECKSUM, check_seal, checksum
from . import _export_io as io
from ._export_io import EXPORT_JSON, FIXED, SCHEMA, TOLERANCES, WEIGHTS
from ._export_paths import check_out, check_outside_run, local_out

__all__ = ["TOLERANCES", "export_generation", "export_model", "verify_export"]

Inputs = torch.Tensor | Iterable[torch.Tensor] | Mapping[str, torch.Tensor]


def export_model(model: torch.nn.Module, out: str | os.PathLike[str], *,
                 identity: Identity | Mapping[str, Any] | None = None,
                 lineage: Mapping[str, Any] | None = None, inputs: Inputs | None = None,
                 dtype: str | None = None, adapter: str | Iterable[str] | None = None,
                 base_revision: str | None = None,
                 generation_config: Mapping[str, Any] | Any | None = None,
                 run: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Export ``model``'s weights for inference into the new folder ``out`` and return what
    ``export.json`` records (plus ``"path"``).

    ``identity``: an `Identity` or a JSON mapping (config, tokenizer, ...; a ``data`` entry is
    left out: an export holds no data identity or path). ``lineage``: JSON naming where the
    weights come from (run, generation, step). ``inputs``: fixed inputs (a tensor, a list of
    positional tensors or a dict of keyword tensors); the outputs the model gives on them now
    (eval mode, no autograd) are recorded for `verify_export`. ``dtype``: ``"bf16"``,
    ``"fp16"`` or ``"fp32"`` casts the floating tensors (float64/32/16, bfloat16) on the way
    out; None keeps them as they are. ``adapter``: export only some tensors (a prefix, or a
    list of names where ``"prefix*"`` selects by prefix); it then needs ``base_revision``, the
    immutable revision of the base model it applies to (``"org/model@<commit>"``,
    ``"sha256:<digest>"``), or `MissingState` is raised. ``generation_config``: a mapping (or
    an object with ``to_dict()``) recorded in the identity. ``run``: the run folder the model
    is checkpointed in, if any: an ``out`` inside it is refused. An ``out`` that exists and is
    not an empty folder, is a URL or lies under a file is refused (`UnbrokenError`)."""
    out = local_out(out)
    if run is not None:  # before check_out: an OUT holding the run is not empty either
        check_outside_run(os.fspath(run), out)
    check_out(out)  # before running anything
    io.check_base_revision(base_revision or _identity(identity, None).get("base_revision"),
                           adapter is not None)
    fixed = None
    if inputs is not None:
        packed = io.pack_inputs(inputs)
        outputs = io.run_fixed(model, packed)
        device, _ = io.model_device_dtype(model)
        fixed = {"tensors": {**packed, **outputs}, "inputs": list(packed),
                 "outputs": list(outputs), "recorded": {
                     "device": device.type, "torch": str(torch.__version__),
                     "num_threads": torch.get_num_threads(),
                     "model_dtypes": sorted({io.dtype_name(t.dtype)
                                             for t in model.state_dict().values()
                                             if isinstance(t, torch.Tensor)})}}
    return _write(model.state_dict(), out, identity, dict(lineage or {}), dtype, adapter,
                  base_revision, generation_config, fixed)


def export_generation(run: str | os.PathLike[str], out: str | os.PathLike[str],
                      generation: int | None = None, dtype: str | None = None, *,
                      adapter: str | Iterable[str] | None = None,
                      base_revision: str | None = None) -> dict[str, Any]:
    """Export the model part of a run's generation (the newest one that verifies, or
    ``generation``) into the new folder ``out``: its identity from the manifest (without the
    data entry), lineage = run id, generation, incarnation and step. Only the model's files
    are read, each hash-verified. Returns what `export_model` returns, plus ``"refused"``:
    newer generations that did not verify. ``run``: a run folder or URL."""
    out = local_out(out)
    check_outside_run(os.fspath(run), out)  # before check_out: OUT holding RUN is not empty
    check_out(out)
    io.check_base_revision(base_revision, adapter is not None)
    store = open_run(os.fspath(run))
    scanned = store.scan()
    candidates = [g for g in reversed(scanned) if generation in (None, g.generation)]
    if not candidates:
        which = "" if generation is None else f" {generation}"
        raise NoCheckpoint(f"{store.root}: no generation{which} to export (found "
                           f"{[g.generation for g in scanned] or 'none'})")
    refused: list[dict[str, str]] = []
    for info in candidates:
        try:
            state = io.read_model(store, info)
        except CorruptCheckpoint as e:
            if generation is not None:
                raise
            refused.append({"path": info.path, "reason": str(e)})
            continue
        m = info.manifest
        assert m is not None  # read_model refuses a generation without one
        lineage = {"run_id": m.run_id, "generation": m.generation,
                   "incarnation": m.incarnation, "step": m.step}
        if isinstance(m.origin, dict) and m.origin.get("run_id"):  # a warm start's parent
            lineage["origin"] = {k: m.origin.get(k) for k in ("operation", "run_id",
                                                               "generation")}
        try:
            doc = _write(state, out, m.identity, lineage, dtype, adapter, base_revision, None,
                         None)
        except UnsupportedValue as e:  # (what of this generation cannot be exported: named)
            raise UnsupportedValue(f"{info.path} [model]: {e}") from None
        return {**doc, "refused": refused}
    raise CorruptCheckpoint(f"{store.root}: no generation verifies; nothing exported:\n" +
                            "\n".join(f"  {r['path']}: {r['reason']}" for r in refused))


def verify_export(out: str | os.PathLike[str], model: torch.nn.Module,
                  inputs: Inputs | None = None, rtol: float | None = None,
                  atol: float | None = None, *, load: bool = True) -> dict[str, Any]:
    """Check the export in ``out`` against ``model`` and return a report.

    Re-hashes the exported files against ``export.json`` (`CorruptCheckpoint` when one
    differs); loads ``model.safetensors`` into ``model`` (strict: every key must match;
    an adapter export's keys must all exist in the model; `StateMismatch` otherwise) unless
    ``load=False`` (a model already built from the export: merged, cast, moved); then runs the
    recorded fixed inputs (or ``inputs``: the same inputs prepared otherwise) through the
    model, moved to the model's device (floating inputs in the model's dtype), in eval mode
    without autograd, and compares every output with its recording. Bitwise when the export
    was not cast, was recorded on the CPU and loads into a CPU model of the same dtypes (the
    same torch and thread count assumed); otherwise within ``max |got - recorded| <= atol +
    rtol * max |recorded|`` per output, by default per the lowest precision involved:
    fp32 1e-4, fp16 (and TF32 on a GPU) 2e-3, bf16 2e-2 (`TOLERANCES`). Giving ``rtol`` or
    ``atol`` always compares within a tolerance (the other from the defaults). Raises
    `StateMismatch` when an output is outside it."""
    out = os.path.abspath(os.fspath(out))
    doc = read_export(out)
    weights = doc["weights"]
    path = io.hash_checked(out, weights, WEIGHTS)
    report: dict[str, Any] = {"out": out, "ok": True, "weights": {
        "file": WEIGHTS, "xxh3_128": weights["xxh3_128"], "verified": True}, "loaded": 0,
        "outputs": [], "mode": None, "checksum": doc.get(CHECKSUM)}
    if CHECKSUM not in doc:
        warnings.warn(UnbrokenWarning(
            f"{out}/{EXPORT_JSON}: has no checksum (written by an older unbroken): its fields "
            "(identity, lineage, dtypes, whether fixed inputs were recorded) are not verified, "
            "only the files' hashes it lists; export again to seal it"), stacklevel=2)
    # (the export's names are the uncompiled model's: a compiled one's map onto them)
    named = {served_name(k): k for k in model.state_dict()}
    live_dtypes = {served_name(k): t.dtype for k, t in model.state_dict().items()
                   if isinstance(t, torch.Tensor)}
    listed = weights.get("tensors")
    exact = isinstance(listed, dict) and all(  # the model computes in the exported dtypes
        k in live_dtypes and io.dtype_name(live_dtypes[k]) == v.get("dtype")
        for k, v in listed.items() if isinstance(v, dict))
    if load:
        state = _tensors(path)
        unknown = sorted(set(state) - set(named))
        if unknown:
            raise StateMismatch(f"{path}: tensors {unknown[:5]} are not in the model "
                                f"({type(model).__name__}); build the model the export is of")
        state = {named[k]: v for k, v in state.items()}
        try:
            model.load_state_dict(with_versions(model, state),
                                  strict=not doc.get("adapter"))
        except RuntimeError as e:
            raise StateMismatch(f"{path}: does not load into {type(model).__name__} "
                                f"({e!s:.400})") from None
        report["loaded"] = len(state)
    fixed = doc.get("fixed_inputs")
    if not fixed and os.path.lexists(os.path.join(out, FIXED)):
        raise CorruptCheckpoint(f"{out}/{EXPORT_JSON}: records no fixed inputs, yet {FIXED} is "
                                "there (export writes both or neither): export.json was edited; "
                                "export again from the run")
    if not fixed:
        if inputs is not None:
            raise MissingState(f"{out}: the export recorded no outputs to compare with; export "
                               "with inputs= to record them")
        return report
    recorded = _tensors(io.hash_checked(out, fixed, FIXED))
    # Each recorded input in fresh (64-byte aligned) memory, as the recording run held it: a
    # reader's tensor sits where the file puts it, and vectorized kernels (a matmul's
    # reductions) round differently at other alignments.
    packed = ({k: v.clone() for k, v in recorded.items() if k.startswith(("args.", "kwargs."))}
              if inputs is None else io.pack_inputs(inputs))
    want = {k: v for k, v in recorded.items() if k == "output" or k.startswith("output.")}
    got = io.run_fixed(model, packed)
    if set(got) != set(want):
        raise StateMismatch(f"{out}: the model's outputs are {sorted(got)[:5]}, the export "
                            f"recorded {sorted(want)[:5]}")
    device, _ = io.model_device_dtype(model)
    bitwise = (rtol is None and atol is None and exact and not weights.get("cast")
               and device.type == "cpu" and fixed["recorded"].get("device") == "cpu")
    dtypes = [*map(io.dtype_name, (*live_dtypes.values(), *(t.dtype for t in got.values()),
                                   *(t.dtype for t in want.values()))),
              *(str(v.get("dtype")) for v in (listed or {}).values() if isinstance(v, dict))]
    kind = io.tolerance_class(dtypes, device)
    r = TOLERANCES[kind][0] if rtol is None else rtol
    a = TOLERANCES[kind][1] if atol is None else atol
    rows = [io.compare(k, got[k], want[k], bitwise, r, a) for k in want]
    report.update(mode="bitwise" if bitwise else "tolerance", outputs=rows,
                  tolerance=None if bitwise else {"class": kind, "rtol": r, "atol": a})
    bad = [row for row in rows if not row["ok"]]
    if bad:
        env = fixed["recorded"]
        raise StateMismatch(
            f"{out}: {len(bad)} of {len(rows)} outputs differ from the recording: " +
            "; ".join(_why(row) for row in bad[:3]) +
            (f" (recorded with torch {env.get('torch')} on {env.get('num_threads')} threads; "
             f"now torch {torch.__version__} on {torch.get_num_threads()}: bitwise needs the "
             "same; pass rtol= to compare within a tolerance)" if bitwise else ""))
    return report


def read_export(out: str) -> dict[str, Any]:
    """``export.json`` of the export in ``out``, checked for its checksum (when it has one:
    exports written before it was added have none) and its schema."""
    where = os.path.join(out, EXPORT_JSON)
    try:
        doc = loads_json(LocalFS().read_file(where, io.MAX_EXPORT_JSON), where,
                         io.MAX_EXPORT_JSON)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{where}: missing; {out} is not an unbroken export") from None
    if isinstance(doc, dict) and CHECKSUM in doc:
        try:
            check_seal(doc, where, SCHEMA, EXPORT_JSON)
        except CorruptCheckpoint as e:
            raise CorruptCheckpoint(f"{e}: a field was edited or damaged after export; export "
                                    "again from the run, or restore the folder from a copy"
                                    ) from None
    fixed = doc.get("fixed_inputs") if isinstance(doc, dict) else None
    weights = doc.get("weights") if isinstance(doc, dict) else None
    listed = weights.get("tensors") if isinstance(weights, dict) else None
    if (not isinstance(doc, dict) or doc.get("schema") != SCHEMA
            or not isinstance(weights, dict)
            or not (listed is None or isinstance(listed, dict)
                    and all(isinstance(v, dict) for v in listed.values()))
            or not (fixed is None or isinstance(fixed, dict)
                    and isinstance(fixed.get("recorded"), dict))):
        raise CorruptCheckpoint(f"{where}: not an export document (schema {SCHEMA})")
    return doc


def _tensors(path: str) -> dict[str, torch.Tensor]:
    """The tensors of an export's safetensors file (already hash-checked against
    ``export.json``), its header validated first: a damaged file is a `CorruptCheckpoint`
    naming it, never the parser's own error."""
    data = LocalFS().read_file(path, os.path.getsize(path))
    return decode_safetensors(data, path)[0]


# -- writing --------------------------------------------------------------------------------


def _served(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state`` under its served names (`served_name`), unless two names would become one."""
    renamed = {served_name(k): v for k, v in state.items()}
    return renamed if len(renamed) == len(state) else state


def _write(state: Mapping[str, Any], out: str, identity: Any, lineage: dict[str, Any],
           dtype: str | None, adapter: str | Iterable[str] | None, base_revision: str | None,
           generation_config: Any, fixed: dict[str, Any] | None) -> dict[str, Any]:
    """The export folder of the model state ``state`` (what both exports share)."""
    from .. import __version__  # here: the package imports this module's users first

    ident = _identity(identity, generation_config)
    base_revision = base_revision or ident.get("base_revision")
    io.check_base_revision(base_revision, adapter is not None)
    if base_revision is not None:
        ident["base_revision"] = base_revision
    state = _served(state)
    if adapter is not None:  # (named as the compiled model's state_dict shows them, or not)
        adapter = (served_name(adapter) if isinstance(adapter, str)
                   else [served_name(a) for a in adapter])
    names = io.select(state, adapter)
    tensors, cast = io.prepare(state, names, dtype)
    files: dict[str, Any] = {WEIGHTS: encode_safetensors(tensors, {"format": "pt"})}
    if fixed is not None:
        files[FIXED] = encode_safetensors(fixed["tensors"], {"format": "pt"})
    doc: dict[str, Any] = {
        "schema": SCHEMA, "kind": "adapter" if adapter is not None else "full",
        "weights": {"file": WEIGHTS, "dtype": dtype, "cast": cast, "tensors": {
            k: {"dtype": io.dtype_name(t.dtype), "shape": list(t.shape)}
            for k, t in tensors.items()}},
        "adapter": ({"base_revision": base_revision, "tensors": len(tensors)}
                    if adapter is not None else None),
        "identity": ident, "lineage": lineage,
        "fixed_inputs": None if fixed is None else {
            "file": FIXED, "inputs": fixed["inputs"], "outputs": fixed["outputs"],
            "recorded": fixed["recorded"]},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "unbroken": __version__}
    try:
        dumps_json(doc)  # identity and lineage must be JSON: fail before writing anything
    except (TypeError, ValueError) as e:
        raise UnsupportedValue(f"export: identity and lineage must be JSON ({e})") from None

    def document(done: dict[str, tuple[int, str]]) -> bytes:
        for name, entry in ((WEIGHTS, doc["weights"]), (FIXED, doc["fixed_inputs"])):
            if name in done:
                entry.update(bytes=done[name][0], xxh3_128=done[name][1])
        # Sealed as a manifest is (an edited field is corruption), over the fields as a
        # reader parses them back: a non-string key of the identity comes back a string.
        doc[CHECKSUM] = checksum(json.loads(json.dumps(doc, ensure_ascii=True, allow_nan=False)))
        # indented: people read it; ASCII: any name (a lone surrogate too) survives
        return json.dumps(doc, indent=2, ensure_ascii=True, allow_nan=False).encode() + b"\n"

    files[EXPORT_JSON] = document
    io.write_folder(out, files)
    return {**doc, "path": out}


def _identity(identity: Any, generation_config: Any) -> dict[str, Any]:
    if identity is None:
        found: dict[str, Any] = {}
    elif isinstance(identity, Identity):
        found = identity.fingerprint()
    elif isinstance(identity, Mapping):
        found = dict(identity)
    else:
        raise TypeError(f"identity must be an Identity or a mapping, not "
                        f"{type(identity).__name__}")
    found.pop("data", None)  # the training data's identity names its paths: not exported
    if generation_config is not None:
        to_dict = getattr(generation_config, "to_dict", None)
        found["generation_config"] = dict(to_dict() if callable(to_dict) else generation_config)
    return found


def _why(row: dict[str, Any]) -> str:
    if "why" in row:
        return f"{row['name']}: {row['why']}"
    if row["mode"] == "bitwise":
        return f"{row['name']}: {row['elements_differing']} elements not bitwise equal"
    return (f"{row['name']}: max |diff| {row['max_abs_diff']:.3g} over the bound "
            f"{row['bound']:.3g}")
