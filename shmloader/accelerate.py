"""Hugging Face Accelerate: keep the shared-memory transport through `Accelerator.prepare`.

What `accelerator.prepare(loader)` does to a DataLoader (accelerate 1.x, `prepare_data_loader` in
accelerate/data_loader.py): it reads the loader's arguments back from its attributes (only the
ones torch's DataLoader has), wraps its batch sampler in a `BatchSamplerShard` (an iterable
dataset in an `IterableDatasetShard`) so that each process gets its share, and returns a
`DataLoaderShard` (`DataLoaderDispatcher` where the main process loads for all) whose
`base_dataloader` is a new `torch.utils.data.DataLoader` built from those arguments.  That object
reports torch's DataLoader as its `__class__`, iterates `base_dataloader`, moves each batch to the
device, and keeps the sampler's epoch and random state in step across processes.  So a
ShmDataLoader passed to `prepare` silently becomes a torch DataLoader: its batches go back to
torch's transport (pickled through a pipe, tensors in a new shared-memory segment per batch).

`accelerate_prepare(accelerator, *objects)` calls `accelerator.prepare(*objects)` as usual, then,
for each ShmDataLoader among `objects`, replaces the prepared object's `base_dataloader` with a
ShmDataLoader built from exactly the same arguments -- the same (sharded) batch sampler object,
dataset, collate_fn, workers, generator, ... -- plus the original's `slot_bytes`,
`max_ring_slots` and `max_ring_bytes`.  What accelerate does around the base loader (sharding, device placement,
`set_epoch`, synchronised sampler seeds, seedable samplers, dispatching) is unchanged, because it
is accelerate's own object that is returned; it now reports ShmDataLoader as its class and answers
`stats()` (tests/test_accelerate.py compares it with accelerate's own, batch for batch).

Not covered: `use_stateful_dataloader=True` (the base is torchdata's StatefulDataLoader) and torch
XLA (a different wrapper) raise TypeError; `accelerator.skip_first_batches(loader, n)` builds a
new torch DataLoader, whose batches take torch's transport.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from .loader import ShmDataLoader


def accelerate_prepare(accelerator, *objects: Any, device_placement: list[bool] | None = None):
    """`accelerator.prepare(*objects)`, with every ShmDataLoader among `objects` still moving its
    batches through shared memory.  Returns what `accelerator.prepare` returns (one object, or a
    tuple in the order given)::

        model, optimizer, loader = shmloader.accelerate_prepare(accelerator, model, optimizer, loader)
    """
    prepared = accelerator.prepare(*objects, device_placement=device_placement)
    results = (prepared,) if len(objects) == 1 else tuple(prepared)
    results = tuple(
        _keep_shared_memory(result, original) if isinstance(original, ShmDataLoader) else result
        for original, result in zip(objects, results)
    )
    return results[0] if len(objects) == 1 else results


def _keep_shared_memory(prepared, original: ShmDataLoader):
    from accelerate.data_loader import DataLoaderAdapter

    if not isinstance(prepared, DataLoaderAdapter):
        raise TypeError(
            f"accelerate_prepare: accelerator.prepare turned the ShmDataLoader into a "
            f"{type(prepared).__module__}.{type(prepared).__name__}, which does not wrap a "
            f"DataLoader that shmloader can take the place of (torch XLA's loader is not supported)"
        )
    base = prepared.base_dataloader
    if isinstance(base, ShmDataLoader):
        return prepared  # prepared before, by accelerate_prepare
    if type(base) is not DataLoader:
        raise TypeError(
            f"accelerate_prepare: accelerate built a {type(base).__module__}.{type(base).__name__} "
            f"for the ShmDataLoader; shmloader can take the place of torch's DataLoader only "
            f"(use_stateful_dataloader=True is not supported)"
        )
    prepared.base_dataloader = _shm_like(base, original)
    return prepared


def _shm_like(base: DataLoader, original: ShmDataLoader) -> ShmDataLoader:
    """A ShmDataLoader that yields what `base` would, with `original`'s slot arguments and modes."""
    sample_parallel = original.sample_parallel
    if isinstance(base.dataset, IterableDataset):
        batching: dict[str, Any] = {"batch_size": base.batch_size, "drop_last": base.drop_last}
    elif base.batch_sampler is not None:
        batching = {"batch_sampler": base.batch_sampler}
    else:  # accelerate passed a batch sampler as `sampler`, with batch_size=None
        batching = {"sampler": base.sampler, "batch_size": None}
        if sample_parallel:
            warnings.warn("accelerate_prepare: accelerate hands this loader its batches as single "
                          "samples (a batch sampler as `sampler`), which sample_parallel=True cannot "
                          "spread over the workers; the prepared loader runs in the default mode",
                          stacklevel=3)
            sample_parallel = False
    return ShmDataLoader(
        base.dataset, **batching, num_workers=base.num_workers, collate_fn=base.collate_fn,
        pin_memory=base.pin_memory, timeout=base.timeout, worker_init_fn=base.worker_init_fn,
        multiprocessing_context=base.multiprocessing_context, generator=base.generator,
        prefetch_factor=base.prefetch_factor, persistent_workers=base.persistent_workers,
        pin_memory_device=base.pin_memory_device, in_order=base.in_order,
        slot_bytes=original.slot_bytes, max_ring_slots=original.max_ring_slots,
        max_ring_bytes=original.max_ring_bytes, sample_parallel=sample_parallel,
        prefetch_next_epoch=original.prefetch_next_epoch,
    )
