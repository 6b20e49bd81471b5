"""Fast tests of :mod:`kvcache_core.vllm.transfer` without an engine: chunk mapping
against vLLM's own ``compute_sub_block_ptrs``, batched copy descriptors."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from helpers.vllm_units import key

from kvcache_core.layout import HEADER_BYTES


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
    with pytest.raises(ValueError, match="out of range"):
        g.split(GPULoadStoreSpec([1, 99], [2], [0]), [key(1)])  # block out of range
    with pytest.raises(ValueError, match="out of range"):
        g.split(GPULoadStoreSpec([1, 2, -1, 3], [4], [0]), [key(1), key(2)])  # negative
    assert len(g.split(GPULoadStoreSpec([1, 2, 63, 0], [4], [0]), [key(1), key(2)])) == 2


def test_dram_load_copy_mode_choice():
    """``dram_load_copy``: 'auto' takes the gather kernel only for hits whose descriptors
    did not coalesce (many small ones: one per GPU block and layer), DMA for coalesced
    runs and for tiny hits; 'dma' and 'kernel' are what they say."""
    from kvcache_core.vllm.transfer import KERNEL_MIN_OPS, use_gather_kernel

    runs = np.full(28 * 4, 1 << 20, dtype=np.int64)  # 4 chunks, one 1 MiB run per layer
    blocks = np.full(28 * 4 * 16, 64 << 10, dtype=np.int64)  # the same, block by block
    assert not use_gather_kernel("auto", runs) and use_gather_kernel("auto", blocks)
    assert not use_gather_kernel("auto", blocks[:KERNEL_MIN_OPS - 1])
    for sizes in (runs, blocks):
        assert use_gather_kernel("kernel", sizes) and not use_gather_kernel("dma", sizes)


@contextlib.contextmanager
def _copier(tmp_path, g, n_slots: int, payload: int):
    """A CPU :class:`KVCopier` over geometry ``g`` and an unpinned pool of ``n_slots``
    8 KiB slots (a layout whose blocks hold ``payload`` bytes); closed afterwards."""
    from kvcache_core.layout import Layout, Namespace
    from kvcache_core.staging import StagingPool
    from kvcache_core.vllm.transfer import KVCopier

    pool = StagingPool(n_slots, 8192, pin=False)
    lay = Layout(str(tmp_path), Namespace("m", "bfloat16", 32, payload))
    try:
        yield KVCopier(pool, HEADER_BYTES, geometry=g, layout=lay, n_staging=n_slots)
    finally:
        lay.close()
        pool.close()


@pytest.mark.parametrize("key_name,setter,attr", [
    ("dram_load_copy", "set_direct_copy", "direct_copy"),
    ("store_copy", "set_store_copy", "store_copy")])
def test_copy_modes_without_cuda_are_dma(tmp_path, vllm_available, key_name, setter, attr):
    """Where CUDA is absent the kernel cannot run: set_direct_copy / set_store_copy keep
    'dma' for every valid mode and refuse an unknown one by its config key's name."""
    with _copier(tmp_path, _geometry(2), 4, 2 * 2 * 256) as c:
        for mode in ("dma", "kernel", "auto"):
            assert getattr(c, setter)(mode) == "dma" and getattr(c, attr) == "dma"
        with pytest.raises(ValueError, match=key_name):
            getattr(c, setter)("fast")


def test_store_copy_auto_picks_scattered_stores(tmp_path, vllm_available):
    """``store_copy='auto'``: a store job whose GPU blocks run backwards (vLLM hands a
    request the blocks its predecessor freed, in reverse) has one descriptor per block
    and tensor, so it goes to the gather kernel (counted in ``store_kernel_jobs``) while a
    consecutive one stays on DMA; either way the pool receives the KV bytes (here through
    the CPU copy, which ignores the choice)."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    page, n_t, bpc = 256, 2, 4
    g = _geometry(bpc, n_tensors=n_t, nb=64, page=page)
    for t in g.flat:
        t[:] = torch.randint(-128, 127, t.shape, dtype=torch.int8)
    slot = 8192  # header + 2 KiB of payload, rounded up to the pool's page multiple
    with _copier(tmp_path, g, 16, n_t * bpc * page) as c:
        pool = c.pool
        c.store_copy = "auto"  # as set_store_copy leaves it where the kernel runs
        # 4 chunks of 4 blocks: one descriptor per chunk and tensor when consecutive (8,
        # below KERNEL_MIN_OPS), one per block and tensor when reversed (32)
        backwards = list(range(63, 47, -1))
        consecutive = list(range(0, 16))
        for ids, kernel_jobs in ((consecutive, 0), (backwards, 1)):
            refs = g.split(GPULoadStoreSpec(ids, [16], [0]), [key(i) for i in range(4)])
            slots = [3, 9, 4, 12]
            pool.as_tensor().zero_()
            assert c.done(c.from_device_batch(slots, refs, [slot] * 4))
            assert c.store_kernel_jobs == kernel_jobs
            # every descriptor's bytes arrived (the descriptors themselves are checked
            # against vLLM's own mapping in the tests above)
            ops = g.batch_ops(refs, [s * slot + HEADER_BYTES for s in slots])
            assert len(ops[0]) == (32 if kernel_jobs else 8)
            p_t = pool.as_tensor()
            for t, k, p, n in zip(*(a.tolist() for a in ops), strict=True):
                assert torch.equal(p_t[p:p + n], g.flat[t][k:k + n].view(torch.uint8))
            assert int(p_t.count_nonzero()) > 0


def test_kernel_programs_env():
    """KVCACHE_KERNEL_PROGRAMS: unset or empty is the default grid; zero or less is
    refused (a grid of no programs would launch a kernel that copies nothing)."""
    from kvcache_core.vllm.transfer import KERNEL_PROGRAMS, kernel_programs

    assert kernel_programs(None) == kernel_programs("") == KERNEL_PROGRAMS
    assert kernel_programs("66") == 66
    for bad in ("0", "-1", "many"):
        with pytest.raises(ValueError, match="KVCACHE_KERNEL_PROGRAMS"):
            kernel_programs(bad)


def test_check_copy_finds_skipped_and_short_copies(tmp_path, vllm_available):
    """The KVCACHE_VERIFY_DIRECT spot check: 0 after a complete pool -> KV copy; a copy
    that skipped a descriptor, or stopped inside one, is counted."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvcache_core.layout import Layout, Namespace
    from kvcache_core.staging import StagingPool
    from kvcache_core.vllm.transfer import KVCopier

    page, n_t, bpc = 256, 3, 4
    g = _geometry(bpc, n_tensors=n_t, nb=64, page=page)
    pool = StagingPool(8, 8192, pin=False)
    pool.as_tensor()[:] = torch.randint(0, 255, (8 * 8192,), dtype=torch.uint8)
    lay = Layout(str(tmp_path), Namespace("m", "bfloat16", 32, n_t * bpc * page))
    try:
        c = KVCopier(pool, HEADER_BYTES, geometry=g, layout=lay, n_staging=8)
        ids = [40, 39, 38, 37, 9, 10, 11, 12]  # one reversed chunk, one consecutive
        refs = g.split(GPULoadStoreSpec(ids, [8], [0]), [key(1), key(2)])
        ops = g.batch_ops(refs, [3 * 8192 + HEADER_BYTES, 5 * 8192 + HEADER_BYTES])
        c._run(ops, to_device=True, after=None, slot=-1)
        assert c.check_copy(ops) == 0
        t, k, _, n = (int(a[-1]) for a in ops)
        g.flat[t][k + n - 1] ^= 1  # the last byte of the last descriptor never arrived
        assert c.check_copy(ops) == 1
        g.flat[t][k + n - 1] ^= 1
        t, k, _, n = (int(a[0]) for a in ops)
        g.flat[t][k:k + n].zero_()  # the first descriptor was skipped
        assert c.check_copy(ops) >= 1
    finally:
        lay.close()
        pool.close()


def test_kernel_descriptors_pad_to_one_specialization():
    """The gather kernel's arguments: rows of source, destination and size, padded with
    zero-byte descriptors to a multiple of KERNEL_PAD (one Triton specialization for
    every hit, the one compiled at start-up), the real ones untouched and in order."""
    from kvcache_core.vllm.transfer import KERNEL_PAD, kernel_descriptors

    for n in (1, KERNEL_PAD - 1, KERNEL_PAD, 3 * KERNEL_PAD + 5):
        src = np.arange(n, dtype=np.int64) * 4096 + (1 << 40)
        dst = np.arange(n, dtype=np.int64)[::-1] * 65536 + (1 << 41)
        sizes = np.full(n, 65536, dtype=np.int64)
        d = kernel_descriptors(src, dst, sizes)
        m = d.shape[1]
        assert d.dtype == np.int64 and m % KERNEL_PAD == 0 and m - n < KERNEL_PAD
        assert d.flags.c_contiguous and (m * 8) % 16 == 0  # rows 16-byte aligned
        assert (d[0, :n] == src).all() and (d[1, :n] == dst).all()
        assert (d[2, :n] == sizes).all() and not d[2, n:].any()  # padding copies nothing
