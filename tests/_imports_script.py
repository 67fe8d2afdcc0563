"""Run by tests/test_worker_imports.py in a fresh interpreter (no test module's imports): one
epoch of each mode, whose dataset records, once every worker has written a batch or more, the
modules its worker has imported.  Prints one JSON line: mode -> the modules imported in a worker
that the main process has not imported by the end of the epoch."""

from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np
from torch.utils.data import Dataset

from shmloader import ShmDataLoader

RECORD_FROM = 32  # the sample index from which a fetch records (every worker has written a batch)


class RecordsImports(Dataset):
    def __init__(self, folder: str):
        self.folder = folder

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i >= RECORD_FROM:
            with open(os.path.join(self.folder, f"{os.getpid()}.txt"), "w") as f:
                f.write(" ".join(sys.modules))
        return {"x": np.full((64, 64), i, np.float32), "y": np.full(3, i, np.int64)}


def imported_only_in_workers(sample_parallel: bool) -> list[str]:
    with tempfile.TemporaryDirectory() as folder:
        loader = ShmDataLoader(RecordsImports(folder), batch_size=8, num_workers=2,
                               sample_parallel=sample_parallel)
        for _ in loader:
            pass
        in_workers = set()
        for name in os.listdir(folder):
            with open(os.path.join(folder, name)) as f:
                in_workers.update(f.read().split())
    return sorted(in_workers - set(sys.modules))


if __name__ == "__main__":
    print(json.dumps({"default": imported_only_in_workers(False),
                      "sample_parallel": imported_only_in_workers(True)}))
