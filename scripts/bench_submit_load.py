#!/usr/bin/env python3
"""Model-runner thread time of one DRAM-hit load job (``PyKVCacheWorker.submit_load``,
the direct path) and of one store job's submission, without an engine (CPU machine).

A 64k-token DRAM hit of the 3B is one load job of 256 chunks; vLLM's engine thread runs
``submit_load`` before the copy starts, so its time adds to the hit's TTFT. This builds a
real worker over CPU KV tensors (256-token chunks of 16 GPU blocks, tiny pages so that the
copy itself is negligible), fills the DRAM tier, then times ``--jobs`` load jobs of
``--chunks`` chunks (and as many store submissions of the same chunks) and reports
medians and the phases of the direct path (header checks, descriptors, copy issue).

Compare two checkouts: run it once per tree (``--repo DIR``: import kvcache_core from
DIR), interleaved with ``--rounds``.

Usage: python scripts/bench_submit_load.py [--repo DIR ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics as st
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys, tempfile, time
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])
import torch
from helpers.vllm_units import key
from kvcache_core.config import StorageConfig
from kvcache_core.layout import Namespace
from kvcache_core.reactor import IN_SLOT
from kvcache_core.vllm import options as O
from kvcache_core.vllm.job_specs import PyKVLoadSpec, PyKVStoreSpec
from kvcache_core.vllm.worker import PyKVCacheWorker
from vllm.v1.kv_offload.base import (CanonicalKVCacheRef, CanonicalKVCaches,
                                     CanonicalKVCacheTensor, GPULoadStoreSpec)
nch, jobs = int(sys.argv[3]), int(sys.argv[4])
bpc, page = 16, 256
nb = nch * bpc + 16
ts = [torch.zeros((nb, page), dtype=torch.int8)]
kv = CanonicalKVCaches([CanonicalKVCacheTensor(t, page) for t in ts],
                       [[CanonicalKVCacheRef(0, page)]])
ns = Namespace("bench/model", "int8", 16 * bpc, block_bytes=page * bpc)
cfg = StorageConfig(root_dir=tempfile.mkdtemp(), staging_bytes=4 * ns.file_bytes,
                    io_depth=2, lookahead=2, copy_headroom=1,
                    dram_cache_bytes=(nch + 8) * ns.file_bytes)
w = PyKVCacheWorker(kv, storage=cfg, namespace=ns, pool=O.pool_geometry(cfg, ns),
                    blocks_per_chunk=bpc, max_disk_bytes=0)
keys = [key(i) for i in range(nch)]
blocks = list(range(nch * bpc))
job = 0
def store():
    global job
    job += 1
    t0 = time.perf_counter()
    w.submit_store(job, GPULoadStoreSpec(blocks, [nch * bpc], [0]),
                   PyKVStoreSpec(keys, list(range(nch))))
    dt = time.perf_counter() - t0
    w.wait({job}); w.get_finished(); w.reactor.wait(60); w.get_finished()
    return dt
def load():
    global job
    job += 1
    t0 = time.perf_counter()
    w.submit_load(job, PyKVLoadSpec(keys, list(range(nch)), [IN_SLOT] * nch),
                  GPULoadStoreSpec(blocks, [nch * bpc], [0]))
    dt = time.perf_counter() - t0
    w.wait({job}); w.get_finished()
    return dt
st_t = [store() for _ in range(jobs)]
for _ in range(3):
    load()
dtm = getattr(w.copier, "direct_timing", None)
if dtm:
    dtm[:] = [0.0] * 4
ld_t = [load() for _ in range(jobs)]
out = {"store_submit_s": st_t, "load_submit_s": ld_t,
       "direct_phases_s": [x / jobs for x in dtm[:3]] if dtm else None}
w.shutdown()
print("RESULT " + json.dumps(out))
"""


def run_one(repo: str, chunks: int, jobs: int) -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TORCHDYNAMO_DISABLE="1")
    p = subprocess.run([sys.executable, "-c", CHILD, repo, os.path.join(HERE, "tests"),
                        str(chunks), str(jobs)], capture_output=True, text=True, env=env,
                       timeout=600)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{repo}: no result\n{p.stderr[-2000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", action="append", help="checkout(s) to import kvcache_core "
                    "from (default: this one); several are run interleaved")
    ap.add_argument("--chunks", type=int, default=256, help="chunks per job (64k tokens)")
    ap.add_argument("--jobs", type=int, default=20, help="timed jobs per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    repos = a.repo or [HERE]
    runs: dict[str, list[dict]] = {r: [] for r in repos}
    for rnd in range(a.rounds):
        for r in repos:
            runs[r].append(run_one(r, a.chunks, a.jobs))
            print(f"round {rnd + 1}/{a.rounds} {r}: load "
                  f"{1e3 * st.median(runs[r][-1]['load_submit_s']):.2f} ms", flush=True)
    rows = []
    for r, rs in runs.items():
        load = st.median(st.median(x["load_submit_s"]) for x in rs)
        store = st.median(st.median(x["store_submit_s"]) for x in rs)
        ph = [x["direct_phases_s"] for x in rs if x["direct_phases_s"]]
        rows.append({"repo": r, "load_submit_ms": 1e3 * load, "store_submit_ms": 1e3 * store,
                     "direct_phases_ms": [1e3 * st.median(p[i] for p in ph) for i in range(3)]
                     if ph else None})
    doc = {"machine": f"{platform.node()} ({os.cpu_count()} cores, CPU)", "chunks": a.chunks,
           "jobs": a.jobs, "rounds": a.rounds, "rows": rows, "raw": runs}
    print(f"{'repo':40} {'load submit ms':>14} {'store submit ms':>15}")
    for row in rows:
        print(f"{row['repo'][-40:]:40} {row['load_submit_ms']:14.2f} "
              f"{row['store_submit_ms']:15.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
