"""Fast tests of the vLLM glue without an engine: config parsing, namespaces computed on
both sides, chunk mapping against vLLM's own ``compute_sub_block_ptrs``, the worker's
copy/store/load/failure paths through a real reactor, the manager's slot bookkeeping."""

from __future__ import annotations

import json
import os
import pickle
import time

import numpy as np
import pytest
import torch

from kvcache_core.config import ConfigError, StorageConfig
from kvcache_core.layout import HEADER_BYTES, MAGIC, Layout, Namespace
from kvcache_core.reactor import IN_SLOT
from kvcache_core.vllm import options as O


def key(i: int, group: int = 0) -> bytes:
    return i.to_bytes(32, "big") + group.to_bytes(4, "big")


# ------------------------------------------------------------------------ options
def test_parse_extra_config_errors_name_the_key():
    base = {"spec_name": "PyKVCacheSpec", "spec_module_path": "kvcache_core.vllm",
            "root_dir": "/tmp/x"}
    with pytest.raises(ConfigError, match=r"unknown config key 'io_depht'.*did you mean "
                                          r"'io_depth'"):
        O.parse_extra_config({**base, "io_depht": 3})
    with pytest.raises(ConfigError, match="'io_depth'"):
        O.parse_extra_config({**base, "io_depth": 0})
    with pytest.raises(ConfigError, match="'block_size' and 'blocks_per_chunk'"):
        O.parse_extra_config({**base, "block_size": 256, "blocks_per_chunk": 2})
    with pytest.raises(ConfigError, match="'blocks_per_chunk'"):
        O.parse_extra_config({**base, "blocks_per_chunk": "2"})
    with pytest.raises(ConfigError, match="'offload_prompt_only'"):
        O.parse_extra_config({**base, "offload_prompt_only": "yes"})
    with pytest.raises(ConfigError, match="'load_failure_policy'"):
        O.parse_extra_config({**base, "load_failure_policy": "ignore"})
    with pytest.raises(ConfigError, match="'breakeven_table'"):
        O.parse_extra_config({**base, "breakeven_table": ""})
    with pytest.raises(ConfigError, match="'queue_aware_preload'.*true or false"):
        O.parse_extra_config({**base, "breakeven_table": "t.json", "queue_aware_preload": 1})
    with pytest.raises(ConfigError, match="'queue_aware_preload': needs 'breakeven_table'"):
        O.parse_extra_config({**base, "queue_aware_preload": True})
    assert O.parse_extra_config({**base, "breakeven_table": "t.json",
                                 "queue_aware_preload": True}).queue_aware_preload
    for bad in (-1, "4k", True, 1.5):
        with pytest.raises(ConfigError, match="'disk_min_prefix_tokens'"):
            O.parse_extra_config({**base, "disk_min_prefix_tokens": bad})
    assert O.parse_extra_config(base).disk_min_prefix_tokens == "auto"
    assert O.parse_extra_config({**base, "disk_min_prefix_tokens": 4096}
                                ).disk_min_prefix_tokens == 4096
    with pytest.raises(ConfigError, match="'dram_cache_bytes'"):
        O.pool_geometry(StorageConfig(dram_cache_bytes=4096),
                        Namespace("m", "bf16", 256, 1 << 20))
    opts = O.parse_extra_config({**base, "block_size": 512})
    with pytest.raises(ConfigError, match="'block_size'"):
        O.check_block_size(opts, 96)
    O.check_block_size(opts, 128)
    assert O.resolve_blocks_per_chunk(opts, (128,), 4) == 4
    dflt = O.parse_extra_config(base)
    assert O.resolve_blocks_per_chunk(dflt, (16,), 1) == 16  # 256 tokens, not 1 block
    assert O.resolve_blocks_per_chunk(dflt, (128,), 1) == 2


def test_hash_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.setattr(O, "_seed_set_by_us", False)
    assert O.ensure_hash_seed() == "0" and os.environ["PYTHONHASHSEED"] == "0"
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    assert O.ensure_hash_seed() == "1234"
    monkeypatch.setenv("PYTHONHASHSEED", "random")
    with pytest.raises(ConfigError, match="PYTHONHASHSEED=random"):
        O.ensure_hash_seed()


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


# ------------------------------------------------------------------------ chunk mapping
def _geometry(bpc: int, n_tensors: int = 2, nb: int = 64, page: int = 256):
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCacheTensor

    from kvcache_core.vllm.transfer import KVGeometry

    ts = [CanonicalKVCacheTensor(torch.zeros((nb, page), dtype=torch.int8), page)
          for _ in range(n_tensors)]
    return KVGeometry(ts, [[CanonicalKVCacheRef(i, page) for i in range(n_tensors)]], bpc)


@pytest.mark.parametrize("bpc", [1, 2, 4])
def test_chunk_mapping_matches_vllm_sub_block_pointers(bpc, vllm_available):
    """Our (chunk, sub-block) for every GPU block equals what vLLM's native CPU offload
    computes with ``compute_sub_block_ptrs`` (including the skip of a partial first
    chunk) for loads and stores."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs

    g = _geometry(bpc)
    page, slot_bytes = 256, 8 * bpc * 256 + HEADER_BYTES
    rng = np.random.default_rng(bpc)
    for _ in range(40):
        skip = int(rng.integers(0, bpc))
        n_blocks = int(rng.integers(1, 4 * bpc + 1))
        n_chunks = -(-(n_blocks + skip) // bpc)
        gpu_ids = rng.choice(64, size=n_blocks, replace=False).astype(np.int64)
        spec = GPULoadStoreSpec(gpu_ids.tolist(), [n_blocks], [skip + bpc * 3])
        slots = rng.choice(8, size=n_chunks, replace=False)
        refs = g.split(spec, [key(int(s)) for s in slots])
        assert [len(r.gpu_ids) for r in refs][0] == min(n_blocks, bpc - skip)
        ours = []
        for r, s in zip(refs, slots, strict=True):
            tix, kvo, plo, _ = g.ops(r, int(s) * slot_bytes + HEADER_BYTES)
            for t, k, p in zip(tix, kvo, plo, strict=True):
                within = p - int(s) * slot_bytes - HEADER_BYTES - t * bpc * page
                ours.append((int(t), int(k) // page, int(s), int(within) // page))
        # vLLM: one CPU tensor per canonical tensor, row = chunk, bpc pages per row
        ref = []
        cpu = torch.zeros((8, bpc * page), dtype=torch.int8)
        for t in range(2):
            out = np.zeros(n_blocks, dtype=np.uint64)
            compute_sub_block_ptrs(slots.astype(np.int64), bpc, out, cpu, skip_count=skip)
            offs = out.astype(np.int64) - cpu.data_ptr()
            ref.append([(t, int(b), int(o) // (bpc * page), int(o) % (bpc * page) // page)
                        for b, o in zip(gpu_ids, offs, strict=True)])
        # ours is chunk-major then tensor; compare as sets of (tensor, block, chunk, sub)
        assert sorted(ours) == sorted(ref[0] + ref[1])



def _pages(ops, page: int) -> list[tuple[int, int, int]]:
    """Expand descriptors into (tensor, kv offset, pool offset) per page."""
    out = []
    for t, k, p, n in zip(*(a.tolist() for a in ops), strict=True):
        assert n % page == 0
        out += [(t, k + i * page, p + i * page) for i in range(n // page)]
    return out


@pytest.mark.parametrize("bpc", [1, 4, 16])
@pytest.mark.parametrize("consecutive", [True, False])
def test_batch_ops_equal_per_chunk_ops_and_coalesce(bpc, consecutive, vllm_available):
    """The vectorised, coalesced descriptors of a whole batch move exactly the same pages
    as the per-chunk reference :meth:`KVGeometry.ops`, and consecutive GPU blocks
    collapse to one copy per (chunk, tensor). Also checked on real bytes (CPU copy)."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    page, n_t, nb = 256, 3, 256
    g = _geometry(bpc, n_tensors=n_t, nb=nb, page=page)
    slot_bytes = n_t * bpc * page + HEADER_BYTES
    rng = np.random.default_rng(bpc + 7 * consecutive)
    for _ in range(20):
        skip = int(rng.integers(0, bpc))
        n_blocks = int(rng.integers(1, 6 * bpc + 1))
        n_chunks = -(-(n_blocks + skip) // bpc)
        if consecutive:
            start = int(rng.integers(0, nb - n_blocks))
            gpu_ids = np.arange(start, start + n_blocks, dtype=np.int64)
        else:
            gpu_ids = rng.choice(nb, size=n_blocks, replace=False).astype(np.int64)
        spec = GPULoadStoreSpec(gpu_ids.tolist(), [n_blocks], [skip + bpc * 3])
        slots = rng.choice(64, size=n_chunks, replace=False)
        refs = g.split(spec, [key(int(s)) for s in slots])
        bases = [int(s) * slot_bytes + HEADER_BYTES for s in slots]
        ref_pages = []
        for r, b in zip(refs, bases, strict=True):
            ref_pages += _pages(g.ops(r, b), page)
        got = g.batch_ops(refs, bases)
        assert sorted(_pages(got, page)) == sorted(ref_pages)
        assert sorted(_pages(g.batch_ops(refs, bases, coalesce=False), page)) == \
            sorted(ref_pages)
        if consecutive:
            assert len(got[0]) == n_t * n_chunks  # one copy per (chunk, tensor)
        # real bytes: copy pool -> KV with the coalesced descriptors == per-page copies
        pool = torch.randint(-128, 127, (64 * slot_bytes,), dtype=torch.int8)
        a = [f.clone().zero_() for f in g.flat]
        b = [f.clone().zero_() for f in g.flat]
        for t, k, p, n in zip(*(x.tolist() for x in got), strict=True):
            a[t][k:k + n].copy_(pool[p:p + n])
        for t, k, p in ref_pages:
            b[t][k:k + page].copy_(pool[p:p + page])
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

def test_split_rejects_inconsistent_specs(vllm_available):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    g = _geometry(2)
    with pytest.raises(ValueError):
        g.split(GPULoadStoreSpec([1, 2, 3], [3], [0]), [key(1)])  # needs 2 chunks
    with pytest.raises(ValueError):
        g.split(GPULoadStoreSpec([1, 2], [2], [0]), [key(1, group=1)])  # wrong group
    with pytest.raises(ValueError):
        g.split(GPULoadStoreSpec([1, 99], [2], [0]), [key(1)])  # block out of range


# ------------------------------------------------------------------------ worker
def _make_worker(root, dram_files: int = 0, **storage):
    """A real PyKVCacheWorker over two random int8 KV tensors (CPU), small pools, a DRAM
    tier of ``dram_files`` slots; ``storage``: more StorageConfig keys. The tensors are
    ``w.test_tensors``."""
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    from kvcache_core.vllm.worker import PyKVCacheWorker

    page, nb, bpc = 4096, 32, 2
    g = torch.Generator().manual_seed(0)
    ts = [torch.randint(-128, 127, (nb, page), dtype=torch.int8, generator=g)
          for _ in range(2)]
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(t, page) for t in ts],
                           [[CanonicalKVCacheRef(0, page), CanonicalKVCacheRef(1, page)]])
    ns = Namespace("unit/model", "int8", 2 * 16, block_bytes=2 * page * bpc)
    cfg = StorageConfig(root_dir=str(root), staging_bytes=4 * ns.file_bytes, io_depth=2,
                        lookahead=2, copy_headroom=1,
                        dram_cache_bytes=dram_files * ns.file_bytes, **storage)
    w = PyKVCacheWorker(kv, storage=cfg, namespace=ns, pool=O.pool_geometry(cfg, ns),
                        blocks_per_chunk=bpc, max_disk_bytes=0)
    w.test_tensors = ts
    w.test_orig = [t.clone() for t in ts]
    return w


@pytest.fixture
def worker(tmp_path, vllm_available):
    w = _make_worker(tmp_path, dram_files=4)
    yield w
    w.shutdown()


def _run(w, job: int) -> None:
    w.wait({job})
    res = {r.job_id: r for r in w.get_finished()}
    assert res[job].success


def test_worker_store_load_dram_and_disk(worker):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvcache_core.vllm.specs import PyKVLoadSpec, PyKVStoreSpec

    w, ts, orig = worker, worker.test_tensors, worker.test_orig
    k1, k2 = key(1), key(2)
    # store: k1 = blocks 3,5 (DRAM slot 0 + disk), k2 = blocks 7,9 (disk only)
    w.submit_store(1, GPULoadStoreSpec([3, 5, 7, 9], [4], [0]),
                   PyKVStoreSpec([k1, k2], [0, -1]))
    w.submit_store(2, GPULoadStoreSpec([], [0], [0]), PyKVStoreSpec([], []))
    w.wait({2})  # waiting for job 2 must not lose job 1's completion
    w.wait({1})
    assert {r.job_id for r in w.get_finished()} == {1, 2}
    # store jobs are acknowledged once copied (early_store_ack); the files follow
    assert w.reactor.wait(30)
    assert w.layout.exists(k1) and w.layout.exists(k2)
    w.get_finished()  # drains the final completions: k1 (DRAM slot 0) is reported written
    assert w.take_written() == [k1] and w.take_written() == []
    for t in ts:
        t.zero_()
    # load: k1 from DRAM slot 0 skipping sub-block 0 -> block 11; k2 from disk -> 12, 13
    w.submit_load(3, PyKVLoadSpec([k1, k2], [0, -1], [IN_SLOT, 0]),
                  GPULoadStoreSpec([11, 12, 13], [3], [1]))
    _run(w, 3)
    assert w.take_invalid_block_ids() == set()
    for t, o in zip(ts, orig, strict=True):
        assert torch.equal(t[11], o[5]) and torch.equal(t[12], o[7])
        assert torch.equal(t[13], o[9]) and not t[10].any()
    failed, counters = w.take_report()
    assert not failed and counters["chunks_loaded_dram"] == 1
    assert counters["chunks_loaded_disk"] == 1 and counters["stores_written"] == 2
    # a DRAM store whose file already exists still gets a valid slot header
    for t, o in zip(ts, orig, strict=True):
        t[3], t[5] = o[3], o[5]
    w.submit_store(4, GPULoadStoreSpec([3, 5], [2], [0]), PyKVStoreSpec([k1], [3]))
    _run(w, 4)
    w.submit_load(5, PyKVLoadSpec([k1], [3], [IN_SLOT]), GPULoadStoreSpec([20, 21], [2], [0]))
    _run(w, 5)
    assert w.take_invalid_block_ids() == set()
    assert torch.equal(ts[1][20], orig[1][3]) and torch.equal(ts[1][21], orig[1][5])
    # promotion: k2 read from disk into DRAM slot 2, then served from that slot
    w.submit_load(6, PyKVLoadSpec([k2], [2], [0]), GPULoadStoreSpec([22, 23], [2], [0]))
    _run(w, 6)
    w.submit_load(7, PyKVLoadSpec([k2], [2], [IN_SLOT]), GPULoadStoreSpec([24, 25], [2], [0]))
    _run(w, 7)
    assert w.take_invalid_block_ids() == set()
    assert torch.equal(ts[0][25], orig[0][9])
    st = w.stats()["reactor"]
    assert st["bytes_read"] == 2 * w.layout.ns.file_bytes
    # jobs 5 and 7 were all DRAM hits: served on this thread, never through the reactor
    # (job 3 mixed a DRAM hit with a disk chunk: the reactor served its DRAM chunk)
    assert st["loads_dram"] == 1 and w.stats()["chunks_loaded_dram"] == 3
    # one latency per job for the scheduler's histograms, by tier: jobs 5 and 7 all
    # DRAM, 3 and 6 with a disk chunk; the stores 1, 2 and 4
    obs = w.take_observations()
    assert {k: len(v) for k, v in obs.items()} == {"store": 3, "load_disk": 2,
                                                   "load_dram": 2}
    assert all(x > 0 for v in obs.values() for x in v) and w.take_observations() == {}


def test_worker_dram_only_chunk_fills_its_slot_and_writes_no_file(worker):
    """A store spec with ``dram_only`` (the write-back share of the tier is full): that
    chunk fills its DRAM slot (served back from it intact), writes no file and is not
    reported written; the job's other chunk is written as usual."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvcache_core.vllm.specs import PyKVLoadSpec, PyKVStoreSpec

    w, ts, orig = worker, worker.test_tensors, worker.test_orig
    k1, k2 = key(31), key(32)
    w.submit_store(1, GPULoadStoreSpec([3, 5, 7, 9], [4], [0]),
                   PyKVStoreSpec([k1, k2], [0, 1], dram_only=[False, True]))
    _run(w, 1)
    assert w.reactor.wait(30)
    w.get_finished()
    assert w.layout.exists(k1) and not w.layout.exists(k2)
    assert w.take_written() == [k1]
    for t in ts:
        t.zero_()
    w.submit_load(2, PyKVLoadSpec([k2], [1], [IN_SLOT]), GPULoadStoreSpec([12, 13], [2], [0]))
    _run(w, 2)
    assert w.take_invalid_block_ids() == set()
    for t, o in zip(ts, orig, strict=True):
        assert torch.equal(t[12], o[7]) and torch.equal(t[13], o[9])


def test_worker_load_failures_are_reported_and_slots_invalidated(worker):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvcache_core.vllm.specs import PyKVLoadSpec, PyKVStoreSpec

    w, ts = worker, worker.test_tensors
    k1, k2, k3 = key(1), key(2), key(3)
    w.submit_store(1, GPULoadStoreSpec([1, 2, 3, 4, 5, 6], [6], [0]),
                   PyKVStoreSpec([k1, k2, k3], [0, 1, -1]))
    _run(w, 1)
    # the job is acknowledged once copied (early_store_ack): let the files land first,
    # as vLLM's manager only sees a disk hit once the file is published
    assert w.reactor.wait(30)
    assert w.layout.exists(k2) and w.layout.exists(k3)
    views = w.reactor.pool.views
    # 1. garbage in a DRAM slot (bad magic): refused, recomputed, never copied
    views[w.n_staging + 0][0] ^= 0xFF
    before = ts[0][10].clone()
    w.submit_load(2, PyKVLoadSpec([k1], [0], [IN_SLOT]), GPULoadStoreSpec([10, 11], [2], [0]))
    _run(w, 2)
    assert w.take_invalid_block_ids() == {10, 11}
    assert torch.equal(ts[0][10], before)
    # 2. a corrupt file promoted into DRAM slot 1: the slot header is zeroed
    path = w.layout.path_for(k2)
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 77)
        b = f.read(1)
        f.seek(HEADER_BYTES + 77)
        f.write(bytes([b[0] ^ 1]))
    assert bytes(views[w.n_staging + 1][:8]) == MAGIC  # the store left a valid header
    w.submit_load(3, PyKVLoadSpec([k2, k3], [1, -1], [0, 0]),
                  GPULoadStoreSpec([12, 13, 14, 15], [4], [0]))
    _run(w, 3)
    assert w.take_invalid_block_ids() == {12, 13}  # k3 loaded fine
    assert bytes(views[w.n_staging + 1][:8]) == bytes(8)
    assert not os.path.exists(path)
    # 3. a missing file
    w.submit_load(4, PyKVLoadSpec([k2], [-1], [0]), GPULoadStoreSpec([16, 17], [2], [0]))
    _run(w, 4)
    assert w.take_invalid_block_ids() == {16, 17}
    failed, counters = w.take_report()
    assert failed == {k1, k2}
    assert counters["chunks_failed"] == 3 and counters["files_corrupt"] == 1
    assert counters["dram_invalid"] == 1 and counters["files_missing"] == 1


# ------------------------------------------------------------------------ manager
def test_manager_pins_dram_slots_until_every_rank_wrote_them(tmp_path, vllm_available):
    """Write-back: a DRAM-tier slot stays pinned from complete_store until all ranks
    reported its key written (in any order: the report may come first), so it is never
    handed to another key while a file is still being written from it; with disk writes
    off (no_disk) nothing is pinned; reset_cache forgets pending write-backs."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager

    nss = [Namespace("m", "bf16", 256, 1 << 16, tp_rank=r, tp_size=2) for r in range(2)]
    m = PyKVCacheManager(str(tmp_path), nss, n_dram=2, writeback_max_fraction=1.0)
    r = ReqContext("r")
    k1, k2, k3, k4 = (key(i) for i in range(1, 5))
    assert m.prepare_store([k1, k2], r).store_spec.dram_slots == [0, 1]
    m.on_worker_report(set(), {}, None, {k2: 2})  # k2 written on both ranks before the ack
    m.complete_store([k1, k2], r)
    assert m.stats()["dram_writeback_pinned"] == 1  # k1 only
    out = m.prepare_store([k3], r)  # k2's slot is the only one free to reclaim
    assert out.store_spec.dram_slots == [1] and out.evicted_keys == [k2]
    m.complete_store([k3], r)
    assert m.prepare_store([k4], r).store_spec.dram_slots == [-1]  # k1, k3 pinned
    m.complete_store([k4], r)
    m.on_worker_report(set(), {}, None, {k1: 1})  # one rank of two: still pinned
    assert m.prepare_store([key(5)], r).store_spec.dram_slots == [-1]
    m.complete_store([key(5)], r)
    m.on_worker_report(set(), {}, None, {k1: 1, key(99): 1})  # unknown key: ignored
    assert m.stats()["dram_writeback_pinned"] == 1  # k3 still pending
    out = m.prepare_store([key(6)], r)
    assert out.store_spec.dram_slots == [0] and out.evicted_keys == [k1]
    m.complete_store([key(6)], r)
    m.dram.check()
    m.reset_cache()
    assert m.stats()["dram_writeback_pinned"] == 0
    m.disk_stores = False  # break-even table: DRAM only, nothing written, nothing pinned
    m.prepare_store([key(7)], r)
    m.complete_store([key(7)], r)
    assert m.stats()["dram_writeback_pinned"] == 0


def test_manager_writeback_cap_keeps_slots_for_promotions(tmp_path, vllm_available):
    """writeback_max_fraction: stores hold at most that share of the DRAM tier while their
    files are pending (storing or pinned); further stores still fill a DRAM slot but
    write no file (dram_only, counted) and pin nothing, so a disk hit can still be
    promoted into the tier and a second request for the block waits for that one read
    (HIT_PENDING). A promoted block counts as a reuse: with ARC a burst of new stores
    evicts the stored-only blocks, not it. Pinned slots come back when the writes end."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager

    ns = Namespace("m", "bf16", 256, 1 << 16)
    m = PyKVCacheManager(str(tmp_path), [ns], n_dram=4, eviction_policy="arc",
                         writeback_max_fraction=0.5)
    w = ReqContext("writer")
    ks = [key(i) for i in range(1, 5)]
    spec = m.prepare_store(ks, w).store_spec
    assert all(s >= 0 for s in spec.dram_slots) and not spec.no_disk
    assert spec.dram_only == [False, False, True, True]
    assert [spec.writes_file(i) for i in range(4)] == [True, True, False, False]
    assert m.stats()["stores_writeback_full"] == 2
    m.complete_store(ks, w)
    assert m.stats()["dram_writeback_pinned"] == 2  # the dram_only ones pin nothing
    assert all(m.dram.lookup(k) >= 0 for k in ks)
    # a block on disk (another process stored it), read by two requests at once
    lay = Layout(str(tmp_path), ns)
    hot = key(50)
    assert lay.write_block(bytes(hot), bytes(ns.block_bytes))
    a, b = ReqContext("a"), ReqContext("b")
    assert m.lookup(hot, a) == LookupResult.HIT
    load = m.prepare_load([hot], a)
    assert load.dram_slots[0] >= 0  # promoted into a slot the cap left reclaimable
    assert m.lookup(hot, b) == LookupResult.HIT_PENDING  # one disk read for both
    m.complete_load([hot], a)
    assert m.lookup(hot, b) == LookupResult.HIT and m.dram.lookup(hot) >= 0
    # the writes end: their slots become reclaimable, and stores write files again
    m.on_worker_report(set(), {}, None, {ks[0]: 1, ks[1]: 1})
    assert m.stats()["dram_writeback_pinned"] == 0
    burst = [key(i) for i in range(100, 106)]
    for k in burst:
        spec = m.prepare_store([k], w).store_spec
        assert spec.dram_only is None and spec.writes_file(0)
        m.complete_store([k], w)
        m.on_worker_report(set(), {}, None, {k: 1})
    assert m.dram.lookup(hot) >= 0  # the reused block survived six new stores
    m.dram.check()


def test_manager_flushes_dram_only_blocks_when_the_writeback_has_room(tmp_path,
                                                                      vllm_available):
    """writeback_flush: blocks kept in the DRAM tier without a file (write-back full) are
    not lost to the disk tier: once the write-back has room, take_flush_plan hands the
    oldest of them to the workers (pinned like any write-back until every rank reports
    them written), as many as the room allows. One evicted before that is counted
    (dram_only_evicted) and never planned; one already on disk (another instance) is
    skipped; with disk writes off (break-even gate) nothing is planned; with
    writeback_flush off (the default) nothing ever is."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager

    ns = Namespace("m", "bf16", 256, 1 << 16)
    off = PyKVCacheManager(str(tmp_path / "off"), [ns], n_dram=4, writeback_max_fraction=0.5)
    m = PyKVCacheManager(str(tmp_path), [ns], n_dram=4, writeback_max_fraction=0.5,
                         writeback_flush=True)
    w = ReqContext("w")
    ks = [key(i) for i in range(1, 5)]
    off.prepare_store(ks, w)
    off.complete_store(ks, w)
    off.on_worker_report(set(), {}, None, {ks[0]: 1, ks[1]: 1})
    assert off.take_flush_plan() == []  # writeback_flush off (the default): never
    spec = m.prepare_store(ks, w).store_spec
    assert spec.dram_only == [False, False, True, True]
    m.complete_store(ks, w)
    assert m.take_flush_plan() == []  # write-back still full (ks[0], ks[1] pinned)
    m.on_worker_report(set(), {}, None, {ks[0]: 1, ks[1]: 1})
    plan = m.take_flush_plan()
    assert plan == [(bytes(ks[2]), m.dram.lookup(ks[2])), (bytes(ks[3]), m.dram.lookup(ks[3]))]
    assert m.stats()["dram_writeback_pinned"] == 2 and m.stats()["flushes_planned"] == 2
    assert m.take_flush_plan() == []  # planned once
    m.on_worker_report(set(), {}, None, {ks[2]: 1, ks[3]: 1})
    assert m.stats()["dram_writeback_pinned"] == 0
    m.dram.check()

    # evicted before its flush: lost to the cache, counted, never planned
    m = PyKVCacheManager(str(tmp_path / "b"), [ns], n_dram=2, writeback_max_fraction=0.5,
                         writeback_flush=True)
    a, b, c = key(10), key(11), key(12)
    assert m.prepare_store([a, b], w).store_spec.dram_only == [False, True]
    m.complete_store([a, b], w)  # a pinned (its write pending), b dirty
    out = m.prepare_store([c], w)  # b is the only reclaimable slot
    assert out.evicted_keys == [b] and out.store_spec.dram_only == [True]
    m.complete_store([c], w)
    assert m.stats()["dram_only_evicted"] == 1
    Layout(str(tmp_path / "b"), ns).write_block(bytes(c), bytes(ns.block_bytes))
    m.on_worker_report(set(), {}, None, {a: 1})
    assert m.take_flush_plan() == []  # c: on disk already (another instance)

    # disk writes off: nothing to flush
    m = PyKVCacheManager(str(tmp_path / "c"), [ns], n_dram=2, writeback_max_fraction=0.5,
                         writeback_flush=True)
    m.prepare_store([a, b], w)
    m.complete_store([a, b], w)
    m.on_worker_report(set(), {}, None, {a: 1})
    m.disk_stores = False
    assert m.take_flush_plan() == []
    m.disk_stores = True
    assert m.take_flush_plan() == [(bytes(b), m.dram.lookup(b))]


def test_manager_positive_lookup_cache(tmp_path, vllm_available):
    """disk_lookup_cache_s: a lookup that found a block's files is believed for that long
    (no filesystem call; counted in lookups_cached), a miss is never cached (a file that
    appears later is found at once: visibility lag of a distributed filesystem), a failed
    load of the block drops the entry so the next lookup asks the filesystem again, and
    reset_cache forgets everything. Off (0, the default off FUSE): every lookup asks."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager

    ns = Namespace("m", "bf16", 256, 1 << 16)
    lay = Layout(str(tmp_path), ns)
    r = ReqContext("r")
    k, late = key(1), key(2)
    m = PyKVCacheManager(str(tmp_path), [ns], n_dram=0, lookup_cache_s=60.0)
    off = PyKVCacheManager(str(tmp_path), [ns], n_dram=0)
    assert m.lookup(late, r) == LookupResult.MISS
    assert lay.write_block(bytes(k), bytes(ns.block_bytes))
    assert lay.write_block(bytes(late), bytes(ns.block_bytes))
    assert m.lookup(late, r) == LookupResult.HIT  # the earlier miss was not cached
    assert m.lookup(k, r) == LookupResult.HIT and off.lookup(k, r) == LookupResult.HIT
    os.unlink(lay.path_for(bytes(k)))  # evicted by some other process
    assert off.lookup(k, r) == LookupResult.MISS
    assert m.lookup(k, r) == LookupResult.HIT  # believed: no filesystem call
    assert m.stats()["lookups_cached"] == 1
    m.on_worker_report({bytes(k)}, {})  # its load failed (file missing): entry dropped
    m._bad.clear()  # (the failed-load quarantine is tested elsewhere)
    assert m.lookup(k, r) == LookupResult.MISS
    assert m.lookup(late, r) == LookupResult.HIT and m.stats()["lookups_cached"] == 2
    m.reset_cache()
    os.unlink(lay.path_for(bytes(late)))
    assert m.lookup(late, r) == LookupResult.MISS


def test_disk_lookup_cache_option():
    from kvcache_core.config import ConfigError
    from kvcache_core.vllm.options import parse_extra_config

    assert parse_extra_config({}).disk_lookup_cache_s == "auto"
    assert parse_extra_config({"disk_lookup_cache_s": 0.5}).disk_lookup_cache_s == 0.5
    for bad in (-1, "2s", True, 4000):
        with pytest.raises(ConfigError, match="'disk_lookup_cache_s'"):
            parse_extra_config({"disk_lookup_cache_s": bad})


def test_store_spec_dram_only_validation():
    from kvcache_core.vllm.specs import PyKVStoreSpec

    with pytest.raises(ValueError, match="needs a DRAM-tier slot"):
        PyKVStoreSpec([b"k"], [-1], dram_only=[True])
    with pytest.raises(ValueError, match="differ in length"):
        PyKVStoreSpec([b"k"], [0], dram_only=[True, False])
    assert not PyKVStoreSpec([b"k"], [0], no_disk=True).writes_file(0)


def test_manager_short_requests_keep_dram_only_and_pin_nothing(tmp_path, vllm_available):
    """disk_min_prefix_tokens: a request the connector marked short stores into the DRAM
    tier without files (no_disk, slot not pinned for a write-back, counted); without a
    DRAM slot its chunks are skipped; a long request in the same step still writes."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager

    m = PyKVCacheManager(str(tmp_path), [Namespace("m", "bf16", 256, 1 << 16)], n_dram=2,
                         writeback_max_fraction=1.0)
    short, long_ = ReqContext("short"), ReqContext("long")
    m.short_requests.add("short")
    out = m.prepare_store([key(1)], short)
    assert out.store_spec.no_disk and out.store_spec.dram_slots == [0]
    out_l = m.prepare_store([key(2)], long_)
    assert not out_l.store_spec.no_disk and out_l.store_spec.dram_slots == [1]
    m.complete_store([key(1)], short)
    m.complete_store([key(2)], long_)
    st = m.stats()
    assert st["dram_writeback_pinned"] == 1  # key(2) only: key(1) has no file coming
    assert st["stores_dram_only_short"] == 1
    out = m.prepare_store([key(3)], short)  # reclaims key(1)'s slot (unpinned)
    assert out.store_spec.dram_slots == [0] and out.evicted_keys == [key(1)]
    m.complete_store([key(3)], short)
    m.prepare_store([key(9)], long_)  # both slots taken (key(2) pinned, key(3) evictable)
    assert m.prepare_store([key(4)], short).keys_to_store == []  # no slot, no file: skip
    assert m.stats()["stores_skipped_short"] == 1


def test_worker_with_a_dead_reactor_fails_loads_and_reports_it(worker):
    """The reactor thread dies (an injected bug): a disk load job still completes, its GPU
    blocks are reported for recompute, the worker reports ``reactor_dead`` once, and
    later store jobs complete too (nothing waits)."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvcache_core.vllm.specs import PyKVLoadSpec, PyKVStoreSpec

    w = worker
    k1 = key(1)
    w.submit_store(1, GPULoadStoreSpec([3, 5], [2], [0]), PyKVStoreSpec([k1], [-1]))
    _run(w, 1)
    assert w.reactor.wait(30)

    def boom(tag, res):
        raise RuntimeError("injected reactor bug")

    w.reactor._on_cqe = boom
    w.submit_load(2, PyKVLoadSpec([k1], [-1], [0]), GPULoadStoreSpec([10, 11], [2], [0]))
    _run(w, 2)
    assert w.take_invalid_block_ids() == {10, 11}
    failed, counters = w.take_report()
    assert failed == {k1} and counters["reactor_dead"] == 1
    w.submit_store(3, GPULoadStoreSpec([7, 9], [2], [0]), PyKVStoreSpec([key(2)], [-1]))
    _run(w, 3)
    assert w.take_report()[1].get("reactor_dead") is None  # reported once


def test_manager_recompute_only_after_a_dead_reactor(tmp_path, vllm_available):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager

    m = PyKVCacheManager(str(tmp_path), [Namespace("m", "bf16", 256, 1 << 16)], n_dram=2)
    r = ReqContext("r")
    m.prepare_store([key(1)], r)
    m.complete_store([key(1)], r)
    assert m.lookup(key(1), r) == LookupResult.HIT and m.stats()["healthy"] == 1
    m.on_worker_report(set(), {"reactor_dead": 1})
    assert m.lookup(key(1), r) == LookupResult.MISS
    assert m.prepare_store([key(2)], r).keys_to_store == []
    assert m.stats()["healthy"] == 0


def test_manager_stats_file_written_off_the_scheduler_thread(tmp_path, vllm_available,
                                                          monkeypatch):
    """$KVCACHE_STATS_FILE is written by the exporter thread, never by the scheduler
    thread that reports (a file create + rename there can wait for the disk's journal),
    soon after each report, and with the final counters at shutdown."""
    import threading

    from vllm.v1.kv_offload.base import ReqContext

    import kvcache_core.vllm.manager as M
    from kvcache_core.bench.common import read_stats_file

    path = str(tmp_path / "stats.json")
    monkeypatch.setenv("KVCACHE_STATS_FILE", path)
    writers: list[str] = []
    real_replace = os.replace

    def spy(src, dst, *a, **kw):
        if dst == path:
            writers.append(threading.current_thread().name)
        return real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(M.os, "replace", spy)
    m = M.PyKVCacheManager(str(tmp_path / "root"), [Namespace("m", "bf16", 256, 1 << 16)],
                           n_dram=2)
    t0 = time.time()
    m.prepare_store([key(1)], ReqContext("r"))
    m.on_worker_report(set(), {"chunks_loaded_disk": 3})
    assert read_stats_file(path, since=t0)["chunks_loaded_disk"] == 3
    m.on_worker_report(set(), {"chunks_loaded_disk": 2})
    m.shutdown()
    with open(path) as f:
        assert json.load(f)["chunks_loaded_disk"] == 5  # the last report, written at shutdown
    assert writers and set(writers) == {"kvcache-stats"}


def test_disk_bytes_is_a_gauge_summed_over_ranks(tmp_path, vllm_available):
    """The workers send the namespace ledger they last saw (``disk_bytes``) as deltas;
    the scheduler exposes the sum over ranks as a Prometheus gauge, never as a counter
    (it goes down when files are evicted)."""
    from kvcache_core.layout import Ledger
    from kvcache_core.vllm.manager import METRIC_PREFIX, PyKVCacheManager

    led = Ledger(str(tmp_path / ".usage"))
    try:
        assert led.last == 0
        assert led.add(300) == 300 and led.last == 300
        led.set(120)
        assert led.last == 120
    finally:
        led.close()
    m = PyKVCacheManager(str(tmp_path), [Namespace("m", "bf16", 256, 1 << 16)], n_dram=2)
    m.on_worker_report(set(), {"disk_bytes": 1000, "chunks_loaded_disk": 1})
    m.on_worker_report(set(), {"disk_bytes": 500})  # a second rank's namespace
    st = m.get_stats()
    types, vals = st.data["types"], st.data["data"]
    assert types[METRIC_PREFIX + "disk_bytes"] == "gauge"
    assert types[METRIC_PREFIX + "chunks_loaded_disk"] == "counter"
    assert sum(vals[METRIC_PREFIX + "disk_bytes"].values()) == 1500
    m.on_worker_report(set(), {"disk_bytes": -700})  # evictions
    assert m.stats()["disk_bytes"] == 800


def test_manager_concurrent_loads_of_one_block_read_it_once(tmp_path, vllm_available):
    """While one request reads a disk block into the DRAM tier, another request's lookup
    of that block is HIT_PENDING (vLLM retries it next step) and then a DRAM hit: one
    disk read per block. A failed promotion ends the wait with the block a miss."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager

    ns = Namespace("m", "bf16", 256, 1 << 16)
    m = PyKVCacheManager(str(tmp_path), [ns], n_dram=4)
    r1, r2 = ReqContext("r1"), ReqContext("r2")
    k1, k2 = key(1), key(2)
    for k in (k1, k2):
        p = m.disk[0].path_for(k)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        open(p, "w").close()
    assert m.lookup(k1, r1) == LookupResult.HIT
    spec = m.prepare_load([k1, k2], r1)
    assert spec.flags == [0, 0] and min(spec.dram_slots) >= 0  # both promoted
    assert m.lookup(k1, r2) == LookupResult.HIT_PENDING
    assert m.plan_preloads([], [], 8) == []
    m.on_worker_report({k2}, {})  # k2's read failed
    m.complete_load([k1, k2], r1)
    assert m.lookup(k1, r2) == LookupResult.HIT and m.dram.lookup(k1) >= 0
    assert m.lookup(k2, r2) == LookupResult.MISS  # failed: a miss for a while, no wait
    s = m.stats()
    assert s["hits_pending"] == 1 and s["loads_disk"] == 2
    spec = m.prepare_load([k1], r2)
    assert spec.flags == [IN_SLOT]  # served from the DRAM tier, not read again
    m.complete_load([k1], r2)
    m.dram.check()


def test_manager_slots_hits_and_failures(tmp_path, vllm_available):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvcache_core.vllm.manager import PyKVCacheManager

    ns = Namespace("m", "bf16", 256, 1 << 16)
    m = PyKVCacheManager(str(tmp_path), [ns], n_dram=2, writeback_max_fraction=1.0)
    r1, r2 = ReqContext("r1"), ReqContext("r2")
    k1, k2, k3 = key(1), key(2), key(3)

    def on_disk(k: bytes) -> None:
        p = m.disk[0].path_for(k)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        open(p, "w").close()

    assert m.lookup(k1, r1) == LookupResult.MISS
    out = m.prepare_store([k1, k2], r1)
    assert out.keys_to_store == [k1, k2] and out.store_spec.dram_slots == [0, 1]
    assert m.lookup(k1, r1) == LookupResult.MISS  # store in flight
    assert m.prepare_store([k1], r2).keys_to_store == []
    m.complete_store([k1, k2], r1)
    assert m.lookup(k1, r1) == LookupResult.HIT
    # both slots are still being written to disk from: pinned, so a new store gets none
    out = m.prepare_store([k3], r2)
    assert out.keys_to_store == [k3] and out.store_spec.dram_slots == [-1]
    assert out.evicted_keys == [] and m.stats()["stores_no_dram_slot"] == 1
    m.complete_store([k3], r2)
    m.on_worker_report(set(), {}, None, {k1: 1, k2: 1})  # the workers wrote them
    assert m.stats()["dram_writeback_pinned"] == 0
    out = m.prepare_store([k3, k2], r1)  # full: evicts k1 (LRU), never k2 (in this call)
    assert out.keys_to_store == [k3] and out.evicted_keys == [k1]
    m.complete_store([k3], r1)
    m.on_worker_report(set(), {}, None, {k3: 1})
    on_disk(k1)
    assert m.lookup(k1, r1) == LookupResult.HIT
    assert m.stats()["hits_disk"] == 1 and m.stats()["hits_dram"] == 1
    # load k1 (disk) + k2 (DRAM): k2 is pinned first, so k1's promotion evicts k3
    spec = m.prepare_load([k1, k2], r2)
    assert spec.flags == [0, IN_SLOT] and spec.dram_slots[1] == 1 and spec.dram_slots[0] == 0
    m.complete_load([k1, k2], r2)
    assert m.dram.lookup(k1) == 0 and m.dram.lookup(k2) == 1 and m.dram.lookup(k3) == -1
    # a failed DRAM read: the key leaves the DRAM tier
    m.prepare_load([k2], r1)
    m.on_worker_report({k2}, {"chunks_failed": 1})
    m.complete_load([k2], r1)
    assert m.dram.lookup(k2) == -1 and m.lookup(k2, r1) == LookupResult.MISS
    # a failed promotion is not retained
    on_disk(k3)
    spec = m.prepare_load([k3], r1)
    assert spec.dram_slots[0] >= 0 and spec.flags == [0]
    m.on_worker_report({k3}, {})
    m.complete_load([k3], r1)
    assert m.dram.lookup(k3) == -1
    s = m.stats()
    assert s["load_failures"] == 2 and s["chunks_failed"] == 1 and s["promotions"] == 2
    m.dram.check()
    st = m.get_stats()
    assert st is not None and m.get_stats() is None  # deltas only, gauges when changed
    assert st._values["vllm:pykvcache_healthy"] == {(): 1}
    # job latencies from the workers become histogram observations (once)
    m.on_worker_report(set(), {}, None, None, {"load_disk": [0.2, 0.4], "bogus": [1.0]})
    st = m.get_stats()
    assert st is not None and st._types["vllm:pykvcache_load_disk_seconds"] == "histogram"
    assert sorted(st._values["vllm:pykvcache_load_disk_seconds"][()]) == [0.2, 0.4]
    assert not any("bogus" in k for k in st._values) and m.get_stats() is None
    g = m.gauges()
    assert g["healthy"] == 1 and g["dram_cached"] == m.dram.cached
    assert g["stores_in_flight"] == 0 and g["loads_in_flight"] == 0
    m.prepare_store([key(77)], r1)  # a gauge moves: the next report carries it
    st2 = m.get_stats()
    assert st2 is not None and st2._values["vllm:pykvcache_stores_in_flight"] == {(): 1}
    m.reset_cache()
    assert m.lookup(k1, r1) == LookupResult.HIT  # disk stays; DRAM forgotten
    assert m.dram.cached == 0


def test_specs_and_metadata_pickle_and_aggregate(vllm_available):
    from kvcache_core.vllm import PyKVCacheWorkerMetadata
    from kvcache_core.vllm.specs import PyKVLoadSpec, PyKVStoreSpec

    ls = pickle.loads(pickle.dumps(PyKVLoadSpec([key(1)], [3], [IN_SLOT])))
    assert ls.keys == [key(1)] and ls.dram_slots == [3] and ls.flags == [IN_SLOT]
    ss = pickle.loads(pickle.dumps(PyKVStoreSpec([key(2)], [-1])))
    assert ss.keys == [key(2)] and ss.dram_slots == [-1]
    a = PyKVCacheWorkerMetadata(completed_jobs={1: 1}, failed_keys={key(1)},
                                counters={"files_corrupt": 1}, staged={key(3): 1},
                                written={key(5): 1}, observations={"store": [0.1]})
    b = PyKVCacheWorkerMetadata(completed_jobs={1: 1, 2: 1}, failed_keys={key(2)},
                                counters={"files_corrupt": 2, "bytes_read": 5},
                                staged={key(3): 1, key(4): 1}, written={key(5): 1},
                                observations={"store": [0.2], "load_dram": [0.3]})
    c = pickle.loads(pickle.dumps(a.aggregate(b)))
    assert isinstance(c, PyKVCacheWorkerMetadata)
    assert c.completed_jobs == {1: 2, 2: 1} and c.failed_keys == {key(1), key(2)}
    assert c.counters == {"files_corrupt": 3, "bytes_read": 5}
    assert c.staged == {key(3): 2, key(4): 1}  # ranks that staged each key
    assert c.written == {key(5): 2}  # ranks that wrote each key
    assert c.observations == {"store": [0.1, 0.2], "load_dram": [0.3]}  # every rank's
    assert a.observations == {"store": [0.1]}  # the inputs are not modified


def test_manager_staged_blocks_count_as_fast_tier(tmp_path, vllm_available, monkeypatch):
    """Keys every rank reported staged (queue-aware preload) are looked up as tier
    ``staged``, the leading non-disk chunks are counted, a load claims them, and the
    belief expires."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvcache_core.vllm import manager as M

    nss = [Namespace("m", "bf16", 256, 1 << 16, tp_rank=r, tp_size=2) for r in range(2)]
    m = M.PyKVCacheManager(str(tmp_path), nss, n_dram=0)
    assert m.n_ranks == 2 and m.key_bytes == 2 * nss[0].file_bytes
    ks = [key(i) for i in range(1, 4)]
    for k in ks:
        for d in m.disk:
            p = d.path_for(k)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            open(p, "w").close()
    r = ReqContext("r")

    def look():
        m.begin_lookup()
        assert all(m.lookup(k, r) == LookupResult.HIT for k in ks)
        return m.lookup_tier(), m.lookup_fast_chunks()

    assert look() == ("disk", (0, "dram"))
    m.on_worker_report(set(), {}, {ks[0]: 2, ks[1]: 1})  # ks[1]: only one rank staged it
    assert look() == ("disk", (1, "staged"))
    m.on_worker_report(set(), {}, {ks[1]: 2, ks[2]: 2})
    assert look() == ("staged", (3, "staged"))
    assert m.stats()["hits_staged"] == 1 + 3
    m.prepare_load([ks[0]], r)  # claimed: no longer believed staged
    assert look() == ("disk", (0, "dram"))
    m.complete_load([ks[0]], r)
    m.on_worker_report({ks[1]}, {}, {})  # a failed key leaves the staged set too
    monkeypatch.setattr(M.time, "monotonic", lambda: 1e12)  # past the TTL
    m.begin_lookup()
    assert m.lookup(ks[2], r) == LookupResult.HIT and m.lookup_tier() == "disk"


# ------------------------------------------------------------------------ model identity
def _mc(model: str, **kw):
    from types import SimpleNamespace

    cfg = kw.pop("cfg", {"hidden_size": 256, "num_hidden_layers": 2, "rope_theta": 1e4})
    hf = SimpleNamespace(to_dict=lambda: {**cfg, "_name_or_path": model})
    return SimpleNamespace(model=model, revision=kw.get("revision"),
                           quantization=kw.get("quantization"),
                           hf_overrides=kw.get("hf_overrides"), hf_config=hf)


def test_model_identity_changes_with_everything_that_changes_the_kv(tmp_path):
    """Issue 12 item 3: revision, quantization, hf_overrides, the model config, the load
    format and the weight files each change the identity (so the namespace); the path
    the same weights are read from does not."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "model-00001.safetensors").write_bytes(b"w" * 200_000)
        (d / "config.json").write_text("{}")
    base, parts = O.model_identity(_mc(str(a)), "auto")
    assert len(base) == 16 and parts["weights"] and parts["config"]
    assert O.model_identity(_mc(str(b)), "auto")[0] == base  # same weights, other path
    variants = [
        O.model_identity(_mc(str(a), revision="v2"), "auto"),
        O.model_identity(_mc(str(a), quantization="fp8"), "auto"),
        O.model_identity(_mc(str(a), hf_overrides={"rope_theta": 2e4}), "auto"),
        O.model_identity(_mc(str(a), cfg={"hidden_size": 256, "num_hidden_layers": 3}),
                         "auto"),
        O.model_identity(_mc(str(a)), "dummy"),
    ]
    digests = [v[0] for v in variants]
    assert base not in digests and len(set(digests)) == len(digests)
    # weights updated in place (same names and sizes, new values at the end of the file)
    with open(a / "model-00001.safetensors", "r+b") as f:
        f.seek(-10, os.SEEK_END)
        f.write(b"0123456789")
    assert O.model_identity(_mc(str(a)), "auto")[0] != base
    # a hub name (no local directory): no weights part, still deterministic
    hub = O.model_identity(_mc("meta-llama/Llama-3.2-3B"), "auto")
    assert hub == O.model_identity(_mc("meta-llama/Llama-3.2-3B"), "auto")
    assert hub[1]["weights"] == ""


def test_worker_watchdog_gives_up_a_stuck_reactor(tmp_path, vllm_available):
    """Issue 12 item 1 (watchdog): the reactor thread hangs inside a synchronous call (a
    publish on a hung filesystem). A load job submitted meanwhile is finished by the
    worker after 2 x io_timeout_s with its blocks reported for recompute, a flush (wait)
    returns, the engine turns recompute-only, and when the stuck call finally returns the
    reactor never writes the GPU blocks of the given-up job."""
    import threading

    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvcache_core.vllm.specs import PyKVLoadSpec, PyKVStoreSpec

    w = _make_worker(tmp_path, io_timeout_s=0.25)
    ts = w.test_tensors
    release = threading.Event()
    try:
        k1, k2 = key(1), key(2)
        w.submit_store(1, GPULoadStoreSpec([3, 5], [2], [0]), PyKVStoreSpec([k1], [-1]))
        _run(w, 1)
        assert w.reactor.wait(30) and w.layout.exists(k1)
        real_publish = w.layout.publish

        def hung_publish(*a, **kw):  # the next publish blocks the reactor thread
            release.wait(60)
            return real_publish(*a, **kw)

        w.layout.publish = hung_publish
        w.submit_store(2, GPULoadStoreSpec([7, 9], [2], [0]), PyKVStoreSpec([k2], [-1]))
        w.wait({2})  # acknowledged once copied; its file write then hangs in publish
        w.get_finished()
        time.sleep(0.3)
        before = [t[10:12].clone() for t in ts]
        w.submit_load(3, PyKVLoadSpec([k1], [-1], [0]), GPULoadStoreSpec([10, 11], [2], [0]))
        t0 = time.monotonic()
        w.wait({3})  # returns through the watchdog, not through the reactor
        took = time.monotonic() - t0
        res = {r.job_id: r for r in w.get_finished()}
        assert 3 in res and res[3].success and took < 5, took
        assert w.take_invalid_block_ids() == {10, 11}
        failed, counters = w.take_report()
        assert failed == {k1}
        assert counters["reactor_stalled"] == 1 and counters["reactor_dead"] == 1
        release.set()  # the stuck call returns: the reactor must not touch blocks 10, 11
        time.sleep(0.5)
        assert all(torch.equal(t[10:12], b) for t, b in zip(ts, before, strict=True))
        w.submit_load(4, PyKVLoadSpec([k1], [-1], [0]), GPULoadStoreSpec([12, 13], [2], [0]))
        _run(w, 4)  # later jobs complete at once (recompute-only)
        assert w.take_invalid_block_ids() == {12, 13}
    finally:
        release.set()
        w.shutdown()
