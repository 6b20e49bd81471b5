"""Admission for the DRAM tier that turns itself on only where it wins (``eviction_policy
= "lru-admit"``).

LRU keeps what was used last. On a loop over more blocks than the tier holds (several
long shared contexts visited round-robin, SCBench-like) that is exactly the block needed
last: every store evicts the next block to be read and the tier serves nothing. A
frequency filter in front of LRU fixes loops (a new block replaces the LRU victim only if
more requests asked for it than for the victim, TinyLFU-style), but it hurts
conversations, where the newest turn's blocks are the ones the next turn reads.

:class:`AdmissionDuel` decides per workload, by measurement: it keeps two shadow caches
of the tier's capacity (keys only, no data), plain LRU and LRU with the filter, runs every
request's block list through both, and keeps a decayed score of the difference of their
prefix hits. The filter is on while the filtered shadow hits more. Frequencies count
requests that asked for a block; they are halved every ``10 x capacity`` blocks asked, so
old popularity fades.

By simulation on the replay workloads (``scripts/sim_dram_policy.py``,
docs/results/cpu/dram-policy-sim.md): SCBench-like loop 0 -> 28 % of chunks from the tier,
LongBench-like 3 -> 22 %, ShareGPT and Bailian-coder unchanged (within 0.5 points).

Contract: one thread (the scheduler thread of vLLM's engine core, through
``PyKVCacheManager``). :meth:`on_request` once per request with its block keys in prefix
order (O(number of keys), no per-key allocation beyond the shadows' and the counter's
entries); :meth:`admit` per block that would evict another (O(1)). Memory: two ordered
dicts of at most ``capacity`` keys and a counter that the halving keeps near the keys
asked in the last ``10 x capacity`` asks.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence

#: the score's decay per request (about the last 50 requests count)
DECAY = 0.98
#: frequencies are halved every RESET_MULT x capacity blocks asked
RESET_MULT = 10


class _Shadow:
    """Keys-only cache of ``capacity`` blocks: LRU, with the frequency filter if
    ``admit`` (tail-first order, as the tier's manager keeps it)."""

    __slots__ = ("cap", "filtered", "freq", "od")

    def __init__(self, capacity: int, filtered: bool, freq: Counter) -> None:
        self.cap = capacity
        self.filtered = filtered
        self.freq = freq
        self.od: OrderedDict[Hashable, None] = OrderedDict()

    def request(self, keys: Sequence[Hashable]) -> int:
        """Serve one request; returns its prefix hits (blocks)."""
        od, n, nk = self.od, 0, len(keys)
        while n < nk and keys[n] in od:
            n += 1
        for i in range(n - 1, -1, -1):
            od.move_to_end(keys[i])
        freq = self.freq
        for i in range(n, nk):
            k = keys[i]
            if k in od:
                continue
            if len(od) >= self.cap:
                victim = next(iter(od))
                if self.filtered and freq[k] <= freq[victim]:
                    continue
                del od[victim]
            od[k] = None
        for i in range(nk - 1, -1, -1):
            k = keys[i]
            if k in od:
                od.move_to_end(k)
        return n


class AdmissionDuel:
    """Decides whether a new DRAM-tier block may evict the LRU victim (see module doc)."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be > 0")
        self.capacity = capacity
        self.freq: Counter = Counter()
        self._asks = 0
        self._reset_every = RESET_MULT * capacity
        self._lru = _Shadow(capacity, False, self.freq)
        self._filtered = _Shadow(capacity, True, self.freq)
        #: > 0: the filtered shadow has been hitting more (decayed block counts)
        self.score = 0.0
        #: whether :meth:`admit` filters now
        self.active = False
        #: requests seen, and how many of them found the filter on
        self.requests = 0
        self.requests_active = 0

    def on_request(self, keys: Sequence[Hashable]) -> None:
        """A request asked for ``keys`` (its block keys in prefix order), once per
        request, before its stores."""
        freq = self.freq
        for k in keys:
            freq[k] += 1
        self._asks += len(keys)
        if self._asks >= self._reset_every:
            self._asks = 0
            for k, v in list(freq.items()):
                if v > 1:
                    freq[k] = v >> 1
                else:
                    del freq[k]
        diff = self._filtered.request(keys) - self._lru.request(keys)
        self.score = self.score * DECAY + diff
        self.active = self.score > 0
        self.requests += 1
        if self.active:
            self.requests_active += 1

    def admit(self, key: Hashable, victim: Hashable) -> bool:
        """Whether ``key`` may take the slot of ``victim`` (the LRU victim)."""
        if not self.active:
            return True
        freq = self.freq
        return freq[key] > freq[victim]
