/* shmloader slot arena: numpy's data allocator (NEP 49) pointed at a ring slot while a worker runs
 * the user's collate_fn, so that the batch's large arrays (np.stack, np.concatenate, np.empty
 * then fill, ...) are born in the slot and need no second copy.
 *
 * An arena is a bump allocator over [lo, hi) of one mapped slot segment.  Blocks are 64-byte
 * aligned and carry a 64-byte prefix holding their size (numpy's realloc does not pass it):
 *
 *   lo ... | size | block (64-aligned) ... | size | block ... | cursor ...... hi
 *
 * While an arena is open (only around the collate call, in the worker's main thread, through a
 * context-local numpy handler) requests of at least `min_bytes` that fit come from it; smaller
 * ones, those that do not fit, and every request of other threads or after closing go to the C
 * heap.  Memory is never reused inside an arena: a block freed before the batch is written is
 * simply lost space in the slot.
 *
 * An exact arena (sample_parallel's rows, shmloader/sample_parallel.py) is one block: [lo, hi)
 * itself, handed out only to the first request of exactly hi - lo bytes, with no size prefix (the
 * bytes before lo are another row's).  A row-sized array the dataset makes is then born in its
 * row.
 *
 * Every arena with a block still alive stays in a process-wide list (guarded by the GIL: numpy
 * allocates and frees array data with the GIL held), so a block freed later, when its batch has
 * long been sent, is recognised and not passed to free(3).  An arena keeps a reference to its
 * segment's Python object while any of its blocks lives, so an array a worker keeps (a cache in
 * the dataset or the collate_fn) never points into unmapped memory.  Whether such a block
 * survived the batch is what `live` tells the worker (shmloader/worker.py decides what to do).
 */
#ifndef SHMLOADER_ARENA_H
#define SHMLOADER_ARENA_H

#include <Python.h>
#include <numpy/ndarraytypes.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SHM_ARENA_ALIGN 64u

typedef struct shm_arena {
    char *lo, *hi, *cursor;
    uint64_t min_bytes;
    int exact;        /* one block, [lo, hi) exactly, no size prefix */
    int64_t live;     /* blocks handed out and not yet freed */
    int open;         /* handing out blocks (only while the collate_fn runs) */
    int released;     /* the worker is done with it: freed when `live` drops to 0 */
    PyObject *owner;  /* the segment, referenced while the arena exists */
    struct shm_arena *next;
} shm_arena;

static shm_arena *shm_arenas = NULL;     /* every arena not freed yet */
static shm_arena *shm_arena_open = NULL; /* the one handing out blocks, if any */

static inline shm_arena *shm_arena_of(const void *p) {
    for (shm_arena *a = shm_arenas; a != NULL; a = a->next) {
        if ((const char *)p >= a->lo && (const char *)p < a->hi) return a;
    }
    return NULL;
}

static inline void shm_arena_unlink_and_free(shm_arena *a) {
    shm_arena **link = &shm_arenas;
    while (*link != NULL && *link != a) link = &(*link)->next;
    if (*link == a) *link = a->next;
    Py_XDECREF(a->owner);
    PyMem_RawFree(a);
}

static inline void *shm_arena_take(size_t size) {
    shm_arena *a = shm_arena_open;
    if (a == NULL || !a->open || size < a->min_bytes) return NULL;
    if (a->exact) {
        if (a->cursor != a->lo || size != (size_t)(a->hi - a->lo)) return NULL;
        a->cursor = a->hi;
        a->live++;
        return a->lo;
    }
    uintptr_t at = ((uintptr_t)a->cursor + SHM_ARENA_ALIGN - 1) & ~(uintptr_t)(SHM_ARENA_ALIGN - 1);
    char *block = (char *)at + SHM_ARENA_ALIGN;
    if (block > a->hi || size > (size_t)(a->hi - block)) return NULL;
    *(uint64_t *)(block - SHM_ARENA_ALIGN) = (uint64_t)size;
    a->cursor = block + size;
    a->live++;
    return block;
}

static inline void shm_arena_give_back(shm_arena *a) {
    a->live--;
    if (a->live == 0 && a->released) shm_arena_unlink_and_free(a);
}

static void *shm_arena_malloc(void *ctx, size_t size) {
    (void)ctx;
    void *p = shm_arena_take(size);
    return p != NULL ? p : malloc(size ? size : 1);
}

static void *shm_arena_calloc(void *ctx, size_t nelem, size_t elsize) {
    (void)ctx;
    if (elsize != 0 && nelem > SIZE_MAX / elsize) return NULL;
    void *p = shm_arena_take(nelem * elsize);
    if (p == NULL) return calloc(nelem ? nelem : 1, elsize ? elsize : 1);
    memset(p, 0, nelem * elsize); /* a slot is reused: its bytes are not zero */
    return p;
}

static void *shm_arena_realloc(void *ctx, void *ptr, size_t new_size) {
    (void)ctx;
    shm_arena *a = ptr != NULL ? shm_arena_of(ptr) : NULL;
    if (a == NULL) return realloc(ptr, new_size ? new_size : 1);
    uint64_t old_size = a->exact ? (uint64_t)(a->hi - a->lo) : *(uint64_t *)((char *)ptr - SHM_ARENA_ALIGN);
    void *q = malloc(new_size ? new_size : 1); /* a resized block moves to the heap */
    if (q == NULL) return NULL;
    memcpy(q, ptr, old_size < new_size ? (size_t)old_size : new_size);
    shm_arena_give_back(a);
    return q;
}

static void shm_arena_free(void *ctx, void *ptr, size_t size) {
    (void)ctx;
    (void)size;
    if (ptr == NULL) return;
    shm_arena *a = shm_arena_of(ptr);
    if (a != NULL) {
        shm_arena_give_back(a);
    } else {
        free(ptr);
    }
}

/* The handler numpy calls while an arena is installed (and, for the arrays allocated then, ever
 * after: numpy frees an array's data through the handler that allocated it). */
static PyDataMem_Handler shm_arena_handler = {
    "shmloader_slot_arena",
    1,
    {NULL, shm_arena_malloc, shm_arena_calloc, shm_arena_realloc, shm_arena_free},
};

#endif /* SHMLOADER_ARENA_H */
