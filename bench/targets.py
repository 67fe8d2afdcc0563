"""The issues' performance targets, checked against a run: met or missed, and in how many repeats.

Each target is a ratio of two transports' figures at the points it names, taken per repeat (the
runs of one repeat ran back to back, so drift hits both alike) and judged at its median over the
repeats, as the README reports it. A target whose transports or points this run did not measure
is left out: ``python -m bench`` (the main job) checks the seed001 ones, ``-w transport`` the
transport ones, and so on. The limits are the issues' own (issue 9: one copy whatever builds the
batch; issue 10: the modes); a run that misses one prints MISSED, with no rewording.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import stats

BOUND = "bound"  # stands for the work bound, measured before each repeat (seed001, rows)


@dataclass(frozen=True)
class Target:
    """``value(over) / value(under)`` of ``metric``, per repeat, must be ``op`` ``limit``.

    ``over`` and ``under`` are transport names; several on one side take, per repeat, the
    smallest value among them (the better of shmloader's two collates, say). Every metric here
    is lower-is-better, so a speed-up reads ``reference / shmloader >= x``."""

    issue: int
    workload: str
    points: Callable[[dict], bool]
    over: tuple[str, ...]
    under: tuple[str, ...]
    op: str  # "<=" | ">="
    limit: float
    metric: str = "s_per_batch"
    what: str = ""  # how the README words it

    def holds(self, ratio: float) -> bool:
        return ratio <= self.limit if self.op == "<=" else ratio >= self.limit


def _seed(workers: tuple[int, ...]) -> Callable[[dict], bool]:
    return lambda p: p["label"] == "large" and p["num_workers"] in workers


def _sized(mib: tuple[int, ...], consumers: tuple[str, ...] = ("touch", "read")) -> Callable[[dict], bool]:
    return lambda p: p["batch_bytes"] in [m << 20 for m in mib] and p["consumer"] in consumers


def _every(_p: dict) -> bool:
    return True


_SHM = ("shmloader", "shmloader-np-stack")  # the transport workload's two collates

TARGETS: tuple[Target, ...] = (
    # issue 9, the forum experiment (seed001, the main job)
    Target(9, "seed001", _seed((2, 4, 6)), ("shmloader", "shmloader-np"), (BOUND,), "<=", 1.10,
           what="within 1.1x of the work bound at 2, 4 and 6 workers"),
    Target(9, "seed001", _seed((8,)), ("shmloader", "shmloader-np"), (BOUND,), "<=", 1.15,
           what="within 1.15x of the work bound at 8 workers"),
    Target(9, "seed001", _seed((8,)), ("torch-pickle",), ("shmloader-np",), ">=", 5.0,
           what="at least 5x torch as posted at 8 workers"),
    Target(9, "seed001", _seed((8,)), ("torch-shm",), ("shmloader",), ">=", 1.4,
           what="at least 1.4x torch-shm at 8 workers"),
    *(Target(9, "seed001", _seed((8,)), (t,), ("torch-shm",), "<=", 1.0, "peak_mem_bytes",
             "peak memory no higher than torch-shm's at 8 workers") for t in ("shmloader", "shmloader-np")),
    # issue 9, transport
    *(Target(9, "transport", _sized((64, 256), ("touch",)), (ref,), (t,), ">=", limit,
             what=f"at 64 and 256 MiB, touching: at least {what}")
      for t in _SHM
      for ref, limit, what in (("memcpy", 0.7, "0.7x a one-core memcpy"), ("spdl-arena", 1.5, "1.5x SPDL"),
                               ("torch-shm", 3.0, "3x torch-shm"), ("torch-pickle", 15.0, "15x torch-pickle"))),
    *(Target(9, "transport", _sized((1,)), ("spdl-arena",), (t,), ">=", 1.2,
             what="at 1 MiB: at least 1.2x SPDL, both collates") for t in _SHM),
    *(Target(9, "transport", lambda p: p["consumer"] == "read", ("torch-shm",), (t,), ">=", 3.0,
             what="reading: at least 3x torch-shm") for t in _SHM),
    *(Target(9, "transport", _every, (t,), ("torch-shm",), "<=", 1.0, "peak_mem_bytes",
             "peak memory no higher than torch-shm's at every transport point") for t in _SHM),
    # issue 10, sample-parallel (rows)
    Target(10, "rows", _every, ("shmloader-rows",), ("torch-shm",), "<=", 0.25, "first_batch_s",
           "time to first batch at most 1/4 of torch-shm's"),
    Target(10, "rows", _every, ("shmloader-rows",), ("torch-shm",), "<=", 0.5, "peak_mem_bytes",
           "peak memory at most half of torch-shm's"),
    Target(10, "rows", _every, ("shmloader-rows",), (BOUND,), "<=", 1.15,
           what="steady state within 1.15x of the work bound"),
    # issue 10, epochs without a gap: a boundary's first wait no longer than a steady one
    *(Target(10, "epochs", _every, ("shmloader-epoch-prefetch",), ("shmloader-epoch-prefetch",), "<=", 1.0,
             f"first_wait_e{e}_s/steady_wait_s", f"epoch {e}'s first wait no longer than a steady wait")
      for e in (2, 3)),
    # ... and the same with both modes on (sample_parallel=True, prefetch_next_epoch=True)
    *(Target(10, "epochs", _every, ("shmloader-rows-epoch-prefetch",), ("shmloader-rows-epoch-prefetch",), "<=",
             1.0, f"first_wait_e{e}_s/steady_wait_s",
             f"epoch {e}'s first wait no longer than a steady wait, with sample_parallel=True too")
      for e in (2, 3)),
)


def _values(point: dict, doc: dict, names: tuple[str, ...], metric: str) -> dict[int, float]:
    """Per repeat, the smallest ``metric`` among ``names`` at ``point`` (BOUND: the work bound)."""
    sides = []
    for name in names:
        if name == BOUND:
            per_repeat = doc.get("work_bound", {}).get("by_point_repeat", {}).get(point["key"])
            if per_repeat:
                sides.append(dict(enumerate(per_repeat)))
            continue
        runs = point["transports"].get(name, {}).get("repeats", [])
        sides.append(stats.per_repeat(runs, metric))
    return stats.best_per_repeat(*sides) if sides else {}


def ratios(target: Target, point: dict, doc: dict) -> list[float]:
    """The target's ratio in each repeat of ``point`` that measured both sides."""
    if "/" in target.metric:  # one transport's two metrics, e.g. a first wait over the steady wait
        num, den = target.metric.split("/")
        return stats.paired_ratios(_values(point, doc, target.over, num),
                                   _values(point, doc, target.under, den))
    return stats.paired_ratios(_values(point, doc, target.over, target.metric),
                               _values(point, doc, target.under, target.metric))


def _paced_targets(doc: dict) -> list[tuple[str, list[float]]]:
    """Issue 9: main-process CPU per batch at 256 MiB no more than 2x that at 1 MiB, the loop
    waiting at both sizes (the paced workload), paired by repeat."""
    pts = {p["label"]: p for p in doc["points"] if p["workload"] == "paced"}
    small, large = pts.get("1MiB"), pts.get("256MiB")
    if small is None or large is None:
        return []
    out = []
    for t in _SHM:
        a = stats.per_repeat(large["transports"].get(t, {}).get("repeats", []), "main_cpu_s_per_batch")
        b = stats.per_repeat(small["transports"].get(t, {}).get("repeats", []), "main_cpu_s_per_batch")
        r = stats.paired_ratios(a, b)
        if r:
            out.append((t, r))
    return out


def _verdict(values: list[float], holds: Callable[[float], bool]) -> str:
    s = stats.summarize(values)
    cell = f"{s['median']:.2f}" + (f" [{s['min']:.2f}-{s['max']:.2f}]" if s["n"] > 1 else "")
    met = sum(holds(v) for v in values)
    verdict = "met" if holds(s["median"]) else "MISSED"
    return f"{cell:>20}  {verdict:<6} (in {met} of {len(values)} repeats)"


def check(doc: dict) -> list[dict]:
    """Every target this run measured: the issue, the workload, the point, what, the limit and
    the per-repeat ratios (for the JSON and the table)."""
    out = []
    for target in TARGETS:
        for p in doc["points"]:
            if p["workload"] != target.workload or not target.points(p):
                continue
            r = ratios(target, p, doc)
            if r:
                sides = ("/".join(target.over) if target.over == target.under
                         else f"{'/'.join(target.over)} / {'/'.join(target.under)}")
                metric = target.metric.replace("/", " / ")
                out.append({"issue": target.issue, "point": p["key"], "what": target.what,
                            "ratio": sides + ("" if metric == "s_per_batch" else f" ({metric})"),
                            "op": target.op, "limit": target.limit, "ratios": r,
                            "met": target.holds(stats.median(r))})
    for t, r in _paced_targets(doc):
        out.append({"issue": 9, "point": "paced/256MiB over 1MiB", "what":
                    "main-process CPU per batch at 256 MiB no more than 2x that at 1 MiB",
                    "ratio": f"{t} (main_cpu_s_per_batch)", "op": "<=", "limit": 2.0,
                    "ratios": r, "met": stats.median(r) <= 2.0})
    return out


def target_lines(doc: dict) -> list[str]:
    """The targets this run measured, one line each: the point, the ratio and its limit, the
    median [min-max] over the repeats, met or MISSED at the median, and in how many repeats."""
    lines = []
    for c in check(doc):
        limit = c["limit"]

        def holds(v, op=c["op"], limit=limit):
            return v <= limit if op == "<=" else v >= limit

        rule = f"{c['ratio']} {c['op']} {limit:.2f}"
        lines.append(f"  issue {c['issue']:<2} {c['point']:<28} {rule:<58}{_verdict(c['ratios'], holds)}")
    return lines
