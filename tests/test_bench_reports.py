"""Pure parts of the GPU benchmarks' reporting: the calibration's boundary sizes, the gate
report (rows, checks, predicted speed-up), the preload result file (merge), the load-phase
summary. No vLLM needed."""

from __future__ import annotations

import json

import pytest

from kvcache_core.bench import gate_report as G
from kvcache_core.bench import longdoc as L
from kvcache_core.cli import _boundary_sizes


def test_boundary_sizes_bracket_the_threshold():
    assert _boundary_sizes(None, {1024}, 65536) == []
    assert _boundary_sizes(0, {1024}, 65536) == []
    got = _boundary_sizes(2058, {1024, 4096}, 65536)
    assert got == [1536, 2560]  # 0.8x and 1.25x, multiples of 256
    assert all(d % 256 == 0 for d in got)
    # never outside the measured range nor a size already measured
    assert _boundary_sizes(60000, {65536}, 65536) == [48128]
    assert _boundary_sizes(1280, {1024}, 65536) == [1536]  # 1024 already measured


def _row(cfg, d, cold, hit, first=None):
    return {"config": cfg, "tokens": d, "ttft_cold_s": cold, "ttft_hit_s": hit,
            "ttft_cold_all": [cold], "ttft_hit_all": [hit], "ttft_first_hit_s": first}


RUN = {"machine": "m", "model": "x", "kv_bytes_per_token": 1000, "disk_read_gbps": 2.0,
       "pcie_h2d_gbps": 50.0, "results": [
           _row("recompute", 1024, 0.02, 0.02), _row("recompute", 65536, 2.0, 2.0),
           _row("kvcache_dram", 1024, 0.05, 0.03), _row("kvcache_dram", 65536, 2.5, 0.2),
           _row("kvcache_disk", 1024, 0.05, 0.08, 0.1), _row("kvcache_disk", 65536, 2.5, 3.0,
                                                              3.5),
           _row("kvcache_dram_gate", 1024, 0.05, 0.021), _row("kvcache_dram_gate", 65536,
                                                             2.5, 0.2),
           _row("kvcache_disk_gate", 1024, 0.05, 0.02, 0.03),
           _row("kvcache_disk_gate", 65536, 2.5, 2.0, 2.05)]}


def test_gate_rows_and_checks():
    rows = G.gate_rows(RUN)
    by = {(r["config"], r.get("source"), r["tokens"]): r["ttft_s"] for r in rows}
    assert by[("recompute", None, 1024)] == pytest.approx(0.02)
    assert by[("gate_off", "disk", 65536)] == 3.5  # first access, read from disk
    assert by[("gate_on", "disk", 65536)] == 2.05
    chk = {(c["source"], c["tokens"]): c for c in G.checks(rows)}
    assert chk[("dram", 1024)]["ratio"] == pytest.approx(0.021 / 0.02)
    assert chk[("dram", 1024)]["ok"]  # 1.05x is the bound
    assert chk[("disk", 1024)]["ratio"] == pytest.approx(1.5) and not chk[("disk", 1024)]["ok"]
    assert chk[("disk", 65536)]["ok"] and chk[("dram", 65536)]["ok"]


def test_disk_rows_use_the_cold_process_recompute_when_measured():
    run = dict(RUN, results=RUN["results"] + [
        _row("recompute_cold", 1024, 0.02, 0.03, 0.04),
        _row("recompute_cold", 65536, 2.0, 2.0, 2.1)])
    rows = G.gate_rows(run)
    assert {"config": "recompute", "source": "disk", "tokens": 1024, "ttft_s": 0.04} in rows
    chk = {(c["source"], c["tokens"]): c for c in G.checks(rows)}
    assert chk[("disk", 1024)]["best_s"] == pytest.approx(0.04)  # like for like
    assert chk[("disk", 1024)]["ratio"] == pytest.approx(0.75)
    assert chk[("dram", 1024)]["best_s"] == pytest.approx(0.02)  # warm recompute


def test_write_gate_files(tmp_path):
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"version": 1, "tiers": {"dram": {"min_prefix_tokens": 0},
                                                          "disk": {"min_prefix_tokens": None}}}))
    out = G.write_gate(RUN, str(table), str(tmp_path / "gate-x.json"))
    assert out["table"]["tiers"]["disk"]["min_prefix_tokens"] is None
    saved = json.loads((tmp_path / "gate-x.json").read_text())
    assert {r["config"] for r in saved["results"]} == {"recompute", "gate_on", "gate_off"}
    assert "| disk | 1024 |" in (tmp_path / "gate-x.md").read_text()


def test_predicted_speedup_model():
    rec = {1024: 0.02, 65536: 2.0}
    load = {1024: 0.03, 65536: 0.2}
    # ratio 1: exactly recompute / hit at the measured sizes
    assert G.predicted_speedup(rec, load, 65536, 1.0) == pytest.approx(2.0 / 0.2)
    # ratio 0: no prefix, nothing loaded: no change
    assert G.predicted_speedup(rec, load, 65536, 0.0) == pytest.approx(1.0)
    # interpolation is exact on a power law
    pts = {1000: 1.0, 4000: 16.0}
    assert G._interp_loglog(pts, 2000) == pytest.approx(4.0)


def test_summary_splits_reuse_and_fresh():
    s = L._summary([1.0, 2.0, 3.0, 10.0], [0, 1, -1, 0])
    assert s["mean_ttft_s"] == pytest.approx(4.0)
    assert s["mean_ttft_noreuse_s"] == pytest.approx(3.0)
    assert s["mean_ttft_reuse_s"] == pytest.approx(13 / 3)
    assert s["n_noreuse"] == 1 and s["n_requests"] == 4


def test_first_access_skips_fresh_and_repeats():
    row = {"ttft_hit_all": [5.0, 1.0, 9.0, 4.0], "hit_docs": [1, 1, -1, 0]}
    assert L._first_access(row) == [5.0, 4.0]


def test_write_preload_merges_by_workload_config_tokens(tmp_path):
    path = str(tmp_path / "preload-x.json")

    def run(cfg, mean):
        r = {"config": cfg, "tokens": 40960, "concurrency": 16, "mean_ttft_s": mean,
             "median_ttft_s": mean, "p90_ttft_s": mean, "mean_ttft_noreuse_s": None,
             "wall_s": 1.0, "peak_staging_bytes": 10, "staging_budget_bytes": 20,
             "disk_read_bytes": 5}
        return {"machine": "m", "model": "x", "disk_read_gbps": 2.0, "results": [r]}

    L.write_preload(run("kvcache_preload", 1.0), path, "longdoc")
    L.write_preload(run("kvcache_nopreload", 2.0), path, "longdoc")
    L.write_preload(run("kvcache_preload", 3.0), path, "longdoc")  # replaces its own row
    L.write_preload(run("kvcache_preload", 4.0), path, "mixed")
    rows = json.loads(open(path).read())["results"]
    got = {(r["workload"], r["config"]): r["mean_ttft_s"] for r in rows}
    assert got == {("longdoc", "kvcache_nopreload"): 2.0, ("longdoc", "kvcache_preload"): 3.0,
                   ("mixed", "kvcache_preload"): 4.0}
    assert "kvcache_nopreload" in open(str(tmp_path / "preload-x.md")).read()
