"""Pure parts of the GPU benchmarks' reporting: the calibration's boundary sizes, the gate
report (rows, checks, predicted speed-up), the preload result file (merge), the load-phase
summary; the SCBench-like workload's turn schedule, process-tree sampler, rows, table and
plot. No vLLM needed, except the one end-to-end run of ``longdoc --workload scbench`` on the
CPU platform (marked slow + vllm)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from kvcache_core.bench import gate_report as G
from kvcache_core.bench import longdoc as L
from kvcache_core.bench import scbench as SC
from kvcache_core.cli import _boundary_sizes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    # a --variant of a preload configuration is a row too (its base and keys kept), and
    # the plot orders it next to its base; a variant of another configuration is not
    v = run("kvcache_preload_join", 5.0)
    v["results"][0].update(base="kvcache_preload", kv_extra={"join_promotions": True})
    o = run("kvcache_dram_x", 6.0)
    o["results"][0]["base"] = "kvcache_dram"
    v["results"] += o["results"]
    L.write_preload(v, path, "longdoc")
    rows = json.loads(open(path).read())["results"]
    (j,) = [r for r in rows if r["config"] == "kvcache_preload_join"]
    assert j["base"] == "kvcache_preload" and j["kv_extra"] == {"join_promotions": True}
    assert j["mean_ttft_s"] == 5.0 and not any(r["config"] == "kvcache_dram_x" for r in rows)
    assert "kvcache_preload_join" in open(str(tmp_path / "preload-x.md")).read()


# ---------------------------------------------------------------- SCBench-like workload
def test_scbench_turns_round_robin_bounded_and_after_previous_answer():
    """Turns go out in round-robin order, at most `concurrency` in flight, and a context's
    turn r only after its turn r-1 answered; each prompt = context + its own question."""
    n, rounds, conc = 4, 3, 2
    contexts = [[100 + c] * 5 for c in range(n)]
    questions = [[1000 + k] * 2 for k in range(n * rounds)]
    events: list[tuple[str, str, float]] = []
    inflight = peak = 0

    async def submit(ids: list[int], rid: str) -> float:
        nonlocal inflight, peak
        r, c = (int(x[1:]) for x in rid.split("-")[1:])
        assert ids == contexts[c] + questions[r * n + c], rid
        inflight += 1
        peak = max(peak, inflight)
        events.append(("start", rid, time.monotonic()))
        await asyncio.sleep(0.01 * (1 + (c % 2)))  # uneven service times
        inflight -= 1
        events.append(("end", rid, time.monotonic()))
        return 0.01

    turns = asyncio.run(SC.run_turns(submit, contexts, questions, rounds, conc, "t"))
    assert [(t["round"], t["ctx"]) for t in turns] == [(r, c) for r in range(rounds)
                                                       for c in range(n)]
    assert all(t["ttft_s"] == 0.01 for t in turns)
    assert peak == conc
    starts = [rid for kind, rid, _ in events if kind == "start"]
    assert starts[:n] == [f"t-r0-c{c}" for c in range(n)]  # round 0 in order
    pos = {rid: i for i, (_, rid, _) in enumerate(events)}
    for r in range(1, rounds):
        for c in range(n):
            done_prev = [i for i, e in enumerate(events)
                         if e[:2] == ("end", f"t-r{r - 1}-c{c}")][0]
            assert pos[f"t-r{r}-c{c}"] > done_prev  # sent after the previous answer
    by = {(t["round"], t["ctx"]): t["submit"] for t in turns}
    assert by[(0, 0)] <= by[(0, 1)] <= by[(1, 0)]


def test_scbench_failed_turn_fails_the_run_without_hanging():
    async def submit(ids: list[int], rid: str) -> float:
        if rid.endswith("r0-c1"):
            raise RuntimeError("boom")
        return 0.0

    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(asyncio.wait_for(
            SC.run_turns(submit, [[1], [2]], [[9]] * 4, 2, 2, "t"), 5))


def test_throughput_of_a_cumulative_counter():
    mids, rates = SC.throughput([0.0, 0.5, 1.0, 1.0, 2.0], [0, 100, 100, 150, 350])
    assert mids == [0.25, 0.75, 1.5]  # the zero-length interval is skipped
    assert rates == [200.0, 0.0, 200.0]
    assert SC.throughput([1.0], [5]) == ([], [])


def _wrow(turns):
    return {"tokens": 1024, "concurrency": 2, "docs": 2, "rounds": 2, "question_tokens": 8,
            "turns": turns}


TURNS = [{"round": 0, "ctx": 0, "submit": 100.0, "ttft_s": 2.0},
         {"round": 0, "ctx": 1, "submit": 100.0, "ttft_s": 4.0},
         {"round": 1, "ctx": 0, "submit": 102.0, "ttft_s": 1.0},
         {"round": 1, "ctx": 1, "submit": 104.0, "ttft_s": 3.0}]  # last answer at 107


def test_scbench_row_summary_disk_bytes_and_series():
    t = [96.0, 97.5, 99.9, 101.0, 104.0, 107.2, 108.0, 110.0]
    samples = {"t": t,
               "rss_bytes": [10, 11, 12, 13, 14, 15, 16, 17],
               "pss_bytes": [5, 6, 7, 9, 8, 7, 6, 5],
               "read_bytes": [1000, 1500, 2000, 2600, 5000, 9000, 9100, 9200],
               "system_used_bytes": [50] * 8}
    r = SC.scbench_row("kvcache_preload", _wrow(TURNS), samples, 1000, 1331)
    assert r["workload"] == "scbench" and r["config"] == "kvcache_preload"
    assert r["mean_ttft_s"] == pytest.approx(2.5)
    assert r["mean_ttft_noreuse_s"] == pytest.approx(3.0)  # round 0: cold, storing
    assert r["mean_ttft_reuse_s"] == pytest.approx(2.0)
    assert r["n_requests"] == 4 and r["n_noreuse"] == 2
    assert r["wall_s"] == pytest.approx(7.0)
    # read_bytes from the last sample at/before the first submit (99.9) to the first one
    # at/after the last answer (107.2)
    assert r["disk_read_bytes"] == 9000 - 2000
    assert r["kv_bytes"] == 1024 * 1000 and r["working_set_bytes"] == 2 * 1024 * 1000
    assert r["dram_budget_bytes"] == 1331
    # PSS (not RSS) when the kernel gives it; peak inside the turns
    assert r["peak_host_mem_bytes"] == 9 and r["host_mem_start_bytes"] == 7
    s = r["series"]  # within 2 s of the turns, seconds from the first submit
    assert s["t_s"] == pytest.approx([-0.1, 1.0, 4.0, 7.2, 8.0])
    assert s["read_bytes"] == [2000, 2600, 5000, 9000, 9100]
    assert [x["submit_s"] for x in r["turns"]] == [0.0, 0.0, 2.0, 4.0]
    json.dumps(r)  # serialisable as it is


def test_scbench_row_edges():
    r = SC.scbench_row("native_fs", _wrow(TURNS), None, 1000)
    assert r["disk_read_bytes"] is None and r["series"] is None
    assert r["mean_ttft_s"] == pytest.approx(2.5)
    # the process ended before a sample after the last answer: the last sample counts;
    # no PSS: RSS
    samples = {"t": [99.0, 103.0], "rss_bytes": [3, 4], "pss_bytes": [0, 0],
               "read_bytes": [10, 70], "system_used_bytes": [1, 2]}
    r = SC.scbench_row("native_fs", _wrow(TURNS), samples, 1000)
    assert r["disk_read_bytes"] == 60 and r["peak_host_mem_bytes"] == 4
    assert r["host_mem_start_bytes"] == 3 and r["peak_system_used_bytes"] == 2


def test_tree_sampler_sums_the_process_tree(tmp_path):
    """A child that starts a grandchild; both allocate 40 MB: the tree's RSS counts both,
    read_bytes never goes down, samples stop when the tree is gone."""
    code = ("import subprocess, sys, time; x = bytearray(40 << 20); "
            "p = subprocess.Popen([sys.executable, '-c', "
            "'import time; x = bytearray(40 << 20); time.sleep(1.5)']); "
            "time.sleep(1.0); print('ok', flush=True); p.wait()")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    sampler = SC.TreeSampler(p.pid, 0.05).start()
    assert p.stdout is not None and p.stdout.readline().strip() == "ok"
    time.sleep(0.2)
    assert len(SC.tree_pids(p.pid)) == 2
    p.wait()
    time.sleep(0.2)
    s = sampler.stop()
    assert len(s["t"]) >= 10
    assert s["t"] == sorted(s["t"])
    assert max(s["rss_bytes"]) >= 80 << 20  # child + grandchild
    assert all(b >= a for a, b in zip(s["read_bytes"], s["read_bytes"][1:], strict=False))
    assert all(v > 0 for v in s["system_used_bytes"])
    assert SC.tree_pids(p.pid) == []
    if os.path.exists("/proc/self/smaps_rollup"):
        assert max(s["pss_bytes"]) >= 80 << 20


def test_window_delta_cuts_at_the_end_of_the_sample_before_the_window():
    """A sample takes time (its /proc reads): the one before a window must have FINISHED
    before the window began, or reads that happened while it was being taken (after the
    window began) would count as before the window. The sample after the window must have
    BEGUN after it ended. Samples without ``t_end`` count as instantaneous."""
    samples = {"t": [0.0, 1.0, 2.0], "t_end": [0.1, 1.6, 2.1], "read_bytes": [0, 100, 150]}
    # sample 1 began before t0=1.5 but finished after it: its 100 may include window reads
    assert SC.window_delta(samples, "read_bytes", 1.5, 1.9) == 150
    assert SC.window_delta(samples, "read_bytes", 1.7, 1.9) == 50
    # sample 2 began after 1.9 but not after 2.05: the window runs to the last sample
    assert SC.window_delta(samples, "read_bytes", 1.7, 2.05) == 50
    del samples["t_end"]
    assert SC.window_delta(samples, "read_bytes", 1.5, 1.9) == 50
    # the scbench row cuts its disk window the same way
    turns = [{"round": 0, "ctx": 0, "submit": 1.5, "ttft_s": 0.4}]
    wrow = {"tokens": 8, "concurrency": 1, "docs": 1, "rounds": 1, "question_tokens": 1,
            "turns": turns}
    full = {"t": [0.0, 1.0, 2.0], "t_end": [0.1, 1.6, 2.1], "read_bytes": [0, 100, 150],
            "rss_bytes": [1, 1, 1], "pss_bytes": [1, 1, 1], "system_used_bytes": [1, 1, 1]}
    assert SC.scbench_row("x", wrow, full, 1)["disk_read_bytes"] == 150


def test_sampled_process_waits_for_a_sample_after_its_last_request(tmp_path):
    """The handshake: the sampled process announces that its requests are done
    (``await_sample``) and returns once a sample begun after the announcement finished;
    without a sampler it gives up after its timeout (False)."""
    hs = str(tmp_path / "part.json")
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        sampler = SC.TreeSampler(p.pid, 0.3, handshake=hs).start()
        time.sleep(0.1)
        t_announce = time.monotonic()
        assert asyncio.run(SC.await_sample(hs, 1, timeout=10))
        took = time.monotonic() - t_announce
        assert asyncio.run(SC.await_sample(hs, 2, timeout=10))  # each round its own
        s = sampler.stop()
    finally:
        p.kill()
        p.wait()
    assert took < 5.0, took  # a sampling period and one sample, not the timeout
    assert any(t >= t_announce for t in s["t"])
    assert len(s["t_end"]) == len(s["t"]) and all(
        e >= b for b, e in zip(s["t"], s["t_end"], strict=True))
    assert not asyncio.run(SC.await_sample(str(tmp_path / "none.json"), 1, timeout=0.2))


def _sc_run(rows):
    return {"machine": "m", "model": "x", "disk_read_gbps": 2.0, "results": rows}


def _sc_rows():
    t = [99.0, 100.5, 103.0, 107.5]
    out = []
    for cfg, rb in (("native_fs", 10_000), ("kvcache_preload", 500)):
        samples = {"t": t, "rss_bytes": [1, 2, 3, 4], "pss_bytes": [1, 2, 3, 4],
                   "read_bytes": [0, rb // 2, rb, rb], "system_used_bytes": [5, 5, 6, 6]}
        r = SC.scbench_row(cfg, _wrow(TURNS), samples, 1000, 1331)
        r.update(peak_staging_bytes=None if cfg == "native_fs" else 10,
                 staging_budget_bytes=None if cfg == "native_fs" else 20)
        out.append(r)
    return out


def test_jobs_split_cold_process_configs_into_store_and_load():
    assert L._jobs(["recompute", "kvcache_disk", "kvcache_dram"], "longdoc") == [
        ("recompute", "both"), ("kvcache_disk", "store"), ("kvcache_disk", "load"),
        ("kvcache_dram", "both")]
    # scbench: one process per configuration, every turn in it
    assert L._jobs(["kvcache_preload", "native_fs"], "scbench") == [
        ("kvcache_preload", "both"), ("native_fs", "both")]


def test_a_failed_store_phase_skips_its_load_phase(monkeypatch):
    """native_fs's store phase died (vLLM's tiering KeyError, twice on the GPU): its load
    phase is not run; the process spawned ahead for it is killed and the next
    configuration's is spawned ahead instead; jobs stay in order."""
    made, cancelled = [], []

    class FakeChild:
        def __init__(self, args, config, phase, seq):
            self.config, self.phase, self.seq = config, phase, seq
            made.append((config, phase))

        def cancel(self):
            cancelled.append((self.config, self.phase))

    monkeypatch.setattr(L, "_Child", FakeChild)
    args = SimpleNamespace(_jobs=L._jobs(["native_fs", "kvcache_disk"], "longdoc"),
                           _job_pos=1, no_prespawn=False)
    args._pre = FakeChild(args, "native_fs", "load", 1)
    L._next_child(args, "native_fs", "load", skip=True)
    assert cancelled == [("native_fs", "load")]
    assert made[-1] == ("kvcache_disk", "store") and args._pre.seq == 2
    assert args._job_pos == 2
    with pytest.raises(RuntimeError, match="not the run's next one"):
        L._next_child(args, "native_fs", "load", skip=True)
    args._job_pos, args._pre, args.no_prespawn = 3, None, True  # the last job: nothing ahead
    L._next_child(args, "kvcache_disk", "load", skip=True)
    assert args._pre is None and args._job_pos == 4


def test_rounds_schedule_alternates_the_order():
    assert L._schedule(["a", "b", "c"], 1) == [("a", 1), ("b", 1), ("c", 1)]
    assert L._schedule(["a", "b"], 3) == [("a", 1), ("b", 1), ("b", 2), ("a", 2),
                                          ("a", 3), ("b", 3)]


def test_merge_rounds_medians_and_keeps_the_rounds():
    def row(cfg, d, rnd, cold, hit, first=None):
        return {"config": cfg, "tokens": d, "round": rnd, "ttft_cold_s": cold,
                "ttft_hit_s": hit, "ttft_first_hit_s": first, "ttft_cold_all": [cold],
                "ttft_hit_all": [hit, hit], "hit_docs": [0, 1]}

    raw = [row("a", 1024, 1, 0.10, 0.05), row("a", 4096, 1, 0.4, 0.2),
           row("b", 1024, 1, 0.11, 0.07, 0.3), row("b", 1024, 2, 0.13, 0.02, 0.1),
           row("a", 1024, 2, 0.30, 0.04), row("b", 1024, 3, 0.12, 0.03, None),
           {"config": "c", "error": "engine run failed"},
           {"config": "c", "error": "engine run failed"}]
    got = L.merge_rounds(raw)
    assert [(r["config"], r.get("tokens")) for r in got] == [
        ("a", 1024), ("a", 4096), ("b", 1024), ("c", None)]
    a, a4, b, c = got
    assert a["ttft_cold_s"] == pytest.approx(0.20) and a["ttft_cold_s_rounds"] == [0.10, 0.30]
    assert a["rounds"] == 2 and a["round"] == [1, 2] and a["ttft_cold_all"] == [0.10, 0.30]
    assert a4 is raw[1] and "rounds" not in a4  # measured once: as it was
    assert b["ttft_hit_s"] == 0.03 and b["ttft_hit_s_rounds"] == [0.07, 0.02, 0.03]
    # a round without a first-hit value does not count in its median
    assert b["ttft_first_hit_s"] == pytest.approx(0.2)
    assert b["hit_docs"] == [0, 1] * 3 and len(b["ttft_hit_all"]) == 6
    assert c == {"config": "c", "error": "engine run failed"}
    assert L.merge_rounds([]) == []


def test_rounds_file_keeps_every_round_and_the_dcab_report_reads_it(tmp_path):
    """A ``--rounds`` run's result file: ``results`` merged over rounds (one row per
    config and size), ``round_results`` every round's row; ``scripts/dcab_report.py``
    reads the arms (``kvcache_dram_<arm>``, ``native_cpu``) and rounds from it."""
    raw = []
    for rnd, order in ((1, ("dma", "auto", "native_cpu")), (2, ("native_cpu", "auto", "dma"))):
        for arm in order:
            cfg = arm if arm == "native_cpu" else f"kvcache_dram_{arm}"
            base = {"dma": 0.20, "auto": 0.10, "native_cpu": 0.15}[arm] * rnd
            raw.append({"config": cfg, "tokens": 16384, "round": rnd, "ttft_cold_s": 0.3,
                        "concurrency": 1,
                        "ttft_hit_s": base, "ttft_first_hit_s": None,
                        "ttft_cold_all": [0.3, 0.3], "ttft_hit_all": [base] * 4,
                        "hit_docs": [0, 1, 0, 1], "disk_floor_s": 1.0,
                        "worker_stats": {"timing_load_phase": [
                            {"direct_kernel_jobs": 2 if arm == "auto" else 0,
                             "direct_issue_max_s": 0.001}]}})
    path = str(tmp_path / "dcab-tiny.json")
    args = SimpleNamespace(machine="test", docs=2, repeats=2, rounds=2, append=False,
                           json=path, workload="longdoc", gate_json=None,
                           gate_table_path=None, preload_json=None, _raw=raw)
    L.save(args, L.merge_rounds(raw), float("nan"), float("nan"), 1024, "tiny")
    doc = json.load(open(path))
    assert doc["rounds"] == 2 and len(doc["round_results"]) == 6
    assert [r["config"] for r in doc["results"]] == ["kvcache_dram_dma", "kvcache_dram_auto",
                                                     "native_cpu"]
    assert doc["results"][0]["ttft_hit_s_rounds"] == [0.2, 0.4]
    assert "kvcache_dram_auto hit" in open(path[:-5] + ".md").read()
    out = tmp_path / "rep"
    p = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "dcab_report.py"),
                        "--call", f"c1={path}", "--json", f"{out}.json", "--md", f"{out}.md"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    summary = {s["arm"]: s for s in json.load(open(f"{out}.json"))["summary"]}
    assert set(summary) == {"dma", "auto", "native_cpu"}
    assert summary["auto"]["rounds"] == 2 and summary["auto"]["hits"] == 8
    assert summary["dma"]["median_hit_s"] == pytest.approx(0.3)  # 0.2 x4, 0.4 x4


def test_resume_rounds_keeps_only_finished_pairs():
    """``--resume`` with ``--rounds``: a (config, round) with rows and no error is done;
    one that failed, or that another config list does not name, runs again."""
    rr = [{"config": "a", "tokens": 1024, "round": 1, "ttft_hit_s": 0.1},
          {"config": "a", "tokens": 4096, "round": 1, "ttft_hit_s": 0.2},
          {"config": "b", "round": 1, "error": "engine run failed"},
          {"config": "b", "tokens": 1024, "round": 2, "ttft_hit_s": 0.3},
          {"config": "c", "tokens": 1024, "round": 1, "ttft_hit_s": 0.4},
          {"config": "a", "error": "engine run failed"}]  # before rows carried a round
    got = L.resume_rounds({"round_results": rr}, ["a", "b"])
    assert [(r["config"], r.get("tokens"), r["round"]) for r in got] == [
        ("a", 1024, 1), ("a", 4096, 1), ("b", 1024, 2)]
    assert L.resume_rounds({"results": []}, ["a"]) == []


def test_round_ratios_and_the_drift_balanced_mean(tmp_path):
    """Per-round ratios pair each round with the same round's reference; the balanced
    mean cancels a steady drift of the machine under the reversed order (rounds 1 and 3
    ran A after B, round 2 B after A: per-round log ratios +d, -d, +d), where the median
    keeps the bias; the table shows both."""
    rows = []
    for rnd, (a, b) in enumerate(((1.1, 1.0), (1.0, 1.1), (1.1, 1.0)), start=1):
        rows += [{"config": "recompute", "tokens": 1024, "round": rnd, "ttft_cold_s": b,
                  "ttft_hit_s": b},
                 {"config": "kvcache_dram", "tokens": 1024, "round": rnd, "ttft_cold_s": a,
                  "ttft_hit_s": a}]
    rows.append({"config": "kvcache_dram", "tokens": 4096, "round": 1, "ttft_cold_s": 2.0,
                 "ttft_hit_s": 2.0})  # no recompute row in that round: no ratio
    out = {"rounds": 3, "round_results": rows}
    r = L.round_ratios(out, "ttft_cold_s", "recompute")
    assert r[("kvcache_dram", 1024)] == pytest.approx([1.1, 1 / 1.1, 1.1])
    assert ("kvcache_dram", 4096) not in r
    assert L.balanced_ratio(r[("kvcache_dram", 1024)]) == pytest.approx(1.0)
    assert L.balanced_ratio([1.2, None]) is None and L.balanced_ratio([1.2]) is None
    assert L.balanced_ratio([1.21, 1.0]) == pytest.approx(1.1)
    lines = L._round_ratio_tables(out, ["recompute", "kvcache_dram"], [1024, 4096])
    text = "\n".join(lines)
    assert "| 1024 | 1.10 / 0.91 / 1.10 (balanced **1.00**) |" in text
    assert "| 4096 | - |" in text
    assert "native_cpu" not in text  # no hit table without native_cpu rows
    assert L._round_ratio_tables({"rounds": 1, "round_results": rows}, ["x"], [1]) == []


def test_resume_rounds_counts_a_single_round_file_as_round_one():
    """A file of a run without ``--rounds`` holds single measurements in ``results``:
    resumed with ``--rounds 2`` they are round 1 (not measured again, not dropped);
    median rows of a rounds run (``rounds`` key) never count as a round."""
    old = {"results": [{"config": "a", "tokens": 1024, "ttft_hit_s": 0.1},
                       {"config": "b", "error": "engine run failed"},
                       {"config": "c", "tokens": 1024, "ttft_hit_s": 0.2}]}
    got = L.resume_rounds(old, ["a", "b"])
    assert [(r["config"], r["tokens"], r["round"]) for r in got] == [("a", 1024, 1)]
    assert "round" not in old["results"][0]  # the old rows are not changed
    medians = {"results": [{"config": "a", "tokens": 1024, "rounds": 2}]}
    assert L.resume_rounds(medians, ["a"]) == []


def test_resume_with_rounds_runs_only_the_missing_pairs(tmp_path):
    """A ``--rounds 2`` run cut short after round 1 (its file written after every
    configuration) resumes with round 2 only: nothing measured twice, the medians over
    both rounds in ``results``. Here every pair is done already, so the resumed run
    starts no engine and only rewrites the merged file."""
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    path = str(tmp_path / "res.json")
    rows = [{"config": "recompute", "tokens": 1024, "round": rnd, "concurrency": 1,
             "ttft_cold_s": c, "ttft_hit_s": c, "ttft_first_hit_s": c,
             "ttft_cold_all": [c], "ttft_hit_all": [c], "hit_docs": [0], "disk_floor_s": 1.0}
            for rnd, c in ((1, 0.1), (2, 0.3))]
    json.dump({"results": rows[:1], "round_results": rows, "rounds": 2}, open(path, "w"))
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(
        [sys.executable, "-m", "kvcache_core.bench.longdoc", "--model", str(model),
         "--root", str(tmp_path / "root"), "--json", path, "--append", "--resume",
         "--rounds", "2", "--configs", "recompute", "--no-probe", "--machine", "t"],
        env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "recompute round 1, recompute round 2 already measured" in p.stderr
    assert "] recompute, round" not in p.stderr  # no engine run
    doc = json.load(open(path))
    (r,) = doc["results"]
    assert r["ttft_hit_s_rounds"] == [0.1, 0.3] and r["ttft_hit_s"] == pytest.approx(0.2)
    assert len(doc["round_results"]) == 2


def _group_members(pgid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    st = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if st[0] != "Z" and int(st[2]) == pgid:
                out.append(int(d))
    return out


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_sigterm_to_the_driver_kills_its_engines(tmp_path):
    """``timeout`` / ``pkill`` on the benchmark driver while an engine runs (the
    twenty-first session's H200 call): the driver exits with 143 and leaves no process
    of the engine groups it started, the one spawned ahead included, so the next run's
    engine gets the GPU memory."""
    pytest.importorskip("vllm")
    import signal

    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    root = tmp_path / "root"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TORCHDYNAMO_DISABLE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.Popen(
        [sys.executable, "-m", "kvcache_core.bench.longdoc", "--model", str(model),
         "--root", str(root), "--json", str(tmp_path / "r.json"), "--tokens", "1024",
         "--staging-bytes", str(4 << 20), "--io-depth", "2", "--timeout", "200",
         "--no-probe", "--configs", "recompute,kvcache_dram", "--repeats", "50"],
        env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        groups: list[int] = []
        deadline = time.monotonic() + 200
        # the first worker (its own process group) has started vLLM's engine process
        while time.monotonic() < deadline and p.poll() is None:
            groups = [int(d) for d in os.listdir("/proc") if d.isdigit()
                      and _cmd_has(int(d), "--worker", str(root))]
            if any(len(_group_members(g)) > 1 for g in groups):
                break
            time.sleep(0.5)
        assert p.poll() is None and groups, "no engine started"
        time.sleep(2)
        groups = sorted({os.getpgid(int(d)) for d in os.listdir("/proc") if d.isdigit()
                         and _cmd_has(int(d), "--worker", str(root))} | set(groups))
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=90)
        assert p.returncode == 143, err[-3000:]
        assert "signal 15: stopping" in err
        assert all(_group_members(g) == [] for g in groups), groups
    finally:
        if p.poll() is None:
            p.kill()


def _cmd_has(pid: int, *parts: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().decode(errors="replace")
    except OSError:
        return False
    return all(x in cmd for x in parts)


def test_small_sizes_take_more_documents_and_the_tiers_hold_them():
    kvb = 1000
    a = SimpleNamespace(workload="longdoc", docs=2, small_docs=8,
                        tokens="1024,4096,16384,65536")
    assert [L.n_docs(a, d) for d in (1024, 4096, 16384, 65536)] == [8, 8, 2, 2]
    assert L.tier_doc_bytes(a, kvb) == 65536 * kvb  # 2 x 64k holds 8 x 4k: as before
    # a run of small sizes only (the twenty-fourth session's TOKENS=1024 run got 2
    # documents, where the tiers capped the count): --small-docs of them, and tiers
    # sized to hold all of one size
    a.tokens, a.small_docs = "1024", 32
    assert L.n_docs(a, 1024) == 32
    assert L.tier_doc_bytes(a, kvb) == 16 * 1024 * kvb  # docs (2) x this = 32 x 1024
    a.tokens, a.small_docs = "1024,4096", 8
    assert [L.n_docs(a, d) for d in (1024, 4096)] == [8, 8]
    assert L.tier_doc_bytes(a, kvb) * a.docs == 8 * 4096 * kvb
    a.small_docs = 0
    assert L.n_docs(a, 1024) == 2
    assert L.tier_doc_bytes(a, kvb) == 4096 * kvb
    a.small_docs, a.workload = 8, "mixed"
    assert L.n_docs(a, 1024) == 2
    rows = [{"tokens": 1024, "docs": 8}, {"tokens": 4096, "docs": 8},
            {"tokens": 65536, "docs": 2}]
    assert L._small_docs_note({"docs": 2}, rows) == " (8 at 1024, 4096 tokens)"
    assert L._small_docs_note({"docs": 2}, rows[2:]) == ""


def test_variant_names_a_kvcache_config_with_extra_keys():
    assert L._variant('kvcache_dram_dma=kvcache_dram:dram_load_copy="dma";io_depth=4') == (
        "kvcache_dram_dma", "kvcache_dram", [("dram_load_copy", "dma"), ("io_depth", 4)])
    for bad in ("kvcache_dram_dma=kvcache_dram:",  # no keys
                "dma=kvcache_dram:io_depth=4",  # not BASE_...
                "native_cpu_x=native_cpu:io_depth=4",  # not a py-kvcache config
                "kvcache_dram=kvcache_dram:io_depth=4",  # a built-in name
                "kvcache_dram_a-b=kvcache_dram:io_depth=4",
                "kvcache_dram_x:io_depth=4"):
        with pytest.raises(Exception, match="--variant"):
            L._variant(bad)
    args = SimpleNamespace(_variants={"kvcache_dram_dma": ("kvcache_dram",
                                                           [("dram_load_copy", "dma")])})
    assert L.base_of(args, "kvcache_dram_dma") == "kvcache_dram"
    assert L.base_of(args, "native_cpu") == "native_cpu"
    assert L.variant_keys(args, "kvcache_dram_dma") == [("dram_load_copy", "dma")]
    assert L.variant_keys(args, "kvcache_dram") == []
    # the variant's own cache root; the DRAM tier sized as its base's
    ns = SimpleNamespace(root="/r", docs=2, staging_bytes=1, io_depth=2,
                         preload_lookahead=0, kv_extra=[], name="kvcache_dram_dma")
    extra = L.transfer_config("kvcache_dram", ns, 1000)["kv_connector_extra_config"]
    assert extra["root_dir"] == "/r/kvcache_dram_dma" and extra["dram_cache_bytes"] == 2600
    assert L._jobs(["kvcache_disk_x"], "longdoc", {"kvcache_disk_x": "kvcache_disk"}.get) == [
        ("kvcache_disk_x", "store"), ("kvcache_disk_x", "load")]
    assert L._row_configs([{"config": "kvcache_dram_dma"}, {"config": "recompute"},
                           {"config": "kvcache_dram"}]) == [
        "recompute", "kvcache_dram", "kvcache_dram_dma"]


def test_variant_env_keys_set_the_engine_process_environment():
    """``env.VAR`` keys: any base (recompute included) may set environment variables of
    its engine process; they are not py-kvcache config keys and the row says them."""
    name, base, kvs = L._variant('recompute_hnd=recompute:env.VLLM_KV_CACHE_LAYOUT="HND"')
    assert (name, base) == ("recompute_hnd", "recompute")
    mixed = L._variant('kvcache_dram_x=kvcache_dram:io_depth=4;env.FOO=3')
    args = SimpleNamespace(_variants={name: (base, kvs), mixed[0]: (mixed[1], mixed[2])})
    assert L.variant_env(args, "recompute_hnd") == {"VLLM_KV_CACHE_LAYOUT": "HND"}
    assert L.variant_keys(args, "recompute_hnd") == []
    assert L.variant_env(args, "kvcache_dram_x") == {"FOO": "3"}
    assert L.variant_keys(args, "kvcache_dram_x") == [("io_depth", 4)]
    assert L.variant_env(args, "recompute") == {}
    for bad in ("recompute_x=recompute:io_depth=4",  # a config key needs a kvcache base
                "recompute_x=recompute:env.=1",  # no variable name
                'recompute_x=recompute:env.A={"a": 1}'):  # not a string or number
        with pytest.raises(Exception, match="--variant"):
            L._variant(bad)


def test_noop_connector_config_names_the_do_nothing_connector():
    """``noop_connector``: vLLM's connector machinery with a connector whose hooks do
    nothing (what a 1k request pays for any connector, before py-kvcache's own work)."""
    ns = SimpleNamespace(root="/r", docs=2, staging_bytes=1, io_depth=2,
                         preload_lookahead=0, kv_extra=[], name="noop_connector")
    tc = L.transfer_config("noop_connector", ns, 1000)
    assert tc == {"kv_connector": "NoopConnector", "kv_connector_module_path":
                  "noop_kv_connector", "kv_role": "kv_both"}
    assert os.path.exists(os.path.join(L.REPO, "scripts", "noop_kv_connector.py"))
    assert L._jobs(["noop_connector"], "longdoc") == [("noop_connector", "both")]


def test_group_alive_ignores_zombies():
    """The driver starts the next engine once the previous one's process group is gone;
    a zombie (exited, not reaped: holds no memory) does not count as alive."""
    live = subprocess.Popen(["sleep", "30"], start_new_session=True)
    dead = subprocess.Popen(["true"], start_new_session=True)
    try:
        end = time.monotonic() + 10
        while L.group_alive(dead.pid) and time.monotonic() < end:
            time.sleep(0.05)
        assert not L.group_alive(dead.pid)  # a zombie until waited for below
        assert L.group_alive(live.pid)
    finally:
        live.kill()
        live.wait()
        dead.wait()
    assert not L.group_alive(live.pid)


def test_held_worker_measures_only_when_the_driver_says(tmp_path):
    """A worker started with ``hold`` (the next engine process is still importing) sends
    no measured request before the driver's ``.measure`` file exists; without ``hold`` it
    does not wait at all."""
    part = str(tmp_path / "cfg-both.json")
    args = SimpleNamespace(hold=True, out_part=part, config="cfg", phase="both")

    async def run() -> float:
        t0 = time.monotonic()
        waiter = asyncio.create_task(L._await_measure(args))
        await asyncio.sleep(0.3)
        assert not waiter.done()  # still held
        open(part + ".measure", "w").close()
        await asyncio.wait_for(waiter, 5)
        return time.monotonic() - t0

    assert asyncio.run(run()) >= 0.3
    os.unlink(part + ".measure")
    args.hold = False
    asyncio.run(asyncio.wait_for(L._await_measure(args), 1))  # returns at once


def test_scbench_table_plot_and_preload_file(tmp_path):
    rows = _sc_rows()
    md = "\n".join(SC.scbench_table(_sc_run(rows + [{"config": "recompute",
                                                      "error": "engine run failed"}])))
    assert "| 1024 | 2 x 2 | 2 | kvcache_preload |" in md
    assert "| 0.050 |" in md  # 500 / 10000 bytes of native_fs's
    assert "recompute: engine run failed" in md
    png = tmp_path / "sc.png"
    SC.plot_scbench(_sc_run(rows), str(png))
    assert png.stat().st_size > 10_000
    # the issue's schema, next to longdoc rows of the same config
    path = str(tmp_path / "preload-x.json")
    L.write_preload(_sc_run([{"config": "kvcache_preload", "tokens": 1024, "concurrency": 2,
                              "mean_ttft_s": 9.0}]), path, "longdoc")
    L.write_preload(_sc_run(rows), path, "scbench")
    saved = json.loads(open(path).read())["results"]
    sc = {r["config"]: r for r in saved if r["workload"] == "scbench"}
    assert set(sc) == {"native_fs", "kvcache_preload"}
    need = {"config", "tokens", "concurrency", "mean_ttft_s", "mean_ttft_reuse_s",
            "mean_ttft_noreuse_s", "disk_read_bytes", "peak_staging_bytes",
            "staging_budget_bytes"}
    assert all(need <= set(r) for r in sc.values())
    assert sc["kvcache_preload"]["disk_read_bytes"] == 500
    assert sc["kvcache_preload"]["mean_ttft_reuse_s"] == pytest.approx(2.0)
    assert any(r["workload"] == "longdoc" for r in saved)
    assert "| scbench | 1024 |" in open(str(tmp_path / "preload-x.md")).read()


def test_scbench_defaults_and_equal_dram_budget():
    args = L.resolve_defaults(L.build_parser().parse_args(
        ["--model", "m", "--workload", "scbench"]))
    assert (args.tokens, args.docs, args.repeats, args.sample_interval) == ("32768", 4, 6,
                                                                            0.25)
    args = L.resolve_defaults(L.build_parser().parse_args(["--model", "m"]))
    assert (args.tokens, args.docs, args.repeats, args.sample_interval) == (
        "1024,4096,16384,65536", 2, 2, 0.0)
    a = SimpleNamespace(root="/r", docs=4, staging_bytes=1, io_depth=2, preload_lookahead=4)
    budgets = {c: L.dram_budget(c, a, 1000) for c in
               ("kvcache_preload", "kvcache_nopreload", "native_fs")}
    assert set(budgets.values()) == {1300}  # 1.3 contexts each, the working set is 4
    assert L.dram_budget("recompute", a, 1000) is None


TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def _longdoc_cpu(tmp_path, name: str, *args: str) -> tuple[subprocess.CompletedProcess,
                                                           str, str]:
    """Run ``kvcache_core.bench.longdoc`` on real vLLM (CPU platform, the TINY model with
    dummy weights) with ``args`` after the common ones: (process, result JSON, preload
    JSON)."""
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    out = str(tmp_path / "res" / f"{name}-tiny.json")
    pre = str(tmp_path / "res" / "preload-tiny.json")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TORCHDYNAMO_DISABLE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run(
        [sys.executable, "-m", "kvcache_core.bench.longdoc", "--model", str(model),
         "--root", str(tmp_path / "root"), "--json", out, "--preload-json", pre,
         "--staging-bytes", str(4 << 20), "--io-depth", "2", "--timeout", "200",
         "--machine", "cpu-test", "--no-probe", *args],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=280)
    return p, out, pre


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_scbench_end_to_end_cpu(tmp_path):
    """``longdoc --workload scbench`` on real vLLM (CPU platform, tiny Llama, dummy
    weights): 4 contexts of 1024 tokens x 3 rounds, 2 in flight, py-kvcache with preload
    and a DRAM tier of 1.3 contexts (native_fs does not run on vLLM's CPU platform), run
    as a ``--variant`` of ``kvcache_preload`` (``preload_keep_s=30``): the row keeps the
    variant's name, its base, its keys and the base's DRAM budget."""
    pytest.importorskip("vllm")
    t0 = time.monotonic()
    p, out, pre = _longdoc_cpu(
        tmp_path, "scbench", "--workload", "scbench", "--tokens", "1024", "--docs", "4",
        "--repeats", "3", "--concurrency", "2", "--gpu-blocks", "20",
        "--configs", "kvcache_preload_keep30",
        "--variant", "kvcache_preload_keep30=kvcache_preload:preload_keep_s=30")
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.load(open(out))
    (r,) = res["results"]
    assert "error" not in r, r
    assert r["workload"] == "scbench" and r["config"] == "kvcache_preload_keep30"
    assert r["base"] == "kvcache_preload" and r["kv_extra"] == {"preload_keep_s": 30}
    assert r["dram_budget_bytes"] > 0
    assert r["n_requests"] == 12 and r["n_noreuse"] == 4
    assert [(t["round"], t["ctx"]) for t in r["turns"]][:4] == [(0, c) for c in range(4)]
    assert r["working_set_bytes"] > 3 * r["dram_budget_bytes"]  # the DRAM tier thrashes
    # later rounds read their contexts back from disk; the process tree's read_bytes
    # (O_DIRECT reads included) agrees with py-kvcache's own counter
    assert r["cache_bytes_read"] > 0, r
    assert r["disk_read_bytes"] >= 0.9 * r["cache_bytes_read"], r
    assert r["peak_staging_bytes"] <= r["staging_budget_bytes"]
    assert r["peak_host_mem_bytes"] > 0 and len(r["series"]["t_s"]) >= 3
    assert r["store_counters"]["stores"] > 0
    assert os.path.exists(out[:-5] + ".md") and os.path.exists(out[:-5] + ".png")
    (row,) = json.load(open(pre))["results"]
    assert row["workload"] == "scbench" and row["disk_read_bytes"] == r["disk_read_bytes"]
    assert row["config"] == "kvcache_preload_keep30" and row["base"] == "kvcache_preload"
    assert not os.path.exists(tmp_path / "root" / "kvcache_preload_keep30")  # root wiped
    print(f"e2e run {time.monotonic() - t0:.0f}s")


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_mixed_preload_workload_counts_tree_reads_cpu(tmp_path):
    """``longdoc --workload mixed`` (the H200 ``preload`` step) on real vLLM (CPU platform,
    tiny Llama): the load phase's row carries the engine process tree's disk reads and
    the page cache growth, measured the same way for every configuration (so native_fs's
    buffered reads can be compared with py-kvcache's O_DIRECT ones), and the row names
    the extra config keys given with ``--kv-extra`` and with a ``--variant`` (run under
    the variant's name, its base kept in both result files)."""
    pytest.importorskip("vllm")
    p, out, pre = _longdoc_cpu(
        tmp_path, "mixed", "--workload", "mixed", "--tokens", "1024", "--docs", "2",
        "--repeats", "3", "--fresh-frac", "0.25", "--concurrency", "4",
        "--gpu-blocks", "160", "--configs", "kvcache_nopreload_wb",
        "--variant", "kvcache_nopreload_wb=kvcache_nopreload:writeback_max_fraction=1.0",
        "--kv-extra", "eviction_policy=arc")
    assert p.returncode == 0, p.stderr[-4000:]
    (r,) = json.load(open(out))["results"]
    assert "error" not in r, r
    # the store phase wrote every block it kept (write-back may fill the whole DRAM tier),
    # so the load phase's engine, its DRAM tier empty, read the first turn of each
    # document from disk with O_DIRECT: the tree's read_bytes sees those reads
    assert r["store_counters"]["stores_written"] > 0, r["store_counters"]
    assert r["disk_read_bytes"] > 0
    assert r["tree_read_bytes"] >= 0.9 * r["disk_read_bytes"], r
    assert r["page_cache_growth_bytes"] is not None
    (row,) = json.load(open(pre))["results"]
    assert row["tree_read_bytes"] == r["tree_read_bytes"]
    assert "tree read (GB)" in open(pre[:-5] + ".md").read()
    # reads of a block already read once in the load phase: counted by the workers
    # (reads per key, issue 10), never more than the reads themselves
    assert isinstance(r["disk_reads_repeat"], int) and r["disk_reads_repeat"] >= 0
    block_payload = 256 * (r["kv_bytes"] // r["tokens"])  # one 256-token block file
    assert r["disk_reads_repeat"] * block_payload <= r["disk_read_bytes"], r
    assert row["disk_reads_repeat"] == r["disk_reads_repeat"]
    assert "repeat reads" in open(pre[:-5] + ".md").read()
    assert r["kv_extra"] == {"eviction_policy": "arc", "writeback_max_fraction": 1.0}
    assert r["config"] == row["config"] == "kvcache_nopreload_wb"
    assert r["base"] == row["base"] == "kvcache_nopreload"
    assert row["kv_extra"] == r["kv_extra"]
    # the load phase's process was spawned while the store phase ran, and the store
    # phase measured only once that process had finished importing vLLM
    assert "kvcache_nopreload_wb/load: engine process spawned ahead" in p.stderr
    assert "imports done" in p.stderr, p.stderr[-3000:]
    assert "kvcache_nopreload_wb/store: waited" in p.stderr


def test_h200_call_stops_a_step_past_its_time_and_leaves_nothing(tmp_path):
    """``scripts/h200_call.sh`` (the GPU machine's call wrapper) with a stand-in step that
    outlives its time: the step's whole process group is gone afterwards (children
    included), the log says it was stopped, and the results folder, kept for the next
    call, is archived into $OUT; a step that ends in time is left to finish."""
    import shutil

    scripts = tmp_path / "scripts"
    scripts.mkdir()
    shutil.copy(os.path.join(REPO, "scripts", "h200_call.sh"), scripts / "h200_call.sh")
    # the real h200_stop.sh kills every benchmark driver and vLLM server of the machine
    # (right on the GPU machine, not beside other work here): a stand-in that only logs
    (scripts / "h200_stop.sh").write_text("#!/bin/bash\necho h200_stop ran\n")
    marker = f"sleep {900 + os.getpid() % 97}"  # this test's own child, found by name
    step = scripts / "h200_runs.sh"
    env = dict(os.environ, RES=str(tmp_path / "res"), OUT=str(tmp_path / "out"))
    for body, limit, stopped in ((f"echo started; {marker}; echo never", "2", True),
                                 ("echo quick; echo x > \"$RES/result.json\"", "60", False)):
        step.write_text(f"#!/bin/bash\n{body}\n")
        t0 = time.monotonic()
        p = subprocess.run(["bash", "scripts/h200_call.sh", limit, "longdoc", "m"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        log = (tmp_path / "res" / "call-longdoc.log").read_text()
        assert ("still running after 2s: stopping it" in log) == stopped, log
        assert log.count("h200_stop ran") == (2 if stopped else 1), log
        assert "never" not in log
        if stopped:
            assert time.monotonic() - t0 < 20
            left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
            assert left.stdout.strip() == "", "the step's child outlived the call"
        assert (tmp_path / "out" / "res.tgz").stat().st_size > 0
    listing = subprocess.run(["tar", "tzf", str(tmp_path / "out" / "res.tgz")],
                             capture_output=True, text=True, check=True).stdout.split()
    assert "res/result.json" in listing and "res/call-longdoc.log" in listing


def test_h200_call_auto_limit_counts_the_configurations(tmp_path):
    """``h200_call.sh auto``: the step's limit is PER_CONFIG_S per configuration of
    CONFIGS (170 s on a card that is not an H200, e.g. none here), plus 30 s for the disk
    probe unless NOPROBE; without CONFIGS it refuses to guess. Each SUFFIX has its own
    log (the twenty-eighth session lost the first step's log of every two-step call)."""
    import shutil

    scripts = tmp_path / "scripts"
    scripts.mkdir()
    shutil.copy(os.path.join(REPO, "scripts", "h200_call.sh"), scripts / "h200_call.sh")
    (scripts / "h200_stop.sh").write_text("#!/bin/bash\n")
    (scripts / "h200_runs.sh").write_text("#!/bin/bash\necho quick\n")
    env = dict(os.environ, RES=str(tmp_path / "res"), OUT=str(tmp_path / "out"),
               PATH="/usr/bin:/bin")  # no nvidia-smi
    for extra, want in (({"CONFIGS": "a,b,c"}, "limit 540s (3 configuration(s) x 170s)"),
                        ({"CONFIGS": "a", "NOPROBE": "1"}, "limit 170s"),
                        ({"CONFIGS": "a,b", "PER_CONFIG_S": "50"}, "limit 130s")):
        p = subprocess.run(["bash", "scripts/h200_call.sh", "auto", "preload", "m"],
                           cwd=tmp_path, env={**env, **extra}, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 0 and want in p.stdout, (p.stdout, p.stderr)
    p = subprocess.run(["bash", "scripts/h200_call.sh", "auto", "preload", "m"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "needs CONFIGS" in p.stderr, p.stderr
    # two steps of one call with their own SUFFIX keep their own logs
    for suffix in ("-a", "-b"):
        subprocess.run(["bash", "scripts/h200_call.sh", "5", "preload", "m"], cwd=tmp_path,
                       env={**env, "SUFFIX": suffix}, capture_output=True, text=True,
                       timeout=60, check=True)
    for suffix in ("-a", "-b"):
        assert "quick" in (tmp_path / "res" / f"call-preload{suffix}.log").read_text()


def test_h200_call_spy_samples_engine_stacks_and_stops_with_the_step(tmp_path):
    """``SPY=1 h200_call.sh``: while the step runs, ``scripts/stack_sampler.py`` dumps
    the stack of every process whose command line names the engine core (here a stand-in
    py-spy that prints a fixed stack, and a stand-in engine renamed with ``exec -a``),
    each dump stamped with ``time.monotonic()``; the sampler ends with the step. Without a
    py-spy binary the call says so and runs the step anyway."""
    import shutil

    scripts = tmp_path / "scripts"
    scripts.mkdir()
    for f in ("h200_call.sh", "stack_sampler.py"):
        shutil.copy(os.path.join(REPO, "scripts", f), scripts / f)
    (scripts / "h200_stop.sh").write_text("#!/bin/bash\n")
    tag = f"EngineCoreFake{os.getpid()}"
    (scripts / "h200_runs.sh").write_text(
        f"#!/bin/bash\n(exec -a {tag} sleep 2)\necho done > \"$RES/result.json\"\n")
    spy = tmp_path / "fake-py-spy"
    spy.write_text("#!/bin/bash\necho \"Thread 1 (idle): MainThread\"\n"
                   "echo \"    faccessat (libc.so.6)\"\n")
    spy.chmod(0o755)
    env = dict(os.environ, RES=str(tmp_path / "res"), OUT=str(tmp_path / "out"),
               SPY="1", PYSPY=str(spy), SPY_INTERVAL="0.2")
    p = subprocess.run(["bash", "scripts/h200_call.sh", "30", "preload50", "m"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    stacks = (tmp_path / "res" / "stacks-preload50.txt").read_text()
    heads = [ln.split() for ln in stacks.splitlines() if ln.startswith("=== ")]
    assert len(heads) >= 3 and "faccessat (libc.so.6)" in stacks, stacks
    assert all(float(h[1]) > 0 and h[2].isdigit() for h in heads), heads
    left = subprocess.run(["pgrep", "-f", "stack_sampler.py --pyspy " + str(spy)],
                          capture_output=True, text=True)
    assert left.stdout.strip() == "", "the sampler outlived the call"
    env["PYSPY"] = str(tmp_path / "missing")
    p = subprocess.run(["bash", "scripts/h200_call.sh", "30", "preload50", "m"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "no py-spy at" in p.stdout, (p.stdout, p.stderr)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_store_drain_puts_the_whole_workload_on_disk_cpu(tmp_path):
    """``longdoc --store-drain`` (``STORE_DRAIN`` of the H200 steps) on real vLLM (CPU
    platform, tiny Llama): with a write-back share that keeps almost every stored block
    without a file in serving (writeback_max_fraction=0.1 of a 5-slot DRAM tier), the
    store phase still leaves every block of both documents on disk (writeback_flush in
    that phase, then waiting for the write-back after each request), so the load phase
    starts from the same disk contents as native_fs's; the wait is reported per request
    and nothing is left unwritten."""
    pytest.importorskip("vllm")
    p, out, _pre = _longdoc_cpu(
        tmp_path, "mixed", "--workload", "mixed", "--tokens", "1024", "--docs", "2",
        "--repeats", "2", "--fresh-frac", "0.25", "--concurrency", "4",
        "--gpu-blocks", "160", "--configs", "kvcache_nopreload", "--store-drain", "60",
        "--kv-extra", "writeback_max_fraction=0.1")
    assert p.returncode == 0, p.stderr[-4000:]
    (r,) = json.load(open(out))["results"]
    assert "error" not in r, r
    assert len(r["store_drain_s"]) == 2 and all(0 <= t < 60 for t in r["store_drain_s"])
    assert r["store_unwritten_after_drain"] == 0, r
    sc = r["store_counters"]
    # 2 documents x 4 blocks of 256 tokens: every one has its file
    assert sc["stores"] >= 8 and sc["bytes_written"] >= 8 * 256 * (r["kv_bytes"] // r["tokens"]), sc
    # the load phase read both documents' first turns from disk
    assert r["disk_read_bytes"] >= 8 * 256 * (r["kv_bytes"] // r["tokens"]), r
    assert "write-back not drained" not in p.stderr


def test_preload_calls_report_compares_only_within_a_call(tmp_path):
    """``scripts/preload_calls_report.py``: each kvcache row is compared with native_fs
    and with the base variant of its own call only (a call without them gives no ratio),
    the medians over the calls count the calls that gave each ratio, the round marker is
    not part of a variant, and a missing results file is an error that names it."""
    def res(suffix, rows):
        (tmp_path / f"preload-m-{suffix}.json").write_text(json.dumps(
            {"disk_read_gbps": 1.5, "results": [
                {"config": c, "mean_ttft_s": t, "mean_ttft_reuse_s": t + 1,
                 "mean_ttft_noreuse_s": t - 1, "disk_read_bytes": 1e9} for c, t in rows]}))
    res("a", [("kvcache_preload", 6.0), ("native_fs", 10.0)])
    res("base", [("kvcache_preload", 8.0)])
    res("base-r2", [("native_fs", 5.0), ("kvcache_preload", 4.0)])
    res("a-r2", [("kvcache_preload", 2.0)])
    res("a-r3", [("kvcache_nopreload", 3.0)])
    res("a-r4", [("kvcache_nopreload", 9.0), ("kvcache_preload", 5.0)])
    script = os.path.join(REPO, "scripts", "preload_calls_report.py")
    out = tmp_path / "ab.json"
    issue = tmp_path / "preload-model.json"
    p = subprocess.run([sys.executable, script, "--dir", str(tmp_path), "--model", "m",
                        "--call", "c1=a,base", "--call", "c2=base-r2,a-r2",
                        "--call", "c3=a-r3", "--call", "c4=a-r4", "--json", str(out),
                        "--issue-json", str(issue), "--issue-model", "model"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    doc = json.load(open(out))
    rows = {(r["call"], r["suffix"], r["config"]): r for r in doc["rows"]}
    assert rows[("c1", "a", "kvcache_preload")]["vs_ref"] == pytest.approx(0.6)
    assert rows[("c1", "a", "kvcache_preload")]["vs_base"] == pytest.approx(0.75)
    assert rows[("c2", "a-r2", "kvcache_preload")]["vs_base"] == pytest.approx(0.5)
    assert rows[("c3", "a-r3", "kvcache_nopreload")]["vs_ref"] is None  # no native_fs there
    # preload off / on of one variant within one call only (reusing: t + 1)
    assert rows[("c4", "a-r4", "kvcache_preload")]["reuse_off_on"] == pytest.approx(10 / 6)
    assert rows[("c1", "a", "kvcache_preload")]["reuse_off_on"] is None  # c3's off: other call
    summ = {(s["variant"], s["config"]): s for s in doc["summary"]}
    a = summ[("a", "kvcache_preload")]
    assert a["n_calls"] == 3 and a["median_vs_base"] == pytest.approx(0.625)
    assert a["median_vs_ref"] == pytest.approx((0.6 + 0.4) / 2) and a["n_vs_ref"] == 2
    assert a["n_reuse_off_on"] == 1
    got = json.load(open(issue))
    assert got["model"] == "model" and len(got["results"]) == len(doc["rows"])
    first = got["results"][0]
    assert (first["call"], first["variant"], first["config"]) == ("c1", "a", "kvcache_preload")
    assert first["mean_ttft_s"] == 6.0 and first["vs_ref"] == pytest.approx(0.6)
    assert summ[("-", "native_fs")]["median_mean_ttft_s"] == pytest.approx(7.5)
    assert (tmp_path / "ab.md").exists() and (tmp_path / "ab.png").stat().st_size > 0
    p = subprocess.run([sys.executable, script, "--dir", str(tmp_path), "--model", "m",
                        "--call", "c1=nope", "--json", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "preload-m-nope.json not found" in p.stderr


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(400)
def test_mixed_with_table_and_queue_aware_preload_cpu(tmp_path):
    """The GPU plan's item 4q on real vLLM (CPU platform, tiny Llama): the queued mixed
    workload with a break-even table whose disk tier never wins on demand, the DRAM tier,
    ``queue_aware_preload`` and ``preload_protect``. With preload, the store phase still
    writes files and the load phase reads only what preloads stage for queued requests
    (on-demand disk loads are refused: recompute); without preload (the gate alone) no
    file is written and nothing is read. Every request completes."""
    pytest.importorskip("vllm")
    table = tmp_path / "table.json"
    table.write_text(json.dumps({
        "version": 1, "gpu": "cpu", "model": "tiny",
        "tiers": {"dram": {"min_prefix_tokens": 0}, "disk": {"min_prefix_tokens": None}},
        "bandwidths": {"disk_read_gbps": 1.0},
        # recompute slow enough that the queue ahead always hides a read
        "measurements": [{"tokens": 1024, "recompute_s": 5.0}]}))
    p, out, _pre = _longdoc_cpu(
        tmp_path, "mixed", "--workload", "mixed", "--tokens", "1024", "--docs", "2",
        "--repeats", "3", "--fresh-frac", "0.25", "--concurrency", "8",
        "--gpu-blocks", "12", "--configs", "kvcache_preload,kvcache_nopreload",
        "--store-drain", "30", "--kv-extra", f"breakeven_table={table}",
        "--kv-extra", "queue_aware_preload=true", "--kv-extra", "preload_protect=true")
    assert p.returncode == 0, p.stderr[-4000:]
    rows = {r["config"]: r for r in json.load(open(out))["results"]}
    pre, nopre = rows["kvcache_preload"], rows["kvcache_nopreload"]
    assert "error" not in pre and "error" not in nopre, rows
    assert pre["n_requests"] == nopre["n_requests"] == 8
    assert pre["store_counters"]["bytes_written"] > 0 and pre["disk_read_bytes"] > 0, pre
    assert pre["store_unwritten_after_drain"] == 0
    assert nopre["store_counters"]["bytes_written"] == 0, nopre
    assert nopre["disk_read_bytes"] == 0, nopre
    stats = json.load(open(tmp_path / "root" / "parts" / "kvcache_preload-load.stats"))
    assert stats["preloads_claimed"] > 0 and stats["gate_accepted_staged"] > 0, stats
    assert stats["gate_accepted_disk"] == 0 and stats["chunks_loaded_disk"] > 0, stats


def test_trace_report_stalls_finds_the_gap_between_engine_steps(tmp_path):
    """``scripts/trace_report.py --stalls``: a gap of 500 ms between one engine step's
    ``fwd_end`` and the next step's ``fwd_start`` is reported with the reads in flight
    inside it (two reads for 450 of its 500 ms: 1.8 on average), the reads and load jobs
    that finished inside it, and the first tokens within 1 s after it; steps 10 ms
    apart and the warm-up request before the first real one are not stalls."""
    t = 1000.0
    ev: list = [[t - 5.0, "fwd_start", None, 0], [t - 4.0, "fwd_end", None, 0]]  # warm-up
    for i in range(10):  # steps every 10 ms
        ev += [[t + i * 0.01, "fwd_start", None, 0], [t + i * 0.01 + 0.005, "fwd_end", None, 0]]
    last_end = t + 0.095
    ev += [[t + 0.05, "read_start", 1, 0], [t + 0.05, "read_start", 1, 1],
           [last_end + 0.45, "read_done", 1, 0], [last_end + 0.45, "read_done", 1, 1],
           [last_end + 0.4, "done_load", 1, 2],
           [last_end + 0.3, "stall_stack", "layout.py:909 exists <- manager.py:540 _on_disk",
            300], [last_end + 0.2, "majflt", None, 40], [last_end + 0.45, "majflt", None, 2],
           [last_end + 1.5, "majflt", None, 7]]
    for i in range(5):  # steps resume 500 ms after the last end
        s = last_end + 0.5 + i * 0.01
        ev += [[s, "fwd_start", None, 0], [s + 0.005, "fwd_end", None, 0]]
    ev.sort(key=lambda e: e[0])
    reqs = [["warm", 16, t - 6.0, t - 4.0], ["a", 16, t, last_end + 0.52],
            ["b", 16, t, last_end + 0.9], ["c", 16, t, last_end + 2.0]]
    d = tmp_path / "trace"
    d.mkdir()
    (d / "x-load.requests.json").write_text(json.dumps(reqs))
    (d / "x-load.r0.json").write_text(json.dumps(ev))
    # stack_sampler.py dumps: two inside the stall (the engine thread in a file lookup),
    # one after it; the reactor thread's frames are not the main thread's
    dump = ('=== {t} 7\nProcess 7: VLLM::EngineCore\n\nThread 7 (idle): "MainThread"\n'
            '    {top} (libc.so.6)\n    lookup (kvcache_core/vllm/manager.py:870)\n\n'
            'Thread 9 (active): "kvcache-reactor-r0"\n    _step (kvcache_core/reactor.py:700)\n')
    (tmp_path / "stacks.txt").write_text(
        dump.format(t=last_end + 0.1, top="faccessat") + dump.format(t=last_end + 0.3,
                                                                     top="faccessat")
        + dump.format(t=last_end + 0.7, top="epoll_wait"))
    out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "trace_report.py"),
                          str(d), "--stalls", "--json", str(tmp_path / "st.json"),
                          "--stacks", str(tmp_path / "stacks.txt")],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "1 engine stalls > 200 ms" in out, out
    assert "2 x faccessat (libc.so.6) <- lookup" in out and "epoll_wait" not in out, out
    assert "1 x (reactor trace) layout.py:909 exists <- manager.py:540 _on_disk" in out, out
    (row,) = json.loads((tmp_path / "st.json").read_text())
    assert row["start_ms"] == pytest.approx(95, abs=1) and row["ms"] == pytest.approx(500, abs=1)
    assert row["reads_in_flight"] == pytest.approx(1.8, abs=0.01)
    assert (row["reads_done"], row["loads_done"], row["tokens_after"]) == (2, 1, 2)
    assert row["major_faults"] == 42  # the fault 1 s after the stall is not its
    assert row["py_stacks"] == [{"n": 1, "stack": "layout.py:909 exists <- manager.py:540 "
                                 "_on_disk"}]
    assert row["stacks"] == [{"n": 2, "frames": [
        "faccessat (libc.so.6)", "lookup (kvcache_core/vllm/manager.py:870)"]}]
    # the per-request report: request a's window (t to last_end + 0.52, both ends
    # included) holds nine 5 ms gaps among the first ten steps, the 500 ms stall and two
    # 5 ms gaps after it (steps start at last_end + 0.5, + 0.51 and + 0.52)
    subprocess.run([sys.executable, os.path.join(REPO, "scripts", "trace_report.py"),
                    str(d), "--json", str(tmp_path / "req.json")],
                   capture_output=True, text=True, timeout=60, check=True)
    rows = {r["request"]: r for r in json.loads((tmp_path / "req.json").read_text())}
    a = rows["a"]
    assert a["gap_max_ms"] == pytest.approx(500, abs=0.01), a
    assert a["gap_ms"] == pytest.approx(9 * 5 + 500 + 2 * 5, abs=0.01), a
    assert rows["warm"].get("gap_ms", 0) == 0  # one step only: no gap inside its window


def test_sim_admission_ideal_tier_reads_each_document_once_and_the_cap_saves_bytes():
    """``scripts/sim_admission.py``: every policy finishes every request and reads at
    least the distinct bytes; the ideal tier with HIT_PENDING reads each document exactly
    once; on the thirty-sixth session's 40k order, py-kvcache's model with two documents
    read at a time reads fewer bytes and gives a lower mean TTFT than its defaults (the
    model's finding that docs/results/cpu/admission-sim-s36.md reports)."""
    from helpers.kvutil import load_script

    S = load_script("sim_admission")

    small = [0, 1, 0, 2, 1, 0, 2, 2, 1]
    for p in ("fcfs-pending", "fcfs-join", "affinity-1", "pyk-pending", "pyk-join",
              "pyk-serial-1", "pyk-serial-2"):
        r = S.simulate(small, p, chunks=8, chunk_bytes=1e6, disk_bps=1e8, gpu_requests=3,
                       dram_chunks=10, concurrency=5)
        assert r["bytes_read_gb"] >= r["distinct_gb"] - 1e-9, r
        assert r["last_token_s"] > 0 and r["mean_ttft_s"] <= r["last_token_s"], r
    ideal = S.simulate(small, "fcfs-pending", chunks=8, chunk_bytes=1e6, disk_bps=1e8,
                       gpu_requests=3, dram_chunks=10, concurrency=5)
    assert ideal["bytes_read_gb"] == pytest.approx(ideal["distinct_gb"])
    base = S.simulate(S.S36_ORDER, "pyk-pending", disk_bps=1.76e9)
    cap = S.simulate(S.S36_ORDER, "pyk-serial-2", disk_bps=1.76e9)
    assert cap["bytes_read_gb"] < 0.8 * base["bytes_read_gb"], (cap, base)
    assert cap["mean_ttft_s"] < 0.9 * base["mean_ttft_s"], (cap, base)


def test_preload_session_rows_ratios_stay_within_a_call(tmp_path):
    """``scripts/preload_session_rows.py``: native_fs ratios and preload on/off ratios
    come from the same call only (a call without native_fs gives none), the workload
    follows the file name unless overridden, a failed row keeps its error, the summary
    (JSON and ``--md``) gives medians over calls of within-call ratios, and a file
    whose name names no workload is a clear error, not a traceback."""
    def run_file(name, rows):
        p = tmp_path / name
        p.write_text(json.dumps({"machine": "m", "model": "x", "results": rows}))
        return str(p)

    def row(config, mean, reuse=None, noreuse=None, **kw):
        return {"config": config, "tokens": 100, "concurrency": 4, "mean_ttft_s": mean,
                "mean_ttft_reuse_s": reuse, "mean_ttft_noreuse_s": noreuse,
                "kv_bytes": 10, "docs": 3, "disk_read_bytes": 45, **kw}
    a = run_file("preload50-run-x-100-c1.json", [
        row("kvcache_preload", 6.0, scheduler_stats={"loads_held": 2, "other": 1}),
        row("kvcache_preload_nohold", 9.0, base="kvcache_preload",
            kv_extra={"disk_load_hold_s": 0}),
        row("native_fs", 10.0), {"config": "kvcache_nopreload", "error": "timeout"}])
    b = run_file("preload-run-x-c2.json", [
        row("kvcache_nopreload", 8.0, 10.0, 2.0, hit_docs=[-1, 0, -2],
            ttft_hit_all=[1.0, 9.0, 3.0]),
        row("kvcache_preload", 5.0, 5.0, 2.1)])
    c = run_file("whatever.json", [row("kvcache_preload", 1.0)])
    d = run_file("preload-run-x-c4.json", [
        row("kvcache_nopreload", 9.0, 12.0, 2.5, hit_docs=[-1, 0, -2],
            ttft_hit_all=[2.0, 9.0, 5.0]),
        row("kvcache_preload", 4.0, 4.0, 2.75, hit_docs=[-1, 0, -2],
            ttft_hit_all=[1.0, 4.0, 4.5])])
    e = run_file("scbench-run-x-c5.json", [row("kvcache_preload", 2.0, disk_read_bytes=4),
                                            row("native_fs", 2.5, disk_read_bytes=40)])
    out, md = tmp_path / "s.json", tmp_path / "s.md"
    script = os.path.join(REPO, "scripts", "preload_session_rows.py")
    p = subprocess.run([sys.executable, script, "--out", str(out), "--card", "h100",
                        "--md", str(md), f"c1={a}", f"c2={b}", f"c3={c}@scbench",
                        f"c4={d}", f"c5={e}"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    # medians over calls of within-call ratios, never ratios of medians
    summ = {(s["workload"], s["arm"]): s for s in doc["summary"]}
    on = summ[("mixed", "kvcache_preload")]
    assert on["calls"] == ["c2", "c4"] and on["mean_ttft_s"] == pytest.approx(4.5)
    assert on["reuse_off_on"]["n"] == 2
    assert on["reuse_off_on"]["median"] == pytest.approx((2.0 + 3.0) / 2)
    assert on["noreuse_on_off"]["median"] == pytest.approx((1.05 + 1.1) / 2)
    assert on["noreuse_on_off"]["min"] == pytest.approx(1.05)
    assert on["noreuse_by_position"] == [[0, 1.0], [2, 4.5]]  # c2's row lists none
    assert summ[("mixed", "kvcache_nopreload")]["noreuse_by_position"] == [[0, 1.5],
                                                                           [2, 4.0]]
    sc = summ[("scbench", "kvcache_preload")]
    assert sc["disk_read_vs_native_fs_same_call"]["median"] == pytest.approx(0.1)
    assert sc["calls"] == ["c3", "c5"]  # c3's 1.0 s has no native_fs beside it
    assert sc["vs_native_fs_same_call"] == {"median": pytest.approx(0.8), "n": 1,
                                            "min": pytest.approx(0.8),
                                            "max": pytest.approx(0.8)}
    assert summ[("longdoc", "kvcache_preload_nohold")]["vs_defaults_same_call"][
        "median"] == pytest.approx(1.5)
    text = md.read_text()
    assert "| mixed | 100 | kvcache_preload | c2,c4 | 4.500 |" in text
    assert "1.075 (2; 1.050-1.100)" in text
    rows = {(r["call"], r["arm"]): r for r in doc["results"]}
    assert doc["card"] == "h100" and doc["model"] == "x"
    pre = rows[("c1", "kvcache_preload")]
    assert pre["workload"] == "longdoc" and pre["variant"] == "defaults"
    assert pre["vs_native_fs_same_call"] == pytest.approx(0.6)
    assert pre["scheduler"] == {"loads_held": 2} and pre["distinct_kv_bytes"] == 30
    nohold = rows[("c1", "kvcache_preload_nohold")]
    assert nohold["config"] == "kvcache_preload" and nohold["variant"] == "disk_load_hold_s=0"
    assert nohold["vs_native_fs_same_call"] == pytest.approx(0.9)
    assert nohold["vs_defaults_same_call"] == pytest.approx(1.5)
    assert "vs_defaults_same_call" not in pre
    # bytes against native_fs's of the same call where native_fs counted any (45 each here)
    assert pre["disk_read_vs_native_fs_same_call"] == pytest.approx(1.0)
    assert rows[("c1", "kvcache_nopreload")] == {"call": "c1", "arm": "kvcache_nopreload",
                                                 "error": "timeout"}
    on = rows[("c2", "kvcache_preload")]
    assert on["workload"] == "mixed" and "vs_native_fs_same_call" not in on
    assert on["reuse_off_on"] == pytest.approx(2.0)
    assert on["noreuse_on_off"] == pytest.approx(1.05)
    assert rows[("c2", "kvcache_nopreload")]["noreuse_by_position"] == [[0, 1.0], [2, 3.0]]
    # position 2's fresh request: in c2 without preload the reusing request ahead of it
    # had its first token later (9.0 against 3.0 s), in c4 with preload earlier (4.0
    # against 4.5 s): FCFS served it first
    assert rows[("c2", "kvcache_nopreload")]["reuse_served_before"] == [[0, 0], [2, 0]]
    assert rows[("c4", "kvcache_preload")]["reuse_served_before"] == [[0, 0], [2, 1]]
    assert "noreuse_by_position" not in on  # its run row lists no documents
    assert "reuse_off_on" not in rows[("c1", "kvcache_preload")]  # c1's nopreload failed
    assert rows[("c3", "kvcache_preload")]["workload"] == "scbench"
    p = subprocess.run([sys.executable, script, "--out", str(out), "--card", "h100",
                        f"c1={c}"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "cannot tell the workload" in p.stderr
    assert "Traceback" not in p.stderr
