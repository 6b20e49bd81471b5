"""Break-even table: fitting, file validation, gate decisions."""

from __future__ import annotations

import json
import math
import os

import pytest

from kvcache_core.breakeven import (
    BreakevenTable,
    Gate,
    _crossing,
    fit_from_longdoc,
    load_table,
)
from kvcache_core.config import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_crossing():
    assert _crossing([(1024, 0.01), (4096, -0.01), (16384, -0.1)]) == 2560
    assert _crossing([(1024, -0.01), (4096, -0.02)]) == 0  # wins everywhere
    assert _crossing([(1024, -0.01), (4096, 0.02)]) is None  # loses at the largest size
    # a win at a small size that is followed by a loss does not count
    assert _crossing([(1024, -0.01), (4096, 0.01), (16384, -0.2)]) == math.ceil(
        4096 + 12288 * 0.01 / 0.21)


def test_fit_from_the_h200_run_refuses_disk_and_gates_dram():
    with open(os.path.join(REPO, "docs/results/h200/longdoc-llama-3.2-3b.json")) as f:
        run = json.load(f)
    t = fit_from_longdoc(run)
    assert t.thresholds["disk"] is None  # disk slower than recompute at every size there
    assert 1024 < t.thresholds["dram"] < 4096
    assert t.model == "llama-3.2-3b"


def test_table_round_trip_and_gate(tmp_path):
    p = tmp_path / "t.json"
    t = BreakevenTable(gpu="g", model="m", thresholds={"dram": 1000, "disk": None})
    p.write_text(json.dumps(t.to_json()))
    g = Gate(load_table(str(p)))
    assert g.allows("dram", 1000) and not g.allows("dram", 999)
    assert not g.allows("disk", 10**9)
    assert g.counters["gate_accepted_dram"] == 1 and g.counters["gate_refused_dram"] == 1
    assert g.counters["gate_refused_disk"] == 1


@pytest.mark.parametrize("content,msg", [
    ("not json", "is not JSON"),
    ('{"version": 9, "tiers": {}}', "version-1"),
    ('{"version": 1, "tiers": {"ssd": {}}}', "'tiers'"),
    ('{"version": 1, "tiers": {"disk": {"min_prefix_tokens": -5}}}', "non-negative"),
])
def test_bad_tables_name_the_key(tmp_path, content, msg):
    p = tmp_path / "t.json"
    p.write_text(content)
    with pytest.raises(ConfigError, match="breakeven_table") as e:
        load_table(str(p))
    assert msg in str(e.value)
