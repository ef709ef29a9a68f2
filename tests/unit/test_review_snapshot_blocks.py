"""Review of the async snapshot's blocks (`_Taking.blocked`: a plan's small tensors of one
shape and dtype are views of one block, copied by one ``torch.stack``) and of the async save's
parameters captured without ``detach`` (`capture(detach=False)`).

Each test changes a planned tree the way a training loop or an unusual model can between two
snapshots, then checks the snapshot against the tree (bit for bit) and against what brand-new
buffers take (`SnapshotBuffers().take`): the same containers, dtypes, shapes, strides and
bits, ties exactly where the tree has one view twice, no memory shared with the tree, and
nothing the loop does afterwards changing it. The Checkpointer tests restore what an async
save wrote into freshly built objects and compare it, bitwise, with clones taken at save time.
The defects found are at the end, each marked ``# FIXED:`` with what was wrong."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_review_snapshot_plans import _same as _same_tree
from test_snapshot_plans import _tensors

import unbroken
from unbroken.errors import UnsupportedValue
from unbroken.persist import plans, snapshot
from unbroken.persist.snapshot import SnapshotBuffers
from unbroken.state.livemodel import LiveModel
from unbroken.state.views import view_ident

N = plans.PLANNED + 2  # tensors in a container: enough for a plan


# -- helpers ----------------------------------------------------------------------------------


def _leaves(obj: Any) -> list[torch.Tensor]:
    return _tensors(obj, [])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as bytes (NaN payloads, -0.0 and the lazy bits resolved count)."""
    t = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _same(a: Any, b: Any) -> None:
    """Same containers (types, keys and their types, order, _metadata), tensors of the same
    dtype, shape and bits."""
    _same_tree(a, b, _same_bits)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of memory ``t``'s elements lie in."""
    if not t.numel():
        return (0, 0)
    start = t.data_ptr()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n) * t.element_size()
    lo, hi = start + min(0, last), start + max(0, last) + t.element_size()
    return (lo, hi)


def _check(buffers: SnapshotBuffers, tree: dict[str, Any],
           counting: _Counting | None = None) -> dict[str, Any]:
    """``buffers.take(tree)`` (its stacks and fills counted by ``counting``), checked against
    the tree and against fresh buffers' snapshot; then the loop goes on (every byte of the
    tree's memory changes): the snapshot does not."""
    if counting is not None:
        counting.active = True
    try:
        snap = buffers.take(tree)
    finally:
        if counting is not None:
            counting.active = False
    fresh = SnapshotBuffers().take(tree)
    _same(snap, tree)
    _same(snap, fresh)
    src, got, new = _leaves(tree), _leaves(snap), _leaves(fresh)
    assert len(src) == len(got) == len(new)
    for g, f in zip(got, new):
        assert type(g) is torch.Tensor and not g.requires_grad and g.grad_fn is None
        assert g.stride() == f.stride() and g.is_contiguous()
        assert not g.is_conj() and not g.is_neg()
    # ties: two leaves share a buffer exactly when they are one view
    ident = [view_ident(t) or id(t) for t in src]
    ids = [id(x) for x in got]
    assert [ident.index(i) for i in ident] == [ids.index(g) for g in ids]
    # buffers apart from each other (one view: one buffer) and from the tree's memory
    spans = {id(x): _span(x) for x in got if x.numel()}
    ordered = sorted(spans.values())
    assert all(a[1] <= b[0] for a, b in zip(ordered, ordered[1:])), "buffers overlap"
    stores = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in src
              if t.is_cpu and t.untyped_storage().nbytes()}
    for s in stores.values():
        lo, hi = s.data_ptr(), s.data_ptr() + s.nbytes()
        assert all(b <= lo or a >= hi for a, b in spans.values()), "shares the tree's memory"
    before = [_bits(x).clone() for x in got]
    raw = [torch.empty(0, dtype=torch.uint8).set_(s) for s in stores.values()]
    with torch.no_grad():
        for r in raw:
            r.add_(1)
    try:
        assert all(torch.equal(_bits(x), b) for x, b in zip(got, before))
    finally:
        with torch.no_grad():
            for r in raw:
                r.sub_(1)
    return snap


class _Counting:
    """Counts ``torch.stack`` calls and the paths `fill` takes while ``active``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.stacks: list[int] = []
        self.filled: list[tuple[Any, ...]] = []
        self.active = False
        real_stack, real_fill = torch.stack, snapshot._Taking.fill

        def stack(tensors, *a, **k):
            if self.active:
                self.stacks.append(len(tensors))
            return real_stack(tensors, *a, **k)

        def fill(this, out, items, path):
            if self.active:
                self.filled.append(path)
            return real_fill(this, out, items, path)

        monkeypatch.setattr(torch, "stack", stack)
        monkeypatch.setattr(snapshot._Taking, "fill", fill)


def _model_sd(n: int = N) -> OrderedDict[str, torch.Tensor]:
    sd: OrderedDict[str, torch.Tensor] = OrderedDict()
    for i in range(n):
        sd[f"w{i}"] = torch.randn(3, 2)
        sd[f"b{i}"] = torch.randn(4)
    sd["big"] = torch.randn(plans.BLOCKED // 4 + 1)
    sd._metadata = OrderedDict({"": {"version": 1}})  # type: ignore[attr-defined]
    return sd


def _plan(buffers: SnapshotBuffers, path: tuple[Any, ...]) -> plans.Plan:
    plan = buffers._plans[path]
    assert plan.blocks, "the test needs a plan with blocks"
    return plan


# -- shapes, dtypes and views changing between two snapshots ------------------------------------


@pytest.mark.parametrize("how", ["all_transposed", "all_broadcastable", "all_but_first",
                                 "first_only", "last_only", "all_bigger"])
def test_block_members_changing_shape_are_taken_as_fresh_buffers_take(how):
    torch.manual_seed(0)
    sd = _model_sd()
    tree = {"model": sd}
    buffers = SnapshotBuffers()
    _check(buffers, tree)
    _check(buffers, tree)  # by the plan
    _plan(buffers, ("model",))
    keys = [f"w{i}" for i in range(N)]
    new = {"all_transposed": lambda: torch.randn(2, 3),
           "all_broadcastable": lambda: torch.randn(1, 2),
           "all_bigger": lambda: torch.randn(4, 2)}
    if how in new:
        for k in keys:
            sd[k] = new[how]()
    elif how == "all_but_first":
        for k in keys[1:]:
            sd[k] = torch.randn(1, 2)
    elif how == "first_only":
        sd[keys[0]] = torch.randn(2, 3)
    else:
        sd[keys[-1]] = torch.randn(3, 1)
    snap = _check(buffers, tree)
    assert all(snap["model"][k].shape == sd[k].shape for k in sd)
    _check(buffers, tree)  # planned again, for the new shapes


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int32,
                                   torch.bool, torch.complex64])
@pytest.mark.parametrize("where", [0, 5, N - 1])
def test_a_block_member_of_another_dtype_is_not_cast_into_the_block(dtype, where):
    """``torch.stack(out=)`` would cast silently: each tensor's dtype is checked."""
    torch.manual_seed(0)
    sd = _model_sd()
    tree = {"model": sd}
    buffers = SnapshotBuffers()
    _check(buffers, tree)
    _plan(buffers, ("model",))
    sd[f"w{where}"] = (torch.randn(3, 2) * 100).to(dtype)
    snap = _check(buffers, tree)
    assert snap["model"][f"w{where}"].dtype == dtype
    _check(buffers, tree)


def test_block_members_becoming_views_of_each_other_or_of_live_memory():
    torch.manual_seed(0)
    sd = _model_sd()
    extra = {"flat": torch.randn(100)}
    tree = {"model": sd, "extra": extra}
    buffers = SnapshotBuffers()
    _check(buffers, tree)
    _check(buffers, tree)
    flat = extra["flat"]
    sd["w1"] = sd["w0"]  # one object twice: a tie
    sd["w2"] = sd["w3"].detach()  # another object, one view: a tie
    sd["w4"] = flat[1:7].view(3, 2)  # a view of a later part's tensor at another offset
    sd["w5"] = flat[4:10].view(3, 2)  # overlapping the one above
    sd["w6"] = flat[:6].view(3, 2)  # the later part's address, another view
    sd["b1"] = sd["w7"].view(-1)[:4]  # a view of another block's member
    snap = _check(buffers, tree)
    assert snap["model"]["w1"] is snap["model"]["w0"]
    assert snap["model"]["w2"] is snap["model"]["w3"]
    assert snap["model"]["w6"] is not snap["extra"]["flat"]
    _check(buffers, tree)
    sd["w1"], sd["w2"] = torch.randn(3, 2), torch.randn(3, 2)  # untied again
    _check(buffers, tree)
    _check(buffers, tree)


def test_a_tie_with_a_later_part_takes_the_block_view():
    torch.manual_seed(0)
    sd = _model_sd()
    tree = {"model": sd, "opt": {"state": {"w0": {"avg": sd["w0"]}}}}
    buffers = SnapshotBuffers()
    _check(buffers, tree)
    snap = _check(buffers, tree)
    _plan(buffers, ("model",))
    assert snap["opt"]["state"]["w0"]["avg"] is snap["model"]["w0"]


def test_one_container_under_two_paths_is_one_set_of_buffers():
    torch.manual_seed(0)
    sd = _model_sd()
    tree = {"a": sd, "b": sd}
    buffers = SnapshotBuffers()
    for _ in range(3):
        snap = _check(buffers, tree)
        assert all(snap["a"][k] is snap["b"][k] for k in sd)
        with torch.no_grad():
            for t in sd.values():
                t.mul_(-1.5)


def test_resize_in_place_of_block_members():
    torch.manual_seed(0)
    sd = _model_sd()
    tree = {"model": sd}
    buffers = SnapshotBuffers()
    _check(buffers, tree)
    _check(buffers, tree)
    sd["w0"].resize_(2, 3)  # the first of its block: same bytes, another shape
    sd["w3"].resize_(4, 2)  # more bytes: a new storage
    sd["b2"].resize_(2)  # fewer
    _check(buffers, tree)
    _check(buffers, tree)
    for i in range(N):  # every member of a block, to one same shape
        sd[f"b{i}"].resize_(2, 2)
    _check(buffers, tree)
    _check(buffers, tree)


def test_lazy_and_strided_block_members_are_taken_by_the_stack_with_their_values(monkeypatch):
    """Non-contiguous, channels_last, zero-stride, negative and conjugate views of the planned
    shapes and dtypes are taken by the plan's stack (not `fill`), with their values."""
    torch.manual_seed(0)
    sd: OrderedDict[str, torch.Tensor] = OrderedDict()
    for i in range(N):
        sd[f"w{i}"] = torch.randn(3, 2)
        sd[f"c{i}"] = torch.randn(2, 3, 2, 2)
        sd[f"z{i}"] = torch.randn(3, dtype=torch.complex64)
    tree = {"model": sd}
    buffers = SnapshotBuffers()
    _check(buffers, tree)
    _plan(buffers, ("model",))
    zs = torch.randn(3, 2, dtype=torch.complex64)
    sd["w0"] = torch.randn(2, 3).t()  # non-contiguous
    sd["w1"] = torch.randn(1, 2).expand(3, 2)  # zero stride
    sd["w2"] = zs.conj().imag  # the negative bit
    sd["w3"] = torch.randn(6)[::2].unsqueeze(1).expand(3, 2)
    sd["c0"] = torch.randn(2, 3, 2, 2).to(memory_format=torch.channels_last)
    sd["c1"] = torch.randn(2, 2, 2, 3).permute(0, 3, 1, 2)
    sd["z0"] = torch.randn(3, dtype=torch.complex64).conj()  # the conjugate bit
    sd["z1"] = torch.randn(3, dtype=torch.complex64).conj().neg()  # both bits
    for i in range(4, N):  # every other member lazy too
        sd[f"z{i}"] = torch.randn(3, dtype=torch.complex64).conj()
    counting = _Counting(monkeypatch)
    snap = _check(buffers, tree, counting)
    assert len(counting.stacks) == 3 and ("model",) not in counting.filled
    assert _same_bits(snap["model"]["w2"], -zs.imag)
    assert _same_bits(snap["model"]["z0"], sd["z0"].resolve_conj())


_DTYPES = [torch.bool, torch.int8, torch.uint8, torch.int16, torch.int64, torch.float16,
           torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
           torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16]


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_blocks_of_every_dtype_copy_every_bit(dtype, monkeypatch):
    """Raw bytes (NaN payloads, -0.0, subnormals, infinities) survive the stack bit for bit;
    a bool block gets 0 and 1."""
    torch.manual_seed(0)

    def make() -> torch.Tensor:
        if dtype is torch.bool:
            return torch.rand(5, 2) > 0.5
        raw = torch.randint(0, 256, (5, 2 * dtype.itemsize), dtype=torch.uint8)
        return raw.view(dtype)

    sd = {f"t{i}": make() for i in range(N)}
    tree = {"m": sd}
    buffers = SnapshotBuffers()
    _check(buffers, tree)
    _plan(buffers, ("m",))
    for i in range(N):
        sd[f"t{i}"] = make() if i % 2 else make().t().contiguous().t()  # (non-contiguous)
    counting = _Counting(monkeypatch)
    _check(buffers, tree, counting)
    assert counting.stacks == [N] and ("m",) not in counting.filled


def test_parameters_requiring_grad_under_grad_mode(monkeypatch):
    """Live parameters (the async save's model) and tensors with history, under an enabled
    grad mode: the stack runs under no_grad, the buffers have no history, and the live
    tensors are untouched (a backward over a graph built before the snapshot still runs)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(N)])
    buffers = SnapshotBuffers()
    with torch.enable_grad():
        _check(buffers, {"model": LiveModel(model).state_dict(detach=False)})
        _plan(buffers, ("model",))
        loss = model(torch.randn(2, 3)).pow(2).sum()
        versions = [p._version for p in model.parameters()]
        counting = _Counting(monkeypatch)
        sd = LiveModel(model).state_dict(detach=False)
        assert all(type(v) is torch.nn.Parameter for v in sd.values())
        snap = _check(buffers, {"model": sd}, counting)
        assert counting.stacks and ("model",) not in counting.filled
        sd2 = dict(sd, **{"0.weight": model[0].weight * 2})  # a non-leaf with history
        _check(buffers, {"model": sd2})
    assert [p._version for p in model.parameters()] == versions
    loss.backward()  # the graph is intact
    assert all(p.grad is not None for p in model.parameters())
    assert all(not t.requires_grad for t in snap["model"].values())


def test_the_block_size_limit_is_65536_bytes():
    torch.manual_seed(0)
    at = plans.BLOCKED
    sd = {f"a{i}": torch.randn(at // 4) for i in range(N)}  # exactly 65536 bytes: blocked
    sd.update({f"o{i}": torch.randint(0, 255, (at + 1,), dtype=torch.uint8) for i in range(2)})
    sd.update({f"s{i}": torch.randn(3) for i in range(N)})
    tree = {"m": sd}
    buffers = SnapshotBuffers()
    _check(buffers, tree)
    plan = _plan(buffers, ("m",))
    keys = list(sd)
    assert sorted(tuple(b.shape) for b in plan.blocks) == [(N, 3), (N, at // 4)]
    assert [keys[i] for i in plan.loose] == ["o0", "o1"]
    for t in sd.values():
        t.add_(3)
    _check(buffers, tree)


def test_blocks_of_two_and_a_tensor_alone_of_its_kind():
    torch.manual_seed(0)
    sd: dict[str, torch.Tensor] = {}
    for i in range(8):  # 8 kinds, 2 tensors each, and one alone
        sd[f"x{i}"] = torch.randn(i + 1)
        sd[f"y{i}"] = torch.randn(i + 1)
    sd["alone"] = torch.randn(2, 2, dtype=torch.float64)
    tree = {"m": sd}
    buffers = SnapshotBuffers()
    _check(buffers, tree)
    plan = _plan(buffers, ("m",))
    assert sorted(b.shape[0] for b in plan.blocks) == [2] * 8
    assert [list(sd)[i] for i in plan.loose] == ["alone"]
    sd["y3"] = torch.randn(5)  # one of a block of two: another shape
    _check(buffers, tree)
    sd["x3"] = torch.randn(5)  # and its pair
    _check(buffers, tree)
    _check(buffers, tree)


def test_optimizer_state_blocks_take_new_tensor_objects_and_steps():
    torch.manual_seed(0)
    state = {f"p{i}": {"step": torch.tensor(float(i)), "exp_avg": torch.randn(3),
                       "exp_avg_sq": torch.rand(3)} for i in range(N)}
    tree = {"opt": {"state": state, "lr": 0.1}}
    buffers = SnapshotBuffers()
    _check(buffers, tree)
    plan = _plan(buffers, ("opt", "state"))
    assert sorted(tuple(b.shape) for b in plan.blocks) == [(N,), (2 * N, 3)]
    for k in state:  # the optimizer replaced by a new one, loaded: new objects, same shapes
        state[k] = {n: v.clone() * 2 for n, v in state[k].items()}
    _check(buffers, tree)
    state["p3"]["step"] = torch.tensor([3.0])  # a (1,) step among () steps
    _check(buffers, tree)
    state["p3"]["step"] = torch.tensor(3.0, dtype=torch.float64)
    _check(buffers, tree)
    _check(buffers, tree)


def test_a_stack_that_fails_midway_falls_back_to_the_same_buffers():
    """The first block's stack succeeds, the second's refuses a member's shape: `fill` takes
    the container into the buffers, the values are the tree's."""
    torch.manual_seed(0)
    sd = _model_sd()
    tree = {"model": sd}
    buffers = SnapshotBuffers()
    _check(buffers, tree)
    order = [tuple(b.shape) for b in _plan(buffers, ("model",)).blocks]
    later = "b" if order[0][1:] == (3, 2) else "w"
    sd[f"{later}5"] = torch.randn(1, 4) if later == "b" else torch.randn(1, 2)
    with torch.no_grad():
        for t in sd.values():
            t.mul_(-2)
    _check(buffers, tree)
    _check(buffers, tree)


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_failed_snapshot_then_a_good_one(where):
    torch.manual_seed(0)
    sd = _model_sd()
    buffers = SnapshotBuffers()
    bad_part = {"s": torch.zeros(3).to_sparse()}

    def tree(bad: bool) -> dict[str, Any]:
        parts: dict[str, Any] = {"model": sd}
        if bad:
            parts = {"bad": bad_part, **parts} if where == "before" else {**parts, "bad": bad_part}
        return parts

    # the failed snapshot is the one that makes the plan (blocks uninitialised)
    with pytest.raises(UnsupportedValue):
        buffers.take(tree(True))
    _check(buffers, tree(False))
    # a failed one by the plan, with new values and a new shape
    with torch.no_grad():
        for t in sd.values():
            t.add_(1)
    sd["w2"] = torch.randn(2, 3)
    with pytest.raises(UnsupportedValue):
        buffers.take(tree(True))
    with torch.no_grad():
        for t in sd.values():
            t.mul_(3)
    _check(buffers, tree(False))
    _check(buffers, tree(False))


def test_a_first_snapshot_in_inference_mode_then_one_outside():
    # FIXED (older than the blocks: the commit before them failed the same way): buffers
    # made by a snapshot taken under ``torch.inference_mode()`` (a save from an evaluation hook) are
    # inference tensors; every later snapshot outside it raises torch's untyped RuntimeError
    # "Inplace update to inference tensor outside InferenceMode" from the final
    # _foreach_copy_ (here: into the loose "big" buffer), and keeps raising, since the entries
    # stay. (The blocks alone happen to pass: the stack's refusal falls back to `fill`.)
    # Repro: b = SnapshotBuffers(); with torch.inference_mode(): b.take({"m": {"x":
    # torch.randn(3)}}); b.take({"m": {"x": torch.randn(3)}}) -> RuntimeError.
    torch.manual_seed(0)
    sd = _model_sd()
    buffers = SnapshotBuffers()
    with torch.inference_mode():
        buffers.take({"model": sd})
    _check(buffers, {"model": sd})
    with torch.no_grad():
        for t in sd.values():
            t.add_(1)
    _check(buffers, {"model": sd})


# -- memory ---------------------------------------------------------------------------------


def test_per_tensor_buffers_are_released_once_blocked(monkeypatch):
    """The buffers `fill` made for the small tensors are dropped when the plan gives them
    block views: only the blocks, the big tensor's buffer and the lone one are alive."""
    torch.manual_seed(0)
    made: list[weakref.ref[torch.Tensor]] = []
    real = snapshot._fit

    def fit(entry, t):
        got = real(entry, t)
        if got is not entry:
            made.append(weakref.ref(got[0]))
        return got

    monkeypatch.setattr(snapshot, "_fit", fit)
    sd = _model_sd()
    sd["alone"] = torch.randn(7, dtype=torch.float64)
    buffers = SnapshotBuffers()
    snap = buffers.take({"model": sd})
    gc.collect()
    alive = [r() for r in made if r() is not None]
    assert len(made) == len(sd)
    assert {id(t) for t in alive} == {id(snap["model"]["big"]), id(snap["model"]["alone"])}
    assert buffers.nbytes == sum(t.nbytes for t in sd.values())


def test_blocks_are_released_when_replanned_or_dropped():
    torch.manual_seed(0)
    sd = _model_sd()
    buffers = SnapshotBuffers()
    buffers.take({"model": sd, "other": {"x": torch.randn(4)}})
    blocks = [weakref.ref(b) for b in _plan(buffers, ("model",)).blocks]
    sd["new"] = torch.randn(3, 2)  # a new key: planned again, new blocks
    snap = buffers.take({"model": sd, "other": {"x": torch.randn(4)}})
    gc.collect()
    assert all(r() is None for r in blocks)
    blocks = [weakref.ref(b) for b in _plan(buffers, ("model",)).blocks]
    assert all(r() is not None for r in blocks)
    del snap
    buffers.take({"other": {"x": torch.randn(4)}})  # the model dropped
    gc.collect()
    assert all(r() is None for r in blocks)
    assert buffers.nbytes == 16 and not buffers._plans


# -- real async saves -------------------------------------------------------------------------


def _net(tied: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    if tied:
        emb = torch.nn.Embedding(10, 4)
        layers: list[torch.nn.Module] = [emb]
        layers += [torch.nn.Linear(4, 4) for _ in range(8)]
        out = torch.nn.Linear(4, 10)
        out.weight = emb.weight
        model = torch.nn.Sequential(*layers, out)
    else:
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(9)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        out.update({f"opt.{i}.{k}": v.clone() for k, v in s.items()})
    return out


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        x = torch.randint(0, 10, (5,)) if isinstance(model[0], torch.nn.Embedding) \
            else torch.randn(5, 4)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _restored(path, step: int, tied: bool) -> dict[str, torch.Tensor]:
    model, opt = _net(tied)
    with unbroken.Checkpointer(path, model=model, optimizer=opt) as ckpt:
        assert ckpt.restore(generation=step) == step
    if tied:
        assert model[0].weight is model[-1].weight
    return _state(model, opt)


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if not _same_bits(a[k], b[k])]
    assert not bad, bad


@pytest.mark.parametrize("tied", [False, True])
def test_what_an_async_save_writes_is_the_state_at_save_whatever_the_loop_does(tmp_path, tied):
    """Three async saves (the first plans, the others take blocks); right after each
    ``save()`` returns the loop changes the parameters in place, through ``.data`` and by an
    optimizer step, and replaces optimizer state tensors; every generation restores into a
    fresh model and optimizer bit for bit as cloned at save time."""
    model, opt = _net(tied)
    at: dict[int, dict[str, torch.Tensor]] = {}
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               async_save=True, keep=unbroken.Keep(last=5)) as ckpt:
        for step in (1, 2, 3):
            _train(model, opt)
            at[step] = _state(model, opt)
            assert ckpt.save(step) is None
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-3.0).add_(7.0)
                model[1].weight.data = torch.randn(4, 4)
                model[2].bias.data = model[3].bias.data  # a tie through .data
            for s in opt.state.values():
                s["exp_avg"].fill_(float("nan"))
                s["exp_avg_sq"] = torch.zeros_like(s["exp_avg_sq"])
            _train(model, opt)
            info = ckpt.wait()
            assert info is not None and info.manifest.step == step
            model[2].bias.data = model[2].bias.data.clone()  # untied for the next save
        plans = ckpt._buffers._plans  # (tied: the model's state_dict holds one view twice)
        assert (("model",) in plans) is not tied
        assert plans[("optimizer", "state")].blocks
    for step in (3, 2, 1):  # (newest first: continuing from an older one sets newer aside)
        _assert_bitwise(_restored(tmp_path / "run", step, tied), at[step])


@contextlib.contextmanager
def _saved_once(run: Any) -> Iterator[tuple[torch.nn.Module, torch.optim.Optimizer, Any]]:
    """A trained net and its async Checkpointer in ``run``, generation 1 saved and waited
    for; closed on leaving."""
    model, opt = _net()
    _train(model, opt)
    with unbroken.Checkpointer(run, model=model, optimizer=opt, async_save=True) as ckpt:
        ckpt.save(1)
        ckpt.wait()
        yield model, opt, ckpt


def test_a_tie_through_data_is_saved_and_restored(tmp_path):
    """``param.data = other.data`` before an async save: the two entries are one view in the
    snapshot (one buffer) and both restore to the value at save."""
    with _saved_once(tmp_path / "run") as (model, opt, ckpt):
        model[4].weight.data = model[5].weight.data
        tree = ckpt._buffers.take({"model": LiveModel(model).state_dict(detach=False)})
        assert tree["model"]["4.weight"] is tree["model"]["5.weight"]
        at = _state(model, opt)
        ckpt.save(2)
        with torch.no_grad():
            model[5].weight.add_(1)
        ckpt.wait()
    _assert_bitwise(_restored(tmp_path / "run", 2, False), at)


def test_a_parameter_replaced_by_another_shape_between_snapshots():
    """``param.data = torch.randn(other shape)`` (and back) on a live model taken without
    detach: taken as fresh buffers take it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(N)])
    buffers = SnapshotBuffers()
    live = lambda: {"model": LiveModel(model).state_dict(detach=False)}  # noqa: E731
    _check(buffers, live())
    _check(buffers, live())
    old = model[3].weight.data
    model[3].weight.data = torch.randn(2, 5)
    model[4].bias.data = torch.randn(3, dtype=torch.float64)
    _check(buffers, live())
    model[3].weight.data = old
    model[4].bias.data = torch.randn(3)
    _check(buffers, live())
    _check(buffers, live())


def test_a_failed_async_save_then_a_good_one(tmp_path):
    """A save that fails in the snapshot (an unstorable buffer, after the model's plan took
    its blocks) raises, and the next one writes the state at its call."""
    with _saved_once(tmp_path / "run") as (model, opt, ckpt):
        _train(model, opt)
        model[8].register_buffer("bad", torch.zeros(3).to_sparse())
        with pytest.raises(UnsupportedValue):
            ckpt.save(2)
        del model[8]._buffers["bad"]
        _train(model, opt)
        at = _state(model, opt)
        ckpt.save(3)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        ckpt.wait()
    _assert_bitwise(_restored(tmp_path / "run", 3, False), at)


def test_a_parameter_subclass_model_is_saved_and_restored(tmp_path):
    """Parameters of a subclass of nn.Parameter: taken without detach (not by a plan), the
    generation restores bit for bit."""
    model, opt = _net()
    for m in model:
        m.weight = _Param(m.weight.detach().clone())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt,
                               async_save=True) as ckpt:
        for step in (1, 2):
            _train(model, opt)
            at = _state(model, opt)
            ckpt.save(step)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1)
            ckpt.wait()
    _assert_bitwise(_restored(tmp_path / "run", 2, False), at)


class _Param(torch.nn.Parameter):
    """A subclass of nn.Parameter (as some libraries define)."""


# -- defects ----------------------------------------------------------------------------------


def test_a_container_with_an_empty_tensor_reuses_its_blocks():
    # FIXED: buffers are no longer reused while a planned container holds an empty tensor
    # (the ``torch.empty(0)`` device-marker parameter idiom, an nn.Embedding(0, d)):
    # `planned` refuses it (``0 in ptrs``), `fill` takes the container, and `plan` (which
    # accepts an empty tensor as a loose one) calls `blocked` again, which allocates new
    # blocks for every small tensor, on every snapshot (after the plan's stack already wrote
    # the old blocks: two copies). Before this change the per-tensor buffers were reused.
    # Repro: sd = {f"w{i}": torch.randn(10) for i in range(20)} | {"e": torch.empty(0)};
    # b = SnapshotBuffers(); b.take({"m": sd})["m"]["w0"] is not b.take({"m": sd})["m"]["w0"].
    torch.manual_seed(0)
    sd = _model_sd()
    sd["marker"] = torch.empty(0)
    buffers = SnapshotBuffers()
    first = _check(buffers, {"model": sd})
    second = _check(buffers, {"model": sd})
    assert second["model"]["marker"] is first["model"]["marker"]
    assert second["model"]["big"] is first["model"]["big"]
    assert second["model"]["w0"] is first["model"]["w0"]


def test_two_views_at_one_address_in_a_planned_container_reuse_its_blocks():
    # FIXED: the same churn as above when two entries are different views at one address
    # (a module's flat buffer and a parameter viewing its start), or an entry shares its
    # address with a tensor of an earlier part: `planned` refuses (duplicate address), `plan`
    # accepts, and every snapshot allocates new blocks.
    torch.manual_seed(0)
    sd = _model_sd()
    sd["flat"] = torch.randn(64)
    sd["view"] = sd["flat"][:6].view(3, 2)  # another view at flat's address
    buffers = SnapshotBuffers()
    first = _check(buffers, {"model": sd})
    second = _check(buffers, {"model": sd})
    assert second["model"]["w0"] is first["model"]["w0"]


def test_a_parameter_subclass_keeps_its_buffer_from_one_async_snapshot_to_the_next():
    # FIXED (regression of detach=False): the async save now snapshots the live parameters;
    # a subclass of nn.Parameter was detached into a plain tensor before (reused buffer, in a
    # plan), and is now taken by `tensor` as "another kind": `_fit` makes its buffer with
    # ``torch.empty_like(t.detach())`` (a plain tensor) and then requires
    # ``type(entry[0]) is type(t)``, which never holds, so every async save allocates a new
    # buffer for each such parameter, and its container is never planned.
    # Repro: m.weight = P(m.weight.detach()) for P(nn.Parameter); two
    # SnapshotBuffers.take({"m": LiveModel(model).state_dict(detach=False)}) -> new buffers.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(N)])
    for m in model:
        m.weight = _Param(m.weight.detach().clone())
    buffers = SnapshotBuffers()
    first = _check(buffers, {"model": LiveModel(model).state_dict(detach=False)})
    second = _check(buffers, {"model": LiveModel(model).state_dict(detach=False)})
    assert second["model"]["0.bias"] is first["model"]["0.bias"]
    assert second["model"]["0.weight"] is first["model"]["0.weight"]


def test_a_shrunk_container_that_cannot_be_planned_releases_its_old_block():
    # FIXED (minor, memory): when a planned container shrinks and can no longer be planned
    # (here: a tie), its remaining entries keep their views of the old block, and a view
    # keeps the whole block alive: 2 tensors of 4 KB in use hold a block of N x 4 KB for as
    # long as the keys stay (``nbytes`` counts only the 8 KB). With 64 KB tensors and
    # thousands of them the block is hundreds of MB.
    torch.manual_seed(0)
    sd = {f"w{i}": torch.randn(1000) for i in range(N)}
    buffers = SnapshotBuffers()
    buffers.take({"m": sd})
    block = weakref.ref(_plan(buffers, ("m",)).blocks[0])
    small = {"w0": sd["w0"], "w1": sd["w1"], "tie": sd["w0"]}
    for _ in range(2):
        _check(buffers, {"m": small})
    gc.collect()
    assert buffers.nbytes == 2 * 4000
    assert block() is None


def test_buffers_are_host_memory_whatever_the_default_device():
    # FIXED (pre-existing in `_fit`, repeated by the new `blocked`): buffers are made by
    # ``torch.empty(shape, dtype=...)`` without ``device="cpu"``, so under
    # ``torch.set_default_device("cuda")`` (as some training scripts set) or a ``with
    # torch.device(...)`` block the snapshot lands on that device (GPU memory the size of
    # the model), and under "meta" it holds no data at all. Repro: ``with
    # torch.device("meta"): SnapshotBuffers().take({"m": {"x": torch.randn(3)}})["m"]["x"]``
    # is a meta tensor.
    torch.manual_seed(0)
    sd = _model_sd()
    buffers = SnapshotBuffers()
    with torch.device("meta"):
        snap = buffers.take({"model": sd})
        again = buffers.take({"model": sd})
    assert all(t.is_cpu for t in _leaves(snap) + _leaves(again))
    _same(again, {"model": sd})
