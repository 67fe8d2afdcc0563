"""How batches move: the transports compared, behind one interface.

========================  ========================================================================
``torch-pickle``          torch's DataLoader, the workload's numpy collate: batches are numpy,
                          pickled through the result pipe (the forum post's case).
``torch-shm``             torch's DataLoader, ``default_collate``: each batch is stacked into a
                          fresh torch shared-memory segment whose fd is passed to the main
                          process.
``torch-pickle-np``       torch's DataLoader, ``np_stack_collate`` (``np.stack``, per key for dict
                          samples: the numpy collate as users write it), pickled through the pipe.
                          For ``transport``/``small`` the workload's numpy collate is the same
                          ``np.stack``, so it runs what ``torch-pickle`` runs; it differs for
                          ``vision`` (labels and names stacked too).
``shmloader``             ``shmloader.ShmDataLoader``, ``default_collate``: collated into a ring
                          slot.
``shmloader-np``          ``shmloader.ShmDataLoader`` with the workload's numpy collate (for
                          seed001 the posted ``collate_fn``: the list of records comes back as
                          numpy views).
``shmloader-np-stack``    ``shmloader.ShmDataLoader`` with ``np_stack_collate``, the same function
                          object ``torch-pickle-np`` uses.
``shmloader-untimed``     ``shmloader`` with its stall diagnostics off (``SHMLOADER_TIMING=0``):
                          beside ``shmloader`` it measures what ``stats().timing`` costs (only
                          when named in ``--transports``).
``spdl-arena``            SPDL 0.8's shared-memory arena: one ``iterate_in_subprocess(...,
                          arena=SharedMemorySegmentPool(...))`` per worker, merged in torch's
                          order (:mod:`bench.spdl_arena`); ``np_stack_collate``, for seed001 the
                          posted collate. Skipped without workers, or where spdl is not installed.
``work-only``             no transport (seed001 and rows): the workload in forked workers with
                          torch's round-robin order and prefetch depth, each batch's records (the
                          posted collate: the list of samples) copied once into a
                          buffer the worker reuses and left there (:mod:`bench.work_only`): what
                          the machine gives the work at this process count, the reference that
                          shows what a transport costs.
``memcpy``                no loader: one copy of the batch's bytes between two preallocated
                          buffers in one process, on one core: the copy that no transport can
                          avoid.
``memcpy-Nc``             the same copy split over N threads (N = the machine's cores).
========================  ========================================================================

Mode transports (the ``epochs`` and ``rows`` workloads only; skipped, with the reason, where
``ShmDataLoader``'s signature does not take their argument, so the tables work before and after
the mode lands):

- ``shmloader-epoch-prefetch``: ``shmloader`` with ``prefetch_next_epoch=True`` (persistent
  workers start the next epoch's batches before its ``iter()``; ``shmloader`` drains, as torch);
- ``shmloader-rows``: ``shmloader`` with ``sample_parallel=True`` (the samples of one batch are
  spread over all workers);
- ``shmloader-rows-epoch-prefetch``: both (the epochs workload only).

A loader transport builds its loader from a :class:`~bench.workloads.Point`; ``memcpy`` is timed
by :func:`time_memcpy` instead.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch.utils.data

from .workloads import Point


@dataclass(frozen=True)
class Transport:
    name: str
    loader: str  # "torch" | "shmloader" | "spdl" | "work" | "memcpy"
    collate: str = "default"  # "numpy" | "default" | "np-stack" (see Point.collate)
    threads: int = 1  # memcpy only
    seed_collate: str | None = None  # seed001's collate where it differs from ``collate``
    timing: bool = True  # shmloader only: its stall diagnostics (SHMLOADER_TIMING)
    extra: tuple = ()  # ((name, value), ...): keyword arguments for the loader (a mode's switch)

    @property
    def is_loader(self) -> bool:
        return self.loader != "memcpy"

    def collate_for(self, p: Point) -> str:
        if p.workload == "seed001" and self.seed_collate:
            return self.seed_collate
        return self.collate


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def all_transports() -> dict[str, Transport]:
    n = cores()
    out = {
        "torch-pickle": Transport("torch-pickle", "torch", "numpy"),
        "torch-shm": Transport("torch-shm", "torch", "default"),
        "shmloader": Transport("shmloader", "shmloader", "default"),
        "shmloader-np": Transport("shmloader-np", "shmloader", "numpy"),
        "torch-pickle-np": Transport("torch-pickle-np", "torch", "np-stack"),
        "shmloader-np-stack": Transport("shmloader-np-stack", "shmloader", "np-stack"),
        "shmloader-untimed": Transport("shmloader-untimed", "shmloader", "default", timing=False),
        "spdl-arena": Transport("spdl-arena", "spdl", "np-stack", seed_collate="numpy"),
        "shmloader-epoch-prefetch": Transport("shmloader-epoch-prefetch", "shmloader", "default",
                                              extra=(("prefetch_next_epoch", True),)),
        "shmloader-rows": Transport("shmloader-rows", "shmloader", "default",
                                    extra=(("sample_parallel", True),)),
        "shmloader-rows-epoch-prefetch": Transport("shmloader-rows-epoch-prefetch", "shmloader", "default",
                                                   extra=(("sample_parallel", True), ("prefetch_next_epoch", True))),
        "work-only": Transport("work-only", "work", "numpy"),
        "memcpy": Transport("memcpy", "memcpy", threads=1),
    }
    if n > 1:
        out[f"memcpy-{n}c"] = Transport(f"memcpy-{n}c", "memcpy", threads=n)
    return out


def shmloader_status() -> tuple[bool, str]:
    """Whether ``shmloader.ShmDataLoader`` can be used, and why not."""
    try:
        import shmloader

        shmloader.ShmDataLoader  # noqa: B018
    except Exception as e:  # noqa: BLE001 - any import failure makes it unavailable
        return False, f"{type(e).__name__}: {e}"
    return True, getattr(shmloader, "__version__", "?")


def unaccepted_kwargs(t: Transport) -> list[str]:
    """The names of ``t.extra`` that ``ShmDataLoader`` does not take (by its signature: a mode
    not built yet in this shmloader). A bare ``**kwargs`` does not count as taking one."""
    if not t.extra:
        return []
    import inspect

    from shmloader import ShmDataLoader

    params = inspect.signature(ShmDataLoader).parameters
    return [k for k, _ in t.extra if k not in params]


def skip_reason(t: Transport, p: Point) -> str | None:
    """Why transport ``t`` cannot run point ``p`` on this machine (None: it can)."""
    if t.loader == "shmloader":
        ok, why = shmloader_status()
        if not ok:
            return f"shmloader not importable: {why}"
        missing = unaccepted_kwargs(t)
        if missing:
            ver = getattr(__import__("shmloader"), "__version__", "?")
            return (f"ShmDataLoader (shmloader {ver}) does not accept "
                    f"{', '.join(k + '=' for k in missing)}: mode not available in this build")
    if dict(t.extra).get("prefetch_next_epoch") and p.num_workers == 0:
        return "no workers: prefetch_next_epoch needs persistent workers"
    if t.loader == "work":
        if p.workload not in ("seed001", "rows"):
            return "seed001 and rows only: the workloads with a work bound"
        if p.num_workers == 0:
            return "no workers: the work bound is what the main process alone can do"
    if t.loader == "spdl":
        from .spdl_arena import spdl_status

        ok, why = spdl_status()
        if not ok:
            return why
        if p.num_workers == 0:
            return "no workers: SPDL's arena moves batches out of subprocesses"
    return None


def prepare(t: Transport) -> None:
    """What a transport needs running before a run counts this process's children."""
    if t.loader == "spdl":
        from .spdl_arena import start_quiet_resource_tracker

        start_quiet_resource_tracker()


def make_loader(t: Transport, p: Point, dataset=None):
    """The loader of transport ``t`` for point ``p`` (same dataset, batch size and workers).
    Pass ``dataset`` to share one dataset between runs (made once, outside the measurement)."""
    kw = p.loader_kwargs()
    kw["collate_fn"] = p.collate(t.collate_for(p))
    kw.update(dict(t.extra))
    ds = p.dataset() if dataset is None else dataset
    if t.loader == "torch":
        return torch.utils.data.DataLoader(ds, **kw)
    if t.loader == "shmloader":
        from shmloader import ShmDataLoader

        if t.timing:
            return ShmDataLoader(ds, **kw)
        saved = os.environ.get("SHMLOADER_TIMING")
        os.environ["SHMLOADER_TIMING"] = "0"  # read by the loader when it is made
        try:
            return ShmDataLoader(ds, **kw)
        finally:
            if saved is None:
                del os.environ["SHMLOADER_TIMING"]
            else:
                os.environ["SHMLOADER_TIMING"] = saved
    if t.loader == "spdl":
        from .spdl_arena import SpdlArenaLoader, segment_bytes_for

        kw.pop("persistent_workers", None)  # one epoch per run: nothing to persist
        return SpdlArenaLoader(
            ds, segment_bytes=segment_bytes_for(p.batch_bytes, leaves=p.batch_size + 3), **kw)
    if t.loader == "work":
        from .work_only import WorkOnlyLoader
        from .workloads import collate_fn as posted_collate

        kw["collate_fn"] = posted_collate  # the records: WorkOnlyLoader copies them once
        return WorkOnlyLoader(ds, **kw)
    raise ValueError(f"{t.name} is not a loader transport")


def close_loader(loader, iterator) -> None:
    """Stop the workers now rather than when the garbage collector gets to them."""
    close = getattr(loader, "close", None)
    if callable(close):
        close()
    for it in (iterator, getattr(loader, "_iterator", None)):
        shutdown = getattr(it, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()


def ring_info(loader) -> dict | None:
    """The ring from ``loader.stats()`` (shmloader only): ``ring_slots``, ``slot_bytes``,
    ``ring_bytes`` as reported, and ``max_ring_bytes`` = slots x slot bytes, what /dev/shm must
    hold once every slot exists."""
    stats = getattr(loader, "stats", None)
    if not callable(stats):
        return None
    try:
        s = stats()
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        return {"error": f"{type(e).__name__}: {e}"}
    if s is None:
        return None
    out = {}
    for k in ("ring_slots", "slot_bytes", "ring_bytes", "reserved_bytes", "held_bytes"):
        v = s.get(k) if isinstance(s, dict) else getattr(s, k, None)
        if v is not None:
            out[k] = v
    cb = s.get("control_bytes_per_batch") if isinstance(s, dict) else getattr(s, "control_bytes_per_batch", None)
    if cb is not None:
        out["control_bytes_per_batch"] = cb  # what crosses the sockets per batch: no array data
    if out.get("ring_slots") and out.get("slot_bytes"):
        out["max_ring_bytes"] = out["ring_slots"] * out["slot_bytes"]
    return out


def time_memcpy(nbytes: int, threads: int, min_seconds: float = 0.1, min_reps: int = 3) -> float:
    """Median seconds for one copy of ``nbytes`` between preallocated, already-faulted buffers,
    on one core or split over ``threads`` threads of a pool started beforehand."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    bounds = np.linspace(0, nbytes, threads + 1).astype(np.int64) // 64 * 64
    bounds[-1] = nbytes
    parts = [(dst[bounds[i] : bounds[i + 1]], src[bounds[i] : bounds[i + 1]]) for i in range(threads)]
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    try:

        def once() -> None:
            if pool is None:
                np.copyto(dst, src)
            else:
                for f in [pool.submit(np.copyto, d, s) for d, s in parts]:
                    f.result()

        once()  # warm: caches, page tables, threads
        times = []
        t_end = time.perf_counter() + min_seconds
        while len(times) < min_reps or (time.perf_counter() < t_end and len(times) < 1000):
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
    finally:
        if pool is not None:
            pool.shutdown()
    times.sort()
    return times[len(times) // 2]
