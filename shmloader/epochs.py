"""Cross-epoch prefetch: forecast the first items of the next epoch's index sampler, so that
persistent workers can be kept busy across an epoch's end instead of draining.

torch's DataLoader with `persistent_workers=True` lets its pipeline run dry at every epoch end:
the next epoch's first tasks are sent only when the loop calls iter(loader) again. This module
tells the loader what those tasks will be, without touching the real sampler or any global RNG,
and checks the guess against what the sampler really yields.

NOTE [ Cross-epoch prefetch ]
  When the main process has drawn the last index of epoch e (its sampler iterator has raised
  StopIteration), `forecast(index_sampler, K)` returns the first K items (K = prefetch_factor x
  num_workers) that a fresh `iter(index_sampler)` would yield if it were made now. It draws them
  from a deep copy of the index sampler (the batch sampler with automatic batching, else the
  sampler), with the dataset passed in `memo` so the copy shares it instead of copying (a
  sampler's data_source may be huge, or not copyable at all), and with its large numpy arrays
  shared read-only (`_share_read_only`: an index table is not copied at every epoch's end; a
  sampler that writes to one is drawn again from a whole copy). The states of torch's global CPU
  RNG, Python's `random` and numpy's global RNG are saved before the draw and put back after it,
  so that nothing the rest of the process sees changes: a copy's generators are its own, and a
  draw from a global RNG (RandomSampler without a generator draws its seed from torch's) is undone.
  A sampler that cannot be copied, one that raises while drawing, or one without a length (an
  infinite sampler such as torch's `_InfiniteConstantSampler` for iterable datasets) gets no
  forecast (None).

  The loader sends the forecast items to the workers as epoch e+1's first tasks
  (`NextEpochPrefetch`, the iterator's side of this note, keeps that bookkeeping). When the loop
  calls iter(loader), the loader draws the real items as torch does, and for each position checks
  `matches(forecast item, real item)`: a prefetched batch is kept only where they are equal, and
  is otherwise dropped and the real item sent. So correctness never depends on the forecast; only
  the time saved does. It is right in the common cases:

  * a sampler whose randomness is its own (a `generator` argument, DistributedSampler's seed and
    epoch, a custom sampler's own `random.Random`): the copy continues from the same state;
  * RandomSampler (and the others) without a generator draw from torch's global RNG at their
    first item: the forecast is right if nothing else draws from that RNG between the forecast
    and the next epoch's first item. Anything that does (CPU dropout in the batches the loop
    still has to take after the last index was drawn, torch.rand in the loop, ...) makes the
    forecast differ, and nothing is kept;
  * DistributedSampler (or any sampler with `set_epoch()` and an int `epoch`, also the batch
    sampler's `.sampler`): the forecast assumes the user calls `set_epoch(epoch + 1)` before the
    next epoch, as is usual, and sets that on the copy only. A user who does not call it gets a
    forecast that does not match (or, with shuffle=False, one that matches because the order does
    not depend on the epoch), and nothing is prefetched wrongly.

  Make the forecast after the epoch's sampler iterator has raised StopIteration, not just after
  its last item: a sampler may still draw on its way to StopIteration (RandomSampler with a
  generator draws one more randperm/randint after its last item), and a forecast made before
  that draw does not match. Make it from the thread that draws the sampler's indices: the global
  RNG states are put back when the draw is done, so a draw another thread made meanwhile would be
  undone. CUDA RNG states are not saved (samplers draw on the CPU).
"""

from __future__ import annotations

import collections
import copy
import itertools
import numbers
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data.distributed import DistributedSampler

from . import torch_private
from .protocol import Rewind, Task

_CHAIN_DEPTH = 4  # how far `.sampler` / `.batch_sampler` are followed to find epoch holders


@dataclass(frozen=True)
class Forecast:
    """A forecast of an epoch's first items: made for loader epoch `epoch`, `items` as the
    sampler's copy yielded them (fewer than asked where the epoch is shorter)."""

    epoch: int
    items: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.items)

    def agrees(self, position: int, real_item: Any) -> bool:
        """Whether the item at `position` is the real one, i.e. its prefetched batch may be kept
        (False past the forecast's end)."""
        return 0 <= position < len(self.items) and matches(self.items[position], real_item)


def make(index_sampler: Any, count: int, epoch: int, *, dataset: Any = None) -> Forecast | None:
    """`forecast()` wrapped as a `Forecast` for loader epoch `epoch` (None: no forecast)."""
    items = forecast(index_sampler, count, dataset=dataset)
    return None if items is None else Forecast(epoch, items)


class NextEpochPrefetch:
    """The iterator's side of the forecast: at epoch e's end it sends epoch e+1's forecast first
    items as tasks (tagged -(e+1)), one per finished task; at e+1's prime it keeps those the
    sampler bears out, as a prefix, and has the workers undo the draws of the rest (Rewind).
    Their results that come in before e+1 begins wait aside until it does."""

    def __init__(self, enabled: bool, num_workers: int, count: int) -> None:
        self.enabled = enabled
        self._num_workers = num_workers
        self._count = count  # the tasks torch keeps in flight (prefetch_factor x num_workers)
        self._ahead: Forecast | None = None  # the next epoch's, while this one ends
        self._ahead_sent = 0  # of its items sent as tasks
        self._ahead_tried = False  # this epoch's forecast was made (or could not be)
        self._early: dict[int, tuple] = {}  # the next epoch's results, in before it began
        self._taken: Forecast | None = None  # during a prime: the last epoch's forecast ...
        self._taken_early: dict[int, tuple] = {}  # ... and its results
        self._adopting: Forecast | None = None  # the forecast the prime checks, item by item
        self._adoptable = 0  # during a prime: how many of its items were sent
        self.adopted: set[int] = set()  # this epoch's batches that were prefetched and kept
        self.prefetched = 0  # batches kept, in all epochs
        self.misses = 0  # forecasts the sampler did not bear out in full

    # -- epoch e's end ---------------------------------------------------------------------------

    def send_ahead(self, epoch: int, index_sampler: Any, dataset: Any, outstanding: int,
                   send_task: Callable[[int, Task], None], send_resume: Callable[[int], None]) -> None:
        """Epoch `epoch`'s indices are all sent: send the next epoch's next forecast item, while
        fewer than the tasks torch keeps in flight within an epoch are out (`outstanding`: this
        epoch's); the forecast is made at the first call."""
        if not self.enabled:
            return
        if not self._ahead_tried:
            self._ahead_tried = True
            self._ahead = make(index_sampler, self._count, epoch + 1, dataset=dataset)
            if self._ahead is not None and len(self._ahead):
                send_resume(epoch + 1)  # the workers see it after epoch e's last task
                torch_private.is_iter_datapipe(dataset)  # warm what the next _reset asks
        ahead = self._ahead
        if ahead is None or self._ahead_sent >= len(ahead) or outstanding + self._ahead_sent >= self._count:
            return
        position = self._ahead_sent
        send_task(position % self._num_workers,  # the worker the next epoch's prime will pick
                  Task(-ahead.epoch, position, ahead.items[position]))
        self._ahead_sent += 1

    def result_of(self, epoch_now: int, epoch: int, idx: int) -> str:
        """For a result tagged `epoch` that is not epoch `epoch_now`'s own: 'now' for a kept
        prefetched batch of this epoch, 'early' for one of the next epoch's forecast (kept aside
        until it begins), 'stale' for the rest."""
        if epoch == -epoch_now and idx in self.adopted:
            return "now"
        if self._ahead is not None and epoch == -self._ahead.epoch:
            return "early"
        return "stale"

    def keep_early(self, idx: int, worker_id: int, result) -> None:
        self._early[idx] = (worker_id, result)

    # -- epoch e+1's prime -----------------------------------------------------------------------

    def new_epoch(self) -> None:
        """At the top of the reset: no batch of the epoch is kept yet."""
        self.adopted = set()

    def start_prime(self, epoch: int) -> None:
        """Before `epoch`'s prime (after the workers' Resumed): the last forecast and its early
        results are taken aside to be checked; a short epoch may make the next one's forecast
        during this very prime."""
        self._taken, self._ahead, self._ahead_tried = self._ahead, None, False
        self._adopting = self._taken if self._taken is not None and self._taken.epoch == epoch else None
        self._adoptable, self._ahead_sent = self._ahead_sent, 0
        self._taken_early, self._early = self._early, {}

    def keeps(self, position: int, index: Any, worker_id: int, send: Callable) -> bool:
        """Whether the prime's task at `position` for `index` was sent ahead, to `worker_id`, with
        every earlier one kept too (a forecast is kept as a prefix, or not at all from there);
        where not, the workers undo the draws of the forecast's tasks from `position` on."""
        ahead = self._adopting
        if ahead is None:
            return False
        if (position < self._adoptable and len(self.adopted) == position
                and worker_id == position % self._num_workers and ahead.agrees(position, index)):
            self.adopted.add(position)
            return True
        if position < self._adoptable:  # the rest were drawn from a wrong forecast
            self._rewind(ahead, position, send)
        self._adopting = None
        return False

    def sampler_ended(self, position: int, send: Callable) -> None:
        """The sampler ended at `position`, before the forecast did (the epoch got shorter):
        before the next epoch's forecast is sent, undo the draws of the tasks past its end."""
        if self._adopting is not None and position < self._adoptable:
            self._rewind(self._adopting, position, send)

    def _rewind(self, ahead: Forecast, position: int, send: Callable) -> None:
        self._adopting = None
        for worker_id in range(self._num_workers):
            send(worker_id, Rewind(-ahead.epoch, position))

    def end_prime(self, events: collections.deque) -> None:
        """After the prime: the results of the kept batches join the epoch's `events`; those the
        sampler did not bear out are dropped (their slots go back as their leases die), and their
        tasks' late results are dropped as a stale epoch's."""
        taken, early = self._taken, self._taken_early
        self._taken, self._taken_early, self._adopting = None, {}, None
        if taken is not None and len(self.adopted) < self._adoptable:
            self.misses += 1
        self._adoptable = 0
        for idx in sorted(self.adopted):
            if idx in early:
                worker_id, result = early.pop(idx)
                events.append((idx, worker_id, result))
        self.prefetched += len(self.adopted)

    def drop(self) -> None:
        """The iterator breaks or shuts down: results kept aside are never delivered."""
        self._early.clear()
        self._taken_early.clear()


def forecast(index_sampler: Any, count: int, *, dataset: Any = None) -> list | None:
    """The first `count` items a fresh iter(index_sampler) would yield if made now (the whole
    epoch where it is shorter), drawn from a copy (NOTE [ Cross-epoch prefetch ]); None where
    the sampler has no length, or copying it or drawing from the copy raises.

    `dataset` is shared with the copy rather than copied. Neither `index_sampler` nor any global
    RNG is changed; epoch holders (DistributedSampler) of the copy are moved to their next epoch.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"forecast: count must be an int >= 0, got {count!r}")
    if not _sized(index_sampler):
        return None
    if count == 0:
        return []
    items = _draw(index_sampler, count, dataset, share=True)
    if items is _WROTE_SHARED:  # it writes to its arrays: a copy of its own, then
        items = _draw(index_sampler, count, dataset, share=False)
    return items


_WROTE_SHARED = object()


def _draw(index_sampler: Any, count: int, dataset: Any, share: bool):
    """forecast()'s draw from a copy, its large arrays shared read-only if `share`
    (_WROTE_SHARED where the copy wrote to one)."""
    saved = _save_rngs()
    memo = {} if dataset is None else {id(dataset): dataset}
    frozen = _share_read_only(index_sampler, memo) if share else []
    try:
        twin = copy.deepcopy(index_sampler, memo)
        holders = _epoch_holders(twin)
        for holder, epoch in holders:  # outermost first, each to its own epoch + 1
            holder.set_epoch(epoch + 1)
        return list(itertools.islice(iter(twin), count))
    except ValueError as exc:
        return _WROTE_SHARED if frozen and "read-only" in str(exc) else None
    except Exception:
        return None
    finally:
        _make_writeable(frozen)
        _restore_rngs(saved)


SHARED_MIN_BYTES = 1 << 20


def _make_writeable(arrays: list) -> None:
    """Undo _share_read_only: bases before their views, whatever the order they were met in."""
    left = list(arrays)
    for _ in range(len(left) + 1):
        failed = []
        for array in left:
            try:
                array.flags.writeable = True
            except ValueError:  # its base is still read-only: after the base
                failed.append(array)
        if not failed:
            return
        left = failed


def _share_read_only(obj: Any, memo: dict, depth: int = 3) -> list:
    """Large numpy arrays a sampler holds (an index table, weights), put in the deepcopy `memo`
    so that the copy shares them instead of copying them at every epoch's end, and made
    read-only until the forecast is drawn: a sampler that writes to one (shuffles it in place)
    raises in the copy, and is drawn again from a whole copy; the real array is never changed.
    Returns the arrays it made read-only, to make writeable again."""
    frozen: list = []
    seen: set = set()

    def visit(value, level):
        if id(value) in seen or id(value) in memo:
            return
        seen.add(id(value))
        if type(value) is np.ndarray:
            if value.nbytes >= SHARED_MIN_BYTES and not value.dtype.hasobject:
                if value.flags.writeable:
                    value.flags.writeable = False
                    frozen.append(value)
                memo[id(value)] = value
            return
        if level == 0:
            return
        if isinstance(value, (list, tuple)):
            items = value
        elif isinstance(value, dict):
            items = value.values()
        else:
            items = getattr(value, "__dict__", {}).values()
        for item in items:
            visit(item, level - 1)

    try:
        visit(obj, depth)
    except Exception:  # an odd object: what was shared stays shared, read-only until the end
        pass
    return frozen


def matches(forecast_item: Any, real_item: Any) -> bool:
    """Whether a forecast item is the real one: the same value and the same kinds of values (ints,
    numpy ints, lists, tuples, tensors and arrays of indices). False for anything that cannot be
    compared; never raises.

    Kinds count, not just values: the prefetched batch was fetched with the forecast item, so it
    stands for the real item only if the dataset would have been given the same thing (a tuple
    where a list was expected, or a numpy int where an int was, may be fetched differently). The
    copy yields what the real sampler yields, so this costs nothing in the common cases.
    """
    try:
        if type(forecast_item) is list and type(real_item) is list and _ints_only(forecast_item, real_item):
            return forecast_item == real_item  # a batch sampler's list of ints: in C, at each prime
        return _same(forecast_item, real_item)
    except Exception:
        return False


def _ints_only(a: list, b: list) -> bool:
    kinds = set(map(type, a))
    kinds.update(map(type, b))
    return kinds <= {int}


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
                and bool(torch.equal(a, b)))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, numbers.Integral) or hasattr(a, "__index__"):
        return operator.index(a) == operator.index(b)
    result = a == b
    return result if isinstance(result, bool) else False


def _sized(sampler: Any) -> bool:
    """Whether len(sampler) works (an infinite or unsized sampler has no forecast)."""
    if not hasattr(sampler, "__len__"):
        return False
    try:
        len(sampler)
    except Exception:
        return False
    return True


def _epoch_holders(sampler: Any) -> list[tuple[Any, int]]:
    """The samplers along `.sampler` / `.batch_sampler` (outermost first) that follow an epoch
    the user sets: DistributedSampler, or anything with set_epoch() and an int `epoch`; each with
    its epoch as of now (taken before any is set, as one may pass it on to those it wraps)."""
    found: list[tuple[Any, int]] = []
    seen: set[int] = set()
    level = [sampler]
    for _ in range(_CHAIN_DEPTH):
        following = []
        for obj in level:
            if obj is None or id(obj) in seen:
                continue
            seen.add(id(obj))
            epoch = getattr(obj, "epoch", None)
            settable = isinstance(obj, DistributedSampler) or callable(getattr(obj, "set_epoch", None))
            if settable and isinstance(epoch, int) and not isinstance(epoch, bool):
                found.append((obj, epoch))
            following += [getattr(obj, "sampler", None), getattr(obj, "batch_sampler", None)]
        level = following
    return found


def _save_rngs() -> tuple:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _restore_rngs(saved: tuple) -> None:
    torch_state, python_state, numpy_state = saved
    torch.set_rng_state(torch_state)
    random.setstate(python_state)
    np.random.set_state(numpy_state)
