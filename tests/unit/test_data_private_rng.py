"""ResumableLoader refuses a collate_fn that draws from a random generator of its own.

Such a stream (a ``torch.Generator``, a NumPy or ``random.Random`` generator the collate
function reaches) is neither saved with a generation nor positioned by the data cursor, so a
resumed run would collate differently; the global streams, which the loader seeds for each
batch's collate from (seed, epoch, position), are accepted. The refusal happens at
construction, before anything is built, and names the path to the generator."""

from __future__ import annotations

import functools
import random
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data

import unbroken.data.loader as loader_module
from unbroken.data import ResumableLoader, ResumableSampler, seeded
from unbroken.data._private_rng import private_rng
from unbroken.errors import UnsupportedSetup

N, B = 16, 4


def make_loader(collate_fn: Any, **kwargs: Any) -> ResumableLoader:
    dataset = seeded(torch.utils.data.TensorDataset(torch.arange(N, dtype=torch.float32)), 0)
    return ResumableLoader(dataset, ResumableSampler(N, B, seed=1), collate_fn=collate_fn,
                           **kwargs)


def batches(loader: ResumableLoader) -> list[Any]:
    return list(loader)


# -- refused -------------------------------------------------------------------------------

class MaskingCollate:
    """A collate class holding a torch.Generator of its own (a common masking idiom)."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, samples: list[Any]) -> torch.Tensor:
        x = torch.utils.data.default_collate(samples)[0]
        return x * (torch.rand(x.shape, generator=self.generator) > 0.1)


class ConfiguredCollate:
    """A collate class whose generator sits in a dict attribute."""

    def __init__(self) -> None:
        self.config = {"p": 0.1, "rng": np.random.default_rng(0)}

    def __call__(self, samples: list[Any]) -> torch.Tensor:
        x = torch.utils.data.default_collate(samples)[0]
        return x * float(self.config["rng"].random() > self.config["p"])


def _collate_with(samples: list[Any], generator: torch.Generator, p: float = 0.1) -> torch.Tensor:
    x = torch.utils.data.default_collate(samples)[0]
    return x * (torch.rand(x.shape, generator=generator) > p)


def _closing_over_random() -> Any:
    rng = random.Random(3)

    def collate(samples: list[Any]) -> torch.Tensor:
        x = torch.utils.data.default_collate(samples)[0]
        return x * float(rng.random() > 0.1)

    return collate


REFUSED = [
    pytest.param(MaskingCollate(torch.Generator().manual_seed(0)),
                 r"collate_fn=MaskingCollate\(\.\.\.\) .*\(collate_fn\.generator: "
                 r"a torch\.Generator\)", id="class-with-torch-generator"),
    pytest.param(_closing_over_random(),
                 r"collate_fn=_closing_over_random\.<locals>\.collate .*"
                 r"\(collate_fn \(closure rng\): a random\.Random\)", id="closure-random"),
    pytest.param(ConfiguredCollate(),
                 r"\(collate_fn\.config\['rng'\]: a numpy\.random\.Generator\)",
                 id="numpy-generator-in-dict"),
    pytest.param(functools.partial(_collate_with, generator=torch.Generator().manual_seed(0)),
                 r"collate_fn=functools\.partial\(_collate_with\) .*"
                 r"\(collate_fn\.keywords\['generator'\]: a torch\.Generator\)",
                 id="partial-generator-argument"),
]


@pytest.mark.parametrize(("collate_fn", "path"), REFUSED)
def test_a_collate_fn_with_a_generator_of_its_own_is_refused(collate_fn: Any,
                                                              path: str) -> None:
    with pytest.raises(UnsupportedSetup, match=path) as caught:
        make_loader(collate_fn)
    message = str(caught.value)
    # Why it breaks a resume, and the remedy, stated as what the loader actually seeds.
    assert "neither saved with a generation nor positioned by the data cursor" in message
    assert "torch's default CPU generator" in message and "np.random" in message
    assert "random.*" in message
    assert "(its seed, the epoch, the position of the batch's first sample)" in message


def test_an_iterable_dataset_loader_refuses_it_too() -> None:
    # (the check runs before the map-style/iterable split: an iterable dataset without the
    # resumable contract would otherwise be refused first, as MissingState)
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self) -> Any:
            return iter(range(N))

    with pytest.raises(UnsupportedSetup, match=r"collate_fn\.generator: a torch\.Generator"):
        ResumableLoader(Stream(), batch_size=B,
                        collate_fn=MaskingCollate(torch.Generator().manual_seed(0)))


def test_a_refused_loader_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    registered: list[Any] = []
    built: list[Any] = []

    class Registry:
        def add(self, loader: Any) -> None:
            registered.append(loader)

    class SpyLoader(torch.utils.data.DataLoader):  # type: ignore[type-arg]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(loader_module, "_LIVE", Registry())
    monkeypatch.setattr(torch.utils.data, "DataLoader", SpyLoader)
    generator = torch.Generator().manual_seed(0)
    before = generator.get_state()
    sampler = ResumableSampler(N, B, seed=1)
    sampler.set_position(0, 2 * B)
    dataset = seeded(torch.utils.data.TensorDataset(torch.arange(N, dtype=torch.float32)), 0)
    with pytest.raises(UnsupportedSetup):
        ResumableLoader(dataset, sampler, num_workers=2, collate_fn=MaskingCollate(generator))
    assert registered == [] and built == []  # not registered for the exit-time worker stop
    assert (sampler.epoch, sampler.consumed) == (0, 2 * B)  # the sampler's cursor untouched
    assert torch.equal(generator.get_state(), before)  # the collate_fn was never called
    # The same sampler still builds an accepted loader, which works from the same cursor.
    ok = ResumableLoader(dataset, sampler, collate_fn=_collate_global)
    assert len(registered) == 1 and len(built) == 1
    assert len(batches(ok)) == N // B - 2


# -- accepted ------------------------------------------------------------------------------

def _collate_global(samples: list[Any]) -> torch.Tensor:
    x = torch.utils.data.default_collate(samples)[0]
    return x + torch.rand(x.shape) + float(np.random.rand()) + random.random()


ACCEPTED = [
    pytest.param(lambda samples: torch.stack([s[0] for s in samples]) + torch.rand(len(samples)),
                 id="lambda-global-torch-rand"),
    pytest.param(torch.utils.data.default_collate, id="default-collate"),
    pytest.param(_collate_global, id="all-three-global-streams"),
    pytest.param(functools.partial(_collate_with, generator=torch.default_generator),
                 id="torch-default-generator-passed-explicitly"),
]


@pytest.mark.parametrize("collate_fn", ACCEPTED)
def test_a_collate_fn_drawing_from_the_global_streams_is_accepted(collate_fn: Any) -> None:
    assert private_rng(collate_fn, "collate_fn") is None
    loader = make_loader(collate_fn)
    # Its draws are seeded per batch: a second loader over the same cursor collates the same.
    assert all(torch.equal(a if isinstance(a, torch.Tensor) else a[0],
                           b if isinstance(b, torch.Tensor) else b[0])
               for a, b in zip(batches(loader), batches(make_loader(collate_fn)), strict=True))


def test_no_collate_fn_is_accepted() -> None:
    assert private_rng(None, "collate_fn") is None
    assert len(batches(make_loader(None))) == N // B


# -- found by the outside review -------------------------------------------------------------------

generator = torch.Generator().manual_seed(42)  # (a module global, as for random_split)
AUG = np.random.default_rng(5)  # (a module global a comprehension in a collate reads)


class _Split:
    """A LightningDataModule-like object: keeps a generator for its own split, and collates
    with the global stream (an unused generator is not the collate's stream)."""

    def __init__(self) -> None:
        self.split_gen = torch.Generator().manual_seed(0)
        self.p = 0.1

    def collate(self, samples: list[Any]) -> torch.Tensor:
        x = torch.utils.data.default_collate(samples)[0]
        return self._mask(x)

    def _mask(self, x: torch.Tensor) -> torch.Tensor:
        return x * (torch.rand(x.shape) > self.p)


class _SplitDrawing(_Split):
    """The same, whose collate draws (through a method it calls) from a generator it keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.rng = torch.Generator().manual_seed(1)

    def _mask(self, x: torch.Tensor) -> torch.Tensor:
        return x * (torch.rand(x.shape, generator=self.rng) > self.p)


class _AttrLikeAGlobal:
    """Reads ``self.generator`` (None: the global stream), named like the module's global."""

    generator = None

    def __call__(self, samples: list[Any]) -> torch.Tensor:
        x = torch.utils.data.default_collate(samples)[0]
        return x * (torch.rand(x.shape, generator=self.generator) > 0.1)


class _Slotted:
    __slots__ = ("rng",)

    def __init__(self) -> None:
        self.rng = np.random.default_rng(3)

    def __call__(self, samples: list[Any]) -> torch.Tensor:
        return torch.utils.data.default_collate(samples)[0] * float(self.rng.random())


def _comprehension_global(samples: list[Any]) -> torch.Tensor:
    return torch.tensor([float(AUG.random()) for _ in samples])


class _Proxy:
    """A global whose attributes raise (werkzeug's LocalProxy outside a request)."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("working outside of a request context")


PROXY = _Proxy()


def _reads_proxy(samples: list[Any]) -> Any:
    return torch.utils.data.default_collate(samples) if PROXY is not None else None


@pytest.mark.parametrize("collate_fn", [
    _Split().collate, _AttrLikeAGlobal(), _reads_proxy,
    functools.partial(lambda s, args: torch.utils.data.default_collate(s),
                      args=__import__("argparse").Namespace(seed=0, generator="gpt2"))],
    ids=["unused_generator_of_its_object", "attribute_named_like_a_global", "raising_proxy",
         "namespace_with_seed_and_generator_name"])
def test_resumable_collators_the_walk_once_refused_or_crashed_on_are_accepted(collate_fn):
    make_loader(collate_fn)  # (no UnsupportedSetup, nor any other error)


@pytest.mark.parametrize("collate_fn", [
    _SplitDrawing().collate, _Slotted(), _comprehension_global,
    lambda s, held=__import__("collections").deque([np.random.default_rng(2)]): s,
    lambda s, bits=np.random.PCG64(7): s],
    ids=["method_calling_a_drawing_method", "slots", "global_read_in_a_comprehension",
         "deque", "bit_generator"])
def test_private_streams_the_walk_once_missed_are_refused(collate_fn):
    with pytest.raises(UnsupportedSetup, match="draws from a random generator of its own"):
        make_loader(collate_fn)
