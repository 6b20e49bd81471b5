"""KV geometry and the KV copier: which bytes of vLLM's KV cache go where in a slot.

Slot payload layout (one storage block = one chunk of ``blocks_per_chunk`` GPU blocks of
one KV-cache group): for each canonical KV tensor of the group, in tensor order, the
chunk's ``blocks_per_chunk`` pages back to back::

    | header 4 KiB | T0 p0 | T0 p1 | ... | T0 p(bpc-1) | T1 p0 | ... | pad to 4 KiB |

A partial chunk (a load that skips the first ``block_indices % blocks_per_chunk``
sub-blocks, see vLLM's ``compute_sub_block_ptrs``) still uses the full-chunk offsets, so
the file bytes never depend on how much of the chunk a request needed.

:meth:`KVGeometry.ops` turns a chunk into copy descriptors (tensor index, byte offset in
the KV tensor, byte offset in the pool, size), one per (tensor, GPU block): the reference
mapping. :meth:`KVGeometry.batch_ops` builds the same descriptors for a whole batch in a
fixed number of vectorised steps and merges runs that are contiguous on both sides (a
fresh request's consecutive GPU blocks: one copy per chunk and tensor). Every execution
path uses the batch descriptors: the CPU path (per-descriptor torch slice copies, used on vLLM's
CPU platform and in CI), the CUDA path (ONE ``vllm._custom_ops.swap_blocks_batch`` call
over raw pointers per batch) and the CUDA fallback (per-descriptor ``copy_(non_blocking)``
on a dedicated stream).

Threads: :class:`KVGeometry` is built by the worker thread and read-only afterwards.
:class:`KVCopier` methods run on the reactor thread only (the reactor's contract).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..copy import Copier
from ..layout import HEADER_BYTES, CorruptBlock, Layout
from ..staging import StagingPool

log = logging.getLogger("vllm.pykvcache")
N_STORE_STREAMS = 8
#: ``dram_load_copy``: vLLM's gather kernel copies this many bytes per step of a program
#: (its own choice for pages of 8 KiB and more)
KERNEL_CHUNK_BYTES = 8192
#: programs (thread blocks) of one gather-kernel launch: 16 of the H200's 132 SMs already
#: read the pinned pool at 51 GB/s, as 32-132 do (docs/results/h200/h2d-kernel-s19.md)
KERNEL_PROGRAMS = 16
#: the kernel's descriptor count is padded to a multiple of this (:func:`kernel_descriptors`)
KERNEL_PAD = 16
#: "auto" uses the kernel for a DRAM hit of at least this many descriptors ...
KERNEL_MIN_OPS = 16
#: ... averaging below this many bytes (blocks that did not coalesce into runs)
KERNEL_MAX_MEAN_BYTES = 256 << 10


def kernel_programs(env: str | None) -> int:
    """The gather kernel's grid: :data:`KERNEL_PROGRAMS`, or a positive integer from
    ``env`` (the value of KVCACHE_KERNEL_PROGRAMS; unset or empty: the default). A grid of
    zero programs would launch a kernel that copies nothing, so it is refused."""
    if not env:
        return KERNEL_PROGRAMS
    try:
        n = int(env)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"KVCACHE_KERNEL_PROGRAMS must be a positive integer, got {env!r}")
    return n


def kernel_descriptors(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The gather kernel's arguments as one (3, m) int64 array (source addresses,
    destination addresses, byte sizes), ``m`` = the descriptor count rounded up to a
    multiple of :data:`KERNEL_PAD` with zero-byte descriptors (the kernel copies nothing
    for them). Triton compiles one variant per divisibility of its integer argument and
    per 16-byte alignment of its pointer arguments (rows start at ``m * 8`` bytes), so a
    fixed multiple keeps every launch on the variant compiled at start-up: the first
    H200 kernel hit without it paid 0.35 s of compilation."""
    n = len(sizes)
    out = np.zeros((3, n + (-n) % KERNEL_PAD), dtype=np.int64)
    out[0, :n] = src
    out[1, :n] = dst
    out[2, :n] = sizes
    return out


def launch_gather(kfn: Any, dev: torch.device, src: np.ndarray, dst: np.ndarray,
                  sizes: np.ndarray, programs: int) -> torch.Tensor:  # pragma: no cover
    """One launch of vLLM's gather kernel ``kfn`` on the current stream: the padded
    descriptors (:func:`kernel_descriptors`) copied to ``dev`` as one (3, m) tensor, then
    ``min(programs, m)`` programs copy ``sizes[i]`` bytes from ``src[i]`` to ``dst[i]``
    (any pointers a GPU thread can dereference: device memory, page-locked host memory).
    Returns the descriptor tensor, which must outlive the launch. Needs CUDA."""
    d = torch.from_numpy(kernel_descriptors(src, dst, sizes)).to(dev, non_blocking=True)
    m = int(d.shape[1])
    kfn[(min(programs, m),)](d[0], d[1], d[2], m, BYTES_PER_CHUNK=KERNEL_CHUNK_BYTES)
    return d


def use_gather_kernel(mode: str, sizes: np.ndarray) -> bool:
    """Whether a DRAM hit whose (coalesced) copy descriptors have these byte ``sizes`` is
    copied by the gather kernel under ``dram_load_copy`` = ``mode``: always for "kernel",
    never for "dma"; for "auto" when there are at least :data:`KERNEL_MIN_OPS` of them and
    they average below :data:`KERNEL_MAX_MEAN_BYTES` (vLLM handed the request
    non-consecutive GPU blocks, so runs did not coalesce and DMA would need one descriptor
    per block and layer)."""
    if mode != "auto":
        return mode == "kernel"
    n = len(sizes)
    return n >= KERNEL_MIN_OPS and int(sizes.sum()) < KERNEL_MAX_MEAN_BYTES * n


class ChunkRef:
    """One storage block of a job, as the copier sees it (the reactor's ``ref``).

    ``gpu_ids`` are the GPU blocks of this chunk that the job moves, which are sub-blocks
    ``sub_start .. sub_start + len(gpu_ids) - 1`` of the chunk. ``check_header``: the
    bytes come from a DRAM-tier slot and must be validated before use. ``failed`` is set by
    the copier (reactor thread) when it refused the chunk; the worker reads it only after
    the job's completion. ``after``: CUDA event the store copy waits on (None on CPU).
    """

    __slots__ = ("key", "group", "gpu_ids", "sub_start", "check_header", "failed", "after")

    def __init__(self, key: bytes, group: int, gpu_ids: np.ndarray, sub_start: int) -> None:
        self.key = key
        self.group = group
        self.gpu_ids = gpu_ids
        self.sub_start = sub_start
        self.check_header = False
        self.failed = False
        self.after: Any = None

    def __repr__(self) -> str:
        return (f"ChunkRef(group={self.group}, gpu_ids={self.gpu_ids.tolist()}, "
                f"sub_start={self.sub_start})")


@dataclass(frozen=True)
class GroupPlan:
    """Tensors of one KV-cache group and their offsets inside a chunk payload."""

    tensor_idx: tuple[int, ...]
    payload_offset: tuple[int, ...]
    payload_bytes: int  # bytes of one full chunk of this group
    gpu_block_bytes: int  # bytes of one GPU block of this group (all its tensors)


class KVGeometry:
    """The worker's KV tensors (from vLLM's ``CanonicalKVCaches``) and the chunk layout."""

    def __init__(self, tensors: Sequence[Any], group_data_refs: Sequence[Sequence[Any]],
                 blocks_per_chunk: int) -> None:
        """``tensors``: CanonicalKVCacheTensor-likes (``.tensor`` of shape (num_blocks,
        row) with unit inner stride, ``.page_size_bytes``); ``group_data_refs``: per group,
        refs with ``.tensor_idx``."""
        if blocks_per_chunk <= 0:
            raise ValueError("blocks_per_chunk must be > 0")
        if not tensors:
            raise ValueError("no KV cache tensors")
        self.bpc = blocks_per_chunk
        self.flat: list[torch.Tensor] = []
        self.page: list[int] = []
        self.row_stride: list[int] = []
        self.num_blocks: list[int] = []
        for ct in tensors:
            t = ct.tensor
            u = t.view(torch.uint8) if t.dtype != torch.uint8 else t
            if u.ndim != 2 or u.stride(1) != 1:
                raise ValueError(f"KV tensor must be (num_blocks, bytes) with unit inner "
                                 f"stride, got shape {tuple(u.shape)} stride {u.stride()}")
            nb, rs, page = u.shape[0], u.stride(0), int(ct.page_size_bytes)
            if page > rs or page > u.shape[1]:
                raise ValueError(f"page_size_bytes {page} exceeds the row ({u.shape[1]} B, "
                                 f"stride {rs} B)")
            self.flat.append(u.as_strided(((nb - 1) * rs + page,), (1,), u.storage_offset()))
            self.page.append(page)
            self.row_stride.append(rs)
            self.num_blocks.append(nb)
        self.device = self.flat[0].device
        self.groups: list[GroupPlan] = []
        for refs in group_data_refs:
            idx = tuple(sorted({int(r.tensor_idx) for r in refs}))
            offs, off = [], 0
            for ti in idx:
                offs.append(off)
                off += self.page[ti] * blocks_per_chunk
            self.groups.append(GroupPlan(idx, tuple(offs), off,
                                         sum(self.page[ti] for ti in idx)))
        self.max_payload = max((g.payload_bytes for g in self.groups), default=0)
        # per group: (tensor idx, row stride, page, payload offset) as int64 column vectors
        self._gcols = [tuple(np.asarray(c, dtype=np.int64)[:, None] for c in (
            g.tensor_idx, [self.row_stride[t] for t in g.tensor_idx],
            [self.page[t] for t in g.tensor_idx], g.payload_offset)) for g in self.groups]

    def payload_bytes(self, group: int) -> int:
        return self.groups[group].payload_bytes

    def describe(self) -> str:
        return ", ".join(f"T{i}[{n}x{p}B stride {s}]" for i, (n, p, s) in
                         enumerate(zip(self.num_blocks, self.page, self.row_stride, strict=True)))

    # ------------------------------------------------------------------ mapping
    def split(self, gpu_spec: Any, keys: Sequence[bytes]) -> list[ChunkRef]:
        """Map a job's ``GPULoadStoreSpec`` onto its chunks (``keys`` in chunk order).

        Per group ``g`` (``group_sizes[g]`` GPU blocks; the first chunk skips
        ``block_indices[g] % blocks_per_chunk`` sub-blocks), chunk ``c`` takes the next
        ``min(bpc - skip_c, remaining)`` GPU blocks. Raises ValueError when the spec and
        the keys disagree (a bug, never data-dependent).
        """
        bpc = self.bpc
        block_ids = np.asarray(gpu_spec.block_ids, dtype=np.int64)
        sizes = list(gpu_spec.group_sizes) if gpu_spec.group_sizes is not None \
            else [len(block_ids)]
        indices = list(gpu_spec.block_indices) if gpu_spec.block_indices is not None \
            else [0] * len(sizes)
        if len(sizes) != len(self.groups):
            raise ValueError(f"spec has {len(sizes)} KV groups, the worker {len(self.groups)}")
        refs: list[ChunkRef] = []
        k = 0
        g_off = 0
        for g, (gsize, bidx) in enumerate(zip(sizes, indices, strict=False)):
            if gsize == 0:
                continue
            skip = int(bidx) % bpc
            ids = block_ids[g_off:g_off + gsize]
            # one range check per group (every chunk's ids are a slice of these)
            limit = min(self.num_blocks[t] for t in self.groups[g].tensor_idx)
            if len(ids) and (ids.min() < 0 or ids.max() >= limit):
                raise ValueError(f"GPU block id out of range in group {g}: "
                                 f"{ids.min()}..{ids.max()}, {limit} blocks")
            pos = 0
            first = True
            while pos < gsize:
                sub = skip if first else 0
                n = min(bpc - sub, gsize - pos)
                if k >= len(keys):
                    raise ValueError(f"GPU spec needs more chunks than the {len(keys)} keys")
                key = keys[k]
                if int.from_bytes(key[-4:], "big") != g:
                    raise ValueError(f"chunk {k}: key belongs to group "
                                     f"{int.from_bytes(key[-4:], 'big')}, GPU blocks to {g}")
                refs.append(ChunkRef(key, g, ids[pos:pos + n], sub))
                pos += n
                k += 1
                first = False
            g_off += gsize
        if k != len(keys) or g_off != len(block_ids):
            raise ValueError(f"GPU spec ({len(block_ids)} blocks, {k} chunks) does not match "
                             f"{len(keys)} keys")
        return refs

    def ops(self, ref: ChunkRef, slot_base: int) -> tuple[np.ndarray, ...]:
        """Copy descriptors of one chunk whose slot payload starts at pool byte
        ``slot_base``: (tensor index, KV byte offset, pool byte offset, size) arrays, one
        entry per (tensor, GPU block). The same offsets serve both directions."""
        plan = self.groups[ref.group]
        n = len(ref.gpu_ids)
        subs = ref.sub_start + np.arange(n, dtype=np.int64)
        tix, kvo, plo, szs = [], [], [], []
        for ti, toff in zip(plan.tensor_idx, plan.payload_offset, strict=True):
            page = self.page[ti]
            tix.append(np.full(n, ti, dtype=np.int64))
            kvo.append(ref.gpu_ids * self.row_stride[ti])
            plo.append(slot_base + toff + subs * page)
            szs.append(np.full(n, page, dtype=np.int64))
        return (np.concatenate(tix), np.concatenate(kvo), np.concatenate(plo),
                np.concatenate(szs))


    def batch_ops(self, refs: Sequence[ChunkRef], slot_bases: Sequence[int],
                  coalesce: bool = True) -> tuple[np.ndarray, ...]:
        """Copy descriptors of many chunks at once (same columns as :meth:`ops`), built
        with a fixed number of vectorised steps per KV group, whatever the chunk count.

        ``coalesce``: merge neighbours that are contiguous on BOTH sides (same tensor,
        KV offset and pool offset each continue where the previous one ended) into one
        descriptor. vLLM hands out consecutive GPU block ids to a fresh request, and a
        chunk's pages of one tensor are consecutive in the slot, so a 16-block chunk of a
        28-layer model typically becomes 28 copies of 1 MiB instead of 448 of 64 KiB.
        """
        parts = []
        for g, cols in enumerate(self._gcols):
            sel = [i for i, r in enumerate(refs) if r.group == g]
            if not sel:
                continue
            ids = [refs[i].gpu_ids for i in sel]
            counts = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(sel))
            n = int(counts.sum())
            if n == 0:
                continue
            gid = np.concatenate(ids).astype(np.int64, copy=False)
            starts = np.cumsum(counts) - counts
            first = np.fromiter((refs[i].sub_start for i in sel), dtype=np.int64,
                                count=len(sel))
            subs = np.arange(n, dtype=np.int64) + np.repeat(first - starts, counts)
            base = np.repeat(np.fromiter((slot_bases[i] for i in sel), dtype=np.int64,
                                         count=len(sel)), counts)
            tix, rs, page, toff = cols
            parts.append(tuple(a.ravel() for a in np.broadcast_arrays(
                tix, gid[None, :] * rs, base[None, :] + toff + subs[None, :] * page, page)))
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty, empty
        tix, kvo, plo, szs = (parts[0] if len(parts) == 1 else
                              tuple(np.concatenate(c) for c in zip(*parts, strict=True)))
        if coalesce and len(tix) > 1:
            cont = ((tix[1:] == tix[:-1]) & (kvo[1:] == kvo[:-1] + szs[:-1])
                    & (plo[1:] == plo[:-1] + szs[:-1]))
            if cont.any():
                heads = np.flatnonzero(np.concatenate(([True], ~cont)))
                return tix[heads], kvo[heads], plo[heads], np.add.reduceat(szs, heads)
        return (np.ascontiguousarray(tix), np.ascontiguousarray(kvo),
                np.ascontiguousarray(plo), np.ascontiguousarray(szs))


class _CudaHandle:
    """A submitted copy: its completion event and the pointer tensors it must outlive."""

    __slots__ = ("event", "keep", "start")

    def __init__(self, event: Any, keep: Any, start: Any = None) -> None:
        self.event = event
        self.keep = keep
        #: timing event recorded just before the copy (``KVCopier.time_direct`` only)
        self.start = start


class KVCopier(Copier):
    """Copies chunks between the staging pool and vLLM's KV cache (reactor thread only).

    ``to_device`` issues ALL chunks that became ready in one reactor iteration as one
    batch; chunks read from a DRAM-tier slot are validated first (header magic, key,
    geometry; no payload hash), and a refused chunk is marked ``ref.failed`` and not
    copied. ``from_device_batch`` copies all chunks of one store job in one call (the
    reactor then writes the slot headers, DRAM-tier slots included, so a retained slot
    always holds header + payload).
    """

    def __init__(self, pool: StagingPool, offset: int, *, geometry: KVGeometry,
                 layout: Layout, n_staging: int) -> None:
        super().__init__(pool, offset)
        if offset != HEADER_BYTES:
            raise ValueError("payload offset must be the header size")
        self.g = geometry
        self.layout = layout
        self.n_staging = n_staging
        self.slot_bytes = pool.slot_bytes
        self.header_failures = 0
        #: :meth:`load_direct`'s time on the calling (model-runner) thread, seconds:
        #: [slot header checks, descriptor build, copy issue (the swap call), longest issue].
        #: A copy issue that lasts as long as the copy says the driver ran it synchronously.
        self.direct_timing = [0.0, 0.0, 0.0, 0.0]
        #: copy descriptors of the last :meth:`load_direct` (after coalescing; diagnostics)
        self.last_direct_ops = 0
        #: ``dram_load_copy``: how :meth:`load_direct` copies ("dma", "kernel", "auto");
        #: set through :meth:`set_direct_copy` (model-runner thread, before any load)
        self.direct_copy = "dma"
        #: DRAM-hit jobs copied by the gather kernel (diagnostics, exported timing)
        self.direct_kernel_jobs = 0
        #: ``store_copy``: how :meth:`from_device_batch` copies ("dma", "kernel", "auto");
        #: set through :meth:`set_store_copy` (model-runner thread, before the reactor
        #: copies anything)
        self.store_copy = "dma"
        #: store jobs copied by the gather kernel (reactor thread; diagnostics)
        self.store_kernel_jobs = 0
        #: diagnostics (env KVCACHE_VERIFY_DIRECT=1, set by the worker): keep the last
        #: :meth:`load_direct`'s descriptors in ``last_ops`` for :meth:`check_copy`
        self.verify_direct = False
        self.last_ops: tuple[np.ndarray, ...] | None = None
        #: diagnostics (set by the worker when the trace is on): :meth:`load_direct`'s
        #: copies carry timing events, read back with :meth:`copy_ms`
        self.time_direct = False
        self._b_refs: list[ChunkRef] = []  # per-batch scratch lists (reactor thread)
        self._b_bases: list[int] = []
        self._pool_t = pool.as_tensor()
        self.cuda = geometry.device.type == "cuda"
        self.asynchronous = self.cuda
        self._cx: _CudaExec | None = _CudaExec(geometry, self._pool_t) if self.cuda else None
        # CPU platform: numpy views (shared memory) of the KV tensors and the pool, copied
        # with numpy's single-threaded memcpy. A torch ``copy_`` of more than 32 KiB runs
        # an OpenMP parallel region, and one from a thread other than vLLM's (the reactor)
        # makes libgomp create a second thread team for the process's whole life; with
        # more OpenMP threads than CPUs libgomp then cuts its spin-wait to almost nothing
        # (GOMP_SPINCOUNT), so vLLM's own OpenMP worker sleeps between parallel regions
        # and every region pays a wake-up: scripts/bench_step_overhead.py measured
        # vLLM's decode step 1.2-1.4x slower (docs/results/cpu/step-overhead.md).
        # Diagnostic knob (env KVCACHE_CPU_COPY=torch): the torch tensors themselves (slice
        # assignment is torch ``copy_``), for that A/B.
        self._cpu: tuple[Sequence[Any], Any] = (geometry.flat, self._pool_t)
        if not self.cuda and os.environ.get("KVCACHE_CPU_COPY") != "torch":
            self._cpu = ([t.numpy() for t in geometry.flat], self._pool_t.numpy())

    # ------------------------------------------------------------------ reactor API
    def to_device(self, slots: list[int], dests: list[Any], nbytes: list[int]) -> Any:
        refs, bases = self._b_refs, self._b_bases
        refs.clear()
        bases.clear()
        for slot, ref, n in zip(slots, dests, nbytes, strict=True):
            need = self.g.payload_bytes(ref.group)
            if n < need or (ref.check_header and not self._slot_valid(slot, ref.key, need)):
                ref.failed = True
                continue
            refs.append(ref)
            bases.append(slot * self.slot_bytes + HEADER_BYTES)
        if not refs:
            return None
        return self._run(self.g.batch_ops(refs, bases), to_device=True, after=None, slot=-1)

    def from_device(self, slot: int, src: Any, nbytes: int) -> Any:
        ref: ChunkRef = src
        # The reactor writes the slot header once the copy is done (also for DRAM-tier
        # slots whose file already exists), so nothing to do here but the copy.
        ops = self.g.batch_ops((ref,), (slot * self.slot_bytes + HEADER_BYTES,))
        return self._run(ops, to_device=False, after=ref.after, slot=slot)

    def load_direct(self, slots: list[int], refs: list[ChunkRef]) -> Any:
        """DRAM-tier hits copied to the device WITHOUT the reactor: the worker's
        model-runner thread is the only caller (its own stream, no shared scratch).
        ``slots`` are pool slots holding the chunks; a slot whose header does not hold its
        chunk is marked ``ref.failed`` and skipped. Returns a handle for :meth:`done` /
        :meth:`sync` (None when nothing was issued or the copy was synchronous)."""
        sb = self.slot_bytes
        t0 = time.perf_counter()
        good, bases = [], []
        for slot, ref in zip(slots, refs, strict=True):
            if not self._slot_valid(slot, ref.key, self.g.payload_bytes(ref.group)):
                ref.failed = True
                continue
            good.append(ref)
            bases.append(slot * sb + HEADER_BYTES)
        if not good:
            return None
        t1 = time.perf_counter()
        ops = self.g.batch_ops(good, bases)
        n_ops = len(ops[0])
        self.last_direct_ops = n_ops
        kernel = use_gather_kernel(self.direct_copy, ops[3])
        if self.verify_direct:
            self.last_ops = ops
        t2 = time.perf_counter()
        h = self._run(ops, to_device=True, after=None, slot=-1, direct=True, kernel=kernel)
        if kernel:
            self.direct_kernel_jobs += 1
        t3 = time.perf_counter()
        dt = self.direct_timing
        dt[0] += t1 - t0
        dt[1] += t2 - t1
        dt[2] += t3 - t2
        if t3 - t2 > dt[3]:
            dt[3] = t3 - t2
        return h

    def set_direct_copy(self, mode: str) -> str:
        """Choose how :meth:`load_direct` copies (``dram_load_copy``: "dma", "kernel" or
        "auto"); model-runner thread, before the first load. "kernel" and "auto" load and
        compile vLLM's gather kernel now (one tiny copy, so the first hit pays no JIT) and
        fall back to "dma" with a warning where it cannot run (no Triton, a vLLM without
        the kernel). Returns the mode in effect; without CUDA that is always "dma"."""
        self.direct_copy = self._kernel_mode("dram_load_copy", mode, "DRAM hits")
        return self.direct_copy

    def set_store_copy(self, mode: str) -> str:
        """Choose how :meth:`from_device_batch` copies (``store_copy``: "dma", "kernel" or
        "auto", the same rule as :meth:`set_direct_copy`); model-runner thread, before
        the reactor issues its first store copy. Returns the mode in effect ("dma" without
        CUDA or where the kernel cannot run)."""
        self.store_copy = self._kernel_mode("store_copy", mode, "stores")
        return self.store_copy

    def _kernel_mode(self, key: str, mode: str, what: str) -> str:
        """``mode`` for config key ``key`` if it can run here, else "dma" (with a warning
        when the gather kernel was asked for and cannot run)."""
        if mode not in ("dma", "kernel", "auto"):
            raise ValueError(f"{key} must be 'dma', 'kernel' or 'auto', got {mode!r}")
        if mode != "dma" and self._cx is not None:  # pragma: no cover - needs CUDA
            try:
                if not getattr(self.pool, "pinned", False):
                    raise RuntimeError("the pool is not registered with CUDA (page-locked), "
                                       "so GPU threads cannot reach it")
                self._cx.load_kernel()
            except Exception as e:  # noqa: BLE001 - any failure means: not here
                log.warning("py-kvcache: %s=%r needs vLLM's Triton gather kernel, which "
                            "cannot run here (%s: %s); %s use 'dma'", key, mode,
                            type(e).__name__, e, what)
                mode = "dma"
        return mode if self._cx is not None else "dma"

    def check_copy(self, ops: tuple[np.ndarray, ...], samples: int = 16,
                   window: int = 64) -> int:
        """Diagnostics: compare the first and the last ``window`` bytes of up to
        ``samples`` descriptors (spread over all of them) of a FINISHED pool -> KV copy
        between the pool and the KV tensors; returns how many descriptors differ. A copy
        that skipped descriptors or stopped early inside one shows up here. Model-runner
        thread (a device read-back on its current stream)."""
        tix, kvo, plo, szs = ops
        n = len(tix)
        if n == 0:
            return 0
        bad = 0
        for i in np.unique(np.linspace(0, n - 1, min(n, samples)).astype(np.int64)).tolist():
            t, k, p, size = int(tix[i]), int(kvo[i]), int(plo[i]), int(szs[i])
            m = min(window, size)
            for off in (0, size - m):
                dev = self.g.flat[t][k + off:k + off + m].cpu().view(torch.uint8)
                if not torch.equal(dev, self._pool_t[p + off:p + off + m].view(torch.uint8)):
                    bad += 1
                    break
        return bad

    def copy_ms(self, handle: Any) -> float | None:
        """GPU time of a finished :meth:`load_direct` copy (ms), when it was issued with
        ``time_direct`` on; else None (also on the CPU platform)."""
        if handle is None or getattr(handle, "start", None) is None:
            return None
        return float(handle.start.elapsed_time(handle.event))  # pragma: no cover - CUDA

    def sync_all(self) -> None:
        """Block until every device copy issued so far is done (any thread; the stall
        watchdog, before it reports the jobs of a stuck reactor as failed)."""
        if self.cuda:  # pragma: no cover - needs CUDA
            torch.cuda.synchronize(self.g.device)

    def fence(self, handle: Any) -> None:
        """Order the calling thread's current CUDA stream (vLLM's compute stream, when the
        model-runner thread calls it) after the copies of ``handle``, without waiting on
        the CPU. A None handle (nothing issued, or a CPU copy that is already done) needs
        nothing."""
        if handle is not None:  # pragma: no cover - needs CUDA
            torch.cuda.current_stream(self.g.device).wait_event(handle.event)

    def sync(self, handle: Any) -> None:
        """Block until a copy handle is done (any thread)."""
        if handle is not None:
            handle.event.synchronize()

    def wait_store(self, handle: Any) -> None:
        """The reactor's store-copy waiter thread: ``cudaEventSynchronize`` with the GIL
        released (torch releases it); store events are made with blocking sync when the
        reactor asked for it (``blocking_store_events``), so the thread sleeps rather than
        spins."""
        if handle is not None and self._cx is not None:  # pragma: no cover - needs CUDA
            self._cx.bind()
        self.sync(handle)

    def from_device_batch(self, slots: list[int], srcs: list[Any], nbytes: list[int]) -> Any:
        """All chunks of one store job in ONE copy call (one descriptor build, one
        ``swap_blocks_batch``) on one store stream that waits on the job's producer
        event(s); the reactor writes the slot headers once it is done."""
        refs: list[ChunkRef] = srcs
        sb = self.slot_bytes
        ops = self.g.batch_ops(refs, [s * sb + HEADER_BYTES for s in slots])
        after = refs[0].after
        if any(r.after is not after for r in refs):  # pragma: no cover - one event per job
            after = list({id(r.after): r.after for r in refs if r.after is not None}.values())
        kernel = use_gather_kernel(self.store_copy, ops[3])
        if kernel:
            self.store_kernel_jobs += 1
        return self._run(ops, to_device=False, after=after, slot=slots[0], kernel=kernel)

    def store_done(self, handle: Any) -> bool:
        return self.done(handle)

    def done(self, handle: Any) -> bool:
        if handle is None:
            return True
        if not handle.event.query():
            return False
        handle.keep = None
        return True

    # ------------------------------------------------------------------ internals
    def _slot_valid(self, slot: int, key: bytes, need: int) -> bool:
        try:
            n = self.layout.check_identity(self.pool.views[slot], key)
        except CorruptBlock as e:
            self.header_failures += 1
            log.warning("py-kvcache: DRAM slot %d does not hold a valid block for its key "
                        "(%s); the chunk is recomputed", slot - self.n_staging, e)
            return False
        if n != need:
            self.header_failures += 1
            return False
        return True

    def _run(self, ops: tuple[np.ndarray, ...], *, to_device: bool, after: Any,
             slot: int, direct: bool = False, kernel: bool = False) -> Any:
        if self._cx is not None:
            return self._cx.run(ops, to_device=to_device, after=after, slot=slot,
                                direct=direct, kernel=kernel,
                                blocking=self.blocking_store_events and not to_device,
                                timed=direct and self.time_direct)
        tix, kvo, plo, szs = (a.tolist() for a in ops)
        kv, pool = self._cpu
        if to_device:
            for t, k, p, n in zip(tix, kvo, plo, szs, strict=True):
                kv[t][k:k + n] = pool[p:p + n]
        else:
            for t, k, p, n in zip(tix, kvo, plo, szs, strict=True):
                pool[p:p + n] = kv[t][k:k + n]
        return None


class _CudaExec:
    """CUDA execution of copy descriptors (cannot run on the CPU-only CI machine).

    Loads: one ``swap_blocks_batch`` (cuMemcpyBatchAsync) per batch on a dedicated load
    stream. Stores: one call per store job (all its chunks) on a store stream chosen by
    its first slot, which first waits on the event recorded on the compute stream when
    vLLM submitted the store (no device-wide sync). Without vLLM's op: per-descriptor
    ``copy_(non_blocking=True)`` on those streams.
    """

    def __init__(self, geometry: KVGeometry, pool_t: torch.Tensor) -> None:
        self.g = geometry
        self.dev = geometry.device
        self.pool_t = pool_t
        self.pool_base = pool_t.data_ptr()
        self.kv_base = np.array([f.data_ptr() for f in geometry.flat], dtype=np.int64)
        self.load_stream = torch.cuda.Stream(self.dev)
        #: DRAM-hit jobs issued by the worker thread (KVCopier.load_direct)
        self.direct_stream = torch.cuda.Stream(self.dev)
        # Store copies of different slots run on different streams (each waits only on
        # its own producer event); a small fixed set, not one per slot: the DRAM tier can
        # have hundreds of slots.
        self.store_streams = [torch.cuda.Stream(self.dev) for _ in range(N_STORE_STREAMS)]
        self._tls = threading.local()
        self.swap: Callable[..., None] | None = None
        try:
            from vllm import _custom_ops as vops

            if hasattr(torch.ops._C_cache_ops, "swap_blocks_batch"):
                self.swap = vops.swap_blocks_batch
        except Exception:  # pragma: no cover - depends on the vLLM build
            self.swap = None
        if self.swap is None:  # pragma: no cover
            log.warning("py-kvcache: vllm._custom_ops.swap_blocks_batch unavailable; using "
                        "per-block copies")
        #: vLLM's Triton gather kernel (``dram_load_copy`` kernel/auto), once loaded
        self._kfn: Any = None
        #: its grid: programs (thread blocks) that copy; env KVCACHE_KERNEL_PROGRAMS
        #: overrides it for the bandwidth A/B (scripts/bench_h2d.py)
        self.kernel_programs = kernel_programs(os.environ.get("KVCACHE_KERNEL_PROGRAMS"))

    def load_kernel(self) -> None:  # pragma: no cover - needs CUDA
        """Import vLLM's gather kernel and compile it with one 8 KiB copy from the pool
        into a scratch tensor (raises where Triton or the kernel is missing)."""
        if self._kfn is not None:
            return
        from vllm.v1.kv_offload.cpu.swap_blocks_triton import _swap_blocks_kernel

        self.bind()
        # 0xff, so that a kernel that copied nothing cannot pass the check below
        scratch = torch.full((KERNEL_CHUNK_BYTES,), 255, dtype=torch.uint8, device=self.dev)
        # launched as every hit is (launch_gather), so that Triton compiles here the one
        # specialization the hits will use
        with torch.cuda.device(self.dev), torch.cuda.stream(self.direct_stream):
            launch_gather(_swap_blocks_kernel, self.dev,
                          np.array([self.pool_base], dtype=np.int64),
                          np.array([scratch.data_ptr()], dtype=np.int64),
                          np.array([KERNEL_CHUNK_BYTES], dtype=np.int64), self.kernel_programs)
        self.direct_stream.synchronize()
        if not torch.equal(scratch.cpu(), self.pool_t[:KERNEL_CHUNK_BYTES]):
            raise RuntimeError("the gather kernel's test copy does not match its source")
        self._kfn = _swap_blocks_kernel

    def bind(self) -> None:  # pragma: no cover - needs CUDA
        """Make the KV device's primary context current on the calling thread, once per
        thread. The reactor thread's first CUDA call may be vLLM's driver-API batch copy
        (cuMemcpyBatchAsync), which needs it; the store-copy waiter thread binds too, so
        that its event waits never touch another device's context."""
        if not getattr(self._tls, "bound", False):
            torch.cuda.set_device(self.dev)
            torch.cuda.current_stream(self.dev).query()
            self._tls.bound = True

    def run(self, ops: tuple[np.ndarray, ...], *, to_device: bool, after: Any,
            slot: int, direct: bool = False, blocking: bool = False,
            timed: bool = False, kernel: bool = False) -> _CudaHandle:  # pragma: no cover
        tix, kvo, plo, szs = ops
        self.bind()
        stream = (self.direct_stream if direct else self.load_stream if to_device
                  else self.store_streams[slot % len(self.store_streams)])
        keep: Any = None
        start: Any = None
        with torch.cuda.device(self.dev), torch.cuda.stream(stream):
            if isinstance(after, list):
                for ev in after:
                    stream.wait_event(ev)
            elif after is not None:
                stream.wait_event(after)
            if timed:  # diagnostics: the copy's GPU time (KVCopier.copy_ms)
                start = torch.cuda.Event(enable_timing=True)
                start.record(stream)
            if kernel and self._kfn is not None:
                # one launch: the GPU's threads read (load) or write (store) the pinned
                # pool directly, whatever the descriptor count
                pool_ptr, kv_ptr = self.pool_base + plo, self.kv_base[tix] + kvo
                src, dst = (pool_ptr, kv_ptr) if to_device else (kv_ptr, pool_ptr)
                keep = launch_gather(self._kfn, self.dev, src, dst, szs,
                                     self.kernel_programs)
            elif self.swap is not None:
                kv_ptr = torch.from_numpy(self.kv_base[tix] + kvo)
                pool_ptr = torch.from_numpy(self.pool_base + plo)
                sizes = torch.from_numpy(np.ascontiguousarray(szs))
                src, dst = (pool_ptr, kv_ptr) if to_device else (kv_ptr, pool_ptr)
                self.swap(src, dst, sizes, is_src_access_order_any=to_device)
                keep = (src, dst, sizes)
            else:
                kv, pool = self.g.flat, self.pool_t
                for t, k, p, n in zip(tix.tolist(), kvo.tolist(), plo.tolist(),
                                      szs.tolist(), strict=True):
                    if to_device:
                        kv[t][k:k + n].copy_(pool[p:p + n], non_blocking=True)
                    else:
                        pool[p:p + n].copy_(kv[t][k:k + n], non_blocking=True)
            # blocking: a thread that synchronizes on it sleeps instead of spinning (the
            # reactor's store-copy waiter, store_copy_wait="block")
            ev = (torch.cuda.Event(enable_timing=True) if timed
                  else torch.cuda.Event(blocking=blocking))
            ev.record(stream)
        return _CudaHandle(ev, keep, start)
