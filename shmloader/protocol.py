"""Every message between the main process and a worker, and the status board they share.

The control socket (channel.py) carries only these messages, a few integers each; batch bytes
never cross it.  Each message is a typed, named tuple; on the wire it is `(tag, *fields)`, the
tag being its index in MESSAGES, so a message costs what a bare tuple costs to pickle.  The
first message a worker gets is `Hello`, which carries PROTOCOL_VERSION: a worker of another
version (a spawned interpreter that imports another shmloader) refuses to start, naming both.

    main ─▶ worker                               worker ─▶ main
    Hello(version, status bytes) + 2 fds         Ready(epoch, idx, slot, generation, capacity,
    Task(epoch, idx, indices)                          in-place bytes, pages end, shared bytes)
                                                       [+ fd of a new segment] [+ fd of each
                                                       shared storage the batch views]
    Grant(slot, generation, capacity, hint,      Failed(epoch, idx, stage, exception payload)
          unreserved_from, trim)
          [+ fd the first time it sees it]       End(epoch, idx)           an iterable ran out
    Forget(slot, generation)                     State(epoch, idx, dataset state)
    Resume(epoch)                                Resumed(epoch)
    Stop()                                       Fatal(stage, exception payload)
    Rewind(epoch, idx)                           NoRoom(slot, generation, needed, free)
                                                       no room in /dev/shm for the granted
                                                       slot's first segment: the grant back
  sample_parallel=True (sample_parallel.py):
    Learn(epoch, idx, size, index)               Schema(epoch, idx, schema bytes)
    Schema(epoch, idx, schema bytes)             RowsDone(epoch, idx, count, in-place bytes)
    Rows(epoch, idx, slot, generation, capacity,       (a failing row: Failed, as above)
         size, first_row, indices)               Kept(slot, generation, offset, row bytes)
         [+ fd the first time it sees the              the dataset keeps an array born in a
          slot's generation]                           row of that segment (its bytes as written)

NOTE [ Status board ]
  One shared segment, made by the main process and mapped by every worker (its fd comes with
  `Hello`): the segment header (csrc/ring.h), then one STATUS_BLOCK_BYTES block per worker at
  `status_offset(worker_id)`.  A block opens with the worker's status word, (stage, batch):
  the index into STAGES of what it is doing and for which batch; a worker killed by a signal
  cannot say what it was doing, so a death report reads it here (`describe_stage`).  The rest of
  the block is the worker's stage clocks (NOTE [ Stage clocks ] in timing.py).
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

from . import _ring
from .errors import SlotProtocolError
from .timing import MAX_STAGES, STATUS_BLOCK_BYTES

PROTOCOL_VERSION = 9  # 1: positional tuples (shmloader <= 0.x); 2: typed messages; 3: rows in place; 4: Kept rows' bytes; 5: NoRoom; 6: Grant's pages; 7: rows of the next epoch; 8: Learn's first index as a slice; 9: Ready's shared storages


# -- main process -> worker ----------------------------------------------------------------------

class Hello(NamedTuple):
    """The first message: the protocol version and the status board's size (fds: the board and
    the write end of the worker's crash log)."""
    version: int
    status_bytes: int


class Task(NamedTuple):
    """Fetch and collate batch `idx` of `epoch` from `indices` (None for an iterable dataset); a
    negative epoch -e tags a task sent before epoch e began (NOTE [ Cross-epoch prefetch ])."""
    epoch: int
    idx: int
    indices: Any


class Grant(NamedTuple):
    """Slot `slot` is this worker's to write one batch into (NOTE [ Slot grants ] in
    scheduler.py); capacity 0: no segment yet, make one (`hint`: the ring's learnt size).
    `unreserved_from` > 0: the segment's pages from there on were given back, take them back
    before writing; `trim`: give back the pages past the batch once it is written (NOTE [ A
    slot's pages follow its batch ] in ring.py)."""
    slot: int
    generation: int
    capacity: int
    hint: int
    unreserved_from: int = 0
    trim: bool = False


class Forget(NamedTuple):
    """Unmap this generation of `slot`: it was detached or replaced (NOTE [ Held batches ])."""
    slot: int
    generation: int


class Resume(NamedTuple):
    """A persistent worker starts epoch `epoch`: a fresh dataset iterator."""
    epoch: int


class Stop(NamedTuple):
    """Exit now (NOTE [ Shutdown ] in pool.py)."""


class Rewind(NamedTuple):
    """The tasks sent ahead for `epoch` (a negative tag) from `idx` on are not kept: put the
    worker's RNGs back as they were before the first of them (NOTE [ Cross-epoch prefetch ])."""
    epoch: int
    idx: int


# -- worker -> main process ----------------------------------------------------------------------

class Ready(NamedTuple):
    """Batch `idx` is published in `slot` (fd: a segment this worker made for it, generation
    and capacity as given); `in_place` bytes were collated in the slot, not copied; the
    segment's pages end at `pages_end`, those past it given back (0: it has them all; NOTE [ A
    slot's pages follow its batch ] in ring.py); the last len(`shared_bytes`) fds are storages
    already in shared memory that the batch views, of those sizes (NOTE [ Views of a storage
    already in shared memory ] in shared_views.py)."""
    epoch: int
    idx: int
    slot: int
    generation: int
    capacity: int
    in_place: int
    pages_end: int = 0
    shared_bytes: tuple[int, ...] = ()


class NoRoom(NamedTuple):
    """The granted `slot` (of `generation`, no segment yet) comes back unused: /dev/shm had
    `free` bytes where its segment needed `needed` (NOTE [ No room for a worker's first slot ] in
    worker.py); the worker waits for another grant."""
    slot: int
    generation: int
    needed: int
    free: int


class Failed(NamedTuple):
    """Batch `idx` raised in `stage`; re-raised in the main process at the batch's turn."""
    epoch: int
    idx: int
    stage: str
    payload: tuple


class End(NamedTuple):
    """This worker's share of an iterable dataset ran out at task `idx`."""
    epoch: int
    idx: int


class State(NamedTuple):
    """The worker's dataset state after task `idx` (-1: at the epoch's start); NOTE [ Resuming
    mid-epoch ] in state.py."""
    epoch: int
    idx: int
    taken: Any


class Resumed(NamedTuple):
    """Every result of earlier epochs has been sent: epoch `epoch` has begun."""
    epoch: int


class Fatal(NamedTuple):
    """An error outside any task (start-up, protocol): the worker exits after it."""
    stage: str
    payload: tuple


# -- sample_parallel=True (NOTE [ Samples of one batch over the workers ] in sample_parallel.py) --

class Learn(NamedTuple):
    """Fetch the sample of `first` (a one-index slice of the batch's indices, in the container the
    batch sampler yielded) as row 0 of batch `idx` (of `size` rows), learn the batch's row
    schema from it, send it back (Schema) and keep the sample for the Rows that asks for it.
    In this mode's messages a negative epoch -e tags a batch of epoch e sent before it began
    (prefetch_next_epoch): its rows are seeded as epoch e's, and its replies carry the tag."""
    epoch: int
    idx: int
    size: int
    first: Any


class Schema(NamedTuple):
    """A RowSchema's bytes: worker -> main, learnt from row 0 of batch `idx`; main -> worker,
    the schema every Rows message of this iterator uses."""
    epoch: int
    idx: int
    schema: bytes


class Rows(NamedTuple):
    """Fetch `indices` (a slice of the batch's, one index at a time) as rows first_row.. of batch `idx` (of `size` rows) and write each into
    `slot` (claimed by the main process), then report RowsDone (or Failed at the first bad row)."""
    epoch: int
    idx: int
    slot: int
    generation: int
    capacity: int
    size: int
    first_row: int
    indices: Any


class RowsDone(NamedTuple):
    """`count` rows of batch `idx` are written in its slot, `in_place` bytes of them by the
    dataset itself (born in their row: NOTE [ Rows born in place ] in sample_parallel.py)."""
    epoch: int
    idx: int
    count: int
    in_place: int


class Kept(NamedTuple):
    """The dataset keeps an array born in a row of `slot`'s segment `generation` (a cache): that
    segment must never be written again, and the batch is delivered with `row`, the row's bytes
    at `offset` as written, whatever the dataset does to its array later (sent before the
    chunk's RowsDone or Failed)."""
    slot: int
    generation: int
    offset: int
    row: bytes


MESSAGES: tuple[type, ...] = (Hello, Task, Grant, Forget, Resume, Stop,
                              Ready, Failed, End, State, Resumed, Fatal, Rewind,
                              Learn, Schema, Rows, RowsDone, Kept, NoRoom)
_TAG = {kind: tag for tag, kind in enumerate(MESSAGES)}


def encode(message: NamedTuple) -> tuple:
    """The wire form of a message: (tag, *fields)."""
    return (_TAG[type(message)], *message)


def decode(wire: tuple) -> NamedTuple:
    """The message a wire tuple stands for; anything else is a SlotProtocolError."""
    try:
        kind = MESSAGES[wire[0]]
        return kind._make(wire[1:])
    except (IndexError, TypeError) as exc:
        raise SlotProtocolError(f"malformed control message {wire!r:.200}: {exc}") from None


def check_version(hello: Any, worker_id: int) -> None:
    """A worker's first message must be a Hello of this very protocol."""
    if not isinstance(hello, Hello):
        raise SlotProtocolError(
            f"worker {worker_id} expected Hello (its status board and crash log) first, got {hello!r:.200}")
    if hello.version != PROTOCOL_VERSION:
        raise SlotProtocolError(
            f"worker {worker_id} speaks shmloader protocol {PROTOCOL_VERSION}, the main process "
            f"{hello.version}: the worker imports another shmloader than the main process "
            "(check sys.path / the installed version under spawn or forkserver)")


# -- the status board (NOTE [ Status board ]) ----------------------------------------------------

STAGES = (
    "starting up (importing modules and unpickling its arguments, before shmloader's code ran)",
    "idle (waiting for a task)",
    "unpickling the dataset, collate_fn and worker_init_fn",
    "running worker_init_fn",
    "starting the dataset (creating its iterator)",
    "waiting for a slot to write into",
    "fetching samples (dataset __getitem__ / __iter__)",
    "collating the batch (collate_fn)",
    "laying out the batch",
    "writing the batch into its slot",
)
(BOOTING, IDLE, UNPICKLING, INIT_FN, STARTING, AWAITING_SLOT, FETCHING, COLLATING, LAYING_OUT,
 WRITING) = range(len(STAGES))
assert len(STAGES) <= MAX_STAGES

STATUS_WORD = struct.Struct("<qq")  # (stage, batch): the first two words of a worker's block


def status_offset(worker_id: int) -> int:
    """Where worker `worker_id`'s block starts in the status board."""
    return _ring.HEADER_BYTES + worker_id * STATUS_BLOCK_BYTES


def status_board_bytes(num_workers: int) -> int:
    return status_offset(num_workers)


def describe_stage(board, worker_id: int) -> str:
    """'fetching samples (...) for batch 7': what a worker last recorded on the board."""
    stage, idx = STATUS_WORD.unpack(board.read(status_offset(worker_id), STATUS_WORD.size))
    name = STAGES[stage] if 0 <= stage < len(STAGES) else f"stage {stage}"
    return name if idx < 0 else f"{name} for batch {idx}"
