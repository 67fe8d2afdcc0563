"""SPDL as a peer: its shared-memory arena path, shaped like a DataLoader of W workers.

SPDL (``pip install spdl==0.8.0``, Meta's loader) moves numpy batches out of a subprocess fastest
with ``spdl.pipeline.iterate_in_subprocess(fn, arena=SharedMemorySegmentPool(...))``: the
subprocess runs ``fn()``'s iterable, copies each item's large numpy leaves (>= 4 KiB) into a
preallocated shared-memory segment of the pool (one item per segment, the pool rotating), and
puts a small pickle with markers on a queue; the main process turns the markers back into numpy
arrays that are zero-copy views of the segment, which goes back to the pool once they are gone.
One such arena connects one subprocess to the main process, so W workers are W of them::

    main process                                  worker k (one iterate_in_subprocess each)
    ------------                                  -----------------------------------------
    batches = BatchSampler(sampler, bs)           for idx in batches[k::W]:
    for i in 0, 1, 2, ...:                            batch = collate_fn([ds[j] for j in idx])
        yield next(worker[i % W])   <-- queue --      offload into pool k's next segment
              (numpy views of pool k)                 put the envelope (markers) on the queue

- **Order**: worker k makes batches k, k+W, k+2W, ... of the sampler's batches, as torch assigns
  them; the W iterators are merged round-robin, so the batches come in torch's order. For an
  ``IterableDataset`` each worker iterates its own copy (as torch's workers do) and cuts it into
  batches of ``batch_size``; ``torch.utils.data.get_worker_info()`` is set in each subprocess
  (SPDL does not; the bench does, so that a dataset that shards itself on it shards alike), and
  numpy's, ``random``'s and torch's generators are seeded per worker (``seed + k``).
- **Prefetch**: ``buffer_size = prefetch_factor`` items per worker (torch's per-worker
  in-flight limit) and ``prefetch_factor + 2`` segments per pool (the queued ones, the one being
  written and the one the training loop holds). SPDL starts a subprocess's iteration at that
  iterator's first ``next()``; so that all W start at ``iter()`` as torch's workers do, each
  first ``next()`` runs in a short-lived thread started by ``iter()``.
- **Teardown**: spdl 0.8.0 gives the iterable no public ``close()``; its teardown (ABORT to the
  worker, join, close and unlink the pool) is a ``multiprocessing.util.Finalize`` that runs when
  the iterable is collected. :meth:`SpdlArenaLoader.close` closes the iterators and drops the
  iterables, which runs it (the training loop must have let go of the batches first).

No workers (``num_workers=0``) means no subprocess and no arena: that case is not SPDL's.
"""

from __future__ import annotations

import functools
import itertools
import os
import random
import sys
import threading
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import BatchSampler, IterableDataset, SequentialSampler

PAGE = 4096
JOIN_TIMEOUT_S = 60.0  # longest wait, at close, for a worker's first batch
ARENA_ALIGN = 64  # spdl 0.8.0 places each offloaded leaf at a 64-byte-aligned offset


def spdl_status() -> tuple[bool, str]:
    """Whether SPDL's arena path can be used here, and its version or why not."""
    try:
        from importlib.metadata import version

        from spdl.pipeline import SharedMemorySegmentPool, iterate_in_subprocess  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure makes it unavailable
        return False, (f"spdl not importable ({type(e).__name__}: {e}); install it with "
                       "`pip install spdl==0.8.0`")
    try:
        return True, version("spdl")
    except Exception:  # noqa: BLE001 - installed without metadata
        return True, "?"


def segment_bytes_for(batch_bytes: int, leaves: int) -> int:
    """A pool segment that holds one batch: its array bytes, each leaf's alignment, and 1 MiB
    for what the estimate leaves out (string arrays), rounded to pages. The segments are created
    with ``ftruncate`` only, so the headroom costs address space, not memory."""
    n = batch_bytes + ARENA_ALIGN * (leaves + 1) + (1 << 20)
    return (n + PAGE - 1) // PAGE * PAGE


def start_quiet_resource_tracker() -> None:
    """Start Python's resource tracker (if it is not running) with its stderr discarded.

    ``SharedMemorySegmentPool`` creates its segments with ``SharedMemory(create=True)``, which
    starts the tracker as a child of this process: start it before a run counts its children, so
    that it is not taken for a worker left behind. Its stderr goes to /dev/null because spdl
    0.8.0 unregisters every segment twice when it unlinks it (``_attach`` unregisters, then
    ``SharedMemory.unlink`` does again), and the tracker prints a ``KeyError`` traceback for
    each. The bench checks that the pool's segments are gone itself (:attr:`SpdlArenaLoader.
    shm_names`)."""
    from multiprocessing import resource_tracker

    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        resource_tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


# ---------------------------------------------------------------------------------------------
# the worker side (module level: they are handed to the subprocess)


class WorkerBatches:
    """What worker ``k`` of ``W`` yields: its share of the batches, collated. Re-iterable."""

    def __init__(self, dataset, batches: list | None, batch_size: int, collate_fn: Callable,
                 drop_last: bool = False):
        self.dataset = dataset
        self.batches = batches  # index lists of a map-style dataset; None: an iterable one
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.drop_last = drop_last  # iterable datasets (map-style: in ``batches`` already)

    def __iter__(self):
        ds, collate = self.dataset, self.collate_fn
        if self.batches is None:
            it = iter(ds)
            while chunk := list(itertools.islice(it, self.batch_size)):
                if self.drop_last and len(chunk) < self.batch_size:
                    return
                yield collate(chunk)
            return
        getitems = getattr(ds, "__getitems__", None)
        for idx in self.batches:
            yield collate(getitems(idx) if getitems else [ds[i] for i in idx])


def make_worker_batches(dataset, batches, batch_size, collate_fn, drop_last) -> WorkerBatches:
    return WorkerBatches(dataset, batches, batch_size, collate_fn, drop_last)


def init_worker(worker_id: int, num_workers: int, seed: int, dataset) -> None:
    """Seed the generators and set torch's worker info, as torch's worker loop does."""
    from torch.utils.data._utils import worker as torch_worker

    s = seed + worker_id
    random.seed(s)
    torch.manual_seed(s)
    np.random.seed(s % (1 << 32))
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=worker_id, num_workers=num_workers, seed=s, dataset=dataset)


# ---------------------------------------------------------------------------------------------
# the main side


class SpdlArenaLoader:
    """W ``iterate_in_subprocess(..., arena=SharedMemorySegmentPool(...))``, merged in order.

    ``segment_bytes`` must hold one batch's offloaded leaves (see :func:`segment_bytes_for`); a
    larger batch fails in the worker with SPDL's ``BufferError`` ("unit exceeds segment_size").
    """

    def __init__(self, dataset, *, batch_size: int, num_workers: int, collate_fn: Callable,
                 segment_bytes: int, sampler=None, drop_last: bool = False,
                 prefetch_factor: int = 2, seed: int | None = None,
                 mp_context: str | None = None, timeout: float | None = None):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 (SPDL's arena moves batches out of "
                             f"subprocesses), got {num_workers}")
        if prefetch_factor < 1:
            raise ValueError(f"prefetch_factor must be >= 1, got {prefetch_factor}")
        if segment_bytes < 1:
            raise ValueError(f"segment_bytes must be >= 1, got {segment_bytes}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.segment_bytes = segment_bytes
        self.sampler = sampler
        self.drop_last = drop_last
        self.prefetch_factor = prefetch_factor
        if seed is None:  # as torch draws its workers' base seed
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
        self.seed = seed
        self.mp_context = mp_context
        self.timeout = timeout
        self._subs: list = []
        self._gens: list = []
        self._merged = None
        self.shm_names: list[str] = []  # every pool segment made so far (/dev/shm names)

    def _shares(self) -> list[list | None]:
        if isinstance(self.dataset, IterableDataset):
            return [None] * self.num_workers
        sampler = self.sampler if self.sampler is not None else SequentialSampler(self.dataset)
        batches = list(BatchSampler(sampler, self.batch_size, self.drop_last))
        return [batches[k::self.num_workers] for k in range(self.num_workers)]

    def __iter__(self) -> Iterator:
        from spdl.pipeline import SharedMemorySegmentPool, iterate_in_subprocess

        self.close()  # one epoch at a time, as a non-persistent DataLoader
        try:
            self._start(SharedMemorySegmentPool, iterate_in_subprocess)
        except BaseException:
            self.close()  # the workers started so far
            raise
        self._gens = [iter(s) for s in self._subs]
        self._merged = self._merge(self._gens)
        return self._merged

    def _start(self, SharedMemorySegmentPool, iterate_in_subprocess) -> None:  # noqa: N803
        W = self.num_workers
        for k, share in enumerate(self._shares()):
            pool = SharedMemorySegmentPool(self.segment_bytes, self.prefetch_factor + 2)
            state = pool.__getstate__()  # its names, as it pickles itself for the subprocess
            self.shm_names += [state["ctrl_name"], *state["seg_names"]]
            self._subs.append(iterate_in_subprocess(
                functools.partial(make_worker_batches, self.dataset, share, self.batch_size,
                                  self.collate_fn, self.drop_last),
                buffer_size=self.prefetch_factor,
                initializer=functools.partial(init_worker, k, W, self.seed, self.dataset),
                mp_context=self.mp_context,
                timeout=self.timeout,
                arena=pool,
            ))

    def _merge(self, gens: list) -> Iterator:
        # start every worker at once: each one's first next() in a thread of its own
        firsts: list = [None] * len(gens)

        def first(k: int) -> None:
            try:
                firsts[k] = ("item", next(gens[k]))
            except StopIteration:
                firsts[k] = ("end", None)
            except BaseException as e:  # noqa: BLE001 - raised in the main thread below
                firsts[k] = ("error", e)

        threads = [threading.Thread(target=first, args=(k,), daemon=True,
                                    name=f"spdl-arena-start-{k}") for k in range(len(gens))]
        for t in threads:
            t.start()
        active = list(range(len(gens)))
        pending = set(active)  # workers whose first batch is still with its thread
        pos = 0  # position in ``active`` of the worker whose batch comes next
        try:
            while active:
                k = active[pos]
                if k in pending:
                    pending.discard(k)
                    threads[k].join()
                    kind, item = firsts[k]
                    firsts[k] = None
                    if kind == "error":
                        raise item
                    if kind == "end":
                        item = StopIteration
                else:
                    item = next(gens[k], StopIteration)
                if item is StopIteration:  # torch goes on with the workers that still have data
                    active.pop(pos)
                    pos = pos % len(active) if active else 0
                    continue
                yield item
                del item
                pos = (pos + 1) % len(active)
        finally:
            # a worker still making its first batch: let it finish before its iterator closes
            for t in threads:
                t.join(JOIN_TIMEOUT_S)
            firsts.clear()

    def close(self) -> None:
        """Stop the subprocesses and unlink the pools (SPDL's own teardown, see above)."""
        merged, self._merged = self._merged, None
        if merged is not None:
            merged.close()  # joins the start-up threads
        gens, self._gens = self._gens, []
        for g in gens:
            try:
                g.close()
            except ValueError:  # still running in a start-up thread that did not finish
                pass
        del gens
        self._subs = []  # the last reference: Finalize -> ABORT, join, pool close + unlink
