"""Incremental generations (``incremental=True``): unchanged tensors are linked from the
previous generation, not written; every generation still verifies and restores on its own,
retention never loses shared data, corruption of shared data fails every generation that uses
it, and a resume is bitwise the uninterrupted run."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import unbroken
from unbroken.errors import CorruptCheckpoint
from unbroken.state import generation as G
from unbroken.state import parts as S
from unbroken.state.incremental import Plan
from unbroken.store.backends.local import LocalFS
from unbroken.store.generations import GenerationStore
from unbroken.store.retention import Keep

WIDTH = 384  # the frozen base: 384*384 floats, 576 KiB, twice over the stable-file minimum


def lora(frozen: bool = True) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH),
                                torch.nn.Dropout(0.1), torch.nn.Linear(WIDTH, 4))
    if frozen:
        for p in (*model[0].parameters(), *model[1].parameters()):
            p.requires_grad_(False)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                    lr=1e-2)


def train(model, opt, ckpt, start: int, stop: int) -> None:
    for step in range(start + 1, stop + 1):
        loss = model(torch.randn(8, WIDTH)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.step_done(step, loss=loss)


def files(root) -> dict[int, dict[str, os.stat_result]]:
    return {g.generation: {n: os.stat(os.path.join(g.path, n)) for n in os.listdir(g.path)}
            for g in GenerationStore(root).scan()}


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def saved(root, stop: int, **options) -> torch.nn.Module:
    """A LoRA-like run saved incrementally every 5 updates up to ``stop``."""
    model, opt = lora()
    with unbroken.Checkpointer(root, model=model, optimizer=opt, every=5, incremental=True,
                               **options) as ckpt:
        ckpt.restore()
        train(model, opt, ckpt, 0, stop)
    return model


def restored(root, step: int) -> dict[str, torch.Tensor]:
    """The weights a fresh process restores from ``root`` (at generation ``step``)."""
    model, opt = lora()
    with unbroken.Checkpointer(root, model=model, optimizer=opt) as ckpt:
        assert ckpt.restore() == step
    return weights(model)


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_frozen_base_is_written_once_and_linked_after(tmp_path):
    saved(tmp_path, 15)
    gens = files(tmp_path)
    assert sorted(gens) == [5, 10, 15]
    base = gens[5]["model.g5.safetensors"]
    assert base.st_size > 2 * WIDTH * WIDTH * 4  # both frozen layers
    for n in (10, 15):  # the same file, linked: nothing of the base written again
        assert os.path.samefile(tmp_path / f"gen-{n:09d}" / "model.g5.safetensors",
                                tmp_path / "gen-000000005" / "model.g5.safetensors")
        written = sum(s.st_size for name, s in gens[n].items() if s.st_nlink == 1)
        assert written < base.st_size / 10
    for g in GenerationStore(tmp_path).scan():  # each generation verifies on its own
        GenerationStore(tmp_path).verify(g)


def test_resume_is_bitwise_and_links_again_after_restore(tmp_path):
    model, opt = lora()
    with unbroken.Checkpointer(tmp_path / "ref", model=model, optimizer=opt) as ckpt:
        train(model, opt, ckpt, 0, 14)
    reference = weights(model)

    model, opt = lora()
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt, every=5,
                               incremental=True) as ckpt:
        ckpt.restore()
        train(model, opt, ckpt, 0, 7)  # dies after update 7; generation 5 holds the base
    model, opt = lora()
    with unbroken.Checkpointer(tmp_path / "run", model=model, optimizer=opt, every=5,
                               incremental=True) as ckpt:
        assert ckpt.restore() == 5
        torch.manual_seed(1234)  # the RNG is restored by restore(), whatever happens here
        ckpt.restore()
        train(model, opt, ckpt, 5, 14)
    assert all(torch.equal(reference[k], v) for k, v in model.state_dict().items())
    assert os.path.samefile(tmp_path / "run/gen-000000010/model.g5.safetensors",
                            tmp_path / "run/gen-000000005/model.g5.safetensors")


def test_retention_deleting_the_origin_keeps_the_shared_data(tmp_path):
    model, opt = lora()
    with unbroken.Checkpointer(tmp_path, model=model, optimizer=opt, every=5,
                               keep=Keep(last=2), incremental=True) as ckpt:
        ckpt.restore()
        train(model, opt, ckpt, 0, 25)
    final = weights(model)
    assert sorted(files(tmp_path)) == [20, 25]
    assert (tmp_path / "gen-000000025/model.g5.safetensors").stat().st_nlink == 2
    assert equal(restored(tmp_path, 25), final)


def test_unchanged_tensors_found_by_content_go_stable_then_linked(tmp_path):
    model, opt = lora(frozen=False)
    for p in (*model[0].parameters(), *model[1].parameters()):
        p.register_hook(lambda g: torch.zeros_like(g))  # trainable, but never moves
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)  # no decay: zero grad, no change
    with unbroken.Checkpointer(tmp_path, model=model, optimizer=opt, every=5,
                               incremental=True) as ckpt:
        ckpt.restore()
        train(model, opt, ckpt, 0, 15)
    gens = files(tmp_path)
    assert not any(".g" in n for n in gens[5])  # nothing known yet: one file per part
    assert "model.g10.safetensors" in gens[10]  # unchanged since 5: set apart, written once
    assert os.path.samefile(tmp_path / "gen-000000015/model.g10.safetensors",
                            tmp_path / "gen-000000010/model.g10.safetensors")


def test_a_changed_stable_tensor_is_written_again(tmp_path):
    model, opt = lora()
    with unbroken.Checkpointer(tmp_path, model=model, optimizer=opt, every=5,
                               incremental=True) as ckpt:
        ckpt.restore()
        train(model, opt, ckpt, 0, 5)
        with torch.no_grad():
            model[0].weight[0, 0] += 1  # the frozen base edited by hand
        train(model, opt, ckpt, 5, 10)
        final = weights(model)
    gens = files(tmp_path)
    assert "model.g5.safetensors" not in gens[10]
    assert equal(restored(tmp_path, 10), final)


def test_without_links_the_stable_file_is_written_again_byte_for_byte(tmp_path, monkeypatch):
    def no_links(self, src, dst):
        raise OSError(errno.EXDEV, "cross-device link", dst)

    monkeypatch.setattr(LocalFS, "link", no_links)
    saved(tmp_path, 10)
    gens = {g.generation: g.manifest for g in GenerationStore(tmp_path).scan()}
    a, b = (gens[n].artifact("model.g5.safetensors") for n in (5, 10))
    assert a == b  # same name, size and hash: the same file, written twice
    assert not os.path.samefile(tmp_path / "gen-000000010/model.g5.safetensors",
                                tmp_path / "gen-000000005/model.g5.safetensors")


def test_corrupt_shared_data_fails_every_generation_that_uses_it(tmp_path):
    model = saved(tmp_path, 15)
    shared = tmp_path / "gen-000000010/model.g5.safetensors"
    with open(shared, "r+b") as f:  # one flipped byte in the data of the shared inode
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    store = GenerationStore(tmp_path)
    for g in store.scan():
        with pytest.raises(CorruptCheckpoint, match="model.g5.safetensors"):
            store.verify(g)
    model, opt = lora()
    ckpt = unbroken.Checkpointer(tmp_path, model=model, optimizer=opt)
    with pytest.raises(CorruptCheckpoint, match="no generation verifies") as e:
        ckpt.restore()
    ckpt.close()
    for n in (5, 10, 15):
        assert f"gen-{n:09d}/model.g5.safetensors: content hash" in str(e.value)


def test_a_corrupt_own_file_falls_back_to_the_previous_generation(tmp_path):
    model, opt = lora()
    with unbroken.Checkpointer(tmp_path, model=model, optimizer=opt, every=5,
                               incremental=True) as ckpt:
        ckpt.restore()
        train(model, opt, ckpt, 0, 10)
        at_10 = weights(model)
        train(model, opt, ckpt, 10, 15)
    with open(tmp_path / "gen-000000015/model.safetensors", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\xff")
    model, opt = lora()
    with unbroken.Checkpointer(tmp_path, model=model, optimizer=opt, every=5,
                               incremental=True) as ckpt:
        assert ckpt.restore() == 10
        assert all(torch.equal(at_10[k], v) for k, v in model.state_dict().items())
        train(model, opt, ckpt, 10, 15)  # saves again, linking the base it verified
    assert os.path.samefile(tmp_path / "gen-000000015/model.g5.safetensors",
                            tmp_path / "gen-000000005/model.g5.safetensors")


@pytest.mark.parametrize("mode", [True, "process"])
def test_async_incremental_and_warm_start_read_the_stable_files(tmp_path, mode):
    model, opt = lora()
    with unbroken.Checkpointer(tmp_path / "a", model=model, optimizer=opt, every=5,
                               incremental=True, async_save=mode) as ckpt:
        ckpt.restore()
        train(model, opt, ckpt, 0, 10)
        final = weights(model)
    assert os.path.samefile(tmp_path / "a/gen-000000010/model.g5.safetensors",
                            tmp_path / "a/gen-000000005/model.g5.safetensors")
    model, opt = lora()
    with unbroken.Checkpointer(tmp_path / "b", model=model, optimizer=opt) as ckpt:
        assert ckpt.restore("warm_start", source=tmp_path / "a") == 0
    assert all(torch.equal(final[k], v) for k, v in model.state_dict().items())


# -- hostile state.json entries naming a part's files -------------------------------------------

def _generation(tmp_path):
    model, opt = lora()
    tree = {S.MODEL: model.state_dict()}
    meta = {"unbroken.run_id": "r", "unbroken.generation": "7", "unbroken.incarnation": "0"}
    encoded = G.encode_generation(tree, meta, plan=Plan(7, frozen=frozenset(
        n for n, p in model.named_parameters() if not p.requires_grad)))
    return {n: b"".join(bytes(c) for c in chunks) for n, chunks in encoded.items()}


def test_the_encoded_files_decode_to_the_same_tree(tmp_path):
    got, _ = G.decode_generation(_generation(tmp_path), "gen")
    model, _ = lora()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in got[S.MODEL].items())


@settings(max_examples=60, deadline=None)
@given(entry=st.one_of(
    st.fixed_dictionaries({"file": st.just("model.g7.safetensors"),
                           "generation": st.sampled_from(["8", "x", "-1", "٧", "", "1e3"]),
                           "incarnation": st.just("0")}),
    st.fixed_dictionaries({"file": st.just("model.g7.safetensors"), "generation": st.just("7"),
                           "incarnation": st.sampled_from(["1", "a", ""])}),
    st.fixed_dictionaries({"file": st.sampled_from(["model.safetensors", "missing",
                                                    "state.json"]),
                           "generation": st.just("7"), "incarnation": st.just("0")}),
    st.one_of(st.none(), st.integers(), st.text(max_size=5), st.lists(st.integers(),
                                                                      max_size=2))))
def test_hostile_file_entries_are_refused(tmp_path_factory, entry):
    found = _generation(tmp_path_factory.mktemp("g"))
    doc = json.loads(found[S.STATE_FILE])
    doc[S.MORE_FILES][S.MODEL] = [entry]
    found[S.STATE_FILE] = json.dumps(doc).encode()
    with pytest.raises(CorruptCheckpoint):
        G.decode_generation(found, "gen")


def test_saving_the_same_step_again_is_still_a_no_op(tmp_path):
    model, opt = lora()
    with unbroken.Checkpointer(tmp_path, model=model, optimizer=opt, every=5,
                               incremental=True) as ckpt:
        ckpt.restore()
        train(model, opt, ckpt, 0, 10)
        before = files(tmp_path)[10]["MANIFEST.json"].st_ino
        assert ckpt.save() is None  # nothing changed since generation 10
        assert files(tmp_path)[10]["MANIFEST.json"].st_ino == before


def test_the_same_step_saved_again_after_a_change_supersedes_and_restores(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(768, 768), torch.nn.Linear(768, 768))
    model[0].requires_grad_(False)  # 2.25 MiB frozen, 2.25 MiB trainable
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    with unbroken.Checkpointer(tmp_path, model=model, optimizer=opt,
                               incremental=True) as ckpt:
        ckpt.restore()
        ckpt.step_done(1)
        assert ckpt.save() is not None
        assert ckpt.save() is None  # nothing changed
        opt.param_groups[0]["lr"] = 0.05  # the state changed, no tensor did
        assert ckpt.save() is not None  # supersedes generation 1
    names = set(os.listdir(tmp_path / "gen-000000001"))
    assert {"model.g1.safetensors", "model.g1.1.safetensors"} <= names  # both stable files
    final = weights(model)
    model2 = torch.nn.Sequential(torch.nn.Linear(768, 768), torch.nn.Linear(768, 768))
    model2[0].requires_grad_(False)
    opt2 = torch.optim.SGD(model2[1].parameters(), lr=0.1)
    with unbroken.Checkpointer(tmp_path, model=model2, optimizer=opt2) as ckpt:
        assert ckpt.restore() == 1
    assert opt2.param_groups[0]["lr"] == 0.05
    assert all(torch.equal(final[k], v) for k, v in model2.state_dict().items())


def test_files_of_an_adopted_run_are_written_again_not_linked(tmp_path):
    model, opt = lora()
    with unbroken.Checkpointer(tmp_path / "a", model=model, optimizer=opt, every=5,
                               incremental=True) as ckpt:
        ckpt.restore()
        train(model, opt, ckpt, 0, 5)
    model, opt = lora()
    with unbroken.Checkpointer(tmp_path / "b", model=model, optimizer=opt) as ckpt:
        ckpt.restore()
        train(model, opt, ckpt, 0, 1)
        ckpt.save()
    shutil.copytree(tmp_path / "a/gen-000000005", tmp_path / "b/gen-000000005")
    model, opt = lora()
    with unbroken.Checkpointer(tmp_path / "b", model=model, optimizer=opt, every=5,
                               incremental=True) as ckpt:
        assert ckpt.restore(adopt=True) == 5
        train(model, opt, ckpt, 5, 10)
        final = weights(model)
    assert not os.path.samefile(tmp_path / "b/gen-000000010/model.g10.safetensors",
                                tmp_path / "b/gen-000000005/model.g5.safetensors")
    model, opt = lora()
    with unbroken.Checkpointer(tmp_path / "b", model=model, optimizer=opt) as ckpt:
        assert ckpt.restore() == 10
    assert all(torch.equal(final[k], v) for k, v in model.state_dict().items())


def test_a_file_written_anew_for_a_link_must_hash_as_its_source(tmp_path, monkeypatch):
    from unbroken.errors import SaveFailed
    from unbroken.state.incremental import Linked

    monkeypatch.setattr(LocalFS, "link", lambda self, src, dst: (_ for _ in ()).throw(
        OSError(errno.EXDEV, "cross-device link")))
    store = GenerationStore(tmp_path)
    store.lock()
    staging = store.stage(1)
    with pytest.raises(SaveFailed, match="written anew"):
        store.write_artifacts(staging, {"model.g1.safetensors": Linked(
            str(tmp_path / "elsewhere"), 3, "0" * 32, lambda: [b"abc"])}, 1)
    store.unlock()


def test_digests_naming_other_tensors_than_the_file_holds_are_refused(tmp_path):
    found = _generation(tmp_path)
    name = "model.g7.safetensors"
    header_len = int.from_bytes(found[name][:8], "little")
    header = json.loads(found[name][8:8 + header_len])
    digests = json.loads(header["__metadata__"]["unbroken.digests"])
    digests["0.weight.extra"] = "0" * 32
    header["__metadata__"]["unbroken.digests"] = json.dumps(digests)
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 64)
    found[name] = len(raw).to_bytes(8, "little") + raw + found[name][8 + header_len:]
    with pytest.raises(CorruptCheckpoint, match="other tensors than the file holds"):
        G.decode_generation(found, "gen")
