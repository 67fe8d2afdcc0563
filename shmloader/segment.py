"""The segment primitive both sides use: one nameless, reserved, mapped shared-memory segment.

The main process (ring.py, spares.py) and the workers (worker.py: a slot that must grow, a batch
moved away from a kept arena) both create segments; this module is all they share.  Which slot
a segment serves, when it is made and when it goes is the ring's policy, not this module's.

NOTE [ Segments ]
  A segment's name exists only for the instant between its creation in /dev/shm (O_EXCL, mode
  0600) and its unlink, two system calls in one C function (`_ring.open_unlinked`): processes share it by passing the fd over
  their control socket (SCM_RIGHTS), so no crash of any process can leave an entry behind in
  /dev/shm.  No Python code runs between the two calls, in this thread or another (the GIL is
  held), so an os._exit elsewhere (the training script's, a worker's watch thread's) cannot
  land there; with the two calls in Python (posix_ipc) 18 of 200 processes that exited while a
  thread made segments left a name behind for good.  This thread's signals wait meanwhile too.
  A Ctrl-C is held while the segment is made (its KeyboardInterrupt raised once it is whole),
  so that it cannot land between the fd and its segment (the fd and its reserved pages
  leaked).  Its pages
  are reserved with posix_fallocate when it is created, so a /dev/shm that is too small is a
  ShmCapacityError then, never a SIGBUS in a worker later.  Its header (csrc/ring.h) carries a
  magic number, the ABI version, its capacity and its generation, which each side checks.
  A posix_fallocate that fails on tmpfs holds the pages it got until it gives them all back, so
  processes that reserve at once (the workers' first slots) can fail where each alone fits: one
  that fails while /dev/shm, read again a moment later, has room for it tries again
  (CREATE_TRIES in all).
"""

from __future__ import annotations

import errno
import os
import random
import secrets
import time

from . import _ring
from .errors import ShmCapacityError
from .interrupts import ctrl_c_held

SHM_DIR = "/dev/shm"
PAGE = os.sysconf("SC_PAGE_SIZE")
MIN_HEADROOM = 64 * 1024
CREATE_TRIES = 4  # NOTE [ Segments ]: a reservation that failed for another's failed one
RETRY_PAUSE_SECONDS = 0.002  # and a pause (1-2x, jittered) for those to give their pages back


def page_round(nbytes: int) -> int:
    return (nbytes + PAGE - 1) // PAGE * PAGE


# NOTE [ A slot's pages follow its batch ] in ring.py: a slot gives back the pages past its batch
# when at least this many bytes, and this share of the slot, lie there.
TRIM_MIN_BYTES = 1 << 20
TRIM_MIN_SHARE = 1 / 4


def trimmed_end(capacity: int, payload_end: int) -> int:
    """Where the pages of a segment of `capacity` bytes end once the batch written in it (ending
    at `payload_end`) is in, if its writer may give back the rest: the batch's end, page-rounded,
    where that frees at least TRIM_MIN_BYTES and TRIM_MIN_SHARE of the segment, else `capacity`
    (a grown slot's headroom, an eighth, is kept).  Worker and main process both apply it, the one
    to give the pages back, the other to know which to ask back at the slot's next grant."""
    end = page_round(payload_end)
    if capacity - end >= max(TRIM_MIN_BYTES, TRIM_MIN_SHARE * capacity):
        return end
    return capacity


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


def create_segment(capacity: int, generation: int, what: str = "a ring slot",
                   populate: bool = True) -> _ring.Segment:
    """A new, reserved, mapped and already-unlinked slot segment of `capacity` bytes; mapped
    without `populate` by a process that will touch little of it (the main process)."""
    capacity = page_round(max(capacity, _ring.HEADER_BYTES))
    free = shm_free_bytes()
    if capacity > free:  # fail before posix_fallocate briefly fills /dev/shm for everyone else
        raise ShmCapacityError(capacity, free, SHM_DIR, what)
    for tries_left in range(CREATE_TRIES - 1, -1, -1):
        try:
            with ctrl_c_held():  # NOTE [ Segments ], NOTE [ Ctrl-C held ] in interrupts.py
                segment = _create(capacity, what, populate)
            break
        except ShmCapacityError as exc:
            if not tries_left:
                raise
            time.sleep(RETRY_PAUSE_SECONDS * (1 + random.random()))  # others' failed ones give back
            free = shm_free_bytes()
            if free < capacity:  # there is no room, not only for a moment
                raise ShmCapacityError(capacity, free, SHM_DIR, what) from exc.__cause__
    segment.init_header(generation)
    return segment


OVERFLOW_MEMORY_MARGIN = 512 << 20  # what an overflow segment leaves of the memory available


def memory_available() -> int:
    """Bytes of memory this process can still take: MemAvailable, or less where its cgroup's
    limit (v2 memory.max) is closer."""
    available = 0
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        return 0
    try:
        with open("/sys/fs/cgroup/memory.max") as limit, open("/sys/fs/cgroup/memory.current") as used:
            cap = limit.read().strip()
            if cap != "max":
                available = min(available, int(cap) - int(used.read().strip()))
    except (OSError, ValueError):
        pass
    return max(0, available)


def create_overflow_segment(capacity: int, generation: int, what: str,
                            populate: bool = False) -> _ring.Segment:
    """A segment outside /dev/shm, for when /dev/shm is full (NOTE [ Overflow slots ] in ring.py):
    a memfd, on the kernel's internal tmpfs, which /dev/shm's size does not bound; its pages
    are reserved and charged to the process's memory as heap pages are.  Mapped without
    `populate` by the main process, which touches little of it.  ShmCapacityError where it would
    leave less than OVERFLOW_MEMORY_MARGIN of the memory available (the OOM killer, not an
    error, would follow)."""
    capacity = page_round(max(capacity, _ring.HEADER_BYTES))
    available = memory_available()
    if capacity + OVERFLOW_MEMORY_MARGIN > available:
        raise ShmCapacityError(capacity, shm_free_bytes(), SHM_DIR,
                               f"{what} (nor could it be made outside {SHM_DIR}: "
                               f"{available} bytes of memory available)")
    with ctrl_c_held():  # NOTE [ Ctrl-C held ] in interrupts.py: no fd leaked half-made
        try:
            segment = _reserved(os.memfd_create("shmloader-overflow", os.MFD_CLOEXEC), capacity, populate)
        except OSError as exc:
            if exc.errno in _NO_ROOM:
                raise MemoryError(f"{what}: no memory for a {capacity}-byte segment outside "
                                  f"{SHM_DIR} either ({exc.strerror})") from exc
            raise
    segment.init_header(generation)
    return segment


def create_segment_or_overflow(capacity: int, generation: int, what: str,
                               populate: bool = True) -> _ring.Segment:
    """A new segment for a slot whose batch needs it now (a larger batch, arrays the dataset
    keeps, a sample-parallel batch): in /dev/shm, or outside it where /dev/shm has no room (NOTE
    [ Overflow slots ] in ring.py; the ring tells the two apart by `outside_shm`).  A
    ShmCapacityError naming both where neither has room."""
    try:
        return create_segment(capacity, generation, what, populate)
    except ShmCapacityError:
        return create_overflow_segment(capacity, generation, what, populate)


def outside_shm(fd: int) -> bool:
    """Whether the segment of `fd` lies outside /dev/shm (an overflow segment, a memfd)."""
    return os.fstat(fd).st_dev != os.stat(SHM_DIR).st_dev


_NO_ROOM = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG)


def _reserved(fd: int, capacity: int, populate: bool) -> _ring.Segment:
    """The segment of `fd`, sized to `capacity` and its pages reserved (the fd closed on error)."""
    try:
        os.ftruncate(fd, capacity)
        _ring.reserve(fd, capacity)
        return _ring.Segment(fd, capacity, populate=populate)
    except OSError:
        os.close(fd)
        raise


def _create(capacity: int, what: str, populate: bool) -> _ring.Segment:
    fd = _ring.open_unlinked(f"{SHM_DIR}/shmloader-{secrets.token_hex(16)}".encode())
    try:
        return _reserved(fd, capacity, populate)
    except OSError as exc:
        if exc.errno in _NO_ROOM:
            # free again: read before, it may have been taken since by another process's segment,
            # or held for a moment by another's failing posix_fallocate
            raise ShmCapacityError(capacity, shm_free_bytes(), SHM_DIR, what) from exc
        raise
