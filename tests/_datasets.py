"""Datasets, collate functions and worker_init_fns shared by the loader tests.

They live at module level in an importable module so that spawn and forkserver workers can
unpickle them (run pytest from the repository root: `tests` is a package).
"""

from __future__ import annotations

import collections
import math
import os
import random
import signal
import time

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

Pair = collections.namedtuple("Pair", ["image", "label"])


def _image(i: int, shape=(3, 4, 5), dtype=np.float32) -> np.ndarray:
    """A sample array whose every element tells which sample it came from."""
    return (np.arange(math.prod(shape), dtype=np.float64).reshape(shape) + 1000.0 * i).astype(dtype)


class DictDataset(Dataset):
    """Samples as dicts of every leaf kind the default collate handles."""

    def __init__(self, n: int = 37, shape=(3, 4, 5)):
        self.n, self.shape = n, shape

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {
            "image": _image(i, self.shape),
            "tensor": torch.full((2, 3), float(i), dtype=torch.float64),
            "label": i,
            "weight": i / 7.0,
            "flag": bool(i % 2),
            "name": f"sample-{i}",
            "nested": {"ids": np.array([i, -i], dtype=np.int64), "pair": (i, str(i))},
        }


class TupleDataset(Dataset):
    def __init__(self, n: int = 29):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return _image(i, (4, 4), np.int32), torch.tensor([i, i + 1]), float(i)


class NamedTupleDataset(Dataset):
    def __init__(self, n: int = 23):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return Pair(image=_image(i, (2, 6)), label=i)


class ArrayDataset(Dataset):
    """Plain numpy samples of `nbytes` each (for zero-copy and control-bytes checks)."""

    def __init__(self, n: int = 16, nbytes: int = 4096, dtype=np.float32):
        self.n = n
        self.count = nbytes // np.dtype(dtype).itemsize
        self.dtype = dtype

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full(self.count, i, dtype=self.dtype)


class RandomDataset(Dataset):
    """Draws from every RNG a worker seeds (torch, numpy, random) plus the worker's info."""

    def __init__(self, n: int = 24):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = get_worker_info()
        return {
            "index": i,
            "torch": torch.rand(3),
            "numpy": np.random.rand(3),
            "random": random.random(),
            "worker": -1 if info is None else info.id,
            "num_workers": -1 if info is None else info.num_workers,
            "seed": -1 if info is None else info.seed,
        }


class ShardedStream(IterableDataset):
    """An iterable dataset that shards itself with get_worker_info(), as users write them: worker
    k yields k, k + W, k + 2W, ... so interleaving differences show."""

    def __init__(self, n: int = 41, with_len: bool = False):
        self.n = n
        self.with_len = with_len

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield {"x": _image(i, (2, 3)), "i": i, "worker": -1 if info is None else info.id}

    def __len__(self):
        if not self.with_len:
            raise TypeError("no len")
        return self.n


class UnevenStream(IterableDataset):
    """Worker k yields 3 + 4k items: streams end at different times (exhaustion handling)."""

    def __iter__(self):
        info = get_worker_info()
        wid = 0 if info is None else info.id
        for j in range(3 + 4 * wid):
            yield np.array([wid, j], dtype=np.int64)


_init_marker = None


def set_marker(worker_id: int) -> None:
    """A worker_init_fn: its effect is visible to MarkerDataset."""
    global _init_marker
    info = get_worker_info()
    _init_marker = 100 * worker_id + info.num_workers


class MarkerDataset(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return {"i": i, "marker": -1 if _init_marker is None else _init_marker}


class VariableLengthDataset(Dataset):
    """Sample i has `base + step * i` elements: later batches are larger than the first."""

    def __init__(self, n: int = 24, base: int = 16, step: int = 2048):
        self.n, self.base, self.step = n, base, step

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full(self.base + self.step * i, i, dtype=np.float32)


def pad_collate(samples):
    """A custom collate for variable-length samples: a padded tensor and the lengths."""
    width = max(len(s) for s in samples)
    out = torch.zeros(len(samples), width)
    for row, s in enumerate(samples):
        out[row, : len(s)] = torch.from_numpy(s)
    return {"padded": out, "lengths": torch.tensor([len(s) for s in samples])}


def numpy_collate(samples):
    """A custom collate that keeps numpy: stacked arrays and a plain list."""
    return {
        "image": np.stack([s["image"] for s in samples]),
        "labels": [s["label"] for s in samples],
        "names": tuple(s["name"] for s in samples),
    }


def mixed_collate(samples):
    """A custom collate returning a tuple of a tensor, a numpy array, a str and an int."""
    return (
        torch.stack([torch.from_numpy(s["image"]) for s in samples]),
        np.array([s["label"] for s in samples], dtype=np.int16),
        "batch",
        len(samples),
    )


def list_collate(samples):
    return samples


# -- datasets that fail -------------------------------------------------------------------------


class FailingDataset(Dataset):
    """Raises ValueError on sample `bad`."""

    def __init__(self, n: int = 16, bad: int = 5):
        self.n, self.bad = n, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"bad sample {i} requested")
        return np.full(4, i, dtype=np.float32)


def failing_collate(samples):
    raise KeyError("collate refuses")


def failing_init(worker_id: int) -> None:
    raise ZeroDivisionError(f"init of worker {worker_id} fails")


class KillSelfDataset(Dataset):
    """The worker that fetches sample `bad` kills itself with `sig`; given `after` (a path), only
    once that file exists (the test makes it when the loop has what must come before the death)."""

    def __init__(self, n: int = 64, bad: int = 9, sig: int = signal.SIGKILL, after: str | None = None):
        self.n, self.bad, self.sig, self.after = n, bad, sig, after

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            deadline = time.monotonic() + 10
            while self.after is not None and not os.path.exists(self.after) and time.monotonic() < deadline:
                time.sleep(0.005)
            os.kill(os.getpid(), self.sig)
            time.sleep(10)
        return np.full(4, i, dtype=np.float32)


class SlowDataset(Dataset):
    """Sample `slow` takes `seconds`."""

    def __init__(self, n: int = 8, slow: int = 3, seconds: float = 5.0):
        self.n, self.slow, self.seconds = n, slow, seconds

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.slow:
            time.sleep(self.seconds)
        return np.full(4, i, dtype=np.float32)


class ObjectArrayDataset(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"ok": np.zeros(2, np.float32), "obj": np.array([object(), i], dtype=object)}


class MismatchedShapeDataset(Dataset):
    """Sample 2 of the 'image' leaf has another shape."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"label": i, "image": np.zeros((3, 4) if i != 2 else (3, 5), np.float32)}


def lambda_leaf_collate(samples):
    """A custom collate whose output holds an unpicklable leaf (a lambda)."""
    return {"x": torch.zeros(len(samples)), "extra": [1, (lambda: None)]}


def object_array_collate(samples):
    return {"x": torch.zeros(len(samples)), "meta": [np.array(["a", None], dtype=object)]}


class SleepyDataset(Dataset):
    """Even samples are slow: batches finish out of order when in_order=False."""

    def __len__(self):
        return 20

    def __getitem__(self, i):
        if (i // 2) % 2 == 0:
            time.sleep(0.02)
        return np.full(3, i, dtype=np.int64)


def sparse_collate(samples):
    """A custom collate returning a sparse COO tensor (pickled whole, its parts laid out as leaves)."""
    dense = torch.zeros(len(samples), 8)
    for row, s in enumerate(samples):
        dense[row, int(s[0]) % 8] = float(s[0])
    return {"sparse": dense.to_sparse(), "n": len(samples)}


def _torch_takes_numpy_bool() -> bool:
    """torch 2.6 with numpy >= 2.3 cannot make a tensor of a numpy.bool scalar (torch's own
    DataLoader raises TypeError there): such samples leave it out."""
    try:
        torch.as_tensor(np.True_)
    except TypeError:
        return False
    return True


TORCH_TAKES_NUMPY_BOOL = _torch_takes_numpy_bool()


class EdgeDataset(Dataset):
    """Leaves the default collate handles in less common shapes and types."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        grid = np.arange(12, dtype=np.float64).reshape(3, 4) + i
        sample = {
            "np_float32": np.float32(i / 3),
            "np_int64": np.int64(-i),
            "np_bool": np.bool_(i % 3 == 0),
            "zero_d": np.array(i * 1.5),
            "empty": np.zeros((0, 3), np.float32),
            "empty_t": torch.zeros(2, 0),
            "transposed": grid.T,
            "fortran": np.asfortranarray(grid),
            "strided": grid[:, ::2],
            "tensor_t": torch.arange(6.0).reshape(2, 3).T + i,
            "half": np.full(3, i, np.float16),
            "uint16": np.full(2, i, np.uint16),
            "bools": np.array([True, i % 2 == 0]),
            "bytes": b"b%d" % i,
            "list": [i, i + 1, float(i)],
            "tuple_of_str": ("a", str(i)),
            "big_int": 2**40 + i,
            "complex": np.full(2, 1j * i, np.complex64),
        }
        if not TORCH_TAKES_NUMPY_BOOL:
            del sample["np_bool"]
        return sample


class MixedDtypeDataset(Dataset):
    """Sample tensors whose dtype differs between samples."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return torch.ones(3, dtype=torch.float32 if i % 2 else torch.float64)


def default_collate_inside(samples):
    """A custom collate that calls torch's default_collate itself (worker-side tensor stacking)."""
    from torch.utils.data import default_collate

    return {"inner": default_collate(samples)}


class SamplerFailingAt(Sampler):
    """Yields 0..31 and raises IndexError when it comes to index `at` (a generator: done after)."""

    def __init__(self, at: int = 31):
        self.at = at

    def __len__(self):
        return 32

    def __iter__(self):
        for i in range(32):
            if i == self.at:
                raise IndexError(f"the sampler fails at {i}")
            yield i


class DiesLeavingAHelper(Dataset):
    """The worker that fetches sample `bad` forks a helper that sleeps (holding the worker's
    socket and sentinel pipe open, as a subprocess it started would) and exits; the helper's pid
    goes to `pid_file` for the test to kill."""

    def __init__(self, pid_file: str, n: int = 64, bad: int = 9):
        self.pid_file, self.n, self.bad = pid_file, n, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            helper = os.fork()
            if helper == 0:
                time.sleep(60)
                os._exit(0)
            with open(self.pid_file, "w") as f:
                f.write(str(helper))
            os._exit(3)
        return np.full(4, i, dtype=np.float32)


class ClosesItsFds(Dataset):
    """The worker that fetches sample `bad` closes every file descriptor above stderr but the
    pidfd that watches the main process (so its socket and its end of the sentinel pipe), as
    daemonizing code in a worker_init_fn does, and lives on for `seconds`."""

    def __init__(self, n: int = 64, bad: int = 9, seconds: float = 30.0):
        self.n, self.bad, self.seconds = n, bad, seconds

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            for name in os.listdir("/proc/self/fd"):
                fd = int(name)
                try:
                    if fd > 2 and "pidfd" not in os.readlink(f"/proc/self/fd/{fd}"):
                        os.close(fd)
                except OSError:
                    pass  # the listing's own fd, gone already
            time.sleep(self.seconds)
        return np.full(4, i, dtype=np.float32)
