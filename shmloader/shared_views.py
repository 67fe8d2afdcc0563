"""Views of a storage already in shared memory: sent as torch sends them, by a handle.

NOTE [ Views of a storage already in shared memory ]
  A dataset may keep its data in shared memory itself: a tensor it called `share_memory_()` on
  (so that workers do not each copy it), or one it got through torch's multiprocessing.  When it
  returns slices of that tensor (`batch_size=None`, or a collate_fn that slices), torch's workers
  pickle each slice as the storage's fd, its offset and strides: the main process maps the
  storage (once, while any batch views it) and copies nothing.  shmloader used to copy each such
  slice into a slot: one copy of the bytes more, and ring slots torch does not hold (32 MiB
  slices of a 512 MiB tensor, 2 workers: 1.09x torch's peak memory, the first batch 0.07 s
  against 0.04-0.05; README, "A loss").

  So a worker sends such a view as torch does: the planner (layout.py) describes it as a "w"
  view on an "h" storage, the storage's fd travels with the batch's Ready message (SCM_RIGHTS,
  channel.py), and the main process maps it here; the batch's tensor views the dataset's memory,
  with torch's storage, storage_offset and strides.  It does so only where:
  * the storage is in shared memory under torch's file_descriptor strategy (torch_private's
    shared_memory_fd), not in one of the ring's slots;
  * the storage is larger than the bytes the view spans: the dataset's own tensor, not a batch
    made for this batch (a fresh segment torch's collate made inside a collate_fn is as large as
    its batch, and stays a copy, as every other batch does);
  * the view spans more than SHARED_VIEW_MIN_BYTES: a smaller one is copied (microseconds, and
    it holds no mapping of the dataset's storage while the loop keeps it, NOTE [ Small leaves
    are copies ] in layout.py);
  * the batch views at most MAX_STORAGES_PER_BATCH such storages (each is an fd of the batch's
    message); views of storages past those are copied;
  * pin_memory is off (a view of the dataset's memory is not page-locked; the slot is, and the
    copy into it is the one copy pinning costs anyway), and SHMLOADER_SHARED_VIEWS is not "0".
  As under torch, such a tensor is the dataset's memory: what the dataset (or the loop) writes
  into that storage later shows in the batch too.

  The main process keeps a weak reference to each storage it mapped, keyed by the shared-memory
  file (device, inode), as torch's unpickling does: the next batch that views the same storage
  while an earlier one is alive gets the same mapping, so its pages are not faulted in again.
"""

from __future__ import annotations

import os
import weakref

import torch

from . import torch_private
from .errors import SlotProtocolError

SHARED_VIEW_MIN_BYTES = 64 * 1024  # NOTE above: smaller views are copies, as small leaves are
# The storages one batch sends by handle, each an fd of its Ready message (channel.MAX_FDS, with
# a slot's segment); views of further storages are copied.
MAX_STORAGES_PER_BATCH = 32


def shared_views_enabled(pin_memory: bool) -> bool:
    """Whether workers send views of shared storages by handle (NOTE above)."""
    return not pin_memory and os.environ.get("SHMLOADER_SHARED_VIEWS", "1") != "0"


def span_bytes(tensor: torch.Tensor) -> int:
    """The bytes from a (non-empty, non-negatively strided) tensor's first element to its last."""
    extent = 1 + sum((n - 1) * step for n, step in zip(tensor.shape, tensor.stride()))
    return extent * tensor.element_size()


def handle_fd(tensor: torch.Tensor) -> int | None:
    """The fd to send `tensor`'s storage by (NOTE above: a view of a larger storage in shared
    memory, spanning more than SHARED_VIEW_MIN_BYTES), or None: the tensor is copied."""
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes <= SHARED_VIEW_MIN_BYTES or not storage.is_shared():  # most tensors: a microsecond
        return None
    span = span_bytes(tensor)
    if span <= SHARED_VIEW_MIN_BYTES or nbytes <= span:
        return None
    return torch_private.shared_memory_fd(storage)


class SharedStorages:
    """The main process's mappings of the storages workers sent by handle, weakly kept."""

    def __init__(self) -> None:
        self._mapped: dict[tuple[int, int], weakref.ref] = {}

    def adopt(self, fds: list[int], sizes: tuple[int, ...]) -> tuple[torch.UntypedStorage, ...]:
        """The storages behind `fds` (one per size in `sizes`), mapped here or found mapped
        already; closes every fd in `fds`, whatever happens."""
        try:
            if len(fds) != len(sizes):
                raise SlotProtocolError(f"a batch named {len(sizes)} shared storages and came with {len(fds)} fds")
            return tuple(self._storage(fd, nbytes) for fd, nbytes in zip(fds, sizes))
        finally:
            for fd in fds:
                os.close(fd)

    def _storage(self, fd: int, nbytes: int) -> torch.UntypedStorage:
        info = os.fstat(fd)
        if type(nbytes) is not int or not 0 < nbytes <= info.st_size:
            raise SlotProtocolError(f"a shared storage of {nbytes!r} bytes came with a file of {info.st_size} bytes")
        key = (info.st_dev, info.st_ino)
        known = self._mapped.get(key)
        storage = known() if known is not None else None
        if storage is None or storage.nbytes() != nbytes:
            storage = torch_private.storage_from_shared_fd(fd, nbytes)
            if len(self._mapped) > 64:  # forget the storages no batch views any more
                self._mapped = {k: ref for k, ref in self._mapped.items() if ref() is not None}
            self._mapped[key] = weakref.ref(storage)
        return storage

    def clear(self) -> None:
        self._mapped.clear()
