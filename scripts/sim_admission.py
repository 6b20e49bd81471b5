#!/usr/bin/env python3
"""Admission order and disk bytes for many clients over a few long documents: what
reordering the admission of disk-loading requests could save (a model, not a benchmark).

    python scripts/sim_admission.py [--run FILE --config NAME] [--gpu-requests 12]
        [--dram-chunks 207] [--disk-gbps 1.49] [--concurrency 50] [--json OUT]

The fifty-client workload of ``scripts/h200_runs.sh preload50`` (8 documents of 40k
tokens, each wanted 7 times in random order, 50 requests in flight, GPU prefix cache off,
every block on disk at the start) is disk-bound: in the thirty-sixth session py-kvcache
read 95 GB for 37.6 GB distinct, and native tiered FS (70.7 GB) won 1.09x. This model
replays the same request order (``--run``: a ``preload50-run-*.json``, the ``hit_docs``
of ``--config``) through:

* a GPU that holds ``--gpu-requests`` requests' KV at once (a request holds its share
  from admission until its first token; compute is not modelled: the disk dominates);
* one disk serving 256-token chunk reads first come first served at ``--disk-gbps``;
* a DRAM tier of ``--dram-chunks`` chunks (the run's ``dram_slots``) that keeps every
  chunk read from disk (LRU over the chunks no admitted request still needs);
* an admitted request's chunks: from the tier if there, else joining a read of the same
  chunk already queued, else a new read; its first token when all are in.

Admission policies, each a pass over the waiting requests in arrival order every time
something changes, admitting while the GPU has room:

* ``fcfs-pending``: vLLM's FCFS with py-kvcache's default HIT_PENDING: a request some of
  whose chunks are being read for another request is skipped until those reads end;
* ``fcfs-join``: FCFS, such a request is admitted and joins the reads
  (``join_promotions``);
* ``affinity-K``: join, and a request that needs new disk reads is admitted only while
  fewer than K documents are being read from disk; requests whose chunks are all in the
  tier or being read are admitted first (in arrival order), then the others.

The ``pyk-*`` policies model py-kvcache as it is instead of that ideal tier: a chunk
enters the tier only if it got a slot when its request was admitted (``prepare_load``:
a free slot, or one whose chunk no admitted request needs; else it is read through
staging and not kept), HIT_PENDING holds only chunks being read INTO the tier, and
the tier's blocks of the first ``--protect`` waiting requests are not evicted
(``preload_protect``):

* ``pyk-pending``: the defaults (a request with a chunk being promoted is skipped);
* ``pyk-join``: ``join_promotions``;
* ``pyk-noslot``: ``pyk-pending`` with ``disk_load_hold_s`` and ``disk_load_hold_when=
  "no_slot"`` (no time limit): a request that needs new disk reads waits, while another
  disk read is queued, until the tier has room for all of them;
* ``pyk-serial-K``: ``pyk-pending``, and a request that needs new disk reads is admitted
  only while fewer than K documents are being read from disk (the others wait in the
  queue, so the document being read keeps the tier's slots and its later readers find
  it there).

Output: per policy, bytes read, mean / p90 TTFT and the time the last request got its
first token; JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from dataclasses import dataclass, field

#: the order of the thirty-sixth session's 40k kvcache_preload run (hit_docs)
S36_ORDER = [4, 3, 1, 3, 6, 4, 0, 5, 6, 3, 6, 1, 1, 2, 7, 4, 2, 6, 7, 5, 2, 6, 6, 7, 1, 5,
             4, 0, 2, 4, 7, 2, 1, 6, 5, 5, 7, 2, 7, 3, 3, 0, 0, 1, 4, 7, 5, 3, 0, 4, 0, 0,
             5, 3, 1, 2]


@dataclass
class Req:
    rid: int
    doc: int
    arrive: float = 0.0
    admitted: float | None = None
    done: float | None = None
    missing: set = field(default_factory=set)


def simulate(order: list[int], policy: str, *, chunks: int = 160,
             chunk_bytes: float = 4.697e9 / 160, disk_bps: float = 1.49e9,
             gpu_requests: int = 12, dram_chunks: int = 207,
             concurrency: int = 50, protect: int = 4) -> dict:
    """Run one policy over ``order`` (document of each request); see the module doc.
    ``protect``: the ``pyk-*`` policies keep the tier's blocks of the first ``protect``
    waiting requests (``preload_protect`` with ``preload_lookahead``, default 4)."""
    read_s = chunk_bytes / disk_bps
    reqs = [Req(i, d) for i, d in enumerate(order)]
    waiting: list[Req] = []
    pending = collections.deque(reqs)  # not yet sent by the clients
    for _ in range(min(concurrency, len(reqs))):
        waiting.append(pending.popleft())
    running: list[Req] = []
    tier: collections.OrderedDict = collections.OrderedDict()  # chunk -> None (LRU)
    disk_q: collections.deque = collections.deque()  # chunks queued, FCFS
    queued: set = set()
    waiters: dict = collections.defaultdict(list)  # chunk -> requests waiting for it
    now, bytes_read = 0.0, 0.0
    k_docs = int(policy.rsplit("-", 1)[1]) if policy[-1].isdigit() else 0
    realistic = policy.startswith("pyk-")
    promoting: set = set()  # chunks being read into a reserved tier slot (realistic)
    reserved = 0  # tier slots reserved by promotions in flight

    def docs_reading() -> set:
        return {c[0] for c in queued}

    def admit(r: Req) -> None:
        nonlocal reserved
        r.admitted = now
        running.append(r)
        waiting.remove(r)
        for i in range(chunks):
            c = (r.doc, i)
            if c in tier:
                tier.move_to_end(c)
                continue
            r.missing.add(c)
            waiters[c].append(r)
            if c not in queued:
                queued.add(c)
                disk_q.append(c)
                if realistic and (len(tier) + reserved < dram_chunks or evict_for(c)):
                    promoting.add(c)  # a tier slot now, the chunk kept when read
                    reserved += 1

    def room_for(r: Req) -> bool:
        """Whether the tier could take every chunk ``r`` must read anew (free slots plus
        those whose chunk no admitted request needs), as ``dram_short`` judges."""
        new = sum(1 for i in range(chunks) if (r.doc, i) not in tier
                  and (r.doc, i) not in queued)
        if not new:
            return True
        needed = {(x.doc, i) for x in running for i in range(chunks)}
        free = dram_chunks - len(tier) - reserved + sum(1 for v in tier if v not in needed)
        return new <= free

    def cheap(r: Req) -> bool:
        return all((r.doc, i) in tier or (r.doc, i) in queued for i in range(chunks))

    def admission() -> None:
        if realistic:
            for r in list(waiting):
                if len(running) >= gpu_requests:
                    return
                if policy != "pyk-join" and any((r.doc, i) in promoting for i in range(chunks)):
                    continue  # HIT_PENDING on a promotion
                if (k_docs and not cheap(r) and r.doc not in docs_reading()
                        and len(docs_reading()) >= k_docs):
                    continue  # pyk-serial-K: the disk reads K documents at most
                if policy == "pyk-noslot" and queued and not room_for(r):
                    continue  # disk_load_hold_when="no_slot": wait for the tier's room
                admit(r)
            return
        if policy == "fcfs-pending":
            for r in list(waiting):
                if len(running) >= gpu_requests:
                    return
                if any((r.doc, i) in queued for i in range(chunks)):
                    continue  # HIT_PENDING: skipped, the next request may go
                admit(r)
        elif policy == "fcfs-join":
            for r in list(waiting):
                if len(running) >= gpu_requests:
                    return
                admit(r)
        else:
            for r in [w for w in waiting if cheap(w)]:
                if len(running) >= gpu_requests:
                    return
                admit(r)
            for r in list(waiting):
                if len(running) >= gpu_requests:
                    return
                if len(docs_reading()) < k_docs:
                    admit(r)

    def finish_ready() -> None:
        for r in [r for r in running if not r.missing]:
            r.done = now
            running.remove(r)
            if pending:
                waiting.append(pending.popleft())

    def evict_for(c) -> bool:
        needed = {x for r in running for x in r.missing} | {
            (r.doc, i) for r in running for i in range(chunks)}
        if realistic and protect:  # preload_protect: the first waiting requests' blocks
            needed |= {(r.doc, i) for r in waiting[:protect] for i in range(chunks)}
        for v in tier:
            if v not in needed:
                del tier[v]
                return True
        return False

    admission()
    finish_ready()
    while running or waiting:
        if not disk_q:
            admission()
            finish_ready()
            if not disk_q:
                if waiting and not running:  # nothing admissible: should not happen
                    raise RuntimeError(f"{policy}: stuck with {len(waiting)} waiting")
                continue
        c = disk_q.popleft()
        now += read_s
        bytes_read += chunk_bytes
        queued.discard(c)
        if realistic:
            if c in promoting:
                promoting.discard(c)
                reserved -= 1
                tier[c] = None
        elif len(tier) < dram_chunks or evict_for(c):
            tier[c] = None
        for r in waiters.pop(c, []):
            r.missing.discard(c)
        finish_ready()
        admission()
        finish_ready()
    ttft = [r.done - r.arrive for r in reqs]
    distinct = len(set(order)) * chunks * chunk_bytes
    return {"policy": policy, "bytes_read_gb": bytes_read / 1e9,
            "distinct_gb": distinct / 1e9, "mean_ttft_s": statistics.mean(ttft),
            "p90_ttft_s": sorted(ttft)[int(0.9 * (len(ttft) - 1))],
            "last_token_s": max(r.done for r in reqs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", help="a preload50-run-*.json: take the request order from it")
    ap.add_argument("--config", default="kvcache_preload", help="its row to take")
    ap.add_argument("--gpu-requests", type=int, default=12)
    ap.add_argument("--dram-chunks", type=int, default=207)
    ap.add_argument("--disk-gbps", type=float, default=1.49)
    ap.add_argument("--concurrency", type=int, default=50)
    ap.add_argument("--protect", type=int, default=4,
                    help="pyk-*: waiting requests whose tier blocks are kept (preload_protect)")
    ap.add_argument("--policies", default="fcfs-pending,fcfs-join,affinity-1,pyk-pending,"
                    "pyk-join,pyk-serial-1,pyk-serial-2")
    ap.add_argument("--random-orders", type=int, default=0,
                    help="instead of one order: N seeded shuffles of 8 documents x 7 "
                    "requests; the table shows medians over them")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    order = S36_ORDER
    if a.run:
        with open(a.run) as f:
            rows = json.load(f)["results"]
        order = next(r["hit_docs"] for r in rows if r["config"] == a.config)
    orders = [order]
    if a.random_orders:
        import random

        orders = []
        for seed in range(a.random_orders):
            o = [d for d in range(8) for _ in range(7)]
            random.Random(seed).shuffle(o)
            orders.append(o)
    out = []
    print("| policy | disk read (GB) | x distinct | mean TTFT (s) | p90 (s) | last token (s) |")
    print("|---|---|---|---|---|---|")
    for p in a.policies.split(","):
        runs = [simulate(o, p, disk_bps=a.disk_gbps * 1e9, gpu_requests=a.gpu_requests,
                         dram_chunks=a.dram_chunks, concurrency=a.concurrency,
                         protect=a.protect)
                for o in orders]
        r = {k: (statistics.median(x[k] for x in runs) if k != "policy" else p)
             for k in runs[0]}
        r["orders"] = len(runs)
        out.append(r)
        print(f"| {p} | {r['bytes_read_gb']:.1f} | {r['bytes_read_gb'] / r['distinct_gb']:.2f} "
              f"| {r['mean_ttft_s']:.1f} | {r['p90_ttft_s']:.1f} | {r['last_token_s']:.1f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"order": order if not a.random_orders else None,
                       "random_orders": a.random_orders, "gpu_requests": a.gpu_requests,
                       "dram_chunks": a.dram_chunks, "disk_gbps": a.disk_gbps,
                       "concurrency": a.concurrency, "results": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
