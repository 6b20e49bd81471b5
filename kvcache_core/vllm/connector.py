"""py-kvcache's subclass of vLLM's ``OffloadingConnector`` (selected with
``"kv_connector_module_path": "kvcache_core.vllm"``).

It keeps vLLM's connector unchanged (metadata, job tracking, deferred stores) and adds
what a storage tier needs that the Offload API lacks:

* validation of ``kv_connector_extra_config`` BEFORE vLLM builds anything (a clear
  :class:`~kvcache_core.config.ConfigError` naming the key instead of an assert), and the
  model dtype injected into the extra config (private key) so that the scheduler and the
  workers compute the same namespace;
* load failures: vLLM 0.26 asserts ``TransferResult.success``, so failed chunks are
  reported through :meth:`get_block_ids_with_load_errors` (vLLM then recomputes them,
  with ``kv_load_failure_policy`` set from our ``load_failure_policy``, default
  ``recompute``) and their keys go to the scheduler's manager in
  :class:`PyKVCacheWorkerMetadata` together with the workers' counters.

Roles: the WORKER-role instance lives in each worker process (model-runner thread); the
SCHEDULER-role instance in the engine-core process (scheduler thread).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector as _VllmOffloadingConnector,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.outputs import KVConnectorOutput

from ..config import ConfigError
from .options import MODEL_DTYPE_KEY, check_block_size, parse_extra_config

log = logging.getLogger("vllm.pykvcache")

SPEC_NAME = "PyKVCacheSpec"
SPEC_MODULE = "kvcache_core.vllm"


@dataclass
class PyKVCacheWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker -> scheduler metadata plus failed keys and counter deltas.

    ``aggregate`` (vLLM's KVOutputAggregator, across TP workers) unions the failed keys
    and sums the counters.
    """

    failed_keys: set[bytes] = field(default_factory=set)
    counters: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        base = OffloadingWorkerMetadata.aggregate(self, other)
        assert isinstance(base, OffloadingWorkerMetadata)
        failed = set(self.failed_keys)
        counters = dict(self.counters)
        if isinstance(other, PyKVCacheWorkerMetadata):
            failed |= other.failed_keys
            for k, v in other.counters.items():
                counters[k] = counters.get(k, 0) + v
        return PyKVCacheWorkerMetadata(completed_jobs=base.completed_jobs,
                                       transfer_stats=base.transfer_stats,
                                       failed_keys=failed, counters=counters)


def _full_attention(spec: KVCacheSpec) -> bool:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return all(_full_attention(s) for s in spec.kv_cache_specs.values())
    return isinstance(spec, FullAttentionSpec)


def load_gate(path: str, vllm_config: VllmConfig) -> Any:
    """The break-even gate for ``path``; None (and ONE warning) if the file is missing or
    belongs to another model: then nothing is gated. A malformed table is a ConfigError."""
    import os

    from ..breakeven import Gate, load_table

    if not os.path.exists(path):
        log.warning("py-kvcache: breakeven_table %s does not exist: loading every hit "
                    "(run `kvcache calibrate`)", path)
        return None
    table = load_table(path)
    model = os.path.basename(os.path.normpath(str(vllm_config.model_config.model)))
    if table.model and table.model not in (model, str(vllm_config.model_config.model)):
        log.warning("py-kvcache: breakeven_table %s was calibrated for model %r, this "
                    "engine serves %r: not gating (calibrate this model)", path,
                    table.model, model)
        return None
    log.info("py-kvcache: break-even gate from %s: min prefix tokens %s", path,
             table.thresholds)
    return Gate(table)


def prepare_vllm_config(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    """Validate our extra config and inject the private keys (idempotent, both roles)."""
    kvt = vllm_config.kv_transfer_config
    assert kvt is not None
    extra = dict(kvt.kv_connector_extra_config or {})
    if extra.get("spec_name") != SPEC_NAME or extra.get("spec_module_path") != SPEC_MODULE:
        raise ConfigError(
            f"py-kvcache config keys 'spec_name'/'spec_module_path': with "
            f"kv_connector_module_path='{SPEC_MODULE}' set \"spec_name\": \"{SPEC_NAME}\" and "
            f"\"spec_module_path\": \"{SPEC_MODULE}\" (got {extra.get('spec_name')!r}, "
            f"{extra.get('spec_module_path')!r})")
    opts = parse_extra_config(extra)
    if vllm_config.cache_config.block_size:
        check_block_size(opts, vllm_config.cache_config.block_size * max(
            1, vllm_config.parallel_config.decode_context_parallel_size))
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if not _full_attention(spec):
            raise ConfigError(f"py-kvcache supports full-attention KV cache groups only; this "
                              f"model has a {type(spec).__name__} group")
    dtype = str(vllm_config.model_config.dtype).replace("torch.", "")
    if extra.get(MODEL_DTYPE_KEY) != dtype:
        extra[MODEL_DTYPE_KEY] = dtype
        kvt.kv_connector_extra_config = extra
    if kvt.kv_load_failure_policy != opts.load_failure_policy:
        log.info("py-kvcache: kv_load_failure_policy=%s (a missing or corrupt cache block %s)",
                 opts.load_failure_policy, "is recomputed" if opts.load_failure_policy ==
                 "recompute" else "fails its request")
        kvt.kv_load_failure_policy = opts.load_failure_policy


class OffloadingConnector(_VllmOffloadingConnector):
    """vLLM's OffloadingConnector + config validation + load-failure reporting +
    scheduler-driven preload (with the patched vLLM, ``kvcache patch-vllm``).

    Preload: the patched scheduler calls :meth:`on_preload_candidates` each step with
    the first ``preload_lookahead`` waiting requests; the manager plans their disk blocks;
    the plan rides in this step's metadata (``pykv_preload``) and the worker starts the
    reads in :meth:`start_preloads` (the patched model runner calls it right after
    binding the metadata, also in steps without a forward pass; :meth:`start_load_kv`
    calls it too, so an unpatched runner still preloads in forward steps). Preloads are
    not jobs: they never enter ``completed_jobs``.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        prepare_vllm_config(vllm_config, kv_cache_config)
        opts = parse_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        #: read by the patched scheduler (k of on_preload_candidates); 0 disables
        self.preload_lookahead = opts.preload_lookahead
        self._preload_max = opts.preload_max_blocks
        self._preload_plan: list[bytes] = []
        super().__init__(vllm_config, role, kv_cache_config)
        self.gate = None
        if role == KVConnectorRole.SCHEDULER and opts.breakeven_table:
            self.gate = load_gate(opts.breakeven_table, vllm_config)
            manager = getattr(self.connector_scheduler, "manager", None)
            if self.gate is not None and manager is not None:
                manager.extra_counters = self.gate.counters  # reported with the stats
                if self.gate.never("disk"):
                    # Disk loads are always refused on this node: writing files would only
                    # slow the requests that store (and preloading them is wasted I/O).
                    manager.disk_stores = False
                    self.preload_lookahead = 0
                    log.info("py-kvcache: the break-even table says disk loads never beat "
                             "recompute here: disk writes and preloads are off, the DRAM "
                             "tier (if any) still stores and serves")

    # ------------------------------------------------------------------ break-even gate
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """vLLM's lookup, then the break-even gate (R9): a reusable prefix shorter than its
        source tier's threshold is refused (0 tokens) and vLLM recomputes it."""
        cs = self.connector_scheduler
        manager = getattr(cs, "manager", None)
        if self.gate is None or manager is None or not hasattr(manager, "begin_lookup"):
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        manager.begin_lookup()
        n, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if not n:
            return n, load_async
        if self.gate.allows(manager.lookup_tier(), num_computed_tokens + n):
            return n, load_async
        return 0, False

    # ------------------------------------------------------------------ preload
    def on_preload_candidates(self, requests: list[Any]) -> None:
        """Scheduler role, once per step (patched vLLM): plan preloads for ``requests``."""
        cs = self.connector_scheduler
        manager = getattr(cs, "manager", None) if cs is not None else None
        if manager is None or not hasattr(manager, "plan_preloads"):
            return
        self._preload_plan += manager.plan_preloads(requests, cs.config.kv_group_configs,
                                                    self._preload_max)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        if self._preload_plan:
            meta.pykv_preload = self._preload_plan
            self._preload_plan = []
        return meta

    def start_preloads(self) -> None:
        """Worker role: start this step's planned preloads (once per metadata)."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        keys = getattr(meta, "pykv_preload", None)
        if not keys or getattr(meta, "_pykv_preload_started", False):
            return
        meta._pykv_preload_started = True
        w = self._our_worker()
        if w is not None:
            w.submit_preloads(keys)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.start_preloads()
        super().start_load_kv(forward_context, **kwargs)

    # ------------------------------------------------------------------ worker role
    def _our_worker(self) -> Any:
        from .worker import PyKVCacheWorker

        cw = self.connector_worker
        w = cw.worker if cw is not None else None
        return w if isinstance(w, PyKVCacheWorker) else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU blocks whose chunk failed to load; reported in the same step as the job's
        completion (vLLM calls this right after ``get_finished``)."""
        w = self._our_worker()
        return w.take_invalid_block_ids() if w is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        meta = super().build_connector_worker_meta()
        w = self._our_worker()
        if w is None:
            return meta
        failed, counters = w.take_report()
        if meta is None and not failed and not counters:
            return None
        if meta is None:
            meta = OffloadingWorkerMetadata()
        assert isinstance(meta, OffloadingWorkerMetadata)
        return PyKVCacheWorkerMetadata(completed_jobs=meta.completed_jobs,
                                       transfer_stats=meta.transfer_stats,
                                       failed_keys=failed, counters=counters)

    # ------------------------------------------------------------------ scheduler role
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        cs = self.connector_scheduler
        if isinstance(meta, PyKVCacheWorkerMetadata) and cs is not None:
            on_report = getattr(cs.manager, "on_worker_report", None)
            if on_report is not None:
                on_report(meta.failed_keys, meta.counters)
        super().update_connector_output(connector_output)
