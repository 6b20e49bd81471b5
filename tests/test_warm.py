"""The start-up warm-up of the cache directory's metadata (``disk_warm_start``,
:mod:`kvcache_core.warm`): real files written by the storage layer, real directories.

What it is for (lookups after ``drop_caches`` reading directory blocks from a busy disk)
needs the GPU machine's disk to measure; here: it finds every published file of every
rank's namespace, waits for a namespace directory the workers create later, skips what
it cannot read without raising, stops on close, and is started by the vLLM manager
only when asked."""

from __future__ import annotations

import os
import time

import pytest

from kvcache_core.layout import Layout, Namespace
from kvcache_core.warm import DirWarmer


def _publish(root: str, ns: Namespace, n: int, salt: bytes = b"") -> Layout:
    lay = Layout(root, ns)
    for i in range(n):
        assert lay.write_block(salt + i.to_bytes(8, "little"), bytes(ns.block_bytes))
    return lay


def _run(bases, **kw) -> tuple[DirWarmer, list[tuple[int, int, int, int]]]:
    got: list[tuple[int, int, int, int]] = []
    w = DirWarmer(bases, lambda *a: got.append(a), **kw)
    assert w.finished.wait(30)
    return w, got


def test_warm_up_reads_every_published_file_of_every_rank(tmp_path):
    nss = [Namespace("m", "bf16", 16, 4096, tp_rank=r, tp_size=2) for r in range(2)]
    lays = [_publish(str(tmp_path), ns, 40) for ns in nss]
    w, got = _run([lay.base for lay in lays])
    assert len(got) == 1
    n_files, n_dirs, errors, us = got[0]
    # every block file (and nothing of the namespace's own bookkeeping: only the
    # two-hex-digit fan-out directories are walked)
    assert n_files == 80, n_files
    assert errors == 0 and us > 0
    leaves = {os.path.dirname(lay.path_for(i.to_bytes(8, "little")))
              for lay in lays for i in range(40)}
    tops = {os.path.dirname(d) for d in leaves}
    assert n_dirs == len(leaves) + len(tops) + 2  # + the two namespace directories
    assert (w.files, w.dirs, w.errors) == (n_files, n_dirs, errors)
    for lay in lays:
        lay.close()


def test_warm_up_waits_for_the_namespace_directory_and_gives_up_in_time(tmp_path):
    ns = Namespace("m", "bf16", 16, 4096)
    base = os.path.join(str(tmp_path), ns.dirname())
    got: list[tuple[int, int, int, int]] = []
    w = DirWarmer([base], lambda *a: got.append(a), wait_s=20)
    time.sleep(0.3)
    assert not w.finished.is_set()  # the workers have not created it yet
    # the namespace appears whole (written elsewhere, renamed into place), so that
    # the count does not race the writes
    lay = _publish(str(tmp_path / "elsewhere"), ns, 5)
    lay.close()
    os.rename(lay.base, base)
    assert w.finished.wait(20)
    assert got[0][0] == 5
    # a namespace that never appears: the warm-up gives up after wait_s, and close()
    # stops a waiting warm-up at once
    t0 = time.monotonic()
    _, got = _run([os.path.join(str(tmp_path), "never")], wait_s=0.3)
    assert got[0][:3] == (0, 0, 0) and time.monotonic() - t0 < 5
    w = DirWarmer([os.path.join(str(tmp_path), "never")], wait_s=60)
    t0 = time.monotonic()
    w.close()
    assert w.finished.is_set() and time.monotonic() - t0 < 2


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_warm_up_skips_unreadable_directories(tmp_path):
    ns = Namespace("m", "bf16", 16, 4096)
    lay = _publish(str(tmp_path), ns, 30)
    leaf = os.path.dirname(lay.path_for((0).to_bytes(8, "little")))
    os.chmod(leaf, 0)
    try:
        _, got = _run([lay.base])
    finally:
        os.chmod(leaf, 0o700)
    n_files, _, errors, _ = got[0]
    assert errors == 1 and 0 < n_files < 30
    lay.close()


def test_warm_up_stops_at_its_file_bound_and_on_close(tmp_path):
    ns = Namespace("m", "bf16", 16, 4096)
    lay = _publish(str(tmp_path), ns, 200)
    _, got = _run([lay.base], threads=1, max_files=10)
    # the bound is checked per leaf directory: at most one directory's files past it
    assert 10 <= got[0][0] < 200
    lay.close()


def test_vllm_manager_starts_the_warm_up_only_when_asked(tmp_path, vllm_available):
    from kvcache_core.vllm.manager import PyKVCacheManager

    ns = Namespace("m", "bf16", 256, 1 << 16)
    lay = _publish(str(tmp_path), ns, 12)
    m = PyKVCacheManager(str(tmp_path), [ns], n_dram=0, warm_start=True)
    try:
        assert m._warmer is not None and m._warmer.finished.wait(30)
        s = m.stats()
        assert s["warm_files"] == 12 and s["warm_dirs"] >= 2 and s["warm_us"] > 0, s
        assert s["warm_errors"] == 0, s
    finally:
        m.shutdown()
    off = PyKVCacheManager(str(tmp_path), [ns], n_dram=0)
    assert off._warmer is None and off.stats().get("warm_files", 0) == 0
    off.shutdown()
    lay.close()
