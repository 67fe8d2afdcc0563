/* shmloader slot arena: numpy's data allocator (NEP 49) pointed at a ring slot while a worker runs
 * the user's collate_fn, so that the batch's large arrays (np.stack, np.concatenate, np.empty
 * then fill, ...) are born in the slot and need no second copy.
 *
 * An arena is a stack allocator over [lo, hi) of one mapped slot segment.  Blocks are 64-byte
 * aligned and carry a 64-byte prefix (`shm_block`: their size, which numpy's realloc does not
 * pass, the cursor before them, the block below, whether freed):
 *
 *   lo ... | prefix | block (64-aligned) ... | prefix | block ... | cursor ...... hi
 *
 * A freed block is space again once every block above it is freed too: freeing the top block
 * takes the cursor back below it and below the freed blocks under it.  So the temporaries of a
 * collate_fn (np.stack's result of uint8 samples, then `.astype(np.float32) / 255`) leave room
 * for what it makes next, as on the heap, and the batch it returns can be born in the slot.
 * `want` is how far the cursor would have gone had every request fitted: a slot that size
 * holds all of the collate_fn's large arrays (shmloader/worker.py may grow the slot to it).
 *
 * While an arena is open (only around the collate call, in the worker's main thread, through a
 * context-local numpy handler) requests of at least `min_bytes` that fit come from it; smaller
 * ones, those that do not fit, and every request of other threads or after closing go to the C
 * heap.  A freed block below a live one is lost space in the slot until the live one goes.
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
    struct shm_block *top; /* the block handed out last and not popped, or NULL */
    uint64_t want;         /* bytes past lo the cursor would reach had every request fitted */
    uint64_t min_bytes;
    int exact;        /* one block, [lo, hi) exactly, no size prefix */
    int64_t live;     /* blocks handed out and not yet freed */
    int open;         /* handing out blocks (only while the collate_fn runs) */
    int released;     /* the worker is done with it: freed when `live` drops to 0 */
    PyObject *owner;  /* the segment, referenced while the arena exists */
    struct shm_arena *next;
} shm_arena;

typedef struct shm_block { /* the 64-byte prefix of a block */
    uint64_t size;
    char *before;           /* the cursor before the block was taken */
    struct shm_block *below; /* the arena's top block then */
    uint64_t freed;
    char pad[SHM_ARENA_ALIGN - 32];
} shm_block;

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
    uint64_t end = (uint64_t)(block - a->lo) + (uint64_t)size;
    if (end > a->want) a->want = end;
    if (block > a->hi || size > (size_t)(a->hi - block)) return NULL;
    shm_block *prefix = (shm_block *)(block - SHM_ARENA_ALIGN);
    prefix->size = (uint64_t)size;
    prefix->before = a->cursor;
    prefix->below = a->top;
    prefix->freed = 0;
    a->top = prefix;
    a->cursor = block + size;
    a->live++;
    return block;
}

static inline void shm_arena_give_back(shm_arena *a) {
    a->live--;
    if (a->live == 0 && a->released) shm_arena_unlink_and_free(a);
}

/* Block `p` of arena `a` is freed: popped with the freed blocks under it if it is the top. */
static inline void shm_arena_free_block(shm_arena *a, void *p) {
    if (!a->exact) {
        shm_block *prefix = (shm_block *)((char *)p - SHM_ARENA_ALIGN);
        prefix->freed = 1;
        while (a->top != NULL && a->top->freed) {
            a->cursor = a->top->before;
            a->top = a->top->below;
        }
    }
    shm_arena_give_back(a);
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
    uint64_t old_size = a->exact ? (uint64_t)(a->hi - a->lo) : ((shm_block *)((char *)ptr - SHM_ARENA_ALIGN))->size;
    void *q = malloc(new_size ? new_size : 1); /* a resized block moves to the heap */
    if (q == NULL) return NULL;
    memcpy(q, ptr, old_size < new_size ? (size_t)old_size : new_size);
    shm_arena_free_block(a, ptr);
    return q;
}

static void shm_arena_free(void *ctx, void *ptr, size_t size) {
    (void)ctx;
    (void)size;
    if (ptr == NULL) return;
    shm_arena *a = shm_arena_of(ptr);
    if (a != NULL) {
        shm_arena_free_block(a, ptr);
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
