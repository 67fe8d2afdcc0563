"""A batch of each loader sent to a child process through torch.multiprocessing: what the
child reads, and what the parent sees after the child wrote to it (tests/test_held_batches.py)."""

import json
import sys

import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, TensorDataset

from shmloader import ShmDataLoader


def add_one(batches, results):
    batch = batches.get()
    results.put(float(batch.sum()))
    batch.add_(1)
    results.put("written")


def main() -> None:
    dataset = TensorDataset(torch.arange(64 * 1000, dtype=torch.float32).reshape(64, 1000))
    context = mp.get_context("fork")
    seen = {}
    for cls in (DataLoader, ShmDataLoader):
        sums = {"epoch": []}
        for i, (batch,) in enumerate(cls(dataset, batch_size=16, num_workers=2)):
            if i == 1:
                sums["parent_before"] = float(batch.sum())
                batches, results = context.Queue(), context.Queue()
                child = context.Process(target=add_one, args=(batches, results))
                child.start()
                batches.put(batch)
                sums["child_read"] = results.get(timeout=60)
                if results.get(timeout=60) != "written":
                    sys.exit("the child did not write")
                child.join(60)
                if child.exitcode != 0:
                    sys.exit(f"the child exited with {child.exitcode}")
                sums["parent_after"] = float(batch.sum())
            sums["epoch"].append(float(batch.sum()))
        seen[cls.__name__] = sums
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
