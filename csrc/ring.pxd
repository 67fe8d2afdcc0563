# The C surface of csrc/ring.h, declared once (see ring.h for the byte layout).
from cpython.object cimport PyObject
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t


cdef extern from "ring.h" nogil:
    const uint64_t SHM_SLOT_MAGIC
    const uint32_t SHM_SLOT_VERSION
    const uint32_t SHM_HEADER_BYTES
    const uint32_t SHM_LEAF_ALIGN
    const uint32_t SHM_SLOT_FREE
    const uint32_t SHM_SLOT_WRITING
    const uint32_t SHM_SLOT_READY
    const uint32_t SHM_SLOT_LEASED

    ctypedef struct shm_slot_header:
        uint64_t magic
        uint32_t version
        uint32_t state
        uint64_t capacity
        uint64_t generation
        int64_t writer
        uint64_t sequence
        uint64_t descriptor_bytes
        uint64_t payload_end
        uint64_t descriptor_offset

    int shm_reserve(int fd, uint64_t nbytes) noexcept
    void *shm_map(int fd, uint64_t nbytes, int populate) noexcept
    int shm_unmap(void *base, uint64_t nbytes) noexcept
    int shm_discard(void *base, uint64_t offset, uint64_t nbytes) noexcept
    int shm_populate(void *base, uint64_t offset, uint64_t nbytes) noexcept
    void slot_init(shm_slot_header *h, uint64_t capacity, uint64_t generation) noexcept
    uint32_t slot_state(const shm_slot_header *h) noexcept
    uint32_t slot_claim(shm_slot_header *h, int64_t writer, uint64_t sequence) noexcept
    void slot_publish(shm_slot_header *h, uint64_t descriptor_offset, uint64_t descriptor_bytes,
                      uint64_t payload_end) noexcept
    uint32_t slot_acquire(shm_slot_header *h) noexcept
    void slot_release(shm_slot_header *h) noexcept


cdef extern from "numpy/arrayobject.h":
    ctypedef struct PyDataMem_Handler:
        pass
    object PyDataMem_SetHandler(object handler)
    int _import_array() except -1


cdef extern from "copy.h" nogil:
    const uint64_t SHM_STREAM_MIN_BYTES
    void shm_copy(void *dst, const void *src, size_t n, uint64_t leaf_bytes) noexcept


cdef extern from "arena.h":
    ctypedef struct shm_arena:
        char *lo
        char *hi
        char *cursor
        void *top
        uint64_t want
        uint64_t min_bytes
        int exact
        int64_t live
        int open
        int released
        PyObject *owner
        shm_arena *next

    shm_arena *shm_arenas
    shm_arena *shm_arena_open
    const uint32_t SHM_ARENA_ALIGN
    PyDataMem_Handler shm_arena_handler
    void shm_arena_unlink_and_free(shm_arena *a) noexcept
