"""Peak memory of a process tree, sampled from a separate process.

Run as ``python -m bench.memwatch PID``; it reads commands on stdin, one per line:
``start`` (reset the peaks, take the baseline, begin sampling), ``stop`` (answer one JSON line
with the peaks), ``quit``. Only the standard library is imported, so it starts in milliseconds.

What is counted, so that shared pages are counted once:

- ``pss``: the sum over PID and all its descendants of ``Pss - Pss_Shmem`` from
  ``/proc/<pid>/smaps_rollup`` (proportional set size, shared-memory pages left out);
- ``shm``: the bytes in use on ``/dev/shm`` (``statvfs``), which holds every POSIX shared-memory
  segment, mapped or not, named or already unlinked.

``peak_mem_bytes`` is the largest ``pss + shm`` seen, minus the baseline taken at ``start``.
Reading smaps_rollup walks the page tables (milliseconds per GB mapped), so PSS is sampled at an
adaptive interval that keeps this process under ~5% of a core; ``/dev/shm`` (cheap) is sampled
every 5 ms. The watcher runs at nice 19 so that it yields to what it measures.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time

SHM = "/dev/shm"


def shm_used() -> int:
    try:
        st = os.statvfs(SHM)
    except OSError:
        return 0
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def descendants(root: int) -> list[int]:
    """``root`` and every live descendant, from the ppid field of /proc/<pid>/stat."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ..."; comm may hold spaces or parentheses.
        rest = stat[stat.rfind(b")") + 2 :].split()
        children.setdefault(int(rest[1]), []).append(int(name))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def pss_non_shmem(pid: int) -> int:
    """``Pss - Pss_Shmem`` of one process in bytes (0 if it is gone)."""
    pss = shmem = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    pss = int(line.split()[1])
                elif line.startswith(b"Pss_Shmem:"):
                    shmem = int(line.split()[1])
    except (OSError, ValueError):
        return 0
    return (pss - shmem) * 1024


def tree_pss(root: int, exclude: int) -> tuple[int, int]:
    pids = [p for p in descendants(root) if p != exclude]
    return sum(pss_non_shmem(p) for p in pids), len(pids)


def main(argv: list[str]) -> int:
    root = int(argv[1])
    me = os.getpid()
    try:
        os.nice(19)
    except OSError:
        pass
    active = False
    base = peak = peak_shm = base_shm = 0
    max_procs = samples = 0
    next_pss = 0.0
    pss_interval = 0.05
    while True:
        r, _, _ = select.select([sys.stdin], [], [], 0.005 if active else None)
        if r:
            line = sys.stdin.readline()
            cmd = line.strip()
            if cmd == "start":
                base_shm = shm_used()
                base_pss, _ = tree_pss(root, me)
                base = base_pss + base_shm
                peak, peak_shm, max_procs, samples = base, base_shm, 0, 0
                next_pss, active = 0.0, True
                print(json.dumps({"ok": True}), flush=True)
                continue
            if cmd == "stop":
                # one last PSS sample so that a short run is not missed entirely
                pss, n = tree_pss(root, me)
                s = shm_used()
                peak = max(peak, pss + s)
                peak_shm = max(peak_shm, s)
                active = False
                print(
                    json.dumps(
                        {
                            "peak_mem_bytes": max(0, peak - base),
                            "peak_shm_bytes": max(0, peak_shm - base_shm),
                            "baseline_bytes": base,
                            "max_procs": max(max_procs, n),
                            "pss_samples": samples + 1,
                        }
                    ),
                    flush=True,
                )
                continue
            if cmd in ("quit", ""):  # "" is EOF: the parent is gone
                return 0
            continue
        if not active:
            continue
        s = shm_used()
        peak_shm = max(peak_shm, s)
        now = time.monotonic()
        if now >= next_pss:
            pss, n = tree_pss(root, me)
            s2 = shm_used()
            took = time.monotonic() - now
            peak = max(peak, pss + max(s, s2))
            max_procs = max(max_procs, n)
            samples += 1
            pss_interval = max(0.05, 20 * took)  # ~5% of one core at most
            next_pss = time.monotonic() + pss_interval


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
