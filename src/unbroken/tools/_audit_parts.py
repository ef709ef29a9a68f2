"""Finding the continuation parts in a foreign checkpoint's object tree, by the shape of the
data (an optimizer state dict has ``state`` and ``param_groups``; a torch RNG state is a
5056-byte uint8 tensor; ...), and the verdict they make (`tools.audit`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import shown
from . import _pickle_scan as ps

# -- finding the parts in an object tree, by the shape of the data ------------------------------

_DATA_KEYS = {"sampler", "sampler_state", "data", "dataloader", "data_loader", "loader",
              "dl_state", "dl_state_dict", "data_position", "cursor", "data_cursor",
              "consumed_samples", "consumed_train_samples", "samples_seen", "batch_sampler",
              "train_dataloader", "dataset_state"}
_COUNTER_KEYS = {"epoch", "global_step", "step", "steps", "iteration", "iter", "it",
                 "num_updates", "updates", "batch_idx", "loops"}
_IDENTITY_KEYS = {"config", "cfg", "args", "hparams", "hyper_parameters", "hyperparameters",
                  "model_config", "tokenizer", "identity", "data_revision", "training_args"}
_MAX_NODES = 200_000
# What the walk may spend on the paths it names (``file:key.key[3]``): a dict nested 23 deep
# under one memoized 1 MiB key would make a 23 MiB path for each of its entries.
_MAX_PATH_BYTES = 64 << 20
_KEY_SHOWN = 80  # characters of a key shown in a path


@dataclass
class Findings:
    """Where each continuation part was found (``file:key.path`` strings)."""
    model: list[str] = field(default_factory=list)
    optimizer: list[tuple[str, bool | None]] = field(default_factory=list)
    scheduler: list[str] = field(default_factory=list)
    scaler: list[str] = field(default_factory=list)
    rng: list[tuple[str, str, int | None]] = field(default_factory=list)  # stream, where, rank
    data: list[str] = field(default_factory=list)
    counters: list[str] = field(default_factory=list)
    identity: list[str] = field(default_factory=list)

    def rng_streams(self) -> dict[str, list[int | None]]:
        out: dict[str, list[int | None]] = {}
        for stream, _where, rank in self.rng:
            out.setdefault(stream, []).append(rank)
        return out


def _mapping(node: Any) -> dict[Any, Any] | None:
    """The dict a node stands for: a dict, or an object whose pickle stored items or a
    state dict into it (an OrderedDict subclass, a dataclass, Lightning's AttributeDict)."""
    if isinstance(node, dict):
        return node
    if isinstance(node, ps.Call):
        if node.items:
            return node.items
        if isinstance(node.state, dict):
            return node.state
    return None


def _rng_stream(node: Any, where: str) -> str | None:
    """The RNG stream a value is the state of, by its shape."""
    if isinstance(node, ps.Tensor) and node.dtype == "uint8":
        if node.shape == (5056,):  # the Mersenne Twister state of a torch CPU generator
            return "torch CPU"
        if node.shape == (16,) and "cuda" in where.lower():  # Philox seed and offset
            return "CUDA"
    if isinstance(node, list) and node and "cuda" in where.lower() and all(
            isinstance(t, ps.Tensor) and t.dtype == "uint8" for t in node):
        return "CUDA"
    if isinstance(node, tuple) and len(node) == 3 and node[0] == 3 and isinstance(
            node[1], tuple) and len(node[1]) == 625:
        return "python"  # random.getstate()
    if isinstance(node, tuple) and len(node) == 5 and node[0] == "MT19937":
        return "numpy"  # np.random.get_state()
    m = _mapping(node)
    if m is not None and isinstance(m.get("bit_generator"), str) and "state" in m:
        return "numpy"  # a Generator's bit_generator.state
    return None


def _weights(m: dict[Any, Any]) -> bool:
    """A model state dict: names mapping mostly to tensors that are not RNG states."""
    if not m or not all(isinstance(k, str) for k in m):
        return False
    tensors = sum(isinstance(v, ps.Tensor) and _rng_stream(v, "") is None for v in m.values())
    return tensors > 0 and 2 * tensors >= len(m)


def _positional(opt: dict[Any, Any]) -> bool | None:
    """Whether an optimizer state dict keys its state by parameter position (what
    ``optimizer.state_dict()`` writes) rather than by parameter name. Each list is looked
    at once (40,000 groups may share one 40,000-long params list), and the look stops at
    the first name."""
    state = _mapping(opt.get("state"))
    lists: list[Any] = [list(state)] if state else []
    groups = opt.get("param_groups")
    seen: set[int] = set()
    for group in groups if isinstance(groups, list) else []:
        g = _mapping(group)
        params = g.get("params") if g else None
        if isinstance(params, list) and id(params) not in seen:
            seen.add(id(params))
            lists.append(params)
    if not any(lists):
        return None
    return all(type(k) is int or (isinstance(k, str) and len(k) < 20 and k.isdigit())
               for keys in lists for k in keys)


def find_parts(root: Any, prefix: str, found: Findings, rank: int | None) -> None:
    """Walk a (symbolic) object tree and record every part whose shape it recognises."""
    seen: set[int] = set()
    todo: list[tuple[Any, str, int]] = [(root, prefix, 0)]
    spent = 0  # bytes of the paths made
    while todo and len(seen) < _MAX_NODES and spent < _MAX_PATH_BYTES:
        node, where, depth = todo.pop()
        if id(node) in seen or depth > 24:
            continue
        seen.add(id(node))
        label = where or "(top level)"
        stream = _rng_stream(node, where)
        if stream is not None:
            found.rng.append((stream, label, rank))
            continue
        if isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                if id(v) not in seen and spent < _MAX_PATH_BYTES:
                    todo.append((v, f"{where}[{i}]", depth + 1))
                    spent += len(where) + 8
            continue
        m = _mapping(node)
        if m is None:
            continue
        if "state" in m and "param_groups" in m:
            found.optimizer.append((label, _positional(m)))
        elif "last_epoch" in m and ("base_lrs" in m or "_last_lr" in m or "_step_count" in m):
            found.scheduler.append(label)
        elif "scale" in m and ("growth_factor" in m or "_growth_tracker" in m):
            found.scaler.append(label)
        elif _weights(m):
            found.model.append(f"{label}: {len(m)} entries")
        else:
            sep = "" if not where else ":" if depth == 0 else "."  # file:key.key
            for k, v in m.items():
                if spent >= _MAX_PATH_BYTES:
                    break
                path = (f"{where}{sep}{k[:_KEY_SHOWN]}" if isinstance(k, str)
                        else f"{where}[{_key_text(k)}]")
                spent += len(path)
                if isinstance(k, str) and depth < 3 and len(k) <= 64:
                    key = k.lower()
                    if key in _DATA_KEYS and not isinstance(v, ps.Tensor):
                        found.data.append(path)
                    elif key in _COUNTER_KEYS:
                        found.counters.append(path)
                    elif key in _IDENTITY_KEYS:
                        found.identity.append(path)
                if id(v) not in seen:
                    todo.append((v, path, depth + 1))


def _key_text(key: Any) -> str:
    """A non-string key as a path shows it (a tuple key is at most 64 deep: `_pickle_scan`
    refuses deeper ones, but its repr may still be long)."""
    try:
        return shown(key)
    except RecursionError:
        return f"<a {type(key).__name__}>"


# -- the verdict --------------------------------------------------------------------------------


def parts_table(found: Findings) -> list[dict[str, Any]]:
    """One row per continuation part: status present / partial / missing, and where."""
    rows: list[dict[str, Any]] = []

    def row(part: str, status: str, detail: str, where: list[str], **extra: Any) -> None:
        rows.append({"part": part, "status": status, "detail": detail, "where": where,
                     **extra})

    row("model", "present" if found.model else "missing",
        "weights" if found.model else "no weights found", found.model)
    opt = [w for w, _p in found.optimizer]
    positional = [p for _w, p in found.optimizer if p is not None]
    keyed = any(positional) if positional else None
    row("optimizer", "present" if opt else "missing",
        ("keyed by position (parameter order must match to restore)" if keyed else
         "keyed by name" if keyed is False else "state dict") if opt else "no optimizer state",
        opt, keyed_by_position=keyed)
    row("scheduler", "present" if found.scheduler else "missing",
        "LR scheduler state" if found.scheduler else "none (fine only if the run used none)",
        found.scheduler)
    row("scaler", "present" if found.scaler else "missing",
        "GradScaler state" if found.scaler else "none (needed only for fp16 AMP)",
        found.scaler)
    streams = found.rng_streams()
    cpu = "torch CPU" in streams
    row("rng", "present" if cpu else "partial" if streams else "missing",
        "; ".join(f"{s}{_ranks(r)}" for s, r in streams.items()) or "no RNG state",
        [w for _s, w, _r in found.rng], streams={s: r for s, r in streams.items()})
    data = "present" if found.data else "partial" if found.counters else "missing"
    row("data position", data,
        "sampler / loader state" if found.data else
        "counters only, no sampler or loader state" if found.counters else
        "no sampler, loader or step state", found.data or found.counters)
    row("identity", "present" if found.identity else "missing",
        "config / tokenizer / arguments" if found.identity else
        "nothing binds it to its config, tokenizer or data", found.identity)
    return rows


def _ranks(ranks: list[int | None]) -> str:
    known = sorted({r for r in ranks if r is not None})
    return f" (rank{'s' * (len(known) > 1)} {', '.join(map(str, known))})" if known else ""


def verdict(rows: list[dict[str, Any]]) -> str:
    """can continue / warm start only / inference only / no model weights."""
    status = {r["part"]: r["status"] for r in rows}
    if status["model"] == "missing":
        return "no model weights"
    training = ("optimizer", "scheduler", "scaler", "rng", "data position")
    if all(status[p] == "missing" for p in training):
        return "inference only"
    if all(status[p] != "missing" for p in ("optimizer", "rng", "data position")):
        return "can continue"
    return "warm start only"


def where_text(where: list[str]) -> str:
    if not where:
        return ""
    shown = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
    return f" ({shown})"


def why_text(rows: list[dict[str, Any]], verdict_text: str) -> str:
    status = {r["part"]: r["status"] for r in rows}
    if verdict_text == "warm start only":
        return " (missing: " + ", ".join(p for p in ("optimizer", "rng", "data position")
                                         if status[p] == "missing") + ")"
    partial = [p for p, s in status.items() if s == "partial"]
    if verdict_text == "can continue" and partial:
        return " (partly: " + ", ".join(partial) + "; see the table)"
    return ""
