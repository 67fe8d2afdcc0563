"""Hugging Face Accelerate: `shmloader.accelerate_prepare` against accelerate's own
`accelerator.prepare`, on one CPU process and on two under torchrun (gloo)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader

import shmloader
from shmloader import ShmDataLoader

from . import _datasets as ds
from ._launch import run_python


@pytest.fixture(scope="module")
def accelerate():
    """The accelerate package (an installed but broken one fails these tests, not collection)."""
    return pytest.importorskip("accelerate")


def check_shards(ranks: list[dict]) -> None:
    """What tests/_accelerate_script.py saw on every rank: together the ranks cover the dataset
    once per epoch, each epoch in a new order, and the batches came through slots."""
    world = len(ranks)
    for rank, seen in enumerate(ranks):
        assert (seen["rank"], seen["world"]) == (rank, world)
        for case in ("shuffle", "seedable", "dispatch"):
            assert seen[case]["type"] == ("DataLoaderDispatcher" if case == "dispatch" else "DataLoaderShard")
        per_epoch = seen["shuffle"]["batches"]
        assert per_epoch == 32 // 4 // world
        # persistent workers: the count runs on across the two epochs; otherwise it restarts
        assert seen["shuffle"]["stats_batches"] == [per_epoch, 2 * per_epoch]
        assert seen["seedable"]["stats_batches"] == [per_epoch, per_epoch]
        # dispatch: the main process loads every batch (ShardedStream: 2 workers × 4 batches)
        assert seen["dispatch"]["stats_batches"] == ([8, 8] if rank == 0 else [0, 0])
    for case, n in (("shuffle", 32), ("seedable", 32), ("dispatch", 26)):
        for epoch in range(2):
            labels = [x for seen in ranks for x in seen[case]["labels"][epoch]]
            assert sorted(labels) == list(range(n)), (case, epoch)
        if case != "dispatch":
            for seen in ranks:
                assert seen[case]["labels"][0] != seen[case]["labels"][1], f"{case}: not reshuffled"


@pytest.mark.timeout(120)
def test_plain_prepare_drops_the_shared_memory_transport(accelerate, no_leaks):
    """Why accelerate_prepare exists: accelerate rebuilds the loader as a torch DataLoader."""
    accelerator = accelerate.Accelerator(cpu=True)
    loader = ShmDataLoader(ds.DictDataset(n=8), batch_size=4, num_workers=1)
    prepared = accelerator.prepare(loader)
    assert type(prepared.base_dataloader) is DataLoader
    assert not isinstance(prepared, ShmDataLoader)
    kept = shmloader.accelerate_prepare(accelerator, loader)
    assert type(kept) is type(prepared) and isinstance(kept, ShmDataLoader)
    assert [b["label"].tolist() for b in kept] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert kept.stats().batches == 2
    del prepared, kept, loader


@pytest.mark.timeout(120)
def test_prepare_returns_every_object_in_order(accelerate, no_leaks):
    """Like accelerator.prepare: models, optimizers and other objects come back as it returns
    them, in the order given; only the ShmDataLoader's base loader differs."""
    accelerator = accelerate.Accelerator(cpu=True)
    net = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    other = object()  # accelerate passes what it does not know through
    loader = ShmDataLoader(ds.DictDataset(n=4), batch_size=2, num_workers=1)
    got = shmloader.accelerate_prepare(accelerator, net, optimizer, loader, other)
    want = accelerator.prepare(net, optimizer, ShmDataLoader(ds.DictDataset(n=4), batch_size=2), other)
    assert [type(x) for x in got] == [type(x) for x in want]
    assert type(got[2].base_dataloader) is ShmDataLoader and got[3] is other
    del got, want, loader


@pytest.mark.timeout(150)
def test_one_process(accelerate, tmp_path, no_leaks):
    from . import _accelerate_script

    _accelerate_script.main(str(tmp_path))
    check_shards([json.loads((tmp_path / "rank0.json").read_text())])


@pytest.mark.timeout(180)
def test_two_processes_under_torchrun(accelerate, tmp_path):
    run_python("-m", "tests._accelerate_script", str(tmp_path), torchrun_ranks=2)
    check_shards([json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", [dict(sample_parallel=True),
                                  dict(prefetch_next_epoch=True, persistent_workers=True)])
def test_prepare_keeps_the_loaders_mode(accelerate, no_leaks, mode):
    """The rebuilt loader runs in the mode the user chose, as it keeps the slot arguments."""
    accelerator = accelerate.Accelerator(cpu=True)
    dataset = ds.ArrayDataset(n=8)
    loader = ShmDataLoader(dataset, batch_size=4, num_workers=2, **mode)
    kept = shmloader.accelerate_prepare(accelerator, loader)
    base = kept.base_dataloader
    assert all(getattr(base, name) == value for name, value in mode.items()), vars(base)
    assert [b.tolist() for b in kept] == [b.tolist() for b in DataLoader(dataset, batch_size=4)]
    del kept, base, loader
