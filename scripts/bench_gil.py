#!/usr/bin/env python3
"""GIL contention: reactor load throughput with a busy Python thread in the same process.

Inside vLLM the reactor shares the GIL with the engine's busy loop. This measures, side by
side in one run, reactor loads (tmpfs root: the device is memory, so the handoff cost
shows) with: no other thread; a busy thread at CPython's default 5 ms switch interval;
a busy thread at the 0.5 ms the reactor sets by default. Each case runs in its own
process (the switch interval is process wide). The copier simulates asynchronous device
copies (done 0.5 ms per block after submission) so the reactor polls as it does on CUDA.

Usage: python scripts/bench_gil.py [--root /dev/shm/kvcache-gil] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from kvcache_core.bench.common import run_cases, write_json_md  # noqa: E402

CASES = {"no_busy_thread": (False, None), "busy_default_5ms": (True, None),
         "busy_reactor_0.5ms": (True, 0.0005)}


def child(root: str, busy: bool, interval: float | None, repeats: int) -> dict:
    from kvcache_core import Layout, Namespace, Reactor
    from kvcache_core.copy import TimedCopier

    block = 4 << 20
    shutil.rmtree(root, ignore_errors=True)
    lay = Layout(root, Namespace("gil", "u8", 256, block))
    keys = [b"k%d" % i for i in range(64)]
    data = os.urandom(block)
    for k in keys:
        lay.write_block(k, data)
    r = Reactor(lay, n_slots=12, io_depth=8, copier=TimedCopier, pin=False,
                switch_interval=interval)
    stop = threading.Event()
    count = [0]

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            if n % 1000 == 0:
                count[0] = n

    th = threading.Thread(target=spin)
    if busy:
        th.start()
        time.sleep(0.1)
    runs = []
    for rep in range(repeats):
        t0 = time.perf_counter()
        r.load(rep, [(k, None, block) for k in keys])
        r.wait()
        runs.append(len(keys) * block / (time.perf_counter() - t0) / 1e9)
    stop.set()
    if busy:
        th.join()
    r.close()
    lay.close()
    shutil.rmtree(root, ignore_errors=True)
    return {"gbps": statistics.median(runs), "runs_gbps": runs,
            "switch_interval_s": sys.getswitchinterval(), "busy_thread": busy}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="/dev/shm/kvcache-gil")
    ap.add_argument("--json", default=os.path.join(REPO, "docs", "results", "cpu",
                                                   "gil-contention.json"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        busy, interval = CASES[args.child]
        print(json.dumps(child(args.root, busy, interval, args.repeats)))
        return 0
    out = {"benchmark": "gil-contention", "machine": platform.node(),
           "cores": os.cpu_count(), "python": platform.python_version(),
           "cases": run_cases(__file__, list(CASES), ["--root", args.root, "--repeats",
                                                       str(args.repeats)], "bench gil")}
    base = out["cases"]["no_busy_thread"]["gbps"]
    lines = [f"# Reactor vs a busy Python thread ({out['machine']}, {out['cores']} cores, "
             f"Python {out['python']})", "",
             "Reactor loads of 64 x 4 MiB files from tmpfs, simulated async device copies, "
             f"median of {args.repeats} runs, each case in its own process.", "",
             "| case | switch interval | GB/s | vs no busy thread |", "|---|---|---|---|"]
    for name, c in out["cases"].items():
        lines.append(f"| {name} | {c['switch_interval_s'] * 1000:.1f} ms | {c['gbps']:.2f} | "
                     f"{c['gbps'] / base:.2f} |")
    write_json_md(args.json, out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
