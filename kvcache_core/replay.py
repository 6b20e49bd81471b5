"""``kvcache replay``: replay a workload file against any running OpenAI-compatible server.

Streams ``/v1/completions`` (prompt = token ids or text, ``max_tokens = output_len``,
``ignore_eos``, temperature 0, continuous usage stats: the request fields of vLLM's
server) and measures per request the TTFT (send to the first streamed output token), the
inter-token latencies (ITL), the latency (send to the last token); per run the
percentiles and the throughput (completed requests / wall time). ITL is per token as
the client receives them: a server that sends several tokens in one chunk gives the first
the gap since the previous chunk and the others 0 (``itl_chunks``: the gaps per chunk).
The streaming client, the Poisson arrivals and the figures are those of the ShareGPT
benchmark (``kvcache_core.bench.sharegpt``: ``_request``, ``arrivals``, ``summarize``).

Arrival modes (one of):

* ``--rate R``: Poisson arrivals at R requests/s (``--seed``), in file order;
* ``--concurrency C``: closed loop, C requests in flight, in file order;
* ``--trace-times``: at the file's ``arrival_s``.

In every mode a session's turns keep their order: a request with a ``session`` is sent
only after the session's previous turn (by ``turn``, then file order) has finished, at the
later of its own send time and that moment.

Exit status: 0 every request completed; 1 the report was written but some requests failed
(HTTP errors, connection resets, timeouts: counted in ``n_errors``, a sample of messages in
``errors_sample``); 2 usage error (bad workload line: ``FILE:LINE: why``; server
unreachable; no model); 130 interrupted (Ctrl-C / SIGTERM: the partial report is written).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from .bench.sharegpt import (
    EngineSampler,
    _payload,
    _request,
    arrivals,
    engine_table,
    summarize,
)
from .workloads import (
    DEFAULT_VOCAB,
    SYNTHETIC_BAILIAN,
    WorkloadError,
    bailian_requests,
    longbench_workload,
    read_bailian,
    read_workload,
    scbench_workload,
    sharegpt_workload,
    synthetic_bailian,
    write_workload,
)

MODES = ("rate", "concurrency", "trace-times")


class ReplayError(Exception):
    """One line for the operator; exit status 2."""


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ============================================================================ server
def base_url(url: str) -> str:
    """``http://host:port`` from what the operator typed (trailing ``/`` or ``/v1``)."""
    u = url.strip().rstrip("/")
    if u.endswith("/v1"):
        u = u[:-3]
    if "://" not in u:
        u = "http://" + u
    return u


def list_models(url: str, timeout: float = 10.0) -> list[str]:
    """Model ids the server lists at /v1/models; ReplayError when it cannot be reached."""
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=timeout) as r:
            data = json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        raise ReplayError(f"{url}/v1/models answered HTTP {e.code}") from None
    except (urllib.error.URLError, OSError) as e:
        why = getattr(e, "reason", None) or e
        raise ReplayError(f"cannot reach the server at {url}: {why}") from None
    except ValueError:
        raise ReplayError(f"{url}/v1/models did not answer JSON") from None
    return [m.get("id") for m in (data.get("data") or []) if isinstance(m, dict)
            and m.get("id")]


# ============================================================================ schedule
def session_predecessors(reqs: list[dict]) -> list[int | None]:
    """Index of each request's previous turn in its session (None: none or no
    session); turns ordered by ``turn`` (missing: 0), then file order."""
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(reqs):
        if r.get("session") is not None:
            groups.setdefault(json.dumps(r["session"]), []).append(i)
    prev: list[int | None] = [None] * len(reqs)
    for idx in groups.values():
        idx.sort(key=lambda i: (reqs[i].get("turn") or 0, i))
        for a, b in zip(idx, idx[1:], strict=False):
            prev[b] = a
    return prev


def per_token_itl(rec: dict) -> list[float]:
    """Inter-token latencies as the client sees them, one per output token after the
    first: a chunk carrying k new tokens gives its gap to the previous chunk, then k - 1
    zeros (tokens that arrive together); the first chunk's extra tokens are zeros too."""
    ch = rec["chunk_tokens"]
    out = [0.0] * (ch[0] - 1)
    for gap, k in zip(rec["itl"], ch[1:], strict=False):
        out += [gap] + [0.0] * (k - 1)
    return out


def send_times(reqs: list[dict], mode: str, rate: float = 0.0, seed: int = 0) -> list[float]:
    """Earliest send time of each request (seconds from the start) in ``mode``."""
    if mode == "rate":
        return arrivals(len(reqs), rate, seed)
    if mode == "trace-times":
        missing = [r["id"] for r in reqs if r.get("arrival_s") is None]
        if missing:
            raise ReplayError(f"--trace-times needs arrival_s on every request; request "
                              f"id {missing[0]!r} has none ({len(missing)} without)")
        return [float(r["arrival_s"]) for r in reqs]
    return [0.0] * len(reqs)


async def run_replay(url: str, model: str, reqs: list[dict], mode: str, *,
                     rate: float = 0.0, seed: int = 0, concurrency: int = 1,
                     timeout_s: float = 600.0, progress: float = 1.0,
                     stop: asyncio.Event | None = None) -> tuple[list[dict], float, bool]:
    """Replay ``reqs``; returns the per-request records, the wall time (first send to last
    completion) and whether it was interrupted (``stop`` set: running requests are
    cancelled, unsent ones never sent)."""
    import aiohttp

    times = send_times(reqs, mode, rate, seed)
    prev = session_predecessors(reqs)
    finished = [asyncio.Event() for _ in reqs]
    sem = asyncio.Semaphore(max(1, concurrency)) if mode == "concurrency" else None
    recs: list[dict] = [{"id": r["id"], "session": r.get("session"), "turn": r.get("turn"),
                         "output_len": r["output_len"], "error": None} for r in reqs]
    counts = {"sent": 0, "done": 0}
    endpoint = f"{url}/v1/completions"

    async def send(i: int, start: float, session: Any) -> None:
        rec = recs[i]
        rec["sent"] = True
        rec["send_s"] = time.perf_counter() - start
        counts["sent"] += 1
        prompt = reqs[i].get("prompt_token_ids", reqs[i].get("prompt"))
        try:
            await asyncio.wait_for(
                _request(session, endpoint, _payload(model, prompt, int(reqs[i]["output_len"])),
                         rec), timeout_s)
        except asyncio.TimeoutError:
            rec["error"] = f"timeout: not finished within {timeout_s:g}s"
        finally:
            counts["done"] += 1
        if rec.get("error") is None and rec.get("chunk_tokens"):
            rec["itl_chunks"], rec["itl"] = rec["itl"], per_token_itl(rec)

    async def one(i: int, start: float, session: Any) -> None:
        try:
            if prev[i] is not None:
                await finished[prev[i]].wait()
            delay = start + times[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                await send(i, start, session)
            else:
                async with sem:
                    await send(i, start, session)
        finally:
            finished[i].set()  # a failed turn must not hang its successors

    def line(start: float) -> str:
        errs = sum(1 for r in recs if r.get("error"))
        return (f"kvcache replay {time.perf_counter() - start:6.1f}s: sent {counts['sent']}/"
                f"{len(reqs)}, done {counts['done']}, in flight "
                f"{counts['sent'] - counts['done']}, errors {errs}")

    async def ticker(start: float) -> None:
        while True:
            await asyncio.sleep(progress)
            _err(line(start))

    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    interrupted = False
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        start = time.perf_counter()
        tasks = [asyncio.ensure_future(one(i, start, session)) for i in range(len(reqs))]
        tick = asyncio.ensure_future(ticker(start)) if progress > 0 else None
        waiters = [asyncio.ensure_future(asyncio.gather(*tasks, return_exceptions=True))]
        if stop is not None:
            waiters.append(asyncio.ensure_future(stop.wait()))
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if stop is not None and stop.is_set() and not waiters[0].done():
            interrupted = True
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        ends = [r["send_s"] + r["latency"] for r in recs if r.get("latency") is not None]
        wall = max(ends, default=time.perf_counter() - start)
        if tick is not None:
            tick.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await tick
        if progress > 0:
            _err(line(start))
    for r in recs:
        if not r.get("sent"):
            r["error"] = "not sent (interrupted)"
        elif r.get("error") is None and r.get("latency") is None:
            r["error"] = "interrupted" if interrupted else "not completed"
        elif interrupted and (r.get("error") or "").startswith("timeout (cancelled"):
            r["error"] = "interrupted"
    return recs, wall, interrupted


# ============================================================================ reports
def request_rows(recs: list[dict]) -> list[dict]:
    out = []
    for r in recs:
        row = {"id": r["id"], "session": r.get("session"), "turn": r.get("turn"),
               "output_len": r["output_len"], "sent": bool(r.get("sent"))}
        if r.get("sent"):
            row["send_s"] = round(r["send_s"], 6)
        if r.get("error") is None:
            row.update(ttft_s=round(r["ttft"], 6), latency_s=round(r["latency"], 6),
                       end_s=round(r["send_s"] + r["latency"], 6),
                       itl_s=[round(g, 6) for g in r["itl"]], output_tokens=r["tokens"],
                       prompt_tokens=r.get("prompt_tokens"),
                       cached_tokens=r.get("cached_tokens"))
        row["error"] = r.get("error")
        out.append(row)
    return out


def build_report(args: argparse.Namespace, model: str, recs: list[dict], wall: float,
                 interrupted: bool, n_workload: int) -> dict:
    sent = [r for r in recs if r.get("sent")]
    row = {"config": args.label, **summarize(sent, wall)}
    row.pop("ttft_all", None)
    row.pop("max_send_lag_s", None)
    errors = [r["error"] for r in sent if r.get("error")]
    row["errors_sample"] = list(dict.fromkeys(errors))[:5]
    row["n_not_sent"] = len(recs) - len(sent)
    mode = args.mode
    params: dict[str, Any] = {}
    if args.mode == "rate":
        params = {"rate": args.rate, "seed": args.seed}
    elif args.mode == "concurrency":
        params = {"concurrency": args.concurrency}
    return {"workload": os.path.abspath(args.workload), "model": model, "url": args.url,
            "mode": mode, "mode_params": params, "n_workload_requests": n_workload,
            "timeout_s": args.timeout_s, "interrupted": interrupted,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(args._t0)),
            "results": [row], "requests": request_rows(recs)}


def _f(v: float | None, nd: int = 3, scale: float = 1.0) -> str:
    return "-" if v is None else f"{v * scale:.{nd}f}"


def report_table(out: dict) -> str:
    p = out.get("mode_params") or {}
    how = {"rate": f"Poisson arrivals at {p.get('rate')} req/s (seed {p.get('seed')})",
           "concurrency": f"closed loop, {p.get('concurrency')} in flight",
           "trace-times": "at the workload's arrival_s"}.get(out["mode"], out["mode"])
    lines = [f"# kvcache replay: {os.path.basename(out['workload'])}", "",
             f"{out['n_workload_requests']} requests of `{out['workload']}` sent to "
             f"`{out['url']}` (model `{out['model']}`), {how}; sessions keep their turn "
             f"order. Started {out['started_at']}."
             + (" **Interrupted: partial results.**" if out.get("interrupted") else ""),
             "", "TTFT and latency in seconds, ITL in milliseconds.", "",
             "| config | requests | errors | mean TTFT | median TTFT | p90 TTFT | p99 TTFT | "
             "mean ITL (ms) | mean latency | throughput (req/s) | output tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in out["results"]:
        lines.append(
            f"| {r['config']} | {r['n_requests']} | {r['n_errors']} | "
            f"{_f(r.get('mean_ttft_s'))} | {_f(r.get('median_ttft_s'))} | "
            f"{_f(r.get('p90_ttft_s'))} | {_f(r.get('p99_ttft_s'))} | "
            f"{_f(r.get('mean_itl_s'), 1, 1e3)} | {_f(r.get('mean_latency_s'))} | "
            f"{_f(r.get('throughput_rps'), 2)} | {_f(r.get('output_tokens_per_s'), 1)} |")
    lines += engine_table(
        out["results"], "The server's view (vLLM's `/metrics` read before and after the "
        "replay, gauges sampled once a second): mean queue and prefill time of the requests "
        "that finished, preemptions, prefix-cache hit fractions (tokens), largest number of "
        "waiting and running requests and KV cache usage.")
    for r in out["results"]:
        if r.get("errors_sample"):
            lines += ["", f"Errors of {r['config']} (sample):", ""]
            lines += [f"- `{e}`" for e in r["errors_sample"]]
    return "\n".join(lines) + "\n"


def plot_report(out: dict, path: str) -> None:
    """TTFT CDF (left) and TTFT over the send time (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in out["requests"] if r.get("error") is None and r.get("ttft_s")]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = sorted(r["ttft_s"] for r in ok)
    if xs:
        a1.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post")
        a1.set_xscale("log")
        a2.scatter([r["send_s"] for r in ok], [r["ttft_s"] for r in ok], s=8, alpha=0.6)
        a2.set_yscale("log")
    bad = [r for r in out["requests"] if r.get("error") and r.get("sent")]
    if bad:
        y = min(xs) if xs else 1.0
        a2.scatter([r["send_s"] for r in bad], [y] * len(bad), marker="x", color="red",
                   s=14, label=f"failed ({len(bad)})")
        a2.legend(fontsize=8)
    a1.set_xlabel("TTFT (s)")
    a1.set_ylabel("fraction of requests")
    a1.set_title("TTFT CDF", fontsize=10)
    a2.set_xlabel("send time (s from start)")
    a2.set_ylabel("TTFT (s)")
    a2.set_title("TTFT over time", fontsize=10)
    for a in (a1, a2):
        a.grid(alpha=0.3)
    fig.suptitle(f"kvcache replay {os.path.basename(out['workload'])}: {out['model']} "
                 f"at {out['url']} ({out['mode']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_report(out: dict, path: str) -> list[str]:
    """JSON at ``path``, the table next to it (.md) and the plot (.png) when matplotlib
    is importable; returns the files written."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, path)
    stem = os.path.splitext(path)[0]
    with open(stem + ".md", "w") as f:
        f.write(report_table(out))
    files = [path, stem + ".md"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return files
    try:
        plot_report(out, stem + ".png")
        files.append(stem + ".png")
    except Exception as e:  # a plot must not cost the report
        _err(f"kvcache replay: no plot ({type(e).__name__}: {e})")
    return files


# ============================================================================ commands
def cmd_replay(args: argparse.Namespace) -> int:
    from .admin import UsageError

    args._t0 = time.time()
    args.mode = _mode_of(args)
    if args.n is not None and args.n < 1:
        raise UsageError("--n must be >= 1")
    if args.mode == "rate" and args.rate <= 0:
        raise UsageError("--rate must be > 0")
    if args.mode == "concurrency" and args.concurrency < 1:
        raise UsageError("--concurrency must be >= 1")
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise UsageError("needs the Python package aiohttp (pip install aiohttp)") from None
    try:
        reqs = read_workload(args.workload, args.n)
        send_times(reqs, args.mode, args.rate or 0.0, args.seed)
        url = base_url(args.url)
        models = list_models(url, timeout=min(10.0, args.timeout_s))
    except (WorkloadError, ReplayError) as e:
        raise UsageError(str(e)) from None
    model = args.model or (models[0] if models else None)
    if not model:
        raise UsageError(f"{url}/v1/models lists no model; name one with --model")
    args.url = url
    _err(f"kvcache replay: {len(reqs)} requests of {args.workload} -> {url} (model {model}, "
         f"mode {args.mode})")

    async def main() -> tuple[list[dict], float, bool]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        return await run_replay(url, model, reqs, args.mode, rate=args.rate or 0.0,
                                seed=args.seed, concurrency=args.concurrency or 1,
                                timeout_s=args.timeout_s,
                                progress=0.0 if args.quiet else 1.0, stop=stop)

    # the server's own view (vLLM's /metrics: queue time, preemptions, KV usage), when it
    # exposes one; nothing is lost when it does not
    sampler = EngineSampler(url).start()
    try:
        recs, wall, interrupted = asyncio.run(main())
    finally:
        engine = sampler.stop()
    out = build_report(args, model, recs, wall, interrupted, len(reqs))
    row = out["results"][0]
    if engine:
        row["engine"] = engine
    if args.json:
        files = save_report(out, args.json)
        _err(f"kvcache replay: wrote {', '.join(files)}")
    print(json.dumps({k: v for k, v in row.items()}))
    if interrupted:
        _err("kvcache replay: interrupted; partial report written" if args.json
             else "kvcache replay: interrupted")
        return 130
    if row["n_errors"]:
        _err(f"kvcache replay: {row['n_errors']} of {row['n_requests']} requests failed, "
             f"e.g. {row['errors_sample'][0]}")
        return 1
    return 0


def cmd_workload(args: argparse.Namespace) -> int:
    from .admin import UsageError

    if args.kind == "bailian" and args.synthetic and not args.n:
        args.n = 1000
    try:
        if args.kind == "sharegpt":
            reqs = sharegpt_workload(args.n, pool=args.pool, seed=args.seed,
                                     max_prompt=args.max_prompt_tokens,
                                     max_output=args.max_output_tokens,
                                     token_ids=args.token_ids)
            if args.rate > 0:
                for r, t in zip(reqs, arrivals(len(reqs), args.rate, args.seed),
                                strict=True):
                    r["arrival_s"] = round(t, 6)
        elif args.kind == "longbench":
            reqs = longbench_workload(args.type, args.chains, args.steps, args.doc_tokens,
                                      args.question_tokens, args.output_len,
                                      seed=args.seed, token_ids=args.token_ids,
                                      interval_s=args.interval_s)
        elif args.kind == "scbench":
            reqs = scbench_workload(args.contexts, args.context_tokens, args.rounds,
                                    args.question_tokens, args.output_len, seed=args.seed,
                                    token_ids=args.token_ids, vocab=args.vocab_size,
                                    interval_s=args.interval_s)
        else:
            if bool(args.trace) == bool(args.synthetic):
                raise UsageError("give a trace file (TRACE) or --synthetic coder|a|b")
            recs = (read_bailian(args.trace) if args.trace
                    else synthetic_bailian(args.synthetic, args.n, seed=args.seed))
            if args.n and args.trace:
                recs = sorted(recs, key=lambda r: float(r.get("timestamp", 0)))[:args.n]
            reqs = bailian_requests(recs, seed=args.seed, vocab=args.vocab_size,
                                    max_prompt=args.max_prompt_tokens,
                                    time_scale=args.time_scale,
                                    where=args.trace or "synthetic")
    except (WorkloadError, ValueError) as e:
        raise UsageError(str(e)) from None
    except SystemExit as e:  # the packaged-data helpers' one-line errors
        if isinstance(e.code, str):
            raise UsageError(e.code) from None
        raise
    n = write_workload(args.out, reqs)
    sessions = {json.dumps(r.get("session")) for r in reqs if r.get("session") is not None}
    lens = [len(r["prompt_token_ids"]) for r in reqs if "prompt_token_ids" in r]
    print(json.dumps({"out": args.out, "kind": args.kind, "n_requests": n,
                      "sessions": len(sessions),
                      "prompt": "token_ids" if lens else "text",
                      "max_prompt_tokens": max(lens) if lens else None,
                      "bytes": os.path.getsize(args.out)}))
    return 0


def add_parsers(sub: Any) -> None:
    """The ``replay`` and ``workload`` subcommands of ``kvcache``."""
    rp = sub.add_parser(
        "replay", help="replay a workload file against a running OpenAI-compatible server",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n", 1)[1])
    rp.add_argument("workload", metavar="WORKLOAD",
                    help="JSONL or JSONL.gz, one request per line (see kvcache workload)")
    rp.add_argument("--url", required=True, help="server base URL, e.g. http://HOST:8000")
    rp.add_argument("--model", help="model name to request (default: the first listed at "
                    "/v1/models)")
    mode = rp.add_mutually_exclusive_group(required=True)
    mode.add_argument("--rate", type=float, help="Poisson arrivals at this many requests/s")
    mode.add_argument("--concurrency", type=int, help="closed loop: keep this many in flight")
    mode.add_argument("--trace-times", action="store_true",
                      help="send at the workload's arrival_s")
    rp.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    rp.add_argument("--n", type=int, help="replay only the first N requests")
    rp.add_argument("--timeout-s", type=float, default=600.0,
                    help="per-request limit in seconds; later = an error (default 600)")
    rp.add_argument("--json", metavar="OUT", help="write the report (+ .md and .png)")
    rp.add_argument("--label", default="server",
                    help="name of this run's result row (default server)")
    rp.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    rp.set_defaults(func=cmd_replay, mode=None)

    wl = sub.add_parser(
        "workload", help="generate a workload file for kvcache replay",
        description="Write a workload (JSONL, .gz compressed) for `kvcache replay`.")
    ksub = wl.add_subparsers(dest="kind", required=True)

    def common(p: argparse.ArgumentParser, ids_help: str) -> None:
        p.add_argument("--out", required=True, help="output file (.jsonl or .jsonl.gz)")
        p.add_argument("--seed", type=int, default=0, help="seed of all random choices")
        p.add_argument("--token-ids", action="store_true", help=ids_help)
        p.set_defaults(func=cmd_workload)

    sg = ksub.add_parser("sharegpt", help="real ShareGPT chat traffic (multi-turn history)")
    common(sg, "write Llama 3 token ids (default: the same prompts as text)")
    sg.add_argument("--n", type=int, default=1000, help="number of requests (default 1000)")
    sg.add_argument("--pool", type=int, default=64, help="conversations active at a time")
    sg.add_argument("--max-prompt-tokens", type=int, default=8192,
                    help="a longer turn ends its conversation (default 8192)")
    sg.add_argument("--max-output-tokens", type=int, default=256,
                    help="cap of output_len (default 256)")
    sg.add_argument("--rate", type=float, default=0.0,
                    help="also write Poisson arrival_s at this rate (default: none)")

    sc = ksub.add_parser("scbench", help="SCBench-like shared long contexts, round-robin")
    common(sc, "random token ids in [100, --vocab-size) (default: real ShareGPT text)")
    sc.add_argument("--contexts", type=int, default=4, help="shared contexts K (default 4)")
    sc.add_argument("--context-tokens", type=int, default=4096,
                    help="tokens per context (default 4096)")
    sc.add_argument("--rounds", type=int, default=3, help="visits per context R (default 3)")
    sc.add_argument("--question-tokens", type=int, default=32,
                    help="tokens of each turn's question (default 32)")
    sc.add_argument("--output-len", type=int, default=32, help="output tokens per turn")
    sc.add_argument("--interval-s", type=float, default=1.0,
                    help="arrival_s gap between consecutive turns (default 1.0)")
    sc.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB,
                    help=f"token ids stay below this (default {DEFAULT_VOCAB})")

    lb = ksub.add_parser("longbench", help="LongBench-like chains over real text: "
                         "multi-document QA or repository code completion")
    common(lb, "write Llama 3 token ids (default: text)")
    lb.add_argument("--type", choices=("docs", "code"), default="docs",
                    help="docs: real ShareGPT text as documents; code: the Python standard "
                    "library's source as repositories (default docs)")
    lb.add_argument("--chains", type=int, default=4,
                    help="independent chains (document sets / repositories), default 4")
    lb.add_argument("--steps", type=int, default=4,
                    help="requests per chain; step j's prompt = pieces 0..j + a question "
                    "(default 4)")
    lb.add_argument("--doc-tokens", type=int, default=4096,
                    help="tokens added per step (one document / code piece), default 4096")
    lb.add_argument("--question-tokens", type=int, default=32,
                    help="real-text tokens of each question (default 32)")
    lb.add_argument("--output-len", type=int, default=32, help="output tokens per request")
    lb.add_argument("--interval-s", type=float, default=1.0,
                    help="arrival_s step between consecutive requests (default 1.0)")

    bl = ksub.add_parser("bailian", help="Bailian-format trace (or a synthetic one)")
    bl.add_argument("trace", nargs="?", metavar="TRACE",
                    help="Bailian trace JSONL (chat_id, parent_chat_id, timestamp, ...)")
    bl.add_argument("--out", required=True, help="output file (.jsonl or .jsonl.gz)")
    bl.add_argument("--synthetic", choices=sorted(SYNTHETIC_BAILIAN),
                    help="generate a labelled synthetic trace (our parameters) instead")
    bl.add_argument("--n", type=int, default=0,
                    help="requests (synthetic: default 1000; trace: first N, 0 = all)")
    bl.add_argument("--seed", type=int, default=0, help="seed of the block token ids")
    bl.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB,
                    help=f"token ids stay below this (default {DEFAULT_VOCAB})")
    bl.add_argument("--max-prompt-tokens", type=int, default=0,
                    help="cut longer prompts (and output_len to 1/8 of it); 0 = no cap")
    bl.add_argument("--time-scale", type=float, default=1.0,
                    help="divide the trace's times by this (2 = twice as fast)")
    bl.add_argument("--token-ids", action="store_true", default=True,
                    help="token ids (always: a trace has block ids, not text)")
    bl.set_defaults(func=cmd_workload)


def _mode_of(args: argparse.Namespace) -> str | None:
    if getattr(args, "trace_times", False):
        return "trace-times"
    if getattr(args, "rate", None) is not None:
        return "rate"
    if getattr(args, "concurrency", None) is not None:
        return "concurrency"
    return None
