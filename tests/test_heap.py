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


LARGE_SCRIPT = """
import resource, sys
import numpy as np
from shmloader import heap

if sys.argv[1] == "keep":
    heap.keep_freed_memory()
faults = []
for _ in range(4):  # a 40 MiB temporary per batch, above glibc's highest mmap threshold
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    np.ones(40 << 17).sum()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_arrays_above_the_mmap_threshold_reuse_their_memory():
    """A 40 MiB array made and freed batch after batch: glibc would mmap it afresh each time and
    fault it in again (10240 page faults, or about 530 where numpy gets huge pages for it); a
    worker's heap keeps it, so only the first one faults."""
    def faults(mode: str) -> list[int]:
        out = subprocess.check_output([sys.executable, "-c", LARGE_SCRIPT, mode], text=True)
        return list(map(int, out.split()))

    fresh, kept = faults("glibc"), faults("keep")
    assert min(fresh[1:]) > 300, fresh  # each one mapped and faulted in again
    assert kept[0] > 300 and max(kept[1:]) < 50, kept
