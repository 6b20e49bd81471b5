""":class:`PyKVCacheSpec`: the ``OffloadingSpec`` vLLM loads by name.

vLLM builds the spec twice per engine: once in the scheduler process (for
:meth:`get_manager`) and once in every worker process (for :meth:`get_worker`), each time
from an ``OffloadingConfig`` (rank 0 on the scheduler side). Everything both sides must
agree on (chunk geometry, every rank's namespace, slot counts) is derived here from
config-level facts only, so the two constructions compute the same values.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from ..config import ConfigError
from ..layout import integrity_key_id, is_fuse, load_integrity_key
from . import compat
from .manager import (
    GATE_COUNTERS,
    JOB_HISTOGRAMS,
    MANAGER_COUNTERS,
    MANAGER_GAUGES,
    METRIC_PREFIX,
    WB_FRACTION_IDLE,
    WB_FRACTION_READING,
    WORKER_COUNTERS,
    PyKVCacheManager,
)
from .options import (
    CROSS_LAYER,
    check_block_size,
    ensure_hash_seed,
    kv_layout_string,
    make_namespace,
    namespace_dtype,
    parse_extra_config,
    pool_geometry,
    resolve_blocks_per_chunk,
)

log = logging.getLogger("vllm.pykvcache")
#: ``disk_lookup_cache_s: auto`` on a FUSE root_dir (GlusterFS, 3FS, Weka, JuiceFS, ...)
AUTO_LOOKUP_CACHE_S = 2.0


def _device_type() -> str:
    try:
        from vllm.platforms import current_platform

        return str(current_platform.device_type)
    except Exception:  # pragma: no cover - platform detection failed
        return "?"


class PyKVCacheSpec(OffloadingSpec):
    """py-kvcache for vLLM's OffloadingConnector: DRAM tier + shared disk tier.

    Raises :class:`~kvcache_core.config.ConfigError` (naming the key) for an unknown
    extra-config key or a bad value, and for ``PYTHONHASHSEED=random``.
    """

    @classmethod
    def build_metric_definitions(
            cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        """Prometheus counters and gauges for :meth:`PyKVCacheManager.get_stats`."""
        defs: dict[str, OffloadingMetricMetadata] = {
            METRIC_PREFIX + k: OffloadingCounterMetadata(documentation=doc)
            for k, doc in (*MANAGER_COUNTERS.items(), *WORKER_COUNTERS.items())}
        defs.update({METRIC_PREFIX + k: OffloadingGaugeMetadata(documentation=doc)
                     for k, doc in MANAGER_GAUGES.items()})
        defs.update({METRIC_PREFIX + k: OffloadingCounterMetadata(documentation=doc)
                     for k, doc in GATE_COUNTERS.items()})
        defs.update({METRIC_PREFIX + k + "_seconds": OffloadingHistogramMetadata(
            documentation=doc, buckets=buckets)
            for k, (doc, buckets) in JOB_HISTOGRAMS.items()})
        return defs

    def __init__(self, config: OffloadingConfig) -> None:
        compat.require()
        super().__init__(config)
        self.options = parse_extra_config(config.extra_config)
        self.storage = self.options.storage
        if self.options.model_dtype is None:
            raise ConfigError(
                "py-kvcache: set \"kv_connector_module_path\": \"kvcache_core.vllm\" next to "
                "\"kv_connector\": \"OffloadingConnector\". vLLM's stock connector class cannot "
                "report a chunk that fails to load (a file evicted by another instance, or "
                "corrupt), so the request would run on garbage KV; py-kvcache's subclass "
                "reports it and vLLM recomputes the chunk.")
        self.hash_seed = ensure_hash_seed()
        tpb = tuple(self.tokens_per_block)
        if tpb:
            check_block_size(self.options, tpb[0])
        self.blocks_per_chunk = resolve_blocks_per_chunk(self.options, tpb,
                                                         self.blocks_per_chunk)
        wkb = config.worker_kv_bytes_per_block
        if wkb <= 0:
            raise RuntimeError("py-kvcache: vLLM reports 0 KV bytes per block (no KV cache)")
        par = config.parallel
        dtype = namespace_dtype(self.options.model_dtype,
                                compat.offload_cache_dtype(config, self.options.model_dtype))
        self.tokens_per_chunk = (tpb[0] if tpb else 1) * self.blocks_per_chunk
        kvl = compat.kv_cache_layout(config)
        if self.options.gpu_kv_layout != CROSS_LAYER:
            # other block bytes (per-layer pages, the backend's own order): own namespace
            kvl = f"{kvl}+{self.options.gpu_kv_layout}" if kvl else self.options.gpu_kv_layout
        layout = kv_layout_string(
            tokens_per_block=tpb, blocks_per_chunk=self.blocks_per_chunk,
            worker_kv_bytes_per_block=wkb, tokens_per_hash=self.tokens_per_hash,
            tp_size=par.tp_size, pp_size=par.pp_size, pcp_size=par.pcp_size,
            dcp_size=par.dcp_size, device=_device_type(),
            kv_cache_layout=kvl)
        model = self.options.model_id or config.model.name
        if self.options.model_identity:  # revision, quantization, config, weights (issue 12)
            model = f"{model}@{self.options.model_identity}"
        #: the secret of ``integrity_key_file`` (None: no keyed integrity); keyed instances
        #: get their own namespace, named by the key's public id
        self.integrity_key = (load_integrity_key(self.storage.integrity_key_file)
                              if self.storage.integrity_key_file else None)
        if self.integrity_key is not None:
            model = f"{model}+keyed-{integrity_key_id(self.integrity_key)}"
        self.rank = par.rank
        self.world_size = par.world_size
        self.namespaces = [
            make_namespace(model=model, dtype=dtype, tokens_per_chunk=self.tokens_per_chunk,
                           block_bytes=wkb * self.blocks_per_chunk, rank=r,
                           world_size=par.world_size, kv_layout=layout)
            for r in range(par.world_size)]
        self.pool = pool_geometry(self.storage, self.namespaces[0])
        # max_disk_bytes bounds the engine's whole namespace: each rank gets its share.
        mdb = self.storage.max_disk_bytes
        self.max_disk_bytes_per_rank = max(1, mdb // par.world_size) if mdb else 0
        if mdb and self.max_disk_bytes_per_rank < self.pool.slot_bytes:
            log.warning("py-kvcache: max_disk_bytes=%d gives each of %d ranks less than one "
                        "file (%d B): every store will be dropped", mdb, par.world_size,
                        self.pool.slot_bytes)
        lc = self.options.disk_lookup_cache_s
        #: seconds of the scheduler's positive disk-lookup cache (0: off)
        self.lookup_cache_s = float(
            (AUTO_LOOKUP_CACHE_S if is_fuse(self.storage.root_dir) else 0.0)
            if lc == "auto" else lc)
        self._manager: PyKVCacheManager | None = None
        self._worker: OffloadingWorker | None = None
        log.info("py-kvcache: rank %d/%d root %s namespace %s (%s, %s), %d tokens = %d B per "
                 "file, staging %d slots, DRAM tier %d slots (%d B per worker, eviction %s, "
                 "write-back up to %s of it)",
                 self.rank, self.world_size, self.storage.root_dir,
                 self.namespaces[self.rank].dirname(), model, dtype, self.tokens_per_chunk,
                 self.pool.slot_bytes, self.pool.n_staging, self.pool.n_dram,
                 self.pool.n_dram * self.pool.slot_bytes, self.storage.eviction_policy,
                 (f"{WB_FRACTION_READING:.0%} while busy, {WB_FRACTION_IDLE:.0%} otherwise"
                  if self.storage.writeback_max_fraction == "auto"
                  else f"{self.storage.writeback_max_fraction:.0%}"))

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = PyKVCacheManager(
                self.storage.root_dir, self.namespaces, self.pool.n_dram,
                eviction_policy=self.storage.eviction_policy,
                writeback_max_fraction=self.storage.writeback_max_fraction,
                writeback_flush=self.storage.writeback_flush,
                disk_admission=self.storage.disk_admission,
                lookup_cache_s=self.lookup_cache_s,
                disk_lookup_async=self.options.disk_lookup_async,
                # a bounded namespace is walked (scandir + lstat of every file) by each
                # worker's Layout at construction (Layout.scan), which warms the same
                # kernel caches: no second walk
                warm_start=self.options.disk_warm_start and not self.max_disk_bytes_per_rank,
                join_promotions=self.options.join_promotions,
                enable_events=self.kv_events_config.enable_kv_cache_events)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            from .worker import PyKVCacheWorker

            self._worker = PyKVCacheWorker(
                kv_caches, storage=self.storage, namespace=self.namespaces[self.rank],
                pool=self.pool, blocks_per_chunk=self.blocks_per_chunk,
                max_disk_bytes=self.max_disk_bytes_per_rank, rank=self.rank,
                integrity_key=self.integrity_key)
        return self._worker
