"""How a batch sits in a slot, and how it comes back out as zero-copy views.

    0            HEADER_BYTES                                    descriptor_offset       payload_end
    | header     | array leaves, each at a 64-byte-aligned offset | descriptor: pickle of the |
    | (ring.h)   | (absolute: from the segment's start)           | batch, leaves left out    |

A batch is any picklable structure.  Its array leaves (numpy arrays, CPU torch tensors, and the
stacked leaves of the default collate) are taken out of the pickle with `persistent_id`: the
descriptor records (kind, offset, dtype, shape) for each and the bytes go to their aligned place
in the slot; arrays a numpy collate_fn allocated in the slot itself (NOTE [ One copy for a numpy
collate_fn ] in worker.py) are described where they are, not copied.  Everything else (containers, str, None, numbers) stays in the small descriptor.  The
main process unpickles the descriptor with `persistent_load` returning views onto the slot, so
any container type (dict, OrderedDict, namedtuple, dataclass) comes back as it was built.

NOTE [ Leaves as torch's DataLoader delivers them ]
  torch's workers pickle a batch; the main process gets whatever that pickle rebuilds.  So does
  shmloader's, with the bytes moved to the slot instead of the pickle:
  * a plain tensor keeps its strides (a transposed or expanded tensor stays so); only the bytes
    from its first to its last element travel, so `storage_offset()` starts at 0, unless other
    tensors of the batch share its storage (NOTE [ Tensors sharing a storage ]);
  * a tensor subclass (torchvision's tv_tensors, a user's subclass) pickles itself with torch's
    own `__reduce_ex__` (its type, `__dict__` and strides), and its storage becomes a leaf;
  * a masked array's data and mask are leaves, rebuilt as numpy's unpickling rebuilds them;
  * object arrays and other ndarray subclasses are pickled whole, as torch pickles them;
  * an empty array or tensor has no bytes to send, but its strides are torch's: numpy unpickles
    an empty array C-ordered, torch keeps a tensor's strides (an "e" leaf carries them);
  * a numpy array comes back C-ordered, or F-ordered if it was Fortran-contiguous, and with a
    non-native byte order swapped into the native one where numpy's pickle (at the protocol
    torch's workers use) swaps it, as numpy's unpickling does.
  With the default collate, a row that torch.as_tensor would convert (a big-endian array) or
  refuse (negative strides) is handed to torch.as_tensor itself: torch's result, torch's error.

NOTE [ Tensors sharing a storage ]
  torch's pickle sends a tensor's whole storage, once however many tensors of the batch view it,
  so a collate_fn returning seq[:, :-1] and seq[:, 1:] (inputs and targets of a language model)
  delivers two views of one storage, each with its storage_offset.  A lone view sends only the
  bytes it spans (cheaper, storage_offset 0).  So the planner counts, on a first pass, the plain
  tensors of each storage and the bytes they span; where two or more share one no bigger than
  those bytes, it plans again with that storage sent whole (an "s" leaf: in place if born in the
  slot) and each tensor a "w" view on it; the unpickler builds the storage once.  A storage much
  bigger than its views (a dataset's tensor the collate_fn slices) is not sent whole: its views
  come back as copies, and the slot holds no more than the bytes they span; unless that storage
  is in shared memory already, where the views go by its fd, as torch sends them ("w" views on
  an "h" storage: NOTE [ Views of a storage already in shared memory ] in shared_views.py).

NOTE [ One object, one leaf ]
  torch's pickle delivers an object that a batch holds twice (a collate_fn returning
  {"x": a, "y": a}) as one object twice.  So does the slot: the planner gives the same object
  the same persistent id (one leaf, written once), pickle writes that id the second time as a
  reference to the first, and the unpickler answers the same id with the leaf it built for it.

With the default collate, samples are not stacked in memory first: `collate_into_slot` runs
torch's own `collate` (so the structure, container types and errors are torch's) with the tensor
and ndarray handlers replaced by `StackedLeaf`, a promise of a (batch, *row) tensor whose rows
are written straight from each sample into the slot.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import pickle
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch

from . import _ring, shared_views, torch_private
from .errors import BatchShapeError, LayoutError, SlotProtocolError, safe_text

HEADER_BYTES = _ring.HEADER_BYTES
ALIGN = _ring.LEAF_ALIGN


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# numpy dtypes whose bytes torch.as_tensor takes as they are.
_NUMPY_TO_TORCH = {
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.complex64): torch.complex64,
    np.dtype(np.complex128): torch.complex128,
}
for _name in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _NUMPY_TO_TORCH[np.dtype(_name)] = getattr(torch, _name)


def is_masked_array(obj) -> bool:
    """Whether `obj` is a numpy MaskedArray itself (not a subclass).  Without touching `np.ma`,
    which imports numpy.ma on first use: about 9 ms of CPU, paid by every worker in its first
    batch where the main process had not imported it (8 workers on 2 cores: about 36 ms of the
    first batch).  A masked array exists only once numpy.ma is imported."""
    ma = sys.modules.get("numpy.ma")
    return ma is not None and type(obj) is ma.MaskedArray


def _describe(leaf) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"{str(leaf.dtype).removeprefix('torch.')}{list(leaf.shape)}"
    if isinstance(leaf, np.ndarray):
        return f"{leaf.dtype}{list(leaf.shape)}"
    return type(leaf).__name__


# -- the default collate, straight into the slot ------------------------------------------------


class StackedLeaf:
    """A (len(rows), *row_shape) tensor of `dtype`, not yet materialised: row i is rows[i]."""

    __slots__ = ("rows", "dtype", "row_shape", "problem")

    def __init__(self, rows, dtype: torch.dtype, row_shape: tuple[int, ...], problem: str | None = None):
        self.rows = rows
        self.dtype = dtype
        self.row_shape = row_shape
        self.problem = problem

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.rows), *self.row_shape)

    @property
    def row_nbytes(self) -> int:
        return math.prod(self.row_shape) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return len(self.rows) * self.row_nbytes


def _first_mismatch(rows, key) -> str | None:
    """Where the samples' shapes (`key`) first differ, in torch's words too (code written for
    torch's DataLoader may match its message)."""
    first = key(rows[0])
    for i, row in enumerate(rows):
        if key(row) != first:
            return (f"sample 0 is {_describe(rows[0])}, sample {i} is {_describe(row)} (stack expects "
                    f"each tensor to be equal size, but got {list(first)} at entry 0 and {list(key(row))} "
                    f"at entry {i})")
    return None


def is_plain_strided(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s bytes are its values, laid out by its strides in CPU memory: not
    sparse, nested, quantized (its bytes are not its values), meta or on another device."""
    return (tensor.layout == torch.strided and tensor.device.type == "cpu"
            and not tensor.is_nested and not tensor.is_quantized)


def _stack_tensors(batch, *, collate_fn_map=None):
    elem = batch[0]
    plain = all(
        type(t) is torch.Tensor and is_plain_strided(t) and t.dtype == elem.dtype and not t.requires_grad
        for t in batch
    )
    if not plain:  # torch's own semantics in a worker (stack into elem's dtype, its errors)
        if elem.is_nested or elem.layout != torch.strided or elem.device.type == "meta":  # torch's own
            return torch_private.TORCH_COLLATE_TENSOR(batch, collate_fn_map=collate_fn_map)
        sum(t.numel() for t in batch)  # torch's AttributeError for a sample that is no tensor
        return torch.stack(batch, 0, out=elem.new_empty((len(batch), *elem.shape)))
    problem = _first_mismatch(batch, lambda t: tuple(t.shape))
    return StackedLeaf(batch, elem.dtype, tuple(elem.shape), problem)


class _UncollatableArray(Exception):
    """Not a TypeError, so that torch's collate does not catch it and retry (its Mapping branch
    does); collate_into_slot re-raises `error`'s type with the leaf's path in the message."""

    def __init__(self, leaf, error: Exception, sample: int = 0):
        self.leaf, self.error, self.sample = leaf, error, sample


def _torch_takes_as_is(array: np.ndarray) -> bool:
    """Whether torch.as_tensor would take `array`'s memory as it is: it refuses negative strides
    and strides that are not a multiple of the item size (a ValueError in default_collate)."""
    itemsize = array.itemsize
    return all(s >= 0 and s % itemsize == 0 for s in array.strides)


def _all_taken_as_is(batch, dtype: np.dtype) -> bool:
    """Whether every array of `batch` has `dtype` and memory torch takes as it is; the strides
    are checked once per distinct strides (samples of a batch mostly share theirs)."""
    checked = set()
    for array in batch:
        if not isinstance(array, np.ndarray) or array.dtype != dtype:
            return False  # (a list or a number among arrays: torch.as_tensor of each, as torch does)
        strides = array.strides
        if strides not in checked:
            if not _torch_takes_as_is(array):
                return False
            checked.add(strides)
    return True


def _stack_arrays(batch, *, collate_fn_map=None):
    elem = batch[0]
    if torch_private.np_str_obj_array_pattern.search(elem.dtype.str) is not None:
        raise _UncollatableArray(elem, TypeError(torch_private.default_collate_err_msg_format.format(elem.dtype)))
    dtype = _NUMPY_TO_TORCH.get(elem.dtype)
    if dtype is None or not _all_taken_as_is(batch, elem.dtype):
        return _collate_as_tensors(batch, collate_fn_map)
    shape = elem.shape
    problem = None
    for array in batch:
        if array.shape != shape:
            problem = _first_mismatch(batch, lambda a: a.shape)
            break
    return StackedLeaf(batch, dtype, shape, problem)


def _collate_as_tensors(batch, collate_fn_map):
    """What torch's collate_numpy_array_fn does (torch.as_tensor of each: byte-swapped copies of
    big-endian arrays, its errors for the rest), naming the sample that fails."""
    tensors = []
    for i, array in enumerate(batch):
        try:
            tensors.append(torch.as_tensor(array))
        except Exception as exc:
            raise _UncollatableArray(batch[0], exc, i) from None
    return torch_private.collate(tensors, collate_fn_map=collate_fn_map)


SLOT_COLLATE_MAP = dict(torch_private.default_collate_fn_map)
SLOT_COLLATE_MAP[torch.Tensor] = _stack_tensors
SLOT_COLLATE_MAP[np.ndarray] = _stack_arrays


def collate_into_slot(samples):
    """What `default_collate(samples)` would return, with StackedLeaf in place of stacked tensors."""
    try:
        return torch_private.collate(samples, collate_fn_map=SLOT_COLLATE_MAP)
    except _UncollatableArray as exc:  # torch's exception type, with the path
        where = path_of(samples[0], exc.leaf)
        message = f"cannot collate {_describe(exc.leaf)} at {where} (sample {exc.sample}): {exc.error}"
        if isinstance(exc.error, TypeError):
            raise LayoutError(message) from None
        try:
            error = type(exc.error)(message)
        except Exception:
            raise exc.error from None
        raise error from None


# -- paths, for errors ---------------------------------------------------------------------------


def iter_leaves(obj, path: str = "batch"):
    """(path, leaf) for every leaf of the containers torch's collate knows."""
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from iter_leaves(value, f"{path}[{key!r}]")
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        for field, value in zip(obj._fields, obj):
            yield from iter_leaves(value, f"{path}.{field}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from iter_leaves(value, f"{path}[{i}]")
    else:
        yield path, obj


def path_of(structure, target) -> str:
    for path, leaf in iter_leaves(structure):
        if leaf is target:
            return path
    return "batch (inside an object shmloader does not walk)"


# -- the plan: what goes where -----------------------------------------------------------------


class _Unsupported(Exception):
    def __init__(self, leaf, reason: str):
        self.leaf, self.reason = leaf, reason


# The byte order numpy marks as non-native ("=" is native, "|" none).
_SWAPPED = ">" if sys.byteorder == "little" else "<"
# What the pickler meets most (a descriptor's tuples, ints and strs, the batch's containers): no
# leaf, so persistent_id answers at once instead of after every leaf test.
_NEVER_A_LEAF = frozenset({str, int, float, bool, type(None), tuple, list, dict, bytes, torch.dtype})


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A C-contiguous tensor's strides as torch.empty(shape) has them.  A contiguous tensor may
    have others where a dimension has one element (a transposed column): torch's pickle keeps
    those, so such a tensor travels as a strided leaf."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _dtype_token(dtype: np.dtype):
    """How an "n" leaf names its dtype: numpy's code (``"<f4"``) for a builtin dtype, which costs
    a few bytes to pickle and a cached lookup to load, else the dtype itself (pickled whole)."""
    return dtype.str if dtype.isbuiltin == 1 else dtype


def _byte_copy(flat: np.ndarray) -> np.ndarray:
    """A copy of a contiguous 1-d array with every byte as it was: numpy copies a structured
    dtype field by field, leaving its padding bytes uninitialized (torch's pickled ones keep them)."""
    if flat.dtype.fields is None:
        return flat.copy()
    out = np.empty_like(flat)
    out.view(np.uint8)[:] = flat.view(np.uint8)
    return out


@functools.cache
def _dtype_of(token: str) -> np.dtype:
    return np.dtype(token)


@functools.cache
def _unpickled_dtype(dtype: np.dtype, how: str) -> np.dtype:
    """The dtype an array of `dtype` has once pickled as torch's workers pickle a batch
    (ForkingPickler, pickle's default protocol) and unpickled: numpy turns a non-native byte
    order into the native one (values kept) below protocol 5, and for masked or non-contiguous
    arrays at any protocol.  `how`: "contiguous", "strided" or "masked"."""
    probe = np.zeros(3, dtype)
    if how == "masked":  # (np.ma only for a masked array: is_masked_array)
        probe = np.ma.MaskedArray(probe[:1])
    else:
        probe = {"contiguous": probe[:1], "strided": probe[::2]}[how]
    return pickle.loads(ForkingPickler.dumps(probe)).dtype


def _byte_order_as_unpickled(array: np.ndarray, how: str) -> np.ndarray:
    """`array` (of a non-native byte order) as torch's DataLoader would deliver it: byte-swapped
    into native order, in the memory order numpy's pickle keeps (F if Fortran-contiguous)."""
    dtype = _unpickled_dtype(array.dtype, how)
    if dtype == array.dtype:
        return array
    return array.astype(dtype, order="F" if array.flags.fnc else "C")


class _Planner(pickle.Pickler):
    """Pickles the structure, assigning array leaves to aligned offsets instead of pickling them.
    Everything else is pickled at the protocol torch's workers use (what a numpy array pickled
    whole comes back as depends on it)."""

    def __init__(self, file, start: int, arena=None, shared: frozenset[int] = frozenset(),
                 by_handle: bool = False):
        super().__init__(file, protocol=pickle.DEFAULT_PROTOCOL)
        self.leaves: list[tuple[int, object]] = []
        self.end = start
        self.arena = arena
        # leaves described where they are: id -> (offset, end, the array, kept so ids stay unique)
        self.in_place: dict[int, tuple[int, int, object]] = {}
        self.seen: dict[int, tuple[object, object]] = {}  # id -> (persistent id, the object)
        # NOTE [ Tensors sharing a storage ]: storage -> [tensors, bytes they span, storage bytes];
        # and, once known, the storages sent whole, with the persistent id of each
        self.storage_users: dict[int, list[int]] = {}
        self.shared = shared
        self.shared_pids: dict[int, tuple] = {}
        # NOTE [ Views of a storage already in shared memory ] in shared_views.py: the storages
        # sent by handle, (fd, bytes, the storage: kept, so the fd stays open), and their ids
        self.by_handle = by_handle
        self.handles: list[tuple[int, int, torch.UntypedStorage]] = []
        self.handle_pids: dict[int, tuple] = {}

    def _in_slot(self, array: np.ndarray) -> int | None:
        """The slot offset of a contiguous array born in the arena, unless another leaf
        described in place shares bytes with it (torch would deliver separate copies: the
        copy path does too).  The same array met twice keeps its offset."""
        if self.arena is None or array.nbytes == 0 or not (array.flags.c_contiguous or array.flags.f_contiguous):
            return None
        return self._in_slot_bytes(array, array.__array_interface__["data"][0], array.nbytes)

    def _tensor_in_slot(self, leaf: torch.Tensor, tensor: torch.Tensor) -> int | None:
        """The same for a contiguous CPU tensor whose storage was born in the arena (a
        torch.stack / torch.cat in the collate_fn, NOTE [ One copy for a numpy collate_fn ]);
        `tensor` is `leaf` with its conj/neg bits resolved (a copy, then not in the arena)."""
        nbytes = tensor.numel() * tensor.element_size()
        if self.arena is None or nbytes == 0 or not tensor.is_contiguous():
            return None
        return self._in_slot_bytes(leaf, tensor.data_ptr(), nbytes)

    def _in_slot_bytes(self, leaf, address: int, nbytes: int) -> int | None:
        if id(leaf) in self.in_place:
            return self.in_place[id(leaf)][0]
        offset = _arena_offset(self.arena, address, nbytes)
        if offset is None:
            return None
        end = offset + nbytes
        if any(offset < other_end and other_start < end for other_start, other_end, _ in self.in_place.values()):
            return None
        self.in_place[id(leaf)] = (offset, end, leaf)  # the leaf is kept, so its id stays unique
        return offset

    def _place(self, nbytes: int, leaf) -> int:
        offset = self.end
        self.leaves.append((offset, leaf))
        self.end = align(offset + nbytes)
        return offset

    def persistent_id(self, obj):
        if type(obj) in _NEVER_A_LEAF:
            return None
        seen = self.seen.get(id(obj))
        if seen is not None:  # NOTE [ One object, one leaf ]
            return seen[0]
        pid = self._leaf_id(obj)
        if pid is not None:
            self.seen[id(obj)] = (pid, obj)  # obj kept, so its id stays unique
        return pid

    def _leaf_id(self, obj):
        if type(obj) is StackedLeaf:
            if obj.problem is not None:
                raise _Unsupported(obj, obj.problem)
            return ("t", self._place(obj.nbytes, obj), obj.dtype, obj.shape, False)
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided or obj.is_nested or obj.is_quantized or obj.device.type == "meta":
                return None  # sparse, nested, quantized, meta: pickled whole (their parts come back here)
            if obj.device.type != "cpu":
                raise _Unsupported(obj, f"a {obj.device.type} tensor cannot be written to shared memory; "
                                        "return CPU tensors from workers")
            if type(obj) is not torch.Tensor:
                return None  # a subclass: torch's __reduce_ex__ keeps its type and __dict__; its storage comes back here
            if obj.numel() == 0:  # no bytes: its strides, as torch's pickle keeps them
                return ("e", obj.dtype, tuple(obj.shape), tuple(obj.stride()), obj.requires_grad)
            if not (obj.is_conj() or obj.is_neg()):
                if self.by_handle:
                    handled = self._handle(obj)
                    if handled is not None:
                        return handled
                shared = self._shared_storage(obj)
                if shared is not None:
                    return shared
            source = obj.detach().resolve_conj().resolve_neg()
            shape = tuple(source.shape)
            if source.is_contiguous() and source.stride() == _contiguous_strides(shape):
                offset = self._tensor_in_slot(obj, source)
                if offset is None:
                    offset = self._place(source.numel() * source.element_size(), source)
                return ("t", offset, obj.dtype, shape, obj.requires_grad)
            # torch's DataLoader keeps a view's strides: send the bytes from its first element to its last
            stride = source.stride()
            extent = 1 + sum((n - 1) * step for n, step in zip(shape, stride))
            span = source.as_strided((extent,), (1,))
            offset = self._place(extent * source.element_size(), span)
            return ("v", offset, obj.dtype, shape, obj.requires_grad, stride, extent)
        if isinstance(obj, np.ndarray):
            if type(obj) is not np.ndarray:
                return self._array_subclass(obj)
            if obj.dtype.hasobject:
                return None  # Python objects: pickled, as torch's DataLoader pickles them
            if obj.dtype.byteorder == _SWAPPED:
                contiguous = obj.flags.c_contiguous or obj.flags.f_contiguous
                obj = _byte_order_as_unpickled(obj, "contiguous" if contiguous else "strided")
            order = "F" if obj.flags.f_contiguous and not obj.flags.c_contiguous else "C"
            offset = self._in_slot(obj)
            if offset is None:
                offset = self._place(obj.nbytes, obj)
            return ("n", offset, _dtype_token(obj.dtype), obj.shape, order)
        kind = type(obj)
        if kind is torch.storage.TypedStorage or kind is torch.UntypedStorage:
            return self._storage(obj)
        return None

    def _shared_storage(self, tensor: torch.Tensor):
        """A "w" leaf (a view on a storage sent whole) for a tensor whose storage another tensor
        of the batch shares, once the first pass found it (NOTE [ Tensors sharing a storage ]);
        else None, having counted the tensor for that pass."""
        storage = tensor.untyped_storage()
        key = storage._cdata  # the storage itself: two storages may start at one address
        if not self.shared:
            users = self.storage_users.get(key)
            span = (1 + sum((n - 1) * step for n, step in zip(tensor.shape, tensor.stride()))) * tensor.element_size()
            if users is None:
                self.storage_users[key] = [1, span, storage.nbytes()]
            else:
                users[0] += 1
                users[1] += span
            return None
        if key not in self.shared:
            return None
        storage_pid = self.shared_pids.get(key)
        if storage_pid is None:  # the storage's bytes, once: in place if born in the slot
            nbytes = storage.nbytes()
            as_bytes = torch.empty(0, dtype=torch.uint8).set_(storage)
            offset = self._in_slot_bytes(as_bytes, storage.data_ptr(), nbytes) if self.arena is not None else None
            if offset is None:
                offset = self._place(nbytes, as_bytes)
            storage_pid = self.shared_pids[key] = ("s", offset, None, nbytes)
        return ("w", storage_pid, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()),
                tensor.storage_offset(), tensor.requires_grad)

    def _handle(self, tensor: torch.Tensor):
        """A "w" leaf on an "h" storage (the storage's fd goes with the batch) for a view of a
        larger storage already in shared memory, else None (NOTE [ Views of a storage already in
        shared memory ] in shared_views.py)."""
        fd = shared_views.handle_fd(tensor)
        if fd is None:
            return None
        storage = tensor.untyped_storage()
        key = storage._cdata
        storage_pid = self.handle_pids.get(key)
        if storage_pid is None:
            if len(self.handles) >= shared_views.MAX_STORAGES_PER_BATCH:
                return None  # a message's fds are few: this storage's views are copied
            storage_pid = self.handle_pids[key] = ("h", len(self.handles), storage.nbytes())
            self.handles.append((fd, storage.nbytes(), storage))
        return ("w", storage_pid, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()),
                tensor.storage_offset(), tensor.requires_grad)

    def shared_storages(self) -> frozenset[int]:
        """The storages to send whole: shared by two tensors or more, and no bigger than the
        bytes those tensors span (a batch of small slices of a dataset's big tensor copies the
        slices, as it would without sharing)."""
        return frozenset(key for key, (count, spans, nbytes) in self.storage_users.items()
                         if count > 1 and nbytes <= spans)

    def _array_subclass(self, obj: np.ndarray):
        """A masked array as two leaves (data and mask, in the data's memory order as numpy's
        pickle has them); any other ndarray subclass pickles itself, as under torch."""
        if not is_masked_array(obj) or obj.dtype.hasobject or obj._baseclass is not np.ndarray:
            return None
        data = obj.data
        if data.dtype.byteorder == _SWAPPED:
            data = _byte_order_as_unpickled(data, "masked")
        mask = np.ma.getmaskarray(obj)
        fortran = data.flags.fnc
        if mask.flags.fnc != fortran:
            mask = mask.copy(order="F" if fortran else "C")
        fill_value = obj._fill_value
        if isinstance(fill_value, np.ndarray) and fill_value.ndim == 0:
            fill_value = fill_value[()]  # a scalar in the descriptor, not a leaf of its own
        return ("m", data, mask, fill_value)  # the pickler lays data and mask out as "n" leaves

    def _storage(self, storage):
        """The storage of a tensor subclass, met while torch's __reduce_ex__ pickles it."""
        typed = type(storage) is torch.storage.TypedStorage
        untyped = storage._untyped_storage if typed else storage
        if untyped.device.type != "cpu":
            raise _Unsupported(storage, f"a {untyped.device.type} storage cannot be written to shared memory")
        nbytes = untyped.nbytes()
        as_bytes = torch.empty(0, dtype=torch.uint8).set_(untyped)
        return ("s", self._place(nbytes, as_bytes), storage.dtype if typed else None, nbytes)


def _arena_offset(arena, address: int, nbytes: int) -> int | None:
    """The slot offset of `nbytes` at `address` when they are one block of `arena`, aligned as
    a leaf must be; else None."""
    offset = arena.offset_of(address, nbytes)
    return None if offset is None or offset % ALIGN else offset


@dataclass
class BatchPlan:
    descriptor: bytes
    leaves: list[tuple[int, object]]  # (slot offset, leaf) of the leaves to copy
    descriptor_offset: int
    total_bytes: int  # the payload's end: the descriptor's last byte + 1
    in_place_bytes: int = 0  # array bytes already in the slot (born in the arena), not copied
    # storages sent by handle, (fd, bytes, storage): NOTE [ Views of a storage already in shared
    # memory ] in shared_views.py
    handles: tuple[tuple[int, int, torch.UntypedStorage], ...] = ()


def plan_batch(structure, arena=None, by_handle: bool = False) -> BatchPlan:
    """Lay out `structure` (leaves born in `arena`, a SlotArena over the slot it will be written
    to, stay where they are; the rest go after the arena's blocks; with `by_handle`, views of a
    larger storage in shared memory go by its fd: NOTE in shared_views.py); raises LayoutError /
    BatchShapeError naming the offending leaf's path."""
    start = align(max(HEADER_BYTES, arena.used_end if arena is not None else 0))
    kind = type(structure)
    if kind is np.ndarray or kind is StackedLeaf:
        plan = _plan_one_leaf(structure, start, arena)
        if plan is not None:
            return plan
    buffer = io.BytesIO()
    planner = _Planner(buffer, start, arena, by_handle=by_handle)
    try:
        planner.dump(structure)
        shared = planner.shared_storages()
        if shared:  # tensors sharing a storage: again, with it sent whole (NOTE [ Tensors sharing ... ])
            buffer = io.BytesIO()
            planner = _Planner(buffer, start, arena, shared, by_handle)
            planner.dump(structure)
    except _Unsupported as exc:
        where = path_of(structure, exc.leaf)
        if type(exc.leaf) is StackedLeaf:
            raise BatchShapeError(
                f"cannot stack samples at {where}: {exc.reason}. Return equal shapes from the "
                "dataset, or pass a collate_fn that pads or keeps a list"
            ) from None
        raise LayoutError(f"cannot send {_describe(exc.leaf)} at {where}: {exc.reason}") from None
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise _pickling_error(structure, exc) from exc
    descriptor = buffer.getvalue()
    descriptor_offset = align(planner.end)
    in_place = sum(end - offset for offset, end, _ in planner.in_place.values())
    return BatchPlan(descriptor, planner.leaves, descriptor_offset, descriptor_offset + len(descriptor), in_place,
                     tuple(planner.handles))


# NOTE [ One-leaf batches ]
#   Most batches are one array: an np.stack in the collate_fn, a tensor of torch's collate (a
#   StackedLeaf here).  For those, plan_batch skips the pickler: it works out the leaf's persistent
#   id as _Planner._leaf_id does, and takes the descriptor (that id, pickled) from a small cache,
#   since a worker lays out batch after batch of one shape at one offset.  The plan is the one
#   the pickler would make, byte for byte (tests/test_layout.py compares them).  In a worker's
#   loop at 1 MiB this path runs in a fraction of the pickler's ~10 µs, with the caches cold.

class _OneLeafPickler(pickle.Pickler):
    """Pickles _ONE_LEAF as the persistent id `pid`, at _Planner's protocol."""

    def __init__(self, file, pid):
        super().__init__(file, protocol=pickle.DEFAULT_PROTOCOL)
        self.pid = pid

    def persistent_id(self, obj):
        return self.pid if obj is _ONE_LEAF else None


_ONE_LEAF = object()
_ONE_LEAF_DESCRIPTORS: dict[tuple, bytes] = {}  # persistent id -> the descriptor of a batch that is that leaf
_ONE_LEAF_CACHE_SIZE = 64


def _plan_one_leaf(leaf, start: int, arena) -> BatchPlan | None:
    """plan_batch of a batch that is one plain ndarray or StackedLeaf (NOTE [ One-leaf batches ]),
    or None for one the pickler must see (objects, swapped bytes, a dtype that is no builtin, a
    stacking problem)."""
    in_place = 0
    if type(leaf) is StackedLeaf:
        if leaf.problem is not None:
            return None
        offset, nbytes = start, leaf.nbytes
        pid = ("t", offset, leaf.dtype, leaf.shape, False)
    else:
        dtype = leaf.dtype
        if dtype.isbuiltin != 1 or dtype.hasobject or dtype.byteorder == _SWAPPED:
            return None  # a dtype of its own is pickled whole, and two that compare equal may differ
        flags = leaf.flags
        order = "F" if flags.f_contiguous and not flags.c_contiguous else "C"
        nbytes = leaf.nbytes
        offset = None
        if arena is not None and nbytes and (flags.c_contiguous or flags.f_contiguous):
            offset = _arena_offset(arena, leaf.__array_interface__["data"][0], nbytes)
        if offset is None:
            offset = start
        else:
            in_place, nbytes = nbytes, 0
        pid = ("n", offset, _dtype_token(dtype), leaf.shape, order)
    descriptor = _ONE_LEAF_DESCRIPTORS.get(pid)
    if descriptor is None:
        buffer = io.BytesIO()
        _OneLeafPickler(buffer, pid).dump(_ONE_LEAF)
        descriptor = buffer.getvalue()
        if len(_ONE_LEAF_DESCRIPTORS) >= _ONE_LEAF_CACHE_SIZE:
            _ONE_LEAF_DESCRIPTORS.clear()
        _ONE_LEAF_DESCRIPTORS[pid] = descriptor
    leaves = [] if in_place else [(offset, leaf)]
    descriptor_offset = align(start + nbytes)
    return BatchPlan(descriptor, leaves, descriptor_offset, descriptor_offset + len(descriptor), in_place)


def _pickling_error(structure, exc: Exception) -> LayoutError:
    for path, leaf in iter_leaves(structure):
        if type(leaf) in (torch.Tensor, StackedLeaf) or (type(leaf) is np.ndarray and not leaf.dtype.hasobject):
            continue
        try:
            pickle.dumps(leaf, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as leaf_exc:
            return LayoutError(
                f"cannot send {type(leaf).__name__} {safe_text(leaf, as_repr=True):.80} at {path}: it cannot "
                f"be pickled ({safe_text(leaf_exc)}); return arrays, tensors, numbers, str or None from the "
                "dataset and collate_fn"
            )
    return LayoutError(f"cannot send the batch: {safe_text(exc)}")


# -- writing (worker) and reading (main) ---------------------------------------------------------


def _copy_numpy(segment: _ring.Segment, offset: int, array: np.ndarray, c_order: bool) -> None:
    """Copy `array` to `offset`: raw bytes when its memory order is the one the descriptor says
    (C, or F for a Fortran-ordered leaf), else element by element into a C-ordered target."""
    if array.nbytes == 0:
        return
    if array.flags.c_contiguous or (array.flags.f_contiguous and not c_order):
        segment.copy_from_address(offset, array.__array_interface__["data"][0], array.nbytes)
    else:
        target = np.frombuffer(segment, dtype=array.dtype, count=array.size, offset=offset)
        np.copyto(target.reshape(array.shape), array)


def _copy_tensor(segment: _ring.Segment, offset: int, tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return
    if tensor.is_contiguous():
        segment.copy_from_address(offset, tensor.data_ptr(), nbytes)
    else:
        target = torch.frombuffer(segment, dtype=tensor.dtype, count=tensor.numel(), offset=offset)
        target.view(tensor.shape).copy_(tensor)


def memory_bounds(value) -> tuple[int, int]:
    """The addresses [lo, hi) that an array's (a memmap, a masked array's data) or a tensor's
    elements may occupy."""
    if isinstance(value, np.ndarray):
        return _byte_bounds(value)
    storage = value.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def data_address(value) -> int:
    return value.__array_interface__["data"][0] if isinstance(value, np.ndarray) else value.data_ptr()


def c_contiguous(value) -> bool:
    return value.flags.c_contiguous if isinstance(value, np.ndarray) else value.is_contiguous()


def _plain_bytes(row) -> bool:
    """Whether a row's memory holds its values as they are (C order, no conj / neg bit)."""
    if isinstance(row, np.ndarray):
        return row.flags.c_contiguous
    return row.is_contiguous() and not row.is_conj() and not row.is_neg()


_byte_bounds = getattr(getattr(np.lib, "array_utils", None), "byte_bounds", None) or np.byte_bounds


def write_batch(segment: _ring.Segment, plan: BatchPlan, rows_in_slot: bool = False) -> int:
    """Copy every leaf (but those already in place) and the descriptor into a slot the caller
    has claimed; returns the bytes of stacked rows found in place.

    `rows_in_slot`: samples may have been born in this slot (NOTE [ Samples born in the slot ]
    in samples_in_slot.py).  A row already at its place (C-contiguous, that address) is not
    copied, and every other source whose memory lies in the slot is copied out first, so that
    no write reads bytes another write has overwritten."""
    leaves = _settle_sources(segment, plan.leaves) if rows_in_slot else plan.leaves
    in_place = 0
    for offset, leaf in leaves:
        if type(leaf) is StackedLeaf:
            row_bytes = leaf.row_nbytes
            rows = leaf.rows
            in_place += row_bytes * sum(row is None for row in rows)
            i = segment.copy_rows(offset, row_bytes, rows)  # arrays: one C loop
            while i < len(rows):  # rows[i] is no C-ordered buffer: a tensor, a strided array
                row, at = rows[i], offset + i * row_bytes
                if isinstance(row, np.ndarray):
                    _copy_numpy(segment, at, row, c_order=True)
                else:
                    _copy_tensor(segment, at, row.resolve_conj().resolve_neg())
                i = segment.copy_rows(offset, row_bytes, rows, i + 1)
        elif isinstance(leaf, np.ndarray):
            _copy_numpy(segment, offset, leaf, c_order=False)
        else:
            _copy_tensor(segment, offset, leaf)
    segment.write(plan.descriptor_offset, plan.descriptor)
    return in_place


def settle_plan(segment: _ring.Segment, plan: BatchPlan) -> BatchPlan:
    """`plan` with its sources settled against `segment` (as write_batch's `rows_in_slot` does),
    so that once the caller drops the batch, an array born in the segment is alive only if
    someone else keeps it."""
    return dataclasses.replace(plan, leaves=_settle_sources(segment, plan.leaves))


def rows_in_place(plan: BatchPlan) -> set[int]:
    """The slot offsets of the stacked rows of a settled `plan` already at their place."""
    return {offset + i * leaf.row_nbytes for offset, leaf in plan.leaves if type(leaf) is StackedLeaf
            for i, row in enumerate(leaf.rows) if row is None}


def unsettle_rows(segment: _ring.Segment, plan: BatchPlan) -> BatchPlan:
    """A settled `plan` whose rows in place are read from `segment` instead (views, copied when
    written), to write the batch into another segment."""
    leaves = []
    for offset, leaf in plan.leaves:
        if type(leaf) is StackedLeaf and any(row is None for row in leaf.rows):
            size = leaf.row_nbytes
            rows = [np.frombuffer(segment, np.uint8, size, offset + i * size) if row is None else row
                    for i, row in enumerate(leaf.rows)]
            leaf = StackedLeaf(rows, leaf.dtype, leaf.row_shape)
        leaves.append((offset, leaf))
    return dataclasses.replace(plan, leaves=leaves)


def _settle_sources(segment: _ring.Segment, leaves: list) -> list:
    """`leaves` with each stacked row already at its place in `segment` replaced by None (nothing
    to copy) and every other source lying in the segment replaced by a copy of it."""
    lo, hi = segment.address, segment.address + segment.size

    def outside(value):
        start, end = memory_bounds(value)
        if end <= lo or hi <= start:
            return value
        if isinstance(value, np.ndarray):  # in the memory order its descriptor says (F stays F)
            return value.copy(order="F" if value.flags.f_contiguous and not value.flags.c_contiguous else "C")
        return value.clone()

    settled = []
    for offset, leaf in leaves:
        if type(leaf) is StackedLeaf:
            row_bytes = leaf.row_nbytes
            rows = []
            for i, row in enumerate(leaf.rows):
                if row_bytes and data_address(row) == lo + offset + i * row_bytes and _plain_bytes(row):
                    rows.append(None)
                else:
                    rows.append(outside(row))
            leaf = StackedLeaf(rows, leaf.dtype, leaf.row_shape)
        else:
            leaf = outside(leaf)
        settled.append((offset, leaf))
    return settled


_TENSOR_KINDS = frozenset({"t", "v", "w", "e"})  # the leaves that are tensors of a dtype
_NOT_PLAIN_DTYPES = frozenset({torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4})


# NOTE [ Small leaves are copies ]
#   A leaf delivered as a view keeps its whole slot: held past the ring, the slot is detached and
#   its segment lives, whole, as long as any view of it (NOTE [ Held batches ] in ring.py).  A
#   loop that keeps a small part of every batch (labels.append(batch["y"]), indices, scores)
#   would keep every slot: 100 batches of 2 MiB images held 200 MiB of /dev/shm for 6 KiB of
#   labels, where torch's leaves each have a segment of their own.  So a leaf of at most
#   SMALL_LEAF_BYTES and at most 1/SMALL_LEAF_SHARE of its slot is read out of the slot as a copy
#   (microseconds), and never holds one; bigger leaves are zero-copy views.  Not under
#   pin_memory, whose leaves must stay page-locked: there a held leaf keeps its slot.
SMALL_LEAF_BYTES = 64 * 1024
SMALL_LEAF_SHARE = 16


def small_leaf_limit(slot_bytes: int) -> int:
    """The largest leaf of a slot of `slot_bytes` that is delivered as a copy (NOTE above)."""
    return min(SMALL_LEAF_BYTES, slot_bytes // SMALL_LEAF_SHARE)


# NOTE [ Reading a one-leaf batch ]
#   The main process reads most batches as one array (NOTE [ One-leaf batches ]): the same
#   descriptor, batch after batch.  Once the unpickler has read a descriptor that is one "t" or
#   "n" leaf and nothing else, the descriptor's bytes map to that leaf's persistent id, and the
#   next batches with those bytes are read by _LeafReader alone: no unpickler, no stream, no
#   sparse-tensor check (there is no sparse tensor).  Every load still checks its bounds.  A
#   plain tensor leaf whose dtype numpy has is made with torch.from_numpy of the slot's numpy
#   view, one call into torch where frombuffer(...).view(shape) is two: at 1 MiB, with the
#   caches cold after each wake-up, reading a tensor batch took about 28 µs of the training
#   process's CPU against 13 µs for the same batch as a numpy array.  Every tensor leaf is a
#   tensor of its own over the slot's storage, never a view of another (a dtype numpy lacks,
#   a strided leaf: set_ on the storage), as torch's unpickled tensors are: a view refuses
#   detach_() ("Can't detach views in-place") and records other autograd nodes.

_NUMPY_DTYPE = {getattr(torch, name): np.dtype(name) for name in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64",
    "complex64", "complex128")}
_ONE_LEAF_KINDS = ("t", "n")
_ONE_LEAF_READS: dict[bytes, tuple] = {}  # descriptor -> the persistent id of its one leaf


class _LeafReader:
    """Rebuilds one leaf from its persistent id: a view of the slot behind `lease` (a copy where
    it has at most `copy_upto` bytes), after checking that it lies within the payload."""

    __slots__ = ("lease", "payload_end", "copy_upto", "loaded", "shared")

    def __init__(self, lease: _ring.SlotLease, payload_end: int, copy_upto: int = 0, shared: tuple = ()):
        self.lease = lease
        self.payload_end = payload_end
        self.copy_upto = copy_upto  # NOTE [ Small leaves are copies ]
        self.shared = shared  # the storages the batch came with by handle (shared_views.py)
        self.loaded: dict[int, tuple[object, object]] = {}  # id(pid) -> (pid, the leaf)

    def load_once(self, pid):
        """load(pid), or the leaf already loaded from this very pid (NOTE [ One object, one leaf ])."""
        loaded = self.loaded.get(id(pid))
        if loaded is not None and loaded[0] is pid:
            return loaded[1]
        leaf = self.load(pid)
        self.loaded[id(pid)] = (pid, leaf)
        return leaf

    def _start(self, offset: int, nbytes: int) -> int:
        if offset < HEADER_BYTES or offset + nbytes > self.payload_end:
            raise SlotProtocolError(
                f"a leaf of {nbytes} bytes at offset {offset} lies outside the slot's payload "
                f"[{HEADER_BYTES}, {self.payload_end})"
            )
        return offset

    def load(self, pid):
        kind = pid[0]
        if kind in _TENSOR_KINDS:
            dtype = pid[1] if kind == "e" else pid[2]
            if type(dtype) is not torch.dtype or dtype in _NOT_PLAIN_DTYPES:
                # torch.frombuffer of a quantized dtype crashes the process: a corrupt slot only
                raise SlotProtocolError(f"a {kind!r} leaf of dtype {dtype!r} in a slot descriptor "
                                        "(quantized tensors travel pickled whole)")
        if kind == "t":
            _, offset, dtype, shape, requires_grad = pid
            count = math.prod(shape)
            start = self._start(offset, count * dtype.itemsize)
            if count == 0:
                view = torch.empty(shape, dtype=dtype)
            else:
                numpy_dtype = _NUMPY_DTYPE.get(dtype)
                if numpy_dtype is None:  # a tensor of its own over the storage, not a view (as torch's)
                    flat = torch.frombuffer(self.lease, dtype=dtype, count=count, offset=start)
                    view = torch.empty(0, dtype=dtype).set_(flat.untyped_storage(), 0, shape)
                else:  # one call into torch (NOTE [ Reading a one-leaf batch ])
                    view = torch.from_numpy(np.frombuffer(self.lease, numpy_dtype, count, start).reshape(shape))
                if count * dtype.itemsize <= self.copy_upto:
                    view = view.clone()
            if requires_grad:
                view.requires_grad_(True)
            return view
        if kind == "n":
            _, offset, dtype, shape, order = pid
            if type(dtype) is str:
                dtype = _dtype_of(dtype)
            count = math.prod(shape)
            start = self._start(offset, count * dtype.itemsize)
            if count == 0 or dtype.itemsize == 0:  # no bytes (shape (0, 3), dtype V0): as unpickled
                return np.ndarray(shape, dtype=dtype, buffer=bytearray())
            flat = np.frombuffer(self.lease, dtype=dtype, count=count, offset=start)
            if count * dtype.itemsize <= self.copy_upto:
                flat = _byte_copy(flat)
            return flat.reshape(shape, order=order)
        if kind == "v":
            _, offset, dtype, shape, requires_grad, stride, extent = pid
            start = self._start(offset, extent * dtype.itemsize)
            if extent <= 0 or min(stride, default=0) < 0 or extent < 1 + sum((n - 1) * s for n, s in zip(shape, stride)):
                raise SlotProtocolError(f"a strided leaf of shape {list(shape)}, strides {list(stride)} "
                                        f"does not fit its {extent} elements")
            span = torch.frombuffer(self.lease, dtype=dtype, count=extent, offset=start)
            if extent * dtype.itemsize <= self.copy_upto:
                span = span.clone()
            view = torch.empty(0, dtype=dtype).set_(span.untyped_storage(), 0, shape, stride)  # not a view
            if requires_grad:
                view.requires_grad_(True)
            return view
        if kind == "w":
            _, storage_pid, dtype, shape, stride, storage_offset, requires_grad = pid
            storage = self.load_once(storage_pid)  # one storage for all its tensors
            extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride))
            if (type(storage) is not torch.UntypedStorage or min(stride, default=0) < 0 or storage_offset < 0
                    or (storage_offset + extent) * dtype.itemsize > storage.nbytes()):
                raise SlotProtocolError(f"a view of shape {list(shape)}, strides {list(stride)} at element "
                                        f"{storage_offset} does not fit its shared storage")
            view = torch.empty(0, dtype=dtype).set_(storage, storage_offset, shape, stride)
            if requires_grad:
                view.requires_grad_(True)
            return view
        if kind == "e":
            _, dtype, shape, stride, requires_grad = pid
            if math.prod(shape) != 0:
                raise SlotProtocolError(f"an empty leaf of shape {list(shape)} has elements")
            empty = torch.empty_strided(shape, stride, dtype=dtype)
            if requires_grad:
                empty.requires_grad_(True)
            return empty
        if kind == "s":
            _, offset, dtype, nbytes = pid
            start = self._start(offset, nbytes)
            if nbytes == 0:
                untyped = torch.UntypedStorage(0)
            else:
                span = torch.frombuffer(self.lease, dtype=torch.uint8, count=nbytes, offset=start)
                untyped = (span.clone() if nbytes <= self.copy_upto else span).untyped_storage()
            if dtype is None:
                return untyped
            return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
        if kind == "h":  # a storage already in shared memory, mapped from the fd sent with the batch
            _, index, nbytes = pid
            if type(index) is not int or not 0 <= index < len(self.shared) or self.shared[index].nbytes() != nbytes:
                raise SlotProtocolError(f"a shared storage {index!r} of {nbytes!r} bytes in a slot descriptor; "
                                        f"the batch came with {[s.nbytes() for s in self.shared]}")
            return self.shared[index]
        if kind == "m":
            _, data, mask, fill_value = pid  # data and mask: "n" leaves, already loaded
            # numpy's _mareconstruct and MaskedArray.__setstate__, with the slot's views
            masked = np.ma.MaskedArray.__new__(np.ma.MaskedArray, data, mask=mask, dtype=data.dtype)
            masked.fill_value = fill_value
            return masked
        raise pickle.UnpicklingError(f"unknown leaf kind {kind!r} in a slot descriptor")


class _SlotUnpickler(pickle.Unpickler):
    def __init__(self, descriptor: bytes, reader: _LeafReader):
        super().__init__(io.BytesIO(descriptor))
        self.persistent_load = reader.load_once


def read_batch(lease: _ring.SlotLease, descriptor: bytes, payload_end: int, copy_upto: int = 0,
               shared: tuple = ()):
    """Rebuild the batch from its descriptor, every array leaf a view that keeps `lease` alive,
    but those of at most `copy_upto` bytes, copies (NOTE [ Small leaves are copies ]); `shared`:
    the storages the batch came with by handle (NOTE in shared_views.py)."""
    pid = _ONE_LEAF_READS.get(descriptor)
    if pid is not None:  # NOTE [ Reading a one-leaf batch ]
        return _LeafReader(lease, payload_end, copy_upto).load(pid)
    reader = _LeafReader(lease, payload_end, copy_upto, shared)
    batch = _SlotUnpickler(descriptor, reader).load()
    torch_private.validate_loaded_sparse_tensors()
    loaded = list(reader.loaded.values())
    if len(loaded) == 1 and loaded[0][1] is batch and type(loaded[0][0]) is tuple and loaded[0][0][0] in _ONE_LEAF_KINDS:
        if len(_ONE_LEAF_READS) >= _ONE_LEAF_CACHE_SIZE:
            _ONE_LEAF_READS.clear()
        _ONE_LEAF_READS[descriptor] = loaded[0][0]
    return batch
