"""Fast tests of :mod:`kvcache_core.vllm.spec` without an engine: namespaces computed
on both sides (scheduler and worker ranks) agree, and the metric definitions."""

from __future__ import annotations

import pytest

from kvcache_core.config import ConfigError
from kvcache_core.vllm import options as O


def _offloading_config(rank: int, world: int, extra: dict):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("l0", "l1")),), worker_kv_bytes_per_block=32768,
        enable_kv_cache_events=False, extra_config=extra, engine_id=f"e{rank}",
        model=OffloadingModelConfig("org/model", "auto"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank, world, world, 1, 1, 1, 0, True))


def test_scheduler_and_worker_specs_agree(tmp_path, vllm_available):
    from kvcache_core.vllm import PyKVCacheSpec

    extra = {"spec_name": "PyKVCacheSpec", "spec_module_path": "kvcache_core.vllm",
             "root_dir": str(tmp_path), "staging_bytes": 1 << 26, "dram_cache_bytes": 1 << 25,
             O.MODEL_DTYPE_KEY: "bfloat16"}
    sched = PyKVCacheSpec(_offloading_config(0, 2, extra))
    work1 = PyKVCacheSpec(_offloading_config(1, 2, extra))
    assert sched.namespaces == work1.namespaces and sched.pool == work1.pool
    assert sched.blocks_per_chunk == work1.blocks_per_chunk == 16  # default 256 tokens
    ns0, ns1 = sched.namespaces
    assert (ns0.tp_rank, ns1.tp_rank, ns0.tp_size) == (0, 1, 2)
    assert ns0.dirname() != ns1.dirname()
    assert ns0.block_bytes == 32768 * 16 and ns0.dtype == "bfloat16"
    assert ns0.block_size == 256
    other = PyKVCacheSpec(_offloading_config(0, 2, {**extra, O.MODEL_DTYPE_KEY: "float16"}))
    assert other.namespaces[0].dirname() != ns0.dirname()
    assert sched.pool.n_dram == (1 << 25) // ns0.file_bytes
    stock = {k: v for k, v in extra.items() if k != O.MODEL_DTYPE_KEY}
    with pytest.raises(ConfigError, match="kv_connector_module_path"):
        PyKVCacheSpec(_offloading_config(0, 1, stock))  # vLLM's stock connector class
    defs = PyKVCacheSpec.build_metric_definitions(extra)
    assert "vllm:pykvcache_hits_disk" in defs and "vllm:pykvcache_files_corrupt" in defs
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata

    assert isinstance(defs["vllm:pykvcache_healthy"], OffloadingGaugeMetadata)
    assert isinstance(defs["vllm:pykvcache_dram_cached"], OffloadingGaugeMetadata)
    assert isinstance(defs["vllm:pykvcache_ops_expired"], OffloadingCounterMetadata)
    from vllm.v1.kv_offload.base import OffloadingHistogramMetadata

    for h in ("store", "load_dram", "load_disk"):
        assert isinstance(defs[f"vllm:pykvcache_{h}_seconds"], OffloadingHistogramMetadata)


def test_gpu_kv_layout_per_layer_has_its_own_namespace_and_layout(tmp_path, vllm_available):
    """``gpu_kv_layout``: 'per_layer' asks vLLM for no cross-layer tensor and the attention
    backend's own order, and its files (other block bytes) live in another namespace;
    the default keeps vLLM's choice ('HND', cross-layer) and the namespace unchanged."""
    from types import SimpleNamespace

    from kvcache_core.vllm import PyKVCacheSpec
    from kvcache_core.vllm.connector import OffloadingConnector

    extra = {"spec_name": "PyKVCacheSpec", "spec_module_path": "kvcache_core.vllm",
             "root_dir": str(tmp_path), "staging_bytes": 1 << 26, O.MODEL_DTYPE_KEY: "bfloat16"}
    dflt = PyKVCacheSpec(_offloading_config(0, 1, extra)).namespaces[0]
    same = PyKVCacheSpec(_offloading_config(0, 1, {**extra, "gpu_kv_layout": "cross_layer"}))
    per = PyKVCacheSpec(_offloading_config(0, 1, {**extra, "gpu_kv_layout": "per_layer"}))
    assert same.namespaces[0].dirname() == dflt.dirname()
    assert per.namespaces[0].dirname() != dflt.dirname()
    assert "per_layer" in per.namespaces[0].kv_layout and "per_layer" not in dflt.kv_layout

    def cfg(**kw):
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={**extra, **kw}))

    assert OffloadingConnector.get_required_kvcache_layout(cfg()) == "HND"
    assert OffloadingConnector.get_required_kvcache_layout(
        cfg(gpu_kv_layout="cross_layer")) == "HND"
    assert OffloadingConnector.get_required_kvcache_layout(
        cfg(gpu_kv_layout="per_layer")) is None
    for cross, want in ((True, True), (False, False)):
        conn = object.__new__(OffloadingConnector)  # the property reads one attribute
        conn._cross_layer = cross
        assert conn.prefer_cross_layer_blocks is want
