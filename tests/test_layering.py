"""The scheduler side of the vLLM glue imports nothing of the worker side (the I/O
reactor, the KV copier, the worker): shared flags live in kvcache_core.flags. The
connector facade imports the worker side only when it builds a worker-role connector."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

REPO = __file__.rsplit("/tests/", 1)[0]

#: the engine-core process's modules, imported in this order (each one's imports add up)
SCHEDULER_SIDE = ("kvcache_core.vllm.manager", "kvcache_core.vllm.connector_scheduler",
                  "kvcache_core.vllm.connector")


def test_scheduler_side_does_not_import_the_worker_side():
    pytest.importorskip("vllm")
    code = ("import importlib, json, sys\n"
            "out = {}\n"
            f"for name in {SCHEDULER_SIDE!r}:\n"
            "    importlib.import_module(name)\n"
            "    out[name] = sorted(m for m in sys.modules if m.startswith('kvcache_core'))\n"
            "print(json.dumps(out))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=True, timeout=120).stdout
    loaded_after = json.loads(out.strip().splitlines()[-1])
    worker_side = {"kvcache_core.reactor", "kvcache_core.vllm.worker",
                   "kvcache_core.vllm.connector_worker", "kvcache_core.vllm.transfer",
                   "kvcache_core.io.uring", "kvcache_core.copy"}
    for name in SCHEDULER_SIDE:  # the first one to load a worker-side module is named
        loaded = set(loaded_after[name])
        assert name in loaded
        assert not loaded & worker_side, (name, sorted(loaded & worker_side))
