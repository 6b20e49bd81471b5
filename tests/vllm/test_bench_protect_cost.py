"""scripts/bench_protect_cost.py: the per-step cost of preload_protect behind
docs/results/cpu/protect-cost."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_protect_cost_reports_each_lookahead(tmp_path, vllm_available):
    out = tmp_path / "p.json"
    p = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_protect_cost.py"),
                        "--steps", "20", "--lookahead", "1,3", "--tokens", "4096",
                        "--dram-chunks", "20", "--json", str(out),
                        "--md", str(tmp_path / "p.md")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    d = json.loads(out.read_text())
    assert [r["lookahead"] for r in d["rows"]] == [1, 3]
    assert [r["keys_per_step"] for r in d["rows"]] == [16, 48]
    assert all(0 < r["median_us"] <= r["p90_us"] for r in d["rows"])
    assert "| 3 | 48 |" in (tmp_path / "p.md").read_text()
