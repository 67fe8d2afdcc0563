"""The ring: the main process's set of shared-memory slots, and the policy that sizes it.

NOTE [ Slot lifecycle ]
  A slot is one POSIX shared-memory segment.  Its name exists only for the instant between
  shm_open and shm_unlink inside `create_segment`: processes share it by passing the fd over
  their control socket (SCM_RIGHTS), so no crash of any process can leave an entry behind in
  /dev/shm.  Its pages are reserved with posix_fallocate when it is created, so a /dev/shm that
  is too small is a ShmCapacityError then, never a SIGBUS in a worker later.

  main: free ──grant───▶ worker k: claim (WRITING) ──publish──▶ READY ──main: acquire──▶ LEASED
          ▲                                                                              │
          └──────────────── the SlotLease dies (last view of the batch freed) ───────────┘

  The main process decides every transition but the worker's claim/publish; the header's state
  word (csrc/ring.h) mirrors it so that each side can check the other.  A slot is handed to a
  worker only when free, so a batch the user still holds is never overwritten.  A worker that
  needs more room than its slot has creates a larger segment itself (generation + 1), writes the
  batch there and passes the fd back with its result; the main process adopts it in place of the
  old one.  A worker that dies while writing leaves its slot WRITING; the main process resets it.

NOTE [ Ring size ]
  depth = num_workers × prefetch_factor (batches in flight, as torch counts them) + CONSUMER_SLOTS
  (batches the training loop holds: the one in use and the one being fetched).  Slots are created
  on first use, and a slot is bound to a batch only once the batch exists (NOTE [ Slot grants ] in
  loader.py), so a loop that keeps up creates far fewer than `depth`.  When the user holds more,
  the ring adds slots up to `max_slots` (default 2 × depth) and then raises RingFullError rather
  than wait for a release that may never come.  Slot size is learnt from the first batch
  (page-rounded) unless `slot_bytes` is given; a larger batch grows only its slot.
"""

from __future__ import annotations

import errno
import gc
import os
import secrets
import warnings
from collections import deque
from dataclasses import dataclass

import posix_ipc

from . import _ring
from .errors import RingFullError, ShmCapacityError, SlotProtocolError
from .ownership import register_parent_only

SHM_DIR = "/dev/shm"
PAGE = os.sysconf("SC_PAGE_SIZE")
CONSUMER_SLOTS = 2
MIN_HEADROOM = 64 * 1024

# The main process's view of a slot (the header's state word has WRITING/READY in between).
_FREE, _DISPATCHED, _LEASED = "free", "granted", "leased"


def page_round(nbytes: int) -> int:
    return (nbytes + PAGE - 1) // PAGE * PAGE


def shm_free_bytes(path: str | None = None) -> int:
    st = os.statvfs(path if path is not None else SHM_DIR)  # SHM_DIR read now: tests patch it
    return st.f_bavail * st.f_frsize


def slot_capacity(needed: int, current: int, learnt: int) -> int:
    """Capacity of a new segment for a slot that must hold `needed` bytes.

    A slot created for the first time takes the ring's learnt size (`learnt`, 0 before the first
    batch) or, when the batch is larger or nothing is learnt yet, exactly what it needs, page
    rounded: equal batches then waste nothing.  A slot that must grow gets 1/8 headroom (at least
    64 KiB) and at least 1.5 × its current size, so that variable-size batches grow it rarely."""
    if current == 0:
        return learnt if needed <= learnt else page_round(needed)
    return page_round(max(needed + max(needed // 8, MIN_HEADROOM), current + current // 2))


def create_segment(capacity: int, generation: int, what: str = "a ring slot") -> _ring.Segment:
    """A new, reserved, mapped and already-unlinked slot segment of `capacity` bytes."""
    capacity = page_round(max(capacity, _ring.HEADER_BYTES))
    free = shm_free_bytes()
    if capacity > free:  # fail before posix_fallocate briefly fills /dev/shm for everyone else
        raise ShmCapacityError(capacity, free, SHM_DIR, what)
    name = "/shmloader-" + secrets.token_hex(16)
    mem = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
    try:
        fd = os.dup(mem.fd)
    finally:
        mem.close_fd()
        mem.unlink()
    try:
        os.ftruncate(fd, capacity)
        _ring.reserve(fd, capacity)
        segment = _ring.Segment(fd, capacity)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise ShmCapacityError(capacity, free, SHM_DIR, what) from exc
        raise
    segment.init_header(generation)
    return segment


@dataclass(frozen=True)
class RingStats:
    slots: int
    allocated_slots: int
    slot_bytes: int
    ring_bytes: int
    ring_grows: int
    slot_grows: int


class Ring:
    """Slots owned by the main process (see NOTE [ Slot lifecycle ])."""

    def __init__(self, depth: int, slot_bytes: int | None = None, max_slots: int | None = None):
        if depth < 1:
            raise ValueError(f"ring depth must be >= 1, got {depth}")
        self.max_slots = max(max_slots if max_slots is not None else 2 * depth, depth)
        self.slot_bytes = page_round(slot_bytes) if slot_bytes else None
        self._segments: list[_ring.Segment | None] = [None] * depth
        self._generations = [0] * depth
        self._states = [_FREE] * depth
        self._free: deque[int] = deque(range(depth))
        # Appended by SlotLease deallocation, from whichever thread dropped the last view.
        self._released: deque[tuple[int, int]] = deque()
        self._ring_grows = 0
        self._slot_grows = 0
        self._closed = False
        register_parent_only(self)
        if self.slot_bytes is not None:
            self._check_fits()

    # -- sizing --------------------------------------------------------------------------

    def _check_fits(self) -> None:
        """Raise ShmCapacityError now if the whole ring at `slot_bytes` cannot fit in /dev/shm.

        Slots are created (and their pages reserved) when first used, by whichever process first
        needs them, so the first batch does not wait for the whole ring to be zeroed; this check
        makes a /dev/shm that is too small an error at the start, not after some batches."""
        if self.slot_bytes is None:
            return
        allocated = self.segments()
        missing = self.depth - len(allocated)
        needed = missing * self.slot_bytes
        free = shm_free_bytes()
        if needed > free:
            total = sum(s.size for s in allocated) + needed
            raise ShmCapacityError(
                total, free + sum(s.size for s in allocated), SHM_DIR,
                f"the ring ({self.depth} slots of {self.slot_bytes} bytes)",
            )

    def _add_slot(self) -> int:
        slot = len(self._segments)
        self._segments.append(None)
        self._generations.append(0)
        self._states.append(_FREE)
        self._ring_grows += 1
        if self.slot_bytes is not None and self.slot_bytes > shm_free_bytes():
            raise ShmCapacityError(self.slot_bytes, shm_free_bytes(), SHM_DIR,
                                   f"growing the ring to {self.depth} slots")
        return slot

    @property
    def depth(self) -> int:
        return len(self._segments)

    # -- the main process's side of the lifecycle ------------------------------------------

    def can_take(self) -> bool:
        """Whether take_free_slot would succeed now."""
        self.collect_released()
        return bool(self._free) or self.may_grow()

    def has_free_created_slot(self) -> bool:
        self.collect_released()
        return any(self._segments[slot] is not None for slot in self._free)

    def take_free_slot(self, prefer: dict[int, int] | None = None, created_only: bool = False) -> int:
        """A free slot to grant (growing the ring if needed and allowed).

        Prefers a slot the receiving worker has mapped already (`prefer`: slot -> generation it
        knows), then one not created yet, so each worker maps few slots (each mapping costs page
        table set-up for the whole slot); `created_only` never picks a slot still to be created."""
        self.collect_released()
        if not self._free:
            if not self.may_grow():
                raise RingFullError(f"no free slot among {self.depth} (max_ring_slots={self.max_slots})")
            self._free.append(self._add_slot())
        prefer = prefer or {}
        created = [s for s in self._free if self._segments[s] is not None]
        known = [s for s in created if prefer.get(s) == self._generations[s]]
        uncreated = [s for s in self._free if self._segments[s] is None]
        if created_only:
            order = known + created
        else:
            order = known + uncreated + created
        if not order:
            raise RingFullError(f"no created free slot among {self.depth}")
        chosen = order[0]
        self._free.remove(chosen)
        self._states[chosen] = _DISPATCHED
        return chosen

    def make_room(self, held: int) -> None:
        """The loop would wait forever for a slot: collect garbage once (reference cycles may
        hold dead batches), then raise RingFullError naming the counts."""
        if self.can_take():
            return
        gc.collect()
        if not self.can_take():
            raise RingFullError(
                f"the training loop holds {held} batches, which fill all {self.depth} slots of the "
                f"ring (max_ring_slots={self.max_slots}); release batches you no longer need "
                "(del them, or copy what you keep with .clone()) or pass a larger max_ring_slots"
            )

    def unassign(self, slot: int) -> None:
        """A dispatched slot came back unused (end of an iterable stream, an error, a reset)."""
        segment = self._segments[slot]
        if segment is not None:
            segment.release()
        self._states[slot] = _FREE
        self._free.append(slot)

    def task_geometry(self, slot: int) -> tuple[int, int, int]:
        """(generation, capacity, size hint) of a slot as a worker must see it; capacity 0: not
        created yet, and the worker creates it at max(hint, what its batch needs)."""
        segment = self._segments[slot]
        return self._generations[slot], (segment.size if segment is not None else 0), self.slot_bytes or 0

    def fd(self, slot: int) -> int:
        segment = self._segments[slot]
        if segment is None:
            raise SlotProtocolError(f"slot {slot} has no segment to pass to a worker")
        return segment.fd

    def adopt(self, slot: int, fd: int, capacity: int, generation: int) -> None:
        """Take over the larger segment a worker created for `slot` (see NOTE [ Slot lifecycle ])."""
        if self._states[slot] != _DISPATCHED:
            os.close(fd)
            raise SlotProtocolError(f"a worker grew slot {slot}, which is {self._states[slot]}, not dispatched")
        if generation != self._generations[slot] + 1:
            os.close(fd)
            raise SlotProtocolError(
                f"slot {slot} came back at generation {generation}, expected {self._generations[slot] + 1}"
            )
        # Not populated: the training loop may read little of a slot (page tables for what it
        # touches are set up once, and stay while the slot is reused).
        segment = _ring.Segment(fd, capacity, populate=False)
        old = self._segments[slot]
        self._segments[slot] = segment
        self._generations[slot] = generation
        if old is not None:
            self._slot_grows += 1
            old.close_fd()
        if self.slot_bytes is None:
            self.slot_bytes = capacity
            self._check_fits()
        elif capacity > self.slot_bytes:
            self.slot_bytes = capacity

    def lease(self, slot: int, sequence: int, on_release) -> tuple[_ring.SlotLease, bytes, int]:
        """Validate a slot a worker reported ready for batch `sequence`; returns its lease, the
        descriptor bytes and the payload end."""
        segment = self._segments[slot]
        if segment is None or self._states[slot] != _DISPATCHED:
            raise SlotProtocolError(f"slot {slot} reported ready but it is {self._states[slot]}")
        magic, version, state, capacity, generation, _writer, seq, desc_bytes, payload_end = segment.header()
        if magic != _ring.MAGIC or version != _ring.VERSION:
            raise SlotProtocolError(
                f"slot {slot} has magic {magic:#x} version {version}; expected {_ring.MAGIC:#x} "
                f"version {_ring.VERSION} (a foreign or stale segment)"
            )
        if generation != self._generations[slot] or capacity != segment.size:
            raise SlotProtocolError(
                f"slot {slot} header says generation {generation}, capacity {capacity}; "
                f"the ring has generation {self._generations[slot]}, capacity {segment.size}"
            )
        if seq != sequence:
            raise SlotProtocolError(f"slot {slot} holds batch {seq}, expected batch {sequence}")
        if _ring.HEADER_BYTES + desc_bytes > payload_end or payload_end > capacity:
            raise SlotProtocolError(
                f"slot {slot} descriptor of {desc_bytes} bytes / payload end {payload_end} "
                f"lie outside its {capacity} bytes"
            )
        found = segment.acquire()
        if found != _ring.READY:
            raise SlotProtocolError(f"slot {slot} is in state {found}, not READY")
        self._states[slot] = _LEASED
        descriptor = segment.read(_ring.HEADER_BYTES, desc_bytes)
        return _ring.SlotLease(segment, slot, generation, sequence, on_release), descriptor, payload_end

    def release_callback(self):
        """What a SlotLease calls when it dies: a thread-safe append, nothing else."""
        return self._released.append

    def collect_released(self) -> int:
        n = 0
        while self._released:
            slot, generation = self._released.popleft()
            if self._closed or generation != self._generations[slot] or self._states[slot] != _LEASED:
                continue
            segment = self._segments[slot]
            if segment is not None:
                segment.release()
            self._states[slot] = _FREE
            self._free.append(slot)
            n += 1
        return n

    def has_free_slot(self) -> bool:
        return bool(self._free)

    def may_grow(self) -> bool:
        return not self._closed and self.depth < self.max_slots

    def held(self) -> int:
        return sum(1 for s in self._states if s == _LEASED)

    def segment(self, slot: int) -> _ring.Segment:
        segment = self._segments[slot]
        if segment is None:
            raise SlotProtocolError(f"slot {slot} has no segment")
        return segment

    def segments(self) -> list[_ring.Segment]:
        return [s for s in self._segments if s is not None]

    def stats(self) -> RingStats:
        allocated = self.segments()
        return RingStats(
            slots=self.depth,
            allocated_slots=len(allocated),
            slot_bytes=self.slot_bytes or 0,
            ring_bytes=sum(s.size for s in allocated),
            ring_grows=self._ring_grows,
            slot_grows=self._slot_grows,
        )

    # -- teardown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close every fd and drop the ring's references; a slot's memory is unmapped when the
        last view of its batch is gone (at once for slots the user does not hold)."""
        if self._closed:
            return
        self._closed = True
        for segment in self._segments:
            if segment is not None:
                segment.close_fd()
        self._segments = [None] * len(self._segments)
        self._free.clear()
        self._released.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    def close_in_child(self) -> None:
        for segment in self._segments:
            if segment is not None:
                segment.close_fd()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"unclosed shmloader Ring of {len(self._segments)} slots", ResourceWarning, stacklevel=2)
            self.close()
