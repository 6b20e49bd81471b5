"""EIO and EACCES injected into every file operation of the reactor (load open, read,
store temp-file open, write, close) and into eviction's unlink: the failing item is
counted (``stats.errors``, ``loads_error`` / ``stores_error``), nothing partial is
published, no file descriptor leaks, and the reactor keeps serving the next requests."""

from __future__ import annotations

import errno
import os

import pytest
from helpers.kvutil import BLOCK, finish, list_files, payload, sentinel_buf

from kvcache_core.copy import MemcpyCopier
from kvcache_core.io.posix import PosixEngine
from kvcache_core.reactor import OP_BITS, OP_OPEN, OP_READ, OP_WCLOSE, OP_WOPEN, OP_WRITE, Reactor

MASK = (1 << OP_BITS) - 1


class FaultyEngine(PosixEngine):
    """A POSIX engine that fails the next ``count`` operations of op code ``op`` with
    ``-err`` WITHOUT performing them (so no descriptor is opened or lost)."""

    def __init__(self, depth: int, op: int, err: int, count: int = 1) -> None:
        super().__init__(depth)
        self.op, self.err, self.left = op, err, count

    def _maybe_fail(self, tag: int) -> bool:
        if self.left and tag & MASK == self.op:
            self.left -= 1
            self._done.append((tag, -self.err))
            os.eventfd_write(self._dfd, 1)
            return True
        return False

    def open(self, tag, path, flags, mode=0o600):
        if not self._maybe_fail(tag):
            super().open(tag, path, flags, mode)

    def read(self, tag, fd, iov, offset=0):
        if not self._maybe_fail(tag):
            super().read(tag, fd, iov, offset)

    def write(self, tag, fd, iov, offset=0):
        if not self._maybe_fail(tag):
            super().write(tag, fd, iov, offset)

    def close(self, tag, fd):
        if tag & MASK == self.op and self.left:  # the descriptor is closed all the same
            self.left -= 1
            os.close(fd)
            self._done.append((tag, -self.err))
            os.eventfd_write(self._dfd, 1)
            return
        super().close(tag, fd)


ERRS = [errno.EIO, errno.EACCES]
NAMES = {OP_OPEN: "open", OP_READ: "read", OP_WOPEN: "wopen", OP_WRITE: "write",
         OP_WCLOSE: "wclose"}


def _reactor(lay, eng) -> Reactor:
    return Reactor(lay, n_slots=6, io_depth=4, copier=MemcpyCopier, pin=False, engine=eng)


@pytest.mark.parametrize("err", ERRS, ids=errno.errorcode.get)
@pytest.mark.parametrize("op", [OP_OPEN, OP_READ], ids=NAMES.get)
def test_injected_load_errors_are_counted_misses(make_layout, err, op):
    lay = make_layout()
    keys = [b"a", b"b", b"c"]
    for k in keys:
        assert lay.write_block(k, payload(k, BLOCK))
    r = _reactor(lay, FaultyEngine(4, op, err))
    try:
        dests = [sentinel_buf(BLOCK) for _ in keys]
        r.load("l1", [(k, d, BLOCK) for k, d in zip(keys, dests, strict=True)])
        c = finish(r)["l1"]
        assert c.ok.count(False) == 1 and c.ok.count(True) == 2  # one item failed, alone
        assert r.stats.loads_error == 1
        assert sum(r.stats.errors.values()) == 1
        assert any(errno.errorcode[err] in name for name in r.stats.errors)
        for k, d, ok in zip(keys, dests, c.ok, strict=True):
            if ok:
                assert bytes(d[:BLOCK]) == payload(k, BLOCK)
        # the reactor still serves: the same blocks load now, and the files are intact
        again = [sentinel_buf(BLOCK) for _ in keys]
        r.load("l2", [(k, d, BLOCK) for k, d in zip(keys, again, strict=True)])
        assert finish(r)["l2"].ok == [True] * 3
    finally:
        r.close()
    assert r.dead is None


@pytest.mark.parametrize("err", ERRS, ids=errno.errorcode.get)
@pytest.mark.parametrize("op", [OP_WOPEN, OP_WRITE, OP_WCLOSE], ids=NAMES.get)
def test_injected_store_errors_drop_the_block_and_publish_nothing(make_layout, err, op):
    lay = make_layout()
    r = _reactor(lay, FaultyEngine(4, op, err))
    keys = [b"s0", b"s1", b"s2"]
    try:
        r.store("s1", [(k, payload(k, BLOCK), BLOCK) for k in keys])
        c = finish(r)["s1"]
        assert c.ok.count(False) == 1 and c.ok.count(True) == 2
        assert r.stats.stores_error == 1 and sum(r.stats.errors.values()) == 1
        finals, temps = list_files(lay.base)
        assert len(finals) == 2 and temps == []  # no partial file, no temp left behind
        failed = keys[c.ok.index(False)]
        assert not lay.exists(failed)
        for k, ok in zip(keys, c.ok, strict=True):
            if ok:
                assert lay.read_block(k) == payload(k, BLOCK)
        # the reactor keeps serving: the dropped block stores now
        r.store("s2", [(failed, payload(failed, BLOCK), BLOCK)])
        assert finish(r)["s2"].ok == [True]
        assert lay.read_block(failed) == payload(failed, BLOCK)
    finally:
        r.close()
    assert r.dead is None


@pytest.mark.parametrize("op", ["rename", "unlink"])
@pytest.mark.parametrize("err", ERRS, ids=errno.errorcode.get)
def test_injected_unlink_errors_in_eviction_are_counted(make_layout, monkeypatch, err, op):
    """Eviction that cannot remove a file (EIO, or EACCES in a root shared by several
    users) skips it, counts it and keeps going; the bound still holds. Eviction renames
    the file away under the ledger lock and the evictor thread unlinks it later: an
    error in either step is counted (``unlink_errors``)."""
    import kvcache_core.layout as L

    lay = make_layout(max_disk_bytes=4 * lay_file_bytes(make_layout))
    real = getattr(os, op)
    state = {"left": 1}

    def flaky(path, *a, **kw):
        # rename: the eviction of a published file; unlink: the removal of one that
        # eviction renamed to a temp name (publish's own temp unlinks are left alone)
        hit = ("/.tmp." not in path if op == "rename"
               else "/.tmp." in path and path in lay._evicted_names)
        if state["left"] and hit and not path.endswith(".usage"):
            state["left"] -= 1
            raise OSError(err, os.strerror(err), path)
        return real(path, *a, **kw)

    lay._evicted_names = set()
    real_rename = os.rename

    def note(src, dst, *a, **kw):
        lay._evicted_names.add(dst)
        return real_rename(src, dst, *a, **kw)

    monkeypatch.setattr(L.os, "rename", note)
    monkeypatch.setattr(L.os, op, flaky)
    for i in range(12):
        lay.write_block(f"e{i}".encode(), payload(b"e", BLOCK))
    lay._drain_evicted()  # what the evictor thread does (it may have done it already)
    assert lay.stats.unlink_errors >= 1 and lay.stats.evicted_files > 0
    assert lay.ledger.get() <= lay.max_disk_bytes


def lay_file_bytes(make_layout) -> int:
    probe = make_layout()
    return probe.ns.file_bytes


def test_vanished_shard_directory_is_made_again(make_layout):
    """A shard directory removed after this process made it (``kvcache purge``/gc, or a
    GlusterFS client whose mkdir lost a race keeps a stale entry): the temp-file create
    fails with ENOENT once, the directory is made again and the store succeeds."""
    import shutil

    lay = make_layout()
    r = _reactor(lay, PosixEngine(4))
    try:
        r.store("a", [(b"k", payload(b"k", BLOCK), BLOCK)])
        assert finish(r)["a"].ok == [True]
        shard = os.path.dirname(os.path.dirname(lay.path_for(b"k")))
        shutil.rmtree(shard)  # the whole ab/ level, under the layout's feet
        r.store("b", [(b"k", payload(b"k", BLOCK), BLOCK)])
        assert finish(r)["b"].ok == [True]
        assert r.stats.temp_reopens == 1 and r.stats.stores_error == 0
        assert lay.read_block(b"k") == payload(b"k", BLOCK)
    finally:
        r.close()


@pytest.mark.parametrize("err", [errno.ENOENT, errno.ESTALE], ids=errno.errorcode.get)
def test_temp_create_retried_once_then_counted(make_layout, err):
    lay = make_layout()
    r = _reactor(lay, FaultyEngine(4, OP_WOPEN, err, count=3))
    try:
        r.store("s", [(b"x", payload(b"x", BLOCK), BLOCK)])
        assert finish(r)["s"].ok == [False]  # failed again after its one retry
        assert r.stats.temp_reopens == 1 and r.stats.stores_error == 1
        r.store("t", [(b"y", payload(b"y", BLOCK), BLOCK)])  # 1 injected failure left
        assert finish(r)["t"].ok == [True]
        assert r.stats.temp_reopens == 2
    finally:
        r.close()
