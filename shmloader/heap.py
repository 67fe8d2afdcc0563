"""The C heap of a worker process: glibc's malloc tuned for datasets that make large arrays.

A worker's samples and batches are large arrays.  glibc returns freed memory of more than 128
KiB to the OS at once (munmap, trimming), and the page faults of touching it again cost more than
making the samples (FACTS.md), so workers keep it (`keep_freed_memory`), whatever its size.  Once a worker fetches
its samples into slots (NOTE [ Samples born in the slot ] in samples_in_slot.py, "The heap it
no longer needs") the heap no longer needs a batch's worth, and `release_free_memory` gives what
it holds back.
"""

from __future__ import annotations

import os


def _libc():
    import ctypes

    return ctypes.CDLL(None)


def keep_freed_memory() -> None:
    """Make glibc keep freed memory in this worker instead of returning it to the OS.

    A dataset that builds each sample in a fresh array (np.random.random, decoding into a new
    buffer) otherwise mmaps and munmaps every array of more than 128 KiB, and the page faults of
    re-touching that memory cost more than the samples themselves (FACTS.md).  With a 32 MiB mmap
    threshold and no trimming, a worker's second batch reuses the first batch's memory.  glibc
    mmaps afresh whatever is above that threshold, and 32 MiB is the highest it takes: the
    temporaries of a collate_fn that converts a batch of 32 MiB or more (`astype`'s result under
    `/ 255`, `x - mean` under `/ std`) were mapped and faulted in at every batch, 36.8 MiB of
    them costing a 2-worker loop 40% of its time (README, "Collates that convert").  So no
    allocation is mmapped (M_MMAP_MAX 0; glibc still does where the heap cannot grow): the
    worker keeps the memory its largest batch needed, for the next.  Off with
    SHMLOADER_KEEP_FREED_MEMORY=0.
    """
    if os.environ.get("SHMLOADER_KEEP_FREED_MEMORY", "1") == "0":
        return
    try:
        libc = _libc()
        m_trim_threshold, m_mmap_threshold, m_mmap_max = -1, -3, -4
        libc.mallopt(m_mmap_threshold, 32 * 1024 * 1024)
        libc.mallopt(m_trim_threshold, 2**31 - 1)
        libc.mallopt(m_mmap_max, 0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


def release_free_memory() -> None:
    """Give the free memory the heap keeps back to the OS (glibc's malloc_trim), once the worker
    no longer needs it; nothing where the C library is not glibc."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass
