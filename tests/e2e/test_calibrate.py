"""`kvcache calibrate --model` end to end on real vLLM (CPU platform): it drives the
long-document measurements (recompute, DRAM-tier hit, disk hit from a fresh process),
writes a valid table, and a second run resumes instead of measuring again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from kvcache_core.breakeven import load_table

from . import helpers as H

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _calibrate(model_dir: str, root: str, out: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "kvcache_core.cli", "calibrate", "--model", model_dir,
         "--root", root, "--out", out, "--tokens", "256,512", "--docs", "1", "--repeats", "1",
         "--no-check"], env=env, capture_output=True, text=True, timeout=600)


def test_calibrate_measures_writes_a_table_and_resumes(model_dir, workdir, tmp_path):
    root = os.path.join(workdir, "calibrate_root")
    out = str(tmp_path / "table.json")
    p = _calibrate(model_dir, root, out)
    assert p.returncode == 0, p.stderr[-3000:]
    table = load_table(out)  # valid, versioned
    assert table.model == os.path.basename(model_dir)
    assert set(table.thresholds) == {"dram", "disk"}
    assert "[1/3] recompute" in p.stderr and "[3/3] kvcache_disk" in p.stderr
    with open(str(tmp_path / "table.run.json")) as f:
        run = json.load(f)
    cfgs = {r["config"] for r in run["results"] if "ttft_hit_s" in r}
    assert cfgs == {"recompute", "kvcache_dram", "kvcache_disk"}
    assert {r["tokens"] for r in run["results"]} == {256, 512}
    disk = [r for r in run["results"] if r["config"] == "kvcache_disk"]
    assert all(r["page_cache_dropped"] is not None for r in disk)
    assert all(r["ttft_first_hit_s"] > 0 for r in disk)
    # a second run resumes: nothing is measured again
    t0 = time.monotonic()
    p2 = _calibrate(model_dir, root, out)
    assert p2.returncode == 0, p2.stderr[-3000:]
    assert "already measured" in p2.stderr and "engine up" not in p2.stderr
    assert time.monotonic() - t0 < 120
    assert load_table(out).thresholds == table.thresholds
    assert H.cache_files(os.path.join(root, "kvcache_disk")) == set()  # cleaned up
