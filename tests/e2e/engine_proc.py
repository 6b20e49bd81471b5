"""One engine in a fresh process, driven by a JSON plan (used by the e2e tests).

    python -m tests.e2e.engine_proc '<plan JSON>'

plan: ``model_dir``, ``extra`` (kv_connector_extra_config or null), ``tp``, ``llm_kwargs``
(more ``LLM(...)`` arguments, optional), ``out`` (JSON result path) and ``steps``:
``{"op": "generate", "prompt": "A", "tag": "a1"}`` (or ``"tokens": [ids]`` for a prompt
not in ``H.PROMPTS``), ``{"op": "generate_many", "prompts":
["A", "B"], "priority": [0, 1] (optional), "tag": T}`` (submitted at once),
``{"op": "drain"}``, ``{"op": "reset_prefix_cache"}`` (vLLM's GPU prefix cache),
``{"op": "signal", "path": P}`` (create a file),
``{"op": "wait_for", "path": P}``, ``{"op": "stats", "tag": T}``, ``{"op":
"record_preloads"}`` (from then on, each call of the connector's preload hook is recorded
in ``preload_calls`` as a list of [request id, priority]), ``{"op": "disk_stores", "on":
false}`` (the manager stops writing files, as a break-even table whose disk never pays
makes it) and ``{"op": "env"}`` (``env``:
the vLLM and torch versions, py-kvcache's release line for it, whether vLLM is patched).
With ``"expect_error": [extra, ...]`` it instead builds one engine per extra config,
expecting each to fail, and records the error messages.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

from tests.e2e import helpers as H

for _k, _v in H.ENV.items():
    os.environ.setdefault(_k, _v)


def main() -> int:
    plan = json.loads(sys.argv[1])
    res: dict = {"results": {}, "stats": {}, "pid": os.getpid()}
    if "expect_error" in plan:
        errors = []
        for extra in plan["expect_error"]:
            try:
                llm = H.make_llm(plan["model_dir"], extra, tp=plan.get("tp", 1))
            except BaseException as e:  # noqa: BLE001 - we record whatever vLLM raised
                chain, cur = [], e
                while cur is not None:
                    chain.append(f"{type(cur).__name__}: {cur}")
                    cur = cur.__cause__ or cur.__context__
                errors.append(" <- ".join(chain))
            else:
                errors.append(None)
                H.shutdown(llm)
        res["errors"] = errors
        with open(plan["out"], "w") as f:
            json.dump(res, f)
        return 0
    t0 = time.perf_counter()
    llm = H.make_llm(plan["model_dir"], plan.get("extra"), tp=plan.get("tp", 1),
                     **plan.get("llm_kwargs", {}))
    res["start_s"] = round(time.perf_counter() - t0, 2)
    try:
        for step in plan["steps"]:
            op = step["op"]
            if op == "generate":
                t = time.perf_counter()
                r = H.generate(llm, H.PROMPTS[step["prompt"]] if "prompt" in step
                               else step["tokens"])
                r["s"] = round(time.perf_counter() - t, 3)
                res["results"][step["tag"]] = r
            elif op == "generate_many":
                res["results"][step["tag"]] = H.generate_many(
                    llm, [H.PROMPTS[n] for n in step["prompts"]], step.get("priority"))
            elif op == "record_preloads":
                _record_preloads(llm, res.setdefault("preload_calls", []))
            elif op == "env":
                res["env"] = _env()
            elif op == "drain":
                H.drain(llm)
            elif op == "reset_prefix_cache":
                H.reset_prefix_cache(llm)
            elif op == "signal":
                with open(step["path"], "w") as f:
                    f.write(str(os.getpid()))
            elif op == "wait_for":
                end = time.monotonic() + step.get("timeout", 180)
                while not os.path.exists(step["path"]):
                    if time.monotonic() > end:
                        raise TimeoutError(step["path"])
                    time.sleep(0.05)
            elif op == "disk_stores":  # the manager writes files (False: DRAM tier only)
                H.manager(llm).disk_stores = bool(step["on"])
            elif op == "stats":
                res["stats"][step["tag"]] = H.manager(llm).stats() \
                    if plan.get("extra") is not None else {}
            else:
                raise ValueError(op)
    except BaseException:
        res["error"] = traceback.format_exc()
        raise
    finally:
        if plan.get("extra") is not None:
            try:
                res["stats"]["final"] = H.manager(llm).stats()
            except Exception:  # noqa: BLE001
                pass
        H.shutdown(llm)
        with open(plan["out"], "w") as f:
            json.dump(res, f)
    return 0


def _record_preloads(llm, calls: list) -> None:
    """Record every call of the scheduler connector's ``on_preload_candidates`` (called by
    the patched scheduler) as ``[[request id, priority], ...]``, then run it."""
    conn = H.scheduler_connector(llm)
    orig = conn.on_preload_candidates

    def record(requests):
        calls.append([[r.request_id, r.priority] for r in requests])
        orig(requests)

    conn.on_preload_candidates = record


def _env() -> dict:
    import torch
    import vllm

    from kvcache_core.patching import is_patched
    from kvcache_core.vllm import compat

    return {"vllm": vllm.__version__, "torch": torch.__version__, "line": compat.require(),
            "patched": is_patched(), "python": sys.executable}


if __name__ == "__main__":
    sys.exit(main())
