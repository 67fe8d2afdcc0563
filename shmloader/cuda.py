"""CUDA path, part 1: page-lock the ring's slots once, and fence their reuse.

NOTE [ Pinned slots ]
  With `pin_memory=True` on a CUDA machine the main process page-locks each slot segment's own
  mapping with cudaHostRegister, once, when it adopts the segment (a grown slot is a new segment,
  so it is registered again).  No batch is ever copied into pinned memory: the slot *is* pinned,
  and delivered CPU tensors report `is_pinned()`.  Rules:

  1. Per process.  Registration belongs to the process that made it (the pid is recorded); a
     forked worker that inherits a Segment object never calls CUDA for it.
  2. Undone before unmap.  `Segment.before_unmap` (called from the segment's deallocation, just
     before munmap) waits for the device (no DMA may still read the pages), then calls
     cudaHostUnregister.  A registration left behind would make a later registration at the same
     address fail (pytorch/pytorch#131270); `live_registrations()` lets tests prove none is.
  3. Never per batch.  Registering costs ~1-2 GB/s; it happens when a segment is adopted.
  4. A failed registration is a RuntimeWarning (naming the size and the CUDA error), not an
     error: the batches stay correct, their copies are just not asynchronous.

NOTE [ Release fence ]
  torch does not fence reuse of memory it did not allocate.  A training loop that does
  `x = batch.to("cuda", non_blocking=True)` and drops `batch` ends the slot's lease while the DMA
  out of it may still be queued behind the previous step's compute; a worker could then write the
  next batch into bytes still being copied.  So while slots are pinned, a dead lease does not go
  straight back to the ring: at the next `next()` the pinner records an event on the current
  CUDA stream (after every copy the loop enqueued there) and hands the slot back only once that
  event has completed (`pump`); when the ring would otherwise be full it waits on the events
  (`pump(wait=True)`).  Copies issued on other streams are the caller's to fence: CudaPrefetcher
  (shmloader/prefetch.py) fences its own.

All CUDA calls go through a small `Runtime` (the real one wraps torch.cuda; tests pass a fake), and
nothing here imports or probes CUDA until a pinner or a prefetcher is created.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import ShmLoaderError, SlotProtocolError

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


class CudaUnavailableError(ShmLoaderError, RuntimeError):
    """A CUDA-only feature was asked for where torch sees no CUDA device."""


class Event(Protocol):
    def record(self, stream: Any = None) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class Runtime(Protocol):
    """The CUDA calls shmloader makes; `CudaRuntime` is the real one, tests use a fake."""

    def available(self) -> bool: ...
    def host_register(self, address: int, size: int) -> int: ...  # 0, or a cudaError code
    def host_unregister(self, address: int) -> int: ...
    def synchronize(self) -> None: ...
    def new_event(self) -> Event: ...
    def new_stream(self, device: Any) -> Any: ...
    def current_stream(self, device: Any) -> Any: ...
    def use_stream(self, stream: Any) -> Any: ...  # a context manager
    def wait_event(self, stream: Any, event: Event) -> None: ...
    def record_stream(self, tensor: Any, stream: Any) -> None: ...
    def is_pinned(self, tensor: Any) -> bool: ...
    def copy(self, tensor: Any, device: Any, non_blocking: bool) -> Any: ...
    def resolve_device(self, device: Any) -> Any: ...


class CudaRuntime:
    """torch's CUDA bindings (torch.cuda.cudart() for cudaHostRegister/Unregister)."""

    def available(self) -> bool:
        import torch

        return torch.cuda.is_available()

    def host_register(self, address: int, size: int) -> int:
        import torch

        return int(torch.cuda.cudart().cudaHostRegister(address, size, HOST_REGISTER_PORTABLE))

    def host_unregister(self, address: int) -> int:
        import torch

        return int(torch.cuda.cudart().cudaHostUnregister(address))

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()

    def new_event(self) -> Event:
        import torch

        return torch.cuda.Event()

    def new_stream(self, device):
        import torch

        return torch.cuda.Stream(device)

    def current_stream(self, device):
        import torch

        return torch.cuda.current_stream(device)

    def use_stream(self, stream):
        import torch

        return torch.cuda.stream(stream)

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)

    def record_stream(self, tensor, stream) -> None:
        tensor.record_stream(stream)

    def is_pinned(self, tensor) -> bool:
        return tensor.is_pinned()

    def copy(self, tensor, device, non_blocking: bool):
        return tensor.to(device, non_blocking=non_blocking)

    def resolve_device(self, device):
        import torch

        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {str(device)!r}")
        return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


_default_runtime: Runtime | None = None


def default_runtime() -> Runtime:
    global _default_runtime
    if _default_runtime is None:
        _default_runtime = CudaRuntime()
    return _default_runtime


# address -> (pid, size) of every range this process registered and has not unregistered yet.
_registry: dict[int, tuple[int, int]] = {}
_registry_lock = threading.Lock()


def live_registrations() -> dict[int, int]:
    """address -> size of the slot mappings this process has page-locked and not yet unlocked."""
    pid = os.getpid()
    with _registry_lock:
        return {address: size for address, (owner, size) in _registry.items() if owner == pid}


@dataclass(frozen=True)
class PinStats:
    registered: int  # segments page-locked by this pinner
    unregistered: int  # ... and unlocked again (before their unmap)
    failed: int  # registrations CUDA refused (those slots stay pageable)
    registered_bytes: int
    fenced: int  # releases that waited for a fence event
    fence_waits: int  # times the ring was full and the pinner blocked on fence events

    @property
    def live(self) -> int:
        return self.registered - self.unregistered


class SlotPinner:
    """Page-locks slot segments once and fences their reuse (NOTE [ Pinned slots ],
    NOTE [ Release fence ]).  Created by the loader's iterator when torch decided to pin.

    device: the accelerator type torch chose ("cuda"; anything else is warned about and left
    unpinned, as shmloader only knows how to register memory with CUDA).
    """

    def __init__(self, device: str | None = "cuda", runtime: Runtime | None = None):
        self.device = device or "cuda"
        self.runtime = runtime if runtime is not None else default_runtime()
        self.active = self.device == "cuda"
        if not self.active:
            warnings.warn(
                f"pin_memory=True: shmloader page-locks its slots only for CUDA, not for "
                f"{self.device!r}; batches are delivered in pageable memory",
                RuntimeWarning, stacklevel=3,
            )
        self._pid = os.getpid()
        self._registered = 0
        self._unregistered = 0
        self._failed = 0
        self._bytes = 0
        self._fenced = 0
        self._fence_waits = 0
        self._warned = False
        self._release: Callable[[tuple[int, int]], Any] | None = None
        self._dead: deque[tuple[int, int]] = deque()  # leases ended, no event recorded yet
        self._fencing: deque[tuple[Event, list[tuple[int, int]]]] = deque()

    # -- registration ----------------------------------------------------------------------

    def pin(self, segment) -> None:
        """Page-lock `segment`'s mapping (once; again for a new, grown segment)."""
        if not self.active or segment.before_unmap is not None:
            return
        address, size = segment.address, segment.size
        with _registry_lock:
            stale = _registry.get(address)
        if stale is not None and stale[0] == self._pid:
            raise SlotProtocolError(
                f"slot memory at {address:#x} is still registered with CUDA ({stale[1]} bytes) "
                "although it was unmapped: a registration was not undone before munmap"
            )
        code = self.runtime.host_register(address, size)
        if code != 0:
            self._failed += 1
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"pin_memory=True: cudaHostRegister of a {size}-byte ring slot failed with "
                    f"cudaError {code}; that slot's batches stay in pageable memory (correct, but "
                    "their host-to-device copies are not asynchronous)",
                    RuntimeWarning, stacklevel=2,
                )
            return
        with _registry_lock:
            _registry[address] = (self._pid, size)
        self._registered += 1
        self._bytes += size
        segment.before_unmap = self._unpin

    def _unpin(self, segment) -> None:
        """Segment.before_unmap: wait for the device, then cudaHostUnregister (rule 2)."""
        if os.getpid() != self._pid:
            return  # a forked child's copy of the object: its mapping was never registered
        address = segment.address
        with _registry_lock:
            if address not in _registry:
                return
        try:
            self.runtime.synchronize()  # no DMA may still read these pages
        finally:
            try:
                self.runtime.host_unregister(address)
            finally:
                with _registry_lock:
                    _registry.pop(address, None)
                self._unregistered += 1

    # -- the release fence ---------------------------------------------------------------------

    def fence_releases(self, release: Callable[[tuple[int, int]], Any]) -> Callable[[tuple[int, int]], Any]:
        """Wrap the ring's release callback: a dead lease is queued here (a thread-safe append,
        as the ring's own callback is) and reaches the ring only through `pump`."""
        if not self.active:
            return release
        self._release = release
        return self._dead.append

    def pump(self, wait: bool = False) -> int:
        """Record one event after the loop's copies for the leases that died since the last call;
        give back to the ring the slots whose event has completed (all of them, waiting for their
        events, when `wait`).  Returns how many slots went back."""
        if self._release is None:
            return 0
        fresh = []
        while self._dead:
            fresh.append(self._dead.popleft())
        if fresh:
            event = self.runtime.new_event()
            event.record()  # on the current stream: after every copy enqueued there so far
            self._fencing.append((event, fresh))
            self._fenced += len(fresh)
        given = 0
        if wait and self._fencing:
            self._fence_waits += 1
        keep: deque[tuple[Event, list[tuple[int, int]]]] = deque()
        while self._fencing:
            event, keys = self._fencing.popleft()
            if wait:
                event.synchronize()
            elif not event.query():
                keep.append((event, keys))
                continue
            for key in keys:
                self._release(key)
            given += len(keys)
        self._fencing = keep
        return given

    def pending(self) -> int:
        """Slots whose lease has ended but that wait for their fence."""
        return len(self._dead) + sum(len(keys) for _, keys in self._fencing)

    def stats(self) -> PinStats:
        return PinStats(self._registered, self._unregistered, self._failed, self._bytes,
                        self._fenced, self._fence_waits)
