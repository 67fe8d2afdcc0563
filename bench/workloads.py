"""What is loaded: the datasets, their collate functions, and the points each workload expands to.

A *point* is one configuration that every transport runs in turn (dataset, batch size, workers,
consumer, how many batches to time). The datasets are module-level classes so that they pickle
(spawn/forkserver) and so that the same objects feed torch's DataLoader and ShmDataLoader.

Workloads
---------
``seed001``    the experiment of ``seeds/001_a569dd7e840eb412.txt`` as posted: an IterableDataset
               whose items are ``np.random.random((1000, 150))`` (large) or ``(10, 150)`` (small)
               after a 3.125 ms sleep, batch 128, ``collate_fn`` returning the list of records, a
               0.05 s train step, ``prefetch_factor=4, persistent_workers=True``.
``transport``  pre-made samples (no compute in ``__getitem__``; 16 distinct arrays, one per row),
               16 samples per batch, batches of 1 MiB .. 256 MiB; the consumer only touches the
               batch, or reads every byte.
``small``      4 KiB batches (32 samples of 128 B): the control path dominates.
``paced``      ``transport``'s batches (1 MiB and 256 MiB by default) from samples that each sleep
               PACED_SAMPLE_S first, so that a batch comes every ~30-45 ms at 2 workers and the
               loop waits for every batch at every size: main-process CPU per batch against
               batch size, with the loop waiting at both (only where named, or ``-w all``).
               Plus ``256MiB-fresh``: the same, each sample a fresh copy (as a decoder's or an
               augmentation's output is), for peak memory when samples are made, not held.
``vision``     dict samples ``{"image": uint8 (3,224,224), "label": int, "name": str}``, batch 64.
``epochs``     the epoch boundary: a map-style dataset of float32 (1000, 150) samples after a 3 ms
               sleep, batch 32, ``shuffle=True`` with a seeded ``torch.Generator``,
               ``persistent_workers=True``, 3 epochs of 20 batches on one loader, a 0.05 s train
               step after each batch; what is measured is the wait in ``next()`` (the first
               batch of each epoch, from the ``iter()`` call, against the steady batches).
``rows``       the forum workload made map-style (:class:`SeedMapDataset`: ``sleep(0.003125)``
               then ``np.random.random((1000, 150))``, float64 as posted), batch 128,
               ``default_collate``, 8 workers, a 0.05 s train step, 5 + 16 batches as seed001 is
               timed: time to first batch, steady s/batch, total, peak memory, against the work
               bound. For the sample-parallel mode (the samples of one batch spread over all
               workers).

``epochs`` and ``rows`` are *mode* workloads: they compare loader modes, run only where named
(``-w epochs,rows`` or ``-w all``; not in ``--quick`` without ``-w``), with their own transports
(``MODE_TRANSPORTS``) and their own tables.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from torch.utils.data import Dataset, IterableDataset, default_collate

MiB = 1 << 20

# ---------------------------------------------------------------------------------------------
# seed001, as posted (the forum code, with its lost lines restored)

SEED_FETCH_S = 0.003125  # "it takes 0.003125 s to fetch an item from a source database"
SEED_STEP_S = 0.05  # "the train step takes 0.05 s"
SEED_BATCH = 128
SEED_SHAPES = {"large": (1000, 150), "small": (10, 150)}


def collate_fn(records):
    # some custom collation function
    return records


class MyIterable:
    def __init__(self, n, shape=SEED_SHAPES["large"]):
        self.n = n
        self.i = 0
        self.shape = shape

    def __iter__(self):
        return self

    def __next__(self):
        if self.i < self.n:
            self.i += 1
            time.sleep(SEED_FETCH_S)  # simulates data fetch time
            return np.random.random(self.shape)
        raise StopIteration


class MyIterableDataset(IterableDataset):
    def __init__(self, n, shape=SEED_SHAPES["large"]):
        self.n = n
        self.shape = shape

    def __iter__(self):
        return MyIterable(self.n, self.shape)


# ---------------------------------------------------------------------------------------------
# transport / small: pre-made samples


class PremadeDataset(Dataset):
    """``length`` samples of ``sample_bytes`` (float32), made once: ``distinct`` different arrays
    (one per row of a batch by default), returned in turn. Distinct rows make a batch's source as
    large as the batch, so that collating it reads from memory, not from a cache-resident sample."""

    def __init__(self, sample_bytes: int, length: int, distinct: int = 1):
        if sample_bytes % 4:
            raise ValueError(f"sample_bytes must be a multiple of 4, got {sample_bytes}")
        n = sample_bytes // 4
        self.samples = [np.arange(k, k + n, dtype=np.float32) for k in range(distinct)]
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return self.samples[i % len(self.samples)]


class PacedDataset(PremadeDataset):
    """PremadeDataset whose samples each take `sample_s` (a sleep: no CPU) to fetch; with
    `fresh`, each is a new copy (memory made per sample, as a decoder's output) rather than an
    array the dataset holds."""

    def __init__(self, sample_bytes: int, length: int, distinct: int, sample_s: float,
                 fresh: bool = False):
        super().__init__(sample_bytes, length, distinct)
        self.sample_s = sample_s
        self.fresh = fresh

    def __getitem__(self, i):
        time.sleep(self.sample_s)
        sample = self.samples[i % len(self.samples)]
        return sample.copy() if self.fresh else sample


def stack_collate(samples):
    """The numpy collate a user writes when batches should stay numpy (pickled by torch)."""
    return np.stack(samples)


def np_stack_collate(samples):
    """The numpy collate as users write it: ``np.stack`` of the samples, per key for dict
    samples (so a dict of str gives a numpy str array, a dict of int an int64 array)."""
    if isinstance(samples[0], dict):
        return {k: np.stack([s[k] for s in samples]) for k in samples[0]}
    return np.stack(samples)


# ---------------------------------------------------------------------------------------------
# vision: dict samples

IMAGE_SHAPE = (3, 224, 224)


class VisionDataset(Dataset):
    def __init__(self, length: int):
        self.image = (np.arange(np.prod(IMAGE_SHAPE)) % 251).astype(np.uint8).reshape(IMAGE_SHAPE)
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return {"image": self.image, "label": i % 1000, "name": f"img_{i:08d}.jpg"}


def vision_numpy_collate(samples):
    return {
        "image": np.stack([s["image"] for s in samples]),
        "label": np.array([s["label"] for s in samples], dtype=np.int64),
        "name": [s["name"] for s in samples],
    }


# ---------------------------------------------------------------------------------------------
# epochs / rows: map-style datasets with slow samples

EPOCHS_FETCH_S = 0.003  # per sample
EPOCHS_SHAPE = (1000, 150)
EPOCHS_BATCH = 32
EPOCHS_N = 3  # epochs per run (one loader, persistent workers)
EPOCHS_BATCHES = 20  # per epoch
EPOCHS_SEED = 1234  # the sampler's torch.Generator: every transport sees the same order
EPOCHS_STEADY_FROM = 3  # the steady wait: batches 3.. of each epoch (0-based)


class SlowMapDataset(Dataset):
    """``length`` samples of ``shape`` float32 after ``fetch_s`` of sleep; sample ``i`` is
    the same array in every run and every loader (its own seeded generator)."""

    def __init__(self, length: int, shape=EPOCHS_SHAPE, fetch_s: float = EPOCHS_FETCH_S):
        self.length, self.shape, self.fetch_s = length, tuple(shape), fetch_s

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        time.sleep(self.fetch_s)
        return np.random.default_rng(i).random(self.shape, dtype=np.float32)


class SeedMapDataset(Dataset):
    """seed001's items behind ``__getitem__``: ``sleep(0.003125)`` then
    ``np.random.random(shape)`` (float64, as posted), so the per-batch work is seed001's and its
    work bound applies."""

    def __init__(self, length: int, shape=SEED_SHAPES["large"]):
        self.length, self.shape = length, tuple(shape)

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        time.sleep(SEED_FETCH_S)  # simulates data fetch time
        return np.random.random(self.shape)


# ---------------------------------------------------------------------------------------------
# points


@dataclass(frozen=True)
class Point:
    """One configuration that every transport runs in turn."""

    workload: str
    label: str  # short, unique within the workload: "64MiB", "large", ...
    batch_size: int
    batch_bytes: int  # bytes of array data per batch
    num_workers: int
    consumer: str  # "touch" | "read" | "step"
    warmup: int  # batches consumed before the clock starts (drains the prefetched ones)
    batches: int  # batches timed, at least
    params: dict = field(default_factory=dict, compare=False, hash=False)
    # The clock runs on past ``batches`` until it has run ``window_s`` (up to ``max_batches``
    # timed), for every transport alike: a fast transport's few batches would time a window of a
    # few ms, where scheduling noise and start-up swamp the rate.
    window_s: float = 0.0
    max_batches: int = 0

    @property
    def key(self) -> str:
        return f"{self.workload}/{self.label}/w{self.num_workers}/{self.consumer}"

    def dataset(self):
        if self.workload == "seed001":
            return MyIterableDataset(n=10000, shape=SEED_SHAPES[self.params["items"]])
        n = (self.warmup + max(self.batches, self.max_batches)) * self.batch_size
        if self.workload in ("transport", "small"):
            return PremadeDataset(self.batch_bytes // self.batch_size, n, distinct=self.batch_size)
        if self.workload == "paced":
            return PacedDataset(self.batch_bytes // self.batch_size, n, self.batch_size,
                                self.params["sample_s"], self.params.get("fresh", False))
        if self.workload == "vision":
            return VisionDataset(n)
        if self.workload == "epochs":
            return SlowMapDataset(self.params["epoch_batches"] * self.batch_size,
                                  self.params["shape"], self.params["fetch_s"])
        if self.workload == "rows":
            return SeedMapDataset(n, self.params["shape"])
        raise ValueError(f"unknown workload {self.workload!r}")

    def collate(self, kind: str):
        """``kind`` is "numpy" (the workload's own numpy collate), "default" (default_collate)
        or "np-stack" (:func:`np_stack_collate`, the same function for every workload)."""
        if kind == "default":
            return default_collate
        if kind == "np-stack":
            return np_stack_collate
        if kind != "numpy":
            raise ValueError(f"collate kind must be 'numpy', 'default' or 'np-stack', got {kind!r}")
        return {
            "seed001": collate_fn,
            "transport": stack_collate,
            "paced": stack_collate,
            "small": stack_collate,
            "vision": vision_numpy_collate,
            "epochs": np_stack_collate,
            "rows": np_stack_collate,
        }[self.workload]

    def loader_kwargs(self) -> dict:
        kw: dict = {"batch_size": self.batch_size, "num_workers": self.num_workers}
        if self.workload == "seed001" and self.num_workers > 0:
            kw.update(prefetch_factor=4, persistent_workers=True)
        if self.workload == "rows" and self.num_workers > 0:
            kw.update(prefetch_factor=4, persistent_workers=True)  # as seed001
        if self.workload == "epochs":
            import torch

            kw.update(shuffle=True, generator=torch.Generator().manual_seed(self.params["seed"]))
            if self.num_workers > 0:
                kw.update(persistent_workers=True)
        return kw

    @property
    def prefetched(self) -> int:
        """Batches a loader may have ready before the first one is consumed."""
        pf = self.loader_kwargs().get("prefetch_factor", 2)
        return self.num_workers * pf


def parse_size(text: str) -> int:
    """``"64MiB"``, ``"64M"``, ``"4KiB"``, ``"4k"``, ``"1048576"`` -> bytes."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    if t and t[-1] in mult:
        return int(float(t[:-1]) * mult[t[-1]])
    return int(t)


def size_label(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def steady_warmup(num_workers: int, prefetch_factor: int = 2) -> int:
    """Untimed batches before the clock starts: more than a loader can have prefetched, and more
    than shmloader's ring has slots (``num_workers * prefetch_factor`` in flight + 2 the consumer
    may hold), so that the one-time costs (start-up, each ring slot's creation) stay out of the
    steady-state figure. They are in ``ttfb_s`` and ``warmup_s`` instead.  Twice the ring's depth:
    shmloader creates a slot only when a finished batch needs one (NOTE [ Slot grants ]), so the
    last slots may be created a while after the start."""
    return max(2, 2 * (num_workers * prefetch_factor + 2) + 3)


def _timed_batches(batch_bytes: int, quick: bool) -> int:
    """Enough batches that a run takes long enough to time, few enough that 256 MiB stays short."""
    budget = (128 if quick else 1536) * MiB
    return int(min(200 if not quick else 40, max(6 if quick else 8, budget // batch_bytes)))


TIMED_WINDOW_S = 1.0  # the shortest timed window of a transport run (not --quick)
FASTEST_GBPS = 25.0  # above any transport measured here: sizes the dataset for the window


def _window(batch_bytes: int, quick: bool) -> dict:
    """Point fields for a timed window of at least TIMED_WINDOW_S (none with --quick)."""
    if quick:
        return {}
    most = int(TIMED_WINDOW_S * FASTEST_GBPS * 1e9 / batch_bytes) + 1
    return {"window_s": TIMED_WINDOW_S, "max_batches": min(20000, max(most, 8))}


def seed001_points(items=("large",), workers=(0, 2, 4, 6, 8), batches=16, warmup=5):
    out = []
    for it in items:
        shape = SEED_SHAPES[it]
        nbytes = SEED_BATCH * int(np.prod(shape)) * 8
        for w in workers:
            out.append(
                Point("seed001", it, SEED_BATCH, nbytes, w, "step", warmup, batches, {"items": it})
            )
    return out


def transport_points(sizes, workers=(2,), consumers=("touch", "read"), quick=False):
    out = []
    for size in sizes:
        if size % (16 * 4):
            raise ValueError(f"transport batch size must be a multiple of 64 bytes, got {size}")
        for w in workers:
            warmup = steady_warmup(w)
            for c in consumers:
                out.append(
                    Point("transport", size_label(size), 16, size, w, c, warmup,
                          _timed_batches(size, quick), {"samples_per_batch": 16},
                          **_window(size, quick))
                )
    return out


PACED_SAMPLE_S = 0.004  # 16 samples: 64 ms a batch per worker, ~32 ms a batch at 2 workers
PACED_SIZES = (1 * MiB, 256 * MiB)


def paced_points(sizes=PACED_SIZES, workers=(2,), quick=False):
    """The transport batches at a pace that keeps the loop waiting (see ``paced`` above), and
    the largest again with fresh samples."""
    sample_s = PACED_SAMPLE_S / (4 if quick else 1)
    variants = [(size, False) for size in sizes] + [(max(sizes), True)]
    return [
        Point("paced", size_label(size) + ("-fresh" if fresh else ""), 16, size, w, "touch",
              steady_warmup(w), 4 if quick else 20,
              {"samples_per_batch": 16, "sample_s": sample_s, **({"fresh": True} if fresh else {})},
              **_window(size, quick))
        for size, fresh in variants
        for w in workers
    ]


def small_points(workers=(2,), quick=False):
    return [
        Point("small", "4KiB", 32, 4096, w, "touch", max(50, steady_warmup(w)),
              300 if quick else 2000, {}, **_window(4096, quick))
        for w in workers
    ]


def vision_points(workers=(2,), consumers=("touch", "read"), quick=False):
    nbytes = 64 * int(np.prod(IMAGE_SHAPE)) + 64 * 8  # images + int64 labels
    return [
        Point("vision", "b64", 64, nbytes, w, c, steady_warmup(w), 20 if quick else 150, {},
              **_window(nbytes, quick))
        for w in workers
        for c in consumers
    ]


def epochs_points(workers=(4,), quick=False):
    """The epoch-boundary workload: one point per worker count; ``batches`` counts all epochs."""
    if quick:
        shape, batch, per_epoch, step_s, fetch_s = (10, 150), 8, 6, 0.01, 0.002
    else:
        shape, batch, per_epoch = EPOCHS_SHAPE, EPOCHS_BATCH, EPOCHS_BATCHES
        step_s, fetch_s = SEED_STEP_S, EPOCHS_FETCH_S
    nbytes = batch * int(np.prod(shape)) * 4
    return [
        Point("epochs", f"b{batch}", batch, nbytes, w, "step", 0, EPOCHS_N * per_epoch,
              {"epochs": EPOCHS_N, "epoch_batches": per_epoch, "shape": shape,
               "fetch_s": fetch_s, "step_s": step_s, "seed": EPOCHS_SEED,
               "steady_from": EPOCHS_STEADY_FROM, "dtype": "float32"})
        for w in workers
    ]


def rows_points(workers=(8,), quick=False, batches=16, warmup=5):
    """The sample-parallel workload: seed001's items map-style, timed as seed001 (5 + 16)."""
    items = "small" if quick else "large"
    shape = SEED_SHAPES[items]
    batch = 32 if quick else SEED_BATCH
    step_s = 0.01 if quick else SEED_STEP_S
    nbytes = batch * int(np.prod(shape)) * 8
    return [
        Point("rows", items, batch, nbytes, w, "step", warmup, batches,
              {"items": items, "shape": shape, "step_s": step_s, "dtype": "float64"})
        for w in workers
    ]


WORKLOADS = ("seed001", "transport", "small", "vision")
MODE_WORKLOADS = ("epochs", "rows")  # only where named (or -w all): see the module docstring
EXTRA_WORKLOADS = ("paced",)  # only where named (or -w all), with the point tables
DEFAULT_SIZES = (1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)
