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
import os
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
#   own).  Forks are serialized, and parent-only fds are opened, registered and closed under the
#   same lock (no_fork_meanwhile): a worker forked from one thread while another closed a pipe
#   found that fd closed (EBADF in close_in_child, the worker dead at start) or, had its number
#   been reused meanwhile, would have closed its own socket.

_fork_lock = threading.RLock()
_collect_after_fork = True  # the user's setting when the fork under way began
_forking_thread: int | None = None  # the thread forking a worker now (forking())


def no_fork_meanwhile():
    """Held while a parent-only fd is opened and registered, or closed (NOTE [ The parent's
    garbage ]): no worker is forked from another thread in between."""
    return _fork_lock


@contextlib.contextmanager
def forking():
    """Around a worker's start: one fork at a time, and under fork the child starts with
    collection off (NOTE [ The parent's garbage ])."""
    global _collect_after_fork, _forking_thread
    with _fork_lock:
        _collect_after_fork = gc.isenabled()
        gc.disable()
        _forking_thread = threading.get_ident()
        try:
            yield
        finally:
            _forking_thread = None
            if _collect_after_fork:
                gc.enable()


def forking_a_worker() -> bool:
    """Whether this thread is forking a worker of ours now (forking())."""
    return _forking_thread == threading.get_ident()


# NOTE [ A fork of the user's ]
#   A process the user forks (os.fork, a fork-started multiprocessing child) inherits this
#   module's state as it was in the forking thread's parent, other threads' too (loader.py's
#   NOTE [ A process forked by the user ] covers the loaders it inherits):
#   * _fork_lock, perhaps held by a thread that starts a loader's workers (a validation loader
#     in a thread of its own): that thread does not exist in the child, whose first iter() then
#     waited on the lock forever (7 of 60 forks in a test).  The child gets a new lock.
#   * the garbage collector turned off by that thread's forking(): turned back on.
#   * the parent's workers in multiprocessing's list of children: at the child's exit,
#     multiprocessing's atexit handler terminated those daemon processes, the parent's loader
#     then died with a SIGTERM'd worker.  They are the parent's, not the child's: struck off.
_parent_workers: weakref.WeakSet = weakref.WeakSet()


def register_worker(process) -> None:
    """A worker process of this process's, which a fork of the user's must not stop."""
    _parent_workers.add(process)


def _after_fork_in_child() -> None:
    global _fork_lock
    if _forking_thread == threading.get_ident():
        return  # a worker of ours, forked by forking(): freeze_inherited_objects() takes over
    _fork_lock = threading.RLock()
    if _forking_thread is not None and _collect_after_fork:
        gc.enable()
    import multiprocessing.process

    children = getattr(multiprocessing.process, "_children", None)
    if isinstance(children, set):
        children.difference_update(_parent_workers)
    _parent_workers.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def freeze_inherited_objects() -> None:
    """In a forked worker, first thing: what the parent left stays out of this collector's reach.
    The fork bookkeeping starts afresh (another thread of the parent may have held its lock)."""
    global _fork_lock
    _fork_lock = threading.RLock()
    gc.freeze()
    if _collect_after_fork:
        gc.enable()
