"""The worker processes of one iterator: start them, talk to them, notice their deaths, stop them.

A WorkerPool owns, per worker, its process, its control channel (channel.py), its crash log
(crashlog.py) and its block of the status board (NOTE [ Status board ] in protocol.py).  It
knows nothing of batches, slots or epochs: the iterator (loader.py) decides what to send and
what a message means; the pool only carries messages and turns a vanished worker into a
WorkerDiedError that says which worker, its exit, what it was doing and its last traceback.

NOTE [ Shutdown ]
  At the end of an epoch (unless persistent), on `del`, on an error or on Ctrl-C: send Stop to
  every worker, give them a moment, terminate the rest (safe: slot segments have no names to
  leak and the kernel closes their fds), join, close the sockets and the process sentinels, then
  the iterator closes the ring.  Slots whose batches the user still holds stay mapped until those
  views are freed.  A shutdown caused by an error leaves the iterator *broken*: the error is
  raised, then the next next() raises LoaderBrokenError naming it, so that a loop that did not
  see it learns why the epoch stopped, and every later next() raises StopIteration, as a
  generator does after raising: a loop that catches errors and calls next() again (log and
  skip) ends instead of spinning on LoaderBrokenError.  torch's iterator goes on after a worker
  death with the other workers' batches (the dead worker's are lost); this one ends the epoch
  there, and iter(loader) starts the next with fresh workers.  A worker's own exception inside
  a task is not an error of the loader: it is raised at its batch's turn and the epoch goes on,
  as in torch.
"""

from __future__ import annotations

import math
import os
import pickle
import select
import signal
import time
import warnings
import weakref

from . import diagnosis
from .channel import Channel, ChannelClosed
from .crashlog import CrashLog
from .errors import WorkerDiedError
from .interrupts import ctrl_c_held
from .ownership import forking, register_worker
from .protocol import (
    BOOTING,
    PROTOCOL_VERSION,
    Hello,
    Stop,
    describe_stage,
    status_board_bytes,
    status_offset,
)
from .segment import create_segment
from .timing import init_block, read_block
from .worker import worker_main

STOP_GRACE_SECONDS = 0.5  # how long stopped workers get before they are terminated
KILLED_JOIN_SECONDS = 10.0  # a SIGKILLed worker is gone in far less (one in D state: left to the OS)


def _warn_unpicklable(context) -> None:
    """torch's hint when a worker cannot start because its arguments do not pickle."""
    method = context.get_start_method()
    warnings.warn(
        f"Got pickle error when attempting to start a worker Process under the {method!r} start "
        "method, which pickles the worker's arguments (the dataset, collate_fn, worker_init_fn): "
        "define them at module level rather than as lambdas or local "
        "functions, drop unpicklable members (locks, open files), or use "
        "multiprocessing_context='fork' where the platform allows it.",
        UserWarning, stacklevel=4)


def hello(status_bytes: int) -> Hello:
    """The first message to each worker (the protocol version it must speak)."""
    return Hello(PROTOCOL_VERSION, status_bytes)


class Poller:
    """A poll(2) set built once; `ready(timeout)` lists the fds readable (or hung up)."""

    def __init__(self, fds: list[int]):
        self._poll = select.poll()
        for fd in fds:
            self._poll.register(fd, select.POLLIN)

    def ready(self, timeout: float) -> list[int]:
        return [fd for fd, _ in self._poll.poll(max(0, math.ceil(timeout * 1000)))]


class _Coalesced:
    """WorkerPool.coalesced()."""

    __slots__ = ("pool",)

    def __init__(self, pool: WorkerPool):
        self.pool = pool

    def __enter__(self) -> None:
        for channel in self.pool.channels:
            channel.hold()

    def __exit__(self, *exc_info) -> None:
        for worker_id, channel in enumerate(self.pool.channels):
            try:
                channel.flush()
            except (BrokenPipeError, ConnectionResetError):
                self.pool._report_death(worker_id)


class WorkerPool:
    """`num_workers` started worker processes; `make_spec(worker_id)` gives each its WorkerSpec.

    `on_death(worker_id)` is called (and must raise) when a send finds a worker gone; the
    iterator passes its own method, which reads the worker's last words and breaks the epoch.
    It is held weakly: the pool must not keep its iterator (and the iterator's ring) alive."""

    def __init__(self, num_workers: int, context, make_spec, timed: bool, on_death):
        self.num_workers = num_workers
        self.processes: list = []
        self.channels: list[Channel] = []
        self.crash_logs: list[CrashLog] = []
        self.board = None
        self.closed = False
        self.final_worker_times: list | None = None
        self._timed = timed
        self._on_death = weakref.WeakMethod(on_death)
        try:
            with ctrl_c_held():  # NOTE [ Ctrl-C held ] in interrupts.py: raised inside this try
                self.board = create_segment(status_board_bytes(num_workers), 0, "the workers' status board")
                for worker_id in range(num_workers):  # what a worker dead before its first word did
                    init_block(self.board, status_offset(worker_id), BOOTING, timed)
                for worker_id in range(num_workers):
                    self._start(worker_id, context, make_spec(worker_id))
                # What every wait polls, built once (the workers are fixed for this pool).
                self.channel_of = {c.fileno(): (worker_id, c) for worker_id, c in enumerate(self.channels)}
                self.sentinel_of = {p.sentinel: worker_id for worker_id, p in enumerate(self.processes)}
        except BaseException:
            self.stop()
            raise

    def _start(self, worker_id: int, context, spec) -> None:
        with forking():  # its fds made and the child's end closed with no fork from elsewhere
            channel, child_sock = Channel.pair()
            self.channels.append(channel)
            crash_log = CrashLog()
            self.crash_logs.append(crash_log)
            channel.send(hello(self.board.size), (self.board.fd, crash_log.write_fd))
            crash_log.close_write_end()
            process = context.Process(target=worker_main, args=(spec, child_sock),
                                      name=f"shmloader-worker-{worker_id}", daemon=True)
            try:
                process.start()
            except (TypeError, AttributeError, pickle.PicklingError):
                _warn_unpicklable(context)
                raise
            finally:
                child_sock.close()
        self.processes.append(process)
        register_worker(process)  # NOTE [ A fork of the user's ] in ownership.py

    # -- messages ----------------------------------------------------------------------------------

    def send(self, worker_id: int, message, fds: tuple[int, ...] = ()) -> None:
        """Send to a worker; a socket whose other end is gone means the worker is gone, and it is
        reported as such (`on_death`), never as a BrokenPipeError."""
        try:
            self.channels[worker_id].send(message, fds)
        except (BrokenPipeError, ConnectionResetError):
            self._report_death(worker_id)

    def coalesced(self) -> _Coalesced:
        """Messages sent inside go out as one write per worker, at the end (Channel.hold):
        nothing inside may wait for a worker.  (A plain context manager, not a generator: it
        runs at every batch.)"""
        return _Coalesced(self)

    def _report_death(self, worker_id: int) -> None:
        on_death = self._on_death()
        if on_death is not None:
            on_death(worker_id)

    def receive(self, worker_id: int):
        """(message, fds) of one waiting message; a closed socket is a dead worker."""
        try:
            return self.channels[worker_id].recv()
        except (ChannelClosed, ConnectionError):
            self._report_death(worker_id)
            raise  # on_death raises its own error; this only if it did not

    def last_words(self, worker_id: int):
        """The messages a dead worker sent before it went, in order."""
        channel = self.channels[worker_id]
        poll = Poller([channel.fileno()])
        while poll.ready(0):
            try:
                yield channel.recv()
            except (ChannelClosed, ConnectionError):
                return

    def first_exited(self) -> int | None:
        """A worker whose process has exited, or None (NOTE [ A sentinel closed by a live
        worker ]): its socket and sentinel may be held open by a process it forked."""
        for worker_id, process in enumerate(self.processes):
            if process.exitcode is not None or reaped_by_kernel(process):
                return worker_id
        return None

    def death(self, worker_id: int) -> WorkerDiedError:
        """The error that reports worker `worker_id`'s death (it is joined first)."""
        process = self.processes[worker_id]
        _join(process, 1.0)
        doing = describe_stage(self.board, worker_id)
        return WorkerDiedError(worker_id, process.pid, process.exitcode, doing,
                               self.crash_logs[worker_id].read(),
                               status_lost=reaped_by_kernel(process, wait=1.0))

    # -- statistics --------------------------------------------------------------------------------

    def worker_times(self) -> list | None:
        """Each worker's stage clocks (NOTE [ Stage clocks ] in timing.py), live or as read when
        the pool stopped."""
        if self.board is None or not self._timed:
            return self.final_worker_times
        now = time.monotonic_ns()
        return [diagnosis.worker_timing(worker_id, read_block(self.board, status_offset(worker_id),
                                                              process.pid, now))
                for worker_id, process in enumerate(self.processes)]

    @property
    def control_bytes(self) -> int:
        return sum(c.bytes_sent + c.bytes_received for c in self.channels)

    @property
    def control_messages(self) -> int:
        return sum(c.messages_sent + c.messages_received for c in self.channels)

    # -- shutdown ----------------------------------------------------------------------------------

    def stop(self) -> None:
        """See NOTE [ Shutdown ]: idempotent, and never raises for a worker already gone; a Ctrl-C
        meanwhile is raised once it is done (NOTE [ Ctrl-C held ] in interrupts.py)."""
        with ctrl_c_held():
            self._stop()

    def _stop(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.final_worker_times = self.worker_times()  # while /proc still has them
        except Exception:
            pass
        try:
            for channel in self.channels:
                try:
                    channel.send(Stop())
                except OSError:
                    pass
            deadline = time.monotonic() + STOP_GRACE_SECONDS
            for process in self.processes:
                _join(process, max(0.0, deadline - time.monotonic()))
            for process in self.processes:
                if _alive(process):
                    process.terminate()
            for process in self.processes:
                _join(process, 2.0)
                if _alive(process):
                    process.kill()
                    _join(process, KILLED_JOIN_SECONDS)
        finally:
            for channel in self.channels:
                channel.close()
            for crash_log in self.crash_logs:
                crash_log.close()
            for process in self.processes:
                _close_process(process)
            if self.board is not None:
                self.board.close_fd()
                self.board = None  # unmapped now, not when the (maybe still referenced) iterator goes


# NOTE [ SIGCHLD ignored ]
#   A process whose SIGCHLD disposition is SIG_IGN (set by the program, or inherited across exec
#   from a launcher that set it) has its children reaped by the kernel the moment they exit: no
#   exit status is ever there to read, waitpid() fails with ECHILD, and multiprocessing then
#   believes the worker runs forever (is_alive() stays True, Process.close() refuses and its
#   sentinel pipe's two fds stay open).  torch replaces the disposition with a handler of its own;
#   the loader leaves the user's disposition alone and instead knows a worker as gone when its
#   sentinel pipe has closed and the kernel has no such child: it is not signalled (its pid may
#   already be another process's), its pipe is closed, and its death is reported as one whose exit
#   status the kernel did not keep.


def sigchld_ignored() -> bool:
    return signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN


def reaped_by_kernel(process, wait: float = 0.0) -> bool:
    """True if `process` has exited and, SIGCHLD being ignored, the kernel reaped it (NOTE
    [ SIGCHLD ignored ]).  `wait`: how long to give a child whose sentinel has closed to be
    reaped (the pipe closes a moment before the exit completes)."""
    if process.exitcode is not None or not sigchld_ignored():
        return False
    if not Poller([process.sentinel]).ready(0):
        return False  # its end of the sentinel pipe is open: it runs
    deadline = time.monotonic() + wait
    while True:
        try:
            os.waitpid(process.pid, os.WNOHANG)  # under SIG_IGN it never returns a status
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)


# NOTE [ A sentinel closed by a live worker ]
#   multiprocessing's Process.join(timeout) waits for the worker's sentinel pipe to close, then
#   reads its exit status with a blocking waitpid.  A worker that closes its own end of that pipe
#   and lives on (a worker_init_fn that closes every file descriptor above some number, as
#   daemonizing code does) made that waitpid block until the worker ended: a next() that hung
#   for good, timeout= or not.  So the loader never calls join(): it polls the exit status
#   (non-blocking) until its deadline, and a worker still running then is terminated and killed
#   at shutdown as any other.  Likewise a worker that died while a process it forked holds its
#   socket and sentinel open (a helper it started) closes neither: the wait for batches checks
#   the workers' exit status every POLL_SECONDS (`first_exited`), as torch checks is_alive().


def _join(process, timeout: float) -> None:
    """Wait up to `timeout` for `process` to exit, never blocking past it (NOTE above)."""
    deadline = time.monotonic() + timeout
    sentinel = Poller([process.sentinel])
    while process.exitcode is None and not reaped_by_kernel(process):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        if sentinel.ready(0):  # closed: the exit status is a moment away, or the worker lives on
            time.sleep(min(remaining, 0.002))
        else:
            sentinel.ready(remaining)


def _alive(process) -> bool:
    return process.is_alive() and not reaped_by_kernel(process)


def _close_process(process) -> None:
    """Close a joined worker's Process and its sentinel pipe, also where multiprocessing cannot
    (NOTE [ SIGCHLD ignored ]); one still running (it could not be killed) keeps them."""
    try:
        process.close()
    except ValueError:
        if reaped_by_kernel(process, wait=1.0):
            process._popen.close()  # its pipe's fds; Process.close() wants an exit status first
            process._popen = None
            process.close()
