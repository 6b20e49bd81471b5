"""``gpu_kv_layout`` against real vLLM 0.26 (CPU platform): 'per_layer' serves hits with
the tokens of recompute, asks vLLM for no cross-layer KV tensor, and keeps its files
apart from the default layout's (other block bytes)."""

from __future__ import annotations

import os

from . import helpers as H


def test_per_layer_layout_hits_with_recompute_tokens(model_dir, workdir, reference):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    root = os.path.join(workdir, "per-layer")
    llm = H.make_llm(model_dir, H.extra_config(root, dram_cache_bytes=8 * H.FILE_BYTES,
                                               gpu_kv_layout="per_layer"))
    try:
        assert get_kv_transfer_group().prefer_cross_layer_blocks is False
        first = H.generate(llm, H.PROMPTS["A"])
        H.drain(llm)
        hit = H.generate(llm, H.PROMPTS["A"])
        H.drain(llm)
    finally:
        H.shutdown(llm)
    assert H.same_output(first, reference["A"])
    assert H.same_output(hit, reference["A"]) and hit["num_cached_tokens"] > 0
    # a default-layout engine on the same root finds none of those blocks
    llm = H.make_llm(model_dir, H.extra_config(root))
    try:
        assert get_kv_transfer_group().prefer_cross_layer_blocks is True
        other = H.generate(llm, H.PROMPTS["A"])
    finally:
        H.shutdown(llm)
    assert H.same_output(other, reference["A"]) and other["num_cached_tokens"] == 0
    # while a new per-layer engine reads them from disk
    llm = H.make_llm(model_dir, H.extra_config(root, gpu_kv_layout="per_layer"))
    try:
        again = H.generate(llm, H.PROMPTS["A"])
    finally:
        H.shutdown(llm)
    assert H.same_output(again, reference["A"]) and again["num_cached_tokens"] > 0
