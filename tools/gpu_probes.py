"""GPU probes for the README's CUDA section: `python -m tools.gpu_probes` from the repository's root
(tools/gpu_check.sh runs it on a lent GPU machine).

1. How fast a ring slot is page-locked (cudaHostRegister through SlotPinner), once per slot.
2. Whether torch's own DataLoader survives what NOTE [ The parent's garbage ] guards shmloader
   against: CUDA tensors left in reference cycles when fork workers start, collected in a worker.
3. The first batch of each epoch with pin_memory=True, workers not persistent (each epoch's ring
   is page-locked anew) and persistent, against torch's DataLoader(pin_memory=True).
"""

from __future__ import annotations

import gc
import statistics
import time

import torch
from torch.utils.data import DataLoader, Dataset

from shmloader import ShmDataLoader
from shmloader import cuda as shm_cuda
from shmloader import segment as shm_segment
from tests.test_cuda import CollectingItems, batches_with_cuda_garbage_at_fork  # the GPU test's

MiB = 1 << 20


def registration_rate(nbytes: int, repeats: int = 5) -> None:
    pinner = shm_cuda.SlotPinner("cuda")
    seconds = []
    for _ in range(repeats):
        seg = shm_segment.create_segment(nbytes, generation=0)
        start = time.perf_counter()
        pinner.pin(seg)
        seconds.append(time.perf_counter() - start)
        del seg
        gc.collect()
    median = statistics.median(seconds)
    print(f"page-locking a {nbytes // MiB} MiB slot: {median * 1e3:.1f} ms median "
          f"[{min(seconds) * 1e3:.1f}-{max(seconds) * 1e3:.1f}] of {repeats}, "
          f"{nbytes / median / 1e9:.1f} GB/s")


def garbage_at_fork(make_loader, name: str) -> None:
    try:
        n = len(batches_with_cuda_garbage_at_fork(make_loader))
        print(f"{name}: CUDA garbage in cycles at fork: {n} batches, OK")
    except Exception as exc:  # noqa: BLE001 - the probe reports whatever it is
        print(f"{name}: CUDA garbage in cycles at fork: {type(exc).__name__}: {str(exc).splitlines()[0]}")


class Rows(Dataset):
    def __init__(self, n: int, row_bytes: int):
        self.n, self.row = n, torch.ones(row_bytes // 4).numpy()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.row


def first_batches(name: str, make_loader, epochs: int = 3) -> None:
    loader = make_loader()
    firsts, rests = [], []
    for _ in range(epochs):
        start = time.perf_counter()
        it = iter(loader)
        next(it)
        firsts.append(time.perf_counter() - start)
        start = time.perf_counter()
        n = sum(1 for _ in it)
        rests.append((time.perf_counter() - start) / max(n, 1))
        del it
    print(f"{name}: first batch of epochs 1..{epochs}: "
          + ", ".join(f"{t * 1e3:.0f}" for t in firsts)
          + " ms; later batches " + ", ".join(f"{t * 1e3:.1f}" for t in rests) + " ms each")
    del loader
    gc.collect()


if __name__ == "__main__":
    for size in (64 * MiB, 256 * MiB):
        registration_rate(size)
    kwargs = dict(batch_size=2, num_workers=2, multiprocessing_context="fork", timeout=60)
    garbage_at_fork(lambda: DataLoader(CollectingItems(), **kwargs), "torch DataLoader")
    garbage_at_fork(lambda: ShmDataLoader(CollectingItems(), **kwargs), "ShmDataLoader")
    rows = Rows(16 * 12, 4 * MiB)  # 12 batches of 64 MiB
    for persistent in (False, True):
        common = dict(batch_size=16, num_workers=4, pin_memory=True, persistent_workers=persistent)
        first_batches(f"torch DataLoader, persistent={persistent}", lambda kw=common: DataLoader(rows, **kw))
        first_batches(f"ShmDataLoader, persistent={persistent}", lambda kw=common: ShmDataLoader(rows, **kw))
