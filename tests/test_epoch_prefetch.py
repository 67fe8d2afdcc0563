"""Cross-epoch prefetch (NOTE [ Cross-epoch prefetch ] in epochs.py): with persistent workers the
next epoch's first batches are fetched while this epoch's last ones are consumed, and the batches
are torch's, epoch for epoch, for every kind of sampler; a forecast the sampler does not bear out
costs time, never a wrong batch."""

from __future__ import annotations

import collections
import itertools
import os
import random

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, RandomSampler

from shmloader import ShmDataLoader
from shmloader.epochs import NextEpochPrefetch
from shmloader.protocol import Rewind

from . import _datasets as ds
from ._helpers import assert_same_batches

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]


class Prefetching(ShmDataLoader):
    """ShmDataLoader with the mode under test turned on (it is opt-in: off, shmloader drains at
    each epoch's end as torch does)."""

    def __init__(self, *args, prefetch_next_epoch: bool = True, **kwargs):
        super().__init__(*args, prefetch_next_epoch=prefetch_next_epoch, **kwargs)

EPOCHS = 3


class Noisy(Dataset):
    """Each sample carries its index and a draw from the worker's numpy RNG (so a batch fetched
    by another worker, or at another point of its RNG stream, would differ)."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return {"index": i, "noise": np.random.random(2), "worker": torch.utils.data.get_worker_info().id}


class Failing(Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        if i == 3:
            raise KeyError(f"no sample {i}")
        return np.full(3, i, dtype=np.int64)


def run(make, epochs: int = EPOCHS, between=None) -> list:
    """Every batch of `epochs` epochs of one loader (persistent workers), `between(epoch)` called
    before each iter()."""
    loader = make()
    got = []
    for epoch in range(epochs):
        if between is not None:
            between(loader, epoch)
        got.append(list(loader))
    return got, loader


def side_by_side(dataset, between=None, prefetched: bool = True, epochs: int = EPOCHS, **kwargs):
    """The same epochs from torch's DataLoader and Prefetching; returns shmloader's stats."""
    kwargs = dict(num_workers=2, persistent_workers=True, **kwargs)
    seed = kwargs.pop("seed", None)

    def make(cls):
        extra = {}
        if seed is not None:
            extra["generator"] = torch.Generator().manual_seed(seed)
        for key in ("sampler", "batch_sampler"):
            if key in kwargs and callable(kwargs[key]):
                extra[key] = kwargs[key](dataset)
        rest = {k: v for k, v in kwargs.items() if k not in extra}
        return lambda: cls(dataset, **rest, **extra)

    torch.manual_seed(7)
    want, _ = run(make(DataLoader), epochs, between=between)
    torch.manual_seed(7)
    got, loader = run(make(Prefetching), epochs, between=between)
    for epoch, (g, w) in enumerate(zip(got, want)):
        assert len(g) == len(w), f"epoch {epoch}: {len(g)} batches, torch {len(w)}"
        assert_same_batches(g, w)
    stats = loader.stats()
    if prefetched:  # the feature did something: the first batches of epochs 2 and 3 were in flight
        assert stats.prefetched_next_epoch >= 2 * (epochs - 1), stats
    return stats


def test_random_sampler_with_a_generator():
    stats = side_by_side(Noisy(), batch_size=4, shuffle=True, seed=3)
    assert stats.forecast_misses == 0


def test_distributed_sampler_with_set_epoch():
    def sampler(dataset):
        return DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=5)

    def set_epoch(loader, epoch):
        loader.sampler.set_epoch(epoch)

    stats = side_by_side(Noisy(), batch_size=3, sampler=sampler, between=set_epoch)
    assert stats.forecast_misses == 0


def test_distributed_sampler_without_set_epoch_misses_and_stays_torchs():
    """A user who never calls set_epoch gets the same order each epoch (torch's behaviour): the
    forecast (epoch + 1) is wrong, nothing prefetched is kept, the batches are still torch's."""
    def sampler(dataset):
        return DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=5)

    stats = side_by_side(Noisy(), batch_size=3, sampler=sampler, prefetched=False)
    assert stats.forecast_misses == EPOCHS - 1 and stats.prefetched_next_epoch == 0, stats


def test_batch_sampler():
    def batch_sampler(dataset):
        return BatchSampler(RandomSampler(dataset, generator=torch.Generator().manual_seed(11)),
                            batch_size=5, drop_last=True)

    side_by_side(Noisy(), batch_sampler=batch_sampler)


def test_custom_batch_sampler_with_its_own_rng():
    class Chunks:
        def __init__(self, n):
            self.n, self.rng = n, random.Random(4)

        def __len__(self):
            return self.n // 4

        def __iter__(self):
            order = list(range(self.n))
            self.rng.shuffle(order)
            return iter([order[i:i + 4] for i in range(0, self.n - 3, 4)])

    side_by_side(Noisy(), batch_sampler=lambda d: Chunks(len(d)))


def test_global_rng_sampler_is_kept_only_when_the_loop_draws_nothing():
    """shuffle=True without a generator seeds from torch's global RNG at the epoch's first item:
    a loop that draws from it (dropout, torch.rand) makes the forecast wrong; the batches stay
    torch's either way."""
    side_by_side(Noisy(), batch_size=4, shuffle=True)

    def draw(loader, epoch):
        torch.rand(1)  # between the forecast and the next epoch's first item

    stats = side_by_side(Noisy(), batch_size=4, shuffle=True, between=draw, prefetched=False)
    assert stats.forecast_misses >= 1, stats


def test_iterable_dataset_is_not_prefetched_and_is_torchs():
    stats = side_by_side(ds.UnevenStream(), batch_size=2, prefetched=False)
    assert stats.prefetched_next_epoch == 0


def test_turned_off():
    loader = Prefetching(Noisy(), batch_size=4, num_workers=2, persistent_workers=True,
                           prefetch_next_epoch=False)
    for _ in range(EPOCHS):
        list(loader)
    assert loader.stats().prefetched_next_epoch == 0


def test_an_error_in_a_prefetched_batch_is_raised_at_its_turn():
    """Index 3 raises in each epoch (sequential sampler: batch 1); with the next epoch's first
    batches prefetched, the error is still raised at batch 1 of each epoch and the rest follow."""
    def epochs_of(cls):
        loader = cls(Failing(), batch_size=2, num_workers=2, persistent_workers=True)
        seen = []
        for _ in range(EPOCHS):
            it = iter(loader)
            epoch = []
            while True:
                try:
                    epoch.append(next(it)[0, 0].item())
                except StopIteration:
                    break
                except KeyError:
                    epoch.append("KeyError")
            seen.append(epoch)
        return seen, loader

    want, ref = epochs_of(DataLoader)
    ref._iterator._shutdown_workers()  # now, not from a gc pass that SIGTERMs them (/tmp/pymp-* left)
    got, loader = epochs_of(Prefetching)
    assert got == want and "KeyError" in got[1], got
    assert loader.stats().prefetched_next_epoch > 0


def test_an_epoch_left_early_then_the_next_one():
    """The loop breaks out of epoch 1 after its sampler is exhausted but before its last batches
    (the next epoch's tasks are in flight), then starts epoch 2: torch's batches."""
    def epochs_of(cls):
        loader = cls(Noisy(), batch_size=2, num_workers=2, persistent_workers=True, shuffle=True,
                     generator=torch.Generator().manual_seed(1))
        out = []
        for epoch in range(EPOCHS):
            for i, batch in enumerate(loader):
                out.append(batch)
                if epoch == 0 and i == len(loader) - 3:
                    break
        return out

    assert_same_batches(epochs_of(Prefetching), epochs_of(DataLoader))


def test_workers_and_segments_are_released(tmp_path):
    """An epoch left with the next one's tasks in flight, then the loader dropped: nothing stays
    (the no_leaks fixture checks processes, fds and /dev/shm)."""
    loader = Prefetching(Noisy(), batch_size=4, num_workers=2, persistent_workers=True)
    list(loader)
    assert os.getpid() > 0
    del loader


def test_epochs_shorter_than_the_prefetch_window():
    """4 batches an epoch, 8 tasks in flight: each epoch's prime exhausts its sampler, so the next
    epoch's forecast is made (and its tasks sent) during the prime itself."""
    side_by_side(Noisy(), batch_size=10, shuffle=True, seed=3, prefetch_factor=4)
    stats = side_by_side(Noisy(), batch_size=40, shuffle=True, seed=3, prefetched=False)  # one batch an epoch
    assert stats.prefetched_next_epoch == EPOCHS - 1, stats


class Curriculum(Noisy):
    """The first `n` samples, `n` set in the main process between epochs."""

    n = 40

    def __len__(self):
        return self.n


@pytest.mark.parametrize("lengths", [(40, 8, 40), (40, 4, 12, 40), (12, 40, 4, 40)])
def test_an_epoch_shorter_than_the_forecast_keeps_the_augmentations_torchs(lengths):
    """The epoch ends before the forecast's tasks do (a curriculum shortens it): the tasks past
    its end are dropped and the workers undo their RNG draws before the next epoch's forecast
    goes out, so every later epoch's random augmentations are torch's."""
    dataset = Curriculum()

    def between(_loader, epoch):
        dataset.n = lengths[epoch]

    stats = side_by_side(dataset, between=between, batch_size=4, prefetched=False, epochs=len(lengths))
    assert stats.forecast_misses >= 1 and stats.prefetched_next_epoch >= 1, stats


def test_out_of_order_delivery_keeps_each_epochs_batches():
    """in_order=False: batches may come in another order, as with torch; each epoch still has
    exactly torch's batches, prefetched ones included."""
    def epochs_of(cls):
        loader = cls(Noisy(), batch_size=4, num_workers=2, persistent_workers=True, in_order=False,
                     shuffle=True, generator=torch.Generator().manual_seed(9))
        out = [sorted(tuple(b["index"].tolist()) for b in loader) for _ in range(EPOCHS)]
        return out, loader

    want, _ = epochs_of(DataLoader)
    got, loader = epochs_of(Prefetching)
    assert got == want
    assert loader.stats().prefetched_next_epoch > 0


def test_stats_count_kept_batches_and_misses_in_the_dict_form():
    loader = Prefetching(Noisy(), batch_size=4, num_workers=2, persistent_workers=True, shuffle=True,
                           generator=torch.Generator().manual_seed(1))
    for _ in range(EPOCHS):
        list(loader)
    data = loader.stats().as_dict()
    assert data["prefetched_next_epoch"] == 4 * (EPOCHS - 1) and data["forecast_misses"] == 0, data


class SharedDifficulty(Dataset):
    """Reads a value the training loop sets between epochs through shared memory (a curriculum):
    what a sample holds depends on when it is fetched."""

    def __init__(self):
        self.difficulty = torch.zeros(1).share_memory_()

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return np.array([i, float(self.difficulty[0])])


def test_by_default_an_epoch_is_fetched_after_its_iter_as_under_torch():
    """Off by default: a dataset that reads state the loop changes between epochs (shared memory,
    files) gets every batch of an epoch fetched after that change, as torch fetches them."""
    def set_difficulty(loader, epoch):
        loader.dataset.difficulty[0] = epoch

    got, want = [], []
    for cls, out in ((ShmDataLoader, got), (DataLoader, want)):
        batches, loader = run(lambda cls=cls: cls(SharedDifficulty(), batch_size=4, num_workers=2,
                                                  persistent_workers=True, shuffle=True,
                                                  generator=torch.Generator().manual_seed(5)),
                              between=set_difficulty)
        out.extend(batches)
        if cls is ShmDataLoader:
            assert loader.stats().prefetched_next_epoch == 0
    for epoch, (g, w) in enumerate(zip(got, want)):
        assert {float(v) for b in g for v in b[:, 1]} == {float(epoch)}, f"epoch {epoch} saw another epoch's state"
        assert_same_batches(g, w)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_prefetch_next_epoch_without_persistent_workers_is_a_clear_error(num_workers):
    """Without persistent workers there is no next epoch in the same workers to prefetch: a
    ValueError saying what to pass, not a mode silently off (found by a new-user check)."""
    with pytest.raises(ValueError, match=rf"needs persistent_workers=True.*persistent_workers=False, "
                                         rf"num_workers={num_workers}"):
        ShmDataLoader(list(range(8)), batch_size=2, num_workers=num_workers, prefetch_next_epoch=True)


# -- NextEpochPrefetch alone: the iterator's side of the forecast, with a recording send ------------


class _Sent:
    """Records what NextEpochPrefetch sends: tasks and resumes, and the workers' messages."""

    def __init__(self):
        self.tasks, self.resumes, self.messages = [], [], []

    def task(self, worker_id, task):
        self.tasks.append((worker_id, task))

    def resume(self, epoch):
        self.resumes.append(epoch)

    def message(self, worker_id, message):
        self.messages.append((worker_id, message))


def _sent_ahead(workers=2, count=4, batches=6, seed=3):
    """Epoch 1 of a shuffled batch sampler has ended: the forecast of epoch 2 is sent ahead."""
    sampler = BatchSampler(RandomSampler(range(batches * 2), generator=torch.Generator().manual_seed(seed)), 2, False)
    prefetch, sent = NextEpochPrefetch(True, workers, count), _Sent()
    for outstanding in range(count, -1, -1):  # one more each time a task of epoch 1 finishes
        prefetch.send_ahead(1, sampler, None, outstanding, sent.task, sent.resume)
    return sampler, prefetch, sent


def test_the_forecast_goes_out_as_tasks_finish_to_the_workers_the_prime_picks():
    sampler, prefetch, sent = _sent_ahead(workers=2, count=4)
    assert sent.resumes == [2]
    assert [w for w, _ in sent.tasks] == [0, 1, 0, 1]
    assert [(t.epoch, t.idx) for _, t in sent.tasks] == [(-2, 0), (-2, 1), (-2, 2), (-2, 3)]
    assert [t.indices for _, t in sent.tasks] == list(itertools.islice(iter(sampler), 4))
    assert prefetch.result_of(1, -2, 3) == "early" and prefetch.result_of(1, -3, 0) == "stale"


def test_the_prime_keeps_the_borne_out_prefix_and_rewinds_the_rest():
    sampler, prefetch, sent = _sent_ahead(workers=2, count=4)
    prefetch.keep_early(0, 0, "batch 0")
    prefetch.keep_early(2, 0, "batch 2")
    prefetch.new_epoch()
    prefetch.start_prime(2)
    real = list(itertools.islice(iter(sampler), 4))
    real[2] = [99, 98]  # the sampler differs from position 2 on
    kept = [prefetch.keeps(i, item, i % 2, sent.message) for i, item in enumerate(real)]
    assert kept == [True, True, False, False]
    assert sent.messages == [(0, Rewind(-2, 2)), (1, Rewind(-2, 2))]  # once, to every worker
    events = collections.deque()
    prefetch.end_prime(events)
    assert list(events) == [(0, 0, "batch 0")]  # batch 2 was not kept: dropped
    assert prefetch.adopted == {0, 1} and prefetch.prefetched == 2 and prefetch.misses == 1
    assert prefetch.result_of(2, -2, 1) == "now" and prefetch.result_of(2, -2, 2) == "stale"


def test_a_task_sent_to_another_worker_than_forecast_is_not_kept():
    sampler, prefetch, sent = _sent_ahead(workers=2, count=4)
    prefetch.new_epoch()
    prefetch.start_prime(2)
    first = next(iter(sampler))
    assert not prefetch.keeps(0, first, 1, sent.message)
    assert sent.messages == [(0, Rewind(-2, 0)), (1, Rewind(-2, 0))]


def test_an_epoch_that_ends_inside_the_forecast_rewinds_past_its_end():
    sampler, prefetch, sent = _sent_ahead(workers=2, count=4)
    prefetch.new_epoch()
    prefetch.start_prime(2)
    real = list(itertools.islice(iter(sampler), 2))
    assert all(prefetch.keeps(i, item, i % 2, sent.message) for i, item in enumerate(real))
    prefetch.sampler_ended(2, sent.message)
    assert sent.messages == [(0, Rewind(-2, 2)), (1, Rewind(-2, 2))]
    prefetch.end_prime(collections.deque())
    assert prefetch.misses == 1 and prefetch.prefetched == 2


def test_turned_off_it_sends_nothing_and_keeps_nothing():
    sampler = BatchSampler(RandomSampler(range(8), generator=torch.Generator().manual_seed(0)), 2, False)
    prefetch, sent = NextEpochPrefetch(False, 2, 4), _Sent()
    prefetch.send_ahead(1, sampler, None, 0, sent.task, sent.resume)
    prefetch.new_epoch()
    prefetch.start_prime(2)
    assert not prefetch.keeps(0, next(iter(sampler)), 0, sent.message)
    assert sent.tasks == sent.resumes == sent.messages == []
