# cython: language_level=3
"""The Cython skin over ring.h: a mapped slot segment and the lease that owns its views.

The seam (STYLE.md): atomics and raw pointers live in ring.h; this module turns pointers into
Python objects (buffers, leases) and releases the GIL around copies; every decision is made in
shmloader/ring.py.
"""

cimport cython
from cpython.buffer cimport (PyBUF_C_CONTIGUOUS, PyBuffer_FillInfo, PyBuffer_Release,
                             PyObject_CheckBuffer, PyObject_GetBuffer)
from cpython.object cimport PyObject
from cpython.mem cimport PyMem_RawMalloc
from cpython.pycapsule cimport PyCapsule_New
from cpython.ref cimport Py_INCREF
from libc.errno cimport errno
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memcpy
from posix.unistd cimport close

from ring cimport (
    PyDataMem_SetHandler, SHM_STREAM_MIN_BYTES, shm_copy, SHM_ARENA_ALIGN, _import_array, shm_arena, shm_arena_handler,
    shm_arena_open, shm_arena_unlink_and_free, shm_arenas,
    SHM_HEADER_BYTES, SHM_LEAF_ALIGN, SHM_SLOT_FREE, SHM_SLOT_LEASED, SHM_SLOT_MAGIC,
    SHM_SLOT_READY, SHM_SLOT_VERSION, SHM_SLOT_WRITING, shm_discard, shm_map, shm_populate, shm_reserve,
    shm_slot_header,
    shm_unmap, slot_acquire, slot_claim, slot_init, slot_publish, slot_release, slot_state,
)

import os

HEADER_BYTES = SHM_HEADER_BYTES
LEAF_ALIGN = SHM_LEAF_ALIGN
MAGIC = SHM_SLOT_MAGIC
VERSION = SHM_SLOT_VERSION
FREE = SHM_SLOT_FREE
WRITING = SHM_SLOT_WRITING
READY = SHM_SLOT_READY
LEASED = SHM_SLOT_LEASED
STREAM_MIN_BYTES = SHM_STREAM_MIN_BYTES  # a leaf this large is copied with streaming stores (copy.h)
# Rows at least this large are copied with the GIL released (a thread of the worker may run).
cdef uint64_t ROW_COPY_NOGIL_BYTES = 1 << 20


def reserve(int fd, uint64_t nbytes):
    """Allocate the pages of `fd` now (posix_fallocate); raise OSError(ENOSPC, ...) if they do not fit."""
    cdef int rc
    with nogil:
        rc = shm_reserve(fd, nbytes)
    if rc != 0:
        raise OSError(rc, os.strerror(rc))


cdef extern from "<fcntl.h>" nogil:
    int O_CREAT, O_EXCL, O_RDWR, O_NOFOLLOW, O_CLOEXEC
    int open(const char *path, int flags, unsigned int mode)

cdef extern from "<unistd.h>" nogil:
    int unlink(const char *path)

cdef extern from "<signal.h>" nogil:
    ctypedef struct sigset_t:
        pass
    int SIG_BLOCK, SIG_SETMASK
    int sigfillset(sigset_t *signals)
    int pthread_sigmask(int how, const sigset_t *signals, sigset_t *before)


def open_unlinked(bytes path):
    """Create the file `path` exclusively (mode 0600, close-on-exec, no symlink followed) and
    unlink it at once; its fd.  On /dev/shm this is shm_open and shm_unlink as glibc makes them.

    NOTE [ Segments ] in segment.py: between the two calls no other Python thread runs (the GIL
    is held, so none can call os._exit with the name still there) and this thread's signals
    wait (a SIGTERM's default action comes after the unlink)."""
    cdef sigset_t every_signal, before
    cdef int fd, err = 0
    sigfillset(&every_signal)
    pthread_sigmask(SIG_BLOCK, &every_signal, &before)
    fd = open(path, O_CREAT | O_EXCL | O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0o600)
    if fd < 0:
        err = errno
    else:
        unlink(path)
    pthread_sigmask(SIG_SETMASK, &before, NULL)
    if fd < 0:
        raise OSError(err, os.strerror(err), path.decode())
    return fd


@cython.no_gc_clear  # __dealloc__ needs before_unmap even when a gc cycle frees it
cdef class Segment:
    """One slot's shared memory, mapped into this process; owns its fd and its mapping.

    The mapping lives until the last reference goes (leases hold one), so views handed to the
    user never outlive the memory under them.  `before_unmap`, when set, is called just before
    munmap (the CUDA path unregisters the pages there).
    """

    cdef char *_base
    cdef uint64_t _size
    cdef int _fd
    cdef Py_ssize_t _exports
    cdef public object before_unmap
    cdef object __weakref__

    def __cinit__(self, int fd, uint64_t size, bint populate=True):
        self._base = NULL
        self._fd = -1
        if size < SHM_HEADER_BYTES:
            raise ValueError(f"a slot segment needs at least {SHM_HEADER_BYTES} bytes, got {size}")
        cdef void *p
        with nogil:
            p = shm_map(fd, size, populate)
        if p == NULL:
            raise OSError(errno, f"mmap of a {size}-byte slot segment failed: {os.strerror(errno)}")
        self._base = <char *>p
        self._size = size
        self._fd = fd

    def __dealloc__(self):
        if self._base != NULL:
            if self.before_unmap is not None:
                try:
                    self.before_unmap(self)
                except BaseException:
                    pass
            shm_unmap(self._base, self._size)
            self._base = NULL
        if self._fd >= 0:
            close(self._fd)
            self._fd = -1

    @property
    def size(self):
        return self._size

    @property
    def fd(self):
        """The segment's file descriptor, or -1 once closed (the mapping stays valid)."""
        return self._fd

    @property
    def address(self):
        return <uintptr_t>self._base

    @property
    def mapped(self):
        return self._base != NULL

    @property
    def exports(self):
        return self._exports

    cdef inline shm_slot_header *_header(self) except NULL:
        if self._base == NULL:
            raise ValueError("slot segment is unmapped")
        return <shm_slot_header *>self._base

    def init_header(self, uint64_t generation):
        slot_init(self._header(), self._size, generation)

    def header(self):
        """(magic, version, state, capacity, generation, writer, sequence, descriptor_bytes,
        payload_end, descriptor_offset)."""
        cdef shm_slot_header *h = self._header()
        return (h.magic, h.version, slot_state(h), h.capacity, h.generation, h.writer,
                h.sequence, h.descriptor_bytes, h.payload_end, h.descriptor_offset)

    def state(self):
        return slot_state(self._header())

    def claim(self, int64_t writer, uint64_t sequence):
        """FREE -> WRITING; returns the state found (FREE means claimed)."""
        return slot_claim(self._header(), writer, sequence)

    def publish(self, uint64_t descriptor_bytes, uint64_t payload_end,
                uint64_t descriptor_offset=SHM_HEADER_BYTES):
        if (payload_end > self._size or descriptor_offset < SHM_HEADER_BYTES
                or descriptor_bytes > self._size - descriptor_offset
                or descriptor_offset + descriptor_bytes > payload_end):
            raise ValueError(
                f"publish past the slot: descriptor {descriptor_bytes} bytes at {descriptor_offset}, "
                f"payload end {payload_end}, capacity {self._size}")
        slot_publish(self._header(), descriptor_offset, descriptor_bytes, payload_end)

    def acquire(self):
        """READY -> LEASED; returns the state found (READY means acquired)."""
        return slot_acquire(self._header())

    def release(self):
        slot_release(self._header())

    def _check_range(self, uint64_t offset, uint64_t nbytes):
        if self._base == NULL:
            raise ValueError("slot segment is unmapped")
        if offset > self._size or nbytes > self._size - offset:
            raise ValueError(
                f"range [{offset}, {offset + nbytes}) lies outside the {self._size}-byte slot")

    def write(self, uint64_t offset, const uint8_t[::1] data):
        """Copy small bytes (the descriptor) into the slot."""
        cdef uint64_t n = data.shape[0]
        self._check_range(offset, n)
        if n:
            memcpy(self._base + offset, &data[0], n)

    def read(self, uint64_t offset, uint64_t nbytes):
        self._check_range(offset, nbytes)
        return (self._base + offset)[:nbytes]

    def copy_from_address(self, uint64_t offset, uintptr_t source, uint64_t nbytes):
        """Copy `nbytes` from a raw address (a contiguous array's data) into the slot, GIL
        released; streaming stores from STREAM_MIN_BYTES (csrc/copy.h)."""
        self._check_range(offset, nbytes)
        cdef char *dst = self._base + offset
        with nogil:
            shm_copy(dst, <const void *>source, nbytes, nbytes)

    def copy_rows(self, uint64_t offset, uint64_t row_nbytes, rows, Py_ssize_t start=0):
        """Copy rows[i] to `offset + i * row_nbytes` for i from `start`: the stacked rows of one
        batch leaf (arrays of one dtype and shape), in one call rather than a Python call per row.
        A None row is already in place.  Stops at the first row that is not a C-contiguous buffer
        of exactly `row_nbytes` (a tensor, a strided array) and returns its index, for the caller
        to copy that row and go on after it; returns len(rows) when every row is copied.  A leaf
        of STREAM_MIN_BYTES or more in all is copied with streaming stores (csrc/copy.h)."""
        cdef Py_ssize_t i, n = len(rows)
        cdef Py_buffer view
        cdef char *dst
        cdef object row
        cdef uint64_t leaf_bytes = row_nbytes * <uint64_t>n
        self._check_range(offset, leaf_bytes)
        for i in range(start, n):
            row = rows[i]
            if row is None:
                continue
            if not PyObject_CheckBuffer(row):
                return i
            try:
                PyObject_GetBuffer(row, &view, PyBUF_C_CONTIGUOUS)
            except Exception:  # a strided array, a dtype with no buffer format
                return i
            if <uint64_t>view.len != row_nbytes:
                PyBuffer_Release(&view)
                return i
            dst = self._base + offset + <uint64_t>i * row_nbytes
            if row_nbytes >= ROW_COPY_NOGIL_BYTES:
                with nogil:
                    shm_copy(dst, view.buf, row_nbytes, leaf_bytes)
            else:
                shm_copy(dst, view.buf, row_nbytes, leaf_bytes)
            PyBuffer_Release(&view)
        return n

    def discard_from(self, uint64_t offset):
        """Give the pages from `offset` (page-aligned) to the end back to /dev/shm, for every
        process mapping the segment: nothing may be read or written there afterwards (a held
        batch keeps only the pages under it, NOTE [ Held batches ] in shmloader/ring.py)."""
        self._check_range(offset, self._size - offset if offset <= self._size else 1)
        if offset == self._size:
            return
        cdef int rc = shm_discard(self._base, offset, self._size - offset)
        if rc != 0:
            raise OSError(rc, f"discarding bytes {offset} to {self._size} of a slot segment: {os.strerror(rc)}")

    def populate(self, uint64_t offset, uint64_t nbytes):
        """Take back from /dev/shm the pages of [offset, offset + nbytes) (offset page-aligned),
        given back by discard_from, before writing there: OSError(EFAULT) where /dev/shm has no
        room for them, OSError(EINVAL) on a kernel without MADV_POPULATE_WRITE (Linux < 5.14)
        (NOTE [ A slot's pages follow its batch ] in shmloader/ring.py)."""
        self._check_range(offset, nbytes)
        cdef int rc
        with nogil:
            rc = shm_populate(self._base, offset, nbytes)
        if rc != 0:
            raise OSError(rc, f"reserving bytes {offset} to {offset + nbytes} of a slot segment: {os.strerror(rc)}")

    def close_fd(self):
        """Close the fd (after it has been passed on); the mapping stays until deallocation."""
        if self._fd >= 0:
            close(self._fd)
            self._fd = -1

    def __getbuffer__(self, Py_buffer *buffer, int flags):
        if self._base == NULL:
            raise BufferError("slot segment is unmapped")
        PyBuffer_FillInfo(buffer, self, self._base, <Py_ssize_t>self._size, 0, flags)
        self._exports += 1

    def __releasebuffer__(self, Py_buffer *buffer):
        self._exports -= 1


@cython.no_gc_clear  # __dealloc__ must still call on_release when a gc cycle frees it
cdef class SlotLease:
    """The main process's claim on one delivered batch.

    Every view of the batch (torch.frombuffer / np.frombuffer over this object) holds a reference
    to it; when the last one goes, `on_release((slot, generation))` tells the ring the slot is
    free again (NOTE [ Slot lifecycle ] in shmloader/ring.py).
    """

    cdef readonly Segment segment
    cdef readonly int slot
    cdef readonly uint64_t generation
    cdef readonly uint64_t sequence
    cdef object _on_release
    cdef object __weakref__

    def __cinit__(self, Segment segment, int slot, uint64_t generation, uint64_t sequence,
                  object on_release):
        self.segment = segment
        self.slot = slot
        self.generation = generation
        self.sequence = sequence
        self._on_release = on_release

    def __dealloc__(self):
        if self._on_release is not None:
            try:
                self._on_release((self.slot, self.generation))
            except BaseException:
                pass
            self._on_release = None

    def __getbuffer__(self, Py_buffer *buffer, int flags):
        if self.segment._base == NULL:
            raise BufferError("slot segment is unmapped")
        PyBuffer_FillInfo(buffer, self, self.segment._base, <Py_ssize_t>self.segment._size, 0, flags)

    def __releasebuffer__(self, Py_buffer *buffer):
        pass

    def __repr__(self):
        return f"<SlotLease slot={self.slot} generation={self.generation} batch={self.sequence}>"


_import_array()
_ARENA_HANDLER = PyCapsule_New(<void *>&shm_arena_handler, "mem_handler", NULL)


cdef class SlotArena:
    """numpy's data allocator pointed at a slot while a worker runs the user's collate_fn (the
    mechanism and its rules are in csrc/arena.h; shmloader/worker.py decides when to use it).

        arena = SlotArena(segment, begin, min_bytes)
        with arena:                       # numpy allocations of >= min_bytes come from the slot
            batch = collate_fn(samples)
        ... lay out batch: leaves with arena.holds(address, nbytes) are described, not copied ...
        del batch
        survivors = arena.release()       # > 0: the worker kept arrays that live in the slot

    After release the arena belongs to csrc/arena.h's list until its last block is freed; it
    keeps `segment` mapped until then.

    `SlotArena(segment, begin, min_bytes, end=begin + n, exact=True)` is one block of exactly
    [begin, end): the first request of n bytes gets it (a row of sample_parallel's batch).
    """

    cdef shm_arena *_a
    cdef object _previous
    cdef char *_base

    def __cinit__(self, Segment segment, uint64_t begin, uint64_t min_bytes, uint64_t end=0,
                  bint exact=False):
        global shm_arenas
        if segment._base == NULL:
            raise ValueError("slot segment is unmapped")
        if end == 0:
            end = segment._size
        if begin > end or end > segment._size:
            raise ValueError(f"arena [{begin}, {end}) does not lie in the {segment._size}-byte slot")
        cdef shm_arena *a = <shm_arena *>PyMem_RawMalloc(sizeof(shm_arena))
        if a == NULL:
            raise MemoryError()
        a.lo = segment._base + begin
        a.hi = segment._base + end
        a.cursor = a.lo
        a.top = NULL
        a.want = 0
        a.min_bytes = min_bytes
        a.exact = exact
        a.live = 0
        a.open = 0
        a.released = 0
        Py_INCREF(segment)
        a.owner = <PyObject *>segment
        a.next = shm_arenas
        shm_arenas = a
        self._a = a
        self._base = segment._base

    def __enter__(self):
        global shm_arena_open
        if self._a == NULL or self._a.released:
            raise ValueError("this slot arena has been released")
        if shm_arena_open != NULL:
            raise RuntimeError("another slot arena is open in this process")
        self._previous = PyDataMem_SetHandler(_ARENA_HANDLER)
        self._a.open = 1
        shm_arena_open = self._a
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False

    def close(self):
        """Stop handing out blocks and give numpy its previous allocator back."""
        global shm_arena_open
        if self._a != NULL and self._a.open:
            self._a.open = 0
            shm_arena_open = NULL
            PyDataMem_SetHandler(self._previous)
            self._previous = None

    @property
    def used_end(self):
        """Offset in the slot past the last block handed out (64-aligned)."""
        if self._a == NULL:
            raise ValueError("this slot arena has been released")
        return (<uint64_t>(self._a.cursor - self._base) + SHM_ARENA_ALIGN - 1) // SHM_ARENA_ALIGN * SHM_ARENA_ALIGN

    @property
    def wanted_end(self):
        """Offset in the slot that the cursor would have reached had every request of at least
        min_bytes fitted (blocks freed on the way taken back): a slot of this size holds every
        large array the collate_fn made."""
        if self._a == NULL:
            raise ValueError("this slot arena has been released")
        return <uint64_t>(self._a.lo - self._base) + self._a.want

    @property
    def begin(self):
        """Offset in the slot of the arena's first byte."""
        if self._a == NULL:
            raise ValueError("this slot arena has been released")
        return <uint64_t>(self._a.lo - self._base)

    @property
    def end(self):
        """Offset in the slot past the arena's last byte."""
        if self._a == NULL:
            raise ValueError("this slot arena has been released")
        return <uint64_t>(self._a.hi - self._base)

    @property
    def taken(self):
        """Whether any block has been handed out."""
        return self._a != NULL and self._a.cursor != self._a.lo

    @property
    def live(self):
        """Blocks handed out and not freed yet."""
        return self._a.live if self._a != NULL else 0

    def offset_of(self, uintptr_t address, uint64_t nbytes):
        """The slot offset of [address, address + nbytes) if it lies in a block of this arena,
        else None."""
        if self._a == NULL:
            return None
        cdef uintptr_t lo = <uintptr_t>self._a.lo
        cdef uintptr_t end = <uintptr_t>self._a.cursor
        if address < lo or address > end or nbytes > end - address:
            return None
        return address - <uintptr_t>self._base

    def release(self):
        """The worker is done with the arena; returns how many of its blocks are still alive
        (kept by the user's code).  Those keep the slot's segment mapped in this process."""
        self.close()
        if self._a == NULL:
            return 0
        cdef shm_arena *a = self._a
        cdef int64_t survivors = a.live
        self._a = NULL
        a.released = 1
        if survivors == 0:
            shm_arena_unlink_and_free(a)
        return survivors

    def __dealloc__(self):
        if self._a != NULL:
            if self._a.open:
                self.close()
            self.release()


# -- a worker's stage clocks (NOTE [ Stage clocks ] in shmloader/timing.py) -------------------------

cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    cdef struct timespec:
        time_t tv_sec
        long tv_nsec
    int clock_gettime(int clk_id, timespec *tp)
    int CLOCK_MONOTONIC

DEF STAGE_SLOTS = 24

cdef struct stage_block:  # one worker's block of the status segment: 32 int64 words, 256 bytes
    int64_t stage  # the stage it is in (an index into shmloader.worker.STAGES)
    int64_t batch  # the batch it is for, or -1
    int64_t since_ns  # CLOCK_MONOTONIC when it entered the stage (0: not started)
    int64_t batches  # batches begun (entries into "fetching")
    int64_t timed  # 1: accumulate times (written by the main process before the worker starts)
    int64_t cpu0_ns  # the worker thread's CPU time when start-up ended, -1 if unknown
    int64_t delay0_ns  # its run-queue delay then, -1 if unknown
    int64_t spare
    int64_t stage_ns[STAGE_SLOTS]  # nanoseconds in each stage so far (the current one excluded)

STATUS_BLOCK_BYTES = sizeof(stage_block)
MAX_STAGES = STAGE_SLOTS


cdef class StageClock:
    """A worker's writer of its stage block: `enter(stage, batch)` adds the time since the last
    change to the stage it leaves and records the new one (a clock read and a few stores, no
    system call).  `on_ready`, if given, is called once, the first time the worker enters the
    `idle` stage, to record its CPU baseline with `set_baseline`."""

    cdef Segment _segment  # keeps the mapping alive
    cdef stage_block *_b
    cdef int64_t _idle, _fetching
    cdef object _on_ready

    def __cinit__(self, Segment segment, uint64_t offset, int64_t idle, int64_t fetching,
                  on_ready=None):
        segment._check_range(offset, sizeof(stage_block))
        if offset % 8:
            raise ValueError(f"a stage block must be 8-byte aligned, got offset {offset}")
        self._segment = segment
        self._b = <stage_block *>(segment._base + offset)
        self._idle, self._fetching = idle, fetching
        self._on_ready = on_ready

    def enter(self, int64_t stage, int64_t batch):
        cdef stage_block *b = self._b
        cdef timespec ts
        cdef int64_t now
        if not b.timed:  # read at each change: the main process may turn it on or off
            b.since_ns = 0
        else:
            clock_gettime(CLOCK_MONOTONIC, &ts)
            now = <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec
            if b.since_ns and 0 <= b.stage < STAGE_SLOTS:
                b.stage_ns[b.stage] += now - b.since_ns
            b.since_ns = now
            if stage == self._fetching:
                b.batches += 1
        b.stage = stage
        b.batch = batch
        if stage == self._idle and self._on_ready is not None:
            on_ready, self._on_ready = self._on_ready, None
            on_ready(self)

    @property
    def timed(self):
        return self._b.timed != 0

    def set_baseline(self, int64_t cpu_ns, int64_t delay_ns):
        self._b.cpu0_ns = cpu_ns
        self._b.delay0_ns = delay_ns
