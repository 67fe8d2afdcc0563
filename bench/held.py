"""``python -m bench.held``: what holding batches costs, torch's DataLoader against ShmDataLoader.

Two workloads (NOTE [ Held batches ] in shmloader/ring.py), run interleaved (torch, shmloader,
torch, ...) for ``--repeats`` rounds, medians with min-max printed:

- ``cycles``: 1 MiB batches through 2 workers, a consumer whose helper forms a reference cycle
  with every batch (closures, tracebacks and logging helpers do), so only the cyclic garbage
  collector frees it; and the same consumer without the cycle.  Seconds per batch over
  ``--batches`` batches after a warm-up.
- ``hold``: ``list(loader)`` of a 200-batch epoch of 1 MiB batches: peak memory of the process
  tree (PSS without shared pages, plus /dev/shm in use: bench/memwatch.py) above the start, and
  the epoch's wall time.

Writes ``bench/results/held.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import numpy as np
from torch.utils.data import DataLoader, Dataset

from shmloader import ShmDataLoader

from .measure import MemWatch
from .report import machine_info
from .stats import summarize

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20


class Premade(Dataset):
    """`n` samples of `sample_bytes` float32, made once (fetching costs nothing)."""

    def __init__(self, n: int, sample_bytes: int):
        self.samples = [np.full(sample_bytes // 4, i, dtype=np.float32) for i in range(64)]
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.samples[i % 64]


def _loader(cls, dataset, batch_size: int):
    return cls(dataset, batch_size=batch_size, num_workers=2, prefetch_factor=2)


def _consume(batch, cycle: bool) -> None:
    float(batch[0, 0])  # touch it
    if cycle:
        helper = [batch]
        helper.append(helper)  # only the cyclic collector frees it


def time_cycles(cls, batches: int, warmup: int, cycle: bool) -> float:
    dataset = Premade((batches + warmup) * 16, MiB // 16)
    it = iter(_loader(cls, dataset, 16))
    for _ in range(warmup):
        _consume(next(it), cycle)
    start = time.perf_counter()
    for _ in range(batches):
        _consume(next(it), cycle)
    elapsed = time.perf_counter() - start
    del it
    gc.collect()
    return elapsed / batches


def hold_epoch(cls, watch: MemWatch, batches: int) -> dict:
    dataset = Premade(batches * 16, MiB // 16)
    loader = _loader(cls, dataset, 16)
    gc.collect()
    watch.start()
    start = time.perf_counter()
    held = list(loader)
    elapsed = time.perf_counter() - start
    peak = watch.stop()
    assert len(held) == batches
    del held, loader
    gc.collect()
    return {"s": elapsed, "peak_bytes": peak.get("peak_mem_bytes")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.held", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, default=400, help="timed batches of the cycles workload")
    ap.add_argument("--hold", type=int, default=200, help="batches in the held epoch")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "held.json"))
    args = ap.parse_args(argv)
    peers = {"torch": DataLoader, "shmloader": ShmDataLoader}
    runs: dict[str, list] = {}
    with MemWatch() as watch:
        for _ in range(args.repeats):
            for name, cls in peers.items():
                for cycle in (False, True):
                    key = f"{name} {'cycle' if cycle else 'plain'}"
                    runs.setdefault(key, []).append(time_cycles(cls, args.batches, 20, cycle))
                held = hold_epoch(cls, watch, args.hold)
                runs.setdefault(f"{name} hold s", []).append(held["s"])
                runs.setdefault(f"{name} hold peak", []).append(held["peak_bytes"])
    summary = {key: summarize(values) for key, values in runs.items()}
    print(f"held batches: 1 MiB batches, 2 workers, {args.repeats} repeats (median [min-max])")
    for consumer in ("plain", "cycle"):
        t, s = summary[f"torch {consumer}"], summary[f"shmloader {consumer}"]
        print(f"  {consumer:5} consumer, ms/batch: torch {_ms(t)}   shmloader {_ms(s)}   "
              f"torch/shmloader {t['median'] / s['median']:.2f}x")
    t, s = summary["torch hold peak"], summary["shmloader hold peak"]
    print(f"  list() of {args.hold} batches, peak MiB above start: torch {_mib(t)}   "
          f"shmloader {_mib(s)}   shmloader/torch {s['median'] / t['median']:.2f}")
    t, s = summary["torch hold s"], summary["shmloader hold s"]
    print(f"  list() of {args.hold} batches, seconds: torch {_sec(t)}   shmloader {_sec(s)}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": machine_info(), "args": vars(args), "runs": runs, "summary": summary}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


def _ms(s: dict) -> str:
    return f"{s['median'] * 1e3:.3f} [{s['min'] * 1e3:.3f}-{s['max'] * 1e3:.3f}]"


def _mib(s: dict) -> str:
    return f"{s['median'] / MiB:.0f} [{s['min'] / MiB:.0f}-{s['max'] / MiB:.0f}]"


def _sec(s: dict) -> str:
    return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


if __name__ == "__main__":
    raise SystemExit(main())
