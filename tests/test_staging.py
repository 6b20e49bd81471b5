"""Staging: SlotAllocator (model-checked with hypothesis), LRU/ARC retention, StagingPool."""

from __future__ import annotations

import ctypes
from collections import OrderedDict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvcache_core.staging import (
    PAGE,
    ARCPolicy,
    LRUPolicy,
    Priority,
    SlotAllocator,
    SlotState,
    StagingPool,
    cuda_available,
    make_policy,
)

KEYS = [f"k{i}" for i in range(4)]  # few keys: pins and drops hit cached ones
FREE, BUSY, CACHED = SlotState.FREE, SlotState.BUSY, SlotState.CACHED


class AllocatorMachine(RuleBasedStateMachine):
    """Random acquire/release/pin/unpin/drop/lookup against a reference model.

    The model tracks every slot's state, key, pins and (for LRU) the exact recency
    order, so that each returned slot and each reclaimed victim is checked, not only
    the allocator's own ``check()``.
    """

    POLICY = "lru"

    @initialize(data=st.data(), n=st.integers(1, 8), retain=st.booleans())
    def setup(self, data, n, retain):
        reserve = data.draw(st.integers(0, n - 1), label="reserve_foreground")
        self.alloc = SlotAllocator(n, reserve_foreground=reserve, retain=retain,
                                   policy=self.POLICY)
        self.n = n
        self.reserve = reserve
        self.retain = retain
        self.state = [FREE] * n
        self.key: list[str | None] = [None] * n
        self.pins = [0] * n
        self.recency: OrderedDict[str, None] = OrderedDict()  # LRU order of cached keys
        self.next_owner = 0
        self.refused = 0

    # -- helpers ------------------------------------------------------------------
    def _slots(self, state):
        return [s for s in range(self.n) if self.state[s] == state]

    def _index(self):
        return {self.key[s]: s for s in self._slots(CACHED)}

    def _reclaimable(self):
        return [s for s in self._slots(CACHED) if self.pins[s] == 0]

    # -- rules --------------------------------------------------------------------
    @rule(prio=st.sampled_from([Priority.FOREGROUND, Priority.SPECULATIVE]))
    def acquire(self, prio):
        free = self._slots(FREE)
        reclaimable = self._reclaimable()
        owner = self.next_owner
        self.next_owner += 1
        slot = self.alloc.acquire(owner, prio)
        if prio == Priority.SPECULATIVE and len(free) + len(reclaimable) <= self.reserve:
            assert slot == -1, "speculative acquire ate into the foreground reservation"
            self.refused += 1
            assert self.alloc.refused_speculative == self.refused
            return
        if not free and not reclaimable:
            assert slot == -1
            return
        assert slot >= 0
        if free:
            assert slot in free, "a free slot exists but a cached one was reclaimed"
        else:
            assert slot in reclaimable, f"reclaimed slot {slot} is pinned or not cached"
            victim = self.key[slot]
            if self.POLICY == "lru":
                expect = next(k for k in self.recency if self.pins[self._index()[k]] == 0)
                assert victim == expect, "LRU reclaimed a key that is not the oldest"
            self.recency.pop(victim)
            assert self.alloc.lookup(victim) == -1
        self.state[slot] = BUSY
        self.key[slot] = None
        assert self.alloc.owner[slot] == owner
        if prio == Priority.SPECULATIVE:
            after = len(self._slots(FREE)) + len(self._reclaimable())
            assert after >= self.reserve

    @precondition(lambda self: any(s == BUSY for s in self.state))
    @rule(i=st.integers(0, 63), key=st.none() | st.sampled_from(KEYS))
    def release(self, i, key):
        busy = self._slots(BUSY)
        slot = busy[i % len(busy)]
        self.alloc.release(slot, key)
        if key is not None and self.retain and key not in self._index():
            self.state[slot] = CACHED
            self.key[slot] = key
            self.recency[key] = None
            self.recency.move_to_end(key)
        else:
            self.state[slot] = FREE

    @rule(i=st.integers(0, 63))
    def release_not_busy_raises(self, i):
        slot = i % self.n
        if self.state[slot] != BUSY:
            with pytest.raises(RuntimeError):
                self.alloc.release(slot)

    @rule(key=st.sampled_from(KEYS))
    def pin(self, key):
        idx = self._index()
        slot = self.alloc.pin(key)
        assert slot == idx.get(key, -1)
        if slot >= 0:
            self.pins[slot] += 1
            self.recency.move_to_end(key)

    @precondition(lambda self: any(p > 0 for p in self.pins))
    @rule(i=st.integers(0, 63))
    def unpin(self, i):
        pinned = [s for s in range(self.n) if self.pins[s] > 0]
        slot = pinned[i % len(pinned)]
        self.alloc.unpin(slot)
        self.pins[slot] -= 1

    @rule(i=st.integers(0, 63))
    def unpin_not_pinned_raises(self, i):
        slot = i % self.n
        if self.pins[slot] == 0:
            with pytest.raises(RuntimeError):
                self.alloc.unpin(slot)

    @rule(key=st.sampled_from(KEYS))
    def drop(self, key):
        slot = self._index().get(key, -1)
        freed = self.alloc.drop(key)
        if slot < 0 or self.pins[slot]:
            assert freed is False
            return
        assert freed is True
        self.state[slot] = FREE
        self.key[slot] = None
        self.recency.pop(key)

    @rule(key=st.sampled_from(KEYS))
    def lookup(self, key):
        assert self.alloc.lookup(key) == self._index().get(key, -1)

    @rule(prio=st.sampled_from([Priority.FOREGROUND, Priority.SPECULATIVE]))
    def available(self, prio):
        free = len(self._slots(FREE))
        rec = len(self._reclaimable())
        expect = free + rec > 0 if prio == Priority.FOREGROUND else free + rec > self.reserve
        assert self.alloc.available(prio) == expect

    # -- invariants ---------------------------------------------------------------
    @invariant()
    def consistent(self):
        if not hasattr(self, "alloc"):
            return
        a = self.alloc
        a.check()
        assert a.busy + a.cached <= a.n_slots
        assert list(a.state) == self.state
        assert a.busy == len(self._slots(BUSY))
        assert a.free == len(self._slots(FREE))
        assert a.pins == self.pins
        for s in range(self.n):
            if self.pins[s]:  # pinned slots are never reclaimed or dropped
                assert a.state[s] == CACHED and a.slot_key[s] == self.key[s]
        assert dict(a.index) == self._index()
        if not self.retain:
            assert a.cached == 0
        pol = a.policy
        if isinstance(pol, ARCPolicy):
            assert set(pol.t1) | set(pol.t2) == set(a.index)
            assert not set(pol.t1) & set(pol.t2)
            # ghost lists stay bounded (trimmed to c on insert; evictions in between
            # can add at most one entry per cached key)
            assert len(pol.b1) <= 2 * pol.capacity and len(pol.b2) <= 2 * pol.capacity
            assert 0 <= pol.p <= pol.capacity
        else:
            assert list(pol._od) == list(self.recency)


class AllocatorMachineLRU(AllocatorMachine):
    POLICY = "lru"


class AllocatorMachineARC(AllocatorMachine):
    POLICY = "arc"


_stateful = settings(max_examples=200, stateful_step_count=60, deadline=None)
TestAllocatorLRU = _stateful(AllocatorMachineLRU).TestCase
TestAllocatorARC = _stateful(AllocatorMachineARC).TestCase


# --------------------------------------------------------------------------- units


def test_allocator_arguments():
    with pytest.raises(ValueError):
        SlotAllocator(0)
    with pytest.raises(ValueError):
        SlotAllocator(4, reserve_foreground=4)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("fifo", 4)


def test_speculative_reservation_and_pins():
    a = SlotAllocator(4, reserve_foreground=2, retain=True)
    s0 = a.acquire(1, Priority.SPECULATIVE)
    s1 = a.acquire(2, Priority.SPECULATIVE)
    assert s0 >= 0 and s1 >= 0
    assert a.acquire(3, Priority.SPECULATIVE) == -1  # only the reserved 2 are left
    assert a.refused_speculative == 1
    f0 = a.acquire(4, Priority.FOREGROUND)
    f1 = a.acquire(5, Priority.FOREGROUND)
    assert f0 >= 0 and f1 >= 0
    assert a.acquire(6, Priority.FOREGROUND) == -1
    for s, k in ((s0, "a"), (s1, "b"), (f0, "c"), (f1, "d")):
        a.release(s, k)
    assert a.cached == 4 and a.free == 0
    for k in "abcd":
        a.pin(k)
    assert a.acquire(7, Priority.FOREGROUND) == -1  # everything pinned
    a.unpin(a.lookup("c"))
    assert a.acquire(8, Priority.SPECULATIVE) == -1  # 1 reclaimable <= reservation 2
    got = a.acquire(9, Priority.FOREGROUND)
    assert got == f0 and a.lookup("c") == -1 and a.reclaimed == 1
    a.check()
    assert a.peak_busy == 4


def _scan_survivors(policy: str) -> set[str]:
    """4 slots; two hot keys are read twice, then a scan of 12 one-time keys runs."""
    a = SlotAllocator(4, retain=True, policy=policy)
    for k in ("hot1", "hot2"):
        a.release(a.acquire(0), k)
    for k in ("hot1", "hot2"):  # second access: a DRAM-tier hit
        a.unpin(a.pin(k))
    for i in range(12):
        s = a.acquire(1)
        assert s >= 0
        a.release(s, f"scan{i}")
        a.check()
    return {k for k in ("hot1", "hot2") if a.lookup(k) >= 0}


def test_arc_keeps_frequent_keys_through_a_scan_lru_does_not():
    assert _scan_survivors("arc") == {"hot1", "hot2"}
    assert _scan_survivors("lru") == set()


def test_arc_ghost_hit_promotes_to_t2():
    p = ARCPolicy(2)
    p.insert("a")
    p.insert("b")
    v = p.victim(lambda k: True)
    assert v == "a"
    p.evicted(v)
    assert "a" in p.b1 and len(p) == 1
    p.insert("a")  # seen again after eviction: frequency list, p grows
    assert "a" in p.t2 and "a" not in p.b1 and p.p >= 1


def test_lru_policy_order():
    p = LRUPolicy(3)
    for k in "abc":
        p.insert(k)
    p.hit("a")
    assert p.victim(lambda k: True) == "b"
    assert p.victim(lambda k: k != "b") == "c"
    p.remove("b")
    assert len(p) == 2


# --------------------------------------------------------------------------- pool


def _addr(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


@pytest.mark.parametrize("slot_bytes", [PAGE, 3 * PAGE, 17 * PAGE])
def test_staging_pool_alignment_and_aliasing(slot_bytes):
    pool = StagingPool(5, slot_bytes, pin=False)
    try:
        assert not pool.pinned
        assert pool.nbytes == 5 * slot_bytes
        assert len(pool.views) == 5
        base = _addr(pool.views[0])
        assert base % PAGE == 0
        for i, v in enumerate(pool.views):
            assert len(v) == slot_bytes
            assert _addr(v) % PAGE == 0
            assert _addr(v) == base + i * slot_bytes  # one contiguous allocation
        t = pool.as_tensor()
        assert t.data_ptr() == base and t.numel() == pool.nbytes
        for i in range(5):
            ti = pool.tensor(i)
            assert ti.data_ptr() == base + i * slot_bytes
            assert ti.data_ptr() % PAGE == 0
            pool.views[i][:4] = bytes([i, 1, 2, 3])
            assert ti[:4].tolist() == [i, 1, 2, 3]  # tensor and view alias the bytes
            ti[-1] = 200 + i
            assert pool.views[i][-1] == 200 + i
        assert pool.tensor(2) is pool.tensor(2)  # built once
    finally:
        pool.close()


def test_staging_pool_pins_only_with_cuda():
    pool = StagingPool(2, PAGE)  # pin="auto"
    try:
        assert pool.pinned == cuda_available()
    finally:
        pool.close()
    if not cuda_available():
        with pytest.raises(Exception):  # noqa: B017 - torch/CUDA raise various types
            StagingPool(2, PAGE, pin=True)


def test_staging_pool_rejects_unaligned_slots():
    with pytest.raises(ValueError):
        StagingPool(2, PAGE + 1, pin=False)
    with pytest.raises(ValueError):
        StagingPool(2, 0, pin=False)


def test_copy_slot_copies_and_refuses_bad_arguments():
    """``copy_slot`` copies exactly ``nbytes`` from one slot to another and refuses a slot
    or a size out of range (and the same slot twice) without touching any byte."""
    pool = StagingPool(3, 2 * PAGE, pin=False)
    try:
        pool.views[0][:] = bytes(range(256)) * (2 * PAGE // 256)
        pool.views[1][:] = b"\xee" * (2 * PAGE)
        pool.copy_slot(1, 0, PAGE + 5)
        assert bytes(pool.views[1][:PAGE + 5]) == bytes(pool.views[0][:PAGE + 5])
        assert bytes(pool.views[1][PAGE + 5:]) == b"\xee" * (PAGE - 5)
        before = [bytes(v) for v in pool.views]
        for dst, src, n in ((3, 0, 1), (1, -1, 1), (1, 1, 1), (2, 0, 2 * PAGE + 1),
                            (2, 0, -1)):
            with pytest.raises(ValueError, match="copy_slot"):
                pool.copy_slot(dst, src, n)
        assert [bytes(v) for v in pool.views] == before
    finally:
        pool.close()
    with pytest.raises(ValueError, match="pool open"):
        pool.copy_slot(1, 0, 1)


def test_copy_slot_releases_the_gil_during_the_copy():
    """The reactor thread's slot-to-slot copy (a promotion claiming a staged preload)
    must let another thread (vLLM's engine loop) run Python meanwhile. Checked by
    timestamps, not speed: the main thread records perf_counter() in a loop while a
    second thread copies 64 MiB slots; with ``copy_slot`` some of those stamps fall
    strictly inside a copy. The same check on a memoryview slice assignment (what the
    reactor did before) finds none: the GIL is held for the whole memcpy there, so the
    check can tell the two apart."""
    import sys
    import threading
    import time

    size = 64 << 20
    pool = StagingPool(2, size, pin=False)
    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    try:
        pool.views[0][:PAGE] = b"\x5a" * PAGE

        def inside(copy) -> int:
            spans: list[tuple[float, float]] = []
            done = threading.Event()

            def copier() -> None:
                try:
                    for _ in range(6):
                        t0 = time.perf_counter()
                        copy()
                        spans.append((t0, time.perf_counter()))
                finally:
                    done.set()

            stamps: list[float] = []
            th = threading.Thread(target=copier)
            th.start()
            while not done.is_set():
                stamps.append(time.perf_counter())
            th.join()
            return sum(1 for s in stamps for a, b in spans if a < s < b)

        def by_view() -> None:
            pool.views[1][:] = pool.views[0]

        assert inside(by_view) == 0
        assert inside(lambda: pool.copy_slot(1, 0, size)) > 0
        assert bytes(pool.views[1][:PAGE]) == b"\x5a" * PAGE
    finally:
        sys.setswitchinterval(saved)
        pool.close()
