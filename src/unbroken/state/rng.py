"""Capture, check, restore and fingerprint every random stream a training step can draw from.

Streams: Python ``random``, NumPy's legacy global ``np.random``, torch's CPU generator, the
per-device CUDA generators (only when CUDA is already initialized) and any named
``torch.Generator`` / ``numpy.random.Generator`` the caller registers. Captured values are
plain trees (tuples, ints, floats, str, NumPy arrays, uint8 tensors): the codec stores them.
"""

from __future__ import annotations

import contextlib
import random
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ..errors import CorruptCheckpoint, MissingState, StateMismatch, UnbrokenWarning
from ._digest import digest_tree

AnyGenerator = torch.Generator | np.random.Generator
Generators = Mapping[str, AnyGenerator]

_REMEDY = ("resume from a checkpoint written by the same setup, or start a new run "
           "(bitwise continuation is impossible without this stream)")


def _kind(gen: object, name: str) -> str:
    if isinstance(gen, torch.Generator):
        return "torch"
    if isinstance(gen, np.random.Generator):
        return "numpy"
    raise TypeError(f"generator {name!r} is a {type(gen).__qualname__}; register only "
                    "torch.Generator or numpy.random.Generator objects (a random.Random, a "
                    "NumPy RandomState or bit generator: pass it in extras= inside an object "
                    "whose state_dict() returns its getstate(), get_state() or .state, and "
                    "whose load_state_dict() sets it)")


def capture_rng(generators: Generators | None = None) -> dict[str, Any]:
    """Return every stream's state as a codec-safe tree; reads state, never changes it."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=True),
        "torch_cpu": torch.get_rng_state(),
        "generators": {},
    }
    # is_initialized() alone: asking is_available() first could poison fork() for workers,
    # and CUDA that was never initialized has drawn nothing worth saving.
    if torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    state["cuda_device_count"] = len(state.get("cuda", ()))
    for name, gen in (generators or {}).items():
        _kind(gen, name)  # rejects anything but a torch or numpy generator
        if isinstance(gen, torch.Generator):
            entry = {"kind": "torch", "device": str(gen.device), "state": gen.get_state()}
        else:
            bit_gen = gen.bit_generator
            entry = {"kind": "numpy", "bit_generator": type(bit_gen).__name__,
                     "state": bit_gen.state}
            seeds = _seed_sequence(gen)
            if seeds is not None:  # (its spawn() children: the count spawned so far)
                entry["seed_sequence"] = seeds
        state["generators"][name] = entry
    return state


def _seed_sequence(gen: np.random.Generator) -> dict[str, Any] | None:
    """What makes a NumPy generator's ``spawn()`` children: its SeedSequence's entropy, spawn
    key and pool size, and how many children it spawned already (not in its bit generator's
    state: a restore that sets only that state spawns the first children again)."""
    seq = getattr(gen.bit_generator, "seed_seq", None)
    if not isinstance(seq, np.random.SeedSequence):
        return None
    entropy = seq.entropy
    return {"entropy": int(entropy) if isinstance(entropy, (int, np.integer))
            else [int(x) for x in entropy] if entropy is not None else None,
            "spawn_key": [int(x) for x in seq.spawn_key], "pool_size": int(seq.pool_size),
            "spawned": int(seq.n_children_spawned)}


def _spawned(saved: Any, gen: np.random.Generator, key: str, where: str) -> int:
    """How many more children ``gen`` must spawn (and drop) to be where the saved run's was;
    `StateMismatch` if it cannot get there (seeded otherwise after spawning, or ahead)."""
    live = _seed_sequence(gen)
    if saved is None or live is None:
        return 0  # (saved before 2026-12-02, or no SeedSequence: nothing known to match)
    if not isinstance(saved, Mapping) or type(saved.get("spawned")) is not int:
        raise StateMismatch(f"{where}: {key}.seed_sequence is malformed")
    same = all(saved.get(k) == live[k] for k in ("entropy", "spawn_key", "pool_size"))
    if not same:
        if saved["spawned"]:
            raise StateMismatch(
                f"{where}: {key} spawned {saved['spawned']} children in the saved run from "
                "another SeedSequence than the registered generator's; seed it as the saved "
                "run did (e.g. np.random.default_rng(seed)) so spawn() continues the same")
        return 0
    if live["spawned"] > saved["spawned"]:
        raise StateMismatch(f"{where}: {key} has spawned {live['spawned']} children already, "
                            f"the saved run {saved['spawned']}; register a fresh generator")
    return int(saved["spawned"]) - live["spawned"]


def _uint8_vector(value: Any, length: int, key: str, where: str) -> None:
    """A torch generator's state (well formed: `rng_form_problems`) of this setup's size."""
    if value.numel() != length:
        raise StateMismatch(f"{where}: {key} holds {value.numel()} bytes, a generator of this "
                            f"setup {length}; the checkpoint comes from an incompatible setup")


def _is_state(value: Any) -> bool:
    """A torch generator's state as ``get_state()`` gives it: a 1-D uint8 tensor."""
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1


def _found(value: Any) -> str:
    return (f"a {value.dtype} tensor of shape {tuple(value.shape)}"
            if isinstance(value, torch.Tensor) else f"a {type(value).__name__}")


def rng_form_problems(saved: Mapping[str, Any], where: str) -> list[str]:
    """What the saved streams hold that no generator's state ever is (a writer's bug or a
    forged generation: corrupt, whatever this process's setup), one message each. What
    differs from this setup (a state's size, a generator's kind) is `validate_rng`'s."""
    out: list[str] = []
    py = saved.get("python")
    if "python" in saved and not (
            isinstance(py, tuple) and len(py) == 3 and type(py[0]) is int
            and isinstance(py[1], tuple) and len(py[1]) == 625
            and all(type(x) is int for x in py[1]) and (py[2] is None or type(py[2]) is float)):
        out.append(f"{where}: rng.python is {_found(py)}, not (int, 625 ints, float or None) "
                   "as random.getstate() gives it")
    elif "python" in saved:  # (the form, but a version, index or word no generator takes)
        out += _refused("rng.python", where, random.Random().setstate, py)
    legacy = saved.get("numpy")
    if "numpy" in saved and not (
            isinstance(legacy, tuple) and len(legacy) == 5 and legacy[0] == "MT19937"
            and isinstance(legacy[1], np.ndarray) and legacy[1].dtype == np.uint32
            and legacy[1].shape == (624,)):
        out.append(f"{where}: rng.numpy is {_found(legacy)}, not the ('MT19937', uint32[624], "
                   "pos, has_gauss, cached_gaussian) tuple np.random.get_state() gives")
    elif "numpy" in saved:
        out += _refused("rng.numpy", where, np.random.RandomState().set_state, legacy)
    if "torch_cpu" in saved and not _is_state(saved["torch_cpu"]):
        out.append(f"{where}: rng.torch_cpu is {_found(saved['torch_cpu'])}; "
                   "torch.get_rng_state() gives a 1-D uint8 tensor")
    cuda = saved.get("cuda")
    if cuda is not None and not (isinstance(cuda, list) and all(map(_is_state, cuda))):
        out.append(f"{where}: rng.cuda is {_found(cuda)}, not a list of 1-D uint8 tensors as "
                   "torch.cuda.get_rng_state_all() gives")
    gens = saved.get("generators")
    if "generators" in saved and not isinstance(gens, Mapping):
        out.append(f"{where}: rng.generators is {_found(gens)}, not a mapping of name to state")
    for name, entry in gens.items() if isinstance(gens, Mapping) else ():
        if not isinstance(entry, Mapping) or "state" not in entry:
            out.append(f"{where}: rng.generators.{name} is {_found(entry)}, not a mapping "
                       "holding a 'state'")
        elif entry.get("kind") == "torch" and not _is_state(entry["state"]):
            out.append(f"{where}: rng.generators.{name} state is {_found(entry['state'])}; "
                       "a torch.Generator's get_state() gives a 1-D uint8 tensor")
    return out


def _refused(key: str, where: str, setter: Any, value: Any) -> list[str]:
    """Apply ``value`` to a throwaway generator: the real setter's checks, no live change. A
    state it refuses is no generator's (its message, one), corrupt."""
    try:
        setter(value)
    except (TypeError, ValueError, RuntimeError, LookupError, OverflowError) as e:
        return [f"{where}: {key} is not a valid state ({e})"]
    return []


def validate_rng(saved: Mapping[str, Any], generators: Generators | None, where: str) -> None:
    """Check that ``saved`` holds a well-formed state for every stream this process has.

    Raises ``MissingState`` for an absent stream and ``StateMismatch`` for a malformed one or
    a saved generator that is not registered now. Live RNG state is never touched."""
    if not isinstance(saved, Mapping):
        raise MissingState(f"{where}: no RNG state (found {type(saved).__name__}); {_REMEDY}")
    for key in ("python", "numpy", "torch_cpu", "generators"):
        if key not in saved:
            raise MissingState(f"{where}: stream rng.{key} is missing; {_REMEDY}")
    problems = rng_form_problems(saved, where)
    if problems:
        raise CorruptCheckpoint("; ".join(problems[:3]) + "; no generator holds such a state: "
                                "the generation is refused")

    _uint8_vector(saved["torch_cpu"], torch.get_rng_state().numel(), "rng.torch_cpu", where)
    cuda = saved.get("cuda")
    if torch.cuda.is_initialized():
        if cuda is None:
            raise MissingState(f"{where}: stream rng.cuda is missing (the checkpoint was saved "
                               "before CUDA was initialized) but CUDA is in use now; " + _REMEDY)
        live = torch.cuda.get_rng_state_all()
        if not isinstance(cuda, list) or len(cuda) != len(live):
            count = len(cuda) if isinstance(cuda, list) else type(cuda).__name__
            raise StateMismatch(f"{where}: rng.cuda holds {count} device states, this process "
                                f"has {len(live)} CUDA devices; run with the same device count")
        for i, (value, now) in enumerate(zip(cuda, live)):
            _uint8_vector(value, now.numel(), f"rng.cuda.{i}", where)
    gens = dict(generators or {})
    saved_gens = saved["generators"]
    unknown = sorted(set(saved_gens) - set(gens), key=str)
    if unknown:
        raise StateMismatch(
            f"{where}: the checkpoint has RNG state for generators {unknown} that are not "
            f"registered now (registered: {sorted(gens)}); register them under the same names")
    for name, gen in gens.items():
        key = f"rng.generators.{name}"
        if name not in saved_gens:
            raise MissingState(f"{where}: stream {key} is missing (generator {name!r} was not "
                               f"registered when the checkpoint was saved); {_REMEDY}")
        entry, kind = saved_gens[name], _kind(gen, name)
        if not isinstance(entry, Mapping) or entry.get("kind") != kind or "state" not in entry:
            found = entry.get("kind") if isinstance(entry, Mapping) else type(entry).__name__
            raise StateMismatch(f"{where}: {key} must be a {kind} generator state, found {found}")
        if isinstance(gen, torch.Generator):  # kind == "torch"
            if entry.get("device") != str(gen.device):
                raise StateMismatch(f"{where}: {key} was saved for device {entry.get('device')}"
                                    f", the registered generator is on {gen.device}")
            _uint8_vector(entry["state"], gen.get_state().numel(), key, where)
        else:
            bit_cls = type(gen.bit_generator)
            if entry.get("bit_generator") != bit_cls.__name__:
                raise StateMismatch(f"{where}: {key} was saved from a "
                                    f"{entry.get('bit_generator')} bit generator, the registered "
                                    f"one is {bit_cls.__name__}; use the same bit generator")
            probe = bit_cls()
            refused = _refused(key, where, lambda s: setattr(probe, "state", s), entry["state"])
            if refused:
                raise CorruptCheckpoint(refused[0])
            _spawned(entry.get("seed_sequence"), gen, key, where)


def _apply(saved: Mapping[str, Any], generators: Generators, spawn: bool = True) -> None:
    """Set every stream from an already validated ``saved`` (``spawn``: and advance each
    NumPy generator's count of spawned children to the saved one, which cannot be undone)."""
    random.setstate(saved["python"])
    np.random.set_state(saved["numpy"])
    torch.set_rng_state(saved["torch_cpu"])
    cuda = saved.get("cuda")
    if cuda:
        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            if len(cuda) != count:
                warnings.warn(f"{len(cuda)} CUDA RNG states were saved but {count} devices are "
                              "visible; only the common ones were restored", UnbrokenWarning,
                              stacklevel=3)
            # Lazy when CUDA is not initialized yet: queued until first use, no init here.
            torch.cuda.set_rng_state_all(cuda[:count])
        else:
            warnings.warn(f"{len(cuda)} CUDA RNG states were not restored: CUDA is not "
                          "available in this process", UnbrokenWarning, stacklevel=3)
    for name, gen in generators.items():
        if isinstance(gen, torch.Generator):
            gen.set_state(saved["generators"][name]["state"])
        else:
            entry = saved["generators"][name]
            gen.bit_generator.state = entry["state"]
            more = _spawned(entry.get("seed_sequence"), gen, name, "rng") if spawn else 0
            seq = getattr(gen.bit_generator, "seed_seq", None)
            if more and isinstance(seq, np.random.SeedSequence):
                seq.spawn(more)  # (the saved run's children: dropped)


def restore_rng(saved: Mapping[str, Any], generators: Generators | None,
                where: str = "rng state") -> None:
    """Validate ``saved`` completely, then set every stream; nothing changes if it fails."""
    validate_rng(saved, generators, where)
    _apply(saved, generators or {})


def rng_digests(state: Mapping[str, Any]) -> dict[str, str]:
    """xxh3-64 hex digest per stream (python, numpy, torch_cpu, cuda:i, gen:NAME), so a
    per-step trace can say which stream diverged; equal states give equal digests."""
    out = {key: digest_tree(state[key]) for key in ("python", "numpy", "torch_cpu")
           if key in state}
    for i, value in enumerate(state.get("cuda") or ()):
        out[f"cuda:{i}"] = digest_tree(value)
    for name, entry in (state.get("generators") or {}).items():
        out[f"gen:{name}"] = digest_tree(entry)
    return out


@contextlib.contextmanager
def fork_rng() -> Iterator[None]:
    """Run a block with its own draws from the global streams (Python, NumPy, torch CPU and
    each initialized CUDA device), then put those streams back as they were on entry.

    For work between updates that must not shift training's randomness: an evaluation after
    ``step_done`` (a shuffled loader, a worker's base seed, sampling) draws from the streams
    a generation saved at that boundary holds, and a resumed run, which never ran that
    evaluation, would continue from other draws than the uninterrupted one::

        ckpt.step_done(step)
        if step % 1000 == 0:
            with unbroken.fork_rng():
                evaluate(model, eval_loader)

    (`torch.random.fork_rng` forks torch's streams alone; generators registered with
    ``generators=`` are your own to leave alone; a CUDA device is forked when it is
    initialized on entry: initialize CUDA before the block if the block would.)"""
    saved = capture_rng()
    try:
        yield
    finally:
        _apply(saved, {})


class RNGStreams:
    """Every RNG stream of this process as one state part (what the Checkpointer saves)."""

    def __init__(self, generators: Mapping[str, Any]) -> None:
        self.generators = dict(generators)

    def state_dict(self) -> dict[str, Any]:
        return capture_rng(self.generators)

    def validate_state_dict(self, saved: Mapping[str, Any], where: str) -> None:
        validate_rng(saved, self.generators, where)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        restore_rng(saved, self.generators)

    def load_streams(self, saved: dict[str, Any]) -> None:
        """`load_state_dict` but for the NumPy generators' spawn counts: a restore sets the
        streams first, where a later part's refusal can still put them back, and everything
        last (`applying.apply`)."""
        validate_rng(saved, self.generators, "rng state")
        _apply(saved, self.generators, spawn=False)
