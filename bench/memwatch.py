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
adaptive interval that keeps this process under ~5% of a core (a second or more when 8 workers
map GBs: a short peak falls between two samples). Between them, every 5 ms, the estimate is the
last PSS plus the anonymous memory each process has gained since (``RssAnon`` from
``/proc/<pid>/statm``, which costs the same whatever is mapped; a process first seen after the
last PSS sample counts what it holds beyond its parent's RssAnon, since a forked child starts
with its parent's pages shared), plus ``/dev/shm``; ``fast_samples`` counts them. Anonymous memory that a
process frees and another allocates between two PSS samples is counted at its largest. The
watcher runs at nice 19 so that it yields to what it measures.

``python -m bench.memwatch PID --min-pss-interval S`` samples PSS at most every S seconds (tests).
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


PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_anon(pid: int) -> int | None:
    """Resident anonymous bytes of one process (statm: resident - shared), None if it is gone."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            fields = f.read().split()
    except OSError:
        return None
    return (int(fields[1]) - int(fields[2])) * PAGE


def tree_pss(root: int, exclude: int) -> tuple[int, int, dict[int, int]]:
    """(PSS without shmem of the tree, its process count, each process's RssAnon then)."""
    pids = [p for p in descendants(root) if p != exclude]
    anon = {p: a for p in pids if (a := rss_anon(p)) is not None}
    return sum(pss_non_shmem(p) for p in pids), len(pids), anon


class AnonGain:
    """The anonymous memory the tree has gained since its last PSS sample (see the docstring)."""

    def __init__(self, root: int, exclude: int):
        self.root, self.exclude = root, exclude
        self.since: dict[int, int] = {}
        self.pids: list[int] = []
        self.next_scan = 0.0

    def reset(self, anon_at_pss: dict[int, int]) -> None:
        self.since = dict(anon_at_pss)
        self.pids = list(anon_at_pss)

    def gain(self, now: float) -> int:
        if now >= self.next_scan:  # new processes: listing /proc costs ~1 ms, so every 50 ms
            self.pids = [p for p in descendants(self.root) if p != self.exclude]
            self.next_scan = now + 0.05
        total = 0
        for p in self.pids:
            a = rss_anon(p)
            if a is None:
                continue
            if p not in self.since:  # new: a fork holds its parent's pages, shared, not new
                parent = rss_anon(parent_of(p)) or 0
                self.since[p] = min(a, parent)
            total += a - self.since[p]
        return total


def parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    return int(stat[stat.rfind(b")") + 2 :].split()[1])


def main(argv: list[str]) -> int:
    root = int(argv[1])
    min_pss_interval = float(argv[argv.index("--min-pss-interval") + 1]) if "--min-pss-interval" in argv else 0.05
    me = os.getpid()
    anon = AnonGain(root, me)
    last_pss = fast = 0
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
                base_pss, _, at = tree_pss(root, me)
                base = base_pss + base_shm
                peak, peak_shm, max_procs, samples, fast = base, base_shm, 0, 0, 0
                last_pss = base_pss
                anon.reset(at)
                next_pss, active = time.monotonic() + min_pss_interval, True
                print(json.dumps({"ok": True}), flush=True)
                continue
            if cmd == "stop":
                # one last PSS sample so that a short run is not missed entirely
                pss, n, _ = tree_pss(root, me)
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
                            "fast_samples": fast,
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
            pss, n, at = tree_pss(root, me)
            s2 = shm_used()
            took = time.monotonic() - now
            peak = max(peak, pss + max(s, s2))
            max_procs = max(max_procs, n)
            samples += 1
            last_pss = pss
            anon.reset(at)
            pss_interval = max(min_pss_interval, 20 * took)  # ~5% of one core at most
            next_pss = time.monotonic() + pss_interval
        else:
            peak = max(peak, last_pss + anon.gain(now) + s)
            fast += 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
