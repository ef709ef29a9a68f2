"""``unbroken audit PATH``: read a foreign checkpoint without executing anything and say which
continuation parts it holds (DESIGN.md, "CLI contract").

Recognised: a torch.save file (zip or legacy), a Lightning ``.ckpt``, a Hugging Face Trainer
``checkpoint-N/`` folder, an Accelerate ``save_state`` folder, a DCP folder, a bare safetensors
file, a ``save_pretrained`` model folder. Pickles are interpreted symbolically
(`._pickle_scan`): nothing is imported or called, neither Python's unpickler nor torch's loader
is ever used. Every global a pickle references is classified; one that would import code is
flagged (exit 1). The parts are found by the shape of the data (an optimizer state dict has
``state`` and ``param_groups``; a torch RNG state is a 5056-byte uint8 tensor; ...) and, in
folders, by the file names each library writes."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field
from typing import Any

from .._commands import arg, emit, tool
from .._runview import UsageError
from .._table import table
from ..errors import CorruptCheckpoint, shown
from ..state.jsontext import loads_json
from ..state.stheader import read_safetensors_header
from . import _pickle_files as pfiles
from . import _pickle_scan as ps
from ._audit_parts import Findings, find_parts, parts_table, verdict, where_text, why_text

MAX_JSON_BYTES = 64 * 1024 * 1024
_PICKLED = (".bin", ".pt", ".pth", ".pkl", ".ckpt", ".pickle")
_IDENTITY_FILES = re.compile(r"config\.json|generation_config\.json|tokenizer(_config)?\.json|"
                             r"special_tokens_map\.json|tokenizer\.model|vocab\.(txt|json)|"
                             r"merges\.txt|training_args\.bin|preprocessor_config\.json")
_RANK = re.compile(r"_(\d+)\.(pth|pkl|pt|bin)$")


@dataclass
class FileReport:
    """One file read: its format, the globals its pickles name (by class) and problems."""
    name: str
    format: str
    code: list[str] = field(default_factory=list)
    numpy: list[str] = field(default_factory=list)
    unresolved: int = 0
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def flagged(self) -> bool:
        return bool(self.code or self.unresolved or self.errors)


@dataclass
class Audit:
    """The result: what PATH is, the files read, the parts found."""
    path: str
    kind: str
    files: list[FileReport] = field(default_factory=list)
    found: Findings = field(default_factory=Findings)
    notes: list[str] = field(default_factory=list)

    def read(self, full: str, name: str, rank: int | None = None, walk: bool = True
             ) -> pfiles.PickleFile | None:
        """Read one file of a folder (or the file itself) by its kind; record what it says."""
        if name.endswith(".safetensors"):
            tensors = self._safetensors(full, name)
            if tensors is not None and "optim" not in name:
                self.found.model.append(f"{name}: {tensors} tensors")
            return None
        if name.endswith(".json"):
            return None
        try:
            pf = pfiles.read_pickle_file(full)
        except (CorruptCheckpoint, OSError) as e:
            self.files.append(FileReport(name, "unreadable", errors=[str(e)]))
            return None
        if pf.not_pickle:
            self.files.append(FileReport(name, "not a pickle (not read)"))
            return pf
        report = FileReport(name, pf.format, notes=list(pf.notes), errors=pf.errors,
                            unresolved=pf.unresolved)
        for g in pf.globals():
            kind = ps.classify(g)
            if kind == "code":
                report.code.append(g)
            elif kind == "numpy":
                report.numpy.append(g)
        self.files.append(report)
        if walk:
            find_parts(pf.root, name if self.kind != "file" else "", self.found, rank)
        return pf

    def _safetensors(self, full: str, name: str) -> int | None:
        """The number of tensors a safetensors header names; the header only is read."""
        try:
            with pfiles.open_regular(full) as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                n = int.from_bytes(head, "little")
                # (what every reader checks: dtypes, shapes, offsets tiling the data; only
                # the header is read, never the tensors)
                header, _ = read_safetensors_header(
                    head + (f.read(n) if len(head) == 8 and n <= min(MAX_JSON_BYTES, size)
                            else b""), name, MAX_JSON_BYTES, size=size)
        except (CorruptCheckpoint, OSError) as e:
            self.files.append(FileReport(name, "safetensors", errors=[str(e)]))
            return None
        count = len(header)
        self.files.append(FileReport(name, f"safetensors ({count} tensors, header only)"))
        return count


# -- what PATH is -------------------------------------------------------------------------------


def audit_path(path: str) -> Audit:
    """Audit a file or folder; raise UsageError when it is not a recognised checkpoint."""
    if not os.path.exists(path):
        raise UsageError(f"{path}: no such file or folder")
    if os.path.isdir(path):
        return _audit_folder(path)
    if not os.path.isfile(path):
        raise UsageError(f"{path}: not a regular file or folder")
    audit = Audit(path, "file")
    name = os.path.basename(path)
    if name.endswith(".safetensors"):
        audit.kind = "safetensors file"
        if audit._safetensors(path, name) is None:
            raise UsageError(f"{path}: not a safetensors file ({audit.files[-1].errors[0]})")
        audit.found.model.append("(the whole file)")
        return audit
    pf = audit.read(path, name)
    if pf is None and audit.files and audit.files[-1].format == "unreadable":
        raise UsageError(f"{path}: {audit.files[-1].errors[0]}")
    if pf is None or audit.files[-1].format == "not a pickle (not read)":
        raise UsageError(f"{path}: not a recognised checkpoint (neither a torch.save file, a "
                         "pickle, a safetensors file nor a checkpoint folder)")
    audit.kind = pf.format
    root = pf.root
    if isinstance(root, dict) and ("pytorch-lightning_version" in root or (
            "state_dict" in root and ("loops" in root or "optimizer_states" in root))):
        audit.kind = f"Lightning checkpoint ({pf.format})"
    return audit


def _listing(path: str) -> list[str]:
    with os.scandir(path) as it:
        return sorted(e.name for e in it if e.is_file())


def _audit_folder(path: str) -> Audit:
    names = _listing(path)
    has = set(names)
    if "MANIFEST.json" in has or any(
            d.startswith("gen-") and os.path.isfile(os.path.join(path, d, "MANIFEST.json"))
            for d in os.listdir(path)):
        audit = Audit(path, "unbroken run")
        audit.notes.append("an unbroken run or generation: use `unbroken inspect` / "
                           "`unbroken verify` on the run folder")
        return audit
    if ".metadata" in has:
        return _audit_dcp(path, names)
    if "trainer_state.json" in has or "training_args.bin" in has:
        kind = "Hugging Face Trainer checkpoint"
    elif any(n.startswith(("random_states_", "custom_checkpoint_")) or re.fullmatch(
            r"(optimizer|scheduler|sampler|dl_state_dict)(_\d+)?\.bin", n) for n in names):
        kind = "Accelerate save_state folder"
    elif any(n.endswith(".safetensors") or re.fullmatch(r"pytorch_model.*\.bin", n)
             for n in names):
        kind = "model folder (weights only)"
    else:
        raise UsageError(f"{path}: not a recognised checkpoint folder (no torch.save, Trainer, "
                         "Accelerate, DCP or safetensors files)")
    audit = Audit(path, kind)
    for n in names:
        full = os.path.join(path, n)
        m = _RANK.search(n)
        rank = int(m.group(1)) if m and n.startswith(("rng_state", "random_states")) else None
        if n.endswith(".safetensors") or n.endswith(_PICKLED):
            audit.read(full, n, 0 if rank is None and n.startswith("rng_state") else rank)
        if _IDENTITY_FILES.fullmatch(n):
            audit.found.identity.append(n)
        if n.endswith(".index.json") and ("model" in n):
            audit.found.model.append(f"{n}: sharded weights index")
        if re.fullmatch(r"(sampler|dl_state_dict)(_\d+)?\.bin", n):
            audit.found.data.append(n)
    if kind.startswith("Accelerate"):
        # random_states_*.pkl holds Accelerate's step counter, but load_state restores no
        # data position: only a stateful dataloader or seedable sampler file does.
        audit.found.counters = [c for c in audit.found.counters
                                if not c.startswith("random_states_")]
        if not audit.found.data:
            audit.notes.append("Accelerate saves the data position only for a stateful "
                               "dataloader (dl_state_dict.bin) or its seedable sampler "
                               "(sampler.bin); skip_first_batches is up to the script")
    if "training_args.bin" in has:
        audit.notes.append("training_args.bin is a pickled TrainingArguments: the Trainer "
                           "does not need it to resume; never load it from a stranger")
    if "trainer_state.json" in has:
        _trainer_state(audit, os.path.join(path, "trainer_state.json"))
    if any(d.startswith("global_step") for d in os.listdir(path)):
        audit.notes.append("a DeepSpeed global_step* folder holds the optimizer: not read")
    return audit


def _trainer_state(audit: Audit, where: str) -> None:
    try:
        with pfiles.open_regular(where) as f:
            state = loads_json(f.read(MAX_JSON_BYTES + 1), where, MAX_JSON_BYTES)
    except (CorruptCheckpoint, OSError) as e:
        audit.files.append(FileReport("trainer_state.json", "JSON", errors=[str(e)]))
        return
    if isinstance(state, dict) and "global_step" in state:
        audit.found.counters.append(
            f"trainer_state.json: global_step {state['global_step']}, epoch "
            f"{state.get('epoch')}; the Trainer skips that many batches of a re-drawn order")


def _audit_dcp(path: str, names: list[str]) -> Audit:
    """A torch.distributed.checkpoint folder: ``.metadata`` (a pickle) names every entry of
    the saved state dict; bytes entries are torch.save archives inside the shards."""
    audit = Audit(path, "DCP checkpoint (torch.distributed.checkpoint)")
    pf = audit.read(os.path.join(path, ".metadata"), ".metadata", walk=False)
    md = pf.root if pf is not None else None
    state = md.state if isinstance(md, ps.Call) and isinstance(md.state, dict) else {}
    entries = state.get("state_dict_metadata")
    planner = state.get("planner_data")
    if not isinstance(entries, dict):
        audit.notes.append(".metadata names no state entries that could be read")
        return audit
    tree: dict[Any, Any] = {}
    as_bytes = {k for k, v in entries.items()
                if isinstance(v, ps.Call) and v.name.endswith("BytesStorageMetadata")}
    bytes_at = _dcp_bytes(path, state.get("storage_data"), as_bytes, audit)
    for fqn, meta in entries.items():
        keys = planner.get(fqn) if isinstance(planner, dict) else None
        # (plain keys, a bounded path: a planner entry may be a list shared by every entry,
        # 100,000 long, or hold unhashable values)
        keys = tuple(keys) if isinstance(keys, (tuple, list)) and 0 < len(keys) <= 64 and all(
            type(k) in (str, int) for k in keys) else (fqn,)
        leaf: Any = bytes_at.get(fqn, "<bytes>")
        if isinstance(meta, ps.Call) and meta.name.endswith("TensorStorageMetadata"):
            st = meta.state if isinstance(meta.state, dict) else {}
            size = st.get("size")
            prop = st.get("properties")
            dtype = prop.args[0] if isinstance(prop, ps.Call) and isinstance(
                prop.args, tuple) and prop.args else None
            leaf = ps.Tensor(tuple(size) if isinstance(size, tuple) else None,
                             dtype.name if isinstance(dtype, ps.Global) else None)
        node = tree
        for k in keys[:-1]:
            nxt = node.get(k)
            if not isinstance(nxt, dict):
                nxt = node[k] = {}
            node = nxt
        node[keys[-1]] = leaf
    find_parts(tree, "", audit.found, None)
    audit.notes.append(f".metadata names {len(entries)} entries; shards: "
                       + (", ".join(n for n in names if n.endswith(".distcp")) or "none"))
    return audit


MAX_DCP_BYTES = 4 << 30  # bytes entries read per DCP folder, all together


def _dcp_bytes(path: str, storage: Any, as_bytes: set[Any], audit: Audit) -> dict[Any, Any]:
    """Scan every bytes entry (DCP loads it with torch's full loader, not the weights-only
    one: a torch.save archive, or any pickle) for globals; return each entry's value as far as it
    is plain data. An entry whose range cannot be read is reported, flagged."""
    out: dict[Any, Any] = {}
    if not isinstance(storage, dict):
        return out
    budget = MAX_DCP_BYTES
    done: dict[tuple[str, int, int], Any] = {}  # (one read per range, however often named)
    for index, info in storage.items():
        fqn = index.state.get("fqn") if isinstance(index, ps.Call) and isinstance(
            index.state, dict) else None
        if type(fqn) is not str or fqn not in as_bytes:
            continue  # a tensor: its bytes are data, never read
        st = info.state if isinstance(info, ps.Call) and isinstance(info.state, dict) else {}
        rel, offset, length = st.get("relative_path"), st.get("offset"), st.get("length")
        label = (f"{rel[:80] if isinstance(rel, str) else '?'}@"
                 f"{shown(offset) if type(offset) is int else '?'} ({fqn[:200]})")
        try:
            if not (isinstance(rel, str) and type(offset) is int and type(length) is int):
                raise CorruptCheckpoint("its storage record names no file, offset and length")
            if "/" in rel or "\\" in rel or rel.startswith("."):
                raise CorruptCheckpoint(f"its file {rel!r} is not in the checkpoint folder")
            if offset < 0 or length < 0:
                raise CorruptCheckpoint(f"a negative offset or length ({offset}, {length})")
            if length > min(pfiles.MAX_PICKLE_BYTES, budget):
                raise CorruptCheckpoint(f"{length} bytes: too large to scan")
            if (rel, offset, length) not in done:
                budget -= length
                done[(rel, offset, length)] = _dcp_entry(os.path.join(path, rel), offset,
                                                         length)
            pf = done[(rel, offset, length)]
        except (CorruptCheckpoint, OSError) as e:
            audit.files.append(FileReport(label, "DCP bytes entry", errors=[
                f"{path}: bytes entry {label}: {e}"]))
            continue
        code = [g for g in pf.globals() if ps.classify(g) == "code"]
        if code or pf.unresolved or pf.errors:
            audit.files.append(FileReport(label, pf.format, code=code,
                                          unresolved=pf.unresolved, errors=pf.errors))
        out[fqn] = pf.root
    return out


def _dcp_entry(where: str, offset: int, length: int) -> pfiles.PickleFile:
    """The bytes entry at ``offset`` in the shard ``where``, scanned; its range must lie in
    the file (a regular one)."""
    with pfiles.open_regular(where) as f:
        size = os.fstat(f.fileno()).st_size
        if offset + length > size:
            raise CorruptCheckpoint(f"bytes {offset} to {offset + length} of {where}, which "
                                    f"holds {size}")
        f.seek(offset)
        blob = f.read(length)
    return pfiles.read_pickle_bytes(blob)


# -- the command --------------------------------------------------------------------------------


@tool("audit",
      arg("path", metavar="PATH", help="a torch.save / Lightning file, a Trainer, "
          "Accelerate or DCP folder, or a safetensors file"))
def _audit(args: argparse.Namespace) -> int:
    """Read PATH without executing anything (pickles are decoded instruction by instruction,
    never loaded) and report which continuation parts it holds: model, optimizer (and whether
    keyed by position), scheduler, scaler, RNG per stream and rank, data position, identity;
    with a verdict: can continue / warm start only / inference only. Every global a pickle
    references is classified; exit 1 when one would import code (a user or library class,
    os.system...), 0 otherwise, 2 when PATH is not a recognised checkpoint."""
    audit = audit_path(args.path)
    rows = parts_table(audit.found) if audit.kind != "unbroken run" else []
    verdict_text = verdict(rows) if rows else "unbroken run"
    flagged = [f for f in audit.files if f.flagged]
    code = sorted({g for f in audit.files for g in f.code})
    numpy = sorted({g for f in audit.files for g in f.numpy})
    ok = not flagged
    payload = {
        "path": audit.path, "kind": audit.kind, "verdict": verdict_text, "parts": rows,
        "files": [vars(f) | {"flagged": f.flagged} for f in audit.files],
        "would_import_code": code, "dangerous": [g for g in code if ps.dangerous(g)],
        "unresolved_globals": sum(f.unresolved for f in audit.files),
        "needs_numpy_globals": numpy, "notes": audit.notes, "ok": ok}
    lines = [f"{audit.path}: {audit.kind}"]
    if len(audit.files) > 1 or audit.kind.startswith(("Hugging", "Accelerate", "DCP")):
        lines += ["", table(("file", "format", "imports code"), [
            (f.name, f.format, ", ".join(f.code) or ("unresolved" if f.unresolved else "-"))
            for f in audit.files])]
    if rows:
        lines += ["", table(("part", "status", "detail (where)"), [
            (r["part"], r["status"], r["detail"] + where_text(r["where"]) * (r["part"] != "rng"))
            for r in rows])]
    lines += [""] + [f"note: {n}" for n in audit.notes]
    lines.append(f"verdict: {verdict_text}" + why_text(rows, verdict_text))
    for f in flagged:
        for g in f.code:
            lines.append(f"WOULD IMPORT CODE: {g} (in {f.name})"
                         + (" -- runs commands or code" if ps.dangerous(g) else ""))
        if f.unresolved:
            lines.append(f"WOULD IMPORT CODE: {f.unresolved} unresolved global(s) in {f.name}")
        lines += [f"unreadable: {e} (cannot be read in full; torch.load may run code from it)"
                  for e in f.errors]
    if numpy:
        lines.append("needs numpy globals (refused by torch.load(weights_only=True) unless "
                     "allowlisted): " + ", ".join(numpy))
    if flagged:
        lines.append("do not unpickle these files, nor open them with torch.load unless "
                     "weights_only is True")
    return emit(args, payload, "\n".join(lines), ok)
