"""Bad input, fuzzed: every batch comes back bit for bit as torch's DataLoader delivers it.

Hypothesis builds nested batches (dict / list / tuple / namedtuple, depth up to 4) whose leaves
are numpy arrays of every dtype torch supports, torch tensors (bfloat16 included), 0-d, empty,
long, non-contiguous, Fortran-ordered, negative-stride and conjugated layouts with random bit
patterns (so NaN payloads and signed zeros too), strings, None and Python numbers.

  * layout, custom collate (identity): plan_batch → write_batch into a real segment → read_batch
    gives back the same structure, leaf types, dtypes, shapes and bytes;
  * layout, default collate: collate_into_slot → slot → read_batch equals default_collate;
  * end to end: ShmDataLoader equals torch's DataLoader on the same samples, for both collates,
    and on samples made in the worker (born in the slot), as they are or beside views of them;
  * unsupported leaves (open files, lambdas, object arrays holding them, CUDA-less oddities)
    raise LayoutError naming the leaf's path, in the layout and through a real loader.
"""

from __future__ import annotations

import collections
import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset, default_collate

from shmloader import LayoutError, ShmDataLoader, _ring, layout
from shmloader.segment import create_segment

pytestmark = pytest.mark.usefixtures("no_leaks")

Pair = collections.namedtuple("Pair", ["first", "second"])

NUMPY_DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.float16,
                np.float32, np.float64, np.complex64, np.complex128] + [
                    getattr(np, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)]
TORCH_DTYPES = [torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
                torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
                torch.complex128]
LAYOUTS = ["c", "f", "strided", "negative", "transposed", "conj"]
FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -- leaf specs: what to build; `materialise` builds it with a given seed ----------------------


shapes = st.one_of(
    st.lists(st.integers(0, 4), max_size=4).map(tuple),  # 0-d, empty, small
    st.sampled_from([(1, 70_001), (3, 0, 5), (40_000,), (96, 130)]),  # long dimensions, a large 2-d
)
array_specs = st.tuples(st.just("numpy"), st.sampled_from(NUMPY_DTYPES), shapes, st.sampled_from(LAYOUTS))
tensor_specs = st.tuples(st.just("torch"), st.sampled_from(TORCH_DTYPES), shapes, st.sampled_from(LAYOUTS))
scalar_specs = st.tuples(st.sampled_from(["str", "int", "float", "bool"]))


def _bits(rng: np.random.Generator, dtype: np.dtype, shape: tuple) -> np.ndarray:
    """A C-ordered array of `shape` with random bit patterns (valid ones for bool)."""
    count = math.prod(shape)
    raw = rng.integers(0, 256, size=count * dtype.itemsize, dtype=np.uint8)
    if dtype == np.bool_:
        raw %= 2
    return raw.view(dtype).reshape(shape)


def _numpy_leaf(rng, dtype, shape, how):
    dtype = np.dtype(dtype)
    if how == "f":
        return np.asfortranarray(_bits(rng, dtype, shape))
    if how == "strided" and shape:
        return _bits(rng, dtype, shape[:-1] + (shape[-1] * 2,))[..., ::2]
    if how == "negative" and shape:
        return _bits(rng, dtype, shape)[::-1]
    if how == "transposed" and len(shape) >= 2:
        return _bits(rng, dtype, shape[::-1]).T
    return _bits(rng, dtype, shape)


def _torch_leaf(rng, dtype, shape, how):
    if dtype == torch.bfloat16:
        tensor = torch.from_numpy(_bits(rng, np.dtype(np.uint16), shape).copy()).view(torch.bfloat16)
    else:
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        tensor = torch.from_numpy(_bits(rng, np_dtype, shape).copy())
    if how == "strided" and tensor.dim():
        wide = torch.cat([tensor, tensor], dim=-1) if tensor.shape[-1] else tensor
        return wide[..., ::2] if tensor.shape[-1] else tensor
    if how == "transposed" and tensor.dim() >= 2:
        return tensor.mT.contiguous().mT
    if how == "conj" and tensor.is_complex():
        return tensor.conj()  # a lazily conjugated view: its bytes are not its values
    return tensor


def materialise(spec, rng: np.random.Generator, with_none: bool = True):
    kind = spec[0]
    if kind == "numpy":
        return _numpy_leaf(rng, *spec[1:])
    if kind == "torch":
        return _torch_leaf(rng, *spec[1:])
    if kind == "str":
        return "".join(chr(c) for c in rng.integers(32, 0x2FF, size=int(rng.integers(0, 8))))
    if kind == "int":
        return int(rng.integers(-(2**63), 2**63 - 1))
    if kind == "float":
        return struct.unpack("<d", rng.bytes(8))[0]  # any bits: NaN payloads, infinities, -0.0
    if kind == "bool":
        return bool(rng.integers(0, 2))
    if kind == "none":
        return None if with_none else 0
    if kind == "list":
        return [materialise(s, rng, with_none) for s in spec[1]]
    if kind == "tuple":
        return tuple(materialise(s, rng, with_none) for s in spec[1])
    if kind == "pair":
        return Pair(materialise(spec[1][0], rng, with_none), materialise(spec[1][1], rng, with_none))
    if kind == "dict":
        return {key: materialise(s, rng, with_none) for key, s in spec[1]}
    raise AssertionError(kind)


def specs(leaves):
    """Nested containers of leaf specs, depth up to 4."""
    keys = st.text(alphabet="abcdefgh_", min_size=1, max_size=4)

    def extend(children):
        return st.one_of(
            st.lists(children, max_size=3).map(lambda c: ("list", c)),
            st.lists(children, max_size=3).map(lambda c: ("tuple", c)),
            st.tuples(children, children).map(lambda c: ("pair", c)),
            st.dictionaries(keys, children, max_size=3).map(lambda d: ("dict", sorted(d.items()))),
        )

    return _depth_limited(leaves, extend, 4)


def _depth_limited(leaves, extend, depth):
    if depth == 0:
        return leaves
    return st.one_of(leaves, extend(_depth_limited(leaves, extend, depth - 1)))


ALL_LEAVES = st.one_of(array_specs, tensor_specs, scalar_specs, st.just(("none",)))


# -- comparison, bit for bit ---------------------------------------------------------------------


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().resolve_conj().resolve_neg()
    dense = torch.empty(t.numel(), dtype=t.dtype)  # standard strides (contiguous() keeps odd
    dense.copy_(t.reshape(-1))                      # strides on size-1 dimensions)
    return dense.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_same(got, want, path="batch"):
    assert type(got) is type(want), f"{path}: got {type(got).__name__}, want {type(want).__name__}"
    if isinstance(want, np.ndarray):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), f"{path}: {got.dtype}{got.shape} vs {want.dtype}{want.shape}"
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), f"{path}: bytes differ"
    elif isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), f"{path}: {got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}"
        assert _tensor_bytes(got) == _tensor_bytes(want), f"{path}: bytes differ"
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{path}: keys {list(got)} vs {list(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} vs {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert struct.pack("<d", got) == struct.pack("<d", want), f"{path}: {got!r} vs {want!r}"
    else:
        assert got == want, f"{path}: {got!r} vs {want!r}"


def through_slot(batch, collated: bool = False):
    """The batch as the main process would read it back from a real slot."""
    structure = layout.collate_into_slot(batch) if collated else batch
    plan = layout.plan_batch(structure)
    segment = create_segment(plan.total_bytes, 0)
    assert segment.claim(0, 0) == _ring.FREE
    layout.write_batch(segment, plan)
    segment.publish(len(plan.descriptor), plan.total_bytes, plan.descriptor_offset)
    lease = _ring.SlotLease(segment, 0, 0, 0, None)
    return layout.read_batch(lease, plan.descriptor, plan.total_bytes)


# -- the layout, many examples ---------------------------------------------------------------------


@pytest.mark.timeout(240)
@FUZZ
@given(spec=specs(ALL_LEAVES), seed=st.integers(0, 2**32 - 1))
def test_identity_collate_round_trips_bit_for_bit(spec, seed):
    batch = materialise(spec, np.random.default_rng(seed))
    assert_same(through_slot(batch), batch)


@pytest.mark.timeout(240)
@FUZZ
@given(spec=specs(st.one_of(array_specs, tensor_specs, scalar_specs)), seed=st.integers(0, 2**32 - 1),
       batch_size=st.integers(1, 4))
def test_default_collate_into_slot_equals_default_collate(spec, seed, batch_size):
    rng = np.random.default_rng(seed)
    samples = [materialise(spec, rng, with_none=False) for _ in range(batch_size)]
    try:
        want = default_collate(samples)
    except (TypeError, RuntimeError, ValueError) as exc:  # an empty dict sample, a negative stride: we refuse it too
        with pytest.raises(type(exc)):
            through_slot(samples, collated=True)
        return
    assert_same(through_slot(samples, collated=True), want)


# -- end to end, fewer examples --------------------------------------------------------------------


END_TO_END = settings(max_examples=16, deadline=None, database=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
LOADER_SPECS = specs(st.one_of(array_specs, tensor_specs, scalar_specs))


class _Samples(Dataset):
    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def _as_is(samples):
    return samples


@pytest.mark.timeout(240)
@END_TO_END
@given(spec=LOADER_SPECS, seed=st.integers(0, 2**32 - 1),
       custom=st.booleans())
def test_loader_matches_torch_dataloader(spec, seed, custom):
    rng = np.random.default_rng(seed)
    dataset = _Samples([materialise(spec, rng, with_none=False) for _ in range(6)])
    kwargs = dict(batch_size=3, collate_fn=_as_is if custom else None)
    try:
        want = list(DataLoader(dataset, **kwargs)) if custom else [
            default_collate(dataset.samples[i:i + 3]) for i in (0, 3)]
    except (TypeError, RuntimeError, ValueError):
        return  # samples torch cannot collate either (covered by the layout fuzz above)
    got = list(ShmDataLoader(dataset, num_workers=2, multiprocessing_context="fork", **kwargs))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_same(g, w)
    del got


class _BornInWorker(Dataset):
    """Samples materialised in the worker (a custom collate's samples are born in the slot: NOTE
    in shmloader/samples_in_slot.py), the same for any process: seeded by the index."""

    def __init__(self, spec, seed: int):
        self.spec, self.seed = spec, seed

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return materialise(self.spec, np.random.default_rng(self.seed + i), with_none=False)


def _views_of(value):
    """Transposed, reversed and Fortran-ordered views and copies of every array leaf."""
    if isinstance(value, np.ndarray):
        return (value.T, value[::-1] if value.ndim else value, np.asfortranarray(value))
    if isinstance(value, torch.Tensor):
        return value.mT if value.dim() >= 2 else value.flip(0) if value.dim() else value
    if isinstance(value, dict):
        return {k: _views_of(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_views_of(v) for v in value]
    return value


def _with_views(samples):
    return samples, _views_of(samples)


@pytest.mark.timeout(240)
@END_TO_END
@given(spec=LOADER_SPECS, seed=st.integers(0, 2**32 - 1),
       with_views=st.booleans())
def test_samples_born_in_the_worker_match_torch_dataloader(spec, seed, with_views):
    """As above with samples made in the worker, so that large ones are born in the slot, and a
    collate that returns them as they are or beside views and Fortran copies of them."""
    dataset = _BornInWorker(spec, seed)
    kwargs = dict(batch_size=3, collate_fn=_with_views if with_views else _as_is)
    # torch's in-process batches: its workers lose the conj bit of a 0-d conj tensor they made
    want = list(DataLoader(dataset, **kwargs))
    got = list(ShmDataLoader(dataset, num_workers=2, multiprocessing_context="fork", **kwargs))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_same(g, w)
    del got


# -- unsupported leaves ----------------------------------------------------------------------------


def _unsupported_cases(tmp_path):
    opened = open(tmp_path / "f.txt", "w")
    return opened, [
        ({"a": [1, (2, np.array([None, opened], dtype=object))]}, r"batch\['a'\]\[1\]\[1\]", "cannot be pickled"),
        ({"a": Pair(1, {"file": opened})}, r"batch\['a'\]\.second\['file'\]", "cannot be pickled"),
        ([0, [1, 2, lambda x: x]], r"batch\[1\]\[2\]", "cannot be pickled"),
    ]


@pytest.mark.timeout(30)
def test_unsupported_leaves_name_their_path(tmp_path):
    opened, cases = _unsupported_cases(tmp_path)
    try:
        for batch, where, why in cases:
            with pytest.raises(LayoutError, match=f"at {where}: .*{why}"):
                layout.plan_batch(batch)
    finally:
        opened.close()


class _NotPicklable:
    def __reduce__(self):
        raise TypeError("this object refuses to be pickled")


_not_picklable = _NotPicklable()


class _BadLeaf(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"ok": np.zeros(2), "bad": [np.array([None, _not_picklable], dtype=object)] if i == 2 else [np.ones(1)]}


@pytest.mark.timeout(60)
def test_unsupported_leaf_through_the_loader_names_worker_and_path():
    loader = ShmDataLoader(_BadLeaf(), batch_size=1, num_workers=2, collate_fn=_as_is,
                           multiprocessing_context="fork")
    delivered = 0
    with pytest.raises(LayoutError) as info:
        for batch in loader:
            delivered += 1
            del batch
    message = str(info.value)
    assert delivered == 2 and isinstance(info.value, TypeError)
    assert "worker 0" in message and "laying out the batch" in message
    assert "at batch[0]['bad'][0]" in message and "cannot be pickled" in message
    del info
