"""Property-based tests (Hypothesis): every parser of an untrusted checkpoint file refuses bad
input with an ``UnbrokenError`` subclass and nothing else, in bounded time and memory.

The contract (README, RELIABILITY.md, ``cli`` docstring): a torn, truncated, edited or crafted
checkpoint is *refused by name* (``CorruptCheckpoint`` and friends), never answered with a raw
``ValueError``, ``TypeError``, ``OverflowError``, ``KeyError``, ``UnicodeError``,
``RecursionError``, ``MemoryError``, ``struct.error``, ``IndexError``, ``RuntimeError`` ... and
the command line returns 0, 1 or 2 without a traceback. A parser may also *accept* odd input;
these properties only forbid every other outcome.

Inputs are (a) arbitrary bytes and (b) structured mutations of the files of a real run: a
manifest edited field by field and resealed with ``manifest.seal`` (so that the checksum passes
and the field validation behind it is what gets exercised), a ``state.json`` edited
structurally or with out-of-range number literals (``1e999``, ``123456789e-999999``),
safetensors files with well-formed but extreme headers, skeletons made of every tag the codec
knows with arbitrary payloads, and a resealed ``RUN.json``. Besides the parsers themselves,
their consumers are exercised in-process on an edited copy of the run: ``unbroken inspect`` and
``unbroken verify`` (with and without ``--json``) must exit 0, 1 or 2, and
``Checkpointer.restore()`` must return a step or raise an ``UnbrokenError``.

Every parser call goes through ``bounded``: it must end within ``SECONDS`` (a SIGALRM stops a
runaway loop) and must not raise the process's peak resident memory by more than
``MAX_RSS_GROWTH``."""

from __future__ import annotations

import base64
import contextlib
import copy
import io
import json
import logging
import math
import os
import random
import re
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st

import unbroken
from unbroken.cli import main as cli_main
from unbroken.errors import UnbrokenError
from unbroken.state.codec import TAG
from unbroken.state.decoding import decode_tree
from unbroken.state.generation import check_stamps, decode_generation
from unbroken.state.jsontext import loads_json
from unbroken.state.parts import STATE_FILE
from unbroken.state.tensorfile import read_safetensors_header
from unbroken.state.tensorread import decode_safetensors
from unbroken.store.manifest import MANIFEST, parse_manifest, seal

pytestmark = pytest.mark.filterwarnings(
    "ignore:Data type alias:DeprecationWarning")  # np.dtype("a"), a name a file may hold

SECONDS = 5.0  # any single parse of these small inputs takes milliseconds
MAX_RSS_GROWTH = 200 * 1024 * 1024  # bytes of peak-RSS growth allowed for one call

# Modest example counts: the whole file runs in well under a minute on two cores. No example
# database: nothing is written into the working tree (a failure prints its minimal example).
# No "explain" phase either: its line tracing makes shrinking a failure several times slower.
# UNBROKEN_PROPERTY_SCALE=10 runs ten times as many examples (a deeper search, minutes).
SCALE = float(os.environ.get("UNBROKEN_PROPERTY_SCALE", "1"))
PROPS = settings(max_examples=150, deadline=None, database=None,
                 phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.filter_too_much,
                                        HealthCheck.function_scoped_fixture])


def examples(n: int) -> settings:
    return settings(PROPS, max_examples=max(1, int(n * SCALE)))


# =============================================================================================
# bounded calls


class Overtime(BaseException):
    """Raised by SIGALRM inside a call that ran past ``SECONDS``. A ``BaseException`` so that
    a broad ``except Exception`` in the code under test cannot swallow it."""


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def bounded(fn: Callable[..., Any], *args: Any, seconds: float = SECONDS, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``: its result, or the ``UnbrokenError`` it raised (returned, not
    raised). Any other exception propagates and fails the property, with its own traceback
    (type, file and line in ``src/``). Also fails when the call takes ``seconds`` or more, or
    raises the peak RSS by more than ``MAX_RSS_GROWTH``."""
    name = getattr(fn, "__qualname__", repr(fn))

    def on_alarm(signum: int, frame: Any) -> None:
        raise Overtime(f"{name} still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    rss = _peak_rss()
    start = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        result = fn(*args, **kwargs)
    except UnbrokenError as e:
        result = e
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    elapsed = time.perf_counter() - start
    grown = _peak_rss() - rss
    with contextlib.suppress(Exception):  # outside a Hypothesis test there is nothing to note
        event(f"{name} -> {type(result).__name__}")  # see --hypothesis-show-statistics
    assert elapsed < seconds, f"{name} took {elapsed:.1f} s (limit {seconds} s)"
    assert grown <= MAX_RSS_GROWTH, f"{name} raised peak RSS by {grown >> 20} MiB"
    return result


def accepted(result: Any) -> None:
    """What a parser accepted is an ordinary value: it can at least be printed (a NumPy string
    array holding code points past U+10FFFF, say, cannot: its repr raises SystemError). Ints
    past 4300 digits are legitimate (the codec stores them in hex); only Python's guard against
    printing them is lifted here."""
    if not isinstance(result, UnbrokenError):
        digits = sys.get_int_max_str_digits()
        sys.set_int_max_str_digits(0)
        try:
            bounded(_print_leaves, result)
        finally:
            sys.set_int_max_str_digits(digits)


def _print_leaves(value: Any) -> None:
    """repr() of every leaf and key of a decoded tree (tensors are torch's own: skipped, their
    repr is slow and they were built from bytes of a checked size)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif not isinstance(v, torch.Tensor):
            repr(v)


# =============================================================================================
# a real run to mutate (built once per module)


def _live() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 5])  # a Counter inside
    return model, opt, sched


def _identity() -> unbroken.Identity:
    return unbroken.Identity(config={"lr": 1e-3, "width": 2}, data="train-v1")


class Sample:
    """The files of a real run (a plain class, not a dataclass: Hypothesis prints a dataclass
    field by field in every falsifying example, and these fields are large)."""

    def __init__(self, root: str, gen: str, manifest: dict[str, Any], state_text: str,
                 files: dict[str, bytes], run_record: dict[str, Any] | None) -> None:
        self.root = root  # the pristine run folder: never changed after the build
        self.gen = gen  # its newest generation folder (gen-000000002), the one tests mutate
        self.manifest = manifest  # gen 2's MANIFEST.json, parsed
        self.state = json.loads(state_text)  # gen 2's state.json, parsed
        self.state_text = state_text
        self.files = files  # every artifact of gen 2 but the manifest
        self.run_record = run_record  # the run folder's RUN.json, parsed (None: none written)

    def __repr__(self) -> str:
        return f"Sample({self.gen!r})"


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Sample:
    root = tmp_path_factory.mktemp("sample") / "run"
    rng_states = _save_rngs()
    torch.manual_seed(0)
    model, opt, sched = _live()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt = unbroken.Checkpointer(root, model=model, optimizer=opt, scheduler=sched,
                                     identity=_identity())
        try:
            assert ckpt.restore() == 0
            for step in (1, 2):
                loss = model(torch.randn(4, 3)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                ckpt.save(step, metrics={"loss": float(loss)})
        finally:
            ckpt.close()
    _load_rngs(rng_states)
    gen = root / "gen-000000002"
    files = {p.name: p.read_bytes() for p in gen.iterdir() if p.name != MANIFEST}
    text = files[STATE_FILE].decode("utf-8")
    record = root / "RUN.json"
    s = Sample(str(root), str(gen), json.loads((gen / MANIFEST).read_bytes()), text, files,
               json.loads(record.read_bytes()) if record.exists() else None)
    # Warm up lazy imports (safetensors.torch, ...) on valid input, outside any bound.
    tree, meta = decode_generation(_files(s, views=False), s.gen)
    decode_generation(_files(s, views=True), s.gen)
    check_stamps(parse_manifest((gen / MANIFEST).read_bytes(), "m"), s.gen, tree, meta)
    with _quiet():
        assert cli_main(["verify", s.root]) == 0
    return s


def _save_rngs() -> tuple[Any, ...]:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _load_rngs(states: tuple[Any, ...]) -> None:
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])


def _writable_view(data: bytes, misalign: int = 0) -> memoryview:
    """A writable memoryview as ``LocalFS.read_file(..., aligned=True)`` returns it, starting
    ``misalign`` bytes past a 64-byte boundary (decode_safetensors takes a zero-copy path for
    aligned tensors and a copying one for the others)."""
    raw = np.zeros(len(data) + 128, dtype=np.uint8)
    skip = (-raw.ctypes.data % 64) + misalign
    buf = raw[skip:skip + len(data)]
    buf[:] = np.frombuffer(data, dtype=np.uint8)
    return buf.data


def _files(s: Sample, views: bool, state: bytes | None = None) -> dict[str, Any]:
    """The artifacts as verify / restore hand them to decode_generation: state.json as bytes,
    tensor files as writable aligned views (``views``) or as bytes."""
    out: dict[str, Any] = {}
    for name, data in s.files.items():
        out[name] = _writable_view(data) if views and name.endswith(".safetensors") else data
    if state is not None:
        out[STATE_FILE] = state
    return out


@contextlib.contextmanager
def _quiet() -> Iterator[tuple[io.TextIOWrapper, io.TextIOWrapper]]:
    """Capture stdout/stderr in strict UTF-8 streams, as a real terminal encodes them (a lone
    surrogate that reaches print() raises UnicodeEncodeError here as it would there)."""
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", write_through=True)
    err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", write_through=True)
    with warnings.catch_warnings(), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        warnings.simplefilter("ignore")
        yield out, err


# =============================================================================================
# strategies: JSON values, including what a hostile file can hold


class Lit:
    """A raw JSON number literal (``1e999``, ``-1e999``, ``123456789e-999999``): json.dumps
    cannot write one, ``to_json_text`` splices it into the text."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"Lit({self.text!r})"


_LIT_OPEN, _LIT_CLOSE = "\x00lit-7f3a:", "\x00"  # json.dumps writes \x00 as \\u0000
_LIT_RE = re.compile(re.escape(json.dumps(_LIT_OPEN)[:-1]) + r"(.*?)"
                     + re.escape(json.dumps(_LIT_CLOSE)[1:]))


def to_json_text(value: Any, ensure_ascii: bool = True) -> bytes:
    """JSON bytes for ``value``, ``Lit`` spliced in as raw number text. ASCII-escaped by default
    (a lone surrogate becomes a ``\\udc80`` escape, which a JSON parser turns back into a lone
    surrogate); otherwise UTF-8 with lone surrogates encoded as they are (invalid UTF-8)."""
    def default(o: Any) -> Any:
        if isinstance(o, Lit):
            return f"{_LIT_OPEN}{o.text}{_LIT_CLOSE}"
        raise TypeError(type(o).__name__)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20_000))  # Deep values: this writer must not give up
    try:
        text = json.dumps(value, ensure_ascii=ensure_ascii, default=default)
    finally:
        sys.setrecursionlimit(limit)
    return _LIT_RE.sub(lambda m: m.group(1), text).encode("utf-8", "surrogatepass")


SURROGATES = st.sampled_from(["\udc80", "\ud800", "a\udfffb", "\ud83d", "x\udc80y\ud800"])
TEXT = st.text(max_size=10) | SURROGATES | st.sampled_from(
    ["", "$t", "v", "key", "..", "../../etc/passwd", "\x00", "\u202e", "gen-000000001", "\ufeff"])
BIG_INTS = st.sampled_from([2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**70, -(2**70),
                            -(2**63) - 1, 10**400, -(10**400)])
INTS = st.integers() | BIG_INTS
FLOATS = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(
    [1e308, -1e308, 5e-324, -0.0, 1.7976931348623157e308])
INFS = st.sampled_from([math.inf, -math.inf])  # what 1e999 / -1e999 parse to
LITS = st.sampled_from(["1e999", "-1e999", "123456789e-999999", "1E400", "-0", "0e0",
                        "18446744073709551616", "1" + "0" * 400]).map(Lit)
SCALARS = st.none() | st.booleans() | INTS | FLOATS | TEXT
KEYS = TEXT | st.sampled_from(["$t", "v", "key", "dtype", "shape", "cuda_devices", "config",
                               "loss", "step", "epoch", "python", "numpy", "torch_cpu"])


class DeepList(list):  # type: ignore[type-arg]
    """A list holding ``depth - 1`` more levels of nesting, with a short repr (Hypothesis prints
    falsifying examples; the repr of 2000 nested lists would itself overflow the stack)."""

    depth: int
    leaf: Any

    def __repr__(self) -> str:
        return f"<{self.depth} nested lists around {self.leaf!r}>"


class DeepDict(dict):  # type: ignore[type-arg]
    depth: int
    leaf: Any

    def __repr__(self) -> str:
        return f"<{self.depth} nested {{'k': ...}} around {self.leaf!r}>"


def _nest(depth: int, leaf: Any, kind: str) -> Any:
    inner = leaf
    for _ in range(depth - 1):
        inner = [inner] if kind == "list" else {"k": inner}
    outer = DeepList([inner]) if kind == "list" else DeepDict(k=inner)
    outer.depth, outer.leaf = depth, leaf
    return outer


# Deep nesting: around and past json's recursion limit and the codec's MAX_DEPTH (200).
DEEP = st.builds(_nest, st.sampled_from([50, 150, 199, 201, 250, 400, 600, 900, 2000]),
                 SCALARS, st.sampled_from(["list", "dict"]))

# -- the codec's tags, with payloads both plausible and wrong ---------------------------------

TENSORS = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.zeros(2),
           "u8": torch.arange(16, dtype=torch.uint8), "u8odd": torch.arange(7, dtype=torch.uint8),
           "u8empty": torch.empty(0, dtype=torch.uint8), "u8x2": torch.zeros(2, 4,
                                                                          dtype=torch.uint8),
           "empty": torch.empty(0), "scalar": torch.tensor(1.5), "i64": torch.arange(4)}
TAGS = ["tensor", "int", "float", "tuple", "size", "dict", "odict", "counter", "bytes",
        "ndarray", "npscalar", "dtype", "device"]
_TORCH_DTYPES = sorted(n for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype))
# Names looked up with getattr(torch, name). torch's lazily imported submodules (_dynamo,
# _inductor, _export, onnx) are left out: looking them up imports them (~1.3 s, ~70 MiB, once
# per process), which would make later examples behave differently from earlier ones.
TORCH_NAMES = st.sampled_from(_TORCH_DTYPES + [
    "Tensor", "nn", "Size", "device", "float", "int", "bool", "_C", "__class__", "__dict__",
    "__spec__", "__name__", "ops", "cuda", "manual_seed", "classes", "library", "overrides",
    "fx", "dtype", "qint8", "quint4x2", "float4_e2m1fn_x2", "bits8", "complex32"]) | TEXT
NP_DTYPES = st.sampled_from([
    "<f4", ">f8", "|b1", "<u4", "|u1", "<c16", "<f2", "<i8", "|O", "O", "|V8", "V0", "|V0",
    "<U4", "|S3", "<M8[s]", "<m8[ns]", "<M8", "(2,3)<f4", "(4294967296,4294967296)u1",
    "V2147483648", "U2147483647", "S9223372036854775807", "f4,i8", "a", "g", "<g", "p",
    "O8", "|O8", "(2,)O", "[('a','O')]", "object", "str", "void"]) | TEXT
SHAPES = (st.lists(st.integers(-2, 5) | BIG_INTS, max_size=5)
          | st.lists(st.just(1), min_size=60, max_size=70) | SCALARS)
B64 = st.binary(max_size=48).map(lambda b: base64.b64encode(b).decode("ascii")) | TEXT
HEX = (st.integers().map(hex) | st.sampled_from(["ff", "-0x1", "0x", "", "1_0", " 12 ", "0b1",
                                                 "f" * 5000, "0x" + "f" * 40000]) | TEXT)
FLOAT_TEXT = st.sampled_from(["inf", "-inf", "nan", "-nan", "Infinity", "1e999", "1.5",
                              "nan(1)", "infinity", " inf ", "1_0"]) | TEXT
DEVICES = st.sampled_from(["cpu", "cuda", "cuda:0", "cuda:-1", "cuda:99999999999999999999",
                           "meta", "mps", "xla", "privateuseone:0", "cpu:0:0", "", " cpu",
                           "ipu", "hpu", "lazy"]) | INTS | TEXT
TENSOR_KEYS = st.sampled_from([*TENSORS, "missing", "__metadata__"]) | TEXT


def tagged_nodes(kids: st.SearchStrategy[Any], numbers: st.SearchStrategy[Any]
                 ) -> st.SearchStrategy[dict[str, Any]]:
    """Tagged skeleton entries with plausible and wrong payloads; ``numbers``: the numbers a
    file can hold that Python does not write (``Lit("1e999")`` in a text, inf once parsed)."""
    def node(tag: str, **fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
        return st.fixed_dictionaries({TAG: st.just(tag), **fields})

    pairs = st.lists(st.lists(kids, min_size=2, max_size=2) | kids, max_size=3)
    dims = st.lists(st.integers(-1, 4) | BIG_INTS | numbers | FLOATS, max_size=4)
    shapes = SHAPES | dims
    return st.one_of(
        node("tensor", key=TENSOR_KEYS),
        node("tensor", key=TENSOR_KEYS, dtype=TORCH_NAMES | kids, shape=shapes),
        node("int", v=HEX | numbers | kids),
        node("float", v=FLOAT_TEXT | numbers | kids),
        node("tuple", v=st.lists(kids, max_size=4) | kids),
        node("size", v=dims | st.lists(kids, max_size=3) | kids),
        *(node(m, v=pairs | kids) for m in ("dict", "odict", "counter")),
        node("bytes", v=B64 | kids),
        node("bytes", key=TENSOR_KEYS | kids),  # bulk bytes kept in the tensor file
        node("ndarray", dtype=NP_DTYPES, shape=shapes, v=B64),
        node("ndarray", dtype=NP_DTYPES, shape=shapes, key=TENSOR_KEYS),
        node("npscalar", dtype=NP_DTYPES, v=B64),
        node("dtype", v=TORCH_NAMES | kids),
        node("device", v=DEVICES | numbers | kids),
        # any tag value, any of the known keys, or one too many
        st.fixed_dictionaries({TAG: st.sampled_from(TAGS) | SCALARS},
                              optional={"v": kids, "key": kids, "dtype": kids, "shape": kids,
                                        "extra": kids}),
    )


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


@st.composite
def valid_nodes(draw: Callable[..., Any], tensor_keys: list[str]) -> dict[str, Any]:
    """Well-formed tagged entries, as the encoder writes them: values of a type that a reader
    may compare or test for truth (arrays, tensors, NaN) where it expected a plain number."""
    kind = draw(st.sampled_from(["ndarray", "tensor", "npscalar", "float", "ndarray", "tensor",
                                 "ndarray", "npscalar", "size", "int", "ndarray", "bytes",
                                 "tuple", "counter", "odict", "dtype", "device"]))
    if kind == "ndarray":
        dtype = np.dtype(draw(st.sampled_from(["<i8", "<f4", "|u1", "<u4", "|b1", "<f8", ">i2",
                                               "<c8", "<M8[s]", "|S2", "<U1"])))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        raw = draw(st.binary(min_size=math.prod(shape) * dtype.itemsize,
                             max_size=math.prod(shape) * dtype.itemsize))
        return {TAG: "ndarray", "dtype": dtype.str, "shape": shape, "v": _b64(raw)}
    if kind == "tensor":
        return {TAG: "tensor", "key": draw(st.sampled_from(tensor_keys))}
    if kind == "npscalar":
        dtype = np.dtype(draw(st.sampled_from(["<i8", "<f4", "|b1", "<f8", "<u2", "<c16"])))
        raw = draw(st.binary(min_size=dtype.itemsize, max_size=dtype.itemsize))
        return {TAG: "npscalar", "dtype": dtype.str, "v": _b64(raw)}
    if kind == "float":
        return {TAG: "float", "v": draw(st.sampled_from(["nan", "inf", "-inf"]))}
    if kind == "size":
        return {TAG: "size", "v": draw(st.lists(st.integers(0, 4), max_size=3))}
    if kind == "int":
        return {TAG: "int", "v": hex(draw(st.integers(2**1024, 2**1100) | st.integers()))}
    if kind == "bytes":
        return {TAG: "bytes", "v": _b64(draw(st.binary(max_size=8)))}
    if kind == "tuple":
        return {TAG: "tuple", "v": draw(st.lists(INTS | FLOATS, max_size=3))}
    if kind in ("counter", "odict"):
        return {TAG: kind, "v": draw(st.lists(st.tuples(st.integers(0, 3) | TEXT, INTS)
                                              .map(list), max_size=3))}
    if kind == "dtype":
        return {TAG: "dtype", "v": draw(st.sampled_from(["float32", "int64", "bool",
                                                          "bfloat16"]))}
    return {TAG: "device", "v": draw(st.sampled_from(["cpu", "meta", "cuda:0", "cuda"]))}


@st.composite
def extreme_entries(draw: Callable[..., Any], numbers: st.SearchStrategy[Any]
                    ) -> dict[str, Any]:
    """One tagged entry with the right keys and payloads of the right shape but extreme
    numbers (huge, negative, ``numbers`` such as inf) where a dimension, an index, a length or
    a code is expected."""
    extreme = st.integers(-2, 4) | BIG_INTS | numbers | FLOATS
    dims = st.lists(extreme, min_size=1, max_size=4)
    tag = draw(st.sampled_from(TAGS), label="tag")
    if tag == "tensor":
        entry: dict[str, Any] = {TAG: tag, "key": draw(TENSOR_KEYS)}
        if draw(st.booleans(), label="with dtype and shape"):
            entry.update(dtype=draw(st.sampled_from(_TORCH_DTYPES) | TORCH_NAMES),
                         shape=draw(dims))
        return entry
    if tag in ("ndarray", "npscalar"):
        dtype = draw(st.sampled_from(["<f4", "<i8", "|u1", "|b1", "<c16", "|V3", "<U2"])
                     | NP_DTYPES, label="dtype")
        entry = {TAG: tag, "dtype": dtype, "v": draw(B64 | extreme)}
        if tag == "ndarray":
            entry["shape"] = draw(dims)
        return entry
    payload = {
        "int": HEX | extreme, "float": FLOAT_TEXT | extreme, "size": dims,
        "tuple": st.lists(extreme, max_size=3), "bytes": B64 | extreme,
        "dtype": TORCH_NAMES | extreme, "device": DEVICES | extreme,
    }.get(tag, st.lists(st.lists(extreme, min_size=2, max_size=2), max_size=3))
    return {TAG: tag, "v": draw(payload, label="v")}


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of the strategies, each with its weight (st.one_of weighs every branch of a nested
    one_of alike); shrinking goes towards the first."""
    table = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.integers(0, len(table) - 1).flatmap(lambda i: table[i])


def rarely(common: st.SearchStrategy[Any], rare: st.SearchStrategy[Any],
           one_in: int = 8) -> st.SearchStrategy[Any]:
    """``rare`` once in ``one_in`` draws (shrinking goes towards ``common``)."""
    return weighted((one_in - 1, common), (1, rare))


def json_values(leaves: st.SearchStrategy[Any],
                numbers: st.SearchStrategy[Any] | None = None) -> st.SearchStrategy[Any]:
    """JSON trees over ``leaves``; with ``numbers``, tagged skeleton entries too."""
    def extend(kids: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        inner = st.lists(kids, max_size=4) | st.dictionaries(KEYS, kids, max_size=4)
        return inner if numbers is None else inner | tagged_nodes(kids, numbers)

    return rarely(st.recursive(leaves, extend, max_leaves=12), DEEP)


# Tensor keys of the sample run's tensor files (model, optimizer, rng parts).
SAMPLE_TENSOR_KEYS = ["weight", "bias", "state.weight.step", "state.weight.exp_avg",
                      "state.bias.exp_avg_sq", "torch_cpu", "numpy.1"]
# Values a sealed manifest can hold (finite floats: no checksum exists for inf; lone
# surrogates are kept: they make the checksum fail, which must still be a clean refusal).
MANIFEST_VALUES = json_values(SCALARS)
# Values of a state.json: tagged skeleton entries, and raw literals such as 1e999.
STATE_VALUES = json_values(weighted((3, SCALARS), (1, LITS), (3, valid_nodes(SAMPLE_TENSOR_KEYS)),
                                    (2, extreme_entries(LITS))), numbers=LITS)
# Skeletons handed to decode_tree directly: what loads_json can return (1e999 is inf).
SKELETONS = json_values(weighted((3, SCALARS), (1, INFS), (3, valid_nodes(list(TENSORS))),
                                 (2, extreme_entries(INFS))), numbers=INFS)


# -- structural mutation of a parsed JSON document --------------------------------------------


def _paths(tree: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path into ``tree`` down to 12 levels; long lists contribute only their first and
    last items (an RNG state of 625 ints would otherwise draw nearly every mutation)."""
    yield prefix
    if len(prefix) >= 12 or isinstance(tree, (DeepList, DeepDict)):
        return
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(tree, list):
        idx = range(len(tree)) if len(tree) <= 8 else [0, 1, 2, len(tree) - 1]
        for i in idx:
            yield from _paths(tree[i], (*prefix, i))


def _at(tree: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def mutate(draw: Callable[..., Any], doc: Any, values: st.SearchStrategy[Any],
           max_edits: int = 3) -> Any:
    """A deep copy of ``doc`` with 1..max_edits edits: a value replaced, a key or item
    removed, or one added."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, max_edits), label="edits")):
        candidates = [p for p in _paths(doc) if p] or [()]
        path = draw(st.sampled_from(candidates), label="path")
        op = draw(st.sampled_from(["replace", "delete", "add"]), label="op")
        if not path:
            doc = draw(values, label="document")
            continue
        parent, key = _at(doc, path[:-1]), path[-1]
        target = parent[key]
        if op == "replace":
            parent[key] = draw(values, label="value")
        elif op == "delete":
            del parent[key]
        elif isinstance(target, dict):
            target[draw(KEYS, label="new key")] = draw(values, label="value")
        elif isinstance(target, list):
            target.insert(draw(st.integers(0, len(target)), label="at"), draw(values))
        else:
            parent[key] = draw(values, label="value")
    return doc


def _exists(doc: Any, path: tuple[Any, ...]) -> bool:
    """``path`` leads through dicts and lists only (an earlier edit may have replaced one)."""
    for k in path:
        if isinstance(doc, dict) and k in doc or (
                isinstance(doc, list) and type(k) is int and 0 <= k < len(doc)):
            doc = doc[k]
        else:
            return False
    return True


# Paths of state.json that restore and verify interpret beyond decoding: counters compared
# with the manifest, RNG states validated, scheduler and optimizer settings, stamps, names.
HOT_STATE_PATHS: list[tuple[Any, ...]] = [
    ("parts", "counters", "step"), ("parts", "counters", "epoch"), ("parts", "counters"),
    ("parts", "rng", "python"), ("parts", "rng", "python", "v", 0),
    ("parts", "rng", "python", "v", 1), ("parts", "rng", "python", "v", 2),
    ("parts", "rng", "numpy"), ("parts", "rng", "numpy", "v", 0), ("parts", "rng", "numpy", "v", 1),
    ("parts", "rng", "numpy", "v", 2), ("parts", "rng", "numpy", "v", 3),
    ("parts", "rng", "numpy", "v", 4), ("parts", "rng", "torch_cpu"),
    ("parts", "rng", "generators"), ("parts", "rng", "cuda"), ("parts", "rng", "cuda_device_count"),
    ("parts", "scheduler", "last_epoch"), ("parts", "scheduler", "_step_count"),
    ("parts", "scheduler", "gamma"), ("parts", "scheduler", "milestones"),
    ("parts", "scheduler", "_last_lr"), ("parts", "scheduler", "base_lrs"),
    ("parts", "optimizer", "param_groups", 0, "lr"),
    ("parts", "optimizer", "param_groups", 0, "betas"),
    ("parts", "optimizer", "param_groups", 0, "params"),
    ("parts", "optimizer", "param_groups", 0, "params", 0),
    ("parts", "optimizer", "state", "weight", "step"), ("parts", "optimizer", "state"),
    ("parts", "optimizer", "class"), ("parts", "model"), ("parts", "model", "v", 0),
    ("parts", "model", "v", 0, 0), ("meta", "unbroken.generation"), ("meta", "unbroken.run_id"),
    ("tensor_files", "model"), ("tensor_files", "counters"), ("schema",),
]


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    """Set ``path`` in ``doc`` where its parent exists (a missing dict key is added)."""
    if _exists(doc, path[:-1]):
        parent = _at(doc, path[:-1])
        if isinstance(parent, dict) or _exists(doc, path):
            parent[path[-1]] = value


def edit_state(draw: Callable[..., Any], base: dict[str, Any]) -> Any:
    """Either 1-3 values set at paths that readers interpret (``HOT_STATE_PATHS``; a missing
    key is added), or a generic structural mutation anywhere."""
    if not draw(st.booleans(), label="targeted"):
        return mutate(draw, base, STATE_VALUES)
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3), label="edits")):
        path = draw(st.sampled_from(HOT_STATE_PATHS), label="path")
        _set(doc, path, draw(STATE_VALUES, label="/".join(map(str, path))))
    return doc


def reseal(fields: Any) -> bytes:
    """Manifest bytes whose checksum passes, as an attacker (or a careless tool) would write
    them with ``manifest.seal``. Where no checksum can exist (a lone surrogate, or not an
    object), the fields are written with a wrong one: parse_manifest must refuse it cleanly."""
    if isinstance(fields, dict):
        try:
            return seal(fields)
        except (ValueError, RecursionError):  # lone surrogates, too deep
            pass
        return to_json_text({**fields, "checksum": "0" * 32})
    return to_json_text(fields)


# -- bytes ----------------------------------------------------------------------------------

JSON_TEXT_BYTES = st.one_of(
    st.binary(max_size=200),
    STATE_VALUES.map(to_json_text),
    st.sampled_from(["1e999", "-1e999", "123456789e-999999", "[1e999]", '{"a":1e999}',
                     "1" * 5000, "-" + "9" * 4301, "NaN", "Infinity", "-Infinity", "[NaN]",
                     '"\\udc80"', '{"\\ud800":1}', "[" * 100_000, "{\"a\":" * 50_000,
                     '{"a":1,"a":2}', "\ufeff{}", "", " ", "null", "0", "\"\"",
                     '"\\u0000"']).map(lambda t: t.encode("utf-8")),
    st.text(max_size=40).map(lambda t: t.encode("utf-8")),
    st.text(max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass")),
)


# =============================================================================================
# (a) arbitrary bytes


@examples(150)
@given(data=JSON_TEXT_BYTES)
def test_loads_json_refuses_any_bytes_cleanly(data: bytes) -> None:
    bounded(loads_json, data, "x.json", 1 << 20)


@examples(150)
@given(data=JSON_TEXT_BYTES)
def test_parse_manifest_refuses_any_bytes_cleanly(data: bytes) -> None:
    bounded(parse_manifest, data, "gen-000000001/MANIFEST.json")


def _safetensors_blob(header: Any, data: bytes, ascii_only: bool = True,
                      claimed: int | None = None) -> bytes:
    raw = to_json_text(header, ensure_ascii=ascii_only)
    raw += b" " * (-(8 + len(raw)) % 64)
    n = len(raw) if claimed is None else claimed
    return struct.pack("<Q", n % 2**64) + raw + data


SAFETENSORS_ANY = st.one_of(
    st.binary(max_size=300),
    st.builds(_safetensors_blob, STATE_VALUES, st.binary(max_size=64), st.booleans()),
    st.builds(_safetensors_blob, STATE_VALUES, st.binary(max_size=64), st.booleans(),
              st.integers(0, 2**64 - 1) | BIG_INTS.map(abs)),
)


def _all_safetensors_paths(data: bytes, misalign: int) -> None:
    bounded(read_safetensors_header, data, "x.safetensors")
    bounded(decode_safetensors, data, "x.safetensors")
    bounded(decode_safetensors, memoryview(bytearray(data)), "x.safetensors")
    bounded(decode_safetensors, _writable_view(data, misalign), "x.safetensors")


@examples(150)
@given(data=SAFETENSORS_ANY, misalign=st.sampled_from([0, 1, 4, 8, 32]))
def test_safetensors_parsers_refuse_any_bytes_cleanly(data: bytes, misalign: int) -> None:
    _all_safetensors_paths(data, misalign)


@examples(150)
@given(data=JSON_TEXT_BYTES, views=st.booleans())
def test_decode_generation_refuses_any_state_bytes_cleanly(sample: Sample, data: bytes,
                                                          views: bool) -> None:
    bounded(decode_generation, _files(sample, views, state=data), sample.gen)


# =============================================================================================
# (b) structured mutations of valid files

# -- manifests, resealed ----------------------------------------------------------------------


@examples(200)
@given(data=st.data())
def test_parse_manifest_of_a_resealed_edit_never_raises_anything_else(sample: Sample,
                                                                       data: st.DataObject) -> None:
    fields = mutate(data.draw, sample.manifest, MANIFEST_VALUES)
    raw = reseal(fields)
    got = bounded(parse_manifest, raw, "gen-000000002/MANIFEST.json")
    if not isinstance(got, UnbrokenError):  # accepted: its own bytes read back the same
        assert bounded(parse_manifest, got.to_bytes(), "again") == got


# -- RUN.json (which run a folder holds), sealed like a manifest -------------------------------


@examples(150)
@given(data=JSON_TEXT_BYTES)
def test_parse_run_record_refuses_any_bytes_cleanly(data: bytes) -> None:
    from unbroken.store.runrecord import parse_run_record

    bounded(parse_run_record, data, "RUN.json")


@examples(150)
@given(data=st.data())
def test_parse_run_record_of_a_resealed_edit_never_raises_anything_else(
        sample: Sample, data: st.DataObject) -> None:
    from unbroken.store.runrecord import parse_run_record

    assert sample.run_record is not None, "the sample run has no RUN.json"
    bounded(parse_run_record, reseal(mutate(data.draw, sample.run_record, MANIFEST_VALUES)),
            "RUN.json")


# -- safetensors with extreme but self-consistent headers -------------------------------------

ST_DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "C64",
             "F8_E4M3", "F8_E5M2", "U16", "U32", "U64"]
_ITEM = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
         "U8": 1, "BOOL": 1, "C64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
DIMS = st.integers(0, 4) | st.sampled_from([2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64, 2**70])


@st.composite
def safetensors_files(draw: Callable[..., Any]) -> bytes:
    """A header that passes read_safetensors_header (dtypes known, offsets tiling the data
    exactly), with shapes up to 70 dims and huge dims next to a zero; then, sometimes, edited."""
    header: dict[str, Any] = {}
    offset = 0
    for key in draw(st.lists(st.sampled_from(["w", "b", "x"]) | TEXT, max_size=4, unique=True)):
        if key == "__metadata__":
            continue
        dtype = draw(st.sampled_from(ST_DTYPES))
        shape = draw(st.lists(DIMS, max_size=5) | st.lists(st.just(1), min_size=60,
                                                            max_size=70))
        if math.prod(shape) * _ITEM[dtype] > 256:
            shape.insert(draw(st.integers(0, len(shape))), 0)  # stays small: nothing to hold
        nbytes = math.prod(shape) * _ITEM[dtype]
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(TEXT, TEXT, max_size=3))
    if draw(st.booleans()):
        header = mutate(draw, header, STATE_VALUES, max_edits=2)
    return _safetensors_blob(header, draw(st.binary(min_size=offset, max_size=offset)),
                             ascii_only=draw(st.booleans()))


@st.composite
def edited_real_safetensors(draw: Callable[..., Any], files: dict[str, bytes]) -> bytes:
    name = draw(st.sampled_from(sorted(n for n in files if n.endswith(".safetensors"))))
    blob = files[name]
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header = mutate(draw, header, STATE_VALUES)
    return _safetensors_blob(header, blob[8 + n:])


@examples(200)
@given(data=st.data(), misalign=st.sampled_from([0, 1, 8, 32]))
def test_safetensors_parsers_on_extreme_headers(sample: Sample, data: st.DataObject,
                                                misalign: int) -> None:
    blob = data.draw(safetensors_files() | edited_real_safetensors(sample.files), label="file")
    _all_safetensors_paths(blob, misalign)


# -- skeletons ----------------------------------------------------------------------------------


@examples(600)
@given(skeleton=SKELETONS, where=TEXT)
def test_decode_tree_refuses_any_skeleton_cleanly(skeleton: Any, where: str) -> None:
    accepted(bounded(decode_tree, skeleton, TENSORS, where))


@examples(300)
@given(entry=extreme_entries(INFS))
def test_decode_tree_refuses_any_single_entry_cleanly(entry: dict[str, Any]) -> None:
    accepted(bounded(decode_tree, {"part": [entry]}, TENSORS, "state.json"))


# -- state.json: edited structurally, or with out-of-range number literals --------------------

_NUMBER = re.compile(r"(?<=[:\[,])-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?(?=[,\]}])")
_LONG_LIST = re.compile(r"\[(?:\d+,){100,}\d+\]")


def _number_spans(text: str) -> list[tuple[int, int]]:
    """Number tokens of the JSON text; of the long RNG state lists, only the first and last."""
    long = [m.span() for m in _LONG_LIST.finditer(text)]
    spans = []
    for m in _NUMBER.finditer(text):
        inside = [s for s in long if s[0] < m.start() < s[1]]
        if inside and text[m.start() - 1] != "[" and text[m.end()] != "]":
            continue
        spans.append(m.span())
    return spans


LITERALS = st.sampled_from(["1e999", "-1e999", "123456789e-999999", "1E400", "-0", "0.0",
                            "1e308", "-1e308", "5e-324", "18446744073709551616",
                            "9223372036854775808", "-9223372036854775809", "1" + "0" * 400,
                            "1" + "0" * 4400, "0.5", "2", "-1"])


@st.composite
def literal_edits(draw: Callable[..., Any], text: str) -> bytes:
    spans = _number_spans(text)
    chosen = draw(st.lists(st.sampled_from(spans), min_size=1, max_size=3, unique=True),
                  label="numbers")
    for start, end in sorted(chosen, reverse=True):
        text = text[:start] + draw(LITERALS, label=f"for {text[start:end]!r}") + text[end:]
    return text.encode("utf-8")


@examples(300)
@given(data=st.data(), views=st.booleans())
def test_decode_generation_of_an_edited_state_never_raises_anything_else(
        sample: Sample, data: st.DataObject, views: bool) -> None:
    doc = edit_state(data.draw, sample.state)
    parts = data.draw(st.sampled_from([None, {"model"}, {"optimizer", "scheduler"}]),
                      label="parts")
    accepted(bounded(decode_generation, _files(sample, views, to_json_text(doc)), sample.gen,
                     parts))


@examples(150)
@given(data=st.data(), views=st.booleans())
def test_decode_generation_with_out_of_range_numbers(sample: Sample, data: st.DataObject,
                                                     views: bool) -> None:
    state = data.draw(literal_edits(sample.state_text), label="state.json")
    bounded(decode_generation, _files(sample, views, state), sample.gen)


def _read_generation(files: dict[str, Any], folder: str, manifest: Any) -> Any:
    """What verify and restore do with verified files: decode, then check the stamps."""
    tree, meta = decode_generation(files, folder)
    check_stamps(manifest, folder, tree, meta)
    return tree


@examples(300)
@given(data=st.data())
def test_decode_and_check_stamps_of_an_edited_state_never_raise_anything_else(
        sample: Sample, data: st.DataObject) -> None:
    manifest = parse_manifest(seal(sample.manifest), "m")
    if data.draw(st.booleans(), label="literal edit"):
        state = data.draw(literal_edits(sample.state_text), label="state.json")
    else:
        state = to_json_text(edit_state(data.draw, sample.state))
    bounded(_read_generation, _files(sample, True, state), sample.gen, manifest)


# Values a decoded part may hold where a reader expects a plain number: arrays, tensors,
# NumPy scalars, NaN, tuples, a torch.Size ... (and plain values of the wrong type).
ODD_NUMBERS = weighted((1, SCALARS), (3, valid_nodes(SAMPLE_TENSOR_KEYS)), (1, LITS),
                       (2, extreme_entries(LITS)))


@examples(200)
@given(edits=st.lists(st.tuples(st.sampled_from(HOT_STATE_PATHS), ODD_NUMBERS), min_size=1,
                      max_size=2),
       views=st.booleans())
def test_decode_generation_with_odd_values_where_numbers_belong(
        sample: Sample, edits: list[tuple[Any, Any]], views: bool) -> None:
    doc = copy.deepcopy(sample.state)
    for path, value in edits:
        _set(doc, path, value)
    accepted(bounded(decode_generation, _files(sample, views, to_json_text(doc)), sample.gen))


@st.composite
def odd_counters(draw: Callable[..., Any]) -> Any:
    """A counters part holding any decoded values (a plain or a tagged mapping)."""
    step, epoch = draw(ODD_NUMBERS, label="step"), draw(ODD_NUMBERS, label="epoch")
    if draw(st.booleans(), label="as a tagged mapping"):
        return {TAG: draw(st.sampled_from(["dict", "odict", "counter"])),
                "v": [["step", step], ["epoch", epoch]]}
    return {"step": step, "epoch": epoch}


def _with_counters(state: dict[str, Any], counters: Any) -> bytes:
    doc = copy.deepcopy(state)
    doc["parts"]["counters"] = counters
    return to_json_text(doc)


@examples(200)
@given(counters=odd_counters())
def test_counters_of_any_decoded_type_are_checked_cleanly(sample: Sample, counters: Any) -> None:
    """The counters part is compared with the manifest's step (check_stamps): whatever a
    state.json decodes to there must be refused or accepted cleanly."""
    manifest = parse_manifest(seal(sample.manifest), "m")
    state = _with_counters(sample.state, counters)
    bounded(_read_generation, _files(sample, True, state), sample.gen, manifest)


# =============================================================================================
# the command line and restore, on a run whose newest generation was edited and resealed


def _copy_run(s: Sample, dest: Path) -> Path:
    run = dest / "run"
    shutil.copytree(s.root, run)
    (run / "LOCK").unlink(missing_ok=True)
    return run


def _write_generation(run: Path, manifest: bytes, state: bytes | None = None) -> None:
    gen = run / "gen-000000002"
    (gen / MANIFEST).write_bytes(manifest)
    if state is not None:
        (gen / STATE_FILE).write_bytes(state)


def _restamp(s: Sample, state: bytes) -> dict[str, Any]:
    """The newest manifest, listing ``state`` as its state.json (size and hash updated)."""
    fields = copy.deepcopy(s.manifest)
    for a in fields["artifacts"]:
        if a["name"] == STATE_FILE:
            a["size"], a["xxh3_128"] = len(state), xxhash.xxh3_128(state).hexdigest()
    return fields


# The manifest fields inspect, verify and restore read, and the keys they read in them.
READ_FIELDS = {
    "environment": ["cuda_devices", "torch", "python", "num_threads", "deterministic_algorithms",
                    "world_size", "filesystem", "rank", "cuda_device_count", "numpy"],
    "identity": ["config", "tokenizer", "data"],
    "parent": ["run_id", "generation", "incarnation"],
    "origin": ["operation", "source", "generation", "run_id", "incarnation", "allowed"],
    "metrics": ["loss", "val_loss"],
    "retention": ["last", "best", "every"],
}
IDENTITY_ENTRIES = st.fixed_dictionaries({}, optional={
    k: MANIFEST_VALUES for k in ("kind", "hash", "summary", "value")})


def edit_manifest(draw: Callable[..., Any], base: dict[str, Any]) -> Any:
    """Either 1-2 rounds of edits of the fields the readers of a manifest use (some keys of
    environment, identity, parent, origin, metrics or retention set to any value, or the whole
    field replaced), or a generic structural mutation anywhere."""
    if not draw(st.booleans(), label="targeted"):
        return mutate(draw, base, MANIFEST_VALUES)
    fields = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 2), label="rounds")):
        field = draw(st.sampled_from(sorted(READ_FIELDS)), label="field")
        if draw(st.integers(0, 4), label="whole field") == 4:
            fields[field] = draw(MANIFEST_VALUES, label=field)
            continue
        if not isinstance(fields.get(field), dict):
            fields[field] = {}
        values = SCALARS | MANIFEST_VALUES  # scalars twice as likely: a wrong type, not a tree
        if field == "identity":
            values |= IDENTITY_ENTRIES
        for key in READ_FIELDS[field]:
            if draw(st.booleans(), label=f"edit {field}.{key}"):
                fields[field][key] = draw(values, label=f"{field}.{key}")
    return fields


CLI_COMMANDS = [["inspect", "--json"], ["inspect"], ["verify"], ["verify", "--json"]]


def _cli(run: Path) -> None:
    for command in CLI_COMMANDS:
        with _quiet():
            rc = bounded(cli_main, [command[0], str(run), *command[1:]])
        assert rc in (0, 1, 2), f"unbroken {' '.join(command)} returned {rc!r}"


@examples(250)
@given(data=st.data())
def test_cli_on_a_resealed_manifest_edit_exits_0_1_or_2(sample: Sample, tmp_path: Path,
                                                       data: st.DataObject) -> None:
    run = tmp_path / "run"
    if not run.exists():
        _copy_run(sample, tmp_path)
    _write_generation(run, reseal(edit_manifest(data.draw, sample.manifest)))
    _cli(run)


@examples(60)
@given(data=st.data())
def test_cli_on_an_edited_state_exits_0_1_or_2(sample: Sample, tmp_path: Path,
                                              data: st.DataObject) -> None:
    run = tmp_path / "run"
    if not run.exists():
        _copy_run(sample, tmp_path)
    if data.draw(st.booleans(), label="literal edit"):
        state = data.draw(literal_edits(sample.state_text), label="state.json")
    else:
        state = to_json_text(edit_state(data.draw, sample.state))
    _write_generation(run, seal(_restamp(sample, state)), state)
    _cli(run)


def _restore(run: Path) -> Any:
    """Checkpointer.restore() of ``run`` into fresh live objects, as a resumed script does."""
    model, opt, sched = _live()
    log = logging.getLogger("unbroken")
    level = log.level
    log.setLevel(logging.CRITICAL)  # "rejected gen-...": expected here, and many
    with warnings.catch_warnings(), contextlib.ExitStack() as stack:
        stack.callback(log.setLevel, level)
        warnings.simplefilter("ignore")
        ckpt = unbroken.Checkpointer(run, model=model, optimizer=opt, scheduler=sched,
                                     identity=_identity())
        try:
            return bounded(ckpt.restore)
        finally:
            ckpt.close()


def _restore_edited_state(sample: Sample, edits: list[tuple[Any, Any]], only: bool) -> None:
    """Restore a copy of the sample run whose newest state.json has ``edits`` (its manifest
    restamped and resealed); ``only``: without generation 1 to fall back to."""
    doc = copy.deepcopy(sample.state)
    for path, value in edits:
        _set(doc, path, value)
    state = to_json_text(doc)
    rngs = _save_rngs()
    with tempfile.TemporaryDirectory() as tmp:
        run = _copy_run(sample, Path(tmp))
        if only:
            shutil.rmtree(run / "gen-000000001")
        _write_generation(run, seal(_restamp(sample, state)), state)
        try:
            got = _restore(run)
        finally:
            _load_rngs(rngs)
    assert isinstance(got, (int, UnbrokenError)), got


@examples(60)
@given(data=st.data())
def test_restore_of_an_edited_generation_raises_only_unbroken_errors(sample: Sample,
                                                                    data: st.DataObject) -> None:
    if data.draw(st.booleans(), label="edit the manifest"):
        state = None
        fields = edit_manifest(data.draw, sample.manifest)
    else:
        if data.draw(st.booleans(), label="literal edit"):
            state = data.draw(literal_edits(sample.state_text), label="state.json")
        else:
            state = to_json_text(edit_state(data.draw, sample.state))
        fields = _restamp(sample, state)
    # Without generation 1, restore cannot fall back: the edited generation is the only one.
    only = data.draw(st.booleans(), label="only the edited generation")
    rngs = _save_rngs()
    with tempfile.TemporaryDirectory() as tmp:
        run = _copy_run(sample, Path(tmp))
        if only:
            shutil.rmtree(run / "gen-000000001")
        _write_generation(run, reseal(fields), state)
        try:
            got = _restore(run)
        finally:
            _load_rngs(rngs)
    assert isinstance(got, (int, UnbrokenError)), got


@examples(80)
@given(data=st.data())
def test_cli_and_restore_with_a_resealed_run_record_edit(sample: Sample,
                                                         data: st.DataObject) -> None:
    assert sample.run_record is not None, "the sample run has no RUN.json"
    record = reseal(mutate(data.draw, sample.run_record, MANIFEST_VALUES))
    rngs = _save_rngs()
    with tempfile.TemporaryDirectory() as tmp:
        run = _copy_run(sample, Path(tmp))
        (run / "RUN.json").write_bytes(record)
        _cli(run)
        try:
            got = _restore(run)
        finally:
            _load_rngs(rngs)
    assert isinstance(got, (int, UnbrokenError)), got


@examples(150)
@given(counters=odd_counters(), only=st.booleans())
# found by this property (1 seed in 25): an int past 4300 digits passed the type check and
# raised ValueError where the message showed it
@example(counters={"step": {TAG: "int", "v": "f" * 4000}, "epoch": 0}, only=False)
@example(counters={"step": 3, "epoch": -1}, only=True)
def test_restore_with_counters_of_any_decoded_type(sample: Sample, counters: Any,
                                                   only: bool) -> None:
    """Restore reads the same counters (``only``: without generation 1 to fall back to)."""
    _restore_edited_state(sample, [(("parts", "counters"), counters)], only)


HUGE_INT = {TAG: "int", "v": "f" * 4000}  # 16,000 bits: str() of it raises ValueError


@pytest.mark.parametrize("path", HOT_STATE_PATHS, ids=lambda p: ".".join(map(str, p)))
def test_restore_with_a_huge_int_at_every_hot_path(sample: Sample, path: tuple[Any, ...]
                                                   ) -> None:
    """The class of the counters defect the property above found once in 25 seeds: an int
    whose decimal text Python refuses to make, wherever a number is read, and shown."""
    _restore_edited_state(sample, [(path, HUGE_INT)], only=True)


@examples(100)
@given(edits=st.lists(st.tuples(st.sampled_from(HOT_STATE_PATHS), ODD_NUMBERS), min_size=1,
                      max_size=2),
       only=st.booleans())
def test_restore_with_odd_values_where_numbers_belong(sample: Sample,
                                                      edits: list[tuple[Any, Any]],
                                                      only: bool) -> None:
    """Restore validates counters, RNG states, scheduler and optimizer settings: an array, a
    tensor, NaN, a tuple or a string where it expects a number must be refused cleanly."""
    _restore_edited_state(sample, edits, only)


# =============================================================================================
# plain examples: the edits these properties were written for, and what they have found


@pytest.mark.parametrize("field,value", [
    ("environment", {"cuda_devices": 5}),
    ("environment", {"cuda_devices": [0, 1], "torch": "\udc80"}),
    ("metrics", {"loss": "x"}),
    ("metrics", {"loss": 10**400}),
    ("metrics", {"loss": None}),
    ("identity", {"config": 3}),
    ("identity", {"config": {"kind": 3, "hash": [1]}}),
    ("parent", {"generation": {"a": 1}}),
    ("origin", {"operation": 5}),
    ("created", "\udc80"),
], ids=lambda v: repr(v)[:30])
def test_cli_on_a_listed_manifest_edit_exits_0_1_or_2(sample: Sample, tmp_path: Path,
                                                      field: str, value: Any) -> None:
    run = _copy_run(sample, tmp_path)
    _write_generation(run, reseal({**sample.manifest, field: value}))
    _cli(run)


@pytest.mark.parametrize("skeleton", [
    {TAG: "size", "v": [2**70]},
    {TAG: "size", "v": [math.inf]},
    {TAG: "size", "v": [-1]},
    {TAG: "dtype", "v": "anything"},
    {TAG: "dtype", "v": "Tensor"},
    {TAG: "device", "v": 2**70},
    {TAG: "device", "v": "cuda:99999999999999999999"},
    {TAG: "ndarray", "dtype": "<f4", "shape": [2**70], "v": ""},
    {TAG: "ndarray", "dtype": "<f4", "shape": [-1, 0], "v": ""},
    {TAG: "ndarray", "dtype": "V2147483648", "shape": [1], "v": ""},
    {TAG: "npscalar", "dtype": "U2147483647", "v": ""},
    {TAG: "tensor", "key": "w", "dtype": "float64", "shape": [2**70]},
    {TAG: "int", "v": "0x" + "f" * 40000},
    {TAG: "counter", "v": [[[1], 2]]},
    {TAG: "ndarray", "dtype": "<U1", "shape": [], "v": _b64(b"\x00\x00\x00\x01")},
    {TAG: "npscalar", "dtype": "<U1", "v": _b64(b"\x00\x00\x00\x01")},
], ids=lambda v: repr(v)[:40])
def test_decode_tree_on_listed_payloads(skeleton: Any) -> None:
    accepted(bounded(decode_tree, skeleton, TENSORS, "state.json"))


@pytest.mark.parametrize("literal", ["1e999", "-1e999", "123456789e-999999"])
def test_decode_generation_with_a_listed_literal_in_a_size(sample: Sample, literal: str) -> None:
    doc = copy.deepcopy(sample.state)
    doc["parts"]["counters"]["shape"] = {TAG: "size", "v": [Lit(literal)]}
    bounded(decode_generation, _files(sample, True, to_json_text(doc)), sample.gen)


_EMPTY_ARRAY = {TAG: "ndarray", "dtype": "<i8", "shape": [0], "v": ""}
_TWO_INTS = {TAG: "ndarray", "dtype": "<i8", "shape": [2], "v": _b64(bytes(16))}


@pytest.mark.parametrize("path,value", [
    (("parts", "counters", "step"), _EMPTY_ARRAY),
    (("parts", "counters", "step"), _TWO_INTS),
    (("parts", "counters", "step"), {TAG: "size", "v": [Lit("1e999")]}),
    (("parts", "optimizer", "param_groups", 0, "params", 0), _EMPTY_ARRAY),
    (("parts", "optimizer", "class"), _TWO_INTS),
    (("parts", "rng", "numpy", "v", 0), _TWO_INTS),
    (("parts", "scheduler", "last_epoch"), _TWO_INTS),
], ids=lambda v: "/".join(map(str, v)) if isinstance(v, tuple) else repr(v)[:30])
def test_restore_with_a_listed_odd_value(sample: Sample, path: tuple[Any, ...],
                                         value: Any) -> None:
    _restore_edited_state(sample, [(path, value)], only=False)

