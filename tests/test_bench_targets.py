"""bench/targets.py: the issues' targets judged from a run's figures, met or MISSED at the median."""

from __future__ import annotations

from bench import targets
from bench.transports import all_transports
from bench.workloads import EXTRA_WORKLOADS, MODE_WORKLOADS, WORKLOADS


def _point(key: str, workers: int, transports: dict[str, list[float]], metric="s_per_batch", **fields):
    workload, label = key.split("/")[:2]
    runs = {name: {"repeats": [{metric: v, "repeat": i} for i, v in enumerate(values)]}
            for name, values in transports.items()}
    return {"key": key, "workload": workload, "label": label, "num_workers": workers,
            "consumer": fields.pop("consumer", "step"), "batch_bytes": fields.pop("batch_bytes", 0),
            "transports": runs, **fields}


def _doc(*points, bounds=None):
    return {"points": list(points), "work_bound": {"by_point_repeat": bounds or {}}}


def test_every_target_names_transports_and_workloads_the_bench_has():
    known = set(all_transports()) | {targets.BOUND}
    for t in targets.TARGETS:
        assert set(t.over) <= known and set(t.under) <= known, t
        assert t.workload in WORKLOADS + MODE_WORKLOADS + EXTRA_WORKLOADS, t
        assert t.op in ("<=", ">="), t


def test_a_speedup_is_judged_at_its_median_and_counted_per_repeat():
    # torch as posted over shmloader: 5.7x, 3.75x, 5.5x -> median 5.5x: met, in 2 of 3 repeats
    doc = _doc(_point("seed001/large/w8/step", 8, {
        "torch-pickle": [0.40, 0.30, 0.44], "shmloader-np": [0.07, 0.08, 0.08]}))
    (line,) = [x for x in targets.target_lines(doc) if "torch-pickle" in x]
    assert "5.50 [3.75-5.71]" in line and "met" in line and "in 2 of 3 repeats" in line
    # the same with the posted run slower in every repeat than 5x: MISSED
    doc = _doc(_point("seed001/large/w8/step", 8, {
        "torch-pickle": [0.30, 0.30, 0.30], "shmloader-np": [0.07, 0.07, 0.07]}))
    (line,) = [x for x in targets.target_lines(doc) if "torch-pickle" in x]
    assert "MISSED" in line and "in 0 of 3 repeats" in line


def test_the_bound_pairs_each_repeat_with_its_own_and_takes_the_better_collate():
    key = "seed001/large/w6/step"
    doc = _doc(_point(key, 6, {"shmloader": [0.100, 0.090], "shmloader-np": [0.095, 0.099]}),
               bounds={key: [0.085, 0.080]})
    (c,) = [c for c in targets.check(doc) if c["point"] == key]
    assert c["ratios"] == [0.095 / 0.085, 0.090 / 0.080]  # the better collate of each repeat
    assert c["limit"] == 1.10 and not c["met"]  # 1.118 and 1.125


def test_a_target_this_run_did_not_measure_is_left_out():
    doc = _doc(_point("seed001/large/w8/step", 8, {"shmloader": [0.07]}))  # no torch, no bound
    assert targets.check(doc) == []
    assert targets.target_lines(_doc()) == []


def test_memory_and_mode_targets_read_their_own_metric():
    rows = _point("rows/large/w8/step", 8, {"torch-shm": [2.0e9, 1.0e9, 1.0e9],
                                            "shmloader-rows": [0.6e9, 0.6e9, 0.4e9]},
                  metric="peak_mem_bytes")
    (c,) = [c for c in targets.check(_doc(rows)) if "peak_mem_bytes" in c["ratio"]]
    assert c["ratios"] == [0.3, 0.6, 0.4] and c["limit"] == 0.5 and c["met"] is True
    epochs = _point("epochs/b32/w4/step", 4, {"shmloader-epoch-prefetch": [0.030, 0.010]},
                    metric="first_wait_e2_s")
    for i, steady in enumerate((0.020, 0.020)):
        epochs["transports"]["shmloader-epoch-prefetch"]["repeats"][i]["steady_wait_s"] = steady
    (c,) = [c for c in targets.check(_doc(epochs))]
    assert c["ratios"] == [1.5, 0.5] and c["met"] is True  # the median of two: their mean, 1.0


def test_the_history_shows_each_run_met_or_missed_and_counts_the_runs(tmp_path):
    from bench import history

    key = "seed001/large/w8/step"

    def run(shm, bound, commit, cpu):
        doc = _doc(_point(key, 8, {"shmloader": shm}), bounds={key: bound})
        doc["machine"] = {"git_commit": commit, "cpu": cpu}
        return doc

    runs = [("r/main.json", run([0.070, 0.072, 0.074], [0.065] * 3, "aaaaaaa1", "Xeon")),
            ("r/main-b.json", run([0.0749, 0.0749, 0.0749], [0.065] * 3, "bbbbbbb2", "EPYC")),
            ("r/main-c.json", run([0.070], [0.070], "ccccccc3", "EPYC"))]
    text = history.history_table(runs)
    header, cpus, row = text.splitlines()
    assert "main aaaaaaa" in header and "main-b bbbbbbb" in header and "main-c ccccccc" in header
    assert "Xeon" in cpus and "EPYC" in cpus
    assert "1.11 met" in row  # 0.072 / 0.065, at the median
    assert "1.152 MISSED" in row  # rounds to the limit: a third digit shows the side
    assert "1.00 met" in row and row.endswith("2 of 3 runs")
    assert history.history_table([("r/x.json", _doc())]) == "no target was measured in these runs\n"
