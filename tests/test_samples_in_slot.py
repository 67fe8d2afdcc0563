"""The default mode's samples born in the slot (NOTE [ Samples born in the slot ] in
shmloader/samples_in_slot.py): with torch's default_collate, a row-sized array the dataset makes
is allocated in its row of the batch's slot and not copied; the batches stay torch's, bit for
bit; a dataset that keeps what it returned (a cache) never sees those bytes written again; values
that share the slot's bytes (a view, another leaf, rows laid out for a longer batch) are copied
out before anything overwrites them."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from shmloader import ShmDataLoader, layout, torch_private
from shmloader.samples_in_slot import SamplesInSlot, row_target
from shmloader.segment import create_segment

from ._helpers import assert_same_batches, collect, seeded

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.usefixtures("no_leaks"),
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]

SHAPE = (48, 64)  # float64: 24 KiB a row, above rows.IN_PLACE_MIN_BYTES
ROW_BYTES = 48 * 64 * 8
FETCH_S = 0.002  # slow enough that a slot grant is in hand while a batch is fetched


def _values(i: int, shape=SHAPE) -> np.ndarray:
    return np.random.default_rng(i).random(shape)


def _sample(i: int, form: str):
    if form == "array":
        return _values(i)
    if form == "dict":  # the big leaf after a smaller one, whose size moves its offset with the batch's
        return {"mask": np.full(100, i % 7, np.uint8), "image": _values(i), "label": i}
    if form == "tensor":
        return torch.from_numpy(_values(i)), i
    if form == "transposed":  # a row-sized block, returned as a non-contiguous view of it
        return _values(i, SHAPE[::-1]).T
    if form == "second_first":  # leaf b's array takes leaf a's row (made first, same size)
        b = _values(i + 1000)
        a = _values(i)
        return {"a": a, "b": b}
    if form == "temporary":  # a row-sized temporary, then the result on the heap
        scratch = _values(i)
        return scratch * 2.0
    if form == "premade":
        return PREMADE[i % len(PREMADE)]
    raise AssertionError(form)


PREMADE = [_values(i) for i in range(3)]


class Made(Dataset):
    def __init__(self, n=40, form="array", fetch_s=FETCH_S):
        self.n, self.form, self.fetch_s = n, form, fetch_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.fetch_s)
        return _sample(i, self.form)


class MadeStream(IterableDataset):
    """A generator (its frame holds the sample it yielded last), split over the workers."""

    def __init__(self, n=40, form="array"):
        self.n, self.form = n, form

    def __iter__(self):
        info = get_worker_info()
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(start, self.n, step):
            time.sleep(FETCH_S)
            sample = _sample(i, self.form)
            yield sample


class Caching(Made):
    """Keeps every sample it returns, in each worker, from its `after`-th on: a dict, or
    (`form="array"`) the array itself."""

    def __init__(self, n=30, after=0, form="dict"):
        super().__init__(n, form)
        self.after, self.cache, self.made = after, {}, 0

    def __getitem__(self, i):
        if i in self.cache:
            return self.cache[i]
        time.sleep(self.fetch_s)
        self.made += 1
        sample = {"image": _values(i), "label": i} if self.form == "dict" else _values(i)
        if self.made > self.after:
            self.cache[i] = sample
        return sample


def _run(dataset, **kwargs):
    """(the batches, stats().in_place_bytes) of one epoch of 2 workers, and torch's batches."""
    kwargs.setdefault("batch_size", 6)
    it = iter(ShmDataLoader(dataset, num_workers=2, **kwargs))
    got = collect(it)
    in_place = it.stats().in_place_bytes
    del it
    generator = kwargs.pop("generator", None)
    if generator is not None:
        kwargs["generator"] = seeded(generator.initial_seed())
    return got, in_place, collect(DataLoader(dataset, num_workers=2, **kwargs))


# -- through the loader ----------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["array", "dict", "tensor"])
def test_rows_made_by_the_dataset_are_born_in_the_slot(form):
    got, in_place, want = _run(Made(40, form))
    assert_same_batches(got, want)
    # Sample 0 of each batch is fetched first, to learn where the rows go; later rows are born
    # in the slot once a grant is in hand, which it is after the first batches.
    assert 0 < in_place <= (40 - 7) * ROW_BYTES
    assert in_place % ROW_BYTES == 0


def test_a_generator_stream_stays_in_place_across_batches():
    got, in_place, want = _run(MadeStream(48, "dict"))
    assert_same_batches(got, want)
    # Each of the 8 batches: rows 1-4 may be born in place (the last is fetched on the heap);
    # more than one batch's worth per worker means the generator's frame did not read as a cache.
    assert 2 * 4 * ROW_BYTES < in_place <= 8 * 4 * ROW_BYTES


def test_an_iterable_end_with_drop_last_gives_its_grant_back():
    """48 samples in batches of 7 over 2 workers: each worker's stream ends with a short batch
    that drop_last discards after its rows were fetched into a granted slot."""
    got, _, want = _run(MadeStream(48, "dict"), batch_size=7, drop_last=True)
    assert_same_batches(got, want)
    loader = ShmDataLoader(MadeStream(48, "dict"), num_workers=2, batch_size=7, drop_last=True,
                           persistent_workers=True, max_ring_slots=3)
    for _ in range(3):  # a grant lost at each stream's end would starve a 3-slot ring
        assert_same_batches(collect(loader), want)
    del loader


@pytest.mark.parametrize("form", ["transposed", "second_first", "temporary"])
def test_values_sharing_the_slots_bytes_are_copied_right(form):
    got, _, want = _run(Made(30, form), shuffle=True, generator=seeded(3))
    assert_same_batches(got, want)


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_in_place_with_other_start_methods(start_method):
    got, in_place, want = _run(Made(24, "dict"), multiprocessing_context=start_method)
    assert_same_batches(got, want)
    assert in_place > 0


def test_off_with_the_arena_switch(monkeypatch):
    monkeypatch.setenv("SHMLOADER_SLOT_ARENA", "0")
    got, in_place, want = _run(Made(24))
    assert in_place == 0
    assert_same_batches(got, want)


def test_arrays_made_before_the_fetch_are_copied():
    got, in_place, want = _run(Made(24, "premade"))
    assert in_place == 0
    assert_same_batches(got, want)


def test_a_dataset_with_getitems_gets_the_whole_batch_as_before():
    class Batched(Made):
        def __getitems__(self, indices):
            return [_sample(i, "array") for i in indices]

    got, in_place, want = _run(Batched(24))
    assert in_place == 0
    assert_same_batches(got, want)


@pytest.mark.parametrize("after", [0, 3])  # every sample kept; kept only after each worker's first 3
def test_a_caching_dataset_keeps_its_samples_intact(after):
    """Three epochs on persistent workers over a small ring: the cache's arrays, returned again in
    epochs 2 and 3, would hold other batches' bytes had their slot been written again."""
    kwargs = dict(batch_size=6, shuffle=True, num_workers=2, persistent_workers=True)
    loader = ShmDataLoader(Caching(30, after), generator=seeded(5), max_ring_slots=3, **kwargs)
    reference = DataLoader(Caching(30, after), generator=seeded(5), **kwargs)
    for _ in range(3):
        assert_same_batches(collect(loader), collect(reference))
    del loader, reference


def test_a_failing_sample_after_allocating_its_row():
    class FailsAt(Made):
        def __getitem__(self, i):
            image = _values(i)
            if i == 15:
                raise ValueError(f"bad sample {i} ({image.shape})")
            time.sleep(FETCH_S)
            return image

    loader = ShmDataLoader(FailsAt(30), batch_size=6, num_workers=2, persistent_workers=True, max_ring_slots=3)
    want = collect(DataLoader(Made(30), batch_size=6))
    for _ in range(2):
        good = []
        with pytest.raises(ValueError, match="bad sample 15"):
            for batch in loader:
                good.append(batch.clone())
        assert len(good) == 2
        assert_same_batches(good + collect(loader._iterator), want[:2] + want[3:])  # the epoch goes on
    del loader


# -- the pieces, without a loader --------------------------------------------------------------------


class _OneSlotWorker:
    """What SamplesInSlot asks of a worker: its fetcher, and a grant of one slot, always in hand."""

    def __init__(self, dataset, kind=torch_private.DatasetKind.Map, size=4 << 20):
        self.fetcher = torch_private.create_fetcher(kind, dataset, True, lambda samples: samples, False)
        self.segment = create_segment(size, 1)

    def grant_now(self):
        return (0, 1, self.segment.size, 0)

    def segment_for(self, grant, min_bytes):
        return self.segment, None


def _fetch_and_write(dataset, index, kind=torch_private.DatasetKind.Map):
    """Fetch `index` with rows in the slot and write the batch as the worker does: (the batch read
    back as numpy leaves by path, bytes found in place, blocks left alive)."""
    worker = _OneSlotWorker(dataset, kind)
    in_slot = SamplesInSlot(kind == torch_private.DatasetKind.Iterable)
    samples = in_slot.fetch(worker, index)
    plan = layout.plan_batch(layout.collate_into_slot(samples))
    segment = worker.segment
    assert segment.claim(0, 0) == layout._ring.FREE
    in_place = layout.write_batch(segment, plan, in_slot.fetched_in_slot)
    got = {}
    for offset, leaf in plan.leaves:  # each leaf's bytes where the plan put them
        count = leaf.nbytes // leaf.dtype.itemsize if type(leaf) is layout.StackedLeaf else leaf.numel()
        written = torch.frombuffer(segment, dtype=leaf.dtype, count=count, offset=offset)
        got[len(got)] = written.reshape(leaf.shape).numpy().copy()
        del written
    del samples, plan, leaf
    kept = in_slot.settle()
    segment.release()
    del worker, segment, in_slot
    gc.collect()
    return got, in_place, kept


def _expected(form, indices):
    batch = torch.utils.data.default_collate([_sample(i, form) for i in indices])
    leaves = [leaf for _, leaf in layout.iter_leaves(batch) if isinstance(leaf, torch.Tensor)]
    return {k: leaf.numpy() for k, leaf in enumerate(leaves)}


@pytest.mark.parametrize("form,rows_in_place", [
    ("array", 5), ("dict", 5), ("tensor", 5), ("transposed", 0), ("second_first", 0), ("temporary", 0),
])
def test_rows_are_written_right_and_only_those_in_place_are_skipped(form, rows_in_place):
    got, in_place, kept = _fetch_and_write(Made(6, form, fetch_s=0), list(range(6)))
    want = _expected(form, range(6))
    assert list(got) == list(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    assert in_place == rows_in_place * ROW_BYTES
    assert kept == 0


def test_rows_fetched_for_a_longer_batch_are_copied_out_first():
    """An iterable that ends after 4 of 6 samples: the rows were born where a batch of 6 puts
    them, the short batch's image leaf starts elsewhere, so each is moved through a copy."""
    class Four(IterableDataset):
        def __iter__(self):
            return (_sample(i, "dict") for i in range(4))

    got, in_place, kept = _fetch_and_write(Four(), list(range(6)), torch_private.DatasetKind.Iterable)
    want = _expected("dict", range(4))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    assert in_place == 0 and kept == 0
    assert row_target(_sample(0, "dict"), 6).offset != row_target(_sample(0, "dict"), 4).offset


def test_a_kept_sample_is_reported():
    cache = []

    class Keeps(Made):
        def __getitem__(self, i):
            sample = _values(i)
            cache.append(sample)
            return sample

    got, in_place, kept = _fetch_and_write(Keeps(6), list(range(6)))
    assert kept == 5 and in_place == 5 * ROW_BYTES
    np.testing.assert_array_equal(got[0], np.stack([_values(i) for i in range(6)]))
    np.testing.assert_array_equal(np.stack(cache), np.stack([_values(i) for i in range(6)]))
    cache.clear()


def test_heap_memory_of_rows_fetched_before_a_grant_goes_back_once_batches_are_in_place(monkeypatch):
    """Rows fetched while no grant is in hand (start-up: the ring's slots still being made) leave
    a batch's worth of free memory on the worker's heap, which heap.keep_freed_memory keeps: in a
    new-user check, 8 MiB in each worker for the rest of the run (batches of 64 images).  Once
    RELEASE_AFTER batches come wholly in place it goes back, once; a worker that keeps fetching
    on the heap keeps it."""
    from shmloader import samples_in_slot

    released = []
    monkeypatch.setattr(samples_in_slot.heap, "release_free_memory", lambda: released.append(1))
    worker = _OneSlotWorker(Made(6, "array", fetch_s=0))
    granted = worker.grant_now
    in_slot = SamplesInSlot(False)

    def batch(with_grant: bool):
        worker.grant_now = granted if with_grant else (lambda: None)
        samples = in_slot.fetch(worker, list(range(6)))
        del samples
        in_slot.settle()
        in_slot.after_batch()

    batch(False)  # on the heap
    batch(True)
    assert released == []
    batch(True)
    assert released == [1]  # two batches in place in a row
    batch(True)
    assert released == [1]  # nothing more to give back
    for with_grant in (False, True) * 3:  # the heap keeps being needed: it is kept
        batch(with_grant)
    assert released == [1]
    worker = in_slot = None  # the segment goes
    gc.collect()


def test_small_samples_get_no_target():
    assert row_target(np.zeros(100), 8) is None
    assert row_target((np.zeros(8), 3), 8) is None
    target = row_target((np.zeros(8), torch.zeros(4096, dtype=torch.float64)), 8)
    assert target.row_nbytes == 4096 * 8


@pytest.mark.parametrize("kind", ["map", "iterable", "iterable_drop_last"])
def test_fetch_each_matches_torchs_fetcher(kind):
    """torch_private.fetch_each makes the calls torch's fetcher makes: the same samples, the same
    end of an iterable (StopIteration where torch raises it, `ended` set)."""
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(10))

    drop_last = kind == "iterable_drop_last"
    dataset_kind = torch_private.DatasetKind.Map if kind == "map" else torch_private.DatasetKind.Iterable
    dataset = list(range(10)) if kind == "map" else Stream()
    ours = torch_private.create_fetcher(dataset_kind, dataset, True, lambda s: s, drop_last)
    theirs = torch_private.create_fetcher(dataset_kind, dataset, True, lambda s: s, drop_last)
    asked = []
    for index in ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 2, 3], [1, 2]):
        try:
            want = theirs.fetch(index)
        except StopIteration:
            with pytest.raises(StopIteration):
                torch_private.fetch_each(ours, index, lambda k, fetched: asked.append((k, len(fetched))))
            continue
        assert torch_private.fetch_each(ours, index, lambda k, fetched: asked.append((k, len(fetched)))) == want
        if kind != "map":
            assert ours.ended == theirs.ended
    assert asked[:4] == [(0, 0), (1, 1), (2, 2), (3, 3)]


# -- a custom collate_fn that passes the samples through -------------------------------------------


def records(samples):
    """The forum's collate_fn: the records as they are."""
    return samples


def keyed(samples):
    return {"images": list(samples), "count": len(samples)}


def np_stack(samples):
    return np.stack(samples)


class WithTemporaries(Made):
    """Each sample made through a row-sized temporary: the arena fills with dead blocks."""

    def __getitem__(self, i):
        time.sleep(self.fetch_s)
        return _values(i) * 2.0


def _in_place_after_learning(total_rows: int, batches: int) -> int:
    """At most: every row but those of each worker's first (watched) batch."""
    return (total_rows - 2 * batches) * ROW_BYTES


@pytest.mark.parametrize("collate_fn", [records, keyed])
@pytest.mark.parametrize("dataset", ["map", "stream"])
def test_a_collate_fn_passing_samples_through_gets_them_born_in_the_slot(collate_fn, dataset):
    data = Made(48) if dataset == "map" else MadeStream(48)
    got, in_place, want = _run(data, collate_fn=collate_fn)
    assert_same_batches(got, want)
    assert 0 < in_place <= _in_place_after_learning(48, 6)


def test_np_stack_is_built_in_the_slot_as_before():
    got, in_place, want = _run(Made(36), collate_fn=np_stack)
    assert_same_batches(got, want)
    assert in_place > 0  # the stacked array, born in the collate_fn's arena


def test_temporaries_in_the_arena_neither_corrupt_nor_grow_the_slot():
    """Half of each sample's blocks are dead temporaries: a batch fetched in the arena does not fit
    the slot as laid out there, is laid out from the slot's start instead, and the worker stops
    fetching in the arena."""
    it = iter(ShmDataLoader(WithTemporaries(36), batch_size=6, num_workers=2, collate_fn=records))
    got = collect(it)
    stats = it.stats()
    del it
    assert_same_batches(got, collect(DataLoader(WithTemporaries(36), batch_size=6, num_workers=2, collate_fn=records)))
    assert stats.slot_grows == 0


@pytest.mark.parametrize("after", [6, 12])
def test_a_caching_dataset_with_a_records_collate_keeps_its_samples_intact(after):
    kwargs = dict(batch_size=6, shuffle=True, num_workers=2, persistent_workers=True, collate_fn=records)
    loader = ShmDataLoader(Caching(30, after, "array"), generator=seeded(7), max_ring_slots=3, **kwargs)
    reference = DataLoader(Caching(30, after, "array"), generator=seeded(7), **kwargs)
    for _ in range(3):
        assert_same_batches(collect(loader), collect(reference))
    del loader, reference


def test_a_collate_fn_that_stops_passing_samples_through():
    """Records for the first batches, then a stacked array: still torch's batches, no growth."""
    class Switching:
        def __init__(self):
            self.calls = 0

        def __call__(self, samples):
            self.calls += 1
            return samples if self.calls <= 3 else np.stack(samples)

    it = iter(ShmDataLoader(Made(60), batch_size=6, num_workers=2, collate_fn=Switching()))
    got = collect(it)
    assert it.stats().slot_grows == 0
    del it
    assert_same_batches(got, collect(DataLoader(Made(60), batch_size=6, num_workers=2, collate_fn=Switching())))


class CachingFailsAt(Caching):
    """Keeps every array it returns; index 17 raises the first time, after the others of its
    batch are kept (the next epochs return them from the cache)."""

    failed = False

    def __getitem__(self, i):
        if i == 17 and not self.failed:
            self.failed = True
            raise ValueError("bad sample 17")
        return super().__getitem__(i)


@pytest.mark.parametrize("collate_fn", [None, records])
def test_a_failed_batch_whose_rows_a_cache_keeps_leaves_its_slot_to_the_cache(collate_fn):
    """Batch 2 fails at its last sample after rows 12-16 were born in its slot and cached: that
    slot must not be written again while the cache returns those arrays in the next epochs."""
    kwargs = dict(batch_size=6, num_workers=2, persistent_workers=True)
    if collate_fn is not None:
        kwargs["collate_fn"] = collate_fn
    # Each worker caches from its 7th sample on: worker 0's batch 2 (indices 12-17) is fetched
    # in its slot, as its batch 0 went through without a cache.
    loader = ShmDataLoader(CachingFailsAt(30, 6, "array"), max_ring_slots=3, **kwargs)
    reference = DataLoader(CachingFailsAt(30, 6, "array"), **kwargs)
    batches = []
    for source in (loader, reference):
        got, it = [], iter(source)
        with pytest.raises(ValueError, match="bad sample 17"):
            for batch in it:
                got.append(copy_of(batch))
        got += [copy_of(batch) for batch in it]
        batches.append(got)
    assert_same_batches(*batches)
    for _ in range(2):  # batch 2 whole now: rows 12-16 from the cache
        assert_same_batches(collect(loader), collect(reference))
    del loader, reference, it


def copy_of(batch):
    import copy

    return copy.deepcopy(batch)


# -- a collate_fn that returns its argument: no watching ---------------------------------------------

BIG_SHAPE = (512, 768)  # 3 MiB a sample: a batch of 4 is above worker.GUESS_MIN_BYTES


identity_lambda = lambda samples: samples  # noqa: E731  (as users write it)


def _records_with_a_default(samples, unused=None):
    return samples


def _returns_a_list(samples):
    return list(samples)


def _sorts_then_returns(samples):
    samples.sort(key=len)
    return samples


def _returns_the_second(first, second=None):
    return second


@pytest.mark.parametrize("function, expected", [
    (records, True), (identity_lambda, True), (_records_with_a_default, True),
    (_returns_a_list, False), (_sorts_then_returns, False), (_returns_the_second, False),
    (keyed, False), (np_stack, False), (list, False), (lambda: None, False),
])
def test_returns_its_argument(function, expected):
    from shmloader.samples_in_slot import returns_its_argument

    assert returns_its_argument(function) is expected


class BigMade(Made):
    def __getitem__(self, i):
        time.sleep(self.fetch_s)
        return _values(i, BIG_SHAPE)


class BigCaching(BigMade):
    def __init__(self, n):
        super().__init__(n)
        self.cache = {}

    def __getitem__(self, i):
        if i not in self.cache:
            self.cache[i] = super().__getitem__(i)
        return self.cache[i]


@pytest.mark.parametrize("collate_fn", [records, identity_lambda])
def test_a_collate_fn_returning_its_argument_gets_the_first_batch_born_in_the_slot(collate_fn):
    """One batch per worker: with a collate_fn that returns its argument the samples after sample
    0 are born in the slot from the first batch on (nothing watched on the heap), where a
    collate_fn that passes them through in a new list has its first batches watched, copied."""
    sample_bytes = int(np.prod(BIG_SHAPE)) * 8
    got, in_place, want = _run(BigMade(8), batch_size=4, collate_fn=collate_fn)
    assert_same_batches(got, want)
    # Each worker's one batch: samples 1-3 in place once its slot grant is in hand (at once, but
    # asked for before each sample, never waited for: on a loaded machine it may come late).
    assert 0 < in_place <= 2 * 3 * sample_bytes and in_place % sample_bytes == 0
    got, in_place, want = _run(BigMade(8), batch_size=4, collate_fn=_returns_a_list)
    assert_same_batches(got, want)
    assert in_place == 0


def test_a_cache_of_first_batch_samples_born_in_the_slot_stays_intact():
    """The dataset keeps every sample it returns, the first batch's born in its slot included:
    those slots are left to the cache (the batch moved), and later epochs still return them."""
    kwargs = dict(batch_size=4, num_workers=2, persistent_workers=True, collate_fn=records)
    loader = ShmDataLoader(BigCaching(16), max_ring_slots=3, **kwargs)
    reference = DataLoader(BigCaching(16), **kwargs)
    for _ in range(3):
        assert_same_batches(collect(loader), collect(reference))
    del loader, reference


class Uneven(Dataset):
    """Samples whose sizes differ from sample 0's: the first batch's slot, sized by sample 0, is
    too small ("grows") or far too large ("shrinks") for the samples after it."""

    def __init__(self, how: str, n: int = 12):
        self.how, self.n = how, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        rows = {"grows": 384 + 256 * (i % 4), "shrinks": 512 if i % 4 == 0 else 8}[self.how]
        return {"x": _values(i, (rows, 768)), "id": i}


@pytest.mark.parametrize("how", ["grows", "shrinks"])
def test_a_first_batch_in_the_arena_unlike_its_sample_0_is_still_torchs(how):
    got, _, want = _run(Uneven(how), batch_size=4, collate_fn=records)
    assert_same_batches(got, want)
