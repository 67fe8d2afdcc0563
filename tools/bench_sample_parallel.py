#!/usr/bin/env python
# Usage: PYTHONPATH=. python tools/bench_sample_parallel.py [repeats]   (indicative; see the sample_parallel commit)
"""Forum workload made map-style: torch DataLoader (default_collate, shm tensors) vs ShmDataLoader
default vs sample_parallel=True.  Time to first batch, steady s/batch, peak memory (sum of PSS
of the process tree, and /dev/shm in use), interleaved repeats."""
import os, sys, time, threading, json
import numpy as np, psutil, torch
from torch.utils.data import DataLoader, Dataset
from shmloader import ShmDataLoader

B, W, STEP, SLEEP = 128, 8, 0.05, 0.003125
N = B * 21


class Forum(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        time.sleep(SLEEP)
        return np.random.random((1000, 150))


def shm_used():
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def tree_pss():
    """Memory of the process tree: PSS of anonymous and file pages of every process, plus each shared-memory
    segment any of them maps counted once at its mapped size (touched or not)."""
    total = 0
    shm = {}
    me = psutil.Process()
    for p in [me] + me.children(recursive=True):
        try:
            with open(f"/proc/{p.pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith(("Pss_Anon:", "Pss_File:")):
                        total += int(line.split()[1]) * 1024
            with open(f"/proc/{p.pid}/maps") as f:
                for line in f:
                    if "/dev/shm/" in line or "memfd:" in line:
                        parts = line.split()
                        lo, hi = (int(x, 16) for x in parts[0].split("-"))
                        shm[parts[4]] = max(shm.get(parts[4], 0), hi - lo)
        except OSError:
            pass
    return total + sum(shm.values())


class Peak(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.stop = False
        self.pss = self.shm = 0
        self.shm0 = shm_used()

    def run(self):
        while not self.stop:
            self.pss = max(self.pss, tree_pss())
            self.shm = max(self.shm, shm_used() - self.shm0)
            time.sleep(0.05)


def make(mode):
    kw = dict(batch_size=B, num_workers=W)
    if mode == "torch":
        return DataLoader(Forum(), **kw)
    if mode == "shm-default":
        return ShmDataLoader(Forum(), **kw)
    return ShmDataLoader(Forum(), sample_parallel=True, **kw)


def run(mode, warm=5, timed=16):
    base = tree_pss()
    peak = Peak()
    peak.start()
    loader = make(mode)
    t0 = time.perf_counter()
    it = iter(loader)
    batch = next(it)
    ttfb = time.perf_counter() - t0
    del batch
    time.sleep(STEP)
    for _ in range(warm - 1):
        batch = next(it); del batch; time.sleep(STEP)
    t1 = time.perf_counter()
    for _ in range(timed):
        batch = next(it); del batch; time.sleep(STEP)
    per = (time.perf_counter() - t1) / timed
    peak.stop = True
    peak.join()
    del it, loader
    return dict(mode=mode, ttfb=ttfb, s_per_batch=per, peak_pss_mb=(peak.pss - base) / 2**20,
                peak_shm_mb=peak.shm / 2**20)


def sample_cpu():
    """One sample's CPU in a worker: making the numbers and one copy into memory already mapped
    (glibc told to keep freed memory, as shmloader's workers do)."""
    import ctypes
    libc = ctypes.CDLL(None); libc.mallopt(-3, 32 * 1024 * 1024); libc.mallopt(-1, 2**31 - 1)
    buf = np.empty((1000, 150))
    for _ in range(5):
        buf[:] = np.random.random((1000, 150))
    t = time.process_time()
    for _ in range(100):
        buf[:] = np.random.random((1000, 150))
    return (time.process_time() - t) / 100


if __name__ == "__main__":
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    cpu = sample_cpu()
    cores = len(os.sched_getaffinity(0))
    bound = max(STEP, B * (SLEEP + cpu) / W, B * cpu / cores)
    print(json.dumps(dict(sample_cpu_s=cpu, cores=cores, work_bound_s_per_batch=bound, load=os.getloadavg())), flush=True)
    for r in range(repeats):
        for mode in ("torch", "shm-default", "sample_parallel"):
            print(json.dumps(run(mode)), flush=True)
    cpu = sample_cpu()
    print(json.dumps(dict(sample_cpu_s=cpu, work_bound_s_per_batch=max(STEP, B * (SLEEP + cpu) / W, B * cpu / cores),
                          load=os.getloadavg())), flush=True)
