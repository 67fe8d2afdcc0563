"""Arrays the dataset or the collate_fn keeps and returns in a later batch (NOTE [ Arrays kept
across batches ] in shmloader/worker.py): an array born in a slot is never overwritten while
someone still holds it, so every batch is torch's, bit for bit.  Each case here gave wrong
batches, silently, when the slot was written over a kept array."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
from torch.utils.data import DataLoader, Dataset, IterableDataset

from shmloader import ShmDataLoader

from ._helpers import assert_same_batches

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]

SHAPE = (64, 128)  # 64 KiB of float64 a sample: row-sized, born in the slot


class Rows(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return np.full(SHAPE, float(i))


class BigRows(Rows):
    """Batches of 4 × 2.5 MiB: the first slot is sized by a guess (worker.first_slot_guess)."""

    def __getitem__(self, i):
        return np.full((320, 1024), float(i))


class ReturnsLater(Dataset):
    """Keeps each array it makes and returns it two samples later (a prefetch or reorder queue)."""

    def __init__(self):
        self.queue = []

    def __len__(self):
        return 48

    def __getitem__(self, i):
        self.queue.append(np.full(SHAPE, float(i)))
        return self.queue.pop(0) if len(self.queue) > 2 else self.queue[-1]


class ShuffleBuffer(IterableDataset):
    """A webdataset-style shuffle buffer: yields a random one of the last 8 arrays it made."""

    def __iter__(self):
        rng, buffer = random.Random(0), []
        for i in range(64):
            buffer.append(np.full(SHAPE, float(i)))
            if len(buffer) >= 8:
                yield buffer.pop(rng.randrange(len(buffer)))
        while buffer:
            yield buffer.pop(rng.randrange(len(buffer)))


class StacksEarlier:
    """A collate_fn that keeps every batch it stacks and returns the one of two calls before."""

    def __init__(self):
        self.stacked = []

    def __call__(self, samples):
        self.stacked.append(np.stack(samples))
        return self.stacked[-3] if len(self.stacked) >= 3 else self.stacked[-1]


def identity(samples):
    return samples


def _both(make_dataset, make_collate, num_workers):
    kwargs = {"batch_size": 4, "num_workers": num_workers}
    got = [b for b in ShmDataLoader(make_dataset(), collate_fn=make_collate(), **kwargs)]
    want = [b for b in DataLoader(make_dataset(), collate_fn=make_collate(), **kwargs)]
    return got, want


@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize("make_dataset, make_collate", [
    (Rows, StacksEarlier),
    (BigRows, StacksEarlier),
    (ReturnsLater, lambda: None),
    (ReturnsLater, lambda: identity),
    (ShuffleBuffer, lambda: None),
    (ShuffleBuffer, lambda: identity),
], ids=["collate-returns-earlier", "collate-returns-earlier-big", "dataset-returns-later", "dataset-returns-later-identity",
        "shuffle-buffer", "shuffle-buffer-identity"])
def test_an_array_kept_and_returned_later_is_never_overwritten(make_dataset, make_collate, num_workers):
    got, want = _both(make_dataset, make_collate, num_workers)
    assert_same_batches(got, want)
    del got


def test_sample_parallel_never_overwrites_an_array_the_dataset_returns_later():
    """One worker fetches every row in torch's order, so a dataset with a queue of its own gives
    torch's batches only if no row write lands on an array it still holds."""
    kwargs = {"batch_size": 4, "num_workers": 1}
    got = [b for b in ShmDataLoader(ReturnsLater(), sample_parallel=True, **kwargs)]
    want = [b for b in DataLoader(ReturnsLater(), **kwargs)]
    assert_same_batches(got, want)
    del got


class KeepsOddAndChangesThem(Dataset):
    """Even samples are new arrays; an odd sample is kept, and changed in place when revisited."""

    def __init__(self):
        self.state = {}

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i % 2 == 0:
            return np.full(SHAPE, float(i))
        if i in self.state:
            self.state[i] += 100
        else:
            self.state[i] = np.full(SHAPE, float(i))
        return self.state[i]


def test_sample_parallel_batches_do_not_change_when_the_dataset_changes_what_it_kept():
    """A row born in the slot that the dataset keeps (found after the probe) must not tie the
    delivered batch to the dataset's array: torch's batch is a copy, so it never changes."""
    kwargs = {"batch_size": 7, "num_workers": 2, "sampler": list(range(8)) * 4}
    loader = ShmDataLoader(KeepsOddAndChangesThem(), sample_parallel=True, **kwargs)
    held, on_receipt = [], []
    for batch in loader:
        held.append(batch)
        on_receipt.append(batch.clone())
    assert_same_batches(held, on_receipt)
    del held, loader


class PoisonsWhatItKept(Dataset):
    """Odd samples are kept, and set to -1 in place when their index comes again (a new array
    is returned then); index SLOW takes a while.  No array is -1 when it is returned, so a
    -1 in a batch is a change that landed after the row was fetched."""

    SLOW = 10

    def __init__(self):
        self.kept = {}

    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i in self.kept:
            self.kept.pop(i)[...] = -1.0
        if i == self.SLOW:
            time.sleep(0.5)
        sample = np.full(SHAPE, float(i))
        if i % 2:
            self.kept[i] = sample
        return sample


def test_sample_parallel_a_kept_row_changed_before_its_batch_completes_is_delivered_as_fetched():
    """NOTE [ Rows born in place ]: worker 0 writes row 0 of batch 1 (index 1, kept by the
    dataset, born in the slot) and goes on to batch 2, where index 1 comes again and the dataset
    changes its kept array in place, while worker 1 is still on batch 1 (index SLOW).  Batch 1
    must hold index 1's values as fetched, as torch's would."""
    sampler = [0, 2, 4, 6, 1, 8, PoisonsWhatItKept.SLOW, 12, 1, 14, 3, 5]
    loader = ShmDataLoader(PoisonsWhatItKept(), batch_size=4, num_workers=2, sampler=sampler,
                           sample_parallel=True)
    got = [batch.clone() for batch in loader]
    firsts = [[float(batch[row, 0, 0]) for row in range(len(batch))] for batch in got]
    assert firsts[:2] == [[0, 2, 4, 6], [1, 8, PoisonsWhatItKept.SLOW, 12]], firsts
    for batch in got:
        assert bool((batch == batch[:, :1, :1]).all()), "a row is not one value throughout"
    del got, loader


class KeepsABufferItDoesNotReturn(Dataset):
    """On its second call in each process it makes a row-sized buffer (born in the row being
    fetched) and keeps it as state; every sample is made apart from it and adds it: a lazily
    built mean image or noise bank.  Each call checks that the buffer still holds what it
    wrote."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 2:
            self.offset = np.empty(SHAPE)
            self.offset.fill(0.5)
        if self.calls >= 2 and not bool((self.offset == 0.5).all()):
            raise AssertionError("the dataset's kept buffer was overwritten")
        sample = np.full(SHAPE, float(i))
        sample += self.offset if self.calls >= 2 else 0.5
        return sample


@pytest.mark.parametrize("num_workers", [1, 2])
def test_sample_parallel_never_writes_a_row_over_a_buffer_the_dataset_keeps(num_workers):
    """NOTE [ Rows born in place ]: the buffer takes the row's memory and the sample comes from
    elsewhere; the sample's row must not be written over the buffer (the worker wrote it there,
    and every later sample of that worker added another sample's values: 14 of 32 rows wrong)."""
    kwargs = {"batch_size": 8}
    want = [b for b in DataLoader(KeepsABufferItDoesNotReturn(), **kwargs)]
    loader = ShmDataLoader(KeepsABufferItDoesNotReturn(), num_workers=num_workers, sample_parallel=True, **kwargs)
    held = [b for b in loader]
    assert_same_batches(held, want)
    assert_same_batches([b for b in loader], want)  # a second epoch
    del held, loader


class MemmapAndMaskedRows(Dataset):
    """Samples with a memory-mapped row and a masked-array row, beside a row of 20 KiB (fetched
    into the slot, NOTE [ Samples born in the slot ]); torch's default_collate takes both as the
    arrays they are."""

    def __init__(self, path):
        self.path = path

    def __len__(self):
        return 16

    def __getitem__(self, i):
        table = np.load(self.path, mmap_mode="r")
        masked = np.ma.masked_array(np.full((16, 300), i, np.float32), mask=np.arange(4800).reshape(16, 300) % 3 == 0)
        return {"memmap": table[i], "masked": masked, "y": np.full(5000, i, np.float32)}


@pytest.mark.parametrize("sample_parallel", [False, True])
def test_memmap_and_masked_rows_under_the_default_collate(tmp_path, sample_parallel):
    """torch stacks a memmap as the array it is and a masked array's data (its mask ignored).
    In the default mode they raised AttributeError ('memmap' object has no attribute
    'data_ptr') while the batch was written (numpy subclasses were taken for tensors); under
    sample_parallel a masked array was refused (RowsUnsupportedError)."""
    path = tmp_path / "table.npy"
    np.save(path, np.arange(16 * 1000, dtype=np.float32).reshape(16, 1000))
    want = [b for b in DataLoader(MemmapAndMaskedRows(path), batch_size=4)]
    got = [b for b in ShmDataLoader(MemmapAndMaskedRows(path), batch_size=4, num_workers=2,
                                    sample_parallel=sample_parallel)]
    assert_same_batches(got, want)
    del got


class RefillsOneBuffer:
    """A collate_fn that stacks every batch into one buffer it keeps and returns it (out=)."""

    def __init__(self):
        self.buffers = {}

    def __call__(self, samples):
        key = len(samples)
        if key not in self.buffers:
            self.buffers[key] = np.empty((key, *samples[0].shape), samples[0].dtype)
        return np.stack(samples, out=self.buffers[key])


class ZeroesItsLastBatch:
    """A collate_fn that keeps the batch it returned and zeroes it at its next call."""

    def __init__(self):
        self.last = None

    def __call__(self, samples):
        if self.last is not None:
            self.last *= 0
        self.last = np.stack(samples)
        return self.last


class FewBigRows(BigRows):
    """4 batches of 10 MiB: the first is born in a slot sized by a guess, and so is a buffer
    the collate_fn makes at its first call."""

    def __len__(self):
        return 16


@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize("make_dataset, make_collate", [
    (FewBigRows, RefillsOneBuffer),
    (Rows, ZeroesItsLastBatch),
    (FewBigRows, ZeroesItsLastBatch),
], ids=["refills-one-buffer", "zeroes-last", "zeroes-last-big"])
def test_a_collate_fn_that_writes_to_a_batch_it_returned_never_changes_a_delivered_one(make_dataset, make_collate,
                                                                                      num_workers):
    """The worker writes later into an array it returned (an out= buffer it refills, a batch it
    zeroes): each delivered batch stays as it was collated, held or not. The reference is built
    in this process: torch's own loader pickles a returned numpy batch in a feeder thread, after
    the collate_fn has returned, so on such a collate_fn it delivers the wrong batch now and then."""
    dataset = make_dataset()
    want = [np.stack([dataset[i] for i in range(k, min(k + 4, len(dataset)))]) for k in range(0, len(dataset), 4)]
    got = list(ShmDataLoader(dataset, batch_size=4, num_workers=num_workers, collate_fn=make_collate()))
    time.sleep(0.2)  # the workers' later writes, if any reached a delivered batch
    assert len(got) == len(want)
    for k, (batch, expected) in enumerate(zip(got, want)):
        assert np.array_equal(batch, expected), f"batch {k} changed after it was delivered"
