"""``python -m bench.timing_cost``: what shmloader's stall diagnostics cost per batch, measured
call by call (the loop's two clock reads around next(), a worker's stage changes with and
without timing, and the status-word store they replace), against the time of a batch.

The transport bench (``--transports shmloader,shmloader-untimed``) measures the same cost end to
end, but on a shared machine its run-to-run noise is larger than the cost; these figures bound it.
"""

from __future__ import annotations

import argparse
import timeit

from shmloader import layout
from shmloader.ring import create_segment
from shmloader.timing import BatchClock, init_block, stage_clock
from shmloader.worker import FETCHING, IDLE, STATUS_WORD, WRITING

# stage changes per batch in a worker: fetching, (awaiting slot,) collating, laying out, writing,
# idle; six with a custom collate_fn
STAGES_PER_BATCH = 6


def _best(stmt, number: int, repeats: int) -> float:
    """The best of `repeats` timings (the least disturbed by other processes), seconds per call."""
    return min(timeit.repeat(stmt, number=number, repeat=repeats)) / number


def measure(number: int = 200_000, repeats: int = 7) -> dict:
    segment = create_segment(4096, 0, "timing_cost")
    out = {}
    for timed in (True, False):
        init_block(segment, layout.HEADER_BYTES, IDLE, timed)
        clock = stage_clock(segment, layout.HEADER_BYTES, IDLE, FETCHING)
        stages = iter(range(10**9))

        def enter(clock=clock, stages=stages):
            clock.enter(WRITING if next(stages) % 2 else FETCHING, 7)

        out["worker_stage_change_timed_s" if timed else "worker_stage_change_untimed_s"] = (
            _best(enter, number, repeats))
    packed = STATUS_WORD.pack

    def old_store():  # what each stage change did before the clocks
        segment.write(layout.HEADER_BYTES, packed(WRITING, 7))

    out["worker_status_store_before_s"] = _best(old_store, number, repeats)
    for enabled in (True, False):
        batch_clock = BatchClock(enabled)

        def next_call(c=batch_clock):
            c.end(c.begin())

        out["main_next_timed_s" if enabled else "main_next_untimed_s"] = (
            _best(next_call, number, repeats))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.timing_cost", description=__doc__)
    ap.add_argument("--batch-ms", type=float, default=0.33,
                    help="time per batch to compare with (default 0.33 ms: the transport "
                         "workload's 1 MiB batches at about 3 GB/s)")
    args = ap.parse_args(argv)
    m = measure()
    worker = STAGES_PER_BATCH * (m["worker_stage_change_timed_s"] - m["worker_status_store_before_s"])
    main_cost = m["main_next_timed_s"] - m["main_next_untimed_s"]
    for k, v in m.items():
        print(f"{k:32s} {v * 1e9:8.0f} ns")
    batch = args.batch_ms / 1e3
    print(f"per batch: main process {main_cost * 1e9:+.0f} ns, a worker {worker * 1e9:+.0f} ns "
          f"({STAGES_PER_BATCH} stage changes) against {args.batch_ms} ms per batch: "
          f"{100 * main_cost / batch:.3f}% of the training process's time, "
          f"{100 * worker / batch:.3f}% of one worker's (2 workers share the batches: half that)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
