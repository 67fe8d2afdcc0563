"""Slot segments are made ahead of need, off the workers' path (NOTE [ Spare segments ] in
shmloader/spares.py): once the ring knows its slot size, no worker creates a slot; the thread
makes only what waiting grants need, honours the user's cap, leaves nothing behind, and when it
cannot make one the workers create their slots again (and report the error with its batch)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import shmloader.ring
from shmloader import ShmDataLoader
from shmloader.errors import ShmCapacityError
from shmloader.spares import SpareMaker

from . import _datasets as ds
from ._helpers import assert_same_batches, collect
from .conftest import wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]

WORKERS = 2


def _fixed(n: int = 60):
    return ds.ArrayDataset(n=n, nbytes=256 * 1024)


def _drain(loader, epochs: int = 1) -> int:
    count = 0
    for _ in range(epochs):
        for batch in loader:
            count += int(batch.shape[0])
        del batch
    return count


def test_workers_create_only_their_first_slots():
    """Each worker's first batch teaches the slot size; every slot needed after that is made
    ahead by the spare thread, none by a worker."""
    loader = ShmDataLoader(_fixed(), batch_size=2, num_workers=WORKERS, persistent_workers=True)
    held = []
    for i, batch in enumerate(loader):  # hold a few: the ring must make more slots than the first
        if i % 5 == 0:
            held.append(batch)
    stats = loader.stats()
    segments = stats.ring_bytes // stats.slot_bytes + stats.held_segments  # + a spare on its way
    assert stats.made_ahead >= 3, stats
    assert segments - stats.made_ahead <= WORKERS + 1, stats
    del held, batch
    assert _drain(loader) == 60  # the next epoch reuses the ring
    assert loader.stats().slot_grows == 0


def test_with_slot_bytes_given_every_slot_is_made_ahead():
    loader = ShmDataLoader(_fixed(20), batch_size=2, num_workers=WORKERS, slot_bytes=1 << 20)
    assert _drain(loader) == 20
    stats = loader.stats()
    assert stats.made_ahead >= max(1, stats.ring_bytes // stats.slot_bytes - 1), stats  # - one on its way


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("SHMLOADER_SPARE_SLOTS", "0")
    loader = ShmDataLoader(_fixed(20), batch_size=2, num_workers=WORKERS, slot_bytes=1 << 20)
    assert _drain(loader) == 20
    assert loader.stats().made_ahead == 0


def test_a_failing_spare_thread_hands_creation_back_to_the_workers(monkeypatch):
    """The thread cannot make segments (a full /dev/shm, say): grants no longer wait for it and
    the workers create their slots, so nothing hangs and every batch arrives."""
    def refuse(capacity, generation, what="a ring slot", populate=True):
        raise ShmCapacityError(capacity, 0, "/dev/shm", what)

    monkeypatch.setattr(shmloader.ring, "create_segment", refuse)  # the main process's only
    loader = ShmDataLoader(_fixed(40), batch_size=2, num_workers=WORKERS, slot_bytes=1 << 20)
    assert _drain(loader) == 40
    assert loader.stats().made_ahead == 0


def test_spares_count_against_the_users_cap():
    cap = 3
    loader = ShmDataLoader(_fixed(40), batch_size=2, num_workers=WORKERS, max_ring_slots=cap,
                           slot_bytes=1 << 20)
    assert _drain(loader) == 40
    stats = loader.stats()
    assert stats.ring_bytes <= cap * stats.slot_bytes, stats


def test_spare_maker_makes_what_is_wanted_and_closes_cleanly():
    made = []

    def create(capacity):
        segment = shmloader.ring.create_segment(capacity, 0)
        made.append(capacity)
        return segment

    maker = SpareMaker(create)
    try:
        maker.want(2, 1 << 16)
        assert _wait(lambda: maker.ready_count() == 2)
        assert maker.reserved_bytes() == 2 << 16
        assert os.read(maker.wakeup_fd, 16)  # the main process was woken
        first = maker.take(1 << 16)
        assert first is not None and first.size == 1 << 16
        assert maker.take(1 << 17) is None  # a ready one of another size is dropped, not handed
        maker.want(1, 1 << 17)
        assert _wait(lambda: maker.ready_count() == 1)
        # (a third 1 << 16 may come in between: the thread can look again after the take)
        assert made[:2] == [1 << 16, 1 << 16] and made[-1] == 1 << 17 and made.count(1 << 17) == 1, made
        del first
    finally:
        maker.close()
    assert not any(t.name == "shmloader-spare-slots" for t in threading.enumerate())


def test_wait_made_returns_once_the_segment_being_made_is_ready():
    """Ring._check_fits waits for a spare being made before it decides whether the ring fits."""
    started, go = threading.Event(), threading.Event()

    def create(capacity):
        started.set()
        go.wait(10)
        return shmloader.ring.create_segment(capacity, 0)

    maker = SpareMaker(create)
    try:
        assert maker.wait_made(0.01) is False  # nothing being made: no wait
        maker.want(1, 1 << 16)
        assert started.wait(10)
        threading.Timer(0.2, go.set).start()
        assert maker.wait_made(10) is True
        assert maker.ready_count() == 1 and maker.pending() == 1
    finally:
        go.set()
        maker.close()


def test_the_batches_are_torchs():
    """Grants that wait for spares change when workers write, never what they write."""
    kwargs = dict(batch_size=3, num_workers=WORKERS, shuffle=True)
    shm = ShmDataLoader(ds.RandomDataset(n=24), generator=torch.Generator().manual_seed(3),
                        slot_bytes=1 << 16, **kwargs)
    ref = torch.utils.data.DataLoader(ds.RandomDataset(n=24), generator=torch.Generator().manual_seed(3),
                                      **kwargs)
    assert_same_batches(collect(shm), collect(ref))
    assert shm.stats().made_ahead > 0


def _wait(predicate, seconds: float = 10.0) -> bool:
    return wait_until(predicate, seconds)


def test_a_closed_ring_in_a_forked_child_closes_nobody_elses_fds():
    """A ring closed in the main process but still referenced (an old iterator awaiting the
    garbage collector) is closed again by a forked worker (ownership.py): its spare-thread pipe's
    old fd numbers, reused since, must not be closed a second time (they are another worker's
    socket by then: EBADF at start-up)."""
    ring = shmloader.ring.Ring(4, slot_bytes=1 << 16)
    ring.close()
    r, w = os.pipe()  # takes the freed numbers (the lowest free fds)
    try:
        ring._spares.close_in_child()  # as close_parent_only_in_child() does, in a forked worker
        os.fstat(r)  # raises OSError (EBADF) if the ring closed it
        os.fstat(w)
    finally:
        os.close(r)
        os.close(w)
