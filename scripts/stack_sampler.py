#!/usr/bin/env python3
"""Sample the stacks of running vLLM engine processes with py-spy, for finding where an
engine's main thread waits (diagnostics for the GPU machine; not used by the product).

    python3 scripts/stack_sampler.py --pyspy PATH --out FILE [--interval 0.25]
        [--match EngineCor ...] [--native]

Every ``--interval`` seconds, for every process whose command line or name contains
``--match``: ``py-spy dump --pid PID`` (``--native``: C frames too, e.g. a thread blocked
in a system call). Each dump is written to ``--out`` after a line ``=== T PID`` where T is
``time.monotonic()`` (CLOCK_MONOTONIC, the clock of the reactor trace and the benchmark's
request times, so a stack lines up with ``scripts/trace_report.py``'s events). Runs until
killed (SIGTERM/SIGINT) or ``--seconds`` elapse; a process that ends between listing and
dumping is skipped. Needs ptrace rights on the engines (root, or the same user with
``kernel.yama.ptrace_scope`` 0).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def engine_pids(match: list[str]) -> list[int]:
    """PIDs (not this process) whose cmdline or comm contains one of ``match``."""
    me, out = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{name}/comm") as f:
                comm = f.read()
        except OSError:
            continue
        if any(m in cmd or m in comm for m in match):
            out.append(int(name))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pyspy", required=True, help="path of the py-spy binary")
    ap.add_argument("--out", required=True, help="file the dumps are appended to")
    ap.add_argument("--interval", type=float, default=0.25, help="seconds between rounds")
    ap.add_argument("--match", action="append", default=None,
                    help="process cmdline/name substring, repeatable (default: EngineCor and "
                    "spawn_main: vLLM's engine core with or without setproctitle)")
    ap.add_argument("--native", action="store_true",
                    help="include native (C) frames (pauses the process for each dump)")
    ap.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0: never)")
    a = ap.parse_args(argv)
    a.match = a.match or ["EngineCor", "spawn_main"]
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    end = time.monotonic() + a.seconds if a.seconds > 0 else float("inf")
    # --native needs the process paused for the dump (py-spy refuses it --nonblocking)
    cmd = [a.pyspy, "dump"] + (["--native"] if a.native else ["--nonblocking"])
    rounds = 0
    with open(a.out, "a") as f:
        while not stop and time.monotonic() < end:
            t_round = time.monotonic()
            for pid in engine_pids(a.match):
                t = time.monotonic()
                try:
                    r = subprocess.run(cmd + ["--pid", str(pid)], capture_output=True,
                                       text=True, timeout=5)
                except (subprocess.TimeoutExpired, OSError) as e:
                    f.write(f"=== {t:.4f} {pid} failed: {e}\n")
                    continue
                if r.returncode == 0:
                    f.write(f"=== {t:.4f} {pid}\n{r.stdout}")
                else:
                    f.write(f"=== {t:.4f} {pid} failed: {r.stderr.strip()[:200]}\n")
            f.flush()
            rounds += 1
            left = a.interval - (time.monotonic() - t_round)
            if left > 0:
                time.sleep(left)
    print(f"stack_sampler: {rounds} rounds", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
