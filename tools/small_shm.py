"""torch's DataLoader against ShmDataLoader in a Docker-sized /dev/shm (64 MiB by default): each
run in its own private tmpfs (`unshare -m`, needs root), so that no run inherits another's
leftovers; s/batch, median [min-max] over interleaved rounds.

    sudo python tools/small_shm.py [--shm-mib 64] [--rounds 3]

The workload: 48 samples of 5 MiB uint8 after a 2 ms sleep, batch 4 (20 MiB), a loop that reads
every 4096th byte and sleeps 10 ms per batch (README, "Shared-memory capacity"); torch's
default_collate, or `"collate": "numpy"`: collate_fn=np.stack.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

CONFIGS = ({"num_workers": 1}, {"num_workers": 2, "prefetch_factor": 1}, {"num_workers": 2},
           {"num_workers": 4}, {"num_workers": 4, "collate": "numpy"})


def one_run(kwargs: dict, which: str) -> dict:
    """Inside the private tmpfs: one loader, one pass; what happened, as a dict."""
    import numpy as np
    from torch.utils.data import DataLoader, Dataset

    from shmloader import ShmCapacityWarning, ShmDataLoader

    class Samples(Dataset):
        def __len__(self):
            return 48

        def __getitem__(self, i):
            time.sleep(0.002)
            return np.full((5 * 1024, 1024), i % 251, dtype=np.uint8)

    cls = DataLoader if which == "torch" else ShmDataLoader
    out = {"which": which, "kwargs": kwargs}
    kwargs = dict(kwargs)
    if kwargs.pop("collate", None) == "numpy":  # what users write; torch pickles its batches
        kwargs["collate_fn"] = np.stack
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start, batches = time.perf_counter(), 0
        try:
            for batch in cls(Samples(), batch_size=4, **kwargs):
                int(batch[:, ::4096].sum())
                batches += 1
                time.sleep(0.01)
            out["s_per_batch"] = (time.perf_counter() - start) / batches
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[-1][:200]}"
    out["fitted"] = any(issubclass(w.category, ShmCapacityWarning) for w in caught)
    return out


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--one":
        print(json.dumps(one_run(json.loads(sys.argv[2]), sys.argv[3])), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shm-mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root: each run mounts its own tmpfs on /dev/shm in a private namespace")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = (f"mount -t tmpfs -o size={args.shm_mib}m tmpfs /dev/shm && "
              'exec "$0" tools/small_shm.py --one "$1" "$2"')
    results: dict = {}
    for _ in range(args.rounds):
        for kwargs in CONFIGS:
            for which in ("torch", "shmloader"):
                done = subprocess.run(["unshare", "-m", "sh", "-c", script, sys.executable, json.dumps(kwargs), which],
                                      cwd=root, capture_output=True, text=True, timeout=300)
                lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
                r = json.loads(lines[-1]) if lines else {"error": f"exit {done.returncode}: {done.stderr[-200:]}"}
                results.setdefault((json.dumps(kwargs), which), []).append(r)
    print(f"/dev/shm {args.shm_mib} MiB, 20 MiB batches; s/batch median [min-max] of {args.rounds}")
    for (kwargs, which), runs in results.items():
        times = [r["s_per_batch"] * 1e3 for r in runs if "s_per_batch" in r]
        errors = sorted({r["error"] for r in runs if "error" in r})
        figure = f"{statistics.median(times):.1f} ms [{min(times):.1f}-{max(times):.1f}]" if times else "-"
        fitted = " (fitted)" if any(r.get("fitted") for r in runs) else ""
        print(f"{kwargs:42s} {which:9s} ran {len(times)}/{len(runs)}  {figure}{fitted}")
        for error in errors:
            print(f"{'':52s}{error}")


if __name__ == "__main__":
    main()
