#!/usr/bin/env python3
"""Host<->device copy bandwidth of the host memory kinds a KV offload can use (GPU machine).

Issue 9 asks why DRAM-tier hits trail vLLM's native CPU offload by 15-20 % at 16k-64k
tokens. A DRAM hit is one ``swap_blocks_batch`` from host memory into the KV cache, so
this measures exactly that call, side by side, for:

* ``pool``: py-kvcache's :class:`kvcache_core.staging.StagingPool` (anonymous private
  mmap, MAP_POPULATE, ``cudaHostRegister``: what the DRAM tier is);
* ``pool_thp``: the same with ``MADV_HUGEPAGE`` before the pages are populated;
* ``shm``: vLLM 0.26's native CPU tier (``SharedOffloadRegion``: MAP_SHARED file in
  /dev/shm, ``MADV_POPULATE_WRITE``, ``cudaHostRegister``);
* ``torch``: ``torch.empty(pin_memory=True)`` (cudaHostAlloc).

Per kind and descriptor size (py-kvcache's chunk of ``--chunk-bytes`` = one descriptor;
native's page of chunk / ``--pages-per-chunk``), ``--reps`` rounds interleaved: the time
the call holds the calling thread (``call_ms``: a copy the driver cannot run
asynchronously blocks here) and the time to completion (GB/s), H2D and D2H. Medians.

With ``--writeback-dir DIR`` the H2D chunk copies of ``pool`` and ``shm`` are measured a
second time (condition ``writeback``) while a thread writes slots of the same host memory
to files in DIR with O_DIRECT, back to back: the DRAM tier's background write-back during
a DRAM hit (the eighteenth session saw slow hits only while write-back was running).

``--descs`` adds the descriptor sizes of a real DRAM hit: ``layer`` (chunk / layers: one
coalesced run of one KV tensor, py-kvcache's copy when vLLM gave the request consecutive
GPU blocks) and ``block`` (one GPU block of one layer, 64 KiB on the 3B: the copy when the
blocks are not consecutive, and always vLLM's native one). ``--kernel-programs`` adds the
same H2D copies done by vLLM's Triton gather kernel (``dram_load_copy=kernel``) at those
grid sizes, both directions (D2H: GPU threads write the pinned host memory, what a store
would do); its first copy of each kind is checked byte for byte at 16 random places.

Usage (GPU machine, after ``source /tmp/rt/env.sh``):
    python scripts/bench_h2d.py --gib 7 --writeback-dir /tmp/h2dwb --json $RES/h2d.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics as st
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvcache_core.staging import StagingPool  # noqa: E402
from kvcache_core.vllm.transfer import launch_gather  # noqa: E402


def _register(t: torch.Tensor) -> None:
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister failed ({rc})")


def _pinned_view(mm: mmap.mmap) -> torch.Tensor:
    """A mapping populated (MADV_POPULATE_WRITE, as vLLM's native region does) and
    registered with CUDA, as a uint8 tensor over it."""
    t = torch.frombuffer(mm, dtype=torch.uint8)
    try:
        mm.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23))
    except OSError:  # kernel < 5.14
        t.fill_(0)
    _register(t)
    return t


def host_buffers(nbytes: int, slot_bytes: int,
                 kinds: list[str]) -> dict[str, tuple[torch.Tensor, object]]:
    """name -> (uint8 tensor of nbytes, keep-alive object), for each of ``kinds``."""
    out: dict[str, tuple[torch.Tensor, object]] = {}
    n_slots = nbytes // slot_bytes
    t0 = time.perf_counter()
    if "pool" in kinds:
        pool = StagingPool(n_slots, slot_bytes, pin=True)
        out["pool"] = (pool.as_tensor(), pool)
        print(f"pool: {time.perf_counter() - t0:.1f} s", flush=True)
    if "pool_thp" in kinds:
        _thp(out, nbytes)
    if "shm" in kinds:
        _shm(out, nbytes)
    if "torch" in kinds:
        t0 = time.perf_counter()
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        out["torch"] = (t, None)
        print(f"torch: {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def _thp(out: dict[str, tuple[torch.Tensor, object]], nbytes: int) -> None:
    t0 = time.perf_counter()
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(getattr(mmap, "MADV_HUGEPAGE", 14))
    out["pool_thp"] = (_pinned_view(mm), mm)
    print(f"pool_thp: {time.perf_counter() - t0:.1f} s", flush=True)


def _shm(out: dict[str, tuple[torch.Tensor, object]], nbytes: int) -> None:
    t0 = time.perf_counter()
    path = f"/dev/shm/bench_h2d_{os.getpid()}.mmap"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, nbytes)
    sm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED,
                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    os.unlink(path)
    out["shm"] = (_pinned_view(sm), sm)
    print(f"shm: {time.perf_counter() - t0:.1f} s", flush=True)


class Writer:
    """Writes slots of ``host`` (uint8 tensor over page-aligned memory) to 4 files in
    ``d`` with O_DIRECT, back to back, on its own thread (os.pwrite releases the GIL),
    until :meth:`stop`. ``written`` counts bytes."""

    def __init__(self, host: torch.Tensor, slot: int, n_slots: int, d: str) -> None:
        os.makedirs(d, exist_ok=True)
        self.fds = [_open_direct(os.path.join(d, f"wb{i}")) for i in range(4)]
        self.mv = memoryview(host.numpy())
        self.slot, self.n = slot, n_slots
        self.written = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            off = (i % self.n) * self.slot
            self.written += os.pwrite(self.fds[i % 4], self.mv[off:off + self.slot], 0)
            i += 1

    def stop(self) -> None:
        self._stop.set()
        self._t.join()
        for fd in self.fds:
            os.close(fd)


def _open_direct(path: str) -> int:
    """O_DIRECT where the filesystem takes it (the DRAM tier's files are), else buffered."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        return os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:
        return os.open(path, flags, 0o600)


def thp_share() -> str:
    try:
        with open("/proc/meminfo") as f:
            return " ".join(ln.strip() for ln in f if ln.startswith("AnonHugePages"))
    except OSError:
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=7.0, help="bytes moved per copy (GiB)")
    ap.add_argument("--chunk-bytes", type=int, default=29360128,
                    help="py-kvcache chunk payload (3B: 256 tokens = 28 MiB)")
    ap.add_argument("--pages-per-chunk", type=int, default=16,
                    help="GPU blocks per chunk (native copies one descriptor per block)")
    ap.add_argument("--layers", type=int, default=28,
                    help="KV tensors (layers) per chunk: descriptor 'layer' is chunk/layers "
                    "(a coalesced run of one layer), 'block' chunk/(layers*pages) (one GPU "
                    "block of one layer: what a request with non-consecutive blocks needs)")
    ap.add_argument("--descs", default="chunk,page",
                    help="descriptor granularities, of chunk, page, layer, block")
    ap.add_argument("--hosts", default="pool,pool_thp,shm,torch",
                    help="host memory kinds, of pool, pool_thp, shm, torch")
    ap.add_argument("--kernel-programs", default="",
                    help="comma list: also copy H2D with vLLM's Triton gather kernel "
                    "(py-kvcache's dram_load_copy=kernel) at these grid sizes")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--writeback-dir", help="also measure H2D while slots of the same host "
                    "memory are written to files here with O_DIRECT (condition 'writeback')")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    from vllm import _custom_ops as ops

    kfn = None
    programs = [int(x) for x in a.kernel_programs.split(",") if x]
    if programs:
        from vllm.v1.kv_offload.cpu.swap_blocks_triton import _swap_blocks_kernel as kfn
    dev = torch.device("cuda", 0)
    chunk = a.chunk_bytes
    n_chunks = int(a.gib * (1 << 30)) // chunk
    nbytes = n_chunks * chunk
    slot = chunk + 4096  # header + payload, like a py-kvcache slot
    hosts = host_buffers(n_chunks * slot, slot, a.hosts.split(","))
    print(thp_share(), flush=True)
    piece = 1 << 28
    for host, _keep in hosts.values():  # a pattern, so that the byte checks mean something
        for off in range(0, host.numel() - piece + 1, piece):
            host[off:off + piece].view(torch.int64).copy_(
                torch.arange(off // 8, (off + piece) // 8, dtype=torch.int64))
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    gbase = gpu.data_ptr()
    # GPU destinations in a shuffled chunk order (a real KV cache's blocks are not in order)
    rng = np.random.default_rng(0)
    gorder = rng.permutation(n_chunks).astype(np.int64)
    stream = torch.cuda.Stream(dev)
    results: dict[str, dict[str, list[float]]] = {}
    per_of = {"chunk": 1, "page": a.pages_per_chunk, "layer": a.layers,
              "block": a.layers * a.pages_per_chunk}
    descs = {d: per_of[d] for d in a.descs.split(",")}
    engines = ["dma"] + [f"kernel{p}" for p in programs]
    conds = ["idle"] + (["writeback"] if a.writeback_dir else [])
    wb_rates: list[float] = []
    for rep in range(a.reps):
        for cond in conds:
            for name, (host, _keep) in hosts.items():
                if cond == "writeback" and name not in ("pool", "shm"):
                    continue
                writer = (Writer(host, slot, n_chunks, a.writeback_dir)
                          if cond == "writeback" else None)
                tw = time.perf_counter()
                if writer is not None:
                    time.sleep(0.05)  # the writes are under way before the copy starts
                hbase = host.data_ptr()
                for dname, per in descs.items():
                    size = chunk // per
                    h = (hbase + 4096 + np.arange(n_chunks, dtype=np.int64)[:, None] * slot
                         + np.arange(per, dtype=np.int64)[None, :] * size).ravel()
                    g = (gbase + gorder[:, None] * chunk
                         + np.arange(per, dtype=np.int64)[None, :] * size).ravel()
                    szs = np.full(n_chunks * per, size, dtype=np.int64)
                    sizes = torch.from_numpy(szs)
                    for engine in engines:
                        for direction in ("h2d", "d2h"):
                            if direction == "d2h" and cond == "writeback":
                                continue
                            src, dst = (h, g) if direction == "h2d" else (g, h)
                            s_t, d_t = torch.from_numpy(src.copy()), torch.from_numpy(dst.copy())
                            check = engine != "dma" and rep == 0 and cond == "idle"
                            if check:  # clear the destination, so the check means it
                                (gpu if direction == "h2d" else host).zero_()
                            torch.cuda.synchronize(dev)
                            with torch.cuda.stream(stream):
                                e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
                                e0.record(stream)
                                t0 = time.perf_counter()
                                if engine == "dma":
                                    ops.swap_blocks_batch(
                                        s_t, d_t, sizes,
                                        is_src_access_order_any=direction == "h2d")
                                else:  # the kernel takes any pointers: d2h writes the
                                    # pinned host memory from GPU threads
                                    launch_gather(kfn, dev, src, dst, szs, int(engine[6:]))
                                t1 = time.perf_counter()
                                e1.record(stream)
                            e1.synchronize()
                            t2 = time.perf_counter()
                            if check:  # the bytes landed where they belong
                                torch.cuda.synchronize(dev)
                                ok = all(
                                    torch.equal(gpu[int(gorder[c]) * chunk + o:][:64].cpu(),
                                                host[4096 + c * slot + o:][:64])
                                    for c, o in zip(rng.integers(0, n_chunks, 16).tolist(),
                                                    rng.integers(0, chunk - 64, 16).tolist(),
                                                    strict=True))
                                if not ok:
                                    raise SystemExit(f"{engine}: copied bytes do not match")
                            key = f"{name}/{dname}/{direction}/{cond}/{engine}"
                            r = results.setdefault(key, {"call_ms": [], "gbps": [],
                                                         "wall_gbps": []})
                            r["call_ms"].append((t1 - t0) * 1e3)
                            r["gbps"].append(nbytes / (e0.elapsed_time(e1) / 1e3) / 1e9)
                            r["wall_gbps"].append(nbytes / (t2 - t0) / 1e9)
                if writer is not None:
                    writer.stop()
                    wb_rates.append(writer.written / (time.perf_counter() - tw) / 1e9)
        print(f"round {rep + 1}/{a.reps} done", flush=True)
    rows = []
    for key, r in results.items():
        name, dname, direction, cond, engine = key.split("/")
        rows.append({"host": name, "descriptor": dname, "direction": direction,
                     "condition": cond, "engine": engine,
                     "descriptors": n_chunks * descs[dname],
                     "descriptor_bytes": chunk // descs[dname],
                     "call_ms": st.median(r["call_ms"]), "gbps": st.median(r["gbps"]),
                     "wall_gbps": st.median(r["wall_gbps"]), "rounds": r})
    doc = {"machine": torch.cuda.get_device_name(dev), "bytes": nbytes, "reps": a.reps,
           "anon_huge_pages": thp_share(), "rows": rows,
           "writeback_gbps": st.median(wb_rates) if wb_rates else None}
    with open(a.json, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{'host':9} {'desc':6} {'dir':4} {'condition':9} {'engine':9} {'n':>7} "
          f"{'call ms':>8} {'GB/s':>6} {'wall':>6}")
    for r in rows:
        print(f"{r['host']:9} {r['descriptor']:6} {r['direction']:4} {r['condition']:9} "
              f"{r['engine']:9} {r['descriptors']:7d} {r['call_ms']:8.1f} {r['gbps']:6.1f} "
              f"{r['wall_gbps']:6.1f}")
    if wb_rates:
        print(f"write-back meanwhile: {st.median(wb_rates):.2f} GB/s (median)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
