"""Leaf types as torch's DataLoader delivers them: every case runs through torch's DataLoader and
ShmDataLoader (2 workers each) and must come out the same — types (tensor subclasses, masked
arrays), metadata (subclass attributes, masks, fill values), dtypes with their byte order,
shapes, strides, values bit for bit — or fail where torch fails, with torch's exception type and
the leaf's path.

  * tensor subclasses: a user's subclass with an attribute, a subclass whose operations return
    plain tensors (as torchvision's tv_tensors do), and torchvision's own Image, BoundingBoxes
    and Mask when torchvision can be imported; under the default collate and custom ones;
  * numpy masked arrays and object arrays;
  * dataclasses and namedtuples returned by a collate_fn;
  * 0-d arrays and tensors, sliced, transposed, expanded and negative-stride layouts,
    big-endian dtypes.
"""

from __future__ import annotations

import collections
import dataclasses
import gc

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from shmloader import LayoutError, ShmDataLoader, layout

from ._helpers import assert_same, both, in_ring

pytestmark = pytest.mark.usefixtures("no_leaks")


# -- samples, collates and the comparison ------------------------------------------------------------


class Made(Dataset):
    """`n` samples, sample i being make(i) (`make` a module-level function, so spawn works)."""

    def __init__(self, make, n: int = 4):
        self.make, self.n = make, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.make(i)


def first(samples):
    return samples[0]


def as_list(samples):
    return samples


def stacked(samples):
    return torch.stack(samples)


def loaders_agree(dataset, **kwargs) -> list:
    """Each ShmDataLoader batch, as it arrives (copying it would lose its strides), equals torch's
    batch; returns torch's batches."""
    kwargs = {"batch_size": 2, "num_workers": 2, **kwargs}
    shm, ref = both(dataset, **kwargs)
    want = list(ref)
    count = 0
    for got in shm:
        assert count < len(want), f"ShmDataLoader gives more than torch's {len(want)} batches"
        assert_same(got, want[count], f"batch #{count}")
        count += 1
        del got
    assert count == len(want), f"ShmDataLoader gives {count} batches, torch {len(want)}"
    return want


def first_error(loader) -> Exception:
    it = iter(loader)
    try:
        for _ in it:
            pass
    except Exception as exc:
        return exc
    finally:
        if not isinstance(loader, ShmDataLoader):
            it._shutdown_workers()  # torch's iterator takes seconds to stop when left to the gc
    raise AssertionError(f"{type(loader).__name__} raised nothing")


def loaders_fail_alike(dataset, **kwargs) -> tuple[Exception, Exception]:
    """Both loaders raise, ShmDataLoader with (a subclass of) torch's exception type and torch's
    message in its own."""
    kwargs = {"batch_size": 2, "num_workers": 2, **kwargs}
    shm, ref = both(dataset, **kwargs)
    want = first_error(ref)
    got = first_error(shm)
    assert isinstance(got, type(want)), f"{type(got).__name__} is not torch's {type(want).__name__}"
    torch_says = str(want).strip().splitlines()[-1].split(": ", 1)[-1]
    assert torch_says in str(got), f"torch says {torch_says!r}, shmloader {str(got)!r}"
    return got, want


def nan_with_payload(payload: int, dtype: str = "<f4") -> np.ndarray:
    """A quiet NaN carrying `payload` in its mantissa, as a 1-element array of `dtype`."""
    bits = np.array([0x7FC00000 | payload], dtype=dtype.replace("f", "u"))
    return bits.view(dtype)


# -- tensor subclasses ---------------------------------------------------------------------------------


class Tagged(torch.Tensor):
    """A user's tensor subclass with an attribute (torch's default __torch_function__: operations
    on it return Tagged, without the attribute)."""


def tagged(i):
    tensor = (torch.arange(6.0).reshape(2, 3) + i).as_subclass(Tagged)
    tensor.tag = {"sample": i, "source": "disk"}
    return tensor


class Boxes(torch.Tensor):
    """Shaped like torchvision's tv_tensors: metadata in attributes, and every operation (stack
    included) returns a plain tensor, as TVTensor.__torch_function__ does."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def boxes(i):
    out = torch.tensor([[0, 0, 4, 4 + i], [1, 1, 2, 2]], dtype=torch.int64).as_subclass(Boxes)
    out.format, out.canvas_size = "XYXY", (32, 48 + i)
    return out


@pytest.mark.parametrize("collate_fn", [None, first, stacked, as_list], ids=["default", "first", "stack", "list"])
@pytest.mark.parametrize("make", [tagged, boxes])
def test_tensor_subclasses(make, collate_fn):
    want = loaders_agree(Made(make), collate_fn=collate_fn)
    leaf = want[0][0] if collate_fn is as_list else want[0]
    if collate_fn in (first, as_list):  # torch pickles the sample whole: type and attributes
        assert type(leaf) is type(make(0)) and vars(leaf) == vars(make(0))
    elif make is tagged:  # a new Tagged from torch.stack, without the sample's attribute
        assert type(leaf) is Tagged and vars(leaf) == {}
    else:  # Boxes' operations return plain tensors, torch.stack included
        assert type(leaf) is torch.Tensor


def _tv_tensors():
    try:
        from torchvision import tv_tensors
    except ImportError:
        pytest.skip("torchvision is not installed")
    except RuntimeError as exc:  # e.g. a CUDA build of torchvision beside a CPU build of torch
        pytest.skip(f"torchvision is installed but cannot be imported: {exc}")
    return tv_tensors


def vision_sample(i):
    from torchvision import tv_tensors as tv

    return {
        "image": tv.Image(torch.full((3, 4, 5), i, dtype=torch.uint8)),
        "boxes": tv.BoundingBoxes(torch.tensor([[0.0, 1.0, 3.0, 4.0 + i]]), format="XYWH", canvas_size=(4, 5)),
        "mask": tv.Mask(torch.eye(4, 5, dtype=torch.bool)),
        "label": i,
    }


def detection_collate(samples):
    """What detection models take: images in a list, one dict of targets per image."""
    return [s["image"] for s in samples], [{"boxes": s["boxes"], "mask": s["mask"]} for s in samples]


def to_image(samples):
    from torchvision import tv_tensors as tv

    return tv.Image(torch.stack([s["image"] for s in samples]))


@pytest.mark.parametrize("collate_fn", [None, first, detection_collate, to_image],
                         ids=["default", "first", "detection", "to-image"])
def test_torchvision_tv_tensors(collate_fn):
    tv = _tv_tensors()
    want = loaders_agree(Made(vision_sample), collate_fn=collate_fn)
    if collate_fn is None:  # TVTensor's torch.stack gives plain tensors
        assert type(want[0]["image"]) is torch.Tensor and type(want[0]["boxes"]) is torch.Tensor
    elif collate_fn is first:
        assert type(want[0]["boxes"]) is tv.BoundingBoxes and want[0]["boxes"].canvas_size == (4, 5)
    elif collate_fn is detection_collate:
        assert type(want[0][1][0]["mask"]) is tv.Mask
    else:
        assert type(want[0]) is tv.Image


def tagged_big(i):
    """tagged, of 128 KiB: delivered as a view (a small leaf is a copy)."""
    tensor = (torch.arange(32768.0) + i).as_subclass(Tagged)
    tensor.tag = {"sample": i, "source": "disk"}
    return tensor


def test_held_subclass_tensor_keeps_its_slot():
    """A subclass tensor is a view onto its slot (through its storage), holding the slot's lease:
    the slot is not reused while it lives."""
    loader = ShmDataLoader(Made(tagged_big, n=40), batch_size=1, num_workers=2, collate_fn=first,
                           prefetch_factor=1, max_ring_slots=4)
    it = iter(loader)
    kept = next(it)
    assert in_ring(kept, it)
    for batch in it:  # 39 more batches through a ring of at most 4 slots
        del batch
    assert type(kept) is Tagged and kept.tag == {"sample": 0, "source": "disk"}
    assert torch.equal(kept.as_subclass(torch.Tensor), tagged_big(0).as_subclass(torch.Tensor))
    del kept, it
    gc.collect()


# -- numpy masked arrays and object arrays -------------------------------------------------------------


def masked(i):
    grid = np.arange(12.0).reshape(3, 4) + i
    return {
        "masked": np.ma.MaskedArray(np.arange(5.0) + i, mask=[0, 1, 0, i % 2, 1], fill_value=-7.5),
        "unmasked": np.ma.MaskedArray(np.arange(3, dtype=np.int32) + i),  # mask is nomask
        "fortran": np.ma.MaskedArray(grid.T, mask=grid.T > 5 + i),
        "hard": np.ma.MaskedArray(np.ones(2, np.float32), mask=[True, False], hard_mask=True),
        "nan": np.ma.MaskedArray(nan_with_payload(0x1234 + i), mask=[False]),
    }


@pytest.mark.parametrize("collate_fn", [None, first, as_list], ids=["default", "first", "list"])
def test_masked_arrays(collate_fn):
    want = loaders_agree(Made(masked), collate_fn=collate_fn)
    if collate_fn is None:  # default_collate takes the data and drops the mask
        assert type(want[0]["masked"]) is torch.Tensor
    else:
        sample = want[0] if collate_fn is first else want[0][0]
        assert type(sample["masked"]) is np.ma.MaskedArray and sample["masked"].fill_value == -7.5


def test_masked_array_data_and_mask_are_views_onto_the_slot(monkeypatch):
    monkeypatch.setattr(layout, "SMALL_LEAF_BYTES", 0)  # these small leaves would be copies
    loader = ShmDataLoader(Made(masked), batch_size=2, num_workers=2, collate_fn=first)
    it = iter(loader)
    batch = next(it)
    for key in ("masked", "fortran", "hard"):
        assert in_ring(batch[key].data, it) and in_ring(batch[key].mask, it), key
    del batch, it


def objects(i):
    return {"ok": np.zeros(2, np.float32), "obj": np.array([i, "text", None, (1, 2)], dtype=object)}


@pytest.mark.parametrize("collate_fn", [first, as_list], ids=["first", "list"])
def test_object_arrays_with_a_custom_collate_are_pickled_as_torch_does(collate_fn):
    want = loaders_agree(Made(objects), collate_fn=collate_fn)
    sample = want[0] if collate_fn is first else want[0][1]
    assert sample["obj"].dtype == object and sample["obj"][3] == (1, 2)


def test_object_arrays_with_the_default_collate_fail_as_torch_does():
    got, _ = loaders_fail_alike(Made(objects))
    assert isinstance(got, LayoutError) and isinstance(got, TypeError)
    assert "batch['obj']" in str(got)


# -- containers returned by a collate_fn ----------------------------------------------------------------

Pair = collections.namedtuple("Pair", ["image", "label"])


@dataclasses.dataclass
class Record:
    images: torch.Tensor
    labels: np.ndarray
    meta: dict


@dataclasses.dataclass(frozen=True)
class Frozen:
    name: str
    values: tuple


def sample_with_label(i):
    return {"image": np.full((2, 3), i, np.float32), "label": i}


def records_collate(samples):
    return {
        "record": Record(
            images=torch.stack([torch.from_numpy(s["image"]) for s in samples]),
            labels=np.array([s["label"] for s in samples], dtype=np.int16),
            meta={"pairs": [Pair(s["image"], s["label"]) for s in samples],
                  "frozen": Frozen("batch", tuple(torch.tensor(s["label"]) for s in samples))},
        ),
        "pair": Pair(torch.zeros(2), [s["label"] for s in samples]),
    }


def test_dataclasses_and_namedtuples_from_a_collate_fn():
    want = loaders_agree(Made(sample_with_label, n=6), collate_fn=records_collate)
    assert type(want[0]["record"]) is Record and type(want[0]["record"].meta["frozen"]) is Frozen


# -- shapes, strides, byte order -------------------------------------------------------------------------


def zero_d(i):
    return {"array": np.array(i * 1.5), "int16": np.array(i, np.int16), "tensor": torch.tensor(i * 1.5),
            "nan": nan_with_payload(0x42 + i).reshape(()), "bool": torch.tensor(bool(i % 2))}


@pytest.mark.parametrize("collate_fn", [None, first, as_list], ids=["default", "first", "list"])
def test_zero_d_arrays_and_tensors(collate_fn):
    loaders_agree(Made(zero_d), collate_fn=collate_fn)


def stride_edge_leaves(i):
    grid = torch.zeros(4, 3)
    return {"column": torch.arange(5.0).view(1, 5).t() + i, "one": torch.zeros(2, 1, 3).transpose(0, 1),
            "rows": np.zeros((0, 3)), "columns": np.zeros((3, 0), np.int8),
            "fortran": np.asfortranarray(np.zeros((3, 0, 2))), "tensor": torch.zeros(0, 3),
            "transposed": torch.zeros(3, 0).t(), "sliced": grid[:, :0], "grad": torch.zeros(0, 2).requires_grad_()}


@pytest.mark.parametrize("collate_fn", [first, as_list], ids=["first", "list"])
def test_empty_and_one_element_dimensions_keep_torchs_strides(collate_fn):
    """Empty leaves have no bytes, but their strides are what torch's pickle gives them (numpy
    unpickles an empty array C-ordered; torch keeps a tensor's strides), and so are those of a
    contiguous tensor whose one-element dimensions have other strides than torch.empty's."""
    want = loaders_agree(Made(stride_edge_leaves), collate_fn=collate_fn)
    shm, _ = both(Made(stride_edge_leaves), batch_size=2, num_workers=2, collate_fn=collate_fn)
    for got, ref in zip(shm, want):
        for key, leaf in (got.items() if collate_fn is first else enumerate(got)):
            items = [(leaf, ref[key])] if collate_fn is first else list(zip(leaf.values(), ref[key].values()))
            for a, b in items:
                strides = (a.strides, b.strides) if isinstance(a, np.ndarray) else (a.stride(), b.stride())
                assert strides[0] == strides[1], (key, strides)
                if isinstance(a, torch.Tensor):
                    assert a.requires_grad == b.requires_grad
        del got


def strided_arrays(i):
    grid = np.arange(24, dtype=np.float32).reshape(4, 6) + i
    return {"sliced": grid[1:, ::2], "transposed": grid.T, "fortran": np.asfortranarray(grid),
            "column": grid[:, 2]}


def reversed_arrays(i):
    grid = np.arange(12, dtype=np.int64).reshape(3, 4) + i
    return {"fine": grid, "negative": grid[:, ::-1]}


@pytest.mark.parametrize("collate_fn", [None, first, as_list], ids=["default", "first", "list"])
def test_non_contiguous_arrays(collate_fn):
    want = loaders_agree(Made(strided_arrays), collate_fn=collate_fn)
    if collate_fn is first:  # numpy's pickle: Fortran order kept, other layouts made C-contiguous
        assert want[0]["transposed"].flags.f_contiguous and want[0]["sliced"].flags.c_contiguous


@pytest.mark.parametrize("collate_fn", [first, as_list], ids=["first", "list"])
def test_negative_strides_with_a_custom_collate(collate_fn):
    loaders_agree(Made(reversed_arrays), collate_fn=collate_fn)


def test_negative_strides_with_the_default_collate_fail_as_torch_does():
    got, _ = loaders_fail_alike(Made(reversed_arrays))
    assert isinstance(got, ValueError) and "batch['negative']" in str(got)
    assert "negative" in str(got) and "copy" in str(got)  # what is wrong and what to do


def strided_tensors(i):
    grid = torch.arange(24.0).reshape(4, 6) + i
    return {
        "sliced": grid[1:, ::2],
        "transposed": grid.T,
        "expanded": torch.arange(3, dtype=torch.int32).expand(4, 3),
        "channels_last": torch.arange(2 * 3 * 4 * 5.0).reshape(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
        "offset": grid[2:],
    }


@pytest.mark.parametrize("collate_fn", [None, first, as_list], ids=["default", "first", "list"])
def test_non_contiguous_tensors(collate_fn):
    want = loaders_agree(Made(strided_tensors), collate_fn=collate_fn)
    if collate_fn is first:  # torch shares the storage: views keep their strides
        assert want[0]["transposed"].stride() == (1, 6) and want[0]["expanded"].stride() == (0, 1)


def test_strided_tensors_are_views_onto_the_slot(monkeypatch):
    monkeypatch.setattr(layout, "SMALL_LEAF_BYTES", 0)  # these small leaves would be copies
    loader = ShmDataLoader(Made(strided_tensors), batch_size=2, num_workers=2, collate_fn=first)
    it = iter(loader)
    batch = next(it)
    for key, leaf in batch.items():  # its storage: an expanded view spans fewer bytes than it has elements
        assert in_ring(torch.empty(0, dtype=torch.uint8).set_(leaf.untyped_storage()), it), key
    del batch, leaf, it


# -- tensors sharing a storage (NOTE [ Tensors sharing a storage ] in layout.py) -----------------------


def token_sequence(i):
    return torch.arange(64, dtype=torch.int64) * 7 + i


def next_token_pairs(samples):
    """A language model's collate: inputs and targets, two views of one stacked storage."""
    sequences = torch.stack(samples)
    return {"inputs": sequences[:, :-1], "targets": sequences[:, 1:], "as_int32": sequences.view(torch.int32)[0]}


def slices_of_a_big_tensor(samples):
    """Small views of a storage much bigger than they are (a dataset's table): copies."""
    return [SHARED_TABLE[int(s[0]) % 8] for s in samples]


SHARED_TABLE = torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


@pytest.mark.parametrize("num_workers", [1, 2])
def test_tensors_sharing_a_storage_share_it_as_under_torch(num_workers):
    """x = seq[:, :-1], y = seq[:, 1:]: torch delivers two views of one storage (a write to one
    shows in the other), each with its storage_offset; so does the slot, zero-copy."""
    want = loaders_agree(Made(token_sequence, n=8), batch_size=4, num_workers=num_workers,
                         collate_fn=next_token_pairs)
    assert _same_storage(want[0]["inputs"], want[0]["targets"])  # what torch does
    loader = ShmDataLoader(Made(token_sequence, n=8), batch_size=4, num_workers=num_workers,
                           collate_fn=next_token_pairs)
    it = iter(loader)
    batch = next(it)
    inputs, targets, as_int32 = batch["inputs"], batch["targets"], batch["as_int32"]
    assert _same_storage(inputs, targets) and _same_storage(inputs, as_int32)
    assert (inputs.storage_offset(), targets.storage_offset()) == (0, 1)
    assert in_ring(torch.empty(0, dtype=torch.uint8).set_(inputs.untyped_storage()), it)
    assert inputs.untyped_storage().nbytes() == 4 * 64 * 8  # the storage once, not a copy per view
    inputs[0, 1] = -5
    assert targets[0, 0] == -5
    del batch, inputs, targets, as_int32, it


def test_small_views_of_a_big_storage_come_back_as_copies():
    """Sending the storage whole would put a dataset's whole table in every slot: the views
    travel as copies (storage_offset 0), the slot no bigger than the bytes they span."""
    loader = ShmDataLoader(Made(token_sequence, n=8), batch_size=4, num_workers=1, collate_fn=slices_of_a_big_tensor)
    want = list(torch.utils.data.DataLoader(Made(token_sequence, n=8), batch_size=4, num_workers=1,
                                            collate_fn=slices_of_a_big_tensor))
    assert _same_storage(want[0][0], want[0][1])  # torch sends the 256 KiB table
    it = iter(loader)
    batch = next(it)
    for got, expected in zip(batch, want[0]):
        assert torch.equal(got, expected)
    assert not _same_storage(batch[0], batch[1])
    assert it._ring.slot_bytes < SHARED_TABLE.nbytes
    del batch, it


def big_endian(i):
    return {
        "f4": np.array([0.5, -1.25, 3.0 + i], dtype=">f4"),
        "i8": np.array([-(2**40) - i, 7], dtype=">i8"),
        "zero_d": np.array(i / 3, dtype=">f8"),
        "nan": nan_with_payload(0x2BAD + i, ">f4"),
        "little": np.arange(2, dtype="<u2") + i,
    }


def big_endian_more(i):
    grid = np.arange(12, dtype=">i4").reshape(3, 4) + np.int32(i).astype(">i4")
    return {
        **big_endian(i),
        "sliced": grid[:, ::2],
        "fortran": np.asfortranarray(grid),
        "text": np.array(["ab", f"c{i}"], dtype=">U2"),
        "record": np.array([(i, 1.5)], dtype=[("a", ">i4"), ("b", ">f8")]),
        "masked": np.ma.MaskedArray(np.array([1.0, 2.0 + i], dtype=">f8"), mask=[1, 0], fill_value=4.0),
    }


@pytest.mark.parametrize("collate_fn", [first, as_list], ids=["first", "list"])
def test_big_endian_dtypes_with_a_custom_collate(collate_fn):
    want = loaders_agree(Made(big_endian_more), collate_fn=collate_fn)
    sample = want[0] if collate_fn is first else want[0][1]
    # numpy's pickle swaps these into native byte order (below protocol 5, the default before
    # Python 3.14, all of them), but not the fields of a structured dtype
    assert sample["sliced"].dtype.isnative and sample["masked"].dtype.isnative
    assert sample["record"].dtype["a"].str == ">i4"


def test_big_endian_dtypes_with_the_default_collate_fail_as_torch_does():
    """torch.as_tensor refuses a byte order other than the machine's."""
    got, _ = loaders_fail_alike(Made(big_endian))
    assert isinstance(got, ValueError) and "batch['f4']" in str(got) and "byte order" in str(got)


def native_after_all(i):
    """Arithmetic on a big-endian array gives a native one: the default collate takes that."""
    return {"f4": np.arange(3, dtype=">f4") + i, "be": np.array([i, 2], dtype=">i4").astype("<i4")}


def test_big_endian_arithmetic_results_collate_as_in_torch():
    loaders_agree(Made(native_after_all))


# -- every kind at once, under spawn ------------------------------------------------------------------------


def everything(i):
    return {"tagged": tagged(i), "boxes": boxes(i), "masked": masked(i)["masked"], "objects": objects(i)["obj"],
            "big_endian": big_endian(i)["f4"], "transposed": strided_tensors(i)["transposed"]}


@pytest.mark.timeout(180)
def test_every_kind_under_spawn():
    loaders_agree(Made(everything), collate_fn=as_list, multiprocessing_context="spawn")


def unbatched(i):
    return {"tagged": tagged(i), "boxes": boxes(i), "masked": masked(i)["masked"], "objects": objects(i)["obj"],
            "transposed": strided_tensors(i)["transposed"], "sliced": strided_arrays(i)["sliced"]}


def test_every_kind_without_batching():
    """batch_size=None: torch's default_convert (arrays to tensors, keeping their strides; a masked
    array is not numpy's own ndarray type, so it stays as it is)."""
    want = loaders_agree(Made(unbatched), batch_size=None)
    assert type(want[0]["masked"]) is np.ma.MaskedArray and type(want[0]["sliced"]) is torch.Tensor


# -- sparse, nested, quantized and meta tensors: pickled whole ----------------------------------------


def sparse_coo(i):
    return (torch.eye(4) * (i + 1)).to_sparse()


def nested_strided(i):
    return torch.nested.nested_tensor([torch.full((2, 3), float(i)), torch.arange(12.0).reshape(4, 3)])


def on_meta(i):
    return torch.empty(3, 4 + i % 2, device="meta")


def quantized(i):
    return torch.quantize_per_tensor(torch.arange(12.0).reshape(3, 4) + i, 0.5, 3, torch.quint8)


def _described(obj):
    """A comparable image of a batch of sparse, nested, quantized or meta tensors."""
    if isinstance(obj, (list, tuple)):
        return [_described(x) for x in obj]
    assert isinstance(obj, torch.Tensor), type(obj)
    image = [type(obj), obj.layout, obj.device.type, obj.dtype, obj.is_nested, obj.is_quantized]
    if obj.is_nested:
        return image + [[(tuple(t.shape), t.tolist()) for t in obj.unbind()]]
    image.append(tuple(obj.shape))
    if obj.device.type == "meta":
        return image
    if obj.is_quantized:
        return image + [obj.int_repr().tolist(), obj.q_scale(), obj.q_zero_point()]
    return image + [obj.to_dense().tolist()]


@pytest.mark.filterwarnings("ignore::UserWarning")  # nested tensors are a prototype
@pytest.mark.parametrize("collate_fn", [None, as_list, stacked], ids=["default", "list", "stack"])
@pytest.mark.parametrize("make", [sparse_coo, nested_strided, on_meta])
def test_sparse_nested_and_meta_tensors_as_torch_delivers_them(make, collate_fn):
    """Delivered as torch delivers them where torch can, failing as torch fails where it cannot
    (a sparse tensor's nbytes sized a custom collate's first slot; a nested one was asked for
    its storage; a meta one was refused)."""
    kwargs = {"batch_size": 2, "num_workers": 2, "collate_fn": collate_fn}
    shm, ref = both(Made(make), **kwargs)
    try:
        want = [_described(batch) for batch in ref]
    except Exception as exc:
        got = first_error(shm)
        assert isinstance(got, type(exc)), f"{type(got).__name__}: {got} is not torch's {type(exc).__name__}"
        advice = str(exc).strip().splitlines()[-1]  # torch's message ("... please provide a custom collate_fn")
        assert advice in str(got) and "while collating" in str(got), f"{got} does not say {advice!r}"
        return
    assert [_described(batch) for batch in shm] == want


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized tensors are deprecated
@pytest.mark.parametrize("collate_fn", [as_list, stacked], ids=["list", "stack"])
def test_quantized_tensors_from_a_collate_fn_are_delivered_pickled_whole(collate_fn):
    """torch's workers cannot send a quantized tensor: what they deliver raises an internal
    assertion when used ("cannot call qscheme on UnknownQuantizer").  shmloader's delivered it
    as a raw byte view that crashed the training process.  It is pickled whole now: its
    integers, scale and zero point as made."""
    with pytest.raises(RuntimeError, match="Quantizer"):
        [_described(batch) for batch in DataLoader(Made(quantized), batch_size=2, num_workers=2, collate_fn=collate_fn)]
    got = list(ShmDataLoader(Made(quantized), batch_size=2, num_workers=2, collate_fn=collate_fn))
    want = [collate_fn([quantized(2 * b), quantized(2 * b + 1)]) for b in range(2)]
    assert [_described(batch) for batch in got] == [_described(batch) for batch in want]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_quantized_tensors_with_the_default_collate_fail_as_torch_does():
    """Both fail to stack them in the worker, each at its own internal check: a RuntimeError."""
    shm, ref = both(Made(quantized), batch_size=2, num_workers=2)
    want, got = first_error(ref), first_error(shm)
    assert type(want) is RuntimeError and type(got) is RuntimeError, (want, got)
    assert "while collating the batch" in str(got)


PADDED = np.dtype([("a", "u1"), ("b", "<f8")], align=True)  # 7 padding bytes per record


def padded_records(i):
    """Records whose padding bytes are set (7s): torch's pickled batch keeps every byte."""
    records = np.zeros(3, PADDED)
    records.view(np.uint8)[:] = 7
    records["a"], records["b"] = [i, i + 1, i + 2], [0.5, 1.5, 2.5]
    return {"small": records, "big": np.tile(records, 8192)}  # a copy, and a view onto the slot


def zero_itemsize(i):
    return {"v0": np.zeros((3, 2), dtype="V0"), "x": np.arange(3) + i}


@pytest.mark.parametrize("collate_fn", [first, as_list], ids=["first", "list"])
@pytest.mark.parametrize("make", [padded_records, zero_itemsize])
def test_padded_records_and_zero_size_dtypes_come_back_byte_for_byte(make, collate_fn):
    """A structured dtype's padding bytes (numpy's copy leaves them uninitialized) and a dtype of
    no bytes (V0, which np.frombuffer refuses) come back as torch delivers them."""
    want = loaders_agree(Made(make), collate_fn=collate_fn)
    sample = want[0] if collate_fn is first else want[0][0]
    if make is padded_records:
        assert sample["small"].view(np.uint8)[1:8].tolist() == [7] * 7  # torch keeps the padding
