#!/usr/bin/env python3
"""Stores into a full disk bound: what eviction costs the reactor, two trees side by side.

With ``max_disk_bytes`` set, every store of a steady-state cache evicts a file. Until the
thirteenth session eviction unlinked the file under the ledger lock on the thread that
reserved room (the reactor): ~8 ms per 28 MiB file on ext4, during which the reactor
served nothing and every publisher of the namespace waited for the lock. Now eviction
renames the file away (metadata only) and the evictor thread unlinks it later.

Each run is a fresh process of one tree (``--tree NAME=PATH``, e.g. the commit before and
after, from ``git worktree``): a Layout bounded to ``--bound-files`` files, pre-filled,
then ``--blocks`` stores of ``--block-mib`` MiB through the reactor (io_uring, O_DIRECT
where the root accepts it) while a Python thread beside it does fixed slices of work (a
stand-in for vLLM's engine thread). Reported per run: store throughput, the reactor's time
in its steps per store, and the busy thread's slowdown against its own idle pace measured
in the same process just before. Trees alternate over ``--rounds`` rounds; the table
gives medians.

Usage: python scripts/bench_evict_path.py --tree before=/tmp/oldtree --tree after=.
       [--root DIR] [--blocks 120] [--block-mib 28] [--bound-files 40] [--rounds 3]
       [--busy-process] [--skip-unlink NAME] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r'''
import json, os, statistics, sys, threading, time
tree, root = sys.argv[1], sys.argv[2]
blocks, size, bound_files = (int(x) for x in sys.argv[3:6])
sys.path.insert(0, tree)
from kvcache_core.layout import Layout, Namespace
from kvcache_core.reactor import Reactor
ns = Namespace("bench-evict", "u8", 1, size)
lay = Layout(root, ns, max_disk_bytes=bound_files * ns.file_bytes)
if os.environ.get("SKIP_UNLINK") == "1":  # --skip-unlink: evicted files are left alone
    lay._drain_evicted = lambda: None
r = Reactor(lay, n_slots=12, io_depth=8, lookahead=8, engine="auto", pin=False,
            store_policy="wait")
def store(prefix, n):
    r.store(prefix, [(f"{prefix}{i}".encode(), None, size) for i in range(n)])
    r.wait()
    (c,) = r.poll()
    assert c.success, r.snapshot()
store("fill", bound_files)  # the bound is full: from here every store evicts
def busy(stop, sink):
    out = []
    while not stop.is_set():
        t = time.perf_counter(); x = 0
        for i in range(20000): x += i
        out.append(time.perf_counter() - t)
    sink(out)
def start_busy():
    """The busy loop in a thread, or (--busy-process) in a forked child that shares no
    GIL with the reactor; returns a function that stops it and gives its slice times."""
    if os.environ.get("BUSY_PROCESS") == "1":
        import multiprocessing as mp
        stop, q = mp.Event(), mp.SimpleQueue()
        w, result = mp.Process(target=busy, args=(stop, q.put)), q.get
    else:
        stop, got = threading.Event(), []
        w, result = threading.Thread(target=busy, args=(stop, got.extend)), lambda: got
    w.start()
    def finish():
        stop.set()
        out = result()
        w.join()
        return out
    return finish
finish = start_busy()
time.sleep(0.5)
idle = statistics.median(finish())
finish = start_busy()
st0, ev0 = r.timing["step_s"], lay.stats.evicted_files
t0 = time.perf_counter()
store("k", blocks)
dt = time.perf_counter() - t0
out = finish()
res = {"store_gbps": blocks * size / dt / 1e9, "seconds": dt,
       "step_ms_per_store": 1e3 * (r.timing["step_s"] - st0) / blocks,
       "busy_slowdown": statistics.median(out) / idle,
       "evicted": lay.stats.evicted_files - ev0, "rescans": lay.stats.rescans,
       "evicted_background": lay.stats.evicted_background, "engine": r.engine.name,
       "direct_io": r.direct}
r.close(); lay.close()
print(json.dumps(res))
'''


def unlink_probe(parent: str, size: int, n: int = 10) -> dict:
    """What removing a file of ``size`` bytes costs here, against renaming it: ``n`` files
    written (O_DIRECT where accepted) and synced, then renamed in their directory, then
    unlinked; per file: wall time and this process's CPU time."""
    d = os.path.join(parent, "probe")
    os.makedirs(d, exist_ok=True)
    buf = mmap.mmap(-1, size)
    buf.write(os.urandom(1 << 20) * (size >> 20))
    paths = []
    for i in range(n):
        p = os.path.join(d, f"f{i}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            fd = os.open(p, flags | os.O_DIRECT, 0o600)
        except OSError:
            fd = os.open(p, flags, 0o600)
        os.write(fd, buf)
        os.close(fd)
        paths.append(p)
    os.sync()
    out = {}
    for op in ("rename", "unlink"):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for i, p in enumerate(paths):
            if op == "rename":
                os.rename(p, p + ".gone")
                paths[i] = p + ".gone"
            else:
                os.unlink(p)
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
        out[op] = {"wall_ms": 1e3 * wall / n, "cpu_ms": 1e3 * cpu / n}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH (repeat)")
    ap.add_argument("--root", default=None, help="parent of the cache roots (default: a "
                    "temporary directory under the current one)")
    ap.add_argument("--blocks", type=int, default=120)
    ap.add_argument("--block-mib", type=int, default=28)
    ap.add_argument("--bound-files", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy-process", action="store_true",
                    help="run the busy loop in a child process instead of a thread of the "
                    "storing process: no GIL shared, so what remains of its slowdown is "
                    "CPU contention")
    ap.add_argument("--skip-unlink", action="append", default=[], metavar="NAME",
                    help="diagnostic, for tree NAME (repeat): evicted files are renamed "
                    "but never unlinked (the disk holds them until the run's root is "
                    "removed)")
    ap.add_argument("--json")
    a = ap.parse_args()
    trees = [t.split("=", 1) for t in a.tree]
    parent = tempfile.mkdtemp(prefix="bench-evict-", dir=a.root or ".")
    runs: dict[str, list[dict]] = {n: [] for n, _ in trees}
    try:
        for rnd in range(a.rounds):
            for name, path in trees:
                root = os.path.join(parent, f"{name}-{rnd}")
                print(f"[bench evict] round {rnd + 1}/{a.rounds}: {name}", file=sys.stderr,
                      flush=True)
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, os.path.abspath(path), root,
                     str(a.blocks), str(a.block_mib << 20), str(a.bound_files)],
                    capture_output=True, text=True, check=True,
                    env=dict(os.environ, BUSY_PROCESS="1" if a.busy_process else "0",
                             SKIP_UNLINK="1" if name in a.skip_unlink else "0"))
                runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
                shutil.rmtree(root, ignore_errors=True)
        probe = unlink_probe(parent, a.block_mib << 20)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    med = {n: {k: statistics.median(r[k] for r in rs) for k in
               ("store_gbps", "step_ms_per_store", "busy_slowdown")} for n, rs in runs.items()}
    d = {"machine": f"{platform.node()} ({os.cpu_count()} cores)", "blocks": a.blocks,
         "block_mib": a.block_mib, "bound_files": a.bound_files, "rounds": a.rounds,
         "busy": "process" if a.busy_process else "thread", "skip_unlink": a.skip_unlink,
         "unlink_probe": probe,
         "trees": dict(trees), "runs": runs, "medians": med}
    lines = ["| tree | store GB/s | reactor step ms per store | busy thread slowdown | "
             "evicted per run |", "|---|---|---|---|---|"]
    for n, m in med.items():
        lines.append(f"| {n} | {m['store_gbps']:.2f} | {m['step_ms_per_store']:.2f} | "
                     f"{m['busy_slowdown']:.3f}x | {runs[n][0]['evicted']} |")
    lines += ["", f"Removing one {a.block_mib} MiB file here (the mean of 10, written and "
              f"synced first): rename {probe['rename']['wall_ms']:.3f} ms "
              f"({probe['rename']['cpu_ms']:.3f} ms CPU), unlink "
              f"{probe['unlink']['wall_ms']:.2f} ms ({probe['unlink']['cpu_ms']:.2f} ms CPU)."]
    if a.skip_unlink:
        lines += ["", f"Diagnostic (`--skip-unlink`): {', '.join(a.skip_unlink)} renamed "
                  "its evicted files and never unlinked them."]
    print("\n".join(lines))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(d, f, indent=1)
        with open(os.path.splitext(a.json)[0] + ".md", "w") as f:
            where = ("in another process: no GIL shared" if a.busy_process
                     else "a thread of the same process")
            f.write(f"# Eviction on the store path: {', '.join(n for n, _ in trees)}\n\n"
                    f"`scripts/bench_evict_path.py` on {d['machine']}: {a.blocks} stores "
                    f"of {a.block_mib} MiB into a bound of {a.bound_files} files (every "
                    f"store evicts one), a busy Python loop beside the reactor "
                    f"({where}); medians "
                    f"of {a.rounds} interleaved rounds, each run a fresh process.\n\n"
                    + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
