"""shmloader/heap.py: a worker keeps freed heap memory for its next batch, and gives it back once
it fetches into slots.  Run in a subprocess: glibc's tuning is process-wide."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.timeout(60)]

SCRIPT = """
import numpy as np
from shmloader import heap

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

heap.keep_freed_memory()
arrays = [np.ones(1 << 17) for _ in range(100)]  # 100 MiB of 1 MiB arrays, on the heap
del arrays
kept = rss_mib()
heap.release_free_memory()
print(kept, rss_mib())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_memory_is_kept_then_given_back():
    kept, released = map(float, subprocess.check_output([sys.executable, "-c", SCRIPT], text=True).split())
    assert kept - released > 80, (kept, released)
