#!/usr/bin/env python3
"""Token check of py-kvcache hits on a GPU machine (CUDA): the e2e tests' tiny Llama
with real random weights (``tests/e2e/helpers.write_model``: output depends on the KV),
greedy, 8 output tokens, logprobs; each engine in its own process.

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
import subprocess
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


def child(plan: dict[str, Any]) -> dict[str, Any]:
    """One engine: every prompt once (``passes`` times), drained in between."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from tests.e2e import helpers as H

    extra = plan.get("extra")
    llm = H.make_llm(plan["model"], extra, max_model_len=4096,
                     gpu_memory_utilization=0.2)
    out: dict[str, Any] = {"passes": []}
    try:
        for _ in range(plan.get("passes", 1)):
            res = {}
            for name, p in prompts().items():
                res[name] = H.generate(llm, p)
                if extra is not None:
                    H.drain(llm)
            out["passes"].append(res)
    finally:
        H.shutdown(llm)
    return out


def run_child(plan: dict[str, Any], timeout: float) -> dict[str, Any]:
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCHDYNAMO_DISABLE="1")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, __file__, "--child", json.dumps(plan), "--out", path],
                       env=env, timeout=timeout, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"engine process failed (rc={r.returncode}):\n{r.stderr[-4000:]}")
    with open(path) as f:
        return json.load(f)


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
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        res = child(json.loads(a.child))
        with open(a.out, "w") as f:
            json.dump(res, f)
        return 0

    from tests.e2e import helpers as H

    work = tempfile.mkdtemp(prefix="tokcheck_")
    model = H.write_model(os.path.join(work, "tiny-llama"))
    ref = run_child({"model": model, "extra": None}, a.timeout)["passes"][0]
    rows: list[dict[str, Any]] = []
    for layout in [x for x in a.layouts.split(",") if x]:
        root = os.path.join(work, f"cache-{layout}")
        dram = H.extra_config(root, dram_cache_bytes=64 * H.FILE_BYTES,
                              staging_bytes=64 * H.FILE_BYTES, gpu_kv_layout=layout)
        first = run_child({"model": model, "extra": dram, "passes": 2}, a.timeout)
        disk = H.extra_config(root, dram_cache_bytes=0, staging_bytes=64 * H.FILE_BYTES,
                              gpu_kv_layout=layout)
        again = run_child({"model": model, "extra": disk}, a.timeout)
        for tier, res, hit in (("store", first["passes"][0], False),
                               ("dram", first["passes"][1], True),
                               ("disk", again["passes"][0], True)):
            for name, got in res.items():
                rows.append({"layout": layout, "tier": tier, "prompt": name,
                             "prompt_tokens": len(prompts()[name]),
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
