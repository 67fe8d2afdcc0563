"""CUDA path, part 2: CudaPrefetcher, batches delivered on the GPU with the copy hidden.

    loader ──CPU batch n+depth (pinned slot)──▶ copy stream: non_blocking H2D, then event E(n+depth)
                                                     │
    user ◀── GPU batch n ◀── consumer stream waits on E(n); tensors record_stream(consumer)
    the CPU batch (and so its slot's lease) is kept until E has completed, then dropped

What one `next()` does:
  1. drop the CPU batches already handed over whose copy event has completed (query, no wait;
     beyond `depth` of them, wait on the oldest) -- NOTE [ Copy lease ];
  2. take the oldest batch in flight; make the caller's current stream wait on its event and
     mark its tensors as used by that stream (record_stream), so the caching allocator does not
     hand their memory to the copy stream while the caller's kernels still read it;
  3. start the copy of the next batch from the loader, so `depth` copies are in flight while the
     caller computes on this one; return the GPU batch.

NOTE [ Errors in order ]
  The loader's errors come at their batch's turn, as they would without the prefetcher: an
  exception raised while a later batch is fetched ahead (a dataset's error for batch n+depth,
  which the loader raises and then goes on) is kept until the batches before it are handed over,
  then raised; the next next() goes on after it.  A KeyboardInterrupt (a Ctrl-C while the
  loader is waited on) is raised at once, and a batch already taken for the caller is handed
  over by the next next(): a loop that catches it loses no batch.

NOTE [ Copy lease ]
  A slot's lease ends only when the copy out of it has completed -- never earlier: the prefetcher
  holds the CPU batch (whose views hold the SlotLease) until `event.query()` is true, or, at worst,
  until `event.synchronize()` returns (when too many are outstanding, at the end of an epoch, and
  when the iterator is closed or collected).  So no worker can write into bytes still being copied.
"""

from __future__ import annotations

import collections.abc
import copy as _copy
import warnings
from collections import deque
from typing import Any

import torch

from .cuda import CudaUnavailableError, Runtime, default_runtime


def _device_tree(data, move, tensors: list):
    """`data` with every tensor leaf replaced by move(leaf) (collected in `tensors`); other leaves
    (str, bytes, numbers, None, numpy arrays, ...) are returned as they are.  Containers are
    rebuilt as torch's pin_memory rebuilds them."""
    if isinstance(data, torch.Tensor):
        out = move(data)
        tensors.append(out)
        return out
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, collections.abc.Mapping):
        items = {k: _device_tree(v, move, tensors) for k, v in data.items()}
        if isinstance(data, collections.abc.MutableMapping):
            clone = _copy.copy(data)
            clone.update(items)
            return clone
        try:
            return type(data)(items)
        except TypeError:
            return items
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(_device_tree(v, move, tensors) for v in data))
    if isinstance(data, tuple):
        return tuple(_device_tree(v, move, tensors) for v in data)
    if isinstance(data, collections.abc.Sequence):
        items = [_device_tree(v, move, tensors) for v in data]
        if isinstance(data, list):
            return items
        try:
            return type(data)(items)
        except TypeError:
            return items
    return data


class _Copy:
    __slots__ = ("cpu", "gpu", "event", "tensors")

    def __init__(self, cpu, gpu, event, tensors):
        self.cpu, self.gpu, self.event, self.tensors = cpu, gpu, event, tensors


class CudaPrefetcher:
    """Wrap a loader so that it yields batches already on a CUDA device.

        loader = ShmDataLoader(ds, batch_size=64, num_workers=8, pin_memory=True)
        for batch in CudaPrefetcher(loader, device="cuda", depth=2):
            loss = model(batch["image"])            # already on the GPU

    Works over any iterable of batches (a torch DataLoader too).  Tensor leaves go to `device`
    with the same shape and dtype; everything else passes through unchanged.  With
    `non_blocking=True` (the default) copies are asynchronous when the source is page-locked
    (ShmDataLoader / DataLoader with pin_memory=True); from pageable memory CUDA stages them and
    they are not asynchronous, which is warned about once per iteration.  Either way the batch you
    get is safe to use on the current stream at the time of `next()`; to use it on another
    stream, make that stream wait on the current one.  `depth` batches are copied ahead (held in
    the loader's ring: a ShmDataLoader's ring grows for them within max_ring_slots).
    """

    def __init__(self, loader, device: Any = "cuda", depth: int = 2, *, non_blocking: bool = True,
                 runtime: Runtime | None = None):
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {depth!r}")
        if not isinstance(non_blocking, bool):
            raise TypeError(f"non_blocking must be a bool, got {non_blocking!r}")
        self.runtime = runtime if runtime is not None else default_runtime()
        if not self.runtime.available():
            raise CudaUnavailableError(
                f"CudaPrefetcher needs a CUDA device, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}); iterate the loader itself on a CPU-only machine"
            )
        self.device = self.runtime.resolve_device(device)
        self.loader = loader
        self.depth = depth
        self.non_blocking = non_blocking

    def __iter__(self) -> _PrefetchIter:
        return _PrefetchIter(self)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name):  # dataset, batch_size, sampler, stats(), ... of the loader
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


class _PrefetchIter:
    def __init__(self, owner: CudaPrefetcher):
        self._rt = owner.runtime
        self._device = owner.device
        self._depth = owner.depth
        self._non_blocking = owner.non_blocking
        self._source = iter(owner.loader)
        self._stream = self._rt.new_stream(self._device)
        self._inflight: deque[_Copy] = deque()  # copies started, batch not handed over yet
        self._handed: deque[_Copy] = deque()  # handed over; CPU batch kept until the event is done
        self._exhausted = False
        self._source_error: Exception | None = None  # NOTE [ Errors in order ]
        self._undelivered = None  # a GPU batch whose handing over a KeyboardInterrupt cut short
        self._warned_pageable = False
        self._fill()

    def __iter__(self):
        return self

    def __len__(self):
        return len(self._source)

    def _start_copy(self, cpu) -> _Copy:
        tensors: list = []
        sources: list = []

        def move(t):
            sources.append(t)
            return self._rt.copy(t, self._device, self._non_blocking)

        with self._rt.use_stream(self._stream):
            gpu = _device_tree(cpu, move, tensors)
            event = self._rt.new_event()
            event.record(self._stream)
        if self._non_blocking and not self._warned_pageable:
            for t in sources:
                if t.device.type == "cpu" and t.numel() and not self._rt.is_pinned(t):
                    self._warned_pageable = True
                    warnings.warn(
                        f"CudaPrefetcher: a {tuple(t.shape)} {t.dtype} batch leaf is in pageable "
                        "memory, so its copy cannot overlap compute; pass pin_memory=True to the loader",
                        RuntimeWarning, stacklevel=3,
                    )
                    break
        return _Copy(cpu, gpu, event, tensors)

    def _fill(self) -> None:
        while not self._exhausted and self._source_error is None and len(self._inflight) < self._depth:
            self._retire()
            try:
                cpu = next(self._source)
            except StopIteration:
                self._exhausted = True
                break
            except Exception as exc:  # NOTE [ Errors in order ]: at its batch's turn
                self._source_error = exc
                break
            self._inflight.append(self._start_copy(cpu))

    def _retire(self, wait: bool = False) -> None:
        """NOTE [ Copy lease ]: drop CPU batches whose copy has completed, oldest first."""
        while self._handed:
            entry = self._handed[0]
            if wait or len(self._handed) > self._depth:
                entry.event.synchronize()
            elif not entry.event.query():
                return
            self._handed.popleft()
            entry.cpu = None

    def __next__(self):
        if self._undelivered is not None:
            gpu, self._undelivered = self._undelivered, None
            return self._hand_over(gpu)
        self._retire()
        self._fill()
        if not self._inflight:
            if self._source_error is not None:
                error, self._source_error = self._source_error, None
                raise error
            self.close()
            raise StopIteration
        entry = self._inflight.popleft()
        consumer = self._rt.current_stream(self._device)
        self._rt.wait_event(consumer, entry.event)
        for t in entry.tensors:
            self._rt.record_stream(t, consumer)
        gpu, entry.gpu, entry.tensors = entry.gpu, None, None
        self._handed.append(entry)
        return self._hand_over(gpu)

    def _hand_over(self, gpu):
        """Start the next copy now, overlapping the caller's compute on `gpu`, and return `gpu`
        (NOTE [ Errors in order ]: kept for the next next() if a KeyboardInterrupt cuts in)."""
        try:
            self._fill()
        except BaseException:
            self._undelivered = gpu
            raise
        return gpu

    def close(self) -> None:
        """Wait for every outstanding copy, then drop the CPU batches (their slots go back)."""
        for entry in self._inflight:
            entry.event.synchronize()
        self._inflight.clear()
        self._retire(wait=True)
        self._exhausted = True
        self._undelivered = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
