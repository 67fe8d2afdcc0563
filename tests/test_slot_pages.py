"""Where batch sizes vary widely, a slot holds its batch's pages, not the largest batch's (NOTE [ A
slot's pages follow its batch ] in shmloader/ring.py): a size-bucketing batch sampler's batches
come out as torch's, the shared memory the loader holds while the loop runs stays well under what
slots kept whole hold, equal batches give nothing back, and a slot is never given back where that
is unsafe (page-locked for CUDA, a kernel without MADV_POPULATE_WRITE); a worker that cannot take
the pages back writes its batch into a new segment where it knows the batch's size (torch's default
collate), else fails that batch with a ShmCapacityError and keeps its grant."""

from __future__ import annotations

import collections
import errno
import os

import numpy as np
import pytest
from torch.utils.data import DataLoader, Dataset

import shmloader.ring as ring_module
from shmloader import ShmCapacityError, ShmDataLoader
from shmloader import worker as worker_module
from shmloader.ring import Ring
from shmloader.segment import create_segment, page_round, trimmed_end
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

    monkeypatch.setenv("SHMLOADER_TRIM_SLOTS", "0")  # slots kept whole, as before (read at iter())
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
    worker.short_of_pages = None
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
    assert info.value.needed == 3 * MiB and info.value.taking_pages_back  # (the stage the worker names)
    assert list(worker.grants) == [grant] and worker.pages_end[3] == (7, MiB)  # tried again next batch


def test_no_room_to_take_pages_back_for_a_batch_of_known_size_asks_for_a_new_segment():
    grant = (3, 7, 4 * MiB, 0)
    worker = _worker_with(_Pages(full=True), MiB)
    assert worker._ready_to_write(grant, upto=2 * MiB, regrow=True) == grant
    assert worker.short_of_pages == 3 and worker.pages_end[3] == (7, MiB)  # taken back from: unchanged
    assert not worker.grants  # this batch's to write (into a new segment)
    worker.segments[3][1].full = False
    assert worker._ready_to_write(grant, upto=2 * MiB, regrow=True) == grant and worker.short_of_pages is None


def test_a_slot_whose_pages_cannot_be_taken_back_gets_a_new_segment(monkeypatch, tmp_path):
    """/dev/shm full when a writer takes back its slot's pages (another process took them): the
    batch goes into a new segment for the slot, as a growing slot's (outside /dev/shm where it has
    no room), never into the missing pages, and the loop gets torch's batches, no error."""
    real_ready, real_new_segment = worker_module._Worker._ready_to_write, worker_module._Worker.new_segment
    log = tmp_path / "events"

    def note(event: str, slot: int) -> None:
        with open(log, "a") as f:  # (one short line per write: the workers' lines do not mix)
            f.write(f"{os.getpid()} {event} {slot}\n")

    def no_room_to_take_back(self, grant, upto=None, regrow=False):
        slot, generation, capacity, _ = grant
        known = self.pages_end.get(slot)
        if (regrow and capacity and known is not None and known[0] == generation
                and min(capacity, page_round(upto or capacity)) > known[1]):
            self.short_of_pages = slot  # as _ready_to_write says it for ENOSPC / EFAULT
            note("short", slot)
            return grant
        return real_ready(self, grant, upto, regrow)

    def new_segment(self, grant, capacity):
        note("new", grant[0])
        return real_new_segment(self, grant, capacity)

    monkeypatch.setattr(worker_module._Worker, "_ready_to_write", no_room_to_take_back)  # (forked workers)
    monkeypatch.setattr(worker_module._Worker, "new_segment", new_segment)
    batches = 30
    want = collect(DataLoader(Samples(), batch_sampler=Buckets(WIDE, batches), num_workers=2))
    _, got, stats = _peak_shm_of_a_loop(Buckets(WIDE, batches), batches)
    assert_same_batches(got, want)
    events = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
    shorts = [k for k, (_, event, _) in enumerate(events) if event == "short"]
    assert stats.pages_given_back > 0 and len(shorts) >= 2, (events, stats)
    for k in shorts:  # that worker's next event: a new segment for that slot
        pid, _, slot = events[k]
        following = [e for e in events[k + 1:] if e[0] == pid]
        assert following and following[0] == [pid, "new", slot], (k, events)


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
