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
#   (gc.freeze: never examined by its collector, so also never written to, which keeps those pages
#   shared) before it turns collection back on.  Objects the worker makes are collected as usual.

_collect_after_fork = True


@contextlib.contextmanager
def no_collection_across_fork():
    """Around a fork: the child starts with collection off (NOTE [ The parent's garbage ])."""
    global _collect_after_fork
    _collect_after_fork = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if _collect_after_fork:
            gc.enable()


def freeze_inherited_objects() -> None:
    """In a forked worker, first thing: what the parent left stays out of this collector's reach."""
    gc.freeze()
    if _collect_after_fork:
        gc.enable()
