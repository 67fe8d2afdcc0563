/* shmloader ring: the byte layout shared between processes, and the few calls that touch it.
 *
 * A slot is one POSIX shared-memory segment, mapped by the main process and by the workers.
 *
 *   offset 0                      SHM_HEADER_BYTES                                          capacity
 *   | shm_slot_header (128 bytes) | array leaves at 64-aligned offsets | descriptor (pickle) |
 *
 * Leaf offsets are absolute (from the segment's start), so arrays a numpy collate_fn allocated
 * in the slot itself (csrc/arena.h) stay where they were born; the descriptor follows the last
 * leaf and the header says where it is.
 *
 * The header starts with a magic number and a layout version so that a stale or foreign segment
 * is refused clearly.  `state` is the slot's lifecycle word, changed with atomics only:
 *
 *   FREE --worker claims--> WRITING --worker publishes--> READY --main acquires--> LEASED
 *     ^                                                                              |
 *     +---------------------------- main releases (last view gone) -----------------+
 *
 * A dead worker's slot is never reset: the loader shuts down and closes the ring when a worker
 * dies (NOTE [ Slot lifecycle ] in shmloader/ring.py).  Array bytes are written before the
 * release-store of READY (a streamed copy, csrc/copy.h, ends with a store fence for that); the
 * main process reads them after its acquire-load, so no torn batch can be observed.
 */
#ifndef SHMLOADER_RING_H
#define SHMLOADER_RING_H

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define SHM_SLOT_MAGIC 0x544f4c534c4d4853ULL /* "SHMLSLOT" little-endian */
#define SHM_SLOT_VERSION 2u
#define SHM_HEADER_BYTES 128u
#define SHM_LEAF_ALIGN 64u

enum {
    SHM_SLOT_FREE = 0,
    SHM_SLOT_WRITING = 1,
    SHM_SLOT_READY = 2,
    SHM_SLOT_LEASED = 3,
};

typedef struct {
    uint64_t magic;            /* SHM_SLOT_MAGIC */
    uint32_t version;          /* SHM_SLOT_VERSION */
    uint32_t state;            /* SHM_SLOT_*, atomic */
    uint64_t capacity;         /* bytes of the whole segment, header included */
    uint64_t generation;       /* bumped each time the slot is replaced by a larger segment */
    int64_t writer;            /* worker id while WRITING or READY, -1 otherwise */
    uint64_t sequence;         /* batch number (send index) held while WRITING/READY/LEASED */
    uint64_t descriptor_bytes; /* pickled descriptor length */
    uint64_t payload_end;      /* first byte past the last leaf and the descriptor */
    uint64_t descriptor_offset; /* where the descriptor starts */
    uint8_t reserved[SHM_HEADER_BYTES - 72];
} shm_slot_header;

_Static_assert(sizeof(shm_slot_header) == SHM_HEADER_BYTES, "slot header must be 128 bytes");

/* Reserve the segment's pages now, so that a full /dev/shm is an error here and not a SIGBUS
 * later.  Returns 0 or an errno value. */
static inline int shm_reserve(int fd, uint64_t bytes) {
    int rc;
    do {
        rc = posix_fallocate(fd, 0, (off_t)bytes);
    } while (rc == EINTR);
    return rc;
}

/* Map a segment read-write and shared; `populate` sets up its page tables now (a writer that
 * fills the whole slot wants that; a reader that may touch little of it does not). */
static inline void *shm_map(int fd, uint64_t bytes, int populate) {
    void *p = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE,
                   MAP_SHARED | (populate ? MAP_POPULATE : 0), fd, 0);
    return p == MAP_FAILED ? NULL : p;
}

static inline int shm_unmap(void *base, uint64_t bytes) { return munmap(base, (size_t)bytes); }

/* Give the pages of [offset, offset + bytes) back to /dev/shm (MADV_REMOVE: the segment's
 * backing store, for every process that maps it; those bytes read as zeros afterwards).  `offset`
 * must be page-aligned.  Returns 0 or an errno value. */
static inline int shm_discard(void *base, uint64_t offset, uint64_t bytes) {
    return madvise((char *)base + offset, (size_t)bytes, MADV_REMOVE) == 0 ? 0 : errno;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux >= 5.14; older kernels answer EINVAL */
#endif

/* Allocate and map writable the pages of [offset, offset + bytes) of a segment whose pages were
 * given back (shm_discard), so that a full /dev/shm is an error here (EFAULT: the write would
 * have raised SIGBUS) and not a SIGBUS in the middle of a batch.  `offset` page-aligned.
 * Returns 0 or an errno value (EINVAL: the kernel has no MADV_POPULATE_WRITE). */
static inline int shm_populate(void *base, uint64_t offset, uint64_t bytes) {
    int rc;
    do {
        rc = madvise((char *)base + offset, (size_t)bytes, MADV_POPULATE_WRITE) == 0 ? 0 : errno;
    } while (rc == EINTR);
    return rc;
}

static inline void slot_init(shm_slot_header *h, uint64_t capacity, uint64_t generation) {
    memset(h, 0, sizeof(*h));
    h->magic = SHM_SLOT_MAGIC;
    h->version = SHM_SLOT_VERSION;
    h->capacity = capacity;
    h->generation = generation;
    h->writer = -1;
    __atomic_store_n(&h->state, SHM_SLOT_FREE, __ATOMIC_RELEASE);
}

static inline uint32_t slot_state(const shm_slot_header *h) {
    return __atomic_load_n(&h->state, __ATOMIC_ACQUIRE);
}

/* FREE -> WRITING by `writer`.  Returns the state found (SHM_SLOT_FREE on success). */
static inline uint32_t slot_claim(shm_slot_header *h, int64_t writer, uint64_t sequence) {
    uint32_t expected = SHM_SLOT_FREE;
    if (__atomic_compare_exchange_n(&h->state, &expected, SHM_SLOT_WRITING, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE)) {
        h->writer = writer;
        h->sequence = sequence;
        h->descriptor_bytes = 0;
        h->payload_end = 0;
        h->descriptor_offset = 0;
    }
    return expected;
}

/* WRITING -> READY: everything written before this call is visible to an acquiring reader. */
static inline void slot_publish(shm_slot_header *h, uint64_t descriptor_offset,
                                uint64_t descriptor_bytes, uint64_t payload_end) {
    h->descriptor_offset = descriptor_offset;
    h->descriptor_bytes = descriptor_bytes;
    h->payload_end = payload_end;
    __atomic_store_n(&h->state, SHM_SLOT_READY, __ATOMIC_RELEASE);
}

/* READY -> LEASED.  Returns the state found (SHM_SLOT_READY on success). */
static inline uint32_t slot_acquire(shm_slot_header *h) {
    uint32_t expected = SHM_SLOT_READY;
    __atomic_compare_exchange_n(&h->state, &expected, SHM_SLOT_LEASED, 0, __ATOMIC_ACQ_REL,
                                __ATOMIC_ACQUIRE);
    return expected;
}

/* Any state -> FREE: the main process's release of a slot whose batch is gone, or a worker's
 * undoing of its own claim when writing the batch failed. */
static inline void slot_release(shm_slot_header *h) {
    h->writer = -1;
    __atomic_store_n(&h->state, SHM_SLOT_FREE, __ATOMIC_RELEASE);
}

#endif /* SHMLOADER_RING_H */
