"""Fast tests of :mod:`kvcache_core.vllm.worker` without an engine: the worker's
copy/store/load/failure paths through a real reactor."""

from __future__ import annotations

import os
import time

import pytest
import torch
from helpers.vllm_units import key

from kvcache_core.config import StorageConfig
from kvcache_core.layout import HEADER_BYTES, MAGIC, Namespace
from kvcache_core.reactor import IN_SLOT
from kvcache_core.vllm import options as O


def _make_worker(root, dram_files: int = 0, page: int = 4096, **storage):
    """A real PyKVCacheWorker over two random int8 KV tensors (CPU) of 32 blocks of
    ``page`` bytes, small pools, a DRAM tier of ``dram_files`` slots; ``storage``: more
    StorageConfig keys. The tensors are ``w.test_tensors``."""
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    from kvcache_core.vllm.worker import PyKVCacheWorker

    nb, bpc = 32, 2
    g = torch.Generator().manual_seed(0)
    ts = [torch.randint(-128, 127, (nb, page), dtype=torch.int8, generator=g)
          for _ in range(2)]
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(t, page) for t in ts],
                           [[CanonicalKVCacheRef(0, page), CanonicalKVCacheRef(1, page)]])
    ns = Namespace("unit/model", "int8", 2 * 16, block_bytes=2 * page * bpc)
    cfg = StorageConfig(root_dir=str(root), staging_bytes=4 * ns.file_bytes, io_depth=2,
                        lookahead=2, copy_headroom=1,
                        dram_cache_bytes=dram_files * ns.file_bytes, **storage)
    w = PyKVCacheWorker(kv, storage=cfg, namespace=ns, pool=O.pool_geometry(cfg, ns),
                        blocks_per_chunk=bpc, max_disk_bytes=0)
    w.test_tensors = ts
    w.test_orig = [t.clone() for t in ts]
    return w


@pytest.fixture
def worker(tmp_path, vllm_available):
    w = _make_worker(tmp_path, dram_files=4)
    yield w
    w.shutdown()


def _run(w, job: int) -> None:
    w.wait({job})
    res = {r.job_id: r for r in w.get_finished()}
    assert res[job].success


def test_worker_store_load_dram_and_disk(worker):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvcache_core.vllm.job_specs import PyKVLoadSpec, PyKVStoreSpec

    w, ts, orig = worker, worker.test_tensors, worker.test_orig
    k1, k2 = key(1), key(2)
    # store: k1 = blocks 3,5 (DRAM slot 0 + disk), k2 = blocks 7,9 (disk only)
    w.submit_store(1, GPULoadStoreSpec([3, 5, 7, 9], [4], [0]),
                   PyKVStoreSpec([k1, k2], [0, -1]))
    w.submit_store(2, GPULoadStoreSpec([], [0], [0]), PyKVStoreSpec([], []))
    w.wait({2})  # waiting for job 2 must not lose job 1's completion
    w.wait({1})
    assert {r.job_id for r in w.get_finished()} == {1, 2}
    _, delta = w.take_report()  # vLLM's blocking waits reach the scheduler's counters
    assert delta["worker_waits"] == 2 and delta["worker_wait_us"] >= 0
    # where a connector costs a server without hits: vLLM's thread in our hooks, the
    # reactor's wake-ups (each takes the GIL) and its work in them
    assert delta["worker_main_us"] >= delta["worker_wait_us"]
    assert delta["reactor_iterations"] >= 2 and delta["reactor_step_us"] > 0
    _, again = w.take_report()
    assert "worker_main_us" not in again  # deltas: no hook ran since
    # store jobs are acknowledged once copied (early_store_ack); the files follow
    assert w.reactor.wait(30)
    assert w.layout.exists(k1) and w.layout.exists(k2)
    w.get_finished()  # drains the final completions: k1 (DRAM slot 0) is reported written
    assert w.take_written() == [k1] and w.take_written() == []
    for t in ts:
        t.zero_()
    # load: k1 from DRAM slot 0 skipping sub-block 0 -> block 11; k2 from disk -> 12, 13
    w.submit_load(3, PyKVLoadSpec([k1, k2], [0, -1], [IN_SLOT, 0]),
                  GPULoadStoreSpec([11, 12, 13], [3], [1]))
    _run(w, 3)
    assert w.take_invalid_block_ids() == set()
    for t, o in zip(ts, orig, strict=True):
        assert torch.equal(t[11], o[5]) and torch.equal(t[12], o[7])
        assert torch.equal(t[13], o[9]) and not t[10].any()
    failed, counters = w.take_report()
    assert not failed and counters["chunks_loaded_dram"] == 1
    # the two files were written after the early store ack: each is counted in the first
    # report or in this one, depending on how fast the disk was
    assert counters["chunks_loaded_disk"] == 1
    assert delta.get("stores_written", 0) + counters.get("stores_written", 0) == 2, (
        delta, counters)
    # a DRAM store whose file already exists still gets a valid slot header
    for t, o in zip(ts, orig, strict=True):
        t[3], t[5] = o[3], o[5]
    w.submit_store(4, GPULoadStoreSpec([3, 5], [2], [0]), PyKVStoreSpec([k1], [3]))
    _run(w, 4)
    w.submit_load(5, PyKVLoadSpec([k1], [3], [IN_SLOT]), GPULoadStoreSpec([20, 21], [2], [0]))
    _run(w, 5)
    assert w.take_invalid_block_ids() == set()
    assert torch.equal(ts[1][20], orig[1][3]) and torch.equal(ts[1][21], orig[1][5])
    # promotion: k2 read from disk into DRAM slot 2, then served from that slot
    w.submit_load(6, PyKVLoadSpec([k2], [2], [0]), GPULoadStoreSpec([22, 23], [2], [0]))
    _run(w, 6)
    w.submit_load(7, PyKVLoadSpec([k2], [2], [IN_SLOT]), GPULoadStoreSpec([24, 25], [2], [0]))
    _run(w, 7)
    assert w.take_invalid_block_ids() == set()
    assert torch.equal(ts[0][25], orig[0][9])
    st = w.stats()["reactor"]
    assert st["bytes_read"] == 2 * w.layout.ns.file_bytes
    # jobs 5 and 7 were all DRAM hits: served on this thread, never through the reactor
    # (job 3 mixed a DRAM hit with a disk chunk: the reactor served its DRAM chunk)
    assert st["loads_dram"] == 1 and w.stats()["chunks_loaded_dram"] == 3
    # one latency per job for the scheduler's histograms, by tier: jobs 5 and 7 all
    # DRAM, 3 and 6 with a disk chunk; the stores 1, 2 and 4
    obs = w.take_observations()
    assert {k: len(v) for k, v in obs.items()} == {"store": 3, "load_disk": 2,
                                                   "load_dram": 2}
    assert all(x > 0 for v in obs.values() for x in v) and w.take_observations() == {}
    # the direct path's time on this thread, by phase (exported with the worker timing)
    dt = w._direct_timing()
    assert set(dt) == {"direct_validate_s", "direct_ops_s", "direct_issue_s",
                       "direct_issue_max_s", "direct_kernel_jobs", "store_kernel_jobs"}
    # no CUDA: dram_load_copy and store_copy are always dma here, the gather kernel
    # never runs
    assert w.copier.direct_copy == "dma" and dt.pop("direct_kernel_jobs") == 0
    assert w.copier.store_copy == "dma" and dt.pop("store_kernel_jobs") == 0
    assert all(v > 0 for v in dt.values()), dt
    assert dt["direct_issue_max_s"] <= dt["direct_issue_s"]
    assert sum(dt[k] for k in ("direct_validate_s", "direct_ops_s", "direct_issue_s")) \
        <= w.timing["main_submit_load_s"]


def test_worker_dram_only_chunk_fills_its_slot_and_writes_no_file(worker):
    """A store spec with ``dram_only`` (the write-back share of the tier is full): that
    chunk fills its DRAM slot (served back from it intact), writes no file and is not
    reported written; the job's other chunk is written as usual."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvcache_core.vllm.job_specs import PyKVLoadSpec, PyKVStoreSpec

    w, ts, orig = worker, worker.test_tensors, worker.test_orig
    k1, k2 = key(31), key(32)
    w.submit_store(1, GPULoadStoreSpec([3, 5, 7, 9], [4], [0]),
                   PyKVStoreSpec([k1, k2], [0, 1], dram_only=[False, True]))
    _run(w, 1)
    assert w.reactor.wait(30)
    w.get_finished()
    assert w.layout.exists(k1) and not w.layout.exists(k2)
    assert w.take_written() == [k1]
    for t in ts:
        t.zero_()
    w.submit_load(2, PyKVLoadSpec([k2], [1], [IN_SLOT]), GPULoadStoreSpec([12, 13], [2], [0]))
    _run(w, 2)
    assert w.take_invalid_block_ids() == set()
    for t, o in zip(ts, orig, strict=True):
        assert torch.equal(t[12], o[7]) and torch.equal(t[13], o[9])


def test_worker_load_failures_are_reported_and_slots_invalidated(worker):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvcache_core.vllm.job_specs import PyKVLoadSpec, PyKVStoreSpec

    w, ts = worker, worker.test_tensors
    k1, k2, k3 = key(1), key(2), key(3)
    w.submit_store(1, GPULoadStoreSpec([1, 2, 3, 4, 5, 6], [6], [0]),
                   PyKVStoreSpec([k1, k2, k3], [0, 1, -1]))
    _run(w, 1)
    # the job is acknowledged once copied (early_store_ack): let the files land first,
    # as vLLM's manager only sees a disk hit once the file is published
    assert w.reactor.wait(30)
    assert w.layout.exists(k2) and w.layout.exists(k3)
    views = w.reactor.pool.views
    # 1. garbage in a DRAM slot (bad magic): refused, recomputed, never copied
    views[w.n_staging + 0][0] ^= 0xFF
    before = ts[0][10].clone()
    w.submit_load(2, PyKVLoadSpec([k1], [0], [IN_SLOT]), GPULoadStoreSpec([10, 11], [2], [0]))
    _run(w, 2)
    assert w.take_invalid_block_ids() == {10, 11}
    assert torch.equal(ts[0][10], before)
    # 2. a corrupt file promoted into DRAM slot 1: the slot header is zeroed
    path = w.layout.path_for(k2)
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 77)
        b = f.read(1)
        f.seek(HEADER_BYTES + 77)
        f.write(bytes([b[0] ^ 1]))
    assert bytes(views[w.n_staging + 1][:8]) == MAGIC  # the store left a valid header
    w.submit_load(3, PyKVLoadSpec([k2, k3], [1, -1], [0, 0]),
                  GPULoadStoreSpec([12, 13, 14, 15], [4], [0]))
    _run(w, 3)
    assert w.take_invalid_block_ids() == {12, 13}  # k3 loaded fine
    assert bytes(views[w.n_staging + 1][:8]) == bytes(8)
    assert not os.path.exists(path)
    # 3. a missing file
    w.submit_load(4, PyKVLoadSpec([k2], [-1], [0]), GPULoadStoreSpec([16, 17], [2], [0]))
    _run(w, 4)
    assert w.take_invalid_block_ids() == {16, 17}
    failed, counters = w.take_report()
    assert failed == {k1, k2}
    assert counters["chunks_failed"] == 3 and counters["files_corrupt"] == 1
    assert counters["dram_invalid"] == 1 and counters["files_missing"] == 1


def test_worker_with_a_dead_reactor_fails_loads_and_reports_it(worker):
    """The reactor thread dies (an injected bug): a disk load job still completes, its GPU
    blocks are reported for recompute, the worker reports ``reactor_dead`` once, and
    later store jobs complete too (nothing waits)."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvcache_core.vllm.job_specs import PyKVLoadSpec, PyKVStoreSpec

    w = worker
    k1 = key(1)
    w.submit_store(1, GPULoadStoreSpec([3, 5], [2], [0]), PyKVStoreSpec([k1], [-1]))
    _run(w, 1)
    assert w.reactor.wait(30)

    def boom(tag, res):
        raise RuntimeError("injected reactor bug")

    w.reactor._on_cqe = boom
    w.submit_load(2, PyKVLoadSpec([k1], [-1], [0]), GPULoadStoreSpec([10, 11], [2], [0]))
    _run(w, 2)
    assert w.take_invalid_block_ids() == {10, 11}
    failed, counters = w.take_report()
    assert failed == {k1} and counters["reactor_dead"] == 1
    w.submit_store(3, GPULoadStoreSpec([7, 9], [2], [0]), PyKVStoreSpec([key(2)], [-1]))
    _run(w, 3)
    assert w.take_report()[1].get("reactor_dead") is None  # reported once


def test_worker_watchdog_gives_up_a_stuck_reactor(tmp_path, vllm_available):
    """Issue 12 item 1 (watchdog): the reactor thread hangs inside a synchronous call (a
    publish on a hung filesystem). A load job submitted meanwhile is finished by the
    worker after 2 x io_timeout_s with its blocks reported for recompute, a flush (wait)
    returns, the engine turns recompute-only, and when the stuck call finally returns the
    reactor never writes the GPU blocks of the given-up job."""
    import threading

    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvcache_core.vllm.job_specs import PyKVLoadSpec, PyKVStoreSpec

    w = _make_worker(tmp_path, io_timeout_s=0.25)
    ts = w.test_tensors
    release = threading.Event()
    try:
        k1, k2 = key(1), key(2)
        w.submit_store(1, GPULoadStoreSpec([3, 5], [2], [0]), PyKVStoreSpec([k1], [-1]))
        _run(w, 1)
        assert w.reactor.wait(30) and w.layout.exists(k1)
        real_publish = w.layout.publish

        def hung_publish(*a, **kw):  # the next publish blocks the reactor thread
            release.wait(60)
            return real_publish(*a, **kw)

        w.layout.publish = hung_publish
        w.submit_store(2, GPULoadStoreSpec([7, 9], [2], [0]), PyKVStoreSpec([k2], [-1]))
        w.wait({2})  # acknowledged once copied; its file write then hangs in publish
        w.get_finished()
        time.sleep(0.3)
        before = [t[10:12].clone() for t in ts]
        w.submit_load(3, PyKVLoadSpec([k1], [-1], [0]), GPULoadStoreSpec([10, 11], [2], [0]))
        t0 = time.monotonic()
        w.wait({3})  # returns through the watchdog, not through the reactor
        took = time.monotonic() - t0
        res = {r.job_id: r for r in w.get_finished()}
        assert 3 in res and res[3].success and took < 5, took
        assert w.take_invalid_block_ids() == {10, 11}
        failed, counters = w.take_report()
        assert failed == {k1}
        assert counters["reactor_stalled"] == 1 and counters["reactor_dead"] == 1
        release.set()  # the stuck call returns: the reactor must not touch blocks 10, 11
        time.sleep(0.5)
        assert all(torch.equal(t[10:12], b) for t, b in zip(ts, before, strict=True))
        w.submit_load(4, PyKVLoadSpec([k1], [-1], [0]), GPULoadStoreSpec([12, 13], [2], [0]))
        _run(w, 4)  # later jobs complete at once (recompute-only)
        assert w.take_invalid_block_ids() == {12, 13}
    finally:
        release.set()
        w.shutdown()


def test_worker_watchdog_ignores_an_idle_reactor(tmp_path, vllm_available):
    """An idle reactor sleeps without a heartbeat. A job submitted after an idle period
    longer than the watchdog's limit, and checked before the reactor thread has turned
    (here: its wake-up withheld), is not a stall: the H200 replay of the tenth session
    lost its DRAM tier so (a synchronous DRAM load waited right after a 110 s pause)."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvcache_core.vllm.job_specs import PyKVLoadSpec, PyKVStoreSpec

    w = _make_worker(tmp_path, io_timeout_s=0.1)  # watchdog: 0.2 s
    try:
        k1 = key(1)
        w.submit_store(1, GPULoadStoreSpec([3, 5], [2], [0]), PyKVStoreSpec([k1], [-1]))
        _run(w, 1)
        assert w.reactor.wait(30) and w.layout.exists(k1)
        time.sleep(0.5)  # idle: the reactor sleeps, its heartbeat ages past the limit
        assert w.reactor.stalled_for() == 0.0  # nothing outstanding
        wake = w.reactor.engine.wake
        w.reactor.engine.wake = lambda: None  # the reactor does not turn yet
        try:
            w.submit_load(2, PyKVLoadSpec([k1], [-1], [0]),
                          GPULoadStoreSpec([10, 11], [2], [0]))
            assert w.reactor.stalled_for() < 0.2
            w._watchdog()
            assert w.reactor.dead is None
        finally:
            w.reactor.engine.wake = wake
        wake()
        _run(w, 2)
        assert w.take_invalid_block_ids() == set()
        _failed, counters = w.take_report()
        assert "reactor_stalled" not in counters and "reactor_dead" not in counters
    finally:
        w.shutdown()


def test_worker_switch_interval_key(tmp_path, vllm_available):
    """``switch_interval_s`` reaches the reactor: the default lowers the interpreter's
    switch interval to 0.5 ms when it is larger; 0 leaves it alone; with
    ``switch_interval_scope="busy"`` starting the worker leaves it alone too."""
    import sys

    old = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        w = _make_worker(tmp_path / "a", switch_interval_s=0)
        w.shutdown()
        assert sys.getswitchinterval() == pytest.approx(0.005)
        w = _make_worker(tmp_path / "c", switch_interval_scope="busy")
        assert w.reactor._si_low == pytest.approx(0.0005)
        w.shutdown()  # "busy": lowered only while requests are in flight (test_reactor.py)
        assert sys.getswitchinterval() == pytest.approx(0.005)
        w = _make_worker(tmp_path / "b")
        w.shutdown()
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(old)


def _threads() -> int:
    """Threads of this process, io_uring's kernel workers (``iou-wrk-*``) not counted."""
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += not f.read().startswith("iou-")
        except FileNotFoundError:  # ended meanwhile
            pass
    return n


@pytest.mark.parametrize("copy", ["numpy", "torch"])
def test_cpu_copies_start_no_openmp_team_on_the_reactor_thread(tmp_path, vllm_available,
                                                               monkeypatch, copy):
    """On the CPU platform the reactor thread copies with numpy's memcpy: storing and
    loading 64 KiB blocks adds no thread to the process. A torch ``copy_`` that large runs
    an OpenMP parallel region, and from the reactor thread libgomp gives that thread a
    team of its own for the life of the process; with more OpenMP threads than CPUs it
    then stops spin-waiting, and vLLM's CPU decode step was 1.4x slower
    (docs/results/cpu/step-overhead.md). ``KVCACHE_CPU_COPY=torch`` (the old copy, kept
    as a diagnostic) shows the check sees such a team where torch runs more than one
    thread, and both copies move the same bytes."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvcache_core.vllm.job_specs import PyKVLoadSpec, PyKVStoreSpec

    if copy == "torch":
        monkeypatch.setenv("KVCACHE_CPU_COPY", "torch")
    torch.ones(1 << 22).add_(1)  # this thread's own OpenMP team exists before counting
    w = _make_worker(tmp_path, page=65536)
    try:
        ts, orig = w.test_tensors, w.test_orig
        k1 = key(1)
        n0 = _threads()
        w.submit_store(1, GPULoadStoreSpec([3, 5], [2], [0]), PyKVStoreSpec([k1], [-1]))
        _run(w, 1)
        assert w.reactor.wait(30) and w.layout.exists(k1)
        w.submit_load(2, PyKVLoadSpec([k1], [-1], [0]), GPULoadStoreSpec([11, 12], [2], [0]))
        _run(w, 2)
        added = _threads() - n0
        assert w.take_invalid_block_ids() == set()
        for t, o in zip(ts, orig, strict=True):
            assert torch.equal(t[11], o[3]) and torch.equal(t[12], o[5])
    finally:
        w.shutdown()
    if copy == "numpy":
        assert added == 0, f"the reactor's copies started {added} thread(s)"
    elif torch.get_num_threads() > 1:
        assert added >= 1, "torch copy_ of 64 KiB started no OpenMP team: check is blind"


def test_store_copy_wait_reaches_the_reactor(tmp_path, vllm_available):
    """The storage key reaches the worker's reactor; with synchronous (CPU) copies there
    is nothing to wait for, so no waiter thread is started and stores work as before."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvcache_core.vllm.job_specs import PyKVStoreSpec

    w = _make_worker(tmp_path, dram_files=2, store_copy_wait="block")
    try:
        assert w.reactor._waiter is None and w.reactor._waitq is None
        w.submit_store(1, GPULoadStoreSpec([3, 5], [2], [0]), PyKVStoreSpec([key(1)], [0]))
        _run(w, 1)
        assert w.reactor.wait(30) and w.layout.exists(key(1))
    finally:
        w.shutdown()


def test_writeback_defer_key_reaches_the_reactor(tmp_path, monkeypatch, vllm_available):
    """``writeback_defer_s`` reaches the worker's reactor: a store is acknowledged at
    once and its file follows only after the deferral (nothing else arrives)."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvcache_core.vllm.job_specs import PyKVStoreSpec

    monkeypatch.delenv("KVCACHE_WRITEBACK_DEFER_MS", raising=False)
    w = _make_worker(tmp_path, dram_files=2, writeback_defer_s=0.5)
    try:
        assert w.reactor.writeback_defer_s == pytest.approx(0.5)
        t0 = time.monotonic()
        w.submit_store(1, GPULoadStoreSpec([3, 5], [2], [0]), PyKVStoreSpec([key(1)], [0]))
        _run(w, 1)
        assert w.reactor.wait(30) and w.layout.exists(key(1))
        assert time.monotonic() - t0 >= 0.45  # the file waited for the deferral
    finally:
        w.shutdown()


def test_worker_trace_marks_dram_hit_issues(tmp_path, monkeypatch, vllm_available):
    """With ``KVCACHE_TRACE`` set, the worker asks its copier to time DRAM-hit copies and
    records each one's issue (``direct_issued``, microseconds on this thread) and
    completion; on the CPU platform a copy is synchronous, so it has no GPU time
    (``copy_ms`` None, no ``direct_copy`` event)."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvcache_core.vllm.job_specs import PyKVLoadSpec, PyKVStoreSpec

    base = tmp_path / "trace"
    monkeypatch.setenv("KVCACHE_TRACE", str(base))
    w = _make_worker(tmp_path / "root", dram_files=2)
    try:
        assert w.reactor.trace is not None and w.copier.time_direct
        k1 = key(1)
        w.submit_store(1, GPULoadStoreSpec([3, 5], [2], [0]), PyKVStoreSpec([k1], [0]))
        _run(w, 1)
        w.submit_load(2, PyKVLoadSpec([k1], [0], [IN_SLOT]), GPULoadStoreSpec([20, 21], [2], [0]))
        _run(w, 2)
        ev = {e[1]: e for e in w.reactor.trace if e[2] == 2}
        assert "direct_load" in ev and "direct_done" in ev and "direct_issued" in ev, ev
        assert ev["direct_issued"][3] > 0 and "direct_copy" not in ev
        assert w.copier.copy_ms(None) is None
    finally:
        w.shutdown()
    # the trace goes to $KVCACHE_TRACE.r<rank>.<pid>.json at shutdown
    assert list(tmp_path.glob("trace.r0.*.json"))
    # the direct_ops event: the hit's copy descriptors (2 tensors, 2 consecutive blocks
    # -> one run per tensor)
    assert ev["direct_ops"][3] == 2


def test_worker_verify_direct_spot_checks_dram_hits(tmp_path, monkeypatch, vllm_available):
    """With ``KVCACHE_VERIFY_DIRECT=1`` every finished DRAM-hit copy is compared with the
    DRAM tier (counters ``direct_verified`` / ``direct_verify_failed``); a destination
    that changed before the check is reported, never silently passed."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvcache_core.vllm.job_specs import PyKVLoadSpec, PyKVStoreSpec

    monkeypatch.setenv("KVCACHE_VERIFY_DIRECT", "1")
    w = _make_worker(tmp_path / "root", dram_files=2)
    try:
        assert w.copier.verify_direct
        k1 = key(1)
        w.submit_store(1, GPULoadStoreSpec([3, 5], [2], [0]), PyKVStoreSpec([k1], [0]))
        _run(w, 1)
        w.submit_load(2, PyKVLoadSpec([k1], [0], [IN_SLOT]), GPULoadStoreSpec([20, 21], [2], [0]))
        _run(w, 2)
        assert w.counters["direct_verified"] == 1 and w.counters["direct_verify_failed"] == 0
        # a copy whose bytes did not all arrive: the next hit's check sees it
        w.submit_load(3, PyKVLoadSpec([k1], [0], [IN_SLOT]), GPULoadStoreSpec([30, 31], [2], [0]))
        ops = w._verify_ops[3]
        for t in w.kv.flat:
            t[int(ops[1][0]):int(ops[1][0]) + 8] ^= 0xff
        _run(w, 3)
        assert w.counters["direct_verified"] == 2 and w.counters["direct_verify_failed"] == 1
    finally:
        w.shutdown()
