"""Break-even gate report: ``gate-<model>.json`` + table, and the paper's Fig. 6/7 plots.

Input: a long-document run (:mod:`kvcache_core.bench.longdoc`) holding the configurations
``recompute``, ``kvcache_dram`` / ``kvcache_disk`` (gate off) and ``kvcache_dram_gate`` /
``kvcache_disk_gate`` (gate on, same run, same table).

Output (``write_gate``)::

    {"machine", "model", "table": {...the table used...},
     "results": [{"config": "recompute"|"gate_off"|"gate_on", "source": "dram"|"disk",
                  "tokens", "ttft_s"}], "checks": [...]}

``checks``: per source and size, gate_on / min(recompute, gate_off) against the 1.05 bound;
for the disk source, recompute is ``recompute_cold`` (first access in a fresh process after
dropping the page cache, like the disk rows) when the run has it.

Plots (``plot_boundary``, ``plot_bandwidth``), from the measured ratio-1 curves only:

* Pareto boundary. A request of D tokens whose first r*D tokens are cached in tier T costs
  ``load_T(rD) + R(D) - R(rD)`` (load the prefix, compute the rest: causal prefill cost is
  additive, so computing tokens rD..D after the prefix costs R(D) - R(rD)) against R(D)
  for recompute; R and load_T are the measured recompute and hit TTFT curves, interpolated
  log-log. Shaded by predicted speed-up; the contour is the break-even line.
* Bandwidth to break even: the storage bandwidth B with ``bytes(D)/B + bytes(D)/pcie =
  R(D)``, against the measured disk and DRAM-hit bandwidths.

Run as ``python -m kvcache_core.bench.gate_report RUN.json --table T.json --out G.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from typing import Any

from .common import save_loglog

GATE_CFG = {("gate_off", "dram"): "kvcache_dram", ("gate_off", "disk"): "kvcache_disk",
            ("gate_on", "dram"): "kvcache_dram_gate", ("gate_on", "disk"): "kvcache_disk_gate"}
BOUND = 1.05


COLD_CONFIGS = ("kvcache_disk", "kvcache_disk_gate", "recompute_cold")


def _hit(r: dict) -> float:
    """Disk configurations run their load phase in a fresh process with the page cache
    dropped: the first access of each document is the one read from disk."""
    if r["config"] in COLD_CONFIGS and r.get("ttft_first_hit_s") is not None:
        return float(r["ttft_first_hit_s"])
    return float(r["ttft_hit_s"])


def _rows(run: dict) -> list[dict]:
    return [r for r in run.get("results", []) if "ttft_hit_s" in r]


def recompute_curve(run: dict) -> dict[int, float]:
    """Median recompute TTFT per size (cold and repeats: all are full prefills)."""
    out = {}
    for r in _rows(run):
        if r["config"] == "recompute":
            out[r["tokens"]] = statistics.median(r["ttft_cold_all"] + r["ttft_hit_all"])
    return out


def gate_rows(run: dict) -> list[dict]:
    rec = recompute_curve(run)
    res: list[dict] = [{"config": "recompute", "tokens": d, "ttft_s": t}
                       for d, t in sorted(rec.items())]
    # recompute measured like the disk rows (fresh process, page cache dropped): their
    # like-for-like baseline when the run has it
    res += [{"config": "recompute", "source": "disk", "tokens": r["tokens"], "ttft_s": _hit(r)}
            for r in _rows(run) if r["config"] == "recompute_cold"]
    for (cfg, src), name in GATE_CFG.items():
        for r in _rows(run):
            if r["config"] == name:
                res.append({"config": cfg, "source": src, "tokens": r["tokens"],
                            "ttft_s": _hit(r)})
    return res


def checks(rows: list[dict]) -> list[dict]:
    rec = {r["tokens"]: r["ttft_s"] for r in rows
           if r["config"] == "recompute" and r.get("source") is None}
    by = {(r["config"], r.get("source"), r["tokens"]): r["ttft_s"] for r in rows}
    out = []
    for src in ("dram", "disk"):
        for d in sorted(rec):
            on, off = by.get(("gate_on", src, d)), by.get(("gate_off", src, d))
            if on is None or off is None:
                continue
            best = min(by.get(("recompute", src, d), rec[d]), off)
            out.append({"source": src, "tokens": d, "gate_on_s": on, "best_s": best,
                        "ratio": on / best, "ok": on <= BOUND * best})
    return out


def write_gate(run: dict, table_path: str, out_path: str) -> dict:
    with open(table_path) as f:
        table = json.load(f)
    rows = gate_rows(run)
    chk = checks(rows)
    out = {"machine": run.get("machine"), "model": run.get("model"), "table": table,
           "results": rows, "checks": chk, "bound": BOUND}
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
    th = {t: v.get("min_prefix_tokens") for t, v in table.get("tiers", {}).items()}
    lines = [f"# Break-even gate: {run.get('model')} on {run.get('machine')}", "",
             f"Table: min prefix tokens {th} (fitted in the same run). TTFT medians in "
             "seconds; ratio = gate_on / min(recompute, gate_off); bound 1.05. Disk rows "
             "use recompute measured like them (fresh process, page cache dropped: "
             "`recompute_cold`) when the run has it.", "",
             "| source | tokens | recompute | gate off | gate on | ratio | ok |",
             "|---|---|---|---|---|---|---|"]
    rec = {r["tokens"]: r["ttft_s"] for r in rows
           if r["config"] == "recompute" and r.get("source") is None}
    by = {(r["config"], r.get("source"), r["tokens"]): r["ttft_s"] for r in rows}
    for c in chk:
        d, s = c["tokens"], c["source"]
        r0 = by.get(("recompute", s, d), rec[d])
        lines.append(f"| {s} | {d} | {r0:.3f} | {by[('gate_off', s, d)]:.3f} | "
                     f"{c['gate_on_s']:.3f} | {c['ratio']:.2f} | {'yes' if c['ok'] else 'NO'} |")
    base = os.path.splitext(out_path)[0]
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        plot_boundary(run, base + "-boundary.png")
        plot_bandwidth(run, base + "-bandwidth.png")
    except Exception as e:  # matplotlib missing, too few points
        print(f"gate_report: no plots: {e}", file=sys.stderr)
    return out


# ------------------------------------------------------------------ model + plots
def _interp_loglog(pts: dict[int, float], x: float) -> float:
    """Piecewise log-log interpolation (linear extrapolation in log-log at the ends)."""
    xs = sorted(pts)
    if x <= 0:
        return 0.0
    if len(xs) == 1:
        return pts[xs[0]] * x / xs[0]
    lx = math.log(x)
    i = 1
    while i < len(xs) - 1 and xs[i] < x:
        i += 1
    x0, x1 = xs[i - 1], xs[i]
    y0, y1 = math.log(pts[x0]), math.log(pts[x1])
    t = (lx - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(y0 + t * (y1 - y0))


def load_curve(run: dict, tier: str) -> dict[int, float]:
    cfg = "kvcache_dram" if tier == "dram" else "kvcache_disk"
    return {r["tokens"]: _hit(r) for r in _rows(run) if r["config"] == cfg}


def predicted_speedup(rec: dict[int, float], load: dict[int, float], d: float,
                      ratio: float) -> float:
    """R(D) / (load(rD) + R(D) - R(rD)) (see module doc)."""
    p = ratio * d
    hit = (_interp_loglog(load, p) if p >= 1 else 0.0) + _interp_loglog(rec, d) \
        - (_interp_loglog(rec, p) if p >= 1 else 0.0)
    return _interp_loglog(rec, d) / max(hit, 1e-9)


def plot_boundary(run: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    rec = recompute_curve(run)
    tiers = [t for t in ("dram", "disk") if len(load_curve(run, t)) >= 2]
    if len(rec) < 2 or not tiers:
        raise ValueError("need recompute and at least one tier at >= 2 sizes")
    ds = np.geomspace(min(rec), max(rec), 60)
    rs = np.linspace(0.02, 1.0, 50)
    fig, axes = plt.subplots(1, len(tiers), figsize=(6 * len(tiers), 4.5), squeeze=False)
    for ax, tier in zip(axes[0], tiers, strict=True):
        load = load_curve(run, tier)
        z = np.array([[math.log2(predicted_speedup(rec, load, d, r)) for d in ds] for r in rs])
        lim = max(0.1, float(np.abs(z).max()))
        m = ax.pcolormesh(ds, rs, z, cmap="RdBu", norm=TwoSlopeNorm(0.0, -lim, lim),
                          shading="auto")
        ax.contour(ds, rs, z, levels=[0.0], colors="k", linewidths=1.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("document tokens")
        ax.set_ylabel("reusable prefix ratio")
        ax.set_title(f"{tier}: predicted speed-up vs recompute (log2)")
        fig.colorbar(m, ax=ax, label="log2(recompute / hit)")
    fig.suptitle(f"{run.get('model')} on {run.get('machine')}: break-even boundary (black), "
                 "blue = loading wins")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bandwidth(run: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rec = recompute_curve(run)
    kvb = run["kv_bytes_per_token"]
    pcie = run["pcie_h2d_gbps"] * 1e9
    pts = []
    for d, t in sorted(rec.items()):
        b = d * kvb
        slack = t - b / pcie
        pts.append((d, b / slack / 1e9 if slack > 0 else float("inf")))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o",
            label="storage bandwidth needed to break even")
    ax.axhline(run["disk_read_gbps"], color="tab:red", ls="--",
               label=f"disk read (measured) {run['disk_read_gbps']:.2f} GB/s")
    dram = load_curve(run, "dram")
    if dram:
        eff = statistics.median(d * kvb / t / 1e9 for d, t in dram.items() if d >= 4096) \
            if any(d >= 4096 for d in dram) else None
        if eff:
            ax.axhline(eff, color="tab:green", ls="--",
                       label=f"DRAM tier, effective (hit bytes / hit TTFT) {eff:.1f} GB/s")
    save_loglog(fig, ax, "GB/s", f"{run.get('model')} on {run.get('machine')}", path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="long-document run JSON with gate_on and gate_off configs")
    ap.add_argument("--table", required=True, help="the break-even table the run used")
    ap.add_argument("--out", required=True, help="gate-<model>.json to write")
    a = ap.parse_args(argv)
    with open(a.run) as f:
        run: dict[str, Any] = json.load(f)
    out = write_gate(run, a.table, a.out)
    bad = [c for c in out["checks"] if not c["ok"]]
    print(f"{len(out['checks'])} checks, {len(bad)} above the {BOUND}x bound")
    return 0


if __name__ == "__main__":
    sys.exit(main())
