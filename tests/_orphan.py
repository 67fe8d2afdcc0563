"""A training script whose main process dies mid-epoch (tests/test_main_dies.py).

    python -m tests._orphan MODE START_METHOD

Starts a ShmDataLoader with 2 workers whose samples are slow (so the workers are busy inside
__getitem__ when the main process dies), takes a few batches and keeps them, prints one JSON line
{"pids": [...], "segments": [...]} and then dies as MODE says: "sigkill" waits to be killed by
the test, "exit" calls os._exit(3), "raise" raises an uncaught exception.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
from torch.utils.data import Dataset

from shmloader import ShmDataLoader
from tests.conftest import mapped_segments


class SlowDataset(Dataset):
    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int):
        time.sleep(0.05)
        return np.full((256, 256), i, dtype=np.float32)


def main(mode: str, start_method: str) -> None:
    loader = ShmDataLoader(SlowDataset(), batch_size=4, num_workers=2, prefetch_factor=2,
                           multiprocessing_context=start_method)
    iterator = iter(loader)
    held = [next(iterator) for _ in range(3)]
    print(json.dumps({"pids": [p.pid for p in iterator._workers],
                      "segments": sorted(mapped_segments())}), flush=True)
    if mode == "sigkill":
        time.sleep(120)
    elif mode == "exit":
        os._exit(3)
    elif mode == "raise":
        raise RuntimeError(f"uncaught in the training loop while holding {len(held)} batches")
    sys.exit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
