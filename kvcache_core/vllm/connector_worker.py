"""The worker role of :class:`~kvcache_core.vllm.connector.OffloadingConnector`:
:class:`WorkerSide`.

One per vLLM worker process (one per TP rank), next to vLLM's
``OffloadingConnectorWorker``, which builds our
:class:`~kvcache_core.vllm.worker.PyKVCacheWorker` when vLLM registers the KV caches.
Every method is called by that worker's model-runner thread, through the connector's
hooks; the worker's reactor thread is never called from here (the
:class:`~kvcache_core.vllm.worker.PyKVCacheWorker` methods used are its model-runner
thread API). It:

* starts the step's preloads and deferred write-backs that the scheduler planned
  (:class:`~kvcache_core.vllm.metadata.PyKVCacheConnectorMetadata`), once per metadata;
* marks the start of the forward pass in the reactor's trace (diagnostics);
* reports the GPU blocks whose chunk failed to load (vLLM recomputes them) and builds
  the worker -> scheduler :class:`~kvcache_core.vllm.metadata.PyKVCacheWorkerMetadata`.

Imported by the connector in the worker role only: the scheduler process never loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)

from .metadata import PyKVCacheConnectorMetadata, PyKVCacheWorkerMetadata
from .worker import PyKVCacheWorker

if TYPE_CHECKING:  # pragma: no cover
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
        OffloadingConnectorWorker,
    )


class WorkerSide:
    """The connector's worker-role logic (worker process, model-runner thread only).

    ``connector_worker`` is vLLM's ``OffloadingConnectorWorker`` of the same connector;
    it owns the :class:`PyKVCacheWorker` (built from our spec, shut down by vLLM), which
    this object only uses (:attr:`worker`).
    """

    def __init__(self, connector_worker: OffloadingConnectorWorker) -> None:
        self._cw = connector_worker
        self._worker: PyKVCacheWorker | None = None

    @property
    def worker(self) -> PyKVCacheWorker | None:
        """This process's :class:`PyKVCacheWorker`; None until vLLM has registered the KV
        caches (vLLM's connector worker builds it then)."""
        w = self._worker
        if w is None:
            built = self._cw.worker
            if built is None:
                return None
            # the connector refuses any spec but ours: the worker is always ours
            assert isinstance(built, PyKVCacheWorker), type(built)
            self._worker = w = built
        return w

    def start_preloads(self, meta: KVConnectorMetadata | None) -> None:
        """Start the deferred write-backs and the preloads that ``meta`` (the step's bound
        metadata) carries, once per metadata: the patched model runner calls this right
        after binding it (also in steps without a forward pass), :meth:`start_load_kv`
        again (an unpatched runner still preloads in forward steps). Preloads are not
        jobs: they never enter ``completed_jobs``."""
        if not isinstance(meta, PyKVCacheConnectorMetadata) or meta.preloads_started:
            return
        meta.preloads_started = True
        w = self.worker
        if w is not None:
            if meta.flush:
                w.submit_flush(meta.flush)
            if meta.preload:
                w.submit_preloads(meta.preload)

    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        """Before vLLM starts the step's load and store jobs: :meth:`start_preloads`, and
        the ``fwd_start`` trace event when the reactor traces."""
        self.start_preloads(meta)
        w = self.worker
        if w is not None and w.reactor.trace is not None:
            w.reactor.trace_event("fwd_start")  # diagnostics: the step's forward begins

    def after_load_submit(self, meta: KVConnectorMetadata | None) -> None:
        """After vLLM submitted the step's load jobs (``start_kv_transfers``), before the
        forward pass: the scheduler's synchronous DRAM loads (``meta.sync_loads``) are
        ordered before the forward pass, and taken out of vLLM's worker bookkeeping (its
        scheduler already counts them complete: no ``finished_recving`` for them)."""
        if not isinstance(meta, PyKVCacheConnectorMetadata) or not meta.sync_loads:
            return
        w = self.worker
        if w is None:  # pragma: no cover - loads come only after the caches exist
            return
        load_jobs = self._cw._load_jobs
        for job_id in meta.sync_loads:
            load_jobs.pop(job_id, None)
            w.make_sync(job_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU blocks whose chunk failed to load; reported in the same step as the job's
        completion (vLLM calls this right after ``get_finished``)."""
        w = self.worker
        return w.take_invalid_block_ids() if w is not None else set()

    def build_connector_worker_meta(self, meta: KVConnectorWorkerMetadata | None
                                    ) -> KVConnectorWorkerMetadata | None:
        """vLLM's worker metadata of this step (``meta``: completed jobs) plus this
        worker's failed keys, counter deltas, staged and written keys and job latencies;
        None when there is nothing to report."""
        w = self.worker
        if w is None:
            return meta
        failed, counters = w.take_report()
        staged = dict.fromkeys(w.take_staged(), 1)
        written = dict.fromkeys(w.take_written(), 1)
        sync_done = dict.fromkeys(w.take_sync_done(), 1)
        obs = w.take_observations()
        if (meta is None and not failed and not counters and not staged and not written
                and not obs and not sync_done):
            return None
        if meta is None:
            meta = OffloadingWorkerMetadata()
        assert isinstance(meta, OffloadingWorkerMetadata)
        return PyKVCacheWorkerMetadata(completed_jobs=meta.completed_jobs,
                                       transfer_stats=meta.transfer_stats,
                                       failed_keys=failed, counters=counters, staged=staged,
                                       written=written, observations=obs,
                                       sync_done=sync_done)
