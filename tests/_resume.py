"""Save-and-resume runs shared by the tests of loader state (NOTE [ Resuming mid-epoch ] in
shmloader/state.py): the batches of a whole run, and of a run saved mid-epoch and resumed."""

from __future__ import annotations

import copy

EPOCHS = 3


def plain(batch):
    """A batch as lists and numbers, comparable with == (and across processes)."""
    if isinstance(batch, dict):
        return {key: plain(value) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return [plain(value) for value in batch]
    return batch.tolist() if hasattr(batch, "tolist") else batch


def uninterrupted(make, epochs: int = EPOCHS) -> list[list]:
    loader = make()
    got = [[plain(b) for b in loader] for _ in range(epochs)]
    del loader
    return got


def interrupted(make, epoch: int, k: int, epochs: int = EPOCHS) -> tuple[list[list], dict]:
    """Run `epoch` whole epochs and k batches of the next, save, and resume in a new loader built
    by `make`: the batches of all `epochs` epochs as the two runs together yield them, and the
    state."""
    loader = make()
    got = [[plain(b) for b in loader] for _ in range(epoch)]
    iterator = iter(loader)
    current = [plain(next(iterator)) for _ in range(k)]
    state = copy.deepcopy(loader.state_dict())
    del iterator, loader
    resumed = make()
    resumed.load_state_dict(state)
    got.append(current + [plain(b) for b in resumed])
    got += [[plain(b) for b in resumed] for _ in range(epoch + 1, epochs)]
    del resumed
    return got, state
