"""``python -m bench.gpu``: does the host-to-device copy hide behind compute?

A synthetic training loop -- per step, a chain of matmuls on the batch, sized to take about as long
as copying the batch -- fed two ways, interleaved:

    torch      DataLoader(pin_memory=True) + batch.to("cuda", non_blocking=True)
    shmloader  CudaPrefetcher(ShmDataLoader(pin_memory=True), depth=2)

Per batch size it reports, all measured in the same run:

    copy ms / GB/s (pinned)  a plain pinned copy of the same bytes (torch.empty(pin_memory=True)
                             → device): the physical H2D limit here
    GB/s (slot)              the same copy out of a ring slot page-locked by cudaHostRegister
                             (target: >= 90% of the pinned copy)
    compute ms               the step's matmuls alone, data already on the device
    step ms                  wall time per step of each loop (target for shmloader: within 10% of
                             max(compute, copy))
    hidden                   fraction of the copy hidden behind compute:
                             (compute + copy - step) / copy, clipped to [0, 1]

    python -m bench.gpu                          # 64M,128M,256M batches
    python -m bench.gpu --sizes 16M,64M --steps 10 --workers 4

Without a CUDA device it says so and exits 0 (the figures are then unmeasured).
Writes ``<out>/gpu-<time>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": MiB, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


class Rows(Dataset):
    """`n` float32 rows of `row_bytes` each; cheap to produce, so the loader is not the limit."""

    def __init__(self, n: int, row_bytes: int):
        self.n = n
        self.row = np.random.default_rng(0).standard_normal(row_bytes // 4, dtype=np.float32)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.row


def cuda_ms(fn, repeats: int) -> float:
    """Median milliseconds of fn() on the current stream, timed with CUDA events."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class Compute:
    """A chain of m×m matmuls that reads the batch; `iters` chosen so it lasts ~target_ms."""

    def __init__(self, device, m: int = 2048):
        self.m = m
        self.w = torch.randn(m, m, device=device) / m**0.5
        self.iters = 1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x.view(-1)[: self.m * self.m].view(self.m, self.m)
        for _ in range(self.iters):
            h = torch.tanh(h @ self.w)
        return h

    def calibrate(self, x: torch.Tensor, target_ms: float) -> float:
        self.iters = 1
        one = cuda_ms(lambda: self(x), 5)
        self.iters = max(1, round(target_ms / one))
        return cuda_ms(lambda: self(x), 5)


def run_loop(batches, compute: Compute, steps: int, warmup: int, to_device) -> float:
    """Seconds per step of `for batch in batches: compute(to_device(batch))` over `steps` steps
    after `warmup`; the GPU is drained at both ends of the timed window."""
    it = iter(batches)
    for _ in range(warmup):
        compute(to_device(next(it)))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        compute(to_device(next(it)))
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    del it
    return elapsed / steps


def measure(size: int, args, device) -> dict:
    from shmloader import CudaPrefetcher, ShmDataLoader

    batch_size = args.batch_size
    row_bytes = size // batch_size // 4 * 4
    nbytes = row_bytes * batch_size
    n_items = batch_size * (args.steps + args.warmup + 2)
    ds = Rows(n_items, row_bytes)

    # 1. the reference: a plain pinned copy of the same bytes
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    copy_ms = cuda_ms(lambda: dst.copy_(pinned, non_blocking=True), args.repeats)

    # 2. the same copy out of a page-locked ring slot
    slot_loader = ShmDataLoader(ds, batch_size=batch_size, num_workers=1, pin_memory=True)
    slot_it = iter(slot_loader)
    slot_batch = next(slot_it)
    assert slot_batch.is_pinned(), "the ring slot is not page-locked"
    flat = slot_batch.view(-1).view(torch.uint8)
    slot_ms = cuda_ms(lambda: dst.copy_(flat, non_blocking=True), args.repeats)
    flat = slot_batch = slot_it = slot_loader = None  # the slot goes back, the loader shuts down

    # 3. compute alone, sized to the copy
    x = torch.randn(nbytes // 4, device=device)
    compute = Compute(device)
    compute_ms = compute.calibrate(x, copy_ms * args.compute_ratio)
    x = dst = pinned = None

    # 4. the two loops, interleaved
    common = dict(batch_size=batch_size, num_workers=args.workers, prefetch_factor=2,
                  persistent_workers=True)
    torch_loader = DataLoader(ds, pin_memory=True, **common)
    shm_loader = CudaPrefetcher(ShmDataLoader(ds, pin_memory=True, **common), device=device, depth=2)
    step = {"torch": [], "shmloader": []}
    for _ in range(args.rounds):
        step["torch"].append(run_loop(torch_loader, compute, args.steps, args.warmup,
                                      lambda b: b.to(device, non_blocking=True)))
        step["shmloader"].append(run_loop(shm_loader, compute, args.steps, args.warmup, lambda b: b))
    del torch_loader, shm_loader

    bound_ms = max(compute_ms, copy_ms)
    row = {
        "batch_bytes": nbytes,
        "copy_ms": copy_ms,
        "pinned_GBps": nbytes / copy_ms / 1e6,
        "slot_ms": slot_ms,
        "slot_GBps": nbytes / slot_ms / 1e6,
        "slot_vs_pinned": copy_ms / slot_ms,
        "compute_ms": compute_ms,
        "bound_ms": bound_ms,
    }
    for name, values in step.items():
        ms = statistics.median(values) * 1e3
        row[f"{name}_step_ms"] = ms
        row[f"{name}_vs_bound"] = ms / bound_ms
        row[f"{name}_hidden"] = min(1.0, max(0.0, (compute_ms + copy_ms - ms) / copy_ms))
    return row


def print_table(rows: list[dict]) -> None:
    head = (f"{'batch':>8} {'copy ms':>8} {'pinned GB/s':>11} {'slot GB/s':>9} {'slot/pin':>8} "
            f"{'compute':>8} {'torch step':>10} {'hidden':>6} {'shm step':>8} {'hidden':>6} {'shm/bound':>9}")
    print(head)
    for r in rows:
        print(f"{r['batch_bytes'] / MiB:>7.0f}M {r['copy_ms']:>8.2f} {r['pinned_GBps']:>11.1f} "
              f"{r['slot_GBps']:>9.1f} {r['slot_vs_pinned']:>8.0%} {r['compute_ms']:>8.2f} "
              f"{r['torch_step_ms']:>10.2f} {r['torch_hidden']:>6.0%} {r['shmloader_step_ms']:>8.2f} "
              f"{r['shmloader_hidden']:>6.0%} {r['shmloader_vs_bound']:>9.2f}")
    print("targets: slot/pin >= 90%; shm/bound <= 1.10; shm step clearly below torch step at 64-256M")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--sizes", default="64M,128M,256M", help="batch sizes in bytes (K/M/G suffixes)")
    ap.add_argument("--batch-size", type=int, default=16, help="rows per batch")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per loop (median)")
    ap.add_argument("--repeats", type=int, default=10, help="repeats of each isolated copy")
    ap.add_argument("--compute-ratio", type=float, default=1.0, help="compute time / copy time")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"no CUDA device (torch {torch.__version__}): GPU figures unmeasured")
        return 0
    device = torch.device(args.device)
    rows = []
    for text in args.sizes.split(","):
        rows.append(measure(parse_size(text), args, device))
        print(f"  measured {rows[-1]['batch_bytes'] / MiB:.0f} MiB", file=sys.stderr)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, {args.workers} workers")
    print_table(rows)
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = os.path.join(args.out, f"gpu-{stamp}.json")
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                   "args": vars(args), "rows": rows}, f, indent=2)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
