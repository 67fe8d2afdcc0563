"""shmloader/scheduler.py on its own: grants in send order within each worker's quota, a slot's
fd sent once per generation, slots taken back and granted again, Forget for replaced segments,
RingFullError under a cap.  The workers are played in-process: a grant is written as worker.py
writes it (a slot without a segment gets one at generation + 1) and handed back with Ready."""

from __future__ import annotations

import os

import numpy as np
import pytest

from shmloader import RingFullError, _ring, layout
from shmloader.protocol import Forget, Grant, Ready
from shmloader.scheduler import (
    AHEAD_MAX_SLOT_BYTES,
    GRANTS_PER_WORKER,
    WAIT_MIN_SLOT_BYTES,
    SlotScheduler,
)
from shmloader.segment import create_segment

pytestmark = [pytest.mark.timeout(30)]


class Workers:
    """The workers' side: the messages each got, its segments, and its writing."""

    def __init__(self, count: int):
        self.inbox: list[list[tuple]] = [[] for _ in range(count)]
        self.mapped: list[dict[int, tuple[int, object]]] = [{} for _ in range(count)]

    def send(self, worker_id, message, fds=()):
        self.inbox[worker_id].append((message, tuple(fds)))
        if type(message) is Grant and fds:
            segment = _ring.Segment(os.dup(fds[0]), message.capacity)  # SCM_RIGHTS gives a copy
            segment.close_fd()
            self.mapped[worker_id][message.slot] = (message.generation, segment)

    def grants(self, worker_id) -> list[Grant]:
        return [m for m, _ in self.inbox[worker_id] if type(m) is Grant]

    def write(self, scheduler, worker_id, grant: Grant, epoch: int, idx: int, value: float, nbytes: int = 4096):
        """Write a batch into the granted slot, as a worker does, and hand it back."""
        plan = layout.plan_batch(np.full(nbytes // 8, value))
        fds: list[int] = []
        if grant.capacity == 0 or plan.total_bytes > grant.capacity:
            segment = create_segment(max(grant.hint, plan.total_bytes), grant.generation + 1)
            generation, fds = grant.generation + 1, [os.dup(segment.fd)]  # the copy SCM_RIGHTS makes
        else:
            generation, segment = self.mapped[worker_id][grant.slot]
        assert segment.claim(worker_id, idx) == _ring.FREE
        layout.write_batch(segment, plan)
        segment.publish(len(plan.descriptor), plan.total_bytes, plan.descriptor_offset)
        ready = Ready(epoch, idx, grant.slot, generation, segment.size, 0)
        batch = scheduler.ready(worker_id, ready, fds, deliver=True)
        if fds:
            self.mapped[worker_id][grant.slot] = (generation, segment)
            segment.close_fd()
        return batch


@pytest.fixture(autouse=True)
def no_spares(monkeypatch):
    monkeypatch.setenv("SHMLOADER_SPARE_SLOTS", "0")  # segments made by the workers: deterministic


def scheduler_for(workers: Workers, prefetch_factor: int = 2, **kwargs) -> SlotScheduler:
    return SlotScheduler(len(workers.inbox), prefetch_factor, workers.send, **kwargs)


def test_grants_go_in_send_order_within_each_workers_quota():
    workers = Workers(2)
    scheduler = scheduler_for(workers, prefetch_factor=3)
    try:
        for idx in range(6):
            scheduler.task_sent(0, idx, idx % 2)
        # Nothing created yet: one grant per worker (a second would only be worth a created slot).
        assert [len(workers.grants(w)) for w in range(2)] == [1, 1]
        batch = workers.write(scheduler, 0, workers.grants(0)[0], 0, 0, 1.0)
        assert float(batch[0]) == 1.0
        scheduler.grant_in_order()
        grants = workers.grants(0)
        assert len(grants) == 2 and grants[1].slot != grants[0].slot  # the first is still leased
        assert GRANTS_PER_WORKER == 2
    finally:
        scheduler.close()


def test_a_freed_slot_is_granted_again_with_its_fd_only_once():
    workers = Workers(1)
    scheduler = scheduler_for(workers, prefetch_factor=1)
    try:
        seen = []
        for idx in range(4):
            scheduler.task_sent(0, idx, 0)
            grant = workers.grants(0)[-1]
            seen.append((grant, workers.inbox[0][-1][1]))
            batch = workers.write(scheduler, 0, grant, 0, idx, float(idx))
            assert float(batch[-1]) == float(idx)
            del batch  # the lease dies: the slot comes back
            scheduler.replenish()
        slots = {g.slot for g, _ in seen}
        assert len(slots) == 1, seen  # one slot, reused
        first, second, third = seen[0], seen[1], seen[2]
        assert first[0].capacity == 0 and first[1] == ()  # made by the worker
        assert second[0].capacity > 0 and second[1] == ()  # the worker made it: it knows it
        assert third[1] == ()
    finally:
        scheduler.close()


def test_workers_that_map_a_replaced_segment_are_told_to_forget_it():
    workers = Workers(2)
    scheduler = scheduler_for(workers, prefetch_factor=1)
    try:
        scheduler.task_sent(0, 0, 0)
        batch = workers.write(scheduler, 0, workers.grants(0)[-1], 0, 0, 1.0)
        slot = workers.grants(0)[-1].slot
        del batch
        scheduler.task_sent(0, 1, 1)  # worker 1 gets the same (freed) slot, with its fd
        grant = workers.grants(1)[-1]
        assert grant.slot == slot and workers.inbox[1][-1][1] != ()
        del grant
        scheduler.task_sent(0, 2, 0)
        workers.write(scheduler, 1, workers.grants(1)[-1], 0, 1, 2.0, nbytes=1 << 20)  # grows it
        forgets = [m for m, _ in workers.inbox[0] if type(m) is Forget]
        assert forgets and forgets[-1].slot == slot, workers.inbox[0]
    finally:
        scheduler.close()


def test_a_capped_ring_whose_slots_are_all_held_raises_ring_full():
    workers = Workers(2)
    scheduler = scheduler_for(workers, prefetch_factor=1, max_slots=2)
    try:
        held = []
        for idx in range(2):
            scheduler.task_sent(0, idx, idx)
            held.append(workers.write(scheduler, idx, workers.grants(idx)[-1], 0, idx, 1.0))
        scheduler.task_sent(0, 2, 0)
        with pytest.raises(RingFullError):
            scheduler.check_not_starved()
        del held
        scheduler.replenish()  # a slot comes back: the owed task gets it
        assert len(workers.grants(0)) == 2
    finally:
        scheduler.close()


@pytest.mark.parametrize("nbytes,ahead", [(4096, True), (AHEAD_MAX_SLOT_BYTES + 4096, False)])
def test_a_grant_to_go_on_with_only_for_small_slots(nbytes, ahead):
    """A worker that owes two batches gets a second, created, free slot ahead only while slots
    are small: a large slot would sit idle a whole batch (NOTE [ Slot grants ])."""
    workers = Workers(1)
    scheduler = scheduler_for(workers, prefetch_factor=2)
    try:
        for idx in range(2):  # two slots made, then both free again
            scheduler.task_sent(0, idx, 0)
        batches = [workers.write(scheduler, 0, grant, 0, idx, 1.0, nbytes)
                   for idx, grant in enumerate(workers.grants(0)[:1])]
        scheduler.grant_in_order()
        batches.append(workers.write(scheduler, 0, workers.grants(0)[1], 0, 1, 2.0, nbytes))
        del batches
        scheduler.replenish()
        before = len(workers.grants(0))
        scheduler.task_sent(0, 2, 0)
        scheduler.task_sent(0, 3, 0)
        assert len(workers.grants(0)) - before == (2 if ahead else 1)
    finally:
        scheduler.close()


@pytest.mark.parametrize("large", [True, False])
def test_while_deferring_a_grant_waits_for_the_slot_the_loop_holds(large):
    """NOTE [ Slots the loop gives back ]: for large slots, no new segment while the loop holds
    one and will give it back before it waits; without deferral (the main process about to
    wait) one is made. Small slots are never deferred."""
    workers = Workers(1)
    # the test's slots are small: with the threshold at 0 every slot counts as large
    scheduler = scheduler_for(workers, prefetch_factor=1, wait_min_slot_bytes=0 if large else WAIT_MIN_SLOT_BYTES)
    try:
        if not large:
            scheduler.task_sent(0, 0, 0)
            held = workers.write(scheduler, 0, workers.grants(0)[-1], 0, 0, 1.0)
            with scheduler.deferring(True):
                scheduler.task_sent(0, 1, 0)
            assert len(workers.grants(0)) == 2  # a new one at once: small slots are cheap
            del held
            return
        scheduler.task_sent(0, 0, 0)
        held = workers.write(scheduler, 0, workers.grants(0)[-1], 0, 0, 1.0)  # the loop holds it
        with scheduler.deferring(True):
            scheduler.task_sent(0, 1, 0)
        assert len(workers.grants(0)) == 1  # waits: the only slot is in the loop's hand
        with scheduler.deferring(True):
            scheduler.replenish()
        assert len(workers.grants(0)) == 1
        del held  # given back: granted again even while deferring, no new segment
        with scheduler.deferring(True):
            scheduler.replenish()
        grants = workers.grants(0)
        assert len(grants) == 2 and grants[1].slot == grants[0].slot and grants[1].capacity > 0
        held = workers.write(scheduler, 0, grants[1], 0, 1, 2.0)
        scheduler.task_sent(0, 2, 0)  # not deferring: the loop may wait on it, a new slot
        grants = workers.grants(0)
        assert len(grants) == 3 and grants[2].slot != grants[1].slot and grants[2].capacity == 0
        del held
    finally:
        scheduler.close()



@pytest.mark.parametrize("ahead", [True, False])
def test_a_worker_ahead_waits_for_the_slot_the_loop_gives_back(monkeypatch, ahead):
    """NOTE [ Slots the loop gives back ]: a worker with a finished batch waiting for the loop
    (`patient`) gets no new large segment while none is free, even when the main process is
    about to wait, and then the slot the loop gives back; a worker not ahead gets a new one."""
    from shmloader import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "AHEAD_MAX_SLOT_BYTES", 0)  # every slot counts as large
    workers = Workers(1)
    scheduler = scheduler_for(workers, prefetch_factor=2, wait_min_slot_bytes=0)
    try:
        scheduler.task_sent(0, 0, 0)
        held = workers.write(scheduler, 0, workers.grants(0)[-1], 0, 0, 1.0)  # in the loop's hand
        scheduler.task_sent(0, 1, 0)
        queued = workers.write(scheduler, 0, workers.grants(0)[-1], 0, 1, 2.0)  # waits for the loop
        with scheduler.deferring(True):
            scheduler.task_sent(0, 2, 0)  # owed, not granted yet
        assert len(workers.grants(0)) == 2
        scheduler.replenish(patient={0} if ahead else frozenset())  # the main process is about to wait
        grants = workers.grants(0)
        if not ahead:
            assert len(grants) == 3 and grants[-1].capacity == 0  # a new segment at once
            return
        assert len(grants) == 2  # none free: it waits
        del held  # the loop gives batch 0's slot back
        scheduler.replenish(patient={0})
        grants = workers.grants(0)
        assert len(grants) == 3 and grants[-1].slot == grants[0].slot and grants[-1].capacity > 0
        del queued
    finally:
        scheduler.close()
