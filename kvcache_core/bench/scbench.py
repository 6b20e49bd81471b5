"""SCBench-like multi-turn workload of the long-document benchmark (``longdoc.py --workload
scbench``): the turn schedule, the process-tree sampler (host memory, disk bytes read), the
result row, table and plot. No vLLM here; the engine side lives in ``longdoc.py``.

A turn is one long shared context plus a short unique question; the contexts are visited
round-robin (context 0, 1, ..., N-1, 0, 1, ...) for R rounds. A context's turn in round r is
sent once its turn in round r-1 has answered (a multi-turn client asks its next question
after the answer), and at most ``concurrency`` turns are in flight. Round 0 is cold (each
context's first visit: computed and stored); rounds 1.. can reuse the context's KV.

Times are ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for all processes of the
machine), so the driver's samples and the engine process' turn times line up.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

#: seconds of samples kept before the first turn and after the last answer
SERIES_MARGIN_S = 2.0

Submit = Callable[[list[int], str], Awaitable[float]]


# ---------------------------------------------------------------------------- turns
async def run_turns(submit: Submit, contexts: Sequence[list[int]],
                    questions: Sequence[list[int]], rounds: int, concurrency: int,
                    tag: str) -> list[dict[str, Any]]:
    """Run ``rounds`` x ``len(contexts)`` turns; ``questions[r * N + c]`` is the question of
    context ``c`` in round ``r``. ``submit(ids, request_id)`` returns the TTFT. Returns one
    dict per turn, in round-robin order: ``round``, ``ctx``, ``submit`` (monotonic seconds
    when it was sent), ``ttft_s``."""
    n = len(contexts)
    sem = asyncio.Semaphore(max(1, concurrency))
    answered = [[asyncio.Event() for _ in range(n)] for _ in range(rounds)]

    async def turn(r: int, c: int) -> dict[str, Any]:
        try:
            if r:
                await answered[r - 1][c].wait()
            async with sem:
                t0 = time.monotonic()
                ttft = await submit(list(contexts[c]) + list(questions[r * n + c]),
                                    f"{tag}-r{r}-c{c}")
            return {"round": r, "ctx": c, "submit": t0, "ttft_s": ttft}
        finally:
            answered[r][c].set()  # a failed turn must not hang its successors

    return list(await asyncio.gather(*[turn(r, c) for r in range(rounds) for c in range(n)]))


# ---------------------------------------------------------------------------- sampling
def _read_bytes(pid: int) -> int | None:
    """``read_bytes`` of /proc/<pid>/io: bytes this process (all its threads, io_uring
    workers included) made the block layer fetch; O_DIRECT reads count, page-cache hits
    do not."""
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _mem_kb(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                k, _, rest = line.partition(":")
                if k in keys:
                    out[k] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def tree_pids(pid: int) -> list[int]:
    """``pid`` and all its live descendants (empty if ``pid`` is gone)."""
    import psutil  # installed with vLLM

    try:
        root = psutil.Process(pid)
        return [pid] + [p.pid for p in root.children(recursive=True)]
    except psutil.Error:
        return []


class TreeSampler:
    """Samples the process tree under ``pid`` every ``interval`` seconds on a thread:
    RSS and PSS summed over the tree (PSS counts memory shared between the engine's
    processes once), the cumulative ``read_bytes`` of every process ever seen in the tree
    (a process that exits keeps its last value, so the sum never goes down), and the
    machine's used memory (MemTotal - MemAvailable: pinned and driver allocations that a
    process' RSS may not show; page cache excluded) and the machine's page cache
    (``Cached``: what buffered reads keep outside any process).

    A sample is not instantaneous: reading /proc for a large tree takes tens of
    milliseconds, hundreds on a loaded machine. ``t`` is when a sample began and
    ``t_end`` when its last value had been read; its values describe some moment in
    between. Window arithmetic (:func:`window_delta`) uses ``t_end`` for the sample
    before a window and ``t`` for the one after it, so a window never loses what happened
    while a sample was being taken. ``read_bytes`` is read first, in one quick pass.

    ``handshake`` (a path prefix, optional): the sampled process writes a sequence number
    to ``<handshake>.idle`` when its requests are done (:func:`await_sample`); a sample
    that BEGAN after that file appeared then writes the number to ``<handshake>.sampled``,
    so the process knows a sample after its last request exists before it exits."""

    def __init__(self, pid: int, interval: float = 0.25, handshake: str | None = None,
                 ) -> None:
        self.pid = pid
        self.interval = interval
        self.handshake = handshake
        self.series: dict[str, list[float]] = {
            "t": [], "t_end": [], "rss_bytes": [], "pss_bytes": [], "read_bytes": [],
            "system_used_bytes": [], "page_cache_bytes": []}
        self._seen: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-sampler", daemon=True)

    def start(self) -> TreeSampler:
        self._thread.start()
        return self

    def stop(self) -> dict[str, list[float]]:
        self._stop.set()
        self._thread.join()
        return self.series

    def _run(self) -> None:
        nxt = time.monotonic()
        while True:
            seq = _read_text(self.handshake + ".idle") if self.handshake else None
            self.sample()
            if seq is not None:
                _write_text(self.handshake + ".sampled", seq)
            nxt = max(nxt + self.interval, time.monotonic())  # a fixed grid, never bursts
            if self._stop.wait(nxt - time.monotonic()):
                return

    def sample(self) -> None:
        t = time.monotonic()
        rss = pss = 0
        pids = tree_pids(self.pid)
        if not pids:  # the tree is gone: nothing to sample
            return
        for p in pids:  # first and quick: the counter that windows are cut from
            rb = _read_bytes(p)
            if rb is not None:
                self._seen[p] = max(rb, self._seen.get(p, 0))
        for p in pids:
            m = _mem_kb(f"/proc/{p}/status", ("VmRSS",))
            rss += m.get("VmRSS", 0)
            pss += _mem_kb(f"/proc/{p}/smaps_rollup", ("Pss",)).get("Pss", 0)
        mi = _mem_kb("/proc/meminfo", ("MemTotal", "MemAvailable", "Cached"))
        s = self.series
        s["t"].append(t)
        s["t_end"].append(time.monotonic())
        s["rss_bytes"].append(rss)
        s["pss_bytes"].append(pss)
        s["read_bytes"].append(sum(self._seen.values()))
        s["system_used_bytes"].append(mi.get("MemTotal", 0) - mi.get("MemAvailable", 0))
        s["page_cache_bytes"].append(mi.get("Cached", 0))


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _write_text(path: str, text: str) -> None:
    """Atomically (a reader sees the old or the new text, never a torn one)."""
    tmp = f"{path}.tmp{threading.get_ident()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


async def await_sample(handshake: str, seq: int, timeout: float = 30.0) -> bool:
    """Called by the SAMPLED process once its requests are done: announce ``seq`` and
    wait (at most ``timeout`` seconds, polling) until a :class:`TreeSampler` sample begun
    after the announcement has finished. True when one did; False on timeout (the window
    then ends at the last sample, and may miss the last reads)."""
    _write_text(handshake + ".idle", str(seq))
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _read_text(handshake + ".sampled") == str(seq):
            return True
        await asyncio.sleep(0.01)
    return False


# ---------------------------------------------------------------------------- results
def throughput(t: Sequence[float], cum: Sequence[float]) -> tuple[list[float], list[float]]:
    """Rate of a cumulative counter: (interval midpoints, delta / dt) per sample pair."""
    mids, rates = [], []
    for i in range(1, len(t)):
        dt = t[i] - t[i - 1]
        if dt > 0:
            mids.append((t[i] + t[i - 1]) / 2)
            rates.append((cum[i] - cum[i - 1]) / dt)
    return mids, rates


def window_delta(samples: dict[str, list[float]], name: str, t0: float,
                 t1: float) -> int | None:
    """Change of series ``name`` from the last sample finished at or before ``t0`` (else
    the first) to the first sample begun at or after ``t1`` (else the last): e.g. the
    bytes the tree read while requests were in flight, not while the engine started.
    Samples without ``t_end`` count as instantaneous."""
    t, v = samples.get("t") or [], samples.get(name) or []
    if len(t) < 2 or len(v) != len(t):
        return None
    te = samples.get("t_end") or t
    if len(te) != len(t):
        te = t
    a = _at_or_before(te, v, t0)
    b = _at_or_after(t, v, t1)
    return int((v[-1] if b is None else b) - (v[0] if a is None else a))


def _at_or_before(t: Sequence[float], v: Sequence[float], x: float) -> float | None:
    best = None
    for ti, vi in zip(t, v, strict=True):
        if ti <= x:
            best = vi
        else:
            break
    return best


def _at_or_after(t: Sequence[float], v: Sequence[float], x: float) -> float | None:
    for ti, vi in zip(t, v, strict=True):
        if ti >= x:
            return vi
    return None


def scbench_row(config: str, wrow: dict[str, Any], samples: dict[str, list[float]] | None,
                kv_bytes_per_token: int, dram_budget_bytes: int | None = None,
                ) -> dict[str, Any]:
    """One result row from the engine's turn log (``wrow``: ``tokens``, ``concurrency``,
    ``docs``, ``rounds``, ``question_tokens``, ``turns``) and the driver's samples of its
    process tree. Times in the row are seconds from the first turn's submit.

    ``disk_read_bytes`` = the tree's read_bytes from the last sample at or before the first
    submit to the first sample at or after the last answer (``None`` without samples)."""
    from .longdoc import _summary

    turns = sorted(wrow["turns"], key=lambda x: x["submit"])
    t0 = turns[0]["submit"]
    t_end = max(x["submit"] + x["ttft_s"] for x in turns)
    ttfts = [x["ttft_s"] for x in turns]
    # _summary: index < 0 = no reusable prefix (the cold first visits of round 0)
    order = [x["ctx"] if x["round"] > 0 else -1 - x["ctx"] for x in turns]
    d = wrow["tokens"]
    row: dict[str, Any] = {
        "workload": "scbench", "config": config, "tokens": d,
        "concurrency": wrow["concurrency"], "docs": wrow["docs"], "rounds": wrow["rounds"],
        "question_tokens": wrow["question_tokens"], "kv_bytes": d * kv_bytes_per_token,
        "working_set_bytes": wrow["docs"] * d * kv_bytes_per_token,
        "dram_budget_bytes": dram_budget_bytes, "wall_s": t_end - t0,
        **_summary(ttfts, order),
        "turns": [{"round": x["round"], "ctx": x["ctx"], "submit_s": x["submit"] - t0,
                   "ttft_s": x["ttft_s"]} for x in turns],
        "disk_read_bytes": None, "peak_host_mem_bytes": None, "host_mem_start_bytes": None,
        "peak_system_used_bytes": None, "series": None}
    if samples and samples.get("t"):
        st = samples["t"]
        # the process may end before a sample after the last answer: the last one counts
        row["disk_read_bytes"] = window_delta(samples, "read_bytes", t0, t_end)
        if row["disk_read_bytes"] is None:  # a single sample
            row["disk_read_bytes"] = 0
        keep = [i for i, ti in enumerate(st)
                if t0 - SERIES_MARGIN_S <= ti <= t_end + SERIES_MARGIN_S]
        mem = samples["pss_bytes"] if any(samples["pss_bytes"]) else samples["rss_bytes"]
        inside = [mem[i] for i in keep if t0 <= st[i] <= t_end] or [mem[i] for i in keep]
        if inside:
            row["peak_host_mem_bytes"] = max(inside)
        start = _at_or_before(st, mem, t0)
        row["host_mem_start_bytes"] = start if start is not None else (
            mem[keep[0]] if keep else None)
        used = [samples["system_used_bytes"][i] for i in keep]
        row["peak_system_used_bytes"] = max(used) if used else None
        row["series"] = {"t_s": [st[i] - t0 for i in keep],
                         **{k: [samples[k][i] for i in keep]
                            for k in ("rss_bytes", "pss_bytes", "read_bytes",
                                      "system_used_bytes")}}
    return row


def _gb(v: float | None, nd: int = 1) -> str:
    return "-" if v is None else f"{v / 1e9:.{nd}f}"


def _f3(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def scbench_table(run: dict[str, Any]) -> list[str]:
    """Markdown lines: one row per (tokens, config), disk read and its ratio to
    native_fs's, host memory, staging."""
    rows = [r for r in run["results"] if r.get("workload") == "scbench" and "turns" in r]
    lines = [f"# SCBench-like multi-turn: {run['model']} on {run['machine']}", "",
             "Shared contexts visited round-robin, each turn = context + a short unique "
             "question, one output token, GPU prefix cache off, all rounds in one engine "
             "process per configuration; round 0 stores, later rounds reuse. Same DRAM/CPU "
             "budget for py-kvcache and native_fs. Disk read = read_bytes of the engine's "
             "process tree during the turns; host memory = PSS of the tree. Times in s.", "",
             "| tokens | docs x rounds | conc | config | mean TTFT | mean reuse | mean cold | "
             "p90 | wall | disk read (GB) | vs native_fs | working set / DRAM (GB) | "
             "peak host mem (GB) | peak staging / budget (MB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["tokens"], r["concurrency"], r["config"])):
        nat = next((x for x in rows if x["config"] == "native_fs"
                    and (x["tokens"], x["concurrency"]) == (r["tokens"], r["concurrency"])),
                   None)
        ratio = "-"
        if nat and nat.get("disk_read_bytes") and r.get("disk_read_bytes") is not None:
            ratio = f"{r['disk_read_bytes'] / nat['disk_read_bytes']:.3f}"
        st = ("-" if r.get("peak_staging_bytes") is None else
              f"{r['peak_staging_bytes'] / 1e6:.0f} / {r['staging_budget_bytes'] / 1e6:.0f}")
        lines.append(
            f"| {r['tokens']} | {r['docs']} x {r['rounds']} | {r['concurrency']} | "
            f"{r['config']} | {_f3(r['mean_ttft_s'])} | {_f3(r.get('mean_ttft_reuse_s'))} | "
            f"{_f3(r.get('mean_ttft_noreuse_s'))} | {_f3(r.get('p90_ttft_s'))} | "
            f"{_f3(r.get('wall_s'))} | {_gb(r.get('disk_read_bytes'))} | {ratio} | "
            f"{_gb(r.get('working_set_bytes'))} / {_gb(r.get('dram_budget_bytes'))} | "
            f"{_gb(r.get('peak_host_mem_bytes'))} | {st} |")
    for e in run["results"]:
        if "error" in e:
            lines.append(f"\n{e['config']}: {e['error']}")
    return lines


def plot_scbench(run: dict[str, Any], path: str) -> None:
    """Per document size (column): (a) TTFT of every turn at its submit time (x: cold
    first visit, o: reuse), (b) host memory of the engine's process tree (solid: PSS;
    dashed: machine used memory), (c) disk read throughput of the tree; one color per
    configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in run["results"] if r.get("workload") == "scbench" and "turns" in r]
    sizes = sorted({r["tokens"] for r in rows})
    if not sizes:
        return
    fig, axes = plt.subplots(3, len(sizes), figsize=(7.5 * len(sizes), 10), squeeze=False,
                             sharex="col")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    cfgs = sorted({r["config"] for r in rows})
    for col, d in enumerate(sizes):
        a, b, c = axes[0][col], axes[1][col], axes[2][col]
        for r in (r for r in rows if r["tokens"] == d):
            color = colors[cfgs.index(r["config"]) % len(colors)]
            cold = [x for x in r["turns"] if x["round"] == 0]
            warm = [x for x in r["turns"] if x["round"] > 0]
            a.plot([x["submit_s"] for x in warm], [x["ttft_s"] for x in warm], "o",
                   color=color, ms=4, label=f"{r['config']} (mean {r['mean_ttft_s']:.2f} s)")
            a.plot([x["submit_s"] for x in cold], [x["ttft_s"] for x in cold], "x",
                   color=color, ms=6)
            s = r.get("series")
            if not s or not s["t_s"]:
                continue
            mem = s["pss_bytes"] if any(s["pss_bytes"]) else s["rss_bytes"]
            b.plot(s["t_s"], [m / 1e9 for m in mem], "-", color=color, label=r["config"])
            b.plot(s["t_s"], [m / 1e9 for m in s["system_used_bytes"]], "--", color=color,
                   lw=0.8)
            mids, rates = throughput(s["t_s"], s["read_bytes"])
            c.plot(mids, [x / 1e9 for x in rates], "-", color=color,
                   label=f"{r['config']} ({_gb(r.get('disk_read_bytes'))} GB)")
        r0 = next(r for r in rows if r["tokens"] == d)
        a.set_title(f"{d} tokens x {r0['docs']} contexts x {r0['rounds']} rounds, "
                    f"{r0['concurrency']} in flight")
        a.set_ylabel("TTFT (s)   x: cold, o: reuse")
        b.set_ylabel("host memory (GB)\nsolid: engine PSS, dashed: machine used")
        c.set_ylabel("disk read (GB/s)")
        c.set_xlabel("time since first turn (s)")
        for ax in (a, b, c):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"SCBench-like multi-turn: {run['model']} on {run['machine']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

