"""Datasets with torchdata's state protocol (state_dict / load_state_dict), for tests/test_state.py.

Module-level classes, so that spawn and forkserver workers can unpickle them.  Each sample says
where it came from, so a resumed run that repeats or skips a sample shows it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


def _shard() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class _StreamIterator:
    """The iterator of StatefulIterStream: its state is its position in the worker's shard."""

    def __init__(self, n: int, worker: int, workers: int, extra: int):
        self.worker = worker
        self.items = list(range(worker, n, workers)) + (list(range(n, n + extra)) if worker == 0 else [])
        self.pos = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.pos >= len(self.items):
            raise StopIteration
        i = self.items[self.pos]
        self.pos += 1
        return {"x": np.full(3, i, dtype=np.float32), "i": i, "worker": self.worker}

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


class StatefulIterStream(IterableDataset):
    """Sharded by worker; iter(dataset) is a stateful iterator (torchdata's iterator state).
    Worker 0's shard has `extra` more samples than the others, so it ends last."""

    def __init__(self, n: int = 40, extra: int = 9):
        self.n, self.extra = n, extra

    def __iter__(self):
        worker, workers = _shard()
        return _StreamIterator(self.n, worker, workers, self.extra)


class EpochStream(IterableDataset):
    """The dataset itself holds the state (torchdata's dataset state: epoch and position); its
    iterator is a plain generator.  Each iter() starts a new epoch, unless a state was just
    loaded (then it goes on where that state was); each epoch shuffles the worker's shard with
    the epoch number, so under persistent workers epoch 2 differs from epoch 1."""

    def __init__(self, n: int = 30):
        self.n = n
        self.epoch, self.pos = -1, 0
        self._resuming = False

    def __iter__(self):
        if self._resuming:
            self._resuming = False
        else:
            self.epoch, self.pos = self.epoch + 1, 0
        worker, workers = _shard()
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        return self._samples([i for i in order if i % workers == worker], worker)

    def _samples(self, mine, worker):
        while self.pos < len(mine):
            i = mine[self.pos]
            self.pos += 1
            yield {"x": torch.full((2,), float(i)), "i": i, "epoch": self.epoch, "worker": worker}

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state):
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._resuming = True


class RewindingStream(IterableDataset):
    """A position that goes back to 0 when the stream runs out (the next iter() starts over), the
    state torchdata saves: the position.  With 7 items in batches of 3 the last batch is partial,
    so the fetcher sees the stream end while filling it, and the state saved after it says 0."""

    def __init__(self, n: int = 7):
        self.n, self.pos = n, 0

    def __iter__(self):
        for i in range(self.pos, self.n):
            self.pos = i + 1
            yield i
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


class PlainStream(IterableDataset):
    """Sharded by worker, without any state (resumed by fast-forwarding)."""

    def __init__(self, n: int = 26):
        self.n = n

    def __iter__(self):
        worker, workers = _shard()
        for i in range(worker, self.n, workers):
            yield {"i": i, "x": np.full(2, i, dtype=np.int64)}


class Indexed(Dataset):
    """Map-style: sample i is an array full of i and its index."""

    def __init__(self, n: int = 50):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": np.full(4, i, dtype=np.float64), "i": i}


class CountingMap(Dataset):
    """Map-style with a state of its own (torchdata saves a map-style dataset's state per worker):
    it counts the samples it has served, and each sample carries the count."""

    def __init__(self, n: int = 24):
        self.n = n
        self.served = 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.served += 1
        return {"i": i, "served": self.served}

    def state_dict(self):
        return {"served": self.served}

    def load_state_dict(self, state):
        self.served = state["served"]
