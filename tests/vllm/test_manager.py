"""Fast tests of :mod:`kvcache_core.vllm.manager` without an engine: the manager's
slot bookkeeping, write-back, lookups, reports and stats."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
from helpers.vllm_units import key

from kvcache_core.layout import Layout, Namespace
from kvcache_core.reactor import IN_SLOT


def test_manager_pins_dram_slots_until_every_rank_wrote_them(tmp_path, vllm_available):
    """Write-back: a DRAM-tier slot stays pinned from complete_store until all ranks
    reported its key written (in any order: the report may come first), so it is never
    handed to another key while a file is still being written from it; with disk writes
    off (no_disk) nothing is pinned; reset_cache forgets pending write-backs."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager

    nss = [Namespace("m", "bf16", 256, 1 << 16, tp_rank=r, tp_size=2) for r in range(2)]
    m = PyKVCacheManager(str(tmp_path), nss, n_dram=2, writeback_max_fraction=1.0)
    r = ReqContext("r")
    k1, k2, k3, k4 = (key(i) for i in range(1, 5))
    assert m.prepare_store([k1, k2], r).store_spec.dram_slots == [0, 1]
    m.on_worker_report(set(), {}, None, {k2: 2})  # k2 written on both ranks before the ack
    m.complete_store([k1, k2], r)
    assert m.stats()["dram_writeback_pinned"] == 1  # k1 only
    out = m.prepare_store([k3], r)  # k2's slot is the only one free to reclaim
    assert out.store_spec.dram_slots == [1] and out.evicted_keys == [k2]
    m.complete_store([k3], r)
    assert m.prepare_store([k4], r).store_spec.dram_slots == [-1]  # k1, k3 pinned
    m.complete_store([k4], r)
    m.on_worker_report(set(), {}, None, {k1: 1})  # one rank of two: still pinned
    assert m.prepare_store([key(5)], r).store_spec.dram_slots == [-1]
    m.complete_store([key(5)], r)
    m.on_worker_report(set(), {}, None, {k1: 1, key(99): 1})  # unknown key: ignored
    assert m.stats()["dram_writeback_pinned"] == 1  # k3 still pending
    out = m.prepare_store([key(6)], r)
    assert out.store_spec.dram_slots == [0] and out.evicted_keys == [k1]
    m.complete_store([key(6)], r)
    m.dram.check()
    m.reset_cache()
    assert m.stats()["dram_writeback_pinned"] == 0
    m.disk_stores = False  # break-even table: DRAM only, nothing written, nothing pinned
    m.prepare_store([key(7)], r)
    m.complete_store([key(7)], r)
    assert m.stats()["dram_writeback_pinned"] == 0


def test_manager_auto_writeback_cap_tightens_while_busy(tmp_path, vllm_available,
                                                       monkeypatch):
    """writeback_max_fraction="auto" (the default): with no disk load in flight the
    write-back may hold half the tier (a 10-slot tier: 5 of 6 new blocks get a file);
    while one is in flight, or while requests wait in the patched scheduler's queue
    (and for WB_BUSY_HOLD_S after they did), only a tenth (1 slot), since the reactor
    then starts no file (write_depth_reading) and the pending blocks would crowd the
    tier that queued requests read. A fixed number keeps one bound."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvcache_core.vllm import manager as manager_mod
    from kvcache_core.vllm.manager import PyKVCacheManager

    ns = Namespace("m", "bf16", 256, 1 << 16)
    m = PyKVCacheManager(str(tmp_path / "auto"), [ns], n_dram=10)
    w = ReqContext("idle")
    spec = m.prepare_store([key(i) for i in range(1, 7)], w).store_spec
    assert [spec.writes_file(i) for i in range(6)] == [True] * 5 + [False]
    m.complete_store([key(i) for i in range(1, 7)], w)
    m.disk_loads_in_flight = 1  # a load reading from disk (prepare_load counts it)
    r = ReqContext("reading")
    spec = m.prepare_store([key(i) for i in range(11, 14)], r).store_spec
    assert not any(spec.writes_file(i) for i in range(3))  # 5 pending >= 1: none
    m.disk_loads_in_flight = 0
    # requests waiting in the patched scheduler's queue: busy too, their loads are next
    # (the H100's queued mixed run: with only the disk-load test the write-back took
    # half the tier between loads, and the reusing requests re-read 577 chunks)
    q = PyKVCacheManager(str(tmp_path / "queue"), [ns], n_dram=10)
    q.note_waiting(3)  # on_preload_candidates, this step
    spec = q.prepare_store([key(i) for i in range(21, 24)], w).store_spec
    assert [spec.writes_file(i) for i in range(3)] == [True, False, False]
    q.complete_store([key(i) for i in range(21, 24)], w)
    q.end_step()
    assert q.requests_waiting == 0
    # the queue emptied a moment ago: still the busy bound (WB_BUSY_HOLD_S)
    spec = q.prepare_store([key(i) for i in range(31, 33)], w).store_spec
    assert not any(spec.writes_file(i) for i in range(2))
    q.complete_store([key(i) for i in range(31, 33)], w)
    monkeypatch.setattr(manager_mod, "WB_BUSY_HOLD_S", 0.0)
    q.note_waiting(1)
    q.end_step()  # nothing waited for longer than the hold: the idle bound again
    spec = q.prepare_store([key(i) for i in range(41, 45)], w).store_spec
    assert [spec.writes_file(i) for i in range(4)] == [True, True, True, True]
    fixed = PyKVCacheManager(str(tmp_path / "fixed"), [ns], n_dram=10,
                             writeback_max_fraction=0.2)
    spec = fixed.prepare_store([key(i) for i in range(1, 4)], w).store_spec
    assert [spec.writes_file(i) for i in range(3)] == [True, True, False]


def test_manager_writeback_cap_keeps_slots_for_promotions(tmp_path, vllm_available):
    """writeback_max_fraction: stores hold at most that share of the DRAM tier while their
    files are pending (storing or pinned); further stores still fill a DRAM slot but
    write no file (dram_only, counted) and pin nothing, so a disk hit can still be
    promoted into the tier and a second request for the block waits for that one read
    (HIT_PENDING). A promoted block counts as a reuse: with ARC a burst of new stores
    evicts the stored-only blocks, not it. Pinned slots come back when the writes end."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager

    ns = Namespace("m", "bf16", 256, 1 << 16)
    m = PyKVCacheManager(str(tmp_path), [ns], n_dram=4, eviction_policy="arc",
                         writeback_max_fraction=0.5)
    w = ReqContext("writer")
    ks = [key(i) for i in range(1, 5)]
    spec = m.prepare_store(ks, w).store_spec
    assert all(s >= 0 for s in spec.dram_slots) and not spec.no_disk
    assert spec.dram_only == [False, False, True, True]
    assert [spec.writes_file(i) for i in range(4)] == [True, True, False, False]
    assert m.stats()["stores_writeback_full"] == 2
    m.complete_store(ks, w)
    assert m.stats()["dram_writeback_pinned"] == 2  # the dram_only ones pin nothing
    assert all(m.dram.lookup(k) >= 0 for k in ks)
    # a block on disk (another process stored it), read by two requests at once
    lay = Layout(str(tmp_path), ns)
    hot = key(50)
    assert lay.write_block(bytes(hot), bytes(ns.block_bytes))
    a, b = ReqContext("a"), ReqContext("b")
    assert m.lookup(hot, a) == LookupResult.HIT
    load = m.prepare_load([hot], a)
    assert load.dram_slots[0] >= 0  # promoted into a slot the cap left reclaimable
    assert m.lookup(hot, b) == LookupResult.HIT_PENDING  # one disk read for both
    m.complete_load([hot], a)
    assert m.lookup(hot, b) == LookupResult.HIT and m.dram.lookup(hot) >= 0
    # the writes end: their slots become reclaimable, and stores write files again
    m.on_worker_report(set(), {}, None, {ks[0]: 1, ks[1]: 1})
    assert m.stats()["dram_writeback_pinned"] == 0
    burst = [key(i) for i in range(100, 106)]
    for k in burst:
        spec = m.prepare_store([k], w).store_spec
        assert spec.dram_only is None and spec.writes_file(0)
        m.complete_store([k], w)
        m.on_worker_report(set(), {}, None, {k: 1})
    assert m.dram.lookup(hot) >= 0  # the reused block survived six new stores
    m.dram.check()


def test_manager_flushes_dram_only_blocks_when_the_writeback_has_room(tmp_path,
                                                                      vllm_available):
    """writeback_flush: blocks kept in the DRAM tier without a file (write-back full) are
    not lost to the disk tier: once the write-back has room, take_flush_plan hands the
    oldest of them to the workers (pinned like any write-back until every rank reports
    them written), as many as the room allows. One evicted before that is counted
    (dram_only_evicted) and never planned; one already on disk (another instance) is
    skipped; with disk writes off (break-even gate) nothing is planned; with
    writeback_flush off (the default) nothing ever is."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager

    ns = Namespace("m", "bf16", 256, 1 << 16)
    off = PyKVCacheManager(str(tmp_path / "off"), [ns], n_dram=4, writeback_max_fraction=0.5)
    m = PyKVCacheManager(str(tmp_path), [ns], n_dram=4, writeback_max_fraction=0.5,
                         writeback_flush=True)
    w = ReqContext("w")
    ks = [key(i) for i in range(1, 5)]
    off.prepare_store(ks, w)
    off.complete_store(ks, w)
    off.on_worker_report(set(), {}, None, {ks[0]: 1, ks[1]: 1})
    assert off.take_flush_plan() == []  # writeback_flush off (the default): never
    assert off.stats()["dram_unwritten"] == 2  # and they stay without a file
    spec = m.prepare_store(ks, w).store_spec
    assert spec.dram_only == [False, False, True, True]
    m.complete_store(ks, w)
    assert m.stats()["dram_unwritten"] == 2  # ks[2], ks[3]: in the tier, no file yet
    assert m.take_flush_plan() == []  # write-back still full (ks[0], ks[1] pinned)
    m.on_worker_report(set(), {}, None, {ks[0]: 1, ks[1]: 1})
    plan = m.take_flush_plan()
    assert plan == [(bytes(ks[2]), m.dram.lookup(ks[2])), (bytes(ks[3]), m.dram.lookup(ks[3]))]
    assert m.stats()["dram_writeback_pinned"] == 2 and m.stats()["flushes_planned"] == 2
    assert m.take_flush_plan() == []  # planned once
    m.on_worker_report(set(), {}, None, {ks[2]: 1, ks[3]: 1})
    assert m.stats()["dram_writeback_pinned"] == 0 and m.stats()["dram_unwritten"] == 0
    m.dram.check()

    # evicted before its flush: lost to the cache, counted, never planned
    m = PyKVCacheManager(str(tmp_path / "b"), [ns], n_dram=2, writeback_max_fraction=0.5,
                         writeback_flush=True)
    a, b, c = key(10), key(11), key(12)
    assert m.prepare_store([a, b], w).store_spec.dram_only == [False, True]
    m.complete_store([a, b], w)  # a pinned (its write pending), b dirty
    out = m.prepare_store([c], w)  # b is the only reclaimable slot
    assert out.evicted_keys == [b] and out.store_spec.dram_only == [True]
    m.complete_store([c], w)
    assert m.stats()["dram_only_evicted"] == 1
    Layout(str(tmp_path / "b"), ns).write_block(bytes(c), bytes(ns.block_bytes))
    m.on_worker_report(set(), {}, None, {a: 1})
    assert m.take_flush_plan() == []  # c: on disk already (another instance)

    # disk writes off: nothing to flush
    m = PyKVCacheManager(str(tmp_path / "c"), [ns], n_dram=2, writeback_max_fraction=0.5,
                         writeback_flush=True)
    m.prepare_store([a, b], w)
    m.complete_store([a, b], w)
    m.on_worker_report(set(), {}, None, {a: 1})
    m.disk_stores = False
    assert m.take_flush_plan() == []
    m.disk_stores = True
    assert m.take_flush_plan() == [(bytes(b), m.dram.lookup(b))]


def test_manager_positive_lookup_cache(tmp_path, vllm_available):
    """disk_lookup_cache_s: a lookup that found a block's files is believed for that long
    (no filesystem call; counted in lookups_cached), a miss is never cached (a file that
    appears later is found at once: visibility lag of a distributed filesystem), a failed
    load of the block drops the entry so the next lookup asks the filesystem again, and
    reset_cache forgets everything. Off (0, the default off FUSE): every lookup asks."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager

    ns = Namespace("m", "bf16", 256, 1 << 16)
    lay = Layout(str(tmp_path), ns)
    r = ReqContext("r")
    k, late = key(1), key(2)
    m = PyKVCacheManager(str(tmp_path), [ns], n_dram=0, lookup_cache_s=60.0)
    off = PyKVCacheManager(str(tmp_path), [ns], n_dram=0)
    assert m.lookup(late, r) == LookupResult.MISS
    assert lay.write_block(bytes(k), bytes(ns.block_bytes))
    assert lay.write_block(bytes(late), bytes(ns.block_bytes))
    assert m.lookup(late, r) == LookupResult.HIT  # the earlier miss was not cached
    assert m.lookup(k, r) == LookupResult.HIT and off.lookup(k, r) == LookupResult.HIT
    os.unlink(lay.path_for(bytes(k)))  # evicted by some other process
    assert off.lookup(k, r) == LookupResult.MISS
    assert m.lookup(k, r) == LookupResult.HIT  # believed: no filesystem call
    assert m.stats()["lookups_cached"] == 1
    m.on_worker_report({bytes(k)}, {})  # its load failed (file missing): entry dropped
    m._bad.clear()  # (the failed-load quarantine is tested elsewhere)
    assert m.lookup(k, r) == LookupResult.MISS
    assert m.lookup(late, r) == LookupResult.HIT and m.stats()["lookups_cached"] == 2
    m.reset_cache()
    os.unlink(lay.path_for(bytes(late)))
    assert m.lookup(late, r) == LookupResult.MISS


def test_manager_short_requests_keep_dram_only_and_pin_nothing(tmp_path, vllm_available):
    """disk_min_prefix_tokens: a request the connector marked short stores into the DRAM
    tier without files (no_disk, slot not pinned for a write-back, counted); without a
    DRAM slot its chunks are skipped; a long request in the same step still writes."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager

    m = PyKVCacheManager(str(tmp_path), [Namespace("m", "bf16", 256, 1 << 16)], n_dram=2,
                         writeback_max_fraction=1.0)
    short, long_ = ReqContext("short"), ReqContext("long")
    m.short_requests.add("short")
    out = m.prepare_store([key(1)], short)
    assert out.store_spec.no_disk and out.store_spec.dram_slots == [0]
    out_l = m.prepare_store([key(2)], long_)
    assert not out_l.store_spec.no_disk and out_l.store_spec.dram_slots == [1]
    m.complete_store([key(1)], short)
    m.complete_store([key(2)], long_)
    st = m.stats()
    assert st["dram_writeback_pinned"] == 1  # key(2) only: key(1) has no file coming
    assert st["stores_dram_only_short"] == 1
    out = m.prepare_store([key(3)], short)  # reclaims key(1)'s slot (unpinned)
    assert out.store_spec.dram_slots == [0] and out.evicted_keys == [key(1)]
    m.complete_store([key(3)], short)
    m.prepare_store([key(9)], long_)  # both slots taken (key(2) pinned, key(3) evictable)
    assert m.prepare_store([key(4)], short).keys_to_store == []  # no slot, no file: skip
    assert m.stats()["stores_skipped_short"] == 1


def test_manager_requests_below_the_store_floor_store_nothing(tmp_path, vllm_available):
    """min_store_prefix_tokens: a request the connector marked below the floor stores
    nothing (no slot taken, nothing evicted, counted); a request in the same step that
    is not marked stores as before."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager

    m = PyKVCacheManager(str(tmp_path), [Namespace("m", "bf16", 256, 1 << 16)], n_dram=1)
    long_, short = ReqContext("long"), ReqContext("short")
    m.prepare_store([key(1)], long_)
    m.complete_store([key(1)], long_)
    m.nostore_requests.add("short")
    out = m.prepare_store([key(2), key(3)], short)
    assert out.keys_to_store == [] and out.evicted_keys == []
    st = m.stats()
    assert st["stores_skipped_below_floor"] == 2 and st["stores"] == 1
    assert st["dram_cached"] == 1  # key(1) kept its slot
    m.nostore_requests.discard("short")
    assert m.prepare_store([key(2)], short).keys_to_store == [key(2)]


def test_manager_recompute_only_after_a_dead_reactor(tmp_path, vllm_available):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager

    m = PyKVCacheManager(str(tmp_path), [Namespace("m", "bf16", 256, 1 << 16)], n_dram=2)
    r = ReqContext("r")
    m.prepare_store([key(1)], r)
    m.complete_store([key(1)], r)
    assert m.lookup(key(1), r) == LookupResult.HIT and m.stats()["healthy"] == 1
    m.on_worker_report(set(), {"reactor_dead": 1})
    assert m.lookup(key(1), r) == LookupResult.MISS
    assert m.prepare_store([key(2)], r).keys_to_store == []
    assert m.stats()["healthy"] == 0


def test_manager_stats_file_written_off_the_scheduler_thread(tmp_path, vllm_available,
                                                          monkeypatch):
    """$KVCACHE_STATS_FILE is written by the exporter thread, never by the scheduler
    thread that reports (a file create + rename there can wait for the disk's journal),
    soon after each report, and with the final counters at shutdown."""
    import threading

    from vllm.v1.kv_offload.base import ReqContext

    import kvcache_core.vllm.manager as M
    from kvcache_core.bench.common import read_stats_file

    path = str(tmp_path / "stats.json")
    monkeypatch.setenv("KVCACHE_STATS_FILE", path)
    writers: list[str] = []
    real_replace = os.replace

    def spy(src, dst, *a, **kw):
        if dst == path:
            writers.append(threading.current_thread().name)
        return real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(M.os, "replace", spy)
    m = M.PyKVCacheManager(str(tmp_path / "root"), [Namespace("m", "bf16", 256, 1 << 16)],
                           n_dram=2)
    t0 = time.time()
    m.prepare_store([key(1)], ReqContext("r"))
    m.on_worker_report(set(), {"chunks_loaded_disk": 3})
    assert read_stats_file(path, since=t0)["chunks_loaded_disk"] == 3
    m.on_worker_report(set(), {"chunks_loaded_disk": 2})
    m.shutdown()
    with open(path) as f:
        assert json.load(f)["chunks_loaded_disk"] == 5  # the last report, written at shutdown
    assert writers and set(writers) == {"kvcache-stats"}


def test_disk_bytes_is_a_gauge_summed_over_ranks(tmp_path, vllm_available):
    """The workers send the namespace ledger they last saw (``disk_bytes``) as deltas;
    the scheduler exposes the sum over ranks as a Prometheus gauge, never as a counter
    (it goes down when files are evicted)."""
    from kvcache_core.layout import Ledger
    from kvcache_core.vllm.manager import METRIC_PREFIX, PyKVCacheManager

    led = Ledger(str(tmp_path / ".usage"))
    try:
        assert led.last == 0
        assert led.add(300) == 300 and led.last == 300
        led.set(120)
        assert led.last == 120
    finally:
        led.close()
    m = PyKVCacheManager(str(tmp_path), [Namespace("m", "bf16", 256, 1 << 16)], n_dram=2)
    m.on_worker_report(set(), {"disk_bytes": 1000, "chunks_loaded_disk": 1})
    m.on_worker_report(set(), {"disk_bytes": 500})  # a second rank's namespace
    st = m.get_stats()
    types, vals = st.data["types"], st.data["data"]
    assert types[METRIC_PREFIX + "disk_bytes"] == "gauge"
    assert types[METRIC_PREFIX + "chunks_loaded_disk"] == "counter"
    assert sum(vals[METRIC_PREFIX + "disk_bytes"].values()) == 1500
    m.on_worker_report(set(), {"disk_bytes": -700})  # evictions
    assert m.stats()["disk_bytes"] == 800


def test_manager_concurrent_loads_of_one_block_read_it_once(tmp_path, vllm_available):
    """While one request reads a disk block into the DRAM tier, another request's lookup
    of that block is HIT_PENDING (vLLM retries it next step) and then a DRAM hit: one
    disk read per block. A failed promotion ends the wait with the block a miss."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager

    ns = Namespace("m", "bf16", 256, 1 << 16)
    m = PyKVCacheManager(str(tmp_path), [ns], n_dram=4)
    r1, r2 = ReqContext("r1"), ReqContext("r2")
    k1, k2 = key(1), key(2)
    for k in (k1, k2):
        p = m.disk[0].path_for(k)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        open(p, "w").close()
    assert m.lookup(k1, r1) == LookupResult.HIT
    spec = m.prepare_load([k1, k2], r1)
    assert spec.flags == [0, 0] and min(spec.dram_slots) >= 0  # both promoted
    assert m.lookup(k1, r2) == LookupResult.HIT_PENDING
    assert m.plan_preloads([], [], 8) == []
    m.on_worker_report({k2}, {})  # k2's read failed
    m.complete_load([k1, k2], r1)
    assert m.lookup(k1, r2) == LookupResult.HIT and m.dram.lookup(k1) >= 0
    assert m.lookup(k2, r2) == LookupResult.MISS  # failed: a miss for a while, no wait
    s = m.stats()
    assert s["hits_pending"] == 1 and s["loads_disk"] == 2
    spec = m.prepare_load([k1], r2)
    assert spec.flags == [IN_SLOT]  # served from the DRAM tier, not read again
    m.complete_load([k1], r2)
    m.dram.check()


def test_manager_join_promotions_loads_from_the_promotion_slot(tmp_path, vllm_available):
    """``join_promotions``: a lookup of a block another request is promoting is a HIT
    (not HIT_PENDING), and its load copies from that promotion's slot (IN_SLOT |
    AFTER_LOAD: the reactor waits for the read); once the promotion ended, the block is
    a DRAM hit (retained) or, if the read failed, read again. One promotion, one slot."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvcache_core.flags import AFTER_LOAD
    from kvcache_core.vllm.manager import PyKVCacheManager

    ns = Namespace("m", "bf16", 256, 1 << 16)
    m = PyKVCacheManager(str(tmp_path), [ns], n_dram=4, join_promotions=True)
    r1, r2, r3 = ReqContext("r1"), ReqContext("r2"), ReqContext("r3")
    k1, k2 = key(1), key(2)
    for k in (k1, k2):
        p = m.disk[0].path_for(k)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        open(p, "w").close()
    spec1 = m.prepare_load([k1, k2], r1)
    assert spec1.flags == [0, 0] and min(spec1.dram_slots) >= 0  # both promoted
    assert m.lookup(k1, r2) == LookupResult.HIT and m.lookup(k2, r2) == LookupResult.HIT
    assert m.lookup_tier() == "disk"  # it waits for a disk read: the gate sees the disk
    spec2 = m.prepare_load([k1, k2], r2)
    assert spec2.dram_slots == spec1.dram_slots
    assert spec2.flags == [IN_SLOT | AFTER_LOAD] * 2
    s = m.stats()
    assert s["hits_promoting"] == 2 and s["hits_pending"] == 0
    assert s["loads_join_promotion"] == 2 and s["promotions"] == 2
    assert m.disk_loads_in_flight == 4
    m.on_worker_report({k2}, {})  # the promotion of k2 failed (so did r2's copy of it)
    m.complete_load([k1, k2], r1)
    m.complete_load([k1, k2], r2)
    assert m.disk_loads_in_flight == 0 and not m._promote_slot
    assert m.lookup(k1, r3) == LookupResult.HIT and m.dram.lookup(k1) >= 0
    assert m.prepare_load([k1], r3).flags == [IN_SLOT]  # retained: a plain DRAM hit
    m.complete_load([k1], r3)
    # without the option, the same lookup waits (HIT_PENDING), as before
    off = PyKVCacheManager(str(tmp_path / "off"), [ns], n_dram=4)
    p = off.disk[0].path_for(k1)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    open(p, "w").close()
    off.prepare_load([k1], r1)
    assert off.lookup(k1, r2) == LookupResult.HIT_PENDING
    m.dram.check()


def test_manager_slots_hits_and_failures(tmp_path, vllm_available):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager

    ns = Namespace("m", "bf16", 256, 1 << 16)
    m = PyKVCacheManager(str(tmp_path), [ns], n_dram=2, writeback_max_fraction=1.0)
    r1, r2 = ReqContext("r1"), ReqContext("r2")
    k1, k2, k3 = key(1), key(2), key(3)

    def on_disk(k: bytes) -> None:
        p = m.disk[0].path_for(k)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        open(p, "w").close()

    assert m.lookup(k1, r1) == LookupResult.MISS
    out = m.prepare_store([k1, k2], r1)
    assert out.keys_to_store == [k1, k2] and out.store_spec.dram_slots == [0, 1]
    assert m.lookup(k1, r1) == LookupResult.MISS  # store in flight
    assert m.prepare_store([k1], r2).keys_to_store == []
    m.complete_store([k1, k2], r1)
    assert m.lookup(k1, r1) == LookupResult.HIT
    # both slots are still being written to disk from: pinned, so a new store gets none
    out = m.prepare_store([k3], r2)
    assert out.keys_to_store == [k3] and out.store_spec.dram_slots == [-1]
    assert out.evicted_keys == [] and m.stats()["stores_no_dram_slot"] == 1
    m.complete_store([k3], r2)
    m.on_worker_report(set(), {}, None, {k1: 1, k2: 1})  # the workers wrote them
    assert m.stats()["dram_writeback_pinned"] == 0
    out = m.prepare_store([k3, k2], r1)  # full: evicts k1 (LRU), never k2 (in this call)
    assert out.keys_to_store == [k3] and out.evicted_keys == [k1]
    m.complete_store([k3], r1)
    m.on_worker_report(set(), {}, None, {k3: 1})
    on_disk(k1)
    assert m.lookup(k1, r1) == LookupResult.HIT
    assert m.stats()["hits_disk"] == 1 and m.stats()["hits_dram"] == 1
    # load k1 (disk) + k2 (DRAM): k2 is pinned first, so k1's promotion evicts k3
    spec = m.prepare_load([k1, k2], r2)
    assert spec.flags == [0, IN_SLOT] and spec.dram_slots[1] == 1 and spec.dram_slots[0] == 0
    m.complete_load([k1, k2], r2)
    assert m.dram.lookup(k1) == 0 and m.dram.lookup(k2) == 1 and m.dram.lookup(k3) == -1
    # a failed DRAM read: the key leaves the DRAM tier
    m.prepare_load([k2], r1)
    m.on_worker_report({k2}, {"chunks_failed": 1})
    m.complete_load([k2], r1)
    assert m.dram.lookup(k2) == -1 and m.lookup(k2, r1) == LookupResult.MISS
    # a failed promotion is not retained
    on_disk(k3)
    spec = m.prepare_load([k3], r1)
    assert spec.dram_slots[0] >= 0 and spec.flags == [0]
    m.on_worker_report({k3}, {})
    m.complete_load([k3], r1)
    assert m.dram.lookup(k3) == -1
    s = m.stats()
    assert s["load_failures"] == 2 and s["chunks_failed"] == 1 and s["promotions"] == 2
    m.dram.check()
    st = m.get_stats()
    assert st is not None and m.get_stats() is None  # deltas only, gauges when changed
    assert st._values["vllm:pykvcache_healthy"] == {(): 1}
    # job latencies from the workers become histogram observations (once)
    m.on_worker_report(set(), {}, None, None, {"load_disk": [0.2, 0.4], "bogus": [1.0]})
    st = m.get_stats()
    assert st is not None and st._types["vllm:pykvcache_load_disk_seconds"] == "histogram"
    assert sorted(st._values["vllm:pykvcache_load_disk_seconds"][()]) == [0.2, 0.4]
    assert not any("bogus" in k for k in st._values) and m.get_stats() is None
    g = m.gauges()
    assert g["healthy"] == 1 and g["dram_cached"] == m.dram.cached
    assert g["stores_in_flight"] == 0 and g["loads_in_flight"] == 0
    m.prepare_store([key(77)], r1)  # a gauge moves: the next report carries it
    st2 = m.get_stats()
    assert st2 is not None and st2._values["vllm:pykvcache_stores_in_flight"] == {(): 1}
    m.reset_cache()
    assert m.lookup(k1, r1) == LookupResult.HIT  # disk stays; DRAM forgotten
    assert m.dram.cached == 0


def test_manager_staged_blocks_count_as_fast_tier(tmp_path, vllm_available, monkeypatch):
    """Keys every rank reported staged (queue-aware preload) are looked up as tier
    ``staged``, the leading non-disk chunks are counted, a load claims them, and the
    belief expires."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvcache_core.vllm import manager as M

    nss = [Namespace("m", "bf16", 256, 1 << 16, tp_rank=r, tp_size=2) for r in range(2)]
    m = M.PyKVCacheManager(str(tmp_path), nss, n_dram=0)
    assert m.n_ranks == 2 and m.key_bytes == 2 * nss[0].file_bytes
    ks = [key(i) for i in range(1, 4)]
    for k in ks:
        for d in m.disk:
            p = d.path_for(k)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            open(p, "w").close()
    r = ReqContext("r")

    def look():
        m.begin_lookup()
        assert all(m.lookup(k, r) == LookupResult.HIT for k in ks)
        return m.lookup_tier(), m.lookup_fast_chunks()

    assert look() == ("disk", (0, "dram"))
    m.on_worker_report(set(), {}, {ks[0]: 2, ks[1]: 1})  # ks[1]: only one rank staged it
    assert look() == ("disk", (1, "staged"))
    m.on_worker_report(set(), {}, {ks[1]: 2, ks[2]: 2})
    assert look() == ("staged", (3, "staged"))
    assert m.stats()["hits_staged"] == 1 + 3
    m.prepare_load([ks[0]], r)  # claimed: no longer believed staged
    assert look() == ("disk", (0, "dram"))
    m.complete_load([ks[0]], r)
    m.on_worker_report({ks[1]}, {}, {})  # a failed key leaves the staged set too
    monkeypatch.setattr(M.time, "monotonic", lambda: 1e12)  # past the TTL
    m.begin_lookup()
    assert m.lookup(ks[2], r) == LookupResult.HIT and m.lookup_tier() == "disk"


def test_manager_evicts_a_prefix_tail_first(tmp_path, vllm_available):
    """A hit must be a prefix: when the DRAM tier is full, a request's LAST block goes
    first, also when its blocks were stored in two jobs (vLLM touches the request's whole
    key list at lookup and at every store job; a store's completion restores the order)."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager

    for policy in ("lru", "arc"):
        m = PyKVCacheManager(str(tmp_path / policy), [Namespace("m", "bf16", 256, 1 << 16)],
                             n_dram=3, writeback_max_fraction=1.0, eviction_policy=policy)
        m.disk_stores = False  # DRAM tier only: no write-back pins
        a, b = ReqContext("a"), ReqContext("b")
        keys = [key(1), key(2), key(3)]  # vLLM's list for request a (grows as it runs)
        m.touch(keys, a)  # lookup: nothing cached yet
        m.prepare_store(keys[:2], a)  # job 1: the first two chunks
        m.touch(keys, a)
        m.complete_store(keys[:2], a)
        m.prepare_store(keys[2:], a)  # job 2: the last chunk
        m.touch(keys, a)
        m.complete_store(keys[2:], a)
        out = m.prepare_store([key(9)], b)  # tier full: one block must go
        assert out.evicted_keys == [key(3)], (policy, out.evicted_keys)
        out = m.prepare_store([key(8)], b)
        assert out.evicted_keys == [key(2)], (policy, out.evicted_keys)


def test_manager_lru_admit_serves_a_loop_that_lru_cannot(tmp_path, vllm_available):
    """eviction_policy=lru-admit: 4 contexts of 8 blocks visited round-robin through a
    20-slot DRAM tier. Plain LRU evicts each context just before its next visit (0 hits);
    with the self-enabling filter the tier keeps blocks that more requests asked for,
    serves later rounds and stores fewer blocks. Driven as vLLM does: touch at lookup,
    lookups until the first miss, then prepare/complete_store of the missing blocks."""
    from helpers.access_patterns import loop
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager

    res = {}
    for policy in ("lru", "lru-admit"):
        m = PyKVCacheManager(str(tmp_path / policy), [Namespace("m", "bf16", 256, 1 << 16)],
                             n_dram=20, eviction_policy=policy)
        m.disk_stores = False  # DRAM tier only
        hits = 0
        for i, ids in enumerate(loop(4, 8, 4)):
            ctx, keys = ReqContext(f"r{i}"), [key(k) for k in ids]
            m.touch(keys, ctx)
            n = 0
            while n < len(keys) and m.lookup(keys[n], ctx) == LookupResult.HIT:
                n += 1
            hits += n
            out = m.prepare_store(keys[n:], ctx)
            m.complete_store(out.keys_to_store, ctx)
        res[policy] = (hits, m.stats())
    assert res["lru"][0] == 0
    assert res["lru-admit"][0] > 0
    st = res["lru-admit"][1]
    assert st["stores_not_admitted"] > 0 and st["stores"] < res["lru"][1]["stores"]
    assert st["dram_admission_active"] == 1 and res["lru"][1]["dram_admission_active"] == 0


def test_manager_holds_synchronous_loads_until_the_workers_copied_them(tmp_path,
                                                                        vllm_available):
    """``dram_load_sync``: vLLM's scheduler completes the load job when it schedules the
    request, but the slots stay pinned (no eviction, counted in flight, visible to
    ``loads_of``) until :meth:`release_held`; a key that failed meanwhile is dropped."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager

    ns = Namespace("m", "bf16", 256, 1 << 16)
    m = PyKVCacheManager(str(tmp_path), [ns], n_dram=2, writeback_max_fraction=1.0)
    r1, r2 = ReqContext("r1"), ReqContext("r2")
    k1, k2, k3 = key(1), key(2), key(3)
    m.prepare_store([k1, k2], r1)
    m.complete_store([k1, k2], r1)
    m.on_worker_report(set(), {}, None, {k1: 1, k2: 1})
    spec = m.prepare_load([k1, k2], r2)
    assert spec.flags == [IN_SLOT, IN_SLOT]
    m.hold_loads(7, "r2", [k1, k2])
    m.complete_load([k1, k2], r2)  # vLLM's completion: finds nothing to release
    assert m.gauges()["loads_in_flight"] == 2
    assert m.loads_of([k2]) == {"r2": {k2}}
    out = m.prepare_store([k3], r1)  # both slots pinned: no DRAM slot for k3
    assert out.store_spec.dram_slots == [-1] and out.evicted_keys == []
    m.complete_store([k3], r1)
    m.on_worker_report({k2}, {"chunks_failed": 1})  # k2 failed its check in the copy
    m.release_held(7)
    m.release_held(7)  # unknown now: ignored
    assert m.gauges()["loads_in_flight"] == 0
    assert m.dram.lookup(k1) >= 0 and m.dram.lookup(k2) == -1
    out = m.prepare_store([key(4)], r1)  # k2's slot is free again
    assert out.keys_to_store == [key(4)] and out.store_spec.dram_slots[0] >= 0
    m.dram.check()


def test_manager_disk_admission_reuse_writes_files_only_for_reused_blocks(tmp_path,
                                                                          vllm_available):
    """disk_admission="reuse": a block's first store fills a DRAM-tier slot without a
    file (dram_only, nothing pinned); a DRAM hit on it queues its file, which
    take_flush_plan hands to the workers even with writeback_flush off (pinned until
    written); one evicted unread is gone without a file; stored again after that (the
    doorkeeper saw it), it is written at once. Without a DRAM tier a first store is not
    stored at all, the second is. "all" (default) writes every first store; an unknown
    value is refused."""
    import pytest
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager

    ns = Namespace("m", "bf16", 256, 1 << 16)
    with pytest.raises(ValueError, match="disk_admission"):
        PyKVCacheManager(str(tmp_path / "x"), [ns], n_dram=2, disk_admission="some")
    m = PyKVCacheManager(str(tmp_path), [ns], n_dram=2, writeback_max_fraction=1.0,
                         disk_admission="reuse")
    w, r = ReqContext("w"), ReqContext("r")
    a, b, c = key(1), key(2), key(3)
    spec = m.prepare_store([a, b], w).store_spec
    assert spec.dram_slots == [0, 1] and spec.dram_only == [True, True]
    assert not spec.writes_file(0) and not spec.writes_file(1)
    m.complete_store([a, b], w)
    st = m.stats()
    assert st["stores_disk_deferred"] == 2 and st["dram_writeback_pinned"] == 0
    assert m.take_flush_plan() == []  # nothing shown reused yet
    # a second request reads a from the tier: now it gets its file
    assert m.lookup(a, r) == LookupResult.HIT
    load = m.prepare_load([a], r)
    assert load.dram_slots == [m.dram.lookup(a)]
    m.complete_load([a], r)
    plan = m.take_flush_plan()
    assert plan == [(bytes(a), m.dram.lookup(a))]
    assert m.stats()["flushes_reused"] == 1 and m.stats()["dram_writeback_pinned"] == 1
    assert m.take_flush_plan() == []  # planned once
    # c evicts b (unread, unpinned: a is pinned by its write-back): b leaves without a file
    out = m.prepare_store([c], w)
    assert out.evicted_keys == [b] and out.store_spec.dram_only == [True]
    m.complete_store([c], w)
    m.on_worker_report(set(), {}, None, {a: 1})
    assert m.stats()["dram_writeback_pinned"] == 0
    # b stored again (a request missed it and recomputed it): seen before, written now
    out = m.prepare_store([b], w)
    assert out.keys_to_store == [b] and out.store_spec.dram_only is None
    assert out.store_spec.writes_file(0)
    m.complete_store([b], w)
    m.dram.check()
    # an unread block reset away is forgotten with the tier
    m.reset_cache()
    assert m.take_flush_plan() == [] and not m._unproven and not m._hot

    # no DRAM tier: the first store of a block is not stored, the second is
    d = PyKVCacheManager(str(tmp_path / "d"), [ns], n_dram=0, disk_admission="reuse")
    assert d.prepare_store([a], w).keys_to_store == []
    assert d.stats()["stores_disk_not_admitted"] == 1
    out = d.prepare_store([a], w)
    assert out.keys_to_store == [a] and out.store_spec.writes_file(0)
    d.complete_store([a], w)
    # the break-even gate's disk-off decision stays as it was (nothing written, no count)
    d.disk_stores = False
    assert d.prepare_store([c], w).keys_to_store == []
    assert d.stats()["stores_disk_not_admitted"] == 1

    # "all" (default): every first store writes its file
    al = PyKVCacheManager(str(tmp_path / "all"), [ns], n_dram=2, writeback_max_fraction=1.0)
    spec = al.prepare_store([a], w).store_spec
    assert spec.dram_only is None and spec.writes_file(0)


def test_manager_disk_admission_doorkeeper_is_bounded(tmp_path, vllm_available,
                                                      monkeypatch):
    """The store doorkeeper keeps two generations of SEEN_GENERATION hashed keys: a key
    first stored more than two generations ago counts as new again; memory stays bounded."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvcache_core.vllm import manager as M
    from kvcache_core.vllm.manager import PyKVCacheManager

    monkeypatch.setattr(M, "SEEN_GENERATION", 4)
    d = PyKVCacheManager(str(tmp_path), [Namespace("m", "bf16", 256, 1 << 16)], n_dram=0,
                         disk_admission="reuse")
    w = ReqContext("w")
    first = [key(i) for i in range(100, 112)]  # three generations of first stores
    for k in first:
        assert d.prepare_store([k], w).keys_to_store == []
    assert len(d._seen) + len(d._seen_old) <= 8
    assert d.prepare_store([first[-1]], w).keys_to_store == [first[-1]]  # recent: seen
    assert d.prepare_store([first[0]], w).keys_to_store == []  # forgotten: new again


@pytest.mark.parametrize("policy", ["lru", "lru-admit"])
def test_protect_queue_evicts_what_the_queue_needs_last(tmp_path, vllm_available, policy):
    """preload_protect: with the DRAM tier full, a store evicts first a block that no
    waiting request in view will read; it takes no slot whose victim a request in view
    reads before the new block (Belady's admission over the queue), and takes one whose
    victim is read later. Order only: nothing counts as a reuse; a request's keys are
    rebuilt when its hashes grow; a step with nothing waiting drops the ranks."""
    from types import SimpleNamespace

    from vllm.v1.kv_offload.base import ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager, make_offload_key

    ns = Namespace("m", "bf16", 256, 1 << 16)
    m = PyKVCacheManager(str(tmp_path), [ns], n_dram=4, eviction_policy=policy,
                         writeback_max_fraction=1.0)
    g = SimpleNamespace(group_idx=0, hashes_per_chunk=2, tokens_per_chunk=256)
    w = ReqContext("writer")

    def doc(base: int) -> tuple[SimpleNamespace, list]:
        hashes = [(base + i).to_bytes(32, "big") for i in range(4)]  # 2 chunks
        return (SimpleNamespace(request_id=f"r{base}", block_hashes=hashes),
                [make_offload_key(h, 0) for h in hashes[1::2]])

    (ra, (a1, a2)), (rb, (b1, b2)), (rc, (c1, _)) = doc(100), doc(200), doc(300)

    def store(keys: list) -> list:
        out = m.prepare_store(keys, w)
        m.complete_store(keys, w)
        m.on_worker_report(set(), {}, None, dict.fromkeys(keys, 1))  # files written
        return out.evicted_keys

    assert store([a1, a2, b1, b2]) == []  # full, a1 the oldest
    m.protect_queue([ra], [g])  # only A waits: B's blocks go first
    assert store([key(1)]) == [b1] and store([key(2)]) == [b2]
    assert store([key(3)]) == []  # the victim would be A's tail: no slot (disk only)
    assert m.dram.lookup(a1) >= 0 and m.dram.lookup(a2) >= 0
    s = m.stats()
    assert s["dram_queue_refused"] == 1 and s["stores_no_dram_slot"] == 1
    assert s["dram_protected"] == 2 and s["hits_dram"] == 0
    # B waits ahead of A: the unqueued blocks make room for B's
    m.protect_queue([rb, ra], [g])
    assert store([b1, b2]) == [key(1), key(2)]
    m.protect_queue([rb, ra], [g])
    assert store([key(4)]) == []  # every victim is read by the queue first
    # C, ahead of both, takes the slot of the block the queue reads last (A's tail)
    m.protect_queue([rc, rb, ra], [g])
    assert store([c1]) == [a2]
    assert store([key(5)]) == [] and m.stats()["dram_queue_refused"] == 3
    # nothing waits any more: no ranks, plain LRU again
    m.protect_queue((), [g])
    assert store([key(6)]) == [a1]
    # A's prompt grew a chunk (hashes 100..105): its keys are rebuilt
    ra.block_hashes = [(100 + i).to_bytes(32, "big") for i in range(6)]
    m.protect_queue([ra], [g])
    assert m._protect_keys["r100"][0] == 6 and len(m._protect_keys["r100"][1]) == 3
    assert set(m._protect_keys) == {"r100"}  # the others left the view: forgotten
    m.dram.check()


def test_protect_queue_promotion_serves_the_next_reader_not_the_loading_one(
        tmp_path, vllm_available):
    """preload_protect, promotions: the request that loads a block reads it whether or
    not it gets a DRAM slot (without one, through staging), so the promotion's value is
    the block's NEXT reader in view. A promotion for the head of the queue whose blocks
    no other request in view reads takes no slot whose victim the second request in view
    reads (the fifty-client runs: the second reader of a document lost the first
    reader's promoted blocks to a third document's promotions and read them again); a
    promotion whose block a request in view reads before the victim's reader takes it."""
    from types import SimpleNamespace

    from vllm.v1.kv_offload.base import ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager, make_offload_key

    ns = Namespace("m", "bf16", 256, 1 << 16)
    m = PyKVCacheManager(str(tmp_path), [ns], n_dram=2, writeback_max_fraction=1.0)
    g = SimpleNamespace(group_idx=0, hashes_per_chunk=2, tokens_per_chunk=256)
    w = ReqContext("writer")

    def doc(base: int, rid: str) -> tuple[SimpleNamespace, list]:
        hashes = [(base + i).to_bytes(32, "big") for i in range(4)]  # 2 chunks
        return (SimpleNamespace(request_id=rid, block_hashes=hashes),
                [make_offload_key(h, 0) for h in hashes[1::2]])

    r_x, kx = doc(100, "x")    # X: a document on disk only, read by X alone
    r_y, ky = doc(200, "y")    # Y: its document in the DRAM tier, waiting behind X
    r_x2, _ = doc(100, "x2")   # a second reader of X's document
    for k in kx + ky:  # every block has its file; Y's stay in the DRAM tier (full)
        m.prepare_store([k], w)
        m.complete_store([k], w)
        m.on_worker_report(set(), {}, None, {k: 1})
    assert all(m.dram.lookup(k) >= 0 for k in ky) and m.dram.lookup(kx[0]) < 0

    # X at the head, Y behind it: X's promotion would evict Y's blocks, and no one in
    # view reads X's blocks after X: X reads through staging, Y keeps its blocks
    m.protect_queue([r_x, r_y], [g])
    spec = m.prepare_load(kx, ReqContext("x"))
    assert spec.dram_slots == [-1, -1], spec
    assert all(m.dram.lookup(k) >= 0 for k in ky)
    assert m.stats()["dram_queue_refused"] == 2 and m.stats()["promotions"] == 0
    for k in kx:
        m.complete_load([k], ReqContext("x"))

    # a second reader of X's document waits before Y: X's promotion serves it, so it
    # takes the slot of Y's (later-read) block
    m.protect_queue([r_x, r_x2, r_y], [g])
    spec = m.prepare_load(kx[:1], ReqContext("x"))
    assert spec.dram_slots[0] >= 0 and m.stats()["promotions"] == 1
    m.dram.check()


def test_manager_slow_file_checks_move_lookups_off_the_scheduler_thread(
        tmp_path, vllm_available, monkeypatch):
    """disk_lookup_async (experimental, off by default): with 'auto', a file check of
    20 ms or more (here a filesystem slowed to 30 ms per check, as a cold directory
    behind a full disk queue is) puts
    lookups in background mode: a lookup of a block not yet answered returns RETRY at
    once (vLLM asks again next step) while the checker thread checks it, and the next
    lookup gets the answer, hit or miss, without a check on the scheduler thread. With
    'off' every lookup checks on the calling thread; with 'on' from the first."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvcache_core.layout import LayoutIndex
    from kvcache_core.vllm import manager as M

    ns = Namespace("m", "bf16", 256, 1 << 16)
    lay = Layout(str(tmp_path), ns)
    r = ReqContext("r")
    for i in range(1, 4):
        assert lay.write_block(bytes(key(i)), bytes(ns.block_bytes))
    real = LayoutIndex.exists
    callers: list[str] = []

    def slow_exists(self, k):
        callers.append(threading.current_thread().name)
        time.sleep(0.03)
        return real(self, k)

    monkeypatch.setattr(LayoutIndex, "exists", slow_exists)
    m = M.PyKVCacheManager(str(tmp_path), [ns], n_dram=0, disk_lookup_async="auto")
    try:
        assert m.lookup(key(1), r) == LookupResult.HIT  # checked here: slow, arms it
        assert callers == ["MainThread"]
        t0 = time.perf_counter()
        assert m.lookup(key(2), r) == LookupResult.RETRY
        assert m.lookup(key(9), r) == LookupResult.RETRY  # not on disk
        assert time.perf_counter() - t0 < 0.02  # nothing waited for the filesystem
        deadline = time.monotonic() + 5
        while len(m._checker.answers) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert m.lookup(key(2), r) == LookupResult.HIT
        assert m.lookup(key(9), r) == LookupResult.MISS
        assert callers.count("MainThread") == 1 and callers.count("pykvcache-lookup") == 2
        s = m.stats()
        assert s["lookups_retry"] == 2 and s["disk_check_max_us"] >= 30_000, s
    finally:
        m.shutdown()
    assert not m._checker._thread.is_alive()
    off = M.PyKVCacheManager(str(tmp_path), [ns], n_dram=0)  # "off", the default
    callers.clear()
    assert off.lookup(key(1), r) == LookupResult.HIT
    assert off.lookup(key(3), r) == LookupResult.HIT
    assert callers == ["MainThread", "MainThread"] and off._checker is None
    on = M.PyKVCacheManager(str(tmp_path), [ns], n_dram=0, disk_lookup_async="on")
    try:
        assert on.lookup(key(3), r) == LookupResult.RETRY
    finally:
        on.shutdown()
    with pytest.raises(ValueError, match="disk_lookup_async"):
        M.PyKVCacheManager(str(tmp_path), [ns], n_dram=0, disk_lookup_async="yes")


def test_manager_counts_the_disk_chunks_another_load_is_reading(tmp_path, vllm_available):
    """``lookup_disk_new_chunks`` (what ``disk_load_hold_s`` asks): of a lookup's disk
    chunks, those no other load reads from disk right now. A key read through staging
    (no DRAM tier) by one request counts as being read for the next lookup until that
    load completes; a reset forgets it."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager

    ns = Namespace("m", "bf16", 256, 1 << 16)
    lay = Layout(str(tmp_path), ns)
    for i in (1, 2):
        assert lay.write_block(bytes(key(i)), bytes(ns.block_bytes))
    m = PyKVCacheManager(str(tmp_path), [ns], n_dram=0)
    a, b = ReqContext("a"), ReqContext("b")

    def look(ctx):
        m.begin_lookup()
        assert [m.lookup(key(i), ctx) for i in (1, 2)] == [LookupResult.HIT] * 2
        return m.lookup_disk_chunks(), m.lookup_disk_new_chunks()

    assert look(a) == (2, 2)
    spec = m.prepare_load([key(1)], a)
    assert spec.dram_slots == [-1]  # through staging
    assert look(b) == (2, 1)  # key 1 is being read for a: b would join that read
    m.prepare_load([key(2)], a)
    assert look(b) == (2, 0)
    m.complete_load([key(1)], a)
    assert look(b) == (2, 1)
    m.reset_cache()
    assert look(b) == (2, 2) and not m._reading
    m.shutdown()
    lay.close()
