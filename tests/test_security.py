"""Security: what another process could do to a slot, and what a corrupt slot could do to us.

Segments are created exclusively (O_EXCL), mode 0600, under 128-bit random names that exist only
for the instant between shm_open and shm_unlink; workers refuse a slot whose header disagrees with
the task (size, generation, magic, version); the main process refuses a header or a descriptor
that points outside its slot.  The trust model is in the README (Reliability).
"""

from __future__ import annotations

import os
import re
import stat
import struct
from types import SimpleNamespace

import numpy as np
import posix_ipc
import pytest

import shmloader.segment as segment_module
from shmloader import SlotProtocolError, _ring, layout
from shmloader.ring import Ring
from shmloader.segment import create_segment
from shmloader.worker import _Worker

pytestmark = [pytest.mark.usefixtures("no_leaks"), pytest.mark.timeout(30)]

# Offsets in shm_slot_header (csrc/ring.h).
MAGIC_AT, VERSION_AT, DESC_BYTES_AT, PAYLOAD_END_AT, DESC_OFFSET_AT = 0, 8, 48, 56, 64


class _Recorder:
    """Wraps _ring.open_unlinked to record the paths segments are made under."""

    def __init__(self):
        self.names = []
        self.real = _ring.open_unlinked

    def __call__(self, path):
        self.names.append(path.decode())
        fd = self.real(path)
        assert not os.path.exists(self.names[-1]), "the name must be gone when the fd comes back"
        return fd


def test_segments_are_private_exclusive_unguessable_and_unlinked(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(segment_module._ring, "open_unlinked", recorder)
    drawn = []
    real_token_hex = segment_module.secrets.token_hex

    def token_hex(nbytes):
        drawn.append(real_token_hex(nbytes))
        return drawn[-1]

    monkeypatch.setattr(segment_module.secrets, "token_hex", token_hex)
    segments = []
    try:
        for _ in range(32):
            segment = create_segment(64 * 1024, 0)
            segments.append(segment)
            st = os.fstat(segment.fd)
            assert stat.S_IMODE(st.st_mode) == 0o600
            assert st.st_uid == os.geteuid()
            assert not os.get_inheritable(segment.fd), "a subprocess the dataset starts must not inherit it"
        assert len(recorder.names) == 32
        assert len(set(recorder.names)) == 32
        # The whole name after the prefix is 128 bits from the CSPRNG: nothing in it comes from the
        # pid, a counter or the clock (a pid may still turn up in random hex by chance).
        assert recorder.names == [f"/dev/shm/shmloader-{token}" for token in drawn]
        for name in recorder.names:
            assert re.fullmatch(r"/dev/shm/shmloader-[0-9a-f]{32}", name), name
    finally:
        segments.clear()


def test_a_symlink_planted_at_the_name_is_not_followed(monkeypatch, tmp_path):
    link = "/dev/shm/shmloader-" + "cd" * 16
    target = tmp_path / "victim"
    os.symlink(target, link)
    try:
        monkeypatch.setattr(segment_module.secrets, "token_hex", lambda n: "cd" * 16)
        with pytest.raises(FileExistsError, match="shmloader-cdcd"):
            create_segment(64 * 1024, 0)
        assert not target.exists(), "the segment must not be made where the link points"
        assert os.path.islink(link), "someone else's name is not ours to unlink"
    finally:
        os.unlink(link)


def test_a_name_taken_by_someone_else_is_not_attached(monkeypatch):
    squatter = posix_ipc.SharedMemory("/shmloader-" + "ab" * 16, posix_ipc.O_CREX, mode=0o666, size=4096)
    try:
        monkeypatch.setattr(segment_module.secrets, "token_hex", lambda n: "ab" * 16)
        with pytest.raises(FileExistsError, match="shmloader-abab"):
            create_segment(64 * 1024, 0)
        assert os.path.exists("/dev/shm/shmloader-" + "ab" * 16), "someone else's name is not ours to unlink"
    finally:
        squatter.close_fd()
        squatter.unlink()


# -- the worker's side: a task's slot must be the slot it says ---------------------------------


def _worker() -> _Worker:
    worker = _Worker.__new__(_Worker)
    worker.spec = SimpleNamespace(worker_id=3)
    worker.segments = {}
    return worker


def test_worker_refuses_a_slot_larger_than_its_segment():
    segment = create_segment(64 * 1024, 0)
    worker = _worker()
    with pytest.raises(SlotProtocolError, match=r"worker 3 refuses slot 0: .*capacity 65536.*capacity 1048576"):
        worker._attach(0, 0, 1024 * 1024, [os.dup(segment.fd)])  # would let writes run past the end
    worker.segments.clear()


@pytest.mark.parametrize("field, value, words", [
    (MAGIC_AT, struct.pack("<Q", 0xDEADBEEF), "magic 0xdeadbeef"),
    (VERSION_AT, struct.pack("<I", 99), "version 99"),
])
def test_worker_refuses_a_foreign_or_stale_segment(field, value, words):
    segment = create_segment(64 * 1024, 0)
    segment.write(field, value)
    worker = _worker()
    with pytest.raises(SlotProtocolError, match=f"refuses slot 0: header says .*{words}"):
        worker._attach(0, 0, segment.size, [os.dup(segment.fd)])
    worker.segments.clear()


def test_worker_refuses_a_wrong_generation():
    segment = create_segment(64 * 1024, 4)
    worker = _worker()
    with pytest.raises(SlotProtocolError, match="generation"):
        worker._attach(0, 5, segment.size, [os.dup(segment.fd)])
    worker.segments.clear()


def test_segment_accesses_stay_inside_the_slot():
    segment = create_segment(64 * 1024, 0)
    size = segment.size
    data = np.zeros(16, np.uint8)
    for bad in (lambda: segment.write(size - 8, data),
                lambda: segment.read(size, 1),
                lambda: segment.read(2**63, 2**63),  # offset + length overflows 64 bits
                lambda: segment.copy_from_address(size - 1, data.ctypes.data, 2),
                lambda: segment.publish(size, size + 1)):
        with pytest.raises(ValueError, match="outside|past the slot"):
            bad()


# -- the main process's side: a READY slot must describe itself inside itself -----------------


@pytest.fixture
def ready_slot(no_leaks):
    """A one-slot ring whose slot a 'worker' has written batch 0 into and published."""
    ring = Ring(1)
    slot = ring.take_free_slot()
    made = create_segment(64 * 1024, 1)
    ring.adopt(slot, os.dup(made.fd), made.size, 1)
    del made
    segment = ring.segment(slot)
    plan = layout.plan_batch({"x": np.arange(10, dtype=np.int64)})
    assert segment.claim(0, 0) == _ring.FREE
    layout.write_batch(segment, plan)
    segment.publish(len(plan.descriptor), plan.total_bytes, plan.descriptor_offset)
    # pytest keeps a fixture's value until after every teardown: hand out a holder that is
    # emptied here, so that no_leaks sees the segment unmapped.
    holder = [ring, slot, segment]
    del segment
    yield holder
    ring.close()
    holder.clear()


def test_main_reads_an_honest_slot(ready_slot):
    ring, slot, _ = ready_slot
    lease, descriptor, end = ring.lease(slot, 0, ring.release_callback())
    batch = layout.read_batch(lease, descriptor, end)
    assert batch["x"].tolist() == list(range(10))


@pytest.mark.parametrize("field, value, words", [
    (MAGIC_AT, struct.pack("<Q", 0x1234), "magic 0x1234 .*foreign or stale"),
    (VERSION_AT, struct.pack("<I", 1), "version 1; expected .* version 2"),
    (DESC_BYTES_AT, struct.pack("<Q", 2**40), "lie outside"),
    (PAYLOAD_END_AT, struct.pack("<Q", 2**40), "lie outside"),
    (DESC_OFFSET_AT, struct.pack("<Q", 2**40), "lie outside"),
    (DESC_OFFSET_AT, struct.pack("<Q", 8), "lie outside"),  # inside the header
])
def test_main_refuses_a_corrupt_header(ready_slot, field, value, words):
    ring, slot, segment = ready_slot
    segment.write(field, value)
    with pytest.raises(SlotProtocolError, match=words):
        ring.lease(slot, 0, ring.release_callback())


def test_main_refuses_a_leaf_past_the_payload(ready_slot):
    ring, slot, _ = ready_slot
    lease, descriptor, end = ring.lease(slot, 0, ring.release_callback())
    with pytest.raises(SlotProtocolError, match="lies outside the slot's payload"):
        # The int64[10] leaf is the payload's first 80 bytes: end the payload 8 bytes short of it.
        layout.read_batch(lease, descriptor, layout.HEADER_BYTES + 72)


@pytest.mark.parametrize("kind", ["t", "v", "w", "e"])
def test_main_refuses_a_tensor_leaf_of_a_quantized_dtype(ready_slot, kind):
    """torch.frombuffer of a quantized dtype crashes the process (a segmentation fault): a
    descriptor that asks for one is refused, whatever its leaf kind."""
    import pickle

    import torch

    ring, slot, _ = ready_slot
    lease, _, end = ring.lease(slot, 0, ring.release_callback())
    storage = ("s", layout.HEADER_BYTES, None, 80)
    pid = {"t": ("t", layout.HEADER_BYTES, torch.quint8, (10,), False),
           "v": ("v", layout.HEADER_BYTES, torch.qint8, (5,), False, (2,), 9),
           "w": ("w", storage, torch.qint32, (2,), (1,), 0, False),
           "e": ("e", torch.quint8, (0,), (1,), False)}[kind]

    class Forger(pickle.Pickler):
        def persistent_id(self, obj):
            return pid if obj == "leaf" else None

    import io

    forged = io.BytesIO()
    Forger(forged, protocol=pickle.DEFAULT_PROTOCOL).dump({"x": "leaf"})
    with pytest.raises(SlotProtocolError, match="quantized"):
        layout.read_batch(lease, forged.getvalue(), end)
