"""Run by tests/test_loader_leaks.py in a fresh interpreter whose SIGCHLD is ignored (SIG_IGN,
as a launcher may leave it across exec), so the kernel reaps the workers at once: 8 loaders run
an epoch each, then a worker of a ninth is SIGKILLed.  Prints one JSON line: the fds open
before and after the 8 epochs, the killed worker's error, and the fds after that iterator."""

from __future__ import annotations

import gc
import json
import os
import signal
import time

import numpy as np
from torch.utils.data import Dataset

from shmloader import ShmDataLoader, WorkerDiedError


class Slow(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.01)
        return np.full((256,), i, np.float32)


def open_fds() -> int:
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def main() -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    out = {"fds_before": open_fds()}
    for _ in range(8):
        assert sum(1 for _ in ShmDataLoader(Slow(), batch_size=8, num_workers=2)) == 8
    out["fds_after_epochs"] = open_fds()
    it = iter(ShmDataLoader(Slow(), batch_size=8, num_workers=2))
    next(it)
    os.kill(it._pool.processes[0].pid, signal.SIGKILL)
    started = time.monotonic()
    try:
        for _ in it:
            pass
        out["error"] = None
    except WorkerDiedError as exc:
        out["error"] = str(exc)
    out["seconds_to_error"] = time.monotonic() - started
    del it
    out["fds_after_death"] = open_fds()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
