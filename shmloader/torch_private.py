"""torch's private DataLoader internals that shmloader needs, reached only through this module.

shmloader behaves as torch's DataLoader does by running torch's own code: its iterator base
class (sampler order, seeds, `len()`, epochs), its fetchers, its collate machinery and its
worker info.  Those live in private modules (`torch.utils.data._utils`, `dataloader._*`) that a
torch release may move; every use goes through the names below, so an upgrade touches this file.
tests/test_torch_private.py checks that each name still exists with the shape shmloader uses.

Attributes of torch's iterator base class that shmloader's iterator reads (set by torch's
`_BaseDataLoaderIter.__init__`/`_reset`): _dataset, _dataset_kind, _index_sampler, _num_workers,
_auto_collation, _collate_fn, _drop_last, _pin_memory, _pin_memory_device, _timeout,
_persistent_workers, _base_seed, _sampler_iter, _num_yielded, _next_index,
_IterableDataset_len_called, _profile_name.
"""

from __future__ import annotations

import torch
from torch.utils.data._utils import collate as _collate
from torch.utils.data._utils import worker as _worker
from torch.utils.data.dataloader import (
    _BaseDataLoaderIter,
    _DatasetKind,
    _InfiniteConstantSampler,
    _MultiProcessingDataLoaderIter,
    _SingleProcessDataLoaderIter,
)

BaseDataLoaderIter = _BaseDataLoaderIter  # the iterator shmloader's derives from
SingleProcessDataLoaderIter = _SingleProcessDataLoaderIter  # num_workers=0
DatasetKind = _DatasetKind  # Map / Iterable, and create_fetcher
InfiniteConstantSampler = _InfiniteConstantSampler  # the index sampler of an iterable dataset
# in_order=False: torch after 2.6 gives a task to the next worker with room for it (it counts
# `_workers_num_tasks`); torch 2.6 gives tasks round-robin, as with in_order=True.
OUT_OF_ORDER_BY_CAPACITY = "_workers_num_tasks" in _MultiProcessingDataLoaderIter._try_put_index.__code__.co_names

# The collate machinery: torch's `collate` with a handler map, as default_collate runs it.
collate = _collate.collate
default_collate_fn_map = _collate.default_collate_fn_map  # type -> handler; workers patch Tensor's
TORCH_COLLATE_TENSOR = _collate.collate_tensor_fn  # torch's tensor handler, before that patch
np_str_obj_array_pattern = _collate.np_str_obj_array_pattern  # numpy dtypes torch refuses
default_collate_err_msg_format = _collate.default_collate_err_msg_format


def key_error_message(text: str) -> str:
    """`text` as torch's workers hand a KeyError its message: a str whose repr() is itself, so
    the traceback prints its lines, not one quoted line of escapes."""
    from torch._utils import KeyErrorMessage

    return KeyErrorMessage(text)


def is_iter_datapipe(dataset) -> bool:
    """torch's `_reset` asks this at every epoch's start.  It is an ABC check: the first one after
    Python's ABC caches were invalidated (any ABC registration does it) costs ~0.4 ms, so the
    loader asks it once ahead of the epoch boundary it wants to be fast."""
    from torch.utils.data.datapipes.datapipe import IterDataPipe

    return isinstance(dataset, IterDataPipe)


def next_batch(it):
    """What torch's iterator `__next__` does (the epoch's sampler, `_next_data`, the count of
    batches yielded), for shmloader's iterator `it`.  torch wraps it in a profiler range
    (`record_function`), which costs ~17 us a batch even with no profiler on, when it records
    nothing.  So torch's own `__next__` runs while a profiler is on (the range is there, named
    as torch names it) and where torch would warn of an IterableDataset's stated length;
    otherwise its steps run without the range."""
    if torch._C._autograd._profiler_enabled() or (
            it._dataset_kind == _DatasetKind.Iterable and it._IterableDataset_len_called is not None):
        return _BaseDataLoaderIter.__next__(it)
    if it._sampler_iter is None:
        it._reset()
    data = it._next_data()
    it._num_yielded += 1
    return data


def create_fetcher(dataset_kind, dataset, auto_collation: bool, collate_fn, drop_last: bool):
    """torch's fetcher for a map-style or iterable dataset (it samples, and ends iterables)."""
    return _DatasetKind.create_fetcher(dataset_kind, dataset, auto_collation, collate_fn, drop_last)


def set_worker_info(worker_id: int, num_workers: int, seed: int, dataset) -> None:
    """What `torch.utils.data.get_worker_info()` returns inside this worker."""
    _worker._worker_info = _worker.WorkerInfo(id=worker_id, num_workers=num_workers, seed=seed,
                                              dataset=dataset)


def numpy_worker_seed(base_seed: int, worker_id: int):
    """The seed torch's workers give numpy's global RNG."""
    return _worker._generate_state(base_seed, worker_id)


def validate_loaded_sparse_tensors() -> None:
    """torch's unpickling of a sparse tensor parks it in a module-level list until validated
    (torch.load does it); left there it would hold a slot's lease forever."""
    if torch._utils._sparse_tensors_to_validate:
        torch._utils._validate_loaded_sparse_tensors()


def fetches_one_by_one(fetcher) -> bool:
    """Whether torch's `fetcher.fetch(index)` asks the dataset for one sample at a time (so
    `fetch_each` can run code around each): a batch of indices from a map-style dataset without
    __getitems__, or from an iterable one."""
    if not fetcher.auto_collation:
        return False
    if hasattr(fetcher, "dataset_iter"):
        return True
    dataset = fetcher.dataset
    return not (hasattr(dataset, "__getitems__") and dataset.__getitems__)


def fetch_each(fetcher, index, around_sample):
    """What torch's `fetcher.fetch(index)` returns (the fetcher's collate_fn is the identity
    here: the list of samples), with sample k asked for inside `around_sample(k, the samples
    fetched so far)`, a context manager or None.  The same calls as torch's fetchers make, in the same order: an iterable's
    end sets `fetcher.ended` and raises StopIteration exactly where torch's does.  Only where
    `fetches_one_by_one(fetcher)`."""
    iterable = hasattr(fetcher, "dataset_iter")
    if iterable and fetcher.ended:
        raise StopIteration
    data = []
    for k, i in enumerate(index):
        context = around_sample(k, data)
        try:
            if context is None:
                data.append(next(fetcher.dataset_iter) if iterable else fetcher.dataset[i])
            else:
                with context:
                    data.append(next(fetcher.dataset_iter) if iterable else fetcher.dataset[i])
        except StopIteration:
            if not iterable:
                raise
            fetcher.ended = True
            break
    if iterable and (not data or (fetcher.drop_last and len(data) < len(index))):
        raise StopIteration
    return fetcher.collate_fn(data)


def shared_memory_fd(storage: torch.UntypedStorage) -> int | None:
    """The fd of a CPU storage that lives in shared memory under torch's file_descriptor
    strategy (`share_memory_()`, a tensor torch's own workers or queues shared), else None: a
    heap storage, one shared under the file_system strategy, a file mapped by `from_file`."""
    if not storage.is_shared():
        return None
    try:
        fd = storage._get_shared_fd()
    except (RuntimeError, AttributeError):
        return None
    return fd if fd >= 0 else None


def storage_from_shared_fd(fd: int, nbytes: int) -> torch.UntypedStorage:
    """A storage mapping the shared-memory file `fd` (`nbytes` long), as torch's unpickling of
    a shared storage makes it; torch keeps a dup of `fd`, the caller closes its own."""
    return torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)
