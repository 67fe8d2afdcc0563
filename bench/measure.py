"""Measuring one run: the clock, main-process CPU, time to first batch, peak memory, leftovers.

One run = build the loader, iterate ``warmup + batches`` batches through the point's consumer,
time the last ``batches`` of them (as the forum post does: wall time per iteration, the consumer's
step included), then shut the workers down and check that nothing was left behind.

- **s/batch**: wall time from the end of batch ``warmup - 1`` to the end of the last batch, over
  ``batches``. The first ``warmup`` batches drain what was prefetched during start-up, so the
  figure is the steady-state rate.
- **main-process CPU per batch**: ``getrusage(RUSAGE_SELF)`` (all threads of the main process)
  over the timed batches, minus the consumer's own CPU (``thread_time`` around it): what the
  loader costs the training process.
- **time to first batch**: from the loader's construction to the first batch in hand; and
  ``warmup_s``, from there to the end of the untimed batches (one-time costs land here).
- **peak memory**: from :mod:`bench.memwatch`, a separate process (so no thread lives in this one
  while workers fork) sampling PSS of this process and its descendants plus ``/dev/shm``.
"""

from __future__ import annotations

import gc
import json
import os
import re
import resource
import subprocess
import sys
import time

import numpy as np
import psutil
import torch

from . import stats
from .transports import Transport, close_loader, make_loader, prepare, ring_info, time_memcpy
from .workloads import SEED_STEP_S, Point

# ---------------------------------------------------------------------------------------------
# consumers


def leaves(obj):
    """The array leaves (numeric numpy arrays, torch tensors) of a nested batch. A numpy array of
    str or objects (``np.stack`` of names) is not one: ``default_collate`` leaves names a list of
    str, which no consumer reads either, so numpy and tensor batches are touched alike."""
    if isinstance(obj, torch.Tensor) or (isinstance(obj, np.ndarray) and obj.dtype.kind in "biufc"):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from leaves(v)


def _as_numpy(x) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else x


def touch(batch) -> float:
    """Read the first and the last element of every array leaf: proves the batch is there."""
    acc = 0.0
    for leaf in leaves(batch):
        a = _as_numpy(leaf).reshape(-1)
        if a.size:
            acc += float(a[0]) + float(a[-1])
    return acc


def read_all(batch) -> int:
    """Read every byte of every array leaf (a sum over 8-byte words where the size allows)."""
    acc = 0
    for leaf in leaves(batch):
        a = np.ascontiguousarray(_as_numpy(leaf)).reshape(-1).view(np.uint8)
        n8 = a.size // 8 * 8
        if n8:
            acc += int(a[:n8].view(np.uint64).sum(dtype=np.uint64))
        if a.size - n8:
            acc += int(a[n8:].sum())
    return acc


def step(batch) -> None:
    """seed001's train step: ``sleep(0.05)``, the batch untouched (as posted)."""
    time.sleep(SEED_STEP_S)


CONSUMERS = {"touch": touch, "read": read_all, "step": step}

# ---------------------------------------------------------------------------------------------
# memory watcher


class MemWatch:
    """Talks to ``python -m bench.memwatch <this pid>`` over its stdin/stdout."""

    def __init__(self, enabled: bool = True, min_pss_interval: float | None = None):
        self.proc = None
        if enabled:
            extra = [] if min_pss_interval is None else ["--min-pss-interval", str(min_pss_interval)]
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "bench.memwatch", str(os.getpid()), *extra],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            )

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def _ask(self, cmd: str) -> dict:
        assert self.proc is not None and self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench.memwatch (pid {self.proc.pid}) exited: {self.proc.poll()}")
        return json.loads(line)

    def start(self) -> None:
        if self.proc:
            self._ask("start")

    def stop(self) -> dict:
        return self._ask("stop") if self.proc else {}

    def close(self) -> None:
        if self.proc:
            try:
                self.proc.stdin.write("quit\n")  # type: ignore[union-attr]
                self.proc.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------------------
# leftovers


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def ours(names: set[str], pids: set[int]) -> list[str]:
    """The /dev/shm entries that our processes made. The machine may be shared, so a new entry
    counts as ours only where its name carries one of our pids as a token (torch's
    ``torch_<pid>_<random>_<n>`` do; shmloader's are unlinked at once and never seen here)."""
    want = {str(p) for p in pids}
    return sorted(n for n in names if want & set(re.split(r"[_.\-]", n)))


def other_cpu(exclude: set[int]) -> dict[int, tuple[int, int]]:
    """pid -> (start time, CPU ticks of it and of its reaped children) for every process not in
    ``exclude``. The difference between two snapshots is the CPU that other processes used in
    between (a process that came and went counts through its parent, once reaped).

    (``/proc/stat`` cannot be used for this: in a VM it also counts the hypervisor's page-fault
    work as busy time, which would blame our own page faults on someone else.)"""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in exclude:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                rest = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # after "pid (comm)": state=0 ppid=1 ... utime=11 stime=12 cutime=13 cstime=14 starttime=19
        out[int(name)] = (int(rest[19]), sum(int(x) for x in rest[11:15]))
    return out


def other_cpu_seconds(before: dict, after: dict) -> float:
    ticks = sum(a[1] - before[p][1] for p, a in after.items()
                if p in before and before[p][0] == a[0])
    return ticks / os.sysconf("SC_CLK_TCK")


def wait_quiet(limit_s: float, exclude: set[int], window_s: float = 0.5,
               busy_share: float = 0.1) -> float:
    """Wait, up to ``limit_s``, for a ``window_s`` in which other processes use less than
    ``busy_share`` of one core; returns the seconds waited. For shared machines."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        before = other_cpu(exclude)
        time.sleep(window_s)
        if other_cpu_seconds(before, other_cpu(exclude)) < busy_share * window_s:
            break
    return time.monotonic() - t0


def reap_children(keep: set[int], timeout: float = 10.0) -> list[int]:
    """Wait for the children this run started to exit; kill (by pid) any still there after
    ``timeout``. Returns the pids that had to be killed: a loader that does not stop its workers."""
    me = psutil.Process()
    deadline = time.monotonic() + timeout
    while True:
        left = [c for c in me.children(recursive=True) if c.pid not in keep]
        if not left:
            return []
        if time.monotonic() > deadline:
            killed = []
            for c in left:
                try:
                    c.kill()
                    killed.append(c.pid)
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(left, timeout=5)
            return killed
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------
# one run


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _begin_run(t: Transport, watch: MemWatch) -> tuple[set[int], set, set[int], dict[int, tuple[int, int]]]:
    """Before a timed run: the processes already there (not ours to count or reap), /dev/shm as
    it is, the memory watch started, and the other processes' CPU so far."""
    prepare(t)
    keep = {c.pid for c in psutil.Process().children(recursive=True)}
    shm_before = shm_entries()
    gc.collect()
    watch.start()
    skip = {os.getpid(), *keep}
    return keep, shm_before, skip, other_cpu(skip)


def run_loader(t: Transport, p: Point, watch: MemWatch, dataset=None) -> dict:
    """One timed run of loader transport ``t`` on point ``p``; returns the raw metrics.
    ``dataset`` (made beforehand, shared by the runs of a point) stays out of the memory figure."""
    consume = CONSUMERS[p.consumer]
    keep, shm_before, skip, others0 = _begin_run(t, watch)
    total = p.warmup + p.batches
    t0 = time.perf_counter()
    loader = make_loader(t, p, dataset)
    it = iter(loader)
    n = 0
    ttfb = ta = tb = None
    cpu_a = cpu_b = cons_cpu = 0.0
    ring = None
    pids = {os.getpid()}
    batch = None
    try:
        for batch in it:
            if n == 0:
                ttfb = time.perf_counter() - t0
                if t.loader == "shmloader":
                    ring = ring_info(loader)
                pids |= {c.pid for c in psutil.Process().children(recursive=True)} - keep
            c0 = time.thread_time()
            consume(batch)
            if n >= p.warmup:
                cons_cpu += time.thread_time() - c0
            n += 1
            if n == p.warmup:
                ta, cpu_a = time.perf_counter(), _cpu_self()
            if n >= total:
                now = time.perf_counter()
                if now - ta >= p.window_s or n >= p.warmup + p.max_batches:
                    tb, cpu_b = now, _cpu_self()
                    break
        del batch
        if ring is not None:
            ring = ring_info(loader) or ring  # after the run: the ring as it grew
        pids |= {c.pid for c in psutil.Process().children(recursive=True)} - keep
        mem = watch.stop()
    finally:
        owned = list(getattr(loader, "shm_names", ()))  # segments the loader names (spdl-arena)
        close_loader(loader, it)
        del it, loader
        gc.collect()
    killed = reap_children(keep)
    wall = time.perf_counter() - t0
    foreign = other_cpu_seconds(others0, other_cpu(skip))
    after = shm_entries()
    leaked_shm = sorted(set(ours(after - shm_before, pids)) | (set(owned) & after))
    if tb is None or ta is None:
        raise RuntimeError(f"{t.name} on {p.key}: the loader ended after {n} of {total} batches")
    timed = n - p.warmup
    s = (tb - ta) / timed
    out = {
        "s_per_batch": s,
        "gbps": p.batch_bytes / s / 1e9,
        "main_cpu_s_per_batch": max(0.0, (cpu_b - cpu_a - cons_cpu) / timed),
        "batches_timed": timed,
        "ttfb_s": ttfb,
        "warmup_s": ta - t0 - ttfb,  # first batch -> end of the untimed batches
        "peak_mem_bytes": mem.get("peak_mem_bytes"),
        "peak_shm_bytes": mem.get("peak_shm_bytes"),
        "max_procs": mem.get("max_procs"),
        # CPU seconds that processes outside this run used meanwhile (an upper bound: a reaped
        # child's whole life counts), and the run's wall time, to judge how quiet the machine was
        "foreign_cpu_s": foreign,
        "wall_s": wall,
    }
    if ring is not None:
        out["ring"] = ring
    if killed:
        out["killed_workers"] = killed
    if leaked_shm:
        out["leaked_shm"] = leaked_shm
    return out


# ---------------------------------------------------------------------------------------------
# the mode workloads (epochs, rows): their own loops, the same bookkeeping around them


def _run_driven(t: Transport, p: Point, watch: MemWatch, dataset, drive) -> dict:
    """Build ``t``'s loader for ``p``, call ``drive(loader, t0, note_children)`` (which iterates
    it and returns its metrics), then shut the workers down and check for leftovers, as
    :func:`run_loader` does. ``t0`` is when the loader is about to be made; ``drive`` calls
    ``note_children()`` once the workers exist (after a first batch)."""
    keep, shm_before, skip, others0 = _begin_run(t, watch)
    pids = {os.getpid()}

    def note_children() -> None:
        pids.update({c.pid for c in psutil.Process().children(recursive=True)} - keep)

    t0 = time.perf_counter()
    loader = make_loader(t, p, dataset)
    try:
        out = drive(loader, t0, note_children)
        ring = ring_info(loader) if t.loader == "shmloader" else None
        note_children()
        mem = watch.stop()
    finally:
        close_loader(loader, getattr(loader, "_iterator", None))
        del loader
        gc.collect()
    killed = reap_children(keep)
    out.update(
        peak_mem_bytes=mem.get("peak_mem_bytes"),
        peak_shm_bytes=mem.get("peak_shm_bytes"),
        max_procs=mem.get("max_procs"),
        pss_samples=mem.get("pss_samples"),  # few on a busy machine: between them, fast_samples
        fast_samples=mem.get("fast_samples"),  # (the last PSS + anonymous memory gained since)
        foreign_cpu_s=other_cpu_seconds(others0, other_cpu(skip)),
        wall_s=time.perf_counter() - t0,
    )
    leaked = sorted(set(ours(shm_entries() - shm_before, pids)))
    if ring is not None:
        out["ring"] = ring
    if killed:
        out["killed_workers"] = killed
    if leaked:
        out["leaked_shm"] = leaked
    return out


def run_epochs(t: Transport, p: Point, watch: MemWatch, dataset=None) -> dict:
    """``epochs``: one loader (persistent workers), ``params["epochs"]`` epochs of
    ``params["epoch_batches"]`` batches, a ``params["step_s"]`` sleep after each batch, as a
    ``for batch in loader`` loop runs them (the last batch is still held at the next ``iter()``).

    Per epoch: the wait for its first batch, from the ``iter()`` call to the batch in hand (the
    ``iter()`` included: that is where a loader that has not prefetched starts its workers), and
    the median wait in ``next()`` over batches ``steady_from``.. of the epoch. ``steady_wait_s``
    pools the steady waits of all epochs; ``boundary_ratio_eK`` = epoch K's first wait / it.
    ``first_batch_sums``: per epoch, the sum of element [0, 0] of each sample of its first batch
    (a sample is a function of its index): equal across transports = the same shuffled order."""
    prm = p.params
    n_epochs, per_epoch, step_s = prm["epochs"], prm["epoch_batches"], prm["step_s"]
    steady_from = prm["steady_from"]

    def drive(loader, t0, note_children) -> dict:
        first, steady_med, steady_all, epoch_s, sums = [], [], [], [], []
        batch = None
        for e in range(n_epochs):
            te = time.perf_counter()
            it = iter(loader)
            waits = []
            while True:
                t1 = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    break
                waits.append(time.perf_counter() - (te if not waits else t1))
                if len(waits) == 1:
                    sums.append(float(batch[:, 0, 0].sum()))
                    if e == 0:
                        note_children()
                time.sleep(step_s)  # the train step, the batch held (as a for loop holds it)
            epoch_s.append(time.perf_counter() - te)
            if len(waits) != per_epoch:
                raise RuntimeError(f"{t.name} on {p.key}: epoch {e + 1} gave {len(waits)} of "
                                   f"{per_epoch} batches")
            first.append(waits[0])
            steady_med.append(stats.median(waits[steady_from:]))
            steady_all += waits[steady_from:]
            del it
        del batch
        total = time.perf_counter() - t0
        steady = stats.median(steady_all)
        out = {
            "s_per_batch": total / (n_epochs * per_epoch),
            "total_s": total,
            "steady_wait_s": steady,
            "first_waits_s": first,
            "epoch_steady_waits_s": steady_med,
            "epoch_s": epoch_s,
            "first_batch_sums": sums,
        }
        for k, w in enumerate(first[:3], 1):
            out[f"first_wait_e{k}_s"] = w
            if k > 1 and steady > 0:
                out[f"boundary_ratio_e{k}"] = w / steady
        return out

    return _run_driven(t, p, watch, dataset, drive)


def run_rows(t: Transport, p: Point, watch: MemWatch, dataset=None) -> dict:
    """``rows``: ``warmup + batches`` batches, a ``params["step_s"]`` sleep after each.

    - ``first_batch_s``: from the ``iter()`` call to the first batch in hand;
    - ``s_per_batch``: the steady state as seed001 times it: the wall time of the ``batches``
      after the first ``warmup`` over their number (the mean of their per-batch times), the figure
      the work bound applies to;
    - ``median_s_per_batch``: the median of those per-batch times (end of the previous step to
      the end of its own). Batches come in bursts (workers that started together finish
      together), so the median can sit at the step time while the mean is above the bound: the
      median is not a throughput;
    - ``total_s``: from ``iter()`` to the end of the last batch's step."""
    step_s, total_n = p.params["step_s"], p.warmup + p.batches

    def drive(loader, t0, note_children) -> dict:
        ends: list[float] = []
        ttfb = None
        ti = time.perf_counter()
        it = iter(loader)
        for batch in it:
            if ttfb is None:
                ttfb = time.perf_counter() - ti
                note_children()
            time.sleep(step_s)
            del batch
            ends.append(time.perf_counter())
            if len(ends) == total_n:
                break
        del it
        if len(ends) < total_n:
            raise RuntimeError(f"{t.name} on {p.key}: the loader ended after {len(ends)} of "
                               f"{total_n} batches")
        per = [b - a for a, b in zip([ti, *ends[:-1]], ends)]
        timed = per[p.warmup:]
        mean = sum(timed) / len(timed)
        return {
            "s_per_batch": mean,
            "median_s_per_batch": stats.median(timed),
            "first_batch_s": ttfb,
            "ttfb_s": ttfb + (ti - t0),  # from the loader's construction, as the others
            "total_s": ends[-1] - ti,
            "gbps": p.batch_bytes / mean / 1e9,
            "batch_s": per,
        }

    return _run_driven(t, p, watch, dataset, drive)


def run_memcpy(t: Transport, p: Point) -> dict:
    s = time_memcpy(p.batch_bytes, t.threads)
    return {"s_per_batch": s, "gbps": p.batch_bytes / s / 1e9}


def run_once(t: Transport, p: Point, watch: MemWatch, dataset=None) -> dict:
    if p.workload == "epochs":
        return run_epochs(t, p, watch, dataset)
    if p.workload == "rows":
        return run_rows(t, p, watch, dataset)
    if t.is_loader:
        return run_loader(t, p, watch, dataset)
    return run_memcpy(t, p)


def seed_costs(items: str = "large", cores: int = 1) -> dict:
    """Measure seed001's per-batch work on this machine, for the work bound, in a fresh process.

    ``fetch_s``: 128 real ``sleep(0.003125)`` calls; ``compute_s``: 128 items of random numbers on
    one core, the best of 5 with freed memory kept by malloc (so reused, as a tuned worker's is:
    the page faults of fresh memory are not work that the experiment asks for); ``copy_s``: the
    best of 3 copies of the batch into memory already mapped. The child process keeps the malloc
    tuning away from this one, whose transports must run with the stock allocator.
    """
    out = subprocess.run(
        [sys.executable, "-m", "bench.measure", "--seed-costs", items],
        capture_output=True, text=True, check=True, timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    costs = json.loads(out.stdout.strip().splitlines()[-1])
    costs.update(step_s=SEED_STEP_S, cores=cores)
    return costs


def _seed_costs_here(items: str) -> dict:
    from .work_only import keep_freed_memory
    from .workloads import SEED_BATCH, SEED_FETCH_S, SEED_SHAPES

    keep_freed_memory()
    shape = SEED_SHAPES[items]
    t0 = time.perf_counter()
    for _ in range(SEED_BATCH):
        time.sleep(SEED_FETCH_S)
    fetch = time.perf_counter() - t0
    comp = []
    recs = None
    for _ in range(5):
        recs = None  # free the last batch first: a worker's memory is reused, not faulted anew
        c0 = time.thread_time()
        recs = [np.random.random(shape) for _ in range(SEED_BATCH)]
        comp.append(time.thread_time() - c0)
    out = np.empty((SEED_BATCH, *shape))
    out.fill(0)
    cp = []
    for _ in range(3):
        t1 = time.perf_counter()
        np.stack(recs, out=out)
        cp.append(time.perf_counter() - t1)
    return {"fetch_s": fetch, "compute_s": min(comp), "copy_s": min(cp)}


if __name__ == "__main__" and sys.argv[1:2] == ["--seed-costs"]:
    print(json.dumps(_seed_costs_here(sys.argv[2])))
