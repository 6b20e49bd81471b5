#!/usr/bin/env python3
"""Report of ``scripts/h200_runs.sh dcab`` calls: how a DRAM hit is copied (dram_load_copy).

Each ``--call LABEL=PATH`` is one device call's result: the step's ``dcab-<model>.json``
(one longdoc run with ``--rounds``: configurations ``kvcache_dram_<arm>`` and
``native_cpu``, every round's rows in ``round_results``), or, for the nineteenth session's
calls, the result directory with ``dcab-<arm>-r<round>/longdoc-<model>.json`` inside (arm:
dma, kernel, auto or native_cpu).
Writes one JSON (every hit of every arm, plus per call, arm and size the median hit TTFT
and the worker's DRAM-hit timing), a Markdown table and a PNG (each hit's TTFT, arms side
by side, per call and size). ``--void LABEL:ARM=REASON`` keeps an arm's rows but marks
them void (left out of the summary and the plot), e.g. a run whose copy was broken.

    python scripts/dcab_report.py --call c9=/tmp/s19c9/res --call c13=/tmp/s19c13/res \\
        --void "c9:kernel=grid of 0 programs" --json OUT.json --md OUT.md --png OUT.png
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics as st
import sys

ARM_ORDER = ("dma", "kernel", "auto", "native_cpu")


def _arm(config: str) -> str:
    """The arm of a configuration of the one-run format: ``kvcache_dram_<arm>`` or a
    built-in configuration's name."""
    return config[len("kvcache_dram_"):] if config.startswith("kvcache_dram_") else config


def _runs(d: str) -> list[tuple[str | None, int | None, dict]]:
    """(arm, round, result row) of one call: ``d`` a result JSON of the one-run format
    (arm and round from each row) or a directory of per-arm runs (from the names)."""
    if os.path.isfile(d):
        with open(d) as f:
            doc = json.load(f)
        return [(None, None, r) for r in doc.get("round_results") or doc.get("results", [])
                if "error" not in r]
    out = []
    for path in sorted(glob.glob(os.path.join(d, "dcab-*-r*", "longdoc-*.json"))):
        m = re.match(r"dcab-(.+)-r(\d+)$", os.path.basename(os.path.dirname(path)))
        if m is None:
            continue
        with open(path) as f:
            doc = json.load(f)
        out += [(m.group(1), int(m.group(2)), r) for r in doc.get("results", [])
                if "error" not in r]
    return out


def load(calls: list[tuple[str, str]], void: dict[tuple[str, str], str]) -> list[dict]:
    """One row per (call, arm, round, tokens) with every hit TTFT."""
    rows = []
    for label, d in calls:
        for arm, rnd, r in _runs(d):
            arm = arm or _arm(r["config"])
            rnd = rnd or r.get("round") or 1
            t = ((r.get("worker_stats") or {}).get("timing_load_phase") or [{}])[0]
            rows.append({
                "call": label, "arm": arm, "round": rnd, "config": r["config"],
                "tokens": r["tokens"], "ttft_hit_all": r["ttft_hit_all"],
                "ttft_hit_s": r["ttft_hit_s"], "ttft_cold_s": r["ttft_cold_s"],
                "direct_kernel_jobs": t.get("direct_kernel_jobs"),
                "direct_issue_max_s": t.get("direct_issue_max_s"),
                "load_job_latency_max_s": t.get("load_job_latency_max_s"),
                "void": void.get((label, arm))})
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per call, arm and size: the median of all hits over the arm's rounds."""
    out = []
    keys = sorted({(r["call"], r["arm"], r["tokens"]) for r in rows if not r["void"]},
                  key=lambda k: (k[0], k[2], ARM_ORDER.index(k[1])
                                 if k[1] in ARM_ORDER else 99))
    for call, arm, tok in keys:
        sel = [r for r in rows if (r["call"], r["arm"], r["tokens"]) == (call, arm, tok)
               and not r["void"]]
        hits = [x for r in sel for x in r["ttft_hit_all"]]
        issue = [r["direct_issue_max_s"] for r in sel if r["direct_issue_max_s"] is not None]
        out.append({"call": call, "arm": arm, "tokens": tok, "rounds": len(sel),
                    "hits": len(hits), "median_hit_s": st.median(hits),
                    "max_hit_s": max(hits), "min_hit_s": min(hits),
                    "direct_issue_max_s": max(issue) if issue else None})
    return out


def markdown(rows: list[dict], summary: list[dict], note: str) -> str:
    lines = ["# DRAM-hit copy A/B (`dram_load_copy`): llama-3.2-3b on H200", ""]
    if note:
        lines += [note, ""]
    lines += ["Median of every hit of the arm's rounds (back to back: each document's hits in",
              "random order) and the longest time vLLM's engine thread spent issuing one",
              "DRAM-hit copy.", "",
              "| call | tokens | arm | rounds | median hit (s) | min - max (s) "
              "| longest issue (ms) |",
              "|---|---|---|---|---|---|---|"]
    for s in summary:
        iss = ("-" if s["direct_issue_max_s"] is None
               else f"{s['direct_issue_max_s'] * 1e3:.1f}")
        lines.append(f"| {s['call']} | {s['tokens']} | {s['arm']} | {s['rounds']} | "
                     f"{s['median_hit_s']:.3f} | {s['min_hit_s']:.3f} - {s['max_hit_s']:.3f} "
                     f"| {iss} |")
    lines += ["", "Every round's hits, in order:", "",
              "| call | arm | round | tokens | hits (s) | kernel jobs | void |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        hits = " ".join(f"{x:.3f}" for x in r["ttft_hit_all"])
        kj = "-" if r["direct_kernel_jobs"] is None else r["direct_kernel_jobs"]
        lines.append(f"| {r['call']} | {r['arm']} | {r['round']} | {r['tokens']} | {hits} "
                     f"| {kj} | {r['void'] or ''} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in rows if not r["void"]]
    panels = sorted({(r["call"], r["tokens"]) for r in good})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (call, tok) in zip(axes[0], panels, strict=True):
        sel = [r for r in good if (r["call"], r["tokens"]) == (call, tok)]
        sel.sort(key=lambda r: (ARM_ORDER.index(r["arm"]) if r["arm"] in ARM_ORDER else 99,
                                r["round"]))
        for i, r in enumerate(sel):
            xs = [i + 0.15 * (j - 1.5) for j in range(len(r["ttft_hit_all"]))]
            ax.bar(xs, r["ttft_hit_all"], width=0.14, color=f"C{ARM_ORDER.index(r['arm'])}"
                   if r["arm"] in ARM_ORDER else "gray")
        ax.set_xticks(range(len(sel)))
        ax.set_xticklabels([f"{r['arm']}\nr{r['round']}" for r in sel], fontsize=8)
        ax.set_title(f"{call}, {tok // 1024}k tokens", fontsize=9)
        ax.set_ylabel("hit TTFT (s), hits 1-4")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--call", action="append", required=True, metavar="LABEL=DIR")
    ap.add_argument("--void", action="append", default=[], metavar="LABEL:ARM=REASON")
    ap.add_argument("--note", default="")
    ap.add_argument("--json", required=True)
    ap.add_argument("--md", required=True)
    ap.add_argument("--png")
    a = ap.parse_args()
    calls = [tuple(c.split("=", 1)) for c in a.call]
    void = {}
    for v in a.void:
        k, reason = v.split("=", 1)
        label, arm = k.split(":", 1)
        void[(label, arm)] = reason
    rows = load(calls, void)  # type: ignore[arg-type]
    if not rows:
        print("no dcab results found", file=sys.stderr)
        return 1
    summary = summarize(rows)
    with open(a.json, "w") as f:
        json.dump({"model": "llama-3.2-3b", "machine": "H200 (GPU machine)", "note": a.note,
                   "summary": summary, "rows": rows}, f, indent=1)
    with open(a.md, "w") as f:
        f.write(markdown(rows, summary, a.note))
    if a.png:
        plot(rows, a.png)
    print(markdown(rows, summary, a.note))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
