"""Workloads as users write them, torch's DataLoader against ShmDataLoader with the same arguments:
`python -m tools.user_workloads [NAME ...]` from the repository's root (about 3 minutes for all).

Not the bench's workloads (bench/workloads.py) but a check that the speed and memory hold on
others: images in a dict with their labels, 3-D volumes with the default collate and with
`np.stack`, audio clips of varying length padded by a numpy collate_fn, speech features padded
by torch's `pad_sequence`, a feature matrix of (vector, label) pairs, and images in batches whose
size varies from 8 to 128 (`images-buckets`, a size-bucketing batch sampler), and images
converted to float32 in [0, 1] by the collate_fn, in numpy (`images-to-float`) and in torch
(`images-torch-float`), and slices of a tensor the dataset holds in shared memory
(`shared-slices`: both loaders send each slice by a handle to that storage). Each sample
of the others is a fresh copy of an array from a small pool, as a decoder's output is; the
consumer reads every byte (a sum: in float64 for numpy arrays, in the tensor's own accumulation
type for torch tensors, since torch's float64 sum of a 16 MiB float32 tensor leaves about 150
MB in its threads' malloc arenas, which would be counted as the loader's memory, more in some
runs than in others). Per workload, 3 repeats, torch then shmloader in each
(interleaved); each run times at least 2 s of batches after 5 untimed ones, in a fresh process of
its own, so that no run's peak memory counts the heap an earlier one grew.

Printed per workload, median [min-max] over the repeats: ms per batch, the ratio torch/shmloader
paired by repeat, time to the first batch, peak memory and the main process's CPU per batch.
Peak memory is sampled every 20 ms: the PSS of the main process and its children less their
shared-memory pages, plus what /dev/shm holds (so a segment mapped by several processes counts
once, as bench/memwatch.py counts it); a peak shorter than 20 ms can fall between samples.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from shmloader import ShmDataLoader

REPEATS = 3
WINDOW_S = 2.0


def _memory_now() -> int:
    """PSS less shared-memory pages of this process and its children, plus /dev/shm's use."""
    total = 0
    me = os.getpid()
    pids = [me]
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) << 10
                    elif line.startswith("Pss_Shmem:"):
                        total -= int(line.split()[1]) << 10
        except OSError:
            pass
    st = os.statvfs("/dev/shm")
    return total + (st.f_blocks - st.f_bfree) * st.f_frsize


class PeakMemory:
    """The largest _memory_now() seen by a thread sampling every 20 ms while in the block."""

    def __enter__(self):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _memory_now())
            self._stop.wait(0.02)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


class Images(Dataset):
    """{"image": uint8 (3, 224, 224), "label": int}."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.pool = [rng.integers(0, 255, (3, 224, 224), dtype=np.uint8) for _ in range(16)]

    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        return {"image": self.pool[i % 16].copy(), "label": i % 1000}


class Volumes(Dataset):
    """float32 (1, 96, 96, 96), 3.4 MiB."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.pool = [rng.random((1, 96, 96, 96), dtype=np.float32) for _ in range(8)]

    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        return self.pool[i % 8].copy()


class Clips(Dataset):
    """float32 clips of 16000 to 48000 samples."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.pool = [rng.random(n, dtype=np.float32) for n in range(16000, 48001, 2000)]

    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        return self.pool[i % len(self.pool)].copy()


class Speech(Dataset):
    """float32 tensors of (frames, 80) log-mel features, 200 to 1600 frames."""

    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.pool = [torch.rand(n, 80, generator=generator) for n in range(200, 1601, 100)]

    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        return self.pool[(i * 7) % len(self.pool)].clone()


class Features(Dataset):
    """(float32 (4096,), np.int64 label)."""

    def __init__(self):
        self.pool = np.random.default_rng(0).random((64, 4096), dtype=np.float32)

    def __len__(self):
        return 1 << 24

    def __getitem__(self, i):
        return self.pool[i % 64].copy(), np.int64(i)


class SharedSlices(Dataset):
    """Contiguous 32 MiB slices (float32 (2048, 4096)) of a 512 MiB tensor the dataset put in
    shared memory (`share_memory_()`, a preloaded table), `batch_size=None`: the workers of both
    loaders send a handle to that storage (shmloader's copied each slice into a slot up to
    commit 20884c1; NOTE in shmloader/shared_views.py)."""

    ROWS, CHUNKS = 2048, 16

    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.data = torch.rand(self.CHUNKS * self.ROWS, 4096, generator=generator).share_memory_()

    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        j = i % self.CHUNKS
        return self.data[j * self.ROWS:(j + 1) * self.ROWS]


class SizeBuckets:
    """A batch sampler of batches whose sizes cycle through BUCKET_SIZES, as a sampler that groups
    samples by size (tokens, resolution) yields them: consecutive indices, endless."""

    def __iter__(self):
        start = 0
        for k in range(1 << 20):
            size = BUCKET_SIZES[k % len(BUCKET_SIZES)]
            yield list(range(start, start + size))
            start += size

    def __len__(self):
        return 1 << 20


BUCKET_SIZES = (8, 64, 16, 128, 32)


def pad_collate(clips):
    """Pad to the longest clip, as audio pipelines do: (padded batch, lengths)."""
    out = np.zeros((len(clips), max(len(c) for c in clips)), np.float32)
    for row, clip in enumerate(clips):
        out[row, : len(clip)] = clip
    return out, np.array([len(c) for c in clips], np.int64)


def pad_speech(features):
    """Dynamic padding as speech and text pipelines write it: (padded batch, lengths)."""
    lengths = torch.tensor([len(f) for f in features])
    return torch.nn.utils.rnn.pad_sequence(features, batch_first=True), lengths


def stack_collate(samples):
    return np.stack(samples)


def to_float_collate(samples):
    """uint8 images to float32 inputs in [0, 1], as numpy pipelines write it: (images, labels)."""
    images = np.stack([s["image"] for s in samples]).astype(np.float32) / 255
    return images, np.array([s["label"] for s in samples], np.int64)


def torch_to_float_collate(samples):
    """The same in torch: stack, .float(), / 255."""
    images = torch.stack([torch.from_numpy(s["image"]) for s in samples]).float() / 255
    return images, torch.tensor([s["label"] for s in samples])


WORKLOADS = {
    "images-w2": (Images, dict(batch_size=64, num_workers=2)),
    "images-w4": (Images, dict(batch_size=64, num_workers=4)),
    "volumes-stack": (Volumes, dict(batch_size=8, num_workers=2, collate_fn=stack_collate)),
    "volumes-default": (Volumes, dict(batch_size=8, num_workers=2)),
    "clips-pad": (Clips, dict(batch_size=32, num_workers=2, collate_fn=pad_collate)),
    "speech-pad": (Speech, dict(batch_size=32, num_workers=2, collate_fn=pad_speech)),
    "features": (Features, dict(batch_size=1024, num_workers=2)),
    "images-buckets": (Images, dict(batch_sampler=SizeBuckets(), num_workers=4)),
    "images-to-float": (Images, dict(batch_size=64, num_workers=2, collate_fn=to_float_collate)),
    "images-torch-float": (Images, dict(batch_size=64, num_workers=2, collate_fn=torch_to_float_collate)),
    "shared-slices": (SharedSlices, dict(batch_size=None, num_workers=2)),
}


def consume(batch) -> float:
    """Read every byte of the batch's main array."""
    x = batch["image"] if isinstance(batch, dict) else batch[0] if isinstance(batch, (tuple, list)) else batch
    if isinstance(x, np.ndarray):
        return float(x.sum(dtype=np.float64))
    return float(x.sum())  # not dtype=torch.float64: see the module docstring


def run_once(loader_class, dataset, kwargs) -> dict:
    gc.collect()
    with PeakMemory() as memory:
        t0 = time.perf_counter()
        loader = loader_class(dataset, **kwargs)
        it = iter(loader)
        consume(next(it))
        first = time.perf_counter() - t0
        for _ in range(4):
            consume(next(it))
        cpu0, start, n = time.process_time(), time.perf_counter(), 0
        while time.perf_counter() - start < WINDOW_S or n < 10:
            consume(next(it))
            n += 1
        per_batch = (time.perf_counter() - start) / n
        cpu = (time.process_time() - cpu0) / n
        del it, loader
        gc.collect()
    return {"ms": 1e3 * per_batch, "first_s": first, "peak_mb": memory.peak / 1e6, "cpu_ms": 1e3 * cpu}


LOADERS = {"torch": DataLoader, "shmloader": ShmDataLoader}


def run_isolated(name: str, loader: str) -> dict:
    """run_once of workload `name` through `loader` ("torch" or "shmloader") in a fresh process."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-m", "tools.user_workloads", "--run", name, loader, str(WINDOW_S)],
                          cwd=root, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name} through {loader} failed (exit {done.returncode}):\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cell(values: list[float], digits: int = 1) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def main(names: list[str]) -> None:
    import warnings

    warnings.filterwarnings("ignore", message="This DataLoader will create")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; median [min-max] of {REPEATS} repeats")
    for name in names or list(WORKLOADS):
        if name not in WORKLOADS:
            raise SystemExit(f"no workload {name!r}: choose from {', '.join(WORKLOADS)}")
        runs: dict[str, list[dict]] = {"torch": [], "shmloader": []}
        for _ in range(REPEATS):
            for loader in runs:
                runs[loader].append(run_isolated(name, loader))
        t, s = runs["torch"], runs["shmloader"]
        speed = [a["ms"] / b["ms"] for a, b in zip(t, s)]
        memory = [b["peak_mb"] / a["peak_mb"] for a, b in zip(t, s)]
        print(f"{name}:")
        for what, key, digits in (("ms per batch", "ms", 2), ("first batch s", "first_s", 3),
                                  ("peak memory MB", "peak_mb", 0), ("main CPU ms/batch", "cpu_ms", 2)):
            print(f"  {what:<18} torch {_cell([r[key] for r in t], digits):>26}   "
                  f"shmloader {_cell([r[key] for r in s], digits):>26}")
        print(f"  torch / shmloader, time: {_cell(speed, 2)}x;  shmloader / torch, peak memory: "
              f"{_cell(memory, 2)}x", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--run"]:  # one run, in this fresh process (run_isolated)
        import warnings

        warnings.filterwarnings("ignore", message="This DataLoader will create")
        workload, loader_name, window = sys.argv[2:5]
        WINDOW_S = float(window)
        make, loader_kwargs = WORKLOADS[workload]
        print(json.dumps(run_once(LOADERS[loader_name], make(), loader_kwargs)))
    else:
        main(sys.argv[1:])
