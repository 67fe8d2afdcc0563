"""torch tensors built in a collate_fn are born in the slot (shmloader/arena.py): torch.stack /
torch.cat without out=, torch's default_collate called inside a collate_fn, and the explicit
`shmloader.empty_tensor`.  The batches stay torch's bit for bit, strides and dtypes included;
whatever the mode must not touch (autograd, non-contiguous results, subclasses) runs as torch
runs it."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from shmloader import ShmDataLoader, empty_tensor
from shmloader.arena import SlotTensorMode

from ._helpers import assert_same_batches

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]

ROW = 64 * 1024  # bytes per sample: well above the arena's threshold


class TensorRows(Dataset):
    def __init__(self, n: int = 32, dtype=torch.float32):
        self.n, self.dtype = n, dtype

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        count = ROW // torch.empty((), dtype=self.dtype).element_size()
        return (torch.arange(count) % 251 + i).to(self.dtype)


def stack(samples):
    return torch.stack(samples)


def cat_dict(samples):
    return {"x": torch.cat(samples), "y": torch.stack([s[:8] for s in samples], dim=1),
            "n": torch.concat([s[:2] for s in samples])}


def promote(samples):  # torch.cat promotes float32 with float64
    return torch.cat([samples[0].double(), *samples[1:]])


def wraps_default_collate(samples):
    return {"batch": default_collate(samples), "count": len(samples)}


def explicit(samples):
    out = empty_tensor((len(samples), *samples[0].shape), samples[0].dtype)
    for i, s in enumerate(samples):
        out[i] = s
    return out


def explicit_stack(samples):
    return torch.stack(samples, out=empty_tensor((len(samples), *samples[0].shape), samples[0].dtype))


def _both(dataset, collate_fn, **kwargs):
    kwargs.setdefault("batch_size", 4)
    kwargs.setdefault("num_workers", 2)
    loader = ShmDataLoader(dataset, collate_fn=collate_fn, persistent_workers=True, **kwargs)
    shm = [copy.deepcopy(b) for b in loader]
    ref = list(DataLoader(dataset, collate_fn=collate_fn, **kwargs))
    return shm, ref, loader.stats()


@pytest.mark.parametrize("collate_fn", [stack, cat_dict, promote, wraps_default_collate, explicit,
                                        explicit_stack])
def test_torch_collates_are_built_in_the_slot(collate_fn):
    shm, ref, stats = _both(TensorRows(), collate_fn)
    assert_same_batches(shm, ref)
    # every batch but the workers' first ones (no slot of the learnt size in hand yet) in place
    assert stats.in_place_bytes >= (len(shm) - 4) * 4 * ROW * 0.9, stats


def test_the_mode_stays_for_a_collate_that_stacks_tensors_batch_after_batch():
    """Past the workers' first TENSOR_MODE_LEARN_BATCHES (worker.py) too."""
    shm, ref, stats = _both(TensorRows(n=160), stack)
    assert_same_batches(shm, ref)
    assert stats.in_place_bytes >= (len(shm) - 4) * 4 * ROW * 0.9, stats


def numpy_then_torch(samples):
    """np.stack for the first 80 indices (10 batches per worker, 9 with an arena: the mode is
    dropped after 8), then torch.stack, which must still give torch's batches."""
    if samples[0][0] < 80:
        return np.stack([s.numpy() for s in samples])
    return torch.stack(samples)


def test_a_collate_that_turns_to_torch_stack_late_still_gives_torchs_batches():
    shm, ref, stats = _both(TensorRows(n=160), numpy_then_torch)
    assert [type(b) for b in shm] == [np.ndarray] * 20 + [torch.Tensor] * 20
    assert_same_batches(shm, ref)
    assert stats.in_place_bytes <= 20 * 4 * ROW, stats  # the torch batches were copied: the mode was dropped


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.complex64, torch.bool, torch.int8])
def test_dtypes_without_or_with_odd_numpy_twins(dtype):
    shm, ref, stats = _both(TensorRows(n=16, dtype=dtype), stack)
    assert_same_batches(shm, ref)
    assert stats.in_place_bytes > 0, stats


class ChannelsLast(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.full((1, 3, 64, 64), float(i)).to(memory_format=torch.channels_last)


def test_a_result_torch_would_not_make_contiguous_keeps_its_strides():
    shm, ref, stats = _both(ChannelsLast(), lambda s: torch.cat(s))
    assert_same_batches(shm, ref)  # strides compared: channels_last, as torch gives it
    assert stats.in_place_bytes == 0, stats


class KeepsTensors:
    """Caches every batch `build(samples)` makes and checks, at each call, that none of them
    changed."""

    def __init__(self, build=torch.stack):
        self.kept = []
        self.build = build

    def __call__(self, samples):
        for batch, snapshot in self.kept:
            if not torch.equal(batch, snapshot):
                raise AssertionError("a tensor the collate_fn kept was overwritten")
        batch = self.build(samples)
        self.kept.append((batch, batch.clone()))
        return batch


def _pad_long(samples):
    """pad_sequence of the samples cut to different lengths (40 KiB or more each: made in the slot)."""
    return torch.nn.utils.rnn.pad_sequence([s.view(-1, 64)[: 160 + k] for k, s in enumerate(samples)])


@pytest.mark.parametrize("build", [torch.stack, _pad_long])
def test_tensors_the_collate_keeps_are_never_overwritten(build):
    shm, ref, stats = _both(TensorRows(n=64), KeepsTensors(build), prefetch_factor=2)
    assert_same_batches(shm, ref)
    assert stats.in_place_bytes == 0, stats  # each batch moved out of the kept segment


def test_the_mode_leaves_autograd_out_and_subclasses_alone():
    a = torch.ones(64, 64, requires_grad=True)
    with SlotTensorMode(0):
        joined = torch.stack([a, a])
        assert joined.requires_grad and joined.grad_fn is not None  # not given an out=
        with torch.no_grad():
            plain = torch.stack([a, a])
        assert not plain.requires_grad
        param = torch.nn.Parameter(torch.ones(4))
        assert type(torch.cat([param, param])) is torch.Tensor  # as torch gives it
        with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
            torch.stack([torch.ones(3), torch.ones(4)])  # torch's own error


def test_stack_and_cat_of_contiguous_tensors_need_no_meta_kernels(monkeypatch):
    """torch's meta kernels take a second or more on their first call in a fresh worker: a
    collate_fn calling torch.stack / torch.cat on contiguous tensors must not wait for them
    (found by a new-user check: 30-40x torch's time for short epochs).  Non-contiguous inputs
    still ask torch (channels_last above)."""
    to_meta = []
    real_to = torch.Tensor.to

    def spy(self, *args, **kwargs):
        if "meta" in args or kwargs.get("device") == "meta":
            to_meta.append(tuple(self.shape))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    rows = [torch.full((32, 16), float(i)) for i in range(4)]
    mixed = [torch.ones(8, 64, dtype=torch.int32), torch.ones(8, 64, dtype=torch.float64)]
    with SlotTensorMode(1024):
        results = [torch.stack(rows), torch.stack(rows, dim=-1), torch.cat(rows, 1), torch.cat(mixed),
                   torch.concat(rows, dim=-2)]
    assert to_meta == []
    for got, want in zip(results, [torch.stack(rows), torch.stack(rows, dim=-1), torch.cat(rows, 1),
                                   torch.cat(mixed), torch.concat(rows, dim=-2)]):
        assert got.dtype == want.dtype and got.stride() == want.stride() and torch.equal(got, want)
    with SlotTensorMode(1024):
        torch.stack([row.T for row in rows])  # not contiguous: torch's meta rules decide
    assert to_meta


def test_empty_tensor_outside_a_worker_is_a_plain_tensor():
    t = empty_tensor((3, 5), torch.bfloat16)
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and t.is_contiguous()
    t.fill_(1.5)
    assert float(t.sum()) == 22.5
    assert np.shares_memory(t.view(torch.uint8).numpy(), t.view(torch.uint8).numpy())


# -- dynamic padding: torch.nn.utils.rnn.pad_sequence ------------------------------------------


class Sequences(Dataset):
    """Sequences of 32 float32 features, 100-700 rows long (a batch of 4: 50-350 KiB padded)."""

    def __len__(self):
        return 160

    def __getitem__(self, i):
        length = 100 + (i * 337) % 600
        return torch.arange(length * 32, dtype=torch.float32).view(length, 32) + i


def pad_right(samples):
    return torch.nn.utils.rnn.pad_sequence(samples, batch_first=True, padding_value=-1.0)


def pad_time_first_left(samples):
    return {"x": torch.nn.utils.rnn.pad_sequence(samples, padding_side="left"),
            "lengths": torch.tensor([len(s) for s in samples])}


@pytest.mark.parametrize("collate_fn", [pad_right, pad_time_first_left])
def test_pad_sequence_batches_are_built_in_the_slot(collate_fn):
    """The usual collate_fn of sequences: torch's batches, and (but the first ones, made while
    the slot size is learnt) born in the slot, not made on the worker's heap and copied."""
    shm, ref, stats = _both(Sequences(), collate_fn)
    assert_same_batches(shm, ref)
    padded = sum((b if isinstance(b, torch.Tensor) else b["x"]).nbytes for b in shm)
    assert stats.in_place_bytes >= 0.7 * padded, (stats, padded)


PAD_VALUES = [0.0, 2.7, -1, True, float("nan"), float("inf"), 300, 1e300, 2**60 + 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64,
                                   torch.int64, torch.int8, torch.uint8, torch.bool])
def test_pad_sequence_in_the_mode_is_torchs_bit_for_bit_and_raises_torchs_errors(dtype):
    """Every side, layout and padding value, lengths with an empty sequence or none shorter:
    the same dtype, shape, strides and bytes as torch's pad_sequence, or the same error (a
    padding value the dtype cannot hold)."""
    pad = torch.nn.utils.rnn.pad_sequence

    def raw(t: torch.Tensor) -> bytes:
        return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes()

    def outcome(mode, sequences, **kwargs):
        try:
            if mode is None:
                return pad(sequences, **kwargs)
            with mode:
                return pad(sequences, **kwargs)
        except RuntimeError as exc:
            return exc

    made = 0
    for lengths in ((5, 0, 9, 3), (4, 4)):
        sequences = [(torch.arange(n * 6).view(n, 2, 3) % 7).to(dtype) for n in lengths]
        for batch_first in (True, False):
            for side in ("right", "left"):
                for value in PAD_VALUES:
                    kwargs = dict(batch_first=batch_first, padding_value=value, padding_side=side)
                    mode = SlotTensorMode(0, min_sequence_bytes=0)
                    got, want = outcome(mode, sequences, **kwargs), outcome(None, sequences, **kwargs)
                    assert mode.builder_calls == 1
                    case = (lengths, kwargs)
                    if isinstance(want, RuntimeError) or isinstance(got, RuntimeError):
                        assert type(got) is type(want) and str(got) == str(want), case
                        continue
                    assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride()), case
                    assert raw(got) == raw(want), case
                    made += 1
    assert made > 0


def test_pad_sequence_the_mode_does_not_make_runs_as_torch_runs_it():
    """Mixed dtypes (torch casts to the first's), other trailing shapes (torch's error),
    autograd: left to torch, with torch's result or error."""
    pad = torch.nn.utils.rnn.pad_sequence
    mixed = [torch.ones(3, 4, dtype=torch.float64), torch.arange(8, dtype=torch.int32).view(2, 4)]
    grad = [torch.ones(3, 4, requires_grad=True), torch.ones(2, 4)]
    with SlotTensorMode(0, min_sequence_bytes=0):
        got_mixed = pad(mixed, batch_first=True)
        got_grad = pad(grad)
        with pytest.raises(RuntimeError, match="must match the size"):
            pad([torch.ones(2, 3), torch.ones(2, 4)])
    assert got_mixed.dtype == torch.float64 and torch.equal(got_mixed, pad(mixed, batch_first=True))
    assert got_grad.grad_fn is not None and torch.equal(got_grad, pad(grad))


def test_pad_sequence_of_short_sequences_is_left_to_torch(monkeypatch):
    """Token ids (256 sequences of 0.4 KiB): copying each from Python costs more than torch's
    pad_sequence and a copy into the slot (PAD_MIN_SEQUENCE_BYTES), so torch makes it; long ones
    are made in the slot's memory."""
    from shmloader import arena

    made = []
    real_empty = arena.empty_tensor
    monkeypatch.setattr(arena, "empty_tensor", lambda *a, **k: made.append(a) or real_empty(*a, **k))
    pad = torch.nn.utils.rnn.pad_sequence
    tokens = [torch.arange(20 + i % 80) for i in range(256)]
    frames = [torch.ones(200 + 10 * i, 80) for i in range(8)]  # 62-90 KiB each
    with SlotTensorMode(16 * 1024) as mode:
        got_tokens = pad(tokens, batch_first=True)
        assert mode.builder_calls == 0  # a collate_fn of token ids alone drops the mode after a few batches
        got_frames = pad(frames, batch_first=True)
    assert torch.equal(got_tokens, pad(tokens, batch_first=True)) and torch.equal(got_frames, pad(frames, batch_first=True))
    assert made == [((8, 270, 80), torch.float32)]


def pad_then_grow(samples):
    """Resized in place after pad_sequence (an end frame added): found by a new-user check."""
    padded = torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)
    old = padded.numel()
    padded.resize_(padded.shape[0], padded.shape[1] + 1, padded.shape[2])
    padded.view(-1)[old:] = 1
    return padded


def stack_then_grow(samples):
    stacked = torch.stack(samples)
    old = stacked.numel()
    stacked.resize_as_(torch.empty(stacked.shape[0] + 1, *stacked.shape[1:]))
    stacked.view(-1)[old:] = 2
    return stacked


@pytest.mark.parametrize("collate_fn, dataset", [(pad_then_grow, Sequences), (stack_then_grow, TensorRows)])
def test_a_tensor_built_in_the_slot_can_be_resized_as_torchs_can(collate_fn, dataset):
    """A block of the slot cannot grow; a tensor the mode made there gets a heap storage of its
    own before resize_ / resize_as_, as torch's result has: torch's batches, no error."""
    shm, ref, stats = _both(dataset(), collate_fn)
    assert_same_batches(shm, ref)


DTYPES = [torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.complex64]


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _same(got, want, case) -> None:
    if isinstance(want, Exception) or isinstance(got, Exception):
        assert type(got) is type(want) and str(got) == str(want), case
        return
    assert (type(got), got.dtype, got.shape, got.stride()) == (type(want), want.dtype, want.shape, want.stride()), case
    assert _raw(got) == _raw(want), case


def _outcome(mode, fn):
    try:
        if mode is None:
            return fn()
        with mode:
            return fn()
    except (RuntimeError, TypeError) as exc:
        return exc


@pytest.mark.parametrize("dtype", DTYPES)
def test_conversions_and_arithmetic_in_the_mode_are_torchs_bit_for_bit(dtype):
    """.float() / .half() / .double() / .bfloat16() / .to(dtype) and + - * / by numbers, 0-d
    tensors and tensors of the same shape: torch's dtype (true division of integers, integer
    overflow, type promotion), shape, strides and bytes, or torch's error."""
    x = (torch.arange(4 * 6 * 5) * 37 % 251).view(4, 6, 5).to(dtype)
    y = (torch.arange(4 * 6 * 5) % 7 + 1).view(4, 6, 5).to(dtype)
    cases = {
        "float": lambda: x.float(), "half": lambda: x.half(), "double": lambda: x.double(),
        "bfloat16": lambda: x.bfloat16(), "to": lambda: x.to(torch.float32), "to_kw": lambda: x.to(dtype=torch.int16),
        "div_int": lambda: x / 255, "div_float": lambda: x / 2.5, "mul_int": lambda: x * 3, "mul_float": lambda: x * 0.5,
        "add": lambda: x + 200, "sub_float": lambda: x - 127.5, "sub_tensor": lambda: x - y, "div_tensor": lambda: x / y,
        "mul_0d": lambda: x * torch.tensor(3.0), "torch_div": lambda: torch.div(x, 7), "torch_add": lambda: torch.add(x, y),
        "method_sub": lambda: x.sub(1), "broadcast": lambda: x * y[0],
    }
    made = 0
    for name, fn in cases.items():
        mode = SlotTensorMode(0)
        got, want = _outcome(mode, fn), _outcome(None, fn)
        _same(got, want, (dtype, name))
        made += mode.builder_calls
    assert made > 0


def test_what_the_mode_does_not_make_runs_as_torch_runs_it():
    """The same dtype (torch returns the tensor itself), autograd, non-contiguous tensors,
    keyword arguments (alpha, rounding_mode), a bool tensor: left to torch."""
    x = torch.arange(12.0).view(3, 4)
    grad = torch.ones(3, 4, requires_grad=True)
    mode = SlotTensorMode(0)
    with mode:
        same = x.float()
        to_same = x.to(torch.float32)
        with_grad = grad * 2
        transposed = x.t().half()
        floor = torch.div(x, 3, rounding_mode="floor")
        alpha = torch.sub(x, x, alpha=2)
        flags = torch.ones(3, 4, dtype=torch.bool) * True
    assert mode.builder_calls == 0 and not mode.made
    assert same is x and to_same is x
    assert with_grad.grad_fn is not None
    assert transposed.stride() == x.t().half().stride()
    assert torch.equal(floor, torch.div(x, 3, rounding_mode="floor")) and torch.equal(alpha, -x)
    assert flags.dtype == (torch.ones(3, 4, dtype=torch.bool) * True).dtype


class Pixels(Dataset):
    def __len__(self):
        return 48

    def __getitem__(self, i):
        return (torch.arange(ROW) * 7 + i).remainder(256).to(torch.uint8).view(64, 1024)


def float_div(samples):
    return torch.stack(samples).float() / 255


def numpy_stack_to_float(samples):
    return torch.from_numpy(np.stack([s.numpy() for s in samples])).float().div_(255)


def half_scaled(samples):
    return torch.stack(samples).half() * 2


@pytest.mark.parametrize("collate_fn", [float_div, numpy_stack_to_float, half_scaled])
def test_a_collate_that_converts_tensors_builds_the_batch_in_the_slot(collate_fn):
    """Before, the converted batch was made by torch on the heap and copied (0 bytes in place)."""
    shm, ref, stats = _both(Pixels(), collate_fn)
    assert_same_batches(shm, ref)
    copied = 2 + stats.ring_slots  # each worker's first batch, each slot's growth at most
    assert stats.in_place_bytes >= (len(shm) - copied) * ref[0].nbytes, stats
