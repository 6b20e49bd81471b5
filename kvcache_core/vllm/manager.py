"""Scheduler side: :class:`PyKVCacheManager` (vLLM's ``OffloadingManager``).

Runs in vLLM's scheduler (EngineCore) process, called by ONE thread (the scheduler's),
so it needs no locks. It owns:

* the DRAM-tier index: a :class:`~kvcache_core.staging.SlotAllocator` over the
  ``n_dram`` caller-owned ("external") slots that every worker's reactor pool appends
  after its staging slots (slot ``i`` here = pool slot ``n_staging + i`` there, same
  number on every rank). The scheduler decides which key lives in which slot; the
  workers only move bytes where the specs say.
* the disk tier is the shared directory itself: a key is on disk iff every rank's file
  exists (one ``access`` per rank, no open, no in-memory index to go stale across
  processes or restarts).

Slot ownership: a slot handed out by :meth:`prepare_store` / :meth:`prepare_load` (BUSY)
belongs to that job until vLLM calls :meth:`complete_store` / :meth:`complete_load`; then
it is retained as CACHED (valid bytes for its key) or freed. A CACHED slot is pinned
while a DRAM-hit load reads it. Keys whose store is in flight are a MISS. A disk
block that another request is reading into a DRAM-tier slot right now is HIT_PENDING:
vLLM retries the lookup next step and then finds it in DRAM, so concurrent requests for
one block cause one disk read.

Write-back: a stored chunk with a DRAM-tier slot is copied there and written to disk
from there in the background (the store job completes once copied). Its slot is kept
CACHED and pinned from :meth:`complete_store` until every worker reported the write ended
(``written`` in :meth:`on_worker_report`, which may also come first), so the slot is
never reclaimed for another key while its file is still being written from it. When
every slot is pinned that way, new stores get no slot and go through the workers'
staging pools, where they are dropped if none is free (counted, never waited for).
Stores may hold at most ``writeback_max_fraction`` of the tier that way (storing or
pinned; ``"auto"``: :data:`WB_FRACTION_READING` of it while a disk load is in flight,
when the reactor holds new writes behind the reads, or requests wait in the patched
scheduler's queue or did less than :data:`WB_BUSY_HOLD_S` ago, else
:data:`WB_FRACTION_IDLE`):
beyond it a new store still fills a DRAM-tier slot but writes no file
(``dram_only``, counted), so a disk that falls behind (e.g. busy with reads) costs new
blocks their file, never the promotions of disk hits that other requests wait for: the
slot is not pinned and can be reclaimed like any cached block. With ``writeback_flush``
such blocks get their files later, oldest first, whenever the write-back has room again
(:meth:`take_flush_plan`, sent to the workers with a step's metadata); one evicted first
is lost to the cache (``dram_only_evicted``).

Disk admission (``disk_admission="reuse"``): a block gets its file only once it has
shown a reuse. Its first store fills a DRAM-tier slot without a file (``dram_only``,
counted ``stores_disk_deferred``); a DRAM hit on it (a second request read it) queues
its file for the write-back (``_hot``, written from the slot by :meth:`take_flush_plan`
whatever ``writeback_flush`` says); a block stored again after it left the tier (its key
is in the store doorkeeper: two generations of hashed keys, ``SEEN_GENERATION`` each)
is written at once. Without a DRAM-tier slot a first store is not stored at all
(``stores_disk_not_admitted``). ``"all"`` (default) writes every stored block.

Replacement: a block read from disk into the tier (promotion) counts as a reuse (with
``eviction_policy=arc`` it enters the frequency list), a block that was only stored does
not, so a burst of new, never-read stores evicts other stores first. A request's blocks
are ordered tail first (its last block the least recent, as vLLM frees GPU blocks): a hit
must be a prefix, so the tail is worth least. :meth:`touch` (vLLM passes the request's
whole key list, at lookup and at every store job) walks it backwards, and a store job's
completion re-walks the request's last touched list, so blocks stored after the last
touch do not end up more recent than the request's head.

Failed loads (a missing or corrupt file, an invalid DRAM slot) are reported by the
workers through :class:`~kvcache_core.vllm.metadata.PyKVCacheWorkerMetadata` and
arrive in :meth:`on_worker_report` BEFORE the job's :meth:`complete_load`, so a promotion
that failed is never retained.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    make_offload_key,
)

from ..admission import AdmissionDuel
from ..breakeven import GATE_TIERS
from ..flags import AFTER_LOAD, IN_SLOT
from ..layout import LayoutIndex, Namespace
from ..staging import SlotAllocator
from ..warm import DirWarmer
from . import compat
from .job_specs import PyKVLoadSpec, PyKVStoreSpec

if TYPE_CHECKING:  # pragma: no cover
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

log = logging.getLogger("vllm.pykvcache")

#: Counters kept by the manager (cumulative; ``get_stats`` reports deltas).
MANAGER_COUNTERS: dict[str, str] = {
    "lookups": "Offload lookups (one per chunk key).",
    "lookup_requests": "Request lookups (vLLM asks once per waiting request per engine "
    "step until it is admitted).",
    "lookup_us": "Microseconds the scheduler thread spent in request lookups (vLLM's and "
    "the connector's work, file existence checks included).",
    "lookup_max_us": "The longest single request lookup, in microseconds (a maximum, not "
    "a sum): seconds here mean the engine's main thread was held in a lookup.",
    "disk_checks": "File existence checks on the scheduler thread (one access() per rank "
    "per key: lookups, store planning, preload planning, the write-back), not counting "
    "answers from the positive lookup cache.",
    "disk_check_us": "Microseconds the scheduler thread spent in those checks.",
    "disk_check_max_us": "The longest single check, in microseconds (a maximum, not a "
    "sum): tens of milliseconds mean the filesystem's metadata was read from a busy "
    "disk (dentries not cached, e.g. after a restart or drop_caches) while the engine's "
    "main thread waited.",
    "lookups_skipped": "Request lookups answered 'not yet' without a scan: the request's "
    "last lookup waited on a block being read into the DRAM tier (HIT_PENDING) and no "
    "disk load has ended since (thirty-seventh session: the repeated scans of waiting "
    "requests held the engine's main thread 10-18 s of a 31-55 s run).",
    "lookups_yielded": "Request lookups answered 'not yet' because another request's "
    "load was done while vLLM still kept it parked (WAITING_FOR_REMOTE_KVS) behind this "
    "one: vLLM 0.26's waiting loop stops at a request it cannot allocate, so without "
    "the deferral an earlier request that lost its blocks to the loaded one would hold "
    "it forever.",
    "lookups_retry": "disk_lookup_async: lookups answered RETRY while their block's files "
    "were checked on the background thread (vLLM asks again next step).",
    "warm_files": "disk_warm_start: files whose metadata the start-up warm-up read "
    "(set once, when it ends).",
    "warm_dirs": "disk_warm_start: directories the start-up warm-up listed.",
    "warm_errors": "disk_warm_start: directories the start-up warm-up could not read "
    "(skipped).",
    "warm_us": "disk_warm_start: microseconds the start-up warm-up took (a background "
    "thread's time, not the engine's).",
    "hits_dram": "Lookups served by the DRAM tier.",
    "hits_disk": "Lookups served by the disk tier.",
    "misses": "Lookups that missed (including keys whose store is in flight).",
    "hits_pending": "Lookups of a disk block that another request is reading into the DRAM "
    "tier right now: HIT_PENDING, so the request waits for that read instead of reading "
    "the file again (one disk read per block in use).",
    "hits_promoting": "join_promotions: lookups of a disk block that another request is "
    "reading into the DRAM tier right now, answered HIT: the load copies from that slot "
    "once the read is done (one disk read, no wait in vLLM's queue).",
    "loads_join_promotion": "join_promotions: chunks loaded from a DRAM-tier slot that "
    "another request's promotion was filling (counted in loads_disk too).",
    "loads_dram": "Chunks loaded from the DRAM tier.",
    "loads_disk": "Chunks loaded from disk (promotions included).",
    "promotions": "Disk chunks loaded into a DRAM-tier slot (kept there on success).",
    "loads_sync": "dram_load_sync: load jobs served synchronously (every chunk in the DRAM "
    "tier; the request computed in the same engine step).",
    "stores": "Chunks stored (written through to disk).",
    "stores_dram": "Stored chunks that also went into a DRAM-tier slot.",
    "stores_no_dram_slot": "Chunks stored without a DRAM-tier slot because every slot was "
    "busy or pinned by a pending disk write (write-back back-pressure).",
    "stores_writeback_full": "Chunks kept in the DRAM tier without a file because "
    "writeback_max_fraction of the tier already waits for disk writes (the disk is "
    "behind): their files are written later from the DRAM tier (stores_flushed) when the "
    "write-back has room again, unless they are evicted first (dram_only_evicted). Never "
    "waited for.",
    "flushes_planned": "Chunks kept in the DRAM tier without a file that the scheduler "
    "sent to the workers for a deferred write-back (the write-back had room again).",
    "dram_only_evicted": "Chunks evicted from the DRAM tier while no file of them existed "
    "(write-back was full until then): a later request recomputes them.",
    "stores_skipped": "Chunks not stored because they are already cached or in flight.",
    "stores_disk_deferred": "disk_admission=reuse: first stores of a block kept in the "
    "DRAM tier without a file; the file is written once a request reads the block from "
    "the tier (flushes_reused) or stores it again after it left the tier.",
    "stores_disk_not_admitted": "disk_admission=reuse: first stores of a block with no "
    "DRAM-tier slot (tier off or busy): not stored; a second store of it writes the file.",
    "flushes_reused": "disk_admission=reuse: DRAM-tier blocks without a file that a DRAM "
    "hit proved reused, sent to the workers for their file (part of flushes_planned).",
    "stores_skipped_gate": "Chunks not stored because the break-even table says disk loads "
    "never pay off on this node and the DRAM tier had no slot (disk writes off).",
    "stores_dram_only_short": "Chunks kept in the DRAM tier only (no file) because their "
    "request's prompt is shorter than disk_min_prefix_tokens.",
    "stores_skipped_below_floor": "Chunks not stored because their request's prompt is "
    "shorter than min_store_prefix_tokens (a hit on them would be recomputed by the gate).",
    "stores_skipped_short": "Chunks not stored at all because their request's prompt is "
    "shorter than disk_min_prefix_tokens and the DRAM tier had no slot (or is off).",
    "restores_planned": "Chunks whose load failed (missing or corrupt file, invalid DRAM "
    "slot) that their own request re-stores once it has recomputed them (self-healing).",
    "dram_evictions": "DRAM-tier slots reclaimed from another key.",
    "stores_not_admitted": "eviction_policy=lru-admit: new blocks kept out of a full DRAM "
    "tier because more requests asked for the block they would evict (a loop over more "
    "than the tier holds); with disk writes on they still get their file.",
    "load_failures": "Chunk loads that failed (missing/corrupt file or invalid DRAM "
    "slot); vLLM recomputed them.",
    "preloads_planned": "Disk blocks of waiting requests sent to the workers for preload.",
    "lookups_cached": "Disk lookups answered by the positive lookup cache "
    "(disk_lookup_cache_s) without touching the filesystem.",
    "hits_staged": "Lookups of disk blocks that every worker reported staged by a preload "
    "(queue-aware preload: gated as DRAM-tier blocks; not counted in hits_disk).",
    "preloads_skipped_queue": "Waiting requests whose short disk prefix was not preloaded "
    "because their expected queueing time would not cover the read (queue-aware preload).",
    "dram_protected": "DRAM-tier blocks of waiting requests moved behind every other block "
    "in eviction order, summed over steps (preload_protect).",
    "dram_queue_refused": "Stores and promotions that took no DRAM slot because its victim "
    "is read by a waiting request in view before the new block (preload_protect).",
    "loads_held": "Waiting requests that waited for another request's disk load before "
    "starting their own (disk_load_hold_s; each request counted once per wait).",
    "loads_hold_joined": "disk_load_hold_s: requests that did not wait because every "
    "chunk they needed from disk was being read for another request right now (they "
    "join those reads instead of reading the blocks again after them).",
    "loads_hold_expired": "Such waits that reached disk_load_hold_s: the request then "
    "loaded from disk beside the other load.",
}
#: Gauges of the scheduler side (current values, sent with every stats report that
#: changes one of them; Prometheus gauges ``vllm:pykvcache_<name>``).
MANAGER_GAUGES: dict[str, str] = {
    "healthy": "1 while the I/O reactors serve; 0 once the engine is recompute-only "
    "(a reactor died or stalled).",
    "dram_slots": "DRAM-tier slots per worker (dram_cache_bytes / file size).",
    "dram_cached": "DRAM-tier slots holding a block.",
    "dram_writeback_pinned": "DRAM-tier slots pinned until their file is written.",
    "dram_unwritten": "DRAM-tier blocks that have no file because the write-back was "
    "full when they were stored: written later with writeback_flush, otherwise lost to the "
    "cache when evicted or when the engine stops.",
    "stores_in_flight": "Chunks whose store job is not complete yet.",
    "disk_bytes": "Bytes of the published files of this engine's namespaces (the ledger "
    "shared by every process using them, as last seen by the workers, summed over ranks).",
    "loads_in_flight": "Chunks whose load job is not complete yet.",
    "dram_admission_active": "eviction_policy=lru-admit: 1 while the admission filter is "
    "on (it measures more DRAM-tier hits than plain LRU on the recent requests).",
}
#: Latency histograms (seconds per vLLM transfer job, observed on the workers):
#: name -> (help, bucket upper bounds). Prometheus ``vllm:pykvcache_<name>_seconds``.
JOB_HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "store": ("Store job: submission to acknowledgement (its device copy done; files are "
              "written after it).", (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                     0.25, 0.5, 1.0)),
    "load_dram": ("Load job whose chunks all came from the DRAM tier: submission until "
                  "they are on the device.", (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                              0.05, 0.1, 0.25, 0.5, 1.0)),
    "load_disk": ("Load job with any chunk read from disk (or a preload's staging slot): "
                  "submission until all its chunks are on the device.",
                  (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)),
}
#: observations kept for get_stats between two calls (vLLM calls it only with stats
#: logging on; the oldest are dropped beyond this)
MAX_PENDING_OBSERVATIONS = 8192
#: Counters of the connector's break-even gate (``breakeven_table``), one decision per
#: request when it is scheduled; tiers: dram, staged (preloaded), disk.
GATE_COUNTERS: dict[str, str] = {
    f"gate_{a}_{t}": f"Break-even gate: requests whose {t}-tier prefix was "
    f"{'loaded' if a == 'accepted' else 'refused (recomputed)'}."
    for a in ("accepted", "refused") for t in GATE_TIERS}
GATE_COUNTERS.update({
    "gate_accepted_backlog": "disk_backlog_gate: requests whose disk prefix was read "
    "because the disk loads in flight still left it faster than recompute.",
    "gate_refused_backlog": "disk_backlog_gate: requests whose disk prefix was recomputed "
    "because the disk loads in flight made it slower than recompute.",
    "gate_accepted_balance": "gate_balance: requests whose disk prefix was read because "
    "the disk finished it before the GPU's queue and its recompute would.",
    "gate_refused_balance": "gate_balance: requests whose disk prefix was recomputed "
    "because the GPU finished it first.",
})
#: Counters reported by the workers (summed over ranks).
WORKER_COUNTERS: dict[str, str] = {
    "chunks_loaded_dram": "Worker: chunks copied to the device from a DRAM-tier slot.",
    "chunks_loaded_disk": "Worker: chunks read from disk and copied to the device.",
    "chunks_failed": "Worker: chunks whose load failed (rank-level).",
    "files_corrupt": "Worker: cache files found corrupt/truncated (counted and removed).",
    "files_missing": "Worker: cache files missing at read time.",
    "load_errors": "Worker: other read errors.",
    "dram_invalid": "Worker: DRAM-tier slots refused by the header check.",
    "stores_written": "Worker: files published.",
    "stores_existing": "Worker: stores skipped because the file already existed.",
    "ops_expired": "Worker: file operations that passed io_timeout_s (a load is then a "
    "miss and recomputed, a store dropped): a hung or very slow cache filesystem.",
    "items_expired": "Worker: blocks of requests older than twice io_timeout_s that had "
    "not started (queued behind stuck operations); failed the same way.",
    "reactor_stalled": "Worker: the I/O reactor had work but made no progress for 2 x "
    "io_timeout_s (stuck in a synchronous call on a hung filesystem): given up, jobs in "
    "flight finished as failed loads / uncached stores, engine recompute-only.",
    "symlinks_skipped": "Worker: symlinks found where cache files or directories belong; "
    "never followed (docs/security.md).",
    "stores_dropped_enospc": "Worker: stores dropped because the disk was full.",
    "stores_dropped_capacity": "Worker: stores dropped by the max_disk_bytes bound.",
    "stores_dropped_backpressure": "Worker: chunks not stored because no host memory was "
    "free for their device copy right then (stores never wait for the disk).",
    "ext_slot_waits": "Worker: tasks that waited for a DRAM-tier slot still being written "
    "from (0 unless the scheduler's write-back pinning is bypassed).",
    "store_errors": "Worker: stores dropped by other write errors.",
    "direct_verified": "Worker (diagnostics, KVCACHE_VERIFY_DIRECT=1): DRAM-hit copies "
    "spot-checked against the DRAM tier after they finished.",
    "direct_verify_failed": "Worker (diagnostics, KVCACHE_VERIFY_DIRECT=1): spot-checked "
    "DRAM-hit copies whose device bytes differed from the DRAM tier.",
    "bytes_read": "Worker: bytes read from disk.",
    "disk_reads_repeat": "Worker: disk reads of a block this worker had already read from "
    "disk (evicted from the DRAM tier, or no DRAM tier, in between); concurrent loads of "
    "one block share one read and do not count.",
    "bytes_written": "Worker: bytes written to disk.",
    "disk_evicted_files": "Worker: files evicted to honour max_disk_bytes.",
    "disk_ledger_reattached": "Worker: times the namespace's .usage byte ledger was found "
    "removed or replaced while in use, reopened and recounted from the files on disk.",
    "preloads_staged": "Worker: preloaded blocks read into staging ahead of their request.",
    "preloads_claimed": "Worker: on-demand loads served by a staged preload (no disk read).",
    "preloads_joined": "Worker: on-demand loads that joined a preload's read in flight.",
    "preloads_wasted": "Worker: preloaded blocks whose staging slot went to other work "
    "before any load claimed them (the read was wasted).",
    "loads_joined": "Worker: on-demand loads that joined another load's read of the same "
    "block in flight (concurrent requests: one disk read, one device copy each).",
    "preloads_dropped_full": "Worker: preloads dropped unread because every staging slot "
    "they could take held a preload staged less than 30 s ago and not yet claimed (a "
    "preload never evicts one: more planned than staging holds, the first planned stay).",
    "preloads_deduped": "Worker: preloads skipped (block already staged, cached or read).",
    "preloads_requeued": "Worker: preloads closed and re-queued for foreground work.",
    "stores_flushed": "Worker: deferred write-backs started from a DRAM-tier slot "
    "(flushes_planned that found the block there and no file yet).",
    "flushes_invalid": "Worker: deferred write-backs refused because the DRAM-tier slot "
    "no longer held the block (nothing written).",
    "worker_waits": "Worker: times vLLM blocked in wait() for store jobs (a freed GPU "
    "block with a store in flight was reallocated: jobs_to_flush).",
    "worker_wait_us": "Worker: microseconds vLLM spent blocked in those waits.",
    "worker_main_us": "Worker: microseconds vLLM's engine thread spent inside the "
    "connector's worker hooks (submitting jobs, collecting finished ones, waits).",
    "reactor_iterations": "Worker: I/O reactor loop iterations; each is a wake-up that "
    "takes the GIL (diagnostics: divided by seconds, how often the reactor competes "
    "with vLLM's engine thread).",
    "reactor_step_us": "Worker: microseconds the I/O reactor spent in those iterations' "
    "Python work (waits for I/O and device copies excluded).",
    "reactor_dead": "Worker: I/O reactor threads that died (the engine then runs "
    "recompute-only: every lookup misses, nothing is stored; see the 'healthy' gauge).",
}
#: ``writeback_max_fraction="auto"``: the write-back's share of the DRAM tier while a disk
#: load is in flight (writes wait behind reads: ``write_depth_reading``; the pending
#: blocks must not crowd out the blocks queued requests read; thirty-second and
#: thirty-third sessions) and otherwise (a store burst on an idle disk keeps its files)
WB_FRACTION_READING = 0.1
WB_FRACTION_IDLE = 0.5
#: seconds after requests last waited in the queue during which ``auto`` keeps the busy
#: share: the last requests of a queued burst store while the queue is already empty,
#: and what the write-back pins then is still pinned when the next burst reads (the CPU
#: SCBench-like test: 2 preloads wasted without it, none with it)
WB_BUSY_HOLD_S = 2.0

METRIC_PREFIX = "vllm:pykvcache_"
#: entries of the positive disk-lookup cache (oldest dropped beyond it)
LOOKUP_CACHE_MAX = 1 << 16
#: seconds a block that failed to load stays a miss (then it may be tried again)
BAD_KEY_TTL_S = 60.0
#: seconds a worker's "staged" report is believed (the reactor may reclaim an unclaimed
#: preload slot for foreground work; a load then reads the disk, correct but slower)
STAGED_TTL_S = 30.0
STAGED_MAX = 65536
#: requests whose last touched key list the manager keeps (tail-first order on store)
REQ_KEYS_MAX = 4096
BAD_KEYS_MAX = 65536
#: disk_admission="reuse": keys per doorkeeper generation (two are kept: a key stored in
#: the last 65536-131072 distinct first stores counts as seen; ~4 MiB of hashes at most)
SEEN_GENERATION = 1 << 16
DISK_ADMISSIONS = ("all", "reuse")


#: shortest gap between two writes of ``$KVCACHE_STATS_FILE`` (benchmarks, ``make run``)
STATS_EXPORT_GAP_S = 0.1

#: what a lookup answers while its block's files are checked in the background: vLLM's
#: RETRY (0.26: "location uncertain", the scan goes on and the request is asked again
#: next step); HIT_PENDING (also a deferral) on a release without it
LOOKUP_RETRY = getattr(LookupResult, "RETRY", LookupResult.HIT_PENDING)

#: ``disk_lookup_async``: values, and (``auto``) a file check at least this slow puts the
#: lookups in background mode for :data:`ASYNC_LOOKUP_HOLD_S` (on a local disk a check
#: takes microseconds; the thirty-seventh session's checks behind a full disk queue after
#: ``drop_caches`` took up to 239 ms, one request's lookup up to 1.9 s)
DISK_LOOKUP_ASYNC = ("auto", "on", "off")
SLOW_CHECK_US = 20_000
ASYNC_LOOKUP_HOLD_S = 5.0
#: seconds a background check's answer is used by lookups (then asked again)
CHECKED_TTL_S = 1.0
CHECKED_MAX = 1 << 16


class _DiskChecker:
    """``disk_lookup_async``: file existence checks on a daemon thread, so that a lookup
    never waits for filesystem metadata on the engine's main thread.

    The scheduler thread calls :meth:`submit` (a key not yet answered; duplicates of a
    pending key are dropped) and reads :attr:`answers` (key -> (found, monotonic time of
    the check)); only the checker thread writes :attr:`answers` (single dict
    assignments and deletions, atomic under the GIL), and calls ``slow(us)`` after a check
    that took :data:`SLOW_CHECK_US` or more."""

    def __init__(self, check: Callable[[OffloadKey], bool],
                 slow: Callable[[int], None]) -> None:
        self._check = check
        self._slow = slow
        self.answers: dict[OffloadKey, tuple[bool, float]] = {}
        self._queue: collections.deque[OffloadKey] = collections.deque()
        self._pending: set[OffloadKey] = set()
        self._cv = threading.Condition()
        self._stop = False
        self.checks = 0
        self._thread = threading.Thread(target=self._run, name="pykvcache-lookup",
                                        daemon=True)
        self._thread.start()

    def submit(self, key: OffloadKey) -> None:
        """Scheduler thread: check ``key`` in the background (no-op while pending)."""
        with self._cv:
            if key in self._pending:
                return
            self._pending.add(key)
            self._queue.append(key)
            self._cv.notify()

    def _run(self) -> None:
        answers, queue = self.answers, self._queue
        while True:
            with self._cv:
                while not queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                key = queue.popleft()
            t0 = time.perf_counter_ns()
            try:
                found = self._check(key)
            except OSError:  # unreadable: a miss (recompute), never an error
                found = False
            us = (time.perf_counter_ns() - t0) // 1000
            if len(answers) >= CHECKED_MAX:
                del answers[next(iter(answers))]  # oldest answer first
            answers[key] = (found, time.monotonic())
            self.checks += 1
            with self._cv:
                self._pending.discard(key)
            if us >= SLOW_CHECK_US:
                self._slow(us)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=5)


class _StatsExporter:
    """Writes a counters snapshot to ``path`` (JSON, atomically replaced) from a daemon
    thread soon after each :meth:`kick` (coalesced; at most one write per
    ``STATS_EXPORT_GAP_S``), so that the engine thread never touches the filesystem for
    it. :meth:`kick` may be called from any thread (an ``Event.set``). ``snapshot`` runs
    on the exporter thread: it must only copy (dict copies and ``len`` reads are atomic
    under the GIL while the scheduler thread mutates the dicts). :meth:`close` (any
    thread) has the thread write the last snapshot and stop, and returns after that."""

    def __init__(self, path: str, snapshot: Callable[[], dict[str, int]]) -> None:
        self.path, self.snapshot = path, snapshot
        self._kick = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kvcache-stats",
                                        daemon=True)
        self._thread.start()

    def kick(self) -> None:
        self._kick.set()

    def _write(self) -> None:
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            snap = self.snapshot()
            with open(tmp, "w") as f:
                json.dump(snap, f)
            os.replace(tmp, self.path)
        except (OSError, RuntimeError) as e:  # RuntimeError: a dict resized mid-copy
            log.debug("py-kvcache: cannot write stats file %s: %s", self.path, e)

    def _loop(self) -> None:
        while True:
            self._kick.wait()
            self._kick.clear()
            self._write()
            if self._stop:
                return
            time.sleep(STATS_EXPORT_GAP_S)

    def close(self) -> None:
        self._stop = True
        self._kick.set()
        self._thread.join(timeout=5)
        if self._thread.is_alive():  # stuck in the filesystem: try once more here
            self._write()


class PyKVCacheManager(OffloadingManager):
    """The DRAM-tier index and disk lookups (scheduler thread only; see module doc)."""

    #: KV-event medium (``"PYKVCACHE"`` on vLLM 0.26, ``Medium.STORAGE`` on 0.32: see
    #: :data:`~kvcache_core.vllm.compat.EVENT_MEDIUM`). Stored blocks are announced once
    #: (write-through: the disk copy outlives any DRAM eviction, so DRAM evictions are not
    #: removals); a block found corrupt or missing at load time is announced as removed.
    medium = compat.EVENT_MEDIUM

    def __init__(self, root_dir: str, namespaces: Sequence[Namespace], n_dram: int,
                 eviction_policy: str = "lru", enable_events: bool = False,
                 writeback_max_fraction: float | str = "auto",
                 writeback_flush: bool = False,
                 lookup_cache_s: float = 0.0, disk_admission: str = "all",
                 join_promotions: bool = False, disk_lookup_async: str = "off",
                 warm_start: bool = False) -> None:
        if disk_lookup_async not in DISK_LOOKUP_ASYNC:
            raise ValueError(f"disk_lookup_async must be one of {DISK_LOOKUP_ASYNC}, got "
                             f"{disk_lookup_async!r}")
        if disk_admission not in DISK_ADMISSIONS:
            raise ValueError(f"disk_admission must be one of {DISK_ADMISSIONS}, got "
                             f"{disk_admission!r}")
        self.disk = [LayoutIndex(root_dir, ns) for ns in namespaces]
        self.n_dram = n_dram
        self._policy = eviction_policy
        self._slot_policy = "lru" if eviction_policy == "lru-admit" else eviction_policy
        #: eviction_policy="lru-admit": LRU, plus a frequency filter on new DRAM-tier
        #: blocks that is on only while it measures better (kvcache_core.admission)
        self._admission = (AdmissionDuel(n_dram) if eviction_policy == "lru-admit"
                           and n_dram > 0 else None)
        self.dram: SlotAllocator | None = (
            SlotAllocator(n_dram, retain=True, policy=self._slot_policy) if n_dram > 0
            else None)
        self._slot_key: list[OffloadKey | None] = [None] * n_dram  # key retained in slot
        self._owner = itertools.count(1)
        self._storing: dict[OffloadKey, int] = {}  # key -> DRAM slot (-1: none) in flight
        #: req id -> the key list vLLM last passed to touch() (its own list, held, not
        #: copied), for the tail-first order after a store job completes; bounded
        self._req_keys: collections.OrderedDict[str, Sequence[OffloadKey]] = (
            collections.OrderedDict())
        # write-back: key -> ranks that reported its disk write ended (keys storing or
        # pinned only), and key -> its DRAM slot, pinned until all ranks reported
        self._wb_done: dict[OffloadKey, int] = {}
        self._wb_pinned: dict[OffloadKey, int] = {}
        # keys storing into a DRAM slot whose file will be written from it; with
        # _wb_pinned, the slots that write-back holds (bounded by _wb_cap())
        self._wb_storing: set[OffloadKey] = set()
        auto = writeback_max_fraction == "auto"
        reading = WB_FRACTION_READING if auto else float(writeback_max_fraction)
        idle = WB_FRACTION_IDLE if auto else float(writeback_max_fraction)
        #: the write-back's bound in slots while busy (:meth:`_wb_cap`), and otherwise
        self._wb_cap_reading = max(1, int(n_dram * reading)) if n_dram > 0 else 0
        self._wb_cap_idle = max(1, int(n_dram * idle)) if n_dram > 0 else 0
        # (req_id, key) -> (dram slot or -1, "pin" | "promote" | "disk") for loads in flight
        self._loading: dict[tuple[str, OffloadKey], tuple[int, str]] = {}
        self._loading_refs: collections.Counter[OffloadKey] = collections.Counter()
        #: records in _loading / _held that read from disk ("disk" or "promote"): the
        #: connector's ``disk_load_hold_s`` holds disk-loading requests while it is > 0
        self.disk_loads_in_flight = 0
        #: req id -> its records in ``disk_loads_in_flight``: ``len()`` is the number of
        #: requests reading from disk (``disk_load_hold_requests``). Scheduler thread.
        self._disk_reqs: collections.Counter[str] = collections.Counter()
        #: waiting requests the patched scheduler offered in this step
        #: (``on_preload_candidates``; 0 when it offered none, and always without the
        #: patches or ``preload_lookahead``): set by :meth:`note_waiting` before this
        #: step's store jobs are prepared, cleared by :meth:`end_step`. Scheduler thread.
        self.requests_waiting = 0
        #: monotonic time until which the write-back keeps its busy share after
        #: requests last waited (:data:`WB_BUSY_HOLD_S`), and whether that time is still
        #: ahead (evaluated once per step, by :meth:`end_step`)
        self._queue_until = 0.0
        self._queue_recent = False
        #: bumped whenever a disk load ends or the workers report blocks staged: what a
        #: request held by ``disk_load_hold_s`` would find may have changed
        self.load_epoch = 0
        # synchronous DRAM loads that vLLM's scheduler already counts complete while the
        # workers still copy them: token (vLLM's job id) -> (req_id, [(key, record)])
        self._held: dict[int, tuple[str, list[tuple[OffloadKey, tuple[int, str]]]]] = {}
        # keys being read from disk into a DRAM-tier slot (promotions in flight)
        self._promoting: collections.Counter[OffloadKey] = collections.Counter()
        #: ``join_promotions``: a later load of a key being promoted copies from the
        #: promotion's slot (key -> that slot) instead of waiting (HIT_PENDING)
        self.join_promotions = join_promotions
        self._promote_slot: dict[OffloadKey, int] = {}
        self._failed: set[OffloadKey] = set()
        self.counters: collections.Counter[str] = collections.Counter()
        self._reported: dict[str, int] = {}
        self._reported_gauges: dict[str, int] = {}
        #: the counters' values at the last get_stats (a step without change skips the
        #: per-counter delta loop)
        self._stats_sig: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        self._lookup_disk = False
        self._lookup_disk_n = 0
        #: of those, chunks another request's load is reading from disk right now
        self._lookup_disk_reading = 0
        #: keys that a load is reading from disk through staging right now (``disk``
        #: records): a second load of one joins that read in the worker (one read)
        self._reading: collections.Counter[OffloadKey] = collections.Counter()
        #: counters owned by others (the connector's break-even gate), reported in stats()
        self.extra_counters: dict[str, int] = {}
        #: False when the break-even table says the disk tier never beats recompute (set
        #: by the connector): stores then fill DRAM-tier slots only and write no files.
        self.disk_stores = True
        #: requests whose prompt is shorter than the connector's ``disk_min_prefix_tokens``
        #: (req id; added and removed by the connector): their stores write no files
        self.short_requests: set[str] = set()
        #: requests whose prompt is shorter than the connector's
        #: ``min_store_prefix_tokens`` (req id; added and removed by the connector): they
        #: store nothing
        self.nostore_requests: set[str] = set()
        # keys being stored without a file (short request): nothing will be written
        self._dram_only: set[OffloadKey] = set()
        # keys being stored without a file because the write-back was full ("behind"),
        # and such keys now CACHED in the DRAM tier, oldest first ("dirty"): their files
        # are written from there later (take_flush_plan), unless they are evicted first
        self._behind: set[OffloadKey] = set()
        self._dirty: collections.OrderedDict[OffloadKey, None] = collections.OrderedDict()
        #: ``writeback_flush``: write such blocks later (take_flush_plan); off: they stay
        #: DRAM-only until evicted
        self._flush_on = writeback_flush
        #: disk_admission="reuse": files only for blocks that showed a reuse (module doc)
        self._reuse_only = disk_admission == "reuse"
        #: ... keys CACHED (or storing) in the DRAM tier without a file, none shown reused
        self._unproven: set[OffloadKey] = set()
        #: ... such keys that a DRAM hit proved reused: files to write, oldest first
        self._hot: collections.OrderedDict[OffloadKey, None] = collections.OrderedDict()
        #: ... store doorkeeper: hash(key) of first stores, current and previous generation
        self._seen: set[int] = set()
        self._seen_old: set[int] = set()
        #: positive disk-lookup cache (``disk_lookup_cache_s``): key -> until when its files
        #: are believed to exist, oldest first; None when off
        self._pos_ttl = lookup_cache_s
        self._pos: collections.OrderedDict[OffloadKey, float] | None = (
            collections.OrderedDict() if lookup_cache_s > 0 else None)
        #: ``disk_lookup_async``: "off", "on" (lookups never check files on this thread)
        #: or "auto" (only until :attr:`_async_until`, set by a slow check)
        self._async_mode = disk_lookup_async
        self._async_until = float("inf") if disk_lookup_async == "on" else 0.0
        self._checker: _DiskChecker | None = None
        #: ``disk_warm_start``: the cache directory's metadata read on a daemon thread
        #: once, at start-up (:mod:`kvcache_core.warm`); it only sets the warm_*
        #: counters, from its own thread, when it ends
        self._warmer: DirWarmer | None = None
        self._events_on = enable_events
        self._exporter: _StatsExporter | None = None
        self._observations: dict[str, list[float]] = {}
        self._events: list[OffloadingEvent] = []
        # keys whose load failed -> until when they are treated as a miss (bounded)
        self._bad: collections.OrderedDict[OffloadKey, float] = collections.OrderedDict()
        # keys recently planned for preload (bounded LRU): never planned twice in a row
        self._planned: collections.OrderedDict[OffloadKey, None] = collections.OrderedDict()
        self._planned_cap = 8192
        #: worker ranks (one namespace each) whose reports make up one step's aggregated
        #: metadata: a block counts as staged once that many ranks reported it
        self.n_ranks = len(self.disk)
        # keys preloaded into staging on every rank -> until when that is believed
        self._staged: collections.OrderedDict[OffloadKey, float] = collections.OrderedDict()
        #: ``protect_queue``: chunk keys of the waiting requests in view (req id ->
        #: (block hashes seen, keys of every KV group)), rebuilt each call from the last
        self._protect_keys: dict[str, tuple[int, list[OffloadKey]]] = {}
        #: ``protect_queue``: key -> position of the first waiting request in view that
        #: reads it (empty unless preload_protect is on)
        self._queue_rank: dict[OffloadKey, int] = {}
        #: ``protect_queue``: the waiting requests in view (the caller's sequence, held
        #: until the next call), and req id -> its position there; ``_queue_sets``: a
        #: request's chunk keys as a set, built only when :meth:`_next_reader` needs it
        #: (a promotion for the head of the queue)
        self._queue_reqs: Sequence[Any] = ()
        self._queue_pos: dict[str, int] = {}
        self._queue_sets: dict[str, tuple[int, frozenset[OffloadKey]]] = {}
        self._lookup_fast = 0
        self._lookup_fast_staged = False
        #: bytes a key's files hold over all ranks (what reading it from disk costs)
        self.key_bytes = sum(d.ns.file_bytes for d in self.disk)
        if warm_start:
            self.start_warm()

    # ------------------------------------------------------------------ helpers
    def _on_disk(self, key: OffloadKey) -> bool:
        """Whether every rank's file of ``key`` exists (one ``access`` per rank), or was
        found within the last ``disk_lookup_cache_s`` seconds (positive lookup cache, for
        filesystems where each lookup is a network round trip). A cached answer may be
        stale (the file evicted by any process since): the load then fails, the block is
        recomputed and its cache entry dropped (:meth:`on_worker_report`)."""
        pos, c = self._pos, self.counters
        if self._cached_on_disk(key):
            return True
        t0 = time.perf_counter_ns()
        found = self._files_exist(key)
        us = (time.perf_counter_ns() - t0) // 1000
        c["disk_checks"] += 1
        c["disk_check_us"] += us
        if us > c["disk_check_max_us"]:
            c["disk_check_max_us"] = us
        if us >= SLOW_CHECK_US:
            self._slow_check(us)
        if pos is None:
            return found
        if found:
            pos[key] = time.monotonic() + self._pos_ttl
            pos.move_to_end(key)
            if len(pos) > LOOKUP_CACHE_MAX:
                pos.popitem(last=False)
            return True
        pos.pop(key, None)  # an expired entry
        return False

    def _files_exist(self, key: OffloadKey) -> bool:
        """One ``access`` per rank: every rank's file of ``key`` is published. Any
        thread (the scheduler's, or ``disk_lookup_async``'s checker)."""
        return all(d.exists(key) for d in self.disk)

    def _cached_on_disk(self, key: OffloadKey) -> bool:
        """The positive lookup cache (``disk_lookup_cache_s``) believes ``key``'s files
        exist (counted in ``lookups_cached``). Scheduler thread."""
        pos = self._pos
        if pos is None:
            return False
        until = pos.get(key)
        if until is None or until <= time.monotonic():
            return False
        self.counters["lookups_cached"] += 1
        return True

    def _slow_check(self, us: int) -> None:
        """A file check took ``us`` >= :data:`SLOW_CHECK_US` (either thread): with
        ``disk_lookup_async="auto"`` lookups check files in the background for the next
        :data:`ASYNC_LOOKUP_HOLD_S` (a float assignment, atomic under the GIL)."""
        if self._async_mode == "auto":
            if time.monotonic() >= self._async_until:
                log.info("py-kvcache: a file check took %d ms: disk lookups move off the "
                         "engine thread for %.0f s (disk_lookup_async=auto)", us // 1000,
                         ASYNC_LOOKUP_HOLD_S)
            self._async_until = time.monotonic() + ASYNC_LOOKUP_HOLD_S

    def _lookup_on_disk(self, key: OffloadKey) -> bool | None:
        """:meth:`_on_disk` for lookups and preload planning: synchronous, except while
        ``disk_lookup_async`` is in background mode; then the answer of a background
        check less than :data:`CHECKED_TTL_S` old, or None after handing ``key`` to the
        checker thread (the caller answers "not yet": vLLM's RETRY). Scheduler thread."""
        if self._async_until <= 0.0 or time.monotonic() >= self._async_until:
            return self._on_disk(key)
        if self._cached_on_disk(key):
            return True
        chk = self._checker
        if chk is None:
            chk = self._checker = _DiskChecker(self._files_exist, self._slow_check)
        ans = chk.answers.get(key)
        if ans is not None and time.monotonic() - ans[1] < CHECKED_TTL_S:
            return ans[0]
        chk.submit(key)
        return None

    def _wb_cap(self) -> int:
        """DRAM slots the write-back may hold now (``writeback_max_fraction``): the
        reading bound while the engine is busy (a disk load in flight, or requests
        waiting in the patched scheduler's queue now or less than
        :data:`WB_BUSY_HOLD_S` ago: their loads are coming, and slots pinned now stay
        pinned while those reads go first), else the idle one. Scheduler thread; O(1)."""
        if self.disk_loads_in_flight or self.requests_waiting or self._queue_recent:
            return self._wb_cap_reading
        return self._wb_cap_idle

    def note_waiting(self, n: int) -> None:
        """``n`` > 0 requests wait in the patched scheduler's queue in this step (the
        connector scheduler, before the step's store jobs are prepared). Scheduler
        thread; O(1)."""
        self.requests_waiting = n
        if n:
            self._queue_until = time.monotonic() + WB_BUSY_HOLD_S

    def end_step(self) -> None:
        """This step's metadata is built (the connector scheduler, once per step): the
        queue count is cleared, and the write-back keeps its busy share while requests
        waited less than :data:`WB_BUSY_HOLD_S` ago. Scheduler thread; one clock read."""
        self.requests_waiting = 0
        self._queue_recent = bool(self._queue_until) and time.monotonic() < self._queue_until

    def _acquire(self, evicted: list[OffloadKey] | None) -> int:
        """A DRAM slot for a new job (BUSY), reclaiming the policy's victim if needed."""
        assert self.dram is not None
        slot = self.dram.acquire(next(self._owner))
        if slot < 0:
            return -1
        old = self._slot_key[slot]
        if old is not None:
            self._slot_key[slot] = None
            self.counters["dram_evictions"] += 1
            if self._dirty and old in self._dirty:  # no file of it: lost to the cache
                del self._dirty[old]
                self.counters["dram_only_evicted"] += 1
            if self._reuse_only:
                self._unproven.discard(old)
                if self._hot and old in self._hot:
                    del self._hot[old]
                    self.counters["dram_only_evicted"] += 1
            if evicted is not None:
                evicted.append(old)
        return slot

    def _retain(self, slot: int, key: OffloadKey) -> None:
        assert self.dram is not None
        self.dram.release(slot, key)
        if self.dram.lookup(key) == slot:
            self._slot_key[slot] = key

    def _drop(self, key: OffloadKey) -> None:
        if self.dram is None:
            return
        slot = self.dram.lookup(key)
        if slot >= 0 and self.dram.drop(key):
            self._slot_key[slot] = None
            self._dirty.pop(key, None)
            self._hot.pop(key, None)
            self._unproven.discard(key)

    # ------------------------------------------------------------------ preload (R8)
    def begin_lookup(self) -> None:
        """The connector starts one request's lookups (break-even gate bookkeeping)."""
        self._lookup_disk = False
        self._lookup_disk_n = 0
        self._lookup_disk_reading = 0
        self._lookup_fast = 0
        self._lookup_fast_staged = False

    def lookup_disk_chunks(self) -> int:
        """Hit chunks since :meth:`begin_lookup` that must come from disk (neither in the
        DRAM tier nor staged): what the request would add to the disk's reads."""
        return self._lookup_disk_n

    def lookup_disk_new_chunks(self) -> int:
        """Of :meth:`lookup_disk_chunks`, those that no other request's load is reading
        from disk right now: what the request would add to the disk's reads (the others
        join the read in flight: in the worker for a read through staging, from the
        promotion's slot with ``join_promotions``). Scheduler thread; O(1)."""
        return self._lookup_disk_n - self._lookup_disk_reading

    def dram_short(self, n: int) -> bool:
        """Whether the DRAM tier cannot give ``n`` slots now (to promote ``n`` chunks read
        from disk) but could once the jobs holding its slots release them: fewer than
        ``n`` are acquirable, and ``n`` fits the tier. False without a tier or for
        ``n <= 0``. Scheduler thread; O(1)."""
        dram = self.dram
        if dram is None or n <= 0 or n > dram.n_slots:
            return False
        return dram.acquirable < n

    def lookup_fast_chunks(self) -> tuple[int, str]:
        """(hit chunks since :meth:`begin_lookup` before the first one that must come from
        disk, their tier ``staged`` if any was staged by a preload else ``dram``): the part
        of the prefix that a gate refusing the disk tier may still load."""
        return self._lookup_fast, "staged" if self._lookup_fast_staged else "dram"

    def lookup_tier(self) -> str:
        """Source tier of the lookups since :meth:`begin_lookup`: ``disk`` if any hit chunk
        must come from disk, else ``staged`` if any was preloaded into staging, else
        ``dram`` (without a disk chunk, every staged chunk is a leading one)."""
        if self._lookup_disk:
            return "disk"
        return "staged" if self._lookup_fast_staged else "dram"

    @staticmethod
    def _live(until_of: dict[OffloadKey, float], key: OffloadKey) -> bool:
        """``key`` is in ``until_of`` (key -> deadline) and its deadline has not passed;
        an expired entry is removed."""
        until = until_of.get(key)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        del until_of[key]
        return False

    def _plan_prefix(self, hashes: Sequence[Any], g: Any, out: list[OffloadKey],
                     max_blocks: int, max_chunks: int | None = None) -> None:
        """Append the disk-resident chunk keys of one request's KV group (prefix order,
        stopping at the first chunk not on disk, and after ``max_chunks`` chunks) that
        were not planned recently."""
        planned = self._planned
        hpc = g.hashes_per_chunk
        stop = None if max_chunks is None else max_chunks * hpc
        for h in itertools.islice(hashes, hpc - 1, stop, hpc):
            key = make_offload_key(h, g.group_idx)
            if key in planned:
                planned.move_to_end(key)
                continue
            if (self.dram is not None and self.dram.lookup(key) >= 0) or key in self._promoting:
                continue  # in the DRAM tier, or being read into it for another request
            if key in self._storing or key in self._bad or not self._lookup_on_disk(key):
                return  # not on disk (or not known yet: disk_lookup_async)
            planned[key] = None
            out.append(key)
            if len(out) >= max_blocks:
                return

    def plan_preloads(self, requests: Sequence[Any], group_configs: Sequence[Any],
                      max_blocks: int,
                      admit: Callable[[Any, int], bool] | None = None) -> list[OffloadKey]:
        """Disk blocks of the waiting ``requests`` (scheduling order) worth reading ahead.

        Per request and KV group, walks the chunk keys in prefix order: DRAM-resident
        chunks are skipped (already fast), the walk stops at the first chunk that is not
        on disk (vLLM's lookup stops there too, so later chunks would never be used), and
        keys planned recently are not planned again. At most ``max_blocks`` keys per call;
        the worker's reactor still runs ONE speculative read at a time, below foreground
        work. ``admit(request, n_new_keys)`` (queue-aware preload) is asked once per
        request, in order, with the number of keys planned for it; False drops them.
        vLLM 0.32's per-request limits hold here too: nothing is planned for a request
        whose ``kv_load_tiers`` exclude the disk tier, and no chunk past its
        ``max_load_tokens`` (counted from the prompt's start; see
        :mod:`~kvcache_core.vllm.compat`). Scheduler thread only.
        """
        out: list[OffloadKey] = []
        planned = self._planned
        for req in requests:
            start = len(out)
            cap = compat.max_load_tokens(req)
            for g in group_configs if compat.request_disk_allowed(req) else ():
                self._plan_prefix(req.block_hashes, g, out, max_blocks,
                                  None if cap is None else cap // g.tokens_per_chunk)
                if len(out) >= max_blocks:
                    break
            if admit is not None and not admit(req, len(out) - start):
                for key in out[start:]:
                    planned.pop(key, None)
                del out[start:]
                self.counters["preloads_skipped_queue"] += 1
            if len(out) >= max_blocks:
                break
        while len(planned) > self._planned_cap:
            planned.popitem(last=False)
        if out:
            self.counters["preloads_planned"] += len(out)
        return out

    def protect_queue(self, requests: Sequence[Any], group_configs: Sequence[Any]) -> None:
        """``preload_protect``: the DRAM-tier blocks of the waiting ``requests``
        (scheduling order) become the most recent, the head of the queue's most recent
        of all and, within a request, its prefix after its tail. A promotion or store
        that needs a slot then evicts first a block that no request in view will read,
        then the tail of the request that runs last: Belady's choice over the part of
        the future the queue shows (vLLM's lookup stops at the first missing chunk, so a
        kept prefix stays usable). Order only (``policy.refresh``): nothing counts as a
        reuse, and the admission filter is not consulted. A request's chunk keys are
        built once and kept while it stays in view.

        It also records each key's rank (the position of the first request in view that
        reads it) and the requests' positions for :meth:`_queue_admits`, Belady's
        admission over the queue: until the next call, a store or promotion does not
        take a DRAM slot whose victim a request in view reads before the new block is
        read again. Scheduler thread only."""
        dram = self.dram
        rank, pos_of = self._queue_rank, self._queue_pos
        rank.clear()
        pos_of.clear()
        self._queue_reqs = requests
        if dram is None or not requests:
            return
        refresh, index = dram.policy.refresh, dram.index
        cache, keep = self._protect_keys, {}
        n = 0
        for pos in range(len(requests) - 1, -1, -1):  # the last first: the head ends newest
            req = requests[pos]
            hashes = req.block_hashes
            rid = req.request_id
            got = cache.get(rid)
            if got is None or got[0] != len(hashes):
                keys: list[OffloadKey] = []
                for g in group_configs:
                    hpc = g.hashes_per_chunk
                    keys.extend(make_offload_key(h, g.group_idx)
                                for h in itertools.islice(hashes, hpc - 1, None, hpc))
                got = (len(hashes), keys)
            keep[rid] = got
            pos_of[rid] = pos
            keys = got[1]
            for i in range(len(keys) - 1, -1, -1):  # tail first: the head ends newest
                key = keys[i]
                rank[key] = pos  # the earliest request in view that reads it wins
                if key in index:
                    refresh(key)
                    n += 1
        self._protect_keys = keep
        if self._queue_sets:
            self._queue_sets = {r: v for r, v in self._queue_sets.items() if r in keep}
        self.counters["dram_protected"] += n

    def _next_reader(self, key: OffloadKey, pos: int) -> int:
        """Position of the first request in view after position ``pos`` that reads
        ``key`` (1 << 30 when none does). Builds (and keeps while in view) the key set
        of each request it checks: costs nothing on a step without such a promotion.
        Scheduler thread only."""
        reqs, sets, keep = self._queue_reqs, self._queue_sets, self._protect_keys
        for p in range(pos + 1, len(reqs)):
            rid = reqs[p].request_id
            got = keep.get(rid)
            if got is None:
                continue
            ks = sets.get(rid)
            if ks is None or ks[0] != got[0]:
                ks = sets[rid] = (got[0], frozenset(got[1]))
            if key in ks[1]:
                return p
        return 1 << 30

    def _queue_admits(self, key: OffloadKey, reader: str | None = None) -> bool:
        """``preload_protect``: whether ``key`` may take a DRAM slot now. False when the
        slot's victim is read by a request in view earlier than ``key`` is read next (a
        key no request in view reads ranks last); True when a slot is free, the victim
        is not in view, or the queue was not ranked (protect off). Counted when False.

        ``reader``: the request that loads ``key`` now (a promotion). Its own read does
        not need the slot (without one the block comes through staging), so the block's
        next use is the NEXT request in view that reads it: a promotion for a request at
        the head of the queue must not evict the blocks of the request behind it (the
        fifty-client runs: the second reader of a document, waiting for the first one's
        promotion, found its blocks evicted by the promotions of a third document and
        read them all again)."""
        rank = self._queue_rank
        if not rank:
            return True
        assert self.dram is not None
        victim = self.dram.next_victim()
        if victim is None:
            return True
        rv = rank.get(victim)
        if rv is None:
            return True
        rk = rank.get(key, 1 << 30)
        if reader is not None and rk == self._queue_pos.get(reader, -1):
            rk = self._next_reader(key, rk)
        if rv >= rk:
            return True
        self.counters["dram_queue_refused"] += 1
        return False

    # ------------------------------------------------------------------ OffloadingManager
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @property
    def healthy(self) -> bool:
        """False once a worker reported its reactor dead: recompute-only from then on."""
        return not self.counters["reactor_dead"]

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self.counters["lookups"] += 1
        if (key in self._storing or (self._bad and self._live(self._bad, key))
                or not self.healthy):
            self.counters["misses"] += 1
            return LookupResult.MISS
        if self.dram is not None and self.dram.lookup(key) >= 0:
            self.counters["hits_dram"] += 1
            if not self._lookup_disk:
                self._lookup_fast += 1
            return LookupResult.HIT
        if self._promoting and self._promoting.get(key):
            if self.join_promotions and key in self._promote_slot:
                # another request is reading this block into a DRAM-tier slot: load it
                # now, copied from that slot once the read is done (prepare_load)
                self.counters["hits_promoting"] += 1
                self._lookup_disk = True
                self._lookup_disk_n += 1
                self._lookup_disk_reading += 1
                return LookupResult.HIT
            # another request is reading this block into the DRAM tier right now: wait
            # for that read (vLLM retries the lookup next step) instead of a second one
            self.counters["hits_pending"] += 1
            return LookupResult.HIT_PENDING
        if not compat.disk_allowed(req_context):  # the request's tier filter (vLLM 0.32)
            self.counters["misses"] += 1
            return LookupResult.MISS
        on_disk = self._lookup_on_disk(key)
        if on_disk is None:  # being checked in the background: vLLM asks again
            self.counters["lookups_retry"] += 1
            return LOOKUP_RETRY
        if on_disk:
            if self._staged and self._live(self._staged, key):
                self.counters["hits_staged"] += 1
                if not self._lookup_disk:
                    self._lookup_fast += 1
                    self._lookup_fast_staged = True
                return LookupResult.HIT
            self.counters["hits_disk"] += 1
            self._lookup_disk = True
            self._lookup_disk_n += 1
            if key in self._reading:
                self._lookup_disk_reading += 1
            return LookupResult.HIT
        self.counters["misses"] += 1
        return LookupResult.MISS

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> Any:
        """vLLM 0.32 (per-source cache-hit metrics, asked after the load was prepared):
        ``CacheHitSource.HOST`` for a chunk served by the DRAM tier, ``DISK`` for one
        read from disk (or from a preload's staging slot). Never called by 0.26."""
        rec = self._loading.get((req_context.req_id, key))
        if rec is not None:
            return compat.hit_source("dram" if rec[1] == "pin" else "disk")
        dram = self.dram is not None and self.dram.lookup(key) >= 0
        return compat.hit_source("dram" if dram else "disk")

    def prepare_load(self, keys: Collection[OffloadKey],
                     req_context: ReqContext) -> PyKVLoadSpec:
        """Pin the DRAM-cached keys (IN_SLOT loads), then give each other key a DRAM slot
        to be read into (promotion) when the tier has one to spare, else -1 (the worker
        reads through a staging slot). Pinning first means a promotion can never evict a
        block this same load is about to read. With ``join_promotions``, a key another
        request is promoting now is loaded from that promotion's slot once its read is
        done (IN_SLOT | AFTER_LOAD: the reactor orders the two on the slot, and keeps a
        later user of the slot waiting until the copy is done), not read again."""
        req_id = req_context.req_id
        keys = list(keys)
        recs: list[tuple[int, str]] = [(-1, "disk")] * len(keys)
        if self.dram is not None:
            unproven = self._unproven
            joining = self.join_promotions and self._promote_slot
            for i, key in enumerate(keys):
                slot = self.dram.pin(key)
                if slot >= 0:
                    recs[i] = (slot, "pin")
                    if unproven and key in unproven:  # read again: worth a file now
                        unproven.discard(key)
                        self._hot[key] = None
                elif joining and key in self._promote_slot:
                    recs[i] = (self._promote_slot[key], "join")
            for i in range(len(keys)):
                if recs[i][1] == "disk":
                    slot = (self._acquire(None) if self._queue_admits(keys[i], req_id)
                            else -1)
                    if slot >= 0:
                        recs[i] = (slot, "promote")
        slots, flags = [], []
        staged = self._staged
        for key, rec in zip(keys, recs, strict=True):
            if staged:
                staged.pop(key, None)  # claimed now (the worker serves it from staging)
            how = rec[1]
            self.counters["loads_dram" if how == "pin" else "loads_disk"] += 1
            if how != "pin":
                self.disk_loads_in_flight += 1
                self._disk_reqs[req_id] += 1
                if how == "disk":
                    self._reading[key] += 1
            if how == "promote":
                self.counters["promotions"] += 1
                self._promoting[key] += 1
                self._promote_slot[key] = rec[0]
            elif how == "join":
                self.counters["loads_join_promotion"] += 1
            prev = self._loading.pop((req_id, key), None)
            if prev is not None:  # pragma: no cover - vLLM issues one load per request
                self._finish_load(req_id, key, prev, failed=True)
            self._loading[(req_id, key)] = rec
            self._loading_refs[key] += 1
            slots.append(rec[0])
            flags.append(IN_SLOT if how == "pin" else IN_SLOT | AFTER_LOAD if how == "join"
                         else 0)
        return PyKVLoadSpec(keys, slots, flags)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """A use of the request's blocks ``keys`` (vLLM: its whole key list in prefix
        order): the ones in the DRAM tier become the most recent, tail first (the head
        ends up most recent)."""
        if self.dram is None:
            return
        if isinstance(keys, Sequence):
            rk = self._req_keys
            if self._admission is not None and req_context.req_id not in rk:
                self._admission.on_request(keys)  # once per request: its lookup
            rk[req_context.req_id] = keys
            rk.move_to_end(req_context.req_id)
            if len(rk) > REQ_KEYS_MAX:
                rk.popitem(last=False)
            self._touch_tail_first(keys)
            return
        for key in keys:
            if self.dram.lookup(key) >= 0:
                self.dram.policy.hit(key)

    def _touch_tail_first(self, keys: Sequence[OffloadKey], reuse: bool = True) -> None:
        """The DRAM-tier blocks of ``keys`` become the most recent, last key first;
        ``reuse``: count it as a use (vLLM's touch), else only restore the order (a
        block that was only stored is not a reuse)."""
        dram = self.dram
        assert dram is not None
        use, index = (dram.policy.hit if reuse else dram.policy.refresh), dram.index
        for i in range(len(keys) - 1, -1, -1):
            key = keys[i]
            if key in index:
                use(key)

    @property
    def disk_load_requests(self) -> int:
        """Requests with at least one chunk being read from disk (promotions and reads
        through staging). Scheduler thread; O(1)."""
        return len(self._disk_reqs)

    def _finish_load(self, req_id: str, key: OffloadKey, rec: tuple[int, str],
                     failed: bool) -> None:
        slot, how = rec
        if how == "pin":
            assert self.dram is not None
            self.dram.unpin(slot)
            if failed:
                self._drop(key)
        else:  # read from disk
            self.disk_loads_in_flight -= 1
            self.load_epoch += 1
            reqs = self._disk_reqs
            reqs[req_id] -= 1
            if reqs[req_id] <= 0:
                del reqs[req_id]
            if how == "disk":
                reading = self._reading
                reading[key] -= 1
                if reading[key] <= 0:
                    del reading[key]
        if how == "promote":
            assert self.dram is not None
            self._promoting[key] -= 1
            if self._promoting[key] <= 0:
                del self._promoting[key]
            if self._promote_slot.get(key) == slot:
                del self._promote_slot[key]  # later loads find it retained, or read it
            if failed:
                self.dram.release(slot)
            else:
                self._retain(slot, key)
                if self.dram.lookup(key) == slot:
                    self.dram.policy.hit(key)  # read again after its store: a reuse
        self._loading_refs[key] -= 1
        if self._loading_refs[key] <= 0:
            del self._loading_refs[key]
            self._failed.discard(key)

    def loads_of(self, keys: Collection[bytes]) -> dict[str, set[OffloadKey]]:
        """Requests with a load of any of ``keys`` in flight: req id -> those keys
        (scheduler thread; walks the loads in flight, so call it on failures only)."""
        want = {OffloadKey(k) for k in keys}
        out: dict[str, set[OffloadKey]] = {}
        for rid, key in self._loading:
            if key in want:
                out.setdefault(rid, set()).add(key)
        for rid, held in self._held.values():
            for key, _rec in held:
                if key in want:
                    out.setdefault(rid, set()).add(key)
        return out

    def hold_loads(self, token: int, req_id: str, keys: Collection[OffloadKey]) -> None:
        """Keep the pins of ``req_id``'s load of ``keys`` after vLLM completes it
        (``complete_load`` then finds nothing to release) until :meth:`release_held`
        ``token``: a synchronous DRAM load that vLLM's scheduler counts complete when it
        is scheduled, while the workers still copy from the slots (scheduler thread)."""
        held = []
        for key in keys:
            rec = self._loading.pop((req_id, key), None)
            if rec is not None:
                held.append((key, rec))
        self._held[token] = (req_id, held)

    def release_held(self, token: int) -> None:
        """Every worker finished the copy of held load ``token``: unpin its slots (a key
        that failed its check is dropped, as in ``complete_load``). Unknown tokens are
        ignored."""
        rid, held = self._held.pop(token, ("", []))
        for key, rec in held:
            self._finish_load(rid, key, rec, failed=key in self._failed)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        req_id = req_context.req_id
        for key in keys:
            rec = self._loading.pop((req_id, key), None)
            if rec is not None:
                self._finish_load(req_id, key, rec, failed=key in self._failed)

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext) -> PrepareStoreOutput:
        to_store: list[OffloadKey] = []
        slots: list[int] = []
        evicted: list[OffloadKey] = []
        if req_context.req_id in self.nostore_requests:
            self.counters["stores_skipped_below_floor"] += len(keys)
            keys = ()
        # keys of this call that are DRAM-cached are pinned meanwhile: not evicted for it
        pinned = [] if self.dram is None else [
            s for s in (self.dram.pin(k) for k in keys) if s >= 0]
        short = req_context.req_id in self.short_requests
        disk = self.disk_stores and not short
        dram_only: list[bool] | None = None
        if not self.healthy:  # recompute-only: the workers cannot store any more
            keys = ()
        wb_cap = self._wb_cap()  # fixed for this call: nothing here starts or ends a load
        for key in keys:
            if (key in self._storing
                    or (self.dram is not None and self.dram.lookup(key) >= 0)
                    or self._on_disk(key)):
                self.counters["stores_skipped"] += 1
                continue
            # disk_admission=reuse, first store: no file until the block shows a reuse
            deferred = disk and self._reuse_only and not self._seen_before(key)
            slot = -1
            if self.dram is not None:
                adm = self._admission
                victim = (self.dram.next_victim() if adm is not None and adm.active
                          else None)
                if victim is not None and not adm.admit(key, victim):
                    # the tier keeps its block: more requests asked for it (loop workload)
                    self.counters["stores_not_admitted"] += 1
                    if not disk:
                        continue
                elif self._queue_admits(key):
                    slot = self._acquire(evicted)
            if deferred and slot < 0:  # no DRAM slot to keep it in until it proves reused
                self.counters["stores_disk_not_admitted"] += 1
                continue
            behind = deferred  # DRAM only (dram_only); _unproven until a DRAM hit
            if deferred:
                self._dram_only.add(key)
                self._unproven.add(key)
                self.counters["stores_disk_deferred"] += 1
            elif slot >= 0 and disk:
                if len(self._wb_storing) + len(self._wb_pinned) >= wb_cap:
                    behind = True  # the disk is behind: this block stays in DRAM only
                    self._dram_only.add(key)
                    self._behind.add(key)
                    self.counters["stores_writeback_full"] += 1
                else:
                    self._wb_storing.add(key)
            if slot < 0 and not disk:  # disk-only store, and the disk never pays off here
                self.counters["stores_skipped_short" if short else "stores_skipped_gate"] += 1
                continue
            if behind or dram_only is not None:
                if dram_only is None:
                    dram_only = [False] * len(to_store)
                dram_only.append(behind)
            self._storing[key] = slot
            if short and self.disk_stores:
                self._dram_only.add(key)
                self.counters["stores_dram_only_short"] += 1
            to_store.append(key)
            slots.append(slot)
            self.counters["stores"] += 1
            if slot >= 0:
                self.counters["stores_dram"] += 1
            elif self.dram is not None:
                self.counters["stores_no_dram_slot"] += 1
        for slot in pinned:
            assert self.dram is not None
            self.dram.unpin(slot)
        self._maybe_export()
        return PrepareStoreOutput(keys_to_store=to_store,
                                  store_spec=PyKVStoreSpec(to_store, slots, no_disk=not disk,
                                                           dram_only=dram_only),
                                  evicted_keys=evicted)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        stored = []
        for key in keys:
            slot = self._storing.pop(key, None)
            if slot is None:
                continue
            stored.append(key)
            if self._wb_storing:
                self._wb_storing.discard(key)
            if success and self._bad:
                self._bad.pop(key, None)  # freshly written: no longer a known-bad block
            written = self._wb_done.pop(key, 0)
            disk = self.disk_stores
            if self._dram_only:
                disk = disk and key not in self._dram_only
                self._dram_only.discard(key)
            behind = False
            if self._behind and key in self._behind:
                self._behind.discard(key)
                behind = True
            if slot >= 0:
                assert self.dram is not None
                if success:
                    self._retain(slot, key)
                    if self._unproven and self.dram.lookup(key) != slot:
                        self._unproven.discard(key)  # not kept in the tier after all
                    if behind and self.dram.lookup(key) == slot:
                        self._dirty[key] = None  # a file still to write, when there is room
                    # still being written to disk from this slot: keep it pinned
                    if (disk and written < self.n_ranks
                            and self.dram.lookup(key) == slot):
                        self.dram.pin(key, touch=False)
                        self._wb_pinned[key] = slot
                        if written:
                            self._wb_done[key] = written
                else:
                    self.dram.release(slot)
                    self._unproven.discard(key)
        if stored and success and self.dram is not None:
            # blocks retained just now are the most recent: restore the tail-first order
            # of the request's blocks (its head most recent)
            req_keys = self._req_keys.get(req_context.req_id)
            if req_keys is not None:
                self._touch_tail_first(req_keys, reuse=False)
        if self._events_on and stored and success:
            self._events.append(OffloadingEvent(stored, self.medium, False))

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        """Forget the DRAM tier (vLLM discards the in-flight jobs' completions and makes
        the workers wait for them before new jobs run). Files on disk are shared and
        persistent; they stay (remove them with ``kvcache gc`` or by deleting root_dir)."""
        if self._pos:
            self._pos.clear()
        if self.dram is not None:
            self.dram = SlotAllocator(self.n_dram, retain=True, policy=self._slot_policy)
            if self._admission is not None:
                self._admission = AdmissionDuel(self.n_dram)
        self._slot_key = [None] * self.n_dram
        self._req_keys.clear()
        self._storing.clear()
        self._dram_only.clear()
        self._behind.clear()
        self._dirty.clear()
        self._hot.clear()
        self._unproven.clear()
        self._wb_done.clear()
        self._wb_pinned.clear()
        self._wb_storing.clear()
        self._loading.clear()
        self.disk_loads_in_flight = 0
        self._disk_reqs.clear()
        self._reading.clear()
        self.load_epoch += 1  # what deferred or held lookups waited on is gone
        self._held.clear()
        self._loading_refs.clear()
        self._promoting.clear()
        self._promote_slot.clear()
        self._failed.clear()
        self._staged.clear()

    # ------------------------------------------------------------------ worker reports
    def on_worker_report(self, failed_keys: Iterable[bytes], counters: dict[str, int],
                         staged: Mapping[bytes, int] | None = None,
                         written: Mapping[bytes, int] | None = None,
                         observations: Mapping[str, list[float]] | None = None) -> None:
        """Failed chunk keys, counter deltas, preloaded keys (key -> number of ranks
        that staged it), written keys (key -> number of ranks whose disk write from
        the key's DRAM-tier slot ended) and job latencies (``JOB_HISTOGRAMS`` name ->
        seconds) from the workers (called by the connector before vLLM processes the
        same step's job completions)."""
        if observations:
            for name, vals in observations.items():
                if name in JOB_HISTOGRAMS:
                    pend = self._observations.setdefault(name, [])
                    pend.extend(vals)
                    if len(pend) > MAX_PENDING_OBSERVATIONS:
                        del pend[:len(pend) - MAX_PENDING_OBSERVATIONS]
        if written:
            self._on_written(written)
        if staged:
            self.load_epoch += 1
            until = time.monotonic() + STAGED_TTL_S
            for k, n in staged.items():
                if n >= self.n_ranks:
                    key = OffloadKey(k)
                    self._staged[key] = until
                    self._staged.move_to_end(key)
            while len(self._staged) > STAGED_MAX:
                self._staged.popitem(last=False)
        failed_keys = [OffloadKey(k) for k in failed_keys]
        if self._events_on and failed_keys:
            self._events.append(OffloadingEvent(failed_keys, self.medium, True))
        now = time.monotonic()
        for key in failed_keys:
            self.counters["load_failures"] += 1
            # A block that failed to load is a MISS for a while, even if its file is
            # still there (e.g. a device-copy failure): never a load/fail/recompute loop.
            self._bad[key] = now + BAD_KEY_TTL_S
            self._bad.move_to_end(key)
            if self._pos:
                self._pos.pop(key, None)
            self._staged.pop(key, None)
            if self._loading_refs.get(key):
                self._failed.add(key)
            else:
                self._drop(key)
        while len(self._bad) > BAD_KEYS_MAX:
            self._bad.popitem(last=False)
        if counters.get("reactor_dead") and self.healthy:
            log.error("py-kvcache: a worker's I/O reactor died; this engine recomputes every "
                      "prefix from now on (lookups miss, nothing is stored)")
        for name, v in counters.items():
            self.counters[name] += v
        self._maybe_export()

    def take_flush_plan(self) -> list[tuple[bytes, int]]:
        """Deferred write-back (scheduler thread, once per step, from the connector's
        ``build_connector_meta``): DRAM-tier blocks kept without a file while the write-back
        was full, oldest first (the next LRU victims), as many as the write-back has room
        for now (``writeback_max_fraction``). Each returned (key, slot) is pinned here like
        any write-back until every worker reports the key written (:meth:`_on_written`);
        the workers write the files from the slots (``PyKVCacheWorker.submit_flush``)."""
        dram = self.dram
        hot, dirty = self._hot, self._dirty if self._flush_on else None
        if dram is None or not (hot or dirty):
            return []
        if not (self.disk_stores and self.healthy):
            return []
        plan: list[tuple[bytes, int]] = []
        room = self._wb_cap() - len(self._wb_storing) - len(self._wb_pinned)
        n_hot = 0
        for queue in (hot, dirty):  # blocks shown reused first (disk_admission=reuse)
            while queue and room > 0:
                key, _ = queue.popitem(last=False)
                slot = dram.lookup(key)
                if slot < 0 or self._on_disk(key):
                    continue  # gone, or written meanwhile (another instance)
                dram.pin(key, touch=False)
                self._wb_pinned[key] = slot
                plan.append((bytes(key), slot))
                room -= 1
                n_hot += queue is hot
        self.counters["flushes_planned"] += len(plan)
        self.counters["flushes_reused"] += n_hot
        return plan

    def _seen_before(self, key: OffloadKey) -> bool:
        """disk_admission="reuse": whether ``key`` was stored before (within the
        doorkeeper's two generations); records it. Scheduler thread; O(1)."""
        h = hash(key)
        if h in self._seen or h in self._seen_old:
            return True
        if len(self._seen) >= SEEN_GENERATION:
            self._seen_old, self._seen = self._seen, self._seen_old
            self._seen.clear()
        self._seen.add(h)
        return False

    def _on_written(self, written: Mapping[bytes, int]) -> None:
        """Count the ranks that finished writing each key; unpin its DRAM slot once all
        did. A report may arrive before the job's ``complete_store`` (then it is kept
        until then); reports for keys neither storing nor pinned are stale (reset)."""
        dram = self.dram
        for k, n in written.items():
            key = OffloadKey(k)
            slot = self._wb_pinned.get(key)
            if slot is None:
                if key in self._storing:
                    self._wb_done[key] = self._wb_done.get(key, 0) + n
                continue
            done = self._wb_done.get(key, 0) + n
            if done < self.n_ranks:
                self._wb_done[key] = done
                continue
            self._wb_done.pop(key, None)
            del self._wb_pinned[key]
            if dram is not None:
                dram.unpin(slot)

    def _maybe_export(self) -> None:
        """Mark the counters for ``$KVCACHE_STATS_FILE`` (used by ``make run`` and the
        benchmarks; unset: no-op). Scheduler thread. The file is written by a daemon
        thread (:class:`_StatsExporter`, right after this call), never here:
        a file create + rename on vLLM's engine thread can wait for the filesystem's
        journal while the reactor writes KV files to the same disk. Readers that need
        the counters of a step wait for the file's mtime to pass it."""
        if self._exporter is None:
            path = os.environ.get("KVCACHE_STATS_FILE")
            if not path:
                return
            self._exporter = _StatsExporter(path, self.stats)
        self._exporter.kick()

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, int]:
        """Cumulative counters of this engine (manager + worker-reported), plus gauges."""
        out = {k: self.counters.get(k, 0) for k in (*MANAGER_COUNTERS, *WORKER_COUNTERS)}
        out.update(self.extra_counters)
        out.update(self.gauges())
        return out

    def gauges(self) -> dict[str, int]:
        """Current values of :data:`MANAGER_GAUGES` (scheduler thread)."""
        return {"healthy": int(self.healthy), "dram_slots": self.n_dram,
                "dram_cached": self.dram.cached if self.dram is not None else 0,
                "dram_writeback_pinned": len(self._wb_pinned),
                "dram_unwritten": len(self._dirty),
                "stores_in_flight": len(self._storing),
                "loads_in_flight": len(self._loading) + sum(
                    len(held) for _rid, held in self._held.values()),
                "disk_bytes": self.counters.get("disk_bytes", 0),
                "dram_admission_active": int(self._admission is not None
                                             and self._admission.active)}

    def get_stats(self) -> OffloadingConnectorStats | None:
        """Counter deltas since the last call and the gauges when any changed (vLLM calls
        this only with stats logging on; they become ``vllm:pykvcache_<name>`` Prometheus
        counters and gauges). None when nothing changed."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        delta = {}
        sig = (tuple(self.counters.values()), tuple(self.extra_counters.values()))
        if sig != self._stats_sig:  # per step: most steps change no counter
            self._stats_sig = sig
            for k, v in (*self.counters.items(), *self.extra_counters.items()):
                if k in MANAGER_GAUGES:  # reported by the workers as deltas, shown as gauges
                    continue
                d = v - self._reported.get(k, 0)
                if d:
                    delta[k] = d
                    self._reported[k] = v
        gauges = self.gauges()
        if gauges == self._reported_gauges:
            gauges = {}
        else:
            self._reported_gauges = gauges
        obs, self._observations = self._observations, {}
        if not delta and not gauges and not obs:
            return None
        st = OffloadingConnectorStats()
        for k, d in delta.items():
            st.increase_counter(METRIC_PREFIX + k, d)
        for k, g in gauges.items():
            st.set_gauge(METRIC_PREFIX + k, g)
        for k, vals in obs.items():
            for v in vals:
                st.observe_histogram(METRIC_PREFIX + k + "_seconds", v)
        return st

    def start_warm(self) -> None:
        """``disk_warm_start``: read the cache directory's metadata (every rank's
        namespace directory) into the kernel's caches on a daemon thread, so that the
        first lookups after a restart or ``drop_caches`` do not read it from a busy disk
        on the engine's main thread (:mod:`kvcache_core.warm`). Idempotent; returns at
        once. Scheduler thread (construction)."""
        if self._warmer is None:
            self._warmer = DirWarmer([d.base for d in self.disk], self._warm_done)

    def _warm_done(self, files: int, dirs: int, errors: int, us: int) -> None:
        """The warm-up's end (its own thread): single counter assignments."""
        c = self.counters
        c["warm_files"], c["warm_dirs"], c["warm_errors"], c["warm_us"] = (
            files, dirs, errors, us)
        log.info("py-kvcache: start-up warm-up read the metadata of %d cached files in "
                 "%d directories in %.2f s%s (disk_warm_start)", files, dirs, us / 1e6,
                 f", {errors} unreadable directories skipped" if errors else "")

    def shutdown(self) -> None:
        if self._warmer is not None:
            self._warmer.close()
        if self._checker is not None:
            self._checker.close()
        self._maybe_export()
        if self._exporter is not None:
            self._exporter.close()  # the final counters are written before returning
        s = self.stats()
        log.info("py-kvcache: scheduler stats: %s",
                 " ".join(f"{k}={v}" for k, v in s.items() if v))
