"""Retention policy validation and the pure selection of generations to keep."""

from __future__ import annotations

import random

import pytest

from unbroken.store.retention import Keep, select_kept

NAN, INF = float("nan"), float("inf")


def gens(n: int, every_step: int = 100, metrics=None):
    """Generations 1..n at steps 100, 200, ...; ``metrics`` maps generation -> metrics dict."""
    metrics = metrics or {}
    return [(g, g * every_step, metrics.get(g, {})) for g in range(1, n + 1)]


# ---------------------------------------------------------------------------------------------
# Keep validation


def test_defaults_and_to_json():
    k = Keep()
    assert (k.last, k.every, k.best) == (3, None, None)
    assert k.to_json() == {"last": 3, "every": None, "best": None, "aside": 2}
    k = Keep(last=2, every=1000, best=("val_loss", "min"), aside=0)
    assert k.to_json() == {"last": 2, "every": 1000, "best": ["val_loss", "min"], "aside": 0}


@pytest.mark.parametrize("last", [0, -1, 1.0, "3", True, None])
def test_bad_last(last):
    with pytest.raises(ValueError, match="last"):
        Keep(last=last)


@pytest.mark.parametrize("every", [0, -5, 2.0, "100", True])
def test_bad_every(every):
    with pytest.raises(ValueError, match="every"):
        Keep(every=every)


@pytest.mark.parametrize("best", [
    ("val_loss",), ("val_loss", "min", "x"), ["val_loss", "min"], ("val_loss", "avg"),
    ("val_loss", "MIN"), (1, "min"), (None, "max"), "val_loss", ("val_loss", None), (),
], ids=repr)
def test_bad_best(best):
    with pytest.raises(ValueError, match="best"):
        Keep(best=best)


def test_keep_is_frozen():
    with pytest.raises(AttributeError):
        Keep().last = 5  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# select_kept


def test_empty():
    assert select_kept([], Keep()) == set()


def test_keeps_the_newest_n():
    assert select_kept(gens(10), Keep(last=3)) == {8, 9, 10}
    assert select_kept(gens(10), Keep(last=1)) == {10}
    assert select_kept(gens(2), Keep(last=5)) == {1, 2}


def test_input_order_does_not_matter():
    data = gens(10)
    shuffled = data[:]
    random.Random(0).shuffle(shuffled)
    assert select_kept(shuffled, Keep(last=2)) == {9, 10}


def test_every_k_steps():
    # steps 100..1000; multiples of 300 are steps 300, 600, 900 -> generations 3, 6, 9
    assert select_kept(gens(10), Keep(last=1, every=300)) == {3, 6, 9, 10}
    # step 0 is a multiple of everything
    data = [(0, 0, {}), (1, 7, {}), (2, 14, {})]
    assert select_kept(data, Keep(last=1, every=1000)) == {0, 2}


def test_best_by_min_and_by_max():
    metrics = {1: {"val_loss": 3.0, "acc": 0.1}, 2: {"val_loss": 1.0, "acc": 0.9},
               3: {"val_loss": 2.0, "acc": 0.5}, 4: {"val_loss": 2.5, "acc": 0.4},
               5: {"val_loss": 4.0, "acc": 0.2}}
    data = gens(5, metrics=metrics)
    assert select_kept(data, Keep(last=1, best=("val_loss", "min"))) == {2, 5}
    assert select_kept(data, Keep(last=1, best=("acc", "max"))) == {2, 5}
    assert select_kept(data, Keep(last=1, best=("val_loss", "max"))) == {5}
    assert select_kept(data, Keep(last=2, best=("acc", "min"))) == {1, 4, 5}


def test_best_ignores_nan_missing_and_non_numeric():
    metrics = {1: {"val_loss": NAN}, 2: {}, 3: {"val_loss": "0.1"}, 4: {"val_loss": None},
               5: {"val_loss": 2.0}, 6: {"other": 0.0}, 7: {"val_loss": 3.0}, 8: {}}
    data = gens(8, metrics=metrics)
    assert select_kept(data, Keep(last=1, best=("val_loss", "min"))) == {5, 8}
    assert select_kept(data, Keep(last=1, best=("val_loss", "max"))) == {7, 8}
    # infinities are real values, ints count as numbers
    data = gens(3, metrics={1: {"m": -INF}, 2: {"m": 5}, 3: {}})
    assert select_kept(data, Keep(last=1, best=("m", "min"))) == {1, 3}
    assert select_kept(data, Keep(last=1, best=("m", "max"))) == {2, 3}


def test_best_when_no_generation_has_the_metric():
    data = gens(4, metrics={1: {"val_loss": NAN}})
    assert select_kept(data, Keep(last=1, best=("val_loss", "min"))) == {4}


def test_policies_combine():
    metrics = {2: {"val_loss": 0.5}}
    data = gens(12, metrics={g: {"val_loss": 1.0 + g} for g in range(1, 13)} | metrics)
    kept = select_kept(data, Keep(last=2, every=500, best=("val_loss", "min")))
    assert kept == {11, 12, 5, 10, 2}


@pytest.mark.parametrize("policy", [Keep(last=1), Keep(last=1, every=7),
                                    Keep(last=1, best=("val_loss", "min")),
                                    Keep(last=1, best=("val_loss", "max"))], ids=repr)
@pytest.mark.parametrize("data", [
    [(1, 1, {"val_loss": 0.0})],
    [(5, 500, {"val_loss": NAN}), (3, 300, {"val_loss": 0.1}), (9, 123, {"val_loss": NAN})],
    [(9, 0, {}), (2, 2000, {"val_loss": -1.0})],  # newest has the smallest step
    [(7, -3, {"val_loss": INF}), (8, 10**18, {"val_loss": -INF})],
    [(1, 1, {})] + [(g, g, {"val_loss": float(g)}) for g in range(2, 50)],
], ids=["one", "nan-newest", "step-order", "extremes", "many"])
def test_the_newest_generation_is_always_kept(policy, data):
    kept = select_kept(data, policy)
    newest = max(g for g, _, _ in data)
    assert newest in kept
    assert kept <= {g for g, _, _ in data}


def test_a_metric_named_like_the_declared_best_but_not_it_is_warned_about_once(tmp_path):
    """A typo in the metric's name kept no best generation, silently (an outside attack,
    session 40): step_done warns, once, when it is given a name close to Keep's but not it;
    other metrics, and the right name, say nothing."""
    import warnings

    import torch

    import unbroken

    assert Keep(best=("val_loss", "min")).misspelled({"train_acc": 1.0, "loss": 2.0}) is None
    assert Keep(best=("val_loss", "min")).misspelled({"val_loss": 1.0}) is None
    assert Keep().misspelled({"val_los": 1.0}) is None
    model = torch.nn.Linear(2, 1)
    keep = Keep(best=("val_loss", "min"))
    with unbroken.Checkpointer(tmp_path / "run", model=model, keep=keep) as ckpt:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            ckpt.step_done(1, train_acc=0.5)
            ckpt.step_done(2, val_los=0.4)
            ckpt.step_done(3, val_los=0.3)
        typos = [w for w in said if issubclass(w.category, unbroken.UnbrokenWarning)]
        assert len(typos) == 1 and "'val_los'" in str(typos[0].message), [
            str(w.message) for w in said]
        assert typos[0].filename == __file__
