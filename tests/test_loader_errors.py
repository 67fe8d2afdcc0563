"""The basic error cases of ShmDataLoader, each beside torch's DataLoader where torch has an
answer: worker exceptions (type, worker, stage, traceback), a killed worker, `timeout=`, and
leaves that cannot travel (paths named); then the defects issue 8 found by reading the code,
out-of-order scheduling and typing against torch.  The big fault tables are tests/test_faults.py."""

from __future__ import annotations

import os
import signal
import threading
import time
import typing
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from shmloader import (
    BatchShapeError,
    LayoutError,
    LoaderBrokenError,
    ShmCapacityError,
    ShmDataLoader,
    SlotProtocolError,
    WorkerDiedError,
    protocol,
    torch_private,
)
from shmloader.errors import RemoteTraceback
from shmloader.ring import Ring

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


class _MissingKey(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        raise KeyError("missing-key")


def test_a_key_error_prints_its_traceback_as_lines_as_torch_does():
    """torch hands a worker's KeyError a message whose repr() is itself: str(e) and the printed
    error are the traceback's lines, not one quoted line of escaped newlines."""
    messages = []
    for loader_class in (DataLoader, ShmDataLoader):
        with pytest.raises(KeyError) as caught:
            next(iter(loader_class(_MissingKey(), batch_size=2, num_workers=1)))
        messages.append(str(caught.value))
    got, want = messages[1], messages[0]
    # lines as torch's are (their number varies with the frames each worker loop adds)
    assert got.count("\n") > 3 and want.count("\n") > 3 and "\\n" not in got
    assert got.startswith("Caught KeyError in DataLoader worker 0") and got.rstrip().endswith("KeyError: 'missing-key'")


class NeedsTwo(Exception):
    def __init__(self, what, code):
        super().__init__(what, code)


class _RaisesNeedsTwo(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        raise NeedsTwo("bad", i)


def _ufunc_collate(samples):
    return np.add(np.array(["a"]), 1)  # numpy's UFuncTypeError, built from a ufunc and dtypes


@pytest.mark.parametrize("case", ["constructor", "ufunc"])
def test_an_error_that_cannot_be_rebuilt_from_a_message_is_a_runtime_error_as_torch(case):
    """torch rebuilds a worker's exception as type(e)(message) and raises RuntimeError(message)
    where that fails; code written for torch catches it with `except RuntimeError`."""
    kwargs = ({"dataset": _RaisesNeedsTwo()} if case == "constructor"
              else {"dataset": ds.ArrayDataset(n=4, nbytes=64), "collate_fn": _ufunc_collate})
    caught = []
    for loader_class in (DataLoader, ShmDataLoader):
        with pytest.raises(RuntimeError) as error:
            next(iter(loader_class(batch_size=2, num_workers=1, **kwargs)))
        caught.append(error.value)
    assert isinstance(caught[1], RuntimeError) and type(caught[0]) is RuntimeError
    assert "Caught" in str(caught[1]) and ("NeedsTwo" in str(caught[1]) or "UFunc" in str(caught[1]))


class _RaisesWithALock(Dataset):
    """Raises at index 1 an exception that does not pickle (it carries a lock)."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 1:
            error = ValueError("bad sample 1")
            error.handle = threading.Lock()
            raise error
        return torch.tensor([i])


def test_an_exception_that_does_not_pickle_keeps_its_type_as_torch():
    """torch's workers send only the exception's type and text; so does a worker whose exception
    does not pickle.  The epoch goes on after it, as under torch."""
    got = []
    for loader_class in (DataLoader, ShmDataLoader):
        it = iter(loader_class(_RaisesWithALock(), batch_size=2, num_workers=1))
        with pytest.raises(ValueError, match="bad sample 1") as error:
            next(it)
        got.append((type(error.value), next(it).tolist()))
        if loader_class is DataLoader:  # its iterator lives on in the traceback's cycle: stop its
            it._shutdown_workers()      # workers now, not from a gc pass (SIGTERM, /tmp/pymp-* left)
        del it, error
    assert got[0] == got[1] == (ValueError, [[2], [3]])


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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_collate_fn_that_does_not_pickle_raises_torchs_error_with_its_hint(method):
    """Under spawn and forkserver the worker's arguments are pickled: torch's PicklingError, and
    torch's warning saying why and what to do (found by a new-user check: the hint was missing)."""
    def run(cls):
        hint = "Got pickle error when attempting to start a worker Process"
        # (torch 2.6's own DataLoader gives no such hint)
        with pytest.warns(UserWarning, match=hint) if cls is not DataLoader else warnings.catch_warnings(record=True) as caught:
            with pytest.raises(Exception) as info:
                list(cls(ds.ArrayDataset(n=8), batch_size=2, num_workers=2,
                         multiprocessing_context=method, collate_fn=lambda batch: batch))
        return type(info.value), [str(w.message) for w in caught]

    want_type, _ = run(DataLoader)
    got_type, warned = run(ShmDataLoader)
    assert got_type is want_type
    assert any(method in message and "module level" in message for message in warned), warned


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
    # broken: the next next() says why, then the epoch has ended (NOTE [ Shutdown ])
    with pytest.raises(LoaderBrokenError, match=r"earlier error \(WorkerDiedError: DataLoader worker 1"):
        next(it)
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(it)
    del it, loader, info


class _ExitsAt7(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == 7:
            os._exit(3)
        return i


@pytest.mark.parametrize("sample_parallel", [False, True])
def test_a_loop_that_logs_errors_and_goes_on_ends_after_a_worker_death(sample_parallel):
    """A "log and skip" loop (catch, call next() again) ends under torch after a worker death;
    it spun for ever here, each next() raising LoaderBrokenError.  torch goes on with the other
    worker's batches; this loader ends the epoch there (NOTE [ Shutdown ] in pool.py)."""
    loader = ShmDataLoader(_ExitsAt7(), batch_size=2, num_workers=2, sample_parallel=sample_parallel)
    it, delivered, errors = iter(loader), [], []
    for _ in range(100):
        try:
            delivered.append(next(it).tolist())
        except StopIteration:
            break
        except Exception as exc:  # noqa: BLE001 (what such a loop does)
            errors.append(type(exc))
    else:
        raise AssertionError(f"the loop did not end: {len(errors)} errors, {delivered}")
    assert errors[:1] == [WorkerDiedError] and errors[1:] == [LoaderBrokenError]
    assert delivered == [[0, 1], [2, 3], [4, 5]][:len(delivered)] and len(delivered) >= 1
    del it, loader


def test_persistent_loader_starts_fresh_workers_after_a_death(tmp_path):
    has_batch_4 = tmp_path / "has-batch-4"  # worker 1 dies at sample 5 only once the loop has 0-4
    loader = ShmDataLoader(ds.KillSelfDataset(n=16, bad=5, after=str(has_batch_4)), batch_size=1,
                           num_workers=2, persistent_workers=True)
    for _ in range(2):
        has_batch_4.unlink(missing_ok=True)
        delivered = []
        with pytest.raises(WorkerDiedError, match="worker 1"):
            for batch in loader:
                delivered.append(int(batch[0, 0]))
                if delivered[-1] == 4:
                    has_batch_4.touch()
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


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # torch's __del__
def test_a_generator_that_is_not_one_raises_torchs_type_error(num_workers, shuffle):
    raised = []
    for cls in (ShmDataLoader, DataLoader):
        with pytest.raises(Exception) as info:  # iter() raises, under torch
            iter(cls(list(range(8)), batch_size=2, num_workers=num_workers, shuffle=shuffle, generator=5))
        raised.append(info.value)
    assert type(raised[0]) is type(raised[1]) is TypeError
    assert "generator" in str(raised[0])


# -- leaves that cannot travel ---------------------------------------------------------------------------


def test_mismatched_shapes_name_the_path_and_both_shapes():
    (exc, _), (ref_exc, _) = _both_errors(ds.MismatchedShapeDataset(), batch_size=4, num_workers=2)
    assert isinstance(exc, type(ref_exc))  # torch.stack's RuntimeError
    assert isinstance(exc, BatchShapeError)
    message = str(exc)
    assert "batch['image']" in message
    assert "[3, 4]" in message and "[3, 5]" in message
    # torch's own words too: code written for torch's loader may match them
    torchs = str(ref_exc).strip().splitlines()[-1].split(": ", 1)[1]
    assert torchs.startswith("stack expects each tensor to be equal size") and torchs in message, (torchs, message)


def test_object_array_with_default_collate_names_the_path():
    (exc, _), (ref_exc, _) = _both_errors(ds.ObjectArrayDataset(), batch_size=2, num_workers=2)
    assert isinstance(exc, type(ref_exc))  # default_collate's TypeError
    assert "batch['obj']" in str(exc)


class _StrFails(Exception):
    def __str__(self):
        raise RuntimeError("this exception's str() fails")


class _RaisesStrFails(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        if i == 2:
            raise _StrFails("sample 2")
        return torch.tensor([i])


def test_an_exception_whose_str_raises_is_raised_and_the_epoch_goes_on_as_torch():
    """Sending a worker's exception formats it: an exception whose __str__ raises must not kill
    the worker (it did: the loader broke) where torch re-raises its type and goes on."""
    got = []
    for loader_class in (DataLoader, ShmDataLoader):
        it = iter(loader_class(_RaisesStrFails(), batch_size=2, num_workers=1))
        first = next(it).tolist()
        with pytest.raises(_StrFails) as error:
            next(it)
        got.append((first, next(it).tolist(), collect(it)))
        if loader_class is DataLoader:
            it._shutdown_workers()
        del it, error
    assert got[0][:2] == got[1][:2] == ([[0], [1]], [[4], [5]])
    assert got[0][2] == got[1][2] == []


class _NeitherPicklesNorPrints:
    def __reduce__(self):
        raise TypeError("no pickling")

    def __repr__(self):
        raise RuntimeError("no repr either")


def _collate_with_an_odd_leaf(samples):
    return {"x": torch.stack(samples), "odd": _NeitherPicklesNorPrints()}


def test_a_leaf_that_neither_pickles_nor_prints_names_its_path():
    exc, _ = _first_error(ShmDataLoader(_RaisesStrFails(), batch_size=1, num_workers=1,
                                        collate_fn=_collate_with_an_odd_leaf))
    assert isinstance(exc, LayoutError), exc
    assert "batch['odd']" in str(exc) and "repr() failed" in str(exc) and "no pickling" in str(exc)


def test_object_array_from_custom_collate_arrives_as_torch_delivers_it():
    shm = ShmDataLoader(ds.DictDataset(n=4), batch_size=2, num_workers=2, collate_fn=ds.object_array_collate)
    ref = DataLoader(ds.DictDataset(n=4), batch_size=2, num_workers=2, collate_fn=ds.object_array_collate)
    assert_same_batches(collect(shm), collect(ref))  # pickled, as torch pickles it


def test_unpicklable_leaf_names_the_path():
    exc, _ = _first_error(ShmDataLoader(ds.DictDataset(n=4), batch_size=2, num_workers=2,
                                        collate_fn=ds.lambda_leaf_collate))
    assert isinstance(exc, LayoutError)
    assert "batch['extra'][1]" in str(exc) and "function" in str(exc)


# -- defects found by reading the code (issue 8), each a test that failed before its fix -----------


@pytest.mark.timeout(30)
def test_an_error_after_a_result_is_taken_breaks_the_iterator(monkeypatch):
    """ShmCapacityError while adopting a worker's new slot happens after the result was taken
    from the worker: the iterator must shut down and say so on every later next(), never wait
    for a result that will not come (timeout=0 would wait forever)."""
    loader = ShmDataLoader(ds.ArrayDataset(n=16, nbytes=4096), batch_size=2, num_workers=2, timeout=0,
                           multiprocessing_context="fork")
    it = iter(loader)  # the workers exist now: only the main process's check is refused below

    def refuse(ring):
        raise ShmCapacityError(1 << 40, 0, "/dev/shm", f"the ring ({ring.depth} slots)")

    monkeypatch.setattr(Ring, "_check_fits", refuse)
    with pytest.raises(ShmCapacityError):
        next(it)
    assert it._shutdown
    with pytest.raises(LoaderBrokenError, match="ShmCapacityError"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    del it, loader


def test_an_error_while_waiting_for_a_slot_names_that_stage():
    """A worker whose grant is bad fails while waiting for its slot, not 'laying out the batch'."""
    from torch.utils.data.dataloader import _DatasetKind

    from shmloader import worker as worker_module

    class FakeChannel:
        def __init__(self, incoming):
            self.incoming, self.sent = list(incoming), []

        def recv(self):
            return self.incoming.pop(0)

        def send(self, message, fds=()):
            self.sent.append(message)

    spec = worker_module.WorkerSpec(
        worker_id=0, num_workers=1, base_seed=0, dataset_kind=_DatasetKind.Map, auto_collation=True,
        collate_mode=worker_module.COLLATE_CUSTOM, drop_last=False, payload=None,
        main_pid=os.getpid(), forked=False, ring_depth=4)
    bad_grant = protocol.Grant(0, 5, 4096, 0)  # generation 5 of a slot, but no segment with it
    worker = worker_module._Worker(spec, FakeChannel([(bad_grant, [])]))
    dataset = ds.ArrayDataset(n=4, nbytes=64)
    worker.fetcher = _DatasetKind.create_fetcher(_DatasetKind.Map, dataset, True, worker_module._identity, False)
    worker.collate_fn = np.stack
    worker._task(protocol.Task(0, 0, [0, 1]))
    failed = worker.channel.sent[-1]
    assert type(failed) is protocol.Failed and failed.idx == 0
    stage, payload = failed.stage, failed.payload
    assert stage == protocol.STAGES[protocol.AWAITING_SLOT], stage
    assert "without its segment" in payload[2]


@pytest.mark.timeout(60)
def test_a_worker_error_outside_a_task_comes_with_its_message():
    """A worker failing between tasks (here: a message it does not know) reports its exception,
    not just 'exited with status 1'; the iterator is broken afterwards."""
    loader = ShmDataLoader(ds.ArrayDataset(n=64, nbytes=1024), batch_size=1, num_workers=2,
                           multiprocessing_context="fork")
    it = iter(loader)
    it._pool.channels[1].send(protocol.Resumed(42))  # a message only workers send
    with pytest.raises(SlotProtocolError) as info:
        for _ in range(64):
            next(it)
    message = str(info.value)
    assert "DataLoader worker 1" in message and "unexpected message Resumed(epoch=42)" in message, message
    assert "exited with status" not in message, message
    with pytest.raises(LoaderBrokenError, match="SlotProtocolError"):
        next(it)
    del it, loader, info


class SlowFirstSample(Dataset):
    """Index 0 waits until the loop has had index 9 (`release` exists); each sample says which
    worker made it."""

    def __init__(self, release: str):
        self.release = release

    def __len__(self):
        return 10

    def __getitem__(self, i):
        if i == 0:
            deadline = time.monotonic() + 30
            while not os.path.exists(self.release) and time.monotonic() < deadline:
                time.sleep(0.005)
        return torch.tensor([i, get_worker_info().id])


@pytest.mark.skipif(not torch_private.OUT_OF_ORDER_BY_CAPACITY,
                    reason="torch 2.6 gives in_order=False tasks round-robin: no order to pin")
@pytest.mark.timeout(90)
@pytest.mark.parametrize("keep", [False, True])
def test_out_of_order_schedules_tasks_as_torch_does(keep, tmp_path):
    """in_order=False with a slow index 0: the same order, from the same workers, as torch's
    ([1, 3, 4, 5, 6, 7, 8, 9, 0, 2] from workers [1]*8 + [0]*2), whether the loop keeps its
    batches or not.  Index 0 ends only once the loop has index 9, so no timing decides it."""
    def run(cls, release):
        loader = cls(SlowFirstSample(str(release)), batch_size=1, num_workers=2, prefetch_factor=2,
                     in_order=False)
        out = []
        for batch in loader:
            out.append(batch if keep else batch.clone())
            if int(batch[0, 0]) == 9:
                release.touch()
        return [(int(b[0, 0]), int(b[0, 1])) for b in out]

    want = [(i, 1) for i in (1, 3, 4, 5, 6, 7, 8, 9)] + [(0, 0), (2, 0)]
    assert run(DataLoader, tmp_path / "torch") == want
    assert run(ShmDataLoader, tmp_path / "shm") == want


def test_generic_like_torchs_dataloader():
    alias = ShmDataLoader[list[torch.Tensor]]
    assert typing.get_origin(alias) is ShmDataLoader
    assert typing.get_args(alias) == (list[torch.Tensor],)
    assert len(ShmDataLoader.__parameters__) == len(DataLoader.__parameters__) == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_workers_start_when_stderr_has_no_file_descriptor(capsys, start_method):
    """pytest's capsys (or a notebook) replaces sys.stderr by an object without a file descriptor;
    a forked worker inherits it: it must start all the same, as torch's do."""
    loader = ShmDataLoader(ds.ArrayDataset(n=8, nbytes=64), batch_size=2, num_workers=2,
                           multiprocessing_context=start_method)
    assert_same_batches(collect(loader), collect(DataLoader(ds.ArrayDataset(n=8, nbytes=64), batch_size=2)))


class ExitsAt5(Dataset):
    """A dataset whose sample 5 ends its process (a library calling sys.exit on bad input)."""

    def __init__(self, exit_with: type[BaseException]):
        self.exit_with = exit_with

    def __len__(self):
        return 20

    def __getitem__(self, i):
        if i == 5:
            raise self.exit_with()
        return np.ones(4)


@pytest.mark.parametrize("exit_with", [SystemExit, KeyboardInterrupt])
def test_a_worker_that_exits_raises_a_runtime_error_not_the_exit(exit_with):
    """SystemExit or KeyboardInterrupt inside a worker ends that worker, as under torch (which
    raises RuntimeError: worker exited unexpectedly): the training process gets an Exception its
    `except Exception` catches, never the exit itself."""
    with pytest.raises(RuntimeError, match=exit_with.__name__):
        for _ in ShmDataLoader(ExitsAt5(exit_with), batch_size=4, num_workers=2):
            pass


def _events(loader, n: int = 12) -> list:
    """The first values of each batch, an exception's type name, or StopIteration, in order."""
    it, out = iter(loader), []
    for _ in range(n):
        try:
            out.append(int(next(it)[0]))
        except StopIteration:
            out.append("StopIteration")
            break
        except Exception as exc:  # noqa: BLE001 - what the loop sees
            out.append(type(exc).__name__)
    return out


@pytest.mark.parametrize("kwargs", [{}, {"persistent_workers": True, "prefetch_next_epoch": True}],
                         ids=["default", "prefetch-next-epoch"])
def test_a_sampler_that_raises_mid_epoch_goes_on_as_torch(kwargs):
    """torch raises the sampler's error at the next() that draws the failing batch (that next()'s
    batch is lost), then delivers the batches already sent and ends the epoch; so does shmloader
    (found by a new-user check: it shut the iterator down, losing those batches)."""
    make = dict(dataset=ds.ArrayDataset(32, nbytes=4), batch_size=4, num_workers=2)
    want = _events(DataLoader(sampler=ds.SamplerFailingAt(), **make))
    assert want == [0, 4, 8, "IndexError", 16, 20, 24, "StopIteration"]  # torch's, as of 2.13
    assert _events(ShmDataLoader(sampler=ds.SamplerFailingAt(), **make, **kwargs)) == want


def test_a_sampler_that_raises_mid_epoch_goes_on_in_sample_parallel():
    """The same in sample_parallel: the error once, at the next() that draws the failing batch
    (another one than torch's, since the mode keeps max(2, prefetch_factor) batches in flight),
    and the batches in flight after it, in order."""
    got = _events(ShmDataLoader(ds.ArrayDataset(32, nbytes=4), batch_size=4, num_workers=2, sample_parallel=True,
                                sampler=ds.SamplerFailingAt()))
    assert got.count("IndexError") == 1 and got[-1] == "StopIteration"
    values = [v for v in got if isinstance(v, int)]
    assert values == sorted(values) and set(values) <= set(range(0, 28, 4)) and len(values) >= 5


@pytest.mark.parametrize("sample_parallel", [False, True], ids=["default", "sample_parallel"])
def test_one_iterator_used_by_two_threads_at_once_is_a_clear_error_not_a_hang(sample_parallel):
    """A persistent loader's iterator (iter(loader) returns that one iterator) driven by two
    threads at once used to corrupt its state: one thread hung in a worker's socket, or a worker
    was reported dead. Not thread-safe in torch either; now the second caller gets a
    RuntimeError that says so, and the first goes on undisturbed."""
    loader = ShmDataLoader(ds.SlowDataset(n=4, slow=0, seconds=0.5), batch_size=2, num_workers=2,
                           persistent_workers=True, sample_parallel=sample_parallel)
    it = iter(loader)
    got: list = []
    taker = threading.Thread(target=lambda: got.append(next(it)))
    taker.start()
    deadline = time.monotonic() + 5
    while not it._in_use.locked() and time.monotonic() < deadline:  # the thread is inside next()
        time.sleep(0.001)
    with pytest.raises(RuntimeError, match="another thread is inside next"):
        next(it)
    with pytest.raises(RuntimeError, match="not thread-safe"):
        iter(loader)
    taker.join(10)
    assert not taker.is_alive() and len(got) == 1
    assert_same_batches(got + list(it), list(DataLoader(ds.SlowDataset(n=4, slow=0, seconds=0), batch_size=2)))


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(num_workers=2.0), r"num_workers must be an int, got 2.0 \(float\)"),
    (dict(num_workers="2"), r"num_workers must be an int, got '2' \(str\)"),
    (dict(num_workers=2, prefetch_factor=2.0), r"prefetch_factor must be an int, got 2.0 \(float\)"),
])
def test_a_count_that_is_not_an_int_is_a_type_error_naming_it(kwargs, message):
    """torch takes num_workers=2.0 and fails at iter() in its own code ("can't multiply
    sequence...", "'float' object cannot be interpreted as an integer"); here it is a TypeError
    at construction naming the argument, and at iter() where it was set afterwards."""
    dataset = torch.utils.data.TensorDataset(torch.arange(10.0))
    with pytest.raises(TypeError, match=message):
        ShmDataLoader(dataset, batch_size=2, **kwargs)
    loader = ShmDataLoader(dataset, batch_size=2, num_workers=2)
    for name, value in kwargs.items():
        setattr(loader, name, value)
    with pytest.raises(TypeError, match=message):
        iter(loader)


def test_numpy_counts_and_workers_set_after_construction_work_as_torchs_defaults():
    """A numpy int is an int to torch (range() takes it); workers set after a loader built with
    none get torch's default prefetch_factor (torch's own loader fails there, in its iterator)."""
    dataset = torch.utils.data.TensorDataset(torch.arange(10.0))
    want = collect(DataLoader(dataset, batch_size=2))
    loader = ShmDataLoader(dataset, batch_size=2, num_workers=np.int64(2), prefetch_factor=np.int32(3))
    assert_same_batches(collect(loader), want)
    later = ShmDataLoader(dataset, batch_size=2)
    later.num_workers = np.int64(2)
    assert_same_batches(collect(later), want)
    assert later.prefetch_factor == 2
    del loader, later
