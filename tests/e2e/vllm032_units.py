"""Unit checks of the vLLM 0.32 adapter (:mod:`kvcache_core.vllm.compat`), run INSIDE
``.venv-0.32`` by tests/e2e/test_vllm032.py (``.venv-0.32/bin/python -m pytest`` on this
file). Its name does not match ``test_*.py``, so .venv's own pytest (vLLM 0.26) never
collects it.

What differs in 0.32 and is checked here against vLLM 0.32's own classes: the release
line, the KV-event medium (vLLM's events tracker accepts our events), the namespace's
dtype and KV-layout fields, the per-request tier filter (``kv_load_tiers``) and load cap
(``max_load_tokens``) in lookups and preload planning, and ``get_load_source``.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm")
if not str(vllm.__version__).startswith("0.32."):  # pragma: no cover - wrong interpreter
    pytest.skip(f"needs vLLM 0.32, this is {vllm.__version__}", allow_module_level=True)

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    Medium,
    ReqContext,
    TierFilter,
    TierMatcher,
    make_offload_key,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from kvcache_core.layout import Namespace  # noqa: E402
from kvcache_core.vllm import compat  # noqa: E402
from kvcache_core.vllm import options as O  # noqa: E402
from kvcache_core.vllm.manager import PyKVCacheManager  # noqa: E402


def key(i: int, group: int = 0) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), group)


def test_release_line_and_event_medium():
    assert compat.VLLM_LINE == "0.32" and compat.IS_0_32 and compat.require() == "0.32"
    assert compat.EVENT_MEDIUM is Medium.STORAGE
    assert PyKVCacheManager.medium is Medium.STORAGE


def _offloading_config(extra: dict, cache_dtype: str, layout: str | None = "LBHNC"):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("l0", "l1"), 0),), worker_kv_bytes_per_block=32768,
        enable_kv_cache_events=False, extra_config=extra, engine_id="e0",
        model=OffloadingModelConfig("org/model", cache_dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
        kv_cache_layout=layout)


@pytest.mark.parametrize("cache_dtype, want", [("bfloat16", "bfloat16"),
                                                ("fp8_e4m3", "bfloat16/kv:fp8_e4m3")])
def test_namespace_dtype_and_layout(tmp_path, cache_dtype, want):
    """0.32 reports the resolved KV dtype (the model's for 'auto'): the namespace names it
    as 0.26 does; the KV-cache layout vLLM resolved is part of the namespace."""
    from kvcache_core.vllm import PyKVCacheSpec

    extra = {"spec_name": "PyKVCacheSpec", "spec_module_path": "kvcache_core.vllm",
             "root_dir": str(tmp_path), "staging_bytes": 1 << 26,
             O.MODEL_DTYPE_KEY: "bfloat16"}
    spec = PyKVCacheSpec(_offloading_config(extra, cache_dtype))
    ns = spec.namespaces[0]
    assert ns.dtype == want
    assert ns.kv_layout.endswith(";dev=cpu;kvl=LBHNC"), ns.kv_layout
    other = PyKVCacheSpec(_offloading_config(extra, cache_dtype, layout="BLHNC"))
    assert other.namespaces[0].dirname() != ns.dirname()


def test_events_pass_vllms_events_tracker(tmp_path):
    """Our KV events carry a ``Medium`` that vLLM 0.32's tracker can translate (a
    string medium raised KeyError there)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventsTracker,
    )
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig

    m = PyKVCacheManager(str(tmp_path), [Namespace("m", "bf16", 256, 1 << 16)], n_dram=2,
                         enable_events=True)
    r = ReqContext("r")
    m.prepare_store([key(1), key(2)], r)
    m.complete_store([key(1), key(2)], r)
    m.on_worker_report({key(2)}, {})  # a failed load: announced as removed
    events = list(m.take_events())
    assert [(e.medium, e.removed) for e in events] == [(Medium.STORAGE, False),
                                                        (Medium.STORAGE, True)]
    tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(True, False))
    out = list(tracker.take_events(events))
    assert len(out) == 3 and all(o.medium for o in out), out


def _on_disk(m: PyKVCacheManager, *keys: bytes) -> None:
    for k in keys:
        for d in m.disk:
            p = d.path_for(k)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            open(p, "w").close()


def test_tier_filter_and_load_source(tmp_path):
    """``kv_load_tiers`` without STORAGE: a disk-only block is a miss, a DRAM-tier block
    still a hit (vLLM's tiering manager filters its secondary tiers only);
    ``get_load_source`` says HOST for DRAM-tier loads and DISK for disk reads."""
    m = PyKVCacheManager(str(tmp_path), [Namespace("m", "bf16", 256, 1 << 16)], n_dram=2)
    dram_key, disk_key = key(1), key(2)
    w = ReqContext("w")
    m.prepare_store([dram_key], w)
    m.complete_store([dram_key], w)
    _on_disk(m, disk_key)
    cpu_only = ReqContext("cpu", load_tier_filter=TierFilter((TierMatcher(Medium.CPU),)))
    storage = ReqContext("st", load_tier_filter=TierFilter((TierMatcher(Medium.STORAGE),)))
    nothing = ReqContext("none", load_tier_filter=TierFilter(()))
    everything = ReqContext("all")
    assert m.lookup(disk_key, cpu_only) == LookupResult.MISS
    assert m.lookup(disk_key, nothing) == LookupResult.MISS
    assert m.lookup(disk_key, storage) == LookupResult.HIT
    assert m.lookup(disk_key, everything) == LookupResult.HIT
    assert m.lookup(dram_key, cpu_only) == LookupResult.HIT
    assert m.lookup(dram_key, nothing) == LookupResult.HIT
    m.prepare_load([dram_key, disk_key], everything)
    assert m.get_load_source(dram_key, everything) == CacheHitSource.HOST
    assert m.get_load_source(disk_key, everything) == CacheHitSource.DISK
    m.complete_load([dram_key, disk_key], everything)
    assert m.get_load_source(dram_key, everything) == CacheHitSource.HOST


def test_preload_planning_honours_tier_filter_and_load_cap(tmp_path):
    """Waiting requests: none of a request's blocks are planned when its kv_load_tiers
    exclude STORAGE, and none past its max_load_tokens; the queue-aware admission is
    still asked once per request, in order."""
    m = PyKVCacheManager(str(tmp_path), [Namespace("m", "bf16", 256, 1 << 16)], n_dram=0)
    g = SimpleNamespace(group_idx=0, hashes_per_chunk=2, tokens_per_chunk=256)

    def req(rid: int, params: dict | None) -> SimpleNamespace:
        hashes = [(rid * 100 + i).to_bytes(32, "big") for i in range(8)]  # 4 chunks
        _on_disk(m, *(make_offload_key(h, 0) for h in hashes[1::2]))
        return SimpleNamespace(request_id=str(rid), block_hashes=hashes,
                               kv_transfer_params=params)

    reqs = [req(1, None), req(2, {"kv_load_tiers": [{"medium": "cpu"}]}),
            req(3, {"max_load_tokens": 600}), req(4, {"max_load_tokens": "x"})]
    asked: list[tuple[str, int]] = []

    def admit(r, n: int) -> bool:
        asked.append((r.request_id, n))
        return True

    planned = m.plan_preloads(reqs, [g], 64, admit)
    assert asked == [("1", 4), ("2", 0), ("3", 2), ("4", 4)]
    assert len(planned) == 10


def test_connector_metadata_subclasses_vllm_032s():
    """The scheduler -> worker metadata (kvcache_core.vllm.metadata) on vLLM 0.32's
    ``OffloadingConnectorMetadata``: every vLLM field copied, preloads and flushes added,
    picklable (multiprocess mode)."""
    import dataclasses
    import pickle

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        TransferJob,
    )

    from kvcache_core.vllm.metadata import PyKVCacheConnectorMetadata

    base = OffloadingConnectorMetadata(load_jobs={1: TransferJob("r", None, None)},
                                       store_jobs={}, jobs_to_flush={3})
    m = pickle.loads(pickle.dumps(PyKVCacheConnectorMetadata.extend(base, [key(1)],
                                                                    [(key(2), 5)])))
    for f in dataclasses.fields(OffloadingConnectorMetadata):
        assert getattr(m, f.name).__class__ is getattr(base, f.name).__class__, f.name
    assert m.load_jobs.keys() == {1} and m.jobs_to_flush == {3}
    assert m.preload == [key(1)] and m.flush == [(key(2), 5)] and not m.preloads_started
