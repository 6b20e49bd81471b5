"""py-kvcache for vLLM 0.26.x and 0.32.x (the KV Offload API).

Enable it with::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector",
        "kv_connector_module_path": "kvcache_core.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "PyKVCacheSpec",
            "spec_module_path": "kvcache_core.vllm", "root_dir": "/nvme/kvcache",
            "block_size": 256, "dram_cache_bytes": 8589934592}}'

Exports (imported lazily, so ``import kvcache_core`` never needs vLLM and this package
itself imports vLLM only when one of these names is used):

* :class:`PyKVCacheSpec` - the ``OffloadingSpec`` (``spec_name``).
* :class:`OffloadingConnector` - vLLM's connector subclass (``kv_connector`` with
  ``kv_connector_module_path``): config validation before start, recompute of chunks
  that fail to load, worker counters and failed keys sent to the scheduler.
* :class:`PyKVCacheManager`, :class:`PyKVCacheWorker`, :class:`PyKVCacheWorkerMetadata`.

Every name is resolved after :func:`kvcache_core.vllm.compat.require`: on a vLLM other
than 0.26.x or 0.32.x, vLLM's loading of our spec or connector fails with
:class:`~kvcache_core.vllm.compat.UnsupportedVLLMError` naming the supported releases
(their differences live in :mod:`kvcache_core.vllm.compat`).

See ``docs/vllm.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .connector import OffloadingConnector
    from .manager import PyKVCacheManager
    from .metadata import PyKVCacheWorkerMetadata
    from .spec import PyKVCacheSpec
    from .worker import PyKVCacheWorker

_LAZY = {
    "PyKVCacheSpec": ".spec",
    "OffloadingConnector": ".connector",
    "PyKVCacheWorkerMetadata": ".metadata",
    "PyKVCacheManager": ".manager",
    "PyKVCacheWorker": ".worker",
}

__all__ = ["OffloadingConnector", "PyKVCacheManager", "PyKVCacheSpec", "PyKVCacheWorker",
           "PyKVCacheWorkerMetadata"]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    importlib.import_module(".compat", __name__).require()
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
