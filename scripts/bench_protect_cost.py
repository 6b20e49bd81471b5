#!/usr/bin/env python3
"""Scheduler time per engine step of ``preload_protect`` (``PyKVCacheManager.protect_queue``),
on this machine.

The queued mixed workload's shape: ``--waiting`` requests of ``--tokens`` tokens wait
(vLLM block hashes every ``--gpu-block`` tokens, 256-token chunks), the DRAM tier holds
``--dram-chunks`` chunks, of which the waiting requests' documents fill what fits (the
refresh walks them). Each step the patched scheduler shows the first ``--lookahead``
waiting requests; ``protect_queue`` reorders the tier for them and ranks their keys. The
same request objects are shown every step (their keys are built once and kept), as
while they wait in vLLM's queue. Reported: the median and p90 microseconds per call over
``--steps`` calls, per lookahead, and one build of the keys (the first step of a request).

Usage: python scripts/bench_protect_cost.py [--lookahead 4,12] [--json OUT] [--md OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def run(args: argparse.Namespace) -> dict:
    from vllm.v1.kv_offload.base import ReqContext

    from kvcache_core.layout import Namespace
    from kvcache_core.vllm.manager import PyKVCacheManager, make_offload_key

    hpc = 256 // args.gpu_block
    g = SimpleNamespace(group_idx=0, hashes_per_chunk=hpc, tokens_per_chunk=256)
    n_hash = args.tokens // args.gpu_block
    docs = [[(d << 40 | i).to_bytes(32, "big") for i in range(n_hash)]
            for d in range(args.docs)]
    reqs = [SimpleNamespace(request_id=f"r{i}", block_hashes=docs[i % args.docs])
            for i in range(args.waiting)]
    rows = []
    with tempfile.TemporaryDirectory() as root:
        ns = Namespace("m", "bf16", 256, 1 << 16)
        m = PyKVCacheManager(root, [ns], n_dram=args.dram_chunks,
                             writeback_max_fraction=1.0)
        w = ReqContext("writer")
        keys = [make_offload_key(h, 0) for d in docs for h in d[hpc - 1::hpc]]
        fill = keys[:args.dram_chunks]
        m.prepare_store(fill, w)
        m.complete_store(fill, w)
        m.on_worker_report(set(), {}, None, dict.fromkeys(fill, 1))
        for k in (int(x) for x in args.lookahead.split(",")):
            view = reqs[:k]
            m._protect_keys.clear()
            t0 = time.perf_counter()
            m.protect_queue(view, [g])
            build_us = (time.perf_counter() - t0) * 1e6
            ts = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                m.protect_queue(view, [g])
                ts.append((time.perf_counter() - t0) * 1e6)
            ts.sort()
            rows.append({"lookahead": k, "keys_per_step": k * (n_hash // hpc),
                         "first_step_us": round(build_us, 1),
                         "median_us": round(statistics.median(ts), 1),
                         "p90_us": round(ts[int(0.9 * (len(ts) - 1))], 1)})
            print(f"lookahead {k}: {rows[-1]['median_us']} us per step (p90 "
                  f"{rows[-1]['p90_us']}), first step {rows[-1]['first_step_us']} us",
                  flush=True)
    return {"machine": f"{platform.node()} ({os.cpu_count()} cores, "
                       f"{platform.processor() or platform.machine()})",
            "python": platform.python_version(), "tokens": args.tokens,
            "waiting": args.waiting, "docs": args.docs, "dram_chunks": args.dram_chunks,
            "steps": args.steps, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=40960)
    ap.add_argument("--waiting", type=int, default=12)
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--dram-chunks", type=int, default=207)
    ap.add_argument("--gpu-block", type=int, default=16)
    ap.add_argument("--lookahead", default="4,12")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--json")
    ap.add_argument("--md")
    args = ap.parse_args()
    out = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.md:
        lines = [f"# preload_protect: scheduler time per step ({out['machine']})", "",
                 f"`python scripts/bench_protect_cost.py` ({out['waiting']} waiting "
                 f"requests of {out['tokens']} tokens over {out['docs']} documents, a DRAM "
                 f"tier of {out['dram_chunks']} chunks filled with them, "
                 f"{out['steps']} calls per lookahead). The first call of a request "
                 "builds its keys; later calls reuse them.", "",
                 "| lookahead | chunk keys per step | median | p90 | first step |",
                 "|---|---|---|---|---|"]
        for r in out["rows"]:
            lines.append(f"| {r['lookahead']} | {r['keys_per_step']} | {r['median_us']} us "
                         f"| {r['p90_us']} us | {r['first_step_us']} us |")
        with open(args.md, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
