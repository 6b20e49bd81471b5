#!/usr/bin/env python3
"""Kill -9 torn-file trial: no partial block is ever visible under a final name, and the
temp files a killed writer leaves are collected by the next process that opens the layout.

Each trial: a fresh root; a writer process opens a Layout (``max_disk_bytes`` small
enough that eviction runs too) and publishes 256 KiB blocks in a loop (``write_block``:
temp file, write, hard link / rename, unlink temp, ledger add; eviction under the ledger
lock); once it reports ready, it is sent SIGKILL after a random delay. Then, in this
process:

1. every file under a final name is read and validated by the layout itself
   (:meth:`LayoutIndex.check_block` with ``verify=True``: header hash, namespace, key,
   length, payload xxh3) and its name checked against its key: a failure is a TORN file;
2. the temp files (``.tmp.*``) left in the root are counted;
3. a new Layout is opened (as a restarted process would): it must remove every one of
   them (``stats.temp_collected``), leave no temp file and no writer entry of the dead
   process, and resync the ledger to the bytes of the published files.

Usage::

    python scripts/reliability_kill9.py --trials 1000 --json reliability.json

Exit status 0 when every trial passed (0 torn files, every temp collected, exact ledger).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from kvcache_core.layout import (  # noqa: E402
    HEADER_BYTES,
    HEADER_FMT,
    TMP_PREFIX,
    CorruptBlock,
    Layout,
    LayoutIndex,
    Namespace,
)

BLOCK_BYTES = 256 * 1024
NS = Namespace(model="kill9/model", dtype="bfloat16", block_size=16, block_bytes=BLOCK_BYTES)
MAX_DISK = 24 * NS.file_bytes

_WRITER = r"""
import os, sys
sys.path.insert(0, %(repo)r)
from kvcache_core.layout import Layout, Namespace
ns = Namespace(model="kill9/model", dtype="bfloat16", block_size=16, block_bytes=%(bb)d)
lay = Layout(sys.argv[1], ns, max_disk_bytes=%(max_disk)d, publish_method=sys.argv[2])
os.write(1, b"R")
i = 0
while True:
    key = b"k%%d.%%d" %% (int(sys.argv[3]), i)
    n = %(bb)d if i %% 3 else 1 + (i * 7919) %% %(bb)d
    lay.write_block(key, (key * (n // len(key) + 1))[:n])
    i += 1
"""


def _walk(base: str) -> tuple[list[str], list[str]]:
    """(final files, temp files) in the namespace's shard directories."""
    finals: list[str] = []
    temps: list[str] = []
    if not os.path.isdir(base):
        return finals, temps
    for top in os.scandir(base):
        if top.name.startswith(".") or not top.is_dir(follow_symlinks=False):
            continue
        for sub in os.scandir(top.path):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for e in os.scandir(sub.path):
                (temps if e.name.startswith(TMP_PREFIX) else finals).append(e.path)
    return finals, temps


def check_final(index: LayoutIndex, path: str) -> str | None:
    """None if ``path`` is a complete, valid block of its key; else why not."""
    with open(path, "rb") as f:
        data = f.read(NS.file_bytes + 1)
    mv = memoryview(data)
    if len(data) < HEADER_FMT.size:
        return f"short header ({len(data)} bytes)"
    fields = HEADER_FMT.unpack_from(mv, 0)
    key = bytes(fields[7][: fields[6]])
    if index.name_of(key) != os.path.basename(path):
        return "name does not match the key in the header"
    try:
        n = index.check_block(mv, len(data), key, verify=True)
    except CorruptBlock as e:
        return str(e)
    if bytes(mv[HEADER_BYTES: HEADER_BYTES + n]) != (key * (n // len(key) + 1))[:n]:
        return "payload differs from the key's content"
    return None


def trial(i: int, rng: random.Random, workdir: str, max_delay: float) -> dict:
    root = os.path.join(workdir, f"t{i}")
    method = "rename" if i % 4 == 3 else "link"
    src = _WRITER % {"repo": REPO, "bb": BLOCK_BYTES, "max_disk": MAX_DISK}
    p = subprocess.Popen([sys.executable, "-c", src, root, method, str(i)],
                         stdout=subprocess.PIPE)
    try:
        ready = p.stdout.read(1) == b"R"
        delay = rng.uniform(0.0, max_delay)
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        rc = p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
    base = os.path.join(root, NS.dirname())
    finals, temps = _walk(base)
    index = LayoutIndex(root, NS)
    torn = []
    for f in finals:
        why = check_final(index, f)
        if why is not None:
            torn.append(f"{f}: {why}")
    lay = Layout(root, NS, max_disk_bytes=MAX_DISK)  # the restarted process
    try:
        collected = lay.stats.temp_collected
        finals2, temps2 = _walk(base)
        ledger = lay.ledger.get()
    finally:
        lay.close()
    on_disk = sum(os.lstat(f).st_size for f in finals2)
    writers_left = os.listdir(os.path.join(base, ".writers"))
    ok = (ready and rc == -signal.SIGKILL and not torn and collected == len(temps)
          and not temps2 and ledger == on_disk and not writers_left)
    shutil.rmtree(root, ignore_errors=True)
    return {"trial": i, "method": method, "ready": ready, "rc": rc,
            "delay_s": round(delay, 4), "finals": len(finals), "torn": torn,
            "temps_seen": len(temps), "temps_collected": collected,
            "temps_left": len(temps2), "ledger_exact": ledger == on_disk,
            "writers_left": len(writers_left), "ok": ok}


def run(trials: int, seed: int = 0, max_delay: float = 0.3, workdir: str | None = None,
        progress: bool = False) -> dict:
    """Run ``trials`` trials; returns the summary (``failures`` lists the bad trials)."""
    rng = random.Random(seed)
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="kvcache-kill9-")
    t0 = time.monotonic()
    results = []
    try:
        for i in range(trials):
            results.append(trial(i, rng, workdir, max_delay))
            if progress and (i + 1) % 50 == 0:
                print(f"{i + 1}/{trials} trials, {time.monotonic() - t0:.0f} s",
                      file=sys.stderr, flush=True)
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    wall = time.monotonic() - t0
    return {
        "trials": trials,
        "seed": seed,
        "max_kill_delay_s": max_delay,
        "block_bytes": BLOCK_BYTES,
        "max_disk_bytes": MAX_DISK,
        "final_files_checked": sum(r["finals"] for r in results),
        "torn_files_visible": sum(len(r["torn"]) for r in results),
        "trials_with_temp_left_by_kill": sum(1 for r in results if r["temps_seen"]),
        "temp_files_left_by_kill": sum(r["temps_seen"] for r in results),
        "temp_files_collected": sum(r["temps_collected"] for r in results),
        "temp_files_left_after_reopen": sum(r["temps_left"] for r in results),
        "ledger_exact_after_reopen": sum(1 for r in results if r["ledger_exact"]),
        "trials_rename": sum(1 for r in results if r["method"] == "rename"),
        "failures": [r for r in results if not r["ok"]],
        "wall_s": round(wall, 1),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, "
                   f"Python {platform.python_version()}",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-delay", type=float, default=0.3,
                    help="SIGKILL after uniform(0, MAX_DELAY) s once the writer is ready")
    ap.add_argument("--workdir", help="where trial roots are made (default: a temp dir)")
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args(argv)
    summary = run(args.trials, args.seed, args.max_delay, args.workdir, progress=True)
    text = json.dumps(summary, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0 if not summary["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
