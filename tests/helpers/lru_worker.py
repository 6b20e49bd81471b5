"""Child process of tests/test_global_lru.py: real Layouts of one namespace in real processes.

Modes (argv[1]):

* ``serve ROOT BLOCK_BYTES MAX_DISK RESCAN_S``: reads one JSON command a line on stdin,
  answers one JSON line on stdout: ``{"op": "pub", "keys": [...]}`` (write_block each;
  answer: the keys published), ``{"op": "touch", "keys": [...]}`` (read_block each, i.e. a
  read hit touches the file; answer: the keys hit), ``{"op": "stats"}``, ``{"op": "quit"}``.
* ``churn ROOT BLOCK_BYTES MAX_DISK WID NWORKERS NBLOCKS SEED OUT``: waits for ``ROOT/go``,
  then publishes NBLOCKS blocks ``w<WID>-<i>`` and reads random earlier blocks of any
  worker; writes to OUT the wall time of every publish and read hit (the block's last use
  is the latest of them), the errors and wrong reads, and its layout stats.

Content is derived from the key only (any process can verify any block it reads).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from kvcache_core.layout import Layout, Namespace  # noqa: E402


def make_ns(block_bytes: int) -> Namespace:
    return Namespace(model="lru/model", dtype="bfloat16", block_size=16, block_bytes=block_bytes)


def content(key: bytes, n: int) -> bytes:
    """``n`` bytes derived from ``key`` (cheap: the key repeated)."""
    reps = n // len(key) + 1
    return (key * reps)[:n]


def serve(root: str, block_bytes: int, max_disk: int, rescan_s: float) -> None:
    lay = Layout(root, make_ns(block_bytes), max_disk_bytes=max_disk,
                 rescan_interval_s=rescan_s)
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
        elif op == "stats":
            res = dict(lay.stats.__dict__)
        elif op == "quit":
            lay.close()
            out.write(json.dumps({"res": None}) + "\n")
            out.flush()
            return
        else:
            raise ValueError(op)
        out.write(json.dumps({"res": res}) + "\n")
        out.flush()


def churn(root: str, block_bytes: int, max_disk: int, wid: int, nworkers: int,
          nblocks: int, seed: int, out_path: str) -> None:
    rng = random.Random(seed)
    ns = make_ns(block_bytes)
    lay = Layout(root, ns, max_disk_bytes=max_disk)
    open(os.path.join(root, f"ready-{wid}"), "w").close()
    go = os.path.join(root, "go")
    while not os.path.exists(go):
        time.sleep(0.01)
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
    lay.close()  # joins the evictor thread: its background evictions are counted too
    stats = dict(lay.stats.__dict__)
    with open(out_path, "w") as f:
        json.dump({"pubs": pubs, "hits": hits, "errors": errors, "wrong": wrong,
                   "stats": stats}, f)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "serve":
        serve(args[0], int(args[1]), int(args[2]), float(args[3]))
    elif mode == "churn":
        churn(args[0], int(args[1]), int(args[2]), int(args[3]), int(args[4]), int(args[5]),
              int(args[6]), args[7])
    else:
        raise SystemExit(f"unknown mode {mode}")
