"""scripts/sim_disk_admission.py: the simulation behind docs/results/cpu/disk-admission-sim."""

from __future__ import annotations

import importlib.util
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))  # it imports sim_dram_policy
_spec = importlib.util.spec_from_file_location(
    "sim_disk_admission", os.path.join(REPO, "scripts", "sim_disk_admission.py"))
sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim)


def _doc(d: int, n: int) -> list[int]:
    return [d * 1000 + i for i in range(n)]


def test_one_off_requests_write_no_files_with_reuse():
    reqs = [_doc(d, 3) for d in range(20)]  # 20 different 3-chunk prompts, each once
    al = sim.simulate(reqs, gpu_cap=0, dram_cap=8, disk_cap=0, admission="all")
    re = sim.simulate(reqs, gpu_cap=0, dram_cap=8, disk_cap=0, admission="reuse")
    assert al["files_written"] == 60 and re["files_written"] == 0
    assert re["stores_disk_deferred"] == 60 and re["evicted_without_file"] == 60 - 8
    assert al["computed_rate"] == re["computed_rate"] == 1.0


def test_reuse_writes_a_block_read_from_dram_and_one_stored_twice():
    a, b = _doc(1, 2), _doc(2, 2)
    # a is read back while in the tier (file written then); b is evicted first and
    # stored again (second store: written at once), then served from disk
    reqs = [a, a, b, _doc(3, 2), _doc(4, 2), b, b]
    r = sim.simulate(reqs, gpu_cap=0, dram_cap=4, disk_cap=0, admission="reuse")
    assert r["files_written"] == 4  # a's two (read back), b's two (stored again)
    assert r["dram_hits"] == 4 and r["disk_hits"] == 0 and r["chunks_computed"] == 10
    assert r["evicted_without_file"] == 4  # b's first copies, then c's
    al = sim.simulate(reqs, gpu_cap=0, dram_cap=4, disk_cap=0, admission="all")
    assert al["files_written"] == 8  # every distinct chunk
    assert al["disk_hits"] == 2 and al["chunks_computed"] == 8  # b's second visit: disk


def test_short_requests_write_nothing_with_a_length_floor():
    reqs = [_doc(d, 2) for d in range(5)] + [_doc(9, 6), _doc(9, 6)]
    r = sim.simulate(reqs, gpu_cap=0, dram_cap=0, disk_cap=0, admission="all",
                     min_chunks=4)
    assert r["files_written"] == 6 and r["stores_skipped_short"] == 10
    assert r["disk_hits"] == 6  # the long prompt's repeat, from its files


def test_gpu_hits_come_first():
    reqs = [_doc(1, 3), _doc(1, 3)]
    r = sim.simulate(reqs, gpu_cap=10, dram_cap=4, disk_cap=0, admission="all")
    assert r["gpu_hits"] == 3 and r["dram_hits"] == 0 and r["disk_hits"] == 0
