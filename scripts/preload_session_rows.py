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
  with preload / without it (issue 10's <= 1.03 bar).

Every row keeps the issue's schema fields (workload, config, tokens, concurrency, the
TTFTs, disk bytes read, peak staging and its budget), plus ``call``, ``arm`` (the
configuration name as run, e.g. a ``--variant`` name), ``variant`` (its ``kv_extra`` as
``key=value`` words, ``defaults`` without), ``distinct_kv_bytes`` (one document's KV x
documents), a subset of the scheduler's counters and, where the run file lists each
request's document (``hit_docs``, negative = nothing to reuse), ``noreuse_by_position``:
``[submission position, TTFT]`` of each request with nothing to reuse. A row that failed keeps only
``call``, ``arm`` and ``error``. Prints one line per row.

Usage: python scripts/preload_session_rows.py --out preload-<model>-sNN-<card>.json
         --card h100 --note "..." c1=RUN.json [c2=RUN.json[@workload] ...]
``@workload`` overrides the workload the file name implies (``preload50`` -> longdoc,
``preload-run`` / ``mixed-run`` -> mixed, ``scbench-run`` -> scbench).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

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
        ss = r.get("scheduler_stats") or {}
        if ss:
            row["scheduler"] = {k: ss[k] for k in SCHED_KEYS if k in ss}
        rows.append(row)
    ok = [r for r in rows if "error" not in r]
    native = {r["tokens"]: r["mean_ttft_s"] for r in ok if r["config"] == "native_fs"}
    for r in ok:
        if r["config"] != "native_fs" and r["tokens"] in native:
            r["vs_native_fs_same_call"] = r["mean_ttft_s"] / native[r["tokens"]]
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


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['call']} {r['arm']}: error {r['error']}"
    gb = (r["disk_read_bytes"] or 0) / 1e9
    extra = "".join(f" {k} {r[k]:.3f}" for k in ("vs_native_fs_same_call", "reuse_off_on",
                                                 "noreuse_on_off") if k in r)
    return (f"{r['call']} {r['workload']} {r['tokens']} {r['arm']:28s} mean "
            f"{r['mean_ttft_s']:.3f} reuse {r['mean_ttft_reuse_s'] or 0:.3f} noreuse "
            f"{r['mean_ttft_noreuse_s'] or 0:.3f} read {gb:.1f} GB "
            f"({gb * 1e9 / r['distinct_kv_bytes']:.2f}x){extra}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the session JSON to write")
    ap.add_argument("--card", required=True, help="the card the calls ran on (h100, h200)")
    ap.add_argument("--note", default="", help="a sentence stored as the file's note")
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
           "results": rows}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    for r in rows:
        print(_line(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
