"""The clocks behind `loader.stats().timing`: where the time goes, recorded without messages.

NOTE [ Stage clocks ]
  Each worker owns one STATUS_BLOCK_BYTES block of the status segment (created by the main
  process, shared with the workers at start-up; protocol.py's `status_offset` gives its offset), a
  row of int64 words:

      word  0  stage        the stage the worker is in (an index into protocol.STAGES)
            1  batch        the batch it is for, or -1
            2  since_ns     CLOCK_MONOTONIC when it entered that stage (0: not started)
            3  batches      batches begun (entries into "fetching")
            4  timed        1 if the worker accumulates times (the main process writes it)
            5  cpu0_ns      the worker thread's CPU time when it first became idle (start-up
                            excluded), -1 if unknown
            6  delay0_ns    its run-queue delay (/proc schedstat) at the same moment, -1 if unknown
            7  (spare)
         8..31 stage_ns     nanoseconds spent in each stage so far (the current one excluded)

  Words 0 and 1 are what a death report reads (worker.describe_stage).  On each change of stage
  the worker adds `now - since_ns` to the stage it leaves and stores the new stage and
  `since_ns = now` (StageClock in csrc/_ring.pyx, where the block's struct is declared): a
  clock read and a few stores in C, tens of nanoseconds, on a handful of stage changes per
  batch.  The main process reads the blocks only when `stats()` is called
  (CLOCK_MONOTONIC is system-wide, so it adds the current stage's time so far itself) and reads
  each worker's CPU time and run-queue delay from /proc/<pid>/schedstat then, so the worker
  pays nothing for those.  Reads race with the writes; a figure may be off by the stage being
  entered at that instant, never torn (aligned 8-byte words).  Blocks are 256 bytes apart, so no
  two workers write the same cache line.

  The training loop's side is BatchClock: two clock reads around each next() (the wait) and the
  time between one next()'s return and the next call (the step), kept as running sums plus the
  last WINDOW batches in fixed arrays, so a long run allocates nothing.

SHMLOADER_TIMING=0 (read when the ShmDataLoader is created) turns both off: no clock is read,
and the workers store only their stage and batch, as before.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from array import array

from . import _ring

# The block's words, as csrc/_ring.pyx's `stage_block` lays them out.
STATUS_BLOCK_WORDS = 32
STATUS_BLOCK_BYTES = _ring.STATUS_BLOCK_BYTES
W_STAGE, W_BATCH, W_SINCE, W_BATCHES, W_TIMED, W_CPU0, W_DELAY0 = range(7)
W_STAGE_NS = 8
MAX_STAGES = _ring.MAX_STAGES
assert STATUS_BLOCK_BYTES == 8 * STATUS_BLOCK_WORDS and MAX_STAGES == STATUS_BLOCK_WORDS - W_STAGE_NS
_BLOCK = struct.Struct(f"<{STATUS_BLOCK_WORDS}q")

WINDOW = 1024  # per-batch figures kept for percentiles and plots (the latest WINDOW batches)
_MASK = WINDOW - 1  # WINDOW is a power of two


def timing_enabled() -> bool:
    """False when SHMLOADER_TIMING=0."""
    return os.environ.get("SHMLOADER_TIMING", "1") != "0"


def _schedstat(path: str) -> tuple[int, int] | None:
    """(CPU ns, run-queue delay ns) of one thread from /proc, or None where the kernel has none."""
    try:
        with open(path, "rb") as f:
            cpu, delay, *_ = f.read().split()
        return int(cpu), int(delay)
    except (OSError, ValueError):
        return None


# -- the worker's side --------------------------------------------------------------------------


def stage_clock(segment, offset: int, idle: int, fetching: int) -> _ring.StageClock:
    """A worker's writer of its block (NOTE [ Stage clocks ]; in C: csrc/_ring.pyx)."""
    return _ring.StageClock(segment, offset, idle, fetching, _record_baseline)


def _record_baseline(clock: _ring.StageClock) -> None:
    """Start-up is over (the worker is idle for the first time): its CPU counts from here."""
    if clock.timed:
        got = _schedstat("/proc/thread-self/schedstat")
        clock.set_baseline(*(got if got else (time.thread_time_ns(), -1)))


def init_block(segment, offset: int, stage: int, timed: bool) -> None:
    """The main process's first words for a worker that has not started yet."""
    words = [0] * STATUS_BLOCK_WORDS
    words[W_STAGE], words[W_BATCH], words[W_TIMED] = stage, -1, int(timed)
    words[W_CPU0] = words[W_DELAY0] = -1
    segment.write(offset, _BLOCK.pack(*words))


# -- the main process's side ----------------------------------------------------------------------


def read_block(segment, offset: int, pid: int | None, now_ns: int | None = None) -> dict:
    """One worker's figures: {"batches", "stage_ns": [ns per stage, the current one included],
    "cpu_ns", "run_queue_ns" (since start-up; None where unknown)}."""
    words = _BLOCK.unpack(segment.read(offset, STATUS_BLOCK_BYTES))
    stage_ns = list(words[W_STAGE_NS:])
    since = words[W_SINCE]
    if since and 0 <= words[W_STAGE] < MAX_STAGES:
        now = time.monotonic_ns() if now_ns is None else now_ns
        stage_ns[words[W_STAGE]] += max(0, now - since)
    cpu = delay = None
    if pid is not None and words[W_CPU0] >= 0:
        got = _schedstat(f"/proc/{pid}/schedstat")
        if got is not None:
            cpu = max(0, got[0] - words[W_CPU0])
            if words[W_DELAY0] >= 0:
                delay = max(0, got[1] - words[W_DELAY0])
    return {"batches": words[W_BATCHES], "stage_ns": stage_ns, "cpu_ns": cpu,
            "run_queue_ns": delay, "timed": bool(words[W_TIMED])}


class BatchClock:
    """The training loop's side: how long each next() waited and how long the loop took between
    next() calls.  The first batch of each epoch (start-up, the ring's first slots) is kept apart
    from the steady-state figures."""

    __slots__ = ("enabled", "waits", "steps", "batches", "wait_ns", "step_ns", "nsteps",
                 "startup_ns", "startups", "_last", "_first", "created_ns", "created_cpu_ns",
                 "_schedstat", "created_delay_ns", "ready", "ready_wait_ns", "blocked")

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.waits = array("q", bytes(8 * WINDOW))
        self.steps = array("q", bytes(8 * WINDOW))
        self.batches = self.nsteps = 0
        self.wait_ns = self.step_ns = self.startup_ns = 0
        self.startups = 0
        # steady batches that had arrived before next() looked for them (its wait was then the
        # loader's own hand-over, not the workers'); `blocked` is set by the loader when next()
        # polls for a batch not there yet
        self.ready = self.ready_wait_ns = 0
        self.blocked = False
        self._last = 0  # when the last next() returned (0: none to measure a step from)
        self._first = True
        self.created_ns = time.monotonic_ns()
        self.created_cpu_ns = time.process_time_ns()
        # the training thread's run-queue delay: is the training process itself short of CPU?
        self._schedstat = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        got = _schedstat(self._schedstat)
        self.created_delay_ns = got[1] if got else -1

    def begin(self, _now=time.monotonic_ns) -> int:
        """At the start of next(): closes the step since the last one; returns the start."""
        if not self.enabled:
            return 0
        now = _now()
        if self._last:
            step = now - self._last
            self.steps[self.nsteps & _MASK] = step
            self.nsteps += 1
            self.step_ns += step
            self._last = 0
        self.blocked = False
        return now

    def end(self, start: int, _now=time.monotonic_ns) -> None:
        """When next() returns a batch that began at `start`."""
        if not start:
            return
        now = self._last = _now()
        wait = now - start
        if self._first:
            self._first = False
            self.startup_ns += wait
            self.startups += 1
        else:
            self.waits[self.batches & _MASK] = wait
            self.batches += 1
            self.wait_ns += wait
            if not self.blocked:
                self.ready += 1
                self.ready_wait_ns += wait

    def new_epoch(self) -> None:
        """The next batch is an epoch's first; the time until it is asked for is not a step."""
        self._first = True
        self._last = 0

    def run_queue_ns(self) -> int | None:
        """Nanoseconds the training thread waited for a CPU since this clock was made."""
        got = _schedstat(self._schedstat) if self.created_delay_ns >= 0 else None
        return None if got is None else max(0, got[1] - self.created_delay_ns)

    def recent(self) -> tuple[list[int], list[int]]:
        """(waits, steps) of the latest batches, oldest first (at most WINDOW of each)."""
        def unroll(values: array, n: int) -> list[int]:
            if n <= WINDOW:
                return list(values[:n])
            k = n % WINDOW
            return list(values[k:]) + list(values[:k])

        return unroll(self.waits, self.batches), unroll(self.steps, self.nsteps)


def available_cores() -> float:
    """CPUs this process may run on: its affinity mask, lowered by a cgroup (v2 or v1) CPU quota."""
    try:
        cores: float = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    quota = None
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            q, period = f.read().split()[:2]
        if q != "max":
            quota = int(q) / int(period)
    except (OSError, ValueError):
        try:
            with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
                q = int(f.read())
            with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
                period = int(f.read())
            if q > 0 and period > 0:
                quota = q / period
        except (OSError, ValueError):
            pass
    if quota is not None and quota < cores:
        cores = quota
    return cores
