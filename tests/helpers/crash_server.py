"""Fork server for the crash tests (one interpreter start for many trials).

Usage: crash_server.py ROOT BLOCK_BYTES MAX_DISK_BYTES

Commands on stdin, one per line:
  go MODE SEED   fork a writer; it prints "ready PID" and writes blocks with random keys
                 until it is killed; the server then prints "reaped PID STATUS".
                 MODE: reactor-io_uring | reactor-posix | write_block | durable | hold
                 ("hold": create one temp file and sleep, a live writer for collect tests)
  quit           exit.
Every block's content and length are derived from its key (helpers.kvutil.payload), so
the parent can verify any published file.
"""

from __future__ import annotations

import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helpers.kvutil import payload, payload_len  # noqa: E402
from kvcache_core.copy import MemcpyCopier  # noqa: E402
from kvcache_core.layout import Layout, Namespace  # noqa: E402
from kvcache_core.reactor import Reactor  # noqa: E402

NS_MODEL = "crash/model"


def say(msg: str) -> None:
    os.write(1, (msg + "\n").encode())


def namespace(block_bytes: int) -> Namespace:
    return Namespace(model=NS_MODEL, dtype="bfloat16", block_size=16, block_bytes=block_bytes)


def worker(root: str, block_bytes: int, max_disk: int, mode: str, seed: int) -> None:
    rng = random.Random(seed)
    ns = namespace(block_bytes)
    lay = Layout(root, ns, collect=False, max_disk_bytes=max_disk, durable=(mode == "durable"))
    if mode == "hold":
        tmp, _ = lay.temp_path_for(b"held-temp")
        with open(tmp, "wb") as f:
            f.write(b"partial")
        say(f"ready {os.getpid()} {tmp}")
        while True:
            time.sleep(1)
    r = None
    if mode != "write_block":
        # durable: the best engine here (io_uring where it runs, else POSIX)
        engine = {"reactor-posix": "posix", "reactor-io_uring": "io_uring"}.get(mode, "auto")
        r = Reactor(lay, n_slots=6, io_depth=4, engine=engine, copier=MemcpyCopier, pin=False)
    say(f"ready {os.getpid()}")
    n = 0
    while True:
        if r is None:
            k = b"crash-%016x" % rng.getrandbits(64)
            lay.write_block(k, payload(k, payload_len(k, block_bytes)))
            n += 1
            continue
        items = []
        for _ in range(8):
            k = b"crash-%016x" % rng.getrandbits(64)
            ln = payload_len(k, block_bytes)
            items.append((k, payload(k, ln), ln))
        r.store(n, items)
        r.wait()
        for c in r.poll():
            if not all(c.ok):
                say(f"error store failed {c} {r.snapshot()}")
        n += 1


def main() -> None:
    root, block_bytes, max_disk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "quit":
            return
        mode, seed = cmd[1], int(cmd[2])
        pid = os.fork()
        if pid == 0:
            try:
                worker(root, block_bytes, max_disk, mode, seed)
            except BaseException as e:  # report anything to the parent
                say(f"error {type(e).__name__}: {e}")
            finally:
                os._exit(3)
        _, status = os.waitpid(pid, 0)
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
        say(f"reaped {pid} {sig}")


if __name__ == "__main__":
    main()
