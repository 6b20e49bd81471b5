"""One of several processes sharing a cache root (tests/test_sharing.py).

Usage: share_worker.py ROOT WID NWORKERS MODE ENGINE MAX_DISK SEED

MODE "barrier": store this worker's share of the key universe (each key is owned by two
workers, so stores overlap), print "stored", wait for "go" on stdin, load EVERY key,
verify, print "result JSON".
MODE "churn": for a fixed number of rounds store a random batch and load a random batch
of the universe while the others do the same under a small max_disk_bytes; any load may
miss, an ok load must carry the key's bytes. Print "result JSON".
"""

from __future__ import annotations

import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helpers.kvutil import BLOCK, payload, payload_len, sentinel_buf  # noqa: E402
from kvcache_core.copy import MemcpyCopier  # noqa: E402
from kvcache_core.layout import Layout, Namespace  # noqa: E402
from kvcache_core.reactor import Reactor  # noqa: E402

UNIVERSE = 60
CHURN_UNIVERSE = 90
CHURN_ROUNDS = 60


def say(msg: str) -> None:
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


def key(i: int) -> bytes:
    return f"shared-{i:05d}".encode()


def run_requests(r: Reactor, req_id, kind: str, keys: list[bytes], result: dict) -> None:
    if kind == "store":
        items = []
        for k in keys:
            n = payload_len(k, BLOCK)
            items.append((k, payload(k, n), n))
        r.store(req_id, items)
        r.wait()
        for c in r.poll():
            result["store_failed"] += c.ok.count(False)
        return
    dests = [sentinel_buf(BLOCK) for _ in keys]
    r.load(req_id, [(k, d, payload_len(k, BLOCK)) for k, d in zip(keys, dests, strict=True)])
    r.wait()
    (c,) = r.poll()
    for k, d, ok in zip(keys, dests, c.ok, strict=True):
        n = payload_len(k, BLOCK)
        if ok:
            result["loaded"] += 1
            if bytes(d[:n]) != payload(k, n) or d[n:] != sentinel_buf(BLOCK - n):
                result["wrong"].append(k.decode())
        else:
            result["missed"] += 1
            if d != sentinel_buf(BLOCK):
                result["wrong"].append("failed item wrote its destination: " + k.decode())


def main() -> None:
    root, wid, nworkers, mode, engine, max_disk, seed = sys.argv[1:8]
    wid, nworkers, max_disk, seed = int(wid), int(nworkers), int(max_disk), int(seed)
    ns = Namespace(model="share/model", dtype="bfloat16", block_size=16, block_bytes=BLOCK)
    lay = Layout(root, ns, max_disk_bytes=max_disk)
    r = Reactor(lay, n_slots=6, io_depth=3, engine=engine, copier=MemcpyCopier, pin=False,
                retain=(wid % 2 == 1))
    result = {"wid": wid, "loaded": 0, "missed": 0, "wrong": [], "store_failed": 0}
    rng = random.Random(seed)
    if mode == "barrier":
        mine = [key(i) for i in range(UNIVERSE) if i % nworkers in (wid, (wid + 1) % nworkers)]
        rng.shuffle(mine)
        run_requests(r, "store", "store", mine, result)
        say("stored")
        assert sys.stdin.readline().strip() == "go"
        everything = [key(i) for i in range(UNIVERSE)]
        rng.shuffle(everything)
        run_requests(r, "load", "load", everything, result)
    else:
        for rnd in range(CHURN_ROUNDS):
            batch = [key(rng.randrange(CHURN_UNIVERSE)) for _ in range(6)]
            run_requests(r, ("s", rnd), "store", list(dict.fromkeys(batch)), result)
            batch = [key(rng.randrange(CHURN_UNIVERSE)) for _ in range(8)]
            run_requests(r, ("l", rnd), "load", batch, result)
    r.close()
    result["stats"] = r.snapshot()
    lay.close()
    say("result " + json.dumps(result, default=str))


if __name__ == "__main__":
    main()
