"""Processes that call os._exit while another of their threads makes segments
(tests/test_main_dies.py).

    python -m tests._exit_race N

Forks N children one after another; in each, a thread makes 64 KiB segments in a loop while the
main thread spins for 0-20 ms and then calls os._exit, as a training script does that exits while
the ring's spare-slot thread (or a worker whose watch thread sees the main process gone) is
making one.  Prints the number of children that ran.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time

from shmloader.segment import create_segment


def _make_segments() -> None:
    while True:
        create_segment(64 * 1024, 0)
        sum(range(2000))  # Python work between segments, as the ring's thread does


def main(children: int) -> None:
    for _ in range(children):
        pid = os.fork()
        if pid == 0:
            sys.setswitchinterval(1e-5)  # threads switch often: the exit may come anywhere in the other
            threading.Thread(target=_make_segments, daemon=True).start()
            until = time.perf_counter() + random.random() * 0.02
            while time.perf_counter() < until:
                pass
            os._exit(3)
        os.waitpid(pid, 0)
    print(children, flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
