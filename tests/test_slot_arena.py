"""A numpy collate_fn's arrays are born in the slot (NOTE [ One copy for a numpy collate_fn ] in
shmloader/worker.py, csrc/arena.h): the batches are still torch's, bit for bit; arrays the
collate_fn keeps never share bytes with a slot that is written again; anything the arena cannot
serve (small, too large, odd dtypes, other threads) takes the copy path."""

from __future__ import annotations

import copy
import gc

import numpy as np
import pytest
import torch
from numpy._core.multiarray import get_handler_name
from torch.utils.data import DataLoader, Dataset

from shmloader import ShmDataLoader, layout
from shmloader._ring import SlotArena
from shmloader.segment import create_segment

from ._helpers import assert_same_batches

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]

ROW = 64 * 1024  # bytes per sample: batches are well above the arena's threshold


class Rows(Dataset):
    def __init__(self, n: int = 48, row: int = ROW, dtype=np.float32):
        self.n, self.count, self.dtype = n, row // np.dtype(dtype).itemsize, np.dtype(dtype)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        assert get_handler_name() == "default_allocator", "the arena leaked out of the collate_fn"
        return (np.arange(self.count) % 251 + i).astype(self.dtype)


def stack(samples):
    return np.stack(samples)


def concat_dict(samples):
    return {"x": np.concatenate(samples), "y": np.stack([s[:3] for s in samples]),
            "ids": np.arange(len(samples))}


def fill(samples):
    out = np.empty((len(samples), *samples[0].shape), samples[0].dtype)
    for i, s in enumerate(samples):
        out[i] = s
    return out


def views(samples):
    whole = np.stack(samples)
    return whole, whole[1:], whole.T  # one in place, the others copied (torch gives three copies)


def _both(dataset, collate_fn, hold: bool = False, **kwargs):
    """(shmloader's batches, torch's batches, shmloader's stats).  A training loop drops each
    batch (its slot is reused): copies are compared; `hold` keeps the batches themselves."""
    kwargs.setdefault("batch_size", 4)
    kwargs.setdefault("num_workers", 2)
    keep = (lambda b: b) if hold else copy.deepcopy
    loader = ShmDataLoader(dataset, collate_fn=collate_fn, **kwargs)
    shm = [keep(b) for b in loader]
    ref = [b for b in DataLoader(dataset, collate_fn=collate_fn, **kwargs)]
    return shm, ref, loader.stats()


BIG_ROW = 3 << 20  # 4 samples a batch: above GUESS_MIN_BYTES, so the first slot is guessed


def quarter(samples):
    return np.stack(samples[:1])


def twice(samples):
    return np.concatenate([np.stack(samples), np.stack(samples)])


@pytest.mark.parametrize("num_workers", [1, 2])
def test_the_first_batch_of_a_numpy_collate_is_born_in_its_slot(num_workers):
    """Before the ring knows its slot size, the samples' bytes size the slot (first_slot_guess):
    every batch, each worker's first included, is stacked in place, none copied from the heap."""
    from shmloader.worker import GUESS_MIN_BYTES

    assert 4 * BIG_ROW >= GUESS_MIN_BYTES
    shm, ref, stats = _both(Rows(n=16, row=BIG_ROW), stack, num_workers=num_workers)
    assert_same_batches(shm, ref)
    assert stats.in_place_bytes == len(shm) * 4 * BIG_ROW, stats
    assert stats.slot_bytes < 4 * BIG_ROW + (1 << 20), stats
    del shm


class Sequences(Dataset):
    """32 sequences of 512 float32 features, 1024-2047 rows (2-4 MiB): padded batches of 4 are
    above GUESS_MIN_BYTES, so slots the ring leaves to their batch's size are guessed."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        return np.full((1024 + (i * 389) % 1024, 512), i, np.float32)


def pad_numpy(samples):
    out = np.zeros((len(samples), max(len(s) for s in samples), 512), np.float32)
    for k, sample in enumerate(samples):
        out[k, : len(sample)] = sample
    return out


def pad_torch(samples):
    return torch.nn.utils.rnn.pad_sequence([torch.from_numpy(s) for s in samples], batch_first=True)


@pytest.mark.parametrize("collate_fn", [pad_numpy, pad_torch])
def test_kept_batches_of_a_padding_collate_are_born_in_their_slots(collate_fn):
    """A loop that keeps every batch of dynamic padding: each batch's slot is made at a guessed
    size (NOTE [ Held batches of varying size ] in ring.py).  Once a worker has seen a batch as
    large as its samples padded to the longest, its guesses count them so, and its batches are
    built in place; with guesses of the samples' bytes as they are, each batch was too large
    for its slot and was made on the heap and copied (a quarter in place)."""
    shm, ref, stats = _both(Sequences(), collate_fn, hold=True)
    assert_same_batches(shm, ref)
    assert stats.in_place_bytes >= 0.5 * sum(b.nbytes for b in shm), stats
    del shm


class Uneven(Dataset):
    """32 sequences of 1024 float32 features: every fourth 2048 rows long (8 MiB), the rest 128."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        return np.full((2048 if i % 4 == 0 else 128, 1024), i, np.float32)


def concatenate(samples):
    return np.concatenate(samples)


@pytest.mark.parametrize("hold", [False, True])
def test_a_joining_collate_of_samples_of_several_sizes_is_guessed_as_they_are(hold):
    """np.concatenate of one long and three short sequences a batch (9.5 MiB): the guess that
    counts the samples as they are fits every batch, each worker's first included; one that
    padded them to the longest (32 MiB) would be far too big, and those batches would be copied
    into slots of their own size."""
    shm, ref, stats = _both(Uneven(), concatenate, hold=hold)
    assert_same_batches(shm, ref)
    assert stats.in_place_bytes == sum(b.nbytes for b in shm), stats
    del shm


@pytest.mark.parametrize("collate_fn", [quarter, twice])
def test_a_wrong_first_slot_guess_does_not_size_the_ring(collate_fn):
    """A batch much smaller than its samples gets a slot of its own size (the ring learns its
    slot size from the first slot); a bigger one grows from nothing, not from the guess."""
    shm, ref, stats = _both(Rows(n=16, row=BIG_ROW), collate_fn, num_workers=2)
    assert_same_batches(shm, ref)
    batch_bytes = shm[0].nbytes
    assert batch_bytes <= stats.slot_bytes <= batch_bytes + batch_bytes // 64 + (1 << 20), (batch_bytes, stats)
    del shm


@pytest.mark.parametrize("hold", [False, True])
@pytest.mark.parametrize("collate_fn", [stack, concat_dict, fill, views])
def test_numpy_collates_give_torchs_batches(collate_fn, hold):
    shm, ref, stats = _both(Rows(), collate_fn, hold=hold, persistent_workers=True)
    assert_same_batches(shm, ref)
    # all but each worker's first batch or two (no created slot in hand yet) are built in place
    assert stats.in_place_bytes >= (len(shm) - 4) * 4 * ROW, stats
    del shm


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.complex128, np.dtype(">f8"),
                                   np.dtype([("a", "<i4"), ("b", "<f2")])])
def test_odd_dtypes(dtype):
    shm, ref, _ = _both(Rows(n=24, dtype=dtype), stack)
    assert_same_batches(shm, ref)
    del shm


class KeepsItsOutput:
    """A collate_fn that caches every batch it returns and checks, at each call, that none of
    them changed: a slot written again under a kept array would fail it."""

    def __init__(self):
        self.kept = []

    def __call__(self, samples):
        for batch, snapshot in self.kept:
            if not np.array_equal(batch, snapshot):
                raise AssertionError("a batch the collate_fn kept was overwritten")
        batch = np.stack(samples)
        self.kept.append((batch, batch.copy()))
        return batch


def test_arrays_the_collate_keeps_are_never_overwritten():
    shm, ref, stats = _both(Rows(n=96), KeepsItsOutput(), prefetch_factor=2)
    assert_same_batches(shm, ref)
    # No batch is read from memory the collate_fn keeps: each kept one was moved to a new
    # segment, or (its arena full of the checks' temporaries) laid out anew from its slot's start.
    assert stats.in_place_bytes == 0, stats
    del shm


def two_stacks(samples):
    return {"a": np.stack(samples), "b": np.stack([s[::-1] for s in samples])}


@pytest.mark.parametrize("collate_fn", [stack, two_stacks])
def test_large_slots_hold_the_batch_and_its_block_prefixes_not_a_fraction_more(collate_fn):
    """A slot made for a custom collate_fn is the batch plus what its arena blocks need (a prefix
    each, and 64 KiB at most for small temporaries), not a flat 1/128 of the batch (2 MiB per
    slot at 256 MiB: above torch's memory at the same point); the batches are still born in it."""
    row = 4 << 20  # 4 rows a batch: 16 MiB, or 32 MiB with two leaves
    shm, ref, stats = _both(Rows(n=24, row=row), collate_fn, num_workers=1)
    assert_same_batches(shm, ref)
    batch_bytes = sum(leaf.nbytes for leaf in (ref[0].values() if isinstance(ref[0], dict) else [ref[0]]))
    assert stats.slot_bytes - batch_bytes <= 96 * 1024, (stats.slot_bytes, batch_bytes)
    assert stats.in_place_bytes >= (len(shm) - 3) * batch_bytes, stats
    del shm


class GrowingRows(Rows):
    def __getitem__(self, i):
        return np.full(self.count * (1 + i // 8), i, dtype=np.float32)


def pad_stack(samples):
    width = max(len(s) for s in samples)
    out = np.zeros((len(samples), width), np.float32)
    for i, s in enumerate(samples):
        out[i, : len(s)] = s
    return out


def test_batches_larger_than_their_slot_fall_back_to_the_copy_path():
    shm, ref, _ = _both(GrowingRows(n=40), pad_stack)
    assert_same_batches(shm, ref)
    del shm


class ImageRows(Dataset):
    """(16, 24, 3) float32 images, 4.5 KiB each: a batch of 4 is 18 KiB, above the arena's threshold."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return np.arange(16 * 24 * 3, dtype=np.float32).reshape(16, 24, 3) + 1000 * i


def fortran_beside_a_transpose(samples):
    whole = np.stack(samples)
    return whole.transpose(0, 3, 1, 2), np.asfortranarray(whole)


def fortran_beside_a_reversal(samples):
    whole = np.stack(samples)
    return whole[:, ::-1], np.asfortranarray(whole.reshape(len(samples), -1))


@pytest.mark.parametrize("hold", [False, True])
@pytest.mark.parametrize("collate_fn", [fortran_beside_a_transpose, fortran_beside_a_reversal])
def test_fortran_ordered_leaves_laid_out_anew_keep_their_order(collate_fn, hold):
    """When the arena's blocks hold more than the batch, the batch is laid out from the slot's
    start and what lies in the slot is copied out first: a Fortran-ordered leaf must be copied
    in Fortran order, as its descriptor says (a C-ordered copy delivered its values scrambled,
    flagged F, with no error)."""
    for num_workers in (1, 2):
        shm, ref, _ = _both(ImageRows(), collate_fn, hold=hold, num_workers=num_workers)
        assert_same_batches(shm, ref)
        del shm


class FortranSamples(Dataset):
    """Samples born C-ordered and returned transposed (F-ordered), 22.5 KiB each."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return np.random.default_rng(i).standard_normal((48, 40, 3)).astype(np.float32).T


def records(samples):
    return samples


@pytest.mark.parametrize("hold", [False, True])
def test_fortran_ordered_samples_through_a_records_collate(hold):
    """The forum's records collate over samples the dataset returns F-ordered (born in the slot
    by the samples' arena): every sample as torch delivers it, in every epoch."""
    loader = ShmDataLoader(FortranSamples(), batch_size=4, num_workers=2, collate_fn=records)
    ref = list(DataLoader(FortranSamples(), batch_size=4, num_workers=2, collate_fn=records))
    keep = (lambda b: b) if hold else copy.deepcopy
    for _ in range(2):
        shm = [keep(b) for b in loader]
        assert_same_batches(shm, ref)
        del shm


LAYOUTS = {  # a (20, 24, 16) float32 sample (30 KiB, born in the worker) in each memory layout
    "C": lambda a: a,
    "F": np.asfortranarray,
    "transposed": lambda a: a.transpose(2, 0, 1),
    "reversed": lambda a: a[::-1, :, ::-2],
    "F view": lambda a: a.T,
}


class Layouts(Dataset):
    def __init__(self, layout_name: str):
        self.make = LAYOUTS[layout_name]

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return self.make(np.random.default_rng(i).standard_normal((20, 24, 16)).astype(np.float32))


def stack_and_views(samples):
    whole = np.stack(samples)
    return {"samples": samples, "whole": whole, "chw": whole.transpose(0, 3, 1, 2),
            "F": np.asfortranarray(whole[:, ::-1])}


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("collate_fn", [records, stack_and_views, None])
def test_every_memory_layout_born_in_the_worker_comes_back_as_torchs(layout_name, collate_fn):
    """Samples made in the worker (born in the slot) in every memory layout, through a records
    collate, one returning stacks, views and Fortran copies side by side, and the default one."""
    if collate_fn is None and layout_name == "reversed":  # torch's default collate refuses negative strides
        with pytest.raises(ValueError, match="negative"):
            list(DataLoader(Layouts(layout_name), batch_size=4))
        with pytest.raises(ValueError, match="negative"):
            list(ShmDataLoader(Layouts(layout_name), batch_size=4, num_workers=2))
        return
    shm, ref, _ = _both(Layouts(layout_name), collate_fn, hold=True, num_workers=2)
    assert_same_batches(shm, ref)
    del shm


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("SHMLOADER_SLOT_ARENA", "0")
    shm, ref, stats = _both(Rows(n=16), stack)
    assert_same_batches(shm, ref)
    assert stats.in_place_bytes == 0
    del shm


def test_a_collate_error_restores_numpys_allocator():
    def failing(samples, calls=[]):  # noqa: B006 - counts calls in this worker
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("collate failed")
        return np.stack(samples)

    loader = ShmDataLoader(Rows(n=16), batch_size=2, num_workers=1, collate_fn=failing,
                           multiprocessing_context="fork")
    got = []
    it = iter(loader)
    with pytest.raises(ValueError, match="collate failed"):
        while True:
            got.append(next(it))
    got.extend(it)  # the epoch goes on; Rows asserts the allocator is numpy's again
    assert len(got) == 7
    del it, got


# -- the layout's side, without a loader --------------------------------------------------------------


def test_leaves_born_in_the_arena_are_described_not_copied():
    segment = create_segment(1 << 22, 0)
    samples = [np.full(ROW // 4, i, np.float32) for i in range(8)]
    arena = SlotArena(segment, layout.HEADER_BYTES, 16 * 1024)
    with arena:
        batch = {"x": np.stack(samples), "small": np.arange(3), "again": None}
    batch["again"] = batch["x"]  # the same array twice: both described at its one place
    plan = layout.plan_batch(batch, arena)
    copied = [leaf for _offset, leaf in plan.leaves]
    assert len(copied) == 1 and copied[0] is batch["small"]  # the stacked array is not copied
    assert plan.descriptor_offset >= arena.used_end
    assert segment.claim(0, 0) == 0
    layout.write_batch(segment, plan)
    segment.publish(len(plan.descriptor), plan.total_bytes, plan.descriptor_offset)
    want = {k: v.copy() for k, v in batch.items() if v is not None}
    del batch, plan
    assert arena.release() == 0  # nothing kept: the slot is the batch's alone
    from shmloader._ring import SlotLease

    lease = SlotLease(segment, 0, 0, 0, None)
    descriptor = segment.read(segment.header()[9], segment.header()[7])
    got = layout.read_batch(lease, descriptor, segment.header()[8])
    np.testing.assert_array_equal(got["x"], want["x"])
    np.testing.assert_array_equal(got["small"], want["small"])
    assert np.shares_memory(got["again"], got["x"])  # views of the same bytes, as in the slot
    del got, lease, segment
    gc.collect()


def test_a_kept_block_keeps_its_segment_mapped():
    segment = create_segment(1 << 20, 0)
    arena = SlotArena(segment, layout.HEADER_BYTES, 1024)
    with arena:
        kept = np.full(10_000, 7.0)
    assert arena.release() == 1
    del segment
    gc.collect()
    assert kept.sum() == 70_000.0  # still mapped: the arena holds the segment until kept goes
    del kept


def test_a_freed_top_block_is_space_again():
    """csrc/arena.h pops a freed block from the top of the arena, with the freed ones under it:
    a collate_fn's temporaries leave room for what it makes next; `wanted_end` is how far the
    cursor would have gone had every request fitted."""
    segment = create_segment(1 << 22, 0)
    arena = SlotArena(segment, layout.HEADER_BYTES, 16 * 1024)
    start = arena.used_end
    with arena:
        first = np.ones(100_000)  # 800 KB
        second = np.ones(100_000)
        both = arena.used_end
        where = second.__array_interface__["data"][0]
        del second
        assert arena.used_end == arena.offset_of(first.__array_interface__["data"][0], first.nbytes) + first.nbytes
        third = np.ones(100_000)
        assert third.__array_interface__["data"][0] == where  # the freed block's place
        del first  # under a live block: not space again yet
        assert arena.used_end == both
        del third  # and now both go
        assert arena.used_end == start
        too_big = np.ones(1 << 20)  # 8 MiB: from the heap
        assert arena.offset_of(too_big.__array_interface__["data"][0], too_big.nbytes) is None
        assert arena.wanted_end >= start + too_big.nbytes
        assert arena.used_end == start
    del too_big
    assert arena.release() == 0
    del segment
    gc.collect()


class Pixels(Dataset):
    """uint8 samples of 64 KiB: a batch of 4 stacks to 256 KiB and converts to 1 MiB of float32."""

    def __init__(self, n: int = 96):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return ((np.arange(ROW) * 7 + i) % 256).astype(np.uint8).reshape(64, 1024)


def to_float(samples):
    return np.stack(samples).astype(np.float32) / 255


def to_float64(samples):
    return np.stack(samples) / 255.0


def normalized(samples):
    batch = np.stack(samples).astype(np.float32)
    batch -= 127.0
    batch /= 50.0
    return batch


def image_and_label(samples):
    return {"image": np.stack(samples).astype(np.float32) / 255.0, "label": np.arange(len(samples))}


def centred(samples):
    return (np.stack(samples).astype(np.float32) - 127.0) / 50.0


@pytest.mark.parametrize("hold", [False, True])
@pytest.mark.parametrize("collate_fn", [to_float, to_float64, normalized, image_and_label])
def test_a_collate_that_converts_its_stack_builds_the_batch_in_the_slot(collate_fn, hold):
    """np.stack of uint8 samples, then astype / division (NOTE [ A slot for the collate_fn's
    temporaries ] in worker.py): torch's batches, and all but the first batches of each worker
    and of each slot born in the slot, in slots no more than ARENA_GROW_MAX times the batch.
    Before, every batch was made on the heap and copied (0 bytes in place)."""
    from shmloader.worker import ARENA_GROW_MAX

    shm, ref, stats = _both(Pixels(), collate_fn, hold=hold)
    assert_same_batches(shm, ref)
    image = ref[0]["image"] if isinstance(ref[0], dict) else ref[0]
    copied = 2 + stats.ring_slots + stats.detached  # each worker's first, each slot's growth
    assert stats.in_place_bytes >= (len(shm) - copied) * image.nbytes, stats
    assert stats.slot_bytes <= ARENA_GROW_MAX * image.nbytes + (64 << 10), stats
    del shm


class KeepsItsStack:
    """A collate_fn that keeps each uint8 stack (a temporary under the batch it returns) and
    checks, at each call, that none of them changed."""

    def __init__(self):
        self.kept = []

    def __call__(self, samples):
        for stacked, snapshot in self.kept:
            if not np.array_equal(stacked, snapshot):
                raise AssertionError("a stack the collate_fn kept was overwritten")
        stacked = np.stack(samples)
        self.kept.append((stacked, stacked.copy()))
        return stacked.astype(np.float32)


@pytest.mark.parametrize("hold", [False, True])
def test_temporaries_the_collate_keeps_are_never_overwritten(hold):
    shm, ref, stats = _both(Pixels(n=48), KeepsItsStack(), hold=hold, prefetch_factor=2)
    assert_same_batches(shm, ref)
    del shm


def from_numpy_then_torch(samples):
    return torch.sqrt(torch.from_numpy(np.stack(samples).astype(np.float32)))


@pytest.mark.parametrize("collate_fn", [from_numpy_then_torch, centred])
def test_a_slot_grows_for_temporaries_only_where_it_helps(collate_fn):
    """from_numpy_then_torch: the batch is torch's product (its allocator cannot be pointed at the
    slot), so a bigger slot would not bring it there.  centred: `(x - 127) / 50` has two
    batch-sized arrays alive at once, a slot of twice the batch, more than ARENA_GROW_MAX.  Both
    keep their copy, and no slot grows beyond the batch."""
    shm, ref, stats = _both(Pixels(n=48), collate_fn)
    assert_same_batches(shm, ref)
    assert stats.slot_bytes <= shm[0].nbytes + (64 << 10), stats
    del shm
