"""The scheduler side of the vLLM glue imports nothing of the worker side (the I/O
reactor, the KV copier, the worker): shared flags live in kvcache_core.flags."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

REPO = __file__.rsplit("/tests/", 1)[0]


def test_scheduler_side_does_not_import_the_worker_side():
    pytest.importorskip("vllm")
    code = ("import json, sys; import kvcache_core.vllm.manager; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('kvcache_core'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=True, timeout=120).stdout
    loaded = set(json.loads(out.strip().splitlines()[-1]))
    assert "kvcache_core.vllm.manager" in loaded
    worker_side = {"kvcache_core.reactor", "kvcache_core.vllm.worker",
                   "kvcache_core.vllm.transfer", "kvcache_core.io.uring", "kvcache_core.copy"}
    assert not loaded & worker_side, sorted(loaded & worker_side)
