"""The saved model state against the live model: its keys (a name the live model ties to a
saved one filled in from it), shapes and dtypes, the lazy, meta and sharded tensors a
continuation cannot restore into, and a warm start's cast that would overflow."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CorruptCheckpoint, StateMismatch, UnbrokenWarning
from .fresh import fresh_names, suggested
from .livemodel import LiveModel
from .names import under_live_names
from .views import UNINITIALIZED


def validate_model(saved: Mapping[str, Any], model: torch.nn.Module, where: str,
                   dtypes: bool = True, live: Mapping[str, Any] | None = None,
                   fresh: tuple[str, ...] = ()) -> Mapping[str, Any]:
    """Keys, shapes and (for a continuation) dtypes of a saved model state against the live
    model; returns the state to load. A warm start may change precision (fp32 weights into a
    bf16 model): load_state_dict converts. A name the live model ties to a saved one (one
    tensor under two names, as a language model's output layer shares the input embedding) is
    filled in from it: a checkpoint written elsewhere (``save_pretrained``, an import) keeps
    only one name, and loading that one fills both. ``live``: the model's tensors by name
    (`LiveModel.live_tensors`), when known already. ``fresh``: a warm start's names left as
    they are (`fresh.fresh_names`)."""
    if not isinstance(saved, Mapping):
        raise CorruptCheckpoint(f"{where}: the model state is not a mapping of tensors")
    if live is None:
        live = LiveModel(model).live_tensors()
    kept: frozenset[str] = frozenset()
    hint = None
    if fresh:  # (the names kept are left out of the load, and of every check below)
        # (what the names say of a wrapper, before the fresh ones are left out)
        hint = _wrapped([k for k in live if k not in saved], [k for k in saved if k not in live])
        saved, kept = fresh_names(saved, live, fresh, where)
    if not dtypes and saved.keys() != live.keys():  # a warm start: a new run, whatever it wraps
        saved = under_live_names(saved, live, partial=bool(fresh))
    missing = [k for k in live if k not in saved and k not in kept]
    if missing:
        try:
            held = {_view(t): k for k, t in live.items()
                    if k in saved and isinstance(t, torch.Tensor)}
            tied = {k: held[_view(live[k])] for k in missing
                    if isinstance(live[k], torch.Tensor) and live[k].numel()
                    and _view(live[k]) in held}
        except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
            tied = {}
        saved = {**saved, **{k: saved[v] for k, v in tied.items()}}
        missing = [k for k in missing if k not in tied]
    unexpected = [k for k in saved if k not in live]
    if missing or unexpected:
        raise StateMismatch(f"{where}: model keys differ: missing {missing[:5]}, unexpected "
                            f"{unexpected[:5]}; " + (hint or _wrapped(missing, unexpected)) + (
                                "" if dtypes else "; a warm start leaves names as they are "
                                "live, or skips saved ones, with restore(..., fresh=[pattern, "
                                "...])"))
    names = [k for k, t in live.items()  # (its tensors)
             if type(t) in _PLAIN_TENSORS and k not in kept]
    _check_ties(saved, live, names, where, continuation=dtypes)
    saved = _unwritable(saved, live, names, where)
    reshaped: list[tuple[str, str]] = []  # (a warm start's: all named, and what keeps them)
    for k, t in live.items():
        if k in kept:
            continue
        s = saved[k]
        if not isinstance(t, torch.Tensor):  # a module's extra state: its set_extra_state's
            continue
        if isinstance(t, UNINITIALIZED):  # (a lazy module's: it has no shape yet)
            raise StateMismatch(f"{where}: live model tensor {k!r} is uninitialized (a lazy "
                                "module, e.g. LazyLinear, that has not run yet) and cannot take "
                                "the saved one; run one forward pass, or otherwise materialize "
                                "the lazy modules, before restore()")
        if t.is_meta:  # (copying into it does nothing: the restore would "succeed" empty)
            raise StateMismatch(f"{where}: live model tensor {k!r} is on the meta device and "
                                "holds no memory to restore into; materialize the model "
                                "first (e.g. model.to_empty(device='cpu')), then restore()")
        if type(t) not in _PLAIN_TENSORS and type(s) is not type(t):
            from ..dist.sharded import is_sharded  # (imports DTensor only where one is live)

            if is_sharded(t) and not is_sharded(s):  # (checked here: before any live change)
                raise StateMismatch(
                    f"{where}: model tensor {k!r} is sharded in the live model (a DTensor, "
                    "FSDP2) but was saved unsharded: a generation saved without sharding "
                    "cannot be loaded into an FSDP2 model; continue it with the model as it "
                    "was saved (unsharded), or save it from a sharded job")
        if (not isinstance(s, torch.Tensor) or s.shape != t.shape
                and not _resizes(model, k) or dtypes and s.dtype != t.dtype):
            found = (f"{tuple(s.shape)} {s.dtype}" if isinstance(s, torch.Tensor)
                     else type(s).__name__)
            said = (f"model tensor {k!r}: expected {tuple(t.shape)} {t.dtype} (live model), "
                    f"found {found}")
            if not dtypes and isinstance(s, torch.Tensor):
                reshaped.append((k, said))
                continue
            remedy = ("build the model as in the saved run (its shapes and dtypes), or "
                      "warm_start a new run from the weights" if dtypes else
                      "a warm start takes weights of the live model's shapes only")
            raise StateMismatch(f"{where}: {said}; {remedy}")
        if s.dtype != t.dtype and (peak := cast_overflow(s, t.dtype)) is not None:
            # (a warm start's cast: load_state_dict would make these finite weights inf)
            raise StateMismatch(
                f"{where}: model tensor {k!r} holds finite {s.dtype} values up to "
                f"{peak:.6g} in magnitude, beyond the live model's {t.dtype} (largest "
                f"{torch.finfo(t.dtype).max:.6g}): the cast would make them inf or nan; "
                "warm start into a model of a wider dtype (e.g. float32), then convert")
    if reshaped:
        raise StateMismatch(
            f"{where}: {len(reshaped)} model tensor(s) of another shape: "
            f"{'; '.join(said for _, said in reshaped[:5])}{'; ...' if len(reshaped) > 5 else ''}"
            "; a warm start takes weights of the live model's shapes only, or leaves those as "
            f"they are live with restore(..., fresh={suggested(k for k, _ in reshaped)!r})")
    return saved


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _unwritable(saved: Mapping[str, Any], live: Mapping[str, Any], names: list[str],
                where: str) -> Mapping[str, Any]:
    """A live tensor whose elements share memory (an expanded view, stride 0: a table of
    position ids broadcast to a batch) takes no copy (torch refuses to write it): one whose
    saved value is the value it holds is left as it is (its own tensor given in the saved
    one's place: a copy of a tensor into itself does nothing); any other is refused here,
    before anything live changed."""
    if all(map(torch.Tensor.is_contiguous, map(live.__getitem__, names))):
        return saved  # (the usual model: one pass, no more)
    odd = [k for k in names if not live[k].is_contiguous()]
    same: dict[str, torch.Tensor] = {}
    for k in odd:
        t = live[k]
        if not torch._debug_has_internal_overlap(t) == 1:  # (1: some elements share memory)
            continue
        if not _same_value(t, saved[k]):
            raise StateMismatch(
                f"{where}: live model tensor {k!r} is an expanded view (shape "
                f"{tuple(t.shape)}, strides {tuple(t.stride())}: its elements share memory) "
                "and cannot take the saved value, which differs from the one it holds; "
                "register it as a tensor of its own (.clone()), or as persistent=False if "
                "it is derived, and restart from the run's start")
        same[k] = t
    return {**saved, **same} if same else saved


def _check_ties(saved: Mapping[str, Any], live: Mapping[str, Any], names: list[str],
                where: str, continuation: bool) -> None:
    """Names the live model holds as one tensor (tied weights, a module shared under two
    names) must hold one value in the checkpoint: loading two different ones into it keeps
    whichever comes last, silently. A continuation also warns of names saved as one tensor
    that the live model holds apart: the saved run trained them as one. (``names``: the
    live model's plain tensors.)"""
    try:
        ptrs = list(map(torch.Tensor.data_ptr, map(live.__getitem__, names)))
    except (RuntimeError, NotImplementedError):  # (a tensor without storage: nothing to tie)
        return
    if len(set(ptrs)) != len(ptrs):  # (the usual model ties nothing: one pass, no more)
        dup = {p for p, n in Counter(ptrs).items() if n > 1 and p}  # (0: empty tensors)
        groups: dict[Any, list[str]] = {}
        for k, p in zip(names, ptrs, strict=True):
            if p in dup:
                # (a view of another dtype, `scale.view(torch.int32)`, is not the same tensor)
                groups.setdefault((_view(live[k]), live[k].dtype), []).append(k)
        for tied in groups.values():
            first = saved[tied[0]]
            for other in tied[1:]:
                if _same_value(first, saved[other]):
                    continue
                said = (f"{where}: the live model holds {tied[0]!r} and {other!r} as one "
                        "tensor (tied, or one module under two names), the checkpoint holds "
                        "different values for them")
                if not continuation:  # (a new run's choice: loaded in order, as torch loads)
                    warnings.warn(f"{said}; the warm start keeps the value of {tied[-1]!r} (the "
                                  "last loaded)", UnbrokenWarning, stacklevel=2)
                    break
                raise StateMismatch(
                    f"{said}: it was saved from a model where they were separate; build the "
                    "model as it was saved (or warm_start, which keeps the last one loaded)")
    ids = list(map(id, map(saved.__getitem__, names)))
    if not continuation or len(set(ids)) == len(ids):
        return
    by_id: dict[int, str] = {}
    for k, i in zip(names, ids, strict=True):
        first = by_id.setdefault(i, k)
        if (first != k and isinstance(saved[k], torch.Tensor) and live[k].numel()
                and _view(live[first]) != _view(live[k])):
            # (warned, not refused: a script may tie them after restoring, at its first
            # forward, and both hold the saved value now)
            warnings.warn(
                f"{where}: the checkpoint holds {first!r} and {k!r} as one tensor (tied, or "
                "one module under two names), the live model holds them apart; both get the "
                "saved value, but unless your script ties them again the resumed run trains "
                "them apart, as the saved run did not", UnbrokenWarning, stacklevel=2)
            return


def _same_value(a: Any, b: Any) -> bool:
    """Whether two saved tensors hold the same bits (one tensor saved under two names is one
    object)."""
    if a is b:
        return True
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or (
            a.shape != b.shape or a.dtype != b.dtype):
        return False
    try:  # (as bytes: NaN equals itself, -0.0 differs from 0.0)
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    except RuntimeError:  # (a layout without a byte view)
        return torch.equal(a, b)
_REDUCIBLE = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})


# Prefixes a wrapper puts before every key of the model it wraps: torch.compile's
# OptimizedModule, DataParallel and DistributedDataParallel.
_WRAPPERS = {"_orig_mod.": "a torch.compile'd model (torch.compile(model))",
             "module.": "a DataParallel / DistributedDataParallel wrapper"}


def _wrapped(missing: list[str], unexpected: list[str]) -> str:
    """The remedy for keys that differ: a wrapper on one side only (every key of one side is
    the other's with its prefix), or another model definition."""
    for prefix, what in _WRAPPERS.items():
        for bare, prefixed, side, other in ((missing, unexpected, "checkpoint", "live model"),
                                            (unexpected, missing, "live model", "checkpoint")):
            if prefixed and sorted(prefixed) == sorted(prefix + k for k in bare):
                return (f"the {side}'s keys are the {other}'s with {prefix!r} before each "
                        f"({what} on the {side}'s side only); give the Checkpointer the model "
                        "as it was given when saving, wrapped or not")
    return "the checkpoint was written by another model definition"


def cast_overflow(s: torch.Tensor, dtype: torch.dtype) -> float | None:
    """The largest magnitude among ``s``'s finite values when a cast to ``dtype`` cannot hold
    it (IEEE types make it inf, float8_e4m3fn clamps it to 448 without a word), or None.
    Values already inf or nan are not the cast's doing; the largest magnitude decides for
    all (casts are monotonic), found by one ``aminmax`` for the usual tensor."""
    if (not s.is_floating_point() or not dtype.is_floating_point or s.is_meta
            or not s.numel() or torch.finfo(dtype).max >= torch.finfo(s.dtype).max):
        return None
    if s.dtype not in _REDUCIBLE:  # (float8: no aminmax or isfinite of its own)
        s = s.float()
    ends = torch.stack(torch.aminmax(s))
    if not bool(torch.isfinite(ends).all()):
        ends = s[torch.isfinite(s)]
        if not ends.numel():
            return None
    peak = ends.abs().max().double()
    info = torch.finfo(dtype)
    # (within an ulp above the largest value, a cast rounds to it: no loss worth refusing)
    if bool(torch.isfinite(peak.to(dtype).float())) and float(peak) <= info.max * (1 + info.eps):
        return None
    return float(peak)


def _resizes(model: torch.nn.Module, key: str) -> bool:
    """Whether the module holding tensor ``key`` is one of torch's quantization modules that
    load their own way (``torch.ao``: a per-channel observer or fake quantizer of
    quantization-aware training resizes its scale, zero point and ranges to the saved ones in
    its ``_load_from_state_dict``, and refuses what it cannot take). Any other module keeps
    the shape check: a changed model definition (a BatchNorm of another width) is refused
    here, before anything is loaded. Asked only for a tensor whose shape differs."""
    try:
        m = model.get_submodule(key.rpartition(".")[0])
    except AttributeError:
        return False
    return (type(m).__module__.startswith("torch.ao.")
            and type(m)._load_from_state_dict is not torch.nn.Module._load_from_state_dict)


def _view(t: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    """Where a tensor's elements are: two names with the same view hold one tensor."""
    return (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape),
            tuple(t.stride()))
