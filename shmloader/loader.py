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

Where each part lives:
  loader.py     ShmDataLoader, and its iterator: torch's bookkeeping (order, epochs, `in_order`,
                iterable ends, persistent workers), as torch's `_MultiProcessingDataLoaderIter`;
  pool.py       the worker processes, their sockets, deaths and shutdown (NOTE [ Shutdown ]);
  scheduler.py  which slot each worker writes into (NOTE [ Slot grants ]);
  ring.py       the main process's slots and their sizing (NOTE [ Ring size ], [ Held batches ]);
  protocol.py   every message between the two sides, and the status board;
  worker.py     the worker's loop; layout.py how a batch sits in a slot; segment.py one segment.

Order, seeding, `len()`, epochs, `persistent_workers`, `in_order` and iterable datasets follow
torch's `_MultiProcessingDataLoaderIter` exactly (this iterator derives from torch's base class,
so the sampler and the seeds are drawn in the same order from the same generator).

An error that shuts the iterator down leaves it broken: NOTE [ Shutdown ] in pool.py.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import operator
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch.utils.data import DataLoader, default_collate, default_convert

from . import diagnosis, epochs, layout, state, torch_private
from .errors import (
    LoaderBrokenError,
    LoaderTimeoutError,
    RemoteTraceback,
    SlotProtocolError,
    WorkerError,
)
from .interrupts import ctrl_c_held
from .pool import Poller, WorkerPool
from .protocol import End, Failed, Fatal, NoRoom, Ready, Resume, Resumed, State, Task
from .ring import Ring, RingStats
from .scheduler import ACROSS_EPOCHS_WAIT_MIN_SLOT_BYTES, WAIT_MIN_SLOT_BYTES, SlotScheduler
from .shared_views import shared_views_enabled
from .timing import BatchClock, timing_enabled
from .worker import COLLATE_CONVERT, COLLATE_CUSTOM, COLLATE_INTO_SLOT, Shipped, WorkerSpec

# NOTE [ Ctrl-C in the wait ]
#   torch's iterator survives a KeyboardInterrupt raised while next() waits for a batch: a loop
#   (or a notebook cell run again) that catches it and calls next() again gets the next batch,
#   and every later one, in order.  Most Ctrl-Cs that reach the loader land there, in poll(),
#   where the iterator's bookkeeping is whole: such a KeyboardInterrupt is marked resumable and
#   the iterator goes on.  One raised anywhere else in the loader's code (between a message read
#   and its record, say) may have cut a step in half, so it shuts the iterator down as before,
#   and the next next() raises LoaderBrokenError naming it.  The sampler's own error (a sampler
#   that raises mid-epoch) is resumable too, as under torch: it is raised by the next() that drew
#   the index (whose batch is lost, as torch loses it), the batches already sent to the workers
#   are still delivered, and the epoch then ends where the sampler stopped.
_RESUMABLE = "_shmloader_resumable"

POLL_SECONDS = 0.5  # longest blind wait: sentinels and timeouts are checked at least this often

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
    far; slot_grows: slots replaced by a larger segment so far; slot_shrinks: free slots dropped
    when the size of new slots came down (NOTE [ Slot size follows the batches ] in ring.py);
    held_bytes counts a held batch's own pages, not its slot's; made_ahead: slot segments made
    ahead of need, off the workers' path (NOTE [ Spare segments ] in spares.py); in_place_bytes: array bytes that a
    numpy collate_fn built in their slot, or that the dataset made in their row of it, so that no
    copy was made (NOTE [ One copy for a numpy collate_fn ] in worker.py, NOTE [ Samples born in
    the slot ] in samples_in_slot.py); prefetched_next_epoch / forecast_misses: batches fetched across
    an epoch's end and kept, and epochs whose forecast was wrong (NOTE [ Cross-epoch prefetch ]
    in epochs.py); spilled_batches: batches moved out of their slot to private memory while they
    waited for their turn, because the loop waited for an earlier one that could get no slot
    (NOTE [ Batches that wait for their turn ] in scheduler.py); overflow_slots: slots made
    outside /dev/shm because it was full of batches the loop holds (NOTE [ Overflow slots ] in
    ring.py); pages_given_back: batches past whose end their slot gave the rest of its pages back
    to /dev/shm, batch sizes varying widely (NOTE [ A slot's pages follow its batch ] in ring.py);
    timing: where the time goes and the verdict (diagnosis.py;
    None with SHMLOADER_TIMING=0 or sample_parallel=True, `timing_off` says which).  After an epoch (workers stopped, ring closed), the epoch's
    figures, ring_bytes as the epoch left it, but held_segments, held_bytes, reserved_bytes and
    in_use_bytes as they are now: only the batches still held reserve memory then.  print() it
    for a table, as_dict() for logging."""

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
    prefetched_next_epoch: int = 0  # batches fetched before their epoch began, and kept
    forecast_misses: int = 0  # next epochs whose forecast the sampler did not bear out
    slot_shrinks: int = 0
    spilled_batches: int = 0
    overflow_slots: int = 0
    pages_given_back: int = 0  # batches past whose end their slot gave its pages back
    timing_off: str = ""  # why timing is None: "SHMLOADER_TIMING=0", or the mode that has none

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


def _counts(num_workers, prefetch_factor) -> tuple:
    """(num_workers, prefetch_factor) as ints (a numpy int taken as torch takes it); a TypeError
    naming the value for one that is not an integer (2.0, "2"): torch's DataLoader takes it and
    fails later in its own code, with a message that names neither."""
    counts = []
    for name, value in (("num_workers", num_workers), ("prefetch_factor", prefetch_factor)):
        if value is None and name == "prefetch_factor":
            counts.append(None)
            continue
        try:
            counts.append(operator.index(value))
        except TypeError:
            raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}); "
                            f"pass {name}=int(...)") from None
    return tuple(counts)


class ShmDataLoader(DataLoader[_T_co]):
    """A drop-in for `torch.utils.data.DataLoader` whose workers hand over batches through shared
    memory.  Takes every DataLoader argument, plus:

    slot_bytes: initial size of each ring slot; by default learnt from the first batch (its size
        rounded to pages).  A batch larger than its slot grows that slot (1/8 headroom, at least
        1.5 × its size); nothing is ever written past a slot.
    sample_parallel: spread the samples of each batch over all the workers, which write their
        rows straight into the batch's slot (map-style datasets with the default collate_fn
        only): a far shorter time to the first batch and a ring of a few slots.  The same
        batches in the same order; per-sample seeding instead of per-worker.  See NOTE
        [ Samples of one batch over the workers ] in sample_parallel.py.
    max_ring_slots, max_ring_bytes: a cap on the shared-memory segments alive at once (the
        ring's and those of batches the training loop holds), only if you want one; past it,
        RingFullError.  By default held batches take what they need, as with torch
        (NOTE [ Held batches ] in ring.py).
    prefetch_next_epoch: with persistent_workers, start the next epoch's first batches while the
        loop takes this epoch's last ones, and keep each only if the sampler really yields its
        indices (NOTE [ Cross-epoch prefetch ] in epochs.py; with sample_parallel too: NOTE [ The
        next epoch's first batches ] in sample_parallel.py).  Off by default (drained at each
        epoch's end, as torch does): those batches are fetched before your code between epochs
        runs, so turn it on only where what the dataset returns does not depend on that code.
    """

    def __init__(self, dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None,
                 num_workers=0, collate_fn=None, pin_memory=False, drop_last=False, timeout=0,
                 worker_init_fn=None, multiprocessing_context=None, generator=None, *,
                 prefetch_factor=None, persistent_workers=False, pin_memory_device="",
                 in_order=True, slot_bytes: int | None = None, max_ring_slots: int | None = None,
                 max_ring_bytes: int | None = None, prefetch_next_epoch: bool = False,
                 sample_parallel: bool = False):
        for name, value, least in (("slot_bytes", slot_bytes, 1), ("max_ring_slots", max_ring_slots, 1),
                                   ("max_ring_bytes", max_ring_bytes, 1)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
                raise ValueError(f"{name} must be an int >= {least} or None, got {value!r}")
        num_workers, prefetch_factor = _counts(num_workers, prefetch_factor)
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
        self.prefetch_next_epoch = bool(prefetch_next_epoch)
        if self.prefetch_next_epoch and not self.persistent_workers:  # (persistent: num_workers > 0)
            raise ValueError(
                "prefetch_next_epoch=True fetches the next epoch's first batches in workers that "
                "outlive the epoch, so it needs persistent_workers=True (and num_workers > 0); got "
                f"persistent_workers={self.persistent_workers}, num_workers={self.num_workers}: pass "
                "persistent_workers=True, or leave prefetch_next_epoch off")
        self.sample_parallel = sample_parallel
        if sample_parallel:
            from .sample_parallel import check_loader

            check_loader(self)  # a clear error now for what this mode cannot do
        self._last_iterator: weakref.ref | None = None
        self._final_stats: LoaderStats | None = None
        self._final_ring: Ring | None = None  # the latest iterator's, closed: what its batches still hold
        self._timing = timing_enabled()  # NOTE [ Stage clocks ] in timing.py

    # NOTE [ A process forked by the user ]
    #   A process the user forks (os.fork, a fork-started multiprocessing child) inherits the
    #   loader and its iterator: the sockets to the workers and the ring's mappings.  Those
    #   workers are the parent's children; were the child to send on those sockets, or stop the
    #   workers when its copy is collected, the two processes would read each other's messages
    #   and the parent's loader would hang or break.  So an iterator remembers the process that
    #   made it: in any other, next() raises and its shutdown does nothing but drop references,
    #   and iter(loader) starts workers of the child's own (a persistent iterator of the parent's
    #   is disowned first), so the child gets torch's batches and the parent is undisturbed.

    def __iter__(self):
        if getattr(self._iterator, "_shutdown", False):
            self._iterator = None  # a persistent iterator shut down by an error: start afresh
        if getattr(self._iterator, "_owner_pid", os.getpid()) != os.getpid():
            self._iterator.disown()  # the parent's (NOTE [ A process forked by the user ])
            self._iterator = None
        current = self._iterator
        if isinstance(current, _PoolIter):  # a persistent iterator, reset here: not while in use
            with current.in_one_thread("iter(loader)"):
                return state.start_epoch(self, super().__iter__)  # NOTE [ Resuming mid-epoch ] in state.py
        return state.start_epoch(self, super().__iter__)

    def _get_iterator(self):
        # (torch lets them be set after construction; workers set then get torch's default prefetch)
        self.num_workers, self.prefetch_factor = _counts(self.num_workers, self.prefetch_factor)
        if self.num_workers > 0 and self.prefetch_factor is None:
            self.prefetch_factor = 2
        if self.num_workers == 0:
            return state.SingleProcessIter(self)  # in-process (torch's, resumable): nothing to transport
        self.check_worker_number_rationality()
        # torch's iterator's own check, in both modes (without it no task is ever sent); raised,
        # not asserted, as torch does: `python -O` drops an assert
        if self.prefetch_factor <= 0:
            raise AssertionError("prefetch_factor must be greater than 0 for MultiProcessingDataLoaderIter "
                                 f"(ShmDataLoader with num_workers > 0), got {self.prefetch_factor}")
        if self.sample_parallel:
            from .sample_parallel import SampleParallelIter, check_loader

            check_loader(self)  # again: torch lets collate_fn be set after construction
            iterator = SampleParallelIter(self)
        else:
            iterator = _ShmLoaderIter(self)
        self._last_iterator = weakref.ref(iterator)
        return iterator

    def __getstate__(self) -> dict:
        """What pickle and copy.deepcopy take: everything torch's loader has, but not the weak
        link to this loader's latest iterator (unpicklable) nor its figures: a copy has no
        iterator yet, and stats() is None until it has one."""
        fields = self.__dict__.copy()
        fields["_last_iterator"] = fields["_final_stats"] = fields["_final_ring"] = None
        return fields

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
        if self._final_stats is None or self._final_ring is None:
            return self._final_stats
        # the epoch's figures; the workers and the ring are gone, and what the batches you still
        # hold keep is counted now (they go as you drop them)
        now = self._final_ring.stats()
        return dataclasses.replace(self._final_stats, held_segments=now.held_segments, held_bytes=now.held_bytes,
                                   in_use_bytes=now.in_use_bytes, reserved_bytes=now.reserved_bytes)


# What a LoaderTimeoutError adds: torch's iterator survives its timeout, and so does ours.
TIMEOUT_ADVICE = ("the workers go on: next() waits for it again, as torch's DataLoader does "
                  "(drop the iterator to stop them)")


class _Failure:
    """A worker's exception, to be raised when its batch's turn comes (as torch does)."""

    def __init__(self, worker_id: int, pid: int | None, idx: int | None, stage: str, payload: tuple):
        self.worker_id, self.pid, self.idx, self.stage, self.payload = worker_id, pid, idx, stage, payload

    @property
    def type_name(self) -> str:
        return self.payload[1].rsplit(".", 1)[-1]

    def reraise(self, note: str = ""):
        """Raise the worker's exception, `note` added to its message."""
        blob, type_name, message, text = self.payload
        where = f"in DataLoader worker {self.worker_id} (pid {self.pid}) while {self.stage}"
        if self.idx is not None:
            where += f" for batch {self.idx}"
        else:  # outside any task: the worker has exited
            where += "; the worker exited and the loader has been shut down"
        text += note
        original = None  # the worker's exception, or only its type (exception_payload in worker.py)
        if blob is not None:
            try:
                import pickle

                original = pickle.loads(blob)
            except Exception:
                original = None
        kind = original if isinstance(original, type) else type(original)
        summary = f"Caught {type_name.rsplit('.', 1)[-1]} {where}.\nOriginal {text}"
        exc: BaseException = WorkerError(summary)
        # SystemExit or KeyboardInterrupt in a worker ends that worker, not the training process:
        # torch raises a RuntimeError for it, which `except Exception` catches; so does WorkerError.
        if original is not None and issubclass(kind, Exception):
            try:  # a KeyError's message printed as text, not repr()-ed, as torch does
                exc = kind(torch_private.key_error_message(summary) if kind is KeyError else summary)
            except Exception:
                if kind.__module__.split(".")[0] == "shmloader" and not isinstance(original, type):
                    # Ours, whose constructor takes its fields (ShmCapacityError from a slot's
                    # growth): the worker's own instance, fields intact, with our summary.
                    original.args = (summary,)
                    exc = original
                # Anything else that cannot be rebuilt from a message (numpy's UFuncTypeError):
                # a RuntimeError, as torch raises then, so `except RuntimeError` catches both.
        exc.worker_id, exc.worker_stage = self.worker_id, self.stage  # type: ignore[attr-defined]
        raise exc from RemoteTraceback(text)

_END = object()  # an iterable worker's stream is exhausted


class _PoolIter(torch_private.BaseDataLoaderIter):
    """What both iterators (this module's and sample_parallel.py's) share: a WorkerPool, a
    SlotScheduler, and a shutdown that leaves the iterator ended or broken (NOTE [ Shutdown ] in
    pool.py).  Subclasses set `_pool` and `_scheduler`, handle messages (`_handle`) and drop
    their buffered batches in `_drop_buffered`."""

    def __init__(self, loader) -> None:
        # Resuming a state: its base seed replaces the one torch's __init__ draws, so that draw
        # must leave its generator (the loader's, else torch's global RNG) as it was, for the
        # epochs after the resumed one to draw what an uninterrupted run draws (NOTE [ Resuming
        # mid-epoch ]).
        source = undo = None
        if getattr(loader, "_state_resume", None) is not None:
            generator = loader.generator
            source = generator if isinstance(generator, torch.Generator) else torch.default_generator
            undo = source.get_state()
        super().__init__(loader)
        if source is not None:
            source.set_state(undo)
        self._shutdown = False
        self._broken: str | None = None  # "Type: message" of the error that shut it down
        self._broken_said = False  # LoaderBrokenError raised (once; NOTE [ Shutdown ] in pool.py)
        self._pool: WorkerPool | None = None
        self._scheduler: SlotScheduler | None = None
        self._final_ring_stats: RingStats | None = None
        self._batches = 0
        self._epoch = 0
        self._loader_ref = weakref.ref(loader)
        self._owner_pid = os.getpid()  # NOTE [ A process forked by the user ]
        self._in_use = threading.Lock()  # held through next() and a persistent iter(): in_one_thread

    def __next__(self):
        if not self._in_use.acquire(blocking=False):
            raise self._used_by_two_threads("next()")
        try:
            return self._next_in_turn()
        finally:
            self._in_use.release()

    def _next_in_turn(self):
        return super().__next__()

    @contextlib.contextmanager
    def in_one_thread(self, call: str):
        """Around `call` (an iter() that resets this persistent iterator): a RuntimeError, not a
        corrupt state or a hang, where another thread is inside next() or iter() meanwhile."""
        if not self._in_use.acquire(blocking=False):
            raise self._used_by_two_threads(call)
        try:
            yield
        finally:
            self._in_use.release()

    def _used_by_two_threads(self, call: str) -> RuntimeError:
        return RuntimeError(
            f"{call} on a ShmDataLoader iterator while another thread is inside next() or iter() of "
            "the same iterator (with persistent_workers=True every iter(loader) returns that one "
            "iterator): a loader's iterator is not thread-safe, in torch's DataLoader either; "
            "give each thread its own loader, or take the batches in one thread and hand them on")

    def _failure_note(self, failure: _Failure) -> str:
        """What a worker's error may owe to the training loop: /dev/shm full while the loop holds
        batches (or parts of them) past the ring, each keeping its whole slot."""
        if failure.type_name != "ShmCapacityError" or self._scheduler is None:
            return ""
        stats = self._scheduler.ring.stats()
        if not stats.held_segments:
            return ""
        return (f"\nMeanwhile the training loop holds {stats.held_segments} batches past the ring, "
                f"{stats.held_bytes / 2**20:.1f} MiB of shared memory: a batch, or any tensor or array "
                f"taken from it larger than {layout.SMALL_LEAF_BYTES // 1024} KiB, keeps its batch's whole "
                "slot. Drop what you no longer need, or keep a .clone() / .copy() of the parts you keep.")

    # The parts, by the names tests and tools know them by.
    @property
    def _ring(self) -> Ring:
        return self._scheduler.ring

    @property
    def _workers(self) -> list:
        return self._pool.processes if self._pool is not None else []

    def _check_open(self) -> None:
        """At each next(): an ended iterator stops, a broken one raises again, and one used from
        a process the user forked from its owner says so (NOTE [ A process forked by the user ])."""
        if os.getpid() != self._owner_pid:
            raise RuntimeError(
                f"this DataLoader iterator belongs to process {self._owner_pid}, whose children its "
                f"workers are; process {os.getpid()} was forked from it and cannot use them: call "
                "iter(loader) in this process for workers of its own"
            )
        if self._shutdown:
            if self._broken is not None and not self._broken_said:
                self._broken_said = True  # once: a loop that catches errors and goes on must end
                raise LoaderBrokenError(
                    f"this DataLoader iterator was shut down by an earlier error ({self._broken}); "
                    "the epoch ends here (later next() calls raise StopIteration): start a new "
                    "epoch with iter(loader)"
                )
            raise StopIteration

    def _next_index(self):
        """The sampler's next batch of indices; its own error leaves the iterator whole (NOTE
        [ Ctrl-C in the wait ]): raised at this next(), the next ones go on as torch's do."""
        try:
            return super()._next_index()
        except StopIteration:
            raise
        except Exception as exc:
            try:
                setattr(exc, _RESUMABLE, True)
            except AttributeError:  # an exception type that takes no attributes
                pass
            raise

    def _handle(self, worker_id: int, message, fds: list[int]):
        raise NotImplementedError

    _exits_checked = 0.0  # when the workers' exit status was last read (_check_exits)

    def _check_exits(self) -> None:
        """Every POLL_SECONDS of waiting, a worker that exited is a death even where its socket
        and sentinel stay open (NOTE [ A sentinel closed by a live worker ] in pool.py)."""
        now = time.monotonic()
        if now - self._exits_checked < POLL_SECONDS:
            return
        self._exits_checked = now
        exited = self._pool.first_exited()
        if exited is not None:
            self._worker_died(exited)

    def _worker_died(self, worker_id: int):
        for message, fds in self._pool.last_words(worker_id):
            try:
                self._handle(worker_id, message, fds)
            except Exception as exc:  # its Fatal: the worker's own error says more than a death
                self._break(exc)
                raise
        error = self._pool.death(worker_id)
        self._break(error)
        raise error

    def _break(self, error: BaseException) -> None:
        """Shut down after `error`; the next next() raises LoaderBrokenError, later ones
        StopIteration (NOTE [ Shutdown ]).
        Only its text is kept: its traceback's frames may hold the user's batches."""
        if self._broken is None:
            lines = str(error).splitlines()
            self._broken = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
        self._shutdown_workers()

    def _drop_buffered(self) -> None:
        """Forget the batches read but not delivered (their leases go, and their slots)."""

    def disown(self) -> None:
        """In a process the user forked from the owner: forget the workers and the ring without
        a word to them, since they are the owner's (NOTE [ A process forked by the user ])."""
        self._shutdown = True

    def _shutdown_workers(self) -> None:
        """See NOTE [ Shutdown ] in pool.py."""
        with ctrl_c_held():  # NOTE [ Ctrl-C held ] in interrupts.py: flagged done, then done
            if self._shutdown:
                return
            if os.getpid() != self._owner_pid:  # the garbage of a forked copy: not ours to stop
                self.disown()
                return
            self._shutdown = True
            try:
                if self._pool is not None:
                    self._pool.stop()
            finally:
                self._drop_buffered()
                if self._scheduler is not None:
                    self._final_ring_stats = self._ring.stats()
                    self._scheduler.close()
                    loader = self._loader_ref()
                    if loader is not None:
                        loader._final_stats = self.stats()
                        loader._final_ring = self._ring

    def __del__(self) -> None:
        try:
            self._shutdown_workers()
        except Exception:
            pass


class _ShmLoaderIter(_PoolIter):
    """torch's bookkeeping (order, epochs, `in_order`, iterable ends), over a WorkerPool that
    carries the messages (pool.py) and a SlotScheduler that hands out the slots (scheduler.py)."""

    def __init__(self, loader: ShmDataLoader) -> None:
        super().__init__(loader)
        self._resumable = state.IterState.attach(self, loader)  # a loaded state's seed, before the workers start
        self._prefetch_factor = loader.prefetch_factor
        self._in_order = getattr(loader, "in_order", True)
        self._clock = BatchClock(getattr(loader, "_timing", True))  # NOTE [ Stage clocks ]
        self._events: collections.deque = collections.deque()  # results read ahead of their wait
        self._task_info: dict[int, tuple] = {}
        self._slot_of: dict[int, tuple[int, int]] = {}  # this epoch's idx -> (slot, generation) it came in
        # NOTE [ Cross-epoch prefetch ] in epochs.py
        ahead_on = (self._persistent_workers and getattr(loader, "prefetch_next_epoch", False)
                    and self._dataset_kind == torch_private.DatasetKind.Map
                    and not state.is_stateful(self._dataset))
        self._next_epoch = epochs.NextEpochPrefetch(ahead_on, self._num_workers,
                                                    self._prefetch_factor * self._num_workers)
        self._resume_sent = 0  # the epoch the workers were last told to Resume
        self._resumed: collections.Counter = collections.Counter()  # Resumed messages per epoch
        self._spilled = 0  # NOTE [ Batches that wait for their turn ] in scheduler.py
        pinner = None
        if self._pin_memory:  # torch's base class set this only where an accelerator exists
            from .cuda import SlotPinner

            pinner = SlotPinner(self._pin_memory_device)
        self._pinner = pinner
        self._scheduler = SlotScheduler(
            self._num_workers, self._prefetch_factor, slot_bytes=loader.slot_bytes,
            max_slots=loader.max_ring_slots, max_bytes=getattr(loader, "max_ring_bytes", None), pinner=pinner,
            wait_min_slot_bytes=ACROSS_EPOCHS_WAIT_MIN_SLOT_BYTES if ahead_on else WAIT_MIN_SLOT_BYTES)
        self._scheduler.ring.trims_allowed = True  # one writer per slot (NOTE [ A slot's pages follow its batch ] in ring.py)
        context = loader.multiprocessing_context or torch.multiprocessing
        payload, mode = self._worker_payload(loader)

        def make_spec(worker_id: int) -> WorkerSpec:
            return WorkerSpec(
                worker_id=worker_id, num_workers=self._num_workers, base_seed=self._base_seed,
                dataset_kind=self._dataset_kind, auto_collation=self._auto_collation,
                collate_mode=mode, drop_last=self._drop_last, payload=payload,
                main_pid=os.getpid(), forked=context.get_start_method() == "fork",
                ring_depth=self._ring.depth, resume_state=self._resumable.worker_resume(worker_id),
                shared_views=shared_views_enabled(self._pin_memory),
            )

        try:
            self._pool = WorkerPool(self._num_workers, context, make_spec, self._clock.enabled, self._worker_died)
        except BaseException:
            self._shutdown_workers()
            raise
        pool = self._pool
        self._scheduler.send = pool.send  # not self._send: no cycle through the iterator
        # What every wait polls, built once: results, deaths, and spare segments made ahead
        # (NOTE [ Spare segments ] in spares.py).
        self._everything = Poller(list(pool.channel_of) + list(pool.sentinel_of) + [self._scheduler.wakeup_fd])
        self._messages = Poller(list(pool.channel_of))
        self._reset(loader, first_iter=True)

    def _worker_payload(self, loader) -> tuple[Shipped, str]:
        """What each worker unpickles (dataset, collate_fn, worker_init_fn), and how it collates."""
        if self._auto_collation and self._collate_fn is default_collate:
            mode = COLLATE_INTO_SLOT
        elif not self._auto_collation and self._collate_fn is default_convert:
            mode = COLLATE_CONVERT
        else:
            mode = COLLATE_CUSTOM
        return Shipped((self._dataset, self._collate_fn if mode == COLLATE_CUSTOM else None,
                        loader.worker_init_fn)), mode

    # -- epochs ------------------------------------------------------------------------------------

    def _reset(self, loader, first_iter=False) -> None:
        self._resumable.before_epoch(loader, first_iter)  # the RNG states the sampler starts from
        super()._reset(loader, first_iter)
        self._clock.new_epoch()
        self._send_idx = 0
        self._rcvd_idx = 0
        self._task_info = {}
        self._slot_of = {}
        self._tasks_outstanding = 0
        self._workers_status = [True] * self._num_workers
        self._workers_num_tasks = [0] * self._num_workers
        self._worker_queue_idx_cycle = itertools.cycle(range(self._num_workers))
        self._next_epoch.new_epoch()
        if not first_iter:
            self._events.clear()  # read ahead in the last epoch, never delivered: free their slots
            self._epoch += 1
            self._send_resume(self._epoch)
            # Stale results of the last epoch arrive before each worker's Resumed and free
            # their slots here.
            try:
                self._wait_for_event(until=lambda: self._resumed[self._epoch] >= self._num_workers)
            except LoaderTimeoutError:  # half way through the reset: no going on
                error = LoaderTimeoutError(
                    f"DataLoader timed out after {self._timeout} seconds waiting for the persistent "
                    f"workers to start epoch {self._epoch} ({self._resumed[self._epoch]} of "
                    f"{self._num_workers} ready, the rest still busy with a sample of the last epoch); "
                    "this iterator is shut down: iter(loader) again starts the epoch afresh once "
                    "they are done, or raise timeout=")
                self._break(error)
                raise error from None
        self._next_epoch.start_prime(self._epoch)  # the last epoch's forecast, to check
        self._resumable.before_prime(self, loader, first_iter)  # resume a loaded state
        for _ in range(self._prefetch_factor * self._num_workers):
            self._try_put_index()
        self._next_epoch.end_prime(self._events)  # the kept batches' results that are in

    def _send_resume(self, epoch: int) -> None:
        """Tell every worker that `epoch` begins (once: maybe before the loop gets to it)."""
        if self._resume_sent != epoch:
            self._resume_sent = epoch
            for worker_id in range(self._num_workers):
                self._send(worker_id, Resume(epoch))

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
            self._next_epoch.sampler_ended(self._send_idx, self._send)
            if not self._shutdown:
                self._next_epoch.send_ahead(self._epoch, self._index_sampler, self._dataset,
                                            self._tasks_outstanding, self._send_task, self._send_resume)
            return
        for _ in range(self._num_workers):  # the next active worker, as torch picks it
            worker_id = next(self._worker_queue_idx_cycle)
            if self._workers_status[worker_id]:
                if self._in_order or not torch_private.OUT_OF_ORDER_BY_CAPACITY:
                    break
                if self._workers_num_tasks[worker_id] < max_tasks // sum(self._workers_status):
                    break
        else:
            return
        if not self._next_epoch.keeps(self._send_idx, index, worker_id, self._send):  # in flight already?
            self._send_task(worker_id, Task(self._epoch, self._send_idx, index))
        self._task_info[self._send_idx] = (worker_id,)
        self._workers_num_tasks[worker_id] += 1
        self._tasks_outstanding += 1
        self._send_idx += 1

    def _send(self, worker_id: int, message, fds: tuple[int, ...] = ()) -> None:
        self._pool.send(worker_id, message, fds)

    def _send_task(self, worker_id: int, task: Task) -> None:
        with self._pool.coalesced():  # the task and the grant it gets: one wake-up
            self._send(worker_id, task)
            self._scheduler.task_sent(task.epoch, task.idx, worker_id)

    def _result_of(self, epoch: int, idx: int) -> str:
        """'now' for a result of this epoch, 'early' for one of the next epoch's prefetched tasks
        (kept aside until it begins), 'stale' for one of an earlier epoch or a forecast not kept."""
        if epoch == self._epoch:
            return "now"
        return self._next_epoch.result_of(self._epoch, epoch, idx)  # NOTE [ Cross-epoch prefetch ]

    # -- the next batch ------------------------------------------------------------------------------

    def _next_in_turn(self):
        # a pending fast-forward, the epoch's end; then torch's steps (torch_private.next_batch)
        return self._resumable.next(self, self._next_batch)

    def _next_batch(self):
        return torch_private.next_batch(self)

    def _next_data(self):
        self._check_open()  # NOTE [ Shutdown ] in pool.py
        start = self._clock.begin()
        try:
            data = self._next_data_inner()
        except StopIteration:
            raise
        except LoaderTimeoutError:
            raise  # the iterator goes on: the next next() waits again, as torch's does
        except BaseException as exc:  # a dead worker, Ctrl-C, a protocol error
            if not getattr(exc, _RESUMABLE, False):  # NOTE [ Ctrl-C in the wait ]
                self._break(exc)
            raise
        self._clock.end(start)
        if isinstance(data, _Failure):
            data.reraise(self._failure_note(data))  # the worker's own exception: the epoch goes on, as in torch
        return data

    def _next_data_inner(self):
        self._read_ahead()
        with self._scheduler.deferring(self._loop_has_next(2)):  # NOTE [ Slots the loop gives back ]
            self._scheduler.replenish(self._workers_ahead())
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
                self._slot_of.pop(self._rcvd_idx, None)
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
                    self._slot_of.pop(idx, None)
                    return self._process_data(data, worker_id)
                self._task_info[idx] += (data,)
                del data  # the buffer's now: a spill drops it (NOTE [ Batches that wait ... ] in scheduler.py)
            else:
                worker_id = self._task_info.pop(idx)[0]
                self._slot_of.pop(idx, None)
                self._rcvd_idx += 1
                return self._process_data(data, worker_id)

    def _process_data(self, data, worker_id: int):
        self._workers_num_tasks[worker_id] -= 1
        with self._scheduler.deferring(True):  # the loop's next call gives one back (NOTE [ Slots the loop gives back ])
            self._try_put_index()
        if not isinstance(data, _Failure):
            self._batches += 1
        self._resumable.on_delivered(self._rcvd_idx - 1, worker_id, not isinstance(data, _Failure))
        return data

    def _workers_ahead(self) -> frozenset[int] | set[int]:
        """The workers with a finished batch waiting for the loop, for large slots in order
        (NOTE [ Slots the loop gives back ] in scheduler.py)."""
        if not self._in_order or not self._scheduler.large_slots:
            return frozenset()
        ahead = {info[0] for info in self._task_info.values() if len(info) == 2}
        ahead.update(event[1] for event in self._events)
        return ahead

    def _loop_has_next(self, count: int) -> bool:
        """Whether the next `count` batches in order are here already, so that the training
        loop will not wait for a batch before its next-but-`count` next() (in order only)."""
        if not self._in_order:
            return False
        task_info, events = self._task_info, self._events
        for idx in range(self._rcvd_idx, self._rcvd_idx + count):
            info = task_info.get(idx)
            if not (info is not None and len(info) == 2) and not any(event[0] == idx for event in events):
                return False
        return True

    # -- waiting on workers ----------------------------------------------------------------------

    def _wait_for_event(self, until=None):
        """Block (in bounded slices) until a worker reports a result of this epoch, and return
        (idx, worker_id, batch | _Failure | _END); or, given `until`, until it returns True (then
        None).  Raises on a dead worker or on `timeout`."""
        if until is None and self._events:
            return self._events.popleft()
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        channel_of, sentinel_of = self._pool.channel_of, self._pool.sentinel_of
        scheduler = self._scheduler
        while True:
            scheduler.replenish(self._workers_ahead())
            if until is not None and until():  # it may hold already (Resumed read ahead)
                return None
            scheduler.check_not_starved(self._spill_buffered)
            wait = POLL_SECONDS if deadline is None else max(0.0, min(POLL_SECONDS, deadline - time.monotonic()))
            if until is None:
                self._clock.blocked = True  # the batch had not arrived: stats().timing counts it
            try:
                ready = self._everything.ready(wait)
            except KeyboardInterrupt as exc:  # NOTE [ Ctrl-C in the wait ]
                if until is None:
                    setattr(exc, _RESUMABLE, True)
                raise
            for fd in ready:
                if fd in channel_of:
                    event = self._receive(channel_of[fd][0])
                    if event is not None:
                        return event
                    if until is not None and until():
                        return None
            for fd in ready:
                if fd in sentinel_of and fd not in channel_of:
                    self._worker_died(sentinel_of[fd])
            self._check_exits()
            if until is not None and until():
                return None
            if deadline is not None and time.monotonic() >= deadline:
                waiting_on = self._task_info.get(self._rcvd_idx, (None,))[0]
                raise LoaderTimeoutError(
                    f"DataLoader timed out after {self._timeout} seconds waiting for batch "
                    f"{self._rcvd_idx} (worker {waiting_on}); {TIMEOUT_ADVICE}")

    def _spill_buffered(self) -> bool:
        """Move the latest batch that waits in the reorder buffer out of its slot into private
        memory, so that the slot can take the batch the loop waits for (NOTE [ Batches that wait
        for their turn ] in scheduler.py); False where none can be moved."""
        waiting = sorted((idx for idx, info in self._task_info.items()
                          if len(info) == 2 and idx in self._slot_of), reverse=True)
        for idx in waiting:
            slot, generation = self._slot_of.pop(idx)
            moved = self._scheduler.spill(slot, generation, idx)
            if moved is not None:
                self._task_info[idx] = (self._task_info[idx][0], moved)  # the slot's views die here
                self._spilled += 1
                return True
        return False

    def _read_ahead(self) -> None:
        """Handle every message already waiting (no blocking), so that slots come back and are
        granted again at each next(), not only when the loop has to wait for a batch.  The
        results are queued, in arrival order, for _wait_for_event."""
        channel_of = self._pool.channel_of
        while True:
            ready = self._messages.ready(0)
            if not ready:
                return
            for fd in ready:
                event = self._receive(channel_of[fd][0])
                if event is not None:
                    self._events.append(event)

    def _receive(self, worker_id: int):
        """Read and handle one message of a worker."""
        message, fds = self._pool.receive(worker_id)
        if fds:  # a segment a worker made: adopted whole (NOTE [ Ctrl-C held ] in interrupts.py)
            with ctrl_c_held():
                return self._handle(worker_id, message, fds)
        return self._handle(worker_id, message, fds)

    def _handle(self, worker_id: int, message, fds: list[int]):
        """Act on a worker's message; a result of this epoch comes back as (idx, worker_id, what)."""
        kind = type(message)
        if kind is Ready:
            where = self._result_of(message.epoch, message.idx)
            batch = self._scheduler.ready(worker_id, message, fds, deliver=where != "stale")
            if where == "now":
                self._slot_of[message.idx] = (message.slot, message.generation)
            if where == "early":
                self._next_epoch.keep_early(message.idx, worker_id, batch)
                return None
            return None if where == "stale" else (message.idx, worker_id, batch)  # a batch may be None
        if kind is NoRoom:  # NOTE [ No room for a worker's first slot ] in worker.py
            self._scheduler.no_room(worker_id, message)
            return None
        if kind is State:  # a worker's dataset state after a batch (NOTE [ Resuming mid-epoch ])
            self._resumable.on_worker_state(self, worker_id, message)
            return None
        if kind is Resumed:
            self._resumed[message.epoch] += 1
            return None
        if kind is Fatal:  # an error outside any task: the worker is exiting
            try:
                _Failure(worker_id, self._workers[worker_id].pid, None, message.stage, message.payload).reraise()
            except BaseException as exc:
                self._break(exc)
                raise
        if kind is Failed or kind is End:
            self._scheduler.result_in(message.epoch, message.idx)
            where = self._result_of(message.epoch, message.idx)
            if where == "stale":
                return None
            if kind is End:
                return message.idx, worker_id, _END
            failure = _Failure(worker_id, self._workers[worker_id].pid, message.idx, message.stage, message.payload)
            if where == "early":
                self._next_epoch.keep_early(message.idx, worker_id, failure)
                return None
            return message.idx, worker_id, failure
        raise SlotProtocolError(f"unexpected message {message!r:.200} from worker {worker_id}")

    # -- statistics and shutdown -----------------------------------------------------------------

    def stats(self) -> LoaderStats:
        ring_stats = self._final_ring_stats or self._ring.stats()
        pool = self._pool
        return LoaderStats(
            ring_slots=ring_stats.slots, slot_bytes=ring_stats.slot_bytes,
            ring_bytes=ring_stats.ring_bytes, held_segments=ring_stats.held_segments,
            held_bytes=ring_stats.held_bytes, reserved_bytes=ring_stats.reserved_bytes,
            in_use_bytes=ring_stats.in_use_bytes, detached=ring_stats.detached,
            slot_grows=ring_stats.slot_grows, made_ahead=ring_stats.made_ahead,
            slot_shrinks=ring_stats.slot_shrinks, batches=self._batches,
            in_place_bytes=self._scheduler.in_place_bytes,
            control_bytes=pool.control_bytes if pool is not None else 0,
            control_messages=pool.control_messages if pool is not None else 0,
            timing=self._timing_stats(), prefetched_next_epoch=self._next_epoch.prefetched,
            forecast_misses=self._next_epoch.misses, spilled_batches=self._spilled,
            overflow_slots=ring_stats.overflow_slots, pages_given_back=ring_stats.pages_given_back,
            timing_off="" if self._clock.enabled else "SHMLOADER_TIMING=0",
        )

    def _timing_stats(self) -> diagnosis.LoaderTiming | None:
        if not self._clock.enabled:
            return None
        times = self._pool.worker_times() if self._pool is not None else None
        return diagnosis.diagnose(self._clock, times or [], self._prefetch_factor,
                                  time.monotonic_ns(), time.process_time_ns())

    def _drop_buffered(self) -> None:
        self._task_info = {}  # batches buffered for reordering: never delivered, unmap them
        self._slot_of = {}
        self._events.clear()
        self._next_epoch.drop()
