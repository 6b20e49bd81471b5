"""Helpers shared by the tests and the child processes (no pytest import here).

Content is derived from the key only, so any process can verify any block it reads.
"""

from __future__ import annotations

import os
import random
import stat
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
REPO = os.path.dirname(TESTS)

if REPO not in sys.path:  # children started as plain scripts
    sys.path.insert(0, REPO)

from kvcache_core.copy import MemcpyCopier  # noqa: E402
from kvcache_core.layout import HEADER_BYTES, HEADER_FMT, TMP_PREFIX  # noqa: E402
from kvcache_core.reactor import Completion, Reactor  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20
BLOCK = 64 * KiB
SENTINEL = 0xEE


def load_script(name: str):
    """Import ``scripts/<name>.py`` (not a package) as a module, for its tests."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts",
                                                                     f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # registered first, as an import does (dataclasses need it)
    spec.loader.exec_module(mod)
    return mod


def payload(key: bytes, n: int) -> bytes:
    """Deterministic pseudo-random ``n`` bytes for ``key``."""
    return random.Random(b"kvtest:" + key).randbytes(n)


def payload_len(key: bytes, block_bytes: int) -> int:
    """Deterministic payload length in [1, block_bytes] (full blocks most of the time)."""
    r = random.Random(b"len:" + key)
    return block_bytes if r.random() < 0.5 else r.randint(1, block_bytes)


def sentinel_buf(n: int) -> bytearray:
    return bytearray([SENTINEL]) * n


def list_files(base: str) -> tuple[list[str], list[str]]:
    """(published files, temp files) under a namespace directory."""
    finals: list[str] = []
    temps: list[str] = []
    if not os.path.isdir(base):
        return finals, temps
    for top in os.scandir(base):
        if not top.is_dir() or top.name.startswith("."):
            continue
        for sub in os.scandir(top.path):
            if not sub.is_dir():
                continue
            for e in os.scandir(sub.path):
                (temps if e.name.startswith(TMP_PREFIX) else finals).append(e.path)
    return finals, temps


def tree_snapshot(top: str) -> dict[str, tuple]:
    """Every entry under ``top`` (links not followed): type, mode, size, mtime, content;
    two equal snapshots mean nothing under ``top`` changed."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for n in [*dirnames, *filenames, ""]:
            p = os.path.join(dirpath, n) if n else dirpath
            st = os.lstat(p)
            data = None
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    data = f.read()
            out[p] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_size,
                      st.st_mtime_ns, data)
    return out


def published_bytes(base: str) -> int:
    finals, _ = list_files(base)
    total = 0
    for p in finals:
        try:
            total += os.stat(p).st_size
        except FileNotFoundError:
            pass
    return total


def read_ledger(base: str) -> int:
    """The raw ``.usage`` ledger value (no lock: call when no writer is running)."""
    with open(os.path.join(base, ".usage"), "rb") as f:
        raw = f.read(8)
    return int.from_bytes(raw, "little", signed=True) if len(raw) == 8 else 0


def header_key(path: str) -> bytes | None:
    """The key recorded in a file's header, or None if the header is unreadable."""
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_FMT.size:
        return None
    fields = HEADER_FMT.unpack_from(raw, 0)
    klen, kbytes = fields[6], fields[7]
    return bytes(kbytes[:klen])


def open_fds_under(path: str) -> list[str]:
    """Targets of this process's open fds that lie under ``path``."""
    out = []
    fd_dir = f"/proc/{os.getpid()}/fd"
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:
            continue
        if target.startswith(path):
            out.append(target)
    return out


class GatedCopier(MemcpyCopier):
    """A real (memcpy) copier whose load copies complete only when a gate opens.

    Copies to a destination listed in ``gated`` return a handle that stays not-done
    until ``gate`` is set: this models a slow device copy holding its staging slot, so
    tests can hold slots deterministically without sleeping.
    """

    asynchronous = True

    def __init__(self, pool, offset, gate: threading.Event, gated: set[int]) -> None:
        super().__init__(pool, offset)
        self.gate = gate
        self.gated = gated

    def to_device(self, slots, dests, nbytes):
        super().to_device(slots, dests, nbytes)
        if any(id(d) in self.gated for d in dests):
            return self.gate
        return None

    def done(self, handle) -> bool:
        return handle is None or handle.is_set()


def gated_copier_factory(gate: threading.Event, gated: set[int]):
    def make(pool, offset):
        return GatedCopier(pool, offset, gate, gated)

    return make


def close_reactor(r: Reactor) -> bool:
    """Close a reactor without hanging the suite if a bug left requests outstanding.

    Returns False if it had to be stopped by force (its fds may then stay open)."""
    if not r._running:
        return True
    if r._thread.is_alive() and r.wait(timeout=5):
        r.close()
        return True
    # The reactor thread died or a request never completed (a bug the test reports):
    # stop it by force so that the rest of the suite can run.
    r._running = False
    r.engine.wake()
    r._thread.join(timeout=5)
    r.engine.shutdown()
    r.pool.close()
    return False


def finish(r: Reactor, timeout: float = 30.0) -> dict:
    """Wait for every submitted request; return {req_id: Completion}."""
    assert r.wait(timeout), f"requests did not complete within {timeout}s: {r.snapshot()}"
    out: dict = {}
    for c in r.poll():
        assert isinstance(c, Completion)
        assert c.req_id not in out, f"request {c.req_id!r} completed twice"
        out[c.req_id] = c
    return out


class Collector:
    """``on_complete`` callback that lets a test wait for one request's completion."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self.done: dict = {}
        self.duplicates: list = []

    def __call__(self, c: Completion) -> None:
        with self._cv:
            if c.req_id in self.done:
                self.duplicates.append(c.req_id)
            self.done[c.req_id] = c
            self._cv.notify_all()

    def get(self, req_id, timeout: float = 30.0) -> Completion | None:
        with self._cv:
            self._cv.wait_for(lambda: req_id in self.done, timeout)
            return self.done.get(req_id)


def wait_until(pred, timeout: float = 10.0, interval: float = 0.001) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return pred()


class GatedWriteEngine:
    """Factory for a POSIX engine whose WRITE completions are withheld from the reactor
    until ``gate`` is set: to the reactor the disk is stalled (the bytes may be in the temp
    file, but the write never "finishes", so nothing is published and the write keeps its
    ``io_depth`` unit and its slot). Reads, opens and closes complete normally. After
    setting the gate, call ``engine.wake()``."""

    def __new__(cls, depth: int, gate: threading.Event):
        from kvcache_core.io.posix import PosixEngine
        from kvcache_core.reactor import OP_BITS, OP_WRITE

        class _Gated(PosixEngine):
            def __init__(self) -> None:
                super().__init__(depth)
                self.held: list[tuple[int, int]] = []
                self.writes_seen = 0

            def write(self, tag, fd, iov, offset=0):
                self.writes_seen += 1
                super().write(tag, fd, iov, offset)

            def reap(self, out):
                n0 = len(out)
                super().reap(out)
                if gate.is_set():
                    out.extend(self.held)
                    self.held.clear()
                    return len(out) - n0
                mine = out[n0:]
                del out[n0:]
                for tag, res in mine:
                    (self.held if tag & ((1 << OP_BITS) - 1) == OP_WRITE else out).append(
                        (tag, res))
                return len(out) - n0

            def wait(self, timeout_s):
                if gate.is_set() and self.held:
                    return
                super().wait(timeout_s if timeout_s is not None else 0.05)

        return _Gated()


class GatedReadEngine:
    """Factory for a POSIX engine whose READ completions of files whose path ends with
    one of ``gated_suffixes`` are withheld until ``gate`` is set: to the reactor those
    reads are stuck on a slow disk (they keep their ``io_depth`` unit and slot), while
    every other operation completes normally. After setting the gate, call
    ``engine.wake()``."""

    def __new__(cls, depth: int, gate: threading.Event, gated_suffixes: set[str]):
        from kvcache_core.io.posix import PosixEngine
        from kvcache_core.reactor import OP_BITS, OP_OPEN, OP_READ

        mask = (1 << OP_BITS) - 1

        class _Gated(PosixEngine):
            def __init__(self) -> None:
                super().__init__(depth)
                self.held: list[tuple[int, int]] = []
                self._open_path: dict[int, str] = {}
                self._gated_fds: set[int] = set()
                self._gated_tags: set[int] = set()

            def open(self, tag, path, flags, mode=0o644):
                if tag & mask == OP_OPEN and any(path.endswith(s) for s in gated_suffixes):
                    self._open_path[tag] = path
                super().open(tag, path, flags, mode)

            def read(self, tag, fd, iov, offset=0):
                if fd in self._gated_fds:
                    self._gated_tags.add(tag)
                super().read(tag, fd, iov, offset)

            def reap(self, out):
                n0 = len(out)
                super().reap(out)
                mine = out[n0:]
                del out[n0:]
                for tag, res in mine:
                    if tag in self._open_path and res >= 0:
                        del self._open_path[tag]
                        self._gated_fds.add(res)
                    if tag & mask == OP_READ and tag in self._gated_tags and not gate.is_set():
                        self.held.append((tag, res))
                    else:
                        out.append((tag, res))
                if gate.is_set() and self.held:
                    out.extend(self.held)
                    self.held.clear()
                return len(out) - n0

            def close(self, tag, fd):
                self._gated_fds.discard(fd)
                super().close(tag, fd)

            def wait(self, timeout_s):
                if gate.is_set() and self.held:
                    return
                super().wait(timeout_s if timeout_s is not None else 0.05)

        return _Gated()


def assert_config_error_names_key(key: str, value: object) -> None:
    """``{key: value}`` is refused by StorageConfig, from a dict and from JSON, with a
    ConfigError that names the key."""
    import json

    import pytest

    from kvcache_core.config import ConfigError, StorageConfig

    with pytest.raises(ConfigError) as ei:
        StorageConfig.from_dict({key: value})
    assert f"'{key}'" in str(ei.value), str(ei.value)
    with pytest.raises(ConfigError, match=f"'{key}'"):
        StorageConfig.from_json(json.dumps({key: value}))
