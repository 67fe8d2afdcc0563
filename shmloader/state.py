"""Resuming mid-epoch: `ShmDataLoader.state_dict()` / `load_state_dict()`, with the contract of
torchdata's `StatefulDataLoader`.

NOTE [ Resuming mid-epoch ]
  A state saved after k batches of an epoch, loaded into a loader built the same way (in a fresh
  process too) and iterated, yields the batches an uninterrupted run yields after batch k: the
  rest of that epoch, then the following epochs.  What it holds, and where each part comes from:

  * the sampler's position, as of the task of batch k-1 (tasks are sent ahead of the batches the
    loop has taken, so `IterState.on_index` records the position at each send and
    `on_delivered` keeps the one of the last batch delivered).  A sampler (or its iterator) with
    `state_dict`/`load_state_dict` is saved and loaded as torchdata does.  Any other sampler is
    *replayed*: the states of the torch generators it can draw from (its `generator`, the
    loader's `generator`, torch's global RNG) are taken just before the epoch's sampler iterator
    is made, and on resume they are put back, the iterator is made again and k batches of
    indices are skipped; torch's global RNG is put back only for that replay, so the resuming
    process's own global RNG is left as it was.  So `shuffle=True` resumes the epoch's
    permutation exactly, with or without a generator.  In process (num_workers=0) torch draws
    the first index at the first next(), not at iter(): the states are taken then (FIRST_INDEX),
    or, for a state saved before that next(), the first index is drawn when it is saved.
  * each worker's dataset state (torchdata's protocol: a dataset, or the iterator its `__iter__`
    returns, with `state_dict`/`load_state_dict`).  A worker takes it right after fetching a
    batch's samples and sends it ("state", epoch, n, state) ahead of the batch; the main process
    applies it only when batch n is delivered (a failed batch's is dropped, as torchdata does), so
    the saved state is the worker's as of the batches the loop has taken, not of those prefetched.
    A persistent worker sends its state again after each epoch's "resume" (the dataset object
    lives on and may have changed).  Nothing is sent for datasets without state.  On resume each
    worker loads its own state: dataset state, then iter(dataset), then the iterator's state.
  * which worker yielded batch k-1, so that batch k goes to the next one in turn (an iterable
    dataset's shards are per worker); the workers' base seed; whether the epoch had ended.
  * the iterator's epoch count, which sample_parallel=True seeds each row with (its iterator
    drives the same IterState hooks: NOTE [ Resuming a sample-parallel epoch ] in
    sample_parallel.py); 0 in the default mode, whose workers are seeded once.

  A loaded state whose epoch had ended starts the next epoch at the next iter(), as torchdata
  does; with workers its replayed sampler's generators are put where that epoch left them at
  load_state_dict() already, so that a re-seed before that iter() holds
  (`_generators_to_the_epochs_end`).  An iterable dataset without state is fast-forwarded (k batches fetched and dropped,
  with a warning), as torchdata does.  state_dict() before any iteration starts the iterator
  (and its workers) so that its seed is fixed; the next iter() uses that iterator (torchdata's
  behaviour).  The state carries FORMAT and the loader's configuration; a state of another
  format, of another loader kind or of a loader built differently in a way that matters is a
  ValueError naming both values, never a silent mismatch.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import warnings
from collections import deque
from typing import Any

import torch

from ._version import __version__
from .errors import safe_text
from .protocol import State
from .torch_private import DatasetKind as _DatasetKind
from .torch_private import InfiniteConstantSampler as _InfiniteConstantSampler
from .torch_private import SingleProcessDataLoaderIter as _SingleProcessDataLoaderIter

FORMAT = 3  # bump on any change to what a state holds or means; older ones are refused
FIRST_INDEX = "first index"  # in-process: the sampler's generators were taken at its first index
FORMAT_KEY = "shmloader_state_format"
_TORCHDATA_KEYS = ("_snapshot", "_num_yielded", "_steps_since_snapshot", "_index_sampler_state")
_KINDS = {_DatasetKind.Map: "map-style", _DatasetKind.Iterable: "iterable"}


# NOTE [ Which objects have a state ]
#   torchdata's `Stateful` protocol is duck-typed: state_dict() and load_state_dict().  torch's
#   DataLoader never calls them, and many datasets have methods of those names for something
#   else: an nn.Module (its weights: a dataset that holds a 32 MiB buffer sent its weights with
#   every batch, 24x slower than torch), or a streaming dataset whose state_dict() needs arguments
#   (MosaicML's, LitData's) or raises in a worker.  So an object counts as stateful only if it is
#   no nn.Module and its state_dict() can be called with no arguments; and a state_dict() that
#   raises never fails a batch: its error is kept in place of the state, and
#   ShmDataLoader.state_dict() raises it, naming the object, if asked for a state that needs it.
STATE_ERROR = "shmloader_state_error"


def is_stateful(obj: Any) -> bool:
    """torchdata's `Stateful` protocol, as NOTE [ Which objects have a state ] narrows it."""
    state_dict = getattr(obj, "state_dict", None)
    if not (callable(state_dict) and callable(getattr(obj, "load_state_dict", None))):
        return False
    if isinstance(obj, torch.nn.Module):
        return False
    kind = type(obj)
    takes_no_arguments = _NO_ARGUMENTS.get(kind)
    if takes_no_arguments is None or getattr(state_dict, "__func__", None) is not getattr(kind, "state_dict", None):
        try:
            signature = inspect.signature(state_dict)
            takes_no_arguments = all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                                     for p in signature.parameters.values())
        except (TypeError, ValueError):
            takes_no_arguments = True  # a builtin without a signature: taken at its word
        if getattr(state_dict, "__func__", None) is getattr(kind, "state_dict", None):
            _NO_ARGUMENTS[kind] = takes_no_arguments  # the class's own method: asked once a class
    return takes_no_arguments


_NO_ARGUMENTS: dict[type, bool] = {}


def _state_of(obj: Any):
    """obj.state_dict(), None without one, or its error (NOTE [ Which objects have a state ])."""
    if not is_stateful(obj):
        return None
    try:
        return obj.state_dict()
    except Exception as exc:
        return {STATE_ERROR: f"{_name(obj)}.state_dict() raised {type(exc).__name__}: {safe_text(exc)}"}


def _error_in(state: Any) -> str | None:
    return state.get(STATE_ERROR) if isinstance(state, dict) else None


def _load_into(obj: Any, saved: Any, what: str) -> None:
    if not is_stateful(obj):
        raise TypeError(
            f"the loaded state holds a state for the {what} but this {what} "
            f"({type(obj).__module__}.{type(obj).__qualname__}) has no load_state_dict(): build the "
            "loader with the dataset that saved the state"
        )
    obj.load_state_dict(saved)


# -- in a worker (or the main process when num_workers=0) ----------------------------------------


def capture(dataset_kind: int, dataset: Any, fetcher: Any) -> dict | None:
    """A worker's dataset state as torchdata takes it (None when nothing has state)."""
    if dataset_kind == _DatasetKind.Iterable:
        dataset_iter = fetcher.dataset_iter
        iter_state = _state_of(dataset_iter)
        dataset_state = _state_of(dataset) if dataset_iter is not dataset else None
        if iter_state is None and dataset_state is None:
            return None
        return {"dataset": dataset_state, "iterator": iter_state, "ended": bool(fetcher.ended)}
    dataset_state = _state_of(dataset)
    if dataset_state is None:
        return None
    return {"dataset": dataset_state, "iterator": None, "ended": False}


def restore_dataset(dataset_kind: int, dataset: Any, saved: dict | None, new_fetcher,
                    in_process: bool = False):
    """Load a worker's saved state in torchdata's order: the dataset's, then iter(dataset) (by
    `new_fetcher()`, which returns the fetcher), then the iterator's.  A worker always asks its
    stream for one more batch; in process (num_workers=0) a stream that had ended as the last
    batch was filled stays ended, so the resumed epoch ends there: both as torchdata does."""
    if saved is not None and saved.get("dataset") is not None:
        _load_into(dataset, saved["dataset"], "dataset")
    fetcher = new_fetcher()
    if saved is not None and dataset_kind == _DatasetKind.Iterable:
        if saved.get("iterator") is not None:
            _load_into(fetcher.dataset_iter, saved["iterator"], "dataset's iterator (iter(dataset))")
        fetcher.ended = bool(saved.get("ended")) if in_process else False
    return fetcher


def start_fetcher(worker, saved: dict | None) -> None:
    """worker.py's hook at start-up: a fresh fetcher, or one restored from `saved`."""
    def new_fetcher():
        worker._new_fetcher()
        return worker.fetcher

    restore_dataset(worker.spec.dataset_kind, worker.dataset, saved, new_fetcher)


def send_batch_state(worker, epoch: int, idx: int) -> None:
    """worker.py's hook after a batch's samples are fetched (or the stream ended)."""
    fetcher = worker.fetcher
    taken = capture(worker.spec.dataset_kind, fetcher.dataset, fetcher)
    if taken is not None:
        worker.channel.send(State(epoch, idx, taken))


def send_epoch_state(worker, epoch: int) -> None:
    """worker.py's hook after a persistent worker's "resume": its state at the epoch's start."""
    if worker.init_error is not None:
        return
    try:
        taken = capture(worker.spec.dataset_kind, worker.fetcher.dataset, worker.fetcher)
    except Exception as exc:  # reported with the next task, as a failed start is
        from .worker import exception_payload

        worker.init_error = ("saving the dataset's state (state_dict)", exception_payload(exc))
        return
    if taken is not None:
        worker.channel.send(State(epoch, -1, taken))


# -- the main process ------------------------------------------------------------------------------


def _name(obj: Any) -> str | None:
    return None if obj is None else f"{type(obj).__module__}.{type(obj).__qualname__}"


def _len(obj) -> int | None:
    try:
        return len(obj)
    except TypeError:
        return None


def _config(loader) -> dict:
    """What a state depends on, beyond the state itself: a loader that differs in one of these
    cannot resume it (`check`)."""
    is_map = loader._dataset_kind == _DatasetKind.Map
    return {
        "dataset_kind": _KINDS[loader._dataset_kind],
        "num_workers": loader.num_workers,
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "sampler": _name(loader.sampler),
        "batch_sampler": _name(loader.batch_sampler),
        "sampler_length": _len(loader.sampler) if is_map else None,
        "batches_per_epoch": _len(loader._index_sampler) if is_map else None,
        "sampler_generators": len(_sampler_generators(loader)),
        "generator": isinstance(loader.generator, torch.Generator),  # the one the permutation may come from
        # its workers seed each row, not each worker (in process, both modes are torch's)
        "sample_parallel": bool(getattr(loader, "sample_parallel", False)) and loader.num_workers > 0,
    }


def _chain_generators(loader) -> list[torch.Generator]:
    """The torch generators the index sampler exposes (`.generator`, following `.sampler`)."""
    found: list[torch.Generator] = []
    obj = loader._index_sampler
    for _ in range(4):
        if obj is None:
            break
        gen = getattr(obj, "generator", None)
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
            found.append(gen)
        obj = getattr(obj, "sampler", None)
    return found


def _sampler_generators(loader) -> list[torch.Generator]:
    """Those of the sampler's generators that are not the loader's own `generator`."""
    return [g for g in _chain_generators(loader) if g is not loader.generator]


def _capture_rng(loader) -> dict:
    return _rng_states(loader.generator, _sampler_generators(loader))


def _rng_states(generator, sampler_generators: list[torch.Generator]) -> dict:
    """The generators' states now, as clones (`_rng_saved` makes them tensors): taken at every
    epoch's start, and a clone costs a fraction of get_state()'s copy into a new tensor (about
    60 of a 0.5 ms iter() at an epoch's boundary, after a train step has left the caches cold)."""
    return {
        # not a Generator: torch's iterator raises its TypeError right after (random_(generator=))
        "loader": _snapshot(generator) if isinstance(generator, torch.Generator) else None,
        "samplers": [_snapshot(g) for g in sampler_generators],
        "global": _snapshot(torch.default_generator),
    }


def _snapshot(generator: torch.Generator):
    clone = getattr(generator, "clone_state", None)  # torch >= 2.4
    return clone() if clone is not None else generator.get_state()


def _rng_saved(rng: dict | None) -> dict | None:
    """`rng` with its snapshots as the state tensors a state_dict holds."""
    if rng is None:
        return None
    as_state = lambda s: s.get_state() if isinstance(s, torch.Generator) else s  # noqa: E731
    return {**rng, "loader": as_state(rng["loader"]), "samplers": [as_state(s) for s in rng["samplers"]],
            "global": as_state(rng["global"])}


def _draw_base_seed(loader) -> None:
    """What torch's base iterator draws after making the sampler iterator (the in-process
    iterator uses that first sampler iterator, so a replay draws it too)."""
    torch.empty((), dtype=torch.int64).random_(generator=loader.generator)


def _restore_sampler(it, loader, main: dict, rng: dict, single: bool) -> None:
    """Put the iterator's sampler where it was (NOTE [ Resuming mid-epoch ])."""
    if main.get("at_end"):  # replayed at load_state_dict (_generators_to_the_epochs_end)
        it._sampler_iter = iter(())
        return
    gen = loader.generator
    if is_stateful(it._index_sampler) or is_stateful(it._sampler_iter):
        # torchdata's way: the sampler restores itself (and the generators it draws from)
        if gen is not None and rng["loader"] is not None and all(g is not gen for g in _chain_generators(loader)):
            gen.set_state(rng["loader"])  # the loader's generator only seeds the workers
            if single:
                _draw_base_seed(loader)
        if is_stateful(it._index_sampler) and main["index_sampler"] is not None:
            it._index_sampler.load_state_dict(main["index_sampler"])
        it._sampler_iter = iter(it._index_sampler)
        if main["sampler_iter"] is not None and is_stateful(it._sampler_iter):
            it._sampler_iter.load_state_dict(main["sampler_iter"])
        return
    # a replay: the generators as they were when the epoch's sampler iterator was made
    if gen is not None and rng["loader"] is not None:
        gen.set_state(rng["loader"])
    for sampler_gen, saved in zip(_sampler_generators(loader), rng["samplers"]):
        sampler_gen.set_state(saved)
    with torch.random.fork_rng(devices=[]):  # torch's global RNG only for the replay
        torch.set_rng_state(rng["global"])
        sampler_iter = iter(it._index_sampler)
        if single and rng.get("at") != FIRST_INDEX:  # taken at iter(): before torch drew the seed
            _draw_base_seed(loader)
        skip = 0 if isinstance(it._index_sampler, _InfiniteConstantSampler) else main["yielded"]
        if skip:
            next(itertools.islice(sampler_iter, skip - 1, None), None)
        sampler_iter = _drawn(sampler_iter)  # under the saved global RNG
    it._sampler_iter = sampler_iter


def _drawn(sampler_iter):
    """`sampler_iter` with its first item drawn now: a sampler seeds its permutation at its first
    item (torch's RandomSampler without a generator, from the global RNG), so this fixes it at a
    point a replay can reproduce."""
    try:
        first = next(sampler_iter)
    except StopIteration:
        return iter(())
    return itertools.chain((first,), sampler_iter)


def check(saved: Any, loader) -> dict:
    """`saved` if this loader can resume from it; else a ValueError naming what differs."""
    where = "ShmDataLoader.load_state_dict"
    if not isinstance(saved, dict):
        raise ValueError(f"{where}: expected the dict state_dict() returned, got {type(saved).__name__}")
    if FORMAT_KEY not in saved:
        if any(key in saved for key in _TORCHDATA_KEYS):
            raise ValueError(
                f"{where}: this is a torchdata StatefulDataLoader state (keys {sorted(saved)[:6]}); "
                "ShmDataLoader reads only states saved by ShmDataLoader.state_dict()"
            )
        raise ValueError(
            f"{where}: not a ShmDataLoader state (no {FORMAT_KEY!r} key; keys {sorted(saved)[:6]})"
        )
    version = saved[FORMAT_KEY]
    if version != FORMAT:
        raise ValueError(
            f"{where}: the state has format {version} (saved by shmloader "
            f"{saved.get('shmloader_version', '?')}), this shmloader {__version__} reads format {FORMAT}. "
            + ("Resume with the shmloader version that saved it, or start the epoch over without "
               "load_state_dict." if version > FORMAT else
               "Resume with the shmloader version that saved it (then save again with this one), "
               "or start the epoch over without load_state_dict.")
        )
    was, now = saved["loader"], _config(loader)
    workers = saved["workers"]
    per_worker = now["dataset_kind"] == "iterable" or any(w is not None for w in workers)
    for key in now:
        if key == "num_workers" and not per_worker and (was[key] == 0) == (now[key] == 0):
            continue  # a map-style dataset without state resumes under any number of workers
        if key in ("sampler_length", "batches_per_epoch") and (was[key] is None or now[key] is None):
            continue
        if was[key] != now[key]:
            why = {
                "num_workers": "each worker's dataset state is its own" if per_worker else
                               "torch's in-process iterator draws its seed and sampler in another order",
                "sampler_generators": "the sampler draws from a different number of generators",
            }.get(key, "the saved position would mean other samples")
            raise ValueError(
                f"{where}: the state was saved by a loader with {key}={was[key]!r}, this loader has "
                f"{key}={now[key]!r} ({why}); build the loader with the arguments that saved the "
                "state, or start the epoch over without load_state_dict"
            )
    if now["dataset_kind"] == "map-style" and any(w is not None and w["dataset"] is not None for w in workers):
        if not is_stateful(loader.dataset):
            raise ValueError(f"{where}: the state holds the dataset's state but this dataset "
                             f"({_name(loader.dataset)}) has no load_state_dict()")
    return saved


class IterState:
    """One iterator's resumable state: what state_dict() returns, kept up to date as batches are
    delivered; and, for an iterator made after load_state_dict(), the state it resumes from."""

    def __init__(self, loader, single: bool):
        self.single = single
        self.kind = loader._dataset_kind
        self.config = _config(loader)
        self.in_order = getattr(loader, "in_order", True)
        self.num_workers = max(loader.num_workers, 1)
        self.resume: dict | None = getattr(loader, "_state_resume", None)
        loader._state_resume = None
        loader._state_tracker = self
        self.loaded: dict | None = None  # the state resumed from, while a fast-forward is pending
        self.workers: list = [None] * self.num_workers
        if self.resume is not None and len(self.resume["workers"]) == self.num_workers:
            self.workers = list(self.resume["workers"])
        self.pending: dict[int, tuple[int, Any]] = {}  # batch -> (worker, its state after it)
        self.sent: deque = deque()  # (task, sampler position after it), for tasks not delivered
        self.main = {"yielded": 0, "index_sampler": None, "sampler_iter": None}
        self.yielded = 0  # indices (batches) drawn from the sampler this epoch
        self.rng: dict | None = None
        self.epoch = 0  # the iterator's epoch count, which sample_parallel seeds rows with (0 otherwise)
        self.unsaved: str | None = None  # a part of the state this iterator cannot save (warned)
        self.steps = 0
        self.skip = 0
        self.finished = False
        self.last_worker = self.num_workers - 1
        self.base_seed: int | None = None
        self.len_called = None
        self.before_saving = None  # SingleProcessIter's hook: fix what a state saved now must fix

    @classmethod
    def attach(cls, it, loader) -> IterState:
        """A multi-worker iterator's tracker, made right after torch's base __init__ (its seed
        drawn) and before the workers start: a loaded state's seed replaces the drawn one."""
        tracker = cls(loader, single=False)
        if tracker.resume is not None:
            it._base_seed = tracker.resume["base_seed"]
        tracker.base_seed = it._base_seed
        return tracker

    def worker_resume(self, worker_id: int):
        return self.workers[worker_id] if self.resume is not None else None

    # -- hooks, in the order an epoch calls them ---------------------------------------------------

    def before_epoch(self, loader, first_iter: bool) -> None:
        """At the top of _reset: the RNG states the epoch's sampler iterator starts from."""
        self.rng = _capture_rng(loader)
        self.pending.clear()
        self.sent.clear()
        self.main = {"yielded": 0, "index_sampler": None, "sampler_iter": None}
        self.yielded = self.steps = self.skip = 0
        self.finished = False
        self.last_worker = self.num_workers - 1
        self.loaded = None
        if not first_iter:  # filled again by the persistent workers' "state" after "resume"
            self.workers = [None] * self.num_workers

    def before_prime(self, it, loader, first_iter: bool) -> dict | None:
        """Before the first tasks are sent: resume a loaded state (sampler, turn, counters).
        Returns the state resumed from (None if none), for what the iterator keeps itself."""
        self.len_called = it._IterableDataset_len_called
        saved, self.resume = self.resume, None
        if saved is None or not first_iter:  # the sampler's state at the epoch's start
            self.main = {"yielded": 0, "index_sampler": _state_of(it._index_sampler),
                         "sampler_iter": _state_of(it._sampler_iter)}
            return None
        self._restore_main(it, loader, saved)
        self.epoch = saved["epoch"]
        if self.skip:
            return saved  # fast-forward from the epoch's start, worker 0 first
        turns = getattr(it, "_worker_queue_idx_cycle", None)  # (sample_parallel has no turns)
        for _ in range(saved["last_worker"] + 1 if turns is not None else 0):
            next(turns)
        if saved["epoch_finished"] and self.kind == _DatasetKind.Iterable:
            it._workers_status = [False] * it._num_workers  # nothing to prime: the next iter() starts afresh
        return saved

    def _restore_main(self, it, loader, saved: dict) -> None:
        sampler = saved["sampler"]
        _restore_sampler(it, loader, sampler, sampler["rng"], self.single)
        self.rng = sampler["rng"]
        self.main = {k: sampler[k] for k in ("yielded", "index_sampler", "sampler_iter")}
        self.yielded = sampler["yielded"]
        self.len_called = it._IterableDataset_len_called = saved["iterable_len_called"]
        self.finished = saved["epoch_finished"]
        steps = saved["batches_yielded"]
        if (self.kind == _DatasetKind.Iterable and steps and not self.finished
                and all(w is None for w in saved["workers"])):
            warnings.warn(
                f"Neither the dataset nor iter(dataset) defines state_dict/load_state_dict, so the "
                f"loader fast-forwards by fetching and dropping {steps} batches. Implement them in "
                "your IterableDataset or its iterator for a faster resume.", UserWarning, stacklevel=5)
            self.skip, self.loaded = steps, saved
            self.yielded, self.main = 0, {"yielded": 0, "index_sampler": None, "sampler_iter": None}
            return
        it._num_yielded = self.steps = steps
        self.last_worker = saved["last_worker"]

    def on_index(self, it) -> None:
        """After each index drawn for a task (torchdata's per-send main snapshot)."""
        self.yielded += 1
        if self.single:
            return
        if is_stateful(it._index_sampler) or is_stateful(it._sampler_iter):
            self.sent.append((it._send_idx, self.yielded, _state_of(it._index_sampler), _state_of(it._sampler_iter)))
        else:
            self.sent.append((it._send_idx, self.yielded, None, None))

    def on_worker_state(self, it, worker_id: int, message) -> None:
        """A worker's State(epoch, batch, state): kept until that batch is delivered
        (batch -1: the worker's state at the epoch's start)."""
        epoch, idx, taken = message
        if epoch != it._epoch:
            return  # a stale epoch's
        if idx < 0:
            self.workers[worker_id] = taken
        else:
            self.pending[idx] = (worker_id, taken)

    def on_delivered(self, idx: int, worker_id: int, ok: bool) -> None:
        """Batch `idx` is handed to the loop (ok) or raised as the worker's error (not ok)."""
        if not ok:
            self.pending.pop(idx, None)
            return
        while self.sent and self.sent[0][0] <= idx:
            _, yielded, index_state, iter_state = self.sent.popleft()
            self.main = {"yielded": yielded, "index_sampler": index_state, "sampler_iter": iter_state}
        self._apply_pending(idx)
        self.last_worker = worker_id
        self.steps += 1

    def _apply_pending(self, upto: int | None) -> None:
        for n in sorted(self.pending):
            if upto is not None and n > upto:
                break
            worker_id, taken = self.pending.pop(n)
            self.workers[worker_id] = taken

    def next(self, it, step):
        """The iterator's __next__: a pending fast-forward first, then `step()`."""
        try:
            if self.skip:
                count, saved = self.skip, self.loaded
                while self.skip:  # counted down: a Ctrl-C meanwhile leaves the rest to skip
                    self._step(it, step)
                    self.skip -= 1
                self.loaded = None
                if self.last_worker != saved["last_worker"]:
                    raise ValueError(
                        f"after fast-forwarding {count} batches the last one came from worker "
                        f"{self.last_worker}, the saved state says worker {saved['last_worker']}: the "
                        "dataset does not yield what it yielded when the state was saved")
            return self._step(it, step)
        except StopIteration:
            self.finished = True
            if self.single:
                self._take_single(it)
            else:
                self._apply_pending(None)  # the ends of iterable streams
            raise

    def _step(self, it, step):
        data = step()
        if self.single:  # in process, the state is taken with each batch
            self.steps += 1
            self._take_single(it)
        return data

    def _take_single(self, it) -> None:
        self.main = {"yielded": self.yielded, "index_sampler": _state_of(it._index_sampler),
                     "sampler_iter": _state_of(it._sampler_iter)}
        self.workers = [capture(self.kind, it._dataset, it._dataset_fetcher)]

    # -- the state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        if not self.in_order:
            warnings.warn("ShmDataLoader with in_order=False gives no guarantee that a saved state "
                          "resumes where it was saved (nor does torchdata's StatefulDataLoader)",
                          UserWarning, stacklevel=3)
        if self.unsaved is not None:  # once an iterator (accelerate may ask at every batch)
            warnings.warn(self.unsaved, UserWarning, stacklevel=3)
            self.unsaved = None
        if self.loaded is not None:
            return copy.copy(self.loaded)  # a fast-forward is pending: the state is the loaded one
        if self.before_saving is not None:
            self.before_saving()
        parts = [self.main["index_sampler"], self.main["sampler_iter"]]
        parts += [part for worker in self.workers if worker is not None for part in (worker["dataset"], worker["iterator"])]
        for part in parts:
            error = _error_in(part)
            if error is not None:  # NOTE [ Which objects have a state ]
                raise RuntimeError(
                    f"ShmDataLoader.state_dict: cannot save the loader's position: {error}. Make "
                    "state_dict() work with no arguments, or rename it if it is not torchdata's "
                    "protocol (the batches themselves are not affected)")
        return {
            FORMAT_KEY: FORMAT,
            "shmloader_version": __version__,
            "loader": dict(self.config),
            "epoch_finished": self.finished,
            "batches_yielded": self.steps,
            "base_seed": self.base_seed,
            "epoch": self.epoch,
            "iterable_len_called": self.len_called,
            "sampler": {**self.main, "rng": _rng_saved(self.rng)},
            "last_worker": self.last_worker,
            "workers": list(self.workers),
        }


class SingleProcessIter(_SingleProcessDataLoaderIter):
    """torch's in-process iterator (num_workers=0), resumable."""

    def __init__(self, loader) -> None:
        self._rng_sources = (loader.generator, _sampler_generators(loader))
        tracker = IterState(loader, single=True)
        tracker.rng = _capture_rng(loader)  # before torch makes the sampler iterator and draws the seed
        super().__init__(loader)
        self._resumable = tracker
        tracker.base_seed = self._base_seed
        tracker.len_called = self._IterableDataset_len_called
        saved, tracker.resume = tracker.resume, None
        if saved is not None:
            self._base_seed = tracker.base_seed = saved["base_seed"]
            tracker._restore_main(self, loader, saved)
            if not tracker.skip:  # a fast-forward replays the stream from its start instead
                worker = saved["workers"][0] if len(saved["workers"]) == 1 else None
                self._dataset_fetcher = restore_dataset(self._dataset_kind, self._dataset, worker,
                                                        self._new_fetcher, in_process=True)
        elif not (is_stateful(self._index_sampler) or is_stateful(self._sampler_iter)):
            self._replay_from_first_index = True  # its generators' states taken then (_next_index)
            tracker.before_saving = self._fix_first_index
        if not tracker.skip:
            tracker._take_single(self)  # the state at the start (or as loaded)

    def _new_fetcher(self):
        return _DatasetKind.create_fetcher(self._dataset_kind, self._dataset, self._auto_collation,
                                           self._collate_fn, self._drop_last)

    _replay_from_first_index = False

    def _fix_first_index(self) -> None:
        """A state saved before the first next(): the sampler's first index is drawn now, so that
        the run and its resumption draw the same permutation (torchdata's behaviour)."""
        self._resumable.before_saving = None
        if self._replay_from_first_index:
            self._replay_from_first_index = False
            self._sampler_iter = _drawn(self._sampler_iter)  # the replay's rng: as at iter()

    def _next_index(self):
        if self._replay_from_first_index:
            # torch draws a sampler's first index at the first next(), not at iter(): what the
            # loop does in between (a seed set, a model made) shapes the permutation, so the
            # replay starts from the generators' states of this moment
            self._replay_from_first_index = False
            self._resumable.before_saving = None
            self._resumable.rng = {**_rng_states(*self._rng_sources), "at": FIRST_INDEX}
        index = super()._next_index()
        self._resumable.on_index(self)
        return index

    def __next__(self):
        return self._resumable.next(self, super().__next__)


# -- the loader's side ----------------------------------------------------------------------------


def loader_state_dict(loader) -> dict:
    """ShmDataLoader.state_dict(): the state of the current (or last) iterator; before any, start
    one (its seed drawn, its workers started) for the next iter() to use, as torchdata does."""
    tracker: IterState | None = getattr(loader, "_state_tracker", None)
    if tracker is None:
        iterator = loader._get_iterator()
        loader._state_prepared = iterator
        if loader.persistent_workers and loader.num_workers > 0:
            loader._iterator = iterator
        tracker = iterator._resumable
    return tracker.state_dict()


def _generators_to_the_epochs_end(loader, saved: dict) -> bool:
    """For a state saved after its epoch ended, with workers and a sampler that is replayed: put
    the generators the sampler draws from where that epoch left them, now, at load_state_dict().
    Replayed at the first iter() instead, as a state saved mid-epoch is, it would undo a re-seed
    made between load_state_dict() and that iter(), which the next epoch must see (an
    uninterrupted run re-seeds after the epoch's end too).  torch's global RNG is not changed
    (NOTE [ Resuming mid-epoch ]).  True where done."""
    if not saved["epoch_finished"] or loader.num_workers == 0 or loader._dataset_kind != _DatasetKind.Map:
        return False
    sampler = loader._index_sampler
    if is_stateful(sampler):
        return False
    rng = saved["sampler"]["rng"]
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(rng["global"])
        sampler_iter = iter(sampler)
        if is_stateful(sampler_iter):
            return False
        if loader.generator is not None and rng["loader"] is not None:
            loader.generator.set_state(rng["loader"])
        for sampler_gen, state in zip(_sampler_generators(loader), rng["samplers"]):
            sampler_gen.set_state(state)
        for _ in sampler_iter:  # the whole epoch, to its StopIteration
            pass
    return True


def load_loader_state(loader, saved: dict) -> None:
    """ShmDataLoader.load_state_dict(): the next iterator resumes from `saved` ({}: no-op)."""
    resume = None if saved == {} else check(saved, loader)
    if resume is not None and _generators_to_the_epochs_end(loader, resume):
        resume = {**resume, "sampler": {**resume["sampler"], "at_end": True}}
    loader._iterator = None
    loader._state_prepared = None
    loader._state_tracker = None
    loader._state_resume = resume


def start_epoch(loader, make):
    """ShmDataLoader.__iter__: the iterator state_dict() started, else `make()`; a resumed
    iterator whose epoch had ended goes on to the next epoch at once (torchdata's behaviour)."""
    iterator = getattr(loader, "_state_prepared", None)
    loader._state_prepared = None
    if iterator is None:
        iterator = make()
    if iterator._resumable.finished:
        if loader.persistent_workers and loader.num_workers > 0:
            iterator._reset(loader)
        else:
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            iterator = loader._get_iterator()
    return iterator
