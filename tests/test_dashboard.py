"""The Grafana dashboard (docs/grafana/py-kvcache.json) queries only series that vLLM's
/metrics exposes for py-kvcache, and is what scripts/make_dashboard.py writes."""

from __future__ import annotations

import json
import os
import re

import pytest
from helpers.kvutil import load_script

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_committed_dashboard_is_current():
    with open(os.path.join(REPO, "docs", "grafana", "py-kvcache.json")) as f:
        assert f.read() == load_script("make_dashboard").render(), "run scripts/make_dashboard.py"


def test_every_pykvcache_series_exists():
    pytest.importorskip("vllm")
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingHistogramMetadata

    from kvcache_core.vllm.spec import PyKVCacheSpec

    defs = PyKVCacheSpec.build_metric_definitions({})
    exposed = {n + ("_total" if isinstance(m, OffloadingCounterMetadata) else
                    "_bucket" if isinstance(m, OffloadingHistogramMetadata) else ""): n
               for n, m in defs.items()}
    used = set()
    for panel in json.loads(load_script("make_dashboard").render())["panels"]:
        for t in panel["targets"]:
            used |= set(re.findall(r"vllm:pykvcache_[a-z_]+", t["expr"]))
    assert used, "the dashboard queries no py-kvcache series"
    missing = sorted(used - set(exposed))
    assert not missing, f"not exposed by vLLM's /metrics: {missing}"
