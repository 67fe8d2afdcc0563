"""Run by tests/test_accelerate.py, in one process (`python -m tests._accelerate_script OUT_DIR`) and
under torchrun with two ranks (gloo, CPU): for each case, `shmloader.accelerate_prepare` and
accelerate's own `accelerator.prepare` are given a ShmDataLoader and a torch DataLoader with the
same arguments; each rank checks, epoch by epoch, that the two yield the same batches in the same
order on the same device, that the prepared loader is accelerate's own wrapper around a
ShmDataLoader whose batches came through slots (`stats()`), and writes what it saw to
OUT_DIR/rank<r>.json for the test to check the shards across ranks.

Cases:
  shuffle   `shuffle=True` with a seeded generator, accelerate's default configuration: each
            process gets every num_processes-th batch, the sampler's random state is
            synchronised from rank 0 at each epoch; persistent workers;
  seedable  `DataLoaderConfiguration(use_seedable_sampler=True, data_seed=...)` and
            `loader.set_epoch(epoch)` each epoch, as accelerate's reproducibility guide does;
  dispatch  an IterableDataset: accelerate's default is then `DataLoaderDispatcher`, where the
            main process loads each batch and sends every process its slice.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader

import shmloader
from shmloader import ShmDataLoader

from . import _datasets as ds
from ._helpers import assert_same_batches, collect, seeded

EPOCHS = 2
SLOT_BYTES = 1 << 16
MAX_RING_SLOTS = 13


def devices(batch) -> list[str]:
    """The device of every tensor leaf, in order."""
    if isinstance(batch, torch.Tensor):
        return [str(batch.device)]
    if isinstance(batch, dict):
        return [d for value in batch.values() for d in devices(value)]
    if isinstance(batch, (list, tuple)):
        return [d for value in batch for d in devices(value)]
    return []


def prepare_both(accelerator, dataset, **kwargs):
    shm = ShmDataLoader(dataset, slot_bytes=SLOT_BYTES, max_ring_slots=MAX_RING_SLOTS,
                        generator=seeded(7), **kwargs)
    ref = DataLoader(dataset, generator=seeded(7), **kwargs)
    return shmloader.accelerate_prepare(accelerator, shm), accelerator.prepare(ref)


def run_case(accelerator, shm, ref, set_epoch: bool) -> dict:
    assert type(shm) is type(ref), f"{type(shm).__name__} != accelerate's {type(ref).__name__}"
    assert isinstance(shm, ShmDataLoader) and type(shm.base_dataloader) is ShmDataLoader
    assert type(ref.base_dataloader) is DataLoader
    assert (shm.slot_bytes, shm.max_ring_slots) == (SLOT_BYTES, MAX_RING_SLOTS)
    assert shmloader.accelerate_prepare(accelerator, shm) is shm  # preparing twice changes nothing
    labels, batches = [], []
    for epoch in range(EPOCHS):
        if set_epoch:
            shm.set_epoch(epoch)
            ref.set_epoch(epoch)
        got, want = collect(shm), collect(ref)
        assert_same_batches(got, want)
        assert [devices(b) for b in got] == [devices(b) for b in want]
        assert all(torch.device(d).type == accelerator.device.type for b in got for d in devices(b))
        key = "label" if "label" in got[0] else "i"
        labels.append([int(x) for b in got for x in b[key]])
        stats = shm.stats()
        batches.append(None if stats is None else stats.batches)
    return {"type": type(shm).__name__, "labels": labels, "stats_batches": batches,
            "batches_per_epoch": [len(lab) for lab in labels]}


def main(out_dir: str) -> None:
    accelerator = Accelerator(cpu=True)
    results = {"rank": accelerator.process_index, "world": accelerator.num_processes}

    shm, ref = prepare_both(accelerator, ds.DictDataset(n=32), batch_size=4, shuffle=True,
                            num_workers=2, persistent_workers=True)
    results["shuffle"] = run_case(accelerator, shm, ref, set_epoch=False)
    results["shuffle"]["batches"] = len(shm)
    del shm, ref

    shm, ref = prepare_both(accelerator, ds.ShardedStream(n=26), batch_size=4, num_workers=2)
    results["dispatch"] = run_case(accelerator, shm, ref, set_epoch=False)
    del shm, ref

    seedable = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_seedable_sampler=True, data_seed=11))
    shm, ref = prepare_both(seedable, ds.DictDataset(n=32), batch_size=4, shuffle=True,
                            num_workers=2)
    results["seedable"] = run_case(seedable, shm, ref, set_epoch=True)
    del shm, ref

    accelerator.wait_for_everyone()
    with open(os.path.join(out_dir, f"rank{accelerator.process_index}.json"), "w") as out:
        json.dump(results, out)
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
