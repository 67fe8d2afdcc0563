"""Tensors born in the slot: torch's side of the slot arena (NOTE [ One copy for a numpy
collate_fn ] in worker.py).

While a worker runs a custom collate_fn, numpy's allocator hands out large blocks from the slot
the batch will be written to (csrc/arena.h), so numpy arrays need no second copy.  torch tensors
come from torch's own allocator, which cannot be redirected; two things bring them into the slot:

* `empty_tensor(shape, dtype)`, the explicit form: a tensor whose memory is a numpy block, so in
  the slot inside a collate_fn (and a plain heap tensor anywhere else).  Fill it with
  ``torch.stack(samples, out=...)``, ``torch.cat(..., out=...)`` or by rows.
* `SlotTensorMode`, active around the collate_fn: ``torch.stack`` / ``torch.cat`` called without
  ``out=`` on plain CPU tensors get an `empty_tensor` as their ``out=``, when torch's own result
  would be contiguous and nothing needs autograd, so the result is the same tensor, bytes, dtype
  and strides, born in the slot.  Anything else runs untouched.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

_BUILDERS = frozenset({torch.stack, torch.cat, torch.concat, torch.concatenate})


def empty_tensor(shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor whose memory numpy allocates: inside a worker's
    collate_fn it lies in the batch's slot, so returning it (filled) costs no copy."""
    shape = tuple(shape)
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=dtype)  # no bytes (numpy gives an empty block stride 0)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = np.empty(math.prod(shape) * itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


def _plain_cpu(tensors) -> bool:
    return all(type(t) is torch.Tensor and t.device.type == "cpu" and t.layout == torch.strided
               for t in tensors)


class SlotTensorMode(TorchFunctionMode):
    """Give torch.stack / torch.cat an `empty_tensor` as their out= (see the module docstring);
    `min_bytes` below which the slot arena would not take the block anyway."""

    def __init__(self, min_bytes: int):
        super().__init__()
        self.min_bytes = min_bytes
        self.builder_calls = 0  # torch.stack / torch.cat calls seen (a worker learns from it)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _BUILDERS and "out" not in kwargs:
            self.builder_calls += 1
            out = self._output_for(func, args, kwargs)
            if out is not None:
                return func(*args, **kwargs, out=out)
        return func(*args, **kwargs)

    def _output_for(self, func, args, kwargs) -> torch.Tensor | None:
        tensors = args[0] if args else kwargs.get("tensors")
        if not isinstance(tensors, (list, tuple)) or not tensors or not _plain_cpu(tensors):
            return None
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return None  # out= does not support autograd
        dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
        if sum(t.numel() for t in tensors) * dtype.itemsize < self.min_bytes:
            return None  # the result's bytes: too few for the arena
        spec = _contiguous_result(func, tensors, args, kwargs)
        if spec is not None:
            return empty_tensor(spec, dtype)
        try:  # torch's own shape, dtype and memory layout of the result, without computing it
            result = func([t.to("meta") for t in tensors], *args[1:], **kwargs)
        except Exception:
            return None  # torch raises its own error when the real call runs
        if not result.is_contiguous() or result.numel() * result.element_size() < self.min_bytes:
            return None
        return empty_tensor(result.shape, result.dtype)


def _contiguous_result(func, tensors, args, kwargs) -> tuple[int, ...] | None:
    """The shape of torch.stack / torch.cat of contiguous tensors along an int `dim` (their result
    is contiguous, of the promoted dtype), worked out here: torch's meta kernels, which tell it
    in every other case, take a second on their first call in a fresh worker.  None where those
    are needed: other layouts, other arguments, shapes torch would refuse, cat's empty 1-d
    tensors."""
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if type(dim) is not int or len(args) > 2 or set(kwargs) - {"tensors", "dim"}:
        return None
    if not all(t.is_contiguous() for t in tensors):
        return None
    first = tuple(tensors[0].shape)
    if func is torch.stack:
        if any(tuple(t.shape) != first for t in tensors) or not -len(first) - 1 <= dim <= len(first):
            return None
        dim %= len(first) + 1
        return (*first[:dim], len(tensors), *first[dim:])
    rank = len(first)
    if rank == 0 or not -rank <= dim < rank:
        return None
    dim %= rank
    for t in tensors:
        shape = tuple(t.shape)
        if len(shape) != rank or shape[:dim] != first[:dim] or shape[dim + 1:] != first[dim + 1:] or t.numel() == 0:
            return None
    return (*first[:dim], sum(t.shape[dim] for t in tensors), *first[dim + 1:])
