"""Break-even gate in real vLLM 0.26 (CPU platform): a refused tier is recomputed with
identical tokens and nothing is read; an accepted one loads; a missing table gates
nothing."""

from __future__ import annotations

import json
import os

import pytest

from kvcache_core.breakeven import BreakevenTable
from kvcache_core.vllm.manager import GATE_COUNTERS

from . import helpers as H


def _table(tmp_path, model_dir, disk, dram=0):
    p = str(tmp_path / "table.json")
    t = BreakevenTable(gpu="cpu", model=os.path.basename(model_dir),
                       thresholds={"dram": dram, "disk": disk})
    with open(p, "w") as f:
        json.dump(t.to_json(), f)
    return p


def _run(model_dir, root, table):
    llm = H.make_llm(model_dir, H.extra_config(root, breakeven_table=table))
    try:
        out = H.generate(llm, H.PROMPTS["A"])
        H.drain(llm)
        return out, H.manager(llm).stats()
    finally:
        H.shutdown(llm)


def test_gate_refuses_and_accepts_disk_hits(model_dir, workdir, reference, tmp_path):
    root = os.path.join(workdir, "root_gate")
    llm = H.make_llm(model_dir, H.extra_config(root))
    try:
        H.generate(llm, H.PROMPTS["A"])
        H.drain(llm)
    finally:
        H.shutdown(llm)
    # disk never worth it here: the 768-token prefix on disk is recomputed
    out, s = _run(model_dir, root, _table(tmp_path, model_dir, None))
    assert H.same_output(out, reference["A"]) and out["num_cached_tokens"] == 0
    assert s["gate_refused_disk"] == 1 and s["chunks_loaded_disk"] == 0, s
    # threshold 512 tokens: the 768-token prefix is loaded
    out, s = _run(model_dir, root, _table(tmp_path, model_dir, 512))
    assert H.same_output(out, reference["A"]) and out["num_cached_tokens"] == 768
    assert s["gate_accepted_disk"] == 1 and s["chunks_loaded_disk"] == 3, s
    # threshold above the prefix: refused again
    out, s = _run(model_dir, root, _table(tmp_path, model_dir, 1024))
    assert out["num_cached_tokens"] == 0 and s["gate_refused_disk"] == 1, s
    # a missing table: one warning, nothing gated
    out, s = _run(model_dir, root, str(tmp_path / "absent.json"))
    assert out["num_cached_tokens"] == 768 and "gate_refused_disk" not in s, s


def test_disk_never_worth_it_turns_disk_writes_off(model_dir, workdir, reference, tmp_path):
    """A table whose disk tier never wins: no file is written (cold requests do not pay for
    disk writes), the DRAM tier still stores and serves, output stays identical."""
    table = _table(tmp_path, model_dir, None)
    root = os.path.join(workdir, "root_gate_nodisk")
    # DRAM tier off: nothing is stored at all
    out, s = _run(model_dir, root, table)
    assert H.same_output(out, reference["A"])
    assert s["stores"] == 0 and s["stores_skipped_gate"] == 3, s
    assert H.cache_files(root) == set()
    # DRAM tier on: the second request is a DRAM hit, still no file on disk
    llm = H.make_llm(model_dir, H.extra_config(root, breakeven_table=table,
                                               dram_cache_bytes=8 * H.FILE_BYTES))
    try:
        H.generate(llm, H.PROMPTS["B"])
        H.drain(llm)
        out = H.generate(llm, H.PROMPTS["B"])
        H.drain(llm)
        s = H.manager(llm).stats()
    finally:
        H.shutdown(llm)
    assert H.same_output(out, reference["B"]) and out["num_cached_tokens"] == 768, s
    assert s["stores_dram"] == 3 and s["loads_dram"] == 3 and s["stores_written"] == 0, s
    assert H.cache_files(root) == set()


def test_prompts_below_the_dram_threshold_store_nothing(model_dir, workdir, reference,
                                                        tmp_path):
    """min_store_prefix_tokens=auto with a table whose DRAM threshold is 950 tokens: C
    (900 tokens) stores nothing (no DRAM slot, no file, counted) and its repeat is
    recomputed with the same output; A (1000 tokens) stores its three chunks."""
    table = _table(tmp_path, model_dir, 512, dram=950)
    root = os.path.join(workdir, "root_gate_floor")
    llm = H.make_llm(model_dir, H.extra_config(root, breakeven_table=table,
                                               dram_cache_bytes=8 * H.FILE_BYTES))
    try:
        m = H.manager(llm)
        c1 = H.generate(llm, H.PROMPTS["C"])
        H.drain(llm)
        s1 = m.stats()
        c2 = H.generate(llm, H.PROMPTS["C"])
        H.drain(llm)
        files_c = H.cache_files(root)
        H.generate(llm, H.PROMPTS["A"])
        H.drain(llm)
        s2 = m.stats()
    finally:
        H.shutdown(llm)
    assert H.same_output(c1, reference["C"]) and H.same_output(c2, reference["C"])
    assert s1["stores_skipped_below_floor"] == 3 and s1.get("stores", 0) == 0, s1
    assert s1.get("dram_cached", 0) == 0 and files_c == set()
    d = H.delta(s2, s1)
    assert d.get("stores_dram") == 3 and d.get("stores_skipped_below_floor", 0) == 3, d


@pytest.mark.parametrize("fast", [False, True])
def test_disk_backlog_gate_weighs_reads_in_flight_against_recompute(
        model_dir, workdir, reference, tmp_path, fast):
    """``disk_backlog_gate``: A (768 tokens, 3 blocks) stored on disk, a table whose
    static thresholds load every disk hit and whose recompute time of 768 tokens is 75 ms.
    With another request's disk read in flight (the manager's count raised by one that no
    load lowers, as a slow read of some other request would), A's 3 blocks plus the one
    ahead take 10 s at the table's disk bandwidth: A is recomputed (recompute's tokens,
    nothing read, counted gate_refused_backlog); at a bandwidth where they take 1 ms it
    loads (gate_accepted_backlog). Once no read is in flight, A loads in both cases."""
    root = os.path.join(workdir, f"root_backlog_{int(fast)}")
    H.store_prompts(model_dir, root, ["A"])
    four = 4 * H.FILE_BYTES
    t = BreakevenTable(gpu="cpu", model=os.path.basename(model_dir),
                       thresholds={"dram": 0, "disk": 0},
                       bandwidths={"disk_read_gbps": four / (1e6 if fast else 1e10)},
                       measurements=[{"tokens": 1024, "recompute_s": 0.1}])
    table = str(tmp_path / "table.json")
    with open(table, "w") as f:
        json.dump(t.to_json(), f)
    llm = H.make_llm(model_dir, H.extra_config(root, breakeven_table=table,
                                                disk_backlog_gate=True,
                                                preload_lookahead=0))
    try:
        mgr = H.manager(llm)
        mgr.disk_loads_in_flight += 1  # a read of another request, still in flight
        out = H.generate(llm, H.PROMPTS["A"])
        H.drain(llm)
        s1 = mgr.stats()
        mgr.disk_loads_in_flight -= 1  # that read is done: the disk is free
        out2 = H.generate(llm, H.PROMPTS["A"])
        H.drain(llm)
        s2 = mgr.stats()
        assert mgr.disk_loads_in_flight == 0
    finally:
        H.shutdown(llm)
    assert H.same_output(out, reference["A"]) and H.same_output(out2, reference["A"])
    if fast:
        assert out["num_cached_tokens"] == 768, s1
        assert s1["gate_accepted_backlog"] == 1 and s1["chunks_loaded_disk"] == 3, s1
        assert s1["gate_refused_backlog"] == 0, s1
    else:
        assert out["num_cached_tokens"] == 0, s1
        assert s1["gate_refused_backlog"] == 1 and s1["chunks_loaded_disk"] == 0, s1
        assert s1["gate_accepted_disk"] == 0 and s1["gate_refused_disk"] == 0, s1
    assert out2["num_cached_tokens"] == 768, s2
    assert s2["gate_accepted_backlog"] == s1["gate_accepted_backlog"] + 1, s2
    assert s2["chunks_loaded_disk"] == s1["chunks_loaded_disk"] + 3, s2
    assert s2["load_failures"] == 0, s2
    assert {k for k in s2 if k.startswith("gate_")} <= set(GATE_COUNTERS), s2


class _Prefilling:
    """Stand-in for a scheduled request still in prefill (what ``gate_balance`` weighs
    as the GPU's queue): only the two token counts the estimate reads."""

    def __init__(self, tokens: int) -> None:
        self.num_prompt_tokens = tokens
        self.num_computed_tokens = 0


def test_gate_balance_sends_a_disk_prefix_to_whichever_finishes_first(
        model_dir, workdir, reference, tmp_path):
    """``gate_balance``: A (768 tokens, 3 blocks) on disk, a table whose disk tier never
    wins idle (threshold null), recompute 0.1 s per 1,024 tokens, and a disk bandwidth at
    which A's 3 blocks take 1 s. With an idle GPU the GPU finishes first: A is recomputed
    (nothing read, gate_refused_balance). With 100k tokens of prefill queued on the GPU
    (~9.8 s by the table) the disk finishes first: A loads from disk
    (gate_accepted_balance) with the reference's tokens; with 10 s of other reads queued
    on the disk as well, the GPU again. With an idle GPU but 20 waiting requests in view
    behind A, each of which its recompute would delay, the disk; with 10, the GPU. The
    table's "never" does not turn disk writes off: a new prompt still gets its files."""
    root = os.path.join(workdir, "root_balance")
    H.store_prompts(model_dir, root, ["A"])
    t = BreakevenTable(gpu="cpu", model=os.path.basename(model_dir),
                       thresholds={"dram": 0, "disk": None},
                       bandwidths={"disk_read_gbps": 3 * H.FILE_BYTES / 1e9},
                       measurements=[{"tokens": 1024, "recompute_s": 0.1}])
    table = str(tmp_path / "table.json")
    with open(table, "w") as f:
        json.dump(t.to_json(), f)
    llm = H.make_llm(model_dir, H.extra_config(root, breakeven_table=table,
                                                gate_balance=True, preload_lookahead=0))
    try:
        sched = H.scheduler_connector(llm)._sched
        mgr = H.manager(llm)
        assert mgr.disk_stores, "a never-winning disk tier must keep writes with the balance"
        out1 = H.generate(llm, H.PROMPTS["A"])
        H.drain(llm)
        s1 = mgr.stats()
        H.reset_prefix_cache(llm)
        sched._prefilling["queued"] = _Prefilling(100_000)
        out2 = H.generate(llm, H.PROMPTS["A"])
        H.drain(llm)
        s2 = mgr.stats()
        # the same GPU queue, but 30 chunks of other requests' reads ahead on the disk
        # (10 s at the table's bandwidth, as slow reads still in flight would be): the
        # GPU finishes first again
        mgr.disk_loads_in_flight += 30
        out_b = H.generate(llm, H.PROMPTS["A"])
        H.drain(llm)
        s_b = mgr.stats()
        mgr.disk_loads_in_flight -= 30
        sched._prefilling.pop("queued", None)
        # nothing queued on the GPU, but 20 waiting requests in view behind A (the
        # patched scheduler's list; A itself not in it): recomputing A would make each
        # of them wait its 0.075 s, 21 x 0.075 s > the 1 s read: the disk
        sched._waiting_ids = [f"waiting-{i}" for i in range(20)]
        out_w = H.generate(llm, H.PROMPTS["A"])
        H.drain(llm)
        s_w = mgr.stats()
        # 10 behind: 11 x 0.075 s < 1 s, the GPU
        sched._waiting_ids = [f"waiting-{i}" for i in range(10)]
        out_w10 = H.generate(llm, H.PROMPTS["A"])
        H.drain(llm)
        s_w10 = mgr.stats()
        sched._waiting_ids = []
        before = H.cache_files(root)
        out3 = H.generate(llm, H.PROMPTS["C"])
        H.drain(llm)
        after = H.cache_files(root)
    finally:
        H.shutdown(llm)
    assert H.same_output(out1, reference["A"]) and out1["num_cached_tokens"] == 0, s1
    assert s1["gate_refused_balance"] == 1 and s1["gate_accepted_balance"] == 0, s1
    assert s1["chunks_loaded_disk"] == 0, s1
    assert H.same_output(out2, reference["A"]) and out2["num_cached_tokens"] == 768, s2
    assert s2["gate_accepted_balance"] == 1 and s2["chunks_loaded_disk"] == 3, s2
    assert s2["load_failures"] == 0, s2
    assert H.same_output(out_b, reference["A"]) and out_b["num_cached_tokens"] == 0, s_b
    assert s_b["gate_refused_balance"] == 2 and s_b["chunks_loaded_disk"] == 3, s_b
    assert H.same_output(out_w, reference["A"]) and out_w["num_cached_tokens"] == 768, s_w
    assert s_w["gate_accepted_balance"] == 2 and s_w["chunks_loaded_disk"] == 6, s_w
    assert H.same_output(out_w10, reference["A"]) and out_w10["num_cached_tokens"] == 0
    assert s_w10["gate_refused_balance"] == 3 and s_w10["chunks_loaded_disk"] == 6, s_w10
    assert H.same_output(out3, reference["C"]) and len(after - before) >= 1
    # every counter it reports is declared (vLLM's Prometheus logger asserts that)
    assert {k for k in s2 if k.startswith("gate_")} <= set(GATE_COUNTERS), s2
