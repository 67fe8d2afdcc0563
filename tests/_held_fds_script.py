"""Run by tests/test_held_batches.py in a fresh interpreter: under `ulimit -n 100`, keep every one
of 200 batches of an IterableDataset of small tensors, with torch's DataLoader and with
ShmDataLoader, and print one JSON line saying what each did.

torch's case (its file_descriptor sharing strategy keeps an fd per held batch) either works or
raises its RuntimeError naming `ulimit -n`; ShmDataLoader must work (a held batch keeps its
mapping, not its fd: NOTE [ Held batches ] in shmloader/ring.py).
"""

from __future__ import annotations

import json
import resource
import sys

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from shmloader import ShmDataLoader

BATCHES = 200


class SmallTensors(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(worker, BATCHES, workers):
            yield torch.full((16,), float(i))


def keep_all(cls) -> dict:
    try:
        held = list(cls(SmallTensors(), batch_size=None, num_workers=2))
    except RuntimeError as exc:
        return {"ok": False, "error": str(exc)}
    values = sorted(int(batch[0]) for batch in held)
    intact = all(torch.equal(b, torch.full((16,), b[0].item())) for b in held)
    return {"ok": values == list(range(BATCHES)) and intact, "batches": len(held)}


def main() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))
    which = sys.argv[1]
    result = keep_all(ShmDataLoader if which == "shm" else DataLoader)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
