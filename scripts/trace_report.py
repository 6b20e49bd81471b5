#!/usr/bin/env python3
"""Line up requests with the reactor's work: what did py-kvcache do during each TTFT?

Input: the directory given to ``bench_longdoc.py --trace`` (per engine process: the
requests' submit / first-token times and the reactor event traces, all CLOCK_MONOTONIC).
For every request it prints its TTFT and, inside that window: store and load jobs
submitted, store copies finished, store and load jobs completed, and how close to the
first token the last store completion came. A first token that keeps arriving right
after store completions says the request waited for its own stores. ``issue ms``: the
longest time issuing a DRAM hit's copy held vLLM's model-runner thread (as long as the
copy itself: the copy ran synchronously); ``descs``: that copy's descriptors (one per
GPU block and layer when vLLM's blocks were not consecutive); ``copy ms``: that copy's
GPU time (CUDA timing events); ``GIL wait``: the longest time the trace's probe thread
waited for the GIL (some thread held it that long); ``gc ms``: the longest garbage
collection in the window (the collecting thread holds the GIL throughout); ``claim ms``:
the time the reactor spent copying staged blocks into DRAM-tier slots for promotions in
the window (``claim_copy`` events; the GIL is released during those copies since the
forty-third session, held before).

With ``--loads``, per engine instead: every load job in the order it reached the reactor
(its id, chunks, when it came, when its first disk read started and its last one ended,
when it completed, relative to the engine's first request), how many blocks it read
itself, and how many reads of OTHER jobs ran inside its own first-to-last read window
(``others``): near 0 when the disk serves the jobs one after the other (first come,
first read), large when their reads interleave, which makes every job of a burst end
late together (the fifty-client runs' "barrier": first tokens of several documents at
one time).

``--loads --summary``: one block per engine instead of every job: the jobs that read,
the median and largest ``others``, and the first ten jobs' submit / first read / last
read / done times (ms), next to the first ten requests' first tokens.

``--stalls [--stall-ms MS]``: per engine, every gap of more than MS (default 200) between
the worker's end of one engine step (``fwd_end``: vLLM's ``get_finished`` call) and the
start of the next (``fwd_start``), i.e. time the engine's main thread spent outside the
worker (scheduling, output processing) or blocked; for each: when, how long, the disk
reads in flight on average inside it, the reads and load jobs that finished inside it,
the first tokens within 1 s after it, and the engine process's major page faults inside
it (``majflt`` events: pages of code or data read from disk). A load job done inside a
stall cannot hand its request to vLLM before the stall ends (the thirty-sixth session's
"barrier": 3.8 s at 10k and 10.6 s at 40k with every finished request waiting, disk
reads in flight 7.6-7.9 of 8).

Under each stall also the reactor trace's own samples of the engine thread
(``stall_stack`` events: its innermost Python frames, taken in-process when it has not
marked a step for 250 ms while requests are outstanding; no ptrace needed), counted.
With ``--stacks FILE`` (the output of ``scripts/stack_sampler.py``, e.g. ``SPY=1`` of
``scripts/h200_call.sh``): under each stall, the engine main thread's stacks sampled
inside it (innermost frames first, counted): where the engine was while it did not step.

Usage: python scripts/trace_report.py TRACE_DIR [--json OUT] [--loads [--summary]]
       [--stalls [--stall-ms MS] [--stacks FILE]]
"""

from __future__ import annotations

import argparse
import bisect
import glob
import json
import os
import sys
from collections import defaultdict


def load(trace_dir: str) -> dict[str, tuple[list, list]]:
    """{'<config>-<phase>': (requests, events sorted by time)}."""
    out: dict[str, tuple[list, list]] = {}
    for req_path in sorted(glob.glob(os.path.join(trace_dir, "*.requests.json"))):
        name = os.path.basename(req_path)[: -len(".requests.json")]
        with open(req_path) as f:
            reqs = json.load(f)
        events: list = []
        for tp in glob.glob(os.path.join(trace_dir, f"{name}.r[0-9]*.json")):
            with open(tp) as f:
                events += json.load(f)
        events.sort(key=lambda e: e[0])
        out[name] = (reqs, events)
    return out


def window(events: list, times: list[float], t0: float, t1: float) -> dict[str, int | float]:
    i, j = bisect.bisect_left(times, t0), bisect.bisect_right(times, t1)
    counts: dict[str, int | float] = defaultdict(int)
    last_store_done = None
    fwd_t = None
    end_t = None  # the last fwd_end seen: the next fwd_start closes a between-steps gap
    for t, ev, _rid, n in events[i:j]:
        counts[ev] += 1
        if ev == "done_store":
            last_store_done = t
        elif ev == "fwd_start":  # the worker's step marks: host time launching a forward
            fwd_t = t
            counts.setdefault("first_fwd_after_submit_ms", (t - t0) * 1e3)
            if end_t is not None:  # the engine thread outside the worker between steps
                g = (t - end_t) * 1e3
                counts["gap_ms"] += g
                counts["gap_max_ms"] = max(counts["gap_max_ms"], g)
                end_t = None
        elif ev == "fwd_end" and fwd_t is not None:
            d = (t - fwd_t) * 1e3
            counts["launch_ms"] += d
            counts["launch_max_ms"] = max(counts["launch_max_ms"], d)
            fwd_t = None
            end_t = t
        elif ev == "direct_done":  # a DRAM hit copied by the worker thread
            counts["direct_done_ms"] = (t - t0) * 1e3
        elif ev == "direct_issued":  # how long issuing that copy held the worker thread
            counts["direct_issue_ms"] = max(counts["direct_issue_ms"], n / 1e3)
        elif ev == "direct_ops":  # that copy's descriptors (one per block when they did
            counts["direct_ops"] = max(counts["direct_ops"], n)  # not coalesce)
        elif ev == "gil_late":  # the probe thread waited that long for the GIL
            counts["gil_late_max_ms"] = max(counts["gil_late_max_ms"], n / 1e3)
        elif ev == "direct_copy":  # that copy's own GPU time (CUDA timing events)
            counts["direct_copy_ms"] = max(counts["direct_copy_ms"], n / 1e3)
        elif ev == "gc":  # a garbage collection (any thread; it holds the GIL throughout)
            counts["gc_max_ms"] = max(counts["gc_max_ms"], n / 1e3)
        elif ev == "write_done":
            counts["written_mb"] += n / 2**20
        elif ev == "claim_copy":  # a promotion copying a staged block (GIL released)
            counts["claim_copy_ms"] += n / 1e3
    counts["last_store_done_before_token_ms"] = (
        (t1 - last_store_done) * 1e3 if last_store_done is not None else -1)
    return dict(counts)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def load_jobs(events: list, t_base: float) -> list[dict]:
    """The load jobs of one engine's trace (see the module doc, ``--loads``), in the
    order they reached the reactor; times in ms from ``t_base``."""
    jobs: dict = {}
    order: list = []
    reads: list[float] = []  # start time of every disk read, in order (events are sorted)
    for t, ev, rid, n in events:
        if ev == "load":
            key = str(rid)
            if key not in jobs:
                order.append(key)
            jobs[key] = {"job": key, "chunks": n, "submit_ms": (t - t_base) * 1e3,
                         "first_read_ms": None, "last_read_ms": None, "done_ms": None,
                         "reads": 0}
        elif ev in ("read_start", "read_done", "done_load"):
            j = jobs.get(str(rid))
            if j is None:
                continue
            ms = (t - t_base) * 1e3
            if ev == "read_start":
                j["reads"] += 1
                if j["first_read_ms"] is None:
                    j["first_read_ms"] = ms
                reads.append(ms)
            elif ev == "read_done":
                j["last_read_ms"] = ms
            else:
                j["done_ms"] = ms
    out = []
    for key in order:
        j = jobs[key]
        lo, hi = j["first_read_ms"], j["last_read_ms"]
        # every read of the job itself starts inside its window: the rest are others'
        j["others"] = (0 if lo is None or hi is None else
                       bisect.bisect_right(reads, hi) - bisect.bisect_left(reads, lo)
                       - j["reads"])
        out.append(j)
    return out


def print_loads(data: dict, summary: bool = False) -> list[dict]:
    rows = []
    for name, (reqs, events) in data.items():
        t_base = min((q[2] for q in reqs), default=events[0][0] if events else 0.0)
        jobs = load_jobs(events, t_base)
        rows += [{"engine": name, **j} for j in jobs]
        if summary:
            print_summary(name, reqs, jobs, t_base)
            continue
        ttfts = sorted((q[3] - q[2]) * 1e3 for q in reqs)
        print(f"== {name}: {len(jobs)} load jobs, {sum(j['reads'] for j in jobs)} disk "
              f"reads; first tokens (ms, sorted): "
              + " ".join(f"{x:.0f}" for x in ttfts[:12]) + (" ..." if len(ttfts) > 12 else ""))
        print(f"{'job':>18} {'chunks':>6} {'submit':>8} {'1st read':>8} {'last read':>9} "
              f"{'done':>8} {'reads':>5} {'others':>6}")
        for j in jobs:
            print(f"{j['job'][:18]:>18} {j['chunks']:>6} {_ms(j['submit_ms']):>8} "
                  f"{_ms(j['first_read_ms']):>8} {_ms(j['last_read_ms']):>9} "
                  f"{_ms(j['done_ms']):>8} "
                  f"{j['reads']:>5} {j['others']:>6}")
    return rows


def print_summary(name: str, reqs: list, jobs: list[dict], t_base: float) -> None:
    """``--loads --summary``: one engine's load jobs in a few lines (see module doc)."""
    readers = [j for j in jobs if j["reads"]]
    if not jobs:
        print(f"== {name}: no load jobs")
        return
    others = sorted(j["others"] for j in readers) or [0]
    print(f"== {name}: {len(jobs)} load jobs, {len(readers)} read from disk "
          f"({sum(j['reads'] for j in readers)} reads), others median "
          f"{others[len(others) // 2]} max {others[-1]}")
    first = readers[:10]
    for label, k in (("submit", "submit_ms"), ("1st read", "first_read_ms"),
                     ("last read", "last_read_ms"), ("done", "done_ms")):
        print(f"  {label:>9}: " + " ".join(_ms(j[k]) for j in first))
    toks = [(q[3] - t_base) * 1e3 for q in sorted(reqs, key=lambda q: q[2])[:10]]
    print("  1st token: " + " ".join(f"{x:.0f}" for x in toks) + "  (first 10 requests)")


def engine_stalls(reqs: list, events: list, min_ms: float = 200.0) -> dict:
    """The ``--stalls`` rows of one engine (see the module doc); times in ms from its
    first non-warm-up request's submit."""
    subs = [q[2] for q in reqs if q[0] != "warm"] or [q[2] for q in reqs]
    t_base = min(subs) if subs else (events[0][0] if events else 0.0)
    ends = [t for t, ev, _, _ in events if ev == "fwd_end"]
    starts = [t for t, ev, _, _ in events if ev == "fwd_start"]
    gaps = []
    for t in ends:
        if t < t_base:
            continue
        i = bisect.bisect_right(starts, t)
        nxt = starts[i] if i < len(starts) else None
        if nxt is not None and (nxt - t) * 1e3 > min_ms:
            gaps.append((t, nxt))
    rd = sorted((t, 1 if ev == "read_start" else -1) for t, ev, _, _ in events
                if ev in ("read_start", "read_done"))
    done_loads = [t for t, ev, _, _ in events if ev == "done_load"]
    samples = [(t, rid) for t, ev, rid, _ in events if ev == "stall_stack"]
    faults = [(t, n) for t, ev, _, n in events if ev == "majflt"]
    toks = sorted(q[3] for q in reqs if q[0] != "warm")
    rows = []
    for a, b in gaps:
        cur, prev, area = 0, None, 0.0
        for t, d in rd:
            if prev is not None and t > a:
                area += cur * (min(t, b) - max(prev, a))
            if t >= b:
                break
            cur += d
            prev = t
        if prev is not None and prev < b:
            area += cur * (b - max(prev, a))
        n_reads = sum(1 for t, d in rd if d < 0 and a <= t < b)
        seen: dict[str, int] = defaultdict(int)
        for t, stack in samples:
            if a <= t < b:
                seen[str(stack)] += 1
        rows.append({"start_ms": (a - t_base) * 1e3, "ms": (b - a) * 1e3,
                     "reads_in_flight": area / (b - a),
                     "reads_done": n_reads,
                     "loads_done": sum(1 for t in done_loads if a <= t < b),
                     "tokens_after": bisect.bisect_right(toks, b + 1.0)
                     - bisect.bisect_left(toks, b),
                     "major_faults": sum(n for t, n in faults if a <= t < b + 0.1),
                     "py_stacks": [{"n": n, "stack": k} for k, n in
                                   sorted(seen.items(), key=lambda kv: -kv[1])]})
    return {"stalls": rows, "t_base": t_base, "stalled_ms": sum(r["ms"] for r in rows),
            "span_ms": ((max(toks) if toks else t_base) - t_base) * 1e3}


def read_stacks(path: str, thread: str = "MainThread", depth: int = 8
                ) -> list[tuple[float, int, tuple[str, ...]]]:
    """``(time, pid, innermost frames)`` of ``thread`` in every dump of a
    ``stack_sampler.py`` file (py-spy ``dump`` text: ``Thread N (state): "name"`` lines,
    frames indented below, innermost first)."""
    out: list[tuple[float, int, tuple[str, ...]]] = []
    t, pid, frames, inside = 0.0, 0, [], False

    def flush() -> None:
        if inside and frames:
            out.append((t, pid, tuple(frames[:depth])))

    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("=== "):
                flush()
                parts = line.split()
                t, pid, frames, inside = float(parts[1]), int(parts[2]), [], False
            elif line.startswith("Thread "):
                flush()
                frames, inside = [], f'"{thread}"' in line
            elif inside and line.startswith("    ") and line.strip():
                frames.append(line.strip())
    flush()
    return out


def print_stalls(data: dict, min_ms: float, stacks: str | None = None) -> list[dict]:
    out = []
    dumps = read_stacks(stacks) if stacks else []
    for name, (reqs, events) in data.items():
        if not any(ev == "fwd_end" for _, ev, _, _ in events):
            continue
        st = engine_stalls(reqs, events, min_ms)
        print(f"== {name}: {len(st['stalls'])} engine stalls > {min_ms:.0f} ms, "
              f"{st['stalled_ms'] / 1e3:.1f} s of {st['span_ms'] / 1e3:.1f} s to the last "
              f"first token")
        if st["stalls"]:
            print(f"{'start ms':>9} {'ms':>7} {'reads in flight':>15} {'reads done':>10} "
                  f"{'loads done':>10} {'1st tokens <1s after':>20} {'page faults':>11}")
        t_base = st["t_base"]
        for r in st["stalls"]:
            print(f"{r['start_ms']:>9.0f} {r['ms']:>7.0f} {r['reads_in_flight']:>15.2f} "
                  f"{r['reads_done']:>10} {r['loads_done']:>10} {r['tokens_after']:>20} "
                  f"{r['major_faults']:>11}")
            for ps in r["py_stacks"][:3]:
                print(f"          {ps['n']} x (reactor trace) {ps['stack']}")
            if dumps:
                a = t_base + r["start_ms"] / 1e3
                b = a + r["ms"] / 1e3
                seen: dict[tuple[str, ...], int] = defaultdict(int)
                for t, _pid, fr in dumps:
                    if a <= t < b:
                        seen[fr] += 1
                r["stacks"] = [{"n": n, "frames": list(fr)} for fr, n in
                               sorted(seen.items(), key=lambda kv: -kv[1])]
                if not seen:
                    print("          (no main-thread stack sampled inside)")
                for fr, n in sorted(seen.items(), key=lambda kv: -kv[1])[:3]:
                    print(f"          {n} x " + " <- ".join(fr))
        out += [{"engine": name, **r} for r in st["stalls"]]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace_dir")
    ap.add_argument("--json", help="also write the per-request rows here")
    ap.add_argument("--loads", action="store_true",
                    help="per load job: submit, first/last disk read, done, interleaving")
    ap.add_argument("--summary", action="store_true",
                    help="with --loads: a few lines per engine instead of every job")
    ap.add_argument("--stalls", action="store_true",
                    help="per engine: gaps between engine steps longer than --stall-ms")
    ap.add_argument("--stall-ms", type=float, default=200.0)
    ap.add_argument("--stacks", help="with --stalls: stack_sampler.py output to match")
    a = ap.parse_args(argv)
    data = load(a.trace_dir)
    if not data:
        print(f"no *.requests.json under {a.trace_dir}", file=sys.stderr)
        return 2
    if a.stalls:
        rows = print_stalls(data, a.stall_ms, a.stacks)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    if a.loads:
        rows = print_loads(data, a.summary)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    rows = []
    for name, (reqs, events) in data.items():
        times = [e[0] for e in events]
        print(f"== {name}: {len(reqs)} requests, {len(events)} reactor events")
        print(f"{'request':>16} {'tokens':>7} {'ttft ms':>9} {'stores':>6} {'copied':>6} "
              f"{'st done':>7} {'loads':>5} {'ld done':>7} {'last st->tok ms':>15} "
              f"{'steps':>5} {'launch ms':>9} {'max':>6} {'1st fwd ms':>10} {'wr MB':>7} "
              f"{'issue ms':>8} {'descs':>6} {'copy ms':>7} {'GIL wait':>8} {'gc ms':>6} "
              f"{'claim ms':>8} {'gap ms':>7} {'gap max':>7}")
        for rid, n_tok, t0, t1 in reqs:
            w = window(events, times, t0, t1)
            row = {"engine": name, "request": rid, "tokens": n_tok, "ttft_ms": (t1 - t0) * 1e3,
                   **w}
            rows.append(row)
            print(f"{rid:>16} {n_tok:>7} {row['ttft_ms']:>9.1f} {w.get('store', 0):>6} "
                  f"{w.get('store_copied', 0):>6} {w.get('done_store', 0):>7} "
                  f"{w.get('load', 0):>5} {w.get('done_load', 0):>7} "
                  f"{w['last_store_done_before_token_ms']:>15.1f} {w.get('fwd_start', 0):>5} "
                  f"{w.get('launch_ms', 0):>9.1f} {w.get('launch_max_ms', 0):>6.1f} "
                  f"{w.get('first_fwd_after_submit_ms', -1):>10.1f} "
                  f"{w.get('written_mb', 0):>7.0f} {w.get('direct_issue_ms', 0):>8.1f} "
                  f"{w.get('direct_ops', 0):>6} {w.get('direct_copy_ms', 0):>7.1f} "
                  f"{w.get('gil_late_max_ms', 0):>8.1f} {w.get('gc_max_ms', 0):>6.1f} "
                  f"{w.get('claim_copy_ms', 0):>8.1f} {w.get('gap_ms', 0):>7.1f} "
                  f"{w.get('gap_max_ms', 0):>7.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
