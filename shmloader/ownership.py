"""Fork-awareness: what the main process owns must not stay open in a forked worker.

A forked worker inherits every fd of the main process: the other workers' sockets and the ring's
segments.  Left open, they keep a dead main process's peers from seeing EOF and they count
against the worker's fd limit.  Objects that only the main process may hold register here; a
worker started with fork closes them first thing (spawn and forkserver children inherit nothing).

It also inherits the main process's garbage -- NOTE [ The parent's garbage ].
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from typing import Protocol


class ParentOnly(Protocol):
    def close_in_child(self) -> None: ...


_parent_only: weakref.WeakSet[ParentOnly] = weakref.WeakSet()


def register_parent_only(obj: ParentOnly) -> None:
    _parent_only.add(obj)


def close_parent_only_in_child() -> None:
    """Called by a freshly forked worker before anything else."""
    for obj in list(_parent_only):
        obj.close_in_child()
    _parent_only.clear()


# NOTE [ The parent's garbage ]
#   A forked worker inherits every object of the main process, its unreachable reference cycles
#   too.  Left to the worker's garbage collector, their finalizers would run in the worker: a CUDA
#   tensor that a loop dropped in a cycle (a traceback, an autograd graph) is freed there through
#   CUDA, which cannot work after fork, and the worker aborts ("CUDA error: initialization
#   error", SIGABRT; seen on an H200 with CudaPrefetcher's record_stream'd batches).  Any other
#   finalizer of the parent's (a file flushed twice, a lock file removed) would run twice.  So the
#   parent forks with collection off, and the worker, first thing, freezes what it inherited
#   (gc.freeze: never examined by its collector) before it turns collection back on, if the user
#   had it on.  Objects the worker makes are collected as usual.  The cost: an inherited object
#   in a cycle that becomes garbage in the worker is never collected there (its pages are the
#   parent's, shared until written); one freed by its reference count is freed as usual.
#
#   Loaders may start workers from several threads at once (a validation loader in a thread of its
#   own): collection is turned off by the first fork under way and back on by the last, so that
#   the user's setting is what it was before, whatever the interleaving.

_fork_lock = threading.Lock()
_forks_under_way = 0
_collect_after_fork = True  # the user's setting when the first fork under way began


@contextlib.contextmanager
def no_collection_across_fork():
    """Around a fork: the child starts with collection off (NOTE [ The parent's garbage ])."""
    global _forks_under_way, _collect_after_fork
    with _fork_lock:
        if _forks_under_way == 0:
            _collect_after_fork = gc.isenabled()
            gc.disable()
        _forks_under_way += 1
    try:
        yield
    finally:
        with _fork_lock:
            _forks_under_way -= 1
            if _forks_under_way == 0 and _collect_after_fork:
                gc.enable()


def freeze_inherited_objects() -> None:
    """In a forked worker, first thing: what the parent left stays out of this collector's reach.
    The fork bookkeeping starts afresh (another thread of the parent may have held its lock)."""
    global _fork_lock, _forks_under_way
    _fork_lock, _forks_under_way = threading.Lock(), 0
    gc.freeze()
    if _collect_after_fork:
        gc.enable()
