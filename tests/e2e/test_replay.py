"""``kvcache replay`` as an operator runs it: a real process against a real vLLM 0.26 OpenAI
server (tiny Llama, dummy weights, no tokenizer: token-id prompts), and against a small
http.server stub that answers HTTP 500 to every other request (no vLLM needed).

Exit status checked here (documented in ``kvcache replay --help``): 0 all requests
completed, 1 report written but some requests failed, 2 usage error / server unreachable,
130 interrupted (partial report written).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from . import helpers as H

START_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvcache(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcache_core.cli", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=H.REPO))


def _import_failure(log: str) -> str | None:
    for line in reversed(log.splitlines()):
        if "ModuleNotFoundError" in line or "ImportError" in line:
            return line.strip()
    return None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One vLLM OpenAI server for the module, in its own process group (killed at
    teardown). Skips the module with one line if vLLM cannot start for a missing import."""
    d = tmp_path_factory.mktemp("replay")
    model = d / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(H.MODEL_CONFIG))
    port = _free_port()
    logf = d / "server.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TORCHDYNAMO_DISABLE="1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--load-format", "dummy", "--enforce-eager", "--max-model-len", "2048",
           "--skip-tokenizer-init", "--disable-uvicorn-access-log"]
    with open(logf, "w") as lf:
        proc = subprocess.Popen(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                log = logf.read_text(errors="replace")
                why = _import_failure(log)
                if why:
                    pytest.skip(f"vLLM server cannot start here: {why}")
                pytest.fail(f"vLLM server exited with {proc.returncode}:\n{log[-3000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            if time.monotonic() > end:
                pytest.fail(f"vLLM server not healthy after {START_TIMEOUT_S}s:\n"
                            f"{logf.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("wl") / "scbench.jsonl.gz")
    p = kvcache("workload", "scbench", "--out", out, "--token-ids", "--contexts", "2",
                "--context-tokens", "300", "--rounds", "2", "--question-tokens", "8",
                "--output-len", "6", "--interval-s", "0.3", "--vocab-size", "4096")
    assert p.returncode == 0, p.stderr
    return out


def _check_report(path: str, n: int) -> dict:
    with open(path) as f:
        out = json.load(f)
    stem = os.path.splitext(path)[0]
    assert os.path.getsize(stem + ".md") > 0
    assert os.path.getsize(stem + ".png") > 0  # matplotlib is in the dev venv
    assert out["model"] == "tiny"  # the server's first model (no --model given)
    row = out["results"][0]
    assert row["config"] == "server" and row["n_requests"] == n and row["n_errors"] == 0
    assert row["throughput_rps"] > 0 and row["mean_ttft_s"] > 0
    assert row["median_ttft_s"] <= row["p90_ttft_s"] <= row["p99_ttft_s"]
    # the server's own view of the replay, from vLLM's /metrics
    eng = row["engine"]
    assert eng["requests"] == n and eng["preemptions"] >= 0, eng
    assert eng["mean_prefill_time_s"] > 0 and eng["mean_queue_time_s"] >= 0, eng
    assert "The server's view" in open(stem + ".md").read()
    reqs = out["requests"]
    assert len(reqs) == n
    for r in reqs:
        assert r["error"] is None
        assert 0 < r["ttft_s"] <= r["latency_s"]
        assert r["output_tokens"] == r["output_len"] == 6
        assert len(r["itl_s"]) == r["output_len"] - 1
    by_session: dict = {}
    for r in reqs:
        by_session.setdefault(r["session"], []).append(r)
    assert len(by_session) == 2
    for turns in by_session.values():
        turns.sort(key=lambda r: r["turn"])
        for a, b in zip(turns, turns[1:], strict=False):
            assert b["send_s"] >= a["end_s"] - 1e-3  # next turn after the previous answer
    return out


def test_replay_concurrency_and_trace_times(server, workload, tmp_path):
    out = str(tmp_path / "conc.json")
    p = kvcache("replay", workload, "--url", server, "--concurrency", "2", "--json", out)
    assert p.returncode == 0, p.stderr
    assert "sent 4/4, done 4, in flight 0, errors 0" in p.stderr
    rep = _check_report(out, 4)
    assert rep["mode"] == "concurrency" and rep["mode_params"] == {"concurrency": 2}

    out = str(tmp_path / "trace.json")
    p = kvcache("replay", workload, "--url", server + "/v1", "--trace-times", "--json", out)
    assert p.returncode == 0, p.stderr
    rep = _check_report(out, 4)
    assert rep["mode"] == "trace-times"
    for r in rep["requests"]:
        assert r["send_s"] >= 0.3 * r["id"] - 1e-3  # not before its arrival_s


def test_replay_rate_mode_with_text_free_ids(server, workload, tmp_path):
    out = str(tmp_path / "rate.json")
    p = kvcache("replay", workload, "--url", server, "--model", "tiny", "--rate", "20",
                "--n", "2", "--json", out, "--label", "vllm-cpu")
    assert p.returncode == 0, p.stderr
    with open(out) as f:
        rep = json.load(f)
    assert rep["results"][0]["config"] == "vllm-cpu" and rep["results"][0]["n_requests"] == 2


def test_malformed_line_is_one_line_exit_2(tmp_path):
    wl = tmp_path / "bad.jsonl"
    wl.write_text('{"id": 0, "prompt_token_ids": [5, 6], "output_len": 2}\n'
                  '{"id": 1, "prompt_token_ids": [5, "x"], "output_len": 2}\n')
    p = kvcache("replay", str(wl), "--url", "http://127.0.0.1:9", "--concurrency", "1")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{wl}:2:" in lines[0], p.stderr


def test_unreachable_server_is_one_line_exit_2(workload):
    p = kvcache("replay", workload, "--url", f"http://127.0.0.1:{_free_port()}",
                "--concurrency", "1")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the server" in lines[0], p.stderr


# ---------------------------------------------------------------- failing server stub
class _Stub(BaseHTTPRequestHandler):
    """/v1/models lists "stub"; /v1/completions answers HTTP 500 to every other request
    (the 2nd, 4th, ...), else streams max_tokens chunks (``delay`` s before each)."""

    counter = 0
    lock = threading.Lock()
    delay = 0.01

    def log_message(self, *a):  # quiet
        pass

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "stub"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            type(self).counter += 1
            k = type(self).counter
        if k % 2 == 0:
            body = b'{"error": "internal server error (stub)"}'
            self.send_response(500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(req["max_tokens"]):
            time.sleep(self.delay)
            chunk = {"choices": [{"index": 0, "text": "x"}],
                     "usage": {"prompt_tokens": 3, "completion_tokens": i + 1}}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def stub():
    _Stub.counter = 0
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _ids_workload(path, n: int, gap: float = 0.0) -> str:
    path.write_text("".join(json.dumps({"id": i, "prompt_token_ids": [7, 8, 9],
                                        "output_len": 3, "arrival_s": gap * i}) + "\n"
                            for i in range(n)))
    return str(path)


def test_server_errors_mid_run_are_counted_and_reported(stub, tmp_path):
    wl = _ids_workload(tmp_path / "w.jsonl", 10)
    out = str(tmp_path / "err.json")
    p = kvcache("replay", wl, "--url", stub, "--concurrency", "1", "--json", out)
    assert p.returncode == 1, p.stderr  # report written, some requests failed
    assert "Traceback" not in p.stderr and "5 of 10 requests failed" in p.stderr
    with open(out) as f:
        rep = json.load(f)
    row = rep["results"][0]
    assert row["n_errors"] == 5 and row["n_completed"] == 5 and rep["model"] == "stub"
    assert any("HTTP 500" in e for e in row["errors_sample"])
    ok = [r for r in rep["requests"] if r["error"] is None]
    assert len(ok) == 5 and all(0 < r["ttft_s"] <= r["latency_s"] for r in ok)
    assert "HTTP 500" in open(os.path.splitext(out)[0] + ".md").read()


def test_ctrl_c_writes_the_partial_report(stub, tmp_path):
    _Stub.delay = 0.01
    wl = _ids_workload(tmp_path / "w.jsonl", 6, gap=3.0)  # 15 s of arrivals
    out = str(tmp_path / "int.json")
    proc = subprocess.Popen([sys.executable, "-m", "kvcache_core.cli", "replay", wl, "--url",
                             stub, "--trace-times", "--json", out], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=H.REPO))
    end = time.monotonic() + 60
    while time.monotonic() < end and _Stub.counter < 2:  # until the 2nd request was sent
        time.sleep(0.2)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "partial report written" in err
    with open(out) as f:
        rep = json.load(f)
    assert rep["interrupted"] is True
    states = [r["error"] for r in rep["requests"]]
    assert states[0] is None and "HTTP 500" in states[1]
    assert states[-1] == "not sent (interrupted)"
    assert rep["results"][0]["n_not_sent"] >= 3
