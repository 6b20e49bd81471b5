#!/usr/bin/env python3
"""Does preload reorder the queued mixed workload's documents, and does the order explain
the disk bytes read? An analysis of the GPU runs already on file (no new measurement).

For every configuration of every ``preload-run-mixed-*.json`` given, the requests are put
in the order in which they got their KV (ascending TTFT; all were submitted at once), and
from that order come: the number of switches between the two reused documents among the
reusing requests, and the DRAM-tier chunk hits that ``scripts/sim_dram_policy.py`` gives
that order (``lru-admit``, the tier's default, at ``--tier-chunks``; sequential, so an
upper bound on hits, without joins). The twenty-sixth session read from two runs that
preload interleaves the documents and that this costs 2.5x the disk chunks; this report
checks that across every run on file: the switches per configuration and the correlation
of the simulated hits with the bytes the run really read.

Usage: python scripts/preload_order_report.py RUN.json... [--tier-chunks 207]
       [--doc-chunks 160] [--json OUT] [--md OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sim_dram_policy import simulate  # noqa: E402


def completion_order(row: dict) -> list[int]:
    """Document ids of the requests in the order their first token came (negative: a
    request with nothing to reuse)."""
    return [doc for _, doc in sorted(zip(row["ttft_hit_all"], row["hit_docs"], strict=True))]


def switches(order: list[int]) -> int:
    """Changes of document between consecutive reusing requests."""
    reuse = [d for d in order if d >= 0]
    return sum(1 for a, b in zip(reuse, reuse[1:], strict=False) if a != b)


def pearson(xs: list[float], ys: list[float]) -> float | None:
    """Pearson correlation (:func:`statistics.correlation`); None with fewer than 3
    points or no spread."""
    if len(xs) < 3:
        return None
    try:
        return statistics.correlation(xs, ys)
    except statistics.StatisticsError:  # a constant input
        return None


def analyse(paths: list[str], tier_chunks: int, doc_chunks: int) -> dict:
    rows = []
    for n, path in enumerate(paths, 1):
        print(f"[{n}/{len(paths)}] {os.path.basename(path)}", file=sys.stderr)
        with open(path) as f:
            run = json.load(f)
        for r in run.get("results", []):
            if not r.get("ttft_hit_all") or "hit_docs" not in r:
                continue
            order = completion_order(r)
            reqs = [[(d, c) for c in range(doc_chunks)] for d in order]
            rows.append({
                "run": os.path.basename(path)[: -len(".json")], "config": r["config"],
                "variant": bool(r.get("kv_extra")), "order": order,
                "switches": switches(order),
                "sim_chunks_hit": simulate(reqs, tier_chunks, "lru-admit")["chunks_hit"],
                "disk_read_gb": round(r.get("disk_read_bytes", 0) / 1e9, 2),
                "mean_ttft_reuse_s": round(r["mean_ttft_reuse_s"], 3),
                "machine": run.get("gpu") or run.get("machine", "")})
    summary = []
    for cfg in sorted({r["config"] for r in rows}):
        for variant in (False, True):
            k = [r for r in rows if r["config"] == cfg and r["variant"] == variant]
            if not k:
                continue
            summary.append({
                "config": cfg, "variant": variant, "n": len(k),
                "median_switches": statistics.median(r["switches"] for r in k),
                "median_sim_chunks_hit": statistics.median(r["sim_chunks_hit"] for r in k),
                "median_disk_read_gb": statistics.median(r["disk_read_gb"] for r in k)})
    corr = []
    for variant in (False, True):
        k = [r for r in rows if r["config"] != "native_fs" and r["variant"] == variant]
        c_hits = pearson([r["sim_chunks_hit"] for r in k], [r["disk_read_gb"] for r in k])
        c_sw = pearson([r["switches"] for r in k], [r["mean_ttft_reuse_s"] for r in k])
        corr.append({"variant": variant, "n": len(k),
                     "sim_hits_vs_disk_read": None if c_hits is None else round(c_hits, 2),
                     "switches_vs_reuse_ttft": None if c_sw is None else round(c_sw, 2)})
    return {"tier_chunks": tier_chunks, "doc_chunks": doc_chunks, "rows": rows,
            "summary": summary, "correlation": corr}


def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    """A Markdown table's lines."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(c) for c in r) + " |" for r in rows)]


def markdown(res: dict) -> str:
    yes = {True: "yes", False: "-"}
    out = ["# Preload and the order of the queued mixed workload's documents", "",
           f"`scripts/preload_order_report.py` over the runs on file; DRAM tier "
           f"{res['tier_chunks']} chunks, {res['doc_chunks']} chunks per document; "
           "variant = a run with extra connector keys (`kv_extra`).", ""]
    out += _table(["run", "config", "variant", "switches", "simulated chunk hits",
                   "disk read (GB)", "reusing TTFT (s)"],
                  [[r["run"], r["config"], yes[r["variant"]], r["switches"],
                    r["sim_chunks_hit"], r["disk_read_gb"], r["mean_ttft_reuse_s"]]
                   for r in res["rows"]])
    out += [""] + _table(["config", "variant", "runs", "median switches",
                          "median simulated hits", "median disk read (GB)"],
                         [[s["config"], yes[s["variant"]], s["n"], s["median_switches"],
                           s["median_sim_chunks_hit"], s["median_disk_read_gb"]]
                          for s in res["summary"]])
    out += [""] + _table(["py-kvcache runs", "n", "corr(simulated hits, disk read)",
                          "corr(switches, reusing TTFT)"],
                         [["variants" if c["variant"] else "defaults", c["n"],
                           c["sim_hits_vs_disk_read"], c["switches_vs_reuse_ttft"]]
                          for c in res["correlation"]])
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="preload-run-mixed-*.json files (bench longdoc)")
    ap.add_argument("--tier-chunks", type=int, default=207,
                    help="DRAM tier size in chunks (the runs' tier: 207)")
    ap.add_argument("--doc-chunks", type=int, default=160,
                    help="chunks per document (40k tokens / 256)")
    ap.add_argument("--json", help="write the analysis here")
    ap.add_argument("--md", help="write the tables here")
    a = ap.parse_args()
    res = analyse(a.runs, a.tier_chunks, a.doc_chunks)
    md = markdown(res)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
