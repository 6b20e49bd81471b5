"""What the connector's two roles send each other once per engine step.

* Scheduler -> workers: :class:`PyKVCacheConnectorMetadata`, vLLM's
  ``OffloadingConnectorMetadata`` (the step's load and store jobs) plus the disk blocks
  planned for preload and the deferred write-backs. Built by the scheduler thread of the
  engine-core process (``SchedulerSide.build_connector_meta`` of
  :mod:`~kvcache_core.vllm.connector_scheduler`) only in steps that carry a plan; other
  steps send vLLM's own metadata unchanged.
* Workers -> scheduler: :class:`PyKVCacheWorkerMetadata`, vLLM's
  ``OffloadingWorkerMetadata`` (completed jobs) plus the keys whose load failed, the
  workers' counter deltas, staged and written keys and job latencies. Built by each
  worker's model-runner thread (``WorkerSide.build_connector_worker_meta`` of
  :mod:`~kvcache_core.vllm.connector_worker`), aggregated over the TP workers by vLLM,
  read by the scheduler thread.

Both are module-level dataclasses: vLLM pickles them between processes in multiprocess
mode (and hands the same object over in-process). Their vLLM bases are identical
dataclasses in vLLM 0.26 and 0.32 (``offloading/common.py``), so no
:mod:`~kvcache_core.vllm.compat` adapter is needed; the scheduler metadata copies its
base's fields by name (:data:`_BASE_FIELDS`), whatever they are in the running release.
This module imports nothing of either role's implementation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)

#: the constructor fields of vLLM's scheduler metadata (``load_jobs``, ``store_jobs``,
#: ``jobs_to_flush`` in 0.26 and 0.32), read once at import
_BASE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(OffloadingConnectorMetadata)
                                      if f.init)


@dataclass
class PyKVCacheConnectorMetadata(OffloadingConnectorMetadata):
    """vLLM's scheduler -> worker metadata plus this step's preloads and flushes.

    ``preload``: disk blocks (chunk keys) of waiting requests to read ahead into the
    workers' staging slots (the patched scheduler's ``on_preload_candidates``).
    ``flush``: deferred write-backs, (key, DRAM-tier slot) pairs whose files the workers
    write from the slot (:meth:`PyKVCacheManager.take_flush_plan
    <kvcache_core.vllm.manager.PyKVCacheManager.take_flush_plan>`).
    ``sync_loads``: this step's load jobs that the scheduler made synchronous
    (``dram_load_sync``): every chunk in the DRAM tier, the request computes in this same
    step, so each worker orders its forward pass after the copy and reports the job in
    ``sync_done``, not to vLLM (whose scheduler already counts it complete).
    ``preloads_started``: set by the worker that started them, so that the two callers
    of ``start_preloads`` in one step (the patched model runner, then ``start_load_kv``)
    start them once; False in every copy the scheduler sends.
    """

    preload: list[bytes] = field(default_factory=list)
    flush: list[tuple[bytes, int]] = field(default_factory=list)
    sync_loads: list[int] = field(default_factory=list)
    preloads_started: bool = False

    @classmethod
    def extend(cls, base: OffloadingConnectorMetadata, preload: list[bytes],
               flush: list[tuple[bytes, int]], sync_loads: list[int] | None = None
               ) -> PyKVCacheConnectorMetadata:
        """``base`` (the metadata vLLM's connector built for this step, whose jobs it
        still tracks) with ``preload``, ``flush`` and ``sync_loads`` added. The job dicts
        are shared, not copied."""
        return cls(**{name: getattr(base, name) for name in _BASE_FIELDS},
                   preload=preload, flush=flush, sync_loads=list(sync_loads or ()))


@dataclass
class PyKVCacheWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker -> scheduler metadata plus failed keys and counter deltas.

    ``aggregate`` (vLLM's KVOutputAggregator, across TP workers) unions the failed keys
    and sums the counters, the per-key count of ranks that staged a preloaded key, and
    the per-key count of ranks whose write-back from a DRAM-tier slot ended (``written``)
    and the per-job count of ranks whose synchronous DRAM load is done (``sync_done``);
    it concatenates the job latencies (``observations``: histogram name -> seconds).
    """

    failed_keys: set[bytes] = field(default_factory=set)
    counters: dict[str, int] = field(default_factory=dict)
    staged: dict[bytes, int] = field(default_factory=dict)
    written: dict[bytes, int] = field(default_factory=dict)
    observations: dict[str, list[float]] = field(default_factory=dict)
    #: synchronous DRAM loads (``sync_loads``) whose copy is done: job id -> ranks
    sync_done: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        base = OffloadingWorkerMetadata.aggregate(self, other)
        assert isinstance(base, OffloadingWorkerMetadata)
        failed = set(self.failed_keys)
        counters = dict(self.counters)
        staged = dict(self.staged)
        written = dict(self.written)
        sync_done = dict(self.sync_done)
        obs = {k: list(v) for k, v in self.observations.items()}
        if isinstance(other, PyKVCacheWorkerMetadata):
            for k, v in other.observations.items():
                obs.setdefault(k, []).extend(v)
            failed |= other.failed_keys
            for mine, theirs in ((counters, other.counters), (staged, other.staged),
                                 (written, other.written), (sync_done, other.sync_done)):
                for k, v in theirs.items():
                    mine[k] = mine.get(k, 0) + v
        return PyKVCacheWorkerMetadata(completed_jobs=base.completed_jobs,
                                       transfer_stats=base.transfer_stats,
                                       failed_keys=failed, counters=counters, staged=staged,
                                       written=written, observations=obs,
                                       sync_done=sync_done)
