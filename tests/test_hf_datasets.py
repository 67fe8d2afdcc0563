"""Hugging Face `datasets` through ShmDataLoader: the batches are those of torch's DataLoader.

The real package (a test extra), not an imitation: an Arrow-backed `datasets.Dataset` answers
`__getitems__` for a whole batch (so torch's fetcher, and shmloader's workers, ask it once per
batch), returns numpy arrays or torch tensors after `with_format`, and runs a `with_transform`
function in the worker. The reference is torch's DataLoader with num_workers=0 (its workers can
run out of file descriptors on the plain-list format: "received 0 items of ancdata")."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from shmloader import ShmDataLoader

from ._helpers import assert_same_batches

datasets = pytest.importorskip("datasets")
tqdm = pytest.importorskip("tqdm")
tqdm.tqdm.monitor_interval = 0  # datasets' tqdm bars start a monitor thread that outlives a test

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]

SAMPLES = 48


def _table(fmt: str | None):
    rng = np.random.default_rng(0)
    table = datasets.Dataset.from_dict({
        "image": [rng.integers(0, 255, (3, 16, 16), dtype=np.uint8) for _ in range(SAMPLES)],
        "label": list(range(SAMPLES)),
        "text": [f"sample {i}" for i in range(SAMPLES)],
        "feature": [rng.random(8, dtype=np.float32) for _ in range(SAMPLES)],
    })
    return table.with_format(fmt) if fmt else table


def _scaled(batch: dict) -> dict:
    """A with_transform function, as image pipelines write them (run in the worker)."""
    images = [np.asarray(image, dtype=np.float32) / 255.0 for image in batch["image"]]
    return {"image": images, "label": batch["label"]}


def numpy_collate(samples: list[dict]) -> dict:
    return {key: [s[key] for s in samples] if key == "text" else np.stack([np.asarray(s[key]) for s in samples])
            for key in samples[0]}


CASES = {
    "numpy": lambda: _table("numpy"),
    "torch": lambda: _table("torch"),
    "lists": lambda: _table(None),
    "transform": lambda: _table(None).with_transform(_scaled),
}


def _epochs(loader, count: int = 2) -> list:
    return [batch for _ in range(count) for batch in loader]


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("shuffle", [False, True], ids=["plain", "shuffled"])
def test_the_batches_are_torchs(kind, shuffle):
    table = CASES[kind]()
    want = _epochs(DataLoader(table, batch_size=8, shuffle=shuffle, generator=torch.Generator().manual_seed(3)))
    loader = ShmDataLoader(table, batch_size=8, num_workers=2, shuffle=shuffle,
                           generator=torch.Generator().manual_seed(3))
    assert_same_batches(_epochs(loader), want)
    assert loader.stats().batches == SAMPLES // 8  # the latest epoch's iterator: through slots


@pytest.mark.parametrize("kind", ["numpy", "torch", "transform"])  # "lists": torch's workers run out of fds
def test_persistent_workers_with_the_next_epoch_prefetched_are_torchs(kind):
    """Against torch's own workers: a persistent iterator draws its base seed once, so the
    second epoch's order differs from an in-process loader's."""
    options = dict(batch_size=8, num_workers=2, shuffle=True, persistent_workers=True)
    want = _epochs(DataLoader(CASES[kind](), generator=torch.Generator().manual_seed(3), **options), 3)
    loader = ShmDataLoader(CASES[kind](), generator=torch.Generator().manual_seed(3), prefetch_next_epoch=True,
                           **options)
    assert_same_batches(_epochs(loader, 3), want)
    assert loader.stats().prefetched_next_epoch > 0


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_numpy_collate_gets_torchs_batches(kind):
    table = CASES[kind]()
    want = list(DataLoader(table, batch_size=8, collate_fn=numpy_collate))
    got = list(ShmDataLoader(table, batch_size=8, num_workers=2, collate_fn=numpy_collate))
    assert_same_batches(got, want)
    assert isinstance(got[0]["image"], np.ndarray)
