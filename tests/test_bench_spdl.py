"""bench's ``spdl-arena`` transport: SPDL's shared-memory arena, one subprocess per worker, gives
torch's DataLoader's batches in torch's order, and leaves no process, thread, fd or segment.

Small sizes; skipped where spdl is not installed (``pip install spdl==0.8.0``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from bench.spdl_arena import (  # imports spdl only when used
    SpdlArenaLoader,
    segment_bytes_for,
    spdl_status,
    start_quiet_resource_tracker,
)
from bench.transports import all_transports, make_loader, skip_reason
from bench.workloads import (
    PremadeDataset,
    VisionDataset,
    np_stack_collate,
    seed001_points,
    small_points,
    transport_points,
    vision_points,
)
from tests.conftest import child_pids

pytest.importorskip("spdl")

def _psm_mapped() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split()[-1] for line in f if "/dev/shm/psm_" in line}


@pytest.fixture
def spdl_clean(no_leaks):
    """The resource tracker running before the test (it outlives it), and after it: the pools'
    segments unlinked and unmapped, on top of no_leaks (processes, fds, threads)."""
    start_quiet_resource_tracker()
    before_children = child_pids()
    loaders: list[SpdlArenaLoader] = []
    yield loaders
    # checked while the test's loaders are still referenced: close() alone must clean up
    names = [n for ld in loaders for n in ld.shm_names]
    assert names or not loaders, "the loaders made no pool"
    left = sorted(n for n in names if os.path.exists(f"/dev/shm/{n}"))
    mapped = sorted(_psm_mapped())
    kids = child_pids() - before_children
    loaders.clear()
    assert not left, f"pool segments not unlinked: {left}"
    assert not mapped, f"pool segments still mapped: {mapped}"
    assert not kids, f"subprocesses still alive after close(): {sorted(kids)}"


def _same(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a, b)


def _spdl(loaders, ds, **kw) -> list:
    ld = SpdlArenaLoader(ds, **kw)
    loaders.append(ld)
    try:
        return [_copy(b) for b in ld]  # the arena's views go back to their pool at once
    finally:
        ld.close()


def _copy(b):
    if isinstance(b, dict):
        return {k: _copy(v) for k, v in b.items()}
    if isinstance(b, list):
        return [_copy(v) for v in b]
    return np.array(b, copy=True)


def _torch(ds, **kw) -> list:
    kw.pop("segment_bytes", None)
    return [_copy(b) for b in DataLoader(ds, **kw)]


class Counting(IterableDataset):
    """Items 0..n-1 as small arrays; each worker its own copy, as torch gives it."""

    def __init__(self, n: int, shard: bool):
        self.n, self.shard = n, shard

    def __iter__(self):
        info = get_worker_info()
        start, step = (info.id, info.num_workers) if self.shard and info else (0, 1)
        for i in range(start, self.n, step):
            yield np.full(1024, i, np.float32)  # 4 KiB: offloaded to the arena


@pytest.mark.timeout(90)
def test_status_names_the_version():
    ok, why = spdl_status()
    assert ok and why.startswith("0."), why


@pytest.mark.timeout(90)
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_map_style_batches_equal_torchs(spdl_clean, workers):
    # 11 batches of 4, the last short: worker k makes batches k, k+W, ...; merged, torch's order
    ds = PremadeDataset(4096, 43, distinct=7)
    kw = dict(batch_size=4, num_workers=workers, collate_fn=np_stack_collate,
              segment_bytes=segment_bytes_for(4 * 4096, leaves=4))
    got = _spdl(spdl_clean, ds, **kw)
    ref = _torch(ds, **kw)
    assert len(got) == len(ref) == 11
    _same(got, ref)


@pytest.mark.timeout(90)
def test_sampler_order_and_dict_samples_equal_torchs(spdl_clean):
    ds = VisionDataset(40)
    order = [int(i) for i in np.random.default_rng(0).permutation(len(ds))]
    kw = dict(batch_size=6, num_workers=2, collate_fn=np_stack_collate, sampler=order,
              segment_bytes=segment_bytes_for(6 * 3 * 224 * 224, leaves=9))
    got = _spdl(spdl_clean, ds, **kw)
    ref = _torch(ds, **kw)
    assert len(got) == 7 and got[0]["name"].dtype.kind == "U"
    _same(got, ref)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("shard", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_iterable_dataset_batches_equal_torchs(spdl_clean, shard, drop_last):
    # without sharding every worker yields the whole dataset (as in torch): 2 x 6 batches; with
    # it (12 + 11 items: 3 + 3 batches, the last ones short; 3 + 2 with drop_last), the
    # dataset reads get_worker_info(), which the bench sets in SPDL's subprocesses
    ds = Counting(23, shard)
    kw = dict(batch_size=4, num_workers=2, collate_fn=np_stack_collate, drop_last=drop_last,
              segment_bytes=segment_bytes_for(4 * 4096, leaves=4))
    got = _spdl(spdl_clean, ds, **kw)
    ref = _torch(ds, **kw)
    assert len(got) == len(ref) == {(False, False): 12, (False, True): 10,
                                    (True, False): 6, (True, True): 5}[shard, drop_last]
    _same(got, ref)


@pytest.mark.timeout(90)
def test_batches_are_views_of_the_pool_and_stopping_early_cleans_up(spdl_clean):
    ds = PremadeDataset(8192, 64, distinct=4)
    ld = SpdlArenaLoader(ds, batch_size=4, num_workers=2, collate_fn=np_stack_collate,
                         segment_bytes=segment_bytes_for(4 * 8192, leaves=4))
    spdl_clean.append(ld)
    it = iter(ld)
    first = next(it)
    assert isinstance(first, np.ndarray) and first.shape == (4, 2048)
    assert not first.flags.owndata  # a zero-copy view of a pool segment
    assert _psm_mapped()
    np.testing.assert_array_equal(first[1], ds[1])
    del first
    next(it)  # workers still making batches when the loop stops
    ld.close()
    del it


@pytest.mark.timeout(90)
def test_worker_error_reaches_the_main_process(spdl_clean):
    def boom(samples):
        raise ValueError("bad sample")

    ld = SpdlArenaLoader(PremadeDataset(64, 16), batch_size=4, num_workers=2, collate_fn=boom,
                         segment_bytes=segment_bytes_for(256, leaves=4))
    spdl_clean.append(ld)
    with pytest.raises(Exception, match="bad sample"):
        list(ld)
    ld.close()


@pytest.mark.timeout(30)
def test_options_are_checked():
    for kw, what in ((dict(num_workers=0), "num_workers"), (dict(prefetch_factor=0), "prefetch"),
                     (dict(segment_bytes=0), "segment_bytes")):
        args = dict(batch_size=2, num_workers=1, collate_fn=np_stack_collate, segment_bytes=1 << 20)
        args.update(kw)
        with pytest.raises(ValueError, match=what):
            SpdlArenaLoader(PremadeDataset(64, 4), **args)


# ---------------------------------------------------------------------------------------------
# as the harness builds it


@pytest.mark.timeout(90)
@pytest.mark.parametrize("make", [
    lambda: transport_points([64 * 1024], consumers=["touch"])[0],
    lambda: small_points()[0],
    lambda: vision_points(consumers=["touch"])[0],
])
def test_harness_transport_gives_torch_pickle_nps_batches(spdl_clean, make):
    p = make()
    t = all_transports()
    assert skip_reason(t["spdl-arena"], p) is None
    ds = p.dataset()
    ld = make_loader(t["spdl-arena"], p, ds)
    spdl_clean.append(ld)
    try:
        got = [_copy(b) for _, b in zip(range(5), ld)]
    finally:
        ld.close()
    ref = [_copy(b) for _, b in zip(range(5), make_loader(t["torch-pickle-np"], p, ds))]
    _same(got, ref)


@pytest.mark.timeout(90)
def test_seed001_uses_the_posted_collate(spdl_clean):
    (p,) = seed001_points(["small"], [2])
    t = all_transports()["spdl-arena"]
    assert t.collate_for(p) == "numpy" and skip_reason(t, p) is None
    assert "no workers" in skip_reason(t, seed001_points(["small"], [0])[0])
    ld = make_loader(t, p, p.dataset())
    spdl_clean.append(ld)
    assert ld.prefetch_factor == 4  # as the posted DataLoader
    try:
        batch = next(iter(ld))
        assert isinstance(batch, list) and len(batch) == 128  # the records, as posted
        assert batch[0].shape == (10, 150) and batch[0].dtype == np.float64
        del batch
    finally:
        ld.close()


def test_workers_draw_different_random_numbers():
    # torch seeds numpy per worker; so does the bench in SPDL's subprocesses
    from bench.spdl_arena import init_worker

    init_worker(0, 2, 7, None)
    a = np.random.random(4)
    init_worker(1, 2, 7, None)
    b = np.random.random(4)
    from torch.utils.data._utils import worker as torch_worker

    torch_worker._worker_info = None
    assert not np.array_equal(a, b)
    assert torch.initial_seed() == 8
