"""shmloader/ring.py: segments are private and nameless, a lease's death returns its slot, a full
ring detaches its longest-held slot (no cap unless asked for; a cap refuses clearly), and foreign
or stale slots are refused."""

from __future__ import annotations

import gc
import os
import stat
import warnings
import weakref

import pytest

from shmloader import RingFullError, ShmCapacityError, SlotProtocolError, _ring
from shmloader.ring import Ring
from shmloader.segment import PAGE, create_segment, page_round, shm_free_bytes

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


def test_ring_that_cannot_fit_is_fitted_at_creation(recwarn):
    """Not refused (NOTE [ A ring fitted to /dev/shm ]): fitted, with a warning, and no slot
    made (the overflow slots its loop may need are made only where it would wait for good)."""
    ring = Ring(4, slot_bytes=shm_free_bytes() + (1 << 20))
    try:
        assert ring._shm_room is not None and ring._shm_room_left() == 0
        assert any("room for" in str(w.message) for w in recwarn.list)
        assert ring.segments() == []
    finally:
        ring.close()


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
    assert again == slot and ring.stats().detached == 0
    ring.unassign(again)
    ring.close()


def _lease_all(ring: Ring, n: int) -> list:
    leases = []
    for sequence in range(n):
        slot = ring.take_free_slot()
        _worker_writes(ring, slot, sequence, payload=b"batch %d" % sequence)
        leases.append(ring.lease(slot, sequence, ring.release_callback())[0])
    return leases


def _payload(lease, n: int = 7) -> bytes:
    return bytes(memoryview(lease)[_ring.HEADER_BYTES:_ring.HEADER_BYTES + n])


def test_a_full_ring_detaches_its_longest_held_slot():
    """NOTE [ Held batches ]: no wait, no cap, no gc; the held batch keeps its memory, the ring
    keeps its depth, and the held segment goes with the batch's last view."""
    ring = Ring(2)
    assert ring.max_slots is None and ring.max_bytes is None
    first, second = _lease_all(ring, 2)
    fds_before = len(_open_fds())
    assert ring.can_take()
    slot = ring.take_free_slot()
    assert slot == first.slot and ring.depth == 2
    generation, capacity, _hint = ring.task_geometry(slot)
    assert capacity == 0 and generation == first.generation + 1  # a fresh segment next time
    assert ring.take_retired() == [(slot, first.generation)] and ring.take_retired() == []
    assert first.segment.fd == -1 and len(_open_fds()) == fds_before - 1  # held: mapped, no fd
    assert _payload(first) == b"batch 0"
    stats = ring.stats()
    assert (stats.held_segments, stats.detached, stats.slots) == (1, 1, 2)
    # the held segment keeps only its batch's pages (the payload ends within the first page)
    assert first.segment.size == 2 * PAGE and stats.held_bytes == PAGE
    assert stats.reserved_bytes == stats.ring_bytes + PAGE
    _worker_writes(ring, slot, 2, payload=b"batch 2")
    third = ring.lease(slot, 2, ring.release_callback())[0]
    held_segment = weakref.ref(first.segment)
    del first  # the old generation's release must not free the slot's new batch
    assert ring.collect_released() == 0 and ring.held() == 2
    assert held_segment() is None and ring.stats().held_segments == 0  # unmapped with its batch
    assert _payload(third) == b"batch 2" and _payload(second) == b"batch 1"
    del second, third
    ring.close()


def _open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def test_a_cap_in_slots_refuses_and_names_itself():
    ring = Ring(4, max_slots=2)
    assert ring.depth == 2  # the cap holds from the start
    leases = _lease_all(ring, 2)
    assert not ring.can_take()
    with pytest.raises(RingFullError, match=r"holds 2 batches.*2 shared-memory segments.*max_ring_slots=2"):
        ring.take_free_slot()
    leases.pop()
    assert ring.take_free_slot() == 1
    del leases
    ring.close()


def test_a_cap_counts_the_segments_workers_are_making():
    """Slots granted to workers that make their segment count against the cap from the grant:
    at start-up (every worker makes its first slot) the loop's first batch was detached for a
    fourth segment while the other two were being made (4 alive under max_ring_slots=3)."""
    ring = Ring(4, max_slots=3)
    first, second, third = (ring.take_free_slot() for _ in range(3))
    _worker_writes(ring, first, 0)
    lease = ring.lease(first, 0, ring.release_callback())[0]
    assert not ring.can_take()  # second and third are on their way: 3 segments already
    _worker_writes(ring, second, 1)
    _worker_writes(ring, third, 2)
    assert not ring.can_take()
    del lease
    assert ring.can_take() and ring.take_free_slot() == first
    ring.unassign(first)
    for slot, sequence in ((second, 1), (third, 2)):
        ring.lease(slot, sequence, ring.release_callback())
    ring.close()


def test_a_cap_in_bytes_counts_held_segments():
    ring = Ring(2, slot_bytes=2 * PAGE, max_bytes=3 * 2 * PAGE)
    leases = _lease_all(ring, 2)
    slot = ring.take_free_slot()
    assert slot == leases[0].slot  # a third segment fits the cap: the held one is detached
    _worker_writes(ring, slot, 2)
    leases.append(ring.lease(slot, 2, ring.release_callback())[0])
    assert not ring.can_take()  # a fourth would not
    with pytest.raises(RingFullError, match=f"max_ring_bytes={6 * PAGE}"):
        ring.take_free_slot()
    del leases
    ring.close()


def test_make_room_names_the_counts_when_the_cap_is_reached():
    ring = Ring(1, max_slots=2)
    leases = _lease_all(ring, 1)
    leases.append(ring.lease(*_detach_and_write(ring, 1), ring.release_callback())[0])
    with pytest.raises(RingFullError, match=r"holds 2 batches.*max_ring_slots=2"):
        ring.make_room()
    leases.pop(0)
    ring.make_room()  # room again: no error
    del leases
    ring.close()


def _detach_and_write(ring: Ring, sequence: int) -> tuple[int, int]:
    slot = ring.take_free_slot()
    _worker_writes(ring, slot, sequence)
    return slot, sequence


def test_make_room_collects_cycles_holding_dead_batches_under_a_cap():
    ring = Ring(1, max_slots=1)
    slot = ring.take_free_slot()
    _worker_writes(ring, slot, 0)
    cycle = [ring.lease(slot, 0, ring.release_callback())[0]]
    cycle.append(cycle)  # only the gc can free this lease
    del cycle
    ring.make_room()
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


def test_a_refused_slot_leaves_no_trace():
    """The old Ring._add_slot registered a slot before its capacity check, so a refusal left a
    phantom slot behind.  Now the ring never adds indices: a refusal changes nothing."""
    ring = Ring(2, max_slots=2)
    leases = _lease_all(ring, 2)
    before = (ring.depth, list(ring._free), list(ring._states), ring.stats())
    for _ in range(3):
        with pytest.raises(RingFullError):
            ring.take_free_slot()
    assert (ring.depth, list(ring._free), list(ring._states), ring.stats()) == before
    del leases
    ring.close()


# -- NOTE [ Slot size follows the batches ] ------------------------------------------------------


def _batch_of(ring: Ring, sequence: int, end: int):
    """A worker's batch whose payload ends at `end`, leased and released at once: the ring
    learns its size."""
    lease = _held_batch_of(ring, sequence, end)
    del lease
    ring.collect_released()


def test_a_held_segment_gives_its_pages_past_the_batch_back_to_dev_shm():
    ring = Ring(1, slot_bytes=64 * PAGE)
    first = _lease_all(ring, 1)[0]
    fd = os.dup(ring.fd(first.slot))
    assert os.fstat(fd).st_blocks * 512 >= 64 * PAGE  # reserved whole
    ring.take_free_slot()  # detaches the held one
    assert os.fstat(fd).st_blocks * 512 == PAGE and _payload(first) == b"batch 0"
    os.close(fd)
    del first
    ring.close()


def test_the_size_of_new_slots_comes_down_after_a_window_of_smaller_batches():
    ring = Ring(2)
    window = ring._recent_ends.maxlen
    _batch_of(ring, 0, 4 << 20)  # the outlier
    big = ring.slot_bytes
    assert big >= 4 << 20
    for sequence in range(1, window):
        _batch_of(ring, sequence, 256 << 10)
        assert ring.slot_bytes == big  # not before a whole window without the outlier
    _batch_of(ring, window, 256 << 10)
    assert ring.slot_bytes < big / 4 and ring.stats().slot_shrinks >= 1
    assert all(s.size <= 2 * ring.slot_bytes for s in ring.segments())  # the big one dropped
    retired = ring.take_retired()
    assert retired, "workers must be told to forget the dropped segment"
    _batch_of(ring, window + 1, 3 << 20)  # a larger batch grows it again at once
    assert ring.slot_bytes >= 3 << 20
    ring.close()


@pytest.mark.parametrize("given", [None, 4 << 20])
def test_sizes_within_twice_and_a_given_slot_bytes_never_shrink_it(given):
    ring = Ring(2, slot_bytes=given)
    ends = [(1 + (k * 5) % 4) << 20 for k in range(40)]  # 1..4 MiB, dynamic padding
    if given:
        ends = [64 << 10] * 40  # far below what the user gave
    for sequence, end in enumerate(ends):
        _batch_of(ring, sequence, end)
    assert ring.stats().slot_shrinks == 0
    if given:
        assert ring.slot_bytes == given
    ring.close()


def test_a_header_changed_after_the_lease_does_not_trim_the_held_batch():
    """Trust model: a worker that rewrites a leased slot's payload end cannot make the main
    process give back pages under the batch the training loop holds."""
    ring = Ring(1, slot_bytes=16 * PAGE)
    slot = ring.take_free_slot()
    _worker_writes(ring, slot, 0, payload=bytes(range(256)) * (4 * PAGE // 256))  # 4 pages
    lease = ring.lease(slot, 0, ring.release_callback())[0]
    ring.segment(slot).publish(1, _ring.HEADER_BYTES + 1)  # a rogue write: "the batch ends at once"
    ring.take_free_slot()  # detaches it
    assert bytes(memoryview(lease)[_ring.HEADER_BYTES:_ring.HEADER_BYTES + 4 * PAGE]) == bytes(range(256)) * (4 * PAGE // 256)
    assert ring.stats().held_bytes == page_round(_ring.HEADER_BYTES + 4 * PAGE)
    del lease
    ring.close()


@pytest.mark.parametrize("where", ["open_unlinked", "reserve"])
def test_a_ctrl_c_while_a_segment_is_made_leaves_no_entry_and_no_fd(where, monkeypatch):
    """A SIGINT that landed between the fd's making and its segment left the fd and its reserved
    pages (NOTE [ Segments ]); no Python code runs between shm_open and shm_unlink.  Signals are
    held meanwhile: the KeyboardInterrupt comes once the segment is whole, and it is freed."""
    import signal

    from shmloader import segment as segment_module

    real = getattr(segment_module._ring, where)

    def interrupted(*args):
        made = real(*args)
        os.kill(os.getpid(), signal.SIGINT)  # arrives before the fd is anyone's
        return made

    monkeypatch.setattr(segment_module._ring, where, interrupted)
    before = set(os.listdir("/proc/self/fd"))
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's, whatever ran before
    try:
        with pytest.raises(KeyboardInterrupt):
            create_segment(1 << 20, 0)
    finally:
        signal.signal(signal.SIGINT, handler)
    monkeypatch.undo()
    gc.collect()
    assert not [name for name in os.listdir("/dev/shm") if name.startswith("shmloader-")]
    assert set(os.listdir("/proc/self/fd")) <= before


# -- NOTE [ Held batches of varying size ] ----------------------------------------------------------


def _held_batch_of(ring: Ring, sequence: int, end: int):
    """A worker's batch whose payload ends at `end`, written as a worker does (a slot without a
    segment made at max(hint, end), the size hint the ring gives; one too small grown), and
    leased: the loop keeps it."""
    slot = ring.take_free_slot()
    generation, capacity, hint = ring.task_geometry(slot)
    if capacity < end:
        segment = create_segment(max(hint, end) if capacity == 0 else 2 * end, generation + 1)
        ring.adopt(slot, os.dup(segment.fd), segment.size, generation + 1)
        segment.close_fd()
    segment = ring.segment(slot)
    assert segment.claim(1, sequence) == _ring.FREE
    segment.write(_ring.HEADER_BYTES, b"d")
    segment.publish(1, end)
    return ring.lease(slot, sequence, ring.release_callback())[0]


def test_kept_batches_of_varying_size_get_segments_of_their_own_size():
    """A loop that keeps every batch of dynamic padding: once slots are detached, their next
    segments are left to the batch's size (hint 0, no spare), not the largest batch's."""
    ring = Ring(2)
    ends = [(4 + (k * 7) % 13) * 16 * PAGE for k in range(12)]  # 64..256 pages, in no order
    kept = [_held_batch_of(ring, sequence, end) for sequence, end in enumerate(ends)]
    assert ring.stats().detached == len(ends) - 2
    assert ring.keeps_batches()
    sizes = [lease.segment.size for lease in kept]
    # the first ones take the learnt size; from the detached slots on, each its batch's size
    assert sizes[4:] == [page_round(end) for end in ends[4:]], (sizes, ends)
    slot = ring.take_free_slot(fitted_only=True)  # a grant to go on with, at no cost before use
    assert ring.task_geometry(slot)[1:] == (0, 0)
    ring.unassign(slot)
    del kept
    ring.close()


def test_kept_batches_of_one_size_keep_the_slot_size_and_the_spares():
    ring = Ring(2)
    kept = [_held_batch_of(ring, sequence, 64 * PAGE) for sequence in range(6)]
    assert not ring.can_grant_fitted() and ring.should_wait_for_spare()
    assert ring.task_geometry(ring.take_free_slot())[2] == ring.slot_bytes
    del kept
    ring.close()


def test_a_loop_that_gives_its_batches_back_is_not_keeping_them():
    ring = Ring(2)
    for sequence in range(3):
        _batch_of(ring, sequence, 64 * PAGE)
    assert not ring.keeps_batches()
    kept = [_held_batch_of(ring, sequence, 64 * PAGE) for sequence in range(3, 6)]
    assert ring.keeps_batches()
    del kept
    for sequence in range(6, 6 + ring.depth + 1):
        _batch_of(ring, sequence, 64 * PAGE)
    assert not ring.keeps_batches()  # a ring's depth of batches given back since the last detach
    ring.close()


def test_a_ring_out_of_room_without_a_cap_says_dev_shm_not_a_cap():
    """Where no slot can be taken and the user set no cap, what is missing is /dev/shm's room:
    a ShmCapacityError that says so, never a RingFullError naming a cap nobody set."""
    ring = Ring(2, slot_bytes=64 * PAGE)
    kept = _lease_all(ring, 2)
    ring._shm_room = ring._shm_bytes()  # fitted to exactly what its segments hold
    with pytest.raises(ShmCapacityError, match="training loop holds 2 batches"):
        ring.take_free_slot()
    del kept
    ring.close()
