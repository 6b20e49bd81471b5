"""Reactor end to end on CPU (MemcpyCopier), real files, io_uring and POSIX engines."""

from __future__ import annotations

import glob
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from helpers.kvutil import (
    BLOCK,
    REPO,
    Collector,
    GatedWriteEngine,
    close_reactor,
    finish,
    gated_copier_factory,
    list_files,
    payload,
    payload_len,
    published_bytes,
    read_ledger,
    sentinel_buf,
    wait_until,
)

import kvcache_core.io as kio
from kvcache_core.copy import MemcpyCopier
from kvcache_core.layout import HEADER_BYTES, round_up
from kvcache_core.reactor import Reactor
from kvcache_core.staging import Priority


def keys_of(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i:04d}".encode() for i in range(n)]


def store_all(r: Reactor, keys: list[bytes], req_id="store", lengths=None) -> None:
    items = []
    for k in keys:
        n = lengths[k] if lengths else BLOCK
        items.append((k, payload(k, n), n))
    r.store(req_id, items)


def check_dests(keys, dests, lengths=None) -> None:
    for k, d in zip(keys, dests, strict=True):
        n = lengths[k] if lengths else BLOCK
        assert bytes(d[:n]) == payload(k, n), f"wrong bytes for {k!r}"
        assert d[n:] == sentinel_buf(len(d) - n), f"bytes past the payload written for {k!r}"


# --------------------------------------------------------------------------- basics


def test_store_then_load_round_trip(make_layout, make_reactor, ns, engine):
    lay = make_layout()
    r = make_reactor(lay)
    assert r.engine.name == engine
    assert r.direct, "tmp_path is a real disk filesystem: O_DIRECT should be used"
    keys = keys_of("rt", 24)
    lengths = {k: payload_len(k, BLOCK) for k in keys}
    store_all(r, keys, lengths=lengths)
    c = finish(r)["store"]
    assert c.kind == "store" and c.ok == [True] * len(keys) and c.success
    sizes = sum(HEADER_BYTES + round_up(lengths[k]) for k in keys)
    assert r.stats.stores_ok == len(keys)
    assert r.stats.bytes_written == sizes == published_bytes(lay.base) == read_ledger(lay.base)
    assert list_files(lay.base)[1] == []
    for k in keys:  # what is on disk is what the synchronous reader expects
        assert lay.read_block(k) == payload(k, lengths[k])

    dests = [sentinel_buf(BLOCK) for _ in keys]
    r.load("load", [(k, d, lengths[k]) for k, d in zip(keys, dests, strict=True)])
    c = finish(r)["load"]
    assert c.kind == "load" and c.ok == [True] * len(keys)
    check_dests(keys, dests, lengths)
    s = r.snapshot()
    assert s["loads_ok"] == len(keys) and s["bytes_read"] == sizes
    assert s["loads_miss"] == s["loads_corrupt"] == s["loads_error"] == 0
    assert s["stores_error"] == 0 and s["errors"] == {}
    assert s["engine"] == engine


def test_request_larger_than_pool_streams(make_layout, make_reactor, ns):
    lay = make_layout()
    n_slots = 6
    r = make_reactor(lay, n_slots=n_slots, io_depth=4, lookahead=4)
    assert r.pool.nbytes == n_slots * ns.file_bytes  # nothing sized by the request
    keys = keys_of("stream", 40)
    store_all(r, keys)
    assert finish(r)["store"].ok == [True] * 40
    dests = [sentinel_buf(BLOCK) for _ in keys]
    r.load("load", [(k, d, BLOCK) for k, d in zip(keys, dests, strict=True)])
    assert finish(r)["load"].ok == [True] * 40
    check_dests(keys, dests)
    s = r.snapshot()
    assert s["peak_busy_slots"] <= n_slots
    assert s["peak_staging_bytes"] <= r.pool.nbytes
    assert s["copy_batches"] >= 40 // n_slots  # streamed through, batch by batch
    r.alloc.check()
    assert r.alloc.busy == 0


def test_missing_keys_fail_only_their_items(make_layout, make_reactor):
    lay = make_layout()
    r = make_reactor(lay)
    present = keys_of("here", 2)
    store_all(r, present)
    finish(r)
    keys = [present[0], b"absent-1", present[1], b"absent-2"]
    dests = [sentinel_buf(BLOCK) for _ in keys]
    r.load("mixed", [(k, d, BLOCK) for k, d in zip(keys, dests, strict=True)])
    c = finish(r)["mixed"]
    assert c.ok == [True, False, True, False] and not c.success and not c.cancelled
    assert r.stats.loads_miss == 2 and r.stats.loads_ok == 2
    check_dests([present[0], present[1]], [dests[0], dests[2]])
    assert dests[1] == sentinel_buf(BLOCK) and dests[3] == sentinel_buf(BLOCK)


def test_store_of_existing_key_is_ok_and_not_rewritten(make_layout, make_reactor, ns):
    lay = make_layout()
    r = make_reactor(lay)
    k = b"exists"
    assert lay.write_block(k, payload(k, BLOCK))
    ino = os.stat(lay.path_for(k)).st_ino
    r.store("again", [(k, payload(k, BLOCK), BLOCK), (k, payload(k, BLOCK), BLOCK)])
    assert finish(r)["again"].ok == [True, True]
    assert r.stats.stores_existing == 2 and r.stats.stores_ok == 0
    assert os.stat(lay.path_for(k)).st_ino == ino
    assert read_ledger(lay.base) == ns.file_bytes


def test_empty_request_and_same_key_twice(make_layout, make_reactor):
    lay = make_layout()
    col = Collector()
    r = make_reactor(lay, on_complete=col)
    r.load("empty", [])
    r.store("empty-store", [])
    k = b"twice"
    store_all(r, [k])
    done = finish(r)
    assert done["empty"].ok == [] and done["empty"].success
    assert done["empty-store"].ok == []
    d1, d2 = sentinel_buf(BLOCK), sentinel_buf(BLOCK)
    r.load("dup", [(k, d1, BLOCK), (k, d2, BLOCK)])
    assert finish(r)["dup"].ok == [True, True]
    check_dests([k, k], [d1, d2])
    assert set(col.done) == {"empty", "empty-store", "store", "dup"} and not col.duplicates


def test_concurrent_loads_of_one_block_read_it_once(make_layout, make_reactor):
    """Issue 10 item 1: several requests load the same blocks at once (no DRAM tier):
    the later loads join the first one's read (``loads_joined``), every request gets the
    right bytes, and each file is read once. A block whose shared read fails (corrupt
    file) fails for every load that joined it: all are misses, none waits forever."""
    lay = make_layout()
    r = make_reactor(lay, n_slots=8, io_depth=2)
    keys = keys_of("shared", 4)
    for k in keys:
        lay.write_block(k, payload(k, BLOCK))
    dests = {f"req{i}": [sentinel_buf(BLOCK) for _ in keys] for i in range(4)}
    for rid, ds in dests.items():  # queued back to back, before any read completes
        r.load(rid, [(k, d, BLOCK) for k, d in zip(keys, ds, strict=True)])
    done = finish(r)
    for rid, ds in dests.items():
        assert done[rid].ok == [True] * 4, rid
        check_dests(keys, ds)
    # every load either read the file, joined a read in flight or found the block still
    # in the slot a shared read left retained; queued together, each file is read once
    reads = r.stats.bytes_read // lay.ns.file_bytes
    assert reads + r.stats.loads_joined + r.stats.loads_dram == 16
    assert reads == 4 and r.stats.loads_joined > 0, r.stats
    # a corrupt block: the read fails, and so does every load that joined it
    bad = b"shared-bad"
    lay.write_block(bad, payload(bad, BLOCK))
    path = lay.path_for(bad)
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 10)
        f.write(b"\xff" * 8)
    joined = r.stats.loads_joined
    for i in range(3):
        r.load(f"bad{i}", [(bad, sentinel_buf(BLOCK), BLOCK)])
    done = finish(r)
    assert [done[f"bad{i}"].ok for i in range(3)] == [[False]] * 3
    assert r.stats.loads_joined > joined and r.stats.loads_corrupt == 1


def test_pool_must_exceed_io_depth(make_layout, engine):
    lay = make_layout()
    with pytest.raises(ValueError, match="io_depth"):
        Reactor(lay, n_slots=4, io_depth=4, engine=engine, pin=False)


def test_durable_store(make_layout, make_reactor):
    lay = make_layout(durable=True)
    r = make_reactor(lay)
    keys = keys_of("durable", 8)
    store_all(r, keys)
    assert finish(r)["store"].ok == [True] * 8
    assert r.stats.stores_ok == 8 and r.stats.errors == {}
    dests = [sentinel_buf(BLOCK) for _ in keys]
    r.load("l", [(k, d, BLOCK) for k, d in zip(keys, dests, strict=True)])
    assert finish(r)["l"].ok == [True] * 8
    check_dests(keys, dests)
    assert list_files(lay.base)[1] == []


@pytest.mark.parametrize("direct_io", ["off", "auto"])
def test_dev_shm_root(make_layout, make_reactor, direct_io):
    """tmpfs root; with direct_io off the buffered read/write path is exercised."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("/dev/shm is not available")
    shm = tempfile.mkdtemp(prefix="kvcache-test-", dir="/dev/shm")
    try:
        lay = make_layout(r=shm)
        r = make_reactor(lay, direct_io=direct_io)
        if direct_io == "off":
            assert r.direct is False
        keys = keys_of("shm", 12)
        lengths = {k: payload_len(k, BLOCK) for k in keys}
        store_all(r, keys, lengths=lengths)
        assert finish(r)["store"].ok == [True] * 12
        dests = [sentinel_buf(BLOCK) for _ in keys]
        r.load("l", [(k, d, lengths[k]) for k, d in zip(keys, dests, strict=True)])
        assert finish(r)["l"].ok == [True] * 12
        check_dests(keys, dests, lengths)
        close_reactor(r)
        lay.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_direct_io_on_required(make_layout, make_reactor):
    lay = make_layout()
    r = make_reactor(lay, direct_io="on")
    assert r.direct
    store_all(r, [b"d"])
    assert finish(r)["store"].ok == [True]


def test_concurrent_client_threads(make_layout, make_reactor):
    lay = make_layout()
    col = Collector()
    r = make_reactor(lay, n_slots=6, io_depth=3, on_complete=col)
    errors: list[str] = []

    def client(t: int) -> None:
        keys = keys_of(f"thread{t}", 10)
        r.store(("s", t), [(k, payload(k, BLOCK), BLOCK) for k in keys])
        c = col.get(("s", t))
        if c is None or c.ok != [True] * 10:
            errors.append(f"store {t}: {c}")
            return
        for rnd in range(3):
            dests = [sentinel_buf(BLOCK) for _ in keys]
            r.load(("l", t, rnd), [(k, d, BLOCK) for k, d in zip(keys, dests, strict=True)])
            c = col.get(("l", t, rnd))
            if c is None or c.ok != [True] * 10:
                errors.append(f"load {t}/{rnd}: {c}")
                return
            for k, d in zip(keys, dests, strict=True):
                if bytes(d) != payload(k, BLOCK):
                    errors.append(f"wrong bytes {k!r}")

    threads = [threading.Thread(target=client, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    assert len(col.done) == 4 + 12 and not col.duplicates
    assert r.wait(5)


# --------------------------------------------------------------------------- DRAM tier


def test_dram_tier_serves_second_load_without_disk(make_layout, make_reactor):
    lay = make_layout()
    r = make_reactor(lay, n_slots=8, io_depth=2, retain=True)
    keys = keys_of("dram", 4)
    for k in keys:  # published by someone else: the first load must read the disk
        lay.write_block(k, payload(k, BLOCK))
    d1 = [sentinel_buf(BLOCK) for _ in keys]
    r.load("first", [(k, d, BLOCK) for k, d in zip(keys, d1, strict=True)])
    assert finish(r)["first"].ok == [True] * 4
    check_dests(keys, d1)
    read_after_first = r.stats.bytes_read
    assert read_after_first == 4 * lay.ns.file_bytes and r.stats.loads_dram == 0
    assert r.stats.disk_reads_repeat == 0
    d2 = [sentinel_buf(BLOCK) for _ in keys]
    r.load("second", [(k, d, BLOCK) for k, d in zip(keys, d2, strict=True)])
    assert finish(r)["second"].ok == [True] * 4
    check_dests(keys, d2)
    assert r.stats.loads_dram == 4
    assert r.stats.bytes_read == read_after_first  # no extra disk bytes
    assert r.snapshot()["cached_slots"] == 4
    # the DRAM copy survives the file's removal (content-addressed, immutable)
    for k in keys:
        lay.remove(k)
    d3 = [sentinel_buf(BLOCK) for _ in keys]
    r.load("third", [(k, d, BLOCK) for k, d in zip(keys, d3, strict=True)])
    assert finish(r)["third"].ok == [True] * 4
    check_dests(keys, d3)

    # stores retain their slot too: a load right after a store is a DRAM hit
    fresh = keys_of("stored", 2)
    store_all(r, fresh)
    finish(r)
    before = r.stats.loads_dram
    d4 = [sentinel_buf(BLOCK) for _ in fresh]
    r.load("fourth", [(k, d, BLOCK) for k, d in zip(fresh, d4, strict=True)])
    assert finish(r)["fourth"].ok == [True] * 2
    check_dests(fresh, d4)
    assert r.stats.loads_dram == before + 2


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_dram_tier_reclaimed_by_foreground_work(make_layout, make_reactor, policy):
    lay = make_layout()
    r = make_reactor(lay, n_slots=4, io_depth=2, retain=True, policy=policy)
    keys = keys_of("reclaim", 12)
    store_all(r, keys)
    assert finish(r)["store"].ok == [True] * 12
    for rnd in range(3):
        dests = [sentinel_buf(BLOCK) for _ in keys]
        r.load(rnd, [(k, d, BLOCK) for k, d in zip(keys, dests, strict=True)])
        assert finish(r)[rnd].ok == [True] * 12
        check_dests(keys, dests)
    assert r.alloc.reclaimed > 0
    assert r.alloc.cached <= 4
    r.alloc.check()


def test_dram_hit_copies_the_same_bytes_as_a_disk_hit(make_layout, make_reactor):
    """A block whose payload is shorter than the requested nbytes: the disk path copies
    the stored payload only; a DRAM-tier hit of the same key must not write anything
    else (padding, or stale bytes of the slot's previous block) into the destination."""
    lay = make_layout()
    r = make_reactor(lay, n_slots=3, io_depth=2, retain=True, direct_io="off")
    junk = [(f"junk{i}".encode(), b"\xaa" * BLOCK, BLOCK) for i in range(3)]
    r.store("junk", junk)  # every slot now holds (and retains) a full block of 0xAA
    finish(r)
    key = b"partial"
    data = payload(key, 1000)
    assert lay.write_block(key, data)
    got = {}
    for tier in ("disk", "dram"):
        d = sentinel_buf(BLOCK)
        r.load(tier, [(key, d, BLOCK)])
        assert finish(r)[tier].ok == [True]
        got[tier] = bytes(d)
    assert r.stats.loads_dram == 1
    assert got["disk"][:1000] == data and got["disk"][1000:] == bytes(sentinel_buf(BLOCK - 1000))
    assert got["dram"][:1000] == data
    diff = sum(a != b for a, b in zip(got["dram"], got["disk"], strict=True))
    assert got["dram"] == got["disk"], (
        f"DRAM hit wrote {diff} bytes past the stored payload (0xAA bytes from another "
        f"block: {got['dram'][1000:].count(0xAA)})")


def test_nbytes_zero_means_whole_payload_in_both_tiers(make_layout, make_reactor):
    """The disk path treats nbytes=0 as 'the whole stored payload'; a DRAM hit must too."""
    lay = make_layout()
    r = make_reactor(lay, n_slots=4, io_depth=2, retain=True)
    k = b"zero"
    assert lay.write_block(k, payload(k, BLOCK))
    for tier in ("disk", "dram"):
        d = sentinel_buf(BLOCK)
        r.load(tier, [(k, d, 0)])
        assert finish(r)[tier].ok == [True]
        assert bytes(d) == payload(k, BLOCK), f"{tier} load with nbytes=0 copied wrong bytes"
    assert r.stats.loads_dram == 1


# --------------------------------------------------------------------------- priorities


def test_speculative_loads_complete_with_foreground_traffic(make_layout, make_reactor):
    lay = make_layout()
    col = Collector()
    r = make_reactor(lay, n_slots=6, io_depth=2, on_complete=col)
    keys = keys_of("spec", 30)
    store_all(r, keys)
    finish(r)
    spec_d = {k: sentinel_buf(BLOCK) for k in keys[:15]}
    fg_d = {k: sentinel_buf(BLOCK) for k in keys[15:]}
    for i, k in enumerate(keys[:15]):
        r.load(("spec", i), [(k, spec_d[k], BLOCK)], Priority.SPECULATIVE)
        if i % 3 == 0:
            fk = keys[15 + i // 3 * 3: 15 + i // 3 * 3 + 3]
            r.load(("fg", i), [(x, fg_d[x], BLOCK) for x in fk])
    done = finish(r)
    assert all(c.ok == [True] * len(c.ok) for c in done.values()), done
    assert len(done) == 15 + 5
    check_dests(list(spec_d), list(spec_d.values()))
    check_dests(list(fg_d), list(fg_d.values()))
    assert r.stats.loads_ok == 30


def test_foreground_load_requeues_open_speculative_file(make_layout, make_reactor):
    """Deterministic R8 scenario: the speculative file is open but cannot get a slot
    (only the foreground reservation is free) when a foreground load arrives; the
    reactor closes it and re-queues the preload, which later completes correctly."""
    lay = make_layout()
    gate = threading.Event()
    held = sentinel_buf(BLOCK)
    col = Collector()
    r = make_reactor(lay, n_slots=3, io_depth=2, on_complete=col,
                     copier=gated_copier_factory(gate, {id(held)}))
    a, b, c = b"held", b"speculative", b"foreground"
    store_all(r, [a, b, c])
    finish(r)
    try:
        r.load("held", [(a, held, BLOCK)])  # its copy holds one slot until the gate opens
        assert wait_until(lambda: r.stats.copy_batches >= 1)
        spec_d, fg_d = sentinel_buf(BLOCK), sentinel_buf(BLOCK)
        r.load("spec", [(b, spec_d, BLOCK)], Priority.SPECULATIVE)
        # opened, then refused a slot: 2 free slots = the foreground reservation
        assert wait_until(lambda: r.alloc.refused_speculative >= 1)
        assert r.stats.spec_requeued == 0
        r.load("fg", [(c, fg_d, BLOCK)])
        assert wait_until(lambda: r.stats.spec_requeued >= 1)
        assert "spec" not in col.done
    finally:
        gate.set()
    done = finish(r)
    assert done["held"].ok == done["spec"].ok == done["fg"].ok == [True]
    check_dests([a, b, c], [held, spec_d, fg_d])
    assert r.stats.spec_requeued == 1
    assert r.stats.loads_ok == 3


def test_foreground_load_requeues_every_open_speculative_file(make_layout, make_reactor):
    """With ``spec_depth=2`` two speculative files are open and refused a slot (only the
    foreground reservation is free) when a foreground load arrives: both are closed and
    re-queued, the foreground load is served first, and both preloads later complete
    with the right bytes."""
    lay = make_layout()
    gate = threading.Event()
    held = sentinel_buf(BLOCK)
    col = Collector()
    r = make_reactor(lay, n_slots=4, io_depth=3, on_complete=col, spec_depth=2,
                     copier=gated_copier_factory(gate, {id(held)}))
    a, b1, b2, c = b"held", b"spec-one", b"spec-two", b"foreground"
    store_all(r, [a, b1, b2, c])
    finish(r)
    try:
        r.load("held", [(a, held, BLOCK)])
        assert wait_until(lambda: r.stats.copy_batches >= 1)
        d1, d2, fg_d = sentinel_buf(BLOCK), sentinel_buf(BLOCK), sentinel_buf(BLOCK)
        r.load("spec1", [(b1, d1, BLOCK)], Priority.SPECULATIVE)
        r.load("spec2", [(b2, d2, BLOCK)], Priority.SPECULATIVE)
        assert wait_until(lambda: len(r._opened_spec) == 2)  # both open, no slot
        assert r.stats.spec_requeued == 0
        r.load("fg", [(c, fg_d, BLOCK)])
        assert wait_until(lambda: r.stats.spec_requeued >= 2)
        assert "spec1" not in col.done and "spec2" not in col.done
    finally:
        gate.set()
    done = finish(r)
    assert all(done[k].ok == [True] for k in ("held", "spec1", "spec2", "fg"))
    check_dests([a, b1, b2, c], [held, d1, d2, fg_d])
    assert r.stats.spec_requeued == 2
    assert r.stats.loads_ok == 4


def test_repeat_disk_reads_of_a_block_are_counted(make_layout, make_reactor, monkeypatch):
    """Without a DRAM tier the second load of a block reads its file again: counted in
    ``disk_reads_repeat``; the set of keys is bounded (cleared when full, counted)."""
    import kvcache_core.reactor as R

    monkeypatch.setattr(R, "READ_KEYS_MAX", 3)
    lay = make_layout()
    r = make_reactor(lay, n_slots=6, io_depth=2)
    keys = keys_of("rep", 4)
    for k in keys:
        lay.write_block(k, payload(k, BLOCK))
    r.load("a", [(k, sentinel_buf(BLOCK), BLOCK) for k in keys[:2]])
    assert finish(r)["a"].ok == [True] * 2
    assert r.stats.disk_reads_repeat == 0
    r.load("b", [(k, sentinel_buf(BLOCK), BLOCK) for k in keys[:3]])
    assert finish(r)["b"].ok == [True] * 3
    assert r.stats.disk_reads_repeat == 2 and r.stats.read_key_epochs == 0
    r.load("c", [(keys[3], sentinel_buf(BLOCK), BLOCK)])  # a 4th key: the set is reset
    assert finish(r)["c"].ok == [True]
    assert r.stats.read_key_epochs == 1 and r.stats.disk_reads_repeat == 2


def test_spec_depth_is_validated_and_capped_below_io_depth(make_layout, make_reactor):
    with pytest.raises(ValueError, match="spec_depth"):
        make_reactor(make_layout(), spec_depth=0)
    assert make_reactor(make_layout(), io_depth=4, spec_depth=8).spec_depth == 3
    assert make_reactor(make_layout(), io_depth=1, spec_depth=2).spec_depth == 1


def test_switch_interval_scope_busy_holds_it_only_while_requests_are_in_flight(
        make_layout, make_reactor):
    """``switch_interval_scope="busy"``: starting the reactor leaves the interpreter's
    switch interval alone; a store until its file is written and a load lower it; a
    second request that ends while the first is still in flight (a miss: device copies
    complete in order, so a hit would wait for the first) does not restore it; the last
    one does, and so does an idle reactor."""
    lay = make_layout()
    gate = threading.Event()
    held = sentinel_buf(BLOCK)
    col = Collector()
    wgate = threading.Event()
    wgate.set()  # writes complete unless a check below holds them
    old = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        r = make_reactor(lay, n_slots=4, io_depth=2, on_complete=col,
                         switch_interval_scope="busy",
                         engine=GatedWriteEngine(2, wgate),
                         copier=gated_copier_factory(gate, {id(held)}))
        assert sys.getswitchinterval() == pytest.approx(0.005)
        a = b"slow-load"
        wgate.clear()  # the store's file write does not complete: the store is in flight
        store_all(r, [a])
        assert wait_until(lambda: sys.getswitchinterval() == pytest.approx(0.0005))
        assert wait_until(lambda: r.engine.writes_seen >= 1)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        wgate.set()
        r.engine.wake()
        assert finish(r)["store"].ok == [True]
        assert sys.getswitchinterval() == pytest.approx(0.005)
        r.load("slow", [(a, held, BLOCK)])  # its device copy waits for the gate
        assert wait_until(lambda: sys.getswitchinterval() == pytest.approx(0.0005))
        r.load("miss", [(b"never-stored", sentinel_buf(BLOCK), BLOCK)])
        assert col.get("miss", timeout=10).ok == [False]
        assert "slow" not in col.done
        assert sys.getswitchinterval() == pytest.approx(0.0005)  # "slow" still in flight
        gate.set()
        assert finish(r)["slow"].ok == [True]
        check_dests([a], [held])
        assert sys.getswitchinterval() == pytest.approx(0.005)
        with pytest.raises(ValueError, match="switch_interval_scope"):
            make_reactor(lay, switch_interval_scope="loads")
    finally:
        gate.set()
        wgate.set()
        sys.setswitchinterval(old)


def test_cancel_of_a_queued_request(make_layout, make_reactor):
    lay = make_layout()
    gate = threading.Event()
    held = [sentinel_buf(BLOCK) for _ in range(3)]
    col = Collector()
    r = make_reactor(lay, n_slots=3, io_depth=2, lookahead=4, on_complete=col,
                     copier=gated_copier_factory(gate, {id(d) for d in held}))
    hk = keys_of("held", 3)
    qk = keys_of("queued", 3)
    store_all(r, hk + qk)
    finish(r)
    try:
        r.load("held", [(k, d, BLOCK) for k, d in zip(hk, held, strict=True)])
        assert wait_until(lambda: r.stats.bytes_read == 3 * lay.ns.file_bytes)
        assert r.alloc.busy == 3  # every slot held by a copy in progress
        qd = [sentinel_buf(BLOCK) for _ in qk]
        r.load("queued", [(k, d, BLOCK) for k, d in zip(qk, qd, strict=True)])
        r.load("marker", [])  # processed after "queued" has been opened/queued
        assert col.get("marker", 10) is not None
        r.cancel("queued")
        r.cancel("no-such-request")  # unknown ids are ignored
        c = col.get("queued", 10)
        assert c is not None, "cancelled request did not complete while slots were held"
        assert c.cancelled and c.ok == [False] * 3 and not c.success
        assert all(d == sentinel_buf(BLOCK) for d in qd)
        assert "held" not in col.done
    finally:
        gate.set()
    done = finish(r)
    assert done["held"].ok == [True] * 3 and not done["held"].cancelled
    check_dests(hk, held)
    # the cancelled keys are still loadable
    qd = [sentinel_buf(BLOCK) for _ in qk]
    r.load("again", [(k, d, BLOCK) for k, d in zip(qk, qd, strict=True)])
    assert finish(r)["again"].ok == [True] * 3
    check_dests(qk, qd)


def _threads_in_openat() -> int:
    """Threads of this process blocked in openat (x86_64 syscall 257)."""
    n = 0
    for f in glob.glob(f"/proc/{os.getpid()}/task/*/syscall"):
        try:
            with open(f) as fh:
                first = fh.read().split(" ", 1)[0]
        except OSError:
            continue
        n += first == "257"
    return n


def _thread_in_openat() -> bool:
    return _threads_in_openat() > 0


def _fifo_keys(lay, tag: str, n: int) -> list[bytes]:
    keys = keys_of(tag, n)
    for k in keys:
        p = lay.path_for(k)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        os.mkfifo(p)
    return keys


def _release_fifos(lay, keys) -> None:
    """Let every open blocked on one of the FIFOs finish (writer opens and closes)."""
    for k in keys:
        try:
            os.close(os.open(lay.path_for(k), os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass  # no reader yet (ENXIO) or already removed


@pytest.mark.parametrize("engine", ["posix"])
@pytest.mark.parametrize("prio,depth", [(Priority.SPECULATIVE, 1), (Priority.SPECULATIVE, 2),
                                        (Priority.FOREGROUND, 1)])
def test_speculative_opens_at_a_time_are_bounded_by_spec_depth(make_layout, make_reactor,
                                                               prio, depth):
    """R8: at most ``spec_depth`` speculative preloads (default ONE) are open or reading.
    FIFOs keep the POSIX engine's opens blocked, so the number of opens in flight is
    observable; foreground loads (the control) open up to the lookahead in parallel."""
    if os.uname().machine != "x86_64":
        pytest.skip("syscall-number probe written for x86_64")
    lay = make_layout()
    col = Collector()
    r = make_reactor(lay, n_slots=6, io_depth=4, lookahead=4, on_complete=col,
                     spec_depth=depth)
    keys = _fifo_keys(lay, "fifo", 3)
    try:
        for i, k in enumerate(keys):
            r.load(i, [(k, sentinel_buf(BLOCK), BLOCK)], prio)
        assert wait_until(_thread_in_openat, 10)
        expect = depth if prio == Priority.SPECULATIVE else 3
        assert wait_until(lambda: _threads_in_openat() >= expect, 2)
        threading.Event().wait(0.2)  # give a wrongly started second open time to show
        assert _threads_in_openat() == expect
        assert wait_until(lambda: (_release_fifos(lay, keys), len(col.done) == 3)[1], 20)
    finally:
        _release_fifos(lay, keys)
        assert r.wait(10)
        for k in keys:
            if os.path.exists(lay.path_for(k)):
                os.unlink(lay.path_for(k))
    assert all(c.ok == [False] for c in col.done.values())


@pytest.mark.parametrize("engine", ["posix"])
def test_cancel_speculative_load_while_its_open_is_in_flight(make_layout, make_reactor):
    """Cancel a speculative load whose open is in flight (a FIFO keeps the POSIX
    engine's open blocked). After it completes as cancelled, later speculative loads
    must still run: the reactor must not keep the cancelled task as the active one."""
    if os.uname().machine != "x86_64":
        pytest.skip("syscall-number probe written for x86_64")
    lay = make_layout()
    col = Collector()
    r = make_reactor(lay, n_slots=4, io_depth=2, on_complete=col)
    good = b"present"
    assert lay.write_block(good, payload(good, BLOCK))
    fifo_key = b"fifo"
    p = lay.path_for(fifo_key)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    os.mkfifo(p)
    try:
        r.load("spec", [(fifo_key, sentinel_buf(BLOCK), BLOCK)], Priority.SPECULATIVE)
        assert wait_until(_thread_in_openat, 10), "speculative open never started"
        r.cancel("spec")
        r.load("marker", [])
        assert col.get("marker", 10) is not None  # the cancel has been handled
        fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK)  # let the blocked open finish
        os.close(fd)
        c = col.get("spec", 10)
        assert c is not None and c.cancelled and c.ok == [False]
        d = sentinel_buf(BLOCK)
        r.load("spec2", [(good, d, BLOCK)], Priority.SPECULATIVE)
        c2 = col.get("spec2", 5)
        assert c2 is not None, ("speculative load never started after a speculative load "
                                "was cancelled during its open (stale _spec_active)")
        assert c2.ok == [True] and bytes(d) == payload(good, BLOCK)
    finally:
        if os.path.exists(p):
            os.unlink(p)


# --------------------------------------------------------------------------- engines


def test_posix_fallback_when_io_uring_disabled(make_layout, monkeypatch, caplog):
    monkeypatch.setenv("KVCACHE_DISABLE_IO_URING", "1")
    ok, why = kio.uring_available()
    assert not ok and "KVCACHE_DISABLE_IO_URING" in why
    kio._warned.clear()
    lay = make_layout()
    reactors = []
    try:
        with caplog.at_level(logging.WARNING, logger="kvcache_core.io"):
            for _ in range(3):
                reactors.append(Reactor(lay, n_slots=3, io_depth=2, engine="auto",
                                        copier=MemcpyCopier, pin=False))
        assert [x.engine.name for x in reactors] == ["posix"] * 3
        recs = [rec for rec in caplog.records if rec.name == "kvcache_core.io"]
        assert len(recs) == 1, [rec.getMessage() for rec in recs]
        assert recs[0].levelno == logging.WARNING
        msg = recs[0].getMessage()
        assert "io_uring unavailable" in msg and "KVCACHE_DISABLE_IO_URING" in msg
        r = reactors[0]
        store_all(r, [b"fallback"])
        assert finish(r)["store"].ok == [True]
        d = sentinel_buf(BLOCK)
        r.load("l", [(b"fallback", d, BLOCK)])
        assert finish(r)["l"].ok == [True]
        check_dests([b"fallback"], [d])
    finally:
        for x in reactors:
            close_reactor(x)
        kio._warned.clear()


def test_io_uring_required_but_disabled(make_layout, monkeypatch):
    monkeypatch.setenv("KVCACHE_DISABLE_IO_URING", "1")
    lay = make_layout()
    with pytest.raises(RuntimeError, match="io_uring"):
        Reactor(lay, n_slots=3, io_depth=2, engine="io_uring", pin=False)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("case", ["key_too_long", "store_larger_than_block",
                                  "dest_smaller_than_nbytes"])
def test_bad_request_fails_its_item_and_reactor_keeps_serving(make_layout, make_reactor,
                                                              case):
    """'Errors never escape the reactor': a caller mistake must fail that item (or be
    refused at submission), never kill the reactor thread and hang later requests."""
    lay = make_layout()
    r = make_reactor(lay, n_slots=4, io_depth=2)
    k = b"fine"
    assert lay.write_block(k, payload(k, BLOCK))
    try:
        if case == "key_too_long":
            r.store("bad", [(b"k" * 65, payload(b"x", BLOCK), BLOCK)])
        elif case == "store_larger_than_block":
            r.store("bad", [(b"big", bytes(2 * BLOCK), 2 * BLOCK)])
        else:
            r.load("bad", [(k, bytearray(100), BLOCK)])
    except (ValueError, TypeError):
        pass  # refused at submission: fine
    else:
        assert r.wait(10)
        done = {c.req_id: c for c in r.poll()}
        assert done["bad"].ok == [False]
    r._thread.join(0.2)
    assert r._thread.is_alive(), "the reactor thread died on a bad request"
    d = sentinel_buf(BLOCK)
    r.load("after", [(k, d, BLOCK)])
    r.store("after-store", [(b"new", payload(b"new", BLOCK), BLOCK)])
    assert r.wait(5), "reactor stopped serving after a bad request"
    done = {c.req_id: c for c in r.poll()}
    assert done["after"].ok == [True] and done["after-store"].ok == [True]
    check_dests([k], [d])


# --------------------------------------------------------------------------- lifecycle


def test_close_finishes_in_flight_requests(make_layout, make_reactor):
    lay = make_layout()
    col = Collector()
    r = make_reactor(lay, n_slots=4, io_depth=2, on_complete=col)
    keys = keys_of("closing", 20)
    store_all(r, keys)
    r.close()  # no wait(): close must finish what was submitted, then stop
    assert not r._thread.is_alive()
    (c,) = r.poll()
    assert c.req_id == "store" and c.ok == [True] * 20
    for k in keys:
        assert lay.read_block(k) == payload(k, BLOCK)
    r.close()  # idempotent


def test_reactor_without_pinning_does_not_import_torch(tmp_path):
    """CPU-only users (and the crash-test children) pass pin=False: no torch import.
    (With the default pin="auto" the pool imports torch to ask whether CUDA exists.)"""
    script = (
        "import sys\n"
        "from kvcache_core.copy import MemcpyCopier\n"
        "from kvcache_core.layout import Layout, Namespace\n"
        "from kvcache_core.reactor import Reactor\n"
        f"lay = Layout({str(tmp_path / 'root')!r}, Namespace('m', 'bf16', 16, 4096))\n"
        "r = Reactor(lay, n_slots=3, io_depth=2, copier=MemcpyCopier, pin=False)\n"
        "r.store('s', [(b'k', b'v' * 4096, 4096)])\n"
        "r.wait(30)\n"
        "d = bytearray(4096)\n"
        "r.load('l', [(b'k', d, 4096)])\n"
        "r.wait(30)\n"
        "assert [c.success for c in r.poll()] == [True, True] and d == b'v' * 4096\n"
        "r.close(); lay.close()\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=REPO), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_early_store_ack_before_the_writes(make_layout, make_reactor):
    """``early_store_ack``: a store request is acknowledged ("store_copied") once every
    item left its source (device copies done), while its files are still being written,
    from staging slots or from caller-owned slots. The final "store" completion follows;
    every file is there and correct in the end."""
    lay = make_layout()
    seen: list = []

    def on_complete(c):  # reactor thread: record what is published at that moment
        seen.append((c.req_id, c.kind, [lay.exists(k) for k in keys + ext_keys]))

    r = make_reactor(lay, n_slots=6, io_depth=2, external_slots=2, early_store_ack=True,
                     on_complete=on_complete)
    keys = keys_of("early", 5)
    ext_keys = keys_of("early-ext", 2)
    store_all(r, keys, req_id="staging")
    assert r.wait(30)
    r.store("ext", [(k, payload(k, BLOCK), BLOCK, r.n_staging + i, 0)
                    for i, k in enumerate(ext_keys)])
    assert r.wait(30)
    assert [(rid, kind) for rid, kind, _ in seen] == [
        ("staging", "store_copied"), ("staging", "store"), ("ext", "store_copied"),
        ("ext", "store")]
    assert not all(seen[0][2][:5])  # acknowledged before every staging file was published
    assert not all(seen[2][2][5:])  # ... and before every caller-slot file was
    for k in keys + ext_keys:
        assert lay.read_block(k) == payload(k, BLOCK)
    # and without the option nothing changes: one completion per request
    r2 = make_reactor(make_layout(), early_store_ack=False)
    store_all(r2, keys_of("plain", 4), req_id="plain")
    assert finish(r2)["plain"].kind == "store"


def test_reused_caller_slot_waits_for_the_write_from_it(make_layout, make_reactor):
    """After an early acknowledgement the caller may reuse a DRAM-tier slot while the
    reactor still writes a file from it: a store or a disk load into that slot waits, so
    the file holds the first key's bytes and the slot ends with the last key's."""
    lay = make_layout()
    r = make_reactor(lay, n_slots=6, io_depth=2, external_slots=1, early_store_ack=True)
    slot = r.n_staging
    a, b, c = b"reuse-a", b"reuse-b", b"reuse-c"
    lay.write_block(c, payload(c, BLOCK))  # C is on disk: loading it fills the slot
    r.store("A", [(a, payload(a, BLOCK), BLOCK, slot, 0)])  # written through from the slot
    r.store("B", [(b, payload(b, BLOCK), BLOCK, slot, 0)])  # reuses the slot at once
    dest = sentinel_buf(BLOCK)
    r.load("C", [(c, dest, BLOCK, slot, 0)])  # promotion into the same slot
    assert r.wait(30)
    kinds = {}
    for comp in r.poll():
        kinds.setdefault(comp.req_id, []).append(comp.kind)
        if comp.kind != "store_copied":  # the early ack comes before the writes' outcome
            assert all(comp.ok), comp
    assert kinds["A"][-1] == kinds["B"][-1] == "store" and kinds["C"] == ["load"]
    assert lay.read_block(a) == payload(a, BLOCK)  # verified: xxh3 of A's bytes
    assert lay.read_block(b) == payload(b, BLOCK)
    assert bytes(dest[:BLOCK]) == payload(c, BLOCK)
    view = r.pool.views[slot]
    assert bytes(view[HEADER_BYTES:HEADER_BYTES + BLOCK]) == payload(c, BLOCK)


def test_io_uring_probe_that_kills_its_process_falls_back(monkeypatch, caplog):
    """A liburing that dies on this machine (SIGILL in Ring(), seen with 2026.3.x on a
    6.18 Firecracker kernel) kills only the probe's child: the caller gets the POSIX
    engine and a warning that names the signal."""
    monkeypatch.delenv(kio.PROBE_ENV, raising=False)
    monkeypatch.delenv("KVCACHE_DISABLE_IO_URING", raising=False)
    monkeypatch.setattr(kio, "_PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    ok, why = kio.uring_available()
    assert not ok and "SIGILL" in why
    assert os.environ[kio.PROBE_ENV] == why  # children inherit the verdict
    kio._warned.clear()
    with caplog.at_level(logging.WARNING, logger="kvcache_core.io"):
        eng = kio.make_engine("auto", depth=2)
    try:
        assert eng.name == "posix"
        assert any("SIGILL" in rec.getMessage() for rec in caplog.records)
        with pytest.raises(RuntimeError, match="SIGILL"):
            kio.make_engine("io_uring", depth=2)
    finally:
        eng.shutdown()


def test_dead_reactor_completes_everything_at_once(make_layout, make_reactor, caplog):
    """A bug that kills the reactor thread: the request in flight completes with its items
    failed, and so does every later one, at once; wait() never hangs; the reason is kept."""
    lay = make_layout()
    r = make_reactor(lay, n_slots=4, io_depth=2)
    store_all(r, [b"dead-1"])
    assert finish(r)["store"].ok == [True]

    def boom(tag, res):
        raise RuntimeError("injected reactor bug")

    r._on_cqe = boom
    with caplog.at_level(logging.ERROR):
        d = sentinel_buf(BLOCK)
        r.load("L1", [(b"dead-1", d, BLOCK)])
        assert r.wait(10)
    assert not r.healthy and "injected reactor bug" in r.dead
    assert any("reactor crashed" in rec.getMessage() for rec in caplog.records)
    r.load("L2", [(b"dead-1", sentinel_buf(BLOCK), BLOCK)])
    store_all(r, [b"dead-2"], req_id="S2")
    assert r.wait(5)
    res = {c.req_id: c for c in r.poll()}
    assert res["L1"].ok == [False] and res["L2"].ok == [False] and res["S2"].ok == [False]
    assert bytes(d) == bytes(sentinel_buf(BLOCK))  # nothing half-copied was reported ok


def test_unlink_refused_is_counted_and_the_reactor_keeps_serving(make_layout, make_reactor,
                                                                 monkeypatch):
    """A corrupt file that cannot be removed (EACCES in a root shared by several users):
    the load is a counted miss, the error is counted, the reactor stays alive."""
    import kvcache_core.layout as L

    lay = make_layout()
    r = make_reactor(lay, n_slots=4, io_depth=2)
    store_all(r, [b"eacces-1", b"eacces-2"])
    assert finish(r)["store"].ok == [True, True]
    p = lay.path_for(b"eacces-1")
    with open(p, "r+b") as f:  # corrupt the payload
        f.seek(HEADER_BYTES + 10)
        f.write(b"\xff\x00\xff")
    real_unlink = os.unlink

    def refuse(path, *a, **kw):
        if path == p:
            raise PermissionError(13, "Permission denied", path)
        return real_unlink(path, *a, **kw)

    monkeypatch.setattr(L.os, "unlink", refuse)
    r.load("L1", [(b"eacces-1", sentinel_buf(BLOCK), BLOCK)])
    assert finish(r)["L1"].ok == [False]
    assert r.healthy and lay.stats.unlink_errors == 1 and r.stats.loads_corrupt == 1
    d = sentinel_buf(BLOCK)
    r.load("L2", [(b"eacces-2", d, BLOCK)])
    assert finish(r)["L2"].ok == [True]
    check_dests([b"eacces-2"], [d])


# --------------------------------------------------------------------------- deadlines


@pytest.mark.parametrize("engine", ["posix"])
def test_blocked_opens_expire_and_every_request_completes(make_layout, make_reactor):
    """Issue 12 item 1: ten loads whose files never open (FIFOs without a writer: a hung
    filesystem) all complete, as misses, within twice the deadline, although more opens
    are stuck than the lookahead allows; once the opens come back the stuck operations
    are reaped (no fd, slot or I/O unit leaks) and the reactor serves normally."""
    lay = make_layout()
    good = b"present"
    assert lay.write_block(good, payload(good, BLOCK))
    col = Collector()
    r = make_reactor(lay, n_slots=6, io_depth=4, lookahead=4, on_complete=col,
                     io_timeout_s=0.4)
    keys = _fifo_keys(lay, "hang", 10)
    try:
        t0 = time.monotonic()
        for i, k in enumerate(keys):
            r.load(i, [(k, sentinel_buf(BLOCK), BLOCK)])
        done = [col.get(i, 10) for i in range(len(keys))]
        took = time.monotonic() - t0
        assert all(c is not None and c.ok == [False] for c in done), done
        assert took < 2 * 0.4 + 1.0, took
        assert r.stats.ops_expired == 4  # the opens in flight (lookahead 4)
        assert r.stats.items_expired == 6  # queued behind them, never started
        d = sentinel_buf(BLOCK)  # stuck opens still hold the lookahead: this one expires
        r.load("stuck", [(good, d, BLOCK)])
        assert col.get("stuck", 10).ok == [False]
        _release_fifos(lay, keys)  # the kernel finishes the stuck opens: reaped
        assert wait_until(lambda: r._opening == 0 and not r._tasks, 10)
        d = sentinel_buf(BLOCK)
        r.load("after", [(good, d, BLOCK)])
        c = col.get("after", 10)
        assert c is not None and c.ok == [True] and bytes(d) == payload(good, BLOCK)
        assert r.alloc.busy == 0 and r._io_inflight == 0 and not col.duplicates
    finally:
        _release_fifos(lay, keys)
        for k in keys:
            if os.path.exists(lay.path_for(k)):
                os.unlink(lay.path_for(k))


def test_stalled_write_expires_the_store_and_publishes_nothing(make_layout):
    """A file write that never completes (disk stalled) drops its block at the deadline:
    the store completes (item failed) while the write is still in flight; when the write
    finally completes, its temp file is removed and nothing is published."""
    lay = make_layout()
    gate = threading.Event()
    eng = GatedWriteEngine(2, gate)
    col = Collector()
    r = Reactor(lay, n_slots=4, io_depth=2, copier=MemcpyCopier, pin=False, engine=eng,
                on_complete=col, io_timeout_s=0.3)
    try:
        k = b"stalled-write"
        r.store("S", [(k, payload(k, BLOCK), BLOCK)])
        c = col.get("S", 10)
        assert c is not None and c.ok == [False]
        assert r.stats.ops_expired == 1 and eng.writes_seen == 1
        assert not lay.exists(k)
        gate.set()
        eng.wake()
        assert wait_until(lambda: not r._tasks and r._io_inflight == 0, 10)
        assert not lay.exists(k)
        _, temps = list_files(lay.base)
        assert temps == []
        k2 = b"after-the-stall"  # the reactor writes normally again
        r.store("S2", [(k2, payload(k2, BLOCK), BLOCK)])
        assert col.get("S2", 10).ok == [True] and lay.exists(k2)
    finally:
        gate.set()
        r.close()


def test_no_deadline_by_default_in_the_reactor_and_config_validates_it():
    from kvcache_core.config import ConfigError, StorageConfig

    assert StorageConfig().io_timeout_s == 30.0
    for bad in (-1, "5", True, 1e9):
        with pytest.raises(ConfigError, match="'io_timeout_s'"):
            StorageConfig(io_timeout_s=bad)
    assert StorageConfig(io_timeout_s=0).io_timeout_s == 0


def test_dram_hits_refresh_the_files_shared_recency(make_layout, make_reactor):
    """With ``max_disk_bytes`` the disk's LRU is shared by every process through the
    files' mtime: a hit served from a retained (DRAM) slot touches the file as a disk hit
    does, so a block that stays hot in DRAM is not the first one evicted on disk."""
    lay = make_layout(max_disk_bytes=1 << 30)
    r = make_reactor(lay, retain=True)
    keys = keys_of("hot", 3)
    store_all(r, keys)
    assert finish(r)["store"].ok == [True] * 3
    dests = [sentinel_buf(BLOCK) for _ in keys]
    r.load("disk", [(k, d, BLOCK) for k, d in zip(keys, dests, strict=True)])
    assert finish(r)["disk"].ok == [True] * 3
    reads = r.stats.bytes_read
    old = time.time() - 1000
    for k in keys:
        os.utime(lay.path_for(k), (old, old))
    r.load("dram", [(k, d, BLOCK) for k, d in zip(keys, dests, strict=True)])
    assert finish(r)["dram"].ok == [True] * 3
    assert r.stats.bytes_read == reads  # served from the retained slots, no disk read
    check_dests(keys, dests)
    for k in keys:
        assert os.stat(lay.path_for(k)).st_mtime > old + 900


def test_publish_over_the_bound_counts_a_capacity_drop(make_layout, make_reactor,
                                                       monkeypatch):
    """The bound is checked again under the ledger lock at publish (another process may
    have filled the room since ``reserve``): that drop is a capacity drop, not ENOSPC."""
    from kvcache_core.layout import CapacityExceeded

    lay = make_layout(max_disk_bytes=1 << 30)

    def full(tmp, final, nbytes):
        lay.discard(tmp)
        raise CapacityExceeded(28, "namespace full")

    monkeypatch.setattr(lay, "publish", full)
    r = make_reactor(lay)
    store_all(r, keys_of("cap", 2))
    assert finish(r)["store"].ok == [False, False]
    assert r.stats.stores_dropped_capacity == 2 and r.stats.stores_dropped_enospc == 0
    assert list_files(lay.base) == ([], [])


def test_trace_gil_probe_sees_a_long_gil_hold_and_the_report_shows_it(make_layout,
                                                                     make_reactor, tmp_path):
    """With the diagnostic trace on, a probe thread records ``gil_late`` when another
    thread keeps the GIL (here a C loop, ``sum`` over a range, that never hands it over);
    with the trace off there is no probe. ``scripts/trace_report.py`` puts the longest
    wait inside a request's window in its ``GIL wait`` column."""
    import json

    lay = make_layout()
    r = make_reactor(lay, trace=True)
    assert any(t.name.endswith("-gil-probe") for t in threading.enumerate())
    time.sleep(0.02)
    t0 = time.monotonic()
    held, n = 0.0, 3_000_000
    while held < 0.06:  # one C call of >= 60 ms: longer each try, whatever the machine
        a = time.monotonic()
        sum(range(n))
        held = time.monotonic() - a
        n *= 2
    time.sleep(0.02)
    r.trace_event("direct_issued", 7, 1234)
    r.trace_event("direct_ops", 7, 114688)
    r.trace_event("direct_copy", 7, 136000)
    import gc

    gc.collect(2)
    gcs = [e for e in r.trace if e[1] == "gc"]
    assert gcs and gcs[-1][2] == 2 and gcs[-1][3] >= 0, gcs  # generation, microseconds
    late = [e for e in r.trace if e[1] == "gil_late"]
    assert late and max(e[3] for e in late) >= 0.5 * held * 1e6, (late, held)
    d = tmp_path / "trace"
    d.mkdir()
    (d / "x.requests.json").write_text(json.dumps([["req", 16, t0, time.monotonic()]]))
    (d / "x.r0.json").write_text(json.dumps([list(e) for e in r.trace]))
    out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "trace_report.py"),
                          str(d), "--json", str(tmp_path / "rows.json")],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "GIL wait" in out and "issue ms" in out and "gc ms" in out, out
    row = json.loads((tmp_path / "rows.json").read_text())[0]
    assert row["gil_late_max_ms"] >= 0.5 * held * 1e3 and row["direct_issue_ms"] == 1.234
    assert row["direct_copy_ms"] == 136.0 and "copy ms" in out
    assert row["direct_ops"] == 114688 and "descs" in out

    def probes() -> int:
        return sum(t.name.endswith("-gil-probe") for t in threading.enumerate())

    before = probes()
    r2 = make_reactor(lay)
    assert r2.trace is None and probes() == before  # no trace, no probe
    cb = r._gc_cb
    assert cb in gc.callbacks
    close_reactor(r)
    assert wait_until(lambda: probes() <= before - 1)  # the probe ends with its reactor
    assert cb not in gc.callbacks  # and so does the gc callback


def test_trace_records_every_read_and_the_loads_report_shows_the_order(make_layout,
                                                                       make_reactor,
                                                                       tmp_path):
    """With the diagnostic trace on, every disk read leaves ``read_start`` and
    ``read_done`` events (request id, item index). Two load jobs submitted together with
    one read in flight at a time are read one after the other, first come first read,
    which ``scripts/trace_report.py --loads`` shows per job: its own reads, and 0 reads
    of the other job inside its first-to-last read window; a job whose keys another
    job is reading joins that read and reads nothing itself."""
    import json

    lay = make_layout()
    r = make_reactor(lay, trace=True, io_depth=1, n_slots=3, lookahead=2)
    ka, kb = keys_of("ta", 4), keys_of("tb", 4)
    store_all(r, ka + kb)
    assert finish(r)["store"].ok == [True] * 8
    t0 = time.monotonic()
    dests = {j: [sentinel_buf(BLOCK) for _ in range(4)] for j in "ABC"}
    r.load("A", [(k, d, BLOCK) for k, d in zip(ka, dests["A"], strict=True)])
    r.load("B", [(k, d, BLOCK) for k, d in zip(kb, dests["B"], strict=True)])
    r.load("C", [(k, d, BLOCK) for k, d in zip(kb, dests["C"], strict=True)])  # joins B
    done = finish(r)
    assert all(done[j].ok == [True] * 4 for j in "ABC")
    check_dests(ka, dests["A"]), check_dests(kb, dests["B"]), check_dests(kb, dests["C"])
    starts = [(e[2], e[3]) for e in r.trace if e[1] == "read_start"]
    assert starts == [("A", i) for i in range(4)] + [("B", i) for i in range(4)], starts
    assert sum(e[1] == "read_done" for e in r.trace) == 8
    d = tmp_path / "trace"
    d.mkdir()
    (d / "x.requests.json").write_text(json.dumps([["req", 16, t0, time.monotonic()]]))
    (d / "x.r0.json").write_text(json.dumps([list(e) for e in r.trace]))
    out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "trace_report.py"),
                          str(d), "--loads", "--json", str(tmp_path / "jobs.json")],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "others" in out and "1st read" in out, out
    jobs = {j["job"]: j for j in json.loads((tmp_path / "jobs.json").read_text())}
    assert [jobs[j]["reads"] for j in "ABC"] == [4, 4, 0]
    assert jobs["A"]["others"] == jobs["B"]["others"] == 0
    assert jobs["A"]["last_read_ms"] <= jobs["B"]["first_read_ms"]
    assert all(jobs[j]["done_ms"] is not None for j in "ABC")
    out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "trace_report.py"),
                          str(d), "--loads", "--summary"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "3 load jobs, 2 read from disk (8 reads), others median 0 max 0" in out, out


def test_trace_samples_the_engine_thread_when_it_stops_marking_steps(make_layout,
                                                                    make_reactor):
    """Trace mode: a thread that marks engine steps (``trace_event("fwd_end")``, as the
    vLLM worker does) and then sits in a call that releases the GIL for 0.6 s while the
    reactor has requests outstanding gets its stack sampled: ``stall_stack`` events whose
    frames name the function it sits in, with the time since its last mark; while it
    keeps marking steps, or with nothing outstanding, nothing is sampled."""
    lay = make_layout()
    r = make_reactor(lay, trace=True)
    r.trace_event("fwd_end")

    def blocked_in_lookup() -> None:
        time.sleep(0.6)  # releases the GIL, like a file lookup or a wait

    with r._cv:  # white box: one request outstanding for the whole test, without I/O
        r._outstanding += 1
    try:
        for _ in range(20):  # marking steps every 10 ms: no stall
            r.trace_event("fwd_start")
            time.sleep(0.01)
        assert not [e for e in r.trace if e[1] == "stall_stack"]
        r.trace_event("fwd_end")
        blocked_in_lookup()
    finally:
        with r._cv:
            r._outstanding -= 1
    samples = [e for e in r.trace if e[1] == "stall_stack"]
    assert samples, [e[1] for e in r.trace][-20:]
    assert all("blocked_in_lookup" in e[2] for e in samples), samples
    assert all(e[3] >= 250 for e in samples) and len(samples) <= 5, samples
    n = len(r.trace)
    r.trace_event("fwd_end")
    time.sleep(0.4)  # nothing outstanding now: no samples
    assert not [e for e in r.trace[n:] if e[1] == "stall_stack"]


def test_trace_records_major_page_faults(make_layout, make_reactor, tmp_path):
    """Trace mode: pages of a file that this process maps and touches after the page
    cache dropped them are major faults, and the probe records them (``majflt`` events,
    n = new faults since its last look) within FAULT_SAMPLE_S."""
    import mmap

    from kvcache_core.reactor import FAULT_SAMPLE_S

    path = tmp_path / "cold.bin"
    size = 8 << 20
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: dropped
        r = make_reactor(make_layout(), trace=True)
        time.sleep(3 * FAULT_SAMPLE_S)
        n0 = sum(e[3] for e in r.trace if e[1] == "majflt")
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
            touched = sum(m[i] for i in range(0, size, 4096))
        time.sleep(3 * FAULT_SAMPLE_S)
    finally:
        os.close(fd)
    got = sum(e[3] for e in r.trace if e[1] == "majflt") - n0
    if got == 0 and not os.environ.get("KV_REQUIRE_MAJFLT"):
        pytest.skip("this filesystem kept the pages (no major fault to see)")
    assert got >= 1 and touched >= 0


@pytest.mark.parametrize("io_async", ["on", "off", "auto"])
def test_io_async_hands_reads_to_kernel_workers_and_times_every_submit(make_layout,
                                                                       make_reactor,
                                                                       io_async):
    """``io_async`` (config key): "on" sets IOSQE_ASYNC on every read and write of the
    io_uring engine (the kernel's workers pin the pages and build the requests, not the
    reactor thread under the GIL), "off" on none, "auto" only without O_DIRECT. Either
    way the bytes are the same, and the reactor's timing counts the time spent in each
    submit that had work (``submit_s`` > 0, ``submit_max_s`` <= ``submit_s``)."""
    lay = make_layout()
    r = make_reactor(lay, io_depth=4, n_slots=6, io_async=io_async)
    if r.engine.name == "io_uring":  # the POSIX engine's threads have no such flag
        import liburing

        want = io_async == "on" or (io_async == "auto" and not r.direct)
        assert r.engine._flags == (liburing.IOSQE_ASYNC if want else 0)
    ks = keys_of(f"ioa-{io_async}", 12)
    store_all(r, ks)
    assert finish(r)["store"].ok == [True] * 12
    dests = [sentinel_buf(BLOCK) for _ in ks]
    r.load("L", [(k, d, BLOCK) for k, d in zip(ks, dests, strict=True)])
    assert finish(r)["L"].ok == [True] * 12
    check_dests(ks, dests)
    tm = r.timing
    assert tm["submit_s"] > 0 and 0 < tm["submit_max_s"] <= tm["submit_s"], tm


def test_io_async_refuses_an_unknown_mode(make_layout):
    with pytest.raises(ValueError, match="io_async"):
        Reactor(make_layout(), n_slots=4, io_async="sometimes")


def test_a_load_after_a_promotion_copies_from_its_slot_once_read(make_layout, make_reactor):
    """``AFTER_LOAD`` (``join_promotions``): loads of a key whose promotion into a
    caller-owned slot was submitted before them wait until that read is done, then copy
    from the slot: one disk read for all of them, the right bytes in every destination,
    and a store that reuses the slot next waits until their copies are done. When the
    promotion fails (its file is missing), the slot's header is zeroed before the waiting
    loads start, so a header check (the vLLM copier's) fails them instead of copying
    what the read left there."""
    from kvcache_core.flags import AFTER_LOAD, IN_SLOT

    lay = make_layout()
    r = make_reactor(lay, n_slots=6, io_depth=2, external_slots=1)
    slot = r.n_staging
    k, s = b"promo-k", b"promo-store"
    lay.write_block(k, payload(k, BLOCK))
    da, db, dc = (sentinel_buf(BLOCK) for _ in range(3))
    r.load("A", [(k, da, BLOCK, slot, 0)])  # promotion into the caller's slot
    r.load("B", [(k, db, BLOCK, slot, IN_SLOT | AFTER_LOAD)])
    r.load("C", [(k, dc, BLOCK, slot, IN_SLOT | AFTER_LOAD)])
    r.store("S", [(s, payload(s, BLOCK), BLOCK, slot, 0)])  # reuses the slot after them
    done = finish(r)
    assert all(done[j].ok == [True] for j in "ABCS"), done
    for d in (da, db, dc):
        check_dests([k], [d])
    assert r.stats.bytes_read == lay.ns.file_bytes  # one read for the three loads
    assert r.stats.loads_joined_promotion == 2 and r.stats.loads_dram == 0
    assert lay.read_block(s) == payload(s, BLOCK)
    view = r.pool.views[slot]
    assert bytes(view[HEADER_BYTES:HEADER_BYTES + BLOCK]) == payload(s, BLOCK)

    # the promotion fails: the waiting load finds no block header in the slot
    m = b"promo-missing"
    de, df = sentinel_buf(BLOCK), sentinel_buf(BLOCK)
    r.load("E", [(m, de, BLOCK, slot, 0)])
    r.load("F", [(m, df, BLOCK, slot, IN_SLOT | AFTER_LOAD)])
    done = finish(r)
    assert done["E"].ok == [False]
    assert bytes(r.pool.views[slot][:8]) == bytes(8)  # magic zeroed before F copied
    assert r.stats.loads_joined_promotion == 3
    # a load after a promotion that already finished copies at once (and owns the slot
    # while it does)
    dg = sentinel_buf(BLOCK)
    r.load("G", [(k, None, 0, slot, 0)])
    finish(r)
    r.load("H", [(k, dg, BLOCK, slot, IN_SLOT | AFTER_LOAD)])
    assert finish(r)["H"].ok == [True]
    check_dests([k], [dg])
