#!/usr/bin/env python3
"""Files written and hits kept by ``disk_admission`` ``all`` vs ``reuse``, by simulation.

Hit and write counts do not depend on the hardware, so the CPU machine can price
``disk_admission="reuse"`` on the workloads the GPU runs replay (``kvcache workload ...
--token-ids`` files, e.g. ``.gpu/wl-scbench.jsonl.gz``) before a GPU call measures it.
Requests are taken one at a time in file order (no concurrency); each prompt is cut into
``--block``-token chunks keyed by their whole prefix (as vLLM's block hashes are). Per
request, modelling vLLM with the GPU prefix cache on and PyKVCacheManager:

1. the GPU prefix cache (an LRU of ``--gpu-bytes`` worth of chunks) serves the leading
   chunks it holds;
2. the tiers serve the next ones, in order, while present: the DRAM tier (LRU, the
   request's chunks touched tail first), else the disk (a disk hit is promoted into the
   DRAM tier); a missing chunk ends the hit, the rest is recomputed;
3. every chunk of the request that neither tier holds is stored (vLLM offers the GPU-hit
   chunks too): into the DRAM tier, and with ``all`` a file; with ``reuse`` a file only
   for a chunk stored before (doorkeeper), the others wait in the DRAM tier without one
   until a DRAM hit writes it (or an eviction drops it); without a DRAM tier such a first
   store is not stored;
4. the disk is an LRU of ``--disk-bytes`` (0: unbounded).

Usage: python scripts/sim_disk_admission.py WORKLOAD[@GPU_BYTES[@N]] [...] [--gpu-bytes 6GiB]
       [--dram-bytes 8GiB] [--disk-bytes 0] [--kv-bytes-per-token 114688] [--block 256]
       [--json OUT] [--md OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter, OrderedDict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from sim_dram_policy import chunk_keys  # noqa: E402

GiB = 1 << 30


def simulate(reqs: list[list[int]], gpu_cap: int, dram_cap: int, disk_cap: int,
             admission: str, min_chunks: int = 0) -> dict:
    """Counts of one admission policy over the chunk-key lists ``reqs`` (capacities in
    chunks; ``disk_cap`` 0 = unbounded). ``min_chunks``: ``disk_min_prefix_tokens`` in
    chunks (a request with fewer chunks writes no files; its first stores go into the
    DRAM tier only, or nowhere without one)."""
    gpu: OrderedDict[int, None] = OrderedDict()
    dram: OrderedDict[int, None] = OrderedDict()
    disk: OrderedDict[int, None] = OrderedDict()
    unproven: set[int] = set()
    seen: set[int] = set()
    c: Counter[str] = Counter()

    def write(k: int) -> None:
        disk[k] = None
        c["files_written"] += 1
        if disk_cap and len(disk) > disk_cap:
            disk.popitem(last=False)
            c["disk_evictions"] += 1

    def into_dram(k: int) -> bool:
        if not dram_cap:
            return False
        dram[k] = None
        if len(dram) > dram_cap:
            v, _ = dram.popitem(last=False)
            if v in unproven:
                unproven.discard(v)
                c["evicted_without_file"] += 1
        return True

    for keys in reqs:
        c["chunks_asked"] += len(keys)
        n = 0
        while n < len(keys) and keys[n] in gpu:
            n += 1
        c["gpu_hits"] += n
        m = n
        while m < len(keys):
            k = keys[m]
            if k in dram:
                c["dram_hits"] += 1
                if k in unproven:  # read again: its file now (a flush from the slot)
                    unproven.discard(k)
                    write(k)
            elif k in disk:
                c["disk_hits"] += 1
                disk.move_to_end(k)
                into_dram(k)
            else:
                break
            m += 1
        c["chunks_computed"] += len(keys) - m
        for k in reversed(keys):  # vLLM's touch, tail first: the head most recent
            if k in dram:
                dram.move_to_end(k)
        for k in keys:
            if k in dram or k in disk:
                continue
            first = k not in seen
            seen.add(k)
            if len(keys) < min_chunks:  # short request: DRAM only, never a file
                if not into_dram(k):
                    c["stores_skipped_short"] += 1
                continue
            if admission == "reuse" and first:
                if into_dram(k):
                    unproven.add(k)
                    c["stores_disk_deferred"] += 1
                else:
                    c["stores_disk_not_admitted"] += 1
                continue
            into_dram(k)
            write(k)
        for k in keys:
            gpu[k] = None
            gpu.move_to_end(k)
        while len(gpu) > gpu_cap:
            gpu.popitem(last=False)
    for name in ("files_written", "disk_hits", "dram_hits", "gpu_hits", "chunks_computed",
                 "stores_disk_deferred", "stores_disk_not_admitted", "evicted_without_file",
                 "stores_skipped_short",
                 "disk_evictions"):
        c[name] += 0  # every row has every field
    asked = c["chunks_asked"] or 1
    return {"admission": admission, **dict(c),
            "tier_hit_rate": (c["dram_hits"] + c["disk_hits"]) / asked,
            "computed_rate": c["chunks_computed"] / asked}


def _bytes(text: str) -> int:
    t = text.strip().lower()
    for suf, mult in (("gib", GiB), ("mib", 1 << 20), ("g", GiB)):
        if t.endswith(suf):
            return int(float(t[: -len(suf)]) * mult)
    return int(float(t))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workloads", nargs="+",
                    help="workload files; WORKLOAD@GPU_BYTES[@N] overrides --gpu-bytes for "
                    "one and takes its first N requests")
    ap.add_argument("--gpu-bytes", default="6GiB", help="GPU prefix cache (KV) size")
    ap.add_argument("--dram-bytes", default="8GiB", help="DRAM tier size (0: off)")
    ap.add_argument("--disk-bytes", default="0", help="disk bound (0: unbounded)")
    ap.add_argument("--kv-bytes-per-token", type=int, default=114688,
                    help="KV bytes per token (default: Llama-3.2-3B, bf16)")
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--min-prefix-tokens", type=int, default=2048,
                    help="disk_min_prefix_tokens of the extra 'all' row (0: no such row)")
    ap.add_argument("--json")
    ap.add_argument("--md")
    a = ap.parse_args()
    from kvcache_core.workloads import read_workload

    chunk = a.block * a.kv_bytes_per_token
    out = []
    for spec in a.workloads:
        path, _, rest = spec.partition("@")
        gpu_text, _, n_text = rest.partition("@")
        gpu_bytes = _bytes(gpu_text or a.gpu_bytes)
        reqs = [chunk_keys(r["prompt_token_ids"], a.block) for r in read_workload(path)]
        if n_text:
            reqs = reqs[:int(n_text)]
        caps = {"gpu": gpu_bytes // chunk, "dram": _bytes(a.dram_bytes) // chunk,
                "disk": _bytes(a.disk_bytes) // chunk}
        for dram_on in (True, False):
            dram_cap = caps["dram"] if dram_on else 0
            runs = [("all", 0), ("reuse", 0)]
            if a.min_prefix_tokens:
                runs.append(("all", a.min_prefix_tokens))
            for adm, min_tokens in runs:
                r = simulate(reqs, caps["gpu"], dram_cap, caps["disk"], adm,
                             min_chunks=-(-min_tokens // a.block))
                if min_tokens:
                    r["admission"] = f"all, disk_min_prefix_tokens={min_tokens}"
                r.update(workload=os.path.basename(path), requests=len(reqs),
                         gpu_chunks=caps["gpu"], dram_chunks=dram_cap,
                         disk_chunks=caps["disk"])
                out.append(r)
                print(f"{r['workload']:32s} dram={dram_cap:4d} {r['admission'][:9]:9s} files "
                      f"{r['files_written']:6d}  disk hits {r['disk_hits']:6d}  dram hits "
                      f"{r['dram_hits']:6d}  computed {r['computed_rate']:.3f}",
                      file=sys.stderr, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"block": a.block, "kv_bytes_per_token": a.kv_bytes_per_token,
                       "chunk_bytes": chunk, "results": out}, f, indent=1)
    if a.md:
        with open(a.md, "w") as f:
            f.write(to_markdown(out, chunk))
    return 0


def to_markdown(rows: list[dict], chunk: int) -> str:
    lines = [
        "# disk_admission all vs reuse: files written and hits, by simulation",
        "",
        "`scripts/sim_disk_admission.py` (requests in file order, one at a time; GPU "
        "prefix cache, DRAM tier and disk as LRUs; see the script's docstring). "
        f"Chunks of {chunk / (1 << 20):.0f} MiB (256 tokens, Llama-3.2-3B bf16). "
        "Counts in chunks; `computed` = share of prompt chunks recomputed.",
        "",
        "| workload | GPU chunks | DRAM chunks | admission | files written | GB written | "
        "disk hits | DRAM hits | computed | first stores kept in DRAM only | not stored |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['gpu_chunks']} | {r['dram_chunks']} | {r['admission']} "
            f"| {r.get('files_written', 0)} | {r.get('files_written', 0) * chunk / 1e9:.1f} "
            f"| {r.get('disk_hits', 0)} | {r.get('dram_hits', 0)} | {r['computed_rate']:.3f} "
            f"| {r.get('stores_disk_deferred', 0)} | {r.get('stores_disk_not_admitted', 0)} |")
    lines += ["", "Against `all` on the same workload and DRAM tier (files written; change in "
              "the share of prompt chunks recomputed):", ""]
    base = {(r["workload"], r["dram_chunks"]): r for r in rows if r["admission"] == "all"}
    for r in rows:
        b = base.get((r["workload"], r["dram_chunks"]))
        if b is None or r is b:
            continue
        files = r["files_written"] / b["files_written"] if b["files_written"] else 0.0
        lines.append(f"- {r['workload']}, DRAM tier {'on' if r['dram_chunks'] else 'off'}, "
                     f"{r['admission']}: {files:.0%} of the files, recomputed "
                     f"{100 * (r['computed_rate'] - b['computed_rate']):+.1f} points")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
