"""Child process of tests/test_global_lru.py and tests/test_glusterfs_cluster.py: real
Layouts of one namespace in real processes.

Modes (argv[1]):

* ``serve ROOT BLOCK_BYTES MAX_DISK RESCAN_S [METHOD [NODE]]``: reads one JSON command a
  line on stdin, answers one JSON line on stdout: ``{"op": "pub", "keys": [...]}``
  (write_block each; answer: the keys published), ``{"op": "touch", "keys": [...]}``
  (read_block each, i.e. a read hit touches the file; answer: the keys hit),
  ``{"op": "temps", "keys": [...]}`` (a temp file of each key with its complete block
  written, left unpublished like a store in flight; answer: the temp paths),
  ``{"op": "publish_temps"}`` (publish them all; answer: the publish results),
  ``{"op": "collect"}`` (:meth:`Layout.collect_dead_writers`; answer: the temp files it
  removed), ``{"op": "info"}`` (writer tag, host name, publish method, coherent ledger),
  ``{"op": "stats"}``, ``{"op": "quit"}`` (answers the final stats). METHOD:
  ``publish_method`` (default "link").
* ``churn ROOT BLOCK_BYTES MAX_DISK WID NWORKERS NBLOCKS SEED OUT``: waits for ``ROOT/go``,
  then publishes NBLOCKS blocks ``w<WID>-<i>`` and reads random earlier blocks of any
  worker; writes to OUT the wall time of every publish and read hit (the block's last use
  is the latest of them), the errors and wrong reads, and its layout stats.
* ``node ROOT CTL BLOCK_BYTES MAX_DISK WID NWORKERS NBLOCKS SEED OUT NODE``: ``churn`` as
  one process of cluster node NODE (tests/test_glusterfs_cluster.py): the ready/go files
  live in CTL (a local directory, not on the shared filesystem) and ``publish_method`` is
  "auto".

NODE (optional): the process first moves into a UTS namespace of its own whose host name
is NODE (root only), so that its writer tag (``.writers/<host>.<pid>...``) and temp names
carry another host, as on a real cluster node.

Content is derived from the key only (any process can verify any block it reads).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import random
import socket
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from kvcache_core.layout import HEADER_BYTES, Layout, Namespace  # noqa: E402

CLONE_NEWUTS = 0x04000000


def become_node(name: str) -> None:
    """Give this process a host name of its own (``unshare(CLONE_NEWUTS)`` then
    ``sethostname``: root only). Raises OSError when the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUTS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWUTS): {os.strerror(err)}")
    socket.sethostname(name)


class ServeProc:
    """A ``lru_worker.py serve`` child (one Layout) driven line by line by a test:
    ``extra`` = the optional ``serve`` arguments (publish method, host name)."""

    def __init__(self, root: str, block_bytes: int, max_disk: int, rescan_s: float,
                 *extra: str) -> None:
        import subprocess

        self.p = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "serve", root, str(block_bytes),
             str(max_disk), str(rescan_s), *extra],
            env=dict(os.environ, PYTHONPATH=REPO), text=True, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE)
        line = self.p.stdout.readline()
        assert line and json.loads(line) == {"ready": True}, (line, self.p.poll())

    def cmd(self, op: str, keys: list[str] | None = None):
        self.p.stdin.write(json.dumps({"op": op, "keys": keys or []}) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        assert line, f"worker died (rc {self.p.poll()})"
        return json.loads(line)["res"]

    def quit(self) -> dict | None:
        """Close the child's Layout (its evictor thread stopped and joined) and wait for
        it to exit; returns its final stats (None when it had exited already). A
        ``stats`` command before ``quit`` can miss an eviction that the background
        evictor makes after answering it."""
        if self.p.poll() is None:
            final = self.cmd("quit")
            assert self.p.wait(timeout=30) == 0
            return final
        return None

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def make_ns(block_bytes: int) -> Namespace:
    return Namespace(model="lru/model", dtype="bfloat16", block_size=16, block_bytes=block_bytes)


def content(key: bytes, n: int) -> bytes:
    """``n`` bytes derived from ``key`` (cheap: the key repeated)."""
    reps = n // len(key) + 1
    return (key * reps)[:n]


def write_temp(lay: Layout, key: bytes, block_bytes: int) -> tuple[str, str, int]:
    """A temp file of ``key`` holding its complete block, not published (a store whose
    write finished but whose publish has not run yet). Returns (temp, final, bytes)."""
    buf = bytearray(lay.ns.file_bytes)
    mv = memoryview(buf)
    mv[HEADER_BYTES: HEADER_BYTES + block_bytes] = content(key, block_bytes)
    n = lay.fill_header(mv, key, block_bytes)
    fd, tmp, final = lay.create_temp(key)
    try:
        if os.write(fd, mv[:n]) != n:
            raise OSError(errno.ENOSPC, "short write")
    finally:
        os.close(fd)
    return tmp, final, n


def serve(root: str, block_bytes: int, max_disk: int, rescan_s: float,
          method: str = "link") -> None:
    lay = Layout(root, make_ns(block_bytes), max_disk_bytes=max_disk,
                 rescan_interval_s=rescan_s, publish_method=method)
    temps: list[tuple[str, str, int]] = []
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "pub":
            res = [k for k in cmd["keys"]
                   if lay.write_block(k.encode(), content(k.encode(), block_bytes))]
        elif op == "touch":
            res = []
            for k in cmd["keys"]:
                got = lay.read_block(k.encode())
                if got is not None:
                    assert got == content(k.encode(), block_bytes), k
                    res.append(k)
        elif op == "temps":
            made = [write_temp(lay, k.encode(), block_bytes) for k in cmd["keys"]]
            temps += made
            res = [t[0] for t in made]
        elif op == "publish_temps":
            res = [lay.publish(*t) for t in temps]
            temps = []
        elif op == "collect":
            res = lay.collect_dead_writers()
        elif op == "info":
            res = {"tag": lay._tag, "host": socket.gethostname(), "pid": os.getpid(),
                   "method": lay.publish_method, "base": lay.base,
                   "coherent": getattr(lay.ledger, "coherent", False)}
        elif op == "stats":
            res = dict(lay.stats.__dict__)
        elif op == "quit":  # answers the final stats: the evictor thread is joined
            lay.close()
            out.write(json.dumps({"res": dict(lay.stats.__dict__)}) + "\n")
            out.flush()
            return
        else:
            raise ValueError(op)
        out.write(json.dumps({"res": res}) + "\n")
        out.flush()


def churn(root: str, block_bytes: int, max_disk: int, wid: int, nworkers: int,
          nblocks: int, seed: int, out_path: str, ctl: str | None = None,
          method: str = "link") -> None:
    """Publish NBLOCKS blocks and read random recent ones of any worker (module doc).
    ``ctl``: the directory of the ready/go files (default: ROOT)."""
    rng = random.Random(seed)
    ns = make_ns(block_bytes)
    ctl = ctl or root
    lay = Layout(root, ns, max_disk_bytes=max_disk, publish_method=method)
    open(os.path.join(ctl, f"ready-{wid}"), "w").close()
    go = os.path.join(ctl, "go")
    while not os.path.exists(go):
        time.sleep(0.01)
    t_start = time.time()
    pubs: list[tuple[str, float]] = []
    hits: list[tuple[str, float]] = []
    errors: list[str] = []
    wrong = 0
    for i in range(nblocks):
        k = f"w{wid}-{i}"
        try:
            if lay.write_block(k.encode(), content(k.encode(), block_bytes)):
                pubs.append((k, time.time()))
            for _ in range(2):  # reads of recent blocks, own or another worker's
                j = rng.randrange(nworkers)
                r = f"w{j}-{max(0, i - rng.randrange(1, 12))}"
                got = lay.read_block(r.encode())
                if got is not None:
                    hits.append((r, time.time()))
                    if got != content(r.encode(), block_bytes):
                        wrong += 1
        except Exception:
            errors.append(traceback.format_exc())
    t_end = time.time()
    info = {"tag": lay._tag, "host": socket.gethostname(), "method": lay.publish_method,
            "coherent": getattr(lay.ledger, "coherent", False)}
    lay.close()  # joins the evictor thread: its background evictions are counted too
    stats = dict(lay.stats.__dict__)
    with open(out_path, "w") as f:
        json.dump({"pubs": pubs, "hits": hits, "errors": errors, "wrong": wrong,
                   "stats": stats, "info": info, "start": t_start, "end": t_end}, f)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "serve":
        if len(args) > 5:
            become_node(args[5])
        serve(args[0], int(args[1]), int(args[2]), float(args[3]),
              args[4] if len(args) > 4 else "link")
    elif mode == "churn":
        churn(args[0], int(args[1]), int(args[2]), int(args[3]), int(args[4]), int(args[5]),
              int(args[6]), args[7])
    elif mode == "node":
        become_node(args[9])
        churn(args[0], int(args[2]), int(args[3]), int(args[4]), int(args[5]), int(args[6]),
              int(args[7]), args[8], ctl=args[1], method="auto")
    else:
        raise SystemExit(f"unknown mode {mode}")


def lru_order_groups(a_keys: list[str], b_keys: list[str]) -> dict[str, int]:
    """The global-LRU-order scenario (tests/test_global_lru.py and its GlusterFS twin):
    node A published ``a_keys``, node B ``b_keys``, then B read A's first four and A read
    B's first two. Key -> recency group (0 = least recently used)."""
    return {**{k: 0 for k in a_keys[4:]}, **{k: 1 for k in b_keys[2:]},
            **{k: 2 for k in a_keys[:4]}, **{k: 3 for k in b_keys[:2]}}


def check_lru_order(group: dict[str, int], survivors: set[str], stats: dict,
                    a_keys: list[str], b_keys: list[str]) -> set[str]:
    """That scenario's verdict after A's new stores evicted: every eviction was A's, at
    least 8 files went, A's unread files all went and some of B's, the evicted files are a
    prefix of the global recency order (ties within a group), and the files each node
    read on the other's behalf stayed. Returns the evicted keys."""
    evicted = set(group) - survivors
    assert stats["evicted_files"] == len(evicted), stats  # all evicted by A's stores
    assert len(evicted) >= 8, (evicted, stats)
    assert set(a_keys[4:]) <= evicted and evicted & set(b_keys), evicted  # B's went too
    assert max(group[k] for k in evicted) <= min(group[k] for k in survivors), (
        sorted(evicted), sorted(survivors))
    assert not evicted & set(a_keys[:4] + b_keys[:2])  # read by the other node: kept
    return evicted
