"""Slot segments made ahead of need, off the path of the batch being waited for.

NOTE [ Spare segments ]
  Creating a slot's segment reserves and zero-fills every page of it (posix_fallocate) and maps
  it: about as long as copying the batch once.  Done by the worker that needs the slot, it
  delays that worker's batch; at the start of an epoch, with many workers, several such batches
  are the ones the training loop waits for.  So once the ring knows its slot size (the first
  batch taught it, or `slot_bytes` was given), a worker that needs a slot and finds no created
  one free is not granted an empty slot to create: the grant waits, and this thread makes the
  segment meanwhile (the kernel's zero-filling runs without the GIL), wakes the main process
  through a pipe, and the main process installs it in the ring and grants it.  The thread makes
  only as many as the grants waiting for one (`want`), so the ring holds what is in flight and
  nothing more; a failure (a full /dev/shm) stops it, and workers create their slots again,
  where the error is reported with its batch.
"""

from __future__ import annotations

import os
import threading
from collections import deque

from . import _ring
from .interrupts import ctrl_c_held
from .ownership import register_parent_only

JOIN_SECONDS = 5.0  # at most one segment's creation to finish


class SpareMaker:
    """A thread that keeps up to `want` spare segments of `capacity` bytes ready; `wakeup_fd`
    becomes readable each time one is."""

    _wake_read = _wake_write = -1  # until the pipe is made (a __del__ of a half-made one closes nothing)
    _thread: threading.Thread | None = None

    def __init__(self, create):
        self._create = create  # capacity -> a new reserved, mapped, unlinked segment
        self._cond = threading.Condition()
        self._ready: deque[_ring.Segment] = deque()
        self._want = 0
        self._making = 0
        self._capacity = 0
        self._woken = False  # set by the thread before it writes a wake-up byte
        self._closed = False
        self.error: BaseException | None = None
        with ctrl_c_held():  # NOTE [ Ctrl-C held ] in interrupts.py
            self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            register_parent_only(self)

    @property
    def wakeup_fd(self) -> int:
        return self._wake_read

    @property
    def usable(self) -> bool:
        return not self._closed and self.error is None

    def want(self, count: int, capacity: int) -> None:
        """Keep `count` segments of `capacity` bytes ready or on their way (ready ones of another
        size are dropped)."""
        if count == self._want and capacity == self._capacity:
            return  # nothing new (called at every grant round: no lock, no wake-up)
        with self._cond:
            if capacity != self._capacity:
                self._drop_ready()
                self._capacity = capacity
            self._want = count
            if self._thread is None and count > 0 and self.usable:
                with ctrl_c_held():  # a thread started is a thread close() joins
                    thread = threading.Thread(target=self._run, name="shmloader-spare-slots", daemon=True)
                    thread.start()
                    self._thread = thread
            if count > len(self._ready) + self._making:
                self._cond.notify()

    def pending(self) -> int:
        """Segments ready or being made.  Read without the lock (each read is atomic under the
        GIL; a segment moving from made to ready may be missed for a moment): it runs at every
        grant round, and a KeyboardInterrupt between a `with` lock's acquire and its block leaves
        the lock held, and this thread never woken again."""
        return len(self._ready) + self._making

    def wait_made(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds until no segment is being made; whether one was."""
        with self._cond:
            if not self._making:
                return False
            self._cond.wait_for(lambda: not self._making, timeout)
            return True

    def take(self, capacity: int) -> _ring.Segment | None:
        """A ready segment of `capacity` bytes, or None."""
        self.drain_wakeups()
        with self._cond:
            while self._ready:
                segment = self._ready.popleft()
                if segment.size == capacity:
                    self._want = max(0, self._want - 1)
                    return segment
                segment.close_fd()
            return None

    def reserved_bytes(self) -> int:
        """Bytes of the segments ready or being made."""
        with self._cond:
            return sum(s.size for s in self._ready) + self._making * self._capacity

    def making(self) -> int:
        return self._making  # an int read: atomic under the GIL

    def ready_bytes(self) -> int:
        return sum(s.size for s in list(self._ready))

    def ready_count(self) -> int:
        return len(self._ready)  # a deque's length: atomic under the GIL

    def drain_wakeups(self) -> None:
        if not self._woken:
            return
        self._woken = False
        try:
            while os.read(self._wake_read, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and len(self._ready) + self._making >= self._want:
                    self._cond.wait()
                if self._closed:
                    return
                capacity = self._capacity
                self._making += 1
            try:
                segment = self._create(capacity)
            except BaseException as exc:  # a full /dev/shm: workers create (and report) again
                with self._cond:
                    self._making -= 1
                    self.error = exc
                    self._cond.notify_all()  # wait_made
                self._wake()
                return
            with self._cond:
                self._making -= 1
                if self._closed or capacity != self._capacity:
                    segment.close_fd()
                else:
                    self._ready.append(segment)
                self._cond.notify_all()  # wait_made
            del segment  # a segment dropped from the deque must be unmapped at once
            self._wake()

    def _wake(self) -> None:
        self._woken = True
        try:
            os.write(self._wake_write, b"!")
        except (BlockingIOError, OSError):
            pass  # the pipe is full: the main process has wake-ups to read already

    def _drop_ready(self) -> None:
        while self._ready:
            self._ready.popleft().close_fd()

    def close(self) -> None:
        with ctrl_c_held():  # NOTE [ Ctrl-C held ]: the thread told to stop is woken and joined
            with self._cond:
                if self._closed:
                    return
                self._closed = True
                self._cond.notify_all()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(JOIN_SECONDS)
            with self._cond:
                self._drop_ready()
            self._close_pipe()

    def __del__(self) -> None:
        """One dropped half-made by a KeyboardInterrupt (a running thread holds a reference to
        it, so this runs only once the thread has ended)."""
        self._close_pipe()

    def close_in_child(self) -> None:
        """A forked worker: the thread is not there, only its fds (no lock taken: it may be
        held by a thread that does not exist in the child)."""
        for segment in list(self._ready):
            segment.close_fd()
        self._close_pipe()

    def _close_pipe(self) -> None:
        """Close the wake-up pipe once (its fd numbers are soon reused by other objects)."""
        fds = (self._wake_read, self._wake_write)
        self._wake_read = self._wake_write = -1  # forgotten first: never closed twice
        for fd in fds:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
