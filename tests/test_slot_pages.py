"""Where batch sizes vary widely, a slot holds its batch's pages, not the largest batch's (NOTE [ A
slot's pages follow its batch ] in shmloader/ring.py): a size-bucketing batch sampler's batches
come out as torch's, the shared memory the loader holds while the loop runs stays well under what
slots kept whole hold, equal batches give nothing back, and a slot is never given back where that
is unsafe (page-locked for CUDA, a kernel without MADV_POPULATE_WRITE); a worker that cannot take
the pages back fails that batch with a ShmCapacityError and keeps its grant."""

from __future__ import annotations

import collections
import errno
import os

import numpy as np
import pytest
from torch.utils.data import DataLoader, Dataset

import shmloader.ring as ring_module
from shmloader import ShmCapacityError, ShmDataLoader
from shmloader.ring import Ring
from shmloader.segment import create_segment, trimmed_end
from shmloader.worker import _Worker

from ._helpers import assert_same_batches, collect
from .test_capacity import _shm_used_by

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]

KiB, MiB = 1 << 10, 1 << 20
SAMPLE_BYTES = 64 * KiB


class Samples(Dataset):
    """float32 samples of SAMPLE_BYTES, each filled with its index."""

    def __len__(self):
        return 1 << 16

    def __getitem__(self, i):
        return np.full(SAMPLE_BYTES // 4, i, dtype=np.float32)


class Buckets:
    """A batch sampler whose batches cycle through `sizes` samples (a size-bucketing sampler)."""

    def __init__(self, sizes, batches: int):
        self.sizes, self.batches = sizes, batches

    def __iter__(self):
        start = 0
        for k in range(self.batches):
            size = self.sizes[k % len(self.sizes)]
            yield list(range(start, start + size))
            start += size

    def __len__(self):
        return self.batches


WIDE = (2, 64, 4, 48, 8)  # 128 KiB to 4 MiB batches


def _peak_shm_of_a_loop(sampler, batches: int) -> tuple[int, list, object]:
    """Run the loop over a ShmDataLoader, holding each batch while reading what /dev/shm holds for
    this process and its workers; (that peak, a copy of each batch, the loader's stats)."""
    loader = ShmDataLoader(Samples(), batch_sampler=sampler, num_workers=2, prefetch_factor=2)
    peak, got = 0, []
    for batch in loader:
        got.append(batch.clone())
        peak = max(peak, _shm_used_by(os.getpid()))
    assert len(got) == batches
    return peak, got, loader.stats()


def test_bucketed_batches_are_torchs_and_hold_their_own_pages(monkeypatch):
    batches = 40
    want = collect(DataLoader(Samples(), batch_sampler=Buckets(WIDE, batches), num_workers=2))
    trimmed_peak, got, stats = _peak_shm_of_a_loop(Buckets(WIDE, batches), batches)
    assert_same_batches(got, want)
    assert stats.pages_given_back >= batches // 4, stats

    monkeypatch.setattr(ring_module, "TRIM_SLOTS", False)  # slots kept whole, as before
    whole_peak, got_whole, whole_stats = _peak_shm_of_a_loop(Buckets(WIDE, batches), batches)
    assert_same_batches(got_whole, want)
    assert whole_stats.pages_given_back == 0
    assert trimmed_peak < 0.75 * whole_peak, (trimmed_peak / MiB, whole_peak / MiB, stats)


def test_batches_of_one_size_give_nothing_back():
    _, got, stats = _peak_shm_of_a_loop(Buckets((16,), 12), 12)
    assert [int(b[0, 0]) for b in got] == [16 * k for k in range(12)]
    assert stats.pages_given_back == 0, stats


def test_a_kernel_without_populate_write_keeps_slots_whole(monkeypatch):
    monkeypatch.setattr(ring_module, "_populate_works", False)
    _, got, stats = _peak_shm_of_a_loop(Buckets(WIDE, 15), 15)
    assert [int(b[0, 0]) for b in got] == [sum(WIDE[j % 5] for j in range(k)) for k in range(15)]
    assert stats.pages_given_back == 0, stats


def _ring_with_varying_batches() -> tuple[Ring, int]:
    """A ring whose one slot has a 4 MiB segment and whose recent batches filled little of it."""
    ring = Ring(2)
    ring.trims_allowed = True
    slot = ring.take_free_slot()
    segment = create_segment(4 * MiB, 1, "a test slot")
    ring.adopt(slot, os.dup(segment.fd), segment.size, 1)
    segment.close_fd()
    ring._recent_ends.extend([128 * KiB] * 4)  # what leases note: batches far under the slot
    return ring, slot


def test_a_page_locked_slot_is_never_given_back():
    ring, slot = _ring_with_varying_batches()
    try:
        assert ring.grant_terms(slot) == (0, True)
        ring.segment(slot).before_unmap = lambda: None  # what cuda.SlotPinner sets when it pins
        assert ring.grant_terms(slot) == (0, False)
        ring.segment(slot).before_unmap = None
    finally:
        ring.close()


def test_trimmed_end_spares_equal_batches_and_headroom():
    assert trimmed_end(20 * MiB, 3 * MiB) == 3 * MiB
    assert trimmed_end(20 * MiB, 18 * MiB) == 20 * MiB  # an eighth of headroom: kept
    assert trimmed_end(2 * MiB, 1536 * KiB) == 2 * MiB  # under TRIM_MIN_BYTES: kept
    assert trimmed_end(8 * MiB, 100) == os.sysconf("SC_PAGE_SIZE")


class _Pages:
    """A segment that records the pages taken back, or whose /dev/shm has no room for them."""

    def __init__(self, full: bool = False):
        self.full, self.taken = full, []

    def populate(self, offset, nbytes):
        if self.full:
            raise OSError(errno.EFAULT, "Bad address")
        self.taken.append((offset, nbytes))


def _worker_with(segment, pages_end) -> _Worker:
    worker = object.__new__(_Worker)
    worker.pages_end = {3: (7, pages_end)}
    worker.segments = {3: (7, segment)}
    worker.grants = collections.deque()
    return worker


def test_a_writer_takes_back_the_pages_its_batch_needs():
    grant = (3, 7, 4 * MiB, 0)
    worker = _worker_with(_Pages(), MiB)
    assert worker._ready_to_write(grant, upto=2 * MiB + 100) == grant  # the batch's size known
    assert worker.segments[3][1].taken == [(MiB, MiB + os.sysconf("SC_PAGE_SIZE"))]
    assert worker.pages_end[3] == (7, 2 * MiB + os.sysconf("SC_PAGE_SIZE"))
    worker._ready_to_write(grant)  # a collate_fn that writes in the slot: all of it
    assert worker.segments[3][1].taken[-1] == (2 * MiB + os.sysconf("SC_PAGE_SIZE"), 2 * MiB - os.sysconf("SC_PAGE_SIZE"))
    assert 3 not in worker.pages_end
    worker = _worker_with(_Pages(), MiB)
    worker.pages_end = {3: (6, MiB)}  # an older generation's: nothing to take back
    assert worker._ready_to_write(grant) == grant and worker.segments[3][1].taken == []


def test_no_room_to_take_pages_back_fails_the_batch_and_keeps_the_grant():
    grant = (3, 7, 4 * MiB, 0)
    worker = _worker_with(_Pages(full=True), MiB)
    with pytest.raises(ShmCapacityError, match="slot 3 of the ring, taking back the pages") as info:
        worker._ready_to_write(grant)
    assert info.value.needed == 3 * MiB
    assert list(worker.grants) == [grant] and worker.pages_end[3] == (7, MiB)  # tried again next batch


def test_taking_pages_back_makes_them_writable():
    segment = create_segment(4 * MiB, 0, "a test slot")
    try:
        view = np.frombuffer(segment, dtype=np.uint8)
        view[:] = 7
        segment.discard_from(MiB)
        assert int(view[MiB:].max()) == 0 and int(view[:MiB].min()) == 7  # given back: zeros
        segment.populate(MiB, 3 * MiB)
        view[MiB:] = 9
        assert int(view[-1]) == 9 and int(view[0]) == 7
        del view
    finally:
        segment.close_fd()
