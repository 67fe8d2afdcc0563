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
- ``padded``: ``list(loader)`` of an epoch of dynamic padding (NOTE [ Held batches of varying
  size ] in shmloader/ring.py): sequences of 64 float32 features whose lengths vary from batch
  to batch, 32 a batch, padded by ``pad_sequence`` (a tensor collate) or by a numpy collate;
  batches of about 8-32 MiB.  The epoch's wall time and its peak memory, as for ``hold``.

Writes ``bench/results/held.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import numpy as np
import torch
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


class Sequences(Dataset):
    """`n` sequences of 64 float32 features; batch b's lengths lie between half and all of a
    length drawn for the batch (512-4063 rows), so padded batches vary in size."""

    def __init__(self, n: int, batch_size: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        longest = rng.integers(512, 4064, n // batch_size + 1)
        self.lengths = (longest[np.arange(n) // batch_size] * rng.uniform(0.5, 1, n)).astype(int)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return torch.full((int(self.lengths[i]), 64), float(i % 7))


def pad_tensors(samples):
    return torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)


def pad_numpy(samples):
    out = np.zeros((len(samples), max(len(s) for s in samples), 64), np.float32)
    for k, sample in enumerate(samples):
        out[k, :len(sample)] = sample.numpy()
    return out


PADDED_COLLATES = {"pad_sequence": pad_tensors, "numpy pad": pad_numpy}


def _loader(cls, dataset, batch_size: int, collate_fn=None):
    return cls(dataset, batch_size=batch_size, num_workers=2, prefetch_factor=2, collate_fn=collate_fn)


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


def hold_epoch(cls, watch: MemWatch, batches: int, padded: str | None = None) -> dict:
    """`list(loader)` of `batches` batches: 1 MiB ones, or with `padded`, those of Sequences
    padded by PADDED_COLLATES[padded]; seconds, peak memory, and the bytes held."""
    if padded is None:
        loader = _loader(cls, Premade(batches * 16, MiB // 16), 16)
    else:
        loader = _loader(cls, Sequences(batches * 32, 32), 32, PADDED_COLLATES[padded])
    gc.collect()
    watch.start()
    start = time.perf_counter()
    held = list(loader)
    elapsed = time.perf_counter() - start
    peak = watch.stop()
    assert len(held) == batches
    held_bytes = sum(int(batch.nbytes) for batch in held)
    del held, loader
    gc.collect()
    return {"s": elapsed, "peak_bytes": peak.get("peak_mem_bytes"), "held_bytes": held_bytes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.held", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, default=400, help="timed batches of the cycles workload")
    ap.add_argument("--hold", type=int, default=200, help="batches in the held epoch")
    ap.add_argument("--padded", type=int, default=100, help="batches in the padded epoch (0: none)")
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
                for collate in PADDED_COLLATES if args.padded else ():
                    held = hold_epoch(cls, watch, args.padded, collate)
                    runs.setdefault(f"{name} {collate} s", []).append(held["s"])
                    runs.setdefault(f"{name} {collate} peak", []).append(held["peak_bytes"])
                    runs.setdefault(f"{name} {collate} held", []).append(held["held_bytes"])
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
    for collate in PADDED_COLLATES if args.padded else ():
        held = summary[f"torch {collate} held"]["median"]
        t, s = summary[f"torch {collate} s"], summary[f"shmloader {collate} s"]
        print(f"  list() of {args.padded} padded batches ({collate}, {held / MiB:.0f} MiB held), seconds: "
              f"torch {_sec(t)}   shmloader {_sec(s)}   torch/shmloader {t['median'] / s['median']:.2f}x")
        t, s = summary[f"torch {collate} peak"], summary[f"shmloader {collate} peak"]
        print(f"  {'':>{len(str(args.padded)) + 25}}peak MiB above start: torch {_mib(t)}   "
              f"shmloader {_mib(s)}   shmloader/torch {s['median'] / t['median']:.2f}")
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
