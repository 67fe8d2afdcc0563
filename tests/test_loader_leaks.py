"""Nothing of a ShmDataLoader outlives its use: after an epoch, a `break`, `del loader`, a worker's
exception or death, a timeout or a full ring, no worker process, file descriptor or shared-memory
segment of it remains (checked by tests/conftest.py's snapshots: child processes, fds, threads,
mapped segments and /dev/shm entries).  Batches the user still holds keep only their own
segments mapped, and those go with the batches."""

from __future__ import annotations

import json
import os

import pytest

from shmloader import LoaderTimeoutError, RingFullError, ShmDataLoader, WorkerDiedError

from . import _datasets as ds
from ._launch import run_python
from .conftest import assert_no_leaks, mapped_segments, process_snapshot

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leaks")]


def _drain(iterable) -> int:
    """Iterate to the end keeping no batch (a `for _ in ...` would keep the last one)."""
    n = 0
    for _ in iterable:
        n += 1
    del _
    return n


def _loader(method="fork", dataset=None, **kwargs):
    kwargs.setdefault("batch_size", 2)
    kwargs.setdefault("num_workers", 2)
    return ShmDataLoader(dataset if dataset is not None else ds.ArrayDataset(n=24, nbytes=8192),
                         multiprocessing_context=method, **kwargs)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_after_an_epoch_and_after_a_break(method, no_leaks):
    loader = _loader(method)
    assert _drain(loader) == 12
    assert_no_leaks(no_leaks)  # the loader object is still alive: only its iterator is done
    for i, _batch in enumerate(loader):
        if i == 2:
            break
    del _batch
    assert_no_leaks(no_leaks)


def test_an_abandoned_iterator(no_leaks):
    loader = _loader()
    it = iter(loader)
    batch = next(it)
    assert len(process_snapshot().children - no_leaks.children) == 2
    del it  # a half-read epoch: the workers go with the iterator
    del batch, loader
    assert_no_leaks(no_leaks)


def test_del_of_a_persistent_loader(no_leaks):
    loader = _loader(persistent_workers=True)
    for _ in range(2):
        _drain(loader)
    assert len(process_snapshot().children - no_leaks.children) == 2  # persistent workers wait for the next epoch
    del loader
    assert_no_leaks(no_leaks)


def test_held_batches_keep_only_their_segments(no_leaks):
    loader = _loader(dataset=ds.ArrayDataset(n=8, nbytes=8192))
    held = list(loader)
    now = process_snapshot()
    assert not (now.children - no_leaks.children)
    assert not {fd: t for fd, t in now.fds.items() if no_leaks.fds.get(fd) != t}
    assert mapped_segments() - no_leaks.mapped  # the held batches' slots, and only those
    del held
    assert_no_leaks(no_leaks)
    del loader


def test_after_a_worker_exception(no_leaks):
    loader = _loader(dataset=ds.FailingDataset(n=16, bad=5), batch_size=1)
    it = iter(loader)
    with pytest.raises(ValueError):
        _drain(it)
    del it
    assert_no_leaks(no_leaks)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_after_a_worker_is_killed(method, no_leaks):
    loader = _loader(method, dataset=ds.KillSelfDataset(n=32, bad=5), batch_size=1)
    it = iter(loader)
    with pytest.raises(WorkerDiedError):
        _drain(it)
    assert_no_leaks(no_leaks)  # shut down at once, though the iterator is still referenced


def test_after_a_timeout(no_leaks):
    """A timeout leaves the iterator usable, as torch's does (the next next() waits for the same
    batch again); dropping the iterator then frees everything."""
    loader = _loader(dataset=ds.SlowDataset(n=8, slow=1, seconds=3.0), batch_size=1, timeout=0.5)
    it = iter(loader)
    with pytest.raises(LoaderTimeoutError):
        _drain(it)
    del it
    assert_no_leaks(no_leaks)


def test_after_a_full_ring(no_leaks):
    loader = _loader(max_ring_slots=6)
    held = []
    it = iter(loader)
    with pytest.raises(RingFullError):
        for batch in it:
            held.append(batch)
    del held, batch, it
    assert_no_leaks(no_leaks)


@pytest.mark.timeout(120)
def test_sigchld_ignored_by_the_launcher_leaks_nothing_and_a_death_says_why_its_status_is_unknown():
    """NOTE [ SIGCHLD ignored ] in pool.py: with SIGCHLD at SIG_IGN the kernel reaps the workers,
    so multiprocessing never learns they ended; each loader used to leave its workers' sentinel
    pipes open (4 fds) and a SIGKILLed worker was reported as "still running"."""
    script = os.path.join(os.path.dirname(__file__), "_sigchld_script.py")
    done = run_python(script)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["fds_after_epochs"] == got["fds_before"], got
    assert got["fds_after_death"] == got["fds_before"], got
    assert got["error"] is not None and "still running" not in got["error"], got
    assert "SIGCHLD" in got["error"] and "DataLoader worker 0" in got["error"], got
    assert got["seconds_to_error"] < 10, got
