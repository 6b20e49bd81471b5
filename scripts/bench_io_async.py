#!/usr/bin/env python3
"""``io_async`` A/B through the real reactor: what submitting a disk read costs the thread
that holds the GIL, and what it costs another Python thread meanwhile.

    python scripts/bench_io_async.py --root DIR [--block-mb 29] [--blocks 64]
        [--depth 8] [--rounds 3] [--json OUT.json]

Stores ``--blocks`` blocks of ``--block-mb`` MB (one file each, the size of a 40k-token
Llama-3.2-3B chunk of 256 tokens is 29 MB) with a real :class:`~kvcache_core.reactor.Reactor`,
then loads them all back (O_DIRECT where the filesystem allows it, io_uring) with
``io_async`` "off" and "on", interleaved over ``--rounds`` rounds (order alternated).
For each load: wall time and GB/s, the reactor's time inside ``submit`` (io_uring_enter,
which the liburing binding runs holding the GIL) in all and at worst, and, measured in
this (main) thread while the load runs, how long batches of 1,640 ``faccessat`` calls on
the cache's own files take (what vLLM's scheduler does for 41 waiting requests x 40
blocks per engine step at 10k tokens; each call releases the GIL and must take it back
from the reactor thread). Rows and medians go to ``--json``; a Markdown table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvcache_core.layout import Layout, Namespace  # noqa: E402
from kvcache_core.reactor import Reactor, probe_direct  # noqa: E402

MiB = 1 << 20
LOOKUPS_PER_STEP = 1640


def _reactor(lay: Layout, depth: int, io_async: str) -> Reactor:
    return Reactor(lay, n_slots=depth + 2, io_depth=depth, lookahead=depth, pin=False,
                   io_async=io_async)


def _run(r: Reactor, kind: str, keys: list[bytes], size: int) -> float:
    items = [(k, None, size) for k in keys]
    t0 = time.perf_counter()
    (r.store if kind == "store" else r.load)(kind, items)
    r.wait()
    dt = time.perf_counter() - t0
    (c,) = r.poll()
    if not c.success:
        raise RuntimeError(f"{kind} failed for {sum(not x for x in c.ok)} blocks")
    return dt


def _lookups_while(r: Reactor, keys: list[bytes], size: int, lay: Layout
                   ) -> tuple[float, list[float]]:
    """Load ``keys`` in a helper thread; meanwhile time batches of lookups here."""
    out: dict[str, float] = {}
    th = threading.Thread(target=lambda: out.setdefault("dt", _run(r, "load", keys, size)))
    batches: list[float] = []
    th.start()
    n = len(keys)
    while th.is_alive():
        t0 = time.perf_counter()
        for i in range(LOOKUPS_PER_STEP):
            lay.exists(keys[i % n])
        batches.append((time.perf_counter() - t0) * 1e3)
    th.join()
    return out["dt"], batches


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="scratch directory (emptied)")
    ap.add_argument("--block-mb", type=int, default=29)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write rows and medians here")
    a = ap.parse_args(argv)
    size = a.block_mb * MiB
    shutil.rmtree(a.root, ignore_errors=True)
    os.makedirs(a.root)
    ns = Namespace("bench-io-async", "u8", 256, size)
    lay = Layout(a.root, ns)
    keys = [f"blk-{i}".encode() for i in range(a.blocks)]
    direct = probe_direct(a.root, "auto")
    r = _reactor(lay, a.depth, "auto")
    try:
        print(f"[io_async] storing {a.blocks} x {a.block_mb} MB under {a.root} "
              f"(O_DIRECT={direct})", file=sys.stderr)
        _run(r, "store", keys, size)
    finally:
        r.close()
    rows = []
    for rnd in range(a.rounds):
        for mode in (("off", "on") if rnd % 2 == 0 else ("on", "off")):
            r = _reactor(lay, a.depth, mode)
            try:
                dt, batches = _lookups_while(r, keys, size, lay)
                tm = r.timing
                row = {"round": rnd, "io_async": mode, "load_s": dt,
                       "gbps": a.blocks * size / dt / 1e9,
                       "submit_ms": tm["submit_s"] * 1e3,
                       "submit_max_ms": tm["submit_max_s"] * 1e3,
                       "lookup_batch_ms_median": statistics.median(batches),
                       "lookup_batch_ms_max": max(batches), "lookup_batches": len(batches)}
            finally:
                r.close()
            rows.append(row)
            print(f"[io_async] round {rnd + 1}/{a.rounds} {mode}: {row['gbps']:.2f} GB/s, "
                  f"submit {row['submit_ms']:.1f} ms (max {row['submit_max_ms']:.2f}), "
                  f"lookups/step {row['lookup_batch_ms_median']:.1f} ms", file=sys.stderr)
    lay.close()
    shutil.rmtree(a.root, ignore_errors=True)
    med = {}
    for mode in ("off", "on"):
        rs = [x for x in rows if x["io_async"] == mode]
        med[mode] = {k: statistics.median(x[k] for x in rs)
                     for k in ("gbps", "submit_ms", "submit_max_ms", "lookup_batch_ms_median",
                               "lookup_batch_ms_max")}
    print(f"| io_async | GB/s | submit total (ms) | longest submit (ms) | "
          f"{LOOKUPS_PER_STEP} lookups, median (ms) | worst (ms) |")
    print("|---|---|---|---|---|---|")
    for mode in ("off", "on"):
        m = med[mode]
        print(f"| {mode} | {m['gbps']:.2f} | {m['submit_ms']:.1f} | {m['submit_max_ms']:.2f} "
              f"| {m['lookup_batch_ms_median']:.1f} | {m['lookup_batch_ms_max']:.1f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"block_bytes": size, "blocks": a.blocks, "io_depth": a.depth,
                       "o_direct": direct, "rounds": a.rounds, "rows": rows,
                       "medians": med}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
