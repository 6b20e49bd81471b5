"""``dram_load_sync`` inside real vLLM 0.26 (CPU platform): a prefix held entirely in the
DRAM tier is loaded in the step that computes its request (vLLM's synchronous load)
instead of parking the request for an asynchronous load. Outputs are compared with plain
recompute (no connector), engine steps are counted, and a DRAM slot that fails its check
is recomputed, never served."""

from __future__ import annotations

import os
import time

import pytest

from kvcache_core.config import ConfigError
from kvcache_core.vllm.metadata import PyKVCacheConnectorMetadata
from kvcache_core.vllm.options import parse_extra_config

from . import helpers as H

A, B = H.PROMPTS["A"], H.PROMPTS["B"]
FULL_HIT = 3 * H.CHUNK  # 1000-token prompts: 3 storage blocks


def _count_steps(llm) -> dict[str, list]:
    """Wrap the scheduler connector's ``build_connector_meta`` (one call per engine step)
    to record each step's synchronous load jobs."""
    conn = H.scheduler_connector(llm)
    seen: dict[str, list] = {"steps": []}
    orig = conn.build_connector_meta

    def counted(so):
        meta = orig(so)
        seen["steps"].append(list(meta.sync_loads)
                             if isinstance(meta, PyKVCacheConnectorMetadata) else [])
        return meta

    conn.build_connector_meta = counted
    return seen


def _hit_run(model_dir: str, root: str, sync: bool) -> dict:
    """A (miss, stored into the DRAM tier), then A again (DRAM hit): outputs, stats and the
    engine steps of the hit."""
    llm = H.make_llm(model_dir, H.extra_config(root, dram_cache_bytes=8 * H.FILE_BYTES,
                                               dram_load_sync=sync))
    try:
        m = H.manager(llm)
        first = H.generate(llm, A)
        H.drain(llm)
        s1 = m.stats()
        seen = _count_steps(llm)
        hit = H.generate(llm, A)
        steps = list(seen["steps"])
        H.drain(llm)
        s2 = m.stats()
    finally:
        H.shutdown(llm)
    return {"first": first, "hit": hit, "s1": s1, "s2": s2, "steps": steps}


@pytest.fixture(scope="module")
def runs(model_dir, workdir) -> dict[str, dict]:
    return {name: _hit_run(model_dir, os.path.join(workdir, f"sync-{name}"), sync)
            for name, sync in (("async", False), ("sync", True))}


def test_sync_dram_hit_same_output_one_step_earlier(runs, reference):
    a, s = runs["async"], runs["sync"]
    for r in (a, s):
        assert H.same_output(r["first"], reference["A"])
        assert H.same_output(r["hit"], reference["A"])
        assert r["hit"]["num_cached_tokens"] == FULL_HIT
        d = H.delta(r["s2"], r["s1"])
        assert d.get("hits_dram") == 3 and d.get("chunks_loaded_dram") == 3, d
        assert "chunks_failed" not in d and "bytes_read" not in d, d
        # the held pins are released once the workers report the copy done
        assert r["s2"]["loads_in_flight"] == 0
    # the synchronous hit: one load job marked synchronous, in the step that computes it
    sync_steps = [j for j in s["steps"] if j]
    assert len(sync_steps) == 1 and len(sync_steps[0]) == 1, s["steps"]
    assert not any(a["steps"]), a["steps"]
    assert H.delta(s["s2"], s["s1"]).get("loads_sync") == 1
    assert "loads_sync" not in H.delta(a["s2"], a["s1"])
    # the asynchronous hit spends one more engine step (parked while the load runs)
    assert len(s["steps"]) == len(a["steps"]) - 1, (s["steps"], a["steps"])


def test_sync_full_prompt_hit_stays_asynchronous(model_dir, workdir):
    """A prompt of exactly 3 storage blocks hits in full: a synchronous load would leave
    no token to compute in its step (vLLM asserts), so it stays asynchronous and vLLM
    recomputes the last token; the output equals recompute's."""
    prompt = A[:FULL_HIT]
    ref = H.make_llm(model_dir, None)
    try:
        expected = H.generate(ref, prompt)
    finally:
        H.shutdown(ref)
    root = os.path.join(workdir, "sync-full")
    llm = H.make_llm(model_dir, H.extra_config(root, dram_cache_bytes=8 * H.FILE_BYTES,
                                               dram_load_sync=True))
    try:
        H.generate(llm, prompt)
        H.drain(llm)
        seen = _count_steps(llm)
        hit = H.generate(llm, prompt)
        H.drain(llm)
    finally:
        H.shutdown(llm)
    assert not any(seen["steps"]), seen["steps"]  # no synchronous load job
    # served from the cache (vLLM counts the hit, then recomputes the last token)
    assert hit["num_cached_tokens"] in (FULL_HIT - 1, FULL_HIT)
    # vLLM's CPU kernels' logprobs depend on the prefill split (a one-token recompute
    # after a cached prefix vs a full prefill): tokens must match exactly
    assert H.same_output(hit, expected, tol=H.SPLIT_LOGPROB_TOL)


def test_sync_dram_hit_with_a_bad_slot_is_recomputed(model_dir, workdir, reference):
    """Every DRAM slot's header zeroed in the worker before the hit: the synchronous load
    reports the chunks failed in the same step, vLLM recomputes, the output is unchanged,
    and the bad blocks are dropped from the DRAM tier (never served again)."""
    root = os.path.join(workdir, "sync-bad")
    llm = H.make_llm(model_dir, H.extra_config(root, dram_cache_bytes=8 * H.FILE_BYTES,
                                               dram_load_sync=True))
    try:
        m = H.manager(llm)
        H.generate(llm, B)
        H.drain(llm)
        s1 = m.stats()
        assert llm.collective_rpc(_zero_dram_headers)[0] >= 3
        seen = _count_steps(llm)
        bad = H.generate(llm, B)
        H.drain(llm)
        s2 = m.stats()
        again = H.generate(llm, B)
        H.drain(llm)
        s3 = m.stats()
    finally:
        H.shutdown(llm)
    assert any(seen["steps"]), seen["steps"]  # it was a synchronous load
    assert H.same_output(bad, reference["B"])
    d = H.delta(s2, s1)
    assert d.get("dram_invalid") == 3 and d.get("chunks_failed") == 3, d
    assert s2["loads_in_flight"] == 0
    assert H.same_output(again, reference["B"])
    assert "chunks_failed" not in H.delta(s3, s2)  # the bad slots are never served again


def _zero_dram_headers(worker) -> int:
    """Runs in the worker (``collective_rpc``): zero the identity header of every DRAM-tier
    slot, as a corrupted host buffer would; returns the number of slots."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    w = get_kv_transfer_group()._work.worker
    views = w.reactor.pool.views
    n = len(views) - w.n_staging
    for i in range(w.n_staging, len(views)):
        views[i][:8] = bytes(8)
    return n


def test_dram_load_sync_must_be_a_bool():
    with pytest.raises(ConfigError, match="dram_load_sync"):
        parse_extra_config({"spec_name": "PyKVCacheSpec", "dram_load_sync": "yes"})
    assert parse_extra_config({"dram_load_sync": True}).dram_load_sync is True
    assert parse_extra_config({}).dram_load_sync is True  # the default since session 11
    assert parse_extra_config({}).dram_load_sync_set is False
    assert parse_extra_config({"dram_load_sync": False}).dram_load_sync is False


def test_dram_load_sync_on_a_vllm_without_the_internals(caplog):
    """Another vLLM's offloading scheduler without the internals: the default falls back
    to asynchronous loads with a warning, an explicit true is refused by name."""
    from types import SimpleNamespace

    from kvcache_core.vllm.connector_scheduler import dram_load_sync_supported

    full = SimpleNamespace(_current_batch_load_jobs=[], _jobs={}, _req_status={},
                           update_connector_output=lambda *_: None)
    bare = SimpleNamespace(_jobs={})
    default = parse_extra_config({})
    explicit = parse_extra_config({"dram_load_sync": True})
    assert dram_load_sync_supported(full, default) is True
    assert dram_load_sync_supported(full, explicit) is True
    with caplog.at_level("WARNING", logger="vllm.pykvcache"):
        assert dram_load_sync_supported(bare, default) is False
    assert "_req_status" in caplog.text and "asynchronously" in caplog.text
    with pytest.raises(ConfigError, match="dram_load_sync.*_current_batch_load_jobs"):
        dram_load_sync_supported(bare, explicit)


CONTEXTS = [[(i * m + c) % 3900 + 100 for i in range(800)]
            for m, c in ((7919, 1), (104729, 2), (1299709, 3), (15485863, 4))]


def _turn(ctx: list[int], r: int, j: int) -> list[int]:
    return ctx + [(r * 31 + j * 17 + k * 13) % 3900 + 100 for k in range(40 + j)]


def _prefix_cache_llm(model_dir: str, root: str, **extra):
    """An engine with vLLM's GPU prefix cache ON with room for about 2 contexts (it
    thrashes), 4 running requests, and a DRAM tier that holds every context."""
    return H.make_llm(model_dir, H.extra_config(root, dram_cache_bytes=16 * H.FILE_BYTES,
                                                **extra),
                      enable_prefix_caching=True, max_num_seqs=4, num_gpu_blocks_override=16,
                      max_model_len=16 * 128)


def _prefix_cache_run(model_dir: str, root: str, sync: bool) -> dict:
    """4 shared contexts x 3 rounds, the turns of a round submitted at once, on
    :func:`_prefix_cache_llm`; a pause longer than the watchdog's limit before each round."""
    llm = _prefix_cache_llm(model_dir, root, dram_load_sync=sync, io_timeout_s=0.25)
    try:
        outs = []
        for r in range(3):
            time.sleep(0.8)  # idle: the reactor sleeps past the watchdog's 0.5 s
            outs += H.generate_many(llm, [_turn(c, r, j) for j, c in enumerate(CONTEXTS)])
            H.drain(llm)
        s = H.manager(llm).stats()
    finally:
        H.shutdown(llm)
    return {"outs": outs, "stats": s}


def test_sync_dram_hits_with_gpu_prefix_cache_and_concurrency(model_dir, workdir):
    """The production setting (GPU prefix cache on, several requests per step). vLLM
    enters a synchronous load's blocks in its prefix cache before the connector builds
    the load job; the offloading scheduler took them for computed and built jobs
    without blocks, so requests computed on KV never loaded (wrong tokens, found by the
    tenth session's replay). Synchronous and asynchronous runs must give the same tokens
    and logprobs, every synchronous hit must load its chunks, and the engine stays
    healthy across idle pauses longer than the watchdog's limit."""
    a = _prefix_cache_run(model_dir, os.path.join(workdir, "pc-async"), False)
    s = _prefix_cache_run(model_dir, os.path.join(workdir, "pc-sync"), True)
    for x, y in zip(a["outs"], s["outs"], strict=True):
        assert x["num_cached_tokens"] == y["num_cached_tokens"]
        assert x["tokens"] == y["tokens"] and H.same_output(x, y)
    later = s["outs"][len(CONTEXTS):]
    assert all(o["num_cached_tokens"] == 768 for o in later), \
        [o["num_cached_tokens"] for o in later]
    st = s["stats"]
    assert st["loads_sync"] >= len(CONTEXTS), st
    assert st["chunks_loaded_dram"] == st["loads_dram"] > 0, st
    assert st["healthy"] == 1 and not st.get("reactor_stalled"), st
    assert st["loads_in_flight"] == 0
    assert a["stats"]["healthy"] == 1 and not a["stats"].get("loads_sync")


def test_sync_bad_slot_with_gpu_prefix_cache_is_recomputed(model_dir, workdir):
    """A synchronous DRAM hit whose slots fail their check, with the GPU prefix cache on:
    vLLM has already entered the loaded range in its prefix cache, so its sync-failure
    recovery must evict those blocks and recompute; later requests of the same context
    (GPU prefix hits on those blocks, or new loads) give the tokens of a run without the
    corruption."""
    ctx = CONTEXTS[0]

    def run(root: str, corrupt: bool) -> list[dict]:
        llm = _prefix_cache_llm(model_dir, root, dram_load_sync=True)
        try:
            outs = [H.generate(llm, _turn(ctx, 0, 0))]
            H.drain(llm)
            H.reset_prefix_cache(llm)  # the next turn must come from the DRAM tier
            if corrupt:
                assert llm.collective_rpc(_zero_dram_headers)[0] >= 3
            outs += H.generate_many(llm, [_turn(ctx, 1, j) for j in range(3)])
            H.drain(llm)
            outs.append(H.generate(llm, _turn(ctx, 2, 0)))
            H.drain(llm)
            s = H.manager(llm).stats()
        finally:
            H.shutdown(llm)
        return outs + [s]

    good = run(os.path.join(workdir, "pc-bad-ref"), False)
    bad = run(os.path.join(workdir, "pc-bad"), True)
    sg, sb = good.pop(), bad.pop()
    assert sg["loads_sync"] >= 1 and sb["loads_sync"] >= 1, (sg, sb)
    assert sb["dram_invalid"] >= 3 and sb["chunks_failed"] >= 3, sb
    for x, y in zip(good, bad, strict=True):
        assert x["tokens"] == y["tokens"]
        assert H.same_output(x, y, tol=H.SPLIT_LOGPROB_TOL)
