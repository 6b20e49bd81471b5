"""scripts/sim_dram_policy.py: the policy simulation behind docs/results/cpu/dram-policy-sim."""

from __future__ import annotations

import importlib.util
import os

from helpers.access_patterns import chat, loop

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "sim_dram_policy", os.path.join(REPO, "scripts", "sim_dram_policy.py"))
sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim)


def test_working_set_that_fits_always_hits_after_the_first_round():
    reqs = loop(3, 4, 3)
    for p in ("lru", "arc", "lru-tail", "arc-tail", "opt"):
        r = sim.simulate(reqs, 12, p)
        assert r["chunks_hit"] == 24 and r["stores"] == 12, (p, r)


def test_a_loop_larger_than_the_tier_defeats_lru_not_belady():
    reqs = loop(4, 8, 4)  # 32 distinct chunks through 20 slots
    assert sim.simulate(reqs, 20, "lru")["chunks_hit"] == 0
    assert sim.simulate(reqs, 20, "opt")["chunks_hit"] > 0
    assert sim.simulate(reqs, 20, "arc-tail")["hit_rate"] >= sim.simulate(reqs, 20,
                                                                           "arc")["hit_rate"]


def test_chunk_keys_chain_the_prefix():
    a = sim.chunk_keys(list(range(10)), 4)
    b = sim.chunk_keys([99] + list(range(1, 10)), 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same tokens, other prefix


def test_lru_admit_wins_loops_and_stays_near_lru_on_conversations():
    lp = loop(4, 8, 4)
    assert sim.simulate(lp, 20, "lru-admit")["chunks_hit"] > 0  # LRU: 0
    assert sim.simulate(lp, 20, "lru-admit")["stores"] < sim.simulate(lp, 20, "lru")["stores"]
    ch = chat(16, 400)
    lru = sim.simulate(ch, 80, "lru-tail")["hit_rate"]
    assert sim.simulate(ch, 80, "lru-admit")["hit_rate"] >= 0.8 * lru


def test_queue_protection_helps_a_loop_and_the_document_order_matters_more():
    """``-q<k>`` (preload_protect): over a loop larger than the tier, refreshing the next
    requests' blocks before each store keeps chunks that plain LRU evicts just before
    their use. And the twenty-sixth session's point: the same requests of two documents
    through a tier of 1.3 documents hit far less when the documents interleave than when
    each one's requests run together."""
    lp = loop(4, 8, 4)
    assert sim.simulate(lp, 20, "lru-tail")["chunks_hit"] == 0
    assert sim.simulate(lp, 20, "lru-tail-q3")["chunks_hit"] > 0
    assert (sim.simulate(lp, 20, "lru-admit-q3")["chunks_hit"]
            >= sim.simulate(lp, 20, "lru-admit")["chunks_hit"])

    def docs(order: str) -> list:
        return [[(d, c) for c in range(10)] for d in map(int, order.split(","))]

    grouped = sim.simulate(docs("1,1,1,0,0,0"), 13, "lru-admit")["chunks_hit"]
    mixed = sim.simulate(docs("1,0,1,0,1,0"), 13, "lru-admit")["chunks_hit"]
    assert grouped > 1.5 * mixed, (grouped, mixed)


def test_preload_order_report_orders_by_first_token_and_counts_switches(tmp_path):
    """scripts/preload_order_report.py: requests are ordered by TTFT, switches count only
    reusing requests, the simulated hits follow the order (grouped documents hit more
    than interleaved ones in a tier of 1.3 documents), correlations need 3 runs."""
    import json
    import subprocess
    import sys

    script = os.path.join(REPO, "scripts", "preload_order_report.py")
    grouped = {"config": "kvcache_nopreload", "hit_docs": [0, -1, 1, 0, 1, 0, 1],
               "ttft_hit_all": [1, 2, 5, 3, 6, 4, 7], "mean_ttft_reuse_s": 4.0,
               "disk_read_bytes": 2e9}
    mixed = {"config": "kvcache_preload", "hit_docs": [0, -1, 1, 0, 1, 0, 1],
             "ttft_hit_all": [1, 2, 3, 4, 5, 6, 7], "mean_ttft_reuse_s": 5.0,
             "disk_read_bytes": 3e9, "kv_extra": {"preload_protect": True}}
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"gpu": "H100", "results": [grouped, mixed]}))
    out = tmp_path / "o.json"
    p = subprocess.run([sys.executable, script, str(run), "--tier-chunks", "13",
                        "--doc-chunks", "10", "--json", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    res = json.loads(out.read_text())
    g, m = res["rows"]
    assert g["order"] == [0, -1, 0, 0, 1, 1, 1] and g["switches"] == 1
    assert m["order"] == [0, -1, 1, 0, 1, 0, 1] and m["switches"] == 5 and m["variant"]
    assert g["sim_chunks_hit"] > m["sim_chunks_hit"], (g, m)
    assert all(c["sim_hits_vs_disk_read"] is None for c in res["correlation"])
    assert "| kvcache_preload | yes | 1 | 5 |" in p.stdout
