"""Where a worker's faulthandler writes: a pipe that the main process reads when the worker dies.

A worker killed by a signal (a segmentation fault in native code, an abort) cannot report
anything itself, but faulthandler still prints the Python traceback of the crash.  Printed to the
worker's stderr it reaches only a terminal or a log; written into this pipe it reaches the
WorkerDiedError that the training loop gets.  Both ends are non-blocking: a crashing worker never
blocks on a full pipe (faulthandler drops what does not fit), and the main process never waits.
"""

from __future__ import annotations

import os

from .ownership import no_fork_meanwhile, register_parent_only

MAX_REPORT_BYTES = 64 * 1024


class CrashLog:
    """One worker's pipe: the main process keeps the read end, the worker gets the write end."""

    def __init__(self) -> None:
        with no_fork_meanwhile():
            self.read_fd, self.write_fd = os.pipe()
            register_parent_only(self)
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)

    def close_write_end(self) -> None:
        """Once the write end has been passed to the worker (SCM_RIGHTS duplicates it)."""
        with no_fork_meanwhile():
            if self.write_fd >= 0:
                os.close(self.write_fd)
                self.write_fd = -1

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
            if self.read_fd >= 0:
                os.close(self.read_fd)
                self.read_fd = -1

    close_in_child = close  # a forked worker keeps none of the other workers' pipes
