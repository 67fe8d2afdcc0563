"""Runs a loader against whatever /dev/shm this process sees and prints one JSON line with what
happened (tests/test_capacity.py runs it inside a private mount namespace over a small tmpfs).

    python -m tests._capacity_probe CASE

CASE "construct": a ring of which not even 2 slots (slot_bytes) fit (the rest overflow); "learnt":
a ring whose size learnt from the first batch does not fit whole (6 slots of 3 MiB in 16 MiB),
where torch runs: fitted to /dev/shm; "learnt-too-big": one whose first batch teaches a slot of
which 2 do not fit;
"grow": one batch much larger than its slot, too large to fit; "fits": a ring learnt from the
first batch that just fits (4 workers: 10 slots of 1.5 MiB in 16 MiB); "first-slots": 4
workers whose first slots (4 MiB, a numpy collate) do not all fit, made at once before the ring
knows its slot size, where torch runs; "first-slots-default": the same with torch's
default_collate; "first-slots-late": the same, worker 0 the last to make its first slot, so that
the batch the loop waits for is the one that finds no room; "held": a numpy collate (4 MiB
batches, 2 workers) and a loop that keeps every batch, 64 MiB in all, where torch runs.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import warnings

import numpy as np
from torch.utils.data import Dataset, get_worker_info

from shmloader import ShmCapacityWarning, ShmDataLoader
from tests.conftest import child_pids, mapped_segments, wait_until

MiB = 1 << 20


class Sized(Dataset):
    """Samples of `small` bytes, except index `big_at`, of `big` bytes."""

    def __init__(self, small: int, big: int = 0, big_at: int = -1):
        self.small, self.big, self.big_at = small, big, big_at

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        n = self.big if i == self.big_at else self.small
        return np.full(n, i % 251, dtype=np.uint8)


class LateFirst(Sized):
    """Sized, but worker 0 sleeps before its first sample: the other workers make their first
    slots before it makes its own."""

    slept = False

    def __getitem__(self, i: int):
        info = get_worker_info()
        if info is not None and info.id == 0 and not LateFirst.slept:
            LateFirst.slept = True
            time.sleep(1.0)
        return super().__getitem__(i)


def stack(samples):
    return np.stack(samples)


def _used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def run(case: str) -> dict:
    kw = dict(num_workers=2, prefetch_factor=2, multiprocessing_context="fork")
    if case == "construct":
        loader = ShmDataLoader(Sized(MiB), batch_size=4, slot_bytes=9 * MiB, **kw)
    elif case == "learnt":
        loader = ShmDataLoader(Sized(MiB), batch_size=3, **kw)
    elif case == "learnt-too-big":
        loader = ShmDataLoader(Sized(MiB), batch_size=9, **kw)
    elif case == "fits":
        loader = ShmDataLoader(Sized(MiB * 3 // 2), batch_size=1, **dict(kw, num_workers=4))
    elif case == "grow":
        loader = ShmDataLoader(Sized(64 * 1024, big=40 * MiB, big_at=9), batch_size=1,
                               collate_fn=lambda samples: samples[0], slot_bytes=MiB, **kw)
    elif case == "held":
        loader = ShmDataLoader(Sized(MiB), batch_size=4, collate_fn=stack, **kw)
    elif case.startswith("first-slots"):
        dataset = LateFirst(MiB) if case == "first-slots-late" else Sized(MiB)
        collate = {} if case == "first-slots-default" else {"collate_fn": stack}
        loader = ShmDataLoader(dataset, batch_size=4, **dict(kw, num_workers=4), **collate)
    else:
        raise SystemExit(f"unknown case {case!r}")
    result: dict = {"total": os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize, "batches": 0}
    sums, kept = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ShmCapacityWarning)
        try:
            for batch in loader:
                result["batches"] += 1
                sums.append(int(batch.sum()))  # what torch's batch sums to: checked by the test
                if case == "held":
                    kept.append(batch)
                del batch  # every slot must be freed at the end
        except Exception as exc:
            result.update(type=type(exc).__name__, mro=[c.__name__ for c in type(exc).__mro__],
                          message=str(exc), needed=getattr(exc, "needed", None), free=getattr(exc, "free", None))
            del exc
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, ShmCapacityWarning)]
    result["sums"] = sums
    result["kept_sums"] = [int(batch.sum()) for batch in kept]
    del kept
    stats = loader.stats()
    result["spilled"] = stats.spilled_batches if stats is not None else None
    result["overflow"] = stats.overflow_slots if stats is not None else None
    del loader
    gc.collect()
    wait_until(lambda: not child_pids() and not mapped_segments(), 10.0)
    result.update(children=sorted(child_pids()), mapped=sorted(mapped_segments()), used_after=_used(),
                  entries=os.listdir("/dev/shm"))
    return result


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1])), flush=True)
