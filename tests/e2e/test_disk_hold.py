"""``disk_load_hold_s`` against real vLLM 0.26 on the CPU platform: a waiting request
whose prefix must be read from disk waits while another request's disk load is in
flight, and the requests behind it that need no disk read go ahead.
"""

from __future__ import annotations

import os

import pytest

from . import helpers as H


def _hold_engine(model_dir: str, root: str, hold: float, tier_files: int = 8, **extra):
    """A and B stored under ``root``, then a fresh engine with three running slots, a
    DRAM tier of ``tier_files`` blocks (8: holds both), no preload and
    ``disk_load_hold_s=hold`` (``extra`` added to the connector config)."""
    H.store_prompts(model_dir, root, ["A", "B"])
    return H.make_llm(model_dir, H.extra_config(root, dram_cache_bytes=tier_files
                                                * H.FILE_BYTES, preload_lookahead=0,
                                                disk_load_hold_s=hold, **extra),
                      max_num_seqs=3)


#: per disk load of the last :func:`_run_batched`: the requests already reading from
#: disk when it began (``disk_load_requests``)
requests_started: list[int] = []


def _run_batched(llm, names: list[str], check_tier: bool = False):
    """Send the :data:`PROMPTS` ``names`` at once to ``llm``, wait for its writes, shut
    it down; returns (outputs, manager stats, ``started``: for each load that read from
    disk, the number of disk loads already in flight when it began). Checks that no disk
    load is left in flight and, with ``check_tier``, the DRAM tier's invariants."""
    try:
        mgr = H.manager(llm)
        requests_started.clear()
        started: list[int] = []
        orig = mgr.prepare_load

        def prepare_load(keys, req_context):
            before, reqs = mgr.disk_loads_in_flight, mgr.disk_load_requests
            spec = orig(keys, req_context)
            if mgr.disk_loads_in_flight > before:
                started.append(before)
                requests_started.append(reqs)
            return spec

        mgr.prepare_load = prepare_load
        outs = H.generate_many(llm, [H.PROMPTS[n] for n in names])
        H.drain(llm)
        s = mgr.stats()
        assert mgr.disk_loads_in_flight == 0 and mgr.disk_load_requests == 0
        if check_tier:
            mgr.dram.check()
    finally:
        H.shutdown(llm)
    return outs, s, started


def _check_batched(names: list[str], outs: list[dict], reference: dict) -> None:
    """Requests run in one batch: vLLM's CPU kernels give logprobs that differ by up to
    ~0.06 with the batch's shape (tests/e2e/test_preload.py runs one at a time for that
    reason); tokens must match exactly, and every prefix was loaded whole."""
    for n, o in zip(names, outs, strict=True):
        assert o["tokens"] == reference[n]["tokens"], n
        assert H.same_output(reference[n], o, tol=0.1), n
        assert o["num_cached_tokens"] == 768, o


@pytest.mark.parametrize("hold", [0, 30])
def test_disk_loads_run_one_request_at_a_time(model_dir, workdir, reference, hold):
    """A and B stored on disk; a fresh engine (three running slots, a DRAM tier that
    holds both) gets A, B, A at once. Without the hold, B's disk load starts in the
    same step as the first A's (two reads share the disk). With it, B waits until no
    other disk load is in flight, the second A waits for the first A's read into the
    DRAM tier (as without the hold) and loads from there: every disk load starts alone,
    each block is read once, and the tokens are recompute's."""
    llm = _hold_engine(model_dir, os.path.join(workdir, f"root_hold_{hold}"), hold)
    names = ["A", "B", "A"]
    outs, s, started = _run_batched(llm, names)
    _check_batched(names, outs, reference)
    assert len(started) == 2, started  # A and B each read from disk once
    assert s["chunks_loaded_disk"] == 6 and s["chunks_loaded_dram"] == 3, s
    assert s["load_failures"] == 0, s
    if hold:
        assert started == [0, 0], started
        assert s["loads_held"] >= 1 and s.get("loads_hold_expired", 0) == 0, s
    else:
        assert started[1] > 0, started  # B began beside A's read
        assert s.get("loads_held", 0) == 0, s


@pytest.mark.parametrize("hold", [0, 30])
def test_a_request_whose_blocks_are_being_read_joins_and_is_not_held(
        model_dir, workdir, reference, hold):
    """A stored on disk; a fresh engine without a DRAM tier gets A twice at once. The
    first A reads its 3 blocks through staging; the second A needs exactly those blocks,
    all being read right now, so even with the hold it is not held: it loads in the same
    step and joins the first one's reads in the worker (one read per block). Held, it
    would wait for those reads to end and then read the 3 blocks again (the
    fifty-client runs at 10k read 1.8x the distinct bytes with the hold)."""
    root = os.path.join(workdir, f"root_hold_join_{hold}")
    H.store_prompts(model_dir, root, ["A"])
    llm = H.make_llm(model_dir, H.extra_config(root, dram_cache_bytes=0,
                                               preload_lookahead=0,
                                               disk_load_hold_s=hold),
                     max_num_seqs=3)
    names = ["A", "A"]
    outs, s, started = _run_batched(llm, names)
    _check_batched(names, outs, reference)
    assert s["load_failures"] == 0, s
    assert s["chunks_loaded_disk"] == 6 and s["bytes_read"] == 3 * H.FILE_BYTES, s
    assert s["loads_joined"] == 3, s  # the second A's three loads joined the reads
    assert s.get("loads_held", 0) == 0, s
    assert len(started) == 2 and started[1] == 3, started  # beside the first A's reads
    if hold:
        assert s["loads_hold_joined"] == 1, s
    else:
        assert s.get("loads_hold_joined", 0) == 0, s


def test_two_requests_read_at_once_the_third_waits(model_dir, workdir, reference):
    """``disk_load_hold_requests=2``: A, B and C stored on disk; a fresh engine (three
    running slots, a DRAM tier that holds all three) gets A, B, C at once. B's read
    starts beside A's (two requests may read), C waits until fewer than two requests
    read from disk; each block is read once and the tokens are recompute's."""
    root = os.path.join(workdir, "root_hold_k2")
    H.store_prompts(model_dir, root, ["A", "B", "C"])
    llm = H.make_llm(model_dir, H.extra_config(root, dram_cache_bytes=12 * H.FILE_BYTES,
                                               preload_lookahead=0, disk_load_hold_s=30,
                                               disk_load_hold_requests=2),
                     max_num_seqs=3)
    names = ["A", "B", "C"]
    outs, s, started = _run_batched(llm, names)
    _check_batched(names, outs, reference)
    assert s["chunks_loaded_disk"] == 9 and s["load_failures"] == 0, s
    assert requests_started[:2] == [0, 1], requests_started  # B began beside A
    assert len(requests_started) == 3 and requests_started[2] < 2, requests_started
    assert s["loads_held"] >= 1 and s.get("loads_hold_expired", 0) == 0, s


@pytest.mark.parametrize(("when", "tier_files"), [(None, 4), ("no_slot", 4),
                                                 ("no_slot", 8)])
def test_no_slot_hold_waits_only_for_room_in_the_dram_tier(model_dir, workdir, reference,
                                                          when, tier_files):
    """``disk_load_hold_when="no_slot"``: A and B (3 blocks each) stored on disk; a fresh
    engine gets A, B, B at once. With a DRAM tier of 4 blocks and no hold, A's read
    takes 3 slots, the first B promotes 1 block and reads 2 through staging (kept
    nowhere), and the second B reads those 2 again: 8 blocks read. With the no_slot
    hold, the first B waits until A's read has left its slots reclaimable, then reads
    its 3 into the tier and the second B joins: 6 blocks, each read once. With a tier of
    8 blocks the tier has room for B beside A: no wait, B's read starts beside A's."""
    extra = {"disk_load_hold_when": when} if when else {}
    hold = 30 if when else 0
    llm = _hold_engine(model_dir, os.path.join(workdir, f"root_noslot_{when}_{tier_files}"),
                       hold, tier_files=tier_files, **extra)
    names = ["A", "B", "B"]
    outs, s, started = _run_batched(llm, names, check_tier=True)
    _check_batched(names, outs, reference)
    assert s["load_failures"] == 0, s
    if when is None:
        assert s["chunks_loaded_disk"] == 8, s  # the second B re-read 2 of B's blocks
        assert s.get("loads_held", 0) == 0, s
    elif tier_files == 4:
        assert s["chunks_loaded_disk"] == 6 and s["chunks_loaded_dram"] == 3, s
        assert started == [0, 0], started  # B's read began after A's
        assert s["loads_held"] >= 1 and s.get("loads_hold_expired", 0) == 0, s
    else:
        assert s["chunks_loaded_disk"] == 6 and s["chunks_loaded_dram"] == 3, s
        assert len(started) == 2 and started[1] > 0, started  # B's read beside A's
        assert s.get("loads_held", 0) == 0, s


def test_a_wait_ends_at_its_limit(model_dir, workdir, reference):
    """A disk load that never ends (the manager's count of disk loads in flight raised by
    one that no load will lower, as a stuck read of some other request would): held
    requests load anyway once ``disk_load_hold_s`` (0.2 s) has passed since their first
    wait, and give recompute's tokens; nothing waits forever."""
    llm = _hold_engine(model_dir, os.path.join(workdir, "root_hold_expiry"), 0.2)
    try:
        mgr = H.manager(llm)
        mgr.disk_loads_in_flight += 1
        mgr._disk_reqs["stuck"] += 1
        names = ["A", "B"]
        outs = H.generate_many(llm, [H.PROMPTS[n] for n in names])
        H.drain(llm)
        s = mgr.stats()
        assert mgr.disk_loads_in_flight == 1 and mgr.disk_load_requests == 1
        assert not H.scheduler_connector(llm)._sched._holds
    finally:
        H.shutdown(llm)
    _check_batched(names, outs, reference)
    assert s["loads_held"] == 2 and s["loads_hold_expired"] == 2, s
    assert s["chunks_loaded_disk"] == 6, s


@pytest.mark.parametrize("protect", [False, True])
def test_writes_behind_reads_in_a_queued_engine(model_dir, workdir, reference, protect):
    """``write_depth_reading=0`` (no new write-back file while a read waits or runs),
    alone and with ``preload_protect``: A and B stored on disk, then a fresh engine with
    one running slot gets A, C (new: it stores), B, A at once. Every request gives
    recompute's tokens, the reusing ones load their whole prefix, and C's files are
    written in the end (the writes wait for the reads, they are not lost)."""
    root = os.path.join(workdir, f"root_wdr_{int(protect)}")
    H.store_prompts(model_dir, root, ["A", "B"])
    files_before = H.cache_files(root)
    names = ["A", "C", "B", "A"]
    # writeback_max_fraction 0.5: with the default 'auto', while loads are in flight an
    # 8-block tier lets one block at a time wait for its file, and C's other two stay in
    # DRAM without one (by design; tests/vllm/test_manager.py covers that): here all
    # writes wait for the reads, and land
    s, _, outs = H.queued(model_dir, root, reference, names,
                          dram_cache_bytes=8 * H.FILE_BYTES, write_depth_reading=0,
                          writeback_max_fraction=0.5, preload_protect=protect)
    for n, o in zip(names, outs, strict=True):
        assert o["num_cached_tokens"] == (0 if n == "C" else 768), (n, o)
    new = H.cache_files(root) - files_before
    assert len(new) == 3, (sorted(new), s)  # C's three blocks, written after the reads
    assert s["load_failures"] == 0 and s["chunks_loaded_disk"] >= 6, s
