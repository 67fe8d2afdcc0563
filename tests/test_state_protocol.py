"""Datasets and samplers that only look stateful (NOTE [ Which objects have a state ] in
shmloader/state.py): torch's DataLoader never calls their state_dict(), so neither must the
loader where it is no torchdata state_dict(): an nn.Module's, one that needs arguments (MosaicML's
and LitData's streaming datasets), one that raises in a worker.  Their batches are torch's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    SequentialSampler,
    get_worker_info,
)

from shmloader import ShmDataLoader
from shmloader.state import is_stateful

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]


class CountsItsStateCalls:
    """Each sample carries how often state_dict() was called in this process: under torch, 0."""

    calls = 0

    def _sample(self, i):
        return np.array([i, self.calls])


class ModuleDataset(torch.nn.Module, Dataset, CountsItsStateCalls):
    """A dataset that is an nn.Module holding a buffer (its state_dict() is its weights)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.zeros(1 << 18))

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return self._sample(i)

    def state_dict(self, *args, **kwargs):
        self.calls += 1
        return super().state_dict(*args, **kwargs)


class NeedsArguments(Dataset, CountsItsStateCalls):
    """state_dict(num_samples, from_beginning), as MosaicML's StreamingDataset has it."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return self._sample(i)

    def state_dict(self, num_samples, from_beginning=True):
        self.calls += 1
        return {"sample_in_epoch": num_samples}

    def load_state_dict(self, obj):
        pass


class MainProcessOnlyStream(IterableDataset):
    """state_dict() raises in a worker, as LitData's StreamingDataset does."""

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        yield from (np.array([i]) for i in range(worker, 12, workers))

    def state_dict(self):
        if get_worker_info() is not None:
            raise RuntimeError("state_dict should only be called in the main process")
        return {}

    def load_state_dict(self, obj):
        pass


class StepSampler(BatchSampler):
    """A batch sampler whose state_dict(step) needs an argument."""

    def __init__(self):
        super().__init__(SequentialSampler(range(12)), batch_size=4, drop_last=False)

    def state_dict(self, step):
        raise AssertionError("state_dict(step) must not be called")

    def load_state_dict(self, state):
        pass


def _batches(loader_class, dataset, epochs=1, **kwargs):
    loader = loader_class(dataset, **kwargs)
    got = [[b.tolist() for b in loader] for _ in range(epochs)]
    del loader
    return got


def test_only_torchdatas_protocol_counts_as_state():
    assert not is_stateful(ModuleDataset()) and not is_stateful(NeedsArguments())
    assert not is_stateful(StepSampler())
    assert is_stateful(MainProcessOnlyStream())  # torchdata's protocol, which raises in workers


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("dataset", [ModuleDataset, NeedsArguments], ids=["nn.Module", "needs-arguments"])
def test_a_state_dict_that_is_not_torchdatas_is_never_called(dataset, num_workers):
    kwargs = {"batch_size": 4, "num_workers": num_workers}
    want = _batches(DataLoader, dataset(), **kwargs)
    assert all(calls == 0 for epoch in want for batch in epoch for _, calls in batch)
    assert _batches(ShmDataLoader, dataset(), **kwargs) == want
    loader = ShmDataLoader(dataset(), **kwargs)
    iterator = iter(loader)
    next(iterator)
    assert loader.state_dict()["workers"] == [None] * max(num_workers, 1)  # resumed by the sampler's replay
    del iterator, loader


@pytest.mark.parametrize("persistent", [False, True])
def test_a_state_dict_that_raises_in_workers_fails_no_batch(persistent):
    kwargs = {"batch_size": 2, "num_workers": 2, "persistent_workers": persistent}
    want = _batches(DataLoader, MainProcessOnlyStream(), epochs=2, **kwargs)
    assert _batches(ShmDataLoader, MainProcessOnlyStream(), epochs=2, **kwargs) == want
    loader = ShmDataLoader(MainProcessOnlyStream(), **kwargs)
    iterator = iter(loader)
    next(iterator)
    with pytest.raises(RuntimeError, match=r"MainProcessOnlyStream.state_dict\(\) raised RuntimeError: "
                                           r"state_dict should only be called in the main process"):
        loader.state_dict()
    assert len(list(iterator)) == 5  # the epoch goes on
    del iterator, loader


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_batch_sampler_whose_state_dict_needs_an_argument(num_workers):
    kwargs = {"batch_sampler": StepSampler(), "num_workers": num_workers}
    dataset = np.arange(12)
    assert _batches(ShmDataLoader, dataset, **kwargs) == _batches(DataLoader, dataset, **kwargs)
