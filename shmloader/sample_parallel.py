"""`ShmDataLoader(..., sample_parallel=True)`: the samples of one batch spread over all the workers.

NOTE [ Samples of one batch over the workers ]
  The default mode gives each batch to one worker, as torch does: the first batch arrives after
  batch_size sample-times, and the ring holds a batch in progress for every worker.  In this
  mode the main process draws the batches of indices from torch's batch sampler exactly as the
  default mode does (this iterator derives from torch's base class: the same sampler, seed and
  len()), keeps max(2, prefetch_factor) batches in flight, and for each batch:

    1. takes a free ring slot, making its segment here (the schema's total bytes) when it has
       none or a too-small one, and claims it (FREE -> WRITING, csrc/ring.h) for the batch;
    2. splits the batch's rows into contiguous chunks, one per worker (chunk j to worker j, so
       that a worker writes the same rows of every slot and touches only those pages of it; for
       a batch smaller than num_workers, fewer chunks, batch n's first to worker n % num_workers,
       the next to the next worker), and sends each worker a Rows message (protocol.py; the
       slot's fd the first time that worker sees that segment);
    3. each worker fetches its samples one by one, writes each straight to its row of the slot
       (rows.write_row, NOTE [ Rows of one batch ] in rows.py) and reports RowsDone, or Failed
       at its first failing row (the row's number is in the error);
    4. once every chunk is reported, the main process publishes the slot (rows.publish_batch:
       WRITING -> READY), leases it and reads the batch (scheduler.deliver), exactly as a
       default-mode batch; batches are delivered in sampler order.  A batch with a failed chunk
       is never published: its slot goes back to the ring once every chunk has reported (no
       worker writes to it any more) and the first failing row's exception (the lowest row) is
       raised at the batch's turn; the epoch goes on, as in torch.  A worker death shuts the
       loader down (WorkerDiedError, then one LoaderBrokenError, then StopIteration), so no
       batch with missing rows is ever delivered.

  The schema.  Before the first batch can be given a slot, the batch's layout must be known:
  the worker that gets row 0 of batch n (_first_worker) fetches it (seeded as that row), learns the RowSchema
  from it (rows.learn_schema) and sends it back (Schema); it keeps the sample and writes it as
  its row 0 later, so it is not fetched twice.  The main process sends the schema to every
  worker; a short batch uses `schema.resized(k)` on both sides.  If fetching that sample raises,
  that batch raises its error at its turn and the schema is learnt from the next batch; if the
  sample cannot be written row by row (RowsUnsupportedError: a str, None, a tensor subclass...),
  that error is raised at the first batch's turn and the loader is shut down (the error says to
  use the default mode).  Batches of another shape than the schema's: NOTE [ A new shape ].  An array or
  tensor of another dtype is cast into the batch as torch's default_collate in a worker casts it
  (torch.stack into an out= of sample 0's dtype), or raises torch's error where that stack
  refuses; a number of another type (a float among int labels) raises BatchShapeError, since
  torch would give that batch another dtype, which rows already written cannot change.

  Seeding.  Before fetching row r of batch n of epoch e, the worker calls
  `rows.seed_sample(rows.sample_seed(base_seed, e, n, r))`: python's `random`, numpy's global
  RNG and torch's CPU generator are seeded from those four numbers only (the formulas are in
  rows.py), so a sample's randomness does not depend on which worker fetched it, nor on
  num_workers, nor on the order rows are fetched in: two runs with the same generator (or
  torch.manual_seed) give identical batches at any num_workers.  `base_seed` is torch's, drawn
  once per iterator from the loader's generator; `e` counts the epochs of one iterator (0, then
  1, 2, ... with persistent_workers=True; always 0 otherwise, where each epoch draws a new
  base_seed).  The random numbers therefore differ from those of torch's DataLoader or the
  default mode, which seed each worker once; data that draw no random numbers are identical.
  get_worker_info() and worker_init_fn behave as in the default mode (the worker's own seed).

NOTE [ A new shape ]
  torch collates each batch on its own, so batches may differ in shape or structure as long as
  the samples of one batch agree (multi-resolution training, buckets of lengths, a dict with
  other keys, another dtype).  Batches are sent with the last schema learnt; a batch whose rows
  do not fit it (a BatchShapeError or MissingKeyError from a row; a row 0 of another dtype is
  one, since row 0 sets its batch's dtype, where other rows are cast into it) is learnt again: its slot goes back, its row
  0 is fetched again by its first worker (seeded as that row, so the same sample), and if that
  gives another layout, the batch is sent again with it, and so are the batches after it.  If
  it gives the same layout, the rows disagree among themselves and the batch raises the row's
  error at its turn (as torch's default_collate raises), and the epoch goes on.  Each batch
  keeps the _Schemas it is written in; before the rows of a batch whose layout is not the one
  the workers were sent last, every worker is sent it (Schema), so a worker always writes a
  batch in that batch's layout.  Cost: at each change of shape, the rows fetched before the
  mismatch was found (about one per worker) and row 0 are fetched again, and the batch waits
  for a round trip; `__getitem__` is called twice for those indices.  A dataset whose shape
  changes at every batch is better served by the default mode.

NOTE [ The first batch first ]
  Until an epoch's first batch is delivered, only the batch being waited for may have a new slot
  segment made for it: making one (reserving and zero-filling a batch's pages) takes the main
  process tens of milliseconds of CPU, and the later batches' segments would take it from the
  workers filling the first batch's rows on the same cores.  The later batches are sent into
  slots that have a segment, or get theirs once the first batch is delivered; with
  persistent_workers the ring's segments outlive the epoch and nothing waits.

NOTE [ A full ring under a cap ]
  Under max_ring_slots / max_ring_bytes a batch may find no slot: every one is held by the loop
  or by a batch in flight.  That is RingFullError only where nothing can change it: the loop is
  about to wait for that very batch (`_fill(waiting=True)`) and no batch in flight is still
  being written.  Right after a batch is handed over the loop still holds the one before it (a
  for loop rebinds its variable only after next() returns), so claiming the next batch's slot
  then may fail with no error: the next next() claims it once that batch is let go.

NOTE [ Rows born in place ]
  A dataset that makes its sample's array (np.random.random(shape), np.empty then fill, a
  decoder's output) would have it copied into its row: one more pass over every byte, on the
  workers' cores.  Instead, while a worker fetches row r, numpy's allocator is pointed at that
  row of the schema's largest array leaf (`RowSchema.in_place_leaf`): an exact slot arena
  (csrc/arena.h), which hands out only the first allocation of exactly that row's size, at the
  row's address.  If the sample's leaf is that array, `rows.write_row` finds it in place and
  copies nothing; anything else (a temporary of that size, a transposed view) is copied as
  before, values sharing the row copied out first.  RowsDone reports the bytes found in place
  (`stats().in_place_bytes`).
  A dataset that keeps an array it returned (a cache) must never see the row written again.
  Each worker first fetches one sample with a private one-row arena (a probe): if the dataset
  keeps that array, the worker never fetches in place (the probe's row of memory stays with the
  cache).  If a dataset keeps a later array born in a row (the arena still has a live block once
  the sample is written and dropped), the worker sends Kept(slot, generation, offset, row bytes)
  before its RowsDone, with the row's bytes as written, and stops fetching in place.  The row
  shares memory with the dataset's array, which the dataset may change in place at any time
  (when that worker fetches the index again, maybe before the batch's other rows are in), so
  the main process delivers that batch as a private copy of the slot with the row's bytes put
  back as the worker sent them (the batch as fetched, as torch's would be), gives that slot a
  new segment the next time it claims it, and the worker's old mapping stays with the cache.
  The array born in the row may also be one the dataset keeps and does not return (a buffer it
  makes on that call: a mean image, a noise bank), the sample being made elsewhere.  So before
  a sample not found in place is written, the arena is asked whether a block is still live
  with the sample's own references dropped: if so, the row is left to the dataset's array, and
  Kept carries the sample's bytes instead (writing them over the buffer changed every later
  sample of that worker).
  Off with
  SHMLOADER_SLOT_ARENA=0, as the default mode's arena.

  Scope.  Map-style datasets with the default collate_fn (torch's default_collate) and a batch
  size (batch_size or batch_sampler).  An IterableDataset, a custom collate_fn or batch_size=None
  is a ValueError at construction, naming what and saying to use the default mode.  A dataset
  with __getitems__ gets it called with one index at a time, in a one-item slice of the
  container the batch sampler yielded (a list, a tensor, an array: `_one_by_one`).  num_workers=0 runs in process
  as the default mode does (there is nothing to spread).  prefetch_next_epoch=True sends the
  next epoch's first batches ahead (NOTE [ The next epoch's first batches ]).  persistent_workers, timeout,
  pin_memory (the slots are page-locked as in the default mode), held batches (list(loader):
  NOTE [ Held batches ] in ring.py) and stats() work as in the default mode (stats().timing is
  None; in_place_bytes counts rows born in place); in_order=False delivers in order anyway; state_dict() / load_state_dict() resume mid-epoch
  (below).

NOTE [ Resuming a sample-parallel epoch ]
  The default mode's state (NOTE [ Resuming mid-epoch ] in state.py, the same IterState hooks:
  the RNG states at the epoch's start, the sampler's position as of each batch drawn and
  delivered, the base seed), plus what this mode seeds rows with: the iterator's epoch count
  (`epoch` in the state).  A resumed iterator takes the saved base seed before its workers
  start, replays the sampler to batch k, and numbers its epoch and its batches from the saved
  ones (a batch that raised, its error caught by the loop, counts as drawn), so batch k's row r
  is seeded as it was (rows.sample_seed(base_seed, e, k, r)) and the
  resumed run yields the uninterrupted run's batches, random augmentations included, at any
  num_workers >= 1.  What it cannot save: a dataset's own state (torchdata's protocol), since
  every worker fetches rows of every batch and no one worker's state is the dataset's; state_dict()
  saves the position and warns.  A state of one mode is refused by the other (`sample_parallel`
  in the state's loader configuration): the two seed random augmentations differently.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import torch
from torch.utils.data import IterableDataset, default_collate

from . import epochs, rows, state
from ._ring import HEADER_BYTES, SlotArena
from .errors import LoaderTimeoutError, SlotProtocolError
from .interrupts import ctrl_c_held
from .loader import _RESUMABLE, POLL_SECONDS, TIMEOUT_ADVICE, LoaderStats, _Failure, _PoolIter
from .pool import Poller, WorkerPool
from .protocol import (
    FETCHING,
    IDLE,
    LAYING_OUT,
    WRITING,
    Failed,
    Fatal,
    Kept,
    Learn,
    Rows,
    RowsDone,
    Schema,
)
from .ring import CONSUMER_SLOTS
from .scheduler import SlotScheduler
from .segment import create_segment, create_segment_or_overflow, slot_capacity
from .worker import Shipped, WorkerSpec, exception_payload

COLLATE_ROWS = "rows"  # WorkerSpec.collate_mode of this mode's workers (they run no Task)
_USE_DEFAULT = "use the default mode (sample_parallel=False)"


# -- what this mode supports ------------------------------------------------------------------------


def check_loader(loader) -> None:
    """A clear ValueError, at construction and when the workers start, for what this mode cannot
    do (a collate_fn set after construction, as torch allows, is caught at iter())."""
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError(
            f"sample_parallel=True needs a map-style dataset (it spreads the indices of each batch "
            f"over the workers); {type(loader.dataset).__name__} is an IterableDataset: {_USE_DEFAULT}")
    if loader.batch_size is None and loader.batch_sampler is None:
        raise ValueError(f"sample_parallel=True needs batches (batch_size=None gives single samples): {_USE_DEFAULT}")
    if loader.collate_fn is not default_collate:
        raise ValueError(
            f"sample_parallel=True writes each sample's rows as torch's default_collate stacks them, "
            f"so it needs the default collate_fn; got collate_fn={loader.collate_fn!r}: {_USE_DEFAULT}")


# A row of one of these did not fit its batch's layout (NOTE [ A new shape ])
_SHAPE_ERRORS = ("BatchShapeError", "MissingKeyError")


def _same_layout(a: rows.RowSchema, b: rows.RowSchema) -> bool:
    """Whether two schemas lay out the same structure, shapes and dtypes (any batch size)."""
    def rows_of(schema):  # a leaf's offset depends on the batch size
        return [dataclasses.replace(leaf, offset=0) for leaf in schema.leaves]

    return a.tree == b.tree and rows_of(a) == rows_of(b)


def _one_by_one(indices):
    """A batch of indices as the workers get it, one-item slices of it to fetch: the batch
    sampler's own container where it slices into its own type (a list, tuple, range, tensor or
    array: a dataset's __getitems__ gets what torch's fetcher would give it, one index long),
    else a list of its items."""
    if isinstance(indices, (list, tuple, range, torch.Tensor, np.ndarray)) and getattr(indices, "ndim", 1) == 1:
        return indices
    return list(indices)


def _first_worker(idx: int, size: int, num_workers: int) -> int:
    """The worker of batch `idx`'s first chunk (NOTE above): 0, or turns for a small batch."""
    return 0 if size >= num_workers else idx % num_workers


def _chunks(size: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges: `size` rows in min(parts, size) contiguous, near-equal chunks."""
    parts = min(parts, size)
    base, extra = divmod(size, parts)
    bounds, lo = [], 0
    for j in range(parts):
        hi = lo + base + (j < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


class _Schemas:
    """The learnt RowSchema and its resized forms, by batch size (both sides keep one)."""

    def __init__(self, schema: rows.RowSchema):
        self.by_size = {schema.batch_size: schema}
        self.any = schema

    def get(self, size: int) -> rows.RowSchema:
        schema = self.by_size.get(size)
        if schema is None:
            schema = self.by_size[size] = self.any.resized(size)
        return schema


# -- the worker's side --------------------------------------------------------------------------------


class _RowsWorker:
    """A worker's state in this mode: the schema, the sample it learnt the schema from, and
    whether it fetches rows in place (NOTE [ Rows born in place ])."""

    def __init__(self):
        self.schemas: _Schemas | None = None
        self.kept = None  # (epoch, idx, sample): row 0 of the batch the schema was learnt from
        # None: not probed yet; then True / False for good
        self.in_place = None if os.environ.get("SHMLOADER_SLOT_ARENA", "1") != "0" else False

    def arena_for(self, segment, schema: rows.RowSchema, epoch: int, idx: int, row: int):
        """(the arena to fetch row `row` of batch `idx` with, whether it is the row itself), or
        (None, False) (NOTE [ Rows born in place ])."""
        leaf = schema.in_place_leaf
        if leaf is None or self.in_place is False or (row == 0 and self.kept is not None
                                                      and self.kept[:2] == (epoch, idx)):
            return None, False  # (the sample the schema was learnt from is fetched already)
        if self.in_place is None:  # the probe: a private row
            probe = create_segment(HEADER_BYTES + leaf.row_nbytes, 1, "a one-row probe of whether the dataset keeps its samples")
            probe.close_fd()
            return SlotArena(probe, HEADER_BYTES, 0, HEADER_BYTES + leaf.row_nbytes, True), False
        at = leaf.offset + row * leaf.row_nbytes
        return SlotArena(segment, at, 0, at + leaf.row_nbytes, True), True

    def fetch(self, worker, epoch: int, idx: int, row: int, one):
        """The sample of `one` (a one-index slice of the batch: _one_by_one) as row `row` of
        batch `idx`: seeded for that row (NOTE above)."""
        kept, self.kept = self.kept, None
        if kept is not None and row == 0 and kept[:2] == (epoch, idx):
            return kept[2]
        # (a batch of the next epoch fetched ahead is tagged -epoch: seeded as that epoch's)
        rows.seed_sample(rows.sample_seed(worker.spec.base_seed, abs(epoch), idx, row))
        return worker.fetcher.fetch(one)[0]

    def learn(self, worker, message: Learn) -> None:
        epoch, idx, size, first = message
        stage = worker._enter(FETCHING, idx)
        try:
            if worker.init_error is not None:
                stage, payload = worker.init_error
                worker.channel.send(Failed(epoch, idx, stage, payload))
                return
            sample = self.fetch(worker, epoch, idx, 0, first)
            stage = worker._enter(LAYING_OUT, idx) + " (learning the batch's row layout from row 0)"
            schema = rows.learn_schema(sample, size)
        except Exception as exc:
            worker.channel.send(Failed(epoch, idx, stage, exception_payload(exc)))
            return
        self.kept = (epoch, idx, sample)  # (its layout comes back with the batch's rows)
        worker.channel.send(Schema(epoch, idx, schema.to_bytes()))

    def rows(self, worker, message: Rows, fds: list[int]) -> None:
        epoch, idx, slot, generation, capacity, size, first_row, indices = message
        # Not populated: this worker writes a few rows of it (a mismatch is a protocol error).
        segment = worker._attach(slot, generation, capacity, fds, populate=False)
        stage, row = worker.stage, first_row
        arena, in_row, in_place, done, sample, ready = None, False, 0, None, None, None
        try:
            if worker.init_error is not None:
                stage, payload = worker.init_error
                worker.channel.send(Failed(epoch, idx, stage, payload))
                return
            if self.schemas is None or segment is None:
                raise SlotProtocolError(f"worker {worker.spec.worker_id} got rows of batch {idx} "
                                        "before the schema or without a slot segment")
            schema = self.schemas.get(size)
            for row in range(first_row, first_row + len(indices)):
                one = indices[row - first_row:row - first_row + 1]
                stage = worker._enter(FETCHING, idx)
                arena, in_row = self.arena_for(segment, schema, epoch, idx, row)
                if arena is None:
                    sample = self.fetch(worker, epoch, idx, row, one)
                else:
                    with arena:
                        sample = self.fetch(worker, epoch, idx, row, one)
                stage = worker._enter(WRITING, idx)
                placed, ready = rows.prepare_row(segment, schema, row, sample, in_row)
                sample = None
                kept_row = None
                if in_row and placed is None and arena.live:
                    # The dataset returned another array, and keeps one born in the row (a buffer
                    # it made on this call): leave the row to it and send the sample's bytes
                    # (NOTE [ Rows born in place ]).
                    leaf = schema.in_place_leaf
                    kept_row = rows.row_bytes(ready[schema.leaves.index(leaf)])
                in_place += rows.write_prepared(segment, schema, row, placed, ready,
                                                skip=schema.in_place_leaf if kept_row is not None else None)
                ready = None
                if kept_row is not None:
                    worker.channel.send(Kept(slot, generation, arena.begin, kept_row))
                if arena is not None:
                    self.settle(worker, arena, in_row, segment, slot, generation, row_sent=kept_row is not None)
                    arena = None
        except Exception as exc:
            done = Failed(epoch, idx, f"{stage}, at row {row} (index {indices[row - first_row]!r})",
                          exception_payload(exc))
        if arena is not None:  # a fetch or a write raised: the traceback is gone by now
            sample = ready = None  # noqa: F841 (ours: only the dataset's references may keep the arena alive)
            self.settle(worker, arena, in_row, segment, slot, generation)
        worker.channel.send(done or RowsDone(epoch, idx, len(indices), in_place))

    def settle(self, worker, arena, in_row: bool, segment, slot: int, generation: int,
               row_sent: bool = False) -> None:
        """The sample is written and dropped: does the dataset keep an array born in the arena?
        (NOTE [ Rows born in place ]; `row_sent`: the row's Kept is sent already)"""
        row = (arena.begin, arena.end)
        kept = arena.release()
        if self.in_place is None and not in_row:
            self.in_place = kept == 0  # the probe's answer (later keeps: Kept, below)
        elif kept:
            self.in_place = False
            if in_row and not row_sent:  # the row's bytes now, before the dataset can change its array
                worker.channel.send(Kept(slot, generation, row[0], segment.read(row[0], row[1] - row[0])))


def worker_handle(worker, message, fds: list[int]) -> None:
    """worker.py's branch for this mode's messages."""
    state = worker.__dict__.get("rows_state")
    if state is None:
        state = worker.rows_state = _RowsWorker()
    kind = type(message)
    if kind is Schema:
        state.schemas = _Schemas(rows.RowSchema.from_bytes(message.schema))
    elif kind is Learn:
        state.learn(worker, message)
    else:
        state.rows(worker, message, fds)
    worker._enter(IDLE)


# -- the main process's side ----------------------------------------------------------------------


class _Batch:
    """One batch drawn from the sampler, until it is delivered."""

    __slots__ = ("epoch", "idx", "indices", "slot", "left", "first_row", "failure", "fatal", "done", "data",
                 "schemas", "relearn", "relearnt", "dropped")

    def __init__(self, epoch: int, idx: int, indices):
        # epoch: its epoch, or -e for one of epoch e's first batches sent before e began (NOTE
        # [ The next epoch's first batches ]); (epoch, idx) is its key and its messages' tag
        self.epoch, self.idx, self.indices = epoch, idx, _one_by_one(indices)
        self.dropped = False  # sent ahead, and the sampler did not bear it out (or its epoch was left)
        self.slot: int | None = None
        self.left = 0  # chunks not reported yet
        self.first_row: dict[int, int] = {}  # worker -> its chunk's first row
        self.failure: _Failure | None = None
        self.fatal = False  # its failure shuts the loader down (the schema cannot be learnt)
        self.done = False
        self.data = None
        self.schemas: _Schemas | None = None  # the layout its rows are written in
        self.relearn = False  # its rows did not fit the layout: row 0 is being learnt again
        self.relearnt = False  # (once per batch: NOTE [ A new shape ])


class SampleParallelIter(_PoolIter):
    """The iterator of `sample_parallel=True` (NOTE [ Samples of one batch over the workers ])."""

    def __init__(self, loader) -> None:
        super().__init__(loader)
        # NOTE [ Resuming a sample-parallel epoch ]; a loaded state's seed, before the workers start
        self._resumable = state.IterState.attach(self, loader)
        self._resumable.in_order = True  # batches come in order in this mode, whatever in_order says
        if state.is_stateful(self._dataset):
            self._resumable.unsaved = (
                f"sample_parallel=True saves the loader's position but not the state of the dataset "
                f"({type(self._dataset).__name__} has state_dict/load_state_dict): its rows are fetched by "
                f"all the workers, so there is no one worker's state to save; {_USE_DEFAULT} to save it too")
        self._depth = max(2, loader.prefetch_factor)  # batches in flight
        self._schemas: _Schemas | None = None  # the layout of the batches to come
        self._sent_schemas: _Schemas | None = None  # the one the workers have (NOTE [ A new shape ])
        self._learning: tuple[int, int] | None = None  # (epoch, idx) whose row 0 is being learnt
        self._flight: dict[tuple[int, int], _Batch] = {}  # drawn, not delivered (stale epochs too)
        self._queue: list[_Batch] = []  # drawn, not yet sent to the workers
        self._kept_segments: set[tuple[int, int]] = set()  # (slot, generation) a dataset keeps rows of
        self._kept_rows: dict[tuple[int, int], list[tuple[int, bytes]]] = {}  # their bytes as written
        self._in_place_bytes = 0
        # NOTE [ The next epoch's first batches ] (persistent workers only: the loader checks)
        self._ahead_on = bool(getattr(loader, "prefetch_next_epoch", False)) and self._persistent_workers
        self._forecast: epochs.Forecast | None = None  # the next epoch's first items, once drawn
        self._ahead: list[_Batch] = []  # the next epoch's first batches, sent ahead, by position
        self._adopted: dict[int, _Batch] = {}  # this epoch's batches that were sent ahead and kept
        self._prefetched = 0  # batches kept, in all epochs
        self._misses = 0  # forecasts the sampler did not bear out in full
        pinner = None
        if self._pin_memory:
            from .cuda import SlotPinner

            pinner = SlotPinner(self._pin_memory_device)
        self._scheduler = SlotScheduler(
            self._num_workers, self._depth, slot_bytes=loader.slot_bytes, max_slots=loader.max_ring_slots,
            max_bytes=loader.max_ring_bytes, pinner=pinner, depth=self._depth + CONSUMER_SLOTS)
        context = loader.multiprocessing_context or torch.multiprocessing
        payload = Shipped((self._dataset, None, loader.worker_init_fn))

        def make_spec(worker_id: int) -> WorkerSpec:
            return WorkerSpec(
                worker_id=worker_id, num_workers=self._num_workers, base_seed=self._base_seed,
                dataset_kind=self._dataset_kind, auto_collation=self._auto_collation,
                collate_mode=COLLATE_ROWS, drop_last=self._drop_last, payload=payload,
                main_pid=os.getpid(), forked=context.get_start_method() == "fork",
                ring_depth=self._ring.depth)

        try:
            self._pool = WorkerPool(self._num_workers, context, make_spec, False, self._worker_died)
        except BaseException:
            self._shutdown_workers()
            raise
        self._scheduler.send = self._pool.send
        self._everything = Poller(list(self._pool.channel_of) + list(self._pool.sentinel_of))
        self._reset(loader, first_iter=True)

    # -- epochs and dispatch -----------------------------------------------------------------------

    def _reset(self, loader, first_iter=False) -> None:
        self._resumable.before_epoch(loader, first_iter)  # the RNG states the sampler starts from
        super()._reset(loader, first_iter)
        self._send_idx = 0
        self._rcvd_idx = 0
        self._exhausted = False
        self._adopted = {}
        if not first_iter:
            self._epoch += 1
        resumed = self._resumable.before_prime(self, loader, first_iter)  # the sampler replayed to batch k
        if resumed is not None:  # NOTE [ Resuming a sample-parallel epoch ]
            self._epoch = resumed["epoch"]
            # the batches drawn before the saved position, failed ones too (batches_yielded counts
            # only those delivered): the next batch's number, which its rows are seeded with
            self._send_idx = self._rcvd_idx = resumed["sampler"]["yielded"]
        self._resumable.epoch = self._epoch
        if not first_iter:
            try:
                self._adopt_ahead()  # (the sampler may raise, as torch's iter() raises it)
            finally:
                for key, batch in list(self._flight.items()):  # the last epoch's: never delivered
                    if self._stale(batch) and (batch.done or batch.slot is None):
                        del self._flight[key]  # a delivered-to-be batch's lease goes with it
                # a schema being learnt still serves; a failure to learn it is dropped
                self._queue = [batch for batch in self._queue if not self._stale(batch)]
        self._fill()

    def _fill(self, create: bool = True, waiting: bool = False) -> None:
        """Draw batches up to the in-flight depth and send what can be sent (without `create`,
        only into slots that have a segment: making one waits until the loop must wait anyway).
        `waiting`: the loop is about to wait for its next batch (NOTE [ A full ring under a cap ]).

        Batches that will never be delivered (an epoch left early) do not count against the
        depth: they hold their slots until their rows are in, but drawing does not wait for them,
        so an iter() draws from the sampler what it always draws, whatever the timing, as torch's
        iter() does (a RandomSampler draws its permutation at its first batch)."""
        while not self._exhausted and self._live_batches() < self._depth:
            try:
                index = self._next_index()
            except StopIteration:
                self._exhausted = True
                break
            self._add_batch(index)
        if self._exhausted:
            self._send_ahead()
        self._dispatch(create, waiting)

    def _next_index(self):
        index = super()._next_index()
        self._resumable.on_index(self)  # the sampler's position as of batch _send_idx
        return index

    def _live_batches(self) -> int:
        """Batches in flight that are to be delivered (not stale)."""
        return sum(1 for batch in self._flight.values() if not self._stale(batch))

    def _add_batch(self, index) -> None:
        batch = _Batch(self._epoch, self._send_idx, index)
        self._flight[(batch.epoch, batch.idx)] = batch
        self._queue.append(batch)
        self._send_idx += 1

    # NOTE [ The next epoch's first batches ]
    #   With prefetch_next_epoch=True (persistent workers), once the epoch's sampler iterator has
    #   raised StopIteration the main process forecasts the next epoch's first `depth` batches of
    #   indices (epochs.make: a copy of the batch sampler, no real sampler or global RNG touched;
    #   NOTE [ Cross-epoch prefetch ] in epochs.py) and sends them as batches of their own, tagged
    #   with the negative next epoch, as this epoch's batches are delivered: as many batches are in
    #   flight across the boundary as within an epoch.  Their rows are seeded as the next epoch's
    #   (rows.sample_seed with the epoch's number), so a batch kept is the batch that epoch would
    #   have fetched.  At the next iter() the real sampler is drawn as always, and each forecast
    #   batch is kept, in order, while its indices are the real ones (epochs.matches); from the
    #   first that differs on, the rest are dropped (their slots go back once their rows are in)
    #   and the real batches are sent.  Workers keep no state between rows in this mode (each row
    #   is seeded on its own), so nothing has to be undone in them.  A dropped batch is never
    #   delivered; a kept one is delivered at its turn, its failure raised at its turn.

    def _stale(self, batch: _Batch) -> bool:
        """Whether `batch` will never be delivered: dropped, or of an epoch other than this one
        (its own or, sent ahead and kept, tagged -epoch; or sent ahead for the next one)."""
        if batch.dropped:
            return True
        if batch.epoch >= 0:
            return batch.epoch != self._epoch
        return batch.epoch != -self._epoch and batch.epoch != -(self._epoch + 1)

    def _send_ahead(self) -> None:
        """This epoch's indices are all drawn: send the next epoch's forecast batches, while fewer
        than `depth` batches are in flight (the forecast is made at the first call)."""
        if not self._ahead_on or self._shutdown:
            return
        if self._forecast is None or self._forecast.epoch != self._epoch + 1:
            self._forecast = epochs.make(self._index_sampler, self._depth, self._epoch + 1, dataset=self._dataset)
            self._ahead = []
            if self._forecast is None:
                self._forecast = epochs.Forecast(self._epoch + 1, [])  # not forecastable: tried once
        forecast = self._forecast
        while len(self._ahead) < len(forecast) and self._live_batches() < self._depth:
            position = len(self._ahead)
            batch = _Batch(-forecast.epoch, position, forecast.items[position])
            self._flight[(batch.epoch, batch.idx)] = batch
            self._queue.append(batch)
            self._ahead.append(batch)

    def _adopt_ahead(self) -> None:
        """At the top of an epoch: draw from the sampler as many batches as were sent ahead and
        keep those the sampler bears out, as a prefix; drop the rest (and any older ones)."""
        ahead, forecast = self._ahead, self._forecast
        self._ahead, self._forecast = [], None
        for batch in self._flight.values():  # dropped unless kept below (also if the sampler raises)
            if batch.epoch < 0:
                batch.dropped = True
        if forecast is None or forecast.epoch != self._epoch:
            return
        for position, batch in enumerate(ahead):
            try:
                index = self._next_index()
            except StopIteration:
                self._exhausted = True
                break
            if not forecast.agrees(position, index):
                self._add_batch(index)  # the real batch, after the ones kept
                break
            batch.dropped = False
            self._adopted[position] = batch
            self._send_idx += 1
        self._prefetched += len(self._adopted)
        if len(self._adopted) < len(ahead):
            self._misses += 1

    def _awaited_key(self) -> tuple[int, int]:
        """The key of the batch the loop is to get next (one sent ahead and kept: tagged)."""
        idx = self._rcvd_idx
        return (-self._epoch, idx) if idx in self._adopted else (self._epoch, idx)

    def _dispatch(self, create: bool = True, waiting: bool = False) -> None:
        while self._queue:
            batch = self._queue[0]
            if self._schemas is None or batch.relearn:
                if self._learning is None:
                    self._learning = (batch.epoch, batch.idx)
                    self._send(_first_worker(batch.idx, len(batch.indices), self._num_workers),
                               Learn(batch.epoch, batch.idx, len(batch.indices), batch.indices[:1]))
                return
            awaited = (batch.epoch, batch.idx) == self._awaited_key()
            if not self._claim_slot(batch, create or awaited, waiting and awaited):
                return
            self._queue.pop(0)
            self._send_rows(batch)

    def _claim_slot(self, batch: _Batch, create: bool = True, stuck_without: bool = False) -> bool:
        """Give `batch` a slot of the right size, claimed for it; False if none can be had now
        (or, without `create`, none that has a segment already). `stuck_without`: the loop waits
        for `batch`, so no slot and nothing in flight to free one is a full ring (RingFullError)."""
        ring = self._ring
        self._scheduler.replenish()
        if not create and not ring.has_free_created_slot():
            return False
        if not ring.can_take():
            # NOTE [ A full ring under a cap ]
            if stuck_without and not any(b.slot is not None and not b.done for b in self._flight.values()):
                ring.make_room()  # gc, spill or an overflow slot; else a user's cap (RingFullError)
            return False
        slot = ring.take_free_slot(created_only=not create)
        generation, capacity, hint = ring.task_geometry(slot)
        if batch.schemas is None:  # (a batch learnt again has its own: NOTE [ A new shape ])
            batch.schemas = self._schemas
        needed = batch.schemas.get(len(batch.indices)).total_bytes
        kept = (slot, generation) in self._kept_segments
        try:
            if capacity < needed or kept:  # (a kept segment stays with the worker's cache)
                self._kept_segments.discard((slot, generation))
                with ctrl_c_held():  # made and adopted whole (NOTE [ Ctrl-C held ] in interrupts.py)
                    segment = create_segment_or_overflow(slot_capacity(needed, capacity, hint), generation + 1,
                                                         f"slot {slot} of the ring ({ring.depth} slots)",
                                                         populate=False)
                    try:
                        ring.adopt(slot, os.dup(segment.fd), segment.size, generation + 1)
                    finally:
                        segment.close_fd()  # this mapping goes with `segment`; the ring maps its own
                self._scheduler.pin(ring.segment(slot))
                self._scheduler.replenish()  # workers forget the segment it replaced
            found = ring.segment(slot).claim(self._num_workers, batch.idx)  # writer: the main process
        except BaseException:
            ring.unassign(slot)
            raise
        if found != rows.layout._ring.FREE:
            raise SlotProtocolError(f"slot {slot} is in state {found}, not FREE, when claimed for batch {batch.idx}")
        batch.slot = slot
        return True

    def _send_rows(self, batch: _Batch) -> None:
        if batch.schemas is not self._sent_schemas:  # the workers write in the layout sent last
            message = Schema(batch.epoch, batch.idx, batch.schemas.any.to_bytes())
            for worker_id in range(self._num_workers):
                self._send(worker_id, message)
            self._sent_schemas = batch.schemas
        slot = batch.slot
        generation, capacity, _ = self._ring.task_geometry(slot)
        size = len(batch.indices)
        chunks = _chunks(size, self._num_workers)
        batch.left = len(chunks)
        first = _first_worker(batch.idx, size, self._num_workers)
        for j, (lo, hi) in enumerate(chunks):
            worker_id = (first + j) % self._num_workers
            batch.first_row[worker_id] = lo
            self._send(worker_id, Rows(batch.epoch, batch.idx, slot, generation, capacity, size, lo,
                                       batch.indices[lo:hi]), self._scheduler.fds_for(worker_id, slot))

    def _send(self, worker_id: int, message, fds: tuple[int, ...] = ()) -> None:
        self._pool.send(worker_id, message, fds)

    # -- results --------------------------------------------------------------------------------

    def _handle(self, worker_id: int, message, fds: list[int]) -> None:
        for fd in fds:  # no message of this mode carries an fd to the main process
            os.close(fd)
        kind = type(message)
        if kind is Schema:
            self._learning = None
            schema = rows.RowSchema.from_bytes(message.schema)
            batch = self._flight.get((message.epoch, message.idx))
            if batch is not None and batch.relearn:  # NOTE [ A new shape ]
                batch.relearn = False
                if _same_layout(batch.schemas.any, schema):
                    self._queue.remove(batch)  # its rows disagree among themselves: its own error
                    batch.done = True
                    self._dispatch(create=self._rcvd_idx > 0)
                    return
                batch.failure = None
                batch.schemas = _Schemas(schema)
            self._schemas = batch.schemas if batch is not None and batch.schemas else _Schemas(schema)
            self._dispatch(create=self._rcvd_idx > 0)  # NOTE [ The first batch first ]
            return
        if kind is Fatal:
            _Failure(worker_id, self._workers[worker_id].pid, None, message.stage, message.payload).reraise()
        if kind is Kept:  # NOTE [ Rows born in place ]: a new segment when the slot is next claimed
            self._kept_segments.add((message.slot, message.generation))
            self._kept_rows.setdefault((message.slot, message.generation), []).append((message.offset, message.row))
            return
        if kind is not RowsDone and kind is not Failed:
            raise SlotProtocolError(f"unexpected message {message!r:.200} from worker {worker_id}")
        key = (message.epoch, message.idx)
        batch = self._flight.get(key)
        failure = None
        if kind is Failed:
            failure = _Failure(worker_id, self._workers[worker_id].pid, message.idx, message.stage, message.payload)
        if key == self._learning:  # learning the schema from row 0 failed
            self._learning = None
            if batch is not None and batch in self._queue:
                self._queue.remove(batch)
                batch.failure, batch.done = failure, True
                batch.fatal = message.payload[1].endswith("RowsUnsupportedError")
            self._dispatch()  # learn from the next batch
            return
        if batch is None or batch.slot is None:
            raise SlotProtocolError(f"worker {worker_id} reported rows of batch {message.idx} (epoch "
                                    f"{message.epoch}), which is not in flight")
        if failure is not None:
            row = batch.first_row.get(worker_id, 0)
            if batch.failure is None or row < batch.first_row.get(batch.failure.worker_id, 0):
                batch.failure = failure
        if failure is None:
            self._in_place_bytes += message.in_place
        batch.left -= 1
        if batch.left == 0:
            self._complete(batch)

    def _complete(self, batch: _Batch) -> None:
        """Every chunk of `batch` is reported: publish and read it, or give its slot back."""
        stale = self._stale(batch)
        kept_rows = self._kept_rows.pop((batch.slot, self._ring.task_geometry(batch.slot)[0]), None)
        if stale or batch.failure is not None:
            self._ring.unassign(batch.slot)  # WRITING -> FREE: no worker writes to it any more
            if stale:
                del self._flight[(batch.epoch, batch.idx)]
                self._fill()
                return
            if not batch.relearnt and batch.failure.type_name in _SHAPE_ERRORS:  # NOTE [ A new shape ]
                batch.slot, batch.first_row, batch.relearn, batch.relearnt = None, {}, True, True
                order = (abs(batch.epoch), batch.idx)  # (an epoch's batches sent ahead come after this one's)
                later = [k for k, queued in enumerate(self._queue) if (abs(queued.epoch), queued.idx) > order]
                self._queue.insert(later[0] if later else len(self._queue), batch)  # in order
                self._dispatch()
                return
            batch.data = batch.failure
        else:
            segment = self._ring.segment(batch.slot)
            rows.publish_batch(segment, batch.schemas.get(len(batch.indices)))
            # A row that is an array the dataset keeps (Kept), which it may have changed since:
            # a copy, with the row as written (NOTE [ Rows born in place ]).
            batch.data = self._scheduler.deliver(batch.slot, batch.idx, restore=kept_rows)
        batch.done = True

    # -- the next batch ----------------------------------------------------------------------------

    def _next_data(self):
        self._check_open()  # NOTE [ Shutdown ] in pool.py
        try:
            batch = self._next_batch()
        except (StopIteration, LoaderTimeoutError):
            raise  # after a timeout the next next() waits again, as torch's does
        except BaseException as exc:
            if not getattr(exc, _RESUMABLE, False):  # NOTE [ Ctrl-C in the wait ] in loader.py
                self._break(exc)
            raise
        self._resumable.on_delivered(batch.idx, self._num_workers - 1, batch.failure is None)
        if batch.failure is None:
            self._batches += 1
            return batch.data
        try:
            batch.failure.reraise(self._failure_note(batch.failure))
        except BaseException as exc:
            if batch.fatal:  # no schema can be learnt: every batch would fail
                self._break(exc)
            raise

    def _next_in_turn(self):
        return self._resumable.next(self, super()._next_in_turn)  # marks the epoch's end

    def _next_batch(self) -> _Batch:
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        while True:
            self._scheduler.replenish()
            self._read(0)
            key = self._awaited_key()
            batch = self._flight.get(key)
            if batch is not None and batch.done:
                del self._flight[key]
                self._adopted.pop(self._rcvd_idx, None)
                self._rcvd_idx += 1
                self._fill(create=False)  # the next batches go on; new segments can wait
                return batch
            self._fill(create=self._rcvd_idx > 0, waiting=True)  # NOTE [ The first batch first ]
            batch = self._flight.get(key)
            if batch is None and self._exhausted:
                if not self._persistent_workers:
                    self._shutdown_workers()
                raise StopIteration
            if batch is not None and batch.done:
                continue
            wait = POLL_SECONDS if deadline is None else max(0.0, min(POLL_SECONDS, deadline - time.monotonic()))
            if not self._read(wait) and deadline is not None and time.monotonic() >= deadline:
                raise LoaderTimeoutError(
                    f"DataLoader timed out after {self._timeout} seconds waiting for batch "
                    f"{self._rcvd_idx}; {TIMEOUT_ADVICE}")

    def _read(self, wait: float) -> int:
        """Handle the messages waiting (waiting up to `wait` for one); a dead worker raises."""
        channel_of, sentinel_of = self._pool.channel_of, self._pool.sentinel_of
        handled = 0
        try:
            ready = self._everything.ready(wait)
        except KeyboardInterrupt as exc:  # NOTE [ Ctrl-C in the wait ] in loader.py
            setattr(exc, _RESUMABLE, True)
            raise
        while ready:
            for fd in ready:
                if fd in channel_of:
                    worker_id = channel_of[fd][0]
                    self._handle(worker_id, *self._pool.receive(worker_id))
                    handled += 1
            for fd in ready:
                if fd in sentinel_of and fd not in channel_of:
                    self._worker_died(sentinel_of[fd])
            ready = self._everything.ready(0)
        self._check_exits()
        return handled

    # -- statistics and shutdown ---------------------------------------------------------------------

    def stats(self) -> LoaderStats:
        ring = self._final_ring_stats or self._ring.stats()
        shared = {f.name: getattr(ring, f.name) for f in dataclasses.fields(ring)
                  if f.name not in ("slots", "allocated_slots")}
        pool = self._pool
        return LoaderStats(ring_slots=ring.slots, reserved_bytes=ring.reserved_bytes, batches=self._batches,
                           in_place_bytes=self._in_place_bytes, control_bytes=pool.control_bytes if pool else 0,
                           control_messages=pool.control_messages if pool else 0, timing=None,
                           prefetched_next_epoch=self._prefetched, forecast_misses=self._misses,
                           timing_off="not measured with sample_parallel=True", **shared)

    def _drop_buffered(self) -> None:
        self._flight.clear()  # batches read ahead, never delivered: their leases go
        self._queue.clear()
        self._ahead.clear()
        self._adopted.clear()
