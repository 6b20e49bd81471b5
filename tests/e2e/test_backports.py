"""The plugin's backport of an upstream fix to vLLM 0.26's offloading scheduler
(:mod:`kvcache_core.vllm.backports`): with vLLM's native tiered offload (CPU primary tier +
FS tier, run on the CPU platform by :mod:`tests.e2e.native_tiering_cpu`), concurrent
requests whose stores the small primary tier refuses kill vLLM 0.26.0's EngineCore with a
``KeyError`` in ``TieringOffloadingManager.prepare_store`` (vllm-project/vllm#49635); with
the backport (installed by py-kvcache's ``vllm.general_plugins`` entry point in every vLLM
process) the same engine serves all rounds, every final store comes before its request's
finish signal, and the FS tier gets files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvcache_core.vllm import backports

from . import helpers as H


def _run(model_dir: str, tmp_path, env: dict[str, str]) -> dict:
    root, out = str(tmp_path / "fs"), str(tmp_path / "out.json")
    e = dict(os.environ)
    e.update(H.ENV)
    e.update(env)
    e["PYTHONPATH"] = H.REPO + os.pathsep + e.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-m", "tests.e2e.native_tiering_cpu", model_dir, root,
                        out], cwd=H.REPO, env=e, capture_output=True, text=True, timeout=300)
    assert os.path.exists(out), f"rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    with open(out) as f:
        res = json.load(f)
    res["files"] = sum(len(fs) for _, _, fs in os.walk(root))
    return res


def test_native_tiered_offload_survives_a_refused_store_with_the_backport(model_dir, tmp_path):
    res = _run(model_dir, tmp_path, {})
    assert res["error"] is None, res
    assert res["rounds"] == 3
    assert res["late_stores"] == []  # prepare_store of a request before its finish signal
    # each request's finish signal sent once, or (the last round's) waiting for the next
    # step, which the engine is told to take
    assert res["finished"] + res["waiting_signals"] == 9
    assert res["finished"] >= 6
    assert res["pending_push_work"] is (res["waiting_signals"] > 0)
    assert res["files"] > 0  # the FS tier wrote what the primary tier took


def test_without_the_backport_vllm_0260_dies_of_its_keyerror(model_dir, tmp_path):
    res = _run(model_dir, tmp_path, {backports.ENV: "0"})
    assert res["rounds"] < 3, res
    assert res["late_stores"], res  # a store built after the request was finalized
    assert "KeyError" in (res["error"] or "") or "EngineDeadError" in (res["error"] or ""), res


def test_install_only_on_0_26_and_idempotent(monkeypatch):
    assert backports.install("0.32.0") is False
    assert backports.install("0.27.0") is False
    assert backports.install("0.26.0") is True
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler as S,
    )
    wrapped = S.request_finished
    assert backports.install("0.26.0") is True
    assert S.request_finished is wrapped  # not wrapped twice
    monkeypatch.setenv(backports.ENV, "0")
    assert backports.install("0.26.0") is False
