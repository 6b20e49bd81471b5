"""A full filesystem (small tmpfs): stores are dropped and counted, nothing is torn,
published blocks stay loadable and the reactor keeps serving."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
from helpers.kvutil import (
    BLOCK,
    finish,
    list_files,
    payload,
    published_bytes,
    read_ledger,
    sentinel_buf,
)

SIZE_MIB = 8


@pytest.fixture
def small_tmpfs(tmp_path):
    """An 8 MiB tmpfs mounted under tmp_path (unmounted at teardown)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE_MIB}m", "tmpfs",
                          str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root/CAP_SYS_ADMIN): "
                    f"{res.stderr.strip()}")
    yield str(mnt / "root")
    r = subprocess.run(["umount", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:  # something still open: detach so the suite goes on
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        raise AssertionError(f"tmpfs still busy at teardown: {r.stderr.strip()}")


def keys_of(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i:04d}".encode() for i in range(n)]


def _fill(r, keys):
    r.store("fill", [(k, payload(k, BLOCK), BLOCK) for k in keys])
    return finish(r, 60)["fill"]


def test_full_disk_drops_stores_and_keeps_serving(small_tmpfs, make_layout, make_reactor,
                                                   ns):
    lay = make_layout(r=small_tmpfs)
    r = make_reactor(lay, n_slots=6, io_depth=4)
    keys = keys_of("fill", 2 * SIZE_MIB * (1 << 20) // ns.file_bytes)  # twice what fits
    c = _fill(r, keys)  # no exception, one completion with per-item status
    published = [k for k, ok in zip(keys, c.ok, strict=True) if ok]
    dropped = [k for k, ok in zip(keys, c.ok, strict=True) if not ok]
    assert 0 < len(published) < len(keys)
    s = r.stats
    assert s.stores_dropped_enospc > 0, r.snapshot()
    assert s.stores_ok == len(published)
    assert s.stores_ok + s.stores_dropped_enospc + s.stores_error == len(keys)
    finals, temps = list_files(lay.base)
    assert temps == [], f"temp files left after ENOSPC: {temps[:3]}"
    assert len(finals) == len(published)
    assert read_ledger(lay.base) == published_bytes(lay.base)
    for k in dropped:
        assert not lay.exists(k)

    # what was published is intact
    dests = [sentinel_buf(BLOCK) for _ in published]
    r.load("load", [(k, d, BLOCK) for k, d in zip(published, dests, strict=True)])
    assert finish(r)["load"].ok == [True] * len(published)
    for k, d in zip(published, dests, strict=True):
        assert bytes(d) == payload(k, BLOCK)
    assert r.stats.loads_corrupt == 0

    # free some space: the same reactor stores again
    for k in published[:8]:
        lay.remove(k)
    later = keys_of("later", 4)
    r.store("later", [(k, payload(k, BLOCK), BLOCK) for k in later])
    assert finish(r)["later"].ok == [True] * 4
    d = [sentinel_buf(BLOCK) for _ in later]
    r.load("later-load", [(k, x, BLOCK) for k, x in zip(later, d, strict=True)])
    assert finish(r)["later-load"].ok == [True] * 4
    assert all(bytes(x) == payload(k, BLOCK) for k, x in zip(later, d, strict=True))
    assert list_files(lay.base)[1] == []


def test_full_disk_short_writes_count_as_enospc(small_tmpfs, make_layout, make_reactor, ns):
    """When the disk fills in the middle of a file the write returns short; that store
    was dropped for lack of space and must be counted as such, not as an I/O error
    ('write:EIO' in stats.errors would send an operator looking for a failing disk)."""
    lay = make_layout(r=small_tmpfs)
    r = make_reactor(lay, n_slots=6, io_depth=4)
    keys = keys_of("fill", 2 * SIZE_MIB * (1 << 20) // ns.file_bytes)
    c = _fill(r, keys)
    n_dropped = c.ok.count(False)
    assert n_dropped > 0
    assert r.stats.stores_error == 0 and r.stats.errors == {}, r.snapshot()
    assert r.stats.stores_dropped_enospc == n_dropped


def test_write_block_on_full_disk_never_publishes_a_partial_file(small_tmpfs, make_layout,
                                                                  ns):
    """Layout.write_block must fail (or return False) on a full disk, never publish a
    file shorter than what the header announces: the atomic-publish contract."""
    lay = make_layout(r=small_tmpfs)
    keys = keys_of("sync", SIZE_MIB * (1 << 20) // ns.file_bytes + 8)
    outcome = {}
    for k in keys:
        try:
            outcome[k] = lay.write_block(k, payload(k, BLOCK))
        except OSError as e:
            assert e.errno in (errno.ENOSPC, errno.EDQUOT), e
            outcome[k] = False
    assert not all(outcome.values())
    finals, temps = list_files(lay.base)
    assert temps == []
    sizes = {os.path.getsize(p) for p in finals}
    assert sizes == {ns.file_bytes}, f"partial file published under a final name: {sizes}"
    assert read_ledger(lay.base) == published_bytes(lay.base)
    for k, ok in outcome.items():
        assert lay.exists(k) == ok
        if ok:
            assert lay.read_block(k) == payload(k, BLOCK)
