"""Fork-awareness: what the main process owns must not stay open in a forked worker.

A forked worker inherits every fd of the main process: the other workers' sockets and the ring's
segments.  Left open, they keep a dead main process's peers from seeing EOF and they count
against the worker's fd limit.  Objects that only the main process may hold register here; a
worker started with fork closes them first thing (spawn and forkserver children inherit nothing).
"""

from __future__ import annotations

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
