"""The store path never waits for the disk (issue 9): ``store_policy="drop"``, write-back
from caller-owned (DRAM-tier) slots, one batched device copy per store request.

The disk is stalled deterministically with :class:`GatedWriteEngine` (write completions
withheld until a gate opens), so every assertion is about order, never about timing.
"""

from __future__ import annotations

import threading
import time

import pytest
from helpers.kvutil import BLOCK, GatedWriteEngine, finish, payload, sentinel_buf, wait_until

from kvcache_core.copy import MemcpyCopier
from kvcache_core.reactor import Reactor


def keys_of(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i:04d}".encode() for i in range(n)]


def items(keys, ext_base: int = -1):
    if ext_base < 0:
        return [(k, payload(k, BLOCK), BLOCK) for k in keys]
    return [(k, payload(k, BLOCK), BLOCK, ext_base + i, 0) for i, k in enumerate(keys)]


class CountingCopier(MemcpyCopier):
    """Memcpy copier that records every batched store copy (slots per call)."""

    batches: list[list[int]] = []

    def from_device_batch(self, slots, srcs, nbytes):
        CountingCopier.batches.append(list(slots))
        return super().from_device_batch(slots, srcs, nbytes)


def _acks(r: Reactor, req_id, timeout: float = 10.0) -> list[str]:
    """Kinds of ``req_id``'s completions seen within ``timeout`` (polls)."""
    seen: list[str] = []

    def got() -> bool:
        seen.extend(c.kind for c in r.poll() if c.req_id == req_id)
        return "store_copied" in seen or "store" in seen

    wait_until(got, timeout)
    return seen


def test_store_ack_does_not_wait_for_a_stalled_disk_and_overflow_is_dropped(make_layout):
    """Disk stalled: a store is acknowledged once copied (nothing published yet). Staging
    slots above the io_depth reservation fill up; the next store's blocks are dropped and
    counted at once instead of queueing behind the disk (and the rest of that request
    with them), while a foreground load still gets a reserved slot. Once the disk moves,
    everything that was copied is published intact and nothing dropped is on disk."""
    lay = make_layout()
    gate = threading.Event()
    eng = GatedWriteEngine(2, gate)
    CountingCopier.batches = []
    r = Reactor(lay, n_slots=6, io_depth=2, copier=CountingCopier, pin=False, engine=eng,
                early_store_ack=True, store_policy="drop")
    try:
        pre = b"already-on-disk"
        lay.write_block(pre, payload(pre, BLOCK))
        a = keys_of("a", 3)
        r.store("A", items(a))
        assert _acks(r, "A") == ["store_copied"]  # acknowledged with the disk stalled
        assert not any(lay.exists(k) for k in a)
        assert CountingCopier.batches == [[0, 1, 2]]  # ONE device copy for the request
        b = keys_of("b", 4)  # 1 slot left above the reservation of 2: 1 copied, 3 dropped
        r.store("B", items(b))
        kinds = _acks(r, "B")
        assert kinds and kinds[0] == "store_copied"
        assert r.stats.stores_dropped_backpressure == 3
        assert r.alloc.busy == 4  # 3 + 1 staging slots held by stalled writes
        dest = sentinel_buf(BLOCK)  # a foreground load still gets a reserved slot
        r.load("L", [(pre, dest, BLOCK)])
        wait_until(lambda: any(c.req_id == "L" and c.ok == [True] for c in r.poll()), 10)
        assert bytes(dest) == payload(pre, BLOCK)
        assert r.alloc.peak_busy <= r.n_staging
        gate.set()
        eng.wake()
        assert r.wait(30)
        for k in a + b[:1]:
            assert lay.read_block(k) == payload(k, BLOCK)
        for k in b[1:]:
            assert not lay.exists(k)
        assert lay.read_block(pre) == payload(pre, BLOCK)  # nothing published was lost
        assert r.stats.stores_ok == 4
    finally:
        gate.set()
        eng.wake()
        r.close()


def test_dram_tier_slots_are_the_write_back_buffer(make_layout):
    """Stores into caller-owned (DRAM-tier) slots never need a staging slot: with the
    disk stalled, many more blocks than the staging pool holds are copied and
    acknowledged, none dropped; the files follow once the disk moves, written from the
    slots (which keep the bytes, header first)."""
    lay = make_layout()
    gate = threading.Event()
    eng = GatedWriteEngine(2, gate)
    n_ext = 12
    r = Reactor(lay, n_slots=4, io_depth=2, external_slots=n_ext, copier=MemcpyCopier,
                pin=False, engine=eng, early_store_ack=True, store_policy="drop")
    try:
        ks = keys_of("dram", n_ext)
        r.store("D", items(ks, ext_base=r.n_staging))
        assert _acks(r, "D") == ["store_copied"]
        assert r.stats.stores_dropped_backpressure == 0
        assert r.alloc.busy == 0  # no staging slot used
        assert eng.writes_seen <= 2  # at most io_depth writes started meanwhile
        gate.set()
        eng.wake()
        assert r.wait(30)
        for i, k in enumerate(ks):
            assert lay.read_block(k) == payload(k, BLOCK)
            view = r.pool.views[r.n_staging + i]
            assert lay.check_block(view, lay.ns.file_bytes, k, True) == BLOCK
        assert r.stats.ext_slot_waits == 0
    finally:
        gate.set()
        eng.wake()
        r.close()


def test_wait_policy_queues_stores_behind_the_disk(make_layout):
    """``store_policy="wait"`` (benchmarks, tests) keeps the old contract: nothing is
    dropped, a store that finds no slot waits for one."""
    lay = make_layout()
    gate = threading.Event()
    eng = GatedWriteEngine(2, gate)
    r = Reactor(lay, n_slots=4, io_depth=2, copier=MemcpyCopier, pin=False, engine=eng,
                store_policy="wait")
    try:
        ks = keys_of("w", 6)
        r.store("W", items(ks))
        assert not r.wait(0.5)  # 4 slots held by stalled writes, 2 blocks wait
        assert r.stats.stores_dropped_backpressure == 0
        gate.set()
        eng.wake()
        res = finish(r)
        assert res["W"].ok == [True] * 6
        for k in ks:
            assert lay.read_block(k) == payload(k, BLOCK)
    finally:
        gate.set()
        eng.wake()
        r.close()


def test_writeback_defer_is_checked(make_layout):
    with pytest.raises(ValueError, match="writeback_defer_s"):
        Reactor(make_layout(), n_slots=4, io_depth=2, copier=MemcpyCopier, pin=False,
                engine="posix", writeback_defer_s=-1)


def test_store_policy_is_checked(make_layout):
    with pytest.raises(ValueError, match="store_policy"):
        Reactor(make_layout(), n_slots=4, io_depth=2, copier=MemcpyCopier, pin=False,
                engine="posix", store_policy="block")


@pytest.mark.parametrize("how", ["config", "env"])
def test_writeback_defer_knob_holds_files_behind_foreground_work(make_layout, monkeypatch,
                                                                 how):
    """``writeback_defer_s`` (config key; the env ``KVCACHE_WRITEBACK_DEFER_MS`` of older
    runs): after a request arrives, no write-back file starts for that long (the store is
    still acknowledged at once); then the files follow without any further request."""
    kw = {}
    if how == "env":
        monkeypatch.setenv("KVCACHE_WRITEBACK_DEFER_MS", "400")
    else:
        monkeypatch.delenv("KVCACHE_WRITEBACK_DEFER_MS", raising=False)
        kw["writeback_defer_s"] = 0.4
    lay = make_layout()
    r = Reactor(lay, n_slots=6, io_depth=2, copier=MemcpyCopier, pin=False, engine="posix",
                early_store_ack=True, store_policy="drop", **kw)
    assert r.writeback_defer_s == pytest.approx(0.4)
    try:
        ks = keys_of("defer", 3)
        r.store("S", items(ks))
        assert _acks(r, "S") == ["store_copied"]
        assert wait_until(lambda: False, 0.15) is False  # 150 ms inside the 400 ms window
        assert not any(lay.exists(k) for k in ks)
        assert r.wait(10)
        for k in ks:
            assert lay.read_block(k) == payload(k, BLOCK)
    finally:
        r.close()


def test_flush_writes_a_kept_dram_slot_later_and_refuses_a_wrong_one(make_layout):
    """Deferred write-back: blocks stored into caller-owned slots WITHOUT a file (NO_DISK,
    the scheduler's write-back was full) are written later from those slots by FLUSH
    items, with no device copy (the source is gone by then) and the same publish path
    (checksum sealed, file readable and verified). A FLUSH of a slot that holds another
    key's block writes nothing and fails only that item; a key already on disk is not
    written twice."""
    from kvcache_core.flags import FLUSH, NO_DISK

    lay = make_layout()
    CountingCopier.batches = []
    r = Reactor(lay, n_slots=4, io_depth=2, external_slots=4, copier=CountingCopier,
                pin=False, early_store_ack=True, store_policy="drop")
    try:
        ks = keys_of("kept", 3)
        base = r.n_staging
        r.store("S", [(k, payload(k, BLOCK), BLOCK, base + i, NO_DISK)
                      for i, k in enumerate(ks)])
        assert r.wait(30)
        done = {c.req_id: c for c in r.poll() if c.kind != "store_copied"}
        assert done["S"].ok == [True] * 3 and not any(lay.exists(k) for k in ks)
        copies = len(CountingCopier.batches)
        lay.write_block(ks[2], payload(ks[2], BLOCK))  # another instance wrote this one
        stored = r.stats.stores_existing
        r.store(("flush", 1), [(ks[0], None, 0, base, FLUSH),
                               (ks[1], None, 0, base, FLUSH),  # slot 0 holds ks[0]
                               (ks[2], None, 0, base + 2, FLUSH)])
        done = finish(r)
        assert done[("flush", 1)].ok == [True, False, True]
        assert len(CountingCopier.batches) == copies  # no device copy for a flush
        assert lay.read_block(ks[0]) == payload(ks[0], BLOCK)
        assert lay.check_block(r.pool.views[base], lay.ns.file_bytes, ks[0], True) == BLOCK
        assert not lay.exists(ks[1])
        assert r.stats.stores_flushed == 1 and r.stats.flushes_invalid == 1
        assert r.stats.stores_existing == stored + 1
        # the flushed file serves a load like any other
        dest = sentinel_buf(BLOCK)
        r.load("L", [(ks[0], dest, BLOCK)])
        assert finish(r)["L"].ok == [True] and bytes(dest) == payload(ks[0], BLOCK)
    finally:
        r.close()


class SlowAsyncCopier(MemcpyCopier):
    """Memcpy copier whose store copies 'finish' COPY_S after they were issued, like a
    CUDA copy behind the step that produced its blocks (the reactor must wait for them)."""

    asynchronous = True
    COPY_S = 0.1

    def from_device_batch(self, slots, srcs, nbytes):
        super().from_device_batch(slots, srcs, nbytes)
        return time.perf_counter() + self.COPY_S

    def store_done(self, handle):
        return handle is None or time.perf_counter() >= handle

    def done(self, handle):
        return self.store_done(handle)


@pytest.mark.parametrize("eng", ["posix"])
def test_store_copy_wait_block_wakes_the_reactor_once_per_copy(make_layout, eng):
    """store_copy_wait='poll' wakes the reactor every STORE_POLL_S while a store copy is
    in flight (each wake-up takes the GIL from vLLM's engine thread); 'block' waits in a
    helper thread and wakes it once per copy. Same stores, same files, far fewer
    reactor iterations; the helper thread stops with the reactor."""
    iters = {}
    for mode in ("poll", "block"):
        lay = make_layout()
        r = Reactor(lay, n_slots=6, io_depth=2, copier=SlowAsyncCopier, pin=False,
                    engine=eng, early_store_ack=True, store_policy="drop",
                    store_copy_wait=mode)
        try:
            ks = keys_of(mode, 8)
            before = r.timing["iterations"]
            for i, k in enumerate(ks):
                r.store(f"S{i}", items([k]))
                assert _acks(r, f"S{i}")[0] == "store_copied"
            iters[mode] = r.timing["iterations"] - before
            assert r.wait(30)
            for k in ks:  # the copies' bytes reached the files
                assert lay.read_block(k) == payload(k, BLOCK)
            assert r.timing["copy_waits"] == (8 if mode == "block" else 0)
            waiter = r._waiter
            assert (waiter is not None) == (mode == "block")
        finally:
            r.close()
        if waiter is not None:
            assert not waiter.is_alive()
    # poll: ~COPY_S / STORE_POLL_S (100) wake-ups per copy; block: a handful (~8)
    assert iters["block"] * 3 < iters["poll"], iters


def test_store_copy_wait_is_validated(make_layout):
    with pytest.raises(ValueError, match="store_copy_wait"):
        Reactor(make_layout(), n_slots=4, io_depth=2, copier=MemcpyCopier, pin=False,
                engine="posix", store_copy_wait="spin")
    from kvcache_core.config import ConfigError, StorageConfig

    with pytest.raises(ConfigError, match="store_copy_wait"):
        StorageConfig.from_dict({"root_dir": "/tmp/x", "store_copy_wait": "spin"})
    assert StorageConfig.from_dict({"root_dir": "/tmp/x"}).store_copy_wait == "poll"


def test_copy_mode_keys_are_validated():
    """``store_copy`` and ``dram_load_copy``: 'dma', 'kernel' or 'auto'; anything else is
    a config error that names the key. Defaults: stores on DMA until their H200 A/B,
    DRAM hits on 'auto'."""
    from kvcache_core.config import ConfigError, StorageConfig

    for key in ("store_copy", "dram_load_copy"):
        for bad in ("fast", "", 1, None):
            with pytest.raises(ConfigError, match=f"'{key}'"):
                StorageConfig.from_dict({"root_dir": "/tmp/x", key: bad})
        assert getattr(StorageConfig.from_dict({"root_dir": "/tmp/x", key: "kernel"}),
                       key) == "kernel"
    cfg = StorageConfig.from_dict({"root_dir": "/tmp/x"})
    assert (cfg.store_copy, cfg.dram_load_copy) == ("dma", "auto")


@pytest.mark.parametrize("wdr", [None, 0, 1])
def test_write_depth_reading_keeps_writes_behind_a_stuck_read(make_layout, wdr):
    """``write_depth_reading``: an on-demand read is stuck on the disk (its completion
    withheld by :class:`GatedReadEngine`) while three stores arrive. By default their
    files are written meanwhile; with 0 none starts until the read completes, with 1 they
    are written one at a time. The stores are acknowledged at once either way, and
    every file is written in the end."""
    from helpers.kvutil import GatedReadEngine

    lay = make_layout()
    k = b"wdr-read"
    assert lay.write_block(k, payload(k, BLOCK))
    gate = threading.Event()
    eng = GatedReadEngine(6, gate, {lay.path_for(k)[-16:]})
    r = Reactor(lay, n_slots=8, io_depth=4, lookahead=2, engine=eng, copier=MemcpyCopier,
                pin=False, early_store_ack=True, store_policy="drop",
                write_depth_reading=wdr)
    assert r.write_depth == 2 and r.write_depth_reading == (2 if wdr is None else wdr)
    peak = [0]
    start_write = r._start_write

    def counted(t):  # on the reactor thread: the files in flight once this one started
        start_write(t)
        peak[0] = max(peak[0], r._writes_inflight)

    r._start_write = counted
    try:
        d = sentinel_buf(BLOCK)
        r.load("fg", [(k, d, BLOCK)])
        assert wait_until(lambda: len(eng.held) >= 1, 10)  # the read is stuck
        ks = keys_of("wdr", 3)
        r.store("S", items(ks))
        acks = _acks(r, "S")
        # acknowledged once copied; where writes may run beside the read (not 0) the
        # files can be done, and their "store" completion seen, by the same poll
        assert acks[0] == "store_copied", acks
        if wdr == 0:
            assert acks == ["store_copied"], acks

        def written() -> bool:
            return all(lay.exists(x) for x in ks)

        # 0: 300 ms with the read stuck and no file started; else every file is written
        # while the read is still stuck
        assert wait_until(written, 0.3 if wdr == 0 else 20) is (wdr != 0)
        assert len(eng.held) == 1
        if wdr == 0:
            assert not any(lay.exists(x) for x in ks) and peak[0] == 0
        else:
            assert 1 <= peak[0] <= r.write_depth_reading
        gate.set()
        eng.wake()
        assert r.wait(10)
        assert bytes(d) == payload(k, BLOCK)
        for x in ks:
            assert lay.read_block(x) == payload(x, BLOCK)
    finally:
        gate.set()
        eng.wake()
        r.close()


def test_write_depth_reading_is_checked(make_layout):
    with pytest.raises(ValueError, match="write_depth_reading"):
        Reactor(make_layout(), n_slots=4, io_depth=2, copier=MemcpyCopier, pin=False,
                engine="posix", write_depth_reading=3)
