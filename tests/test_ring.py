"""shmloader/ring.py: segments are private and nameless, a lease's death returns its slot, the
ring grows up to its cap and then refuses clearly, and foreign or stale slots are refused."""

from __future__ import annotations

import gc
import os
import stat
import warnings

import pytest

from shmloader import RingFullError, ShmCapacityError, SlotProtocolError, _ring
from shmloader.ring import PAGE, Ring, create_segment, page_round, shm_free_bytes

from .conftest import shm_entries

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("no_leaks")]


# -- segments ---------------------------------------------------------------------------------------


def test_segment_is_private_unlinked_and_page_sized():
    before = shm_entries()
    segment = create_segment(10_000, generation=4)
    info = os.fstat(segment.fd)
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_nlink == 0  # unlinked at once: no name left in /dev/shm
    assert shm_entries() == before
    assert segment.size == page_round(10_000) and segment.size % PAGE == 0
    assert info.st_size == segment.size and info.st_blocks * 512 >= segment.size  # reserved
    magic, version, state, capacity, generation, *_ = segment.header()
    assert (magic, version, state, capacity, generation) == (_ring.MAGIC, _ring.VERSION, _ring.FREE,
                                                             segment.size, 4)
    segment.close_fd()
    assert segment.fd == -1 and segment.mapped
    del segment


def test_segment_larger_than_dev_shm_is_a_capacity_error():
    free = shm_free_bytes()
    with pytest.raises(ShmCapacityError) as info:
        create_segment(free + (1 << 30), 0, "a test slot")
    assert info.value.free <= free + PAGE and "a test slot" in str(info.value)
    assert isinstance(info.value, MemoryError)


def test_ring_that_cannot_fit_is_refused_at_creation():
    with pytest.raises(ShmCapacityError, match="the ring"):
        Ring(4, slot_bytes=shm_free_bytes())


# -- the slot lifecycle ------------------------------------------------------------------------------


def _worker_writes(ring: Ring, slot: int, sequence: int, payload: bytes = b"hello") -> None:
    """What a worker does with a slot it was given: create its segment (first use), claim, write,
    publish; the main process adopts the segment."""
    generation, capacity, hint = ring.task_geometry(slot)
    if capacity == 0:
        segment = create_segment(max(hint, 2 * PAGE), generation + 1)
        ring.adopt(slot, os.dup(segment.fd), segment.size, generation + 1)
        segment.close_fd()
    else:
        segment = ring.segment(slot)
    assert segment.claim(1, sequence) == _ring.FREE
    segment.write(_ring.HEADER_BYTES, payload)
    segment.publish(len(payload), _ring.HEADER_BYTES + len(payload))


def test_lease_release_returns_the_slot():
    ring = Ring(2)
    slot = ring.take_free_slot()
    _worker_writes(ring, slot, sequence=0)
    lease, descriptor, end = ring.lease(slot, 0, ring.release_callback())
    assert descriptor == b"hello" and end == _ring.HEADER_BYTES + 5
    assert ring.segment(slot).state() == _ring.LEASED and ring.held() == 1
    view = memoryview(lease)
    del lease
    ring.collect_released()
    assert ring.held() == 1  # a view still holds the lease
    view.release()
    del view
    assert ring.collect_released() == 1
    assert ring.held() == 0 and ring.segment(slot).state() == _ring.FREE
    assert ring.has_free_slot()
    # the slot is reused as it is: same segment, no growth
    again = ring.take_free_slot(prefer={slot: ring.task_geometry(slot)[0]})
    assert again == slot and ring.stats().ring_grows == 0
    ring.unassign(again)
    ring.close()


def test_ring_grows_up_to_its_cap_then_raises():
    ring = Ring(2, max_slots=4)
    slots = [ring.take_free_slot() for _ in range(4)]
    assert sorted(slots) == [0, 1, 2, 3]
    assert ring.depth == 4 and ring.stats().ring_grows == 2
    assert not ring.can_take()
    with pytest.raises(RingFullError, match="max_ring_slots=4"):
        ring.take_free_slot()
    ring.unassign(slots[0])
    assert ring.take_free_slot() == slots[0]
    ring.close()


def test_default_cap_is_twice_the_depth():
    ring = Ring(3)
    assert ring.max_slots == 6
    ring.close()


def test_make_room_names_the_counts_when_every_slot_is_held():
    ring = Ring(1, max_slots=2)
    leases = []
    for sequence in range(2):
        slot = ring.take_free_slot()
        _worker_writes(ring, slot, sequence)
        leases.append(ring.lease(slot, sequence, ring.release_callback())[0])
    with pytest.raises(RingFullError, match=r"holds 2 batches.*all 2 slots.*max_ring_slots=2"):
        ring.make_room(ring.held())
    leases.pop()
    ring.make_room(ring.held())  # room again: no error
    del leases
    ring.close()


def test_make_room_collects_cycles_holding_dead_batches():
    ring = Ring(1, max_slots=1)
    slot = ring.take_free_slot()
    _worker_writes(ring, slot, 0)
    cycle = [ring.lease(slot, 0, ring.release_callback())[0]]
    cycle.append(cycle)  # only the gc can free this lease
    del cycle
    ring.make_room(1)
    assert ring.has_free_slot()
    ring.close()


# -- refusals --------------------------------------------------------------------------------------------


def test_lease_refuses_a_wrong_sequence_and_a_slot_not_dispatched():
    ring = Ring(2)
    slot = ring.take_free_slot()
    _worker_writes(ring, slot, sequence=5)
    with pytest.raises(SlotProtocolError, match="holds batch 5, expected batch 6"):
        ring.lease(slot, 6, None)
    other = ring.take_free_slot()
    ring.unassign(other)
    with pytest.raises(SlotProtocolError, match="reported ready"):
        ring.lease(other, 0, None)
    ring.close()


def test_lease_refuses_a_foreign_segment():
    ring = Ring(1)
    slot = ring.take_free_slot()
    _worker_writes(ring, slot, 0)
    ring.segment(slot).write(0, b"NOTSHMLD")  # clobber the magic number
    with pytest.raises(SlotProtocolError, match="foreign or stale"):
        ring.lease(slot, 0, None)
    ring.close()


def test_adopt_refuses_a_wrong_generation_and_closes_the_fd():
    ring = Ring(1)
    slot = ring.take_free_slot()
    segment = create_segment(PAGE, 5)
    fd = os.dup(segment.fd)
    with pytest.raises(SlotProtocolError, match="generation 5, expected 1"):
        ring.adopt(slot, fd, segment.size, 5)
    with pytest.raises(OSError):
        os.fstat(fd)  # closed by adopt
    del segment
    ring.close()


# -- teardown ----------------------------------------------------------------------------------------------


def test_close_keeps_leased_memory_mapped_until_the_views_go():
    ring = Ring(1)
    slot = ring.take_free_slot()
    _worker_writes(ring, slot, 0, payload=b"kept")
    lease = ring.lease(slot, 0, ring.release_callback())[0]
    ring.close()
    assert ring.closed and ring.segments() == []
    assert bytes(memoryview(lease)[_ring.HEADER_BYTES:_ring.HEADER_BYTES + 4]) == b"kept"
    del lease  # unmapped now (the no_leaks fixture checks it)


def test_an_unclosed_ring_warns():
    ring = Ring(1)
    slot = ring.take_free_slot()
    _worker_writes(ring, slot, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del ring
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) for w in caught)
