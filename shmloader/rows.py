"""The rows of one batch written by several workers: the plan of a batch learnt from one sample.

The default mode gives each batch to one worker: it fetches all `batch_size` samples, collates
them straight into a slot (layout.collate_into_slot) and publishes it.  A batch of slow samples
then takes `batch_size` sample-times on one core while the others wait for their own batches.
With `sample_parallel=True` the samples (rows) of ONE batch are spread over all workers: each
fetches some rows of batch n and writes each row's bytes straight to its place in that batch's
slot; the main process delivers the batch once every row is in.

That needs every worker to know, before it has seen the other rows, where its row goes.  With
torch's default_collate on a map-style dataset it can: when every leaf of a sample collates to a
stacked tensor, the batch's layout is a function of ONE sample's structure, shapes and dtypes and
of the batch size.  `learn_schema` works it out once, with the default mode's own machinery, and
the result (`RowSchema`, small and picklable) is sent to every worker.

NOTE [ Rows of one batch ]
  * Learning.  `learn_schema(sample, n)` collates `[sample] * n` with torch's own `collate` and
    the default mode's handlers (layout.SLOT_COLLATE_MAP: arrays and tensors become StackedLeaf),
    numbers too becoming StackedLeaf of the dtype torch's default_collate gives them (float ->
    float64, int -> int64, bool -> bool, a numpy scalar -> its dtype), then lays the result out
    with layout.plan_batch.  So the descriptor, its container types and every leaf's dtype and
    shape are what the default mode writes for a batch of such samples, and `read_batch` rebuilds
    exactly what `default_collate(samples)` returns.  A leaf whose collated form depends on the
    values of all samples (str, bytes, None, other objects: torch keeps a list of them) or is not
    a plain stack (a tensor subclass, a sparse tensor) raises RowsUnsupportedError there, naming
    its path; an array torch cannot collate raises the default mode's error.
  * Layout.  Leaf j is a (n, *row_shape) C-contiguous tensor at `leaves[j].offset`; row r of it
    lies at `offset + r * row_nbytes`.  Rows of one leaf are contiguous and leaves are 64-byte
    aligned and disjoint, so no two rows (or a row and the header or descriptor) share a byte:
    workers write their rows concurrently without any lock.  The descriptor sits after the last
    leaf at `descriptor_offset` and never changes for a given schema.
  * Writing.  `write_row(segment, schema, r, sample)` checks the sample against the schema
    (container types, keys, lengths; each leaf's kind, dtype and shape: BatchShapeError names the
    path and the row) and copies each leaf to row r's place, through the same copies as the
    default mode (layout._copy_numpy / _copy_tensor: one memcpy with the GIL released for a
    contiguous leaf, values in C order for a strided one).  It checks everything before it copies
    anything, so a rejected sample leaves the slot untouched.  A leaf the dataset allocated in
    its row (`born_in_row`: NOTE [ Rows born in place ] in sample_parallel.py) is not copied.
  * Publishing.  Whoever claimed the slot (segment.claim) waits until all n rows are reported
    written, then calls `publish_batch(segment, schema)`: it writes the descriptor and publishes
    (WRITING -> READY) with payload_end = total_bytes, as layout.write_batch + segment.publish do
    for a default-mode batch; ring.lease and layout.read_batch read it back unchanged.  A
    worker's report of its rows (a pipe / queue message) orders its writes before the publish.
  * A short last batch (drop_last=False) has another layout: use `schema.resized(k)`.
  * Exactness.  Row 0 must match the schema exactly (its container types and key order are the
    ones torch's collate copies into the batch).  Other rows are accepted where torch would give
    the same batch: a Mapping holding the keys (extra keys ignored, as torch does), any list or
    tuple of the same length, an int or bool for a float leaf, a bool for an int leaf.  Anything
    else raises, even where torch would still collate it into something else (an int row in a
    bool leaf, a float64 array in a float32 leaf: torch casts, the schema cannot).
  * Seeding.  A sample's random augmentation must not depend on which worker fetched it:
    `seed_sample(sample_seed(base_seed, epoch, batch, row))` before fetching row `row` of batch
    `batch` seeds python's `random`, numpy's global RNG and torch's CPU generator from those four
    numbers only (the formula is in `sample_seed`).
"""

from __future__ import annotations

import collections
import hashlib
import pickle
import random
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch.utils.data._utils import collate as torch_collate

from . import layout
from .errors import BatchShapeError, LayoutError, MissingKeyError, NotATensorError

__all__ = [
    "RowLeaf", "RowSchema", "RowsUnsupportedError", "learn_schema", "publish_batch",
    "sample_seed", "seed_sample", "write_row",
]

_ADVICE = "use the default mode (sample_parallel=False) or make it an array"

# A row smaller than this is not worth an arena (it is copied: a few microseconds).
IN_PLACE_MIN_BYTES = 16 * 1024


class RowsUnsupportedError(LayoutError):
    """A sample's leaf or container whose collated form is not a stack of rows (a TypeError, via
    LayoutError), so its batch cannot be written row by row; names the leaf's path."""


# -- leaves ----------------------------------------------------------------------------------------

_NUMBER_DTYPES = {float: torch.float64, int: torch.int64, bool: torch.bool}
_PACK = {float: struct.Struct("=d").pack, int: struct.Struct("=q").pack, bool: struct.Struct("=?").pack}
# Rows (other than row 0) torch's collate turns into the same dtype as row 0's type gives:
# torch.tensor(batch) of python ints with signed numpy integers or uint8 is int64 (torch refuses
# to promote uint16/32/64), and torch.as_tensor(batch) of np.int64 scalars with those too (np.float64 and
# float: float64 with any of these or a smaller float). Any other mix makes a dtype that
# depends on every row (np.float32 with np.float64 is float64), which a row cannot know.
_INTEGERS = (int, bool, np.int8, np.int16, np.int32, np.int64, np.uint8)
_FLOATS = (float, np.float16, np.float32, np.float64, *_INTEGERS)
_ACCEPTS = {float: _FLOATS, int: _INTEGERS, bool: (bool,), np.int64: _INTEGERS, np.float64: _FLOATS}


@dataclass(frozen=True)
class RowLeaf:
    """One stacked leaf of the batch: row r lies at `offset + r * row_nbytes` in the slot."""

    path: str  # e.g. "batch['image']"
    kind: str  # "ndarray", "tensor", "float", "int", "bool" or "numpy scalar"
    offset: int  # of row 0, from the segment's start
    row_nbytes: int
    row_shape: tuple[int, ...]
    dtype: torch.dtype  # of the collated tensor
    source_type: type  # float/int/bool or the numpy scalar type; np.ndarray / torch.Tensor
    numpy_dtype: np.dtype | None = None  # an ndarray's or numpy scalar's dtype

    def describe(self) -> str:
        if self.kind in ("ndarray", "tensor"):
            name = str(self.numpy_dtype) if self.numpy_dtype is not None else _torch_name(self.dtype)
            return f"{self.kind} {name}{list(self.row_shape)}"
        return self.source_type.__name__


def _torch_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(value) -> str:
    if isinstance(value, np.ndarray):
        return f"ndarray {layout._describe(value)}"
    if isinstance(value, torch.Tensor):
        return f"tensor {layout._describe(value)}"
    return type(value).__name__


# -- the schema ----------------------------------------------------------------------------------

# Structure nodes: ("leaf", index) | ("map", type, keys, children) | ("seq", type, children)
# (a namedtuple is a "seq" whose type has _fields).


@dataclass(frozen=True)
class RowSchema:
    """The plan of a batch of `batch_size` samples shaped like the one it was learnt from."""

    batch_size: int
    total_bytes: int  # the payload's end: the slot needs at least this many bytes
    descriptor: bytes
    descriptor_offset: int
    leaves: tuple[RowLeaf, ...]
    tree: tuple
    skeleton: bytes = field(repr=False)  # pickle of the collated structure (StackedLeaf rows: ranges)

    def to_bytes(self) -> bytes:
        return pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def from_bytes(data: bytes) -> RowSchema:
        schema = pickle.loads(data)
        if type(schema) is not RowSchema:
            raise TypeError(f"expected a pickled RowSchema, got {type(schema).__name__}")
        return schema

    @property
    def row_nbytes(self) -> int:
        """Bytes one sample adds to the batch (its leaves, alignment not counted)."""
        return sum(leaf.row_nbytes for leaf in self.leaves)

    @property
    def in_place_leaf(self) -> RowLeaf | None:
        """The leaf whose rows a dataset may allocate in place (the largest array leaf of at
        least IN_PLACE_MIN_BYTES a row; NOTE [ Rows born in place ] in sample_parallel.py)."""
        arrays = [leaf for leaf in self.leaves
                  if leaf.kind in ("ndarray", "tensor") and leaf.row_nbytes >= IN_PLACE_MIN_BYTES]
        return max(arrays, key=lambda leaf: leaf.row_nbytes, default=None)

    def resized(self, batch_size: int) -> RowSchema:
        """The schema of a batch of `batch_size` such samples (a short last batch)."""
        if batch_size == self.batch_size:
            return self
        return _plan(pickle.loads(self.skeleton), batch_size, self.leaves, self.tree)


def learn_schema(sample, batch_size: int) -> RowSchema:
    """The plan of a batch of `batch_size` samples shaped like `sample`, as default_collate
    would build it; raises RowsUnsupportedError for a leaf that is not a stack of rows."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    found: list[tuple[str, object]] = []
    tree = _learn_tree(sample, "batch", found)
    samples = [sample] * batch_size
    try:
        skeleton = torch_collate.collate(samples, collate_fn_map=_ROWS_COLLATE_MAP)
    except Exception:
        layout.collate_into_slot(samples)  # the default mode's error, with the leaf's path
        raise
    collated = list(layout.iter_leaves(skeleton))
    if [path for path, _ in collated] != [path for path, _ in found]:
        raise RowsUnsupportedError(
            f"cannot spread the samples of a batch over workers: torch's collate gives leaves "
            f"{[p for p, _ in collated]} for a sample with leaves {[p for p, _ in found]}; {_ADVICE}")
    leaves = []
    for (path, value), (_, stacked) in zip(found, collated):
        if type(stacked) is not layout.StackedLeaf or stacked.problem is not None:
            raise RowsUnsupportedError(
                f"cannot spread the samples of a batch over workers: {_describe(value)} at {path} "
                f"is not collated as a plain stack of rows (torch.stack of a tensor subclass, a "
                f"sparse or grad-requiring tensor, or a converted array); {_ADVICE}")
        stacked.rows = range(batch_size)  # the skeleton keeps no sample data
        leaves.append(_leaf(path, value, stacked))
    return _plan(skeleton, batch_size, leaves, tree)


def _leaf(path: str, value, stacked: layout.StackedLeaf) -> RowLeaf:
    common = dict(path=path, offset=-1, row_nbytes=stacked.row_nbytes, row_shape=tuple(stacked.row_shape),
                  dtype=stacked.dtype)
    if type(value) is np.ndarray:
        return RowLeaf(kind="ndarray", source_type=np.ndarray, numpy_dtype=value.dtype, **common)
    if type(value) is torch.Tensor:
        return RowLeaf(kind="tensor", source_type=torch.Tensor, **common)
    if type(value) in _NUMBER_DTYPES:
        return RowLeaf(kind=type(value).__name__, source_type=type(value), **common)
    return RowLeaf(kind="numpy scalar", source_type=type(value), numpy_dtype=value.dtype, **common)


def _plan(skeleton, batch_size: int, leaves, tree) -> RowSchema:
    stacked = [leaf for _, leaf in layout.iter_leaves(skeleton)]
    for leaf in stacked:
        leaf.rows = range(batch_size)
    plan = layout.plan_batch(skeleton)
    offsets = {id(leaf): offset for offset, leaf in plan.leaves}
    placed = tuple(replace(leaf, offset=offsets[id(s)]) for leaf, s in zip(leaves, stacked))
    return RowSchema(batch_size, plan.total_bytes, plan.descriptor, plan.descriptor_offset, placed, tree,
                     pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL))


def _learn_tree(obj, path: str, found: list) -> tuple:
    """The structure node of `obj` (the paths as layout.iter_leaves writes them); supported
    leaves are appended to `found`."""
    obj = _plain_array(obj)
    kind = type(obj)
    if isinstance(obj, Mapping):
        if kind not in (dict, collections.OrderedDict):
            raise RowsUnsupportedError(
                f"cannot spread the samples of a batch over workers: {path} is a {kind.__name__}, "
                f"whose collated form copies one sample's mapping object; {_ADVICE.replace('make it an array', 'return a dict')}")
        keys = tuple(obj)
        children = tuple(_learn_tree(obj[key], f"{path}[{key!r}]", found) for key in keys)
        return ("map", kind, keys, children)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return ("seq", kind, tuple(_learn_tree(value, f"{path}.{name}", found) for name, value in zip(obj._fields, obj)))
    if kind in (list, tuple):
        return ("seq", kind, tuple(_learn_tree(value, f"{path}[{i}]", found) for i, value in enumerate(obj)))
    if kind in (np.ndarray, torch.Tensor) or kind in _NUMBER_DTYPES:
        found.append((path, obj))
        return ("leaf", len(found) - 1)
    if isinstance(obj, (np.bool_, np.number)):
        dtype = layout._NUMPY_TO_TORCH.get(obj.dtype)
        try:
            collated = torch_collate.collate_numpy_scalar_fn([obj])
        except Exception as exc:
            raise RowsUnsupportedError(
                f"cannot collate {kind.__name__} at {path}: torch's default_collate refuses it "
                f"({type(exc).__name__}: {exc})") from None
        if dtype is None or collated.dtype != dtype:
            raise RowsUnsupportedError(
                f"cannot spread the samples of a batch over workers: {kind.__name__} at {path} "
                f"becomes {_torch_name(collated.dtype)} in torch's default_collate, not its own bytes; {_ADVICE}")
        found.append((path, obj))
        return ("leaf", len(found) - 1)
    form, collatable = _collated_form(obj)
    advice = _ADVICE if collatable else "return arrays, tensors or numbers from the dataset"
    raise RowsUnsupportedError(
        f"cannot spread the samples of a batch over workers: {path} is {_short(obj)}, which {form}; {advice}")


def _short(obj) -> str:
    if isinstance(obj, (np.ndarray, torch.Tensor)):
        return f"a {type(obj).__name__} ({layout._describe(obj)})"
    text = repr(obj).replace("\n", " ")
    return f"{type(obj).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _collated_form(obj) -> tuple[str, bool]:
    """What torch's default_collate makes of a batch of `obj`, in words; and whether it can."""
    if isinstance(obj, torch.Tensor):
        return "torch's default_collate stacks with torch.stack as a tensor subclass, not row by row", True
    if isinstance(obj, np.ndarray):
        return "torch's default_collate converts with torch.as_tensor (dropping its subclass), not row by row", True
    try:
        collated = torch_collate.default_collate([obj, obj])
    except Exception as exc:
        return f"torch's default_collate cannot collate either ({type(exc).__name__}: {str(exc)[:120]})", False
    if isinstance(collated, list):
        return f"torch's default_collate keeps as a list of {type(obj).__name__}, not a stacked tensor", True
    return f"torch's default_collate makes a {type(collated).__name__} of, not a stack of rows", True


def _number_rows(batch, *, collate_fn_map=None):
    """A number leaf: a StackedLeaf of the dtype torch's default_collate gives it."""
    elem = batch[0]
    dtype = _NUMBER_DTYPES.get(type(elem)) or layout._NUMPY_TO_TORCH[elem.dtype]
    return layout.StackedLeaf(batch, dtype, ())


_ROWS_COLLATE_MAP = dict(layout.SLOT_COLLATE_MAP)
for _key in list(_ROWS_COLLATE_MAP):
    if _key in (float, int) or (isinstance(_key, tuple) and np.number in _key):
        _ROWS_COLLATE_MAP[_key] = _number_rows


# -- writing a row (worker) ------------------------------------------------------------------------


def _mismatch(what: str, path: str, row: int, expected: str, got: str) -> BatchShapeError:
    return BatchShapeError(f"{what}: expected {expected} at {path} row {row}, got {got}")


def _plain_array(obj):
    """What torch's default_collate stacks of a numpy subclass: a memmap is the ndarray it is, a
    masked array its data (torch.as_tensor ignores the mask); anything else as it is."""
    kind = type(obj)
    if kind is np.ndarray:
        return obj
    if kind is np.memmap:
        return obj.view(np.ndarray)
    if layout.is_masked_array(obj) and obj._baseclass is np.ndarray:
        return obj.data
    return obj


def _gather(node, obj, path: str, row: int, out: list) -> None:
    """Check `obj` against `node` and append its leaves to `out` in the schema's order."""
    tag = node[0]
    if tag == "leaf":
        out.append(_plain_array(obj))  # as _learn_tree
        return
    kind = node[1]
    if tag == "map":
        keys, children = node[2], node[3]
        if row == 0:  # torch copies row 0's mapping and key order into the batch
            if type(obj) is not kind or tuple(obj) != keys:
                got = f"{type(obj).__name__} with keys {list(obj)}" if isinstance(obj, Mapping) else _describe(obj)
                raise _mismatch("sample structure differs", path, row, f"{kind.__name__} with keys {list(keys)}", got)
        elif not isinstance(obj, Mapping) or any(key not in obj for key in keys):
            got = f"{type(obj).__name__} with keys {list(obj)}" if isinstance(obj, Mapping) else _describe(obj)
            error = _mismatch("sample structure differs", path, row, f"a mapping with keys {list(keys)}", got)
            if isinstance(obj, Mapping):  # a missing key: torch's default_collate raises KeyError
                raise MissingKeyError(*error.args)
            raise error
        for key, child in zip(keys, children):
            _gather(child, obj[key], f"{path}[{key!r}]", row, out)
        return
    children = node[2]
    fields = getattr(kind, "_fields", None)
    ok = (type(obj) is kind) if row == 0 else isinstance(obj, (list, tuple))
    if not ok or len(obj) != len(children):
        got = f"{type(obj).__name__} of {len(obj)}" if isinstance(obj, (list, tuple)) else _describe(obj)
        raise _mismatch("sample structure differs", path, row, f"{kind.__name__} of {len(children)}", got)
    for i, (value, child) in enumerate(zip(obj, children)):
        _gather(child, value, f"{path}.{fields[i]}" if fields else f"{path}[{i}]", row, out)


def _check_leaf(leaf: RowLeaf, value, row: int):
    """`value` ready to copy (a plain tensor with conj/neg resolved, the packed bytes of a
    number), or raise naming the leaf's path and the row."""
    kind = leaf.kind
    if kind == "ndarray":
        if type(value) is torch.Tensor and row > 0:  # torch.as_tensor of each sample, then a stack
            return _tensor_row(leaf, value, row)
        if type(value) is not np.ndarray:
            raise _mismatch("sample leaf differs", leaf.path, row, leaf.describe(), _describe(value))
        if row == 0 and value.dtype != leaf.numpy_dtype:  # row 0 sets the batch's dtype
            raise _mismatch("sample dtype differs", leaf.path, row, leaf.describe(), _describe(value))
        if (value.shape == leaf.row_shape and value.dtype != leaf.numpy_dtype and value.dtype.isnative
                and layout._torch_takes_as_is(value)):
            try:
                as_tensor = torch.from_numpy(value)
            except TypeError:  # a dtype torch has no tensor of
                _torch_refusal(leaf, value, row)
            return _cast_as_torch_stacks(leaf, as_tensor, row)
        if value.dtype != leaf.numpy_dtype or value.shape != leaf.row_shape:
            if value.dtype.byteorder not in "=|" and value.dtype.newbyteorder("=") == leaf.numpy_dtype:
                _torch_refusal(leaf, value, row)
            raise _mismatch("cannot stack samples", leaf.path, row, leaf.describe(), _describe(value))
        if not layout._torch_takes_as_is(value):
            _torch_refusal(leaf, value, row)
        return value
    if kind == "tensor":
        if type(value) is not torch.Tensor:
            error = _mismatch("sample leaf differs", leaf.path, row, leaf.describe(), _describe(value))
            # torch's default_collate in a worker sums the samples' numel() first
            try:
                value.numel()
                torchs = "a stack of tensors only"
            except Exception as exc:
                torchs = str(exc)
            raise NotATensorError(f"{error}: {torchs} (torch's error); return a tensor in every sample")
        if row == 0 and value.dtype != leaf.dtype:  # row 0 sets the batch's dtype
            raise _mismatch("sample dtype differs", leaf.path, row, leaf.describe(), _describe(value))
        return _tensor_row(leaf, value, row)
    source = leaf.source_type
    if kind == "numpy scalar":
        if type(value) is source:
            return value.tobytes()
        if row == 0 or type(value) not in _ACCEPTS.get(source, ()):
            raise _mismatch("sample leaf differs", leaf.path, row, leaf.describe(), _describe(value))
        return source(value).tobytes()
    if type(value) is not source and (row == 0 or type(value) not in _ACCEPTS[source]):
        error = _mismatch("sample leaf differs", leaf.path, row, leaf.describe(), _describe(value))
        if type(value) in _PACK:  # e.g. a float among int labels: torch makes that batch float
            raise BatchShapeError(f"{error}; torch's default_collate would make this batch's "
                                  f"{leaf.path} {type(value).__name__}, but sample_parallel fixes each "
                                  "number's type from the first sample it sees: return one type "
                                  "in every sample, or use the default mode (sample_parallel=False)")
        raise error
    try:
        return _PACK[source](source(value))
    except (struct.error, OverflowError) as exc:
        raise OverflowError(f"{value} at {leaf.path} row {row} does not fit {_torch_name(leaf.dtype)}: {exc}") from None


def _tensor_row(leaf: RowLeaf, value: torch.Tensor, row: int) -> torch.Tensor:
    """A tensor row ready to copy: cast into row 0's dtype as torch stacks it, or torch's error."""
    if tuple(value.shape) == leaf.row_shape and value.dtype != leaf.dtype:
        value = _cast_as_torch_stacks(leaf, value, row)
    if value.dtype != leaf.dtype or tuple(value.shape) != leaf.row_shape:
        raise _mismatch("cannot stack samples", leaf.path, row, leaf.describe(), _describe(value))
    if (value.layout != torch.strided or value.device.type != "cpu" or value.is_nested
            or value.requires_grad):
        raise RowsUnsupportedError(
            f"cannot write {_describe(value)} at {leaf.path} row {row} as a row: torch's "
            f"default_collate stacks a {value.device.type} / {value.layout} / grad-requiring "
            f"tensor with torch.stack; {_ADVICE}")
    return value.resolve_conj().resolve_neg()


def _cast_as_torch_stacks(leaf: RowLeaf, value: torch.Tensor, row: int) -> torch.Tensor:
    """A row of another dtype than row 0's, cast as torch's default_collate in a worker casts it:
    torch.stack into an out= of row 0's dtype (a float64 row into float32 rows is rounded; an
    int batch gets no float row: torch's error, with the leaf's path)."""
    try:
        torch.stack([torch.zeros((), dtype=leaf.dtype), torch.zeros((), dtype=value.dtype)],
                    out=torch.empty(2, dtype=leaf.dtype))
    except (RuntimeError, TypeError) as exc:  # torch's error type, with the leaf's path
        raise type(exc)(f"cannot collate {_describe(value)} at {leaf.path} (sample {row}) into "
                        f"the batch's {_torch_name(leaf.dtype)} of sample 0: {exc}") from None
    return value.to(leaf.dtype)


def _torch_refusal(leaf: RowLeaf, value: np.ndarray, row: int):
    """Raise what torch.as_tensor raises for `value` (default_collate's error), with the path."""
    try:
        torch.as_tensor(value)
    except Exception as exc:
        message = f"cannot collate {_describe(value)} at {leaf.path} (sample {row}): {exc}"
        try:
            error = type(exc)(message)
        except Exception:
            raise exc from None
        raise error from None
    raise _mismatch("cannot stack samples", leaf.path, row, leaf.describe(), _describe(value))


def write_row(segment, schema: RowSchema, row: int, sample, born_in_row: bool = False) -> int:
    """Check `sample` against `schema` and copy its leaves to row `row` of the batch in
    `segment` (a slot claimed for the batch); nothing is written if the check fails.

    With `born_in_row`, the sample was fetched with schema.in_place_leaf's row `row` as an
    arena: a leaf already there (C-contiguous, that address) is not copied, and any other value
    whose memory lies in that row is copied out first, so no write reads bytes another write has
    overwritten.  Returns the bytes found in place."""
    done, ready = prepare_row(segment, schema, row, sample, born_in_row)
    return write_prepared(segment, schema, row, done, ready)


def prepare_row(segment, schema: RowSchema, row: int, sample, born_in_row: bool = False):
    """write_row's checks: (the leaf found in place or None, each leaf's value ready to copy,
    none of them lying in the in-place leaf's row but the one found in place)."""
    if not 0 <= row < schema.batch_size:
        raise IndexError(f"row {row} is outside a batch of {schema.batch_size}")
    if segment.size < schema.total_bytes:
        raise ValueError(f"a batch of {schema.total_bytes} bytes does not fit a {segment.size}-byte slot")
    values: list = []
    _gather(schema.tree, sample, "batch", row, values)
    ready = [_check_leaf(leaf, value, row) for leaf, value in zip(schema.leaves, values)]
    done = None
    if born_in_row:
        done, ready = _in_place(segment, schema, row, ready)
    return done, ready


def write_prepared(segment, schema: RowSchema, row: int, done, ready: list, skip=None) -> int:
    """Copy what prepare_row made ready into row `row`, but leaf `skip` (its row holds an array
    the dataset keeps); returns the bytes found in place."""
    for leaf, value in zip(schema.leaves, ready):
        at = leaf.offset + row * leaf.row_nbytes
        if leaf is done or leaf is skip:
            continue
        if type(value) is bytes:
            segment.write(at, value)
        elif type(value) is np.ndarray:
            layout._copy_numpy(segment, at, value, c_order=True)
        else:
            layout._copy_tensor(segment, at, value)
    return done.row_nbytes if done is not None else 0


def row_bytes(value) -> bytes:
    """The bytes a ready array or tensor value writes into its row (C order)."""
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value).tobytes()
    return value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _in_place(segment, schema: RowSchema, row: int, ready: list) -> tuple[RowLeaf | None, list]:
    """(the in-place leaf if its value is born exactly in its row, else None; the values, those
    that share bytes with that row otherwise copied out)."""
    target = schema.in_place_leaf
    row_lo = segment.address + target.offset + row * target.row_nbytes
    row_hi = row_lo + target.row_nbytes
    done, out = None, []
    for leaf, value in zip(schema.leaves, ready):
        if type(value) is not bytes:
            lo, hi = layout.memory_bounds(value)
            if lo < row_hi and row_lo < hi:  # born in the row
                if leaf is target and layout.data_address(value) == row_lo and layout.c_contiguous(value):
                    done = leaf
                else:  # another leaf, or a view of the row (a transpose...): copy it out first
                    value = value.copy() if isinstance(value, np.ndarray) else value.clone()
        out.append(value)
    return done, out


def publish_batch(segment, schema: RowSchema) -> None:
    """Once every row is written: write the descriptor and publish the slot (WRITING -> READY),
    as a default-mode worker does after layout.write_batch."""
    segment.write(schema.descriptor_offset, schema.descriptor)
    segment.publish(len(schema.descriptor), schema.total_bytes, schema.descriptor_offset)


# -- per-sample seeding ----------------------------------------------------------------------------

_SEED_KEY = struct.Struct("<4Q")
_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1


def sample_seed(base_seed: int, epoch: int, batch_idx: int, row: int) -> int:
    """A 63-bit seed for one sample, a function of these four numbers only:

        int.from_bytes(blake2b(pack("<4Q", base_seed, epoch, batch_idx, row) (each mod 2**64),
                               digest_size=8, person=b"shmloader-rows").digest(), "little") % 2**63

    Below 2**63, as the seeds of torch's workers are, so torch.initial_seed() fits an int64."""
    key = _SEED_KEY.pack(base_seed & _MASK64, epoch & _MASK64, batch_idx & _MASK64, row & _MASK64)
    digest = hashlib.blake2b(key, digest_size=8, person=b"shmloader-rows").digest()
    return int.from_bytes(digest, "little") & _MASK63


def seed_sample(seed: int) -> None:
    """Seed python's `random` with `seed`, numpy's global RNG with its two 32-bit halves
    ([seed & 0xffffffff, seed >> 32]) and torch's CPU generator with `seed` (0 <= seed < 2**64).

    About 28 us on the 2-core dev machine: numpy's legacy seeding from two words is 19 of them
    (from one 32-bit word it is 2.5 us, but 2**32 streams collide within an epoch of 100k
    samples), python's random.seed 7, torch's 1.7; sample_seed itself 1.7 us."""
    random.seed(seed)
    np.random.seed((seed & 0xFFFFFFFF, seed >> 32))
    torch.default_generator.manual_seed(seed)

