"""Small helpers for the loader tests: batch comparison, torch side-by-side runs, zero-copy checks.
(Leak checks: the `no_leaks` fixture and helpers of tests/conftest.py.)"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses

import numpy as np
import torch
from torch.utils.data import DataLoader

from shmloader import ShmDataLoader

# -- comparing batches ------------------------------------------------------------------------------


def assert_same(got, want, path: str = "batch") -> None:
    """`got` equals `want` leaf for leaf: the same container and leaf types (tensor subclasses and
    masked arrays exactly), dtypes (byte order included), shapes, strides of the dimensions that
    have any (size > 1), subclass attributes, masks and fill values, and bytes, bit for bit (NaN
    payloads included); and the same plain tensors share a storage (assert_same_sharing)."""
    _assert_same_leaves(got, want, path)
    assert_same_sharing(got, want, path)


def _plain_tensors(batch, path: str, out: dict) -> dict:
    """path -> tensor for each non-empty plain tensor of a batch (dicts, lists, tuples)."""
    if type(batch) is torch.Tensor and batch.layout == torch.strided and batch.numel():
        out[path] = batch
    elif isinstance(batch, collections.abc.Mapping):
        for key, value in batch.items():
            _plain_tensors(value, f"{path}[{key!r}]", out)
    elif isinstance(batch, (list, tuple)):
        for i, value in enumerate(batch):
            _plain_tensors(value, f"{path}[{i}]", out)
    return out


def _storage_groups(tensors: dict) -> dict:
    groups: dict = {}
    for path, tensor in tensors.items():
        groups.setdefault(tensor.untyped_storage()._cdata, []).append(path)
    return groups


def assert_same_sharing(got, want, path: str = "batch") -> None:
    """Tensors of `got` that share a storage share one in torch's `want` too, at the same
    storage offsets (never a sharing torch lacks), and torch's tensors sharing a storage no
    bigger than the bytes they span share one in `got` (layout.py, NOTE [ Tensors sharing a
    storage ]: a storage bigger than that travels as copies of the views)."""
    got_tensors, want_tensors = _plain_tensors(got, path, {}), _plain_tensors(want, path, {})
    want_group_of = {p: tuple(g) for g in _storage_groups(want_tensors).values() for p in g}
    for group in _storage_groups(got_tensors).values():
        if len(group) > 1:
            assert want_group_of.get(group[0]) == tuple(group), f"{group} share a storage; under torch {want_group_of.get(group[0])}"
            for p in group:
                assert got_tensors[p].storage_offset() == want_tensors[p].storage_offset(), (
                    f"{p}: storage_offset {got_tensors[p].storage_offset()} != {want_tensors[p].storage_offset()}")
    got_group_of = {p: tuple(g) for g in _storage_groups(got_tensors).values() for p in g}
    for group in _storage_groups(want_tensors).values():
        storage = want_tensors[group[0]].untyped_storage()
        spans = sum((1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()
                    for t in (want_tensors[p] for p in group))
        if len(group) > 1 and storage.nbytes() <= spans:
            assert got_group_of.get(group[0]) == tuple(group), (
                f"under torch {group} share a storage; here {got_group_of.get(group[0])}")


def _assert_same_leaves(got, want, path: str) -> None:
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        _assert_same_tensor(got, want, path)
    elif isinstance(want, np.ndarray):
        _assert_same_array(got, want, path)
    elif isinstance(want, collections.abc.Mapping):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for key in want:
            _assert_same_leaves(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same_leaves(g, w, f"{path}[{i}]")
    elif dataclasses.is_dataclass(want) and not isinstance(want, type):
        for field in dataclasses.fields(want):
            _assert_same_leaves(getattr(got, field.name), getattr(want, field.name), f"{path}.{field.name}")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def _laid_out(shape, strides) -> tuple:
    """The strides that matter: those of dimensions with more than one element (none at all in
    an empty array)."""
    if 0 in tuple(shape):
        return ()
    return tuple(step for n, step in zip(shape, strides) if n > 1)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's values as bytes in C order (lazy conjugation and negation applied)."""
    plain = tensor.detach().as_subclass(torch.Tensor).resolve_conj().resolve_neg()
    dense = torch.empty(plain.numel(), dtype=plain.dtype)
    dense.copy_(plain.reshape(-1))
    return dense.view(torch.uint8).numpy().tobytes()


def _assert_same_tensor(got: torch.Tensor, want: torch.Tensor, path: str) -> None:
    assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{path}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.layout == want.layout, f"{path}: layout {got.layout} != {want.layout}"
    assert got.requires_grad == want.requires_grad, f"{path}: requires_grad {got.requires_grad}"
    if want.layout != torch.strided:
        assert torch.equal(got.to_dense(), want.to_dense()), f"{path}: values differ"
        return
    assert _laid_out(got.shape, got.stride()) == _laid_out(want.shape, want.stride()), (
        f"{path}: strides {got.stride()} != {want.stride()}")
    assert tensor_bytes(got) == tensor_bytes(want), f"{path}: values differ"
    assert_same(vars(got), vars(want), f"{path}.__dict__")  # a subclass's metadata


def _assert_same_array(got: np.ndarray, want: np.ndarray, path: str) -> None:
    assert got.dtype == want.dtype and got.dtype.str == want.dtype.str, f"{path}: dtype {got.dtype.str} != {want.dtype.str}"
    assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
    assert _laid_out(got.shape, got.strides) == _laid_out(want.shape, want.strides), (
        f"{path}: strides {got.strides} != {want.strides}")
    if isinstance(want, np.ma.MaskedArray):
        assert (got.mask is np.ma.nomask) == (want.mask is np.ma.nomask), f"{path}: mask {got.mask!r} != {want.mask!r}"
        mask, want_mask = np.ma.getmaskarray(got), np.ma.getmaskarray(want)
        assert mask.tobytes() == want_mask.tobytes(), f"{path}: mask {mask} != {want_mask}"
        assert _laid_out(mask.shape, mask.strides) == _laid_out(want_mask.shape, want_mask.strides), (
            f"{path}: mask strides {mask.strides} != {want_mask.strides}")
        fill, want_fill = np.asarray(got.fill_value), np.asarray(want.fill_value)
        assert fill.dtype == want_fill.dtype and fill.tobytes() == want_fill.tobytes(), (
            f"{path}: fill_value {got.fill_value!r} != {want.fill_value!r}")
        assert got.hardmask == want.hardmask, f"{path}: hardmask {got.hardmask} != {want.hardmask}"
        assert got.baseclass is want.baseclass, f"{path}: baseclass {got.baseclass} != {want.baseclass}"
        got, want = got.data, want.data
    if want.dtype.hasobject:
        assert_same(got.tolist(), want.tolist(), path)
    else:
        assert got.tobytes() == want.tobytes(), f"{path}: values differ"


def assert_same_batches(got: list, want: list) -> None:
    assert len(got) == len(want), f"{len(got)} batches, torch gives {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same(g, w, f"batch #{i}")


def seeded(seed: int = 1234) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def both(dataset, seed: int | None = None, **kwargs) -> tuple[ShmDataLoader, DataLoader]:
    """A ShmDataLoader and a torch DataLoader with the same arguments (and equal generators)."""
    if seed is not None:
        return (ShmDataLoader(dataset, generator=seeded(seed), **kwargs),
                DataLoader(dataset, generator=seeded(seed), **kwargs))
    return ShmDataLoader(dataset, **kwargs), DataLoader(dataset, **kwargs)


def collect(loader) -> list:
    """One epoch's batches, each deep-copied out of its slot as it arrives (holding every batch
    itself would fill the ring: a loop that keeps them all must copy them, or raise the cap)."""
    return [copy.deepcopy(batch) for batch in loader]


def epochs(loader, n: int = 1) -> list[list]:
    return [collect(loader) for _ in range(n)]


def freeze(obj):
    """A hashable, comparable image of a batch (for order-insensitive comparisons)."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", str(obj.dtype), tuple(obj.shape), tuple(obj.flatten().tolist()))
    if isinstance(obj, np.ndarray):
        return ("ndarray", str(obj.dtype), obj.shape, tuple(obj.flatten().tolist()))
    if isinstance(obj, collections.abc.Mapping):
        return ("map", tuple((k, freeze(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(freeze(v) for v in obj))
    return obj


# -- zero copy --------------------------------------------------------------------------------------


def address_of(leaf) -> int:
    if isinstance(leaf, torch.Tensor):
        return leaf.data_ptr()
    return leaf.__array_interface__["data"][0]


def nbytes_of(leaf) -> int:
    if isinstance(leaf, torch.Tensor):
        return leaf.numel() * leaf.element_size()
    return leaf.nbytes


def in_ring(leaf, iterator) -> bool:
    """Whether all of `leaf`'s memory lies inside one segment of the iterator's ring."""
    start = address_of(leaf)
    end = start + nbytes_of(leaf)
    return any(s.address <= start and end <= s.address + s.size for s in iterator._ring.segments())


def array_leaves(obj):
    """Every tensor and numpy array in a batch (dicts, lists, tuples, dataclasses)."""
    if isinstance(obj, dict):
        for value in obj.values():
            yield from array_leaves(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from array_leaves(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        yield from array_leaves([getattr(obj, f.name) for f in dataclasses.fields(obj)])
    elif isinstance(obj, (torch.Tensor, np.ndarray)):
        yield obj
