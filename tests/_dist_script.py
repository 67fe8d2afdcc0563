"""Run by tests/test_distributed.py as `python -m torch.distributed.run --standalone
--nproc_per_node=2 -m tests._dist_script OUT_DIR`: each rank loads its DistributedSampler shard
through ShmDataLoader (with persistent workers, and without) and torch's DataLoader, calling
`set_epoch` before each epoch but the last (`SET_EPOCH`: a loop that forgets it gets the last
epoch's order again, as with torch), checks they agree batch for batch, all-reduces a sum over its
batches (gloo, CPU) and writes what it saw to OUT_DIR/rank<r>.json for the test to check that the
shards cover the dataset and follow the sampler's order for each epoch."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from shmloader import ShmDataLoader

from . import _datasets as ds
from ._helpers import assert_same_batches, collect

SET_EPOCH = [0, 1, None]  # the argument of set_epoch before each epoch (None: not called)
SEED = 5


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = ds.DictDataset(n=30)
    samplers = [DistributedSampler(dataset, shuffle=True, seed=SEED) for _ in range(3)]
    shm = ShmDataLoader(dataset, batch_size=4, sampler=samplers[0], num_workers=2, persistent_workers=True)
    fresh = ShmDataLoader(dataset, batch_size=4, sampler=samplers[1], num_workers=1)  # new workers each epoch
    ref = DataLoader(dataset, batch_size=4, sampler=samplers[2], num_workers=2, persistent_workers=True)
    labels, sums = [], []
    for epoch in SET_EPOCH:
        if epoch is not None:
            for sampler in samplers:
                sampler.set_epoch(epoch)
        got, want = collect(shm), collect(ref)
        assert_same_batches(got, want)
        assert_same_batches(collect(fresh), want)
        labels.append([int(x) for b in got for x in b["label"]])
        total = torch.stack([b["image"].sum() for b in got]).sum().to(torch.float64)
        dist.all_reduce(total)
        sums.append(float(total))
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as out:
        json.dump({"rank": rank, "world": world, "labels": labels, "sums": sums,
                   "stats_batches": shm.stats().batches,
                   "fresh_stats_batches": fresh.stats().batches}, out)
    del shm, fresh, ref
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
