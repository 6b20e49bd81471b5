#!/usr/bin/env python3
"""Long-document benchmark (the paper's Fig. 4 workload) on real vLLM 0.26.0.

N documents of D tokens are sent once (store; cold TTFT), then each is repeated R times in
random order (load; hit TTFT), one output token each, GPU prefix cache off. Configurations,
all in one run, each engine in its own process group:

  recompute     no connector
  native_cpu    vLLM CPUOffloadingSpec (DRAM)
  native_fs     vLLM TieringOffloadingSpec + fs tier; load phase in a fresh process with
                the page cache dropped
  kvcache_disk  py-kvcache, DRAM tier off; load phase in a fresh process, page cache dropped
  kvcache_dram  py-kvcache, DRAM tier on (same process)
  kvcache_disk_gate / kvcache_dram_gate
                the same with the break-even gate on (``--gate-table``; ``auto`` fits the
                table from this run's recompute / kvcache_dram / kvcache_disk rows first)
  recompute_cold
                no connector, but measured like the disk configurations (first access in
                a fresh process after dropping the page cache): the like-for-like baseline
                of a refused disk hit
  kvcache_preload / kvcache_nopreload
                py-kvcache with scheduler preload on (preload_lookahead from
                ``--preload-lookahead``; needs the patched vLLM) / off (preload_lookahead 0);
                load phase in a fresh process, page cache dropped; a DRAM tier of the same
                size as native_fs's CPU tier (1.3 documents), cold at the start
  kvcache_gate_queue
                kvcache_disk_gate plus queue_aware_preload: a disk prefix the gate refuses
                on demand is preloaded while its request queues and loaded only if staged
                in time (compare with kvcache_disk_gate in the same queued workload)

The same run measures the disk's O_DIRECT read bandwidth on the cache root and pinned
host->device bandwidth, so the floor KV/disk + KV/pcie is known. Output JSON:
{"machine","model","kv_bytes_per_token","disk_read_gbps","pcie_h2d_gbps",
 "results":[{"config","tokens","concurrency","ttft_cold_s","ttft_hit_s", ...}]} (medians).

Load phase: the R repeats of the N documents in random order, at most ``--concurrency``
requests in flight (all submitted at once; concurrency 1 = one after another);
``--fresh-frac F`` mixes in that fraction of requests with NO reusable prefix (new random
documents) to see what the cache costs requests that cannot use it.

SCBench-like multi-turn workload (``--workload scbench``; the seed paper's Fig. 12, issue 10
item 3): ``--docs`` shared contexts (default 4) of ``--tokens`` tokens (default 32768) visited
round-robin for ``--repeats`` rounds (default 6); each turn is its context plus a short unique
question (``--question-tokens``, seeded), one output token; a context's next turn is sent
after its previous one answered, at most ``--concurrency`` turns in flight. Round 0 is cold
(each context stored); later rounds reuse the context's KV. With the DRAM/CPU tier of
kvcache_preload / kvcache_nopreload / native_fs at 1.3 contexts, the working set (docs x
context KV) overflows it and the tier thrashes. All rounds run in ONE engine process per
configuration, unlike the store / load split of the other workloads: a multi-turn server
is one long-lived process whose tiers fill and thrash over time (the figure is a time series
of that), and no fresh process is needed to make reuse come from disk, since both py-kvcache
and vLLM's fs tier (``tiering/fs/io.py``) open their files with O_DIRECT, so the page cache
serves neither; one engine start per configuration also leaves more of a 10-minute device
call for the turns. While the engine runs, the driver samples its process tree every
``--sample-interval`` s (default 0.25): RSS and PSS summed over the tree, the machine's used
memory, and the tree's cumulative ``read_bytes`` (/proc/<pid>/io: storage reads, O_DIRECT
included). Rows (``workload: "scbench"``) carry every turn's submit time and TTFT and the
series; ``disk_read_bytes`` is the tree's read_bytes over the turns (``cache_bytes_read``:
py-kvcache's own counter); the table and PNG next to ``--json`` show TTFT per turn, host
memory and disk read throughput over time (``kvcache_core/bench/scbench.py``).

Rounds and variants: ``--rounds N`` (``--workload longdoc``) runs the configuration list N
times, the order reversed every other round; each row then holds the medians over the
rounds and ``round_results`` every round's rows. ``--variant NAME=BASE:KEY=JSON``
(every workload) adds a py-kvcache configuration with extra config
keys under its own name (an A/B of one key in one run). Sizes below 16k tokens take
``--small-docs`` documents (default 8).

Engine processes: the driver spawns the next one while the current one runs, so its
vLLM import overlaps; it creates its engine only once the previous one is gone, and the
running engine sends its measured requests only once the next process has finished
importing (``--no-prespawn``: one after another, as before).

Usage: python -m kvcache_core.bench.longdoc --model DIR --root DIR --json OUT.json
       [--tokens 1024,4096,16384,65536] [--configs ...] [--docs 2] [--repeats 2]
       [--small-docs 8] [--rounds N] [--variant NAME=BASE:KEY=JSON[;KEY=JSON]]
       [--concurrency 1] [--gate-table auto|PATH --gate-json G.json]
       [--preload-json P.json --workload longdoc|mixed|scbench]
(``scripts/bench_longdoc.py`` is the same program.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from . import scbench as SC
from .common import read_stats_file, save_loglog

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALL_CONFIGS = ["recompute", "native_cpu", "native_fs", "kvcache_disk", "kvcache_dram",
               "kvcache_disk_gate", "kvcache_dram_gate", "kvcache_preload", "kvcache_nopreload",
               "recompute_cold", "kvcache_gate_queue", "noop_connector"]
BASE_CONFIGS = ALL_CONFIGS[:5]
COLD_PROCESS = {"native_fs", "kvcache_disk", "kvcache_disk_gate", "kvcache_preload",
                "kvcache_nopreload", "recompute_cold", "kvcache_gate_queue"}
GATE_OF = {"kvcache_disk_gate": "disk", "kvcache_dram_gate": "dram",
           "kvcache_gate_queue": "disk"}
#: Storage block of every offloading configuration, and the KV dtype the runs assume
BLOCK_TOKENS = 256
#: a held engine process (:meth:`_Child.start`) measures after this long at the latest,
#: even if the process spawned ahead of it has not finished importing
HOLD_MAX_S = 120.0
#: how long the driver waits for a killed engine process group to be gone
GROUP_GONE_S = 30.0
DTYPE = "bfloat16"


def log(msg: str) -> None:
    print(f"[longdoc {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def kv_bytes_per_token(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2  # DTYPE


VOCAB = 128000
#: (request id, prompt tokens, submit time, first-token time), time.monotonic()
REQ_LOG: list[tuple[str, int, float, float]] = []


def docs_for(tokens: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed * 1_000_003 + tokens)
    hi = max(200, VOCAB - 100)
    return [[rng.randrange(100, hi) for _ in range(tokens)] for _ in range(n)]


def _kv_extra(text: str) -> tuple[str, Any]:
    """``KEY=JSON`` of ``--kv-extra`` (a value that is not JSON is a string)."""
    key, sep, val = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(val)
    except ValueError:
        return key, val


#: prefix of a ``--variant`` key that sets an environment variable of the engine process
#: instead of a py-kvcache config key (``env.VLLM_KV_CACHE_LAYOUT="HND"``)
ENV_KEY_PREFIX = "env."


def _variant(text: str) -> tuple[str, str, list[tuple[str, Any]]]:
    """``NAME=BASE:KEY=JSON[;KEY=JSON...]`` of ``--variant``: the configuration ``BASE``
    with extra keys, run and reported under ``NAME`` (a new name of letters, digits and
    '_' that starts with ``BASE_``). A key ``env.VAR`` sets the environment variable VAR
    of the variant's engine process (any BASE, e.g. ``recompute_hnd=recompute:
    env.VLLM_KV_CACHE_LAYOUT="HND"``); any other key is a py-kvcache config key (BASE a
    py-kvcache configuration)."""
    name, sep, rest = text.partition("=")
    base, sep2, keys = rest.partition(":")
    kvs = [_kv_extra(kv) for kv in keys.split(";") if kv] if sep2 else []
    cfg_keys = [k for k, _ in kvs if not k.startswith(ENV_KEY_PREFIX)]
    bad_env = [k for k, v in kvs if k.startswith(ENV_KEY_PREFIX)
               and (len(k) == len(ENV_KEY_PREFIX) or not isinstance(v, (str, int, float)))]
    if not (sep and sep2 and kvs and base in ALL_CONFIGS and not bad_env
            and (base.startswith("kvcache") or not cfg_keys)
            and name.startswith(base + "_") and name not in ALL_CONFIGS
            and name.replace("_", "").isalnum()):
        raise argparse.ArgumentTypeError(
            f"--variant {text!r}: expected NAME=BASE:KEY=JSON[;KEY=JSON], BASE one of "
            + ", ".join(ALL_CONFIGS) + ", NAME a new name of letters, digits and '_' "
            "starting with BASE_, KEY a py-kvcache config key (BASE a kvcache "
            "configuration) or env.VAR with a string or number (any BASE) (e.g. "
            "kvcache_dram_dma=kvcache_dram:dram_load_copy=\"dma\", "
            "recompute_hnd=recompute:env.VLLM_KV_CACHE_LAYOUT=\"HND\")")
    return name, base, kvs


def _who(args) -> str:
    """The configuration a worker's log lines name: a ``--variant``'s own name, else the
    built-in configuration (``args`` without ``name``: the built-in one)."""
    return getattr(args, "name", "") or args.config


def variant_keys(args, name: str) -> list[tuple[str, Any]]:
    """The extra py-kvcache config keys of a ``--variant`` name (``[]`` for a built-in
    one; its ``env.`` keys are :func:`variant_env`)."""
    v = getattr(args, "_variants", None) or {}
    return [(k, x) for k, x in v[name][1] if not k.startswith(ENV_KEY_PREFIX)] \
        if name in v else []


def variant_env(args, name: str) -> dict[str, str]:
    """The environment variables a ``--variant`` name sets in its engine process."""
    v = getattr(args, "_variants", None) or {}
    return {k[len(ENV_KEY_PREFIX):]: str(x) for k, x in v[name][1]
            if k.startswith(ENV_KEY_PREFIX)} if name in v else {}


def base_of(args, name: str) -> str:
    """The built-in configuration a ``--variant`` name stands for (``name`` itself if not
    one)."""
    v = getattr(args, "_variants", None) or {}
    return v[name][0] if name in v else name


def transfer_config(cfg: str, args, doc_bytes: int) -> dict | None:
    """The kv-transfer-config of built-in configuration ``cfg`` (py-kvcache's root is
    named after ``args.name``, a variant's name, when set)."""
    block = {"block_size": BLOCK_TOKENS}
    if cfg in ("recompute", "recompute_cold"):
        return None
    if cfg == "noop_connector":  # vLLM's connector machinery alone (scripts/noop_kv_connector.py)
        return {"kv_connector": "NoopConnector", "kv_connector_module_path": "noop_kv_connector",
                "kv_role": "kv_both"}
    if cfg == "native_cpu":
        extra = {**block, "cpu_bytes_to_use": int(doc_bytes * args.docs * 1.3)}
    elif cfg == "native_fs":
        extra = {**block, "spec_name": "TieringOffloadingSpec",
                 "cpu_bytes_to_use": int(doc_bytes * 1.3),
                 "secondary_tiers": [{"type": "fs", "root_dir": os.path.join(args.root, cfg)}]}
    else:
        if cfg.startswith("kvcache_dram"):
            dram = int(doc_bytes * args.docs * 1.3)
        elif cfg in ("kvcache_preload", "kvcache_nopreload"):
            dram = int(doc_bytes * 1.3)  # the same DRAM budget as native_fs's CPU tier
        else:
            dram = 0
        extra = {**block, "spec_name": "PyKVCacheSpec", "spec_module_path": "kvcache_core.vllm",
                 "root_dir": os.path.join(args.root, getattr(args, "name", "") or cfg),
                 "staging_bytes": args.staging_bytes,
                 "io_depth": args.io_depth, "lookahead": args.io_depth,
                 "dram_cache_bytes": dram,
                 "preload_lookahead": 0 if cfg == "kvcache_nopreload"
                 else args.preload_lookahead}
        extra.update(getattr(args, "kv_extra", None) or {})
        if getattr(args, "store_drain", 0) and getattr(args, "phase", "") == "store":
            # --store-drain: the store phase puts every stored block on disk (blocks
            # past the write-back's share get their file later instead of none)
            extra["writeback_flush"] = True
        if cfg in GATE_OF:
            extra["breakeven_table"] = args.gate_table_path
        if cfg == "kvcache_gate_queue":
            extra["queue_aware_preload"] = True
        return {"kv_connector": "OffloadingConnector",
                "kv_connector_module_path": "kvcache_core.vllm", "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": extra}


# ---------------------------------------------------------------------------- worker
async def _ttft(engine, ids: list[int], rid: str) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0.0)
    t0 = time.monotonic()
    async for _out in engine.generate(TokensPrompt(prompt_token_ids=ids), sp, rid):
        break
    t1 = time.monotonic()
    REQ_LOG.append((rid, len(ids), t0, t1))  # CLOCK_MONOTONIC: comparable with the
    return t1 - t0  # reactor trace written by the engine's worker process (--trace)


#: cache counters whose per-size change the result rows carry (``store_counters``)
STORE_COUNTERS = ("stores", "stores_dram", "stores_no_dram_slot", "stores_skipped",
                  "stores_written", "stores_existing", "stores_dropped_backpressure",
                  "stores_dropped_capacity", "ext_slot_waits", "bytes_written")


async def _stats_snapshot(engine, rid: str) -> dict:
    """The scheduler's counters (``$KVCACHE_STATS_FILE``) after one tiny request: the
    workers' counters reach the scheduler with an engine step's metadata, so the step
    of that request brings everything that happened before it (the file is written in
    the background right after a step: read once it was written after the request
    was sent)."""
    path = os.environ.get("KVCACHE_STATS_FILE")
    if not path:
        return {}
    d = await _stats_after_tick(engine, path, rid)
    return {k: d.get(k, 0) for k in STORE_COUNTERS} if d else {}


async def _stats_after_tick(engine, path: str, rid: str) -> dict:
    """Every counter and gauge of the stats file ``path`` as of one tiny request ``rid``
    (:func:`_stats_snapshot`'s handshake); ``{}`` when none was written."""
    t0 = time.time()  # the exporter writes after each step: wait for one after t0
    await _ttft(engine, docs_for(16, 1, 4242)[0], rid)
    return read_stats_file(path, since=t0)


async def _drain_writes(engine, args, rid: str) -> tuple[float, int]:
    """``--store-drain``: after a storing request, wait (up to ``args.store_drain``
    seconds) until py-kvcache has nothing left to write: no store job in flight, no
    DRAM-tier slot pinned by its write-back, no block without its file (the store phase
    runs with writeback_flush, see :func:`transfer_config`). Polls the scheduler's stats
    with tiny requests (:func:`_stats_after_tick`). Returns (seconds waited, blocks
    still without a file); not a py-kvcache configuration (no stats file): (0, 0)."""
    path = os.environ.get("KVCACHE_STATS_FILE")
    if not path or not args.config.startswith("kvcache"):
        return 0.0, 0
    t0 = time.perf_counter()
    n = 0
    while True:
        st = await _stats_after_tick(engine, path, f"{rid}-{n}")
        n += 1
        left = st.get("dram_unwritten", 0)
        if st and not (st.get("stores_in_flight", 0) or st.get("dram_writeback_pinned", 0)
                       or left):
            return time.perf_counter() - t0, 0
        if time.perf_counter() - t0 >= args.store_drain:
            log(f"{_who(args)}/store: write-back not drained after {args.store_drain:.0f}s "
                f"({left} blocks without a file)")
            return time.perf_counter() - t0, int(left)
        await asyncio.sleep(0.25)


def _store_counter_deltas(rows: list[dict]) -> list[dict | None]:
    """Per row (document size, in run order): change of :data:`STORE_COUNTERS` during
    that size's cold (storing) requests."""
    out: list[dict | None] = []
    prev: dict = {}
    for r in rows:
        cur = r.get("stats_after_store")
        if not cur:
            out.append(None)
            continue
        out.append({k: cur.get(k, 0) - prev.get(k, 0) for k in STORE_COUNTERS})
        prev = cur
    return out


async def _limited(sem: asyncio.Semaphore, engine, ids: list[int], rid: str) -> float:
    async with sem:
        return await _ttft(engine, ids, rid)


async def _worker(args) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    global VOCAB
    with open(os.path.join(args.model, "config.json")) as f:
        VOCAB = json.load(f).get("vocab_size", VOCAB)

    tokens = [int(t) for t in args.tokens.split(",")]
    kvb = kv_bytes_per_token(args.model)
    tc = transfer_config(args.config, args, tier_doc_bytes(args, kvb))
    extra_len = args.question_tokens if args.workload == "scbench" else args.hit_suffix_tokens
    ea = AsyncEngineArgs(model=args.model, load_format="dummy", enforce_eager=True,
                         enable_prefix_caching=False,
                         max_model_len=max(tokens) + extra_len + 64,
                         gpu_memory_utilization=0.85, skip_tokenizer_init=True,
                         kv_transfer_config=tc, seed=0,
                         num_gpu_blocks_override=args.gpu_blocks or None)
    t0 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(ea)
    log(f"{_who(args)}/{args.phase}: engine up in {time.perf_counter() - t0:.1f}s")
    out: dict = {"config": args.config, "phase": args.phase, "rows": []}
    rng = random.Random(7)
    try:
        # warm-up (CUDA graphs off; first kernels / allocator)
        await _ttft(engine, docs_for(512, 1, 99)[0], "warm")
        await _await_measure(args)
        for d in tokens:
            docs = docs_for(d, n_docs(args, d), args.seed)
            row = {"tokens": d, "concurrency": args.concurrency}
            if args.workload == "scbench":
                row.update(await _scbench_turns(engine, args, d, docs))
                await _sampled(args, len(out["rows"]) + 1)
                out["rows"].append(row)
                log(f"{_who(args)} scbench D={d}: mean TTFT "
                    f"{statistics.fmean(row['ttft_all']):.3f}s over {len(row['ttft_all'])} "
                    "turns")
                continue
            if args.phase in ("store", "both"):
                cold, drains = [], []
                for i, doc in enumerate(docs):
                    cold.append(await _ttft(engine, doc, f"s{d}-{i}"))
                    if args.store_drain:
                        drains.append(await _drain_writes(engine, args, f"dr{d}-{i}"))
                row["ttft_cold_all"] = cold
                if args.store_drain:
                    row["store_drain_s"] = [t for t, _ in drains]
                    row["store_unwritten_after_drain"] = drains[-1][1] if drains else 0
                await asyncio.sleep(args.settle)  # deferred stores finish
                row["stats_after_store"] = await _stats_snapshot(engine, f"tick{d}")
            if args.phase in ("load", "both"):
                order = [i for i in range(len(docs)) for _ in range(args.repeats)]
                rng.shuffle(order)
                n_fresh = int(round(len(order) * args.fresh_frac / max(1e-9,
                                                                       1 - args.fresh_frac)))
                fresh = docs_for(d, n_fresh, args.seed + 1000 + d) if n_fresh else []
                # --hit-suffix-tokens: each load-phase request = its document + a unique
                # suffix (a question after the shared context), so the cached prefix is
                # not the whole prompt
                ns = args.hit_suffix_tokens
                sfx = docs_for(ns, len(order) + n_fresh, args.seed + 7000 + d) if ns else None
                if ns:
                    row["hit_suffix_tokens"] = ns
                # fresh documents (-1 - k) spread evenly through the order
                for k in range(n_fresh):
                    order.insert(rng.randrange(len(order) + 1), -1 - k)
                sem = asyncio.Semaphore(max(1, args.concurrency))
                t0 = time.perf_counter()
                hits = list(await asyncio.gather(*[
                    _limited(sem, engine, (docs[i] if i >= 0 else fresh[-1 - i])
                             + (sfx[j] if sfx else []), f"h{d}-{j}")
                    for j, i in enumerate(order)]))
                row["load_wall_s"] = time.perf_counter() - t0
                row["ttft_hit_all"] = hits
                row["hit_docs"] = order
                await _sampled(args, len(out["rows"]) + 1)
            out["rows"].append(row)
            log(f"{_who(args)}/{args.phase} D={d}: " + ", ".join(
                f"{k}={statistics.median(v):.3f}s" for k, v in row.items()
                if k.endswith("_all")))
    finally:
        engine.shutdown()
    out["req_log"] = REQ_LOG
    return out


async def _sampled(args, seq: int) -> None:
    """With the parent sampling this process tree: wait until a sample begun after the
    last request is done (the handshake of :class:`.scbench.TreeSampler`; ``seq``: the
    row's number, unique in this process), so that the window delta
    (``scbench.window_delta``) holds every read of the phase."""
    if not args.sample_interval:
        return
    if not await SC.await_sample(args.out_part, seq,
                                 timeout=max(30.0, 20 * args.sample_interval)):
        log(f"{_who(args)}/{args.phase}: no process-tree sample after the last request; "
            "the disk-read window ends at the last sample")


async def _scbench_turns(engine, args, d: int, contexts: list[list[int]]) -> dict:
    """All rounds of the SCBench-like workload on ``contexts`` (see :mod:`.scbench`)."""
    questions = docs_for(args.question_tokens, args.docs * args.repeats, args.seed + 5000 + d)
    turns = await SC.run_turns(lambda ids, rid: _ttft(engine, ids, rid), contexts, questions,
                               args.repeats, args.concurrency, f"sc{d}")
    return {"docs": args.docs, "rounds": args.repeats, "question_tokens": args.question_tokens,
            "turns": turns, "ttft_all": [t["ttft_s"] for t in turns],
            "stats_after": await _stats_snapshot(engine, f"tick{d}")}


# ---------------------------------------------------------------------------- driver
def _jobs(configs: list[str], workload: str,
          base: Any = None) -> list[tuple[str, str]]:
    """The engine processes of a run, in order: (config, phase); ``base`` maps a
    ``--variant`` name to its built-in configuration."""
    out: list[tuple[str, str]] = []
    for cfg in configs:
        if workload != "scbench" and (base(cfg) if base else cfg) in COLD_PROCESS:
            out += [(cfg, "store"), (cfg, "load")]
        else:
            out.append((cfg, "both"))
    return out


class _Child:
    """One engine process of the driver (driver thread only).

    Spawned early (by :func:`_next_child`, with ``--go``): the process imports vLLM and
    torch, then waits for its go file, so the next configuration's imports (7-9 s on the
    idle CPU machine; the nineteenth session's H200 logs show 19 s from spawn to vLLM's
    first line) overlap the current one's engine start, requests and teardown.
    It creates no engine and touches no GPU, cache root or page cache before :meth:`start`,
    which the driver calls only after the previous engine's process group is gone (and,
    for a load phase, after dropping the page cache). :meth:`finish` waits for it and kills
    its group; :meth:`cancel` kills it unused."""

    def __init__(self, args, config: str, phase: str, seq: int) -> None:
        self.config, self.phase, self.seq = config, phase, seq
        # ``seq``: the job's place in the run; a configuration runs more than once with
        # --rounds, and its next process may be spawned while the current one runs
        self.part = os.path.join(args.work, f"{config}-{phase}-j{seq}.json")
        self.go = self.part + ".go"
        # a previous run's files
        for ext in ("", ".go", ".go.tmp", ".ready", ".measure", ".idle", ".sampled"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.part + ext)
        base = base_of(args, config)
        cmd = [sys.executable, "-m", "kvcache_core.bench.longdoc", "--worker", "--config",
               base, "--name", config, "--phase", phase, "--model", args.model, "--root", args.root,
               "--tokens", args.tokens, "--docs", str(args.docs), "--small-docs",
               str(args.small_docs), "--repeats",
               str(args.repeats), "--concurrency", str(args.concurrency), "--staging-bytes",
               str(args.staging_bytes), "--io-depth", str(args.io_depth), "--out-part",
               self.part, "--seed", str(args.seed), "--fresh-frac", str(args.fresh_frac),
               "--gpu-blocks", str(args.gpu_blocks), "--preload-lookahead",
               str(args.preload_lookahead), "--workload", args.workload,
               "--question-tokens", str(args.question_tokens), "--hit-suffix-tokens",
               str(args.hit_suffix_tokens), "--store-drain", str(args.store_drain),
               "--go", self.go]
        for k, v in list(args.kv_extra) + variant_keys(args, config):
            cmd += ["--kv-extra", f"{k}={json.dumps(v)}"]
        env = dict(os.environ, PYTHONHASHSEED="0",
                   KVCACHE_STATS_FILE=os.path.join(args.work, f"{config}-{phase}.stats"),
                   **variant_env(args, config))
        if args.trace:
            env["KVCACHE_TRACE"] = os.path.join(args.trace, f"{config}-{phase}")
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        if base == "noop_connector":  # its connector module lives in scripts/
            env["PYTHONPATH"] = os.path.join(REPO, "scripts") + os.pathsep + env["PYTHONPATH"]
        self.p = subprocess.Popen(cmd, env=env, start_new_session=True)
        self.spawned = time.monotonic()
        self.sampler: Any = None
        self.t_go = 0.0
        self.hold = False

    def ready(self) -> bool:
        """Whether its imports are done (it waits for its go file)."""
        return os.path.exists(self.part + ".ready")

    def start(self, gate_table_path: str, sample: float, hold: bool) -> None:
        """Let it create its engine now (the late-bound arguments go in the go file);
        with ``sample`` > 0 sample its process tree that often (:class:`.scbench.TreeSampler`).
        ``hold``: after its engine is up and warm it waits to send its measured requests
        until :meth:`finish` lets it (once the process spawned ahead of it is done
        importing), so that no import runs beside a measured request."""
        with open(self.go + ".tmp", "w") as f:
            json.dump({"gate_table_path": gate_table_path or "",
                       "sample_interval": sample, "hold": hold}, f)
        os.rename(self.go + ".tmp", self.go)
        self.t_go = time.monotonic()
        self.hold = hold
        if sample > 0:
            self.sampler = SC.TreeSampler(self.p.pid, sample, handshake=self.part).start()

    def finish(self, timeout: float, quiet: Any = None) -> tuple[int, Any]:
        """Wait for it (``timeout`` s from :meth:`start`), kill its process group: (exit
        status, -1 on a timeout; the tree samples or None). A held process (:meth:`start`)
        is let measure once ``quiet()`` is true (or after :data:`HOLD_MAX_S`)."""
        samples = None
        deadline = self.t_go + timeout
        held = self.hold
        rc: int | None = None
        try:
            while rc is None:
                if held and (quiet is None or quiet()
                             or time.monotonic() - self.t_go > HOLD_MAX_S):
                    with open(self.part + ".measure", "w"):
                        pass
                    held = False
                left = deadline - time.monotonic()
                if left <= 0:
                    log(f"{self.config}/{self.phase}: timeout after {timeout}s")
                    rc = -1
                    break
                try:
                    rc = self.p.wait(timeout=min(left, 0.2) if held else left)
                except subprocess.TimeoutExpired:
                    continue
            if rc == 0:
                # the worker exits as soon as its result is written (no interpreter
                # teardown); vLLM's engine processes may still be writing their last
                # stats on the way out: let them end on their own before the kill
                self._wait_gone(max(1.0, min(GROUP_GONE_S, deadline - time.monotonic())))
        finally:
            if self.sampler is not None:
                samples = self.sampler.stop()
            self.cancel()
        return rc, samples

    def cancel(self) -> None:
        """Kill its process group and wait (up to :data:`GROUP_GONE_S`) until no process of
        the group is left: the next engine may start right after, and the GPU memory of
        this one's engine process is free only once that process is gone."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.p.wait(timeout=30)
        if not self._wait_gone(GROUP_GONE_S):
            log(f"{self.config}/{self.phase}: processes of its group still exist after "
                f"{GROUP_GONE_S:.0f}s")

    def _wait_gone(self, limit: float) -> bool:
        """Wait up to ``limit`` s until no process of its group runs; whether none does."""
        end = time.monotonic() + limit
        while group_alive(self.p.pid):
            if time.monotonic() >= end:
                return False
            time.sleep(0.05)
        return True


def group_alive(pgid: int) -> bool:
    """Whether a process of process group ``pgid`` is still running (zombies, which hold no
    memory and may never be reaped by a container's PID 1, do not count)."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
        except OSError:
            continue
        # after the command name in parentheses: state, ppid, pgrp, ...
        fields = st[st.rfind(")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _next_child(args, config: str, phase: str, skip: bool = False) -> _Child | None:
    """The process for (config, phase), which must be the run's next job (``args._jobs``,
    position ``args._job_pos``): the one spawned ahead for it, else a new one; then spawn
    the job after it ahead (unless ``--no-prespawn``). ``skip``: the job is not run (its
    store phase failed: a load phase would measure nothing): the process spawned ahead
    for it is killed and None returned; the job after it is still spawned ahead."""
    jobs = args._jobs
    pos = getattr(args, "_job_pos", 0)
    if pos >= len(jobs) or jobs[pos] != (config, phase):
        raise RuntimeError(f"engine job {config}/{phase} is not the run's next one")
    args._job_pos = pos + 1
    pre: _Child | None = getattr(args, "_pre", None)
    args._pre = None
    child = None
    if pre is not None and pre.seq == pos and not skip:
        child = pre
        log(f"{config}/{phase}: engine process spawned ahead "
            f"{time.monotonic() - pre.spawned:.0f}s ago, imports "
            f"{'done' if pre.ready() else 'still running'}")
    else:
        if pre is not None:
            pre.cancel()
        if skip:
            log(f"{config}/{phase}: skipped (the store phase failed)")
        else:
            child = _Child(args, config, phase, pos)
    if not args.no_prespawn and pos < len(jobs) - 1:
        args._pre = _Child(args, *jobs[pos + 1], pos + 1)
    return child


def _run_child(args, config: str, phase: str, timeout: float,
               sample: float = 0.0) -> dict | None:
    """Run one engine process; with ``sample`` > 0, sample its process tree that often
    (``res["samples"]``, see :class:`.scbench.TreeSampler`)."""
    child = _next_child(args, config, phase)
    assert child is not None
    nxt: _Child | None = args._pre
    child.start(args.gate_table_path or "", sample, hold=nxt is not None)
    rc, samples = child.finish(
        timeout, quiet=None if nxt is None else lambda: nxt.ready() or nxt.p.poll() is not None)
    part = child.part
    if rc != 0 or not os.path.exists(part):
        log(f"{config}/{phase}: failed rc={rc}")
        return None
    with open(part) as f:
        res = json.load(f)
    if samples is not None:
        res["samples"] = samples
    if args.trace:
        with open(os.path.join(args.trace, f"{config}-{phase}.requests.json"), "w") as f:
            json.dump(res.get("req_log", []), f)
    return res


async def _await_measure(args) -> None:
    """A held worker (see :meth:`_Child.start`): engine up and warm, wait for the driver's
    ``.measure`` file before the measured requests."""
    if not getattr(args, "hold", False):
        return
    t0 = time.perf_counter()
    parent = os.getppid()
    while not os.path.exists(args.out_part + ".measure"):
        if os.getppid() != parent:
            raise SystemExit("longdoc worker: the driver is gone")
        await asyncio.sleep(0.05)
    log(f"{_who(args)}/{args.phase}: waited {time.perf_counter() - t0:.1f}s for the next "
        "engine process's imports")


def _await_go(path: str, poll: float = 0.05) -> dict:
    """Worker spawned ahead (``--go``): import what the engine needs, say so (``.ready``
    next to the part file), then wait for the driver's go file and return its JSON (the
    late-bound arguments). Exits if the driver goes away meanwhile."""
    t0 = time.perf_counter()
    import torch  # noqa: F401 - importing is the point: it overlaps the previous engine
    from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: F401
    from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401

    ready = path[:-len(".go")] + ".ready"
    with open(ready, "w") as f:
        f.write(f"{time.perf_counter() - t0:.1f}\n")
    parent = os.getppid()
    while not os.path.exists(path):
        if os.getppid() != parent:
            raise SystemExit("longdoc worker: the driver is gone")
        time.sleep(poll)
    with open(path) as f:
        return json.load(f)


def _first_access(lrow: dict) -> list[float]:
    """TTFTs of the first access to each document in the load phase: in a cold process
    with the page cache dropped, the ones that really come from disk (a later repeat may
    hit a DRAM/CPU tier that the first access filled)."""
    docs = lrow.get("hit_docs")
    if docs is None:
        return []
    seen: set[int] = set()
    out = []
    for t, i in zip(lrow["ttft_hit_all"], docs, strict=True):
        if i >= 0 and i not in seen:
            seen.add(i)
            out.append(t)
    return out


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError as e:
        log(f"cannot drop page cache: {e}")
        return False


def measure_disk(root: str) -> float:
    """O_DIRECT read GB/s of 28 MiB files at depth 8 on the root's filesystem."""
    sys.path.insert(0, REPO)
    from kvcache_core.bench.storage import _raw
    from kvcache_core.io import probe_direct
    from kvcache_core.staging import StagingPool

    d = os.path.join(root, "disk-probe")
    os.makedirs(d, exist_ok=True)
    size, n = 28 << 20, 48
    pool = StagingPool(8, size, pin=False)
    paths = [os.path.join(d, f"f{i}") for i in range(n)]
    direct = probe_direct(d)
    _raw(paths, size, 8, True, direct, pool.views)
    drop_caches()
    dt = _raw(paths, size, 8, False, direct, pool.views)
    pool.close()
    shutil.rmtree(d, ignore_errors=True)
    return n * size / dt / 1e9


def measure_pcie() -> float:
    import torch

    if not torch.cuda.is_available():
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * (1 << 30) / (time.perf_counter() - t0) / 1e9


def _gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:
        return "?"


def read_stats(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvcache-bench-longdoc", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model directory (config.json; dummy weights)")
    ap.add_argument("--root", default="/tmp/longdoc-root", help="cache roots live under here")
    ap.add_argument("--json", help="result JSON (also writes .md and .png next to it)")
    ap.add_argument("--tokens", default=None,
                    help="document sizes in tokens, comma-separated (default "
                    "1024,4096,16384,65536; scbench: 32768)")
    ap.add_argument("--configs", default=",".join(BASE_CONFIGS),
                    help=f"comma-separated, from: {', '.join(ALL_CONFIGS)}")
    ap.add_argument("--docs", type=int, default=None,
                    help="documents per size (default 2; scbench: 4 shared contexts)")
    ap.add_argument("--small-docs", type=int, default=8,
                    help=f"documents per size below {SMALL_TOKENS} tokens (--workload "
                         "longdoc; default 8; the DRAM / CPU tiers grow to hold all of one "
                         "size; 0: --docs for every size)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="hits per document (default 2); scbench: rounds of turns, the "
                    "first one cold (default 6)")
    ap.add_argument("--concurrency", type=int, default=1,
                    help="max requests in flight in the load phase")
    ap.add_argument("--fresh-frac", type=float, default=0.0,
                    help="fraction of load-phase requests with no reusable prefix (mixed "
                    "workload); 0 = all reuse")
    ap.add_argument("--staging-bytes", type=int, default=1 << 30)
    ap.add_argument("--io-depth", type=int, default=8)
    ap.add_argument("--kv-extra", action="append", default=[], metavar="KEY=JSON",
                    type=_kv_extra,
                    help="extra py-kvcache config key for every kvcache configuration, "
                    "e.g. eviction_policy='\"arc\"' or writeback_max_fraction=0.25 "
                    "(repeatable; the value is JSON, a bare word is taken as a string)")
    ap.add_argument("--preload-lookahead", type=int, default=4,
                    help="preload_lookahead of the kvcache configs (kvcache_nopreload: 0)")
    ap.add_argument("--gate-table", default=None,
                    help="break-even table for the *_gate configs: a path, or 'auto' (fit it "
                    "from this run's recompute/kvcache_dram/kvcache_disk rows, written next "
                    "to --json as breakeven-<model>.json)")
    ap.add_argument("--gate-json", help="also write the gate result file (issue schema)")
    ap.add_argument("--preload-json", help="also write the preload result file")
    ap.add_argument("--workload", default="longdoc", choices=("longdoc", "mixed", "scbench"),
                    help="workload name recorded in --preload-json; scbench runs the "
                    "SCBench-like multi-turn workload (module docstring)")
    ap.add_argument("--question-tokens", type=int, default=64,
                    help="scbench: tokens of each turn's unique question")
    ap.add_argument("--hit-suffix-tokens", type=int, default=0,
                    help="longdoc/mixed: unique tokens appended to each load-phase request "
                    "after its document (a question after the shared context), so the "
                    "reusable prefix is not the whole prompt; 0 (default): the document "
                    "alone")
    ap.add_argument("--sample-interval", type=float, default=None,
                    help="seconds between samples of the engine's process tree (host "
                    "memory, disk bytes read); default 0.25 for scbench, else off")
    ap.add_argument("--gpu-blocks", type=int, default=0,
                    help="cap vLLM's GPU KV cache at this many blocks (num_gpu_blocks_override) "
                    "so that requests queue, as on a loaded server; 0 = vLLM's own sizing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settle", type=float, default=2.0, help=argparse.SUPPRESS)
    ap.add_argument("--store-drain", type=float, default=0.0, metavar="S",
                    help="py-kvcache configurations: the store phase writes every stored "
                    "block to disk (writeback_flush on in that phase only) and, after each "
                    "storing request, waits up to S seconds until nothing is left to write, "
                    "so that the load phase starts with the whole workload on disk, as "
                    "native_fs's does; 0 (default): stores as in serving, blocks past "
                    "writeback_max_fraction keep no file")
    ap.add_argument("--timeout", type=float, default=900, help="per engine process, seconds")
    ap.add_argument("--machine", default=None, help="machine name for the JSON")
    ap.add_argument("--no-probe", action="store_true",
                    help="skip the disk / PCIe bandwidth probe (recorded as NaN; tests)")
    ap.add_argument("--append", action="store_true",
                    help="merge into an existing --json: replace the rows of the configs run "
                    "now, keep the others (several calls on one machine, one result file)")
    ap.add_argument("--resume", action="store_true",
                    help="with --append: skip configs that already have rows in --json")
    ap.add_argument("--trace", default=None,
                    help="directory: keep each engine's reactor event trace there "
                    "(<config>-<phase>.r<rank>.<pid>.json) and every request's submit and "
                    "first-token times (<config>-<phase>.requests.json), all in "
                    "CLOCK_MONOTONIC seconds (diagnostics)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--out-part", help=argparse.SUPPRESS)
    ap.add_argument("--gate-table-path", default="", help=argparse.SUPPRESS)
    ap.add_argument("--go", default="", help=argparse.SUPPRESS)
    ap.add_argument("--name", default="", help=argparse.SUPPRESS)
    ap.add_argument("--variant", action="append", default=[], type=_variant,
                    metavar="NAME=BASE:KEY=JSON[;KEY=JSON]",
                    help="a py-kvcache configuration BASE with extra config keys, run as "
                         "its own configuration NAME (list it in --configs), e.g. "
                         "kvcache_dram_dma=kvcache_dram:dram_load_copy=\"dma\" "
                         "(every --workload)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the --configs list this many times, the order reversed every "
                         "other round (A B C, C B A, ...), each configuration in new engine "
                         "processes; each row then holds the median over rounds of "
                         "ttft_cold_s / ttft_hit_s / ttft_first_hit_s and the per-round "
                         "values in *_rounds; --workload longdoc only")
    ap.add_argument("--no-prespawn", action="store_true",
                    help="start each engine process only when its turn comes (default: the "
                         "next one is spawned while the current one runs, so its vLLM "
                         "import overlaps; it creates its engine only when the previous "
                         "one is gone; always off for --workload scbench, whose host "
                         "memory series would include it)")
    return ap


def _load_stats(args, cfg: str) -> tuple[list[dict], list[dict]]:
    """(all worker stat lines, load-phase ones) of one configuration."""
    w = args.work
    load = (read_stats(os.path.join(w, f"{cfg}-load.stats.workers.jsonl"))
            + read_stats(os.path.join(w, f"{cfg}-both.stats.workers.jsonl")))
    return read_stats(os.path.join(w, f"{cfg}-store.stats.workers.jsonl")) + load, load


def _scheduler_stats(args, cfg: str) -> dict:
    """The scheduler's last counters of the load phase (nonzero ones; ``{}`` if the
    configuration has none): gate decisions, staged hits, preloads planned."""
    for phase in ("load", "both"):
        path = os.path.join(args.work, f"{cfg}-{phase}.stats")
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                d = json.load(f)
            return {k: v for k, v in d.items() if isinstance(v, (int, float)) and v}
    return {}


def _ensure_gate_table(args, results: list[dict], model_name: str) -> None:
    if args.gate_table_path:
        return
    if args.gate_table in (None, ""):
        raise SystemExit("*_gate configs need --gate-table PATH|auto")
    if args.gate_table != "auto":
        args.gate_table_path = os.path.abspath(args.gate_table)
        return
    from kvcache_core.breakeven import fit_from_longdoc

    run = {"results": results + list(getattr(args, "_old_results", None) or []),
           "gpu": _gpu_name(), "model": model_name, "disk_read_gbps": args._disk,
           "pcie_h2d_gbps": args._pcie, "block_size": BLOCK_TOKENS, "dtype": DTYPE}
    table = fit_from_longdoc(run)
    out_dir = os.path.dirname(os.path.abspath(args.json or os.path.join(args.root, "x")))
    path = os.path.join(out_dir, f"breakeven-{model_name}.json")
    with open(path, "w") as f:
        json.dump(table.to_json(), f, indent=1)
    args.gate_table_path = path
    log(f"gate table fitted from this run: {table.thresholds} -> {path}")


def _summary(ttfts: list[float], order: list[int]) -> dict:
    reuse = [t for t, i in zip(ttfts, order, strict=False) if i >= 0]
    fresh = [t for t, i in zip(ttfts, order, strict=False) if i < 0]
    qs = statistics.quantiles(ttfts, n=10) if len(ttfts) >= 2 else ttfts * 9
    return {"mean_ttft_s": statistics.fmean(ttfts), "median_ttft_s": statistics.median(ttfts),
            "p90_ttft_s": qs[8],
            "mean_ttft_reuse_s": statistics.fmean(reuse) if reuse else None,
            "mean_ttft_noreuse_s": statistics.fmean(fresh) if fresh else None,
            "n_requests": len(ttfts), "n_noreuse": len(fresh)}


#: ``--small-docs`` applies to document sizes below this many tokens
SMALL_TOKENS = 16384


def n_docs(args, d: int) -> int:
    """Documents of ``d`` tokens in a run: ``--docs``; in the longdoc workload, sizes below
    :data:`SMALL_TOKENS` take ``--small-docs`` (a 1k request's TTFT is 15-30 ms and
    varies by several ms from request to request, so two documents cannot show a 5 %
    difference). The DRAM / CPU tiers are sized by :func:`tier_doc_bytes` so that they
    still hold every document of any one size."""
    small = getattr(args, "small_docs", 0) or 0
    if args.workload != "longdoc" or d >= SMALL_TOKENS or small <= args.docs:
        return args.docs
    return small


def tier_doc_bytes(args, kvb: int) -> int:
    """The "document" bytes that :func:`transfer_config` sizes the tiers by (a DRAM / CPU
    tier of ``--docs`` x 1.3 such documents): the largest document, or more where the
    documents of a smaller size (``--small-docs`` of them) hold more tokens in all than
    ``--docs`` of the largest (e.g. ``--tokens 1024`` alone)."""
    sizes = [int(t) for t in str(args.tokens).split(",")]
    most = max(n_docs(args, d) * d for d in sizes)
    return max(max(sizes), -(-most // args.docs)) * kvb


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Per-workload defaults of --tokens, --docs, --repeats, --sample-interval."""
    sc = args.workload == "scbench"
    if args.tokens is None:
        args.tokens = "32768" if sc else "1024,4096,16384,65536"
    if args.docs is None:
        args.docs = 4 if sc else 2
    if args.repeats is None:
        args.repeats = 6 if sc else 2
    if args.sample_interval is None:
        # scbench: host memory over time; mixed (the preload workload): the engine
        # tree's disk reads, so native_fs's are counted like py-kvcache's
        args.sample_interval = 0.25 if sc or args.workload == "mixed" else 0.0
    return args


def dram_budget(cfg: str, args, doc_bytes: int) -> int | None:
    """Bytes of the DRAM / CPU tier that ``transfer_config`` gives ``cfg`` (None: none)."""
    tc = transfer_config(cfg, args, doc_bytes)
    if tc is None:
        return None
    extra = tc["kv_connector_extra_config"]
    return extra.get("dram_cache_bytes", extra.get("cpu_bytes_to_use"))


def _scbench_results(args, cfg: str, res: dict, kvb: int) -> list[dict]:
    """The SCBench-like rows of configuration ``cfg`` (a ``--variant`` name keeps its
    base, whose DRAM budget it has, and its extra keys, as the other workloads' rows)."""
    doc_bytes = tier_doc_bytes(args, kvb)
    base = base_of(args, cfg)
    keys = list(args.kv_extra) + variant_keys(args, cfg)
    out = []
    for wrow in res["rows"]:
        row = SC.scbench_row(cfg, wrow, res.get("samples"), kvb,
                             dram_budget(base, args, doc_bytes))
        row["store_counters"] = wrow.get("stats_after") or None
        if keys and base.startswith("kvcache"):
            row["kv_extra"] = dict(keys)
        if base != cfg:
            row["base"] = base
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    args = resolve_defaults(build_parser().parse_args(argv))
    if args.worker:
        if args.go:
            late = _await_go(args.go)
            args.gate_table_path = late.get("gate_table_path", "")
            args.sample_interval = late.get("sample_interval", 0.0)
            args.hold = bool(late.get("hold", False))
        res = asyncio.run(_worker(args))
        with open(args.out_part, "w") as f:
            json.dump(res, f)
        # the engine is shut down and the result written: skip the interpreter's teardown
        # (seconds of torch / vLLM finalizers the driver would wait for)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    # the driver: a SIGTERM (``timeout``, ``pkill``) unwinds like SystemExit, so the
    # ``finally`` blocks kill every engine process group it started; otherwise an engine
    # outlives the run and holds its GPU memory against the next one
    in_main = threading.current_thread() is threading.main_thread()
    prev_term = signal.signal(signal.SIGTERM, _terminate) if in_main else None
    try:
        return _drive(args)
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, prev_term)


def _drive(args) -> int:
    """The driver's run (:func:`main` without ``--worker``)."""
    os.makedirs(args.root, exist_ok=True)
    if args.trace:
        args.trace = os.path.abspath(args.trace)
        os.makedirs(args.trace, exist_ok=True)
    args.work = os.path.join(args.root, "parts")
    os.makedirs(args.work, exist_ok=True)
    model_name = os.path.basename(os.path.normpath(args.model))
    configs = [c for c in args.configs.split(",") if c]
    args._variants = {n: (b, kv) for n, b, kv in args.variant}
    bad = [c for c in configs if c not in ALL_CONFIGS and c not in args._variants]
    if bad:
        raise SystemExit(f"unknown config(s) {bad}; choose from {ALL_CONFIGS} or a "
                         "--variant name")
    if args.rounds != 1 and args.workload != "longdoc":
        raise SystemExit("--rounds is for --workload longdoc only")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    prior: list[dict] = []  # --rounds: the rows of the (config, round)s already measured
    if args.resume and args.append and args.json and os.path.exists(args.json):
        with open(args.json) as f:
            old = json.load(f)
        if args.rounds > 1:
            prior = resume_rounds(old, configs)
            if prior:
                log("resume: " + ", ".join(sorted({f"{r['config']} round {r['round']}"
                                                    for r in prior}))
                    + f" already measured in {args.json}")
        else:
            done = {r["config"] for r in old.get("results", []) if "error" not in r}
            skipped = [c for c in configs if c in done]
            configs = [c for c in configs if c not in done]
            if skipped:
                log(f"resume: {', '.join(skipped)} already measured in {args.json}")
    if args.no_probe:
        disk = pcie = float("nan")
    else:
        log("measuring disk and PCIe bandwidth")
        disk = measure_disk(args.root)
        pcie = measure_pcie()
    args._disk, args._pcie = disk, pcie
    log(f"disk_read_gbps={disk:.2f} pcie_h2d_gbps={pcie:.1f}")
    kvb = kv_bytes_per_token(args.model)
    sizes = [int(t) for t in str(args.tokens).split(",")]
    log("documents per size: " + ", ".join(f"{d}: {n_docs(args, d)}" for d in sizes)
        + f"; tiers sized for {args.docs} x {tier_doc_bytes(args, kvb) // kvb} tokens")
    results: list[dict] = []
    out = save(args, results, disk, pcie, kvb, model_name)
    done_pairs = {(r["config"], r["round"]) for r in prior}
    schedule = [j for j in _schedule(configs, args.rounds) if j not in done_pairs]
    args._prior = prior
    args._jobs = _jobs([c for c, _ in schedule], args.workload, lambda c: base_of(args, c))
    if args.workload == "scbench":
        args.no_prespawn = True
    try:
        out = _run_configs(args, schedule, results, disk, pcie, kvb, model_name, out)
    finally:
        if getattr(args, "_pre", None) is not None:  # spawned ahead, never started
            args._pre.cancel()
    print(json.dumps({k: v for k, v in out.items() if k != "results"}, indent=1))
    return 0


def _terminate(signum: int, frame: Any) -> None:
    """The driver's SIGTERM handler (main thread): exit through the ``finally`` blocks."""
    log(f"signal {signum}: stopping; killing the engine processes")
    raise SystemExit(128 + signum)


def resume_rounds(old: dict, configs: list[str]) -> list[dict]:
    """``--resume`` with ``--rounds``: the rows of an earlier (cut short) run's
    ``round_results`` for ``configs``, of every (config, round) that finished (a failed
    pair has its one error row instead, and runs again). The run then measures only the
    other pairs, and its medians include these rows. A file written without ``--rounds``
    (no ``round_results``; its ``results`` rows are single measurements) counts as round
    1, so that ``--rounds 2`` on it measures round 2 only (the twenty-second session's 8B
    call ran round 1 again and overwrote the earlier call's rows)."""
    rows = old.get("round_results")
    if rows is None:
        rows = [dict(r, round=1) for r in old.get("results", [])
                if r.get("rounds") is None and r.get("round") is None]
    return [r for r in rows if r.get("config") in configs
            and r.get("round") is not None and "error" not in r]


def _schedule(configs: list[str], rounds: int) -> list[tuple[str, int]]:
    """(configuration, round) in run order: the list, then reversed, then the list ...
    (so that no configuration always runs right after the same neighbour)."""
    out: list[tuple[str, int]] = []
    for r in range(1, rounds + 1):
        out += [(c, r) for c in (configs if r % 2 else configs[::-1])]
    return out


#: per-row values that ``--rounds`` reports as the median over rounds (``<key>_rounds``:
#: each round's value)
ROUND_KEYS = ("ttft_cold_s", "ttft_hit_s", "ttft_first_hit_s", "mean_ttft_s",
              "median_ttft_s", "p90_ttft_s")


def merge_rounds(raw: list[dict]) -> list[dict]:
    """One row per (config, tokens) from the rows of every round (``round`` key): a row
    measured in one round only is returned as is; otherwise the first round's row with
    :data:`ROUND_KEYS` replaced by their median over the rounds (``<key>_rounds``: the
    per-round values, in round order), the raw TTFT lists concatenated, ``rounds``: how
    many. Error rows are kept as they are."""
    groups: dict[tuple, list[dict]] = {}
    order: list[tuple] = []
    for r in raw:
        k = (r["config"], r.get("tokens"), "error" in r)
        if k not in groups:
            groups[k] = []
            order.append(k)
        groups[k].append(r)
    out = []
    for k in order:
        rows = groups[k]
        if len(rows) == 1 or k[2]:
            out += rows[:1] if k[2] else rows
            continue
        m = dict(rows[0])
        for key in ROUND_KEYS:
            vals = [r.get(key) for r in rows]
            m[key + "_rounds"] = vals
            got = [v for v in vals if v is not None]
            m[key] = statistics.median(got) if got else None
        for key in ("ttft_cold_all", "ttft_hit_all", "hit_docs"):
            if all(r.get(key) is not None for r in rows):
                m[key] = [x for r in rows for x in r[key]]
        m["rounds"] = len(rows)
        m["round"] = [r.get("round") for r in rows]
        out.append(m)
    return out


def _run_configs(args, schedule: list[tuple[str, int]], results: list[dict], disk: float,
                 pcie: float, kvb: int, model_name: str, out: dict) -> dict:
    """Run every (configuration, round)'s engine process(es) in turn and put its rows in
    ``results`` (merged over rounds, :func:`merge_rounds`; the result files are rewritten
    after each). Returns the last save."""
    raw: list[dict] = list(getattr(args, "_prior", None) or [])  # resumed rounds first
    args._raw = raw  # save() writes them as round_results

    def publish() -> dict:  # the rows so far (merged over rounds) into the result files
        results[:] = merge_rounds(raw) if args.rounds > 1 else raw
        return save(args, results, disk, pcie, kvb, model_name)

    if raw:  # resumed rounds: their medians in the files at once
        out = publish()
    for n, (cfg, rnd) in enumerate(schedule, 1):
        log(f"[{n}/{len(schedule)}] {cfg}" + (f", round {rnd}" if args.rounds > 1 else ""))
        base = base_of(args, cfg)
        mark = len(raw)
        if base in GATE_OF:
            _ensure_gate_table(args, results, model_name)
        shutil.rmtree(os.path.join(args.root, cfg), ignore_errors=True)
        for stale in ("store", "load", "both"):
            for ext in (".stats", ".stats.workers.jsonl"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(args.work, f"{cfg}-{stale}{ext}"))
        if args.workload == "scbench":
            store = load = _run_child(args, cfg, "both", args.timeout, args.sample_interval)
            dropped = None
        elif base in COLD_PROCESS:
            store = _run_child(args, cfg, "store", args.timeout)
            if store is None:  # e.g. vLLM's tiering KeyError: nothing to load
                _next_child(args, cfg, "load", skip=True)
                dropped, load = None, None
            else:
                dropped = drop_caches()
                load = _run_child(args, cfg, "load", args.timeout, args.sample_interval)
        else:
            store = load = _run_child(args, cfg, "both", args.timeout)
            dropped = None
        stats, lstats = _load_stats(args, cfg)
        sched = _scheduler_stats(args, cfg)
        if not store or not load:
            raw.append({"config": cfg, "error": "engine run failed",
                        **({"round": rnd} if args.rounds > 1 else {})})
            out = publish()
            continue
        if args.workload == "scbench":
            raw += _scbench_results(args, cfg, load, kvb)
        deltas = [] if args.workload == "scbench" else _store_counter_deltas(store["rows"])
        for srow, lrow, sc in zip(store["rows"], load["rows"], deltas, strict=False):
            d = srow["tokens"]
            floor = d * kvb / (disk * 1e9) + d * kvb / (pcie * 1e9)
            first = _first_access(lrow)
            hits = lrow["ttft_hit_all"]
            row = {"config": cfg, "tokens": d, "concurrency": args.concurrency,
                   "docs": n_docs(args, d),
                   "ttft_cold_s": statistics.median(srow["ttft_cold_all"]),
                   "ttft_hit_s": statistics.median(hits),
                   "ttft_first_hit_s": statistics.median(first) if first else None,
                   "ttft_cold_all": srow["ttft_cold_all"], "ttft_hit_all": hits,
                   "hit_docs": lrow.get("hit_docs"), "wall_s": lrow.get("load_wall_s"),
                   "kv_bytes": d * kvb, "disk_floor_s": floor, "page_cache_dropped": dropped,
                   "store_counters": sc,
                   **_summary(hits, lrow.get("hit_docs") or [0] * len(hits))}
            keys = list(args.kv_extra) + variant_keys(args, cfg)
            if keys and base.startswith("kvcache"):
                row["kv_extra"] = dict(keys)
            if venv := variant_env(args, cfg):
                row["env"] = venv
            if base != cfg:
                row["base"] = base
            if args.rounds > 1:
                row["round"] = rnd
            if "store_drain_s" in srow:  # --store-drain: how long the write-back took
                row["store_drain_s"] = srow["store_drain_s"]
                row["store_unwritten_after_drain"] = srow["store_unwritten_after_drain"]
            reqs = load.get("req_log") or []
            if load.get("samples") and reqs and len(load["rows"]) == 1:
                # every config alike, while the load phase's requests were in flight (not
                # while the engine started): what the engine's process tree read from
                # storage (O_DIRECT reads, and buffered ones that missed the page cache)
                # and how much the host's page cache grew (buffered reads keep what they
                # read there, outside any tier's budget)
                t0, t1 = min(q[2] for q in reqs), max(q[3] for q in reqs)
                row["tree_read_bytes"] = SC.window_delta(load["samples"], "read_bytes", t0, t1)
                row["page_cache_growth_bytes"] = SC.window_delta(
                    load["samples"], "page_cache_bytes", t0, t1)
            raw.append(row)
        if stats:
            peak = max(s.get("peak_staging_bytes", 0) for s in stats)
            budget = max(s.get("staging_budget_bytes", 0) for s in stats)
            diag = {"timing_store_phase": [s.get("timing") for s in stats if s not in lstats],
                    "timing_load_phase": [s.get("timing") for s in lstats],
                    "reactor_timing": [s.get("reactor_timing") for s in stats]}
            for r in raw[mark:]:
                if r["config"] == cfg:
                    r["peak_staging_bytes"] = peak
                    r["staging_budget_bytes"] = budget
                    # scbench: disk_read_bytes is the process tree's (all configs alike)
                    key = ("cache_bytes_read" if args.workload == "scbench"
                           else "disk_read_bytes")
                    r[key] = sum(s.get("bytes_read", 0) for s in lstats)
                    if args.workload != "scbench":  # blocks read from disk more than once
                        r["disk_reads_repeat"] = sum(s.get("disk_reads_repeat", 0)
                                                     for s in lstats)
                    r["worker_stats"] = diag
                    r["scheduler_stats"] = sched
                    if base in GATE_OF:
                        r["gate_table"] = args.gate_table_path
        shutil.rmtree(os.path.join(args.root, cfg), ignore_errors=True)
        out = publish()  # after every config
    return out


def save(args, results: list[dict], disk: float, pcie: float, kvb: int,
         model_name: str) -> dict:
    """Write JSON + table + plot (called after every configuration: a run cut short by
    a time limit still leaves its finished configurations)."""
    for r in results:
        r["disk_read_gbps"], r["pcie_h2d_gbps"] = disk, pcie
    out = {"machine": args.machine or _gpu_name(), "gpu": _gpu_name(), "model": model_name,
           "kv_bytes_per_token": kvb, "disk_read_gbps": disk, "pcie_h2d_gbps": pcie,
           "block_size": BLOCK_TOKENS, "dtype": DTYPE, "docs": args.docs,
           "repeats": args.repeats, "rounds": getattr(args, "rounds", 1),
           "results": list(results)}
    if out["rounds"] > 1:  # every round's own rows, in run order
        out["round_results"] = list(getattr(args, "_raw", None) or [])
    if args.append and args.json and os.path.exists(args.json):
        with open(args.json) as f:
            old = json.load(f)
        if not getattr(args, "_old_results", None):
            args._old_results = old.get("results", [])
        ran = {r["config"] for r in results}
        kept = [r for r in args._old_results if r["config"] not in ran]
        out["results"] = kept + list(results)
        bw = [(r.get("disk_read_gbps"), r.get("pcie_h2d_gbps")) for r in out["results"]]
        for i, key in enumerate(("disk_read_gbps", "pcie_h2d_gbps")):
            got = [b[i] for b in bw if b[i]]
            if got:  # else this run's own probe (rows of older files may lack it)
                out[key] = statistics.median(got)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        base = os.path.splitext(args.json)[0]
        if args.workload == "scbench":
            with open(base + ".md", "w") as f:
                f.write("\n".join(SC.scbench_table(out)) + "\n")
        else:
            write_table(out, base + ".md")
        try:
            (SC.plot_scbench if args.workload == "scbench" else plot)(out, base + ".png")
        except Exception as e:  # matplotlib missing etc.
            log(f"no plot: {e}")
    if args.gate_json and args.gate_table_path:
        from .gate_report import write_gate

        write_gate(out, args.gate_table_path, args.gate_json)
    if args.preload_json:
        write_preload(out, args.preload_json, args.workload)
    return out


PRELOAD_CONFIGS = ("kvcache_preload", "kvcache_nopreload", "native_fs", "kvcache_disk_gate",
                   "kvcache_gate_queue", "recompute_cold")
PRELOAD_KEYS = ("tokens", "concurrency", "mean_ttft_s", "median_ttft_s", "p90_ttft_s",
                "mean_ttft_noreuse_s", "mean_ttft_reuse_s", "wall_s", "peak_staging_bytes",
                "staging_budget_bytes", "disk_read_bytes", "n_requests", "n_noreuse",
                "tree_read_bytes", "page_cache_growth_bytes", "disk_reads_repeat")


def write_preload(run: dict, path: str, workload: str) -> dict:
    """Write / merge the preload result file: rows keyed by (workload, config, tokens);
    a later run replaces only its own rows. Also a Markdown table next to it."""
    # a --variant of a preload configuration is a row too, with its base and extra keys
    rows = [{"workload": workload, "config": r["config"], **{k: r.get(k) for k in PRELOAD_KEYS},
             **{k: r[k] for k in ("base", "kv_extra") if k in r}}
            for r in run["results"]
            if r.get("base", r.get("config")) in PRELOAD_CONFIGS and "tokens" in r]
    old: list[dict] = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f).get("results", [])
    new_keys = {(r["workload"], r["config"], r["tokens"]) for r in rows}
    allrows = [r for r in old if (r["workload"], r["config"], r["tokens"]) not in new_keys] + rows
    out = {"machine": run["machine"], "model": run["model"],
           "disk_read_gbps": run["disk_read_gbps"], "results": allrows}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    lines = [f"# Preload: {run['model']} on {run['machine']}", "",
             "longdoc / mixed: disk-only (fresh process, page cache dropped), all requests "
             "submitted at once, at most `concurrency` in flight, one output token. scbench: "
             "shared contexts visited round-robin, all rounds in one process, reuse = later "
             "visits, no-reuse = first (storing) visits, disk read = the engine process "
             "tree's read_bytes (same DRAM/CPU budget of 1.3 contexts for every config). "
             "longdoc / mixed: disk read = py-kvcache's own counter; repeat reads = its "
             "reads of a block it had already read from disk in that process; tree read = the "
             "engine process tree's read_bytes in the load phase and page cache growth = "
             "how much the host's page cache grew meanwhile (every config alike: buffered "
             "reads keep what they read there, outside any tier's budget). "
             "Times in seconds.", "",
             "| workload | tokens | conc | config | mean TTFT | median | p90 | mean reuse | "
             "mean no-reuse | wall | peak staging / budget (MB) | disk read (GB) | "
             "repeat reads | tree read (GB) | page cache growth (GB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f3(v):
        return "-" if v is None else f"{v:.3f}"

    for r in sorted(allrows, key=lambda r: (r["workload"], r["tokens"], r["config"])):
        st = ("-" if r.get("peak_staging_bytes") is None else
              f"{r['peak_staging_bytes'] / 1e6:.0f} / {r['staging_budget_bytes'] / 1e6:.0f}")
        rd = "-" if not r.get("disk_read_bytes") else f"{r['disk_read_bytes'] / 1e9:.1f}"
        tr = ("-" if r.get("tree_read_bytes") is None
              else f"{r['tree_read_bytes'] / 1e9:.1f}")
        pc = ("-" if r.get("page_cache_growth_bytes") is None
              else f"{r['page_cache_growth_bytes'] / 1e9:.1f}")
        rep = "-" if r.get("disk_reads_repeat") is None else str(r["disk_reads_repeat"])
        lines.append(f"| {r['workload']} | {r['tokens']} | {r['concurrency']} | {r['config']} "
                     f"| {f3(r['mean_ttft_s'])} | {f3(r['median_ttft_s'])} | "
                     f"{f3(r['p90_ttft_s'])} | {f3(r.get('mean_ttft_reuse_s'))} | "
                     f"{f3(r['mean_ttft_noreuse_s'])} | "
                     f"{f3(r['wall_s'])} | {st} | {rd} | {rep} | {tr} | {pc} |")
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        plot_preload(out, os.path.splitext(path)[0] + ".png")
    except Exception as e:  # matplotlib missing
        log(f"no preload plot: {e}")
    return out


def plot_preload(out: dict, path: str) -> None:
    """Grouped bars: mean TTFT of reusing and of no-reuse requests, per config, per
    (workload, tokens)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["results"]
    groups = sorted({(r["workload"], r["tokens"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4), squeeze=False)
    for ax, (wl, d) in zip(axes[0], groups, strict=True):
        rs = [r for r in rows if (r["workload"], r["tokens"]) == (wl, d)]
        rs.sort(key=lambda r: (PRELOAD_CONFIGS.index(r.get("base", r["config"])),
                               r["config"]))  # a --variant next to its base
        xs = range(len(rs))
        reuse = [r.get("mean_ttft_reuse_s") or r["mean_ttft_s"] for r in rs]
        fresh = [r.get("mean_ttft_noreuse_s") or 0.0 for r in rs]
        ax.bar([x - 0.2 for x in xs], reuse, 0.4, label="reusing requests")
        ax.bar([x + 0.2 for x in xs], fresh, 0.4, label="no reusable prefix")
        ax.set_xticks(list(xs), [r["config"] for r in rs], fontsize=8)
        ax.set_ylabel("mean TTFT (s)")
        ax.set_title(f"{wl}, {d} tokens, {rs[0]['concurrency']} in flight")
        ax.legend(fontsize=8)
    fig.suptitle(f"{out['model']} on {out['machine']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _hit(r: dict) -> float:
    """Hit TTFT to report: for the cold-process disk configurations the first access of
    each document (really read from disk; a repeat may hit the CPU tier it filled)."""
    if r["config"] in COLD_PROCESS and r.get("ttft_first_hit_s") is not None:
        return r["ttft_first_hit_s"]
    return r["ttft_hit_s"]


def _row_configs(rows: list[dict]) -> list[str]:
    """The configurations of ``rows``: the built-in ones in :data:`ALL_CONFIGS` order, then
    ``--variant`` names in the order they first appear."""
    seen = [r["config"] for r in rows]
    return ([c for c in ALL_CONFIGS if c in seen]
            + [c for c in dict.fromkeys(seen) if c not in ALL_CONFIGS])


def _small_docs_note(out: dict, rows: list[dict]) -> str:
    """`` (8 at 1024, 4096 tokens)`` where sizes ran with other than ``out["docs"]``
    documents (``--small-docs``), else empty."""
    by: dict[int, list[int]] = {}
    for r in rows:
        n = r.get("docs", out["docs"])
        if n != out["docs"] and r["tokens"] not in by.get(n, []):
            by.setdefault(n, []).append(r["tokens"])
    if not by:
        return ""
    return " (" + "; ".join(f"{n} at {', '.join(str(t) for t in sorted(ts))} tokens"
                            for n, ts in sorted(by.items())) + ")"


def write_table(out: dict, path: str) -> None:
    rows = [r for r in out["results"] if "ttft_hit_s" in r]
    sizes = sorted({r["tokens"] for r in rows})
    cfgs = _row_configs(rows)
    lines = [f"# Long-document TTFT: {out['model']} on {out['machine']}", "",
             f"KV {out['kv_bytes_per_token']} B/token; disk read {out['disk_read_gbps']:.2f} "
             f"GB/s, pinned H2D {out['pcie_h2d_gbps']:.1f} GB/s (same run). Medians of "
             f"{out['docs']} docs{_small_docs_note(out, rows)} x {out['repeats']} repeats"
             + (f", then the median over {out['rounds']} rounds (engines restarted, "
                "order reversed every other round)" if out.get("rounds", 1) > 1 else "")
             + ", concurrency "
             f"{', '.join(str(c) for c in sorted({r['concurrency'] for r in rows}))}, "
             "one output token, "
             "GPU prefix cache off. Hit TTFT in seconds (cold TTFT of recompute in the first "
             "column); for native_fs and kvcache_disk (fresh process, page cache dropped) the "
             "first access of each document, which is the one read from disk.", "",
             "| tokens | recompute | " + " | ".join(f"{c} hit" for c in cfgs) + " | disk floor |",
             "|---|---|" + "---|" * len(cfgs) + "---|"]
    for d in sizes:
        by = {r["config"]: r for r in rows if r["tokens"] == d}
        rec = by.get("recompute", {}).get("ttft_cold_s")
        cells = [f"{_hit(by[c]):.3f}" if c in by else "-" for c in cfgs]
        floor = next(iter(by.values()))["disk_floor_s"]
        lines.append(f"| {d} | {rec:.3f} | " if rec else f"| {d} | - | ")
        lines[-1] += " | ".join(cells) + f" | {floor:.3f} |"
    lines += ["", "Cold (storing) requests, back to back: TTFT in seconds and its ratio to "
              "recompute; `stored` = chunks the cache kept of those it was asked to store "
              "(dropped for back-pressure: never waited for), from the store counters.", "",
              "| tokens | recompute | " + " | ".join(f"{c} cold" for c in cfgs) + " |",
              "|---|---|" + "---|" * len(cfgs)]
    for d in sizes:
        by = {r["config"]: r for r in rows if r["tokens"] == d}
        rec = by.get("recompute", {}).get("ttft_cold_s")
        cells = []
        for c in cfgs:
            r = by.get(c)
            if r is None:
                cells.append("-")
                continue
            cell = f"{r['ttft_cold_s']:.3f}"
            if rec:
                cell += f" ({r['ttft_cold_s'] / rec:.2f}x)"
            sc = r.get("store_counters") or {}
            asked = sc.get("stores", 0)
            if asked:
                kept = asked - sc.get("stores_dropped_backpressure", 0)
                cell += f", stored {kept}/{asked}"
            cells.append(cell)
        lines.append(f"| {d} | {rec:.3f} | " if rec else f"| {d} | - | ")
        lines[-1] += " | ".join(cells) + " |"
    lines += _round_ratio_tables(out, cfgs, sizes)
    errs = [r for r in out["results"] if "error" in r]
    for e in errs:
        lines.append(f"\n{e['config']}: {e['error']}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def round_ratios(out: dict, key: str, ref: str) -> dict[tuple[str, int], list[float | None]]:
    """Per (config, tokens): ``key`` of each round over the same round's ``key`` of
    configuration ``ref`` (``round_results`` of a ``--rounds`` run, rounds in order;
    None where either row is missing). ``ttft_hit_s`` is read as the main table reads
    it (:func:`_hit`: the first access for the cold-process disk configurations). A
    machine that speeds up or slows down between rounds moves both sides of a
    same-round ratio alike."""
    rows = [r for r in out.get("round_results", []) if "error" not in r and key in r]
    val = _hit if key == "ttft_hit_s" else (lambda r: r[key])
    base = {(r["tokens"], r["round"]): val(r) for r in rows if r["config"] == ref}
    rounds = sorted({r["round"] for r in rows})
    got: dict[tuple[str, int], dict[int, float]] = {}
    for r in rows:
        b = base.get((r["tokens"], r["round"]))
        v = val(r)
        if r["config"] != ref and b and v is not None:
            got.setdefault((r["config"], r["tokens"]), {})[r["round"]] = v / b
    return {k: [v.get(n) for n in rounds] for k, v in got.items()}


def balanced_ratio(ratios: list[float | None]) -> float | None:
    """The drift-balanced mean of per-round ratios (rounds in run order): a geometric
    mean with weight 1/2 on the first and last round and 1 on the others. With the order
    of configurations reversed every other round (``--rounds``), a machine that gets
    steadily faster or slower through the run moves the per-round log ratios by +d, -d,
    +d, ...; these weights cancel that for any number of rounds, where a plain mean or
    median of three rounds keeps a bias toward whichever side ran later twice. None if a
    round is missing or there is only one."""
    if len(ratios) < 2 or any(r is None or r <= 0 for r in ratios):
        return None
    w = [0.5 if i in (0, len(ratios) - 1) else 1.0 for i in range(len(ratios))]
    return math.exp(sum(wi * math.log(r) for wi, r in zip(w, ratios, strict=True)) / sum(w))


def _round_ratio_tables(out: dict, cfgs: list[str], sizes: list[int]) -> list[str]:
    """With more than one round: cold TTFT over the same round's recompute, and hit TTFT
    over the same round's native_cpu, per round and drift-balanced
    (:func:`balanced_ratio`)."""
    if out.get("rounds", 1) < 2:
        return []
    lines: list[str] = []
    for key, ref, what in (("ttft_cold_s", "recompute", "Cold (storing) TTFT"),
                           ("ttft_hit_s", "native_cpu", "Hit TTFT")):
        ratios = round_ratios(out, key, ref)
        shown = [c for c in cfgs if c != ref and any((c, d) in ratios for d in sizes)]
        if not shown:
            continue
        lines += ["", f"{what} over the same round's {ref}, round by round (run order), "
                  "and balanced over the rounds (geometric mean, first and last round "
                  "weighted 1/2: a machine that speeds up or slows down through the run "
                  "cancels out, since the order is reversed every other round):", "",
                  "| tokens | " + " | ".join(shown) + " |", "|---|" + "---|" * len(shown)]
        for d in sizes:
            cells = []
            for c in shown:
                rs = ratios.get((c, d)) or []
                bal = balanced_ratio(rs)
                cells.append("-" if not any(x is not None for x in rs) else " / ".join(
                    "-" if x is None else f"{x:.2f}" for x in rs)
                    + (f" (balanced **{bal:.2f}**)" if bal is not None else ""))
            lines.append(f"| {d} | " + " | ".join(cells) + " |")
    return lines


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    rows = [r for r in out["results"] if "ttft_hit_s" in r]
    for cfg in _row_configs(rows):
        pts = sorted((r["tokens"], _hit(r)) for r in rows if r["config"] == cfg)
        if not pts:
            continue
        label = "recompute" if cfg == "recompute" else f"{cfg} hit"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label=label)
    fl = sorted({(r["tokens"], r["disk_floor_s"]) for r in rows})
    ax.plot([p[0] for p in fl], [p[1] for p in fl], "k--", label="disk floor")
    save_loglog(fig, ax, "TTFT (s)", f"{out['model']} on {out['machine']}", path)


if __name__ == "__main__":
    sys.exit(main())
