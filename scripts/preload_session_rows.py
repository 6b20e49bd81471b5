#!/usr/bin/env python3
"""One session's issue-10 rows from the run files of its device calls.

Each device call of ``scripts/h200_call.sh`` with the ``preload``, ``preload50`` or
``mixed`` step leaves one run file (``preload-run-<model><suffix>.json``,
``preload50-run-<model>-<tokens><suffix>.json``, ``mixed-run-<model><suffix>.json``)
with every configuration of that call. Only rows of one call compare (the disk moves
from call to call), so every ratio here is within one call:

- ``vs_native_fs_same_call``: mean TTFT / the same call's ``native_fs`` at the same
  tokens (absent where the call had no native_fs);
- ``reuse_off_on`` and ``noreuse_on_off`` on a ``kvcache_preload`` row whose call also
  ran ``kvcache_nopreload`` with the same ``kv_extra``: the reusing requests' mean TTFT
  without preload / with it (issue 10's 1.3x bar) and the no-reuse requests' mean TTFT
  with preload / without it (issue 10's <= 1.03 bar);
- ``disk_read_vs_native_fs_same_call``: disk bytes read / the same call's native_fs's
  (where native_fs has a byte count: the SCBench-like workload's 1/10 bar);
- ``vs_defaults_same_call`` and ``noreuse_vs_defaults_same_call`` on a variant's row:
  its mean TTFT (and its no-reuse requests') / the same call's arm of the same
  configuration with the defaults (e.g. ``disk_load_hold_s=0`` against the default).

``summary`` (also printed, and written as a Markdown table with ``--md``): per workload,
tokens and arm, the median over the calls that ran it of each TTFT, of the disk bytes and
of each ratio above (with the number of calls that gave it), and ``noreuse_by_position``
as the median TTFT of each position over those calls. Medians of within-call ratios,
never ratios of medians across calls.

Every row keeps the issue's schema fields (workload, config, tokens, concurrency, the
TTFTs, disk bytes read, peak staging and its budget), plus ``call``, ``arm`` (the
configuration name as run, e.g. a ``--variant`` name), ``variant`` (its ``kv_extra`` as
``key=value`` words, ``defaults`` without), ``distinct_kv_bytes`` (one document's KV x
documents), a subset of the scheduler's counters and, where the run file lists each
request's document (``hit_docs``, negative = nothing to reuse), ``noreuse_by_position``:
``[submission position, TTFT]`` of each request with nothing to reuse, and
``reuse_served_before``: ``[submission position, n]``, n the requests with something to
reuse submitted before it whose first token came before its own (FCFS served them first:
the part of a no-reuse request's delay with preload that is queue order, not overhead).
A row that failed keeps only ``call``, ``arm`` and ``error``. Prints one line per row.

Usage: python scripts/preload_session_rows.py --out preload-<model>-sNN-<card>.json
         [--md preload-<model>-sNN-<card>.md] --card h100 --note "..."
         c1=RUN.json [c2=RUN.json[@workload] ...]
``@workload`` overrides the workload the file name implies (``preload50`` -> longdoc,
``preload-run`` / ``mixed-run`` -> mixed, ``scbench-run`` -> scbench).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict

#: scheduler counters worth carrying into the session rows
SCHED_KEYS = ("lookup_us", "lookup_max_us", "disk_checks", "disk_check_us",
              "lookups_skipped", "lookups_yielded", "loads_held", "loads_hold_joined",
              "dram_queue_refused", "warm_us", "warm_files", "preloads_staged",
              "preloads_claimed")
#: fields copied from each run row
ROW_KEYS = ("tokens", "concurrency", "mean_ttft_s", "median_ttft_s", "p90_ttft_s",
            "mean_ttft_noreuse_s", "mean_ttft_reuse_s", "wall_s", "peak_staging_bytes",
            "staging_budget_bytes", "disk_read_bytes", "n_requests", "n_noreuse",
            "tree_read_bytes", "page_cache_growth_bytes", "disk_reads_repeat")
#: within-call ratios a row may carry, summarized as medians over calls
RATIO_KEYS = ("vs_native_fs_same_call", "disk_read_vs_native_fs_same_call", "reuse_off_on",
              "noreuse_on_off", "vs_defaults_same_call", "noreuse_vs_defaults_same_call")
#: per-row values summarized as medians over calls
MEDIAN_KEYS = ("mean_ttft_s", "mean_ttft_reuse_s", "mean_ttft_noreuse_s", "disk_read_bytes")
WORKLOAD_BY_PREFIX = (("preload50", "longdoc"), ("preload-run", "mixed"),
                      ("mixed-run", "mixed"), ("scbench-run", "scbench"))


def workload_of(path: str) -> str:
    """The workload a run file's name implies; ValueError when it implies none."""
    name = os.path.basename(path)
    for prefix, wl in WORKLOAD_BY_PREFIX:
        if name.startswith(prefix):
            return wl
    raise ValueError(f"{path}: cannot tell the workload from the file name; "
                     "append @longdoc, @mixed or @scbench")


def _variant(extra: dict | None) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted((extra or {}).items())) or "defaults"


def call_rows(call: str, doc: dict, workload: str) -> list[dict]:
    """The rows of one call's run file ``doc`` with their same-call ratios."""
    rows: list[dict] = []
    for r in doc["results"]:
        if "error" in r:
            rows.append({"call": call, "arm": r.get("config"), "error": r["error"]})
            continue
        config = r.get("base", r["config"])
        row = {"call": call, "workload": workload, "config": config, "arm": r["config"],
               "variant": "-" if config == "native_fs" else _variant(r.get("kv_extra")),
               **{k: r.get(k) for k in ROW_KEYS},
               "distinct_kv_bytes": r["kv_bytes"] * r["docs"]}
        hd, tt = r.get("hit_docs"), r.get("ttft_hit_all")
        if hd and tt and len(hd) == len(tt) and any(h < 0 for h in hd):
            # the requests with nothing to reuse, by submission position: which of them
            # a configuration moved (the mixed workload's fresh requests are negative)
            row["noreuse_by_position"] = [
                [i, t] for i, (t, h) in enumerate(zip(tt, hd, strict=True)) if h < 0]
            # per such request: the reusing requests submitted before it whose first
            # token came first (FCFS served them ahead of it: the part of a no-reuse
            # request's delay that is queue order, not overhead)
            row["reuse_served_before"] = [
                [i, sum(1 for j in range(i) if hd[j] >= 0 and tt[j] < t)]
                for i, t in row["noreuse_by_position"]]
        ss = r.get("scheduler_stats") or {}
        if ss:
            row["scheduler"] = {k: ss[k] for k in SCHED_KEYS if k in ss}
        rows.append(row)
    ok = [r for r in rows if "error" not in r]
    native = {r["tokens"]: r for r in ok if r["config"] == "native_fs"}
    for r in ok:
        n = native.get(r["tokens"]) if r["config"] != "native_fs" else None
        if n is None:
            continue
        r["vs_native_fs_same_call"] = r["mean_ttft_s"] / n["mean_ttft_s"]
        if n["disk_read_bytes"] and r["disk_read_bytes"] is not None:
            r["disk_read_vs_native_fs_same_call"] = r["disk_read_bytes"] / n["disk_read_bytes"]
    dflt = {(r["tokens"], r["config"]): r for r in ok if r["variant"] == "defaults"}
    for r in ok:
        d = dflt.get((r["tokens"], r["config"])) if r["variant"] not in ("defaults", "-") \
            else None
        if d is None:
            continue
        r["vs_defaults_same_call"] = r["mean_ttft_s"] / d["mean_ttft_s"]
        if r["mean_ttft_noreuse_s"] and d["mean_ttft_noreuse_s"]:
            r["noreuse_vs_defaults_same_call"] = (r["mean_ttft_noreuse_s"]
                                                  / d["mean_ttft_noreuse_s"])
    off = {(r["tokens"], r["variant"]): r for r in ok if r["config"] == "kvcache_nopreload"}
    for r in ok:
        o = off.get((r["tokens"], r["variant"])) if r["config"] == "kvcache_preload" else None
        if o is None:
            continue
        if r["mean_ttft_reuse_s"] and o["mean_ttft_reuse_s"]:
            r["reuse_off_on"] = o["mean_ttft_reuse_s"] / r["mean_ttft_reuse_s"]
        if r["mean_ttft_noreuse_s"] and o["mean_ttft_noreuse_s"]:
            r["noreuse_on_off"] = r["mean_ttft_noreuse_s"] / o["mean_ttft_noreuse_s"]
    return rows


def _median(vals: list[float]) -> float | None:
    return statistics.median(vals) if vals else None


def summarize(rows: list[dict]) -> list[dict]:
    """Medians over calls per (workload, tokens, arm), in first-seen order: see the
    module doc. Rows with an error are left out."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if "error" not in r:
            groups[(r["workload"], r["tokens"], r["arm"])].append(r)
    out: list[dict] = []
    for (workload, tokens, arm), rs in groups.items():
        s: dict = {"workload": workload, "tokens": tokens, "arm": arm,
                   "calls": [r["call"] for r in rs]}
        for k in MEDIAN_KEYS:
            s[k] = _median([r[k] for r in rs if r.get(k) is not None])
        for k in RATIO_KEYS:
            vals = [r[k] for r in rs if k in r]
            if vals:
                s[k] = {"median": _median(vals), "n": len(vals), "min": min(vals),
                        "max": max(vals)}
        by_pos: dict[int, list[float]] = defaultdict(list)
        for r in rs:
            for pos, t in r.get("noreuse_by_position", ()):
                by_pos[pos].append(t)
        if by_pos:
            s["noreuse_by_position"] = [[p, _median(v)] for p, v in sorted(by_pos.items())]
        out.append(s)
    return out


def _fmt(v: float | None, nd: int = 3) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def _ratio(s: dict, k: str) -> str:
    r = s.get(k)
    if r is None:
        return "-"
    return f"{r['median']:.3f} ({r['n']}; {r['min']:.3f}-{r['max']:.3f})"


def write_md(path: str, doc: dict) -> None:
    """The summary as a Markdown table (medians over calls; ratios: median (n; range))."""
    lines = [f"# Issue 10 rows, {doc['model']} on {doc['card']}: medians over calls", "",
             doc["note"], "",
             "Each ratio is within one call; the table gives its median over the calls "
             "that ran both arms (n; min-max). Times in s, bytes in GB.", "",
             "| workload | tokens | arm | calls | mean TTFT | reusing | no-reuse | disk read "
             "| vs native_fs | bytes vs native_fs | reusing off/on | no-reuse on/off "
             "| vs defaults | no-reuse vs defaults | no-reuse by position |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in doc["summary"]:
        gb = s["disk_read_bytes"]
        pos = " ".join(f"{p}:{t:.2f}" for p, t in s.get("noreuse_by_position", ())) or "-"
        lines.append(
            f"| {s['workload']} | {s['tokens']} | {s['arm']} | {','.join(s['calls'])} | "
            f"{_fmt(s['mean_ttft_s'])} | {_fmt(s['mean_ttft_reuse_s'])} | "
            f"{_fmt(s['mean_ttft_noreuse_s'])} | {_fmt(None if gb is None else gb / 1e9, 1)} | "
            + " | ".join(_ratio(s, k) for k in RATIO_KEYS) + f" | {pos} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['call']} {r['arm']}: error {r['error']}"
    gb = (r["disk_read_bytes"] or 0) / 1e9
    extra = "".join(f" {k} {r[k]:.3f}" for k in RATIO_KEYS if k in r)
    return (f"{r['call']} {r['workload']} {r['tokens']} {r['arm']:28s} mean "
            f"{r['mean_ttft_s']:.3f} reuse {r['mean_ttft_reuse_s'] or 0:.3f} noreuse "
            f"{r['mean_ttft_noreuse_s'] or 0:.3f} read {gb:.1f} GB "
            f"({gb * 1e9 / r['distinct_kv_bytes']:.2f}x){extra}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the session JSON to write")
    ap.add_argument("--card", required=True, help="the card the calls ran on (h100, h200)")
    ap.add_argument("--note", default="", help="a sentence stored as the file's note")
    ap.add_argument("--md", help="also write the summary (medians over calls) as Markdown")
    ap.add_argument("calls", nargs="+", metavar="CALL=RUN.json[@workload]")
    a = ap.parse_args(argv)
    rows: list[dict] = []
    machine = model = None
    for spec in a.calls:
        call, sep, path = spec.partition("=")
        if not sep or not call or not path:
            ap.error(f"{spec!r}: expected CALL=RUN.json[@workload]")
        path, _, wl = path.partition("@")
        try:
            workload = wl or workload_of(path)
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            print(f"preload_session_rows: {e}", file=sys.stderr)
            return 2
        machine, model = doc.get("machine"), doc.get("model")
        rows.extend(call_rows(call, doc, workload))
    out = {"machine": machine, "model": model, "card": a.card,
           "note": a.note or "only rows of one call compare (vs_native_fs_same_call)",
           "results": rows, "summary": summarize(rows)}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    if a.md:
        write_md(a.md, out)
    for r in rows:
        print(_line(r))
    for s in out["summary"]:
        print(f"median {s['workload']} {s['tokens']} {s['arm']:28s} calls "
              f"{','.join(s['calls'])} mean {_fmt(s['mean_ttft_s'])} "
              + " ".join(f"{k} {_ratio(s, k)}" for k in RATIO_KEYS if k in s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
