"""Holding batches behaves as with torch (NOTE [ Held batches ] in shmloader/ring.py).

`list(loader)`, `sorted(...)` of an epoch, two whole epochs compared, a loop that keeps every
batch, batches kept alive by reference cycles: all work with no cap by default, give torch's
batches, cost no file descriptor per held batch and no forced garbage collection, and the shared
memory goes back to the ring's working size once the batches are dropped, in the main process
and in the workers.  A cap is there only where the user asks for one.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader

import shmloader.ring
from bench import held as held_bench
from shmloader import RingFullError, ShmDataLoader

from . import _datasets as ds
from ._helpers import assert_same_batches, collect, seeded
from .conftest import SHM_PREFIX, mapped_segments, wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]

WORKERS, PREFETCH = 2, 2
DEPTH = WORKERS * PREFETCH + 2


def _pair(dataset, **kwargs):
    kwargs.setdefault("num_workers", WORKERS)
    kwargs.setdefault("prefetch_factor", PREFETCH)
    return ShmDataLoader(dataset, generator=seeded(3), **kwargs), DataLoader(dataset, generator=seeded(3), **kwargs)


@pytest.mark.parametrize("collate_fn", [None, ds.numpy_collate])
def test_list_of_an_epoch_is_torchs(collate_fn):
    shm, ref = _pair(ds.DictDataset(n=90), batch_size=2, shuffle=True, collate_fn=collate_fn)
    held = list(shm)  # 45 batches, far past the ring's depth
    assert len(held) == 45
    assert_same_batches(held, list(ref))
    stats = shm.stats()
    assert stats.ring_slots == DEPTH and stats.detached > 0 and stats.held_segments > 0, stats
    del held


def test_two_whole_epochs_compared_and_sorted():
    shm, ref = _pair(ds.ArrayDataset(n=60, nbytes=2048), batch_size=3, shuffle=True,
                     persistent_workers=True)
    first, second = list(shm), list(shm)  # the second epoch must not write into any held batch
    want_first, want_second = list(ref), list(ref)
    assert_same_batches(first, want_first)
    assert_same_batches(second, want_second)
    key = lambda b: float(b[0, 0])  # noqa: E731
    assert_same_batches(sorted(shm, key=key), sorted(ref, key=key))
    assert_same_batches(first, want_first)  # still intact after two more epochs
    del first, second


def _workers_of(loader) -> list[int]:
    return [p.pid for p in loader._iterator._workers]


def test_held_batches_cost_no_fd_and_memory_goes_back_to_the_working_ring():
    shm = ShmDataLoader(ds.ArrayDataset(n=120, nbytes=8192), batch_size=2, num_workers=WORKERS,
                        prefetch_factor=PREFETCH, persistent_workers=True,
                        prefetch_next_epoch=False)  # a quiet ring once the epoch is over
    it = iter(shm)
    held = [next(it) for _ in range(20)]
    fds_20 = len(os.listdir("/proc/self/fd"))
    held += list(it)
    assert len(held) == 60
    fds_60 = len(os.listdir("/proc/self/fd"))
    # 40 more batches held, no fd for any: only the ring's own slots come and go (at most DEPTH)
    assert fds_60 - fds_20 <= DEPTH, (fds_20, fds_60)
    del it
    stats = shm.stats()
    assert stats.held_segments >= 60 - DEPTH and stats.reserved_bytes == stats.ring_bytes + stats.held_bytes
    assert len(mapped_segments()) >= 60
    del held
    after = shm.stats()
    assert after.held_segments == 0 and after.reserved_bytes == after.ring_bytes, after
    assert after.ring_slots == DEPTH and after.ring_bytes <= DEPTH * after.slot_bytes
    # the main process maps the working ring and the workers' status page only, and so do the
    # workers once they have read their "forget" messages (they read them when idle)
    assert len(mapped_segments()) <= DEPTH + 1
    pids = _workers_of(shm)
    assert wait_until(lambda: all(len(mapped_segments(pid)) <= DEPTH + 1 for pid in pids), 5.0), \
        [len(mapped_segments(pid)) for pid in pids]
    del shm


def test_workers_forget_pre_growth_segments():
    """Batches that grow their slots: no process keeps a pre-growth segment mapped, so what the
    processes map together is what stats() reports reserved."""
    shm = ShmDataLoader(ds.VariableLengthDataset(n=48, step=4096), batch_size=4, num_workers=WORKERS,
                        prefetch_factor=PREFETCH, persistent_workers=True, collate_fn=ds.pad_collate,
                        prefetch_next_epoch=False)  # nothing in flight once the epoch is over
    for _ in range(2):
        for _batch in shm:
            pass
        del _batch
    stats = shm.stats()
    assert stats.slot_grows > 0, stats
    pids = _workers_of(shm)

    def mapped_bytes() -> int:
        sizes: dict[str, int] = {}
        for pid in ["self", *pids]:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    if "/dev/shm/shmloader-" in line:
                        start, end = (int(x, 16) for x in line.split()[0].split("-"))
                        sizes[line.split()[-2]] = end - start
        return sum(sizes.values())

    status_bytes = os.sysconf("SC_PAGE_SIZE")  # the workers' status words: one page
    assert wait_until(lambda: mapped_bytes() <= stats.reserved_bytes + status_bytes, 5.0), \
        (mapped_bytes(), stats)
    del shm


class _CountingCollect:
    def __init__(self):
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        return _REAL_COLLECT(*args)


_REAL_COLLECT = gc.collect


def test_batches_in_reference_cycles_force_no_garbage_collection(monkeypatch):
    """A consumer whose helper forms a cycle with each batch: no gc.collect per batch (torch
    forces none either); the detached slots' memory goes when the collector runs."""
    counter = _CountingCollect()
    monkeypatch.setattr(shmloader.ring.gc, "collect", counter)
    shm = ShmDataLoader(ds.DictDataset(n=80), batch_size=2, num_workers=WORKERS,
                        prefetch_factor=PREFETCH, collate_fn=ds.numpy_collate)
    gc.disable()
    try:
        for i, batch in enumerate(shm):
            assert batch["labels"] == [2 * i, 2 * i + 1]
            holder = [batch["image"], batch]
            holder.append(holder)  # only the cycle collector frees this batch
            del holder, batch
    finally:
        gc.enable()
    assert counter.calls == 0
    stats = shm.stats()
    assert stats.batches == 40 and stats.detached > 0
    _REAL_COLLECT()
    assert len(mapped_segments()) <= DEPTH + 1  # the ring and the status page, no held batch
    del shm


def test_a_cap_in_bytes_raises_ring_full_error_naming_it():
    shm = ShmDataLoader(ds.ArrayDataset(n=40, nbytes=8192), batch_size=2, num_workers=WORKERS,
                        prefetch_factor=PREFETCH, max_ring_bytes=10 * 16384 + 4096)
    held = []
    with pytest.raises(RingFullError, match="max_ring_bytes=167936"):
        for batch in shm:
            held.append(batch)
    assert 1 <= len(held) < 20
    for i, batch in enumerate(held):  # what was delivered is still intact
        assert torch.equal(batch[:, 0], torch.tensor([2.0 * i, 2.0 * i + 1]))
    del held, batch, shm


@pytest.mark.timeout(180)
def test_keeping_200_batches_under_ulimit_n_100():
    """torch's case: 200 small-tensor batches of an IterableDataset kept under RLIMIT_NOFILE 100.
    torch either works or raises its RuntimeError naming `ulimit -n`; ShmDataLoader works."""
    script = os.path.join(os.path.dirname(__file__), "_held_fds_script.py")
    root = os.path.dirname(os.path.dirname(__file__))

    def run(which: str) -> dict:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        done = subprocess.run([sys.executable, script, which], capture_output=True, text=True,
                              timeout=150, cwd=root, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    torch_result = run("torch")
    assert torch_result["ok"] or "ulimit -n" in torch_result["error"], torch_result
    shm_result = run("shm")
    assert shm_result == {"ok": True, "batches": 200}, shm_result


def test_held_batches_stay_correct_through_collect_helpers():
    """`collect` (the helpers' list of an epoch) against torch with held batches from two loaders
    at once: their rings never share or overwrite a held batch."""
    a, ref_a = _pair(ds.TupleDataset(n=40), batch_size=2)
    b, ref_b = _pair(ds.ArrayDataset(n=40, nbytes=1024), batch_size=4, shuffle=True)
    got_a, got_b = collect(a), collect(b)
    assert_same_batches(got_a, collect(ref_a))
    assert_same_batches(got_b, collect(ref_b))
    del got_a, got_b



def test_a_batch_sent_to_another_process_is_shared_with_it_as_under_torch():
    """torch.multiprocessing sends a delivered batch by sharing its memory (a storage not in
    shared memory yet is moved there first: is_shared() is False on shmloader's batches): a
    child reads the parent's values, its writes show in the parent, under both loaders alike,
    and the loader goes on.  In a process of its own, since torch's fd sharing keeps a listener
    socket for the life of the process."""
    script = os.path.join(os.path.dirname(__file__), "_shared_batch_script.py")
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["ShmDataLoader"] == seen["DataLoader"], seen
    sums = seen["DataLoader"]
    assert sums["child_read"] == sums["parent_before"] and sums["parent_after"] == sums["parent_before"] + 16 * 1000
    assert len(sums["epoch"]) == 4


class _SizedBatches(torch.utils.data.Dataset):
    """Sample i is a float32 tensor of `sizes[i]` bytes, filled with i (batch_size=1)."""

    def __init__(self, sizes):
        self.sizes = sizes

    def __len__(self):
        return len(self.sizes)

    def __getitem__(self, i):
        return torch.full((self.sizes[i] // 4,), float(i))


def _shm_held() -> int:
    """Bytes of /dev/shm in the shmloader segments this process maps (pages given back to
    /dev/shm not counted): other processes' use of /dev/shm, other tests' too, leaves it alone."""
    blocks = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "/dev/shm/" + SHM_PREFIX in line:
                st = os.stat(f"/proc/self/map_files/{line.split()[0]}")
                blocks[st.st_ino] = st.st_blocks * 512
    return sum(blocks.values())


@pytest.mark.parametrize("order", ["outlier first", "padded"])
def test_held_batches_of_varying_size_cost_their_own_size(order):
    """NOTE [ Held batches ]: a held batch keeps its own pages, not its slot's, which is sized for
    the largest batch so far. One 24 MiB batch and then 2 MiB ones kept (each would keep a 27 MiB
    slot: 324 MiB), or sizes that vary batch to batch (dynamic padding), kept in a list: /dev/shm
    holds what the batches hold, as under torch."""
    mib = 1 << 20
    if order == "outlier first":
        sizes = [mib // 4, 24 * mib] + [2 * mib] * 12
    else:
        sizes = [(1 + (7 * i) % 9) * mib for i in range(16)]  # 1..9 MiB, no order
    loader = ShmDataLoader(_SizedBatches(sizes), batch_size=1, num_workers=WORKERS)
    kept = [batch for k, batch in enumerate(loader) if k >= 2]
    used = _shm_held()  # the iterator is done: the ring is closed, only held batches remain
    kept_bytes = sum(sizes[2:])
    assert used <= kept_bytes * 1.05 + mib, f"{used / mib:.1f} MiB held for {kept_bytes / mib:.1f} MiB of batches"
    for k, batch in enumerate(kept, start=2):
        assert batch.shape == (1, sizes[k] // 4) and bool((batch == k).all())


def test_one_outlier_batch_does_not_size_the_slots_made_after_it():
    """NOTE [ Slot size follows the batches ] in ring.py: after a window of small batches the
    ring makes its new slots at their size again, and drops its free slots far above it."""
    mib = 1 << 20
    sizes = [mib // 4, 24 * mib] + [2 * mib] * 20
    loader = ShmDataLoader(_SizedBatches(sizes), batch_size=1, num_workers=WORKERS, persistent_workers=True)
    it = iter(loader)
    for k in range(len(sizes)):
        batch = next(it)
        assert bool((batch == k).all())
    del batch
    stats = it.stats()
    assert stats.slot_bytes < 3 * mib, stats
    assert stats.ring_bytes <= DEPTH * 3 * mib, stats  # no 27 MiB slot left in the ring
    del it


@pytest.mark.parametrize("kwargs", [{}, {"sample_parallel": True}], ids=["default", "sample_parallel"])
def test_a_batch_held_across_a_fork_of_the_users_is_never_written_again(kwargs):
    """NOTE [ Batches held across a fork of the user's ] (ring.py): a child forked while the
    loop holds batch 0 keeps batch 0 as it was while the parent goes on (the slot used to be
    reused: the child's batch changed under it), and what the child writes into its batch never
    shows in the parent's later batches, as with torch's segments of their own."""
    import time

    import numpy as np

    loader = ShmDataLoader(ds.ArrayDataset(n=96, nbytes=64 * 1024), batch_size=4, num_workers=2, **kwargs)
    want = [b.clone() for b in DataLoader(ds.ArrayDataset(n=96, nbytes=64 * 1024), batch_size=4)]
    it = iter(loader)
    batch = next(it)
    held = batch.numpy()  # the child reads and writes through numpy (torch ops in a fork: no)
    expected = want[0].numpy().copy()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: check its batch after the parent has gone on, then write into it
        os.close(read)
        time.sleep(1.0)
        same = bool(np.array_equal(held, expected))
        held += 1000
        os.write(write, b"1" if same else b"0")
        os._exit(0)
    os.close(write)
    del batch, held
    got = [next(it) for _ in range(10)]  # the ring's slots are all reused by now
    assert os.read(read, 1) == b"1", "the child's batch changed while it held it"
    os.close(read)
    os.waitpid(child, 0)
    got += list(it)
    assert len(got) == len(want) - 1
    for g, w in zip(got, want[1:]):
        assert torch.equal(g, w)


class _PaddedSequences(torch.utils.data.Dataset):
    """Sequence i: `lengths[i]` rows of 64 float32, filled with i (dynamic padding's samples)."""

    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return torch.full((self.lengths[i], 64), float(i))


@pytest.mark.parametrize("collate_fn", [held_bench.pad_tensors, held_bench.pad_numpy], ids=["pad_sequence", "numpy"])
def test_every_batch_of_dynamic_padding_kept_makes_segments_of_its_own_size(collate_fn):
    """NOTE [ Held batches of varying size ] in ring.py: a loop that keeps every padded batch
    gets torch's batches, and the segments made for them once slots are detached are the
    batches' sizes, not the largest batch's (each was reserved and zero-filled whole, 1.8x torch's
    time for such a loop)."""
    rows = [512 * (1 + (5 * (i // 4)) % 9) - 64 * (i % 4) for i in range(4 * 30)]  # 0.5..4.5k rows a batch
    dataset = _PaddedSequences(rows)
    shm, ref = _pair(dataset, batch_size=4, collate_fn=collate_fn)
    it = iter(shm)
    kept = list(it)
    assert_same_batches(kept, list(ref))
    batch_bytes = sum(int(b.nbytes) for b in kept)
    segments = list(it._scheduler.ring._held_segments)
    assert len(segments) == len(kept)
    reserved = sum(segment.size for segment in segments)
    assert reserved <= 1.3 * batch_bytes, f"{reserved >> 20} MiB of segments for {batch_bytes >> 20} MiB of batches"
    del kept, segments
