"""ShmDataLoader: torch's DataLoader, with batches carried through a ring of shared-memory slots.

    sampler ──indices──▶ worker k ──(fetch, collate straight into slot s)──▶ ring slot s
       ▲                                                                         │
       │                "batch n is in slot s" (a few ints over a socket)        │
       └── main: reorder by n ◀──────────────────────────────────────────────────┘
              └─▶ wrap slot s as tensors (zero-copy views holding the slot's lease)

What one `next()` does, step by step:
  1. read whatever the workers have reported (without waiting), take back the slots whose
     batches the user has dropped (their leases died) and grant free slots to workers;
  2. if batch `rcvd_idx` is not in yet, wait on every worker's socket and process sentinel
     (bounded waits: a dead worker or `timeout` raises, never a hang);
  3. validate the slot's header, unpickle its small descriptor with views onto the slot;
  4. send the next task (indices) to the next worker in round-robin order; return the batch.

NOTE [ Slot grants ]
  Tasks carry no slot.  Each worker holds up to GRANTS_PER_WORKER free slots granted by the main
  process ("grant" messages, with the segment's fd the first time that worker sees it) and writes
  each finished batch into one of them; the "ready" message hands the slot back, and the main
  process grants another.  So a slot is bound only to a batch that exists: the ring's depth
  (NOTE [ Ring size ]) is a cap, and the slots actually created are about the granted ones plus
  the batches waiting to be consumed, far fewer than num_workers × prefetch_factor when the
  training loop keeps up.  A worker that has a batch and no grant waits for one on its socket.
  When no slot is free because the training loop holds batches, the ring detaches the
  longest-held one (NOTE [ Held batches ] in ring.py) and the workers that mapped it are told to
  forget it ("forget" messages), as they are for a slot's pre-growth segment.  Only under a cap
  the user set can a worker wait for good: then RingFullError.

Order, seeding, `len()`, epochs, `persistent_workers`, `in_order` and iterable datasets follow
torch's `_MultiProcessingDataLoaderIter` exactly (this iterator derives from torch's base class,
so the sampler and the seeds are drawn in the same order from the same generator).

NOTE [ Shutdown ]
  At the end of an epoch (unless persistent), on `del`, on an error or on Ctrl-C: send "stop" to
  every worker, give them a moment, terminate the rest (safe: slot segments have no names to leak
  and the kernel closes their fds), join, close the sockets and the process sentinels, then close
  the ring.  Slots whose batches the user still holds stay mapped until those views are freed.
  A shutdown caused by an error leaves the iterator *broken*: every later next() raises
  LoaderBrokenError (its __cause__ the original error) rather than end the epoch quietly; an
  epoch that simply ended raises StopIteration.  A worker's own exception inside a task is not
  an error of the loader: it is raised at its batch's turn and the epoch goes on, as in torch.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import select
import time
import weakref
from dataclasses import dataclass
from multiprocessing import connection as mp_connection
from typing import TypeVar

import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils import collate as torch_collate
from torch.utils.data.dataloader import _BaseDataLoaderIter

from . import diagnosis, layout, state
from .channel import Channel, ChannelClosed
from .crashlog import CrashLog
from .errors import (
    LoaderBrokenError,
    LoaderTimeoutError,
    RemoteTraceback,
    SlotProtocolError,
    WorkerDiedError,
    WorkerError,
)
from .ring import CONSUMER_SLOTS, Ring, RingStats, create_segment
from .timing import BatchClock, init_block, read_block, timing_enabled
from .worker import (
    BOOTING,
    COLLATE_CONVERT,
    COLLATE_CUSTOM,
    COLLATE_INTO_SLOT,
    Shipped,
    WorkerSpec,
    describe_stage,
    status_offset,
    worker_main,
)

GRANTS_PER_WORKER = 2  # NOTE [ Slot grants ]: the slot being written + one to go on with
POLL_SECONDS = 0.5  # longest blind wait: sentinels and timeouts are checked at least this often
STOP_GRACE_SECONDS = 0.5  # how long stopped workers get before they are terminated

_T_co = TypeVar("_T_co", covariant=True)


@dataclass(frozen=True)
class LoaderStats:
    """A snapshot of the loader's shared memory and control channel (NOTE [ Ring size ] and
    NOTE [ Held batches ] in ring.py).

    ring_slots: the ring's working depth; slot_bytes: the size a new slot gets;
    ring_bytes: shared memory of the ring's own slots; held_segments / held_bytes: segments
    detached from the ring for batches the training loop holds, still alive;
    reserved_bytes: all shared memory reserved now (ring + held); in_use_bytes: of which hold a
    batch now (being written, waiting, or held); detached: slots handed over to held batches so
    far; slot_grows: slots replaced by a larger segment so far; made_ahead: slot segments made
    ahead of need, off the workers' path (NOTE [ Spare segments ] in spares.py); in_place_bytes: array bytes that a
    numpy collate_fn built in their slot, so that no copy was made (NOTE [ One copy for a numpy
    collate_fn ] in worker.py); timing: where the time goes and the verdict (diagnosis.py;
    None with SHMLOADER_TIMING=0).  print() it for a table, as_dict() for logging."""

    ring_slots: int
    slot_bytes: int
    ring_bytes: int
    held_segments: int
    held_bytes: int
    reserved_bytes: int
    in_use_bytes: int
    detached: int
    slot_grows: int
    made_ahead: int
    batches: int
    in_place_bytes: int
    control_bytes: int
    control_messages: int
    timing: diagnosis.LoaderTiming | None = None

    @property
    def control_bytes_per_batch(self) -> float:
        return self.control_bytes / self.batches if self.batches else 0.0

    def as_dict(self) -> dict:
        """Plain, JSON-ready values, `timing` nested (LoaderStats.from_dict rebuilds it)."""
        return diagnosis.stats_as_dict(self)

    @classmethod
    def from_dict(cls, data: dict) -> LoaderStats:
        timing = data.get("timing")
        return cls(**{**data, "timing": diagnosis.LoaderTiming.from_dict(timing) if timing else None})

    def __str__(self) -> str:
        return diagnosis.format_stats(self)


class ShmDataLoader(DataLoader[_T_co]):
    """A drop-in for `torch.utils.data.DataLoader` whose workers hand over batches through shared
    memory.  Takes every DataLoader argument, plus:

    slot_bytes: initial size of each ring slot; by default learnt from the first batch (its size
        rounded to pages).  A batch larger than its slot grows that slot (1/8 headroom, at least
        1.5 × its size); nothing is ever written past a slot.
    max_ring_slots, max_ring_bytes: a cap on the shared-memory segments alive at once (the
        ring's and those of batches the training loop holds), only if you want one; past it,
        RingFullError.  By default held batches take what they need, as with torch
        (NOTE [ Held batches ] in ring.py).
    """

    def __init__(self, dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None,
                 num_workers=0, collate_fn=None, pin_memory=False, drop_last=False, timeout=0,
                 worker_init_fn=None, multiprocessing_context=None, generator=None, *,
                 prefetch_factor=None, persistent_workers=False, pin_memory_device="",
                 in_order=True, slot_bytes: int | None = None, max_ring_slots: int | None = None,
                 max_ring_bytes: int | None = None):
        for name, value, least in (("slot_bytes", slot_bytes, 1), ("max_ring_slots", max_ring_slots, 1),
                                   ("max_ring_bytes", max_ring_bytes, 1)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
                raise ValueError(f"{name} must be an int >= {least} or None, got {value!r}")
        super().__init__(
            dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
            batch_sampler=batch_sampler, num_workers=num_workers, collate_fn=collate_fn,
            pin_memory=pin_memory, drop_last=drop_last, timeout=timeout,
            worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
            generator=generator, prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers, pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        self.slot_bytes = slot_bytes
        self.max_ring_slots = max_ring_slots
        self.max_ring_bytes = max_ring_bytes
        self._last_iterator: weakref.ref | None = None
        self._final_stats: LoaderStats | None = None
        self._timing = timing_enabled()  # NOTE [ Stage clocks ] in timing.py

    def __iter__(self):
        if getattr(self._iterator, "_shutdown", False):
            self._iterator = None  # a persistent iterator shut down by an error: start afresh
        return state.start_epoch(self, super().__iter__)  # NOTE [ Resuming mid-epoch ] in state.py

    def _get_iterator(self):
        if self.num_workers == 0:
            return state.SingleProcessIter(self)  # in-process (torch's, resumable): nothing to transport
        self.check_worker_number_rationality()
        iterator = _ShmLoaderIter(self)
        self._last_iterator = weakref.ref(iterator)
        return iterator

    def state_dict(self) -> dict:
        """Where the loader is in its epoch, to resume there later with load_state_dict(), in this
        process or another (torchdata's StatefulDataLoader contract; NOTE [ Resuming mid-epoch ]
        in state.py).  Before any iteration it starts the iterator that the next iter() uses."""
        return state.loader_state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Make the next iter() resume from `state_dict` (from state_dict() of a loader built with
        the same arguments); a state it cannot resume from is a ValueError saying why."""
        state.load_loader_state(self, state_dict)

    def stats(self) -> LoaderStats | None:
        """The ring and control-channel figures of the latest iterator (None before the first)."""
        iterator = self._last_iterator() if self._last_iterator is not None else None
        if iterator is not None and not iterator._shutdown:
            return iterator.stats()
        return self._final_stats


class _Failure:
    """A worker's exception, to be raised when its batch's turn comes (as torch does)."""

    def __init__(self, worker_id: int, pid: int | None, idx: int | None, stage: str, payload: tuple):
        self.worker_id, self.pid, self.idx, self.stage, self.payload = worker_id, pid, idx, stage, payload

    def reraise(self):
        blob, type_name, message, text = self.payload
        where = f"in DataLoader worker {self.worker_id} (pid {self.pid}) while {self.stage}"
        if self.idx is not None:
            where += f" for batch {self.idx}"
        else:  # outside any task: the worker has exited
            where += "; the worker exited and the loader has been shut down"
        original = None
        if blob is not None:
            try:
                import pickle

                original = pickle.loads(blob)
            except Exception:
                original = None
        summary = f"Caught {type_name.rsplit('.', 1)[-1]} {where}.\nOriginal {text}"
        exc: BaseException = WorkerError(summary)
        if original is not None:
            try:
                exc = type(original)(summary)
            except Exception:
                # A type whose constructor takes its fields (ShmCapacityError from a slot's
                # growth): raise the worker's own instance, fields intact, with our summary.
                original.args = (summary,)
                exc = original
        exc.worker_id, exc.worker_stage = self.worker_id, self.stage  # type: ignore[attr-defined]
        raise exc from RemoteTraceback(text)


_END = object()  # an iterable worker's stream is exhausted


class _Poller:
    """poll(2) over a fixed set of fds, registered once (multiprocessing.connection.wait builds
    a selector per call, which costs more than the wait itself when the loop waits per batch).
    Errors and hang-ups count as ready: reading then says what happened."""

    def __init__(self, fds: list[int]):
        self._poll = select.poll()
        for fd in fds:
            self._poll.register(fd, select.POLLIN)

    def ready(self, timeout: float) -> list[int]:
        """The fds readable (or hung up) within `timeout` seconds."""
        return [fd for fd, _ in self._poll.poll(max(0, math.ceil(timeout * 1000)))]


class _ShmLoaderIter(_BaseDataLoaderIter):
    def __init__(self, loader: ShmDataLoader) -> None:
        super().__init__(loader)
        self._resumable = state.IterState.attach(self, loader)  # a loaded state's seed, before the workers start
        self._prefetch_factor = loader.prefetch_factor
        # torch's own check (an AssertionError there too); without it no task is ever sent
        assert self._prefetch_factor > 0, "prefetch_factor must be greater than 0"
        self._in_order = getattr(loader, "in_order", True)
        self._shutdown = False
        self._workers: list = []
        self._channels: list[Channel] = []
        self._status = None  # one [stage, batch] word per worker, read when a worker dies
        self._crash_logs: list[CrashLog] = []  # each worker's faulthandler output
        self._broken: str | None = None  # "Type: message" of the error that shut it down
        self._ring: Ring | None = None
        self._final_ring_stats: RingStats | None = None
        self._batches = 0
        self._in_place_bytes = 0  # array bytes workers did not copy (NOTE in worker.py)
        self._clock = BatchClock(getattr(loader, "_timing", True))  # NOTE [ Stage clocks ]
        self._final_worker_times: list | None = None  # read at shutdown, before the workers go
        self._epoch = 0
        self._loader_ref = weakref.ref(loader)
        context = loader.multiprocessing_context or torch.multiprocessing
        start_method = context.get_start_method()
        max_tasks = self._prefetch_factor * self._num_workers
        self._ring = Ring(max_tasks + CONSUMER_SLOTS, loader.slot_bytes, loader.max_ring_slots,
                          getattr(loader, "max_ring_bytes", None))
        self._release = self._ring.release_callback()
        self._known_generation: list[dict[int, int]] = [{} for _ in range(self._num_workers)]
        self._grants: list[set[int]] = [set() for _ in range(self._num_workers)]
        self._grant_quota = min(GRANTS_PER_WORKER, self._prefetch_factor)
        # (epoch, batch) -> worker, in the order sent: tasks whose result has not come back yet
        self._unreceived: dict[tuple[int, int], int] = {}
        self._events: collections.deque = collections.deque()  # results read ahead of their wait
        self._pinner = None
        if self._pin_memory:  # torch's base class set this only where an accelerator exists
            from .cuda import SlotPinner

            self._pinner = SlotPinner(self._pin_memory_device)
            self._release = self._pinner.fence_releases(self._release)  # NOTE [ Release fence ]

        if self._auto_collation and self._collate_fn is torch_collate.default_collate:
            mode = COLLATE_INTO_SLOT
        elif not self._auto_collation and self._collate_fn is torch_collate.default_convert:
            mode = COLLATE_CONVERT
        else:
            mode = COLLATE_CUSTOM
        payload = Shipped((self._dataset, self._collate_fn if mode == COLLATE_CUSTOM else None,
                           loader.worker_init_fn))
        try:
            self._status = create_segment(status_offset(self._num_workers), 0, "the workers' status words")
            for worker_id in range(self._num_workers):  # what a worker dead before its first word did
                init_block(self._status, status_offset(worker_id), BOOTING, self._clock.enabled)
            for worker_id in range(self._num_workers):
                channel, child_sock = Channel.pair()
                self._channels.append(channel)
                crash_log = CrashLog()
                self._crash_logs.append(crash_log)
                channel.send(("status", self._status.size), (self._status.fd, crash_log.write_fd))
                crash_log.close_write_end()
                spec = WorkerSpec(
                    worker_id=worker_id, num_workers=self._num_workers, base_seed=self._base_seed,
                    dataset_kind=self._dataset_kind, auto_collation=self._auto_collation,
                    collate_mode=mode, drop_last=self._drop_last, payload=payload,
                    main_pid=os.getpid(), forked=start_method == "fork",
                    ring_depth=self._ring.depth, resume_state=self._resumable.worker_resume(worker_id),
                )
                process = context.Process(target=worker_main, args=(spec, child_sock),
                                          name=f"shmloader-worker-{worker_id}", daemon=True)
                try:
                    process.start()
                finally:
                    child_sock.close()
                self._workers.append(process)
        except BaseException:
            self._shutdown_workers()
            raise
        # What every wait selects on, built once (the workers are fixed for this iterator).
        self._channel_of = {c.fileno(): (worker_id, c) for worker_id, c in enumerate(self._channels)}
        self._channel_fds = list(self._channel_of)
        self._sentinel_of = {p.sentinel: worker_id for worker_id, p in enumerate(self._workers)}
        # ... and the spare-segment thread's wake-ups (NOTE [ Spare segments ] in spares.py)
        self._wait_fds = self._channel_fds + list(self._sentinel_of) + [self._ring.spare_wakeup_fd]
        self._everything = _Poller(self._wait_fds)  # polled at every wait and read-ahead, made once
        self._messages = _Poller(self._channel_fds)
        self._reset(loader, first_iter=True)

    # -- epochs ------------------------------------------------------------------------------------

    def _reset(self, loader, first_iter=False) -> None:
        self._resumable.before_epoch(loader, first_iter)  # the RNG states the sampler starts from
        super()._reset(loader, first_iter)
        self._clock.new_epoch()
        self._send_idx = 0
        self._rcvd_idx = 0
        self._task_info: dict[int, tuple] = {}
        self._tasks_outstanding = 0
        self._workers_status = [True] * self._num_workers
        self._workers_num_tasks = [0] * self._num_workers
        self._worker_queue_idx_cycle = itertools.cycle(range(self._num_workers))
        if not first_iter:
            self._events.clear()  # read ahead in the last epoch, never delivered: free their slots
            self._epoch += 1
            for worker_id in range(self._num_workers):
                self._send(worker_id, ("resume", self._epoch))
            self._resumed = 0
            # Stale results of the last epoch arrive before each worker's "resumed" and free
            # their slots here.
            self._wait_for_event(until=lambda: self._resumed >= self._num_workers)
        self._resumable.before_prime(self, loader, first_iter)  # resume a loaded state
        for _ in range(self._prefetch_factor * self._num_workers):
            self._try_put_index()

    # -- dispatch ----------------------------------------------------------------------------------

    def _next_index(self):
        index = super()._next_index()
        self._resumable.on_index(self)  # the sampler's position as of this task
        return index

    def _try_put_index(self) -> None:
        max_tasks = self._prefetch_factor * self._num_workers
        assert self._tasks_outstanding < max_tasks, "more tasks outstanding than prefetch allows"
        try:
            index = self._next_index()
        except StopIteration:
            return
        for _ in range(self._num_workers):  # the next active worker, as torch picks it
            worker_id = next(self._worker_queue_idx_cycle)
            if self._workers_status[worker_id]:
                if self._in_order:
                    break
                if self._workers_num_tasks[worker_id] < max_tasks // sum(self._workers_status):
                    break
        else:
            return
        self._send(worker_id, ("task", self._epoch, self._send_idx, index))
        self._unreceived[(self._epoch, self._send_idx)] = worker_id
        self._grant_in_order()
        self._task_info[self._send_idx] = (worker_id,)
        self._workers_num_tasks[worker_id] += 1
        self._tasks_outstanding += 1
        self._send_idx += 1

    def _grant_in_order(self) -> None:
        """Grant free slots for the tasks whose results are owed, in the order the tasks were
        sent, up to GRANTS_PER_WORKER ahead per worker (NOTE [ Slot grants ]).

        A worker writes its tasks in order, so its k-th grant serves its k-th owed task; granting
        in send order keeps the granted tasks a prefix of the owed ones.  When slots are scarce
        (a cap the user set) the earliest batch is the one that gets the slot, never a later one
        that would only wait in the reorder buffer: no priority inversion, no deadlock.  Granted
        plus received-but-not-yielded slots stay within num_workers × prefetch_factor, as torch's
        in-flight batches do; held batches are detached from the ring (NOTE [ Held batches ])."""
        owed = [0] * self._num_workers
        waiting_for_spares = 0
        for worker_id in self._unreceived.values():
            owed[worker_id] += 1
            if owed[worker_id] > self._grant_quota or len(self._grants[worker_id]) >= owed[worker_id]:
                continue
            ahead = owed[worker_id] > 1  # a grant to go on with: never worth a new segment
            if ahead:
                if not self._ring.has_free_created_slot():
                    continue
            elif not self._slot_available():
                break
            elif self._ring.should_wait_for_spare():  # NOTE [ Spare segments ] in spares.py
                waiting_for_spares += 1
                continue
            self._grant(worker_id, created_only=ahead)
        self._ring.want_spares(waiting_for_spares)
        self._forget_retired()

    def _grant(self, worker_id: int, created_only: bool = False) -> None:
        ring = self._ring
        slot = ring.take_free_slot(prefer=self._known_generation[worker_id], created_only=created_only)
        generation, capacity, hint = ring.task_geometry(slot)
        if capacity and self._pinner is not None:
            self._pinner.pin(ring.segment(slot))  # a segment made ahead (spares.py): once each
        fds: tuple[int, ...] = ()
        if capacity and self._known_generation[worker_id].get(slot) != generation:
            fds = (ring.fd(slot),)
            self._known_generation[worker_id][slot] = generation
        self._send(worker_id, ("grant", slot, generation, capacity, hint), fds)
        self._grants[worker_id].add(slot)

    def _send(self, worker_id: int, message: tuple, fds: tuple[int, ...] = ()) -> None:
        """Send to a worker; a socket its end of which is gone means the worker is gone, and it
        is reported as such (with its last words, if it sent any), never as a BrokenPipeError."""
        try:
            self._channels[worker_id].send(message, fds)
        except (BrokenPipeError, ConnectionResetError):
            self._worker_died(worker_id)

    def _forget_retired(self) -> None:
        """Tell the workers that still map a detached or pre-growth segment to unmap it, so that
        its memory goes when the main process's last view does (and stats() tells the truth)."""
        for slot, generation in self._ring.take_retired():
            for worker_id, known in enumerate(self._known_generation):
                if known.get(slot) == generation:
                    del known[slot]
                    self._send(worker_id, ("forget", slot, generation))

    def _slot_available(self) -> bool:
        """Whether a slot can be granted now: a free one, one whose copy fence completes (waiting
        for it beats a new segment), or a held one to detach within the user's cap."""
        ring = self._ring
        ring.collect_released()
        if ring.has_free_slot():
            return True
        if self._pinner is not None and self._pinner.pending():
            self._pinner.pump(wait=True)  # NOTE [ Release fence ] in cuda.py
            ring.collect_released()
        return ring.can_take()

    def _replenish(self) -> None:
        """Take back released slots and grant them to workers that have work."""
        if self._pinner is not None:
            self._pinner.pump()  # NOTE [ Release fence ] in cuda.py
        self._ring.collect_released()
        self._ring.drain_spare_wakeups()
        self._grant_in_order()

    def _check_not_starved(self) -> None:
        """Raise RingFullError if no worker with work can ever get a slot: every one that owes a
        result has no grant, and the ring can neither free nor detach one (a user's cap)."""
        owing = set(self._unreceived.values())
        if not owing or any(self._grants[w] for w in owing):
            return
        if self._pinner is not None:
            self._pinner.pump(wait=True)  # slots waiting for their copies' fence come back
        self._ring.make_room()  # collects garbage once, raises if still full
        self._grant_in_order()

    # -- the next batch ------------------------------------------------------------------------------

    def __next__(self):
        return self._resumable.next(self, super().__next__)  # a pending fast-forward, the epoch's end

    def _next_data(self):
        if self._shutdown:  # NOTE [ Shutdown ]: ended (StopIteration) or broken (raise again)
            if self._broken is not None:
                raise LoaderBrokenError(
                    f"this DataLoader iterator was shut down by an earlier error ({self._broken}); "
                    "start a new epoch with iter(loader)"
                )
            raise StopIteration
        start = self._clock.begin()
        try:
            data = self._next_data_inner()
        except StopIteration:
            raise
        except BaseException as exc:  # a dead worker, a timeout, Ctrl-C, a protocol error
            self._break(exc)
            raise
        self._clock.end(start)
        if isinstance(data, _Failure):
            data.reraise()  # the worker's own exception: the epoch goes on, as in torch
        return data

    def _next_data_inner(self):
        self._read_ahead()
        self._replenish()
        while True:
            while self._rcvd_idx < self._send_idx:
                info = self._task_info.get(self._rcvd_idx)
                if info:
                    worker_id = info[0]
                    if len(info) == 2 or self._workers_status[worker_id]:
                        break
                    del self._task_info[self._rcvd_idx]
                self._rcvd_idx += 1
            else:
                if not self._persistent_workers:
                    self._shutdown_workers()
                raise StopIteration

            if len(self._task_info[self._rcvd_idx]) == 2:
                worker_id, data = self._task_info.pop(self._rcvd_idx)
                self._rcvd_idx += 1
                return self._process_data(data, worker_id)

            if self._tasks_outstanding <= 0:
                raise SlotProtocolError("batch awaited with no task outstanding (loader state is corrupt)")
            idx, worker_id, data = self._wait_for_event()
            self._tasks_outstanding -= 1
            if data is _END:
                self._workers_status[worker_id] = False
                self._try_put_index()
                continue
            if idx != self._rcvd_idx:
                if not self._in_order:
                    worker_id = self._task_info.pop(idx)[0]
                    return self._process_data(data, worker_id)
                self._task_info[idx] += (data,)
            else:
                worker_id = self._task_info.pop(idx)[0]
                self._rcvd_idx += 1
                return self._process_data(data, worker_id)

    def _process_data(self, data, worker_id: int):
        self._workers_num_tasks[worker_id] -= 1
        self._try_put_index()
        if not isinstance(data, _Failure):
            self._batches += 1
        self._resumable.on_delivered(self._rcvd_idx - 1, worker_id, not isinstance(data, _Failure))
        return data

    # -- waiting on workers ----------------------------------------------------------------------

    def _wait_for_event(self, until=None):
        """Block (in bounded slices) until a worker reports a result of this epoch, and return
        (idx, worker_id, batch | _Failure | _END); or, given `until`, until it returns True (then
        None).  Raises on a dead worker or on `timeout`."""
        if until is None and self._events:
            return self._events.popleft()
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        channel_of, sentinel_of = self._channel_of, self._sentinel_of
        while True:
            self._replenish()
            self._check_not_starved()
            wait = POLL_SECONDS if deadline is None else max(0.0, min(POLL_SECONDS, deadline - time.monotonic()))
            ready = self._everything.ready(wait)
            for fd in ready:
                if fd in channel_of:
                    event = self._receive(*channel_of[fd])
                    if event is not None:
                        return event
                    if until is not None and until():
                        return None
            for fd in ready:
                if fd in sentinel_of and fd not in channel_of:
                    self._worker_died(sentinel_of[fd])
            if until is not None and until():
                return None
            if deadline is not None and time.monotonic() >= deadline:
                waiting_on = self._task_info.get(self._rcvd_idx, (None,))[0]
                error = LoaderTimeoutError(
                    f"DataLoader timed out after {self._timeout} seconds waiting for batch "
                    f"{self._rcvd_idx} (worker {waiting_on}); the loader has been shut down"
                )
                self._break(error)
                raise error

    def _read_ahead(self) -> None:
        """Handle every message already waiting (no blocking), so that slots come back and are
        granted again at each next(), not only when the loop has to wait for a batch.  The
        results are queued, in arrival order, for _wait_for_event."""
        channel_of = self._channel_of
        while True:
            ready = self._messages.ready(0)
            if not ready:
                return
            for fd in ready:
                event = self._receive(*channel_of[fd])
                if event is not None:
                    self._events.append(event)

    def _receive(self, worker_id: int, channel: Channel):
        """Read and handle one message of a worker; a closed socket is a dead worker."""
        try:
            message, fds = channel.recv()
        except (ChannelClosed, ConnectionError):
            self._worker_died(worker_id)
        return self._handle(worker_id, message, fds)

    def _handle(self, worker_id: int, message: tuple, fds: list[int]):
        kind = message[0]
        if kind == "resumed":
            self._resumed += 1
            return None
        if kind == "fatal":  # an error outside any task: the worker is exiting
            stage, payload = message[1], message[2]
            try:
                _Failure(worker_id, self._workers[worker_id].pid, None, stage, payload).reraise()
            except BaseException as exc:
                self._break(exc)
                raise
        if kind == "state":  # a worker's dataset state after a batch (NOTE [ Resuming mid-epoch ])
            self._resumable.on_worker_state(self, worker_id, message)
            return None
        epoch, idx = message[1], message[2]
        self._unreceived.pop((epoch, idx), None)
        if kind == "ready":
            slot, generation, capacity = message[3], message[4], message[5]
            self._in_place_bytes += message[6]
            self._grants[worker_id].discard(slot)
            if fds:
                self._ring.adopt(slot, fds[0], capacity, generation)
                self._known_generation[worker_id][slot] = generation
                self._forget_retired()  # other workers' mappings of the pre-growth segment
                if self._pinner is not None:
                    self._pinner.pin(self._ring.segment(slot))  # once per slot segment
            if epoch != self._epoch:
                self._ring.unassign(slot)
                return None
            lease, descriptor, payload_end = self._ring.lease(slot, idx, self._release)
            batch = layout.read_batch(lease, descriptor, payload_end)
            return idx, worker_id, batch
        if epoch != self._epoch:
            return None
        if kind == "end":
            return idx, worker_id, _END
        if kind == "error":
            stage, payload = message[3], message[4]
            return idx, worker_id, _Failure(worker_id, self._workers[worker_id].pid, idx, stage, payload)
        raise SlotProtocolError(f"unknown message {kind!r} from worker {worker_id}")

    def _worker_died(self, worker_id: int):
        channel = self._channels[worker_id]
        while mp_connection.wait([channel.fileno()], timeout=0):  # its last words, if any
            try:
                message, fds = channel.recv()
            except (ChannelClosed, ConnectionError):
                break
            self._handle(worker_id, message, fds)  # raises for a "fatal" message
        process = self._workers[worker_id]
        process.join(timeout=1.0)
        doing = describe_stage(self._status, worker_id)
        error = WorkerDiedError(worker_id, process.pid, process.exitcode, doing,
                                self._crash_logs[worker_id].read())
        self._break(error)
        raise error

    def _break(self, error: BaseException) -> None:
        """Shut down after `error`; every later next() raises LoaderBrokenError (NOTE [ Shutdown ]).
        Only its text is kept: its traceback's frames may hold the user's batches."""
        if self._broken is None:
            lines = str(error).splitlines()
            self._broken = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
        self._shutdown_workers()

    # -- statistics and shutdown -----------------------------------------------------------------

    def stats(self) -> LoaderStats:
        ring_stats = self._final_ring_stats or self._ring.stats()
        return LoaderStats(
            ring_slots=ring_stats.slots, slot_bytes=ring_stats.slot_bytes,
            ring_bytes=ring_stats.ring_bytes, held_segments=ring_stats.held_segments,
            held_bytes=ring_stats.held_bytes, reserved_bytes=ring_stats.reserved_bytes,
            in_use_bytes=ring_stats.in_use_bytes, detached=ring_stats.detached,
            slot_grows=ring_stats.slot_grows, made_ahead=ring_stats.made_ahead, batches=self._batches,
            in_place_bytes=self._in_place_bytes,
            control_bytes=sum(c.bytes_sent + c.bytes_received for c in self._channels),
            control_messages=sum(c.messages_sent + c.messages_received for c in self._channels),
            timing=self._timing_stats(),
        )

    def _worker_times(self) -> list | None:
        """Each worker's stage clocks (NOTE [ Stage clocks ]), live or as read at shutdown."""
        if self._status is None or not self._clock.enabled:
            return self._final_worker_times
        now = time.monotonic_ns()
        return [diagnosis.worker_timing(worker_id, read_block(
                    self._status, status_offset(worker_id), process.pid, now))
                for worker_id, process in enumerate(self._workers)]

    def _timing_stats(self) -> diagnosis.LoaderTiming | None:
        if not self._clock.enabled:
            return None
        return diagnosis.diagnose(self._clock, self._worker_times() or [], self._prefetch_factor,
                                  time.monotonic_ns(), time.process_time_ns())

    def _shutdown_workers(self) -> None:
        """See NOTE [ Shutdown ]."""
        if self._shutdown:
            return
        self._shutdown = True
        try:
            self._final_worker_times = self._worker_times()  # while /proc still has them
        except Exception:
            pass
        try:
            for channel in self._channels:
                try:
                    channel.send(("stop",))
                except OSError:
                    pass
            deadline = time.monotonic() + STOP_GRACE_SECONDS
            for process in self._workers:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
            for process in self._workers:
                if process.is_alive():
                    process.terminate()
            for process in self._workers:
                process.join(timeout=2.0)
                if process.is_alive():
                    process.kill()
                    process.join()
        finally:
            for channel in self._channels:
                channel.close()
            for crash_log in self._crash_logs:
                crash_log.close()
            for process in self._workers:
                try:
                    process.close()
                except ValueError:
                    pass
            if self._status is not None:
                self._status.close_fd()
                self._status = None  # unmapped now, not when the (maybe still referenced) iterator goes
            if self._ring is not None:
                self._final_ring_stats = self._ring.stats()
                self._ring.close()
            self._task_info = {}  # batches buffered for reordering: never delivered, unmap them
            self._events.clear()
            loader = self._loader_ref()
            if loader is not None:
                loader._final_stats = self.stats()

    def __del__(self) -> None:
        try:
            self._shutdown_workers()
        except Exception:
            pass
