"""Resuming mid-epoch (issue 11, NOTE [ Resuming mid-epoch ] in shmloader/state.py): a state saved
after k batches, loaded by a new loader, yields what an uninterrupted run yields after batch k,
batch for batch, checked against torchdata's StatefulDataLoader on the same datasets."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler

from shmloader import ShmDataLoader
from shmloader.state import FORMAT, FORMAT_KEY

from . import _state_datasets as sds
from ._launch import run_python
from ._resume import interrupted, plain, uninterrupted

torchdata_sdl = pytest.importorskip("torchdata.stateful_dataloader")
td_sampler = pytest.importorskip("torchdata.stateful_dataloader.sampler")
StatefulDataLoader = torchdata_sdl.StatefulDataLoader

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.usefixtures("no_leaks"),
    pytest.mark.filterwarnings("ignore:.*set_vital.*:UserWarning"),  # torchdata 0.11 on torch 2.13
    pytest.mark.filterwarnings("ignore:Neither dataset nor iter:UserWarning"),
    pytest.mark.filterwarnings("ignore:Neither the dataset nor iter:UserWarning"),
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),  # 3 workers, 2 cores
]

CONFIGS = [(0, False), (2, False), (2, True)]  # (num_workers, persistent_workers)
CONFIG_IDS = ["in-process", "2-workers", "2-persistent"]


def check_against_torchdata(make_shm, make_td, saves) -> None:
    """Uninterrupted, both loaders yield the same; resumed at each (epoch, k) of `saves`, each
    yields what it yields uninterrupted, so the same as the other."""
    want = uninterrupted(make_td)
    assert uninterrupted(make_shm) == want
    for epoch, k in saves:
        got_td, _ = interrupted(make_td, epoch, k)
        got, state = interrupted(make_shm, epoch, k)
        assert got_td == want, f"torchdata itself does not resume at epoch {epoch}, batch {k}"
        assert got == want, f"resumed at epoch {epoch}, batch {k}"
        assert state["batches_yielded"] == k and not state["epoch_finished"]


# -- iterable datasets: each worker's state --------------------------------------------------------


@pytest.mark.parametrize("dataset", [sds.StatefulIterStream, sds.EpochStream, sds.PlainStream],
                         ids=["iterator-state", "dataset-state", "no-state"])
@pytest.mark.parametrize(("num_workers", "persistent"), CONFIGS, ids=CONFIG_IDS)
def test_iterable_dataset_resumes_like_torchdata(dataset, num_workers, persistent):
    """Per-worker states (the iterator's, or the dataset's own, which under persistent workers
    changes from epoch to epoch), uneven shards whose ends fall mid-epoch, and fast-forward for a
    dataset without state; saved in epoch 1 (near its end, a shard already over) and epoch 2."""
    kwargs = dict(batch_size=4, num_workers=num_workers, persistent_workers=persistent)
    n_batches = len(uninterrupted(lambda: ShmDataLoader(dataset(), **kwargs), 1)[0])
    check_against_torchdata(lambda: ShmDataLoader(dataset(), **kwargs),
                            lambda: StatefulDataLoader(dataset(), **kwargs),
                            saves=[(0, n_batches - 1), (1, 2)])


@pytest.mark.parametrize(("num_workers", "persistent"), CONFIGS, ids=CONFIG_IDS)
def test_map_style_dataset_state_resumes_like_torchdata(num_workers, persistent):
    """A map-style dataset with state: each worker's, as torchdata keeps it."""
    kwargs = dict(batch_size=3, num_workers=num_workers, persistent_workers=persistent)
    check_against_torchdata(lambda: ShmDataLoader(sds.CountingMap(), **kwargs),
                            lambda: StatefulDataLoader(sds.CountingMap(), **kwargs),
                            saves=[(0, 3), (1, 4)])


def test_state_after_the_last_batch_starts_the_next_epoch():
    """A state saved when the epoch had ended (StopIteration) resumes with the next epoch."""
    def make():
        return ShmDataLoader(sds.EpochStream(), batch_size=4, num_workers=2, persistent_workers=True)

    want = uninterrupted(make)
    loader = make()
    first = [plain(b) for b in loader]
    state = loader.state_dict()
    assert state["epoch_finished"] and state["batches_yielded"] == len(first)
    del loader
    resumed = make()
    resumed.load_state_dict(state)
    assert [first] + [[plain(b) for b in resumed] for _ in range(2)] == want


@pytest.mark.parametrize("num_workers", [0, 1])
def test_state_after_a_partial_last_batch_resumes_as_torchdata(num_workers):
    """Saved right after the epoch's last batch, a partial one (the stream ended while it was
    filled, and rewound its position): in process the resumed loop yields nothing more, as the
    uninterrupted run and torchdata do (found by a new-user check: it replayed the whole epoch);
    with a worker, torchdata asks the stream for one more batch, and so does shmloader."""
    def run(cls):
        loader = cls(sds.RewindingStream(), batch_size=3, num_workers=num_workers)
        first = []
        for batch in loader:
            first.append(plain(batch))
            if len(first) == 3:
                state = copy.deepcopy(loader.state_dict())
        resumed = cls(sds.RewindingStream(), batch_size=3, num_workers=num_workers)
        resumed.load_state_dict(state)
        return first, [plain(b) for b in resumed], [plain(b) for b in resumed]

    first, rest, after = run(ShmDataLoader)
    assert first == [[0, 1, 2], [3, 4, 5], [6]] and after == first
    assert (first, rest, after) == run(StatefulDataLoader)
    if num_workers == 0:
        assert rest == []


# -- map-style datasets: the sampler's position --------------------------------------------------


@pytest.mark.parametrize(("num_workers", "persistent"), CONFIGS, ids=CONFIG_IDS)
def test_stateful_batch_sampler_resumes_like_torchdata(num_workers, persistent):
    """A batch_sampler with state (torchdata's own BatchSampler over its RandomSampler): saved and
    loaded as torchdata does, the same batches as torchdata's, saved in epochs 1 and 2."""
    dataset = sds.Indexed(30)

    def batch_sampler():
        return td_sampler.BatchSampler(td_sampler.RandomSampler(dataset, generator=torch.Generator().manual_seed(3)),
                                       batch_size=4, drop_last=False)

    kwargs = dict(num_workers=num_workers, persistent_workers=persistent)
    check_against_torchdata(lambda: ShmDataLoader(dataset, batch_sampler=batch_sampler(), **kwargs),
                            lambda: StatefulDataLoader(dataset, batch_sampler=batch_sampler(), **kwargs),
                            saves=[(0, 3), (1, 5)])


@pytest.mark.parametrize(("num_workers", "persistent"), CONFIGS, ids=CONFIG_IDS)
def test_shuffle_with_generator_resumes_exactly(num_workers, persistent):
    """shuffle=True with a generator: ShmDataLoader yields torch's DataLoader's order (torchdata's
    StatefulDataLoader draws its permutation otherwise, README "Resuming mid-epoch"); saved in
    epoch 1 or 2, ShmDataLoader resumes exactly, the rest of the epoch and the next, and so does
    torchdata with workers (in process, its epochs after the resumed one differ)."""
    dataset = sds.Indexed(30)
    kwargs = dict(batch_size=4, shuffle=True, num_workers=num_workers, persistent_workers=persistent)

    def make():
        return ShmDataLoader(dataset, generator=torch.Generator().manual_seed(5), **kwargs)

    def make_td():
        return StatefulDataLoader(dataset, generator=torch.Generator().manual_seed(5), **kwargs)

    want = uninterrupted(make)
    assert want == uninterrupted(lambda: DataLoader(dataset, generator=torch.Generator().manual_seed(5), **kwargs))
    want_td = uninterrupted(make_td)
    for epoch, k in [(0, 2), (1, 6)]:
        got, state = interrupted(make, epoch, k)
        assert got == want, f"resumed at epoch {epoch}, batch {k}"
        assert state["sampler"]["yielded"] == k
        got_td = interrupted(make_td, epoch, k)[0]
        assert got_td[epoch] == want_td[epoch]
        if num_workers:  # in process, torchdata's later epochs differ (README "Resuming mid-epoch")
            assert got_td == want_td


def test_torch_random_sampler_resumes_in_any_epoch():
    """torch's RandomSampler passed as `sampler` has no state: ShmDataLoader replays it from the
    generator's state at the epoch's start.  Saved in epoch 1 the batches are torchdata's; saved in
    epoch 2 too they are the uninterrupted run's (torchdata fast-forwards a fresh iterator of the
    sampler there, which draws a new permutation: README "Resuming mid-epoch")."""
    dataset = sds.Indexed(30)

    def sampler():
        return RandomSampler(dataset, generator=torch.Generator().manual_seed(8))

    def make():
        return ShmDataLoader(dataset, batch_size=4, sampler=sampler(), num_workers=2)

    want = uninterrupted(lambda: StatefulDataLoader(dataset, batch_size=4, sampler=sampler(), num_workers=2))
    assert uninterrupted(make) == want
    assert interrupted(lambda: StatefulDataLoader(dataset, batch_size=4, sampler=sampler(), num_workers=2),
                       0, 3)[0] == want
    assert interrupted(make, 0, 3)[0] == want
    assert interrupted(make, 1, 3)[0] == want


def test_shuffle_without_generator_resumes_the_epoch():
    """No generator: torch's sampler seeds its permutation from torch's global RNG, whose state at
    the epoch's start the state holds; the resumed epoch is exact whatever the resuming process's
    global RNG, and that RNG is left as it was (later epochs draw from it, as torch's do)."""
    dataset = sds.Indexed(30)
    torch.manual_seed(123)
    loader = ShmDataLoader(dataset, batch_size=4, shuffle=True, num_workers=2)
    iterator = iter(loader)
    first = [plain(next(iterator)) for _ in range(3)]
    state = copy.deepcopy(loader.state_dict())
    rest = [plain(b) for b in iterator]
    del iterator, loader
    torch.manual_seed(456)
    resumed = ShmDataLoader(dataset, batch_size=4, shuffle=True, num_workers=2)
    resumed.load_state_dict(state)
    iterator = iter(resumed)
    before = torch.get_rng_state()
    assert [plain(b) for b in iterator] == rest
    assert torch.equal(torch.get_rng_state(), before)
    assert sorted(i for b in first + rest for i in b["i"]) == list(range(30))
    del iterator, resumed


def test_map_style_state_resumes_under_another_num_workers():
    """A map-style dataset without state depends only on the sampler's position, so its state
    loads under another (non-zero) num_workers (torchdata asserts the same number)."""
    dataset = sds.Indexed(30)

    def make(num_workers):
        return ShmDataLoader(dataset, batch_size=4, shuffle=True, num_workers=num_workers,
                             generator=torch.Generator().manual_seed(2))

    want = uninterrupted(lambda: make(2), 2)
    loader = make(2)
    iterator = iter(loader)
    first = [plain(next(iterator)) for _ in range(4)]
    state = loader.state_dict()
    del iterator, loader
    for num_workers in (1, 2):
        resumed = make(num_workers)
        resumed.load_state_dict(state)
        assert [first + [plain(b) for b in resumed], [plain(b) for b in resumed]] == want
        del resumed


# -- torchdata's state_dict() / load_state_dict() semantics ----------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_before_iteration_fixes_the_run(num_workers):
    """state_dict() before any iteration starts the iterator (its seed and permutation drawn then)
    and the next iter() uses it, as torchdata does: loading that state reproduces the run even
    though the global RNG moved on in between."""
    dataset = sds.Indexed(30)
    runs = []
    for cls in (ShmDataLoader, StatefulDataLoader):
        torch.manual_seed(77)
        loader = cls(dataset, batch_size=4, shuffle=True, num_workers=num_workers)
        state = copy.deepcopy(loader.state_dict())
        torch.rand(100)  # the training loop draws from the global RNG before the first batch
        got = [plain(b) for b in loader]
        del loader
        torch.manual_seed(78)
        resumed = cls(dataset, batch_size=4, shuffle=True, num_workers=num_workers)
        resumed.load_state_dict(state)
        assert [plain(b) for b in resumed] == got, cls.__name__
        del resumed
        runs.append(state)
    assert runs[0]["batches_yielded"] == 0 and not runs[0]["epoch_finished"]


@pytest.mark.parametrize("with_generator", [False, True])
def test_in_process_the_first_index_is_drawn_at_the_first_next_as_torch_draws_it(with_generator):
    """What the loop does between iter() and the first next() (a seed set, a model made) shapes
    torch's permutation; and a state saved later in that epoch resumes it."""
    def make(cls):
        torch.manual_seed(5)
        generator = torch.Generator().manual_seed(6) if with_generator else None
        return cls(range(40), batch_size=4, shuffle=True, num_workers=0, generator=generator), generator

    def first_epoch(cls):
        loader, generator = make(cls)
        it = iter(loader)
        torch.manual_seed(7)  # between iter() and next()
        if generator is not None:
            generator.manual_seed(8)
        return loader, it

    loader, it = first_epoch(DataLoader)
    want = [b.tolist() for b in it]
    loader, it = first_epoch(ShmDataLoader)
    got = [next(it).tolist() for _ in range(3)]
    state = copy.deepcopy(loader.state_dict())
    got += [b.tolist() for b in it]
    assert got == want
    resumed, _ = make(ShmDataLoader)
    resumed.load_state_dict(state)
    torch.manual_seed(9)  # the resuming process's global RNG is elsewhere
    assert [b.tolist() for b in resumed] == want[3:]


def test_load_then_state_dict_gives_the_loaded_state():
    """load_state_dict() then state_dict() before iterating: the loaded position (torchdata's
    behaviour: the resumed iterator is started and the next iter() uses it)."""
    def make():
        return ShmDataLoader(sds.StatefulIterStream(), batch_size=4, num_workers=2)

    loader = make()
    iterator = iter(loader)
    first = [plain(next(iterator)) for _ in range(3)]
    state = copy.deepcopy(loader.state_dict())
    rest = [plain(b) for b in iterator]
    del iterator, loader
    resumed = make()
    resumed.load_state_dict(state)
    again = resumed.state_dict()
    for key in ("batches_yielded", "last_worker", "workers", "epoch_finished", "base_seed"):
        assert again[key] == state[key], key
    assert [plain(b) for b in resumed] == rest and len(first) == 3
    del resumed


def test_empty_state_is_ignored():
    loader = ShmDataLoader(sds.Indexed(8), batch_size=4)
    loader.load_state_dict({})
    assert [plain(b)["i"] for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]


# -- a fresh process -----------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_resume_in_a_fresh_process(tmp_path):
    """Preempted in one process, resumed in another (spawn workers, another global seed): the
    batches the two yield together are those of an uninterrupted run (the iterable stream's are
    torchdata's too)."""
    saved, out = tmp_path / "state.pt", tmp_path / "resumed.pt"
    run_python("-m", "tests._state_script", "save", str(saved), "3")
    run_python("-m", "tests._state_script", "resume", str(saved), str(out))
    before, after = torch.load(saved), torch.load(out)
    stream = StatefulDataLoader(sds.StatefulIterStream(), batch_size=4, num_workers=2, persistent_workers=True)
    want = {
        "stream": [plain(b) for _ in range(3) for b in stream],
        "shuffled": [b for epoch in uninterrupted(lambda: DataLoader(
            sds.Indexed(30), batch_size=4, shuffle=True, num_workers=2,
            generator=torch.Generator().manual_seed(11))) for b in epoch],
    }
    del stream
    for name, batches in want.items():
        assert before["batches"][name] + after["batches"][name] == batches, name


# -- states that cannot be resumed ---------------------------------------------------------------


def saved_state(dataset, **kwargs) -> dict:
    loader = ShmDataLoader(dataset, batch_size=4, **kwargs)
    iterator = iter(loader)
    next(iterator)
    state = copy.deepcopy(loader.state_dict())
    del iterator, loader
    return state


def test_another_format_is_refused():
    state = saved_state(sds.StatefulIterStream(), num_workers=2)
    for version in (FORMAT + 1, 0):
        state[FORMAT_KEY] = version
        loader = ShmDataLoader(sds.StatefulIterStream(), batch_size=4, num_workers=2)
        with pytest.raises(ValueError, match=f"the state has format {version} .*reads format {FORMAT}"):
            loader.load_state_dict(state)


def test_torchdata_state_is_refused():
    loader = StatefulDataLoader(sds.Indexed(8), batch_size=4, num_workers=0)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="torchdata StatefulDataLoader state"):
        ShmDataLoader(sds.Indexed(8), batch_size=4).load_state_dict(state)
    with pytest.raises(ValueError, match="not a ShmDataLoader state"):
        ShmDataLoader(sds.Indexed(8), batch_size=4).load_state_dict({"epoch": 3})


@pytest.mark.parametrize(("saved_with", "change", "message"), [
    (sds.StatefulIterStream, dict(num_workers=3), "num_workers=2, this loader has num_workers=3 .*own"),
    (sds.StatefulIterStream, dict(num_workers=0), "num_workers=2, this loader has num_workers=0"),
    (sds.StatefulIterStream, dict(batch_size=5), "batch_size=4, this loader has batch_size=5"),
    (sds.StatefulIterStream, dict(dataset=sds.Indexed(30)),
     "dataset_kind='iterable', this loader has dataset_kind='map-style'"),
    (sds.Indexed, dict(num_workers=0), "num_workers=2, this loader has num_workers=0 .*in-process"),
    (sds.Indexed, dict(dataset=sds.Indexed(51)), "sampler_length=50, this loader has sampler_length=51"),
    (sds.Indexed, dict(shuffle=True), "sampler='torch.utils.data.sampler.SequentialSampler', this loader "
                                      "has sampler='torch.utils.data.sampler.RandomSampler'"),
    (sds.CountingMap, dict(num_workers=3), "num_workers=2, this loader has num_workers=3 .*own"),
    (sds.CountingMap, dict(dataset=sds.Indexed(24)), "holds the dataset's state but this dataset"),
], ids=["num_workers", "in-process", "batch_size", "dataset-kind", "map-in-process", "length", "shuffle",
        "map-state-num_workers", "map-state-lost"])
def test_a_differently_built_loader_is_refused(saved_with, change, message):
    state = saved_state(saved_with(), num_workers=2)
    kwargs = dict(dataset=saved_with(), batch_size=4, num_workers=2)
    kwargs.update(change)
    loader = ShmDataLoader(**kwargs)
    with pytest.raises(ValueError, match=message):
        loader.load_state_dict(state)


def test_a_refused_state_leaves_the_loader_as_it_was():
    loader = ShmDataLoader(sds.Indexed(8), batch_size=4, num_workers=2, persistent_workers=True)
    first = [plain(b)["i"] for b in loader]
    state = loader.state_dict()
    state[FORMAT_KEY] = FORMAT + 1
    with warnings.catch_warnings(), pytest.raises(ValueError):
        loader.load_state_dict(state)
    assert [plain(b)["i"] for b in loader] == first
    del loader


def test_state_after_a_sampler_error_resumes_as_torchdata():
    """A sampler that raised mid-epoch (its error caught by the loop, the epoch gone on): the
    state saved after it resumes with the batches torchdata's StatefulDataLoader resumes with,
    then a whole next epoch."""
    from . import _datasets as ds

    def run(loader_class):
        make = dict(dataset=ds.ArrayDataset(32, nbytes=4), batch_size=4, num_workers=2)
        loader = loader_class(sampler=ds.SamplerFailingAt(), **make)
        it, seen = iter(loader), []
        for _ in range(5):
            try:
                seen.append(int(next(it)[0]))
            except IndexError:
                seen.append("IndexError")
        resumed = loader_class(sampler=ds.SamplerFailingAt(at=99), **make)
        resumed.load_state_dict(loader.state_dict())
        return seen, [int(b[0]) for b in resumed], [int(b[0]) for b in resumed]

    want = run(StatefulDataLoader)
    assert want == ([0, 4, 8, "IndexError", 16], [20, 24, 28], list(range(0, 32, 4)))  # torchdata 0.11's
    assert run(ShmDataLoader) == want
