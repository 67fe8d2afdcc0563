"""shmloader: a drop-in torch DataLoader that moves batches through shared memory, not pickles."""

from ._version import __version__
from .accelerate import accelerate_prepare
from .arena import empty_tensor
from .cuda import CudaUnavailableError
from .errors import (
    BatchShapeError,
    LayoutError,
    LoaderBrokenError,
    LoaderTimeoutError,
    MissingKeyError,
    NotATensorError,
    RingFullError,
    ShmCapacityError,
    ShmCapacityWarning,
    ShmLoaderError,
    SlotProtocolError,
    WorkerDiedError,
    WorkerError,
)
from .loader import LoaderStats, ShmDataLoader
from .prefetch import CudaPrefetcher

__all__ = [
    "__version__",
    "ShmDataLoader",
    "LoaderStats",
    "CudaPrefetcher",
    "accelerate_prepare",
    "empty_tensor",
    "CudaUnavailableError",
    "ShmLoaderError",
    "WorkerDiedError",
    "WorkerError",
    "LoaderTimeoutError",
    "LoaderBrokenError",
    "RingFullError",
    "ShmCapacityError",
    "ShmCapacityWarning",
    "LayoutError",
    "BatchShapeError",
    "MissingKeyError",
    "NotATensorError",
    "SlotProtocolError",
]
