"""Leases, ring growth, slot sizes, zero copy and control bytes of ShmDataLoader.

A slot is reused only when nothing of its batch is referenced in the main process; held batches
stay intact (the ring detaches their slots, see tests/test_held_batches.py); a cap the user sets
raises RingFullError; delivered
leaves are views into ring slots; control messages do not grow with the batch's bytes.
"""

from __future__ import annotations

import gc
import time
import weakref

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import shmloader.layout
from shmloader import RingFullError, ShmDataLoader
from shmloader._ring import SlotLease

from . import _datasets as ds
from ._helpers import (
    address_of,
    array_leaves,
    assert_same,
    assert_same_batches,
    collect,
    in_ring,
    nbytes_of,
    seeded,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leaks")]

WORKERS, PREFETCH = 2, 2
DEPTH = WORKERS * PREFETCH + 2  # NOTE [ Ring size ]: in flight + CONSUMER_SLOTS


def _slot_of(iterator, leaf) -> int:
    """The ring slot whose segment holds `leaf`'s memory."""
    for slot, segment in enumerate(iterator._ring._segments):
        if segment is not None and segment.address <= address_of(leaf) < segment.address + segment.size:
            return slot
    raise AssertionError("leaf is not in any slot")


def _leased(iterator, slot: int) -> bool:
    """Whether `slot` is still leased (results waiting in the reorder buffer are leased too, so
    the ring's total says little: this looks at one slot)."""
    iterator._ring.collect_released()
    return iterator._ring._states[slot] == "leased"


# -- held batches ---------------------------------------------------------------------------------


def test_held_batches_stay_intact_and_their_slots_are_detached():
    """A loop that appends every batch to a list (more than the ring's depth) finds them all
    intact, through a second epoch on the same persistent ring."""
    dataset = ds.ArrayDataset(n=20, nbytes=4096)
    shm = ShmDataLoader(dataset, batch_size=2, shuffle=True, generator=seeded(1), num_workers=WORKERS,
                        prefetch_factor=PREFETCH, persistent_workers=True)
    ref = DataLoader(dataset, batch_size=2, shuffle=True, generator=seeded(1), num_workers=WORKERS,
                     prefetch_factor=PREFETCH, persistent_workers=True)
    held = list(shm)  # 10 batches > DEPTH - in flight
    stats = shm.stats()
    assert stats.detached > 0 and stats.ring_slots == DEPTH and stats.held_segments > 0, stats
    want_first = collect(ref)
    assert_same_batches(held, want_first)
    second = collect(shm)  # the next epoch must not write into any held slot
    assert_same_batches(second, collect(ref))
    assert_same_batches(held, want_first)
    del held, second, shm


def test_dropped_batches_free_their_slots_and_the_ring_stays_small():
    shm = ShmDataLoader(ds.ArrayDataset(n=120, nbytes=2048), batch_size=2, num_workers=WORKERS,
                        prefetch_factor=PREFETCH)
    for i, batch in enumerate(shm):
        assert int(batch[0, 0]) == 2 * i
    stats = shm.stats()
    assert stats.batches == 60
    # `batch` still holds the last one (held now, the ring being gone); nothing was detached
    assert stats.detached == 0 and stats.held_segments == 1 and stats.ring_slots == DEPTH, stats
    del batch
    gc.collect()
    assert shm.stats().held_segments == 0


class _RowsOfOnes(torch.utils.data.Dataset):
    """Rows of `row_bytes` (float32 ones, made once per row index) for large slots."""

    def __init__(self, n: int, rows: int, row_bytes: int):
        self.n, self.rows = n, [np.full(row_bytes // 4, i, np.float32) for i in range(rows)]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.rows[i % len(self.rows)]


@pytest.mark.parametrize("row_bytes", [9 << 18, 3 << 18], ids=["36MiB", "12MiB"])
def test_a_loop_slower_than_its_workers_keeps_the_ring_at_what_is_in_flight(row_bytes):
    """NOTE [ Slots the loop gives back ]: with large slots (above WAIT_MIN_SLOT_BYTES, also
    below AHEAD_MAX_SLOT_BYTES) and a loop that reads every byte (slower than 2 workers that
    copy), the ring holds the batches in flight and the one in the loop's hand (prefetch_factor
    x num_workers + 1), not one more for the batch that the loop still holds while next() hands
    it the next one."""
    rows = 16
    shm = ShmDataLoader(_RowsOfOnes(40 * rows, rows, row_bytes), batch_size=rows,
                        num_workers=WORKERS, prefetch_factor=PREFETCH)
    slots = []
    for batch in shm:
        assert float(batch.sum(dtype=torch.float64)) == sum(range(rows)) * row_bytes // 4  # every byte
        time.sleep(0.01)  # and computes a little
        slots.append(shm.stats().reserved_bytes // shm.stats().slot_bytes)
    assert len(slots) == 40
    assert max(slots) <= WORKERS * PREFETCH + 1, slots


def test_with_prefetch_next_epoch_only_slots_above_32_mib_wait_for_the_loop():
    """NOTE [ Slots the loop gives back ]: workers that must start the next epoch's batches
    before the epoch ends are not made to wait for the slots of 8-32 MiB batches."""
    from shmloader.scheduler import (
        ACROSS_EPOCHS_WAIT_MIN_SLOT_BYTES,
        AHEAD_MAX_SLOT_BYTES,
        WAIT_MIN_SLOT_BYTES,
    )

    assert WAIT_MIN_SLOT_BYTES < 3 << 22 < ACROSS_EPOCHS_WAIT_MIN_SLOT_BYTES == AHEAD_MAX_SLOT_BYTES
    rows, row_bytes = 16, 3 << 18  # 12 MiB batches
    dataset = _RowsOfOnes(4 * rows, rows, row_bytes)
    for ahead, large in ((False, True), (True, False)):
        shm = ShmDataLoader(dataset, batch_size=rows, num_workers=WORKERS, prefetch_factor=PREFETCH,
                            persistent_workers=True, prefetch_next_epoch=ahead)
        it = iter(shm)
        next(it)
        assert it._scheduler.large_slots is large
        del it, shm


class _SlowRows(_RowsOfOnes):
    """_RowsOfOnes whose samples take `sample_s` each to fetch (a sleep): workers slower than the loop."""

    def __init__(self, n: int, rows: int, row_bytes: int, sample_s: float):
        super().__init__(n, rows, row_bytes)
        self.sample_s = sample_s

    def __getitem__(self, i):
        time.sleep(self.sample_s)
        return super().__getitem__(i)


@pytest.mark.timeout(120)
def test_a_loop_faster_than_its_workers_makes_no_slot_for_the_batch_it_still_holds():
    """NOTE [ Slots the loop gives back ]: when the loop waits for its workers, a worker that
    finishes while next() hands the loop a batch gets the slot of the loop's previous batch at
    its next call, not a new segment: the ring stays at a slot per worker, the loop's batch and
    one finished early (num_workers + 2), and the main process makes no segment for a slot
    that comes back a step later."""
    rows, row_bytes = 8, 9 << 19  # 36 MiB batches: above AHEAD_MAX_SLOT_BYTES
    shm = ShmDataLoader(_SlowRows(120 * rows, rows, row_bytes, 0.002), batch_size=rows,
                        num_workers=WORKERS, prefetch_factor=PREFETCH)
    slots = []
    for batch in shm:
        assert float(batch[-1, -1]) == rows - 1
        slots.append(shm.stats().reserved_bytes // shm.stats().slot_bytes)
    assert len(slots) == 120
    assert max(slots) <= WORKERS + 2, slots


def test_holding_past_the_cap_raises_ring_full_error():
    shm = ShmDataLoader(ds.ArrayDataset(n=40, nbytes=1024), batch_size=2, num_workers=WORKERS,
                        prefetch_factor=PREFETCH, max_ring_slots=DEPTH + 1)
    held = []
    with pytest.raises(RingFullError, match="max_ring_slots"):
        for batch in shm:
            held.append(batch)
    assert DEPTH <= len(held) < 20
    for i, batch in enumerate(held):  # what was delivered is still intact
        assert torch.equal(batch[:, 0], torch.tensor([2.0 * i, 2.0 * i + 1]))
    del held, batch, shm


def test_batches_freed_by_the_cycle_collector_free_their_slots():
    """Under a cap, a batch caught in a reference cycle is freed only by the gc; its slot must
    come back then (the ring collects garbage once before it would raise RingFullError)."""
    shm = ShmDataLoader(ds.DictDataset(n=60), batch_size=2, num_workers=WORKERS, prefetch_factor=PREFETCH,
                        max_ring_slots=DEPTH, collate_fn=ds.numpy_collate)  # numpy views: gc-tracked
    for i, batch in enumerate(shm):
        assert batch["labels"] == [2 * i, 2 * i + 1]
        holder = [batch["image"], batch]
        holder.append(holder)  # a cycle: refcounting alone never frees this batch
        del holder, batch
    assert shm.stats().batches == 30


def test_a_cap_large_enough_lets_a_loop_hold_everything():
    shm = ShmDataLoader(ds.ArrayDataset(n=40, nbytes=1024), batch_size=2, num_workers=WORKERS,
                        max_ring_slots=24)
    held = list(shm)
    assert_same_batches(held, collect(DataLoader(ds.ArrayDataset(n=40, nbytes=1024), batch_size=2)))
    del held, shm


# -- the lease itself ----------------------------------------------------------------------------------


def test_any_view_keeps_the_slot_and_the_last_one_frees_it(monkeypatch):
    monkeypatch.setattr(shmloader.layout, "SMALL_LEAF_BYTES", 0)  # `nested` would be a copy
    shm = ShmDataLoader(ds.DictDataset(n=24), batch_size=3, num_workers=WORKERS, persistent_workers=True)
    it = iter(shm)
    batch = next(it)
    slot = _slot_of(it, batch["image"])
    assert _leased(it, slot)
    row = batch["image"][1]  # a view of a view
    nested = batch["nested"]["ids"]
    del batch
    gc.collect()
    assert _leased(it, slot)
    for _ in range(5):  # the ring cycles through other slots meanwhile
        next(it)
    assert torch.equal(row, torch.from_numpy(ds._image(1)))
    del row
    gc.collect()
    assert _leased(it, slot)  # `nested` still refers to the first batch
    assert torch.equal(nested, torch.tensor([[0, 0], [1, -1], [2, -2]]))
    del nested
    gc.collect()
    assert not _leased(it, slot)
    assert slot in it._ring._free
    del it, shm


def _lease_of(array: np.ndarray) -> SlotLease:
    base = array
    while not isinstance(base, SlotLease):
        base = base.obj if isinstance(base, memoryview) else base.base
    return base


def test_numpy_views_hold_their_lease_until_the_last_one_dies():
    shm = ShmDataLoader(ds.DictDataset(n=12), batch_size=4, num_workers=WORKERS,
                        collate_fn=ds.numpy_collate, persistent_workers=True)
    it = iter(shm)
    batch = next(it)
    image = batch["image"]
    lease = weakref.ref(_lease_of(image))
    del batch
    gc.collect()
    assert lease() is not None
    part = image[2:, 0]
    del image
    gc.collect()
    assert lease() is not None and _leased(it, lease().slot)
    np.testing.assert_array_equal(part, np.stack([ds._image(2)[0], ds._image(3)[0]]))
    slot = _slot_of(it, part)
    del part
    gc.collect()
    assert lease() is None
    assert not _leased(it, slot)
    del it, shm


def test_batches_outlive_the_loader():
    shm = ShmDataLoader(ds.DictDataset(n=9), batch_size=3, num_workers=WORKERS)
    it = iter(shm)
    kept = next(it)
    del it, shm
    gc.collect()
    want = next(iter(DataLoader(ds.DictDataset(n=9), batch_size=3)))
    assert_same(kept, want)
    del kept


# -- zero copy -------------------------------------------------------------------------------------


@pytest.mark.parametrize("collate_fn", [None, ds.numpy_collate, ds.mixed_collate],
                         ids=["default", "numpy", "mixed"])
def test_delivered_leaves_lie_inside_ring_slots(collate_fn, monkeypatch):
    monkeypatch.setattr(shmloader.layout, "SMALL_LEAF_BYTES", 0)  # these leaves are small: copies
    shm = ShmDataLoader(ds.DictDataset(n=16), batch_size=4, num_workers=WORKERS, collate_fn=collate_fn)
    it = iter(shm)
    count = 0
    for batch in it:
        for leaf in array_leaves(batch):
            if nbytes_of(leaf):
                assert in_ring(leaf, it), f"{type(leaf).__name__} at {address_of(leaf):#x} is not in a slot"
                count += 1
    assert count > 0
    del batch, leaf, it, shm


def test_control_bytes_per_batch_do_not_grow_with_the_batch():
    per_batch = {}
    for nbytes in (1024, 1 << 20):  # batches of 4 KiB and of 4 MiB
        shm = ShmDataLoader(ds.ArrayDataset(n=16, nbytes=nbytes), batch_size=4, num_workers=WORKERS)
        for _ in shm:
            pass
        stats = shm.stats()
        assert stats.batches == 4
        per_batch[nbytes] = stats.control_bytes_per_batch
    assert all(0 < b < 1024 for b in per_batch.values()), per_batch
    assert abs(per_batch[1 << 20] - per_batch[1024]) < 64, per_batch


# -- slot sizes ------------------------------------------------------------------------------------


def test_slot_size_is_learnt_from_the_first_batch():
    shm = ShmDataLoader(ds.ArrayDataset(n=24, nbytes=64 * 1024), batch_size=4, num_workers=WORKERS)
    for _ in shm:
        pass
    stats = shm.stats()
    assert stats.slot_bytes >= 4 * 64 * 1024
    assert stats.slot_grows == 0


def test_growing_batches_grow_their_slots():
    dataset = ds.VariableLengthDataset(n=24, base=16, step=4096)  # 64 KiB .. 1.5 MiB a batch
    shm = ShmDataLoader(dataset, batch_size=3, num_workers=WORKERS, collate_fn=ds.pad_collate)
    got = collect(shm)
    assert_same_batches(got, collect(DataLoader(dataset, batch_size=3, collate_fn=ds.pad_collate)))
    stats = shm.stats()
    assert stats.slot_grows > 0
    assert stats.slot_bytes >= got[-1]["padded"].numel() * 4


@pytest.mark.parametrize("slot_bytes", [4096, 8 << 20])
def test_slot_bytes_argument(slot_bytes):
    dataset = ds.ArrayDataset(n=12, nbytes=32 * 1024)  # 128 KiB batches
    shm = ShmDataLoader(dataset, batch_size=4, num_workers=WORKERS, slot_bytes=slot_bytes)
    assert_same_batches(collect(shm), collect(DataLoader(dataset, batch_size=4)))
    stats = shm.stats()
    assert stats.slot_bytes >= max(slot_bytes, 4 * 32 * 1024)
    if slot_bytes > 4 * 32 * 1024:
        assert stats.slot_grows == 0


def test_last_batch_larger_than_the_first():
    """A last batch larger than the first (sizes learnt from batch 0) grows, never overflows."""
    dataset = ds.ArrayDataset(n=9, nbytes=128 * 1024)
    sampler = [[0], [1], [2], [3, 4, 5, 6, 7, 8]]  # the last batch is 6x the first
    shm = ShmDataLoader(dataset, batch_sampler=sampler, num_workers=WORKERS)
    assert_same_batches(collect(shm), collect(DataLoader(dataset, batch_sampler=sampler)))


@pytest.mark.parametrize("sample_parallel", [False, True])
def test_stats_after_the_epoch_count_the_batches_still_held(sample_parallel):
    """After the epoch the workers and the ring are gone: stats() keeps the epoch's figures, but
    held_segments / held_bytes / reserved_bytes / in_use_bytes say what the batches you still
    hold keep now, and fall to nothing once you drop them (found by a new-user check: they
    stayed at their end-of-epoch values)."""
    shm = ShmDataLoader(ds.ArrayDataset(n=64, nbytes=64 * 1024), batch_size=4, num_workers=WORKERS,
                        sample_parallel=sample_parallel)
    held = list(shm)
    assert len(held) == 16
    stats = shm.stats()
    assert stats.held_segments == 16 and stats.held_bytes >= 16 * 4 * 64 * 1024, stats
    assert stats.reserved_bytes == stats.in_use_bytes == stats.held_bytes, stats
    del held[::2]
    gc.collect()
    assert shm.stats().held_segments == 8
    del held
    gc.collect()
    stats = shm.stats()
    assert (stats.held_segments, stats.held_bytes, stats.reserved_bytes, stats.in_use_bytes) == (0, 0, 0, 0), stats
    assert stats.batches == 16 and stats.ring_slots > 0
