"""ShmDataLoader gives what torch's DataLoader gives: run side by side on the same datasets, seeds
and arguments, batch for batch (types, dtypes, shapes, values and order)."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from shmloader import ShmDataLoader

from . import _datasets as ds
from ._helpers import assert_same_batches, both, collect, epochs, freeze, seeded

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),  # 3 workers, 2 cores
]


# -- map-style, default collate ----------------------------------------------------------------------


@pytest.mark.parametrize("dataset", [ds.DictDataset(), ds.TupleDataset(), ds.NamedTupleDataset()],
                         ids=["dict", "tuple", "namedtuple"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_map_style_default_collate_shuffled(dataset, num_workers):
    shm, ref = both(dataset, seed=7, batch_size=4, shuffle=True, num_workers=num_workers)
    assert_same_batches(collect(shm), collect(ref))


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("batch_size", [1, 5, 8])
def test_drop_last_and_len(drop_last, batch_size):
    shm, ref = both(ds.DictDataset(n=37), batch_size=batch_size, drop_last=drop_last, num_workers=2)
    assert len(shm) == len(ref)
    got, want = collect(shm), collect(ref)
    assert len(got) == len(shm)
    assert_same_batches(got, want)


def test_default_collate_types():
    """Arrays and numbers become tensors, str become lists of str, as default_collate makes them."""
    shm, ref = both(ds.DictDataset(n=8), batch_size=4, num_workers=2)
    got, want = collect(shm), collect(ref)
    assert_same_batches(got, want)
    batch = got[0]
    assert isinstance(batch["image"], torch.Tensor) and batch["image"].dtype == torch.float32
    assert batch["label"].dtype == torch.int64 and batch["weight"].dtype == torch.float64
    assert batch["flag"].dtype == torch.bool
    assert batch["name"] == ["sample-0", "sample-1", "sample-2", "sample-3"]


@pytest.mark.parametrize("batch_size", [None, 1, 4])
def test_uncommon_leaves_like_torch(batch_size):
    shm, ref = both(ds.EdgeDataset(), batch_size=batch_size, num_workers=2)
    assert_same_batches(collect(shm), collect(ref))


@pytest.mark.parametrize("collate_fn", [None, ds.default_collate_inside], ids=["default", "custom"])
def test_mixed_sample_dtypes_like_torch(collate_fn):
    """torch's workers stack into the first sample's dtype (no type promotion)."""
    results = []
    for cls in (ShmDataLoader, DataLoader):
        try:
            loader = cls(ds.MixedDtypeDataset(), batch_size=3, num_workers=2, collate_fn=collate_fn)
            results.append(("ok", collect(loader)))
        except Exception as exc:
            results.append(("error", type(exc)))
    if results[1][0] == "ok":
        assert results[0][0] == "ok", results[0]
        assert_same_batches(results[0][1], results[1][1])
    else:
        assert results[0][0] == "error" and issubclass(results[0][1], results[1][1]), results


def test_batch_size_none_converts_like_torch():
    shm, ref = both(ds.DictDataset(n=6), batch_size=None, num_workers=2)
    assert_same_batches(collect(shm), collect(ref))


# -- custom collate --------------------------------------------------------------------------------


@pytest.mark.parametrize("collate_fn", [ds.numpy_collate, ds.mixed_collate, ds.list_collate],
                         ids=["numpy", "mixed", "list"])
def test_custom_collate_keeps_types(collate_fn):
    shm, ref = both(ds.DictDataset(n=14), seed=3, batch_size=4, shuffle=True, num_workers=2,
                    collate_fn=collate_fn)
    got, want = collect(shm), collect(ref)
    assert_same_batches(got, want)
    if collate_fn is ds.numpy_collate:
        assert isinstance(got[0]["image"], np.ndarray)  # a numpy view, not a tensor


def _twice_numpy(samples):
    a = np.stack([s["image"] for s in samples])
    return {"x": a, "y": a, "more": (a, [a])}


def _twice_tensor(samples):
    t = torch.stack([torch.as_tensor(s["image"]) for s in samples])
    return t, t


def _twice_masked(samples):
    m = np.ma.masked_greater(np.stack([s["image"] for s in samples]), 0.5)
    return [m, m]


@pytest.mark.parametrize("collate_fn", [_twice_numpy, _twice_tensor, _twice_masked],
                         ids=["numpy", "tensor", "masked"])
def test_an_object_a_batch_holds_twice_comes_back_as_one_object(collate_fn):
    """NOTE [ One object, one leaf ] in layout.py: torch's pickle keeps identity within a batch."""
    shm, ref = both(ds.DictDataset(n=8), seed=0, batch_size=4, num_workers=1, collate_fn=collate_fn)
    got, want = collect(shm), collect(ref)
    assert_same_batches(got, want)

    def same_objects(batch):
        if type(batch) is dict:
            return [batch["x"] is batch["y"], batch["more"][0] is batch["x"], batch["more"][1][0] is batch["x"]]
        return [batch[0] is batch[1]]

    assert [same_objects(b) for b in got] == [same_objects(b) for b in want] == [[True] * len(same_objects(want[0]))] * 2
    del got, shm


def _nothing(samples):
    return None  # "skip this batch", as users write it


class _Nones(torch.utils.data.Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("in_order", [True, False])
def test_a_batch_that_is_none_is_delivered(in_order):
    """A collate_fn returning None, or a None sample without batching: torch yields None."""
    for dataset, kwargs in [(ds.DictDataset(n=8), {"batch_size": 4, "collate_fn": _nothing}),
                            (_Nones(), {"batch_size": None})]:
        shm, ref = both(dataset, num_workers=2, timeout=20, in_order=in_order, **kwargs)
        assert list(shm) == list(ref) == [None] * len(ref)


class _EmptyRows(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.zeros((0, 3), np.float32)


def _torch_default_collate(samples):
    return torch.utils.data.default_collate(samples)


def test_torchs_default_collate_inside_a_collate_fn_with_empty_samples():
    shm, ref = both(_EmptyRows(), batch_size=4, num_workers=1, collate_fn=_torch_default_collate)
    got, want = collect(shm), collect(ref)
    assert_same_batches(got, want)
    assert [tuple(b.shape) for b in got] == [(4, 0, 3)] * 2


def test_custom_collate_variable_length():
    shm, ref = both(ds.VariableLengthDataset(n=20, step=300), batch_size=3, num_workers=2,
                    collate_fn=ds.pad_collate)
    assert_same_batches(collect(shm), collect(ref))


@pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")  # torch's side
def test_custom_collate_sparse_output():
    """Sparse batches: equal to torch's, and their slots come back (no RingFullError)."""
    dataset = ds.ArrayDataset(n=60, nbytes=64)
    shm, ref = both(dataset, batch_size=2, num_workers=2, collate_fn=ds.sparse_collate)
    got, want = collect(shm), collect(ref)
    assert len(got) == len(want) == 30
    for g, w in zip(got, want):
        assert g["sparse"].layout == torch.sparse_coo and g["n"] == w["n"]
        assert torch.equal(g["sparse"].to_dense(), w["sparse"].to_dense())
    assert shm.stats().detached == 0


# -- samplers ---------------------------------------------------------------------------------------


def _sampler_cases(dataset):
    """Fresh samplers (with fresh generators) for each loader."""
    return [
        dict(sampler=SubsetRandomSampler(range(0, 30, 2), generator=seeded(5)), batch_size=3),
        dict(sampler=WeightedRandomSampler([1.0] * 30, 17, generator=seeded(6)), batch_size=4),
        dict(sampler=SequentialSampler(dataset), batch_size=7, drop_last=True),
        dict(batch_sampler=BatchSampler(RandomSampler(dataset, generator=seeded(8)), 6, False)),
        dict(batch_sampler=[[3, 1], [4, 1, 5], [9], [2, 6, 5, 3]]),
        dict(sampler=RandomSampler(dataset, replacement=True, num_samples=11), batch_size=4),
    ]


def test_samplers():
    dataset = ds.DictDataset(n=30)
    for case, (shm_kwargs, ref_kwargs) in enumerate(zip(_sampler_cases(dataset), _sampler_cases(dataset))):
        torch.manual_seed(case)  # RandomSampler without a generator draws from the global RNG
        shm = ShmDataLoader(dataset, num_workers=2, **shm_kwargs)
        got = epochs(shm, 2)
        torch.manual_seed(case)
        ref = DataLoader(dataset, num_workers=2, **ref_kwargs)
        want = epochs(ref, 2)
        assert len(shm) == len(ref)
        for g, w in zip(got, want):
            assert_same_batches(g, w)


# -- seeds, workers, epochs ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [2, 3])
def test_per_worker_seeding_and_worker_info(num_workers):
    """torch, numpy and random draws inside workers, worker ids, num_workers and seeds match."""
    shm, ref = both(ds.RandomDataset(n=24), seed=11, batch_size=2, shuffle=True, num_workers=num_workers)
    got, want = collect(shm), collect(ref)
    assert_same_batches(got, want)
    # as in torch, batch i comes from worker i mod num_workers
    assert [int(b["worker"][0]) for b in got] == [i % num_workers for i in range(len(got))]


def test_seeds_follow_the_global_rng_without_generator():
    torch.manual_seed(2024)
    got = list(ShmDataLoader(ds.RandomDataset(n=8), batch_size=2, shuffle=True, num_workers=2))
    torch.manual_seed(2024)
    want = list(DataLoader(ds.RandomDataset(n=8), batch_size=2, shuffle=True, num_workers=2))
    assert_same_batches(got, want)


def test_worker_init_fn():
    shm, ref = both(ds.MarkerDataset(), batch_size=2, num_workers=2, worker_init_fn=ds.set_marker)
    got, want = collect(shm), collect(ref)
    assert_same_batches(got, want)
    assert {int(b["marker"][0]) for b in got} == {2, 102}


def test_in_process_worker_info_is_none():
    results = []
    for cls in (ShmDataLoader, DataLoader):  # in-process draws come from the global RNGs
        torch.manual_seed(1), np.random.seed(1), random.seed(1)
        results.append(collect(cls(ds.RandomDataset(n=6), batch_size=3, num_workers=0)))
    assert_same_batches(*results)
    assert int(results[0][0]["worker"][0]) == -1


@pytest.mark.parametrize("persistent_workers", [False, True])
def test_epochs(persistent_workers):
    shm, ref = both(ds.RandomDataset(n=14), seed=21, batch_size=3, shuffle=True, num_workers=2,
                    persistent_workers=persistent_workers)
    got, want = epochs(shm, 3), epochs(ref, 3)
    for g, w in zip(got, want):
        assert_same_batches(g, w)
    assert not all(torch.equal(a["index"], b["index"]) for a, b in zip(got[0], got[1]))


@pytest.mark.parametrize("persistent_workers", [False, True])
def test_break_then_new_epoch(persistent_workers):
    shm, ref = both(ds.RandomDataset(n=20), seed=4, batch_size=2, shuffle=True, num_workers=2,
                    persistent_workers=persistent_workers)
    results = []
    for loader in (shm, ref):
        seen = []
        for i, batch in enumerate(loader):
            seen.append(copy.deepcopy(batch))
            if i == 2:
                break
        seen.extend(collect(loader))  # a new epoch
        seen.extend(collect(loader))
        results.append(seen)
    assert_same_batches(*results)


def test_iterator_reuse_across_epochs_with_prefetch_factor():
    shm, ref = both(ds.DictDataset(n=19), seed=9, batch_size=2, shuffle=True, num_workers=3,
                    prefetch_factor=1, persistent_workers=True)
    for g, w in zip(epochs(shm, 2), epochs(ref, 2)):
        assert_same_batches(g, w)


# -- iterable datasets ---------------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2, 3])
@pytest.mark.parametrize("batch_size", [None, 1, 4])
def test_iterable_sharded_interleaving(num_workers, batch_size):
    shm, ref = both(ds.ShardedStream(n=23), batch_size=batch_size, num_workers=num_workers)
    assert_same_batches(collect(shm), collect(ref))


@pytest.mark.parametrize("drop_last", [False, True])
def test_iterable_uneven_streams(drop_last):
    shm, ref = both(ds.UnevenStream(), batch_size=2, num_workers=3, drop_last=drop_last)
    for g, w in zip(epochs(shm, 2), epochs(ref, 2)):
        assert_same_batches(g, w)


@pytest.mark.parametrize("in_order", [True, False])
def test_iterable_break_then_new_epoch_restarts_the_streams(in_order):
    shm, ref = both(ds.ShardedStream(n=21), batch_size=2, num_workers=2, persistent_workers=True,
                    in_order=in_order)
    results = []
    for loader in (shm, ref):
        before = []
        for i, batch in enumerate(loader):
            before.append(copy.deepcopy(batch))
            if i == 3:
                break
        results.append((before, collect(loader)))
    (got_before, got), (want_before, want) = results
    if in_order:
        assert_same_batches(got_before + got, want_before + want)
    else:  # which batches precede the break depends on timing; the new epoch is whole
        assert sorted(map(repr, map(freeze, got))) == sorted(map(repr, map(freeze, want)))
        assert {repr(freeze(b)) for b in got_before} <= {repr(freeze(b)) for b in want}


def test_iterable_uneven_streams_out_of_order():
    shm, ref = both(ds.UnevenStream(), batch_size=2, num_workers=3, in_order=False)
    got, want = collect(shm), collect(ref)
    assert sorted(map(repr, map(freeze, got))) == sorted(map(repr, map(freeze, want)))


def test_iterable_len_and_persistent_epochs():
    shm, ref = both(ds.ShardedStream(n=17, with_len=True), batch_size=3, num_workers=2,
                    persistent_workers=True)
    assert len(shm) == len(ref)
    for g, w in zip(epochs(shm, 2), epochs(ref, 2)):
        assert_same_batches(g, w)


# -- in_order=False -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dataset", [ds.SleepyDataset(), ds.ShardedStream(n=20)], ids=["map", "iterable"])
def test_out_of_order_gives_the_same_set(dataset):
    shm, ref = both(dataset, batch_size=2, num_workers=2, in_order=False)
    got, want = collect(shm), collect(ref)
    assert len(got) == len(want)
    assert sorted(map(repr, map(freeze, got))) == sorted(map(repr, map(freeze, want)))


# -- start methods ----------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_start_methods(method):
    """Map-style with seeds and worker_init_fn, then an iterable stream, over two persistent epochs."""
    shm = ShmDataLoader(ds.RandomDataset(n=10), batch_size=2, shuffle=True, generator=seeded(13),
                        num_workers=2, multiprocessing_context=method, persistent_workers=True,
                        worker_init_fn=ds.set_marker)
    ref = DataLoader(ds.RandomDataset(n=10), batch_size=2, shuffle=True, generator=seeded(13),
                     num_workers=2, persistent_workers=True, worker_init_fn=ds.set_marker)
    for g, w in zip(epochs(shm, 2), epochs(ref, 2)):
        assert_same_batches(g, w)
    shm = ShmDataLoader(ds.ShardedStream(n=11), batch_size=2, num_workers=2, multiprocessing_context=method)
    ref = DataLoader(ds.ShardedStream(n=11), batch_size=2, num_workers=2)
    assert_same_batches(collect(shm), collect(ref))


def test_context_object_instead_of_a_name():
    import multiprocessing

    context = multiprocessing.get_context("fork")
    shm, ref = both(ds.RandomDataset(n=8), seed=3, batch_size=2, num_workers=2,
                    multiprocessing_context=context)
    assert_same_batches(collect(shm), collect(ref))


# -- other arguments --------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the behaviour without an accelerator")
def test_pin_memory_without_accelerator_matches_torch():
    import warnings
    with warnings.catch_warnings(record=True) as ours:
        warnings.simplefilter("always")
        shm = ShmDataLoader(ds.DictDataset(n=9), batch_size=4, num_workers=2, pin_memory=True)
        got = list(shm)
    with warnings.catch_warnings(record=True) as torchs:
        warnings.simplefilter("always")
        want = list(DataLoader(ds.DictDataset(n=9), batch_size=4, num_workers=2, pin_memory=True))
    assert [str(w.message) for w in ours if w.category is UserWarning] == [str(w.message) for w in torchs if w.category is UserWarning]  # none on torch 2.6
    assert_same_batches(got, want)


def test_accepts_every_dataloader_argument():
    kwargs = dict(batch_size=3, shuffle=True, sampler=None, batch_sampler=None, num_workers=2,
                  collate_fn=None, pin_memory=False, drop_last=True, timeout=30,
                  worker_init_fn=ds.set_marker, multiprocessing_context="fork",
                  prefetch_factor=3, persistent_workers=True, pin_memory_device="", in_order=True)
    shm = ShmDataLoader(ds.MarkerDataset(), generator=seeded(2), **kwargs)
    ref = DataLoader(ds.MarkerDataset(), generator=seeded(2), **kwargs)
    assert_same_batches(collect(shm), collect(ref))


# -- invalid arguments raise torch's exception types --------------------------------------------------------

INVALID = {
    "negative workers": dict(num_workers=-1),
    "prefetch without workers": dict(num_workers=0, prefetch_factor=2),
    "prefetch zero": dict(num_workers=2, prefetch_factor=0),
    "persistent without workers": dict(num_workers=0, persistent_workers=True),
    "negative timeout": dict(timeout=-1),
    "shuffle and sampler": dict(shuffle=True, sampler=SequentialSampler(range(10))),
    "batch_sampler and batch_size": dict(batch_sampler=[[0, 1]], batch_size=2),
    "batch_sampler and drop_last": dict(batch_sampler=[[0, 1]], drop_last=True),
    "batch_size None and drop_last": dict(batch_size=None, drop_last=True),
    "bad context name": dict(num_workers=2, multiprocessing_context="telepathy"),
    "bad context type": dict(num_workers=2, multiprocessing_context=42),
    "context without workers": dict(num_workers=0, multiprocessing_context="spawn"),
    "worker_init_fn not callable": dict(num_workers=2, worker_init_fn=5),
    "zero batch_size": dict(batch_size=0),
}

@pytest.mark.parametrize("sample_parallel", [False, True])
def test_prefetch_factor_zero_raises_torchs_assertion_in_both_modes(sample_parallel):
    """torch's iterator raises it (sample_parallel=True delivered batches regardless)."""
    loader = ShmDataLoader(list(range(8)), batch_size=2, num_workers=2, prefetch_factor=0,
                           sample_parallel=sample_parallel)
    with pytest.raises(AssertionError, match="prefetch_factor must be greater than 0 for MultiProcessingDataLoaderIter"):
        iter(loader)


INVALID_ITERABLE = {
    "shuffle with iterable": dict(shuffle=True),
    "sampler with iterable": dict(sampler=[0, 1]),
    "batch_sampler with iterable": dict(batch_sampler=[[0, 1]]),
}


def _outcome(cls, dataset, kwargs):
    """The exception type (or None) of constructing and then iterating a loader."""
    try:
        loader = cls(dataset, **kwargs)
    except Exception as exc:
        return "construct", type(exc)
    try:
        next(iter(loader))
    except Exception as exc:
        return "iterate", type(exc)
    return None


# torch's own iterator, failing in __init__, complains from its __del__ ('no attribute _shutdown')
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("name", list(INVALID) + list(INVALID_ITERABLE))
def test_invalid_arguments_raise_torchs_exception_types(name):
    if name in INVALID:
        dataset, kwargs = ds.DictDataset(n=10), INVALID[name]
    else:
        dataset, kwargs = ds.ShardedStream(n=10), INVALID_ITERABLE[name]
    want = _outcome(DataLoader, dataset, kwargs)
    got = _outcome(ShmDataLoader, dataset, kwargs)
    if want is not None and got is not None:
        stage, exc_type = got
        assert stage == want[0] and issubclass(exc_type, want[1]), f"{got} vs torch {want}"
    else:
        assert got == want


@pytest.mark.parametrize("kwargs", [dict(slot_bytes=0), dict(slot_bytes=-5), dict(slot_bytes=1.5),
                                    dict(max_ring_slots=0), dict(max_ring_slots="many")])
def test_invalid_shm_arguments_name_the_value(kwargs):
    (key, value), = kwargs.items()
    with pytest.raises(ValueError, match=key):
        ShmDataLoader(ds.DictDataset(n=4), num_workers=2, **kwargs)


# -- pickling and copying the loader -------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loader_pickles_and_deep_copies_after_an_epoch_as_torchs_does(num_workers):
    """torch's DataLoader pickles after iterating (torch.save(loader), a spawn child's args);
    shmloader's kept a weak reference to its last iterator, which pickle refuses.  A copy
    iterates the same batches, and has no iterator of its own until it is iterated."""
    import pickle

    shm, ref = both(ds.DictDataset(n=12), seed=3, batch_size=4, shuffle=True, num_workers=num_workers)
    assert_same_batches(collect(shm), collect(ref))
    clones = [pickle.loads(pickle.dumps(shm)), copy.deepcopy(shm)]
    pickle.loads(pickle.dumps(ref))  # torch's, as a user does
    want = collect(ref)  # epoch 2: each copy carries the generator's state after epoch 1
    for clone in clones:
        assert type(clone) is ShmDataLoader and clone.stats() is None
        assert_same_batches(collect(clone), want)


class _ArrayThenOther(torch.utils.data.Dataset):
    """{"a": float32[3]}, but index 6's "a" is `other` (a list, None, an int, a str)."""

    def __init__(self, other):
        self.other = other

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"a": self.other if i == 6 else np.arange(3, dtype=np.float32) + i}


def test_an_array_leaf_that_is_a_list_in_a_later_sample_collates_as_torchs():
    """torch's default_collate converts each array of a leaf with torch.as_tensor, a list among
    them too; shmloader's stacking asked the list for its dtype (AttributeError)."""
    shm, ref = both(_ArrayThenOther([0.0, 1.0, 2.0]), batch_size=4, num_workers=2)
    assert_same_batches(collect(shm), collect(ref))


@pytest.mark.parametrize("other", [None, 5, "abc"], ids=["none", "int", "str"])
def test_an_array_leaf_that_is_not_an_array_in_a_later_sample_fails_as_torchs(other):
    shm, ref = both(_ArrayThenOther(other), batch_size=4, num_workers=2)
    errors = []
    for loader in (ref, shm):
        with pytest.raises(Exception) as info:
            collect(loader)
        errors.append(info.value)
    want, got = errors
    assert isinstance(got, type(want)), f"{type(got).__name__}: {got} is not torch's {type(want).__name__}: {want}"
