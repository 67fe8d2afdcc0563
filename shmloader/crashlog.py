"""Where a worker's faulthandler writes: a pipe that the main process reads when the worker dies.

A worker killed by a signal (a segmentation fault in native code, an abort) cannot report
anything itself, but faulthandler still prints the Python traceback of the crash.  Printed to the
worker's stderr it reaches only a terminal or a log; written into this pipe it reaches the
WorkerDiedError that the training loop gets.  Both ends are non-blocking: a crashing worker never
blocks on a full pipe (faulthandler drops what does not fit), and the main process never waits.
"""

from __future__ import annotations

import os

from .interrupts import ctrl_c_held
from .ownership import no_fork_meanwhile, register_parent_only

MAX_REPORT_BYTES = 64 * 1024


class CrashLog:
    """One worker's pipe: the main process keeps the read end, the worker gets the write end."""

    read_fd = write_fd = -1  # until the pipe is made (a __del__ of a half-made one closes nothing)

    def __init__(self) -> None:
        with ctrl_c_held(), no_fork_meanwhile():  # NOTE [ Ctrl-C held ] in interrupts.py
            self.read_fd, self.write_fd = os.pipe()
            register_parent_only(self)
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)

    def close_write_end(self) -> None:
        """Once the write end has been passed to the worker (SCM_RIGHTS duplicates it)."""
        with no_fork_meanwhile():
            fd, self.write_fd = self.write_fd, -1  # forgotten first: never closed twice
            if fd >= 0:
                os.close(fd)

    def read(self) -> str:
        """What the worker wrote so far ('' if nothing), without waiting."""
        if self.read_fd < 0:
            return ""
        chunks = []
        size = 0
        while size < MAX_REPORT_BYTES:
            try:
                chunk = os.read(self.read_fd, MAX_REPORT_BYTES - size)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks).decode("utf-8", errors="replace").strip()

    def close(self) -> None:
        with no_fork_meanwhile():
            self.close_write_end()
            fd, self.read_fd = self.read_fd, -1
            if fd >= 0:
                os.close(fd)

    close_in_child = close  # a forked worker keeps none of the other workers' pipes

    def __del__(self) -> None:
        """One dropped half-made by a KeyboardInterrupt (NOTE [ Ctrl-C held ] in interrupts.py)."""
        self.close()
