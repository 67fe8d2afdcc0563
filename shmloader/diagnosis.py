"""Is the loader the bottleneck?  The figures of `loader.stats().timing`, the verdict, the table.

From the clocks of timing.py (NOTE [ Stage clocks ]): how long the training loop waited in
next() and how long it spent between calls (its step), and how each worker's time splits between
start-up, fetching, collating, waiting for a slot, writing and idling.  `assess` turns those into
a verdict in words:

  * **input-bound** when the loop waited at least INPUT_BOUND of its time, **compute-bound** below
    COMPUTE_BOUND, **balanced** between;
  * the workers that would keep up: a worker needs `B0` seconds per batch uncontended (its CPU
    time plus the time it blocked on I/O or sleep, i.e. its busy wall time less the time it sat in
    the run queue), the loop takes one batch every `T` seconds (its step; the loader's own part of
    next() is left out, a fraction of a millisecond), so about B0 / T workers keep up (HEADROOM more for the jitter) — unless the
    CPU runs out first: the workers need c / T cores (c: CPU seconds per batch) and have the
    machine's cores less what the training process itself uses; past that more workers only
    share the cores, so the suggestion stops at the count that fills them;
  * what else would help: workers idle while the loop waits (prefetch_factor too low) — unless
    most of the wait (READY_HANDOVER or more) was spent in next() calls whose batch had arrived
    before they looked for it: then the wait is the loader's own hand-over of a batch, which
    neither more workers nor a deeper prefetch shortens, and the step is short against it (the
    share of calls alone would not tell: workers in lockstep deliver batches in bunches, and all
    but the first of a bunch are there already); workers
    waiting for slots while the loop waits (slots scarce: a cap, or batches held), workers or the
    training process waiting for a CPU (more workers than the cores can take).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from .protocol import (
    AWAITING_SLOT,
    BOOTING,
    COLLATING,
    FETCHING,
    IDLE,
    INIT_FN,
    LAYING_OUT,
    STARTING,
    UNPICKLING,
    WRITING,
)
from .timing import BatchClock, available_cores

INPUT_BOUND = 0.10  # the loop waited at least this share of its time: input-bound
COMPUTE_BOUND = 0.05  # below this: compute-bound (between the two: balanced)
HEADROOM = 1.1  # workers suggested = ceil(needed × HEADROOM)
MIN_BATCHES = 5  # fewer steady-state batches than this: no verdict
IDLE_WHILE_WAITING = 0.25  # workers idle this much while the loop waits: prefetch_factor too low
SLOT_WAIT = 0.10  # workers waiting for a slot this much while the loop waits: slots are scarce
RUN_QUEUE = 0.25  # workers waiting for a CPU this share of their time: too few cores
MAIN_RUN_QUEUE = 0.05  # the training thread waiting for a CPU this share of the time: too many workers
READY_HANDOVER = 0.5  # this share of the wait in calls whose batch was there: the wait is the hand-over

# protocol.STAGES grouped as the table shows them
_GROUPS = {
    "starting": (BOOTING, UNPICKLING, INIT_FN, STARTING),
    "idle": (IDLE,),
    "fetching": (FETCHING,),
    "collating": (COLLATING, LAYING_OUT),
    "awaiting_slot": (AWAITING_SLOT,),
    "writing": (WRITING,),
}


@dataclass(frozen=True)
class WorkerTiming:
    """One worker's time since it started, in seconds per stage: fetching (dataset
    __getitem__/__iter__), collating (collate_fn and the layout), awaiting_slot (no free slot to
    write into), writing (the copy into the slot), idle (no task), starting (unpickling, init_fn,
    creating the dataset's iterator).  cpu_s / run_queue_s: the worker's CPU time and its time
    waiting for a CPU since start-up (None where /proc has no schedstat)."""

    worker_id: int
    batches: int
    fetching_s: float
    collating_s: float
    awaiting_slot_s: float
    writing_s: float
    idle_s: float
    starting_s: float
    cpu_s: float | None
    run_queue_s: float | None

    @property
    def busy_s(self) -> float:
        """Time working on batches: fetching + collating + writing."""
        return self.fetching_s + self.collating_s + self.writing_s

    @property
    def active_s(self) -> float:
        """Time since start-up ended: busy + awaiting a slot + idle."""
        return self.busy_s + self.awaiting_slot_s + self.idle_s


@dataclass(frozen=True)
class LoaderTiming:
    """Where the time goes (seconds; `*_fraction` in 0..1).  The training loop's figures leave
    out each epoch's first batch (start-up, in `startup_s`): `batches` next() calls waited
    `wait_s` in all, and the loop spent `step_s` between calls.  Percentiles are over the latest
    timing.WINDOW batches.  `main_cpu_fraction`: CPU the training process used per second since
    iter() (its own work included), `main_run_queue_fraction` the share of that time its thread
    waited for a CPU (None where unknown), `cores`: CPUs this process may use.  `bound` is "input",
    "compute", "balanced" or "unknown"; `suggested_workers` the workers that would keep up on
    this machine; `verdict` says it in words and `advice` lists what else would help.
    `ready_fraction`: the share of those next() calls whose batch had arrived before the call
    looked for it, and `ready_wait_s` their wait in all (the loader's own hand-over; both None
    from an older record)."""

    num_workers: int
    prefetch_factor: int
    cores: float
    batches: int
    startup_s: float
    wait_s: float
    step_s: float
    wait_fraction: float
    wait_p50_s: float
    wait_p90_s: float
    wait_max_s: float
    step_p50_s: float
    main_cpu_fraction: float
    main_run_queue_fraction: float | None
    workers: tuple[WorkerTiming, ...]
    bound: str
    suggested_workers: int | None
    verdict: str
    advice: tuple[str, ...]
    ready_fraction: float | None = None
    ready_wait_s: float | None = None

    @property
    def wait_per_batch_s(self) -> float:
        return self.wait_s / self.batches if self.batches else 0.0

    @property
    def step_per_batch_s(self) -> float:
        return self.step_s / self.batches if self.batches else 0.0

    def stage_fractions(self) -> dict[str, float]:
        """Each stage's share of the workers' time since start-up (all workers together)."""
        active = sum(w.active_s for w in self.workers)
        out = {}
        for name in ("fetching", "collating", "awaiting_slot", "writing", "idle"):
            total = sum(getattr(w, f"{name}_s") for w in self.workers)
            out[name] = total / active if active > 0 else 0.0
        return out

    def as_dict(self) -> dict:
        """Plain, JSON-ready values (LoaderTiming.from_dict rebuilds this object)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> LoaderTiming:
        values = dict(data)
        values["workers"] = tuple(WorkerTiming(**w) for w in values["workers"])
        values["advice"] = tuple(values["advice"])
        return cls(**values)

    def scalars(self, prefix: str = "loader/") -> dict[str, float]:
        """A flat dict of numbers to log each step (TensorBoard's add_scalar, wandb.log, a CSV row)."""
        out = {
            "wait_fraction": self.wait_fraction,
            "wait_ms_per_batch": 1e3 * self.wait_per_batch_s,
            "step_ms_per_batch": 1e3 * self.step_per_batch_s,
            "wait_p90_ms": 1e3 * self.wait_p90_s,
            "batches": float(self.batches),
            "num_workers": float(self.num_workers),
            "suggested_workers": float(self.suggested_workers or 0),
            "main_cpu_fraction": self.main_cpu_fraction,
        }
        out.update({f"workers_{k}_fraction": v for k, v in self.stage_fractions().items()})
        return {prefix + k: float(v) for k, v in out.items()}

    def __str__(self) -> str:
        return format_timing(self)


# -- from the clocks --------------------------------------------------------------------------------


def worker_timing(worker_id: int, raw: dict) -> WorkerTiming:
    """A WorkerTiming from timing.read_block's figures."""
    ns = raw["stage_ns"]
    group = {name: sum(ns[i] for i in stages) / 1e9 for name, stages in _GROUPS.items()}
    cpu, delay = raw.get("cpu_ns"), raw.get("run_queue_ns")
    return WorkerTiming(
        worker_id=worker_id, batches=raw["batches"],
        fetching_s=group["fetching"], collating_s=group["collating"],
        awaiting_slot_s=group["awaiting_slot"], writing_s=group["writing"],
        idle_s=group["idle"], starting_s=group["starting"],
        cpu_s=None if cpu is None else cpu / 1e9,
        run_queue_s=None if delay is None else delay / 1e9,
    )


def _quantile(values: list[int], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e9


def diagnose(clock: BatchClock, workers: list[WorkerTiming], prefetch_factor: int,
             now_ns: int, now_cpu_ns: int, cores: float | None = None) -> LoaderTiming:
    """The LoaderTiming of a loader from its BatchClock and its workers' figures."""
    waits, steps = clock.recent()
    queued = clock.run_queue_ns()
    elapsed = max(1, now_ns - clock.created_ns)
    cores = available_cores() if cores is None else cores
    wait_s = clock.wait_ns / 1e9
    # Each epoch has one step more than timed batches (the one after its first batch, which is
    # start-up): scale the steps to one per timed batch.
    step_s = clock.step_ns / 1e9 * (clock.batches / clock.nsteps if clock.nsteps else 0.0)
    figures = dict(
        num_workers=len(workers), prefetch_factor=prefetch_factor, cores=float(cores),
        batches=clock.batches, startup_s=clock.startup_ns / 1e9, wait_s=wait_s, step_s=step_s,
        wait_fraction=wait_s / (wait_s + step_s) if wait_s + step_s > 0 else 0.0,
        wait_p50_s=_quantile(waits, 0.5), wait_p90_s=_quantile(waits, 0.9),
        wait_max_s=max(waits) / 1e9 if waits else 0.0, step_p50_s=_quantile(steps, 0.5),
        main_cpu_fraction=max(0.0, (now_cpu_ns - clock.created_cpu_ns) / elapsed),
        main_run_queue_fraction=None if queued is None else queued / elapsed,
        workers=tuple(workers),
        ready_fraction=clock.ready / clock.batches if clock.batches else None,
        ready_wait_s=clock.ready_wait_ns / 1e9,
    )
    bound, suggested, verdict, advice = assess(figures)
    return LoaderTiming(**figures, bound=bound, suggested_workers=suggested, verdict=verdict,
                        advice=tuple(advice))


# -- the verdict ------------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    ms = 1e3 * seconds
    return f"{ms:.3g} ms" if ms < 100 else f"{ms:.0f} ms"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%" if x < 0.1 else f"{100 * x:.0f}%"


def _workers(n: int) -> str:
    return f"{n} worker" if n == 1 else f"{n} workers"


def _cores(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


def estimate_workers(busy_s: float, cpu_s: float | None, run_queue_s: float | None,
                     target_s: float, cores: float) -> tuple[int, bool, float | None]:
    """(workers that would keep up with one batch every `target_s`, whether the CPU is what limits
    them, the cores they would need), from one batch's busy wall time, CPU time and run-queue
    time in a worker.  See the module's docstring."""
    target_s = max(target_s, 1e-6)
    if cpu_s is None:
        uncontended = busy_s
    else:
        blocked = max(0.0, busy_s - cpu_s - (run_queue_s or 0.0))
        uncontended = cpu_s + blocked
    needed = uncontended / target_s
    if cpu_s is not None and cpu_s > 0:
        cores_needed = cpu_s / target_s
        if cores_needed > 0.9 * cores:  # the CPU runs out first: fill the cores, no more
            return max(1, math.ceil(uncontended * cores / cpu_s)), True, cores_needed
        return max(1, math.ceil(needed * HEADROOM)), False, cores_needed
    return max(1, math.ceil(needed * HEADROOM)), False, None


def assess(f: dict) -> tuple[str, int | None, str, list[str]]:
    """(bound, suggested workers, verdict, advice) from LoaderTiming's figures."""
    n, workers = f["batches"], f["workers"]
    if not workers:
        return "unknown", None, "no worker figures (timing is off in the workers)", []
    if n < MIN_BATCHES:
        return ("unknown", None, f"too few batches to judge ({n} after the first; "
                f"{MIN_BATCHES} needed)", [])
    num_workers, cores = f["num_workers"], f["cores"]
    wait, step = f["wait_s"] / n, f["step_s"] / n
    frac = f["wait_fraction"]
    done = sum(w.batches for w in workers)
    active = sum(w.active_s for w in workers)
    busy = sum(w.busy_s for w in workers)
    share = {name: (sum(getattr(w, f"{name}_s") for w in workers) / active if active > 0 else 0.0)
             for name in ("fetching", "collating", "writing", "awaiting_slot", "idle")}
    cpu = None
    if done and all(w.cpu_s is not None for w in workers):
        cpu = sum(w.cpu_s for w in workers) / done  # type: ignore[misc]
    queue = None
    if done and all(w.run_queue_s is not None for w in workers):
        queue = sum(w.run_queue_s for w in workers) / done  # type: ignore[misc]
    busy_per_batch = busy / done if done else 0.0
    target = step  # the loop takes a batch every step
    free_cores = max(1.0, cores - f["main_cpu_fraction"])
    suggested, cpu_limited, cores_needed = estimate_workers(busy_per_batch, cpu, queue, target,
                                                           free_cores)

    if frac >= INPUT_BOUND:
        bound = "input"
        head = (f"input-bound: the training loop waited {_pct(frac)} of the time ({_ms(wait)} per "
                f"batch against a {_ms(step)} step); without the wait it would run "
                f"{1 / max(1e-9, 1 - frac):.2f}x as fast")
    elif frac >= COMPUTE_BOUND:
        bound = "balanced"
        head = (f"balanced: the training loop waited {_pct(frac)} of the time ({_ms(wait)} per "
                f"batch against a {_ms(step)} step): the loader barely keeps up")
    else:
        bound = "compute"
        head = (f"compute-bound: the training loop waited only {_pct(frac)} of the time "
                f"({_ms(wait)} per batch against a {_ms(step)} step): the loader keeps up")
    parts = [head]
    shown = [(name, x) for name, x in share.items() if x >= 0.01]
    shown.sort(key=lambda item: -item[1])
    if shown:
        label = {"awaiting_slot": "waiting for a slot"}
        parts.append("workers spend " + ", ".join(f"{_pct(x)} {label.get(name, name)}"
                                                  for name, x in shown))
    machine = f"this machine, which has {_cores(cores)} cores"
    if cpu_limited and bound != "compute":
        parts.append(
            f"the CPU limits them: keeping up would take {cores_needed:.1f} cores of worker "
            f"CPU ({_ms(cpu or 0.0)} per batch) and {machine} "
            f"({f['main_cpu_fraction']:.1f} used by the training process); about "
            f"{_workers(suggested)} fill them (now {num_workers}) and more would not help")
    elif bound == "compute":
        if suggested < num_workers:
            parts.append(f"about {_workers(suggested)} would keep up (now {num_workers}); fewer "
                         "workers would leave cores and memory to the training process")
        else:
            parts.append(f"the {num_workers} workers are busy {_pct(busy / active if active else 0)}"
                         " of the time")
            if suggested > num_workers:
                parts.append(f"they are at their limit: about {_workers(suggested)} would leave "
                             "headroom for slower samples or a faster step")
    elif bound == "input" and suggested <= num_workers:
        parts.append(f"the {num_workers} workers should be enough (about {suggested} would keep "
                     f"up on {machine}): the wait is not for want of workers")
    else:
        parts.append(f"about {_workers(suggested)} would keep up on {machine} "
                     f"(now {num_workers})")
    advice = []
    ready, ready_wait = f.get("ready_fraction"), f.get("ready_wait_s")
    handover = (bound == "input" and ready is not None and ready_wait is not None
                and ready_wait >= READY_HANDOVER * f["wait_s"])
    if handover:
        advice.append(
            f"the batch was already there at {_pct(ready)} of next() calls, which took "
            f"{_pct(ready_wait / f['wait_s'])} of the wait: the wait ({_ms(wait)} per batch) is "
            f"the loader handing batches over, which more workers or a larger prefetch_factor "
            f"will not shorten; against a {_ms(step)} step it shows, and larger batches (fewer "
            f"next() calls for the same samples) share it out")
    if bound == "input":
        if cpu_limited:
            advice.append("make each sample cheaper on the CPU (decode less, cache decoded "
                          "samples, move augmentation to the GPU) or use more cores")
        main_queue = f.get("main_run_queue_fraction")
        if main_queue is not None and main_queue >= MAIN_RUN_QUEUE:
            advice.append(
                f"the training process waited {_pct(main_queue)} of the time for a CPU: "
                f"{num_workers} workers and it share {_cores(cores)} cores"
                + (f"; about {_workers(suggested)} would leave it more" if suggested < num_workers
                   else ""))
        elif share["idle"] >= IDLE_WHILE_WAITING and not handover:
            advice.append(
                f"workers sat idle {_pct(share['idle'])} of the time while the loop waited: "
                f"batches are not queued early enough; raise prefetch_factor (now "
                f"{f['prefetch_factor']})")
        if share["awaiting_slot"] >= SLOT_WAIT:
            advice.append(
                f"workers waited {_pct(share['awaiting_slot'])} of the time for a free slot: "
                "slots are scarce; raise max_ring_slots / max_ring_bytes if you set them, or "
                "let go of batches sooner")
        if not advice and suggested <= num_workers:  # (handover's advice came first)
            advice.append(f"uneven sample times make the loop wait on the slowest batch: a "
                          f"larger prefetch_factor (now {f['prefetch_factor']}) absorbs them")
        # Of all their time, as the table's "cpu wait": the run queue fills on idle wake-ups too,
        # so against busy time alone an idle worker's wake-ups read as contention.
        queue_share = None if queue is None or active <= 0 else queue * done / active
        if queue_share is not None and queue_share >= RUN_QUEUE:
            advice.append(
                f"workers waited {_pct(queue_share)} of their time for a CPU: "
                f"{num_workers} workers and the training process share {_cores(cores)} cores")
    return bound, suggested, "; ".join(parts), advice


# -- the table ----------------------------------------------------------------------------------------


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  " + "  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in
                             enumerate(zip(r, widths))).rstrip() for r in [header, *rows]]


def format_timing(t: LoaderTiming) -> str:
    n = t.batches
    ready = ("" if t.ready_fraction is None or t.ready_wait_s is None else
             f"; batch already there: {_pct(t.ready_fraction)} of calls, "
             f"{_pct(t.ready_wait_s / t.wait_s if t.wait_s > 0 else 0.0)} of the wait")
    lines = [f"training loop ({n} batches after each epoch's first; first batch: "
             f"{_ms(t.startup_s)} in all{ready}):"]
    lines += _table([
        ["waiting in next()", _ms(t.wait_per_batch_s), _ms(t.wait_p50_s), _ms(t.wait_p90_s),
         _ms(t.wait_max_s), _pct(t.wait_fraction)],
        ["step (between next()s)", _ms(t.step_per_batch_s), _ms(t.step_p50_s), "", "",
         _pct(1 - t.wait_fraction) if n else "-"],
    ], ["per batch", "mean", "p50", "p90", "max", "share"])
    lines.append(f"workers ({t.num_workers}, prefetch_factor {t.prefetch_factor}; share of each "
                 f"one's time since start-up; {_cores(t.cores)} cores, training process "
                 f"{t.main_cpu_fraction:.2f} CPU"
                 + ("" if t.main_run_queue_fraction is None
                    else f", {_pct(t.main_run_queue_fraction)} waiting for one") + "):")
    rows = []
    for w in t.workers:
        active = w.active_s or 1.0
        per = (lambda s, w=w: _ms(s / w.batches) if w.batches else "-")  # noqa: E731
        rows.append([
            str(w.worker_id), str(w.batches),
            *[_pct(getattr(w, f"{k}_s") / active)
              for k in ("fetching", "collating", "awaiting_slot", "writing", "idle")],
            per(w.busy_s), "-" if w.cpu_s is None else per(w.cpu_s),
            # of its whole time, as the other columns: the run queue fills while idle too (a wake-up)
            "-" if w.run_queue_s is None else _pct(min(1.0, w.run_queue_s / active)),
            _ms(w.starting_s),
        ])
    lines += _table(rows, ["worker", "batches", "fetching", "collating", "await slot", "writing",
                           "idle", "busy/batch", "cpu/batch", "cpu wait", "start-up"])
    lines.append(f"verdict: {t.verdict}")
    lines += [f"  - {a}" for a in t.advice]
    return "\n".join(lines)


def _bytes(n: float) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n:.0f} B"


def format_stats(stats) -> str:
    """`print(loader.stats())`: the ring in one line, then the timing table and the verdict."""
    lines = [
        f"shmloader: {stats.batches} batches; ring {stats.ring_slots} slots of "
        f"{_bytes(stats.slot_bytes)} ({_bytes(stats.reserved_bytes)} reserved, "
        f"{_bytes(stats.in_use_bytes)} in use, {stats.held_segments} held segments of "
        f"{_bytes(stats.held_bytes)}, {stats.detached} detached, {stats.slot_grows} grown); "
        f"{stats.control_bytes_per_batch:.0f} control bytes per batch",
    ]
    timing = getattr(stats, "timing", None)
    if timing is None:
        lines.append(f"timing: off ({getattr(stats, 'timing_off', '') or 'SHMLOADER_TIMING=0'})")
    else:
        lines.append(format_timing(timing))
    return "\n".join(lines)


def stats_as_dict(stats) -> dict:
    """LoaderStats as plain values, its timing nested (None when off)."""
    out = {f.name: getattr(stats, f.name) for f in fields(stats)}
    if out.get("timing") is not None:
        out["timing"] = out["timing"].as_dict()
    return out
