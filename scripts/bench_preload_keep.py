#!/usr/bin/env python3
"""``preload_keep_s`` on the CPU machine: the SCBench-like workload with 30 s and with the
default 0 (any preload may evict an unclaimed staged one, as before the forty-third
session), rounds interleaved, each run its own engine process.

The workload is ``kvcache_core.bench.longdoc --workload scbench`` at CPU scale (the tests'
tiny dummy-weight Llama, 4 contexts x 3,072 tokens, 4 rounds, 4 turns in flight, a staging
pool of 12 files with io_depth 4, the DRAM tier of 1.3 contexts the workload sets). On
this machine the model's compute, not the disk, bounds the turns, so the point is the
counters (preloads staged, claimed, wasted, dropped; blocks read), not the TTFT.

Usage: python scripts/bench_preload_keep.py [--rounds 3] [--workdir /tmp/kvcache-keep]
         [--json docs/results/cpu/preload-keep-s43.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from kvcache_core.bench.common import write_json_md  # noqa: E402

ARMS = {"keep30": ["--kv-extra", "preload_keep_s=30"], "keep0": []}
COUNTERS = ("preloads_planned", "preloads_staged", "preloads_claimed", "preloads_wasted",
            "preloads_dropped_full", "disk_reads_repeat", "loads_disk", "loads_dram")


def tiny_model(path: str) -> str:
    """The tests' tiny Llama (config + dummy weights), written once."""
    if not os.path.exists(os.path.join(path, "config.json")):
        spec = importlib.util.spec_from_file_location(
            "e2e_helpers", os.path.join(REPO, "tests", "e2e", "helpers.py"))
        mod = importlib.util.module_from_spec(spec)
        assert spec.loader is not None
        spec.loader.exec_module(mod)
        mod.write_model(path)
    return path


def one_run(model: str, workdir: str, arm: str, rnd: int) -> dict:
    root = os.path.join(workdir, "root")
    shutil.rmtree(root, ignore_errors=True)
    out = os.path.join(workdir, f"{arm}-{rnd}.json")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=REPO)
    cmd = [sys.executable, "-m", "kvcache_core.bench.longdoc", "--model", model,
           "--root", root, "--json", out, "--staging-bytes", str(12 * 266240),
           "--io-depth", "4", "--no-probe", "--workload", "scbench", "--tokens", "3072",
           "--docs", "4", "--repeats", "4", "--concurrency", "4",
           "--configs", "kvcache_preload", "--timeout", "600", *ARMS[arm]]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=900)
    if p.returncode != 0 or not os.path.exists(out):
        raise SystemExit(f"bench_preload_keep: {arm} round {rnd} failed:\n{p.stderr[-2000:]}")
    with open(out) as f:
        row = json.load(f)["results"][0]
    if "error" in row:
        raise SystemExit(f"bench_preload_keep: {arm} round {rnd}: {row['error']}")
    ss = row.get("scheduler_stats") or {}
    return {"mean_ttft_s": row["mean_ttft_s"], "disk_read_bytes": row["disk_read_bytes"],
            **{k: ss.get(k, 0) for k in COUNTERS}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/kvcache-keep")
    ap.add_argument("--json", default=os.path.join(REPO, "docs", "results", "cpu",
                                                   "preload-keep-s43.json"))
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    model = tiny_model(os.path.join(a.workdir, "tiny"))
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for rnd in range(1, a.rounds + 1):
        order = list(ARMS) if rnd % 2 else list(ARMS)[::-1]
        for arm in order:
            print(f"[bench preload-keep] round {rnd}/{a.rounds} {arm}", file=sys.stderr,
                  flush=True)
            runs[arm].append(one_run(model, a.workdir, arm, rnd))
    med = {arm: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for arm, rs in runs.items()}
    out = {"benchmark": "preload-keep", "machine": platform.node(), "cores": os.cpu_count(),
           "rounds": a.rounds, "medians": med, "runs": runs}
    lines = [f"# `preload_keep_s` 30 vs 0 (the default), SCBench-like at CPU scale "
             f"({out['machine']}, {out['cores']} cores)", "",
             "4 contexts x 3,072 tokens, 4 rounds, 4 turns in flight, tiny dummy-weight "
             "Llama on vLLM's CPU platform, staging 12 files (io_depth 4), DRAM tier 1.3 "
             f"contexts; {a.rounds} rounds per arm, interleaved, medians (per-run values in "
             "the JSON). The model's compute bounds the turns here: read the counters, not "
             "the TTFT. Produced by `python scripts/bench_preload_keep.py`.", "",
             "| arm | mean TTFT (s) | disk read (MB) | "
             + " | ".join(COUNTERS) + " |", "|---|---|---|" + "---|" * len(COUNTERS)]
    for arm in ARMS:
        m = med[arm]
        lines.append(f"| {arm} | {m['mean_ttft_s']:.3f} | {m['disk_read_bytes'] / 1e6:.1f} | "
                     + " | ".join(f"{m[k]:g}" for k in COUNTERS) + " |")
    write_json_md(a.json, out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
