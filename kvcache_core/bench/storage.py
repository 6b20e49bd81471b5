"""`kvcache bench storage`: I/O engine x request size x depth, and metadata rates.

Every mode does the same per-block work a file-per-block cache must do (open, one full
read or write, close), on separate files, at the same depth, in the same run:

* ``raw``     - ``depth`` plain threads: os.open / os.preadv|pwritev / os.close (O_DIRECT
                where the root accepts it). The baseline the engine must match.
* ``uring``   - the io_uring engine driven directly (async open, readv/writev, close).
* ``posix``   - the POSIX fallback engine driven the same way.
* ``reactor`` - the full reactor: loads (open, read, header + xxh3 verification, copy
                batch with no device) and stores (header + xxh3, temp file, write, close,
                atomic publish), through the bounded staging pool.

Throughput is payload bytes per second (the reactor also moves its 4 KiB header).
Each point is the median of ``repeats`` runs. Metadata: ``Layout.exists`` lookups and
``Layout.write_block`` publishes with 10k/100k/1M files in the root.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

from ..io import make_engine, probe_direct, uring_available
from ..layout import HEADER_BYTES, Layout, Namespace
from ..reactor import Reactor
from ..staging import StagingPool

KiB, MiB = 1 << 10, 1 << 20


def _progress(msg: str) -> None:
    print(f"[bench storage] {msg}", file=sys.stderr, flush=True)


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except Exception:
        pass
    return {"hostname": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
            "mem_gib": round(mem / 2**30, 1), "kernel": platform.release(), "gpu": gpu}


def _fs_of(path: str) -> str:
    best, fstype = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1]
                if path.startswith(mnt) and len(mnt) > len(best):
                    best, fstype = mnt, parts[2]
    except OSError:
        pass
    return fstype


# ------------------------------------------------------------------------ raw baseline
def _raw(paths: list[str], size: int, depth: int, write: bool, direct: bool,
         bufs: list[memoryview]) -> float:
    """``depth`` threads, each open/preadv|pwritev/close its share of files. Returns s."""
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
    if direct:
        flags |= os.O_DIRECT
    idx = iter(range(len(paths)))
    lock = threading.Lock()
    err: list[BaseException] = []
    stop = threading.Event()  # set when the main thread is interrupted

    def work(buf: memoryview) -> None:
        try:
            while not stop.is_set():
                with lock:
                    i = next(idx, None)
                if i is None:
                    return
                fd = os.open(paths[i], flags, 0o644)
                try:
                    n = os.pwritev(fd, [buf], 0) if write else os.preadv(fd, [buf], 0)
                finally:
                    os.close(fd)
                if n != size:
                    raise OSError(f"short {'write' if write else 'read'} {n} != {size}")
        except BaseException as e:  # pragma: no cover - reported below
            err.append(e)

    threads = [threading.Thread(target=work, args=(bufs[i],)) for i in range(depth)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except BaseException:  # Ctrl-C: stop the workers before the scratch dir is removed
        stop.set()
        for t in threads:
            t.join()
        raise
    dt = time.perf_counter() - t0
    if err:
        raise err[0]
    return dt


# ------------------------------------------------------------------------ engine driven
def _engine_run(kind: str, paths: list[str], size: int, depth: int, write: bool, direct: bool,
                bufs: list[memoryview]) -> float:
    """Drive an engine directly: open -> read/write -> close per file, ``depth`` in flight."""
    eng = make_engine(kind, depth=depth, entries=4 * depth + 8, force_async=not direct)
    try:
        iovs = [eng.make_iov(b) for b in bufs]
        flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
        if direct:
            flags |= os.O_DIRECT
        nxt = 0
        inflight = 0
        free = list(range(depth))
        slot_of: dict[int, int] = {}
        fd_of: dict[int, int] = {}
        out: list[tuple[int, int]] = []
        done = 0
        t0 = time.perf_counter()
        while done < len(paths):
            while free and nxt < len(paths):
                s = free.pop()
                slot_of[nxt] = s
                eng.open(nxt << 2, paths[nxt], flags)
                nxt += 1
                inflight += 1
            eng.submit()
            if not eng.reap(out):
                eng.wait(0.05)
                eng.reap(out)
            for tag, res in out:
                i, op = tag >> 2, tag & 3
                if res < 0:
                    raise OSError(-res, f"{kind} op {op} on {paths[i]}")
                if op == 0:
                    fd_of[i] = res
                    if write:
                        eng.write((i << 2) | 1, res, iovs[slot_of[i]], 0)
                    else:
                        eng.read((i << 2) | 1, res, iovs[slot_of[i]], 0)
                elif op == 1:
                    if res != size:
                        raise OSError(f"short I/O {res} != {size}")
                    eng.close((i << 2) | 2, fd_of.pop(i))
                else:
                    free.append(slot_of.pop(i))
                    inflight -= 1
                    done += 1
            out.clear()
            eng.submit()
        return time.perf_counter() - t0
    finally:
        eng.shutdown()


# ------------------------------------------------------------------------ reactor
def _reactor_run(layout: Layout, keys: list[bytes], size: int, depth: int, write: bool,
                 engine: str) -> tuple[float, dict[str, Any]]:
    r = Reactor(layout, n_slots=depth + max(2, depth // 2), io_depth=depth, lookahead=depth,
                engine=engine, pin=False)
    try:
        items = [(k, None, size) for k in keys]
        t0 = time.perf_counter()
        if write:
            r.store("bench", items)
        else:
            r.load("bench", items)
        r.wait()
        dt = time.perf_counter() - t0
        (c,) = r.poll()
        if not c.success:
            raise RuntimeError(f"reactor {'store' if write else 'load'} failed: "
                               f"{sum(not x for x in c.ok)} items, {r.snapshot()}")
        return dt, r.snapshot()
    finally:
        r.close()


def _count_for(size: int, budget: int, max_ops: int) -> int:
    return max(8, min(max_ops, budget // size))


def bench_throughput(root: str, sizes: list[int], depths: list[int], budget: int,
                     max_ops: int, repeats: int, modes: list[str]) -> tuple[list[dict], dict]:
    direct = probe_direct(root, "auto")
    rows: list[dict] = []
    peak = {"pool_bytes": 0, "peak_staging_bytes": 0, "bounded": True}
    total = len(sizes) * len(depths)
    step = 0
    for size in sizes:
        n = _count_for(size, budget, max_ops)
        plain = os.path.join(root, f"plain-{size}")
        os.makedirs(plain, exist_ok=True)
        paths = [os.path.join(plain, f"f{i:06d}") for i in range(n)]
        ns = Namespace("bench", "u8", 1, size)
        lroot = os.path.join(root, f"layout-{size}")
        for depth in depths:
            step += 1
            _progress(f"[{step}/{total}] size={_fmt(size)} depth={depth} files={n}")
            bufs_pool = StagingPool(depth, max(4096, _round4k(size)), pin=False)
            bufs = [v[:size] for v in bufs_pool.views]
            for i in range(depth):
                bufs[i][:] = os.urandom(size) if size <= 4 * MiB else bytes(size)
            res: dict[str, dict[str, list[float]]] = {m: {"read": [], "write": []}
                                                      for m in modes}
            for _rep in range(repeats):
                for mode in modes:
                    for write in (True, False):
                        if mode == "reactor":
                            if write:
                                shutil.rmtree(lroot, ignore_errors=True)
                            lay = Layout(lroot, ns)
                            keys = [f"k{size}-{i}".encode() for i in range(n)]
                            dt, snap = _reactor_run(lay, keys, size, depth, write, "auto")
                            lay.close()
                            peak["pool_bytes"] = max(peak["pool_bytes"], snap["pool_bytes"])
                            peak["peak_staging_bytes"] = max(peak["peak_staging_bytes"],
                                                             snap["peak_staging_bytes"])
                            if snap["peak_staging_bytes"] > snap["pool_bytes"]:
                                peak["bounded"] = False
                            peak["engine"] = snap["engine"]
                        elif mode == "raw":
                            dt = _raw(paths, size, depth, write, direct, bufs)
                        else:
                            dt = _engine_run("io_uring" if mode == "uring" else "posix",
                                             paths, size, depth, write, direct, bufs)
                        res[mode]["write" if write else "read"].append(n * size / dt / 1e9)
            bufs = []
            bufs_pool.close()
            for mode in modes:
                for op in ("read", "write"):
                    vals = res[mode][op]
                    rows.append({"mode": mode, "op": op, "size": size, "depth": depth,
                                 "files": n, "gbps": statistics.median(vals),
                                 "runs_gbps": [round(v, 4) for v in vals]})
        shutil.rmtree(plain, ignore_errors=True)
        shutil.rmtree(lroot, ignore_errors=True)
    return rows, peak


def _round4k(n: int) -> int:
    return (n + 4095) // 4096 * 4096


def _fmt(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


def bench_metadata(root: str, levels: list[int], probes: int) -> list[dict]:
    """Publish files up to each level (rate measured), then time ``exists`` lookups."""
    mroot = os.path.join(root, "meta")
    shutil.rmtree(mroot, ignore_errors=True)
    lay = Layout(mroot, Namespace("bench-meta", "u8", 1, 1))
    rows = []
    have = 0
    rng = random.Random(1)
    payload = b"x"
    for level in levels:
        t0 = time.perf_counter()
        last = t0
        for i in range(have, level):
            lay.write_block(i.to_bytes(8, "little"), payload)
            if time.perf_counter() - last > 5:
                last = time.perf_counter()
                _progress(f"metadata: published {i + 1}/{level} files")
        pub_dt = time.perf_counter() - t0
        published = level - have
        have = level
        hit_keys = [rng.randrange(level).to_bytes(8, "little") for _ in range(probes)]
        miss_keys = [(level + rng.randrange(10 * level)).to_bytes(8, "little")
                     for _ in range(probes)]
        exists = lay.exists
        t0 = time.perf_counter()
        hits = sum(1 for k in hit_keys if exists(k))
        t_hit = time.perf_counter() - t0
        t0 = time.perf_counter()
        false_hits = sum(1 for k in miss_keys if exists(k))
        t_miss = time.perf_counter() - t0
        if hits != probes or false_hits:
            raise RuntimeError(f"lookup wrong: {hits}/{probes} hits, {false_hits} false hits")
        rows.append({"files_in_root": level, "published": published,
                     "publish_per_s": published / pub_dt,
                     "lookup_hit_per_s": probes / t_hit, "lookup_miss_per_s": probes / t_miss,
                     "lookup_per_s": 2 * probes / (t_hit + t_miss)})
        _progress(f"metadata: {level} files: publish {rows[-1]['publish_per_s']:.0f}/s, "
                  f"lookup {rows[-1]['lookup_per_s']:.0f}/s")
    lay.close()
    shutil.rmtree(mroot, ignore_errors=True)
    return rows


def run(args) -> dict[str, Any]:
    """Measure under ``args.root`` in a private scratch directory that is removed at the
    end, also on an error or when interrupted. A missing root is refused unless
    ``args.create`` (then it is created, its parent must exist: a typo in a path is an
    error, not a new directory tree, and removed again at the end); a root that is a file
    or not writable is an ``OSError`` that the CLI prints as one line."""
    user_root = os.path.abspath(args.root)
    parent = os.path.dirname(user_root)
    made = not os.path.exists(user_root)
    if made and not getattr(args, "create", False):
        raise FileNotFoundError(2, "root does not exist (--create creates it and removes "
                                "it afterwards)", user_root)
    if not os.path.isdir(parent):
        raise FileNotFoundError(2, "parent directory does not exist", parent)
    if made:
        os.mkdir(user_root)
    try:
        root = tempfile.mkdtemp(prefix=".kvcache-bench-", dir=user_root)
    except BaseException:
        if made:
            os.rmdir(user_root)
        raise
    args._user_root = user_root  # what the report names (the scratch dir goes away)
    try:
        return _run_in(args, root)
    finally:
        for _ in range(20):  # a thread still finishing its last op may add a file
            shutil.rmtree(root, ignore_errors=True)
            if not os.path.exists(root):
                break
            time.sleep(0.1)
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(user_root)


def _volume(sizes: list[int], depths: list[int], budget: int, max_ops: int, repeats: int,
            modes: list[str], levels: list[int]) -> tuple[int, int, int, int]:
    """(bytes written, bytes read, peak bytes on disk, files published) of a run."""
    written = read = peak = 0
    for size in sizes:
        n = _count_for(size, budget, max_ops)
        per_mode = {m: n * (HEADER_BYTES + _round4k(size) if m == "reactor" else size)
                    for m in modes}
        written += len(depths) * repeats * sum(per_mode.values())
        read += len(depths) * repeats * sum(per_mode.values())
        peak = max(peak, n * size + per_mode.get("reactor", 0))
    top = max(levels, default=0)
    meta_file = HEADER_BYTES + _round4k(1)  # bench_metadata's 1-byte blocks
    written += top * meta_file
    return written, read, max(peak, top * meta_file), top


def _probe_rates(root: str, direct: bool) -> tuple[float, float, float]:
    """(write B/s, read B/s, publishes/s) from a short probe in ``root`` (removed)."""
    d = os.path.join(root, "probe")
    os.makedirs(d, exist_ok=True)
    try:
        size, n, depth = 1 * MiB, 16, 4
        pool = StagingPool(depth, size, pin=False)
        try:
            bufs = [v[:size] for v in pool.views]
            paths = [os.path.join(d, f"p{i}") for i in range(n)]
            w = n * size / _raw(paths, size, depth, True, direct, bufs)
            r = n * size / _raw(paths, size, depth, False, direct, bufs)
            bufs = []
        finally:
            pool.close()
        lay = Layout(os.path.join(d, "meta"), Namespace("bench-probe", "u8", 1, 1))
        t0 = time.perf_counter()
        for i in range(300):
            lay.write_block(i.to_bytes(8, "little"), b"x")
        pub = 300 / (time.perf_counter() - t0)
        lay.close()
        return w, r, pub
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _announce(root: str, sizes, depths, budget, max_ops, repeats, modes, levels,
              probes: int) -> None:
    written, read, peak, files = _volume(sizes, depths, budget, max_ops, repeats, modes,
                                         levels)
    _progress(f"will write about {written / 1e9:.1f} GB and read {read / 1e9:.1f} GB "
              f"under {root} (at most {peak / 1e9:.1f} GB on disk at a time"
              + (f", {files} files in the metadata part" if files else "")
              + "); everything is removed at the end")
    w, r, pub = _probe_rates(root, probe_direct(root, "auto"))
    est = written / w + read / r + files / pub + 2 * probes * len(levels) / 1e5
    _progress(f"roughly {est / 60:.0f} min ({est:.0f} s) at the probed {w / 1e9:.2f} GB/s "
              f"write, {r / 1e9:.2f} GB/s read, {pub:.0f} publishes/s (1 MiB files, "
              "depth 4: a rough guide)")


def _run_in(args, root: str) -> dict[str, Any]:
    quick = args.quick
    sizes = [4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 28 * MiB]
    depths = [1, 8] if quick else [1, 4, 8, 16]
    head_depth = 8
    budget = (128 if quick else 1024) * MiB
    max_ops = 512 if quick else 1024
    repeats = 1 if quick else 3
    modes = ["raw", "uring", "posix", "reactor"]
    ok, why = uring_available()
    if not ok:  # e.g. seccomp, an old kernel, or a liburing that cannot run here
        modes.remove("uring")
        _progress(f"io_uring unavailable ({why}): skipping the io_uring engine; the "
                  "reactor runs on the POSIX fallback")
    levels = [] if args.no_metadata else ([10_000, 100_000] if quick
                                          else [10_000, 100_000, 1_000_000])
    _progress(f"root={root} fs={_fs_of(root)} direct_io={probe_direct(root, 'auto')} "
              f"quick={quick}")
    probes = 50_000 if quick else 100_000
    _announce(root, sizes, depths, budget, max_ops, repeats, modes, levels, probes)
    t_start = time.time()
    rows, peak = bench_throughput(root, sizes, depths, budget, max_ops, repeats, modes)

    def g(mode, op, size=28 * MiB, depth=head_depth):
        for r in rows:
            if (r["mode"], r["op"], r["size"], r["depth"]) == (mode, op, size, depth):
                return r["gbps"]
        return None

    meta = bench_metadata(root, levels, probes) if levels else []
    big = [m for m in meta if m["files_in_root"] >= 100_000]
    out: dict[str, Any] = {
        "benchmark": "storage",
        "machine": _machine(),
        "root": getattr(args, "_user_root", root),
        "filesystem": _fs_of(root),
        "direct_io": probe_direct(root, "auto"),
        "engine": peak.get("engine"),
        "quick": quick,
        "headline_size": 28 * MiB,
        "headline_depth": head_depth,
        "raw_read_gbps": g("raw", "read"),
        "raw_write_gbps": g("raw", "write"),
        "uring_read_gbps": g("uring", "read"),
        "uring_write_gbps": g("uring", "write"),
        "posix_read_gbps": g("posix", "read"),
        "posix_write_gbps": g("posix", "write"),
        "reactor_read_gbps": g("reactor", "read"),
        "reactor_write_gbps": g("reactor", "write"),
        "pool_bytes": peak["pool_bytes"],
        "peak_staging_bytes": peak["peak_staging_bytes"],
        "staging_bounded": peak["bounded"],
        "lookup_per_s": min(m["lookup_per_s"] for m in big) if big else None,
        "publish_per_s": min(m["publish_per_s"] for m in big) if big else None,
        "files_in_root": max((m["files_in_root"] for m in meta), default=0),
        "header_bytes": HEADER_BYTES,
        "throughput": rows,
        "metadata": meta,
        "wall_s": round(time.time() - t_start, 1),
    }
    if out["raw_read_gbps"]:
        out["reactor_vs_raw_read"] = out["reactor_read_gbps"] / out["raw_read_gbps"]
        out["reactor_vs_raw_write"] = out["reactor_write_gbps"] / out["raw_write_gbps"]
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        md = os.path.splitext(args.json)[0] + ".md"
        with open(md, "w") as f:
            f.write(to_markdown(out))
        try:
            plot(out, os.path.splitext(args.json)[0] + ".png")
        except ImportError:
            _progress("matplotlib missing: no plot")
        _progress(f"wrote {args.json}, {md}")
    return out


def to_markdown(d: dict[str, Any]) -> str:
    m = d["machine"]
    lines = [f"# Storage benchmark ({m['hostname']}: {m['cores']} cores, {m['cpu']}"
             f"{', ' + m['gpu'] if m.get('gpu') else ''})", "",
             f"Root `{d['root']}` ({d['filesystem']}, O_DIRECT={d['direct_io']}), engine "
             f"{d['engine']}, {'quick' if d['quick'] else 'full'} run, {d['wall_s']} s. "
             "Payload GB/s, median of runs; every mode opens, reads or writes one whole file "
             "and closes it per block.", "",
             f"## Headline: 28 MiB blocks, depth {d['headline_depth']}", "",
             "| mode | read GB/s | write GB/s | read vs raw | write vs raw |",
             "|---|---|---|---|---|"]
    for mode in ("raw", "uring", "posix", "reactor"):
        r, w = d.get(f"{mode}_read_gbps"), d.get(f"{mode}_write_gbps")
        if r is None:
            continue
        lines.append(f"| {mode} | {r:.3f} | {w:.3f} | {r / d['raw_read_gbps']:.2f} | "
                     f"{w / d['raw_write_gbps']:.2f} |")
    lines += ["", f"Staging: pool {d['pool_bytes']} B, peak in use {d['peak_staging_bytes']} B "
              f"(bounded: {d['staging_bounded']}).", "", "## All points (GB/s)", "",
              "| size | depth | op | raw | uring | posix | reactor |",
              "|---|---|---|---|---|---|---|"]
    pts: dict[tuple, dict[str, float]] = {}
    for r in d["throughput"]:
        pts.setdefault((r["size"], r["depth"], r["op"]), {})[r["mode"]] = r["gbps"]
    for (size, depth, op), v in sorted(pts.items()):
        cells = " | ".join(f"{v[m]:.3f}" if m in v else "-"
                           for m in ("raw", "uring", "posix", "reactor"))
        lines.append(f"| {_fmt(size)} | {depth} | {op} | {cells} |")
    if d["metadata"]:
        lines += ["", "## Metadata", "", "| files in root | publish/s | lookup/s (hit) | "
                  "lookup/s (miss) |", "|---|---|---|---|"]
        for m in d["metadata"]:
            lines.append(f"| {m['files_in_root']} | {m['publish_per_s']:.0f} | "
                         f"{m['lookup_hit_per_s']:.0f} | {m['lookup_miss_per_s']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(d: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    depth = d["headline_depth"]
    for ax, op in zip(axes, ("read", "write"), strict=False):
        for mode, style in (("raw", "k--"), ("uring", "b-o"), ("posix", "g-s"),
                            ("reactor", "r-^")):
            pts = sorted((r["size"], r["gbps"]) for r in d["throughput"]
                         if r["mode"] == mode and r["op"] == op and r["depth"] == depth)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xticks([4 * KiB, 64 * KiB, MiB, 4 * MiB, 28 * MiB],
                      ["4K", "64K", "1M", "4M", "28M"])
        ax.set_title(f"{op}, depth {depth}")
        ax.set_xlabel("request (file) size")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s (payload)")
    axes[0].legend()
    m = d["machine"]
    fig.suptitle(f"py-kvcache storage: {m['hostname']} ({d['filesystem']}, "
                 f"O_DIRECT={d['direct_io']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

