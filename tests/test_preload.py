"""Preload policy in the reactor (R8): staged preloads, claim, join, dedupe, preemption,
bounded staging. Real files, real io_uring / POSIX engines."""

from __future__ import annotations

import os

import pytest
from helpers.kvutil import BLOCK, close_reactor, payload

from kvcache_core.copy import MemcpyCopier
from kvcache_core.layout import HEADER_BYTES, Layout
from kvcache_core.reactor import Reactor
from kvcache_core.staging import Priority


def _setup(root, ns, engine, n_keys, n_slots=6, io_depth=2, **kw):
    lay = Layout(root, ns)
    keys = [f"pre-{i}".encode() for i in range(n_keys)]
    for k in keys:
        assert lay.write_block(k, payload(k, BLOCK))
    r = Reactor(lay, n_slots=n_slots, io_depth=io_depth, lookahead=2, engine=engine,
                copier=MemcpyCopier, pin=False, **kw)
    return lay, r, keys


def _load(r, rid, keys, prio=Priority.FOREGROUND):
    dests = [bytearray(BLOCK) if prio == Priority.FOREGROUND else None for _ in keys]
    r.load(rid, [(k, d, BLOCK if d is not None else 0) for k, d in zip(keys, dests,
                                                                       strict=True)], prio)
    return dests


def test_preload_then_on_demand_load_claims_the_staged_slot(root, ns, engine):
    lay, r, keys = _setup(root, ns, engine, 2)
    try:
        _load(r, "p", keys[:1], Priority.SPECULATIVE)
        assert r.wait(30)
        read_after_preload = r.stats.bytes_read
        assert r.stats.preload_staged == 1 and read_after_preload == ns.file_bytes
        (d,) = _load(r, "fg", keys[:1])
        assert r.wait(30)
        done = {c.req_id: c for c in r.poll()}
        assert done["fg"].success and done["p"].success
        assert bytes(d) == payload(keys[0], BLOCK)
        assert r.stats.preload_claimed == 1
        assert r.stats.bytes_read == read_after_preload  # no second read
    finally:
        close_reactor(r)
        lay.close()


def test_promotion_claims_a_staged_preload_into_its_dram_slot(root, ns, engine):
    """A load into a caller-owned DRAM-tier slot (a promotion) of a block a preload has
    staged claims the staged slot: no second read, the block's header and payload are
    copied into the DRAM-tier slot (``StagingPool.copy_slot``, GIL released), and the
    load's destination gets the right bytes. With the trace on, the copy is a
    ``claim_copy`` event (its request, its microseconds) that ``scripts/trace_report.py``
    sums into the request's ``claim ms``."""
    import json
    import subprocess
    import sys
    import time

    lay = Layout(root, ns)
    keys = [b"prom-0", b"prom-1"]
    for k in keys:
        assert lay.write_block(k, payload(k, BLOCK))
    n_slots = 6
    t0 = time.monotonic()
    r = Reactor(lay, n_slots=n_slots, io_depth=2, lookahead=2, engine=engine,
                copier=MemcpyCopier, pin=False, external_slots=1, trace=True)
    try:
        _load(r, "p", keys[:1], Priority.SPECULATIVE)
        assert r.wait(30)
        read_after_preload = r.stats.bytes_read
        assert r.stats.preload_staged == 1
        ext = n_slots  # the first caller-owned slot
        r.pool.views[ext][:HEADER_BYTES + BLOCK] = bytes(HEADER_BYTES + BLOCK)
        d = bytearray(BLOCK)
        r.load("prom", [(keys[0], d, BLOCK, ext, 0)])
        assert r.wait(30)
        done = {c.req_id: c for c in r.poll()}
        assert done["prom"].success
        assert bytes(d) == payload(keys[0], BLOCK)
        assert r.stats.preload_claimed == 1
        assert r.stats.bytes_read == read_after_preload  # served by the staged read
        with open(lay.path_for(keys[0]), "rb") as f:
            on_disk = f.read(HEADER_BYTES + BLOCK)
        assert bytes(r.pool.views[ext][:HEADER_BYTES + BLOCK]) == on_disk
        copies = [e for e in r.trace if e[1] == "claim_copy"]
        assert len(copies) == 1 and copies[0][2] == "prom" and copies[0][3] >= 0, copies
        d = os.path.join(str(root), "trace")
        os.makedirs(d)
        with open(os.path.join(d, "x.requests.json"), "w") as f:
            json.dump([["req", 16, t0, time.monotonic()]], f)
        with open(os.path.join(d, "x.r0.json"), "w") as f:
            json.dump([list(e) for e in r.trace], f)
        rows = os.path.join(str(root), "rows.json")
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        out = subprocess.run([sys.executable, os.path.join(repo, "scripts", "trace_report.py"),
                              d, "--json", rows], capture_output=True, text=True,
                             timeout=60, check=True).stdout
        assert "claim ms" in out
        with open(rows) as f:
            (row,) = json.load(f)
        assert row["claim_copy"] == 1
        assert row["claim_copy_ms"] == pytest.approx(copies[0][3] / 1e3)
    finally:
        close_reactor(r)
        lay.close()


def test_a_preload_never_evicts_a_fresh_unclaimed_preload(root, ns, engine):
    """``preload_keep_s`` = 30 s (off by default). More preloads than staging holds above
    the foreground reservation (one request's
    prefix longer than staging, or requests further back in the queue): the first ones
    stay staged for their loads, the rest are dropped unread (``preload_dropped_full``),
    never read only to be evicted by the next preload. The on-demand load then claims the
    staged prefix and reads the rest itself: every block read once, the right bytes.
    A staged preload older than ``preload_keep_s`` may be evicted by a later one; with 0
    (the default: every staged preload may be) the reads cycle through staging and waste."""
    lay, r, keys = _setup(root, ns, engine, 10, n_slots=5, io_depth=2, preload_keep_s=30)
    try:
        _load(r, "p", keys, Priority.SPECULATIVE)
        assert r.wait(30)
        s = r.stats
        staged = s.preload_staged
        assert staged >= 1 and s.preload_dropped_full == len(keys) - staged
        assert s.preload_wasted == 0 and s.bytes_read == staged * ns.file_bytes
        dests = _load(r, "fg", keys)
        assert r.wait(30)
        done = {c.req_id: c for c in r.poll()}
        assert done["fg"].success
        for k, d in zip(keys, dests, strict=True):
            assert bytes(d) == payload(k, BLOCK)
        assert s.preload_claimed == staged and s.preload_wasted == 0
        assert s.bytes_read == len(keys) * ns.file_bytes  # each block read once
        r.alloc.check()
    finally:
        close_reactor(r)
        lay.close()
    lay, r, keys = _setup(os.path.join(str(root), "keep0"), ns, engine, 10, n_slots=5,
                          io_depth=2)
    try:
        _load(r, "p", keys, Priority.SPECULATIVE)
        assert r.wait(30)
        assert r.stats.preload_dropped_full == 0 and r.stats.preload_staged == len(keys)
        assert r.stats.preload_wasted > 0  # read, then evicted by the next preload
    finally:
        close_reactor(r)
        lay.close()


def test_same_prefix_preloads_share_one_read(root, ns, engine):
    lay, r, keys = _setup(root, ns, engine, 1)
    try:
        for i in range(4):  # four candidates asking for the same block
            _load(r, f"p{i}", keys, Priority.SPECULATIVE)
        assert r.wait(30)
        assert all(c.success for c in r.poll())
        assert r.stats.bytes_read == ns.file_bytes
        assert r.stats.preload_deduped == 3 and r.stats.preload_staged == 1
    finally:
        close_reactor(r)
        lay.close()


def test_on_demand_load_never_reads_a_preloaded_block_twice(root, ns, engine):
    """Preload and on-demand load of the same key submitted back to back, many times:
    whatever the interleaving (claim of the staged slot, join of the read in flight, or
    the preload superseded before it reads), each block is read from disk exactly once and
    the bytes are right."""
    n = 24
    lay, r, keys = _setup(root, ns, engine, n, n_slots=8, io_depth=2)
    try:
        dests = []
        for i, k in enumerate(keys):
            _load(r, f"p{i}", [k], Priority.SPECULATIVE)
            dests += _load(r, f"fg{i}", [k])
        assert r.wait(60)
        done = r.poll()
        assert len(done) == 2 * n and all(c.success for c in done)
        for k, d in zip(keys, dests, strict=True):
            assert bytes(d) == payload(k, BLOCK)
        assert r.stats.bytes_read == n * ns.file_bytes
        s = r.stats
        assert s.preload_claimed + s.preload_joined + s.preload_deduped >= 1
        assert r.alloc.peak_busy <= r.alloc.n_slots
    finally:
        close_reactor(r)
        lay.close()


def test_staged_preloads_are_reclaimed_by_foreground_work(root, ns, engine):
    """More preloads than the pool holds, then foreground loads of OTHER keys: foreground
    reclaims staged slots; every load completes; the pool bound holds."""
    lay, r, keys = _setup(root, ns, engine, 16, n_slots=5, io_depth=2)
    try:
        _load(r, "p", keys[:10], Priority.SPECULATIVE)
        assert r.wait(60)
        dests = _load(r, "fg", keys[10:])
        assert r.wait(60)
        done = {c.req_id: c for c in r.poll()}
        assert done["fg"].success
        for k, d in zip(keys[10:], dests, strict=True):
            assert bytes(d) == payload(k, BLOCK)
        assert r.alloc.peak_busy <= 5 and r.alloc.busy + r.alloc.cached <= 5
        assert r.alloc.reclaimed > 0
        # every staged block whose slot went to the foreground loads was a wasted read
        assert r.stats.preload_wasted == r.alloc.reclaimed > 0
        assert r.stats.preload_claimed == 0
        r.alloc.check()
    finally:
        close_reactor(r)
        lay.close()


def test_preload_of_a_missing_or_corrupt_file_is_a_quiet_miss(root, ns, engine):
    lay, r, keys = _setup(root, ns, engine, 1)
    try:
        path = lay.path_for(keys[0])
        with open(path, "r+b") as f:  # flip one payload byte
            f.seek(HEADER_BYTES + 10)
            b = f.read(1)
            f.seek(HEADER_BYTES + 10)
            f.write(bytes([b[0] ^ 0xFF]))
        _load(r, "p", [keys[0], b"absent"], Priority.SPECULATIVE)
        assert r.wait(30)
        (c,) = r.poll()
        assert c.ok == [False, False]
        assert r.stats.preload_staged == 0 and not lay.exists(keys[0])
        (d,) = _load(r, "fg", keys[:1])  # on-demand after the failed preload: a miss
        assert r.wait(30)
        (c,) = r.poll()
        assert c.ok == [False] and not any(d)
    finally:
        close_reactor(r)
        lay.close()


@pytest.mark.parametrize("spec_depth", [1, 2, 4])
def test_a_stuck_preload_never_delays_on_demand_loads_or_stores(root, ns, spec_depth):
    """R8 with a throttled disk: the speculative reads are stuck (their completions are
    withheld: one, or ``preload_depth`` of them); on-demand loads of other blocks and a
    store still complete, in full, while they are stuck; the preloads complete once the
    disk moves. io_depth 3: with 4 allowed, the cap (io_depth - 1) keeps a unit free."""
    import threading

    from helpers.kvutil import GatedReadEngine, sentinel_buf, wait_until

    lay = Layout(root, ns)
    keys = [f"ord-{i}".encode() for i in range(7)]
    spec = [f"spec-{i}".encode() for i in range(4)]
    for k in keys + spec:
        assert lay.write_block(k, payload(k, BLOCK))
    gate = threading.Event()
    eng = GatedReadEngine(3, gate, {lay.path_for(k)[-16:] for k in spec})
    r = Reactor(lay, n_slots=8, io_depth=3, lookahead=2, engine=eng, copier=MemcpyCopier,
                pin=False, early_store_ack=True, store_policy="drop", spec_depth=spec_depth)
    stuck = min(spec_depth, 2)
    try:
        for i, k in enumerate(spec):
            r.load(("spec", i), [(k, None, 0)], Priority.SPECULATIVE)
        assert wait_until(lambda: len(eng.held) >= stuck, 10)  # the reads are stuck
        threading.Event().wait(0.1)
        assert len(eng.held) == stuck
        dests = [sentinel_buf(BLOCK) for _ in keys[1:]]
        r.load("fg", [(k, d, BLOCK) for k, d in zip(keys[1:], dests, strict=True)])
        s = b"ord-store"
        r.store("st", [(s, payload(s, BLOCK), BLOCK)])
        seen: dict = {}

        def done() -> bool:
            for c in r.poll():
                seen[(c.req_id, c.kind)] = c
            return ("fg", "load") in seen and ("st", "store") in seen

        assert wait_until(done, 20), seen
        assert seen[("fg", "load")].ok == [True] * 6 and seen[("st", "store")].ok == [True]
        assert not any(rid[0] == "spec" for rid, _ in seen) and eng.held  # still stuck
        for k, d in zip(keys[1:], dests, strict=True):
            assert bytes(d) == payload(k, BLOCK)
        assert lay.read_block(s) == payload(s, BLOCK)
        gate.set()
        eng.wake()
        assert r.wait(10)
        assert r.stats.preload_staged == len(spec)
    finally:
        gate.set()
        eng.wake()
        close_reactor(r)
        lay.close()
