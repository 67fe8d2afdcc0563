"""The CUDA path: pinned slots (shmloader/cuda.py) and CudaPrefetcher (shmloader/prefetch.py).

CPU tests (always run) drive both through a fake CUDA runtime, with real slot segments and real
loaders, and prove the orderings that matter: a registration is undone while the memory is still
mapped and after the device is idle; a slot goes back to the ring only after its copy's event has
completed; the consumer waits on each batch's event before seeing it.  Tests marked `cuda` run the
same on a GPU (skipped without one).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import os
import subprocess
import sys
import textwrap
import warnings
import weakref

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import shmloader
from shmloader import CudaPrefetcher, CudaUnavailableError, ShmDataLoader
from shmloader import cuda as shm_cuda
from shmloader import ring as shm_ring
from shmloader import segment as shm_segment

HAS_CUDA = torch.cuda.is_available()


def cuda_test(fn):
    """A test that needs a CUDA device: marked `cuda`, skipped without one."""
    return pytest.mark.cuda(pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")(fn))


Point = collections.namedtuple("Point", "x y")


# -- datasets (module level: workers may be spawned) ------------------------------------------------


class Items(Dataset):
    """Item i: a float tensor filled with i, a label, a string; `nbytes` per image."""

    def __init__(self, n: int = 12, nbytes: int = 4096, grow_at: int | None = None):
        self.n, self.nbytes, self.grow_at = n, nbytes, grow_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        size = self.nbytes * (8 if self.grow_at is not None and i >= self.grow_at else 1)
        return {"image": np.full(size // 4, i, dtype=np.float32), "label": i, "name": f"item{i}"}


class Numeric(Items):
    """Items without the string (sample_parallel stacks every leaf)."""

    def __getitem__(self, i):
        item = super().__getitem__(i)
        del item["name"]
        return item


class Filled(Dataset):
    """Item i: `nbytes` of uint8 all equal to i % 251 (a batch's bytes name its batch)."""

    def __init__(self, n: int, nbytes: int):
        self.n, self.nbytes = n, nbytes

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full(self.nbytes, i % 251, dtype=np.uint8)


# -- a fake CUDA runtime --------------------------------------------------------------------------


def _mapped_at(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        return any(int(line.split("-", 1)[0], 16) == address for line in maps)


class FakeEvent:
    def __init__(self, rt: FakeRuntime, number: int):
        self.rt, self.number = rt, number
        self.stream = None
        self.done = False

    def record(self, stream=None):
        self.stream = stream if stream is not None else self.rt.current
        self.done = self.rt.auto_complete
        self.rt.log.append(("record", self.number, getattr(self.stream, "name", None)))

    def query(self):
        return self.done

    def synchronize(self):
        self.rt.log.append(("synchronize", self.number))
        self.done = True

    def complete(self):
        self.rt.log.append(("complete", self.number))
        self.done = True


class FakeStream:
    def __init__(self, name):
        self.name = name


class FakeRuntime:
    """Stands in for torch.cuda: 'device' copies are CPU clones; events complete when a test says
    so (or at once with auto_complete); every call is logged in order."""

    def __init__(self, auto_complete: bool = False, register_code: int = 0, pinned: bool = True):
        self.auto_complete, self.register_code, self.pinned = auto_complete, register_code, pinned
        self.log: list[tuple] = []
        self.registered: dict[int, int] = {}
        self.events: list[FakeEvent] = []
        self.current = FakeStream("consumer")
        self.active = None
        self.streams: list[FakeStream] = []

    def available(self):
        return True

    def host_register(self, address, size):
        assert size > 0 and _mapped_at(address), "registering memory that is not mapped"
        self.log.append(("register", address, size))
        if self.register_code == 0:
            assert address not in self.registered, "registered twice"
            self.registered[address] = size
        return self.register_code

    def host_unregister(self, address):
        self.log.append(("unregister", address, _mapped_at(address)))
        assert address in self.registered, "unregistering memory never registered"
        del self.registered[address]
        return 0

    def synchronize(self):
        self.log.append(("device-synchronize",))
        for event in self.events:
            event.done = True

    def new_event(self):
        event = FakeEvent(self, len(self.events))
        self.events.append(event)
        return event

    def new_stream(self, device):
        stream = FakeStream(f"copy{len(self.streams)}")
        self.streams.append(stream)
        return stream

    def current_stream(self, device):
        return self.current

    @contextlib.contextmanager
    def use_stream(self, stream):
        previous, self.active = self.active, stream
        try:
            yield
        finally:
            self.active = previous

    def wait_event(self, stream, event):
        assert event.stream is not None, "waiting on an event never recorded"
        self.log.append(("wait", stream.name, event.number))

    def record_stream(self, tensor, stream):
        self.log.append(("record_stream", stream.name))

    def is_pinned(self, tensor):
        return self.pinned

    def copy(self, tensor, device, non_blocking):
        assert self.active is not None and self.active.name.startswith("copy"), "copy off the copy stream"
        self.log.append(("copy", tuple(tensor.shape), non_blocking))
        return tensor.clone()

    def resolve_device(self, device):
        return torch.device("cuda", 0) if str(device) == "cuda" else torch.device(device)


def _segment(nbytes: int = 1 << 16):
    return shm_segment.create_segment(nbytes, generation=0)


# == import and API without CUDA ===================================================================


@pytest.mark.timeout(60)
def test_import_touches_no_cuda():
    """`import shmloader` (and its CUDA modules) neither initializes nor probes CUDA."""
    code = textwrap.dedent("""
        import torch
        def boom(*a, **k):
            raise AssertionError("CUDA probed at import time")
        for name in ("is_available", "device_count", "current_device", "init", "_lazy_init", "cudart"):
            setattr(torch.cuda, name, boom)
        torch.accelerator.is_available = boom
        torch.accelerator.current_accelerator = boom
        import shmloader, shmloader.cuda, shmloader.prefetch
        from shmloader import CudaPrefetcher, ShmDataLoader
        ShmDataLoader(list(range(4)), batch_size=2, num_workers=1, pin_memory=True)
        assert not torch.cuda.is_initialized()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.timeout(60)
@pytest.mark.skipif(HAS_CUDA, reason="checks the behaviour without CUDA")
def test_pin_memory_without_cuda_behaves_as_torch():
    loader = ShmDataLoader(Items(8), batch_size=4, num_workers=1, pin_memory=True)
    with warnings.catch_warnings(record=True) as torchs:
        warnings.simplefilter("always")
        iter(DataLoader(Items(8), batch_size=4, num_workers=1, pin_memory=True))
    torch_warns = any("no accelerator is found" in str(w.message) for w in torchs)  # not torch 2.6
    with pytest.warns(UserWarning, match="no accelerator is found") if torch_warns else contextlib.nullcontext():
        it = iter(loader)
    assert it._pinner is None
    batches = [b["image"].clone() for b in it]
    want = [b["image"] for b in DataLoader(Items(8), batch_size=4)]
    assert len(batches) == 2 and all(torch.equal(a, b) for a, b in zip(batches, want))
    assert not shm_cuda.live_registrations()


@pytest.mark.timeout(30)
@pytest.mark.skipif(HAS_CUDA, reason="checks the behaviour without CUDA")
def test_prefetcher_without_cuda_is_a_clear_error():
    with pytest.raises(CudaUnavailableError, match=r"torch.cuda.is_available\(\) is False") as info:
        CudaPrefetcher(ShmDataLoader(Items(4), batch_size=2))
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, shmloader.ShmLoaderError)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("depth", [0, -1, 1.5, True, "2", None])
def test_prefetcher_depth_is_validated(depth):
    with pytest.raises(ValueError, match=f"depth must be an int >= 1, got {depth!r}"):
        CudaPrefetcher([], depth=depth, runtime=FakeRuntime())


@pytest.mark.timeout(30)
def test_device_must_be_cuda():
    rt = shm_cuda.CudaRuntime()
    with pytest.raises(ValueError, match="device must be a CUDA device, got 'cpu'"):
        rt.resolve_device("cpu")
    assert rt.resolve_device("cuda:1") == torch.device("cuda", 1)  # no probe: index given
    with pytest.raises(TypeError, match="non_blocking must be a bool"):
        CudaPrefetcher([], non_blocking="yes", runtime=FakeRuntime())


# == SlotPinner: registration per segment, undone before unmap ======================================


@pytest.mark.timeout(30)
def test_pin_registers_once_and_unregisters_before_unmap():
    rt = FakeRuntime()
    pinner = shm_cuda.SlotPinner("cuda", runtime=rt)
    seg = _segment()
    address, size = seg.address, seg.size
    pinner.pin(seg)
    pinner.pin(seg)  # once per segment
    assert rt.registered == {address: size}
    assert shm_cuda.live_registrations() == {address: size}
    assert pinner.stats().live == 1 and pinner.stats().registered_bytes == size
    del seg
    gc.collect()
    # the device was synchronized, then the range unregistered while still mapped, then unmapped
    tail = rt.log[-2:]
    assert tail == [("device-synchronize",), ("unregister", address, True)]
    assert not _mapped_at(address)
    assert rt.registered == {} and shm_cuda.live_registrations() == {}
    assert pinner.stats().live == 0 and pinner.stats().unregistered == 1


@pytest.mark.timeout(30)
def test_grown_segment_is_registered_again():
    rt = FakeRuntime()
    pinner = shm_cuda.SlotPinner("cuda", runtime=rt)
    small = _segment(1 << 16)
    pinner.pin(small)
    grown = _segment(1 << 20)  # what a worker creates when a batch outgrows its slot
    pinner.pin(grown)
    assert rt.registered == {small.address: small.size, grown.address: grown.size}
    old = small.address
    del small
    gc.collect()
    assert rt.registered == {grown.address: grown.size}
    assert ("unregister", old, True) in rt.log
    del grown
    gc.collect()
    assert rt.registered == {} and pinner.stats().registered == pinner.stats().unregistered == 2


@pytest.mark.timeout(30)
def test_failed_registration_warns_once_and_stays_pageable():
    rt = FakeRuntime(register_code=2)
    pinner = shm_cuda.SlotPinner("cuda", runtime=rt)
    a, b = _segment(), _segment()
    with pytest.warns(RuntimeWarning, match=r"cudaHostRegister of a \d+-byte ring slot failed with cudaError 2"):
        pinner.pin(a)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pinner.pin(b)  # warned once only
    assert a.before_unmap is None and pinner.stats().failed == 2 and pinner.stats().registered == 0
    del a, b
    gc.collect()
    assert not any(entry[0] == "unregister" for entry in rt.log)


@pytest.mark.timeout(30)
def test_forked_child_never_unregisters():
    rt = FakeRuntime()
    pinner = shm_cuda.SlotPinner("cuda", runtime=rt)
    seg = _segment()
    pinner.pin(seg)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: drop its copy of the segment; the fake must not be called
        try:
            del seg
            gc.collect()
            calls = sum(1 for entry in rt.log if entry[0] in ("unregister", "device-synchronize"))
            os.write(write, str(calls).encode())
        finally:
            os._exit(0)
    os.close(write)
    got = os.read(read, 16)
    os.close(read)
    os.waitpid(pid, 0)
    assert got == b"0"
    assert rt.registered == {seg.address: seg.size}  # the parent's registration is untouched
    del seg
    gc.collect()
    assert rt.registered == {}


@pytest.mark.timeout(30)
def test_pinner_for_another_accelerator_warns_and_does_nothing():
    rt = FakeRuntime()
    with pytest.warns(RuntimeWarning, match="only for CUDA, not for 'xpu'"):
        pinner = shm_cuda.SlotPinner("xpu", runtime=rt)
    seg = _segment()
    pinner.pin(seg)
    release = [].append
    assert pinner.fence_releases(release) is release
    assert rt.registered == {} and seg.before_unmap is None


@pytest.mark.timeout(30)
def test_stale_registration_is_refused():
    rt = FakeRuntime()
    pinner = shm_cuda.SlotPinner("cuda", runtime=rt)
    seg = _segment()
    shm_cuda._registry[seg.address] = (os.getpid(), seg.size)  # as if a previous unmap skipped it
    try:
        with pytest.raises(shmloader.SlotProtocolError, match="still registered with CUDA"):
            pinner.pin(seg)
    finally:
        shm_cuda._registry.pop(seg.address, None)


# == the release fence =============================================================================


@pytest.mark.timeout(30)
def test_release_fence_holds_slots_until_their_event():
    rt = FakeRuntime()
    pinner = shm_cuda.SlotPinner("cuda", runtime=rt)
    ring_released: list = []
    on_release = pinner.fence_releases(ring_released.append)
    on_release((0, 0))
    on_release((1, 0))
    assert ring_released == [] and pinner.pending() == 2  # a dead lease is not a free slot yet
    assert pinner.pump() == 0  # event 0 recorded after the loop's copies; not complete
    assert rt.log[-1] == ("record", 0, "consumer")
    on_release((2, 0))
    assert pinner.pump() == 0 and len(rt.events) == 2  # a later death needs a later event
    rt.events[0].complete()
    assert pinner.pump() == 2 and ring_released == [(0, 0), (1, 0)]
    assert pinner.pending() == 1
    assert pinner.pump(wait=True) == 1 and ring_released[-1] == (2, 0)
    assert ("synchronize", 1) in rt.log
    assert pinner.stats().fenced == 3 and pinner.stats().fence_waits == 1
    assert pinner.pump() == 0 and len(rt.events) == 2  # nothing new: no event


@pytest.fixture
def fake_cuda_loader(monkeypatch):
    """Make torch's base iterator decide to pin (as on a CUDA machine) and give the pinner the
    fake runtime; workers do not pin, so they are unaffected."""
    rt = FakeRuntime()
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # torch 2.6's base iterator asks this
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(shm_cuda, "_default_runtime", rt)
    return rt


@pytest.mark.timeout(90)
@pytest.mark.parametrize("events_complete", [True, False])
def test_loader_pins_every_segment_and_fences_releases(fake_cuda_loader, events_complete):
    """A real ShmDataLoader with pin_memory=True over two epochs (one slot grows): every segment it
    adopts is registered once, every registration is undone while still mapped, and the epoch
    completes even when fence events never complete by themselves (the full ring waits on them)."""
    rt = fake_cuda_loader
    rt.auto_complete = events_complete
    ds = Items(24, nbytes=8192, grow_at=16)
    loader = ShmDataLoader(ds, batch_size=4, num_workers=2, pin_memory=True, prefetch_factor=1,
                           max_ring_slots=4, persistent_workers=True)
    want = [b["image"] for b in DataLoader(ds, batch_size=4)]
    it = iter(loader)
    pinner = it._pinner
    assert isinstance(pinner, shm_cuda.SlotPinner) and pinner.active
    for epoch in range(2):
        got = [b["image"].clone() for b in (it if epoch == 0 else iter(loader))]
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    segments = it._ring.segments()
    assert segments and all(seg.before_unmap is not None for seg in segments)
    assert {s.address for s in segments} <= set(rt.registered)
    stats = pinner.stats()
    assert stats.registered >= len(segments) and it.stats().slot_grows >= 1
    assert stats.fenced >= 2 * len(want) - pinner.pending()
    if not events_complete:
        assert stats.fence_waits >= 1
    registered = {e[1] for e in rt.log if e[0] == "register"}
    del it, loader, segments, got
    gc.collect()
    unregistered = [e for e in rt.log if e[0] == "unregister"]
    assert {e[1] for e in unregistered} == registered
    assert all(still_mapped for _, _, still_mapped in unregistered)
    assert rt.registered == {} and shm_cuda.live_registrations() == {}


# == CudaPrefetcher with the fake runtime ==========================================================


def _batches(n: int):
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
              torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64]
    for i in range(n):
        yield {
            "tensors": [torch.arange(6).reshape(2, 3).to(dt) + (i if dt is not torch.bool else 0) for dt in dtypes],
            "point": Point(torch.full((3,), float(i)), f"p{i}"),
            "pair": (i, None),
            "names": [f"item{i}", b"raw"],
            "array": np.full(2, i),
            "empty": torch.empty(0, 5),
            "strided": torch.arange(20.0).reshape(4, 5)[:, ::2],
        }


@pytest.mark.timeout(30)
def test_prefetcher_moves_tensors_and_passes_other_leaves():
    rt = FakeRuntime(auto_complete=True)
    got = list(CudaPrefetcher(_batches(3), depth=2, runtime=rt))
    want = list(_batches(3))
    assert len(got) == 3
    for g, w in zip(got, want):
        assert list(g) == list(w)
        for a, b in zip(g["tensors"], w["tensors"]):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        assert type(g["point"]) is Point and torch.equal(g["point"].x, w["point"].x) and g["point"].y == w["point"].y
        assert g["pair"] == w["pair"] and type(g["pair"]) is tuple
        assert g["names"] == w["names"]
        assert isinstance(g["array"], np.ndarray) and np.array_equal(g["array"], w["array"])
        assert g["empty"].shape == (0, 5) and torch.equal(g["strided"], w["strided"])
    copies = [e for e in rt.log if e[0] == "copy"]
    assert copies and all(non_blocking for *_, non_blocking in copies)


@pytest.mark.timeout(30)
def test_prefetcher_orders_copy_event_wait_and_record_stream():
    rt = FakeRuntime(auto_complete=True)
    it = iter(CudaPrefetcher(_batches(4), depth=2, runtime=rt))
    assert sum(1 for e in rt.log if e[0] == "record") == 2  # depth copies started at iter()
    for n in range(4):
        start = len(rt.log)
        next(it)
        step = rt.log[start:]
        assert step[0] == ("wait", "consumer", n), step  # the consumer waits on batch n's event
        assert step[1][0] == "record_stream" and step[1][1] == "consumer"
        records = [e for e in step if e[0] == "record"]
        assert all(stream.startswith("copy") for *_, stream in records)
        if n + 2 < 4:
            assert records[-1][1] == n + 2  # and batch n+2's copy starts, depth ahead
    with pytest.raises(StopIteration):
        next(it)


class _Tracked:
    """A source whose CPU batches report when they are freed (standing in for their lease)."""

    def __init__(self, rt, n):
        self.rt, self.n = rt, n
        self.alive: set[int] = set()

    def __iter__(self):
        for i in range(self.n):
            batch = torch.full((4,), float(i))
            self.alive.add(i)
            weakref.finalize(batch, self._freed, i)
            yield {"x": batch}
            del batch

    def _freed(self, i):
        self.alive.discard(i)
        self.rt.log.append(("freed", i))


@pytest.mark.timeout(30)
def test_cpu_batch_lives_until_its_copy_event_completes():
    rt = FakeRuntime()
    src = _Tracked(rt, 6)
    it = iter(CudaPrefetcher(src, depth=2, runtime=rt))
    out0 = next(it)
    gc.collect()
    assert 0 in src.alive  # handed over, but its copy has not completed: the lease is kept
    out1 = next(it)
    gc.collect()
    assert {0, 1} <= src.alive
    rt.events[0].complete()
    next(it)
    gc.collect()
    assert 0 not in src.alive and 1 in src.alive  # dropped only once its event completed
    # every free comes after its batch's event completed
    for entry in [e for e in rt.log if e[0] == "freed"]:
        i = entry[1]
        done_at = next(k for k, e in enumerate(rt.log) if e[0] in ("complete", "synchronize") and e[1] == i)
        assert done_at < rt.log.index(entry)
    del out0, out1


@pytest.mark.timeout(30)
def test_too_many_outstanding_copies_wait_on_the_oldest():
    rt = FakeRuntime()
    src = _Tracked(rt, 8)
    it = iter(CudaPrefetcher(src, depth=2, runtime=rt))
    for _ in range(5):
        next(it)
    # at most depth handed-over batches wait for their events; older ones were synchronized
    assert ("synchronize", 0) in rt.log
    gc.collect()
    assert len(src.alive) <= 2 * 2 + 1
    freed = [e[1] for e in rt.log if e[0] == "freed"]
    assert freed == [0, 1, 2]
    for i in freed:
        sync_at = rt.log.index(("synchronize", i))
        assert sync_at < rt.log.index(("freed", i))


@pytest.mark.timeout(30)
def test_closing_mid_epoch_waits_for_copies_before_dropping_batches():
    rt = FakeRuntime()
    src = _Tracked(rt, 10)
    it = iter(CudaPrefetcher(src, depth=3, runtime=rt))
    next(it)
    del it
    gc.collect()
    assert not src.alive
    for i in (0, 1, 2, 3):
        assert rt.log.index(("synchronize", i)) < rt.log.index(("freed", i))


@pytest.mark.timeout(30)
def test_pageable_batches_are_warned_about_once():
    rt = FakeRuntime(auto_complete=True, pinned=False)
    with pytest.warns(RuntimeWarning, match="pageable memory.*pin_memory=True") as record:
        list(CudaPrefetcher(_batches(3), runtime=rt))
    assert sum("pageable" in str(w.message) for w in record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(CudaPrefetcher(_batches(2), runtime=FakeRuntime(auto_complete=True, pinned=False), non_blocking=False))


@pytest.mark.timeout(30)
def test_prefetcher_delegates_to_its_loader():
    loader = DataLoader(list(range(10)), batch_size=3)
    pf = CudaPrefetcher(loader, runtime=FakeRuntime(auto_complete=True))
    assert len(pf) == 4 and pf.batch_size == 3 and pf.dataset is loader.dataset and pf.loader is loader
    assert [b.tolist() for b in pf] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert [b.tolist() for b in pf][0] == [0, 1, 2]  # a second epoch


@pytest.mark.timeout(90)
def test_prefetcher_over_shm_loader_never_frees_a_slot_before_its_event(fake_cuda_loader, monkeypatch):
    """Real slots, real leases: the ring never gets a slot back before the copy event of the batch
    in it has completed, and the batches are the plain loader's."""
    rt = fake_cuda_loader
    counts = {"released": 0}
    original = shm_ring.Ring.release_callback

    def spy(self):
        forward = original(self)

        def on_release(key):
            counts["released"] += 1
            done = sum(1 for e in rt.events if e.done and getattr(e.stream, "name", "").startswith("copy"))
            assert counts["released"] <= done, "a slot came back before its copy's event completed"
            forward(key)

        return on_release

    monkeypatch.setattr(shm_ring.Ring, "release_callback", spy)
    ds = Filled(16, 1 << 16)
    loader = ShmDataLoader(ds, batch_size=2, num_workers=2, pin_memory=True, prefetch_factor=1)
    want = [b.clone() for b in DataLoader(ds, batch_size=2)]
    got = []
    it = iter(CudaPrefetcher(loader, depth=2, runtime=rt))
    for n, batch in enumerate(it):
        got.append(batch)
        copy_events = [e for e in rt.events if getattr(e.stream, "name", "").startswith("copy")]
        if n % 3 == 0:  # complete copies in bursts, some late
            for e in copy_events:
                e.complete()
        gc.collect()
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert counts["released"] >= 1
    del it, loader
    gc.collect()
    assert rt.registered == {}


# == on a GPU =======================================================================================


def _gpu_loader(ds, **kwargs):
    kwargs.setdefault("num_workers", 2)
    return ShmDataLoader(ds, pin_memory=True, **kwargs)


@cuda_test
@pytest.mark.timeout(300)
@pytest.mark.parametrize("persistent", [False, True])
def test_cuda_batches_bit_exact_over_epochs(persistent):
    ds = Items(40, nbytes=1 << 18)
    loader = _gpu_loader(ds, batch_size=4, persistent_workers=persistent)
    want = [b for b in DataLoader(ds, batch_size=4)]
    pf = CudaPrefetcher(loader, device="cuda", depth=2)
    for _ in range(3):
        got = list(pf)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g["image"].is_cuda and g["image"].dtype == w["image"].dtype
            assert torch.equal(g["image"].cpu(), w["image"]) and torch.equal(g["label"].cpu(), w["label"])
            assert g["name"] == w["name"]
    torch.cuda.synchronize()


@cuda_test
@pytest.mark.timeout(300)
def test_cuda_slots_are_pinned_and_growth_registers_again():
    loader = _gpu_loader(Items(24, nbytes=1 << 16, grow_at=12), batch_size=4)
    it = iter(loader)
    for batch in it:
        assert batch["image"].is_pinned()  # the grown slots' batches too: registered again
    grows = it.stats().slot_grows
    assert grows >= 1 and it._pinner.stats().registered >= 1 + grows
    del it, batch
    gc.collect()
    assert shm_cuda.live_registrations() == {}


@cuda_test
@pytest.mark.timeout(300)
def test_cuda_no_slot_reused_before_its_copy_completed():
    """Large copies held back behind a long kernel on the copy stream, with the ring at its
    smallest: if a slot were handed back before its copy finished, a worker would overwrite it
    and the GPU batch would hold another batch's bytes."""
    ds = Filled(24, 16 << 20)
    loader = _gpu_loader(ds, batch_size=2, num_workers=2, prefetch_factor=1)
    it = iter(CudaPrefetcher(loader, depth=2))
    for n, batch in enumerate(it):
        with torch.cuda.stream(it._stream):
            torch.cuda._sleep(50_000_000)  # delays the next copies by tens of ms
        expected = torch.tensor([(2 * n) % 251, (2 * n + 1) % 251], device="cuda", dtype=torch.uint8)
        assert torch.equal(batch[:, 0], expected) and torch.equal(batch[:, -1], expected)
        assert bool((batch == expected[:, None]).all())


@cuda_test
@pytest.mark.timeout(300)
def test_cuda_release_fence_protects_plain_non_blocking_copies():
    """The usual loop without the prefetcher: `x = batch.to('cuda', non_blocking=True)` drops the
    CPU batch while its copy may still wait behind compute on the stream."""
    ds = Filled(24, 16 << 20)
    loader = _gpu_loader(ds, batch_size=2, num_workers=2, prefetch_factor=1)
    results = []
    for n, batch in enumerate(loader):
        torch.cuda._sleep(50_000_000)
        x = batch.to("cuda", non_blocking=True)
        del batch
        results.append((n, x))
    for n, x in results:
        expected = torch.tensor([(2 * n) % 251, (2 * n + 1) % 251], device="cuda", dtype=torch.uint8)
        assert bool((x == expected[:, None]).all()), f"batch {n} overwritten"


@cuda_test
@pytest.mark.timeout(300)
def test_cuda_no_leak_of_registrations_or_gpu_memory_across_epochs():
    ds = Items(32, nbytes=1 << 18)
    pf = CudaPrefetcher(_gpu_loader(ds, batch_size=4), depth=2)
    list(pf)
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for _ in range(3):
        for batch in pf:
            batch["image"].sum()
        del batch
        gc.collect()
        torch.cuda.synchronize()
        assert shm_cuda.live_registrations() == {}
        assert torch.cuda.memory_allocated() == base



def _stack_rows(samples):
    """A numpy collate as users write it."""
    return np.stack(samples)


@cuda_test
@pytest.mark.timeout(300)
def test_cuda_numpy_collate_slots_are_pinned_and_plain_copies_are_fenced():
    """A user's `np.stack` collate: the arrays come back as numpy views onto the slot; the slot is
    page-locked, and `torch.from_numpy(batch).to('cuda', non_blocking=True)` queued behind compute
    still gets its own batch's bytes (the release fence covers the slot whatever wraps it)."""
    ds = Filled(24, 8 << 20)
    loader = _gpu_loader(ds, batch_size=2, num_workers=2, prefetch_factor=1, collate_fn=_stack_rows)
    results = []
    for n, batch in enumerate(loader):
        assert isinstance(batch, np.ndarray)
        host = torch.from_numpy(batch)
        assert host.is_pinned()
        torch.cuda._sleep(50_000_000)
        results.append((n, host.to("cuda", non_blocking=True)))
        del batch, host
    for n, x in results:
        expected = torch.tensor([(2 * n) % 251, (2 * n + 1) % 251], device="cuda", dtype=torch.uint8)
        assert bool((x == expected[:, None]).all()), f"batch {n} overwritten"
    gc.collect()
    assert shm_cuda.live_registrations() == {}


@cuda_test
@pytest.mark.timeout(300)
def test_cuda_sample_parallel_batches_through_the_prefetcher():
    """sample_parallel=True with pin_memory: rows written by several workers into one pinned slot
    arrive on the GPU bit for bit as torch's batches."""
    ds = Numeric(48, nbytes=1 << 18)
    loader = _gpu_loader(ds, batch_size=8, num_workers=3, sample_parallel=True)
    want = list(DataLoader(ds, batch_size=8))
    for _ in range(2):
        got = list(CudaPrefetcher(loader, device="cuda", depth=2))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g["image"].is_cuda and torch.equal(g["image"].cpu(), w["image"])
            assert torch.equal(g["label"].cpu(), w["label"])
    gc.collect()
    torch.cuda.synchronize()
    assert shm_cuda.live_registrations() == {}


class CollectingItems(Dataset):
    """Each item runs the garbage collector in the worker, as any allocation-heavy item may."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        gc.collect()
        return torch.full((1024,), float(i))


class InCycle:
    def __init__(self, tensor):
        self.tensor, self.me = tensor, self


def batches_with_cuda_garbage_at_fork(make_loader) -> list:
    """Leave CUDA tensors in reference cycles (record_stream'd on a side stream, as CudaPrefetcher's
    batches are), start the loader's workers with that garbage uncollected, and return copies of
    its batches."""
    side = torch.cuda.Stream()
    gc.collect()
    gc.disable()
    try:
        for _ in range(4):
            x = torch.ones(1 << 20, device="cuda")
            x.record_stream(side)
            InCycle(x)
        del x
        it = iter(make_loader())
    finally:
        gc.enable()
    try:
        return [b.clone() for b in it]
    finally:
        del it
        gc.collect()
        torch.cuda.synchronize()


@cuda_test
@pytest.mark.timeout(300)
def test_cuda_garbage_of_the_training_loop_is_not_freed_in_forked_workers():
    """Freed in a forked worker, such tensors abort it ('CUDA error: initialization error',
    SIGABRT); they must stay the training process's to free (NOTE [ The parent's garbage ])."""
    got = batches_with_cuda_garbage_at_fork(lambda: ShmDataLoader(
        CollectingItems(), batch_size=2, num_workers=2, multiprocessing_context="fork"))
    assert len(got) == 4 and all(torch.equal(a, b) for a, b in zip(got, DataLoader(CollectingItems(), batch_size=2)))


# == the other ways users run the GPU path ==========================================================


def _same_on_gpu(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g["image"].is_cuda and torch.equal(g["image"].cpu(), w["image"])
        assert torch.equal(g["label"].cpu(), w["label"]) and g["name"] == w["name"]


@cuda_test
@pytest.mark.timeout(300)
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_cuda_pinned_slots_under_other_start_methods(context):
    """CUDA is initialized in the training process; spawn and forkserver workers (what a dataset
    that touches CUDA needs) write into slots the training process page-locked."""
    ds = Items(24, nbytes=1 << 18)
    loader = _gpu_loader(ds, batch_size=4, multiprocessing_context=context, persistent_workers=True)
    want = list(DataLoader(ds, batch_size=4))
    for _ in range(2):
        _same_on_gpu(list(CudaPrefetcher(loader, device="cuda")), want)
    it = iter(loader)
    assert all(b["image"].is_pinned() for b in it)
    del it, loader
    gc.collect()
    assert shm_cuda.live_registrations() == {}


@cuda_test
@pytest.mark.timeout(300)
def test_cuda_held_pinned_batches_then_copied():
    """list(loader) with pin_memory=True (more batches than the ring holds), then every batch to
    the GPU: each is its own, and every registration is undone once they are dropped."""
    ds = Items(64, nbytes=1 << 18)
    loader = _gpu_loader(ds, batch_size=4, prefetch_factor=1)
    held = list(loader)
    assert len(held) == 16 and all(b["image"].is_pinned() for b in held)
    on_gpu = [{**b, "image": b["image"].to("cuda", non_blocking=True),
               "label": b["label"].to("cuda", non_blocking=True)} for b in held]
    _same_on_gpu(on_gpu, list(DataLoader(ds, batch_size=4)))
    del held, on_gpu, loader
    gc.collect()
    torch.cuda.synchronize()
    assert shm_cuda.live_registrations() == {}


@cuda_test
@pytest.mark.timeout(300)
def test_cuda_prefetch_next_epoch_and_shuffle():
    ds = Items(40, nbytes=1 << 16)
    kwargs = dict(batch_size=4, shuffle=True, num_workers=2, persistent_workers=True)
    loader = ShmDataLoader(ds, generator=torch.Generator().manual_seed(7), pin_memory=True,
                           prefetch_next_epoch=True, **kwargs)
    ref = DataLoader(ds, generator=torch.Generator().manual_seed(7), **kwargs)
    pf = CudaPrefetcher(loader, device="cuda")
    for _ in range(3):
        _same_on_gpu(list(pf), list(ref))


@cuda_test
@pytest.mark.timeout(300)
def test_cuda_in_order_false_delivers_every_batch_once():
    ds = Items(40, nbytes=1 << 16)
    loader = _gpu_loader(ds, batch_size=4, num_workers=3, in_order=False)
    labels = sorted(int(x) for b in CudaPrefetcher(loader, device="cuda") for x in b["label"].cpu())
    assert labels == list(range(40))


@cuda_test
@pytest.mark.timeout(300)
def test_cuda_worker_death_with_pinned_slots_leaves_no_registration():
    from shmloader import WorkerDiedError

    from ._datasets import KillSelfDataset

    loader = _gpu_loader(KillSelfDataset(n=32, bad=9), batch_size=2, num_workers=2)
    with pytest.raises(WorkerDiedError, match="SIGKILL"):
        for _ in CudaPrefetcher(loader, device="cuda"):
            pass
    del loader
    gc.collect()
    torch.cuda.synchronize()
    assert shm_cuda.live_registrations() == {}


@cuda_test
@pytest.mark.timeout(300)
@pytest.mark.parametrize("depth, non_blocking", [(1, True), (3, False)])
def test_cuda_prefetcher_over_torchs_dataloader(depth, non_blocking):
    """CudaPrefetcher wraps any loader: torch's DataLoader(pin_memory=True) too, at any depth, with
    synchronous copies as well; strings and numbers pass through."""
    ds = Items(24, nbytes=1 << 16)
    loader = DataLoader(ds, batch_size=4, num_workers=2, pin_memory=True)
    got = list(CudaPrefetcher(loader, device="cuda", depth=depth, non_blocking=non_blocking))
    _same_on_gpu(got, list(DataLoader(ds, batch_size=4)))


class _Interrupted:
    """A loader's iterator: batch i is {"x": tensor full of i}, up to `n`; at the indices in
    `raises` it raises that exception first (a dataset's error, a Ctrl-C while it is waited on),
    and then goes on, as ShmDataLoader's and torch's iterators do."""

    def __init__(self, n: int, raises: dict):
        self.n, self.raises, self.i = n, dict(raises), 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i in self.raises:
            raise self.raises.pop(self.i)
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return {"x": torch.full((4,), float(self.i - 1))}


def _drive(iterator, limit: int = 30) -> list:
    """Each next()'s batch index or the exception's type name, until StopIteration."""
    got = []
    while len(got) < limit:
        try:
            got.append(int(next(iterator)["x"][0]))
        except StopIteration:
            return got
        except (ValueError, KeyboardInterrupt) as exc:
            got.append(type(exc).__name__)
    return got


@pytest.mark.timeout(30)
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_prefetcher_raises_a_loader_error_at_its_batchs_turn_and_goes_on(depth):
    """NOTE [ Errors in order ]: the error of batch 3, met while batch 1 was handed over, took
    batch 1's place (batch 1 was lost, and the error came two batches early)."""
    want = _drive(_Interrupted(6, {3: ValueError("sample 3")}))
    assert want == [0, 1, 2, "ValueError", 3, 4, 5]
    rt = FakeRuntime(auto_complete=True)
    got = _drive(iter(CudaPrefetcher(_Interrupted(6, {3: ValueError("sample 3")}), depth=depth, runtime=rt)))
    assert got == want


@pytest.mark.timeout(30)
@pytest.mark.parametrize("depth", [1, 2])
def test_prefetcher_loses_no_batch_to_a_ctrl_c_while_the_loader_is_waited_on(depth):
    """A KeyboardInterrupt while the next batch is fetched comes at once; the batch already taken
    for the caller comes with the next next(), and then every later one."""
    rt = FakeRuntime(auto_complete=True)
    got = _drive(iter(CudaPrefetcher(_Interrupted(6, {3: KeyboardInterrupt()}), depth=depth, runtime=rt)))
    assert got.count("KeyboardInterrupt") == 1
    assert [x for x in got if x != "KeyboardInterrupt"] == [0, 1, 2, 3, 4, 5], got
