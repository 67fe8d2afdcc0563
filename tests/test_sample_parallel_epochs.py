"""sample_parallel=True with prefetch_next_epoch=True (NOTE [ The next epoch's first batches ] in
shmloader/sample_parallel.py): the next epoch's first batches are spread over the workers while
this epoch's last ones are consumed, and every epoch's batches are those of the mode without it
(and torch's indices), for every kind of sampler; a forecast the sampler does not bear out costs
time, never a wrong batch."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from shmloader import ShmDataLoader
from tests._helpers import assert_same_batches
from tests.test_epoch_prefetch import Failing  # index 3 raises KeyError

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.usefixtures("no_leaks"),
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),  # 3 workers, 2 cores
]

EPOCHS = 4


class Noisy(Dataset):
    """Each sample: its index and draws from numpy's and torch's global RNGs (seeded per row in
    this mode, so a row fetched with another seed would differ)."""

    def __init__(self, n=42):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"index": i, "noise": np.random.random(3), "draw": torch.rand(2)}


class Plain(Dataset):
    """No randomness: torch's batches exactly."""

    def __init__(self, n=30):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full((2, 3), i, np.float32), i


class Shapes(Dataset):
    """Samples 0-7 are (4,), the rest (6,): the last batches of an epoch have another layout than
    its first ones, so a batch sent ahead is laid out again (NOTE [ A new shape ])."""

    def __len__(self):
        return 20

    def __getitem__(self, i):
        return np.full(4 if i < 8 else 6, i, np.int64)


def epochs_of(loader, epochs=EPOCHS, between=None) -> list[list]:
    out = []
    for epoch in range(epochs):
        if between is not None:
            between(loader, epoch)
        out.append(list(loader))
    return out


def make(dataset, cls=ShmDataLoader, seed=None, **kwargs):
    if seed is not None:
        kwargs["generator"] = torch.Generator().manual_seed(seed)
    kwargs.setdefault("num_workers", 3)
    kwargs.setdefault("batch_size", 4)
    if cls is ShmDataLoader:
        kwargs["sample_parallel"] = True
    return cls(dataset, persistent_workers=True, **kwargs)


def assert_same_epochs(got, want):
    assert [len(e) for e in got] == [len(e) for e in want]
    for g, w in zip(got, want):
        assert_same_batches(g, w)


@pytest.mark.parametrize("num_workers,prefetch_factor", [(2, 2), (3, 4)])
def test_random_augmentations_are_those_of_the_mode_without_it(num_workers, prefetch_factor):
    """Rows of the next epoch fetched ahead are seeded as that epoch's rows: the batches are the
    mode's without prefetch, epoch for epoch, and the indices are torch's."""
    common = dict(num_workers=num_workers, prefetch_factor=prefetch_factor, shuffle=True, seed=5)
    want = epochs_of(make(Noisy(), **common))
    loader = make(Noisy(), prefetch_next_epoch=True, **common)
    got = epochs_of(loader)
    assert_same_epochs(got, want)
    torch_order = epochs_of(make(Noisy(), cls=DataLoader, **common))
    assert [[b["index"].tolist() for b in e] for e in got] == [[b["index"].tolist() for b in e] for e in torch_order]
    stats = loader.stats()
    depth = max(2, prefetch_factor)
    assert stats.prefetched_next_epoch == depth * (EPOCHS - 1) and stats.forecast_misses == 0, stats


def test_without_it_nothing_is_fetched_ahead():
    loader = make(Noisy(), shuffle=True, seed=5)
    epochs_of(loader)
    assert loader.stats().prefetched_next_epoch == 0


def test_distributed_sampler_with_set_epoch():
    dataset = Plain()

    def build(cls, **kwargs):
        sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=3)
        return make(dataset, cls=cls, sampler=sampler, **kwargs)

    set_epoch = lambda loader, epoch: loader.sampler.set_epoch(epoch)  # noqa: E731
    want = epochs_of(build(DataLoader), between=set_epoch)
    loader = build(ShmDataLoader, prefetch_next_epoch=True)
    assert_same_epochs(epochs_of(loader, between=set_epoch), want)
    assert loader.stats().prefetched_next_epoch > 0 and loader.stats().forecast_misses == 0


def test_a_forecast_the_sampler_does_not_bear_out_costs_no_wrong_batch():
    """The sampler's generator is seeded again between epochs (another order than forecast):
    every batch sent ahead is dropped and the real ones are fetched; torch's batches."""
    dataset = Plain()
    reseed = lambda loader, epoch: loader.generator.manual_seed(100 + epoch)  # noqa: E731
    want = epochs_of(make(dataset, cls=DataLoader, shuffle=True, seed=1), between=reseed)
    loader = make(dataset, shuffle=True, seed=1, prefetch_next_epoch=True)
    assert_same_epochs(epochs_of(loader, between=reseed), want)
    stats = loader.stats()
    assert stats.forecast_misses == EPOCHS - 1 and stats.prefetched_next_epoch == 0, stats


def test_a_batch_of_another_layout_sent_ahead_is_laid_out_again():
    want = epochs_of(make(Shapes(), cls=DataLoader))
    loader = make(Shapes(), prefetch_next_epoch=True)
    assert_same_epochs(epochs_of(loader), want)
    assert loader.stats().prefetched_next_epoch > 0


def test_an_error_in_a_batch_sent_ahead_is_raised_at_its_turn():
    """Index 3 raises (sequential sampler, batch 1 of every epoch): still at batch 1 of each
    epoch, and the rest follow."""
    def run(loader):
        seen = []
        for _ in range(EPOCHS):
            it, epoch = iter(loader), []
            while True:
                try:
                    epoch.append(int(next(it)[0, 0]))
                except StopIteration:
                    break
                except KeyError:
                    epoch.append("KeyError")
            seen.append(epoch)
        return seen

    want = run(make(Failing(), cls=DataLoader, batch_size=2))
    loader = make(Failing(), batch_size=2, prefetch_next_epoch=True)
    assert run(loader) == want and want[1][1] == "KeyError", want
    assert loader.stats().prefetched_next_epoch > 0


def test_an_epoch_left_early_then_the_next_one():
    """The loop leaves epoch 1 once its sampler is exhausted but before its last batches (the
    next epoch's are in flight), then runs the others: the mode's batches without prefetch."""
    def run(loader):
        out = []
        for epoch in range(EPOCHS):
            for i, batch in enumerate(loader):
                out.append(batch)
                if epoch == 0 and i == len(loader) - 2:
                    break
        return out

    want = run(make(Noisy(), shuffle=True, seed=2))
    assert_same_batches(run(make(Noisy(), shuffle=True, seed=2, prefetch_next_epoch=True)), want)


@pytest.mark.parametrize("lengths", [(40, 3, 40, 8), (6, 40, 2, 40)])
def test_epochs_shorter_than_the_batches_sent_ahead(lengths):
    """A curriculum changes the epoch's length between epochs (the main process's dataset: the
    sampler's length): an epoch may end inside the forecast, or be drawn whole by its own start."""
    def run(cls, **kwargs):
        dataset = Noisy(40)

        def between(_loader, epoch):
            dataset.n = lengths[epoch]

        loader = make(dataset, cls=cls, batch_size=4, prefetch_factor=4, seed=4, **kwargs)  # (seeds the rows)
        return epochs_of(loader, epochs=len(lengths), between=between), loader

    want, _ = run(ShmDataLoader)
    got, loader = run(ShmDataLoader, prefetch_next_epoch=True)
    assert_same_epochs(got, want)
    assert loader.stats().prefetched_next_epoch > 0


def test_the_loader_dropped_with_batches_sent_ahead_leaves_nothing():
    """The no_leaks fixture checks processes, fds and /dev/shm once the loader is gone."""
    loader = make(Plain(), prefetch_next_epoch=True)
    list(loader)
    del loader


class Flaky:
    """Batches of 4 in order; its next iterator raises at its first batch while `fail` is set (a
    class attribute: the forecast's copy, made before, does not raise)."""

    fail = False

    def __init__(self, n=24):
        self.n = n

    def __len__(self):
        return self.n // 4

    def __iter__(self):
        if Flaky.fail:
            raise RuntimeError("flaky sampler")
        return iter([list(range(i, i + 4)) for i in range(0, self.n, 4)])


def test_a_sampler_that_raises_at_the_next_iter_after_batches_were_sent_ahead():
    """As torch's, iter() raises the sampler's error; the batches sent ahead are dropped (no slot
    or flight place kept by them), and the next iter() gives a whole epoch."""
    def run(cls, **kwargs):
        loader = make(Plain(24), cls=cls, batch_size=1, batch_sampler=Flaky(), seed=1, **kwargs)
        first = list(loader)
        Flaky.fail = True
        try:
            with pytest.raises(RuntimeError, match="flaky sampler"):
                iter(loader)
        finally:
            Flaky.fail = False
        return [first, list(loader), list(loader)], loader

    want, _ = run(DataLoader)
    got, loader = run(ShmDataLoader, prefetch_next_epoch=True)
    assert_same_epochs(got, want)
    assert loader.stats().prefetched_next_epoch > 0


def _random_case(seed: int) -> tuple[dict, list]:
    """A loader configuration and, per epoch, where the loop leaves it (None: at its end)."""
    rng = random.Random(seed)
    kind = rng.choice(["shuffle", "sequential", "weighted", "subset", "distributed"])
    kwargs = dict(num_workers=rng.choice([1, 2, 3]), prefetch_factor=rng.choice([1, 2, 4]),
                  batch_size=rng.choice([1, 3, 8]), drop_last=rng.random() < 0.3, seed=seed)
    if kind == "shuffle":
        kwargs["shuffle"] = True
    elif kind == "weighted":
        kwargs["sampler"] = lambda gen: WeightedRandomSampler(torch.linspace(0.1, 2.0, 30), 25, generator=gen)
    elif kind == "subset":
        kwargs["sampler"] = lambda gen: SubsetRandomSampler(range(3, 27), generator=gen)
    elif kind == "distributed":
        kwargs["sampler"] = lambda gen: DistributedSampler(Noisy(30), num_replicas=2, rank=seed % 2, seed=seed)
    leave = [rng.choice([None, None, rng.randint(0, 4)]) for _ in range(EPOCHS)]
    return kwargs, leave


@pytest.mark.parametrize("seed", range(8))
def test_random_configurations_give_the_batches_of_the_mode_without_it(seed):
    """Samplers, workers, prefetch factors, batch sizes, drop_last and epochs left early (or
    an iter() with no next()) drawn at random: the same batches with and without prefetch, and
    torch's indices where no epoch is left early (torch's order then depends on its own prefetch)."""
    kwargs, leave = _random_case(seed)

    def run(cls, **extra):
        options = dict(kwargs, **extra)
        gen = torch.Generator().manual_seed(options.pop("seed"))
        make_sampler = options.pop("sampler", None)
        if make_sampler is not None:
            options["sampler"] = make_sampler(gen)
        loader = make(Noisy(30), cls=cls, generator=gen, **options)
        epochs = []
        for epoch, stop in enumerate(leave):
            if isinstance(loader.sampler, DistributedSampler):
                loader.sampler.set_epoch(epoch)
            it = iter(loader)
            epochs.append([batch for _, batch in zip(range(stop if stop is not None else 1 << 30), it)])
        del it
        return epochs, loader

    want, _ = run(ShmDataLoader)
    got, loader = run(ShmDataLoader, prefetch_next_epoch=True)
    assert_same_epochs(got, want)
    if all(stop is None for stop in leave):
        order, ref = run(DataLoader)
        assert [[b["index"].tolist() for b in e] for e in got] == [[b["index"].tolist() for b in e] for e in order]
        ref._iterator._shutdown_workers()
        assert loader.stats().prefetched_next_epoch > 0 or len(want[0]) == 0
