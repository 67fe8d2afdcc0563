"""The basic error cases of ShmDataLoader, each beside torch's DataLoader where torch has an
answer: worker exceptions (type, worker, stage, traceback), a killed worker, `timeout=`, and
leaves that cannot travel (paths named).  The big fault tables are tests/test_faults.py."""

from __future__ import annotations

import signal
import time

import pytest
from torch.utils.data import DataLoader

from shmloader import BatchShapeError, LayoutError, ShmDataLoader, WorkerDiedError
from shmloader.errors import RemoteTraceback

from . import _datasets as ds
from ._helpers import assert_same_batches, collect

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leaks")]


def _first_error(loader, consume: bool = False):
    """The exception iterating `loader` raises (and, with consume, the batches after it)."""
    it = iter(loader)
    try:
        while True:
            try:
                next(it)
            except StopIteration:
                raise AssertionError("no exception was raised") from None
            except Exception as exc:
                return exc, (collect(it) if consume else [])
    finally:
        if not isinstance(loader, ShmDataLoader):
            it._shutdown_workers()  # torch's iterator takes 10 s to stop when left to the gc


def _both_errors(dataset, consume=False, **kwargs):
    got = _first_error(ShmDataLoader(dataset, **kwargs), consume)
    want = _first_error(DataLoader(dataset, **kwargs), consume)
    return got, want


# -- exceptions raised in workers --------------------------------------------------------------------


def test_dataset_exception_names_worker_stage_and_keeps_traceback():
    (exc, after), (ref_exc, ref_after) = _both_errors(
        ds.FailingDataset(n=16, bad=5), consume=True, batch_size=1, num_workers=2)
    assert type(exc) is type(ref_exc) is ValueError
    message = str(exc)
    assert "worker 1" in message  # batch 5 comes from worker 5 mod 2
    assert "fetching" in message and "batch 5" in message
    assert "bad sample 5 requested" in message
    assert isinstance(exc.__cause__, RemoteTraceback)
    assert "__getitem__" in str(exc.__cause__) and "_datasets.py" in str(exc.__cause__)
    assert exc.worker_id == 1
    # as in torch, the iterator goes on with the batches after the failed one
    assert_same_batches(after, ref_after)


def test_collate_exception_names_the_stage():
    (exc, _), (ref_exc, _) = _both_errors(ds.DictDataset(n=8), batch_size=2, num_workers=2,
                                          collate_fn=ds.failing_collate)
    assert type(exc) is type(ref_exc) is KeyError
    assert "worker 0" in str(exc) and "collat" in str(exc)
    assert "failing_collate" in str(exc.__cause__)


def test_worker_init_fn_exception_names_the_stage():
    (exc, _), (ref_exc, _) = _both_errors(ds.DictDataset(n=8), batch_size=2, num_workers=2,
                                          worker_init_fn=ds.failing_init)
    assert type(exc) is type(ref_exc) is ZeroDivisionError
    assert "worker_init_fn" in str(exc) and "init of worker 0 fails" in str(exc)
    assert "failing_init" in str(exc.__cause__)


def test_dataset_exception_under_spawn():
    exc, _ = _first_error(ShmDataLoader(ds.FailingDataset(n=6, bad=2), batch_size=1, num_workers=2,
                                        multiprocessing_context="spawn"))
    assert type(exc) is ValueError and "worker 0" in str(exc)


# -- a worker that dies --------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_killed_worker_raises_quickly_naming_worker_pid_and_signal(method):
    loader = ShmDataLoader(ds.KillSelfDataset(n=64, bad=9), batch_size=1, num_workers=2,
                           multiprocessing_context=method)
    it = iter(loader)
    pids = [p.pid for p in it._workers]
    start = time.monotonic()
    with pytest.raises(WorkerDiedError) as info:
        for _ in it:
            pass
    assert time.monotonic() - start < 5.0
    assert isinstance(info.value, RuntimeError)  # what torch raises for a dead worker
    message = str(info.value)
    assert "worker 1" in message and f"pid {pids[1]}" in message and "SIGKILL" in message
    assert info.value.exitcode == -signal.SIGKILL
    with pytest.raises(StopIteration):  # the loader has been shut down
        next(it)
    del it, loader, info


def test_persistent_loader_starts_fresh_workers_after_a_death():
    loader = ShmDataLoader(ds.KillSelfDataset(n=16, bad=5), batch_size=1, num_workers=2,
                           persistent_workers=True)
    for _ in range(2):
        delivered = []
        with pytest.raises(WorkerDiedError, match="worker 1"):
            for batch in loader:
                delivered.append(int(batch[0, 0]))
        assert delivered == [0, 1, 2, 3, 4]
    del loader, batch


# -- timeout ------------------------------------------------------------------------------------------


def test_timeout_raises_like_torch():
    start = time.monotonic()
    (exc, _), (ref_exc, _) = _both_errors(ds.SlowDataset(n=8, slow=3, seconds=4.0), batch_size=1,
                                          num_workers=2, timeout=1)
    assert isinstance(exc, type(ref_exc))  # torch raises RuntimeError
    assert isinstance(exc, TimeoutError)
    assert "1 seconds" in str(exc) and "batch 3" in str(exc)
    assert time.monotonic() - start < 15


def test_timeout_is_not_raised_when_batches_arrive_in_time():
    shm = ShmDataLoader(ds.SlowDataset(n=6, slow=2, seconds=0.3), batch_size=1, num_workers=2, timeout=5)
    assert len(collect(shm)) == 6


# -- leaves that cannot travel ---------------------------------------------------------------------------


def test_mismatched_shapes_name_the_path_and_both_shapes():
    (exc, _), (ref_exc, _) = _both_errors(ds.MismatchedShapeDataset(), batch_size=4, num_workers=2)
    assert isinstance(exc, type(ref_exc))  # torch.stack's RuntimeError
    assert isinstance(exc, BatchShapeError)
    message = str(exc)
    assert "batch['image']" in message
    assert "[3, 4]" in message and "[3, 5]" in message


def test_object_array_with_default_collate_names_the_path():
    (exc, _), (ref_exc, _) = _both_errors(ds.ObjectArrayDataset(), batch_size=2, num_workers=2)
    assert isinstance(exc, type(ref_exc))  # default_collate's TypeError
    assert "batch['obj']" in str(exc)


def test_object_array_from_custom_collate_arrives_as_torch_delivers_it():
    shm = ShmDataLoader(ds.DictDataset(n=4), batch_size=2, num_workers=2, collate_fn=ds.object_array_collate)
    ref = DataLoader(ds.DictDataset(n=4), batch_size=2, num_workers=2, collate_fn=ds.object_array_collate)
    assert_same_batches(collect(shm), collect(ref))  # pickled, as torch pickles it


def test_unpicklable_leaf_names_the_path():
    exc, _ = _first_error(ShmDataLoader(ds.DictDataset(n=4), batch_size=2, num_workers=2,
                                        collate_fn=ds.lambda_leaf_collate))
    assert isinstance(exc, LayoutError)
    assert "batch['extra'][1]" in str(exc) and "function" in str(exc)
