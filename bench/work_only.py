"""The work with no transport: what the machine gives seed001 in ``w`` worker processes.

The work bound (``stats.seed_work_bound``) takes one quiet process's costs and assumes that ``w``
workers share the cores perfectly. On a 2-core machine, 6 or 8 processes that make random
numbers side by side each spend more CPU per item than one quiet process does (caches, context
switches), so no loader can reach that bound. ``WorkOnlyLoader`` measures what they can reach:
the same dataset, batch size, collate and prefetch depth as torch's DataLoader, in ``w`` forked
workers taking batches in torch's round-robin order, each batch copied once into a buffer that
the worker reuses (the one copy the bound counts), with malloc keeping freed memory for reuse as
the bound's costs were measured. The batch itself never leaves the worker: the
main process gets the batch's index (8 bytes through a pipe), so the transport costs nothing.

A loader's s/batch over this one's is what its transport and main process cost, on this machine
and at this process count. It is a reference for seed001 only (its collate returns a list of
equal arrays, or an array), not a loader.
"""

from __future__ import annotations

import multiprocessing
import struct

import numpy as np
from torch.utils.data import IterableDataset

_INDEX = struct.Struct("<q")
_END = -1  # a worker's dataset (map-style) has no more batches for it
_ERROR = -2  # followed by the worker's exception, as text


def _as_arrays(batch) -> list[np.ndarray]:
    arrays = [batch] if isinstance(batch, np.ndarray) else list(batch)
    if not arrays or not all(isinstance(a, np.ndarray) and a.shape == arrays[0].shape
                             and a.dtype == arrays[0].dtype for a in arrays):
        raise TypeError("WorkOnlyLoader copies a batch that is an array or a list of arrays of "
                        f"one shape and dtype; got {type(batch).__name__}")
    return arrays


def _copy_once(batch, out: np.ndarray | None) -> np.ndarray:
    """Copy the batch's bytes into ``out`` (made, and faulted, the first time only)."""
    arrays = _as_arrays(batch)
    shape = (len(arrays), *arrays[0].shape)
    if out is None or out.shape != shape or out.dtype != arrays[0].dtype:
        out = np.empty(shape, arrays[0].dtype)
        out.fill(0)  # fault it now: a reused buffer's pages are mapped already
    np.stack(arrays, out=out)
    return out


def keep_freed_memory() -> None:
    """Make glibc's malloc keep freed memory for reuse (M_TRIM_THRESHOLD, M_MMAP_THRESHOLD): the
    work bound counts a worker's memory as reused, not faulted in anew for every item."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-1, 1 << 30)
    libc.mallopt(-3, 32 << 20)


def _worker(worker_id, num_workers, dataset, batch_size, collate_fn, credits, conn) -> None:
    keep_freed_memory()  # as the bound's costs were measured (bench.measure.seed_costs)
    try:
        _make_batches(worker_id, num_workers, dataset, batch_size, collate_fn, credits, conn)
    except Exception as e:  # noqa: BLE001 - reported to the main process, which raises it
        conn.send_bytes(_INDEX.pack(_ERROR) + f"{type(e).__name__}: {e}".encode())


def _make_batches(worker_id, num_workers, dataset, batch_size, collate_fn, credits, conn) -> None:
    out = None
    if isinstance(dataset, IterableDataset):  # every worker iterates its own copy, as in torch
        items = iter(dataset)
        while True:
            credits.acquire()
            records = []
            for _ in range(batch_size):
                try:
                    records.append(next(items))
                except StopIteration:
                    break
            if not records:
                conn.send_bytes(_INDEX.pack(_END))
                return
            out = _copy_once(collate_fn(records), out)
            conn.send_bytes(_INDEX.pack(0))
    n = len(dataset)
    for k in range(worker_id, (n + batch_size - 1) // batch_size, num_workers):
        credits.acquire()
        records = [dataset[i] for i in range(k * batch_size, min(n, (k + 1) * batch_size))]
        out = _copy_once(collate_fn(records), out)
        conn.send_bytes(_INDEX.pack(k))
    credits.acquire()
    conn.send_bytes(_INDEX.pack(_END))


class WorkOnlyLoader:
    """Iterating yields the index of each batch made (module docstring); ``close()`` stops the
    workers. Takes DataLoader's arguments; those it has no use for are ignored."""

    def __init__(self, dataset, batch_size=1, num_workers=0, collate_fn=None, prefetch_factor=2,
                 **_ignored):
        if num_workers < 1:
            raise ValueError(f"WorkOnlyLoader needs num_workers >= 1, got {num_workers}")
        if collate_fn is None:
            raise ValueError("WorkOnlyLoader needs the workload's collate_fn")
        self.dataset, self.batch_size, self.num_workers = dataset, batch_size, num_workers
        self.collate_fn, self.prefetch_factor = collate_fn, prefetch_factor
        self._procs: list = []
        self._conns: list = []

    def __iter__(self):
        self.close()
        ctx = multiprocessing.get_context("fork")
        credits = [ctx.Semaphore(self.prefetch_factor) for _ in range(self.num_workers)]
        for w in range(self.num_workers):
            receiver, sender = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, daemon=True, args=(
                w, self.num_workers, self.dataset, self.batch_size, self.collate_fn,
                credits[w], sender))
            p.start()
            sender.close()
            self._procs.append(p)
            self._conns.append(receiver)
        return self._batches(credits)

    def _batches(self, credits):
        k = 0
        while True:
            w = k % self.num_workers
            try:
                message = self._conns[w].recv_bytes()
            except EOFError:
                raise RuntimeError(f"work-only worker {w} exited "
                                   f"(exit code {self._procs[w].exitcode})") from None
            (got,) = _INDEX.unpack_from(message)
            if got == _ERROR:
                raise RuntimeError(f"work-only worker {w}: {message[_INDEX.size:].decode()}")
            if got == _END:
                return
            credits[w].release()  # as torch sends worker w its next task
            yield k
            k += 1

    def close(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(timeout=10)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []

    def __del__(self):
        self.close()
