"""Review: every RNG stream and every extra continue bit for bit across a resume.

README's promise: "an interrupted training run continues exactly as if it had never stopped
... every RNG stream (Python, NumPy, torch CPU, each initialized CUDA device, any generator you
register) and your own extras", bitwise on CPU, refusing by name what it cannot restore.

The end-to-end cases run in two subprocesses (`_review_rng_scripts/rng_cases.py`): one makes,
per case, the uninterrupted run of N updates and an interrupted run that saves at update K
and stops; a fresh process then restores each case (its global streams scrambled first, so a
stream restore() does not set cannot match by accident) and runs on to N. The losses of every
micro-batch, the final parameters and Adam moments, and the next draw of every stream must
equal the uninterrupted run's exactly. The rest are small in-process checks of what extras
can hold and of typed refusals.

Not repeated here (covered elsewhere): dropout, augmentation, workers and accumulation after a
SIGKILL (integration/test_resume_matrix.py), batch size / accumulation / drop_last changes and
iterable datasets (test_review_data_position.py), capture and validation of registered
generators at the unit level (test_rng.py), codec round trips (test_codec.py).
"""

from __future__ import annotations

import json
import math
import random
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import unbroken

SCRIPT = Path(__file__).parent / "_review_rng_scripts" / "rng_cases.py"
CASES = ("all_global_streams_workers", "registered_generators", "rng_objects_in_extras",
         "numpy_generator_spawn", "extra_grows_in_place", "model_load_hook_draws_rng")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> tuple[dict, dict]:
    root = tmp_path_factory.mktemp("rng-cases")
    out = {}
    for mode in ("reference", "resume"):  # the resume in a process of its own
        path = root / f"{mode}.json"
        r = subprocess.run([sys.executable, str(SCRIPT), mode, str(root), str(path), *CASES],
                           capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr[-3000:]
        out[mode] = json.loads(path.read_text())
    return out["reference"], out["resume"]


def check_resume(outcomes: tuple[dict, dict], case: str) -> None:
    ref, res = outcomes[0][case], outcomes[1][case]
    assert "error" not in ref, f"the uninterrupted run itself failed: {ref['error']['trace']}"
    if "error" in res:
        e = res["error"]
        pytest.fail(f"the resumed run raised {e['type']} (UnbrokenError: "
                    f"{'UnbrokenError' in e['mro']}) where the uninterrupted run went on:\n"
                    f"{e['trace']}")
    full, saved, resumed = ref["full"], ref["saved"], res["resumed"]
    assert saved["losses"] == {k: full["losses"][k] for k in saved["losses"]}, \
        "the run that saved differs from the uninterrupted one before the save"
    stitched = {**saved["losses"], **resumed["losses"]}
    bad = [int(k) for k in full["losses"] if stitched.get(k) != full["losses"][k]]
    differs = [name for name in ("params", "moments", "draws") if resumed[name] != full[name]]
    assert not bad and not differs, (
        f"resumed at update {len(saved['losses'])}: first differing update "
        f"{min(bad) if bad else None} (of {sorted(bad)}); final {differs} differ")


# -- end to end, fresh process ---------------------------------------------------------------


def test_every_global_stream_with_persistent_workers_and_accumulation_resumes_bitwise(
        outcomes) -> None:
    """Dropout, torch.randperm, python and NumPy draws in the loop, seeded augmentation
    drawing from all three global streams in 2 persistent workers, accumulation 2, and a
    torch.cuda seeding call on a CUDA-free host: bitwise after a fresh-process resume."""
    check_resume(outcomes, "all_global_streams_workers")


def test_registered_torch_and_numpy_generators_resume_bitwise(outcomes) -> None:
    """A torch.Generator used by torch.bernoulli and NumPy Generators on MT19937 and Philox,
    registered in generators=, continue exactly (losses, weights, their next draws)."""
    check_resume(outcomes, "registered_generators")


def test_random_Random_and_RandomState_held_as_extras_resume_bitwise(outcomes) -> None:
    """The documented route for RNG objects generators= does not take (random.Random and
    np.random.RandomState, gaussian caches included): an extra with getstate/setstate."""
    check_resume(outcomes, "rng_objects_in_extras")


def test_a_registered_numpy_generator_spawns_the_same_children_after_resume(outcomes) -> None:
    """DEFECT. Promise: every registered generator's stream continues exactly. A registered
    numpy.random.Generator that spawns a child stream per update (Generator.spawn, NumPy's
    idiom for independent streams) gives other children after the resume: only
    bit_generator.state is saved, not its SeedSequence's n_children_spawned, so the resumed
    run's first spawn repeats the uninterrupted run's first one. Losses differ from update
    K+1 on, silently (restore accepted it)."""
    check_resume(outcomes, "numpy_generator_spawn")


def test_an_extra_that_grows_its_state_in_place_keeps_running_after_resume(outcomes) -> None:
    """DEFECT. Promise: an extra continues as if the run had never stopped. An extra whose
    history tensor grows with Tensor.resize_ (and NumPy array with ndarray.resize) works in
    the uninterrupted run; after restore it gets tensors whose storage is a slice of the
    generation's file buffer (torch.frombuffer: not resizable) and arrays that do not own
    their data, so the resumed run dies at update K+1 with RuntimeError "Trying to resize
    storage that is not resizable" (NumPy: ValueError "cannot resize this array: it does
    not own its data")."""
    check_resume(outcomes, "extra_grows_in_place")


def test_a_model_load_hook_that_draws_random_numbers_does_not_shift_the_restored_streams(
        outcomes) -> None:
    """DEFECT. Promise: after restore() every RNG stream is where it was at the save. The
    restore sets the RNG part before it loads the model and the optimizer (applying.apply), so
    a model whose load_state_dict post-hook draws (here a smoke test on torch.randn input)
    leaves the torch stream moved past the saved state when restore() returns: dropout
    differs from update K+1 on. Setting the RNG streams after the model and optimizer
    makes this case bitwise (checked with a patched applying.apply, outside this suite)."""
    check_resume(outcomes, "model_load_hook_draws_rng")


# -- extras in one process --------------------------------------------------------------------


class Holder:
    """An extra holding whatever state it is given, and keeping what it is loaded with."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def round_trip(tmp_path: Path, state: dict) -> dict:
    folder = str(tmp_path / "run")
    model = torch.nn.Linear(1, 1)
    with unbroken.Checkpointer(folder, model=model, extras={"x": Holder(state)}) as ckpt:
        ckpt.restore()
        ckpt.save(0)
    back = Holder({})
    with unbroken.Checkpointer(folder, model=model, extras={"x": back}) as ckpt:
        assert ckpt.restore() == 0
    return back.state


def test_restoring_an_earlier_generation_with_a_non_leaf_tensor_in_an_extra(tmp_path) -> None:
    """DEFECT. Promise: a restore raises only typed errors (UnbrokenError) and changes nothing
    when it refuses. An extra whose state holds a tensor still attached to the graph (a
    running loss average updated without .detach(), a common slip) saves fine (the encoder
    detaches it) and restores fine in a fresh process, but restore(generation=N) in the same
    process (rolling back after a loss spike) raises torch's RuntimeError "Only Tensors
    created explicitly by the user (graph leaves) support the deepcopy protocol": applying.apply
    backs up every small part with copy.deepcopy(part.state_dict()) before loading."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Holder({"avg": torch.zeros(())})
    saved = {}
    with unbroken.Checkpointer(str(tmp_path / "run"), model=model, optimizer=opt,
                               extras={"guard": guard}) as ckpt:
        ckpt.restore()
        for step in (1, 2, 3):
            loss = model(torch.ones(1, 2)).pow(2).sum()
            guard.state = {"avg": 0.9 * guard.state["avg"] + 0.1 * loss}  # not detached
            loss.backward()
            opt.step()
            opt.zero_grad()
            ckpt.step_done(step)
            ckpt.save()
            saved[step] = guard.state["avg"].detach().clone()
        try:
            assert ckpt.restore(generation=2) == 2
        except unbroken.UnbrokenError:
            return  # a typed refusal keeps the promise
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"restore(generation=2) raised {type(e).__name__}, not an "
                        f"UnbrokenError: {e}")
    assert torch.equal(guard.state["avg"], saved[2])


def test_a_masked_array_in_an_extra_is_restored_with_its_mask_or_refused(tmp_path) -> None:
    """DEFECT (silent acceptance). Promise: what save writes, restore reads; a value the
    format cannot store is refused, naming the part. A numpy.ma.MaskedArray in an extra (a
    metric history with invalid entries masked) is saved as its raw data only: it comes back
    a plain ndarray with the masked entries unmasked (sum 4.0 becomes 6.0), no warning."""
    masked = np.ma.masked_array([1.0, 2.0, 3.0], mask=[False, True, False])
    try:
        back = round_trip(tmp_path, {"history": masked})["history"]
    except unbroken.UnsupportedValue:
        return  # refused up front: the promise holds
    assert isinstance(back, np.ma.MaskedArray), f"restored as {type(back).__name__}"
    assert back.mask.tolist() == [False, True, False] and back.sum() == masked.sum()


def test_a_negative_nan_in_an_extra_keeps_its_sign_bit(tmp_path) -> None:
    """DEFECT (minor). Promise: bit for bit; the codec "keeps Python types exactly (... NaN/
    inf ...)". A Python float NaN is written as repr() text "nan", so its sign (and payload)
    is lost: the NaN x86 produces for a diverged loss (0/0, inf-inf: loss.item() of such a
    loss) has the sign bit set, and an extra keeping it (a loss-spike guard's last loss)
    gets +NaN back: other bits wherever it flows (torch.tensor(x), struct, copysign)."""
    loss = torch.nn.functional.mse_loss(torch.tensor([math.inf]), torch.tensor([math.inf]))
    last = loss.item()
    assert math.isnan(last) and math.copysign(1.0, last) == -1.0  # what x86 produces
    back = round_trip(tmp_path, {"last_loss": last, "as_numpy": np.float64(last)})
    assert struct.pack("<d", back["as_numpy"]) == struct.pack("<d", last)  # kept
    assert struct.pack("<d", back["last_loss"]) == struct.pack("<d", last), \
        f"saved bits {struct.pack('<d', last).hex()}, restored " \
        f"{struct.pack('<d', back['last_loss']).hex()}"


def test_extra_state_of_many_kinds_comes_back_with_its_exact_types(tmp_path) -> None:
    """NumPy scalars and 0-d arrays, bytes, tuples, keys of every storable type in their
    order, nested OrderedDicts, inf, -0.0, ints past 2**1024, tied tensors and a
    non-contiguous tensor: equal values and types after a restore."""
    t = torch.arange(6.0).reshape(2, 3)
    state = {
        "z": 1, "a": (np.float32(1.5), np.int64(-3), np.bool_(True), np.array(2.0), b"\x00ab"),
        "keys": {(1, "a"): 1, None: 2, b"k": 3, 2.5: 4, 7: 5, "7": 6, True: 7},
        "od": __import__("collections").OrderedDict([("b", {3: "x", 1: "y"}), ("a", [])]),
        "num": [math.inf, -math.inf, -0.0, 1 << 5000, -(1 << 1100)],
        "t": t, "same": t, "tr": t.t(),
    }
    back = round_trip(tmp_path, state)
    assert list(back) == list(state) and list(back["keys"]) == list(state["keys"])
    assert [type(v) for v in back["a"]] == [type(v) for v in state["a"]]
    assert [type(k) for k in back["keys"]] == [type(k) for k in state["keys"]]
    assert back["keys"] == state["keys"] and back["od"] == state["od"]
    assert type(back["od"]) is type(state["od"])
    assert back["num"][:2] == state["num"][:2] and back["num"][3:] == state["num"][3:]
    assert math.copysign(1.0, back["num"][2]) == -1.0
    assert back["t"] is back["same"] and torch.equal(back["tr"], t.t())


# -- typed refusals ---------------------------------------------------------------------------


def _ckpt(folder: str, extras: dict, generators: dict) -> unbroken.Checkpointer:
    torch.manual_seed(0)
    return unbroken.Checkpointer(folder, model=torch.nn.Linear(1, 1), extras=extras,
                                 generators=generators)


class Strict(Holder):
    def load_state_dict(self, state: dict) -> None:  # expects another structure than saved
        self.state = {"v": state["renamed"]}


@pytest.mark.parametrize("change, error", [
    ("extra added", unbroken.MissingState),
    ("extra removed", unbroken.StateMismatch),
    ("extra structure changed", unbroken.StateMismatch),
    ("generator added", unbroken.MissingState),
    ("generator removed", unbroken.StateMismatch),
    ("generator kind changed", unbroken.StateMismatch),
])
def test_extras_or_generators_changed_at_resume_are_refused_typed_before_any_change(
        tmp_path, change, error) -> None:
    """A continuation with extras or generators added, removed, or loading another
    structure is refused with a typed error, and no live stream or extra has changed."""
    folder = str(tmp_path / "run")
    with _ckpt(folder, {"a": Holder({"v": 1})}, {"g": torch.Generator().manual_seed(1)}) as c:
        c.restore()
        c.save(0)
    extras: dict = {"a": Holder({"v": 9})}
    gens: dict = {"g": torch.Generator().manual_seed(2)}
    if change == "extra added":
        extras["b"] = Holder({"v": 9})
    elif change == "extra removed":
        extras = {}
    elif change == "extra structure changed":
        extras = {"a": Strict({"v": 9})}
    elif change == "generator added":
        gens["h"] = torch.Generator()
    elif change == "generator removed":
        gens = {}
    else:
        gens = {"g": np.random.default_rng(2)}
    random.seed(5)
    before = (random.getstate(), torch.get_rng_state(), [g.get_state() if isinstance(
        g, torch.Generator) else g.bit_generator.state for g in gens.values()])
    with _ckpt(folder, extras, gens) as c:
        with pytest.raises(error):
            c.restore()
    after = (random.getstate(), torch.get_rng_state(), [g.get_state() if isinstance(
        g, torch.Generator) else g.bit_generator.state for g in gens.values()])
    assert before[0] == after[0] and torch.equal(before[1], after[1])
    assert all((torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y)
               for x, y in zip(before[2], after[2], strict=True))
    assert all(e.state == {"v": 9} for e in extras.values())


@pytest.mark.parametrize("rng", [np.random.RandomState(0), random.Random(0)],
                         ids=["RandomState", "random.Random"])
def test_an_rng_object_generators_cannot_take_is_refused_when_built_not_ignored(
        tmp_path, rng) -> None:
    """Limit, documented: generators= takes torch.Generator and numpy.random.Generator only.
    Anything else is refused when the Checkpointer is built (a TypeError naming it, as for
    other wrong argument types), never saved partially; wrap it in an extra instead (see
    test_random_Random_and_RandomState_held_as_extras_resume_bitwise)."""
    with pytest.raises(TypeError, match="register only torch.Generator or numpy"):
        _ckpt(str(tmp_path / "run"), {}, {"r": rng})
    assert not any((tmp_path / "run").glob("gen-*"))
