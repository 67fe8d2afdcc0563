"""A Ctrl-C held while the loader's resources change hands, and raised once they are settled.

NOTE [ Ctrl-C held ]
  Python raises KeyboardInterrupt in the main thread between any two bytecodes, so a Ctrl-C
  (or Jupyter's "interrupt kernel", which sends the same SIGINT) landing inside the loader's own
  code could cut a resource's change of hands in half: a segment's name not yet unlinked, a
  pipe made but not yet owned by anything that closes it, a shutdown flagged done but never
  run, a thread told to stop but never woken.  In a long-lived process (a notebook) those
  leaks add up.  The steps where that can happen hold a SIGINT that comes meanwhile and run
  Python's handler (the KeyboardInterrupt) once they are done: making a segment, building and
  stopping the workers, closing the ring and its spare-segment thread, adopting a segment a
  worker sent.  Each is short (a shutdown waits at most a few seconds for its workers), and
  none is on the per-batch path, where swapping the handler twice (about 5 us) would cost
  more than it is worth; there a KeyboardInterrupt leaves objects that close their fds when
  collected.  A worker forked inside a block gets the handler the block replaced.

  Inside a finalizer (an iterator dropped mid-epoch, whose __del__ stops its workers), Python
  prints and drops any exception, a KeyboardInterrupt too: raised there, the held Ctrl-C would
  be lost and the program would go on as if it had never come (a loop that makes loaders ran
  on until killed).  So a block reached from a `__del__` frame raises it later instead: it puts
  a relay handler in place of the handler, and a watcher thread sends SIGINT to the main thread
  once no `__del__` frame is on its stack; the relay puts the handler back and runs it there, in
  the code the finalizer returned to (or lets it pass if a `__del__` came meanwhile, and the
  watcher sends it again).  A thread, not a second signal from the relay itself: a signal raised
  in the main thread is handled at its next bytecode check, which would be inside the relay or
  the finalizer again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time


@contextlib.contextmanager
def ctrl_c_held():
    """In the main thread, where Python raises KeyboardInterrupt: a SIGINT that comes meanwhile
    is held, and its handler (the KeyboardInterrupt) runs once the block is done.  Nested
    blocks hand a held SIGINT to the outer one."""
    if threading.current_thread() is not threading.main_thread() or sys.is_finalizing():
        yield
        return
    handler = signal.getsignal(signal.SIGINT)
    if not callable(handler):  # ignored, or not Python's to handle
        yield
        return
    held = _Held()
    signal.signal(signal.SIGINT, held)
    _replaced.append(handler)
    try:
        yield
    finally:
        if _replaced:  # emptied in a process forked meanwhile
            _replaced.pop()
        signal.signal(signal.SIGINT, handler)
        if held.frames:
            if not isinstance(handler, _Held) and _in_finalizer(sys._getframe()):
                _raise_after_finalizer(handler)
            else:
                handler(signal.SIGINT, held.frames[0])  # raised, or handed to the outer block


class _Held:
    """The SIGINT handler of a block: notes the Ctrl-C."""

    def __init__(self) -> None:
        self.frames: list = []

    def __call__(self, signum, frame) -> None:
        self.frames.append(frame)


def _in_finalizer(frame) -> bool:
    """Whether `frame` runs inside a `__del__` (where Python drops what is raised)."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _raise_after_finalizer(handler) -> None:
    """Run `handler` for a held SIGINT once no `__del__` is on the main thread's stack (NOTE
    [ Ctrl-C held ]): a watcher thread sends SIGINT to the main thread when its stack has none,
    and a relay handler runs `handler` there, or waits for the next one if a `__del__` came."""
    main = threading.main_thread()
    delivered = threading.Event()

    def relay(signum, frame) -> None:
        if _in_finalizer(frame):
            return  # the watcher sends it again
        delivered.set()
        if signal.getsignal(signal.SIGINT) is relay:
            signal.signal(signal.SIGINT, handler)
        handler(signum, frame)

    def watch() -> None:
        while not delivered.is_set():
            frame = sys._current_frames().get(main.ident)
            if frame is None:  # the main thread is gone
                return
            if _in_finalizer(frame):
                del frame
                time.sleep(RELAY_POLL_SECONDS)
                continue
            del frame
            signal.pthread_kill(main.ident, signal.SIGINT)
            delivered.wait(RELAY_RETRY_SECONDS)

    signal.signal(signal.SIGINT, relay)
    threading.Thread(target=watch, name="shmloader-ctrl-c-relay", daemon=True).start()


RELAY_POLL_SECONDS = 0.001  # how often the watcher looks at the main thread's stack
RELAY_RETRY_SECONDS = 0.05  # after a SIGINT the relay did not take (a __del__ had come)


_replaced: list = []  # the handlers of the blocks under way, outermost first


def _after_fork_in_child() -> None:
    """A process forked inside a block (a worker started meanwhile) gets the handler the block
    replaced: its Ctrl-C must raise KeyboardInterrupt as the parent's would."""
    if _replaced:
        try:
            signal.signal(signal.SIGINT, _replaced[0])
        except ValueError:  # not forked from the main thread: Python's handler runs in none of its
            pass
        _replaced.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
