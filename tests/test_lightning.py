"""PyTorch Lightning: `Trainer.fit` with ShmDataLoaders, on one CPU process and under
`strategy="ddp"` with two (gloo), where Lightning re-creates each loader with a DistributedSampler."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from shmloader import ShmDataLoader

from . import _datasets as ds
from ._helpers import assert_same_batches, collect, seeded
from ._launch import run_python


@pytest.fixture(scope="module")
def L():
    """The lightning package (an installed but broken one fails these tests, not collection)."""
    return pytest.importorskip("lightning")


def recorder(L):
    """A LightningModule that keeps a copy of every batch it trains and validates on, and the
    loaders it was given."""

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(60, 1)
            self.train_batches: list = []
            self.val_batches: list = []
            self.loaders: list = []

        def training_step(self, batch, batch_idx):
            self.train_batches.append(copy.deepcopy(batch))
            self.loaders.append(self.trainer.train_dataloader)
            return self.layer(batch["image"].reshape(len(batch["label"]), -1)).square().mean()

        def validation_step(self, batch, batch_idx):
            self.val_batches.append(copy.deepcopy(batch))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Recorder()


@pytest.mark.timeout(120)
def test_fit_on_one_process(L, no_leaks):
    """Without DDP Lightning iterates the loaders it is given: batches through slots, in torch's
    order (the loader's generator reshuffles each epoch as torch's does)."""
    dataset = ds.DictDataset(n=16)
    kwargs = dict(batch_size=4, shuffle=True, num_workers=2, persistent_workers=True)
    train = ShmDataLoader(dataset, generator=seeded(3), slot_bytes=1 << 16, **kwargs)
    val = ShmDataLoader(ds.DictDataset(n=8), batch_size=4, num_workers=1)
    model = recorder(L)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val)

    assert all(loader is train for loader in model.loaders)
    ref = torch.utils.data.DataLoader(dataset, generator=seeded(3), **kwargs)
    assert_same_batches(model.train_batches, collect(ref) + collect(ref))
    assert_same_batches(model.val_batches, 2 * collect(torch.utils.data.DataLoader(
        ds.DictDataset(n=8), batch_size=4, num_workers=1)))
    assert train.stats().batches == len(model.train_batches) == 8  # persistent: both epochs
    assert val.stats().batches == 2
    del trainer, model, train, val, ref


@pytest.mark.timeout(180)
def test_fit_with_ddp_on_two_processes(L, tmp_path):
    """`Trainer(strategy="ddp", accelerator="cpu", devices=2)`: each rank's re-created loaders
    are ShmDataLoaders with the slot arguments given, moved their batches through slots, and
    yielded exactly torch's DataLoader with the same DistributedSampler, epoch by epoch
    (tests/_lightning_script.py checks that per rank; here, the shards across ranks)."""
    run_python("-m", "tests._lightning_script", str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    from ._lightning_script import (
        BATCH,
        EPOCHS,
        MAX_RING_SLOTS,
        SLOT_BYTES,
        TRAIN_SAMPLES,
        VAL_SAMPLES,
    )

    for rank, seen in enumerate(ranks):
        assert seen["rank"] == rank
        for role, workers, shuffle in (("train", 2, True), ("val", 1, False)):
            for epoch, facts in enumerate(seen[role]):
                assert facts["type"] == "ShmDataLoader"
                assert (facts["slot_bytes"], facts["max_ring_slots"]) == (SLOT_BYTES, MAX_RING_SLOTS)
                assert facts["num_workers"] == workers
                assert facts["sampler"] == "DistributedSampler"
                assert (facts["sampler_rank"], facts["sampler_replicas"]) == (rank, 2)
                assert facts["sampler_shuffle"] is shuffle
                assert facts["stats_ring_bytes"] > 0
                per_epoch = seen[f"{role}_batches"][epoch]
                # the training loader's workers persist: its count runs on across epochs
                expected = per_epoch * (epoch + 1) if role == "train" else per_epoch
                assert facts["stats_batches"] == expected > 0
        assert seen["train_batches"] == [TRAIN_SAMPLES // 2 // BATCH] * EPOCHS
    for epoch in range(EPOCHS):
        shards = [seen["labels"][epoch] for seen in ranks]
        assert sorted(shards[0] + shards[1]) == list(range(TRAIN_SAMPLES))  # disjoint, complete
        val = [seen["val_labels"][epoch] for seen in ranks]
        assert sorted(val[0] + val[1]) == list(range(VAL_SAMPLES))
    for seen in ranks:
        assert seen["labels"][0] != seen["labels"][1]  # Lightning's set_epoch reshuffled


class ImagesAndLabels(torch.utils.data.Dataset):
    """What sample_parallel=True spreads over the workers: arrays and numbers (no str)."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return {"image": np.full((3, 4, 5), i, np.float32), "label": i}


@pytest.mark.timeout(120)
def test_fit_with_sample_parallel_and_lightnings_default_checkpointing(L, tmp_path, no_leaks):
    """Lightning saves the state of every loader that has state_dict/load_state_dict in the
    checkpoint it writes after each epoch: a sample_parallel loader's state goes in, and fit()
    runs through both epochs with the batches torch's loader gives."""
    dataset = ImagesAndLabels()
    train = ShmDataLoader(dataset, batch_size=4, shuffle=True, num_workers=2, generator=seeded(3),
                          sample_parallel=True)
    model = recorder(L)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, num_sanity_val_steps=0,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))  # checkpointing left on, as by default
    trainer.fit(model, train_dataloaders=train)
    assert trainer.current_epoch == 2 and len(model.train_batches) == 8
    checkpoints = list(tmp_path.rglob("*.ckpt"))
    assert checkpoints, "Lightning wrote no checkpoint"
    saved = repr(torch.load(checkpoints[0], weights_only=False))
    assert "'shmloader_state_format'" in saved and "'sample_parallel': True" in saved, saved[:2000]
    ref = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True, generator=seeded(3))
    assert [b["label"].tolist() for b in model.train_batches] == [b["label"].tolist() for b in collect(ref) + collect(ref)]
    del trainer, model, train
