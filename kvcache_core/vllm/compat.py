"""The vLLM release adapter: every difference between the supported vLLM releases that
:mod:`kvcache_core.vllm` depends on, and the version check.

Supported: vLLM 0.26.x and 0.32.x (:data:`RELEASE_LINES`, i.e.
:data:`kvcache_core.patching.RUNTIME_LINES`; each has a patch series in
``kvcache_core/vllm_patches/``, see :func:`kvcache_core.patching.supported_versions`; the
v0.34.0 series has no adapter yet: docs/vllm-0.34-api.md).
Everything else of the Offload API and of the offloading connector that py-kvcache uses
is the same in both lines and is used directly by the other modules (one code path);
what differs is here, as functions and constants selected ONCE, at import, by the
running vLLM's version. Each says what changed in which release.

Not adapted because our code already is release-neutral:

* ``BlockIDsLoadStoreSpec.block_ids`` became ``int32`` (0.32); ``KVGeometry.split``
  converts to ``int64`` before computing byte offsets.
* ``OffloadingGroupConfig.group_id`` / keys carry the ORIGINAL KV-cache group index
  (0.32 offloads only prefix-cacheable groups); py-kvcache refuses every model with a
  group that is not full attention, so every group is offloaded and indices agree.
* ``OffloadingConnector.get_num_new_matched_tokens`` caps loads by ``max_load_tokens``
  and the groups it does not offload (0.32); our subclass calls it and only ever
  returns fewer tokens than it did.
* ``OffloadPolicy.BLOCK_LEVEL`` was renamed ``CHUNK_LEVEL`` (0.32); we return the
  default ``RequestOffloadingContext()``.
* Store jobs are queued in ``wait_for_save`` (0.32) instead of ``get_finished`` (0.26),
  and ``start_load_kv`` may run after the forward launch (0.32); the preload hook
  (patch 0003 of each series) runs right after the metadata is bound in both.

On any other vLLM, :func:`require` raises :class:`UnsupportedVLLMError` naming the
supported lines; it is called before ``kvcache_core.vllm`` hands vLLM any of its classes
(so vLLM's connector and spec factories fail with that message), by the connector's and
the spec's constructors, and by the plugin when a py-kvcache ``--kv-transfer-config`` is
parsed (the plugin itself registers on any vLLM and touches no other configuration).
The adapters below then keep their 0.26 behaviour but are never reached.
"""

from __future__ import annotations

import re
from typing import Any

from ..config import ConfigError
from ..patching import RUNTIME_LINES

#: release lines (major.minor) this module has adapters for, oldest first (defined beside
#: the patch series, whose tooling reads it without importing vLLM)
RELEASE_LINES: tuple[str, ...] = RUNTIME_LINES


class UnsupportedVLLMError(ConfigError):
    """The installed vLLM is not a release line py-kvcache supports."""


def release_line(version: str) -> str | None:
    """``"0.26"`` / ``"0.32"`` for a version of a supported line (local labels such as
    ``+cpu`` ignored, patch releases and pre-releases of the line included), else None."""
    m = re.match(r"\s*v?(\d+)\.(\d+)", version)
    if not m:
        return None
    line = f"{int(m.group(1))}.{int(m.group(2))}"
    return line if line in RELEASE_LINES else None


def supported_text() -> str:
    """``"0.26.x and 0.32.x"``."""
    lines = [f"{v}.x" for v in RELEASE_LINES]
    return " and ".join([", ".join(lines[:-1]), lines[-1]] if len(lines) > 1 else lines)


def check_supported(version: str | None = None) -> str:
    """The release line of ``version`` (default: the importable vLLM's).

    Raises :class:`UnsupportedVLLMError` naming the supported lines and the patch
    series py-kvcache ships for any other version.
    """
    if version is None:
        version = installed_version()
    line = release_line(version)
    if line is None:
        from ..patching import supported_versions

        raise UnsupportedVLLMError(
            f"py-kvcache does not support vLLM {version}: it runs on vLLM "
            f"{supported_text()} only (patch series shipped: "
            f"{', '.join(supported_versions()) or 'none'}; a series that applies to a "
            "release is not runtime support, see docs/patch-compat.md). Install a "
            "supported vLLM "
            "(`make dev` builds 0.26.0, `make dev-0.32` builds 0.32.0) or use vLLM's own "
            "offloading without kv_connector_module_path/spec_module_path "
            "'kvcache_core.vllm'.")
    return line


def installed_version() -> str:
    """``vllm.__version__`` of the importable vLLM (imports the ``vllm`` package)."""
    import vllm

    return str(vllm.__version__)


#: ``vllm.__version__`` of the running vLLM
VLLM_VERSION: str = installed_version()
#: its release line ("0.26" or "0.32"); None for an unsupported vLLM (see :func:`require`)
VLLM_LINE: str | None = release_line(VLLM_VERSION)
IS_0_32: bool = VLLM_LINE == "0.32"


def require() -> str:
    """The running vLLM's release line; raises :class:`UnsupportedVLLMError` (naming the
    supported lines) on any other vLLM."""
    return VLLM_LINE if VLLM_LINE is not None else check_supported(VLLM_VERSION)


if IS_0_32:
    from vllm.v1.kv_offload.base import Medium
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    #: ``OffloadingEvent.medium`` of py-kvcache's KV events. 0.26: any string (ours:
    #: ``"PYKVCACHE"``); 0.32: a ``Medium`` enum member, mapped to the event's medium
    #: string by the events tracker (a string there raises KeyError). Stored blocks are
    #: written through to the disk tier, so ``Medium.STORAGE``.
    EVENT_MEDIUM: Any = Medium.STORAGE
else:
    EVENT_MEDIUM = "PYKVCACHE"


#: Whether vLLM's offloading scheduler's store-job builder (``_build_store_jobs``) may
#: be handed only the scheduled requests that can have a new chunk to store
#: (:meth:`~kvcache_core.vllm.connector_scheduler.SchedulerSide.store_view`). 0.26: yes;
#: its builder reads only ``num_scheduled_tokens`` and ``finished_req_ids`` of the
#: scheduler output, and for a running request whose storable chunk count did not pass
#: ``next_stored_chunk_idx`` it does nothing. 0.32: no (its builder also serves
#: retention intervals and sliding-window tails): vLLM's full loop runs.
STORE_JOB_PREFILTER: bool = VLLM_LINE == "0.26"


#: Whether vLLM's offloading scheduler calls ``OffloadingManager.touch`` itself. 0.26: yes,
#: after every lookup (``get_num_new_matched_tokens``) and every store job, with the
#: request's whole key list per KV group. 0.32: never (its manager API moved recency
#: into ``lookup`` / ``prepare_*`` / ``on_request_finished``, which vLLM's CPU manager
#: records itself); py-kvcache's manager keeps its recency, its tail-first order and the
#: ``lru-admit`` admission's per-request input in ``touch``, so on 0.32 the connector
#: calls it after each lookup, as 0.26's scheduler did
#: (:meth:`~kvcache_core.vllm.connector_scheduler.SchedulerSide.touch_request`). Without
#: that, 0.32 ran ``lru-admit`` as plain LRU: its filter never saw a request.
MANAGER_TOUCH: bool = VLLM_LINE == "0.26"


def offload_cache_dtype(config: Any, model_dtype: str | None) -> str:
    """The KV-cache dtype as 0.26 reports it in ``OffloadingConfig.model.dtype``:
    ``"auto"`` unless ``--kv-cache-dtype`` names another dtype than the model's.

    0.26: ``model.dtype`` is ``cache_config.cache_dtype`` (``"auto"`` by default).
    0.32: it is resolved (the model dtype when ``cache_dtype == "auto"``); a value equal
    to the model dtype is mapped back to ``"auto"`` (same KV bytes), so both releases
    name the dtype of a namespace alike (:func:`~kvcache_core.vllm.options.namespace_dtype`).
    """
    dtype = str(config.model.dtype).replace("torch.", "")
    if IS_0_32 and model_dtype is not None and dtype == model_dtype.replace("torch.", ""):
        return "auto"
    return dtype


def kv_cache_layout(config: Any) -> str | None:
    """vLLM's KV-cache layout name as a namespace field, None where it adds nothing.

    0.26: the connector requires ``"HND"`` and ``OffloadingConfig`` does not carry it:
    None (namespaces stay as they were before 0.32 support). 0.32: the connector
    requires ``"LBHNC"`` (``"BLHNC"`` with hisparse) and ``OffloadingConfig`` carries the
    resolved ``kv_cache_layout``: it goes into the namespace, so files written by one
    release are never read as KV by the other (nothing checks that their page bytes
    agree).
    """
    if not IS_0_32:
        return None
    return str(getattr(config, "kv_cache_layout", None) or "?")


def disk_allowed(req_context: Any) -> bool:
    """Whether the request may load from the disk tier (the DRAM tier always may).

    0.26: no per-request tier filter: True. 0.32: ``ReqContext.load_tier_filter``
    (``kv_transfer_params["kv_load_tiers"]``), applied like vLLM's tiering manager
    applies it to its secondary tiers: the disk tier is ``Medium.STORAGE`` of unknown
    locality (a shared root may be local or remote).
    """
    if not IS_0_32:
        return True
    f = getattr(req_context, "load_tier_filter", None)
    return f is None or f.allows(Medium.STORAGE, None)


def request_disk_allowed(request: Any) -> bool:
    """:func:`disk_allowed` for a vLLM ``Request`` that has no ``ReqContext`` yet (a
    waiting request planned for preload). 0.26: True. 0.32: parses the request's
    ``kv_load_tiers`` with vLLM's own parser."""
    if not IS_0_32:
        return True
    params = getattr(request, "kv_transfer_params", None)
    if not params:
        return True
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as S

    raw = params.get(S.KV_LOAD_TIERS_KEY)
    return raw is None or S._parse_tier_filter(raw).allows(Medium.STORAGE, None)


def max_load_tokens(request: Any) -> int | None:
    """Per-request cap on the tokens loaded from offloaded KV, None for no cap.

    0.26: none. 0.32: ``kv_transfer_params["max_load_tokens"]`` (an int >= 0; vLLM
    ignores other values), which vLLM's lookup applies; the preload planner applies it
    too so that it never reads blocks the request will not load.
    """
    if not IS_0_32:
        return None
    params = getattr(request, "kv_transfer_params", None)
    raw = params.get("max_load_tokens") if params else None
    return raw if type(raw) is int and raw >= 0 else None


def hit_source(tier: str) -> Any:
    """``OffloadingManager.get_load_source`` value for a hit from ``tier`` ("dram" or
    "disk"). 0.26: the method does not exist (None). 0.32: ``CacheHitSource.HOST`` /
    ``CacheHitSource.DISK`` (vLLM's per-source prefix-cache hit metrics)."""
    if not IS_0_32:
        return None
    return CacheHitSource.HOST if tier == "dram" else CacheHitSource.DISK
