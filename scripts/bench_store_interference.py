#!/usr/bin/env python3
"""Store interference: how much the reactor's STORE work slows vLLM's model-runner thread.

On the H200 the requests that store their KV (cold prefill) were 1.15-1.45x slower than
recompute while vLLM's own CPU offload stored the same bytes for free
(docs/results/h200/longdoc-*). Inside vLLM the reactor shares the GIL with the engine
thread, whose chunked-prefill steps alternate Python work (scheduling, input preparation,
eager kernel launches: needs the GIL) with waiting for the GPU (GIL free). This emulates
that thread: ``--steps`` steps of ``--py-ms`` of pure-Python work plus ``--gpu-ms`` of
GIL-free wait, submitting ``--chunks-per-step`` chunk stores at the start of each step
(vLLM's deferred stores), and reports the emulated prefill time of each case against the
same loop with no stores, side by side in one run, each case in its own process:

  no_store        the loop alone (baseline)
  store_disk      every chunk copied to a staging slot, hashed and written to a file
  store_dram      every chunk copied into a DRAM-tier slot only (NO_DISK)
  store_disk_dram every chunk copied into a DRAM-tier slot and written through to disk

Device copies are simulated (asynchronous, done 0.5 ms after submission). Root: a real
filesystem directory (``--root``).

Usage: python scripts/bench_store_interference.py [--root DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from kvcache_core.bench.common import run_cases, write_json_md  # noqa: E402

CASES = ("no_store", "store_disk", "store_dram", "store_disk_dram")


_ITERS_PER_MS = 0


def _spin(n: int) -> int:
    x = 0
    for i in range(n):
        x += i * i
    return x


def _calibrate() -> None:
    """Iterations of :func:`_spin` per ms on an idle process (fixed work, not wall time:
    a GIL stolen by the reactor must make the step longer)."""
    global _ITERS_PER_MS
    n = 200_000
    best = min(_timed(n) for _ in range(5))
    _ITERS_PER_MS = max(1, int(n / (best * 1000)))


def _timed(n: int) -> float:
    t0 = time.perf_counter()
    _spin(n)
    return time.perf_counter() - t0


def _py_work(ms: float) -> None:
    """A fixed amount of pure-Python work: about ``ms`` when nothing else wants the GIL."""
    _spin(int(_ITERS_PER_MS * ms))


def child(args, case: str) -> dict:
    from kvcache_core import Layout, Namespace, Reactor
    from kvcache_core.copy import TimedCopier
    from kvcache_core.reactor import NO_DISK

    _calibrate()
    block = args.block_mib << 20
    root = os.path.join(args.root, case)
    shutil.rmtree(root, ignore_errors=True)
    lay = Layout(root, Namespace("interf", "u8", 256, block))
    n_dram = args.steps * args.chunks_per_step if case.endswith("dram") else 0
    r = Reactor(lay, n_slots=36, external_slots=n_dram, io_depth=8, copier=TimedCopier,
                pin=False)
    runs = []
    seq = 0
    for rep in range(args.repeats):
        t0 = time.perf_counter()
        for s in range(args.steps):
            if case != "no_store":
                items = []
                for c in range(args.chunks_per_step):
                    i = s * args.chunks_per_step + c
                    key = b"r%d-c%d" % (rep, i)
                    if n_dram:
                        flags = NO_DISK if case == "store_dram" else 0
                        items.append((key, None, block, r.n_staging + i, flags))
                    else:
                        items.append((key, None, block))
                seq += 1
                r.store(seq, items)
            _py_work(args.py_ms)
            time.sleep(args.gpu_ms / 1000.0)
        runs.append(time.perf_counter() - t0)
        r.wait()  # stores finish between repeats (between requests)
    st = r.snapshot()
    r.close()
    lay.close()
    shutil.rmtree(root, ignore_errors=True)
    return {"prefill_s": statistics.median(runs), "runs_s": runs,
            "switch_interval_s": sys.getswitchinterval(), "stores_ok": st["stores_ok"],
            "bytes_written": st["bytes_written"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=os.path.join(REPO, ".bench-root", "interference"))
    ap.add_argument("--json", default=os.path.join(REPO, "docs", "results", "cpu",
                                                   "store-interference.json"))
    ap.add_argument("--steps", type=int, default=32, help="prefill steps (64k / 2048)")
    ap.add_argument("--chunks-per-step", type=int, default=8)
    ap.add_argument("--block-mib", type=int, default=4, help="chunk size (MiB)")
    ap.add_argument("--py-ms", type=float, default=8.0, help="Python work per step (ms)")
    ap.add_argument("--gpu-ms", type=float, default=50.0, help="GIL-free wait per step (ms)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args, args.child)))
        return 0
    out = {"benchmark": "store-interference", "machine": platform.node(),
           "cores": os.cpu_count(), "python": platform.python_version(),
           "params": {k: getattr(args, k) for k in ("steps", "chunks_per_step", "block_mib",
                                                     "py_ms", "gpu_ms", "repeats")},
           "cases": {}}
    passthru = ["--root", args.root, "--steps", str(args.steps), "--chunks-per-step",
                str(args.chunks_per_step), "--block-mib", str(args.block_mib), "--py-ms",
                str(args.py_ms), "--gpu-ms", str(args.gpu_ms), "--repeats", str(args.repeats)]
    out["cases"] = run_cases(__file__, CASES, passthru, "bench interference")
    base = out["cases"]["no_store"]["prefill_s"]
    p = out["params"]
    lines = [f"# Store interference with a busy model-runner thread ({out['machine']}, "
             f"{out['cores']} cores, Python {out['python']})", "",
             f"Emulated chunked prefill: {p['steps']} steps x ({p['py_ms']} ms Python + "
             f"{p['gpu_ms']} ms GIL-free wait), {p['chunks_per_step']} chunk stores of "
             f"{p['block_mib']} MiB submitted per step; simulated device copies; median of "
             f"{p['repeats']}; each case in its own process.", "",
             "| case | emulated prefill (s) | vs no store | GB written |", "|---|---|---|---|"]
    for name, c in out["cases"].items():
        lines.append(f"| {name} | {c['prefill_s']:.3f} | {c['prefill_s'] / base:.2f} | "
                     f"{c['bytes_written'] / 1e9:.2f} |")
    write_json_md(args.json, out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
