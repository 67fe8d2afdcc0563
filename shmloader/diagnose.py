"""``python -m shmloader.diagnose``: run your dataset through ShmDataLoader with a given step time
and say whether the loader would be the bottleneck, and how many workers would keep up.

    python -m shmloader.diagnose mypkg.data:make_dataset --batch-size 64 --workers 4 \\
        --batches 200 --step-ms 80 --plot diagnosis.png
    python -m shmloader.diagnose mypkg.data:ImageFolderDataset --args '{"root": "/data"}' \\
        --batch-size 64 --step-ms 80 --sweep 2,4,8,12 --plot sweep.png

DATASET is ``module:name`` (or ``path/to/file.py:name``): a Dataset object, or a callable (a class,
a function) that returns one when called with ``--args`` (a JSON object of keyword arguments).
Each batch is followed by a stand-in for the training step: ``--step-ms`` of sleep (a GPU step,
which leaves the CPU to the workers) or of busy CPU (``--step-kind spin``, a CPU-bound step).
It prints ``loader.stats()`` (the timing table and the verdict; see diagnosis.py) and, with
``--sweep``, seconds per batch at each worker count and the smallest count that keeps up.
``--plot`` draws the per-batch waits and steps, each worker's stages and the sweep (matplotlib;
without it the text is all there is).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import sys
import time
from dataclasses import dataclass

from .diagnosis import LoaderTiming

KNEE_TOLERANCE = 0.10  # a sweep's answer: the fewest workers within 10% of its fastest


@dataclass
class RunResult:
    """One run: the loader's stats at the end, and the run's own per-batch clock (seconds)."""

    num_workers: int
    stats: object  # LoaderStats
    waits: list[float]  # time in next(), per batch (the first included)
    steps: list[float]  # the step after each batch
    seconds_per_batch: float  # wall time per batch after the first

    @property
    def timing(self) -> LoaderTiming | None:
        return getattr(self.stats, "timing", None)

    @property
    def wait_fraction(self) -> float:
        waits, steps = self.waits[1:], self.steps[1:]
        total = sum(waits) + sum(steps)
        return sum(waits) / total if total > 0 else 0.0


def load_dataset(spec: str, kwargs: dict | None = None):
    """The dataset named by ``module:name`` or ``file.py:name`` (called with kwargs if callable)."""
    if ":" not in spec:
        raise SystemExit(f"DATASET must be module:name or path.py:name, got {spec!r}")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py") or os.sep in where:
        module_name = os.path.splitext(os.path.basename(where))[0]
        loaded = importlib.util.spec_from_file_location(module_name, where)
        if loaded is None or loaded.loader is None:
            raise SystemExit(f"cannot import {where!r}")
        module = importlib.util.module_from_spec(loaded)
        sys.modules[module_name] = module  # so that spawned workers can unpickle its classes
        loaded.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    obj = module
    for part in name.split("."):
        obj = getattr(obj, part)
    from torch.utils.data import Dataset, IterableDataset

    if isinstance(obj, (Dataset, IterableDataset)) and not kwargs:
        return obj
    if callable(obj):
        return obj(**(kwargs or {}))
    raise SystemExit(f"{spec} is neither a Dataset nor a callable that makes one")


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def run(dataset, *, num_workers: int, batches: int, step_s: float, step_kind: str = "sleep",
        **loader_kwargs) -> RunResult:
    """Iterate `batches` batches of `dataset` through a ShmDataLoader (more epochs if one is too
    short), a `step_s` step after each, and return its figures."""
    from .loader import ShmDataLoader

    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1 to diagnose the workers, got {num_workers}")
    step = time.sleep if step_kind == "sleep" else _spin
    loader = ShmDataLoader(dataset, num_workers=num_workers, persistent_workers=True,
                           **loader_kwargs)
    waits: list[float] = []
    steps: list[float] = []
    it = iter(loader)
    try:
        t_first = None
        while len(waits) < batches:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                if not waits:
                    raise SystemExit("the dataset gave no batch") from None
                it = iter(loader)  # persistent workers: the next epoch
                continue
            t1 = time.perf_counter()
            waits.append(t1 - t0)
            if t_first is None:
                t_first = t1
            del batch
            step(step_s)
            steps.append(time.perf_counter() - t1)
        t_end = time.perf_counter()
        stats = loader.stats()
    finally:
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()  # now, not when the garbage collector gets to it
        del it, loader
    per = (t_end - t_first) / (batches - 1) if batches > 1 else float("nan")
    return RunResult(num_workers, stats, waits, steps, per)


def sweep(dataset, worker_counts, **kwargs) -> list[RunResult]:
    """run() at each worker count."""
    return [run(dataset, num_workers=w, **kwargs) for w in worker_counts]


def enough_workers(results: list[RunResult], tolerance: float = KNEE_TOLERANCE) -> int | None:
    """What a sweep finds: the fewest workers whose seconds per batch are within `tolerance` of
    the sweep's fastest (more workers gain nothing worth having)."""
    done = [r for r in results if math.isfinite(r.seconds_per_batch)]
    if not done:
        return None
    best = min(r.seconds_per_batch for r in done)
    return min(r.num_workers for r in done if r.seconds_per_batch <= best * (1 + tolerance))


def sweep_table(results: list[RunResult]) -> str:
    lines = ["workers  s/batch   waited  suggested"]
    for r in results:
        t = r.timing
        lines.append(f"{r.num_workers:>7}  {r.seconds_per_batch:7.4f}  {100 * r.wait_fraction:6.1f}%"
                     f"  {'-' if t is None or t.suggested_workers is None else t.suggested_workers:>9}")
    lines.append(f"the fewest workers within {100 * KNEE_TOLERANCE:.0f}% of the fastest: "
                 f"{enough_workers(results)}")
    return "\n".join(lines)


def plot(result: RunResult, path: str, sweep_results: list[RunResult] | None = None) -> str | None:
    """Draw the diagnosis into `path` (PNG); None (and a note on stderr) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib, or "
              "pip install 'shmloader[bench]')", file=sys.stderr)
        return None
    panels = 3 if sweep_results else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2))
    ax = axes[0]
    xs = range(len(result.waits))
    ax.bar(xs, [1e3 * s for s in result.steps], width=1.0, color="tab:blue", label="step")
    ax.bar(xs, [1e3 * w for w in result.waits], width=1.0, bottom=[1e3 * s for s in result.steps],
           color="tab:red", label="waited in next()")
    ax.set_xlabel("batch")
    ax.set_ylabel("ms")
    ax.set_title(f"per batch, {result.num_workers} workers (waited {100 * result.wait_fraction:.0f}%)")
    ax.legend(fontsize=8)
    t = result.timing
    ax = axes[1]
    if t is not None and t.workers:
        stages = (("fetching", "tab:orange"), ("collating", "tab:green"),
                  ("writing", "tab:purple"), ("awaiting_slot", "tab:red"), ("idle", "lightgray"))
        left = [0.0] * len(t.workers)
        ids = [str(w.worker_id) for w in t.workers]
        for name, color in stages:
            share = [getattr(w, f"{name}_s") / (w.active_s or 1.0) * 100 for w in t.workers]
            ax.barh(ids, share, left=left, color=color, label=name.replace("_", " "))
            left = [a + b for a, b in zip(left, share)]
        ax.set_xlabel("% of the worker's time")
        ax.set_ylabel("worker")
        ax.set_xlim(0, 100)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=5)
    ax.set_title("workers' time by stage")
    if sweep_results:
        ax = axes[2]
        ws = [r.num_workers for r in sweep_results]
        ax.plot(ws, [1e3 * r.seconds_per_batch for r in sweep_results], "o-", label="ms per batch")
        step_ms = 1e3 * (sum(result.steps[1:]) / max(1, len(result.steps) - 1))
        ax.axhline(step_ms, color="gray", ls=":", label="step")
        if t is not None and t.suggested_workers:
            ax.axvline(t.suggested_workers, color="tab:red", ls="--",
                       label=f"suggested ({t.suggested_workers})")
        ax.set_xlabel("num_workers")
        ax.set_ylabel("ms per batch")
        ax.set_ylim(bottom=0)
        ax.set_title("sweep")
        ax.legend(fontsize=8)
    if t is not None:
        import textwrap

        fig.suptitle("\n".join(textwrap.wrap(t.verdict, 40 * panels + 40)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m shmloader.diagnose",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("dataset", help="module:name or path.py:name of a Dataset or a factory")
    ap.add_argument("--args", default=None, help="JSON object of keyword arguments for the factory")
    ap.add_argument("--batches", type=int, default=100, help="batches to time (default 100)")
    ap.add_argument("--step-ms", type=float, default=0.0, help="the training step (default 0)")
    ap.add_argument("--step-kind", choices=("sleep", "spin"), default="sleep",
                    help="sleep (a GPU step: the CPU stays free) or spin (a CPU step)")
    ap.add_argument("--workers", type=int, default=None,
                    help="num_workers (default: the machine's cores)")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--prefetch-factor", type=int, default=2)
    ap.add_argument("--shuffle", action="store_true")
    ap.add_argument("--collate", default=None, help="module:name of a collate_fn")
    ap.add_argument("--sweep", default=None, metavar="W1,W2,...",
                    help="also run these worker counts and compare")
    ap.add_argument("--plot", default=None, metavar="PNG", help="draw the diagnosis here")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the stats here")
    return ap


def main(argv: list[str] | None = None) -> int:
    import warnings

    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    if args.batches < 2:
        raise SystemExit(f"--batches must be >= 2, got {args.batches}")
    dataset = load_dataset(args.dataset, json.loads(args.args) if args.args else None)
    from .timing import available_cores

    workers = args.workers or max(1, math.floor(available_cores()))
    kwargs = dict(batches=args.batches, step_s=args.step_ms / 1e3, step_kind=args.step_kind,
                  batch_size=args.batch_size, prefetch_factor=args.prefetch_factor,
                  shuffle=args.shuffle)
    if args.collate:
        where, name = args.collate.rsplit(":", 1)
        kwargs["collate_fn"] = getattr(importlib.import_module(where), name)
    result = run(dataset, num_workers=workers, **kwargs)
    print(f"{args.batches} batches, {workers} workers, batch_size {args.batch_size}, "
          f"{args.step_ms:g} ms {args.step_kind} step: {1e3 * result.seconds_per_batch:.2f} ms "
          "per batch\n")
    print(result.stats)
    swept = None
    if args.sweep:
        swept = sweep(dataset, _ints(args.sweep), **kwargs)
        print()
        print(sweep_table(swept))
    if args.json:
        doc = {"stats": result.stats.as_dict(),
               "waits_s": result.waits, "steps_s": result.steps,
               "seconds_per_batch": result.seconds_per_batch}
        if swept:
            doc["sweep"] = [{"num_workers": r.num_workers, "seconds_per_batch": r.seconds_per_batch,
                             "wait_fraction": r.wait_fraction} for r in swept]
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot and plot(result, args.plot, swept):
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
