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
  and strides, born in the slot.  ``torch.nn.utils.rnn.pad_sequence`` (dynamic padding, the
  usual collate_fn of sequences), which has no ``out=``, is made the way torch makes it (a
  tensor of the first sequence's dtype, each sequence copied into its place, the padding value
  everywhere else) into an `empty_tensor`, for sequences of one dtype and trailing shape.
  A dtype conversion (``.float()``, ``.half()``, ``.double()``, ``.bfloat16()``, ``.to(dtype)``)
  and the arithmetic that turns pixels into inputs (``+ - * /`` by a number or by a tensor of the
  same shape, ``torch.add/sub/mul/div``) of a contiguous tensor are made the way torch makes
  them (``copy_`` into, or the op's ``out=``, an `empty_tensor` of torch's result dtype).
  Anything else runs untouched.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

_BUILDERS = frozenset({torch.stack, torch.cat, torch.concat, torch.concatenate})
_PAD_SEQUENCE = torch._C._nn.pad_sequence  # what torch.nn.utils.rnn.pad_sequence calls
_PAD_ARGUMENTS = ("sequences", "batch_first", "padding_value", "padding_side")
_RESIZES = frozenset({torch.Tensor.resize_, torch.Tensor.resize_as_})
_LARGEST_ITEMSIZE = 16  # complex128: a tensor of fewer elements makes no result of min_bytes
_CONVERSIONS = {torch.Tensor.float: torch.float32, torch.Tensor.double: torch.float64,
                torch.Tensor.half: torch.float16, torch.Tensor.bfloat16: torch.bfloat16}
_ARITHMETIC = {f: op for op in (torch.add, torch.sub, torch.mul, torch.div)
               for f in (op, getattr(torch.Tensor, op.__name__))}  # x / 255 calls Tensor.div


def empty_tensor(shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor whose memory numpy allocates: inside a worker's
    collate_fn it lies in the batch's slot, so returning it (filled) costs no copy.  Like
    torch.from_numpy's, its storage cannot grow: resize_ it larger and torch raises."""
    shape = tuple(shape)
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=dtype)  # no bytes (numpy gives an empty block stride 0)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = np.empty(math.prod(shape) * itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


def _plain_cpu(tensors) -> bool:
    return all(type(t) is torch.Tensor and t.device.type == "cpu" and t.layout == torch.strided
               for t in tensors)


PAD_MIN_SEQUENCE_BYTES = 32 * 1024


class SlotTensorMode(TorchFunctionMode):
    """Give torch.stack / torch.cat an `empty_tensor` as their out= (see the module docstring);
    `min_bytes` below which the slot arena would not take the block anyway.  pad_sequence is made
    here only for sequences of `min_sequence_bytes` or more on average: it copies them one by one
    from Python, about 7 us a sequence, which for short ones (token ids) costs more than torch's
    own pad_sequence and the copy into the slot together (4x for 256 sequences of 0.4 KiB)."""

    def __init__(self, min_bytes: int, min_sequence_bytes: int = PAD_MIN_SEQUENCE_BYTES):
        super().__init__()
        self.min_bytes = min_bytes
        self.min_sequence_bytes = min_sequence_bytes
        self.builder_calls = 0  # torch.stack / torch.cat calls seen (a worker learns from it)
        self.made: set[int] = set()  # the storages (data pointers) of the tensors made here

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _BUILDERS and "out" not in kwargs:
            self.builder_calls += 1
            out = self._output_for(func, args, kwargs)
            if out is not None:
                self.made.add(out.untyped_storage().data_ptr())
                return func(*args, **kwargs, out=out)
        elif func is _PAD_SEQUENCE:  # counted as a builder call only where made here
            padded = self._pad_sequence(args, kwargs)
            if padded is not None:
                self.made.add(padded.untyped_storage().data_ptr())
                return padded
        elif func in _RESIZES and args and type(args[0]) is torch.Tensor:
            self._resizable(args[0])
        elif func is torch.Tensor.to or func in _CONVERSIONS:
            out = self._converted(func, args, kwargs)
            if out is not None:
                return out
        elif func in _ARITHMETIC and not kwargs and len(args) == 2:
            out = self._arithmetic_output(*args, func)
            if out is not None:
                return _ARITHMETIC[func](*args, out=out)
        return func(*args, **kwargs)

    def _source(self, tensor) -> bool:
        """Whether `tensor` is one whose result torch would make contiguous (itself contiguous,
        plain, on the CPU, without a conj/neg bit or autograd to follow)."""
        return (type(tensor) is torch.Tensor and _plain_cpu((tensor,)) and tensor.is_contiguous()
                and not (tensor.is_conj() or tensor.is_neg())
                and not (tensor.requires_grad and torch.is_grad_enabled()))

    def _made(self, out: torch.Tensor) -> torch.Tensor:
        self.builder_calls += 1
        self.made.add(out.untyped_storage().data_ptr())
        return out

    def _converted(self, func, args, kwargs) -> torch.Tensor | None:
        """tensor.float() / .to(dtype) and the like, born in the slot; None where torch should
        make it (other arguments, no conversion, too few bytes)."""
        if func is torch.Tensor.to:
            given = dict(zip(("self", "dtype"), args), **kwargs)
            if len(args) > 2 or set(given) != {"self", "dtype"}:
                return None
            dtype = given["dtype"]
        elif len(args) == 1 and not kwargs:
            dtype = _CONVERSIONS[func]
        else:
            return None
        tensor = args[0]
        if type(tensor) is not torch.Tensor or tensor.numel() * _LARGEST_ITEMSIZE < self.min_bytes:
            return None  # (cheap first: small tensors are the many)
        if not isinstance(dtype, torch.dtype) or not self._source(tensor) or tensor.dtype == dtype:
            return None  # (the same dtype: torch returns the tensor itself)
        if tensor.numel() * dtype.itemsize < self.min_bytes:
            return None
        return self._made(empty_tensor(tensor.shape, dtype).copy_(tensor))

    def _arithmetic_output(self, a, b, func) -> torch.Tensor | None:
        """An `empty_tensor` for torch.add/sub/mul/div(a, b) to write into, of the result's dtype
        and shape: `a` a contiguous tensor, `b` a number or a contiguous tensor of a's shape or
        none (0-d); None otherwise."""
        if type(a) is not torch.Tensor or a.numel() * _LARGEST_ITEMSIZE < self.min_bytes:
            return None  # (cheap first: small tensors are the many)
        if not self._source(a) or a.dtype == torch.bool:
            return None
        if type(b) in (int, float):
            pass
        elif type(b) is not torch.Tensor or not self._source(b) or (b.dim() and b.shape != a.shape):
            return None
        dtype = torch.result_type(a, b)
        if _ARITHMETIC[func] is torch.div and not (dtype.is_floating_point or dtype.is_complex):
            dtype = torch.get_default_dtype()  # true division of integers
        if dtype == torch.bool or a.numel() * dtype.itemsize < self.min_bytes:
            return None
        return self._made(empty_tensor(a.shape, dtype))

    def _resizable(self, tensor: torch.Tensor) -> None:
        """A tensor made here lies in a block of the slot, which cannot grow: before it is
        resized, it gets a storage of its own on the heap (a copy, as torch's result would have
        been), so that resize_ works as it does on torch's result."""
        storage = tensor.untyped_storage()
        if not storage.resizable() and storage.data_ptr() in self.made:
            tensor.set_(storage.clone(), tensor.storage_offset(), tensor.shape, tensor.stride())

    def _pad_sequence(self, args, kwargs) -> torch.Tensor | None:
        """torch's pad_sequence, born in the slot; None where torch should make it (several
        dtypes or trailing shapes, autograd, too few bytes, arguments it does not know)."""
        if len(args) > len(_PAD_ARGUMENTS) or set(kwargs) - set(_PAD_ARGUMENTS[len(args):]):
            return None
        given = dict(zip(_PAD_ARGUMENTS, args), **kwargs)
        sequences = given.get("sequences")
        batch_first = given.get("batch_first", False)
        padding_value = given.get("padding_value", 0.0)
        side = given.get("padding_side", "right")
        if (not isinstance(sequences, (list, tuple)) or not sequences or type(batch_first) is not bool
                or side not in ("right", "left") or type(padding_value) not in (float, int, bool)):
            return None
        first = sequences[0]
        try:  # first what is cheap to ask of each: short sequences are left to torch at once
            total_bytes = sum(s.numel() for s in sequences) * first.element_size()
        except (AttributeError, TypeError):
            return None  # not tensors: torch's error
        if total_bytes < max(self.min_bytes, self.min_sequence_bytes * len(sequences)):
            return None
        self.builder_calls += 1
        if not _plain_cpu(sequences) or first.dim() == 0 or any(
                s.dim() != first.dim() or s.shape[1:] != first.shape[1:] or s.dtype != first.dtype for s in sequences):
            return None
        if torch.is_grad_enabled() and any(s.requires_grad for s in sequences):
            return None
        longest = max(len(s) for s in sequences)
        shape = (len(sequences), longest) if batch_first else (longest, len(sequences))
        shape += tuple(first.shape[1:])
        padding_value = float(padding_value)  # a double, as torch's pad_sequence takes it
        torch.empty(0, dtype=first.dtype).fill_(padding_value)  # torch's error where the dtype cannot hold it
        out = empty_tensor(shape, first.dtype)
        rows = out if batch_first else out.transpose(0, 1)  # (sequence, time, ...) either way
        left = side == "left"
        for row, sequence in zip(rows, sequences):
            length = len(sequence)
            if length == longest:
                row.copy_(sequence)
            elif left:
                row[:longest - length].fill_(padding_value)
                row[longest - length:].copy_(sequence)
            else:
                row[:length].copy_(sequence)
                row[length:].fill_(padding_value)
        return out

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
