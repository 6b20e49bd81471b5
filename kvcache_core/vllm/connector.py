"""py-kvcache's subclass of vLLM's ``OffloadingConnector`` (selected with
``"kv_connector_module_path": "kvcache_core.vllm"``): a facade over one object per role.

It keeps vLLM's connector unchanged (metadata, job tracking, deferred stores) and adds
what a storage tier needs that the Offload API lacks:

* validation of ``kv_connector_extra_config`` BEFORE vLLM builds anything (a clear
  :class:`~kvcache_core.config.ConfigError` naming the key instead of an assert), and the
  model dtype injected into the extra config (private key) so that the scheduler and the
  workers compute the same namespace (:func:`prepare_vllm_config`, here, both roles);
* the break-even gate, scheduler-driven preload (patched vLLM, ``kvcache patch-vllm``),
  short requests and the self-healing of failed loads, in the scheduler role:
  :class:`~kvcache_core.vllm.connector_scheduler.SchedulerSide`;
* preload and write-back starts and load-failure reporting in the worker role:
  :class:`~kvcache_core.vllm.connector_worker.WorkerSide`. vLLM (0.26 and 0.32) asserts
  ``TransferResult.success``, so failed chunks are reported through
  :meth:`OffloadingConnector.get_block_ids_with_load_errors` (vLLM then recomputes them,
  with ``kv_load_failure_policy`` set from our ``load_failure_policy``, default
  ``recompute``) and their keys go to the scheduler's manager in
  :class:`~kvcache_core.vllm.metadata.PyKVCacheWorkerMetadata` together with the
  workers' counters.

Roles: the SCHEDULER-role instance lives in the engine-core process and vLLM calls its
hooks from the scheduler thread; each WORKER-role instance lives in a worker process and
vLLM calls its hooks from that worker's model-runner thread. The two exchange
:mod:`~kvcache_core.vllm.metadata` once per step. This module imports the worker side
(reactor, KV copier, io_uring) only when it builds a worker-role connector.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
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
from .connector_scheduler import SchedulerSide
from .options import (
    CROSS_LAYER,
    MODEL_DTYPE_KEY,
    MODEL_IDENTITY_KEY,
    PER_LAYER,
    VllmOptions,
    check_block_size,
    model_identity,
    parse_extra_config,
)

if TYPE_CHECKING:  # pragma: no cover
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from .connector_worker import WorkerSide

log = logging.getLogger("vllm.pykvcache")

SPEC_NAME = "PyKVCacheSpec"
SPEC_MODULE = "kvcache_core.vllm"


def _full_attention(spec: KVCacheSpec) -> bool:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return all(_full_attention(s) for s in spec.kv_cache_specs.values())
    return isinstance(spec, FullAttentionSpec)


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
    if opts.gpu_kv_layout != CROSS_LAYER and compat.IS_0_32:
        raise ConfigError(f"py-kvcache config key 'gpu_kv_layout': "
                          f"'{opts.gpu_kv_layout}' is for vLLM 0.26 only (this is "
                          f"vLLM {compat.VLLM_VERSION}); leave it unset")
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
    """vLLM's OffloadingConnector + config validation, delegating py-kvcache's additions
    to one role object: :class:`SchedulerSide` (``_sched``, scheduler role) or
    :class:`~kvcache_core.vllm.connector_worker.WorkerSide` (``_work``, worker role).

    Every hook it overrides hands off to that object and to vLLM's own connector
    (``super()``); a hook of one role is never called on the other role's instance
    (asserted, as vLLM's connector does).

    Preload: the patched scheduler calls :meth:`on_preload_candidates` each step with
    the first :attr:`preload_lookahead` waiting requests; the scheduler side plans their
    disk blocks; the plan rides in this step's metadata and the worker side starts the
    reads in :meth:`start_preloads` (the patched model runner calls it right after
    binding the metadata, also in steps without a forward pass; :meth:`start_load_kv`
    calls it too, so an unpatched runner still preloads in forward steps).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        compat.require()  # vLLM 0.26.x or 0.32.x, else UnsupportedVLLMError
        opts = prepare_vllm_config(vllm_config, kv_cache_config)
        #: scheduler role (engine-core process): the gate, preload planning, reports
        self._sched: SchedulerSide | None = None
        #: worker role (worker process): preload starts, load errors, worker metadata
        self._work: WorkerSide | None = None
        #: ``gpu_kv_layout``: whether vLLM should give this connector the cross-layer KV
        #: tensor (read by vLLM's model runner when it allocates the KV cache)
        self._cross_layer = opts.gpu_kv_layout == CROSS_LAYER
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            assert self.connector_scheduler is not None
            self._sched = SchedulerSide(self.connector_scheduler, opts, vllm_config)
        elif role == KVConnectorRole.WORKER:
            from .connector_worker import WorkerSide  # the worker side: workers only

            assert self.connector_worker is not None
            self._work = WorkerSide(self.connector_worker)

    # ------------------------------------------------------------------ KV cache layout
    @property
    def prefer_cross_layer_blocks(self) -> bool:
        """vLLM's model runner (worker process, once, when it allocates the KV cache):
        one cross-layer KV tensor (vLLM's choice for an offloading connector, the
        default) unless ``gpu_kv_layout`` is 'per_layer'. vLLM 0.32 has no such
        attribute and never reads it (False there rather than AttributeError)."""
        return self._cross_layer and bool(getattr(super(), "prefer_cross_layer_blocks",
                                                  False))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """vLLM (any process, before the attention backends are built): the KV layout
        this connector needs: vLLM's ('HND') by default, the attention backend's own
        (None) with ``gpu_kv_layout`` 'per_layer'. Reads the raw extra config (it may run
        before the connector validates it; a wrong value is refused there)."""
        kvt = vllm_config.kv_transfer_config
        extra = (kvt.kv_connector_extra_config or {}) if kvt is not None else {}
        if extra.get("gpu_kv_layout") == PER_LAYER and not compat.IS_0_32:
            return None
        return super().get_required_kvcache_layout(vllm_config)

    # ------------------------------------------------------------------ scheduler role
    # vLLM calls these from the scheduler thread of the engine-core process.
    @property
    def preload_lookahead(self) -> int:
        """k of ``on_preload_candidates``, read by the patched scheduler every step; 0
        (preload off) in the worker role."""
        return self._sched.preload_lookahead if self._sched is not None else 0

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """vLLM's lookup between the two halves of the scheduler side's judgement: the
        break-even gate (R9), ``disk_load_hold_s`` (``(None, False)``: ask again next
        step) and ``dram_load_sync``. A request held, or deferred on a promotion with
        nothing changed since (:meth:`SchedulerSide.still_deferred`), is answered "not
        yet" without a lookup."""
        sched = self._sched
        assert sched is not None
        c = sched.manager.counters
        if sched.loaded_behind(request):
            c["lookups_yielded"] += 1  # let vLLM's loop reach a request whose load is done
            return None, False
        if sched.hold_s and sched.still_held(request):
            return None, False
        if sched.still_deferred(request, num_computed_tokens):
            c["lookups_skipped"] += 1  # still waiting on the same promotion: no rescan
            return None, False
        t0 = time.perf_counter_ns()
        pending0, retry0 = c["hits_pending"], c["lookups_retry"]
        judged = sched.begin_lookup(request)
        found = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if not compat.MANAGER_TOUCH:  # vLLM 0.32: the touch 0.26's scheduler does here
            sched.touch_request(request)
        out = sched.end_lookup(request, num_computed_tokens, found) if judged else found
        # memoized only when deferred on a promotion alone: a RETRY (disk_lookup_async)
        # needs the rescan that picks up the background check's answer
        sched.note_lookup(request, num_computed_tokens,
                          found[0] is None and c["hits_pending"] > pending0
                          and c["lookups_retry"] == retry0)
        # diagnostics: how long lookups hold the engine's main thread (file existence
        # checks wait for the disk and give the GIL away; the thirty-sixth session's stalls)
        us = (time.perf_counter_ns() - t0) // 1000
        c["lookup_requests"] += 1
        c["lookup_us"] += us
        if us > c["lookup_max_us"]:
            c["lookup_max_us"] = us
        return out

    def on_preload_candidates(self, requests: list[Request]) -> None:
        """Patched vLLM, once per step: plan preloads for the waiting ``requests``."""
        assert self._sched is not None
        self._sched.on_preload_candidates(requests)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """``request`` got its blocks (it is scheduled): its gate decision is counted, and
        a synchronous DRAM load is completed in vLLM's scheduler (``dram_load_sync``)."""
        assert self._sched is not None
        self._sched.after_alloc(request)
        super().update_state_after_alloc(
            request, self._sched.load_view(request, blocks, num_external_tokens),
            num_external_tokens)
        self._sched.after_load_job(request, num_external_tokens)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """``request`` finished: the scheduler side forgets it."""
        assert self._sched is not None
        self._sched.forget(request)
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """``request`` finished (hybrid-allocator form): as :meth:`request_finished`."""
        assert self._sched is not None
        self._sched.forget(request)
        return super().request_finished_all_groups(request, block_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Once per step: vLLM's metadata, plus this step's preloads and flushes."""
        assert self._sched is not None
        return self._sched.build_connector_meta(super().build_connector_meta(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Once per step: the workers' report goes to the scheduler side, then to vLLM."""
        assert self._sched is not None
        self._sched.on_worker_meta(connector_output.kv_connector_worker_meta)
        super().update_connector_output(connector_output)

    # ------------------------------------------------------------------ worker role
    # vLLM calls these from the model-runner thread of a worker process.
    def start_preloads(self) -> None:
        """Patched model runner, right after binding the step's metadata: start its
        preloads and deferred write-backs (once per metadata)."""
        assert self._work is not None
        self._work.start_preloads(self._connector_metadata)

    def has_connector_metadata(self) -> bool:
        """Always False, so that vLLM's per-layer attention wrapper
        (``maybe_transfer_kv_layer``, its only caller outside connectors in 0.26 and 0.32)
        skips ``wait_for_layer_load`` and ``save_kv_layer`` for every layer of every step:
        ours are vLLM's no-ops (transfers are per step, not per layer), and in eager mode
        and piecewise CUDA graphs those two calls per layer ran on the model-runner
        thread's critical path. The bound metadata itself is unaffected
        (``_connector_metadata``, read by every per-step hook)."""
        return False

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Before the forward pass: preloads (if not started yet), then vLLM's jobs, then
        the forward pass is ordered after this step's synchronous DRAM loads."""
        assert self._work is not None
        self._work.start_load_kv(self._connector_metadata)
        super().start_load_kv(forward_context, **kwargs)
        self._work.after_load_submit(self._connector_metadata)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU blocks whose chunk failed to load since the last call (vLLM recomputes)."""
        assert self._work is not None
        return self._work.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Once per step: vLLM's worker metadata plus this worker's report."""
        meta = super().build_connector_worker_meta()
        return self._work.build_connector_worker_meta(meta) if self._work is not None else meta
