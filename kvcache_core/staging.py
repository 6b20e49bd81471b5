"""Bounded staging pool: one aligned (page-locked with CUDA) allocation in fixed slots.

Two parts, so that the accounting can live where the decisions are made:

* :class:`SlotAllocator` - pure bookkeeping of ``n_slots`` slots: each slot is FREE,
  BUSY (owned by exactly one task, named by an integer owner id) or CACHED (retained as
  a DRAM-tier copy of one key, optionally pinned by readers). It enforces the foreground
  reservation and the retention policy (:class:`LRUPolicy` / :class:`ARCPolicy`). It is
  NOT thread-safe: exactly one thread (the reactor thread, or vLLM's scheduler thread)
  calls it.
* :class:`StagingPool` - the memory: ONE contiguous ``n_slots * slot_bytes`` allocation,
  4 KiB aligned (anonymous mmap), registered with CUDA as page-locked when CUDA is present.
  Slot views are built once at start (no per-call allocation on the hot path).

Hard bound: the bytes behind BUSY and CACHED slots never exceed ``n_slots * slot_bytes``
because there is no other memory to hand out; :attr:`SlotAllocator.peak_busy` records the
high-water mark that benchmarks report.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections import OrderedDict
from collections.abc import Callable, Hashable
from enum import IntEnum

log = logging.getLogger(__name__)

PAGE = 4096


class SlotState(IntEnum):
    FREE = 0
    BUSY = 1
    CACHED = 2


class Priority(IntEnum):
    """Who asks for a slot. FOREGROUND may use reserved slots; SPECULATIVE may not."""

    FOREGROUND = 0
    SPECULATIVE = 1


class LRUPolicy:
    """Least-recently-used order of retained keys."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._od: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        self._od[key] = None
        self._od.move_to_end(key)

    def hit(self, key: Hashable) -> None:
        self._od.move_to_end(key)

    def refresh(self, key: Hashable) -> None:
        """Most recent, without counting a reuse (here the same as :meth:`hit`)."""
        self._od.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._od.pop(key, None)

    def victim(self, evictable: Callable[[Hashable], bool]) -> Hashable | None:
        for k in self._od:
            if evictable(k):
                return k
        return None

    def evicted(self, key: Hashable) -> None:
        self._od.pop(key, None)

    def __len__(self) -> int:
        return len(self._od)


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo & Modha) over retained keys.

    T1 holds keys seen once, T2 keys seen again; B1/B2 are ghost lists of keys evicted
    from T1/T2 that steer the target size ``p`` of T1.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.p = 0.0
        self.t1: OrderedDict[Hashable, None] = OrderedDict()
        self.t2: OrderedDict[Hashable, None] = OrderedDict()
        self.b1: OrderedDict[Hashable, None] = OrderedDict()
        self.b2: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        c = self.capacity
        if key in self.b1:
            self.p = min(c, self.p + max(len(self.b2) / max(1, len(self.b1)), 1))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / max(1, len(self.b2)), 1))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        while len(self.b1) > c:
            self.b1.popitem(last=False)
        while len(self.b2) > c:
            self.b2.popitem(last=False)

    def hit(self, key: Hashable) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def refresh(self, key: Hashable) -> None:
        """Most recent within its own list, without counting a reuse (a block seen once
        stays in T1)."""
        if key in self.t1:
            self.t1.move_to_end(key)
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def victim(self, evictable: Callable[[Hashable], bool]) -> Hashable | None:
        first, second = ((self.t1, self.t2) if self.t1 and (len(self.t1) > self.p or not self.t2)
                         else (self.t2, self.t1))
        for lst in (first, second):
            for k in lst:
                if evictable(k):
                    return k
        return None

    def evicted(self, key: Hashable) -> None:
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            self.b2[key] = None

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)


def make_policy(name: str, capacity: int) -> LRUPolicy | ARCPolicy:
    if name == "lru":
        return LRUPolicy(capacity)
    if name == "arc":
        return ARCPolicy(capacity)
    raise ValueError(f"unknown eviction policy {name!r} (lru or arc)")


class SlotAllocator:
    """Slot states, owners, foreground reservation and DRAM retention.

    Single-threaded by contract (see module docstring).

    ``reserve_foreground`` slots can only go to FOREGROUND requests: a SPECULATIVE
    acquire succeeds only while more than that many slots are free or reclaimable.
    ``retain`` enables the DRAM tier: a released slot may keep its bytes under a key; a
    FOREGROUND (or, above the reservation, SPECULATIVE) acquire reclaims the policy's
    victim among retained slots that no reader has pinned.
    """

    def __init__(self, n_slots: int, *, reserve_foreground: int = 0, retain: bool = False,
                 policy: str = "lru") -> None:
        if n_slots <= 0:
            raise ValueError("n_slots must be > 0")
        if reserve_foreground >= n_slots:
            raise ValueError("reserve_foreground must be smaller than n_slots")
        self.n_slots = n_slots
        self.reserve_foreground = reserve_foreground
        self.retain = retain
        self.state = [SlotState.FREE] * n_slots
        self.owner = [-1] * n_slots
        self.slot_key: list[Hashable | None] = [None] * n_slots
        self.pins = [0] * n_slots
        self._free = list(range(n_slots - 1, -1, -1))  # stack; pop() gives slot 0 first
        self.index: dict[Hashable, int] = {}
        self.policy = make_policy(policy, n_slots)
        self.busy = 0
        #: CACHED slots with at least one pin (readers): not reclaimable until unpinned
        self.pinned = 0
        self.peak_busy = 0
        self.reclaimed = 0
        self.refused_speculative = 0

    # -- queries --------------------------------------------------------------------
    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def cached(self) -> int:
        return len(self.index)

    @property
    def acquirable(self) -> int:
        """Slots a FOREGROUND :meth:`acquire` could get now, one after another (free or
        cached and unpinned); O(1)."""
        return self.n_slots - self.busy - self.pinned

    def _unpinned_cached(self, key: Hashable) -> bool:
        return self.pins[self.index[key]] == 0

    def available(self, prio: Priority = Priority.FOREGROUND) -> bool:
        """Whether :meth:`acquire` with ``prio`` would succeed now (no side effects)."""
        if prio == Priority.FOREGROUND:
            return bool(self._free) or self.policy.victim(self._unpinned_cached) is not None
        reclaimable = sum(1 for s in self.index.values() if self.pins[s] == 0)
        return len(self._free) + reclaimable > self.reserve_foreground

    # -- ownership ------------------------------------------------------------------
    def next_victim(self) -> Hashable | None:
        """The key a FOREGROUND :meth:`acquire` would reclaim now, None if a slot is free
        (or none can be reclaimed). No side effects."""
        if self._free:
            return None
        return self.policy.victim(self._unpinned_cached)

    def acquire(self, owner: int, prio: Priority = Priority.FOREGROUND,
                evictable: Callable[[Hashable], bool] | None = None) -> int:
        """Give a slot to ``owner`` (state BUSY). Returns the slot index or -1.

        The caller owns the slot until :meth:`release`; nobody else may touch its bytes.
        ``evictable(key)`` (optional) narrows which cached slots may be reclaimed when none
        is free; it is only asked about unpinned cached keys.
        """
        if prio == Priority.SPECULATIVE and not self.available(prio):
            self.refused_speculative += 1
            return -1
        if self._free:
            slot = self._free.pop()
        else:
            pred = self._unpinned_cached
            if evictable is not None:
                def pred(k: Hashable) -> bool:
                    return self._unpinned_cached(k) and evictable(k)
            key = self.policy.victim(pred)
            if key is None:
                return -1
            slot = self.index.pop(key)
            self.policy.evicted(key)
            self.slot_key[slot] = None
            self.reclaimed += 1
        self.state[slot] = SlotState.BUSY
        self.owner[slot] = owner
        self.busy += 1
        if self.busy > self.peak_busy:
            self.peak_busy = self.busy
        return slot

    def release(self, slot: int, retain_key: Hashable | None = None,
                force: bool = False) -> None:
        """Return a BUSY slot. With ``retain_key`` (and retention on, or ``force`` for a
        staged preload) keep it as CACHED; it stays reclaimable by FOREGROUND acquires.

        If ``retain_key`` is already cached in another slot, this slot is simply freed.
        """
        if self.state[slot] != SlotState.BUSY:
            raise RuntimeError(f"release of slot {slot} in state {self.state[slot].name}")
        self.busy -= 1
        self.owner[slot] = -1
        if retain_key is not None and (self.retain or force) and retain_key not in self.index:
            self.state[slot] = SlotState.CACHED
            self.slot_key[slot] = retain_key
            self.index[retain_key] = slot
            self.policy.insert(retain_key)
        else:
            self.state[slot] = SlotState.FREE
            self._free.append(slot)

    # -- DRAM tier ------------------------------------------------------------------
    def lookup(self, key: Hashable) -> int:
        """Slot holding ``key`` (CACHED) or -1. Does not pin or touch."""
        return self.index.get(key, -1)

    def pin(self, key: Hashable, touch: bool = True) -> int:
        """Pin the cached slot of ``key`` (no reclaim until :meth:`unpin`). ``touch``:
        count it as a use for the replacement policy (a reader); False for a pin that is
        not a use (e.g. a disk write still reading the slot)."""
        slot = self.index.get(key, -1)
        if slot >= 0:
            if not self.pins[slot]:
                self.pinned += 1
            self.pins[slot] += 1
            if touch:
                self.policy.hit(key)
        return slot

    def unpin(self, slot: int) -> None:
        if self.pins[slot] <= 0:
            raise RuntimeError(f"unpin of slot {slot} that is not pinned")
        self.pins[slot] -= 1
        if not self.pins[slot]:
            self.pinned -= 1

    def drop(self, key: Hashable) -> bool:
        """Forget a cached key (its slot becomes FREE unless pinned). Returns True if freed."""
        slot = self.index.get(key, -1)
        if slot < 0 or self.pins[slot]:
            return False
        del self.index[key]
        self.policy.remove(key)
        self.slot_key[slot] = None
        self.state[slot] = SlotState.FREE
        self._free.append(slot)
        return True

    def check(self) -> None:
        """Verify every invariant (tests): raise AssertionError on the first violation."""
        n_free = sum(1 for s in self.state if s == SlotState.FREE)
        n_busy = sum(1 for s in self.state if s == SlotState.BUSY)
        n_cached = sum(1 for s in self.state if s == SlotState.CACHED)
        assert n_free + n_busy + n_cached == self.n_slots
        assert n_free == len(self._free) == len(set(self._free))
        assert n_busy == self.busy <= self.peak_busy <= self.n_slots
        assert n_cached == len(self.index) == len(self.policy)
        for k, s in self.index.items():
            assert self.state[s] == SlotState.CACHED and self.slot_key[s] == k
        for s in self._free:
            assert self.state[s] == SlotState.FREE and self.pins[s] == 0
        for s in range(self.n_slots):
            assert (self.owner[s] >= 0) == (self.state[s] == SlotState.BUSY)
            assert self.pins[s] == 0 or self.state[s] == SlotState.CACHED
        assert self.pinned == sum(1 for p in self.pins if p)


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class StagingPool:
    """The memory behind a :class:`SlotAllocator`: one allocation, fixed slots.

    ``pin``: ``"auto"`` registers the allocation with CUDA when CUDA is available
    (page-locked, so host<->device copies are DMA), ``True`` requires it, ``False`` never.
    ``views[i]`` is a memoryview of slot ``i``; ``tensor(i)`` a torch uint8 view (lazy,
    built once). Both alias the same bytes; their owner is whoever owns the slot in the
    allocator. :meth:`copy_slot` copies between slots without holding the GIL.
    """

    def __init__(self, n_slots: int, slot_bytes: int, pin: bool | str = "auto") -> None:
        if slot_bytes <= 0 or slot_bytes % PAGE:
            raise ValueError(f"slot_bytes must be a positive multiple of {PAGE}")
        self.n_slots = n_slots
        self.slot_bytes = slot_bytes
        self.nbytes = n_slots * slot_bytes
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self._mm = mmap.mmap(-1, self.nbytes, flags=flags)
        self._mv = memoryview(self._mm)
        self.views = [self._mv[i * slot_bytes:(i + 1) * slot_bytes] for i in range(n_slots)]
        # the allocation's address, for copy_slot (the ctypes object holds an export of
        # the mapping, like the views, until close)
        self._anchor: ctypes.Array | None = (ctypes.c_char * self.nbytes).from_buffer(self._mm)
        self.base_addr = ctypes.addressof(self._anchor)
        self.pinned = False
        self._torch = None
        self._slot_tensors: list | None = None
        want = cuda_available() if pin == "auto" else bool(pin)
        if want:
            self._register_cuda()

    def _register_cuda(self) -> None:
        import torch

        t = self.as_tensor()
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), self.nbytes, 0)
        if int(rc) != 0:
            raise RuntimeError(f"cudaHostRegister of the staging pool failed ({rc})")
        self.pinned = True

    def copy_slot(self, dst: int, src: int, nbytes: int) -> None:
        """Copy the first ``nbytes`` of slot ``src`` over slot ``dst``, with the GIL released
        for the copy (``ctypes.memmove``). A memoryview slice assignment holds the GIL for
        the whole memcpy: one 28 MiB block is about 5 ms during which vLLM's engine thread
        cannot run Python (``docs/results/cpu/claim-copy-gil.md``). The caller owns both
        slots (nobody else reads or writes them meanwhile); ``dst != src``. Any thread.
        Raises ValueError on a slot or size out of range (nothing is copied)."""
        sb = self.slot_bytes
        if not (0 <= dst < self.n_slots and 0 <= src < self.n_slots and dst != src
                and 0 <= nbytes <= sb) or self._anchor is None:
            raise ValueError(f"copy_slot({dst}, {src}, {nbytes}): slots must be distinct "
                             f"in [0, {self.n_slots}), size in [0, {sb}], pool open")
        ctypes.memmove(self.base_addr + dst * sb, self.base_addr + src * sb, nbytes)

    def as_tensor(self):
        """The whole pool as a torch uint8 tensor (built once, aliases the pool)."""
        if self._torch is None:
            import torch

            self._torch = torch.frombuffer(self._mm, dtype=torch.uint8)
        return self._torch

    def tensor(self, slot: int):
        if self._slot_tensors is None:
            t = self.as_tensor()
            sb = self.slot_bytes
            self._slot_tensors = [t[i * sb:(i + 1) * sb] for i in range(self.n_slots)]
        return self._slot_tensors[slot]

    def close(self) -> None:
        if self.pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.as_tensor().data_ptr())
            self.pinned = False
        self._slot_tensors = None
        self._torch = None
        self.views = []
        self._anchor = None
        self.base_addr = 0
        self._mv.release()
        try:
            self._mm.close()
        except BufferError:
            log.debug("staging pool still referenced at close; left to the GC")
