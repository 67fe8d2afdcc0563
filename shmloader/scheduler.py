"""Slot scheduling: which free slot of the ring each worker gets to write its next batch into.

The iterator (loader.py) says which tasks it sent to which worker (`task_sent`) and hands over
each result (`ready`); this module keeps the ring (ring.py), the grants and the page-locking of
slots (cuda.py), and sends Grant / Forget messages through the pool.  It knows nothing of
torch's order, epochs or samplers beyond the (epoch, idx) key of a task.

NOTE [ Slot grants ]
  Tasks carry no slot.  Each worker holds up to GRANTS_PER_WORKER free slots granted by the main
  process (Grant messages, with the segment's fd the first time that worker sees it) and writes
  each finished batch into one of them; the Ready message hands the slot back, and the main
  process grants another.  So a slot is bound only to a batch that exists: the ring's depth
  (NOTE [ Ring size ] in ring.py) is a cap, and the slots actually created are about the granted
  ones plus the batches waiting to be consumed, far fewer than num_workers × prefetch_factor when
  the training loop keeps up.  A worker that has a batch and no grant waits for one on its
  socket.  When no slot is free because the training loop holds batches, the ring detaches the
  longest-held one (NOTE [ Held batches ] in ring.py) and the workers that mapped it are told to
  forget it (Forget messages), as they are for a slot's pre-growth segment.  Only under a cap
  the user set can a worker wait for good: then RingFullError.

  A second grant (a slot to go on with once the current batch is written) is given only from
  the created free slots, and only while slots are at most AHEAD_MAX_SLOT_BYTES: for large
  batches it would hold a whole slot idle for a batch's time to save one round trip, and workers
  that fetch their samples into the slot (NOTE [ Samples born in the slot ] in
  samples_in_slot.py) start the next batch without one anyway.

  Grants go in the order the tasks were sent, up to GRANTS_PER_WORKER ahead per worker.  A
  worker writes its tasks in order, so its k-th grant serves its k-th owed task; granting in
  send order keeps the granted tasks a prefix of the owed ones.  When slots are scarce (a cap the
  user set) the earliest batch is the one that gets the slot, never a later one that would only
  wait in the reorder buffer: no priority inversion, no deadlock.  Granted plus
  received-but-not-yielded slots stay within num_workers × prefetch_factor, as torch's in-flight
  batches do; held batches are detached from the ring.

NOTE [ Slots the loop gives back ]
  A slot is whole memory from the moment it exists, where torch's fresh segment fills as the
  batch is stacked.  So when the training loop is the bottleneck (its next batch is already
  here), a worker that needs a slot while none is free waits for the one the loop is about to
  give back instead of getting a new segment: `deferring(True)` around the grants made inside
  next() while the loop will not wait at its next call.  The worker loses nothing (the loop
  would not take its batch sooner), and the ring stays at what is in flight.  Only for large
  slots (above WAIT_MIN_SLOT_BYTES), where a slot is worth saving: a small one costs little, and
  the finished batch it lets a worker keep ready absorbs the loop's jitter.  The loop's next
  next() grants again; whenever the main process is about to wait for a batch, grants are made
  as usual (no deferral), so a worker never waits on a slot that the main process waits on.
  A loop that keeps its batches (`list(loader)`: a slot was detached within the last ring's
  depth of batches, `Ring.keeps_batches`) gives none back: then nothing is deferred and no
  worker is patient.  Where such batches vary in size, a worker may hold a grant to go on with
  whose segment it makes at its next batch's size (NOTE [ Held batches of varying size ] in
  ring.py): it costs nothing before that batch exists, and spares the worker a round trip to a
  main process that is busy with its step.

  The grants made while next() hands a batch over are deferred whether or not the loop will
  wait next: until the loop's next call, it still holds its previous batch (`for b in loader`
  rebinds `b` only once next() returns), so a worker that finishes meanwhile would find every
  slot taken and get a new segment, a slot more than is in flight, made (posix_fallocate) by the
  main process's spare thread: about 45 ms of the training process's CPU per 256 MiB.  At the
  next call that slot is back, and the worker gets it.  The worker waits one loop step at most,
  and only if it needs its slot before then (it fetches its samples first).

  When the loop is about to wait, grants are made as usual, but not a new segment for a worker
  that is ahead: a finished batch of its own is already here, waiting behind the batch the loop
  waits for (`replenish(patient)`).  Its next batch comes after that one in order, so the loop
  never waits on it for this: it gets the slot the loop gives back once the awaited batch is in
  (the loop drops one at each next()).  The worker the loop waits for is never patient (a
  worker's batches come in order, so it has none queued).  Without this, a worker running ahead
  of the other by a few samples made a slot more than is in flight: 4 slots where 3 do, 256 MiB
  more for batches of 256 MiB.

  Where "large" starts.  At 32 MiB (where the grant to go on with stops, AHEAD_MAX_SLOT_BYTES)
  batches of 9-18 MiB kept a slot more than torch-shm keeps batches: 6 slots of 16 MiB for 2
  workers where torch keeps 4-5 batches, a peak of 1.14x torch-shm's (transport, 16 MiB, the
  touching consumer); dict images of 9.2 MiB with a loop slower than the workers, 1.03-1.04x
  torch's.  From 8 MiB up: 0.65x and 0.94-0.97x, at a cost in speed at 16 MiB with a reading
  consumer (loop and workers about even) of 10-15% (1.8-2.1 against 2.0-2.6 ms a batch, still
  5.7x torch-shm): a worker that finishes during the hand-over fetches its next rows on the heap
  and copies them once its grant comes.  Below 8 MiB a slot is under the noise of a Python
  process's memory and speed comes first (1 MiB: NOTE [ Slot grants ]).  With
  prefetch_next_epoch the threshold stays at ACROSS_EPOCHS_WAIT_MIN_SLOT_BYTES: workers made to
  wait for each slot the loop gives back start the next epoch's batches late, and busy at the
  epoch's end, where the loop's iter() runs (epochs workload, 18.3 MiB slots: the first wait of
  epochs 2 and 3 went from 1.00-1.04x the steady wait to 2-3x).

NOTE [ Batches that wait for their turn ]
  Granting in order keeps the earliest batch first, but not before the ring knows its slot size:
  then each worker makes its first slot itself, at once, and in a /dev/shm fitted to fewer slots
  than workers the one that finds no room may be the worker of the batch the loop waits for
  (NOTE [ No room for a worker's first slot ] in worker.py).  Its slot went to later batches,
  which wait in the reorder buffer for it: every slot is taken, the loop waits for a batch that
  can get none.  Before that is an error (`check_not_starved`), the latest such batch is read
  again from a private copy of its slot and its slot's views dropped (`spill`): the slot frees,
  the awaited batch gets it, and the moved batch is delivered in turn from the heap, as torch's
  pickled batches are.  A copy of one batch, only where the loop would otherwise fail; never for
  slots page-locked for pin_memory.
"""

from __future__ import annotations

import os
import weakref

from . import layout
from .protocol import Forget, Grant, NoRoom, Ready
from .ring import CONSUMER_SLOTS, Ring
from .shared_views import SharedStorages

GRANTS_PER_WORKER = 2  # the slot being written + one to go on with (small slots only)
# A grant to go on with saves a worker the round trip to the main process after each batch, but
# holds a whole slot idle meanwhile: worth it while that round trip is a sizeable part of a
# batch's time, not for large slots (NOTE [ Slot grants ]).
AHEAD_MAX_SLOT_BYTES = 32 << 20
# NOTE [ Slots the loop gives back ]: slots above this are worth a worker's wait; with
# prefetch_next_epoch only those above ACROSS_EPOCHS_WAIT_MIN_SLOT_BYTES.
WAIT_MIN_SLOT_BYTES = 8 << 20
ACROSS_EPOCHS_WAIT_MIN_SLOT_BYTES = AHEAD_MAX_SLOT_BYTES


class _Deferral:
    """What SlotScheduler.deferring() returns: its exit ends the deferral."""

    __slots__ = ("scheduler",)

    def __init__(self, scheduler: SlotScheduler):
        self.scheduler = scheduler

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc_info) -> None:
        self.scheduler._defer_new_segments = False


class SlotScheduler:
    """The ring of one iterator and the grants of its `num_workers` workers.

    `send(worker_id, message, fds)` delivers a message: the pool's send, set once the workers
    are started `pinner` page-locks slots for pin_memory (cuda.SlotPinner) or is None."""

    def __init__(self, num_workers: int, prefetch_factor: int, send=None, *, slot_bytes=None,
                 max_slots=None, max_bytes=None, pinner=None, depth=None,
                 wait_min_slot_bytes: int = WAIT_MIN_SLOT_BYTES):
        if depth is None:  # NOTE [ Ring size ] in ring.py; sample_parallel.py asks for fewer
            depth = prefetch_factor * num_workers + CONSUMER_SLOTS
        self.ring = Ring(depth, slot_bytes, max_slots, max_bytes)
        self.send = send
        self._pinner = pinner
        self._release = self.ring.release_callback()
        if pinner is not None:
            self._release = pinner.fence_releases(self._release)  # NOTE [ Release fence ] in cuda.py
        self._known_generation: list[dict[int, int]] = [{} for _ in range(num_workers)]
        self._grants: list[set[int]] = [set() for _ in range(num_workers)]
        self._quota = min(GRANTS_PER_WORKER, prefetch_factor)
        self._wait_min_slot_bytes = wait_min_slot_bytes  # NOTE [ Slots the loop gives back ]
        self._owed: dict[tuple[int, int], int] = {}  # (epoch, idx) -> worker, in send order
        self._defer_new_segments = False  # NOTE [ Slots the loop gives back ]
        self._deferral = _Deferral(self)
        self._patient: frozenset[int] | set[int] = frozenset()  # during replenish(patient)
        self.in_place_bytes = 0  # array bytes workers did not copy (NOTE in worker.py)
        # NOTE [ Views of a storage already in shared memory ] in shared_views.py: the storages
        # mapped, and per slot the batch it holds and the storages that batch views (weakly: a
        # spill needs them only while the batch lives)
        self._shared = SharedStorages()
        self._shared_of_slot: dict[int, tuple[int, tuple[weakref.ref, ...]]] = {}

    # -- what the iterator tells it --------------------------------------------------------------

    def task_sent(self, epoch: int, idx: int, worker_id: int) -> None:
        """A task went to `worker_id`: it will need a slot."""
        self._owed[(epoch, idx)] = worker_id
        self.grant_in_order()

    def result_in(self, epoch: int, idx: int) -> None:
        """The task's result (a batch, an error, an iterable's end) came back."""
        self._owed.pop((epoch, idx), None)

    def ready(self, worker_id: int, message: Ready, fds: list[int], deliver: bool):
        """Take back the slot of a Ready message (adopting a segment the worker made for it) and
        return the batch read from it, or None where `deliver` is False (a stale epoch's)."""
        ring = self.ring
        slot = message.slot
        self.result_in(message.epoch, message.idx)
        self.in_place_bytes += message.in_place
        self._grants[worker_id].discard(slot)
        shared = ()
        if message.shared_bytes:  # the last fds: storages the batch views (NOTE in shared_views.py)
            split = max(0, len(fds) - len(message.shared_bytes))
            fds, shared_fds = fds[:split], fds[split:]
            try:
                shared = self._shared.adopt(shared_fds, message.shared_bytes)  # (closes shared_fds)
            except BaseException:
                for fd in fds:  # a segment made for a batch that cannot be read
                    os.close(fd)
                raise
        if fds:
            ring.adopt(slot, fds[0], message.capacity, message.generation)
            self._known_generation[worker_id][slot] = message.generation
            self._forget_retired()  # other workers' mappings of the pre-growth segment
            if self._pinner is not None:
                self._pinner.pin(ring.segment(slot))  # once per slot segment
        ring.note_pages(slot, message.pages_end)  # NOTE [ A slot's pages follow its batch ] in ring.py
        if not deliver:
            ring.unassign(slot)
            return None
        if shared:
            self._shared_of_slot[slot] = (message.idx, tuple(weakref.ref(storage) for storage in shared))
        else:
            self._shared_of_slot.pop(slot, None)
        return self.deliver(slot, message.idx, shared=shared)

    def no_room(self, worker_id: int, message: NoRoom) -> None:
        """A worker found no room in /dev/shm for its granted slot's first segment and handed the
        grant back: the ring is fitted to the segments alive and on their way (NOTE [ No room for
        a worker's first slot ] in worker.py); the worker's task gets another slot in turn."""
        self._grants[worker_id].discard(message.slot)
        self.ring.no_room(message.slot, message.generation, message.needed, message.free)
        self.grant_in_order()

    def deliver(self, slot: int, idx: int, restore=None, shared: tuple = ()):
        """Lease a READY slot holding batch `idx` and read the batch from it (views on the slot,
        and on the `shared` storages it came with); with `restore`, [(offset, bytes)], from a
        private copy of the slot with those bytes put back (sample_parallel.py's kept rows), the
        slot free again at once."""
        lease, descriptor, payload_end = self.ring.lease(slot, idx, self._release)
        if restore:
            private = bytearray(memoryview(lease)[:payload_end])
            for offset, data in restore:
                private[offset:offset + len(data)] = data
            return layout.read_batch(private, descriptor, payload_end)
        # small leaves as copies, that hold no slot; not pinned ones (NOTE in layout.py)
        copy_upto = layout.small_leaf_limit(self.ring.segment(slot).size) if self._pinner is None else 0
        return layout.read_batch(lease, descriptor, payload_end, copy_upto, shared)

    def fds_for(self, worker_id: int, slot: int) -> tuple[int, ...]:
        """The slot's fd if `worker_id` does not map its current generation yet (it will, once
        sent), else nothing."""
        generation, capacity, _ = self.ring.task_geometry(slot)
        known = self._known_generation[worker_id]
        if capacity and known.get(slot) != generation:
            known[slot] = generation
            return (self.ring.fd(slot),)
        return ()

    def pin(self, segment) -> None:
        """Page-lock a new slot segment for pin_memory (once per segment), if pinning."""
        if self._pinner is not None:
            self._pinner.pin(segment)

    # -- granting ------------------------------------------------------------------------------------

    def grant_in_order(self) -> None:
        """Grant free slots for the tasks whose results are owed (NOTE [ Slot grants ])."""
        owed = [0] * len(self._grants)
        waiting_for_spares = 0
        ring = self.ring
        for worker_id in self._owed.values():
            owed[worker_id] += 1
            if owed[worker_id] > self._quota or len(self._grants[worker_id]) >= owed[worker_id]:
                continue
            ahead = owed[worker_id] > 1  # a grant to go on with: never worth a new segment
            fitted = False
            if ahead:
                fitted = ring.can_grant_fitted()  # NOTE [ Held batches of varying size ] in ring.py
                if not fitted and (not ring.has_free_created_slot() or (ring.slot_bytes or 0) > AHEAD_MAX_SLOT_BYTES):
                    continue
            elif worker_id in self._patient and self._worth_waiting() and not ring.has_free_created_slot():
                continue  # it waits for a slot the loop gives back (NOTE [ Slots the loop gives back ])
            elif not self._slot_available():
                break
            elif ring.should_wait_for_spare():  # NOTE [ Spare segments ] in spares.py
                waiting_for_spares += 1
                continue
            self._grant(worker_id, created_only=ahead and not fitted, fitted_only=fitted)
        ring.want_spares(waiting_for_spares)
        self._forget_retired()

    def _grant(self, worker_id: int, created_only: bool = False, fitted_only: bool = False) -> None:
        ring = self.ring
        slot = ring.take_free_slot(prefer=self._known_generation[worker_id], created_only=created_only,
                                   fitted_only=fitted_only)
        generation, capacity, hint = ring.task_geometry(slot)
        if capacity:
            self.pin(ring.segment(slot))  # a segment made ahead (spares.py): once each
        fds = self.fds_for(worker_id, slot)
        unreserved_from, trim = ring.grant_terms(slot)  # NOTE [ A slot's pages follow its batch ] in ring.py
        self.send(worker_id, Grant(slot, generation, capacity, hint, unreserved_from, trim), fds)
        self._grants[worker_id].add(slot)

    def _forget_retired(self) -> None:
        """Tell the workers that still map a detached or pre-growth segment to unmap it, so that
        its memory goes when the main process's last view does (and stats() tells the truth)."""
        for slot, generation in self.ring.take_retired():
            for worker_id, known in enumerate(self._known_generation):
                if known.get(slot) == generation:
                    del known[slot]
                    self.send(worker_id, Forget(slot, generation))

    def deferring(self, defer: bool) -> _Deferral:
        """`with deferring(defer):` while `defer`, grants take only created free slots
        (NOTE [ Slots the loop gives back ]).  (A plain context manager, not a generator: it runs
        twice at every batch.)"""
        self._defer_new_segments = defer
        return self._deferral

    def _slot_available(self) -> bool:
        """Whether a slot can be granted now: a free one, one whose copy fence completes (waiting
        for it beats a new segment), or a held one to detach within the user's cap; while
        deferring, only a free one that has its segment."""
        ring = self.ring
        ring.collect_released()
        if ring.has_free_created_slot():
            return True
        if not ring.has_free_slot() and self._pinner is not None and self._pinner.pending():
            self._pinner.pump(wait=True)  # NOTE [ Release fence ] in cuda.py
            ring.collect_released()
            if ring.has_free_created_slot():
                return True
        if self._defer_new_segments and ring.held() and self._worth_waiting():
            return False  # the loop gives one back before it waits (NOTE [ Slots the loop ... ])
        return ring.can_take()  # a free slot whose segment may be made, or a held one to detach

    def replenish(self, patient: frozenset[int] | set[int] = frozenset()) -> None:
        """Take back released slots and grant them to workers that have work; the `patient`
        ones (a finished batch of theirs waits for the loop) get no new large segment
        (NOTE [ Slots the loop gives back ])."""
        if self._pinner is not None:
            self._pinner.pump()  # NOTE [ Release fence ] in cuda.py
        self.ring.collect_released()
        self.ring.drain_spare_wakeups()
        self._patient = patient
        try:
            self.grant_in_order()
        finally:
            self._patient = frozenset()

    def _worth_waiting(self) -> bool:
        """Whether a worker should wait for the slot the loop gives back rather than get a new
        one: large slots, and a loop that gives them back (not one that keeps its batches)."""
        return self.large_slots and not self.ring.keeps_batches()

    @property
    def large_slots(self) -> bool:
        """Whether a slot is worth a worker's wait (NOTE [ Slots the loop gives back ])."""
        return (self.ring.slot_bytes or 0) > self._wait_min_slot_bytes

    def check_not_starved(self, spill=None) -> None:
        """Raise RingFullError (ShmCapacityError) if no worker with work can ever get a slot:
        every one that owes a result has no grant, and the ring can neither free nor detach one
        (a user's cap, or the room in /dev/shm), not even when `spill()` moves a batch that waits
        for its turn out of its slot (NOTE [ Batches that wait for their turn ])."""
        owing = set(self._owed.values())
        if not owing or any(self._grants[w] for w in owing):
            return
        if self._pinner is not None:
            self._pinner.pump(wait=True)  # slots waiting for their copies' fence come back
        self.ring.make_room(spill)  # collects garbage once, raises if still full
        self.grant_in_order()

    def spill(self, slot: int, generation: int, idx: int):
        """Batch `idx`, read again from a private copy of `slot` (of `generation`), whose lease
        then dies with the old batch's views; None where the slot no longer holds it, or where
        slots are page-locked (a copy would not be)."""
        if self._pinner is not None:
            return None
        shared = ()
        held = self._shared_of_slot.get(slot)
        if held is not None and held[0] == idx:  # the storages its views keep alive
            shared = tuple(ref() for ref in held[1])
            if any(storage is None for storage in shared):
                return None
        found = self.ring.copy_out(slot, generation, idx)
        if found is None:
            return None
        private, descriptor, payload_end = found
        return layout.read_batch(private, descriptor, payload_end, 0, shared)

    @property
    def wakeup_fd(self) -> int:
        """Readable when a spare segment is ready to be granted (NOTE [ Spare segments ])."""
        return self.ring.spare_wakeup_fd

    def close(self) -> None:
        self._shared_of_slot.clear()
        self._shared.clear()
        self.ring.close()
