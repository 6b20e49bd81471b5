#!/usr/bin/env python3
"""What a promotion's slot-to-slot copy costs vLLM's engine thread (GIL), before and after.

When an on-demand load into the DRAM tier (a promotion) finds its block already in a
staging slot (a staged preload, or a read another load made), the reactor copies the
block's header and payload from that slot into the caller's DRAM-tier slot. Until the
forty-third session that was a memoryview slice assignment, which holds the GIL for the
whole memcpy; now it is ``StagingPool.copy_slot`` (``ctypes.memmove``, GIL released).

Side by side in one process, rounds interleaved: a Python thread stands in for vLLM's
engine loop (a tight loop of perf_counter() calls: Python work that needs the GIL, as
kernel launches do) while a second thread, standing in for the reactor, copies
``--block`` bytes from one slot to another ``--copies`` times, by each method; plus a
round without copies. Reported per method (medians over ``--rounds``): the engine
thread's Python throughput against the no-copy round, its longest gap between two
iterations, and the copy rate. The switch interval is the reactor's 0.5 ms.

Usage: python scripts/bench_claim_copy.py [--block 29364224] [--copies 40] [--rounds 5]
         [--json docs/results/cpu/claim-copy-gil.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from kvcache_core.bench.common import write_json_md  # noqa: E402
from kvcache_core.staging import PAGE, StagingPool  # noqa: E402

METHODS = ("none", "memoryview", "copy_slot")


def one_round(pool: StagingPool, method: str, nbytes: int, copies: int) -> dict:
    """One timed round: the engine stand-in loops while the copier thread runs."""
    views = pool.views
    done = threading.Event()
    spans: list[float] = []

    def copier() -> None:
        try:
            for _ in range(copies):
                t0 = time.perf_counter()
                if method == "memoryview":
                    views[1][:nbytes] = views[0][:nbytes]
                elif method == "copy_slot":
                    pool.copy_slot(1, 0, nbytes)
                else:
                    time.sleep(0.005)  # the no-copy round lasts about as long
                spans.append(time.perf_counter() - t0)
        finally:
            done.set()

    th = threading.Thread(target=copier)
    n, worst = 0, 0.0
    t_start = last = time.perf_counter()
    th.start()
    while not done.is_set():
        now = time.perf_counter()
        if now - last > worst:
            worst = now - last
        last = now
        n += 1
    wall = time.perf_counter() - t_start
    th.join()
    copy_s = sum(spans)
    return {"engine_iter_per_s": n / wall, "engine_worst_gap_ms": worst * 1e3,
            "copy_gbps": (nbytes * copies / copy_s / 1e9) if method != "none" else None,
            "wall_s": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block", type=int, default=29364224,
                    help="bytes per copy (default: one file of the 3B, 256 tokens)")
    ap.add_argument("--copies", type=int, default=40, help="copies per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per method, interleaved")
    ap.add_argument("--json", default=os.path.join(REPO, "docs", "results", "cpu",
                                                   "claim-copy-gil.json"))
    a = ap.parse_args()
    slot = -(-a.block // PAGE) * PAGE
    pool = StagingPool(2, slot, pin=False)
    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    try:
        pool.views[0][:] = os.urandom(slot)
        for rnd in range(a.rounds):
            order = METHODS if rnd % 2 == 0 else METHODS[::-1]
            for m in order:
                print(f"[bench claim-copy] round {rnd + 1}/{a.rounds} {m}", file=sys.stderr,
                      flush=True)
                runs[m].append(one_round(pool, m, a.block, a.copies))
        assert bytes(pool.views[1][:a.block]) == bytes(pool.views[0][:a.block])
    finally:
        sys.setswitchinterval(saved)
        pool.close()
    med = {m: {k: statistics.median(r[k] for r in rs) if rs[0][k] is not None else None
               for k in rs[0]} for m, rs in runs.items()}
    base = med["none"]["engine_iter_per_s"]
    out = {"benchmark": "claim-copy-gil", "machine": platform.node(),
           "cores": os.cpu_count(), "python": platform.python_version(),
           "block_bytes": a.block, "copies": a.copies, "rounds": a.rounds,
           "switch_interval_s": 0.0005, "medians": med, "runs": runs}
    lines = [f"# A promotion's slot-to-slot copy and the engine thread ({out['machine']}, "
             f"{out['cores']} cores, Python {out['python']})", "",
             f"{a.copies} copies of {a.block} B per round (one file of the 3B), "
             f"{a.rounds} rounds per method interleaved, medians; the engine stand-in is a "
             "Python loop in another thread; switch interval 0.5 ms (the reactor's). "
             "`memoryview` is the copy as the reactor made it before the forty-third "
             "session, `copy_slot` as it makes it now. Produced by "
             "`python scripts/bench_claim_copy.py`.", "",
             "| method | engine Python throughput (vs no copies) | engine's longest gap (ms) "
             "| copy GB/s |", "|---|---|---|---|"]
    for m in METHODS:
        r = med[m]
        gb = "-" if r["copy_gbps"] is None else f"{r['copy_gbps']:.2f}"
        lines.append(f"| {m} | {r['engine_iter_per_s'] / base:.2f} | "
                     f"{r['engine_worst_gap_ms']:.2f} | {gb} |")
    write_json_md(a.json, out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
