"""sample_parallel's rows born in place (NOTE [ Rows born in place ] in shmloader/sample_parallel.py):
a row-sized array the dataset makes is allocated in its row of the slot and not copied; the
batches stay torch's, bit for bit; a dataset that keeps what it returned (a cache) never sees
those bytes written again; values that share the row's bytes (a view, another leaf) are copied
out before anything overwrites them."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from shmloader import ShmDataLoader, layout, rows
from shmloader._ring import SlotArena
from shmloader.segment import create_segment

from ._helpers import assert_same_batches, collect, seeded

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.usefixtures("no_leaks"),
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]

SHAPE = (48, 64)  # float64: 24 KiB a row, above rows.IN_PLACE_MIN_BYTES
ROW_BYTES = 48 * 64 * 8


def _values(i: int, shape=SHAPE) -> np.ndarray:
    return np.random.default_rng(i).random(shape)


class Made(Dataset):
    """Each sample's array made by the dataset (the case the arena serves), in several forms."""

    def __init__(self, n=40, form="array"):
        self.n, self.form = n, form

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.form == "array":
            return _values(i)
        if self.form == "dict":
            return {"image": _values(i), "label": i, "mask": np.full(4, i % 7, np.uint8)}
        if self.form == "tensor":
            return torch.from_numpy(_values(i)), i
        if self.form == "transposed":  # a row-sized block, returned as a non-contiguous view of it
            return _values(i, SHAPE[::-1]).T
        if self.form == "second_first":  # leaf b's array takes leaf a's row (made first, same size)
            b = _values(i + 1000)
            a = _values(i)
            return {"a": a, "b": b}
        if self.form == "temporary":  # a row-sized temporary, then the result on the heap
            scratch = _values(i)
            return scratch * 2.0
        raise AssertionError(self.form)


class Caching(Dataset):
    """Keeps the samples it returns, in each worker: every one (`after=0`), or only those it
    makes after its first `after` (so the probe passes and a later row is kept)."""

    def __init__(self, n=40, after=0):
        self.n, self.after, self.cache, self.made = n, after, {}, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.cache:
            return self.cache[i]
        self.made += 1
        sample = {"image": _values(i), "label": i}
        if self.made > self.after:
            self.cache[i] = sample
        return sample


def _loader(dataset, **kwargs):
    return ShmDataLoader(dataset, batch_size=6, num_workers=2, sample_parallel=True, **kwargs)


@pytest.mark.parametrize("form", ["array", "dict", "tensor"])
def test_rows_made_by_the_dataset_are_not_copied(form):
    loader = _loader(Made(40, form))
    it = iter(loader)
    got = collect(it)
    stats = it.stats()
    assert_same_batches(got, collect(DataLoader(Made(40, form), batch_size=6, num_workers=2)))
    # Every row but the one the schema is learnt from and each worker's probe is born in place.
    assert stats.in_place_bytes == (40 - 1 - 2) * ROW_BYTES
    del it, loader


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_in_place_with_other_start_methods(start_method):
    it = iter(_loader(Made(18, "dict"), multiprocessing_context=start_method))
    got = collect(it)
    assert it.stats().in_place_bytes == (18 - 1 - 2) * ROW_BYTES
    assert_same_batches(got, collect(DataLoader(Made(18, "dict"), batch_size=6)))
    del it


def test_off_with_the_arena_switch(monkeypatch):
    monkeypatch.setenv("SHMLOADER_SLOT_ARENA", "0")
    it = iter(_loader(Made(12)))
    got = collect(it)
    assert it.stats().in_place_bytes == 0
    assert_same_batches(got, collect(DataLoader(Made(12), batch_size=6)))
    del it


@pytest.mark.parametrize("form", ["transposed", "second_first", "temporary"])
def test_values_sharing_the_rows_bytes_are_copied_right(form):
    got = collect(_loader(Made(30, form), shuffle=True, generator=seeded(3)))
    assert_same_batches(got, collect(DataLoader(Made(30, form), batch_size=6, shuffle=True, generator=seeded(3))))


@pytest.mark.parametrize("after", [0, 3])  # every sample kept (the probe sees it); kept later (Kept)
def test_a_caching_dataset_keeps_its_samples_intact(after):
    """Three epochs on persistent workers over a small ring: the cache's arrays, returned again in
    epochs 2 and 3, would hold other rows' bytes had their slot been written again."""
    loader = _loader(Caching(30, after), shuffle=True, generator=seeded(5), persistent_workers=True,
                     max_ring_slots=3, prefetch_factor=2)
    reference = DataLoader(Caching(30, after), batch_size=6, shuffle=True, generator=seeded(5), num_workers=2,
                           persistent_workers=True)
    for _ in range(3):
        assert_same_batches(collect(loader), collect(reference))
    in_place = loader._iterator.stats().in_place_bytes
    if after == 0:
        assert in_place == 0  # the probe found the cache: nothing is fetched in place
    else:
        assert 0 < in_place <= 2 * after * ROW_BYTES  # until a worker's first kept row
    del loader, reference


def test_a_rejected_row_born_in_place_does_not_stop_the_rest():
    """Index 13 is born in its row (complex64: the row's size) but has a dtype torch's stack
    cannot cast into the batch's float64: its batch raises torch's error type, and the worker
    goes on fetching in place (the rejected sample is not a 'kept' one)."""
    class WrongDtypeAt(Made):
        def __getitem__(self, i):
            if i == 13:
                return np.random.default_rng(i).random(SHAPE).astype(np.complex64)
            return _values(i)

    it = iter(_loader(WrongDtypeAt(30)))
    got = []
    with pytest.raises((TypeError, RuntimeError), match=r"\(sample 1\).*can't be cast"):
        for batch in it:
            got.append(batch.clone())
    got += [batch.clone() for batch in it]
    want = collect(DataLoader(Made(30), batch_size=6))
    assert_same_batches(got, want[:2] + want[3:])
    # All rows but the learnt one, the two probes and batch 2's failed chunk (rows 12-14).
    assert it.stats().in_place_bytes == (30 - 1 - 2 - 3) * ROW_BYTES
    del it


def test_a_failing_sample_after_allocating_its_row():
    class FailsAt(Made):
        def __getitem__(self, i):
            image = _values(i)
            if i == 13:
                raise ValueError(f"bad sample {i} ({image.shape})")
            return image

    it = iter(_loader(FailsAt(30)))
    good = []
    with pytest.raises(ValueError, match="bad sample 13"):
        for batch in it:
            good.append(batch.clone())
    assert len(good) == 2
    rest = [batch.clone() for batch in it]  # the epoch goes on
    want = collect(DataLoader(Made(30), batch_size=6))
    assert_same_batches(good + rest, want[:2] + want[3:])
    del it


# -- write_row and the exact arena, without a loader ---------------------------------------------------


def _claimed(schema):
    segment = create_segment(schema.total_bytes, 0)
    assert segment.claim(0, 0) == layout._ring.FREE
    return segment


def _row(segment, leaf, row):
    return np.frombuffer(segment, np.uint8, leaf.row_nbytes, leaf.offset + row * leaf.row_nbytes)


def test_exact_arena_hands_out_its_row_once_and_touches_nothing_else():
    schema = rows.learn_schema({"a": _values(0), "b": _values(1)}, 4)
    leaf = schema.in_place_leaf
    assert leaf.path == "batch['a']"
    segment = _claimed(schema)
    before = _row(segment, leaf, 1).copy()
    before[:] = 0xAB
    _row(segment, leaf, 1)[:] = before  # row 1's bytes: an exact arena over row 2 must not touch them
    at = leaf.offset + 2 * leaf.row_nbytes
    arena = SlotArena(segment, at, 0, at + leaf.row_nbytes, True)
    with arena:
        smaller = np.empty(SHAPE[0] * SHAPE[1] - 1)
        first = _values(2)
        second = _values(3)
    address = segment.address + at
    assert first.__array_interface__["data"][0] == address
    assert smaller.__array_interface__["data"][0] != address and second.__array_interface__["data"][0] != address
    np.testing.assert_array_equal(_row(segment, leaf, 1), before)  # no size prefix before the row
    assert arena.live == 1
    first.resize((SHAPE[0] + 1, SHAPE[1]), refcheck=False)  # numpy's realloc: moved to the heap whole
    assert first.__array_interface__["data"][0] != address and arena.live == 0
    np.testing.assert_array_equal(first[:SHAPE[0]], _values(2))
    del first, smaller, second
    assert arena.release() == 0
    del segment
    gc.collect()


def _written(schema, samples_by_row):
    segment = _claimed(schema)
    leaf = schema.in_place_leaf
    in_place = 0
    for row, make in samples_by_row.items():
        at = leaf.offset + row * leaf.row_nbytes
        arena = SlotArena(segment, at, 0, at + leaf.row_nbytes, True)
        with arena:
            sample = make()
        in_place += rows.write_row(segment, schema, row, sample, born_in_row=True)
        del sample
        assert arena.release() == 0
    rows.publish_batch(segment, schema)
    return segment, in_place


def test_write_row_skips_a_leaf_in_place_and_copies_out_what_shares_the_row():
    schema = rows.learn_schema({"a": _values(0), "b": _values(1), "n": 1}, 3)

    def in_place():
        return {"a": _values(10), "b": _values(11), "n": 10}

    def b_in_a_row():
        b = _values(21)
        return {"a": _values(20), "b": b, "n": 20}

    def view_of_a_row():
        a = _values(31, SHAPE[::-1])
        return {"a": a.T, "b": a.T, "n": 30}

    segment, done = _written(schema, {0: in_place, 1: b_in_a_row, 2: view_of_a_row})
    assert done == ROW_BYTES  # row 0's "a" only
    leaves = {leaf.path: leaf for leaf in schema.leaves}

    def value(path, row, shape=SHAPE, segment=segment):
        leaf = leaves[path]
        return np.frombuffer(segment, np.float64, SHAPE[0] * SHAPE[1], leaf.offset + row * leaf.row_nbytes).reshape(shape)

    np.testing.assert_array_equal(value("batch['a']", 0), _values(10))
    np.testing.assert_array_equal(value("batch['b']", 0), _values(11))
    np.testing.assert_array_equal(value("batch['a']", 1), _values(20))
    np.testing.assert_array_equal(value("batch['b']", 1), _values(21))
    np.testing.assert_array_equal(value("batch['a']", 2), _values(31, SHAPE[::-1]).T)
    np.testing.assert_array_equal(value("batch['b']", 2), _values(31, SHAPE[::-1]).T)
    del segment, value
    gc.collect()


def test_small_rows_get_no_arena():
    assert rows.learn_schema(np.zeros(100), 8).in_place_leaf is None
    assert rows.learn_schema((np.zeros(8), 3), 8).in_place_leaf is None
    big = rows.learn_schema((np.zeros(8), torch.zeros(4096, dtype=torch.float64)), 8)
    assert big.in_place_leaf.kind == "tensor"

