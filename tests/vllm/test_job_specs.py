"""Fast tests of :mod:`kvcache_core.vllm.job_specs` (the LoadStoreSpecs of jobs)."""

from __future__ import annotations

import pytest


def test_store_spec_dram_only_validation():
    from kvcache_core.vllm.job_specs import PyKVStoreSpec

    with pytest.raises(ValueError, match="needs a DRAM-tier slot"):
        PyKVStoreSpec([b"k"], [-1], dram_only=[True])
    with pytest.raises(ValueError, match="differ in length"):
        PyKVStoreSpec([b"k"], [0], dram_only=[True, False])
    assert not PyKVStoreSpec([b"k"], [0], no_disk=True).writes_file(0)
