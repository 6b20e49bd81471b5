"""scripts/sim_dram_policy.py: the policy simulation behind docs/results/cpu/dram-policy-sim."""

from __future__ import annotations

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "sim_dram_policy", os.path.join(REPO, "scripts", "sim_dram_policy.py"))
sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim)


def _loop(contexts: int, chunks: int, rounds: int) -> list[list[int]]:
    return [[c * 1000 + i for i in range(chunks)] for _ in range(rounds)
            for c in range(contexts)]


def test_working_set_that_fits_always_hits_after_the_first_round():
    reqs = _loop(3, 4, 3)
    for p in ("lru", "arc", "lru-tail", "arc-tail", "opt"):
        r = sim.simulate(reqs, 12, p)
        assert r["chunks_hit"] == 24 and r["stores"] == 12, (p, r)


def test_a_loop_larger_than_the_tier_defeats_lru_not_belady():
    reqs = _loop(4, 8, 4)  # 32 distinct chunks through 20 slots
    assert sim.simulate(reqs, 20, "lru")["chunks_hit"] == 0
    assert sim.simulate(reqs, 20, "opt")["chunks_hit"] > 0
    assert sim.simulate(reqs, 20, "arc-tail")["hit_rate"] >= sim.simulate(reqs, 20,
                                                                           "arc")["hit_rate"]


def test_chunk_keys_chain_the_prefix():
    a = sim.chunk_keys(list(range(10)), 4)
    b = sim.chunk_keys([99] + list(range(1, 10)), 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same tokens, other prefix
