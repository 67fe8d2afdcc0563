"""shmloader.epochs: the forecast of the next epoch's first sampler items (NOTE [ Cross-epoch
prefetch ]). Each sampler kind is taken through an epoch, forecast, and its next epoch compared
with the forecast and with a twin sampler that was never forecast; the global RNGs must be as
they were. No worker processes."""

from __future__ import annotations

import copy
import itertools
import pickle
import random
import threading

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    RandomSampler,
    SequentialSampler,
    Subset,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data.dataloader import _InfiniteConstantSampler
from torch.utils.data.distributed import DistributedSampler

from shmloader import epochs
from shmloader.epochs import Forecast, forecast, matches

pytestmark = pytest.mark.timeout(60)

N = 100  # dataset length: a reshuffle keeps the first item with probability 1/N
K = 8  # items forecast (prefetch_factor x num_workers)


class Dataset:
    """A map-style dataset of N items."""

    def __init__(self, n: int = N):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class Uncopyable(Dataset):
    """A dataset that refuses deepcopy and pickle (a huge or process-bound one)."""

    def __deepcopy__(self, memo):
        raise RuntimeError("Uncopyable must not be deep-copied")

    def __reduce_ex__(self, protocol):
        raise RuntimeError("Uncopyable must not be pickled")


class OwnRandomBatches:
    """A custom batch sampler drawing from its own random.Random(seed), which runs on."""

    def __init__(self, n: int, batch_size: int, seed: int):
        self.n, self.batch_size = n, batch_size
        self.rng = random.Random(seed)

    def __iter__(self):
        order = list(range(self.n))
        self.rng.shuffle(order)
        for start in range(0, self.n, self.batch_size):
            yield order[start:start + self.batch_size]

    def __len__(self) -> int:
        return (self.n + self.batch_size - 1) // self.batch_size


class Counting:
    """A stateful sampler: each iter() counts, and the epoch's order depends on the count."""

    def __init__(self, n: int):
        self.n = n
        self.iters = 0

    def __iter__(self):
        self.iters += 1
        shift = self.iters
        return iter([(i + shift) % self.n for i in range(self.n)])

    def __len__(self) -> int:
        return self.n


class Locked(SequentialSampler):
    """A sampler holding a lock: it cannot be deep-copied."""

    def __init__(self, data_source):
        super().__init__(data_source)
        self.lock = threading.Lock()


def distributed(dataset, seed=7):
    return DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=seed)


# name -> a function building (sampler, dataset) identically at each call, so that the twin built
# by a second call draws what the first would have drawn without a forecast
SAMPLERS = {
    "sequential": lambda ds: SequentialSampler(ds),
    "random-generator": lambda ds: RandomSampler(ds, generator=torch.Generator().manual_seed(3)),
    "random-replacement": lambda ds: RandomSampler(
        ds, replacement=True, num_samples=70, generator=torch.Generator().manual_seed(4)),
    "random-num-samples": lambda ds: RandomSampler(
        ds, num_samples=250, generator=torch.Generator().manual_seed(5)),
    "subset-random": lambda ds: SubsetRandomSampler(
        list(range(0, N, 3)), generator=torch.Generator().manual_seed(6)),
    "weighted": lambda ds: WeightedRandomSampler(
        torch.linspace(0.1, 1.0, N), num_samples=60, generator=torch.Generator().manual_seed(8)),
    "weighted-no-replacement": lambda ds: WeightedRandomSampler(
        torch.linspace(0.1, 1.0, N), num_samples=60, replacement=False,
        generator=torch.Generator().manual_seed(9)),
    "distributed": distributed,
}
BATCH_SIZE = 7  # N % 7 != 0: drop_last changes the last batch


def rng_states():
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def assert_rng_states(before):
    torch_state, python_state, numpy_state = rng_states()
    assert torch.equal(torch_state, before[0]), "forecast changed torch's global RNG"
    assert python_state == before[1], "forecast changed Python's random state"
    assert all(np.array_equal(a, b) for a, b in zip(numpy_state, before[2])), \
        "forecast changed numpy's global RNG"


def next_epoch(sampler):
    """What the loader does at an epoch's start: move epoch holders on, then iterate."""
    for holder in (sampler, getattr(sampler, "sampler", None)):
        if isinstance(holder, DistributedSampler):
            holder.set_epoch(holder.epoch + 1)
    return list(sampler)


def check_forecast(build, count=K, epochs_before=1, dataset=None):
    """Take a sampler through `epochs_before` epochs, forecast, and compare with the real next
    epoch and with a twin's; returns the forecast."""
    dataset = Dataset() if dataset is None else dataset
    real, twin = build(dataset), build(dataset)
    for _ in range(epochs_before):
        assert next_epoch(real) == next_epoch(twin)
    before = rng_states()
    items = forecast(real, count, dataset=dataset)
    assert_rng_states(before)
    assert items is not None
    following = next_epoch(real)
    assert following == next_epoch(twin), "the forecast disturbed the real sampler"
    assert items == following[:count]
    assert all(matches(f, r) for f, r in zip(items, following))
    assert next_epoch(real) == next_epoch(twin)  # and the one after
    return items


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
def test_sampler_forecast_is_the_next_epoch(kind):
    items = check_forecast(SAMPLERS[kind])
    assert len(items) == K
    check_forecast(SAMPLERS[kind], epochs_before=3)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("kind", sorted(SAMPLERS))
def test_batch_sampler_forecast_is_the_next_epoch(kind, drop_last):
    def build(ds):
        return BatchSampler(SAMPLERS[kind](ds), BATCH_SIZE, drop_last)

    items = check_forecast(build)
    assert all(isinstance(batch, list) for batch in items)
    # the whole epoch: the last batch is short or dropped as the real one is
    whole = check_forecast(build, count=10_000)
    assert len(whole) == len(build(Dataset()))


def test_custom_batch_sampler_with_its_own_random():
    items = check_forecast(lambda ds: OwnRandomBatches(N, 10, seed=11), count=3)
    assert len(items) == 3 and all(len(batch) == 10 for batch in items)


def test_random_sampler_without_generator_matches_when_nothing_draws_between():
    torch.manual_seed(0)
    # the same global RNG draws for the twin: it is built, iterated and forecast from the same state
    dataset = Dataset()
    real = RandomSampler(dataset)
    list(real)
    state = torch.get_rng_state()
    before = rng_states()
    items = forecast(real, K, dataset=dataset)
    assert_rng_states(before)
    following = list(real)
    assert items == following[:K]
    torch.set_rng_state(state)  # without the forecast, the real next epoch is the same
    assert list(real) == following


def test_random_sampler_without_generator_differs_when_something_draws_between():
    torch.manual_seed(0)
    dataset = Dataset()
    real = RandomSampler(dataset)
    list(real)
    misses = 0
    for _ in range(5):
        items = forecast(real, K, dataset=dataset)
        torch.rand(1)  # e.g. dropout on the CPU in the batches the loop still takes
        following = list(real)
        misses += not matches(items[0], following[0])
        assert items != following[:K]
    assert misses >= 4  # each first item agrees by chance with probability 1/N


def test_distributed_sampler_needs_set_epoch():
    dataset = Dataset()
    real = distributed(dataset)
    real.set_epoch(0)
    list(real)
    items = forecast(real, K, dataset=dataset)
    assert real.epoch == 0, "the forecast set the real sampler's epoch"
    without = list(real)  # the user forgot set_epoch: epoch 0's order again
    assert items != without[:K]
    assert not all(matches(f, r) for f, r in zip(items, without))
    real.set_epoch(1)
    assert list(real)[:K] == items


def test_distributed_batch_sampler_sets_the_inner_epoch_on_the_copy_only():
    dataset = Dataset()
    inner = distributed(dataset)
    batches = BatchSampler(inner, 4, drop_last=False)
    inner.set_epoch(5)
    items = forecast(batches, 3, dataset=dataset)
    assert inner.epoch == 5
    inner.set_epoch(6)
    assert list(batches)[:3] == items


def test_epoch_holder_that_passes_its_epoch_on():
    class Wrapper:
        """A batch sampler with its own set_epoch that sets its sampler's too."""

        def __init__(self, sampler):
            self.sampler, self.epoch = sampler, 0

        def set_epoch(self, epoch):
            self.epoch = epoch
            self.sampler.set_epoch(epoch)

        def __iter__(self):
            return iter(BatchSampler(self.sampler, 5, drop_last=True))

        def __len__(self):
            return len(self.sampler) // 5

    dataset = Dataset()
    wrapper = Wrapper(distributed(dataset))
    wrapper.set_epoch(2)
    items = forecast(wrapper, 4, dataset=dataset)
    wrapper.set_epoch(3)  # epoch 3, not 4: the inner one was moved once
    assert list(wrapper)[:4] == items
    assert wrapper.sampler.epoch == 3


def test_real_sampler_is_never_advanced():
    sampler = Counting(10)
    assert list(sampler) == [(i + 1) % 10 for i in range(10)]
    items = forecast(sampler, 4)
    assert sampler.iters == 1
    assert items == [(i + 2) % 10 for i in range(4)]
    assert list(sampler)[:4] == items
    assert sampler.iters == 2


def test_uncopyable_sampler_has_no_forecast():
    dataset = Dataset()
    sampler = Locked(dataset)
    with pytest.raises(TypeError):
        copy.deepcopy(sampler)
    before = rng_states()
    assert forecast(sampler, K, dataset=dataset) is None
    assert_rng_states(before)
    assert list(sampler) == list(range(N))


def test_dataset_is_shared_not_copied():
    dataset = Uncopyable()
    with pytest.raises(RuntimeError):
        pickle.dumps(dataset)
    for build in (SequentialSampler, SAMPLERS["random-generator"], distributed,
                  lambda ds: BatchSampler(RandomSampler(ds, generator=torch.Generator()), 4, False)):
        check_forecast(build, dataset=dataset)
    # without the memo the copy would reach the dataset and fail: no forecast, no error
    assert forecast(SequentialSampler(dataset), K) is None


def test_dataset_inside_a_wrapper_is_shared():
    dataset = Uncopyable()
    subset = Subset(dataset, list(range(0, N, 2)))
    items = check_forecast(lambda ds: RandomSampler(subset, generator=torch.Generator().manual_seed(1)),
                           dataset=dataset)
    assert len(items) == K


def test_count_beyond_the_epoch_is_the_whole_epoch():
    dataset = Dataset(5)
    sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(2))
    list(sampler)
    items = forecast(sampler, 50, dataset=dataset)
    assert sorted(items) == list(range(5))
    assert list(sampler) == items
    assert forecast(sampler, 0) == []


def test_empty_epoch():
    assert forecast(SequentialSampler(Dataset(0)), K) == []


def test_bad_count_is_an_error_naming_it():
    with pytest.raises(ValueError, match="-1"):
        forecast(SequentialSampler(Dataset()), -1)
    with pytest.raises(ValueError, match="2.0"):
        forecast(SequentialSampler(Dataset()), 2.0)


def test_unsized_and_infinite_samplers_have_no_forecast():
    assert forecast(_InfiniteConstantSampler(), K) is None
    assert forecast(BatchSampler(_InfiniteConstantSampler(), 4, False), K) is None

    class Endless:
        def __iter__(self):
            return itertools.count()

    assert forecast(Endless(), K) is None


def test_sampler_that_raises_has_no_forecast_and_keeps_rngs():
    class Failing(SequentialSampler):
        def __iter__(self):
            torch.rand(3)
            random.random()
            np.random.rand()
            raise RuntimeError("boom")

    before = rng_states()
    assert forecast(Failing(Dataset()), K) is None
    assert_rng_states(before)


def test_global_rng_draws_in_the_copy_are_undone():
    class GlobalShuffles(SequentialSampler):
        """Draws from all three global RNGs at each iter()."""

        def __iter__(self):
            order = list(range(len(self.data_source)))
            random.shuffle(order)
            shift = int(np.random.randint(N)) + int(torch.randint(N, ()))
            return iter([(i + shift) % N for i in order])

    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    sampler = GlobalShuffles(Dataset())
    before = rng_states()
    items = forecast(sampler, K)
    assert_rng_states(before)
    assert list(sampler)[:K] == items


def test_forecast_made_before_stop_iteration_misses():
    """Why the loader forecasts after StopIteration: RandomSampler with a generator draws once
    more on its way there."""
    dataset = Dataset()
    sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(3))
    it = iter(sampler)
    for _ in range(N):
        next(it)
    early = forecast(sampler, K, dataset=dataset)
    assert next(it, None) is None
    late = forecast(sampler, K, dataset=dataset)
    following = list(sampler)
    assert late == following[:K]
    assert early != late


@pytest.mark.parametrize("a, b, equal", [
    (3, 3, True),
    (3, 4, False),
    (np.int64(3), np.int64(3), True),
    (np.int64(3), np.int64(4), False),
    (np.int64(3), 3, False),  # another kind: the dataset would be given another thing
    ([1, 2, 3], [1, 2, 3], True),
    ([1, 2, 3], [1, 2], False),
    ([1, 2, 3], [1, 2, 4], False),
    ([1, 2, 3], (1, 2, 3), False),
    ((1, 2), (1, 2), True),
    ([np.int64(1), 2], [np.int64(1), 2], True),
    (torch.tensor([1, 2]), torch.tensor([1, 2]), True),
    (torch.tensor([1, 2]), torch.tensor([1, 3]), False),
    (torch.tensor([1, 2]), torch.tensor([1, 2, 3]), False),
    (torch.tensor([1, 2]), torch.tensor([1, 2], dtype=torch.int32), False),
    (torch.tensor([1, 2]), [1, 2], False),
    (np.array([1, 2]), np.array([1, 2]), True),
    (np.array([1, 2]), np.array([2, 1]), False),
    ([torch.tensor(1), torch.tensor(2)], [torch.tensor(1), torch.tensor(2)], True),
    ("a", "a", True),
    (None, None, True),
    (None, 0, False),
])
def test_matches(a, b, equal):
    assert matches(a, b) is equal
    assert matches(b, a) is equal


def test_matches_never_raises():
    class Angry:
        def __eq__(self, other):
            raise RuntimeError("no comparing")

        __hash__ = object.__hash__

    class Vague:
        def __eq__(self, other):
            return torch.tensor([True, False])  # an ambiguous truth value

        __hash__ = object.__hash__

    assert matches(Angry(), Angry()) is False
    assert matches(Vague(), Vague()) is False
    assert matches([Angry()], [Angry()]) is False


def test_forecast_object():
    dataset = Dataset()
    sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(1))
    list(sampler)
    made = epochs.make(sampler, 4, epoch=2, dataset=dataset)
    assert isinstance(made, Forecast) and made.epoch == 2 and len(made) == 4
    real = list(sampler)
    assert [made.agrees(i, item) for i, item in enumerate(real[:6])] == [True] * 4 + [False] * 2
    assert not made.agrees(0, real[1])
    assert not made.agrees(-1, real[3])
    assert epochs.make(_InfiniteConstantSampler(), 4, epoch=0) is None


class TableSampler(torch.utils.data.Sampler):
    """Holds a large index table (4 MiB) and yields from it; with `shuffles`, shuffles it in
    place at each epoch (its own generator)."""

    def __init__(self, shuffles: bool = False):
        self.table = np.arange(N).repeat((1 << 19) // N + 1)[: 1 << 19]  # 512 Ki int64
        self.view = self.table[::2]  # a view of it, met too
        self.shuffles = shuffles
        self.rng = np.random.default_rng(0)

    def __len__(self):
        return N

    def __iter__(self):
        if self.shuffles:
            self.rng.shuffle(self.table)
        return iter(int(i) for i in self.table[:N])


def test_a_samplers_large_arrays_are_shared_read_only_not_copied():
    import tracemalloc

    sampler = TableSampler()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        items = forecast(sampler, K)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert items == list(sampler)[:K]
    assert peak < sampler.table.nbytes // 2, peak  # not copied
    assert sampler.table.flags.writeable and sampler.view.flags.writeable  # given back


def test_a_sampler_that_writes_its_large_array_is_forecast_from_a_whole_copy():
    sampler, twin = TableSampler(shuffles=True), TableSampler(shuffles=True)
    items = forecast(sampler, K)  # its copy could not shuffle the shared table: drawn again
    assert sampler.table.flags.writeable
    assert items == list(twin)[:K] == list(sampler)[:K]  # the real table was never shuffled by the forecast
