"""``python -m bench``: how much faster is shmloader than what I have, and is my loader the
bottleneck?

With no flags it runs the project's main job: seed001 (the forum experiment, large items) at 0, 2,
4, 6 and 8 workers through torch as posted, torch with default_collate, shmloader with both collates
and SPDL's shared-memory arena (posted collate; where spdl is installed), three repeats each, and
prints seconds per batch (median [min-max]) side by side with the work bound. Other workloads::

    python -m bench --workload transport --sizes 1M,64M,256M --repeats 3
    python -m bench --workload all           # every workload at its defaults (the longest run)
    python -m bench -w epochs                # the epoch boundary: first wait of each epoch
    python -m bench -w rows --workers 8      # sample-parallel: TTFB, steady, memory, bound
    python -m bench --quick                  # CI: a little of everything, under a minute
    python -m bench -w transport --sizes 1M --consumers touch \
        --transports shmloader,shmloader-untimed --repeats 7   # what stats().timing costs

Transports run interleaved (A B C A B C ...) within each point, so drift hits all alike.
Writes ``<out>/<name>.json`` and ``<out>/<name>-*.png`` (default ``bench/results/``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
import warnings

from . import report, stats
from .measure import MemWatch, run_once, seed_costs, wait_quiet
from .transports import all_transports, cores, shmloader_status, skip_reason
from .workloads import (
    DEFAULT_SIZES,
    EXTRA_WORKLOADS,
    MODE_WORKLOADS,
    PACED_SIZES,
    WORKLOADS,
    MiB,
    epochs_points,
    paced_points,
    parse_size,
    rows_points,
    seed001_points,
    small_points,
    transport_points,
    vision_points,
)

HERE = os.path.dirname(os.path.abspath(__file__))
SEED_TRANSPORTS = ("torch-pickle", "torch-shm", "shmloader-np", "shmloader", "spdl-arena",
                   "work-only")
SEED_ONLY = ("shmloader-np", "work-only")  # left out of the other workloads unless named
OTHER_TRANSPORTS = ("torch-pickle", "torch-shm", "torch-pickle-np", "shmloader",
                    "shmloader-np-stack", "spdl-arena", "memcpy", "memcpy-*")
# the mode workloads' transports (bench.transports; a mode's is skipped where not yet built)
MODE_TRANSPORTS = {
    "epochs": ("torch-shm", "shmloader", "shmloader-epoch-prefetch", "shmloader-rows-epoch-prefetch"),
    "rows": ("torch-shm", "shmloader", "shmloader-rows", "work-only"),
}
MODE_ONLY = ("shmloader-epoch-prefetch", "shmloader-rows", "shmloader-rows-epoch-prefetch")
# paced: the main process's CPU while it waits, for the loaders that deliver without pickling
PACED_TRANSPORTS = ("torch-shm", "shmloader", "shmloader-np-stack", "spdl-arena")
EPOCHS_WORKERS = 4  # 4 x 32 samples x 3 ms: the workers keep ahead of the 0.05 s step
ROWS_WORKERS = 8
MAIN_REPEATS = 3  # runs per cell (main job too): median [min-max] of three interleaved runs


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    ap.add_argument("--workload", "-w", default=None,
                    help=f"comma list of {', '.join(WORKLOADS + EXTRA_WORKLOADS + MODE_WORKLOADS)}, or 'all' "
                         "(default: the main job, seed001 large items; --quick alone runs "
                         f"{', '.join(WORKLOADS)})")
    ap.add_argument("--sizes", default=None,
                    help="transport batch sizes, e.g. 1M,16M,64M,256M (the default)")
    ap.add_argument("--workers", default=None,
                    help="num_workers list (default: seed001 0,2,4,6,8; "
                         f"epochs {EPOCHS_WORKERS}; rows {ROWS_WORKERS}; --quick 2; "
                         "others: the machine's cores)")
    ap.add_argument("--items", default=None, help="seed001 items: large,small (default both; "
                    "main job large)")
    ap.add_argument("--consumers", default="touch,read",
                    help="transport/vision consumers: touch (one element per leaf), read (every "
                         "byte) (default both)")
    ap.add_argument("--transports", default=None,
                    help="comma list of torch-pickle, torch-shm, torch-pickle-np, shmloader, "
                         "shmloader-np, shmloader-np-stack, spdl-arena, work-only (seed001, rows), memcpy, "
                         "memcpy-Nc (default: all that apply), and shmloader-untimed (shmloader with "
                         "SHMLOADER_TIMING=0: the cost of stats().timing, only when named)")
    ap.add_argument("--repeats", type=int, default=None,
                    help=f"runs per transport and point (default {MAIN_REPEATS}; --quick 1)")
    ap.add_argument("--batches", type=int, default=None,
                    help="timed batches per run (override; not for epochs: 3 x 20 batches)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed batches first (override; not for epochs)")
    ap.add_argument("--quick", action="store_true",
                    help="a little of every workload, one repeat: under a minute (CI)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="output folder")
    ap.add_argument("--name", default=None, help="file prefix (default: main, quick, the workloads named with -w joined "
                         "by '-', or 'bench' for -w all)")
    ap.add_argument("--no-plots", action="store_true", help="write no PNGs")
    ap.add_argument("--no-mem", action="store_true", help="do not sample memory")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                    help="before each run, wait up to SECONDS for other processes to go idle "
                         "(for shared machines; default 0: do not wait)")
    ap.add_argument("--replot", metavar="JSON", help="print and plot a saved result; run nothing")
    ap.add_argument("--history", metavar="JSON", nargs="+",
                    help="the targets measured in saved results, one column per file: met or "
                         "missed in each run; run nothing")
    return ap


def plan(args) -> tuple[str, list, list[str]]:
    """(name, points, transport names) for the parsed arguments."""
    main_job = args.workload is None and not args.quick
    if args.workload in (None, ""):
        wls = ["seed001"] if main_job else list(WORKLOADS)
    elif args.workload == "all":
        wls = list(WORKLOADS + EXTRA_WORKLOADS + MODE_WORKLOADS)
    else:
        wls = _names(args.workload)
        for w in wls:
            if w not in WORKLOADS + EXTRA_WORKLOADS + MODE_WORKLOADS:
                raise SystemExit(f"--workload: unknown workload {w!r} "
                                 f"(choose from {WORKLOADS + EXTRA_WORKLOADS + MODE_WORKLOADS})")
    consumers = _names(args.consumers)
    for c in consumers:
        if c not in ("touch", "read"):
            raise SystemExit(f"--consumers: must be touch or read, got {c!r}")
    ncores = cores()
    q = args.quick
    workers = _ints(args.workers) if args.workers else None
    points = []
    if "seed001" in wls:
        items = _names(args.items) if args.items else (["large"] if main_job or q else
                                                      ["large", "small"])
        sw = workers or ([2] if q else [0, 2, 4, 6, 8])
        points += seed001_points(items, sw, batches=4 if q else 16, warmup=2 if q else 5)
    w_other = workers or [ncores]
    if "transport" in wls:
        sizes = ([parse_size(s) for s in _names(args.sizes)] if args.sizes else
                 [1 * MiB, 16 * MiB] if q else list(DEFAULT_SIZES))
        points += transport_points(sizes, w_other, consumers, quick=q)
    if "paced" in wls:
        sizes = [parse_size(s) for s in _names(args.sizes)] if args.sizes else PACED_SIZES
        points += paced_points(sizes, w_other, quick=q)
    if "small" in wls:
        points += small_points(w_other, quick=q)
    if "vision" in wls:
        points += vision_points(w_other, ["touch"] if q else consumers, quick=q)
    if "rows" in wls:
        points += rows_points(workers or [2 if q else ROWS_WORKERS], quick=q,
                              batches=4 if q else 16, warmup=2 if q else 5)
    if args.batches or args.warmup is not None:
        import dataclasses

        points = [dataclasses.replace(p, batches=args.batches or p.batches,
                                      warmup=p.warmup if args.warmup is None else args.warmup)
                  for p in points]
    if "epochs" in wls:  # after the override: its batches are the epochs' (3 x 20)
        points += epochs_points(workers or [2 if q else EPOCHS_WORKERS], quick=q)
    known = all_transports()
    if args.transports:
        names = _names(args.transports)
        for n in names:
            if n not in known and not (n == "memcpy-*"):
                raise SystemExit(f"--transports: unknown {n!r} (choose from {', '.join(known)})")
    else:
        names = list(dict.fromkeys(SEED_TRANSPORTS + OTHER_TRANSPORTS + MODE_ONLY))
    names = [k for k in known if k in names or (k.startswith("memcpy-") and "memcpy-*" in names)]
    named = args.workload not in (None, "", "all")  # -w paced writes paced.json, and so on
    name = args.name or ("main" if main_job else "quick" if q else "-".join(wls) if named
                         else "bench")
    return name, points, names


def point_bound(p) -> float:
    """The work bound of a seed001 or rows point, its costs measured now (a fresh process)."""
    costs = seed_costs(p.label, cores())
    if p.workload == "rows":
        costs = rows_costs(costs, p.batch_size, p.params["step_s"])
    return stats.seed_work_bound(p.num_workers, copies=0 if p.num_workers == 0 else 1, **costs)


def rows_costs(costs: dict, batch_size: int, step_s: float) -> dict:
    """seed001's measured per-batch costs (128 items) for a ``rows`` batch of ``batch_size``
    items and its step: fetch, compute and copy scale with the items."""
    from .workloads import SEED_BATCH

    k = batch_size / SEED_BATCH
    return {**costs, "fetch_s": costs["fetch_s"] * k, "compute_s": costs["compute_s"] * k,
            "copy_s": costs["copy_s"] * k, "step_s": step_s}


def default_repeats(args) -> int:
    return args.repeats or (1 if args.quick else MAIN_REPEATS)


def transports_for(point, names: list[str], explicit: bool = False) -> list[str]:
    """seed001 compares the loaders of SEED_TRANSPORTS (no memcpy: the work bound and work-only
    are its references); the other workloads leave out SEED_ONLY unless asked for by name
    (shmloader-np's numpy collate there is the ``np.stack`` that shmloader-np-stack runs). The mode workloads
    (epochs, rows) run their MODE_TRANSPORTS only; their mode-only transports run nowhere else
    unless named."""
    if point.workload == "seed001":
        return [n for n in names if n in SEED_TRANSPORTS]
    if point.workload in MODE_TRANSPORTS:
        return [n for n in names if n in MODE_TRANSPORTS[point.workload]]
    if point.workload == "paced" and not explicit:
        return [n for n in names if n in PACED_TRANSPORTS]
    if explicit:
        return names
    return [n for n in names if n not in SEED_ONLY and n not in MODE_ONLY]


class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.t0 = total, 0, time.monotonic()
        self.enabled = enabled
        self.tty = sys.stderr.isatty()

    def show(self, what: str) -> None:
        if not self.enabled:
            return
        el = time.monotonic() - self.t0
        eta = el / self.done * (self.total - self.done) if self.done else 0
        w = 24
        fill = int(w * self.done / max(1, self.total))
        line = (f"[{'#' * fill}{'.' * (w - fill)}] {self.done}/{self.total} "
                f"{el:4.0f}s eta {eta:3.0f}s  {what}")
        if self.tty:
            sys.stderr.write("\r\033[K" + line[:150])
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def step(self, what: str) -> None:
        self.done += 1
        self.show(what)

    def end(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")


def run(args) -> dict:
    name, points, names = plan(args)
    repeats = default_repeats(args)
    ok, why = shmloader_status()
    known = all_transports()
    doc: dict = {
        "schema": report.SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m bench" + "".join(" " + shlex.quote(a) for a in sys.argv[1:]),
        "machine": report.machine_info(),
        "config": {"name": name, "repeats": repeats, "transports": names, "quick": args.quick},
        "points": [],
        "warnings": [] if ok else [f"shmloader not importable ({why}): its rows are skipped"],
    }
    seed_pts = [p for p in points if p.workload == "seed001"]
    rows_pts = [p for p in points if p.workload == "rows"]
    if seed_pts or rows_pts:
        costs = {it: seed_costs(it, cores())
                 for it in sorted({p.label for p in seed_pts + rows_pts})}
        by_point = {
            p.key: stats.seed_work_bound(p.num_workers, copies=0 if p.num_workers == 0 else 1,
                                         **costs[p.label])
            for p in seed_pts
        }
        for p in rows_pts:  # seed001's items map-style: the same work, per sample
            by_point[p.key] = stats.seed_work_bound(
                p.num_workers, copies=0 if p.num_workers == 0 else 1,
                **rows_costs(costs[p.label], p.batch_size, p.params["step_s"]))
        doc["work_bound"] = {
            "costs": costs,
            "by_point": by_point,
            # measured again before each repeat of a point, so each repeat's runs are set
            # against the machine as it was then (it moves by 50% between runs on a shared VM)
            "by_point_repeat": {p.key: [] for p in seed_pts + rows_pts},
            "rule": "no workers: fetch + compute + step; w workers: max(step, (fetch + compute + "
                    "copy) / w, (compute + copy) / min(w, cores)); rows: seed001's costs "
                    "scaled to its batch (items / 128), its own step",
        }
    steps = sum(repeats * len(transports_for(p, names, bool(args.transports))) for p in points)
    prog = Progress(steps, enabled=not args.no_progress)
    noisy: list[str] = []
    waited = 0.0
    with MemWatch(enabled=not args.no_mem) as watch:
        for p in points:
            pdoc = {
                "key": p.key, "workload": p.workload, "label": p.label,
                "batch_size": p.batch_size, "batch_bytes": p.batch_bytes,
                "num_workers": p.num_workers, "consumer": p.consumer, "warmup": p.warmup,
                "batches": p.batches, "params": p.params, "transports": {}, "ratios": {},
            }
            tnames = transports_for(p, names, bool(args.transports))
            dataset = p.dataset()  # one per point, made before any run: not in the memory figure
            for tn in tnames:
                pdoc["transports"][tn] = {"repeats": []}
                why_not = skip_reason(known[tn], p)
                if why_not:
                    pdoc["transports"][tn] = {"skipped": why_not}
            for r in range(repeats):
                if p.key in doc.get("work_bound", {}).get("by_point_repeat", {}):
                    doc["work_bound"]["by_point_repeat"][p.key].append(point_bound(p))
                for tn in tnames:  # interleaved: A B C A B C ...
                    tdoc = pdoc["transports"][tn]
                    prog.show(f"{p.key} {tn} #{r + 1}")
                    if "skipped" not in tdoc:
                        if args.wait_quiet > 0 and known[tn].is_loader:
                            waited += wait_quiet(args.wait_quiet, {os.getpid(), watch.pid})
                        try:
                            res = run_once(known[tn], p, watch, dataset)
                        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                            tdoc.setdefault("errors", []).append(f"{type(e).__name__}: {e}")
                            doc["warnings"].append(f"{p.key} {tn} run {r + 1}: {type(e).__name__}: {e}")
                        else:
                            res["repeat"] = r  # pairs this run with the others' run r
                            if "ring" in res:
                                tdoc["ring"] = res.pop("ring")
                            for k in ("killed_workers", "leaked_shm"):
                                if k in res:
                                    doc["warnings"].append(f"{p.key} {tn} run {r + 1}: {k} {res[k]}")
                            if res.get("foreign_cpu_s", 0) > 0.1 * res.get("wall_s", 0) + 0.05:
                                noisy.append(f"{p.key} {tn} #{r + 1} "
                                             f"({res['foreign_cpu_s']:.1f} CPU-s in {res['wall_s']:.1f} s)")
                            tdoc["repeats"].append(res)
                    prog.step(f"{p.key} {tn} #{r + 1}")
            for tn, tdoc in pdoc["transports"].items():
                if "skipped" not in tdoc and not tdoc["repeats"]:
                    pdoc["transports"][tn] = {"skipped": "; ".join(tdoc.get("errors", ["failed"]))}
            del dataset
            doc["points"].append(report.point_summary(pdoc))
    prog.end()
    if noisy:
        doc["warnings"].append(
            f"{len(noisy)} of {steps} runs shared the machine with other busy processes (their "
            f"figures are noisier): {'; '.join(noisy[:6])}{' ...' if len(noisy) > 6 else ''}")
    doc["noisy_runs"] = noisy
    doc["waited_for_quiet_s"] = round(waited, 1)
    return doc


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # seed001 runs 8 workers on small machines on purpose: torch's advice about that is noise here
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    if args.history:
        import json

        from . import history

        runs = []
        for path in args.history:
            with open(path) as f:
                doc = json.load(f)
            report.validate(doc)
            runs.append((path, doc))
        print(history.history_table(runs), end="")
        return 0
    if args.replot:
        import json

        with open(args.replot) as f:
            doc = json.load(f)
        report.validate(doc)
        print(report.format_report(doc), end="")
        if not args.no_plots:
            out = os.path.dirname(os.path.abspath(args.replot))
            prefix = os.path.splitext(os.path.basename(args.replot))[0]
            for path in report.plot(doc, out, prefix):
                print(f"wrote {path}")
        return 0
    doc = run(args)
    print(report.format_report(doc), end="")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{doc['config']['name']}.json")
    report.write_json(doc, path)
    print(f"wrote {path}")
    if not args.no_plots:
        for p in report.plot(doc, args.out, doc["config"]["name"]):
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
