"""Review of the process-mode room (`ProcessPersister.room`): gathered small tensors built in
the shared-memory segment itself, listed at the hand-over by offset, the rest copied after
them. Attacked: what each artifact's pieces hold in the segment (room chunks, copied chunks,
a segment that grows while chunks of the old one are still viewed, an encode abandoned
midway, a persisting process replaced), and, end to end, that every generation holds the
state at its ``save()`` bitwise while the loop changes every tensor in place at once: mixed
dtypes (float8 cannot be stacked: the memmove fallback), empty and tied tensors, a state that
grows past the segment and shrinks again, saves of one step twice, incremental saves with
frozen parameters, a failed encode, a killed persisting process, two writers side by side."""

from __future__ import annotations

import os
import signal
import types
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import unbroken
from unbroken.errors import SaveFailed, UnsupportedValue
from unbroken.persist import process as P
from unbroken.persist.process import ProcessPersister
from unbroken.state.incremental import Linked

# -- the hand-over itself, without a persisting process --------------------------------------


class Wire:
    """Stands for the socket: records what `submit` sends (message, descriptor)."""

    def __init__(self) -> None:
        self.sent: list[tuple[dict, int | None]] = []

    def send(self, sock, message, fd=None) -> None:
        self.sent.append((message, fd))


def persister() -> ProcessPersister:
    p = ProcessPersister(types.SimpleNamespace(root="nowhere"), takes_lock=False)
    p._ready = lambda: "socket"  # (a persisting process that is always ready)
    return p


def snapshot_maps() -> int:
    """How many mappings of a snapshot segment this process holds."""
    with open("/proc/self/maps") as f:
        return sum("unbroken-snapshot" in line for line in f)


# one chunk of an artifact: built in the room (if it gives), or memory of its own of a kind
KINDS = ["room", "bytes", "bytearray", "f32", "big"]


def chunk_source(kind: str, n: int, rng: np.random.Generator):
    if kind == "bytes":
        return bytes(rng.integers(0, 256, n, dtype=np.uint8))
    if kind == "bytearray":
        return bytearray(rng.integers(0, 256, n, dtype=np.uint8))
    if kind == "f32":  # a typed (not "B") buffer, as `tensor_bytes` of a NumPy dtype may be
        return memoryview(rng.standard_normal(max(n // 4, 1)).astype(np.float32))
    # over _TORCH_COPY and writable: torch copies it
    return memoryview(bytearray(rng.integers(0, 256, (1 << 20) + n, dtype=np.uint8)))


saves_st = st.lists(
    st.tuples(
        st.lists(st.lists(st.tuples(st.sampled_from(KINDS + ["room"] * 4), st.integers(1, 300_000)),
                          min_size=1, max_size=4), min_size=1, max_size=4),
        st.booleans(),  # a Linked artifact besides
        st.booleans(),  # the encode is abandoned midway (an error), then done again
        st.booleans()),  # the persisting process was replaced since the last save
    min_size=1, max_size=6)


@settings(max_examples=40, deadline=None, database=None)
@given(saves_st, st.integers(0, 2 ** 32 - 1))
def test_each_artifact_lies_in_the_segment_as_listed_whatever_the_room_gave(saves, seed):
    """For every save: each artifact's pieces, read from the segment in order, are its bytes
    at ``submit``; pieces lie after the head, inside the segment, and never overlap; a chunk
    the room gave is listed where it was built, not copied; the descriptor goes along with a
    new segment and to a new persisting process; the sources changing afterwards (the loop)
    changes nothing in the segment; old segments are unmapped once nothing views them."""
    rng = np.random.default_rng(seed)
    wire = Wire()
    p = persister()
    fds_before = len(os.listdir("/proc/self/fd"))
    with mock.patch.object(P._wire, "send", wire.send):
        for layout, linked, abandoned, replaced in saves:
            for attempt in ([0, 1] if abandoned else [1]):
                room = p.room()
                artifacts: dict[str, object] = {}
                want: dict[str, bytes] = {}
                given_here: dict[int, int] = {}  # id of a chunk the room gave -> its offset
                for a, chunks in enumerate(layout):
                    made = []
                    for kind, n in chunks:
                        c = room(n) if kind == "room" else None
                        if c is not None:
                            assert len(c) == n and not c.readonly
                            given_here[id(c)] = p._placed[id(c)][1]
                            c[:] = bytes(rng.integers(0, 256, n, dtype=np.uint8))
                        else:
                            c = chunk_source("bytes" if kind == "room" else kind, n, rng)
                        made.append(c)
                    artifacts[f"a{a}"] = made
                    want[f"a{a}"] = b"".join(bytes(memoryview(c).cast("B")) for c in made)
                if not attempt:
                    continue  # the encode raised here: nothing handed over
                if linked:
                    artifacts["linked"] = Linked("/elsewhere", 3, "0" * 32, None)
                if replaced:
                    p._shm_sent = False  # (as `_start` leaves it)
                segment_before = p._shm_id
                p.submit({"step": 1}, artifacts)
                message, fd = wire.sent[-1]
                new_segment = message["segment"] != segment_before
                assert (fd is not None) == (new_segment or replaced)
                if fd is not None:
                    assert fd == p._shm_fd and os.fstat(fd).st_size == message["segment_size"]
                assert message["segment_size"] == len(p._shm)
                for c in (c for cs in artifacts.values() if isinstance(cs, list) for c in cs):
                    if isinstance(c, bytearray):
                        c[:] = bytes(len(c))  # the loop goes on: sources change
                    elif isinstance(c, memoryview) and not c.readonly and id(c) not in given_here:
                        c.cast("B")[:] = bytes(c.nbytes)
                spans = []
                built = 0
                listed = {a["name"]: a for a in message["artifacts"]}
                assert listed.keys() == artifacts.keys()
                assert listed.get("linked", {"link": [
                    "/elsewhere", 3, "0" * 32]})["link"] == ["/elsewhere", 3, "0" * 32]
                for name, data in want.items():
                    pieces = listed[name]["pieces"]
                    assert len(pieces) == len(artifacts[name])
                    got = b"".join(bytes(p._shm[at:at + n]) for at, n in pieces)
                    assert got == data, name
                    for (at, n), c in zip(pieces, artifacts[name]):
                        if id(c) in given_here and not new_segment:
                            assert at == given_here[id(c)]
                            built += n
                        spans.append((at, n))
                spans.sort()
                assert all(at >= P._wire.HEAD for at, _ in spans)
                assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:])), spans
                assert spans[-1][0] + spans[-1][1] <= message["segment_size"]
                assert p.built == built and p.nbytes == len(b"".join(want.values()))
                del artifacts, made, c, room
                assert snapshot_maps() == 1  # only the current segment stays mapped
    p.close()
    assert snapshot_maps() == 0
    assert len(os.listdir("/proc/self/fd")) <= fds_before  # no descriptor left open


# -- end to end: a Checkpointer saving in process mode ---------------------------------------

VOCAB, WIDTH = 50, 32
F8 = [torch.float8_e4m3fn, torch.float8_e5m2]


class Bag:
    """An extra part whose tensors the test sets (any dtype and size: the state grows and
    shrinks); ``bad``: its state_dict holds a value no save can store (the encode raises
    after the model's chunks were built in the room)."""

    def __init__(self) -> None:
        self.t: dict[str, torch.Tensor] = {}
        self.bad = False

    def state_dict(self) -> dict:
        return {"t": dict(self.t), **({"oops": {1, 2}} if self.bad else {})}

    def load_state_dict(self, saved: dict) -> None:
        self.t = {k: v.clone() for k, v in saved["t"].items()}


class Model(torch.nn.Module):
    """Many small tensors of mixed dtypes: float32 layers (stacked by shape), float8 buffers
    (not stackable on the CPU: moved one by one), bool, int64, bfloat16, float16, an empty
    and a zero-dimensional buffer; ``tied``: the head shares the embedding; ``frozen``: layers
    that never train (incremental saves put them in a stable file, built in the room)."""

    def __init__(self, layers: int = 24, tied: bool = False, frozen: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.frozen = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(frozen))
        self.frozen.requires_grad_(False)
        for i in range(10):  # a run of one float8 dtype and shape: a stack would be tried
            self.register_buffer(f"f8_{i}", torch.randn(9).to(F8[0]))
        self.register_buffer("f8_odd", torch.randn(37).to(torch.float8_e5m2))
        self.register_buffer("flags", torch.rand(5) > 0.5)
        self.register_buffer("count", torch.arange(3))
        self.register_buffer("bf", torch.randn(6).to(torch.bfloat16))
        self.register_buffer("f16", torch.randn(10).to(torch.float16))
        self.register_buffer("nothing", torch.empty(0, 3))
        self.register_buffer("scalar", torch.tensor(5))

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for n, p in self.named_parameters() if not n.startswith("frozen")]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def train(model: Model, opt: torch.optim.Optimizer, mask: int) -> None:
    """One update of the parameters whose bit is set in ``mask`` (the others keep no grad:
    AdamW makes their state when they first train, so the state grows)."""
    params = model.trainable()
    for i, p in enumerate(params):
        p.requires_grad_(bool(mask >> (i % 60) & 1) or i == 0)
    model(torch.randint(0, VOCAB, (8,))).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        model.count.add_(1)
        model.scalar.add_(2)
        model.flags.logical_not_()
        model.f16.mul_(1.5)


def bits(t: torch.Tensor) -> tuple:
    t = t.detach().contiguous()
    return t.dtype, tuple(t.shape), bytes(t.reshape(-1).view(torch.uint8).numpy())


def state(model: Model, opt: torch.optim.Optimizer, bag: Bag) -> dict[str, tuple]:
    """Every tensor of the state, as its bits, with the torch RNG."""
    out = {f"model.{k}": bits(v) for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": bits(v) for k, v in s.items()})
    out.update({f"bag.{k}": bits(v) for k, v in bag.t.items()})
    out["rng"] = bits(torch.get_rng_state())
    return out


def scramble(model: Model, opt: torch.optim.Optimizer, bag: Bag) -> None:
    """What a loop does right after ``save()`` returns: every tensor's bytes change in place
    (the model's, the optimizer's, the extra part's) and the RNG moves on."""
    with torch.no_grad():
        tensors = [*model.state_dict().values(), *bag.t.values(),
                   *(v for s in opt.state.values() for v in s.values())]
        for t in tensors:
            if not t.numel():
                continue
            if t.dtype == torch.bool:
                t.logical_not_()
            else:
                t.reshape(-1).view(torch.uint8).add_(1)
    torch.rand(3)


def reader_state(root, g: int, layers: int, tied: bool, frozen: int, name: str = "bag"
                 ) -> dict[str, tuple]:
    """Generation ``g`` restored by a fresh Checkpointer into a fresh model."""
    model = Model(layers, tied, frozen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    bag = Bag()
    torch.manual_seed(12345)  # (the restore sets the RNG)
    with unbroken.Checkpointer(root, model=model, optimizer=opt, extras={name: bag}) as ckpt:
        assert ckpt.restore(generation=g) == g
    return state(model, opt, bag)


def assert_same(got: dict[str, tuple], want: dict[str, tuple], where: object) -> None:
    assert got.keys() == want.keys(), (where, got.keys() ^ want.keys())
    different = [k for k in want if got[k] != want[k]]
    assert not different, (where, different[:6])


BAG_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, *F8]


def bag_tensors(spec: list[tuple[int, int]], many: int, seed: int) -> dict[str, torch.Tensor]:
    """Tensors of the given (dtype index, numel), and ``many`` of 16 KiB (a gathered run of
    megabytes: the room runs out midway, or a new segment copies it by torch)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, (d, n) in enumerate(spec):
        raw = torch.randint(0, 256, (n * BAG_DTYPES[d].itemsize,), dtype=torch.uint8,
                            generator=gen)
        out[f"x{i}"] = (raw % 2).bool() if BAG_DTYPES[d] == torch.bool else raw.view(
            BAG_DTYPES[d])
    for i in range(many):
        out[f"m{i}"] = torch.randn(4096, generator=gen)
    return out


ops_st = st.lists(st.one_of(
    st.tuples(st.just("train"), st.integers(0, 2 ** 60 - 1)),
    st.tuples(st.just("bag"), st.lists(st.tuples(st.integers(0, len(BAG_DTYPES) - 1),
                                                  st.sampled_from([0, 1, 5, 300, 20_000,
                                                                   70_000])), max_size=5),
              st.sampled_from([0, 0, 40, 150])),
    st.tuples(st.just("again"))), min_size=2, max_size=6)


@settings(max_examples=5, deadline=None, database=None)
@given(ops_st, st.booleans(), st.booleans(), st.integers(0, 1000))
def test_every_save_holds_its_state_bitwise_whatever_grows_or_shrinks(tmp_path_factory, ops,
                                                                      incremental, tied, seed):
    """A sequence of saves of a state that trains some parameters (the optimizer state grows),
    grows and shrinks an extra part by megabytes (the room runs out midway, the segment is
    replaced, the next save builds in the new one), saves one step twice (unchanged: nothing
    to do; changed: supersedes): each generation restores the state at its ``save()``, in
    the writer right after it and in a fresh reader at the end."""
    root = tmp_path_factory.mktemp("run")
    layers, frozen = 24, 70 if incremental else 0
    model = Model(layers, tied, frozen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    bag = Bag()
    torch.manual_seed(seed)
    want: dict[int, dict[str, tuple]] = {}
    step = 0
    with unbroken.Checkpointer(root, model=model, optimizer=opt, extras={"bag": bag},
                               async_save="process", incremental=incremental,
                               keep=unbroken.Keep(last=100)) as ckpt:
        for n, op in enumerate(ops):
            if op[0] == "train":
                step += 1
                train(model, opt, op[1])
            elif op[0] == "bag":
                bag.t = bag_tensors(op[1], op[2], seed + n)
            want[step] = state(model, opt, bag)
            assert ckpt.save(step) is None
            scramble(model, opt, bag)  # at once: the persisting process has not written yet
            ckpt.wait()
            scramble(model, opt, bag)
            assert ckpt.restore(generation=step) == step
            assert_same(state(model, opt, bag), want[step], (n, op[0]))
    for g in sorted(want, reverse=True):  # (an older one abandons the newer ones)
        assert_same(reader_state(root, g, layers, tied, frozen), want[g], g)


class Spy:
    """Counts the chunks the room gave in each save (`ProcessPersister.room` wrapped)."""

    def __init__(self, monkeypatch) -> None:
        self.given: list[int] = []
        room = ProcessPersister.room

        def counted(persister: ProcessPersister):
            give = room(persister)
            self.given.append(0)

            def counting(n: int):
                view = give(n)
                self.given[-1] += view is not None
                return view

            return counting

        monkeypatch.setattr(ProcessPersister, "room", counted)


def test_an_encode_that_fails_after_the_room_gave_leaves_the_next_saves_whole(tmp_path,
                                                                             monkeypatch):
    """The model's chunks are built in the room, then an extra part holds a value no save
    stores: a typed error, nothing handed over; the next save (one that needs a new segment,
    then one built in it again) holds its state bitwise, and so do the older ones."""
    spy = Spy(monkeypatch)
    model = Model(30)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    bag = Bag()
    bag.t = bag_tensors([(0, 300), (5, 40)], 0, 1)
    root = tmp_path / "run"
    want: dict[int, dict[str, tuple]] = {}
    with unbroken.Checkpointer(root, model=model, optimizer=opt, extras={"zbag": bag},
                               async_save="process", keep=unbroken.Keep(last=10)) as ckpt:
        for step in (1, 2):
            train(model, opt, -1)
            want[step] = state(model, opt, bag)
            ckpt.save(step)
            scramble(model, opt, bag)
            ckpt.wait()
            ckpt.restore(generation=step)
        train(model, opt, -1)
        bag.bad = True
        with pytest.raises(UnsupportedValue, match="set"):
            ckpt.save(3)
        assert spy.given[-1] > 0  # the failed encode had built the model's chunks in place
        bag.bad = False
        bag.t = bag_tensors([(0, 300), (3, 30_000), (6, 9)], 150, 2)  # megabytes more
        for step in (4, 5):  # (not 3 again: the failed save left step 3's boundary behind)
            if step == 5:
                train(model, opt, -1)
            want[step] = state(model, opt, bag)
            ckpt.save(step)
            scramble(model, opt, bag)
            ckpt.wait()
            assert (ckpt._persister.built > 0) == (step == 5)  # a new segment, then in it
            scramble(model, opt, bag)
            assert ckpt.restore(generation=step) == step
            assert_same(state(model, opt, bag), want[step], step)
    for g in sorted(want, reverse=True):
        assert_same(reader_state(root, g, 30, False, 0, "zbag"), want[g], g)


def test_a_persisting_process_killed_after_an_in_place_save_is_replaced_and_gets_the_segment(
        tmp_path, monkeypatch):
    """SIGKILL of the persisting process between saves (after one built in place), and once
    right after ``save()`` returned: the next save starts a new one, which must be handed the
    segment again, and builds in the very segment the dead one had mapped; every generation
    committed holds the state at its ``save()``."""
    model = Model(30)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    bag = Bag()
    root = tmp_path / "run"
    want: dict[int, dict[str, tuple]] = {}
    fds: list[bool] = []  # each save's message: with the segment's descriptor
    send = P._wire.send

    def recorded(sock, message, fd=None) -> None:
        if "seq" in message:
            fds.append(fd is not None)
        send(sock, message, fd)

    monkeypatch.setattr(P._wire, "send", recorded)
    with unbroken.Checkpointer(root, model=model, optimizer=opt, extras={"bag": bag},
                               async_save="process", keep=unbroken.Keep(last=10)) as ckpt:
        persister = ckpt._persister
        pids = []
        for step in range(1, 7):
            train(model, opt, -1)
            if step == 5:
                bag.t = bag_tensors([(1, 20_000)], 120, 5)  # grows: a new segment
            want[step] = state(model, opt, bag)
            ckpt.save(step)
            pids.append(persister._proc.pid)
            # a new process, or a new segment: the descriptor goes along (else it would wait
            # for one forever, and so would this loop: it is ended so that close() returns)
            if fds[-1] != (step in (1, 3, 4, 5)):
                os.kill(persister._proc.pid, signal.SIGKILL)
                pytest.fail(f"save {step}: descriptor sent {fds}")
            segment = persister._shm_id
            if step == 4:  # killed with the save in its hands: committed or not
                os.kill(persister._proc.pid, signal.SIGKILL)
            scramble(model, opt, bag)
            try:
                ckpt.wait()
            except SaveFailed:
                assert step == 4 and persister.died
                del want[step]
            assert persister.built > 0 or step in (1, 5)
            if step in (2, 3):  # killed between saves, after one built in place
                os.kill(persister._proc.pid, signal.SIGKILL)
                persister._proc.wait()
            scramble(model, opt, bag)
            if step in want:
                assert ckpt.restore(generation=step) == step
                assert_same(state(model, opt, bag), want[step], step)
            else:
                ckpt.restore(generation=step - 1)  # (the state to go on from)
            assert persister._shm_id == segment
        assert len(set(pids)) == 4  # replaced after steps 2, 3 and 4
    for g in sorted(want, reverse=True):
        assert_same(reader_state(root, g, 30, False, 0), want[g], g)


def test_two_writers_in_process_mode_side_by_side_keep_their_rooms_apart(tmp_path):
    """Two Checkpointers of one process in two run folders, their saves interleaved (each
    one's in flight while the other encodes into its room; one paced, hurried by its next
    save): each run's generations hold that run's state, bitwise."""
    models = [Model(20), Model(36, tied=True)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    bags = [Bag(), Bag()]
    bags[1].t = bag_tensors([(2, 70_000), (4, 33)], 20, 9)
    roots = [tmp_path / "a", tmp_path / "b"]
    want: list[dict[int, dict[str, tuple]]] = [{}, {}]
    ckpts = [unbroken.Checkpointer(roots[i], model=models[i], optimizer=opts[i],
                                   extras={"bag": bags[i]}, async_save="process",
                                   keep=unbroken.Keep(last=10),
                                   persist_share=0.5 if i else None) for i in (0, 1)]
    built = [[], []]
    try:
        for step in range(1, 6):
            for i in (0, 1):
                train(models[i], opts[i], -1 if step % 2 else 0x5555)
                if i == 0 and step == 3:
                    bags[0].t = bag_tensors([(0, 30_000)], 100, step)  # a's state grows
                want[i][step] = state(models[i], opts[i], bags[i])
                ckpts[i].save(step)  # (waits for this writer's own save in flight)
                built[i].append(ckpts[i]._persister.built)
                scramble(models[i], opts[i], bags[i])
    finally:
        for c in ckpts:
            c.close()
    assert all(b > 0 for b in built[0][1:2] + built[0][3:] + built[1][1:]), built
    for i, (layers, tied) in enumerate([(20, False), (36, True)]):
        for g in sorted(want[i], reverse=True):
            assert_same(reader_state(roots[i], g, layers, tied, 0), want[i][g], (i, g))
