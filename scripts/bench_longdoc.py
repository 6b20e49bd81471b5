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

The same run measures the disk's O_DIRECT read bandwidth on the cache root and pinned
host->device bandwidth, so the floor KV/disk + KV/pcie is known. Output JSON:
{"machine","model","kv_bytes_per_token","disk_read_gbps","pcie_h2d_gbps",
 "results":[{"config","tokens","concurrency","ttft_cold_s","ttft_hit_s", ...}]} (medians).

Usage: python scripts/bench_longdoc.py --model DIR --root DIR --json OUT.json
       [--tokens 1024,4096,16384,65536] [--configs ...] [--docs 2] [--repeats 2]
       [--concurrency 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ALL_CONFIGS = ["recompute", "native_cpu", "native_fs", "kvcache_disk", "kvcache_dram"]
COLD_PROCESS = {"native_fs", "kvcache_disk"}


def log(msg: str) -> None:
    print(f"[longdoc {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def kv_bytes_per_token(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2  # bf16


VOCAB = 128000


def docs_for(tokens: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed * 1_000_003 + tokens)
    hi = max(200, VOCAB - 100)
    return [[rng.randrange(100, hi) for _ in range(tokens)] for _ in range(n)]


def transfer_config(cfg: str, args, doc_bytes: int) -> dict | None:
    block = {"block_size": 256}
    if cfg == "recompute":
        return None
    if cfg == "native_cpu":
        extra = {**block, "cpu_bytes_to_use": int(doc_bytes * args.docs * 1.3)}
    elif cfg == "native_fs":
        extra = {**block, "spec_name": "TieringOffloadingSpec",
                 "cpu_bytes_to_use": int(doc_bytes * 1.3),
                 "secondary_tiers": [{"type": "fs", "root_dir": os.path.join(args.root, cfg)}]}
    else:
        dram = int(doc_bytes * args.docs * 1.3) if cfg == "kvcache_dram" else 0
        extra = {**block, "spec_name": "PyKVCacheSpec", "spec_module_path": "kvcache_core.vllm",
                 "root_dir": os.path.join(args.root, cfg), "staging_bytes": args.staging_bytes,
                 "io_depth": args.io_depth, "lookahead": args.io_depth,
                 "dram_cache_bytes": dram}
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
    t0 = time.perf_counter()
    async for _out in engine.generate(TokensPrompt(prompt_token_ids=ids), sp, rid):
        return time.perf_counter() - t0
    return time.perf_counter() - t0


async def _worker(args) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    global VOCAB
    with open(os.path.join(args.model, "config.json")) as f:
        VOCAB = json.load(f).get("vocab_size", VOCAB)

    tokens = [int(t) for t in args.tokens.split(",")]
    kvb = kv_bytes_per_token(args.model)
    tc = transfer_config(args.config, args, max(tokens) * kvb)
    ea = AsyncEngineArgs(model=args.model, load_format="dummy", enforce_eager=True,
                         enable_prefix_caching=False, max_model_len=max(tokens) + 64,
                         gpu_memory_utilization=0.85, skip_tokenizer_init=True,
                         kv_transfer_config=tc, seed=0)
    t0 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(ea)
    log(f"{args.config}/{args.phase}: engine up in {time.perf_counter() - t0:.1f}s")
    out: dict = {"config": args.config, "phase": args.phase, "rows": []}
    rng = random.Random(7)
    try:
        # warm-up (CUDA graphs off; first kernels / allocator)
        await _ttft(engine, docs_for(512, 1, 99)[0], "warm")
        for d in tokens:
            docs = docs_for(d, args.docs, args.seed)
            row = {"tokens": d, "concurrency": args.concurrency}
            if args.phase in ("store", "both"):
                cold = []
                for i, doc in enumerate(docs):
                    cold.append(await _ttft(engine, doc, f"s{d}-{i}"))
                row["ttft_cold_all"] = cold
                await asyncio.sleep(args.settle)  # deferred stores finish
            if args.phase in ("load", "both"):
                order = [i for i in range(len(docs)) for _ in range(args.repeats)]
                rng.shuffle(order)
                hits = []
                c = args.concurrency
                for w in range(0, len(order), c):
                    wave = order[w:w + c]
                    hits += await asyncio.gather(*[_ttft(engine, docs[i], f"h{d}-{w}-{j}")
                                                   for j, i in enumerate(wave)])
                row["ttft_hit_all"] = hits
                row["hit_docs"] = [order[i] for i in range(len(hits))]
            out["rows"].append(row)
            log(f"{args.config}/{args.phase} D={d}: " + ", ".join(
                f"{k}={statistics.median(v):.3f}s" for k, v in row.items()
                if k.endswith("_all")))
    finally:
        engine.shutdown()
    return out


# ---------------------------------------------------------------------------- driver
def _run_child(args, config: str, phase: str, timeout: float) -> dict | None:
    part = os.path.join(args.work, f"{config}-{phase}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--config", config,
           "--phase", phase, "--model", args.model, "--root", args.root, "--tokens",
           args.tokens, "--docs", str(args.docs), "--repeats", str(args.repeats),
           "--concurrency", str(args.concurrency), "--staging-bytes", str(args.staging_bytes),
           "--io-depth", str(args.io_depth), "--out-part", part, "--seed", str(args.seed)]
    env = dict(os.environ, PYTHONHASHSEED="0",
               KVCACHE_STATS_FILE=os.path.join(args.work, f"{config}-{phase}.stats"))
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log(f"{config}/{phase}: timeout after {timeout}s")
        rc = -1
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if rc != 0 or not os.path.exists(part):
        log(f"{config}/{phase}: failed rc={rc}")
        return None
    with open(part) as f:
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
        if i not in seen:
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model directory (config.json; dummy weights)")
    ap.add_argument("--root", default="/tmp/longdoc-root", help="cache roots live under here")
    ap.add_argument("--json", help="result JSON (also writes .md and .png next to it)")
    ap.add_argument("--tokens", default="1024,4096,16384,65536")
    ap.add_argument("--configs", default=",".join(ALL_CONFIGS))
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--staging-bytes", type=int, default=1 << 30)
    ap.add_argument("--io-depth", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settle", type=float, default=2.0, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--machine", default=None, help="machine name for the JSON")
    ap.add_argument("--append", action="store_true",
                    help="merge into an existing --json: replace the rows of the configs run "
                    "now, keep the others (several calls on one machine, one result file)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--out-part", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        res = asyncio.run(_worker(args))
        with open(args.out_part, "w") as f:
            json.dump(res, f)
        return 0

    os.makedirs(args.root, exist_ok=True)
    args.work = os.path.join(args.root, "parts")
    os.makedirs(args.work, exist_ok=True)
    model_name = os.path.basename(os.path.normpath(args.model))
    log("measuring disk and PCIe bandwidth")
    disk = measure_disk(args.root)
    pcie = measure_pcie()
    log(f"disk_read_gbps={disk:.2f} pcie_h2d_gbps={pcie:.1f}")
    kvb = kv_bytes_per_token(args.model)
    results = []
    for cfg in args.configs.split(","):
        shutil.rmtree(os.path.join(args.root, cfg), ignore_errors=True)
        if cfg in COLD_PROCESS:
            store = _run_child(args, cfg, "store", args.timeout)
            dropped = drop_caches()
            load = _run_child(args, cfg, "load", args.timeout)
        else:
            store = load = _run_child(args, cfg, "both", args.timeout)
            dropped = None
        stats = (read_stats(os.path.join(args.work, f"{cfg}-store.stats.workers.jsonl"))
                 + read_stats(os.path.join(args.work, f"{cfg}-load.stats.workers.jsonl"))
                 + read_stats(os.path.join(args.work, f"{cfg}-both.stats.workers.jsonl")))
        if not store or not load:
            results.append({"config": cfg, "error": "engine run failed"})
            continue
        for srow, lrow in zip(store["rows"], load["rows"], strict=False):
            d = srow["tokens"]
            floor = d * kvb / (disk * 1e9) + d * kvb / (pcie * 1e9)
            first = _first_access(lrow)
            row = {"config": cfg, "tokens": d, "concurrency": args.concurrency,
                   "ttft_cold_s": statistics.median(srow["ttft_cold_all"]),
                   "ttft_hit_s": statistics.median(lrow["ttft_hit_all"]),
                   "ttft_first_hit_s": statistics.median(first) if first else None,
                   "ttft_cold_all": srow["ttft_cold_all"], "ttft_hit_all": lrow["ttft_hit_all"],
                   "kv_bytes": d * kvb, "disk_floor_s": floor, "page_cache_dropped": dropped}
            results.append(row)
        if stats:
            peak = max(s.get("peak_staging_bytes", 0) for s in stats)
            budget = max(s.get("staging_budget_bytes", 0) for s in stats)
            for r in results:
                if r["config"] == cfg:
                    r["peak_staging_bytes"] = peak
                    r["staging_budget_bytes"] = budget
        shutil.rmtree(os.path.join(args.root, cfg), ignore_errors=True)
        out = save(args, results, disk, pcie, kvb, model_name)  # after every config
    print(json.dumps({k: v for k, v in out.items() if k != "results"}, indent=1))
    return 0


def save(args, results: list[dict], disk: float, pcie: float, kvb: int,
         model_name: str) -> dict:
    """Write JSON + table + plot (called after every configuration: a run cut short by
    a time limit still leaves its finished configurations)."""
    for r in results:
        r["disk_read_gbps"], r["pcie_h2d_gbps"] = disk, pcie
    out = {"machine": args.machine or _gpu_name(), "gpu": _gpu_name(), "model": model_name,
           "kv_bytes_per_token": kvb, "disk_read_gbps": disk, "pcie_h2d_gbps": pcie,
           "docs": args.docs, "repeats": args.repeats, "results": list(results)}
    if args.append and args.json and os.path.exists(args.json):
        with open(args.json) as f:
            old = json.load(f)
        if not getattr(args, "_old_results", None):
            args._old_results = old.get("results", [])
        ran = {r["config"] for r in results}
        kept = [r for r in args._old_results if r["config"] not in ran]
        out["results"] = kept + list(results)
        bw = [(r.get("disk_read_gbps"), r.get("pcie_h2d_gbps")) for r in out["results"]]
        out["disk_read_gbps"] = statistics.median(b[0] for b in bw if b[0])
        out["pcie_h2d_gbps"] = statistics.median(b[1] for b in bw if b[1])
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        write_table(out, os.path.splitext(args.json)[0] + ".md")
        try:
            plot(out, os.path.splitext(args.json)[0] + ".png")
        except Exception as e:  # matplotlib missing etc.
            log(f"no plot: {e}")
    return out


def _hit(r: dict) -> float:
    """Hit TTFT to report: for the cold-process disk configurations the first access of
    each document (really read from disk; a repeat may hit the CPU tier it filled)."""
    if r["config"] in COLD_PROCESS and r.get("ttft_first_hit_s") is not None:
        return r["ttft_first_hit_s"]
    return r["ttft_hit_s"]


def write_table(out: dict, path: str) -> None:
    rows = [r for r in out["results"] if "ttft_hit_s" in r]
    sizes = sorted({r["tokens"] for r in rows})
    cfgs = [c for c in ALL_CONFIGS if any(r["config"] == c for r in rows)]
    lines = [f"# Long-document TTFT: {out['model']} on {out['machine']}", "",
             f"KV {out['kv_bytes_per_token']} B/token; disk read {out['disk_read_gbps']:.2f} "
             f"GB/s, pinned H2D {out['pcie_h2d_gbps']:.1f} GB/s (same run). Medians of "
             f"{out['docs']} docs x {out['repeats']} repeats, concurrency 1, one output token, "
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
    errs = [r for r in out["results"] if "error" in r]
    for e in errs:
        lines.append(f"\n{e['config']}: {e['error']}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    rows = [r for r in out["results"] if "ttft_hit_s" in r]
    for cfg in ALL_CONFIGS:
        pts = sorted((r["tokens"], _hit(r)) for r in rows if r["config"] == cfg)
        if not pts:
            continue
        label = "recompute" if cfg == "recompute" else f"{cfg} hit"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label=label)
    fl = sorted({(r["tokens"], r["disk_floor_s"]) for r in rows})
    ax.plot([p[0] for p in fl], [p[1] for p in fl], "k--", label="disk floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("document tokens")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"{out['model']} on {out['machine']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
