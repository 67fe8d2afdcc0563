"""The targets across saved runs: is a figure what every run gives, or one lucky run's?

``python -m bench --history bench/results/main*.json`` prints one row per target and point and
one column per run (the file, its commit and its CPU above), each cell the ratio's median over
that run's repeats and whether it met the limit there, and at the end in how many runs it did.
Everything comes from the JSON documents; nothing is run.
"""

from __future__ import annotations

import os

from . import stats, targets


def _label(path: str, doc: dict) -> tuple[str, str, str]:
    m = doc.get("machine", {})
    name = os.path.splitext(os.path.basename(path))[0]
    return name, str(m.get("git_commit", "?"))[:7], str(m.get("cpu", "?"))


def history_table(runs: list[tuple[str, dict]]) -> str:
    """The matrix described above, for ``runs`` = [(path, document)], in the order given."""
    cols = [_label(path, doc) for path, doc in runs]
    rows: dict[tuple, list[str]] = {}
    met_in: dict[tuple, list[bool]] = {}
    for i, (_path, doc) in enumerate(runs):
        for c in targets.check(doc):
            key = (c["issue"], c["point"], f"{c['ratio']} {c['op']} {c['limit']:.2f}")
            median = stats.median(c["ratios"])
            # 1.152 is not 1.15: as many digits as it takes to show which side of the limit
            digits = 2 if f"{median:.2f}" != f"{c['limit']:.2f}" or median == c["limit"] else 3
            rows.setdefault(key, [""] * len(runs))[i] = f"{median:.{digits}f} {'met' if c['met'] else 'MISSED'}"
            met_in.setdefault(key, []).append(c["met"])
    if not rows:
        return "no target was measured in these runs\n"
    header = ["issue", "point", "ratio and limit", *(f"{n} {commit}" for n, commit, _ in cols), "met in"]
    cpus = ["", "", "cpu", *(cpu for _, _, cpu in cols), ""]
    body = [[str(k[0]), k[1], k[2], *cells, f"{sum(met_in[k])} of {len(met_in[k])} runs"]
            for k, cells in rows.items()]
    widths = [max(len(r[j]) for r in [header, cpus, *body]) for j in range(len(header))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()

    return "\n".join(line(r) for r in [header, cpus, *body]) + "\n"
