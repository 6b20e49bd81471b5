"""Worker side: :class:`PyKVCacheWorker` (vLLM's ``OffloadingWorker``).

One per vLLM worker process (one per TP rank). Threads:

* vLLM's model-runner thread calls :meth:`submit_store`, :meth:`submit_load`,
  :meth:`get_finished`, :meth:`wait`, :meth:`take_invalid_block_ids`,
  :meth:`take_report` and :meth:`shutdown`. Those only talk to the reactor through its
  client API and read completed state.
* The reactor thread (``kvcache_core.reactor``) does all I/O and every copy (through
  :class:`~kvcache_core.vllm.transfer.KVCopier`); it only notifies this object.

Slots: the reactor's pool is ``n_staging`` reactor-managed staging slots followed by
``n_dram`` DRAM-tier slots whose index lives in the scheduler's
:class:`~kvcache_core.vllm.manager.PyKVCacheManager`. A DRAM slot named in a job belongs to
that job (reactor side) until the job completes; then the worker may zero the header of
a slot whose load failed, so an invalid slot can never be served as a DRAM hit.

Store jobs are reported to vLLM when their device copies are done (the reactor's
``early_store_ack``), and those copies never wait for the disk (``store_policy="drop"``):
a chunk goes into its DRAM-tier slot (the write-back buffer) or a staging slot free right
now, else it is dropped and counted (``stores_dropped_backpressure``). vLLM then may
reuse the GPU blocks while the files are still being written. The scheduler keeps a
DRAM-tier slot pinned until this worker reports its key written (:meth:`take_written`),
so it never hands that slot to another key meanwhile (the reactor would make that task
wait; ``ext_slot_waits`` counts it, 0 in normal operation). A key whose write later
fails or is dropped is simply not on disk (a later lookup misses).

DRAM hits: a load job whose chunks are ALL in the DRAM tier (vLLM's job for a request
whose prefix is DRAM-resident) does not go through the reactor: this thread checks each
slot's header and issues ONE batched device copy on its own stream
(:meth:`KVCopier.load_direct`), and :meth:`get_finished` reports the job once that copy's
event has completed, as vLLM's native CPU offload does. No thread hop, no per-chunk
reactor task. Jobs that need the disk for any chunk go through the reactor.

Failures: vLLM asserts that every ``TransferResult`` succeeds, so every job is reported
successful; the GPU blocks of chunks that failed to load are reported through
:meth:`take_invalid_block_ids` (the connector's ``get_block_ids_with_load_errors``) in
the same engine step, so vLLM recomputes them, and their keys go to the scheduler in the
worker metadata. A dropped store (disk full, capacity bound, write error) is counted.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from ..config import StorageConfig, write_depth_reading_of
from ..flags import AFTER_LOAD, FLUSH, IN_SLOT, NO_DISK
from ..layout import Layout, Namespace
from ..reactor import Completion, Item, Reactor
from ..staging import Priority
from .job_specs import PyKVLoadSpec, PyKVStoreSpec
from .options import PoolGeometry
from .transfer import ChunkRef, KVCopier, KVGeometry

log = logging.getLogger("vllm.pykvcache")


#: job latencies kept for the scheduler between two reports, per histogram
MAX_PENDING_OBSERVATIONS = 4096
#: :meth:`PyKVCacheWorker.take_report` rebuilds the counter snapshot when something
#: happened since its last one, and at least this often (diagnostic timings and the
#: evictor's counters move without I/O activity)
REPORT_MAX_GAP_S = 1.0


@dataclass
class _Job:
    is_load: bool
    refs: list[ChunkRef]
    dram_slots: list[int]
    gpu_bytes: int
    t0: float = field(default_factory=time.perf_counter)
    #: latency histogram this job is observed in (JOB_HISTOGRAMS)
    hist: str = "store"


class PyKVCacheWorker(OffloadingWorker):
    """Moves chunks between vLLM's KV cache and the cache files (see module doc)."""

    def __init__(self, kv_caches: CanonicalKVCaches, *, storage: StorageConfig,
                 namespace: Namespace, pool: PoolGeometry, blocks_per_chunk: int,
                 max_disk_bytes: int, rank: int = 0,
                 integrity_key: bytes | None = None) -> None:
        self.kv = KVGeometry(kv_caches.tensors, kv_caches.group_data_refs, blocks_per_chunk)
        if self.kv.max_payload > namespace.block_bytes:
            raise RuntimeError(
                f"py-kvcache: the KV tensors need {self.kv.max_payload} bytes per storage "
                f"block but vLLM's worker_kv_bytes_per_block gives {namespace.block_bytes} "
                f"({self.kv.describe()})")
        self.rank = rank
        self.n_staging = pool.n_staging
        self.n_dram = pool.n_dram
        self.is_cuda = self.kv.device.type == "cuda"
        self.layout = Layout(storage.root_dir, namespace, max_disk_bytes=max_disk_bytes,
                             durable=storage.durable, dir_mode=storage.dir_mode,
                             file_mode=storage.file_mode,
                             allow_foreign_root=storage.allow_foreign_root,
                             publish_method=storage.publish_method,
                             integrity_key=integrity_key)
        try:
            self.reactor = Reactor(
                self.layout, n_slots=pool.n_staging, external_slots=pool.n_dram,
                io_depth=storage.io_depth, lookahead=storage.lookahead,
                engine=storage.engine, direct_io=storage.direct_io,
                io_async=storage.io_async,
                copier=functools.partial(KVCopier, geometry=self.kv, layout=self.layout,
                                         n_staging=pool.n_staging),
                verify=storage.verify_checksum, on_complete=self._on_complete,
                name=f"kvcache-reactor-r{rank}",
                trace=bool(os.environ.get("KVCACHE_TRACE")), early_store_ack=True,
                store_policy="drop", io_timeout_s=storage.io_timeout_s,
                switch_interval=storage.switch_interval_s or None,
                switch_interval_scope=storage.switch_interval_scope,
                store_copy_wait=storage.store_copy_wait,
                writeback_defer_s=float(storage.writeback_defer_s),
                spec_depth=storage.preload_depth,
                preload_keep_s=float(storage.preload_keep_s),
                write_depth_reading=write_depth_reading_of(storage))
        except BaseException:
            self.layout.close()
            raise
        self._jobs: dict[int, _Job] = {}
        #: the reactor thread counts as stuck when it has work and its loop has not turned
        #: for this long (2 x io_timeout_s; 0: no watchdog); see :meth:`_watchdog`
        self.watchdog_s = 2.0 * storage.io_timeout_s
        #: the reactor's copier; :meth:`KVCopier.load_direct` (with ``done``, ``sync``,
        #: ``fence`` and ``copy_ms`` on its handles) is what this (model-runner) thread
        #: may call
        self.copier: KVCopier = self.reactor.copier  # type: ignore[assignment]
        if self.reactor.trace is not None:
            self.copier.time_direct = True  # diagnostics: DRAM-hit copies' GPU time
        self.copier.set_direct_copy(storage.dram_load_copy)  # "dma" without CUDA
        self.copier.set_store_copy(storage.store_copy)  # before any store: none yet
        #: diagnostics (env KVCACHE_VERIFY_DIRECT=1): each finished DRAM-hit copy is
        #: spot-checked against the pool (counters direct_verified / direct_verify_failed)
        self._verify_ops: dict[int, Any] | None = None
        if os.environ.get("KVCACHE_VERIFY_DIRECT") == "1":
            self.copier.verify_direct = True
            self._verify_ops = {}
        #: load jobs served entirely from the DRAM tier: job id -> copy handle
        self._direct: dict[int, Any] = {}
        #: synchronous load jobs (``dram_load_sync``) not yet finished, and the finished
        #: ones not yet reported (:meth:`make_sync`, :meth:`take_sync_done`)
        self._sync: set[int] = set()
        self._sync_done: list[int] = []
        #: serve all-DRAM load jobs on this thread (False: through the reactor; tests)
        self.direct_dram = os.environ.get("KVCACHE_DIRECT_DRAM", "1") != "0"
        self._results: list[TransferResult] = []
        self._observations: dict[str, list[float]] = {}
        self._invalid: set[int] = set()
        self._failed_keys: set[bytes] = set()
        self._cv = threading.Condition()
        self._gen = 0
        self.counters: collections.Counter[str] = collections.Counter()
        self._reported: dict[str, int] = {}
        #: activity signature and deadline of the last snapshot (take_report)
        self._report_sig: tuple[int, float, int, int] = (-1, -1.0, -1, -1)
        self._report_due = 0.0
        self._closed = False
        self._preload_seq = 0
        #: preload request id -> its keys, until the reactor reports it
        self._preloads: dict[tuple[str, int], list[bytes]] = {}
        #: keys a preload staged since the last :meth:`take_staged`
        self._staged_keys: list[bytes] = []
        #: store job id -> keys it copied into DRAM-tier slots and writes to disk from
        #: there, until the job's files are all written (or dropped)
        #: (and ("flush", n) -> keys of a :meth:`submit_flush`)
        self._writeback: dict[Any, list[bytes]] = {}
        #: keys whose write-back from a DRAM-tier slot ended since :meth:`take_written`
        self._written_keys: list[bytes] = []
        # Diagnostics (model-runner thread only): seconds this thread spent inside our
        # calls, and the submit -> completion latency of load jobs. Plain float adds.
        self.timing = {"main_submit_store_s": 0.0, "main_submit_load_s": 0.0,
                       "main_get_finished_s": 0.0, "load_job_latency_sum_s": 0.0,
                       "load_job_latency_max_s": 0.0, "load_jobs": 0, "main_wait_s": 0.0,
                       "main_wait_calls": 0}
        log.info("py-kvcache worker rank %d: %s, engine %s, O_DIRECT %s, %d staging + %d DRAM "
                 "slots of %d B, KV %s", rank, self.layout.base, self.reactor.engine.name,
                 self.reactor.direct, pool.n_staging, pool.n_dram, pool.slot_bytes,
                 self.kv.describe())

    # ------------------------------------------------------------------ reactor thread
    def _on_complete(self, c: Completion) -> None:
        with self._cv:
            self._gen += 1
            self._cv.notify_all()

    # ------------------------------------------------------------------ submit
    def _gpu_bytes(self, refs: list[ChunkRef]) -> int:
        return sum(len(r.gpu_ids) * self.kv.groups[r.group].gpu_block_bytes for r in refs)

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        """Queue a GPU -> storage job (vLLM's step N store, submitted at step N+1)."""
        assert isinstance(dst_spec, PyKVStoreSpec), type(dst_spec)
        t0 = time.perf_counter()
        refs = self.kv.split(src_spec, dst_spec.keys)
        if self.is_cuda:  # pragma: no cover - needs CUDA
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.kv.device))
            for r in refs:
                r.after = ev
        items = []
        writes = dst_spec.writes_file
        wb = []
        for i, (ref, slot) in enumerate(zip(refs, dst_spec.dram_slots, strict=True)):
            ext = self.n_staging + slot if slot >= 0 else -1
            flag = 0 if writes(i) else NO_DISK
            items.append(Item(ref.key, ref, self.kv.payload_bytes(ref.group), ext, flag))
            if slot >= 0 and not flag:
                wb.append(dst_spec.keys[i])
        self._jobs[job_id] = _Job(False, refs, list(dst_spec.dram_slots), self._gpu_bytes(refs))
        if wb:
            self._writeback[job_id] = wb
        self.reactor.store(job_id, items)
        self.timing["main_submit_store_s"] += time.perf_counter() - t0
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    dst_spec: GPULoadStoreSpec) -> bool:
        """Queue a storage -> GPU job (DRAM hits skip the disk; see PyKVLoadSpec)."""
        assert isinstance(src_spec, PyKVLoadSpec), type(src_spec)
        t0 = time.perf_counter()
        refs = self.kv.split(dst_spec, src_spec.keys)
        # AFTER_LOAD chunks wait in the reactor for a promotion still reading their slot
        all_dram = all(f & IN_SLOT and not f & AFTER_LOAD for f in src_spec.flags)
        if self.direct_dram and refs and all_dram:
            # every chunk is a DRAM hit: no disk, so no reactor either (see module doc)
            for ref in refs:
                ref.check_header = True
            slots = [self.n_staging + s for s in src_spec.dram_slots]
            self._jobs[job_id] = _Job(True, refs, list(src_spec.dram_slots),
                                      self._gpu_bytes(refs), t0, "load_dram")
            self.reactor.note_foreground()
            self.reactor.trace_event("direct_load", job_id, len(refs))
            self._direct[job_id] = self.copier.load_direct(slots, refs)
            if self._verify_ops is not None and self.copier.last_ops is not None:
                self._verify_ops[job_id] = self.copier.last_ops
                self.copier.last_ops = None
            dt = time.perf_counter() - t0
            self.timing["main_submit_load_s"] += dt
            if self.reactor.trace is not None:  # diagnostics: how long the issue held us
                self.reactor.trace_event("direct_issued", job_id, int(dt * 1e6))
                self.reactor.trace_event("direct_ops", job_id, self.copier.last_direct_ops)
            return True
        items = []
        for ref, slot, flag in zip(refs, src_spec.dram_slots, src_spec.flags, strict=True):
            ext = self.n_staging + slot if slot >= 0 else -1
            if flag & IN_SLOT:
                ref.check_header = True
            items.append(Item(ref.key, ref, self.kv.payload_bytes(ref.group), ext,
                          flag if slot >= 0 else 0))
        self._jobs[job_id] = _Job(True, refs, list(src_spec.dram_slots), self._gpu_bytes(refs),
                                  t0, "load_dram" if all_dram else "load_disk")
        self.reactor.load(job_id, items)
        self.timing["main_submit_load_s"] += time.perf_counter() - t0
        return True

    def make_sync(self, job_id: int) -> None:
        """Load job ``job_id`` (submitted this step) is synchronous (``dram_load_sync``):
        the forward pass that follows must see its blocks. A direct DRAM job's copy is
        fenced on the GPU (the compute stream waits for it; on the CPU the copy is
        already done); a job that went through the reactor is waited for here. Its
        result is reported by :meth:`take_sync_done`, never by :meth:`get_finished`
        (model-runner thread)."""
        self._sync.add(job_id)
        if job_id in self._direct:
            self.copier.fence(self._direct[job_id])
        elif job_id in self._jobs:
            self.wait({job_id})

    def take_sync_done(self) -> list[int]:
        """Synchronous load jobs finished since the last call (model-runner thread)."""
        out, self._sync_done = self._sync_done, []
        return out

    def submit_preloads(self, keys: list[bytes]) -> None:
        """Start speculative disk -> staging reads of ``keys`` (model-runner thread).

        Preloads are not vLLM jobs: their completions never reach :meth:`get_finished`
        (vLLM raises on unknown job ids). The reactor runs ONE at a time, below foreground
        work, in staging slots above the foreground reservation; an on-demand load of the
        same key later claims the staged slot or joins the read in flight.
        """
        if not keys:
            return
        self._preload_seq += 1
        rid = ("preload", self._preload_seq)
        self._preloads[rid] = keys
        self.reactor.load(rid, [Item(k, None, 0) for k in keys], Priority.SPECULATIVE)

    def submit_flush(self, items: list[tuple[bytes, int]]) -> None:
        """Write files for DRAM-tier blocks that were stored without one (model-runner
        thread): ``items`` = [(key, DRAM-tier slot)], planned by the scheduler when its
        write-back had room again. The scheduler keeps each slot pinned until this worker
        reports the key in :meth:`take_written` (whatever the outcome), so the bytes do not
        change while the file is written from them. Not a vLLM job: no completion reaches
        :meth:`get_finished`."""
        if not items:
            return
        self._preload_seq += 1
        rid = ("flush", self._preload_seq)
        self._writeback[rid] = [k for k, _ in items]
        self.reactor.store(rid, [Item(k, None, 0, self.n_staging + slot, FLUSH)
                                 for k, slot in items])

    # ------------------------------------------------------------------ completions
    def _drain(self) -> None:
        if self._direct:
            self._drain_direct()
        for c in self.reactor.poll():
            if c.kind == "store":  # every file of the job written (or dropped)
                wb = self._writeback.pop(c.req_id, None)
                if wb:
                    self._written_keys.extend(wb)
            job = self._jobs.pop(c.req_id, None)
            if job is None:  # a preload, or the final "store" of a job acknowledged early
                keys = self._preloads.pop(c.req_id, None)
                if keys is not None:
                    self._staged_keys.extend(k for k, ok in zip(keys, c.ok, strict=True)
                                             if ok)
                continue
            if job.is_load:
                self._load_done(job, c.ok)
            dt = time.perf_counter() - job.t0
            self._results.append(TransferResult(c.req_id, True, job.gpu_bytes, dt))
            self._observe(job.hist, dt)

    def _load_done(self, job: _Job, ok: list[bool] | None) -> None:
        """Counters and failure bookkeeping of a finished load job (``ok`` per chunk from
        the reactor; None: the direct DRAM path, where only ``ref.failed`` tells)."""
        lat = time.perf_counter() - job.t0
        tm = self.timing
        tm["load_jobs"] += 1
        tm["load_job_latency_sum_s"] += lat
        if lat > tm["load_job_latency_max_s"]:
            tm["load_job_latency_max_s"] = lat
        for i, ref in enumerate(job.refs):
            slot = job.dram_slots[i]
            if (ok is None or ok[i]) and not ref.failed:
                self.counters["chunks_loaded_dram" if ref.check_header
                              else "chunks_loaded_disk"] += 1
                continue
            self.counters["chunks_failed"] += 1
            if ref.check_header:
                self.counters["dram_invalid"] += 1
            self._invalid.update(int(b) for b in ref.gpu_ids)
            self._failed_keys.add(bytes(ref.key))
            if slot >= 0:  # never serve this slot's bytes again
                self.reactor.pool.views[self.n_staging + slot][:8] = bytes(8)

    def _drain_direct(self) -> None:
        """Finish the direct DRAM-hit jobs whose device copy is done (worker thread)."""
        done = [j for j, h in self._direct.items() if self.copier.done(h)]
        for j in done:
            h = self._direct.pop(j)
            self.reactor.trace_event("direct_done", j)
            if self.reactor.trace is not None:  # diagnostics: the copy's own GPU time
                ms = self.copier.copy_ms(h)
                if ms is not None:
                    self.reactor.trace_event("direct_copy", j, int(ms * 1e3))
            job = self._jobs.pop(j)
            self._load_done(job, None)
            if self._verify_ops is not None:
                self._verify(j, self._verify_ops.pop(j, None))
            dt = time.perf_counter() - job.t0
            self._results.append(TransferResult(j, True, job.gpu_bytes, dt))
            self._observe(job.hist, dt)

    def _verify(self, job_id: int, ops: Any) -> None:
        """Diagnostics (KVCACHE_VERIFY_DIRECT=1): spot-check a finished direct copy whose
        descriptors were ``ops`` (None: nothing was copied)."""
        if ops is None:
            return
        bad = self.copier.check_copy(ops)
        self.counters["direct_verified"] += 1
        if bad:
            self.counters["direct_verify_failed"] += 1
            log.error("py-kvcache: DRAM-hit job %d: %d sampled copy descriptors differ from "
                      "the pool after the copy (dram_load_copy=%s)", job_id, bad,
                      self.copier.direct_copy)

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call (all reported successful; see module doc)."""
        t0 = time.perf_counter()
        if self.reactor.trace is not None:
            self.reactor.trace_event("fwd_end")  # diagnostics: vLLM calls this per step
        if self.watchdog_s and self._jobs:
            self._watchdog()
        sync = self._sync
        if sync:  # done within this step: their chunk failures are reported in it too
            for j in sync:
                h = self._direct.get(j)
                if h is not None:
                    self.copier.sync(h)
        self._drain()
        out, self._results = self._results, []
        if sync:
            keep = []
            for r in out:
                if r.job_id in sync:
                    sync.discard(r.job_id)
                    self._sync_done.append(r.job_id)
                else:
                    keep.append(r)
            out = keep
        self.timing["main_get_finished_s"] += time.perf_counter() - t0
        return out

    def wait(self, job_ids: set[int]) -> None:
        """Block until the given jobs have completed; their results stay queued for
        :meth:`get_finished`, as do any other completions seen meanwhile."""
        t0 = time.perf_counter()
        self.timing["main_wait_calls"] += 1
        try:
            while True:
                for j in job_ids:
                    h = self._direct.get(j)
                    if h is not None:
                        self.copier.sync(h)
                with self._cv:
                    gen = self._gen
                if self.watchdog_s:
                    self._watchdog()  # a stuck reactor must not hang vLLM's flush either
                self._drain()
                if not any(j in self._jobs for j in job_ids):
                    return
                with self._cv:
                    self._cv.wait_for(functools.partial(self._moved, gen), timeout=1.0)
        finally:
            self.timing["main_wait_s"] += time.perf_counter() - t0

    def _watchdog(self) -> None:
        """Model-runner thread, every step with jobs in flight: if the reactor has work and
        its loop has not turned for ``watchdog_s`` (its thread is stuck inside a
        synchronous call on a hung filesystem: per-operation deadlines cannot fire), give
        it up (:meth:`Reactor.declare_stalled`: no device copy after that) and finish every
        job still in flight here: loads with all chunks failed (vLLM recomputes them),
        stores as done (their blocks are simply not cached). From then on this engine is
        recompute-only, as after a reactor death."""
        r = self.reactor
        if r.dead is not None:
            return
        idle = r.stalled_for()
        if idle <= self.watchdog_s:
            return
        if not r.declare_stalled(f"the I/O reactor made no progress for {idle:.0f} s "
                                 f"with {r.outstanding} requests in flight"):
            return
        self.counters["reactor_stalled"] += 1
        for job_id in [j for j in self._jobs if j not in self._direct]:
            job = self._jobs.pop(job_id)
            if job.is_load:
                self._load_done(job, [False] * len(job.refs))
            wb = self._writeback.pop(job_id, None)
            if wb:  # unpins their DRAM slots in the scheduler (no file will come)
                self._written_keys.extend(wb)
            self._results.append(TransferResult(job_id, True, job.gpu_bytes,
                                                time.perf_counter() - job.t0))
        for rid in [r for r in self._writeback if isinstance(r, tuple)]:  # flushes
            self._written_keys.extend(self._writeback.pop(rid))
        self._preloads.clear()

    def _moved(self, gen: int) -> bool:
        return self._gen != gen

    def take_invalid_block_ids(self) -> set[int]:
        """GPU block ids of chunks that failed to load since the last call."""
        out, self._invalid = self._invalid, set()
        return out

    def _snapshot(self) -> dict[str, int]:
        s, ls = self.reactor.stats, self.layout.stats
        snap = dict(self.counters)
        snap.update(files_corrupt=s.loads_corrupt, files_missing=s.loads_miss,
                    load_errors=s.loads_error, stores_written=s.stores_ok,
                    stores_existing=s.stores_existing,
                    stores_dropped_enospc=s.stores_dropped_enospc,
                    stores_dropped_capacity=s.stores_dropped_capacity,
                    stores_dropped_backpressure=s.stores_dropped_backpressure,
                    ext_slot_waits=s.ext_slot_waits, ops_expired=s.ops_expired,
                    items_expired=s.items_expired, symlinks_skipped=ls.symlinks_skipped,
                    store_errors=s.stores_error, bytes_read=s.bytes_read,
                    disk_reads_repeat=s.disk_reads_repeat,
                    bytes_written=s.bytes_written, disk_evicted_files=ls.evicted_files,
                    disk_ledger_reattached=ls.ledger_reattached,
                    preloads_staged=s.preload_staged, preloads_claimed=s.preload_claimed,
                    preloads_joined=s.preload_joined, preloads_deduped=s.preload_deduped,
                    loads_joined=s.loads_joined, preloads_wasted=s.preload_wasted,
                    preloads_dropped_full=s.preload_dropped_full,
                    stores_flushed=s.stores_flushed, flushes_invalid=s.flushes_invalid,
                    preloads_requeued=s.spec_requeued,
                    # vLLM blocked in wait() (jobs_to_flush: a freed GPU block with a
                    # store in flight was reused): how often and how long in total
                    worker_waits=self.timing["main_wait_calls"],
                    worker_wait_us=int(self.timing["main_wait_s"] * 1e6),
                    # where a server with a connector but no hits may lose time: vLLM's
                    # engine thread inside our hooks, the reactor's wake-ups and work
                    worker_main_us=int(1e6 * (self.timing["main_submit_store_s"]
                                              + self.timing["main_submit_load_s"]
                                              + self.timing["main_get_finished_s"]
                                              + self.timing["main_wait_s"])),
                    reactor_iterations=self.reactor.timing["iterations"],
                    reactor_step_us=int(self.reactor.timing["step_s"] * 1e6),
                    # a gauge sent as deltas (the scheduler sums them: total over ranks)
                    disk_bytes=self.layout.ledger.last)
        return snap

    def _check_health(self) -> None:
        """Once the reactor thread has died: one error through vLLM's logger and the
        ``reactor_dead`` counter, which turns the scheduler recompute-only."""
        if self.reactor.dead is not None and not self.counters["reactor_dead"]:
            self.counters["reactor_dead"] = 1
            log.error("py-kvcache worker rank %d: the I/O reactor died (%s); this engine "
                      "now recomputes every prefix (lookups miss, nothing is stored); "
                      "requests keep being served", self.rank, self.reactor.dead)

    def take_report(self) -> tuple[set[bytes], dict[str, int]]:
        """(keys that failed to load, counter deltas) since the last call, for the
        scheduler (sent in the connector's worker metadata)."""
        self._check_health()
        failed, self._failed_keys = self._failed_keys, set()
        # Once per engine step: skip the ~40-counter snapshot when nothing moved. The
        # reactor adds to ``step_s`` at the END of each loop iteration, so a snapshot
        # taken in the middle of one is followed by another after it.
        rt = self.reactor.timing
        sig = (rt["iterations"], rt["step_s"], sum(self.counters.values()),
               self.timing["main_wait_calls"])
        now = time.monotonic()
        if not failed and sig == self._report_sig and now < self._report_due:
            return failed, {}
        self._report_sig, self._report_due = sig, now + REPORT_MAX_GAP_S
        delta = {}
        for k, v in self._snapshot().items():
            d = v - self._reported.get(k, 0)
            if d:
                delta[k] = d
                self._reported[k] = v
        return failed, delta

    def _observe(self, name: str, seconds: float) -> None:
        """One job latency for the scheduler's histograms (bounded: if nobody takes them,
        e.g. a test, the oldest half is dropped)."""
        obs = self._observations.setdefault(name, [])
        obs.append(seconds)
        if len(obs) > MAX_PENDING_OBSERVATIONS:
            del obs[:MAX_PENDING_OBSERVATIONS // 2]

    def take_observations(self) -> dict[str, list[float]]:
        """Job latencies (histogram name -> seconds) since the last call: a store job
        from submission to its acknowledgement (device copy done), a load job from
        submission until its chunks are on the device, by source tier (``load_dram``: all
        chunks DRAM-tier hits; ``load_disk``: any chunk read from disk or staging)."""
        out, self._observations = self._observations, {}
        return out

    def take_staged(self) -> list[bytes]:
        """Keys that preloads staged (or found already staged) since the last call, for
        the scheduler's queue-aware gate (sent in the connector's worker metadata)."""
        out, self._staged_keys = self._staged_keys, []
        return out

    def take_written(self) -> list[bytes]:
        """Keys whose disk write from a DRAM-tier slot ended (published, or dropped) since
        the last call, for the scheduler: it keeps such a slot pinned until then, so a
        slot is never handed to another key while its file is being written from it."""
        out, self._written_keys = self._written_keys, []
        return out

    def stats(self) -> dict[str, Any]:
        """Cumulative counters of this worker plus the reactor's snapshot."""
        return {**self._snapshot(), "reactor": self.reactor.snapshot()}

    def _direct_timing(self) -> dict[str, float]:
        """The copier's :meth:`~kvcache_core.vllm.transfer.KVCopier.load_direct` phases
        (model-runner thread seconds), for the exported timing."""
        dt = self.copier.direct_timing
        return {"direct_validate_s": dt[0], "direct_ops_s": dt[1], "direct_issue_s": dt[2],
                "direct_issue_max_s": dt[3],
                "direct_kernel_jobs": self.copier.direct_kernel_jobs,
                "store_kernel_jobs": self.copier.store_kernel_jobs}

    def _export(self, snap: dict[str, int]) -> None:
        """Append this worker's final counters and staging high-water mark as one JSON line
        to ``$KVCACHE_STATS_FILE.workers.jsonl`` (benchmarks read it)."""
        path = os.environ.get("KVCACHE_STATS_FILE")
        if not path:
            return
        r = self.reactor
        line = {**snap, "rank": self.rank, "peak_staging_bytes": r.alloc.peak_busy * r.slot_bytes,
                "staging_budget_bytes": r.n_staging * r.slot_bytes,
                "pool_bytes": r.pool.nbytes if r.pool.views else 0, "engine": r.engine.name,
                "direct_io": r.direct, "timing": {**self.timing, **self._direct_timing()},
                "reactor_timing": dict(r.timing)}
        try:
            with open(f"{path}.workers.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as e:
            log.warning("py-kvcache: cannot write %s.workers.jsonl: %s", path, e)

    def _dump_trace(self) -> None:
        """Write the reactor's event trace to ``$KVCACHE_TRACE.r<rank>.<pid>.json``
        (diagnostics: [monotonic time, event, job id, n] rows; job ids are vLLM's)."""
        base, tr = os.environ.get("KVCACHE_TRACE"), self.reactor.trace
        if not base or tr is None:
            return
        rows = [[t, ev, rid if isinstance(rid, (int, str)) or rid is None else str(rid), n]
                for t, ev, rid, n in tr]
        try:
            with open(f"{base}.r{self.rank}.{os.getpid()}.json", "w") as f:
                json.dump(rows, f)
        except OSError as e:
            log.warning("py-kvcache: cannot write the trace: %s", e)

    def shutdown(self) -> None:
        """Finish in-flight I/O (stores already submitted are completed), stop the
        reactor, release the namespace's writer lock."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.reactor.dead is None:  # a given-up reactor may never finish its work
                self.reactor.wait(timeout=120)
            self._drain()
            self.reactor.close()
        finally:
            self.layout.close()
        snap = self._snapshot()
        self._export(snap)
        self._dump_trace()
        log.info("py-kvcache worker rank %d stats: %s", self.rank,
                 " ".join(f"{k}={v}" for k, v in sorted(snap.items()) if v))
