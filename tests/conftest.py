"""Shared fixtures for shmloader's tests: leak checks that a test's processes, fds, threads and
shared-memory segments are all gone when it ends.

    def test_something(no_leaks): ...                 # one test
    pytestmark = pytest.mark.usefixtures("no_leaks")  # a whole module

`no_leaks` snapshots this process before the test and, after it, collects garbage and polls
(up to LEAK_WAIT_SECONDS) until the snapshot is back, failing with the difference otherwise:

  * child processes (the forkserver and the resource tracker, which multiprocessing keeps for the
    life of the process, are not counted),
  * open file descriptors (the same two helpers' fds are not counted),
  * Python threads,
  * shmloader segments mapped into this process (`/dev/shm/shmloader-* (deleted)` in
    /proc/self/maps: a batch view or a ring nobody closed),
  * `/dev/shm/shmloader-*` entries (a segment whose name was never unlinked; these are checked
    machine-wide, so they are also checked to be absent before the test).

pytest keeps every fixture's value until all fixtures are torn down, so a fixture that hands out
segments, leases or batches must depend on `no_leaks` (to be torn down before it) and drop them in
its own teardown (yield a list and clear it).

The helpers (`open_fds`, `child_pids`, `mapped_segments`, `shm_entries`, `wait_until`,
`process_snapshot`) are importable for tests that watch other processes (`from tests.conftest
import ...`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from dataclasses import dataclass

import psutil
import pytest

SHM_PREFIX = "shmloader-"
LEAK_WAIT_SECONDS = 10.0


def pytest_configure(config):
    """Forkserver children fork from a server that has imported torch, shmloader's worker and the
    test faults already (what a user would do for speed; without it each forkserver case pays
    torch's import).  Set for the whole session, before any test starts the server: set in one
    module only, it held or not depending on which test ran first."""
    import multiprocessing

    multiprocessing.get_context("forkserver").set_forkserver_preload(["shmloader.worker", "tests._faulty"])


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    """Poll `predicate` until it is true or `timeout` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return bool(predicate())
        time.sleep(interval)


def _infrastructure() -> tuple[set[int], set[int]]:
    """(pids, fds) of multiprocessing's long-lived helpers started by this process."""
    pids: set[int] = set()
    fds: set[int] = set()
    try:
        from multiprocessing import forkserver

        server = forkserver._forkserver
        if server._forkserver_pid is not None:
            pids.add(server._forkserver_pid)
        if server._forkserver_alive_fd is not None:
            fds.add(server._forkserver_alive_fd)
    except (ImportError, AttributeError):
        pass
    try:
        from multiprocessing import resource_tracker

        tracker = resource_tracker._resource_tracker
        if tracker._pid is not None:
            pids.add(tracker._pid)
        if tracker._fd is not None:
            fds.add(tracker._fd)
    except (ImportError, AttributeError):
        pass
    return pids, fds


def open_fds(pid: int | str = "self") -> dict[int, str]:
    """fd -> what it points to, for a process (default: this one)."""
    base = f"/proc/{pid}/fd"
    result = {}
    for name in os.listdir(base):
        try:
            result[int(name)] = os.readlink(f"{base}/{name}")
        except OSError:
            pass  # closed while listing (the listing's own fd, for one)
    return result


def child_pids() -> set[int]:
    """Live (not zombie) descendants of this process."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def pid_gone(pid: int) -> bool:
    """True if `pid` has exited (a zombie waiting for its parent counts as exited)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def mapped_segments(pid: int | str = "self") -> set[str]:
    """Names of shmloader segments mapped into a process."""
    names = set()
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                at = line.find("/dev/shm/" + SHM_PREFIX)
                if at < 0:  # an overflow slot (NOTE [ Overflow slots ] in ring.py): its inode
                    at = line.find("/memfd:shmloader-overflow")
                    if at >= 0:
                        names.add("memfd inode " + line.split()[4])
                        continue
                if at >= 0:
                    names.add(line[at:].split()[0])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return names


def segments_held_anywhere(names: set[str]) -> dict[int, set[str]]:
    """pid -> those of `names` that the process still maps or holds an fd on (any process)."""
    held: dict[int, set[str]] = {}
    for proc in psutil.process_iter():
        found = set(mapped_segments(proc.pid)) & names
        try:
            for target in open_fds(proc.pid).values():
                if target.split(" ")[0] in names:
                    found.add(target.split(" ")[0])
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
        if found:
            held[proc.pid] = found
    return held


def shm_entries() -> set[str]:
    """shmloader's entries in /dev/shm (there should never be any: names are unlinked at once)."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX)}
    except FileNotFoundError:
        return set()


@dataclass
class Snapshot:
    children: set[int]
    fds: dict[int, str]
    threads: set[int]
    mapped: set[str]
    shm: set[str]


def process_snapshot() -> Snapshot:
    pids, fds = _infrastructure()
    return Snapshot(
        children=child_pids() - pids,
        fds={fd: t for fd, t in open_fds().items() if fd not in fds},
        threads={t.ident for t in threading.enumerate()},
        mapped=mapped_segments(),
        shm=shm_entries(),
    )


def leaks_since(before: Snapshot) -> list[str]:
    """What the process holds now that it did not hold in `before` (empty: nothing leaked)."""
    now = process_snapshot()
    problems = []
    if now.children - before.children:
        problems.append(f"child processes still alive: {sorted(now.children - before.children)}")
    new_fds = {fd: t for fd, t in now.fds.items() if before.fds.get(fd) != t}
    if new_fds:
        problems.append(f"file descriptors still open: {new_fds}")
    if now.threads - before.threads:
        names = [t.name for t in threading.enumerate() if t.ident in now.threads - before.threads]
        problems.append(f"threads still running: {names}")
    if now.mapped - before.mapped:
        problems.append(f"shared-memory segments still mapped: {sorted(now.mapped - before.mapped)}")
    if now.shm - before.shm:
        problems.append(f"/dev/shm entries left behind: {sorted(now.shm - before.shm)}")
    return problems


def _reap_torch_workers() -> None:
    """torch 2.6's DataLoader terminates a worker that did not join within 5 s and never joins
    it (torch 2.13 does): it stays in multiprocessing's children, its pipes open.  Only torch's
    own workers are reaped here, so a shmloader worker left unjoined still fails the test."""
    import multiprocessing.process

    for proc in list(multiprocessing.process._children):  # shmloader's are "shmloader-worker-N"
        if not proc.name.startswith("shmloader-") and proc.exitcode is not None:
            proc.join()


def assert_no_leaks(before: Snapshot, timeout: float = LEAK_WAIT_SECONDS) -> None:
    """Collect garbage and wait (bounded) until nothing beyond `before` is held."""

    def clean() -> bool:
        gc.collect()
        _reap_torch_workers()
        return not leaks_since(before)

    if not wait_until(clean, timeout, interval=0.1):
        for name in process_snapshot().shm - before.shm:  # this test fails; the next ones start clean
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", name))
        pytest.fail("leaked after the test:\n  " + "\n  ".join(leaks_since(before)), pytrace=False)


@pytest.fixture
def no_leaks():
    """Fail the test if it leaves processes, fds, threads or shared memory behind."""
    gc.collect()
    before = process_snapshot()
    assert not before.shm, f"/dev/shm holds shmloader entries before the test: {sorted(before.shm)}"
    yield before
    assert_no_leaks(before)
