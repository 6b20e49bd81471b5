#!/usr/bin/env python3
"""Summarise py-spy raw profiles (``py-spy record --format raw --threads --subprocesses``)
of vLLM servers, e.g. those written by ``python -m kvcache_core.bench.sharegpt run
--profile CFG``: per process and thread, the CPU seconds sampled (samples / rate), the
share spent inside py-kvcache (any frame under ``kvcache_core/``), and the functions with
the most samples (inclusive) and the most self time.

    python3 scripts/pyspy_report.py --rate 200 A.pyspy.txt [B.pyspy.txt ...] [--json OUT]
    [--only-stack SUBSTR]   (count only samples whose stack contains SUBSTR, e.g. "step")

Raw format: one record per distinct stack, ``process PID:"cmdline";[process ...;]thread
(TID)[: NAME];frame (file:line);... COUNT``; command lines may span lines and hold ``;``.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys

_RECORD = re.compile(r'(?m)^(?=process \d+:")')
_PROC = re.compile(r'^process (\d+):"(.*)', re.S)
_COUNT = re.compile(r"\s(\d+)\s*$")


def parse(text: str) -> list[tuple[str, str, list[str], int]]:
    """(process label, thread label, frames outermost first, samples) per record."""
    out = []
    for rec in _RECORD.split(text):
        m = _COUNT.search(rec)
        if not rec.startswith("process ") or m is None:
            continue
        body = rec[: m.start()]
        # the thread item starts the stack; everything before it names processes
        ti = body.rfind(";thread (")
        if ti < 0:
            continue
        procs, stack = body[:ti], body[ti + 1:].split(";")
        last = procs.rfind("process ")
        pm = _PROC.match(procs[last:])
        proc = "?"
        if pm:
            cmd = pm.group(2).split('"')[0].split("\n")[0]
            proc = f"{pm.group(1)} {cmd[:60]}"
        out.append((proc, stack[0], stack[1:], int(m.group(1))))
    return out


def summarise(records: list[tuple[str, str, list[str], int]], rate: float,
              only: str | None = None, top: int = 12) -> list[dict]:
    """One row per (process, thread) with >= 1 % of all samples, busiest first."""
    per: dict[tuple[str, str], dict] = {}
    for proc, thread, frames, n in records:
        if only and not any(only in f for f in frames):
            continue
        d = per.setdefault((proc, thread), {"samples": 0, "kvcache": 0,
                                            "incl": collections.Counter(),
                                            "self": collections.Counter()})
        d["samples"] += n
        if any("kvcache_core" in f for f in frames):
            d["kvcache"] += n
        for f in set(frames):
            d["incl"][f] += n
        if frames:
            d["self"][frames[-1]] += n
    total = sum(d["samples"] for d in per.values()) or 1
    rows = []
    for (proc, thread), d in sorted(per.items(), key=lambda kv: -kv[1]["samples"]):
        if d["samples"] < total * 0.01:
            continue
        rows.append({
            "process": proc, "thread": thread, "samples": d["samples"],
            "cpu_s": round(d["samples"] / rate, 2),
            "kvcache_share": round(d["kvcache"] / d["samples"], 4),
            "kvcache_cpu_s": round(d["kvcache"] / rate, 2),
            "top_kvcache_inclusive": [(f, n) for f, n in d["incl"].most_common()
                                      if "kvcache_core" in f][:top],
            "top_self": d["self"].most_common(top),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="py-spy raw outputs")
    ap.add_argument("--rate", type=float, default=200.0, help="py-spy --rate used")
    ap.add_argument("--only-stack", default=None,
                    help="count only samples whose stack contains this substring")
    ap.add_argument("--top", type=int, default=12, help="functions listed per thread")
    ap.add_argument("--json", default=None, help="also write the summary as JSON")
    a = ap.parse_args(argv)
    result = {}
    for path in a.files:
        with open(path, errors="replace") as f:
            rows = summarise(parse(f.read()), a.rate, a.only_stack, a.top)
        result[path] = rows
        print(f"== {path}" + (f" (stacks containing {a.only_stack!r})" if a.only_stack else ""))
        for r in rows:
            print(f"  {r['process'][:50]:50s} | {r['thread'][:40]:40s} | {r['cpu_s']:8.2f} s CPU"
                  f" | py-kvcache {100 * r['kvcache_share']:5.1f} % ({r['kvcache_cpu_s']:.2f} s)")
            for fr, n in r["top_self"][: a.top]:
                print(f"      self {n / a.rate:7.2f} s  {fr[:110]}")
            for fr, n in r["top_kvcache_inclusive"][: a.top]:
                print(f"      kvc  {n / a.rate:7.2f} s  {fr[:110]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
