"""Break-even table: fitting, file validation, gate decisions."""

from __future__ import annotations

import json
import math
import os

import pytest

from kvcache_core.breakeven import (
    BreakevenTable,
    Gate,
    QueueModel,
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
    """The run that docs/results/h200/breakeven-llama-3.2-3b.json was fitted from."""
    with open(os.path.join(REPO, "docs/results/h200/longdoc-llama-3.2-3b-run3.json")) as f:
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
    # staged blocks (queue-aware preload) use the DRAM threshold, counted apart
    assert g.passes("staged", 1000) and not g.passes("staged", 999)
    g.count("staged", True)
    assert g.counters["gate_accepted_staged"] == 1 and g.counters["gate_accepted_dram"] == 1


def test_queue_model_interpolates_recompute_and_compares_reads():
    t = BreakevenTable(gpu="g", model="m", thresholds={"dram": 0, "disk": None},
                       bandwidths={"disk_read_gbps": 2.0},
                       measurements=[{"tier": "dram", "tokens": 1000, "recompute_s": 0.1},
                                     {"tier": "disk", "tokens": 1000, "recompute_s": 0.1},
                                     {"tier": "dram", "tokens": 3000, "recompute_s": 0.5}])
    q = QueueModel(t)
    assert q.recompute_s(500) == pytest.approx(0.05)  # proportional below the first size
    assert q.recompute_s(2000) == pytest.approx(0.3)  # linear between sizes
    assert q.recompute_s(6000) == pytest.approx(1.0)  # proportional beyond the last
    assert q.read_s(10**9) == pytest.approx(0.5)
    assert q.worth(0.5, 10**9) and not q.worth(0.49, 10**9)
    with pytest.raises(ValueError, match="recompute"):
        QueueModel(BreakevenTable(gpu="g", model="m", thresholds={},
                                  bandwidths={"disk_read_gbps": 2.0}))
    with pytest.raises(ValueError, match="disk_read_gbps"):
        QueueModel(BreakevenTable(gpu="g", model="m", thresholds={},
                                  measurements=t.measurements))


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
