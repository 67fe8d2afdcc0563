"""ShmDataLoader(sample_parallel=True): the samples of one batch spread over the workers, each
writing its rows into the batch's slot (NOTE [ Samples of one batch over the workers ] in
shmloader/sample_parallel.py).  The same batches, in the same order, as torch's DataLoader and the
default mode; clear errors for what the mode cannot do; no partial batch, no leak."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from shmloader import (
    BatchShapeError,
    LoaderBrokenError,
    LoaderStats,
    RingFullError,
    ShmDataLoader,
    WorkerDiedError,
)
from tests._helpers import assert_same_batches, collect, seeded

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.usefixtures("no_leaks"),
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),  # 3 workers, 2 cores
]


class Arrays(Dataset):
    def __init__(self, n=23, kind="array"):
        self.n, self.kind = n, kind

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        image = np.arange(12, dtype=np.float32).reshape(3, 4) + i
        if self.kind == "array":
            return image
        if self.kind == "pair":
            return image, i
        return {"image": np.full((2, 3), i % 256, np.uint8), "label": i, "weight": i * 0.25}


class LargeRows(Dataset):
    """256 KiB samples: batches that the loop holds in their slots (tiny ones come back as copies)."""

    def __len__(self):
        return 23

    def __getitem__(self, i):
        return np.full((64, 1024), i, np.float32)


class Noisy(Dataset):
    """Per-sample randomness from numpy's, torch's and python's global RNGs."""

    def __len__(self):
        return 13

    def __getitem__(self, i):
        import random

        return np.random.random(3) + i, torch.rand(2), random.random()


class Faulty(Dataset):
    """Index `bad` raises KeyError; index `odd` has another shape; index `kill` kills its worker."""

    def __init__(self, bad=None, odd=None, kill=None):
        self.bad, self.odd, self.kill = bad, odd, kill

    def __len__(self):
        return 20

    def __getitem__(self, i):
        if i == self.bad:
            raise KeyError(f"no item {i}")
        if i == self.kill:
            os.kill(os.getpid(), signal.SIGKILL)
        return np.full((5 if i == self.odd else 4,), i, np.int64)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


def _three(dataset, seed=None, **kwargs):
    """Batches of torch's DataLoader, the default mode and sample_parallel, same arguments."""
    def gen():
        return seeded(seed) if seed is not None else None

    torch_batches = collect(DataLoader(dataset, generator=gen(), **kwargs))
    default = collect(ShmDataLoader(dataset, generator=gen(), **kwargs))
    parallel = collect(ShmDataLoader(dataset, generator=gen(), sample_parallel=True, **kwargs))
    return torch_batches, default, parallel


@pytest.mark.parametrize("kind", ["array", "pair", "dict"])
@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_same_batches_as_torch_and_the_default_mode(kind, num_workers):
    want, default, got = _three(Arrays(23, kind), batch_size=5, num_workers=num_workers)
    assert_same_batches(got, want)
    assert_same_batches(default, want)


class MemoryMapped(Dataset):
    """Rows of an array on disk: np.memmap samples, and np.load(mmap_mode="r") ones (read-only),
    in a dict with a label, as memory-mapped datasets return them."""

    def __init__(self, folder, n=17):
        table = np.arange(n * 6 * 16, dtype=np.float32).reshape(n, 6, 16)
        np.save(os.path.join(folder, "table.npy"), table)
        self.path, self.n = os.path.join(folder, "table.npy"), n
        self.table = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.table is None:  # opened in each worker
            self.table = np.load(self.path, mmap_mode="r")
        raw = np.memmap(self.path, dtype=np.float32, mode="r", offset=128 + i * 6 * 16 * 4, shape=(6, 16))
        return {"row": self.table[i], "raw": raw, "label": i}


def test_memory_mapped_samples_as_torch_collates_them(tmp_path):
    """torch's default_collate takes np.memmap rows (np.load(mmap_mode=...) included) as the
    arrays they are; the mode refused them as an ndarray subclass."""
    dataset = MemoryMapped(str(tmp_path))
    assert type(dataset[3]["raw"]) is np.memmap and type(dataset[3]["row"]) is np.memmap
    want, default, got = _three(dataset, batch_size=5, num_workers=2)
    assert_same_batches(got, want)
    assert_same_batches(default, want)
    assert float(got[1]["raw"][2, 5, 7]) == float(np.load(dataset.path)[7, 5, 7])


@pytest.mark.parametrize("drop_last", [False, True])
def test_shuffle_with_generator_and_drop_last(drop_last):
    want, default, got = _three(Arrays(23, "dict"), seed=7, batch_size=4, num_workers=2, shuffle=True,
                                drop_last=drop_last)
    assert len(want) == (5 if drop_last else 6)
    assert_same_batches(got, want)
    assert_same_batches(default, want)


@pytest.mark.parametrize("batch_size", [2, 7])  # fewer rows than workers; not divisible by them
def test_batch_sizes_against_num_workers(batch_size):
    want, _, got = _three(Arrays(11, "pair"), batch_size=batch_size, num_workers=3)
    assert_same_batches(got, want)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_other_start_methods(start_method):
    """Workers that unpickle the dataset (spawn, forkserver): the same batches, and per-sample
    seeding gives the same noise as forked workers."""
    want, _, got = _three(Arrays(13, "dict"), seed=2, batch_size=4, num_workers=2, shuffle=True,
                          multiprocessing_context=start_method)
    assert_same_batches(got, want)
    forked = collect(ShmDataLoader(Noisy(), batch_size=4, num_workers=2, generator=seeded(3), sample_parallel=True,
                                   multiprocessing_context="fork"))
    other = collect(ShmDataLoader(Noisy(), batch_size=4, num_workers=2, generator=seeded(3), sample_parallel=True,
                                  multiprocessing_context=start_method))
    assert_same_batches(other, forked)


@pytest.mark.parametrize("max_ring_slots", [2, 3, 4])
def test_a_capped_ring(max_ring_slots):
    """max_ring_slots below the mode's depth: fewer batches in flight, the same batches; the
    cap holds (the ring never has more segments than it allows). With 2 slots a plain for loop
    holds one batch while next() completes the other (found by a new-user check: RingFullError
    after one batch; NOTE [ A full ring under a cap ])."""
    want = collect(DataLoader(LargeRows(), batch_size=3, num_workers=2))
    loader = ShmDataLoader(LargeRows(), batch_size=3, num_workers=2, max_ring_slots=max_ring_slots,
                           sample_parallel=True)
    assert_same_batches(collect(loader), want)
    stats = loader.stats()
    assert stats.ring_slots <= max_ring_slots and stats.ring_bytes <= max_ring_slots * stats.slot_bytes, stats


def test_a_loop_that_holds_as_many_batches_as_the_cap_allows_gets_ring_full_error():
    loader = ShmDataLoader(LargeRows(), batch_size=3, num_workers=2, max_ring_slots=2, sample_parallel=True)
    it = iter(loader)
    held = [next(it), next(it)]
    with pytest.raises(RingFullError, match="max_ring_slots=2"):
        next(it)
    del held, it


def test_per_sample_seeding_is_independent_of_the_workers():
    runs = [collect(ShmDataLoader(Noisy(), batch_size=4, num_workers=w, generator=seeded(3), sample_parallel=True))
            for w in (2, 3, 2)]
    assert_same_batches(runs[1], runs[0])
    assert_same_batches(runs[2], runs[0])
    other = collect(ShmDataLoader(Noisy(), batch_size=4, num_workers=2, generator=seeded(4), sample_parallel=True))
    assert not torch.equal(other[0][1], runs[0][0][1])  # another base seed, other noise


def test_persistent_workers_over_two_epochs():
    loader = ShmDataLoader(Arrays(17, "dict"), batch_size=4, num_workers=2, shuffle=True, generator=seeded(5),
                           persistent_workers=True, sample_parallel=True)
    reference = DataLoader(Arrays(17, "dict"), batch_size=4, num_workers=2, shuffle=True, generator=seeded(5),
                           persistent_workers=True)
    for _ in range(2):
        assert_same_batches(collect(loader), collect(reference))
    noisy = ShmDataLoader(Noisy(), batch_size=4, num_workers=2, generator=seeded(5), persistent_workers=True,
                          sample_parallel=True)
    first, second = collect(noisy), collect(noisy)
    assert not torch.equal(first[0][1], second[0][1])  # the epoch is part of each sample's seed
    del loader, noisy, reference


def test_held_batches_equal_torchs():
    held = list(ShmDataLoader(Arrays(23, "pair"), batch_size=3, num_workers=2, sample_parallel=True))
    assert_same_batches(held, list(DataLoader(Arrays(23, "pair"), batch_size=3)))
    del held


def test_break_mid_epoch_then_a_new_epoch_with_persistent_workers():
    loader = ShmDataLoader(Arrays(40), batch_size=4, num_workers=2, persistent_workers=True, sample_parallel=True)
    for i, _ in enumerate(loader):
        if i == 1:
            break
    assert_same_batches(collect(loader), collect(DataLoader(Arrays(40), batch_size=4)))
    stats = loader.stats()
    assert stats.batches >= 10 and stats.ring_slots == 4  # max(2, prefetch_factor) + 2
    del loader


@pytest.mark.parametrize("make", [
    lambda: ShmDataLoader(Stream(), batch_size=2, num_workers=2, sample_parallel=True),
    lambda: ShmDataLoader(Arrays(), batch_size=2, num_workers=2, collate_fn=lambda b: b, sample_parallel=True),
    lambda: ShmDataLoader(Arrays(), batch_size=None, num_workers=2, sample_parallel=True),
], ids=["iterable", "collate_fn", "batch_size_none"])
def test_what_the_mode_cannot_do_is_a_clear_error(make):
    with pytest.raises(ValueError, match=r"sample_parallel=True.*use the default mode \(sample_parallel=False\)"):
        make()


def test_a_collate_fn_set_after_construction_is_the_same_clear_error_at_iter():
    loader = ShmDataLoader(Arrays(), batch_size=2, num_workers=2, sample_parallel=True)
    loader.collate_fn = lambda batch: batch  # torch's DataLoader allows it, and uses it
    with pytest.raises(ValueError, match=r"collate_fn.*use the default mode \(sample_parallel=False\)"):
        iter(loader)


def test_prefetch_next_epoch_needs_persistent_workers_here_too():
    """The two modes combine (tests/test_sample_parallel_epochs.py), with persistent workers only."""
    with pytest.raises(ValueError, match=r"prefetch_next_epoch=True .* needs persistent_workers=True"):
        ShmDataLoader(Arrays(), batch_size=2, num_workers=2, sample_parallel=True, prefetch_next_epoch=True)


def test_unsupported_sample_is_a_clear_error_at_the_first_batch():
    class Strings(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"name": f"item {i}"}

    it = iter(ShmDataLoader(Strings(), batch_size=2, num_workers=2, sample_parallel=True))
    with pytest.raises(TypeError, match=r"batch\['name'\].*default mode"):
        next(it)
    with pytest.raises(LoaderBrokenError):
        next(it)


def test_a_sample_of_another_shape_raises_at_its_batch_and_the_epoch_goes_on():
    it = iter(ShmDataLoader(Faulty(odd=9), batch_size=4, num_workers=2, sample_parallel=True))
    assert [next(it)[0, 0].item() for _ in range(2)] == [0, 4]
    with pytest.raises(BatchShapeError, match="row 1"):
        next(it)
    assert [b[0, 0].item() for b in it] == [12, 16]


class MissingKey(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return {"a": np.full(2, i), **({"b": i} if i % 4 != 2 else {})}  # row 2 of each batch lacks "b"


def test_a_missing_key_is_a_key_error_as_under_torch():
    got = iter(ShmDataLoader(MissingKey(), batch_size=4, num_workers=2, sample_parallel=True))
    want = iter(DataLoader(MissingKey(), batch_size=4, num_workers=2))
    for _ in range(3):  # each batch fails; the epoch goes on
        with pytest.raises(KeyError) as ref:
            next(want)
        with pytest.raises(KeyError) as info:
            next(got)
        assert isinstance(info.value, BatchShapeError) and isinstance(ref.value, KeyError)
        assert "row 2" in str(info.value) and not str(info.value).startswith("'")
    want._shutdown_workers()  # torch's iterator takes 10 s to stop when left to the gc


def test_a_dataset_error_raises_at_its_batch_and_the_epoch_goes_on():
    it = iter(ShmDataLoader(Faulty(bad=5), batch_size=4, num_workers=3, sample_parallel=True))
    assert next(it)[0, 0].item() == 0
    with pytest.raises(KeyError, match="no item 5"):
        next(it)
    assert [b[0, 0].item() for b in it] == [8, 12, 16]


def test_a_failing_first_sample_learns_from_the_next_batch():
    it = iter(ShmDataLoader(Faulty(bad=0), batch_size=4, num_workers=2, sample_parallel=True))
    with pytest.raises(KeyError, match="no item 0"):
        next(it)
    assert [b[0, 0].item() for b in it] == [4, 8, 12, 16]


def test_a_worker_killed_mid_batch():
    it = iter(ShmDataLoader(Faulty(kill=10), batch_size=4, num_workers=2, sample_parallel=True))
    assert next(it)[0, 0].item() == 0
    with pytest.raises(WorkerDiedError):
        for _ in range(4):
            next(it)
    with pytest.raises(LoaderBrokenError):
        next(it)


def test_timeout_is_honoured():
    class Slow(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            import time

            time.sleep(5 if i == 2 else 0)
            return np.zeros(2)

    it = iter(ShmDataLoader(Slow(), batch_size=2, num_workers=2, timeout=1, sample_parallel=True))
    next(it)
    from shmloader import LoaderTimeoutError

    with pytest.raises(LoaderTimeoutError):
        next(it)


def test_num_workers_zero_is_the_default_mode():
    got = collect(ShmDataLoader(Arrays(7, "dict"), batch_size=3, sample_parallel=True))
    assert_same_batches(got, collect(DataLoader(Arrays(7, "dict"), batch_size=3)))


def test_later_batches_get_no_segment_before_the_first_is_complete():
    """NOTE [ The first batch first ]: the later batches' segments would take CPU from the
    workers filling the first batch; they are made once it is delivered."""
    it = iter(ShmDataLoader(Arrays(64), batch_size=8, num_workers=2, sample_parallel=True, prefetch_factor=4))
    first = next(it)
    stats = it.stats()
    # Two segments: the first batch's, and the one made for batch 1 once batch 0 was complete
    # (batch 1 is then the one waited for); batches 2 and 3 have none yet.
    assert stats.ring_bytes == 2 * stats.slot_bytes, stats
    del first
    rest = [batch.clone() for batch in it]
    assert len(rest) == 7
    assert it.stats().ring_bytes > stats.slot_bytes  # the later batches got theirs
    del it


class MixedDtypes(Dataset):
    """Sample 5 is float64 among float32 arrays (and a float64 tensor among float32 ones);
    with `int_rows`, sample 0 of each batch is an int64 array and the others float32."""

    def __init__(self, int_rows=False):
        self.int_rows = int_rows

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if self.int_rows:
            return np.full(3, i, np.int64 if i % 4 == 0 else np.float32)
        wide = i == 5
        return {"array": np.full(3, i + 0.1, np.float64 if wide else np.float32),
                "tensor": torch.full((2,), i + 0.1, dtype=torch.float64 if wide else torch.float32)}


def test_a_row_of_another_dtype_is_cast_as_torchs_default_collate_casts_it():
    """torch's default_collate in a worker stacks into an out= of sample 0's dtype: a float64
    row among float32 ones is rounded into the float32 batch; sample_parallel gives the same."""
    want = collect(DataLoader(MixedDtypes(), batch_size=4, num_workers=2))
    got = collect(ShmDataLoader(MixedDtypes(), batch_size=4, num_workers=2, sample_parallel=True))
    assert_same_batches(got, want)
    assert got[1]["array"].dtype == got[1]["tensor"].dtype == torch.float32


def test_a_row_torch_cannot_cast_into_the_batch_raises_torchs_error_type():
    errors = []
    for loader_class, extra in ((DataLoader, {}), (ShmDataLoader, {"sample_parallel": True})):
        with pytest.raises((RuntimeError, TypeError)) as caught:
            next(iter(loader_class(MixedDtypes(int_rows=True), batch_size=4, num_workers=2, **extra)))
        errors.append(caught.value)
    assert type(errors[0]) is type(errors[1])
    assert "can't be cast" in str(errors[0]) and "can't be cast" in str(errors[1])
    assert "(sample 1)" in str(errors[1])


class FloatAmongIntLabels(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.zeros(3, np.float32), (float(i) if i == 6 else i)


def test_a_number_of_another_type_says_what_torch_would_do_and_what_to_do():
    loader = ShmDataLoader(FloatAmongIntLabels(), batch_size=4, num_workers=2, sample_parallel=True)
    it = iter(loader)
    next(it)
    with pytest.raises(BatchShapeError, match=r"expected int at batch\[1\] row 2, got float.*default mode"):
        next(it)
    del it, loader


class ShapePerBatch(Dataset):
    """Multi-resolution / bucketed batches: every sample of a batch has one shape, batches differ
    (and so does the structure: a dict of another key set from index 24 on)."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        side = (8, 16, 8, 12, 12)[(i // 8) % 5]
        image = torch.arange(3 * side * side, dtype=torch.float32).reshape(3, side, side) + i
        if i >= 24:
            return {"image": image, "extra": np.full(side, i, np.int16)}
        return {"image": image, "label": i}


@pytest.mark.parametrize("num_workers, persistent", [(2, False), (3, True)])
def test_sample_shapes_that_change_from_batch_to_batch_are_torchs_batches(num_workers, persistent):
    kwargs = dict(batch_size=8, num_workers=num_workers, persistent_workers=persistent)
    loader = ShmDataLoader(ShapePerBatch(), sample_parallel=True, **kwargs)
    want = collect(DataLoader(ShapePerBatch(), **kwargs))
    for _ in range(2):
        assert_same_batches(collect(loader), want)
    shuffled = ShmDataLoader(ShapePerBatch(), sample_parallel=True, shuffle=True, generator=seeded(3),
                             batch_sampler=None, batch_size=8, num_workers=num_workers)
    with pytest.raises(BatchShapeError):  # shuffled, the samples of one batch disagree: torch raises too
        collect(shuffled)


class DtypePerBatch(Dataset):
    """Every sample of a batch has one dtype, batches differ (an array and a tensor leaf): torch
    gives each batch its own row 0's dtype; within batch 5, row 2 is float64 among float32 rows
    (cast into row 0's float32, as torch's collate in a worker casts it)."""

    DTYPES = ((np.float32, torch.float32), (np.float64, torch.float64), (np.uint8, torch.uint8),
              (np.int16, torch.int16), (np.int64, torch.int64), (np.float32, torch.float32))

    def __len__(self):
        return 24

    def __getitem__(self, i):
        array_dtype, tensor_dtype = self.DTYPES[i // 4]
        if i == 22:
            array_dtype, tensor_dtype = np.float64, torch.float64
        value = 300 + i + (0.1 if np.dtype(array_dtype).kind == "f" else 0)
        return {"array": np.full(2, value).astype(array_dtype), "tensor": torch.tensor([value]).to(tensor_dtype)}


@pytest.mark.parametrize("num_workers", [2, 3])
def test_a_batch_of_another_dtype_is_torchs_batch(num_workers):
    """Found by a new-user check: a batch whose dtype differed from the last batch's was written
    in the last batch's dtype (uint8 then int16 values 300+ wrapped to 48; float64 rounded to
    float32), or refused; row 0 of each batch now sets its dtype (NOTE [ A new shape ])."""
    kwargs = dict(batch_size=4, num_workers=num_workers)
    got = collect(ShmDataLoader(DtypePerBatch(), sample_parallel=True, **kwargs))
    want = collect(DataLoader(DtypePerBatch(), **kwargs))
    assert_same_batches(got, want)
    assert [b["array"].dtype for b in got] == [torch.float32, torch.float64, torch.uint8, torch.int16,
                                               torch.int64, torch.float32]


class LabelTypePerBatch(Dataset):
    """Batch 1's labels are all floats: torch makes that batch's labels float64."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return np.zeros(3, np.float32), (i + 0.5 if 4 <= i < 8 else i)


def test_a_batch_whose_numbers_are_of_another_type_is_torchs_batch():
    kwargs = dict(batch_size=4, num_workers=2)
    assert_same_batches(collect(ShmDataLoader(LabelTypePerBatch(), sample_parallel=True, **kwargs)),
                        collect(DataLoader(LabelTypePerBatch(), **kwargs)))


class MixedLeafTypes(Dataset):
    """Row 0 of each batch has one type at "x", the other rows `other` (found by a new-user
    check: every one of these raised BatchShapeError where torch collates them)."""

    def __init__(self, first, other):
        self.first, self.other = first, other

    def __len__(self):
        return 8

    def __getitem__(self, i):
        make = self.first if i % 4 == 0 else self.other
        return {"x": make(i + 1), "y": np.full(2, i, np.float32)}


def _as(kind):
    return {"int": int, "bool": lambda i: bool(i % 2), "float": lambda i: i + 0.1}.get(kind) or (
        lambda i: getattr(np, kind)(i + (0.1 if kind.startswith("float") else 0)))


@pytest.mark.parametrize("first, other", [
    ("int", "int64"), ("int64", "int"), ("int", "uint8"), ("int64", "int32"), ("int64", "int8"),
    ("int64", "bool"), ("float", "float32"), ("float", "int64"), ("float64", "float"),
    ("float64", "float16"), ("float64", "int"), ("float64", "int32"),
])
def test_numbers_of_mixed_types_are_torchs_batch_where_row_0_sets_its_dtype(first, other):
    dataset = MixedLeafTypes(_as(first), _as(other))
    want = collect(DataLoader(dataset, batch_size=4, num_workers=2))
    got = collect(ShmDataLoader(dataset, batch_size=4, num_workers=2, sample_parallel=True))
    assert_same_batches(got, want)


def test_a_tensor_among_array_rows_is_stacked_as_torch_stacks_it():
    dataset = MixedLeafTypes(lambda i: np.full(3, i, np.int64), lambda i: torch.full((3,), i, dtype=torch.int32))
    want = collect(DataLoader(dataset, batch_size=4, num_workers=2))
    got = collect(ShmDataLoader(dataset, batch_size=4, num_workers=2, sample_parallel=True))
    assert_same_batches(got, want)
    assert got[0]["x"].dtype == torch.int64


def test_a_mix_whose_dtype_depends_on_every_row_is_a_clear_error():
    """np.float64 among np.float32 scalars: torch makes the batch float64, row 0 says float32."""
    dataset = MixedLeafTypes(np.float32, np.float64)
    assert collect(DataLoader(dataset, batch_size=4, num_workers=2))[0]["x"].dtype == torch.float64
    with pytest.raises(BatchShapeError, match=r"expected float32 at batch\['x'\] row 1, got float64"):
        collect(ShmDataLoader(dataset, batch_size=4, num_workers=2, sample_parallel=True))


@pytest.mark.parametrize("sample_parallel", [False, True])
def test_a_leaf_that_is_no_tensor_after_a_tensor_raises_torchs_attribute_error(sample_parallel):
    dataset = MixedLeafTypes(lambda i: torch.full((3,), i), lambda i: np.full(3, i))
    with pytest.raises(AttributeError, match="no attribute 'numel'") as torchs:
        collect(DataLoader(dataset, batch_size=4, num_workers=2))
    with pytest.raises(AttributeError, match="'numpy.ndarray' object has no attribute 'numel'") as ours:
        collect(ShmDataLoader(dataset, batch_size=4, num_workers=2, sample_parallel=sample_parallel))
    assert "'numpy.ndarray' object" in str(torchs.value)
    if sample_parallel:
        assert isinstance(ours.value, BatchShapeError) and "batch['x'] row 1" in str(ours.value)


def test_stats_say_why_timing_is_none():
    """Found by a new-user check: print(stats()) said "timing: off (SHMLOADER_TIMING=0)" with
    the variable unset; this mode keeps no stage clocks, and stats() now says so."""
    loader = ShmDataLoader(Arrays(12, "array"), batch_size=3, num_workers=2, sample_parallel=True)
    collect(loader)
    stats = loader.stats()
    assert stats.timing is None and stats.timing_off == "not measured with sample_parallel=True"
    assert "timing: off (not measured with sample_parallel=True)" in str(stats)
    assert LoaderStats.from_dict(stats.as_dict()) == stats


class SlowIndex(Dataset):
    """Each sample is its index, after 50 ms: batches in flight are still being fetched when the
    loop leaves an epoch."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        time.sleep(0.05)
        return i


def test_an_epoch_left_early_does_not_move_the_next_epochs_draws():
    """The loop leaves epoch 1 after 3 batches (the next ones still being fetched), calls iter() for
    epoch 2 and takes nothing, then runs epoch 3: torch's iter() draws from the sampler at once
    (the permutation of a shuffled epoch), so epoch 3 is torch's only if this mode's iter() draws
    then too, not once the abandoned batches are in."""
    def first_batches(cls):
        loader = cls(SlowIndex(), batch_size=3, shuffle=True, num_workers=2, persistent_workers=True,
                     generator=torch.Generator().manual_seed(77),
                     **({"sample_parallel": True} if cls is ShmDataLoader else {}))
        out = []
        for stop in (3, 0, 2):
            it = iter(loader)
            out.append([batch.tolist() for _, batch in zip(range(stop), it)])
        del it
        if cls is DataLoader:
            loader._iterator._shutdown_workers()
        return out

    assert first_batches(ShmDataLoader) == first_batches(DataLoader)


class ContainerSeen(Dataset):
    """A dataset with __getitems__ whose samples record the container type it was given."""

    KINDS = (list, tuple, range, torch.Tensor, np.ndarray)

    def __len__(self):
        return 20

    def __getitem__(self, i):
        return np.array([int(i), -1], np.int64)

    def __getitems__(self, indices):
        kind = next(k for k, t in enumerate(self.KINDS) if isinstance(indices, t))
        return [np.array([int(i), kind], np.int64) for i in indices]


class Batches:
    """A batch sampler yielding its batches in the container `make` builds."""

    def __init__(self, make):
        self.make = make

    def __iter__(self):
        return (self.make(range(lo, min(lo + 6, 20))) for lo in range(0, 20, 6))

    def __len__(self):
        return 4


@pytest.mark.parametrize("make", [list, tuple, lambda r: r, lambda r: torch.tensor(list(r)),
                                  lambda r: np.array(list(r))],
                         ids=["list", "tuple", "range", "tensor", "ndarray"])
def test_getitems_gets_the_batch_samplers_container_one_index_long(make):
    """torch's fetcher hands __getitems__ what the batch sampler yielded; this mode fetches one
    index at a time, in a one-item slice of that same container (audit: a tensor batch used to
    arrive as a list holding a tensor, and a dataset calling .tolist() on it raised)."""
    loader = ShmDataLoader(ContainerSeen(), batch_sampler=Batches(make), num_workers=2, sample_parallel=True)
    want = collect(DataLoader(ContainerSeen(), batch_sampler=Batches(make)))
    assert_same_batches(collect(loader), want)
    del loader
