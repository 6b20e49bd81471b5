"""Shared helpers of the end-to-end tests (real vLLM on the CPU platform: 0.26 in this
interpreter; 0.32 in ``.venv-0.32``'s, through :func:`run_proc` with ``python=``).

Importable without vLLM; vLLM is imported inside the functions that need it, after the
environment of :data:`ENV` is in place (conftest sets it for the pytest process, and
:func:`run_proc` for subprocesses).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable

ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TORCHDYNAMO_DISABLE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}

MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
#: Tokens per storage block in the tests: 2 GPU blocks of 128 tokens (CPU default).
CHUNK = 256
#: KV bytes per GPU block of the tiny model (2 layers x 2 heads x 128 tokens x 2 x 64 x 2 B).
GPU_BLOCK_BYTES = 131072
FILE_BYTES = 4096 + 2 * GPU_BLOCK_BYTES

PROMPTS = {
    # 1000 tokens = 3 full storage blocks + 232 tokens recomputed
    "A": [(i * 7919 + 13) % 3900 + 100 for i in range(1000)],
    "B": [(i * 104729 + 7) % 3900 + 100 for i in range(1000)],
    "C": [(i * 1299709 + 3) % 3900 + 100 for i in range(900)],
}
MAX_TOKENS = 8
LOGPROB_TOL = 1e-3


def write_model(model_dir: str, seed: int = 0) -> str:
    """Tiny Llama with a small RANDOM safetensors checkpoint (~7 MB).

    ``load_format="dummy"`` weights (U(-1e-3, 1e-3)) give ~0 logits, so greedy output
    would not depend on the KV at all; these weights make output sensitive to the KV.
    """
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(MODEL_CONFIG, f)
    path = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(path):
        return model_dir
    import torch
    from safetensors.torch import save_file

    c = MODEL_CONFIG
    h, inter, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd, nh, nkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, s: float = 0.05) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * s).to(torch.bfloat16)

    w = {"model.embed_tokens.weight": r(v, h, s=1.0),
         "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
         "lm_head.weight": r(v, h, s=0.2)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        w[p + "self_attn.q_proj.weight"] = r(nh * hd, h, s=0.15)
        w[p + "self_attn.k_proj.weight"] = r(nkv * hd, h, s=0.15)
        w[p + "self_attn.v_proj.weight"] = r(nkv * hd, h, s=0.15)
        w[p + "self_attn.o_proj.weight"] = r(h, nh * hd)
        w[p + "mlp.gate_proj.weight"] = r(inter, h)
        w[p + "mlp.up_proj.weight"] = r(inter, h)
        w[p + "mlp.down_proj.weight"] = r(h, inter)
    tmp = path + ".tmp"
    save_file(w, tmp)
    os.replace(tmp, path)
    return model_dir


def extra_config(root: str, **kw: Any) -> dict[str, Any]:
    """kv_connector_extra_config for the tests (small pools)."""
    d: dict[str, Any] = {
        "spec_name": "PyKVCacheSpec",
        "spec_module_path": "kvcache_core.vllm",
        "root_dir": root,
        "block_size": CHUNK,
        "staging_bytes": 8 * FILE_BYTES,
        "io_depth": 4,
        "lookahead": 4,
        "copy_headroom": 2,
        "dram_cache_bytes": 0,
    }
    d.update(kw)
    return d


def make_llm(model_dir: str, extra: dict[str, Any] | None, tp: int = 1, **kw: Any):
    """An in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0); ``extra=None``: no
    connector (the recompute reference), unless ``kv_transfer_config`` names another."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = kw.pop("kv_transfer_config", None)
    if extra is not None:
        ktc = KVTransferConfig(kv_connector="OffloadingConnector",
                               kv_connector_module_path="kvcache_core.vllm",
                               kv_role="kv_both", kv_connector_extra_config=extra)
    kw.setdefault("enable_prefix_caching", False)
    kw.setdefault("max_model_len", 2048)
    return LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True,
               dtype="bfloat16", seed=0,
               tensor_parallel_size=tp, kv_transfer_config=ktc, **kw)


def generate(llm, prompt: list[int]) -> dict[str, Any]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    out = o.outputs[0]
    lps = [float(d[t].logprob) for t, d in zip(out.token_ids, out.logprobs, strict=True)]
    return {"tokens": list(out.token_ids), "logprobs": lps,
            "num_cached_tokens": o.num_cached_tokens}


def generate_many(llm, prompts: list[list[int]],
                  priority: list[int] | None = None) -> list[dict[str, Any]]:
    """All ``prompts`` submitted at once (greedy, :data:`MAX_TOKENS` each); outputs in
    prompt order (tokens, logprobs, num_cached_tokens)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False,
                        priority=priority)
    res = []
    for o in outs:
        out = o.outputs[0]
        res.append({"tokens": list(out.token_ids),
                    "logprobs": [float(d[t].logprob) for t, d in
                                 zip(out.token_ids, out.logprobs, strict=True)],
                    "num_cached_tokens": o.num_cached_tokens})
    return res


#: queued engines (:func:`queued`): one running request, the others wait, which is when
#: preload helps
QUEUED_SEQS = 1
#: ... and device KV blocks (128 tokens each) for ONE 1000-token request, so the others
#: wait for blocks (not only for a running slot) as long requests do on a full GPU
QUEUED_GPU_BLOCKS = 10


def store_prompts(model_dir: str, root: str, names: list[str]) -> None:
    """Store the :data:`PROMPTS` ``names`` under ``root``, one at a time, in one engine
    (default test config: files only)."""
    llm = make_llm(model_dir, extra_config(root))
    try:
        for n in names:
            generate(llm, PROMPTS[n])
            drain(llm)
    finally:
        shutdown(llm)


def queued(model_dir: str, root: str, reference: dict, names: list[str],
           **extra: Any) -> tuple[dict[str, int], Any, list[dict[str, Any]]]:
    """Send the :data:`PROMPTS` ``names`` at once to a fresh engine with
    :data:`QUEUED_SEQS` running slot and room for one request (the others queue),
    ``extra`` added to the connector config (preload lookahead 4 unless ``extra`` sets
    it). Checks the outputs against recompute's (``reference``); returns (manager stats,
    connector, outputs)."""
    llm = make_llm(model_dir, extra_config(root, **{"preload_lookahead": 4, **extra}),
                   max_num_seqs=QUEUED_SEQS, num_gpu_blocks_override=QUEUED_GPU_BLOCKS,
                   max_model_len=QUEUED_GPU_BLOCKS * 128)
    try:
        conn = scheduler_connector(llm)
        outs = generate_many(llm, [PROMPTS[n] for n in names])
        drain(llm)
        s = manager(llm).stats()
    finally:
        shutdown(llm)
    for n, o in zip(names, outs, strict=True):
        assert same_output(reference[n], o), n
    return s, conn, outs


def scheduler_connector(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def manager(llm):
    return scheduler_connector(llm).connector_scheduler.manager


def _our_worker(conn) -> Any:
    """The PyKVCacheWorker of a worker-role py-kvcache connector (None before vLLM
    registered the KV caches)."""
    return conn._work.worker if conn._work is not None else None


def _settle_worker(worker) -> Any:
    """Runs in every worker process (``collective_rpc``, on the model-runner thread that
    otherwise drains completions in an engine step): wait until the reactor has no I/O
    in flight (store jobs are acknowledged once copied; their files follow), take the
    reactor's completions as the next engine step would (a flush write that ended after
    the last step is only then among the written keys), then hand over the worker's
    report and the keys whose write-back ended (which unpin their DRAM-tier slots)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    w = _our_worker(get_kv_transfer_group())
    if w is None:
        return None
    if not w.reactor.wait(60):
        raise TimeoutError("reactor I/O still in flight")
    w._drain()
    return (*w.take_report(), w.take_written())


def _kill_reactor(worker) -> bool:
    """Runs in every worker process (``collective_rpc``): the next I/O completion kills
    the reactor thread (an injected bug)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    w = _our_worker(get_kv_transfer_group())
    if w is None:
        return False

    def boom(tag: int, res: int) -> None:
        raise RuntimeError("injected reactor bug")

    w.reactor._on_cqe = boom
    return True


def drain(llm, timeout: float = 60.0) -> None:
    """Step the engine until the connector has no job in flight, then let every worker's
    writes finish and deliver their counters to the scheduler (what later engine steps
    of a serving engine would do)."""
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    end = time.monotonic() + timeout
    while sched.has_requests():
        if time.monotonic() > end:
            raise TimeoutError("connector jobs still pending")
        llm.llm_engine.step()
        time.sleep(0.002)
    m = manager(llm)
    for rep in llm.collective_rpc(_settle_worker):
        if rep is not None:
            failed, counters, written = rep
            m.on_worker_report(failed, counters, written=dict.fromkeys(written, 1))


def reset_prefix_cache(llm, timeout: float = 30.0) -> None:
    """Empty vLLM's GPU prefix cache (the next request of a cached prompt then comes from
    py-kvcache). vLLM refuses while blocks are in use: blocks whose release it still
    delays for a store job are waited for by draining again."""
    end = time.monotonic() + timeout
    while not llm.reset_prefix_cache():
        if time.monotonic() > end:
            raise TimeoutError("vLLM's GPU prefix cache still has blocks in use")
        drain(llm)
        time.sleep(0.05)


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


#: Logprob tolerance where a full prefill is compared with a cached-prefix prefill across
#: tensor-parallel CPU workers: vLLM's CPU fallback kernels (torch linear where oneDNN
#: refuses the CPU) are not bit-stable across those two computations; on our CI machine
#: vLLM's own GPU prefix cache differs from a full prefill by up to 0.06 (see
#: test_preload.test_scbench_like_pressure_bounded_reads_and_staging). Tokens still
#: must be identical.
SPLIT_LOGPROB_TOL = 0.1


def same_output(a: dict[str, Any], b: dict[str, Any], tol: float = LOGPROB_TOL) -> bool:
    return a["tokens"] == b["tokens"] and max(
        abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)) <= tol


def run_proc(plan: dict[str, Any], timeout: float = 240, env: dict[str, str] | None = None,
             wait: bool = True, python: str | None = None):
    """Run :mod:`tests.e2e.engine_proc` with ``plan`` in a fresh process of ``python``
    (default: this interpreter; ``.venv-0.32/bin/python`` runs it on vLLM 0.32).

    Returns the parsed JSON result (``wait``) or the Popen object and its output path.
    """
    import tempfile

    fd, out = tempfile.mkstemp(prefix="pykv_e2e_", suffix=".json")
    os.close(fd)
    plan = dict(plan, out=out)
    e = dict(os.environ)
    # A fresh process must get stable keys WITHOUT help: PyKVCacheSpec sets the seed.
    e.pop("PYTHONHASHSEED", None)
    e.update(ENV)
    e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
    if env:
        e.update(env)
    log = out + ".log"
    with open(log, "w") as lf:
        p = subprocess.Popen([python or PY, "-m", "tests.e2e.engine_proc", json.dumps(plan)],
                             cwd=REPO, env=e, stdout=lf, stderr=subprocess.STDOUT)
    if not wait:
        return p, out
    return finish_proc(p, out, timeout)


def finish_proc(p, out: str, timeout: float = 240) -> dict[str, Any]:
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        rc = -9
    try:
        with open(out + ".log") as f:
            log = f.read()
        if rc != 0:
            raise AssertionError(f"engine process failed (rc={rc}):\n{log[-6000:]}")
        with open(out) as f:
            res = json.load(f)
    finally:
        for path in (out, out + ".log"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    res["log"] = log
    return res


def cache_files(root: str) -> set[str]:
    """Published block files under ``root`` (all namespaces)."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for f in filenames:
            if not f.startswith(".") and f != "meta.json":
                out.add(os.path.join(dirpath, f))
    return out


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
