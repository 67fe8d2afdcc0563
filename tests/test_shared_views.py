"""Views of a tensor the dataset already put in shared memory come as torch delivers them: views
of that storage, sent by its fd, with no copy and no slot of their size (NOTE [ Views of a
storage already in shared memory ] in shmloader/shared_views.py).  Everything else is copied as
before: small views, whole shared tensors, storages shared under the file_system strategy,
pin_memory, SHMLOADER_SHARED_VIEWS=0.  No fd is left behind, held views outlive the loader, and
a Ready message whose storages do not match its fds is refused with its fds closed."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.multiprocessing
from torch.utils.data import DataLoader, Dataset

from shmloader import ShmDataLoader
from shmloader.errors import SlotProtocolError
from shmloader.shared_views import (
    MAX_STORAGES_PER_BATCH,
    SHARED_VIEW_MIN_BYTES,
    SharedStorages,
    shared_views_enabled,
)

from ._helpers import assert_same
from .conftest import open_fds

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]

ROWS, COLS = 256, 1024  # a slice: 1 MiB of float32


class SharedSlices(Dataset):
    """Item i: rows [i*ROWS, (i+1)*ROWS) of one float32 tensor in shared memory, as `view`
    makes them ("rows", "columns": a transposed slice, "pair": two views in a dict, "small": a
    view under SHARED_VIEW_MIN_BYTES, "whole": a shared tensor of its own per item)."""

    def __init__(self, items: int = 8, view: str = "rows"):
        self.items, self.view = items, view
        self.data = torch.arange(items * ROWS * COLS, dtype=torch.float32).reshape(items * ROWS, COLS).share_memory_()
        self.whole = [torch.full((ROWS, COLS), float(i)).share_memory_() for i in range(items)] if view == "whole" else None

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, i: int):
        rows = self.data[i * ROWS:(i + 1) * ROWS]
        if self.view == "columns":
            return rows.t()
        if self.view == "pair":
            return {"x": rows[:, :-1], "y": rows[:, 1:], "label": i, "mask": np.ones(8, dtype=bool)}
        if self.view == "small":
            return rows[:4]
        if self.view == "whole":
            return self.whole[i]
        return rows


def _both(dataset, **kwargs):
    kwargs.setdefault("num_workers", 2)
    kwargs.setdefault("batch_size", None)
    want = list(DataLoader(dataset, **kwargs))
    batches = iter(ShmDataLoader(dataset, **kwargs))
    got = list(batches)
    return got, want, batches.stats()


def _leaves(batch):
    return [batch["x"], batch["y"]] if isinstance(batch, dict) else [batch]


@pytest.mark.parametrize("view", ["rows", "columns", "pair"])
def test_views_of_a_shared_tensor_come_as_torch_delivers_them(view):
    """The same values, strides, storage offsets and storage sizes as torch's DataLoader: views
    of the dataset's storage, in shared memory; the slots hold only the descriptors."""
    dataset = SharedSlices(view=view)
    got, want, stats = _both(dataset)
    assert len(got) == len(want) == dataset.items
    for g, w in zip(got, want):
        assert_same(g, w)
        for gl, wl in zip(_leaves(g), _leaves(w)):
            assert gl.is_shared() and wl.is_shared()
            assert gl.storage_offset() == wl.storage_offset() and gl.stride() == wl.stride()
            assert gl.untyped_storage().nbytes() == wl.untyped_storage().nbytes() == dataset.data.untyped_storage().nbytes()
        if view == "pair":  # one storage, mapped once, for both views of the batch
            assert g["x"].untyped_storage().data_ptr() == g["y"].untyped_storage().data_ptr()
    assert stats.slot_bytes < SHARED_VIEW_MIN_BYTES, stats  # no slot of a batch's size: nothing copied
    # every batch views one mapping of the storage while the earlier ones are alive
    assert len({g.untyped_storage().data_ptr() for b in got for g in _leaves(b)}) == 1


@pytest.mark.parametrize("view", ["small", "whole"])
def test_small_views_and_whole_shared_tensors_are_copied(view):
    """A view of at most SHARED_VIEW_MIN_BYTES, and a shared tensor returned whole (no larger
    storage behind it: it may be a batch made for this batch), come as copies in a slot."""
    dataset = SharedSlices(view=view)
    got, want, stats = _both(dataset)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
        assert g.storage_offset() == 0 and g.untyped_storage().nbytes() == g.numel() * g.element_size()
    if view == "whole":
        assert stats.slot_bytes >= ROWS * COLS * 4, stats


def test_shared_views_turned_off_are_copies(monkeypatch):
    monkeypatch.setenv("SHMLOADER_SHARED_VIEWS", "0")
    dataset = SharedSlices()
    got, want, stats = _both(dataset)
    for g, w in zip(got, want):
        assert torch.equal(g, w) and g.storage_offset() == 0
    assert stats.slot_bytes >= ROWS * COLS * 4, stats
    assert not shared_views_enabled(pin_memory=False)


def test_pin_memory_takes_the_copy_into_a_page_locked_slot():
    assert not shared_views_enabled(pin_memory=True)
    assert shared_views_enabled(pin_memory=False)


_FILE_SYSTEM_SCRIPT = """
import torch, torch.multiprocessing
torch.multiprocessing.set_sharing_strategy("file_system")
from shmloader import ShmDataLoader
from tests.test_shared_views import ROWS, COLS, SharedSlices
dataset = SharedSlices(items=4)
batches = iter(ShmDataLoader(dataset, batch_size=None, num_workers=2))
got = list(batches)
assert all(torch.equal(g, dataset[i]) and g.storage_offset() == 0 for i, g in enumerate(got))
assert batches.stats().slot_bytes >= ROWS * COLS * 4
print("copied")
"""


def test_a_storage_shared_under_the_file_system_strategy_is_copied():
    """torch's other strategy keeps no fd to send: the views are copied, values intact (in a
    process of its own: that strategy starts torch's shared-memory manager, which outlives it)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _FILE_SYSTEM_SCRIPT], cwd=root, capture_output=True, text=True,
                          timeout=90)
    assert done.returncode == 0 and done.stdout.strip() == "copied", done.stderr[-2000:]


class ManyStorages(Dataset):
    """Item i: one 128 KiB slice of each of `storages` shared tensors of 256 KiB."""

    def __init__(self, storages: int):
        self.tensors = [torch.full((2, 32768), float(k)).share_memory_() for k in range(storages)]

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        return [t[i % 2] for t in self.tensors]


@pytest.mark.parametrize("storages", [5, MAX_STORAGES_PER_BATCH + 8])
def test_a_batch_viewing_many_storages_sends_the_first_ones_and_copies_the_rest(storages):
    """Each storage is an fd of the batch's message: past MAX_STORAGES_PER_BATCH its views are
    copied (a check found 4 storages refused as a dead worker and 5 hanging the loop)."""
    dataset = ManyStorages(storages)
    got, want, _ = _both(dataset, timeout=60)
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(g, w)) and len(g) == storages
        by_handle = [t.untyped_storage().nbytes() == 2 * t.numel() * 4 for t in g]
        assert by_handle == [k < MAX_STORAGES_PER_BATCH for k in range(storages)]


def test_held_views_outlive_the_loader_and_its_workers():
    dataset = SharedSlices()
    loader = ShmDataLoader(dataset, batch_size=None, num_workers=2)
    held = list(loader)
    expected = [t.clone() for t in held]
    del loader
    gc.collect()
    assert all(torch.equal(h, e) for h, e in zip(held, expected))


def test_writes_to_the_dataset_storage_show_in_the_batch_as_under_torch():
    """A view of shared memory is that memory, under torch and here alike."""
    dataset = SharedSlices(items=2)
    for loader_class in (DataLoader, ShmDataLoader):
        batch = next(iter(loader_class(dataset, batch_size=None, num_workers=1)))
        dataset.data[0, 0] = -1.0
        assert batch[0, 0].item() == -1.0, loader_class
        dataset.data[0, 0] = 0.0


def test_spawned_workers_send_the_storage_they_were_given():
    """Under spawn the dataset's storage reaches the workers as torch pickles it (an fd); their
    views come back as views of it."""
    dataset = SharedSlices(items=4)
    batches = iter(ShmDataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="spawn"))
    got = list(batches)
    assert all(torch.equal(g, dataset[i]) and g.storage_offset() == i * ROWS * COLS for i, g in enumerate(got))
    assert batches.stats().slot_bytes < SHARED_VIEW_MIN_BYTES


def test_no_fd_is_left_behind_over_many_batches_and_broken_epochs():
    """Each batch's fd is closed once mapped, a stale batch's too (an epoch broken off with
    persistent workers): the main process holds the dataset's own fd of the storage, and one
    more (its mapping's) while batches view it, however many batches came."""
    dataset = SharedSlices(items=64)
    storage_file = os.readlink(f"/proc/self/fd/{dataset.data.untyped_storage()._get_shared_fd()}")

    def fds_of_the_storage() -> int:
        return sum(target == storage_file for target in open_fds().values())

    assert fds_of_the_storage() == 1
    loader = ShmDataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=True, prefetch_factor=4)
    for epoch in range(6):
        for i, batch in enumerate(loader):
            assert torch.equal(batch, dataset[i])
            assert fds_of_the_storage() == 2
            if epoch % 2 and i == 3:
                break  # batches in flight become stale
    del batch, loader
    gc.collect()
    assert fds_of_the_storage() == 1


def test_storages_that_do_not_match_their_fds_are_refused_and_the_fds_closed():
    storages = SharedStorages()
    source = torch.zeros(1 << 16).share_memory_().untyped_storage()
    for sizes, count in (((source.nbytes(),), 2), ((source.nbytes() * 2,), 1), ((0,), 1)):
        fds = [os.dup(source._get_shared_fd()) for _ in range(count)]
        with pytest.raises(SlotProtocolError):
            storages.adopt(fds, sizes)
        for fd in fds:
            with pytest.raises(OSError):
                os.fstat(fd)
    fd = os.dup(source._get_shared_fd())
    mapped, = storages.adopt([fd], (source.nbytes(),))
    again, = storages.adopt([os.dup(source._get_shared_fd())], (source.nbytes(),))
    assert mapped is again  # one mapping while it is alive
