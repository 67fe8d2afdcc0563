"""Datasets and hooks that inject one fault into one worker at one stage (tests/test_faults.py).

Importable by spawn and forkserver workers (tests/ is a package; pytest runs from the repo root).
Only the worker named by TARGET_WORKER faults, so the test knows which worker to expect in the
error; every fault first drops a marker file in `marker_dir` named `<how>-<pid>` holding the
time, so the test can measure how long the main process took to report it and, for "sigkill",
knows which pid to kill from outside.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import resource
import time

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

HOWS = ("raise", "exit", "segfault", "sigkill", "hang")
WHERES = ("unpickle", "worker_init", "getitem", "iter", "collate", "write")
TARGET_WORKER = 1
EXIT_STATUS = 7
HANG_SECONDS = 300


class InjectedFault(Exception):
    """The exception the "raise" faults raise (a distinctive type the main process must rebuild)."""


def _is_target() -> bool:
    # During unpickling get_worker_info() is not set yet; the process name is.
    return multiprocessing.current_process().name == f"shmloader-worker-{TARGET_WORKER}"


def inject(how: str, marker_dir: str, where: str) -> None:
    """Fault now, the way `how` says (only in the target worker)."""
    if not _is_target():
        return
    path = os.path.join(marker_dir, f"{how}-{os.getpid()}")
    with open(path + ".tmp", "w") as marker:
        marker.write(f"{time.time()!r} {where}")
    os.rename(path + ".tmp", path)  # the test never reads a half-written marker
    if how == "raise":
        raise InjectedFault(f"injected fault in {where}")
    if how == "exit":
        os._exit(EXIT_STATUS)
    if how == "segfault":
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file on the shared machine
        faulthandler._sigsegv()
    if how in ("sigkill", "hang"):  # "sigkill": the test kills this pid from outside
        time.sleep(HANG_SECONDS)
        os._exit(99)  # never reached in a passing test
    raise ValueError(f"unknown fault {how!r}")


def _sample(i: int) -> dict:
    return {"x": np.full((4, 3), i, dtype=np.float32), "i": i}


class FaultyDataset(Dataset):
    """16 samples; faults in worker TARGET_WORKER at `where` (see WHERES)."""

    def __init__(self, how: str, where: str, marker_dir: str):
        self.how, self.where, self.marker_dir = how, where, marker_dir

    def __len__(self) -> int:
        return 16

    def __setstate__(self, state):  # runs in spawn/forkserver workers: the "unpickle" stage
        self.__dict__.update(state)
        if self.where == "unpickle":
            inject(self.how, self.marker_dir, "unpickle")

    def __getitem__(self, i: int):
        if self.where == "getitem":
            inject(self.how, self.marker_dir, "getitem")
        if self.where == "write" and _is_target():
            _arm_write_fault(self.how, self.marker_dir)
        return _sample(i)


class FaultyIterable(IterableDataset):
    """The iterable-dataset variant: faults in `__iter__` of worker TARGET_WORKER."""

    def __init__(self, how: str, where: str, marker_dir: str):
        self.how, self.where, self.marker_dir = how, where, marker_dir

    def __iter__(self):  # a plain function, so the fault is in iter(dataset) itself
        inject(self.how, self.marker_dir, "iter")
        info = get_worker_info()
        return (_sample(i) for i in range(info.id, 16, info.num_workers))


class FaultyInit:
    """A worker_init_fn that faults."""

    def __init__(self, how: str, marker_dir: str):
        self.how, self.marker_dir = how, marker_dir

    def __call__(self, worker_id: int) -> None:
        inject(self.how, self.marker_dir, "worker_init")


class FaultyCollate:
    """A collate_fn that faults (after building its batch)."""

    def __init__(self, how: str, marker_dir: str):
        self.how, self.marker_dir = how, marker_dir

    def __call__(self, samples):
        inject(self.how, self.marker_dir, "collate")
        return torch.utils.data.default_collate(samples)


def _arm_write_fault(how: str, marker_dir: str) -> None:
    """Make this worker fault in the middle of writing its next batch into its slot: after the
    slot is claimed and the descriptor and leaves are written, before it is published."""
    from shmloader import layout

    real = getattr(layout.write_batch, "__wrapped__", layout.write_batch)

    def write_batch(segment, plan, rows_in_slot=False):
        in_place = real(segment, plan, rows_in_slot)
        inject(how, marker_dir, "write")
        return in_place

    write_batch.__wrapped__ = real
    layout.write_batch = write_batch


def make_loader(how: str, where: str, marker_dir: str, start_method: str, **kwargs):
    """A ShmDataLoader (2 workers, batches of 2) that faults at `where` in worker 1."""
    from shmloader import ShmDataLoader

    dataset_type = FaultyIterable if where == "iter" else FaultyDataset
    return ShmDataLoader(
        dataset_type(how, where, marker_dir),
        batch_size=2,
        num_workers=2,
        multiprocessing_context=start_method,
        worker_init_fn=FaultyInit(how, marker_dir) if where == "worker_init" else None,
        collate_fn=FaultyCollate(how, marker_dir) if where == "collate" else None,
        **kwargs,
    )
