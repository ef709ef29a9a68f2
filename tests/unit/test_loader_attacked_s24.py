"""Defects an outside tester found in the data loader (session 24):

* an IterableDataset's ``window_size`` was wrong on the early micro-batches of an epoch's last
  short window (the loader looked one batch ahead only), so ``loss / loader.window_size``
  weighted that update's micro-batches unequally;
* a map-style dataset not wrapped in ``seeded()`` drew different augmentation in DataLoader
  workers after a resume, silently;
* ``seeded()``'s plain-int path needs ``set_epoch``, which the README did not make plain.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data

from unbroken.data import ResumableLoader, ResumableSampler, seeded
from unbroken.errors import UnbrokenWarning, UpdateBoundaryError

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

README = Path(__file__).parents[2] / "README.md"


class Stream(torch.utils.data.IterableDataset):
    """Items ``0..n-1`` in order from ``consumed`` on; counts the items it yielded (with no
    workers, what the loader pulled)."""

    splits_by_worker = True

    def __init__(self, n: int) -> None:
        self.n = n
        self.state: dict[str, Any] = {"epoch": 0, "consumed": 0}
        self.pulled = 0

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = dict(state)

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        start, size = self.state["consumed"], self.state.get("batch_size", 1)
        for i in range(start, self.n):
            if info is None or (i - start) // size % info.num_workers == info.id:
                self.pulled += 1
                yield {"id": i, "x": torch.tensor([float(self.state["epoch"] * 1000 + i)])}


def observed(loader: ResumableLoader, batches: int | None = None) -> list[Any]:
    """Per micro-batch of one pass: ids, window_size, at_boundary and the cursor after it."""
    out = []
    for batch in loader:
        out.append((batch["id"].tolist(), loader.window_size, loader.at_boundary,
                    loader.epoch, loader.consumed))
        if len(out) == batches:
            break
    return out


def map_loader(n: int, batch: int, accumulation: int) -> ResumableLoader:
    items = [{"id": i, "x": torch.tensor([float(i)])} for i in range(n)]
    return ResumableLoader(items, ResumableSampler(n, batch, shuffle=False),
                           accumulation=accumulation)


# -- 1. an iterable pass knows each window's size before its first micro-batch -------------


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(("n", "batch", "accumulation"), [
    (10, 2, 3),   # 5 batches: windows 3 + 2 (the tester's case)
    (11, 2, 4),   # 6 batches, the last one short: windows 4 + 2
    (13, 2, 5),   # 7 batches: 5 + 2
    (12, 2, 3),   # 6 batches: the stream ends with a full window
    (3, 2, 4),    # 2 batches: the only window is short
    (8, 2, 1),    # no accumulation
])
def test_iterable_window_size_and_boundaries_match_the_map_style_path(
        workers: int, n: int, batch: int, accumulation: int) -> None:
    expected = observed(map_loader(n, batch, accumulation))
    loader = ResumableLoader(Stream(n), batch_size=batch, accumulation=accumulation,
                             num_workers=workers)
    assert observed(loader) == expected
    assert (loader.epoch, loader.consumed) == (1, 0)
    last = -(-n // batch) % accumulation or accumulation  # the epoch's last window
    assert [size for _, size, *_ in expected[-last:]] == [last] * last


def test_the_short_last_window_scales_its_micro_batches_to_a_mean() -> None:
    # The README idiom: sum of loss / window_size over a window is the window's mean loss.
    loader = ResumableLoader(Stream(10), batch_size=2, accumulation=3)
    window, means = [], []
    for b in loader:
        window.append(float(b["x"].sum()) / loader.window_size)
        if loader.at_boundary:
            means.append(sum(window))
            window = []
    assert means == [sum(range(6)) / 3, sum(range(6, 10)) / 2]


@pytest.mark.parametrize("accumulation", [1, 2, 3, 4])
def test_the_look_ahead_holds_at_most_one_window(accumulation: int) -> None:
    ds = Stream(23)  # 12 batches of 2 (the last of 1); no workers: ds.pulled is what was read
    loader = ResumableLoader(ds, batch_size=2, accumulation=accumulation)
    handed = 0
    for _ in loader:
        handed += 1
        held = -(-ds.pulled // 2) - handed  # batches read, not yet handed out
        assert held <= max(accumulation, 2) - 1, (handed, held)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop", [1, 2, 3, 4])  # micro-batches into the run before the kill
def test_a_kill_inside_a_window_resumes_at_its_first_micro_batch(workers: int, stop: int) -> None:
    # 10 items in batches of 2, accumulation 3: windows [0, 1, 2] and [3, 4]; the kill comes
    # after `stop` micro-batches, so inside the first window or inside the short last one.
    reference = observed(ResumableLoader(Stream(10), batch_size=2, accumulation=3))
    first = ResumableLoader(Stream(10), batch_size=2, accumulation=3, num_workers=workers)
    head = observed(first, stop)
    assert head == reference[:stop]
    if not first.at_boundary:
        with pytest.raises(UpdateBoundaryError, match=r"\d of \d micro-batches"):
            first.state_dict()
    done = 3 if stop >= 3 else 0  # micro-batches of completed updates
    assert first.consumed == done * 2
    first.stop_workers()
    resumed = ResumableLoader(Stream(10), batch_size=2, accumulation=3, num_workers=workers)
    resumed.load_state_dict(_boundary_state(done))
    assert observed(resumed) == reference[done:]


def _boundary_state(done: int) -> dict[str, Any]:
    """The state a Checkpointer saved at the last boundary before the kill."""
    loader = ResumableLoader(Stream(10), batch_size=2, accumulation=3)
    if done:
        observed(loader, done)
    return loader.state_dict()


# -- 2. workers' draws survive a resume only under seeded(): say so ------------------------


class Augmented(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return int(i), torch.rand(())  # a random crop offset, say


def test_an_unseeded_dataset_in_workers_is_warned_about_naming_it_and_the_remedy() -> None:
    with pytest.warns(UnbrokenWarning, match=r"Augmented is not wrapped in unbroken\.seeded"
                                             r"\(\).*2 DataLoader workers.*after a resume") as ws:
        ResumableLoader(Augmented(), ResumableSampler(16, 4, seed=0), num_workers=2)
    assert [Path(w.filename).name for w in ws] == [Path(__file__).name]  # the caller's line


def test_a_seeded_dataset_no_workers_or_an_iterable_one_is_not_warned_about() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnbrokenWarning)
        ResumableLoader(seeded(Augmented()), ResumableSampler(16, 4, seed=0), num_workers=2)
        ResumableLoader(Augmented(), ResumableSampler(16, 4, seed=0), num_workers=0)
        # seeded() refuses iterables: they key their draws by their own state (contract)
        ResumableLoader(Stream(16), batch_size=4, num_workers=2)


@pytest.mark.parametrize("wrap", [False, True])
def test_only_a_seeded_dataset_draws_the_same_augmentation_after_a_resume_in_workers(
        wrap: bool) -> None:
    # Why the warning: the same resume, unwrapped and wrapped.
    def make() -> ResumableLoader:
        ds = seeded(Augmented(), seed=5) if wrap else Augmented()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnbrokenWarning)
            return ResumableLoader(ds, ResumableSampler(16, 4, seed=0), num_workers=2)

    full = [b[1] for b in make()]
    first = make()
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    first.stop_workers()
    resumed = make()
    resumed.load_state_dict(state)
    same = all(torch.equal(a, b[1]) for a, b in zip(full[2:], resumed))
    assert same is wrap


# -- 3. seeded() and the epoch ---------------------------------------------------------------


def test_under_the_loader_each_epoch_draws_new_augmentation_without_set_epoch() -> None:
    loader = ResumableLoader(seeded(Augmented(), seed=5),
                             ResumableSampler(16, 4, seed=0, shuffle=False))
    epoch0 = [b[1] for b in loader]
    epoch1 = [b[1] for b in loader]
    assert not any(torch.equal(a, b) for a, b in zip(epoch0, epoch1))


def test_outside_the_loader_plain_indices_need_set_epoch() -> None:
    ds = seeded(Augmented(), seed=5)
    before = ds[3][1]
    assert torch.equal(ds[3][1], before)  # (seed, epoch 0, 3) again: the documented trap
    ds.set_epoch(1)
    assert not torch.equal(ds[3][1], before)


def test_the_readme_states_both_seeded_rules_plainly() -> None:
    text = " ".join(README.read_text().split())
    assert re.search(r"\*\*Random draws inside DataLoader workers come back the same after a "
                     r"resume only for a dataset wrapped in `seeded\(\)`\*\*", text)
    assert "bit for bit, whatever the number of DataLoader workers before and after (random " \
           "draws inside workers, such as augmentation, only for a dataset wrapped in " \
           "`seeded()`" in text
    assert re.search(r"call `ds\.set_epoch\(e\)` every epoch, or every epoch draws the same "
                     r"augmentation\.\*\*", text)
