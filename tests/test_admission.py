"""kvcache_core.admission: the DRAM tier's self-enabling admission filter."""

from __future__ import annotations

import pytest
from helpers.access_patterns import chat, loop

from kvcache_core.admission import AdmissionDuel


def test_a_loop_larger_than_the_tier_turns_the_filter_on():
    duel = AdmissionDuel(20)
    for keys in loop(4, 8, 4):  # 32 blocks through 20 slots, round-robin
        duel.on_request(keys)
    assert duel.active and duel.score > 0
    assert duel.requests == 16 and 0 < duel.requests_active <= 16
    # a block asked by more requests stays; one asked once does not replace it
    assert not duel.admit("new", 0) and duel.freq[0] == 4
    duel.freq["hot"] = 9
    assert duel.admit("hot", 0)


def test_conversations_that_lru_serves_better_turn_it_off():
    """16 conversations through 80 slots: the newest turn's blocks are what the next
    turn reads, LRU hits more than the filter (by the shadows), so the filter ends off."""
    duel = AdmissionDuel(80)
    for keys in chat(16, 400):
        duel.on_request(keys)
    assert not duel.active and duel.score < 0
    assert duel.admit("anything", 1)  # off: every new block may evict the LRU victim


def test_frequencies_fade():
    duel = AdmissionDuel(4)  # halved every 40 blocks asked
    duel.on_request([1, 2])
    for i in range(20):
        duel.on_request([100 + i, 200 + i])
    assert 1 not in duel.freq and 2 not in duel.freq  # asked once, long ago: forgotten
    assert len(duel.freq) <= 40


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        AdmissionDuel(0)
