"""Lightning and Accelerate on a GPU, as users run them: ShmDataLoader(pin_memory=True) handed to
`Trainer(accelerator="gpu")` and to `shmloader.accelerate_prepare(Accelerator())`, which move each
batch to the device themselves.  The batches a step sees are torch's DataLoader's, on the GPU.
Marked `cuda`: skipped without a CUDA device (run by tools/gpu_check.sh on a lent machine)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.utils.data import DataLoader

import shmloader
from shmloader import ShmDataLoader
from shmloader import cuda as shm_cuda

from . import _datasets as ds
from ._helpers import assert_same_batches, seeded

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(300),
]


def _tree_map(data, fn):
    """`data` with fn applied to every tensor leaf (dicts, lists and tuples rebuilt)."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, dict):
        return {k: _tree_map(v, fn) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_tree_map(v, fn) for v in data)
    return data


def _gpu_leaf_to_cpu(tensor):
    assert tensor.is_cuda, "a tensor leaf was not moved to the GPU"
    return tensor.cpu()


def _to_cpu(batch):
    """A batch the step saw on the GPU, back on the CPU (every tensor leaf must be on the GPU)."""
    return _tree_map(batch, _gpu_leaf_to_cpu)


def _cpu_copy(batch):
    """A CPU batch of torch's, detached from whatever memory it came in."""
    return _tree_map(batch, torch.clone)


def test_lightning_fit_on_one_gpu():
    L = pytest.importorskip("lightning")

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(60, 1)
            self.seen: list = []

        def training_step(self, batch, batch_idx):
            self.seen.append(_to_cpu(batch))
            return self.layer(batch["image"].reshape(len(batch["label"]), -1)).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    dataset = ds.DictDataset(n=32)
    kwargs = dict(batch_size=4, shuffle=True, num_workers=2, persistent_workers=True, pin_memory=True)
    train = ShmDataLoader(dataset, generator=seeded(5), **kwargs)
    model = Recorder()
    trainer = L.Trainer(accelerator="gpu", devices=1, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, train_dataloaders=train)
    ref = DataLoader(dataset, generator=seeded(5), **kwargs)
    assert_same_batches(model.seen, [_cpu_copy(b) for b in ref] + [_cpu_copy(b) for b in ref])
    assert train.stats().batches == 16
    del trainer, model, train, ref
    gc.collect()
    torch.cuda.synchronize()
    assert shm_cuda.live_registrations() == {}



def test_accelerate_prepare_on_one_gpu():
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator()
    assert accelerator.device.type == "cuda"
    dataset = ds.DictDataset(n=24)
    kwargs = dict(batch_size=4, shuffle=True, num_workers=2, pin_memory=True)
    shm = shmloader.accelerate_prepare(accelerator, ShmDataLoader(dataset, generator=seeded(9), **kwargs))
    ref = accelerator.prepare(DataLoader(dataset, generator=seeded(9), **kwargs))
    assert isinstance(shm, ShmDataLoader)
    for _ in range(2):
        got = [_to_cpu(b) for b in shm]
        want = [_to_cpu(b) for b in ref]
        assert_same_batches(got, want)
    assert shm.stats().batches == 6  # this epoch's iterator (workers not persistent)
    del shm, ref, got
    gc.collect()
    torch.cuda.synchronize()
    assert shm_cuda.live_registrations() == {}
