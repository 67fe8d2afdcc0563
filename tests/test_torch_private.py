"""shmloader/torch_private.py: every private torch name shmloader relies on still exists with the
shape shmloader uses, so that a torch upgrade that moves one fails here, by name, rather than
deep inside a worker."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from shmloader import torch_private

pytestmark = pytest.mark.timeout(30)


class Squares(Dataset):
    def __len__(self):
        return 5

    def __getitem__(self, i):
        return i * i


class Count(IterableDataset):
    def __iter__(self):
        return iter(range(3))


def test_the_iterator_base_class_and_the_attributes_shmloader_reads():
    loader = torch.utils.data.DataLoader(Squares(), batch_size=2)
    iterator = torch_private.SingleProcessDataLoaderIter(loader)
    assert isinstance(iterator, torch_private.BaseDataLoaderIter)
    doc = torch_private.__doc__
    names = doc[doc.index("_dataset,"):].replace("\n", " ").rstrip(". ").split(", ")
    missing = [name.strip().rstrip(".") for name in names if not hasattr(iterator, name.strip().rstrip("."))]
    assert not missing, f"torch's iterator no longer has {missing}"
    assert "first_iter" in inspect.signature(torch_private.BaseDataLoaderIter._reset).parameters


def test_fetchers_for_both_dataset_kinds():
    def identity(x):
        return x

    fetch = torch_private.create_fetcher(torch_private.DatasetKind.Map, Squares(), True, identity, False)
    assert fetch.fetch([1, 2]) == [1, 4]
    stream = torch_private.create_fetcher(torch_private.DatasetKind.Iterable, Count(), True, identity, False)
    assert stream.fetch([None, None]) == [0, 1]
    sampler = torch_private.InfiniteConstantSampler()
    assert next(iter(sampler)) is None


def test_collate_machinery():
    assert torch.Tensor in torch_private.default_collate_fn_map
    batch = torch_private.collate([np.ones(2), np.zeros(2)], collate_fn_map=torch_private.default_collate_fn_map)
    assert torch.equal(batch, torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=torch.float64))
    assert torch_private.np_str_obj_array_pattern.search(np.array(["a"]).dtype.str)
    assert "{}" in torch_private.default_collate_err_msg_format


def test_worker_info_and_numpy_seed():
    torch_private.set_worker_info(3, 4, 1234, Squares())
    try:
        info = get_worker_info()
        assert (info.id, info.num_workers, info.seed) == (3, 4, 1234)
    finally:
        torch_private.set_worker_info.__globals__["_worker"]._worker_info = None
    np.random.seed(torch_private.numpy_worker_seed(99, 1))  # a seed numpy takes
    assert torch_private.numpy_worker_seed(99, 1) == torch_private.numpy_worker_seed(99, 1)
    assert torch_private.numpy_worker_seed(99, 1) != torch_private.numpy_worker_seed(99, 2)


def test_sparse_validation_hook():
    torch_private.validate_loaded_sparse_tensors()  # nothing pending: a no-op that exists


class CountWithShortLen(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, 6, step))

    def __len__(self):
        return 2


def test_next_batch_keeps_torchs_profiler_range_and_length_warning():
    """next_batch skips torch's record_function only while no profiler is on: under one, each
    batch has its range, named as torch names it; and an IterableDataset yielding more than its
    __len__ warns as under torch."""
    from torch.profiler import ProfilerActivity, profile

    from shmloader import ShmDataLoader

    loader = ShmDataLoader(Squares(), batch_size=1, num_workers=1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        batches = list(loader)
    ranges = [e.name for e in prof.events() if e.name.startswith("enumerate(DataLoader)#")]
    assert len(batches) == 5
    assert len(ranges) >= 5 and set(ranges) == {"enumerate(DataLoader)#_ShmLoaderIter.__next__"}
    assert len(list(loader)) == 5  # and without a profiler, the same batches
    shm = ShmDataLoader(CountWithShortLen(), batch_size=1, num_workers=1)
    assert len(shm) == 2
    with pytest.warns(UserWarning, match="Length of IterableDataset"):
        got = [int(b) for b in shm]
    assert got == list(range(6))


def test_a_shared_storage_fd_and_its_mapping():
    """torch's private storage calls behind NOTE [ Views of a storage already in shared memory ]
    (shared_views.py): the fd of a `share_memory_()` storage, none for a heap one, and a second
    mapping of that fd that sees the same bytes."""
    shared = torch.arange(1024, dtype=torch.float32).share_memory_()
    fd = torch_private.shared_memory_fd(shared.untyped_storage())
    assert fd is not None and fd >= 0
    assert torch_private.shared_memory_fd(torch.zeros(8).untyped_storage()) is None
    mapped = torch_private.storage_from_shared_fd(fd, shared.untyped_storage().nbytes())
    view = torch.empty(0).set_(mapped, 10, (4,), (1,))
    shared[10] = -1.0
    assert view.tolist() == [-1.0, 11.0, 12.0, 13.0]
