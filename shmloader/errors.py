"""The exceptions shmloader raises, each naming the values involved and what to do.

All derive from the types torch's DataLoader raises in the same situation (RuntimeError for a
dead worker or a timeout, TypeError for an unsupported leaf) so existing `except` clauses keep
working.  Every class pickles with its fields, because workers raise some of them.
"""

from __future__ import annotations

import signal

_LIKELY_CAUSE = {
    signal.SIGKILL: "likely the out-of-memory killer: check `dmesg`, use fewer workers or smaller batches",
    signal.SIGBUS: "likely shared memory too small (/dev/shm): give the container more (docker --shm-size)",
    signal.SIGSEGV: "a segmentation fault in native code run by the dataset or collate_fn",
    signal.SIGABRT: "an abort in native code run by the dataset or collate_fn",
    signal.SIGTERM: "terminated from outside",
}


def safe_text(obj, *, as_repr: bool = False) -> str:
    """str(obj) (repr(obj) with `as_repr`), or a placeholder naming its type where that raises: an
    error path must not fail on a user's exception or leaf whose __str__/__repr__ raises (a worker
    would die of it, where torch's re-raises the exception and the epoch goes on)."""
    try:
        return repr(obj) if as_repr else str(obj)
    except Exception:
        return f"<{type(obj).__name__} object: {'repr' if as_repr else 'str'}() failed>"


def describe_exit(exitcode: int | None, status_lost: bool = False) -> str:
    """'killed by SIGKILL (likely ...)' or 'exited with status 3' for a process's exit code;
    `status_lost`: it has exited but the kernel reaped it (NOTE [ SIGCHLD ignored ] in pool.py)."""
    if status_lost:
        return ("has ended, its exit status unknown (this process ignores SIGCHLD, signal.SIG_IGN, "
                "perhaps inherited from its launcher, so the kernel reaped the worker without "
                "keeping its status; a SIGKILL from the out-of-memory killer is a common cause)")
    if exitcode is None:  # NOTE [ A sentinel closed by a live worker ] in pool.py
        return ("closed its connection to the main process (its socket and sentinel pipe) and is "
                "still running: it is stopped (does its code close file descriptors it did not "
                "open, as daemonizing code does?)")
    if exitcode < 0:
        try:
            sig = signal.Signals(-exitcode)
        except ValueError:
            return f"was killed by signal {-exitcode}"
        cause = _LIKELY_CAUSE.get(sig)
        return f"was killed by {sig.name}" + (f" ({cause})" if cause else "")
    return f"exited with status {exitcode}"


class ShmLoaderError(Exception):
    """Base of shmloader's own exceptions."""


class WorkerDiedError(ShmLoaderError, RuntimeError):
    """A worker process ended while the loader still needed it."""

    def __init__(self, worker_id: int, pid: int | None, exitcode: int | None, doing: str = "",
                 crash_report: str = "", status_lost: bool = False):
        self.worker_id, self.pid, self.exitcode = worker_id, pid, exitcode
        self.crash_report = crash_report
        self.status_lost = status_lost
        detail = f" while {doing}" if doing else ""
        report = f"\nThe worker's faulthandler report:\n{crash_report}" if crash_report else ""
        super().__init__(
            f"DataLoader worker {worker_id} (pid {pid}) {describe_exit(exitcode, status_lost)}"
            f"{detail}; the loader has been shut down{report}"
        )
        self._doing = doing

    def __reduce__(self):
        return (type(self), (self.worker_id, self.pid, self.exitcode, self._doing, self.crash_report,
                             self.status_lost))


class LoaderTimeoutError(ShmLoaderError, RuntimeError, TimeoutError):
    """No batch arrived within `timeout` seconds (torch raises RuntimeError here too)."""


class RingFullError(ShmLoaderError, RuntimeError):
    """The batches the training loop holds reach the cap it set (max_ring_slots / max_ring_bytes)."""


class LoaderBrokenError(ShmLoaderError, RuntimeError):
    """The first next() on an iterator that an earlier error shut down (a dead worker, Ctrl-C,
    a protocol error), naming that error; later ones raise StopIteration (NOTE [ Shutdown ] in
    pool.py).  An iterator that simply ended raises StopIteration."""


class ShmCapacityError(ShmLoaderError, MemoryError):
    """The ring (or a slot's growth) does not fit in the shared-memory filesystem."""

    def __init__(self, needed: int, free: int, path: str, what: str):
        self.needed, self.free, self.path, self.what = needed, free, path, what
        super().__init__(
            f"{what} needs {_fmt_bytes(needed)} ({needed} bytes) of shared memory but {path} has "
            f"{_fmt_bytes(free)} ({free} bytes) free. Lower prefetch_factor or num_workers, "
            f"pass a smaller slot_bytes or batch_size, free space in {path}, or give the "
            "container more shared memory (e.g. `docker run --shm-size=8g`)."
        )

    def __reduce__(self):
        return (type(self), (self.needed, self.free, self.path, self.what))


class NoRoomForSlot(Exception):
    """In a worker: the granted slot has no segment and /dev/shm no room for one, so the grant
    went back to the main process (NOTE [ No room for a worker's first slot ] in worker.py).
    Never reaches the user."""


class ShmCapacityWarning(UserWarning):
    """The whole ring does not fit in the shared-memory filesystem: it is fitted to the room
    there is, and fewer batches are prefetched (NOTE [ A ring fitted to /dev/shm ] in ring.py)."""


class LayoutError(ShmLoaderError, TypeError):
    """A batch contains a leaf that cannot travel through a slot; names the leaf's path."""


class BatchShapeError(ShmLoaderError, RuntimeError):
    """Samples disagree on a leaf's shape or dtype, so they cannot be stacked (torch.stack's case)."""


class NotATensorError(BatchShapeError, AttributeError):
    """A sample's leaf is not a tensor where the batch's first sample has one (sample_parallel=True):
    an AttributeError, as torch's default_collate raises then in a worker (it asks each numel())."""


class MissingKeyError(BatchShapeError, KeyError):
    """A dict sample lacks a key of the batch's first (sample_parallel=True): a KeyError, as torch's
    default_collate raises then, so `except KeyError` catches both."""

    __str__ = BaseException.__str__  # the message as written, not quoted as a KeyError's key


class SlotProtocolError(ShmLoaderError, RuntimeError):
    """A slot's header or descriptor is not what this process expects (stale, foreign, corrupt)."""


class WorkerError(ShmLoaderError, RuntimeError):
    """Stands for a worker's exception that could not be rebuilt with its own type."""


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback; attached as `__cause__` of re-raised exceptions."""

    def __init__(self, text: str):
        self.text = text
        super().__init__(text)

    def __str__(self) -> str:
        return self.text


def _fmt_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    raise AssertionError("unreachable")
