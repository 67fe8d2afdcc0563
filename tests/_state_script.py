"""A training process that is preempted and one that resumes it (tests/test_state.py):

    python -m tests._state_script save OUT K       # epoch 1 whole, K batches of epoch 2, state → OUT
    python -m tests._state_script resume IN OUT    # load IN's state: the rest of epoch 2, epoch 3

Two loaders: an iterable dataset with per-worker state under persistent workers, and a
shuffled map-style dataset with a generator.  The resuming process uses the spawn start method
and another global seed, so nothing but the saved state can carry the position over.
"""

from __future__ import annotations

import sys

import torch

from shmloader import ShmDataLoader

from . import _state_datasets as sds


def loaders(context=None) -> dict[str, ShmDataLoader]:
    return {
        "stream": ShmDataLoader(sds.StatefulIterStream(), batch_size=4, num_workers=2,
                                persistent_workers=True, multiprocessing_context=context),
        "shuffled": ShmDataLoader(sds.Indexed(30), batch_size=4, shuffle=True, num_workers=2,
                                  generator=torch.Generator().manual_seed(11),
                                  multiprocessing_context=context),
    }


def plain(batch) -> dict:
    return {key: value.tolist() for key, value in batch.items()}


def save(out: str, k: int) -> None:
    batches, states = {}, {}
    for name, loader in loaders().items():
        got = [plain(b) for b in loader]
        iterator = iter(loader)
        got += [plain(next(iterator)) for _ in range(k)]
        states[name] = loader.state_dict()
        batches[name] = got
        del iterator, loader
    torch.save({"batches": batches, "states": states}, out)


def resume(saved_path: str, out: str) -> None:
    torch.manual_seed(987654321)
    saved = torch.load(saved_path)  # weights_only: a state is plain data and tensors
    batches = {}
    for name, loader in loaders("spawn").items():
        loader.load_state_dict(saved["states"][name])
        batches[name] = [plain(b) for b in loader] + [plain(b) for b in loader]
        del loader
    torch.save({"batches": batches}, out)


if __name__ == "__main__":
    if sys.argv[1] == "save":
        save(sys.argv[2], int(sys.argv[3]))
    else:
        resume(sys.argv[2], sys.argv[3])
