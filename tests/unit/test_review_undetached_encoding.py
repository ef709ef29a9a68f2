"""Review of the undetached encoding: a parameter (requires_grad) is stored as itself by the
codec, captured undetached by ``async_save="process"``, digested without ``.detach()`` first
where it can, written through a cached chunking (`tensorfile._chunking`), and skipped by
`dist.sharded.split` inside dicts of plain tensors. Whatever is live or detached, planned or
not, cached or fresh, the bytes written are the same, and the parameters are never changed."""

from __future__ import annotations

import json
import struct
from collections import OrderedDict
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_async_save import train
from test_codec_differential import same_state

import unbroken
from unbroken.dist.sharded import split
from unbroken.state import tensorfile as TF
from unbroken.state._digest import digest_tree
from unbroken.state.codec import encode_tree_for_file
from unbroken.state.generation import decode_generation, encode_generation
from unbroken.state.tensorread import decode_safetensors

META = {"unbroken.run_id": "r", "unbroken.generation": "3", "unbroken.incarnation": "0"}
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64,
          torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2]
INTS = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
SHAPES = [(), (0,), (3,), (2, 3), (4, 5), (1, 1), (3, 0, 2), (8, 4)]
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


# -- helpers ------------------------------------------------------------------------------------


def values(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    low = 0 if dtype is torch.uint8 else -100
    return torch.randint(low, 100, shape, generator=g).to(dtype)


def raw(t: torch.Tensor) -> bytes:
    """A tensor's values as bytes (its lazy bits resolved): NaNs compare bit for bit."""
    t = t.detach().resolve_conj().resolve_neg()
    flat = torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1)  # (stride 1 everywhere)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def joined(artifacts: dict[str, Any]) -> dict[str, bytes]:
    return {name: b"".join(bytes(c) for c in chunks) for name, chunks in artifacts.items()}


def detached(tree: Any, memo: dict[int, torch.Tensor] | None = None) -> Any:
    """``tree`` with every tensor detached (one detached view per tensor object)."""
    memo = {} if memo is None else memo
    if isinstance(tree, torch.Tensor):
        if id(tree) not in memo:
            memo[id(tree)] = tree.detach()
        return memo[id(tree)]
    if isinstance(tree, dict):
        out = type(tree)()
        for k, v in tree.items():
            out[k] = detached(v, memo)
        return out
    if isinstance(tree, list):
        return [detached(v, memo) for v in tree]
    if isinstance(tree, tuple):
        return tuple(detached(v, memo) for v in tree)
    return tree


def fingerprint(t: torch.Tensor) -> tuple[Any, ...]:
    grad = t.grad
    return (raw(t), t.requires_grad, t.is_leaf, t.grad_fn is None, t._version, t.dtype,
            tuple(t.shape), t.stride(), t.data_ptr(), None if grad is None else raw(grad),
            None if grad is None else grad._version)


class Roots:
    """Parameters and buffers that live across saves (changed in place between them), and a
    state tree made from them anew for each save (as ``state_dict()`` is)."""

    def __init__(self, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], seed: int):
        self.params: dict[str, torch.Tensor] = {}
        self.kinds = {}
        for i, (kind, dtype, shape) in enumerate(specs):
            name = f"w{i}"
            if kind == "buffer" or not (dtype.is_floating_point or dtype.is_complex):
                t = values(dtype, shape, seed + i)
                kind = "buffer"
            elif kind == "transposed" and len(shape) == 2:
                # a leaf parameter whose memory is not contiguous
                t = torch.nn.Parameter(values(dtype, shape[::-1], seed + i).t())
            else:
                t = torch.nn.Parameter(values(dtype, shape, seed + i))
                if kind == "grad":
                    t.grad = values(dtype, shape, seed + 1000 + i)
            self.params[name] = t
            self.kinds[name] = kind

    def mutate(self, step: int) -> None:
        with torch.no_grad():
            for i, t in enumerate(self.params.values()):
                t.copy_(values(t.dtype, tuple(t.shape), 7919 * step + i))

    def tree(self, dropped: frozenset[str] = frozenset()) -> dict[str, Any]:
        model = OrderedDict((k, v) for k, v in self.params.items() if k not in dropped)
        extra: dict[str, Any] = {}
        state: dict[int, dict[str, Any]] = {}
        for i, (k, v) in enumerate(self.params.items()):
            if k in dropped:
                continue
            kind = self.kinds[k]
            if kind == "tied":
                model[f"{k}.tied"] = v  # the same Parameter under a second key
            elif kind == "neg" and v.dtype.itemsize > 1:  # (torch cannot negate a float8)
                extra[f"{k}.negdetached"] = torch._neg_view(v.detach())
                if v.requires_grad:
                    extra[f"{k}.neglive"] = torch._neg_view(v)  # a non-leaf with the bit
            elif kind == "conj" and v.dtype.is_complex:
                extra[f"{k}.conj"] = v.conj()
                if v.dim() >= 1:
                    extra[f"{k}.imag"] = v.conj().imag  # real, with the negative bit
            elif kind == "nonleaf" and v.requires_grad and v.dtype in (
                    torch.float32, torch.float64, torch.float16, torch.bfloat16):
                extra[f"{k}.twice"] = v * 2  # with a grad_fn: a graph hangs off it
                if v.dim() == 2:
                    extra[f"{k}.t"] = v.t()  # a non-contiguous view with a grad_fn
            elif kind == "shared" and v.dim() >= 1 and v.shape[0] > 1 and v.is_contiguous():
                # two Parameters over one storage: its whole, and from its second row on
                model[f"{k}.whole"] = torch.nn.Parameter(v.detach())
                model[f"{k}.tail"] = torch.nn.Parameter(v.detach()[1:])
            if v.requires_grad:
                state[i] = {"exp_avg": v.detach() * 0 + 1 if v.dtype.is_floating_point
                            and v.dtype.itemsize > 1 else v.detach().clone(),
                            "step": torch.tensor(float(i))}
        return {"model": model, "optimizer": {"state": state, "param_groups": [
            {"lr": 0.1, "params": sorted(state)}]}, "extra": {"nested": extra, "list": list(
                extra.values())[:3]}}


SPEC = st.tuples(
    st.sampled_from(["param", "param", "transposed", "grad", "tied", "neg", "conj",
                     "nonleaf", "shared", "buffer"]),
    st.sampled_from(FLOATS + FLOATS + INTS), st.sampled_from(SHAPES))


def all_tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in all_tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in all_tensors(v)]
    return []


# -- codec: live parameters encode as their detached views --------------------------------------


@settings(SETTINGS, max_examples=40)
@given(specs=st.lists(SPEC, min_size=1, max_size=30), seed=st.integers(0, 2**16),
       ops=st.lists(st.one_of(st.just("mutate"), st.just("same"), st.integers(0, 59)),
                    min_size=1, max_size=4),
       bulk=st.tuples(st.sampled_from([0, 16, 24]), st.sampled_from(FLOATS[:4] + FLOATS[6:]),
                      st.sampled_from(SHAPES), st.sampled_from(["param", "grad", "buffer"])))
@example(specs=[("param", torch.float32, (3,))], seed=1, ops=["mutate", "mutate", 5, "same"],
         bulk=(24, torch.bfloat16, (2, 3), "grad"))
@example(specs=[("buffer", torch.int64, (4,))], seed=2, ops=["mutate", 20, "mutate", 20],
         bulk=(16, torch.float8_e4m3fn, (), "param"))
@example(specs=[("param", torch.float16, (8, 4))], seed=3, ops=["mutate", "same", "mutate"],
         bulk=(16, torch.float32, (0,), "param"))  # (empty tensors: no plan, by `tensor`)
@example(specs=[("shared", torch.float32, (8, 4)), ("tied", torch.float64, (3,))], seed=4,
         ops=["mutate", 0, "mutate", 1], bulk=(24, torch.float64, (1, 1), "param"))
def test_live_parameters_encode_to_the_bytes_of_their_detached_views(specs, seed, ops, bulk):
    # (``bulk``: that many plain parameters of one kind, so that the model's state dict and
    # the optimizer's state are planned, and taken by their plans at the next saves)
    n, dtype, shape, kind = bulk
    specs = [*specs, *[(kind, dtype, shape)] * n] if n and len(specs) % 2 else [
        *[(kind, dtype, shape)] * n, *specs]
    roots = Roots(specs, seed)
    live_layouts: dict[str, Any] = {}
    detached_layouts: dict[str, Any] = {}
    dropped: frozenset[str] = frozenset()
    for step, op in enumerate(["same", *ops, "same"]):
        if op == "mutate":
            roots.mutate(step)
        elif isinstance(op, int):  # the set of keys changes: plans and layouts made again
            name = f"w{op % len(specs)}"
            dropped = dropped ^ {name}
        tree = roots.tree(dropped)
        before = {k: fingerprint(v) for k, v in roots.params.items()}
        live = joined(encode_generation(tree, META, layouts=live_layouts))
        after = {k: fingerprint(v) for k, v in roots.params.items()}
        assert after == before  # nothing of a parameter changed: values, grad, version
        plain = detached(tree)
        assert live == joined(encode_generation(plain, META, layouts=detached_layouts))
        assert live == joined(encode_generation(plain, META))
        assert live == joined(encode_generation(tree, META))
        for view in (False, True):
            files = ({k: memoryview(bytearray(v)) for k, v in live.items()} if view else live)
            decoded, meta = decode_generation(files, "gen")
            assert meta == META
            same_state(tree, decoded)
    for t in roots.params.values():
        if isinstance(t, torch.nn.Parameter):
            assert t.is_leaf and t.requires_grad and t.grad_fn is None


def test_a_state_dict_of_live_parameters_is_planned_and_stays_the_detached_bytes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(12)])
    model[0].weight.data = model[0].weight.data.to(torch.bfloat16)  # mixed dtypes
    layouts: dict[str, Any] = {}
    plans_seen = []
    for step in range(4):
        sd = model.state_dict(keep_vars=True)  # live Parameters, as the process save has them
        assert all(v.requires_grad for v in sd.values())
        tree = {"model": sd}
        out = joined(encode_generation(tree, META, layouts=layouts))
        plans_seen.append(bool(layouts["model.safetensors"].get("plans")))
        assert out == joined(encode_generation({"model": model.state_dict()}, META))
        decoded, _ = decode_generation(out, "gen")
        same_state(model.state_dict(), decoded["model"])
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-1.5).add_(0.25)
        for p in model.parameters():
            assert p.grad_fn is None and p.is_leaf and p.grad is None
    assert plans_seen[1:] == [True] * 3  # the model's state dict of Parameters was planned


def test_encoding_a_parameter_needs_no_grad_mode_and_leaves_no_graph():
    p = torch.nn.Parameter(torch.randn(4, 4))
    q = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.complex128))  # the bytes path
    r = torch.nn.Parameter(torch.randn(6, 2).t())  # made contiguous from its detached view
    version = (p._version, q._version, r._version)
    with torch.enable_grad():
        enc = encode_tree_for_file({"p": p, "q": q, "r": r, "n": torch._neg_view(p),
                                    "c": q.conj()})
    for key, t in enc.tensors.items():
        assert t.is_contiguous() and t.is_cpu and not t.is_neg() and not t.is_conj(), key
        if t is not p:  # (stored as itself) anything else was made from a detached view
            assert t.grad_fn is None and not t.requires_grad, key
    assert enc.tensors["p"] is p
    assert (p._version, q._version, r._version) == version
    chunks = TF.encode_safetensors(enc.tensors, META, prepared=True, kinds=enc.kinds,
                                   ptrs=enc.ptrs)
    found, _ = decode_safetensors(b"".join(bytes(c) for c in chunks), "x")
    assert raw(found["p"]) == raw(p) and raw(found["r"]) == raw(r)
    assert raw(found["n"]) == raw(-p.detach())


# -- digests ------------------------------------------------------------------------------------


@SETTINGS
@given(spec=SPEC, seed=st.integers(0, 1000))
def test_a_live_tensor_digests_as_its_detached_view(spec, seed):
    roots = Roots([spec], seed)
    t = roots.params["w0"]
    for x in (t, t.t() if t.dim() == 2 else t):
        assert digest_tree({"a": x, "b": [x]}) == digest_tree({"a": x.detach(),
                                                               "b": [x.detach()]})
    assert digest_tree(t) == digest_tree(t.detach().clone())


# -- the chunking kept with a layout ------------------------------------------------------------


GROUP_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float32,
                torch.bool, torch.int64, torch.complex64, torch.float16, torch.uint16]
GROUP_SHAPES = [(), (1,), (3,), (2, 5), (16,), (4, 4)]


@SETTINGS
@given(groups=st.lists(st.tuples(st.sampled_from(GROUP_DTYPES), st.sampled_from(GROUP_SHAPES),
                                 st.sampled_from([1, 2, 7, 8, 9, 17]), st.booleans()),
                       min_size=1, max_size=5),
       big=st.sampled_from([None, 0, 1, -1]), seed=st.integers(0, 1000),
       rounds=st.integers(2, 4))
def test_a_cached_chunking_writes_the_bytes_of_a_fresh_one(groups, big, seed, rounds):
    tensors: dict[str, torch.Tensor] = {}
    for g, (dtype, shape, n, live) in enumerate(groups):
        for i in range(n):
            t = values(dtype, shape, seed + 31 * g + i)
            if live and (dtype.is_floating_point or dtype.is_complex):
                t = torch.nn.Parameter(t)
            tensors[f"g{g}.{i:02d}"] = t
    if big is not None:  # a tensor at the small boundary (or one byte side of it)
        n = TF._SMALL + big * 4
        tensors["big"] = torch.nn.Parameter(values(torch.float32, (n // 4,), seed))
        tensors["zbig"] = values(torch.uint8, (TF._SMALL + big,), seed)
    layout: dict[str, Any] = {}
    for r in range(rounds):
        with torch.no_grad():  # new values in place: the same kinds, the cached chunking
            for i, t in enumerate(tensors.values()):
                t.copy_(values(t.dtype, tuple(t.shape), 1000 * r + i))
        want = {k: raw(v) for k, v in tensors.items()}
        enc = encode_tree_for_file(tensors)
        cached = b"".join(bytes(c) for c in TF.encode_safetensors(
            enc.tensors, META, prepared=True, layout=layout, kinds=enc.kinds, ptrs=enc.ptrs))
        assert "chunking" in layout
        fresh = b"".join(bytes(c) for c in TF.encode_safetensors(tensors, META))
        assert cached == fresh
        assert fresh == b"".join(bytes(c) for c in TF.encode_safetensors(
            {k: v.detach() for k, v in tensors.items()}, META, layout={}))
        for data in (cached, memoryview(bytearray(cached))):
            found, meta = decode_safetensors(data, "x")
            assert meta == META
            assert {k: raw(v) for k, v in found.items()} == want
            assert {k: (v.dtype, tuple(v.shape)) for k, v in found.items()} == {
                k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}


@pytest.mark.parametrize("n", [7, 8, 9])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float32,
                                   torch.bfloat16, torch.bool])
def test_runs_at_the_stacked_boundary_keep_every_tensor_in_its_place(n, dtype):
    # one run of small tensors: n of one dtype and shape amid others of another shape
    tensors = {f"a{i}": torch.nn.Parameter(values(dtype, (3,), i))
               if dtype.is_floating_point else values(dtype, (3,), i) for i in range(n)}
    tensors.update({f"b{i}": values(dtype, (5,), 100 + i) for i in range(n)})
    tensors.update({f"c{i}": values(torch.int8, (1,), 200 + i) for i in range(n)})
    layout: dict[str, Any] = {}
    for r in range(3):
        with torch.no_grad():
            for i, t in enumerate(tensors.values()):
                t.copy_(values(t.dtype, tuple(t.shape), 50 * r + i))
        data = b"".join(bytes(c) for c in TF.encode_safetensors(tensors, META, layout=layout))
        runs = [c for c in layout["chunking"] if type(c) is not int]
        assert len(runs) == 1
        stacked = [p for p in runs[0].parts if p[0] is not None]
        assert len(stacked) == (3 if n >= TF._STACKED else 0)
        found, _ = decode_safetensors(data, "x")
        assert {k: raw(v) for k, v in found.items()} == {k: raw(v) for k, v in tensors.items()}


# -- dist.sharded.split -------------------------------------------------------------------------


def _mixed_tree() -> dict[str, Any]:
    p = torch.nn.Parameter(torch.randn(3))
    return {
        "model": OrderedDict(a=p, b=torch.randn(2)),
        "optimizer": {"state": {0: {"exp_avg": torch.zeros(3), "step": torch.tensor(1.0)},
                                1: {"v": torch.nn.Parameter(torch.ones(1))}},
                      "param_groups": [{"params": [0, 1], "lr": 0.1}]},
        "plain": {"x": torch.ones(2), "y": p},
        "nested": {"d": {"e": {"f": torch.ones(1)}}, "g": 3, "empty": {}},
        "counters": {"step": 3},
        "scalar": 5,
    }


def test_split_without_dtensors_leaves_every_dict_itself():
    import torch.distributed.tensor  # noqa: F401 -- so split walks the tree

    tree = _mixed_tree()
    rest, shards = split(tree)
    assert shards == {}
    assert rest.keys() == tree.keys()
    for k in tree:
        assert rest[k] is tree[k], k


def test_split_takes_dtensors_out_of_dicts_beside_dicts_of_plain_tensors():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("no gloo backend in this torch build")
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        dt = distribute_tensor(torch.randn(4, 2), mesh, [Replicate()])
        dparam = torch.nn.Parameter(distribute_tensor(torch.randn(3), mesh, [Replicate()]))
        tree = _mixed_tree()
        tree["model"]["sharded"] = dparam
        tree["optimizer"]["state"][2] = {"exp_avg": dt, "step": torch.tensor(2.0)}
        tree["plain2"] = {"only": dt}  # a plain dict holding a DTensor alone
        # a DTensor parameter (its type stays DTensor) among plain tensors and parameters
        tree["plain3"] = {"x": torch.ones(1), "p": torch.nn.Parameter(torch.ones(2)),
                          "dp": dparam}
        assert type(dparam) is not torch.nn.Parameter
        model_before = list(tree["model"].items())
        rest, shards = split(tree)
        assert set(shards) == {json.dumps(["model", "sharded"]),
                               json.dumps(["optimizer", "state", 2, "exp_avg"]),
                               json.dumps(["plain2", "only"]),
                               json.dumps(["plain3", "dp"])}
        assert shards[json.dumps(["model", "sharded"])] is dparam
        assert list(rest["model"]) == ["a", "b"]
        assert type(rest["model"]) is OrderedDict
        assert list(rest["optimizer"]["state"][2]) == ["step"]
        assert rest["optimizer"]["state"][0] is tree["optimizer"]["state"][0]
        assert rest["plain"] is tree["plain"] and rest["nested"] is tree["nested"]
        assert rest["plain2"] == {}
        assert list(rest["plain3"]) == ["x", "p"] and list(tree["plain3"]) == ["x", "p", "dp"]
        assert list(tree["model"].items()) == model_before  # the tree is not changed
        assert "exp_avg" in tree["optimizer"]["state"][2]
    finally:
        if started:
            dist.destroy_process_group()


# -- end to end: process saves write what sync and thread saves write ---------------------------


def _net() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8),
                                torch.nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _state(model, opt) -> dict[str, bytes]:
    out = {f"model.{k}": raw(v) for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        out.update({f"opt.{i}.{k}": raw(v) for k, v in s.items()})
    return out


def _tensor_file(path) -> tuple[dict[str, Any], bytes]:
    data = path.read_bytes()
    header, _meta = TF.read_safetensors_header(data, str(path))  # (stamps differ by run)
    (n,) = struct.unpack("<Q", data[:8])
    return header, data[8 + n:]


def _run(folder, mode) -> tuple[dict[str, bytes], Any]:
    model, opt = _net()
    with unbroken.Checkpointer(folder, model=model, optimizer=opt, async_save=mode) as ckpt:
        train(model, opt, ckpt, 0, 3)
        before = _state(model, opt)
        info = ckpt.save()
        with torch.no_grad():  # the loop goes on at once, in place, grads and all
            for p in model.parameters():
                p.add_(100.0)
                p.grad.mul_(3.0)
            for s in opt.state.values():
                s["exp_avg"].mul_(-3.0)
        waited = ckpt.wait()
        info = info if info is not None else waited
        assert info is not None and info.manifest.step == 3
        for p in model.parameters():  # the save left the parameters as parameters
            assert p.is_leaf and p.requires_grad and p.grad_fn is None
    return before, info


def test_a_process_save_writes_the_files_a_sync_and_a_thread_save_write(tmp_path):
    results = {str(mode): _run(tmp_path / str(mode), mode) for mode in (False, True, "process")}
    befores = [b for b, _ in results.values()]
    assert befores[0] == befores[1] == befores[2]
    paths = {m: tmp_path / m / info.path.split("/")[-1] if isinstance(info.path, str)
             else info.path for m, (_, info) in results.items()}
    for m, path in paths.items():
        assert path.name == "gen-000000003" or path.name.startswith("gen-"), (m, path)
    names = {m: sorted(p.name for p in path.iterdir() if p.name.endswith(".safetensors"))
             for m, path in paths.items()}
    assert names["False"] == names["True"] == names["process"]
    assert {"model.safetensors", "optimizer.safetensors"} <= set(names["False"])
    for name in ("model.safetensors", "optimizer.safetensors"):
        files = {m: _tensor_file(path / name) for m, path in paths.items()}
        assert files["False"] == files["True"] == files["process"], name
    docs = {m: json.loads((path / "state.json").read_bytes()) for m, path in paths.items()}
    for part in ("model", "optimizer"):
        assert docs["False"]["parts"][part] == docs["True"]["parts"][part] \
            == docs["process"]["parts"][part], part
    for m, (before, _) in results.items():  # each restores bitwise, into a fresh model
        model, opt = _net()
        with unbroken.Checkpointer(tmp_path / m, model=model, optimizer=opt) as ckpt:
            assert ckpt.restore() == 3
        assert _state(model, opt) == before, m
        for p in model.parameters():
            assert p.is_leaf and p.requires_grad


class _Odd(torch.nn.Module):
    """Tied weights, a frozen layer, a bfloat16 and a float64 parameter, a non-contiguous
    leaf parameter and an int buffer: what a process save now captures undetached."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.frozen = torch.nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.bf = torch.nn.Parameter(torch.randn(6).to(torch.bfloat16))
        self.f64 = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
        self.tw = torch.nn.Parameter(torch.randn(5, 4).t())  # (4, 5), not contiguous
        self.register_buffer("count", torch.arange(3))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.frozen(self.emb(idx)) @ self.tw
        return self.head(h[..., :4]).pow(2).mean() + self.f64.sum().float() * 0.01 \
            + self.bf.float().sum() * 0.01


def _odd_run(folder, mode, incremental: bool) -> tuple[dict[str, bytes], list[str]]:
    model = _Odd()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    with unbroken.Checkpointer(folder, model=model, optimizer=opt, async_save=mode,
                               incremental=incremental) as ckpt:
        for step in range(1, 5):
            loss = model(torch.randint(0, 10, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            ckpt.step_done(step, loss=loss)
            if step in (2, 4):
                ckpt.save()
                ckpt.save()  # the same step again, unchanged
                ckpt.wait()
            if step == 2:  # the state changes under the same step: saved again, superseding
                with torch.no_grad():
                    model.f64.add_(1.0)
                ckpt.save()
                with torch.no_grad():
                    model.tw.mul_(-1.0)  # right after save(): not what is written
                ckpt.wait()
                with torch.no_grad():
                    model.tw.mul_(-1.0)
        assert model.head.weight is model.emb.weight
        assert not model.frozen.weight.requires_grad and model.tw.is_leaf
        before = _state(model, opt)
    gens = sorted(p.name for p in folder.glob("gen-*"))
    restored = _Odd()
    ropt = torch.optim.AdamW(restored.parameters(), lr=1e-2, foreach=False)
    with unbroken.Checkpointer(folder, model=restored, optimizer=ropt) as ckpt:
        assert ckpt.restore() == 4
    assert restored.head.weight is restored.emb.weight
    assert _state(restored, ropt) == before
    return before, gens


@pytest.mark.parametrize("incremental", [False, True])
def test_a_process_save_of_tied_frozen_and_odd_parameters_restores_as_a_sync_one(
        tmp_path, incremental):
    sync = _odd_run(tmp_path / "sync", False, incremental)
    process = _odd_run(tmp_path / "process", "process", incremental)
    assert sync == process
    for gen in sync[1]:  # (the step-2 one was written while the loop changed ``tw``)
        names = sorted(p.name for p in (tmp_path / "sync" / gen).glob("*.safetensors"))
        assert names == sorted(p.name for p in (tmp_path / "process" / gen).glob(
            "*.safetensors"))
        assert "model.safetensors" in names or incremental
        for name in names:
            a, b = tmp_path / "sync" / gen / name, tmp_path / "process" / gen / name
            assert _tensor_file(a) == _tensor_file(b), (gen, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float64, torch.complex64, torch.float8_e4m3fn])
def test_a_stretch_of_live_parameters_is_stacked_not_moved_one_by_one(dtype):
    # (a stack of parameters outside no_grad would raise, and fall back to memmove unseen)
    params = tuple(torch.nn.Parameter(values(dtype, (2, 3), i)) for i in range(TF._STACKED))
    size = params[0].nbytes
    into = torch.empty(len(params) * size, dtype=torch.uint8)
    with torch.enable_grad():
        assert TF._stacked(params, into, dtype, params[0].shape)
    assert into.numpy().tobytes() == b"".join(raw(p) for p in params)
    assert all(p.is_leaf and p.grad_fn is None and p._version == 0 for p in params)
