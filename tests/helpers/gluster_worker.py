"""A writer or reader process on one GlusterFS mount (tests/test_glusterfs.py).

Usage::

    gluster_worker.py writer ROOT METHOD KEYS_JSON SHARED_JSON PUBLOG
    gluster_worker.py reader ROOT KEYS_JSON PUBLOG DONE_FLAG GRACE_S SEED

Both print "ready" once their Layout / LayoutIndex is open and wait for "go" on stdin.

writer: publishes KEYS_JSON in order through the real :class:`Layout` (``publish_method``
METHOD). Keys also in SHARED_JSON are written the way the reactor does it (temp file,
then :meth:`Layout.publish`), so two writers on two mounts race inside ``publish`` for
them; the others go through :meth:`Layout.write_block`. After each publish that this
writer won it appends "KEY WALLTIME" to PUBLOG (a local file, not on the volume). Prints
"result JSON": the keys it published, the keys that existed, its Layout stats.

reader (on the OTHER mount): follows PUBLOG and looks up + reads each key published
there until it is visible (bounded by GRACE_S after DONE_FLAG appears), re-reads a sample
of the keys already seen and probes a sample of all keys. A read is either absent (no
file) or a complete, correct block (:meth:`LayoutIndex.check_block` with the payload
checksum, then the bytes against ``payload(key, n)``); anything else is recorded as bad.
At the end it reads every key of KEYS_JSON once more (all must be there and correct).
Prints "result JSON": visibility lag of each followed key, bad reads, keys that vanished
after being seen, followed keys never seen, keys missing in the final sweep.
"""

from __future__ import annotations

import errno
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helpers.kvutil import payload, payload_len  # noqa: E402
from kvcache_core.layout import (  # noqa: E402
    HEADER_BYTES,
    CorruptBlock,
    Layout,
    LayoutIndex,
    Namespace,
)

BLOCK_BYTES = 16 << 10
NS = Namespace(model="gluster/model", dtype="bfloat16", block_size=16,
               block_bytes=BLOCK_BYTES)


def say(msg: str) -> None:
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


def wait_go() -> None:
    say("ready")
    line = sys.stdin.readline().strip()
    if line != "go":
        raise SystemExit(f"expected go, got {line!r}")


def publish_racing(lay: Layout, key: bytes) -> bool:
    """Temp file + publish, without write_block's existence shortcut (the reactor's path)."""
    n = payload_len(key, BLOCK_BYTES)
    buf = bytearray(lay.ns.file_bytes)
    mv = memoryview(buf)
    mv[HEADER_BYTES: HEADER_BYTES + n] = payload(key, n)
    total = lay.fill_header(mv, key, n)
    fd, tmp, final = lay.create_temp(key)
    try:
        done = os.write(fd, mv[:total])
        if done != total:
            raise OSError(errno.ENOSPC, f"short write {done} of {total}")
    finally:
        os.close(fd)
    return lay.publish(tmp, final, total)


def writer(root: str, method: str, keys_file: str, shared_file: str, publog: str) -> None:
    with open(keys_file) as f:
        keys = [k.encode() for k in json.load(f)]
    with open(shared_file) as f:
        shared = {k.encode() for k in json.load(f)}
    lay = Layout(root, NS, publish_method=method)
    log = open(publog, "a", buffering=1)  # noqa: SIM115 (line buffered, closed below)
    wait_go()
    published: list[str] = []
    existing: list[str] = []
    t0 = time.monotonic()
    for k in keys:
        if k in shared:
            ok = publish_racing(lay, k)
        else:
            n = payload_len(k, BLOCK_BYTES)
            ok = lay.write_block(k, payload(k, n))
        if ok:
            log.write(f"{k.decode()} {time.time():.6f}\n")
            published.append(k.decode())
        else:
            existing.append(k.decode())
    elapsed = time.monotonic() - t0
    log.close()
    stats = vars(lay.stats).copy()
    method_used = lay.publish_method
    lay.close()
    say("result " + json.dumps({"published": published, "existing": existing,
                                "stats": stats, "method": method_used,
                                "elapsed_s": elapsed}))


def reader(root: str, keys_file: str, publog: str, flag: str, grace: float,
           seed: int) -> None:
    with open(keys_file) as f:
        keys = [k.encode() for k in json.load(f)]
    idx = LayoutIndex(root, NS)
    rng = random.Random(seed)
    bad: list[str] = []
    vanished: list[str] = []
    lag: dict[str, float] = {}
    seen: list[bytes] = []
    watch: dict[bytes, float] = {}  # published on the other mount, not visible here yet
    reads = lookups = 0
    buf = bytearray(NS.file_bytes + 4096)

    def check(k: bytes) -> bool:
        """True: complete and correct; False: absent; a bad read is recorded."""
        nonlocal reads, lookups
        lookups += 1
        if not idx.exists(k):
            return False
        try:
            fd = os.open(idx.path_for(k), os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            nread = os.readv(fd, [buf])
        finally:
            os.close(fd)
        reads += 1
        mv = memoryview(buf)
        try:
            n = idx.check_block(mv, nread, k, verify=True)
        except CorruptBlock as e:
            bad.append(f"{k.decode()}: {e} ({nread} bytes read)")
            return True
        want = payload_len(k, BLOCK_BYTES)
        if n != want or bytes(mv[HEADER_BYTES: HEADER_BYTES + n]) != payload(k, want):
            bad.append(f"{k.decode()}: wrong payload ({n} bytes)")
        return True

    wait_go()
    done_at = None
    partial = ""
    with open(publog) as logf:
        while True:
            if done_at is None and os.path.exists(flag):
                done_at = time.monotonic()
            chunk = logf.read()  # new publishes of the other mount's writer
            if chunk:
                partial += chunk
                *lines, partial = partial.split("\n")
                for ln in lines:
                    k, t = ln.split()
                    watch[k.encode()] = float(t)
            if done_at is not None and not chunk and not watch:
                break
            if done_at is not None and time.monotonic() > done_at + grace:
                break
            for k in list(watch):
                if check(k):
                    lag[k.decode()] = max(0.0, time.time() - watch.pop(k))
                    seen.append(k)
            for k in rng.sample(seen, min(8, len(seen))):  # seen blocks stay complete
                if not check(k):
                    vanished.append(k.decode())
            for k in rng.sample(keys, 8):  # any key: absent or complete, never partial
                check(k)
            if not watch:
                time.sleep(0.002)
    missing = [k.decode() for k in keys if not check(k)]  # final sweep: all, all correct
    say("result " + json.dumps({
        "lag": lag, "bad": bad[:50], "n_bad": len(bad), "vanished": vanished[:50],
        "n_vanished": len(vanished), "never_seen": [k.decode() for k in watch][:50],
        "n_never_seen": len(watch), "missing": missing[:50], "n_missing": len(missing),
        "reads": reads, "lookups": lookups}))


def main() -> None:
    role = sys.argv[1]
    if role == "writer":
        writer(*sys.argv[2:7])
    elif role == "reader":
        reader(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], float(sys.argv[6]),
               int(sys.argv[7]))
    else:
        raise SystemExit(f"unknown role {role}")


if __name__ == "__main__":
    main()
