#!/usr/bin/env python3
"""Per-step overhead of the connector with many concurrent decoding requests.

Real vLLM (the CPU build), the e2e tests' tiny Llama, an in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) stepped by hand. Each configuration runs in its
own process: ``--requests`` requests sharing ``--prefix-groups`` prefixes (plus a unique
suffix each) are added at once and decode ``--output-tokens`` tokens each, so decode
steps with all of them running dominate. Rounds after the first reuse the same prefixes
(GPU prefix-cache hits, and for py-kvcache DRAM-tier / disk hits of what was stored).

Configurations: ``prefix_cache`` (vLLM's GPU prefix cache, no connector),
``kvcache_dram`` (py-kvcache, DRAM tier, disk writes off as when the break-even table
says the disk never pays: ``manager.disk_stores = False``), ``kvcache_disk`` (DRAM tier
and write-through files), ``kvcache_nodram`` (files only, no DRAM tier),
``noop_connector`` (scripts/noop_kv_connector.py: a connector whose hooks do nothing, what
vLLM's own connector machinery costs), ``kvcache_dram_torchcopy`` (kvcache_dram with the
CPU copies done by torch ``copy_`` on the reactor thread, as before the fix in
docs/results/cpu/step-overhead.md: env ``KVCACHE_CPU_COPY=torch``),
``kvcache_dram_gate`` (kvcache_dram plus a break-even table, written into the work
directory, whose DRAM tier pays from T tokens and whose disk never pays: as the H200
tables do, it sets ``min_store_prefix_tokens=auto`` to T and turns disk writes off),
``kvcache_dram_floor`` (kvcache_dram with explicit ``min_store_prefix_tokens`` and
``disk_min_prefix_tokens`` of T and no table). T is half the prompt length
(``--prefix-tokens`` + ``--suffix-tokens``), so every prompt stores and every prefix hit
loads in both: they differ only by the gate's per-request work.
``--repeats`` runs the whole list that many times, interleaved (this box's speed drifts
by tens of percent over minutes), and reports medians over repeats.

Reported per configuration (medians over the measured rounds): the time of a decode
step with at least half the requests running (``step_ms``), the wall time of a round,
the mean per-token decode time, and, for the connector: store jobs per round and the
number of engine steps between a store job's creation and its completion report
(``store_steps`` histogram), flushes (``jobs_to_flush``) and the worker's time blocked
in ``wait``, and what the gate / floors resolved to (``gating``). ``--profile CFG`` adds
a cProfile of that configuration's measured rounds (top entries of py-kvcache and vLLM's
offloading connector).

Usage: python scripts/bench_step_overhead.py [--requests 24] [--rounds 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TORCHDYNAMO_DISABLE": "1",
       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
CONFIGS = ("prefix_cache", "kvcache_dram", "kvcache_disk", "kvcache_nodram", "noop_connector",
           "kvcache_dram_torchcopy", "kvcache_dram_gate", "kvcache_dram_floor")


def _prompts(args, rnd: int) -> list[list[int]]:
    import random

    pre = [[random.Random(1000 + g).randrange(100, 4000) for _ in range(args.prefix_tokens)]
           for g in range(args.prefix_groups)]
    rng = random.Random(7 + rnd)
    return [pre[i % args.prefix_groups] + [rng.randrange(100, 4000)
                                           for _ in range(args.suffix_tokens)]
            for i in range(args.requests)]


def _thread_cpu() -> dict[int, tuple[str, float, int]]:
    """Per thread of this process: tid -> (name, CPU seconds (user + system), involuntary
    context switches). Python threads by their ``threading`` name."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                st = f.read()
            with open(f"/proc/self/task/{tid}/status") as f:
                nv = int(next(ln for ln in f if ln.startswith("nonvoluntary")).split()[1])
        except (OSError, StopIteration):
            continue
        name = names.get(int(tid)) or st[st.index("(") + 1:st.rindex(")")]
        fields = st[st.rindex(")") + 2:].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick, nv)
    return out


def child(args) -> dict:
    for k, v in ENV.items():
        os.environ[k] = v
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from e2e import helpers as H
    from vllm import SamplingParams

    cfg = args.child
    if cfg == "kvcache_dram_torchcopy":
        os.environ["KVCACHE_CPU_COPY"] = "torch"
    model = H.write_model(os.path.join(args.workdir, "tiny-llama"))
    root = os.path.join(args.workdir, f"cache-{cfg}")
    shutil.rmtree(root, ignore_errors=True)
    extra = None
    if cfg not in ("prefix_cache", "noop_connector"):
        dram = 0 if cfg == "kvcache_nodram" else args.dram_mib << 20
        extra = H.extra_config(root, dram_cache_bytes=dram,
                               staging_bytes=32 * H.FILE_BYTES, io_depth=8, lookahead=8)
        gate_tokens = (args.prefix_tokens + args.suffix_tokens) // 2  # prompts above it
        if cfg == "kvcache_dram_gate":
            from kvcache_core.breakeven import BreakevenTable

            table = os.path.join(args.workdir, "breakeven-table.json")
            t = BreakevenTable(gpu="cpu", model=os.path.basename(model),
                               thresholds={"dram": gate_tokens, "disk": None})
            with open(table, "w") as f:
                json.dump(t.to_json(), f)
            extra["breakeven_table"] = table
        elif cfg == "kvcache_dram_floor":
            extra.update(min_store_prefix_tokens=gate_tokens,
                         disk_min_prefix_tokens=gate_tokens)
        extra.update(json.loads(args.kv_extra or "{}"))
    kw = {}
    if args.gpu_blocks:
        kw["num_gpu_blocks_override"] = args.gpu_blocks
    if cfg == "noop_connector":
        from vllm.config import KVTransferConfig

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NoopConnector", kv_connector_module_path="noop_kv_connector",
            kv_role="kv_both")
    llm = H.make_llm(model, extra, enable_prefix_caching=True,
                     max_model_len=args.prefix_tokens + args.suffix_tokens
                     + args.output_tokens + 64, max_num_seqs=max(64, args.requests), **kw)
    eng = llm.llm_engine
    sched = eng.engine_core.engine_core.scheduler
    cs = None
    worker = None
    if extra is not None:
        conn = H.scheduler_connector(llm)
        cs = conn.connector_scheduler
        if cfg in ("kvcache_dram", "kvcache_dram_torchcopy", "kvcache_dram_floor"):
            conn._sched.manager.disk_stores = False
        worker = H._our_worker(conn) if conn._work is not None else None
        if worker is None:  # in-process executor: the worker-role connector
            from vllm.distributed.kv_transfer import get_kv_transfer_group
            worker = H._our_worker(get_kv_transfer_group())
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    rounds = []
    prof = None
    for rnd in range(args.rounds + 1):
        measured = rnd > 0
        if measured and args.profile == cfg and prof is None:
            import cProfile

            prof = cProfile.Profile()
        prompts = _prompts(args, rnd)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{rnd}-{i}", {"prompt_token_ids": p}, sp)
        steps: list[tuple[float, int]] = []
        born: dict[int, int] = {}
        lat: collections.Counter[int] = collections.Counter()
        wait0 = worker.timing["main_wait_s"] if worker is not None else 0.0
        it0 = worker.reactor.timing["iterations"] if worker is not None else 0
        n = 0
        cpu0 = _thread_cpu()
        t_round = time.perf_counter()
        if prof is not None:
            prof.enable()
        while eng.has_unfinished_requests():
            running = len(sched.running)
            t0 = time.perf_counter()
            eng.step()
            steps.append((time.perf_counter() - t0, running))
            n += 1
            if cs is not None:
                jobs = cs._jobs
                for j, st in jobs.items():
                    if st.is_store and j not in born:
                        born[j] = n
                for j in [j for j in born if j not in jobs]:
                    lat[n - born.pop(j)] += 1
        if prof is not None:
            prof.disable()
        wall = time.perf_counter() - t_round
        cpu1 = _thread_cpu()
        threads = collections.Counter()
        for tid, (name, t, nv) in cpu1.items():
            _, t0_, nv0 = cpu0.get(tid, (name, 0.0, 0))
            if t - t0_ or nv - nv0:
                threads[f"{name}-{tid} ({nv - nv0} preempted)"] += t - t0_
        if cs is not None:  # let in-flight stores finish before the next round
            t_end = time.monotonic() + 30
            while cs._jobs and time.monotonic() < t_end:
                eng.step()
                time.sleep(0.001)
        dec = [dt for dt, r in steps if r >= args.requests // 2]
        rec = {"round": rnd, "wall_s": wall, "steps": len(steps),
               "step_ms_median": 1e3 * statistics.median(dec) if dec else None,
               "step_ms_mean": 1e3 * statistics.fmean(dec) if dec else None,
               "decode_steps": len(dec),
               "ms_per_token": 1e3 * sum(dec) / max(1, len(dec)) / max(1, args.requests)}
        if cs is not None:
            rec.update(store_jobs=sum(lat.values()), store_steps=dict(sorted(lat.items())),
                       worker_wait_s=(worker.timing["main_wait_s"] - wait0
                                      if worker is not None else None),
                       reactor_iterations=(worker.reactor.timing["iterations"] - it0
                                           if worker is not None else None))
        rec["thread_cpu_s"] = {k: round(v, 3) for k, v in threads.most_common(8)}
        rounds.append(rec)
        print(f"  [{cfg}] round {rnd}{'' if measured else ' (warm-up)'}: "
              f"{wall:.2f} s, {len(steps)} steps, decode step median "
              f"{rec['step_ms_median'] or 0:.2f} ms"
              + (f", store jobs {rec['store_jobs']} steps-to-complete {rec['store_steps']}"
                 f" wait {rec['worker_wait_s']:.3f} s reactor iterations "
                 f"{rec['reactor_iterations']}" if cs is not None else ""),
              file=sys.stderr, flush=True)
        print(f"    thread CPU s: {rec['thread_cpu_s']}", file=sys.stderr, flush=True)
    out = {"config": cfg, "rounds": rounds}
    m = rounds[1:]
    out["step_ms_median"] = statistics.median(r["step_ms_median"] for r in m)
    out["wall_s_median"] = statistics.median(r["wall_s"] for r in m)
    out["ms_per_token_median"] = statistics.median(r["ms_per_token"] for r in m)
    if cs is not None:
        st = H.manager(llm).stats()
        sd = H.scheduler_connector(llm)._sched  # what the gate / floors resolved to
        out["gating"] = {"gate": sd.gate is not None,
                         "min_store_prefix_tokens": sd.min_store_prefix_tokens,
                         "disk_min_prefix_tokens": sd.disk_min_prefix_tokens,
                         "disk_stores": sd.manager.disk_stores}
        out["counters"] = {k: v for k, v in st.items() if v}
    if prof is not None:
        import io
        import pstats

        s = io.StringIO()
        ps = pstats.Stats(prof, stream=s).sort_stats("cumulative")
        ps.print_stats(r"kvcache_core|offloading|kv_connector", args.profile_top)
        out["profile"] = s.getvalue()
        s = io.StringIO()
        ps = pstats.Stats(prof, stream=s).sort_stats("tottime")
        ps.print_stats(args.profile_top)
        out["profile_tottime"] = s.getvalue()
    H.shutdown(llm)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--requests", type=int, default=24, help="concurrent requests per round")
    ap.add_argument("--prefix-groups", type=int, default=4, help="distinct shared prefixes")
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--suffix-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the configuration list this many times, interleaved")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (after a warm-up)")
    ap.add_argument("--dram-mib", type=int, default=256, help="py-kvcache DRAM tier")
    ap.add_argument("--gpu-blocks", type=int, default=0,
                    help="num_gpu_blocks_override (0: vLLM's; small: KV-cache pressure)")
    ap.add_argument("--kv-extra", default="", help="JSON merged into py-kvcache's extra config")
    ap.add_argument("--profile", default="", help="cProfile this configuration")
    ap.add_argument("--profile-top", type=int, default=40)
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    own = not args.workdir
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="kv_stepbench_")
    results = []
    plan = args.configs.split(",") * args.repeats
    try:
        for k, cfg in enumerate(plan):
            if cfg not in CONFIGS:
                ap.error(f"unknown config {cfg}")
            print(f"== {cfg} ({k + 1}/{len(plan)})", file=sys.stderr, flush=True)
            cmd = [sys.executable, os.path.abspath(__file__), "--child", cfg]
            for a in ("requests", "prefix_groups", "prefix_tokens", "suffix_tokens",
                      "output_tokens", "rounds", "dram_mib", "gpu_blocks", "profile",
                      "profile_top", "workdir", "kv_extra"):
                cmd += [f"--{a.replace('_', '-')}", str(getattr(args, a))]
            env = {**os.environ, **ENV, "PYTHONPATH": REPO + os.pathsep
                   + os.environ.get("PYTHONPATH", "")}
            p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
            if p.returncode != 0:
                print(f"   {cfg} failed (rc {p.returncode})", file=sys.stderr)
                return 1
            results.append(json.loads(p.stdout.strip().splitlines()[-1]))
    finally:
        if own:
            shutil.rmtree(args.workdir, ignore_errors=True)
    print(f"\n{'config':14} {'step ms (median)':>17} {'ms/token':>9} {'round s':>8}  "
          "step ms per repeat")
    summary = {}
    for cfg in dict.fromkeys(plan):
        rs = [r for r in results if r["config"] == cfg]
        med = {k: statistics.median(r[k] for r in rs)
               for k in ("step_ms_median", "ms_per_token_median", "wall_s_median")}
        summary[cfg] = med
        print(f"{cfg:14} {med['step_ms_median']:17.2f} {med['ms_per_token_median']:9.3f} "
              f"{med['wall_s_median']:8.2f}  "
              + " ".join(f"{r['step_ms_median']:.2f}" for r in rs))
    for r in results:
        if r.get("profile"):
            print(f"\n-- profile {r['config']} (cumulative, ours + vLLM's connector)\n"
                  + r["profile"] + "\n-- by own time\n" + r["profile_tottime"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
