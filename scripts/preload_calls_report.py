#!/usr/bin/env python3
"""Report of a queued-workload A/B spread over several device calls: each call ran some
variants of the `preload` step (`SUFFIX=-<variant>[-rN]`, one results file each), and
only numbers of one call compare (the disk moves from call to call).

For every call: the rows of each variant in the order they ran, each kvcache row's mean
TTFT as a ratio to the same call's reference configuration (native_fs) and to the same
configuration of the base variant in that call. Over the calls: per (variant, config)
the median mean TTFT, and the medians of those within-call ratios, with how many calls
gave each. Preload on vs off: where a call ran both ``kvcache_nopreload`` and
``kvcache_preload`` of one variant, the preload row's ``reuse_off_on`` = the reusing
requests' mean TTFT without preload / with it (issue 10's 1.3x bar). Writes OUT.json,
OUT.md and OUT.png (mean TTFT per call and row); with ``--issue-json``, also the rows in
the issue's schema (``preload-<model>.json``: workload, config, tokens, concurrency, the
TTFTs, disk bytes read, peak staging and its budget, plus call and variant).

Usage: python scripts/preload_calls_report.py --dir RES --model llama-3.2-3b
         --call c4=wdrp,base --call c5=base-r2,wdrp-r2 ... --base base --json OUT.json
         [--issue-json preload-<model>.json]
RES holds preload-<model>-<suffix>.json (what `scripts/h200_runs.sh preload` writes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics as st

FIELDS = ("mean_ttft_s", "mean_ttft_reuse_s", "mean_ttft_noreuse_s", "wall_s",
          "disk_read_bytes", "disk_reads_repeat")
#: carried from each results row into the report's rows (the issue's schema)
ISSUE_FIELDS = ("workload", "tokens", "concurrency", "median_ttft_s", "p90_ttft_s",
                "peak_staging_bytes", "staging_budget_bytes")


def variant_of(suffix: str) -> str:
    """``wdrp-r3`` -> ``wdrp`` (the round marker is not part of the variant)."""
    return re.sub(r"-r\d+$", "", suffix)


def collect(res_dir: str, model: str, calls: list[tuple[str, list[str]]]) -> list[dict]:
    """One row per (call, suffix, config) in run order; a missing file is an error."""
    rows = []
    for call, suffixes in calls:
        for suffix in suffixes:
            path = os.path.join(res_dir, f"preload-{model}-{suffix}.json")
            if not os.path.exists(path):
                raise SystemExit(f"preload_calls_report: {path} not found (call {call})")
            with open(path) as fh:
                d = json.load(fh)
            for r in d["results"]:
                row = {"call": call, "suffix": suffix, "variant": variant_of(suffix),
                       "config": r["config"], "disk_read_gbps": d.get("disk_read_gbps")}
                row.update({k: r.get(k) for k in FIELDS + ISSUE_FIELDS})
                rows.append(row)
    return rows


def add_ratios(rows: list[dict], ref: str, base: str) -> None:
    """Within each call: ``vs_ref`` = mean / ref config's mean, ``vs_base`` = mean /
    the base variant's mean for the same config (both None where the call lacks them);
    ``reuse_off_on`` (preload rows) = the same variant's ``kvcache_nopreload`` reusing
    mean / this row's, None where the call lacks it. ``label``: the variant, ``-`` for
    the reference configuration (the same whichever variant's step ran it)."""
    for row in rows:
        row["label"] = "-" if row["config"] == ref else row["variant"]
        same = [r for r in rows if r["call"] == row["call"]]
        refs = [r["mean_ttft_s"] for r in same if r["config"] == ref]
        bases = [r for r in same if r["variant"] == base and r["config"] == row["config"]]
        row["vs_ref"] = (row["mean_ttft_s"] / refs[0]
                         if refs and row["config"] != ref else None)
        row["vs_base"] = (row["mean_ttft_s"] / bases[0]["mean_ttft_s"]
                          if bases and row["variant"] != base else None)
        reuse_b = bases[0]["mean_ttft_reuse_s"] if bases else None
        row["reuse_vs_base"] = (row["mean_ttft_reuse_s"] / reuse_b
                                if reuse_b and row["variant"] != base else None)
        off = [r["mean_ttft_reuse_s"] for r in same if r["variant"] == row["variant"]
               and r["config"] == "kvcache_nopreload" and r["mean_ttft_reuse_s"]]
        row["reuse_off_on"] = (off[0] / row["mean_ttft_reuse_s"]
                               if off and row["config"] == "kvcache_preload"
                               and row["mean_ttft_reuse_s"] else None)


def summarize(rows: list[dict]) -> list[dict]:
    """Per (label, config), in first-run order: medians over the calls."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["label"], r["config"]), []).append(r)
    out = []
    for (label, config), rs in groups.items():
        row = {"variant": label, "config": config, "n_calls": len(rs)}
        for f in ("mean_ttft_s", "mean_ttft_reuse_s", "mean_ttft_noreuse_s",
                  "disk_read_bytes", "vs_ref", "vs_base", "reuse_vs_base",
                  "reuse_off_on"):
            vals = [r[f] for r in rs if r.get(f) is not None]
            row[f"median_{f}"] = st.median(vals) if vals else None
            row[f"n_{f}"] = len(vals)
        out.append(row)
    return out


def fmt(v: float | None, nd: int = 3) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def write_md(path: str, doc: dict) -> None:
    ref, base = doc["ref"], doc["base"]
    lines = [f"# {doc['title']}", "", doc.get("note", ""), "",
             "## Per call (rows in run order)", "",
             f"| call | variant | config | mean TTFT | reusing | no-reuse | disk read (GB) "
             f"| repeat reads | vs {ref} | vs {base} (same config) "
             f"| reusing, preload off/on | probe GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        rd = r["disk_read_bytes"]
        gbps = r["disk_read_gbps"]
        gbps = None if gbps is None or math.isnan(gbps) else gbps  # probe: first only
        lines.append(
            f"| {r['call']} | {r['label']} | {r['config']} "
            f"| {fmt(r['mean_ttft_s'])} | {fmt(r['mean_ttft_reuse_s'])} "
            f"| {fmt(r['mean_ttft_noreuse_s'])} | {fmt(rd / 1e9 if rd else None, 1)} "
            f"| {r['disk_reads_repeat'] if r['disk_reads_repeat'] is not None else '-'} "
            f"| {fmt(r['vs_ref'])} | {fmt(r['vs_base'])} "
            f"| {fmt(r['reuse_off_on'])} | {fmt(gbps, 2)} |")
    lines += ["", "## Over the calls (medians; n = calls with that number)", "",
              f"| variant | config | mean TTFT | reusing | no-reuse | disk read (GB) "
              f"| vs {ref} (n) | vs {base} (n) | reusing vs {base} (n) "
              f"| reusing, preload off/on (n) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for s in doc["summary"]:
        rd = s["median_disk_read_bytes"]
        lines.append(
            f"| {s['variant']} | {s['config']} | {fmt(s['median_mean_ttft_s'])} "
            f"| {fmt(s['median_mean_ttft_reuse_s'])} | {fmt(s['median_mean_ttft_noreuse_s'])} "
            f"| {fmt(rd / 1e9 if rd else None, 1)} "
            f"| {fmt(s['median_vs_ref'])} ({s['n_vs_ref']}) "
            f"| {fmt(s['median_vs_base'])} ({s['n_vs_base']}) "
            f"| {fmt(s['median_reuse_vs_base'])} ({s['n_reuse_vs_base']}) "
            f"| {fmt(s['median_reuse_off_on'])} ({s['n_reuse_off_on']}) |")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


def issue_rows(doc: dict, model: str) -> dict:
    """The report's rows in issue 10's ``preload-<model>.json`` schema, one per
    (call, step, config) in run order; ``call`` and ``variant`` say which compare."""
    keep = ("workload", "config", "tokens", "concurrency", "mean_ttft_s", "median_ttft_s",
            "p90_ttft_s", "mean_ttft_reuse_s", "mean_ttft_noreuse_s", "disk_read_bytes",
            "peak_staging_bytes", "staging_budget_bytes", "disk_reads_repeat", "vs_ref",
            "reuse_off_on")
    return {"machine": doc["machine"], "model": model, "note": doc["note"],
            "results": [{"call": r["call"], "variant": r["label"],
                         **{k: r.get(k) for k in keep}} for r in doc["rows"]]}


def write_png(path: str, doc: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    labels = sorted({(r["label"], r["config"]) for r in rows})
    calls = list(dict.fromkeys(r["call"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(calls)), 4))
    width = 0.8 / max(1, len(labels))
    for i, lab in enumerate(labels):
        xs, ys = [], []
        for j, c in enumerate(calls):
            for r in rows:
                if r["call"] == c and (r["label"], r["config"]) == lab:
                    xs.append(j + i * width)
                    ys.append(r["mean_ttft_s"])
        ax.bar(xs, ys, width, label=f"{lab[1]} ({lab[0]})" if lab[0] != "-" else lab[1])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(calls))], calls)
    ax.set_ylabel("mean TTFT (s)")
    ax.set_title(doc["title"], fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="folder with preload-<model>-<suffix>.json")
    ap.add_argument("--model", required=True)
    ap.add_argument("--call", action="append", required=True,
                    help="NAME=SUFFIX[,SUFFIX...]: one device call's results in run order")
    ap.add_argument("--ref", default="native_fs", help="reference configuration")
    ap.add_argument("--base", default="base", help="variant the others are compared to")
    ap.add_argument("--json", required=True, help="OUT.json (OUT.md and OUT.png beside it)")
    ap.add_argument("--machine", default="GPU machine")
    ap.add_argument("--note", default="")
    ap.add_argument("--issue-json", help="also write the rows in issue 10's schema here")
    ap.add_argument("--issue-model", help="model named in --issue-json (default --model)")
    a = ap.parse_args()
    calls = []
    for c in a.call:
        name, sep, rest = c.partition("=")
        if not sep or not rest:
            ap.error(f"--call {c!r}: want NAME=SUFFIX[,SUFFIX...]")
        calls.append((name, rest.split(",")))
    rows = collect(a.dir, a.model, calls)
    add_ratios(rows, a.ref, a.base)
    doc = {"title": f"Queued preload A/B over {len(calls)} calls: {a.model}, {a.machine}",
           "model": a.model, "machine": a.machine, "ref": a.ref, "base": a.base,
           "note": a.note, "calls": [{"call": n, "suffixes": s} for n, s in calls],
           "rows": rows, "summary": summarize(rows)}
    stem = a.json[:-5] if a.json.endswith(".json") else a.json
    with open(stem + ".json", "w") as fh:
        json.dump(doc, fh, indent=1)
    write_md(stem + ".md", doc)
    write_png(stem + ".png", doc)
    if a.issue_json:
        with open(a.issue_json, "w") as fh:
            json.dump(issue_rows(doc, a.issue_model or a.model), fh, indent=1)
    print(open(stem + ".md").read())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
