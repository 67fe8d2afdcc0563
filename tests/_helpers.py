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
    """`got` equals `want` leaf for leaf, with the same container and leaf types, dtypes, shapes."""
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(got, want), f"{path}: values differ"
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        np.testing.assert_array_equal(got, want, err_msg=path)
    elif isinstance(want, collections.abc.Mapping):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


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
