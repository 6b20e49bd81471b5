#!/usr/bin/env python3
"""Report of an A/B made with scripts/h200_ab.sh: per configuration, document size and
metric (cold, hit, first hit TTFT) the median over the rounds of each commit, the ratio
after/before, geometric means of the ratios, and the spread between rounds of one commit
(max/min), which says how much of a difference the run can resolve.

Usage: python scripts/ab_report.py AB_DIR --json OUT.json [--before C] [--after C]
                                   [--note TEXT]
AB_DIR holds <before|after>-r<round>/longdoc-<model>.json (the archive's ``ab/``).
Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics as st

METRICS = ("ttft_cold_s", "ttft_hit_s", "ttft_first_hit_s")


def collect(ab_dir: str) -> tuple[list[dict], str]:
    """Rows {config, tokens, metric, before{round: s}, after{round: s}} and the model."""
    rows: dict[tuple, dict] = {}
    model = "?"
    for f in sorted(glob.glob(os.path.join(ab_dir, "*-r*", "longdoc-*.json"))):
        side, rnd = os.path.basename(os.path.dirname(f)).split("-", 1)
        with open(f) as fh:
            d = json.load(fh)
        model = d.get("model", model)
        for r in d["results"]:
            for m in METRICS:
                if r.get(m) is None:
                    continue
                row = rows.setdefault((r["config"], r["tokens"], m),
                                      {"before": {}, "after": {}})
                row[side][rnd] = r[m]
    out = []
    for (c, t, m), v in sorted(rows.items()):
        if not v["before"] or not v["after"]:
            continue
        mb, ma = st.median(v["before"].values()), st.median(v["after"].values())
        out.append({"config": c, "tokens": t, "metric": m, "before": v["before"],
                    "after": v["after"], "median_before_s": mb, "median_after_s": ma,
                    "ratio_after_before": ma / mb})
    return out, model


def geomean(rows: list[dict]) -> float | None:
    if not rows:
        return None
    return math.exp(sum(math.log(r["ratio_after_before"]) for r in rows) / len(rows))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ab_dir")
    ap.add_argument("--json", required=True)
    ap.add_argument("--before", default="before")
    ap.add_argument("--after", default="after")
    ap.add_argument("--note", default="")
    ap.add_argument("--machine", default="H200 (GPU machine)")
    a = ap.parse_args()
    res, model = collect(a.ab_dir)
    if not res:
        raise SystemExit(f"no before/after pairs under {a.ab_dir}")
    summ: dict[str, float | None] = {"all": geomean(res)}
    for c in sorted({r["config"] for r in res}):
        summ[f"{c}_hits"] = geomean([r for r in res if r["config"] == c
                                     and r["metric"] != "ttft_cold_s"])
        summ[f"{c}_cold"] = geomean([r for r in res if r["config"] == c
                                     and r["metric"] == "ttft_cold_s"])
    spread = {s: st.median(max(r[s].values()) / min(r[s].values()) for r in res)
              for s in ("before", "after")}
    out = {"machine": a.machine, "model": model, "benchmark": "longdoc (scripts/h200_ab.sh)",
           "before_commit": a.before, "after_commit": a.after, "note": a.note,
           "geomean_ratio_after_before": summ,
           "median_within_commit_spread_max_over_min": spread, "results": res}
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    j = lambda d: ", ".join(f"{d[k]:.3f}" for k in sorted(d))  # noqa: E731
    lines = [f"# A/B on the {a.machine}: longdoc before ({a.before}) vs after ({a.after}), "
             f"{model}", "", a.note, "",
             "Median TTFT over the rounds (s); ratio = after / before; rounds listed in "
             "order r1, r2, ...", "",
             "| config | tokens | metric | before (n) | after (n) | after/before | "
             "before rounds | after rounds |", "|---|---|---|---|---|---|---|---|"]
    for r in res:
        lines.append(f"| {r['config']} | {r['tokens']} | {r['metric'][5:-2]} | "
                     f"{r['median_before_s']:.4f} ({len(r['before'])}) | "
                     f"{r['median_after_s']:.4f} ({len(r['after'])}) | "
                     f"{r['ratio_after_before']:.3f} | {j(r['before'])} | {j(r['after'])} |")
    lines += ["", "Geometric means of after/before: " + ", ".join(
        f"{k} {v:.3f}" for k, v in summ.items() if v is not None) + ".", "",
        f"Spread between rounds of the SAME commit (max/min per row, median over rows): "
        f"before {spread['before']:.2f}x, after {spread['after']:.2f}x.", ""]
    with open(os.path.splitext(a.json)[0] + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[-4:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
