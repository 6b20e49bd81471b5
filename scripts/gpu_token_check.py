#!/usr/bin/env python3
"""Token check of py-kvcache hits on a GPU machine (CUDA): the e2e tests' tiny Llama
with real random weights (``tests/e2e/helpers.write_model``: output depends on the KV),
greedy, 8 output tokens, logprobs; each engine in its own process (``tests/e2e/engine_proc``).

For each ``gpu_kv_layout`` (``cross_layer``, ``per_layer``):
- ``dram``: one engine stores every prompt, then serves each again from its DRAM tier;
- ``disk``: a fresh engine (no DRAM tier) on the same root serves each from the files
  the first one wrote.
Every output is compared with a plain recompute engine (no connector): tokens must be
identical, logprobs within ``--tol``, and a hit must have come from the cache
(``num_cached_tokens`` > 0). Exit status 1 on any mismatch; ``--json`` keeps the rows.

The CPU test of the same code path is ``tests/e2e/test_kv_layout.py``; this script is
what runs it for real on CUDA (``scripts/h200_runs.sh tokcheck``).

    python3 scripts/gpu_token_check.py --json /tmp/res/tokcheck.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

#: prompts: the e2e tests' three, and two longer ones (more blocks per request)
EXTRA_PROMPTS = {
    "L1": [(i * 48271 + 11) % 3900 + 100 for i in range(3000)],
    "L2": [(i * 69621 + 5) % 3900 + 100 for i in range(1800)],
}


def prompts() -> dict[str, list[int]]:
    from tests.e2e import helpers as H

    return {**H.PROMPTS, **EXTRA_PROMPTS}


def run_engine(model: str, extra: dict | None, passes: int, timeout: float
               ) -> list[dict[str, dict]]:
    """One engine in its own process (the e2e tests' ``engine_proc``): every prompt,
    ``passes`` times, drained after each when there is a connector. Per pass: outputs
    by prompt name."""
    from tests.e2e import helpers as H

    ps = prompts()
    names = list(ps)
    steps: list[dict[str, Any]] = []
    for p in range(passes):
        for n in names:
            steps.append({"op": "generate", "tokens": ps[n], "tag": f"{p}:{n}"})
            if extra is not None:
                steps.append({"op": "drain"})
    res = H.run_proc({"model_dir": model, "extra": extra, "steps": steps,
                      "llm_kwargs": {"max_model_len": 4096, "gpu_memory_utilization": 0.2}},
                     timeout=timeout)["results"]
    return [{n: res[f"{p}:{n}"] for n in names} for p in range(passes)]


def compare(ref: dict, got: dict, tol: float, hit: bool) -> dict[str, Any]:
    dlp = max((abs(a - b) for a, b in zip(ref["logprobs"], got["logprobs"], strict=True)),
              default=0.0)
    ok = ref["tokens"] == got["tokens"] and dlp <= tol and (got["num_cached_tokens"] > 0
                                                           or not hit)
    return {"tokens_equal": ref["tokens"] == got["tokens"], "max_logprob_diff": dlp,
            "num_cached_tokens": got["num_cached_tokens"], "ok": ok}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="result rows (JSON)")
    ap.add_argument("--tol", type=float, default=0.1,
                    help="largest logprob difference accepted against recompute (bf16: a "
                         "cached prefix and a computed one run different kernels; the e2e "
                         "tests' SPLIT_LOGPROB_TOL, and vLLM's own GPU prefix cache differs "
                         "by up to 0.06 on the CPU machine); tokens must be identical")
    ap.add_argument("--layouts", default="cross_layer,per_layer")
    ap.add_argument("--timeout", type=float, default=300, help="per engine process (s)")
    a = ap.parse_args(argv)
    from tests.e2e import helpers as H

    work = tempfile.mkdtemp(prefix="tokcheck_")
    model = H.write_model(os.path.join(work, "tiny-llama"))
    ref = run_engine(model, None, 1, a.timeout)[0]
    tokens = {n: len(p) for n, p in prompts().items()}
    rows: list[dict[str, Any]] = []
    for layout in [x for x in a.layouts.split(",") if x]:
        root = os.path.join(work, f"cache-{layout}")
        dram = H.extra_config(root, dram_cache_bytes=64 * H.FILE_BYTES,
                              staging_bytes=64 * H.FILE_BYTES, gpu_kv_layout=layout)
        first = run_engine(model, dram, 2, a.timeout)
        disk = H.extra_config(root, dram_cache_bytes=0, staging_bytes=64 * H.FILE_BYTES,
                              gpu_kv_layout=layout)
        again = run_engine(model, disk, 1, a.timeout)
        for tier, res, hit in (("store", first[0], False), ("dram", first[1], True),
                               ("disk", again[0], True)):
            for name, got in res.items():
                rows.append({"layout": layout, "tier": tier, "prompt": name,
                             "prompt_tokens": tokens[name],
                             **compare(ref[name], got, a.tol, hit)})
                print(json.dumps(rows[-1]), flush=True)
    bad = [r for r in rows if not r["ok"]]
    summary = {"rows": rows, "n": len(rows), "failed": len(bad), "tol": a.tol,
               "machine": os.environ.get("MACHINE", "")}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    print(f"token check: {len(rows) - len(bad)}/{len(rows)} ok"
          + (f"; FAILED: {[(r['layout'], r['tier'], r['prompt']) for r in bad]}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
