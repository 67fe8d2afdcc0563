"""Load and soak: nothing grows with the number of batches or of loaders.

  * 10,000 batches through 3 workers: resident memory of the main process and of each worker,
    open fds (main and workers), threads (main and workers), mapped segments and /dev/shm entries
    are sampled every 500 batches and must stay within a small bound of their value after warm-up;
  * two loaders iterating at once in one process deliver their own batches, intact;
  * a loader created, iterated and destroyed 200 times in a row leaves nothing behind.
"""

from __future__ import annotations

import gc

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import Dataset

from shmloader import ShmDataLoader
from tests.conftest import mapped_segments, open_fds, shm_entries

pytestmark = pytest.mark.usefixtures("no_leaks")
MiB = 1 << 20


class Indexed(Dataset):
    """Sample i is a float32 row filled with i (and a tag), so any mix-up shows."""

    def __init__(self, n: int, width: int = 256, tag: int = 0):
        self.n, self.width, self.tag = n, width, tag

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return {"x": np.full(self.width, i, dtype=np.float32), "tag": self.tag, "i": i}


def _measure(pids: list[int]) -> dict:
    main = psutil.Process()
    workers = [psutil.Process(p) for p in pids]
    return {
        "main_rss": main.memory_info().rss,
        "main_fds": len(open_fds()),
        "main_threads": main.num_threads(),
        "mapped": len(mapped_segments()),
        "shm": len(shm_entries()),
        "worker_rss": [w.memory_info().rss for w in workers],
        "worker_fds": [w.num_fds() for w in workers],
        "worker_threads": [w.num_threads() for w in workers],
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_10000_batches_stay_flat():
    batches, batch_size, workers = 10_000, 4, 3
    loader = ShmDataLoader(Indexed(batches * batch_size), batch_size=batch_size, num_workers=workers,
                           prefetch_factor=2, multiprocessing_context="fork")
    iterator = iter(loader)
    pids = [p.pid for p in iterator._workers]
    samples = []
    for n, batch in enumerate(iterator, 1):
        first = n * batch_size - batch_size
        assert int(batch["i"][0]) == first and float(batch["x"][-1, 0]) == first + batch_size - 1
        del batch
        if n % 500 == 0:
            samples.append(_measure(pids))
    assert n == batches
    depth = loader.stats().ring_slots
    warm, rest = samples[1], samples[2:]  # after 1,000 batches every slot has been used
    for s in rest:
        assert s["main_rss"] - warm["main_rss"] < 24 * MiB, (warm["main_rss"], s["main_rss"])
        assert s["main_fds"] <= warm["main_fds"] + 1, (warm["main_fds"], s["main_fds"])
        assert s["main_threads"] == warm["main_threads"]
        assert s["mapped"] <= depth + 1 and s["shm"] == 0  # the ring's slots + the status words
        for k in range(workers):
            assert s["worker_rss"][k] - warm["worker_rss"][k] < 24 * MiB, (k, warm["worker_rss"], s["worker_rss"])
            assert s["worker_fds"][k] <= warm["worker_fds"][k] + 1, (k, warm["worker_fds"], s["worker_fds"])
            assert s["worker_threads"][k] == warm["worker_threads"][k]
    del iterator


@pytest.mark.timeout(120)
def test_two_loaders_iterate_at_once():
    a = ShmDataLoader(Indexed(400, tag=1), batch_size=8, num_workers=2, multiprocessing_context="fork")
    b = ShmDataLoader(Indexed(400, width=1000, tag=2), batch_size=5, num_workers=2, shuffle=True,
                      generator=torch.Generator().manual_seed(0), multiprocessing_context="fork")
    held = []
    seen_b = []
    for n, (x, y) in enumerate(zip(a, b)):
        assert x["tag"].tolist() == [1] * 8 and y["tag"].tolist() == [2] * 5
        assert x["i"].tolist() == list(range(8 * n, 8 * n + 8))
        assert torch.equal(y["x"][:, 0], y["i"].float()) and y["x"].shape == (5, 1000)
        seen_b += y["i"].tolist()
        if n % 10 == 0:
            held.append((x, y))  # some batches kept: their slots must not be reused under them
    assert n == 49 and len(set(seen_b)) == 250
    for x, y in held:
        assert torch.equal(x["x"][:, 0], x["i"].float()) and torch.equal(y["x"][:, 0], y["i"].float())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_create_and_destroy_200_loaders():
    main = psutil.Process()
    baseline = None
    for round_ in range(200):
        loader = ShmDataLoader(Indexed(16), batch_size=4, num_workers=2, multiprocessing_context="fork")
        out = [batch["i"].tolist() for batch in loader]
        assert out == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
        del loader
        if round_ == 20:
            gc.collect()
            baseline = (main.memory_info().rss, len(open_fds()), main.num_threads())
    gc.collect()
    rss, fds, threads = main.memory_info().rss, len(open_fds()), main.num_threads()
    assert rss - baseline[0] < 32 * MiB, (baseline, rss)
    assert fds <= baseline[1] and threads <= baseline[2], (baseline, fds, threads)
