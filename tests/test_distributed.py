"""DistributedSampler through ShmDataLoader: two ranks under torchrun (gloo, CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from . import _datasets as ds

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(180)
def test_two_ranks_under_torchrun(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "tests._dist_script", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    n = len(ds.DictDataset(n=30))
    for epoch in range(2):
        shards = [r["labels"][epoch] for r in ranks]
        assert len(shards[0]) == len(shards[1]) == n // 2
        assert sorted(shards[0] + shards[1]) == list(range(n))  # disjoint, and cover the dataset
        assert ranks[0]["sums"][epoch] == ranks[1]["sums"][epoch]  # all_reduce saw both ranks
    assert ranks[0]["labels"][0] != ranks[0]["labels"][1]  # set_epoch reshuffles
