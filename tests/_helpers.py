"""Small helpers for the loader tests: batch comparison, torch side-by-side runs, leak snapshots."""

from __future__ import annotations

import collections.abc
import copy
import gc
import os
import time
from dataclasses import dataclass

import numpy as np
import psutil
import torch
from torch.utils.data import DataLoader

from shmloader import ShmDataLoader

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "shmloader-"


# -- comparing batches ------------------------------------------------------------------------------


def assert_same(got, want, path: str = "batch") -> None:
    """`got` equals `want` leaf for leaf, with the same container and leaf types, dtypes, shapes."""
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(got, want), f"{path}: values differ"
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        np.testing.assert_array_equal(got, want, err_msg=path)
    elif isinstance(want, collections.abc.Mapping):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def assert_same_batches(got: list, want: list) -> None:
    assert len(got) == len(want), f"{len(got)} batches, torch gives {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same(g, w, f"batch #{i}")


def seeded(seed: int = 1234) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def both(dataset, seed: int | None = None, **kwargs) -> tuple[ShmDataLoader, DataLoader]:
    """A ShmDataLoader and a torch DataLoader with the same arguments (and equal generators)."""
    if seed is not None:
        return (ShmDataLoader(dataset, generator=seeded(seed), **kwargs),
                DataLoader(dataset, generator=seeded(seed), **kwargs))
    return ShmDataLoader(dataset, **kwargs), DataLoader(dataset, **kwargs)


def collect(loader) -> list:
    """One epoch's batches, each deep-copied out of its slot as it arrives (holding every batch
    itself would fill the ring: a loop that keeps them all must copy them, or raise the cap)."""
    return [copy.deepcopy(batch) for batch in loader]


def epochs(loader, n: int = 1) -> list[list]:
    return [collect(loader) for _ in range(n)]


def freeze(obj):
    """A hashable, comparable image of a batch (for order-insensitive comparisons)."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", str(obj.dtype), tuple(obj.shape), tuple(obj.flatten().tolist()))
    if isinstance(obj, np.ndarray):
        return ("ndarray", str(obj.dtype), obj.shape, tuple(obj.flatten().tolist()))
    if isinstance(obj, collections.abc.Mapping):
        return ("map", tuple((k, freeze(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(freeze(v) for v in obj))
    return obj


# -- zero copy --------------------------------------------------------------------------------------


def address_of(leaf) -> int:
    if isinstance(leaf, torch.Tensor):
        return leaf.data_ptr()
    return leaf.__array_interface__["data"][0]


def nbytes_of(leaf) -> int:
    if isinstance(leaf, torch.Tensor):
        return leaf.numel() * leaf.element_size()
    return leaf.nbytes


def in_ring(leaf, iterator) -> bool:
    """Whether all of `leaf`'s memory lies inside one segment of the iterator's ring."""
    start = address_of(leaf)
    end = start + nbytes_of(leaf)
    return any(s.address <= start and end <= s.address + s.size for s in iterator._ring.segments())


# -- leak snapshots -------------------------------------------------------------------------------


def shm_entries() -> set[str]:
    return {name for name in os.listdir(SHM_DIR) if name.startswith(SEGMENT_PREFIX)}


def mapped_segments() -> int:
    """How many shmloader segments this process maps (unlinked ones show as '(deleted)')."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if f"/{SEGMENT_PREFIX}" in line)


def _helper_process(proc: psutil.Process) -> bool:
    """multiprocessing's long-lived helpers (forkserver, resource tracker) are not the loader's."""
    try:
        cmdline = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return "forkserver" in cmdline or "resource_tracker" in cmdline


def child_pids() -> set[int]:
    children = psutil.Process().children(recursive=True)
    return {p.pid for p in children if not _helper_process(p)}


def open_fds() -> dict[int, str]:
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the listing's own fd, closed already
    return fds


@dataclass
class Snapshot:
    shm: set[str]
    mapped: int
    children: set[int]
    fds: dict[int, str]


def snapshot() -> Snapshot:
    gc.collect()
    return Snapshot(shm_entries(), mapped_segments(), child_pids(), open_fds())


def leaks_since(before: Snapshot) -> list[str]:
    now = snapshot()
    problems = []
    if now.shm - before.shm:
        problems.append(f"/dev/shm entries left: {sorted(now.shm - before.shm)}")
    if now.mapped > before.mapped:
        problems.append(f"{now.mapped - before.mapped} shmloader segments still mapped")
    if now.children - before.children:
        problems.append(f"child processes left: {sorted(now.children - before.children)}")
    new_fds = {fd: target for fd, target in now.fds.items() if before.fds.get(fd) != target}
    if new_fds:
        problems.append(f"fds left open: {new_fds}")
    return problems


def assert_no_leaks(before: Snapshot, within: float = 5.0) -> None:
    """Poll until nothing of the loader remains (processes take a moment to be reaped)."""
    deadline = time.monotonic() + within
    while True:
        problems = leaks_since(before)
        if not problems:
            return
        if time.monotonic() >= deadline:
            raise AssertionError("; ".join(problems))
        time.sleep(0.05)
