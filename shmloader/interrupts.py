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
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading


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
    came: list = []
    signal.signal(signal.SIGINT, lambda signum, frame: came.append(frame))
    _replaced.append(handler)
    try:
        yield
    finally:
        if _replaced:  # emptied in a process forked meanwhile
            _replaced.pop()
        signal.signal(signal.SIGINT, handler)
        if came:
            handler(signal.SIGINT, came[0])


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
