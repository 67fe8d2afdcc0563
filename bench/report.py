"""What a run leaves behind: the terminal tables, the JSON document, the PNG plots.

The JSON document (``SCHEMA``) is the source of truth; the tables and the plots are drawn from it
alone, so ``python -m bench --replot FILE.json`` redraws them without measuring again.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
from collections.abc import Iterable

from . import stats
from .targets import target_lines
from .workloads import size_label

SCHEMA = "shmloader-bench/1"
LOADERS = ("torch-pickle", "torch-shm", "shmloader-np", "shmloader", "spdl-arena", "work-only")
REFERENCES = ("torch-shm", "torch-pickle", "torch-pickle-np", "spdl-arena", "memcpy")

# ---------------------------------------------------------------------------------------------
# the machine


def machine_info() -> dict:
    def first(path: str, key: str) -> str | None:
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith(key):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return None

    import numpy
    import torch

    from .transports import cores, shmloader_status

    try:
        st = os.statvfs("/dev/shm")
        shm_total = st.f_blocks * st.f_frsize
    except OSError:
        shm_total = None
    mem_kb = first("/proc/meminfo", "MemTotal")
    ok, ver = shmloader_status()
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        commit = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=5,
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "hostname": socket.gethostname(),
        "cpu": first("/proc/cpuinfo", "model name") or platform.processor(),
        "cores": cores(),
        "mem_bytes": int(mem_kb.split()[0]) * 1024 if mem_kb else None,
        "shm_bytes": shm_total,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "shmloader": ver if ok else None,
        "git_commit": commit,
    }


def machine_line(m: dict) -> str:
    gib = (m.get("mem_bytes") or 0) / (1 << 30)
    return (
        f"{m.get('cpu')}, {m.get('cores')} cores, {gib:.0f} GiB RAM "
        f"(host {m.get('hostname')}, Linux {m.get('kernel')}, Python {m.get('python')}, "
        f"torch {m.get('torch')}, shmloader {m.get('shmloader')})"
    )


# ---------------------------------------------------------------------------------------------
# the document


def point_summary(point_doc: dict) -> dict:
    """Fill in ``summary`` per transport and ``ratios`` for one point (in place; returns it)."""
    med = {}
    for name, tdoc in point_doc["transports"].items():
        tdoc["summary"] = stats.summarize_repeats(tdoc.get("repeats", []))
        s = tdoc["summary"].get("s_per_batch")
        med[name] = s["median"] if s else None
    point_doc["ratios"] = {
        t: r for t, r in stats.ratios(med, REFERENCES).items() if not t.startswith("memcpy")
    }
    return point_doc


_POINT_KEYS = {
    "key": str, "workload": str, "label": str, "batch_size": int, "batch_bytes": int,
    "num_workers": int, "consumer": str, "warmup": int, "batches": int, "transports": dict,
    "ratios": dict,
}


def validate(doc: dict) -> None:
    """Raise ``ValueError`` naming the first thing in ``doc`` that breaks the schema."""
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ValueError(f"bench result does not follow {SCHEMA}: {what}")

    need(isinstance(doc, dict), "top level is not an object")
    need(doc.get("schema") == SCHEMA, f"schema is {doc.get('schema')!r}")
    for k in ("created", "command", "machine", "config", "points"):
        need(k in doc, f"missing {k!r}")
    need(isinstance(doc["points"], list), "'points' is not a list")
    for i, p in enumerate(doc["points"]):
        for k, typ in _POINT_KEYS.items():
            need(isinstance(p.get(k), typ), f"points[{i}].{k} is {p.get(k)!r}, expected {typ.__name__}")
        for name, t in p["transports"].items():
            where = f"points[{i}].transports[{name!r}]"
            if "skipped" in t:
                need(isinstance(t["skipped"], str), f"{where}.skipped is not a string")
                continue
            need(isinstance(t.get("repeats"), list) and t["repeats"], f"{where}.repeats is empty")
            for j, r in enumerate(t["repeats"]):
                need(
                    isinstance(r.get("s_per_batch"), (int, float)) and r["s_per_batch"] > 0,
                    f"{where}.repeats[{j}].s_per_batch is {r.get('s_per_batch')!r}",
                )
            summ = t.get("summary", {})
            for m, s in summ.items():
                need(m in stats.METRICS, f"{where}.summary has unknown metric {m!r}")
                need(s["min"] <= s["median"] <= s["max"], f"{where}.summary[{m!r}] out of order")


def write_json(doc: dict, path: str) -> None:
    validate(doc)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# tables


def _fmt_s(s: dict | None, scale: float = 1.0, digits: int = 4) -> str:
    if not s:
        return "-"
    return f"{s['median'] * scale:.{digits}g}"


def _fmt_range(s: dict | None, scale: float = 1.0) -> str:
    if not s or s.get("n", 1) < 2:
        return ""
    return f"[{s['min'] * scale:.3g}-{s['max'] * scale:.3g}]"


def fmt_bytes(n: float | None) -> str:
    if not n:
        return "0"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{n:.0f} B"


def _fmt_ratio(x: float | None, pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.0f}%" if pct else f"{x:.2f}x"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).rjust(w) if j else str(c).ljust(w) for j, (c, w) in
                       enumerate(zip(r, widths))) for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def point_table(points: Iterable[dict]) -> str:
    """One row per (point, transport): medians [min-max], and the ratios to the references (a
    reference's column only where some point ran it)."""
    points = list(points)
    refs = [r for r in REFERENCES if any(r in p["transports"] for p in points)]
    header = ["point", "transport", "s/batch", "[min-max]", "GB/s", "CPU ms/b", "TTFB s",
              "mem MiB", "ring", *[("of " if r == "memcpy" else "vs ") + r for r in refs]]
    rows = []
    for p in points:
        name = f"{p['label']} w{p['num_workers']} {p['consumer']}"
        for tname, t in p["transports"].items():
            if "skipped" in t:
                rows.append([name, tname, "skipped", t["skipped"][:40], *[""] * (len(header) - 4)])
                name = ""
                continue
            s = t["summary"]
            r = p["ratios"].get(tname, {})
            ring = t.get("ring") or {}
            rb = ring.get("max_ring_bytes") or ring.get("ring_bytes")
            rows.append([
                name, tname,
                _fmt_s(s.get("s_per_batch")), _fmt_range(s.get("s_per_batch")),
                _fmt_s(s.get("gbps"), digits=3),
                _fmt_s(s.get("main_cpu_s_per_batch"), 1e3, 3),
                _fmt_s(s.get("ttfb_s"), digits=3),
                _fmt_s(s.get("peak_mem_bytes"), 1 / (1 << 20), 4),
                f"{fmt_bytes(rb)} ({ring.get('ring_slots')}x)" if rb else "",
                *[_fmt_ratio(r.get(ref), pct=ref == "memcpy") if ref != tname else ""
                  for ref in refs],
            ])
            name = ""
    return _table(rows, header)


SEED_TITLES = {
    "torch-pickle": "torch posted", "torch-shm": "torch default_collate",
    "shmloader-np": "shmloader posted", "shmloader": "shmloader default_collate",
    "spdl-arena": "SPDL arena posted",
    "work-only": "work only",
}

# (title, numerators, denominators): per repeat, the smallest s/batch among the numerators over
# the smallest among the denominators ("bound": the work bound)
SEED_RATIOS = (
    ("shmloader vs torch posted", ("torch-pickle",), ("shmloader-np",)),
    ("vs torch default_collate", ("torch-shm",), ("shmloader",)),
    ("shmloader / work bound", ("shmloader", "shmloader-np"), ("bound",)),
    ("shmloader vs SPDL arena", ("spdl-arena",), ("shmloader-np",)),
    ("shmloader / work only", ("shmloader", "shmloader-np"), ("work-only",)),
    ("work only / work bound", ("work-only",), ("bound",)),
)


def _cell(values: list[float], fmt: str, unit: str = "") -> str:
    """``median [min-max]`` of ``values`` (just the median for one)."""
    s = stats.summarize(values)
    if s is None:
        return "-"
    out = f"{s['median']:{fmt}}{unit}"
    if s["n"] > 1:
        out += f" [{s['min']:{fmt}}-{s['max']:{fmt}}]"
    return out


def seed_table(doc: dict, items: str = "large") -> str:
    """seed001 side by side: s/batch per num_workers for each transport and the work bound, then
    the ratios, each as median [min-max] over the repeats."""
    pts = [p for p in doc["points"] if p["workload"] == "seed001" and p["label"] == items]
    if not pts:
        return ""
    pts.sort(key=lambda p: p["num_workers"])
    bounds = doc.get("work_bound", {}).get("by_point", {})
    cols = [t for t in LOADERS if any(t in p["transports"] for p in pts)]
    repeat_bounds = doc.get("work_bound", {}).get("by_point_repeat", {})
    rows, ratio_rows, skipped = [], [], {}
    for p in pts:
        runs = {c: stats.per_repeat(p["transports"].get(c, {}).get("repeats", [])) for c in cols}
        for c in cols:
            why = p["transports"].get(c, {}).get("skipped")
            if why:
                skipped.setdefault((c, why), []).append(str(p["num_workers"]))
        bound = bounds.get(p["key"])
        per_repeat = repeat_bounds.get(p["key"])
        rows.append([str(p["num_workers"]),
                     *[_cell(list(runs[c].values()), ".3f") for c in cols],
                     _cell(per_repeat, ".3f") if per_repeat else f"{bound:.3f}" if bound else "-"])
        if per_repeat:
            runs["bound"] = dict(enumerate(per_repeat))  # repeat r's, measured just before it
        elif bound:
            runs["bound"] = {k: bound for k in stats.best_per_repeat(
                *(runs.get(c, {}) for c in ("shmloader", "shmloader-np")))}
        cells = []
        for _, num, den in SEED_RATIOS:
            a = stats.best_per_repeat(*(runs.get(c, {}) for c in num))
            b = stats.best_per_repeat(*(runs.get(c, {}) for c in den))
            cells.append(_cell(stats.paired_ratios(a, b), ".2f", "x"))
        ratio_rows.append([str(p["num_workers"]), *cells])
    n = doc["config"].get("repeats", 1)
    title = (f"seed001 ({items} items, batch 128, 0.05 s step): seconds per batch, "
             f"median [min-max] of {n} run(s)")
    out = [title, _table(rows, ["workers", *[SEED_TITLES.get(c, c) for c in cols],
                                "work bound"])]
    for (c, why), ws in skipped.items():
        out.append(f"  {SEED_TITLES.get(c, c)} skipped at {', '.join(ws)} workers: {why}")
    keep = [i for i, (_, num, den) in enumerate(SEED_RATIOS)
            if any(c in cols for c in num if c != "bound") and any(c in cols or c == "bound"
                                                                   for c in den)]
    out += ["", f"seed001 ({items} items): ratios of s/batch, median [min-max] over the repeats, "
            "each repeat's runs paired (they ran back to back)",
            "('a vs b' = a's s/batch / b's: >1x = shmloader faster; posted = the posted "
            "collate_fn; the bound: the better of shmloader's two collates / the work bound;",
            " work only: the work in the same workers with no transport, bench/work_only.py)",
            _table([[r[0], *[r[1 + i] for i in keep]] for r in ratio_rows],
                   ["workers", *[SEED_RATIOS[i][0] for i in keep]])]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# the mode workloads: epochs, rows


def _per_repeat_ratio(a: dict[int, float], b: dict[int, float]) -> str:
    return _cell(stats.paired_ratios(a, b), ".2f", "x")


def _skipped_lines(p: dict) -> list[str]:
    return [f"  {tn} skipped: {t['skipped']}" for tn, t in p["transports"].items()
            if "skipped" in t]


def epochs_table(doc: dict) -> str:
    """Per epochs point: per transport the first waits of epochs 1, 2, 3, the steady wait, the
    total, and each boundary's first wait over the steady wait, median [min-max] over repeats."""
    out = []
    n = doc["config"].get("repeats", 1)
    for p in [p for p in doc["points"] if p["workload"] == "epochs"]:
        prm = p.get("params", {})
        shape = "x".join(str(d) for d in prm.get("shape", ()))
        out.append(
            f"epochs (map-style, {shape} float32 samples after {1e3 * prm.get('fetch_s', 0):g} ms, "
            f"batch {p['batch_size']}, {p['num_workers']} workers, persistent, shuffled; "
            f"{prm.get('epochs')} epochs x {prm.get('epoch_batches')} batches, "
            f"{prm.get('step_s')} s step): median [min-max] of {n} run(s)")
        rows = []
        for tn, t in p["transports"].items():
            if "skipped" in t:
                continue
            reps = t["repeats"]

            def col(m: str, scale: float = 1e3, fmt: str = ".1f", reps=reps) -> str:
                return _cell([v * scale for v in stats.per_repeat(reps, m).values()], fmt)

            steady = stats.per_repeat(reps, "steady_wait_s")
            rows.append([
                tn, col("first_wait_e1_s"), col("first_wait_e2_s"), col("first_wait_e3_s"),
                col("steady_wait_s", fmt=".2f"), col("total_s", 1.0, ".2f"),
                _per_repeat_ratio(stats.per_repeat(reps, "first_wait_e2_s"), steady),
                _per_repeat_ratio(stats.per_repeat(reps, "first_wait_e3_s"), steady),
            ])
        out.append(_table(rows, ["transport", "e1 first wait ms", "e2 first wait ms",
                                 "e3 first wait ms", "steady wait ms", "total s",
                                 "e2 first / steady", "e3 first / steady"]))
        out.append("  (first wait: iter() -> batch 0 of the epoch in hand; steady wait: median "
                   f"time in next() for batches {prm.get('steady_from')}.. of every epoch)")
        orders = {tn: {tuple(r.get("first_batch_sums", ())) for r in t["repeats"]}
                  for tn, t in p["transports"].items() if "skipped" not in t}
        ref = orders.get("torch-shm")
        if ref is not None:
            same = [tn for tn, o in orders.items() if tn != "torch-shm" and o == ref]
            differ = [tn for tn, o in orders.items() if tn != "torch-shm" and o != ref]
            if same:
                out.append(f"  same shuffled order as torch-shm in every epoch: {', '.join(same)}")
            if differ:
                out.append(f"  ORDER DIFFERS from torch-shm (first batch of an epoch): "
                           f"{', '.join(differ)}")
        out += _skipped_lines(p)
        out.append("")
    return "\n".join(out).rstrip()


def rows_table(doc: dict) -> str:
    """Per rows point: per transport time to first batch, steady s/batch, total, peak memory,
    and TTFB and memory over torch-shm's, steady s/batch over the work bound (paired per
    repeat), median [min-max]."""
    out = []
    n = doc["config"].get("repeats", 1)
    bounds = doc.get("work_bound", {}).get("by_point", {})
    repeat_bounds = doc.get("work_bound", {}).get("by_point_repeat", {})
    for p in [p for p in doc["points"] if p["workload"] == "rows"]:
        prm = p.get("params", {})
        shape = "x".join(str(d) for d in prm.get("shape", ()))
        bound = bounds.get(p["key"])
        per_repeat = repeat_bounds.get(p["key"])
        if per_repeat:
            said = f"work bound {_cell(per_repeat, '.3f')} s/batch, measured before each repeat"
        else:
            said = f"work bound {bound:.3f} s/batch" if bound else "no work bound"
        out.append(
            f"rows (seed001 map-style: {shape} float64 items, batch {p['batch_size']}, "
            f"default_collate, {p['num_workers']} workers, {prm.get('step_s')} s step, "
            f"{p['warmup']} + {p['batches']} batches): median [min-max] of {n} run(s); " + said)
        ref = p["transports"].get("torch-shm", {}).get("repeats", [])
        ref_ttfb = stats.per_repeat(ref, "first_batch_s")
        ref_mem = stats.per_repeat(ref, "peak_mem_bytes")
        rows, undersampled = [], []
        for tn, t in p["transports"].items():
            if "skipped" in t:
                continue
            reps = t["repeats"]
            ttfb = stats.per_repeat(reps, "first_batch_s")
            mem = stats.per_repeat(reps, "peak_mem_bytes")
            sb = stats.per_repeat(reps, "s_per_batch")
            shm = stats.per_repeat(reps, "peak_shm_bytes")
            if any(shm.get(k, 0) > v for k, v in mem.items()):
                undersampled.append(tn)
            rows.append([
                tn, _cell(list(ttfb.values()), ".3f"), _cell(list(sb.values()), ".3f"),
                _cell(list(stats.per_repeat(reps, "median_s_per_batch").values()), ".3f"),
                _cell(list(stats.per_repeat(reps, "total_s").values()), ".2f"),
                _cell([v / (1 << 20) for v in mem.values()], ".0f"),
                _cell([v / (1 << 20) for v in shm.values()], ".0f"),
                "" if tn in ("torch-shm", "work-only") else _per_repeat_ratio(ttfb, ref_ttfb),
                "" if tn in ("torch-shm", "work-only") else _per_repeat_ratio(mem, ref_mem),
                (_per_repeat_ratio(sb, dict(enumerate(per_repeat))) if per_repeat else
                 _per_repeat_ratio(sb, {k: bound for k in sb}) if bound else "-"),
            ])
        out.append(_table(rows, ["transport", "TTFB s", "steady s/batch", "median s/batch",
                                 "total s", "peak mem MiB", "peak shm MiB", "TTFB / torch-shm",
                                 "mem / torch-shm", "steady / bound"]))
        out.append(f"  (TTFB: iter() -> first batch; steady: wall time of the {p['batches']} "
                   f"batches after the first {p['warmup']} over their number, step included, as "
                   "seed001 is timed; median: of those batches' own times (bursty: not a "
                   "throughput); total: iter() -> end of the last step; peak mem: PSS of main + "
                   "workers + /dev/shm above the start, shm: /dev/shm alone; x / y < 1: x is "
                   "lower; work-only: the work in the workers with no transport, its batches "
                   "whole per worker, bench/work_only.py)")
        ns = [r.get("pss_samples") for t in p["transports"].values()
              for r in t.get("repeats", []) if r.get("pss_samples")]
        if ns:
            out.append(f"  bench.memwatch took {min(ns)}-{max(ns)} PSS samples per run (one every "
                       "20x the time a sample takes: smaps_rollup of processes mapping GBs is "
                       "slow; nice 19); every 5 ms between them: /dev/shm, and the last PSS plus "
                       "the anonymous memory (statm) each process gained since")
        if undersampled:
            out.append(f"  peak mem below peak shm for {', '.join(undersampled)}: PSS was not "
                       "sampled at that peak; their peak mem is a lower bound")
        out += _skipped_lines(p)
        out.append("")
    return "\n".join(out).rstrip()


def format_report(doc: dict) -> str:
    out = [f"machine: {machine_line(doc['machine'])}", f"command: {doc['command']}", ""]
    for items in ("large", "small"):
        t = seed_table(doc, items)
        if t:
            out += [t, ""]
    for table in (epochs_table, rows_table):
        t = table(doc)
        if t:
            out += [t, ""]
    wl_order = ("seed001", "transport", "paced", "small", "vision")
    for wl in wl_order:
        pts = [p for p in doc["points"] if p["workload"] == wl]
        if not pts:
            continue
        out.append(f"{wl}: medians over repeats; 'vs X' = X's s/batch / this one's "
                   f"(>1 = faster); 'of memcpy' = share of one-core memcpy bandwidth")
        out += [point_table(pts), ""]
    paced = paced_lines(doc)
    if paced:
        out += ["main-process CPU per batch with the loop waiting for every batch (paced), "
                "largest over smallest batch, median of the repeats:", *paced, ""]
    timing = timing_lines(doc)
    if timing:
        out += ["shmloader's stall diagnostics (stats().timing): s/batch on / off - 1, each "
                "repeat's two runs paired, median [min-max]:", *timing, ""]
    checked = target_lines(doc)
    if checked:
        out += ["the issues' targets that this run measured: each ratio per repeat (its runs paired), "
                "median [min-max]; met or MISSED at the median (bench/targets.py):", *checked, ""]
    rings = ring_lines(doc)
    if rings:
        out += ["shmloader ring (size /dev/shm for it):", *rings, ""]
    for w in doc.get("warnings", []):
        out.append(f"WARNING: {w}")
    return "\n".join(out).rstrip() + "\n"


def paced_lines(doc: dict) -> list[str]:
    """Per transport of the paced workload: main-process CPU per batch at the largest batch over
    that at the smallest (2x is the issue's ceiling)."""
    pts = sorted((p for p in doc["points"] if p["workload"] == "paced" and not p["params"].get("fresh")),
                 key=lambda p: p["batch_bytes"])
    if len(pts) < 2:
        return []
    small, large = point_summary(pts[0]), point_summary(pts[-1])

    def cpu(point, name):
        summary = (point["transports"].get(name) or {}).get("summary") or {}
        return (summary.get("main_cpu_s_per_batch") or {}).get("median")

    out = []
    for name in small["transports"]:
        a, b = cpu(small, name), cpu(large, name)
        if a and b:
            out.append(f"  {name}: {b * 1e3:.3f} ms at {pts[-1]['label']} / {a * 1e3:.3f} ms at "
                       f"{pts[0]['label']} = {b / a:.2f}x")
    return out


def timing_lines(doc: dict) -> list[str]:
    """Per point that ran both shmloader and shmloader-untimed: what the timing costs."""
    out = []
    for p in doc["points"]:
        on = stats.per_repeat(p["transports"].get("shmloader", {}).get("repeats", []))
        off = stats.per_repeat(p["transports"].get("shmloader-untimed", {}).get("repeats", []))
        if on and off:
            cost = [r - 1 for r in stats.paired_ratios(on, off)]
            out.append(f"  {p['key']}: {_cell([100 * c for c in cost], '+.2f', '%')} "
                       f"(on {_cell(list(on.values()), '.5f')} s, off "
                       f"{_cell(list(off.values()), '.5f')} s per batch, {len(cost)} pairs)")
    return out


def ring_lines(doc: dict) -> list[str]:
    out = []
    for p in doc["points"]:
        for tname, t in p["transports"].items():
            ring = t.get("ring") or {}
            if ring.get("ring_bytes"):
                line = (f"  {p['key']} {tname}: {ring['ring_slots']} slots x "
                        f"{fmt_bytes(ring['slot_bytes'])} = "
                        f"{fmt_bytes(ring.get('max_ring_bytes') or ring['ring_bytes'])}")
                if ring.get("max_ring_bytes") and ring["max_ring_bytes"] != ring["ring_bytes"]:
                    line += f" at most ({fmt_bytes(ring['ring_bytes'])} allocated by this run)"
                out.append(line)
    return out


# ---------------------------------------------------------------------------------------------
# plots

COLORS = {
    "torch-pickle": "tab:red", "torch-shm": "tab:orange", "shmloader": "tab:blue",
    "shmloader-np": "tab:cyan", "memcpy": "black", "torch-pickle-np": "tab:pink",
    "shmloader-np-stack": "tab:purple", "spdl-arena": "tab:green",
    "shmloader-untimed": "tab:gray", "work-only": "dimgray",
}


def _series(points: list[dict], metric: str, x_of) -> dict[str, list[tuple]]:
    out: dict[str, list[tuple]] = {}
    for p in points:
        for tname, t in p["transports"].items():
            s = t.get("summary", {}).get(metric)
            if s:
                out.setdefault(tname, []).append((x_of(p), s["median"], s["min"], s["max"]))
    return {k: sorted(v) for k, v in out.items()}


SEED_LABELS = {
    "torch-pickle": "torch, posted collate (pickle)",
    "torch-shm": "torch, default_collate (shm)",
    "shmloader-np": "shmloader, posted collate",
    "shmloader": "shmloader, default_collate",
    "spdl-arena": "SPDL arena, posted collate",
    "work-only": "work only (no transport)",
}


def _draw(ax, series: dict, scale: float = 1.0, labels: dict | None = None) -> None:
    for tname, pts in series.items():
        xs = [p[0] for p in pts]
        ys = [p[1] * scale for p in pts]
        err = [[(p[1] - p[2]) * scale for p in pts], [(p[3] - p[1]) * scale for p in pts]]
        style = "--" if tname.startswith("memcpy") or tname == "work-only" else "-"
        ax.errorbar(xs, ys, yerr=err, marker="o", ms=4, ls=style, capsize=3,
                    color=COLORS.get(tname, "gray" if tname.startswith("memcpy") else None),
                    label=(labels or {}).get(tname, tname))


def plot(doc: dict, outdir: str, prefix: str) -> list[str]:
    """Draw the PNGs this document has data for; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    machine = f"{doc['machine'].get('cpu')}, {doc['machine'].get('cores')} cores"
    tp = [p for p in doc["points"] if p["workload"] == "transport"]
    consumers = sorted({p["consumer"] for p in tp}, key=lambda c: (c != "touch", c))

    def size_axis(ax):
        ax.set_xscale("log", base=2)
        xs = sorted({p["batch_bytes"] for p in tp})
        ax.set_xticks(xs, [size_label(x) for x in xs])
        ax.set_xlabel("batch size")
        ax.grid(True, which="both", alpha=0.3)

    for metric, fname, ylabel, scale, logy in (
        ("gbps", "gbps", "GB/s delivered to the main process", 1.0, True),
        ("main_cpu_s_per_batch", "cpu", "main-process CPU per batch (ms)", 1e3, True),
    ):
        if not tp:
            break
        fig, axes = plt.subplots(1, len(consumers), figsize=(6 * len(consumers), 4.5), squeeze=False)
        for ax, c in zip(axes[0], consumers):
            pts = [p for p in tp if p["consumer"] == c]
            series = _series(pts, metric, lambda p: p["batch_bytes"])
            if metric != "gbps":
                series = {k: v for k, v in series.items() if not k.startswith("memcpy")}
            _draw(ax, series, scale)
            size_axis(ax)
            if logy:
                ax.set_yscale("log")
            ax.set_ylabel(ylabel)
            ax.set_title(f"transport, consumer={c}, {pts[0]['num_workers']} workers")
            ax.legend(fontsize=8)
        fig.suptitle(machine, fontsize=9)
        fig.tight_layout()
        path = os.path.join(outdir, f"{prefix}-{fname}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)

    sp = [p for p in doc["points"] if p["workload"] == "seed001"]
    items = sorted({p["label"] for p in sp})
    if sp:
        bounds = dict(doc.get("work_bound", {}).get("by_point", {}))
        for key, per_repeat in doc.get("work_bound", {}).get("by_point_repeat", {}).items():
            if per_repeat:  # measured before each repeat: their median
                bounds[key] = stats.median(per_repeat)
        fig, axes = plt.subplots(1, len(items), figsize=(6.5 * len(items), 4.5), squeeze=False)
        for ax, it in zip(axes[0], items):
            pts = [p for p in sp if p["label"] == it]
            series = _series(pts, "s_per_batch", lambda p: p["num_workers"])
            series = {k: v for k, v in series.items() if not k.startswith("memcpy")}
            _draw(ax, series, labels=SEED_LABELS)
            bx = sorted((p["num_workers"], bounds[p["key"]]) for p in pts if p["key"] in bounds)
            if bx:
                ax.plot([b[0] for b in bx], [b[1] for b in bx], "k:", marker="x",
                        label="work bound")
            ax.set_xlabel("num_workers")
            ax.set_ylabel("seconds per batch (0.05 s step included)")
            ax.set_title(f"seed001, {it} items, batch 128")
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(machine, fontsize=9)
        fig.tight_layout()
        path = os.path.join(outdir, f"{prefix}-seed001.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made
