"""The scheduler role of :class:`~kvcache_core.vllm.connector.OffloadingConnector`:
:class:`SchedulerSide`.

Lives in vLLM's engine-core process, next to vLLM's ``OffloadingConnectorScheduler``
and our :class:`~kvcache_core.vllm.manager.PyKVCacheManager` (its ``manager``). Every
method is called by the scheduler thread (EngineCore's busy loop), through the
connector's hooks, one call at a time: nothing here takes a lock. It owns:

* the break-even gate (R9, :class:`~kvcache_core.breakeven.Gate`): prefixes whose
  source tier does not beat recompute are refused at lookup, and each request's
  decision is counted once it is scheduled;
* preload planning (R8, patched vLLM): the plan of the waiting requests' disk blocks,
  optionally queue-aware (:class:`~kvcache_core.breakeven.QueueModel`), sent to the
  workers in the next metadata (:class:`~kvcache_core.vllm.metadata.PyKVCacheConnectorMetadata`)
  with the manager's deferred write-backs;
* ``disk_min_prefix_tokens``: requests marked short in the manager (no files) from
  their lookup until the metadata that carries their last store job;
* ``dram_load_sync``: a hit whose every chunk is in the DRAM tier is loaded in the step
  that computes its request: the lookup answers vLLM "not asynchronous", the load job
  vLLM builds for it is completed in vLLM's scheduler at once (vLLM builds store jobs
  only for requests without a pending load, and this request computes in this step) while
  the manager keeps its slots pinned (``hold_loads``) until every worker reports the
  copy done (``sync_done``); the job ids ride in the metadata (``sync_loads``);
* ``disk_load_hold_s``: a waiting request that would read its prefix from disk while
  another request's disk load is in flight is answered "not yet" (vLLM keeps it in
  place and schedules the requests behind it), for at most that long;
* the workers' reports (:class:`~kvcache_core.vllm.metadata.PyKVCacheWorkerMetadata`):
  failed loads rewind their requests' store cursors (self-healing), then everything goes
  to the manager.

It imports nothing of the worker side (reactor, KV copier, io_uring, worker):
``tests/test_layering.py`` checks it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from ..breakeven import Gate, QueueModel, load_table
from ..config import ConfigError
from . import compat
from .manager import PyKVCacheManager
from .metadata import PyKVCacheConnectorMetadata, PyKVCacheWorkerMetadata
from .options import VllmOptions

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        GroupOffloadConfig,
        OffloadingConnectorScheduler,
    )
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.pykvcache")

#: a request deferred on a promotion is scanned again after this long even if no disk
#: load ended (a safety bound: a promotion ends only with its load, which bumps the
#: manager's ``load_epoch``)
DEFERRED_MAX_S = 1.0


def load_gate(path: str, vllm_config: VllmConfig) -> Gate | None:
    """The break-even gate for ``path``; None (and ONE warning) if the file is missing or
    belongs to another model: then nothing is gated. A malformed table is a ConfigError."""
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


def _queue_model(gate: Gate, path: str, key: str = "queue_aware_preload"
                 ) -> QueueModel | None:
    """The queue model of the gate's table, or None (one warning naming the option
    ``key`` that is then off) if the table lacks the recompute times or the disk
    bandwidth it needs."""
    try:
        return QueueModel(gate.table)
    except ValueError as e:
        log.warning("py-kvcache: %s is off: %s (%s); run `kvcache calibrate`", key, e,
                    path)
        return None


class _Unhashed:
    """A GPU block of a synchronous load's range as the offloading scheduler must see it:
    its id, not null, no prefix-cache hash (:meth:`SchedulerSide.load_view`). Read-only
    stand-in, built per synchronous load (not on the per-step path of other requests)."""

    __slots__ = ("block_id",)
    is_null = False
    block_hash = None

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id


def dram_load_sync_supported(cs: object, opts: VllmOptions) -> bool:
    """Whether vLLM's offloading scheduler ``cs`` has the internals ``dram_load_sync``
    uses (vLLM 0.26 and 0.32 do). Without them an explicit ``dram_load_sync: true`` is a
    :class:`ConfigError`; the default (key not set) falls back to asynchronous DRAM loads
    with a warning, so an operator on another vLLM still starts."""
    missing = [a for a in ("_current_batch_load_jobs", "_jobs", "_req_status",
                           "update_connector_output") if not hasattr(cs, a)]
    if missing and opts.dram_load_sync_set:
        raise ConfigError("py-kvcache config key 'dram_load_sync': this vLLM's offloading "
                          "scheduler lacks " + ", ".join(missing) +
                          " (present in vLLM 0.26 and 0.32); set it to false")
    if missing:
        log.warning("py-kvcache: this vLLM's offloading scheduler lacks %s; DRAM hits "
                    "are loaded asynchronously (dram_load_sync off)", ", ".join(missing))
        return False
    return True


class _StoreView:
    """What vLLM 0.26's store-job builder reads of a ``SchedulerOutput``: the scheduled
    requests that may have a chunk to store (req id -> tokens scheduled) and the
    finished ones (vLLM's set, unchanged). Built by :meth:`SchedulerSide.store_view`."""

    __slots__ = ("num_scheduled_tokens", "finished_req_ids")

    def __init__(self, num_scheduled_tokens: dict[str, int],
                 finished_req_ids: set[str] | None) -> None:
        self.num_scheduled_tokens = num_scheduled_tokens
        self.finished_req_ids = finished_req_ids


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

    def __init__(self, gate: Gate, model: QueueModel, key_bytes: int, tokens_per_chunk: int,
                 running_s: float = 0.0) -> None:
        self.gate, self.model = gate, model
        self.key_bytes, self.tpc = key_bytes, tokens_per_chunk
        self.ahead_s = running_s
        self.queued = 0

    def __call__(self, req: Request, n_keys: int) -> bool:
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


class SchedulerSide:
    """The connector's scheduler-role state and logic (engine-core process, scheduler
    thread only; see the module doc).

    Built once by the connector, after vLLM's ``OffloadingConnectorScheduler`` (``cs``,
    whose manager vLLM got from our spec) from the validated options. Owns the gate, the
    queue model, the preload plan, the gate decisions and prefilling requests of the
    queue-aware estimate, and the short requests finished since the last metadata; it
    shares ``manager`` with ``cs`` (vLLM calls the manager too, on the same thread).
    """

    def __init__(self, cs: OffloadingConnectorScheduler, opts: VllmOptions,
                 vllm_config: VllmConfig) -> None:
        manager = cs.manager
        # the connector refuses any spec but ours (prepare_vllm_config), so vLLM's
        # scheduler always got its manager from PyKVCacheSpec.get_manager
        assert isinstance(manager, PyKVCacheManager), type(manager)
        self._cs = cs
        self.manager: PyKVCacheManager = manager
        #: vLLM's per-KV-group offload geometry (fixed for the engine's lifetime)
        self.group_configs: tuple[GroupOffloadConfig, ...] = cs.config.kv_group_configs
        #: k of the patched scheduler's ``on_preload_candidates`` (read every step
        #: through the connector's ``preload_lookahead``); 0 disables preload; with
        #: ``preload_protect_requests`` above ``preload_lookahead``, that many (the
        #: protected view; see ``_plan_k``)
        self.preload_lookahead: int = opts.preload_lookahead
        #: how many of the offered requests preloads are planned for (the configured
        #: ``preload_lookahead``; the offer may be wider for ``preload_protect_requests``)
        self._plan_k: int = opts.preload_lookahead
        self._preload_max: int = opts.preload_max_blocks
        #: ``preload_protect``: the waiting requests' DRAM-tier blocks are evicted last
        #: (needs the patched scheduler's per-step call, so preload_lookahead > 0)
        self._protect: bool = (opts.preload_protect in (True, "auto")
                               and self.preload_lookahead > 0 and manager.dram is not None)
        if opts.preload_protect is True and not self._protect:
            log.warning("py-kvcache: preload_protect needs preload_lookahead > 0 and a "
                        "DRAM tier (dram_cache_bytes > 0): off")
        if self._protect and opts.preload_protect_requests > self.preload_lookahead:
            # the patched scheduler offers the wider view; preloads keep their own k
            self.preload_lookahead = opts.preload_protect_requests
        elif opts.preload_protect_requests and not self._protect:
            log.warning("py-kvcache: preload_protect_requests has no effect while "
                        "preload_protect is off (it needs preload_lookahead > 0 and a "
                        "DRAM tier)")
        #: whether the waiting requests' disk blocks are read ahead (False when the
        #: break-even table says disk loads never win but ``preload_protect`` keeps the
        #: per-step call)
        self._plan_disk: bool = True
        #: ``preload_protect``: whether this step's hook ranked the queue (the patched
        #: scheduler skips the hook when nothing waits; the ranks are then dropped)
        self._ranked: bool = False
        #: keys planned since the last metadata (sent with it, then a new list)
        self._preload_plan: list[bytes] = []
        self.gate: Gate | None = None
        #: queue-aware preload (breakeven.QueueModel), None when off
        self.queue_model: QueueModel | None = None
        #: ``disk_backlog_gate``: the table's recompute times and disk bandwidth
        self.backlog_model: QueueModel | None = None
        #: ``gate_balance``: the same model, the GPU's queue weighed beside the disk's
        self.balance_model: QueueModel | None = None
        #: queue-aware preload and ``gate_balance``: scheduled requests still in prefill
        #: (req id -> request; vLLM counts the tokens a request loads in its
        #: ``num_computed_tokens`` from the step that schedules it: not GPU work)
        self._prefilling: dict[str, Request] = {}
        #: ``gate_balance``: ids of the waiting requests in view at the last preload call
        #: (scheduling order; the patched scheduler's first ``preload_lookahead``)
        self._waiting_ids: list[str] = []
        #: the gate's last decision per waiting request, counted once it is scheduled
        self._gate_decisions: dict[str, tuple[tuple[str, bool], ...]] = {}
        #: requests shorter than this write no files (``disk_min_prefix_tokens``)
        self.disk_min_prefix_tokens = 0
        #: requests shorter than this store nothing (``min_store_prefix_tokens``)
        self.min_store_prefix_tokens = 0
        #: short requests finished since the last metadata build (their last store job is
        #: built in the next one, still without files)
        self._short_finished: list[str] = []
        #: ``dram_load_sync``: waiting requests whose last lookup was answered
        #: synchronous; this step's synchronous load jobs (sent with the metadata); the
        #: ones not yet reported done by every worker (job id -> ranks so far)
        self.dram_load_sync: bool = opts.dram_load_sync
        self._sync_lookup: set[str] = set()
        #: requests scheduled with an asynchronous load (vLLM parks them in
        #: WAITING_FOR_REMOTE_KVS until the load is done and its waiting loop reaches
        #: them again): req id -> request (:meth:`loaded_behind`)
        self._async_loading: dict[str, Request] = {}
        self._sync_jobs: list[int] = []
        self._sync_pending: dict[int, int] = {}
        #: ``disk_load_hold_s`` (0: off) and the held requests: req id -> (monotonic
        #: deadline of its wait, or -1.0 once the deadline passed (it then loads); the
        #: manager's ``load_epoch`` when it was last held)
        self.hold_s: float = opts.disk_load_hold_s
        #: ``disk_load_hold_when`` "no_slot": hold only while the DRAM tier has no room
        self._hold_no_slot: bool = opts.disk_load_hold_when == "no_slot"
        #: ``disk_load_hold_requests``: requests reading from disk that make one wait
        self._hold_k: int = opts.disk_load_hold_requests
        self._holds: dict[str, tuple[float, int]] = {}
        #: requests whose last lookup vLLM deferred because a block of their prefix was
        #: being read into the DRAM tier (HIT_PENDING): req id -> (the manager's
        #: ``load_epoch``, ``num_computed_tokens``, monotonic time) of that lookup
        #: (:meth:`still_deferred`). Scheduler thread.
        self._deferred: dict[str, tuple[int, int, float]] = {}
        self._num_workers: int = int(cs.config.num_workers)
        if self.dram_load_sync:
            self.dram_load_sync = dram_load_sync_supported(cs, opts)
        #: vLLM 0.26 (``compat.STORE_JOB_PREFILTER``): vLLM's store-job builder is handed
        #: :meth:`store_view` of each step's output instead of the whole batch
        self._prompt_only: bool = bool(getattr(cs.config, "offload_prompt_only", False))
        #: tokens per chunk when there is one KV group (the common case: store_view's
        #: fast path), else None
        self._single_tpc: int | None = (self.group_configs[0].tokens_per_chunk
                                        if len(self.group_configs) == 1 else None)
        if compat.STORE_JOB_PREFILTER and hasattr(cs, "_build_store_jobs"):
            build = cs._build_store_jobs  # vLLM's bound method

            def _build_store_jobs(scheduler_output: SchedulerOutput) -> dict:
                return build(self.store_view(scheduler_output))

            cs._build_store_jobs = _build_store_jobs
        if opts.breakeven_table:
            self._init_gate(opts, opts.breakeven_table, vllm_config)
        self.disk_min_prefix_tokens = self._floor(
            opts.disk_min_prefix_tokens, "disk",
            self.gate is not None and not self.gate.never("disk"))
        if self.disk_min_prefix_tokens:
            log.info("py-kvcache: requests with prompts shorter than %d tokens keep their "
                     "KV in the DRAM tier only (no files)", self.disk_min_prefix_tokens)
        self.min_store_prefix_tokens = self._floor(
            opts.min_store_prefix_tokens, "dram", self.manager.dram is not None)
        if self.min_store_prefix_tokens:
            log.info("py-kvcache: requests with prompts shorter than %d tokens store "
                     "nothing (the gate would recompute any hit they could give)",
                     self.min_store_prefix_tokens)

    def _floor(self, value: int | str, tier: str, applies: bool) -> int:
        """A prompt-length floor: ``value``, or for ``"auto"`` the break-even table's
        threshold of ``tier`` when there is a table and ``applies``, else 0."""
        if value != "auto":
            return int(value)
        if self.gate is None or not applies:
            return 0
        return self.gate.table.thresholds.get(tier) or 0

    def _init_gate(self, opts: VllmOptions, path: str, vllm_config: VllmConfig) -> None:
        gate = self.gate = load_gate(path, vllm_config)
        if gate is None:
            return
        self.manager.extra_counters = gate.counters  # reported with the stats
        if opts.gate_balance:
            self.balance_model = _queue_model(gate, path, "gate_balance")
            if self.balance_model is not None:
                gate.counters.update(gate_accepted_balance=0, gate_refused_balance=0)
                log.info("py-kvcache: gate_balance on: a disk prefix is read when the "
                         "disk finishes it before the GPU's queue and its recompute would")
        if opts.disk_backlog_gate and self.balance_model is not None:
            log.info("py-kvcache: disk_backlog_gate is implied by gate_balance")
        elif opts.disk_backlog_gate and not gate.never("disk"):
            self.backlog_model = _queue_model(gate, path, "disk_backlog_gate")
            if self.backlog_model is not None:
                gate.counters.update(gate_accepted_backlog=0, gate_refused_backlog=0)
                log.info("py-kvcache: disk backlog gate on: a disk prefix is read only "
                         "while the reads in flight leave it faster than recompute")
        if opts.queue_aware_preload and self.preload_lookahead == 0:
            log.warning("py-kvcache: queue_aware_preload needs preload_lookahead > 0 "
                        "(it decides which waiting requests to preload): off")
        elif opts.queue_aware_preload:
            self.queue_model = _queue_model(gate, path)
        if self.queue_model is not None:
            log.info("py-kvcache: queue-aware preload on: disk prefixes the gate "
                     "refuses on demand are preloaded when the queue leaves time")
        elif gate.never("disk") and self.balance_model is None:
            # Disk loads are always refused on this node: writing files would only
            # slow the requests that store (and preloading them is wasted I/O).
            self.manager.disk_stores = False
            if self._protect:
                self._plan_disk = False  # the per-step call still orders the DRAM tier
            else:
                self.preload_lookahead = 0
            log.info("py-kvcache: the break-even table says disk loads never beat "
                     "recompute here: disk writes and preloads are off, the DRAM "
                     "tier (if any) still stores and serves")

    # ------------------------------------------------------------------ lookup + gate
    def begin_lookup(self, request: Request) -> bool:
        """Before vLLM's lookup of ``request`` (per waiting request per step): a request
        shorter than ``min_store_prefix_tokens`` is marked in the manager to store nothing,
        else one shorter than ``disk_min_prefix_tokens`` is marked short (its stores
        write no files). Returns whether the break-even gate judges this lookup (then
        the manager starts collecting its source tiers)."""
        n = request.num_prompt_tokens
        if self.min_store_prefix_tokens and n < self.min_store_prefix_tokens:
            self.manager.nostore_requests.add(request.request_id)
        elif self.disk_min_prefix_tokens and n < self.disk_min_prefix_tokens:
            self.manager.short_requests.add(request.request_id)
        if self.gate is None and not self.dram_load_sync and not self.hold_s:
            return False
        self.manager.begin_lookup()
        return True

    def touch_request(self, request: Request) -> None:
        """After vLLM's lookup of ``request`` on a vLLM whose scheduler does not call
        ``OffloadingManager.touch`` (0.32, :data:`~kvcache_core.vllm.compat.MANAGER_TOUCH`):
        the touch 0.26's ``_touch`` does at that point, the request's whole key list per
        KV group (every group is full attention: the connector refuses other models).
        Scheduler thread; does nothing for a request vLLM does not track or whose lookup
        was delayed before its keys were computed (no keys yet). 0.26's second touch,
        after each store job, is not repeated: the lookup's key list already holds every
        prompt chunk a store job can add, which is what ``complete_store`` orders by."""
        st = self._cs._req_status.get(request.request_id)
        if st is None:
            return
        touch, ctx = self.manager.touch, st.req_context
        for gs in st.group_states:
            if gs.offload_keys:
                touch(gs.offload_keys, ctx)

    def end_lookup(self, request: Request, num_computed_tokens: int,
                   found: tuple[int | None, bool]) -> tuple[int | None, bool]:
        """vLLM's lookup result ``found`` after :meth:`begin_lookup` returned True: the
        break-even gate (:meth:`gate_lookup`), then ``disk_load_hold_s`` (:meth:`_hold`:
        ``(None, False)``, vLLM asks again next step), then ``dram_load_sync``: a load
        whose every chunk is in the DRAM tier is answered synchronous (``(n, False)``),
        unless it covers the whole request."""
        result = self.gate_lookup(request, num_computed_tokens, found)
        rid = request.request_id
        if self.hold_s and self._hold(rid, found, result):
            self._sync_lookup.discard(rid)
            return None, False
        if not self.dram_load_sync:
            return result
        n = result[0]
        # A hit that reaches the end of the request stays asynchronous: vLLM then
        # recomputes the last token itself, while a synchronous load must leave at least
        # one token to compute in this step (vLLM's scheduler asserts it).
        if n and result[1] and num_computed_tokens + n < request.num_tokens:
            manager = self.manager
            # the gate may have kept only the leading DRAM/staged chunks of the prefix
            tier = manager.lookup_tier() if n == found[0] else manager.lookup_fast_chunks()[1]
            if tier == "dram":
                self._sync_lookup.add(rid)
                return n, False
        self._sync_lookup.discard(rid)
        return result

    def _hold(self, rid: str, found: tuple[int | None, bool],
              result: tuple[int | None, bool]) -> bool:
        """``disk_load_hold_s``: whether request ``rid``, whose lookup gave ``found`` and
        the gate ``result``, waits this step. It waits when the gate let it load its
        whole prefix, part of which must come from disk and is not being read for
        another request already (:meth:`PyKVCacheManager.lookup_disk_new_chunks`: a
        request whose disk chunks are all in flight joins those reads), while
        ``disk_load_hold_requests``
        other requests' disk loads are in flight (the manager's ``disk_load_requests``;
        a waiting request has none of its own) and, with
        ``disk_load_hold_when="no_slot"``, the DRAM tier cannot take its disk chunks now
        (:meth:`PyKVCacheManager.dram_short`), until ``hold_s`` after its first wait;
        from then on it loads. Scheduler thread."""
        n, m = result[0], self.manager
        if (not n or n != found[0] or m.disk_load_requests < self._hold_k
                or m.lookup_tier() != "disk"):
            return False
        if not m.lookup_disk_new_chunks():
            # every disk chunk it needs is being read for another request right now: it
            # joins those reads and adds nothing to the disk's queue; held, it would read
            # them again once they are done (the fifty-client runs at 10k, thirty-eighth
            # session: 1.8x the distinct bytes with the hold, 1.1x without)
            if rid not in self._holds:
                m.counters["loads_hold_joined"] += 1
            return False
        if self._hold_no_slot and not m.dram_short(m.lookup_disk_chunks()):
            return False  # disk_load_hold_when="no_slot": the tier can take its chunks
        held = self._holds.get(rid)
        if held is None:
            self._holds[rid] = (time.monotonic() + self.hold_s, m.load_epoch)
            m.counters["loads_held"] += 1
            return True
        until = held[0]
        if until < 0:
            return False
        if time.monotonic() < until:
            self._holds[rid] = (until, m.load_epoch)
            return True
        self._holds[rid] = (-1.0, m.load_epoch)
        m.counters["loads_hold_expired"] += 1
        return False

    def still_held(self, request: Request) -> bool:
        """Before vLLM's lookup of ``request`` (``disk_load_hold_s`` on): True when it
        was held and nothing it waits for changed since (still
        ``disk_load_hold_requests`` requests reading from disk, no disk load ended and
        no block was staged since: the manager's ``load_epoch``; its wait not yet over),
        so the connector answers "not yet" without a lookup: a held request costs no
        per-chunk work per step. Scheduler thread."""
        held = self._holds.get(request.request_id)
        if held is None or held[0] < 0:
            return False
        m = self.manager
        return (m.disk_load_requests >= self._hold_k and held[1] == m.load_epoch
                and time.monotonic() < held[0])

    def still_deferred(self, request: Request, num_computed_tokens: int) -> bool:
        """Before vLLM's lookup of ``request``: True when its last lookup was deferred on
        a block being promoted (:meth:`note_lookup`) and nothing that lookup waited for
        can have changed: no disk load ended and no block was staged since (the
        manager's ``load_epoch``; a promotion ends only with its load), the same
        ``num_computed_tokens``, and less than :data:`DEFERRED_MAX_S` ago. The connector
        then answers "not yet" without vLLM's scan of every chunk key: on the H100's
        fifty-client 40k runs (thirty-seventh session) those repeated scans of waiting
        requests held the engine's main thread 10-18 s of 31-55. Scheduler thread;
        O(1)."""
        d = self._deferred.get(request.request_id)
        return (d is not None and d[0] == self.manager.load_epoch
                and d[1] == num_computed_tokens
                and time.monotonic() - d[2] < DEFERRED_MAX_S)

    def note_lookup(self, request: Request, num_computed_tokens: int,
                    pending: bool) -> None:
        """After the connector's lookup of ``request``: ``pending`` = vLLM deferred it
        ("not yet") on a block another request is reading into the DRAM tier
        (HIT_PENDING), remembered for :meth:`still_deferred`; else forgotten.
        Scheduler thread."""
        if pending:
            self._deferred[request.request_id] = (self.manager.load_epoch,
                                                  num_computed_tokens, time.monotonic())
        elif self._deferred:
            self._deferred.pop(request.request_id, None)

    def gate_lookup(self, request: Request, num_computed_tokens: int,
                    found: tuple[int | None, bool]) -> tuple[int | None, bool]:
        """The break-even gate (R9) on vLLM's lookup result ``found`` (after
        :meth:`begin_lookup` returned True): a reusable prefix shorter than its source
        tier's threshold is refused (0 tokens) and vLLM recomputes it, except for its
        leading chunks in the DRAM tier or staged by a preload when those alone pass."""
        n = found[0]
        gate = self.gate
        if not n or gate is None:
            return found
        manager, rid = self.manager, request.request_id
        tier = manager.lookup_tier()
        refused: tuple[str, bool] = (tier, False)
        if tier == "disk" and self.balance_model is not None:
            if self._disk_first(rid, num_computed_tokens, n):
                self._gate_decisions[rid] = (("balance", True),)
                return found
            refused = ("balance", False)
        elif gate.passes(tier, num_computed_tokens + n):
            if tier != "disk" or self.backlog_model is None:
                self._gate_decisions[rid] = ((tier, True),)
                return found
            if not self._disk_backlogged(num_computed_tokens, n):
                self._gate_decisions[rid] = ((tier, True), ("backlog", True))
                return found
            refused = ("backlog", False)
        # Refused because part of the prefix must come from disk: the leading chunks that
        # are in the DRAM tier or staged by a preload may still be worth loading alone.
        fast, fast_tier = manager.lookup_fast_chunks()
        groups = self.group_configs
        if fast and len(groups) == 1:
            tpc = groups[0].tokens_per_chunk
            m = tpc * (num_computed_tokens // tpc + fast) - num_computed_tokens
            if 0 < m < n and gate.passes(fast_tier, num_computed_tokens + m):
                self._gate_decisions[rid] = (refused, (fast_tier, True))
                return m, True
        self._gate_decisions[rid] = (refused,)
        return 0, False

    def _disk_first(self, rid: str, num_computed_tokens: int, n: int) -> bool:
        """``gate_balance``: whether reading the disk part of a prefix of ``n`` tokens
        after ``num_computed_tokens`` costs the queue less time than recomputing it.

        Reading it, the request has its prefix when the disk delivers it
        (:meth:`_read_and_recompute_s`: the loads in flight plus its own); recomputing,
        when the GPU has done the prefill still queued on it (:meth:`_prefill_left_s`,
        without ``rid`` itself: a preempted request is still listed) plus its recompute
        ``g``, and each of the ``k`` waiting requests in view behind it
        (:meth:`_waiting_behind`) waits ``g`` longer for the GPU. The disk wins when
        ``read <= prefill_left + (k + 1) * g`` (the sum of the waits: an exchange
        argument over the two servers). ``k`` matters because vLLM admits a waiting
        request only in a step with token budget left, i.e. when the GPU is about to be
        free: the prefill queued on it is then near 0 and, by its own finish time alone,
        every request would recompute (thirty-third session: 9-11 of 9-11 disk prefixes
        recomputed, 1.26-1.30x slower than reading them). Scheduler thread."""
        model = self.balance_model
        assert model is not None
        read_s, recompute_s = self._read_and_recompute_s(model, num_computed_tokens, n)
        gpu_s = self._prefill_left_s(model, rid) + (self._waiting_behind(rid) + 1) * recompute_s
        return read_s <= gpu_s

    def _waiting_behind(self, rid: str) -> int:
        """How many waiting requests in view (the last :meth:`on_preload_candidates`
        call's) wait behind request ``rid``: those after it in scheduling order (all of
        them when it is not in view) that are not scheduled yet (a request scheduled
        earlier in this step is in ``_prefilling``). 0 without the patched scheduler's
        call or with ``preload_lookahead`` 0. Scheduler thread; O(preload_lookahead)."""
        ids, prefilling = self._waiting_ids, self._prefilling
        start = ids.index(rid) + 1 if rid in ids else 0
        return sum(1 for i in range(start, len(ids)) if ids[i] not in prefilling)

    def _disk_backlogged(self, num_computed_tokens: int, n: int) -> bool:
        """``disk_backlog_gate``: whether the disk part of a prefix of ``n`` tokens after
        ``num_computed_tokens`` would arrive later than the GPU recomputes it
        (:meth:`_read_and_recompute_s`); False while no disk load is in flight (the
        static gate already decided). Scheduler thread; arithmetic only."""
        model = self.backlog_model
        assert model is not None
        if not self.manager.disk_loads_in_flight:
            return False  # the disk is free: the static gate already decided
        read_s, recompute_s = self._read_and_recompute_s(model, num_computed_tokens, n)
        return read_s > recompute_s

    def _read_and_recompute_s(self, model: QueueModel, num_computed_tokens: int,
                              n: int) -> tuple[float, float]:
        """By ``model`` (the table), for the last lookup's prefix of ``n`` tokens after
        ``num_computed_tokens`` (:meth:`PyKVCacheManager.lookup_disk_chunks` chunks from
        disk, its leading ``lookup_fast_chunks`` in host memory): when its disk part
        would be read, the disk loads in flight (every request's, one chunk each,
        ``disk_loads_in_flight``) plus its own at the table's disk bandwidth; and the
        recompute time of its tokens after the leading host-memory chunks (those load
        either way). Scheduler thread; arithmetic only."""
        manager = self.manager
        read_s = model.read_s((manager.disk_loads_in_flight + manager.lookup_disk_chunks())
                              * manager.key_bytes)
        tpc = self._single_tpc or self.group_configs[0].tokens_per_chunk
        fast = manager.lookup_fast_chunks()[0]
        start = min(num_computed_tokens + n, tpc * (num_computed_tokens // tpc + fast))
        end = num_computed_tokens + n
        return read_s, model.recompute_s(end) - model.recompute_s(start)

    # ------------------------------------------------------------------ preload (R8)
    def on_preload_candidates(self, requests: list[Request]) -> None:
        """Once per step (patched vLLM), before the metadata is built: plan preloads for
        the first ``preload_lookahead`` waiting ``requests`` (scheduling order); with
        ``preload_protect``, their DRAM-tier blocks become the last to be evicted first.
        The manager notes their count for this step (the write-back's bound,
        ``writeback_max_fraction`` ``auto``). With ``preload_protect_requests`` above
        ``preload_lookahead`` the patched scheduler offers that many: all of them are
        protected, the first ``preload_lookahead`` are the ones preloaded and counted."""
        view = requests
        if len(requests) > self._plan_k:
            requests = requests[:self._plan_k]
        self.manager.note_waiting(len(requests))
        if self.balance_model is not None:
            self._waiting_ids = [r.request_id for r in requests]
        if self._protect:
            self.manager.protect_queue(view, self.group_configs)
            self._ranked = True
        if not self._plan_disk:
            return
        admit = None
        if self.queue_model is not None:
            assert self.gate is not None  # the queue model is the gate's table's
            admit = _QueueAdmission(self.gate, self.queue_model, self.manager.key_bytes,
                                    self.group_configs[0].tokens_per_chunk,
                                    self._prefill_left_s(self.queue_model))
        self._preload_plan += self.manager.plan_preloads(requests, self.group_configs,
                                                         self._preload_max, admit)

    def _prefill_left_s(self, m: QueueModel, skip: str | None = None) -> float:
        """Expected compute time left, by ``m``'s recompute times, of the scheduled
        requests still in prefill other than ``skip`` (how long a request scheduled now
        waits for the GPU); the tokens a request loads from outside count as no GPU work.
        Forgets the requests whose prefill is done. Scheduler thread."""
        left, done = 0.0, []
        for rid, r in self._prefilling.items():
            n, c = r.num_prompt_tokens, r.num_computed_tokens
            if c >= n:
                done.append(rid)
                continue
            if rid == skip:
                continue
            left += m.recompute_s(n) - m.recompute_s(c)
        for rid in done:
            del self._prefilling[rid]
        return left

    # ------------------------------------------------------------------ request life
    def after_alloc(self, request: Request) -> None:
        """``request`` was scheduled (``update_state_after_alloc``): its gate decision
        is counted, it joins the prefilling requests of the queue-aware estimate and of
        ``gate_balance``, and it waits no more (``disk_load_hold_s``)."""
        if self._holds:
            self._holds.pop(request.request_id, None)
        if self.queue_model is not None or self.balance_model is not None:
            self._prefilling[request.request_id] = request
        if self._gate_decisions:
            decisions = self._gate_decisions.pop(request.request_id, ())
            if decisions:
                assert self.gate is not None
                for tier, ok in decisions:
                    self.gate.count(tier, ok)

    def load_view(self, request: Request, blocks: KVCacheBlocks,
                  num_external_tokens: int) -> KVCacheBlocks:
        """``blocks`` as vLLM's offloading scheduler must see them to build the load job
        of ``request`` (before ``update_state_after_alloc``). For an asynchronous load,
        ``blocks`` itself. For a synchronous one (``dram_load_sync``) with vLLM's GPU
        prefix cache on, vLLM has already entered the blocks of the loaded range in its
        prefix cache (it delays that only for asynchronous loads), and the offloading
        scheduler takes a block with a hash for one computed on the GPU: it would build
        a load job without those blocks, and the request would compute on KV that was
        never loaded. So the blocks of the loaded range are shown without their hash
        (:class:`_Unhashed`, a read-only stand-in: vLLM's own blocks are not touched).
        Scheduler thread."""
        rid = request.request_id
        if not num_external_tokens or rid not in self._sync_lookup:
            return blocks
        local = self._cs._req_status[rid].num_locally_computed_tokens
        end = local + num_external_tokens
        groups = []
        for gc, gb in zip(self.group_configs, blocks.blocks, strict=True):
            tpb = gc.tokens_per_block
            lo, hi = local // tpb, min(-(-end // tpb), len(gb))
            if lo >= hi:
                groups.append(gb)
                continue
            view = list(gb)
            for i in range(lo, hi):
                b = view[i]
                if not b.is_null and b.block_hash is not None:
                    view[i] = _Unhashed(b.block_id)
            groups.append(view)
        return KVCacheBlocks(tuple(groups))

    def after_load_job(self, request: Request, num_external_tokens: int) -> None:
        """After vLLM's ``update_state_after_alloc`` of ``request`` (scheduled this step):
        if its lookup was answered synchronous and vLLM built a load job for it, the job
        is completed in vLLM's scheduler now (as if every worker had reported it: the
        request computes in this step, and vLLM builds store jobs only for requests
        without a pending load) while the manager keeps the DRAM slots pinned until the
        workers report the copy done (:meth:`on_worker_meta`)."""
        rid = request.request_id
        if rid not in self._sync_lookup:
            if num_external_tokens:
                self._async_loading[rid] = request
            return
        self._sync_lookup.discard(rid)
        if not num_external_tokens:
            return
        cs = self._cs
        job = None
        for j, t in cs._current_batch_load_jobs.items():
            if t.req_id == rid:
                job = j
                break
        if job is None:  # pragma: no cover - vLLM builds one job per loading request
            return
        self.manager.hold_loads(job, rid, cs._jobs[job].keys)
        self.manager.counters["loads_sync"] += 1
        cs.update_connector_output(KVConnectorOutput(
            kv_connector_worker_meta=OffloadingWorkerMetadata(
                completed_jobs={job: self._num_workers})))
        self._sync_jobs.append(job)
        self._sync_pending[job] = 0

    def loaded_behind(self, request: Request) -> bool:
        """Whether another request's asynchronous load is done while vLLM still has it
        parked (WAITING_FOR_REMOTE_KVS, its GPU blocks allocated): the connector then
        answers ``request``'s lookup "not yet".

        Why: vLLM 0.26's FCFS waiting loop stops at the first request it cannot allocate
        blocks for, and promotes a parked request only when the loop reaches it. A
        request deferred once (RETRY, HIT_PENDING) sits ahead of later requests in the
        skipped queue; if a later one was scheduled with a load meanwhile and holds the
        blocks, the earlier one fails its allocation at the head every step and the
        loaded one behind it is never promoted: the engine steps forever with nothing
        running (reproduced on the CPU with ``disk_lookup_async="on"``: 1.2 million
        lookups of one request in 150 s). Deferring the lookup lets the loop reach the
        loaded request, which then runs and frees its blocks. A request is never parked
        behind one that is still waiting for vLLM's loop in any other way: in FCFS the
        skipped queue (where parked requests wait) is served first, so a finished load
        is promoted before any request of the main queue is looked up.
        Scheduler thread; O(requests with an asynchronous load in flight)."""
        al = self._async_loading
        if not al:
            return False
        rs = getattr(self._cs, "_req_status", None)
        own = request.request_id
        stale: list[str] | None = None
        found = False
        for rid, req in al.items():
            if req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                if req.status != RequestStatus.WAITING:  # promoted, running or done
                    (stale := stale or []).append(rid)
                continue
            if rid == own or rs is None:
                continue
            st = rs.get(rid)
            if st is None or not getattr(st, "transfer_jobs", True):
                found = True  # its load jobs are all done: only the loop keeps it
                break
        for rid in stale or ():
            del al[rid]
        return found

    def forget(self, request: Request) -> None:
        """``request`` finished (``request_finished*``): drop its state; a short one
        stays marked until the next metadata carries its last store job."""
        self._sync_lookup.discard(request.request_id)
        self._async_loading.pop(request.request_id, None)
        self._prefilling.pop(request.request_id, None)
        self._gate_decisions.pop(request.request_id, None)
        self._holds.pop(request.request_id, None)
        self._deferred.pop(request.request_id, None)
        if self.disk_min_prefix_tokens or self.min_store_prefix_tokens:
            self._short_finished.append(request.request_id)

    # ------------------------------------------------------------------ per-step metadata
    def build_connector_meta(self, meta: KVConnectorMetadata) -> KVConnectorMetadata:
        """This step's metadata from vLLM's ``meta`` (built just before, with the final
        store jobs of the requests finished since the last step): vLLM's own object when
        there is nothing to add, else a :class:`PyKVCacheConnectorMetadata` with the
        preload plan and the manager's deferred write-backs. Every step's metadata reaches
        the workers' ``start_load_kv`` (with or without a forward), so the slots pinned for
        the write-backs are always released. With ``preload_protect``, a step in which
        nothing waited drops the queue ranks (no request in view any more); the
        manager ends its step (its queue count is cleared)."""
        self.manager.end_step()
        if self._protect:
            if not self._ranked:
                self.manager.protect_queue((), self.group_configs)
            self._ranked = False
        if self._short_finished:  # their final store jobs were built just now
            short = self.manager.short_requests
            nostore = self.manager.nostore_requests
            for rid in self._short_finished:
                short.discard(rid)
                nostore.discard(rid)
            self._short_finished.clear()
        flush = self.manager.take_flush_plan()
        if not (self._preload_plan or flush or self._sync_jobs):
            return meta
        assert isinstance(meta, OffloadingConnectorMetadata), type(meta)
        plan, self._preload_plan = self._preload_plan, []
        sync, self._sync_jobs = self._sync_jobs, []
        return PyKVCacheConnectorMetadata.extend(meta, plan, flush, sync)

    def store_view(self, scheduler_output: SchedulerOutput) -> SchedulerOutput | _StoreView:
        """The part of this step's ``scheduler_output`` that vLLM 0.26's store-job builder
        must see (scheduler thread, once per step, inside vLLM's ``build_connector_meta``).

        vLLM's builder walks every scheduled request each step (~4 us each on the CPU
        machine) although a running request has a new chunk to store only
        when its computed tokens cross a chunk boundary (every ``tokens_per_chunk``
        tokens, i.e. once in hundreds of decode steps). Kept: a request whose tokens
        after this step reach past its next unstored chunk in some KV group
        (``(num_computed_tokens + scheduled) // tokens_per_chunk >
        next_stored_chunk_idx``, capped at the prompt with ``offload_prompt_only``: an
        upper bound of vLLM's own count), and any finished one. Dropped: the others
        (vLLM would find nothing to store and only re-set the same index), those vLLM
        does not track, and requests marked to store nothing (``min_store_prefix_tokens``:
        their chunks reach ``prepare_store`` once, when they finish, and are counted as
        skipped then). Returns ``scheduler_output`` itself when every request is kept."""
        sched = scheduler_output.num_scheduled_tokens
        if not sched:
            return scheduler_output
        rs = self._cs._req_status
        nostore = self.manager.nostore_requests
        prompt_only = self._prompt_only
        groups = self.group_configs
        tpc = self._single_tpc
        keep: dict[str, int] = {}
        for rid, n in sched.items():
            st = rs.get(rid)
            if st is None or rid in nostore:
                continue
            req = st.req
            upto = req.num_computed_tokens + n
            if prompt_only and upto > req.num_prompt_tokens:
                upto = req.num_prompt_tokens
            if tpc is not None:
                due = upto // tpc > st.group_states[0].next_stored_chunk_idx
            else:
                due = any(upto // g.tokens_per_chunk > s.next_stored_chunk_idx
                          for g, s in zip(groups, st.group_states, strict=True))
            if due or req.is_finished():
                keep[rid] = n
        if len(keep) == len(sched):
            return scheduler_output
        return _StoreView(keep, scheduler_output.finished_req_ids)

    # ------------------------------------------------------------------ worker reports
    def on_worker_meta(self, meta: KVConnectorWorkerMetadata | None) -> None:
        """The workers' aggregated report of a step (``update_connector_output``, before
        vLLM processes the same step's job completions): failed loads rewind their
        requests' store cursors, then failures, counters, staged and written keys and
        job latencies go to the manager."""
        if not isinstance(meta, PyKVCacheWorkerMetadata):
            return
        if meta.failed_keys:
            self._restore_failed(meta.failed_keys)
        self.manager.on_worker_report(meta.failed_keys, meta.counters, meta.staged,
                                      meta.written, meta.observations)
        pending = self._sync_pending
        for job, ranks in meta.sync_done.items():
            n = pending.get(job)
            if n is None:
                continue
            n += ranks
            if n >= self._num_workers:
                del pending[job]
                self.manager.release_held(job)  # after the failed keys are known
            else:
                pending[job] = n

    def _restore_failed(self, failed_keys: Collection[bytes]) -> None:
        """Self-healing (issue 12 item 4): a chunk whose load failed is recomputed by its
        request (vLLM resets the request's computed tokens to that chunk in this same
        ``update_from_output``, before this hook); rewind the request's store cursor to
        the first failed chunk so that vLLM's store-job builder stores the recomputed
        chunks (keys still cached are skipped by ``prepare_store``). Without it vLLM
        treats loaded chunks as already offloaded and the next request recomputes too.

        Reads vLLM's per-request offload state (``_req_status``: ``group_states`` with
        ``offload_keys`` and ``next_stored_chunk_idx``), the same in 0.26 and 0.32."""
        req_status = self._cs._req_status
        manager = self.manager
        for rid, keys in manager.loads_of(failed_keys).items():
            st = req_status.get(rid)
            if st is None:
                continue
            for gs in st.group_states:
                okeys, nxt = gs.offload_keys, gs.next_stored_chunk_idx
                first = next((i for i, k in enumerate(okeys[:nxt]) if k in keys), None)
                if first is not None:
                    gs.next_stored_chunk_idx = first
                    manager.counters["restores_planned"] += sum(
                        1 for k in okeys[first:nxt] if k in keys)
