"""A Ctrl-C that lands inside the loader's own code leaves nothing behind (NOTE [ Ctrl-C held ] in
shmloader/interrupts.py).

Each test sends this process a real SIGINT from inside one step of the loader (the step's
function is wrapped so that it first signals, then runs), as a Ctrl-C or Jupyter's "interrupt
kernel" would at that moment.  The user must get the KeyboardInterrupt, and once the loader is
dropped no process, fd, thread, mapping or /dev/shm entry of it may remain (the no_leaks
fixture).  Without the hold, each of these left pipes, a thread or a segment's fd open."""

from __future__ import annotations

import os
import signal
import time

import pytest

from shmloader import ShmDataLoader
from shmloader.crashlog import CrashLog
from shmloader.interrupts import ctrl_c_held
from shmloader.ring import Ring
from shmloader.spares import SpareMaker

from . import _datasets as ds

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leaks")]


@pytest.fixture(autouse=True)
def pythons_sigint_handler():
    """Python's own handler, whatever ran before (a background job starts with SIGINT ignored)."""
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, handler)


def _interrupt_first_call(monkeypatch, owner, name: str) -> list:
    """Wrap `owner.name` so that its first call in this process (not in a forked worker) signals
    SIGINT to this process, then runs."""
    real = getattr(owner, name)
    calls: list = []
    pid = os.getpid()

    def interrupted(*args, **kwargs):
        if os.getpid() == pid:
            calls.append(name)
            if len(calls) == 1:
                os.kill(pid, signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)
    return calls


def _loader(**kwargs) -> ShmDataLoader:
    kwargs.setdefault("batch_size", 4)
    kwargs.setdefault("num_workers", 2)
    return ShmDataLoader(ds.ArrayDataset(n=48, nbytes=64 * 1024), **kwargs)


def _epoch_interrupted(loader) -> None:
    with pytest.raises(KeyboardInterrupt):
        for _ in loader:
            pass


@pytest.mark.parametrize("step", ["CrashLog.close", "SpareMaker._close_pipe"])
def test_a_ctrl_c_while_the_workers_stop(step, monkeypatch):
    """At an epoch's end: a Ctrl-C in the middle of the shutdown used to leave it half done,
    flagged done and never retried (the other workers' pipes, the spare-segment thread's pipe
    and the segments it had made stayed open)."""
    cls, name = step.split(".")
    calls = _interrupt_first_call(monkeypatch, {"CrashLog": CrashLog, "SpareMaker": SpareMaker}[cls], name)
    _epoch_interrupted(_loader())
    assert calls, f"{step} was never called: the test no longer reaches the step it interrupts"


@pytest.mark.parametrize("mode", ["default", "sample_parallel"])
def test_a_ctrl_c_while_a_new_segment_is_adopted(mode, monkeypatch):
    """A worker's first batch in a slot comes with the fd of the segment it made (in
    sample_parallel mode the main process makes it); a Ctrl-C before the ring adopted it leaked
    the fd and the segment's pages."""
    calls = _interrupt_first_call(monkeypatch, Ring, "adopt")
    _epoch_interrupted(_loader(sample_parallel=mode == "sample_parallel"))
    assert calls


def test_a_ctrl_c_while_the_workers_start(monkeypatch):
    """iter(loader): a Ctrl-C after the last worker started, while the pool made its poll sets,
    left the workers running with nothing to stop them but garbage collection."""
    from shmloader.channel import Channel

    calls = _interrupt_first_call(monkeypatch, Channel, "fileno")
    loader = _loader()
    with pytest.raises(KeyboardInterrupt):
        iter(loader)
    assert calls


def test_a_ctrl_c_in_a_spare_makers_start(monkeypatch):
    """The spare-segment thread started but not yet recorded: close() could not join it, and
    raised RuntimeError ("cannot join thread before it is started") in place of the Ctrl-C."""
    import threading

    maker = SpareMaker(lambda capacity: (_ for _ in ()).throw(OSError("no segments in this test")))
    _interrupt_first_call(monkeypatch, threading.Thread, "start")
    with pytest.raises(KeyboardInterrupt):
        maker.want(1, 1 << 20)
    monkeypatch.undo()
    maker.close()


def test_held_ctrl_c_comes_once_the_block_is_done_and_nested_blocks_hand_it_out():
    order = []
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_held():
            with ctrl_c_held():
                os.kill(os.getpid(), signal.SIGINT)
                order.append("inner done")
            order.append("outer done")
    assert order == ["inner done", "outer done"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_half_made_crash_log_closes_its_pipe_when_dropped():
    before = set(os.listdir("/proc/self/fd"))
    log = CrashLog()
    assert log.read_fd >= 0
    del log
    assert set(os.listdir("/proc/self/fd")) <= before


def test_spare_makers_count_takes_no_lock():
    """pending() runs at every grant round; a KeyboardInterrupt between a `with` lock's acquire
    and its block can leave the lock held, and the spare thread never woken (seen once in 150
    real Ctrl-Cs): it reads the counts without the lock."""
    import threading

    maker = SpareMaker(lambda capacity: (_ for _ in ()).throw(OSError("no segments in this test")))
    holding, release = threading.Event(), threading.Event()

    def hold_the_lock():
        with maker._cond:
            holding.set()
            release.wait(10)

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    holding.wait(10)
    answered = []
    reader = threading.Thread(target=lambda: answered.append(maker.pending()), daemon=True)
    reader.start()
    reader.join(2)
    answered_while_held = list(answered)
    release.set()
    holder.join()
    reader.join(10)
    maker.close()
    assert answered_while_held == [0], "pending() waited for the spare maker's lock"


@pytest.mark.parametrize("mode", ["default", "sample_parallel"])
def test_a_ctrl_c_while_a_dropped_iterator_stops_its_workers_is_raised_after_its_del(mode, monkeypatch):
    """An iterator dropped mid-epoch stops its workers in its __del__, where Python prints and
    drops any exception: a Ctrl-C held through that shutdown was lost there, and a loop that
    makes a loader, takes a batch and moves on ran on after Ctrl-C until it was killed. Now the
    KeyboardInterrupt comes in the code the finalizer returned to."""
    calls = _interrupt_first_call(monkeypatch, CrashLog, "close")
    it = iter(_loader(sample_parallel=mode == "sample_parallel"))
    next(it)
    start = time.monotonic()
    try:
        del it  # its __del__ stops the workers; the Ctrl-C comes in the middle
        time.sleep(5)  # the held Ctrl-C is raised here, in the code the finalizer returned to
    except KeyboardInterrupt:
        pass
    else:
        pytest.fail("the Ctrl-C that came during the dropped iterator's shutdown was lost")
    assert calls, "CrashLog.close was never called: the test no longer reaches the shutdown"
    assert time.monotonic() - start < 4, "the Ctrl-C came only after the sleep"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_held_in_a_del_is_raised_once_no_del_is_on_the_stack():
    class Dropped:
        def __del__(self):
            with ctrl_c_held():
                os.kill(os.getpid(), signal.SIGINT)
            self.after_the_block()  # still inside the finalizer: not here

        def after_the_block(self):
            for _ in range(100):
                pass

    dropped = Dropped()
    with pytest.raises(KeyboardInterrupt):
        del dropped
        time.sleep(5)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
