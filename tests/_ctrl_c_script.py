"""Run by tests/test_faults.py in a session of its own, then sent Ctrl-C (SIGINT to its process
group, as a terminal sends it): a dataset whose samples each run a program (`sleep`, standing
for an ffmpeg), recording each program's pid in the folder argv[2]."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch
from torch.utils.data import DataLoader, Dataset

from shmloader import ShmDataLoader


class RunsAProgram(Dataset):
    def __init__(self, folder: str):
        self.folder = folder

    def __len__(self):
        return 64

    def __getitem__(self, i):
        child = subprocess.Popen(["sleep", "60"])
        with open(os.path.join(self.folder, str(child.pid)), "w"):
            pass
        child.wait()
        return torch.zeros(4)


if __name__ == "__main__":
    # As in a terminal: a job started in the background (`make test &`) has SIGINT ignored, and
    # Python then never raises KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cls = {"torch": DataLoader, "shmloader": ShmDataLoader}[sys.argv[1]]
    for _ in cls(RunsAProgram(sys.argv[2]), batch_size=4, num_workers=2,
                 multiprocessing_context=sys.argv[3]):
        pass
