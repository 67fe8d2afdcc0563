"""Run by tests/test_lightning.py as `python -m tests._lightning_script OUT_DIR`: `Trainer.fit` with
`strategy="ddp"` on two CPU processes (gloo), which re-runs this module for rank 1.  Under DDP
Lightning re-creates each loader with a DistributedSampler, from its `__init__` arguments: the
training loader is passed to `fit` (re-created from its attributes), the validation loader is made
in the `val_dataloader` hook (re-created from the arguments Lightning recorded).

Each rank checks that the loaders it trained and validated with are ShmDataLoaders with the slot
arguments given, whose batches came through slots (`stats()`), equal batch for batch to torch's
DataLoader with the same DistributedSampler (and `set_epoch` for each epoch), and writes what it
saw to OUT_DIR/rank<r>.json for the test to check that the shards cover the dataset."""

from __future__ import annotations

import copy
import json
import os
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

from shmloader import ShmDataLoader

from . import _datasets as ds
from ._helpers import assert_same_batches, collect

EPOCHS = 2
TRAIN_SAMPLES = 24
VAL_SAMPLES = 12
BATCH = 4
SLOT_BYTES = 1 << 16
MAX_RING_SLOTS = 11


def loader_facts(loader) -> dict:
    sampler = loader.sampler
    return {
        "type": type(loader).__name__,
        "slot_bytes": loader.slot_bytes,
        "max_ring_slots": loader.max_ring_slots,
        "num_workers": loader.num_workers,
        "sampler": type(sampler).__name__,
        "sampler_rank": sampler.rank,
        "sampler_replicas": sampler.num_replicas,
        "sampler_shuffle": sampler.shuffle,
        "stats_batches": loader.stats().batches,
        "stats_ring_bytes": loader.stats().ring_bytes,
    }


def reference(dataset, loader, epoch: int) -> list:
    """What torch's DataLoader gives with a DistributedSampler like the one Lightning injected."""
    used = loader.sampler
    sampler = DistributedSampler(dataset, num_replicas=used.num_replicas, rank=used.rank,
                                 shuffle=used.shuffle, seed=used.seed, drop_last=used.drop_last)
    sampler.set_epoch(epoch)
    return collect(DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=2))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(60, 1)
        self.train_batches: list[list] = [[] for _ in range(EPOCHS)]
        self.val_batches: list[list] = [[] for _ in range(EPOCHS)]
        self.train_facts: list[dict] = []
        self.val_facts: list[dict] = []

    def _loss(self, batch):
        return self.layer(batch["image"].reshape(len(batch["label"]), -1)).square().mean()

    def training_step(self, batch, batch_idx):
        self.train_batches[self.current_epoch].append(copy.deepcopy(batch))
        return self._loss(batch)

    def on_train_epoch_end(self):
        self.train_facts.append(loader_facts(self.trainer.train_dataloader))

    def validation_step(self, batch, batch_idx):
        self.val_batches[self.current_epoch].append(copy.deepcopy(batch))
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def on_validation_epoch_end(self):
        self.val_facts.append(loader_facts(self.trainer.val_dataloaders))

    def val_dataloader(self):
        self.val_made = ShmDataLoader(ds.DictDataset(n=VAL_SAMPLES), batch_size=BATCH,
                                      num_workers=1, slot_bytes=SLOT_BYTES,
                                      max_ring_slots=MAX_RING_SLOTS)
        return self.val_made

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(out_dir: str) -> None:
    train_set = ds.DictDataset(n=TRAIN_SAMPLES)
    train = ShmDataLoader(train_set, batch_size=BATCH, shuffle=True, num_workers=2,
                          persistent_workers=True, slot_bytes=SLOT_BYTES,
                          max_ring_slots=MAX_RING_SLOTS)
    model = Model()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=EPOCHS,
                        num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, train_dataloaders=train)

    rank = trainer.global_rank
    # The two ways Lightning re-creates a loader: from the arguments it recorded while the
    # `*_dataloader` hook ran (validation), from attributes named like `__init__`'s parameters
    # (training: the loader was made before `fit`).
    assert not hasattr(train, "__pl_saved_args") and hasattr(model.val_made, "__pl_saved_args")
    for made, used in ((train, trainer.train_dataloader), (model.val_made, trainer.val_dataloaders)):
        assert used is not made, "Lightning did not re-create the loader under DDP"
        assert made.stats() is None, "the loader Lightning was given was iterated itself"
    for epoch in range(EPOCHS):
        assert_same_batches(model.train_batches[epoch],
                            reference(train_set, trainer.train_dataloader, epoch))
        assert_same_batches(model.val_batches[epoch],
                            reference(trainer.val_dataloaders.dataset, trainer.val_dataloaders, 0))
    labels = [[int(x) for b in batches for x in b["label"]] for batches in model.train_batches]
    val_labels = [[int(x) for b in batches for x in b["label"]] for batches in model.val_batches]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as out:
        json.dump({"rank": rank, "labels": labels, "val_labels": val_labels,
                   "train": model.train_facts, "val": model.val_facts,
                   "train_batches": [len(b) for b in model.train_batches],
                   "val_batches": [len(b) for b in model.val_batches]}, out)
    # Rank 0 started the other rank (Lightning's launcher does not wait for it): wait here.
    for proc in getattr(trainer.strategy.launcher, "procs", []):
        if proc.wait(timeout=120) != 0:
            sys.exit(f"rank process {proc.pid} exited with status {proc.returncode}")


if __name__ == "__main__":
    main(sys.argv[1])
