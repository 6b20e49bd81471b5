"""Block-key access patterns for the DRAM-tier policy tests (lists of chunk keys per
request, in prefix order)."""

from __future__ import annotations

import random


def loop(contexts: int, chunks: int, rounds: int) -> list[list[int]]:
    """``contexts`` shared contexts of ``chunks`` blocks visited round-robin."""
    return [[c * 1000 + i for i in range(chunks)] for _ in range(rounds)
            for c in range(contexts)]


def chat(sessions: int, turns: int, seed: int = 0) -> list[list[int]]:
    """Conversations: each turn's prompt is its session's history plus 1-3 new blocks."""
    rng, hist, out, n = random.Random(seed), {s: [] for s in range(sessions)}, [], 0
    for _ in range(turns):
        s = rng.randrange(sessions)
        for _ in range(rng.randint(1, 3)):
            n += 1
            hist[s].append(n)
        out.append(list(hist[s]))
    return out
