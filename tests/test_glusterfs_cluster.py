"""Multi-node semantics on a real GlusterFS volume (issue 16 item 3): the byte ledger,
``max_disk_bytes``, global LRU eviction and dead-writer collection across "nodes".

A node here is one FUSE mount of the volume (its own GlusterFS client process, with its
own caches) plus processes that run under a host name of their own (a UTS namespace:
their writer tags and temp names carry ``node-a`` or ``node-b``, as on two machines).
The volumes come from the session's fixtures (tests/conftest.py: one glusterd on
127.0.0.1, each volume mounted twice); one brick, ``replica 2`` and two-brick distribute
layouts.

What must hold across nodes:

* the ``.usage`` ledger is exact: every update of every node is seen by the next holder
  of the lock, whichever mount it comes through (``Ledger(coherent=True)``, picked on
  FUSE: plain reads and writes lose about half of the updates across two mounts);
* ``max_disk_bytes`` is one cluster-wide bound: an observer that takes the ledger lock
  (as every publisher and evictor does) and sums the published files on the bricks
  themselves (the servers' view, no client cache) finds them never above the bound and
  always equal to the ledger;
* eviction removes the globally least recently used files, recency being the mtime
  set by read hits on any node, once the evicting node's mount sees those mtimes
  (GlusterFS's metadata caches: about 1 s with the default volume options);
* a live writer's temp files are never collected from another node (``flock`` is
  exclusive across mounts), and are collected once that writer is killed, or once its
  node's mount dies.

``KV_GLUSTER_REPORT=path`` appends the measured numbers (JSON lines).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import pytest
from helpers.kvutil import REPO, list_files
from helpers.lru_worker import (
    ServeProc,
    check_lru_order,
    content,
    lru_order_groups,
    make_ns,
)

from kvcache_core.layout import LEDGER_XATTR, TMP_PREFIX, Layout, Ledger

WORKER = os.path.join(REPO, "tests", "helpers", "lru_worker.py")
ENV = dict(os.environ, PYTHONPATH=REPO)
BB = 1024  # one file = 4 KiB header + 4 KiB payload
NS = make_ns(BB)
FB = NS.file_bytes
NODES = ("node-a", "node-b")  # node-a on mount 1, node-b on mount 2
LAYOUTS = ["single", "replica", "distribute"]
T = TypeVar("T")


def _report(fig: dict) -> None:
    print(json.dumps(fig))
    if os.environ.get("KV_GLUSTER_REPORT"):
        with open(os.environ["KV_GLUSTER_REPORT"], "a") as f:
            f.write(json.dumps(fig) + "\n")


def _wait_for(pred: Callable[[], T], timeout: float, what: str, step: float = 0.01) -> T:
    """Poll ``pred()`` every ``step`` seconds until it returns a truthy value (returned);
    the test fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(step)


# ---------------------------------------------------------------- the servers' view
def brick_copies(gluster, layout: str) -> list[list[str]]:
    """The volume's bricks grouped into full copies of its files: one group of all its
    bricks (one brick; distribute: each file on one brick), or one group per brick
    (replica 2: each brick holds every file)."""
    bricks = gluster.bricks[layout]
    return [[b] for b in bricks] if layout == "replica" else [bricks]


def _shard_entries(bricks: list[str], rel_base: str):
    """Every entry of the namespace's shard directories on every brick (hidden top-level
    entries such as the ledger skipped)."""
    for brick in bricks:
        for top in _entries(os.path.join(brick, rel_base)):
            if top.name.startswith(".") or not top.is_dir(follow_symlinks=False):
                continue
            for sub in _entries(top.path):
                if sub.is_dir(follow_symlinks=False):
                    yield from _entries(sub.path)


def _is_link_file(st: os.stat_result) -> bool:
    """A GlusterFS DHT link file: empty, mode ``---------T`` (the data is on another
    brick)."""
    return stat.S_ISREG(st.st_mode) and bool(st.st_mode & stat.S_ISVTX) and st.st_size == 0


def brick_files(bricks: list[str], rel_base: str) -> dict[str, int]:
    """Published files of a namespace as the bricks hold them, name -> bytes: regular
    files in the shard directories of every brick, temp files and GlusterFS's zero-byte
    DHT link files (mode ``---------T``, pointing to the brick that holds the data)
    excluded. Exact only while nothing publishes or evicts (the ledger lock held)."""
    out: dict[str, int] = {}
    for e in _shard_entries(bricks, rel_base):
        if e.name.startswith(TMP_PREFIX):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode) or _is_link_file(st):
            continue
        assert e.name not in out, f"{e.name} holds data on two bricks"
        out[e.name] = st.st_size
    return out


def brick_usage(bricks: list[str], rel_base: str) -> tuple[int, int]:
    """(published files, bytes) of :func:`brick_files`."""
    files = brick_files(bricks, rel_base)
    return len(files), sum(files.values())


def _entries(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []


def brick_ledger(bricks: list[str], rel_base: str, name: str = ".usage") -> int:
    """The ledger ``rel_base/name`` as the brick holding it stores it: its
    :data:`~kvcache_core.layout.LEDGER_XATTR` attribute (coherent ledger), else its
    first 8 bytes."""
    for brick in bricks:
        p = os.path.join(brick, rel_base, name)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode) or _is_link_file(st):
            continue  # a DHT link file: the data file is on another brick
        try:
            raw = os.getxattr(p, LEDGER_XATTR)
        except OSError:
            with open(p, "rb") as f:
                raw = f.read(8)
        return int.from_bytes(raw, "little", signed=True) if len(raw) == 8 else 0
    raise AssertionError(f"no {name} on the bricks {bricks} under {rel_base}")


def await_ledger_on_bricks(copies: list[list[str]], rel_base: str, mount_bases: list[str],
                          timeout: float = 20.0) -> None:
    """Wait until every full copy of the volume holds the namespace's ledger. A replica
    client that lost a brick for a moment creates the entry on the other brick only, and
    AFR heals it on the next lookup through a mount (stat of the ledger here); without
    this a brick read right after the workers opened their layouts can miss it."""
    def everywhere() -> bool:
        for m in mount_bases:
            with contextlib.suppress(OSError):
                os.stat(os.path.join(m, ".usage"))
        try:
            for c in copies:
                brick_ledger(c, rel_base)
        except AssertionError:
            return False
        return True

    _wait_for(everywhere, timeout, "the ledger on every brick", step=0.1)


def brick_temps(bricks: list[str], rel_base: str) -> list[str]:
    """Names of the temp files on the bricks (DHT link files excluded)."""
    out = []
    for e in _shard_entries(bricks, rel_base):
        if not e.name.startswith(TMP_PREFIX):
            continue
        try:
            link = _is_link_file(e.stat(follow_symlinks=False))
        except FileNotFoundError:
            link = False  # gone meanwhile: it was a temp file when listed
        if not link:
            out.append(e.name)
    return out


class BoundObserver(threading.Thread):
    """Samples the namespace every ``period`` seconds the way a publisher sees it: takes
    the ledger's ``flock`` through ``mount_base`` (every publish, eviction and
    collection of every node holds it while it changes the files or the ledger), then
    reads the ledger and the published files from the bricks, and releases it. With
    several full copies (replica) each sample also records whether they agree."""

    def __init__(self, mount_base: str, copies: list[list[str]], rel_base: str,
                 period: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.mount_base, self.copies, self.rel_base = mount_base, copies, rel_base
        self.period = period
        self.samples: list[tuple[int, int, int]] = []  # (ledger, files, bytes)
        self.disagree = 0  # samples where the replicas' files or ledgers differed
        self.error: BaseException | None = None
        self._stop_ev = threading.Event()

    def run(self) -> None:
        try:
            fd = os.open(os.path.join(self.mount_base, ".usage"), os.O_RDONLY)
            try:
                while not self._stop_ev.is_set():
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    try:
                        views = [(brick_ledger(c, self.rel_base), brick_files(c, self.rel_base))
                                 for c in self.copies]
                    finally:
                        fcntl.flock(fd, fcntl.LOCK_UN)
                    ledger, files = views[0]
                    self.disagree += any(v != views[0] for v in views[1:])
                    self.samples.append((ledger, len(files), sum(files.values())))
                    self._stop_ev.wait(self.period)
            finally:
                os.close(fd)
        except BaseException as e:  # reported by stop()
            self.error = e

    def stop(self) -> list[tuple[int, int, int]]:
        self._stop_ev.set()
        self.join(30)
        assert not self.is_alive(), "the observer did not stop"
        if self.error is not None:
            raise self.error
        return self.samples


# ---------------------------------------------------------------- the ledger itself
_ADDER = """
import sys
from kvcache_core.layout import Ledger
led = Ledger(sys.argv[1], coherent=sys.argv[2] == "1")
print("coherent" if led.coherent else "plain", flush=True)
for _ in range(int(sys.argv[3])):
    led.add(int(sys.argv[4]))
led.close()
"""


@pytest.mark.parametrize("mounts", LAYOUTS, indirect=True)
def test_ledger_is_exact_across_mounts(mounts, gluster, tmp_path):
    """Four processes, two per mount, each add 1 to one ledger 150 times at the same
    time (a read-modify-write under ``flock`` each): the ledger ends at exactly 600, read
    through either mount and on the brick. A Layout picks the coherent ledger on a FUSE
    mount and the plain one on a local directory."""
    layout, m1, m2, name = mounts
    os.makedirs(os.path.join(m1, name))
    paths = [os.path.join(m, name, "ledger") for m in (m1, m2)]
    Ledger(paths[0], coherent=True).close()
    _wait_for(lambda: os.path.exists(paths[1]), 10, "the ledger on mount 2")
    n_add, t0 = 150, time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", _ADDER, paths[i % 2], "1", str(n_add),
                               "1"], env=ENV, stdout=subprocess.PIPE, text=True)
             for i in range(4)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    took = time.monotonic() - t0
    assert [p.returncode for p in procs] == [0] * 4
    assert [o.strip() for o in outs] == ["coherent"] * 4
    want = 4 * n_add
    seen = []
    for p in paths:
        led = Ledger(p, coherent=True)
        try:
            seen.append(led.get())
        finally:
            led.close()
    on_brick = brick_ledger(brick_copies(gluster, layout)[0], name, "ledger")
    assert seen == [want, want] and on_brick == want, (seen, on_brick, want)
    for m in (m1, m2):
        lay = Layout(os.path.join(m, name), NS, publish_method="auto")
        try:
            assert lay.ledger.coherent and lay.publish_method == "rename"
        finally:
            lay.close()
    lay = Layout(str(tmp_path / "local"), NS, publish_method="auto")
    try:
        assert not lay.ledger.coherent
    finally:
        lay.close()
    _report({"test": "ledger_across_mounts", "layout": layout, "adds": want,
             "ledger": seen, "brick": on_brick, "s": round(took, 2),
             "ms_per_add": round(took / want * 1000, 2)})


# ---------------------------------------------------------------- the cluster-wide bound
N_WORKERS = 6  # 3 per node
N_BLOCKS = 40
BOUND_FILES = 48


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mounts", LAYOUTS, indirect=True)
def test_max_disk_bytes_is_a_cluster_wide_bound(mounts, gluster, tmp_path):
    """Six processes, three on each node (mount), 40 stores each (+2 reads of recent
    blocks of any process after each store) into one namespace bounded to 48 files:
    240 stores, ~190 evictions. Sampled every ~20 ms under the ledger lock from the
    bricks: the published bytes never exceed ``max_disk_bytes`` and always equal the
    ledger; at the end the ledger equals the bytes on disk, no temp file or writer
    entry is left, no error, no wrong read, and the survivors are mostly the most
    recently used blocks (eviction is global LRU, to GlusterFS's ~1 s mtime
    coherence)."""
    layout, m1, m2, name = mounts
    bricks = brick_copies(gluster, layout)[0]
    roots = (os.path.join(m1, name), os.path.join(m2, name))
    rel_base = os.path.join(name, NS.dirname())
    bound = BOUND_FILES * FB
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    outs = [str(tmp_path / f"out-{w}.json") for w in range(N_WORKERS)]
    t0 = time.monotonic()
    procs = [subprocess.Popen(
        [sys.executable, WORKER, "node", roots[w % 2], str(ctl), str(BB), str(bound),
         str(w), str(N_WORKERS), str(N_BLOCKS), str(100 + w), outs[w], NODES[w % 2]],
        env=ENV) for w in range(N_WORKERS)]
    obs = None
    try:
        def ready() -> bool:
            assert all(p.poll() in (None, 0) for p in procs), "a worker died"
            return len(list(ctl.glob("ready-*"))) == N_WORKERS

        _wait_for(ready, 60, "the workers to open their layouts")
        bases = [os.path.join(r, NS.dirname()) for r in roots]
        await_ledger_on_bricks(brick_copies(gluster, layout), rel_base, bases)
        obs = BoundObserver(bases[0], brick_copies(gluster, layout), rel_base)
        obs.start()
        t_go = time.monotonic()
        (ctl / "go").touch()
        rcs = [p.wait(timeout=180) for p in procs]
        t_run = time.monotonic() - t_go
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        samples = obs.stop() if obs is not None else []
    assert rcs == [0] * N_WORKERS, rcs
    results = []
    for o in outs:
        with open(o) as f:
            results.append(json.load(f))
    errors = [e for r in results for e in r["errors"]]
    wrong = sum(r["wrong"] for r in results)
    assert errors == [] and wrong == 0, (errors[:3], wrong)
    for w, r in enumerate(results):  # two nodes: host-tagged writers, rename, coherent
        info = r["info"]
        assert info["host"] == NODES[w % 2] and info["tag"].startswith(NODES[w % 2] + ".")
        assert info["method"] == "rename" and info["coherent"], info
    # the bound, at every observed moment (a consistent cut: the ledger lock was held)
    assert len(samples) >= 20, f"only {len(samples)} observations"
    over = [s for s in samples if s[2] > bound]
    assert not over, f"published bytes above the bound {bound}: {over[:5]}"
    skew = [s for s in samples if s[0] != s[2]]
    assert not skew, f"ledger != bytes on the bricks (ledger, files, bytes): {skew[:5]}"
    assert obs.disagree == 0, f"the replicas differed in {obs.disagree} samples"
    peak = max(s[2] for s in samples)
    assert peak >= 0.85 * bound, (peak, bound)  # the bound was reached and enforced
    # at the end: ledger == disk (bricks, and each mount's own walk), nothing left over
    await_ledger_on_bricks(brick_copies(gluster, layout), rel_base, bases)
    final_files, final_bytes = brick_usage(bricks, rel_base)
    assert brick_ledger(bricks, rel_base) == final_bytes <= bound
    for other in brick_copies(gluster, layout)[1:]:  # replica: both bricks alike
        assert brick_files(other, rel_base) == brick_files(bricks, rel_base)
        assert brick_ledger(other, rel_base) == final_bytes
    for root in roots:
        base = os.path.join(root, NS.dirname())
        finals, temps = list_files(base)
        assert temps == [] and len(finals) == final_files, (len(finals), temps[:3])
        assert os.listdir(os.path.join(base, ".writers")) == []
    assert brick_temps(bricks, rel_base) == []
    lay = Layout(roots[1], NS, publish_method="auto", collect=False)
    try:
        assert lay.ledger.get() == final_bytes
        # which blocks survived: the bricks' names (a lookup through a mount may still
        # find a file another node evicted less than ~1 s ago: GlusterFS's metadata
        # cache; reading it then fails, a miss)
        names = brick_files(bricks, rel_base)
        survivors = {k for r in results for k, _ in r["pubs"]
                     if lay.name_of(k.encode()) in names}
    finally:
        lay.close()
    # accounting: every store was published or dropped (counted), every eviction counted
    last_use: dict[str, float] = {}
    for r in results:
        for k, t in r["pubs"] + r["hits"]:
            last_use[k] = max(t, last_use.get(k, 0.0))
    published = sum(len(r["pubs"]) for r in results)
    dropped = sum(r["stats"]["dropped_full"] for r in results)
    evicted = sum(r["stats"]["evicted_files"] for r in results)
    assert len(survivors) == final_files
    assert published + dropped == N_WORKERS * N_BLOCKS, (published, dropped)
    assert evicted == published - final_files, (evicted, published, final_files)
    assert dropped <= 0.25 * N_WORKERS * N_BLOCKS, dropped
    by_node = [sum(r["stats"]["evicted_files"] for w, r in enumerate(results) if w % 2 == n)
               for n in (0, 1)]
    assert min(by_node) > 0, by_node  # both nodes evicted (each other's files too)
    recent = sorted(last_use, key=last_use.get, reverse=True)[: len(survivors)]
    precision = len(survivors & set(recent)) / max(1, len(survivors))
    fig = {"test": "cluster_bound", "layout": layout, "processes": N_WORKERS,
           "nodes": 2, "stores": N_WORKERS * N_BLOCKS, "published": published,
           "dropped_full": dropped, "evicted": evicted, "evicted_by_node": by_node,
           "bound_bytes": bound, "peak_bytes": peak, "peak_files": max(s[1] for s in samples),
           "observations": len(samples), "final_bytes": final_bytes,
           "final_ledger": brick_ledger(bricks, rel_base), "final_files": final_files,
           "lru_precision": round(precision, 3), "run_s": round(t_run, 2),
           "wall_s": round(time.monotonic() - t0, 2)}
    _report(fig)
    assert precision >= 0.5, fig


# ---------------------------------------------------------------- global LRU order
def Node(root: str, node: str, max_disk: int, rescan_s: float = 0.05) -> ServeProc:
    """A ``lru_worker.py serve`` child on one mount, under its own host name."""
    return ServeProc(root, BB, max_disk, rescan_s, "auto", node)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mounts", LAYOUTS, indirect=True)
def test_eviction_follows_global_recency_across_mounts(mounts, gluster):
    """Node A (mount 1) publishes a0-a7, node B (mount 2) b0-b7; B reads a0-a3 (its read
    hits set their mtime through mount 2), A reads b0-b1. Recency, oldest first:
    a4-a7 < b2-b7 < a0-a3 < b0-b1. Once mount 1 shows B's mtimes (GlusterFS caches
    metadata per client: ~1 s with default options, measured) and A's evictor has
    rescanned, A alone stores 12 new blocks into a bound of 20 files: what it evicts is
    the oldest of that order, B's files included, and never a file B read."""
    layout, m1, m2, name = mounts
    roots = (os.path.join(m1, name), os.path.join(m2, name))
    bound = 20 * FB
    a = Node(roots[0], NODES[0], bound)
    b = None
    try:
        b = Node(roots[1], NODES[1], bound)
        A = [f"a{i}" for i in range(8)]
        B = [f"b{i}" for i in range(8)]
        assert a.cmd("pub", A) == A
        assert b.cmd("pub", B) == B
        assert b.cmd("touch", A[:4]) == A[:4]  # B's read hits on A's files
        assert a.cmd("touch", B[:2]) == B[:2]  # A's read hits on B's files
        b.quit()
        lay2 = Layout(roots[1], NS, publish_method="auto", collect=False)
        try:  # the mtimes as B's own mount has them
            want = {k: os.lstat(lay2.path_for(k.encode())).st_mtime for k in A[:4]}
            paths1 = {k: os.path.join(roots[0], os.path.relpath(lay2.path_for(k.encode()),
                                                                roots[1])) for k in A[:4]}
        finally:
            lay2.close()
        t_touch = time.monotonic()
        _wait_for(lambda: all(abs(os.lstat(paths1[k]).st_mtime - t) < 1e-6
                              for k, t in want.items()), 15, "mount 1 to see B's mtimes")
        lag = time.monotonic() - t_touch
        base_scans = a.cmd("stats")["rescans"]  # then A's evictor rescans (80% full)
        _wait_for(lambda: a.cmd("stats")["rescans"] >= base_scans + 2, 30,
                  "node A's evictor to rescan", step=0.05)
        group = lru_order_groups(A, B)
        new = [f"n{i}" for i in range(12)]
        for k in new:
            assert a.cmd("pub", [k]) == [k]
        stats = a.quit()  # after its evictor stopped: every eviction counted
    finally:
        a.kill()
        if b is not None:
            b.kill()
    bricks = brick_copies(gluster, layout)[0]
    rel_base = os.path.join(name, NS.dirname())
    names = brick_files(bricks, rel_base)  # not lookups through mount 2: they may be stale
    lay = Layout(roots[1], NS, publish_method="auto")
    try:
        survivors = {k for k in group if lay.name_of(k.encode()) in names}
        assert all(lay.name_of(k.encode()) in names for k in new)
        for k in survivors:
            assert lay.read_block(k.encode()) == content(k.encode(), BB)
        ledger = lay.ledger.get()
    finally:
        lay.close()
    evicted = check_lru_order(group, survivors, stats, A, B)
    assert brick_ledger(bricks, rel_base) == ledger == brick_usage(bricks, rel_base)[1] <= bound
    _report({"test": "global_lru_order", "layout": layout, "evicted": sorted(evicted),
             "mtime_coherence_s": round(lag, 3), "bound_bytes": bound,
             "final_bytes": ledger})


# ---------------------------------------------------------------- a lost ledger
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mounts", LAYOUTS, indirect=True)
def test_ledger_removed_through_another_mount_is_reattached(mounts, gluster):
    """Node A (mount 1) runs bounded with four blocks published; ``.usage`` is removed
    through mount 2 and node B opens the namespace there (a fresh ledger at 0, as after
    GlusterFS lost a concurrent create). A's evictor finds its ledger detached once its
    mount sees the removal (GlusterFS's ~1 s metadata cache), reopens the one at the
    path and recounts it; then both nodes store into one bound, and the ledger equals
    the bytes on the bricks."""
    layout, m1, m2, name = mounts
    roots = (os.path.join(m1, name), os.path.join(m2, name))
    bound = 12 * FB
    a = Node(roots[0], NODES[0], bound)
    b = None
    try:
        first = [f"a{i}" for i in range(4)]
        assert a.cmd("pub", first) == first
        base2 = os.path.join(roots[1], NS.dirname())
        os.unlink(os.path.join(base2, ".usage"))
        b = Node(roots[1], NODES[1], bound)
        _wait_for(lambda: a.cmd("stats")["ledger_reattached"] >= 1, 30,
                  "node A to reattach its ledger", step=0.05)
        for i in range(10):
            assert a.cmd("pub", [f"a-more{i}"]) == [f"a-more{i}"]
            assert b.cmd("pub", [f"b-more{i}"]) == [f"b-more{i}"]
        sa, sb = a.quit(), b.quit()
    finally:
        a.kill()
        if b is not None:
            b.kill()
    assert sa["ledger_reattached"] == 1 and sb["ledger_reattached"] == 0, (sa, sb)
    assert sa["evicted_files"] + sb["evicted_files"] > 0, (sa, sb)
    copies = brick_copies(gluster, layout)
    rel_base = os.path.join(name, NS.dirname())
    await_ledger_on_bricks(copies, rel_base, [os.path.join(r, NS.dirname()) for r in roots])
    for bricks in copies:
        assert brick_ledger(bricks, rel_base) == brick_usage(bricks, rel_base)[1] <= bound


# ---------------------------------------------------------------- dead writers
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mounts", LAYOUTS, indirect=True)
def test_dead_writer_on_another_node_is_collected_only_after_it_dies(mounts, gluster):
    """Writer W runs on node A (mount 1) with three stores in flight (complete temp
    files, not published yet). Node B (mount 2) opens the namespace (which collects dead
    writers) and calls ``collect_dead_writers`` again and again: W's ``flock`` on
    ``.writers/node-a.<pid>...`` is held across the mounts, so nothing of W's is
    removed, and W then publishes its three blocks intact. W starts two more stores and
    is killed (SIGKILL): its lock goes with it, and B's next collection removes exactly
    those two temp files and W's writer entry, and resyncs the ledger to the disk."""
    layout, m1, m2, name = mounts
    roots = (os.path.join(m1, name), os.path.join(m2, name))
    bricks = brick_copies(gluster, layout)[0]
    rel_base = os.path.join(name, NS.dirname())
    w = Node(roots[0], NODES[0], 0)
    b = None
    try:
        info = w.cmd("info")
        assert info["host"] == NODES[0] and info["tag"].startswith(NODES[0] + ".")
        first = w.cmd("temps", ["t0", "t1", "t2"])
        assert len(first) == 3 and all(os.path.basename(t).startswith(
            f"{TMP_PREFIX}{info['tag']}.") for t in first)
        b = Node(roots[1], NODES[1], 0)  # opening the layout collects dead writers
        binfo = b.cmd("info")
        assert binfo["host"] == NODES[1] and binfo["tag"] != info["tag"]
        assert b.cmd("stats")["temp_collected"] == 0
        for _ in range(5):
            assert b.cmd("collect") == 0
        wdir2 = os.path.join(roots[1], NS.dirname(), ".writers")
        assert info["tag"] in os.listdir(wdir2)
        assert sorted(brick_temps(bricks, rel_base)) == sorted(
            os.path.basename(t) for t in first)
        assert w.cmd("publish_temps") == [True, True, True]  # intact: published
        for k in ("t0", "t1", "t2"):
            assert b.cmd("touch", [k]) == [k]  # B reads them (content checked)
        second = w.cmd("temps", ["u0", "u1"])
        assert b.cmd("collect") == 0
        os.kill(w.p.pid, signal.SIGKILL)
        w.p.wait()
        t_kill = time.monotonic()
        removed = _wait_for(lambda: b.cmd("collect"), 30,
                            "node B to collect the killed writer", step=0.02)
        collect_s = time.monotonic() - t_kill
        assert removed == 2, removed
        assert brick_temps(bricks, rel_base) == []
        for root in roots:
            assert not any(os.path.exists(os.path.join(root, os.path.relpath(t, roots[0])))
                           for t in second)
        assert info["tag"] not in os.listdir(wdir2) and binfo["tag"] in os.listdir(wdir2)
        assert b.cmd("collect") == 0
        assert b.cmd("stats")["temp_collected"] == 2
        b.quit()
    finally:
        w.kill()
        if b is not None:
            b.kill()
    files, nbytes = brick_usage(bricks, rel_base)
    assert files == 3 and brick_ledger(bricks, rel_base) == nbytes
    _report({"test": "dead_writer_across_nodes", "layout": layout,
             "live_collect_attempts": 7, "collected_after_kill": removed,
             "collect_after_kill_s": round(collect_s, 3)})



@pytest.mark.timeout(120)
@pytest.mark.parametrize("mounts", ["single"], indirect=True)
def test_writer_of_a_node_whose_mount_died_is_collected(mounts, gluster):
    """Node A's whole mount dies (its GlusterFS client process is killed: the node
    crashed or lost the filesystem) while its writer has two stores in flight. The
    writer process itself still runs, but its locks lived in that client: the server
    drops them with the connection, and node B's next collection removes the writer's
    temp files and entry. (A node that vanishes without closing its TCP connection keeps
    its locks until the server's ``network.ping-timeout``, 42 s by default: not tested
    here.)"""
    layout, _m1, m2, name = mounts
    m3 = gluster.extra_mount(layout, f"node-a-{time.time_ns()}")
    bricks = brick_copies(gluster, layout)[0]
    rel_base = os.path.join(name, NS.dirname())
    w = Node(os.path.join(m3, name), NODES[0], 0)
    b = None
    client = gluster.client_pid(m3)
    try:
        info = w.cmd("info")
        assert len(w.cmd("temps", ["d0", "d1"])) == 2
        b = Node(os.path.join(m2, name), NODES[1], 0)
        assert b.cmd("collect") == 0 and b.cmd("stats")["temp_collected"] == 0
        assert len(brick_temps(bricks, rel_base)) == 2
        os.kill(client, signal.SIGKILL)  # node A's mount dies; its writer lives on
        t_kill = time.monotonic()
        removed = _wait_for(lambda: b.cmd("collect"), 30,
                            "node B to collect the writer of the dead mount", step=0.02)
        collect_s = time.monotonic() - t_kill
        assert removed == 2 and brick_temps(bricks, rel_base) == []
        assert w.p.poll() is None  # the writer process was alive all along
        wdir = os.path.join(m2, name, NS.dirname(), ".writers")
        assert info["tag"] not in os.listdir(wdir)
        b.quit()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(client, signal.SIGKILL)
        w.kill()
        if b is not None:
            b.kill()
    _report({"test": "dead_mount_writer_collected", "layout": layout,
             "collect_after_client_kill_s": round(collect_s, 3)})


# ---------------------------------------------------------------- a fresh namespace
OPENER = r"""
import json, sys
from helpers.lru_worker import become_node, content, make_ns
from kvcache_core.layout import Layout
root, node, key, bb = sys.argv[1], sys.argv[2], sys.argv[3].encode(), int(sys.argv[4])
become_node(node)
print("ready", flush=True)
sys.stdin.readline()
lay = Layout(root, make_ns(bb), max_disk_bytes=1 << 30, publish_method="auto")
try:
    ok = lay.write_block(key, content(key, bb))
    print(json.dumps({"published": ok, "back": lay.read_block(key) == content(key, bb)}),
          flush=True)
finally:
    lay.close()
"""
OPEN_ROUNDS = 8
OPENERS_PER_MOUNT = 3


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mounts", LAYOUTS, indirect=True)
def test_processes_on_both_mounts_open_a_fresh_namespace_at_once(mounts, gluster):
    """Operators start the engines of several nodes at the same moment: processes on
    both mounts open a namespace that does not exist yet, at once (each round a fresh
    root). GlusterFS mishandles concurrent ``mkdir`` of one name from two clients (the
    losing client is told its ``mkdir`` worked, under a directory id the server never
    recorded: its next ``mkdir`` inside fails with ESTALE / ENOENT for about a second;
    a CI run lost a writer to it). Every process must open the namespace, store its
    block and read it back. The race is rare even so: in about 30 runs of this test on
    the CPU machine the brick logged it a few times, and the processes that lost it
    did not always reach the failing ``mkdir`` inside the stale window (the old code
    passed those runs too): a guard of the path, while the deterministic check of the
    retry is tests/test_layout.py's namespace-vanishes test."""
    layout, m1, m2, name = mounts
    env = dict(ENV, PYTHONPATH=f"{REPO}{os.pathsep}{os.path.join(REPO, 'tests')}")
    failures: list[str] = []
    for r in range(OPEN_ROUNDS):
        # odd rounds: the root exists already, so the processes meet at the namespace's
        # mkdir (even rounds: at the root's first)
        if r % 2:
            os.mkdir(os.path.join(m1, f"{name}-{r}"))
        procs = []
        for m, node in ((m1, NODES[0]), (m2, NODES[1])):
            root = os.path.join(m, f"{name}-{r}")
            for i in range(OPENERS_PER_MOUNT):
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", OPENER, root, node, f"{node}-{r}-{i}", str(BB)],
                    env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE))
        try:
            for p in procs:
                assert p.stdout.readline().strip() == "ready", p.communicate(timeout=30)
            for p in procs:  # as close together as the test can make them
                p.stdin.write("go\n")
                p.stdin.flush()
            for p in procs:
                out, err = p.communicate(timeout=60)
                if p.returncode != 0 or json.loads(out.strip() or "{}") != {
                        "published": True, "back": True}:
                    failures.append(f"round {r}: rc {p.returncode} {out!r}\n{err[-1500:]}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert not failures, "\n".join(failures)
