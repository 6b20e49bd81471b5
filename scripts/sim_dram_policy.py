#!/usr/bin/env python3
"""Hit rate of the DRAM tier's slot policies on a workload file, by simulation.

Hit counts do not depend on the hardware, so the CPU machine can compare eviction
policies on the workloads the GPU runs replay (``kvcache workload ... --token-ids``
files, e.g. ``.gpu/wl-scbench.jsonl.gz``). Requests are taken one at a time in file
order; each prompt is cut into ``--block``-token chunks keyed by their whole prefix (as
vLLM's block hashes are); a request hits the leading chunks present in the tier (a
prefix: a missing chunk ends the hit) and then stores its missing full chunks, evicting
with the policy when the tier is full. The GPU prefix cache is left out (an upper bound
on what the tier sees). Policies: the tier's own ``lru`` and ``arc``
(``kvcache_core.staging``) with a request's blocks in prompt order (the manager before
the sixth session) or ``-tail`` first (its last block the least recent, the manager
now: a prefix loses its tail first), ``lru-admit`` (the manager's
``eviction_policy=lru-admit``: LRU tail first behind kvcache_core.admission's filter), and
``opt`` (Belady per chunk: evict the chunk
needed again last, offline; a reference, not a strict bound, since a hit must be a
prefix). A ``-q<k>`` suffix on any online policy models the connector key
``preload_protect``: before a request's stores, the tier blocks of the next ``k``
requests (the waiting requests the patched scheduler shows) are refreshed, the k-th
first and each tail first, as ``PyKVCacheManager.protect_queue`` does every step, and a
store takes no slot whose victim one of them reads before the new block
(``_queue_admits``).

Usage: python scripts/sim_dram_policy.py WORKLOAD [--tier-bytes 8GiB] [--kv-bytes-per-token
       114688] [--block 256] [--json OUT]
       python scripts/sim_dram_policy.py --docs-order 1,0,-1,1 --doc-chunks 160
       --tier-chunks 207     (requests by document id in that order; a negative id is a
       request with nothing to reuse: the order in which a queued workload's requests got
       their KV, e.g. the mixed 16 x 40k's, read from its per-request TTFTs)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from kvcache_core.admission import AdmissionDuel  # noqa: E402
from kvcache_core.staging import make_policy  # noqa: E402


def chunk_keys(tokens: list[int], block: int) -> list[int]:
    """One key per full chunk, chained over the prefix (like vLLM's block hashes)."""
    keys, h = [], 0
    for i in range(len(tokens) // block):
        h = hash((h, tuple(tokens[i * block:(i + 1) * block])))
        keys.append(h)
    return keys


class _Belady:
    """Offline optimal eviction: the victim is the chunk whose next request is furthest
    away (or never comes). ``advance(i)`` before request ``i``."""

    def __init__(self, reqs: list[list[int]]) -> None:
        self.uses: dict[int, list[int]] = {}
        for i, keys in enumerate(reqs):
            for k in keys:
                u = self.uses.setdefault(k, [])
                if not u or u[-1] != i:
                    u.append(i)
        self.now = 0
        self.keys: set[int] = set()

    def advance(self, i: int) -> None:
        self.now = i

    def _next(self, k: int) -> float:
        for j in self.uses.get(k, ()):
            if j > self.now:
                return j
        return float("inf")

    def insert(self, key: int) -> None:
        self.keys.add(key)

    def hit(self, key: int) -> None:
        pass

    def refresh(self, key: int) -> None:
        pass

    def victim(self, evictable) -> int:
        return max(self.keys, key=self._next)

    def evicted(self, key: int) -> None:
        self.keys.discard(key)


def simulate(reqs: list[list[int]], capacity: int, policy: str) -> dict:
    """Hit and store counts of one policy over the chunk-key lists ``reqs``, modelling
    PyKVCacheManager: vLLM's touch of the request's keys at lookup (a use of the blocks
    in the tier), then the stores of its missing chunks in prompt order. ``-tail``: the
    tail-first order (touch walks the keys backwards, and after the stores the request's
    blocks are re-ordered tail first without counting a use)."""
    look = 0
    base, _, q = policy.rpartition("-q")
    if base and q.isdigit():  # preload_protect over the next int(q) requests
        policy_name, look = base, int(q)
    else:
        policy_name = policy
    name, tail = policy_name.removesuffix("-tail"), policy_name.endswith("-tail")
    adm = None
    if name == "lru-admit":  # the manager's eviction_policy=lru-admit (tail first)
        name, tail, adm = "lru", True, AdmissionDuel(capacity)
    pol = _Belady(reqs) if name == "opt" else make_policy(name, capacity)
    present: set[int] = set()
    hits = asked = stores = evictions = 0
    for i, keys in enumerate(reqs):
        if isinstance(pol, _Belady):
            pol.advance(i)
        n = 0
        while n < len(keys) and keys[n] in present:
            n += 1
        hits += n
        asked += len(keys)
        if adm is not None:
            adm.on_request(keys)
        for k in (reversed(keys) if tail else keys):  # vLLM's touch at lookup
            if k in present:
                pol.hit(k)
        rank: dict = {}
        for j in range(min(len(reqs), i + 1 + look) - 1, i, -1):  # protect_queue
            for k in reversed(reqs[j]):
                rank[k] = j
                if k in present:
                    pol.refresh(k)
        for k in keys[n:]:
            if k in present:
                continue
            if len(present) >= capacity:
                v = pol.victim(lambda _k: True)
                if adm is not None and not adm.admit(k, v):
                    continue
                if rank and v in rank and rank[v] < rank.get(k, len(reqs)):
                    continue  # _queue_admits: the queue reads the victim first
                pol.evicted(v)
                present.discard(v)
                evictions += 1
            pol.insert(k)
            present.add(k)
            stores += 1
        if tail:
            for k in reversed(keys):
                if k in present:
                    pol.refresh(k)
    return {"policy": policy, "hit_rate": hits / asked if asked else 0.0,
            "chunks_hit": hits, "chunks_asked": asked, "stores": stores,
            "evictions": evictions}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", nargs="?")
    ap.add_argument("--docs-order", help="instead of a workload: document ids, comma-"
                    "separated (negative: a request with its own unique chunks)")
    ap.add_argument("--doc-chunks", type=int, default=160,
                    help="chunks per document with --docs-order (160: 40k tokens)")
    ap.add_argument("--tier-chunks", type=int, default=0,
                    help="tier size in chunks (overrides --tier-bytes)")
    ap.add_argument("--tier-bytes", type=float, default=8 * (1 << 30))
    ap.add_argument("--kv-bytes-per-token", type=int, default=114688,
                    help="KV bytes per token (default: Llama-3.2-3B, bf16)")
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--policies", default="lru,lru-tail,arc,arc-tail,lru-admit,opt")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.docs_order:
        ids = [int(x) for x in a.docs_order.split(",")]
        reqs = [[(d, c) for c in range(a.doc_chunks)] for d in ids]
        a.workload = f"docs order {a.docs_order}"
    elif a.workload:
        from kvcache_core.workloads import read_workload

        reqs = [chunk_keys(r["prompt_token_ids"], a.block) for r in read_workload(a.workload)]
    else:
        ap.error("a workload file or --docs-order")
    cap = a.tier_chunks or int(a.tier_bytes // (a.block * a.kv_bytes_per_token))
    distinct = len({k for ks in reqs for k in ks})
    print(f"{a.workload}: {len(reqs)} requests, {distinct} distinct chunks, tier "
          f"{cap} chunks ({cap / max(1, distinct):.0%} of them)", file=sys.stderr)
    rows = [simulate(reqs, cap, p) for p in a.policies.split(",")]
    for r in rows:
        print(f"{r['policy']:8s} hit rate {r['hit_rate']:.3f} ({r['chunks_hit']} of "
              f"{r['chunks_asked']} chunks), stores {r['stores']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"workload": os.path.basename(a.workload), "tier_chunks": cap,
                       "distinct_chunks": distinct, "block": a.block, "results": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
