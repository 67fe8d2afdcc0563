"""shmloader/rows.py: a batch written row by row, in any order and by several processes, reads
back exactly as torch's default_collate builds it; mismatched or unsupported samples raise errors
naming the leaf's path and the row; per-sample seeds depend only on (seed, epoch, batch, row)."""

from __future__ import annotations

import collections
import hashlib
import os
import pickle
import random
import struct

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from shmloader import BatchShapeError, LayoutError, layout, rows
from shmloader._ring import FREE, READY, WRITING, SlotLease
from shmloader.ring import create_segment

from ._datasets import TORCH_TAKES_NUMPY_BOOL
from ._helpers import assert_same

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leaks")]

Point = collections.namedtuple("Point", ["x", "y"])


class Tagged(torch.Tensor):
    pass


def _read(segment, sequence: int = 7):
    """Lease a published segment as the main process does (the header says where the descriptor
    is) and rebuild the batch; the batch's views hold the segment."""
    assert segment.acquire() == READY
    (_magic, _version, _state, _capacity, _generation, _writer, seq, desc_bytes, payload_end,
     desc_offset) = segment.header()
    assert seq == sequence
    lease = SlotLease(segment, 0, 0, sequence, None)
    return layout.read_batch(lease, segment.read(desc_offset, desc_bytes), payload_end)


def _claimed(schema: rows.RowSchema, sequence: int = 7):
    segment = create_segment(schema.total_bytes, 0)
    assert segment.claim(-1, sequence) == FREE
    segment.close_fd()
    return segment


def _through_rows(samples, learn_from: int = 0, shuffle_seed: int = 0):
    """Learn from one sample, write every row in a shuffled order, publish, read back."""
    schema = rows.learn_schema(samples[learn_from], len(samples))
    segment = _claimed(schema)
    order = list(range(len(samples)))
    random.Random(shuffle_seed).shuffle(order)
    for row in order:
        rows.write_row(segment, schema, row, samples[row])
    assert segment.state() == WRITING
    rows.publish_batch(segment, schema)
    return _read(segment)


# -- structures ---------------------------------------------------------------------------------

N = 7
TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
                torch.complex128, torch.uint16, torch.uint32, torch.uint64]
NUMPY_DTYPES = [np.bool_, np.uint8, np.int8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
                np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128]


def _rng(i: int) -> np.random.Generator:
    return np.random.default_rng(1000 + i)


def _nan_payloads(i: int) -> np.ndarray:
    """float32 values with odd NaN payloads and signed zeros, to check bits, not values."""
    bits = _rng(i).integers(0, 2**32, size=(2, 3), dtype=np.uint32)
    bits[0, 0] = 0x7FC00001 + i
    bits[0, 1] = 0x80000000
    return bits.view(np.float32)


SAMPLES = {
    "single array": lambda i: _rng(i).standard_normal((5, 4)).astype(np.float32),
    "array and int label": lambda i: (_rng(i).integers(0, 255, (3, 4), dtype=np.uint8), i * 3),
    "image dict": lambda i: {"image": _rng(i).integers(0, 255, (3, 8, 8), dtype=np.uint8),
                             "label": i, "weight": 0.25 * i},
    "namedtuple": lambda i: Point(torch.randn(2, 3, generator=torch.Generator().manual_seed(i)), float(i)),
    "nested dict of tuples": lambda i: {
        "a": (np.full((2,), i, np.int16), {"b": [torch.tensor([i, -i]), i % 2 == 0]}),
        "c": collections.OrderedDict(d=np.float32(i / 3), e=(i, (1.5 * i,))),
        "f": Point(x=[np.arange(3) + i], y=()),
    },
    "torch dtypes": lambda i: [(torch.arange(6) * (i + 1) % 5).to(t).reshape(2, 3) for t in TORCH_DTYPES],
    "numpy dtypes": lambda i: {str(np.dtype(t)): (np.arange(4) * (i + 1) % 3).astype(t) for t in NUMPY_DTYPES},
    "numpy scalars": lambda i: [*([np.bool_(i % 2)] if TORCH_TAKES_NUMPY_BOOL else []), np.uint8(i), np.int16(-i), np.uint16(i), np.int32(i),
                                np.uint32(i), np.int64(-i), np.float16(i / 7), np.float32(i / 7),
                                np.float64(i / 7), np.complex64(i + 1j)],
    "python numbers": lambda i: (i, -(2**62) + i, i / 3, float("nan"), -0.0, i % 2 == 1, True),
    "0-d": lambda i: (np.array(i * 1.5), torch.tensor(i, dtype=torch.int32), np.array(i % 2 == 0),
                      torch.tensor(i * 0.5, dtype=torch.bfloat16)),
    "empty leaves": lambda i: (np.zeros((0, 3)), torch.zeros(2, 0, dtype=torch.int8), i),
    "non-contiguous": lambda i: {
        "transposed": np.arange(12.0).reshape(4, 3).T + i,
        "sliced": np.arange(40, dtype=np.int32)[i % 2::4][:5],
        "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3) * i),
        "t_transposed": torch.arange(12.0).reshape(3, 4).t() + i,
        "t_expanded": torch.tensor([i, 2 * i]).expand(3, 2),
        "t_sliced": torch.arange(30, dtype=torch.int16).reshape(5, 6)[1:, ::2] + i,
    },
    "mixed strides across rows": lambda i: (np.arange(12.0).reshape(3, 4) + i if i % 2
                                            else np.ascontiguousarray((np.arange(12.0).reshape(4, 3) + i).T)),
    "conj and neg views": lambda i: (torch.tensor([1 + 2j, i - 1j]).conj(), torch.tensor([1.0, i])._neg_view()),
    "nan payloads": _nan_payloads,
    "empty containers": lambda i: {"x": np.int8(i), "none": [], "nothing": {}, "t": ()},
}


@pytest.mark.parametrize("name", list(SAMPLES))
def test_rows_read_back_as_default_collate(name):
    samples = [SAMPLES[name](i) for i in range(N)]
    batch = _through_rows(samples, shuffle_seed=len(name))
    assert_same(batch, default_collate(samples))


@pytest.mark.parametrize("name", list(SAMPLES))
def test_descriptor_is_the_default_modes(name):
    """The schema learnt from one sample lays a batch out exactly as the default mode lays out
    `collate_into_slot(samples)`: the same descriptor bytes, offsets and payload end."""
    samples = [SAMPLES[name](i) for i in range(N)]
    schema = rows.learn_schema(samples[3], N)
    plan = layout.plan_batch(layout.collate_into_slot(samples))
    assert schema.descriptor == plan.descriptor
    assert (schema.descriptor_offset, schema.total_bytes) == (plan.descriptor_offset, plan.total_bytes)


def test_learning_from_any_row_and_one_row_batches():
    samples = [SAMPLES["image dict"](i) for i in range(5)]
    assert_same(_through_rows(samples, learn_from=4), default_collate(samples))
    assert_same(_through_rows(samples[:1]), default_collate(samples[:1]))


def test_resized_for_a_short_last_batch():
    samples = [SAMPLES["nested dict of tuples"](i) for i in range(8)]
    schema = rows.learn_schema(samples[0], 8)
    assert schema.resized(8) is schema
    short = schema.resized(3)
    assert short.batch_size == 3 and short.total_bytes < schema.total_bytes
    assert short.descriptor == layout.plan_batch(layout.collate_into_slot(samples[:3])).descriptor
    segment = _claimed(short)
    for row in (2, 0, 1):
        rows.write_row(segment, short, row, samples[row])
    rows.publish_batch(segment, short)
    assert_same(_read(segment), default_collate(samples[:3]))
    with pytest.raises(IndexError, match="row 3 is outside a batch of 3"):
        rows.write_row(segment, short, 3, samples[3])


def test_rows_written_by_several_processes():
    """Three forked writers (each given the schema as bytes) write interleaved rows of one
    slot at once; the main process publishes when they are all done."""
    samples = [SAMPLES["image dict"](i) for i in range(12)]
    schema = rows.learn_schema(samples[0], len(samples))
    data = schema.to_bytes()
    segment = _claimed(schema)
    pids = []
    for worker in range(3):
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child)
            code = 1
            try:
                mine = rows.RowSchema.from_bytes(data)
                for row in range(worker, len(samples), 3):
                    rows.write_row(segment, mine, row, samples[row])
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    for pid in pids:
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    rows.publish_batch(segment, schema)
    assert_same(_read(segment), default_collate(samples))


def test_numbers_of_other_rows_that_torch_converts_alike():
    """Row 0 fixes the type (torch's collate looks at it); other rows may be what torch turns
    into the same dtype: an int or bool for a float, a bool for an int; extra keys are ignored
    and any list or tuple of the right length will do, as in torch."""
    samples = [{"w": 0.5, "n": 3, "pair": (1, 2)}, {"w": 2, "n": True, "pair": [3, 4]},
               {"w": False, "n": 7, "pair": (5, 6), "extra": "ignored"}]
    assert_same(_through_rows(samples), default_collate(samples))


# -- errors ---------------------------------------------------------------------------------------


def _written(schema, bad_row, sample):
    segment = _claimed(schema)
    before = segment.read(0, schema.total_bytes)
    try:
        rows.write_row(segment, schema, bad_row, sample)
    finally:
        assert segment.read(0, schema.total_bytes) == before  # nothing was written


def test_shape_and_dtype_mismatch_names_path_and_row():
    good = {"x": np.zeros((1000, 150), np.float32), "y": 1}
    schema = rows.learn_schema(good, 8)
    with pytest.raises(BatchShapeError, match=r"expected ndarray float32\[1000, 150\] at batch\['x'\] row 7, "
                                              r"got ndarray float32\[999, 150\]"):
        _written(schema, 7, {"x": np.zeros((999, 150), np.float32), "y": 2})
    with pytest.raises(BatchShapeError, match=r"float32\[1000, 150\] at batch\['x'\] row 2, got ndarray float64\[999, 150\]"):
        _written(schema, 2, {"x": np.zeros((999, 150)), "y": 2})
    with pytest.raises(BatchShapeError, match=r"expected int at batch\['y'\] row 5, got float"):
        _written(schema, 5, {"x": good["x"], "y": 2.5})
    # a tensor among array rows is stacked as torch stacks it (torch.as_tensor of each), so one
    # of another shape is torch.stack's mismatch
    with pytest.raises(BatchShapeError, match=r"expected ndarray float32\[1000, 150\] at batch\['x'\] row 1, got tensor"):
        _written(schema, 1, {"x": torch.zeros(1000, 149), "y": 2})
    t_schema = rows.learn_schema((torch.zeros(2, 3, dtype=torch.bfloat16),), 4)
    with pytest.raises(BatchShapeError, match=r"expected tensor bfloat16\[2, 3\] at batch\[0\] row 3, got tensor float16\[3, 3\]"):
        _written(t_schema, 3, (torch.zeros(3, 3, dtype=torch.float16),))
    with pytest.raises((TypeError, RuntimeError), match=r"batch\[0\] \(sample 3\).*can't be cast"):  # torch's stack refuses it
        _written(t_schema, 3, (torch.zeros(2, 3, dtype=torch.complex64),))


def test_structure_mismatch_names_path_and_row():
    schema = rows.learn_schema({"a": (np.zeros(2), 1), "b": Point(1.0, 2.0)}, 4)
    cases = [
        ({"a": (np.zeros(2),), "b": Point(1.0, 2.0)}, 2, r"expected tuple of 2 at batch\['a'\] row 2, got tuple of 1"),
        ({"a": (np.zeros(2), 1)}, 3, r"expected a mapping with keys \['a', 'b'\] at batch row 3"),
        ({"b": Point(1.0, 2.0), "a": (np.zeros(2), 1)}, 0, r"expected dict with keys \['a', 'b'\] at batch row 0, "
                                                         r"got dict with keys \['b', 'a'\]"),
        ({"a": [np.zeros(2), 1], "b": Point(1.0, 2.0)}, 0, r"expected tuple of 2 at batch\['a'\] row 0, got list of 2"),
        ({"a": (np.zeros(2), 1), "b": 3.0}, 1, r"expected Point of 2 at batch\['b'\] row 1, got float"),
        ({"a": (np.zeros(2), 1), "b": Point(1.0, 2.0)}.items(), 1, r"at batch row 1, got dict_items"),
    ]
    for sample, row, message in cases:
        with pytest.raises(BatchShapeError, match=message):
            _written(schema, row, sample)
    with pytest.raises(BatchShapeError, match=r"expected float at batch\['b'\].y row 0, got int"):
        _written(schema, 0, {"a": (np.zeros(2), 1), "b": Point(1.0, 2)})  # row 0 fixes the type


def test_errors_pickle_as_workers_send_them():
    schema = rows.learn_schema(np.zeros(3), 2)
    with pytest.raises(BatchShapeError) as info:
        _written(schema, 1, np.zeros(4))
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is BatchShapeError and str(again) == str(info.value)
    with pytest.raises(rows.RowsUnsupportedError) as info:
        rows.learn_schema({"s": "x"}, 2)
    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)


class Marked(np.ndarray):
    """An ndarray subclass of a user's (a masked array is stacked as its data, as by torch)."""


UNSUPPORTED = "use the default mode (sample_parallel=False) or make it an array"
UNCOLLATABLE = "torch's default_collate cannot collate either"


@pytest.mark.parametrize("leaf, error, words", [
    ("a string", rows.RowsUnsupportedError, ["is str 'a string'", "list of str", UNSUPPORTED]),
    (b"bytes", rows.RowsUnsupportedError, ["is bytes b'bytes'", "list of bytes", UNSUPPORTED]),
    (np.str_("numpy str"), rows.RowsUnsupportedError, ["is str_", "list of str_", UNSUPPORTED]),
    (Tagged(torch.zeros(2)), rows.RowsUnsupportedError, ["is a Tagged (float32[2])", "torch.stack", UNSUPPORTED]),
    (np.zeros(2).view(Marked), rows.RowsUnsupportedError, ["is a Marked (float64[2])", UNSUPPORTED]),
    (collections.defaultdict(int, a=1), rows.RowsUnsupportedError, ["is a defaultdict", "return a dict"]),
    (None, rows.RowsUnsupportedError, ["is NoneType None", UNCOLLATABLE, "return arrays, tensors or numbers"]),
    (object(), rows.RowsUnsupportedError, ["is object <object", UNCOLLATABLE]),
    (3 + 4j, rows.RowsUnsupportedError, ["is complex (3+4j)", UNCOLLATABLE]),
    (np.uint64(3), rows.RowsUnsupportedError, ["cannot collate uint64", "refuses it"]),
    # what the default mode raises, as default_collate does
    (np.array(["a", "b"]), LayoutError, ["cannot collate <U1[2]", "found <U1"]),
    (np.array([1, "a"], dtype=object), LayoutError, ["cannot collate object[2]"]),
    (np.zeros(2, "M8[s]"), LayoutError, ["cannot collate datetime64[s][2]"]),
    (torch.zeros(2, requires_grad=True), RuntimeError, ["requires grad"]),
])
def test_unsupported_leaves_are_refused_at_learn_time(leaf, error, words):
    with pytest.raises(error) as info:
        rows.learn_schema({"image": np.zeros(3), "meta": [leaf]}, 4)
    message = str(info.value)
    if error is not RuntimeError:
        assert "batch['meta'][0]" in message, message
    for word in words:
        assert word in message, message


def test_unsupported_error_is_a_layout_and_type_error():
    assert issubclass(rows.RowsUnsupportedError, LayoutError)
    assert issubclass(rows.RowsUnsupportedError, TypeError)
    with pytest.raises(rows.RowsUnsupportedError, match=r"batch\['name'\] is str 'cat'.*list of str.*"
                                                        r"use the default mode \(sample_parallel=False\)"):
        rows.learn_schema({"image": np.zeros(3), "name": "cat"}, 4)


def test_arrays_torch_refuses_raise_torchs_error():
    """A big-endian or negatively-strided array: default_collate raises ValueError, so do the
    default mode (at learn time) and write_row (in a later row), naming the leaf."""
    for bad in (np.arange(4.0)[::-1], np.arange(4.0).astype(">f8")):
        with pytest.raises(ValueError) as torch_error:
            default_collate([bad, bad])
        with pytest.raises(ValueError, match=r"batch\['x'\]"):
            rows.learn_schema({"x": bad}, 2)
        schema = rows.learn_schema({"x": np.arange(4.0)}, 3)
        with pytest.raises(ValueError, match=r"batch\['x'\] \(sample 2\)") as ours:
            _written(schema, 2, {"x": bad})
        assert str(torch_error.value).split(".")[0] in str(ours.value)


def test_numbers_that_do_not_fit():
    schema = rows.learn_schema((1,), 2)
    with pytest.raises(OverflowError, match=r"batch\[0\] row 1"):
        _written(schema, 1, (2**70,))
    with pytest.raises(TypeError, match="numpy.uint64|uint64"):
        rows.learn_schema({"u": np.uint64(3)}, 2)  # torch's default_collate refuses it too


def test_slot_too_small():
    schema = rows.learn_schema(np.zeros(100_000), 2)
    segment = create_segment(4096, 0)
    segment.close_fd()
    with pytest.raises(ValueError, match="does not fit"):
        rows.write_row(segment, schema, 0, np.zeros(100_000))


# -- the schema travels ---------------------------------------------------------------------------


def test_schema_round_trips_and_is_small():
    sample = SAMPLES["nested dict of tuples"](0)
    schema = rows.learn_schema(sample, 64)
    for copy in (pickle.loads(pickle.dumps(schema)), rows.RowSchema.from_bytes(schema.to_bytes())):
        assert copy == schema
        assert copy.resized(5) == schema.resized(5)
    assert len(schema.to_bytes()) < 8192
    big = rows.learn_schema({"image": np.zeros((3, 224, 224), np.uint8), "label": 1}, 256)
    assert len(big.to_bytes()) < 4096  # no sample data in it
    assert big.row_nbytes == 3 * 224 * 224 + 8
    with pytest.raises(TypeError, match="expected a pickled RowSchema"):
        rows.RowSchema.from_bytes(pickle.dumps({"not": "a schema"}))


def test_leaf_offsets_and_paths():
    schema = rows.learn_schema({"image": np.zeros((3, 8, 8), np.uint8), "label": 1, "w": Point(0.5, np.float16(1))}, 10)
    by_path = {leaf.path: leaf for leaf in schema.leaves}
    assert list(by_path) == ["batch['image']", "batch['label']", "batch['w'].x", "batch['w'].y"]
    image = by_path["batch['image']"]
    assert (image.row_nbytes, image.row_shape, image.dtype) == (192, (3, 8, 8), torch.uint8)
    assert by_path["batch['w'].y"].dtype == torch.float16 and by_path["batch['w'].y"].row_nbytes == 2
    for leaf in schema.leaves:
        assert leaf.offset % layout.ALIGN == 0
        assert leaf.offset + 10 * leaf.row_nbytes <= schema.descriptor_offset


# -- seeding --------------------------------------------------------------------------------------


def _draws(seed: int):
    rows.seed_sample(seed)
    return (random.random(), random.getrandbits(64), tuple(np.random.rand(3)), np.random.randint(0, 2**31),
            tuple(torch.rand(3).tolist()), torch.randint(0, 2**31, ()).item())


def test_sample_seed_formula():
    key = struct.pack("<4Q", 12345, 2, 17, 5)
    want = int.from_bytes(hashlib.blake2b(key, digest_size=8, person=b"shmloader-rows").digest(), "little") % 2**63
    assert rows.sample_seed(12345, 2, 17, 5) == want
    assert 0 <= rows.sample_seed(-1, 0, 0, 0) < 2**63
    # below 2**63 as torch's worker seeds are: torch.initial_seed() fits an int64 (it did not for
    # about half the samples)
    assert max(rows.sample_seed(7, 0, b, r) for b in range(64) for r in range(64)) < 2**63
    assert rows.sample_seed(-1, 0, 0, 0) == rows.sample_seed(2**64 - 1, 0, 0, 0)


def test_seeding_is_per_sample():
    seeds = {(e, b, r): rows.sample_seed(99, e, b, r) for e in range(3) for b in range(10) for r in range(16)}
    assert len(set(seeds.values())) == len(seeds)
    assert rows.sample_seed(98, 0, 0, 0) != rows.sample_seed(99, 0, 0, 0)
    first = _draws(seeds[(1, 4, 3)])
    random.random(), np.random.rand(), torch.rand(1)  # whatever a worker did before
    assert _draws(rows.sample_seed(99, 1, 4, 3)) == first
    other = _draws(seeds[(1, 4, 2)])
    assert all(a != b for a, b in zip(first, other))


def test_seeding_matches_in_another_process():
    seed = rows.sample_seed(7, 0, 3, 1)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            os.write(write, pickle.dumps(_draws(seed)))
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        theirs = pickle.loads(pipe.read())
    os.waitpid(pid, 0)
    assert theirs == _draws(seed)
