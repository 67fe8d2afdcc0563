"""Samples born in the slot: the default mode's workers fetch each sample's largest array straight
into its row of the batch.

NOTE [ Samples born in the slot ]
  With torch's default_collate, a worker fetches batch_size samples and the collate stacks them.
  Each sample's array is first made on the worker's heap (np.random.random(shape), a decoder's
  output) and then copied into its row of the slot: one more pass over every byte of the batch on
  the workers' cores, and a batch's worth of heap memory in every worker (issue 9: memory no
  higher than torch's, no fresh pages per batch).  Instead:

    1. sample 0 is fetched as usual; from it `row_target` works out where default_collate's
       batch puts the rows of its largest array leaf (at least rows.IN_PLACE_MIN_BYTES a row),
       exactly as layout.plan_batch will lay the real batch out;
    2. if a slot grant is in hand or already waiting on the socket (never waited for: the fetch
       must not stall behind the training loop; asked again before each sample until one is
       there), the worker takes it for this batch, with its segment (a new one, at the batch's
       size, if the slot has none or a too-small one);
    3. each sample from then on is fetched with an exact slot arena over row k of that leaf
       (csrc/arena.h, as sample_parallel's rows): numpy's first allocation of exactly a row's
       size lands at the row's address;
    4. collate and layout run as before; layout.write_batch(..., rows_in_slot=True) copies no row
       already at its place, and copies out first every other source lying in the slot (a
       transposed view of a row, a row fetched for a batch laid out differently, a leaf born in
       another leaf's row), so no write reads bytes another write has overwritten.

  Fetching one sample at a time is torch's own loop (torch_private.fetch_each: the same calls,
  the same iterable end), so the samples, their randomness and the batches are torch's.  A
  dataset with __getitems__ is asked for the whole batch and gets no arena.

  Caches.  A dataset that keeps an array it returned must never see the slot written again.
  Once the batch is written and every reference of the worker's own is dropped, an arena with a
  live block means the dataset kept it: the batch is moved to a new segment for the slot (the
  worker's _move_batch, as for a collate_fn's cache) and the old segment stays mapped, with the
  cache, in this worker; the worker stops fetching in place.  A batch that fails after taking
  its grant puts the grant back; if blocks are still alive then, the grant goes back without its
  segment, so the slot gets a new one.  An iterable's last sample of each batch is fetched
  without an arena: a generator's frame often holds the value it yielded last until it is
  resumed, which would read as kept.

  A custom collate_fn.  A collate_fn that returns the samples' arrays as they are (the records,
  a dict of lists) has them copied into the slot: the same pass and heap as above.  The slot
  arena that a custom collate_fn runs in (NOTE [ One copy for a numpy collate_fn ] in worker.py)
  is a bump allocator over the slot; fetching the samples inside it too makes their arrays the
  batch's leaves in place.  But a collate_fn that makes new arrays (np.stack) would then find
  the arena full of samples and its own result on the heap, copied once more.  So a worker first
  watches its first LEARN_BATCHES batches, fetched as usual: if at least half of a batch's bytes
  are the samples' own arrays, copied, it fetches into the arena from then on (and gives the
  heap memory the watched batches took back: heap.py); if a batch fetched so finds less than
  half of what the arena handed out in place (the collate_fn changed), it stops for good.
  Watching cost every worker's first batch a batch of heap and a copy, on the path of the first
  batch (at 8 workers of seed001, 8 batches of heap at once beside the slots: in a probe, 2.5
  GB at the peak where 1.9 GB otherwise, and the first batch 0.2 s later).  A collate_fn whose code is
  `return` of its argument (`lambda batch: batch`, the forum's `def collate_fn(records): return
  records`: `returns_its_argument`) needs no watching: its workers fetch in the arena from the
  first batch, whose slot, before the ring knows its size, sample 0 sizes
  (worker.records_slot_guess, from GUESS_MIN_BYTES up).  Any other collate_fn is watched.  A batch whose arena
  holds more than the slot can lay out (dead temporaries) is laid out from the slot's start, what
  lies in the slot copied out first, never by growing the slot.  Slots made for a custom
  collate_fn are the compact batch plus worker.arena_slack: a block prefix per large leaf and a
  little room for small temporaries.  Kept arrays are handled as for the collate_fn's own (the
  batch moved).

  The heap it no longer needs.  Rows fetched while no grant is in hand (at start-up the ring's
  slots are still being made, NOTE [ Spare segments ] in spares.py) are made on the heap, and
  heap.keep_freed_memory keeps that batch's worth there after it is freed.  Once RELEASE_AFTER
  batches in a row are fetched wholly in place, the worker gives it back (heap.py), once per
  such spell: in a new-user check (batches of 64 images of 147 KiB, 2 workers), 8 MiB per
  worker for the rest of the run.  A worker whose rows keep finding no grant keeps it.

  When it stops.  A sample with no array leaf of at least IN_PLACE_MIN_BYTES a row, or a batch
  in which no arena was taken (the dataset returns arrays it made before: nothing to gain), turns
  it off for that worker.  SHMLOADER_SLOT_ARENA=0 turns it off everywhere, with the collate_fn
  arena.  stats().in_place_bytes counts the rows found in place.
"""

from __future__ import annotations

import dis
import os
import types
from dataclasses import dataclass

import numpy as np
import torch

from . import heap, layout, torch_private
from ._ring import SlotArena
from .errors import NoRoomForSlot
from .rows import IN_PLACE_MIN_BYTES

LEARN_BATCHES = 2  # custom collate_fn: batches watched for samples passed through
RELEASE_AFTER = 2  # default collate: batches wholly in place before the heap's free memory goes back


@dataclass(frozen=True)
class RowTarget:
    """Where a batch's rows of its largest array leaf lie in the slot."""

    offset: int  # of row 0, from the segment's start
    row_nbytes: int
    total_bytes: int  # the batch's payload end: the slot must hold this many bytes


def row_target(sample, batch_size: int) -> RowTarget | None:
    """Where layout.plan_batch puts the rows of the largest array leaf of torch's default_collate
    of `batch_size` samples shaped like `sample`; None if no leaf has IN_PLACE_MIN_BYTES a row or
    such a batch cannot be collated."""
    if not any((type(leaf) is np.ndarray or (type(leaf) is torch.Tensor and leaf.layout == torch.strided))
               and leaf.nbytes >= IN_PLACE_MIN_BYTES  # (a sparse tensor has no nbytes)
               for _, leaf in layout.iter_leaves(sample)):
        return None  # (cheap: most samples of small datasets end here)
    try:
        plan = layout.plan_batch(layout.collate_into_slot([sample] * batch_size))
    except Exception:
        return None  # the real batch raises its own error
    stacked = [(offset, leaf) for offset, leaf in plan.leaves
               if type(leaf) is layout.StackedLeaf and leaf.row_nbytes >= IN_PLACE_MIN_BYTES]
    if not stacked:
        return None
    offset, leaf = max(stacked, key=lambda placed: placed[1].row_nbytes)
    return RowTarget(offset, leaf.row_nbytes, plan.total_bytes)


class SamplesInSlot:
    """One worker's side of NOTE [ Samples born in the slot ] with torch's default_collate:
    whether it fetches in place, and the grant, segment and arenas of the batch being fetched."""

    def __init__(self, iterable: bool):
        self.on = os.environ.get("SHMLOADER_SLOT_ARENA", "1") != "0"
        self.iterable = iterable
        # "The heap it no longer needs" (NOTE above): rows fetched on the heap since the last
        # release, and the batches fetched wholly in place since then
        self.heap_rows = 0
        self.in_place_batches = 0
        self._reset()

    def _reset(self) -> None:
        self.grant = None  # the slot taken for the batch being fetched
        self.fresh = None  # the new segment made for it (the slot had none big enough)
        self.segment = None
        self.target: RowTarget | None = None
        self.arenas: list = []

    def wanted(self, fetcher) -> bool:
        return self.on and torch_private.fetches_one_by_one(fetcher)

    def fetch(self, worker, index) -> list:
        """The samples of `index`, as torch's fetcher returns them, rows born in a granted slot
        where they can be (`grant`, `fresh` and `arenas` say which slot and how)."""
        self._reset()
        size = len(index)
        last = size - 1 if self.iterable else size

        on_heap = 0

        def around_sample(k: int, fetched: list):
            nonlocal on_heap
            if k == 1:
                self.target = row_target(fetched[0], size)
                self.on = self.target is not None  # off for good: nothing row-sized to fetch in place
            if k >= last or self.target is None:
                return None
            if self.segment is None and not self._take_slot(worker):
                on_heap += 1
                return None  # no grant yet: asked again at the next sample
            at = self.target.offset + k * self.target.row_nbytes
            arena = SlotArena(self.segment, at, 0, at + self.target.row_nbytes, True)
            self.arenas.append(arena)
            return arena

        samples = torch_private.fetch_each(worker.fetcher, index, around_sample)
        if on_heap:
            self.heap_rows += on_heap
            self.in_place_batches = 0
        elif self.arenas:
            self.in_place_batches += 1
        return samples

    def _take_slot(self, worker) -> bool:
        """Take the slot of a grant in hand or waiting on the socket for this batch, if any."""
        grant = worker.grant_now()
        if grant is None:
            return False
        self.grant = grant
        try:
            self.segment, self.fresh = worker.segment_for(grant, self.target.total_bytes)
        except NoRoomForSlot:  # handed back (NOTE [ No room for a worker's first slot ] in worker.py)
            self.grant = None
            return False
        return True

    @property
    def fetched_in_slot(self) -> bool:
        return bool(self.arenas)

    def settle(self) -> int:
        """The batch is written (or failed) and the worker's references are dropped: release the
        arenas; returns how many blocks the dataset keeps (NOTE above: then off for good)."""
        arenas, self.arenas = self.arenas, []
        if arenas and not any(arena.taken for arena in arenas):
            self.on = False  # the dataset makes no row-sized arrays while fetching
        kept = sum(arena.release() for arena in arenas)
        if kept:
            self.on = False
        self.segment = self.target = None
        return kept

    def after_batch(self) -> None:
        """The batch is sent.  Rows fetched on the heap (no grant in hand yet) left a batch's
        worth of free memory there, which heap.keep_freed_memory keeps; once RELEASE_AFTER
        batches in a row are fetched wholly in place, the worker no longer needs it and gives it
        back (a worker whose rows often find no grant keeps it, and is spared the page faults)."""
        if self.heap_rows and self.in_place_batches >= RELEASE_AFTER:
            self.heap_rows = 0
            heap.release_free_memory()


def returns_its_argument(function) -> bool:
    """Whether `function` is plain Python code that only returns its first argument (`lambda
    batch: batch`): then it passes the samples through, whatever they are, and does nothing else."""
    code = getattr(function, "__code__", None)
    if code is None or not isinstance(function, types.FunctionType) or code.co_argcount < 1:
        return False
    ops = [(op.opname, op.argval) for op in dis.get_instructions(function)
           if op.opname not in ("RESUME", "NOP", "CACHE")]
    return (len(ops) == 2 and ops[0][0].startswith("LOAD_FAST") and ops[0][1] == code.co_varnames[0]
            and ops[1][0] == "RETURN_VALUE")


class SamplesInArena:
    """The same for a custom collate_fn that passes the samples' arrays through (returns the
    records, or a structure of them): fetch the samples inside the collate_fn's slot arena
    (NOTE [ One copy for a numpy collate_fn ] in worker.py), so that those arrays are born where
    the batch is laid out (NOTE [ Samples born in the slot ], "A custom collate_fn")."""

    def __init__(self, iterable: bool, slot_guess):
        """`slot_guess(sample 0, batch size)`: slot bytes for a first batch fetched in the arena
        before the ring knows its slot size, or 0 (too small to be worth it)."""
        self.iterable = iterable
        self.slot_guess = slot_guess
        self.on = False
        self.heap_to_release = False
        self.enabled = os.environ.get("SHMLOADER_SLOT_ARENA", "1") != "0"
        self.first_in_arena = False  # the next batch is the first fetched in the arena, unwatched
        # batches left to watch for arrays passed through (none when the arena is switched off)
        self.watching = LEARN_BATCHES if self.enabled else 0
        self._reset()

    def _reset(self) -> None:
        self.grant = None
        self.arena = None  # the slot arena the samples were fetched in (the collate_fn's too)
        self.fresh = None
        self.guessed = False  # `fresh` was sized by `slot_guess`, not by the ring

    def known_to_pass_through(self, collate_fn) -> None:
        """Fetch in the arena from the first batch when `collate_fn` returns its argument."""
        if self.enabled and returns_its_argument(collate_fn):
            self.on, self.first_in_arena, self.watching = True, True, 0

    def wanted(self, fetcher) -> bool:
        return self.on and torch_private.fetches_one_by_one(fetcher)

    def fetch(self, worker, index) -> list:
        """The samples of `index`, as torch's fetcher returns them, fetched in the slot arena of
        a grant in hand (polled before each sample until one is).  For the first batch, sample 0
        is fetched first and sizes the slot when the ring does not know its size yet."""
        self._reset()
        first, self.first_in_arena = self.first_in_arena, False
        size = len(index)
        last = size - 1 if self.iterable else size
        guess = None  # the first batch's slot size, once sample 0 is in (0: too small to bother)

        def around_sample(k: int, fetched: list):
            nonlocal guess
            if k >= last or guess == 0:
                return None  # (an iterable's last sample: see "Caches" in the NOTE)
            if self.grant is None:
                if first:
                    if k == 0:
                        return None
                    if guess is None:
                        guess = self.slot_guess(fetched[0], size)
                        if guess == 0:
                            return None
                self.grant = worker.grant_now()
                if self.grant is not None:
                    _, _, capacity, hint = self.grant
                    known = capacity or hint
                    try:
                        self.arena, self.fresh = worker.slot_arena(self.grant, 0 if known else guess or 0)
                    except NoRoomForSlot:  # handed back (NOTE [ No room for a worker's first slot ])
                        self.grant = None
                        return None
                    self.guessed = self.fresh is not None and not known
            return self.arena

        return torch_private.fetch_each(worker.fetcher, index, around_sample)

    def watch(self, samples) -> set[int] | None:
        """Before the collate_fn runs: the ids of the samples' large arrays, while still learning
        whether the collate_fn passes them through."""
        if self.on or not self.watching:
            return None
        return {id(leaf) for sample in samples for _, leaf in layout.iter_leaves(sample)
                if type(leaf) is np.ndarray and leaf.nbytes >= IN_PLACE_MIN_BYTES}

    def learn(self, plan, watched: set[int] | None, fetched_in_arena: int) -> None:
        """After the batch is laid out: turn on when at least half its bytes are the samples'
        own arrays, copied; off for good when less than half of the `fetched_in_arena` bytes
        handed out while fetching are found in place (the collate_fn makes new arrays now)."""
        if fetched_in_arena:
            self.on = 2 * plan.in_place_bytes >= fetched_in_arena
            return
        if watched is None:
            return
        passed = sum(leaf.nbytes for _, leaf in plan.leaves if id(leaf) in watched)
        self.watching -= 1
        if 2 * passed >= plan.total_bytes:
            self.on, self.watching, self.heap_to_release = True, 0, True

    def after_batch(self) -> None:
        """The batch is sent: once the worker fetches into slots, the heap memory its earlier
        batches' samples took goes back to the OS (heap.py)."""
        if self.heap_to_release:
            self.heap_to_release = False
            heap.release_free_memory()
