"""The arithmetic: median/min/max over repeats, ratios between transports, and the work bound.

Kept free of I/O and of torch so that it is unit-tested on its own (tests/test_bench.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

# The metrics recorded for every (point, transport, repeat), and which way is better.
METRICS = {
    "s_per_batch": "lower",
    "gbps": "higher",  # GB/s (1e9 bytes) of array data delivered to the main process
    "main_cpu_s_per_batch": "lower",  # main-process CPU per batch, the consumer's own CPU excluded
    "ttfb_s": "lower",  # loader construction -> first batch in hand
    "warmup_s": "lower",  # first batch -> end of the untimed batches (one-time costs)
    "peak_mem_bytes": "lower",  # PSS of main + workers (shm excluded) + /dev/shm used, minus baseline
    "peak_shm_bytes": "lower",  # /dev/shm in use, minus baseline
    # the mode workloads (epochs, rows)
    "total_s": "lower",  # epochs: loader construction -> end of the last epoch; rows: iter() -> end
    "first_batch_s": "lower",  # rows: iter() -> first batch in hand
    "median_s_per_batch": "lower",  # rows: median per-batch time of the timed batches
    "first_wait_e1_s": "lower",  # epochs: iter() -> first batch of epoch 1 (workers start)
    "first_wait_e2_s": "lower",  # ... of epoch 2 (persistent workers)
    "first_wait_e3_s": "lower",  # ... of epoch 3
    "steady_wait_s": "lower",  # epochs: median wait in next() for batches 3.. of every epoch
    "boundary_ratio_e2": "lower",  # epochs: first_wait_e2_s / steady_wait_s
    "boundary_ratio_e3": "lower",  # epochs: first_wait_e3_s / steady_wait_s
}


def median(values: Iterable[float]) -> float:
    v = sorted(float(x) for x in values)
    if not v:
        raise ValueError("median of no values")
    n = len(v)
    mid = n // 2
    return v[mid] if n % 2 else (v[mid - 1] + v[mid]) / 2.0


def summarize(values: Iterable[float | None]) -> dict | None:
    """``{"median", "min", "max", "n"}`` over the values that were measured (None is skipped)."""
    v = [float(x) for x in values if x is not None and not math.isnan(float(x))]
    if not v:
        return None
    return {"median": median(v), "min": min(v), "max": max(v), "n": len(v)}


def summarize_repeats(repeats: list[Mapping]) -> dict:
    """Per metric, the summary over repeats (metrics missing from every repeat are left out)."""
    out = {}
    for m in METRICS:
        s = summarize(r.get(m) for r in repeats)
        if s is not None:
            out[m] = s
    return out


def speedup(reference_s: float | None, this_s: float | None) -> float | None:
    """How many times faster ``this`` is than ``reference`` (seconds per batch, both): ref / this.

    > 1 means faster than the reference. Against ``memcpy`` it is the fraction of the memcpy
    bandwidth that is delivered (memcpy is the faster one, so it is <= 1 for a transport).
    """
    if reference_s is None or this_s is None or this_s <= 0 or reference_s <= 0:
        return None
    return reference_s / this_s


def per_repeat(runs: list[Mapping], metric: str = "s_per_batch") -> dict[int, float]:
    """``{repeat index: value}`` of one transport's runs at one point (the index a run was
    recorded with, else its position)."""
    return {int(r.get("repeat", i)): float(r[metric]) for i, r in enumerate(runs)
            if r.get(metric) is not None}


def best_per_repeat(*sides: Mapping[int, float]) -> dict[int, float]:
    """Per repeat, the smallest value among the transports that have one."""
    keys = set().union(*(s.keys() for s in sides))
    return {k: min(s[k] for s in sides if k in s) for k in keys}


def paired_ratios(num: Mapping[int, float], den: Mapping[int, float]) -> list[float]:
    """``num / den`` per repeat, the runs paired by repeat index: run r of every transport ran
    back to back (interleaved), so drift hits a pair alike. Unpaired repeats are left out."""
    return [num[k] / den[k] for k in sorted(num.keys() & den.keys()) if num[k] > 0 and den[k] > 0]


def gbps(nbytes: int, seconds: float | None) -> float | None:
    if seconds is None or seconds <= 0:
        return None
    return nbytes / seconds / 1e9


def ratios(medians: Mapping[str, float | None], references=("torch-shm", "torch-pickle", "memcpy")):
    """For each transport, its speed-up over each reference from the medians of s/batch."""
    return {
        t: {ref: speedup(medians.get(ref), s) for ref in references if ref != t}
        for t, s in medians.items()
    }


def seed_work_bound(
    num_workers: int,
    *,
    fetch_s: float,
    compute_s: float,
    copy_s: float,
    step_s: float,
    cores: int,
    copies: int = 1,
) -> float:
    """Seconds per batch that no transport can beat for seed001.

    Per batch: ``fetch_s`` of sleeping (128 x 3.125 ms and the sleeps' own overhead; it needs no
    core), ``compute_s`` of one core making the random numbers, ``copies`` copies of the batch's
    bytes (``copy_s`` each, one core, into memory already mapped), and the ``step_s`` train step in
    the main process (a sleep, overlapping the workers).

    - no workers: everything runs one after the other in the main process;
    - ``w`` workers: each worker makes its batch alone (sleep, then compute and copy), ``w`` at a
      time: ``(fetch + cpu) / w``; the CPU work of all workers shares ``min(w, cores)`` cores:
      ``cpu / min(w, cores)``; and the step cannot go faster than ``step_s``.
    """
    cpu = compute_s + copies * copy_s
    if num_workers == 0:
        return fetch_s + cpu + step_s
    return max(step_s, (fetch_s + cpu) / num_workers, cpu / min(num_workers, cores))
