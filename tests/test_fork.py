"""A process the user forks from the training process (NOTE [ A process forked by the user ] in
loader.py): the child may iterate the loader with workers of its own, and never disturbs the
parent's workers, whether it iterates, calls next() on the parent's iterator, or just exits."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader

from shmloader import ShmDataLoader

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("no_leaks")]

DATA = torch.arange(40.0).view(40, 1)


def _in_child(body) -> int:
    """Run `body()` in a forked child; its exit status (0: it returned True)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if body() else 3
        except BaseException as exc:  # noqa: BLE001 - reported through the exit status
            sys.stderr.write(f"child: {type(exc).__name__}: {exc}\n")
            code = 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("persistent_workers", [False, True])
def test_a_forked_child_iterates_with_workers_of_its_own_and_the_parent_goes_on(persistent_workers):
    loader = ShmDataLoader(DATA, batch_size=4, num_workers=2, persistent_workers=persistent_workers)
    want = list(DataLoader(DATA, batch_size=4))
    assert all(torch.equal(a, b) for a, b in zip(loader, want))  # workers (persistent: alive) now

    def child():
        return all(torch.equal(a, b) for a, b in zip(loader, want)) and len(list(loader)) == len(want)

    assert _in_child(child) == 0
    for _ in range(2):  # the parent's epochs, on its own workers
        got = list(loader)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    del got


def test_next_on_the_parents_iterator_in_a_child_raises_and_leaves_the_parent_alone():
    loader = ShmDataLoader(DATA, batch_size=4, num_workers=2)
    it = iter(loader)
    first = next(it)

    def child():
        try:
            next(it)
        except RuntimeError as exc:
            return "forked" in str(exc) and "iter(loader)" in str(exc)
        return False

    assert _in_child(child) == 0
    rest = list(it)
    assert torch.equal(first, DATA[:4]) and len(rest) == 9 and torch.equal(rest[-1], DATA[36:])
    del first, rest


def test_a_child_that_exits_through_the_garbage_collector_stops_none_of_the_parents_workers():
    loader = ShmDataLoader(DATA, batch_size=4, num_workers=2, persistent_workers=True)
    assert len(list(loader)) == 10

    def child():
        import gc

        global_loader = loader
        del global_loader
        gc.collect()
        loader._iterator.__del__()  # what the collector runs at the child's exit
        return True

    assert _in_child(child) == 0
    assert all(p.is_alive() for p in loader._iterator._workers)
    assert len(list(loader)) == 10


def test_a_child_drops_the_inherited_loader_though_a_thread_of_the_parent_held_a_lock_at_the_fork():
    """A lock that a thread of the parent held at the fork (the ring's spare-segment maker) stays
    held in the child, where that thread does not exist: dropping the inherited loader there must
    not wait for it."""
    loader = ShmDataLoader(DATA, batch_size=4, num_workers=2)
    it = iter(loader)
    first = next(it)
    spares_lock = it._ring._spares._cond
    held, release = threading.Event(), threading.Event()

    def hold():
        with spares_lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            import gc

            del it, first
            gc.collect()  # the iterator, its ring (and the ring's spare maker) are collected here
            code = 0
        finally:
            os._exit(code)
    release.set()
    holder.join()
    deadline = time.monotonic() + 20
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung dropping the inherited loader")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    rest = list(it)  # the parent's workers and ring are untouched
    assert torch.equal(first, DATA[:4]) and len(rest) == 9 and torch.equal(rest[-1], DATA[36:])
    del first, rest


_EXITS_NORMALLY = """
import os, sys, torch
from shmloader import ShmDataLoader
data = torch.arange(40.0).view(40, 1)
loader = ShmDataLoader(data, batch_size=4, num_workers=2, sample_parallel={sample_parallel})
it = iter(loader)
got = [next(it).tolist()]
if os.fork() == 0:
    if {iterates}:
        assert len(list(loader)) == 10
    sys.exit(0)  # a script's normal end: atexit handlers run
_, status = os.wait()
assert os.waitstatus_to_exitcode(status) == 0, status
got += [b.tolist() for b in it]
assert got == [[[4.0 * b + r] for r in range(4)] for b in range(10)], got
print("parent ok")
"""


@pytest.mark.parametrize("sample_parallel", [False, True])
@pytest.mark.parametrize("iterates", [False, True], ids=["exits", "iterates-then-exits"])
def test_a_child_that_exits_normally_stops_none_of_the_parents_workers(iterates, sample_parallel):
    """A normal exit runs multiprocessing's atexit handler, which terminated every daemon child it
    knew of: the parent's workers, inherited in its list (NOTE [ A fork of the user's ])."""
    from ._launch import run_python

    done = run_python("-c", _EXITS_NORMALLY.format(sample_parallel=sample_parallel, iterates=iterates),
                      timeout=60)
    assert "parent ok" in done.stdout


def test_a_fork_while_another_thread_starts_workers_gets_a_free_lock_and_collection_on():
    """A fork from one thread while another held the fork lock in forking() (starting a loader's
    workers): the child's iter() waited on that lock forever, with collection off."""
    import gc
    import threading

    from shmloader import ownership

    entered, release = threading.Event(), threading.Event()

    def starts_workers():
        with ownership.forking():
            entered.set()
            release.wait(30)

    thread = threading.Thread(target=starts_workers)
    thread.start()
    entered.wait(30)
    try:
        def child():
            if not gc.isenabled():
                return False
            if not ownership.no_fork_meanwhile().acquire(timeout=5):
                return False
            ownership.no_fork_meanwhile().release()
            return len(list(ShmDataLoader(DATA, batch_size=4, num_workers=2))) == 10

        assert _in_child(child) == 0
    finally:
        release.set()
        thread.join(30)
    assert gc.isenabled()


# == the parent's garbage (NOTE [ The parent's garbage ] in ownership.py) ===========================


class _Finalized:
    """In a reference cycle; its finalizer reports the pid it ran in through a pipe."""

    def __init__(self, write_fd: int):
        self.write_fd, self.me = write_fd, self

    def __del__(self):
        os.write(self.write_fd, f"{os.getpid()}\n".encode())


class _Collecting(torch.utils.data.Dataset):
    """Each item runs the garbage collector in the worker, as any allocation-heavy item may."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        import gc

        gc.collect()
        return torch.full((4,), float(i))


@pytest.mark.parametrize("sample_parallel", [False, True])
def test_a_forked_worker_never_finalizes_the_parents_garbage(sample_parallel):
    """Cyclic garbage the training loop left behind (on a GPU: CUDA tensors, whose free aborts a
    forked worker) is finalized in the training process only, never in a worker."""
    import gc

    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    try:
        gc.collect()
        gc.disable()  # keep the cycle uncollected until the workers are forked
        try:
            _Finalized(write_fd)  # unreachable at once: garbage in a cycle
            loader = ShmDataLoader(_Collecting(), batch_size=2, num_workers=2,
                                   multiprocessing_context="fork", sample_parallel=sample_parallel)
            it = iter(loader)
        finally:
            gc.enable()
        got = [b.clone() for b in it]
        del it, loader
        assert all(torch.equal(a, b) for a, b in zip(got, DataLoader(_Collecting(), batch_size=2)))
        gc.collect()  # now the training process finalizes it, once
        try:
            pids = os.read(read_fd, 4096).decode().split()
        except BlockingIOError:
            pids = []
        assert pids == [str(os.getpid())], f"finalized in {pids}, the training process is {os.getpid()}"
    finally:
        os.close(read_fd)
        os.close(write_fd)


class _CollectorState(torch.utils.data.Dataset):
    """Item i: whether the worker's garbage collector is on."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        import gc

        return torch.tensor([gc.isenabled()])


def test_forked_workers_collect_their_own_garbage_and_the_users_setting_is_kept():
    """Workers collect (what they make is not frozen with what they inherited); a user who turned
    collection off keeps it off, in the training process and in the workers, as with torch."""
    import gc

    loader = ShmDataLoader(_CollectorState(), batch_size=2, num_workers=2, multiprocessing_context="fork")
    assert [bool(x) for b in loader for x in b] == [True] * 4 and gc.isenabled()
    gc.disable()
    try:
        want = [bool(x) for b in DataLoader(_CollectorState(), batch_size=2, num_workers=2) for x in b]
        assert [bool(x) for b in loader for x in b] == want == [False] * 4
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_loaders_started_from_several_threads_all_start_and_leave_collection_on():
    """Threads starting forked workers at once (a validation loader in a thread of its own):
    collection is on afterwards, as it was (found by a new-user check: it was left off), and
    every worker starts (a fork while another thread closed a worker's pipe killed the new
    worker at start: EBADF closing the inherited, already closed, fd)."""
    import gc
    import threading

    errors = []

    def consume():
        try:
            for _ in range(12):
                for _ in ShmDataLoader(DATA[:8], batch_size=4, num_workers=2, multiprocessing_context="fork"):
                    pass
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    assert gc.isenabled()
    threads = [threading.Thread(target=consume) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and gc.isenabled()
