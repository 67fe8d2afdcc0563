"""The benchmark harness's own logic: workload shapes, the arithmetic, the JSON schema, the CLI.

Runs on 2 cores without a GPU in little memory; ``--quick`` end to end is the last test.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from bench import __main__ as cli
from bench import report, stats
from bench.measure import (
    MemWatch,
    leaves,
    other_cpu,
    other_cpu_seconds,
    ours,
    read_all,
    shm_entries,
    touch,
)
from bench.transports import (
    all_transports,
    close_loader,
    make_loader,
    ring_info,
    skip_reason,
    time_memcpy,
)
from bench.workloads import (
    MiB,
    np_stack_collate,
    parse_size,
    seed001_points,
    size_label,
    small_points,
    transport_points,
    vision_points,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _nbytes(batch) -> int:
    return sum(x.nbytes if isinstance(x, np.ndarray) else x.numel() * x.element_size()
               for x in leaves(batch))


# ---------------------------------------------------------------------------------------------
# workloads


@pytest.mark.timeout(30)
def test_seed001_items_are_as_posted():
    (large,) = seed001_points(["large"], [2])
    (small,) = seed001_points(["small"], [0])
    assert large.batch_size == 128 and large.consumer == "step"
    assert large.batch_bytes == 128 * 1000 * 150 * 8  # 153.6 MB, the "~150 MB" of DESIGN.md
    assert small.batch_bytes == 128 * 10 * 150 * 8
    assert large.loader_kwargs() == {
        "batch_size": 128, "num_workers": 2, "prefetch_factor": 4, "persistent_workers": True
    }
    assert small.loader_kwargs() == {"batch_size": 128, "num_workers": 0}
    item = next(iter(small.dataset()))
    assert item.shape == (10, 150) and item.dtype == np.float64
    recs = [item] * 3
    assert small.collate("numpy")(recs) is recs  # the posted collate_fn returns the records


@pytest.mark.timeout(30)
@pytest.mark.parametrize("make", [
    lambda: transport_points([1 * MiB, 64 * 1024], consumers=["touch"]),
    lambda: small_points(),
    lambda: vision_points(consumers=["read"]),
])
def test_batch_bytes_match_what_the_collates_make(make):
    for p in make():
        ds = p.dataset()
        assert len(ds) == (p.warmup + max(p.batches, p.max_batches)) * p.batch_size
        samples = [ds[i] for i in range(p.batch_size)]
        for kind in ("numpy", "default", "np-stack"):
            batch = p.collate(kind)(samples)
            assert _nbytes(batch) == p.batch_bytes, (p.key, kind)


@pytest.mark.timeout(60)
def test_a_run_times_its_window_for_every_transport():
    """A fast transport's run goes on past the point's minimum of batches until it has timed
    `window_s`; a point without a window times its batches exactly."""
    import dataclasses

    from bench.measure import run_loader

    (p,) = transport_points([64 * 1024], consumers=["touch"], quick=True)
    assert p.window_s == 0 and transport_points([64 * 1024], consumers=["touch"])[0].window_s >= 1
    windowed = dataclasses.replace(p, batches=4, window_s=0.5, max_batches=100000)
    t = all_transports()["torch-pickle"]
    with MemWatch(enabled=False) as watch:
        exact = run_loader(t, dataclasses.replace(p, batches=4), watch)
        timed = run_loader(t, windowed, watch)
    assert exact["batches_timed"] == 4
    assert timed["batches_timed"] > 4
    assert timed["batches_timed"] * timed["s_per_batch"] >= 0.5


@pytest.mark.timeout(30)
def test_vision_batches_keep_their_structure():
    (p,) = vision_points(consumers=["touch"])
    ds = p.dataset()
    samples = [ds[i] for i in range(4)]
    assert samples[1]["image"].shape == (3, 224, 224) and samples[1]["image"].dtype == np.uint8
    b = p.collate("default")(samples)
    assert b["image"].dtype == torch.uint8 and b["image"].shape == (4, 3, 224, 224)
    assert b["label"].tolist() == [0, 1, 2, 3] and b["name"][2] == "img_00000002.jpg"
    n = p.collate("numpy")(samples)
    assert isinstance(n["image"], np.ndarray) and n["label"].dtype == np.int64
    s = p.collate("np-stack")(samples)  # np.stack per key, as users write it
    assert s["image"].shape == (4, 3, 224, 224) and s["label"].dtype == np.int64
    assert s["name"].dtype.kind == "U" and s["name"][2] == "img_00000002.jpg"
    assert touch(s) == touch(b) and read_all(s) == read_all(b)  # names are read in neither


@pytest.mark.timeout(30)
def test_np_stack_collate_is_one_function_for_every_workload():
    pts = [transport_points([MiB])[0], small_points()[0], vision_points()[0]]
    assert {p.collate("np-stack") for p in pts} == {np_stack_collate}
    (seed,) = seed001_points(["small"], [2])
    t = all_transports()
    assert t["torch-pickle-np"].collate_for(pts[0]) == t["shmloader-np-stack"].collate_for(
        pts[0]) == "np-stack"
    assert t["spdl-arena"].collate_for(pts[2]) == "np-stack"
    assert t["spdl-arena"].collate_for(seed) == "numpy"  # the posted collate_fn


@pytest.mark.timeout(30)
def test_timed_batches_drain_the_prefetch():
    for p in transport_points([1 * MiB, 256 * MiB], workers=[2, 4]) + vision_points([2]):
        assert p.warmup > p.prefetched + 2  # past start-up and past every ring slot's creation
        assert p.batches >= 8
    big = transport_points([256 * MiB], consumers=["touch"])[0]
    assert big.batches * big.batch_bytes <= 4 << 30  # keeps the 256 MiB runs short


@pytest.mark.timeout(30)
def test_sizes_parse_and_print():
    assert parse_size("64M") == parse_size("64MiB") == 64 * MiB
    assert parse_size("4k") == parse_size("4KiB") == 4096
    assert parse_size("1048576") == MiB
    assert size_label(256 * MiB) == "256MiB" and size_label(4096) == "4KiB"
    assert size_label(1000) == "1000B"
    with pytest.raises(ValueError):
        transport_points([100])


@pytest.mark.timeout(30)
def test_point_collate_kind_is_checked():
    (p,) = small_points()
    with pytest.raises(ValueError, match="collate kind"):
        p.collate("pickle")


@pytest.mark.timeout(30)
def test_spdl_is_skipped_without_workers_with_a_reason():
    t = all_transports()["spdl-arena"]
    (w0,) = seed001_points(["large"], [0])
    why = skip_reason(t, w0)
    assert why and ("no workers" in why or "spdl not importable" in why)
    assert skip_reason(all_transports()["torch-pickle"], w0) is None


# ---------------------------------------------------------------------------------------------
# arithmetic


@pytest.mark.timeout(10)
def test_median_and_summary():
    assert stats.median([3, 1, 2]) == 2
    assert stats.median([4, 1, 3, 2]) == 2.5
    assert stats.summarize([2.0, None, 1.0, 5.0]) == {"median": 2.0, "min": 1.0, "max": 5.0, "n": 3}
    assert stats.summarize([None, float("nan")]) is None
    with pytest.raises(ValueError):
        stats.median([])
    s = stats.summarize_repeats([{"s_per_batch": 1.0, "gbps": 2.0}, {"s_per_batch": 3.0}])
    assert s["s_per_batch"]["median"] == 2.0 and s["gbps"]["n"] == 1
    assert "ttfb_s" not in s


@pytest.mark.timeout(10)
def test_ratios_are_reference_over_this():
    med = {"torch-shm": 0.2, "torch-pickle": 1.0, "memcpy": 0.01, "shmloader": 0.05, "x": None}
    r = stats.ratios(med)
    assert r["shmloader"] == pytest.approx({"torch-shm": 4.0, "torch-pickle": 20.0, "memcpy": 0.2})
    assert "torch-shm" not in r["torch-shm"]  # no ratio to itself
    assert r["x"]["torch-shm"] is None
    assert stats.speedup(1.0, 0.0) is None and stats.gbps(1e9, 0.5) == 2.0


@pytest.mark.timeout(10)
def test_ratios_pair_the_repeats():
    torch_runs = [{"s_per_batch": 2.0, "repeat": 0}, {"s_per_batch": 4.0, "repeat": 2},
                  {"s_per_batch": 3.0, "repeat": 1}]
    shm_runs = [{"s_per_batch": 1.0, "repeat": 0}, {"s_per_batch": 2.0, "repeat": 2}]
    a, b = stats.per_repeat(torch_runs), stats.per_repeat(shm_runs)
    assert a == {0: 2.0, 1: 3.0, 2: 4.0}
    assert stats.paired_ratios(a, b) == [2.0, 2.0]  # repeat 1 failed for one side: left out
    assert stats.per_repeat([{"s_per_batch": 5.0}, {"s_per_batch": 6.0}]) == {0: 5.0, 1: 6.0}
    assert stats.best_per_repeat({0: 1.0, 1: 5.0}, {1: 3.0, 2: 7.0}) == {0: 1.0, 1: 3.0, 2: 7.0}


@pytest.mark.timeout(10)
def test_seed_work_bound():
    c = {"fetch_s": 0.4, "compute_s": 0.08, "copy_s": 0.02, "step_s": 0.05, "cores": 2}
    assert stats.seed_work_bound(0, copies=0, **c) == pytest.approx(0.4 + 0.08 + 0.05)
    assert stats.seed_work_bound(2, **c) == pytest.approx(0.5 / 2)  # workers' own latency
    assert stats.seed_work_bound(8, **c) == pytest.approx(0.5 / 8)
    many = dict(c, compute_s=0.5)
    assert stats.seed_work_bound(16, **many) == pytest.approx(0.52 / 2)  # the cores are the limit
    assert stats.seed_work_bound(100, **c) == pytest.approx(0.05)  # the train step is the limit


# ---------------------------------------------------------------------------------------------
# consumers and measurement pieces


@pytest.mark.timeout(10)
def test_consumers_read_what_is_there():
    a = np.arange(10, dtype=np.float32)
    batch = {"x": torch.from_numpy(a.copy()), "y": [a, "name"], "z": 3}
    assert len(list(leaves(batch))) == 2
    assert touch(batch) == 2 * (0 + 9)
    # arrays of str or objects are not leaves (default_collate leaves names a list of str)
    assert list(leaves({"n": np.array(["a", "b"]), "o": np.array([None])})) == []
    raw = np.frombuffer(a.tobytes(), np.uint8)
    expected = int(raw[:40].view(np.uint64).sum()) + 0  # 40 bytes = 5 words
    assert read_all({"x": a}) == expected
    odd = np.arange(11, dtype=np.uint8)
    assert read_all([odd]) == int(odd[:8].view(np.uint64)[0]) + 8 + 9 + 10


@pytest.mark.timeout(10)
def test_leak_check_only_blames_our_own_segments():
    # the machine may be shared: another user's torch segment is not our leak
    new = {"torch_123_4567_1", "torch_999_1_2", "psm_abc", "seg-123"}
    assert ours(new, {123}) == ["seg-123", "torch_123_4567_1"]
    assert ours(new, {12}) == []



@pytest.mark.timeout(30)
def test_other_processes_cpu_is_seen():
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<5: pass"])
    try:
        time.sleep(0.2)
        b = other_cpu({os.getpid()})
        time.sleep(0.5)
        assert other_cpu_seconds(b, other_cpu({os.getpid()})) >= 0.2
    finally:
        busy.kill()
        busy.wait()


@pytest.mark.timeout(30)
def test_memcpy_times_a_copy():
    s = time_memcpy(4 * MiB, 1, min_seconds=0.01)
    assert 0 < s < 1
    if len(os.sched_getaffinity(0)) > 1:
        assert 0 < time_memcpy(4 * MiB, 2, min_seconds=0.01) < 1


@pytest.mark.timeout(60)
def test_memwatch_sees_shared_memory():
    import mmap

    import posix_ipc

    with MemWatch() as w:
        w.start()
        seg = posix_ipc.SharedMemory(f"/bench-test-{os.getpid()}", posix_ipc.O_CREX, size=16 * MiB)
        try:
            m = mmap.mmap(seg.fd, seg.size)
            m.write(b"\1" * seg.size)  # fault every page in
            time.sleep(0.1)
            got = w.stop()
            m.close()
        finally:
            seg.close_fd()
            seg.unlink()
    assert got["peak_shm_bytes"] >= 15 * MiB
    assert got["peak_mem_bytes"] >= 15 * MiB
    assert got["max_procs"] >= 1


def _hold_anon(nbytes: int, seconds: float, ready) -> None:
    block = np.ones(nbytes, np.uint8)  # faulted in: resident anonymous memory
    ready.set()
    time.sleep(seconds)
    del block


@pytest.mark.timeout(60)
def test_memwatch_catches_a_peak_between_two_pss_samples():
    """PSS only at start and stop (30 s apart at most): a worker's 128 MiB held for 0.4 s in
    between is seen by the 5 ms RssAnon path alone; memory a forked child merely shares with
    its parent is not counted."""
    import multiprocessing

    inherited = np.ones(96 * MiB, np.uint8)  # the parent's: a forked child shares these pages
    context = multiprocessing.get_context("fork")
    with MemWatch(min_pss_interval=30) as w:
        w.start()
        ready = context.Event()
        idle = context.Process(target=time.sleep, args=(0.6,))
        idle.start()
        time.sleep(0.3)
        shared_only = w.stop()
        idle.join()
        w.start()
        child = context.Process(target=_hold_anon, args=(128 * MiB, 0.4, ready))
        child.start()
        assert ready.wait(20)
        child.join()
        got = w.stop()
    del inherited
    assert shared_only["peak_mem_bytes"] < 32 * MiB, shared_only
    assert got["pss_samples"] == 1 and got["fast_samples"] > 10, got
    assert got["peak_mem_bytes"] >= 120 * MiB, got


@pytest.mark.timeout(10)
def test_ring_info_reads_stats_and_sizes_the_full_ring():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Stats:
        ring_slots: int = 10
        slot_bytes: int = 1 << 20
        ring_bytes: int = 4 << 20  # only the slots created so far

    class Loader:
        def stats(self):
            return Stats()

    assert ring_info(Loader()) == {"ring_slots": 10, "slot_bytes": 1 << 20, "ring_bytes": 4 << 20,
                                   "max_ring_bytes": 10 << 20}
    assert ring_info(object()) is None


@pytest.mark.timeout(60)
def test_torch_transports_give_the_same_batches():
    (p,) = transport_points([64 * 1024], consumers=["touch"])
    t = all_transports()
    pickled = next(iter(make_loader(t["torch-pickle"], p)))
    shm = next(iter(make_loader(t["torch-shm"], p)))
    assert isinstance(pickled, np.ndarray) and isinstance(shm, torch.Tensor)
    assert np.array_equal(pickled, shm.numpy())
    stacked = next(iter(make_loader(t["torch-pickle-np"], p)))
    assert isinstance(stacked, np.ndarray) and np.array_equal(stacked, pickled)


@pytest.mark.timeout(60)
def test_shmloader_np_stack_gives_torch_pickle_nps_batches():
    pytest.importorskip("shmloader")
    (p,) = vision_points([2], consumers=["touch"])
    t = all_transports()
    ds = p.dataset()
    ref = next(iter(make_loader(t["torch-pickle-np"], p, ds)))
    loader = make_loader(t["shmloader-np-stack"], p, ds)
    it = iter(loader)
    try:
        got = next(it)
        assert got.keys() == ref.keys()
        for k in ref:
            assert isinstance(got[k], np.ndarray) and got[k].dtype == ref[k].dtype
            assert np.array_equal(got[k], ref[k]), k
        del got
    finally:
        close_loader(loader, it)


# ---------------------------------------------------------------------------------------------
# the document


def _fake_doc() -> dict:
    pts = []
    for size in (MiB, 64 * MiB):
        p = transport_points([size], consumers=["touch"])[0]
        pdoc = {
            "key": p.key, "workload": p.workload, "label": p.label, "batch_size": p.batch_size,
            "batch_bytes": p.batch_bytes, "num_workers": p.num_workers, "consumer": p.consumer,
            "warmup": p.warmup, "batches": p.batches, "params": p.params, "ratios": {},
            "transports": {
                name: {"repeats": [{"s_per_batch": s * k, "gbps": size / (s * k) / 1e9,
                                    "main_cpu_s_per_batch": 1e-4, "ttfb_s": 0.1,
                                    "peak_mem_bytes": 1 << 20, "peak_shm_bytes": 0}
                                   for k in (1.0, 1.1, 0.9)]}
                for name, s in (("torch-pickle", 1.0), ("torch-shm", 0.2), ("shmloader", 0.05),
                                ("memcpy", 0.01))
            },
        }
        pdoc["transports"]["shmloader-np"] = {"skipped": "not importable"}
        pdoc["transports"]["shmloader"]["ring"] = {"ring_slots": 6, "slot_bytes": size,
                                                   "ring_bytes": 6 * size}
        pts.append(report.point_summary(pdoc))
    (sp,) = seed001_points(["large"], [8])
    pts.append(report.point_summary({
        "key": sp.key, "workload": "seed001", "label": "large", "batch_size": 128,
        "batch_bytes": sp.batch_bytes, "num_workers": 8, "consumer": "step", "warmup": 5,
        "batches": 16, "params": sp.params, "ratios": {},
        "transports": {n: {"repeats": [{"s_per_batch": s}]} for n, s in
                       (("torch-pickle", 0.67), ("torch-shm", 0.18), ("shmloader-np", 0.07),
                        ("shmloader", 0.066))},
    }))
    return {
        "schema": report.SCHEMA, "created": "2024-01-01T00:00:00+00:00",
        "command": "python -m bench --test", "machine": {"cpu": "test cpu", "cores": 2},
        "config": {"repeats": 3, "name": "t"}, "points": pts, "warnings": [],
        "work_bound": {"by_point": {sp.key: 0.0625}},
    }


@pytest.mark.timeout(30)
def test_point_summary_medians_and_ratios():
    doc = _fake_doc()
    p = doc["points"][1]
    s = p["transports"]["shmloader"]["summary"]["s_per_batch"]
    assert s == {"median": 0.05, "min": pytest.approx(0.045), "max": pytest.approx(0.055), "n": 3}
    assert p["ratios"]["shmloader"]["torch-shm"] == pytest.approx(4.0)
    assert p["ratios"]["shmloader"]["torch-pickle"] == pytest.approx(20.0)
    assert p["ratios"]["shmloader"]["memcpy"] == pytest.approx(0.2)
    assert "memcpy" not in p["ratios"] and "shmloader-np" in p["ratios"]


@pytest.mark.timeout(30)
def test_schema_accepts_a_good_document_and_names_what_is_wrong():
    doc = _fake_doc()
    report.validate(json.loads(json.dumps(doc)))  # survives a JSON round trip
    bad = copy.deepcopy(doc)
    bad["schema"] = "other/9"
    with pytest.raises(ValueError, match="schema"):
        report.validate(bad)
    bad = copy.deepcopy(doc)
    del bad["points"][0]["batch_bytes"]
    with pytest.raises(ValueError, match=r"points\[0\]\.batch_bytes"):
        report.validate(bad)
    bad = copy.deepcopy(doc)
    bad["points"][1]["transports"]["torch-shm"]["repeats"][0]["s_per_batch"] = -1
    with pytest.raises(ValueError, match="s_per_batch"):
        report.validate(bad)
    bad = copy.deepcopy(doc)
    bad["points"][0]["transports"]["torch-shm"]["summary"]["gbps"]["min"] = 1e9
    with pytest.raises(ValueError, match="out of order"):
        report.validate(bad)


@pytest.mark.timeout(60)
def test_report_table_and_plots(tmp_path):
    pytest.importorskip("matplotlib")  # the bench extra's (make test installs it)
    doc = _fake_doc()
    text = report.format_report(doc)
    assert "seed001 (large items" in text and "9.57x" in text  # 0.67 / 0.07 posted
    assert "4.00x" in text and "20.00x" in text and "20%" in text
    assert "6 slots x 64 MiB = 384 MiB" in text
    assert report.fmt_bytes(4096) == "4 KiB" and report.fmt_bytes(1.5 * (1 << 30)) == "1.5 GiB"
    report.write_json(doc, str(tmp_path / "t.json"))
    made = report.plot(doc, str(tmp_path), "t")
    assert sorted(os.path.basename(m) for m in made) == ["t-cpu.png", "t-gbps.png", "t-seed001.png"]
    for m in made:
        with open(m, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _seed_doc() -> dict:
    """seed001 at 0 and 8 workers, three repeats each; SPDL skipped without workers."""
    runs = {  # s/batch of repeats 0, 1, 2
        "torch-pickle": (0.60, 0.70, 0.65), "torch-shm": (0.18, 0.20, 0.16),
        "shmloader-np": (0.10, 0.14, 0.13), "shmloader": (0.09, 0.11, 0.10),
        "spdl-arena": (0.20, 0.21, 0.26),
    }
    pts = []
    for w in (0, 8):
        (sp,) = seed001_points(["large"], [w])
        tr = {n: {"repeats": [{"s_per_batch": s, "repeat": r} for r, s in enumerate(v)]}
              for n, v in runs.items()}
        if w == 0:
            tr["spdl-arena"] = {"skipped": "no workers: SPDL's arena moves batches out of "
                                           "subprocesses"}
        pts.append(report.point_summary({
            "key": sp.key, "workload": "seed001", "label": "large", "batch_size": 128,
            "batch_bytes": sp.batch_bytes, "num_workers": w, "consumer": "step", "warmup": 5,
            "batches": 16, "params": sp.params, "ratios": {}, "transports": tr}))
    return {
        "schema": report.SCHEMA, "created": "2024-01-01T00:00:00+00:00",
        "command": "python -m bench", "machine": {"cpu": "test cpu", "cores": 2},
        "config": {"repeats": 3, "name": "main"}, "points": pts, "warnings": [],
        "work_bound": {"by_point": {pts[1]["key"]: 0.08}},
    }


@pytest.mark.timeout(30)
def test_seed_table_prints_median_and_range_of_the_repeats():
    doc = _seed_doc()
    report.validate(doc)
    text = report.seed_table(doc, "large")
    assert "median [min-max] of 3 run(s)" in text
    assert "0.650 [0.600-0.700]" in text  # torch posted: its three runs
    assert "SPDL arena posted" in text and "0.210 [0.200-0.260]" in text
    assert "skipped at 0 workers: no workers" in text
    # paired per repeat: torch-pickle / shmloader-np = 6.00, 5.00, 5.00
    assert "5.00x [5.00-6.00]" in text
    # torch-shm / shmloader = 2.00, 1.82, 1.60
    assert "1.82x [1.60-2.00]" in text
    # best of shmloader's two collates / the work bound: 0.09, 0.11, 0.10 over 0.08
    assert "1.25x [1.12-1.38]" in text
    # spdl-arena / shmloader-np = 2.00, 1.50, 2.00
    assert "2.00x [1.50-2.00]" in text


@pytest.mark.timeout(30)
def test_a_bound_measured_before_each_repeat_is_paired_with_that_repeat():
    doc = _seed_doc()
    doc["work_bound"]["by_point_repeat"] = {doc["points"][1]["key"]: [0.09, 0.055, 0.05]}
    text = report.seed_table(doc, "large")
    assert "0.055 [0.050-0.090]" in text  # the bound column: the repeats' bounds
    # best of shmloader's two collates / that repeat's bound: 0.09/0.09, 0.11/0.055, 0.10/0.05
    assert "2.00x [1.00-2.00]" in text and "1.25x" not in text


@pytest.mark.timeout(30)
def test_work_only_is_set_against_shmloader_and_the_bound():
    doc = _seed_doc()
    key = doc["points"][1]["key"]
    tr = doc["points"][1]["transports"]
    tr["work-only"] = {"repeats": [{"s_per_batch": s, "repeat": r}
                                   for r, s in enumerate((0.09, 0.10, 0.08))]}
    doc["points"][1] = report.point_summary(doc["points"][1])
    text = report.seed_table(doc, "large")
    assert "work only" in text and "0.090 [0.080-0.100]" in text
    # shmloader's better collate / work only: 0.09/0.09, 0.11/0.10, 0.10/0.08
    assert "1.10x [1.00-1.25]" in text
    # work only / the bound (0.08): 1.125, 1.25, 1.0
    assert "1.12x [1.00-1.25]" in text
    assert key in doc["work_bound"]["by_point"]


@pytest.mark.timeout(60)
def test_work_only_makes_batches_in_order_within_the_prefetch_and_stops_its_workers():
    from bench.work_only import WorkOnlyLoader

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return np.full(4, i, np.float64)

    loader = WorkOnlyLoader(Rows(), batch_size=3, num_workers=2, collate_fn=lambda b: b,
                            prefetch_factor=2)
    assert list(loader) == [0, 1, 2, 3]  # round-robin over the 2 workers, the last batch short
    procs = [c for c in __import__("multiprocessing").active_children()]
    loader.close()
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(RuntimeError, match="TypeError: .*a list of arrays of one shape"):
        list(WorkOnlyLoader(Rows(), batch_size=2, num_workers=1,
                            collate_fn=lambda b: {"x": b}))
    (sp,) = seed001_points(["large"], [2])
    t = all_transports()["work-only"]
    assert skip_reason(t, sp) is None
    assert "seed001 and rows only" in skip_reason(t, transport_points([MiB], [2])[0])
    assert "no workers" in skip_reason(t, seed001_points(["large"], [0])[0])


# ---------------------------------------------------------------------------------------------
# the CLI


@pytest.mark.timeout(30)
def test_default_run_is_the_main_job():
    name, points, names = cli.plan(cli.build_parser().parse_args([]))
    assert name == "main"
    assert [(p.workload, p.label, p.num_workers) for p in points] == [
        ("seed001", "large", w) for w in (0, 2, 4, 6, 8)]  # the 2, 4, 6 and 8
    assert cli.transports_for(points[0], names) == [
        "torch-pickle", "torch-shm", "shmloader", "shmloader-np", "spdl-arena", "work-only"]
    assert cli.default_repeats(cli.build_parser().parse_args([])) == 3  # median [min-max]
    assert cli.default_repeats(cli.build_parser().parse_args(["--quick"])) == 1
    assert all(p.warmup + p.batches >= 21 for p in points)  # the post's 5 + 16 at least
    name, points, names = cli.plan(cli.build_parser().parse_args(
        ["-w", "transport", "--sizes", "1M,256M", "--workers", "2,4", "--consumers", "read"]))
    assert [(p.batch_bytes, p.num_workers, p.consumer) for p in points] == [
        (MiB, 2, "read"), (MiB, 4, "read"), (256 * MiB, 2, "read"), (256 * MiB, 4, "read")]
    assert "shmloader-np" not in cli.transports_for(points[0], names)
    assert "work-only" not in cli.transports_for(points[0], names)  # seed001's reference only
    assert "memcpy" in cli.transports_for(points[0], names)
    for n in ("torch-pickle-np", "shmloader-np-stack", "spdl-arena"):
        assert n in cli.transports_for(points[0], names)
    with pytest.raises(SystemExit):
        cli.plan(cli.build_parser().parse_args(["-w", "nope"]))
    # each workload's own file: -w paced then -w epochs do not overwrite one another
    assert cli.plan(cli.build_parser().parse_args(["-w", "paced"]))[0] == "paced"
    assert cli.plan(cli.build_parser().parse_args(["-w", "rows,epochs"]))[0] == "rows-epochs"
    assert cli.plan(cli.build_parser().parse_args(["-w", "all"]))[0] == "bench"


@pytest.mark.timeout(30)
def test_paced_points_keep_the_loop_waiting_and_report_the_cpu_ratio():
    """`-w paced`: transport batches at 1 MiB and 256 MiB whose samples sleep, so the loop waits
    for every batch at both sizes; the report divides main-process CPU at the largest by the
    smallest, per transport."""
    name, points, names = cli.plan(cli.build_parser().parse_args(["-w", "paced"]))
    assert [(p.workload, p.batch_bytes, p.num_workers, p.label) for p in points] == [
        ("paced", MiB, cli.cores(), "1MiB"), ("paced", 256 * MiB, cli.cores(), "256MiB"),
        ("paced", 256 * MiB, cli.cores(), "256MiB-fresh")]
    assert cli.transports_for(points[0], names) == ["torch-shm", "shmloader", "shmloader-np-stack",
                                                    "spdl-arena"]
    ds = points[0].dataset()
    t0 = time.perf_counter()
    sample = ds[3]
    assert time.perf_counter() - t0 >= points[0].params["sample_s"] and sample.nbytes == MiB // 16
    assert sample is ds[3]  # held by the dataset; the fresh point's samples are new each time
    fresh = dataclasses.replace(points[2], batch_bytes=MiB).dataset()  # small, for the test
    assert fresh[3] is not fresh[3] and np.array_equal(fresh[3], sample)

    def point(label, nbytes, cpus, params=None):
        return {"key": f"paced/{label}/w2/touch", "workload": "paced", "label": label,
                "batch_bytes": nbytes, "params": params or {}, "transports": {"shmloader": {"repeats": [
                    {"s_per_batch": 0.03, "main_cpu_s_per_batch": c} for c in cpus]}}}

    doc = {"points": [point("256MiB", 256 * MiB, [0.0006, 0.0005, 0.0007]),
                      point("256MiB-fresh", 256 * MiB, [0.009, 0.009, 0.009], {"fresh": True}),
                      point("1MiB", MiB, [0.0002, 0.00025, 0.0003])]}
    (line,) = report.paced_lines(doc)
    assert line == "  shmloader: 0.600 ms at 256MiB / 0.250 ms at 1MiB = 2.40x"

@pytest.mark.timeout(120)
def test_quick_runs_end_to_end(tmp_path):
    pytest.importorskip("matplotlib")  # the bench extra's (make test installs it)
    before = shm_entries()
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(tmp_path), "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "quick.json") as f:
        doc = json.load(f)
    report.validate(doc)
    assert {p["workload"] for p in doc["points"]} == {"seed001", "transport", "small", "vision"}
    for p in doc["points"]:
        for name in ("torch-pickle", "torch-shm"):
            assert doc and p["transports"][name]["summary"]["s_per_batch"]["median"] > 0
    for p in doc["points"]:  # SPDL runs where it is installed, else says why not
        spdl = p["transports"]["spdl-arena"]
        assert "summary" in spdl or "spdl not importable" in spdl["skipped"], spdl
    assert not [w for w in doc["warnings"] if "leaked" in w or "killed" in w], doc["warnings"]
    assert (tmp_path / "quick-gbps.png").exists() and (tmp_path / "quick-seed001.png").exists()
    assert "seconds per batch" in proc.stdout
    assert shm_entries() <= before



@pytest.mark.timeout(120)
def test_the_user_workloads_tool_runs_both_loaders_and_prints_their_ratios(monkeypatch, capsys):
    from tools import user_workloads

    monkeypatch.setattr(user_workloads, "REPEATS", 1)
    monkeypatch.setattr(user_workloads, "WINDOW_S", 0.05)
    user_workloads.main(["features", "clips-pad"])
    out = capsys.readouterr().out
    assert "features:" in out and "clips-pad:" in out
    assert out.count("torch / shmloader, time:") == 2
    assert "peak memory MB" in out


@pytest.mark.timeout(180)
def test_the_held_batches_bench_runs_every_workload_for_both_loaders(tmp_path, capsys):
    from bench import held

    out = tmp_path / "held.json"
    assert held.main(["--repeats", "1", "--batches", "10", "--hold", "10", "--padded", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("padded batches (") == 2 and "numpy pad" in printed and "pad_sequence" in printed
    runs = json.loads(out.read_text())["runs"]
    for peer in ("torch", "shmloader"):
        for collate in held.PADDED_COLLATES:
            assert runs[f"{peer} {collate} held"] == runs[f"torch {collate} held"]  # the same batches
            assert runs[f"{peer} {collate} s"][0] > 0
