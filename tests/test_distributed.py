"""DistributedSampler through ShmDataLoader: two ranks under torchrun (gloo, CPU)."""

from __future__ import annotations

import json

import pytest
from torch.utils.data import DistributedSampler

from . import _datasets as ds
from ._dist_script import SEED, SET_EPOCH
from ._launch import run_python


@pytest.mark.timeout(180)
def test_two_ranks_under_torchrun(tmp_path):
    run_python("-m", "tests._dist_script", str(tmp_path), torchrun_ranks=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    dataset = ds.DictDataset(n=30)
    n = len(dataset)
    for epoch in range(len(SET_EPOCH)):
        shards = [r["labels"][epoch] for r in ranks]
        assert len(shards[0]) == len(shards[1]) == n // 2
        assert sorted(shards[0] + shards[1]) == list(range(n))  # disjoint, and cover the dataset
        assert ranks[0]["sums"][epoch] == ranks[1]["sums"][epoch]  # all_reduce saw both ranks
    for rank, seen in enumerate(ranks):
        # each epoch in the order torch's DistributedSampler gives for that rank and epoch
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=SEED)
        last = 0
        for epoch, set_to in enumerate(SET_EPOCH):
            last = last if set_to is None else set_to
            sampler.set_epoch(last)
            assert seen["labels"][epoch] == list(sampler), (rank, epoch)
        assert seen["labels"][0] != seen["labels"][1]  # set_epoch reshuffles
        assert seen["labels"][2] == seen["labels"][1]  # without it, the order repeats
        batches = -(-n // 2 // 4)
        assert seen["stats_batches"] == len(SET_EPOCH) * batches  # persistent: runs on
        assert seen["fresh_stats_batches"] == batches  # the last epoch's iterator
