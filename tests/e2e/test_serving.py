"""py-kvcache inside real vLLM 0.26 (CPU platform): hits from each tier, across processes,
with bad files and with a full disk. Every output is compared with plain recompute
(no connector): same greedy tokens, same logprobs."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from kvcache_core.admin import read_ledger

from . import helpers as H

A, B, C = H.PROMPTS["A"], H.PROMPTS["B"], H.PROMPTS["C"]
FULL_HIT = 3 * H.CHUNK  # 1000-token prompts: 3 storage blocks


@pytest.fixture(scope="module")
def root1(workdir) -> str:
    return os.path.join(workdir, "root1")


@pytest.fixture(scope="module")
def dram_run(model_dir, root1) -> dict:
    """One engine with the DRAM tier: A (miss, stored), A again (DRAM hit), C (stored)."""
    llm = H.make_llm(model_dir, H.extra_config(root1, dram_cache_bytes=8 * H.FILE_BYTES))
    out: dict = {}
    try:
        m = H.manager(llm)
        out["A1"] = H.generate(llm, A)
        H.drain(llm)
        out["s1"] = m.stats()
        out["A2"] = H.generate(llm, A)
        H.drain(llm)
        out["s2"] = m.stats()
        before = H.cache_files(root1)
        out["C1"] = H.generate(llm, C)
        H.drain(llm)
        out["c_files"] = sorted(H.cache_files(root1) - before)
        out["s3"] = m.stats()
    finally:
        H.shutdown(llm)
    return out


def test_dram_tier_hit(dram_run, reference, root1):
    s1, s2 = dram_run["s1"], dram_run["s2"]
    assert H.same_output(dram_run["A1"], reference["A"])
    assert dram_run["A1"]["num_cached_tokens"] == 0
    assert s1["stores"] == 3 and s1["stores_dram"] == 3 and s1["stores_written"] == 3
    assert s1["hits_dram"] == s1["hits_disk"] == 0
    # second request: served by the DRAM tier, nothing read from disk
    assert H.same_output(dram_run["A2"], reference["A"])
    assert dram_run["A2"]["num_cached_tokens"] == FULL_HIT
    d = H.delta(s2, s1)
    assert d.get("hits_dram") == 3 and d.get("chunks_loaded_dram") == 3, d
    assert "hits_disk" not in d and "chunks_loaded_disk" not in d and "bytes_read" not in d
    assert "stores" not in d  # already cached: nothing stored again
    assert len(dram_run["c_files"]) == 3


def test_disk_hit_fresh_process(dram_run, reference, model_dir, root1):
    """A new process (no PYTHONHASHSEED in its environment), DRAM tier off, same root."""
    r = H.run_proc({"model_dir": model_dir, "extra": H.extra_config(root1),
                    "steps": [{"op": "generate", "prompt": "A", "tag": "A"}]})
    out, s = r["results"]["A"], r["stats"]["final"]
    assert H.same_output(out, reference["A"])
    assert out["num_cached_tokens"] == FULL_HIT
    assert s["hits_disk"] == 3 and s["chunks_loaded_disk"] == 3, s
    assert s["hits_dram"] == 0 and s["dram_slots"] == 0
    assert s["bytes_read"] == 3 * H.FILE_BYTES
    assert "PYTHONHASHSEED was unset; set it to 0" in r["log"]


def test_disk_hit_promoted_to_dram(dram_run, reference, model_dir, root1):
    """DRAM tier on, cold: the disk hit is read into DRAM slots; the next hit is DRAM."""
    llm = H.make_llm(model_dir, H.extra_config(root1, dram_cache_bytes=4 * H.FILE_BYTES))
    try:
        m = H.manager(llm)
        first = H.generate(llm, A)
        H.drain(llm)
        s1 = m.stats()
        second = H.generate(llm, A)
        H.drain(llm)
        s2 = m.stats()
    finally:
        H.shutdown(llm)
    assert H.same_output(first, reference["A"]) and H.same_output(second, reference["A"])
    assert first["num_cached_tokens"] == second["num_cached_tokens"] == FULL_HIT
    assert s1["hits_disk"] == 3 and s1["promotions"] == 3 and s1["chunks_loaded_disk"] == 3
    d = H.delta(s2, s1)
    assert d.get("hits_dram") == 3 and d.get("chunks_loaded_dram") == 3, d
    assert "bytes_read" not in d


def test_corrupt_files_are_recomputed(dram_run, reference, model_dir, root1):
    """Truncate one of C's files and flip a payload byte in another: vLLM recomputes, the
    output is unchanged, both files are counted and removed, and the request that found
    them corrupt re-stores the recomputed chunks itself (self-healing, issue 12 item 4):
    the very next request hits all three chunks from disk."""
    files = dram_run["c_files"]
    assert len(files) == 3
    truncated, flipped = files[0], files[1]
    os.truncate(truncated, 4096 + 1000)
    with open(flipped, "r+b") as f:
        f.seek(4096 + 12345)
        b = f.read(1)
        f.seek(4096 + 12345)
        f.write(bytes([b[0] ^ 0xFF]))
    llm = H.make_llm(model_dir, H.extra_config(root1))
    try:
        m = H.manager(llm)
        bad = H.generate(llm, C)
        H.drain(llm)
        s1 = m.stats()
        sizes = [os.path.getsize(p) if os.path.exists(p) else -1 for p in (truncated, flipped)]
        healed = H.generate(llm, C)
        H.drain(llm)
        s2 = m.stats()
    finally:
        H.shutdown(llm)
    assert H.same_output(bad, reference["C"])
    assert s1["files_corrupt"] == 2 and s1["chunks_failed"] == 2, s1
    assert s1["load_failures"] == 2 and s1["restores_planned"] == 2, s1
    assert s1["stores_written"] == 2, s1  # re-stored by the request that recomputed them
    assert sizes == [H.FILE_BYTES, H.FILE_BYTES]
    assert H.same_output(healed, reference["C"])
    assert healed["num_cached_tokens"] == FULL_HIT
    d = H.delta(s2, s1)
    assert d.get("chunks_loaded_disk") == 3 and "chunks_failed" not in d, d


def test_concurrent_requests_read_each_block_once(dram_run, reference, model_dir, root1):
    """Two requests for the same document at once, its blocks on disk only (a new engine
    on the same root): the first reads them into the DRAM tier, the second waits for that
    read (HIT_PENDING) and loads from DRAM. Each block is read from disk once."""
    llm = H.make_llm(model_dir, H.extra_config(root1, dram_cache_bytes=8 * H.FILE_BYTES),
                     max_num_seqs=4)
    try:
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=H.MAX_TOKENS, ignore_eos=True,
                            logprobs=0)
        outs = llm.generate([{"prompt_token_ids": A}, {"prompt_token_ids": A}], sp,
                            use_tqdm=False)
        H.drain(llm)
        s = H.manager(llm).stats()
    finally:
        H.shutdown(llm)
    for o in outs:
        out = o.outputs[0]
        assert list(out.token_ids) == reference["A"]["tokens"]
        assert o.num_cached_tokens == FULL_HIT
    assert s["chunks_loaded_disk"] == 3 and s["bytes_read"] == 3 * H.FILE_BYTES, s
    assert s["chunks_loaded_dram"] == 3 and s["hits_pending"] >= 1, s


def test_partial_gpu_hit_loads_the_rest_of_a_chunk(dram_run, reference, model_dir, root1):
    """GPU prefix caching ON: the GPU cache holds A's first 3 GPU blocks (384 tokens, from
    a request sharing that prefix), so the offload load starts in the middle of storage
    block 1 (``block_indices % blocks_per_chunk == 1``): only its second half is copied."""
    llm = H.make_llm(model_dir, H.extra_config(root1), enable_prefix_caching=True)
    try:
        m = H.manager(llm)
        H.generate(llm, A[:384] + H.PROMPTS["B"][:300])
        H.drain(llm)
        s0 = m.stats()
        out = H.generate(llm, A)
        H.drain(llm)
        d = H.delta(m.stats(), s0)
    finally:
        H.shutdown(llm)
    assert out["num_cached_tokens"] == FULL_HIT
    assert H.same_output(out, reference["A"])
    assert d.get("chunks_loaded_disk") == 2, d  # storage blocks 1 (second half) and 2


def test_two_engines_share_one_root(reference, model_dir, workdir):
    """Two engines in two concurrent processes on one root: both store prompt B at the same
    time (same files: one publish wins), then the second finds the first's file for A."""
    root = os.path.join(workdir, "root_shared")
    sig = os.path.join(workdir, "first_stored_A")
    ex = H.extra_config(root)
    p1, o1 = H.run_proc({"model_dir": model_dir, "extra": ex, "steps": [
        {"op": "generate", "prompt": "B", "tag": "B"}, {"op": "drain"},
        {"op": "generate", "prompt": "A", "tag": "A"}, {"op": "drain"},
        {"op": "signal", "path": sig}]}, wait=False,
        env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    p2, o2 = H.run_proc({"model_dir": model_dir, "extra": ex, "steps": [
        {"op": "generate", "prompt": "B", "tag": "B"}, {"op": "drain"},
        {"op": "wait_for", "path": sig},
        {"op": "generate", "prompt": "A", "tag": "A"}, {"op": "drain"}]}, wait=False,
        env={"VLLM_CPU_OMP_THREADS_BIND": "1"})
    r1 = H.finish_proc(p1, o1)
    r2 = H.finish_proc(p2, o2)
    for r in (r1, r2):
        assert H.same_output(r["results"]["B"], reference["B"])
        assert H.same_output(r["results"]["A"], reference["A"])
    assert r1["results"]["A"]["num_cached_tokens"] == 0
    assert r2["results"]["A"]["num_cached_tokens"] == FULL_HIT
    s1, s2 = r1["stats"]["final"], r2["stats"]["final"]
    assert s2["chunks_loaded_disk"] >= 3 and s2["files_corrupt"] == 0
    # B's three files were written once (the loser of a race counts it as existing)
    written = s1["stores_written"] + s2["stores_written"]
    assert written == 6, (s1, s2)
    assert len(H.cache_files(root)) == 6


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mounts", ["distribute"], indirect=True)
def test_two_engines_on_two_glusterfs_mounts(reference, model_dir, workdir, mounts):
    """Issue 16 item 4: two real engines, each on its own FUSE mount of one GlusterFS
    volume (two-brick distribute, where only rename publishes are safe: the root's
    publish method is left on ``auto``). Both store prompt B at the same time (one
    publish per file across the mounts), then the second engine hits the first's files
    for A once they are visible on its mount; every output equals recompute."""
    layout, m1, m2, name = mounts
    root1, root2 = os.path.join(m1, name), os.path.join(m2, name)
    sig = os.path.join(workdir, f"gl_first_stored_A_{name}")
    seen = os.path.join(workdir, f"gl_visible_A_{name}")
    p1, o1 = H.run_proc({"model_dir": model_dir, "extra": H.extra_config(root1), "steps": [
        {"op": "generate", "prompt": "B", "tag": "B"}, {"op": "drain"},
        {"op": "generate", "prompt": "A", "tag": "A"}, {"op": "drain"},
        {"op": "signal", "path": sig}]}, wait=False,
        env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    p2, o2 = H.run_proc({"model_dir": model_dir, "extra": H.extra_config(root2), "steps": [
        {"op": "generate", "prompt": "B", "tag": "B"}, {"op": "drain"},
        {"op": "wait_for", "path": seen, "timeout": 400},
        {"op": "generate", "prompt": "A", "tag": "A"}, {"op": "drain"}]}, wait=False,
        env={"VLLM_CPU_OMP_THREADS_BIND": "1"})
    # the first engine published A through mount 1: wait until mount 2 shows all six
    # files (a distributed filesystem's visibility lag; measured, not slept over)
    deadline = time.monotonic() + 400
    while not os.path.exists(sig) and p1.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    t_sig = time.monotonic()
    while len(H.cache_files(root2)) < 6 and time.monotonic() < t_sig + 30:
        time.sleep(0.05)
    lag = time.monotonic() - t_sig
    with open(seen, "w") as f:
        f.write(f"{lag:.3f}")
    r1 = H.finish_proc(p1, o1, timeout=400)
    r2 = H.finish_proc(p2, o2, timeout=400)
    for r in (r1, r2):
        assert H.same_output(r["results"]["B"], reference["B"])
        assert H.same_output(r["results"]["A"], reference["A"])
    assert r1["results"]["A"]["num_cached_tokens"] == 0
    assert r2["results"]["A"]["num_cached_tokens"] == FULL_HIT, (lag, r2["stats"])
    s1, s2 = r1["stats"]["final"], r2["stats"]["final"]
    assert s2["chunks_loaded_disk"] >= 3 and s1["files_corrupt"] == s2["files_corrupt"] == 0
    # B's three files were published once across the two mounts (the loser of the race
    # counts the file as existing), A's three by the first engine. The one allowed surplus:
    # a B block both renamed at once because a GlusterFS client's stale negative lookup hid
    # the other mount's just-published name (identical content-addressed file, counted by
    # both: Layout._publish_rename); six files remain either way.
    written = s1["stores_written"] + s2["stores_written"]
    assert 6 <= written <= 6 + len(H.PROMPTS["B"]) // H.CHUNK, (s1, s2)
    assert len(H.cache_files(root1)) == len(H.cache_files(root2)) == 6
    print(f"{layout}: A visible on the second mount {lag:.3f} s after the first engine "
          f"drained")


@pytest.mark.parametrize("mounts", ["distribute"], indirect=True)
def test_two_engines_evict_under_one_bound_on_two_glusterfs_mounts(reference, model_dir,
                                                                   workdir, mounts):
    """Issue 16 item 4, eviction: two engines on two mounts of one volume serve at once
    under ONE max_disk_bytes of 4 files (the ledger of the namespace lives on the volume,
    under a lock every mount honours). Together they store 9 different files (A, C from
    the first; B, then A or a hit on it, from the second), so the bound must evict while
    both publish: afterwards at most 4 files remain, the ledger equals the bytes on the
    volume, nothing was corrupt or failed, and every output equals recompute (an evicted
    block is a miss and is recomputed, never a wrong token)."""
    layout, m1, m2, name = mounts
    root1, root2 = os.path.join(m1, name), os.path.join(m2, name)
    bound = 4 * H.FILE_BYTES
    p1, o1 = H.run_proc({"model_dir": model_dir,
                         "extra": H.extra_config(root1, max_disk_bytes=bound), "steps": [
        {"op": "generate", "prompt": "A", "tag": "A"}, {"op": "drain"},
        {"op": "generate", "prompt": "C", "tag": "C"}, {"op": "drain"}]}, wait=False,
        env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    p2, o2 = H.run_proc({"model_dir": model_dir,
                         "extra": H.extra_config(root2, max_disk_bytes=bound), "steps": [
        {"op": "generate", "prompt": "B", "tag": "B"}, {"op": "drain"},
        {"op": "generate", "prompt": "A", "tag": "A"}, {"op": "drain"}]}, wait=False,
        env={"VLLM_CPU_OMP_THREADS_BIND": "1"})
    r1 = H.finish_proc(p1, o1, timeout=400)
    r2 = H.finish_proc(p2, o2, timeout=400)
    for r, tags in ((r1, "AC"), (r2, "BA")):
        for t in tags:
            assert H.same_output(r["results"][t], reference[t]), (t, r["stats"]["final"])
    s1, s2 = r1["stats"]["final"], r2["stats"]["final"]
    files = H.cache_files(root1)
    assert len(files) <= 4, (len(files), s1, s2)
    assert H.cache_files(root2) == {f.replace(m1, m2, 1) for f in files}
    on_disk = sum(os.path.getsize(f) for f in files)
    (base,) = [d for d, _, fs in os.walk(root1) if ".usage" in fs]
    assert read_ledger(base) == on_disk  # the coherent (xattr) ledger on FUSE
    written = s1.get("stores_written", 0) + s2.get("stores_written", 0)
    evicted = s1.get("disk_evicted_files", 0) + s2.get("disk_evicted_files", 0)
    # every file published across the two mounts is either still there or was evicted;
    # the one allowed surplus is a block of A (the only prompt both engines store) that
    # both published at once: a GlusterFS client's stale negative lookup can hide the
    # other mount's just-published name, so both rename the identical content-addressed
    # file (Layout._publish_rename) and both count it. Never fewer: a file that is there
    # was counted, and an eviction is counted once (Layout._removed_elsewhere).
    a_blocks = len(H.PROMPTS["A"]) // H.CHUNK
    double = written - evicted - len(files)
    assert 0 <= double <= a_blocks, (double, len(files), s1, s2)
    assert written > 4 and evicted >= 1, (s1, s2)  # the bound really had to evict
    for s in (s1, s2):
        assert s.get("files_corrupt", 0) == 0 and s.get("store_errors", 0) == 0, s
    print(f"{layout}: {written} files written, {len(files)} left under the bound of 4, "
          f"evicted {s1.get('disk_evicted_files', 0)} + {s2.get('disk_evicted_files', 0)}, "
          f"dropped at capacity {s1.get('stores_dropped_capacity', 0)} + "
          f"{s2.get('stores_dropped_capacity', 0)}")


@pytest.fixture
def tiny_tmpfs(workdir):
    mnt = os.path.join(workdir, "tmpfs")
    os.makedirs(mnt, exist_ok=True)
    size = H.FILE_BYTES + 64 * 1024  # room for one block file and the metadata
    rc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mnt],
                        capture_output=True, text=True)
    if rc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {rc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", mnt], capture_output=True)


def _b_twice(llm) -> tuple[dict, dict, dict, dict]:
    """Prompt B twice on ``llm`` (drained after each), then shut it down: (first output,
    counters after it, second output, counters after it)."""
    try:
        m = H.manager(llm)
        first = H.generate(llm, H.PROMPTS["B"])
        H.drain(llm)
        s1 = m.stats()
        second = H.generate(llm, H.PROMPTS["B"])
        H.drain(llm)
        return first, s1, second, m.stats()
    finally:
        H.shutdown(llm)


def test_full_disk_keeps_serving(reference, model_dir, tiny_tmpfs):
    """Root on a tmpfs that holds one file: stores beyond it are dropped and counted,
    requests keep being served with unchanged output, the stored block still hits.

    io_depth=1 makes the outcome deterministic (one write at a time: the first fits);
    with concurrent writes all three may fail on a nearly full disk, which is fine."""
    llm = H.make_llm(model_dir, H.extra_config(tiny_tmpfs, io_depth=1))
    first, s1, second, s2 = _b_twice(llm)
    assert H.same_output(first, reference["B"]) and H.same_output(second, reference["B"])
    # ENOSPC, or a short write (tmpfs returns the bytes that fit) counted as a write error
    dropped = s1["stores_dropped_enospc"] + s1["store_errors"]
    assert s1["stores_written"] == 1 and dropped == 2, s1
    assert second["num_cached_tokens"] == H.CHUNK
    assert H.delta(s2, s1).get("chunks_loaded_disk") == 1
    assert not [f for f in os.listdir(next(
        os.path.join(tiny_tmpfs, d) for d in os.listdir(tiny_tmpfs) if d.startswith("v")))
        if f.startswith(".tmp.")]


def test_store_backpressure_drops_the_tail_and_keeps_output(reference, model_dir, workdir):
    """Stores never wait for the disk: with the DRAM tier off and a staging pool of 4
    slots, 2 of them reserved for on-demand loads (io_depth=2), a request's 3-chunk store
    job gets 2 staging slots and its third chunk is dropped and counted at once. The
    prefix that was kept still hits (2 chunks), the recomputed tail is stored then, and
    the output is unchanged."""
    root = os.path.join(workdir, "root_backpressure")
    llm = H.make_llm(model_dir, H.extra_config(root, staging_bytes=4 * H.FILE_BYTES,
                                               io_depth=2, lookahead=2, copy_headroom=2))
    first, s1, second, s2 = _b_twice(llm)
    assert s1["stores"] == 3 and s1["stores_dropped_backpressure"] == 1, s1
    assert s1["stores_written"] == 2 and s1["ext_slot_waits"] == 0, s1
    assert second["num_cached_tokens"] == 2 * H.CHUNK
    d = H.delta(s2, s1)
    assert d.get("chunks_loaded_disk") == 2 and d.get("stores_written") == 1, d
    assert len(H.cache_files(root)) == 3  # the recomputed tail was stored this time
    for out in (first, second):
        assert out["tokens"] == reference["B"]["tokens"]
        assert H.same_output(out, reference["B"], tol=H.SPLIT_LOGPROB_TOL)


def test_dead_reactor_turns_the_engine_recompute_only(dram_run, reference, model_dir,
                                                       root1):
    """A reactor thread that dies mid-run (an injected bug at its next I/O completion):
    the load in flight is reported failed and recomputed, later requests are served by
    recompute (lookups miss, nothing stored), tokens unchanged, health 0; nothing hangs."""
    llm = H.make_llm(model_dir, H.extra_config(root1))
    try:
        assert all(llm.collective_rpc(H._kill_reactor))
        first = H.generate(llm, A)  # its blocks are on disk: the read kills the reactor
        H.drain(llm)
        s1 = H.manager(llm).stats()
        second = H.generate(llm, C)
        H.drain(llm)
        s2 = H.manager(llm).stats()
    finally:
        H.shutdown(llm)
    assert H.same_output(first, reference["A"]) and H.same_output(second, reference["C"])
    assert s1["reactor_dead"] == 1 and s1["healthy"] == 0, s1
    assert s1["chunks_failed"] >= 1 and s1["chunks_loaded_disk"] == 0, s1
    d = H.delta(s2, s1)
    assert d.get("hits_disk", 0) == 0 and d.get("stores", 0) == 0, d
    assert second["num_cached_tokens"] == 0


def test_short_prompts_stay_in_dram_without_files(reference, model_dir, workdir):
    """disk_min_prefix_tokens=950: C (900 tokens) is stored into the DRAM tier only (no
    file; its repeat is a DRAM hit with the same output), A (1000 tokens) writes its
    three files as before."""
    root = os.path.join(workdir, "root_short")
    llm = H.make_llm(model_dir, H.extra_config(root, dram_cache_bytes=8 * H.FILE_BYTES,
                                               disk_min_prefix_tokens=950))
    try:
        m = H.manager(llm)
        c1 = H.generate(llm, C)
        H.drain(llm)
        s1 = m.stats()
        files_c = H.cache_files(root)
        c2 = H.generate(llm, C)
        a1 = H.generate(llm, A)
        H.drain(llm)
        s2 = m.stats()
        files_a = H.cache_files(root)
    finally:
        H.shutdown(llm)
    assert H.same_output(c1, reference["C"]) and H.same_output(c2, reference["C"])
    assert H.same_output(a1, reference["A"])
    assert s1["stores_dram_only_short"] == 3 and s1.get("stores_written", 0) == 0, s1
    assert files_c == set()
    assert c2["num_cached_tokens"] == 3 * H.CHUNK  # DRAM hit of the short prompt
    d = H.delta(s2, s1)
    assert d.get("hits_dram") == 3 and d.get("stores_written") == 3, d
    assert len(files_a) == 3 and s2["dram_writeback_pinned"] == 0


def test_prompts_below_the_store_floor_store_nothing(reference, model_dir, workdir):
    """min_store_prefix_tokens=950 (no break-even table): C (900 tokens) stores nothing,
    and its repeat is recomputed with the same output; A (1000 tokens) stores as before
    and its repeat is a DRAM hit."""
    root = os.path.join(workdir, "root_floor")
    llm = H.make_llm(model_dir, H.extra_config(root, dram_cache_bytes=8 * H.FILE_BYTES,
                                               min_store_prefix_tokens=950))
    try:
        m = H.manager(llm)
        c1 = H.generate(llm, C)
        H.drain(llm)
        c2 = H.generate(llm, C)
        H.drain(llm)
        s1 = m.stats()
        files_c = H.cache_files(root)
        a1 = H.generate(llm, A)
        H.drain(llm)
        a2 = H.generate(llm, A)
        H.drain(llm)
        s2 = m.stats()
    finally:
        H.shutdown(llm)
    assert H.same_output(c1, reference["C"]) and H.same_output(c2, reference["C"])
    assert H.same_output(a1, reference["A"]) and H.same_output(a2, reference["A"])
    assert s1["stores_skipped_below_floor"] == 6 and s1.get("stores", 0) == 0, s1
    assert files_c == set() and c2["num_cached_tokens"] == 0
    d = H.delta(s2, s1)
    assert d.get("stores") == 3 and d.get("hits_dram") == 3, d
    assert a2["num_cached_tokens"] == 3 * H.CHUNK


def _steps_until_files(llm, root: str, n: int) -> None:
    """Other traffic (prompts shorter than a chunk: they store nothing) until ``root``
    holds ``n`` cache files or 30 requests passed: the engine steps that carry the
    scheduler's flush plans to the workers."""
    for i in range(30):
        if len(H.cache_files(root)) == n:
            return
        H.generate(llm, [7 + i] * 16)
        H.drain(llm)


def _fresh_engine_serves_a_from_disk(model_dir: str, root: str, reference) -> None:
    """A fresh engine without a DRAM tier over ``root`` serves all of A's chunks from its
    files, with the reference output."""
    llm = H.make_llm(model_dir, H.extra_config(root))
    try:
        again = H.generate(llm, A)
    finally:
        H.shutdown(llm)
    assert again["num_cached_tokens"] == 3 * H.CHUNK
    assert H.same_output(again, reference["A"])


def test_blocks_kept_in_dram_under_writeback_pressure_get_their_files_later(
        reference, model_dir, workdir):
    """writeback_max_fraction=0.125 of 8 DRAM-tier slots: one file write may be pending,
    so A's other chunks are kept in DRAM without a file (stores_writeback_full). With
    writeback_flush, later engine steps (any traffic) write them from the DRAM tier as
    the write-back frees up: all three files appear, nothing is lost to an eviction,
    and a fresh engine without a DRAM tier serves A from those files with the reference
    output."""
    root = os.path.join(workdir, "root_flush")
    ex = H.extra_config(root, dram_cache_bytes=8 * H.FILE_BYTES, writeback_max_fraction=0.125,
                        writeback_flush=True)
    llm = H.make_llm(model_dir, ex)
    try:
        first = H.generate(llm, A)
        H.drain(llm)
        _steps_until_files(llm, root, 3)
        s = H.manager(llm).stats()
    finally:
        H.shutdown(llm)
    assert H.same_output(first, reference["A"])
    assert s["stores_writeback_full"] >= 1 and s["flushes_planned"] >= 1, s
    assert s["stores_flushed"] == s["flushes_planned"], s
    assert s.get("dram_only_evicted", 0) == 0 and s["dram_writeback_pinned"] == 0, s
    assert len(H.cache_files(root)) == 3
    _fresh_engine_serves_a_from_disk(model_dir, root, reference)


def test_disk_admission_reuse_writes_a_file_once_a_block_is_read_again(
        reference, model_dir, workdir):
    """disk_admission=reuse: A's first run keeps its three chunks in the DRAM tier with no
    file; its repeat is a DRAM hit (same output) that proves them reused, and later engine
    steps write their files from the tier. A fresh engine without a DRAM tier then serves
    A from those files with the reference output. C, run once, never gets a file."""
    root = os.path.join(workdir, "root_reuse")
    llm = H.make_llm(model_dir, H.extra_config(root, dram_cache_bytes=8 * H.FILE_BYTES,
                                               disk_admission="reuse"))
    try:
        a1 = H.generate(llm, A)
        c1 = H.generate(llm, C)
        H.drain(llm)
        s1 = H.manager(llm).stats()
        files1 = H.cache_files(root)
        a2 = H.generate(llm, A)
        H.drain(llm)
        _steps_until_files(llm, root, 3)
        s2 = H.manager(llm).stats()
    finally:
        H.shutdown(llm)
    assert H.same_output(a1, reference["A"]) and H.same_output(a2, reference["A"])
    assert H.same_output(c1, reference["C"])
    assert files1 == set() and s1.get("stores_written", 0) == 0, s1
    assert s1["stores_disk_deferred"] == 6, s1  # A's three chunks and C's three
    assert a2["num_cached_tokens"] == 3 * H.CHUNK  # served by the DRAM tier
    assert s2["flushes_reused"] == 3 and s2["stores_flushed"] == 3, s2
    assert s2["stores_written"] == 3 and s2["dram_writeback_pinned"] == 0, s2
    assert len(H.cache_files(root)) == 3  # A's; C was never read again
    _fresh_engine_serves_a_from_disk(model_dir, root, reference)


def test_config_errors_name_the_key(model_dir, workdir):
    root = os.path.join(workdir, "root_cfg")
    r = H.run_proc({"model_dir": model_dir, "expect_error": [
        H.extra_config(root, io_depht=4),
        H.extra_config(root, eviction_policy="fifo"),
        H.extra_config(root, block_size=200),
        H.extra_config(root, staging_bytes=H.FILE_BYTES),
        H.extra_config(root, preload_lookahead=-1),
        H.extra_config(root, breakeven_table=5),
        H.extra_config(root, disk_min_prefix_tokens="4k"),
        H.extra_config(root, min_store_prefix_tokens=-1),
        H.extra_config(root, disk_admission="often"),
    ]})
    errs = r["errors"]
    assert all(e is not None for e in errs), errs
    # a ConfigError, raised by the engine or (vLLM plugin, issue 13 item 3) already while
    # vLLM validates KVTransferConfig, where pydantic wraps it: the message names the key
    named = ["unknown config key 'io_depht'", "'eviction_policy'", "'block_size'",
             "'staging_bytes'", "'preload_lookahead'", "'breakeven_table'",
             "'disk_min_prefix_tokens'", "'min_store_prefix_tokens'", "'disk_admission'"]
    for e, key in zip(errs, named, strict=True):
        assert ("ConfigError" in e or "py-kvcache config key" in e
                or "py-kvcache: unknown config key" in e), e
        assert key in e, (key, e)


def test_tensor_parallel_2(model_dir, workdir):
    """TP=2 on CPU (2 worker processes): each rank stores and loads its own files; the DRAM
    slot numbering chosen by the scheduler is valid on both ranks."""
    root = os.path.join(workdir, "root_tp2")
    r = H.run_proc({"model_dir": model_dir, "tp": 2,
                    "extra": H.extra_config(root, dram_cache_bytes=4 * H.FILE_BYTES),
                    "steps": [{"op": "generate", "prompt": "A", "tag": "miss"}, {"op": "drain"},
                              {"op": "generate", "prompt": "A", "tag": "dram"}, {"op": "drain"}]},
                   env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, timeout=300)
    miss, dram, s = r["results"]["miss"], r["results"]["dram"], r["stats"]["final"]
    assert miss["num_cached_tokens"] == 0 and dram["num_cached_tokens"] == FULL_HIT
    assert miss["tokens"] == dram["tokens"]
    assert H.same_output(miss, dram, tol=H.SPLIT_LOGPROB_TOL)
    assert s["stores_written"] == 6 and s["chunks_loaded_dram"] == 6, s  # 3 per rank
    assert s["hits_dram"] == 3
    spaces = sorted(d for d in os.listdir(root) if d.startswith("v"))
    assert len(spaces) == 2
    for d in spaces:
        assert len(H.cache_files(os.path.join(root, d))) == 3


def test_lru_admit_serves_a_loop_over_more_contexts_than_the_dram_tier(reference, model_dir,
                                                                       workdir):
    """eviction_policy=lru-admit on a real engine: A, B, C (9 blocks) visited round-robin
    4 times through a 5-slot DRAM tier, disk writes off (as when the break-even table says
    the disk never pays). Plain LRU would evict each prompt just before it comes back (0
    hits, tests/vllm/test_manager.py); here the filter turns itself on, later rounds are
    DRAM hits, and every output equals the recompute reference."""
    root = os.path.join(workdir, "root_admit")
    llm = H.make_llm(model_dir, H.extra_config(root, dram_cache_bytes=5 * H.FILE_BYTES,
                                               eviction_policy="lru-admit"))
    outs = []
    try:
        m = H.manager(llm)
        m.disk_stores = False
        for _ in range(4):
            for name, p in (("A", A), ("B", B), ("C", C)):
                outs.append((name, H.generate(llm, p)))
                H.drain(llm)
        st = m.stats()
    finally:
        H.shutdown(llm)
    for name, o in outs:
        assert H.same_output(o, reference[name]), name
    assert st["hits_dram"] >= 6 and st["stores_not_admitted"] > 0, st
    assert st["dram_admission_active"] == 1 and H.cache_files(root) == set()
    assert sum(o["num_cached_tokens"] for _, o in outs[3:]) >= 6 * H.CHUNK


def _decode_heavy_run(model_dir: str, root: str, prefilter: bool) -> dict:
    """8 concurrent 600-token prompts, prefilled in 512-token steps (chunk boundaries are
    crossed in the middle of prefills), then 200 decode steps (vLLM stores prompts only:
    ``offload_prompt_only``), on an engine whose store-job builder gets the prefiltered
    view (``prefilter``) or vLLM's whole batch. Records how many requests vLLM's builder
    was handed next to how many were scheduled, over all steps, and the keys of the
    store jobs it built in each step. Its patches are undone before it returns."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler as CS,
    )

    from kvcache_core.vllm import compat
    from kvcache_core.vllm.connector_scheduler import SchedulerSide

    seen = {"scheduled": 0, "handed": 0}
    jobs: list[list[tuple[bytes, ...]]] = []  # per step: the keys of each store job built
    view, build = SchedulerSide.store_view, CS._build_store_jobs

    def counting_view(self, so):
        v = view(self, so)
        seen["scheduled"] += len(so.num_scheduled_tokens)
        seen["handed"] += len(v.num_scheduled_tokens)
        return v

    def recording_build(self, so):
        out = build(self, so)
        jobs.append(sorted(tuple(j.dst_spec.keys) for j in out.values()))
        return out

    prompts = [[(i * 31 + j * 7) % 3900 + 100 for j in range(600)] for i in range(8)]
    sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compat, "STORE_JOB_PREFILTER", prefilter)
        mp.setattr(SchedulerSide, "store_view", counting_view)
        mp.setattr(CS, "_build_store_jobs", recording_build)
        # a fixed write-back share: with "auto" a store made while requests wait may keep
        # its block in DRAM only when the files lag, and this test counts files
        llm = H.make_llm(model_dir, H.extra_config(root, dram_cache_bytes=32 * H.FILE_BYTES,
                                                   writeback_max_fraction=0.5),
                         enable_prefix_caching=True, max_num_batched_tokens=512)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                use_tqdm=False)
            H.drain(llm)
            stats = H.manager(llm).stats()
        finally:
            H.shutdown(llm)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "stats": stats,
            "files": {os.path.relpath(f, root) for f in H.cache_files(root)}, "jobs": jobs,
            **seen}


def test_store_job_prefilter_stores_the_same_chunks(model_dir, workdir):
    """vLLM 0.26's store-job builder is handed only the requests whose tokens cross their
    next chunk boundary in the step (``SchedulerSide.store_view``): the same chunks are
    stored in the same steps (same store jobs, files and store counters) as when it
    walks the whole batch every step, and in this decode-heavy batch it sees a small
    fraction of the scheduled requests (vLLM's walk costs ~4 us a request and step on our
    CPU machine)."""
    on = _decode_heavy_run(model_dir, os.path.join(workdir, "root_prefilter_on"), True)
    off = _decode_heavy_run(model_dir, os.path.join(workdir, "root_prefilter_off"), False)
    assert on["tokens"] == off["tokens"]
    # the same store jobs in the same steps (not merely the same chunks by the end)
    assert on["jobs"] == off["jobs"] and sum(map(len, on["jobs"])) >= 8
    # 8 prompts x 600 tokens: chunks 0 and 1 of each
    assert len(on["files"]) == 16 and on["files"] == off["files"]
    for k in ("stores", "stores_dram"):
        assert on["stats"].get(k) == off["stats"].get(k) == 16, (k, on["stats"], off["stats"])
    assert off["handed"] == 0  # without the prefilter vLLM's builder never asks for a view
    assert on["scheduled"] > 8 * 190 and 8 <= on["handed"] <= on["scheduled"] // 10, on
