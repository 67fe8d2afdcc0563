"""``python -m bench.timing_cost``: what shmloader's stall diagnostics cost per batch, measured
call by call (the loop's two clock reads around next(), a worker's stage changes with and
without timing, and the status-word store they replace), against the time of a batch.

The transport bench (``--transports shmloader,shmloader-untimed``) measures the same cost end to
end, one loader per run; on a shared machine its run-to-run noise is larger than the cost.
``--ab`` measures it end to end on one loader instead: the transport workload (16 rows, 1 MiB
batches by default, 2 workers, the touch consumer), timing switched on and off in alternate
blocks of batches (the workers read their block's `timed` word at each change of stage), so that
the load of other processes hits both alike; the cost is each on block against the off blocks
beside it, median [min-max] over the blocks.
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

from shmloader import layout
from shmloader.protocol import FETCHING, IDLE, STATUS_WORD, WRITING
from shmloader.segment import create_segment
from shmloader.timing import BatchClock, init_block, stage_clock

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


def ab(batch_bytes: int = 1 << 20, workers: int = 2, blocks: int = 40, per_block: int = 300,
       warmup: int = 100) -> dict:
    """On/off blocks on one loader; returns {"cost": [on / mean(neighbouring offs) - 1, ...],
    "on_s": [...], "off_s": [...]} (seconds per batch per block)."""
    import struct

    from shmloader import ShmDataLoader
    from shmloader.protocol import status_offset
    from shmloader.timing import W_TIMED

    from .measure import touch
    from .workloads import PremadeDataset

    rows = 16
    dataset = PremadeDataset(batch_bytes // rows, 1 << 40, distinct=rows)
    loader = ShmDataLoader(dataset, batch_size=rows, num_workers=workers)
    it = iter(loader)

    def timed(on: bool) -> None:
        it._clock.enabled = on
        for worker_id in range(workers):
            it._status.write(status_offset(worker_id) + 8 * W_TIMED, struct.pack("<q", int(on)))

    def block() -> float:
        t0 = time.perf_counter()
        for _ in range(per_block):
            batch = next(it)
            touch(batch)
            del batch
        return (time.perf_counter() - t0) / per_block

    try:
        for _ in range(warmup):
            touch(next(it))
        modes = [k % 2 == 0 for k in range(blocks)]  # on, off, on, off, ...
        seconds = []
        for on in modes:
            timed(on)
            seconds.append(block())
    finally:
        it._shutdown_workers()
    cost = []
    for k, on in enumerate(modes):
        if on:
            offs = [seconds[j] for j in (k - 1, k + 1) if 0 <= j < blocks]
            cost.append(seconds[k] / (sum(offs) / len(offs)) - 1)
    return {"cost": cost, "on_s": [s for s, on in zip(seconds, modes) if on],
            "off_s": [s for s, on in zip(seconds, modes) if not on]}


def _cell(values: list[float], scale: float, fmt: str) -> str:
    ordered = sorted(values)
    return (f"{statistics.median(ordered) * scale:{fmt}} "
            f"[{ordered[0] * scale:{fmt}}..{ordered[-1] * scale:{fmt}}]")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.timing_cost", description=__doc__)
    ap.add_argument("--batch-ms", type=float, default=0.33,
                    help="time per batch to compare with (default 0.33 ms: the transport "
                         "workload's 1 MiB batches at about 3 GB/s)")
    ap.add_argument("--ab", action="store_true",
                    help="also measure end to end: timing on and off in alternate blocks")
    ap.add_argument("--ab-sizes", default="1M", help="batch sizes for --ab (default 1M)")
    ap.add_argument("--blocks", type=int, default=40, help="--ab blocks (half on, half off)")
    ap.add_argument("--per-block", type=int, default=300, help="--ab batches per block")
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
    if args.ab:
        from .workloads import parse_size

        for size in [parse_size(x) for x in args.ab_sizes.split(",") if x.strip()]:
            r = ab(size, blocks=args.blocks, per_block=args.per_block)
            print(f"--ab {size >> 20} MiB batches, 2 workers, {len(r['cost'])} on blocks of "
                  f"{args.per_block} batches against the off blocks beside them: cost "
                  f"{_cell(r['cost'], 100, '+.2f')} %; ms per batch on {_cell(r['on_s'], 1e3, '.4f')}, "
                  f"off {_cell(r['off_s'], 1e3, '.4f')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
