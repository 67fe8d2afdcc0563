"""shmloader/layout.py: structures round-trip through a slot as zero-copy views, default-collate
output matches torch's, and errors name the leaf's path."""

from __future__ import annotations

import collections
import dataclasses
import gc
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from shmloader import BatchShapeError, LayoutError, SlotProtocolError, layout
from shmloader._ring import FREE, HEADER_BYTES, LEAF_ALIGN, READY, STREAM_MIN_BYTES, SlotLease
from shmloader.segment import create_segment

from . import _datasets as ds
from ._helpers import address_of, array_leaves, assert_same, nbytes_of

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("no_leaks")]

Point = collections.namedtuple("Point", ["x", "y"])


@dataclasses.dataclass
class Record:
    name: str
    values: np.ndarray


def _write(structure, sequence: int = 7):
    """Plan, write and publish `structure` into a fresh segment, as a worker does; then lease it
    as the main process does.  Returns (batch, released list, segment)."""
    plan = layout.plan_batch(structure)
    segment = create_segment(plan.total_bytes, 0)
    assert segment.claim(0, sequence) == FREE
    layout.write_batch(segment, plan)
    segment.publish(len(plan.descriptor), plan.total_bytes, plan.descriptor_offset)
    assert segment.acquire() == READY
    segment.close_fd()
    released: list = []
    lease = SlotLease(segment, 3, 0, sequence, released.append)
    descriptor = segment.read(plan.descriptor_offset, len(plan.descriptor))
    return layout.read_batch(lease, descriptor, plan.total_bytes), released, segment


NUMPY_DTYPES = [np.bool_, np.uint8, np.int8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
                np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128]
TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]


def _structures():
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    return {
        "numpy dtypes": {str(np.dtype(t)): (np.arange(12) % 3).astype(t).reshape(3, 4) for t in NUMPY_DTYPES},
        "torch dtypes": [torch.arange(6).to(t).reshape(2, 3) for t in TORCH_DTYPES],
        "non-contiguous": (base.transpose(0, 2), base[:, ::2, 1:], base.expand(2, 3, 4, 5)[1]),
        "numpy orders": [np.asfortranarray(np.arange(12.0).reshape(3, 4)), np.arange(24)[::3],
                         np.arange(12).reshape(3, 4).T],
        "empty and 0-d": {"empty": np.zeros((0, 3)), "t0": torch.tensor(3.5), "n0": np.array(7),
                          "empty_t": torch.zeros(2, 0)},
        "nested": {"a": [Point(np.ones(3), "p"), Point(torch.zeros(2), None)],
                   "b": collections.OrderedDict(z=1, y=(2.5, "s", b"bytes")),
                   "c": Record("r", np.arange(4, dtype=np.int16))},
        "scalars only": [1, 2.0, "three", None, True],
        "conj and neg": (torch.tensor([1 + 2j, 3 - 1j]).conj(), torch.tensor([1.0, 2.0])._neg_view()),
        "sparse": torch.eye(3).to_sparse(),
    }


@pytest.mark.parametrize("name", list(_structures()))
def test_round_trip(name):
    structure = _structures()[name]
    batch, released, segment = _write(structure)
    if name == "sparse":
        assert torch.equal(batch.to_dense(), structure.to_dense())
    elif name == "conj and neg":
        assert torch.equal(batch[0], structure[0].resolve_conj()) and torch.equal(batch[1], -structure[1]._neg_view())
    elif name == "nested":
        assert type(batch["b"]) is collections.OrderedDict and type(batch["a"][0]) is Point
        assert type(batch["c"]) is Record and batch["c"].name == "r"
        np.testing.assert_array_equal(batch["c"].values, structure["c"].values)
        assert_same(batch["a"], structure["a"])
        assert_same(batch["b"], structure["b"])
    elif name == "numpy orders":  # C-ordered unless Fortran-contiguous, as numpy's pickle gives them
        assert_same(batch, pickle.loads(pickle.dumps(structure)))
    else:
        assert_same(batch, structure)
    for leaf in array_leaves(batch):  # every non-empty strided leaf is a view into the slot, aligned
        if nbytes_of(leaf) and getattr(leaf, "layout", torch.strided) == torch.strided:
            assert segment.address + HEADER_BYTES <= address_of(leaf)
            assert address_of(leaf) + nbytes_of(leaf) <= segment.address + segment.size
            # a tensor's storage is aligned (views sharing one start where torch's do)
            start = leaf.untyped_storage().data_ptr() if isinstance(leaf, torch.Tensor) else address_of(leaf)
            assert (start - segment.address) % LEAF_ALIGN == 0
        del leaf
    del batch, segment
    gc.collect()
    assert released == [(3, 0)]


def test_fortran_order_is_kept():
    array = np.asfortranarray(np.arange(12.0).reshape(3, 4))
    batch, _, _ = _write({"f": array})
    assert batch["f"].flags.f_contiguous and not batch["f"].flags.c_contiguous
    np.testing.assert_array_equal(batch["f"], array)


def test_requires_grad_travels():
    batch, _, _ = _write([torch.ones(3, requires_grad=True), torch.ones(3)])
    assert batch[0].requires_grad and not batch[1].requires_grad


def test_the_lease_lives_as_long_as_any_view():
    batch, released, segment = _write({"x": np.arange(100.0), "y": torch.arange(10)})
    x_part = batch["x"][10:20]
    y = batch["y"]
    del batch, segment
    gc.collect()
    assert released == []
    del x_part
    gc.collect()
    assert released == []
    assert torch.equal(y, torch.arange(10))
    del y
    gc.collect()
    assert released == [(3, 0)]


def test_descriptor_does_not_grow_with_the_arrays():
    small = layout.plan_batch({"x": np.zeros(16, np.float32), "y": [1, 2]})
    large = layout.plan_batch({"x": np.zeros(1 << 20, np.float32), "y": [1, 2]})
    assert len(small.descriptor) < 1024 and abs(len(large.descriptor) - len(small.descriptor)) < 16
    assert large.total_bytes >= 4 << 20


# -- the default collate, straight into the slot -----------------------------------------------------


@pytest.mark.parametrize("dataset", [ds.DictDataset(n=5), ds.TupleDataset(n=5), ds.NamedTupleDataset(n=5),
                                     ds.RandomDataset(n=5)], ids=["dict", "tuple", "namedtuple", "random"])
def test_collate_into_slot_matches_default_collate(dataset):
    samples = [dataset[i] for i in range(len(dataset))]
    batch, _, _ = _write(layout.collate_into_slot(samples))
    assert_same(batch, default_collate(samples))


def test_collate_of_non_contiguous_rows():
    samples = [torch.arange(20.0).reshape(4, 5).T * i for i in range(3)]
    batch, _, _ = _write(layout.collate_into_slot(samples))
    assert_same(batch, default_collate(samples))


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_rows_of_every_kind_in_one_batch_match_default_collate():
    """write_batch copies C-ordered array rows in one C loop (Segment.copy_rows) and every other
    row (a tensor, a strided, Fortran-ordered or read-only array) one by one, between them."""
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    frozen = base.copy() + 100
    frozen.flags.writeable = False
    samples = [base.copy(), base * 2, np.asfortranarray(base * 3), base[:, ::-1].copy(),
               np.arange(48, dtype=np.float32).reshape(4, 12)[:, ::2], frozen, base * 7, base * 8]
    batch, _, _ = _write(layout.collate_into_slot(samples))
    assert_same(batch, default_collate(samples))
    tensors = [torch.from_numpy(s.copy()) if k % 3 == 1 else s for k, s in enumerate(samples)]
    batch, _, _ = _write(layout.collate_into_slot(tensors))
    assert_same(batch, default_collate(tensors))


def test_copy_rows_stops_at_a_row_it_cannot_copy_whole():
    segment = create_segment(4096, 0)
    row = np.arange(4, dtype=np.int32)
    rows = [row, None, row + 1, torch.zeros(4, dtype=torch.int32), row[::-1], row + 5,
            np.arange(8, dtype=np.int32)[::2], np.arange(5, dtype=np.int32), row + 8]
    at = HEADER_BYTES
    assert segment.copy_rows(at, 16, rows) == 3  # a tensor exports no buffer
    assert segment.copy_rows(at, 16, rows, 4) == 4  # reversed: not C-contiguous
    assert segment.copy_rows(at, 16, rows, 5) == 6  # strided
    assert segment.copy_rows(at, 16, rows, 7) == 7  # 5 items: not the row's size
    assert segment.copy_rows(at, 16, rows, 8) == 9
    written = np.frombuffer(segment, np.int32, 36, at).reshape(9, 4)
    for k in (0, 2, 5, 8):
        np.testing.assert_array_equal(written[k], rows[k])
    assert not written[[1, 3, 4, 6, 7]].any()  # skipped rows left as they were
    del written
    with pytest.raises(ValueError, match="outside"):
        segment.copy_rows(4096 - 16, 16, rows)


@pytest.mark.parametrize("dst_shift, length_cut", [(0, 0), (1, 0), (7, 13), (15, 63), (64, 1)])
def test_a_streamed_copy_is_every_byte_with_no_byte_outside(dst_shift, length_cut):
    """A copy of STREAM_MIN_BYTES or more takes the streaming-store path (csrc/copy.h): its
    unaligned head, 64-byte body and tail land byte for byte, and the bytes around it stay."""
    nbytes = STREAM_MIN_BYTES + 4099 - length_cut
    source = np.random.default_rng(dst_shift).integers(0, 256, nbytes + 3, dtype=np.uint8)[3:]
    segment = create_segment(HEADER_BYTES + nbytes + 256, 0)
    view = np.frombuffer(segment, np.uint8)
    view[:] = 0xA5
    at = HEADER_BYTES + dst_shift
    segment.copy_from_address(at, source.__array_interface__["data"][0], nbytes)
    np.testing.assert_array_equal(view[at:at + nbytes], source)
    assert (view[:at] == 0xA5).all() and (view[at + nbytes:] == 0xA5).all()
    del view


def test_rows_of_a_leaf_past_the_streaming_size_are_copied_whole():
    """copy_rows streams every row of a leaf whose rows together reach STREAM_MIN_BYTES, even
    rows far smaller than that; the batch is default_collate's, byte for byte."""
    row_items = 4096 * 3 + 5  # a row size that is no multiple of 16 or 64 bytes
    count = -(-STREAM_MIN_BYTES // (row_items * 4))
    samples = [np.random.default_rng(k).random(row_items, dtype=np.float32) for k in range(count)]
    batch, _, segment = _write(layout.collate_into_slot(samples))
    assert batch.numel() * 4 >= STREAM_MIN_BYTES
    assert torch.equal(batch, default_collate(samples))
    del batch, segment


# -- errors name the leaf's path ---------------------------------------------------------------------


def test_object_arrays_are_pickled_in_the_descriptor():
    """As torch's DataLoader pickles them; an unpicklable item names the array's path."""
    batch, _, segment = _write({"a": [np.zeros(2), np.array([None, 1, "x"], dtype=object)]})
    assert batch["a"][1].dtype == object and batch["a"][1].tolist() == [None, 1, "x"]
    del batch, segment
    with pytest.raises(LayoutError, match=r"batch\['a'\]\[1\].*cannot be pickled") as info:
        layout.plan_batch({"a": [np.zeros(2), np.array([None, lambda: 0], dtype=object)]})
    assert isinstance(info.value, TypeError)


def test_unpicklable_leaf_names_its_path():
    structure = Point(x=torch.zeros(2), y={"fn": lambda: 0})
    with pytest.raises(LayoutError, match=r"batch\.y\['fn'\]"):
        layout.plan_batch(structure)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_non_cpu_tensor_names_its_path():
    with pytest.raises(LayoutError, match=r"batch\[1\].*cuda"):
        layout.plan_batch([torch.zeros(2), torch.zeros(2, device="cuda")])


def test_meta_tensors_travel_pickled_whole():
    """A meta tensor has no bytes: it is pickled whole, as torch's workers send it."""
    plan = layout.plan_batch([torch.zeros(2), torch.zeros(2, device="meta")])
    assert len(plan.leaves) == 1 and b"meta" in plan.descriptor


def test_mismatched_shapes_name_the_path_and_both_shapes():
    samples = [{"img": np.zeros((3, 4), np.float32)}, {"img": np.zeros((3, 5), np.float32)}]
    with pytest.raises(BatchShapeError, match=r"batch\['img'\]") as info:
        layout.plan_batch(layout.collate_into_slot(samples))
    assert "[3, 4]" in str(info.value) and "[3, 5]" in str(info.value)
    with pytest.raises(RuntimeError):  # torch's own type for this case
        default_collate(samples)


def test_default_collate_of_object_arrays_names_the_path():
    samples = [{"meta": (np.zeros(1), np.array(["x"], dtype=object))} for _ in range(2)]
    with pytest.raises(TypeError) as torch_info:
        default_collate(samples)
    with pytest.raises(LayoutError, match=r"batch\['meta'\]\[1\]") as info:
        layout.collate_into_slot(samples)
    assert isinstance(info.value, type(torch_info.value))


def test_sparse_leaves_do_not_keep_the_lease():
    """torch parks unpickled sparse tensors in a module-level list until validated; the slot's
    lease must not stay there."""
    batch, released, segment = _write({"s": torch.eye(4).to_sparse(), "d": torch.ones(2)})
    assert torch.equal(batch["s"].to_dense(), torch.eye(4))
    del batch, segment
    gc.collect()
    assert released == [(3, 0)]


def test_a_leaf_past_the_payload_end_is_refused():
    plan = layout.plan_batch({"x": np.arange(1000.0)})
    segment = create_segment(plan.total_bytes, 0)
    layout.write_batch(segment, plan)
    lease = SlotLease(segment, 0, 0, 0, None)
    with pytest.raises(SlotProtocolError, match="lies outside the slot's payload"):
        # the leaf is the payload's first 8000 bytes: end the payload 8 bytes short of it
        layout.read_batch(lease, segment.read(plan.descriptor_offset, len(plan.descriptor)),
                          HEADER_BYTES + 8000 - 8)
    del lease, segment


# -- NOTE [ One-leaf batches ]: plan_batch's shortcut gives the pickler's plan ----------------------


def _one_leaf_cases():
    c = np.arange(24, dtype=np.float32).reshape(4, 6)
    rows = [np.full((3, 5), i, np.int16) for i in range(4)]
    return {
        **{f"C {np.dtype(t)}": (np.arange(12) % 3).astype(t).reshape(3, 4) for t in NUMPY_DTYPES},
        "Fortran": np.asfortranarray(c),
        "transposed (F)": c.T,
        "strided": c[:, ::2],
        "reversed": c[::-1],
        "empty": np.zeros((0, 3)),
        "0-d": np.array(7),
        "datetime": np.arange(5).astype("datetime64[s]"),
        "structured": np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]),
        "with metadata": np.zeros(3, dtype=np.dtype(np.float64, metadata={"unit": "m"})),
        "objects": np.array([1, "x", None], dtype=object),
        "swapped bytes": np.arange(6, dtype=">i4"),
        "stacked rows": layout.collate_into_slot(rows),
        "stacked tensors": layout.collate_into_slot([torch.full((2, 3), float(i)) for i in range(3)]),
    }


def _plan_fields(plan, given):
    """A plan's fields; a leaf is named by identity when it is the `given` one, else (a converted
    copy, say of swapped bytes) by its dtype, shape and bytes."""
    def name(leaf):
        return id(leaf) if leaf is given else (leaf.dtype.str, leaf.shape, leaf.tobytes())
    return (plan.descriptor, [(offset, name(leaf)) for offset, leaf in plan.leaves], plan.descriptor_offset,
            plan.total_bytes, plan.in_place_bytes)


def _pickler_plan(monkeypatch, structure, arena=None):
    with monkeypatch.context() as patched:
        patched.setattr(layout, "_plan_one_leaf", lambda *args: None)
        return layout.plan_batch(structure, arena)


@pytest.mark.parametrize("name", list(_one_leaf_cases()))
def test_a_one_leaf_plan_is_the_picklers(name, monkeypatch):
    leaf = _one_leaf_cases()[name]
    want = _plan_fields(_pickler_plan(monkeypatch, leaf), leaf)
    assert _plan_fields(layout.plan_batch(leaf), leaf) == want
    assert _plan_fields(layout.plan_batch(leaf), leaf) == want  # the descriptor from the cache
    batch, released, segment = _write(leaf)
    if isinstance(leaf, layout.StackedLeaf):
        assert_same(batch, torch.stack([torch.as_tensor(row) for row in leaf.rows]))
    else:
        assert_same(batch, pickle.loads(pickle.dumps(leaf)))  # what torch's pickling gives
    del batch, segment
    gc.collect()
    assert released == [(3, 0)]


def test_one_leaf_plans_of_one_shape_at_other_offsets_differ():
    a = np.zeros((2, 3), np.float32)
    first = layout.plan_batch(a)
    assert layout.plan_batch(a.astype(np.float64)).descriptor != first.descriptor
    assert layout.plan_batch(a.reshape(3, 2)).descriptor != first.descriptor
    assert layout.plan_batch(np.asfortranarray(np.zeros((3, 2), np.float32)).T).descriptor == first.descriptor


def test_one_leaf_plan_with_an_arena_is_the_picklers(monkeypatch):
    from shmloader._ring import SlotArena

    segment = create_segment(1 << 22, 0)
    arena = SlotArena(segment, layout.HEADER_BYTES, 16 * 1024)
    samples = [np.full(8192, i, np.float32) for i in range(8)]
    with arena:
        born = np.stack(samples)  # one block of the arena: described where it is
        block = np.zeros(64 * 1024, np.uint8)
    cases = {"born in the arena": born, "Fortran view of it": born.T, "unaligned part of a block": block[1:],
             "rows of it": born[2:5], "not in the arena": np.ones(9000, np.float32),
             "empty": np.zeros((0, 4), np.float32)}
    for name, leaf in cases.items():
        got, want = layout.plan_batch(leaf, arena), _pickler_plan(monkeypatch, leaf, arena)
        assert _plan_fields(got, leaf) == _plan_fields(want, leaf), name
    assert layout.plan_batch(born, arena).in_place_bytes == born.nbytes
    assert layout.plan_batch(born, arena).leaves == []
    del born, block, cases, got, want, leaf
    assert arena.release() == 0
    del arena, segment
    gc.collect()


def test_a_one_leaf_stacking_problem_still_names_the_shapes():
    leaf = layout.collate_into_slot([np.zeros((2, 3)), np.zeros((3, 2))])
    with pytest.raises(BatchShapeError, match=r"cannot stack samples at batch"):
        layout.plan_batch(leaf)


# -- NOTE [ Reading a one-leaf batch ]: read_batch's shortcut gives the unpickler's batch ------------


def _one_leaf_reads():
    rows = [np.full((3, 5), i, np.int16) for i in range(4)]
    return {
        **{f"numpy {np.dtype(t)}": (np.arange(12) % 3).astype(t).reshape(3, 4) for t in NUMPY_DTYPES},
        **{f"tensor {t}": layout.collate_into_slot([torch.arange(6).to(t).reshape(2, 3)] * 3) for t in TORCH_DTYPES},
        "plain tensor": torch.arange(12.0).reshape(3, 4),
        "Fortran": np.asfortranarray(np.arange(12.0).reshape(3, 4)),
        "0-d tensor": torch.tensor(3.5),
        "0-d array": np.array(7),
        "empty": np.zeros((0, 3)),
        "stacked rows": layout.collate_into_slot(rows),
        "large tensor": layout.collate_into_slot([torch.full((64, 64), float(i)) for i in range(8)]),
        "large array": np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024),
    }


def _read_twice(leaf, copy_upto: int):
    """Write `leaf` once, read it twice from two leases (the second read takes the shortcut)."""
    plan = layout.plan_batch(leaf)
    segment = create_segment(plan.total_bytes, 0)
    layout.write_batch(segment, plan)
    descriptor = segment.read(plan.descriptor_offset, len(plan.descriptor))
    released: list = []
    reads = [layout.read_batch(SlotLease(segment, 3, 0, 7, released.append), descriptor, plan.total_bytes,
                               copy_upto) for _ in range(2)]
    return reads, descriptor, released, segment


@pytest.mark.parametrize("copy_upto", [0, layout.SMALL_LEAF_BYTES])
@pytest.mark.parametrize("name", list(_one_leaf_reads()))
def test_a_one_leaf_batch_read_by_the_shortcut_is_the_unpicklers(name, copy_upto):
    leaf = _one_leaf_reads()[name]
    layout._ONE_LEAF_READS.clear()
    (first, second), descriptor, released, segment = _read_twice(leaf, copy_upto)
    want = torch.stack([torch.as_tensor(r) for r in leaf.rows]) if isinstance(leaf, layout.StackedLeaf) else leaf
    for batch in (first, second):
        assert type(batch) is type(first)
        assert_same(batch, pickle.loads(pickle.dumps(want)) if isinstance(want, np.ndarray) else want)
        if isinstance(batch, torch.Tensor):
            assert batch.stride() == first.stride() and batch.storage_offset() == 0 and not batch.requires_grad
    if nbytes_of(first):
        assert layout._ONE_LEAF_READS.get(descriptor) is not None, "the descriptor was not remembered"
        in_slot = segment.address <= address_of(second) < segment.address + segment.size
        assert in_slot == (nbytes_of(second) > copy_upto)  # a view, or a copy of a small leaf
    del first, second, batch, segment
    gc.collect()
    assert released == [(3, 0), (3, 0)]


def test_the_shortcut_still_refuses_a_leaf_past_the_payload_end():
    layout._ONE_LEAF_READS.clear()
    plan = layout.plan_batch(np.arange(1000.0))
    segment = create_segment(plan.total_bytes, 0)
    layout.write_batch(segment, plan)
    descriptor = segment.read(plan.descriptor_offset, len(plan.descriptor))
    lease = SlotLease(segment, 0, 0, 0, None)
    assert layout.read_batch(lease, descriptor, plan.total_bytes)[999] == 999.0
    assert descriptor in layout._ONE_LEAF_READS
    with pytest.raises(SlotProtocolError, match="lies outside the slot's payload"):
        layout.read_batch(lease, descriptor, HEADER_BYTES + 8000 - 8)
    del lease, segment


def test_batches_of_more_than_one_leaf_are_never_read_by_the_shortcut():
    layout._ONE_LEAF_READS.clear()
    shared = torch.arange(10.0)
    for structure in ({"x": np.ones(3)}, [torch.ones(3)], (shared[:4], shared[4:]), torch.eye(3).to_sparse()):
        _read_twice(structure, 0)
    assert layout._ONE_LEAF_READS == {}


@pytest.mark.parametrize("name", ["torch dtypes", "non-contiguous", "conj and neg", "nested"])
def test_no_tensor_leaf_is_a_view_of_another(name):
    """As torch's unpickled tensors: a view would refuse detach_() ("Can't detach views
    in-place"); the one-leaf batches of every dtype too, copied or not."""
    structures = [_structures()[name]]
    if name == "torch dtypes":
        structures += [layout.collate_into_slot([torch.arange(4096).to(t).reshape(64, 64)] * 4) for t in TORCH_DTYPES]
        structures += [torch.arange(4096).to(t).reshape(64, 64)[:, ::2] for t in TORCH_DTYPES]
    for structure in structures:
        for _ in range(2):  # the second read of a one-leaf batch takes NOTE [ Reading a one-leaf batch ]
            batch, released, segment = _write(structure)
            for leaf in array_leaves(batch):
                if isinstance(leaf, torch.Tensor):
                    assert not leaf._is_view() and leaf._base is None, (name, leaf.dtype, leaf.shape)
                    leaf.detach_()
            del batch, leaf, segment
            gc.collect()
            assert released == [(3, 0)]
