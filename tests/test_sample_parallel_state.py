"""Resuming a sample_parallel epoch (NOTE [ Resuming a sample-parallel epoch ] in
shmloader/sample_parallel.py): a state saved after k batches, loaded by a new loader, yields what
an uninterrupted run yields after batch k, random augmentations included (their rows are seeded
by epoch, batch and row, so the saved epoch count and seed must come back)."""

from __future__ import annotations

import io
import random
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from shmloader import ShmDataLoader

from ._resume import interrupted, plain, uninterrupted

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.usefixtures("no_leaks"),
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),  # 3 workers, 2 cores
]

N, BATCH = 23, 4  # 6 batches an epoch, the last one short


class Augmented(Dataset):
    """Sample i plus noise from each RNG a transform draws from (numpy's, torch's, python's)."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        noise = np.random.rand(2) + torch.rand(2).numpy() + random.random()
        return {"x": (i + noise).astype(np.float32), "i": i}


class WithState(Augmented):
    """A map-style dataset with torchdata's protocol: its state cannot be saved in this mode."""

    def state_dict(self):
        return {"calls": 0}

    def load_state_dict(self, state):
        pass


def rows_loader(num_workers=2, persistent=True, dataset=None, **kwargs):
    kwargs.setdefault("generator", torch.Generator().manual_seed(11))
    return ShmDataLoader(dataset if dataset is not None else Augmented(), batch_size=BATCH, shuffle=True,
                         num_workers=num_workers, persistent_workers=persistent, sample_parallel=True, **kwargs)


def through_bytes(state: dict) -> dict:
    """`state` as torch.save / torch.load bring it back (Lightning's checkpoints; plain data
    and tensors: weights_only=True reads it)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


SAVES = [(0, 2), (1, 0), (1, 5), (1, 6), (2, 3)]  # (epochs done, batches of the next); (1, 6): all of it


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "fresh-workers"])
def test_a_saved_epoch_resumes_with_the_same_batches(persistent):
    make = lambda: rows_loader(persistent=persistent)  # noqa: E731
    want = uninterrupted(make)
    assert want[0] != want[1] and len({tuple(b["x"][0]) for e in want for b in e}) > 1  # shuffled, random
    for epoch, k in SAVES:
        got, state = interrupted(make, epoch, k)
        assert got == want, f"resumed at epoch {epoch}, batch {k}"
        assert state["batches_yielded"] == k and state["epoch"] == (epoch if persistent else 0)


def test_resumes_under_another_num_workers():
    """Rows are seeded by (seed, epoch, batch, row), not by worker: any num_workers >= 1 resumes."""
    want = uninterrupted(lambda: rows_loader(num_workers=2))
    for epoch, k in [(1, 3), (2, 1)]:
        saved_by = rows_loader(num_workers=2)
        [list(saved_by) for _ in range(epoch)]
        iterator = iter(saved_by)
        first = [next(iterator) for _ in range(k)]
        state = through_bytes(saved_by.state_dict())
        del iterator, saved_by
        resumed = rows_loader(num_workers=3)
        resumed.load_state_dict(state)
        got = [b["x"].tolist() for b in first] + [b["x"].tolist() for b in resumed]
        assert got == [b["x"] for b in want[epoch]]
        assert [[b["x"].tolist() for b in resumed] for _ in range(epoch + 1, 3)] == [
            [b["x"] for b in e] for e in want[epoch + 1:]]
        del resumed, first


def test_shuffle_without_a_generator_resumes_the_epoch():
    """The permutation and the seed come from torch's global RNG: their states at the epoch's
    start are saved, so the resumed epoch is exact whatever the resuming process's global RNG,
    which is left as it was (later epochs draw from it, as the default mode's do)."""
    torch.manual_seed(3)
    saved_by = rows_loader(generator=None)
    iterator = iter(saved_by)
    first = [plain(next(iterator)) for _ in range(2)]
    state = through_bytes(saved_by.state_dict())
    rest = [plain(b) for b in iterator]
    del iterator, saved_by
    torch.manual_seed(456)
    resumed = rows_loader(generator=None)
    resumed.load_state_dict(state)
    iterator = iter(resumed)
    before = torch.get_rng_state()
    assert [plain(b) for b in iterator] == rest
    assert torch.equal(torch.get_rng_state(), before)
    assert sorted(i for b in first + rest for i in b["i"]) == list(range(N))
    del iterator, resumed


def test_prefetch_next_epoch_resumes_at_the_boundary_and_mid_epoch():
    """Saved where the next epoch's first batches are in flight (after the last batch, and at
    batch 0), and mid-epoch: the same batches as the uninterrupted run."""
    make = lambda: rows_loader(prefetch_next_epoch=True)  # noqa: E731
    want = uninterrupted(make)
    assert want == uninterrupted(lambda: rows_loader())
    for epoch, k in [(0, 6), (1, 0), (1, 4)]:
        got, _ = interrupted(make, epoch, k)
        assert got == want, f"resumed at epoch {epoch}, batch {k}"


def test_a_state_saved_before_the_first_batch_fixes_the_run():
    """state_dict() before any iteration starts the iterator the next iter() uses (its seed
    drawn); a loader resumed from that state yields the same run."""
    loader = rows_loader()
    state = through_bytes(loader.state_dict())
    want = [[b["x"].tolist() for b in loader] for _ in range(2)]
    del loader
    resumed = rows_loader(generator=torch.Generator().manual_seed(999))  # the state brings the seed
    with pytest.raises(ValueError):  # (but not a sampler of another length)
        rows_loader(dataset=torch.utils.data.Subset(Augmented(), range(N - 1))).load_state_dict(state)
    resumed.load_state_dict(state)
    # the generator's states come back with the sampler's: the whole run is the saved one
    assert [[b["x"].tolist() for b in resumed] for _ in range(2)] == want
    del resumed


@pytest.mark.parametrize("saved_rows", [True, False], ids=["rows-into-default", "default-into-rows"])
def test_a_state_of_the_other_mode_is_refused(saved_rows):
    """The two modes seed random augmentations differently: a position saved in one means other
    samples in the other, so loading it is a ValueError naming the argument."""
    saved_by = ShmDataLoader(Augmented(), batch_size=BATCH, num_workers=2, sample_parallel=saved_rows)
    iterator = iter(saved_by)
    next(iterator)
    state = saved_by.state_dict()
    del iterator, saved_by
    other = ShmDataLoader(Augmented(), batch_size=BATCH, num_workers=2, sample_parallel=not saved_rows)
    with pytest.raises(ValueError, match=f"sample_parallel={saved_rows}, this loader has "
                                         f"sample_parallel={not saved_rows}"):
        other.load_state_dict(state)
    in_process = ShmDataLoader(Augmented(), batch_size=BATCH, num_workers=0, sample_parallel=True)
    with pytest.raises(ValueError, match="num_workers=2, this loader has num_workers=0"):
        in_process.load_state_dict(state)


def test_a_dataset_with_state_warns_that_only_the_position_is_saved():
    """Its rows are fetched by every worker: no one worker's dataset state to save. The
    position is saved (and resumes), with a warning saying what is not."""
    make = lambda: rows_loader(dataset=WithState())  # noqa: E731
    want = uninterrupted(make)
    with pytest.warns(UserWarning, match="not the state of the dataset .*WithState"):
        got, _ = interrupted(make, 1, 2)
    assert got == want


def test_lightning_style_state_after_each_epoch_is_quiet_and_resumes():
    """What a checkpoint after an epoch saves (the epoch finished): no warning, and the resumed
    loader starts the next epoch."""
    make = lambda: rows_loader()  # noqa: E731
    want = uninterrupted(make)
    loader = make()
    first = [[b["x"].tolist() for b in loader]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = through_bytes(loader.state_dict())
    assert state["epoch_finished"]
    del loader
    resumed = make()
    resumed.load_state_dict(state)
    got = first + [[b["x"].tolist() for b in resumed] for _ in range(2)]
    assert got == [[b["x"] for b in e] for e in want]
    del resumed


class Numbers(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return i


@pytest.mark.parametrize("sample_parallel", [True, False], ids=["rows", "default"])
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "fresh-workers"])
def test_without_a_generator_the_saved_global_rng_gives_the_later_epochs(sample_parallel, persistent):
    """The README's advice for a loader without a generator: save torch's RNG state with the
    loader's, put it back before the resumed loader's iter(); the later epochs are then the
    uninterrupted run's (audit: the resumed iterator's own seed draw left the RNG one draw on)."""
    def make():
        return ShmDataLoader(Numbers(), batch_size=3, shuffle=True, num_workers=2,
                             persistent_workers=persistent, sample_parallel=sample_parallel)

    torch.manual_seed(0)
    saved_by = make()
    iterator = iter(saved_by)
    next(iterator)
    checkpoint = through_bytes({"loader": saved_by.state_dict(), "rng": torch.get_rng_state()})
    want = [[b.tolist() for b in iterator]] + [[b.tolist() for b in saved_by] for _ in range(2)]
    del iterator, saved_by
    torch.manual_seed(999)  # another process's RNG
    resumed = make()
    torch.set_rng_state(checkpoint["rng"])
    resumed.load_state_dict(checkpoint["loader"])
    assert [[b.tolist() for b in resumed] for _ in range(3)] == want
    del resumed


@pytest.mark.parametrize("sample_parallel", [True, False], ids=["rows", "default"])
def test_a_state_of_a_loader_with_another_generator_argument_is_refused(sample_parallel):
    """With generator= the permutation comes from it, without from torch's global RNG: a
    position saved by one means other samples in the other (audit: it was taken silently)."""
    for saved_with in (True, False):
        def make(with_generator):
            return ShmDataLoader(Numbers(), batch_size=3, shuffle=True, num_workers=2,
                                 sample_parallel=sample_parallel,
                                 generator=torch.Generator().manual_seed(0) if with_generator else None)

        saved_by = make(saved_with)
        iterator = iter(saved_by)
        next(iterator)
        state = saved_by.state_dict()
        del iterator, saved_by
        with pytest.raises(ValueError, match=f"generator={saved_with}, this loader has generator={not saved_with}"):
            make(not saved_with).load_state_dict(state)


class FlakyAugmented(Augmented):
    def __getitem__(self, i):
        if i == 5:
            raise RuntimeError("corrupt sample 5")
        return super().__getitem__(i)


def test_a_batch_that_raised_before_the_save_keeps_the_later_batches_seeds():
    """A batch whose row raised, its error caught by the loop, is still a batch drawn: the
    resumed batches are numbered (and their rows seeded) from the sampler's position, not from
    the batches delivered (audit: every later batch got its predecessor's augmentations)."""
    def make():
        return ShmDataLoader(FlakyAugmented(), batch_size=2, num_workers=2, persistent_workers=True,
                             sample_parallel=True, generator=torch.Generator().manual_seed(0))

    def rest(iterator):
        out = []
        while True:
            try:
                out.append(plain(next(iterator)))
            except StopIteration:
                return out
            except RuntimeError:
                out.append("error")

    loader = make()
    iterator = iter(loader)
    got = [plain(next(iterator)), plain(next(iterator))]
    with pytest.raises(RuntimeError, match="corrupt sample 5"):
        next(iterator)  # batch 2 holds index 5
    got.append(plain(next(iterator)))
    state = through_bytes(loader.state_dict())
    want = rest(iterator)
    del iterator, loader
    resumed = make()
    resumed.load_state_dict(state)
    assert rest(iter(resumed)) == want and len(want) == 8
    del resumed


@pytest.mark.parametrize("sample_parallel", [True, False], ids=["rows", "default"])
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "fresh-workers"])
def test_a_generator_reseeded_at_each_epoch_resumes_from_a_state_saved_at_the_end(sample_parallel, persistent):
    """A loop that re-seeds the loader's generator at each epoch's start, a state saved after
    an epoch's end (a checkpoint per epoch): the resumed loader's next epoch is the re-seeded
    one (audit: the first iter() put the generator back over the re-seed, as torchdata does)."""
    def make():
        return ShmDataLoader(Numbers(), batch_size=3, shuffle=True, num_workers=2, generator=torch.Generator(),
                             persistent_workers=persistent, sample_parallel=sample_parallel)

    def epoch(loader, seed):
        loader.generator.manual_seed(seed)
        return [b.tolist() for b in loader]

    saved_by = make()
    want = [epoch(saved_by, 100)]
    state = through_bytes(saved_by.state_dict())
    want += [epoch(saved_by, 101), epoch(saved_by, 102)]
    del saved_by
    resumed = make()
    resumed.load_state_dict(state)
    assert [epoch(resumed, 101), epoch(resumed, 102)] == want[1:]
    del resumed
    # and without re-seeding, the epoch after the saved one is the uninterrupted run's
    saved_by = make()
    saved_by.generator.manual_seed(7)
    [list(saved_by)]
    state = through_bytes(saved_by.state_dict())
    want = [[b.tolist() for b in saved_by] for _ in range(2)]
    del saved_by
    resumed = make()
    resumed.load_state_dict(state)
    assert [[b.tolist() for b in resumed] for _ in range(2)] == want
    del resumed
