"""py-kvcache's subclass of vLLM's ``OffloadingConnector`` (selected with
``"kv_connector_module_path": "kvcache_core.vllm"``).

It keeps vLLM's connector unchanged (metadata, job tracking, deferred stores) and adds
what a storage tier needs that the Offload API lacks:

* validation of ``kv_connector_extra_config`` BEFORE vLLM builds anything (a clear
  :class:`~kvcache_core.config.ConfigError` naming the key instead of an assert), and the
  model dtype injected into the extra config (private key) so that the scheduler and the
  workers compute the same namespace;
* load failures: vLLM (0.26 and 0.32) asserts ``TransferResult.success``, so failed chunks are
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
from . import compat
from .options import (
    MODEL_DTYPE_KEY,
    MODEL_IDENTITY_KEY,
    VllmOptions,
    check_block_size,
    model_identity,
    parse_extra_config,
)

log = logging.getLogger("vllm.pykvcache")

SPEC_NAME = "PyKVCacheSpec"
SPEC_MODULE = "kvcache_core.vllm"


@dataclass
class PyKVCacheWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker -> scheduler metadata plus failed keys and counter deltas.

    ``aggregate`` (vLLM's KVOutputAggregator, across TP workers) unions the failed keys
    and sums the counters, the per-key count of ranks that staged a preloaded key, and
    the per-key count of ranks whose write-back from a DRAM-tier slot ended (``written``);
    it concatenates the job latencies (``observations``: histogram name -> seconds).
    """

    failed_keys: set[bytes] = field(default_factory=set)
    counters: dict[str, int] = field(default_factory=dict)
    staged: dict[bytes, int] = field(default_factory=dict)
    written: dict[bytes, int] = field(default_factory=dict)
    observations: dict[str, list[float]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        base = OffloadingWorkerMetadata.aggregate(self, other)
        assert isinstance(base, OffloadingWorkerMetadata)
        failed = set(self.failed_keys)
        counters = dict(self.counters)
        staged = dict(self.staged)
        written = dict(self.written)
        obs = {k: list(v) for k, v in self.observations.items()}
        if isinstance(other, PyKVCacheWorkerMetadata):
            for k, v in other.observations.items():
                obs.setdefault(k, []).extend(v)
            failed |= other.failed_keys
            for mine, theirs in ((counters, other.counters), (staged, other.staged),
                                 (written, other.written)):
                for k, v in theirs.items():
                    mine[k] = mine.get(k, 0) + v
        return PyKVCacheWorkerMetadata(completed_jobs=base.completed_jobs,
                                       transfer_stats=base.transfer_stats,
                                       failed_keys=failed, counters=counters, staged=staged,
                                       written=written, observations=obs)


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


def _queue_model(gate: Any, path: str) -> Any:
    """The queue model of the gate's table, or None (one warning) if the table lacks the
    recompute times or the disk bandwidth it needs."""
    from ..breakeven import QueueModel

    try:
        return QueueModel(gate.table)
    except ValueError as e:
        log.warning("py-kvcache: queue_aware_preload is off: %s (%s); run `kvcache "
                    "calibrate`", e, path)
        return None


class _QueueAdmission:
    """One scheduler step's queue-aware preload decision (``admit`` of
    :meth:`PyKVCacheManager.plan_preloads`), over the waiting requests in scheduling order.

    A request whose disk prefix the gate would load on demand is always preloaded (as
    without the gate). Otherwise it is preloaded only if the requests ahead of it in this
    window, plus what the scheduled requests still have to prefill (``running_s``), take at
    least as long to compute (``QueueModel.recompute_s``) as the reads
    queued up to and including its own (``QueueModel.read_s``): then its blocks are likely
    staged when it is scheduled, and the gate takes them as ``staged``.
    """

    def __init__(self, gate: Any, model: Any, key_bytes: int, tokens_per_chunk: int,
                 running_s: float = 0.0) -> None:
        self.gate, self.model = gate, model
        self.key_bytes, self.tpc = key_bytes, tokens_per_chunk
        self.ahead_s = running_s
        self.queued = 0

    def __call__(self, req: Any, n_keys: int) -> bool:
        ahead = self.ahead_s
        self.ahead_s += self.model.recompute_s(max(0, req.num_tokens - req.num_computed_tokens))
        if n_keys == 0:
            return True
        if self.gate.passes("disk", n_keys * self.tpc):
            self.queued += n_keys * self.key_bytes
            return True
        need = self.queued + n_keys * self.key_bytes
        if not self.model.worth(ahead, need):
            return False
        self.queued = need
        return True


_IDENTITY_LOGGED: set[tuple[str, str]] = set()


def _identity_of(vllm_config: VllmConfig) -> str:
    """:func:`model_identity` of this engine's model (cheap: config hash and 64 KiB per
    weight file), logged once per process and model."""
    load_format = str(getattr(vllm_config.load_config, "load_format", "") or "")
    digest, parts = model_identity(vllm_config.model_config, load_format)
    seen = (str(vllm_config.model_config.model), digest)
    if seen not in _IDENTITY_LOGGED:
        _IDENTITY_LOGGED.add(seen)
        log.info("py-kvcache: model identity %s (%s): part of the cache namespace, so a "
                 "change of any of these never serves stale KV", digest,
                 ", ".join(f"{k}={v or '-'}" for k, v in parts.items()))
    return digest


def prepare_vllm_config(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
                        ) -> VllmOptions:
    """Validate our extra config and inject the private keys (idempotent, both roles).
    Returns the parsed options (the connector's one parse; vLLM's spec factory parses the
    same dict once more, in :class:`~kvcache_core.vllm.spec.PyKVCacheSpec`)."""
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
    identity = _identity_of(vllm_config)
    if extra.get(MODEL_DTYPE_KEY) != dtype or extra.get(MODEL_IDENTITY_KEY) != identity:
        extra[MODEL_DTYPE_KEY] = dtype
        extra[MODEL_IDENTITY_KEY] = identity
        kvt.kv_connector_extra_config = extra
    if kvt.kv_load_failure_policy != opts.load_failure_policy:
        log.info("py-kvcache: kv_load_failure_policy=%s (a missing or corrupt cache block %s)",
                 opts.load_failure_policy, "is recomputed" if opts.load_failure_policy ==
                 "recompute" else "fails its request")
        kvt.kv_load_failure_policy = opts.load_failure_policy
    return opts


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
        compat.require()  # vLLM 0.26.x or 0.32.x, else UnsupportedVLLMError
        opts = prepare_vllm_config(vllm_config, kv_cache_config)
        #: read by the patched scheduler (k of on_preload_candidates); 0 disables
        self.preload_lookahead = opts.preload_lookahead
        self._preload_max = opts.preload_max_blocks
        self._preload_plan: list[bytes] = []
        super().__init__(vllm_config, role, kv_cache_config)
        self.gate = None
        #: queue-aware preload (breakeven.QueueModel), None when off
        self.queue_model = None
        #: queue-aware preload: scheduled requests still in prefill (req id -> request)
        self._prefilling: dict[str, Any] = {}
        #: the gate's last decision per waiting request, counted once it is scheduled
        self._gate_decisions: dict[str, tuple[tuple[str, bool], ...]] = {}
        if role == KVConnectorRole.SCHEDULER and opts.breakeven_table:
            self.gate = load_gate(opts.breakeven_table, vllm_config)
            manager = getattr(self.connector_scheduler, "manager", None)
            if self.gate is not None and manager is not None:
                manager.extra_counters = self.gate.counters  # reported with the stats
                if opts.queue_aware_preload and self.preload_lookahead == 0:
                    log.warning("py-kvcache: queue_aware_preload needs preload_lookahead > 0 "
                                "(it decides which waiting requests to preload): off")
                elif opts.queue_aware_preload:
                    self.queue_model = _queue_model(self.gate, opts.breakeven_table)
                if self.queue_model is not None:
                    log.info("py-kvcache: queue-aware preload on: disk prefixes the gate "
                             "refuses on demand are preloaded when the queue leaves time")
                elif self.gate.never("disk"):
                    # Disk loads are always refused on this node: writing files would only
                    # slow the requests that store (and preloading them is wasted I/O).
                    manager.disk_stores = False
                    self.preload_lookahead = 0
                    log.info("py-kvcache: the break-even table says disk loads never beat "
                             "recompute here: disk writes and preloads are off, the DRAM "
                             "tier (if any) still stores and serves")

        #: requests shorter than this write no files (``disk_min_prefix_tokens``)
        self.disk_min_prefix_tokens = 0
        #: short requests finished since the last metadata build (their last store job is
        #: built in the next one, still without files)
        self._short_finished: list[str] = []
        manager = getattr(self.connector_scheduler, "manager", None)
        if role == KVConnectorRole.SCHEDULER and hasattr(manager, "short_requests"):
            dm = opts.disk_min_prefix_tokens
            if dm == "auto":
                dm = 0
                if self.gate is not None and not self.gate.never("disk"):
                    dm = self.gate.table.thresholds.get("disk") or 0
            self.disk_min_prefix_tokens = int(dm)
            if self.disk_min_prefix_tokens:
                log.info("py-kvcache: requests with prompts shorter than %d tokens keep their "
                         "KV in the DRAM tier only (no files)", self.disk_min_prefix_tokens)

    # ------------------------------------------------------------------ break-even gate
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """vLLM's lookup, then the break-even gate (R9): a reusable prefix shorter than its
        source tier's threshold is refused (0 tokens) and vLLM recomputes it. A request
        shorter than ``disk_min_prefix_tokens`` is marked here: its stores write no files."""
        cs = self.connector_scheduler
        manager = getattr(cs, "manager", None)
        if (self.disk_min_prefix_tokens and manager is not None
                and request.num_prompt_tokens < self.disk_min_prefix_tokens):
            manager.short_requests.add(request.request_id)
        if self.gate is None or manager is None or not hasattr(manager, "begin_lookup"):
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        manager.begin_lookup()
        n, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if not n:
            return n, load_async
        gate, rid = self.gate, request.request_id
        tier = manager.lookup_tier()
        if gate.passes(tier, num_computed_tokens + n):
            self._gate_decisions[rid] = ((tier, True),)
            return n, load_async
        # Refused because part of the prefix must come from disk: the leading chunks that
        # are in the DRAM tier or staged by a preload may still be worth loading alone.
        fast, fast_tier = manager.lookup_fast_chunks()
        groups = cs.config.kv_group_configs
        if fast and len(groups) == 1:
            tpc = groups[0].tokens_per_chunk
            m = tpc * (num_computed_tokens // tpc + fast) - num_computed_tokens
            if 0 < m < n and gate.passes(fast_tier, num_computed_tokens + m):
                self._gate_decisions[rid] = ((tier, False), (fast_tier, True))
                return m, True
        self._gate_decisions[rid] = ((tier, False),)
        return 0, False

    # ------------------------------------------------------------------ preload
    def on_preload_candidates(self, requests: list[Any]) -> None:
        """Scheduler role, once per step (patched vLLM): plan preloads for ``requests``."""
        cs = self.connector_scheduler
        manager = getattr(cs, "manager", None) if cs is not None else None
        if manager is None or not hasattr(manager, "plan_preloads"):
            return
        admit = None
        if self.queue_model is not None:
            admit = _QueueAdmission(self.gate, self.queue_model, manager.key_bytes,
                                    cs.config.kv_group_configs[0].tokens_per_chunk,
                                    self._prefill_left_s())
        self._preload_plan += manager.plan_preloads(requests, cs.config.kv_group_configs,
                                                    self._preload_max, admit)

    def _prefill_left_s(self) -> float:
        """Expected compute time left of the scheduled requests still in prefill (the
        queue-aware estimate of how long the head of the queue still waits)."""
        m, left, done = self.queue_model, 0.0, []
        for rid, r in self._prefilling.items():
            n, c = r.num_prompt_tokens, r.num_computed_tokens
            if c >= n:
                done.append(rid)
                continue
            left += m.recompute_s(n) - m.recompute_s(c)
        for rid in done:
            del self._prefilling[rid]
        return left

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> Any:
        if self.queue_model is not None:
            self._prefilling[request.request_id] = request
        if self._gate_decisions:
            for tier, ok in self._gate_decisions.pop(request.request_id, ()):
                self.gate.count(tier, ok)
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def _forget(self, request: Any) -> None:
        self._prefilling.pop(request.request_id, None)
        self._gate_decisions.pop(request.request_id, None)
        if self.disk_min_prefix_tokens:
            self._short_finished.append(request.request_id)

    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        self._forget(request)
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        self._forget(request)
        return super().request_finished_all_groups(request, block_ids)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        done, self._short_finished = self._short_finished, []
        meta = super().build_connector_meta(scheduler_output)
        if done:  # their final store jobs were built just now
            short = self.connector_scheduler.manager.short_requests
            for rid in done:
                short.discard(rid)
        if self._preload_plan:
            meta.pykv_preload = self._preload_plan
            self._preload_plan = []
        # deferred write-backs: every step's metadata reaches the workers' start_load_kv
        # (with or without a forward), so the slots pinned for them are always released
        manager = getattr(self.connector_scheduler, "manager", None)
        flush = manager.take_flush_plan() if hasattr(manager, "take_flush_plan") else None
        if flush:
            meta.pykv_flush = flush
        return meta

    def start_preloads(self) -> None:
        """Worker role: start this step's planned preloads and deferred write-backs
        (once per metadata)."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        keys = getattr(meta, "pykv_preload", None)
        flush = getattr(meta, "pykv_flush", None)
        if not (keys or flush) or getattr(meta, "_pykv_preload_started", False):
            return
        meta._pykv_preload_started = True
        w = self._our_worker()
        if w is not None:
            if flush:
                w.submit_flush(flush)
            if keys:
                w.submit_preloads(keys)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.start_preloads()
        w = self._our_worker()
        if w is not None and w.reactor.trace is not None:
            w.reactor.trace_event("fwd_start")  # diagnostics: the step's forward begins
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
        staged = dict.fromkeys(w.take_staged(), 1)
        written = dict.fromkeys(w.take_written(), 1)
        obs = w.take_observations()
        if (meta is None and not failed and not counters and not staged and not written
                and not obs):
            return None
        if meta is None:
            meta = OffloadingWorkerMetadata()
        assert isinstance(meta, OffloadingWorkerMetadata)
        return PyKVCacheWorkerMetadata(completed_jobs=meta.completed_jobs,
                                       transfer_stats=meta.transfer_stats,
                                       failed_keys=failed, counters=counters, staged=staged,
                                       written=written, observations=obs)

    # ------------------------------------------------------------------ scheduler role
    def _restore_failed(self, failed_keys: Any) -> None:
        """Self-healing (issue 12 item 4): a chunk whose load failed is recomputed by its
        request (vLLM resets the request's computed tokens to that chunk in this same
        ``update_from_output``, before this hook); rewind the request's store cursor to
        the first failed chunk so that vLLM's store-job builder stores the recomputed
        chunks (keys still cached are skipped by ``prepare_store``). Without it vLLM
        treats loaded chunks as already offloaded and the next request recomputes too."""
        cs = self.connector_scheduler
        loads_of = getattr(cs.manager, "loads_of", None)
        req_status = getattr(cs, "_req_status", None)
        if loads_of is None or req_status is None:
            return
        for rid, keys in loads_of(failed_keys).items():
            st = req_status.get(rid)
            for gs in getattr(st, "group_states", ()):
                okeys = getattr(gs, "offload_keys", None)
                nxt = getattr(gs, "next_stored_chunk_idx", None)
                if okeys is None or nxt is None:
                    continue
                first = next((i for i, k in enumerate(okeys[:nxt]) if k in keys), None)
                if first is not None:
                    gs.next_stored_chunk_idx = first
                    cs.manager.counters["restores_planned"] += sum(
                        1 for k in okeys[first:nxt] if k in keys)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        cs = self.connector_scheduler
        if isinstance(meta, PyKVCacheWorkerMetadata) and cs is not None:
            if meta.failed_keys:
                self._restore_failed(meta.failed_keys)
            on_report = getattr(cs.manager, "on_worker_report", None)
            if on_report is not None:
                on_report(meta.failed_keys, meta.counters, meta.staged, meta.written,
                          meta.observations)
        super().update_connector_output(connector_output)
