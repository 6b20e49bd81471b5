"""Crash safety: writers killed with SIGKILL at random points never leave a torn file
under a final name, and their temp files are collected by the next process."""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time

import pytest
from helpers.kvutil import (
    HERE,
    REPO,
    header_key,
    list_files,
    payload,
    payload_len,
    published_bytes,
    read_ledger,
)

from kvcache_core.io import uring_available
from kvcache_core.layout import Layout, Namespace

SERVER = os.path.join(HERE, "crash_server.py")
BLOCK_BYTES = 4096  # small files: many publishes per trial
FILE_BYTES = Namespace("x", "x", 1, BLOCK_BYTES).file_bytes
MAX_DISK = 96 * FILE_BYTES  # eviction runs in the writers too
TRIALS = 240
# io_uring mode only where it runs (liburing 2026.3.x dies with SIGILL on some kernels:
# the engine probe falls back to POSIX there, and so do these trials)
MODES = (["reactor-io_uring"] if uring_available()[0] else []) + [
    "reactor-posix", "write_block", "durable"]


def crash_ns() -> Namespace:
    return Namespace(model="crash/model", dtype="bfloat16", block_size=16,
                     block_bytes=BLOCK_BYTES)


class Server:
    def __init__(self, root: str) -> None:
        env = dict(os.environ, PYTHONPATH=REPO)
        self.p = subprocess.Popen([sys.executable, SERVER, root, str(BLOCK_BYTES),
                                   str(MAX_DISK)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, env=env, bufsize=0)
        self._buf = b""

    def send(self, line: str) -> None:
        self.p.stdin.write((line + "\n").encode())
        self.p.stdin.flush()

    def readline(self, timeout: float = 30.0) -> str:
        end = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = end - time.monotonic()
            if left <= 0 or not select.select([self.p.stdout], [], [], left)[0]:
                raise AssertionError(f"crash server silent for {timeout}s")
            chunk = os.read(self.p.stdout.fileno(), 65536)
            if not chunk:
                raise AssertionError(f"crash server exited ({self.p.poll()})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def expect(self, prefix: str) -> list[str]:
        line = self.readline()
        assert line.startswith(prefix), f"expected {prefix!r}, got {line!r}"
        return line.split()

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.send("quit")
                self.p.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait()


@pytest.fixture
def server(tmp_path):
    root = str(tmp_path / "root")
    s = Server(root)
    yield root, s
    s.close()


def _verify_new_files(lay: Layout, verified: set) -> tuple[int, int]:
    """Check every published file not seen before (one directory walk).

    Returns (files checked now, bytes of all published files)."""
    finals, temps = list_files(lay.base)
    assert temps == [], f"temp files left after collect: {temps[:5]}"
    n = 0
    total = 0
    for p in finals:
        try:
            st = os.stat(p)
        except FileNotFoundError:
            continue
        total += st.st_size
        ident = (p, st.st_ino)
        if ident in verified:
            continue
        key = header_key(p)
        assert key is not None, f"{p}: torn header under a final name"
        assert lay.path_for(key) == p, f"{p}: holds key {key!r} of another path"
        data = lay.read_block(key)
        assert data is not None, f"{p}: corrupt/partial file under a final name"
        assert data == payload(key, payload_len(key, BLOCK_BYTES)), f"{p}: wrong content"
        verified.add(ident)
        n += 1
    return n, total


@pytest.mark.slow
def test_sigkill_writers_never_publish_torn_files(server):
    root, srv = server
    ns = crash_ns()
    rng = random.Random(20240601)
    verified: set = set()
    temps_seen = 0
    trials_with_temps = 0
    checked = 0
    base = None
    t0 = time.monotonic()
    for trial in range(TRIALS):
        mode = MODES[trial % len(MODES)]
        srv.send(f"go {mode} {rng.getrandbits(32)}")
        ready = srv.expect("ready")
        pid = int(ready[1])
        time.sleep(rng.uniform(0, 0.05))
        os.kill(pid, signal.SIGKILL)
        reaped = srv.expect("reaped")
        assert reaped[1] == str(pid) and reaped[2] == str(int(signal.SIGKILL)), (
            f"trial {trial} ({mode}): writer did not die by our SIGKILL: {reaped}")

        lay0_base = os.path.join(root, ns.dirname())
        _, temps = list_files(lay0_base)
        temps_seen += len(temps)
        trials_with_temps += bool(temps)
        lay = Layout(root, ns)  # collect=True: the dead writer's temp files go
        try:
            base = lay.base
            assert lay.stats.temp_collected == len(temps), (trial, mode, temps)
            n, total = _verify_new_files(lay, verified)
            checked += n
            assert read_ledger(lay.base) == total, f"trial {trial}: ledger != file sizes"
        finally:
            lay.close()
        assert os.listdir(os.path.join(base, ".writers")) == [], "dead writer entries left"
    elapsed = time.monotonic() - t0
    finals, temps = list_files(base)
    assert temps == []
    assert read_ledger(base) == published_bytes(base)
    # the test really exercised crashes in the middle of writes
    assert checked > TRIALS, f"only {checked} files published in {TRIALS} trials"
    assert trials_with_temps >= 5, f"temp files found after only {trials_with_temps} kills"
    print(f"\n{TRIALS} kills in {elapsed:.1f}s: {checked} files verified, {temps_seen} temp "
          f"files collected after {trials_with_temps} kills, {len(finals)} files remain")


@pytest.mark.slow
def test_live_writer_temps_are_kept_dead_writer_temps_collected(server):
    root, srv = server
    ns = crash_ns()
    srv.send("go hold 1")
    ready = srv.expect("ready")
    pid, tmp = int(ready[1]), ready[2]
    assert os.path.exists(tmp)
    lay = Layout(root, ns)  # the writer is alive: its temp file must stay
    try:
        assert lay.stats.temp_collected == 0
        assert os.path.exists(tmp)
    finally:
        lay.close()
    os.kill(pid, signal.SIGKILL)
    srv.expect("reaped")
    assert os.path.exists(tmp)
    lay = Layout(root, ns, collect=False)  # collect=False leaves it alone
    lay.close()
    assert os.path.exists(tmp)
    lay = Layout(root, ns)
    try:
        assert lay.stats.temp_collected == 1
        assert not os.path.exists(tmp)
        assert os.listdir(os.path.join(lay.base, ".writers")) == [lay._tag]
    finally:
        lay.close()
