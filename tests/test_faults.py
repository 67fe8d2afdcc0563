"""Fault table: (raise, os._exit, segfault, SIGKILL from outside, hang) × (dataset unpickling,
worker_init_fn, __getitem__, __iter__, collate_fn, writing into the slot) × (fork, forkserver,
spawn).  Each case must end in a clear exception in the main process within a few seconds that
names the worker, its pid, the stage (for exceptions) and the exit status or signal with its
likely cause, carry the worker's traceback where there is one, and leave nothing behind
(processes, fds, threads, mapped segments, /dev/shm entries: the `no_leaks` fixture).

The faults themselves live in tests/_faulty.py so spawn and forkserver workers can import them.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from shmloader import LoaderTimeoutError, ShmDataLoader, WorkerDiedError
from shmloader.errors import RemoteTraceback
from tests import _faulty
from tests.conftest import pid_gone, wait_until

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.usefixtures("no_leaks")

START_METHODS = ["fork", "forkserver", pytest.param("spawn", marks=pytest.mark.slow)]
REPORT_WITHIN = 6.0  # seconds from the fault to the exception in the main process
HANG_TIMEOUT = 2

# What the main process must say for an exception raised at each stage (worker.py's stages).
STAGE_WORDS = {
    "unpickle": "unpickling the dataset",
    "worker_init": "worker_init_fn",
    "getitem": "fetching samples",
    "iter": "starting the dataset",
    "collate": "collating the batch",
    "write": "writing the batch into its slot",
}
DEATH_WORDS = {
    "exit": f"exited with status {_faulty.EXIT_STATUS}",
    "segfault": "killed by SIGSEGV (a segmentation fault",
    "sigkill": "killed by SIGKILL (likely the out-of-memory killer",
}


def _markers(marker_dir: str, how: str) -> list[tuple[int, float]]:
    """(pid, time) of the faults injected so far."""
    found = []
    for name in os.listdir(marker_dir):
        if name.startswith(how + "-") and not name.endswith(".tmp"):
            with open(os.path.join(marker_dir, name)) as f:
                found.append((int(name.rsplit("-", 1)[1]), float(f.read().split()[0])))
    return found


class _Killer(threading.Thread):
    """SIGKILLs, from outside, each worker that reaches its "sigkill" fault."""

    def __init__(self, marker_dir: str):
        super().__init__(daemon=True, name="test-killer")
        self.marker_dir, self.stop, self.killed = marker_dir, threading.Event(), set()

    def run(self):
        while not self.stop.is_set():
            for pid, _ in _markers(self.marker_dir, "sigkill"):
                if pid not in self.killed:
                    os.kill(pid, signal.SIGKILL)
                    self.killed.add(pid)
            time.sleep(0.02)


def _run(loader, marker_dir: str, how: str) -> dict:
    """Iterate `loader` until it raises; what it raised, when, and the workers' pids.  Holds no
    reference to the exception or the iterator afterwards, so the leak check sees them freed."""
    killer = _Killer(marker_dir) if how == "sigkill" else None
    if killer:
        killer.start()
    result: dict = {"batches": 0}
    try:
        iterator = iter(loader)
        result["pids"] = [p.pid for p in iterator._workers]
        try:
            for _ in iterator:
                result["batches"] += 1
        except Exception as exc:  # recorded, then asserted on
            result["raised_at"] = time.time()
            result["type"] = type(exc)
            result["message"] = str(exc)
            cause = exc.__cause__
            result["cause"] = cause.text if isinstance(cause, RemoteTraceback) else None
            result["shut_down_at_once"] = iterator._shutdown
            del exc
        else:
            result["type"] = None
        del iterator
        gc.collect()
    finally:
        if killer:
            killer.stop.set()
            killer.join()
    markers = _markers(marker_dir, how)
    assert markers, f"the {how} fault was never injected"
    result["fault_pid"], result["fault_at"] = markers[0]
    return result


def _check_gone(pids):
    assert wait_until(lambda: all(pid_gone(p) for p in pids), 5.0), "workers still alive after the error"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", START_METHODS)
@pytest.mark.parametrize("where", _faulty.WHERES)
@pytest.mark.parametrize("how", ["raise", "exit", "segfault", "sigkill"])
def test_fault_is_reported(how, where, start_method, tmp_path):
    if where == "unpickle" and start_method == "fork":
        pytest.skip("fork workers inherit the dataset: nothing is unpickled")
    loader = _faulty.make_loader(how, where, str(tmp_path), start_method)
    r = _run(loader, str(tmp_path), how)
    message = r["message"]
    assert r["type"] is not None, "the loader finished the epoch despite the fault"
    assert r["raised_at"] - r["fault_at"] < REPORT_WITHIN, f"reported {r['raised_at'] - r['fault_at']:.1f} s after the fault"
    assert r["fault_pid"] == r["pids"][_faulty.TARGET_WORKER]
    assert f"worker {_faulty.TARGET_WORKER} (pid {r['fault_pid']})" in message, message
    if how == "raise":
        # The original type, the stage, the batch and the worker's own traceback.
        assert r["type"] is _faulty.InjectedFault, (r["type"], message)
        assert STAGE_WORDS[where] in message, message
        assert f"injected fault in {where}" in message
        assert r["cause"] is not None and "in inject" in r["cause"] and "InjectedFault" in r["cause"]
    else:
        assert r["type"] is WorkerDiedError, (r["type"], message)
        assert DEATH_WORDS[how] in message, message
        assert "shut down" in message
        if how == "segfault":  # the worker's faulthandler report, brought into the error
            assert "Fatal Python error: Segmentation fault" in message and "in inject" in message, message
        assert r["shut_down_at_once"], "the loader must shut down as soon as a worker dies"
    _check_gone(r["pids"])


# A spawned worker imports torch before it can do anything (seconds on a loaded 2-core machine),
# and `timeout` counts that too, as torch's does: spawn gets a longer timeout and fewer stages.
HANG_CASES = [("fork", w) for w in _faulty.WHERES if w != "unpickle"] + [
    ("forkserver", w) for w in _faulty.WHERES] + [
    pytest.param("spawn", "unpickle", marks=pytest.mark.slow)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method, where", HANG_CASES)
def test_hang_with_timeout_raises(where, start_method, tmp_path):
    timeout = 10 if start_method == "spawn" else HANG_TIMEOUT
    loader = _faulty.make_loader("hang", where, str(tmp_path), start_method, timeout=timeout)
    started = time.time()
    r = _run(loader, str(tmp_path), "hang")
    assert r["type"] is LoaderTimeoutError, (r["type"], r["message"])
    assert issubclass(r["type"], RuntimeError)  # what torch raises, for existing except clauses
    assert f"timed out after {timeout} seconds" in r["message"]
    assert f"worker {_faulty.TARGET_WORKER}" in r["message"]
    assert r["raised_at"] - started >= timeout
    assert r["raised_at"] - r["fault_at"] < timeout + REPORT_WITHIN
    assert not r["shut_down_at_once"], "torch's iterator survives a timeout: so must ours"
    _check_gone(r["pids"])  # once the iterator is dropped


class SlowOnce(Dataset):
    """Index `slow` takes `seconds` (a storage hiccup); the other 15 are instant."""

    def __init__(self, slow: int = 8, seconds: float = 2.0):
        self.slow, self.seconds = slow, seconds

    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == self.slow:
            time.sleep(self.seconds)
        return torch.full((3,), i)


def _next_or_timeout(iterator):
    try:
        return next(iterator)[0, 0].item()
    except StopIteration:
        return "end"
    except RuntimeError as exc:  # torch's RuntimeError; LoaderTimeoutError is one
        assert "timed out after 1 seconds" in str(exc), exc
        return "timeout"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs", [{}, {"persistent_workers": True}, {"sample_parallel": True}],
                         ids=["default", "persistent", "sample_parallel"])
def test_after_a_timeout_the_loop_can_go_on_as_with_torch(kwargs):
    def run(cls, **extra):
        """Each next()'s batch or 'timeout', until the end (how many timeouts a 2-second sample
        gives against timeout=1 depends on the moment the wait began: 1 or 2, for both)."""
        iterator = iter(cls(SlowOnce(), batch_size=4, num_workers=2, timeout=1, **extra))
        got = []
        while "end" not in got and len(got) < 12:
            got.append(_next_or_timeout(iterator))
        return got

    want = run(DataLoader, persistent_workers=kwargs.get("persistent_workers", False))
    assert "timeout" in want and want[-1] == "end", want
    got = run(ShmDataLoader, **kwargs)
    assert "timeout" in got and [x for x in got if x != "timeout"] == [x for x in want if x != "timeout"], (got, want)


@pytest.mark.timeout(60)
def test_a_timeout_while_persistent_workers_start_an_epoch_says_what_happened():
    """The loop leaves an epoch while a worker is in a slow sample; the next iter() times out
    waiting for that worker to start the new epoch.  That iterator is shut down (the error says
    so, and which epoch, not 'next() waits for it again' about a batch of no worker), and a later
    iter(loader) delivers the epoch (found by a new-user check)."""
    loader = ShmDataLoader(SlowOnce(slow=12, seconds=3), batch_size=4, num_workers=2, timeout=1, persistent_workers=True)
    it = iter(loader)
    next(it)
    del it  # worker 1 is in index 12's three seconds
    with pytest.raises(LoaderTimeoutError) as info:
        iter(loader)
    message = str(info.value)
    assert "waiting for the persistent workers to start epoch 1 (1 of 2 ready" in message, message
    assert "this iterator is shut down" in message and "next() waits" not in message and "None" not in message
    it = iter(loader)  # (index 12 is slow again: a timeout or more, then every batch)
    got = []
    while "end" not in got and len(got) < 12:
        got.append(_next_or_timeout(it))
    assert [x for x in got if x != "timeout"] == [0, 4, 8, 12, "end"], got
    del it, loader


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["getitem", "write"])
def test_ctrl_c_while_waiting_on_a_hung_worker(where, tmp_path, request):
    """No timeout: the loop waits on a hung worker, and Ctrl-C still reaches it at once.  As
    torch's, the iterator survives the KeyboardInterrupt (NOTE [ Ctrl-C in the wait ]); dropping
    it shuts the workers down and closes the ring."""
    # Python turns SIGINT into KeyboardInterrupt only if SIGINT was not ignored when it started
    # (a shell's background job starts with it ignored): the handler a terminal's Python has.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    loader = _faulty.make_loader("hang", where, str(tmp_path), "fork")
    iterator = iter(loader)
    pids = [p.pid for p in iterator._workers]

    def interrupt():
        wait_until(lambda: _markers(str(tmp_path), "hang"), 20.0)
        time.sleep(0.3)  # the main thread is now blocked waiting for batch 1
        os.kill(os.getpid(), signal.SIGINT)

    sender = threading.Thread(target=interrupt, daemon=True)
    sender.start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        while True:
            next(iterator)
    assert time.monotonic() - started < 10
    sender.join()
    assert not iterator._shutdown  # the loop may call next() again
    ring = iterator._ring
    del iterator
    assert ring.closed
    _check_gone(pids)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
@pytest.mark.parametrize("cls", ["torch", "shmloader"])
def test_ctrl_c_in_a_terminal_leaves_no_program_the_dataset_started(cls, start_method, tmp_path):
    """Ctrl-C reaches the whole process group: the workers stop as torch's do, inside the
    dataset's code, so the programs it started (here `sleep 60`) end with them, and nothing is
    left running under init (an ignored SIGINT would be inherited by those programs)."""
    script = os.path.join(os.path.dirname(__file__), "_ctrl_c_script.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, script, cls, str(tmp_path), start_method], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    started = []
    try:
        assert wait_until(lambda: len(os.listdir(tmp_path)) >= 2, 30.0), "the workers ran no program"
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        _out, err = proc.communicate(timeout=30)
        assert proc.returncode != 0 and "KeyboardInterrupt" in err, err[-3000:]
        time.sleep(1.0)  # a worker that went on would have started the next sample's program by now
        started = [int(name) for name in os.listdir(tmp_path)]
        wait_until(lambda: all(pid_gone(pid) for pid in started), 10.0)
        left = [pid for pid in started if not pid_gone(pid)]
        assert not left, f"programs the dataset started still run after Ctrl-C: {left} of {started}"
        assert err.count("Traceback") == 1, err[-3000:]  # the training process's, not the workers'
    finally:
        for pid in [int(name) for name in os.listdir(tmp_path)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["getitem", "collate", "write"])
def test_death_names_the_stage(where, tmp_path):
    loader = _faulty.make_loader("exit", where, str(tmp_path), "fork")
    r = _run(loader, str(tmp_path), "exit")
    assert r["type"] is WorkerDiedError
    assert STAGE_WORDS[where] in r["message"], r["message"]


class _Paced(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        time.sleep(0.05)
        return torch.full((64,), float(i))


def _interrupt_the_wait(main_tid: int, stop: threading.Event) -> None:
    """SIGINT this process once the main thread blocks in poll (next() waiting for a batch),
    unless `stop` is set first."""
    def in_poll():
        """Blocked in a poll with a timeout (not a poll(0) that returns at once)."""
        try:
            with open(f"/proc/self/task/{main_tid}/syscall") as f:
                fields = f.read().split()
        except OSError:
            return True  # no way to tell: the samples are slow enough for the wait to dominate
        # x86-64: 7 is poll (its third argument the timeout in ms), 271 ppoll
        return fields[0] == "271" or (fields[0] == "7" and int(fields[3], 16) != 0)
    while not stop.is_set():
        if in_poll():
            time.sleep(0.002)
            if in_poll():  # still blocked: not on its way out with a message
                os.kill(os.getpid(), signal.SIGINT)
                return
        time.sleep(0.001)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kwargs", [{}, {"persistent_workers": True}, {"sample_parallel": True}],
                         ids=["default", "persistent", "sample_parallel"])
def test_after_a_ctrl_c_in_next_the_loop_can_go_on_as_with_torch(kwargs, request):
    """A Ctrl-C while next() waits (Jupyter's "interrupt kernel", then the cell run again): torch's
    iterator goes on with the next batch, and every later one, in order; so does this one (NOTE
    [ Ctrl-C in the wait ] in loader.py).  It raised LoaderBrokenError."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))

    def run(cls, **extra):
        """(the batches' first values, the Ctrl-Cs caught, whether each landed in the wait: the
        loader marks those it resumes from, NOTE [ Ctrl-C in the wait ])."""
        iterator = iter(cls(_Paced(), batch_size=4, num_workers=2, **extra))
        got = [int(next(iterator)[0, 0])]
        interrupts = 0
        while interrupts < 3:  # three Ctrl-Cs, each sent while next() waits for a batch
            stop = threading.Event()
            sender = threading.Thread(target=_interrupt_the_wait, args=(threading.main_thread().native_id, stop))
            sender.start()
            try:
                while True:
                    got.append(int(next(iterator)[0, 0]))
            except KeyboardInterrupt as exc:
                interrupts += 1
                in_the_wait = getattr(exc, "_shmloader_resumable", cls is DataLoader)
            except StopIteration:
                break
            finally:
                stop.set()
                sender.join()
            if not in_the_wait:
                return got, interrupts, False  # a batch came just as the signal was sent: see below
        got.extend(int(batch[0, 0]) for batch in iterator)
        return got, interrupts, interrupts > 0  # (none sent: the epoch ended first, see below)

    want, _, _ = run(DataLoader, **{k: v for k, v in kwargs.items() if k != "sample_parallel"})
    assert want == list(range(0, 40, 4))
    # A real signal: the poll it was aimed at may return with a batch in the microseconds before
    # it lands, and then it lands in the loader's own code, which shuts the iterator down (as
    # documented).  Such a run proves nothing either way, so it is run again, as is one whose
    # epoch ended before the sender caught next() blocked (a loaded machine: seen once in a full run);
    # a loader that resumes from no Ctrl-C at all never gets past this loop.
    for _attempt in range(4):
        got, interrupts, in_the_wait = run(ShmDataLoader, **kwargs)
        if in_the_wait:
            break
    assert in_the_wait, "in 4 runs, a Ctrl-C never landed in the wait for a batch"
    assert interrupts >= 1 and got == want, (got, interrupts)


class _PacedStream(torch.utils.data.IterableDataset):
    """Sharded by worker, without state: a resume fast-forwards it, one wait per batch."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for i in range(info.id, 40, info.num_workers):
            time.sleep(0.03)
            yield torch.full((8,), float(i))


@pytest.mark.timeout(90)
@pytest.mark.filterwarnings("ignore:Neither the dataset nor iter:UserWarning")
def test_a_ctrl_c_during_a_resumes_fast_forward_leaves_the_rest_of_it_to_the_next_next(request):
    """A resumed state of a dataset without state is replayed at the first next(); a Ctrl-C in
    the middle of it, caught, and next() again: the replay goes on where it was, and the batches
    are those the saved run went on with (it lost the replay's count)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))

    def make():
        return ShmDataLoader(_PacedStream(), batch_size=2, num_workers=2)

    saved = make()
    saved_run = iter(saved)
    for _ in range(6):
        next(saved_run)
    state = saved.state_dict()
    want = [int(batch[0, 0]) for batch in saved_run]
    del saved_run, saved
    for _attempt in range(4):  # again if the signal landed outside the wait (see the test above)
        loader = make()
        loader.load_state_dict(state)
        it = iter(loader)
        stop = threading.Event()
        sender = threading.Thread(target=_interrupt_the_wait, args=(threading.main_thread().native_id, stop))
        sender.start()
        try:
            with pytest.raises(KeyboardInterrupt) as caught:
                next(it)  # the replay of 6 batches waits for each
        finally:
            stop.set()
            sender.join()
        if getattr(caught.value, "_shmloader_resumable", False):
            break
    assert getattr(caught.value, "_shmloader_resumable", False), "in 4 runs, no Ctrl-C landed in the wait"
    got = [int(batch[0, 0]) for batch in it]
    assert len(want) == 14 and got == want


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs", [{}, {"sample_parallel": True}], ids=["default", "sample_parallel"])
def test_a_worker_that_dies_while_a_process_it_forked_lives_is_reported(kwargs, tmp_path):
    """The helper holds the dead worker's socket and sentinel open, so neither closes: the wait
    reads the workers' exit status every POLL_SECONDS (NOTE [ A sentinel closed by a live
    worker ] in pool.py).  torch reports it within a second; shmloader waited for the helper."""
    from . import _datasets as ds

    pid_file = tmp_path / "helper.pid"
    loader = ShmDataLoader(ds.DiesLeavingAHelper(str(pid_file)), batch_size=4, num_workers=2, **kwargs)
    start = time.monotonic()
    try:
        with pytest.raises(WorkerDiedError, match="exited with status 3"):
            for _ in loader:
                pass
        assert time.monotonic() - start < REPORT_WITHIN
    finally:
        if wait_until(pid_file.exists, timeout=5):
            helper = int(pid_file.read_text())
            try:
                os.kill(helper, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs", [{}, {"sample_parallel": True}], ids=["default", "sample_parallel"])
def test_a_worker_that_closes_its_fds_and_lives_on_is_reported_not_waited_for(kwargs):
    """Its socket and sentinel close while it runs: multiprocessing's join() then blocks in
    waitpid until the worker ends (30 s here); the loader reports the death within seconds and
    stops the worker (NOTE [ A sentinel closed by a live worker ] in pool.py)."""
    from . import _datasets as ds

    loader = ShmDataLoader(ds.ClosesItsFds(), batch_size=4, num_workers=2, **kwargs)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="closed its connection to the main process"):
        for _ in loader:
            pass
    assert time.monotonic() - start < REPORT_WITHIN
