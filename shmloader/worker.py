"""The worker process: fetch samples, collate them straight into a ring slot, report a few ints.

One worker's loop (NOTE [ Slot lifecycle ] in ring.py has the slot's side):

    recv task (epoch, batch n, indices)
      → fetch    dataset[i] for i in indices (or the next items of its iterable stream); large
                 arrays born in the granted slot where they can be (samples_in_slot.py)
      → collate  default: torch's collate with rows written straight into the slot
                 custom:  collate_fn(samples), array leaves copied once into the slot (or born
                 there: NOTE [ One copy for a numpy collate_fn ])
      → layout   descriptor + aligned leaf offsets
      → slot     take a slot s granted by the main process (NOTE [ Slot grants ] in scheduler.py;
                 wait for a "grant" message if none is in hand); a slot too small is replaced by
                 a larger segment that this worker creates (its fd travels back with the result)
      → write    claim s, copy (GIL released, in C), publish s
    send Ready(epoch, n, s, generation, capacity, bytes not copied)   (protocol.py)

Seeding, `get_worker_info()` and the fetchers are torch's own, so datasets that shard themselves
or draw random numbers behave exactly as under torch's DataLoader.
"""

from __future__ import annotations

import collections
import errno
import faulthandler
import os
import pickle
import random
import select
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import numpy.random  # noqa: F401 (NOTE [ What a worker imports ])
import torch
from torch.utils.data import default_convert

from . import heap, layout, protocol, torch_private
from ._ring import SlotArena
from .arena import SlotTensorMode, empty_tensor
from .channel import Channel, ChannelClosed
from .errors import NoRoomForSlot, ShmCapacityError, SlotProtocolError, safe_text
from .ownership import close_parent_only_in_child, freeze_inherited_objects
from .protocol import (
    AWAITING_SLOT,
    BOOTING,
    COLLATING,
    FETCHING,
    IDLE,
    INIT_FN,
    LAYING_OUT,
    STAGES,
    STARTING,
    UNPICKLING,
    WRITING,
    End,
    Failed,
    Fatal,
    Forget,
    Grant,
    NoRoom,
    Ready,
    Resume,
    Resumed,
    Rewind,
    Stop,
    Task,
    check_version,
    status_offset,
)
from .samples_in_slot import SamplesInArena, SamplesInSlot
from .segment import (
    SHM_DIR,
    create_segment,
    create_segment_or_overflow,
    page_round,
    shm_free_bytes,
    slot_capacity,
    trimmed_end,
)
from .state import send_batch_state, send_epoch_state, start_fetcher
from .timing import stage_clock

# How the batch is built in the worker.
COLLATE_INTO_SLOT = "slot"  # collate_fn is torch's default_collate: rows written in place
COLLATE_CONVERT = "convert"  # collate_fn is torch's default_convert (batch_size=None)
COLLATE_CUSTOM = "custom"  # the user's collate_fn, output copied once (or born in the slot)

# NOTE [ One copy for a numpy collate_fn ]
#   With a custom collate_fn the worker takes its slot grant before collating (it would wait
#   for it right after anyway), and while the collate_fn runs numpy's data allocator hands out
#   allocations of at least ARENA_MIN_BYTES from that slot (csrc/arena.h; a slot with no segment
#   yet gets one first, at the ring's learnt size), so np.stack / np.concatenate / np.empty-then-fill build the
#   batch's arrays in the slot itself; the layout describes such leaves where they are instead
#   of copying them.  torch.stack / torch.cat (and torch's default_collate called inside a
#   collate_fn) get an out= tensor over such a block (arena.py), pad_sequence is made in one, and
#   `shmloader.empty_tensor` is the explicit form.  Smaller allocations, other torch tensors and everything made outside
#   the call come from the heap and are copied once, as before.  If the collate_fn keeps an array born in
#   the slot (a cache) past the batch, the slot is left to it and the batch is moved to a fresh
#   segment (`_move_batch`), so a kept array never shares bytes with a slot written again.
#   A collate_fn that returns the samples' own arrays gets the samples fetched inside the arena
#   too, once a worker has seen it do so (NOTE [ Samples born in the slot ] in
#   samples_in_slot.py, which also covers torch's default_collate).
#   SHMLOADER_SLOT_ARENA=0 turns it off.
#   Before the ring has learnt its slot size (a worker's first batch), the slot is sized by the
#   samples' array bytes (`slot_guesses`), what a stacking or joining collate_fn makes of them,
#   so the first batch is born in its slot too rather than on the heap and copied.  Only from
#   GUESS_MIN_BYTES up (below, that copy costs little), and a batch that turns out more than
#   GUESS_MAX_WASTE times smaller than the guess goes to a slot of its own size instead: the ring
#   learns its slot size from the first slot, which must not be the guess's mistake.  The same
#   guess sizes a slot the ring leaves to its batch's size (NOTE [ Held batches of varying size ]
#   in ring.py).  A batch larger than its guess but no larger than its samples with each leaf
#   counted at its largest in the batch is a padding collate_fn's (pad_sequence, np.zeros then
#   fill): that worker's later guesses count the leaves so (a guess far too big turns it back).
#   One larger still (a collate_fn that adds more than padding): that worker guesses no more,
#   and collates on the heap for such slots.  Not padded from the start: a joining collate_fn
#   (np.concatenate of samples of different sizes) would have the ring learn a slot up to
#   GUESS_MAX_WASTE times its batches.
#   SlotTensorMode costs a worker microseconds a batch, and every torch call inside the collate_fn
#   goes through it: a worker whose collate_fn made no torch.stack / torch.cat / pad_sequence call in its first
#   TENSOR_MODE_LEARN_BATCHES batches with an arena (a numpy collate_fn) runs it without the mode
#   from then on.  A later torch.stack there is then copied once, as any heap tensor is.
ARENA_MIN_BYTES = 16 * 1024
TENSOR_MODE_LEARN_BATCHES = 8
GUESS_MIN_BYTES = 8 << 20
GUESS_MAX_WASTE = 2
# NOTE [ Arrays kept across batches ]
#   A dataset or collate_fn may keep an array born in a slot and return it in a later batch (a
#   shuffle buffer, a reorder queue, a collate_fn that returns an earlier batch).  Such an array
#   must never be written over.  Two writes could do it: rows fetched in place, where row k's
#   bytes are written from another source while the array born in row k is kept; and a batch laid
#   out from the slot's start over its arena's blocks.  So before either write, the sources that
#   lie in the slot are copied out (layout.settle_plan) and the worker drops the batch: a block
#   still alive is then held by someone else.  If one lies where the write goes, the batch is
#   written to a new segment for the slot (the rows in place read from the old one), and the old
#   segment stays mapped, with what is kept, for as long as it lives.  Once written, a slot whose
#   arena still has a live block is left to its keeper the same way (`_move_batch`).  Rows in
#   place are never written, so a kept one is safe until then.
# NOTE [ No room for a worker's first slot ]
#   Until the first batch has taught the ring its slot size, each worker makes the segment of the
#   slot it was granted, all at once: in a small /dev/shm (a container's 64 MiB) with more workers
#   than slots fit, some find no room where torch, which keeps in /dev/shm only the batches that
#   exist, would run.  Such a worker does not fail: it hands the grant back (NoRoom, with what it
#   needed and what was free), goes on with its batch on the heap, and waits for a slot that has a
#   segment; the main process fits the ring to the segments alive and on their way then (NOTE [ A
#   ring fitted to /dev/shm ] in ring.py).  Only a slot that has no segment yet is handed back: a
#   slot too small for a larger batch, whose growth finds no room, grows outside /dev/shm (NOTE
#   [ Overflow slots ] in ring.py), as does one moved away from arrays the dataset keeps.
# A slot made for a custom collate_fn's batch holds the batch laid out compactly plus
# `arena_slack`: the same arrays born in the arena take up to ARENA_BLOCK_SLACK more bytes each (a
# 64-byte size prefix, 64-byte alignment), and a few small dead temporaries (the arena never
# reuses a freed block) fit in 1/ARENA_MARGIN of the batch, up to ARENA_TEMPORARIES_MAX bytes.
# A batch whose arena holds more is laid out from the slot's start (the slot does not grow).
ARENA_BLOCK_SLACK = 128
ARENA_MARGIN = 128
# NOTE [ A slot for the collate_fn's temporaries ]
#   A numpy collate_fn often makes the batch in steps: `np.stack(images).astype(np.float32) / 255`
#   stacks uint8 samples, converts them and divides (torch's `.float() / 255` does the same in
#   SlotTensorMode, arena.py).  The arena (csrc/arena.h) takes a freed top
#   block back, so where each step's input is freed before the next array is made the result
#   is born in a slot of the batch's size.  But `.astype` makes its result while np.stack's is
#   alive: in a slot of the batch's size it does not fit, is made on the heap (mmapped afresh
#   for every batch from 32 MiB up) and copied.  So when a batch copied numpy arrays of at least
#   ARENA_MIN_BYTES and the arena was asked for more than the slot has (`wanted_end`: where its
#   cursor would have gone had every request fitted), the slot grows to hold them all, with no
#   headroom; the ring's new slots take that size.  Not beyond ARENA_GROW_MAX times the batch
#   (a collate_fn that makes many temporaries keeps its copy: slots that size would cost more
#   memory than the copy costs time); and a worker whose copied arrays had room in the arena and
#   were not born there (made outside the collate_fn, by torch, ...) grows no slot for them again.
#   Not for samples fetched in the arena (NOTE [ Samples born in the slot ]: a worker whose
#   samples leave dead blocks there stops fetching them so), nor for a guessed first slot.
ARENA_GROW_MAX = 1.5
ARENA_TEMPORARIES_MAX = 64 * 1024
DESCRIPTOR_ROOM = 4096  # a guessed slot's room for the header and the descriptor
DESCRIPTOR_BYTES_PER_LEAF = 128  # and per leaf of a batch of records


def slot_guesses(samples) -> tuple[int, int]:
    """The slot bytes for a custom collate_fn's batch before the ring knows its slot size, two
    ways: the samples' array bytes as they are (what a stacking collate_fn makes of samples of
    one size, or a joining one of any), and with each leaf counted at its largest in the batch
    (what a padding one makes of sequences); each with room for the arena's prefixes,
    temporaries and the descriptor, 0 when under GUESS_MIN_BYTES (NOTE [ One copy for a numpy
    collate_fn ])."""
    sizes = [[leaf.nbytes for _, leaf in layout.iter_leaves(sample)
              if type(leaf) is np.ndarray or (type(leaf) is torch.Tensor and layout.is_plain_strided(leaf))]
             for sample in samples]
    arrays = sum(map(len, sizes))
    as_they_are = sum(map(sum, sizes))
    padded = as_they_are
    if sizes and all(len(leaves) == len(sizes[0]) for leaves in sizes):  # leaf by leaf
        padded = len(sizes) * sum(map(max, zip(*sizes)))
    per_sample = -(-arrays // max(1, len(samples)))  # a stacked batch's leaves
    room = ARENA_BLOCK_SLACK * (per_sample + 1) + ARENA_TEMPORARIES_MAX + DESCRIPTOR_ROOM
    return tuple(nbytes + room if nbytes >= GUESS_MIN_BYTES else 0 for nbytes in (as_they_are, padded))


def first_slot_guess(samples) -> int:
    """slot_guesses()'s bytes as the samples are."""
    return slot_guesses(samples)[0]


def records_slot_guess(sample, batch_size: int) -> int:
    """The slot bytes for `batch_size` samples like `sample` fetched in the arena and passed
    through by the collate_fn (NOTE [ Samples born in the slot ] in samples_in_slot.py): every
    array a block of its own, each leaf a line of the descriptor; 0 under GUESS_MIN_BYTES."""
    arrays = sum(1 for _, leaf in layout.iter_leaves(sample)
                 if type(leaf) is np.ndarray or (type(leaf) is torch.Tensor and layout.is_plain_strided(leaf)))
    guess = first_slot_guess([sample] * batch_size)
    if not guess:
        return 0
    return guess + (ARENA_BLOCK_SLACK + DESCRIPTOR_BYTES_PER_LEAF) * arrays * batch_size


def arena_slack(plan) -> int:
    """The bytes a slot needs beyond `plan` (a compact layout) for the same batch born in its
    arena: ARENA_BLOCK_SLACK per leaf large enough to be an arena block, and room for small
    temporaries.  At 256 MiB this is kilobytes where a flat 1/128 was 2 MiB a slot."""
    ends = [offset for offset, _ in plan.leaves[1:]] + [plan.descriptor_offset]
    blocks = sum(1 for (offset, _), end in zip(plan.leaves, ends) if end - offset >= ARENA_MIN_BYTES)
    return ARENA_BLOCK_SLACK * blocks + min(plan.total_bytes // ARENA_MARGIN, ARENA_TEMPORARIES_MAX)


class Shipped:
    """An object that crosses to a spawned worker as bytes and is unpickled there, inside the
    worker's error handling, so a dataset that fails to unpickle is reported with its stage."""

    def __init__(self, obj: Any):
        self._obj = obj
        self._blob: bytes | None = None

    def __reduce__(self):
        return (Shipped._from_blob, (bytes(ForkingPickler.dumps(self._obj)),))

    @classmethod
    def _from_blob(cls, blob: bytes) -> Shipped:
        shipped = cls.__new__(cls)
        shipped._obj, shipped._blob = None, blob
        return shipped

    def load(self) -> Any:
        if self._blob is not None:
            self._obj, self._blob = pickle.loads(self._blob), None
        return self._obj


@dataclass
class WorkerSpec:
    worker_id: int
    num_workers: int
    base_seed: int
    dataset_kind: int
    auto_collation: bool
    collate_mode: str
    drop_last: bool
    payload: Shipped  # (dataset, collate_fn, worker_init_fn)
    main_pid: int
    forked: bool
    ring_depth: int
    resume_state: Any = None  # this worker's part of a loaded state (NOTE [ Resuming mid-epoch ])
    shared_views: bool = False  # NOTE [ Views of a storage already in shared memory ] in shared_views.py


def exception_payload(exc: BaseException) -> tuple:
    """What the main process needs to re-raise a worker's exception: the pickled exception if it
    pickles, else its pickled type (an exception carrying a lock or a file: torch's workers send
    only the type too), or None; its type's name, message and formatted traceback."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    blob = None
    for what in (exc, type(exc)):
        try:
            blob = pickle.dumps(what, protocol=pickle.HIGHEST_PROTOCOL)
            pickle.loads(blob)
            break
        except Exception:
            blob = None
    return (blob, f"{type(exc).__module__}.{type(exc).__qualname__}", safe_text(exc), text)


def _collate_tensors_without_shm(batch, *, collate_fn_map=None):
    """torch's collate_tensor_fn minus its per-batch shared-memory segment (FACTS.md): inside our
    workers the stacked batch is copied into a slot anyway, so a plain stack is enough."""
    elem = batch[0]
    if elem.is_nested or elem.layout != torch.strided:
        return _TORCH_COLLATE_TENSOR(batch, collate_fn_map=collate_fn_map)
    # out= as torch's worker does: the batch takes elem's dtype (no type promotion); a plain
    # tensor's out= is born in the slot while a collate_fn's arena is open (arena.py)
    shape = (len(batch), *elem.shape)
    if type(elem) is torch.Tensor and elem.device.type == "cpu":
        out = empty_tensor(shape, elem.dtype)
    else:
        out = elem.new_empty(shape)
    return torch.stack(batch, 0, out=out)


_TORCH_COLLATE_TENSOR = torch_private.TORCH_COLLATE_TENSOR


def _watch_main_process(main_pid: int) -> None:
    """Exit this worker within a second of the main process's death, even mid-__getitem__."""
    try:
        pidfd = os.pidfd_open(main_pid)
    except (AttributeError, OSError):
        pidfd = None
    while True:
        if pidfd is not None:
            readable, _, _ = select.select([pidfd], [], [], 1.0)
            if readable:
                os._exit(1)
        else:
            time.sleep(0.5)
            try:
                os.kill(main_pid, 0)
            except ProcessLookupError:
                os._exit(1)


# NOTE [ What a worker imports ]
#   A module imported in a forked worker is imported again by every worker, at every start of
#   workers (each epoch without persistent_workers), on the cores that fetch the first batch.
#   numpy.random, which each worker seeds as torch's do, costs about 11 ms of CPU to import: it
#   is imported here, once, in the main process.  numpy.ma (about 9 ms) is never touched where
#   no one imported it (layout.is_masked_array).  tests/test_worker_imports.py checks that a
#   worker's first batches import nothing the main process lacks.


def worker_main(spec: WorkerSpec, sock) -> None:
    """Entry point of a worker process (any start method)."""
    if spec.forked:
        freeze_inherited_objects()  # NOTE [ The parent's garbage ]
        close_parent_only_in_child()
    heap.keep_freed_memory()
    try:
        faulthandler.enable()  # until the crash log arrives (_start)
    except (RuntimeError, ValueError, OSError, AttributeError):
        pass  # sys.stderr replaced by an object without a file descriptor (pytest's capsys, a notebook)
    threading.Thread(target=_watch_main_process, args=(spec.main_pid,), daemon=True,
                     name="shmloader-parent-watch").start()
    channel = Channel(sock)
    worker = _Worker(spec, channel)
    try:
        worker.run()
    except (ChannelClosed, BrokenPipeError, ConnectionResetError):
        pass  # the main process went away or closed us: nothing left to report to
    except BaseException as exc:  # outside any task (tasks report their own): say it, then exit
        try:
            channel.send(Fatal(worker.stage, exception_payload(exc)))
        except OSError:
            pass
        if not isinstance(exc, KeyboardInterrupt):
            raise
        # Ctrl-C (SIGINT to the terminal's process group) ends a worker as it ends torch's: in the
        # dataset's code, so that what that code started is stopped too (subprocess.run kills its
        # child); quietly, since the training process got its own KeyboardInterrupt.
    finally:
        channel.close()


class _Worker:
    def __init__(self, spec: WorkerSpec, channel: Channel):
        self.spec = spec
        self.channel = channel
        self.segments: dict[int, tuple[int, Any]] = {}  # slot -> (generation, Segment)
        self.init_error: tuple | None = None
        self.ended = False
        self.fetcher = None
        self.status = None  # the status segment, whose fd is the first message from main
        self.clock = None  # writes this worker's block of it (timing.stage_clock)
        self.stage = STAGES[BOOTING]  # the stage last entered, for an error outside a task
        self.crash_file = None  # where faulthandler writes (crashlog.py)
        self.grants: collections.deque[tuple[int, int, int, int]] = collections.deque()  # (slot, gen, cap, hint)
        # NOTE [ A slot's pages follow its batch ] in ring.py: per slot, (generation, where its
        # pages end: those past were given back); the generation granted leave to give them back
        self.pages_end: dict[int, tuple[int, int]] = {}
        self.may_trim: dict[int, int] = {}
        self.short_of_pages: int | None = None  # _ready_to_write: a slot whose pages could not be taken back
        self.pending: collections.deque[tuple[tuple, list[int]]] = collections.deque()
        self.rewind_points: dict[tuple[int, int], tuple] = {}  # tasks sent ahead -> RNG states before
        # NOTE [ Samples born in the slot ] in samples_in_slot.py
        iterable = spec.dataset_kind == torch_private.DatasetKind.Iterable
        self.samples_in_slot = SamplesInSlot(iterable)  # torch's default_collate
        self.samples_in_arena = SamplesInArena(iterable, records_slot_guess)  # a collate_fn that passes samples through
        self.arena_on = os.environ.get("SHMLOADER_SLOT_ARENA", "1") != "0"
        self.tensor_mode_unused = 0  # batches in a row whose collate_fn built no tensor under the mode
        self.guess_fits = True  # no guessed slot has been too small for its batch yet (NOTE above)
        self.guess_padded = False  # a batch was as large as its samples padded to the longest
        self.arena_grows = True  # NOTE [ A slot for the collate_fn's temporaries ]

    def _enter(self, stage: int, idx: int = -1) -> str:
        """Record the stage in this worker's status word (and time the one it leaves: NOTE
        [ Stage clocks ] in timing.py), return its name."""
        if self.clock is not None:
            self.clock.enter(stage, idx)
        self.stage = STAGES[stage]
        return self.stage

    # -- start-up, as torch's worker loop does it ------------------------------------------------

    def _start(self) -> None:
        spec = self.spec
        message, fds = self.channel.recv()
        if not isinstance(message, protocol.Hello) or len(fds) != 2:
            for fd in fds:
                os.close(fd)
        check_version(message, spec.worker_id)  # NOTE in protocol.py: both sides speak one version
        if len(fds) != 2:
            raise SlotProtocolError(f"worker {spec.worker_id} expected 2 fds with Hello, got {len(fds)}")
        from ._ring import Segment

        self.status = Segment(fds[0], message.status_bytes)
        self.status.close_fd()
        self.clock = stage_clock(self.status, status_offset(spec.worker_id), IDLE, FETCHING)
        self.crash_file = os.fdopen(fds[1], "w")
        faulthandler.enable(file=self.crash_file)  # into the main process's WorkerDiedError
        torch.set_num_threads(1)
        seed = spec.base_seed + spec.worker_id
        random.seed(seed)
        torch.manual_seed(seed)
        np.random.seed(torch_private.numpy_worker_seed(spec.base_seed, spec.worker_id))
        torch_private.default_collate_fn_map[torch.Tensor] = _collate_tensors_without_shm
        stage = self._enter(UNPICKLING)
        try:
            self.dataset, self.collate_fn, init_fn = spec.payload.load()
            if spec.collate_mode == COLLATE_CUSTOM:
                self.samples_in_arena.known_to_pass_through(self.collate_fn)
            torch_private.set_worker_info(spec.worker_id, spec.num_workers, seed, self.dataset)
            stage = self._enter(INIT_FN)
            if init_fn is not None:
                init_fn(spec.worker_id)
            stage = self._enter(STARTING)
            start_fetcher(self, spec.resume_state)
        except Exception as exc:
            self.init_error = (stage, exception_payload(exc))
        self._enter(IDLE)

    def _new_fetcher(self) -> None:
        self.ended = False
        self.fetcher = torch_private.create_fetcher(
            self.spec.dataset_kind, self.dataset, self.spec.auto_collation, _identity, self.spec.drop_last
        )

    # -- the loop ---------------------------------------------------------------------------------

    def run(self) -> None:
        self._start()
        while True:
            message, fds = self.pending.popleft() if self.pending else self.channel.recv()
            kind = type(message)
            if kind is Grant:
                self._take_grant(message, fds)
            elif kind is Forget:
                self._forget(message)
            elif kind is Task:
                try:
                    self._task(message)
                except _Stopped:
                    return
                self._enter(IDLE)
            elif kind is Rewind:
                self._rewind(message)
            elif kind is Resume:
                self.rewind_points = {k: v for k, v in self.rewind_points.items() if k[0] == -message.epoch}
                if self.init_error is None:
                    self._enter(STARTING)
                    try:
                        self._new_fetcher()
                    except Exception as exc:
                        self.init_error = ("starting the dataset (creating its iterator)", exception_payload(exc))
                send_epoch_state(self, message.epoch)
                self._enter(IDLE)
                self.channel.send(Resumed(message.epoch))
            elif kind is Stop:
                return
            elif kind in (protocol.Learn, protocol.Schema, protocol.Rows):
                from .sample_parallel import worker_handle  # NOTE there

                worker_handle(self, message, fds)
                self._enter(IDLE)
            else:
                raise SlotProtocolError(f"worker {self.spec.worker_id} got unexpected message {message!r:.200}")

    def _attach(self, slot: int, generation: int, capacity: int, fds: list[int], populate: bool = True):
        """The worker's mapping of `slot`, checked against what the main process says it is
        (mapped without `populate` by a worker that writes only some rows of it)."""
        if fds:
            from ._ring import Segment

            segment = Segment(fds[0], capacity, populate=populate)
            segment.close_fd()
            for extra in fds[1:]:
                os.close(extra)
            self.segments[slot] = (generation, segment)
        if capacity == 0:
            return None
        known = self.segments.get(slot)
        if known is None or known[0] != generation:
            raise SlotProtocolError(
                f"worker {self.spec.worker_id} was given slot {slot} generation {generation} "
                f"without its segment (it knows generation {known[0] if known else None})"
            )
        segment = known[1]
        magic, version, _state, cap, gen, *_ = segment.header()
        if magic != layout._ring.MAGIC or version != layout._ring.VERSION or cap != capacity or gen != generation:
            raise SlotProtocolError(
                f"worker {self.spec.worker_id} refuses slot {slot}: header says magic {magic:#x} "
                f"version {version} capacity {cap} generation {gen}, the task says capacity "
                f"{capacity} generation {generation}"
            )
        return segment

    def _forget(self, message: Forget) -> None:
        """Unmap a segment the main process detached or replaced (NOTE [ Held batches ])."""
        slot, generation = message
        known = self.segments.get(slot)
        if known is not None and known[0] == generation:
            del self.segments[slot]

    def _take_grant(self, message: Grant, fds: list[int]) -> None:
        slot, generation, capacity, hint = message.slot, message.generation, message.capacity, message.hint
        self._attach(slot, generation, capacity, fds)
        if message.unreserved_from and capacity:
            self.pages_end[slot] = (generation, message.unreserved_from)
        else:
            self.pages_end.pop(slot, None)
        if message.trim:
            self.may_trim[slot] = generation
        else:
            self.may_trim.pop(slot, None)
        self.grants.append((slot, generation, capacity, hint))

    def _next_grant(self, idx: int, upto: int | None = None) -> tuple[int, int, int, int]:
        """A granted slot, ready for writing its first `upto` bytes (all without `upto`); reads
        (and keeps, in order) other messages while waiting for one.  With `upto` (the batch's
        size is known, its writer can take a new segment), a slot whose pages could not be taken
        back is in `self.short_of_pages` instead of a ShmCapacityError."""
        while not self.grants:
            self._receive_while_waiting()
        return self._ready_to_write(self.grants.popleft(), upto, regrow=upto is not None)

    # A grant in `short_of_pages` (its slot's pages given back could not be taken back: /dev/shm
    # is full) gets a new segment for its batch from whoever uses it first: segment_for() (samples
    # fetched into the slot, a collate_fn's arena) or _task() (the batch written); neither writes
    # to the old segment's missing pages, which would be a SIGBUS.

    def grant_now(self) -> tuple[int, int, int, int] | None:
        """A granted slot if one is in hand or already waiting on the socket, without waiting."""
        while not self.grants:
            readable, _, _ = select.select([self.channel], [], [], 0)
            if not readable:
                return None
            self._receive_while_waiting()
        return self._ready_to_write(self.grants.popleft(), regrow=True)

    def _ready_to_write(self, grant: tuple[int, int, int, int], upto: int | None = None,
                        regrow: bool = False) -> tuple[int, int, int, int]:
        """`grant`, the pages of its slot's first `upto` bytes (all without `upto`) that were given
        back after an earlier, smaller batch taken back first (NOTE [ A slot's pages follow its
        batch ] in ring.py).  Where /dev/shm has no room for them: with `regrow`, the grant with
        its slot in `short_of_pages` (the caller writes the batch into a new segment, outside
        /dev/shm if need be, as a growing slot's); else the grant stays this worker's and the
        batch fails with a ShmCapacityError."""
        self.short_of_pages = None
        slot, generation, capacity, _hint = grant
        known = self.pages_end.get(slot)
        if known is None or known[0] != generation or not capacity:
            return grant
        end = known[1]
        target = capacity if upto is None else min(capacity, page_round(upto))
        if target <= end:
            return grant
        try:
            self.segments[slot][1].populate(end, target - end)
        except OSError as exc:
            if exc.errno not in (errno.EFAULT, errno.ENOMEM, errno.ENOSPC):
                self.grants.appendleft(grant)
                raise
            if regrow:
                self.short_of_pages = slot
                return grant
            self.grants.appendleft(grant)
            error = ShmCapacityError(target - end, shm_free_bytes(), SHM_DIR,
                                     f"slot {slot} of the ring, taking back the pages past its "
                                     f"earlier, smaller batch,")
            error.taking_pages_back = True  # (the stage the worker names: not a new slot)
            raise error from exc
        if target < capacity:
            self.pages_end[slot] = (generation, target)
        else:
            del self.pages_end[slot]
        return grant

    def _pages_after(self, segment, slot: int, granted: int, payload_end: int) -> int:
        """Just before the batch in the granted slot is published: give back the pages past it
        where the grant allows; where the segment's pages end now, 0 for all (Ready.pages_end)."""
        known = self.pages_end.get(slot)
        end = known[1] if known is not None and known[0] == granted else segment.size
        if self.may_trim.get(slot) == granted:
            cut = trimmed_end(segment.size, payload_end)
            if cut < end:
                segment.discard_from(cut)
                end = cut
        if end < segment.size:
            self.pages_end[slot] = (granted, end)
            return end
        self.pages_end.pop(slot, None)
        return 0

    def _receive_while_waiting(self) -> None:
        message, fds = self.channel.recv()
        kind = type(message)
        if kind is Grant:
            self._take_grant(message, fds)
        elif kind is Forget:
            self._forget(message)
        elif kind is Stop:
            raise _Stopped
        else:
            self.pending.append((message, fds))

    def _rewind(self, message: Rewind) -> None:
        """Undo the RNG draws of the tasks sent ahead that the main process did not keep, so that
        the tasks that follow draw what they would have under torch (NOTE [ Cross-epoch prefetch ]
        in epochs.py)."""
        dropped = sorted(k for k in self.rewind_points if k[0] == message.epoch and k[1] >= message.idx)
        if dropped:
            py_state, np_state, torch_state = self.rewind_points[dropped[0]]
            random.setstate(py_state)
            import numpy as np

            np.random.set_state(np_state)
            torch.set_rng_state(torch_state)
        self.rewind_points = {k: v for k, v in self.rewind_points.items() if k[0] != message.epoch}

    def _task(self, message: Task) -> None:
        epoch, idx, index = message
        if epoch < 0:  # sent ahead of its epoch: it may not be kept (Rewind)
            import numpy as np

            self.rewind_points[(epoch, idx)] = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        spec = self.spec
        stage = STAGES[IDLE]
        grant = None
        segment = None
        arena = fresh = in_slot = returned = None
        guessed = False
        guesses = (0, 0)
        try:
            if self.init_error is not None:
                stage, payload = self.init_error
                self.channel.send(Failed(epoch, idx, stage, payload))
                return
            if self.ended:
                self.channel.send(End(epoch, idx))
                return
            stage = self._enter(FETCHING, idx)
            in_slot = {COLLATE_INTO_SLOT: self.samples_in_slot,
                       COLLATE_CUSTOM: self.samples_in_arena}.get(spec.collate_mode)
            try:
                if in_slot is not None and in_slot.wanted(self.fetcher):  # NOTE in samples_in_slot.py
                    try:
                        samples = in_slot.fetch(self, index)
                    finally:
                        grant, fresh = in_slot.grant, in_slot.fresh  # this task's, whatever happens
                        if spec.collate_mode == COLLATE_CUSTOM:
                            arena, guessed = in_slot.arena, in_slot.guessed
                else:
                    samples = self.fetcher.fetch(index)
            except StopIteration:
                if spec.dataset_kind != torch_private.DatasetKind.Iterable:
                    raise
                if grant is not None:  # taken for samples that ended up too few (drop_last)
                    self.grants.appendleft(grant)
                    grant = None
                self.ended = True
                send_batch_state(self, epoch, idx)
                self.channel.send(End(epoch, idx))
                return
            send_batch_state(self, epoch, idx)  # NOTE [ Resuming mid-epoch ] in state.py
            watched = fetched_in_arena = None
            if spec.collate_mode == COLLATE_CUSTOM:  # NOTE [ One copy for a numpy collate_fn ]
                watched = in_slot.watch(samples)
                fetched_in_arena = arena.used_end - layout.HEADER_BYTES if arena is not None else 0
                if grant is None:
                    stage = self._enter(AWAITING_SLOT, idx)
                    grant = self._next_grant(idx)
                    guesses = slot_guesses(samples) if not (grant[2] or grant[3]) and self.guess_fits else (0, 0)
                    guess = guesses[1] if self.guess_padded else guesses[0]
                    try:
                        arena, fresh = self.slot_arena(grant, guess)
                    except NoRoomForSlot:  # handed back: collated on the heap, a slot found later
                        grant = None
                    guessed = fresh is not None and guess > 0
            stage = self._enter(COLLATING, idx)
            if spec.collate_mode == COLLATE_INTO_SLOT:
                batch = layout.collate_into_slot(samples)
            elif spec.collate_mode == COLLATE_CONVERT:
                batch = default_convert(samples)
            else:
                if arena is not None and self.tensor_mode_unused < TENSOR_MODE_LEARN_BATCHES:
                    mode = SlotTensorMode(ARENA_MIN_BYTES)
                    with arena, mode:
                        batch = self.collate_fn(samples)
                    self.tensor_mode_unused = 0 if mode.builder_calls else self.tensor_mode_unused + 1
                elif arena is not None:  # a numpy collate_fn: without the mode
                    with arena:
                        batch = self.collate_fn(samples)
                else:
                    batch = self.collate_fn(samples)
            del samples
            stage = self._enter(LAYING_OUT, idx)
            plan = layout.plan_batch(batch, arena, spec.shared_views)
            wanted_end = arena.wanted_end if arena is not None else 0
            if watched is not None or fetched_in_arena:
                in_slot.learn(plan, watched, fetched_in_arena)
            if grant is None:
                stage = self._enter(AWAITING_SLOT, idx)
                grant = self._next_grant(idx, plan.total_bytes)  # its pages as far as the batch goes
            slot, granted, capacity, hint = grant
            generation = granted  # a segment this worker makes for the slot is granted + 1
            segment = self.segments[slot][1] if capacity else None
            stage = self._enter(WRITING, idx)
            grown = None
            in_arena = arena is not None  # the batch goes to the segment its arena lies in
            sources_in_slot = in_slot is self.samples_in_slot and in_slot.fetched_in_slot
            if fresh is not None:  # the slot's segment, made before the collate for the arena
                segment, grown, generation, fresh = fresh, fresh, granted + 1, None
            if guessed and GUESS_MAX_WASTE * (plan.total_bytes + arena_slack(plan)) < segment.size:
                # the guess was far too big: a slot of the batch's size (NOTE [ One copy for ... ]);
                # the arena keeps the guessed segment mapped for the arrays born in it
                self.guess_padded = False  # it joins samples of several sizes after all
                segment.close_fd()  # never sent
                plan, sources_in_slot, segment, grown, in_arena = layout.plan_batch(batch, None, spec.shared_views), False, None, None, False
            if in_arena and plan.total_bytes > segment.size:
                # The arena's blocks hold more than the batch (temporaries): lay the batch out
                # from the slot's start instead, what lies in the slot copied out first.
                plan, sources_in_slot = layout.plan_batch(batch, None, spec.shared_views), True
            grow_to = 0
            if in_arena and not (guessed or fetched_in_arena) and self.arena_grows and plan.total_bytes <= segment.size:
                grow_to = self._slot_for_temporaries(plan, wanted_end, segment.size)
            if self.short_of_pages is not None and self.short_of_pages == slot:
                # its pages given back could not be taken back (/dev/shm is full): a new segment,
                # outside /dev/shm where it has no room (NOTE [ A slot's pages follow its batch ])
                self.short_of_pages = None
                size = segment.size if plan.total_bytes <= segment.size else slot_capacity(plan.total_bytes, segment.size, hint)
                segment = grown = self.new_segment(grant, size)  # (on an error the grant stays ours)
                generation = granted + 1
                self.pages_end.pop(slot, None)  # (those of the segment it replaces)
            elif segment is None or plan.total_bytes > segment.size or grow_to:
                if guessed and not self.guess_padded and plan.total_bytes + arena_slack(plan) <= guesses[1]:
                    self.guess_padded = True  # a padding collate_fn: its next guesses count it
                elif guessed:  # the collate_fn makes more than its samples' bytes, padded
                    self.guess_fits = False
                sources_in_slot = False  # a new segment: no source lies in it
                if in_arena:  # a new segment gets every byte: nothing is in place there
                    plan = layout.plan_batch(batch, None, spec.shared_views)
                    in_arena = False
                current = segment.size if segment is not None and not guessed else 0  # a guess is no size to grow from
                needed = plan.total_bytes
                if spec.collate_mode == COLLATE_CUSTOM:  # room for the arena's block prefixes
                    needed += arena_slack(plan)
                held, grant = grant, None  # _segment_for_batch's: it keeps what it holds on an error
                grant, grown = self._segment_for_batch(held, max(needed, grow_to), current, idx, exact=grow_to > 0)
                slot, granted, capacity, hint = grant
                if grown is None:  # another grant, whose segment is large enough
                    segment, generation = self.segments[slot][1], granted
                else:
                    segment, generation = grown, granted + 1
                stage = self._enter(WRITING, idx)
            if sources_in_slot:  # NOTE [ Arrays kept across batches ]
                plan, batch = layout.settle_plan(segment, plan), None
                if self._keeps_arrays_in(segment, plan, arena if in_arena else None, in_slot):
                    plan = layout.unsettle_rows(segment, plan)
                    if grown is not None:
                        grown.close_fd()  # never sent: the arrays born in it keep it mapped
                    segment = grown = create_segment_or_overflow(
                        segment.size, granted + 1, f"slot {slot} of the ring ({spec.ring_depth} slots)")
                    generation, in_arena = granted + 1, False
            found = segment.claim(spec.worker_id, idx)
            if found != layout._ring.FREE:
                segment = None  # not ours to release
                raise SlotProtocolError(f"worker {spec.worker_id} found slot {slot} in state {found}, not FREE")
            in_place = layout.write_batch(segment, plan) + plan.in_place_bytes
            published = (len(plan.descriptor), plan.total_bytes, plan.descriptor_offset)
            handles = plan.handles  # kept, and their fds open, until sent (NOTE in shared_views.py)
            del batch, plan
            kept = 0
            if arena is not None:
                kept, arena = arena.release(), None
                kept = kept if in_arena else 0
            if in_slot is self.samples_in_slot and in_slot.fetched_in_slot:
                rows_segment = in_slot.segment
                if in_slot.settle() and rows_segment is segment:
                    kept = 1
            if kept:  # the collate_fn or the dataset keeps arrays that live in this segment
                segment = grown = self._move_batch(segment, slot, granted, published[1], idx)
                generation, in_place = granted + 1, 0
            pages_end = 0 if grown is not None else self._pages_after(segment, slot, granted, published[1])
            segment.publish(*published)
            grant = None  # handed back with the result
            shared_bytes = tuple(nbytes for _, nbytes, _ in handles)
            handle_fds = tuple(fd for fd, _, _ in handles)
            if grown is not None:
                self.channel.send(Ready(epoch, idx, slot, generation, segment.size, in_place, 0, shared_bytes),
                                  (grown.fd, *handle_fds))
                grown.close_fd()
                self.segments[slot] = (generation, grown)  # known to the main process only now
            else:
                self.channel.send(Ready(epoch, idx, slot, generation, segment.size, in_place, pages_end, shared_bytes),
                                  handle_fds)
            del handles
            if in_slot is not None:
                in_slot.after_batch()  # (the heap memory it no longer needs: heap.py)
        except (ChannelClosed, BrokenPipeError, ConnectionResetError, _Stopped):
            raise
        except Exception as exc:
            if grant is not None:  # the batch failed: the slot stays this worker's, unwritten
                if segment is not None and segment.state() == layout._ring.WRITING:
                    segment.release()
                self.grants.appendleft(grant)
                returned = grant
            if isinstance(exc, ShmCapacityError) and stage != STAGES[WRITING]:
                # the slot is made where the batch first needs it: while its samples are
                # fetched into it, or collated into it, not by the dataset's code
                doing = ("taking back the pages of its shared-memory slot" if getattr(exc, "taking_pages_back", False)
                         else "creating the shared-memory slot for its batch")
                stage = f"{doing}, {stage.split(' (')[0]}"
            self.channel.send(Failed(epoch, idx, stage, exception_payload(exc)))
        finally:
            if arena is not None or (in_slot is self.samples_in_slot and in_slot.arenas):
                # The batch failed with arrays born in its slot: drop our references; if the
                # dataset or collate_fn still holds some, the slot must not be written again.
                samples = batch = None  # noqa: F841
                kept = arena.release() if arena is not None else 0
                if in_slot is self.samples_in_slot:
                    kept += in_slot.settle()
                if kept and returned is not None and self.grants and self.grants[0] is returned:
                    slot, generation, _capacity, hint = self.grants.popleft()
                    self.grants.appendleft((slot, generation, 0, hint))  # a new segment when used

    def _slot_for_temporaries(self, plan, wanted_end: int, size: int) -> int:
        """The slot bytes that would let the collate_fn's numpy arrays copied in `plan` be born in
        the slot next time, or 0 (NOTE [ A slot for the collate_fn's temporaries ])."""
        ends = [offset for offset, _ in plan.leaves[1:]] + [plan.descriptor_offset]
        copied = sum(end - offset for (offset, leaf), end in zip(plan.leaves, ends)
                     if end - offset >= ARENA_MIN_BYTES and _numpy_memory(leaf))
        if not copied:
            return 0
        if wanted_end <= size:  # they had room and were not born there: a bigger slot is no help
            self.arena_grows = False
            return 0
        needed = wanted_end + plan.total_bytes - copied + arena_slack(plan)
        return needed if needed <= ARENA_GROW_MAX * (plan.total_bytes + arena_slack(plan)) else 0

    def _segment_for_batch(self, grant, needed: int, current: int, idx: int, exact: bool = False):
        """(the grant, a new segment for its slot of at least `needed` bytes), or (another
        grant, None) whose slot's segment holds `needed`: where /dev/shm has no room for the
        granted slot's first segment, the worker waits for another grant (NOTE [ No room for a
        worker's first slot ]).  On an error the grant it holds then is the worker's again.
        `exact`: the segment is `needed` bytes page-rounded, without a growing slot's headroom."""
        while True:
            try:
                capacity = page_round(needed) if exact else slot_capacity(needed, current, grant[3])
                return grant, self.new_segment(grant, capacity)
            except NoRoomForSlot:  # handed back
                self._enter(AWAITING_SLOT, idx)
                grant = self._next_grant(idx)
                capacity = grant[2]
                if capacity >= needed:
                    return grant, None
                current = capacity
            except BaseException:
                self.grants.appendleft(grant)
                raise

    def _keeps_arrays_in(self, segment, plan, arena, in_slot) -> bool:
        """Whether the dataset or the collate_fn keeps an array born in `segment` where the settled
        `plan` would write (NOTE [ Arrays kept across batches ]): the batch's own references are
        dropped, so a live block is someone else's."""
        if arena is not None and arena.live:
            return True  # the batch is laid out from the slot's start, over the arena's blocks
        if in_slot is not self.samples_in_slot or in_slot.segment is not segment:
            return False
        in_place = layout.rows_in_place(plan)
        return any(row_arena.live and row_arena.begin not in in_place for row_arena in in_slot.arenas)

    def slot_arena(self, grant: tuple[int, int, int, int], guess: int = 0):
        """(a SlotArena over the granted slot, the new segment made for it if the slot had none
        yet), or (None, None) before the ring knows its slot size and without a `guess` of it,
        or when turned off (NOTE [ One copy for a numpy collate_fn ])."""
        if not self.arena_on:
            return None, None
        segment, fresh = self.segment_for(grant, guess)
        if segment is None:
            return None, None
        return SlotArena(segment, layout.HEADER_BYTES, ARENA_MIN_BYTES), fresh

    def segment_for(self, grant: tuple[int, int, int, int], min_bytes: int):
        """(the granted slot's segment, None), or (a new segment for it, the same) when the slot
        has none or one smaller than `min_bytes`: sized by `min_bytes` and the ring's learnt size
        (a worker's new segment is the granted generation + 1, adopted with its Ready), or
        (None, None) when neither says a size."""
        slot, generation, capacity, hint = grant
        if capacity and self.short_of_pages == slot:  # (see grant_now)
            self.short_of_pages = None
            fresh = self.new_segment(grant, max(capacity, page_round(min_bytes)))
            return fresh, fresh
        if capacity and capacity >= min_bytes:
            return self.segments[slot][1], None
        if not (hint or min_bytes):
            return None, None
        fresh = self.new_segment(grant, slot_capacity(min_bytes, capacity, hint))
        return fresh, fresh

    def new_segment(self, grant: tuple[int, int, int, int], capacity: int):
        """A new segment of `capacity` bytes for the granted slot (its generation + 1).  Where
        /dev/shm has no room for it and the slot has no segment yet, the grant goes back to the
        main process and NoRoomForSlot is raised (NOTE [ No room for a worker's first slot ]);
        a slot that grows gets it outside /dev/shm then (NOTE [ Overflow slots ] in ring.py)."""
        slot, generation, current, _hint = grant
        what = f"slot {slot} of the ring ({self.spec.ring_depth} slots)"
        if current:  # the slot's segment is too small for this batch: nothing to wait for
            return create_segment_or_overflow(capacity, generation + 1, what)
        try:
            return create_segment(capacity, generation + 1, what)
        except ShmCapacityError as exc:
            self.channel.send(NoRoom(slot, generation, exc.needed, exc.free))
            raise NoRoomForSlot(slot) from exc

    def _move_batch(self, kept, slot: int, generation: int, end: int, idx: int):
        """The collate_fn kept arrays born in `kept` (a cache): leave that segment to them and
        move the batch, bytes as they are, into a new segment for slot `slot` (the granted
        generation + 1), which the main process adopts as it adopts a grown one."""
        moved = create_segment_or_overflow(kept.size, generation + 1,
                                           f"slot {slot} of the ring ({self.spec.ring_depth} slots)")
        if moved.claim(self.spec.worker_id, idx) != layout._ring.FREE:
            raise SlotProtocolError(f"worker {self.spec.worker_id} could not claim a new segment")
        moved.copy_from_address(layout.HEADER_BYTES, kept.address + layout.HEADER_BYTES,
                                end - layout.HEADER_BYTES)
        kept.release()
        return moved


def _numpy_memory(leaf) -> bool:
    """Whether `leaf`'s bytes came from numpy's allocator (an array, or a tensor over one, which
    torch cannot resize): a larger arena could have held them."""
    return type(leaf) is np.ndarray or (type(leaf) is torch.Tensor and not leaf.untyped_storage().resizable())


class _Stopped(Exception):
    """The main process said stop while this worker waited for a slot."""


def _identity(samples):
    return samples
