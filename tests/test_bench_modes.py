"""The benchmark's mode workloads (``-w epochs``, ``-w rows``): planned apart from the others, and
each run end to end in its ``--quick`` form (2 workers, small arrays, a few batches) through the
CLI's ``main()``, the JSON checked for the fields the tables are drawn from."""

from __future__ import annotations

import inspect
import json

import pytest

from bench import __main__ as cli
from bench import report
from bench.transports import Transport, all_transports, skip_reason
from bench.workloads import epochs_points, rows_points


def _accepts(kwarg: str) -> bool:
    try:
        from shmloader import ShmDataLoader
    except Exception:  # noqa: BLE001 - shmloader not built: its rows are skipped
        return False
    return kwarg in inspect.signature(ShmDataLoader).parameters


def _run(tmp_path, workload: str, capfd) -> tuple[dict, str]:
    # capfd, not capsys: under capsys sys.stderr has no fileno, and shmloader's workers call
    # faulthandler.enable() (sys.stderr) first thing, so they exit with status 1 at start-up
    rc = cli.main(["-w", workload, "--quick", "--out", str(tmp_path), "--name", workload,
                   "--no-plots", "--no-progress"])
    assert rc == 0
    with open(tmp_path / f"{workload}.json") as f:
        doc = json.load(f)
    report.validate(doc)
    return doc, capfd.readouterr().out


def _check_mode_transport(tdoc: dict, kwarg: str) -> bool:
    """The mode transport ran where ShmDataLoader takes ``kwarg``, else says why not."""
    if _accepts(kwarg):
        assert "summary" in tdoc, tdoc
        return True
    assert kwarg in tdoc["skipped"], tdoc
    return False


@pytest.mark.timeout(30)
def test_mode_workloads_are_planned_apart():
    args = cli.build_parser().parse_args(["--quick"])
    _, points, _ = cli.plan(args)
    assert not {p.workload for p in points} & {"epochs", "rows"}  # --quick alone: as before
    _, points, names = cli.plan(cli.build_parser().parse_args(["-w", "epochs,rows,transport"]))
    by = {p.workload: p for p in points}
    assert cli.transports_for(by["epochs"], names) == [
        "torch-shm", "shmloader", "shmloader-epoch-prefetch", "shmloader-rows-epoch-prefetch"]
    assert cli.transports_for(by["rows"], names) == ["torch-shm", "shmloader", "shmloader-rows",
                                                    "work-only"]
    assert not set(cli.transports_for(by["transport"], names)) & set(cli.MODE_ONLY)
    assert by["rows"].num_workers == 8 and by["rows"].batch_size == 128
    assert by["rows"].warmup + by["rows"].batches == 21  # timed as seed001
    (p,) = cli.plan(cli.build_parser().parse_args(["-w", "rows", "--workers", "4"]))[1]
    assert p.num_workers == 4
    (e,) = epochs_points([4])
    assert e.batches == e.params["epochs"] * e.params["epoch_batches"] == 60
    kw = e.loader_kwargs()
    assert kw["shuffle"] is True and kw["persistent_workers"] is True
    assert kw["generator"].initial_seed() == e.params["seed"]
    assert len(e.dataset()) == e.params["epoch_batches"] * e.batch_size
    assert e.dataset()[0].dtype.name == "float32"
    (r,) = rows_points([8])
    assert r.dataset()[0].shape == (1000, 150) and r.dataset()[0].dtype.name == "float64"


@pytest.mark.timeout(30)
def test_a_mode_kwarg_the_loader_does_not_take_is_a_skip_reason():
    pytest.importorskip("shmloader")
    (p,) = rows_points([2], quick=True)
    fake = Transport("x", "shmloader", extra=(("no_such_mode_kwarg", True),))
    assert "no_such_mode_kwarg=" in skip_reason(fake, p)
    assert skip_reason(all_transports()["shmloader"], p) is None
    why = skip_reason(all_transports()["shmloader-rows"], p)
    assert (why is None) == _accepts("sample_parallel")


@pytest.mark.timeout(120)
def test_epochs_quick_end_to_end(tmp_path, capfd):
    doc, out = _run(tmp_path, "epochs", capfd)
    (p,) = doc["points"]
    assert p["workload"] == "epochs" and p["num_workers"] == 2
    ran = ["torch-shm", "shmloader"]
    if _check_mode_transport(p["transports"]["shmloader-epoch-prefetch"],
                             "prefetch_next_epoch"):
        ran.append("shmloader-epoch-prefetch")
        ran.append("shmloader-rows-epoch-prefetch")  # (both modes, which combine)
    for tn in ran:
        assert "repeats" in p["transports"][tn], (tn, p["transports"][tn], doc["warnings"])
        (r,) = p["transports"][tn]["repeats"]
        assert len(r["first_waits_s"]) == len(r["epoch_steady_waits_s"]) == 3
        for k in ("first_wait_e1_s", "first_wait_e2_s", "first_wait_e3_s", "steady_wait_s",
                  "total_s", "boundary_ratio_e2", "boundary_ratio_e3"):
            assert r[k] > 0, (tn, k)
            assert k in p["transports"][tn]["summary"], (tn, k)
        assert r["first_wait_e2_s"] == r["first_waits_s"][1]
        assert r["boundary_ratio_e2"] == pytest.approx(r["first_wait_e2_s"] / r["steady_wait_s"])
        assert r["total_s"] >= sum(r["epoch_s"])
        assert len(set(r["first_batch_sums"])) == 3  # each epoch reshuffled
    ref = p["transports"]["torch-shm"]["repeats"][0]["first_batch_sums"]
    for tn in ran:  # the same seeded order through every loader
        assert p["transports"][tn]["repeats"][0]["first_batch_sums"] == ref, tn
    assert not [w for w in doc["warnings"] if "leaked" in w or "killed" in w], doc["warnings"]
    assert "e2 first / steady" in out and "same shuffled order as torch-shm" in out


@pytest.mark.timeout(120)
def test_rows_quick_end_to_end(tmp_path, capfd):
    doc, out = _run(tmp_path, "rows", capfd)
    (p,) = doc["points"]
    assert p["workload"] == "rows" and p["num_workers"] == 2
    assert doc["work_bound"]["by_point"][p["key"]] > 0
    ran = ["torch-shm", "shmloader", "work-only"]
    if _check_mode_transport(p["transports"]["shmloader-rows"], "sample_parallel"):
        ran.append("shmloader-rows")
    for tn in ran:
        assert "repeats" in p["transports"][tn], (tn, p["transports"][tn], doc["warnings"])
        (r,) = p["transports"][tn]["repeats"]
        for k in ("first_batch_s", "s_per_batch", "median_s_per_batch", "total_s",
                  "peak_mem_bytes", "peak_shm_bytes"):
            assert r[k] is not None and r[k] >= 0, (tn, k)
            assert k in p["transports"][tn]["summary"], (tn, k)
        assert len(r["batch_s"]) == p["warmup"] + p["batches"]
        assert r["total_s"] == pytest.approx(sum(r["batch_s"]))
        timed = r["batch_s"][p["warmup"]:]
        assert r["s_per_batch"] == pytest.approx(sum(timed) / len(timed))  # seed001's figure
    assert not [w for w in doc["warnings"] if "leaked" in w or "killed" in w], doc["warnings"]
    assert "TTFB / torch-shm" in out and "steady / bound" in out


@pytest.fixture
def modes_built(monkeypatch):
    """A ShmDataLoader that takes both mode kwargs (and ignores them): the bench's wiring for
    when the modes land, tested before they do."""
    shmloader = pytest.importorskip("shmloader")

    class WithModes(shmloader.ShmDataLoader):
        def __init__(self, *args, prefetch_next_epoch=False, sample_parallel=False, **kwargs):
            self.seen = {"prefetch_next_epoch": prefetch_next_epoch,
                         "sample_parallel": sample_parallel}
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(shmloader, "ShmDataLoader", WithModes)
    return WithModes


@pytest.mark.timeout(60)
def test_mode_transports_pass_their_kwarg_once_it_exists(modes_built):
    from bench.transports import make_loader

    t = all_transports()
    (r,) = rows_points([2], quick=True)
    (e,) = epochs_points([2], quick=True)
    assert skip_reason(t["shmloader-rows"], r) is None
    assert skip_reason(t["shmloader-epoch-prefetch"], e) is None
    assert make_loader(t["shmloader-rows"], r).seen == {
        "prefetch_next_epoch": False, "sample_parallel": True}
    assert make_loader(t["shmloader-epoch-prefetch"], e).seen == {
        "prefetch_next_epoch": True, "sample_parallel": False}
    assert make_loader(t["shmloader"], e).seen == {
        "prefetch_next_epoch": False, "sample_parallel": False}


@pytest.mark.timeout(120)
def test_epochs_table_has_the_mode_row_once_it_exists(tmp_path, capfd, modes_built):
    doc, out = _run(tmp_path, "epochs", capfd)
    (p,) = doc["points"]
    assert "summary" in p["transports"]["shmloader-epoch-prefetch"]
    assert "shmloader-epoch-prefetch" in out and "skipped" not in out
