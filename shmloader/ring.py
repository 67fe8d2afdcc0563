"""The ring: the main process's set of shared-memory slots, and the policy that sizes it.

NOTE [ Slot lifecycle ]
  A slot is one shared-memory segment (NOTE [ Segments ] in segment.py: nameless, passed by fd,
  reserved up front).

  main: free ──grant───▶ worker k: claim (WRITING) ──publish──▶ READY ──main: acquire──▶ LEASED
          ▲                                                                              │
          └──────────────── the SlotLease dies (last view of the batch freed) ───────────┘

  The main process decides every transition but the worker's claim/publish; the header's state
  word (csrc/ring.h) mirrors it so that each side can check the other.  A slot is handed to a
  worker only when free, so a batch the user still holds is never overwritten.  A worker that
  needs more room than its slot has creates a larger segment itself (generation + 1), writes the
  batch there and passes the fd back with its result; the main process adopts it in place of the
  old one, and the workers that still map the old one are told to forget it.  A worker that dies
  leaves its slot as it was (WRITING, say): the loader is shut down then (NOTE [ Shutdown ] in
  pool.py) and the ring closed, so no slot is ever reused after a death and nothing resets it.

NOTE [ Held batches ]
  The training loop may keep as many batches as it likes (`list(loader)`, a reference cycle that
  only the garbage collector frees), as with torch.  When a worker needs a slot and none is free,
  the ring *detaches* the longest-held leased slot instead of waiting: the batch keeps its
  segment through its lease (mapped, fd closed, so a held batch costs no file descriptor), the
  slot's index starts a new generation with no segment, and the next worker to write into it
  creates a fresh one.  The held segment is unmapped when the batch's last view goes (workers
  are told to forget it, see scheduler.py), so the ring is back at its working size by itself:
  nothing waits, no garbage collection is forced, and the memory is what the user holds plus the
  batches in flight, as with torch.  Only a cap the user asks for (`max_slots`, `max_bytes`)
  stops it; then RingFullError says which.  A detached segment gives the pages past its batch's
  end back to /dev/shm (MADV_REMOVE), so a held batch costs its own size, page-rounded, not its
  slot's (a slot sized for the largest batch so far): batches of varying size (dynamic padding,
  one outlier) held in a list cost what torch's segments cost.  Not under pin_memory, whose pages
  are page-locked.  Whole leaves are still counted in slots, where torch counts each leaf's own
  segment: so small leaves are delivered as copies that hold no slot (NOTE [ Small leaves are
  copies ] in layout.py), and a kept label tensor costs its bytes.

NOTE [ A slot's pages follow its batch ]
  A slot is sized for the largest recent batch and its pages are reserved whole, so where batch
  sizes vary widely (a batch sampler that buckets samples by size: batches of 8 to 128 images)
  every slot in flight held the largest batch's pages, where torch's segments hold each batch's
  own: 1.3x torch's peak memory, and up to 1.9x.  So while the recent batches fill on average
  less than FITTED_BELOW of a slot (`_sizes_vary`), a grant lets its writer give back the pages
  past its batch once the batch is written (`Grant.trim`, `segment.trimmed_end`: at least
  TRIM_MIN_BYTES and a quarter of the slot, so equal batches and a grown slot's headroom never
  pay), and its Ready says where the slot's pages end now (`Ready.pages_end`), which the main
  process notes, for a stale result too.  The slot's next grant says so (`Grant.unreserved_from`),
  and its writer takes back (MADV_POPULATE_WRITE) the pages it will write before it writes
  there: as far as its batch's end where the batch is laid out before the slot is taken (torch's
  default collate), the whole slot where the collate_fn or the samples are made in it.  So a
  full /dev/shm is a ShmCapacityError for that batch, never a SIGBUS, and a ready or leased slot
  holds its batch's pages only.  The cost is the pages made again when a larger batch follows
  a smaller one (zero-filled by the worker, as torch's worker fills a new segment per batch).
  Never for a segment page-locked for CUDA (the driver holds its pages: a hole punched under
  them would part the GPU's copy from the file), nor outside /dev/shm, nor in the
  sample-parallel mode (many writers share one slot), nor on a kernel without
  MADV_POPULATE_WRITE (Linux < 5.14), nor with SHMLOADER_TRIM_SLOTS=0.

NOTE [ Held batches of varying size ]
  A slot is sized for the largest recent batch, so where batch sizes vary (dynamic padding) a
  segment remade for a detached slot at the slot's size reserves and zero-fills the part its
  batch leaves unused, then gives it back (MADV_REMOVE) at its own detach.  In a loop that
  keeps every batch, each batch paid for a whole slot where torch's worker makes a segment of
  the batch's size: 1.8x torch's time for 75 kept batches of 9-33 MiB padded by pad_sequence.
  So while the recent batches fill on average less than FITTED_BELOW of a slot, a detached
  slot's next segment is made by its writer at its batch's size (the grant's size hint is 0,
  and no spare is put there); the slot grows as any slot does if a later batch needs more.
  Batches of one size keep the slot's size and the spares made ahead, as does a `slot_bytes`
  the user gave.  A custom collate_fn's batch goes to a slot sized by its samples' bytes, as a
  worker's first batch does (NOTE [ One copy for a numpy collate_fn ] in worker.py), until a
  batch outgrows that guess (padding): that worker then collates such batches on the heap and
  copies them into a segment of their size, as torch copies a tensor batch into shared memory.

NOTE [ Batches held across a fork of the user's ]
  A slot is MAP_SHARED memory: a process the user forks (os.fork, a fork-started
  multiprocessing child given a batch) maps the slots of the batches the loop holds, and copy-on-
  write does not apply.  Once the loop dropped such a batch, the ring wrote a later batch into
  that slot: the child's batch changed under it, and what the child wrote into "its" batch showed
  in the parent's later batches.  torch's batches each have a segment of their own, never reused.
  So after any fork but a worker's own (os.register_at_fork), the slots leased at the next ring
  round are detached as held batches are (NOTE [ Held batches ]): their segments stay with the
  batches, the parent's mapping goes when its last view does, the child's when the child is
  done, and the ring makes new ones.  Cost: a new segment per batch held at each fork (a
  validation loader's workers fork too).

NOTE [ Ring size ]
  depth = num_workers × prefetch_factor (batches in flight, as torch counts them) + CONSUMER_SLOTS
  (batches the training loop holds: the one in use and the one being fetched).  Slots are created
  on first use, and a slot is bound to a batch only once the batch exists (NOTE [ Slot grants ] in
  scheduler.py), so a loop that keeps up creates far fewer than `depth`, and one that falls
  behind no more than the batches in flight and the one in its hand (NOTE [ Slots the loop gives
  back ] in scheduler.py, slots above WAIT_MIN_SLOT_BYTES).  Slot size is learnt from
  the first batch (page-rounded) unless `slot_bytes` is given; a larger batch grows only its slot.

NOTE [ A ring fitted to /dev/shm ]
  A ring of `depth` slots may not fit where torch's loader runs: torch keeps in /dev/shm only the
  batches that exist, often fewer than `depth` (a Docker container's 64 MiB, 20 MiB batches, one
  worker: torch runs with 3 of them, a ring of 4 slots does not fit).  So a ring that cannot fit
  whole is not refused: it is fitted to what /dev/shm has room for (`_shm_room`, bytes), never
  more segments alive than that, and a warning says so once, with how to get the whole ring.
  Fewer batches are then in flight; a grant waits for a slot the loop gives back.  Where the
  loop would wait for good (a /dev/shm without room for MIN_FITTED_SLOTS slots, the batch in
  the loop's hand and the next one being written; a loop that holds every batch it has room
  for), further slots are made outside /dev/shm (NOTE [ Overflow slots ]).  The room is counted low while segments are on their way (they may or may not be in what
  /dev/shm has used yet) and counted again at every adoption and every batch leased until sure.
  Before the first batch has taught the slot size, the room is not known: each worker makes its
  first slot at once, and one that finds no room hands its grant back (`no_room`, NOTE [ No room
  for a worker's first slot ] in worker.py); from then on no more segments are alive or on their
  way than at that moment (`_shm_slots`), and the same warning says so once no other first
  slot is on its way (those may find no room either).

NOTE [ Overflow slots ]
  A fitted ring can be full of batches the loop holds (`list(loader)`, the last few kept), or
  /dev/shm may have room for fewer than MIN_FITTED_SLOTS slots (64 MiB, batches of 40 MiB):
  nothing is left to write into, and /dev/shm has no room for more.  torch runs there with a
  numpy collate_fn (its batches are pickled onto the heap), so where the loop would wait for
  good (`make_room`), and only then, the ring makes a slot outside /dev/shm instead (`_add_overflow_slot`, a memfd: the kernel's internal
  tmpfs, which /dev/shm's size does not bound, charged to the process's memory as torch's heap
  batches are).  Once, a warning says so.  Such a slot is a slot like any other, but never
  counted as room in /dev/shm, and it stays in the ring (reused first, as created slots are)
  until the ring closes.  Not under a cap the user set (then RingFullError, as before).
  A worker whose batch needs its slot to grow, or to move away from arrays the dataset keeps,
  makes the new segment outside /dev/shm the same way where /dev/shm has no room for it
  (`segment.create_segment_or_overflow`); the ring tells it apart when it adopts it
  (`segment.outside_shm`).  Neither kind is made where it would leave less than
  OVERFLOW_MEMORY_MARGIN of the memory available (MemAvailable, a cgroup's limit): a
  ShmCapacityError then, not the OOM killer.

NOTE [ Slot size follows the batches ]
  The size a new slot gets (`slot_bytes`: a slot made for the first time, one made again after
  its batch was detached, a spare) rises at once with a larger batch, and comes down when a whole
  window of batches (RECENT_PER_SLOT × depth, at least RECENT_MIN) has needed less than
  1/SHRINK_ABOVE of it: then it becomes what those batches needed, with a grown slot's headroom,
  and the free slots above SHRINK_ABOVE × that size are dropped (made again at the new size by
  their next writer).  So one outlier batch (a 200 MiB batch among 20 MiB ones) does not size
  every slot made after it; batches whose sizes vary within 2× (dynamic padding) never shrink it,
  so their slots are not made again and again.  Never below a `slot_bytes` the user gave.
"""

from __future__ import annotations

import gc
import os
import sys
import warnings
import weakref
from collections import deque
from dataclasses import dataclass

from . import _ring
from . import segment as shm_segment
from .errors import RingFullError, ShmCapacityError, ShmCapacityWarning, SlotProtocolError
from .errors import _fmt_bytes as fmt_bytes
from .interrupts import ctrl_c_held
from .ownership import forking_a_worker, register_parent_only
from .segment import MIN_HEADROOM, create_segment, page_round
from .spares import SpareMaker

CONSUMER_SLOTS = 2
# NOTE [ Slot size follows the batches ]: the window (batches) and the ratio that shrink it.
RECENT_PER_SLOT = 1
RECENT_MIN = 4
SHRINK_ABOVE = 2
SPARES_MADE_WAIT_SECONDS = 2.0  # _check_fits: at most this for spares being made
MIN_FITTED_SLOTS = 2  # NOTE [ A ring fitted to /dev/shm ]: the least room a ring runs in without overflow
FITTED_BELOW = 0.8  # NOTE [ Held batches of varying size ]: the mean fill of a slot that sizes its batches


def trim_slots_on() -> bool:
    """SHMLOADER_TRIM_SLOTS=0 keeps slots whole (NOTE [ A slot's pages follow its batch ]); read
    when a ring is made, i.e. at each iter() that starts workers, as SHMLOADER_TIMING is."""
    return os.environ.get("SHMLOADER_TRIM_SLOTS", "1") != "0"


_populate_works: bool | None = None  # MADV_POPULATE_WRITE, found out once (Linux >= 5.14)

# The main process's view of a slot (the header's state word has WRITING/READY in between).
_FREE, _DISPATCHED, _LEASED = "free", "granted", "leased"


def _keep_only_the_batch(segment: _ring.Segment, payload_end: int) -> int:
    """Give back the pages of a leased segment past its batch's end (as checked when it was
    leased, not as its header says now: NOTE [ Held batches ]); returns the bytes it keeps.
    Not for a segment page-locked for CUDA."""
    kept = page_round(payload_end)
    if kept >= segment.size or segment.before_unmap is not None:
        return segment.size
    segment.discard_from(kept)
    return kept


def _populate_supported(segment: _ring.Segment) -> bool:
    """Whether this kernel has MADV_POPULATE_WRITE (asked once, with an empty range)."""
    global _populate_works
    if _populate_works is None:
        try:
            segment.populate(segment.size, 0)
            _populate_works = True
        except OSError:
            _populate_works = False
    return _populate_works


def _user_stacklevel() -> int:
    """warnings.warn's stacklevel, from the function that calls this one, of the first frame
    outside shmloader and torch's data loading: the user's `for batch in loader` line."""
    frame, level = sys._getframe(1), 1
    inside = (os.path.dirname(os.path.abspath(__file__)), os.path.join("torch", "utils", "data"))
    while frame.f_back is not None and any(part in frame.f_code.co_filename for part in inside):
        frame, level = frame.f_back, level + 1
    return level


@dataclass(frozen=True)
class RingStats:
    slots: int  # the ring's working depth (NOTE [ Ring size ])
    allocated_slots: int  # of which have a segment
    slot_bytes: int
    ring_bytes: int  # bytes of the ring's own segments (spares made ahead of need included)
    held_segments: int  # detached segments still alive: batches held past the ring
    held_bytes: int
    in_use_bytes: int  # bytes of segments that hold a batch now (granted, leased or detached)
    detached: int  # slots handed over to held batches so far (NOTE [ Held batches ])
    slot_grows: int
    made_ahead: int  # segments made by the spare thread and installed (NOTE [ Spare segments ])
    slot_shrinks: int = 0  # free slots dropped as the slot size shrank (NOTE [ Slot size follows ... ])
    overflow_slots: int = 0  # slots made outside /dev/shm so far (NOTE [ Overflow slots ])
    pages_given_back: int = 0  # batches past whose end their slot gave its pages back (NOTE [ A slot's pages ... ])

    @property
    def reserved_bytes(self) -> int:
        """Shared memory reserved now: the ring's segments and the held ones."""
        return self.ring_bytes + self.held_bytes


_RINGS: weakref.WeakSet = weakref.WeakSet()  # every open ring (NOTE [ Batches held across a fork ... ])


def _after_fork_in_parent() -> None:
    if not forking_a_worker():
        for ring in list(_RINGS):
            ring._forked = True  # one store: the ring's own thread acts on it (collect_released)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_parent=_after_fork_in_parent)


class Ring:
    """Slots owned by the main process (see NOTE [ Slot lifecycle ] and NOTE [ Held batches ]).

    `max_slots` / `max_bytes`: a cap on the segments alive at once (the ring's and the held
    ones), only where the user asks for one; None lets held batches take what they need."""

    def __init__(self, depth: int, slot_bytes: int | None = None, max_slots: int | None = None,
                 max_bytes: int | None = None):
        if depth < 1:
            raise ValueError(f"ring depth must be >= 1, got {depth}")
        if max_slots is not None:
            depth = min(depth, max_slots)
        self.max_slots = max_slots
        self.max_bytes = max_bytes
        self.slot_bytes = page_round(slot_bytes) if slot_bytes else None
        self._given_bytes = self.slot_bytes or 0  # the user's slot_bytes: never shrunk below
        # payload ends of the latest batches (NOTE [ Slot size follows the batches ])
        self._recent_ends: deque[int] = deque(maxlen=max(RECENT_MIN, RECENT_PER_SLOT * depth))
        self._segments: list[_ring.Segment | None] = [None] * depth
        self._generations = [0] * depth
        self._states = [_FREE] * depth
        self._leased_ends = [0] * depth  # a leased slot's payload end, as lease() checked it
        self._free: deque[int] = deque(range(depth))
        self._leased: dict[int, None] = {}  # leased slots, longest-held first
        # Appended by SlotLease deallocation, from whichever thread dropped the last view.
        self._released: deque[tuple[int, int]] = deque()
        # detached segments still alive -> the bytes they keep (NOTE [ Held batches ])
        self._held_segments: weakref.WeakKeyDictionary[_ring.Segment, int] = weakref.WeakKeyDictionary()
        self._retired: list[tuple[int, int]] = []  # (slot, generation) no process should map now
        self._detached = 0
        self._fitted: set[int] = set()  # slots remade at their batch's size (NOTE [ Held batches of varying size ])
        # NOTE [ A slot's pages follow its batch ]: where a slot's pages end now (absent: its whole
        # segment, as its writer's Ready said), and whether trims may be granted
        self._pages_end: dict[int, int] = {}
        self.trims_allowed = False  # the default mode's iterator allows them (one writer per slot)
        self._trim_slots = trim_slots_on()
        self._trimmed = 0
        self._leases = 0  # batches leased so far
        self._detached_at = None  # self._leases at the latest detach, None before any
        self._slot_grows = 0
        self._shrunk = 0
        self._made_ahead = 0
        self._fits = False  # the whole ring at slot_bytes was found to fit (_check_fits)
        self._shm_room: int | None = None  # NOTE [ A ring fitted to /dev/shm ]
        self._shm_slots: int | None = None  # the same, in segments, learnt from a worker's no_room
        self._no_room: tuple[int, int] = (0, 0)  # (needed, free) of the last no_room
        self._overflow: weakref.WeakSet[_ring.Segment] = weakref.WeakSet()  # NOTE [ Overflow slots ]
        self._overflow_made = 0
        self._fitted_warned = False
        self._spares = SpareMaker(lambda capacity: create_segment(capacity, 0, "a spare ring slot", populate=False))
        self._spares_on = os.environ.get("SHMLOADER_SPARE_SLOTS", "1") != "0"  # NOTE [ Spare segments ]
        self._forked = False  # a fork of the user's since the last ring round
        self._owner_pid = os.getpid()  # NOTE [ A process forked by the user ] in loader.py
        self._closed = False  # last: the __del__ of a half-made ring has nothing to close
        _RINGS.add(self)
        register_parent_only(self)
        if self.slot_bytes is not None:
            self._check_fits()

    # -- sizing --------------------------------------------------------------------------

    def _check_fits(self) -> None:
        """Fit the ring to /dev/shm if the whole ring at `slot_bytes` cannot fit there (NOTE [ A
        ring fitted to /dev/shm ]), with a warning.

        Slots are created (and their pages reserved) when first used, by whichever process first
        needs them, so the first batch does not wait for the whole ring to be zeroed; this check
        fits the ring at the start, not after some slots found no room.

        A slot granted to a worker to create, or a spare being made, is counted as missing, yet
        its segment may exist already and be counted in what /dev/shm has used: a ring that fits
        was refused (a 72 MiB ring in an 82 MiB /dev/shm, where torch runs).  So the answer is
        sure only once nothing is on its way: till then the room is counted low, the check waits
        for the spares being made (this process's own, made in a millisecond or so), and it runs
        again at every adoption and every batch leased.  One unsure check followed by none left
        a ring running on whose fate depended on which thread won (a CI failure)."""
        if self.slot_bytes is None or self._fits:
            return
        if self._fits_unsure() and self._spares.wait_made(SPARES_MADE_WAIT_SECONDS):
            self._fits_unsure()  # the spares made since are counted as made now

    def _fits_unsure(self) -> bool:
        """One check of _check_fits: sets `_fits` where the whole ring surely fits, else fits the
        ring to the room there is (raising where that is too little), and says whether the
        answer depends on segments on their way."""
        slot_bytes = self.slot_bytes
        allocated = self.segments()
        missing = self.depth - len(allocated)
        needed = missing * slot_bytes
        free = shm_segment.shm_free_bytes()
        on_their_way = self._spares.making() + self._dispatched_uncreated()
        ready = self._spares.ready_bytes()  # made, in what /dev/shm has used: each fills a slot
        self._fits = needed <= free + ready
        if self._fits:
            self._shm_room = None
            return False
        unsure = on_their_way > 0
        # what our segments hold now, and what is free: low by the segments on their way that
        # /dev/shm has counted already
        room = self._shm_bytes() + ready + free
        self._shm_room = room  # under MIN_FITTED_SLOTS slots: the rest overflow (make_room)
        if not unsure:
            in_shm = sum(1 for segment in allocated if segment not in self._overflow)
            fitted = min(self.depth - 1, in_shm + (ready + free) // slot_bytes)
            self._warn_fitted(fitted, slot_bytes, free)
        return unsure

    def _warn_fitted(self, fitted: int, slot_bytes: int, free: int) -> None:
        """The ring's one ShmCapacityWarning: room for `fitted` slots of `slot_bytes`."""
        if self._fitted_warned:
            return
        self._fitted_warned = True
        held = self.held() + len(self._held_segments)
        warnings.warn(
            f"shmloader: {shm_segment.SHM_DIR} has room for {fitted} of the ring's {self.depth} "
            f"slots of {fmt_bytes(slot_bytes)} ({fmt_bytes(free)} free besides its own"
            f"{f' and the {held} batches the training loop holds' if held > 1 else ''}; the whole "
            f"ring needs {fmt_bytes(self.depth * slot_bytes)}): at most "
            f"{fitted} batches are kept in shared memory at once, so fewer are prefetched than "
            "num_workers x prefetch_factor and loading may be slower. For the whole ring give "
            "the container more shared memory (e.g. `docker run --shm-size=8g`), or lower "
            "prefetch_factor, num_workers or batch_size.",
            ShmCapacityWarning, stacklevel=_user_stacklevel())

    def no_room(self, slot: int, generation: int, needed: int, free: int) -> None:
        """A worker found no room in /dev/shm (`free` bytes) for the first segment (`needed`
        bytes) of `slot`, granted to it without one, and handed the slot back: it is free again,
        and no more segments are made than are alive or on their way now (NOTE [ A ring fitted to
        /dev/shm ])."""
        if (self._states[slot] != _DISPATCHED or self._segments[slot] is not None
                or generation != self._generations[slot]):
            raise SlotProtocolError(
                f"a worker handed back slot {slot} generation {generation}, which is "
                f"{self._states[slot]} at generation {self._generations[slot]}"
                f"{' with a segment' if self._segments[slot] is not None else ''}")
        self._states[slot] = _FREE
        self._free.append(slot)
        count, _ = self._live_in_shm()
        room = count + self._dispatched_uncreated()
        self._shm_slots = room if self._shm_slots is None else min(self._shm_slots, room)
        self._no_room = (needed, free)
        self._warn_no_room_once_sure()

    def _warn_no_room_once_sure(self) -> None:
        """no_room's warning, once no other worker's first slot is on its way (it may find no
        room either: the warning said room for 3 slots of 40 MiB in 32 MiB)."""
        if self._shm_slots is None or self._fitted_warned or self._dispatched_uncreated():
            return
        needed, free = self._no_room
        held = sum(1 for segment in self._held_segments if segment not in self._overflow)
        fitted = max(0, min(self.depth - 1, self._shm_slots - held))
        self._warn_fitted(fitted, self.slot_bytes or needed, free)

    def working_depth(self) -> int:
        """The slots the ring may hold at once: its depth, or fewer where fitted to /dev/shm."""
        depth = self.depth
        if self._shm_room is not None and self.slot_bytes:
            depth = min(depth, max(MIN_FITTED_SLOTS, self._shm_room // self.slot_bytes))
        if self._shm_slots is not None:
            depth = min(depth, self._shm_slots)
        return depth

    def _shm_bytes(self) -> int:
        """What the ring's own slots and the held ones take of /dev/shm (not overflow slots)."""
        overflow = self._overflow
        return (sum(s.size for s in self.segments() if s not in overflow)
                + sum(kept for s, kept in self._held_segments.items() if s not in overflow))

    def _add_overflow_slot(self) -> bool:
        """Put a segment made outside /dev/shm in a free slot without one (detaching the
        longest-held batch's if none is free): NOTE [ Overflow slots ]."""
        size = self.slot_bytes or self._no_room[0]  # before any batch: what the worker needed
        if not size or self._closed:
            return False
        empty = [slot for slot in self._free if self._segments[slot] is None]
        if not empty:
            if self._free or not self._leased:
                return False
            self._detach(next(iter(self._leased)))
            empty = [self._free[-1]]
        slot = empty[0]
        segment = shm_segment.create_overflow_segment(size, self._generations[slot],
                                                      f"slot {slot} of the ring")
        self._segments[slot] = segment
        self._new_segment_in(slot)
        held = self.held() + len(self._held_segments)
        self._note_overflow(segment, f"has no room for another ring slot (the training loop holds "
                                     f"{held} batch{'es' if held != 1 else ''})",
                            "Keep fewer batches (or a .clone() of what you keep), or give")
        return True

    def _note_overflow(self, segment: _ring.Segment, why: str, advice: str) -> None:
        """Count a segment made outside /dev/shm, and warn the first time (NOTE [ Overflow slots ])."""
        self._overflow.add(segment)
        self._overflow_made += 1
        if self._overflow_made == 1:
            warnings.warn(
                f"shmloader: {shm_segment.SHM_DIR} {why}: ring slots of {fmt_bytes(segment.size)} "
                f"are made outside {shm_segment.SHM_DIR}, in the process's memory (as torch's "
                f"pickled batches are). {advice} the container more shared memory (e.g. "
                "`docker run --shm-size=8g`).",
                ShmCapacityWarning, stacklevel=_user_stacklevel())

    def _dispatched_uncreated(self) -> int:
        """Slots granted to a worker that creates their segment (it may exist already)."""
        return sum(1 for slot, segment in enumerate(self._segments)
                   if segment is None and self._states[slot] == _DISPATCHED)

    @property
    def depth(self) -> int:
        return len(self._segments)

    def _live(self) -> tuple[int, int]:
        """(segments, bytes) alive now: the ring's created slots, the held ones and the spares
        ready or being made."""
        ring = self.segments()
        held = list(self._held_segments.values())
        spares = self._spares.pending()
        return (len(ring) + len(held) + spares,
                sum(s.size for s in ring) + sum(held) + spares * (self.slot_bytes or 0))

    def _live_or_on_their_way(self) -> tuple[int, int]:
        """_live() and the segments workers were granted slots to make (they may exist already):
        what a user's cap counts, else a slot detached while first slots are being made is one
        segment too many (4 alive under max_ring_slots=3)."""
        count, nbytes = self._live()
        uncreated = self._dispatched_uncreated()
        return count + uncreated, nbytes + uncreated * (self.slot_bytes or 0)

    def _live_in_shm(self) -> tuple[int, int]:
        """_live() without the overflow slots (NOTE [ Overflow slots ])."""
        count, nbytes = self._live()
        overflow = list(self._overflow)
        return count - len(overflow), nbytes - sum(s.size for s in overflow)

    def _may_add_segment(self) -> bool:
        """Whether one more segment stays within the user's cap and the room /dev/shm has
        (always, without either)."""
        if self._closed:
            return False
        if self.max_slots is None and self.max_bytes is None and self._shm_room is None and self._shm_slots is None:
            return True
        return self._within_users_cap() and self._shm_room_left() > 0

    def _within_users_cap(self) -> bool:
        if self.max_slots is None and self.max_bytes is None:
            return True
        count, nbytes = self._live_or_on_their_way()
        if self.max_slots is not None and count >= self.max_slots:
            return False
        return self.max_bytes is None or nbytes + (self.slot_bytes or 0) <= self.max_bytes

    def _shm_room_left(self) -> int:
        """How many more slots the room in /dev/shm takes (NOTE [ A ring fitted to /dev/shm ]):
        past the segments alive and those granted to be made by workers."""
        left = self.depth
        if self._shm_room is None and self._shm_slots is None:
            return left
        count, nbytes = self._live_in_shm()
        uncreated = self._dispatched_uncreated()
        if self._shm_room is not None and self.slot_bytes:
            left = max(0, (self._shm_room - nbytes) // self.slot_bytes - uncreated)
        if self._shm_slots is not None:
            left = min(left, max(0, self._shm_slots - count - uncreated))
        return left

    # -- the main process's side of the lifecycle ------------------------------------------

    def can_take(self) -> bool:
        """Whether take_free_slot would succeed now."""
        self.collect_released()
        if self.has_free_created_slot():
            return True
        return bool(self._free or self._leased) and (self._spares.pending() > 0 or self._may_add_segment())

    def has_free_created_slot(self) -> bool:
        self.collect_released()
        return any(self._segments[slot] is not None for slot in self._free)

    def take_free_slot(self, prefer: dict[int, int] | None = None, created_only: bool = False,
                       fitted_only: bool = False) -> int:
        """A free slot to grant: detaching the longest-held leased one if none is free
        (NOTE [ Held batches ]).

        Prefers a slot the receiving worker has mapped already (`prefer`: slot -> generation it
        knows), then any created one (mapping a segment costs far less than creating one), then
        one to be created, with a spare segment installed in it if one is ready
        (NOTE [ Spare segments ] in spares.py); `created_only` never picks a slot without one,
        `fitted_only` only one its writer makes at its batch's size (can_grant_fitted)."""
        self.collect_released()
        prefer = prefer or {}
        created = [s for s in reversed(self._free) if self._segments[s] is not None]  # last freed first: cache-warm
        if fitted_only:
            created = []
        known = [s for s in created if prefer.get(s) == self._generations[s]]
        order = known + created
        may_add = self._may_add_segment()
        if not order and not created_only and (self._spares.ready_count() > 0 or may_add):
            if not self._free and self._leased:
                self._detach(next(iter(self._leased)))
            order = sorted(self._free, key=lambda s: s not in self._fitted)  # those needing no spare first
            if not may_add:  # only the ready spare has room: a slot its writer makes would be one
                # segment past the cap (a fitted slot gets no spare: max_ring_slots=7 held 20)
                order = [s for s in order if s not in self._fitted and self._segments[s] is None]
        if not order:
            if self._within_users_cap():  # /dev/shm's room is what is missing, not a cap
                raise ShmCapacityError((self.slot_bytes or 0), shm_segment.shm_free_bytes(), shm_segment.SHM_DIR,
                                       f"one more ring slot, while the training loop holds "
                                       f"{self.held() + len(self._held_segments)} batches")
            raise RingFullError(self._full_message())
        chosen = order[0]
        if self._segments[chosen] is None and self.slot_bytes and chosen not in self._fitted:
            spare = self._spares.take(self.slot_bytes)
            if spare is not None:
                spare.init_header(self._generations[chosen])
                self._segments[chosen] = spare
                self._new_segment_in(chosen)
                self._made_ahead += 1
        self._free.remove(chosen)
        self._states[chosen] = _DISPATCHED
        return chosen

    def should_wait_for_spare(self) -> bool:
        """Whether a grant that would hand a worker a slot to create should rather wait for a
        spare segment made off its path (NOTE [ Spare segments ] in spares.py)."""
        if not self._spares_on or not self._spares.usable or not self.slot_bytes:
            return False
        if self.has_free_created_slot() or self._spares.ready_count():
            return False  # a slot to grant now (take_free_slot installs a ready spare)
        if any(slot in self._fitted for slot in self._free) or (not self._free and self._sizes_vary()):
            return False  # its writer makes it at its batch's size (NOTE [ Held batches of varying size ])
        # one on its way counts already against a user's cap
        return bool(self._free or self._leased) and (self._spares.pending() > 0 or self._may_add_segment())

    def want_spares(self, count: int) -> None:
        """Keep `count` spare segments on their way (the grants waiting for one), as far as the
        user's cap allows: spares count against it from the moment they are asked for."""
        if not self._spares_on or not self.slot_bytes or self._closed:
            return
        if (self.max_slots is not None or self.max_bytes is not None or self._shm_room is not None
                or self._shm_slots is not None):
            live, nbytes = self._live_or_on_their_way()
            room = min(count, self._shm_room_left())
            if self.max_slots is not None:
                room = min(room, self.max_slots - live)
            if self.max_bytes is not None:
                room = min(room, (self.max_bytes - nbytes) // self.slot_bytes)
            count = min(count, self._spares.pending() + max(0, room))
        self._spares.want(count, self.slot_bytes)

    @property
    def spare_wakeup_fd(self) -> int:
        return self._spares.wakeup_fd

    def drain_spare_wakeups(self) -> None:
        self._spares.drain_wakeups()

    def grant_terms(self, slot: int) -> tuple[int, bool]:
        """For a grant of `slot` (after any page-locking): where its writer must take its pages back
        from (0: none given back), and whether it may give back those past its batch (NOTE [ A
        slot's pages follow its batch ])."""
        segment = self._segments[slot]
        if segment is None:
            return 0, False
        trim = (self.trims_allowed and self._trim_slots and segment.before_unmap is None
                and segment not in self._overflow and self._sizes_vary() and _populate_supported(segment))
        return self._pages_end.get(slot, 0), trim

    def note_pages(self, slot: int, pages_end: int) -> None:
        """Its writer's Ready: the slot's segment has its pages up to `pages_end` only (0: all)."""
        segment = self._segments[slot]
        if segment is not None and 0 < pages_end < segment.size:
            self._pages_end[slot] = pages_end
            self._trimmed += 1
        else:
            self._pages_end.pop(slot, None)

    def _new_segment_in(self, slot: int) -> None:
        """The slot's segment changed: what was noted of the old one's pages goes."""
        self._pages_end.pop(slot, None)

    def _detach(self, slot: int) -> None:
        """Leave a leased slot's segment to its batch alone; the slot starts a new generation."""
        segment = self._segments[slot]
        assert segment is not None and self._states[slot] == _LEASED
        kept = _keep_only_the_batch(segment, self._leased_ends[slot])
        segment.close_fd()  # the lease keeps the mapping: a held batch costs no fd
        self._held_segments[segment] = kept
        self._retired.append((slot, self._generations[slot]))
        del self._leased[slot]
        self._segments[slot] = None
        self._new_segment_in(slot)
        self._generations[slot] += 1  # its lease's release is then ignored (collect_released)
        self._states[slot] = _FREE
        self._free.append(slot)
        self._detached += 1
        self._detached_at = self._leases
        if self._sizes_vary():
            self._fitted.add(slot)

    def can_grant_fitted(self) -> bool:
        """Whether a slot can be granted that its writer makes at its batch's size (NOTE [ Held
        batches of varying size ]): a free one, or the longest-held batch's, detached now.  Such a
        grant costs no memory before the batch exists, so a worker may hold one to go on with."""
        self.collect_released()
        if not self._may_add_segment():
            return False
        if any(slot in self._fitted for slot in self._free):
            return True
        return not self._free and bool(self._leased) and self.keeps_batches() and self._sizes_vary()

    def keeps_batches(self) -> bool:
        """Whether the training loop keeps batches (a slot was detached within the last ring's
        depth of batches): then a slot it holds is not given back at its next call
        (NOTE [ Slots the loop gives back ] in scheduler.py)."""
        return self._detached_at is not None and self._leases - self._detached_at <= self.depth

    def _sizes_vary(self) -> bool:
        """Whether the recent batches fill on average less than FITTED_BELOW of a slot, whose
        size the user did not give (NOTE [ Held batches of varying size ])."""
        recent = self._recent_ends
        return (bool(recent) and bool(self.slot_bytes) and not self._given_bytes
                and sum(recent) < FITTED_BELOW * self.slot_bytes * len(recent))

    def take_retired(self) -> list[tuple[int, int]]:
        """(slot, generation) pairs that workers still mapping them must forget, once each."""
        retired, self._retired = self._retired, []
        return retired

    def _full_message(self) -> str:
        count, nbytes = self._live()
        caps = ", ".join(f"{name}={value}" for name, value in
                         (("max_ring_slots", self.max_slots), ("max_ring_bytes", self.max_bytes))
                         if value is not None)
        return (f"the training loop holds {self.held() + len(self._held_segments)} batches, and the "
                f"{count} shared-memory segments alive ({nbytes} bytes) reach the cap you set "
                f"({caps}); release batches you no longer need (del them, or copy what you keep "
                "with .clone()), raise the cap, or leave it unset to let held batches take what "
                "they need")

    def make_room(self, spill=None) -> None:
        """The loop would wait forever for a slot (under a user's cap, or in a ring fitted to
        /dev/shm): collect garbage once (reference cycles may hold dead batches), then move
        batches that wait for their turn out of their slots while `spill()` can (NOTE [ Batches
        that wait for their turn ] in scheduler.py), then, where /dev/shm is what is missing, make
        a slot outside it (NOTE [ Overflow slots ]); under a user's cap raise RingFullError."""
        if self.can_take():
            return
        gc.collect()
        if self.can_take():
            return
        while spill is not None and spill():
            if self.can_take():
                return
        if self._within_users_cap() and (self._shm_room is not None or self._shm_slots is not None) \
                and self._add_overflow_slot():  # NOTE [ Overflow slots ]
            return
        if self._within_users_cap():  # the room in /dev/shm is what is missing
            count, nbytes = self._live()
            raise ShmCapacityError(
                nbytes + (self.slot_bytes or 0), self._shm_room or 0, shm_segment.SHM_DIR,
                f"one more ring slot of {self.slot_bytes} bytes, while the training loop holds "
                f"{self.held() + len(self._held_segments)} batches (each keeps its batch's whole "
                "slot: drop those you no longer need, or keep a .clone() of what you keep),")
        raise RingFullError(self._full_message())

    def unassign(self, slot: int) -> None:
        """A dispatched slot came back unused (end of an iterable stream, an error, a reset)."""
        segment = self._segments[slot]
        if segment is not None:
            segment.release()
        self._states[slot] = _FREE
        self._free.append(slot)
        self._retire_if_oversized(slot)

    def task_geometry(self, slot: int) -> tuple[int, int, int]:
        """(generation, capacity, size hint) of a slot as a worker must see it; capacity 0: not
        created yet, and the worker creates it at max(hint, what its batch needs)."""
        segment = self._segments[slot]
        if segment is None:  # its writer makes it: at its batch's size where fitted
            return self._generations[slot], 0, 0 if slot in self._fitted else self.slot_bytes or 0
        return self._generations[slot], segment.size, self.slot_bytes or 0

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
        self._fitted.discard(slot)
        old = self._segments[slot]
        self._segments[slot] = segment
        self._new_segment_in(slot)
        if shm_segment.outside_shm(fd):  # a worker's, where /dev/shm had no room for it
            self._note_overflow(segment, f"has no room for a slot of {fmt_bytes(capacity)} "
                                f"({fmt_bytes(shm_segment.shm_free_bytes())} free)",
                                "For batches this large, lower batch_size or give")
        if old is not None:
            self._slot_grows += 1
            self._retired.append((slot, self._generations[slot]))
            old.close_fd()
        self._generations[slot] = generation
        if self.slot_bytes is None:
            self.slot_bytes = capacity
        elif capacity > self.slot_bytes:
            self.slot_bytes = capacity
        self._check_fits()  # once it fits, a no-op
        self._warn_no_room_once_sure()

    def lease(self, slot: int, sequence: int, on_release) -> tuple[_ring.SlotLease, bytes, int]:
        """Validate a slot a worker reported ready for batch `sequence`; returns its lease, the
        descriptor bytes and the payload end."""
        self._check_fits()  # until the ring is known to fit (a no-op after)
        segment = self._segments[slot]
        if segment is None or self._states[slot] != _DISPATCHED:
            raise SlotProtocolError(f"slot {slot} reported ready but it is {self._states[slot]}")
        (magic, version, state, capacity, generation, _writer, seq, desc_bytes, payload_end,
         desc_offset) = segment.header()
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
        if desc_offset < _ring.HEADER_BYTES or desc_offset + desc_bytes > payload_end or payload_end > capacity:
            raise SlotProtocolError(
                f"slot {slot} descriptor of {desc_bytes} bytes at {desc_offset} / payload end "
                f"{payload_end} lie outside its {capacity} bytes"
            )
        found = segment.acquire()
        if found != _ring.READY:
            raise SlotProtocolError(f"slot {slot} is in state {found}, not READY")
        self._states[slot] = _LEASED
        self._leased[slot] = None
        self._leased_ends[slot] = payload_end
        self._leases += 1
        self._follow(payload_end)
        descriptor = segment.read(desc_offset, desc_bytes)
        return _ring.SlotLease(segment, slot, generation, sequence, on_release), descriptor, payload_end

    def copy_out(self, slot: int, generation: int, sequence: int) -> tuple[bytearray, bytes, int] | None:
        """(a private copy of the leased `slot`'s payload, its descriptor, its payload end) if it
        still holds batch `sequence` at `generation`, else None (NOTE [ Batches that wait for
        their turn ] in scheduler.py)."""
        segment = self._segments[slot]
        if segment is None or self._states[slot] != _LEASED or self._generations[slot] != generation:
            return None
        (_magic, _version, _state, _capacity, _generation, _writer, seq, desc_bytes, payload_end,
         desc_offset) = segment.header()
        if seq != sequence or payload_end != self._leased_ends[slot]:
            return None
        with memoryview(segment) as view:
            private = bytearray(view[:payload_end])
        return private, segment.read(desc_offset, desc_bytes), payload_end

    def _follow(self, payload_end: int) -> None:
        """Shrink the size of new slots, and drop free slots far above it, once a whole window of
        batches has needed much less (NOTE [ Slot size follows the batches ])."""
        recent = self._recent_ends
        recent.append(payload_end)
        if not self.slot_bytes or self.slot_bytes <= SHRINK_ABOVE * payload_end or len(recent) < recent.maxlen:
            return  # (the first test settles it for batches of one size, at no cost)
        needed = max(recent)
        wanted = max(page_round(needed + max(needed // 8, MIN_HEADROOM)), self._given_bytes)
        if self.slot_bytes <= SHRINK_ABOVE * wanted:
            return
        self.slot_bytes = wanted
        recent.clear()  # a whole new window before the next shrink
        for slot in list(self._free):
            self._retire_if_oversized(slot)

    def _retire_if_oversized(self, slot: int) -> None:
        """Drop a free slot's segment if it is far above the size of new slots (it was made
        before that size came down); workers are told to forget it, and the slot's next writer
        makes one at the ring's size."""
        segment = self._segments[slot]
        if segment is None or not self.slot_bytes or segment.size <= SHRINK_ABOVE * self.slot_bytes:
            return
        assert self._states[slot] == _FREE
        segment.close_fd()
        self._retired.append((slot, self._generations[slot]))
        self._segments[slot] = None
        self._new_segment_in(slot)
        self._generations[slot] += 1
        self._shrunk += 1

    def release_callback(self):
        """What a SlotLease calls when it dies: a thread-safe append, nothing else."""
        return self._released.append

    def collect_released(self) -> int:
        if self._forked and not self._closed:  # before any release: those batches may live on in the child
            self._forked = False
            for slot in list(self._leased):
                self._detach(slot)  # NOTE [ Batches held across a fork of the user's ]
        n = 0
        while self._released:
            slot, generation = self._released.popleft()
            if self._closed or generation != self._generations[slot] or self._states[slot] != _LEASED:
                continue  # a detached slot's old batch, or the ring is gone
            segment = self._segments[slot]
            if segment is not None:
                segment.release()
            self._states[slot] = _FREE
            self._leased.pop(slot, None)
            self._free.append(slot)
            self._retire_if_oversized(slot)
            n += 1
        return n

    def has_free_slot(self) -> bool:
        return bool(self._free)

    def held(self) -> int:
        return len(self._leased)

    def segment(self, slot: int) -> _ring.Segment:
        segment = self._segments[slot]
        if segment is None:
            raise SlotProtocolError(f"slot {slot} has no segment")
        return segment

    def segments(self) -> list[_ring.Segment]:
        return [s for s in self._segments if s is not None]

    def stats(self) -> RingStats:
        self.collect_released()
        allocated = self.segments()
        held = list(self._held_segments.values())
        held_bytes = sum(held)
        busy = sum(s.size for slot, s in enumerate(self._segments) if s is not None and self._states[slot] != _FREE)
        return RingStats(
            slots=self.working_depth(),
            allocated_slots=len(allocated),
            slot_bytes=self.slot_bytes or 0,
            ring_bytes=sum(s.size for s in allocated) + self._spares.reserved_bytes(),
            held_segments=len(held),
            held_bytes=held_bytes,
            in_use_bytes=busy + held_bytes,
            detached=self._detached,
            slot_grows=self._slot_grows,
            made_ahead=self._made_ahead,
            slot_shrinks=self._shrunk,
            overflow_slots=self._overflow_made,
            pages_given_back=self._trimmed,
        )

    # -- teardown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close every fd and drop the ring's references; a slot's memory is unmapped when the
        last view of its batch is gone (at once for slots the user does not hold)."""
        with ctrl_c_held():  # NOTE [ Ctrl-C held ] in interrupts.py
            if self._closed:
                return
            self._closed = True
            _RINGS.discard(self)
            if os.getpid() != self._owner_pid:  # a copy in a process the user forked: its fds only
                self._spares.close_in_child()  # (no lock: the parent's thread may have held it)
                self.close_in_child()
                return
            self._spares.close()
            for slot, segment in enumerate(self._segments):
                if segment is not None:
                    if self._states[slot] == _LEASED:  # held past the ring's end, never reused now
                        # counted as held from now on (stats() after the epoch: what is held now)
                        self._held_segments[segment] = _keep_only_the_batch(segment, self._leased_ends[slot])
                    segment.close_fd()
            self._segments = [None] * len(self._segments)
            self._free.clear()
            self._leased.clear()
            self._released.clear()
            self._retired.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    def close_in_child(self) -> None:
        for segment in self._segments:
            if segment is not None:
                segment.close_fd()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            if os.getpid() != self._owner_pid:  # a forked copy's garbage: nothing was left open
                self.close()
                return
            warnings.warn(f"unclosed shmloader Ring of {len(self._segments)} slots", ResourceWarning, stacklevel=2)
            self.close()
