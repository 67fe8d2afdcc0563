"""Datasets for tests/test_diagnosis.py and its `python -m shmloader.diagnose` run: samples that
take a known time (a sleep, so they scale with workers even on a 2-core machine)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
from torch.utils.data import Dataset


class SleepDataset(Dataset):
    """`n` samples of 64 float32, each after `sleep_ms` of sleep."""

    def __init__(self, sleep_ms: float = 0.0, n: int = 100_000):
        self.sleep_s, self.n = sleep_ms / 1e3, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return np.full(64, i, dtype=np.float32)


def make_sleepy(sleep_ms: float = 5.0) -> SleepDataset:
    """A factory, as the CLI takes one."""
    return SleepDataset(sleep_ms)


def kill_in_collate(samples):
    """A collate_fn that SIGKILLs its worker at batch 3 (its first sample is 3 × batch_size)."""
    if int(samples[0][0]) == 6:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)
    return np.stack(samples)
