#!/usr/bin/env python3
"""What a small metadata write costs on a filesystem that is busy with KV-file writes.

Why: in the H200 ShareGPT runs (docs/results/h200/README.md, third session) the
configurations that write KV files had ~15 ms slower decode steps; vLLM's engine thread
then wrote py-kvcache's stats file (create + write + rename) after every step in a
directory on the same disk. This measures, side by side in one run on one filesystem:

* ``stats_write``: create + write ~300 B + ``os.replace`` of a small JSON file (what the
  stats export did on the engine thread), and
* ``lookup``: ``os.access`` of a missing file in a hashed shard directory (what a lookup
  does on the engine thread),

each with the filesystem idle and while another PROCESS writes 28 MiB files with O_DIRECT
and publishes them as the reactor does (temp file, link, unlink; the oldest files
unlinked). A separate process, so the GIL plays no part.

    python3 scripts/bench_fs_stall.py --dir /path/on/the/disk [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import time

SHARDS = 16


def _shard(d: str, i: int) -> str:
    return f"{d}/{i % SHARDS:x}0/{(i // SHARDS) % SHARDS:x}0"


def writer(d: str, file_mb: int, keep: int) -> None:
    """Write, publish and expire files forever (killed by the parent)."""
    buf = mmap.mmap(-1, file_mb << 20)  # page aligned, as O_DIRECT needs
    buf.write(os.urandom(1 << 20) * file_mb)
    i = 0
    while True:
        s = _shard(d, i)
        tmp, fin = f"{s}/.tmp{i}", f"{s}/f{i}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
        os.link(tmp, fin)
        os.unlink(tmp)
        if i >= keep:
            os.unlink(f"{_shard(d, i - keep)}/f{i - keep}")
        i += 1


def _stats_write(d: str, k: int) -> None:
    tmp, path = f"{d}/stats.json.tmp", f"{d}/stats.json"
    with open(tmp, "w") as f:
        json.dump({"step": k, "counters": list(range(40))}, f)
    os.replace(tmp, path)


def _lookup(d: str, k: int) -> None:
    os.access(f"{_shard(d, k * 7 + 3)}/missing{k}", os.F_OK)


def measure(d: str, op, n: int, gap_s: float) -> dict:
    lat = []
    for k in range(n):
        t = time.perf_counter()
        op(d, k)
        lat.append(time.perf_counter() - t)
        time.sleep(gap_s)
    lat.sort()
    return {"n": n, "median_ms": statistics.median(lat) * 1e3,
            "p99_ms": lat[int(len(lat) * 0.99)] * 1e3, "max_ms": lat[-1] * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="scratch directory on the disk to test "
                    "(created; removed afterwards)")
    ap.add_argument("--n", type=int, default=300, help="operations per measurement")
    ap.add_argument("--file-mb", type=int, default=28, help="size of the KV files written")
    ap.add_argument("--json", default=None, help="write the results here (+ .md)")
    a = ap.parse_args(argv)
    d = os.path.join(os.path.abspath(a.dir), f"fs-stall-{os.getpid()}")
    for i in range(SHARDS * SHARDS):
        os.makedirs(_shard(d, i), exist_ok=True)
    fs = "?"
    try:
        with open("/proc/mounts") as f:
            best = ""
            for line in f:
                parts = line.split()
                if d.startswith(parts[1]) and len(parts[1]) > len(best):
                    best, fs = parts[1], parts[2]
    except OSError:
        pass
    out: dict = {"machine": f"{platform.node()} ({os.cpu_count()} CPUs)", "dir": a.dir,
                 "filesystem": fs, "file_mb": a.file_mb, "results": {}}
    try:
        for name, op, gap in (("stats_write", _stats_write, 0.01), ("lookup", _lookup, 0.001)):
            print(f"[fs-stall] {name}: idle ...", file=sys.stderr, flush=True)
            idle = measure(d, op, a.n, gap)
            p = mp.Process(target=writer, args=(d, a.file_mb, 64), daemon=True)
            p.start()
            time.sleep(1.0)
            print(f"[fs-stall] {name}: while another process writes KV files ...",
                  file=sys.stderr, flush=True)
            busy = measure(d, op, a.n, gap)
            p.terminate()
            p.join()
            out["results"][name] = {"idle": idle, "busy": busy,
                                    "median_ratio": busy["median_ms"] / idle["median_ms"]}
    finally:
        shutil.rmtree(d, ignore_errors=True)
    lines = [f"# Metadata writes on a busy filesystem ({out['filesystem']}, {out['machine']})",
             "",
             f"`python3 scripts/bench_fs_stall.py --dir {a.dir}`; busy = another process "
             f"writes {a.file_mb} MiB files with O_DIRECT and publishes them (temp, link, "
             "unlink), as py-kvcache's write-back does. Milliseconds.", "",
             "| operation | idle median | idle p99 | busy median | busy p99 | busy max | "
             "median ratio |", "|---|---|---|---|---|---|---|"]
    for name, r in out["results"].items():
        i, b = r["idle"], r["busy"]
        lines.append(f"| {name} | {i['median_ms']:.3f} | {i['p99_ms']:.3f} | "
                     f"{b['median_ms']:.3f} | {b['p99_ms']:.3f} | {b['max_ms']:.2f} | "
                     f"{r['median_ratio']:.1f}x |")
    print("\n".join(lines))
    if a.json:
        from kvcache_core.bench.common import write_json_md

        write_json_md(a.json, out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
